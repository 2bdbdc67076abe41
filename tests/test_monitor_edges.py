"""Training-time precision statistics and validation at their edges: empty and float64
tensors, the monitor's keys and its state between iterations, box filtering, the baseline
colour, stuck pixels and the saved images, against per-element counts and float64 references."""

import copy
import dataclasses
import math

import numpy as np
import pytest
import torch

from mptex import MLPTexture3D
from mptex.diagnostics import TEXTURE_CONFIGS, PrecisionMonitor, tensor_statistics
from mptex.precision import StepResult
from mptex.train.monitor import _fractions, _Tally
from mptex.train.validation import box_filter, evaluate, save_val_images

AABB = [[-1.0, -1.0, -1.0], [1.0, 1.0, 1.0]]


def _texture():
    torch.manual_seed(0)
    return MLPTexture3D(AABB, precision="f32", backend="torch", **TEXTURE_CONFIGS["small"])


def _points(n, seed=1):
    return torch.rand(n, 3, generator=torch.Generator().manual_seed(seed)) * 2 - 1


# ----------------------------------------------------------------------------- statistics
def test_an_empty_tensor_has_zero_fractions():
    assert tensor_statistics(torch.empty(0)) == {
        "zero_frac": 0.0, "subnormal_frac": 0.0, "nonfinite_frac": 0.0, "maxabs": 0.0
    }  # fmt: skip


def test_float64_statistics_match_a_per_element_count():
    # float64's own subnormals (below 2**-1022), and an f32 threshold for an f64 copy.
    edges = [0.0, -0.0, 5e-324, -1e-310, 2.0**-1022, 1e-40, math.inf, -math.inf, math.nan, -2.5,
             1.0, 3e300]  # fmt: skip
    values = torch.tensor(edges, dtype=torch.float64)
    for dtype in (torch.float64, torch.float32):
        tiny = torch.finfo(dtype).tiny
        mags = [abs(v) for v in edges]
        zero = sum(m == 0 for m in mags)
        below = sum(m < tiny for m in mags)
        finite = [m for m in mags if math.isfinite(m)]
        assert tensor_statistics(values, dtype) == {
            "zero_frac": zero / 12,
            "subnormal_frac": (below - zero) / 12,
            "nonfinite_frac": (12 - len(finite)) / 12,
            "maxabs": 3e300,
        }, dtype


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_largest_finite_value_of_a_dtype_is_finite(dtype):
    # IEEE 754: finfo.max is a finite number; only inf and NaN count as non-finite. Counted by
    # hand: [max, -max, inf, 1] holds 1 non-finite value of 4, the largest finite |x| max.
    largest = torch.finfo(dtype).max
    values = torch.tensor([largest, -largest, math.inf, 1.0], dtype=dtype)
    assert tensor_statistics(values) == {
        "zero_frac": 0.0, "subnormal_frac": 0.0, "nonfinite_frac": 0.25, "maxabs": largest
    }  # fmt: skip


def test_an_empty_call_merged_into_a_sites_statistics_changes_nothing_but_the_count():
    # Counted by hand: [0, 2, inf] then nothing: 1 zero, 1 non-finite of 3; largest 2.
    merged = _Tally(torch.tensor([0.0, 2.0, math.inf]), torch.float32).merge(
        _Tally(torch.empty(0), torch.float32)
    )
    values = [*merged.below.tolist(), float(merged.numel), merged.largest.item()]
    assert _fractions(values) == {"zero_frac": 1 / 3, "subnormal_frac": 0.0,
                                  "nonfinite_frac": 1 / 3, "maxabs": 2.0}  # fmt: skip


# ----------------------------------------------------------------------------- the monitor
def test_each_site_reports_the_documented_keys_only():
    # Activations: max-abs and the non-finite fraction; output gradients: the three fractions;
    # parameter gradients: the three fractions and max-abs (the class docstring's table).
    texture = _texture()
    monitor = PrecisionMonitor(texture, every=1)
    monitor.start(0)
    texture.sample(_points(64)).sum().backward()
    stats = monitor.collect()
    want = {"iteration"} | {f"output.saturated_frac.{c}" for c in range(3)}
    for site in ("encoder", "net.0", "net.1", "net.2"):
        want |= {f"{site}.act_{k}" for k in ("maxabs", "nonfinite_frac")}
        want |= {f"{site}.out_grad_{k}" for k in ("zero_frac", "subnormal_frac", "nonfinite_frac")}
        want |= {f"{site}.grad_{k}" for k in ("zero_frac", "subnormal_frac", "nonfinite_frac",
                                               "maxabs")}  # fmt: skip
    assert set(stats) == want


def test_a_sampled_iteration_is_collected_once():
    texture = _texture()
    monitor = PrecisionMonitor(texture, every=1)
    monitor.start(0)
    texture.sample(_points(16)).sum().backward()
    assert monitor.collect() is not None
    assert monitor.collect() is None  # nothing armed until the next start


def test_a_restarted_iteration_forgets_what_the_previous_start_recorded():
    # start(0) with a large batch and a saturating output, then start(0) again without a
    # collect: the statistics are those of the second batch alone, counted here per element.
    texture = _texture()
    monitor = PrecisionMonitor(texture, every=1)
    last = texture.net.layers[-1].weight
    kept = last.detach().clone()
    monitor.start(0)
    with torch.no_grad():
        texture.encoder.params.mul_(1e4)
        last.copy_(torch.full_like(last, 1e3))
    texture.sample(_points(2048)).sum().backward()
    with torch.no_grad():
        texture.encoder.params.div_(1e4)
        last.copy_(kept)
    texture.zero_grad(set_to_none=True)
    logits = []
    hook = texture.net.register_forward_hook(lambda module, args, out: logits.append(out))
    monitor.start(0)
    texture.sample(_points(4, seed=2)).sum().backward()
    hook.remove()
    stats = monitor.collect()
    grad = texture.encoder.params.grad
    # A float64 count over the whole table: the fraction exactly as the monitor forms it.
    assert stats["encoder.grad_zero_frac"] == int((grad == 0).sum()) / grad.numel()
    saturated = (logits[0].abs() > 8).double().mean(0).tolist()
    assert [stats[f"output.saturated_frac.{c}"] for c in range(3)] == saturated


@pytest.mark.parametrize("sizes", [(16, 48), (1,)])
def test_output_saturation_is_counted_over_every_forward_of_the_iteration(sizes):
    # A saturating first forward (last layer +-1e3) and an unsaturated second one, or a single
    # point: per channel, the fraction of all the iteration's rows with |logit| > 8, counted
    # here over the logits themselves.
    texture = _texture()
    monitor = PrecisionMonitor(texture, every=1)
    last = texture.net.layers[-1].weight
    kept = last.detach().clone()
    logits = []
    hook = texture.net.register_forward_hook(lambda module, args, out: logits.append(out))
    monitor.start(0)
    with torch.no_grad():
        texture.encoder.params.mul_(1e4)
        last.copy_(torch.tensor([1e3, 0.0, -1e3])[:, None].expand_as(last))
        texture.sample(_points(sizes[0]))
        texture.encoder.params.div_(1e4)
        last.copy_(kept)
        for n in sizes[1:]:
            texture.sample(_points(n, seed=2))
    hook.remove()
    stats = monitor.collect()
    want = (torch.cat(logits).abs() > 8).double().mean(0).tolist()
    assert want[0] > 0  # the first forward saturated
    assert [stats[f"output.saturated_frac.{c}"] for c in range(3)] == want


def test_a_frozen_parameter_is_not_watched():
    # No gradient reaches a frozen weight: the monitor reports its site's activations but no
    # parameter gradient for it.
    texture = _texture()
    texture.net.layers[1].weight.requires_grad_(False)
    monitor = PrecisionMonitor(texture, every=1)
    monitor.start(0)
    texture.sample(_points(16)).sum().backward()
    stats = monitor.collect()
    assert "net.1.act_maxabs" in stats and "net.0.grad_zero_frac" in stats
    assert not any(key.startswith("net.1.grad_") for key in stats)


def test_a_layer_computing_in_float32_counts_float32_subnormals():
    # per_layer: f16 layers, the last in f32. A gradient of ~1e-6 on the last layer is an f16
    # subnormal (below 2**-14) but a normal f32 number: counted against f32's 2**-126.
    torch.manual_seed(0)
    texture = MLPTexture3D(AABB, precision="per_layer", backend="torch",
                           **TEXTURE_CONFIGS["small"])  # fmt: skip
    assert texture.net.layers[2].compute_dtype == torch.float32
    monitor = PrecisionMonitor(texture, every=1)
    monitor.start(0)
    (texture.sample(_points(64)).float().sum() * 1e-6).backward()
    stats = monitor.collect()
    grad = texture.net.layers[2].weight.grad.abs()
    assert ((grad > 0) & (grad < 2.0**-14)).any()  # the f16 count would differ
    want = int(((grad > 0) & (grad < 2.0**-126)).sum()) / grad.numel()
    assert stats["net.2.grad_subnormal_frac"] == want


# ----------------------------------------------------------------------------- validation
def test_box_filter_refuses_a_width_that_is_not_a_multiple_of_spp():
    with pytest.raises(ValueError, match=r"^img: expected a height and width divisible by spp=2, "
                       r"got 4x5$"):  # fmt: skip
        box_filter(torch.zeros(1, 4, 5, 3), 2)


def test_box_filter_averages_each_block_against_a_loop():
    img = torch.arange(2 * 6 * 4 * 3, dtype=torch.float64).reshape(2, 6, 4, 3) ** 1.5
    got = box_filter(img, 2)
    want = torch.zeros(2, 3, 2, 3, dtype=torch.float64)
    for b in range(2):
        for y in range(3):
            for x in range(2):
                want[b, y, x] = img[b, 2 * y : 2 * y + 2, 2 * x : 2 * x + 2].mean((0, 1))
    # float64 means of four values each way: to 1e-12 relative.
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


def test_saved_images_are_reference_then_prediction_and_no_more_than_there_are(tmp_path):
    iio = pytest.importorskip("imageio.v3")
    # Two views asked for five: two files; black reference on the left, white prediction on
    # the right (sRGB of 0 and 1 are 0 and 255).
    evaluation = {"ref": torch.zeros(2, 3, 4, 3), "pred": torch.ones(2, 3, 4, 3)}
    save_val_images(tmp_path, evaluation, 5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["val_000.png", "val_001.png"]
    png = np.asarray(iio.imread(tmp_path / "val_000.png"))
    assert png.shape[:2] == (3, 8)
    assert (png[:, :4, :3] == 0).all() and (png[:, 4:, :3] == 255).all()


@pytest.fixture(scope="module")
def knot():
    """The knot at 8 x 8, two validation views, kd shading over white (test_train_validation's
    setup): alpha 0 or 1, black where uncovered."""
    from test_train_validation import _spp_setup

    return _spp_setup(8)


def _with_reference(monkeypatch, scene, alpha, uncovered_rgb=(0.0, 0.0, 0.0)):
    """Make the validation references' covered pixels ``alpha`` and the uncovered ones
    ``uncovered_rgb`` with alpha 0."""
    real = scene.views

    def views(split, indices, spp=1):
        v = real(split, indices, spp)
        covered = v.mask[..., None]
        rgb = torch.where(covered, v.rgba[..., :3], torch.tensor(uncovered_rgb))
        a = torch.where(v.mask, torch.tensor(alpha), torch.tensor(0.0))
        return dataclasses.replace(v, rgba=torch.cat([rgb, a[..., None]], -1))

    monkeypatch.setattr(scene, "views", views)
    return views("val", range(scene.n_val_views))


def _srgb_psnr64(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """nvdiffrec's per-image PSNR in float64: sRGB, clamped to [0, 1]."""

    def srgb(x):
        return np.clip(np.where(x <= 0.0031308, x * 12.92, 1.055 * np.abs(x) ** (1 / 2.4) - 0.055),
                       0, 1)  # fmt: skip

    return -10 * np.log10(((srgb(a) - srgb(b)) ** 2).reshape(len(a), -1).mean(1))


def test_the_baseline_colour_is_the_alpha_weighted_mean_of_the_reference(knot, monkeypatch):
    # Half-transparent covered pixels and a red background colour under alpha 0: the
    # constant colour weighs each pixel's colour by its alpha (the red counts for nothing).
    full, scene, texture, light = knot
    views = _with_reference(monkeypatch, scene, 0.5, uncovered_rgb=(1.0, 0.0, 0.0))
    got = evaluate(texture, scene, full["train"], light)
    rgba, mask = views.rgba.double().numpy(), views.mask.double().numpy()[..., None]
    rgb, alpha = rgba[..., :3], rgba[..., 3:]
    mean = (rgb * alpha).sum((0, 1, 2)) / alpha.sum()
    ref = rgb * alpha + (1 - alpha)  # over white
    constant = mean * mask + (1 - mask)
    # float32 images against float64: ~1e-6 relative in the MSE, ~5e-6 dB.
    assert got["baseline_psnr"] == pytest.approx(_srgb_psnr64(constant, ref).mean(), abs=1e-3)


def test_a_reference_without_any_alpha_has_a_black_baseline(knot, monkeypatch):
    # No alpha anywhere: the reference is all white background, the constant colour black
    # (0 / a clamped 1e-8) on the covered pixels, an error of exactly 1 there in sRGB: each
    # view's baseline PSNR is -10 log10(its covered fraction).
    full, scene, texture, light = knot
    views = _with_reference(monkeypatch, scene, 0.0)
    got = evaluate(texture, scene, full["train"], light)
    covered = views.mask.double().mean((1, 2)).numpy()
    assert got["baseline_psnr"] == pytest.approx(float(np.mean(-10 * np.log10(covered))), abs=1e-4)


@pytest.mark.parametrize("alpha, counted", [(0.5, True), (0.49, False)])
def test_stuck_pixels_count_where_the_reference_is_at_least_half_opaque(
    knot, monkeypatch, alpha, counted
):
    # Logits scaled far past 8: per covered pixel and channel, stuck = saturated and more than
    # 0.1 from the reference's colour, at a pixel whose alpha is at least 0.5.
    full, scene, _, light = knot
    texture = copy.deepcopy(knot[2])
    with torch.no_grad():
        texture.net.layers[-1].weight.mul_(100.0)
    views = _with_reference(monkeypatch, scene, alpha)
    logits = []
    hook = texture.net.register_forward_hook(lambda module, args, out: logits.append(out))
    got = evaluate(texture, scene, full["train"], light)
    hook.remove()
    z, pred = logits[0].double(), got["pred"][views.mask].double()
    wrong = (pred - views.rgba[..., :3][views.mask].double()).abs() > 0.1
    stuck = ((z.abs() > 8) & wrong).double().mean(0).tolist()
    assert max(stuck) > 0.1  # the case is not vacuous
    want = stuck if counted else [0.0, 0.0, 0.0]
    assert got["saturation"]["stuck_fraction"] == pytest.approx(want, abs=1e-12)


def test_output_saturation_counts_logits_beyond_eight_and_no_others():
    # The last layer scaled so that the logits spread over [0, 16]: some lie in (4, 8], where a
    # smaller threshold would count them, some beyond 8. The monitor counts |z| > 8 only
    # (SATURATION_LOGIT), as counted here over the logits themselves.
    texture = _texture()
    points = _points(256)
    last = texture.net.layers[-1].weight
    with torch.no_grad():
        last.mul_(16.0 / float(texture.net(texture.encoder(points)).abs().max()))
    logits = []
    hook = texture.net.register_forward_hook(lambda module, args, out: logits.append(out))
    monitor = PrecisionMonitor(texture, every=1)
    monitor.start(0)
    texture.sample(points).sum().backward()
    hook.remove()
    stats = monitor.collect()
    magnitude = logits[0].detach().abs().double()
    want = (magnitude > 8).double().mean(0).tolist()
    assert bool(((magnitude > 4) & (magnitude <= 8)).any()) and max(want) > 0
    assert [stats[f"output.saturated_frac.{c}"] for c in range(3)] == want


@pytest.mark.parametrize("skipped, scale", [(True, 32768.0), (False, 128.0)])
def test_the_sampled_statistics_carry_the_steps_outcome(skipped, scale):
    texture = _texture()
    monitor = PrecisionMonitor(texture, every=1)
    monitor.start(0)
    texture.sample(_points(8)).sum().backward()
    stats = monitor.collect(StepResult(skipped=skipped, loss_scale=scale))
    assert stats["skipped"] is skipped and stats["loss_scale"] == scale


def test_every_sites_statistics_cover_every_forward_of_the_iteration():
    # Two forwards between start and collect (as the smoothness regulariser's separate
    # forward): each site's largest activation is that of both calls, here taken over the
    # outputs themselves; the first call (many points) holds the larger one.
    texture = _texture()
    layers = {
        "encoder": texture.encoder,
        **{f"net.{i}": m for i, m in enumerate(texture.net.layers)},
    }
    outputs = {site: [] for site in layers}
    hooks = [module.register_forward_hook(lambda m, a, out, site=site: outputs[site].append(out))
             for site, module in layers.items()]  # fmt: skip
    monitor = PrecisionMonitor(texture, every=1)
    monitor.start(0)
    (texture.sample(_points(2048)).sum() + texture.sample(_points(1, seed=2)).sum()).backward()
    for hook in hooks:
        hook.remove()
    stats = monitor.collect()
    for site, (first, second) in outputs.items():
        largest = [float(out.detach().abs().max()) for out in (first, second)]
        assert largest[0] > largest[1], site
        assert stats[f"{site}.act_maxabs"] == largest[0], site
