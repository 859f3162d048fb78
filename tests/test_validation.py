"""Every rejection code, triggered by real engine dumps (or real dumps rewritten where no engine can err)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from hsx import contract
from hsx.engine import validation
from hsx.engine.client import DumpCorrupt, DumpMissing, EngineClient, EngineRejected, EngineUnavailable
from hsx.engine.dumps import Dump, as_float32, delete_dump, open_dump, read_dump, validate_open_dump
from hsx.engine.validation import SampleRejected
from tests.fixtures.dump_checks import validate_dump
from tests.fixtures.engine import RunningEngine, captured_rid, unique_prompt

HIDDEN = 576


@pytest.fixture(scope="module")
def clean(engine_nocache: RunningEngine) -> tuple[list[int], str]:
    """A complete, correct dump of a 9-token prompt: (sent ids, rid)."""
    ids = unique_prompt(9)
    rid = captured_rid("clean")
    reply = engine_nocache.client.prefill(ids, rid)
    assert reply["meta_info"]["cached_tokens"] == 0
    return ids, rid


def load(engine: RunningEngine, rid: str) -> Dump:
    return read_dump(engine.dump_dir, rid, wait_seconds=10)


def expect(reason: str, engine: RunningEngine, dump: Dump, ids: list[int], **overrides: object) -> str:
    kwargs: dict[str, object] = {
        "cached_tokens_reported": 0,
        "expected_hf_indices": engine.info.hf_indices,
        "expected_hidden_size": HIDDEN,
    }
    kwargs.update(overrides)
    with pytest.raises(SampleRejected) as caught:
        validate_dump(dump, ids, **kwargs)  # type: ignore[arg-type]
    assert caught.value.reason == reason, caught.value
    return caught.value.detail


def test_a_clean_dump_passes(engine_nocache: RunningEngine, clean: tuple[list[int], str]) -> None:
    ids, rid = clean
    validate_dump(load(engine_nocache, rid), ids, 0, engine_nocache.info.hf_indices, HIDDEN)


def test_prefix_cached_dump_is_rejected_first(engine_cache: RunningEngine) -> None:
    prefix = unique_prompt(12)
    engine_cache.client.prefill(prefix + [5, 6], captured_rid())
    ids = prefix + [7, 8, 9, 10, 11, 12, 13]
    rid = captured_rid()
    reply = engine_cache.client.prefill(ids, rid)
    dump = load(engine_cache, rid)
    reported = reply["meta_info"]["cached_tokens"]
    detail = expect("cached_tokens", engine_cache, dump, ids, cached_tokens_reported=reported)
    assert "engine reused 12 cached tokens; dumped 7 of 19" in detail


def test_cached_tokens_in_the_response_alone_reject(
    engine_nocache: RunningEngine, clean: tuple[list[int], str]
) -> None:
    ids, rid = clean
    expect("cached_tokens", engine_nocache, load(engine_nocache, rid), ids, cached_tokens_reported=3)


def test_token_count(engine_nocache: RunningEngine, clean: tuple[list[int], str]) -> None:
    ids, rid = clean
    detail = expect("token_count", engine_nocache, load(engine_nocache, rid), ids + [42])
    assert "9" in detail and "10" in detail


def test_token_count_checks_every_tensor(engine_nocache: RunningEngine, clean: tuple[list[int], str]) -> None:
    ids, rid = clean
    dump = load(engine_nocache, rid)
    dump.states[15] = dump.states[15][:-1]
    assert "hidden.15 has 8 rows" in expect("token_count", engine_nocache, dump, ids)


def test_input_ids_mismatch(engine_nocache: RunningEngine, clean: tuple[list[int], str]) -> None:
    ids, rid = clean
    altered = list(ids)
    altered[4] = (altered[4] + 1) % 49152
    assert "first at 4" in expect("input_ids_mismatch", engine_nocache, load(engine_nocache, rid), altered)


def test_layers_mismatch(engine_nocache: RunningEngine, clean: tuple[list[int], str]) -> None:
    ids, rid = clean
    dump = load(engine_nocache, rid)
    expect("layers_mismatch", engine_nocache, dump, ids, expected_hf_indices=[3, 15, 27, 30])
    del dump.states[27]
    expect("layers_mismatch", engine_nocache, dump, ids)


def test_hidden_size_mismatch(engine_nocache: RunningEngine, clean: tuple[list[int], str]) -> None:
    ids, rid = clean
    detail = expect(
        "hidden_size_mismatch", engine_nocache, load(engine_nocache, rid), ids, expected_hidden_size=960
    )
    assert "576" in detail and "960" in detail


def rewrite_dump(
    source: str, target: str, states: dict[int, npt.NDArray[np.uint16] | npt.NDArray[np.float32]], dtype: str
) -> None:
    """Copy a real dump with its states replaced (the engine cannot be made to emit NaN or bf16 here)."""
    shutil.copytree(source, target)
    meta = contract.DumpMeta.from_json((Path(source) / contract.META_FILE).read_text())
    meta.rid = Path(target).name
    meta.dtype = "bfloat16" if dtype == "BF16" else "float32"
    contract.write_meta_atomically(target, meta)
    original = contract.read_safetensors(str(Path(source) / contract.STATES_FILE))
    tensors = [("input_ids", "I32", original["input_ids"].shape, original["input_ids"].data)]
    tensors += [
        (contract.tensor_name(i), dtype, list(a.shape), a.astype(a.dtype.newbyteorder("<")).tobytes())
        for i, a in states.items()
    ]
    contract.write_safetensors(str(Path(target) / contract.STATES_FILE), tensors)


def to_bf16_words(array: npt.NDArray[np.float32]) -> npt.NDArray[np.uint16]:
    return (np.ascontiguousarray(array, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


@pytest.mark.parametrize("dtype", ["F32", "BF16"])
def test_non_finite(engine_nocache: RunningEngine, clean: tuple[list[int], str], dtype: str) -> None:
    ids, rid = clean
    dump = load(engine_nocache, rid)
    states = {i: s.astype(np.float32) for i, s in dump.states.items()}
    converted = {i: (to_bf16_words(s) if dtype == "BF16" else s) for i, s in states.items()}
    good_rid, bad_rid = captured_rid(f"good{dtype}"), captured_rid(f"bad{dtype}")
    rewrite_dump(dump.path, contract.dump_path(engine_nocache.dump_dir, good_rid), converted, dtype)
    good = load(engine_nocache, good_rid)
    assert good.dtypes[30] == dtype
    validate_dump(good, ids, 0, engine_nocache.info.hf_indices, HIDDEN)

    poisoned = {i: s.copy() for i, s in states.items()}
    poisoned[27][3, 100] = np.nan
    poisoned[30][0, 0] = np.inf
    converted = {i: (to_bf16_words(s) if dtype == "BF16" else s) for i, s in poisoned.items()}
    rewrite_dump(dump.path, contract.dump_path(engine_nocache.dump_dir, bad_rid), converted, dtype)
    assert "hidden.27 has 1 NaN/Inf" in expect(
        "non_finite", engine_nocache, load(engine_nocache, bad_rid), ids
    )
    # The job's and the preflight's path: the open dump, counted chunk by chunk in its bytes.
    info = contract.EngineInfo.from_dict({**engine_nocache.info.to_dict(), "dtype": dtype})
    with open_dump(engine_nocache.dump_dir, bad_rid, 1) as opened:
        verdict = validate_open_dump(opened, ids, 0, info, count_values=True)
    failure = verdict.first_failure
    assert failure is not None and failure.reason == "non_finite" and failure.name == "finite"
    assert "hidden.27 has 1 NaN/Inf" in failure.detail and failure.actual == 2
    with open_dump(engine_nocache.dump_dir, good_rid, 1) as opened:
        assert validate_open_dump(opened, ids, 0, info, count_values=True).ok


JOB_CHECKS = ["cached_tokens", "dumped_tokens", "input_ids", "layers", "hidden_size", "finite", "dtype"]


def test_one_verdict_lists_every_check(engine_nocache: RunningEngine, clean: tuple[list[int], str]) -> None:
    """The open dump's verdict (what the job applies, what the preflight reports): every check, in order,
    with expected and actual, and no reason on a pass."""
    ids, rid = clean
    info = engine_nocache.info
    with open_dump(engine_nocache.dump_dir, rid, 10) as dump:
        for count_values in (False, True):
            verdict = validate_open_dump(dump, ids, 0, info, count_values=count_values)
            assert verdict.ok and verdict.first_failure is None and verdict.rejection() is None
            assert [check.name for check in verdict.checks] == JOB_CHECKS
            assert all(check.reason is None and check.detail == "" for check in verdict.checks)
            by_name = {check.name: check for check in verdict.checks}
            assert by_name["dumped_tokens"].actual == len(ids) == by_name["dumped_tokens"].expected
            assert by_name["hidden_size"].actual == [HIDDEN]
            assert by_name["layers"].expected == sorted(f"hidden.{i}" for i in info.hf_indices)


def test_the_first_failure_is_the_rejection(
    engine_nocache: RunningEngine, clean: tuple[list[int], str]
) -> None:
    ids, rid = clean
    with open_dump(engine_nocache.dump_dir, rid, 10) as dump:
        verdict = validate_open_dump(dump, ids + [42], 3, engine_nocache.info)
        failed = [check.name for check in verdict.checks if not check.ok]
        assert failed == ["cached_tokens", "dumped_tokens", "input_ids"]
        rejection = verdict.rejection()
        assert rejection is not None and rejection.reason == "cached_tokens"
        assert "response said 3" in rejection.detail
        token_count = next(check for check in verdict.checks if check.name == "dumped_tokens")
        assert token_count.reason == "token_count"
        assert token_count.detail == "meta says 9 tokens, 10 were sent"
        # A reply without cached_tokens cannot pass: a cache hit could not be told apart.
        missing = validate_open_dump(dump, ids, None, engine_nocache.info).first_failure
        assert missing is not None and missing.name == "cached_tokens" and "no meta_info" in missing.detail


def test_a_dtype_other_than_the_reported_one_fails_last(
    engine_nocache: RunningEngine, clean: tuple[list[int], str]
) -> None:
    """A dump in another dtype than the engine reports: the job calls the engine unfit (unit_processor)."""
    ids, rid = clean
    info = contract.EngineInfo.from_dict(engine_nocache.info.to_dict())
    dumped = contract.canonical_state_dtype(info.dtype)
    info.dtype = "BF16" if dumped != "BF16" else "F32"
    with open_dump(engine_nocache.dump_dir, rid, 10) as dump:
        verdict = validate_open_dump(dump, ids, 0, info)
    failure = verdict.first_failure
    assert failure is not None and failure.name == "dtype" and failure.reason == "dtype_mismatch"
    assert failure.actual == [dumped] and f"but dumps {dumped}" in failure.detail
    # With a width error as well, the sample's own fault comes first.
    info.hidden_size = HIDDEN + 1
    with open_dump(engine_nocache.dump_dir, rid, 10) as dump:
        first = validate_open_dump(dump, ids, 0, info).first_failure
    assert first is not None and first.reason == "hidden_size_mismatch"


def test_one_non_finite_count_for_chunks_and_arrays() -> None:
    values = np.array([1.0, np.nan, -np.inf, 2.0, np.inf], dtype=np.float32)
    assert validation.count_non_finite(values, "F32") == 3
    assert validation.count_non_finite(values.tobytes(), "float32") == 3
    words = to_bf16_words(values)
    assert validation.count_non_finite(words, "BF16") == 3
    assert validation.count_non_finite(memoryview(words.tobytes()), "bf16") == 3
    halves = values.astype(np.float16)
    assert validation.count_non_finite(halves.view(np.uint16), "F16") == 3
    assert validation.count_non_finite(np.ones(4, dtype=np.float32), "F32") == 0
    with pytest.raises(ValueError):
        validation.count_non_finite(b"\0" * 8, "I64")


def test_bf16_words_widen_to_float32() -> None:
    values = np.array([1.0, -2.5, 3.140625, 0.0, -0.0, np.inf, 65280.0], dtype=np.float32)
    np.testing.assert_array_equal(as_float32(to_bf16_words(values), "BF16"), values)
    assert as_float32(values, "F32") is not None


def test_a_dump_under_the_wrong_rid_is_corrupt(
    engine_nocache: RunningEngine, clean: tuple[list[int], str], tmp_path: Path
) -> None:
    _, rid = clean
    impostor = captured_rid("impostor")
    shutil.copytree(contract.dump_path(engine_nocache.dump_dir, rid), tmp_path / impostor)
    with pytest.raises(DumpCorrupt, match="holds the meta of"):
        read_dump(str(tmp_path), impostor, wait_seconds=1)


def test_missing_dump_times_out(engine_nocache: RunningEngine) -> None:
    started = time.monotonic()
    with pytest.raises(DumpMissing):
        read_dump(engine_nocache.dump_dir, captured_rid("never"), wait_seconds=0.3)
    assert time.monotonic() - started < 2


def test_a_truncated_states_file_is_corrupt(
    engine_nocache: RunningEngine, clean: tuple[list[int], str], tmp_path: Path
) -> None:
    _, rid = clean
    target = tmp_path / rid
    shutil.copytree(contract.dump_path(engine_nocache.dump_dir, rid), target)
    states_file = target / contract.STATES_FILE
    states_file.write_bytes(states_file.read_bytes()[:1000])
    with pytest.raises(DumpCorrupt):
        read_dump(str(tmp_path), rid, wait_seconds=1)


def test_delete_dump(engine_nocache: RunningEngine) -> None:
    rid = captured_rid("delete")
    engine_nocache.client.prefill(unique_prompt(3), rid)
    assert Path(contract.dump_path(engine_nocache.dump_dir, rid), contract.META_FILE).is_file()
    delete_dump(engine_nocache.dump_dir, rid)
    assert not Path(contract.dump_path(engine_nocache.dump_dir, rid)).exists()


def test_engine_rejection_carries_the_reason(engine_nocache: RunningEngine) -> None:
    with pytest.raises(EngineRejected) as caught:
        engine_nocache.client.prefill([], captured_rid())
    assert caught.value.reason == "empty_input" and caught.value.status == 400


def test_unreachable_engine_is_unavailable_after_retries() -> None:
    with EngineClient("http://127.0.0.1:9", timeout=2, retries=2, backoff=0.05) as client:
        started = time.monotonic()
        with pytest.raises(EngineUnavailable, match="failed 3 times"):
            client.prefill([1, 2], captured_rid())
    assert time.monotonic() - started < 5


def test_reason_codes_are_stable() -> None:
    assert validation.REASONS == (
        "cached_tokens",
        "token_count",
        "input_ids_mismatch",
        "layers_mismatch",
        "hidden_size_mismatch",
        "non_finite",
        "dump_missing",
        "engine_rejected",
        "engine_timeout",
    )
