"""The manifest of a job's output directory: what was captured, how, and which shards hold it.

``<output_dir>/manifest.json`` lists every shard by a path relative to that directory, with its sha256, so
the directory can be moved or copied as a whole. It is written through a rename, so a reader sees either
the previous manifest or the new one. Format: docs/format.md. Standard library only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from hsx.contract import LAYER_CONVENTION, PARALLEL_LAYOUT, ParallelLayout
from hsx.layout import FINAL_STATES as FINAL_STATES  # the schema's names live in hsx.layout
from hsx.layout import FP8_SCHEMA_VERSION as FP8_SCHEMA_VERSION
from hsx.layout import MANIFEST_FILE as MANIFEST_FILE
from hsx.layout import READABLE_SCHEMA_VERSIONS as READABLE_SCHEMA_VERSIONS
from hsx.layout import SCHEMA_VERSION as SCHEMA_VERSION
from hsx.layout import write_atomically

# The shard's state tensors use safetensors dtype names, so the manifest does too (no aliases here).
STATE_DTYPES = ("BF16", "F16", "F32")
FP8_DTYPE = "F8_E4M3"  # schema 3 only; source_dtype then names what the engine produced

# The job option that picks it (``state_dtype``), spelled here once: the option (hsx.server.job_options)
# takes its type from this, and a stream reader reads a job document's options with :func:`stores_fp8`.
StateDtype = Literal["engine", "fp8_e4m3"]
FP8_STATE_DTYPE: StateDtype = "fp8_e4m3"


def stores_fp8(state_dtype: object) -> bool:
    """Whether a job's ``state_dtype`` option stores fp8 e4m3 codes and per-token scales (schema 3)
    instead of the engine's dtype. ``None`` (a job without the option) is the engine's dtype."""
    return state_dtype == FP8_STATE_DTYPE


class ManifestError(Exception):
    """The manifest is missing, unreadable, of another schema version, or inconsistent."""


@dataclass
class ModelInfo:
    path: str
    num_layers: int
    hidden_size: int
    dtype: str


@dataclass
class Counts:
    samples: int = 0
    rejected: int = 0
    tokens: int = 0
    # Kept samples that were cut to the job's max_length (GET /jobs/{id}/truncations lists them).
    truncated: int = 0


@dataclass
class ShardEntry:
    path: str  # relative to the manifest's directory, with forward slashes
    sha256: str  # schema 2: of the data section (the bytes after the header); schema 1: of the whole file
    bytes: int
    samples: int
    tokens: int
    header_sha256: str | None = None  # schema 2: of the 8-byte length and the header


def relative_shard_path(manifest_dir: Path, shard_path: Path) -> str:
    """``shard_path`` as the manifest records it; refuses a shard outside ``manifest_dir``."""
    try:
        relative = Path(shard_path).resolve().relative_to(Path(manifest_dir).resolve())
    except ValueError:
        raise ManifestError(f"shard {shard_path} lies outside {manifest_dir}") from None
    return relative.as_posix()


def _checked_relative(path: str) -> str:
    pure = PurePosixPath(path)
    if not path or pure.is_absolute() or ".." in pure.parts or "\\" in path or "\x00" in path:
        raise ManifestError(f"shard path {path!r} is not a plain relative path")
    return path


@dataclass(kw_only=True)
class Manifest:
    job_id: str
    model: ModelInfo
    tokenizer: dict[str, Any]
    chat_template_sha256: str
    aux_layer_ids: list[int]
    hf_indices: list[int]  # the aux layers' HF indices, then the final state's
    dtype: str  # safetensors name of the state tensors: BF16, F16, F32, or F8_E4M3 (schema 3)
    hidden_size: int
    counts: Counts = field(default_factory=Counts)
    shards: list[ShardEntry] = field(default_factory=list)
    layer_convention: str = LAYER_CONVENTION
    # Which final state the shards hold: "post" (post-norm, HF hidden_states[N]), "pre" (the last decoder
    # layer's output, before the final norm) or "both".
    final_state: str = "post"
    # What produced the states: backend ("sglang", "reference", "synthetic"), version, parallel layout.
    engine: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION
    # Schema 3 (dtype F8_E4M3): the engine's dtype the states were quantized from (BF16, F16 or F32).
    source_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.final_state not in FINAL_STATES:
            raise ManifestError(f"final_state {self.final_state!r} is not one of {FINAL_STATES}")
        if self.schema_version == 1 and self.final_state != "post":
            raise ManifestError("a schema 1 manifest can only hold the post-norm final state")
        if self.dtype == FP8_DTYPE:
            if self.schema_version < FP8_SCHEMA_VERSION:
                raise ManifestError(f"dtype {FP8_DTYPE} needs schema_version {FP8_SCHEMA_VERSION}")
            if self.source_dtype not in STATE_DTYPES:
                raise ManifestError(f"source_dtype {self.source_dtype!r} is not one of {STATE_DTYPES}")
        elif self.dtype not in STATE_DTYPES:
            raise ManifestError(
                f"dtype {self.dtype!r} is not one of {(*STATE_DTYPES, FP8_DTYPE)} (safetensors names)"
            )
        if len(self.hf_indices) != len(self.aux_layer_ids) + 1:
            raise ManifestError("hf_indices must list each aux layer and then the final state")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Manifest:
        version = raw.get("schema_version")
        if version not in READABLE_SCHEMA_VERSIONS:
            raise ManifestError(
                f"manifest schema_version {version!r}, this reader knows {list(READABLE_SCHEMA_VERSIONS)}"
            )
        try:
            shards = [ShardEntry(**entry) for entry in raw["shards"]]
            for entry in shards:
                _checked_relative(entry.path)
            manifest = cls(
                job_id=raw["job_id"],
                model=ModelInfo(**raw["model"]),
                tokenizer=dict(raw["tokenizer"]),
                chat_template_sha256=raw["chat_template_sha256"],
                aux_layer_ids=list(raw["aux_layer_ids"]),
                hf_indices=list(raw["hf_indices"]),
                dtype=raw["dtype"],
                hidden_size=raw["hidden_size"],
                counts=Counts(**raw["counts"]),
                shards=shards,
                layer_convention=raw["layer_convention"],
                final_state=raw.get("final_state", "post"),
                engine=dict(raw.get("engine", {})),
                extra=dict(raw.get("extra", {})),
                schema_version=version,
                source_dtype=raw.get("source_dtype"),
            )
        except (KeyError, TypeError) as exc:
            raise ManifestError(f"manifest is missing or has a malformed field: {exc}") from exc
        return manifest

    @property
    def parallel_layout(self) -> ParallelLayout | None:
        """How the engine was laid out over GPUs (``engine["parallel_layout"]``); None in a manifest written
        before engines said, or by an engine that does not."""
        return ParallelLayout.from_dict(self.engine.get(PARALLEL_LAYOUT))

    def shard_path(self, directory: Path, entry: ShardEntry) -> Path:
        return Path(directory) / _checked_relative(entry.path)

    def write(self, directory: Path) -> Path:
        """Write ``manifest.json`` into ``directory`` through a temp file and a rename; return its path."""
        directory = Path(directory)
        for entry in self.shards:
            _checked_relative(entry.path)
        directory.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"
        return write_atomically(directory / MANIFEST_FILE, text)

    @classmethod
    def load(cls, directory: Path) -> Manifest:
        path = Path(directory) / MANIFEST_FILE
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ManifestError(f"cannot read {path}: {exc.strerror or exc}") from exc
        except ValueError as exc:
            raise ManifestError(f"{path} is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise ManifestError(f"{path} does not hold a JSON object")
        return cls.from_dict(raw)


def job_manifest(
    job_id: str,
    engine: Mapping[str, Any],
    *,
    fp8: bool,
    counts: Counts | None = None,
    shards: list[ShardEntry] | None = None,
    extra: dict[str, Any] | None = None,
) -> Manifest:
    """The manifest of a job from the engine record its workers wrote (``jobs.engine``, shown as
    ``GET /jobs/{id}``'s ``engine``): what finalize writes, and what a stream reader checks a shard
    against before the job has a manifest on disk. ``fp8``: the job's ``state_dtype`` is ``fp8_e4m3``."""
    engine_dtype = str(engine.get("state_dtype", ""))
    return Manifest(
        job_id=job_id,
        model=ModelInfo(
            path=str(engine.get("model_path", "")),
            num_layers=int(engine.get("num_layers", 0)),
            hidden_size=int(engine.get("hidden_size", 0)),
            dtype=str(engine.get("dtype", "")),
        ),
        tokenizer=dict(engine.get("tokenizer") or {}),
        chat_template_sha256=str(engine.get("chat_template_sha256", "")),
        aux_layer_ids=list(engine.get("aux_layer_ids", [])),
        hf_indices=list(engine.get("hf_indices", [])),
        dtype=FP8_DTYPE if fp8 else engine_dtype,
        source_dtype=engine_dtype if fp8 else None,
        schema_version=FP8_SCHEMA_VERSION if fp8 else SCHEMA_VERSION,
        hidden_size=int(engine.get("hidden_size", 0)),
        counts=counts or Counts(),
        shards=shards or [],
        final_state=str(engine.get("final_state", "post")),
        engine={
            "backend": engine.get("backend", ""),
            "protocol_version": engine.get("protocol_version"),
            **dict(engine.get("extra") or {}),
        },
        extra=extra or {},
    )
