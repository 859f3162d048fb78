"""Checks that a dump holds exactly the sample that was sent, before it may become training data.

The first check is the one that matters most: an engine that reused a cached prefix computed (and dumped)
only the tail of the prompt, so a dump with ``cached_tokens != 0`` is never usable, whatever else it holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from workers.engine_client import Dump

# Stable reason codes, stored with rejected samples and counted in job reports.
CACHED_TOKENS: Final = "cached_tokens"
TOKEN_COUNT: Final = "token_count"
INPUT_IDS_MISMATCH: Final = "input_ids_mismatch"
LAYERS_MISMATCH: Final = "layers_mismatch"
HIDDEN_SIZE_MISMATCH: Final = "hidden_size_mismatch"
NON_FINITE: Final = "non_finite"
DUMP_MISSING: Final = "dump_missing"
ENGINE_REJECTED: Final = "engine_rejected"
REASONS: Final = (
    CACHED_TOKENS,
    TOKEN_COUNT,
    INPUT_IDS_MISMATCH,
    LAYERS_MISMATCH,
    HIDDEN_SIZE_MISMATCH,
    NON_FINITE,
    DUMP_MISSING,
    ENGINE_REJECTED,
)

_BF16_EXPONENT_MASK: Final = 0x7F80  # all ones: Inf or NaN
_BF16_NAMES: Final = ("BF16", "bfloat16", "bf16")


class SampleRejected(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def validate_dump(
    dump: Dump,
    sent_ids: Sequence[int],
    cached_tokens_reported: int,
    expected_hf_indices: Iterable[int],
    expected_hidden_size: int,
) -> None:
    """Raise :class:`SampleRejected` with the first problem found, in a fixed order; return if usable."""
    sent = len(sent_ids)
    dumped = int(dump.meta.num_tokens)

    cached = max(int(cached_tokens_reported), int(dump.meta.cached_tokens))
    if cached != 0:
        raise SampleRejected(
            CACHED_TOKENS,
            f"engine reused {cached} cached tokens; dumped {dumped} of {sent} "
            f"(response said {cached_tokens_reported}, meta said {dump.meta.cached_tokens})",
        )

    if dumped != sent:
        raise SampleRejected(TOKEN_COUNT, f"meta says {dumped} tokens, {sent} were sent")
    for name, rows in _row_counts(dump):
        if rows != sent:
            raise SampleRejected(TOKEN_COUNT, f"{name} has {rows} rows, {sent} tokens were sent")

    dumped_ids = dump.input_ids.reshape(-1)
    sent_array = np.asarray(sent_ids, dtype=np.int64)
    differing = np.flatnonzero(dumped_ids.astype(np.int64) != sent_array)
    if differing.size:
        first = int(differing[0])
        raise SampleRejected(
            INPUT_IDS_MISMATCH,
            f"{differing.size} of {sent} token ids differ; first at {first}: "
            f"dumped {int(dumped_ids[first])}, sent {int(sent_array[first])}",
        )

    expected = sorted(set(expected_hf_indices))
    present = sorted(dump.states)
    if present != expected:
        raise SampleRejected(LAYERS_MISMATCH, f"dump has hf indices {present}, expected {expected}")

    for hf_index in expected:
        state = dump.states[hf_index]
        if state.ndim != 2 or state.shape[1] != expected_hidden_size:
            raise SampleRejected(
                HIDDEN_SIZE_MISMATCH,
                f"hidden.{hf_index} has shape {list(state.shape)}, expected [{sent}, {expected_hidden_size}]",
            )

    for hf_index in expected:
        bad = count_non_finite(dump.states[hf_index], dump.dtypes.get(hf_index, "F32"))
        if bad:
            size = dump.states[hf_index].size
            raise SampleRejected(NON_FINITE, f"hidden.{hf_index} has {bad} NaN/Inf values of {size}")


def count_non_finite(state: npt.NDArray[Any], dtype: str) -> int:
    """NaN and Inf values in a state; bf16 words are non-finite when their exponent bits are all ones."""
    if dtype in _BF16_NAMES:
        words = np.asarray(state).view(np.uint16)
        return int(np.count_nonzero((words & _BF16_EXPONENT_MASK) == _BF16_EXPONENT_MASK))
    return int(np.count_nonzero(~np.isfinite(state)))


def _row_counts(dump: Dump) -> list[tuple[str, int]]:
    counts = [("input_ids", int(dump.input_ids.size))]
    for hf_index in sorted(dump.states):
        state = dump.states[hf_index]
        counts.append((f"hidden.{hf_index}", int(state.shape[0]) if state.ndim >= 1 else 1))
    return counts
