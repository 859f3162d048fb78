"""Streamed shards (schema 2): written sample by sample from dumps, read back by the loader and by the
reference safetensors library; schema 1 outputs still read; corruption, bad samples and full disks."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from hsx import contract, loader, safetensors_io
from hsx.engine.dumps import open_dump
from hsx.engine.validation import NON_FINITE, SampleRejected
from hsx.layout import shard_data_sha256 as data_sha256
from hsx.manifest import Manifest, ManifestError, relative_shard_path
from hsx.safetensors_io import encode_header, read_file
from tests.fixtures.v1_shards import (
    AUX,
    FINAL,
    HIDDEN,
    NUM_LAYERS,
    PRE,
    Written,
    add_sample,
    build_manifest,
    check_sample,
    dump_sample,
    dump_tensor_names,
    random_samples,
    rewrite_shard,
    stream_shard,
    write_job,
    write_v1_job,
)
from workers.engines.synthetic.engine import SyntheticConfig, SyntheticEngine, expected_state
from workers.shards import ShardStream, ShardWriteError, canonical_state_dtype


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
@pytest.mark.parametrize("final_state", ["post", "pre", "both"])
def test_round_trip_through_iter_samples_and_random_access(
    tmp_path: Path, dtype: str, final_state: str
) -> None:
    rng = np.random.default_rng(1)
    names = dump_tensor_names(final_state)
    shards = [
        random_samples(rng, [5, 1, 9], 0, dtype, names),
        random_samples(rng, [7], 100, dtype, names),
        random_samples(rng, [3, 2], 200, dtype, names),
    ]
    manifest = write_job(tmp_path / "out", tmp_path / "dumps", shards, dtype, final_state)
    assert (manifest.schema_version, manifest.final_state) == (2, final_state)
    expected = [sample for shard in shards for sample in shard]

    got = list(loader.iter_samples(tmp_path / "out"))
    assert len(got) == len(expected)
    for sample, want in zip(got, expected, strict=True):
        check_sample(sample, want, final_state)
    if dtype == "BF16":
        for sample, want in zip(loader.iter_samples(tmp_path / "out", raw_bf16=True), expected, strict=True):
            check_sample(sample, want, final_state, raw=True)

    reader = loader.OutputReader(tmp_path / "out", verify_checksums=True)
    assert len(reader) == 6 and reader.shard_sample_counts() == [3, 1, 2]
    for i in [5, 0, 3, 1, 4, 2]:  # out of order, across shards
        check_sample(reader[i], expected[i], final_state)
    check_sample(reader[-1], expected[-1], final_state)
    check_sample(reader[-6], expected[0], final_state)
    for bad in (6, -7, 100):
        with pytest.raises(IndexError):
            reader[bad]


def test_random_access_over_more_shards_than_stay_mapped(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    names = dump_tensor_names("post")
    shards = [random_samples(rng, [2, 3], 10 * n, "F32", names) for n in range(7)]
    write_job(tmp_path / "out", tmp_path / "dumps", shards, "F32")
    expected = [sample for shard in shards for sample in shard]
    reader = loader.OutputReader(tmp_path / "out")
    order = np.random.default_rng(3).permutation(len(expected)).tolist()
    for i in order + order[::-1]:
        check_sample(reader[i], expected[i], "post")


@pytest.mark.parametrize("final_state", ["post", "pre", "both"])
def test_synthetic_engine_dumps_stream_into_shards(tmp_path: Path, final_state: str) -> None:
    torch = pytest.importorskip("torch")
    engine = SyntheticEngine(
        SyntheticConfig(
            hidden_size=HIDDEN, num_layers=NUM_LAYERS, dump_dir=str(tmp_path / "d"), final_state=final_state
        )
    )
    assert engine.hf_indices == [*AUX, FINAL]
    names = [name for name, _ in engine.tensor_names()]
    assert names == dump_tensor_names(final_state)
    prompts = [[5, 6, 7], list(range(300)), [49151]]  # 300 tokens: more than one write of the engine's
    stream = ShardStream(tmp_path / "out/shards/s.safetensors", dtype="bf16", dump_tensors=names, capacity=3)
    for k, ids in enumerate(prompts):
        rid = f"hsx-synthetic-{k}"
        engine.prefill(ids, rid)
        dump = open_dump(str(tmp_path / "d"), rid, 0)
        try:
            stream.add(k, np.asarray(ids), np.ones(len(ids), np.uint8), dump.fd, dump.state_specs())
        finally:
            dump.close()
    info = stream.finish()
    build_manifest(tmp_path / "out", [info], "BF16", final_state).write(tmp_path / "out")

    def want(ids: list[int], hf_index: int) -> npt.NDArray[np.uint16]:
        return expected_state(engine.table, np.asarray(ids), hf_index)

    for sample, ids in zip(loader.iter_samples(tmp_path / "out", raw_bf16=True), prompts, strict=True):
        aux = np.concatenate([want(ids, i) for i in AUX], axis=1)
        assert np.array_equal(sample.aux_hidden_state, aux)
        if final_state != "pre":
            assert sample.hidden_state is not None and np.array_equal(sample.hidden_state, want(ids, FINAL))
        if final_state != "post":
            assert sample.final_pre_norm is not None
            assert np.array_equal(sample.final_pre_norm, want(ids, FINAL + 1))
    for tensors, ids in zip(loader.iter_samples(tmp_path / "out", as_torch=True), prompts, strict=True):
        assert tensors.aux_hidden_state.dtype == torch.bfloat16
        assert tensors.input_ids.dtype == torch.int32 and tensors.input_ids.tolist() == ids
        final = tensors.hidden_state if final_state != "pre" else tensors.final_pre_norm
        assert final is not None and final.dtype == torch.bfloat16
        want_final = want(ids, FINAL if final_state != "pre" else FINAL + 1)
        assert np.array_equal(final.view(torch.int16).numpy().view(np.uint16), want_final)
        assert np.array_equal(final.float().numpy(), loader.bf16_words_to_float32(want_final))


def test_layout_hashes_and_reference_reader(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    names = dump_tensor_names("both")
    samples = random_samples(rng, [3, 8, 2], 40, "BF16", names)
    # A dump may hold more than the shard keeps: only the requested tensors are copied.
    extra = {"hidden.9": np.zeros((3, HIDDEN), np.uint16)}
    samples[0].states.update(extra)
    kept = dump_tensor_names("post")
    path = tmp_path / "out" / "shards" / "shard-00000.safetensors"
    info = stream_shard(path, tmp_path / "dumps", samples, "BF16", kept)
    assert (info.path, info.samples, info.tokens, info.bytes) == (path, 3, 13, path.stat().st_size)

    blob = path.read_bytes()
    header_end = 8 + int.from_bytes(blob[:8], "little")
    assert header_end % 8 == 0
    assert info.header_sha256 == hashlib.sha256(blob[:header_end]).hexdigest()
    assert info.sha256 == hashlib.sha256(blob[header_end:]).hexdigest() == data_sha256(path)
    assert data_sha256(tmp_path / "nowhere") is None

    tensors = read_file(str(path))
    per_sample = [f"s{k}.{name}" for k in range(3) for name in kept]
    assert list(tensors) == [*per_sample, "sample_offsets", "sample_index", "input_ids", "loss_mask"]
    assert [tensors[n][0].start for n in tensors] == sorted(tensors[n][0].start for n in tensors)
    assert tensors["s1.hidden.15"][0].shape == (8, HIDDEN) and tensors["s1.hidden.15"][0].dtype == "BF16"
    assert np.frombuffer(tensors["sample_offsets"][1], "<i8").tolist() == [0, 3, 11, 13]
    assert np.frombuffer(tensors["sample_index"][1], "<i8").tolist() == [40, 43, 46]
    assert tensors["input_ids"][0].dtype == "I32" and tensors["loss_mask"][0].dtype == "U8"

    # The reference safetensors library opens the streamed file; every tensor is what was written.
    safetensors_torch = pytest.importorskip("safetensors.torch")
    torch = pytest.importorskip("torch")
    loaded = safetensors_torch.load_file(str(path))
    assert sorted(loaded) == sorted(tensors)
    for k, sample in enumerate(samples):
        for name in kept:
            words = loaded[f"s{k}.{name}"]
            assert words.dtype == torch.bfloat16
            assert np.array_equal(words.view(torch.int16).numpy().view(np.uint16), sample.states[name])
    assert loaded["sample_offsets"].tolist() == [0, 3, 11, 13]
    assert loaded["sample_index"].tolist() == [40, 43, 46]
    assert loaded["input_ids"].tolist() == [t for s in samples for t in s.input_ids]
    assert loaded["loss_mask"].tolist() == [m for s in samples for m in s.loss_mask]


@pytest.mark.parametrize("dtype", ["F32", "F16"])
def test_reference_reader_matches_every_tensor(tmp_path: Path, dtype: str) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    names = dump_tensor_names("both")
    samples = random_samples(np.random.default_rng(5), [4, 1, 6], 7, dtype, names)
    path = tmp_path / "shard.safetensors"
    stream_shard(path, tmp_path / "dumps", samples, dtype, names)
    loaded = safetensors_torch.load_file(str(path))
    assert len(loaded) == 3 * len(names) + 4
    for k, sample in enumerate(samples):
        for name in names:
            assert np.array_equal(loaded[f"s{k}.{name}"].numpy(), sample.states[name])


def test_checksum_mismatch_in_data_or_header(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    samples = random_samples(rng, [6, 6], 0, "F32", dump_tensor_names("post"))
    manifest = write_job(tmp_path, tmp_path / "dumps", [samples], "F32")
    path = tmp_path / manifest.shards[0].path
    good = path.read_bytes()
    header_end = 8 + int.from_bytes(good[:8], "little")

    data_flip = bytearray(good)
    data_flip[header_end + 100] ^= 0x40  # one bit of the first state tensor
    path.write_bytes(bytes(data_flip))
    with pytest.raises(loader.ChecksumMismatch):
        next(loader.iter_samples(tmp_path))
    with pytest.raises(loader.ChecksumMismatch):
        loader.OutputReader(tmp_path, verify_checksums=True)[0]
    assert len(list(loader.iter_samples(tmp_path, verify_checksums=False))) == 2

    # Still valid JSON (padding space -> newline): only the header hash can tell.
    padding_flip = bytearray(good)
    assert padding_flip[header_end - 1 : header_end] == b" "
    padding_flip[header_end - 1] = ord("\n")
    path.write_bytes(bytes(padding_flip))
    with pytest.raises(loader.ChecksumMismatch):
        next(loader.iter_samples(tmp_path))

    # Two layers swapped in the header: the data is untouched and the file still parses and loads.
    swapped = good.replace(b'"s0.hidden.15"', b'"s0.hidden.XX"')
    swapped = swapped.replace(b'"s0.hidden.27"', b'"s0.hidden.15"').replace(
        b'"s0.hidden.XX"', b'"s0.hidden.27"'
    )
    assert swapped != good and len(swapped) == len(good)
    path.write_bytes(swapped)
    with pytest.raises(loader.ChecksumMismatch):
        next(loader.iter_samples(tmp_path))
    unverified = next(loader.iter_samples(tmp_path, verify_checksums=False))
    assert not np.array_equal(
        unverified.aux_hidden_state[:, HIDDEN : 2 * HIDDEN], samples[0].states["hidden.15"]
    )

    path.write_bytes(good + b"\0")
    with pytest.raises(loader.LoaderError, match="bytes"):
        next(loader.iter_samples(tmp_path, verify_checksums=False))
    path.write_bytes(good)
    assert len(list(loader.iter_samples(tmp_path))) == 2


def _one_shard_job(tmp_path: Path, final_state: str = "post") -> Manifest:
    names = dump_tensor_names(final_state)
    samples = random_samples(np.random.default_rng(7), [4, 2], 0, "F32", names)
    return write_job(tmp_path / "out", tmp_path / "dumps", [samples], "F32", final_state)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"bytes": 1}, "the manifest says"),
        ({"samples": 1}, "manifest disagrees"),
        ({"tokens": -1}, "manifest disagrees"),
        ({"hidden_size": HIDDEN + 1}, "expected F32"),
        ({"dtype": "F16"}, "expected F16"),
        ({"final_state": "both"}, "final_pre_norm is missing"),
        ({"hf_indices": [2, 15, 28, FINAL]}, "hidden.28 is missing"),
    ],
)
def test_loader_refuses_a_manifest_that_disagrees(
    tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    manifest = _one_shard_job(tmp_path)
    entry = manifest.shards[0]
    change = dict(change)
    for field in ("bytes", "samples", "tokens"):
        if field in change:
            entry = dataclasses.replace(entry, **{field: getattr(entry, field) + change.pop(field)})
    dataclasses.replace(manifest, shards=[entry], **change).write(tmp_path / "out")
    with pytest.raises(loader.LoaderError, match=message):
        next(loader.iter_samples(tmp_path / "out"))
    with pytest.raises(loader.LoaderError, match=message):
        loader.OutputReader(tmp_path / "out")[0]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda items: [t for t in items if t[0] != "sample_index"], r"missing tensors \['sample_index'\]"),
        (lambda items: [t for t in items if t[0] != "s1.hidden.2"], "s1.hidden.2 is missing"),
        (
            lambda items: [
                (n, d, s, np.asarray([0, 4, 5], "<i8").tobytes() if n == "sample_offsets" else b)
                for n, d, s, b in items
            ],
            "do not cover the tokens",
        ),
        (
            lambda items: [
                (n, "F16", [s[0], s[1] * 2], b) if n == "s0.hidden.30" else (n, d, s, b)
                for n, d, s, b in items
            ],
            r"s0.hidden.30 is F16\[4, 32\]",
        ),
        (lambda items: [(n, d, s, b) for n, d, s, b in items if n != "loss_mask"], "missing tensors"),
    ],
)
def test_loader_refuses_a_shard_of_the_wrong_shape(tmp_path: Path, edit: Any, message: str) -> None:
    manifest = _one_shard_job(tmp_path)
    path = tmp_path / "out" / manifest.shards[0].path
    rewrite_shard(path, edit)
    entry = dataclasses.replace(manifest.shards[0], bytes=path.stat().st_size)
    dataclasses.replace(manifest, shards=[entry]).write(tmp_path / "out")
    with pytest.raises(loader.LoaderError, match=message):
        next(loader.iter_samples(tmp_path / "out", verify_checksums=False))


def test_manifest_round_trip_and_refusals(tmp_path: Path) -> None:
    manifest = _one_shard_job(tmp_path)
    out = tmp_path / "out"
    assert Manifest.load(out) == manifest
    assert manifest.layer_convention.startswith("eagle3:")
    assert manifest.shards[0].header_sha256 is not None
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "shards"]

    raw = json.loads((out / "manifest.json").read_text())
    assert raw["schema_version"] == 2 and raw["final_state"] == "post"
    for field, value in (
        ("schema_version", 4),  # 3 is an fp8 output (tests/test_fp8_shards.py)
        ("schema_version", None),
        ("shards", [{**raw["shards"][0], "path": "../x"}]),
        ("shards", [{**raw["shards"][0], "path": "/abs/x"}]),
        ("final_state", "middle"),
        ("dtype", "bfloat16"),
        ("hf_indices", [2, 15, 27]),
    ):
        (out / "manifest.json").write_text(json.dumps({**raw, field: value}))
        with pytest.raises(ManifestError):
            Manifest.load(out)
    (out / "manifest.json").write_text(json.dumps({**raw, "schema_version": 1, "final_state": "pre"}))
    with pytest.raises(ManifestError, match="schema 1"):
        Manifest.load(out)
    del raw["counts"]
    (out / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(ManifestError):
        Manifest.load(out)
    with pytest.raises(ManifestError):
        Manifest.load(tmp_path / "nowhere")
    with pytest.raises(ManifestError):
        relative_shard_path(out / "shards", out / "manifest.json")


@pytest.mark.parametrize("dtype", ["BF16", "F32"])
def test_schema_1_output_is_still_read(tmp_path: Path, dtype: str) -> None:
    names = dump_tensor_names("post")
    rng = np.random.default_rng(8)
    shards = [random_samples(rng, [3, 5], 0, dtype, names), random_samples(rng, [2], 50, dtype, names)]
    manifest = write_v1_job(tmp_path, shards, dtype)
    raw = json.loads((tmp_path / "manifest.json").read_text())
    assert raw["schema_version"] == 1 and raw["shards"][0]["header_sha256"] is None
    assert Manifest.load(tmp_path).schema_version == 1
    expected = [sample for shard in shards for sample in shard]

    for got, want in zip(loader.iter_samples(tmp_path), expected, strict=True):
        check_sample(got, want, "post")
    reader = loader.OutputReader(tmp_path, verify_checksums=True, raw_bf16=True)
    assert len(reader) == 3
    check_sample(reader[-1], expected[2], "post", raw=True)
    check_sample(reader[1], expected[1], "post", raw=True)

    path = tmp_path / manifest.shards[0].path
    good = path.read_bytes()
    blob = bytearray(good)
    blob[-3] ^= 0x01  # the whole-file sha256 covers every byte
    path.write_bytes(bytes(blob))
    with pytest.raises(loader.ChecksumMismatch):
        next(loader.iter_samples(tmp_path))

    rewrite_shard(path, lambda items: [t for t in items if t[0] != "aux_hidden_state"])
    entry = dataclasses.replace(manifest.shards[0], bytes=path.stat().st_size)
    dataclasses.replace(manifest, shards=[entry, manifest.shards[1]]).write(tmp_path)
    with pytest.raises(loader.LoaderError, match="aux_hidden_state"):
        next(loader.iter_samples(tmp_path, verify_checksums=False))


@pytest.mark.parametrize(("dtype", "bad_value"), [("F32", np.nan), ("F16", -np.inf), ("BF16", 0x7FC0)])
@pytest.mark.parametrize("check_every_chunk", [True, False])
@pytest.mark.parametrize("write_behind", [1 << 30, 256], ids=["no-writeback-yet", "writeback-every-256B"])
def test_non_finite_sample_is_cut_off_without_a_trace(
    tmp_path: Path, dtype: str, bad_value: Any, check_every_chunk: bool, write_behind: int
) -> None:
    names = dump_tensor_names("both")
    first, bad, last = random_samples(np.random.default_rng(9), [30, 40, 20], 0, dtype, names)
    # Three tensors of the bad sample are copied before its fourth turns out bad; with every chunk checked
    # the bad value sits many small chunks into that tensor, otherwise in its first chunk.
    bad.states["hidden.30"][25 if check_every_chunk else 0, 3] = bad_value
    dumps = tmp_path / "dumps"

    with_bad = ShardStream(
        tmp_path / "a.safetensors",
        dtype=dtype,
        dump_tensors=names,
        capacity=3,
        chunk_bytes=64,
        write_behind=write_behind,
    )
    add_sample(with_bad, dumps, first, check_every_chunk=check_every_chunk)
    size = with_bad.path.stat().st_size
    with pytest.raises(SampleRejected) as rejected:
        add_sample(with_bad, dumps, bad, check_every_chunk=check_every_chunk)
    assert rejected.value.reason == NON_FINITE and "hidden.30" in rejected.value.detail
    assert with_bad.path.stat().st_size == size and with_bad.samples == 1
    # Part of the bad sample had already been handed to the disk; the cut takes the write-behind back too.
    if with_bad.write_behind.enabled and write_behind < size:
        assert 0 < with_bad.write_behind.started <= size
    add_sample(with_bad, dumps, last, check_every_chunk=check_every_chunk)
    info = with_bad.finish()

    # Written without the bad sample, with the same capacity (so the same header reserve).
    without = ShardStream(tmp_path / "b.safetensors", dtype=dtype, dump_tensors=names, capacity=3)
    add_sample(without, dumps, first)
    add_sample(without, dumps, last)
    clean = without.finish()
    assert info.path.read_bytes() == clean.path.read_bytes()
    assert (info.sha256, info.header_sha256, info.bytes) == (clean.sha256, clean.header_sha256, clean.bytes)
    assert (info.samples, info.tokens) == (2, 50)


def test_a_dump_cut_short_or_of_another_dtype_is_rejected_and_rewound(tmp_path: Path) -> None:
    names = dump_tensor_names("post")
    first, short, mixed, last = random_samples(np.random.default_rng(10), [3, 4, 5, 6], 0, "BF16", names)
    dumps = tmp_path / "dumps"
    stream = ShardStream(tmp_path / "a.safetensors", dtype="BF16", dump_tensors=names, capacity=4)
    add_sample(stream, dumps, first)

    rid = dump_sample(dumps, short, {name: "BF16" for name in names})
    dump = open_dump(str(dumps), rid, 0)
    os.truncate(Path(dump.directory) / contract.STATES_FILE, dump.specs["hidden.27"].start + 10)
    with pytest.raises(SampleRejected) as rejected:
        stream.add(1, np.asarray(short.input_ids), np.asarray(short.loss_mask), dump.fd, dump.state_specs())
    dump.close()
    assert rejected.value.reason == "dump_missing"

    mixed.states["hidden.27"] = mixed.states["hidden.27"].astype(np.float32)  # values irrelevant here
    rid = dump_sample(dumps, mixed, {**{name: "BF16" for name in names}, "hidden.27": "F32"})
    dump = open_dump(str(dumps), rid, 0)
    with pytest.raises(SampleRejected) as rejected:
        stream.add(2, np.asarray(mixed.input_ids), np.asarray(mixed.loss_mask), dump.fd, dump.state_specs())
    dump.close()
    assert rejected.value.reason == "dtype_mismatch"

    add_sample(stream, dumps, last)
    info = stream.finish()
    clean = ShardStream(tmp_path / "b.safetensors", dtype="BF16", dump_tensors=names, capacity=4)
    add_sample(clean, dumps, first)
    add_sample(clean, dumps, last)
    assert info.path.read_bytes() == clean.finish().path.read_bytes()


@pytest.mark.parametrize("capacity", [1, 64, 4096])
def test_header_reserve_holds_the_capacity_it_was_made_for(tmp_path: Path, capacity: int) -> None:
    # A 200-layer model's names and the pre-norm state: the longest tensor names a shard holds.
    aux, final = [3, 100, 197], 200
    names = dump_tensor_names("both", aux, final)
    sample = Written(0, [1, 2], [0, 1], {name: np.zeros((2, HIDDEN), np.uint16) for name in names})
    stream = ShardStream(tmp_path / "s.safetensors", dtype="BF16", dump_tensors=names, capacity=capacity)
    rid = dump_sample(tmp_path / "dumps", sample, {name: "BF16" for name in names})
    dump = open_dump(str(tmp_path / "dumps"), rid, 0)
    filled = min(capacity, 64)  # every sample of a 64-sample shard; the header math is checked below
    for k in range(filled):
        stream.add(k, np.asarray([1, 2]), np.asarray([0, 1]), dump.fd, dump.state_specs())
    if filled == capacity:
        with pytest.raises(ValueError, match="full"):
            stream.add(capacity, np.asarray([1, 2]), np.asarray([0, 1]), dump.fd, dump.state_specs())
    dump.close()
    info = stream.finish()
    assert info.samples == filled
    reserved = int.from_bytes(info.path.read_bytes()[:8], "little")

    # The largest header this shard could need: every sample a million tokens of a 16384-wide model.
    tokens, width = 1_000_000, 16384
    entries = [
        (f"s{k}.{name}", "BF16", [tokens, width], tokens * width * 2)
        for k in range(capacity)
        for name in names
    ]
    entries += [
        ("sample_offsets", "I64", [capacity + 1], 8 * (capacity + 1)),
        ("sample_index", "I64", [capacity], 8 * capacity),
        ("input_ids", "I32", [capacity * tokens], 4 * capacity * tokens),
        ("loss_mask", "U8", [capacity * tokens], capacity * tokens),
    ]
    assert len(encode_header(entries, pad_to=reserved)) == 8 + reserved


def test_stream_refusals_and_discard(tmp_path: Path) -> None:
    names = dump_tensor_names("post")
    with pytest.raises(ValueError, match="unsupported state dtype"):
        ShardStream(tmp_path / "x.safetensors", dtype="int8", dump_tensors=names, capacity=1)
    assert canonical_state_dtype("bfloat16") == "BF16" and canonical_state_dtype("fp32") == "F32"
    empty = ShardStream(tmp_path / "empty.safetensors", dtype="F32", dump_tensors=names, capacity=1)
    with pytest.raises(ValueError):
        empty.finish()
    empty.discard()
    empty.discard()  # twice is harmless
    assert not (tmp_path / "empty.safetensors").exists()

    existing = tmp_path / "taken.safetensors"
    existing.write_bytes(b"someone else's")
    with pytest.raises(ShardWriteError) as caught:
        ShardStream(existing, dtype="F32", dump_tensors=names, capacity=1)
    assert caught.value.errno == errno.EEXIST and existing.read_bytes() == b"someone else's"

    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    with pytest.raises(ShardWriteError):
        ShardStream(blocker / "shard.safetensors", dtype="F32", dump_tensors=names, capacity=1)

    sample = random_samples(np.random.default_rng(11), [2], 0, "F32", names)[0]
    half = ShardStream(tmp_path / "half.safetensors", dtype="F32", dump_tensors=names, capacity=2)
    add_sample(half, tmp_path / "dumps", sample)
    half.discard()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dumps", "not-a-dir", "taken.safetensors"]


def test_a_dump_missing_a_tensor_is_rejected_and_rewound(tmp_path: Path) -> None:
    names = dump_tensor_names("both")
    first, partial = random_samples(np.random.default_rng(14), [3, 4], 0, "F32", names)
    del partial.states[PRE]  # the aux layers and the post-norm state are copied before this is missed
    stream = ShardStream(tmp_path / "a.safetensors", dtype="F32", dump_tensors=names, capacity=2)
    add_sample(stream, tmp_path / "dumps", first)
    size = stream.path.stat().st_size
    with pytest.raises(SampleRejected):
        add_sample(stream, tmp_path / "dumps", partial)
    assert stream.path.stat().st_size == size and stream.samples == 1


def test_stream_keeps_its_own_copy_of_ids_and_mask(tmp_path: Path) -> None:
    names = dump_tensor_names("post")
    sample = random_samples(np.random.default_rng(12), [3], 0, "F32", names)[0]
    rid = dump_sample(tmp_path / "dumps", sample, {name: "F32" for name in names})
    dump = open_dump(str(tmp_path / "dumps"), rid, 0)
    stream = ShardStream(tmp_path / "s.safetensors", dtype="F32", dump_tensors=names, capacity=1)
    ids, mask = np.asarray(sample.input_ids, np.int32), np.asarray(sample.loss_mask, np.uint8)
    stream.add(0, ids, mask, dump.fd, dump.state_specs())
    dump.close()
    ids[:], mask[:] = 0, 0  # the caller reuses its buffers
    info = stream.finish()
    stored = read_file(str(info.path))
    assert np.frombuffer(stored["input_ids"][1], "<i4").tolist() == sample.input_ids
    assert np.frombuffer(stored["loss_mask"][1], "u1").tolist() == sample.loss_mask


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


def test_out_of_space_raises_and_keeps_the_finished_shard(tmp_path: Path, tiny_tmpfs: Path) -> None:
    names = dump_tensor_names("post")
    rng = np.random.default_rng(13)
    small, large = random_samples(rng, [2, 512], 0, "F32", names)  # the large one: 128 KiB of states
    dumps = tmp_path / "dumps"  # on the real disk: only the shard runs out of space
    first = stream_shard(tiny_tmpfs / "shard-00000.safetensors", dumps, [small], "F32", names)
    before = first.path.read_bytes()

    stream = ShardStream(tiny_tmpfs / "shard-00001.safetensors", dtype="F32", dump_tensors=names, capacity=1)
    with pytest.raises(ShardWriteError) as caught:
        add_sample(stream, dumps, large)
    assert caught.value.errno == errno.ENOSPC
    stream.discard()
    assert [p.name for p in tiny_tmpfs.iterdir()] == [first.path.name]
    assert first.path.read_bytes() == before and data_sha256(first.path) == first.sha256


def test_a_dump_file_is_whole_after_short_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel may take part of a writev; every byte still lands once, in order, whatever the buffer
    types (the SGLang plugin hands uint8 views of pinned rows, the engines int32 and bf16 arrays)."""
    real_writev, calls = os.writev, []

    def short_writev(fd: int, buffers: list[memoryview]) -> int:
        calls.append(len(buffers))
        return real_writev(fd, [buffers[0][:7]])

    monkeypatch.setattr(safetensors_io.os, "writev", short_writev)
    ids = np.arange(5, dtype="<i4")
    states = np.arange(5 * 6, dtype="<u2").reshape(5, 6)
    path = tmp_path / "states.safetensors"
    safetensors_io.write_file(
        str(path), [("input_ids", "I32", [5], ids.data), ("hidden.1", "BF16", [5, 6], states.tobytes())]
    )
    got = read_file(str(path))
    assert got["input_ids"][1] == ids.tobytes() and got["hidden.1"][1] == states.tobytes()
    assert got["hidden.1"][0].shape == (5, 6) and len(calls) > 3
