"""A model's fingerprint: what tells two checkpoints of one shape apart, cheaply, at an engine's start.

Layers, hidden size and dtype say nothing about which weights produced a state: a fine-tune of the same
base has the same shape. An engine reports :func:`model_fingerprint` of its model directory in
``EngineInfo.extra["model_fingerprint"]`` (:data:`hsx.contract.MODEL_FINGERPRINT`), and a worker never
mixes states of two fingerprints in one job.

The fingerprint is a sha256 over the model's ``config.json`` (parsed, without keys that differ between
copies of one checkpoint: ``_name_or_path``, ``transformers_version``, ...) and, for every weights file,
its name, its size and three 1 MiB windows of it (start, middle, end). A different checkpoint differs in
nearly every weight, so the windows differ; reading 3 MiB a file keeps this fast for any model size. It
is a fingerprint, not a full hash: it does not prove two files byte-identical. Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

WINDOW_BYTES = 1 << 20
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# Config keys that say where a copy came from, not what it is.
_VOLATILE_CONFIG_KEYS = ("transformers_version",)


def model_fingerprint(model_dir: str | os.PathLike[str]) -> str:
    """``sha256:<hex>`` of the model's config and weights (see the module docstring)."""
    root = Path(model_dir)
    digest = hashlib.sha256()
    digest.update(b"hsx-model-fingerprint-1\n")
    digest.update(_canonical_config(root / "config.json"))
    for path in sorted(p for p in root.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)):
        size = path.stat().st_size
        digest.update(f"\n{path.name}:{size}\n".encode())
        with open(path, "rb") as fh:
            for offset in sorted({0, max(0, size // 2 - WINDOW_BYTES // 2), max(0, size - WINDOW_BYTES)}):
                fh.seek(offset)
                digest.update(fh.read(WINDOW_BYTES))
    return "sha256:" + digest.hexdigest()


def fingerprint_of(description: dict[str, Any]) -> str:
    """The fingerprint of a model that has no files (a synthetic engine's pattern): its description."""
    text = json.dumps(description, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(b"hsx-model-fingerprint-1\n" + text.encode()).hexdigest()


def _canonical_config(path: Path) -> bytes:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return b"{}"
    if not isinstance(raw, dict):
        return json.dumps(raw).encode()
    kept = {k: v for k, v in raw.items() if not k.startswith("_") and k not in _VOLATILE_CONFIG_KEYS}
    return json.dumps(kept, sort_keys=True, separators=(",", ":")).encode()
