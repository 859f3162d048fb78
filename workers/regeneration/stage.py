"""The regenerate stage of a unit (worker side): every sample of the unit regenerated turn by turn, made
durable under the unit's lease, then handed to capture as the token ids that were kept.

For each sample the recorded outcome is looked up first (:mod:`hsx.server.regenerate.repository`): a sample
whose text an earlier attempt kept is never generated again, so a worker that dies between generation and
capture cannot produce a second, different text, and the shard holds the states of the kept one. The rest
are generated on ``concurrency`` threads and written in batches, each batch fenced on the lease; the
capture starts only once every sample of the unit has its row. A sample that cannot be regenerated is kept
as a rejection with its reason (stable across attempts too), and reaches capture as a
:class:`~hsx.server.ingest.SampleError`, which the unit records like any other rejected sample.
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from hsx.engine.client import EngineClient, EngineRejected, EngineTimeout, EngineUnavailable
from hsx.server import telemetry
from hsx.server.db.session import retry_db, session_scope
from hsx.server.faults import crash_point
from hsx.server.ingest import Pretokenized, Record, SampleError
from hsx.server.job_options import RegenerateOptions
from hsx.server.jobs.repository import ClaimedUnit
from hsx.server.regenerate import repository as regen_repo
from hsx.server.regenerate.repository import KeptSample
from workers.regeneration.turns import (
    GENERATION_REJECTED,
    GENERATION_TIMEOUT,
    NEEDS_MESSAGES,
    GeneratedTurn,
    RegenerateError,
    TurnRegenerator,
)
from workers.unit_hooks import UnitRecord
from workers.unit_processor import UnitAborted

if TYPE_CHECKING:
    from hsx.engine.regenerate_contract import GenerationParams

log = logging.getLogger(__name__)

# Kept rows written per fenced transaction: a crash loses at most this many samples' generation.
WRITE_BATCH = 8


class LeaseLost(UnitAborted):
    """The unit's lease went to another attempt while this one was generating: nothing more is written."""


def turn_seed(seed: int | None, sample_index: int, turn: int) -> int | None:
    """A seed of its own for every turn of every sample, derived from the job's: samples do not share one
    random stream, and the same job seed gives every sample the same seeds whichever worker runs it."""
    if seed is None:
        return None
    digest = hashlib.sha256(f"{seed}:{sample_index}:{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def generation_params(
    options: RegenerateOptions, seed: int | None, stop: tuple[int, ...]
) -> GenerationParams:
    """The sampling parameters of one turn's request."""
    from hsx.engine.regenerate_contract import GenerationParams

    return GenerationParams(
        max_new_tokens=options.max_new_tokens,
        temperature=options.temperature,
        top_p=options.top_p,
        seed=seed,
        stop_token_ids=stop,
    )


class RegenerateStage:
    def __init__(
        self,
        db_url: str,
        client: EngineClient,
        regenerator: Callable[[], TurnRegenerator],
        options: RegenerateOptions,
        concurrency: int,
    ) -> None:
        self.db_url = db_url
        self.client = client
        self._regenerator_factory = regenerator
        self._regenerator: TurnRegenerator | None = None
        self.options = options
        self.concurrency = max(1, concurrency)

    def run(
        self, unit: ClaimedUnit, records: Iterable[UnitRecord], should_stop: Callable[[], bool]
    ) -> list[UnitRecord]:
        """The unit's records as capture must take them: kept conversations as their token ids, samples
        that could not be regenerated as rejections. Raises :class:`LeaseLost` when the lease goes."""
        records = list(records)
        kept = retry_db(lambda: self._load(unit, [index for index, _, _ in records]))
        todo = [r for r in records if r[0] not in kept and not isinstance(r[1], SampleError)]
        reused = len(kept)
        if todo:
            self._generate_all(unit, todo, kept, should_stop)
        log.info(
            "unit %s: %d samples regenerated and kept, %d kept by an earlier attempt",
            unit.unit_index,
            len(todo),
            reused,
        )
        crash_point("after_regenerate_durable")
        return [self._as_record(index, record, record_id, kept) for index, record, record_id in records]

    def _load(self, unit: ClaimedUnit, indices: list[int]) -> dict[int, KeptSample]:
        with session_scope(self.db_url) as session:
            return regen_repo.kept_samples(session, unit.job_id, indices)

    def _generate_all(
        self,
        unit: ClaimedUnit,
        todo: list[UnitRecord],
        kept: dict[int, KeptSample],
        should_stop: Callable[[], bool],
    ) -> None:
        if self._regenerator is None:
            self._regenerator = self._regenerator_factory()
        regenerator = self._regenerator
        batch: list[KeptSample] = []
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="generate") as pool:
            futures: list[Future[KeptSample]] = [
                pool.submit(self._one, regenerator, unit, index, record, record_id)
                for index, record, record_id in todo
            ]
            try:
                for future in futures:
                    if should_stop():
                        raise LeaseLost("lease lost or job stopped while generating")
                    batch.append(future.result())
                    if len(batch) >= WRITE_BATCH:
                        self._write(unit, batch, kept)
                        batch = []
                self._write(unit, batch, kept)
            except BaseException:
                for future in futures:
                    future.cancel()
                raise

    def _write(self, unit: ClaimedUnit, batch: list[KeptSample], kept: dict[int, KeptSample]) -> None:
        if not batch:
            return

        def write() -> bool:
            with session_scope(self.db_url) as session:
                return regen_repo.keep_samples(session, unit, time.time(), batch)

        if not retry_db(write):
            raise LeaseLost("the unit's lease was lost before its generations were kept")
        kept.update((s.sample_index, s) for s in batch)

    def _one(
        self,
        regenerator: TurnRegenerator,
        unit: ClaimedUnit,
        index: int,
        record: Record,
        record_id: str | None,
    ) -> KeptSample:
        if isinstance(record, Pretokenized):
            detail = "a pre-tokenized record has no turns to regenerate; send it in messages form"
            return KeptSample(index, record_id, NEEDS_MESSAGES, detail)
        assert not isinstance(record, SampleError)
        from hsx.engine.regenerate_contract import generation_rid

        seeds: list[int | None] = []

        def generate(prompt: list[int], turn: int) -> GeneratedTurn:
            seed = turn_seed(self.options.seed, index, turn)
            seeds.append(seed)
            unique = uuid.uuid4().hex[:8]
            key = f"{unit.job_id[:8]}-u{unit.unit_index}a{unit.attempt}-s{index}-g{turn}-{unique}"
            rid = generation_rid(key)
            params = generation_params(self.options, seed, regenerator.stop_token_ids)
            return self._generate(prompt, params, rid)

        generation: dict[str, Any] = {
            "max_new_tokens": self.options.max_new_tokens,
            "temperature": self.options.temperature,
            "top_p": self.options.top_p,
            "turns": self.options.turns,
            "thinking": self.options.thinking,
            "seeds": seeds,
        }
        try:
            done = regenerator.regenerate(record, generate)
        except RegenerateError as exc:
            return KeptSample(index, record_id, exc.reason, exc.detail, generation=generation)
        telemetry.tokens_generated(done.generated_tokens)
        generation["finish_reasons"] = done.finish_reasons
        return KeptSample(
            index,
            record_id,
            messages=done.messages,
            input_ids=done.input_ids,
            loss_mask=done.loss_mask,
            generated_tokens=done.generated_tokens,
            turns_generated=len(done.finish_reasons),
            turns_at_length=done.turns_at_length,
            generation=generation,
        )

    def _generate(self, prompt: list[int], params: GenerationParams, rid: str) -> GeneratedTurn:
        """One turn's generation; an engine refusal or a stuck request is this sample's rejection, an
        engine that no longer answers is the unit's (it goes back for healthy workers)."""
        try:
            generation = self.client.generate(prompt, params, rid)
        except EngineRejected as exc:
            telemetry.engine_error("rejected")
            raise RegenerateError(GENERATION_REJECTED, str(exc)[:500]) from exc
        except EngineTimeout as exc:
            telemetry.engine_error("timeout")
            if not self.client.alive():
                raise EngineUnavailable(f"{exc}; the engine no longer answers") from exc
            raise RegenerateError(GENERATION_TIMEOUT, str(exc)[:500]) from exc
        return GeneratedTurn(list(generation.output_ids), generation.finish_reason)

    @staticmethod
    def _as_record(
        index: int, record: Record, record_id: str | None, kept: dict[int, KeptSample]
    ) -> UnitRecord:
        outcome = kept.get(index)
        if isinstance(record, SampleError) or outcome is None:
            return index, record, record_id
        if outcome.reason is not None or outcome.input_ids is None or outcome.loss_mask is None:
            return index, SampleError(outcome.reason or "regenerate_failed", outcome.detail), record_id
        return index, Pretokenized(input_ids=outcome.input_ids, loss_mask=outcome.loss_mask), record_id
