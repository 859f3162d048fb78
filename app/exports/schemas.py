"""Request and response shapes of the exports API."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

ExportFormat = Literal["specforge", "speculators", "modelopt"]
ExportStateName = Literal["queued", "running", "succeeded", "failed"]
MAX_VOCAB = 16_777_216


class ExportCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: ExportFormat
    draft_vocab_size: int | None = Field(
        None, ge=1, le=MAX_VOCAB, description="specforge: also write vocab_mapping/vocab_mapping.pt"
    )
    target_vocab_size: int | None = Field(
        None, ge=1, le=MAX_VOCAB, description="default: vocab_size in the target model's config.json"
    )
    vocab_max_length: int | None = Field(
        None, ge=1, le=1_048_576, description="count only each sample's first tokens (the trainer's max_len)"
    )
    group_size: int = Field(2000, ge=1, le=1_000_000, description="specforge: files per rows_* folder")


class ExportError(BaseModel):
    error: str
    detail: str


class ExportOut(BaseModel):
    # Read from the exports table's row (hsx.server.db.export_models.Export), field for field.
    model_config = ConfigDict(from_attributes=True)

    id: str
    job_id: str
    format: ExportFormat
    state: ExportStateName
    options: dict[str, Any]
    dest: str = Field(description="the export folder; it exists only once the export has succeeded")
    created_at: datetime
    updated_at: datetime
    attempts: int
    error: ExportError | None
    report: dict[str, Any] | None = Field(description="hsx_export.json of a finished export")


class ExportPage(BaseModel):
    items: list[ExportOut]
    total: int
