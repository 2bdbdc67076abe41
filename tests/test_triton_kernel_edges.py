"""Edge cases of the grid encoding's and the training loss's Triton kernels, run under Triton's
CPU interpreter in ONE subprocess (tests/triton_kernel_edges_interpreted.py).

What is checked, and against what:
- more points than one program's block (1024 under the interpreter) and not a multiple of it:
  forward and input gradient bit for bit against the torch twin, the parameter gradient within
  the float32 atomic-order bound of tests/test_encoding_triton.py;
- a frozen table (input gradient only) and frozen points (parameter gradient only): the wanted
  gradient as the twin's, the frozen tensor left unchanged, none for it; an empty batch;
- half mode's per-corner fused multiply-add rounded once, on two sums that lie within a float32
  rounding of a half midpoint: hand-computed values and the brute-force Fraction reference of
  tests/grid_reference.py;
- NaN table entries in bfloat16 mode, whatever their payload, give NaN (IEEE: NaN times a weight
  plus anything is NaN), as torch's rounding to bfloat16 keeps a NaN;
- the refusals of bad arguments, each one line naming the argument: a geometry whose hashed
  levels do not follow the dense ones, an output dtype outside the three modes, the loss
  kernels' shapes and dtypes.
Compiled for sm_80 (no GPU needed): the floored positions become cells through a signed 64-bit
integer, so that negative cells wrap around as uint32 values (tcnn's cast) where PTX's direct
conversion to uint32 would saturate them to 0; on a CUDA device (skipped elsewhere), points
outside [0, 1] against the twin.
"""

import numpy as np
import pytest
import torch
from test_encoding import _reference
from test_encoding_triton import _param_gradient_bound, _twin_results
from triton_subprocess import check_compiles, run_cases

import mptex
from mptex import HashGridEncoding
from mptex._grid_torch import grid_geometry

pytestmark = pytest.mark.requires_triton

# 2-d, a dense level then a hashed one, two features: small enough for the interpreter.
SMALL = dict(n_levels=2, n_features_per_level=2, log2_hashmap_size=6, base_resolution=4,
             per_level_scale=3.0)  # fmt: skip
# One 5 x 5 dense level (scale 4: position 4 x + 0.5), one feature.
DENSE_5 = dict(n_levels=1, n_features_per_level=1, log2_hashmap_size=10, base_resolution=5,
               per_level_scale=2.0)  # fmt: skip


def _grid_case(name, x, dtype=torch.float32, kwargs=SMALL, params=None, v=None, seed=0,
               want_x=True, want_params=True):  # fmt: skip
    enc = HashGridEncoding(2, backend="torch", dtype=dtype, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    if params is None:
        params = torch.rand(enc.n_params, generator=gen) * 2 - 1
    if v is None:
        v = torch.randn(x.shape[0], enc.n_output_dims, generator=gen)
    return dict(kind="grid", name=name, n_dims=2, kwargs=kwargs, dtype=dtype, x=x,
                params=params, v=v, want_x=want_x, want_params=want_params)  # fmt: skip


def _points(n, seed):
    return torch.rand(n, 2, generator=torch.Generator().manual_seed(seed))


def _from_bits(bits):
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


# Half mode: tcnn's result = fma((half)weight, value, result), each corner rounded once to half.
# A point of the 5 x 5 level at position (cell + f, 2.0) has weights (1 - f, f, 0, 0): the
# result after corner 1 is half(f * v1 + acc), acc the half result of corner 0.
U = 2.0**-10  # half's ulp at 1
HALF_FMA_POINTS = {
    # f = (1 + 31 u) 2^-5, v1 = (1 - 30 u) 2^-6, acc = 1: f v1 = (1 + u - 930 u^2) 2^-11
    # = 2^-11 + 94 * 2^-31, so the exact sum 1 + 2^-11 + 94 * 2^-31 is above the midpoint
    # 1 + 2^-11 of 1 and 1 + 2^-10 and rounds up to 1 + 2^-10; rounded to float32 first it is
    # the midpoint itself (94 * 2^-31 < 2^-24, half a float32 ulp), which ties down to 1.
    "up": (1, 2, (1 + 31 * U) * 2**-5, (1 - 30 * U) * 2**-6, 1.0),
    # f = (1 + 15 u) 2^-5, v1 = (1 - 15 u) 2^-6, acc = 1 + 2^-10: f v1 = 2^-11 - 225 * 2^-31,
    # the exact sum 1 + 3 * 2^-11 - 225 * 2^-31 is below the midpoint 1 + 3 * 2^-11 and rounds
    # down to 1 + 2^-10; rounded to float32 it is the float32 just below the midpoint, and
    # one float32 ulp up is the midpoint itself, which ties (to even) up to 1 + 2^-9.
    "down": (3, 1, (1 + 15 * U) * 2**-5, (1 - 15 * U) * 2**-6, 1.0 + U),
}


def _half_fma_case():
    """Two points whose half-mode outputs are both 1 + 2^-10 (HALF_FMA_POINTS), and a third at
    the centre of cell (0, 0)."""
    table = torch.full((32,), 0.25)
    xs = []
    for cell0, cell1, f, v1, acc in HALF_FMA_POINTS.values():
        # position 4 x + 0.5: x0 = (cell0 - 0.5 + f) / 4 and x1 = (cell1 - 0.5) / 4 are exact
        xs.append([(cell0 - 0.5 + f) / 4, (cell1 - 0.5) / 4])
        row = cell0 + 5 * cell1  # corner 0; corner 1 is the next entry
        w0 = np.float16(1 - f)  # corner 0's weight, rounded to half (1 - f is exact)
        # a half table value v0 whose product with w0 rounds to acc in half
        up = down = np.float16(acc / float(w0))
        candidates = [up]
        for _ in range(4):
            up, down = np.nextafter(up, np.float16(2)), np.nextafter(down, np.float16(0))
            candidates += [up, down]
        v0 = next(v for v in candidates if np.float16(float(w0) * float(v)) == acc)
        table[row], table[row + 1] = float(v0), v1
    xs.append([0.0, 0.0])
    return _grid_case("half-fma", torch.tensor(xs), torch.float16, DENSE_5, table)


NAN_BITS = (0x7FFFFFFF, 0x7F800001, 0xFFFFFFFF)  # largest payload, signalling, negative


def _nan_table_case():
    """bfloat16 mode, the 5 x 5 level with three NaN entries of unusual payloads."""
    table = 1 + torch.arange(32, dtype=torch.float32) / 16  # exact in bfloat16
    table[[6, 12, 18]] = _from_bits(list(NAN_BITS))
    # positions (4 x + 0.5): (1.5, 1.5) reads 6, 7, 11, 12; (2.0, 3.5) reads 17, 18 (weight
    # 0 for 18 along dim 0 frac 0: NaN * 0 is NaN), 22, 23; (0.5, 3.0) reads 15, 16 only
    # (weights 1/2, 1/2, then 0 for 20, 21), no NaN.
    x = torch.tensor([[0.25, 0.25], [0.375, 0.75], [0.0, 0.625]])
    return _grid_case("bf16-nan", x, torch.bfloat16, DENSE_5, table, want_x=False)


def _grid_cases():
    x = _points(1500, 3)
    x[1499] = 1.0  # the last point, in the second program, at the top corner
    return [
        _grid_case("many-points", x),
        _grid_case("frozen-table", _points(40, 4), want_params=False),
        _grid_case("frozen-points", _points(40, 5), want_x=False),
        _grid_case("frozen-table-half", _points(40, 6), torch.float16, want_params=False),
        _grid_case("empty", torch.zeros(0, 2)),
        _half_fma_case(),
        _nan_table_case(),
    ]


KD_PIXELS = 100


def _kd_order_grad():
    """A float32 G near 100 for which (G * (1/pixels)) * (1/3) and (G * (1/3)) * (1/pixels),
    float32 reciprocals, round apart."""
    f = np.float32
    for k in range(1000):
        g = f(100.0 + k / 7.0)
        if (g * (f(1) / f(KD_PIXELS))) * (f(1) / f(3)) != (g * (f(1) / f(3))) * (
            f(1) / f(KD_PIXELS)
        ):
            return g
    raise AssertionError("no distinguishing gradient")


def _kd_order_case():
    gen = torch.Generator().manual_seed(9)
    tex = torch.rand(50, 4, generator=gen)
    tex_jitter = tex + torch.randn(50, 4, generator=gen) * 0.01
    grad = torch.tensor(float(_kd_order_grad()))
    return dict(kind="kd_call", name="kd-reciprocal-order", function="kd_grad",
                args=(tex, tex_jitter, grad, KD_PIXELS, True))  # fmt: skip


def _call_cases():
    f32 = torch.float32
    shrinking = (2, 3, 2, 6, 64, 0.3)  # per_level_scale < 1: a hashed level, then dense ones
    grid = dict(kind="grid_call", x=torch.rand(4, 2))
    n_shrinking = grid_geometry(*shrinking).n_params
    pred, rgba, bg = torch.rand(2, 5, 3), torch.rand(2, 5, 4), torch.rand(2, 5, 3)
    tex = torch.rand(10, 4)
    return [
        dict(grid, name="shrinking-levels", geometry=shrinking, out_dtype=f32,
             params=torch.zeros(n_shrinking)),
        dict(grid, name="float64-output", geometry=(2, 1, 1, 10, 5, 2.0), out_dtype=torch.float64,
             params=torch.zeros(32)),
        dict(kind="loss_call", name="pred-4-channels", function="loss_partials",
             args=(torch.rand(2, 5, 4), rgba, torch.rand(2, 5, 4), True)),
        dict(kind="loss_call", name="rgba-float64", function="loss_grad",
             args=(pred, rgba.double(), bg, torch.tensor(1.0), True, False)),
        dict(kind="kd_call", name="kd-shapes", function="kd_partials",
             args=(tex, torch.rand(10, 3))),
        dict(kind="kd_call", name="kd-float64", function="kd_grad",
             args=(tex, tex.double(), torch.tensor(1.0), 40, False)),
        _kd_order_case(),
    ]  # fmt: skip


def _cases():
    return _grid_cases() + _call_cases()


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """{case name: (case, results)} from one interpreter subprocess."""
    if not mptex.has_triton():
        pytest.skip("needs triton importable")
    cases = _cases()
    results = run_cases("triton_kernel_edges_interpreted.py", cases,
                        tmp_path_factory.mktemp("edges"), 300)  # fmt: skip
    return {case["name"]: (case, results[case["name"]]) for case in cases}


def _twin(case):
    """The twin's out, grad_x, grad_params, and sum |contributions| per entry."""
    full = dict(case, want_x=True)
    _, out, grad_x, grad_params, grad_abs = _twin_results(full)
    return out, grad_x, grad_params, grad_abs


def _bits(t):
    return t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def _assert_param_gradient_within_bound(case, got, twin_grad, grad_abs):
    enc = HashGridEncoding(2, backend="torch", dtype=case["dtype"], **case["kwargs"])
    bound = _param_gradient_bound(enc, case, grad_abs, twin_grad)  # atomic order only
    assert ((got.double() - twin_grad.double()).abs() <= bound).all()


# ------------------------------------------------------------------------------- the grid
@pytest.mark.slow
def test_points_beyond_one_block_are_all_encoded(interpreted):
    case, result = interpreted["many-points"]
    out, grad_x, grad_params, grad_abs = _twin(case)
    assert result["out"].shape == (1500, 4)
    # the kernels do the twin's float32 operations in its order: bit for bit
    assert torch.equal(_bits(result["out"]), _bits(out))
    assert torch.equal(_bits(result["grad_x"]), _bits(grad_x))
    _assert_param_gradient_within_bound(case, result["grad_params"], grad_params, grad_abs)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["frozen-table", "frozen-table-half"])
def test_frozen_table_gets_input_gradient_only_and_stays_unchanged(interpreted, name):
    case, result = interpreted[name]
    out, grad_x, _, _ = _twin(case)
    assert torch.equal(_bits(result["out"]), _bits(out))
    assert torch.equal(_bits(result["grad_x"]), _bits(grad_x))
    assert result["grad_params"] is None
    assert torch.equal(_bits(result["params"]), _bits(case["params"]))


@pytest.mark.slow
def test_frozen_points_get_no_gradient_and_stay_unchanged(interpreted):
    case, result = interpreted["frozen-points"]
    out, _, grad_params, grad_abs = _twin(case)
    assert torch.equal(_bits(result["out"]), _bits(out))
    assert result["grad_x"] is None
    assert torch.equal(_bits(result["x"]), _bits(case["x"]))
    _assert_param_gradient_within_bound(case, result["grad_params"], grad_params, grad_abs)


@pytest.mark.slow
def test_empty_batch_gives_empty_output_and_zero_gradients(interpreted):
    _, result = interpreted["empty"]
    assert result["out"].shape == (0, 4) and result["out"].dtype == torch.float32
    assert result["grad_x"].shape == (0, 2)
    assert result["grad_params"].abs().sum() == 0


@pytest.mark.slow
def test_half_mode_rounds_each_corner_fma_once(interpreted):
    case, result = interpreted["half-fma"]
    out = result["out"]
    assert out.dtype == torch.float16
    # Both sums round to 1 + 2^-10 (see HALF_FMA_POINTS); the third point is a cell centre:
    # 0.25 * 4 entries of 0.25, all exact.
    expected = torch.tensor([[1 + U], [1 + U], [0.25]], dtype=torch.float16)
    assert torch.equal(_bits(out), _bits(expected))
    # The brute-force reference (tests/grid_reference.py: exact rationals rounded once per fma)
    enc = HashGridEncoding(2, backend="torch", dtype=torch.float16, **case["kwargs"])
    with torch.no_grad():
        enc.params.copy_(case["params"])
    reference, _ = _reference(enc, case["x"], half=True)
    assert torch.equal(reference.half(), expected)
    # The first sum needs the single rounding: rounded to float32 first, then to half, it is 1.
    assert torch.tensor(1 + 2**-11 + 94 * 2**-31, dtype=torch.float32).half().item() == 1.0
    # The second lies within one float32 ulp of a midpoint that ties up, to 1 + 2^-9.
    assert torch.tensor(1 + 3 * 2**-11, dtype=torch.float32).half().item() == 1 + 2 * U


@pytest.mark.slow
def test_nan_table_entries_give_nan_in_bfloat16_mode(interpreted):
    case, result = interpreted["bf16-nan"]
    out = result["out"].float()
    assert result["out"].dtype == torch.bfloat16
    assert torch.isnan(out[:2]).all()
    # (0.5, 3.0): entries 15 and 16, 1 + 15/16 and 1 + 16/16, weights 1/2: 1 + 31/32, exact
    # in bfloat16 (7 fraction bits)
    assert out[2].item() == 1 + 31 / 32
    twin, *_ = _twin(dict(case, want_params=True))
    assert torch.equal(torch.isnan(out), torch.isnan(twin.float()))


# ------------------------------------------------------------------------ the loss
@pytest.mark.slow
def test_smoothness_gradient_by_reciprocals_is_one_over_pixels_then_one_third(interpreted):
    # torch on CUDA runs kd = (sum(per point / 3)) / pixels backward as G * float32(1/pixels),
    # then * float32(1/3) per element (a division by a host scalar is a product by its float32
    # reciprocal there), then the sign of tex_jitter - tex: the float32 formula, per element.
    case, result = interpreted["kd-reciprocal-order"]
    tex, tex_jitter, grad, pixels, _ = case["args"]
    got_jitter, got_tex = result["value"]
    f = np.float32
    g = (f(grad.item()) * (f(1) / f(pixels))) * (f(1) / f(3))
    d = (tex_jitter - tex).numpy()
    want = np.where(d > 0, g, np.where(d < 0, -g, f(0))).astype(np.float32)
    want[:, 3:] = 0  # only kd, the first three channels
    assert torch.equal(got_jitter, torch.from_numpy(want))
    assert torch.equal(got_tex, torch.from_numpy(-want))
    # the case tells the two orders of the reciprocals apart
    assert g != (f(grad.item()) * (f(1) / f(3))) * (f(1) / f(pixels))


# ------------------------------------------------------------------- refusals of bad input
@pytest.mark.slow
@pytest.mark.parametrize(
    "name, message",
    [
        ("shrinking-levels", "ValueError: geometry: hashed levels must follow the dense ones"),
        ("float64-output", "ValueError: out_dtype: expected torch.float32, torch.float16 or "
                           "torch.bfloat16, got torch.float64"),
        ("pred-4-channels", "ValueError: pred: expected [..., 3], got [2, 5, 4]"),
        ("rgba-float64", "ValueError: rgba, background: expected float32, got torch.float64 and "
                         "torch.float32"),
        ("kd-shapes", "ValueError: tex, tex_jitter: expected two [N, C >= 3] of one shape, got "
                      "[10, 4] and [10, 3]"),
        ("kd-float64", "ValueError: tex, tex_jitter: expected float32, got torch.float32, "
                       "torch.float64"),
    ],
)  # fmt: skip
def test_bad_arguments_are_refused_in_one_line(interpreted, name, message):
    _, result = interpreted[name]
    assert "error" in result, result
    assert result["error"].startswith(message)
    assert "\n" not in result["error"]


# ------------------------------------------------------------- compiled, and on a GPU
@pytest.mark.slow
def test_negative_cells_wrap_in_the_compiled_kernels():
    check_compiles("triton_kernel_edges_interpreted.py", timeout=300)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_points_outside_the_unit_square_wrap_as_the_twin_on_cuda(dtype):
    # Negative positions floor to negative cells, which tcnn casts through a signed integer
    # to uint32 (wrapping to 2^32 - k); the kernels must not saturate them to 0.
    twin = HashGridEncoding(2, backend="torch", dtype=dtype, device="cuda", **SMALL)
    fast = HashGridEncoding(2, backend="triton", dtype=dtype, device="cuda", **SMALL)
    with torch.no_grad():
        twin.params.uniform_(-1, 1)
    fast.load_state_dict(twin.state_dict())
    x = torch.rand(4096, 2, device="cuda") * 2.4 - 0.7
    assert (x < 0).any()
    torch.testing.assert_close(fast(x), twin(x), rtol=0, atol=0)
