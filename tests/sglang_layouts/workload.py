"""The requests of a layout run and the batches SGLang's scheduler would cut from them (harness.py)."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch

from tests.sglang_layouts.standin import VOCAB

CHUNK = 16  # chunked prefill: prompt tokens per pass (the longer prompts take two)
# Each DP group's requests (token counts); a layout without DP attention serves them all in one batch queue.
GROUP_LENGTHS = [[1, 6, 13], [9, 2], [4, 11, 3], [7]]


def prompt(rid: str, n: int) -> list[int]:
    seed = sum(ord(c) * (i + 1) for i, c in enumerate(rid))
    return [(seed + 7 * i) % (VOCAB - 1) + 1 for i in range(n)]


class Req:
    def __init__(self, rid: str, ids: list[int]) -> None:
        self.rid, self.origin_input_ids = rid, ids
        self.to_finish: object = None
        self.cached_tokens = 0
        self.extra_key = None

    def finished(self) -> bool:
        return False


def group_requests(layout: str, groups: int) -> list[list[Req]]:
    """Each DP group's (or replica's) requests, one plain rid among them; one queue without DP."""
    lengths = GROUP_LENGTHS if groups > 1 else [[n for g in GROUP_LENGTHS for n in g]]
    # the same prompts in every layout (the test computes each one's reference once)
    out = [
        [Req(f"hsx-{layout}-g{g}-{i}", prompt(f"g{g}-{i}", n)) for i, n in enumerate(ns)]
        for g, ns in enumerate(lengths[:groups])
    ]
    out[0].insert(1, Req(f"plain-{layout}", prompt("plain", 5)))  # served, never dumped
    return out


def chunked(reqs: list[Req]) -> Iterator[list[tuple[Req, int, int]]]:
    """SGLang's chunked prefill: each pass takes up to CHUNK prompt tokens, oldest requests first."""
    pending = [[r, 0] for r in reqs]
    while pending:
        budget, items = CHUNK, []
        for entry in pending:
            req, pos = entry
            take = min(len(req.origin_input_ids) - pos, budget)
            if take <= 0:
                break
            items.append((req, pos, take))
            entry[1] = pos + take
            budget -= take
        pending = [e for e in pending if e[1] < len(e[0].origin_input_ids)]
        yield items


def ceil_to(n: int, k: int) -> int:
    return -(-n // k) * k


def batches(plan: list[list[Req]], group: int, groups: int, attn_tp: int, pad: bool) -> list[Any]:
    """This group's ScheduleBatch of every step; under DP attention every group runs every step (IDLE when
    it has nothing), padded to the longest group's tokens (MAX_LEN), rounded up to attention TP."""
    steps = [list(chunked(reqs)) for reqs in plan]
    out = []
    for s in range(max(len(x) for x in steps) if groups > 1 else len(steps[group])):
        items = steps[group][s] if s < len(steps[group]) else []
        counts = [sum(e for _, _, e in x[s]) if s < len(x) else 0 for x in steps]
        local = counts[group]
        max_len = max(ceil_to(c, attn_tp) for c in counts) if groups > 1 else local
        max_len = ceil_to(max_len, attn_tp) if pad else max_len
        ids = [r.origin_input_ids[p + i] for r, p, e in items for i in range(e)]
        pos = [p + i for _, p, e in items for i in range(e)]
        fill = max_len - len(ids)
        out.append(
            SimpleNamespace(
                forward_mode=SimpleNamespace(name="EXTEND" if items else "IDLE"),
                reqs=[r for r, _, _ in items],
                prefix_lens=[p for _, p, _ in items],
                extend_lens=[e for _, _, e in items],
                inputs=(torch.tensor(ids + [0] * fill), torch.tensor(pos + [0] * fill)),
                fb=SimpleNamespace(max_len=max_len),
            )
        )
    return out
