"""Chunk reassembly of the SGLang plugin's writers: order, restarts, drops, non-finite counts."""

from __future__ import annotations

import pytest
import torch

from hsx import contract
from workers.engines.sglang.planning import Piece, int32_bytes
from workers.engines.sglang.reassembly import ChunkOutOfOrder, Reassembler

K, ROW_BYTES = 2, 8


def meta(rid: str, total: int) -> contract.DumpMeta:
    return contract.DumpMeta(rid, total, total, 0, 2, "float32", 6, [1], [2, 6])


def piece(rid: str, token: int, dst_off: int, n: int, total: int, last: bool = False) -> Piece:
    ids = int32_bytes(range(dst_off, dst_off + n))
    return Piece(rid, token, 0, n, dst_off, total, ids, meta(rid, total) if last else None)


def rows(dst_off: int, n: int) -> torch.Tensor:
    """uint8 [K, n, ROW_BYTES] whose bytes say which tensor and which prompt row they are."""
    out = torch.empty((K, n, ROW_BYTES), dtype=torch.uint8)
    for k in range(K):
        for i in range(n):
            out[k, i] = 10 * k + dst_off + i
    return out


def test_a_one_piece_prompt_comes_back_at_once_without_a_copy() -> None:
    r = Reassembler(torch, K, ROW_BYTES)
    src = rows(0, 3)
    done = r.add(piece("hsx-a", 1, 0, 3, 3, last=True), src, [0, 5])
    assert done is not None and done.non_finite == [0, 5]
    assert done.layers[1].data_ptr() == src[1].data_ptr() and not r.parts


def test_chunks_in_order_reassemble_the_prompt() -> None:
    r = Reassembler(torch, K, ROW_BYTES)
    assert r.add(piece("hsx-a", 1, 0, 2, 5), rows(0, 2), [1, 0]) is None
    assert r.add(piece("hsx-a", 1, 2, 2, 5), rows(2, 2), [0, 0]) is None
    done = r.add(piece("hsx-a", 1, 4, 1, 5, last=True), rows(4, 1), [2, 3])
    assert done is not None and not r.parts
    assert torch.equal(done.layers[0], rows(0, 5)[0]) and torch.equal(done.layers[1], rows(0, 5)[1])
    assert list(memoryview(done.ids).cast("i")) == [0, 1, 2, 3, 4]
    assert done.non_finite == [3, 3]


def test_a_chunk_out_of_order_drops_the_capture() -> None:
    r = Reassembler(torch, K, ROW_BYTES)
    r.add(piece("hsx-a", 1, 0, 2, 5), rows(0, 2), [0, 0])
    with pytest.raises(ChunkOutOfOrder, match="at row 3"):
        r.add(piece("hsx-a", 1, 3, 2, 5), rows(3, 2), [0, 0])
    assert not r.parts
    with pytest.raises(ChunkOutOfOrder, match="holding nothing"):
        r.add(piece("hsx-a", 1, 2, 3, 5, last=True), rows(2, 3), [0, 0])


def test_a_chunk_of_a_stale_capture_leaves_the_newer_one_alone() -> None:
    r = Reassembler(torch, K, ROW_BYTES)
    r.add(piece("hsx-a", 1, 0, 2, 5), rows(0, 2), [0, 0])
    r.add(piece("hsx-a", 2, 0, 1, 5), rows(0, 1), [0, 0])  # a restart: capture 2 replaces capture 1
    with pytest.raises(ChunkOutOfOrder):
        r.add(piece("hsx-a", 1, 2, 3, 5, last=True), rows(2, 3), [0, 0])
    assert r.parts["hsx-a"].token == 2 and r.parts["hsx-a"].filled == 1


def test_drop_forgets_only_the_named_capture() -> None:
    r = Reassembler(torch, K, ROW_BYTES)
    r.add(piece("hsx-a", 2, 0, 2, 5), rows(0, 2), [0, 0])
    assert r.drop("hsx-a", 1) is False and "hsx-a" in r.parts
    assert r.drop("hsx-a", 2) is True and not r.parts
    assert r.drop("hsx-unknown", 1) is False
