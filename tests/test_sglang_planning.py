"""Span planning of the SGLang plugin: which batch rows are captured, chunk placement, restarts, aborts."""

from __future__ import annotations

from array import array
from typing import Any

from hsx import contract
from hsx.engine.regenerate_contract import generation_rid
from workers.engines.sglang.planning import Planner, ReqState


class Req:
    """The part of SGLang's ``Req`` the planner reads."""

    def __init__(self, rid: str, n: int, first: int = 100) -> None:
        self.rid = rid
        self.origin_input_ids = list(range(first, first + n))
        self.to_finish: object = None
        self.done = False
        self.cached_tokens = 0
        self.extra_key = None

    def finished(self) -> bool:
        return self.done


class Recorder:
    def __init__(self) -> None:
        self.drops: list[tuple[str, int]] = []
        self.metas: list[str] = []

    def meta(self, req: Any, st: ReqState) -> contract.DumpMeta:
        self.metas.append(req.rid)
        return contract.DumpMeta(
            req.rid, st.total, len(req.origin_input_ids), 0, 8, "float32", 6, [1], [2, 6]
        )

    def drop(self, rid: str, token: int) -> None:
        self.drops.append((rid, token))


def planner() -> tuple[Planner, Recorder]:
    rec = Recorder()
    return Planner(rec.meta, rec.drop), rec


def ids_of(data: bytes) -> list[int]:
    return list(array("i", data))


def test_only_captured_prompt_rows_are_planned_and_adjacent_rows_merge_into_spans() -> None:
    p, rec = planner()
    a, plain, b, c = Req("hsx-a", 3), Req("plain-1", 4), Req("hsx-b", 2, 200), Req("hsx-c", 5, 300)
    plan = p.plan([a, plain, b, c], [0, 0, 0, 0], [3, 4, 2, 5])
    assert plan is not None
    assert plan.batch_rows == 14 and plan.rows == 10
    # a at batch rows 0..3; the plain request's 4 rows are skipped; b and c are adjacent: one span
    assert plan.spans == [[0, 3, 0], [7, 7, 3]]
    assert [(x.rid, x.cap_off, x.n, x.dst_off, x.total) for x in plan.pieces] == [
        ("hsx-a", 0, 3, 0, 3),
        ("hsx-b", 3, 2, 0, 2),
        ("hsx-c", 5, 5, 0, 5),
    ]
    assert all(x.whole for x in plan.pieces) and rec.metas == ["hsx-a", "hsx-b", "hsx-c"]
    assert ids_of(plan.pieces[1].ids) == [200, 201]
    assert not p.partials


def test_a_batch_without_captured_rows_plans_nothing() -> None:
    p, _ = planner()
    assert p.plan([Req("plain", 3), Req("HEALTH_CHECK_1", 1)], [0, 0], [3, 1]) is None


def test_batches_without_lengths_for_every_request_are_not_captured() -> None:
    p, _ = planner()
    assert p.plan([Req("hsx-a", 3)], None, [3]) is None
    assert p.plan([Req("hsx-a", 3), Req("hsx-b", 3)], [0], [3]) is None


def test_chunks_are_placed_by_their_prefix_offset_and_the_last_one_carries_the_meta() -> None:
    p, rec = planner()
    r = Req("hsx-long", 10)
    first = p.plan([r], [0], [4])
    assert first is not None and first.pieces[0].meta is None and not first.pieces[0].whole
    assert list(p.partials.values()) == [r]
    other = Req("hsx-short", 2)
    second = p.plan([other, r], [0, 4], [2, 4])  # the chunked request continues after another one
    assert second is not None
    piece = second.pieces[1]
    assert (piece.cap_off, piece.n, piece.dst_off, piece.total) == (2, 4, 4, 10)
    assert second.spans == [[0, 6, 0]]
    third = p.plan([r], [8], [2])
    assert third is not None and third.pieces[0].meta is not None and third.pieces[0].dst_off == 8
    assert ids_of(third.pieces[0].ids) == [108, 109]
    assert r._hsx_cap.chunks == 3 and r._hsx_cap.closed and not p.partials and not rec.drops
    assert p.plan([r], [10], [1]) is None  # its decode row afterwards


def test_decode_rows_in_a_mixed_batch_are_skipped() -> None:
    p, _ = planner()
    done = Req("hsx-decoding", 3)
    assert p.plan([done], [0], [3]) is not None
    fresh = Req("hsx-new", 2)
    plan = p.plan([fresh, done], [0, 3], [2, 1])
    assert plan is not None and [x.rid for x in plan.pieces] == ["hsx-new"] and plan.batch_rows == 3


def test_generation_requests_are_never_planned_whatever_their_rows() -> None:
    """Regeneration's requests share batches with captures: their prompts, their decode rows in a mixed
    batch and the re-prefill of a retracted one (prompt and output so far) are all passed over."""
    p, rec = planner()
    prompt, decoding, retracted = (Req(generation_rid(f"s{i}-t1"), 6, 500 + 50 * i) for i in range(3))
    captured = Req("hsx-a", 3)
    plan = p.plan([prompt, captured, decoding, retracted], [0, 0, 10, 0], [6, 3, 1, 14])
    assert plan is not None and plan.batch_rows == 24 and plan.rows == 3
    assert plan.spans == [[6, 3, 0]] and [x.rid for x in plan.pieces] == ["hsx-a"]
    assert p.plan([prompt, decoding], [0, 10], [6, 1]) is None
    assert rec.metas == ["hsx-a"] and not rec.drops and not p.partials
    assert not any(hasattr(r, "_hsx_cap") for r in (prompt, decoding, retracted))


def test_a_prefill_restarted_at_another_offset_drops_the_partial_and_starts_again() -> None:
    p, rec = planner()
    r = Req("hsx-retracted", 8)
    p.plan([r], [0], [4])
    token = r._hsx_cap.token
    again = p.plan([r], [0], [4])  # retracted and re-prefilled from the start
    assert rec.drops == [("hsx-retracted", token)]
    assert again is not None and r._hsx_cap.token != token and again.pieces[0].dst_off == 0
    last = p.plan([r], [4], [4])
    assert last is not None and last.pieces[0].meta is not None and last.pieces[0].total == 8


def test_a_restart_past_the_start_captures_only_the_rest_and_says_so() -> None:
    p, rec = planner()
    r = Req("hsx-skip", 8)
    p.plan([r], [0], [3])
    plan = p.plan([r], [5], [3])  # e.g. a prefix-cache hit on re-prefill
    assert plan is not None and len(rec.drops) == 1
    piece = plan.pieces[0]
    assert (piece.dst_off, piece.n, piece.total) == (0, 3, 3) and r._hsx_cap.start == 5
    assert piece.meta is not None and piece.meta.num_tokens == 3 and piece.meta.prompt_tokens == 8


def test_aborted_requests_are_swept_and_never_planned_again() -> None:
    p, rec = planner()
    r, s = Req("hsx-aborted", 9), Req("hsx-finished", 9)
    p.plan([r, s], [0, 0], [3, 3])
    r.to_finish = object()  # set_finish_with_abort marks it before it finishes
    s.done = True
    p.sweep()
    assert sorted(rid for rid, _ in rec.drops) == ["hsx-aborted", "hsx-finished"]
    assert not p.partials and p.dropped == 2
    assert p.plan([r, s], [3, 3], [3, 3]) is None


def test_an_abort_noticed_at_planning_time_drops_the_partial() -> None:
    p, rec = planner()
    r = Req("hsx-a", 6)
    p.plan([r], [0], [3])
    r.to_finish = object()
    p.partials.clear()  # as if the sweep had not run yet: the planner still notices
    assert p.plan([r], [3], [3]) is None
    assert rec.drops == [("hsx-a", r._hsx_cap.token)]


def test_a_failed_forward_closes_its_requests() -> None:
    p, rec = planner()
    r = Req("hsx-f", 6)
    plan = p.plan([r], [0], [3])
    assert plan is not None
    p.fail(plan)
    assert rec.drops == [("hsx-f", r._hsx_cap.token)] and not p.partials
    assert p.plan([r], [3], [3]) is None  # its later chunks are not captured either
