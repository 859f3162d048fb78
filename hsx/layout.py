"""The on-disk contract: every name hsx writes to a disk or a table and later parses, in one place.

Standard library only: the SGLang plugin imports this inside a stock server's scheduler process, and the
API imports it without torch. Each name has its writer and its parser side by side, so the two cannot
drift apart; a parser refuses what its writer would never produce. Formats: docs/format.md.

- Per-sample state tensors (a dump's and a shard's): the aux layers' ``hidden.<hf_index>`` in the job's
  order, then the post-norm final state ``hidden.<N>`` and/or the pre-norm one ``final_pre_norm``.
- Shard tensors: sample ``k`` of a shard holds ``s<k>.<state tensor>``; after every sample the shard holds
  the token tensors of :data:`TOKEN_TENSORS`, in that order.
- Shard files: ``shard-NNNNN.safetensors`` once placed; ``.shard-NNNNN.aA.staged`` while attempt ``A``
  of unit ``NNNNN`` writes it (hidden, so listings of a live output show finished shards only).
- Lease owner: ``host:pid@engine_url``, the worker process that holds a unit and the engine it feeds.
- fp8 scales (schema 3): ``s<k>.<state tensor>.scale`` F32 [T_k] right after the codes it scales.
- Schema version of the manifest (and so of the shards it lists).
- Atomic placement: write a temp file beside the target, fsync, rename over it, fsync the directory, so
  a reader sees the old file or the new one, never a part, and a crash leaves at most a ``.tmp`` file.
  ("Place" is this rename into place; "publish" is reserved for the object store, "feed" for SpecForge.)
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from hsx.fsutil import fsync_dir

# --- schema ------------------------------------------------------------------------------------------
# 3: schema 2 with fp8 states: e4m3 codes plus a per-token float32 scale per state tensor. Written by a
#    job with state_dtype "fp8_e4m3"; a job that keeps the engine's dtype still writes 2, so readers that
#    predate fp8 keep reading it.
# 2: shards written as a stream (per-sample state tensors, data and header hashed apart; docs/format.md).
# 1: shards with every state tensor concatenated, one sha256 over the whole file. All are read.
SCHEMA_VERSION = 2
FP8_SCHEMA_VERSION = 3
READABLE_SCHEMA_VERSIONS = (1, 2, 3)
MANIFEST_FILE = "manifest.json"

# --- per-sample state tensors ------------------------------------------------------------------------
# "post": hidden.<N> is the post-norm final state; "pre": only the pre-norm one, as PRE_NORM_TENSOR; "both".
FINAL_STATES = ("post", "pre", "both")
# The final state before the model's final norm (the last decoder layer's output); vLLM's extractor and
# the speculators trainer use it.
PRE_NORM_TENSOR = "final_pre_norm"
_HIDDEN = re.compile(r"hidden\.(0|[1-9][0-9]*)")


def tensor_name(hf_index: int) -> str:
    """The state tensor of Hugging Face ``hidden_states[hf_index]``."""
    if hf_index < 0:
        raise ValueError(f"hf_index {hf_index} is negative")
    return f"hidden.{hf_index}"


def parse_tensor_name(name: str) -> int:
    """The Hugging Face index of a ``hidden.<i>`` tensor; ValueError for anything else."""
    match = _HIDDEN.fullmatch(name)
    if match is None:
        raise ValueError(f"not a hidden-state tensor name: {name!r}")
    return int(match.group(1))


def state_tensor_names(hf_indices: Sequence[int], final_state: str) -> list[str]:
    """The state tensors of one sample, in dump and shard order: the aux layers, then the final state(s).

    ``hf_indices`` lists the aux layers' indices and then the final state's (``N``) whatever
    ``final_state`` is; with ``pre`` the pre-norm tensor stands in place of ``hidden.<N>``.
    """
    if final_state not in FINAL_STATES:
        raise ValueError(f"final_state {final_state!r} is not one of {FINAL_STATES}")
    if not hf_indices:
        raise ValueError("hf_indices must hold at least the final state's index")
    names = [tensor_name(i) for i in hf_indices[:-1]]
    if final_state in ("post", "both"):
        names.append(tensor_name(hf_indices[-1]))
    if final_state in ("pre", "both"):
        names.append(PRE_NORM_TENSOR)
    return names


# --- shard tensors -----------------------------------------------------------------------------------
# Written after every sample's states, in this order: (name, safetensors dtype).
TOKEN_TENSORS = (
    ("sample_offsets", "I64"),  # [n+1]: sample k holds tokens offsets[k]:offsets[k+1]
    ("sample_index", "I64"),  # [n]: each sample's index in the dataset
    ("input_ids", "I32"),  # [T]
    ("loss_mask", "U8"),  # [T]
)
TOKEN_TENSOR_NAMES = tuple(name for name, _ in TOKEN_TENSORS)
_SAMPLE_TENSOR = re.compile(r"s(0|[1-9][0-9]*)\.(.+)")


def sample_tensor_name(position: int, state_tensor: str) -> str:
    """The shard tensor holding ``state_tensor`` of the shard's ``position``-th sample."""
    if position < 0 or not state_tensor:
        raise ValueError(f"cannot name sample {position}'s tensor {state_tensor!r}")
    return f"s{position}.{state_tensor}"


# Schema 3: the per-token float32 scales [T_k] of an fp8 state tensor follow it, named after it.
SCALE_SUFFIX = ".scale"


def scale_tensor_name(shard_tensor: str) -> str:
    """The scales of an fp8 shard tensor: ``s<k>.hidden.<i>`` -> ``s<k>.hidden.<i>.scale``."""
    if not shard_tensor or shard_tensor.endswith(SCALE_SUFFIX):
        raise ValueError(f"cannot name the scales of {shard_tensor!r}")
    return f"{shard_tensor}{SCALE_SUFFIX}"


def parse_sample_tensor_name(name: str) -> tuple[int, str]:
    """``(position, state tensor)`` of a ``s<k>.<state tensor>`` name; ValueError for anything else."""
    match = _SAMPLE_TENSOR.fullmatch(name)
    if match is None:
        raise ValueError(f"not a per-sample shard tensor name: {name!r}")
    return int(match.group(1)), match.group(2)


# --- shard files -------------------------------------------------------------------------------------
_SHARD = re.compile(r"shard-([0-9]{5,})\.safetensors")
_STAGED = re.compile(r"\.shard-([0-9]{5,})\.a([0-9]+)\.staged")


def shard_file_name(unit_index: int) -> str:
    """The placed shard of a unit (its final name)."""
    if unit_index < 0:
        raise ValueError(f"unit_index {unit_index} is negative")
    return f"shard-{unit_index:05d}.safetensors"


def parse_shard_file_name(name: str) -> int | None:
    """The unit of a placed shard's file name; None for any other name."""
    match = _SHARD.fullmatch(name)
    return int(match.group(1)) if match else None


def staged_shard_name(unit_index: int, attempt: int) -> str:
    """The file an attempt writes its shard to before the commit places it."""
    if unit_index < 0 or attempt < 0:
        raise ValueError(f"unit {unit_index} attempt {attempt}: negative")
    return f".shard-{unit_index:05d}.a{attempt}.staged"


def parse_staged_shard_name(name: str) -> tuple[int, int] | None:
    """``(unit_index, attempt)`` of a staged shard's file name; None for any other name."""
    match = _STAGED.fullmatch(name)
    return (int(match.group(1)), int(match.group(2))) if match else None


def is_temp_name(name: str) -> bool:
    """A file :func:`write_atomically` (or a crashed writer) leaves behind: never part of an output."""
    return name.startswith(".") and name.endswith(".tmp")


# --- lease owner -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LeaseOwner:
    host: str
    pid: int
    engine_url: str

    @property
    def worker(self) -> str:
        return f"{self.host}:{self.pid}"


def lease_owner(host: str, pid: int, engine_url: str) -> str:
    """Who holds a lease: the process and the engine it feeds, so a dead horse's leases can be found and
    units can be counted per engine. A host name holds no ``@`` or ``:``, so the first ``@`` splits."""
    if not host or "@" in host or ":" in host or pid < 0 or not engine_url:
        raise ValueError(f"cannot build a lease owner from {host!r}, {pid!r}, {engine_url!r}")
    return f"{host}:{pid}@{engine_url}"


def split_lease_owner(owner: str | None) -> tuple[str | None, str | None]:
    """``(worker, engine_url)`` of a stored owner, for display and counting: an owner written by an older
    version without an engine comes back whole as the worker, with no engine."""
    if not owner:
        return None, None
    worker, sep, engine = owner.partition("@")
    return (worker, engine) if sep else (owner, None)


def parse_lease_owner(owner: str) -> LeaseOwner:
    """The parts of ``host:pid@engine_url``; ValueError for anything :func:`lease_owner` would not write."""
    worker, engine = split_lease_owner(owner)
    host, sep, pid = (worker or "").rpartition(":")
    if not sep or not host or not engine or not pid.isdigit() or ":" in host:
        raise ValueError(f"not a lease owner (host:pid@engine_url): {owner!r}")
    return LeaseOwner(host, int(pid), engine)


# --- atomic placement --------------------------------------------------------------------------------
@contextlib.contextmanager
def atomic_file(path: Path | str, *, text: bool = False, sync_dir: bool = True) -> Iterator[IO[Any]]:
    """Write ``path`` through the yielded file: a reader sees the previous file or the whole new one.

    The file is written under a unique hidden temp name (two writers never share one), fsynced and renamed
    onto ``path`` when the block ends; on an error the temp file is removed and ``path`` is untouched.
    ``sync_dir=False`` skips the directory fsync where losing the rename in a power cut is harmless (an
    engine's dump: the worker asks again) and its cost is paid per sample."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    try:
        with open(tmp, "w" if text else "wb", encoding="utf-8" if text else None) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if sync_dir:
        fsync_dir(path.parent)


def write_atomically(path: Path | str, data: bytes | str, *, sync_dir: bool = True) -> Path:
    """Place ``data`` at ``path`` through :func:`atomic_file`."""
    with atomic_file(path, sync_dir=sync_dir) as fh:
        fh.write(data.encode("utf-8") if isinstance(data, str) else data)
    return Path(path)


def place_file(source: Path | str, target: Path | str) -> None:
    """Rename a complete, fsynced file (a staged shard) to its final name, durably."""
    os.replace(source, target)
    fsync_dir(Path(target).parent)


# --- a shard's checksums (schema 2 and later) -------------------------------------------------------------
# A shard is recorded (job table, manifest, stream items) with two sha256: ``sha256`` of its data section,
# everything after the 8-byte header length and the header, and ``header_sha256`` of everything before it.
# The writer (workers/shards.py) hashes the data as it streams it and the header it writes last; readers of
# a whole file compute both here.
_CHECKSUM_CHUNK = 1 << 20


def data_section_start(prefix: Any) -> int:
    """Where the data section of a safetensors file starts, from its first 8 bytes."""
    return 8 + int.from_bytes(bytes(prefix[:8]), "little")


def shard_checksums(buffer: Any) -> tuple[str, str]:
    """``(header_sha256, sha256)`` of a whole shard in memory (bytes or an mmap)."""
    view = memoryview(buffer)
    start = data_section_start(view)
    return hashlib.sha256(view[:start]).hexdigest(), hashlib.sha256(view[start:]).hexdigest()


def shard_data_sha256(path: Path | str) -> str | None:
    """``sha256`` of a shard file's data section, read in chunks; None when the file is gone or truncated."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as fh:
            prefix = fh.read(8)
            if len(prefix) < 8:
                return None
            fh.seek(data_section_start(prefix))
            while chunk := fh.read(_CHECKSUM_CHUNK):
                digest.update(chunk)
    except FileNotFoundError:
        return None
    return digest.hexdigest()
