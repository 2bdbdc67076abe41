import subprocess
import sys

import numpy as np
import pytest
import torch
from grid_reference import encode_point, levels, param_gradient

import mptex
from mptex import HashGridEncoding
from mptex.encoding import hash_grid_encode

NVDIFFREC_SCALE = float(np.exp(np.log(4096 / 16) / 15))
NVDIFFREC_CONFIG = {
    "otype": "HashGrid",
    "n_levels": 16,
    "n_features_per_level": 2,
    "log2_hashmap_size": 19,
    "base_resolution": 16,
    "per_level_scale": NVDIFFREC_SCALE,
}


def _encoder(n_dims=3, seed=0, **kw):
    enc = HashGridEncoding(n_dims, backend="torch", **kw)
    with torch.no_grad():  # params in [-1, 1], the range the accuracy bounds are stated for
        enc.params.uniform_(-1, 1, generator=torch.Generator().manual_seed(seed))
    return enc


def _reference(enc, x, half=False):
    cfg = enc.config
    geometry = levels(
        enc.n_input_dims,
        cfg["n_levels"],
        cfg["log2_hashmap_size"],
        cfg["base_resolution"],
        cfg["per_level_scale"],
        dense_grid=cfg["type"] == "Dense",
    )
    params = enc.params.detach().numpy()
    rows = [
        encode_point(p, params, cfg["n_features_per_level"], geometry, cfg["interpolation"], half)
        for p in x.numpy()
    ]
    return torch.tensor(rows, dtype=torch.float64), geometry


# ---------------------------------------------------------------------------------------
# tcnn's own constants.


def test_param_counts_match_tcnn():
    # Values printed by tiny-cuda-nn for these configs.
    assert HashGridEncoding(3, 20, 2, 16, 32, 1.5).n_params == 2_555_904
    assert HashGridEncoding(3, 16, 2, 19, 16, 2.0).n_params == 14_229_504


def test_level_five_of_16_to_1024_is_dense_resolution_65():
    per_level_scale = float(np.exp2(np.log2(1024 / 16) / 15))
    enc = HashGridEncoding(3, 16, 2, 19, 16, per_level_scale)
    geometry = enc.geometry
    assert geometry.resolutions[5] == 65
    assert geometry.table_sizes[5] == 274_632  # 65^3 = 274625 rounded up to a multiple of 8
    assert not geometry.hashed[5] and geometry.hashed[6]
    assert geometry.offsets[6] - geometry.offsets[5] == 274_632


def test_nvdiffrec_config_geometry():
    enc = HashGridEncoding.from_tcnn_config(3, NVDIFFREC_CONFIG)
    assert enc.n_output_dims == 32
    assert enc.geometry.resolutions[0] == 16 and enc.geometry.resolutions[-1] == 4096
    assert enc.geometry.hashed == (False,) * 5 + (True,) * 11
    assert enc.params.shape == (enc.n_params,) and enc.params.dtype == torch.float32
    assert enc.n_params == 2 * sum(enc.geometry.table_sizes)


def test_init_is_uniform_in_tcnn_range():
    params = HashGridEncoding(3, 4, 2, 12, 8, 1.5, seed=3).params.detach()
    assert params.abs().max() <= 1e-4
    assert params.std() > 5e-5  # uniform on [-1e-4, 1e-4] has std 5.8e-5


# ---------------------------------------------------------------------------------------
# Forward against the brute-force reference.

CASES = [
    dict(
        n_dims=3,
        n_levels=16,
        log2_hashmap_size=19,
        base_resolution=16,
        per_level_scale=NVDIFFREC_SCALE,
    ),
    dict(n_dims=2, n_levels=6, log2_hashmap_size=9, base_resolution=5, per_level_scale=1.7),
    dict(n_dims=4, n_levels=4, log2_hashmap_size=12, base_resolution=3, per_level_scale=1.9),
    dict(
        n_dims=3,
        n_levels=5,
        log2_hashmap_size=10,
        base_resolution=4,
        per_level_scale=1.5,
        interpolation="Smoothstep",
        n_features_per_level=4,
    ),
    dict(
        n_dims=3,
        n_levels=5,
        log2_hashmap_size=10,
        base_resolution=4,
        per_level_scale=1.5,
        interpolation="Nearest",
        n_features_per_level=1,
    ),
    dict(
        n_dims=2,
        n_levels=3,
        log2_hashmap_size=6,
        base_resolution=6,
        per_level_scale=2.0,
        grid_type="Dense",
        n_features_per_level=8,
    ),
]


@pytest.mark.parametrize(
    "case",
    CASES,
    ids=lambda c: f"{c['n_dims']}d-{c.get('interpolation', 'Linear')}-{c['n_levels']}L",
)
def test_forward_matches_reference_f32(case):
    case = dict(case)
    enc = _encoder(case.pop("n_dims"), **case)
    x = torch.rand(64, enc.n_input_dims, generator=torch.Generator().manual_seed(1))
    x[0] = 1.0  # the top corner, where dense levels wrap around
    x[1] = 0.0
    expected, _ = _reference(enc, x)
    out = enc(x)
    assert out.dtype == torch.float32 and out.shape == (64, enc.n_output_dims)
    # The bound asked of it: float32 rounding of an 8-term sum of values in [-1, 1].
    assert (out.double() - expected).abs().max().item() <= 1e-6


@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[5]], ids=["3d", "2d", "2d-dense"])
def test_outside_unit_cube_follows_uint32_arithmetic(case):
    # tcnn does not clamp: negative cells wrap to large uint32 values and products wrap mod
    # 2^32. The twin has a separate code path for this, checked here against the reference.
    case = dict(case)
    enc = _encoder(case.pop("n_dims"), **case)
    x = torch.rand(40, enc.n_input_dims, generator=torch.Generator().manual_seed(11)) * 2.4 - 0.7
    expected, _ = _reference(enc, x)
    assert (enc(x).double() - expected).abs().max().item() <= 1e-6


@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: f"{c['n_dims']}d-{c['n_levels']}L")
def test_forward_half_mode_is_bit_exact(case):
    # Half mode rounds each float32 weight to half and takes one half fma per corner in corner
    # order (tcnn's __hfma2); the twin does the same operations, so it must agree to the bit
    # with the reference.
    case = dict(case)
    enc = _encoder(case.pop("n_dims"), dtype=torch.float16, **case)
    x = torch.rand(48, enc.n_input_dims, generator=torch.Generator().manual_seed(2))
    expected, _ = _reference(enc, x, half=True)
    out = enc(x)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=0)


def test_chunking_does_not_change_results(monkeypatch):
    # The twin processes points in chunks (small on a CPU, large on a GPU); results, including
    # the accumulated table gradient, must not depend on where the chunks split.
    import mptex._grid_torch as grid

    enc = _encoder(3, n_levels=6, log2_hashmap_size=10, base_resolution=4, per_level_scale=1.8)
    x = torch.rand(1000, 3, generator=torch.Generator().manual_seed(12), requires_grad=True)
    v = torch.randn(1000, enc.n_output_dims, generator=torch.Generator().manual_seed(13))
    results = []
    for chunk in (4096, 7, 333):
        monkeypatch.setitem(grid.CHUNK_POINTS, "cpu", chunk)
        out = enc(x)
        results.append((out, *torch.autograd.grad((out * v).sum(), (x, enc.params))))
    for other in results[1:]:
        torch.testing.assert_close(other[0], results[0][0], rtol=0, atol=0)
        torch.testing.assert_close(other[1], results[0][1], rtol=0, atol=0)
        # scatter_add order changes with the chunks: float32 summation rounding only.
        torch.testing.assert_close(other[2], results[0][2], rtol=1e-5, atol=1e-6)


def test_real_row_and_cpu_position_fallbacks_match(monkeypatch):
    # Devices without complex64 kernels keep rows real; devices without float64 (MPS) compute
    # positions on the CPU. Both paths are forced here on the CPU and must give the same
    # encoding (bitwise) and the same gradients (scatter order: float32 rounding).
    import mptex._grid_torch as grid

    enc = _encoder(3, n_levels=6, log2_hashmap_size=10, base_resolution=4, per_level_scale=1.8)
    x = torch.rand(500, 3, generator=torch.Generator().manual_seed(14), requires_grad=True)
    v = torch.randn(500, enc.n_output_dims, generator=torch.Generator().manual_seed(15))
    results = []
    for complex_devices, no_float64 in (({"cpu"}, set()), (set(), {"cpu"})):
        monkeypatch.setattr(grid, "COMPLEX_DEVICES", complex_devices)
        monkeypatch.setattr(grid, "NO_FLOAT64_DEVICES", no_float64)
        out = enc(x)
        results.append((out, *torch.autograd.grad((out * v).sum(), (x, enc.params))))
    (out_a, gx_a, gp_a), (out_b, gx_b, gp_b) = results
    torch.testing.assert_close(out_b, out_a, rtol=0, atol=0)
    torch.testing.assert_close(gx_b, gx_a, rtol=0, atol=0)
    torch.testing.assert_close(gp_b, gp_a, rtol=1e-5, atol=1e-6)


def test_wraparound_at_one_by_hand():
    # 2-D dense level with scale 3 (base 4): resolution 4, 16 entries. x = (1, 0) gives
    # pos = (3.5, 0.5), cell (3, 0), and the corner (4, 0) has index 4 = entry (0, 1) of the
    # next row: tcnn's wraparound, not a clamp.
    enc = HashGridEncoding(2, 1, 1, 10, 4, 2.0, backend="torch")
    assert enc.geometry.resolutions == (4,) and enc.geometry.table_sizes == (16,)
    with torch.no_grad():
        enc.params.copy_(torch.arange(16, dtype=torch.float32))
    out = enc(torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]]))
    # (1, 0): 0.25 * (e3 + e4 + e7 + e8); (1, 1): corners (3,3)=15, (4,3)=16%16=0,
    # (3,4)=19%16=3, (4,4)=20%16=4; (0, 0): pos 0.5 -> 0.25 * (e0 + e1 + e4 + e5).
    expected = torch.tensor(
        [[0.25 * (3 + 4 + 7 + 8)], [0.25 * (15 + 0 + 3 + 4)], [0.25 * (0 + 1 + 4 + 5)]]
    )
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_fma_single_rounding_matters():
    # A point where scale * x + 0.5 rounded twice differs from one rounding (found by search
    # with the exact-rational reference): the encoder must follow fmaf.
    from grid_reference import fmaf

    enc = HashGridEncoding(1 + 1, 1, 1, 20, 4096, 2.0, backend="torch")
    scale = np.float32(enc.geometry.scales[0])
    rng = np.random.default_rng(0)
    for x in rng.random(20000, dtype=np.float32):
        two = np.float32(np.float32(scale * x) + np.float32(0.5))
        if two != fmaf(scale, x, np.float32(0.5)):
            break
    else:
        pytest.fail("no double-rounding point found")
    from mptex._grid_torch import _positions

    pos = _positions(torch.tensor([[x, x]]), torch.tensor([scale]))
    assert pos[0, 0, 0].item() == float(fmaf(scale, x, np.float32(0.5)))
    assert pos[0, 0, 0].item() != float(two)


# ---------------------------------------------------------------------------------------
# Gradients.


@pytest.mark.parametrize("interpolation", ["Linear", "Smoothstep"])
def test_param_gradient_matches_reference(interpolation):
    enc = _encoder(
        3,
        n_levels=6,
        log2_hashmap_size=10,
        base_resolution=4,
        per_level_scale=1.8,
        interpolation=interpolation,
    )
    x = torch.rand(40, 3, generator=torch.Generator().manual_seed(3))
    grad_out = torch.randn(40, enc.n_output_dims, generator=torch.Generator().manual_seed(4))
    (grad,) = torch.autograd.grad((enc(x) * grad_out).sum(), enc.params)
    _, geometry = _reference(enc, x[:1])
    expected = param_gradient(x.numpy(), grad_out.numpy(), enc.n_params, 2, geometry, interpolation)
    # float32 accumulation of a few products of magnitude <= 3 (randn cotangent).
    torch.testing.assert_close(grad.double(), torch.from_numpy(expected), rtol=0, atol=2e-6)


def _away_from_cells(enc, n, seed):
    """Points whose positions are >= 0.05 cells from every cell boundary (gradcheck's finite
    differences must not cross a kink)."""
    gen = torch.Generator().manual_seed(seed)
    scales = torch.tensor(enc.geometry.scales, dtype=torch.float64)
    keep = []
    while len(keep) < n:
        x = torch.rand(256, enc.n_input_dims, generator=gen, dtype=torch.float64) * 0.9 + 0.05
        frac = torch.frac(scales.view(-1, 1, 1) * x + 0.5)
        ok = ((frac > 0.05) & (frac < 0.95)).all(0).all(-1)
        keep.extend(x[ok])
    return torch.stack(keep[:n])


@pytest.mark.parametrize("interpolation", ["Linear", "Smoothstep"])
def test_gradcheck_float64(interpolation):
    enc = _encoder(
        3,
        n_levels=4,
        log2_hashmap_size=8,
        base_resolution=3,
        per_level_scale=1.6,
        interpolation=interpolation,
    ).double()
    x = _away_from_cells(enc, 6, seed=5).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x_, p: _call_with(enc, p, x_), (x, enc.params))


def _call_with(enc, params, x):
    from mptex._grid_torch import hash_grid_encode

    return hash_grid_encode(x, params, enc.geometry, torch.float64)


def test_gradcheck_2d_dense_and_hashed():
    enc = _encoder(
        2, n_levels=5, log2_hashmap_size=6, base_resolution=4, per_level_scale=2.0
    ).double()
    assert any(enc.geometry.hashed) and not all(enc.geometry.hashed)
    x = _away_from_cells(enc, 8, seed=6).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x_, p: _call_with(enc, p, x_), (x, enc.params))


def test_nearest_has_zero_input_gradient_and_unit_param_weights():
    enc = _encoder(3, n_levels=3, log2_hashmap_size=8, base_resolution=4, interpolation="Nearest")
    x = torch.rand(10, 3, generator=torch.Generator().manual_seed(7)).requires_grad_(True)
    gx, gp = torch.autograd.grad(enc(x).sum(), (x, enc.params))
    assert torch.equal(gx, torch.zeros_like(gx))
    assert gp.sum().item() == pytest.approx(10 * enc.n_output_dims)


def test_half_mode_agrees_with_f32_forward():
    enc32 = _encoder(3, n_levels=8, log2_hashmap_size=12, base_resolution=8, per_level_scale=1.5)
    enc16 = HashGridEncoding(3, 8, 2, 12, 8, 1.5, backend="torch", dtype=torch.float16)
    enc16.load_state_dict(enc32.state_dict())
    x = torch.rand(500, 3, generator=torch.Generator().manual_seed(8))
    # Each of the 8 terms (|value| <= 1) and each partial sum is rounded to half once:
    # |error| <= 16 half ulps of values <= 1, i.e. 16 * 2^-11.
    torch.testing.assert_close(enc16(x).float(), enc32(x), rtol=0, atol=16 * 2**-11)


def test_half_mode_backward_is_the_exact_gradient_of_half_values():
    # Half mode differentiates the half-rounded table with the half-rounded cotangent; tcnn's
    # x128 / 128 are exact powers of two. So its gradients must equal a float64 evaluation of
    # exactly that, up to float32 accumulation and (for params) the final rounding to half.
    enc16 = _encoder(
        3,
        n_levels=8,
        log2_hashmap_size=12,
        base_resolution=8,
        per_level_scale=1.5,
        dtype=torch.float16,
    )
    enc64 = HashGridEncoding(3, 8, 2, 12, 8, 1.5, backend="torch").double()
    with torch.no_grad():
        enc64.params.copy_(enc16.params.half().double())
    x = _away_from_cells(enc64, 300, seed=8).float()
    v = torch.randn(300, enc16.n_output_dims, generator=torch.Generator().manual_seed(9))
    x16 = x.clone().requires_grad_(True)
    gx16, gp16 = torch.autograd.grad((enc16(x16).float() * v).sum(), (x16, enc16.params))
    assert gp16.dtype == torch.float32  # the f32 master receives the gradient
    x64 = x.double().requires_grad_(True)
    v64 = v.half().double()
    gx64, gp64 = torch.autograd.grad((enc64(x64) * v64).sum(), (x64, enc64.params))
    # Bound: one half rounding of the result (2^-11 relative) plus float32 accumulation of at
    # most 300 points * 8 corners terms (worst case (n - 1) * 2^-24 * sum |term|; the weights
    # are >= 0, so sum |term| is the gradient for the cotangent |v|).
    (gp_abs,) = torch.autograd.grad((enc64(x64) * v64.abs()).sum(), enc64.params)
    # tcnn unscales in half (`params_grad / 128`), which lands gradients below 2^-14 / 128 in
    # half's subnormal range: one more rounding of up to half a subnormal ulp, 2^-25.
    bound = 2**-11 * gp64.abs() + 2400 * 2**-24 * gp_abs + 2**-25
    assert ((gp16.double() - gp64).abs() <= bound).all()
    # dL/dx sums L*C*F = 128 float32 products with cancellation: error <= 128 * 2^-24 of the
    # largest term; bounded here by the largest gradient component.
    torch.testing.assert_close(
        gx16.double(), gx64, rtol=0, atol=128 * 2**-24 * gx64.abs().max().item()
    )


# ---------------------------------------------------------------------------------------
# API, configs and errors.


def test_from_tcnn_config_equals_constructor():
    a = HashGridEncoding.from_tcnn_config(3, NVDIFFREC_CONFIG, seed=1)
    b = HashGridEncoding(3, 16, 2, 19, 16, NVDIFFREC_SCALE, seed=1)
    assert a.geometry == b.geometry
    assert torch.equal(a.params, b.params)
    assert a.tcnn_config()["per_level_scale"] == pytest.approx(NVDIFFREC_SCALE)


def test_state_dict_is_one_flat_vector():
    enc = HashGridEncoding(3, 4, 2, 10, 8)
    assert list(enc.state_dict()) == ["params"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n_input_dims=5), "n_input_dims"),
        (dict(n_input_dims=3, n_levels=0), "n_levels"),
        (dict(n_input_dims=3, n_features_per_level=3), "n_features_per_level"),
        (dict(n_input_dims=3, per_level_scale=0.5), "per_level_scale"),
        (dict(n_input_dims=3, interpolation="Cubic"), "interpolation"),
        (dict(n_input_dims=3, backend="cuda"), "backend"),
        (dict(n_input_dims=3, dtype=torch.float64), "dtype"),
        (dict(n_input_dims=3, n_features_per_level=True), "^n_features_per_level"),
        (dict(n_input_dims=3, seed=-1), r"^seed: expected an integer in \[0, 2\*\*64\) or None"),
        (dict(n_input_dims=3, seed=2**64), "^seed"),
        (dict(n_input_dims=3, seed=True), "^seed"),
        (dict(n_input_dims=3, seed=1.5), "^seed"),
    ],
)
def test_bad_constructor_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HashGridEncoding(**kwargs)


SMALL_CONFIG = {"otype": "HashGrid", "n_levels": 4, "log2_hashmap_size": 10, "base_resolution": 8,
                "per_level_scale": 1.5}  # fmt: skip


def _same_grid(a, b):
    return a.geometry == b.geometry and a.config == b.config


def test_tcnn_call_shape_builds_tcnns_encoding():
    # tcnn.Encoding(n_input_dims, encoding_config, seed=1337, dtype=None): nvdiffrec's call.
    enc = HashGridEncoding(3, NVDIFFREC_CONFIG)
    keyword = HashGridEncoding.from_tcnn_config(3, NVDIFFREC_CONFIG, dtype=torch.float16,
                                                seed=1337)  # fmt: skip
    assert _same_grid(enc, keyword) and torch.equal(enc.params, keyword.params)
    assert enc.dtype == torch.float16  # dtype=None: tcnn's preferred precision, half
    assert enc.n_output_dims == 32 and enc.params.dtype == torch.float32
    # The same call written every way tcnn accepts it.
    calls = [
        HashGridEncoding(3, SMALL_CONFIG, 1337, None),
        HashGridEncoding(3, SMALL_CONFIG, seed=1337, dtype=None),
        HashGridEncoding(n_input_dims=3, encoding_config=SMALL_CONFIG),
    ]
    for other in calls[1:]:
        assert _same_grid(other, calls[0]) and torch.equal(other.params, calls[0].params)
    f32 = HashGridEncoding(3, SMALL_CONFIG, 7, torch.float32, backend="torch")
    assert f32.dtype == torch.float32 and f32.backend == "torch"
    assert not torch.equal(f32.params, calls[0].params)  # another seed
    x = torch.rand(64, 3, generator=torch.Generator().manual_seed(0))
    assert calls[0](x).dtype == torch.float16 and f32(x).dtype == torch.float32
    with pytest.raises(TypeError):  # tcnn's signature has no fifth positional argument
        HashGridEncoding(3, SMALL_CONFIG, 1337, None, "torch")


def test_keyword_form_keeps_mptex_defaults():
    enc = HashGridEncoding(3, 4, 2, 10, 8, 1.5)
    assert enc.dtype == torch.float32 and _same_grid(enc, HashGridEncoding(3, SMALL_CONFIG))
    torch.manual_seed(3)
    a = HashGridEncoding.from_tcnn_config(3, SMALL_CONFIG)
    torch.manual_seed(3)
    b = HashGridEncoding.from_tcnn_config(3, SMALL_CONFIG)
    assert a.dtype == torch.float32 and torch.equal(a.params, b.params)  # torch's global RNG


def test_tcnn_config_takes_numbers_and_names_as_tcnn_reads_them():
    plain = HashGridEncoding.from_tcnn_config(3, SMALL_CONFIG)
    variants = [
        {**SMALL_CONFIG, "n_levels": np.int64(4), "log2_hashmap_size": np.int32(10)},
        {**SMALL_CONFIG, "n_levels": 4.0, "base_resolution": np.float64(8.0)},
        {**SMALL_CONFIG, "per_level_scale": np.float32(1.5)},
        {**SMALL_CONFIG, "otype": "hashgrid", "type": "HASH", "interpolation": "linear"},
        {**{k: v for k, v in SMALL_CONFIG.items() if k != "n_levels"}, "n_features": 8},
        {**{k: v for k, v in SMALL_CONFIG.items() if k != "n_levels"}, "n_grid_features": 8},
        {**SMALL_CONFIG, "otype": "Grid", "hash": "coherentprime", "fixed_point_pos": False},
    ]
    for config in variants:
        assert _same_grid(HashGridEncoding.from_tcnn_config(3, config), plain), config
    loaded = HashGridEncoding.from_tcnn_config(3, variants[0])
    assert all(type(v) in (int, float, str) for v in loaded.config.values())


def test_dense_grid_default_scale_is_tcnns():
    enc = HashGridEncoding(3, {"otype": "DenseGrid", "n_levels": 4, "base_resolution": 8})
    assert enc.config["type"] == "Dense"
    # tcnn: std::exp(std::log(256.0f / (float)base_resolution) / (n_levels - 1)), in float.
    # numpy's float32 log/exp may round differently from libm's logf/expf: 1 ulp allowed.
    f32 = np.float32
    expected = np.exp(np.log(f32(256) / f32(8)) / f32(3))
    assert expected.dtype == np.float32
    assert abs(enc.config["per_level_scale"] - float(expected)) <= float(np.spacing(expected))
    hashed = HashGridEncoding(3, {"otype": "HashGrid", "n_levels": 4, "base_resolution": 8})
    assert hashed.config["per_level_scale"] == 2.0


@pytest.mark.parametrize("base_resolution, n_levels", [(300, 4), (512, 16)])
def test_a_dense_grids_derived_scale_below_one_names_where_it_came_from(base_resolution, n_levels):
    # tcnn's default, (256 / base_resolution) ** (1 / (n_levels - 1)), is below 1 above 256:
    # (256/300)**(1/3) = 0.9485, (256/512)**(1/15) = 0.9548. The user gave no per_level_scale,
    # so the message says it was derived, from what, and what to set.
    derived = (256 / base_resolution) ** (1 / (n_levels - 1))
    config = {"otype": "DenseGrid", "n_levels": n_levels, "base_resolution": base_resolution}
    expected = (
        "config.per_level_scale: not given, and tcnn's default for a dense grid, "
        f"exp(log(256 / base_resolution) / (n_levels - 1)) = {derived:.4g} with "
        f"base_resolution={base_resolution}, is below 1 (each level would be coarser than the "
        "one before): set per_level_scale (a number >= 1), or a base_resolution of at most 256"
    )
    with pytest.raises(ValueError) as info:
        HashGridEncoding.from_tcnn_config(3, config)
    assert str(info.value) == expected
    # base_resolution 256 derives exactly 1 (exp(0)): taken
    at_256 = HashGridEncoding.from_tcnn_config(3, {**config, "base_resolution": 256})
    assert at_256.config["per_level_scale"] == 1.0


def test_keys_tcnn_ignores_warn_once_in_one_line():
    with pytest.warns(UserWarning) as record:
        enc = HashGridEncoding(3, {**SMALL_CONFIG, "n_dims_to_encode": 3, "n_level": 16})
    assert len(record) == 1
    message = str(record[0].message)
    assert "\n" not in message and "'n_dims_to_encode'" in message
    assert "'n_level' (did you mean 'n_levels'?)" in message
    assert record[0].filename == __file__  # points at the caller's line
    assert _same_grid(enc, HashGridEncoding(3, SMALL_CONFIG))


@pytest.mark.parametrize(
    "config, match",
    [
        ({"otype": "Frequency", "n_frequencies": 12},
         r"^encoding_config.otype: .*'HashGrid', 'Grid' and 'DenseGrid'.*got 'Frequency'"),
        ({"otype": "TiledGrid"}, r"^encoding_config.otype: .*'TiledGrid' is not implemented"),
        ({"n_levels": 16.5}, r"^encoding_config.n_levels: expected a whole number, got 16.5"),
        ({"log2_hashmap_size": "19"}, r"^encoding_config.log2_hashmap_size: expected a whole"),
        ({"base_resolution": True}, r"^encoding_config.base_resolution: expected a whole"),
        ({"per_level_scale": "2"}, r"^encoding_config.per_level_scale: expected a number"),
        ({"type": "Tiled"}, r"^encoding_config.type: .*'Tiled' is not implemented"),
        ({"interpolation": "Cubic"}, r"^encoding_config.interpolation: expected one of"),
        ({"hash": "Prime"}, r"^encoding_config.hash: .*'CoherentPrime' only"),
        ({"stochastic_interpolation": True}, r"^encoding_config.stochastic_interpolation: "),
        ({"n_features": 32, "n_levels": 16}, r"^encoding_config.n_features: may not be given"),
        ({"n_features": 33}, r"^encoding_config.n_features: expected a multiple of"),
        ({"otype": "DenseGrid", "n_levels": 1}, r"^encoding_config.per_level_scale: required"),
        ({"n_levels": 0}, r"^n_levels must be an integer >= 1"),
    ],
)  # fmt: skip
def test_bad_tcnn_config_names_the_key(config, match):
    with pytest.raises(ValueError, match=match):
        HashGridEncoding(3, config)
    # from_tcnn_config names its own argument, config.
    with pytest.raises(ValueError, match=match.replace("encoding_config", "config")):
        HashGridEncoding.from_tcnn_config(3, config)


@pytest.mark.parametrize(
    "x, match",
    [
        (torch.rand(5, 2), r"shape \[N, 3\]"),
        (torch.rand(5), r"shape \[N, 3\]"),
        (torch.rand(5, 3).half(), "float32"),
        (torch.rand(5, 3).double(), "float32"),
        (torch.tensor([[0.1, float("nan"), 0.2]]), "non-finite"),
        (torch.tensor([[0.1, float("inf"), 0.2]]), "non-finite"),
        (torch.rand(5, 3, device="meta"), "meta"),
    ],
)
def test_bad_inputs(x, match):
    with pytest.raises(ValueError, match=match):
        HashGridEncoding(3, 2, 2, 8, 4)(x)


@pytest.mark.parametrize("cast", ["half", "bfloat16"])
def test_a_module_cast_to_half_params_is_refused_before_the_forward(cast):
    # The table is a float32 master (float64 for gradcheck); the compute dtype is dtype=. A
    # half table would pass the forward and fail in the backward's scatter, so the forward
    # refuses it, naming params.
    enc = getattr(HashGridEncoding(3, 2, 2, 8, 4), cast)()
    x = torch.rand(5, 3)
    with pytest.raises(ValueError, match=r"^params: expected float32 .*got torch\.(float16|bf)"):
        enc(x)
    with pytest.raises(ValueError, match=r"^params: expected float32 or float64"):
        hash_grid_encode(x, enc.params.detach(), enc.geometry, torch.float32)
    # The texture built on it says the same at its first sample.
    aabb = torch.tensor([[-1.0, -1.0, -1.0], [1.0, 1.0, 1.0]])
    small = {"otype": "HashGrid", "n_levels": 2, "n_features_per_level": 2,
             "log2_hashmap_size": 8, "base_resolution": 4, "per_level_scale": 2.0}  # fmt: skip
    tex = getattr(mptex.MLPTexture3D(aabb, precision="f16_dynamic", encoder=small), cast)()
    with pytest.raises(ValueError, match=r"^params: expected float32"):
        tex.sample(x * 2 - 1)


def test_tcnn_backend_without_tcnn_is_a_clear_error():
    if mptex.has_tcnn():
        pytest.skip("tinycudann is present")
    with pytest.raises(RuntimeError, match="tcnn"):
        HashGridEncoding(3, backend="tcnn")


def test_auto_backend_on_cpu_is_torch():
    assert HashGridEncoding(3, 2, 2, 8, 4).resolved_backend() == "torch"


def test_empty_batch():
    enc = HashGridEncoding(3, 2, 2, 8, 4)
    x = torch.zeros(0, 3, requires_grad=True)
    out = enc(x)
    assert out.shape == (0, 4)
    out.sum().backward()
    assert torch.equal(enc.params.grad, torch.zeros_like(enc.params))


def test_import_mptex_does_not_import_native_backends():
    # Also not triton: it is imported by the first forward of a backend="triton" encoding.
    code = (
        "import sys, mptex, mptex.encoding, mptex.texture;"
        "bad = [m for m in ('tinycudann', 'nvdiffrast', 'triton') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_public_names_resolve():
    assert len(set(mptex.__all__)) == len(mptex.__all__)
    for name in mptex.__all__:
        assert getattr(mptex, name) is not None


# ---------------------------------------------------------------------------------------
# tinycudann, where present.


@pytest.mark.requires_tcnn
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_torch_backend_matches_tcnn(dtype):
    torch_enc = HashGridEncoding.from_tcnn_config(
        3, NVDIFFREC_CONFIG, backend="torch", dtype=dtype, device="cuda"
    )
    tcnn_enc = HashGridEncoding.from_tcnn_config(
        3, NVDIFFREC_CONFIG, backend="tcnn", dtype=dtype, device="cuda"
    )
    with torch.no_grad():
        torch_enc.params.uniform_(-1, 1)
    tcnn_enc.load_state_dict(torch_enc.state_dict())
    x = torch.rand(2**16, 3, device="cuda")
    v = torch.randn(2**16, 32, device="cuda")
    out_t, out_c = torch_enc(x), tcnn_enc(x)
    # The twin models tcnn 2.0's forward (one fma per corner; half mode: the weight rounded to
    # half and __hfma2) with the level scales of the device's own ex2.approx (exp2="auto" on
    # CUDA); on an H100 it was bit-equal to tcnn on 3 configs x 8192 points (tests/gpu_golden).
    if dtype == torch.float32:
        # 2.5e-7: two float32 ulps of outputs below 1 (U(-1, 1) table values).
        torch.testing.assert_close(out_t, out_c, rtol=0, atol=2.5e-7)
    else:
        equal = (out_t.view(torch.int16) == out_c.view(torch.int16)).float().mean().item()
        assert equal >= 0.999, f"{equal:.5f} of the half outputs bit-equal to tcnn's"
        torch.testing.assert_close(out_t.float(), out_c.float(), rtol=0, atol=2**-11)
    g_t = torch.autograd.grad((out_t.float() * v).sum(), torch_enc.params)[0]
    g_c = torch.autograd.grad((out_c.float() * v).sum(), tcnn_enc.params)[0]
    relative = ((g_t - g_c).norm() / g_c.norm()).item()
    # float32: atomic summation order only (measured <= 4e-7 per level on the H100). half: tcnn
    # accumulates the gradient table in half with atomics (order-dependent half roundings),
    # the twin in float32 rounded once (measured 4e-4 to 1.6e-3 relative on the H100).
    assert relative <= (1e-6 if dtype == torch.float32 else 4e-3), relative


def test_functional_op_refuses_a_geometry_with_shrinking_levels():
    # The twin indexes the dense levels as a prefix; a geometry built directly with
    # per_level_scale < 1 (the module refuses it) must not be mis-indexed silently.
    from mptex._grid_torch import grid_geometry, hash_grid_encode

    geometry = grid_geometry(2, 3, 2, 6, 64, 0.3)
    with pytest.raises(ValueError, match="hashed levels must follow the dense ones"):
        hash_grid_encode(torch.rand(4, 2), torch.zeros(geometry.n_params), geometry, torch.float32)


def test_level_scale_modes():
    from mptex._grid_torch import H100_EX2_TABLE, grid_geometry

    with pytest.raises(ValueError, match="exp2 must be one of"):
        grid_geometry(3, 4, 2, 10, 4, 1.5, exp2="fast")
    with pytest.raises(ValueError, match="exp2 must be one of"):
        HashGridEncoding(3, 4, 2, 10, 4, 1.5, exp2="fast")
    # nvdiffrec's level 1: tcnn's ex2.approx (measured on an H100) is one float32 ulp above the
    # correctly rounded 2^0.53333330 = 1.44726920 (0x3FB9401E).
    exact = grid_geometry(3, 2, 2, 19, 16, NVDIFFREC_SCALE)
    table = grid_geometry(3, 2, 2, 19, 16, NVDIFFREC_SCALE, exp2="h100-table")
    assert H100_EX2_TABLE[0x3F088888] == 0x3FB9401F
    assert exact.scales[0] == table.scales[0] == 15.0
    assert table.scales[1] - exact.scales[1] == 16 * 2.0**-23  # one ulp of 2^x, times 16
    # the table changes no host constant (table sizes and offsets come from the host's exp2f)
    assert (exact.table_sizes, exact.offsets) == (table.table_sizes, table.offsets)
    if not torch.cuda.is_available():
        pytest.importorskip("triton")
        with pytest.raises(RuntimeError, match="cuda-ex2"):
            grid_geometry(3, 2, 2, 19, 16, NVDIFFREC_SCALE, exp2="cuda-ex2")
