"""The regenerated dataset as a JSONL download: one kept conversation a line, in the messages form the API
accepts, with the token ids and loss mask its capture used and the parameters it was generated with.

A line carries ``input_ids`` and ``loss_mask`` beside ``messages``: submitted again (``format: "auto"``),
it is taken as pre-tokenized, so a re-capture (another layer set, another dtype) sees the very ids the
engine returned, bit for bit, rather than a re-tokenization of the text (which a sampled generation need
not round-trip). ``messages`` is the conversation as text, for reading and for other tools.

Standard library only (the API serves it).
"""

from __future__ import annotations

import json
from typing import Any

from hsx.server.regenerate.repository import KeptSample

MEDIA_TYPE = "application/x-ndjson"


def sample_line(sample: KeptSample) -> bytes:
    """One kept sample's JSONL line. ``id`` is the dataset record's own id, or its index there."""
    record: dict[str, Any] = {
        "id": sample.record_id if sample.record_id is not None else sample.sample_index,
        "sample_index": sample.sample_index,
        "messages": sample.messages,
        "input_ids": sample.input_ids,
        "loss_mask": sample.loss_mask,
        "generation": {
            **sample.generation,
            "generated_tokens": sample.generated_tokens,
            "turns_at_length": sample.turns_at_length,
        },
    }
    return json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
