"""A captured request's dump, opened without reading its states: the meta, the tensor layout and the ids.

The states themselves (gigabytes for a long prompt of a large model) are never loaded here: the shard
writer copies them from this file in chunks, checking and hashing each chunk as it passes, so a worker's
memory does not grow with prompt length or hidden size.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from hsx import contract
from hsx.engine_client import DumpCorrupt, wait_for_meta
from hsx.safetensors_io import SafetensorsError, TensorSpec, read_header


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

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def open_dump(dump_dir: str, rid: str, wait_seconds: float) -> DumpFile:
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
