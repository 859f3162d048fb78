"""Export a job's output into a trainer's own on-disk layout: the streaming driver and the report.

Samples come one at a time through :func:`hsx.loader.iter_samples` (shards stay memory-mapped, a sample
costs its own bytes), and a target writer (:mod:`hsx.integrations.specforge.export`,
:mod:`hsx.integrations.speculators`,
:mod:`hsx.integrations.modelopt`) turns each into that trainer's files. Everything is written into a hidden
staging folder beside ``DEST`` and renamed to ``DEST`` only once it is complete and counted, so ``DEST``
either does not exist or holds a whole export; a crash leaves at most a ``.<name>.hsx-partial-*`` folder.

``DEST`` then holds, next to the trainer's files, ``hsx_export.json`` (counts, the source's identity, where
the trainer should be pointed) and ``hsx_export.sha256`` (one ``sha256sum -c`` line per file written).

This module imports no torch; the writers import it when they run. The API uses :func:`refusal` to refuse
an export that cannot be made before it queues one.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import secrets
import shutil
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from hsx.errors import BadRequest, Conflict, NotFound
from hsx.fsutil import fsync_dir
from hsx.manifest import MANIFEST_FILE, Manifest, ManifestError

if TYPE_CHECKING:
    from hsx.samples import TorchSample

FORMATS = ("specforge", "speculators", "modelopt")
REPORT_FILE = "hsx_export.json"
CHECKSUMS_FILE = "hsx_export.sha256"
REPORT_VERSION = 1
_WRITERS = {
    "specforge": "hsx.integrations.specforge.export:SpecForgeWriter",
    "speculators": "hsx.integrations.speculators:SpeculatorsWriter",
    "modelopt": "hsx.integrations.modelopt:ModelOptWriter",
}
_PARTIAL_MARK = ".hsx-partial-"


class ExportError(BadRequest):
    """The export cannot be made from this output (a missing state, a bad option, a bad destination)."""

    error = "export_refused"


class ExportSourceMissing(NotFound):
    error = "export_source_not_found"


class ExportDestinationTaken(Conflict):
    error = "export_destination_exists"


@dataclass(frozen=True)
class ExportOptions:
    # SpecForge: also write vocab_mapping/vocab_mapping.pt (d2t, t2d) for a draft vocabulary this large.
    draft_vocab_size: int | None = None
    # The target model's vocabulary (t2d's length); default: vocab_size in the model's config.json.
    target_vocab_size: int | None = None
    # Count only each sample's first tokens for the mapping, as SpecForge does when training with max_len.
    vocab_max_length: int | None = None
    # SpecForge: samples per rows_<g>-<g+N> folder, as its prepare_hidden_states.py --file-group-size.
    group_size: int = 2000
    verify_checksums: bool = True


@dataclass(frozen=True)
class WrittenFile:
    path: str  # relative to the export's root, forward slashes
    sha256: str
    bytes: int


class _HashingFile:
    """A write-only file object that hashes and counts what passes through (torch.save accepts it)."""

    def __init__(self, fh: Any) -> None:
        self._fh = fh
        self.digest = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        self.digest.update(view)
        self._fh.write(view)
        self.size += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self._fh.flush()


def write_file(root: Path, relative: str, produce: Callable[[Any], None]) -> WrittenFile:
    """Create ``root/relative`` (never over an existing file), let ``produce`` write into it, fsync it."""
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "xb") as fh:
        sink = _HashingFile(fh)
        produce(sink)
        fh.flush()
        os.fsync(fh.fileno())
    return WrittenFile(relative, sink.digest.hexdigest(), sink.size)


def hash_existing(root: Path, relative: str) -> WrittenFile:
    """A file some other writer made under ``root``: fsync it and describe it."""
    path = root / relative
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
        os.fsync(fh.fileno())
    return WrittenFile(relative, digest.hexdigest(), path.stat().st_size)


class TargetWriter(ABC):
    """Writes one trainer's layout under ``root``, one sample at a time."""

    format: ClassVar[str]

    def __init__(self, root: Path, manifest: Manifest, options: ExportOptions) -> None:
        self.root = root
        self.manifest = manifest
        self.options = options
        self.files: list[WrittenFile] = []

    @classmethod
    def refusal(cls, manifest: Manifest, options: ExportOptions) -> str | None:
        """Why this output cannot become this target (checked before anything is written), or None."""
        return None

    @abstractmethod
    def add(self, ordinal: int, sample: TorchSample) -> None:
        """Write sample number ``ordinal`` (0, 1, ... in manifest order)."""

    def finish(self) -> dict[str, Any]:
        """Write whatever comes after the samples; return this target's part of the report."""
        return {}

    @abstractmethod
    def listed_samples(self) -> int:
        """How many samples the trainer will find under ``root``, found the way its reader finds them."""


def writer_class(fmt: str) -> type[TargetWriter]:
    if fmt not in _WRITERS:
        raise ExportError(f"unknown export format {fmt!r}; expected one of {list(FORMATS)}")
    module, name = _WRITERS[fmt].split(":")
    cls: type[TargetWriter] = getattr(importlib.import_module(module), name)
    return cls


def refusal(manifest: Manifest, fmt: str, options: ExportOptions) -> str | None:
    if options.group_size < 1:
        return "group_size must be positive"
    return writer_class(fmt).refusal(manifest, options)


def resolve_source(job_or_dir: str, output_dir: Path) -> Path:
    """A job's output directory from a directory path or a job id (looked up under ``output_dir``, the
    deployment's output directory)."""
    path = Path(job_or_dir)
    if path.is_dir():
        directory = path
    elif "/" not in job_or_dir and "\\" not in job_or_dir and job_or_dir not in ("", ".", ".."):
        directory = output_dir / job_or_dir
    else:
        raise ExportSourceMissing(f"{job_or_dir} is not a directory")
    if not (directory / MANIFEST_FILE).is_file():
        raise ExportSourceMissing(
            f"{directory} has no {MANIFEST_FILE}: not a job output, or the job has not succeeded"
        )
    return directory


def _check_destination(dest: Path) -> None:
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ExportDestinationTaken(f"{dest} already exists and is not an empty directory")


def _walk_dirs(root: Path) -> Iterator[Path]:
    yield root
    for current, dirs, _ in os.walk(root):
        for name in dirs:
            yield Path(current) / name


@dataclass
class _Tally:
    samples: int = 0
    tokens: int = 0
    files: list[WrittenFile] = field(default_factory=list)


def _manifest_sha256(source: Path) -> str:
    return hashlib.sha256((source / MANIFEST_FILE).read_bytes()).hexdigest()


def export_output(
    source: Path | str,
    fmt: str,
    dest: Path | str,
    options: ExportOptions | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Export the job output at ``source`` as ``fmt`` into ``dest``; returns the report (also in DEST).

    Raises :class:`ExportError` (the output cannot become this target, or the counts do not add up),
    :class:`ExportSourceMissing`, :class:`ExportDestinationTaken`, and the loader's errors when a shard
    does not match its manifest.
    """
    from hsx.loader import iter_samples

    options = options or ExportOptions()
    source = Path(source)
    try:
        manifest = Manifest.load(source)
    except ManifestError as exc:
        raise ExportSourceMissing(str(exc)) from exc
    why = refusal(manifest, fmt, options)
    if why:
        raise ExportError(why, error="export_not_possible")
    dest = Path(dest).absolute()
    _check_destination(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = dest.parent / f".{dest.name}{_PARTIAL_MARK}{secrets.token_hex(4)}"
    staging.mkdir()
    try:
        writer = writer_class(fmt)(staging, manifest, options)
        tally = _Tally()
        for ordinal, sample in enumerate(iter_samples(source, options.verify_checksums, as_torch=True)):
            writer.add(ordinal, sample)
            tally.samples += 1
            tally.tokens += int(sample.input_ids.numel())
            if progress is not None:
                progress(tally.samples, manifest.counts.samples)
        target = writer.finish()
        _check_counts(manifest, tally, writer.listed_samples())
        report = _write_report(staging, source, manifest, fmt, writer.files, tally, target)
        for directory in _walk_dirs(staging):
            fsync_dir(directory)
        if dest.exists():
            dest.rmdir()  # checked empty above; os.rename cannot replace a directory that has entries
        os.rename(staging, dest)
        fsync_dir(dest.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return report


def _check_counts(manifest: Manifest, tally: _Tally, listed: int) -> None:
    expected = manifest.counts
    problems = []
    if tally.samples != expected.samples:
        problems.append(f"{tally.samples} samples read, the manifest counts {expected.samples}")
    if tally.tokens != expected.tokens:
        problems.append(f"{tally.tokens} tokens read, the manifest counts {expected.tokens}")
    if listed != tally.samples:
        problems.append(f"the trainer's reader would find {listed} samples, {tally.samples} were written")
    if problems:
        raise ExportError("; ".join(problems), error="export_count_mismatch")


def _write_report(
    root: Path,
    source: Path,
    manifest: Manifest,
    fmt: str,
    files: list[WrittenFile],
    tally: _Tally,
    target: dict[str, Any],
) -> dict[str, Any]:
    ordered = sorted(files, key=lambda f: f.path)
    checksums = "".join(f"{f.sha256}  {f.path}\n" for f in ordered).encode()
    (root / CHECKSUMS_FILE).write_bytes(checksums)
    report: dict[str, Any] = {
        "report_version": REPORT_VERSION,
        "format": fmt,
        "created_at": datetime.now(timezone.utc).isoformat(),
        "source": {
            "dir": str(source.absolute()),
            "job_id": manifest.job_id,
            "manifest_sha256": _manifest_sha256(source),
            "schema_version": manifest.schema_version,
            "final_state": manifest.final_state,
            "dtype": manifest.dtype,
            "source_dtype": manifest.source_dtype,
            "hidden_size": manifest.hidden_size,
            "aux_layer_ids": manifest.aux_layer_ids,
            "hf_indices": manifest.hf_indices,
        },
        "counts": {
            "samples": tally.samples,
            "tokens": tally.tokens,
            "files": len(files),
            "bytes": sum(f.bytes for f in files),
        },
        "checksums": {"file": CHECKSUMS_FILE, "sha256": hashlib.sha256(checksums).hexdigest()},
        "target": target,
    }
    text = json.dumps(report, indent=2, sort_keys=True) + "\n"
    with open(root / REPORT_FILE, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    return report


def load_report(dest: Path | str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((Path(dest) / REPORT_FILE).read_text(encoding="utf-8"))
    return data


def options_dict(options: ExportOptions) -> dict[str, Any]:
    return asdict(options)
