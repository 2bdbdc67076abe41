"""Edge cases of the fused-MLP twin (mptex._fused_mlp_torch) and of the FP8 quantisation op
(mptex._fp8_fused), each against an independent reference.

FP8 op: hand-computed scales and codes (``scale = fp8_max / amax / 2**margin``, E4M3 max 448,
E5M2 max 57344, the fallback to 1 where amax is 0 or NaN and to 0 where it is inf), the
documented layouts (``q_pad`` gives a row-major ``q``, its added columns zero), the dispatch
(the op on inputs its C kernel does not take, the op without its kernel, ``op_available``),
and that an op's outputs are never its inputs.

Fused-MLP twin: ``accumulate="float"`` matrix products against a per-element float64 loop
(exact block sums, each added and rounded to float32, the finished sum rounded to half), the
precision statistics against hand counts, in the C kernel and in eager PyTorch.
"""

from __future__ import annotations

import pytest
import torch

import mptex._fused_mlp_torch as twin
from mptex import _fp8_fused
from mptex._fp8_fused import fp8_quantize, fp8_quantize_reference, op_available
from mptex._native_cpu import native_kernels
from mptex.fp8 import E4M3, E5M2

needs_kernel = pytest.mark.skipif(
    native_kernels() is None, reason="no C compiler: the op runs its eager twin"
)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t`` as integers (NaNs compare equal, -0.0 differs from +0.0)."""
    kinds = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(kinds[t.element_size()])


def _same(a, b) -> None:
    for index, (u, v) in enumerate(zip(a, b, strict=True)):
        assert u.dtype == v.dtype and u.shape == v.shape, (index, u.dtype, v.dtype)
        assert torch.equal(_bits(u), _bits(v)), index


QUANTIZERS = [fp8_quantize, fp8_quantize_reference, torch.ops.mptex.fp8_quantize]


# ----------------------------------------------------------------------------- FP8 values
@pytest.mark.parametrize("quantize", QUANTIZERS)
def test_current_recipe_codes_and_scales_by_hand(quantize):
    x = torch.tensor([1.0, -2.0, 0.5, 0.0])
    history = torch.zeros(3)
    # E4M3, margin 0: amax 2, scale 448 / 2 = 224; codes 224, -448, 112, 0 (224 = 1.75 * 2^7,
    # 112 = 1.75 * 2^6: representable with E4M3's 3 mantissa bits)
    out = quantize(x, torch.tensor(1.0), history, 0, 1, 0, False, False, E4M3)
    assert out[0].float().tolist() == [224.0, -448.0, 112.0, 0.0]
    assert out[2].item() == 2.0 and out[3].item() == 224.0 and out[4].item() == 224.0
    assert out[1].item() == torch.tensor(1.0 / 224.0, dtype=torch.float32).item()
    # margin 1: scale 448 / 2 / 2 = 112, codes 112, -224, 56, 0
    out = quantize(x, torch.tensor(1.0), history, 0, 1, 1, False, False, torch.float32)
    assert out[0].tolist() == [112.0, -224.0, 56.0, 0.0] and out[3].item() == 112.0
    # E5M2: scale 57344 / 2 = 28672 = 1.75 * 2^14 (2 mantissa bits suffice); codes
    # 28672, -57344, 14336, 0
    for q_dtype in (E5M2, torch.float64):
        out = quantize(x, torch.tensor(1.0), history, 1, 1, 0, False, False, q_dtype)
        assert out[0].dtype == q_dtype and out[3].item() == 28672.0
        assert out[0].double().tolist() == [28672.0, -57344.0, 14336.0, 0.0]


@pytest.mark.parametrize("quantize", QUANTIZERS)
def test_current_recipe_falls_back_where_amax_is_zero_nan_or_inf(quantize):
    history = torch.zeros(2)
    zeros = torch.zeros(5)
    out = quantize(zeros, torch.tensor(3.0), history, 0, 1, 0, False, False, torch.float32)
    # amax 0: 448 / 0 is not finite, scale 1 kept; q all zero
    assert out[2].item() == 0.0 and out[3].item() == 1.0 and out[1].item() == 1.0
    assert out[0].tolist() == [0.0] * 5
    nan = torch.tensor([1.0, float("nan"), 2.0])
    out = quantize(nan, torch.tensor(3.0), history, 0, 1, 0, False, False, torch.float32)
    # amax NaN: scale 1; the NaN stays NaN, the others are cast with scale 1
    assert out[2].isnan().item() and out[3].item() == 1.0
    assert out[0][0].item() == 1.0 and out[0][1].isnan().item() and out[0][2].item() == 2.0
    inf = torch.tensor([1.0, float("inf")])
    out = quantize(inf, torch.tensor(3.0), history, 0, 1, 0, False, False, torch.float32)
    # amax inf: 448 / inf = 0 is used; 1 * 0 = 0, inf * 0 = NaN; scale_inv = 1 / 0 = inf
    assert out[2].item() == float("inf") and out[3].item() == 0.0
    assert out[1].item() == float("inf")
    assert out[0][0].item() == 0.0 and out[0][1].isnan().item()


@pytest.mark.parametrize("quantize", QUANTIZERS)
def test_delayed_recipe_without_record_returns_its_scale_even_when_it_falls_back(quantize):
    """The delayed recipe's next scale is the given one when it does not record, even where
    the call itself used the overflow fallback ``fp8_max / amax``."""
    x = torch.tensor([4.0, -1.0])
    scale = torch.tensor(256.0)
    # 4 * 256 = 1024 > 448: used = 448 / 4 = 112, codes 448, -112
    out = quantize(x, scale, torch.zeros(2), 0, 0, 0, False, False, torch.float32)
    assert out[3].item() == 112.0 and out[0].tolist() == [448.0, -112.0]
    assert out[4].item() == 256.0 and out[5].shape == (0,)


@pytest.mark.parametrize("quantize", QUANTIZERS)
def test_rowwise_zero_row_keeps_scale_one_and_statistics(quantize):
    x = torch.tensor([[0.0, 0.0, 0.0], [1.0, -4.0, 2.0]])
    out = quantize(x, torch.tensor(1.0), torch.zeros(2), 0, 2, 0, False, True, torch.float32)
    # row 0: amax 0, scale 1, codes 0; row 1: amax 4, scale 448 / 4 = 112, codes 112, -448, 224
    assert out[0].tolist() == [[0.0, 0.0, 0.0], [112.0, -448.0, 224.0]]
    assert out[2].tolist() == [[0.0], [4.0]] and out[3].tolist() == [[1.0], [112.0]]
    assert out[4].tolist() == [[1.0], [112.0]]
    # statistics: the largest row amax 4, the smallest scale used 1
    assert out[5].tolist() == [4.0, 1.0]


# ----------------------------------------------------------------------------- layouts
@pytest.mark.parametrize("quantize", QUANTIZERS)
@pytest.mark.parametrize("recipe", [0, 1, 2])
def test_q_pad_one_gives_row_major_q_for_a_transposed_input(quantize, recipe):
    """``q_pad`` makes q row-major (1: no added column), whatever the strides of x."""
    x = (torch.arange(12.0) - 5.0).reshape(4, 3).t()  # [3, 4], column-major
    args = (x, torch.tensor(1.0), torch.zeros(2), 0, recipe, 0, False, False, torch.float32)
    plain = fp8_quantize_reference(x.contiguous(), *args[1:])
    out = quantize(*args, 1)
    assert out[0].shape == (3, 4) and out[0].is_contiguous()
    assert torch.equal(out[0], plain[0])


@needs_kernel
def test_rowwise_pad_of_one_column_is_zero():
    """Rows of 15 values padded to 16 (one added column): that column is +0 every time, also
    where the output's memory held other values before."""
    x = torch.linspace(-3.0, 5.0, 4 * 15).reshape(4, 15)
    for _ in range(20):
        junk = torch.full((4, 16), float("nan"))  # freed memory the next output may reuse
        del junk
        out = torch.ops.mptex.fp8_quantize(
            x, torch.tensor(1.0), torch.zeros(2), 0, 2, 0, False, False, torch.float32, 16
        )
        assert out[0].shape == (4, 16)
        assert torch.equal(_bits(out[0][:, 15]), torch.zeros(4, dtype=torch.int32))


# ----------------------------------------------------------------------------- dispatch
def _x_transposed() -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    return (torch.randn(9, 7, generator=gen) * 30).t()


@needs_kernel
@pytest.mark.parametrize("recipe", [0, 1, 2])
@pytest.mark.parametrize("make", ["float64", "transposed", "column_slice"])
def test_the_op_called_directly_takes_any_dtype_and_strides(recipe, make):
    """The registered op itself (not only the dispatching wrapper) gives its twin's values for
    float64 inputs and strided inputs (a transpose, a slice of columns), which its C kernel
    does not read per tensor."""
    x = _x_transposed()
    if make == "float64":
        x = x.double().contiguous()
    elif make == "column_slice":  # every other column of a row-major matrix: not dense
        x = x.contiguous()[:, ::2]
    for record in (False, True):
        args = (x, torch.tensor(2.0), torch.tensor([5.0, 1.0]), 0, recipe, 0, False, record, E4M3)
        _same(torch.ops.mptex.fp8_quantize(*args), fp8_quantize_reference(*args))


def test_float64_input_is_quantised_from_its_float32_value():
    """x is converted to float32 first, and x * scale is rounded to float32 before the cast."""
    # x = 0x1.6aaaac0aaaaabp-2 (float64); its float32 value is 0x1.6aaaacp-2, and 3 times that
    # is 1.0625 + 2^-24 exactly: a float32 tie that rounds to the even 1.0625 = 1 + 2^-4, itself
    # the E4M3 tie between 1 and 1.125 (3 mantissa bits), which rounds to the even 1.0. In
    # float64, 3 x = 1.06250006... lies above that tie and would give 1.125.
    x = torch.tensor([float.fromhex("0x1.6aaaac0aaaaabp-2"), 2.0], dtype=torch.float64)
    for quantize in (fp8_quantize, fp8_quantize_reference):
        # delayed, scale 3: amax 2, 2 * 3 = 6 <= 448, so 3 is used
        out = quantize(x, torch.tensor(3.0), torch.zeros(2), 0, 0, 0, False, False, E4M3)
        assert out[0].float().tolist() == [1.0, 6.0]
        assert out[3].item() == 3.0
        assert out[2].dtype == torch.float32 and out[2].item() == 2.0
    # current: amax 0x1.2aaaaap7 (149.3333282...): 448 / amax = 3.0000001017 rounds to the
    # float32 3.0 (half an ulp there is 2^-23 = 1.19e-7), so the same x * 3 as above
    x[1] = float.fromhex("0x1.2aaaaap7")
    for quantize in (fp8_quantize, fp8_quantize_reference):
        out = quantize(x, torch.tensor(1.0), torch.zeros(2), 0, 1, 0, False, False, E4M3)
        assert out[3].item() == 3.0 and out[3].dtype == torch.float32
        assert out[0].float().tolist() == [1.0, 448.0]


def _without_kernel(monkeypatch):
    monkeypatch.setattr(_fp8_fused, "native_kernels", lambda: None)


def test_op_available_is_false_without_the_c_kernel(monkeypatch):
    _without_kernel(monkeypatch)
    x = torch.tensor([1.0, 2.0])
    assert not op_available(x)
    args = (x, torch.tensor(1.0), torch.zeros(2), 0, 1, 0, False, False, E4M3)
    _same(fp8_quantize(*args), fp8_quantize_reference(*args))


def test_the_op_without_its_kernel_returns_none_of_its_inputs(monkeypatch):
    """Without the C kernel the op runs its twin; the delayed recipe that does not record
    returns its scale's value, in a tensor of its own (an op's outputs alias none of its
    inputs)."""
    _without_kernel(monkeypatch)
    x = torch.tensor([1.0, -3.0])
    scale, history = torch.tensor(2.0), torch.tensor([4.0, 1.0])
    out = torch.ops.mptex.fp8_quantize(x, scale, history, 0, 0, 0, False, False, torch.float32)
    assert out[4].item() == 2.0 and out[0].tolist() == [2.0, -6.0]
    inputs = {t.untyped_storage().data_ptr() for t in (x, scale, history)}
    assert all(t.untyped_storage().data_ptr() not in inputs for t in out if t.numel())


# ----------------------------------------------------------------------------- fused MLP
@pytest.fixture(params=["native", "eager"])
def loops(request, monkeypatch):
    """The twin's loops in its C kernel or in eager PyTorch ops."""
    if request.param == "eager":
        monkeypatch.setattr(twin, "_native", lambda *args: None)
    elif native_kernels() is None:
        pytest.skip("the C kernel does not build here")
    return request.param


def _float_accumulated(a: torch.Tensor, b: torch.Tensor, k_block: int) -> torch.Tensor:
    """Per element: each block's exact sum (float64 holds half products and 16 of their sums
    exactly), added to a float32 accumulator with one rounding, the end rounded to half."""
    a64, b64 = a.double(), b.double()
    n, k = a.shape
    out = torch.empty(n, b.shape[1], dtype=torch.float16)
    for i in range(n):
        for j in range(b.shape[1]):
            acc = torch.tensor(0.0, dtype=torch.float32)
            for k0 in range(0, k, k_block):
                block = sum(float(a64[i, t] * b64[t, j]) for t in range(k0, min(k, k0 + k_block)))
                acc = (acc.double() + block).float()
            out[i, j] = acc.half()
    return out


@pytest.mark.parametrize("k", [5, 20, 32])
def test_float_accumulation_matches_a_float64_loop_for_any_depth(loops, k):
    gen = torch.Generator().manual_seed(k)
    a = (torch.randn(3, k, generator=gen) * 4).half()
    b = (torch.randn(k, 4, generator=gen) * 4).half()
    for k_block in (8, 16):
        got = twin.half_matmul(a, b, k_block, "float")
        assert torch.equal(_bits(got), _bits(_float_accumulated(a, b, k_block)))


def test_float_accumulation_rounds_each_block_to_float32(loops):
    # Block 1 adds 2^4 * 2^7 = 2048; block 2 adds 2^-6 * 2^-7 = 2^-13, half a float32 ulp of
    # 2048 (ulp 2^(11 - 23) = 2^-12): the tie rounds to the even 2048; block 3 adds -2048. The
    # result is 0, not the exact 2^-13: one float32 rounding per block.
    a = torch.zeros(1, 24, dtype=torch.float16)
    b = torch.zeros(24, 1, dtype=torch.float16)
    a[0, 0], b[0, 0] = 2.0**4, 2.0**7
    a[0, 8], b[8, 0] = 2.0**-6, 2.0**-7
    a[0, 16], b[16, 0] = -(2.0**4), 2.0**7
    assert twin.half_matmul(a, b, 8, "float").item() == 0.0
    # one block of 32 holds all 24 products: their exact sum 2^-13 (a normal half, >= 2^-14)
    assert twin.half_matmul(a, b, 32, "float").item() == 2.0**-13


@pytest.mark.parametrize("columns", [8, 41])
def test_float_accumulation_rounds_each_block_in_every_column_loop(loops, columns):
    # The case above in each output column: the C kernel takes 32 columns at a time, then 8,
    # then one by one (41: all three loops; 8: the 8-wide one alone), each rounding per block.
    a = torch.zeros(1, 24, dtype=torch.float16)
    b = torch.zeros(24, columns, dtype=torch.float16)
    a[0, 0], b[0] = 2.0**4, 2.0**7
    a[0, 8], b[8] = 2.0**-6, 2.0**-7
    a[0, 16], b[16] = -(2.0**4), 2.0**7
    assert torch.equal(twin.half_matmul(a, b, 8, "float"), torch.zeros(1, columns).half())
    assert torch.equal(
        twin.half_matmul(a, b, 32, "float"), torch.full((1, columns), 2.0**-13).half()
    )


@pytest.mark.parametrize("columns", [1, 8])
def test_half_accumulator_of_a_subnormal_truncates_at_exponent_minus_14(loops, columns):
    # The tensor core's half step: terms truncated to multiples of 2^(E - 25), E the largest
    # exponent among the accumulator and the products, a half subnormal's counted as -14. Block
    # 1 leaves the accumulator at 2^-23 (a subnormal); block 2 adds 2^-25 and 2^-40: E = -14,
    # so 2^-40 truncates to 0 (an E of -15 would keep it), and 2^-23 + 2^-25, a tie between
    # the subnormals 2 and 3 units of 2^-24, rounds to the even 2^-23 (with 2^-40 on top it
    # would round up). 8 columns: the C kernel's 8-wide step; 1: its scalar one.
    a = torch.zeros(1, 16, dtype=torch.float16)
    b = torch.zeros(16, columns, dtype=torch.float16)
    a[0, 0], b[0] = 2.0**-12, 2.0**-11
    a[0, 8], b[8] = 2.0**-12, 2.0**-13
    a[0, 9], b[9] = 2.0**-20, 2.0**-20
    want = torch.full((1, columns), 2.0**-23).half()
    assert torch.equal(twin.half_matmul(a, b, 8, "half"), want)


def test_precision_statistics_by_hand():
    tiny = 2.0**-14  # half's smallest normal
    grad = torch.tensor([0.0, tiny, 2.0**-15, 1.0, 2.0**-20], dtype=torch.float16)
    stats = twin._grad_stats(grad, 128.0)
    # scaled: one zero; subnormal 2^-15 and 2^-20 (2^-14 itself is normal): 2 of 5
    assert stats["scaled_zero_frac"].item() == 1 / 5
    assert stats["scaled_subnormal_frac"].item() == 2 / 5
    # / 128: 0, 2^-21, 2^-22, 2^-7, 2^-27 -> 0 (below half of half's smallest subnormal 2^-24)
    assert stats["zero_frac"].item() == 2 / 5
    assert stats["subnormal_frac"].item() == 2 / 5
    assert stats["flushed_by_unscale_frac"].item() == 1 / 5


def test_float_absorbed_fraction_counts_nonzero_blocks_only(loops):
    """16 samples, blocks of 8: the first block's products are all zero (not a contribution);
    with an accumulator of 2048, a block adding 2^-13 (below half a float32 ulp) is absorbed."""
    grad = torch.zeros(32, 1, dtype=torch.float16)
    act = torch.zeros(32, 1, dtype=torch.float16)
    grad[8], act[8] = 2.0**4, 2.0**7  # block 1: 2048, changes the accumulator
    grad[16], act[16] = 2.0**-6, 2.0**-7  # block 2: 2^-13, absorbed
    # block 0 and block 3: zero products, not counted
    stats = {}
    out = twin.split_k_weight_grad(grad, act, "float", split_k=False, stats=stats)
    assert out.item() == 2048.0
    assert stats["absorbed_frac"].item() == 1 / 2


def test_split_k_slices_are_summed_in_the_accumulator_type(loops):
    """12288 samples: split-K cuts 12288 // 4096 = 3 slices of (12288 // 32 // 3) * 32 = 4096
    samples; one non-zero product per slice (2^4 * 2^7 = 2048, then 1, then 1), so each slice
    holds its product exactly."""
    grad = torch.zeros(12288, 1, dtype=torch.float16)
    act = torch.zeros(12288, 1, dtype=torch.float16)
    grad[0], act[0] = 2.0**4, 2.0**7
    grad[4096], act[4096] = 1.0, 1.0
    grad[8192], act[8192] = 1.0, 1.0
    # float32 slice sums: 2048 + 1 + 1 = 2050 exactly, a half value (ulp 2 there)
    assert twin.split_k_weight_grad(grad, act, "float", split_k=True).item() == 2050.0
    # half slice sums: 2048 + 1 = 2049 is a tie between the halves 2048 and 2050 -> the even
    # 2048, twice
    assert twin.split_k_weight_grad(grad, act, "half", split_k=True).item() == 2048.0
    # one slice, float: the same 2050
    assert twin.split_k_weight_grad(grad, act, "float", split_k=False).item() == 2050.0


def test_flat_params_layout_and_xavier_bounds_by_hand():
    """5 inputs, 3 outputs, width 32, 2 hidden layers: matrices [32, 16] (inputs padded to 16),
    [32, 32], [16, 32] (outputs padded to 16), 512 + 1024 + 512 = 2048 values; each uniform
    within sqrt(6 / (rows + cols)): sqrt(6 / 48) = 0.35355, sqrt(6 / 64) = 0.30619."""
    spec = twin.FusedMLPSpec(5, 3, 32, 2)
    assert spec.shapes() == [(32, 16), (32, 32), (16, 32)]
    assert spec.n_params == 2048
    params = twin.xavier_uniform_params(spec, seed=7)
    assert params.dtype == torch.float32 and params.shape == (2048,)
    for lo, hi, bound in ((0, 512, 0.35355339), (512, 1536, 0.30618622), (1536, 2048, 0.35355339)):
        part = params[lo:hi].double()
        # float32 rounding of the bound and of u * 2 * s - s: within 1e-6 of it
        assert part.abs().max() <= bound + 1e-6
        # 512 or more uniform draws: the largest is above 0.9 of the bound (a miss has
        # probability 0.95^512 < 1e-11) and both signs occur
        assert part.abs().max() > 0.9 * bound
        assert (part > 0).any() and (part < 0).any()


@pytest.mark.parametrize("accumulate", ["fast", "Half", "", None])
def test_a_spec_refuses_an_unknown_accumulator(accumulate):
    # Every path runs the float32 accumulators unless accumulate == "half": a typo in a spec
    # built directly would otherwise select them silently.
    with pytest.raises(ValueError) as info:
        twin.FusedMLPSpec(3, 2, 16, 1, accumulate=accumulate)
    assert str(info.value) == (f"accumulate: expected one of ('half', 'float'), got {accumulate!r}")


@pytest.mark.parametrize("accumulate", ["float", "half"])
def test_forward_and_backward_wiring_against_float64(accumulate):
    """A linear network (3 inputs, 2 outputs, width 16, one hidden layer, no activation)
    against its float64 formulas with the same half weights: out = x_pad W0^T W1^T, where x_pad
    is x with columns of 1.0 up to 16 (the padded input columns of W0 act as a bias); dL/dx =
    c W1[:2] W0[:, :3]; dL/dW1 = c^T h (rows 2.. zero: no cotangent reaches the padded
    outputs); dL/dW0 = (c W1[:2])^T x_pad. Samples 10..255 of the padded batch get no
    cotangent."""
    spec = twin.FusedMLPSpec(3, 2, 16, 1, activation="None", accumulate=accumulate)
    gen = torch.Generator().manual_seed(11)
    params = twin.xavier_uniform_params(spec, seed=5)
    x = torch.rand(10, 3, generator=gen).half().float().requires_grad_(True)
    master = params.clone().requires_grad_(True)
    out = twin.fused_mlp(x, master, spec)
    cotangent = (torch.rand(10, 2, generator=gen) - 0.5).half()
    out.backward(cotangent)

    w = params.half().double()
    w0, w1 = w[:256].view(16, 16), w[256:].view(16, 16)
    x_pad = torch.ones(10, 16, dtype=torch.float64)
    x_pad[:, :3] = x.detach().double()
    h = x_pad @ w0.t()
    c = cotangent.double()
    want_out = (h @ w1.t())[:, :2]
    want_gx = c @ w1[:2] @ w0[:, :3]
    want_gw1 = torch.zeros(16, 16, dtype=torch.float64)
    want_gw1[:2] = c.t() @ h
    want_gw0 = (c @ w1[:2]).t() @ x_pad
    # magnitudes: the sums of |terms| of each result bound its rounding errors
    mag_h = x_pad.abs() @ w0.abs().t()
    mag_out = (mag_h @ w1.abs().t())[:, :2]
    mag_gx = c.abs() @ w1[:2].abs() @ w0[:, :3].abs()
    mag_gw1 = torch.zeros(16, 16, dtype=torch.float64)
    mag_gw1[:2] = c.abs().t() @ mag_h
    mag_gw0 = (c.abs() @ w1[:2].abs()).t() @ x_pad
    # half rounds every stored value to 2^-11 relative; each result passes through at most 4
    # such roundings (operand, accumulation, scaled gradient, result), half accumulation adds
    # one per block of 8 or 16 terms (2 here): 8 half ulps of the magnitude bound them; the
    # 1e-5 absolute term covers gradients that reach half's subnormals after / 128.
    for got, want, mag in (
        (out.double(), want_out, mag_out),
        (x.grad.double(), want_gx, mag_gx),
        (master.grad[256:].view(16, 16).double(), want_gw1, mag_gw1),
        (master.grad[:256].view(16, 16).double(), want_gw0, mag_gw0),
    ):
        assert ((got - want).abs() <= 8 * 2.0**-11 * mag + 1e-5).all()
    # the padded output rows of W1 get exactly zero
    assert not master.grad[256 + 32 :].any()


def test_input_gradient_is_unscaled_in_float32_below_halfs_range():
    """The input gradient is rounded to half with the loss scale applied, then divided by the
    loss scale in float32: a value below half's subnormal spacing survives the division.

    Hand-set weights: W0[0, 0] = 0.75, W1[0, 0] = 1, all else 0. A cotangent of 3 * 2^-24 (a
    half subnormal) is scaled by 128 to 3 * 2^-17, passes W1 unchanged and W0 as
    3 * 2^-17 * 0.75 = 9 * 2^-19 (= 288 * 2^-24, a half subnormal, exact); / 128 in float32 is
    9 * 2^-26 exactly (in half it would round to 2 * 2^-24)."""
    spec = twin.FusedMLPSpec(3, 2, 16, 1, activation="None")
    params = torch.zeros(spec.n_params)
    params[0] = 0.75  # W0[0, 0]
    params[256] = 1.0  # W1[0, 0]
    x = torch.full((4, 3), 0.5, requires_grad=True)
    out = twin.fused_mlp(x, params, spec)
    assert out[:, 0].tolist() == [0.375] * 4 and not out[:, 1].any()
    cotangent = torch.zeros(4, 2, dtype=torch.float16)
    cotangent[:, 0] = 3 * 2.0**-24
    out.backward(cotangent)
    assert x.grad[:, 0].tolist() == [9 * 2.0**-26] * 4
    assert not x.grad[:, 1:].any()


def test_inputs_are_rounded_to_half_once():
    """Hand-set weights W0[0, 0] = W1[0, 0] = 1 pass the first input through: the output is
    x rounded to half (one rounding to nearest even, half ulp 2^-10 at 1)."""
    spec = twin.FusedMLPSpec(3, 2, 16, 1, activation="None")
    params = torch.zeros(spec.n_params)
    params[0] = params[256] = 1.0
    x = torch.zeros(3, 3)
    # 1 + 2^-10: a half; 1 + 2^-11 + 2^-13: above the tie 1 + 2^-11 -> 1 + 2^-10;
    # 1 + 2^-11: the tie -> the even 1.0
    x[:, 0] = torch.tensor([1 + 2.0**-10, 1 + 2.0**-11 + 2.0**-13, 1 + 2.0**-11])
    out = twin.fused_mlp(x, params, spec)
    assert out[:, 0].tolist() == [1 + 2.0**-10, 1 + 2.0**-10, 1.0]


# Half accumulation over products 2048, 1 (k = 0, 1) and 1 (k = 8): in blocks of 16 the exact
# sum 2050 is a half and is kept; in blocks of 8 the first block's 2049 is a tie between the
# halves 2048 and 2050 and rounds to the even 2048, and so does 2048 + 1 after the second.
BLOCKS_OF_16, BLOCKS_OF_8 = 2050.0, 2048.0


@pytest.mark.parametrize("n_out,want", [(2, BLOCKS_OF_16), (17, BLOCKS_OF_8)])
def test_last_layer_forward_block_is_8_only_past_16_outputs(n_out, want):
    """Width 16: the hidden activations are W0's padded-input column (x_pad's 1.0 there) and
    the output layer sums them: blocks of 16 (the fused kernel) for 16 padded outputs, of 8
    (CUTLASS) for 32."""
    spec = twin.FusedMLPSpec(3, n_out, 16, 1, activation="None")
    params = torch.zeros(spec.n_params)
    w0 = params[:256].view(16, 16)
    w1 = params[256:].view(spec.output_pad, 16)
    w0[0, 3], w0[1, 3], w0[8, 3] = 2048.0, 1.0, 1.0  # h = 2048, 1, 0, ..., 1 (k = 8), 0, ...
    w1[0, 0] = w1[0, 1] = w1[0, 8] = 1.0
    out = twin.fused_mlp(torch.zeros(2, 3), params, spec)
    assert out[:, 0].tolist() == [want] * 2


@pytest.mark.parametrize("n_out,want", [(9, BLOCKS_OF_16), (17, BLOCKS_OF_8)])
def test_last_layer_backward_block_is_8_only_past_16_outputs(n_out, want):
    """The gradient through the output layer sums over its padded outputs, in blocks of 16 for
    16 of them (9 outputs) and of 8 for 32 (17 outputs): a cotangent of 16, 2^-7, 2^-7 at
    outputs 0, 1, 8, scaled by 128 to 2048, 1, 1, meets W1[o, 0] = 1 there; W0[0, 0] = 1 passes
    the sum on (one exact product), / 128 in float32."""
    spec = twin.FusedMLPSpec(3, n_out, 16, 1, activation="None")
    params = torch.zeros(spec.n_params)
    w0 = params[:256].view(16, 16)
    w1 = params[256:].view(spec.output_pad, 16)
    w1[0, 0] = w1[1, 0] = w1[8, 0] = 1.0
    w0[0, 0] = 1.0
    x = torch.zeros(2, 3, requires_grad=True)
    out = twin.fused_mlp(x, params, spec)
    cotangent = torch.zeros(2, n_out, dtype=torch.float16)
    cotangent[:, 0], cotangent[:, 1], cotangent[:, 8] = 16.0, 2.0**-7, 2.0**-7
    out.backward(cotangent)
    assert x.grad[:, 0].tolist() == [want / 128] * 2


@pytest.mark.parametrize("width,want", [(16, BLOCKS_OF_16), (32, BLOCKS_OF_8)])
def test_input_gradient_block_is_16_only_when_the_padded_input_fills_the_width(width, want):
    """The input gradient sums over the width: in blocks of 16 (the fused kernel) where the
    padded input width equals the network width, else of 8 (CUTLASS). The output layer turns a
    cotangent of 16 (scaled: 2048) into 2048, 1, 1 at hidden units 0, 1, 8 (W1[0, k] = 1,
    2^-11, 2^-11: one exact product each); W0[k, 0] = 1 for those units."""
    spec = twin.FusedMLPSpec(3, 2, width, 1, activation="None")
    params = torch.zeros(spec.n_params)
    w0 = params[: width * 16].view(width, 16)
    w1 = params[width * 16 :].view(16, width)
    w1[0, 0], w1[0, 1], w1[0, 8] = 1.0, 2.0**-11, 2.0**-11
    w0[0, 0] = w0[1, 0] = w0[8, 0] = 1.0
    x = torch.zeros(2, 3, requires_grad=True)
    out = twin.fused_mlp(x, params, spec)
    cotangent = torch.zeros(2, 2, dtype=torch.float16)
    cotangent[:, 0] = 16.0
    out.backward(cotangent)
    # the half sum, / 128 in float32
    assert x.grad[:, 0].tolist() == [want / 128] * 2
