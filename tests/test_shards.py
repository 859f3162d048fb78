from __future__ import annotations

import errno
import hashlib
import json
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from hsx import loader
from hsx.contract import read_safetensors
from hsx.manifest import Counts, Manifest, ManifestError, ModelInfo, ShardEntry, relative_shard_path
from workers.shards import ShardBuilder, ShardInfo, ShardWriteError, canonical_state_dtype, fsync_dir

HIDDEN = 16
AUX = [2, 16, 27]  # HF indices of aux layers 1, 15, 26 of a 30-layer model
FINAL = 30


@dataclass
class Expected:
    index: int
    input_ids: list[int]
    loss_mask: list[int]
    states: dict[int, npt.NDArray[Any]]


def _float32_states(rng: np.random.Generator, tokens: int) -> dict[int, npt.NDArray[Any]]:
    return {hf: rng.standard_normal((tokens, HIDDEN), dtype=np.float32) for hf in [*AUX, FINAL]}


def _bf16_words(values: npt.NDArray[np.float32]) -> npt.NDArray[np.uint16]:
    # bf16 by truncation: the upper 16 bits of each float32.
    return (values.view(np.uint32) >> np.uint32(16)).astype(np.uint16)


def _samples(rng: np.random.Generator, lengths: list[int], first_index: int, bf16: bool) -> list[Expected]:
    samples = []
    for k, tokens in enumerate(lengths):
        states = _float32_states(rng, tokens)
        if bf16:
            states = {hf: _bf16_words(values) for hf, values in states.items()}
        samples.append(
            Expected(
                index=first_index + 3 * k,  # rejected samples leave gaps in the indices
                input_ids=rng.integers(0, 49152, tokens).tolist(),
                loss_mask=rng.integers(0, 2, tokens).tolist(),
                states=states,
            )
        )
    return samples


def _write_job(output_dir: Path, shards: list[list[Expected]], dtype: str) -> Manifest:
    infos: list[ShardInfo] = []
    for number, samples in enumerate(shards):
        builder = ShardBuilder(HIDDEN, dtype, AUX, FINAL)
        for sample in samples:
            builder.add(sample.index, sample.input_ids, sample.loss_mask, sample.states)
        infos.append(builder.write(output_dir / "shards" / f"shard-{number:05d}.safetensors"))
    manifest = Manifest(
        job_id="job-1",
        model=ModelInfo(path="/models/smol", num_layers=FINAL, hidden_size=HIDDEN, dtype=dtype),
        tokenizer={"name_or_path": "/models/smol", "vocab_size": 49152, "tokenizer_json_sha256": None},
        chat_template_sha256="0" * 64,
        aux_layer_ids=[hf - 1 for hf in AUX],
        hf_indices=[*AUX, FINAL],
        dtype=canonical_state_dtype(dtype),
        hidden_size=HIDDEN,
        counts=Counts(
            samples=sum(info.samples for info in infos), rejected=2, tokens=sum(i.tokens for i in infos)
        ),
        shards=[
            ShardEntry(
                path=relative_shard_path(output_dir, info.path),
                sha256=info.sha256,
                bytes=info.bytes,
                samples=info.samples,
                tokens=info.tokens,
            )
            for info in infos
        ],
    )
    manifest.write(output_dir)
    return manifest


def _as_float32(array: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
    return loader.bf16_words_to_float32(array) if array.dtype == np.uint16 else array


def test_float32_round_trip_is_exact(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    shards = [_samples(rng, [5, 1, 9], 0, False), _samples(rng, [7, 3], 100, False)]
    _write_job(tmp_path, shards, "float32")
    got = list(loader.iter_samples(tmp_path))
    expected = [sample for shard in shards for sample in shard]
    assert [s.index for s in got] == [e.index for e in expected]
    for sample, want in zip(got, expected, strict=True):
        assert sample.input_ids.dtype == np.int32 and sample.input_ids.tolist() == want.input_ids
        assert sample.loss_mask.dtype == np.uint8 and sample.loss_mask.tolist() == want.loss_mask
        assert sample.hidden_state.dtype == np.float32
        assert np.array_equal(sample.hidden_state, want.states[FINAL])
        aux = np.concatenate([want.states[hf] for hf in AUX], axis=1)
        assert sample.aux_hidden_state.shape == (len(want.input_ids), 3 * HIDDEN)
        assert np.array_equal(sample.aux_hidden_state, aux)


def test_bf16_round_trip_as_float32_words_and_torch(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    shards = [_samples(rng, [4, 6], 10, True)]
    _write_job(tmp_path, shards, "bf16")
    expected = shards[0]
    as_float = list(loader.iter_samples(tmp_path))
    as_words = list(loader.iter_samples(tmp_path, raw_bf16=True))
    for sample, words, want in zip(as_float, as_words, expected, strict=True):
        assert sample.hidden_state.dtype == np.float32
        assert np.array_equal(sample.hidden_state, _as_float32(want.states[FINAL]))
        assert words.hidden_state.dtype == np.uint16
        assert np.array_equal(words.hidden_state, want.states[FINAL])
        aux_words = np.concatenate([want.states[hf] for hf in AUX], axis=1)
        assert np.array_equal(words.aux_hidden_state, aux_words)
        assert np.array_equal(sample.aux_hidden_state, _as_float32(aux_words))

    torch = pytest.importorskip("torch")
    tensors = list(loader.iter_samples(tmp_path, as_torch=True))
    for tensor, want in zip(tensors, expected, strict=True):
        assert tensor.hidden_state.dtype == torch.bfloat16
        assert tensor.input_ids.dtype == torch.int32 and tensor.input_ids.tolist() == want.input_ids
        assert np.array_equal(
            tensor.hidden_state.view(torch.int16).numpy().view(np.uint16), want.states[FINAL]
        )
        assert np.array_equal(tensor.hidden_state.float().numpy(), _as_float32(want.states[FINAL]))


def test_shard_layout_offsets_and_interoperability(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    samples = _samples(rng, [3, 8, 2], 40, True)
    manifest = _write_job(tmp_path, [samples], "BF16")
    entry = manifest.shards[0]
    path = tmp_path / entry.path
    assert entry.path == "shards/shard-00000.safetensors"
    assert entry.bytes == path.stat().st_size
    assert entry.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert (entry.samples, entry.tokens) == (3, 13)

    raw = read_safetensors(str(path))
    assert {name: (t.dtype, t.shape) for name, t in raw.items()} == {
        "input_ids": ("I32", [13]),
        "loss_mask": ("U8", [13]),
        "hidden_state": ("BF16", [13, HIDDEN]),
        "aux_hidden_state": ("BF16", [13, 3 * HIDDEN]),
        "sample_offsets": ("I64", [4]),
        "sample_index": ("I64", [3]),
    }
    assert np.frombuffer(raw["sample_offsets"].data, "<i8").tolist() == [0, 3, 11, 13]
    assert np.frombuffer(raw["sample_index"].data, "<i8").tolist() == [40, 43, 46]

    # The reference safetensors library reads the same file.
    safetensors_torch = pytest.importorskip("safetensors.torch")
    torch = pytest.importorskip("torch")
    loaded = safetensors_torch.load_file(str(path))
    assert loaded["hidden_state"].dtype == torch.bfloat16
    assert loaded["sample_offsets"].tolist() == [0, 3, 11, 13]
    words = loaded["aux_hidden_state"][3:11].view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(words, np.concatenate([samples[1].states[hf] for hf in AUX], axis=1))


def test_checksum_and_size_mismatches_are_detected(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    manifest = _write_job(tmp_path, [_samples(rng, [6, 6], 0, False)], "F32")
    path = tmp_path / manifest.shards[0].path
    blob = bytearray(path.read_bytes())
    blob[-5] ^= 0x40  # one bit of the last tensor's data
    path.write_bytes(bytes(blob))
    with pytest.raises(loader.ChecksumMismatch):
        next(loader.iter_samples(tmp_path))
    assert len(list(loader.iter_samples(tmp_path, verify_checksums=False))) == 2

    path.write_bytes(bytes(blob) + b"\0")
    with pytest.raises(loader.LoaderError):
        next(loader.iter_samples(tmp_path, verify_checksums=False))


def test_manifest_round_trip_and_refusals(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    manifest = _write_job(tmp_path, [_samples(rng, [2], 0, False)], "F32")
    assert Manifest.load(tmp_path) == manifest
    assert manifest.layer_convention.startswith("eagle3:")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json", "shards"]

    raw = json.loads((tmp_path / "manifest.json").read_text())
    for field, value in (("schema_version", 2), ("shards", [{**raw["shards"][0], "path": "../x"}])):
        (tmp_path / "manifest.json").write_text(json.dumps({**raw, field: value}))
        with pytest.raises(ManifestError):
            Manifest.load(tmp_path)
    del raw["counts"]
    (tmp_path / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(ManifestError):
        Manifest.load(tmp_path)
    with pytest.raises(ManifestError):
        Manifest.load(tmp_path / "nowhere")
    with pytest.raises(ManifestError):
        relative_shard_path(tmp_path / "shards", tmp_path / "manifest.json")
    with pytest.raises(ManifestError):
        Manifest(**{**vars(manifest), "dtype": "bfloat16"})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"missing": FINAL}, "missing hidden state"),
        ({"shape": (4, HIDDEN + 1)}, "shape"),
        ({"dtype": np.float64}, "does not carry"),
        ({"mask": [0, 1, 2, 1]}, "only 0 and 1"),
        ({"ids": [1, 2, 3]}, "loss_mask shape"),
        ({"ids": [1, 2, 3, -1]}, "int32"),
    ],
)
def test_builder_refuses_inconsistent_samples(change: dict[str, Any], message: str) -> None:
    rng = np.random.default_rng(6)
    states = _float32_states(rng, 4)
    ids: list[int] = change.get("ids", [1, 2, 3, 4])
    mask: list[int] = change.get("mask", [0, 1, 1, 1])
    if "missing" in change:
        del states[change["missing"]]
    if "shape" in change:
        states[AUX[0]] = np.zeros(change["shape"], np.float32)
    if "dtype" in change:
        states[AUX[1]] = states[AUX[1]].astype(change["dtype"])
    builder = ShardBuilder(HIDDEN, "F32", AUX, FINAL)
    with pytest.raises(ValueError, match=message):
        builder.add(0, ids, mask, states)
    assert builder.samples == 0


def test_builder_accepts_int16_bf16_words_and_copies_its_inputs(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    words = {hf: _bf16_words(v) for hf, v in _float32_states(rng, 3).items()}
    expected = {hf: w.copy() for hf, w in words.items()}
    builder = ShardBuilder(HIDDEN, "bfloat16", AUX, FINAL)
    builder.add(0, [5, 6, 7], [0, 1, 1], {hf: w.view(np.int16) for hf, w in words.items()})
    for array in words.values():
        array[:] = 0  # the caller reuses its buffer
    assert builder.state_bytes == 3 * HIDDEN * 4 * 2
    info = builder.write(tmp_path / "s.safetensors")
    raw = read_safetensors(str(info.path))
    stored = np.frombuffer(raw["hidden_state"].data, "<u2").reshape(3, HIDDEN)
    assert np.array_equal(stored, expected[FINAL])
    with pytest.raises(ValueError):
        ShardBuilder(HIDDEN, "F32", AUX, FINAL).write(tmp_path / "empty.safetensors")
    with pytest.raises(ValueError):
        ShardBuilder(HIDDEN, "int8", AUX, FINAL)


def test_failed_write_leaves_nothing_behind(tmp_path: Path) -> None:
    builder = ShardBuilder(HIDDEN, "F32", AUX, FINAL)
    builder.add(0, [1, 2], [1, 1], _float32_states(np.random.default_rng(8), 2))
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    with pytest.raises(ShardWriteError):
        builder.write(blocker / "shard.safetensors")
    assert [p.name for p in tmp_path.iterdir()] == ["not-a-dir"]
    fsync_dir(tmp_path)


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs, so a write runs out of space for real; needs root and a working mount."""
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    mount_point = tmp_path / f"tmpfs-{uuid.uuid4().hex[:8]}"
    mount_point.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip() or result.returncode}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=False)


def test_out_of_space_keeps_the_previous_shard_and_no_temp_file(tiny_tmpfs: Path) -> None:
    rng = np.random.default_rng(9)
    target = tiny_tmpfs / "shard-00000.safetensors"
    small = ShardBuilder(HIDDEN, "F32", AUX, FINAL)
    small.add(0, [1, 2], [0, 1], _float32_states(rng, 2))
    first = small.write(target)
    before = target.read_bytes()

    large = ShardBuilder(HIDDEN, "F32", AUX, FINAL)
    large.add(0, list(range(512)), [1] * 512, _float32_states(rng, 512))  # 128 KiB of states
    with pytest.raises(ShardWriteError) as caught:
        large.write(target)
    assert caught.value.errno == errno.ENOSPC
    assert [p.name for p in tiny_tmpfs.iterdir()] == [target.name]
    assert target.read_bytes() == before
    assert hashlib.sha256(before).hexdigest() == first.sha256
