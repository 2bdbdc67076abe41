"""Weight quantisation for int8 / FP8 decoders (mptex.quantize): hand-computed values, the
per-element reference, straight-through gradients, and the QAT layer."""

import numpy as np
import pytest
import torch
from fp8_reference import fake_quantize_reference

from mptex.mlp import QuantizedLinear
from mptex.quantize import fake_quantize, int8_channel_scales, quantize_int8


def test_int8_per_channel_by_hand():
    weight = torch.tensor(
        [[0.5, -1.27, 0.004, 0.015], [0.0, 0.0, 0.0, 0.0], [2.54, 1.0, -1.0, 0.0]]
    )
    q, scales = quantize_int8(weight)
    # Row 0: scale 1.27 / 127 = 0.01 -> 50, -127, 0.4 -> 0, 1.5 -> 2 (a tie, but one that
    # rounding half away from zero sends to 2 as well); row 1: all zero, scale 1; row 2: scale
    # 0.02 -> 127, 50, -50, 0. Each scale is the float32 quotient amax / 127, rounded once.
    f32 = np.float32
    assert scales.tolist() == [float(f32(1.27) / f32(127)), 1.0, float(f32(2.54) / f32(127))]
    assert q.tolist() == [[50, -127, 0, 2], [0, 0, 0, 0], [127, 50, -50, 0]]
    assert q.dtype == torch.int8 and int(q.min()) >= -127  # -128 never used
    assert torch.equal(int8_channel_scales(weight), scales)


def test_int8_rounds_half_to_even():
    # Scale 127 / 127 = 1, so the quotients are the values: three ties. Half to even gives
    # 2, 0, 4; half away from zero would give 3, -1, 4.
    q, scales = quantize_int8(torch.tensor([[127.0, 2.5, -0.5, 3.5]]))
    assert scales.tolist() == [1.0] and q.tolist() == [[127, 2, 0, 4]]


def test_int8_clamps_a_quotient_above_127():
    # float32 subnormals: 2e-42 is 1427 * 2^-149, its scale 1427 / 127 rounds to 11 * 2^-149,
    # and 1427 / 11 = 129.7 rounds to 130, which must become 127 (int8 would wrap it to -126);
    # 1e-42 is 714 * 2^-149, 714 / 11 = 64.9 -> 65.
    q, scales = quantize_int8(torch.tensor([[2e-42, 1e-42]]))
    assert scales.item() == 11 * 2.0**-149 and q.tolist() == [[127, 65]]


def test_int8_fake_quantisation_keeps_a_nan_weight_nan_and_the_rest_as_the_codes_give():
    # A NaN master weight stays NaN in the forward (as the FP8 kinds keep it; the int8 cast of
    # NaN would give some finite code); its row's scale is 1.0 (int8_channel_scales), so the
    # row's other weights are their own values rounded to integers, clamped to +-127.
    w = torch.tensor([[0.25, -1.5, float("nan"), 300.0], [1.0, -2.0, 0.5, 127.0]])
    got = fake_quantize(w, "int8")
    assert torch.isnan(got[0, 2]) and int(torch.isnan(got).sum()) == 1
    # row 0, scale 1: round(0.25) = 0, round(-1.5) = -2 (half to even), 300 -> 127
    assert got[0, [0, 1, 3]].tolist() == [0.0, -2.0, 127.0]
    # row 1, scale 127 / 127 = 1: every value is already its code except 0.5 -> 0 (even)
    assert got[1].tolist() == [1.0, -2.0, 0.0, 127.0]
    # finite weights: the int8 codes times the scales, bit for bit
    gen = torch.Generator().manual_seed(3)
    finite = torch.randn(16, 9, generator=gen) * 10.0 ** (torch.rand(16, 1, generator=gen) * 6 - 3)
    q, scales = quantize_int8(finite)
    assert torch.equal(fake_quantize(finite, "int8"), q.float() * scales[:, None])


def test_int8_row_whose_scale_underflows_gets_scale_one():
    # 63 * 2^-149 / 127 underflows to 0 in float32 (64 * 2^-149 is the smallest amax with a
    # non-zero quotient): such a row is treated as a zero row, scale 1, codes 0 (a scale of 0
    # would make its zeros NaN codes and its other values +-127 over an infinite inverse).
    tiny = 63 * 2.0**-149
    q, scales = quantize_int8(torch.tensor([[tiny, 0.0, -tiny], [64 * 2.0**-149, 0.0, 0.0]]))
    assert scales.tolist() == [1.0, 2.0**-149]
    assert q.tolist() == [[0, 0, 0], [64, 0, 0]]


def test_int8_scale_is_the_correctly_rounded_quotient():
    # An amax whose amax * (1 / 127), two roundings, lands one ulp below amax / 127.
    amax = np.float32(1.740332841873169)
    scales = int8_channel_scales(torch.tensor([[float(amax), 0.5]]))
    assert scales.item() == float(amax / np.float32(127)) == 0.013703408651053905


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_fake_quantize_matches_the_per_element_reference(kind):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(16, 32, generator=gen) * 10.0 ** (torch.rand(16, 1, generator=gen) * 3 - 2)
    got = fake_quantize(weight, kind)
    # Both compute each step in float32; the reference's last product is rounded once as well.
    assert torch.equal(got.double(), fake_quantize_reference(weight, kind))


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_straight_through_gradient(kind):
    weight = torch.randn(4, 8, requires_grad=True)
    x = torch.randn(5, 8)
    cotangent = torch.randn(5, 4)
    (fake_quantize(weight, kind) @ x.T).T.mul(cotangent).sum().backward()
    # d/dW of sum(cotangent * (x W^T)) with the quantiser taken as the identity.
    assert torch.allclose(weight.grad, cotangent.T @ x, rtol=1.3e-6, atol=1e-6)
    assert fake_quantize(weight, "none") is weight
    with pytest.raises(ValueError, match="kind: expected one of"):
        fake_quantize(weight, "int4")


def test_qat_layer_computes_with_the_quantised_weight_and_trains_the_master():
    torch.manual_seed(0)
    layer = QuantizedLinear(8, 3, bias=False, compute_dtype=torch.float32, weight_quant="int8")
    x = torch.randn(10, 8)
    expected = x.double() @ fake_quantize_reference(layer.weight, "int8").T
    out = layer(x)
    # f32 GEMM over 8 terms against float64: 10 u |x||W|.
    bound = 10 * 2.0**-24 * (x.double().abs() @ layer.weight.double().abs().T)
    assert torch.all((out.double() - expected).abs() <= bound)
    out.sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.dtype == torch.float32
    assert layer.quant_statistics() == {}  # collected only when asked
    layer.collect_stats = True
    layer(x)
    stats = layer.quant_statistics()
    assert 0 < float(stats["w_rel_error"]) < 0.5 / 127 * 8**0.5


def _eager_e4m3_values(x, rowwise):
    """The eager ops the fused path replaces: quantize_fp8 with fp8_scale of the amax, or
    quantize_fp8_rowwise, then dequantize_fp8."""
    from mptex.fp8 import E4M3, dequantize_fp8, fp8_scale, quantize_fp8, quantize_fp8_rowwise

    if rowwise:
        q, scale_inv, _, _ = quantize_fp8_rowwise(x, E4M3)
    else:
        amax = x.float().abs().amax()
        q, scale_inv, _, _ = quantize_fp8(x, fp8_scale(amax, E4M3), E4M3, amax)
    return dequantize_fp8(q, scale_inv)


@pytest.mark.parametrize("rowwise", [False, True])
@pytest.mark.parametrize("case", ["wide", "zeros", "tiny", "inf", "nan", "transposed"])
def test_e4m3_values_are_the_eager_ops_bits(rowwise, case):
    # The QAT arms' rounding in one mptex::fp8_quantize (the C kernel here, the twin where it
    # has none) against the eager ops it replaced, bit for bit: wide magnitudes, all zeros,
    # float32 subnormals (the scale overflows: kept at 1), an inf, a NaN, a transposed input.
    from golden_io import bits

    from mptex.quantize import e4m3_values

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(37, 24, generator=gen) * 10.0 ** (torch.rand(37, 1, generator=gen) * 8 - 4)
    if case == "zeros":
        x = torch.zeros(37, 24)
    elif case == "tiny":
        x = x * 1e-42
    elif case in ("inf", "nan"):
        x[3, 5] = float(case)
    elif case == "transposed":
        x = x.t().contiguous().t()
    got = e4m3_values(x, rowwise=rowwise)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert torch.equal(bits(got), bits(_eager_e4m3_values(x, rowwise)))
