"""Checks that a dump holds exactly the sample that was sent, before it may become training data.

The first check is the one that matters most: an engine that reused a cached prefix computed (and dumped)
only the tail of the prompt, so a dump with ``cached_tokens != 0`` is never usable, whatever else it holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from hsx.contract import DumpMeta, tensor_name
from hsx.engine_client import Dump
from hsx.errors import ReasonError

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
        "dtype_mismatch",
    }
)

_BF16_EXPONENT_MASK: Final = 0x7F80  # all ones: Inf or NaN
_BF16_NAMES: Final = ("BF16", "bfloat16", "bf16")


class SampleRejected(ReasonError):
    """A capture that must not become training data; ``reason`` is stored with the rejected sample."""


def validate_dump(
    dump: Dump,
    sent_ids: Sequence[int],
    cached_tokens_reported: int,
    expected_hf_indices: Iterable[int],
    expected_hidden_size: int,
) -> None:
    """Raise :class:`SampleRejected` with the first problem found, in a fixed order; return if usable."""
    expected = [tensor_name(i) for i in sorted(set(expected_hf_indices))]
    present = {tensor_name(i): state for i, state in dump.states.items()}
    shapes = {name: tuple(state.shape) for name, state in present.items()}
    check_dump(
        dump.meta, dump.input_ids, shapes, sent_ids, cached_tokens_reported, expected, expected_hidden_size
    )
    for hf_index in sorted(dump.states):
        bad = count_non_finite(dump.states[hf_index], dump.dtypes.get(hf_index, "F32"))
        if bad:
            size = dump.states[hf_index].size
            raise SampleRejected(NON_FINITE, f"hidden.{hf_index} has {bad} NaN/Inf values of {size}")


def check_dump(
    meta: DumpMeta,
    dumped_ids: npt.NDArray[Any],
    state_shapes: Mapping[str, tuple[int, ...]],
    sent_ids: Sequence[int] | npt.NDArray[Any],
    cached_tokens_reported: int,
    expected_tensors: Sequence[str],
    expected_hidden_size: int,
) -> None:
    """Everything but the values: cache reuse, counts, ids, layers, shapes, and the engine's own count of
    non-finite values where it made one. Raises :class:`SampleRejected` with the first problem found."""
    sent = len(sent_ids)
    dumped = int(meta.num_tokens)

    cached = max(int(cached_tokens_reported), int(meta.cached_tokens))
    if cached != 0:
        raise SampleRejected(
            CACHED_TOKENS,
            f"engine reused {cached} cached tokens; dumped {dumped} of {sent} "
            f"(response said {cached_tokens_reported}, meta said {meta.cached_tokens})",
        )

    if dumped != sent:
        raise SampleRejected(TOKEN_COUNT, f"meta says {dumped} tokens, {sent} were sent")
    rows = [("input_ids", int(dumped_ids.size))]
    rows += [(name, shape[0] if shape else 1) for name, shape in sorted(state_shapes.items())]
    for name, count in rows:
        if count != sent:
            raise SampleRejected(TOKEN_COUNT, f"{name} has {count} rows, {sent} tokens were sent")

    dumped_flat = dumped_ids.reshape(-1).astype(np.int64)
    sent_array = np.asarray(sent_ids, dtype=np.int64)
    differing = np.flatnonzero(dumped_flat != sent_array)
    if differing.size:
        first = int(differing[0])
        raise SampleRejected(
            INPUT_IDS_MISMATCH,
            f"{differing.size} of {sent} token ids differ; first at {first}: "
            f"dumped {int(dumped_flat[first])}, sent {int(sent_array[first])}",
        )

    if sorted(state_shapes) != sorted(expected_tensors):
        raise SampleRejected(
            LAYERS_MISMATCH, f"dump has {sorted(state_shapes)}, expected {sorted(expected_tensors)}"
        )

    for name in expected_tensors:
        shape = state_shapes[name]
        if len(shape) != 2 or shape[1] != expected_hidden_size:
            raise SampleRejected(
                HIDDEN_SIZE_MISMATCH,
                f"{name} has shape {list(shape)}, expected [{sent}, {expected_hidden_size}]",
            )

    for name, count in sorted((meta.non_finite or {}).items()):
        if count:
            raise SampleRejected(NON_FINITE, f"{name} has {count} NaN/Inf values (counted by the engine)")


def count_non_finite(state: npt.NDArray[Any], dtype: str) -> int:
    """NaN and Inf values in a state; bf16 words are non-finite when their exponent bits are all ones."""
    if dtype in _BF16_NAMES:
        words = np.asarray(state).view(np.uint16)
        return int(np.count_nonzero((words & _BF16_EXPONENT_MASK) == _BF16_EXPONENT_MASK))
    return int(np.count_nonzero(~np.isfinite(state)))
