"""One record of a unit as the token ids and loss mask capture sends, or the reason it is rejected before
anything is sent: the chat template, the job's length policy, and what the engine says it can take.

A sample longer than the job's ``max_length`` is cut (``truncation: "truncate"``, recorded per sample) or
rejected as ``too_long`` (``"reject"``); one whose assistant tokens all lie past the cut is ``too_long``
too, never ``no_assistant_tokens``. A sample the engine cannot take is rejected before it is sent: longer
than the prompt it says it takes (``too_long``), or with a dump larger than it says it can write
(``dump_too_large``; an engine would answer it and no dump would ever come).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hsx.contract import dump_bytes
from hsx.engine.validation import DUMP_TOO_LARGE, TOO_LONG
from hsx.safetensors_io import DTYPE_SIZES
from hsx.server import telemetry
from hsx.server.ingest import Pretokenized, Record, SampleError
from hsx.server.jobs.unit_results import RejectionRow, TruncationRow
from workers.job_plan import REJECT, JobPlan

if TYPE_CHECKING:
    from workers.chat import ChatEncoder


@dataclass(frozen=True)
class Encoded:
    input_ids: list[int]
    loss_mask: list[int]
    truncation: TruncationRow | None


class SampleEncoder:
    def __init__(self, plan: JobPlan, chat: Callable[[], ChatEncoder]) -> None:
        self.plan = plan
        self._chat_factory = chat
        self._chat: ChatEncoder | None = None  # loaded by the first chat record: pre-tokenized jobs need none
        self._dtype_size = DTYPE_SIZES[plan.state_dtype]
        self._tensor_count = len(plan.tensors)

    def encode(self, index: int, raw: Record, record_id: str | None) -> Encoded | RejectionRow:
        from workers.chat import EncodeError

        if isinstance(raw, SampleError):
            return RejectionRow(index, raw.reason, raw.detail, record_id)
        if isinstance(raw, Pretokenized):
            ids, mask = raw.input_ids, raw.loss_mask
        else:
            if self._chat is None:
                self._chat = self._chat_factory()
            try:
                sample = self._chat.encode(raw)
            except EncodeError as exc:
                return RejectionRow(index, exc.reason, exc.detail, record_id)
            ids, mask = sample.input_ids, sample.loss_mask
        fitted = self._fit_length(index, ids, mask, record_id)
        refusal = None if isinstance(fitted, RejectionRow) else self._engine_refusal(len(fitted.input_ids))
        if refusal is not None:
            return RejectionRow(index, *refusal, record_id)
        return fitted

    def _fit_length(
        self, index: int, ids: list[int], mask: list[int], record_id: str | None
    ) -> Encoded | RejectionRow:
        """The job's truncation policy, applied to chat and pre-tokenized records alike."""
        limit = self.plan.max_length
        if len(ids) <= limit:
            return Encoded(ids, mask, None)
        if self.plan.truncation == REJECT:
            detail = f"{len(ids)} tokens, max_length is {limit} (truncation: reject)"
            return RejectionRow(index, TOO_LONG, detail, record_id)
        if not any(mask[:limit]):
            detail = f"{len(ids)} tokens and no assistant token within the first {limit} (max_length)"
            return RejectionRow(index, TOO_LONG, detail, record_id)
        telemetry.samples_truncated(1)
        return Encoded(ids[:limit], mask[:limit], TruncationRow(index, len(ids), limit, record_id))

    def _engine_refusal(self, tokens: int) -> tuple[str, str] | None:
        """Why the engine cannot take a prompt of ``tokens`` (reason, detail), or None when it can."""
        info = self.plan.info
        if info.max_prompt_tokens and tokens > info.max_prompt_tokens:
            return TOO_LONG, f"{tokens} tokens; the engine takes prompts of at most {info.max_prompt_tokens}"
        if not info.max_prompt_tokens and info.context_length and tokens > info.context_length:
            return TOO_LONG, f"{tokens} tokens exceed the engine's context length {info.context_length}"
        size = dump_bytes(tokens, info.hidden_size, self._tensor_count, self._dtype_size)
        if info.max_dump_bytes and size > info.max_dump_bytes:
            limit = info.max_dump_bytes
            return DUMP_TOO_LARGE, f"its dump is {size:,} bytes; the engine writes dumps of at most {limit:,}"
        return None
