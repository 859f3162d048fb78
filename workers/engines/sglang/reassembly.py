"""Reassembly of chunked prefills: the pieces of one prompt, gathered in order into one buffer.

One :class:`Reassembler` per writer thread; pieces of one rid always go to the same writer, so a rid's
pieces and drops arrive in the order the scheduler produced them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from workers.engines.sglang.planning import Piece


class ChunkOutOfOrder(RuntimeError):
    """A piece that does not continue its request's partial capture; the capture is dropped."""


@dataclass
class Partial:
    token: int
    buf: Any  # pageable uint8 [K, total, row_bytes]
    ids: bytearray
    non_finite: list[int]
    filled: int = 0


@dataclass
class Completed:
    """A whole prompt: its ids, one [T, row_bytes] uint8 view per tensor, non-finite counts per tensor."""

    ids: bytes
    layers: list[Any]
    non_finite: list[int] = field(default_factory=list)


class Reassembler:
    def __init__(self, torch: Any, num_tensors: int, row_bytes: int) -> None:
        self.torch = torch
        self.K = num_tensors
        self.row_bytes = row_bytes
        self.parts: dict[str, Partial] = {}

    def add(self, p: Piece, rows: Any, non_finite: list[int]) -> Completed | None:
        """Take one piece (``rows``: uint8 [K, p.n, row_bytes]); the whole prompt once it is complete.

        A prompt that arrived in one piece is returned at once, as views of ``rows`` (no copy). Raises
        :class:`ChunkOutOfOrder` when the piece does not continue the rid's partial capture.
        """
        if p.whole:
            return Completed(p.ids, [rows[k] for k in range(self.K)], list(non_finite))
        part = self.parts.get(p.rid)
        if p.dst_off == 0:
            part = Partial(
                p.token,
                self.torch.empty((self.K, p.total, self.row_bytes), dtype=self.torch.uint8),
                bytearray(4 * p.total),
                [0] * self.K,
            )
            self.parts[p.rid] = part
        elif part is None or part.token != p.token or part.filled != p.dst_off:
            if part is not None and part.token == p.token:
                del self.parts[p.rid]
            have = "nothing" if part is None else f"{part.filled} rows of capture {part.token}"
            raise ChunkOutOfOrder(
                f"chunk of {p.rid} (capture {p.token}) at row {p.dst_off}, holding {have}; dropped"
            )
        part.buf[:, p.dst_off : p.dst_off + p.n].copy_(rows)
        part.ids[4 * p.dst_off : 4 * (p.dst_off + p.n)] = p.ids
        part.filled += p.n
        part.non_finite = [a + b for a, b in zip(part.non_finite, non_finite, strict=True)]
        if p.meta is None:
            return None
        del self.parts[p.rid]
        if part.filled != p.total:
            raise ChunkOutOfOrder(f"{p.rid}: {part.filled} of {p.total} rows at the last chunk; dropped")
        return Completed(bytes(part.ids), [part.buf[k] for k in range(self.K)], part.non_finite)

    def drop(self, rid: str, token: int) -> bool:
        """Forget the partial capture ``token`` of ``rid`` (a newer capture of the rid is kept)."""
        part = self.parts.get(rid)
        if part is not None and part.token == token:
            del self.parts[rid]
            return True
        return False
