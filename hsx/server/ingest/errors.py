"""What can be wrong with a dataset: the whole file (:class:`DatasetError`) or one sample
(:class:`SampleError`), each named by a stable reason code that rejection rows and job errors store.

Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass

from hsx.errors import ReasonError

# Per-sample rejection reasons; stable strings, stored with each rejected sample.
MALFORMED_JSON = "malformed_json"
WRONG_SHAPE = "wrong_shape"
UNKNOWN_FORMAT = "unknown_format"
UNKNOWN_ROLE = "unknown_role"
NON_STRING_CONTENT = "non_string_content"
UNSUPPORTED_CONTENT_PART = "unsupported_content_part"
INVALID_TOOL_CALL = "invalid_tool_call"
EMPTY_CONVERSATION = "empty_conversation"
NO_ASSISTANT_TURN = "no_assistant_turn"

# File-level reasons raised by DatasetError.
FILE_NOT_FOUND = "not_found"
FILE_EMPTY = "empty_file"
FILE_TOO_LARGE = "too_large"
FILE_NOT_JSON_LINES = "not_json_lines"
FILE_UNRECOGNIZED_FORMAT = "unrecognized_format"
# The prepared records no longer match the byte ranges stored when the job was prepared.
DATASET_CHANGED = "dataset_changed"


@dataclass(frozen=True)
class SampleError:
    """Why one sample cannot be used: a stable ``reason`` code and a human-readable ``detail``."""

    reason: str
    detail: str


class DatasetError(ReasonError):
    """The file as a whole is unusable (raised at submit time, or when an index cannot be built)."""
