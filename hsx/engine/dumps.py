"""The one dump reader: a captured request's dump, opened by file descriptor without reading its states.

A dump (format: :mod:`hsx.contract`) is ``<dump_dir>/<rid>/`` with ``states.safetensors`` and a
``meta.json`` written last. :func:`open_dump` waits for the meta, reads it and the states file's header,
and keeps one descriptor open: the shard writer copies the states from it in chunks, checking and hashing
each chunk as it passes, so a worker's memory does not grow with prompt length or hidden size. The
preflight (``hsx verify``) reads through the same object: it counts non-finite values chunk by chunk, and
loads states whole (:func:`read_dump`) only for its optional comparison against transformers.

No torch: the API process uses this. bf16 states come back as raw ``uint16`` words; :func:`as_float32`
widens them.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from hsx import contract, layout
from hsx.engine.client import DumpCorrupt, DumpMissing
from hsx.engine.validation import DumpVerdict, check_dump, count_non_finite
from hsx.safetensors_io import SafetensorsError, TensorSpec, read_header
from hsx.samples import bf16_words_to_float32

# How a dump's safetensors dtype is held in numpy; bf16 has no numpy type, so its words stay uint16.
NUMPY_DTYPES: dict[str, npt.DTypeLike] = {
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,
    "I32": np.int32,
    "I64": np.int64,
}
CHUNK_BYTES = 1 << 20


def wait_for_meta(dump_dir: str, rid: str, wait_seconds: float) -> str:
    """The dump directory of ``rid`` once its ``meta.json`` exists (written last: the dump is complete)."""
    directory = contract.dump_path(dump_dir, rid)
    meta_path = os.path.join(directory, contract.META_FILE)
    deadline = time.monotonic() + max(0.0, wait_seconds)
    pause = 0.002
    while not os.path.isfile(meta_path):
        if time.monotonic() >= deadline:
            raise DumpMissing(f"no dump for {rid} in {dump_dir} after {wait_seconds:g}s")
        time.sleep(pause)
        # A short cap: the shard writer takes dumps in order, and every ms it oversleeps a landed dump is a
        # ms it is not copying (a stat every 10 ms costs nothing).
        pause = min(pause * 2, 0.01)
    return directory


def delete_dump(dump_dir: str, rid: str) -> None:
    shutil.rmtree(contract.dump_path(dump_dir, rid), ignore_errors=True)


@dataclass
class DumpFile:
    meta: contract.DumpMeta
    specs: dict[str, TensorSpec]  # every tensor of states.safetensors, offsets absolute in the file
    fd: int
    directory: str

    def input_ids(self) -> npt.NDArray[np.int32]:
        spec = self.specs["input_ids"]
        raw = os.pread(self.fd, spec.nbytes, spec.start)
        dtype = {"I32": "<i4", "I64": "<i8"}.get(spec.dtype)
        if dtype is None or len(raw) != spec.nbytes:
            raise DumpCorrupt(f"{self.directory}: input_ids is {spec.dtype} with {len(raw)} bytes")
        return np.frombuffer(raw, dtype=dtype).astype(np.int32, copy=False)

    def state_specs(self) -> dict[str, TensorSpec]:
        return {name: spec for name, spec in self.specs.items() if name != "input_ids"}

    def chunks(self, name: str, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
        """The bytes of one tensor, front to back, ``chunk_bytes`` at a time (a multiple of 8)."""
        spec = self.specs[name]
        step = max(8, chunk_bytes - chunk_bytes % 8)
        for start in range(spec.start, spec.end, step):
            want = min(step, spec.end - start)
            data = os.pread(self.fd, want, start)
            if len(data) != want:
                raise DumpCorrupt(f"{self.directory}: {name} ends {spec.end - start - len(data)} bytes early")
            yield data

    def non_finite_counts(self) -> dict[str, int]:
        """NaN/Inf values per state tensor, counted chunk by chunk (never the whole state in memory)."""
        return {
            name: sum(count_non_finite(chunk, spec.dtype) for chunk in self.chunks(name))
            for name, spec in self.state_specs().items()
        }

    def read_state(self, name: str) -> npt.NDArray[Any]:
        """One state tensor whole, [T, H] (bf16 as uint16 words): for checks that need every value."""
        spec = self.specs[name]
        numpy_dtype = NUMPY_DTYPES.get(spec.dtype)
        if numpy_dtype is None:
            raise DumpCorrupt(f"tensor {name} has unsupported dtype {spec.dtype}")
        data = b"".join(self.chunks(name))
        try:
            array = np.frombuffer(data, dtype=np.dtype(numpy_dtype).newbyteorder("<"))
            return array.reshape(spec.shape)
        except ValueError as exc:  # a byte count that does not fit the shape
            raise DumpCorrupt(f"tensor {name}: {exc}") from exc

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> DumpFile:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def open_dump(dump_dir: str, rid: str, wait_seconds: float) -> DumpFile:
    """The complete dump of ``rid``, waiting up to ``wait_seconds`` for the engine to finish writing it;
    :class:`DumpMissing` when none came, :class:`DumpCorrupt` when it cannot be read."""
    directory = wait_for_meta(dump_dir, rid, wait_seconds)
    try:
        with open(os.path.join(directory, contract.META_FILE), encoding="utf-8") as fh:
            meta = contract.DumpMeta.from_json(fh.read())
        with open(os.path.join(directory, contract.STATES_FILE), "rb") as states:
            specs = read_header(states, f"dump of {rid}")
            fd = os.dup(states.fileno())
    except (OSError, ValueError, TypeError, KeyError, SafetensorsError) as exc:
        raise DumpCorrupt(f"dump of {rid} is unreadable: {exc}") from exc
    if meta.rid != rid:
        os.close(fd)
        raise DumpCorrupt(f"dump directory of {rid} holds the meta of {meta.rid}")
    if "input_ids" not in specs:
        os.close(fd)
        raise DumpCorrupt(f"dump of {rid} has no input_ids tensor")
    return DumpFile(meta=meta, specs=specs, fd=fd, directory=directory)


def validate_open_dump(
    dump: DumpFile,
    sent_ids: Sequence[int] | npt.NDArray[Any],
    cached_tokens_reported: int | None,
    info: contract.EngineInfo,
    *,
    count_values: bool = False,
) -> DumpVerdict:
    """The validator's verdict on an open dump of a request to the engine described by ``info``: the one
    call the job's per-sample check and the preflight share. ``count_values``: count NaN/Inf in the dump's
    bytes here (the preflight); without it the engine's own count is used, and the job counts the rest
    chunk by chunk as it copies the states into the shard."""
    counts = dict(dump.meta.non_finite) if dump.meta.non_finite is not None else None
    source = "counted by the engine"
    if count_values:
        in_bytes = dump.non_finite_counts()
        engine = counts or {}
        counts = {name: max(in_bytes.get(name, 0), engine.get(name, 0)) for name in {*in_bytes, *engine}}
        source = "counted in the dump"
    return check_dump(
        dump.meta,
        dump.input_ids(),
        dump.state_specs(),
        sent_ids,
        cached_tokens_reported,
        layout.state_tensor_names(info.hf_indices, info.final_state),
        info.hidden_size,
        info.dtype,
        counts,
        source,
    )


@dataclass
class Dump:
    """A dump with its states loaded, for comparisons that need every value (``hsx verify``'s reference
    check, tests); the job never builds one."""

    meta: contract.DumpMeta
    input_ids: npt.NDArray[np.int32]
    states: dict[int, npt.NDArray[Any]]  # hf_index -> [T, H]; bf16 as uint16 words
    dtypes: dict[int, str]  # hf_index -> safetensors dtype name ("F32", "BF16", ...)
    path: str

    def state_float32(self, hf_index: int) -> npt.NDArray[np.float32]:
        return as_float32(self.states[hf_index], self.dtypes[hf_index])


def load_states(dump: DumpFile) -> Dump:
    """Every ``hidden.<i>`` state of an open dump, read whole through the same descriptor."""
    states: dict[int, npt.NDArray[Any]] = {}
    dtypes: dict[int, str] = {}
    for name, spec in dump.state_specs().items():
        if not name.startswith("hidden."):
            continue
        try:
            hf_index = layout.parse_tensor_name(name)
        except ValueError as exc:
            raise DumpCorrupt(f"dump of {dump.meta.rid} has a badly named tensor {name!r}") from exc
        states[hf_index] = dump.read_state(name)
        dtypes[hf_index] = spec.dtype
    return Dump(dump.meta, dump.input_ids(), states, dtypes, dump.directory)


def read_dump(dump_dir: str, rid: str, wait_seconds: float) -> Dump:
    """:func:`open_dump`, then :func:`load_states`."""
    with open_dump(dump_dir, rid, wait_seconds) as dump:
        return load_states(dump)


def as_float32(raw: npt.NDArray[Any], dtype: str) -> npt.NDArray[np.float32]:
    """A state as float32: bf16 words are the high halves of float32 words, so they widen by a shift."""
    if contract.STATE_DTYPES.get(dtype) == "BF16":
        return bf16_words_to_float32(np.ascontiguousarray(raw).view(np.uint16))
    return np.asarray(raw, dtype=np.float32)
