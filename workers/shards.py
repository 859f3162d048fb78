"""Write one shard as a stream: each validated sample's states go from its dump to the shard in chunks.

A shard (format: docs/format.md, schema 2) is a safetensors file. Its header is reserved at the front and
filled in last; the data section holds, for the ``k``-th sample of the shard, one tensor per captured
layer (``s<k>.hidden.<hf_index>`` [T_k, H], and ``s<k>.final_pre_norm`` when captured), then, after all
samples, ``sample_offsets`` I64 [n+1], ``sample_index`` I64 [n], ``input_ids`` I32 [T] and ``loss_mask``
U8 [T].

Each chunk is read once into a reused buffer, checked for non-finite values, hashed and written: memory
does not grow with the number of samples, their length or the hidden size. The data section's sha256 is
computed as it is written; the header is hashed on its own once filled in. A sample found bad while it is
copied is cut off again (the file truncated, the hash restored), so nothing of it stays in the shard.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from hsx import fp8
from hsx.contract import canonical_state_dtype as canonical_state_dtype
from hsx.engine.validation import (
    DTYPE_MISMATCH,
    LAYERS_MISMATCH,
    NON_FINITE,
    TOKEN_COUNT,
    SampleRejected,
    count_non_finite,
)
from hsx.fsutil import WRITE_BEHIND_WINDOW, WriteBehind
from hsx.layout import TOKEN_TENSORS, sample_tensor_name, scale_tensor_name
from hsx.safetensors_io import TensorSpec, encode_header
from hsx.server.faults import crash_point

CHUNK_BYTES = 1 << 20
# Header room per tensor entry: '"s12345.hidden.123":{"dtype":"BF16","shape":[..],"data_offsets":[..]},'
# is under 120 bytes for any realistic size; the reserve is checked when the header is written.
_HEADER_BYTES_PER_TENSOR = 160
_HEADER_BASE_BYTES = 1024


class ShardWriteError(Exception):
    """The shard could not be written; the caller removes the staged file."""

    def __init__(self, path: Path, errno: int | None, detail: str) -> None:
        super().__init__(f"cannot write shard {path}: {detail}")
        self.path = path
        self.errno = errno
        self.detail = detail


@dataclass(frozen=True)
class ShardInfo:
    path: Path
    sha256: str  # of the data section: every byte after the header
    header_sha256: str  # of the first 8 + header-length bytes
    bytes: int
    samples: int
    tokens: int


class ShardStream:
    """One shard, written sample by sample to ``path`` (created exclusively; a staged name)."""

    def __init__(
        self,
        path: Path,
        *,
        dtype: str,
        dump_tensors: Sequence[str],
        capacity: int,
        chunk_bytes: int = CHUNK_BYTES,
        write_behind: int = WRITE_BEHIND_WINDOW,
        store_fp8: bool = False,
    ) -> None:
        self.path = Path(path)
        self.dtype = canonical_state_dtype(dtype)
        self.dump_tensors = list(dump_tensors)
        self.capacity = capacity
        self.store_fp8 = store_fp8
        per_sample = len(self.dump_tensors) * (2 if store_fp8 else 1)
        self._reserved = _HEADER_BASE_BYTES + _HEADER_BYTES_PER_TENSOR * capacity * per_sample
        self._reserved += -self._reserved % 8
        self._buffer = bytearray(chunk_bytes - chunk_bytes % 8)
        self._digest = hashlib.sha256()
        self._data_bytes = 0
        self._entries: list[tuple[str, str, tuple[int, ...], int]] = []
        self._ids: list[npt.NDArray[np.int32]] = []
        self._masks: list[npt.NDArray[np.uint8]] = []
        self._indices: list[int] = []
        self._tokens = 0
        # Seconds spent in os.write (and the write-behind's waits on the disk) and in the closing fsync:
        # the unit's log line carries them (workers.unit_processor.UnitResult), so a bench tells the disk
        # from the copy.
        self.write_s = 0.0
        self.fsync_s = 0.0
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.lseek(self._fd, 8 + self._reserved, os.SEEK_SET)
        except OSError as exc:
            raise ShardWriteError(self.path, exc.errno, exc.strerror or str(exc)) from exc
        # The disk takes the shard while it is written, not all at once at the closing fsync.
        self.write_behind = WriteBehind(self._fd, write_behind)

    @property
    def samples(self) -> int:
        return len(self._indices)

    @property
    def tokens(self) -> int:
        return self._tokens

    def add(
        self,
        sample_index: int,
        input_ids: npt.NDArray[Any],
        loss_mask: npt.NDArray[Any],
        source_fd: int,
        specs: dict[str, TensorSpec],
        check_every_chunk: bool = True,
    ) -> int:
        """Append one sample whose states are ``specs`` in the open file ``source_fd``; returns the bytes
        copied. Raises :class:`SampleRejected` (non-finite values; nothing of the sample stays) or
        :class:`ShardWriteError`. Without ``check_every_chunk`` only each tensor's first chunk is checked
        (the engine counted non-finite values itself)."""
        if self.samples >= self.capacity:
            raise ValueError(f"shard {self.path.name} is full ({self.capacity} samples)")
        tokens = len(input_ids)
        position = self.samples
        missing = [name for name in self.dump_tensors if name not in specs]
        if missing:
            raise SampleRejected(LAYERS_MISMATCH, f"the dump lacks {missing}")
        if len(loss_mask) != tokens:
            raise SampleRejected(TOKEN_COUNT, f"loss_mask has {len(loss_mask)} entries for {tokens} tokens")
        for name in self.dump_tensors:
            if not specs[name].shape or specs[name].shape[0] != tokens:
                raise SampleRejected(
                    TOKEN_COUNT, f"{name} has shape {list(specs[name].shape)} for {tokens} tokens"
                )
        mark = (self._data_bytes, self._digest.copy(), len(self._entries))
        try:
            for name in self.dump_tensors:
                spec = specs[name]
                if spec.dtype != self.dtype:
                    raise SampleRejected(
                        DTYPE_MISMATCH, f"{name} is {spec.dtype}, the shard holds {self.dtype}"
                    )
                stored = sample_tensor_name(position, name)
                if self.store_fp8:
                    self._copy_fp8(source_fd, spec, stored, check_every_chunk)
                    continue
                self._copy(source_fd, spec, check_every_chunk)
                self._entries.append((stored, spec.dtype, spec.shape, spec.nbytes))
        except SampleRejected:
            self._rewind(*mark)
            raise
        except OSError as exc:
            raise ShardWriteError(self.path, exc.errno, exc.strerror or str(exc)) from exc
        # Copies: the caller may reuse its buffers before finish().
        self._ids.append(np.array(input_ids, dtype="<i4", copy=True))
        self._masks.append(np.array(loss_mask, dtype="u1", copy=True))
        self._indices.append(sample_index)
        self._tokens += tokens
        return self._data_bytes - mark[0]

    def _copy(self, source_fd: int, spec: TensorSpec, check_every_chunk: bool) -> None:
        view = memoryview(self._buffer)
        position, first = spec.start, True
        while position < spec.end:
            want = min(len(view), spec.end - position)
            got = os.preadv(source_fd, [view[:want]], position)
            if got <= 0:
                raise SampleRejected("dump_missing", f"{spec.name} ends {spec.end - position} bytes early")
            chunk = view[:got]
            if (check_every_chunk or first) and count_non_finite(chunk, spec.dtype):
                raise SampleRejected(NON_FINITE, f"{spec.name} holds NaN/Inf values")
            self._digest.update(chunk)
            self._write(chunk)
            position += got
            first = False

    def _copy_fp8(self, source_fd: int, spec: TensorSpec, stored: str, check_every_chunk: bool) -> None:
        """Quantize one state tensor row-chunk by row-chunk: codes first, then the tensor's scales."""
        _single_threaded_torch()
        tokens, hidden = spec.shape[0], int(np.prod(spec.shape[1:], dtype=np.int64))
        row_bytes = spec.nbytes // max(tokens, 1)
        rows_per_chunk = max(1, len(self._buffer) // max(row_bytes, 1))
        if len(self._buffer) < row_bytes:
            self._buffer = bytearray(row_bytes)
        view = memoryview(self._buffer)
        scales = np.empty(tokens, dtype="<f4")
        first = True
        for row in range(0, tokens, rows_per_chunk):
            rows = min(rows_per_chunk, tokens - row)
            want = rows * row_bytes
            got = os.preadv(source_fd, [view[:want]], spec.start + row * row_bytes)
            if got != want:
                raise SampleRejected("dump_missing", f"{spec.name} ends {want - got} bytes early")
            chunk = view[:want]
            if (check_every_chunk or first) and count_non_finite(chunk, spec.dtype):
                raise SampleRejected(NON_FINITE, f"{spec.name} holds NaN/Inf values")
            # torch's cast (the worker has torch): the same bytes as hsx.fp8's numpy encoder, 20x faster.
            codes, chunk_scales = fp8.quantize_rows_torch(_as_torch_rows(chunk, spec.dtype, rows, hidden))
            # Every chunk, whatever the engine counted: a NaN or Inf anywhere in a row makes its peak, so
            # its scale, non-finite, and finite rows never give a NaN code (clipped to +-448 first); so
            # the scales alone vouch for every stored byte.
            if fp8.bad_scales(chunk_scales.numpy()) is not None:
                raise SampleRejected(NON_FINITE, f"{spec.name} holds NaN/Inf values")
            data = codes.numpy().reshape(-1).data
            self._digest.update(data)
            self._write(data)
            scales[row : row + rows] = chunk_scales.numpy()
            first = False
        self._entries.append((stored, fp8.FP8_DTYPE, (tokens, hidden), tokens * hidden))
        scale_bytes = scales.view(np.uint8).data  # bytes, so that len() counts bytes
        self._digest.update(scale_bytes)
        self._write(scale_bytes)
        self._entries.append((scale_tensor_name(stored), fp8.SCALE_DTYPE, (tokens,), scales.nbytes))

    def _write(self, data: memoryview | bytes) -> None:
        started = time.monotonic()
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
        self._data_bytes += len(data)
        self.write_behind.advance(8 + self._reserved + self._data_bytes)
        self.write_s += time.monotonic() - started

    def _rewind(self, data_bytes: int, digest: Any, entries: int) -> None:
        os.ftruncate(self._fd, 8 + self._reserved + data_bytes)
        os.lseek(self._fd, 8 + self._reserved + data_bytes, os.SEEK_SET)
        self.write_behind.rewind(8 + self._reserved + data_bytes)
        self._data_bytes, self._digest = data_bytes, digest
        del self._entries[entries:]

    def finish(self) -> ShardInfo:
        """Write the per-token tensors and the header, fsync and close; the file is complete."""
        if not self._indices:
            raise ValueError("a shard needs at least one sample")
        offsets = np.zeros(len(self._ids) + 1, dtype="<i8")
        np.cumsum([len(ids) for ids in self._ids], out=offsets[1:])
        arrays = {
            "sample_offsets": offsets,
            "sample_index": np.asarray(self._indices, dtype="<i8"),
            "input_ids": np.concatenate(self._ids),
            "loss_mask": np.concatenate(self._masks),
        }
        try:
            for name, dtype in TOKEN_TENSORS:
                array = arrays[name]
                data = memoryview(np.ascontiguousarray(array).tobytes())
                self._digest.update(data)
                self._write(data)
                self._entries.append((name, dtype, tuple(array.shape), array.nbytes))
            header = encode_header(self._entries, pad_to=self._reserved)
            os.pwrite(self._fd, header, 0)
            crash_point("before_shard_fsync")
            syncing = time.monotonic()
            os.fsync(self._fd)
            self.fsync_s += time.monotonic() - syncing
        except OSError as exc:
            raise ShardWriteError(self.path, exc.errno, exc.strerror or str(exc)) from exc
        finally:
            self._close()
        return ShardInfo(
            path=self.path,
            sha256=self._digest.hexdigest(),
            header_sha256=hashlib.sha256(header).hexdigest(),  # as hsx.layout.shard_checksums reads it
            bytes=len(header) + self._data_bytes,
            samples=self.samples,
            tokens=self._tokens,
        )

    def _close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def discard(self) -> None:
        """Close and remove the file (the unit was abandoned, or no sample made it)."""
        self._close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


_torch_threads_set = False


def _single_threaded_torch() -> None:
    """The fp8 encoder runs on the collecting thread of each worker process. torch's intra-op pool, on a
    host whose cores also run the engine and the other workers, cost far more in contention than it gave:
    on the 2-core dev host a 1 MiB chunk took 80 ms with the default pool and 2.4 ms with one thread.
    The worker process runs no other torch work (engines are processes of their own)."""
    global _torch_threads_set
    if not _torch_threads_set:
        import torch

        torch.set_num_threads(1)
        _torch_threads_set = True


def _as_torch_rows(chunk: memoryview, dtype: str, rows: int, hidden: int) -> Any:
    """A chunk of the dump as a torch tensor [rows, hidden] of its own dtype, without a copy."""
    import torch

    if dtype == "BF16":
        return torch.frombuffer(chunk, dtype=torch.int16).view(torch.bfloat16).reshape(rows, hidden)
    torch_dtype = {"F16": torch.float16, "F32": torch.float32}[dtype]
    return torch.frombuffer(chunk, dtype=torch_dtype).reshape(rows, hidden)
