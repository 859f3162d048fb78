"""``torch.utils.data`` views over a job's native output (format: docs/format.md), for training in torch.

* :class:`OutputDataset`: map-style, random access by sample number through the manifest (sample ``i`` is
  the ``i``-th in manifest order; ``Sample.index`` is its index in the source dataset). Shards are
  memory-mapped, a few at a time per process, so a worker holds only the pages it touches.
* :class:`ShardedIterableDataset`: streams whole shards, split across distributed ranks and, within a rank,
  across DataLoader workers, each shard read front to back by exactly one of them. Each split balances
  sample counts (largest shard first to the least loaded part), so ranks differ by at most one shard's
  samples; a worker can still get nothing when a rank has fewer shards than workers, so choose
  ``samples_per_shard`` with that in mind.
* :class:`JobStream` (:mod:`hsx.streams.torch_stream`): follows a running job through the API, shard by
  shard as units commit, acknowledged by the training loop after each optimizer step (docs/streaming.md).
* :func:`collate_samples`: pads a list of samples into a batch and builds the attention mask.

Each item is a dict: ``index`` (dataset index), ``input_ids`` int64 [T], ``loss_mask`` int64 [T],
``hidden_state`` [T, H] (post-norm final; absent when the job captured only the pre-norm one),
``aux_hidden_state`` [T, A*H] and, when captured, ``final_pre_norm`` [T, H], states as
:func:`hsx.samples.to_torch` gives them for the manifest's dtype (bf16 stays ``torch.bfloat16``; fp8 comes
dequantized to ``torch.bfloat16``), the same for every reader of the job.

Readers are opened lazily in the process that uses them, so the datasets pickle (spawned workers) and a
forked DataLoader worker never shares a parent's file mappings.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from hsx.loader import OutputReader
from hsx.manifest import Manifest
from hsx.samples import STATE_FIELDS, Item, sample_item
from hsx.streams.torch_stream import JobStream, JobStreamError  # re-exported: the torch views in one place


class _ProcessLocalReader:
    """An :class:`OutputReader` opened on first use in each process (mappings do not cross a fork)."""

    def __init__(self, output_dir: Path, verify_checksums: bool) -> None:
        self.output_dir = output_dir
        self.verify_checksums = verify_checksums
        self._reader: OutputReader | None = None
        self._pid = -1

    def get(self) -> OutputReader:
        if self._reader is None or self._pid != os.getpid():
            self._reader = OutputReader(self.output_dir, self.verify_checksums, raw_bf16=True)
            self._pid = os.getpid()
        return self._reader

    def __getstate__(self) -> dict[str, Any]:
        return {"output_dir": self.output_dir, "verify_checksums": self.verify_checksums}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["output_dir"], state["verify_checksums"])  # type: ignore[misc]


class OutputDataset(Dataset[Item]):
    """Map-style: ``dataset[i]`` is the ``i``-th sample in manifest order."""

    def __init__(self, output_dir: Path | str, *, verify_checksums: bool = False) -> None:
        self.output_dir = Path(output_dir)
        self.manifest = Manifest.load(self.output_dir)
        self._length = sum(entry.samples for entry in self.manifest.shards)
        self._reader = _ProcessLocalReader(self.output_dir, verify_checksums)

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, i: int) -> Item:
        return sample_item(self._reader.get()[i], self.manifest.dtype)


def split_shards(counts: Sequence[int], parts: int, order: Sequence[int] | None = None) -> list[list[int]]:
    """Shard numbers per part: every shard in exactly one part, sample counts balanced greedily.

    ``order`` (a permutation of the shard numbers) only breaks ties and sets each part's reading order;
    the same arguments give the same split in every process.
    """
    if parts < 1:
        raise ValueError("parts must be positive")
    order = list(order) if order is not None else list(range(len(counts)))
    position = {shard: rank for rank, shard in enumerate(order)}
    loads = [0] * parts
    assigned: list[list[int]] = [[] for _ in range(parts)]
    for shard in sorted(order, key=lambda k: (-counts[k], position[k])):
        target = min(range(parts), key=lambda p: (loads[p], p))
        assigned[target].append(shard)
        loads[target] += counts[shard]
    return [sorted(shards, key=position.__getitem__) for shards in assigned]


def _distributed_rank() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class ShardedIterableDataset(IterableDataset[Item]):
    """Iterable: this rank's and this DataLoader worker's shards, each read front to back.

    ``rank`` and ``world_size`` default to ``torch.distributed``'s (0 and 1 without it). With ``shuffle``,
    the shard order, and so the split, changes with :meth:`set_epoch` (same seed and epoch on every rank);
    samples within a shard keep their order.
    """

    def __init__(
        self,
        output_dir: Path | str,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        shuffle: bool = False,
        seed: int = 0,
        verify_checksums: bool = False,
    ) -> None:
        super().__init__()
        self.output_dir = Path(output_dir)
        self.manifest = Manifest.load(self.output_dir)
        self.counts = [entry.samples for entry in self.manifest.shards]
        default_rank, default_world = _distributed_rank()
        self.rank = default_rank if rank is None else rank
        self.world_size = default_world if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in [0, {self.world_size})")
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self._reader = _ProcessLocalReader(self.output_dir, verify_checksums)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def shards_for(self, worker: int = 0, num_workers: int = 1) -> list[int]:
        order = list(range(len(self.counts)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        # Ranks first, so ranks stay balanced (each steps the same number of times in lockstep training),
        # then this rank's shards across its workers.
        mine = split_shards(self.counts, self.world_size, order)[self.rank]
        counts = [self.counts[k] for k in mine]
        return [mine[j] for j in split_shards(counts, num_workers)[worker]]

    def __iter__(self) -> Iterator[Item]:
        info = get_worker_info()
        worker, num_workers = (0, 1) if info is None else (info.id, info.num_workers)
        reader = self._reader.get()
        for shard in self.shards_for(worker, num_workers):
            for sample in reader.iter_shard(shard):
                yield sample_item(sample, self.manifest.dtype)


def collate_samples(
    batch: Sequence[Item],
    pad_token_id: int = 0,
    max_length: int | None = None,
    pad_to_multiple_of: int | None = None,
) -> Item:
    """Pad samples to one length: ``input_ids`` with ``pad_token_id``, masks and states with zeros.

    Returns ``input_ids``, ``attention_mask`` (1 on real tokens), ``loss_mask`` [B, L] int64, each state
    [B, L, width], ``lengths`` and ``index`` [B]. ``max_length`` cuts longer samples first.
    """
    if not batch:
        raise ValueError("an empty batch")
    lengths = [
        len(item["input_ids"]) if max_length is None else min(len(item["input_ids"]), max_length)
        for item in batch
    ]
    width = max(lengths)
    if pad_to_multiple_of:
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    size = len(batch)
    out: Item = {
        "input_ids": torch.full((size, width), pad_token_id, dtype=torch.int64),
        "attention_mask": torch.zeros((size, width), dtype=torch.int64),
        "loss_mask": torch.zeros((size, width), dtype=torch.int64),
        "lengths": torch.tensor(lengths, dtype=torch.int64),
        "index": torch.tensor([item["index"] for item in batch], dtype=torch.int64),
    }
    for name in STATE_FIELDS:
        present = [name in item for item in batch]
        if not any(present):
            continue
        if not all(present):
            raise ValueError(f"{name} is in some samples of the batch and not in others")
        first = batch[0][name]
        out[name] = torch.zeros((size, width, first.shape[1]), dtype=first.dtype)
    if "stream_ref" in batch[0]:  # JobStream samples: what JobStream.ack needs after the optimizer step
        out["stream_ref"] = [item["stream_ref"] for item in batch]
    for row, (item, length) in enumerate(zip(batch, lengths, strict=True)):
        out["input_ids"][row, :length] = item["input_ids"][:length]
        out["attention_mask"][row, :length] = 1
        out["loss_mask"][row, :length] = item["loss_mask"][:length]
        for name in STATE_FIELDS:
            if name in out:
                out[name][row, :length] = item[name][:length]
    return out


__all__ = [
    "JobStream",
    "JobStreamError",
    "OutputDataset",
    "ShardedIterableDataset",
    "collate_samples",
    "sample_item",
    "split_shards",
]
