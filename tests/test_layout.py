"""hsx.layout: every write/parse pair round-trips, and each parser refuses what its writer never writes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hsx import layout


@pytest.mark.parametrize("hf_index", [0, 1, 9, 80, 12345])
def test_tensor_name_round_trip(hf_index: int) -> None:
    assert layout.parse_tensor_name(layout.tensor_name(hf_index)) == hf_index


@pytest.mark.parametrize(
    "name", ["hidden.", "hidden.-1", "hidden.01", "hidden.2x", "Hidden.2", "s0.hidden.2", ""]
)
def test_tensor_name_refuses_malformed(name: str) -> None:
    with pytest.raises(ValueError):
        layout.parse_tensor_name(name)
    with pytest.raises(ValueError):
        layout.tensor_name(-1)


def test_state_tensor_order() -> None:
    hf = [2, 14, 25, 28]
    assert layout.state_tensor_names(hf, "post") == ["hidden.2", "hidden.14", "hidden.25", "hidden.28"]
    assert layout.state_tensor_names(hf, "pre") == ["hidden.2", "hidden.14", "hidden.25", "final_pre_norm"]
    assert layout.state_tensor_names(hf, "both") == [
        "hidden.2",
        "hidden.14",
        "hidden.25",
        "hidden.28",
        layout.PRE_NORM_TENSOR,
    ]
    with pytest.raises(ValueError, match="final_state"):
        layout.state_tensor_names(hf, "middle")
    with pytest.raises(ValueError):
        layout.state_tensor_names([], "post")


def test_every_state_tensor_user_shares_the_order() -> None:
    """The writer (unit processor), the loader and the SGLang plugin name one sample's tensors alike."""
    from hsx.contract import EngineInfo
    from workers.engines.sglang.config import dump_tensor_names
    from workers.job_plan import dump_tensors

    for final_state in layout.FINAL_STATES:
        info = EngineInfo("reference", "m", 12, 64, "F32", [1, 5, 8], [2, 6, 9, 12], "/d", False)
        info.final_state = final_state
        expected = layout.state_tensor_names(info.hf_indices, final_state)
        assert dump_tensors(info) == expected
        assert dump_tensor_names(info.hf_indices, final_state) == expected


@pytest.mark.parametrize("position, state", [(0, "hidden.3"), (17, "final_pre_norm"), (12345, "hidden.80")])
def test_sample_tensor_name_round_trip(position: int, state: str) -> None:
    name = layout.sample_tensor_name(position, state)
    assert name == f"s{position}.{state}"
    assert layout.parse_sample_tensor_name(name) == (position, state)


@pytest.mark.parametrize(
    "name", ["s.hidden.2", "s01.hidden.2", "sx.hidden.2", "s1.", "hidden.2", "input_ids", "s-1.a"]
)
def test_sample_tensor_name_refuses_malformed(name: str) -> None:
    with pytest.raises(ValueError):
        layout.parse_sample_tensor_name(name)


def test_sample_tensor_name_refuses_bad_parts() -> None:
    with pytest.raises(ValueError):
        layout.sample_tensor_name(-1, "hidden.2")
    with pytest.raises(ValueError):
        layout.sample_tensor_name(0, "")


def test_token_tensors_never_look_like_sample_tensors() -> None:
    assert layout.TOKEN_TENSOR_NAMES == ("sample_offsets", "sample_index", "input_ids", "loss_mask")
    for name in layout.TOKEN_TENSOR_NAMES:
        with pytest.raises(ValueError):
            layout.parse_sample_tensor_name(name)


@pytest.mark.parametrize("unit", [0, 7, 99999, 123456])
def test_shard_file_name_round_trip(unit: int) -> None:
    name = layout.shard_file_name(unit)
    assert name.endswith(".safetensors") and not name.startswith(".")
    assert layout.parse_shard_file_name(name) == unit
    assert layout.parse_staged_shard_name(name) is None


@pytest.mark.parametrize("unit, attempt", [(0, 0), (3, 1), (99999, 12), (123456, 7)])
def test_staged_shard_name_round_trip(unit: int, attempt: int) -> None:
    name = layout.staged_shard_name(unit, attempt)
    assert name.startswith(".") and name.endswith(".staged")
    assert layout.parse_staged_shard_name(name) == (unit, attempt)
    assert layout.parse_shard_file_name(name) is None


@pytest.mark.parametrize(
    "name",
    [
        "shard-1.safetensors",
        "shard-00001.safetensor",
        "shard-0000a.safetensors",
        ".shard-00001.safetensors",
        "shard-00001.safetensors.tmp",
        "manifest.json",
        "",
    ],
)
def test_shard_file_name_refuses_malformed(name: str) -> None:
    assert layout.parse_shard_file_name(name) is None


@pytest.mark.parametrize(
    "name",
    [
        ".shard-00001.a.staged",
        ".shard-00001.1.staged",
        "shard-00001.a1.staged",
        ".shard-1.a1.staged",
        ".shard-00001.a1",
    ],
)
def test_staged_shard_name_refuses_malformed(name: str) -> None:
    assert layout.parse_staged_shard_name(name) is None


def test_shard_names_refuse_negative_parts() -> None:
    with pytest.raises(ValueError):
        layout.shard_file_name(-1)
    with pytest.raises(ValueError):
        layout.staged_shard_name(1, -1)


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:30000", "http://engine-3.internal:8000/", "http://user:secret@gpu-host:30000"]
)
def test_lease_owner_round_trip(url: str) -> None:
    owner = layout.lease_owner("node-7", 4242, url)
    parsed = layout.parse_lease_owner(owner)
    assert parsed == layout.LeaseOwner("node-7", 4242, url)
    assert parsed.worker == "node-7:4242"
    # An engine URL with an ``@`` of its own splits at the host's: the first one.
    assert layout.split_lease_owner(owner) == ("node-7:4242", url)


@pytest.mark.parametrize(
    "owner", ["node-7:4242", "node-7@http://e", ":1@http://e", "node-7:x@http://e", "n:1@", ""]
)
def test_lease_owner_refuses_malformed(owner: str) -> None:
    with pytest.raises(ValueError):
        layout.parse_lease_owner(owner)


def test_lease_owner_refuses_bad_parts() -> None:
    for host, pid, url in [("a@b", 1, "http://e"), ("a:b", 1, "http://e"), ("", 1, "http://e"), ("h", 1, "")]:
        with pytest.raises(ValueError):
            layout.lease_owner(host, pid, url)


def test_split_lease_owner_keeps_old_rows_readable() -> None:
    assert layout.split_lease_owner(None) == (None, None)
    assert layout.split_lease_owner("") == (None, None)
    assert layout.split_lease_owner("host:12") == ("host:12", None)


def test_worker_builds_owners_the_fleet_view_parses() -> None:
    from workers.job_runner import lease_owner

    owner = lease_owner(os.getpid(), "http://127.0.0.1:30000")
    parsed = layout.parse_lease_owner(owner)
    assert parsed.pid == os.getpid() and parsed.engine_url == "http://127.0.0.1:30000"


def test_write_atomically_replaces_whole_and_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "manifest.json"
    layout.write_atomically(target, "first")
    layout.write_atomically(target, b"second")
    assert target.read_bytes() == b"second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]
    layout.write_atomically(tmp_path / "meta.json", "{}", sync_dir=False)
    assert (tmp_path / "meta.json").read_text() == "{}"


def test_write_atomically_failure_keeps_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "status.json"
    target.write_text("old")
    (tmp_path / "blocker").mkdir()
    with pytest.raises(OSError):
        layout.write_atomically(tmp_path / "blocker", "new")  # os.replace cannot put a file over a directory
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blocker", "status.json"]
    assert not any(layout.is_temp_name(p.name) for p in tmp_path.iterdir())


def test_place_file_renames(tmp_path: Path) -> None:
    staged = tmp_path / layout.staged_shard_name(3, 1)
    staged.write_bytes(b"shard")
    final = tmp_path / layout.shard_file_name(3)
    layout.place_file(staged, final)
    assert final.read_bytes() == b"shard" and not staged.exists()


def test_is_temp_name() -> None:
    assert layout.is_temp_name(".manifest.json.0a1b2c.tmp")
    assert not layout.is_temp_name("manifest.json")
    assert not layout.is_temp_name(layout.staged_shard_name(1, 1))


def test_layout_imports_only_the_standard_library() -> None:
    """The SGLang plugin imports it inside a stock server, and the API without torch or numpy."""
    code = (
        "import sys, hsx.layout, hsx.contract; "
        "bad = [m for m in ('numpy', 'torch', 'pydantic', 'sqlalchemy') if m in sys.modules]; "
        "sys.exit(str(bad) if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ.copy())
    assert done.returncode == 0, done.stdout + done.stderr
