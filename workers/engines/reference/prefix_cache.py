"""The reference engine's prefix cache: the attention keys and values of recent prompts, reused for later
prompts that share a prefix, as SGLang's radix cache would (the cached-token count a capture reports is
what the job runner's checks are tested against)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

# One layer's cached attention keys and values, each [1, kv_heads, tokens, head_dim].
KvLayers = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class _CacheEntry:
    namespace: str | None
    input_ids: tuple[int, ...]
    kv: KvLayers = field(repr=False)


class PrefixCache:
    """The attention caches of recent prompts, reused for later prompts that share a prefix (LRU).

    A stand-in for SGLang's radix cache with the same observable behaviour: a hit skips the shared prefix,
    always leaves at least one token to compute, and only matches within the same ``extra_key`` namespace.
    """

    def __init__(self, max_prompts: int) -> None:
        if max_prompts < 1:
            raise ValueError("max_prompts must be at least 1")
        self.max_prompts = max_prompts
        self._entries: OrderedDict[int, _CacheEntry] = OrderedDict()
        self._next_key = 0

    def __len__(self) -> int:
        return len(self._entries)

    def longest_prefix(self, namespace: str | None, input_ids: Sequence[int]) -> tuple[int, KvLayers]:
        """The longest reusable prefix (at most ``len - 1`` tokens) and its keys and values, cropped."""
        limit = len(input_ids) - 1
        best_key, best_len = -1, 0
        for key, entry in self._entries.items():
            if entry.namespace != namespace:
                continue
            shared = _shared_prefix_length(entry.input_ids, input_ids, limit)
            if shared > best_len:
                best_key, best_len = key, shared
        if best_len == 0:
            return 0, []
        self._entries.move_to_end(best_key)
        entry = self._entries[best_key]
        return best_len, [(keys[:, :, :best_len], values[:, :, :best_len]) for keys, values in entry.kv]

    def insert(self, namespace: str | None, input_ids: Sequence[int], kv: KvLayers) -> None:
        ids = tuple(input_ids)
        # An entry whose prompt is a prefix of this one can serve nothing this one cannot.
        covered = [
            key
            for key, entry in self._entries.items()
            if entry.namespace == namespace and ids[: len(entry.input_ids)] == entry.input_ids
        ]
        for key in covered:
            del self._entries[key]
        self._entries[self._next_key] = _CacheEntry(namespace, ids, kv)
        self._next_key += 1
        while len(self._entries) > self.max_prompts:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()


def _shared_prefix_length(cached: Sequence[int], prompt: Sequence[int], limit: int) -> int:
    length = min(len(cached), len(prompt), limit)
    for position in range(length):
        if cached[position] != prompt[position]:
            return position
    return length


def kv_layers(cache: DynamicCache) -> KvLayers:
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return [(layer.keys, layer.values) for layer in layers]
    # transformers before 4.56 kept the tensors in two parallel lists
    return list(zip(getattr(cache, "key_cache"), getattr(cache, "value_cache"), strict=True))  # noqa: B009
