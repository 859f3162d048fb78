"""SpecForge 0.2.0's disaggregated on-disk layout, written by hsx (our own writer of their format; SpecForge
is not imported). Two parts on a mount the trainer shares:

- features, as ``specforge.runtime.data_plane.disaggregated.SharedDirFeatureStore`` reads them:
  ``<store_root>/<store_id>/<sample_id>.g<generation>.ckpt``, one ``torch.save`` dict per sample and
  generation, placed by one rename so a reader sees a whole file or none;
- refs, as ``specforge.runtime.data_plane.streaming_ref_channel.StreamingRefChannel`` reads them: an
  append-only JSONL file of ``SampleRef`` records (fsynced), and sidecar files beside it: ``.consumed_count``
  (the trainer's count of refs it is done with: the producer's backpressure), ``.closed`` (the producer
  finished), ``.failed`` (the producer failed, with its reason), ``.consumer_done`` / ``.consumer_failed``
  (the trainer stopped) and ``.consumer_quantum`` (refs per optimizer step of the trainer).

The tensors are those SpecForge's online EAGLE-3 consumer trains on (the ``eagle3`` algorithm's
``server_streaming`` provider: ``hidden_state`` is the aux layers side by side, ``target`` the post-norm
final state, re-projected by the trainer's own lm_head since ``target_repr`` is ``hidden_state``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from hsx.fsutil import fsync_dir
from hsx.samples import Sample, sample_item

SCHEMA_VERSION = 1  # specforge.runtime.contracts.SCHEMA_VERSION in 0.2.0
GENERATION = 1  # hsx writes each sample once; a rewrite after a crash is of a sample no ref names yet
TARGET_REPR = "hidden_state"
EAGLE3_FEATURES = ("input_ids", "loss_mask", "attention_mask", "hidden_state", "target")

# StreamingRefChannel's sidecars (suffixes of the channel's path).
CONSUMED = ".consumed_count"
CLOSED = ".closed"
FAILED = ".failed"
CONSUMER_DONE = ".consumer_done"
CONSUMER_FAILED = ".consumer_failed"
CONSUMER_QUANTUM = ".consumer_quantum"
# Ours: the hsx consumer the feeder leases through, so a restarted feeder can hand its leases back.
HSX_CONSUMER = ".hsx_consumer"


def sample_id(job_id: str, index: int) -> str:
    return f"{job_id}:{index:08d}"


def eagle3_tensors(sample: Sample, dtype: str) -> dict[str, torch.Tensor]:
    """One hsx sample (read as :func:`hsx.streams.reader.item_samples` reads it; ``dtype`` the manifest's)
    as SpecForge's online EAGLE-3 features, each with a leading batch dimension of 1."""
    item = sample_item(sample, dtype)
    if "hidden_state" not in item:
        raise ValueError(f"sample {sample.index} has no post-norm final state (the EAGLE-3 target)")
    input_ids = item["input_ids"].unsqueeze(0)
    return {
        "input_ids": input_ids,
        "loss_mask": item["loss_mask"].unsqueeze(0),
        "attention_mask": torch.ones_like(input_ids),
        "hidden_state": item["aux_hidden_state"].unsqueeze(0),
        "target": item["hidden_state"].unsqueeze(0),
    }


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


@dataclass(frozen=True)
class FeatureDir:
    """Where SharedDirFeatureStore(store_root, store_id) reads and frees a sample's features."""

    store_root: Path
    store_id: str

    @property
    def root(self) -> Path:
        return self.store_root / self.store_id

    def path(self, sid: str, generation: int = GENERATION) -> Path:
        return self.root / f"{sid}.g{generation}.ckpt"

    def write(self, sid: str, tensors: dict[str, torch.Tensor]) -> Path:
        """Whole or absent: written beside its name, fsynced, renamed into place."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.path(sid)
        tmp = final.with_name(f"{final.name}.hsx-{os.getpid()}.tmp")
        with open(tmp, "wb") as fh:
            torch.save(tensors, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        return final

    def uri(self, sid: str) -> str:
        return f"disagg://{self.store_id}/{sid}"

    def exists(self, sid: str) -> bool:
        """False once the trainer's store has released (deleted) the sample."""
        return self.path(sid).exists()

    def remove(self, sid: str) -> None:
        """After the trainer is done with a sample: its file, if the trainer left it (a retaining store)."""
        for path in self.root.glob(f"{sid}.g*.ckpt"):
            path.unlink(missing_ok=True)

    def sync(self) -> None:
        fsync_dir(self.root)

    def close(self) -> None:
        pass


class FeatureSink(Protocol):
    """Where the feeder puts a sample's features: a shared directory, or Mooncake
    (:mod:`hsx.integrations.specforge.mooncake`)."""

    def write(self, sid: str, tensors: dict[str, torch.Tensor]) -> Any: ...

    def uri(self, sid: str) -> str: ...

    def exists(self, sid: str) -> bool: ...

    def remove(self, sid: str) -> None: ...

    def sync(self) -> None: ...

    def close(self) -> None: ...


def sample_ref(
    sid: str, features: FeatureSink, tensors: dict[str, torch.Tensor], run_id: str, metadata: dict[str, Any]
) -> dict[str, Any]:
    """A SampleRef record as SpecForge's ref_from_dict reads it (every field named, so none is guessed)."""
    specs: dict[str, dict[str, Any]] = {
        name: {
            "name": name,
            "shape": list(t.shape),
            "dtype": _dtype_name(t),
            "device_hint": None,
            "required": True,
            "target_repr": TARGET_REPR if name == "target" else None,
            "target_meta": {},
        }
        for name, t in tensors.items()
    }
    return {
        "sample_id": sid,
        "run_id": run_id,
        "source_task_id": None,
        "feature_store_uri": features.uri(sid),
        "feature_keys": {name: f"{sid}/{name}" for name in tensors},
        "feature_specs": specs,
        "strategy": "eagle3",
        "schema_version": SCHEMA_VERSION,
        "target_model_version": str(metadata.get("target_model_version", "unknown")),
        "draft_weight_version": None,
        "tokenizer_version": str(metadata.get("tokenizer_version", "unknown")),
        "num_tokens": int(tensors["input_ids"].numel()),
        "estimated_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
        "metadata": {
            **metadata,
            "run_id": run_id,
            "strategy": "eagle3",
            "target_repr": TARGET_REPR,
            # SharedDirFeatureStore.get reads the file of exactly this generation (Mooncake: these keys).
            "generation": GENERATION,
        },
    }


class RefChannel:
    """The producer's side of a StreamingRefChannel file: append refs, read the trainer's progress back."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.refs: list[dict[str, Any]] = self._recover()

    def _recover(self) -> list[dict[str, Any]]:
        """The refs already appended (a restarted feeder continues after them). A torn last line, from
        a crash mid-append, is cut off: the trainer parses complete lines only, so it never read it."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return []
        complete = data[: data.rfind(b"\n") + 1]
        if len(complete) != len(data):
            with open(self.path, "r+b") as fh:
                fh.truncate(len(complete))
                os.fsync(fh.fileno())
        return [json.loads(line) for line in complete.decode("utf-8").splitlines() if line.strip()]

    @property
    def appended(self) -> int:
        return len(self.refs)

    def append(self, refs: list[dict[str, Any]]) -> None:
        """Append refs in one write and fsync: the trainer sees them once their line is whole."""
        if not refs:
            return
        payload = b"".join((json.dumps(ref, separators=(",", ":")) + "\n").encode("utf-8") for ref in refs)
        fd = os.open(self.path, os.O_APPEND | os.O_CREAT | os.O_WRONLY, 0o644)
        try:
            view = memoryview(payload)
            while view:
                written = os.write(fd, view)
                if written <= 0:
                    raise OSError(f"no progress appending to {self.path}")
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        self.refs.extend(refs)

    def _sidecar(self, suffix: str) -> Path:
        return self.path.with_name(self.path.name + suffix)

    def read_sidecar(self, suffix: str) -> str | None:
        try:
            return self._sidecar(suffix).read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            return None

    def write_sidecar(self, suffix: str, value: str) -> None:
        final = self._sidecar(suffix)
        tmp = final.with_name(f"{final.name}.tmp.{os.getpid()}")
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(value)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)

    def consumed(self) -> int:
        """How many refs, in channel order, the trainer is done with (0 before it says)."""
        try:
            return int(self.read_sidecar(CONSUMED) or 0)
        except ValueError:
            return 0

    def quantum(self) -> int:
        """Refs the trainer needs for one optimizer step (0 before it says): a producer window below it
        would deadlock, the trainer waiting for refs the producer holds back."""
        try:
            return int(self.read_sidecar(CONSUMER_QUANTUM) or 0)
        except ValueError:
            return 0

    def close(self) -> None:
        self.write_sidecar(CLOSED, "")

    def fail(self, reason: str) -> None:
        self.write_sidecar(FAILED, reason or "hsx job failed")

    def is_closed(self) -> bool:
        return self._sidecar(CLOSED).exists()

    def consumer_stopped(self) -> str | None:
        """Why the trainer stopped (``done`` or its failure), or None while it runs."""
        failure = self.read_sidecar(CONSUMER_FAILED)
        if failure is not None:
            return f"trainer failed: {failure or 'unknown'}"
        return "done" if self._sidecar(CONSUMER_DONE).exists() else None
