"""Tests for mptex.train.validation: the saved validation images are upright; supersampled
validation (train.val_spp) against a per-pixel brute force."""

from __future__ import annotations

import imageio.v3 as iio
import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from mptex.cli import CONFIG_DIR
from mptex.scenes import build_scene
from mptex.train import train

# A tetrahedron whose front face is a triangle in the z = 0 plane with its apex along world +y,
# and a fourth vertex behind the centroid (a flat mesh would have an empty bounding box in z):
# seen from the front, rows narrow towards the apex, so the picture tells up from down.
_APEX_UP_TRIANGLE = """mtllib tri.mtl
usemtl red
v -1 -1 0
v 1 -1 0
v 0 1 0
v 0 -0.333 -0.5
f 1 2 3
f 1 4 2
f 2 4 3
f 3 4 1
"""
_MTL = "newmtl red\nKd 0.8 0.1 0.1\n"


def test_saved_validation_png_is_upright_for_the_cameras_up_vector(tmp_path):
    (tmp_path / "tri.obj").write_text(_APEX_UP_TRIANGLE)
    (tmp_path / "tri.mtl").write_text(_MTL)
    overrides = [
        "scene=mesh",
        f"scene.path={tmp_path / 'tri.obj'}",
        "scene.resolution=48",
        "scene.n_train_views=2",
        "scene.n_val_views=1",  # orbit view 0: the triangle seen from the front
        "texture=tiny",
        "train=tiny",
        "train.iterations=1",
        "train.n_val_images=1",
        "train.val_background=white",
    ]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    train(cfg, tmp_path / "run")

    # The camera's up vector in world space is the second row of the world-to-camera rotation;
    # the apex lies along it, seen from this camera.
    views = build_scene(cfg.scene).val_views()
    up_world = views.mv[0, 1, :3]
    apex_dir = torch.tensor([0.0, 1.0, 0.0]) - torch.tensor([0.0, -1 / 3, 0.0])
    assert float(up_world @ apex_dir) > 0.5 * float(apex_dir.norm())

    # Read with imageio, not mptex: file row 0 is the top of the picture in every viewer.
    png = iio.imread(tmp_path / "run" / "images" / "val_000.png").astype(np.float32) / 255
    width = png.shape[1] // 2
    for half in (png[:, :width], png[:, width:]):  # reference | prediction
        covered = (half[..., :3] < 0.99).any(-1)  # not the white background
        rows = np.nonzero(covered.any(1))[0]
        assert len(rows) > 10, "the triangle should fill a good part of the view"
        widths = covered[rows].sum(1)
        quarter = len(rows) // 4
        # Upright: the apex (narrow rows) is at the top of the file, the base at the bottom.
        assert widths[:quarter].mean() < 0.5 * widths[-quarter:].mean()
    ref, pred = png[:, :width], png[:, width:]
    np.testing.assert_array_equal((ref[..., :3] < 0.99).any(-1), (pred[..., :3] < 0.99).any(-1))


# ----------------------------------------------------------------------------- train.val_spp
def _spp_setup(resolution: int, *extra: str):
    """The knot at ``resolution``, 2 validation views, a tiny texture whose outputs reach past
    [0, 1] (a 30 % margin and a scaled output layer): what the supersampled score must clamp."""
    from mptex.train import validate_config
    from mptex.train.checkpoint import build_texture

    overrides = [
        "texture=tiny", "train=tiny", f"scene.resolution={resolution}", "scene.n_train_views=1",
        "scene.n_val_views=2", "scene.tubular_segments=48", "scene.radial_segments=8",
        "texture.min_max=[[-0.3,-0.3,-0.3],[1.3,1.3,1.3]]", "train.device=cpu", *extra,
    ]  # fmt: skip
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    full = validate_config(cfg)
    torch.manual_seed(0)
    scene = build_scene(full["scene"])
    texture = build_texture(scene.aabb, full["texture"], full["precision"])
    with torch.no_grad():
        # Grid features of order 1 (not the init's 1e-4) and a scaled output layer: logits of
        # several units, the sigmoid near 0 or 1, outputs spread over [-0.3, 1.3].
        texture.encoder.params.uniform_(-1.0, 1.0)
        texture.net.layers[-1].weight.mul_(10.0)
    light = torch.nn.functional.normalize(torch.tensor(full["train"]["light_dir"]), dim=0)
    return full, scene, texture, light


def _psnr_f64(pred: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """nvdiffrec's PSNR in float64: sRGB, clamp to [0, 1], -10 log10(MSE) per image."""

    def srgb(x):
        return np.where(x <= 0.0031308, x * 12.92, 1.055 * np.abs(x) ** (1 / 2.4) - 0.055)

    a, b = np.clip(srgb(pred), 0, 1), np.clip(srgb(ref), 0, 1)
    return -10 * np.log10(((a - b) ** 2).reshape(len(a), -1).mean(1))


def test_supersampled_validation_matches_a_per_pixel_brute_force():
    from mptex.train.shading import composite, draw_background, render_batch
    from mptex.train.validation import evaluate

    low, spp = 10, 3
    full, scene, texture, light = _spp_setup(low, f"train.val_spp={spp}")
    got = evaluate(texture, scene, full["train"], light)

    # Oracle: the same cameras rendered point-sampled at 3x the resolution (a scene of its
    # own), then per pixel and channel in float64: mean of the clamped sub-pixels.
    _, hi_scene, _, _ = _spp_setup(low * spp)
    views = hi_scene.val_views()
    white = draw_background("white", views.mask.shape + (3,), "cpu", None)
    with torch.no_grad():
        pred_hi, _ = render_batch(texture, views, full["train"], white, light)
    ref_hi = composite(views.rgba[..., :3], views.rgba[..., 3:], white)
    pred_hi, ref_hi = pred_hi.double().numpy(), ref_hi.double().numpy()
    alpha_hi = views.rgba[..., 3:].double().numpy()
    mean_color = (views.rgba[..., :3].double().numpy() * alpha_hi).sum((0, 1, 2)) / alpha_hi.sum()
    const_hi = 1.0 + (mean_color - 1.0) * views.mask.double().numpy()[..., None]
    pred = np.zeros((2, low, low, 3))
    unclamped, ref, const = np.zeros_like(pred), np.zeros_like(pred), np.zeros_like(pred)
    for b in range(2):
        for y in range(low):
            for x in range(low):
                block = (b, slice(y * spp, (y + 1) * spp), slice(x * spp, (x + 1) * spp))
                pred[b, y, x] = np.clip(pred_hi[block], 0, 1).mean((0, 1))
                unclamped[b, y, x] = pred_hi[block].mean((0, 1))
                ref[b, y, x] = ref_hi[block].mean((0, 1))
                const[b, y, x] = const_hi[block].mean((0, 1))
    want = _psnr_f64(pred, ref)
    # float32 sums against float64: a relative MSE error ~1e-6 is ~5e-6 dB.
    np.testing.assert_allclose(got["psnr_per_image"], want, atol=1e-3)
    assert abs(got["psnr"] - want.mean()) < 1e-3
    assert abs(got["baseline_psnr"] - _psnr_f64(const, ref).mean()) < 1e-3
    np.testing.assert_allclose(got["pred"].double().numpy(), pred, atol=1e-5)
    # The clamp matters here: without it the score differs (the test can fail).
    assert np.abs(_psnr_f64(unclamped, ref) - want).max() > 0.1
    # Supersampling measures something else than the centre samples (edges count by area).
    point = evaluate(texture, scene, {**full["train"], "val_spp": 1}, light)
    assert np.abs(np.array(point["psnr_per_image"]) - want).max() > 0.1
    assert got["pred"].shape == point["pred"].shape == (2, low, low, 3)


def test_the_centre_sub_pixel_of_an_odd_spp_is_the_point_sample():
    # Sub-pixel (3y + 1, 3x + 1) has the pixel's centre: the same surface point, up to the
    # rasterizer's snapping. It snaps vertices to 1/16 of a pixel of the resolution it draws (as
    # nvdiffrast does), so a centre within a snapping step of an edge may be covered at one
    # resolution and not the other (only where the pixel's footprint is partly covered), or get
    # barycentrics clamped onto the edge: a point shifted by at most about two snapping steps
    # across the view ray, 2/16 of a 12-pixel view's pixel (this unit-size scene: ~0.17 world
    # units a pixel), which moves the surface point by that shift over cos(theta), theta the
    # angle between the surface's normal and the ray (a surface seen at a grazing angle
    # stretches the shift).
    _, scene, _, _ = _spp_setup(12)
    point, sub = scene.val_views(), scene.val_views(spp=3)
    assert sub.mask.shape == (2, 36, 36)
    blocks = sub.mask.view(2, 12, 3, 12, 3)
    partial = blocks.any(4).any(2) & ~blocks.all(4).all(2)
    centre_mask = sub.mask[:, 1::3, 1::3]
    assert torch.equal(centre_mask & ~partial, point.mask & ~partial)
    both = centre_mask & point.mask
    error = (sub.position[:, 1::3, 1::3] - point.position).abs().amax(-1)[both]
    ray = torch.nn.functional.normalize(point.position - point.campos[:, None, None], dim=-1)
    cos = (point.gbuffer.normal * ray).sum(-1).abs()[both]
    assert (error * cos).max() <= 2 / 16 * 0.17
    assert (error <= 1e-5).float().mean() >= 0.9  # elsewhere the same point, to float32
    colour = (sub.rgba[:, 1::3, 1::3] - point.rgba).abs().amax(-1)[both]
    assert (colour <= 1e-5).float().mean() >= 0.9
    # Coverage of the other sub-pixels differs at the silhouette: they sample other points.
    assert not torch.equal(sub.mask[:, 0::3, 0::3], point.mask)


def test_val_spp_1_scores_pixel_centres_in_one_batch(monkeypatch):
    # The default keeps nvdiffrec's score: every view in one render, no clamp before the PSNR.
    from mptex.train import validation

    full, scene, texture, light = _spp_setup(12)
    calls = []
    real = validation.render_batch
    monkeypatch.setattr(
        validation, "render_batch", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    got = validation.evaluate(texture, scene, full["train"], light)
    assert len(calls) == 1 and got["pred"].shape == (2, 12, 12, 3)
    assert float(got["pred"].max()) > 1.0  # the margin's values stay (clamped in the PSNR)
    views = scene.val_views()
    ref = views.rgba[..., :3] + (1 - views.rgba[..., 3:])  # over white
    want = _psnr_f64(got["pred"].double().numpy(), ref.double().numpy())
    np.testing.assert_allclose(got["psnr_per_image"], want, atol=1e-3)


def test_val_spp_is_refused_for_image_references():
    from mptex.train import validate_config

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[
            "scene=nerf", "scene.path=/tmp/x", "scene.mesh=/tmp/x.obj", "train.val_spp=2",
        ])  # fmt: skip
    with pytest.raises(ValueError, match=r"^train\.val_spp: scene=nerf") as info:
        validate_config(cfg)
    assert "\n" not in str(info.value)
