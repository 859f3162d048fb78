"""Reading a streamed shard before its job has a manifest: the job's engine record (``GET /jobs/{id}``'s
``engine``) says what finalize would write in the manifest, so a shard handed out by a lease is checked and
read exactly as the loader reads a finished job's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hsx.loader import Sample, ShardView
from hsx.manifest import Manifest, ModelInfo, ShardEntry


def manifest_for(job_id: str, engine: dict[str, Any]) -> Manifest:
    """The manifest of a job without its shard list, from the engine record the job started with."""
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
        dtype=str(engine.get("state_dtype", "")),
        hidden_size=int(engine.get("hidden_size", 0)),
        final_state=str(engine.get("final_state", "post")),
    )


def open_item(item: dict[str, Any], manifest: Manifest, verify: bool = True) -> ShardView:
    """A leased item's shard (a ``POST .../leases`` item), checked against the item's checksums."""
    entry = ShardEntry(
        path=Path(item["path"]).name,
        sha256=str(item["sha256"]),
        bytes=int(item["bytes"]),
        samples=int(item["samples"]),
        tokens=int(item["tokens"]),
        header_sha256=item.get("header_sha256"),
    )
    return ShardView(Path(item["path"]), entry, manifest, verify)


def item_samples(
    item: dict[str, Any], manifest: Manifest, verify: bool = True, raw_bf16: bool = False
) -> Iterator[Sample]:
    view = open_item(item, manifest, verify)
    for k in range(len(view)):
        yield view.sample(k, raw_bf16)
