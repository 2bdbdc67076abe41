"""Scenes built from their YAML configs; G-buffer caching; NeRF loader on a generated dataset."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import mptex.render
import mptex.scenes
from mptex.render import Mesh, look_at, save_image, srgb_to_rgb, write_obj
from mptex.scenes import SCENE_DEFAULTS, build_scene, gt_texture, render_gbuffer, torus_knot

SCENE_CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "scene"
SMALL = ["resolution=24", "n_train_views=3", "n_val_views=2"]


def _compose(name: str, overrides=()):
    with initialize_config_dir(config_dir=str(SCENE_CONFIGS), version_base="1.3"):
        return compose(config_name=name, overrides=list(overrides))


@pytest.mark.parametrize("name", ["builtin", "mesh", "nerf"])
def test_yaml_keys_match_python_defaults(name):
    cfg = _compose(name)
    assert set(cfg.keys()) == set(SCENE_DEFAULTS[name])
    assert cfg.name == name


def test_builtin_scene_from_yaml():
    scene = build_scene(_compose("builtin", SMALL + ["tubular_segments=60", "radial_segments=8"]))
    assert scene.resolution == (24, 24) and scene.n_train_views == 3 and scene.n_val_views == 2
    assert scene.mesh.t_pos_idx.shape == (2 * 60 * 8, 3)
    torch.testing.assert_close(
        scene.aabb, torch.stack([scene.mesh.v_pos.min(0)[0], scene.mesh.v_pos.max(0)[0]])
    )
    batch = scene.sample_train_batch(2, torch.Generator().manual_seed(0))
    assert batch.rgba.shape == (2, 24, 24, 4) and batch.position.shape == (2, 24, 24, 3)
    assert batch.mask.dtype == torch.bool and batch.mask.any()
    # Reference = ground truth at the cached surface positions, alpha = coverage.
    mask = batch.mask
    torch.testing.assert_close(batch.rgba[..., :3][mask], gt_texture(batch.position[mask]))
    assert torch.equal(batch.rgba[..., 3] > 0, mask)
    assert batch.rgba[~mask].abs().max() == 0
    # Positions lie inside the mesh's bounding box.
    inside = (batch.position[mask] >= scene.aabb[0] - 1e-5) & (
        batch.position[mask] <= scene.aabb[1] + 1e-5
    )
    assert inside.all()


def test_gbuffers_are_rasterized_once_per_view():
    scene = build_scene({"name": "builtin", "resolution": 16, "n_train_views": 4, "n_val_views": 2,
                         "tubular_segments": 40, "radial_segments": 6})  # fmt: skip
    first = scene.train_views([0, 1, 1])
    assert scene.gbuffers.misses == 2 and scene.gbuffers.hits == 1
    again = scene.train_views([1, 0])
    assert scene.gbuffers.misses == 2 and scene.gbuffers.hits == 3
    assert torch.equal(again.position[1], first.position[0])
    scene.val_views()
    scene.val_views()
    assert scene.gbuffers.misses == 4 and len(scene.gbuffers) == 4
    # A cached G-buffer equals a fresh rasterization of the same camera.
    fresh = render_gbuffer(scene.mesh, first.mvp[:1], scene.resolution)
    assert torch.equal(fresh.mask, first.mask[:1])


def test_a_second_scene_of_the_same_mesh_takes_the_rasterized_views():
    # A sweep's next job in the same process finds the G-buffers of the same mesh and cameras
    # (mptex.scenes.gbuffer's process-wide store) and rasterizes nothing.
    cfg = {"name": "builtin", "resolution": 12, "n_train_views": 3, "n_val_views": 2,
           "tubular_segments": 24, "radial_segments": 5}  # fmt: skip
    first = build_scene(cfg)
    views = first.train_views([0, 2])
    second = build_scene(cfg)
    again = second.train_views([2, 0, 1])
    assert second.gbuffers.rasterized == 1 and second.gbuffers.misses == 3
    for name in ("rast", "position", "normal", "mask"):
        assert torch.equal(getattr(again.gbuffer, name)[1], getattr(views.gbuffer, name)[0])
    other = build_scene({**cfg, "radial_segments": 6})  # another mesh: its own views
    other.train_views([0])
    assert other.gbuffers.rasterized == 1


def test_training_batches_are_deterministic():
    cfg = {"name": "builtin", "resolution": 16, "n_train_views": 5, "tubular_segments": 30,
           "radial_segments": 6}  # fmt: skip
    a, b = build_scene(cfg), build_scene(cfg)
    ba = a.sample_train_batch(3, torch.Generator().manual_seed(7))
    bb = b.sample_train_batch(3, torch.Generator().manual_seed(7))
    assert torch.equal(ba.index, bb.index) and torch.equal(ba.mvp, bb.mvp)
    assert torch.equal(ba.rgba, bb.rgba)


def _textured_quad_mesh(tmp_path: Path) -> Path:
    mesh = Mesh(
        v_pos=torch.tensor([[-1.0, -1, 0], [1, -1, 0], [1, 1, 0], [-1, 1, 0]]),
        t_pos_idx=torch.tensor([[0, 1, 2], [0, 2, 3]], dtype=torch.int32),
        v_tex=torch.tensor([[0.0, 0], [1, 0], [1, 1], [0, 1]]),
        t_tex_idx=torch.tensor([[0, 1, 2], [0, 2, 3]], dtype=torch.int32),
        kd_texture=torch.tensor([[[1.0, 0, 0], [0, 1, 0]], [[0, 0, 1], [1, 1, 1]]]),
    )
    write_obj(tmp_path / "quad.obj", mesh)
    return tmp_path / "quad.obj"


def test_mesh_scene_from_yaml(tmp_path):
    path = _textured_quad_mesh(tmp_path)
    scene = build_scene(_compose("mesh", SMALL + [f"path={path}"]))
    views = scene.val_views()
    assert views.rgba.shape == (2, 24, 24, 4)
    colours = views.rgba[..., :3][views.mask]
    # Bilinear samples of a red/green/blue/white texture: values in [0, 1], all hues present.
    assert colours.min() >= 0 and colours.max() <= 1 + 1e-6
    assert (colours.argmax(-1).unique().numel()) == 3
    assert torch.equal(views.rgba[..., 3] > 0, views.mask)


def _write_nerf_dataset(root: Path, mesh_path: Path, resolution=(20, 28)):
    """Render a known mesh from known cameras with our rasterizer and write NeRF-format files."""
    mesh = mptex.render.unit_size(torus_knot(40, 8))
    write_obj(mesh_path, mesh)
    height, width = resolution
    fovx = 0.9
    aspect = width / height
    proj = mptex.render.perspective(mptex.render.fovx_to_fovy(fovx, aspect), aspect, 0.1, 1000.0)
    eyes = {
        "train": [(3.0, 0.5, 0.2), (0.1, 0.4, -3.0), (-2.0, 2.0, 1.0)],
        "test": [(0.3, -3.0, 0.5)],
    }
    for split, split_eyes in eyes.items():
        frames = []
        (root / split).mkdir(parents=True)
        for n, eye in enumerate(split_eyes):
            mv = (
                look_at(eye, (0.0, 0.0, 0.0), (0.0, 1.0, 0.0))
                if n != 2
                else look_at(eye, (0.1, 0.0, 0.0), (0.0, 0.0, 1.0))
            )
            gb = render_gbuffer(mesh, (proj @ mv).unsqueeze(0), resolution)
            rgb = torch.zeros(height, width, 3)
            rgb[gb.mask[0]] = gt_texture(gb.position[0][gb.mask[0]])
            rgba = torch.cat([rgb, gb.mask[0, ..., None].float()], -1)
            save_image(
                root / split / f"r_{n}.png",
                torch.cat([mptex.render.rgb_to_srgb(rgba[..., :3]), rgba[..., 3:]], -1),
            )
            frames.append(
                {"file_path": f"./{split}/r_{n}", "transform_matrix": torch.linalg.inv(mv).tolist()}
            )
        (root / f"transforms_{split}.json").write_text(
            json.dumps({"camera_angle_x": fovx, "frames": frames})
        )
    return proj


def test_nerf_scene_on_generated_dataset(tmp_path):
    root, mesh_path = tmp_path / "data", tmp_path / "knot.obj"
    proj = _write_nerf_dataset(root, mesh_path)
    scene = build_scene(_compose("nerf", [f"path={root}", f"mesh={mesh_path}"]))
    assert scene.resolution == (20, 28) and scene.n_train_views == 3 and scene.n_val_views == 1
    views = scene.train_views([0, 1, 2])
    torch.testing.assert_close(views.mvp, proj @ views.mv)
    # The loaded cameras see the mesh exactly where the images have alpha (same rasterizer,
    # cameras round-tripped through inverse(inverse(mv)): allow a pixel on an edge to flip).
    alpha = views.rgba[..., 3] > 0.5
    assert (alpha == views.mask).float().mean() > 0.99
    both = alpha & views.mask
    colour = views.rgba[..., :3][both]
    # 8-bit sRGB quantisation of the reference: < 0.01 in linear RGB.
    torch.testing.assert_close(colour, gt_texture(views.position[both]), rtol=0, atol=0.01)


@pytest.mark.parametrize(
    "cfg, match",
    [
        ({"name": "teapot"}, "scene.name"),
        ({"name": "builtin", "resolutoin": 32}, "scene.resolutoin: unknown key"),
        ({"name": "builtin", "resolution": 0}, "scene.resolution"),
        ({"name": "builtin", "n_train_views": -1}, "scene.n_train_views"),
        ({"name": "mesh"}, "scene.path: required"),
        ({"name": "mesh", "path": "/nonexistent/x.obj"}, "scene.path: file not found"),
        ({"name": "nerf", "path": "/nonexistent", "mesh": "/x.obj"}, "scene.path"),
    ],
)
def test_config_errors_name_the_key(cfg, match):
    with pytest.raises(ValueError, match=match):
        build_scene(cfg)


def test_missing_yaml_value_is_reported():
    with pytest.raises(ValueError, match="scene.path: required"):
        build_scene(_compose("mesh"))


@pytest.mark.parametrize("module", [mptex.render, mptex.scenes])
def test_all_names_resolve(module):
    for name in module.__all__:
        assert getattr(module, name) is not None


def test_import_does_not_load_native_backends():
    code = "import sys, mptex.render, mptex.scenes; print('nvdiffrast' in sys.modules)"
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo)}  # this checkout, not another installed copy
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env, cwd=repo
    )
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("damage", ["json", "image", "pose"])
def test_a_damaged_nerf_dataset_is_one_line_naming_the_file(tmp_path, damage):
    root, mesh_path = tmp_path / "data", tmp_path / "knot.obj"
    _write_nerf_dataset(root, mesh_path)
    meta_path = root / "transforms_train.json"
    if damage == "json":
        meta_path.write_text(meta_path.read_text()[:40])  # truncated
        named = str(meta_path)
    elif damage == "image":
        (root / "train" / "r_1.png").write_bytes(b"\x89PNG\r\n\x1a\n not a png")
        named = str(root / "train" / "r_1.png")
    else:
        meta = json.loads(meta_path.read_text())
        meta["frames"][0]["transform_matrix"] = [[0.0] * 4] * 4  # singular
        meta_path.write_text(json.dumps(meta))
        named = str(meta_path)
    with pytest.raises(ValueError) as info:
        build_scene(_compose("nerf", [f"path={root}", f"mesh={mesh_path}"]))
    message = str(info.value)
    assert named in message and "\n" not in message, message


def test_mesh_scene_with_several_materials(tmp_path):
    """Each pixel takes its triangle's material: the textured quad its texture (UVs in [1, 2]
    wrap), the Kd-only quad (faces without vt) its Kd, faces before usemtl the 0.8 default."""
    Image = pytest.importorskip("PIL.Image")
    Image.new("RGB", (2, 2), (255, 0, 0)).save(tmp_path / "red tex.png")
    (tmp_path / "m.mtl").write_text("newmtl red\nmap_Kd red tex.png\nnewmtl blue\nKd 0 0 1\n")
    (tmp_path / "m.obj").write_text(
        "mtllib m.mtl\n"
        "v -1 -1 0\nv 0 -1 0\nv 0 1 0\nv -1 1 0\nv 1 -1 0\nv 1 1 0\nv 0 -1.5 0\n"
        "vt 1 1\nvt 2 1\nvt 2 2\nvt 1 2\n"
        "f 2 5 7\n"  # no usemtl yet: the default material
        "usemtl red\nf 1/1 2/2 3/3 4/4\nusemtl blue\nf 2 5 6 3\n"
    )  # fmt: skip
    scene = build_scene(_compose("mesh", SMALL + [f"path={tmp_path / 'm.obj'}"]))
    views = scene.val_views()
    tri = views.gbuffer.rast[..., 3].long() - 1
    material = scene.mesh.t_mat_idx.long()[tri.clamp_min(0)]
    rgb = views.rgba[..., :3]
    expected = {0: srgb_to_rgb(torch.full((3,), 0.8)), 1: torch.tensor([1.0, 0, 0]),
                2: torch.tensor([0.0, 0, 1])}  # fmt: skip
    for index, colour in expected.items():
        where = views.mask & (material == index)
        assert int(where.sum()) > 0, index
        torch.testing.assert_close(rgb[where], colour.expand(int(where.sum()), 3))


@pytest.mark.requires_assets
def test_a_suite_scene_from_another_machine_reads_this_machines_asset():
    # A run's config stores the suite asset's path as its machine resolved it: where that file
    # is missing (an export on another machine), the asset is read from this one's package.
    from mptex.scenes import suite_path

    cfg = {"name": "duck", "path": "/elsewhere/pybullet_data/duck.obj", "resolution": 16,
           "n_train_views": 2, "n_val_views": 1}  # fmt: skip
    with pytest.warns(UserWarning, match=r"^scene\.path: /elsewhere/pybullet_data/duck\.obj not "
                      r"found; suite asset 'duck' read from "):  # fmt: skip
        moved = build_scene(cfg, "cpu")
    here = build_scene({**cfg, "path": suite_path("duck")}, "cpu")
    assert torch.equal(moved.mesh.v_pos, here.mesh.v_pos)
    # a mesh that is not a suite asset: still the one-line error
    with pytest.raises(ValueError, match=r"^scene\.path: file not found: /elsewhere/x\.obj$"):
        build_scene({**cfg, "name": "mesh", "path": "/elsewhere/x.obj"}, "cpu")
