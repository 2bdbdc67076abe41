"""The bake, its files, the decoders and ``mptex-export`` against independent references.

Memory and resolution bounds, what counts as usable UVs, which texels a bake evaluates and
the values it gives them (worked out by hand for a square in the middle of the atlas), the
atlas xatlas packs, the channel groups, MTL, OBJ and GLB contents, the measurement's
composites and framing, the decode precisions and the NumPy decoder's rounding, and what
``mptex-export`` takes from the run it exports.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

import mptex
import mptex.bake.bake as bake_module
import mptex.bake.export as export_module
from mptex.bake import (
    PACK_DEFAULTS,
    bake_texture,
    check_bake_memory,
    export_mesh,
    needs_unwrap,
    neural_decoder,
    orbit_views_around,
    sample_in_chunks,
    texel_positions,
    unwrap_mesh,
    uv_problem,
    write_glb,
    write_obj_asset,
    write_texture_images,
)
from mptex.bake.decode import (
    DECODE_PRECISIONS,
    decode_precision_table,
    decode_texture,
    export_neural,
)
from mptex.export_config import EXPORT_DEFAULTS, check_export_config
from mptex.render import Mesh, load_image, load_obj, orbit_views, save_image
from mptex.scenes.builtin import torus_knot

DECODE_GRID = {"otype": "HashGrid", "n_levels": 4, "n_features_per_level": 2,
               "log2_hashmap_size": 12, "base_resolution": 4, "per_level_scale": 2.0}  # fmt: skip


class CoordinateTexture(mptex.MLPTexture3D):
    """A known texture: channel k is world axis k % 3 mapped from the AABB onto [0, 1]."""

    def sample(self, texc: torch.Tensor) -> torch.Tensor:
        lo, hi = self.AABB
        unit = ((texc - lo) / (hi - lo)).clamp(0, 1)
        return unit[..., [k % 3 for k in range(self.channels)]]


def coordinate_texture(aabb, channels: int = 3) -> CoordinateTexture:
    grid = {"otype": "HashGrid", "n_levels": 1, "log2_hashmap_size": 8}
    return CoordinateTexture(aabb, channels=channels, precision="f32", internal_dims=8,
                             hidden=1, encoder=grid)  # fmt: skip


def neural_texture(encoder=DECODE_GRID, **kwargs) -> mptex.MLPTexture3D:
    torch.manual_seed(0)
    texture = mptex.MLPTexture3D([[-1.0, -2.0, 0.0], [3.0, 2.0, 1.0]], encoder=encoder,
                                 precision="f32", backend="torch", **kwargs)  # fmt: skip
    with torch.no_grad():  # features of order 1, as a trained table has
        texture.encoder.params.uniform_(-1, 1)
    return texture


def points_in(texture: mptex.MLPTexture3D, n: int, seed: int = 1) -> torch.Tensor:
    lo, hi = texture.AABB
    return lo + (hi - lo) * torch.rand(n, 3, generator=torch.Generator().manual_seed(seed))


def square_mesh() -> Mesh:
    """A 3 x 2 rectangle (area 6) in the z = 0 plane whose UVs are the square [0.25, 0.75]^2.

    At 16^2 texel (row j, column i) has its centre at UV ((i + 0.5) / 16, (j + 0.5) / 16): the
    centres of rows and columns 4..11 lie inside (64 texels), those of 3 and 12 half a texel
    outside, within the sqrt(2) ring (a 10 x 10 block), those of 2 and 13 1.5 texels outside.
    """
    pos = torch.tensor([[0.0, 0, 0], [3, 0, 0], [3, 2, 0], [0, 2, 0]])
    uv = torch.tensor([[0.25, 0.25], [0.75, 0.25], [0.75, 0.75], [0.25, 0.75]])
    faces = torch.tensor([[0, 1, 2], [0, 2, 3]], dtype=torch.int32)
    return Mesh(v_pos=pos, t_pos_idx=faces, v_tex=uv, t_tex_idx=faces.clone())


SQUARE_AABB = [[0.0, 0.0, -1.0], [3.0, 2.0, 1.0]]


def uv_plane_mesh(uv_texels: list[list[float]], n: int) -> Mesh:
    """Triangles given in texel units (texel (i, j) centred at (i, j)); positions are the UVs
    with z = 0, so a position tells the UV it was evaluated at."""
    uv = (torch.tensor(uv_texels, dtype=torch.float64) + 0.5) / n
    faces = torch.arange(len(uv_texels), dtype=torch.int32).reshape(-1, 3)
    pos = torch.cat([uv, torch.zeros(len(uv), 1, dtype=torch.float64)], 1).float()
    return Mesh(v_pos=pos, t_pos_idx=faces, v_tex=uv.float(), t_tex_idx=faces.clone())


def two_quads(u_split_low: float, u_split_high: float) -> Mesh:
    """Two quads covering u in [0, high] and [low, 1] (the whole v range): they overlap where
    low < u < high."""
    uv = torch.tensor([[0.0, 0], [u_split_high, 0], [u_split_high, 1], [0, 1],
                       [u_split_low, 0], [1, 0], [1, 1], [u_split_low, 1]])  # fmt: skip
    pos = torch.cat([uv, torch.arange(8.0)[:, None] * 0.1], 1)
    faces = torch.tensor([[0, 1, 2], [0, 2, 3], [4, 5, 6], [4, 6, 7]], dtype=torch.int32)
    return Mesh(v_pos=pos, t_pos_idx=faces, v_tex=uv, t_tex_idx=faces.clone())


# ----------------------------------------------------------------------------- memory
def test_resolution_bounds_are_two_and_the_largest_int32_indexed_square(monkeypatch):
    monkeypatch.setattr(bake_module, "available_bytes", lambda device: None)
    assert 46340**2 < 2**31 <= 46341**2
    assert check_bake_memory(2, 3) > 0
    assert check_bake_memory(46340, 3) > 0
    with pytest.raises(ValueError, match="^resolution: expected at most 46340"):
        check_bake_memory(46341, 3)
    with pytest.raises(ValueError, match="^resolution: expected an integer >= 2, received 1$"):
        check_bake_memory(1, 3)


def test_memory_estimate_counts_two_float32_copies_per_channel_and_refuses_only_beyond(
    monkeypatch,
):
    monkeypatch.setattr(bake_module, "available_bytes", lambda device: None)
    need = check_bake_memory(64, 3)
    # One more channel: 4 bytes in the texture and 4 in its dilated copy, for every texel.
    assert check_bake_memory(64, 4) - need == 8 * 64 * 64
    monkeypatch.setattr(bake_module, "available_bytes", lambda device: need)
    assert check_bake_memory(64, 3) == need  # exactly what is available fits
    monkeypatch.setattr(bake_module, "available_bytes", lambda device: need - 1)
    with pytest.raises(ValueError, match="^resolution: a 64x64 bake of 3 channels"):
        check_bake_memory(64, 3)


# ----------------------------------------------------------------------------- UVs
def test_uvs_a_hair_outside_the_unit_square_are_refused_and_its_borders_accepted():
    mesh = two_quads(0.5, 0.5)  # corners exactly at 0 and 1
    assert uv_problem(mesh) is None
    for bad in (1.01, -0.01):
        uv = mesh.v_tex.clone()
        uv[5, 0] = bad
        assert "leave [0, 1]" in uv_problem(dataclasses.replace(mesh, v_tex=uv)), bad


def test_non_finite_uvs_are_named():
    mesh = two_quads(0.5, 0.5)
    for bad in (float("nan"), float("inf")):
        uv = mesh.v_tex.clone()
        uv[2, 1] = bad
        assert uv_problem(dataclasses.replace(mesh, v_tex=uv)) == "the mesh's UVs are not finite"


def test_a_triangle_with_two_corners_on_one_uv_vertex_still_has_uvs():
    # Only all three corners on one UV vertex means "no vt" (load_obj's Kd-only faces).
    mesh = two_quads(0.5, 0.5)
    extra = torch.tensor([[0, 1, 4]], dtype=torch.int32)
    degenerate = dataclasses.replace(
        mesh, t_pos_idx=torch.cat([mesh.t_pos_idx, extra]),
        t_tex_idx=torch.cat([mesh.t_tex_idx, torch.tensor([[1, 1, 2]], dtype=torch.int32)]),
    )  # fmt: skip
    assert uv_problem(degenerate) is None


def test_uvs_overlap_when_the_texels_covered_are_under_90_percent_of_the_summed_area():
    # [0, 0.6] and [0.4, 1]: areas sum to 1.2, the union is 1 (83 %): overlapping.
    assert "overlap" in needs_unwrap(two_quads(0.4, 0.6), backend="torch")
    # [0, 0.52] and [0.48, 1]: 1.04 against 1 (96 %): kept.
    assert needs_unwrap(two_quads(0.48, 0.52), backend="torch") is None


def test_an_unknown_unwrap_mode_is_refused():
    mesh = square_mesh()
    with pytest.raises(ValueError, match="^unwrap: expected 'auto' or 'always', received 'never'"):
        needs_unwrap(mesh, "never")
    with pytest.raises(ValueError, match="^unwrap: "):
        bake_texture(coordinate_texture(SQUARE_AABB), mesh, 16, unwrap="never")


# ----------------------------------------------------------------------------- texels
def test_a_ring_texel_equidistant_from_two_triangles_takes_the_lower_index():
    # Two slivers covering no texel centre, mirror images about column 3: triangle 0's right
    # edge at x = 2.625, triangle 1's left edge at x = 3.375 (dyadic: the distances are exact).
    # Texel (3, 3) lies 0.375 from both; the first triangle is the one it is evaluated on.
    n = 8
    mesh = uv_plane_mesh([[2.5, 0.25], [2.625, 0.25], [2.625, 5.75],
                          [3.5, 0.25], [3.375, 0.25], [3.375, 5.75]], n)  # fmt: skip
    index, position, n_covered = texel_positions(mesh, n, backend="torch")
    assert n_covered == 0
    where = (index == 3 * n + 3).nonzero()
    assert where.numel() == 1
    x, y = (position[int(where)][:2] * n - 0.5).tolist()
    assert x == pytest.approx(2.625, abs=1e-5) and y == pytest.approx(3.0, abs=1e-5)


def test_every_evaluated_texel_is_listed_once():
    # The square: covered texels are not evaluated again by the ring.
    index, _, n_covered = texel_positions(square_mesh(), 16, backend="torch")
    assert n_covered == 64 and index.numel() == 100 == index.unique().numel()
    # A vertical sliver from v = 1/8 to v = 1 (texel units y 0.5 .. 7.5) reaches texel
    # (row 0, column 2) twice through the wrap, at the same distance (sqrt(0.5)) from its two
    # ends: it is still evaluated once.
    n = 8
    sliver = uv_plane_mesh([[2.5, 0.5], [2.5, 7.5], [2.625, 4.0]], n)
    index, _, n_covered = texel_positions(sliver, n, backend="torch")
    assert n_covered == 0 and int((index == 0 * n + 2).sum()) == 1
    assert index.numel() == index.unique().numel()


def expected_square_bake(n: int = 16) -> torch.Tensor:
    """The bake of CoordinateTexture on square_mesh() with padding 1, texel by texel.

    Evaluated texels (rows and columns 3..12) hold the texture at the nearest point of the
    square to their centre (the centre itself when covered); the padding ring (2 and 13)
    copies the nearest evaluated texel, whose row and column are the texel's clamped to
    3..12; every other texel is 0.
    """
    out = torch.zeros(n, n, 3)
    for j in range(2, 14):
        for i in range(2, 14):
            source_j, source_i = min(max(j, 3), 12), min(max(i, 3), 12)
            u = min(max((source_i + 0.5) / n, 0.25), 0.75)
            v = min(max((source_j + 0.5) / n, 0.25), 0.75)
            # world x = 3 (u - 0.25) / 0.5 over an AABB x range of 3; y likewise; z = 0 in [-1, 1]
            out[j, i] = torch.tensor([2 * u - 0.5, 2 * v - 0.5, 0.5])
    return out


def test_bake_of_a_centred_square_by_hand():
    result = bake_texture(coordinate_texture(SQUARE_AABB), square_mesh(), 16, padding=1,
                          backend="torch")  # fmt: skip
    assert result.uv_source == "mesh"
    block = torch.zeros(16, 16, dtype=torch.bool)
    covered, evaluated, filled = block.clone(), block.clone(), block.clone()
    covered[4:12, 4:12], evaluated[3:13, 3:13], filled[2:14, 2:14] = True, True, True
    assert torch.equal(result.covered, covered)
    assert torch.equal(result.evaluated, evaluated)
    assert torch.equal(result.filled, filled)
    torch.testing.assert_close(result.texture, expected_square_bake(), rtol=0, atol=1e-5)
    stats = result.stats
    assert (stats["resolution"], stats["padding"]) == (16, 1)
    assert stats["coverage"] == 64 / 256
    assert stats["evaluated_fraction"] == 100 / 256
    assert stats["filled_fraction"] == 144 / 256
    assert stats["surface_area"] == pytest.approx(6.0, rel=1e-12)
    assert stats["texels_per_unit"] == pytest.approx(math.sqrt(64 / 6), rel=1e-12)


def test_bake_refuses_a_zero_chunk_size_and_a_mesh_without_triangles():
    mesh, texture = square_mesh(), coordinate_texture(SQUARE_AABB)
    with pytest.raises(ValueError, match="^chunk_size: expected an integer >= 1"):
        bake_texture(texture, mesh, 16, chunk_size=0)
    empty = dataclasses.replace(mesh, t_pos_idx=torch.zeros(0, 3, dtype=torch.int32),
                                t_tex_idx=torch.zeros(0, 3, dtype=torch.int32))  # fmt: skip
    with pytest.raises(ValueError, match="^mesh: expected at least one triangle$"):
        bake_texture(texture, empty, 16)


def test_sampling_in_chunks_handles_no_points_and_restores_the_training_mode():
    texture = neural_texture()
    points = points_in(texture, 100)
    assert sample_in_chunks(texture, points[:0], 8).shape == (0, 3)
    for training in (True, False):
        texture.train(training)
        values = sample_in_chunks(texture, points, 7)
        assert texture.training is training
    texture.eval()
    with torch.no_grad():
        torch.testing.assert_close(values, texture.sample(points), rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- xatlas
def _charts(mesh: Mesh) -> torch.Tensor:
    """[T] chart label of each triangle: xatlas splits UV vertices at chart borders, so the
    charts are the components of triangles sharing a UV vertex."""
    parent = list(range(mesh.v_tex.shape[0]))

    def find(a):
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for a, b, c in mesh.t_tex_idx.tolist():
        parent[find(a)] = find(b)
        parent[find(b)] = find(c)
    return torch.tensor([find(int(t[0])) for t in mesh.t_tex_idx])


@pytest.mark.requires_xatlas
def test_packed_charts_never_share_a_texel_the_bake_evaluates():
    # The default packing leaves PACK_DEFAULTS["padding"] = 2 texels between charts: the
    # conservative ring of one chart never reaches another chart's texels.
    assert PACK_DEFAULTS == {"padding": 2, "bilinear": True}
    knot = torus_knot(24, 6)
    n = 64
    unwrapped = unwrap_mesh(Mesh(v_pos=knot.v_pos, t_pos_idx=knot.t_pos_idx), n)
    labels = _charts(unwrapped)
    assert labels.unique().numel() > 1
    seen, total = set(), 0
    for label in labels.unique():
        chart = labels == label
        part = dataclasses.replace(unwrapped, t_pos_idx=unwrapped.t_pos_idx[chart],
                                   t_tex_idx=unwrapped.t_tex_idx[chart])  # fmt: skip
        index, _, _ = texel_positions(part, n, backend="torch")
        total += index.numel()
        seen |= set(index.tolist())
    assert total == len(seen)


@pytest.mark.requires_xatlas
def test_charts_that_do_not_fit_one_atlas_are_refused_naming_the_resolution():
    knot = torus_knot(48, 8)
    with pytest.raises(ValueError, match=r"^resolution: xatlas cannot pack .* one 8\^2 atlas"):
        unwrap_mesh(Mesh(v_pos=knot.v_pos, t_pos_idx=knot.t_pos_idx), 8)


# ----------------------------------------------------------------------------- files
def test_channel_groups_need_three_channels_each(tmp_path):
    for channels, groups in ((3, {"kd"}), (4, {"kd"}), (5, {"kd"}), (6, {"kd", "ks"}),
                             (8, {"kd", "ks"}), (9, {"kd", "ks", "n"}),
                             (11, {"kd", "ks", "n"})):  # fmt: skip
        folder = tmp_path / str(channels)
        folder.mkdir()
        written = write_texture_images(folder, torch.rand(4, 4, channels))
        assert set(written) == groups, channels
        assert sorted(p.name for p in folder.iterdir()) == sorted(written.values())


class ConstantTexture(mptex.MLPTexture3D):
    """Every point: kd 0.5 grey, ks (0.25, 0.5, 1.0), normal offset (-0.5, 1.5, 0.5): the x and
    y of the normal outside [0, 1], as a ``min_max`` of [-1, 1] lets a texture give them."""

    def sample(self, texc: torch.Tensor) -> torch.Tensor:
        value = torch.tensor([0.5, 0.5, 0.5, 0.25, 0.5, 1.0, -0.5, 1.5, 0.5])
        return value.expand(*texc.shape[:-1], 9)


def constant_texture() -> ConstantTexture:
    grid = {"otype": "HashGrid", "n_levels": 1, "log2_hashmap_size": 8}
    return ConstantTexture(SQUARE_AABB, channels=9, precision="f32", internal_dims=8, hidden=1,
                           encoder=grid)  # fmt: skip


def test_png_values_outside_0_1_are_recorded_and_named_on_stderr(tmp_path, capsys):
    # padding 16 on a 16^2 atlas fills every texel (wrapping dilation): 256 texels, each
    # with x = -0.5 and y = 1.5 in the normal group: 2 * 256 = 512 values outside [0, 1]
    summary = export_mesh(constant_texture(), square_mesh(), tmp_path, resolution=16,
                          padding=16, formats="obj", measure=False)  # fmt: skip
    expected = {
        "texture_kd.png": {"min": 0.5, "max": 0.5, "outside_0_1": 0, "clamped": 0},
        "texture_ks.png": {"min": 0.25, "max": 1.0, "outside_0_1": 0, "clamped": 0},
        "texture_n.png": {"min": -0.5, "max": 1.5, "outside_0_1": 512, "clamped": 512},
    }
    written = json.loads((tmp_path / "export.json").read_text())
    assert summary["value_ranges"] == written["value_ranges"] == expected
    normal = np.asarray(png_pixels(tmp_path / "texture_n.png"))
    assert normal[..., 0].max() == 0 and normal[..., 1].min() == 255  # what was clamped
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "mptex export: warning: texture_n.png: 512 values outside [0, 1] written as 0 or 1 "
        "(the texture's range here is [-0.5, 1.5]; export.json's value_ranges records it; "
        "kd_format exr keeps them)"
    ]


def test_exr_files_keep_values_outside_0_1(tmp_path, monkeypatch, capsys):
    written = {}

    def recording_save_image(path, img, to_srgb=False):
        written[Path(path).name] = img.clone()
        Path(path).write_bytes(b"")

    monkeypatch.setattr(export_module, "save_image", recording_save_image)
    summary = export_mesh(constant_texture(), square_mesh(), tmp_path, resolution=16,
                          padding=16, formats="obj", kd_format="exr", measure=False)  # fmt: skip
    assert written["texture_n.exr"][..., 0].unique().tolist() == [-0.5]
    assert written["texture_n.exr"][..., 1].unique().tolist() == [1.5]
    assert summary["value_ranges"]["texture_n.exr"] == {
        "min": -0.5, "max": 1.5, "outside_0_1": 512, "clamped": 0
    }  # fmt: skip
    assert capsys.readouterr().err == ""


class HdrAlbedoTexture(ConstantTexture):
    """Every point: kd (1.5, 0.5, -0.25), beyond [0, 1] in two channels (an EXR keeps them),
    ks and the normal inside it."""

    def sample(self, texc: torch.Tensor) -> torch.Tensor:
        value = torch.tensor([1.5, 0.5, -0.25, 0.25, 0.5, 1.0, 0.5, 0.5, 0.5])
        return value.expand(*texc.shape[:-1], 9)


@pytest.mark.requires_trimesh
def test_the_glbs_base_colour_clamps_whatever_kd_format_and_a_new_format_replaces_the_old(
    tmp_path, monkeypatch, capsys
):
    def recording_save_image(path, img, to_srgb=False):
        Path(path).write_bytes(b"")

    monkeypatch.setattr(export_module, "save_image", recording_save_image)
    grid = {"otype": "HashGrid", "n_levels": 1, "log2_hashmap_size": 8}
    texture = HdrAlbedoTexture(SQUARE_AABB, channels=9, precision="f32", internal_dims=8,
                               hidden=1, encoder=grid)  # fmt: skip
    # 16^2 texels (padding 16 fills the atlas), 2 kd channels outside [0, 1]: 512 values. The
    # EXR keeps them; mesh.glb's base colour is an 8-bit PNG of the same channels: 512 clamped.
    summary = export_mesh(texture, square_mesh(), tmp_path, resolution=16, padding=16,
                          formats=["obj", "glb"], kd_format="exr", measure=False)  # fmt: skip
    kd = {"min": -0.25, "max": 1.5, "outside_0_1": 512}
    assert summary["value_ranges"]["texture_kd.exr"] == {**kd, "clamped": 0}
    assert summary["value_ranges"]["mesh.glb"] == {**kd, "clamped": 512}
    assert capsys.readouterr().err.splitlines() == [
        "mptex export: warning: mesh.glb: 512 values outside [0, 1] written as 0 or 1 (the "
        "texture's range here is [-0.25, 1.5]; export.json's value_ranges records it)"
    ]
    # The same folder exported as PNGs: the EXRs of the earlier export go.
    summary = export_mesh(texture, square_mesh(), tmp_path, resolution=16, padding=16,
                          formats="obj", kd_format="png8", measure=False)  # fmt: skip
    exrs = ["texture_kd.exr", "texture_ks.exr", "texture_n.exr"]
    assert summary["removed_earlier_files"] == ["mesh.glb", *exrs]  # sorted by name
    assert not any((tmp_path / name).exists() for name in [*exrs, "mesh.glb"])


def test_an_export_removes_the_files_of_the_earlier_export_it_replaces(tmp_path, capsys):
    out = tmp_path / "asset"
    export_mesh(constant_texture(), square_mesh(), out, resolution=16, formats="obj",
                measure=False, neural_precision="f16")  # fmt: skip
    first = json.loads((out / "export.json").read_text())["files"]
    assert sorted(first.values()) == [
        "mesh.mtl", "mesh.obj", "neural_decoder.py", "texture_kd.png", "texture_ks.png",
        "texture_n.png", "texture_neural.safetensors",
    ]  # fmt: skip
    # Files mptex did not write stay, also where an edited export.json lists them.
    (out / "notes.txt").write_text("mine")
    (out / "mesh.fbx").write_text("mine")
    (tmp_path / "outside.txt").write_text("mine")
    edited = json.loads((out / "export.json").read_text())
    edited["files"].update(notes="notes.txt", fbx="mesh.fbx", up="../outside.txt")
    (out / "export.json").write_text(json.dumps(edited))
    capsys.readouterr()
    summary = export_mesh(coordinate_texture(SQUARE_AABB), square_mesh(), out,
                          resolution=8, formats="obj", measure=False)  # fmt: skip
    gone = ["neural_decoder.py", "texture_ks.png", "texture_n.png", "texture_neural.safetensors"]
    assert summary["removed_earlier_files"] == gone
    assert json.loads((out / "export.json").read_text())["removed_earlier_files"] == gone
    assert sorted(p.name for p in out.iterdir()) == [
        "export.json", "mesh.fbx", "mesh.mtl", "mesh.obj", "notes.txt", "texture_kd.png",
    ]  # fmt: skip
    assert (tmp_path / "outside.txt").read_text() == "mine"
    assert capsys.readouterr().err == (
        f"mptex export: removed {', '.join(gone)}: written by the earlier export in {out}, "
        "not by this one\n"
    )
    # An export.json that is not an export's: nothing is removed.
    for text in ("not json", '{"files": {"kd": ["texture_kd.png"], "n": {}}}'):
        (out / "export.json").write_text(text)
        summary = export_mesh(coordinate_texture(SQUARE_AABB), square_mesh(), out,
                              resolution=8, formats="obj", measure=False)  # fmt: skip
        assert "removed_earlier_files" not in summary and (out / "notes.txt").is_file()


def test_an_earlier_exports_name_that_is_now_a_folder_stays_and_a_link_goes_not_its_target(
    tmp_path, capsys
):
    # The earlier export.json lists mesh.glb, texture_ks.png and texture_n.png; since then the
    # user made mesh.glb a folder, texture_ks.png a link to a file of theirs and texture_n.png
    # a link to nothing. The next export removes the links (a name it wrote), never a folder
    # or what a link points to.
    out = tmp_path / "asset"
    export_mesh(constant_texture(), square_mesh(), out, resolution=8, formats="obj",
                measure=False)  # fmt: skip
    edited = json.loads((out / "export.json").read_text())
    edited["files"]["glb"] = "mesh.glb"
    (out / "export.json").write_text(json.dumps(edited))
    (out / "mesh.glb").mkdir()
    (out / "mesh.glb" / "mine.txt").write_text("mine")
    (tmp_path / "mine.png").write_text("mine")
    (out / "texture_ks.png").unlink()
    (out / "texture_ks.png").symlink_to(tmp_path / "mine.png")
    (out / "texture_n.png").unlink()
    (out / "texture_n.png").symlink_to(tmp_path / "gone.png")
    summary = export_mesh(coordinate_texture(SQUARE_AABB), square_mesh(), out, resolution=8,
                          formats="obj", measure=False)  # fmt: skip
    assert summary["removed_earlier_files"] == ["texture_ks.png", "texture_n.png"]
    assert (out / "mesh.glb" / "mine.txt").read_text() == "mine"
    assert (tmp_path / "mine.png").read_text() == "mine"
    assert not (out / "texture_ks.png").is_symlink() and not (out / "texture_n.png").is_symlink()


def test_a_record_that_is_a_list_of_names_removes_nothing_and_old_temporaries_go(tmp_path):
    # An export.json or export.pending.json that is a bare list is not an export's record:
    # texture_ks.png, which it names, stays. The temporary a killed write of either left goes.
    out = tmp_path / "asset"
    export_mesh(constant_texture(), square_mesh(), out, resolution=8, formats="obj",
                measure=False)  # fmt: skip
    for record in ("export.json", "export.pending.json"):
        (out / record).write_text('["texture_ks.png", "texture_n.png"]')
    (out / ".export.pending.json.x1y2z3.tmp").write_text('{"files": ["tex')
    summary = export_mesh(coordinate_texture(SQUARE_AABB), square_mesh(), out, resolution=8,
                          formats="obj", measure=False)  # fmt: skip
    assert "removed_earlier_files" not in summary
    assert (out / "texture_ks.png").is_file() and (out / "texture_n.png").is_file()
    assert not list(out.glob(".*.tmp")) and not (out / "export.pending.json").exists()


def test_every_file_export_json_lists_reaches_the_disk_before_it(tmp_path, monkeypatch):
    synced = []
    monkeypatch.setattr(export_module, "fsync_file", lambda path: synced.append(Path(path).name))
    real = export_module.atomic_write_bytes

    def atomic_write_bytes(path, write):
        if Path(path).name == "export.json":
            synced.append("export.json")
        real(path, write)

    monkeypatch.setattr(export_module, "atomic_write_bytes", atomic_write_bytes)
    summary = export_mesh(constant_texture(), square_mesh(), tmp_path, resolution=8,
                          formats="obj", measure=False, neural_precision="f16")  # fmt: skip
    files = sorted(summary["files"].values())
    assert synced == [*files, "export.json"] and len(files) == 7
    # The decoder beside the weights is mptex's own, byte for byte.
    source = Path(export_module.__file__).with_name("neural_decoder.py")
    assert (tmp_path / "neural_decoder.py").read_bytes() == source.read_bytes()


class _Killed(BaseException):  # no except clause of the export records it, as a kill
    pass


def _export_killed_at(monkeypatch, out: Path, texture, writer: str, **options) -> None:
    """``export_mesh`` into ``out``, killed where it calls ``writer`` (an attribute of the
    export module)."""

    def killed(*args, **kwargs):
        raise _Killed

    with monkeypatch.context() as patch:
        patch.setattr(export_module, writer, killed)
        with pytest.raises(_Killed):
            export_mesh(texture, square_mesh(), out, resolution=8, **options)


def test_an_export_killed_midway_leaves_no_export_json_of_the_earlier_one(tmp_path, monkeypatch):
    # export.json says what the files beside it are; a kill (SIGKILL, an OOM kill) after an
    # export has rewritten some of them must not leave the earlier export's beside them.
    out = tmp_path / "asset"
    export_mesh(constant_texture(), square_mesh(), out, resolution=16, formats="obj",
                measure=False)  # fmt: skip
    assert json.loads((out / "export.json").read_text())["resolution"] == 16
    # and the temporary an earlier kill left in the middle of an export.json write goes too
    (out / ".export.json.k3j9x0.tmp").write_text('{"files": {"kd": "tex')
    # after the texture images, before the OBJ
    _export_killed_at(monkeypatch, out, coordinate_texture(SQUARE_AABB), "write_obj_asset",
                      formats="obj", measure=False)  # fmt: skip
    assert np.asarray(load_image(out / "texture_kd.png")).shape[:2] == (8, 8)  # the new one
    assert not (out / "export.json").exists()
    assert not list(out.glob(".*.tmp"))


@pytest.mark.parametrize("kills", [1, 2])
def test_the_export_after_one_killed_midway_removes_the_earlier_exports_files(
    tmp_path, monkeypatch, capsys, kills
):
    # An OBJ + neural export of 9 channels, then OBJ-only exports of 3 channels killed after
    # their images (once, twice), then one that completes: no export.json was left to list the
    # first export's files, and the last export must still remove those it does not write.
    out = tmp_path / "asset"
    export_mesh(constant_texture(), square_mesh(), out, resolution=16, formats="obj",
                measure=False, neural_precision="f16")  # fmt: skip
    (out / "notes.txt").write_text("mine")
    obj_only = dict(formats="obj", measure=False)
    for _ in range(kills):
        _export_killed_at(monkeypatch, out, coordinate_texture(SQUARE_AABB), "write_obj_asset",
                          **obj_only)  # fmt: skip
        assert not (out / "export.json").exists()
    capsys.readouterr()
    summary = export_mesh(coordinate_texture(SQUARE_AABB), square_mesh(), out, resolution=8,
                          **obj_only)  # fmt: skip
    gone = ["neural_decoder.py", "texture_ks.png", "texture_n.png", "texture_neural.safetensors"]
    assert summary["removed_earlier_files"] == gone
    assert sorted(p.name for p in out.iterdir()) == [
        "export.json", "mesh.mtl", "mesh.obj", "notes.txt", "texture_kd.png",
    ]  # fmt: skip
    assert f"mptex export: removed {', '.join(gone)}: " in capsys.readouterr().err


def test_the_export_after_one_killed_midway_removes_the_killed_ones_files(tmp_path, monkeypatch):
    # An OBJ-only export of 3 channels, then one of 9 channels with the neural files killed
    # before its export.json, then an OBJ-only export of 3 channels: the killed export's files
    # it does not write go too.
    out = tmp_path / "asset"
    export_mesh(coordinate_texture(SQUARE_AABB), square_mesh(), out, resolution=8,
                formats="obj", measure=False)  # fmt: skip
    _export_killed_at(monkeypatch, out, constant_texture(), "_remove_earlier_files",
                      formats="obj", measure=False, neural_precision="f16")  # fmt: skip
    assert (out / "texture_neural.safetensors").is_file()
    summary = export_mesh(coordinate_texture(SQUARE_AABB), square_mesh(), out, resolution=8,
                          formats="obj", measure=False)  # fmt: skip
    assert summary["removed_earlier_files"] == [
        "neural_decoder.py", "texture_ks.png", "texture_n.png", "texture_neural.safetensors",
    ]  # fmt: skip
    assert sorted(p.name for p in out.iterdir()) == [
        "export.json", "mesh.mtl", "mesh.obj", "texture_kd.png",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "channels, options",
    [
        (3, dict(formats="obj", measure=False)),
        (3, dict(formats="glb", measure=False)),  # no OBJ
        (9, dict(formats="obj", measure=False, kd_format="png16", neural_precision="int8")),
        (9, dict(formats=["obj", "glb"], measure=True)),
        (5, dict(formats="glb", measure=True)),  # the measurement writes the OBJ
    ],
)
def test_export_pending_json_lists_the_files_the_export_writes(tmp_path, channels, options):
    # It names the files of an export killed before its export.json: what the export wrote,
    # no more (a name listed and not written could be a user's file of that name).
    if "glb" in str(options["formats"]):
        pytest.importorskip("trimesh")
    texture = coordinate_texture(SQUARE_AABB, channels)
    listed = []
    real = export_module.atomic_write_bytes

    def atomic_write_bytes(path, write):
        if Path(path).name == "export.json":  # just before it: the marker as the export left it
            listed.append(json.loads((Path(path).parent / "export.pending.json").read_text()))
        real(path, write)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(export_module, "atomic_write_bytes", atomic_write_bytes)
        summary = export_mesh(texture, square_mesh(), tmp_path, resolution=8, **options)
    assert listed[0]["files"] == sorted(summary["files"].values())
    assert not (tmp_path / "export.pending.json").exists()


def png_pixels(path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


@pytest.mark.parametrize(
    "channels, layout, rest",
    [(5, {"kd": [0, 3]}, [3, 4]), (11, {"kd": [0, 3], "ks": [3, 6], "n": [6, 9]}, [9, 10])],
)
def test_export_json_lists_the_channel_layout_and_the_channels_not_written(
    channels, layout, rest, tmp_path
):
    summary = export_mesh(coordinate_texture(SQUARE_AABB, channels), square_mesh(), tmp_path,
                          resolution=16, formats="obj", measure=False)  # fmt: skip
    written = json.loads((tmp_path / "export.json").read_text())
    for got in (summary, written):
        assert got["channels"] == channels and got["layout"] == layout
        assert got["channels_not_written"] == rest and got["kd_encoding"] == "sRGB"
        assert got["source"] is None  # a texture that is not a run's


def test_mtl_references_the_albedo_and_the_ks_map(tmp_path):
    mesh = square_mesh()
    write_obj_asset(tmp_path, mesh, {"kd": "texture_kd.png", "ks": "texture_ks.png"})
    mtl = (tmp_path / "mesh.mtl").read_text().splitlines()
    assert "newmtl baked" in mtl
    assert "map_Kd texture_kd.png" in mtl and "map_Ks texture_ks.png" in mtl
    obj = (tmp_path / "mesh.obj").read_text().splitlines()
    assert "mtllib mesh.mtl" in obj and "usemtl baked" in obj
    write_obj_asset(tmp_path, mesh, {"kd": "texture_kd.png"})
    assert not any(line.startswith("map_Ks") for line in (tmp_path / "mesh.mtl").read_text()
                   .splitlines())  # fmt: skip


def test_obj_asset_is_written_a_block_of_rows_at_a_time(tmp_path, monkeypatch):
    """write_obj_asset held a 1M-face mesh's whole text and the Python lists of all its numbers
    (0.67 GB for a 95 MB mesh.obj). Python's and NumPy's allocations at its peak (tracemalloc;
    torch's tensors are not among them) are counted here for the knot's 4,000 triangles with
    UVs and normals, written 64 rows at a time: the same bytes as in one block."""
    import tracemalloc

    mesh = torus_knot(100, 20)
    (tmp_path / "one").mkdir()
    (tmp_path / "blocks").mkdir()
    write_obj_asset(tmp_path / "one", mesh, {"kd": "texture_kd.png"})
    import mptex.render.obj as obj  # its blocks of rows are the export's too

    monkeypatch.setattr(obj, "_WRITE_ROWS", 64)
    tracemalloc.start()
    try:
        write_obj_asset(tmp_path / "blocks", mesh, {"kd": "texture_kd.png"})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    text = (tmp_path / "blocks" / "mesh.obj").read_bytes()
    assert text == (tmp_path / "one" / "mesh.obj").read_bytes()
    # The faces' int64 corner indices (72 bytes a face, about 3/4 of the file's share of a
    # face) are one array; the text is never whole (held whole it alone was the file's size,
    # with the lists of its numbers 6 times it).
    assert peak < 2 * len(text), f"{peak} bytes at the peak for a file of {len(text)}"


def test_obj_keeps_float32_positions_exactly_and_each_corners_own_normal(tmp_path):
    gen = torch.Generator().manual_seed(0)
    pos = torch.randn(4, 3, generator=gen) * 1e3 + torch.randn(4, 3, generator=gen) * 1e-3
    uv = torch.rand(5, 2, generator=gen)
    normals = torch.eye(3)  # unit normals: load_obj's normalisation leaves them exactly
    mesh = Mesh(
        v_pos=pos,
        t_pos_idx=torch.tensor([[0, 1, 2], [1, 3, 2]], dtype=torch.int32),
        v_tex=uv,
        t_tex_idx=torch.tensor([[0, 1, 2], [4, 3, 2]], dtype=torch.int32),
        v_nrm=normals,
        t_nrm_idx=torch.tensor([[2, 2, 0], [1, 0, 1]], dtype=torch.int32),
    )
    save_image(tmp_path / "texture_kd.png", torch.rand(4, 4, 3, generator=gen))
    write_obj_asset(tmp_path, mesh, {"kd": "texture_kd.png"})
    loaded = load_obj(tmp_path / "mesh.obj")

    def corners(m: Mesh, values: str, index: str) -> torch.Tensor:
        return getattr(m, values)[getattr(m, index).long()]  # [T, 3, k], per face corner

    for values, index in (("v_pos", "t_pos_idx"), ("v_nrm", "t_nrm_idx")):
        assert torch.equal(corners(loaded, values, index), corners(mesh, values, index)), values
    torch.testing.assert_close(
        corners(loaded, "v_tex", "t_tex_idx"),
        corners(mesh, "v_tex", "t_tex_idx"),
        rtol=0,
        atol=1e-7,
    )


def _glb_json(path) -> dict:
    data = Path(path).read_bytes()
    (length,) = struct.unpack_from("<I", data, 12)
    return json.loads(data[20 : 20 + length])


@pytest.mark.requires_trimesh
def test_glb_material_is_dielectric_and_fully_rough(tmp_path):
    mesh = square_mesh()
    write_glb(tmp_path / "m.glb", mesh, torch.full((4, 4, 3), 0.5))
    pbr = _glb_json(tmp_path / "m.glb")["materials"][0]["pbrMetallicRoughness"]
    # glTF defaults both factors to 1 when absent
    assert pbr.get("metallicFactor", 1.0) == 0.0 and pbr.get("roughnessFactor", 1.0) == 1.0


def test_exr_albedo_is_written_linear_and_named_in_the_mtl(tmp_path, monkeypatch):
    written = {}

    def recording_save_image(path, img, to_srgb=False):
        written[Path(path).name] = (img.clone(), to_srgb)
        Path(path).write_bytes(b"")

    monkeypatch.setattr(export_module, "save_image", recording_save_image)
    texture, mesh = coordinate_texture(SQUARE_AABB, 6), square_mesh()
    summary = export_mesh(texture, mesh, tmp_path / "a", resolution=16, formats="obj",
                          kd_format="exr", measure=False)  # fmt: skip
    assert summary["kd_encoding"] == "linear float (EXR)"
    assert summary["files"]["kd"] == "texture_kd.exr" and summary["files"]["ks"] == "texture_ks.exr"
    baked = bake_texture(texture, mesh, 16, backend="torch").texture
    for name, first in (("texture_kd.exr", 0), ("texture_ks.exr", 3)):
        values, to_srgb = written[name]
        assert to_srgb is False and torch.equal(values, baked[..., first : first + 3])
    mtl = (tmp_path / "a" / "mesh.mtl").read_text().splitlines()
    assert "map_Kd texture_kd.exr" in mtl and "map_Ks texture_ks.exr" in mtl


def test_a_missing_exr_writer_is_one_line_naming_kd_format(tmp_path):
    try:
        save_image(tmp_path / "probe.exr", torch.zeros(1, 1, 3))
        pytest.skip("this machine writes EXR")
    except RuntimeError:
        pass
    out = tmp_path / "new" / "asset"
    with pytest.raises(RuntimeError) as err:
        export_mesh(coordinate_texture(SQUARE_AABB), square_mesh(), out, resolution=16,
                    formats="obj", kd_format="exr")  # fmt: skip
    message = str(err.value)
    assert message.startswith("export.kd_format: 'exr' needs an imageio plugin that writes EXR")
    assert "\n" not in message and "freeimage" in message and "probe" not in message
    # the folders the export made for nothing are gone, the one that was there stays
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "notes.txt").write_text("mine")
    with pytest.raises(RuntimeError, match="^export.kd_format: "):
        export_mesh(coordinate_texture(SQUARE_AABB), square_mesh(), tmp_path / "kept",
                    resolution=16, formats="obj", kd_format="exr")  # fmt: skip
    assert [p.name for p in (tmp_path / "kept").iterdir()] == ["notes.txt"]


def test_mptex_export_without_an_exr_writer_names_the_flag(tmp_path, monkeypatch, capsys):
    from test_export import SMALL_KNOT, _train

    from mptex.cli.export import export_main

    def no_exr_writer(path, img, to_srgb=False):
        raise RuntimeError("save_image: cannot write .exr here (IndexError: no plugin)")

    monkeypatch.setattr(export_module, "save_image", no_exr_writer)
    run = _train(tmp_path / "run", *SMALL_KNOT, "train.iterations=1")
    out = tmp_path / "asset"
    assert export_main([str(run), "--out", str(out), "--kd-format", "exr"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        "mptex-export: error: --kd-format: 'exr' needs an imageio plugin that writes EXR"
    ), err
    assert not out.exists()


@pytest.mark.requires_trimesh
def test_a_glb_only_export_writes_the_obj_only_to_measure_it(tmp_path):
    texture, mesh = coordinate_texture(SQUARE_AABB), square_mesh()
    summary = export_mesh(texture, mesh, tmp_path / "m", resolution=32, formats="glb",
                          decode_precisions=[])  # fmt: skip
    assert (tmp_path / "m" / "mesh.glb").is_file() and (tmp_path / "m" / "mesh.obj").is_file()
    assert summary["psnr_baked_vs_neural"] > 30
    assert len(summary["psnr_baked_vs_neural_per_image"]) == summary["n_views"] == 8
    # texels per pixel: texels per world unit times world units per pixel
    assert summary["texels_per_pixel"] == pytest.approx(
        summary["texels_per_unit"] * summary["world_units_per_pixel"], rel=1e-12
    )
    summary = export_mesh(texture, mesh, tmp_path / "n", resolution=32, formats="glb",
                          measure=False)  # fmt: skip
    assert sorted(summary["files"]) == ["glb", "kd"]
    assert not (tmp_path / "n" / "mesh.obj").exists()


def test_non_finite_numbers_are_written_as_null():
    from mptex.bake.export import _json_safe

    got = _json_safe({"a": [float("inf"), 1.5], 2: (float("nan"), "x"), "b": -float("inf")})
    assert got == {"a": [None, 1.5], "2": [None, "x"], "b": None}


def test_fp8_neural_export_is_calibrated_on_the_texels_of_the_bake(tmp_path):
    pytest.importorskip("safetensors")
    texture = neural_texture()
    texture.AABB.copy_(torch.tensor(SQUARE_AABB))
    summary = export_mesh(texture, square_mesh(), tmp_path / "a", resolution=16, formats="obj",
                          measure=False, padding=1, neural_precision="fp8")  # fmt: skip
    neural = summary["neural"]
    assert neural["calibrated_on"] == "100 texel positions of the bake"  # the 10 x 10 block
    assert len(neural["input_scales"]) == len(texture.net.layers)
    summary = export_mesh(texture, square_mesh(), tmp_path / "b", resolution=16, formats="obj",
                          measure=False, neural_precision="f16")  # fmt: skip
    assert "calibrated_on" not in summary["neural"] and "input_scales" not in summary["neural"]


# ----------------------------------------------------------------------------- measurement
def test_orbit_views_frame_the_mesh_box_to_a_longest_side_of_two():
    # A box from (5, -2, 1) to (11, 0, 2): centre (8, -1, 1.5), longest side 6, scale 1/3.
    corners = torch.tensor([[x, y, z] for x in (5.0, 11.0) for y in (-2.0, 0.0)
                            for z in (1.0, 2.0)])  # fmt: skip
    mesh = Mesh(v_pos=corners, t_pos_idx=torch.tensor([[0, 1, 2], [5, 6, 7]], dtype=torch.int32))
    gbuffer, mvp = orbit_views_around(mesh, n_views=3, resolution=8, backend="torch")
    unit = (corners - torch.tensor([8.0, -1.0, 1.5])) / 3
    ones = torch.ones(8, 1)
    want = torch.cat([unit, ones], 1) @ orbit_views(3).mvp.transpose(1, 2)
    got = torch.cat([corners, ones], 1) @ mvp.transpose(1, 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert gbuffer.mask.shape == (3, 8, 8)


def test_measurement_composites_the_reference_over_the_chosen_background(tmp_path):
    from mptex.bake.export import measure_bake

    texture, mesh = coordinate_texture(SQUARE_AABB), square_mesh()
    result = bake_texture(texture, mesh, 32, backend="torch")
    write_obj_asset(tmp_path, result.mesh, write_texture_images(tmp_path, result.texture))
    gbuffer, mvp = orbit_views_around(mesh, n_views=2, resolution=32, backend="torch")
    mask = gbuffer.mask
    assert 0 < int(mask.sum()) < mask.numel()
    with torch.no_grad():
        kd = texture.sample(gbuffer.position[mask])[:, :3]
    for background, level in (("black", 0.0), ("white", 1.0)):
        # The neural image itself, opaque, with the background painted in: 100 dB (the cap).
        opaque = torch.full((*mask.shape, 4), level)
        opaque[..., 3] = 1
        opaque[mask, :3] = kd
        # The same with alpha 0 off the surface and other colours there: composited away.
        cut_out = torch.full((*mask.shape, 4), 0.3)
        cut_out[..., 3] = mask.float()
        cut_out[mask, :3] = kd
        for reference in (opaque, cut_out):
            got = measure_bake(texture, tmp_path / "mesh.obj", gbuffer, mvp, reference,
                               background, backend="torch")  # fmt: skip
            assert got["background"] == background
            assert got["psnr_neural_vs_reference"] == pytest.approx(100.0), background


def test_world_units_per_pixel_is_the_median_step_between_covered_neighbours(tmp_path):
    from mptex.bake.export import measure_bake

    texture, mesh = coordinate_texture(SQUARE_AABB), square_mesh()
    result = bake_texture(texture, mesh, 16, backend="torch")
    write_obj_asset(tmp_path, result.mesh, write_texture_images(tmp_path, result.texture))
    gbuffer, mvp = orbit_views_around(mesh, n_views=2, resolution=24, backend="torch")
    position, mask = gbuffer.position, gbuffer.mask
    steps = sorted(
        float((position[b, y, x + 1] - position[b, y, x]).norm())
        for b in range(2) for y in range(24) for x in range(23)
        if mask[b, y, x] and mask[b, y, x + 1]
    )  # fmt: skip
    got = measure_bake(texture, tmp_path / "mesh.obj", gbuffer, mvp, backend="torch")
    low, high = steps[(len(steps) - 1) // 2], steps[len(steps) // 2]
    assert low - 1e-7 <= got["world_units_per_pixel"] <= high + 1e-7
    # Every other column: no two horizontal neighbours both on the surface.
    alternate = torch.zeros_like(mask)
    alternate[..., ::2] = True
    sparse = dataclasses.replace(gbuffer, mask=mask & alternate)
    got = measure_bake(texture, tmp_path / "mesh.obj", sparse, mvp, backend="torch")
    assert got["world_units_per_pixel"] is None


# ----------------------------------------------------------------------------- decoding
def test_points_outside_the_aabb_decode_as_their_clamped_point(tmp_path):
    pytest.importorskip("safetensors")
    texture = neural_texture()
    inside = points_in(texture, 500)
    lo, hi = texture.AABB
    outside = inside + (torch.rand(500, 3, generator=torch.Generator().manual_seed(2)) - 0.5) * 6
    clamped = torch.maximum(torch.minimum(outside, hi), lo)
    assert not bool(torch.equal(outside, clamped))
    for precision in DECODE_PRECISIONS:
        scales = [1.0] * len(texture.net.layers)  # fp8: fixed input scales for both sets
        a = decode_texture(texture, outside, precision, scales if precision == "fp8" else None)
        b = decode_texture(texture, clamped, precision, scales if precision == "fp8" else None)
        assert torch.equal(a, b), precision
    export_neural(texture, tmp_path / "n.safetensors", "f32")
    decoder = neural_decoder.load(tmp_path / "n.safetensors")
    assert np.array_equal(decoder.decode(outside.numpy()), decoder.decode(clamped.numpy()))


def test_an_unknown_precision_is_refused_before_decoding(tmp_path):
    texture = neural_texture()
    points = points_in(texture, 10)
    with pytest.raises(ValueError, match="^precision: expected one of"):
        decode_texture(texture, points, "int4")
    pytest.importorskip("safetensors")
    with pytest.raises(ValueError, match="^precision: expected one of"):
        export_neural(texture, tmp_path / "n.safetensors", "int4")
    with pytest.raises(ValueError, match="^calibration_points: the fp8 export needs points"):
        export_neural(texture, tmp_path / "n.safetensors", "fp8")


def test_a_decoder_with_biases_or_a_smoothstep_grid_is_refused(tmp_path):
    texture = neural_texture()
    layer = texture.net.layers[0]
    layer.bias = torch.nn.Parameter(torch.zeros(layer.weight.shape[0]))
    with pytest.raises(ValueError, match="^texture: the decoder handles bias-free MLPs"):
        decode_texture(texture, points_in(texture, 10), "f32")
    pytest.importorskip("safetensors")
    smooth = neural_texture({**DECODE_GRID, "interpolation": "Smoothstep"})
    with pytest.raises(ValueError, match="^texture: the neural export's decoder interpolates"):
        export_neural(smooth, tmp_path / "n.safetensors", "f16")


def random_views(texture, seed: int, size: int, covered: float):
    """Two views' G-buffer positions, uniform in the texture's box (``[2, size, size, 3]``),
    and a mask that covers about ``covered`` of their pixels."""
    gen = torch.Generator().manual_seed(seed)
    lo, hi = texture.AABB
    positions = lo + (hi - lo) * torch.rand(2, size, size, 3, generator=gen)
    return positions, torch.rand(2, size, size, generator=gen) > 1 - covered


def test_decode_table_max_error_is_the_largest_absolute_difference():
    texture = neural_texture()
    positions, mask = random_views(texture, seed=3, size=12, covered=0.7)
    table = decode_precision_table(texture, positions, mask, "white")
    points = positions[mask]
    f32 = decode_texture(texture, points, "f32")
    for precision in DECODE_PRECISIONS[1:]:
        values = decode_texture(texture, points, precision)
        want = max(abs(float(a) - float(b)) for a, b in zip(values.flatten(), f32.flatten()))
        assert table["max_abs_error"][precision] == pytest.approx(want, rel=1e-6), precision


def test_decode_table_composites_the_reference_over_the_background():
    texture = neural_texture()
    positions, mask = random_views(texture, seed=4, size=10, covered=0.6)
    f32 = decode_texture(texture, positions[mask], "f32")[:, :3]
    for background, level in (("black", 0.0), ("white", 1.0)):
        opaque = torch.full((2, 10, 10, 4), level)
        opaque[..., 3] = 1
        opaque[mask, :3] = f32
        cut_out = torch.full((2, 10, 10, 4), 0.3)
        cut_out[..., 3] = mask.float()
        cut_out[mask, :3] = f32
        for reference in (opaque, cut_out):
            table = decode_precision_table(texture, positions, mask, background, ["f32"],
                                           reference)  # fmt: skip
            assert table["psnr_vs_reference"]["f32"] == pytest.approx(100.0), background


def _header(path) -> dict:
    data = Path(path).read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length])


def test_neural_export_stores_each_precisions_tensors(tmp_path):
    pytest.importorskip("safetensors")
    texture = neural_texture()
    points = points_in(texture, 200)
    width = texture.net.layers[0].weight.shape[0]
    table = {"f32": ("F32", "F32"), "f16": ("F16", "F16"), "bf16": ("BF16", "BF16"),
             "fp8": ("F16", "F8_E4M3"), "fp8_rowwise": ("F16", "F8_E4M3"),
             "int8": ("F16", "I8")}  # fmt: skip
    extra = {
        "fp8": {"weight_scale_inv": [1], "input_scale": [1]},
        "fp8_rowwise": {"weight_scale_inv": [width]},
        "int8": {"weight_scale": [width]},
    }
    for precision, (grid, weight) in table.items():
        path = tmp_path / f"{precision}.safetensors"
        export_neural(texture, path, precision, points)
        header = _header(path)
        assert header["grid.table"]["dtype"] == grid, precision
        assert header["mlp.0.weight"]["dtype"] == weight, precision
        keys = {k.split(".", 2)[2] for k in header if k.startswith("mlp.0.")}
        assert keys == {"weight", *extra.get(precision, {})}, precision
        for key, shape in extra.get(precision, {}).items():
            tensor = header[f"mlp.0.{key}"]
            assert (tensor["dtype"], tensor["shape"]) == ("F32", shape), (precision, key)
        assert header["__metadata__"]["precision"] == precision


def test_numpy_decoder_scales_into_the_output_range(tmp_path):
    pytest.importorskip("safetensors")
    min_max = [[-1.0, 0.5, 2.0], [3.0, 1.5, 2.5]]
    texture = neural_texture(min_max=min_max)
    points = points_in(texture, 400)
    with torch.no_grad():
        expected = texture.sample(points)
    assert torch.equal(decode_texture(texture, points, "f32"), expected)
    export_neural(texture, tmp_path / "n.safetensors", "f32")
    got = neural_decoder.load(tmp_path / "n.safetensors").decode(points.numpy())
    np.testing.assert_allclose(got, expected.numpy(), rtol=0, atol=1e-5)
    assert got.min(0).tolist() >= [-1.0, 0.5, 2.0] and got.max(0).tolist() <= [3.0, 1.5, 2.5]


def test_numpy_decoder_row_wise_fp8_of_an_all_zero_row_is_zero(tmp_path):
    pytest.importorskip("safetensors")
    from mptex.bake.decode import _layer

    texture = neural_texture()
    export_neural(texture, tmp_path / "n.safetensors", "fp8_rowwise")
    decoder = neural_decoder.load(tmp_path / "n.safetensors")
    h = torch.randn(3, decoder.layers[0]["weight"].shape[1], generator=torch.Generator())
    h[1] = 0  # a point whose inputs are all zero (after a ReLU, say)
    got = decoder._layer(h.numpy(), decoder.layers[0])
    assert np.all(np.isfinite(got)) and np.all(got[1] == 0)
    want = _layer(h, texture.net.layers[0].weight.detach(), "fp8_rowwise", None).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)


def test_a_file_that_is_not_a_neural_export_is_refused(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    safetensors.save_file({"grid.table": torch.zeros(4)}, str(tmp_path / "x.safetensors"),
                          metadata={"format": "something-else/1"})  # fmt: skip
    with pytest.raises(ValueError, match="^metadata: not an mptex neural export"):
        neural_decoder.load(tmp_path / "x.safetensors")


def test_numpy_e4m3_table_is_torchs_float8_of_every_byte():
    table = neural_decoder._e4m3_table()
    want = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(table, want, equal_nan=True)
    assert int(np.isnan(table).sum()) == 2  # 0x7F and 0xFF


def test_numpy_rounding_breaks_ties_to_even_as_torchs_casts_do():
    # bfloat16: float32 values whose low 16 bits are exactly half a bfloat16 step.
    gen = np.random.default_rng(0)
    high = gen.integers(0x0080, 0x7F00, size=4000, dtype=np.uint32)  # finite, normal
    ties = ((high << 16) | 0x8000).view(np.float32)
    ties = np.concatenate([ties, -ties])
    want = torch.from_numpy(ties).to(torch.bfloat16).float().numpy()
    assert np.array_equal(neural_decoder.round_to_bf16(ties), want)
    # E4M3: the midpoints between neighbouring values (exact in float32), powers of two.
    values = np.unique(neural_decoder._e4m3_table())
    values = values[np.isfinite(values) & (values >= 0)]
    mids = ((values[1:] + values[:-1]) / 2).astype(np.float32)
    powers = np.exp2(np.arange(-9, 9)).astype(np.float32)
    x = np.concatenate([mids, -mids, powers, -powers])
    want = torch.from_numpy(x).to(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(neural_decoder.round_to_e4m3(x), want)


# ----------------------------------------------------------------------------- config
def test_export_padding_may_be_zero_and_chunk_size_must_be_positive():
    assert check_export_config({"padding": 0})["padding"] == 0
    with pytest.raises(ValueError, match="^export.chunk_size: "):
        check_export_config({"chunk_size": 0})
    # mip levels 0-2 free of background: 2**2 texels of padding by default
    assert EXPORT_DEFAULTS["padding"] == 4 and EXPORT_DEFAULTS["resolution"] == 1024


# ----------------------------------------------------------------------------- mptex-export
@pytest.fixture(scope="module")
def black_run(tmp_path_factory):
    from test_export import SMALL_KNOT, _train

    return _train(tmp_path_factory.mktemp("black_run"), *SMALL_KNOT,
                  "train.val_background=black", "export.resolution=64", "export.formats=[obj]",
                  "export.decode_precisions=[]")  # fmt: skip


@pytest.mark.requires_xatlas
def test_mptex_export_takes_the_runs_export_group_and_background(black_run):
    from mptex.cli.export import export_main

    assert export_main([str(black_run)]) == 0
    summary = json.loads((black_run / "export" / "export.json").read_text())  # the default
    assert summary["resolution"] == 64 and summary["background"] == "black"
    assert "glb" not in summary["files"] and "decode_precision" not in summary


@pytest.mark.requires_xatlas
def test_mptex_export_keeps_a_runs_measure_false(tmp_path):
    from test_export import SMALL_KNOT, _train

    from mptex.cli.export import export_main

    run = _train(tmp_path / "run", *SMALL_KNOT, "train.iterations=2", "export.resolution=64",
                 "export.formats=[obj]", "export.measure=false")  # fmt: skip
    assert export_main([str(run), "--out", str(tmp_path / "out")]) == 0
    summary = json.loads((tmp_path / "out" / "export.json").read_text())
    assert summary["measure_skipped"] == "export.measure=false"


def test_export_json_names_the_run_and_the_checkpoint_it_exported(tmp_path, capsys):
    from test_export import SMALL_KNOT, _train

    from mptex.cli.export import export_main

    # A run stopped after 3 of 10 iterations: its checkpoint and metrics.json say so.
    run = _train(tmp_path / "run", *SMALL_KNOT, "train.iterations=3", "train.seed=7",
                 "export.resolution=64", "export.formats=[obj]",
                 "export.measure=false")  # fmt: skip
    ckpt = torch.load(run / "checkpoint.pt", weights_only=False)
    ckpt["config"]["train"]["iterations"] = 10
    torch.save(ckpt, run / "checkpoint.pt")
    metrics = json.loads((run / "metrics.json").read_text())
    (run / "metrics.json").write_text(json.dumps({**metrics, "status": "interrupted"}))
    assert export_main([str(run), "--out", str(tmp_path / "out")]) == 0
    assert "exporting a checkpoint of 3 of 10 iterations" in capsys.readouterr().err
    source = json.loads((tmp_path / "out" / "export.json").read_text())["source"]
    assert source == {
        "run_dir": str(run.resolve()),
        "checkpoint": str(run.resolve() / "checkpoint.pt"),
        "iterations": 3,
        "iterations_planned": 10,
        "status": "interrupted",
        "final_weights": False,
        "precision": metrics["precision"],
        "scene": metrics["scene"],
        "seed": 7,
    }
    assert metrics["seed"] == 7 and isinstance(metrics["precision"], str)
    # Without a readable metrics.json the status is unknown, and not the run's result.
    (run / "metrics.json").unlink()
    assert export_main([str(run), "--out", str(tmp_path / "out")]) == 0
    source = json.loads((tmp_path / "out" / "export.json").read_text())["source"]
    assert source["status"] is None and source["final_weights"] is False


@pytest.mark.requires_xatlas  # the knot's mesh gets its UVs from xatlas
def test_a_runs_own_export_names_its_final_weights_as_such(tmp_path):
    from tiny_runs import tiny_cfg

    from mptex.bake import TrainingExport
    from mptex.train import train
    from mptex.train.checkpoint import export_source, load_checkpoint

    cfg = tiny_cfg("train.iterations=2", "export.enabled=true", "export.resolution=32",
                   "export.formats=[obj]", "export.measure=false")  # fmt: skip
    metrics = train(cfg, tmp_path, exporter=TrainingExport())
    assert metrics["status"] == "completed" and metrics["export"].get("error") is None
    source = json.loads((tmp_path / "export" / "export.json").read_text())["source"]
    config = load_checkpoint(tmp_path / "checkpoint.pt")["config"]
    assert source == export_source(tmp_path, config, 2, "completed")
    assert source["status"] == "completed" and source["final_weights"] is True


@pytest.mark.requires_xatlas
@pytest.mark.parametrize(
    "override, message",
    [
        ("++export.chart_options={bogus:1}",
         "export.chart_options.bogus: unknown xatlas option; valid: ['fix_winding', "),
        ("++export.pack_options={resolution:8}",
         "export.pack_options.resolution: set by the bake (the atlas is the bake resolution)"),
    ],
)  # fmt: skip
def test_a_bad_xatlas_option_stops_the_run_at_start(tmp_path, override, message):
    # The options were first read by the unwrap at the end: the run trained, then its export
    # failed ("export failed: ValueError: chart_options.bogus: ..."); now the run's start.
    from tiny_runs import tiny_cfg

    from mptex.bake import TrainingExport
    from mptex.train import ConfigError, train

    cfg = tiny_cfg("train.iterations=2", "export.enabled=true", "export.resolution=32",
                   "export.formats=[obj]", "export.unwrap=always", override)  # fmt: skip
    with pytest.raises(ConfigError) as err:
        train(cfg, tmp_path, exporter=TrainingExport())
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
    assert not (tmp_path / "checkpoint.pt").exists()


def test_a_bad_xatlas_option_is_refused_before_any_work(tmp_path):
    # export_mesh's own check, on a mesh whose UVs are kept: the options go unused there, but a
    # misspelt one is still the user's error, said rather than dropped.
    pytest.importorskip("xatlas")
    with pytest.raises(ValueError, match=r"^export\.chart_options\.bogus: unknown xatlas option"):
        export_mesh(constant_texture(), square_mesh(), tmp_path / "a", resolution=16,
                    formats="obj", chart_options={"bogus": 1})  # fmt: skip
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize(
    "options, message",
    [
        ({"chart_options": {"max_iterations": "abc"}},
         "export.chart_options.max_iterations: expected an integer in [0, 4294967295] "
         "(xatlas's uint32), got 'abc'"),
        ({"chart_options": {"max_iterations": True}},
         "export.chart_options.max_iterations: expected an integer in [0, 4294967295] "
         "(xatlas's uint32), got True"),
        ({"pack_options": {"padding": -1}},
         "export.pack_options.padding: expected an integer in [0, 4294967295] (xatlas's "
         "uint32), got -1"),
        ({"pack_options": {"bilinear": 1}},
         "export.pack_options.bilinear: expected true or false, got 1"),
        ({"chart_options": {"max_cost": float("nan")}},
         "export.chart_options.max_cost: expected a finite number, got nan"),
    ],
)  # fmt: skip
def test_an_xatlas_option_of_the_wrong_kind_says_what_it_expected(options, message):
    # xatlas's own TypeError spans lines ("(): incompatible function arguments. The following
    # argument types are supported: ..."), and it took True for 1 and 1 for True, NaN as a cost.
    pytest.importorskip("xatlas")
    from mptex.bake.unwrap import check_xatlas_options

    with pytest.raises(ValueError) as err:
        check_xatlas_options(options.get("chart_options"), options.get("pack_options"),
                             "export.")  # fmt: skip
    assert str(err.value) == message


def test_a_bad_value_from_the_runs_config_names_the_export_key(black_run, tmp_path, monkeypatch,
                                                               capsys):  # fmt: skip
    from mptex.cli.export import export_main

    monkeypatch.setattr(bake_module, "available_bytes", lambda device: 1 << 10)
    assert export_main([str(black_run), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mptex-export: error: export.resolution: a 64x64 bake"), err
