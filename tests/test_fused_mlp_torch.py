"""The fused-MLP twin against golden tensors of its first implementation (tests/golden/).

``tests/test_network.py`` checks the twin against the per-element reference of the arithmetic
model; these tests pin the twin's bits (tests/golden/make_golden.py wrote them), for every
activation, both accumulate modes, split-K with unequal slices, the padding paths and the
statistics, at 1 and 2 torch threads, with its C kernel (mptex._native_cpu) and with its eager
PyTorch loops.
"""

from __future__ import annotations

import itertools

import golden_io
import pytest
import torch

import mptex._fused_mlp_torch as twin
from mptex._fused_mlp_torch import FusedMLPSpec, fused_mlp

GOLDEN = golden_io.load("fused_mlp_twin.pt")
MAKE = golden_io.make_golden()


def _run(entry: dict):
    spec = FusedMLPSpec(**entry["spec"])
    rows = entry["rows"]
    if entry["x"] is not None:
        x, cotangent = entry["x"].float(), entry["cotangent"]
    else:
        x = MAKE.grid_points(rows, spec.n_input_dims)
        cotangent = MAKE.grid_cotangent(rows, spec.n_output_dims, 8 * entry["grad_scale"]).half()
    x = x.clone().requires_grad_(True)
    params = entry["params"].clone().requires_grad_(True)
    out = fused_mlp(x, params, spec)
    out.backward(cotangent)
    return spec, out, x.grad, params.grad


def _check(name: str, entry: dict) -> None:
    spec, out, grad_x, grad_params = _run(entry)
    golden_io.assert_same_bits(f"{name} out", out, entry["out"])
    golden_io.assert_same_bits(f"{name} grad_x", grad_x, entry["grad_x"])
    golden_io.assert_same_bits(f"{name} grad_params", grad_params, entry["grad_params"])
    if "stats" in entry:
        assert spec.stats == entry["stats"]


@pytest.fixture(params=golden_io.PATHS)
def loops(request, monkeypatch):
    """Run the twin's loops in the C kernel (default build, portable builds) or in eager
    PyTorch ops."""
    return golden_io.native_or_eager(request.param, twin, monkeypatch, pytest)


@pytest.mark.golden_bits
@pytest.mark.parametrize("name", list(GOLDEN))
def test_twin_reproduces_its_golden_bits(name, loops):
    _check(name, GOLDEN[name])


@pytest.mark.golden_bits
@pytest.mark.parametrize("name", ["texture-half", "split-k-texture", "split-k-float"])
def test_twin_bits_do_not_depend_on_the_thread_count(name, loops):
    if loops not in ("native", "eager"):
        pytest.skip("one thread in any build of the C kernel")
    with golden_io.torch_threads(2):
        _check(name, GOLDEN[name])


def _edge_halves(shape, gen, wild):
    """Half values over the binades 2^-24 to 2^4 (subnormals included) and signed zeros;
    ``wild`` adds the largest finite values (whose sums overflow the half accumulator to inf),
    inf and NaN."""
    specials = [(0.0, 0.08), (-0.0, 0.02)]
    if wild:
        specials += [(65504.0, 0.01), (float("inf"), 0.001), (float("nan"), 0.001)]
    return golden_io.edge_values(shape, gen, (-24, 5), torch.float16, specials)


@pytest.mark.parametrize("build", ["portable", "avx2"])
def test_the_kernels_vector_steps_equal_the_scalar_steps(build, monkeypatch):
    # The default build steps 8 outputs at a time where the CPU has AVX-512; the portable and
    # AVX2 builds step one at a time (the arithmetic model as written). Their bits agree on
    # every class of value, overflowing and non-finite accumulators included, at sizes with
    # vector parts and scalar tails (widths not a multiple of 8, a last k-block shorter).
    from mptex import _native_cpu

    default, scalar = golden_io.default_and_scalar_kernels(build, twin, monkeypatch, pytest)
    gen = torch.Generator().manual_seed(0)
    cases = [(37, 32, 32, 16), (53, 27, 19, 16), (29, 21, 16, 8), (8, 64, 9, 64)]
    for (n, k, m, k_block), wild in itertools.product(cases, (False, True)):
        a, b = _edge_halves((n, k), gen, wild), _edge_halves((k, m), gen, wild)
        want = _native_cpu.half_matmul_native(scalar, a, b, k_block, True)
        got = _native_cpu.half_matmul_native(default, a, b, k_block, True)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (n, k, m, wild)
        layers = [(_edge_halves((n, o), gen, wild), _edge_halves((n, i), gen, wild))
                  for o, i in [(16, 32), (3, 19), (32, 8)]]  # fmt: skip
        bounds = [(0, n // 3), (n // 3, n)]
        counts_want, counts_got = [None] * 3, [None] * 3
        want = _native_cpu.weight_grads_native(scalar, layers, bounds, 8, True, counts_want)
        got = _native_cpu.weight_grads_native(default, layers, bounds, 8, True, counts_got)
        for w, g in zip(want, got, strict=True):
            assert torch.equal(g.view(torch.int64), w.view(torch.int64)), (n, k, m, wild)
        assert counts_got == counts_want


def test_golden_covers_every_activation_and_switch():
    from mptex._fused_mlp_torch import ACTIVATIONS

    specs = [FusedMLPSpec(**entry["spec"]) for entry in GOLDEN.values()]
    assert {s.activation for s in specs} == set(ACTIVATIONS)
    assert {s.output_activation for s in specs} == set(ACTIVATIONS)
    assert {s.accumulate for s in specs} == {"half", "float"}
    assert {s.split_k for s in specs} == {True, False}


def test_the_c_kernel_can_be_turned_off(monkeypatch):
    from mptex import _native_cpu

    monkeypatch.setenv("MPTEX_NATIVE", "0")
    _native_cpu.native_kernels.cache_clear()
    try:
        assert _native_cpu.native_kernels() is None
    finally:
        _native_cpu.native_kernels.cache_clear()


def test_a_missing_compiler_falls_back_with_one_warning(monkeypatch, tmp_path):
    from mptex import _native_cpu

    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("MPTEX_CACHE_DIR", str(tmp_path))
    _native_cpu.native_kernels.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="C kernel.*eager PyTorch"):
            assert _native_cpu.native_kernels() is None
        spec = FusedMLPSpec(5, 3, 16, 1)
        x = torch.rand(40, 5)
        assert twin.fused_mlp(x, twin.xavier_uniform_params(spec), spec).shape == (40, 3)
    finally:
        _native_cpu.native_kernels.cache_clear()


@pytest.mark.golden_bits
@pytest.mark.parametrize("name", [a for a in twin.ACTIVATIONS if a not in ("None", "ReLU")])
def test_activations_do_not_depend_on_the_math_library(name):
    """Each activation equals the per-element reference (Python's ``math``, float64, rounded
    once to float32): the twin's bits do not come from the CPU's vector library (MKL's VML or
    Sleef pick their code path by CPU, so their float32 exp / sqrt / log / tanh differ in the
    last bit between CPUs). Every half value in [-12, 12) (exp's output stays finite)."""
    import fused_mlp_reference as ref

    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16)
    x = bits[bits.float().abs() < 12].contiguous()
    got = twin._activate(name, x)
    want = torch.tensor([ref.activation(name, v) for v in x.tolist()], dtype=torch.float16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    if name == "Softplus":  # its backward's exp
        out = got[got.isfinite()]
        factor = twin._activate_backward(name, torch.ones_like(out), out)
        want = [ref.activation_backward_factor(name, v) for v in out.tolist()]
        assert torch.equal(factor, torch.tensor(want, dtype=torch.float16))


def test_subnormal_factors_align_at_halfs_smallest_normal_exponent():
    # One row by one column, 16 products in one k-block: subnormal half factors (0x0001,
    # 0x8001, ...) share the exponent -14 of the smallest normal; taking -15 for them moves the
    # truncation point and the rounded sum ends one ulp off (0x826e). The C kernel states the
    # model independently of the eager ops.
    a = [0x80B6, 0x8000, 0x0004, 0x8001, 0x3992, 0x1B25, 0x80A2, 0x2C64,
         0x0008, 0x3900, 0xA827, 0xC74C, 0x0001, 0x1FA3, 0x1055, 0x8004]  # fmt: skip
    b = [0x800B, 0x4A97, 0x31A9, 0xEEE4, 0x05BB, 0x0CA9, 0x103A, 0x00C0,
         0xF324, 0x1C6F, 0x9901, 0x8C10, 0xF4BD, 0x3678, 0x801E, 0x0011]  # fmt: skip

    def halves(codes, shape):
        return torch.tensor(codes).to(torch.int16).view(torch.float16).view(shape)  # same bits

    a, b = halves(a, (1, 16)), halves(b, (16, 1))
    got = twin._half_matmul_eager(a, b, 16)
    assert got.view(torch.int16).item() & 0xFFFF == 0x826F
    lib = twin.native_kernels()
    if lib is not None:
        from mptex._native_cpu import half_matmul_native

        assert torch.equal(half_matmul_native(lib, a, b, 16, True).view(torch.int16),
                           got.view(torch.int16))  # fmt: skip
