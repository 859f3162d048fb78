"""The parallel layout an engine ran with, on record: ``/hsx/info``'s ``extra["parallel_layout"]`` and each
job's manifest (``engine["parallel_layout"]``), read back as :class:`contract.ParallelLayout`. Engines,
/hsx/info documents and manifests from before the field exist must still load (the layout is then None)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hsx import contract
from hsx.manifest import Manifest, job_manifest
from tests.fixtures.jobs import running_job

KIMI_LAYOUT = contract.ParallelLayout(tp=8, dp=8, dp_attention=True, ep=8, moe_a2a_backend="deepep")


def engine_record(**extra: object) -> dict[str, object]:
    """What a worker records as a job starts (``jobs.engine``): /hsx/info plus its own side."""
    return {
        "backend": "sglang",
        "protocol_version": 1,
        "model_path": "/m",
        "num_layers": 4,
        "hidden_size": 8,
        "dtype": "bfloat16",
        "state_dtype": "BF16",
        "aux_layer_ids": [0, 1, 2],
        "hf_indices": [1, 2, 3, 4],
        "extra": {"engine_version": "0.5.17", "tp_size": 8, **extra},
    }


def test_the_layout_round_trips_and_says_who_shares_attention() -> None:
    raw = KIMI_LAYOUT.to_dict()
    assert raw == {
        "tp": 8,
        "dp": 8,
        "dp_attention": True,
        "ep": 8,
        "moe_a2a_backend": "deepep",
        "pp": 1,
        "nnodes": 1,
    }
    assert contract.ParallelLayout.from_dict(json.loads(json.dumps(raw))) == KIMI_LAYOUT
    assert KIMI_LAYOUT.attention_tp == 1
    assert contract.ParallelLayout(tp=8, dp=2, dp_attention=True).attention_tp == 4
    assert contract.ParallelLayout(tp=8, dp=2).attention_tp == 8  # plain replicas: each one TP 8
    # a later engine's field is ignored, a missing one takes the default; nothing said is None
    assert contract.ParallelLayout.from_dict({"tp": 2, "cp": 4}) == contract.ParallelLayout(tp=2)
    assert contract.ParallelLayout.from_dict(None) is None


def test_hsx_info_with_and_without_a_layout() -> None:
    info = contract.EngineInfo(
        backend="sglang",
        model_path="/m",
        num_layers=4,
        hidden_size=8,
        dtype="bfloat16",
        aux_layer_ids=[0, 1, 2],
        hf_indices=[1, 2, 3, 4],
        dump_dir="/d",
        prefix_cache=False,
        extra={contract.PARALLEL_LAYOUT: KIMI_LAYOUT.to_dict()},
    )
    raw = json.loads(json.dumps(info.to_dict()))
    assert contract.EngineInfo.from_dict(raw).parallel_layout == KIMI_LAYOUT
    raw["extra"].pop(contract.PARALLEL_LAYOUT)  # an engine from before the field
    assert contract.EngineInfo.from_dict(raw).parallel_layout is None


def test_a_manifest_records_the_layout_and_an_older_one_still_loads(tmp_path: Path) -> None:
    manifest = job_manifest(
        "job", engine_record(**{contract.PARALLEL_LAYOUT: KIMI_LAYOUT.to_dict()}), fp8=False
    )
    assert manifest.engine[contract.PARALLEL_LAYOUT] == KIMI_LAYOUT.to_dict()
    manifest.write(tmp_path / "new")
    assert Manifest.load(tmp_path / "new").parallel_layout == KIMI_LAYOUT
    # written before engines said: loads, and says nothing of the layout
    old = job_manifest("job", engine_record(), fp8=False)
    old.write(tmp_path / "old")
    raw = json.loads((tmp_path / "old" / "manifest.json").read_text())
    assert contract.PARALLEL_LAYOUT not in raw["engine"]
    assert Manifest.load(tmp_path / "old").parallel_layout is None


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_finalizing_a_job_writes_its_engines_layout_into_the_manifest(db_url: str, tmp_path: Path) -> None:
    import time

    from sqlalchemy import update

    from hsx.server.db.models import Job
    from hsx.server.db.session import session_scope
    from hsx.server.jobs import finalize, unit_results
    from hsx.server.jobs import repository as repo

    out = tmp_path / "out"
    job_id = running_job(db_url, out, units=1)
    engine = engine_record(**{contract.PARALLEL_LAYOUT: KIMI_LAYOUT.to_dict()})
    with session_scope(db_url) as session:
        session.execute(update(Job).where(Job.id == job_id).values(engine=engine))
    with session_scope(db_url) as session:
        unit = repo.claim_unit(session, job_id, "host:1@http://engine", 60, time.time())
    assert unit is not None
    with session_scope(db_url) as session:
        shard = unit_results.ShardRow(str(out / "shard-00000.safetensors"), "0" * 64, 1000, 4, 40)
        assert unit_results.commit_unit(session, unit, time.time(), shard, [], 4, 40, lambda: None)
    assert finalize.finalize_if_complete(db_url, job_id)
    assert Manifest.load(out).parallel_layout == KIMI_LAYOUT
