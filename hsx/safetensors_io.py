"""The one safetensors codec of hsx: header building and parsing, and whole-file read and write.

Standard library only: the SGLang plugin (inside a stock server), the API (without torch) and the worker
all use it. Tensors travel as raw little-endian bytes; bf16 has no stdlib or numpy type and stays words.

Layout: an 8-byte little-endian header length ``n``, ``n`` bytes of JSON (``{name: {dtype, shape,
data_offsets}}``) padded with spaces, then the data. Offsets are relative to the data section, must be
contiguous from 0 and cover it exactly (the reference implementation refuses holes).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

# safetensors dtype names and their item sizes.
DTYPE_SIZES = {"F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "I64": 8, "I32": 4, "U8": 1, "BOOL": 1}
MAX_HEADER_BYTES = 16 << 20


class SafetensorsError(ValueError):
    """A file that is not a well-formed safetensors file."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def nbytes_of(dtype: str, shape: Sequence[int]) -> int:
    size = DTYPE_SIZES[dtype]
    for dim in shape:
        size *= int(dim)
    return size


def encode_header(entries: Iterable[tuple[str, str, Sequence[int], int]], pad_to: int = 0) -> bytes:
    """The length prefix and JSON header for ``(name, dtype, shape, nbytes)`` laid out in order.

    ``pad_to`` reserves room: the JSON is padded with spaces to exactly that many bytes (a streaming
    writer reserves the header before it knows the tensors). Otherwise it is padded to a multiple of 8.
    """
    header: dict[str, Any] = {}
    offset = 0
    for name, dtype, shape, nbytes in entries:
        if nbytes != nbytes_of(dtype, shape):  # a mismatch would corrupt every later tensor
            raise SafetensorsError(f"{name}: {nbytes} bytes for {dtype}{list(shape)}")
        header[name] = {
            "dtype": dtype,
            "shape": [int(d) for d in shape],
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    if pad_to:
        if len(raw) > pad_to:
            raise SafetensorsError(f"header of {len(raw)} bytes does not fit the {pad_to} reserved")
        raw += b" " * (pad_to - len(raw))
    else:
        raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def parse_header(
    prefix: bytes | bytearray | memoryview | mmap.mmap, file_size: int, where: str = "safetensors file"
) -> dict[str, TensorSpec]:
    """Tensor specs from a file's first bytes (at least the length prefix and the whole header)."""
    if len(prefix) < 8:
        raise SafetensorsError(f"{where}: truncated")
    (length,) = struct.unpack("<Q", prefix[:8])
    if length > MAX_HEADER_BYTES or 8 + length > file_size or 8 + length > len(prefix):
        raise SafetensorsError(f"{where}: bad header length {length}")
    try:
        header = json.loads(bytes(prefix[8 : 8 + length]))
    except ValueError as exc:
        raise SafetensorsError(f"{where}: unreadable header: {exc}") from exc
    if not isinstance(header, dict):
        raise SafetensorsError(f"{where}: the header is not an object")
    base = 8 + length
    specs: dict[str, TensorSpec] = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = spec["dtype"]
            shape = tuple(int(d) for d in spec["shape"])
            start, end = (int(x) for x in spec["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise SafetensorsError(f"{where}: malformed entry for {name}") from exc
        if dtype not in DTYPE_SIZES or any(d < 0 for d in shape):
            raise SafetensorsError(f"{where}: tensor {name} has dtype {dtype!r} shape {list(shape)}")
        if not 0 <= start <= end <= file_size - base or end - start != nbytes_of(dtype, shape):
            raise SafetensorsError(f"{where}: tensor {name} does not fit its data offsets")
        specs[name] = TensorSpec(name, dtype, shape, base + start, base + end)
    return specs


def read_header(fh: BinaryIO, where: str = "safetensors file") -> dict[str, TensorSpec]:
    size = os.fstat(fh.fileno()).st_size
    fh.seek(0)
    prefix = fh.read(8)
    if len(prefix) == 8:
        (length,) = struct.unpack("<Q", prefix)
        if length <= MAX_HEADER_BYTES:
            prefix += fh.read(length)
    return parse_header(prefix, size, where)


def write_file(path: str, tensors: Iterable[tuple[str, str, Sequence[int], bytes]]) -> None:
    """Write ``(name, dtype, shape, raw little-endian bytes)`` tuples as one file, fsynced."""
    items = [(name, dtype, shape, memoryview(data).cast("B")) for name, dtype, shape, data in tensors]
    header = encode_header((name, dtype, shape, data.nbytes) for name, dtype, shape, data in items)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, [header, *(data for _, _, _, data in items)])
        os.fsync(fd)
    finally:
        os.close(fd)


# Linux takes at most this many buffers in one writev(2).
_IOV_MAX = 1024


def write_all(fd: int, buffers: Sequence[Any]) -> None:
    """Write every buffer in order with as few system calls as the kernel allows: a writer thread next to
    a busy thread waits for the GIL after each call, so one ``writev`` beats a ``write`` per tensor."""
    views = [memoryview(b).cast("B") for b in buffers]
    views = [v for v in views if len(v)]
    while views:
        written = os.writev(fd, views[:_IOV_MAX])
        while views and written >= len(views[0]):
            written -= len(views.pop(0))
        if written:
            views[0] = views[0][written:]


def read_file(path: str) -> dict[str, tuple[TensorSpec, bytes]]:
    """Every tensor of a file with its raw bytes (small files: dumps in tests, verification prompts)."""
    with open(path, "rb") as fh:
        blob = fh.read()
    specs = parse_header(blob, len(blob), path)
    return {name: (spec, blob[spec.start : spec.end]) for name, spec in specs.items()}
