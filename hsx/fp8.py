"""fp8 (e4m3fn) hidden states: one float32 scale per token, per stored tensor (format: docs/format.md).

A token's row ``x`` [H] is stored as codes ``q`` (one byte each) and a scale ``s`` with
``s = max|x| / 448`` (448 is e4m3fn's largest finite value), ``q = e4m3(x / s)`` rounded to nearest, ties
to even, and read back as ``decode(q) * s``. Each aux layer and the final state get their own scale: the
final state's magnitude is often far from the aux layers', and a scale shared across them (speculators'
choice) spends the small tensors' precision on the large one (``docs/format.md`` has the numbers).

numpy only, so ``hsx.loader`` stays torch-free: decoding is a 256-entry table, exact; encoding works on
float32 bits. :func:`quantize_rows_torch` gives the same codes through torch's own cast, about 20x faster
on CPU, so the worker (which has torch) encodes with it; tests hold the two to the same bytes.

A row of zeros gets scale 1 and zero codes. Finite input never produces the NaN codes (0x7F, 0xFF): values
are clipped to +-448 before rounding, so a scale that rounds down in float32 cannot push one past it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from hsx.samples import bf16_words_to_float32

if TYPE_CHECKING:
    import torch

FP8_DTYPE = "F8_E4M3"  # the safetensors name of the codes
SCALE_DTYPE = "F32"
E4M3_MAX = 448.0
NAN_CODES = (0x7F, 0xFF)
# The documented bound of a dequantized token against the engine's own (docs/format.md; hsx verify checks
# it). Proven, not fitted: each normal value is within 2**-4 of itself and each subnormal within
# scale * 2**-10, so the relative L2 error is at most 2**-4 + sqrt(H) / 458752 (under 0.0627 for any H up
# to 16384), and the cosine at least sqrt(1 - 0.07**2). Measured errors are far smaller (docs/format.md).
DOCUMENTED_MAX_REL_L2 = 0.07
DOCUMENTED_MIN_COSINE = 0.9975
# Below 2**-6 e4m3 is subnormal: multiples of 2**-9.
_MIN_NORMAL = np.float32(2.0**-6)
_SUBNORMAL_STEP = np.float32(2.0**9)
# A float32 whose bits, shifted right by 20, give sign|exponent|3 mantissa bits; e4m3's exponent bias is 7,
# float32's 127, so subtracting (127 - 7) << 3 from those bits gives the e4m3 code of a normal value.
_BIAS_SHIFT = np.uint32((127 - 7) << 3)


def _decode_table() -> npt.NDArray[np.float32]:
    codes = np.arange(256, dtype=np.uint32)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent = (codes >> 3) & 0xF
    mantissa = (codes & 0x7).astype(np.float64)
    normal = (1.0 + mantissa / 8.0) * np.exp2(exponent.astype(np.float64) - 7.0)
    subnormal = (mantissa / 8.0) * 2.0**-6
    values = sign * np.where(exponent == 0, subnormal, normal)
    values[[0x7F, 0xFF]] = np.nan
    return values.astype(np.float32)


DECODE_TABLE = _decode_table()  # code -> float32, exact


def _to_float32(rows: npt.NDArray[Any], source_dtype: str) -> npt.NDArray[np.float32]:
    """``rows`` as float32: BF16 given as its uint16 words (widened exactly), F16 or F32 as themselves."""
    if source_dtype == "BF16":
        return bf16_words_to_float32(rows)
    return rows.astype(np.float32, copy=False)


def row_scales(values: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """One scale per row of ``values`` [..., H]: ``max|x| / 448``, 1 for an all-zero row. A row so small
    that its scale would underflow float32 gets the smallest normal float32 (its codes are then small)."""
    amax = np.abs(values).max(axis=-1).astype(np.float64)
    scales = (amax / E4M3_MAX).astype(np.float32)
    tiny = np.finfo(np.float32).tiny
    scales = np.where(amax == 0, np.float32(1.0), np.maximum(scales, tiny))
    return scales.astype(np.float32)


def encode_e4m3(y: npt.NDArray[np.float32]) -> npt.NDArray[np.uint8]:
    """float32 values (finite) to e4m3fn codes, round to nearest even, saturating at +-448."""
    y = np.clip(y, -E4M3_MAX, E4M3_MAX)
    magnitude = np.abs(y)
    bits = magnitude.view(np.uint32)
    # Normal range: round the float32 mantissa to 3 bits (ties to even) by adding just under half an ulp
    # of the kept bits plus the lowest kept bit; a carry moves into the exponent, as it should.
    rounded = (bits + np.uint32(0x7FFFF) + ((bits >> np.uint32(20)) & np.uint32(1))) >> np.uint32(20)
    normal = rounded.astype(np.int64) - np.int64(_BIAS_SHIFT)
    # Subnormal range: multiples of 2**-9; np.rint rounds ties to even. 8 (= 2**-6) is the first normal.
    subnormal = np.rint(magnitude * _SUBNORMAL_STEP).astype(np.int64)
    codes = np.where(magnitude < _MIN_NORMAL, subnormal, normal).astype(np.uint8)
    return codes | np.where(np.signbit(y), np.uint8(0x80), np.uint8(0))


def quantize_rows(
    rows: npt.NDArray[Any], source_dtype: str = "F32"
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.float32]]:
    """Rows [T, H] (``source_dtype`` BF16 as uint16 words, F16, F32) to codes [T, H] and scales [T]."""
    values = _to_float32(rows, source_dtype)
    scales = row_scales(values)
    return encode_e4m3(values / scales[:, None]), scales


def dequantize(codes: npt.NDArray[np.uint8], scales: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """Codes [T, H] and per-row scales [T] back to float32 [T, H]."""
    result: npt.NDArray[np.float32] = DECODE_TABLE[codes]
    result *= scales.astype(np.float32, copy=False)[:, None]
    return result


def bad_scales(scales: npt.NDArray[np.float32]) -> str | None:
    """Why a stored scale tensor cannot be right (non-finite, zero or negative), or None."""
    if not bool(np.isfinite(scales).all()):
        return "holds non-finite values"
    if bool((scales <= 0).any()):
        return "holds zero or negative values"
    return None


def has_nan_code(codes: npt.NDArray[np.uint8]) -> bool:
    """Whether any code is e4m3fn's NaN (the format has no infinities)."""
    return bool(((codes & np.uint8(0x7F)) == np.uint8(0x7F)).any())


def quantize_rows_torch(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same encoding through torch's float8_e4m3fn cast (any float dtype in; uint8 codes out)."""
    import torch

    # The peak of each row in the input's own dtype (exact: max of |x| needs no rounding), then one float32
    # copy that is divided and clamped in place: three passes over the chunk besides the cast.
    amax = rows.abs().amax(dim=-1).to(torch.float32)
    tiny = float(np.finfo(np.float32).tiny)
    scales = torch.where(amax == 0, torch.ones_like(amax), (amax / E4M3_MAX).clamp_min(tiny))
    scaled = rows.to(torch.float32, copy=True).div_(scales[:, None]).clamp_(-E4M3_MAX, E4M3_MAX)
    return scaled.to(torch.float8_e4m3fn).view(torch.uint8), scales
