"""FP8 and int8 quantisation at their edges, against hand-worked values and per-element
references: half-precision inputs, the delayed recipe with nothing to go on, margins per row,
negative clamps and quotient roundings of int8, dtypes kept through fake quantisation, FP8
layers' biases and recording, the scaling state's counts, statistics, snapshots and checkpoints."""

import math

import numpy as np
import pytest
import torch
from fp8_reference import fp8_code, rowwise_gemm_reference

from mptex._fp8_scaling import delayed_update, rowwise_amax
from mptex.fp8 import (
    E4M3,
    E5M2,
    FP8_MAX,
    ScalingRecipe,
    ScalingState,
    fp8_linear,
    fp8_scale,
    quantization_error,
    quantize_fp8,
    quantize_fp8_rowwise,
    rowwise_spread,
    scaled_mm,
    statistics,
)
from mptex.quantize import fake_quantize, fake_quantize_input, quantize_int8

f32 = np.float32


def _wide(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    magnitudes = 10.0 ** (torch.rand(n, generator=gen) * 4 - 3)  # 1e-3 .. 1e1
    return torch.randn(n, generator=gen).sign() * magnitudes


# ----------------------------------------------------------------------------- quantisation


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_a_half_precision_input_is_scaled_in_float32(half, dtype):
    # The scaled product x * scale is rounded once, in float32, then cast: never first to the
    # input's own 11 or 8 bits (a double rounding that moves values across FP8 ties).
    x = _wide(4000, 1).to(half)
    amax = x.float().abs().max()
    scale = fp8_scale(amax, dtype)
    q, _, got_amax, used = quantize_fp8(x, scale, dtype)
    assert got_amax.item() == amax.item() and used.item() == scale.item()
    s = f32(scale.item())
    expected = [fp8_code(float(f32(v) * s), dtype) for v in x.float().tolist()]
    assert q.view(torch.uint8).tolist() == expected


def test_an_overflow_falls_back_to_the_correctly_rounded_quotient():
    # 3 * 200 = 600 > 448: the scale used is 448 / 3 rounded once in float32 (149.33333);
    # 448 * (1 / 3) rounds twice and lands one ulp above (149.33334).
    x = torch.tensor([3.0, -1.0])
    _, scale_inv, _, used = quantize_fp8(x, torch.tensor(200.0), E4M3)
    once, twice = f32(448.0) / f32(3.0), f32(448.0) * (f32(1.0) / f32(3.0))
    assert once != twice and used.item() == float(once)
    assert scale_inv.item() == float(f32(1.0) / once)


def test_the_delayed_recipe_keeps_its_scale_until_a_non_zero_amax_is_seen():
    # An all-zero history (start of training, or only zero tensors so far): 448 / 0 is inf,
    # so the scale stays at what it was, whatever that is; an inf amax does not enter.
    history = torch.zeros(3)
    for amax in (0.0, math.inf):
        scale, after = delayed_update(torch.tensor(amax), torch.tensor(0.5), history, E4M3)
        assert scale.item() == 0.5 and after.tolist() == [0.0, 0.0, 0.0]
    # With margin 2 the first finite amax 8 gives 448 / 8 / 4 = 14.
    scale, after = delayed_update(torch.tensor(8.0), torch.tensor(0.5), history, E4M3, margin=2)
    assert scale.item() == 14.0 and after.tolist() == [8.0, 0.0, 0.0]


def test_rowwise_amax_takes_matrices_only():
    with pytest.raises(ValueError, match=r"^x: expected a \[M, K\] matrix, got shape \[4\]"):
        rowwise_amax(torch.ones(4))


def test_rowwise_scales_carry_the_margin():
    # Row amaxes 2 and 8, margin 1: 448 / 2 / 2 = 112 and 448 / 8 / 2 = 28 (exact).
    x = torch.tensor([[2.0, -1.0], [0.5, -8.0]])
    q, scale_inv, _, used = quantize_fp8_rowwise(x, E4M3, margin=1)
    assert used[:, 0].tolist() == [112.0, 28.0]
    assert scale_inv[:, 0].tolist() == [float(f32(1) / f32(112)), float(f32(1) / f32(28))]
    assert q.float().tolist() == [[224.0, -112.0], [14.0, -224.0]]


# ----------------------------------------------------------------------------- int8


def test_int8_clamps_a_negative_quotient_at_minus_127():
    # As the positive case: -2e-42 is -1427 * 2^-149 over the scale 11 * 2^-149, -129.7, which
    # rounds to -130: clamped to -127, never -128 (the symmetric range).
    q, scales = quantize_int8(torch.tensor([[-2e-42, -1e-42]]))
    assert scales.item() == 11 * 2.0**-149 and q.tolist() == [[-127, -65]]


def test_int8_codes_are_the_rounded_float32_quotient():
    # amax 1.8691334 gives the scale f32(amax / 127); 1.5085526 / scale is exactly 102.5 in
    # float32, a tie that goes to even (102). A product with the scale's reciprocal rounds to
    # 102.50001 and would give 103.
    row = [1.8691333532333374, 1.5085525512695312]
    scale = f32(f32(row[0]) / f32(127))
    assert f32(f32(row[1]) / scale) == f32(102.5)
    q, scales = quantize_int8(torch.tensor([row]))
    assert scales.item() == float(scale) and q.tolist() == [[127, 102]]


# ----------------------------------------------------------------------------- fake quantisation


@pytest.mark.parametrize("kind", ["int8", "fp8", "fp8_rowwise"])
def test_fake_quantisation_returns_the_weights_dtype(kind):
    from fp8_reference import fake_quantize_reference

    weight = (_wide(8 * 16, 2).reshape(8, 16) * 0.1).half().requires_grad_()
    got = fake_quantize(weight, kind)
    assert got.dtype == torch.float16
    # The quantised values are float32 numbers; float64 -> float16 of them rounds as float32's.
    want = fake_quantize_reference(weight.detach().float(), kind).half()
    assert torch.equal(got.detach(), want)
    got.float().sum().backward()
    assert weight.grad.dtype == torch.float16 and bool((weight.grad == 1).all())


def test_fake_quantised_inputs_keep_their_dtype_and_refuse_unknown_kinds():
    x = (_wide(6 * 16, 3).reshape(6, 16)).half()
    y = fake_quantize_input(x, "fp8_rowwise")
    assert y.dtype == torch.float16 and y.shape == x.shape
    with pytest.raises(ValueError, match="^kind: expected one of"):
        fake_quantize_input(x, "int4")


# ----------------------------------------------------------------------------- error statistics


def test_quantization_error_by_hand():
    # ||(0.5, -0.5, 0, -1e-3)||_2 / ||(3, 4, 0, 1e-3)||_2 and one of three non-zeros flushed.
    x = torch.tensor([3.0, 4.0, 0.0, 1e-3])
    q = torch.tensor([3.5, 3.5, 0.0, 0.0])
    relative, flushed = quantization_error(x, q).tolist()
    want = math.sqrt(0.25 + 0.25 + 1e-6) / math.sqrt(25 + 1e-6)
    assert relative == pytest.approx(want, rel=1e-6)  # float32: a few roundings in the norms
    assert flushed == pytest.approx(1 / 3, rel=2**-23)


def test_quantization_error_of_a_zero_tensor_is_zero():
    assert quantization_error(torch.zeros(5), torch.zeros(5)).tolist() == [0.0, 0.0]


def test_rowwise_spread_of_a_matrix_without_live_rows_is_zero():
    x = torch.zeros(3, 4)
    _, _, amax, used = quantize_fp8_rowwise(x, E4M3)
    assert rowwise_spread(x, used, amax, E4M3).tolist() == [0.0, 0.0]


# ----------------------------------------------------------------------------- scaling state


def test_an_inf_is_counted_as_non_finite_and_never_as_an_overflow():
    state = ScalingState(E4M3, ScalingRecipe(amax_history_len=2), None)
    state.quantize(torch.tensor([4.0]), record=True)  # next scale 448 / 4 = 112
    _, _, used = state.quantize(torch.tensor([1.0, math.inf]), record=True)
    assert used.item() == 0.0  # 448 / inf: the inf becomes NaN
    assert state.nonfinite.item() == 1.0 and state.overflows.item() == 0.0


def test_the_current_recipe_never_counts_an_overflow():
    state = ScalingState(E4M3, ScalingRecipe("current", margin=1), None)
    for x in ([3.0, -1.0], [1e-3], [600.0]):
        state.quantize(torch.tensor(x), record=True)
    assert state.overflows.item() == 0.0 and state.calls.item() == 3.0


def test_statistics_report_the_scale_each_call_used():
    # Fresh: amax 0 and scale 1. Delayed, margin 1: call 1 uses 1 (next 448 / 1 / 2 = 224);
    # call 2's 4 * 224 = 896 overflows, so it uses 448 / 4 = 112 (next 448 / 4 / 2 = 56).
    state = ScalingState(E4M3, ScalingRecipe(margin=1, amax_history_len=4), None)
    fresh = statistics(state)
    assert fresh["amax"].item() == 0.0 and fresh["scale"].item() == 1.0
    state.quantize(torch.tensor([1.0]), record=True)
    state.quantize(torch.tensor([4.0, -2.0]), record=True)
    stats = statistics(state)
    assert stats["amax"].item() == 4.0 and stats["scale"].item() == 112.0
    assert stats["overflows"].item() == 1.0 and state.scale.item() == 56.0


def test_collected_statistics_name_the_error_and_the_underflow():
    # Current scale 448 / 448 = 1: 2^-12 is below half of E4M3's smallest subnormal 2^-9 and
    # flushes to 0. Relative error 2^-12 / sqrt(448^2 + 2^-24), underflow 1 of 2.
    state = ScalingState(E4M3, ScalingRecipe("current"), None)
    state.collect = True
    state.quantize(torch.tensor([448.0, 2.0**-12]), record=True)
    stats = statistics(state)
    assert stats["rel_error"].item() == pytest.approx(2.0**-12 / 448.0, rel=2**-22)
    assert stats["underflow_frac"].item() == 0.5
    assert "scale_spread" not in stats and "tensor_underflow_frac" not in stats
    rows = ScalingState(E4M3, ScalingRecipe("rowwise"), None)
    rows.collect = True
    rows.quantize(torch.tensor([[2.0, 1.0], [8.0, 0.0]]), record=True)
    stats = statistics(rows)
    # Row scales 448 / 2 = 224 and 448 / 8 = 56: two binades apart.
    assert stats["scale_spread"].item() == 2.0 and stats["tensor_underflow_frac"].item() == 0.0


def test_a_reused_quantisation_serves_only_the_same_output_dtype():
    w = torch.nn.Parameter(torch.tensor([[1.0, -0.3], [0.2, 0.7]]))
    state = ScalingState(E4M3, ScalingRecipe("current"), None)
    state.reuse = True
    codes, _, _ = state.quantize(w, True)
    values, _, _ = state.quantize(w, True, torch.float32)
    assert codes.dtype == E4M3 and values.dtype == torch.float32
    assert torch.equal(values, codes.float())


def test_per_tensor_quantize_both_gives_the_one_scale_to_both_layouts():
    x = torch.tensor([[1.0, -2.0, 0.5], [4.0, 0.25, -1.0]])
    state = ScalingState(E4M3, ScalingRecipe("current"), None)
    q, q_t, scale_inv, t_scale_inv = state.quantize_both(x, True, 0, 1)
    assert scale_inv.item() == float(f32(1.0) / f32(112.0))  # scale 448 / 4
    assert torch.equal(t_scale_inv, scale_inv)
    assert torch.equal(q_t.float(), q.float().t())
    q, q_t, scale_inv, t_scale_inv = state.quantize_both(x, True, 0, 0)
    assert q_t is None and t_scale_inv is None


def test_restoring_a_snapshot_forgets_every_call_since_as_often_as_asked():
    # The calls since the snapshot (each with an inf) leave no count behind, however often the
    # same snapshot is restored; the call before it (amax 2, finite) stays counted.
    state = ScalingState(E4M3, ScalingRecipe(amax_history_len=3), None)
    state.quantize(torch.tensor([2.0]), record=True)
    snap = state.snapshot()
    for _ in range(3):
        state.quantize(torch.tensor([1.0, math.inf]), record=True)
        state.restore(snap)
        assert state.calls.item() == 1.0 and state.nonfinite.item() == 0.0
        assert state.history.tolist() == [2.0, 0.0, 0.0] and state.scale.item() == 224.0


def test_a_state_saved_before_the_rowwise_statistics_loads():
    # Checkpoints written before last_rowwise existed lack it: it keeps its initial zeros.
    source = ScalingState(E4M3, ScalingRecipe(amax_history_len=2), None)
    source.quantize(torch.tensor([8.0]), record=True)
    saved = {k: v for k, v in source.state_dict().items() if k != "last_rowwise"}
    state = ScalingState(E4M3, ScalingRecipe(amax_history_len=2), None)
    state.load_state_dict(saved)
    assert state.scale.item() == 56.0 and state.last_rowwise.tolist() == [0.0, 0.0]


# ----------------------------------------------------------------------------- GEMMs and layers


def test_scaled_mm_refuses_operands_whose_inner_sizes_differ():
    q = torch.zeros(2, 3, dtype=E4M3)
    with pytest.raises(ValueError, match=r"^a, b: expected \[M, K\] and \[K, N\], got \[2, 3\]"):
        scaled_mm(q, q, torch.tensor(1.0), torch.tensor(1.0), backend="emulated")


def _states(recipe, margin=0):
    r = ScalingRecipe(recipe, margin=margin)
    return (ScalingState(E4M3, r, None), ScalingState(E4M3, r, None), ScalingState(E5M2, r, None))


@pytest.mark.parametrize("recipe", ["current", "rowwise"])
def test_an_fp8_layers_bias_is_added_in_float32_and_its_gradient_is_the_batch_sum(recipe):
    gen = torch.Generator().manual_seed(8)
    x = torch.rand(40, 32, generator=gen) * 2 - 1
    w = torch.randn(8, 32, generator=gen) * 0.3
    b = (torch.randn(8, generator=gen)).requires_grad_()
    g = torch.randn(40, 8, generator=gen)
    plain = fp8_linear(x, w, None, _states(recipe), backend="emulated")
    y = fp8_linear(x, w, b, _states(recipe), backend="emulated")
    assert torch.equal(y, plain + b.detach())  # the same quantised GEMM, then one f32 addition
    (grad_b,) = torch.autograd.grad((y * g).sum(), (b,))
    # float32 sum of 40 terms against float64: at most 39 u sum |g|.
    ref = g.double().sum(0)
    assert torch.all((grad_b.double() - ref).abs() <= 39 * 2.0**-24 * g.double().abs().sum(0))


@pytest.mark.parametrize("recipe", ["delayed", "current", "rowwise"])
def test_a_training_forward_records_with_only_the_weight_requiring_grad(recipe):
    # The first layer's input (fixed encodings) needs no gradient; the weight does: the call
    # is a training forward, and the backward records the output gradient.
    x = torch.rand(12, 16) * 2 - 1
    w = (torch.randn(4, 16) * 0.3).requires_grad_()
    states = _states(recipe)
    y = fp8_linear(x, w, None, states, backend="emulated")
    assert [s.calls.item() for s in states] == [1.0, 1.0, 0.0]
    y.sum().backward()
    assert [s.calls.item() for s in states] == [1.0, 1.0, 1.0]
    assert states[2].last_amax.item() == 1.0  # dL/dy of a sum: all ones


def _codes_with_margin(x: np.ndarray, dtype, margin: int):
    """Per-element row-wise codes of float32 ``x`` with ``scale_i = fp8_max / amax_i / 2**m``
    (two float32 roundings; 1 for a zero row) and the float32 inverse scales."""
    fp8_max = f32(FP8_MAX[dtype])
    codes = np.zeros(x.shape, dtype=np.int64)
    inverse = np.zeros(x.shape[0], dtype=np.float32)
    for i, row in enumerate(x):
        amax = f32(max(abs(float(v)) for v in row))
        scale = f32(f32(fp8_max / amax) / f32(2.0**margin)) if amax > 0 else f32(1.0)
        inverse[i] = f32(1.0) / scale
        codes[i] = [fp8_code(float(f32(v) * scale), dtype) for v in row]
    return codes, inverse


def test_a_rowwise_layer_applies_the_margin_to_every_operand():
    # Margin 6 pushes the small values of each row (magnitudes 1e-3 .. 1e1) into E4M3's
    # subnormals, where it changes the values the GEMMs see: every operand must carry it.
    margin = 6
    gen = torch.Generator().manual_seed(9)
    x = _wide(160, 9).reshape(10, 16).requires_grad_()
    w = (torch.randn(4, 16, generator=gen) * 0.3).requires_grad_()
    g = torch.randn(10, 4, generator=gen) * 1e-3
    y = fp8_linear(x, w, None, _states("rowwise", margin), backend="emulated")
    grad_x, grad_w = torch.autograd.grad((y * g).sum(), (x, w))
    xn, wn, gn = x.detach().numpy(), w.detach().numpy(), g.numpy()

    def product(a, dtype_a, b_t):  # a [M, K] per row, b_t [N, K] per row (columns of b)
        ca, sa = _codes_with_margin(a, dtype_a, margin)
        cb, sb = _codes_with_margin(b_t, E4M3, margin)
        return rowwise_gemm_reference(ca, dtype_a, cb.T, E4M3, sa, sb)

    assert y.tolist() == product(xn, E4M3, wn).tolist()
    assert grad_x.tolist() == product(gn, E5M2, wn.T).tolist()
    assert grad_w.tolist() == product(gn.T, E5M2, xn.T).tolist()
    # The margin matters here: without it the weight gradient differs.
    cg, sg = _codes_with_margin(gn.T, E5M2, margin)
    cx, sx = _codes_with_margin(xn.T, E4M3, 0)
    assert grad_w.tolist() != rowwise_gemm_reference(cg, E5M2, cx.T, E4M3, sg, sx).tolist()


@pytest.mark.parametrize("recipe", ["current", "rowwise"])
def test_a_recipe_without_history_keeps_the_delayed_scale_and_history_untouched(recipe):
    # Only the delayed recipe reads and moves `scale` and `history`; a current or row-wise
    # state keeps 1.0 and its zero history through recorded calls, so its checkpoint loads into
    # a fresh state of the same recipe (the shapes match).
    state = ScalingState(E4M3, ScalingRecipe(recipe, amax_history_len=4), None)
    for value in (3.0, 0.5):
        state.quantize(torch.full((2, 3), value), record=True)
    assert float(state.last_scale) == 448.0 / 0.5
    assert float(state.scale) == 1.0 and torch.equal(state.history, torch.zeros(4))
    fresh = ScalingState(E4M3, ScalingRecipe(recipe, amax_history_len=4), None)
    fresh.load_state_dict(state.state_dict())
    assert torch.equal(fresh.history, torch.zeros(4)) and float(fresh.last_scale) == 896.0
