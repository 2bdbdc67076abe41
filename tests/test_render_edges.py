"""Renderer, scene, shading, loss and bake/export behaviour checked against independent
references: hand-computed values, defining formulas and brute-force per-pixel loops."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

import mptex
from mptex.bake import bake_texture, texel_positions
from mptex.bake.export import write_glb, write_texture_images
from mptex.render import (
    Mesh,
    interpolate,
    load_image,
    orbit_views,
    random_views,
    rasterize,
    rgb_to_srgb,
    srgb_to_rgb,
    texture,
    unit_size,
)
from mptex.render.camera import random_rotation_translation
from mptex.scenes import build_scene, gt_texture, render_gbuffer, torus_knot
from mptex.scenes.config import check_scene_config
from mptex.train.shading import composite, draw_background, light_direction, shade

TRI1 = torch.tensor([[0, 1, 2]], dtype=torch.int32)
TINY_GRID = {"otype": "HashGrid", "n_levels": 2, "log2_hashmap_size": 10, "base_resolution": 4,
             "per_level_scale": 2.0}  # fmt: skip


# ----------------------------------------------------------------------------- cameras
@pytest.mark.parametrize("kind", ["orbit", "random"])
def test_campos_is_the_point_the_view_matrix_sends_to_the_origin(kind):
    # The camera sits at the origin of camera space, so mv @ [campos, 1] = [0, 0, 0, 1] for
    # every view, whatever the rotation (a check that |campos| = radius alone cannot make).
    if kind == "orbit":
        cams = orbit_views(5, radius=2.5)
    else:
        cams = random_views(5, radius=2.5, generator=torch.Generator().manual_seed(3))
    ones = torch.ones(len(cams), 1)
    origin = (cams.mv @ torch.cat([cams.campos, ones], 1).unsqueeze(-1)).squeeze(-1)
    expected = torch.tensor([0.0, 0.0, 0.0, 1.0]).expand(len(cams), 4)
    # float32 inverse and product of matrices with entries <= 2.5: errors ~1e-6.
    torch.testing.assert_close(origin, expected, rtol=0, atol=1e-5)


def test_random_translation_is_uniform_in_the_symmetric_cube():
    # nvdiffrec jitters the object by a uniform translation in [-t, t]^3: over 400 draws every
    # component reaches below -0.8 t and above 0.8 t (each miss has probability 0.9^400), and
    # none leaves the cube; the mean is near 0 (std of the mean: t / sqrt(3 * 400) ~ 0.03 t).
    gen = torch.Generator().manual_seed(0)
    t = torch.stack([random_rotation_translation(0.25, gen)[:3, 3] for _ in range(400)])
    assert bool((t.abs() <= 0.25).all())
    assert bool((t.min(0).values < -0.2).all()) and bool((t.max(0).values > 0.2).all())
    assert float(t.mean(0).abs().max()) < 0.25 * 0.15


# ----------------------------------------------------------------------------- sRGB
def test_srgb_to_linear_on_both_segments_of_its_definition():
    # IEC 61966-2-1: c / 12.92 for c <= 0.04045, ((c + 0.055) / 1.055) ** 2.4 above, evaluated
    # in float64 here. float32 division and pow are within a few ulps: rtol 2e-6.
    srgb = [0.0, 0.01, 0.02, 0.04, 0.05, 0.2, 0.5, 0.9, 1.0]

    def linear(c):
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    got = srgb_to_rgb(torch.tensor(srgb).unsqueeze(-1).expand(-1, 3))
    want = torch.tensor([linear(c) for c in srgb], dtype=torch.float64)
    torch.testing.assert_close(got.double(), want[:, None].expand(-1, 3), rtol=2e-6, atol=1e-9)
    # and the forward curve on its linear segment: 12.92 x exactly (to float32 rounding).
    lin = torch.tensor([[0.0005, 0.001, 0.003]])
    torch.testing.assert_close(rgb_to_srgb(lin), lin * 12.92, rtol=1e-6, atol=0)


# ----------------------------------------------------------------------------- texture
@pytest.mark.parametrize("height, width", [(4, 2), (2, 4)])
def test_clamped_bilinear_lookup_on_a_non_square_texture(height, width):
    # texel (column i, row j) holds 10 j + i and is centred at ((i + 0.5) / W, (j + 0.5) / H).
    rows = torch.arange(height, dtype=torch.float32)[:, None]
    cols = torch.arange(width, dtype=torch.float32)[None, :]
    tex = (10 * rows + cols)[None, ..., None]

    def expected(u, v):  # bilinear between clamped texel centres, computed by hand below
        x = min(max(u * width - 0.5, 0.0), width - 1.0)
        y = min(max(v * height - 0.5, 0.0), height - 1.0)
        return 10 * y + x  # the texel values are linear in (row, column)

    uvs = [(0.3, 0.9), (0.9, 0.3), (0.95, 0.95), (0.2, 1.3), (1.4, 0.6), (-0.3, -0.2), (0.6, 0.6)]
    got = texture(tex, torch.tensor(uvs).reshape(1, 1, -1, 2), boundary_mode="clamp",
                  backend="torch").reshape(-1)  # fmt: skip
    want = torch.tensor([expected(u, v) for u, v in uvs])
    # values below 40 in float32: a few ulps.
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- meshes
def test_unit_size_centres_every_axis_and_scales_the_longest_to_two():
    # A box spanning x in [1, 3], y in [-2, 6], z in [0, 1]: longest side 8 -> scale 1/4,
    # centre (2, 2, 0.5) -> AABB [-0.25, -1, -0.125] .. [0.25, 1, 0.125].
    corners = torch.tensor([[x, y, z] for x in (1.0, 3.0) for y in (-2.0, 6.0) for z in (0.0, 1.0)])
    mesh = Mesh(v_pos=corners, t_pos_idx=torch.tensor([[0, 1, 2], [5, 6, 7]], dtype=torch.int32))
    got = unit_size(mesh).aabb
    want = torch.tensor([[-0.25, -1.0, -0.125], [0.25, 1.0, 0.125]])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-7)


@pytest.mark.parametrize(
    "v_pos, want",
    [
        # x in [-3e38, 3e38] (side 6e38, beyond float32's 3.4e38), y and z in [0, 3e38]: scale
        # 2 / 6e38, centre (0, 1.5e38, 1.5e38).
        ([[-3e38, 0, 0], [3e38, 0, 0], [0, 3e38, 0]], [[-1, -0.5, 0], [1, -0.5, 0], [0, 0.5, 0]]),
        # x in [1e38, 3.4e38] (side 2.4e38, but lo + hi = 4.4e38), y in [0, 1e38]: scale
        # 2 / 2.4e38, centre (2.2e38, 0.5e38, 0): x -1, 1, -0.2 / 1.2; y -0.5 / 1.2, 0.5 / 1.2.
        ([[1e38, 0, 0], [3.4e38, 1e38, 0], [2e38, 0, 0]],
         [[-1, -5 / 12, 0], [1, 5 / 12, 0], [-1 / 6, -5 / 12, 0]]),
    ],
)  # fmt: skip
def test_unit_size_of_coordinates_near_the_float32_limit(v_pos, want):
    mesh = Mesh(v_pos=torch.tensor(v_pos), t_pos_idx=torch.tensor([[0, 1, 2]], dtype=torch.int32))
    # float32 rounding of the inputs (3.4e38 and 1e38 are not exact) and of the scaling
    torch.testing.assert_close(unit_size(mesh).v_pos, torch.tensor(want), rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- rasterizer
def test_depth_is_clamped_where_the_snapped_triangle_covers_a_centre_outside_the_exact_one():
    # 4x4 pixels: a sub-pixel is 1/32 in NDC. The vertical edge at x = -0.249 snaps to -0.25,
    # onto the centres of column 1, which lie 0.001 outside the exact triangle. Its two vertices
    # on that edge sit on the far plane (z/w = 1), the third at z/w = 0.995: the exact plane
    # extrapolated to x = -0.25 gives 1 + 0.005 * 0.001 / 1.149 = 1.0000044 > 1, which must
    # come out clamped to the depth range as exactly 1.0 (and -1.0 mirrored at the near plane).
    for sign in (1.0, -1.0):
        pos = torch.tensor(
            [[-0.249, -0.9, sign, 1.0], [0.9, -0.9, 0.995 * sign, 1.0], [-0.249, 0.9, sign, 1.0]]
        )
        rast = rasterize(pos, TRI1, (4, 4), backend="torch")[0][0]
        assert torch.all(rast[:, 1, 3] == 1)  # the snapped edge keeps its samples
        assert torch.equal(rast[:, 1, 2], torch.full((4,), sign))
        assert float(rast[..., 2].abs().max()) <= 1.0


def test_a_vertex_index_equal_to_the_vertex_count_is_refused():
    # Valid indices are 0 .. V - 1: V itself is out of range and must be named as such.
    pos = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="tri: expected vertex indices in"):
        rasterize(pos, torch.tensor([[0, 1, 3]], dtype=torch.int32), (4, 4), backend="torch")
    rast = torch.zeros(1, 4, 4, 4)
    with pytest.raises(ValueError, match="tri: expected vertex indices in"):
        interpolate(torch.zeros(3, 2), rast, torch.tensor([[0, 1, 3]], dtype=torch.int32),
                    backend="torch")  # fmt: skip


def test_interpolate_takes_each_batch_entrys_own_attributes():
    # The same triangle in two batch entries, per-entry attributes [2, 3, 1]: pixel (1, 1)
    # has barycentrics (0.625, 0.125, 0.25) (hand-computed in the single-triangle test), so
    # entry 0 gives 0.625 * 1 + 0.125 * 2 + 0.25 * 3 = 1.625 and entry 1 ten times that.
    pos = torch.tensor([[-0.5, -0.5, 0.25, 1.0], [0.5, -0.5, 0.25, 1.0], [0.0, 0.5, 0.25, 1.0]])
    rast = rasterize(torch.stack([pos, pos]), TRI1, (4, 4), backend="torch")[0]
    attr = torch.tensor([[[1.0], [2.0], [3.0]], [[10.0], [20.0], [30.0]]])
    out, _ = interpolate(attr, rast, TRI1, backend="torch")
    torch.testing.assert_close(out[:, 1, 1, 0], torch.tensor([1.625, 16.25]))
    torch.testing.assert_close(out[:, 1, 2, 0], torch.tensor([2.125, 21.25]))  # (0.125, 0.625)
    assert float(out[:, 0].abs().max()) == 0.0  # row 0 is background in both entries


# ----------------------------------------------------------------------------- G-buffers
def _flat_triangle_mesh() -> Mesh:
    # One triangle in the z = 0.25 plane, drawn with an identity camera (clip = (x, y, z, 1)).
    v_pos = torch.tensor([[-0.5, -0.5, 0.25], [0.5, -0.5, 0.25], [0.0, 0.5, 0.25]])
    tri = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    return Mesh(v_pos=v_pos, t_pos_idx=tri)


def test_gbuffer_normals_follow_the_normal_indices_not_the_position_indices():
    # OBJ meshes index normals separately (f p/t/n): here the triangle's corners use normals
    # 3, 4, 5 of the table (all +z), while entries 0, 1, 2 (the position indices) point along
    # x. Every covered pixel must see +z.
    mesh = _flat_triangle_mesh()
    mesh.v_nrm = torch.tensor([[1.0, 0, 0]] * 3 + [[0.0, 0, 1]] * 3)
    mesh.t_nrm_idx = torch.tensor([[3, 4, 5]], dtype=torch.int32)
    gb = render_gbuffer(mesh, torch.eye(4)[None], (4, 4), backend="torch")
    assert int(gb.mask.sum()) == 2
    torch.testing.assert_close(gb.normal[gb.mask], torch.tensor([[0.0, 0, 1]] * 2))


def test_gbuffer_normals_are_unit_length_between_diverging_vertex_normals():
    # Vertex normals fanning out by 90 degrees: their barycentric mix is shorter than 1 (at
    # pixel (1, 1), weights (0.625, 0.125, 0.25)); the G-buffer holds it renormalised, as its
    # docstring promises. Reference: the mix computed by hand, divided by its length.
    mesh = _flat_triangle_mesh()
    mesh.v_nrm = torch.tensor([[1.0, 0, 0], [0.0, 1, 0], [0.0, 0, 1]])
    mesh.t_nrm_idx = mesh.t_pos_idx.clone()
    gb = render_gbuffer(mesh, torch.eye(4)[None], (4, 4), backend="torch")
    mix = torch.tensor([0.625, 0.125, 0.25])
    torch.testing.assert_close(gb.normal[0, 1, 1], mix / mix.norm(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gb.normal[gb.mask].norm(dim=-1), torch.ones(2))
    assert float(gb.normal[~gb.mask].abs().max()) == 0.0  # background stays zero
    # position: the same weights on the vertex positions.
    torch.testing.assert_close(gb.position[0, 1, 1], mix @ mesh.v_pos)


def test_gbuffer_mask_covers_surface_points_at_zero_depth():
    # Coverage is the triangle id, not the depth: a surface at z/w = 0 (the texture-space
    # atlas of a bake, any point on the plane half-way between the clip planes) is covered.
    mesh = _flat_triangle_mesh()
    mesh.v_pos = mesh.v_pos * torch.tensor([1.0, 1.0, 0.0])
    gb = render_gbuffer(mesh, torch.eye(4)[None], (4, 4), backend="torch")
    expected = torch.zeros(1, 4, 4, dtype=torch.bool)
    expected[0, 1, 1:3] = True  # the two centres inside (see the single-triangle test)
    assert torch.equal(gb.mask, expected)


# ----------------------------------------------------------------------------- built-in scene
def test_torus_knot_winds_outward_with_outward_normals():
    # Each ring of the tube (radial_segments vertices per tubular sample, a full circle) has
    # its centre at the ring's mean; d = vertex - centre points out of the tube. The vertex
    # normals must be radial (|n . d| / |d| near 1) and point out of the tube, and the
    # triangles wind counter-clockwise seen from outside: the signed volume
    # sum p0 . (p1 x p2) / 6 (divergence theorem) is positive. Otherwise an exported knot is
    # drawn inside out by viewers that cull back faces, and diffuse shading lights its far side.
    mesh = torus_knot(60, 8)
    ring = mesh.v_pos.double().reshape(60, 8, 3)
    out = ring - ring.mean(1, keepdim=True)
    radial = (out * mesh.v_nrm.double().reshape(60, 8, 3)).sum(-1) / out.norm(dim=-1)
    p = mesh.v_pos.double()[mesh.t_pos_idx.long()]
    volume = float((p[:, 0] * torch.linalg.cross(p[:, 1], p[:, 2])).sum() / 6)
    assert volume > 0.1
    # area-weighted normals of an 8-sided tube bend a little towards the tube's axis: > 0.9
    assert bool((radial > 0.9).all())


def test_gt_texture_is_its_documented_formula():
    # Per channel c: 0.5 + 0.5 tanh(2 sum_o amp_o sin(f_o d1 . x + p1) sin(f_o d2 . x + p2)),
    # octaves (f, amp) = (2.5, 0.45), (9, 0.33), (33, 0.22); unit directions and phases drawn
    # from the documented seed in the documented order (randn [3, 3, 2, 3], then rand
    # [3, 3, 2] * 2 pi). Evaluated here in float64 with explicit loops.
    octaves = ((2.5, 0.45), (9.0, 0.33), (33.0, 0.22))
    gen = torch.Generator().manual_seed(20240613)
    dirs = torch.randn(3, 3, 2, 3, generator=gen).double()
    dirs = dirs / dirs.norm(dim=-1, keepdim=True)
    phases = (torch.rand(3, 3, 2, generator=gen) * 2 * math.pi).double()
    x = torch.rand(20, 3, generator=torch.Generator().manual_seed(1)) * 2 - 1
    want = torch.zeros(20, 3, dtype=torch.float64)
    for c in range(3):
        total = torch.zeros(20, dtype=torch.float64)
        for o, (freq, amp) in enumerate(octaves):
            s1 = torch.sin(freq * (x.double() @ dirs[c, o, 0]) + phases[c, o, 0])
            s2 = torch.sin(freq * (x.double() @ dirs[c, o, 1]) + phases[c, o, 1])
            total += amp * s1 * s2
        want[:, c] = 0.5 + 0.5 * torch.tanh(2 * total)
    # float32 arguments up to 33 * sqrt(3) ~ 57 rad: sin's argument rounding ~4e-6 times the
    # slope, well inside 1e-4 (a changed constant moves values by > 1e-2).
    torch.testing.assert_close(gt_texture(x).double(), want, rtol=0, atol=1e-4)


# ----------------------------------------------------------------------------- scene configs
def test_scene_cameras_follow_resolution_fov_radius_and_clip_planes():
    # [H, W] = [12, 20]: aspect 5/3. fovy 60 deg: tan(30 deg) = 1/sqrt(3). near 0.5, far 10.
    # The projection is mvp @ mv^-1, compared with the OpenGL matrix written out by hand.
    cfg = {"name": "builtin", "resolution": [12, 20], "n_train_views": 2, "n_val_views": 3,
           "fovy_deg": 60.0, "cam_radius": 4.0, "near": 0.5, "far": 10.0,
           "tubular_segments": 12, "radial_segments": 4}  # fmt: skip
    scene = build_scene(cfg)
    assert scene.resolution == (12, 20)
    t = 1 / math.sqrt(3)
    proj = torch.tensor(
        [[1 / (t * 5 / 3), 0, 0, 0], [0, -1 / t, 0, 0],
         [0, 0, -10.5 / 9.5, -10 / 9.5], [0, 0, -1, 0]], dtype=torch.float64,
    )  # fmt: skip
    for split in ("train", "val"):
        views = scene.views(split, range(2))
        got = views.mvp.double() @ torch.linalg.inv(views.mv.double())
        # float32 matrices (entries <= 2): products and inverse within ~1e-6.
        torch.testing.assert_close(got, proj.expand_as(got), rtol=0, atol=1e-5)
        assert views.rgba.shape == (2, 12, 20, 4)
    # Validation orbit: the camera is cam_radius from the origin.
    val = scene.views("val", range(3))
    torch.testing.assert_close(val.campos.norm(dim=-1), torch.full((3,), 4.0))


def test_scene_seed_selects_the_training_cameras():
    base = {"name": "builtin", "resolution": 8, "n_train_views": 3, "n_val_views": 1,
            "tubular_segments": 12, "radial_segments": 4}  # fmt: skip
    a, b, c = (build_scene({**base, "seed": s}).views("train", range(3)).mv for s in (1, 1, 2))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_far_plane_at_the_near_plane_is_refused():
    with pytest.raises(ValueError, match="scene.far"):
        check_scene_config({"name": "builtin", "near": 1.0, "far": 1.0})
    assert check_scene_config({"name": "builtin", "resolution": [6, 9]})["resolution"] == (6, 9)


def _box_obj(tmp_path) -> str:
    # A box x in [0, 4], y in [1, 3], z in [-1, 0] with a Kd material, written by hand.
    (tmp_path / "box.mtl").write_text("newmtl grey\nKd 0.5 0.5 0.5\n")
    lines = ["mtllib box.mtl"]
    lines += [f"v {x} {y} {z}" for x in (0, 4) for y in (1, 3) for z in (-1, 0)]
    lines.append("usemtl grey")
    faces = [(1, 2, 4, 3), (5, 7, 8, 6), (1, 5, 6, 2), (3, 4, 8, 7), (1, 3, 7, 5), (2, 6, 8, 4)]
    lines += ["f " + " ".join(map(str, f)) for f in faces]
    (tmp_path / "box.obj").write_text("\n".join(lines) + "\n")
    return str(tmp_path / "box.obj")


@pytest.mark.parametrize("normalize", [True, False])
def test_mesh_scene_normalize_flag(tmp_path, normalize):
    cfg = {"name": "mesh", "path": _box_obj(tmp_path), "resolution": 8, "n_train_views": 1,
           "n_val_views": 1, "normalize": normalize}  # fmt: skip
    aabb = build_scene(cfg).aabb
    if normalize:  # centre (2, 2, -0.5), longest side 4 -> scale 1/2
        want = torch.tensor([[-1.0, -0.5, -0.25], [1.0, 0.5, 0.25]])
    else:  # the file's coordinates
        want = torch.tensor([[0.0, 1.0, -1.0], [4.0, 3.0, 0.0]])
    torch.testing.assert_close(aabb, want, rtol=0, atol=1e-6)


def test_training_batch_indices_address_every_views_covered_pixels():
    # TrainingBatch.covered is coverage.reshape(-1).nonzero() (its docstring), for every view
    # of the batch, the third included; points are the G-buffer positions at those pixels.
    cfg = {"name": "builtin", "resolution": 10, "n_train_views": 4, "n_val_views": 1,
           "tubular_segments": 24, "radial_segments": 6}  # fmt: skip
    scene = build_scene(cfg)
    batch = scene.training_batch(4, torch.Generator().manual_seed(0))
    assert len(set(batch.index)) > 1
    assert torch.equal(batch.covered, batch.coverage.reshape(-1).nonzero().squeeze(1))
    views = scene.views("train", batch.index)
    assert torch.equal(batch.points, views.position.reshape(-1, 3)[batch.covered])


# ----------------------------------------------------------------------------- shading
def test_diffuse_shading_on_hand_computed_cases():
    # tex = kd (3), ks (3, unused), normal offset (3): offset = 2 t - 1, so 0.5 leaves the
    # geometric normal. ambient 0.25: colour = kd (0.25 + 0.75 max(0, n . l)).
    kd = torch.tensor([0.2, 0.4, 0.8])
    up = torch.tensor([0.0, 0.0, 1.0])

    def tex(offset):
        return torch.cat([kd, torch.zeros(3), torch.tensor(offset)])[None]

    def lit(normal_offset, light):
        light = torch.tensor(light, dtype=torch.float32)
        light = light / light.norm()
        return shade(tex(normal_offset), up[None], "diffuse", light, 0.25)[0]

    torch.testing.assert_close(lit([0.5, 0.5, 0.5], [0, 0, 1]), kd)  # facing the light
    cos60 = 0.5  # light 60 degrees off the normal
    want = kd * (0.25 + 0.75 * cos60)
    torch.testing.assert_close(lit([0.5, 0.5, 0.5], [math.sqrt(3) / 2, 0, 0.5]), want)
    torch.testing.assert_close(lit([0.5, 0.5, 0.5], [0, 0, -1]), kd * 0.25)  # lit from behind
    # offset (1, 0, 0): n = normalize((1, 0, 1)); light along +x: cos = 1 / sqrt(2).
    torch.testing.assert_close(lit([1.0, 0.5, 0.5], [1, 0, 0]), kd * (0.25 + 0.75 / math.sqrt(2)))
    # the "kd" shading is the albedo whatever the normal
    torch.testing.assert_close(shade(tex([0.5, 0.5, 0.5]), None, "kd")[0], kd)


def test_light_direction_is_normalised_and_backgrounds_are_exact():
    torch.testing.assert_close(light_direction({"light_dir": [0.0, 3.0, 4.0]}),
                               torch.tensor([0.0, 0.6, 0.8]))  # fmt: skip
    shape = (1, 2, 2, 3)
    assert torch.equal(draw_background("white", shape, "cpu", None), torch.ones(shape))
    assert torch.equal(draw_background("black", shape, "cpu", None), torch.zeros(shape))
    rgb, bg = torch.full(shape, 0.8), torch.full(shape, 0.2)
    alpha = torch.tensor([0.0, 0.25, 1.0, 0.5]).reshape(1, 2, 2, 1)
    want = (0.8 * alpha + 0.2 * (1 - alpha)).expand(shape)  # straight alpha "over"
    torch.testing.assert_close(composite(rgb, alpha, bg), want)


# ----------------------------------------------------------------------------- bake
def _uv_plane_mesh(uv_texels: list[list[float]], n: int) -> Mesh:
    # Triangles given in texel units (texel (i, j) centred at (i, j)); positions are the UVs
    # with z = 0, so a position tells the UV it was evaluated at.
    uv = (torch.tensor(uv_texels, dtype=torch.float64) + 0.5) / n
    faces = torch.arange(len(uv_texels), dtype=torch.int32).reshape(-1, 3)
    pos = torch.cat([uv, torch.zeros(len(uv), 1, dtype=torch.float64)], 1).float()
    return Mesh(v_pos=pos, t_pos_idx=faces, v_tex=uv.float(), t_tex_idx=faces.clone())


def _centres_inside(tri: list[list[float]], n: int):
    """Texel centres inside a triangle given in texel units (float64 edge distances), and
    those within 0.05 texel of an edge: vertices snap to 1/16 texel, which moves an edge by up
    to 1/32 texel, so coverage there may go either way."""
    inside, unsure = set(), set()
    for j in range(n):
        for i in range(n):
            signs = []
            for k in range(3):
                (ax, ay), (bx, by) = tri[k], tri[(k + 1) % 3]
                length = math.hypot(bx - ax, by - ay)
                signs.append(((bx - ax) * (j - ay) - (by - ay) * (i - ax)) / length)
            if all(s > 0.05 for s in signs) or all(s < -0.05 for s in signs):
                inside.add(j * n + i)
            elif min(abs(s) for s in signs) <= 0.05:
                unsure.add(j * n + i)
    return inside, unsure


def test_banded_atlas_rasterization_covers_and_locates_every_texel(monkeypatch):
    # Large atlases are rasterized in horizontal bands; with 5 texel rows per band (bands
    # that do not divide the 32 rows evenly) the covered texels and their positions must be
    # those of the texel centres inside the triangle, whichever band they fall in.
    import mptex.bake.bake as bake_module

    n = 32
    tri = [[2.3, 1.2], [29.6, 4.7], [9.1, 30.4]]
    mesh = _uv_plane_mesh(tri, n)
    monkeypatch.setattr(bake_module, "_BAND_TEXELS", 5 * n)
    index, position, n_covered = texel_positions(mesh, n, backend="torch")
    covered = set(index[:n_covered].tolist())
    inside, unsure = _centres_inside(tri, n)
    assert inside - covered == set() and covered - inside - unsure == set()
    rows, cols = index[:n_covered] // n, index[:n_covered] % n
    centres = torch.stack([(cols + 0.5) / n, (rows + 0.5) / n], -1)
    error = (position[:n_covered, :2] - centres).abs().amax(-1)
    near_edge = torch.tensor([int(k) in unsure for k in index[:n_covered]])
    # Interpolated positions at texel centres: float32 barycentrics, ~1e-6. Next to an edge
    # the barycentrics may be clamped onto it: off by up to a snapping step, 1/32 texel.
    assert float(error[~near_edge].max()) < 1e-5
    assert float(error.max()) <= 1 / 32 / n


def _closest_reference(p, corners):
    """float64 distance^2 from p to a 2D triangle and its closest point (brute definition:
    0 and p itself when inside by edge signs, else the nearest point of the three segments)."""
    signs = []
    for k in range(3):
        (ax, ay), (bx, by) = corners[k], corners[(k + 1) % 3]
        signs.append((bx - ax) * (p[1] - ay) - (by - ay) * (p[0] - ax))
    if all(s >= 0 for s in signs) or all(s <= 0 for s in signs):
        return 0.0, p
    best = None
    for k in range(3):
        (ax, ay), (bx, by) = corners[k], corners[(k + 1) % 3]
        ex, ey = bx - ax, by - ay
        t = min(1.0, max(0.0, ((p[0] - ax) * ex + (p[1] - ay) * ey) / (ex * ex + ey * ey)))
        q = (ax + t * ex, ay + t * ey)
        d2 = (q[0] - p[0]) ** 2 + (q[1] - p[1]) ** 2
        if best is None or d2 < best[0]:
            best = (d2, q)
    return best


def test_closest_point_on_triangles_against_the_definition():
    from mptex.bake.bake import _closest_on_triangles

    gen = torch.Generator().manual_seed(0)
    corners = torch.rand(200, 3, 2, generator=gen, dtype=torch.float64) * 4
    # points around each triangle's centroid: about half inside, half outside
    points = corners.mean(1) + torch.randn(200, 2, generator=gen, dtype=torch.float64) * 0.8
    d2, bary = _closest_on_triangles(points, corners[:, 0], corners[:, 1], corners[:, 2])
    closest = (bary[:, :, None] * corners).sum(1)
    n_inside = 0
    for m in range(200):
        want_d2, want_q = _closest_reference(points[m].tolist(), corners[m].tolist())
        n_inside += want_d2 == 0.0
        assert float(d2[m]) == pytest.approx(want_d2, abs=1e-9), m
        assert closest[m].tolist() == pytest.approx(list(want_q), abs=1e-9), m
        assert float(bary[m].sum()) == pytest.approx(1.0, abs=1e-12)
    assert 10 < n_inside < 190  # both branches exercised


def test_a_ring_texel_takes_its_nearest_triangle_not_the_lower_index():
    # Two slivers (texel units) that cover no texel centre: triangle 0 near x = 1.93, triangle
    # 1 near x = 3.41. Texel (3, 3) lies ~1.06 texels from the first and ~0.41 from the second
    # (both within the sqrt(2) ring): it must be evaluated on the second, at about (3.41, 3).
    n = 8
    mesh = _uv_plane_mesh([[1.9, 0.5], [1.95, 0.5], [1.925, 5.5],
                           [3.4, 0.5], [3.45, 0.5], [3.425, 5.5]], n)  # fmt: skip
    index, position, n_covered = texel_positions(mesh, n, backend="torch")
    assert n_covered == 0
    where = (index == 3 * n + 3).nonzero()
    assert where.numel() == 1
    x, y = (position[int(where)][:2] * n - 0.5).tolist()  # back to texel units
    # the left edge of sliver 1 runs from (3.4, 0.5) to (3.425, 5.5): x = 3.4125 at y = 3.
    assert x == pytest.approx(3.4125, abs=0.01) and y == pytest.approx(3.0, abs=0.01)


def test_bake_stats_area_coverage_and_texel_density():
    # A 3 x 2 rectangle (area 6) mapped onto the whole [0, 1]^2: at 16^2 every texel centre is
    # covered, so coverage 1 and texels_per_unit = sqrt(256 / 6) texels per world unit.
    pos = torch.tensor([[0.0, 0, 0], [3, 0, 0], [3, 2, 0], [0, 2, 0]])
    uv = torch.tensor([[0.0, 0], [1, 0], [1, 1], [0, 1]])
    faces = torch.tensor([[0, 1, 2], [0, 2, 3]], dtype=torch.int32)
    mesh = Mesh(v_pos=pos, t_pos_idx=faces, v_tex=uv, t_tex_idx=faces.clone())
    torch.manual_seed(0)
    aabb = torch.tensor([[0.0, 0.0, -1.0], [3.0, 2.0, 1.0]])
    tex = mptex.MLPTexture3D(aabb, channels=3, internal_dims=8, hidden=1, precision="f32",
                             encoder=TINY_GRID)  # fmt: skip
    stats = bake_texture(tex, mesh, 16, padding=1, backend="torch").stats
    assert stats["surface_area"] == pytest.approx(6.0, rel=1e-9)
    assert stats["coverage"] == 1.0
    assert stats["texels_per_unit"] == pytest.approx(math.sqrt(256 / 6), rel=1e-9)


# ----------------------------------------------------------------------------- export
def test_png16_writes_ks_and_normal_groups_linear(tmp_path):
    # Only the albedo group is colour (sRGB); ks and the normal offset are data, stored as
    # round(x * 65535) of the linear value in 16-bit files as in 8-bit ones.
    values = torch.tensor([0.0, 0.2165, 0.5, 1.0])
    image = values[None, :, None].expand(1, 4, 9).contiguous()
    files = write_texture_images(tmp_path, image, "png16")
    assert set(files) == {"kd", "ks", "n"}
    srgb = [0.0, 0.5026, 0.7354, 1.0]  # sRGB encodings of the values, 4 decimals
    kd = load_image(tmp_path / files["kd"])[0, :, 0]
    assert kd.tolist() == pytest.approx(srgb, abs=1e-4)
    for group in ("ks", "n"):
        got = load_image(tmp_path / files[group])[0, :, 0]
        # 16-bit words: half a step of 1 / 65535.
        torch.testing.assert_close(got, values, rtol=0, atol=0.5 / 65535 + 1e-7)


def test_measurement_composites_are_straight_alpha_over_the_background():
    from mptex.bake.export import _over

    rgba = torch.tensor([0.8, 0.4, 0.0, 0.25]).reshape(1, 1, 1, 4)
    # background + (rgb - background) * alpha, by hand
    torch.testing.assert_close(_over(rgba, 1.0)[0, 0, 0], torch.tensor([0.95, 0.85, 0.75]))
    torch.testing.assert_close(_over(rgba, 0.0)[0, 0, 0], torch.tensor([0.2, 0.1, 0.0]))


def test_glb_vertices_carry_each_corners_own_normal_and_uv():
    # Positions, UVs and normals indexed separately (normal i of corner != position i): each
    # face corner of the split mesh must hold exactly the attributes its triangle names.
    from mptex.bake.export import _split_at_seams

    mesh = Mesh(
        v_pos=torch.tensor([[0.0, 0, 0], [1, 0, 0], [0, 1, 0], [1, 1, 0]]),
        t_pos_idx=torch.tensor([[0, 1, 2], [1, 3, 2]], dtype=torch.int32),
        v_tex=torch.tensor([[0.0, 0], [1, 0], [0, 1], [1, 1], [0.5, 0.5]]),
        t_tex_idx=torch.tensor([[0, 1, 2], [4, 3, 2]], dtype=torch.int32),
        v_nrm=torch.tensor([[0.0, 0, 1], [0.0, 1, 0], [1.0, 0, 0]]),
        t_nrm_idx=torch.tensor([[2, 2, 0], [1, 0, 1]], dtype=torch.int32),
    )
    positions, uvs, normals, faces = _split_at_seams(mesh)
    for t in range(2):
        for k in range(3):
            v = int(faces[t, k])
            assert torch.equal(positions[v], mesh.v_pos[mesh.t_pos_idx[t, k]])
            assert torch.equal(uvs[v], mesh.v_tex[mesh.t_tex_idx[t, k]])
            assert torch.equal(normals[v], mesh.v_nrm[mesh.t_nrm_idx[t, k]])


def _glb_base_colour(path) -> np.ndarray:
    """The base-colour PNG embedded in a .glb, decoded with Pillow (GLB: 12-byte header, JSON
    chunk, BIN chunk; the image's bufferView slices the BIN chunk)."""
    import io
    import json
    import struct

    from PIL import Image

    data = Path(path).read_bytes()
    json_len = struct.unpack_from("<I", data, 12)[0]
    gltf = json.loads(data[20 : 20 + json_len])
    bin_start = 20 + json_len + 8
    view = gltf["bufferViews"][gltf["images"][0]["bufferView"]]
    start = bin_start + view.get("byteOffset", 0)
    png = data[start : start + view["byteLength"]]
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def test_glb_base_colour_is_srgb_encoded(tmp_path):
    pytest.importorskip("trimesh", reason="GLB export needs trimesh")
    # glTF's baseColorTexture is sRGB: linear 0.5 -> 0.7354 * 255 = 187.5 -> 188; 0.2165 ->
    # 128.2 -> 128; 0 and 1 stay.
    pos = torch.tensor([[0.0, 0, 0], [1, 0, 0], [0, 1, 0]])
    faces = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    mesh = Mesh(v_pos=pos, t_pos_idx=faces, v_tex=pos[:, :2].clone(), t_tex_idx=faces.clone())
    kd = torch.tensor([0.0, 0.2165, 0.5, 1.0])[None, :, None].expand(4, 4, 3).contiguous()
    write_glb(tmp_path / "m.glb", mesh, kd)
    base = _glb_base_colour(tmp_path / "m.glb")
    assert base.shape == (4, 4, 3)
    assert base[0, :, 0].tolist() == [0, 128, 188, 255]
