"""The reported numbers (validation PSNR, constant-colour baseline, saturation fractions) on tiny
constructed images, against hand-computed values and a float64 brute force of their definitions
in docs/metrics.md."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mptex.train.validation import evaluate

_SETTINGS = {"val_spp": 1, "shading": "kd", "val_background": "white", "ambient": 0.25}
_LIGHT = torch.tensor([0.0, 0.0, 1.0])


def _linear(srgb: float) -> float:
    """The sRGB curve's inverse in float64 (IEC 61966-2-1), independent of mptex."""
    return srgb / 12.92 if srgb <= 0.04045 else ((srgb + 0.055) / 1.055) ** 2.4


def _srgb_f64(x: np.ndarray) -> np.ndarray:
    return np.where(x <= 0.0031308, x * 12.92, 1.055 * np.abs(x) ** (1 / 2.4) - 0.055)


def _psnr_f64(pred: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """nvdiffrec's PSNR in float64: sRGB, clamp to [0, 1], -10 log10(MSE) over each image."""
    a, b = np.clip(_srgb_f64(pred), 0, 1), np.clip(_srgb_f64(ref), 0, 1)
    mse = ((a - b) ** 2).reshape(len(a), -1).mean(1)
    return -10 * np.log10(np.maximum(mse, 1e-10))


class _PositionTexture:
    """A texture whose value (and logit) at a point is the point: each covered pixel's
    prediction is the position its G-buffer holds, set by the test."""

    def __init__(self):
        self.net = torch.nn.Identity()  # evaluate() hooks the net's output as the logits

    def sample(self, points: torch.Tensor, check: bool = True) -> torch.Tensor:
        return self.net(points)


def _scene(rgba: torch.Tensor, mask: torch.Tensor, position: torch.Tensor):
    """A stand-in for Scene with point-sampled validation views only."""

    def views(split, indices, spp=1):
        assert split == "val" and spp == 1
        idx = torch.tensor(list(indices))
        gbuffer = SimpleNamespace(mask=mask[idx], position=position[idx], normal=None)
        return SimpleNamespace(
            rgba=rgba[idx], gbuffer=gbuffer, mask=mask[idx], position=position[idx]
        )

    return SimpleNamespace(n_val_views=rgba.shape[0], views=views)


def _evaluate(rgba, mask, position, settings=_SETTINGS) -> dict:
    """evaluate() of the stand-in texture on the stand-in scene, float32 inputs."""
    scene = _scene(rgba.float(), mask, position.float())
    return evaluate(_PositionTexture(), scene, settings, _LIGHT)


def test_psnr_is_the_mean_of_hand_computed_per_image_psnrs():
    # Two fully covered, opaque 2x2 views, reference sRGB 0.5 everywhere. View 0's prediction is
    # sRGB 0.6 at one pixel: sRGB MSE = 0.1^2 * 3 / 12 = 0.0025, PSNR = 10 log10(400) dB.
    # View 1 matches exactly: the MSE floor 1e-10 makes it 100 dB. The reported PSNR is the mean
    # of the two (not the PSNR of the mean MSE, 29.03 dB).
    half, six = _linear(0.5), _linear(0.6)
    rgba = torch.full((2, 2, 2, 4), half, dtype=torch.float64)
    rgba[..., 3] = 1.0
    position = rgba[..., :3].clone()
    position[0, 0, 0] = six
    mask = torch.ones(2, 2, 2, dtype=torch.bool)
    got = _evaluate(rgba, mask, position)
    view0 = 10 * math.log10(400)  # 26.0206 dB
    # float32 colours: a relative error ~1e-7 in a difference of 0.1 is ~1e-5 dB.
    np.testing.assert_allclose(got["psnr_per_image"], [view0, 100.0], atol=1e-3)
    assert got["psnr"] == pytest.approx((view0 + 100.0) / 2, abs=1e-3)
    # The baseline: the mean colour is the reference's own, a perfect match in both views.
    assert got["baseline_psnr"] == pytest.approx(100.0, abs=1e-3)


def test_psnr_counts_the_background_pixels_and_clamps_before_the_error():
    # One 1x4 view over white: two covered pixels, two background pixels (alpha 0, the white
    # background in both images: no error there, but they count in the mean). Covered pixel 0:
    # reference sRGB 0.2, prediction 0.0 (error 0.2); covered pixel 1: reference sRGB 1.0,
    # prediction linear 3.0 (sRGB ~1.6, clamped to 1: no error). MSE = 0.2^2 * 3 / 12 = 0.01.
    rgba = torch.zeros(1, 1, 4, 4, dtype=torch.float64)
    rgba[0, 0, 0] = torch.tensor([_linear(0.2)] * 3 + [1.0])
    rgba[0, 0, 1] = torch.tensor([1.0, 1.0, 1.0, 1.0])
    mask = torch.tensor([[[True, True, False, False]]])
    position = torch.zeros(1, 1, 4, 3, dtype=torch.float64)
    position[0, 0, 1] = 3.0
    got = _evaluate(rgba, mask, position)
    assert got["psnr_per_image"][0] == pytest.approx(20.0, abs=1e-3)  # -10 log10(0.01)
    # The prediction is reported as rendered (linear, unclamped), composited over white.
    expected_pred = torch.tensor([[[[0.0] * 3, [3.0] * 3, [1.0] * 3, [1.0] * 3]]])
    torch.testing.assert_close(got["pred"], expected_pred, rtol=0, atol=0)


@pytest.mark.parametrize("background", ["white", "black"])
def test_baseline_is_the_alpha_weighted_mean_colour_scored_like_the_prediction(background):
    # Image-like references: fractional alpha, and colour where alpha is 0 (an unpremultiplied
    # RGBA image keeps whatever colour its transparent pixels had): the best constant colour is
    # the alpha-weighted mean, sum(rgb * a) / sum(a), drawn at the covered pixels (the mask,
    # not the alpha) over the validation background.
    gen = torch.Generator().manual_seed(3)
    rgba = 0.3 * torch.rand(2, 3, 4, 4, generator=gen, dtype=torch.float64)
    alpha = torch.tensor([[1.0, 0.5, 0.25, 0.0], [1.0, 1.0, 0.0, 0.75], [0.0, 0.5, 1.0, 1.0]])
    rgba[alpha.expand(2, 3, 4) == 0] = 1.0  # white under alpha 0 (alpha is set next)
    rgba[..., 3] = alpha
    mask = (torch.tensor([[1, 1, 1, 0], [1, 1, 0, 1], [0, 1, 1, 1]]) == 1).expand(2, 3, 4)
    position = torch.rand(2, 3, 4, 3, generator=gen, dtype=torch.float64)
    settings = {**_SETTINGS, "val_background": background}
    got = _evaluate(rgba, mask, position, settings)

    rgba64, a = rgba.float().double().numpy(), rgba.float().double().numpy()[..., 3:]
    bg = 1.0 if background == "white" else 0.0
    covered = mask.double().numpy()[..., None]
    ref = bg + (rgba64[..., :3] - bg) * a
    pred = bg + (position.float().double().numpy() - bg) * covered
    mean_color = (rgba64[..., :3] * a).sum((0, 1, 2)) / a.sum()
    constant = bg + (mean_color - bg) * covered
    # float32 image against float64: relative MSE error ~1e-6, ~5e-6 dB.
    np.testing.assert_allclose(got["psnr_per_image"], _psnr_f64(pred, ref), atol=1e-3)
    assert got["baseline_psnr"] == pytest.approx(_psnr_f64(constant, ref).mean(), abs=1e-3)
    # The test can fail: the unweighted mean, or the constant over the alpha, score otherwise.
    unweighted = rgba64[..., :3].reshape(-1, 3).mean(0)
    for other in (bg + (unweighted - bg) * covered, bg + (mean_color - bg) * a):
        assert abs(_psnr_f64(other, ref).mean() - got["baseline_psnr"]) > 0.05


def test_stuck_fraction_counts_a_reference_of_alpha_one_half_as_a_surface():
    # docs/metrics.md: a covered pixel whose reference is mostly background (alpha < 0.5) holds
    # no target colour. Four covered pixels with saturated logits (value 10, far from the
    # reference's 0.2): alpha 1, 0.5 (a target: the boundary is included), 0.49 and 0.
    rgba = torch.full((1, 1, 4, 4), 0.2)
    rgba[0, 0, :, 3] = torch.tensor([1.0, 0.5, 0.49, 0.0])
    mask = torch.ones(1, 1, 4, dtype=torch.bool)
    position = torch.full((1, 1, 4, 3), 10.0)
    got = _evaluate(rgba, mask, position)
    saturation = got["saturation"]
    assert saturation["covered_pixels"] == 4
    assert saturation["saturated_fraction"] == [1.0, 1.0, 1.0]
    assert saturation["stuck_fraction"] == [0.5, 0.5, 0.5]


def test_box_filter_means_each_block_and_refuses_a_width_spp_does_not_divide():
    from mptex.train.validation import box_filter

    img = torch.arange(2 * 4 * 6 * 1, dtype=torch.float32).reshape(2, 4, 6, 1)
    got = box_filter(img, 2)
    want = torch.tensor(
        [[img[b, 2 * y : 2 * y + 2, 2 * x : 2 * x + 2].mean() for y in range(2) for x in range(3)]
         for b in range(2)]
    ).reshape(2, 2, 3, 1)  # fmt: skip
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # means of 4 small integers: exact
    with pytest.raises(ValueError, match="img: expected a height and width divisible by spp=2"):
        box_filter(torch.zeros(1, 4, 5, 3), 2)


def test_saved_images_are_reference_then_prediction_in_8_bit_srgb(tmp_path):
    import imageio.v3 as iio

    from mptex.train.validation import save_val_images

    # Three 1x2 views; reference and prediction in distinct sRGB levels, written for two.
    ref = torch.full((3, 1, 2, 3), _linear(0.2))
    pred = torch.full((3, 1, 2, 3), _linear(0.8))
    pred[:, 0, 1] = 2.0  # beyond white: clamped to 255 in the PNG
    save_val_images(tmp_path / "images", {"ref": ref, "pred": pred}, n_images=2)
    assert sorted(p.name for p in (tmp_path / "images").iterdir()) == ["val_000.png", "val_001.png"]
    png = iio.imread(tmp_path / "images" / "val_001.png")
    # round(0.2 * 255) = 51, round(0.8 * 255) = 204: [reference | prediction] (docs/metrics.md).
    want = np.array([[[51] * 3, [51] * 3, [204] * 3, [255] * 3]], dtype=np.uint8)
    np.testing.assert_array_equal(png[..., :3], want)


# ----------------------------------------------------------------------------- training loss
def _srgb_scalar(x: float) -> float:
    return x * 12.92 if x <= 0.0031308 else 1.055 * x ** (1 / 2.4) - 0.055


def test_log_srgb_losses_match_hand_computed_values():
    from mptex.train.losses import image_loss

    # nvdiffrec's tone map: sRGB(log(clamp(x, 0, 65535) + 1)) on both images. x = e^l - 1 with
    # l = linear(0.5) maps to sRGB 0.5; 1e5 is clamped to 65535 (log 65536 = 11.09, sRGB ~2.97);
    # a negative value is clamped to 0. The target is 0 everywhere (tone-mapped to 0).
    x = math.exp(_linear(0.5)) - 1
    img = torch.tensor([[x, 1e5, -4.0]])
    target = torch.zeros(1, 3)
    errors = [0.5, _srgb_scalar(math.log(65536.0)), 0.0]
    # float32 pow/log against float64: a few ulps of values up to 3.
    assert float(image_loss(img, target, "logl1")) == pytest.approx(sum(errors) / 3, rel=1e-6)
    assert float(image_loss(img, target, "logl2")) == pytest.approx(
        sum(e * e for e in errors) / 3, rel=1e-6
    )
    # Both images are tone-mapped: swapped, the L1 is the same.
    assert float(image_loss(target, img, "logl1")) == pytest.approx(sum(errors) / 3, rel=1e-6)


def test_linear_losses_match_hand_computed_values():
    from mptex.train.losses import image_loss

    img = torch.tensor([[1.0, 0.0, 2.0]])
    target = torch.tensor([[0.0, 1.0, 2.0]])
    # No tone map (2.0 would tone-map to ~1.3): l1 = (1 + 1 + 0) / 3; mse of [3, 0, 6]
    # against [0, 1, 2] = (9 + 1 + 16) / 3.
    assert float(image_loss(img, target, "l1")) == pytest.approx(2 / 3, rel=1e-6)
    assert float(image_loss(img * 3, target, "mse")) == pytest.approx(26 / 3, rel=1e-6)
    # smape: |a - b| / (|a| + |b| + 0.01); relmse: (a - b)^2 / (a^2 + b^2 + 0.1).
    smape = (1 / 1.01 + 1 / 1.01 + 0.0) / 3
    relmse = (1 / 1.1 + 1 / 1.1 + 0.0) / 3
    assert float(image_loss(img, target, "smape")) == pytest.approx(smape, rel=1e-6)
    assert float(image_loss(img, target, "relmse")) == pytest.approx(relmse, rel=1e-6)


def test_lr_schedules_count_from_the_end_of_the_warmup():
    from mptex.train.losses import lr_schedule

    assert lr_schedule(2, warmup_iter=4) == 0.5
    assert lr_schedule(15, warmup_iter=5, lr_decay=0.1) == pytest.approx(0.1, rel=1e-12)
    # cosine: half-way between the warmup's end (5) and the run's end (15): 0.5.
    assert lr_schedule(10, 5, kind="cosine", iterations=15) == pytest.approx(0.5, rel=1e-12)
    assert lr_schedule(15, 5, kind="cosine", iterations=15) == pytest.approx(0.0, abs=1e-12)


def test_masked_image_loss_weighs_both_images_by_the_reference_alpha():
    from mptex.train.fused_loss import masked_image_loss

    # One pixel, alpha 0.25, white background: ref = 1 + (0.2 - 1) * 0.25 = 0.8; the loss
    # compares pred * 0.25 with 0.8 * 0.25 = 0.2: |0.1 - 0.2| = 0.1 for pred 0.4.
    pred = torch.full((1, 1, 1, 3), 0.4)
    rgba = torch.tensor([[[[0.2, 0.2, 0.2, 0.25]]]])
    white = torch.ones(1, 1, 1, 3)
    assert float(masked_image_loss(pred, rgba, white, "l1")) == pytest.approx(0.1, rel=1e-6)


def test_kd_smoothness_is_the_kd_channels_mean_difference_over_every_pixel():
    from mptex.train.fused_loss import kd_smoothness

    # Two covered points of a 10-pixel batch, 9 channels: only kd (0:3) counts.
    tex = torch.zeros(2, 9)
    jitter = torch.zeros(2, 9)
    jitter[0, 0:3] = torch.tensor([0.3, 0.0, 0.0])  # sum |d| / 3 = 0.1
    jitter[1, 0:3] = torch.tensor([0.1, 0.2, 0.3])  # 0.2
    jitter[:, 3:9] = 5.0  # ks and normal: not smoothed
    assert float(kd_smoothness(tex, jitter, pixels=10)) == pytest.approx(0.3 / 10, rel=1e-6)


# ----------------------------------------------------------------------------- shading
def test_composite_lerps_from_the_background_by_alpha():
    from mptex.train.shading import composite, draw_background

    rgb = torch.full((1, 1, 2, 3), 0.2)
    alpha = torch.tensor([[[[0.25], [1.0]]]])
    white = draw_background("white", (1, 1, 2, 3), "cpu", None)
    black = draw_background("black", (1, 1, 2, 3), "cpu", None)
    assert torch.equal(white, torch.ones(1, 1, 2, 3))
    assert torch.equal(black, torch.zeros(1, 1, 2, 3))
    # 1 + (0.2 - 1) * 0.25 = 0.8 over white, 0.2 * 0.25 = 0.05 over black; opaque: the colour.
    want_white = torch.tensor([0.8, 0.2]).view(1, 1, 2, 1).expand(1, 1, 2, 3)
    want_black = torch.tensor([0.05, 0.2]).view(1, 1, 2, 1).expand(1, 1, 2, 3)
    torch.testing.assert_close(composite(rgb, alpha, white), want_white, rtol=1e-6, atol=0)
    torch.testing.assert_close(composite(rgb, alpha, black), want_black, rtol=1e-6, atol=0)


def test_diffuse_shading_matches_hand_computed_lambert_terms():
    from mptex.train.shading import light_direction, shade

    # The light at 60 degrees from +z, given unnormalised: cos = 0.5 on a +z normal.
    light = light_direction({"light_dir": [0.0, 2 * math.sqrt(3.0), 2.0]})
    torch.testing.assert_close(light, torch.tensor([0.0, math.sqrt(3.0) / 2, 0.5]))
    tex = torch.zeros(3, 9)
    tex[:, 0:3] = torch.tensor([0.8, 0.4, 0.2])  # kd
    tex[:, 3:6] = 0.9  # ks: unused
    tex[:, 6:9] = 0.5  # normal offset 2 * 0.5 - 1 = 0: the geometric normal
    tex[2, 6:9] = torch.tensor([0.5, 0.5 + 0.5 * math.sqrt(3.0), 0.5])  # offset (0, sqrt 3, 0)
    normal = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, -1.0], [0.0, 0.0, 1.0]])
    got = shade(tex, normal, "diffuse", light, ambient=0.25)
    # 0.25 + 0.75 * cos: cos 0.5 (front), 0 (facing away: clamped, not |cos|), and for the
    # perturbed normal normalize((0, sqrt 3, 1)) = the light itself: cos 1.
    factors = torch.tensor([0.25 + 0.75 * 0.5, 0.25, 1.0]).unsqueeze(1)
    torch.testing.assert_close(got, factors * tex[:, 0:3], rtol=1e-6, atol=1e-7)


def test_render_batch_composites_covered_pixels_and_averages_smoothness_over_all_pixels():
    from mptex.train.shading import render_batch

    # A 1x4 view, pixels 0 and 2 covered; kd = position (dyadic values: the composite is
    # exact). The jitter moves x by 0.375: each covered point's term is 0.375 / 3 = 0.125,
    # averaged over the 4 pixels: 0.0625.
    mask = torch.tensor([[[True, False, True, False]]])
    position = torch.tensor([[[[0.125, 0.25, 0.375], [0.0] * 3, [0.75, 0.5, 1.0], [0.0] * 3]]])
    rgba = torch.zeros(1, 1, 4, 4)
    views = _scene(rgba, mask, position).views("val", range(1))
    background = torch.full((1, 1, 4, 3), 0.5)
    pred, smooth = render_batch(
        _PositionTexture(), views, _SETTINGS, background, _LIGHT,
        jitter=lambda p: p + torch.tensor([0.375, 0.0, 0.0]),
    )  # fmt: skip
    want = torch.tensor([[[[0.125, 0.25, 0.375], [0.5] * 3, [0.75, 0.5, 1.0], [0.5] * 3]]])
    torch.testing.assert_close(pred, want, rtol=0, atol=0)
    assert float(smooth) == 0.0625


def test_stuck_fraction_compares_the_unclamped_linear_value():
    # docs/metrics.md: stuck is saturated and more than 0.1 from the reference in the
    # texture's linear output (a widened texture.min_max reaches past 1): a value of 10 is
    # 9.05 from a reference of 0.95, although the PSNR sees it clamped to 1 (0.05 away).
    rgba = torch.tensor([[[[0.95, 0.95, 0.95, 1.0]]]])
    position = torch.full((1, 1, 1, 3), 10.0)
    mask = torch.ones(1, 1, 1, dtype=torch.bool)
    got = _evaluate(rgba, mask, position)
    assert got["saturation"]["stuck_fraction"] == [1.0, 1.0, 1.0]
