"""HashGridEncoding(backend="triton") against the torch twin, under Triton's CPU interpreter.

The kernels run in ONE subprocess per module (tests/triton_interpreted.py, with
``TRITON_INTERPRET=1``): the interpreter is chosen when the kernels are decorated, so it cannot
be switched on safely inside a pytest process that may already have imported them. This
process builds the cases, computes the twin's results and compares.

What is claimed (mptex/_grid_triton.py states why):
- forward, float32, half and bfloat16 mode: bit-exact with the twin (the bound asked for
  float32 is 1e-6 absolute; the kernels do the twin's operations in its order, so it is 0; in
  bfloat16 mode the float32 sums are then the same bits, so their one rounding to bfloat16 is
  too: no one-bfloat16-ulp allowance is needed);
- input gradient: bit-exact (no atomics: levels are summed in order, as in the twin);
- parameter gradient: float32 atomics in any order; an entry with k contributions c_i differs
  from an ordered sum by at most (k - 1) 2^-24 sum |c_i|, so from the twin by twice that (the
  bfloat16 mode's backward is the float32 one on the cast dL/dy: the same bound).
"""

import pytest
import torch
from grid_reference import param_gradient
from test_encoding import NVDIFFREC_CONFIG, _reference
from triton_subprocess import check_compiles, run_cases

import mptex
from mptex import HashGridEncoding, MLPTexture3D
from mptex._grid_torch import hash_grid_encode

pytestmark = pytest.mark.requires_triton

N_POINTS = 48  # the interpreter runs each kernel op in Python: few points, few levels

# (name, n_dims, constructor kwargs). Small geometries that still have dense levels followed
# by hashed ones (checked in test_cases_cover_dense_and_hashed_levels).
CONFIGS = [
    ("3d-linear", 3, dict(n_levels=4, log2_hashmap_size=8, base_resolution=4, per_level_scale=1.8)),
    ("2d-linear", 2, dict(n_levels=5, log2_hashmap_size=6, base_resolution=4, per_level_scale=2.0)),
    (
        "3d-smoothstep",
        3,
        dict(
            n_levels=3,
            log2_hashmap_size=8,
            base_resolution=4,
            per_level_scale=1.9,
            interpolation="Smoothstep",
            n_features_per_level=4,
        ),
    ),
    (
        "3d-nearest",
        3,
        dict(
            n_levels=3,
            log2_hashmap_size=8,
            base_resolution=4,
            per_level_scale=1.9,
            interpolation="Nearest",
            n_features_per_level=1,
        ),
    ),
    (
        "2d-dense-grid",
        2,
        dict(
            n_levels=3,
            log2_hashmap_size=6,
            base_resolution=6,
            per_level_scale=2.0,
            grid_type="Dense",
            n_features_per_level=8,
        ),
    ),
    (
        "4d-linear",
        4,
        dict(n_levels=2, log2_hashmap_size=8, base_resolution=3, per_level_scale=1.7),
    ),
]
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def _twin(n_dims, kwargs, dtype):
    return HashGridEncoding(n_dims, backend="torch", dtype=dtype, **kwargs)


def _case(name, n_dims, kwargs, dtype, x, seed):
    enc = _twin(n_dims, kwargs, dtype)
    gen = torch.Generator().manual_seed(seed)
    params = torch.rand(enc.n_params, generator=gen) * 2 - 1  # [-1, 1]: the bound's range
    v = torch.randn(x.shape[0], enc.n_output_dims, generator=gen)
    return dict(
        name=name, n_dims=n_dims, kwargs=kwargs, dtype=dtype, x=x, params=params, v=v, want_x=True
    )


def _points(n_dims, seed, low=0.0, high=1.0):
    x = torch.rand(N_POINTS, n_dims, generator=torch.Generator().manual_seed(seed))
    x = x * (high - low) + low
    x[0] = 1.0  # the top corner: dense levels wrap around (tcnn does not clamp)
    x[1] = 0.0
    x[2, 0] = 1.0
    return x


def _cases():
    cases = []
    for seed, (name, n_dims, kwargs) in enumerate(CONFIGS):
        for tag, dtype in DTYPES.items():
            x = _points(n_dims, seed)
            cases.append(_case(f"{name}-{tag}", n_dims, kwargs, dtype, x, seed))
    # Outside [0, 1]: negative cells wrap to large uint32 values, products wrap mod 2^32.
    for name, n_dims, kwargs in (CONFIGS[0], CONFIGS[1], CONFIGS[4]):
        x = _points(n_dims, 100, low=-0.7, high=1.7)
        cases.append(_case(f"{name}-outside", n_dims, kwargs, torch.float32, x, 100))
    # The hand-computed wraparound of test_encoding.test_wraparound_at_one_by_hand.
    hand = _case(
        "hand",
        2,
        dict(
            n_levels=1,
            n_features_per_level=1,
            log2_hashmap_size=10,
            base_resolution=4,
            per_level_scale=2.0,
        ),
        torch.float32,
        torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]]),
        0,
    )
    hand["params"] = torch.arange(16, dtype=torch.float32)
    cases.append(hand)
    cases.append(_bf16_ties_case())
    return cases


def _bf16_ties_case():
    """bfloat16 rounding ties, in the table and in the output (Triton's interpreter truncates
    on a cast to bfloat16; torch rounds to nearest even): a 4x4 dense level whose entries
    1 + k 2^-8 are halfway between bfloat16 neighbours for odd k, read at cell centres
    (weights 1/4) and at random points."""
    kwargs = dict(n_levels=1, n_features_per_level=1, log2_hashmap_size=10, base_resolution=4,
                  per_level_scale=2.0)  # fmt: skip
    x = torch.cat([torch.tensor([[0.0, 0.0], [1.0, 1.0], [1.0, 0.0], [0.0, 1.0]]),
                   _points(2, 7)])  # fmt: skip
    case = _case("bf16-ties", 2, kwargs, torch.bfloat16, x, 7)
    case["params"] = 1 + torch.arange(16, dtype=torch.float32) * 2**-8
    return case


CASE_NAMES = [c["name"] for c in _cases()]


def interpret(cases, folder):
    """{case name: (case, triton results)} of ``cases`` from one interpreter subprocess."""
    if not mptex.has_triton():
        pytest.skip("needs triton importable")
    results = run_cases("triton_interpreted.py", cases, folder, 300)
    return {case["name"]: (case, results[case["name"]]) for case in cases}


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return interpret(_cases(), tmp_path_factory.mktemp("triton"))


def _twin_results(case):
    enc = _twin(case["n_dims"], case["kwargs"], case["dtype"])
    with torch.no_grad():
        enc.params.copy_(case["params"])
    x = case["x"].clone().requires_grad_(True)
    out = enc(x)
    grad_x, grad_params = torch.autograd.grad((out.float() * case["v"]).sum(), (x, enc.params))
    # sum_i |c_i| per entry: the weights are >= 0, so it is the gradient for |v|.
    (grad_abs,) = torch.autograd.grad((enc(case["x"]).float() * case["v"].abs()).sum(), enc.params)
    return enc, out.detach(), grad_x, grad_params, grad_abs


def _contributions_per_entry(enc, x):
    """k: [n_params] how many (point, corner) terms the backward adds into each entry."""
    from mptex._grid_torch import _Lookup

    scales = torch.tensor(enc.geometry.scales, device=x.device)
    rows = _Lookup(x, enc.geometry, scales, in_unit_cube=False).rows  # [L, C, N]
    counts = torch.bincount(rows.flatten(), minlength=enc.geometry.n_entries)
    return counts.repeat_interleave(enc.geometry.n_features_per_level)


def _param_gradient_bound(enc, case, grad_abs, grad_twin):
    """Allowed |triton - twin| of the parameter gradient (see the module docstring)."""
    k = _contributions_per_entry(enc, case["x"]).double()
    f32_sum = 2 * (k - 1).clamp(min=0) * 2**-24 * grad_abs.double()
    # bfloat16 mode: the float32 backward on the bfloat16 dL/dy, so the float32 bound.
    if case["dtype"] == torch.float16:
        # The f32 sums (x128) are rounded to half and divided by 128 in half: two roundings
        # that can land one half ulp (2^-10 relative, 2^-24 absolute in half's subnormal
        # range) apart when the f32 sums differ; f32_sum already has the x128 scaled out.
        return f32_sum + torch.where(k > 1, 2**-10 * grad_twin.double().abs() + 2**-24, 0.0)
    return f32_sum


def test_cases_cover_dense_and_hashed_levels():
    for name, n_dims, kwargs in CONFIGS:
        hashed = _twin(n_dims, kwargs, torch.float32).geometry.hashed
        if kwargs.get("grid_type") == "Dense":
            assert not any(hashed), name
        else:
            assert hashed[0] is False and hashed[-1] is True, (name, hashed)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_forward_is_bit_exact_with_twin(interpreted, name):
    case, result = interpreted[name]
    _, out, *_ = _twin_results(case)
    assert result["out"].dtype == case["dtype"] and result["out"].shape == out.shape
    # float32: 1e-6 is asked; the kernels do the twin's operations, so 0.
    # half mode: bit-exact, as required.
    # bfloat16 mode: the float32 sums are the twin's bits, rounded once the same way (to
    # nearest even): bit-exact, no one-ulp allowance for differently ordered sums.
    torch.testing.assert_close(result["out"], out, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_input_gradient_is_bit_exact_with_twin(interpreted, name):
    case, result = interpreted[name]
    _, _, grad_x, _, _ = _twin_results(case)
    torch.testing.assert_close(result["grad_x"], grad_x, rtol=0, atol=0)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_param_gradient_within_atomic_order_bound(interpreted, name):
    case, result = interpreted[name]
    enc, _, _, grad_params, grad_abs = _twin_results(case)
    assert result["grad_params"].dtype == torch.float32  # the f32 master receives it
    difference = (result["grad_params"].double() - grad_params.double()).abs()
    bound = _param_gradient_bound(enc, case, grad_abs, grad_params)
    assert (difference <= bound).all(), (difference - bound).max().item()


def test_bf16_ties_case_needs_round_to_nearest_even():
    # The case would pass with truncation unless some table value and some float32 sum round
    # up (away from zero, all values being positive) to bfloat16.
    case = _bf16_ties_case()
    enc = _twin(case["n_dims"], case["kwargs"], torch.float32)
    table = case["params"].to(torch.bfloat16).float()
    assert (table > case["params"]).any()
    sums = hash_grid_encode(case["x"], table, enc.geometry, torch.float32)
    assert (sums.to(torch.bfloat16).float() > sums).any()


def test_hand_computed_wraparound(interpreted):
    # See test_encoding.test_wraparound_at_one_by_hand: corner (4, 0) of a 4x4 dense level
    # is entry 4 (the next row), corner (4, 4) is 20 % 16 = 4.
    _, result = interpreted["hand"]
    expected = torch.tensor(
        [[0.25 * (3 + 4 + 7 + 8)], [0.25 * (15 + 0 + 3 + 4)], [0.25 * (0 + 1 + 4 + 5)]]
    )
    torch.testing.assert_close(result["out"], expected, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["3d-linear-f32", "2d-linear-f32", "3d-linear-outside"])
def test_param_gradient_matches_float64_reference(interpreted, name):
    # Independent of the twin: grid_reference accumulates dL/dparams in float64. Linear only:
    # there each float32 weight is within (D + 1) 2^-24 of the reference's float64 weight
    # relatively (1 - frac and D - 1 products round once each; frac is exact), while
    # smoothstep's 1 - w near w = 1 has no relative bound (it is checked against the twin).
    case, result = interpreted[name]
    enc = _twin(case["n_dims"], case["kwargs"], case["dtype"])
    _, geometry = _reference(enc, case["x"][:1])
    expected = param_gradient(
        case["x"].numpy(),
        case["v"].numpy(),
        enc.n_params,
        enc.geometry.n_features_per_level,
        geometry,
        enc.geometry.interpolation,
    )
    _, _, _, _, grad_abs = _twin_results(case)
    # A float32 sum of <= k products per entry, each product rounded once, weights as above.
    n_dims = enc.n_input_dims
    k = case["x"].shape[0] * 2**n_dims
    bound = (k + n_dims + 2) * 2**-24 * grad_abs.double()
    difference = (result["grad_params"].double() - torch.from_numpy(expected)).abs()
    assert (difference <= bound).all()


# ---------------------------------------------------------------------------------------
# In-process: API, errors, dispatch (no kernel runs unless the process is interpreted).


def test_auto_never_picks_triton():
    assert HashGridEncoding(3, 2, 2, 8, 4).resolved_backend() == "torch"
    assert HashGridEncoding(3, 2, 2, 8, 4, backend="triton").resolved_backend() == "triton"


def test_triton_accepted_by_config_and_texture():
    enc = HashGridEncoding.from_tcnn_config(3, NVDIFFREC_CONFIG, backend="triton")
    assert enc.resolved_backend() == "triton" and "triton" in repr(enc)
    texture = MLPTexture3D([[0, 0, 0], [1, 1, 1]], backend="triton", precision="f32")
    assert texture.encoder.resolved_backend() == "triton"


def test_bfloat16_runs_on_triton():
    # tcnn still refuses it (tests/test_grid_bf16.py); "auto" never picks triton.
    enc = HashGridEncoding(3, 2, 2, 8, 4, backend="triton", dtype=torch.bfloat16)
    assert enc.resolved_backend() == "triton" and "bfloat16" in repr(enc)
    auto = HashGridEncoding(3, 2, 2, 8, 4, dtype=torch.bfloat16)
    assert auto.resolved_backend() == "torch"
    texture = MLPTexture3D([[0, 0, 0], [1, 1, 1]], backend="triton", precision="bf16_grid")
    assert texture.encoder.resolved_backend() == "triton"
    assert texture.encoder.dtype == torch.bfloat16


def test_cpu_tensors_need_the_interpreter():
    import mptex._grid_triton as grid_triton

    enc = HashGridEncoding(3, 2, 2, 8, 4, backend="triton")
    x = torch.rand(4, 3)
    if grid_triton.INTERPRETED:  # this pytest process was started with TRITON_INTERPRET=1
        assert enc(x).shape == (4, 4)
    else:
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            enc(x)


def test_float64_is_refused_with_a_pointer_to_the_twin():
    enc = HashGridEncoding(3, 2, 2, 8, 4, backend="triton").double()
    with pytest.raises(RuntimeError, match="backend='torch' for float64"):
        enc(torch.rand(4, 3, dtype=torch.float64))


class _OnCuda(torch.nn.Parameter):
    """A CPU parameter that says it is on ``cuda:0`` (this machine may have no CUDA)."""

    @property
    def device(self):
        return torch.device("cuda:0")


@pytest.mark.parametrize("triton, tcnn", [(True, True), (False, True), (False, False)])
def test_auto_on_cuda_takes_the_fastest_backend_that_runs_the_parameters_dtype(
    monkeypatch, recwarn, triton, tcnn
):  # fmt: skip
    # On CUDA, "auto" picks triton for float32 master parameters, else tcnn, else the twin
    # with a warning. Neither kernel computes in float64 (a .double() grid, for gradcheck):
    # there the twin is the only path, taken without a warning, not tcnn, whose forward
    # refuses float64 parameters. torch's CUDA state is not consulted: the parameter says
    # where it is.
    from mptex import _backends

    monkeypatch.setattr(_backends, "has_triton", lambda: triton)
    monkeypatch.setattr(_backends, "has_tcnn", lambda: tcnn)
    enc = HashGridEncoding(3, 2, 2, 8, 4)
    enc.params = _OnCuda(enc.params.detach())
    fastest = "triton" if triton else "tcnn" if tcnn else "torch"
    assert enc.resolved_backend() == fastest
    enc.params = _OnCuda(enc.params.detach().double())
    _backends.warn_fallback_once.cache_clear()  # (a warning is given once per process)
    recwarn.clear()
    assert enc.resolved_backend() == "torch"
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_missing_triton_is_a_clear_error(monkeypatch):
    from mptex import _backends

    monkeypatch.setattr(_backends, "_try_import", lambda name: (None, "ImportError: absent"))
    assert not _backends.has_triton()
    with pytest.raises(RuntimeError, match="pip install triton"):
        HashGridEncoding(3, 2, 2, 8, 4, backend="triton")


def test_kernels_compile_for_a_cuda_target():
    # The interpreter runs the kernels as Python; this compiles them to PTX and a cubin for
    # sm_80 (no GPU needed: triton's wheel ships ptxas), catching what only the compiler
    # rejects. It also checks that no fma was contracted (enable_fp_fusion=False): the only
    # fma.rn instructions are the D position fmas and tcnn's corner fmas (float32 and bfloat16
    # mode), and that the level-scale kernel is PTX ex2.approx.ftz.f32.
    check_compiles("triton_interpreted.py", timeout=300)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_twin_on_cuda(dtype):
    # The same claims as under the interpreter, compiled, at nvdiffrec's config.
    twin = HashGridEncoding.from_tcnn_config(
        3, NVDIFFREC_CONFIG, dtype=dtype, device="cuda", backend="torch"
    )
    fast = HashGridEncoding.from_tcnn_config(
        3, NVDIFFREC_CONFIG, dtype=dtype, device="cuda", backend="triton"
    )
    with torch.no_grad():
        twin.params.uniform_(-1, 1)
    fast.load_state_dict(twin.state_dict())
    x = torch.rand(2**14, 3, device="cuda")
    x[0] = 1.0
    v = torch.randn(2**14, 32, device="cuda")
    results = []
    for enc in (twin, fast):
        xg = x.clone().requires_grad_(True)
        out = enc(xg)
        results.append((out, *torch.autograd.grad((out.float() * v).sum(), (xg, enc.params))))
    (out_t, gx_t, gp_t), (out_f, gx_f, gp_f) = results
    torch.testing.assert_close(out_f, out_t, rtol=0, atol=0)
    torch.testing.assert_close(gx_f, gx_t, rtol=0, atol=0)
    (grad_abs,) = torch.autograd.grad((twin(x).float() * v.abs()).sum(), twin.params)
    case = dict(x=x, dtype=dtype)
    bound = _param_gradient_bound(twin, case, grad_abs, gp_t)
    assert ((gp_f.double() - gp_t.double()).abs() <= bound).all()
