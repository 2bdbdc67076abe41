"""mptex.bake.export and mptex-export: files, orientation, sRGB, GLB, measurement, CLI errors."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

import mptex
from mptex.bake import MEASURE_VIEWS, bake_texture, export_mesh, orbit_views_around
from mptex.bake.export import (
    check_export_config,
    write_glb,
    write_obj_asset,
    write_png16,
    write_texture_images,
)
from mptex.cli import CONFIG_DIR
from mptex.cli.export import export_main
from mptex.render import Mesh, load_image, load_obj, save_image, texture, write_obj
from mptex.scenes.builtin import torus_knot
from mptex.train import train

ROOT = Path(__file__).resolve().parents[1]
TINY = ["train=tiny", "texture=tiny", "scene.resolution=32", "scene.n_train_views=4",
        "scene.n_val_views=2", "train.iterations=10"]  # fmt: skip
SMALL_KNOT = ["scene.tubular_segments=48", "scene.radial_segments=8"]


class GradientTexture(mptex.MLPTexture3D):
    """An asymmetric, known texture: red grows with world y (up), green with world x."""

    def sample(self, texc: torch.Tensor) -> torch.Tensor:
        red = (texc[..., 1] + 1) / 2
        green = (texc[..., 0] + 1) / 2
        return torch.stack([red, green, 1 - red], dim=-1).clamp(0, 1)


def quad_mesh() -> Mesh:
    """A unit quad in the z = 0 plane, UVs in OBJ's convention turned into mptex's: world top
    (y = +1) at OBJ v = 1, i.e. mptex v = 0, texture row 0 (the top of the image)."""
    pos = torch.tensor([[-1.0, -1, 0], [1, -1, 0], [1, 1, 0.1], [-1, 1, 0.1]])
    obj_uv = torch.tensor([[0.0, 0], [1, 0], [1, 1], [0, 1]])
    uv = torch.stack([obj_uv[:, 0], 1 - obj_uv[:, 1]], -1)
    faces = torch.tensor([[0, 1, 2], [0, 2, 3]], dtype=torch.int32)
    return Mesh(v_pos=pos, t_pos_idx=faces, v_tex=uv, t_tex_idx=faces.clone())


def gradient_texture(mesh: Mesh) -> GradientTexture:
    grid = {"otype": "HashGrid", "n_levels": 1, "log2_hashmap_size": 8}
    return GradientTexture(mesh.aabb, precision="f32", internal_dims=8, hidden=1, encoder=grid)


# ----------------------------------------------------------------------------- images
def test_srgb_bytes_of_known_linear_values(tmp_path):
    # sRGB 0, 0.735357 (187.97 / 255), 1, 0.502648 (128.18 / 255); linear 0.2165: 55.21 / 255
    values = torch.tensor([0.0, 0.5, 1.0, 0.2165])
    image = torch.zeros(1, 4, 6)
    image[0, :, 0:3] = values[:, None]
    image[0, :, 3:6] = values[:, None]
    files = write_texture_images(tmp_path, image, "png8")
    assert files == {"kd": "texture_kd.png", "ks": "texture_ks.png"}
    kd = np.asarray(load_image(tmp_path / "texture_kd.png") * 255).round()
    ks = np.asarray(load_image(tmp_path / "texture_ks.png") * 255).round()
    assert kd[0, :, 0].tolist() == [0, 188, 255, 128]  # colour: sRGB-encoded
    assert ks[0, :, 0].tolist() == [0, 128, 255, 55]  # ks: linear


def test_png16_is_a_valid_png_with_srgb_words(tmp_path):
    from PIL import Image

    image = torch.tensor([[[0.0, 0.5, 1.0]]]).expand(2, 3, 3)
    write_texture_images(tmp_path, image, "png16")
    data = (tmp_path / "texture_kd.png").read_bytes()
    with Image.open(tmp_path / "texture_kd.png") as png:
        assert png.size == (3, 2)
    # One IDAT: the filter byte then big-endian 16-bit R, G, B per pixel.
    start = data.index(b"IDAT") + 4
    length = int.from_bytes(data[start - 8 : start - 4], "big")
    raw = np.frombuffer(zlib.decompress(data[start : start + length]), np.uint8).reshape(2, -1)
    words = raw[:, 1:].copy().view(">u2").reshape(2, 3, 3)
    assert words[0, 0].tolist() == [0, round(0.7353569830524495 * 65535), 65535]
    write_png16(tmp_path / "x.png", torch.zeros(2, 2, 3))
    with pytest.raises(ValueError, match="^image"):
        write_png16(tmp_path / "y.png", torch.zeros(2, 2, 4))


# ----------------------------------------------------------------------------- orientation
def test_top_stays_top_in_png_obj_and_glb(tmp_path):
    mesh = quad_mesh()
    result = bake_texture(gradient_texture(mesh), mesh, 16, backend="torch")
    assert result.uv_source == "mesh"
    images = write_texture_images(tmp_path, result.texture)
    write_obj_asset(tmp_path, result.mesh, images)
    png = load_image(tmp_path / "texture_kd.png", to_linear=True)
    # Image row 0 (the top of the picture) is the top of the quad: red; the bottom is blue.
    assert float(png[0, :, 0].mean()) > 0.9 and float(png[-1, :, 2].mean()) > 0.9
    assert float(png[:, 0, 1].mean()) < 0.1 and float(png[:, -1, 1].mean()) > 0.9
    obj_text = (tmp_path / "mesh.obj").read_text().splitlines()
    assert "vt 0 1" in obj_text  # the top-left corner: OBJ counts v from the bottom
    loaded = load_obj(tmp_path / "mesh.obj")
    # The re-loaded texture at re-loaded UVs gives the colour of the same surface point (near
    # each corner; at the corner itself the wrap sampler blends in the opposite border).
    near_corner = torch.full((3, 3), 0.05).fill_diagonal_(0.9)
    uv = near_corner @ loaded.v_tex[loaded.t_tex_idx.long()]  # [T, 3, 2]
    pos = near_corner @ loaded.v_pos[loaded.t_pos_idx.long()]
    got = texture(loaded.kd_texture[None], uv.reshape(1, 1, -1, 2), backend="torch")[0, 0]
    assert float((got - GradientTexture.sample(None, pos.reshape(-1, 3))).abs().max()) < 0.03

    pytest.importorskip("trimesh", reason="GLB export needs trimesh")
    import trimesh

    write_glb(tmp_path / "mesh.glb", result.mesh, result.texture[..., :3])
    scene = trimesh.load(tmp_path / "mesh.glb")
    glb = next(iter(scene.geometry.values())) if hasattr(scene, "geometry") else scene
    base = np.asarray(glb.visual.material.baseColorTexture.convert("RGB"), dtype=np.float32)
    assert base.shape == (16, 16, 3)
    # trimesh hands back glTF UVs with v up; the top vertex (y = +1) must look up a red texel.
    for vertex, uv in zip(glb.vertices, glb.visual.uv):
        row = min(int((1 - uv[1]) * 16), 15)
        column = min(int(uv[0] * 16), 15)
        red = base[row, column, 0] / 255
        assert (red > 0.8) == (vertex[1] > 0), (vertex, uv, red)


@pytest.mark.requires_xatlas
def test_xatlas_bake_reloads_with_the_right_orientation(tmp_path):
    mesh = dataclasses.replace(torus_knot(24, 6), v_tex=None, t_tex_idx=None)
    result = bake_texture(gradient_texture(mesh), mesh, 128, backend="torch")
    write_obj_asset(tmp_path, result.mesh, write_texture_images(tmp_path, result.texture))
    loaded = load_obj(tmp_path / "mesh.obj")
    # Sample at triangle centroids (inside the charts, away from their seams).
    tri_uv = loaded.v_tex[loaded.t_tex_idx.long()].mean(1)
    tri_pos = loaded.v_pos[loaded.t_pos_idx.long()].mean(1)
    got = texture(loaded.kd_texture[None], tri_uv[None, None], backend="torch")[0, 0]
    assert float((got - GradientTexture.sample(None, tri_pos)).abs().max()) < 0.05


# ----------------------------------------------------------------------------- config
def test_export_config_errors_name_the_key():
    assert check_export_config(None)["formats"] == ["obj", "glb"]
    assert check_export_config({"formats": "glb,obj"})["formats"] == ["glb", "obj"]
    cases = [({"foo": 1}, "foo"), ({"resolution": 1.5}, "resolution"),
             ({"formats": ["fbx"]}, "formats"), ({"enabled": "yes"}, "enabled"),
             ({"kd_format": "jpg"}, "kd_format"), ({"padding": -1}, "padding")]  # fmt: skip
    for bad, key in cases:
        with pytest.raises(ValueError, match=f"^export.{key}: "):
            check_export_config(bad)


def test_a_padding_wider_than_the_atlas_is_refused():
    # The dilation visits (2 padding + 1)^2 offsets: export.padding=99999999999 (at resolution
    # 1024) was taken, and the bake's list of offsets exhausted the memory (the process was
    # killed); beyond the atlas's width a padding fills no more texels.
    with pytest.raises(ValueError) as err:
        check_export_config({"resolution": 1024, "padding": 99999999999})
    assert str(err.value) == (
        "export.padding: expected at most export.resolution (1024: a padding wider than the "
        "atlas fills no more texels), got 99999999999"
    )
    assert check_export_config({"resolution": 16, "padding": 16})["padding"] == 16


# ----------------------------------------------------------------------------- runs and CLI
def _train(run_dir: Path, *overrides: str) -> Path:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[*TINY, *overrides])
    train(cfg, run_dir)
    return run_dir


@pytest.fixture(scope="module")
def builtin_run(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("builtin_run"), *SMALL_KNOT)


@pytest.fixture(scope="module")
def mesh_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mesh_run")
    knot = torus_knot(48, 8)
    write_obj(folder / "knot.obj", dataclasses.replace(knot, kd=torch.tensor([0.8, 0.3, 0.1])))
    return _train(folder / "run", "scene=mesh", f"scene.path={folder / 'knot.obj'}")


def write_multi_material_knot(folder: Path) -> Path:
    """A knot OBJ as users have them: two materials (``usemtl`` switching), the first half of
    the triangles textured (``map_Kd`` with ``-s``, a PNG named with a space, faces with vt),
    the second half Kd only (faces without vt), quads nowhere needed."""
    knot = torus_knot(48, 8)
    gen = torch.Generator().manual_seed(0)
    save_image(folder / "knot tex.png", torch.rand(16, 16, 3, generator=gen), to_srgb=True)
    (folder / "knot.mtl").write_text(
        "newmtl textured\nmap_Kd -s 2 1 1 knot tex.png\nnewmtl flat\nKd 0.8 0.3 0.1\n"
    )
    half = knot.t_pos_idx.shape[0] // 2
    lines = ["mtllib knot.mtl"]
    lines += [f"v {x:.9g} {y:.9g} {z:.9g}" for x, y, z in knot.v_pos.tolist()]
    lines += [f"vt {u:.9g} {1 - v:.9g}" for u, v in knot.v_tex.tolist()]
    lines.append("usemtl textured")
    for pos, tex in zip(knot.t_pos_idx[:half].tolist(), knot.t_tex_idx[:half].tolist()):
        lines.append("f " + " ".join(f"{p + 1}/{t + 1}" for p, t in zip(pos, tex)))
    lines.append("usemtl flat")
    lines += ["f " + " ".join(str(p + 1) for p in pos) for pos in knot.t_pos_idx[half:].tolist()]
    (folder / "two materials.obj").write_text("\n".join(lines) + "\n")
    return folder / "two materials.obj"


@pytest.fixture(scope="module")
def multi_material_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("multi_material_run")
    obj = write_multi_material_knot(folder)
    return _train(folder / "run", "scene=mesh", f"scene.path={obj}", "train.iterations=3")


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mptex-export: error: "), err
    return err


@pytest.mark.requires_xatlas
@pytest.mark.requires_trimesh
@pytest.mark.parametrize("run", ["builtin_run", "mesh_run"])
def test_mptex_export_writes_obj_mtl_png_glb_and_measures(run, request, tmp_path):
    import trimesh

    run_dir = request.getfixturevalue(run)
    out = tmp_path / "asset"
    assert export_main([str(run_dir), "--out", str(out), "--resolution", "128"]) == 0
    for name in ("mesh.obj", "mesh.mtl", "texture_kd.png", "mesh.glb", "export.json"):
        assert (out / name).is_file(), name
    summary = json.loads((out / "export.json").read_text())
    assert summary["resolution"] == 128 and summary["uv_source"] == "xatlas"
    assert "overlap" in summary["unwrap_reason"]  # the knot's UVs wrap around the tube
    assert 0 < summary["coverage"] < summary["filled_fraction"] <= 1
    assert summary["texels_per_unit"] > 0 and summary["texels_per_pixel"] > 0
    # Even this small atlas reproduces the tiny run's smooth texture closely.
    assert summary["psnr_baked_vs_neural"] > 30
    assert abs(summary["psnr_baked_vs_reference"] - summary["psnr_neural_vs_reference"]) < 2
    # The texture decoded in each precision (f32 runs: its f32 decode is the neural texture).
    table = summary["decode_precision"]
    assert table["views"] == "the scene's 2 validation views"
    assert table["psnr_vs_reference"]["f32"] == pytest.approx(summary["psnr_neural_vs_reference"])
    assert set(table["psnr_vs_reference"]) == {"f32", "f16", "bf16", "fp8", "fp8_rowwise", "int8"}
    assert table["psnr_vs_f32"]["f16"] > table["psnr_vs_f32"]["fp8"]
    loaded = load_obj(out / "mesh.obj")
    assert loaded.kd_texture.shape == (128, 128, 3)
    glb = trimesh.load(out / "mesh.glb")
    geometry = next(iter(glb.geometry.values()))
    assert geometry.visual.material.baseColorTexture.size == (128, 128)
    assert len(geometry.vertices) == summary["glb"]["vertices"] >= loaded.v_pos.shape[0]


@pytest.mark.requires_xatlas
def test_mptex_export_of_a_multi_material_run(multi_material_run, tmp_path):
    metrics = json.loads((multi_material_run / "metrics.json").read_text())
    assert metrics["iterations"] == 3 and np.isfinite(metrics["psnr"])
    out = tmp_path / "asset"
    assert export_main([str(multi_material_run), "--out", str(out), "--resolution", "128",
                        "--format", "obj"]) == 0  # fmt: skip
    summary = json.loads((out / "export.json").read_text())
    # The Kd-only half has no vt: the bake needs new UVs for the whole mesh.
    half = torus_knot(48, 8).t_pos_idx.shape[0] // 2
    assert summary["uv_source"] == "xatlas"
    assert summary["unwrap_reason"].startswith(f"{half} of the mesh's triangles have no UVs")
    assert summary["psnr_baked_vs_neural"] > 30
    # The exported asset is one material with the baked texture on every triangle.
    loaded = load_obj(out / "mesh.obj")
    assert len(loaded.materials) == 1 and loaded.kd_texture.shape == (128, 128, 3)
    assert loaded.t_pos_idx.shape[0] == 2 * half


def _moved_knot():
    """The knot in a frame of its own (scaled and off the origin): export_mesh must frame it."""
    knot = torus_knot(48, 8)
    return dataclasses.replace(knot, v_pos=knot.v_pos * 3 + torch.tensor([5.0, -2.0, 1.0]))


@pytest.mark.requires_xatlas
@pytest.mark.requires_trimesh
def test_export_mesh_from_a_mesh_alone(tmp_path):
    mesh = _moved_knot()
    texture = gradient_texture(mesh)
    out = str(tmp_path / "asset")  # a str folder, as users write it
    summary = export_mesh(texture, mesh, out, resolution=128, formats=["obj", "glb"])
    for name in ("mesh.obj", "mesh.mtl", "texture_kd.png", "mesh.glb", "export.json"):
        assert (tmp_path / "asset" / name).is_file(), name
    written = json.loads((tmp_path / "asset" / "export.json").read_text())
    assert written["files"] == summary["files"] and written["resolution"] == 128
    assert summary["uv_source"] == "xatlas" and summary["n_views"] == MEASURE_VIEWS
    assert summary["measured_on"].startswith(f"{MEASURE_VIEWS} orbit views")
    # Views of its own: the whole knot in view in every one, whatever its frame.
    gbuffer, _ = orbit_views_around(mesh)
    covered = gbuffer.mask.float().mean(dim=(1, 2))
    assert bool((covered > 0.1).all())
    assert not bool(gbuffer.mask[:, 0].any() | gbuffer.mask[:, -1].any())  # nothing cut off
    assert summary["psnr_baked_vs_neural"] > 30 and summary["texels_per_pixel"] > 0
    assert "psnr_baked_vs_reference" not in summary  # a mesh alone has no reference
    loaded = load_obj(tmp_path / "asset" / "mesh.obj")
    assert loaded.kd_texture.shape == (128, 128, 3)
    torch.testing.assert_close(loaded.aabb, mesh.aabb)  # written in the mesh's own frame


@pytest.mark.requires_xatlas
def test_export_mesh_writes_what_mptex_export_writes(builtin_run, tmp_path):
    from mptex.train import load_texture

    assert export_main([str(builtin_run), "--out", str(tmp_path / "cli"), "--resolution", "128",
                        "--format", "obj"]) == 0  # fmt: skip
    cli = json.loads((tmp_path / "cli" / "export.json").read_text())
    texture = load_texture(builtin_run / "checkpoint.pt")
    points = torch.rand(64, 3) * 2 - 1
    # the run's directory names the same texture
    assert torch.equal(load_texture(builtin_run).sample(points), texture.sample(points))
    mesh = torus_knot(48, 8)  # the run's scene mesh (SMALL_KNOT)
    api = export_mesh(texture, mesh, tmp_path / "api", resolution=128, formats="obj")
    # The same bake: the same files, byte for byte, and the same bake statistics.
    assert api["files"] == cli["files"]
    for name in cli["files"].values():
        assert (tmp_path / "api" / name).read_bytes() == (tmp_path / "cli" / name).read_bytes()
    for key in ("uv_source", "unwrap_reason", "coverage", "texels_per_unit", "options"):
        assert api[key] == cli[key], key
    # Only the measurement's views differ: the scene's validation views, with references.
    assert set(cli) - set(api) == {"psnr_baked_vs_reference", "psnr_neural_vs_reference"}
    assert set(api) <= set(cli)
    assert cli["measured_on"] == "the scene's 2 validation views"


def test_export_mesh_errors_are_one_line_before_any_work(tmp_path):
    mesh = quad_mesh()
    texture = gradient_texture(mesh)
    with pytest.raises(ValueError, match="^export.resolution: expected an integer >= 2"):
        export_mesh(texture, mesh, tmp_path / "a", resolution=1)
    with pytest.raises(ValueError, match="^export.formats: "):
        export_mesh(texture, mesh, tmp_path / "a", formats=["fbx"])
    with pytest.raises(ValueError, match="^background: expected 'white' or 'black'"):
        export_mesh(texture, mesh, tmp_path / "a", background="grey")
    with pytest.raises(ValueError, match="^mesh: expected an mptex Mesh"):
        export_mesh(texture, None, tmp_path / "a")
    with pytest.raises(ValueError, match="^texture: expected an MLPTexture3D, got NoneType"):
        export_mesh(None, mesh, tmp_path / "a")
    assert not (tmp_path / "a").exists()
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError) as err:
        export_mesh(texture, mesh, tmp_path / "file", resolution=16, formats="obj")
    assert str(err.value) == f"out_dir: {tmp_path / 'file'} exists and is not a folder"
    summary = export_mesh(texture, mesh, tmp_path / "b", resolution=16, formats="obj",
                          measure=False)  # fmt: skip
    assert summary["measure_skipped"] == "export.measure=false"
    assert summary["uv_source"] == "mesh"


def test_mptex_export_without_checkpoint_is_one_line(tmp_path, capsys):
    assert export_main([str(tmp_path)]) == 2
    assert "no checkpoint.pt" in _one_line_error(capsys)
    (tmp_path / "metrics.json").write_text("{}")
    assert export_main([str(tmp_path / "metrics.json")]) == 2
    assert _one_line_error(capsys).rstrip() == (
        f"mptex-export: error: {tmp_path / 'metrics.json'}: a file, not a run directory (give "
        "the folder that holds checkpoint.pt)"
    )


def test_mptex_export_names_the_flag_that_set_a_bad_value(builtin_run, tmp_path, capsys):
    assert export_main([str(builtin_run), "--out", str(tmp_path), "--format", "OBJ"]) == 2
    assert _one_line_error(capsys).rstrip() == (
        "mptex-export: error: --format: expected a non-empty list of values, each one of "
        "['obj', 'glb'], got 'OBJ'"
    )
    assert export_main([str(builtin_run), "--out", str(tmp_path), "--decode", "f16,f99"]) == 2
    assert _one_line_error(capsys).startswith("mptex-export: error: --decode: expected a list")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_mptex_export_on_a_missing_gpu_is_one_line(builtin_run, tmp_path, capsys):
    # not "a corrupt checkpoint", which loading it onto an absent GPU would report
    assert export_main([str(builtin_run), "--out", str(tmp_path), "--device", "cuda:1"]) == 2
    assert _one_line_error(capsys).rstrip().endswith(
        "--device: cuda:1 requested but CUDA is not available")  # fmt: skip


def test_mptex_export_without_xatlas_is_one_line(builtin_run, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "xatlas", None)
    assert export_main([str(builtin_run), "--out", str(tmp_path), "--resolution", "64"]) == 2
    err = _one_line_error(capsys)
    assert "overlap" in err and "pip install xatlas" in err


def test_mptex_export_resolution_beyond_memory_is_one_line(builtin_run, tmp_path, monkeypatch,
                                                            capsys):  # fmt: skip
    import mptex.bake.bake as bake_module

    monkeypatch.setattr(bake_module, "available_bytes", lambda device: 1 << 20)
    assert export_main([str(builtin_run), "--out", str(tmp_path), "--resolution", "512"]) == 2
    assert "--resolution: a 512x512 bake" in _one_line_error(capsys)  # the flag that set it
    assert not (tmp_path / "export.json").exists()


def test_mptex_export_problems_found_late_are_one_line(builtin_run, tmp_path, monkeypatch,
                                                       capsys):  # fmt: skip
    import mptex.bake.export as export_module

    (tmp_path / "file").write_text("")
    assert export_main([str(builtin_run), "--out", str(tmp_path / "file")]) == 2
    assert _one_line_error(capsys) == (
        f"mptex-export: error: --out: {tmp_path / 'file'} exists and is not a folder\n"
    )

    def unpackable(*args, **kwargs):  # what only the bake finds: xatlas's packing
        raise ValueError("resolution: xatlas cannot pack the mesh's charts into one 7^2 atlas")

    monkeypatch.setattr(export_module, "export_asset", unpackable)
    assert export_main([str(builtin_run), "--out", str(tmp_path / "a"), "--resolution", "16"]) == 2
    assert _one_line_error(capsys).endswith("cannot pack the mesh's charts into one 7^2 atlas\n")


@pytest.mark.requires_xatlas
@pytest.mark.requires_trimesh
def test_mptex_train_exports_at_the_end_of_a_run(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "mptex.cli", f"hydra.run.dir={tmp_path}", *TINY, *SMALL_KNOT,
           "export.enabled=true", "export.resolution=64", "export.formats=[obj]"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["export"]["dir"] == "export" and metrics["export"]["resolution"] == 64
    assert metrics["export"]["psnr_baked_vs_neural"] > 25
    # The decode-precision table travels with the run's metrics, as export.json has it.
    export_json = json.loads((tmp_path / "export" / "export.json").read_text())
    assert metrics["export"]["decode_precision"] == export_json["decode_precision"]
    assert set(metrics["export"]["decode_precision"]["psnr_vs_f32"]) >= {"f16", "int8", "fp8"}
    assert (tmp_path / "export" / "mesh.obj").is_file()
    assert not (tmp_path / "export" / "mesh.glb").exists()
    # The weights are the completed run's final ones (TINY: 10 iterations, seed 0).
    assert export_json["source"] == {
        "run_dir": str(tmp_path.resolve()), "checkpoint": str(tmp_path.resolve() / "checkpoint.pt"),
        "iterations": 10, "iterations_planned": 10, "status": "completed", "final_weights": True,
        "precision": metrics["precision"], "scene": metrics["scene"], "seed": 0,
    }  # fmt: skip
    # An export that fails after the training (charts that xatlas cannot pack at this size):
    # the run stands, and mptex-train says so instead of only recording it.
    small = [cmd[0], "-m", "mptex.cli", f"hydra.run.dir={tmp_path / 'small'}", *cmd[4:-2],
             "export.resolution=8", "export.formats=[obj]"]  # fmt: skip
    proc = subprocess.run(small, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    error = json.loads((tmp_path / "small" / "metrics.json").read_text())["export"]["error"]
    assert error == (
        "ValueError: resolution: xatlas cannot pack the mesh's charts into one 8^2 atlas"
    )
    assert proc.stderr.strip().splitlines()[-1] == f"mptex-train: export failed: {error}"
    # A bad export key stops the run at start with one line naming it.
    bad = subprocess.run(cmd[:-3] + ["+export.colour=1"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1].startswith("mptex-train: error: export.colour:")


def test_fp8_decode_parts_script_checks_itself_against_the_fp8_decode(builtin_run, tmp_path):
    """benchmarks/fp8_decode_parts.py, run as a user runs it. Its 'both' and 'row both'
    variants must equal decode_texture's fp8 and fp8_rowwise decodes to the bit (the script
    exits non-zero otherwise); the same run
    given twice pairs into intervals of zero width around the difference of its own columns; a
    folder without a checkpoint is one line."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "fp8_decode_parts.py"
    done = subprocess.run([sys.executable, str(script), str(builtin_run), str(builtin_run)],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    run_row = next(line for line in lines if line.startswith(f"| {builtin_run} "))
    names = ["none", "weights", "inputs", "both", "row weights", "row inputs", "row both"]
    value = dict(zip(names, (float(v) for v in run_row.split("|")[2:9]), strict=True))
    pairs = [("weights", "none"), ("inputs", "none"), ("both", "none"), ("both", "weights"),
             ("row weights", "none"), ("row inputs", "none"), ("row both", "none"),
             ("row both", "row weights"), ("row both", "both")]  # fmt: skip
    for a, b in pairs:
        expected = value[a] - value[b]
        row = next(line for line in lines if line.startswith(f"| {a} − {b} "))
        mean, low, high = (float(v) for v in re.findall(r"[+-]\d+\.\d+", row.split("|")[3]))
        assert mean == low == high  # one run twice: no spread
        assert abs(mean - expected) <= 0.011  # the columns are rounded to 0.01 dB
    empty = tmp_path / "not_a_run"
    empty.mkdir()
    done = subprocess.run([sys.executable, str(script), str(empty)], capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip() == f"runs: no checkpoint.pt in {empty}"
