"""fp8 shards (schema 3): streamed from engine-dtype dumps, read back dequantized or raw, by the loader,
the torch views and the reference safetensors reader; corrupt scales refused; old schemas unaffected."""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from hsx import contract, fp8, loader
from hsx.engine.validation import NON_FINITE, SampleRejected
from hsx.manifest import FP8_DTYPE, Manifest, ManifestError
from hsx.torch_data import OutputDataset
from tests.fixtures.v1_shards import (
    AUX,
    HIDDEN,
    POST,
    PRE,
    Written,
    add_sample,
    as_float32,
    build_manifest,
    dump_tensor_names,
    random_samples,
    stream_shard,
)
from workers.shards import ShardStream


def write_fp8_job(
    output_dir: Path,
    dump_dir: Path,
    shards: list[list[Written]],
    dtype: str,
    final_state: str = "post",
    **kw: Any,
) -> Manifest:
    names = dump_tensor_names(final_state)
    infos = [
        stream_shard(
            output_dir / f"shard-{n:05d}.safetensors", dump_dir, samples, dtype, names, store_fp8=True, **kw
        )
        for n, samples in enumerate(shards)
    ]
    manifest = dataclasses.replace(
        build_manifest(output_dir, infos, dtype, final_state),
        dtype=FP8_DTYPE,
        source_dtype=dtype,
        schema_version=3,
    )
    manifest.write(output_dir)
    return manifest


def expected(state: Any, dtype: str) -> tuple[Any, Any]:
    """The codes and scales hsx.fp8's numpy reference gives for one engine-dtype tensor."""
    return fp8.quantize_rows(state, dtype)


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32"])
@pytest.mark.parametrize("final_state", ["post", "both"])
def test_fp8_round_trip_dequantized_and_raw(tmp_path: Path, dtype: str, final_state: str) -> None:
    rng = np.random.default_rng(7)
    names = dump_tensor_names(final_state)
    shards = [random_samples(rng, [5, 1, 9], 0, dtype, names), random_samples(rng, [300], 50, dtype, names)]
    out = tmp_path / "out"
    # A small chunk: a sample's rows cross several chunks, and the scales must still line up.
    write_fp8_job(out, tmp_path / "dumps", shards, dtype, final_state, chunk_bytes=256)
    wanted = [s for shard in shards for s in shard]

    got = list(loader.iter_samples(out, verify_checksums=True))
    raw = list(loader.iter_samples(out, raw_fp8=True))
    assert len(got) == len(raw) == len(wanted)
    for sample, codes, want in zip(got, raw, wanted, strict=True):
        assert sample.index == want.index and sample.input_ids.tolist() == want.input_ids
        assert sample.aux_hidden_state.dtype == np.float32
        assert sample.aux_hidden_state.shape == (len(want.input_ids), len(AUX) * HIDDEN)
        for layer, index in enumerate(AUX):
            want_codes, want_scales = expected(want.states[contract.tensor_name(index)], dtype)
            columns = slice(layer * HIDDEN, (layer + 1) * HIDDEN)
            assert np.array_equal(codes.aux_hidden_state[:, columns], want_codes)
            assert codes.aux_hidden_state_scale is not None
            assert np.array_equal(codes.aux_hidden_state_scale[:, layer], want_scales)
            assert np.array_equal(
                sample.aux_hidden_state[:, columns], fp8.dequantize(want_codes, want_scales)
            )
            # Within e4m3's half step of the engine's own values.
            original = as_float32(want.states[contract.tensor_name(index)]).astype(np.float32)
            bound = np.abs(original) * 2.0**-4 + want_scales[:, None] * 2.0**-10
            assert (np.abs(sample.aux_hidden_state[:, columns] - original) <= bound * 1.0001).all()
        want_codes, want_scales = expected(want.states[POST], dtype)
        assert np.array_equal(codes.hidden_state, want_codes)  # type: ignore[arg-type]
        assert np.array_equal(codes.hidden_state_scale, want_scales)  # type: ignore[arg-type]
        assert np.array_equal(sample.hidden_state, fp8.dequantize(want_codes, want_scales))  # type: ignore[arg-type]
        if final_state == "both":
            pre_codes, pre_scales = expected(want.states[PRE], dtype)
            assert np.array_equal(codes.final_pre_norm, pre_codes)  # type: ignore[arg-type]
            assert np.array_equal(codes.final_pre_norm_scale, pre_scales)  # type: ignore[arg-type]
            assert np.array_equal(sample.final_pre_norm, fp8.dequantize(pre_codes, pre_scales))  # type: ignore[arg-type]
        else:
            assert sample.final_pre_norm is None and codes.final_pre_norm_scale is None
        assert sample.hidden_state_scale is None  # dequantized samples carry no scales

    # The reference safetensors reader opens the shard and sees fp8 codes and float32 scales.
    tensors = load_file(out / "shard-00000.safetensors")
    assert tensors[f"s0.{POST}"].dtype == torch.float8_e4m3fn
    assert tensors[f"s0.{POST}.scale"].dtype == torch.float32
    dequantized = tensors[f"s0.{POST}"].float() * tensors[f"s0.{POST}.scale"][:, None]
    assert torch.equal(dequantized, torch.from_numpy(got[0].hidden_state))


def test_fp8_torch_views_are_bf16_or_raw_fp8(tmp_path: Path) -> None:
    rng = np.random.default_rng(8)
    shards = [random_samples(rng, [4, 6], 0, "BF16", dump_tensor_names("post"))]
    out = tmp_path / "out"
    write_fp8_job(out, tmp_path / "dumps", shards, "BF16")
    plain = list(loader.iter_samples(out))
    for sample, numpy_sample in zip(loader.iter_samples(out, as_torch=True), plain, strict=True):
        assert sample.aux_hidden_state.dtype == torch.bfloat16
        assert torch.equal(
            sample.aux_hidden_state, torch.from_numpy(numpy_sample.aux_hidden_state).bfloat16()
        )
    for sample, numpy_sample in zip(
        loader.iter_samples(out, as_torch=True, raw_fp8=True), plain, strict=True
    ):
        assert sample.hidden_state is not None and sample.hidden_state.dtype == torch.float8_e4m3fn
        assert sample.hidden_state_scale is not None and sample.aux_hidden_state_scale is not None
        assert sample.aux_hidden_state_scale.shape == (len(sample.input_ids), len(AUX))
        back = sample.hidden_state.float() * sample.hidden_state_scale[:, None]
        assert torch.equal(back, torch.from_numpy(numpy_sample.hidden_state))
    dataset = OutputDataset(out)
    batch = torch.utils.data.DataLoader(dataset, batch_size=2, collate_fn=lambda items: items)
    items = [item for chunk in batch for item in chunk]
    assert [item["index"] for item in items] == [s.index for s in plain]
    assert all(item["hidden_state"].dtype == torch.bfloat16 for item in items)
    assert torch.equal(items[1]["aux_hidden_state"], torch.from_numpy(plain[1].aux_hidden_state).bfloat16())


def _corrupt_scale(path: Path, tensor: str, value: float, position: int = 0) -> None:
    """Overwrite one stored scale in place (the checksum no longer matches, which is not what is tested)."""
    blob = bytearray(path.read_bytes())
    from hsx.safetensors_io import read_header

    with open(path, "rb") as fh:
        spec = read_header(fh, str(path))[tensor]
    struct.pack_into("<f", blob, spec.start + 4 * position, value)
    path.write_bytes(bytes(blob))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -0.5, 0.0])
def test_a_corrupt_scale_is_refused(tmp_path: Path, value: float) -> None:
    rng = np.random.default_rng(9)
    shards = [random_samples(rng, [3, 5], 0, "F32", dump_tensor_names("post"))]
    out = tmp_path / "out"
    write_fp8_job(out, tmp_path / "dumps", shards, "F32")
    _corrupt_scale(out / "shard-00000.safetensors", f"s1.{contract.tensor_name(AUX[1])}.scale", value, 2)
    reader = loader.OutputReader(out)
    assert reader[0].index == 0  # the other sample is intact
    for raw in (False, True):
        with pytest.raises(loader.LoaderError, match=r"s1\.hidden\.15\.scale holds"):
            loader.OutputReader(out, raw_fp8=raw)[1]
    with pytest.raises(loader.ChecksumMismatch):
        list(loader.iter_samples(out, verify_checksums=True))


@pytest.mark.parametrize("check_every_chunk", [True, False])
@pytest.mark.parametrize("bad_value", [np.nan, np.inf, -np.inf])
def test_fp8_stream_rejects_non_finite_input_and_rewinds(
    tmp_path: Path, check_every_chunk: bool, bad_value: float
) -> None:
    rng = np.random.default_rng(10)
    names = dump_tensor_names("post")
    good, bad, after = random_samples(rng, [4, 6, 5], 0, "F32", names)
    bad.states[names[-1]][5, 3] = bad_value  # in the last chunk of the last tensor: 64-byte rows, 2 a chunk
    stream = ShardStream(
        tmp_path / "shard.safetensors",
        dtype="F32",
        dump_tensors=names,
        capacity=3,
        store_fp8=True,
        chunk_bytes=128,
    )
    add_sample(stream, tmp_path / "dumps", good)
    with pytest.raises(SampleRejected) as caught:
        # Without check_every_chunk (the engine counted none) the scales still catch it.
        add_sample(stream, tmp_path / "dumps", bad, check_every_chunk=check_every_chunk)
    assert caught.value.reason == NON_FINITE
    add_sample(stream, tmp_path / "dumps", after)
    info = stream.finish()
    manifest = dataclasses.replace(
        build_manifest(tmp_path, [info], "F32"), dtype=FP8_DTYPE, source_dtype="F32", schema_version=3
    )
    manifest.write(tmp_path)
    got = list(loader.iter_samples(tmp_path, verify_checksums=True))
    assert [s.index for s in got] == [good.index, after.index]
    # fp8 stores 1 byte a value plus 4 bytes a token per tensor: a quarter of F32, plus the scales.
    tokens = 4 + 5
    assert info.bytes - (8 + struct.unpack("<Q", (tmp_path / "shard.safetensors").read_bytes()[:8])[0]) == (
        tokens * len(names) * (HIDDEN + 4) + (2 + 1) * 8 + 2 * 8 + tokens * 4 + tokens
    )


def test_manifest_schema_3_rules(tmp_path: Path) -> None:
    rng = np.random.default_rng(11)
    shards = [random_samples(rng, [2], 0, "BF16", dump_tensor_names("post"))]
    manifest = write_fp8_job(tmp_path / "out", tmp_path / "dumps", shards, "BF16")
    again = Manifest.load(tmp_path / "out")
    assert (again.schema_version, again.dtype, again.source_dtype) == (3, "F8_E4M3", "BF16")
    with pytest.raises(ManifestError, match="needs schema_version 3"):
        dataclasses.replace(manifest, schema_version=2)
    with pytest.raises(ManifestError, match="source_dtype"):
        dataclasses.replace(manifest, source_dtype=None)
    with pytest.raises(ManifestError, match="schema_version 4"):
        Manifest.from_dict({**manifest.to_dict(), "schema_version": 4})
