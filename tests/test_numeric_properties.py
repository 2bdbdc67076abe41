"""Randomised cross-checks of the numerical core against independent references.

Each test draws its configurations and inputs from a seeded generator (the same cases on every
run) and compares the product code with a reference written from the documented behaviour:
scipy for the statistics, per-element loops for the grid, the fused MLP and the FP8 formats.
"""

from __future__ import annotations

import math
import random
import statistics

import fp8_reference
import fused_mlp_reference
import grid_reference
import numpy as np
import pytest
import torch
from scipy import stats

from mptex import _fused_mlp_torch as fused_mlp_torch
from mptex import _grid_torch as grid_torch
from mptex._fp8_fused import RECIPE_CODES, fp8_quantize, fp8_quantize_reference
from mptex._fp8_scaling import quantize_fp8
from mptex._fused_mlp_torch import ACTIVATIONS, FusedMLPSpec, fused_mlp
from mptex._grid_torch import grid_geometry, hash_grid_encode
from mptex.fp8 import (
    AMAX_COMPUTE_ALGOS,
    E4M3,
    E5M2,
    ScalingRecipe,
    ScalingState,
    quantize_fp8_rowwise,
    rowwise_spread,
)
from mptex.intervals import family_confidence, mean_ci, ratio_ci, t_quantile
from mptex.quantize import e4m3_values, fake_quantize, quantization_error

# ------------------------------------------------------------------------------ intervals


def _random_dof(rng: random.Random) -> float:
    return rng.choice(
        [
            rng.uniform(0.05, 1.0),  # fractional, below one
            rng.uniform(1.0, 30.0),
            float(rng.randint(1, 60)),
            10 ** rng.uniform(2, 5),
            10 ** rng.uniform(5, 300),  # beyond any seed count: the normal limit
        ]
    )


def test_t_quantile_matches_scipy_over_random_dofs_and_probabilities():
    rng = random.Random(11)
    for _ in range(300):
        dof = _random_dof(rng)
        p = rng.choice([rng.uniform(0.5, 0.99999), rng.uniform(1e-5, 0.5), 0.975])
        want = stats.t.ppf(p, dof)
        # bisection to 1e-12 of the bracket; the continued fraction's own error is below 1e-8
        # relative at 1e5 degrees of freedom, where it hands over to the normal expansion
        assert t_quantile(p, dof) == pytest.approx(want, rel=1e-8, abs=1e-10), (p, dof)


@pytest.mark.parametrize("dof", [1e6, 1e10, 1e16, 1e20, 1e300])
def test_t_quantile_with_huge_dof_tends_to_the_normal_quantile(dof):
    # scipy: 1.959963984540054 for dof -> infinity, above it by ~2.4e-7 * 1e6 / dof
    assert t_quantile(0.975, dof) == pytest.approx(stats.t.ppf(0.975, dof), rel=1e-12)
    assert t_quantile(0.6, dof) == pytest.approx(stats.t.ppf(0.6, dof), rel=1e-12)


@pytest.mark.parametrize("tail", [1e-15, 1e-12, 1e-9])
@pytest.mark.parametrize("dof", [0.7, 3.0, 41.0, 5000.0])
def test_t_quantile_far_in_either_tail_matches_scipy(tail, dof):
    # both signs: p = tail itself, and 1 - tail (exact in float64 only to ~1e-16 absolute, so
    # scipy is asked for the same float64 p)
    for p in (tail, 1.0 - tail):
        assert t_quantile(p, dof) == pytest.approx(stats.t.ppf(p, dof), rel=1e-9), p


def test_mean_ci_matches_scipy_over_random_samples():
    rng = random.Random(12)
    for _ in range(200):
        n = rng.choice([1, 2, 3, rng.randint(2, 40)])
        confidence = rng.choice([0.95, rng.uniform(0.01, 0.9999)])
        values = [rng.gauss(rng.uniform(-1e3, 1e3), 10 ** rng.uniform(-6, 3)) for _ in range(n)]
        if rng.random() < 0.15:
            values = [values[0]] * n  # equal values: sd 0, an interval of width 0
        ci = mean_ci(values, confidence)
        assert ci["n"] == n
        assert ci["mean"] == pytest.approx(math.fsum(values) / n, rel=1e-15, abs=1e-12)
        if n < 2:
            assert ci["sd"] is ci["half_width"] is ci["low"] is ci["high"] is None
            continue
        sd = statistics.stdev(values)
        half = stats.t.ppf(0.5 + confidence / 2, n - 1) * sd / math.sqrt(n)
        assert ci["sd"] == pytest.approx(sd, rel=1e-12, abs=0)
        assert ci["half_width"] == pytest.approx(half, rel=1e-9, abs=0)
        assert ci["low"] == pytest.approx(ci["mean"] - half, rel=1e-9, abs=1e-9 * abs(half))
        assert ci["high"] == pytest.approx(ci["mean"] + half, rel=1e-9, abs=1e-9 * abs(half))


def _assert_exp_of(value: float, log_value: float) -> None:
    """``value`` is exp(``log_value``): compared as logs (the log ratios reach ~1400 in size),
    infinite beyond float64, and tiny where exp underflows."""
    if log_value > math.log(1.7976931348623157e308):
        assert value == math.inf  # beyond float64: infinite, as documented
    elif log_value < -700:  # towards float64's subnormals and 0
        assert 0 <= value < 1e-300
    else:
        # scipy's interval and the mean's float64 sums: agreement to 1e-9 in the log
        assert math.log(value) == pytest.approx(log_value, rel=1e-9, abs=1e-9)


def test_ratio_ci_is_scipys_t_interval_of_the_log_ratios_exponentiated():
    rng = random.Random(13)
    for _ in range(150):
        n = rng.choice([1, 2, 3, rng.randint(2, 20)])
        confidence = rng.choice([0.95, rng.uniform(0.5, 0.999)])
        pairs = [(10 ** rng.uniform(-300, 300), 10 ** rng.uniform(-300, 300)) for _ in range(n)]
        got = ratio_ci(pairs, confidence)
        logs = [math.log(a) - math.log(b) for a, b in pairs]
        mean_log = math.fsum(logs) / n
        _assert_exp_of(got["ratio"], mean_log)
        if n < 2:
            assert got["low"] is got["high"] is None
            continue
        interval = stats.ttest_1samp(logs, 0.0).confidence_interval(confidence)
        _assert_exp_of(got["low"], interval.low)
        _assert_exp_of(got["high"], interval.high)


def test_family_confidence_is_bonferronis_over_random_families():
    rng = random.Random(14)
    for _ in range(100):
        k, confidence = rng.randint(0, 500), rng.uniform(0.5, 0.999)
        assert family_confidence(k, "none", confidence) == confidence
        # 1 - (1 - c) / k for a family of two or more; k = 0 or 1 is no family
        want = confidence if k <= 1 else 1 - (1 - confidence) / k
        assert family_confidence(k, "bonferroni", confidence) == pytest.approx(want, rel=1e-15)


# ------------------------------------------------------------------------------ hash grid

F32_UNIT_ROUNDOFF = 2.0**-24


def _grid_case(rng: random.Random):
    """A random valid grid (dense and hashed levels, per_level_scale at 1, near 1 and large)
    and points with exact cell boundaries, 0, 1 and a point outside the unit cube."""
    while True:
        n_dims = rng.choice([2, 3, 4])
        n_levels = rng.randint(1, 5)
        base = rng.randint(1, 16)
        per_level_scale = rng.choice(
            [1.0, 1.0 + rng.random() * 1e-3, 1.0 + rng.random(), 2.0, rng.uniform(2.0, 5.0)]
        )
        grid_type = rng.choice(["Hash", "Dense"])
        finest = base * per_level_scale ** (n_levels - 1)
        if finest <= 2**10 and (grid_type == "Hash" or finest**n_dims <= 1e5):
            break
    config = dict(
        n_input_dims=n_dims,
        n_levels=n_levels,
        n_features_per_level=rng.choice([1, 2, 4, 8]),
        log2_hashmap_size=rng.randint(3, 10),
        base_resolution=base,
        per_level_scale=per_level_scale,
        interpolation=rng.choice(["Linear", "Smoothstep", "Nearest"]),
        grid_type=grid_type,
    )
    geometry = grid_geometry(**config)
    points = []
    for _ in range(rng.randint(1, 12)):
        point = []
        for _ in range(n_dims):
            kind = rng.random()
            if kind < 0.15:
                point.append(0.0)
            elif kind < 0.3:
                point.append(1.0)
            elif kind < 0.5 and max(geometry.scales) > 0:
                # on a cell boundary of some level: scale * x + 0.5 an integer
                scale = rng.choice([s for s in geometry.scales if s > 0])
                step = rng.randint(0, max(1, int(scale)))
                point.append(min(max(float(np.float32((step - 0.5) / scale)), 0.0), 1.0))
            else:
                point.append(float(np.float32(rng.random())))
        points.append(point)
    if rng.random() < 0.25:  # outside [0, 1]: tcnn's uint32 wraparound
        points.append([float(np.float32(rng.uniform(-2.0, 3.0))) for _ in range(n_dims)])
    return config, geometry, torch.tensor(points, dtype=torch.float32)


def _reference_geometry(config):
    return grid_reference.levels(
        config["n_input_dims"],
        config["n_levels"],
        config["log2_hashmap_size"],
        config["base_resolution"],
        config["per_level_scale"],
        dense_grid=config["grid_type"] == "Dense",
    )


def test_grid_level_constants_match_the_reference_over_random_configs():
    rng = random.Random(21)
    for _ in range(60):
        config, geometry, _ = _grid_case(rng)
        want = _reference_geometry(config)
        got = zip(
            geometry.scales,
            geometry.resolutions,
            geometry.table_sizes,
            geometry.offsets[:-1],
            geometry.hashed,
            strict=True,
        )
        assert [(np.float32(s), r, t, o, h) for s, r, t, o, h in got] == want, config


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_grid_forward_and_gradients_match_the_per_point_reference(out_dtype, grid_ops):
    rng = random.Random(22)
    half = out_dtype == torch.float16
    for case in range(12):
        config, geometry, x = _grid_case(rng)
        n_features, interpolation = config["n_features_per_level"], config["interpolation"]
        levels = _reference_geometry(config)
        gen = torch.Generator().manual_seed(case)
        params = torch.randn(geometry.n_params, generator=gen)
        cotangent = torch.randn(x.shape[0], geometry.n_output_dims, generator=gen)
        points, table = x.requires_grad_(True), params.clone().requires_grad_(True)
        out = hash_grid_encode(points, table, geometry, out_dtype)
        grad_x, grad_params = torch.autograd.grad((out.float() * cotangent).sum(), (x, table))
        # Forward: bit for bit (the reference rounds as tcnn's kernel: fmaf per corner, or
        # half weights and __hfma2 in half mode).
        want = [
            grid_reference.encode_point(p, params.numpy(), n_features, levels, interpolation, half)
            for p in x.tolist()
        ]
        assert torch.equal(out.double(), torch.tensor(want, dtype=torch.float64)), config
        if half:
            continue  # the half backward (scaled, rounded to half) is held to tcnn elsewhere
        args = (x.tolist(), cotangent.double().numpy(), geometry.n_params, n_features, levels)
        want_params = grid_reference.param_gradient(*args, interpolation)
        # float32 weights (D factors of up to 6 roundings each, smoothstep's, in [0, 1]) and
        # sums of up to N * 2^D terms per entry, against float64: at most that many float32
        # unit roundoffs of the terms' magnitudes with every weight at its bound 1.
        size = grid_reference.param_gradient(*args, interpolation, magnitude=True)
        roundings = x.shape[0] * 2 ** x.shape[1] + 8 * x.shape[1] + 2
        bound = roundings * F32_UNIT_ROUNDOFF * size
        assert (np.abs(grad_params.double().numpy() - want_params) <= bound).all(), config
        args = (x.tolist(), cotangent.double().numpy(), params.numpy(), n_features, levels)
        want_x = grid_reference.input_gradient(*args, interpolation)
        size = grid_reference.input_gradient(*args, interpolation, magnitude=True)
        # per term: F products summed, D weight factors (up to 6 roundings each), the slope
        # (4), the scale; per coordinate 2^D corners and L levels summed
        roundings = n_features + 8 * x.shape[1] + 2 ** x.shape[1] + config["n_levels"] + 8
        bound = roundings * F32_UNIT_ROUNDOFF * size
        assert (np.abs(grad_x.double().numpy() - want_x) <= bound).all(), config


def test_grid_c_kernel_and_eager_ops_give_the_same_bits_over_random_configs(monkeypatch):
    if grid_torch.native_kernels() is None:
        pytest.skip("the C kernel does not build here (no C compiler)")
    rng = random.Random(23)
    native = grid_torch._native
    for case in range(25):
        _, geometry, x = _grid_case(rng)
        out_dtype = rng.choice([torch.float32, torch.float16])
        gen = torch.Generator().manual_seed(case)
        params = torch.randn(geometry.n_params, generator=gen)
        cotangent = torch.randn(x.shape[0], geometry.n_output_dims, generator=gen)
        results = []
        for ops in (native, lambda *args: None):
            monkeypatch.setattr(grid_torch, "_native", ops)
            points, table = x.clone().requires_grad_(True), params.clone().requires_grad_(True)
            out = hash_grid_encode(points, table, geometry, out_dtype)
            results.append((out, *torch.autograd.grad((out * cotangent).sum(), (points, table))))
        for got, want in zip(*results, strict=True):
            assert torch.equal(got, want), (geometry, out_dtype)


def test_grid_gradients_pass_gradcheck_in_float64_over_random_configs():
    rng = random.Random(24)
    checked = 0
    while checked < 4:
        _, geometry, _ = _grid_case(rng)
        gen = torch.Generator().manual_seed(checked)
        x = 0.1 + 0.8 * torch.rand(3, geometry.n_input_dims, generator=gen, dtype=torch.float64)
        # gradcheck's finite differences (step 1e-6) must not cross a cell boundary
        pos = x.unsqueeze(-1) * torch.tensor(geometry.scales, dtype=torch.float64) + 0.5
        if ((pos - pos.floor()) < 1e-4).any() or ((pos.ceil() - pos) < 1e-4).any():
            continue
        params = torch.randn(geometry.n_params, generator=gen, dtype=torch.float64)
        # the table's Jacobian costs one evaluation per parameter: only for small tables
        params.requires_grad_(geometry.n_params <= 300)

        def encode(points, table, geometry=geometry):
            return hash_grid_encode(points, table, geometry, torch.float64)

        # float64 throughout: gradcheck's default tolerances (atol 1e-5, rtol 1e-3) hold
        assert torch.autograd.gradcheck(encode, (x.requires_grad_(True), params)), geometry
        checked += 1


# ------------------------------------------------------------------------------ fused MLP


def test_fused_mlp_matches_the_per_element_reference_over_random_networks(monkeypatch):
    rng = random.Random(31)
    eager = lambda tensor: None  # noqa: E731
    native = fused_mlp_torch._native if fused_mlp_torch.native_kernels() is not None else eager
    for case in range(len(ACTIVATIONS)):
        # width 32 once (the per-element reference's cost grows with width^2); output widths
        # above 16 take the last layer's CUTLASS path (k-blocks of 8)
        width = 32 if case == 2 else 16
        spec = FusedMLPSpec(
            n_input_dims=rng.randint(1, 20),
            n_output_dims=rng.randint(1, 20 if width == 16 else 8),
            width=width,
            n_hidden_layers=rng.randint(1, 2),
            activation=ACTIVATIONS[case],  # each once, with an output activation at random
            output_activation=rng.choice(ACTIVATIONS),
            accumulate=rng.choice(["half", "float"]),
        )
        batch = rng.choice([1, 2, 3, 17, 100, 255, 256])  # all padded to 256 rows
        gen = torch.Generator().manual_seed(case)
        params = (torch.rand(spec.n_params, generator=gen) * 2 - 1) * rng.choice([0.05, 0.3])
        x = torch.randn(batch, spec.n_input_dims, generator=gen)
        grad_out = torch.randn(batch, spec.n_output_dims, generator=gen).half()
        want = fused_mlp_reference.network(
            x.tolist(), params.tolist(), spec.n_output_dims, width, spec.n_hidden_layers,
            grad_out=grad_out.float().tolist(), accumulate=spec.accumulate,
            activation_name=spec.activation, output_activation=spec.output_activation,
        )  # fmt: skip
        for ops in (native, eager):  # the C kernel's loops and the eager ops
            monkeypatch.setattr(fused_mlp_torch, "_native", ops)
            points, table = x.clone().requires_grad_(True), params.clone().requires_grad_(True)
            out = fused_mlp(points, table, spec)
            got = (out, *torch.autograd.grad(out, (points, table), grad_out))
            # bit for bit: the reference states the same arithmetic model element by element
            for value, expected in zip(got, want, strict=True):
                assert torch.equal(value.double(), torch.tensor(expected).double()), spec


# ------------------------------------------------------------------------------ FP8

FP8_LARGEST = {E4M3: 448.0, E5M2: 57344.0}
# E5M2's largest finite value is 1.75 * 2^15; values from 1.875 * 2^15 (the midpoint to the
# next binade's 2^16, a tie that rounds to the even code, inf) on round to infinity.
E5M2_OVERFLOW = 61440.0


def _fp8_code(value: float, dtype: torch.dtype) -> int | None:
    """The documented cast of an f32 value: round to nearest even; E4M3 saturates at +-448,
    infinities included; E5M2 rounds to infinity past its range; None for NaN."""
    if math.isnan(value):
        return None
    if dtype == E4M3 and abs(value) > 448.0:
        value = math.copysign(448.0, value)
    if dtype == E5M2 and abs(value) >= E5M2_OVERFLOW:
        return 0xFC if value < 0 else 0x7C
    return fp8_reference.fp8_code(value, dtype)


def _row_scale(row: np.ndarray, dtype: torch.dtype, margin: int = 0) -> np.float32:
    """The scale a row (or a tensor) is quantised with under the current recipe, in float32
    numpy scalars: fp8_max / amax / 2^margin, 1 where that is not a finite positive number
    (zero row, tiny amax, inf or NaN), and fp8_max / amax where amax * scale overflows."""
    amax = np.float32(np.nan) if np.isnan(row).any() else np.float32(np.abs(row).max())
    with np.errstate(all="ignore"):
        quotient = np.float32(np.float32(FP8_LARGEST[dtype]) / amax)
        scale = np.float32(quotient / np.float32(2**margin))
        if not (np.isfinite(quotient) and quotient > 0):
            scale = np.float32(1.0)
        if np.float32(amax * scale) > FP8_LARGEST[dtype]:
            scale = quotient
    return scale


def _random_rows(rng: random.Random, rows: int, cols: int) -> torch.Tensor:
    """Rows of very different magnitudes (float32 subnormals to near its max), zero rows,
    rows of float32's extremes, and now and then an inf or a NaN."""
    x = np.zeros((rows, cols), dtype=np.float32)
    for i in range(rows):
        kind, magnitude = rng.random(), 10 ** rng.uniform(-44, 38)
        for j in range(cols):
            if kind < 0.1:
                value = 0.0
            elif kind < 0.2:
                value = rng.choice([0.0, -0.0, 1e-45, -1e-45, 1e-40, 3.4e38, -3.4e38])
            else:
                value = rng.gauss(0.0, 1.0) * magnitude * 10 ** rng.uniform(-6, 0)
            x[i, j] = np.float32(value)
    special = rng.random()
    if special < 0.15:
        x[rng.randrange(rows), rng.randrange(cols)] = rng.choice([np.inf, -np.inf])
    elif special < 0.3:
        x[rng.randrange(rows), rng.randrange(cols)] = np.nan
    return torch.from_numpy(x)


def _assert_codes(q: torch.Tensor, x: np.ndarray, scales, dtype: torch.dtype) -> None:
    """Each code of ``q`` is the documented cast of ``x * scale`` (one f32 multiply)."""
    codes = q.view(torch.uint8).numpy()
    for (i, j), value in np.ndenumerate(x):
        with np.errstate(all="ignore"):
            scaled = float(np.float32(value * scales[i]))
        want = _fp8_code(scaled, dtype)
        if want is None:
            assert math.isnan(float(q[i, j].float())), (value, scales[i])
        else:
            assert codes[i, j] == want, (value, scales[i], hex(codes[i, j]), hex(want))


def test_rowwise_quantisation_matches_the_per_element_reference():
    rng = random.Random(41)
    for _ in range(120):
        x = _random_rows(rng, rng.randint(1, 6), rng.randint(1, 9))
        dtype, margin = rng.choice([E4M3, E5M2]), rng.choice([0, 0, 1, 3])
        q, scale_inv, amax, used = quantize_fp8_rowwise(x, dtype, margin)
        rows = x.numpy()
        scales = [_row_scale(row, dtype, margin) for row in rows]
        for i, row in enumerate(rows):
            # an inf row: scale fp8_max / inf = 0 (its infs become NaN), as documented
            assert np.array_equal(used[i].numpy(), [scales[i]], equal_nan=True), row
            with np.errstate(all="ignore"):
                inverse = np.float32(np.float32(1.0) / scales[i])
            assert np.array_equal(scale_inv[i].numpy(), [inverse], equal_nan=True), row
            assert np.array_equal(amax[i].numpy(), [np.abs(row).max()], equal_nan=True)
        _assert_codes(q, rows, scales, dtype)


def test_per_tensor_quantisation_with_any_scale_matches_the_per_element_reference():
    rng = random.Random(42)
    for _ in range(120):
        x = _random_rows(rng, rng.randint(1, 4), rng.randint(1, 9))
        if not bool(torch.isfinite(x).all()):
            continue  # a non-finite amax is the rowwise test's and the delayed test's
        dtype = rng.choice([E4M3, E5M2])
        scale = np.float32(10 ** rng.uniform(-30, 30))
        q, _, _, used = quantize_fp8(x, torch.tensor(scale), dtype)
        amax = np.float32(np.abs(x.numpy()).max())
        # the recipe's scale unless amax * scale overflows: then fp8_max / amax
        with np.errstate(all="ignore"):
            overflows = np.float32(amax * scale) > FP8_LARGEST[dtype]
            want = np.float32(np.float32(FP8_LARGEST[dtype]) / amax) if overflows else scale
        assert used.item() == want
        _assert_codes(q, x.numpy(), [want] * x.shape[0], dtype)


def _fake_quantized(x: np.ndarray, kind: str) -> np.ndarray:
    """float64 values of the documented fake quantisation of a finite [out, in] ``x``."""
    out = np.zeros(x.shape, dtype=np.float64)
    rows = x.reshape(1, -1) if kind == "fp8" else x
    flat = out.reshape(rows.shape)
    for i, row in enumerate(rows):
        if kind == "int8":
            scale = np.float32(np.float32(np.abs(row).max()) / np.float32(127))
            scale = scale if scale > 0 else np.float32(1.0)
            for j, value in enumerate(row):
                code = min(
                    127.0, max(-127.0, float(np.round(np.float64(np.float32(value / scale)))))
                )
                flat[i, j] = float(np.float32(np.float32(code) * scale))
        else:
            scale = _row_scale(row, E4M3)
            inverse = np.float32(np.float32(1.0) / scale)
            for j, value in enumerate(row):
                code = _fp8_code(float(np.float32(value * scale)), E4M3)
                flat[i, j] = float(
                    np.float32(np.float32(fp8_reference.fp8_value(code, E4M3)) * inverse)
                )
    return out


def test_fake_quantisation_matches_the_per_element_reference():
    rng = random.Random(43)
    for _ in range(80):
        x = _random_rows(rng, rng.randint(1, 5), rng.randint(1, 9))
        if not bool(torch.isfinite(x).all()):
            continue
        for kind in ("int8", "fp8", "fp8_rowwise"):
            want = torch.from_numpy(_fake_quantized(x.numpy(), kind))
            got = fake_quantize(x.clone().requires_grad_(True), kind)
            assert torch.equal(got.double(), want), (kind, x)
            if kind != "int8":
                got = e4m3_values(x, rowwise=kind == "fp8_rowwise")
                assert torch.equal(got.double(), want), (kind, x)


def test_delayed_scaling_follows_its_amax_history_over_random_sequences():
    rng = random.Random(44)
    for case in range(60):
        dtype, length = rng.choice([E4M3, E5M2]), rng.randint(1, 5)
        margin, algo = rng.choice([0, 0, 2]), rng.choice(AMAX_COMPUTE_ALGOS)
        state = ScalingState(dtype, ScalingRecipe("delayed", margin, length, algo), None)
        scale, history = np.float32(1.0), [np.float32(0.0)] * length
        overflows = nonfinite = 0
        for step in range(rng.randint(1, 8)):
            x = _random_rows(rng, 2, rng.randint(1, 6))
            record = rng.random() < 0.8
            q, _, used = state.quantize(x, record)
            rows = x.numpy()
            amax = np.float32(np.nan) if np.isnan(rows).any() else np.float32(np.abs(rows).max())
            with np.errstate(all="ignore"):
                overflow = np.float32(amax * scale) > FP8_LARGEST[dtype]
                want = np.float32(np.float32(FP8_LARGEST[dtype]) / amax) if overflow else scale
            assert np.array_equal(used.numpy(), want, equal_nan=True), (case, step)
            _assert_codes(q, rows, [want] * rows.shape[0], dtype)
            if record:
                if np.isfinite(amax):  # only finite amaxes enter the history
                    history = [amax, *history[:-1]]
                    overflows += bool(overflow)
                else:
                    nonfinite += 1
                reduced = history[0] if algo == "most_recent" else max(history)
                with np.errstate(all="ignore"):
                    quotient = np.float32(np.float32(FP8_LARGEST[dtype]) / reduced)
                if np.isfinite(quotient):  # else the scale is kept
                    scale = np.float32(quotient / np.float32(2**margin))
            assert state.scale.item() == scale, (case, step)
            assert state.history.tolist() == [float(v) for v in history], (case, step)
        assert (state.overflows, state.nonfinite) == (overflows, nonfinite), case


def test_the_fused_quantisation_op_and_its_eager_twin_agree_over_random_arguments():
    rng = random.Random(45)
    for case in range(150):
        rows, cols = rng.randint(1, 7), rng.randint(1, 40)
        x = _random_rows(rng, rows, cols)
        fp8_format, recipe = rng.choice([0, 1]), rng.choice(list(RECIPE_CODES.values()))
        q_dtype = rng.choice([E5M2 if fp8_format else E4M3, torch.float32, torch.float64])
        pad = rng.choice([0, 0, 16])
        args = (
            torch.tensor(np.float32(10 ** rng.uniform(-20, 20))),  # scale
            torch.tensor(np.float32(np.abs(np.random.default_rng(case).standard_normal(3)))),
            fp8_format, recipe, rng.choice([0, 1]), rng.random() < 0.5, rng.random() < 0.6,
            q_dtype, pad, rng.choice([0, 16]) if pad else 0,
        )  # fmt: skip
        fused = fp8_quantize(x, *[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
        eager = fp8_quantize_reference(x, *args)
        for got, want in zip(fused, eager, strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape, (case, args)
            got, want = got.float(), want.float()
            assert torch.equal(got.isnan(), want.isnan()), (case, args)
            assert torch.equal(got.nan_to_num(), want.nan_to_num()), (case, args)


def test_rowwise_spread_matches_the_per_element_reference_over_random_rows():
    rng = random.Random(46)
    for _ in range(150):
        rows = rng.randint(1, 5)
        x = _random_rows(rng, rows, rng.randint(1, 6))
        dtype = rng.choice([E4M3, E5M2])
        _, _, amax, used = quantize_fp8_rowwise(x, dtype)
        spread, flushed = rowwise_spread(x, used, amax, dtype).tolist()
        matrix = x.numpy()
        live = [i for i in range(rows) if 0 < amax[i].item() < math.inf]
        scales = [float(_row_scale(matrix[i], dtype)) for i in live]
        # log2(largest / smallest) row scale, in float64 (the float32 quotient can overflow);
        # the float32 result is a difference of two float32 log2 values of up to ~150 in size:
        # a few float32 ulps of each
        want = math.log2(max(scales) / min(scales)) if len(live) > 1 else 0.0
        size = abs(math.log2(max(scales))) + abs(math.log2(min(scales))) if live else 0.0
        assert spread == pytest.approx(want, rel=0, abs=4 * 2.0**-24 * (size + 1)), matrix
        # one current scale for the tensor, from the largest finite row amax
        tensor = np.stack([matrix[i] for i in live]) if live else np.zeros((1, 1), np.float32)
        scale = _row_scale(tensor, dtype)
        nonzero = [v for v in matrix.ravel() if v != 0]
        lost = 0
        for value in nonzero:
            with np.errstate(all="ignore"):
                code = _fp8_code(float(np.float32(value * scale)), dtype)
            lost += code is not None and code & 0x7F == 0
        assert flushed == pytest.approx(lost / max(len(nonzero), 1), rel=1e-6), matrix


def test_rowwise_spread_of_rows_far_apart_is_finite():
    # row scales 448 / 2^-90 = 448 * 2^90 and 448 / 2^60: 150 binades apart, beyond float32's
    # largest quotient (2^128)
    x = torch.tensor([[2.0**-90, 0.0], [2.0**60, -1.0]])
    _, _, amax, used = quantize_fp8_rowwise(x, E4M3)
    assert rowwise_spread(x, used, amax, E4M3)[0].item() == 150.0


def test_quantization_error_matches_float64_norms_at_any_magnitude():
    rng = random.Random(47)
    for _ in range(150):
        x = _random_rows(rng, 1, rng.randint(1, 12))[0]
        if not bool(torch.isfinite(x).all()):
            continue
        q = fake_quantize(x.view(1, -1), rng.choice(["int8", "fp8"])).view(-1)
        relative, flushed = quantization_error(x, q).tolist()
        values, rounded = x.double().tolist(), q.double().tolist()
        # math.hypot: the Euclidean norm without overflow or underflow of the squares
        norm = math.hypot(*values)
        error = math.hypot(*(b - a for a, b in zip(values, rounded, strict=True)))
        want = error / norm if norm > 0 else 0.0
        assert relative == pytest.approx(want, rel=2**-20), values  # float64 norms, f32 result
        nonzero = [b for a, b in zip(values, rounded, strict=True) if a != 0]
        want = sum(b == 0 for b in nonzero) / max(len(nonzero), 1)
        assert flushed == pytest.approx(want, rel=2**-23), values


@pytest.mark.parametrize("magnitude", [2.0**-80, 2.0**80])
def test_quantization_error_of_tiny_and_huge_tensors_by_hand(magnitude):
    # ||(0.5, -0.5)|| / ||(3, 4)|| = sqrt(0.5) / 5, whatever power of two scales both
    x = torch.tensor([3.0, 4.0]) * magnitude
    q = torch.tensor([3.5, 3.5]) * magnitude
    relative, flushed = quantization_error(x, q).tolist()
    assert relative == pytest.approx(math.sqrt(0.5) / 5, rel=2**-22)
    assert flushed == 0.0
