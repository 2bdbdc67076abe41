"""Scenes at their edges, against hand-built meshes, cameras, datasets and configs.

Which views a scene serves and what it refuses (indices outside a split, sub-pixels of image
references), that a view's reference is computed once, what a training batch gathers, the
process-wide G-buffer store's eviction and identity, the files a mesh or NeRF scene refuses,
what the NeRF reader makes of RGB frames and of its clip planes, and the scene config's bounds.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import warnings
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

import mptex.scenes.gbuffer as gbuffer_module
from mptex.render import look_at, orbit_views, save_image, write_obj
from mptex.scenes import (
    GBufferCache,
    Scene,
    build_scene,
    gt_texture,
    load_nerf_split,
    render_gbuffer,
    torus_knot,
)
from mptex.scenes.config import check_scene_config

SMALL = {"name": "builtin", "resolution": 8, "n_train_views": 3, "n_val_views": 2,
         "tubular_segments": 12, "radial_segments": 4}  # fmt: skip


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _image_scene(alpha: float = 0.5) -> Scene:
    """A scene whose references are given images: view i of a split is filled with i + 1 (train)
    or 10 * (i + 1) (val) in RGB, and ``alpha`` everywhere (an image's alpha, not coverage)."""
    train, val = orbit_views(3), orbit_views(2, elevation=0.3)

    def images(scale, n):
        rgb = (torch.arange(n, dtype=torch.float32) + 1)[:, None, None, None] * scale
        return torch.cat([rgb.expand(n, 8, 8, 3), torch.full((n, 8, 8, 1), alpha)], -1)

    reference = {"train": images(1.0, 3), "val": images(10.0, 2)}
    return Scene("images", torus_knot(12, 4), (8, 8), train, val, reference)


# ----------------------------------------------------------------------------- views
def test_views_refuse_fewer_than_one_sample_per_pixel():
    scene = build_scene(SMALL)
    for spp in (0, -1, 1.0):
        with pytest.raises(ValueError, match=r"^spp: expected an integer >= 1"):
            scene.views("val", [0], spp=spp)


def test_image_references_are_served_as_given_and_have_no_sub_pixels():
    scene = _image_scene()
    views = scene.views("val", [1, 0])
    assert torch.equal(views.rgba[:, 0, 0, :3], torch.tensor([[20.0] * 3, [10.0] * 3]))
    assert torch.equal(scene.train_views([2]).rgba[0, 3, 5], torch.tensor([3.0, 3, 3, 0.5]))
    with pytest.raises(ValueError, match=r"^spp: scene 'images' has image references"):
        scene.views("val", [0], spp=2)
    with pytest.raises(ValueError, match=r"^spp: scene 'images' has image references"):
        scene.val_views(spp=3)


@pytest.mark.parametrize("split, indices", [("train", [-1]), ("train", [0, 3]), ("val", [2])])
def test_view_indices_outside_their_split_are_refused(split, indices):
    scene = build_scene(SMALL)
    last = {"train": 2, "val": 1}[split]
    with pytest.raises(ValueError, match=rf"^indices: expected values in \[0, {last}\] for split"):
        scene.views(split, indices)
    assert len(scene.views(split, [last, 0])) == 2  # both ends of the split are views


def test_a_views_reference_is_computed_once_per_sampling():
    # The reference function sees each (view, spp) once; asking again is served from the scene.
    calls = []

    def reference(gbuffer):
        calls.append(gbuffer.mask.shape)
        return torch.cat([gbuffer.position, gbuffer.mask[..., None].float()], -1)

    train = Scene("counted", torus_knot(12, 4), (8, 8), orbit_views(3), orbit_views(2), reference)
    train.train_views([0, 1])
    train.train_views([1, 0, 1])
    assert calls == [(1, 8, 8)] * 2
    first = train.val_views(spp=2)
    again = train.val_views(spp=2)
    assert calls == [(1, 8, 8)] * 2 + [(1, 16, 16)] * 2
    assert torch.equal(first.rgba, again.rgba) and first.rgba.shape == (2, 16, 16, 4)


# ----------------------------------------------------------------------------- training draws
def test_training_draws_cover_the_pool_and_match_sample_train_batch():
    # Uniform with replacement from the 3 training views: 64 draws reach every view, and the
    # gathered batch draws the same indices from the same generator.
    scene = build_scene(SMALL)
    drawn = scene.sample_train_batch(64, _gen(5)).index.tolist()
    assert set(drawn) == {0, 1, 2}
    assert scene.training_batch(64, _gen(5)).index == drawn


def test_a_training_batch_holds_each_views_reference_coverage_and_asked_normals():
    # A scene of image references whose alpha (0.5) is not the coverage: the batch's coverage
    # is the rasterized one, its references the images of the drawn views.
    scene = _image_scene(alpha=0.5)
    batch = scene.training_batch(6, _gen(1))
    assert set(batch.index) >= {1, 2} and batch.normals is None
    views = scene.views("train", batch.index)
    assert torch.equal(batch.rgba, views.rgba)
    assert torch.equal(batch.coverage[..., 0], views.mask.float())
    assert torch.equal(batch.covered, views.mask.reshape(-1).nonzero().squeeze(1))
    # Normals asked for after a batch without them: the covered pixels' unit normals.
    with_normals = scene.training_batch(6, _gen(1), normals=True)
    assert with_normals.index == batch.index
    want = views.gbuffer.normal.reshape(-1, 3)[batch.covered]
    assert torch.equal(with_normals.normals, want)
    torch.testing.assert_close(want.norm(dim=-1), torch.ones(len(want)))
    # ... and none when not asked, though prepared.
    assert scene.training_batch(2, _gen(2)).normals is None


# ----------------------------------------------------------------------------- G-buffer store
def _views_mvp(n: int = 3) -> torch.Tensor:
    return orbit_views(n).mvp


def _view_bytes(mesh, mvp) -> int:
    g = render_gbuffer(mesh, mvp[:1], (8, 8), "torch")
    return sum(getattr(g, f.name).nbytes for f in dataclasses.fields(g))


def test_the_shared_store_drops_the_least_recently_used_view(monkeypatch):
    # Room for two views: a, b shared; a taken again (now the most recent); c shared: b goes.
    mesh, mvp = torus_knot(12, 4), _views_mvp()
    monkeypatch.setattr(gbuffer_module, "_SHARED", OrderedDict())
    monkeypatch.setattr(gbuffer_module, "SHARED_BYTES", 2 * _view_bytes(mesh, mvp))
    first = GBufferCache(mesh, (8, 8), "torch")
    first.get(["a"], mvp[0:1])
    first.get(["b"], mvp[1:2])
    GBufferCache(mesh, (8, 8), "torch").get(["a"], mvp[0:1])
    first.get(["c"], mvp[2:3])
    later = GBufferCache(mesh, (8, 8), "torch")
    later.get(["a"], mvp[0:1])
    later.get(["c"], mvp[2:3])
    assert later.rasterized == 0
    later.get(["b"], mvp[1:2])
    assert later.rasterized == 1


def test_a_view_larger_than_the_shared_store_is_still_shared(monkeypatch):
    mesh, mvp = torus_knot(12, 4), _views_mvp()
    monkeypatch.setattr(gbuffer_module, "_SHARED", OrderedDict())
    monkeypatch.setattr(gbuffer_module, "SHARED_BYTES", _view_bytes(mesh, mvp) // 2)
    GBufferCache(mesh, (8, 8), "torch").get(["a"], mvp[0:1])
    again = GBufferCache(mesh, (8, 8), "torch")
    again.get(["a"], mvp[0:1])
    assert again.rasterized == 0


def test_a_view_taken_from_the_shared_store_is_a_miss_not_a_hit(monkeypatch):
    mesh, mvp = torus_knot(12, 4), _views_mvp()
    monkeypatch.setattr(gbuffer_module, "_SHARED", OrderedDict())
    GBufferCache(mesh, (8, 8), "torch").get(["a"], mvp[0:1])
    second = GBufferCache(mesh, (8, 8), "torch")
    second.get(["a", "a"], mvp[[0, 0]])
    assert (second.hits, second.misses, second.rasterized) == (1, 1, 0)


def test_meshes_differing_only_in_normals_do_not_share_views(monkeypatch):
    monkeypatch.setattr(gbuffer_module, "_SHARED", OrderedDict())
    mesh, mvp = torus_knot(12, 4), _views_mvp()
    flipped = dataclasses.replace(mesh, v_nrm=-mesh.v_nrm)
    out = GBufferCache(mesh, (8, 8), "torch").get(["v"], mvp[0:1])
    cache = GBufferCache(flipped, (8, 8), "torch")
    inward = cache.get(["v"], mvp[0:1])
    assert cache.rasterized == 1 and bool(out.mask.any())
    assert torch.equal(inward.normal, -out.normal)


def test_meshes_differing_only_in_their_faces_do_not_share_views(monkeypatch):
    # The same vertices, half of the triangles (no normals): less of the view is covered.
    monkeypatch.setattr(gbuffer_module, "_SHARED", OrderedDict())
    knot, mvp = torus_knot(12, 4), _views_mvp()
    full = dataclasses.replace(knot, v_nrm=None, t_nrm_idx=None)
    half = dataclasses.replace(full, t_pos_idx=full.t_pos_idx[: len(full.t_pos_idx) // 2])
    GBufferCache(full, (8, 8), "torch").get(["v"], mvp[0:1])
    cache = GBufferCache(half, (8, 8), "torch")
    got = cache.get(["v"], mvp[0:1])
    assert cache.rasterized == 1
    assert torch.equal(got.mask, render_gbuffer(half, mvp[0:1], (8, 8), "torch").mask)


def test_a_cache_refuses_a_camera_count_unlike_its_keys():
    cache = GBufferCache(torus_knot(12, 4), (8, 8), "torch")
    with pytest.raises(ValueError, match=r"^mvp: expected 2 matrices, received 1$"):
        cache.get(["a", "b"], _views_mvp()[:1])


# ----------------------------------------------------------------------------- mesh files
def _kd_obj(tmp_path: Path, vertices: str, material: bool = True) -> str:
    (tmp_path / "m.mtl").write_text("newmtl grey\nKd 0.5 0.5 0.5\n")
    head = "mtllib m.mtl\nusemtl grey\n" if material else ""
    (tmp_path / "m.obj").write_text(head + vertices + "f 1 2 3\n")
    return str(tmp_path / "m.obj")


def test_a_mesh_of_one_repeated_point_is_refused(tmp_path):
    path = _kd_obj(tmp_path, "v 0.5 0.5 0.5\n" * 3)
    with pytest.raises(ValueError, match=r"^scene\.path: .*m\.obj: every vertex is the same point"):
        build_scene({"name": "mesh", "path": path, "resolution": 8})


def test_a_mesh_without_a_colour_is_refused(tmp_path):
    path = _kd_obj(tmp_path, "v 0 0 0\nv 1 0 0\nv 0 1 0\n", material=False)
    with pytest.raises(ValueError, match=r"^scene\.path: .*m\.obj has no material with Kd"):
        build_scene({"name": "mesh", "path": path, "resolution": 8})


# ----------------------------------------------------------------------------- NeRF datasets
def _nerf(root: Path, sizes=None, rgb_only=False, fovx=0.8) -> Path:
    """A NeRF-synthetic folder: splits train (2 frames) and test (1 frame) of constant images
    (``sizes``: split -> (H, W) per frame, default 6 x 8), cameras looking at the origin, and a
    knot mesh; returns the mesh path."""
    sizes = sizes or {"train": [(6, 8), (6, 8)], "test": [(6, 8)]}
    eyes = [(3.0, 0.5, 0.2), (0.2, 0.4, -3.0)]
    for split, shapes in sizes.items():
        (root / split).mkdir(parents=True)
        frames = []
        for n, (h, w) in enumerate(shapes):
            channels = 3 if rgb_only else 4
            save_image(root / split / f"r_{n}.png", torch.full((h, w, channels), 0.5))
            c2w = torch.linalg.inv(look_at(eyes[n % 2], (0.0, 0.0, 0.0)))
            frames.append({"file_path": f"./{split}/r_{n}", "transform_matrix": c2w.tolist()})
        meta = {"camera_angle_x": fovx, "frames": frames}
        (root / f"transforms_{split}.json").write_text(json.dumps(meta))
    mesh = root.parent / "knot.obj"
    write_obj(mesh, torus_knot(12, 4))
    return mesh


def _nerf_cfg(root: Path, mesh: Path, **extra) -> dict:
    return {"name": "nerf", "path": str(root), "mesh": str(mesh), **extra}


def test_a_nerf_scene_without_its_validation_split_names_the_key(tmp_path):
    root = tmp_path / "data"
    mesh = _nerf(root)
    (root / "transforms_test.json").unlink()
    with pytest.raises(ValueError, match=r"^scene\.val_split: .*transforms_test\.json not found"):
        build_scene(_nerf_cfg(root, mesh))


def test_a_nerf_scene_whose_splits_differ_in_image_size_is_refused(tmp_path):
    root = tmp_path / "data"
    mesh = _nerf(root, sizes={"train": [(6, 8)], "test": [(8, 6)]})
    with pytest.raises(ValueError, match=r"^scene\.val_split: image size differs"):
        build_scene(_nerf_cfg(root, mesh))


def test_a_split_whose_frames_differ_in_size_is_refused(tmp_path):
    root = tmp_path / "data"
    _nerf(root, sizes={"train": [(6, 8), (6, 9)]})
    with pytest.raises(ValueError) as info:
        load_nerf_split(root, "train")
    assert str(info.value) == (
        f"{root / 'transforms_train.json'}: frame 1 image size differs from frame 0: 6 x 9 "
        "pixels, expected 6 x 8 (height x width)"
    )


def test_a_frame_path_without_extension_is_a_name_not_a_pattern(tmp_path):
    root = tmp_path / "data"
    _nerf(root, sizes={"train": [(6, 8)]})
    save_image(root / "train" / "r_[0].png", torch.zeros(6, 8, 4))  # r_0.png holds 0.5
    path = root / "transforms_train.json"
    meta = json.loads(path.read_text())
    meta["frames"][0]["file_path"] = "./train/r_[0]"
    path.write_text(json.dumps(meta))
    _, rgba = load_nerf_split(root, "train")
    assert torch.equal(rgba, torch.zeros(1, 6, 8, 4))
    meta["frames"][0]["file_path"] = "./train/r_*"
    path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"frame image .*r_\*\(\.\*\) does not exist$"):
        load_nerf_split(root, "train")


@pytest.mark.parametrize("channels", [1, 2])
def test_a_grey_frame_is_refused_saying_what_was_expected(tmp_path, channels):
    root = tmp_path / "data"
    _nerf(root)
    save_image(root / "train" / "r_1.png", torch.full((6, 8, channels), 0.5))
    with pytest.raises(ValueError) as info:
        load_nerf_split(root, "train")
    assert str(info.value) == (
        f"{root / 'transforms_train.json'}: frame 1 image {root / 'train' / 'r_1.png'} has "
        f"{channels} channel(s); expected RGB or RGBA (3 or 4)"
    )


def test_rgb_frames_are_opaque(tmp_path):
    root = tmp_path / "data"
    _nerf(root, rgb_only=True)
    _, rgba = load_nerf_split(root, "train")
    assert rgba.shape == (2, 6, 8, 4)
    assert torch.equal(rgba[..., 3], torch.ones(2, 6, 8))
    # 0.5 written as 8 bits: 128 (round half to even of 127.5), read back through the sRGB
    # curve ((c + 0.055) / 1.055) ** 2.4.
    want = ((128 / 255 + 0.055) / 1.055) ** 2.4
    torch.testing.assert_close(rgba[..., :3], torch.full((2, 6, 8, 3), want), rtol=0, atol=1e-5)


def test_the_nerf_projection_takes_the_scenes_clip_planes_and_horizontal_fov(tmp_path):
    # fovx 0.8 over an 8-wide, 6-high image: the x scale is 1 / tan(0.4) whatever the aspect,
    # the y scale that times the aspect (flipped, as nvdiffrec's); near 0.5, far 7.
    root = tmp_path / "data"
    mesh = _nerf(root)
    scene = build_scene(_nerf_cfg(root, mesh, near=0.5, far=7.0))
    views = scene.views("train", [0, 1])
    got = views.mvp.double() @ torch.linalg.inv(views.mv.double())
    sx = 1 / math.tan(0.4)
    want = torch.tensor(
        [[sx, 0, 0, 0], [0, -sx * 8 / 6, 0, 0], [0, 0, -7.5 / 6.5, -7.0 / 6.5], [0, 0, -1, 0]],
        dtype=torch.float64,
    )
    torch.testing.assert_close(got, want.expand_as(got), rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda meta: meta.update(frames=[]), "no frames"),
        (lambda meta: meta.pop("camera_angle_x"), "malformed \\(KeyError"),
        (lambda meta: meta["frames"][0].update(transform_matrix=[[1.0, 0, 0, 0]] * 3),
         "frame 0 transform_matrix is not 4x4"),
        (lambda meta: meta["frames"][1].update(file_path="./train/r_1x"),
         "frame image .*r_1x\\(\\.\\*\\) does not exist"),
        (lambda meta: meta.update(frames=5), "frames: expected a list of frames, got 5$"),
        (lambda meta: meta.update(frames=True), "frames: expected a list of frames, got True$"),
        (lambda meta: meta.update(frames={"a": 1}),
         "frames: expected a list of frames, got \\{'a': 1\\}$"),
        (lambda meta: meta["frames"][1].update(file_path=5),
         "frame 1 file_path: expected an image path relative to the dataset folder, got 5$"),
        (lambda meta: meta["frames"][0].update(file_path=None), "frame 0 file_path: .*got None$"),
        (lambda meta: meta["frames"][0].update(file_path=["r_0"]), "frame 0 file_path: .*\\]$"),
        (lambda meta: meta["frames"][0].update(file_path=""), "frame 0 file_path: .*got ''$"),
        # 7 rad is past pi: tan(3.5) > 0 would have made it a 0.7 rad field of view
        (lambda meta: meta.update(camera_angle_x=7), "camera_angle_x: expected the horizontal "
         "field of view in radians, in \\(0, pi\\), got 7$"),
        (lambda meta: meta.update(camera_angle_x=3.5), "camera_angle_x: .*got 3.5$"),
        (lambda meta: meta.update(camera_angle_x=0), "camera_angle_x: .*got 0$"),
        (lambda meta: meta.update(camera_angle_x=-0.5), "camera_angle_x: .*got -0.5$"),
        (lambda meta: meta.update(camera_angle_x=float("inf")), "camera_angle_x: .*got inf$"),
        (lambda meta: meta.update(camera_angle_x=float("nan")), "camera_angle_x: .*got nan$"),
        (lambda meta: meta.update(camera_angle_x=True), "camera_angle_x: .*got True$"),
    ],
    ids=["no-frames", "no-fov", "pose-3x4", "prefix-of-another-name", "frames-a-number",
         "frames-true", "frames-a-mapping", "path-a-number", "path-null", "path-a-list",
         "path-empty", "fov-7", "fov-3.5", "fov-0", "fov-negative", "fov-inf", "fov-nan",
         "fov-true"],
)  # fmt: skip
def test_a_malformed_split_is_one_line_naming_its_file(tmp_path, damage, message):
    root = tmp_path / "data"
    _nerf(root)
    # A longer name sharing a frame's prefix is not that frame's image.
    save_image(root / "train" / "r_1xy.png", torch.zeros(6, 8, 4))
    path = root / "transforms_train.json"
    meta = json.loads(path.read_text())
    damage(meta)
    path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: .*{message}") as info:
        load_nerf_split(root, "train")
    assert "\n" not in str(info.value)


# ----------------------------------------------------------------------------- built-in scene
def test_the_knot_and_its_texture_refuse_what_they_cannot_draw():
    with pytest.raises(ValueError, match=r"^tubular_segments, radial_segments: expected >= 3"):
        torus_knot(12, 2)
    with pytest.raises(ValueError, match=r"^pos: expected shape \[N, 3\], received \[4, 2\]"):
        gt_texture(torch.zeros(4, 2))


# ----------------------------------------------------------------------------- scene configs
@pytest.mark.parametrize(
    "cfg, key",
    [
        ({"near": 0.0}, "near"),
        ({"cam_radius": 0}, "cam_radius"),
        ({"fovy_deg": 180.0}, "fovy_deg"),
        ({"fovy_deg": 0.0}, "fovy_deg"),
        ({"n_val_views": 0}, "n_val_views"),
        ({"n_train_views": 0}, "n_train_views"),
        ({"tubular_segments": 2}, "tubular_segments"),
        ({"radial_segments": 2}, "radial_segments"),
        ({"resolution": [8, 8, 8]}, "resolution"),
        ({"resolution": [8]}, "resolution"),
        ({"name": "nerf", "path": "d", "mesh": "m.obj", "train_split": ""}, "train_split"),
        ({"name": "nerf", "path": "d", "mesh": "m.obj", "val_split": ""}, "val_split"),
    ],
)
def test_scene_values_outside_their_range_are_refused_naming_the_key(cfg, key):
    base = {"name": "builtin"} if cfg.get("name") != "nerf" else {}
    with pytest.raises(ValueError, match=rf"^scene\.{key}: "):
        check_scene_config({**base, **cfg})


def test_values_at_the_ends_of_their_ranges_are_accepted():
    got = check_scene_config({"name": "builtin", "fovy_deg": 179.5, "n_val_views": 1,
                              "tubular_segments": 3, "radial_segments": 3, "resolution": [1, 2],
                              "near": 1e-6})  # fmt: skip
    assert got["resolution"] == (1, 2) and got["fovy_deg"] == 179.5


@pytest.mark.requires_assets
def test_a_suite_scene_with_a_null_path_takes_the_suite_file_silently():
    from mptex.scenes import suite_path

    assert check_scene_config({"name": "duck", "path": None})["path"] == suite_path("duck")
    cfg = {"name": "duck", "path": suite_path("duck"), "resolution": 8, "n_train_views": 1,
           "n_val_views": 1}  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the file is where it says: nothing to warn about
        assert build_scene(cfg).name == "duck"
