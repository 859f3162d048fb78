"""Which rows of a batch belong to captured requests, and where they go in each request's dump.

Runs on the scheduler thread before an EXTEND/MIXED forward. Pure Python over SGLang's ``Req`` objects
(only ``rid``, ``origin_input_ids``, ``finished()``, ``to_finish``, ``cached_tokens`` and ``extra_key``
are read); the per-request progress lives on the ``Req`` as ``_hsx_cap``.
"""

from __future__ import annotations

import itertools
import logging
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hsx import contract

log = logging.getLogger("hsx.sglang")


class ReqState:
    """Per-request capture progress, kept on the ``Req`` object (scheduler thread only)."""

    __slots__ = ("token", "start", "next", "total", "chunks", "closed")

    def __init__(self, token: int, start: int, total: int) -> None:
        self.token = token  # tells this capture from an earlier one of the same rid
        self.start = start  # first prompt position captured (> 0 only on a prefix-cache hit)
        self.next = start  # next prompt position expected
        self.total = total  # rows of the finished dump
        self.chunks = 0
        self.closed = False  # written, failed or aborted: ignore further rows


@dataclass
class Piece:
    """The rows of one request in one forward."""

    rid: str
    token: int
    cap_off: int  # first row in the forward's capture buffer
    n: int
    dst_off: int  # first row in the dump
    total: int
    ids: bytes  # int32 little-endian input ids of these rows
    meta: contract.DumpMeta | None  # set on the piece that completes the prompt
    state: ReqState | None = field(default=None, repr=False)

    @property
    def whole(self) -> bool:
        """The whole prompt arrived in this one piece."""
        return self.dst_off == 0 and self.n == self.total and self.meta is not None


@dataclass
class Plan:
    """The captured rows of one forward: pieces per request and contiguous spans of batch rows."""

    pieces: list[Piece]
    spans: list[list[int]]  # [batch_row, n, cap_off]
    batch_rows: int  # rows of the whole batch's prompt part (captured or not)
    rows: int  # captured rows


def int32_bytes(ids: Sequence[int]) -> bytes:
    """Token ids as int32 little-endian bytes (the hosts hsx runs on are little-endian)."""
    return array("i", ids).tobytes()


def _is_aborted(req: Any) -> bool:
    # finished(), or about to be: set_finish_with_abort swaps the prompt for one token before it finishes.
    return bool(req.finished()) or getattr(req, "to_finish", None) is not None


MetaFactory = Callable[[Any, ReqState], contract.DumpMeta]
DropSink = Callable[[str, int], None]


class Planner:
    """Plans the captured rows of each forward and tracks requests whose prompt is still being captured.

    ``make_meta(req, state)`` builds the dump meta when a prompt completes; ``on_drop(rid, token)`` tells
    the writers to discard the partial capture ``token`` of ``rid``.
    """

    def __init__(self, make_meta: MetaFactory, on_drop: DropSink) -> None:
        self.make_meta = make_meta
        self.on_drop = on_drop
        self._tokens = itertools.count(1)
        self.partials: dict[int, Any] = {}  # token -> Req with a capture in progress
        self.dropped = 0

    def plan(self, reqs: Sequence[Any], prefix_lens: Any, extend_lens: Any) -> Plan | None:
        """The captured rows of a batch, or None when it holds none (or cannot be placed)."""
        if self.partials:
            self.sweep()
        if (
            prefix_lens is None
            or extend_lens is None
            or not (len(reqs) == len(prefix_lens) == len(extend_lens))
        ):
            log.error("hsx: batch without prefix_lens/extend_lens for every request; not captured")
            return None
        pieces: list[Piece] = []
        spans: list[list[int]] = []
        row = rows = 0
        for req, pre, ext in zip(reqs, prefix_lens, extend_lens, strict=True):
            pre, ext = int(pre), int(ext)
            if contract.is_captured_rid(getattr(req, "rid", None)):
                piece = self._piece(req, pre, ext, rows)
                if piece is not None:
                    last = spans[-1] if spans else None
                    if last is not None and last[0] + last[1] == row and last[2] + last[1] == rows:
                        last[1] += piece.n
                    else:
                        spans.append([row, piece.n, rows])
                    pieces.append(piece)
                    rows += piece.n
            row += ext
        if not pieces:
            return None
        return Plan(pieces, spans, row, rows)

    def _piece(self, req: Any, pre: int, ext: int, cap_off: int) -> Piece | None:
        st: ReqState | None = getattr(req, "_hsx_cap", None)
        if st is not None and st.closed:
            return None
        if _is_aborted(req):
            if st is not None:
                self.drop(req, st, "finished before its prompt was complete")
            return None
        ids_all = req.origin_input_ids
        plen = len(ids_all)
        n = min(pre + ext, plen) - pre
        if n <= 0:
            return None  # a decode row of a request whose prompt is done
        if st is None or pre != st.next:
            if st is not None:
                self.drop(req, st, f"prefill restarted at {pre}, expected {st.next}")
            st = ReqState(next(self._tokens), pre, plen - pre)
            req._hsx_cap = st
        ids = int32_bytes(ids_all[pre : pre + n])
        piece = Piece(req.rid, st.token, cap_off, n, pre - st.start, st.total, ids, None, st)
        st.next = pre + n
        st.chunks += 1
        if st.next == plen:
            st.closed = True
            self.partials.pop(st.token, None)
            piece.meta = self.make_meta(req, st)
        else:
            self.partials[st.token] = req
        return piece

    def drop(self, req: Any, st: ReqState, reason: str) -> None:
        st.closed = True
        self.partials.pop(st.token, None)
        self.on_drop(req.rid, st.token)
        self.dropped += 1
        log.warning(
            "hsx: dropped partial capture of %s (%s; %d of %d rows captured)",
            req.rid,
            reason,
            st.next - st.start,
            st.total,
        )

    def fail(self, plan: Plan) -> None:
        """A forward's capture failed: its requests are not captured, not even their later chunks."""
        for p in plan.pieces:
            if p.state is not None:
                p.state.closed = True
            self.partials.pop(p.token, None)
            self.on_drop(p.rid, p.token)

    def sweep(self) -> None:
        """Drop the partial captures of requests that finished (were aborted) mid-prefill."""
        for token, req in list(self.partials.items()):
            st = getattr(req, "_hsx_cap", None)
            if st is None or st.token != token or st.closed:
                self.partials.pop(token, None)
            elif _is_aborted(req):
                self.drop(req, st, "aborted")
