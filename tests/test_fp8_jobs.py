"""fp8 jobs end to end: the API on the embedded defaults (reference engine), read back by the loader and a
DataLoader, compared with an engine-dtype job of the same data, and exported to each trainer's reader."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hsx import fp8
from hsx.integrations.exports import export_output
from hsx.loader import iter_samples
from hsx.torch_data import OutputDataset, collate_samples
from tests.conftest import REDIS_URL
from tests.fixtures.shared import once_per_session
from tests.fixtures.stack import make_stack
from tests.test_export_trainers import (
    MULTI_TURN,
    SYNTHETIC_HIDDEN,
    JobOutput,
    engine_job_once,
    synthetic_engine,
)

__all__ = ["synthetic_engine"]  # a fixture of tests/test_export_trainers.py, used here too


def run_job(engine_url: str, tmp: Path, **options: Any) -> JobOutput:
    from hsx.server.db.migrate import upgrade

    db_url = f"sqlite:///{tmp / 'hsx.sqlite3'}"
    upgrade(db_url)
    with pytest.MonkeyPatch.context() as patch:
        stack = make_stack(db_url, REDIS_URL, engine_url, tmp, patch)
        try:
            job = stack.submit(MULTI_TURN, samples_per_shard=4, **options)
            assert stack.run_burst(timeout=600) == 0, stack.logs()
            doc = stack.wait(job["id"], timeout=120)
            assert doc["state"] == "succeeded", (doc, stack.logs())
            assert doc["options"]["state_dtype"] == options.get("state_dtype", "engine")
        finally:
            stack.stop_workers()
            from hsx.server.settings import get_settings

            get_settings.cache_clear()
    return JobOutput(Path(doc["output_dir"]), db_url, job["id"], engine_url)


@pytest.fixture(scope="module")
def fp8_job(engine_nocache: Any, tmp_path_factory: pytest.TempPathFactory) -> JobOutput:
    """Run once per session, whichever test process asks first (tests/fixtures/shared.py)."""
    job = once_per_session(
        tmp_path_factory, "fp8-job", lambda tmp: run_job(engine_nocache.url, tmp, state_dtype="fp8_e4m3")
    )
    return dataclasses.replace(job, engine_url=engine_nocache.url)


@pytest.fixture(scope="module")
def engine_job(engine_nocache: Any, tmp_path_factory: pytest.TempPathFactory) -> JobOutput:
    """The engine-dtype job: tests/test_export_trainers.py's reference job, the same job, run once."""
    return engine_job_once(engine_nocache, tmp_path_factory)


def _bytes(job: JobOutput) -> int:
    return sum(
        entry["bytes"] for entry in json.loads((job.output_dir / "manifest.json").read_text())["shards"]
    )


def test_fp8_job_is_within_the_bound_of_the_engines_own_states(
    fp8_job: JobOutput, engine_job: JobOutput
) -> None:
    manifest = json.loads((fp8_job.output_dir / "manifest.json").read_text())
    assert (manifest["schema_version"], manifest["dtype"], manifest["source_dtype"]) == (3, "F8_E4M3", "F32")
    assert manifest["extra"]["options"]["state_dtype"] == "fp8_e4m3"
    plain = json.loads((engine_job.output_dir / "manifest.json").read_text())
    assert (plain["schema_version"], plain["dtype"]) == (2, "F32")
    # The reference engine on CPU gives float32: fp8 is a quarter of its bytes, plus 4 bytes a token per
    # tensor of scales.
    assert manifest["counts"]["tokens"] == plain["counts"]["tokens"] > 0
    assert 0.24 < _bytes(fp8_job) / _bytes(engine_job) < 0.30

    theirs = {s.index: s for s in iter_samples(engine_job.output_dir)}
    ours = list(iter_samples(fp8_job.output_dir, verify_checksums=True))
    raw = list(iter_samples(fp8_job.output_dir, raw_fp8=True))
    assert sorted(s.index for s in ours) == sorted(theirs)
    for sample, codes in zip(ours, raw, strict=True):
        want = theirs[sample.index]
        assert np.array_equal(sample.input_ids, want.input_ids)
        assert np.array_equal(sample.loss_mask, want.loss_mask)
        for got, original in (
            (sample.hidden_state, want.hidden_state),
            (sample.aux_hidden_state, want.aux_hidden_state),
        ):
            assert got is not None and original is not None and got.dtype == np.float32
            cosine = (got * original).sum(1) / (
                np.linalg.norm(got, axis=1) * np.linalg.norm(original, axis=1)
            )
            relative = np.linalg.norm(got - original, axis=1) / np.linalg.norm(original, axis=1)
            # The documented bound (docs/format.md): the aux layers side by side are three tensors each
            # within it, so their concatenation is too.
            assert cosine.min() >= fp8.DOCUMENTED_MIN_COSINE
            assert relative.max() <= fp8.DOCUMENTED_MAX_REL_L2
        assert codes.hidden_state is not None and codes.hidden_state.dtype == np.uint8
        assert codes.hidden_state_scale is not None
        assert np.array_equal(
            fp8.dequantize(codes.hidden_state, codes.hidden_state_scale),
            sample.hidden_state,  # type: ignore[arg-type]
        )


def test_fp8_job_loads_through_the_dataloader(fp8_job: JobOutput) -> None:
    dataset = OutputDataset(fp8_job.output_dir)
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, collate_fn=collate_samples)
    seen = 0
    for batch in loader:
        assert batch["hidden_state"].dtype == torch.bfloat16
        assert batch["aux_hidden_state"].shape[-1] == 3 * batch["hidden_state"].shape[-1]
        seen += batch["input_ids"].shape[0]
    assert seen == len(dataset) > 0
    first = next(iter_samples(fp8_job.output_dir, as_torch=True))
    assert torch.equal(dataset[0]["hidden_state"], first.hidden_state)  # type: ignore[arg-type]


def test_specforge_and_modelopt_readers_load_an_fp8_job(fp8_job: JobOutput, tmp_path: Path) -> None:
    pytest.importorskip("specforge", reason="specforge is in the interop extra (installed with --no-deps)")
    pytest.importorskip("modelopt", reason="nvidia-modelopt is in the interop extra")
    from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator, OfflineSupervisedDataset
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader

    native = {s.index: s for s in iter_samples(fp8_job.output_dir, as_torch=True)}
    export_output(fp8_job.output_dir, "specforge", tmp_path / "specforge")
    refs = OfflineManifestReader(str(tmp_path / "specforge"), validate_files=True).read()
    assert len(refs) == len(native)
    store = LocalFeatureStore()
    for ref in refs:
        sample = native[int(Path(ref.feature_store_uri).stem.split("_")[1])]
        features, _handle = store.get(ref)
        assert features["hidden_state"].dtype == torch.bfloat16
        assert torch.equal(features["hidden_state"][0], sample.hidden_state)  # type: ignore[arg-type]
        assert torch.equal(features["aux_hidden_state"][0], sample.aux_hidden_state)
    report = export_output(fp8_job.output_dir, "modelopt", tmp_path / "modelopt")
    assert report["source"]["dtype"] == "F8_E4M3" and report["source"]["source_dtype"] == "F32"
    files = [str(p) for p in (tmp_path / "modelopt").rglob("*.pt")]
    dataset = OfflineSupervisedDataset(files, answer_only_loss=True)
    assert len(dataset) == len(native)
    collate = EagleOfflineDataCollator(train_len=max(len(s.input_ids) for s in native.values()))
    for i, path in enumerate(files):
        outputs = collate([dataset[i]])["base_model_outputs"]
        sample = native[int(Path(path).stem)]
        length = len(sample.input_ids)
        assert torch.equal(outputs["base_model_hidden_states"][0, :length], sample.hidden_state)  # type: ignore[arg-type]
        assert torch.equal(outputs["aux_hidden_states"][0, :length], sample.aux_hidden_state)


def test_speculators_reader_loads_an_fp8_job(
    synthetic_engine: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    pytest.importorskip(
        "speculators", reason="speculators is in the interop extra (installed with --no-deps)"
    )
    from speculators.train.data import ArrowDataset

    job = run_job(synthetic_engine, tmp_path_factory.mktemp("fp8-synthetic"), state_dtype="fp8_e4m3")
    dest = tmp_path_factory.mktemp("speculators-fp8") / "export"
    export_output(job.output_dir, "speculators", dest)
    samples = list(iter_samples(job.output_dir, as_torch=True))
    dataset = ArrowDataset(max_len=4096, datapath=str(dest), on_missing="raise")
    assert len(dataset) == len(samples) > 0
    for i, sample in enumerate(samples):
        item: Any = dataset[i]
        assert item["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(item["input_ids"], sample.input_ids.long())
        assert torch.equal(item["verifier_last_hidden_states"], sample.final_pre_norm)  # type: ignore[arg-type]
        assert torch.equal(
            item["hidden_states"][:, :SYNTHETIC_HIDDEN], sample.aux_hidden_state[:, :SYNTHETIC_HIDDEN]
        )


def test_verify_job_holds_an_fp8_job_to_the_documented_bound(fp8_job: JobOutput, engine_nocache: Any) -> None:
    from hsx.engine.verify import run_verification

    doc = {
        "id": fp8_job.job_id,
        "output_dir": str(fp8_job.output_dir),
        "options": {"state_dtype": "fp8_e4m3"},
    }
    report = run_verification(engine_nocache.url, rid_prefix_tag="verify-fp8", job=doc)
    fp8_checks = [c for c in report.checks if c.name.startswith("fp8.")]
    # Three samples, four stored tensors each (three aux layers and the post-norm final state).
    assert len(fp8_checks) == 12 and all(c.ok for c in fp8_checks), [c.to_dict() for c in fp8_checks]
    assert all(c.actual.startswith("min cos 0.99") for c in fp8_checks)

    # A stored state that is not the engine's (here: another sample's scales swapped in) fails the check.
    from hsx.engine.verify_fp8 import token_errors

    engine = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    codes, scales = fp8.quantize_rows(engine, "F32")
    assert token_errors(fp8.dequantize(codes, scales), engine)[1] <= fp8.DOCUMENTED_MAX_REL_L2
    wrong = fp8.dequantize(codes, scales[::-1].copy())
    cosine, relative = token_errors(wrong, engine)
    assert relative > fp8.DOCUMENTED_MAX_REL_L2
