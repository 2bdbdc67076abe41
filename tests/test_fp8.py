"""FP8 GEMMs (mptex.fp8): quantisation bit for bit against a per-element reference, scales
against float64, the emulated GEMM against a float64 reference with a stated bound, the recipes'
histories by hand, and that no overflow or non-finite value reaches the weights."""

import math

import numpy as np
import pytest
import torch
from fp8_reference import FORMATS, fp8_code, fp8_value, rowwise_codes, rowwise_gemm_reference
from torch.utils._python_dispatch import TorchDispatchMode

from mptex.fp8 import (
    E4M3,
    E5M2,
    FP8_MAX,
    ScalingRecipe,
    ScalingState,
    fp8_linear,
    fp8_scale,
    quantize_fp8,
    quantize_fp8_rowwise,
    resolve_gemm_backend,
    rowwise_spread,
    scaled_mm,
    scaled_mm_rowwise,
)
from mptex.mlp import FP8Linear, PrecisionMLP
from mptex.precision import PrecisionPolicy, PrecisionStepper

U32 = 2.0**-24  # float32's unit roundoff


def _values(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    magnitudes = 10.0 ** (torch.rand(n, generator=gen) * 8 - 6)  # 1e-6 .. 1e2
    return torch.randn(n, generator=gen).sign() * magnitudes


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_cast_matches_the_per_element_reference(dtype):
    fp8_max = FP8_MAX[dtype]
    x = _values(4000, 0)
    x = x[x.abs() <= fp8_max]
    # Exact ties between neighbours (even and odd mantissas), and the subnormal edge.
    ebits, mbits, bias = FORMATS[dtype]
    tiny = 2.0 ** (1 - bias - mbits)
    ties = [tiny * 0.5, tiny * 1.5, tiny * 2.5, 1.0 + 2.0**-mbits / 2, 1.0 + 3 * 2.0**-mbits / 2]
    x = torch.cat([x, torch.tensor(ties + [-t for t in ties] + [0.0, -0.0, fp8_max])])
    codes = x.to(dtype).view(torch.uint8).tolist()
    expected = [fp8_code(float(v), dtype) for v in x.tolist()]
    assert codes == expected


def test_scale_is_transformer_engines_formula_in_float32():
    # 0.14917877 and 0.3: torch's 448.0 / amax (reciprocal, then multiply) is one ulp off there.
    amax = torch.tensor([3.0e-5, 0.7, 1.0, 413.25, 9.9e4, 0.14917877, 0.3], dtype=torch.float32)
    for dtype in (E4M3, E5M2):
        for margin in (0, 1, 3):
            got = fp8_scale(amax, dtype, margin)
            # float64 quotient, rounded once to float32: the same as float32's own division
            # (double rounding is innocuous for a quotient since 53 >= 2 * 24 + 2).
            ref = [
                np.float32(np.float32(FP8_MAX[dtype] / float(a)) / np.float32(2.0**margin))
                for a in amax
            ]
            assert got.tolist() == [float(r) for r in ref]
    previous = torch.tensor(5.0)
    kept = fp8_scale(torch.tensor([0.0, math.inf, math.nan]), E4M3, 0, previous)
    assert kept.tolist() == [5.0, 5.0, 5.0]  # amax 0 or non-finite keeps the previous scale
    assert fp8_scale(torch.tensor(1e-42), E4M3).item() == 1.0  # 448 / 1e-42 overflows f32


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_quantize_is_one_float32_multiply_then_the_cast(dtype):
    x = _values(2000, 1)
    amax = x.abs().max()
    scale = fp8_scale(amax, dtype)
    q, scale_inv, got_amax, used = quantize_fp8(x, scale, dtype)
    assert q.dtype == dtype and got_amax.item() == amax.item() and used.item() == scale.item()
    assert scale_inv.item() == float(np.float32(1.0) / np.float32(scale.item()))
    scaled = (x.numpy().astype(np.float64) * np.float64(scale.item())).astype(np.float32)
    expected = [fp8_code(float(v), dtype) for v in scaled]
    assert q.view(torch.uint8).tolist() == expected


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_a_scale_that_would_overflow_uses_the_current_one(dtype):
    x = torch.tensor([1.0, -3.0, 1000.0, 0.5])
    q, scale_inv, amax, used = quantize_fp8(x, torch.tensor(100.0), dtype)  # 1e5 > 57344
    assert used.item() == np.float32(FP8_MAX[dtype]) / np.float32(1000.0)
    assert torch.isfinite(q.float()).all()
    assert q.float().abs().max().item() == FP8_MAX[dtype]


def test_a_product_that_rounds_to_fp8_max_is_no_overflow():
    # 14.884913 * 30.09759 is 448 + 1.4e-5 exactly but 448.0 in float32, the product the rule
    # compares: it fits, so the recipe's scale stays (falling back would give 448 / 14.884913).
    x, scale = torch.tensor([14.884913]), torch.tensor(30.09759)
    assert float(np.float32(14.884913) * np.float32(30.09759)) == 448.0
    q, _, _, used = quantize_fp8(x, scale, E4M3)
    assert used.item() == scale.item() and q.float().item() == 448.0
    state = ScalingState(E4M3, ScalingRecipe("delayed"), None)
    state.scale = scale
    _, _, used = state.quantize(x, record=True)
    assert used.item() == scale.item() and state.overflows.item() == 0.0


def test_non_finite_input_becomes_nan_never_a_finite_value():
    # torch 2.13's CPU cast saturates inf at 448: the scale 0 turns an inf into NaN first.
    for bad in (math.inf, -math.inf, math.nan):
        x = torch.tensor([1.0, bad, 2.0])
        q, scale_inv, amax, used = quantize_fp8(x, torch.tensor(4.0), E4M3)
        assert torch.isnan(q.float()[1]) and not torch.isfinite(amax)


def test_delayed_recipe_uses_the_history_of_earlier_calls():
    recipe = ScalingRecipe("delayed", margin=1, amax_history_len=3, amax_compute_algo="max")
    state = ScalingState(E4M3, recipe, None)
    used = []
    for amax in (2.0, 8.0, 1.0, 0.5, 0.25):
        _, _, scale = state.quantize(torch.tensor([amax, -amax / 4]), record=True)
        used.append(scale.item())

    def s(a):  # 448 / a / 2**margin, two float32 roundings
        return float(np.float32(np.float32(448.0 / a) / np.float32(2.0)))

    # By hand: call 1 uses the initial 1.0; call 2 the scale of history [2] (112), but
    # 8 * 112 > 448, so 448 / 8 (one overflow); calls 3-5 the scale of max(history) = 8 until
    # 8 leaves the 3-entry history after call 5.
    assert used == [1.0, 448.0 / 8, s(8.0), s(8.0), s(8.0)]
    assert state.overflows.item() == 1.0 and state.calls.item() == 5.0
    assert state.history.tolist() == [0.25, 0.5, 1.0]
    assert state.scale.item() == s(1.0)


def test_delayed_recipe_counts_an_overflow_and_most_recent_forgets():
    recipe = ScalingRecipe("delayed", amax_history_len=4, amax_compute_algo="most_recent")
    state = ScalingState(E4M3, recipe, None)
    state.quantize(torch.tensor([1.0]), record=True)  # scale 1 -> next 448
    _, _, used = state.quantize(torch.tensor([2.0]), record=True)  # 2 * 448 > 448: overflow
    assert used.item() == 224.0 and state.overflows.item() == 1.0
    _, _, used = state.quantize(torch.tensor([0.5]), record=True)
    assert used.item() == 224.0  # most recent: 448 / 2
    assert state.scale.item() == 896.0


def test_non_finite_amax_is_counted_and_kept_out_of_the_history():
    state = ScalingState(E4M3, ScalingRecipe(amax_history_len=2), None)
    state.quantize(torch.tensor([4.0]), record=True)
    before = state.scale.clone()
    state.quantize(torch.tensor([math.inf]), record=True)
    assert state.nonfinite.item() == 1.0 and state.scale.item() == before.item()
    assert state.history.tolist() == [4.0, 0.0]


def test_current_recipe_is_each_tensors_own_amax():
    state = ScalingState(E5M2, ScalingRecipe("current", margin=2), None)
    x = torch.tensor([3.0e-4, -7.5e-3])
    _, _, used = state.quantize(x, record=True)
    assert used.item() == float(np.float32(np.float32(57344.0 / np.float32(7.5e-3)) / 4))


def _gemm_reference(a, b, sa, sb):
    """float64 result and the magnitude sum sum_k |a_ik b_kj| |alpha| (the bound's scale)."""
    a64, b64 = a.double(), b.double()
    alpha = sa.double() * sb.double()
    return (a64 @ b64) * alpha, (a64.abs() @ b64.abs()) * alpha.abs()


@pytest.mark.parametrize("shape", [(7, 32, 3), (300, 32, 32), (3, 4096, 32)])
@pytest.mark.parametrize("dtypes", [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)])
def test_emulated_gemm_within_the_float32_accumulation_bound(shape, dtypes):
    m, k, n = shape
    gen = torch.Generator().manual_seed(m + k)
    a = torch.randn(m, k, generator=gen)
    b = torch.randn(k, n, generator=gen) * 1e-3
    qa, sa, _, _ = quantize_fp8(a, fp8_scale(a.abs().max(), dtypes[0]), dtypes[0])
    qb, sb, _, _ = quantize_fp8(b, fp8_scale(b.abs().max(), dtypes[1]), dtypes[1])
    out = scaled_mm(qa, qb, sa, sb, backend="emulated")
    ref, magnitude = _gemm_reference(qa.float(), qb.float(), sa, sb)
    # Products of FP8 values are exact in float32 and the float64 sum is exact, so the error is
    # the float32 summation's, at most (k - 1) u sum|ab| (Higham's gamma_{k-1}), plus one
    # rounding of alpha and one of the scaled result: (k + 2) u sum|ab| |alpha|.
    err = (out.double() - ref).abs()
    assert out.dtype == torch.float32
    assert torch.all(err <= (k + 2) * U32 * magnitude), (err / magnitude).max()


def test_emulated_gemm_multiplies_by_the_product_of_the_scales():
    # k = 1: the sum is the exact product p = 0.40625 * 0.8125 of the E4M3 values, so the
    # result is f32(p * f32(sa * sb)); applying the scales one after the other,
    # f32(f32(p * sa) * sb), rounds at other points and lands one ulp above (0x1.794dd4p-3).
    a, b = torch.tensor([[0.40625]]).to(E4M3), torch.tensor([[0.8125]]).to(E4M3)
    sa, sb = torch.tensor(0.6976675987243652), torch.tensor(0.800011396408081)
    f32 = np.float32
    expected = f32(0.40625 * 0.8125) * (f32(sa.item()) * f32(sb.item()))
    assert float(expected) == float.fromhex("0x1.794dd2p-3")
    assert scaled_mm(a, b, sa, sb, backend="emulated").item() == float(expected)


@pytest.mark.parametrize("shape", [(7, 32, 3), (300, 32, 32), (3, 4096, 32)])
def test_the_scaled_mm_path_on_this_cpus_kernel_agrees_within_the_same_bound(shape):
    """The hardware path (padding to multiples of 16, column-major b) on this torch build's CPU
    torch._scaled_mm kernel, where it has one: a second, independent GEMM."""
    from mptex.fp8 import _scaled_mm_padded

    m, k, n = shape
    a = _values(m * k, 2).reshape(m, k)
    b = _values(k * n, 3).reshape(k, n)
    qa, sa, _, _ = quantize_fp8(a, fp8_scale(a.abs().max(), E4M3), E4M3)
    qb, sb, _, _ = quantize_fp8(b, fp8_scale(b.abs().max(), E4M3), E4M3)
    try:
        hardware = _scaled_mm_padded(qa, qb, sa, sb)
    except (RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"torch._scaled_mm has no CPU kernel in this build: {exc}")
    ref, magnitude = _gemm_reference(qa.float(), qb.float(), sa, sb)
    assert hardware.shape == (m, n)
    assert torch.all((hardware.double() - ref).abs() <= (k + 2) * U32 * magnitude)


def _skip_without_cpu_rowwise_scaled_mm() -> None:
    """Skip where this torch's CPU ``torch._scaled_mm`` takes per-tensor scales only (torch
    2.11's), so that the row-wise GEMMs cannot run on it here."""
    a = torch.ones(16, 16).to(E4M3)
    b = torch.ones(16, 16).to(E4M3).t()
    try:
        torch._scaled_mm(a, b, scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16),
                         out_dtype=torch.float32)  # fmt: skip
    except (RuntimeError, NotImplementedError) as exc:
        why = " ".join(str(exc).split())[:200]
        pytest.skip(
            f"torch {torch.__version__}'s CPU torch._scaled_mm has no row-wise scales: {why}"
        )


def _strict_scaled_mm(calls):
    """``torch._scaled_mm`` that first asserts what its CUDA kernels check and this CPU's kernel
    does not (torch's ``_scaled_mm_out_cuda``): a row-major ``a`` with K a multiple of 16, a
    column-major ``b`` with K and N multiples of 16, 16-byte aligned operands, not both E5M2;
    row-wise scales ``[M, 1]`` and ``N`` values with unit stride, an E4M3 ``b``; then torch's own
    checks of a CUDA call (its meta function, which takes a meta tensor for a CUDA one), on
    meta tensors of the operands' shapes, strides and dtypes. Records each call's ``(M, K, N)``."""
    real = torch._scaled_mm

    def as_meta(t):
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

    def checked(a, b, scale_a, scale_b, **kwargs):
        (m, k), n = a.shape, b.shape[1]
        assert k % 16 == 0 and b.shape[0] % 16 == 0 and n % 16 == 0, (a.shape, b.shape)
        assert a.stride(1) == 1 and a.stride(0) >= k, ("a row-major", a.stride())
        assert b.stride(0) == 1 and b.stride(1) >= k, ("b column-major", b.stride())
        assert a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0
        assert not a.dtype == b.dtype == E5M2
        if scale_a.numel() > 1:  # row-wise
            assert scale_a.shape == (m, 1) and scale_a.stride(1) == 1, scale_a.shape
            assert scale_b.numel() == n and scale_b.stride(-1) == 1, scale_b.shape
            assert b.dtype == E4M3
        real(as_meta(a), as_meta(b), scale_a=as_meta(scale_a), scale_b=as_meta(scale_b), **kwargs)
        calls.append((m, k, n))
        return real(a, b, scale_a=scale_a, scale_b=scale_b, **kwargs)

    return checked


def test_the_strict_scaled_mm_applies_torchs_own_cuda_checks():
    # A row-wise scale_b of shape [N] passes the checks written out above (N values, unit
    # stride); torch's CUDA path takes only [1, N] and its meta function says so.
    a = torch.zeros(16, 16).to(E4M3)
    b = torch.zeros(16, 16).to(E4M3).t()
    calls = []
    with pytest.raises(RuntimeError, match="scale tensors must be 2D"):
        _strict_scaled_mm(calls)(a, b, torch.ones(16, 1), torch.ones(16), out_dtype=torch.float32)
    assert calls == []


@pytest.mark.parametrize("recipe", ["delayed", "current", "rowwise"])
@pytest.mark.parametrize("m, k_in, n_out", [(1, 32, 9), (17, 32, 3), (40, 24, 32), (64, 32, 9)])
def test_the_scaled_mm_path_meets_the_cuda_kernels_checks_and_agrees_with_the_emulation(
    monkeypatch, recipe, m, k_in, n_out
):
    """A layer's three GEMMs through torch._scaled_mm (this CPU's kernel, with the CUDA
    kernel's checks asserted), with rows M not a multiple of 16, against the emulation on the
    same quantised operands. Both sum the same FP8 products; each rounds at most (K + 2) times
    in float32 (the row-wise emulation fewer), so they differ by at most 2 (K + 2) u sum|a b|,
    taken here from the unquantised operands times 1.27 (an E4M3 value is within 2^-4 of its
    input, an E5M2 one within 2^-3: (1 + 2^-3)^2 < 1.27)."""
    import mptex.fp8 as fp8

    if recipe == "rowwise":
        _skip_without_cpu_rowwise_scaled_mm()
    gen = torch.Generator().manual_seed(m * 100 + n_out)
    x0 = torch.rand(m, k_in, generator=gen) * 2 - 1
    w0 = torch.randn(n_out, k_in, generator=gen) * 0.3
    g = torch.randn(m, n_out, generator=gen) * 1e-4
    results = {}
    for backend in ("emulated", "scaled_mm"):
        calls = []
        if backend == "scaled_mm":
            monkeypatch.setattr(fp8, "has_fp8_tensor_cores", lambda device, rowwise=False: True)
            monkeypatch.setattr(torch, "_scaled_mm", _strict_scaled_mm(calls))
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = fp8_linear(x, w, None, _states(recipe), backend=backend)
        grads = torch.autograd.grad((y * g).sum(), (x, w))
        results[backend] = (y, *grads)
    # K of the forward, the input gradient and the weight gradient; M passes unpadded.
    assert sorted(calls) == sorted([(m, 32, 32 if n_out > 16 else 16), (m, 32 if n_out > 16
                                    else 16, 32), (n_out, 16 * -(-m // 16), 32)])  # fmt: skip
    magnitudes = (x0.abs() @ w0.abs().t(), g.abs() @ w0.abs(), g.abs().t() @ x0.abs())
    for k, emu, hw, mag in zip((k_in, n_out, m), results["emulated"], results["scaled_mm"],
                               magnitudes):  # fmt: skip
        assert hw.shape == emu.shape and hw.dtype == emu.dtype == torch.float32
        bound = 2 * (k + 2) * U32 * 1.27 * mag
        assert torch.all((hw - emu).abs() <= bound), ((hw - emu).abs() / mag).max()


class _OpNames(TorchDispatchMode):
    """The names of the aten ops run under it."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


_COPIES = ("copy_", "clone", "new_zeros", "zeros", "contiguous")  # layout copies


def _scaled_mm_layer_case(monkeypatch, recipe: str, n_out: int, seed: int):
    """A layer of 32 inputs and ``n_out`` outputs on 40 rows, on the scaled_mm path (this CPU's
    ``torch._scaled_mm`` behind :func:`_strict_scaled_mm`, whose calls are recorded) and the
    emulation: ``(calls, x, w, g, states by backend)``, the gradient states collecting."""
    import mptex.fp8 as fp8

    if recipe == "rowwise":
        _skip_without_cpu_rowwise_scaled_mm()
    monkeypatch.setattr(fp8, "has_fp8_tensor_cores", lambda device, rowwise=False: True)
    calls = []
    monkeypatch.setattr(torch, "_scaled_mm", _strict_scaled_mm(calls))
    gen = torch.Generator().manual_seed(seed)
    x = (torch.rand(40, 32, generator=gen) * 2 - 1).requires_grad_()
    w = (torch.randn(n_out, 32, generator=gen) * 0.3).requires_grad_()
    g = torch.randn(40, n_out, generator=gen) * 1e-4
    states = {backend: _states(recipe) for backend in ("scaled_mm", "emulated")}
    for backend in states:
        states[backend][2].collect = True
    return calls, x, w, g, states


@pytest.mark.parametrize("n_out", [32, 3])
def test_the_rowwise_backward_gives_scaled_mm_its_operands_uncopied(monkeypatch, n_out):
    """Row-wise, on the scaled_mm path: the operands the backward quantises for its GEMMs (the
    output gradient per sample, the weight per input channel, the weight gradient's two per
    channel) come from the op in the layout torch._scaled_mm takes (the reduced dimension
    contiguous, padded with zeros to a multiple of 16), so the backward copies nothing, whatever
    M and the number of output channels; the results are those of the emulation within the
    bound of the test above, and the gradient's collected statistics are the emulation's (the
    padding left out)."""
    calls, x, w, g, states = _scaled_mm_layer_case(monkeypatch, "rowwise", n_out, seed=5)
    y = fp8_linear(x, w, None, states["scaled_mm"], backend="scaled_mm")
    with _OpNames() as ops:
        grad_x, grad_w = torch.autograd.grad((y * g).sum(), (x, w))
    copies = [n for n in ops.names if n in _COPIES]
    assert not copies, copies
    assert calls[1:] == [(40, 32 if n_out > 16 else 16, 32), (n_out, 48, 32)]  # dX, dW (M: 48)
    y_emu = fp8_linear(x, w, None, states["emulated"], backend="emulated")
    want = torch.autograd.grad((y_emu * g).sum(), (x, w))
    for got, emu, k, mag in ((grad_x, want[0], n_out, g.abs() @ w.detach().abs()),
                             (grad_w, want[1], 40, g.abs().t() @ x.detach().abs())):  # fmt: skip
        assert torch.all((got - emu).abs() <= 2 * (k + 2) * U32 * 1.27 * mag)
    got, emu = states["scaled_mm"][2], states["emulated"][2]
    assert got.last_error.tolist() == emu.last_error.tolist() and got.last_error[0] > 0
    assert got.last_rowwise.tolist() == emu.last_rowwise.tolist()


@pytest.mark.parametrize("recipe", ["delayed", "current"])
@pytest.mark.parametrize("n_out", [32, 3])
def test_the_per_tensor_layer_gives_scaled_mm_its_operands_uncopied(monkeypatch, recipe, n_out):
    """Per tensor, on the scaled_mm path: each operand comes from its quantisation in the
    layout torch._scaled_mm takes, the transposes the backward's GEMMs reduce over (the input's
    and the output gradient's over the batch, the weight's over its output channels) from the
    same op call. The backward copies nothing; the forward copies only the weight of a layer
    with fewer than 16 outputs (padded as its b). The gradients are those the emulation gives
    on the same codes within the bound of the test above, and the recorded scales and the
    gradient's collected statistics are the emulation's (the padding left out)."""
    calls, x, w, g, states = _scaled_mm_layer_case(monkeypatch, recipe, n_out, seed=6)
    results = {}
    for backend in states:
        with _OpNames() as forward:
            y = fp8_linear(x, w, None, states[backend], backend=backend)
        with _OpNames() as backward:
            grads = torch.autograd.grad((y * g).sum(), (x, w))
        results[backend] = (y, grads, forward.names, backward.names)
    y, (grad_x, grad_w), forward, backward = results["scaled_mm"]
    assert not [n for n in backward if n in _COPIES], backward
    assert [n for n in forward if n in _COPIES] == ([] if n_out >= 16 else ["new_zeros", "copy_"])
    padded_out = 32 if n_out > 16 else 16
    assert calls == [(40, 32, padded_out), (40, padded_out, 32), (n_out, 48, 32)]  # y, dX, dW
    y_emu, (want_x, want_w), _, _ = results["emulated"]
    mag_y = x.detach().abs() @ w.detach().abs().t()
    for got, emu, k, mag in ((y, y_emu, 32, mag_y),
                             (grad_x, want_x, n_out, g.abs() @ w.detach().abs()),
                             (grad_w, want_w, 40, g.abs().t() @ x.detach().abs())):  # fmt: skip
        assert got.shape == emu.shape
        assert torch.all((got - emu).abs() <= 2 * (k + 2) * U32 * 1.27 * mag)
    for got, emu in zip(states["scaled_mm"], states["emulated"], strict=True):
        assert got.last_scale.tolist() == emu.last_scale.tolist()
        assert got.history.tolist() == emu.history.tolist()
    got, emu = states["scaled_mm"][2], states["emulated"][2]
    assert got.last_error.tolist() == emu.last_error.tolist() and got.last_error[0] > 0


def test_the_per_tensor_layer_makes_transposes_only_for_a_backward(monkeypatch):
    """On the scaled_mm path the transposes (``t_pad``) are asked for where a backward can
    follow: the input's when the weight requires grad, the weight's when the input does; none
    under ``torch.no_grad()`` (a validation forward)."""
    import mptex.fp8 as fp8

    calls, x, w, _, states = _scaled_mm_layer_case(monkeypatch, "current", 32, seed=7)
    asked, quantize = [], fp8.fp8_quantize
    monkeypatch.setattr(fp8, "fp8_quantize", lambda *a: asked.append(a[-1]) or quantize(*a))
    with torch.no_grad():
        fp8_linear(x, w, None, states["scaled_mm"], backend="scaled_mm")
    assert asked == [0, 0]
    for x_grad, w_grad, want in ((True, True, [16, 16]), (False, True, [16, 0]),
                                 (True, False, [0, 16])):  # fmt: skip
        asked.clear()
        fp8_linear(x.detach().requires_grad_(x_grad), w.detach().requires_grad_(w_grad), None,
                   states["scaled_mm"], backend="scaled_mm")  # fmt: skip
        assert asked == want, (x_grad, w_grad)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("recipe", ["delayed", "current", "rowwise"])
@pytest.mark.parametrize("m, n_out", [(17, 9), (4097, 3), (65536 + 5, 32)])
def test_the_scaled_mm_path_on_cuda_agrees_with_the_emulation_without_host_syncs(recipe, m, n_out):
    """The layer's GEMMs on the FP8 tensor cores, rows M not a multiple of 16, against the
    emulation on the same quantised operands, with the host never waiting for the device
    (after a warm-up call: Triton compiles then). The tensor cores keep about 14 bits over a
    block of K (up to 128) before promoting to float32 (benchmarks/gpu/validate.py's bound),
    plus float32's roundings in both; the magnitude as in the CPU test above."""
    from mptex.fp8 import has_fp8_tensor_cores

    if not has_fp8_tensor_cores("cuda", rowwise=recipe == "rowwise"):
        pytest.skip("needs FP8 tensor cores (compute capability 8.9 or later; row-wise with a "
                    "float32 result: 9.x and CUDA 12.9 or later)")  # fmt: skip
    gen = torch.Generator(device="cuda").manual_seed(m + n_out)
    x0 = torch.rand(m, 32, generator=gen, device="cuda") * 2 - 1
    w0 = torch.randn(n_out, 32, generator=gen, device="cuda") * 0.3
    g = torch.randn(m, n_out, generator=gen, device="cuda") * 1e-4
    results = {}
    for backend in ("emulated", "scaled_mm"):
        for attempt in ("warm-up", "measured"):
            states = tuple(ScalingState(s.dtype, s.recipe, "cuda") for s in _states(recipe))
            x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error" if attempt == "measured" else "default")
            try:
                y = fp8_linear(x, w, None, states, backend=backend)
                grads = torch.autograd.grad((y * g).sum(), (x, w))
            finally:
                torch.cuda.set_sync_debug_mode("default")
        results[backend] = (y, *grads)
    magnitudes = (x0.abs() @ w0.abs().t(), g.abs() @ w0.abs(), g.abs().t() @ x0.abs())
    for k, emu, hw, mag in zip((32, n_out, m), results["emulated"], results["scaled_mm"],
                               magnitudes):  # fmt: skip
        assert hw.shape == emu.shape and hw.dtype == torch.float32
        bound = (min(k, 128) * 2.0**-14 + 2 * (k + 2) * U32) * 1.27 * mag
        assert torch.all((hw - emu).abs() <= bound), ((hw - emu).abs() / mag).max().item()


def test_gemm_operands_are_copied_only_to_pad_or_lay_out():
    from mptex.fp8 import _gemm_operand

    row = torch.zeros(17, 32, dtype=E4M3)
    assert _gemm_operand(row, 17, 32, column_major=False) is row
    col = torch.zeros(32, 16, dtype=E4M3).t()
    assert _gemm_operand(col, 16, 32, column_major=True) is col
    padded = _gemm_operand(torch.ones(17, 9).to(E4M3).t(), 9, 32, column_major=False)
    assert padded.shape == (9, 32) and padded.is_contiguous()
    assert padded.float()[:, :17].eq(1).all() and padded.float()[:, 17:].eq(0).all()
    laid = _gemm_operand(row, 17, 32, column_major=True)
    assert laid.stride() == (1, 17) and torch.equal(laid.float(), row.float())


@pytest.mark.parametrize(
    "capability, cuda, tensorwise, rowwise",
    [((9, 0), "12.9", True, True), ((9, 0), "13.0", True, True), ((9, 0), "12.8", True, False),
     ((8, 9), "13.0", True, False), ((10, 0), "13.0", True, False), ((8, 6), "13.0", False, False)],
)  # fmt: skip
def test_where_the_scaled_mm_paths_run(monkeypatch, capability, cuda, tensorwise, rowwise):
    # torch._scaled_mm's row-wise path returns float32 only through cuBLAS (compute capability
    # 9.x, CUDA 12.9 or later); elsewhere its CUTLASS kernel returns bfloat16 only, so "auto"
    # emulates the row-wise GEMMs there and "scaled_mm" is refused in one line.
    from mptex.fp8 import has_fp8_tensor_cores

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    assert has_fp8_tensor_cores("cuda") is tensorwise
    assert has_fp8_tensor_cores("cuda", rowwise=True) is rowwise
    assert resolve_gemm_backend("auto", "cuda", rowwise=True) == ("scaled_mm" if rowwise
                                                                  else "emulated")  # fmt: skip
    if not rowwise:
        with pytest.raises(ValueError, match=r"backend: 'scaled_mm' needs .*row-wise"):
            resolve_gemm_backend("scaled_mm", "cuda", rowwise=True)


def test_scaled_mm_backend_resolution():
    assert resolve_gemm_backend("auto", "cpu") == "emulated"
    with pytest.raises(ValueError, match="backend: 'scaled_mm' needs a CUDA device"):
        resolve_gemm_backend("scaled_mm", "cpu")
    with pytest.raises(ValueError, match="backend: expected one of"):
        resolve_gemm_backend("cutlass", "cpu")
    q = torch.zeros(2, 2, dtype=E5M2)
    with pytest.raises(ValueError, match="not both E5M2"):
        scaled_mm(q, q, torch.tensor(1.0), torch.tensor(1.0))


def _states(recipe="current"):
    r = ScalingRecipe(recipe)
    return (ScalingState(E4M3, r, None), ScalingState(E4M3, r, None), ScalingState(E5M2, r, None))


def test_fp8_linear_forward_and_backward_against_float64():
    gen = torch.Generator().manual_seed(4)
    x = (torch.rand(513, 32, generator=gen) * 2 - 1).requires_grad_()
    w = (torch.randn(16, 32, generator=gen) * 0.3).requires_grad_()
    g = torch.randn(513, 16, generator=gen) * 1e-5  # training-sized cotangent
    states = _states()
    y = fp8_linear(x, w, None, states, backend="emulated")
    grad_x, grad_w = torch.autograd.grad((y * g).sum(), (x, w))
    # Independent quantisation of the three operands (current scaling: each tensor's amax).
    quantized = []
    for t, dtype in ((x.detach(), E4M3), (w.detach(), E4M3), (g, E5M2)):
        scale = np.float32(FP8_MAX[dtype]) / np.float32(t.abs().max().item())
        scaled = (t.numpy().astype(np.float64) * np.float64(scale)).astype(np.float32)
        codes = torch.tensor([fp8_code(float(v), dtype) for v in scaled.reshape(-1)],
                             dtype=torch.uint8).view(dtype).reshape(t.shape)  # fmt: skip
        quantized.append((codes, torch.tensor(np.float32(1.0) / scale)))
    (qx, sx), (qw, sw), (qg, sg) = quantized
    for got, (a, b, sa, sb) in (
        (y, (qx.float(), qw.float().t(), sx, sw)),
        (grad_x, (qg.float(), qw.float(), sg, sw)),
        (grad_w, (qg.float().t(), qx.float(), sg, sx)),
    ):
        ref, magnitude = _gemm_reference(a, b, sa, sb)
        k = a.shape[1]
        assert torch.all((got.double() - ref).abs() <= (k + 2) * U32 * magnitude)
    assert grad_w.dtype == torch.float32 and grad_x.dtype == torch.float32


def test_fp8_layer_state_round_trips_and_follows_the_device():
    torch.manual_seed(0)
    layer = FP8Linear(8, 4, bias=False, recipe=ScalingRecipe(amax_history_len=5))
    for _ in range(3):
        layer(torch.randn(10, 8)).sum().backward()
    copy = FP8Linear(8, 4, bias=False, recipe=ScalingRecipe(amax_history_len=5))
    copy.load_state_dict(layer.state_dict())
    for role in FP8Linear.ROLES:
        assert torch.equal(copy.scaling[role].history, layer.scaling[role].history)
        assert torch.equal(copy.scaling[role].scale, layer.scaling[role].scale)
    layer.half()  # a dtype cast leaves the scaling state in float32
    assert layer.scaling["input"].history.dtype == torch.float32
    other = FP8Linear(8, 4, bias=False, recipe=ScalingRecipe(amax_history_len=6))
    with pytest.raises(ValueError, match="amax_history_len"):
        other.load_state_dict(copy.state_dict())


def test_no_grad_forwards_leave_the_history_alone():
    torch.manual_seed(0)
    layer = FP8Linear(8, 4, bias=False)
    layer(torch.randn(10, 8)).sum().backward()
    before = layer.get_extra_state()
    with torch.no_grad():
        layer(torch.randn(10, 8) * 100)
    after = layer.get_extra_state()
    for role in FP8Linear.ROLES:
        assert all(torch.equal(before[role][k], after[role][k]) for k in before[role])


@pytest.mark.parametrize("arm", ["fp8", "fp8_current", "fp8_rowwise"])
def test_an_overflowing_step_never_puts_nan_into_weights_or_adam(arm):
    torch.manual_seed(0)
    policy = PrecisionPolicy.from_config({"name": arm, "encoder_dtype": "f32",
                                          "loss_scaling": "none"})  # fmt: skip
    mlp = PrecisionMLP(8, 3, 2, 16, policy)
    optimizer = torch.optim.Adam(mlp.parameters(), lr=1e-2)
    stepper = PrecisionStepper(policy, optimizer)
    x = torch.rand(64, 8)
    stepper(mlp(x).square().mean())  # a normal step: Adam state exists
    # Activations 1e12 x larger than the delayed scales expect: the overflow rule rescales them.
    optimizer.zero_grad()
    result = stepper(mlp(x * 1e12).square().mean())
    assert not result.skipped
    assert all(torch.isfinite(p).all() for p in mlp.parameters())
    if policy.fp8_recipe == "delayed":
        assert mlp.layers[0].scaling["input"].overflows.item() >= 1
    # An inf in the batch: the gradient is NaN, the step is skipped, nothing changes.
    weights = [p.detach().clone() for p in mlp.parameters()]
    adam = [{k: v.clone() for k, v in optimizer.state[p].items()} for p in mlp.parameters()]
    optimizer.zero_grad()
    bad = x.clone()
    bad[3, 2] = math.inf
    result = stepper(mlp(bad).square().mean())
    assert result.skipped
    for p, before, state in zip(mlp.parameters(), weights, adam, strict=True):
        assert torch.equal(p, before)
        assert all(torch.equal(optimizer.state[p][k], v) for k, v in state.items())
    assert mlp.layers[0].scaling["input"].nonfinite.item() == 1.0


def test_fp8_policy_checks_name_the_key():
    for cfg, key in (
        ({"name": "fp8", "mlp_dtypes": ["f16"]}, "mlp_dtypes"),
        ({"name": "fp8", "weight_quant": "int8"}, "weight_quant"),
        ({"name": "fp8", "fp8_recipe": "mxfp8"}, "fp8_recipe"),
        ({"name": "fp8", "fp8_margin": -1}, "fp8_margin"),
        ({"name": "fp8", "fp8_amax_history_len": 0}, "fp8_amax_history_len"),
        ({"name": "int8_qat", "master_weights": False}, "weight_quant"),
        ({"name": "int8_qat", "weight_quant": "int4"}, "weight_quant"),
    ):
        with pytest.raises(ValueError, match=rf"^{key}: ") as info:
            PrecisionPolicy.from_config(cfg)
        assert "\n" not in str(info.value)


# ----------------------------------------------------------------------------- row-wise scaling


def _rows(m: int, k: int, seed: int) -> torch.Tensor:
    """Rows of very different magnitudes (1e-5 .. 1e3), one all-zero row."""
    x = _values(m * k, seed).reshape(m, k) * 10.0 ** torch.linspace(-3, 1, m)[:, None]
    x[m // 2] = 0.0
    return x


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_rowwise_quantizer_matches_the_per_element_reference(dtype):
    x = _rows(23, 32, 5)
    q, scale_inv, amax, used = quantize_fp8_rowwise(x, dtype)
    codes, inverse = rowwise_codes(x.numpy(), dtype)
    assert q.view(torch.uint8).tolist() == codes.tolist()
    assert scale_inv.shape == (23, 1) and scale_inv[:, 0].tolist() == inverse.tolist()
    assert amax[:, 0].tolist() == x.abs().amax(dim=1).tolist()
    # The zero row: scale 1, all codes +0, and nothing but finite numbers anywhere.
    assert used[11].item() == 1.0 and not q[11].view(torch.uint8).any()
    assert torch.isfinite(scale_inv).all() and torch.isfinite(q.float()).all()


def _operands(m, k, n, dtype_a, seed):
    a = _rows(m, k, seed)
    b = _rows(n, k, seed + 1)  # b's columns are the rows of b^T
    qa, sa, _, _ = quantize_fp8_rowwise(a, dtype_a)
    qb, sb, _, _ = quantize_fp8_rowwise(b, E4M3)
    return qa, qb.t(), sa, sb.t()


@pytest.mark.parametrize("shape", [(7, 32, 5), (37, 32, 24), (5, 3, 2)])
@pytest.mark.parametrize("dtype_a", [E4M3, E5M2])
def test_rowwise_gemm_emulation_is_bit_exact(shape, dtype_a):
    m, k, n = shape
    qa, qb, sa, sb = _operands(m, k, n, dtype_a, m + k)
    out = scaled_mm_rowwise(qa, qb, sa, sb, backend="emulated")
    ref = rowwise_gemm_reference(qa.view(torch.uint8).numpy(), dtype_a,
                                 qb.view(torch.uint8).numpy(), E4M3,
                                 sa[:, 0].numpy(), sb[0].numpy())  # fmt: skip
    assert out.dtype == torch.float32 and out.shape == (m, n)
    assert out.tolist() == ref.tolist()  # every element, every bit (and -0.0 == 0.0)
    assert not out[m // 2].any() and not out[:, n // 2].any()  # the zero row and column


def test_rowwise_gemm_checks_its_arguments():
    qa, qb, sa, sb = _operands(4, 8, 3, E4M3, 0)
    with pytest.raises(ValueError, match=r"^scale_a, scale_b: expected \[4, 1\] and \[1, 3\]"):
        scaled_mm_rowwise(qa, qb, sb.t(), sa.t(), backend="emulated")
    with pytest.raises(ValueError, match="^a, b: expected an E4M3/E5M2 a and an E4M3 b"):
        scaled_mm_rowwise(qa, qb.to(E5M2), sa, sb, backend="emulated")
    with pytest.raises(ValueError, match=r"^a, b: expected \[M, K\] and \[K, N\]"):
        scaled_mm_rowwise(qa, qb.t(), sa, sb, backend="emulated")


def test_one_huge_row_flushes_the_others_per_tensor_but_not_row_wise():
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(16, 32, generator=gen) * 1e-3
    x[0] *= 1e6  # one sample with activations ~1e3
    per_tensor, inv, _, _ = quantize_fp8(x, fp8_scale(x.abs().max(), E4M3), E4M3)
    # 448 / amax ~ 0.1 puts the small rows at ~1e-4, below E4M3's smallest subnormal 2^-9 / 2.
    assert not per_tensor[1:].float().any()
    rowwise, inv_rows, _, _ = quantize_fp8_rowwise(x, E4M3)
    rows = (rowwise.float() * inv_rows).double()
    error = (rows - x.double()).norm(dim=1) / x.double().norm(dim=1)
    # E4M3 keeps 3 fraction bits: a relative error of at most 2^-4 per normal element.
    assert (rowwise.float() != 0).all() and (error <= 2.0**-4).all(), error.max()


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_rowwise_spread_against_per_element_counts(dtype):
    x = _rows(23, 32, 9) * 1e-2  # rows 1e-7 .. 1e1: the small ones flush under one scale
    x[3, 5] = math.inf  # a non-finite row is left out of the spread and of the tensor scale
    _, _, amax, used = quantize_fp8_rowwise(x, dtype)
    spread, flushed = rowwise_spread(x, used, amax, dtype).tolist()
    fp8_max = 448.0 if dtype == E4M3 else 57344.0
    live = [i for i in range(23) if i not in (3, 11)]  # 11: the zero row
    scales = [np.float32(fp8_max) / np.float32(max(abs(v) for v in x[i].tolist())) for i in live]
    assert spread == pytest.approx(math.log2(max(scales) / min(scales)), rel=1e-6)
    top = max(max(abs(v) for v in x[i].tolist()) for i in live)
    scale = np.float32(np.float32(fp8_max) / np.float32(top))
    values = [v for row in x.tolist() for v in row if v != 0]
    zeros = sum(fp8_code(float(np.float32(v) * scale), dtype) & 0x7F == 0
                for v in values if math.isfinite(v))  # fmt: skip
    assert zeros > 0 and flushed == pytest.approx(zeros / len(values), abs=1e-7)
    # One row: no spread.
    one = x[:1]
    _, _, amax1, used1 = quantize_fp8_rowwise(one, dtype)
    assert rowwise_spread(one, used1, amax1, dtype)[0].item() == 0.0


def test_rowwise_non_finite_rows_become_nan_and_stay_in_their_rows():
    x = _rows(6, 32, 7)
    clean_q, clean_inv, _, _ = quantize_fp8_rowwise(x, E4M3)
    bad = x.clone()
    bad[1, 4], bad[4, 9] = math.inf, math.nan
    q, scale_inv, amax, _ = quantize_fp8_rowwise(bad, E4M3)
    assert torch.isnan(q.float()[1, 4]) and torch.isnan(q.float()[4, 9])
    assert not torch.isfinite(amax[[1, 4]]).any()
    keep = [0, 2, 3, 5]  # the zero row (3) included
    assert torch.equal(q[keep].view(torch.uint8), clean_q[keep].view(torch.uint8))
    w, w_inv, _, _ = quantize_fp8_rowwise(_rows(5, 32, 8), E4M3)
    out = scaled_mm_rowwise(q, w.t(), scale_inv, w_inv.t(), backend="emulated")
    assert torch.isnan(out[[1, 4]]).all() and torch.isfinite(out[keep]).all()
    assert not torch.isinf(out).any()


@pytest.mark.parametrize("margin", [0, 2])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_rowwise_statistics_count_a_nonfinite_row_and_never_an_overflow(dtype, margin):
    """Where every row is finite, each row's used scale is its recipe scale bit for bit (so
    the smallest of either stands for both in the statistics); a row holding an inf is counted
    as non-finite, not as an overflow."""
    from mptex._fp8_fused import fp8_quantize_reference

    x = _rows(12, 32, 21) * 10.0 ** torch.linspace(-30, 30, 12)[:, None]  # 1e-33 .. 1e31
    x[3] = 1e-42  # a subnormal row: fp8_max / amax overflows, the recipe keeps 1
    x[5, 7] = 3.0e38  # the largest finite magnitudes
    empty = torch.empty(0)
    outputs = fp8_quantize_reference(x, empty, empty, int(dtype == E5M2), 2, margin, False,
                                     False, dtype)  # fmt: skip
    _, _, amax, used, recipe_scale, *_ = outputs
    assert torch.isfinite(amax).all() and torch.equal(used, recipe_scale)
    assert (used == 1.0).sum() >= 2  # the zero and the subnormal rows kept 1
    state = ScalingState(dtype, ScalingRecipe("rowwise", margin=margin), None)
    state.quantize(x, True)
    assert state.overflows.item() == 0.0 and state.nonfinite.item() == 0.0
    assert state.last_scale.item() == used.min().item() and state.calls.item() == 1.0
    x[8, 0] = float("inf")
    _, _, amax, used, recipe_scale, *_ = fp8_quantize_reference(
        x, empty, empty, int(dtype == E5M2), 2, margin, False, False, dtype)  # fmt: skip
    assert used[8].item() == 0.0 and recipe_scale[8].item() == 1.0  # only that row differs
    keep = torch.arange(12) != 8
    assert torch.equal(used[keep], recipe_scale[keep])
    state.quantize(x, True)
    assert state.overflows.item() == 0.0 and state.nonfinite.item() == 1.0
    assert state.last_scale.item() == 0.0 and state.calls.item() == 2.0


@pytest.mark.parametrize("kernel", ["twin", "op"])
def test_rowwise_statistics_come_from_the_quantisation(kernel):
    """A recording row-wise call returns its per-tensor statistics, (largest row amax, smallest
    used scale), hand-computed here: rows of amax 2, 8 and 0 use 448 / 2, 448 / 8 and 1 (a zero
    row keeps 1); a NaN row makes the first NaN, an inf row makes it inf and the second 0 (its
    used scale); no rows give a zero tensor's (0, 1); a call that does not record returns
    none."""
    from mptex._fp8_fused import fp8_quantize_reference

    quantize = fp8_quantize_reference if kernel == "twin" else torch.ops.mptex.fp8_quantize
    empty = torch.empty(0)

    def statistics(x, record=True):
        return quantize(x, empty, empty, 0, 2, 0, False, record, E4M3)[5]

    x = torch.tensor([[1.0, -2.0], [-8.0, 0.5], [0.0, 0.0]])
    assert statistics(x).tolist() == [8.0, 1.0]
    assert statistics(x[:2]).tolist() == [8.0, 56.0]
    assert statistics(x, record=False).shape == (0,)
    nan, inf = x.clone(), x.clone()
    nan[1, 1], inf[0, 0] = float("nan"), float("inf")
    top, low = statistics(nan).tolist()
    assert math.isnan(top) and low == 1.0
    assert statistics(inf).tolist() == [float("inf"), 0.0]
    assert statistics(torch.empty(0, 2)).tolist() == [0.0, 1.0]
    assert statistics(torch.empty(3, 0)).tolist() == [0.0, 1.0]  # zero rows: amax 0, scale 1


def test_rowwise_fp8_layer_records_an_empty_batch_as_a_zero_tensor():
    """No rows (a batch that covers no pixel): the layer's output and gradients are empty or
    zero, and each state records one call with a zero tensor's amax and scale."""
    x = torch.empty(0, 32, requires_grad=True)
    w = (_rows(8, 32, 10) * 0.3).requires_grad_()
    r = ScalingRecipe("rowwise")
    states = (ScalingState(E4M3, r, None), ScalingState(E4M3, r, None), ScalingState(E5M2, r, None))
    for state in states:
        state.collect = True
    y = fp8_linear(x, w, None, states, backend="emulated")
    assert y.shape == (0, 8)
    grad_x, grad_w = torch.autograd.grad(y.sum(), (x, w))
    assert grad_x.shape == (0, 32) and not torch.count_nonzero(grad_w)
    x_state = states[0]
    assert x_state.calls.item() == 1.0 and x_state.nonfinite.item() == 0.0
    assert x_state.last_amax.item() == 0.0 and x_state.last_scale.item() == 1.0
    assert x_state.last_rowwise.tolist() == [0.0, 0.0]


def test_rowwise_fp8_linear_quantises_each_gemm_along_its_reduced_axis():
    """Forward, input and weight gradients bit for bit against the per-element reference, each
    operand scaled per index its GEMM does not reduce over (module docstring)."""
    x = _rows(19, 32, 9).requires_grad_()
    w = (_rows(8, 32, 10) * 0.3).requires_grad_()
    g = _rows(19, 8, 11) * 1e-5  # training-sized cotangent
    r = ScalingRecipe("rowwise")
    states = (ScalingState(E4M3, r, None), ScalingState(E4M3, r, None), ScalingState(E5M2, r, None))
    y = fp8_linear(x, w, None, states, backend="emulated")
    grad_x, grad_w = torch.autograd.grad((y * g).sum(), (x, w))
    xn, wn, gn = x.detach().numpy(), w.detach().numpy(), g.numpy()

    def product(a, dtype_a, b_t):  # a [M, K] per row, b_t [N, K] per row (columns of b)
        ca, sa = rowwise_codes(a, dtype_a)
        cb, sb = rowwise_codes(b_t, E4M3)
        return rowwise_gemm_reference(ca, dtype_a, cb.T, E4M3, sa, sb)

    assert y.tolist() == product(xn, E4M3, wn).tolist()  # X per sample, W per output channel
    assert grad_x.tolist() == product(gn, E5M2, wn.T).tolist()  # dY per sample, W per input
    assert grad_w.tolist() == product(gn.T, E5M2, xn.T).tolist()  # both per channel
    # The statistics are per tensor: the largest row amax.
    assert states[0].last_amax.item() == x.abs().max().item()


def test_rowwise_qat_rounds_inputs_per_row_with_a_straight_through_gradient():
    from mptex.quantize import fake_quantize, fake_quantize_input

    x = _rows(12, 32, 12).reshape(3, 4, 32).requires_grad_()
    y = fake_quantize_input(x, "fp8_rowwise")
    codes, inverse = rowwise_codes(x.detach().reshape(12, 32).numpy(), E4M3)
    expected = [[float(np.float32(np.float32(fp8_value(int(c), E4M3)) * inverse[i]))
                 for c in row] for i, row in enumerate(codes)]  # fmt: skip
    assert y.reshape(12, 32).tolist() == expected
    g = torch.randn(3, 4, 32)
    y.backward(g)
    assert torch.equal(x.grad, g)
    assert fake_quantize_input(x, "fp8") is x and fake_quantize_input(x, "int8") is x
    w = _rows(8, 32, 13)
    assert torch.equal(fake_quantize(w, "fp8_rowwise"),
                       fake_quantize_input(w, "fp8_rowwise"))  # per output channel  # fmt: skip


@pytest.mark.parametrize("arm", ["fp8_rowwise", "fp8_rowwise_qat"])
def test_rowwise_arms_train_on_the_cpu(arm):
    from mptex import MLPTexture3D

    torch.manual_seed(0)
    texture = MLPTexture3D(torch.tensor([[0.0] * 3, [1.0] * 3]), precision=arm, backend="torch",
                           encoder={"otype": "HashGrid", "n_levels": 4, "n_features_per_level": 2,
                                    "log2_hashmap_size": 12, "base_resolution": 4,
                                    "per_level_scale": 2.0})  # fmt: skip
    optimizer = torch.optim.Adam(texture.parameters(), lr=1e-2)
    stepper = PrecisionStepper(texture.policy, optimizer)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(30):
        p = torch.rand(1024, 3, generator=gen)
        target = torch.stack([p[:, 0], p[:, 1] * p[:, 2], 0.5 + 0.0 * p[:, 0]], dim=1)
        optimizer.zero_grad()
        loss = (texture.sample(p) - target).square().mean()
        result = stepper(loss)
        assert not result.skipped
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-5:]) < 0.5 * sum(losses[:5]), losses
    assert all(torch.isfinite(p).all() for p in texture.parameters())


def test_the_gpu_kits_rowwise_comparison_runs_here():
    """benchmarks/gpu/fp8_rowwise.py as a script on the CPU: the emulation within its bound,
    no hardware entries."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    script = root / "benchmarks" / "gpu" / "fp8_rowwise.py"
    done = subprocess.run([sys.executable, str(script), "--device", "cpu", "--n", "64",
                           "--repeats", "1"], cwd=root, capture_output=True, text=True,
                          check=True)  # fmt: skip
    rows = json.loads(done.stdout)
    assert [r["case"] for r in rows] == [
        "forward, hidden layer", "forward, output layer", "input gradient",
        "input gradient, output layer", "weight gradient", "weight gradient, output layer",
    ]  # fmt: skip
    # the rows are not a multiple of 16 (the covered pixels are any number)
    assert rows[0]["shape"] == "69 x 32 x 32" and rows[4]["shape"] == "32 x 69 x 32"
    assert all(r["ok"] and r["emulated_err"] <= r["emulated_bound"] for r in rows), rows
    assert all(r["scaled_mm_err"] is None and r["bit_equal_frac"] is None for r in rows)


def _quantize_calls(monkeypatch) -> list:
    """Counts the quantisation op's calls made through mptex.fp8."""
    import mptex.fp8 as fp8_module

    calls, original = [], fp8_module.fp8_quantize

    def counted(*args):
        calls.append(args[4])  # the recipe code
        return original(*args)

    monkeypatch.setattr(fp8_module, "fp8_quantize", counted)
    return calls


@pytest.mark.parametrize("recipe", ["current", "rowwise"])
def test_a_weights_state_reuses_its_quantisation_until_the_weight_changes(monkeypatch, recipe):
    calls = _quantize_calls(monkeypatch)
    w = torch.nn.Parameter(_rows(8, 32, 3))
    state = ScalingState(E4M3, ScalingRecipe(recipe), None)
    state.reuse = True
    first = state.quantize(w, True)
    again = state.quantize(w, True)
    assert len(calls) == 1 and all(a is b for a, b in zip(first, again, strict=True))
    assert state.calls.item() == 2  # counted as two calls, as without reuse
    state.quantize(w, False)  # a forward without autograd neither uses nor keeps it
    assert len(calls) == 2
    for change in (
        lambda: w.data.mul_(1.0),  # no version bump, but end_reuse (each backward) ends it
        lambda: None,
    ):
        state.end_reuse()
        change()
        state.quantize(w, True)
    assert len(calls) == 4
    with torch.no_grad():
        w.add_(1.0)  # in place: a new version
    moved = state.quantize(w, True)
    assert len(calls) == 5 and not torch.equal(moved[0].float(), first[0].float())
    w.data = w.data.clone()  # new storage, same object and version
    state.quantize(w, True)
    state.quantize(w.detach(), True)  # another object
    assert len(calls) == 7


def test_the_delayed_recipe_never_reuses(monkeypatch):
    calls = _quantize_calls(monkeypatch)
    w = _rows(8, 32, 4)
    state = ScalingState(E4M3, ScalingRecipe("delayed"), None)
    state.reuse = True
    state.quantize(w, True)
    state.quantize(w, True)  # its scale moved with the first call's amax
    assert len(calls) == 2


@pytest.mark.parametrize("recipe", ["current", "rowwise"])
def test_fp8_layers_two_forwards_one_backward_same_bits_with_and_without_reuse(recipe):
    # The training loop's pattern: two forwards (render, smoothness term), one backward.
    torch.manual_seed(0)
    layers = [FP8Linear(32, 8, recipe=ScalingRecipe(recipe), gemm_backend="emulated")
              for _ in range(2)]  # fmt: skip
    layers[1].load_state_dict(layers[0].state_dict())
    layers[1].scaling["weight"].reuse = False
    for layer in layers:
        for state in layer.scaling.values():
            state.collect = True
    x1, x2 = _rows(19, 32, 5), _rows(23, 32, 6)
    results = []
    for layer in layers:
        loss = (layer(x1) * _rows(19, 8, 7) * 1e-3).sum() + (layer(x2) ** 2).sum()
        loss.backward()
        stats = {role: {k: v.clone() for k, v in layer.scaling[role].state_dict().items()}
                 for role in layer.ROLES}  # fmt: skip
        results.append((layer.weight.grad.clone(), layer.bias.grad.clone(), stats))
    (gw0, gb0, s0), (gw1, gb1, s1) = results
    assert torch.equal(gw0, gw1) and torch.equal(gb0, gb1)
    for role in FP8Linear.ROLES:
        for name, value in s0[role].items():
            assert torch.equal(value, s1[role][name]) or (
                value.isnan().all() and s1[role][name].isnan().all()
            ), (role, name)
    assert s0["weight"]["calls"].item() == 2


@pytest.mark.parametrize(
    "dtype, values, codes",
    [
        # E4M3: 448 is 0x7E; 464 is the tie between 448 and the NaN slot above it (to even:
        # 448); past it, and at infinity, saturated; NaN keeps its sign in 0x7F.
        (E4M3, [448.0, 464.0, 465.0, 1e30, math.inf, -math.inf, -500.0, math.nan],
         [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0xFE, 0x7F]),
        # E5M2: 57344 is 0x7B; 61440 is the tie between it and infinity (to even: 0x7C, inf),
        # so E5M2 overflows to infinity rather than saturating.
        (E5M2, [57344.0, 61439.0, 61440.0, 1e30, -math.inf],
         [0x7B, 0x7B, 0x7C, 0x7C, 0xFC]),
    ],
)  # fmt: skip
def test_the_eager_cast_saturates_e4m3_on_every_torch_build(dtype, values, codes):
    # torch's own float32 -> float8_e4m3fn cast saturates from torch 2.13 on and gives NaN past
    # 464 before; the eager quantisation clamps first, as the C and Triton kernels saturate,
    # so these codes hold whichever torch runs them.
    from mptex._fp8_scaling import _to_fp8

    q = _to_fp8(torch.tensor(values, dtype=torch.float32), dtype)
    assert q.view(torch.uint8).tolist() == codes
