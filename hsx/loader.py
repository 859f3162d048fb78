"""Read a job's output back, one sample at a time, for drafter training (format: docs/format.md).

Shards are memory-mapped, so a sample costs its own bytes, not its shard's; each yielded sample owns its
arrays (copies), so nothing keeps a shard mapped after iteration moves on. With ``verify_checksums`` the
whole shard is hashed before its first sample is yielded and a mismatch raises :class:`ChecksumMismatch`.

numpy is required; torch only for ``as_torch=True``.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

import numpy as np
import numpy.typing as npt

from hsx.manifest import Manifest, ShardEntry

if TYPE_CHECKING:
    import torch

MAX_HEADER_BYTES = 16 << 20
_NUMPY_DTYPES = {"BF16": "<u2", "F16": "<f2", "F32": "<f4", "I32": "<i4", "I64": "<i8", "U8": "u1"}
_REQUIRED = ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state", "sample_offsets", "sample_index")


class LoaderError(Exception):
    """A shard does not match its manifest entry or the shard format."""


class ChecksumMismatch(LoaderError):
    pass


@dataclass(frozen=True)
class Sample:
    index: int
    input_ids: npt.NDArray[np.int32]  # [T]
    loss_mask: npt.NDArray[np.uint8]  # [T]
    hidden_state: npt.NDArray[Any]  # [T, H]; float32 (from bf16), or raw uint16 bf16 words on request
    aux_hidden_state: npt.NDArray[Any]  # [T, len(aux) * H]


@dataclass(frozen=True)
class TorchSample:
    index: int
    input_ids: torch.Tensor  # int32
    loss_mask: torch.Tensor  # uint8
    hidden_state: torch.Tensor  # the shard's dtype (bfloat16 stays bfloat16)
    aux_hidden_state: torch.Tensor


def bf16_words_to_float32(words: npt.NDArray[np.uint16]) -> npt.NDArray[np.float32]:
    """Exact: a bf16 value is the upper half of the float32 with the same bits."""
    return (words.astype(np.uint32) << np.uint32(16)).view(np.float32)


def _read_header(buffer: mmap.mmap | bytes, path: Path) -> tuple[dict[str, Any], int]:
    if len(buffer) < 8:
        raise LoaderError(f"{path}: truncated safetensors file")
    (length,) = struct.unpack("<Q", buffer[:8])
    if length > MAX_HEADER_BYTES or 8 + length > len(buffer):
        raise LoaderError(f"{path}: bad safetensors header length {length}")
    try:
        header = json.loads(buffer[8 : 8 + length])
    except ValueError as exc:
        raise LoaderError(f"{path}: unreadable safetensors header: {exc}") from exc
    if not isinstance(header, dict):
        raise LoaderError(f"{path}: the safetensors header is not an object")
    return header, 8 + length


def _tensor(
    buffer: mmap.mmap, header: dict[str, Any], base: int, name: str, path: Path
) -> tuple[str, npt.NDArray[Any]]:
    spec = header[name]
    dtype = spec.get("dtype")
    if dtype not in _NUMPY_DTYPES:
        raise LoaderError(f"{path}: tensor {name} has unsupported dtype {dtype!r}")
    start, end = spec["data_offsets"]
    shape = [int(dim) for dim in spec["shape"]]
    count = int(np.prod(shape, dtype=np.int64))
    numpy_dtype = np.dtype(_NUMPY_DTYPES[dtype])
    if not 0 <= start <= end <= len(buffer) - base or end - start != count * numpy_dtype.itemsize:
        raise LoaderError(f"{path}: tensor {name} does not fit its data offsets")
    array = np.frombuffer(buffer, dtype=numpy_dtype, count=count, offset=base + start).reshape(shape)
    return dtype, array


def _open_shard(path: Path, entry: ShardEntry, manifest: Manifest, verify: bool) -> dict[str, Any]:
    with open(path, "rb") as fh:
        size = fh.seek(0, 2)
        if size != entry.bytes or size < 8:
            raise LoaderError(f"{path}: {size} bytes, the manifest says {entry.bytes}")
        buffer = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    if verify:
        digest = hashlib.sha256(buffer).hexdigest()
        if digest != entry.sha256:
            raise ChecksumMismatch(f"{path}: sha256 {digest}, the manifest says {entry.sha256}")
    header, base = _read_header(buffer, path)
    missing = [name for name in _REQUIRED if name not in header]
    if missing:
        raise LoaderError(f"{path}: missing tensors {missing}")
    tensors: dict[str, Any] = {}
    for name in _REQUIRED:
        dtype, tensors[name] = _tensor(buffer, header, base, name, path)
        if name in ("hidden_state", "aux_hidden_state") and dtype != manifest.dtype:
            raise LoaderError(f"{path}: {name} is {dtype}, the manifest says {manifest.dtype}")
    _check_shapes(tensors, entry, manifest, path)
    return tensors


def _check_shapes(tensors: dict[str, Any], entry: ShardEntry, manifest: Manifest, path: Path) -> None:
    offsets = tensors["sample_offsets"]
    tokens = len(tensors["input_ids"])
    aux_width = manifest.hidden_size * (len(manifest.hf_indices) - 1)
    problems = []
    if tensors["loss_mask"].shape != (tokens,):
        problems.append("loss_mask length differs from input_ids")
    if tensors["hidden_state"].shape != (tokens, manifest.hidden_size):
        problems.append(f"hidden_state shape {tensors['hidden_state'].shape}")
    if tensors["aux_hidden_state"].shape != (tokens, aux_width):
        problems.append(f"aux_hidden_state shape {tensors['aux_hidden_state'].shape}")
    if len(offsets) != len(tensors["sample_index"]) + 1 or offsets[0] != 0 or offsets[-1] != tokens:
        problems.append("sample_offsets do not cover the tokens")
    elif (np.diff(offsets) <= 0).any():
        problems.append("sample_offsets are not increasing")
    if len(tensors["sample_index"]) != entry.samples or tokens != entry.tokens:
        problems.append(f"{len(tensors['sample_index'])} samples / {tokens} tokens, manifest disagrees")
    if problems:
        raise LoaderError(f"{path}: " + "; ".join(problems))


def _iter_numpy(output_dir: Path, verify: bool, raw_bf16: bool) -> Iterator[Sample]:
    manifest = Manifest.load(output_dir)
    for entry in manifest.shards:
        path = manifest.shard_path(output_dir, entry)
        tensors = _open_shard(path, entry, manifest, verify)
        offsets = tensors["sample_offsets"]
        convert = manifest.dtype == "BF16" and not raw_bf16
        for k, index in enumerate(tensors["sample_index"].tolist()):
            rows = slice(int(offsets[k]), int(offsets[k + 1]))
            final, aux = tensors["hidden_state"][rows], tensors["aux_hidden_state"][rows]
            yield Sample(
                index=int(index),
                input_ids=tensors["input_ids"][rows].astype(np.int32),
                loss_mask=tensors["loss_mask"][rows].copy(),
                hidden_state=bf16_words_to_float32(final) if convert else final.copy(),
                aux_hidden_state=bf16_words_to_float32(aux) if convert else aux.copy(),
            )
        del tensors, offsets  # drop the views so the mapping can be freed


def _to_torch(sample: Sample, bf16: bool) -> TorchSample:
    import torch

    def states(words: npt.NDArray[Any]) -> torch.Tensor:
        if bf16:  # same bits, reinterpreted; torch's uint16 support is too thin to go through it
            return torch.from_numpy(words.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(words)

    return TorchSample(
        index=sample.index,
        input_ids=torch.from_numpy(sample.input_ids),
        loss_mask=torch.from_numpy(sample.loss_mask),
        hidden_state=states(sample.hidden_state),
        aux_hidden_state=states(sample.aux_hidden_state),
    )


@overload
def iter_samples(
    output_dir: Path | str,
    verify_checksums: bool = ...,
    *,
    raw_bf16: bool = ...,
    as_torch: Literal[False] = ...,
) -> Iterator[Sample]: ...


@overload
def iter_samples(
    output_dir: Path | str,
    verify_checksums: bool = ...,
    *,
    raw_bf16: bool = ...,
    as_torch: Literal[True],
) -> Iterator[TorchSample]: ...


def iter_samples(
    output_dir: Path | str,
    verify_checksums: bool = True,
    *,
    raw_bf16: bool = False,
    as_torch: bool = False,
) -> Iterator[Sample] | Iterator[TorchSample]:
    """Every sample of a job's output in manifest order.

    numpy: bf16 states become float32 unless ``raw_bf16`` (then their uint16 words); F16 and F32 are kept.
    ``as_torch``: torch tensors in the shard's own dtype (bf16 as ``torch.bfloat16``); needs torch.
    """
    directory = Path(output_dir)
    if not as_torch:
        return _iter_numpy(directory, verify_checksums, raw_bf16)
    bf16 = Manifest.load(directory).dtype == "BF16"
    return (_to_torch(sample, bf16) for sample in _iter_numpy(directory, verify_checksums, raw_bf16=True))
