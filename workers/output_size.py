"""How many bytes a job's shards will take, projected once its records are known (at prepare).

Every kept token costs one row per captured tensor (hidden size x dtype size each), 4 bytes of token id
and 1 byte of loss mask; every sample and shard adds its index entries and the header room the shard
writer reserves (per record of the unit, whether kept or not). Pre-tokenized records
give their token counts exactly. Chat records are counted from a sample: up to ``sample_size`` records
drawn evenly over the file are encoded with the job's tokenizer and template, and their tokens per byte of
JSON scale to every chat record's bytes; the projection then says it is an estimate, and on what basis.
The job's truncation policy applies to both (a cut sample counts ``max_length`` tokens, a rejected one
none). Samples rejected for other reasons are not foreseen, so the projection errs on the large side.
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hsx.contract import EngineInfo, canonical_state_dtype
from hsx.safetensors_io import DTYPE_SIZES
from hsx.server.ingest import Pretokenized, parse_record
from workers.job_plan import REJECT, dump_tensors

if TYPE_CHECKING:
    from workers.chat import ChatEncoder

# Header room the shard writer reserves per tensor of each record of its unit, and per shard (with the
# 8-byte length, the header's alignment and the extra sample offset).
HEADER_BYTES_PER_TENSOR = 160
SHARD_OVERHEAD_BYTES = 8 + 1024 + 8 + 8
# sample_offsets and sample_index: one I64 each per kept sample.
INDEX_BYTES_PER_SAMPLE = 16
# With no tokenizer to count with: a rough tokens-per-byte of JSON chat records.
FALLBACK_TOKENS_PER_BYTE = 0.25


@dataclass(frozen=True)
class Projection:
    bytes: int
    tokens: int
    samples: int
    exact: bool
    basis: str  # how the tokens were counted, in words
    free_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def bytes_per_token(info: EngineInfo, store_fp8: bool = False) -> int:
    """Shard bytes per token: the states (fp8: 1 byte a value plus a 4-byte scale per tensor), id and mask."""
    tensors = len(dump_tensors(info))
    if store_fp8:
        return (info.hidden_size + 4) * tensors + 4 + 1
    dtype = canonical_state_dtype(info.dtype)
    return info.hidden_size * DTYPE_SIZES[dtype] * tensors + 4 + 1


class OutputProjector:
    """Fed every record line during the planning pass (:func:`hsx.server.ingest.plan_units`' ``observe``)."""

    def __init__(
        self,
        info: EngineInfo,
        max_length: int | None,
        truncation: str,
        encoder: Callable[[], ChatEncoder],
        sample_size: int = 64,
        seed: int = 20240601,
        store_fp8: bool = False,
    ) -> None:
        self.info = info
        self.store_fp8 = store_fp8
        self.max_length = max_length
        self.truncation = truncation
        self._encoder = encoder
        self.sample_size = max(1, sample_size)
        self._rng = random.Random(seed)
        self.records = 0
        self.exact_tokens = 0
        self.exact_samples = 0
        self.chat_records = 0
        self.chat_bytes = 0
        self._sampled: list[bytes] = []

    def observe(self, line: bytes) -> None:
        self.records += 1
        if b'"input_ids"' in line:
            record = parse_record(line)
            if isinstance(record, Pretokenized):
                kept = self._kept(len(record.input_ids))
                self.exact_tokens += kept
                self.exact_samples += kept > 0
                return
        self.chat_records += 1
        self.chat_bytes += len(line)
        # Reservoir sampling: every chat record is equally likely to be among those encoded.
        if len(self._sampled) < self.sample_size:
            self._sampled.append(line)
        else:
            slot = self._rng.randrange(self.chat_records)
            if slot < self.sample_size:
                self._sampled[slot] = line

    def _kept(self, tokens: int) -> int:
        if self.max_length is None or tokens <= self.max_length:
            return tokens
        return 0 if self.truncation == REJECT else self.max_length

    def finish(self, shards: int) -> Projection:
        chat_tokens, basis = self._chat_tokens()
        tokens = self.exact_tokens + chat_tokens
        samples = self.exact_samples + self.chat_records
        header = (
            HEADER_BYTES_PER_TENSOR
            * len(dump_tensors(self.info))
            * self.records
            * (2 if self.store_fp8 else 1)
        )
        total = (
            tokens * bytes_per_token(self.info, self.store_fp8)
            + samples * INDEX_BYTES_PER_SAMPLE
            + header
            + shards * SHARD_OVERHEAD_BYTES
        )
        exact = self.chat_records == 0
        if exact:
            basis = f"exact: {self.exact_samples} pre-tokenized records, {tokens} tokens"
        elif self.exact_samples:
            basis = f"{self.exact_samples} pre-tokenized records counted exactly; {basis}"
        return Projection(bytes=int(total), tokens=int(tokens), samples=samples, exact=exact, basis=basis)

    def _chat_tokens(self) -> tuple[int, str]:
        if not self.chat_records:
            return 0, ""
        from workers.chat import EncodeError

        try:
            encoder = self._encoder()
        except Exception as exc:  # noqa: BLE001 - no tokenizer: a rough estimate still beats none
            tokens = int(self.chat_bytes * FALLBACK_TOKENS_PER_BYTE)
            return (
                tokens,
                f"estimate: {self.chat_records} chat records, no tokenizer ({exc}), 1 token per 4 bytes",
            )
        sampled_tokens = sampled_bytes = 0
        for line in self._sampled:
            sampled_bytes += len(line)
            record = parse_record(line)
            if not isinstance(record, list):
                continue
            try:
                sampled_tokens += self._kept(len(encoder.encode(record).input_ids))
            except EncodeError:
                continue
        ratio = sampled_tokens / sampled_bytes if sampled_bytes else 0.0
        tokens = int(round(ratio * self.chat_bytes))
        return tokens, (
            f"estimate: {len(self._sampled)} of {self.chat_records} chat records encoded "
            f"({ratio:.3f} tokens per byte of {self.chat_bytes} bytes)"
        )


def free_bytes(directory: str | Path) -> int:
    """Free bytes on the filesystem that holds (or will hold) ``directory``."""
    path = Path(directory).resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free
