"""The contract between ``hsx feed specforge`` and ``specforge train``'s own consumer (SpecForge 0.2.0,
``deployment.mode: disaggregated``, ``training.role: consumer``), checked with SpecForge's own code on
the trainer's side and the YAML ``scripts/device/drafter/streamed.sh`` writes: the schedule record the
consumer waits for (``_read_online_total_steps``), the epochs' order, where the stream is
(``build_launch_plan``), and that every mismatch is refused loudly rather than left waiting.
No stack: each test takes well under a second (the first import of SpecForge aside).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from hsx.integrations.specforge import feed_layout as layout
from hsx.integrations.specforge.feed_args import resolve_target
from hsx.integrations.specforge.feeder import SpecForgeFeeder
from hsx.integrations.specforge.schedule import (
    TrainerConfigError,
    read_trainer_config,
    schedule_path,
    schedule_record,
    write_epochs,
)

REPO = Path(__file__).resolve().parents[1]
STREAMED = REPO / "scripts" / "device" / "drafter" / "streamed.sh"


def streamed_config(tmp: Path, **overrides: str) -> Path:
    """The trainer's YAML exactly as ``streamed.sh`` writes it for the GPU run (the recipe's values)."""
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("DISAGG_", "MOONCAKE_"))},
        "W": str(tmp / "w"),
        "MODEL": str(tmp / "model"),
        "TRAIN_JSONL": str(tmp / "train.jsonl"),
        "VOCAB_MAPPING": str(tmp / "vocab_mapping.pt"),
        "DRAFT_CONFIG": str(REPO / "scripts" / "device" / "drafter" / "draft.json"),
        "EPOCHS": "2",
        "LR": "3e-4",
        "BATCH": "4",
        "MAXLEN": "1024",
        "SEED": "42",
        "PORT_BASE": "31000",
        **overrides,
    }
    cmd = ["bash", str(STREAMED), "config"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def specforge_config(path: Path) -> Any:
    from specforge.config import load_config

    return load_config(str(path))


def feeder_for(run: Any, prompts: int | None) -> SpecForgeFeeder:
    """The feeder as ``hsx feed specforge --specforge-config`` builds it (its API is never called here)."""
    assert run.channel is not None
    return SpecForgeFeeder(
        api_url="http://127.0.0.1:9",
        job_id="job-1",
        channel_path=run.channel,
        store_root=run.channel.parent,
        store_id=run.store_id,
        trainer=run,
        prompts=prompts,
    )


def test_the_feeders_schedule_is_specforges_and_its_consumer_trains_1200_steps(tmp_path: Path) -> None:
    """2,400 conversations x 2 epochs at batch 4: SpecForge's own producer would write this very record,
    and its consumer reads 1,200 steps from the one the feeder wrote."""
    from specforge.training.disaggregated import _online_schedule_payload, _read_online_total_steps

    yaml_path = streamed_config(tmp_path)
    cfg = specforge_config(yaml_path)
    deployment = cfg.deployment.disaggregated
    assert (cfg.mode, cfg.training.role, deployment.backend) == ("online", "consumer", "mooncake")
    run = read_trainer_config(yaml_path)
    assert schedule_record(run, 2400) == _online_schedule_payload(cfg, num_prompts=2400)

    feeder = feeder_for(run, prompts=2400)
    assert feeder._publish_schedule(run, 4800) is None  # the job: each conversation once per epoch
    assert run.channel is not None
    assert json.loads(schedule_path(run.channel).read_text())["total_steps"] == 1200
    assert _read_online_total_steps(cfg, str(run.channel)) == 1200
    assert feeder.required == 4800 and feeder.spare == 0


def test_the_stream_is_where_specforges_launcher_points_its_consumer(tmp_path: Path) -> None:
    from specforge.application import resolve_run
    from specforge.launch_plan import build_launch_plan

    yaml_path = streamed_config(tmp_path)
    resolved = resolve_run(specforge_config(yaml_path))
    plan = build_launch_plan(
        resolved.config,
        algorithm=resolved.algorithm,
        config_path=str(yaml_path),
        requested_role="consumer",
        env={},
    )
    args = argparse.Namespace(
        specforge_config=yaml_path, prompts=2400, job_id="job-1", channel=None, backend=None, store_id=None,
        store_root=None, mooncake_master=None, mooncake_metadata=None, mooncake_host=None,
    )  # fmt: skip
    target = resolve_target(args)
    env = plan.worker_env
    assert (plan.kind, plan.role) == ("worker", "consumer")
    assert str(target.channel) == env["DISAGG_REF_CHANNEL"]
    assert (target.backend, target.store_id) == (env["DISAGG_BACKEND"], env["DISAGG_STORE_ID"])
    assert target.mooncake_master == env["MOONCAKE_MASTER_SERVER_ADDR"]
    assert target.mooncake_metadata == env["MOONCAKE_METADATA_SERVER"]

    # An option that disagrees with the trainer's YAML would feed a channel the trainer never reads.
    with pytest.raises(TrainerConfigError, match="--channel is .* but .* in the trainer's config"):
        resolve_target(argparse.Namespace(**{**vars(args), "channel": tmp_path / "elsewhere.jsonl"}))


def test_a_trainer_config_other_than_the_feeders_is_refused_by_specforges_consumer(tmp_path: Path) -> None:
    """The feeder wrote its record for batch 4; a consumer configured for batch 8 raises at once."""
    from specforge.training.disaggregated import _read_online_total_steps

    run = read_trainer_config(streamed_config(tmp_path))
    assert feeder_for(run, prompts=2400)._publish_schedule(run, 4800) is None
    other = specforge_config(streamed_config(tmp_path / "other", BATCH="8"))
    assert run.channel is not None
    with pytest.raises(ValueError, match=r"does not match this consumer configuration.*batch_size.*\(4, 8\)"):
        _read_online_total_steps(other, str(run.channel))


@pytest.mark.parametrize(
    ("prompts", "expected"),
    [
        # the dataset is not repeated
        (2400, "the job holds 2400 samples, not 2400 prompts x 2 epochs = 4800"),
        (None, "give --prompts"),
    ],
)
def test_a_job_that_is_not_the_trainers_epochs_fails_the_waiting_consumer(
    tmp_path: Path, prompts: int | None, expected: str
) -> None:
    """The feeder refuses to guess (2,400 samples are 2,400 prompts once or 1,200 twice): it fails the
    channel instead of writing a schedule, and SpecForge's consumer, waiting for the record, raises with
    the feeder's reason (no timeout is set: it does not hang)."""
    from specforge.training.disaggregated import _read_online_total_steps

    yaml_path = streamed_config(tmp_path)
    run = read_trainer_config(yaml_path)
    reason = feeder_for(run, prompts)._publish_schedule(run, 2400)
    assert reason is not None and expected in reason
    assert run.channel is not None
    layout.RefChannel(run.channel).fail(reason)  # what the feeder's run() does with it
    with pytest.raises(RuntimeError, match="remote role failed while waiting for .*schedule.json") as raised:
        _read_online_total_steps(specforge_config(yaml_path), str(run.channel))
    assert expected in str(raised.value)


def test_a_stream_short_of_the_schedule_fails_rather_than_closes(tmp_path: Path) -> None:
    """SpecForge's consumer ends without an error when a closed stream runs dry before total_steps (its
    controller just returns), so the feeder must say it: rejections past the tail the schedule drops anyway,
    or fewer refs than promised at the end."""
    run = read_trainer_config(streamed_config(tmp_path))
    feeder = feeder_for(run, prompts=2401)
    assert feeder._publish_schedule(run, 4802) is None  # 1,200 steps of 4: two samples to spare
    assert (feeder.required, feeder.spare) == (4800, 2)
    assert feeder._short(rejected=2) is None
    assert "rejected 3 samples" in str(feeder._short(rejected=3))
    assert "gave 0 samples; the trainer's schedule needs 4800" in str(feeder._short())


def test_a_config_specforge_would_not_stream_is_refused_by_both(tmp_path: Path) -> None:
    """SpecForge 0.2.0's online consumer reads features from Mooncake only: a shared_dir config is refused
    by its schema, and the feeder says the same before feeding anything."""
    from pydantic import ValidationError

    yaml_path = streamed_config(tmp_path)
    shared = yaml_path.with_name("shared.yaml")
    shared_dir = f"backend: shared_dir\n    store_root: {tmp_path}"
    text = yaml_path.read_text().replace("backend: mooncake", shared_dir)
    shared.write_text(text)
    with pytest.raises(ValidationError, match="requires deployment.disaggregated.backend=mooncake"):
        specforge_config(shared)
    with pytest.raises(TrainerConfigError, match="reads features from Mooncake only"):
        read_trainer_config(shared)


def test_the_epochs_dataset_is_in_specforges_own_epoch_order(tmp_path: Path) -> None:
    from specforge.launch import _epoch_prompt_indices

    src, dst = tmp_path / "train.jsonl", tmp_path / "epochs.jsonl"
    rows = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(7)]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert write_epochs(src, dst, epochs=2, seed=42) == 14
    written = [json.loads(line) for line in dst.read_text().splitlines()]
    for epoch in range(2):
        order = _epoch_prompt_indices(rows, epoch, seed=42)
        pass_rows = written[epoch * 7 : (epoch + 1) * 7]
        assert [r["id"] for r in pass_rows] == [f"c{i}#e{epoch}" for i in order]
        assert [r["messages"] for r in pass_rows] == [rows[i]["messages"] for i in order]
    assert written[:7] != written[7:]  # each epoch in its own order


def test_streamed_status_reads_the_data_wait_from_specforges_own_log_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """streamed.sh status sums perf/data_wait_time_s (the controller's mean per step of each logged window)
    over the windows, from the lines SpecForge's own console logger prints."""
    import importlib.util

    from specforge.training.assembly import _logger

    _logger({"loss": 2.0, "perf/data_wait_time_s": 0.5, "acces": [0.1, 0.2]}, 5)
    _logger({"loss": 1.5, "perf/data_wait_time_s": 0.25, "acces": [0.3, 0.4]}, 10)
    log = tmp_path / "train.log"
    log.write_text(capsys.readouterr().out)
    spec = importlib.util.spec_from_file_location("streamed", STREAMED.with_suffix(".py"))
    assert spec is not None and spec.loader is not None
    streamed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(streamed)
    got = streamed.trainer_progress(log)
    assert got == {
        "step": 10,
        "data_wait_s": 0.5 * 5 + 0.25 * 5,
        "data_wait_through_step": 10,
        "log_interval": 5,
    }
