"""The one dump validator: does a dump hold exactly the sample that was sent, in the engine's terms?

:func:`check_dump` runs every check and returns them all (name, expected, actual, and for a failure its
reason code and detail). A job rejects a sample with the first failure (``SampleRejected``; a dtype
mismatch instead makes the engine unfit: every dump of it would be so); the preflight (``hsx verify``,
``POST /verify``, the dashboard) reports every check on its known prompts, so what it proves is exactly
what a job applies. The dump is read through :mod:`hsx.engine.dumps`, whose ``validate_open_dump`` feeds this.

The first check is the one that matters most: an engine that reused a cached prefix computed (and dumped)
only the tail of the prompt, so a dump with ``cached_tokens != 0`` is never usable, whatever else it holds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from hsx.contract import DumpMeta, canonical_state_dtype
from hsx.errors import ReasonError
from hsx.safetensors_io import TensorSpec

# Stable reason codes, stored with rejected samples and counted in job reports.
CACHED_TOKENS: Final = "cached_tokens"
TOKEN_COUNT: Final = "token_count"
INPUT_IDS_MISMATCH: Final = "input_ids_mismatch"
LAYERS_MISMATCH: Final = "layers_mismatch"
HIDDEN_SIZE_MISMATCH: Final = "hidden_size_mismatch"
NON_FINITE: Final = "non_finite"
DUMP_MISSING: Final = "dump_missing"
ENGINE_REJECTED: Final = "engine_rejected"
# The engine gave no answer in time while it still answered other requests (sent twice, then rejected).
ENGINE_TIMEOUT: Final = "engine_timeout"
# Longer than the job's max_length, with truncation "reject" (or no assistant token left after the cut).
TOO_LONG: Final = "too_long"
# The dump's states are not in the dtype the engine reports: the engine is unfit, not the sample.
DTYPE_MISMATCH: Final = "dtype_mismatch"
# The sample's dump is larger than the engine says it can write (EngineInfo.max_dump_bytes): rejected
# before it is sent, where the engine would answer and no dump would ever come.
DUMP_TOO_LARGE: Final = "dump_too_large"
REASONS: Final = (
    CACHED_TOKENS,
    TOKEN_COUNT,
    INPUT_IDS_MISMATCH,
    LAYERS_MISMATCH,
    HIDDEN_SIZE_MISMATCH,
    NON_FINITE,
    DUMP_MISSING,
    ENGINE_REJECTED,
    ENGINE_TIMEOUT,
)
# Rejections that say what an engine did, not what the sample is: another try (POST /jobs/{id}/retry,
# perhaps on other engines) can keep the sample. An engine's 4xx refusal (engine_rejected) would be
# refused again, and the dataset's and the chat template's reasons are the record's own.
RETRIABLE_REASONS: Final = frozenset(
    {
        CACHED_TOKENS,
        TOKEN_COUNT,
        INPUT_IDS_MISMATCH,
        LAYERS_MISMATCH,
        HIDDEN_SIZE_MISMATCH,
        NON_FINITE,
        DUMP_MISSING,
        ENGINE_TIMEOUT,
        DTYPE_MISMATCH,
        DUMP_TOO_LARGE,  # an engine with a larger dump directory, or more memory, can take it
    }
)

# Bits that are all ones in the exponent of a non-finite value, per 16-bit float format.
_EXPONENT_MASKS: Final = {"BF16": 0x7F80, "F16": 0x7C00}


class SampleRejected(ReasonError):
    """A capture that must not become training data; ``reason`` is stored with the rejected sample."""


@dataclass
class Check:
    """One check: what was expected, what was found; a failure carries its reason code and a detail."""

    name: str
    ok: bool
    expected: Any
    actual: Any
    reason: str | None = None
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class DumpVerdict:
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks)

    @property
    def first_failure(self) -> Check | None:
        return next((check for check in self.checks if not check.ok), None)

    def rejection(self) -> SampleRejected | None:
        """The first failure as a rejection, or None when the dump is usable."""
        failure = self.first_failure
        if failure is None:
            return None
        return SampleRejected(failure.reason or LAYERS_MISMATCH, failure.detail)


def _check(name: str, ok: bool, expected: Any, actual: Any, reason: str, detail: str) -> Check:
    return Check(name, ok, expected, actual, None if ok else reason, "" if ok else detail)


def check_dump(
    meta: DumpMeta,
    dumped_ids: npt.NDArray[Any],
    state_specs: Mapping[str, TensorSpec],
    sent_ids: Sequence[int] | npt.NDArray[Any],
    cached_tokens_reported: int | None,
    expected_tensors: Sequence[str],
    expected_hidden_size: int,
    expected_dtype: str,
    non_finite: Mapping[str, int] | None,
    non_finite_source: str = "counted by the engine",
) -> DumpVerdict:
    """Every check of one dump, in the order a job applies them: cache reuse, token counts, ids, layers,
    widths, non-finite values, dtype.

    ``cached_tokens_reported``: the ``/generate`` reply's (None: the reply had none). ``non_finite``:
    NaN/Inf per tensor (the engine's count, or one made from the dump's bytes); None when nobody counted,
    and then the job checks every chunk as it copies it into the shard (:func:`count_non_finite` there too).
    """
    checks: list[Check] = []
    sent = len(sent_ids)
    dumped = int(meta.num_tokens)

    reported = "missing" if cached_tokens_reported is None else int(cached_tokens_reported)
    cached = max(0 if reported == "missing" else int(reported), int(meta.cached_tokens))
    checks.append(
        _check(
            "cached_tokens",
            cached == 0 and cached_tokens_reported is not None,
            0,
            cached if cached or cached_tokens_reported is not None else "missing from the reply",
            CACHED_TOKENS,
            f"engine reused {cached} cached tokens; dumped {dumped} of {sent} "
            f"(response said {reported}, meta said {meta.cached_tokens})"
            if cached
            else "the reply has no meta_info.cached_tokens: a reused cached prefix could not be detected",
        )
    )

    rows = [("input_ids", int(dumped_ids.size))]
    rows += [(name, spec.shape[0] if spec.shape else 1) for name, spec in sorted(state_specs.items())]
    wrong = next(((name, count) for name, count in rows if count != sent), None)
    if dumped != sent:
        detail = f"meta says {dumped} tokens, {sent} were sent"
    else:
        detail = f"{wrong[0]} has {wrong[1]} rows, {sent} tokens were sent" if wrong else ""
    uniform = len({dumped, *(count for _, count in rows)}) == 1
    checks.append(
        _check(
            "dumped_tokens",
            dumped == sent and wrong is None,
            sent,
            dumped if uniform else {"meta": dumped, **dict(rows)},
            TOKEN_COUNT,
            detail,
        )
    )

    checks.append(_ids_check(dumped_ids, sent_ids))

    layers = sorted(state_specs)
    expected = sorted(expected_tensors)
    checks.append(
        _check(
            "layers",
            layers == expected,
            expected,
            layers,
            LAYERS_MISMATCH,
            f"dump has {layers}, expected {expected}",
        )
    )

    ordered = [n for n in expected_tensors if n in state_specs] + [n for n in layers if n not in expected]
    bad_width = [n for n in ordered if tuple(state_specs[n].shape[1:]) != (expected_hidden_size,)]
    widths = sorted({spec.shape[-1] if len(spec.shape) == 2 else -1 for spec in state_specs.values()})
    shape = list(state_specs[bad_width[0]].shape) if bad_width else []
    checks.append(
        _check(
            "hidden_size",
            widths == [expected_hidden_size] and not bad_width,
            expected_hidden_size,
            widths,
            HIDDEN_SIZE_MISMATCH,
            f"{bad_width[0] if bad_width else 'no state'} has shape {shape}, "
            f"expected [{sent}, {expected_hidden_size}]",
        )
    )

    if non_finite is None:
        uncounted = "not counted by the engine: every chunk is checked as it is copied"
        checks.append(Check("finite", True, 0, uncounted))
    else:
        bad = [(name, count) for name, count in sorted(non_finite.items()) if count]
        checks.append(
            _check(
                "finite",
                not bad,
                0,
                sum(count for _, count in bad),
                NON_FINITE,
                f"{bad[0][0]} has {bad[0][1]} NaN/Inf values ({non_finite_source})" if bad else "",
            )
        )

    try:
        want = canonical_state_dtype(expected_dtype)
    except ValueError:
        want = expected_dtype
    dtypes = sorted({spec.dtype for spec in state_specs.values()})
    other = [d for d in dtypes if d != want]
    checks.append(
        _check(
            "dtype",
            dtypes == [want],
            want,
            dtypes,
            DTYPE_MISMATCH,
            f"the engine reports dtype {expected_dtype} ({want}) but dumps {', '.join(other)}",
        )
    )
    return DumpVerdict(checks)


def _ids_check(dumped_ids: npt.NDArray[Any], sent_ids: Sequence[int] | npt.NDArray[Any]) -> Check:
    sent = len(sent_ids)
    expected = f"the {sent} sent ids"
    dumped_flat = dumped_ids.reshape(-1).astype(np.int64)
    if dumped_flat.size != sent:
        detail = f"{dumped_flat.size} ids dumped, {sent} sent"
        return Check("input_ids", False, expected, f"{dumped_flat.size} ids", INPUT_IDS_MISMATCH, detail)
    sent_array = np.asarray(sent_ids, dtype=np.int64)
    differing = np.flatnonzero(dumped_flat != sent_array)
    if not differing.size:
        return Check("input_ids", True, expected, "identical")
    first = int(differing[0])
    dumped, wanted = int(dumped_flat[first]), int(sent_array[first])
    return Check(
        "input_ids",
        False,
        expected,
        f"differ from position {first} (dumped {dumped}, sent {wanted})",
        INPUT_IDS_MISMATCH,
        f"{differing.size} of {sent} token ids differ; first at {first}: dumped {dumped}, sent {wanted}",
    )


def count_non_finite(data: bytes | memoryview | npt.NDArray[Any], dtype: str) -> int:
    """NaN and Inf values in raw little-endian state bytes (or an array of them) of a safetensors dtype;
    16-bit floats are non-finite when their exponent bits are all ones. The one non-finite check: the
    shard writer runs it on each chunk it copies, the preflight on each chunk of its dumps."""
    name = canonical_state_dtype(dtype)
    if name in _EXPONENT_MASKS:
        mask = _EXPONENT_MASKS[name]
        words = _as(data, "<u2")
        return int(np.count_nonzero(np.bitwise_and(words, mask) == mask))
    return int(np.count_nonzero(~np.isfinite(_as(data, "<f4"))))


def _as(data: bytes | memoryview | npt.NDArray[Any], dtype: str) -> npt.NDArray[Any]:
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(dtype)
    return np.frombuffer(data, dtype=dtype)
