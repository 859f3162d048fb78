"""A job's options: the one typed model that the API validates requests into and shows in the job document,
that the job table stores (as its JSON) and that the workers read back. pydantic only, because the API
imports it and must never import torch; a new option is a new field here and nowhere else.

Requests are strict (``"100"`` is not a length, a typo is refused). Stored rows go through
:meth:`JobOptions.from_stored`, which accepts what older versions wrote: a field they did not have, or a
``null`` they stored, takes today's default.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# state_dtype (the engine's dtype, or fp8 storage) and the retention modes are spelled in the SDK, where a
# trainer reads a job document's options without this model.
from hsx.manifest import StateDtype
from hsx.manifest import stores_fp8 as state_dtype_is_fp8
from hsx.streams.contract import CONSUME, Retention

RecordFormat = Literal["auto", "messages", "sharegpt"]
Truncation = Literal["truncate", "reject"]


class RegenerateOptions(BaseModel):
    """Regenerate the assistant turns with the job's own engine before capture (docs/regenerate.md)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    turns: Literal["all", "last"] = Field(
        "all",
        description="Which assistant turns to rewrite: every one, or the last. A turn that calls tools is "
        "kept as it is; a row that ends on a user or tool turn gets its answer generated.",
    )
    max_new_tokens: int = Field(512, ge=1, le=32768, description="The most tokens generated for one turn.")
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="0 is greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(
        None,
        ge=0,
        le=2**31 - 1,
        description="Each turn samples with a seed derived from this, its sample and turn.",
    )
    thinking: bool | None = Field(
        None,
        description="For templates that have it (enable_thinking): on or off. Unset: the template's default.",
    )
    on_length: Literal["keep", "drop"] = Field(
        "keep",
        description="A turn that stopped on max_new_tokens: keep the sample (counted), or reject it as "
        "generation_length.",
    )


class JobOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    format: RecordFormat = "auto"
    chat_template: bool = True
    max_length: int = Field(
        4096,
        ge=8,
        le=131072,
        description="The most tokens a sample may have; at most the engine's context length (422 otherwise).",
    )
    truncation: Truncation = Field(
        "truncate",
        description="A longer sample is cut to max_length and kept (counted, and listed at /truncations), "
        "or rejected as too_long. Either way one whose assistant turns all lie past the cut is too_long.",
    )
    aux_layers: list[int] | None = Field(
        None,
        min_length=1,
        max_length=16,
        description="EAGLE-3 auxiliary layer ids (output of decoder layer L). Default: the engine's, which "
        "is [1, N//2-1, N-4] plus the final post-norm state.",
    )
    # The unit size: one work unit writes one shard. Left out, the deployment's HSX_SAMPLES_PER_SHARD
    # (hsx/server/settings.py, the one place its default lives) is filled in when the job is recorded.
    samples_per_shard: int | None = Field(
        None, ge=1, le=65536, description="Samples per shard (one work unit). Default: HSX_SAMPLES_PER_SHARD."
    )
    cache_namespace_per_request: bool = Field(
        True,
        description="Send each request its own cache namespace (SGLang extra_key) as a second guard. It does "
        "not make a prefix-cached engine acceptable: such an engine is refused whatever this says.",
    )
    state_dtype: StateDtype = Field(
        "engine",
        description="How the shards store the states: the engine's dtype, or fp8 e4m3 with one float32 "
        "scale per token per tensor (half the bytes of bf16; schema 3, error bound in docs/format.md).",
    )
    retention: Retention = Field(
        "keep",
        description="keep: the output stays whole; consume: shards are deleted once a consumer acknowledges "
        "them, and workers wait while buffer_cap_bytes are held (docs/streaming.md).",
    )
    buffer_cap_bytes: int | None = Field(
        None,
        ge=1,
        description="consume: the most bytes committed-but-unacknowledged plus in flight; default "
        "HSX_STREAM_BUFFER_CAP_BYTES, fixed at submission.",
    )

    regenerate: RegenerateOptions | None = Field(
        None, description="Off unless given: rewrite the assistant turns with the target model first."
    )

    @field_validator("aux_layers")
    @classmethod
    def _distinct_non_negative(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and (len(set(value)) != len(value) or min(value) < 0):
            raise ValueError("aux_layers must be distinct non-negative layer ids")
        return value

    @model_validator(mode="after")
    def _regenerate_needs_template(self) -> JobOptions:
        if self.regenerate is not None and not self.chat_template:
            # The generation prompt of each turn is the template's: without one there is nothing to continue.
            raise ValueError("regenerate needs chat_template=true (each turn is continued from the template)")
        return self

    @classmethod
    def from_stored(cls, raw: Mapping[str, Any] | None, samples_per_shard: int | None = None) -> JobOptions:
        """The options of a job row. A missing field or a stored ``null`` takes the default (rows written by
        older versions); a key this version does not know is dropped (an option since removed), while a
        value of the wrong type still fails, as it would on submit. ``samples_per_shard``: the deployment's
        unit size, for a row that holds none."""
        present = {
            key: value for key, value in (raw or {}).items() if value is not None and key in cls.model_fields
        }
        options = cls.model_validate(present)
        return options.with_unit_size(samples_per_shard) if samples_per_shard is not None else options

    def with_unit_size(self, default: int) -> JobOptions:
        """These options with the deployment's unit size filled in where the client gave none."""
        return (
            self
            if self.samples_per_shard is not None
            else self.model_copy(update={"samples_per_shard": default})
        )

    def with_cap(self, default: int) -> JobOptions:
        """These options with the deployment's byte cap (HSX_STREAM_BUFFER_CAP_BYTES) filled in where a
        consume job names none: the one place that default is applied. Submission stores the result, so a
        later change of the setting does not move a running job's cap; a row from before that is filled in
        when read."""
        if self.retention != CONSUME or self.buffer_cap_bytes is not None:
            return self
        return self.model_copy(update={"buffer_cap_bytes": default})

    @property
    def stores_fp8(self) -> bool:
        """Whether the shards hold fp8 e4m3 codes and per-token scales (schema 3) instead of the engine's
        dtype: the one place the option's spelling is read."""
        return state_dtype_is_fp8(self.state_dtype)

    @property
    def unit_size(self) -> int:
        """Samples per unit; only a resolved model (see :meth:`with_unit_size`) has one."""
        if self.samples_per_shard is None:
            raise ValueError(
                "samples_per_shard is not resolved: call with_unit_size(settings.samples_per_shard)"
            )
        return self.samples_per_shard

    def stored(self) -> dict[str, Any]:
        """What the job table keeps (JSON)."""
        return self.model_dump(mode="json")
