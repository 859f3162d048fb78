"""fp8 e4m3 quantization (hsx.fp8): round trips, edge values, and the numpy and torch encoders agreeing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hsx import fp8


def _bf16_words(values: np.ndarray) -> np.ndarray:
    return (
        torch.from_numpy(values.astype(np.float32))
        .to(torch.bfloat16)
        .view(torch.int16)
        .numpy()
        .view(np.uint16)
    )


def _round_trip(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    codes, scales = fp8.quantize_rows(rows.astype(np.float32), "F32")
    return codes, scales, fp8.dequantize(codes, scales)


def test_decode_table_matches_torch() -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    expected = codes.view(torch.float8_e4m3fn).to(torch.float32).numpy()
    assert np.array_equal(fp8.DECODE_TABLE, expected, equal_nan=True)
    assert np.isnan(fp8.DECODE_TABLE[[0x7F, 0xFF]]).all()
    assert fp8.DECODE_TABLE[0x7E] == 448.0
    assert fp8.DECODE_TABLE[0x01] == 2.0**-9  # the smallest subnormal


def test_encoder_matches_torch_cast_on_every_code_midpoint_and_random_values() -> None:
    finite = fp8.DECODE_TABLE[np.isfinite(fp8.DECODE_TABLE)]
    positive = np.sort(finite[finite > 0])
    midpoints = (positive[:-1] + positive[1:]) / 2  # ties: must round to the even code
    rng = np.random.default_rng(0)
    values = np.concatenate(
        [finite, midpoints, -midpoints, rng.standard_normal(200_000).astype(np.float32) * 40]
    ).astype(np.float32)
    values = np.clip(values, -448, 448)
    expected = torch.from_numpy(values).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(fp8.encode_e4m3(values), expected)


def test_round_trip_error_is_within_half_an_e4m3_step() -> None:
    rng = np.random.default_rng(1)
    rows = rng.standard_normal((64, 576)).astype(np.float32) * rng.uniform(1e-3, 1e3, (64, 1)).astype(
        np.float32
    )
    codes, scales, back = _round_trip(rows)
    assert codes.dtype == np.uint8 and codes.shape == rows.shape and scales.shape == (64,)
    # e4m3 keeps 3 mantissa bits: a normal value is off by at most 2**-4 of itself; subnormals by half
    # a step of 2**-9 of the scale.
    bound = np.maximum(np.abs(rows) * 2.0**-4, scales[:, None] * 2.0**-10) * (1 + 1e-6)
    assert (np.abs(back - rows) <= bound).all()
    # The largest magnitude of each row is exactly representable: it maps to 448 * scale.
    peak = np.abs(rows).argmax(axis=1)
    assert np.allclose(np.abs(back[np.arange(64), peak]), np.abs(rows[np.arange(64), peak]), rtol=1e-6)


def test_zeros_equal_values_negatives_and_signed_zero() -> None:
    rows = np.zeros((4, 8), dtype=np.float32)
    rows[1] = 3.25  # every value equal: all map to 448
    rows[2] = -7.0
    rows[3, :4] = -0.0
    rows[3, 4:] = [-1.0, 2.0, -3.5, 0.5]  # scale 3.5 / 448 = 2**-7: all exact
    codes, scales, back = _round_trip(rows)
    assert scales[0] == 1.0 and not codes[0].any() and not back[0].any()
    assert np.array_equal(back[1], rows[1]) and (codes[1] == 0x7E).all()
    assert np.array_equal(back[2], rows[2]) and (codes[2] == 0xFE).all()
    assert np.array_equal(back[3], rows[3])
    assert (fp8.bad_scales(scales)) is None


def test_huge_and_tiny_rows_keep_their_relative_precision() -> None:
    rows = np.array(
        [[3e38, -1e38, 2e37, 0.0], [1e-30, -3e-31, 5e-32, 0.0], [1e-44, 0.0, -1e-45, 0.0]], dtype=np.float32
    )
    codes, scales, back = _round_trip(rows)
    assert np.isfinite(back).all() and np.isfinite(scales).all() and (scales > 0).all()
    assert not fp8.has_nan_code(codes)
    assert np.allclose(back[:2], rows[:2], rtol=2.0**-4, atol=0)
    # A row below 448 * float32's smallest normal has its scale held at that normal: it comes back finite
    # and as small as it was (its precision is lost; no hidden state is that small).
    assert np.abs(back[2]).max() <= np.finfo(np.float32).tiny


def test_subnormal_codes_round_trip() -> None:
    # One row whose peak is 448 (scale 1): the other values fall into e4m3's subnormal range.
    subnormals = np.arange(1, 8, dtype=np.float32) * 2.0**-9
    row = np.concatenate([[448.0], subnormals, -subnormals, [2.0**-10, 3 * 2.0**-10]]).astype(np.float32)
    codes, scales, back = _round_trip(row[None, :])
    assert scales[0] == 1.0
    assert np.array_equal(back[0, :15], row[:15])
    assert back[0, 15] == 0.0  # 2**-10 is a tie between 0 and 2**-9: to even, 0
    assert back[0, 16] == 2.0**-9 * 2  # 1.5 steps: a tie, to even, 2 steps


def test_saturates_at_448_and_never_produces_nan_from_finite_input() -> None:
    values = np.array([448.0, 449.0, 464.0, 1e9, -1e9, np.float32(3.4e38)], dtype=np.float32)
    codes = fp8.encode_e4m3(values)
    assert list(fp8.DECODE_TABLE[codes]) == [448.0, 448.0, 448.0, 448.0, -448.0, 448.0]
    rng = np.random.default_rng(2)
    rows = (rng.standard_normal((256, 128)) * 10.0 ** rng.uniform(-40, 38, (256, 1))).astype(np.float32)
    codes, scales = fp8.quantize_rows(rows, "F32")
    assert not fp8.has_nan_code(codes)
    assert np.isfinite(fp8.dequantize(codes, scales)).all()


def test_bf16_and_f16_input_give_the_codes_of_their_float32_values() -> None:
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((16, 64)).astype(np.float32) * 5
    words = _bf16_words(rows)
    widened = (words.astype(np.uint32) << 16).view(np.float32)
    assert np.array_equal(fp8.quantize_rows(words, "BF16")[0], fp8.quantize_rows(widened, "F32")[0])
    halves = rows.astype(np.float16)
    assert np.array_equal(
        fp8.quantize_rows(halves, "F16")[0], fp8.quantize_rows(halves.astype(np.float32), "F32")[0]
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_torch_encoder_gives_the_same_bytes(dtype: torch.dtype) -> None:
    rng = np.random.default_rng(4)
    rows = torch.from_numpy(rng.standard_normal((32, 96)).astype(np.float32) * 3).to(dtype)
    rows[0] = 0
    rows[1] = -2.5
    before = rows.clone()
    codes, scales = fp8.quantize_rows_torch(rows)
    assert torch.equal(rows, before)  # the worker's dump chunk is not written to
    ref_codes, ref_scales = fp8.quantize_rows(rows.to(torch.float32).numpy(), "F32")
    assert np.array_equal(codes.numpy(), ref_codes)
    assert np.array_equal(scales.numpy(), ref_scales)


def test_bad_scales_are_named() -> None:
    assert fp8.bad_scales(np.array([1.0, np.nan], dtype=np.float32)) == "holds non-finite values"
    assert fp8.bad_scales(np.array([1.0, np.inf], dtype=np.float32)) == "holds non-finite values"
    assert fp8.bad_scales(np.array([1.0, -1.0], dtype=np.float32)) == "holds zero or negative values"
    assert fp8.bad_scales(np.array([0.25], dtype=np.float32)) is None
