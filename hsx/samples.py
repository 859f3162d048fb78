"""A stored sample as the loader reads it (numpy), and the one conversion of it to torch tensors.

Every torch reader of hsx output goes through :func:`to_torch` (``iter_samples(as_torch=True)``, the
exports, the datasets of :mod:`hsx.torch_data`, ``JobStream`` and the SpecForge feeder), so a job's
states come out in one dtype whichever way it is read, chosen by the manifest's dtype alone:

==========  ==========================================  ===========================
manifest    the sample as the loader reads it           tensor
==========  ==========================================  ===========================
BF16        uint16 words (``raw_bf16``)                 ``torch.bfloat16`` (same bits)
F16, F32    float16, float32                            the same dtype
F8_E4M3     float32, dequantized by the loader          ``torch.bfloat16``
F8_E4M3     uint8 codes plus scales (``raw_fp8``)       ``torch.float8_e4m3fn``, float32 scales
==========  ==========================================  ===========================

numpy only at import: the loader imports this module and stays torch-free until a caller asks for torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from hsx.manifest import FP8_DTYPE

if TYPE_CHECKING:
    import torch

# The state fields of a sample, in the order a batch lists them.
STATE_FIELDS = ("hidden_state", "aux_hidden_state", "final_pre_norm")
Item = dict[str, Any]


@dataclass(frozen=True)
class Sample:
    index: int
    input_ids: npt.NDArray[np.int32]  # [T]
    loss_mask: npt.NDArray[np.uint8]  # [T]
    # [T, H] post-norm final state; None when the job captured only the pre-norm one (final_state "pre").
    # float32 (from bf16), or raw uint16 bf16 words on request.
    hidden_state: npt.NDArray[Any] | None
    aux_hidden_state: npt.NDArray[Any]  # [T, len(aux) * H], the aux layers side by side
    final_pre_norm: npt.NDArray[Any] | None = None  # [T, H] when the job captured it
    # raw_fp8 on a schema 3 output: the states above are e4m3 codes (uint8) and these their float32
    # per-token scales (value = fp8.DECODE_TABLE[code] * scale); None otherwise.
    hidden_state_scale: npt.NDArray[np.float32] | None = None  # [T]
    aux_hidden_state_scale: npt.NDArray[np.float32] | None = None  # [T, len(aux)], one per aux layer
    final_pre_norm_scale: npt.NDArray[np.float32] | None = None  # [T]


@dataclass(frozen=True)
class TorchSample:
    index: int
    input_ids: torch.Tensor  # int32
    loss_mask: torch.Tensor  # uint8
    # The shard's dtype (bfloat16 stays bfloat16); fp8 comes dequantized to bfloat16, or with raw_fp8 as
    # torch.float8_e4m3fn with the float32 scales below.
    hidden_state: torch.Tensor | None
    aux_hidden_state: torch.Tensor
    final_pre_norm: torch.Tensor | None = None
    hidden_state_scale: torch.Tensor | None = None
    aux_hidden_state_scale: torch.Tensor | None = None
    final_pre_norm_scale: torch.Tensor | None = None


def bf16_words_to_float32(words: npt.NDArray[np.uint16]) -> npt.NDArray[np.float32]:
    """Exact: a bf16 value is the upper half of the float32 with the same bits."""
    return (words.astype(np.uint32) << np.uint32(16)).view(np.float32)


def _state(values: npt.NDArray[Any], dtype: str) -> torch.Tensor:
    import torch

    if dtype == "BF16":
        if values.dtype != np.uint16:
            raise TypeError(f"a BF16 state read as {values.dtype}: a torch reader reads with raw_bf16")
        # The same bits reinterpreted, no copy; torch's uint16 support is too thin to go through it.
        return torch.from_numpy(values.view(np.int16)).view(torch.bfloat16)
    if dtype == FP8_DTYPE:
        if values.dtype == np.uint8:  # codes, read with raw_fp8: their scales travel beside them
            return torch.from_numpy(values).view(torch.float8_e4m3fn)
        return torch.from_numpy(values).to(torch.bfloat16)
    return torch.from_numpy(values)


def to_torch(sample: Sample, dtype: str) -> TorchSample:
    """The sample as tensors; ``dtype`` is the manifest's (see the table above)."""
    import torch

    def state(values: npt.NDArray[Any] | None) -> torch.Tensor | None:
        return None if values is None else _state(values, dtype)

    def scales(values: npt.NDArray[np.float32] | None) -> torch.Tensor | None:
        return None if values is None else torch.from_numpy(values)

    return TorchSample(
        index=sample.index,
        input_ids=torch.from_numpy(sample.input_ids),
        loss_mask=torch.from_numpy(sample.loss_mask),
        hidden_state=state(sample.hidden_state),
        aux_hidden_state=_state(sample.aux_hidden_state, dtype),
        final_pre_norm=state(sample.final_pre_norm),
        hidden_state_scale=scales(sample.hidden_state_scale),
        aux_hidden_state_scale=scales(sample.aux_hidden_state_scale),
        final_pre_norm_scale=scales(sample.final_pre_norm_scale),
    )


def sample_item(sample: Sample, dtype: str) -> Item:
    """The sample as a training item (what the datasets and ``JobStream`` yield): ``index``,
    ``input_ids`` and ``loss_mask`` as int64, and the states :func:`to_torch` gives that are present."""
    import torch

    tensors = to_torch(sample, dtype)
    item: Item = {
        "index": tensors.index,
        "input_ids": tensors.input_ids.to(torch.int64),
        "loss_mask": tensors.loss_mask.to(torch.int64),
    }
    for name in STATE_FIELDS:
        value = getattr(tensors, name)
        if value is not None:
            item[name] = value
    return item
