"""Each trainer's own reader, from its own package, loads an exported job and yields the native tensors:
ids, loss mask and every captured layer.

* SpecForge 0.2.0: ``OfflineManifestReader`` -> ``LocalFeatureStore`` -> ``FeatureDataLoader`` with the
  EAGLE-3 offline normalizer and collator; and its vocab-mapping functions against the exported mapping.
* ModelOpt 0.47.0: ``OfflineSupervisedDataset`` (answer_only_loss) and ``EagleOfflineDataCollator``.
* speculators 0.9.0: ``ArrowDataset`` (``datasets.load_from_disk`` and hs_connectors' ``FileTransfer``).

The SpecForge and ModelOpt exports come from a multi-turn job made with the reference engine (SmolLM2,
prefix cache off). speculators needs the pre-norm final state, which the reference engine does not capture
(it has no --final-state), so its export comes from a job on the synthetic engine with --final-state both;
the refusal on the reference job is checked too. The package-free checks (torch.load and safetensors on
the same files) run even where a trainer package is missing.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from hsx.integrations.exports import ExportError, ExportOptions, export_output
from hsx.loader import TorchSample, iter_samples
from tests.conftest import REDIS_URL
from tests.fixtures.engine import _stop, _wait_healthy, engine_url
from tests.fixtures.shared import once_per_session
from tests.fixtures.stack import REPO, make_stack
from tests.fixtures.warm_processes import start_hsx

MULTI_TURN = REPO / "tests" / "data" / "short_chats.jsonl"
SYNTHETIC_HIDDEN, SYNTHETIC_LAYERS = 64, 8


@dataclass(frozen=True)
class JobOutput:
    output_dir: Path
    db_url: str
    job_id: str
    engine_url: str

    def native(self) -> dict[int, TorchSample]:
        return {s.index: s for s in iter_samples(self.output_dir, as_torch=True)}


def run_job(engine_url: str, tmp: Path) -> JobOutput:
    """One job through the real stack (API, Redis, SQLite job table, a burst worker process)."""
    from hsx.server.db.migrate import upgrade

    db_url = f"sqlite:///{tmp / 'hsx.sqlite3'}"
    upgrade(db_url)
    with pytest.MonkeyPatch.context() as patch:
        stack = make_stack(db_url, REDIS_URL, engine_url, tmp, patch)
        try:
            job = stack.submit(MULTI_TURN, samples_per_shard=4)
            assert stack.run_burst(timeout=600) == 0, stack.logs()
            doc = stack.wait(job["id"], timeout=120)
            assert doc["state"] == "succeeded", (doc, stack.logs())
        finally:
            stack.stop_workers()
            from hsx.server.settings import get_settings

            get_settings.cache_clear()
    return JobOutput(Path(doc["output_dir"]), db_url, job["id"], engine_url)


def engine_job_once(engine_nocache: Any, tmp_path_factory: pytest.TempPathFactory) -> JobOutput:
    """The job of MULTI_TURN on the prefix-cache-free engine, run once per session whichever test process
    asks first (tests/fixtures/shared.py): this module's reference job and tests/test_fp8_jobs.py's
    engine-dtype job are the same job. Its output and job table are read from where it ran; the engine it
    names is this process's own (the same model, the same flags), alive for as long as this process runs."""
    job = once_per_session(tmp_path_factory, "engine-job", lambda tmp: run_job(engine_nocache.url, tmp))
    return dataclasses.replace(job, engine_url=engine_nocache.url)


@pytest.fixture(scope="module")
def reference_job(engine_nocache: Any, tmp_path_factory: pytest.TempPathFactory) -> JobOutput:
    return engine_job_once(engine_nocache, tmp_path_factory)


@pytest.fixture(scope="module")
def synthetic_engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    work = tmp_path_factory.mktemp("synthetic")
    args = [
        "engine", "--backend", "synthetic", "--final-state", "both",
        "--hidden-size", str(SYNTHETIC_HIDDEN), "--num-layers", str(SYNTHETIC_LAYERS),
        "--tokenizer", str(model_dir), "--port", "0", "--port-file", str(work / "port"),
        "--dump-dir", str(work / "dumps"),
    ]  # fmt: skip
    process = start_hsx(args, dict(os.environ), work / "engine.log")
    try:
        url = engine_url(process, work / "port", work / "engine.log")
        _wait_healthy(process, url, work / "engine.log")
        yield url
    finally:
        _stop(process)


@pytest.fixture(scope="module")
def both_states_job(synthetic_engine: str, tmp_path_factory: pytest.TempPathFactory) -> JobOutput:
    return run_job(synthetic_engine, tmp_path_factory.mktemp("synthetic-job"))


def test_the_reference_job_is_multi_turn(reference_job: JobOutput) -> None:
    native = reference_job.native()
    assert len(native) >= 10
    # Several assistant turns in one sample: the loss mask has more than one run of ones.
    runs = [int((torch.diff(s.loss_mask.int()) == 1).sum()) + int(s.loss_mask[0]) for s in native.values()]
    assert max(runs) >= 2


# --- SpecForge -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def specforge_export(
    reference_job: JobOutput, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    dest = tmp_path_factory.mktemp("specforge") / "export"
    options = ExportOptions(draft_vocab_size=256, group_size=8)  # target size from the model's config.json
    report = export_output(reference_job.output_dir, "specforge", dest, options)
    assert report["target"]["vocab_mapping"]["target_vocab_size"] == 49152
    return dest


def test_specforge_files_hold_the_native_tensors(reference_job: JobOutput, specforge_export: Path) -> None:
    native = reference_job.native()
    files = sorted(specforge_export.rglob("*.ckpt"))
    assert len(files) == len(native)
    for path in files:
        raw = torch.load(path, weights_only=True, mmap=True)
        sample = native[int(path.stem.split("_")[1])]
        assert path.parent.name == f"rows_{sample.index // 8 * 8}-{sample.index // 8 * 8 + 8}"
        assert (
            raw["input_ids"].dtype == torch.int64 and raw["hidden_state"].dtype == sample.hidden_state.dtype
        )  # type: ignore[union-attr]
        assert torch.equal(raw["input_ids"], sample.input_ids.long())
        assert torch.equal(raw["loss_mask"], sample.loss_mask.long())
        assert torch.equal(raw["hidden_state"], sample.hidden_state.unsqueeze(0))  # type: ignore[union-attr]
        assert torch.equal(raw["aux_hidden_state"], sample.aux_hidden_state.unsqueeze(0))


def test_specforge_reader_yields_the_native_tensors(reference_job: JobOutput, specforge_export: Path) -> None:
    pytest.importorskip("specforge", reason="specforge is in the interop extra (installed with --no-deps)")
    from specforge.algorithms.eagle3.data import build_offline_collator, build_offline_normalizer
    from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader

    native = reference_job.native()
    hidden = 576
    refs = OfflineManifestReader(str(specforge_export), validate_files=True).read()
    assert len(refs) == len(native)
    index_of = {ref.sample_id: int(Path(ref.feature_store_uri).stem.split("_")[1]) for ref in refs}
    loader = FeatureDataLoader(
        LocalFeatureStore(),
        refs=refs,
        batch_size=3,
        collate_fn=build_offline_collator(),
        per_sample_transform=build_offline_normalizer(max_len=4096),
        drop_last=False,
    )
    seen = set()
    for batch in loader:
        tensors = batch.tensors
        for row, sample_id in enumerate(batch.sample_ids):
            sample = native[index_of[sample_id]]
            length = len(sample.input_ids)
            assert torch.equal(tensors["input_ids"][row, :length], sample.input_ids.long())
            assert tensors["attention_mask"][row, :length].eq(1).all()
            # SpecForge's normalizer zeroes the last position of the mask (nothing follows it to predict).
            expected_mask = sample.loss_mask.long().clone()
            expected_mask[-1] = 0
            assert torch.equal(tensors["loss_mask"][row, :length], expected_mask)
            assert torch.equal(tensors["target"][row, :length], sample.hidden_state)
            for layer in range(3):  # every aux layer, in hf_indices order
                columns = slice(layer * hidden, (layer + 1) * hidden)
                got = tensors["hidden_state"][row, :length, columns]
                assert torch.equal(got, sample.aux_hidden_state[:, columns])
            seen.add(sample.index)
    assert seen == set(native)


def test_specforge_vocab_mapping_is_what_its_trainer_builds(specforge_export: Path) -> None:
    pytest.importorskip("specforge", reason="specforge is in the interop extra (installed with --no-deps)")
    from specforge.core.compact_teacher import validate_vocab_mapping_consistency
    from specforge.data.preprocessing import process_token_dict_to_mappings
    from specforge.training.vocab_mapping import count_effective_feature_tokens

    saved = torch.load(specforge_export / "vocab_mapping" / "vocab_mapping.pt", weights_only=True)
    counts = count_effective_feature_tokens(str(specforge_export), target_vocab_size=49152)
    d2t, t2d = process_token_dict_to_mappings(counts, 256, 49152)
    assert torch.equal(saved["d2t"], d2t) and torch.equal(saved["t2d"], t2d)
    validate_vocab_mapping_consistency(saved["t2d"], saved["d2t"])


# --- ModelOpt --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def modelopt_export(reference_job: JobOutput, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("modelopt") / "export"
    export_output(reference_job.output_dir, "modelopt", dest)
    return dest


def test_modelopt_files_hold_the_native_tensors(reference_job: JobOutput, modelopt_export: Path) -> None:
    native = reference_job.native()
    files = sorted(modelopt_export.rglob("*.pt"))
    assert len(files) == len(native)
    for path in files:
        raw = torch.load(path, weights_only=True)  # as ModelOpt loads them
        sample = native[int(path.stem)]
        assert raw["conversation_id"] == path.stem
        assert torch.equal(raw["input_ids"], sample.input_ids.long())
        assert torch.equal(raw["loss_mask"], sample.loss_mask.long())
        assert torch.equal(raw["hidden_states"], sample.hidden_state)
        assert torch.equal(raw["aux_hidden_states"], sample.aux_hidden_state)


def test_modelopt_reader_yields_the_native_tensors(reference_job: JobOutput, modelopt_export: Path) -> None:
    pytest.importorskip("modelopt", reason="nvidia-modelopt is in the interop extra")
    from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator, OfflineSupervisedDataset

    native = reference_job.native()
    files = [str(p) for p in modelopt_export.rglob("*.pt")]  # how ModelOpt's main.py finds them
    dataset = OfflineSupervisedDataset(files, answer_only_loss=True)
    assert len(dataset) == len(native)
    longest = max(len(s.input_ids) for s in native.values())
    collate = EagleOfflineDataCollator(train_len=longest)
    for start in range(0, len(files), 4):
        items = [dataset[i] for i in range(start, min(start + 4, len(files)))]
        batch = collate(items)
        for row, i in enumerate(range(start, start + len(items))):
            sample = native[int(Path(files[i]).stem)]
            length = len(sample.input_ids)
            assert items[row]["base_hidden_prenorm"] is False
            assert torch.equal(batch["input_ids"][row, :length], sample.input_ids.long())
            assert torch.equal(batch["loss_mask"][row, :length], sample.loss_mask.long())
            assert batch["loss_mask"][row, length:].eq(0).all()
            assert torch.equal(batch["labels"][row, : length - 1], sample.input_ids[1:].long())
            outputs = batch["base_model_outputs"]
            assert torch.equal(outputs["base_model_hidden_states"][row, :length], sample.hidden_state)
            assert torch.equal(outputs["aux_hidden_states"][row, :length], sample.aux_hidden_state)


# --- speculators -----------------------------------------------------------------------------------------


def test_speculators_is_refused_for_a_post_norm_only_job(reference_job: JobOutput, tmp_path: Path) -> None:
    with pytest.raises(ExportError) as caught:
        export_output(reference_job.output_dir, "speculators", tmp_path / "x")
    assert "--final-state both" in caught.value.detail
    assert not (tmp_path / "x").exists()


@pytest.fixture(scope="module")
def speculators_export(both_states_job: JobOutput, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("speculators") / "export"
    export_output(both_states_job.output_dir, "speculators", dest)
    return dest


def in_order(job: JobOutput) -> list[TorchSample]:
    return list(iter_samples(job.output_dir, as_torch=True))


def test_speculators_files_hold_the_native_tensors(
    both_states_job: JobOutput, speculators_export: Path
) -> None:
    import pyarrow as pa

    samples = in_order(both_states_job)
    with pa.memory_map(str(speculators_export / "data-00000-of-00001.arrow")) as source:
        table = pa.ipc.open_stream(source).read_all()
    assert table.num_rows == len(samples)
    for i, sample in enumerate(samples):
        raw = load_file(speculators_export / "hidden_states" / f"hs_{i}.safetensors")
        assert raw["hidden_states"].shape == (len(sample.input_ids), 4, SYNTHETIC_HIDDEN)
        assert torch.equal(raw["token_ids"], sample.input_ids.long())
        assert torch.equal(raw["hidden_states"][:, 3], sample.final_pre_norm)  # type: ignore[arg-type]
        assert torch.equal(raw["hidden_states"][:, :3].flatten(1), sample.aux_hidden_state)
        assert table["input_ids"][i].as_py() == sample.input_ids.tolist()
        assert table["loss_mask"][i].as_py() == sample.loss_mask.tolist()


def test_speculators_reader_yields_the_native_tensors(
    both_states_job: JobOutput, speculators_export: Path
) -> None:
    pytest.importorskip(
        "speculators", reason="speculators is in the interop extra (installed with --no-deps)"
    )
    from speculators.train.data import ArrowDataset, CollateFn

    samples = in_order(both_states_job)
    dataset = ArrowDataset(max_len=4096, datapath=str(speculators_export), on_missing="raise")
    assert len(dataset) == len(samples)
    for i, sample in enumerate(samples):
        item = dataset[i]
        assert torch.equal(item["input_ids"], sample.input_ids.long())
        assert torch.equal(item["loss_mask"], sample.loss_mask.long())
        assert torch.equal(item["verifier_last_hidden_states"], sample.final_pre_norm)  # type: ignore[arg-type]
        for layer in range(3):
            columns = slice(layer * SYNTHETIC_HIDDEN, (layer + 1) * SYNTHETIC_HIDDEN)
            assert torch.equal(item["hidden_states"][:, columns], sample.aux_hidden_state[:, columns])
    packed = CollateFn(max_len=4096, hidden_size=SYNTHETIC_HIDDEN)([dataset[0], dataset[1]])
    first, second = samples[0], samples[1]
    total = len(first.input_ids) + len(second.input_ids)
    assert torch.equal(packed["input_ids"][0, :total], torch.cat([first.input_ids, second.input_ids]).long())
    token_freq = torch.load(speculators_export / "token_freq.pt", weights_only=True)
    assert sum(token_freq.values()) == sum(int(s.loss_mask.sum()) for s in samples)


# --- the API route, run by a real worker ------------------------------------------------------------------


def test_export_through_the_api(
    reference_job: JobOutput, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stack = make_stack(
        reference_job.db_url, REDIS_URL, reference_job.engine_url, tmp_path, monkeypatch,
        exports_dir=str(tmp_path / "exports"),
    )  # fmt: skip
    try:
        base = f"/jobs/{reference_job.job_id}/exports"
        resp = stack.client.post(base, json={"format": "modelopt"})
        assert resp.status_code == 202, resp.text
        export = resp.json()
        assert export["state"] == "queued" and not Path(export["dest"]).exists()
        again = stack.client.post(base, json={"format": "modelopt"})
        assert again.status_code == 200 and again.json()["id"] == export["id"]
        refused = stack.client.post(base, json={"format": "speculators"})
        assert refused.status_code == 400 and refused.json()["error"] == "export_not_possible"
        assert stack.client.post(base, json={"format": "x"}).status_code == 422
        assert stack.client.get(f"{base}/{'0' * 32}").status_code == 404
        assert stack.client.get(f"{base}/../../etc").status_code == 404
        assert stack.client.post("/jobs/no-such-job/exports", json={"format": "modelopt"}).status_code == 404

        assert stack.run_burst(timeout=300) == 0, stack.logs()
        deadline = time.monotonic() + 60
        while (doc := stack.client.get(f"{base}/{export['id']}").json())["state"] in ("queued", "running"):
            assert time.monotonic() < deadline, doc
            time.sleep(0.2)
        assert doc["state"] == "succeeded", doc
        assert doc["report"]["counts"]["samples"] == len(reference_job.native())
        assert len(list(Path(doc["dest"]).glob("*.pt"))) == doc["report"]["counts"]["samples"]
        listing = stack.client.get(base).json()
        assert listing["total"] == 1 and listing["items"][0]["id"] == export["id"]
        assert os.path.isfile(Path(doc["dest"]) / "hsx_export.json")
    finally:
        stack.stop_workers()
