"""The torch hash grid against golden tensors of its first implementation (tests/golden/).

``tests/test_encoding.py`` checks the grid against the brute-force reference; these tests pin
the bits it returned before it was made faster (forward, dL/dx and the parameter gradient,
whose float32 sums depend on the order of the scatter), float32 and half mode, dense and hashed
levels, points outside [0, 1], Smoothstep, Nearest, 2-D to 4-D, more than one chunk of points,
at 1 and 2 torch threads, with its C kernel (mptex._native_cpu) and with its eager PyTorch ops.
"""

from __future__ import annotations

import golden_io
import pytest
import torch

import mptex._grid_torch as grid
from mptex._grid_torch import grid_geometry, hash_grid_encode

GOLDEN = golden_io.load("grid_torch.pt")
MAKE = golden_io.make_golden()


def _check(name: str, entry: dict) -> None:
    geometry = grid_geometry(**entry["geometry"])
    n_points, (low, high), dtype = entry["n_points"], entry["range"], entry["dtype"]
    params = MAKE.grid_params(geometry.n_params, entry["amplitude"])
    x = entry["x"]
    if x is None:
        x = MAKE.grid_points(n_points, geometry.n_input_dims, low, high)
        if low == 0.0 and high == 1.0:
            x[0], x[1] = 1.0, 0.0
    x = x.clone().requires_grad_(True)
    params.requires_grad_(True)
    out = hash_grid_encode(x, params, geometry, dtype)
    cotangent = MAKE.grid_cotangent(
        n_points, geometry.n_output_dims, 1e-3 if dtype == torch.float16 else 1.0
    )
    (out.float() * cotangent).sum().backward()
    golden_io.assert_same_bits(f"{name} out", out, entry["out"])
    golden_io.assert_same_bits(f"{name} grad_x", x.grad, entry["grad_x"])
    golden_io.assert_same_bits(f"{name} grad_params", params.grad, entry["grad_params"])


@pytest.fixture(params=golden_io.PATHS)
def ops(request, monkeypatch):
    """Compute the grid in the C kernel (default build, portable builds) or in eager
    PyTorch ops."""
    return golden_io.native_or_eager(request.param, grid, monkeypatch, pytest)


@pytest.mark.golden_bits
@pytest.mark.parametrize("name", list(GOLDEN))
def test_grid_reproduces_its_golden_bits(name, ops):
    if ops not in ("native", "eager") and GOLDEN[name]["n_points"] > 2000:
        pytest.skip("the portable builds' software half conversions are slow; same loops")
    _check(name, GOLDEN[name])


@pytest.mark.golden_bits
@pytest.mark.parametrize("name", ["cpu-texture-chunks-float32", "cpu-texture-chunks-float16"])
def test_grid_bits_do_not_depend_on_the_thread_count(name, ops):
    if ops not in ("native", "eager"):
        pytest.skip("one thread in any build of the C kernel")
    with golden_io.torch_threads(2):
        _check(name, GOLDEN[name])


@pytest.mark.parametrize("build", ["portable", "avx2"])
def test_the_kernels_vector_half_sums_equal_the_scalar_ones(build, monkeypatch):
    # The default build sums tcnn's half-mode corners for 8 points at a time where the CPU has
    # AVX-512; the portable and AVX2 builds one at a time. Same bits on tables of every class
    # of value: small and large, subnormal in half, signed zeros, values whose sums overflow
    # half, inf and NaN; point counts that leave scalar tails.
    from mptex import _native_cpu

    default, scalar = golden_io.default_and_scalar_kernels(build, grid, monkeypatch, pytest)
    geometry = grid_geometry(3, 6, 2, 12, 4, 1.6)
    gen = torch.Generator().manual_seed(0)
    for n_points, wild in [(1003, False), (517, True), (7, False)]:
        specials = [(0.0, 0.05), (-0.0, 0.02)]
        if wild:
            specials += [(60000.0, 0.03), (float("inf"), 0.005), (float("nan"), 0.005)]
        params = golden_io.edge_values((geometry.n_params,), gen, (-30, 10), torch.float32,
                                       specials)  # fmt: skip
        x = torch.rand(n_points, 3, generator=gen)
        want = _native_cpu.grid_forward_native(scalar, geometry, x, params, True)
        got = _native_cpu.grid_forward_native(default, geometry, x, params, True)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (n_points, wild)


def test_the_c_kernel_runs_on_float32_cpu_tensors_only():
    geometry = grid_geometry(3, 4, 2, 10, 4, 1.5)
    x = torch.rand(10, 3)
    params = torch.zeros(geometry.n_params)
    assert (grid._native(x, params, geometry, torch.float32) is not None) == (
        grid.native_kernels() is not None
    )
    assert grid._native(x.double(), params.double(), geometry, torch.float64) is None
    five_d = grid_geometry(5, 2, 2, 10, 4, 1.5)
    assert (
        grid._native(torch.rand(3, 5), torch.zeros(five_d.n_params), five_d, torch.float32) is None
    )


def test_fma_redoes_a_tie_that_double_rounding_gets_wrong():
    # scale * x + 0.5 with a product of 1.5 * 2^-24 * (1 - 2^-32): the exact sum lies just below
    # the float32 midpoint 0.5 + 1.5 * 2^-24, so fmaf rounds down to 0x1.000002p-1. The float64
    # sum rounds onto the midpoint itself and a second rounding (ties to even) goes up to
    # 0x1.000004p-1. With c = 0.5 the function redoes such ties only for products below 2^-6
    # (above, the float64 sum is exact): this one is.
    from grid_reference import fmaf

    a, b = 48 * (1 + 2**-16), (1 - 2**-16) * 2**-29
    got = grid._fma_f32(torch.tensor([a]), torch.tensor([b]), 0.5, nonnegative_product=True)
    assert got.item() == float(fmaf(a, b, 0.5)) == float.fromhex("0x1.000002p-1")


def _midpoint_cases(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(a, b, c)`` float32 whose exact ``a * b + c`` lies just below a float32 midpoint
    (the case of the test above, at other exponents, odd multiples and signs), with zeros,
    signed zeros and subnormal sums among them."""
    g = torch.Generator().manual_seed(5)
    j = torch.randint(-10, 10, (n,), generator=g).double()
    r = torch.randint(0, 1 << 22, (n,), generator=g).double()
    odd = (torch.randint(0, 8, (n,), generator=g) * 2 + 1).double()
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    a = (sign * odd * 16 * (1 + 2**-16)).float()
    b = ((1 - 2**-16) * 2 ** (j - 28)).float()
    c = (sign * 2**j * (1 + r * 2**-23)).float()
    c[::9], a[1::9] = 0.0, -0.0  # a product alone; a signed-zero product
    b[2::9], c[2::9] = 2.0**-140, 0.0  # a subnormal product and sum
    return a, b, c


def test_fma_helpers_round_once_and_never_synchronise():
    # The exact per-element value (fractions) against the twin's fmaf and __hfma2, with the
    # overhead counter watching: deciding on the device which elements to redo, instead of
    # reading back whether any need it, keeps a GPU's queue running (the torch grid calls
    # these once per corner).
    from grid_reference import fmaf, hfma

    from mptex.diagnostics.overhead import OverheadCounter

    a, b, c = _midpoint_cases(360)
    g = torch.Generator().manual_seed(6)
    half = [(torch.randn(len(a), generator=g) * 8).half().float() for _ in range(3)]
    half[2][::7], half[0][1::7] = 0.0, -0.0
    counter = OverheadCounter(torch.device("cpu"))
    with counter:
        got = grid._fma_f32(a, b, c)
        got_unit = grid._fma_f32(a.abs(), b, 0.5, nonnegative_product=True)
        got_half = grid._hfma(*half)
    assert sum(counter.syncs.values()) == 0, dict(counter.syncs)
    naive = (a.double() * b.double() + c.double()).float()
    assert (naive != got).any()  # the cases do need the second look
    for i in range(len(a)):
        x, y, z = a[i].item(), b[i].item(), c[i].item()
        assert got[i].item() == float(fmaf(x, y, z)), (x, y, z)
        assert got_unit[i].item() == float(fmaf(abs(x), y, 0.5)), (x, y)
        hx, hy, hz = (t[i].item() for t in half)
        assert got_half[i].item() == float(hfma(hx, hy, hz)), (hx, hy, hz)
    # Signs of zero as fmaf gives them: (-0) * b + 0 is +0, a * b + (-0) keeps the product's.
    assert torch.equal(got.view(torch.int32), torch.tensor(
        [float(fmaf(x, y, z)) for x, y, z in zip(a.tolist(), b.tolist(), c.tolist())]
    ).view(torch.int32))  # fmt: skip
