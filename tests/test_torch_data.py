"""The torch views over native shards: random access, the rank and worker split, the collate function; each
on a bf16 output and on an fp8 one, whose states come out as bfloat16 too."""

from __future__ import annotations

import pickle
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from hsx.loader import Sample, iter_samples
from hsx.torch_data import (
    OutputDataset,
    ShardedIterableDataset,
    collate_samples,
    split_shards,
)
from tests.fixtures.outputs import OutputSpec, write_output

# 19 samples in 8 shards of uneven size (3 per shard, the last short), with rejected indices leaving gaps.
LENGTHS = (5, 9, 3, 12, 7, 4, 8, 6, 2, 11, 5, 3, 9, 4, 7, 10, 3, 6, 5)
SPEC = OutputSpec(lengths=LENGTHS, samples_per_shard=3, final_state="both", skip_indices=(2, 7, 11))


@pytest.fixture(scope="module", params=["BF16", "F8_E4M3"])
def output(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("torch-data") / "out"
    write_output(directory, replace(SPEC, dtype=request.param))
    return directory


def native(output: Path) -> dict[int, Sample]:
    """The numpy loader's samples: states as float32 (bf16 widened, fp8 dequantized)."""
    return {s.index: s for s in iter_samples(output)}


def bf16(values: np.ndarray | None) -> torch.Tensor:
    """What a torch reader must give for a state the numpy loader reads as ``values``: bfloat16, whether
    the shard holds bf16 (exact) or fp8 (dequantized, then narrowed)."""
    assert values is not None
    return torch.from_numpy(values).to(torch.bfloat16)


def same(item: dict[str, object], sample: Sample) -> bool:
    checks = [
        torch.equal(item["input_ids"], torch.from_numpy(sample.input_ids).long()),  # type: ignore[arg-type]
        torch.equal(item["loss_mask"], torch.from_numpy(sample.loss_mask).long()),  # type: ignore[arg-type]
        torch.equal(item["hidden_state"], bf16(sample.hidden_state)),  # type: ignore[arg-type]
        torch.equal(item["aux_hidden_state"], bf16(sample.aux_hidden_state)),  # type: ignore[arg-type]
        torch.equal(item["final_pre_norm"], bf16(sample.final_pre_norm)),  # type: ignore[arg-type]
    ]
    return all(checks)


def test_map_dataset_gives_every_sample_in_manifest_order(output: Path) -> None:
    dataset = OutputDataset(output)
    samples = list(iter_samples(output))
    assert len(dataset) == len(samples) == len(LENGTHS)
    for i in (0, 5, len(samples) - 1, 3, 1):  # out of order: random access across shards
        item = dataset[i]
        assert item["index"] == samples[i].index
        assert same(item, samples[i])
        assert item["hidden_state"].dtype == torch.bfloat16
    with pytest.raises(IndexError):
        dataset[len(samples)]
    clone = pickle.loads(pickle.dumps(dataset))  # spawned DataLoader workers get a pickled copy
    assert same(clone[4], samples[4])


def test_split_covers_every_shard_once_and_balances_samples() -> None:
    counts = [3, 3, 3, 3, 3, 3, 1, 9]
    parts = split_shards(counts, 4)
    assert sorted(k for part in parts for k in part) == list(range(len(counts)))
    loads = sorted(sum(counts[k] for k in part) for part in parts)
    assert loads == [6, 6, 7, 9]
    assert split_shards(counts, 4) == parts  # the same split in every process
    assert split_shards([2], 3) == [[0], [], []]


def test_two_ranks_with_two_workers_each_see_every_sample_exactly_once(output: Path) -> None:
    expected = native(output)
    seen: Counter[int] = Counter()
    per_rank = []
    for rank in (0, 1):
        dataset = ShardedIterableDataset(output, rank=rank, world_size=2)
        loader = DataLoader(dataset, batch_size=3, num_workers=2, collate_fn=collate_samples)
        indices = []
        for batch in loader:
            for row, index in enumerate(batch["index"].tolist()):
                length = int(batch["lengths"][row])
                sample = expected[index]
                want_ids = torch.from_numpy(sample.input_ids).long()
                assert torch.equal(batch["input_ids"][row, :length], want_ids)
                assert torch.equal(batch["aux_hidden_state"][row, :length], bf16(sample.aux_hidden_state))
                assert torch.equal(batch["final_pre_norm"][row, :length], bf16(sample.final_pre_norm))
                indices.append(index)
        per_rank.append(indices)
        seen.update(indices)
    assert sorted(seen) == sorted(expected)  # nothing lost
    assert set(seen.values()) == {1}  # nothing twice
    assert all(per_rank)
    assert abs(len(per_rank[0]) - len(per_rank[1])) <= SPEC.samples_per_shard


def test_shuffle_changes_the_split_per_epoch_and_keeps_it_complete(output: Path) -> None:
    def union(epoch: int) -> tuple[list[list[int]], list[int]]:
        parts = []
        for rank in (0, 1):
            dataset = ShardedIterableDataset(output, rank=rank, world_size=2, shuffle=True, seed=3)
            dataset.set_epoch(epoch)
            parts += [dataset.shards_for(worker, 2) for worker in (0, 1)]
        return parts, sorted(k for part in parts for k in part)

    first, covered = union(0)
    assert covered == list(range(len(OutputDataset(output).manifest.shards)))
    assert any(union(epoch)[0] != first for epoch in range(1, 6))
    assert union(0)[0] == first


def test_collate_pads_and_masks() -> None:
    def item(index: int, length: int) -> dict[str, object]:
        return {
            "index": index,
            "input_ids": torch.arange(1, length + 1),
            "loss_mask": torch.ones(length, dtype=torch.int64),
            "hidden_state": torch.full((length, 2), float(index), dtype=torch.bfloat16),
            "aux_hidden_state": torch.ones((length, 6), dtype=torch.bfloat16),
        }

    batch = collate_samples([item(4, 3), item(9, 5)], pad_token_id=-1, pad_to_multiple_of=4)
    assert batch["input_ids"].tolist() == [[1, 2, 3, -1, -1, -1, -1, -1], [1, 2, 3, 4, 5, -1, -1, -1]]
    assert batch["attention_mask"].sum(1).tolist() == [3, 5]
    assert batch["loss_mask"].tolist()[0] == [1, 1, 1, 0, 0, 0, 0, 0]
    assert batch["hidden_state"].shape == (2, 8, 2) and batch["hidden_state"].dtype == torch.bfloat16
    assert batch["hidden_state"][0, 3:].abs().sum() == 0 and batch["hidden_state"][1, :5].eq(9).all()
    assert batch["index"].tolist() == [4, 9] and batch["lengths"].tolist() == [3, 5]
    assert "final_pre_norm" not in batch
    cut = collate_samples([item(1, 7)], max_length=4)
    assert cut["input_ids"].shape == (1, 4) and cut["lengths"].tolist() == [4]
    with pytest.raises(ValueError):
        collate_samples([item(1, 2), {**item(2, 2), "final_pre_norm": torch.zeros(2, 2)}])
    assert np.array_equal(batch["input_ids"][1, :5].numpy(), np.arange(1, 6))
