"""The pinned staging ring of the SGLang plugin (on CPU, unpinned): where blocks fit, reuse, backpressure."""

from __future__ import annotations

import threading
import time
from collections import deque

import pytest
import torch

from workers.engines.sglang.arena import ALIGN, Block, PinnedArena, aligned, fit


def ring(*blocks: tuple[int, int]) -> deque[Block]:
    return deque(Block(off, size) for off, size in blocks)


def test_aligned_rounds_up_to_whole_units() -> None:
    assert aligned(0) == ALIGN and aligned(1) == ALIGN and aligned(ALIGN) == ALIGN
    assert aligned(ALIGN + 1) == 2 * ALIGN


@pytest.mark.parametrize(
    ("live", "n", "expected"),
    [
        ((), 4, 0),  # empty ring: the start
        (((0, 4),), 4, 4),  # after the newest block
        (((0, 4), (4, 4)), 2, 8),  # exactly up to the end
        (((0, 4), (4, 4)), 3, None),  # past the end, and the oldest block still holds the start
        (((4, 4), (8, 2)), 4, 0),  # wraps to the start, before the oldest block
        (((4, 4), (8, 2)), 5, None),  # does not fit before the oldest block
        (((6, 4), (0, 2)), 4, 2),  # wrapped: between the newest and the oldest block
        (((6, 4), (0, 2)), 5, None),  # wrapped: would overwrite the oldest block
    ],
)
def test_fit(live: tuple[tuple[int, int], ...], n: int, expected: int | None) -> None:
    assert fit(10, ring(*live), n) == expected


def test_blocks_are_reused_only_after_every_older_block_is_freed() -> None:
    arena = PinnedArena(torch, 4 * ALIGN, pin=False)
    a, view_a = arena.acquire(ALIGN)
    b, _ = arena.acquire(2 * ALIGN)
    c, _ = arena.acquire(ALIGN)
    assert a is not None and b is not None and c is not None
    assert (a.offset, b.offset, c.offset) == (0, ALIGN, 3 * ALIGN)
    assert view_a.numel() == ALIGN and view_a.data_ptr() == arena.buf.data_ptr()
    arena.release(b)  # out of order: nothing is reclaimed while the older block a lives
    assert arena.in_use() == 3
    with pytest.raises(TimeoutError):
        arena.acquire(ALIGN, timeout=0.05)
    arena.release(a)  # a and b go; c stays
    assert arena.in_use() == 1
    d, _ = arena.acquire(3 * ALIGN)  # the freed front of the ring
    assert d is not None and d.offset == 0
    assert arena.wait_s > 0


def test_a_full_ring_blocks_until_a_writer_frees_a_block() -> None:
    arena = PinnedArena(torch, 2 * ALIGN, pin=False)
    first, _ = arena.acquire(ALIGN)
    arena.acquire(ALIGN)
    got: list[Block | None] = []
    waiter = threading.Thread(target=lambda: got.append(arena.acquire(ALIGN, timeout=10)[0]))
    waiter.start()
    time.sleep(0.1)
    assert not got  # still waiting: the ring is full
    arena.release(first)
    waiter.join(10)
    assert got and got[0] is not None and got[0].offset == 0


def test_a_block_larger_than_the_ring_gets_its_own_buffer() -> None:
    arena = PinnedArena(torch, 2 * ALIGN, pin=False)
    block, view = arena.acquire(3 * ALIGN + 5)
    assert block is None and view.numel() == 3 * ALIGN + 5 and arena.oversize == 1
    assert view.data_ptr() != arena.buf.data_ptr() and arena.in_use() == 0
    arena.release(block)  # a no-op, as the writers call it
