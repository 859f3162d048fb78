"""Accumulate captured samples and write them as one crash-safe safetensors shard.

A shard holds, for ``n`` samples of ``T_total`` tokens in all (format: docs/format.md):

* ``input_ids`` I32 [T_total], ``loss_mask`` U8 [T_total]
* ``hidden_state`` [T_total, H]: the final post-norm state
* ``aux_hidden_state`` [T_total, 3H]: the aux layers side by side, in ``aux_hf_indices`` order
* ``sample_offsets`` I64 [n+1] (sample ``k`` is rows ``offsets[k]:offsets[k+1]``), ``sample_index`` I64 [n]

The file is the same safetensors layout as :func:`hsx.contract.write_safetensors` produces, but written
here by streaming each sample's arrays straight from memory (no concatenated copy of a multi-gigabyte
tensor) and hashing the bytes as they are written. It appears under its final name only once complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from hsx.contract import DTYPE_SIZES
from hsx.fsutil import fsync_dir
from workers.faults import crash_point

# Accepted spellings of the state dtype, mapped to the safetensors name the shard uses.
STATE_DTYPES = {
    "BF16": "BF16",
    "bf16": "BF16",
    "bfloat16": "BF16",
    "F16": "F16",
    "fp16": "F16",
    "float16": "F16",
    "F32": "F32",
    "fp32": "F32",
    "float32": "F32",
}
# How each state dtype arrives in numpy: bf16 has no numpy type, so it travels as its raw 16-bit words.
NUMPY_STATE_DTYPES: dict[str, np.dtype[Any]] = {
    "BF16": np.dtype("<u2"),
    "F16": np.dtype("<f2"),
    "F32": np.dtype("<f4"),
}


def canonical_state_dtype(dtype: str) -> str:
    try:
        return STATE_DTYPES[dtype]
    except KeyError:
        raise ValueError(
            f"unsupported state dtype {dtype!r}; expected one of {sorted(STATE_DTYPES)}"
        ) from None


class ShardWriteError(Exception):
    """The shard could not be written; nothing is left under its final name or a temp name."""

    def __init__(self, path: Path, errno: int | None, detail: str) -> None:
        super().__init__(f"cannot write shard {path}: {detail}")
        self.path = path
        self.errno = errno
        self.detail = detail


@dataclass(frozen=True)
class ShardInfo:
    path: Path
    sha256: str
    bytes: int
    samples: int
    tokens: int


@dataclass(frozen=True)
class _PendingSample:
    index: int
    input_ids: npt.NDArray[np.int32]
    loss_mask: npt.NDArray[np.uint8]
    final: npt.NDArray[Any]  # [T, H]
    aux: npt.NDArray[Any]  # [T, len(aux) * H]


class ShardBuilder:
    """Samples for one shard, held in memory until :meth:`write`."""

    def __init__(
        self, hidden_size: int, dtype: str, aux_hf_indices: Sequence[int], final_hf_index: int
    ) -> None:
        if hidden_size < 1:
            raise ValueError(f"hidden_size must be positive, got {hidden_size}")
        if not aux_hf_indices:
            raise ValueError("at least one aux layer is needed")
        if final_hf_index in aux_hf_indices or len(set(aux_hf_indices)) != len(aux_hf_indices):
            raise ValueError(f"layer indices repeat: aux {list(aux_hf_indices)}, final {final_hf_index}")
        self.hidden_size = hidden_size
        self.dtype = canonical_state_dtype(dtype)
        self.numpy_dtype = NUMPY_STATE_DTYPES[self.dtype]
        self.aux_hf_indices = list(aux_hf_indices)
        self.final_hf_index = final_hf_index
        self._samples: list[_PendingSample] = []
        self._tokens = 0

    @property
    def samples(self) -> int:
        return len(self._samples)

    @property
    def tokens(self) -> int:
        return self._tokens

    @property
    def state_bytes(self) -> int:
        """Bytes of hidden states held so far (what a caller watches to decide when to write)."""
        return self._tokens * self.hidden_size * (1 + len(self.aux_hf_indices)) * self.numpy_dtype.itemsize

    def reset(self) -> None:
        self._samples.clear()
        self._tokens = 0

    def _state(self, states: Mapping[int, npt.NDArray[Any]], hf_index: int, tokens: int) -> npt.NDArray[Any]:
        if hf_index not in states:
            raise ValueError(f"missing hidden state for hf index {hf_index} (have {sorted(states)})")
        array = states[hf_index]
        if self.dtype == "BF16" and array.dtype.kind == "i" and array.dtype.itemsize == 2:
            # torch cannot view bf16 as uint16, so words often arrive as int16: same bits, reinterpret them.
            array = array.view(array.dtype.str.replace("i", "u"))
        if array.shape != (tokens, self.hidden_size):
            raise ValueError(
                f"hf index {hf_index}: shape {array.shape}, expected {(tokens, self.hidden_size)}"
            )
        if array.dtype.newbyteorder("<") != self.numpy_dtype.newbyteorder("<"):
            raise ValueError(f"hf index {hf_index}: numpy dtype {array.dtype} does not carry {self.dtype}")
        return array

    def add(
        self,
        sample_index: int,
        input_ids: Sequence[int] | npt.NDArray[Any],
        loss_mask: Sequence[int] | npt.NDArray[Any],
        states: Mapping[int, npt.NDArray[Any]],
    ) -> None:
        """Add one sample; the arrays are copied, so the caller may reuse its buffers."""
        ids = np.asarray(input_ids, dtype=np.int64)
        mask = np.asarray(loss_mask)
        tokens = len(ids)
        if ids.ndim != 1 or tokens == 0:
            raise ValueError(f"sample {sample_index}: input_ids must be a non-empty 1-D sequence")
        if mask.shape != (tokens,):
            raise ValueError(f"sample {sample_index}: loss_mask shape {mask.shape}, expected {(tokens,)}")
        if ids.min() < 0 or ids.max() > np.iinfo(np.int32).max:
            raise ValueError(f"sample {sample_index}: token ids do not fit in int32")
        if not np.isin(mask, (0, 1)).all():
            raise ValueError(f"sample {sample_index}: loss_mask must hold only 0 and 1")
        final = self._state(states, self.final_hf_index, tokens)
        aux_parts = [self._state(states, hf_index, tokens) for hf_index in self.aux_hf_indices]
        self._samples.append(
            _PendingSample(
                index=sample_index,
                input_ids=ids.astype("<i4"),
                loss_mask=mask.astype("u1"),
                final=np.array(final, dtype=self.numpy_dtype, order="C", copy=True),
                aux=np.ascontiguousarray(np.concatenate(aux_parts, axis=1), dtype=self.numpy_dtype),
            )
        )
        self._tokens += tokens

    # --- writing -----------------------------------------------------------------------------------

    def _tensor_parts(self) -> list[tuple[str, str, list[int], list[npt.NDArray[Any]]]]:
        """Every tensor as (name, safetensors dtype, shape, arrays whose bytes, in order, make its data)."""
        offsets = np.zeros(len(self._samples) + 1, dtype="<i8")
        np.cumsum([len(s.input_ids) for s in self._samples], out=offsets[1:])
        width = self.hidden_size * len(self.aux_hf_indices)
        return [
            ("input_ids", "I32", [self._tokens], [s.input_ids for s in self._samples]),
            ("loss_mask", "U8", [self._tokens], [s.loss_mask for s in self._samples]),
            ("hidden_state", self.dtype, [self._tokens, self.hidden_size], [s.final for s in self._samples]),
            ("aux_hidden_state", self.dtype, [self._tokens, width], [s.aux for s in self._samples]),
            ("sample_offsets", "I64", [len(offsets)], [offsets]),
            (
                "sample_index",
                "I64",
                [len(self._samples)],
                [np.array([s.index for s in self._samples], "<i8")],
            ),
        ]

    def write(self, final_path: Path) -> ShardInfo:
        """Write the held samples to ``final_path`` atomically; the builder keeps them (see :meth:`reset`)."""
        if not self._samples:
            raise ValueError("a shard needs at least one sample")
        final_path = Path(final_path)
        tmp_path = final_path.with_name(f".{final_path.name}.{secrets.token_hex(6)}.tmp")
        try:
            final_path.parent.mkdir(parents=True, exist_ok=True)
            digest, size = _write_streaming(tmp_path, self._tensor_parts())
            os.replace(tmp_path, final_path)
        except BaseException as exc:  # interrupts too: a temp file must never outlive a failed write
            with contextlib.suppress(OSError):
                tmp_path.unlink()
            if isinstance(exc, OSError):
                raise ShardWriteError(final_path, exc.errno, exc.strerror or str(exc)) from exc
            raise
        try:
            fsync_dir(final_path.parent)
        except OSError as exc:  # the shard is complete and in place; only the rename's durability is unknown
            raise ShardWriteError(final_path, exc.errno, f"fsync of the directory: {exc}") from exc
        return ShardInfo(path=final_path, sha256=digest, bytes=size, samples=self.samples, tokens=self.tokens)


def _header(parts: Iterable[tuple[str, str, list[int], list[npt.NDArray[Any]]]]) -> bytes:
    header: dict[str, Any] = {}
    offset = 0
    for name, dtype, shape, arrays in parts:
        length = sum(array.nbytes for array in arrays)
        expected = DTYPE_SIZES[dtype] * int(np.prod(shape, dtype=np.int64))
        if length != expected:  # an internal invariant; a mismatch would corrupt every later tensor
            raise AssertionError(f"{name}: {length} bytes for {dtype}{shape}, expected {expected}")
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + length]}
        offset += length
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)  # safetensors pads the header so tensor data is 8-byte aligned


def _write_streaming(
    path: Path, parts: list[tuple[str, str, list[int], list[npt.NDArray[Any]]]]
) -> tuple[str, int]:
    """Create ``path`` exclusively, write the safetensors bytes, fsync; return (sha256, size)."""
    header = _header(parts)
    digest = hashlib.sha256()
    size = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o644)
    with os.fdopen(fd, "wb", buffering=1 << 20) as fh:

        def emit(data: bytes | memoryview) -> None:
            nonlocal size
            digest.update(data)
            fh.write(data)
            size += len(data)

        emit(struct.pack("<Q", len(header)))
        emit(header)
        for _, _, _, arrays in parts:
            for array in arrays:
                emit(array.data.cast("B"))
        fh.flush()
        crash_point("before_shard_fsync")
        os.fsync(fh.fileno())
    return digest.hexdigest(), size
