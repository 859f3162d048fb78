"""One pinned host buffer handed out as a ring: the staging memory of the device-to-host copies."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

ALIGN = 4096


class Block:
    """A reserved slice of the ring; ``freed`` blocks are reclaimed once every older block is freed."""

    __slots__ = ("offset", "size", "freed")

    def __init__(self, offset: int, size: int) -> None:
        self.offset = offset
        self.size = size
        self.freed = False

    def __repr__(self) -> str:
        return f"Block({self.offset}, {self.size}, freed={self.freed})"


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to the ring's alignment (at least one unit)."""
    return max(ALIGN, -(-nbytes // ALIGN) * ALIGN)


def fit(size: int, live: deque[Block], n: int) -> int | None:
    """Where a block of ``n`` (aligned) bytes fits in a ring of ``size`` bytes, or None when it is full.

    Blocks are allocated in order (``live`` is oldest first) and freed in any order; space is reclaimed
    from the oldest end only, so the free space is ``[head, size)`` then ``[0, first)`` before the ring
    wraps, and ``[head, first)`` after.
    """
    if not live:
        return 0
    first, last = live[0], live[-1]
    head = last.offset + last.size
    if last.offset >= first.offset:  # not wrapped
        if head + n <= size:
            return head
        if n <= first.offset:
            return 0
        return None
    return head if head + n <= first.offset else None


class PinnedArena:
    """``acquire`` blocks while the ring is full (the writers are behind): that backpressure keeps host
    memory bounded. A block larger than the whole ring gets a one-off buffer (counted in ``oversize``)."""

    def __init__(self, torch: Any, nbytes: int, pin: bool) -> None:
        self.torch = torch
        self.pin = pin
        self.size = max(ALIGN, nbytes // ALIGN * ALIGN)
        self.buf = torch.empty(self.size, dtype=torch.uint8, pin_memory=pin)
        self.live: deque[Block] = deque()
        self.cv = threading.Condition()
        self.wait_s = 0.0
        self.oversize = 0

    def acquire(self, nbytes: int, timeout: float | None = None) -> tuple[Block | None, Any]:
        """A block and its ``nbytes`` uint8 view; ``(None, buffer)`` for a one-off oversize buffer.

        Raises TimeoutError when ``timeout`` passes with the ring still full (tests).
        """
        n = aligned(nbytes)
        if n > self.size:
            self.oversize += 1
            return None, self.torch.empty(nbytes, dtype=self.torch.uint8, pin_memory=self.pin)
        with self.cv:
            off = fit(self.size, self.live, n)
            if off is None:
                t0 = time.perf_counter()
                deadline = None if timeout is None else t0 + timeout
                while off is None:
                    left = None if deadline is None else deadline - time.perf_counter()
                    if left is not None and left <= 0:
                        self.wait_s += time.perf_counter() - t0
                        raise TimeoutError(f"arena full: {n} bytes wanted, {len(self.live)} blocks live")
                    self.cv.wait(left)
                    off = fit(self.size, self.live, n)
                self.wait_s += time.perf_counter() - t0
            block = Block(off, n)
            self.live.append(block)
        return block, self.buf[off : off + nbytes]

    def release(self, block: Block | None) -> None:
        if block is None:
            return
        with self.cv:
            block.freed = True
            while self.live and self.live[0].freed:
                self.live.popleft()
            self.cv.notify_all()

    def in_use(self) -> int:
        with self.cv:
            return len(self.live)
