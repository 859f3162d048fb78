"""What SpecForge 0.2.0's ``specforge train`` consumer needs from hsx's feeder beyond refs and features:
the run's finite schedule, and the data of every epoch (docs/streaming.md, "SpecForge's own stream").

SpecForge's online consumer (``deployment.mode: disaggregated``, ``training.role: consumer``; its
``training/disaggregated.py``, ``_read_online_total_steps``) waits for the producer-owned record
``<channel>.schedule.json`` (or the channel's ``.failed``), checks ``version``, ``prompt_epochs``,
``prompt_seed``, ``dp_size``, ``batch_size`` and ``accumulation_steps`` against its own config, and trains
``total_steps`` optimizer steps from one stream of refs. Its own producer writes the record from the same
run YAML, with ``total_steps = num_prompts * prompt_epochs // (dp_size * batch_size * accumulation_steps)``
(``training/schedule.py``), and replays the prompts ``prompt_epochs`` times, epoch ``e`` in the order of
``random.Random(prompt_seed + e).shuffle`` (``launch.py``, ``_epoch_prompt_indices``).

hsx does the same from the trainer's YAML (:func:`read_trainer_config`), so the checked fields agree by
construction; what only the feeder knows is ``num_prompts``, from the job. hsx's epochs are in the job's
dataset: each conversation once per epoch, each epoch in SpecForge's order (:func:`write_epochs`), so the
job's samples are the consumer's whole stream and a ``consume`` job deletes each as it is trained on.
SpecForge is not imported here (the feeder runs where it is not installed).

    python -m hsx.integrations.specforge.schedule epochs TRAIN.jsonl OUT.jsonl --specforge-config run.yaml
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEDULE_SUFFIX = ".schedule.json"  # specforge.training.disaggregated._ONLINE_SCHEDULE_SUFFIX
SCHEDULE_VERSION = 1
# SpecForge 0.2.0's defaults (config/schema.py) for the fields the schedule carries.
DEFAULT_SEED = 42
DEFAULT_RUN_ID = "specforge-run"


class TrainerConfigError(ValueError):
    """The trainer's YAML cannot describe a consumer of hsx's stream."""


@dataclass(frozen=True)
class TrainerRun:
    """What the feeder takes from the trainer's run YAML: the schedule's fields and where the stream is."""

    epochs: int
    prompt_seed: int
    dp_size: int
    batch_size: int
    accumulation_steps: int
    # training.total_steps or max_steps: the consumer then reads no schedule record (it trains that many).
    fixed_horizon: bool
    store_id: str
    channel: Path | None = None  # <control_dir>/refs.jsonl, as SpecForge's launcher derives it
    backend: str | None = None
    store_root: Path | None = None
    mooncake_master: str | None = None
    mooncake_metadata: str | None = None
    mooncake_host: str | None = None

    @property
    def quantum(self) -> int:
        """Refs per global optimizer step: the consumer dispatches only whole windows of these."""
        return self.dp_size * self.batch_size * self.accumulation_steps


def _positive(section: dict[str, Any], key: str, default: int, where: str) -> int:
    value = section.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TrainerConfigError(f"{where}.{key} must be a positive integer, got {value!r}")
    return value


def _section(raw: dict[str, Any], key: str) -> dict[str, Any]:
    value = raw.get(key) or {}
    if not isinstance(value, dict):
        raise TrainerConfigError(f"{key} must be a mapping, got {type(value).__name__}")
    return value


def read_trainer_config(path: Path) -> TrainerRun:
    """The consumer's run YAML (or JSON), read with SpecForge 0.2.0's defaults for what it leaves out."""
    import yaml

    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise TrainerConfigError(f"cannot read the trainer's config {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise TrainerConfigError(f"{path} is not a SpecForge run config (no mapping at its top)")
    training, data, deployment = _section(raw, "training"), _section(raw, "data"), _section(raw, "deployment")
    if data.get("hidden_states_path"):
        raise TrainerConfigError(
            f"{path} sets data.hidden_states_path: SpecForge reads such a run offline, from a manifest, "
            "not from a stream"
        )
    if deployment.get("mode") != "disaggregated":
        raise TrainerConfigError(
            f"{path}: SpecForge trains from a producer's stream only with deployment.mode: disaggregated "
            f"(got {deployment.get('mode', 'local_colocated')!r})"
        )
    trainer, disagg = _section(deployment, "trainer"), _section(deployment, "disaggregated")
    if disagg.get("backend") != "mooncake":
        # config/schema.py: "online disaggregated training requires deployment.disaggregated.backend=
        # mooncake"; its online consumer opens a Mooncake store whatever DISAGG_BACKEND says.
        raise TrainerConfigError(
            f"{path}: SpecForge 0.2.0's online consumer reads features from Mooncake only "
            f"(deployment.disaggregated.backend: mooncake, got {disagg.get('backend')!r})"
        )
    seed = training.get("prompt_seed")
    if seed is None:
        seed = training.get("seed", DEFAULT_SEED)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TrainerConfigError(f"training.prompt_seed/seed must be an integer, got {seed!r}")
    control_dir = disagg.get("control_dir")
    return TrainerRun(
        epochs=_positive(training, "num_epochs", 1, "training"),
        prompt_seed=seed,
        dp_size=_positive(trainer, "nnodes", 1, "deployment.trainer")
        * _positive(trainer, "nproc_per_node", 1, "deployment.trainer"),
        batch_size=_positive(training, "batch_size", 1, "training"),
        accumulation_steps=_positive(training, "accumulation_steps", 1, "training"),
        fixed_horizon=training.get("total_steps") is not None or training.get("max_steps") is not None,
        store_id=str(disagg.get("store_id") or raw.get("run_id") or DEFAULT_RUN_ID),
        channel=Path(control_dir) / "refs.jsonl" if control_dir else None,
        backend=disagg.get("backend"),
        store_root=Path(disagg["store_root"]) if disagg.get("store_root") else None,
        mooncake_master=disagg.get("mooncake_master_server_addr"),
        mooncake_metadata=disagg.get("mooncake_metadata_server"),
        mooncake_host=disagg.get("mooncake_local_hostname"),
    )


def total_steps(run: TrainerRun, num_prompts: int) -> int:
    """SpecForge's ``resolve_online_total_steps``: whole global optimizer windows over every epoch."""
    steps = num_prompts * run.epochs // run.quantum
    if steps < 1:
        raise TrainerConfigError(
            f"{num_prompts} prompts x {run.epochs} epochs make no optimizer step of {run.quantum} refs "
            f"(dp_size {run.dp_size} x batch_size {run.batch_size} x accumulation_steps "
            f"{run.accumulation_steps})"
        )
    return steps


def schedule_record(run: TrainerRun, num_prompts: int) -> dict[str, Any]:
    """The record as SpecForge's ``_online_schedule_payload`` writes it."""
    return {
        "version": SCHEDULE_VERSION,
        "total_steps": total_steps(run, num_prompts),
        "num_prompts": num_prompts,
        "prompt_epochs": run.epochs,
        "prompt_seed": run.prompt_seed,
        "dp_size": run.dp_size,
        "batch_size": run.batch_size,
        "accumulation_steps": run.accumulation_steps,
    }


# The torch dtype the feeder's tensors have for each manifest dtype (fp8 comes dequantized to bfloat16).
FEATURE_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F8_E4M3": "bfloat16"}
# SpecForge 0.2.0's TargetHead.from_pretrained moves the head to bfloat16 whatever model.torch_dtype says.
TARGET_HEAD_DTYPE = "bfloat16"


def dtype_problem(manifest_dtype: str) -> str | None:
    """SpecForge's online consumer hands the target state as it comes to its bfloat16 target head
    (``_prepare_eagle_target``: ``target_head(target.to(device))``): another dtype fails its first
    optimizer step with a matmul dtype error, so say it before the trainer starts instead."""
    got = FEATURE_DTYPES.get(manifest_dtype, manifest_dtype)
    if got == TARGET_HEAD_DTYPE:
        return None
    return (
        f"the job's states are {got} ({manifest_dtype}), and SpecForge 0.2.0's online consumer hands them "
        f"unconverted to its {TARGET_HEAD_DTYPE} target head: capture in {TARGET_HEAD_DTYPE} (the engine's "
        "--dtype)"
    )


def schedule_path(channel: Path) -> Path:
    return channel.with_name(channel.name + SCHEDULE_SUFFIX)


def num_prompts(run: TrainerRun, samples_total: int, prompts: int | None) -> int:
    """The prompts behind a job of ``samples_total`` samples that holds each prompt once per epoch. With
    more than one epoch the caller must say how many prompts there are: a job of 2,400 samples is 2,400
    prompts once or 1,200 twice, and only the one who built the dataset knows which."""
    if prompts is None:
        if run.epochs > 1:
            raise TrainerConfigError(
                f"the trainer's config asks for {run.epochs} epochs; give --prompts (the distinct "
                f"conversations: the job's dataset must hold each {run.epochs} times, as "
                "`python -m hsx.integrations.specforge.schedule epochs` writes it)"
            )
        return samples_total
    if prompts * run.epochs != samples_total:
        raise TrainerConfigError(
            f"the job holds {samples_total} samples, not {prompts} prompts x {run.epochs} epochs "
            f"= {prompts * run.epochs}: its dataset is not the trainer's epochs"
        )
    return prompts


def epoch_order(n: int, epoch: int, seed: int) -> list[int]:
    """SpecForge's ``_epoch_prompt_indices``: epoch ``epoch``'s order of ``n`` prompts."""
    indices = list(range(n))
    random.Random(int(seed) + int(epoch)).shuffle(indices)
    return indices


def write_epochs(src: Path, dst: Path, epochs: int, seed: int) -> int:
    """``src``'s rows once per epoch, each epoch in SpecForge's order; each row's ``id`` gets ``#e<epoch>``
    so that the job's samples stay distinct (as SpecForge mints an id per epoch). Returns the rows written."""
    rows = [json.loads(line) for line in src.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{src} holds no rows")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as out:
        for epoch in range(epochs):
            for index in epoch_order(len(rows), epoch, seed):
                row = dict(rows[index])
                row["id"] = f"{row.get('id', index)}#e{epoch}"
                out.write(json.dumps(row, ensure_ascii=False) + "\n")
    tmp.replace(dst)
    return len(rows) * epochs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hsx.integrations.specforge.schedule")
    sub = parser.add_subparsers(dest="command", required=True)
    ep = sub.add_parser("epochs", help="a job's dataset holding every conversation once per trainer epoch")
    ep.add_argument("src", type=Path)
    ep.add_argument("dst", type=Path)
    ep.add_argument("--specforge-config", type=Path, required=True, help="the trainer's run YAML")
    args = parser.parse_args(argv)
    try:
        run = read_trainer_config(args.specforge_config)
        written = write_epochs(args.src, args.dst, run.epochs, run.prompt_seed)
    except (TrainerConfigError, ValueError, OSError) as exc:
        print(f"specforge_schedule: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"rows": written, "prompts": written // run.epochs, "epochs": run.epochs}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
