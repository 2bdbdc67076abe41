"""Renderer behaviour pinned down against independent references.

Cameras, sRGB curves, image I/O, materials, meshes, OBJ/MTL reading and writing, texture
sampling, rasterization and interpolation are compared with hand-computed values (the
arithmetic is in the comments), float64 evaluations of the defining formulas, brute-force
per-element loops and ``torch.autograd.gradcheck`` in float64.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from mptex.render import (
    Mesh,
    interpolate,
    load_image,
    load_obj,
    orbit_views,
    psnr,
    random_views,
    rasterize,
    rgb_to_srgb,
    save_image,
    srgb_to_rgb,
    texture,
    unit_size,
    vertex_normals,
    write_obj,
)
from mptex.render.camera import perspective, random_rotation_translation
from mptex.render.material import Material, shade_kd


# ----------------------------------------------------------------------------- cameras
def test_orbit_view_positions_follow_the_documented_product():
    # mv = translate(0, 0, -r) @ rotate_x(e) @ rotate_y(phi): the camera sits at
    # Ry(phi)^T Rx(e)^T (0, 0, r). With nvdiffrec's signs (Rx rows (1,0,0), (0,c,s), (0,-s,c);
    # Ry rows (c,0,s), (0,1,0), (-s,0,c)) that is
    #   (-sin(phi) cos(e) r, -sin(e) r, cos(phi) cos(e) r).
    # Defaults r = 3, e = -0.4: view k = 1 of 4 (phi = pi / 2) sits at (-3 cos 0.4, 3 sin 0.4, 0),
    # above the object; view 2 (phi = pi) at (0, 3 sin 0.4, -3 cos 0.4).
    cams = orbit_views(4)
    c, s = math.cos(0.4), math.sin(0.4)
    expected = torch.tensor(
        [[0.0, 3 * s, 3 * c], [-3 * c, 3 * s, 0.0], [0.0, 3 * s, -3 * c], [3 * c, 3 * s, 0.0]]
    )
    # float32 matrices with entries <= 3 and a float32 inverse: errors of a few 1e-7.
    torch.testing.assert_close(cams.campos, expected, rtol=0, atol=2e-6)
    assert len(cams) == 4


def test_orbit_views_use_the_documented_default_projection():
    # perspective(45 deg, 1, 0.1, 1000): 1 / tan(22.5 deg) = 1 + sqrt(2) = 2.41421356;
    # -(f + n) / (f - n) = -1000.1 / 999.9; -2 f n / (f - n) = -200 / 999.9.
    f = 1 + math.sqrt(2)
    proj = torch.tensor(
        [[f, 0, 0, 0], [0, -f, 0, 0], [0, 0, -1000.1 / 999.9, -200 / 999.9], [0, 0, -1, 0]],
        dtype=torch.float64,
    )
    cams = orbit_views(3)
    # float32 products of entries <= 3: a few ulps of the largest term.
    torch.testing.assert_close(cams.mvp.double(), proj @ cams.mv.double(), rtol=1e-6, atol=1e-5)


def test_random_views_put_the_object_in_front_at_the_given_radius():
    # With no jitter, mv = translate(0, 0, -r) @ [R | 0]: the object's origin lands at camera
    # (0, 0, -r), in front of the camera (which looks down -z), for every view; the default
    # radius is 3.
    cams = random_views(6, max_translation=0.0, generator=torch.Generator().manual_seed(1))
    origin = cams.mv @ torch.tensor([0.0, 0.0, 0.0, 1.0])
    expected = torch.tensor([0.0, 0.0, -3.0, 1.0]).expand(6, 4)
    torch.testing.assert_close(origin, expected, rtol=0, atol=0)
    assert len(cams) == 6


def test_random_rotations_are_proper_rotations():
    # Rows orthonormal is not enough: a reflection also has them. A rotation has det = +1
    # (float32 orthonormal rows: det within 1e-5 of +1, a reflection gives -1).
    gen = torch.Generator().manual_seed(2)
    rots = torch.stack([random_rotation_translation(0.0, gen)[:3, :3] for _ in range(20)])
    torch.testing.assert_close(
        torch.linalg.det(rots.double()), torch.ones(20, dtype=torch.float64), rtol=0, atol=1e-5
    )


# ----------------------------------------------------------------------------- sRGB
def test_srgb_curves_take_the_linear_segment_at_their_breakpoints():
    # IEC 61966-2-1 puts the breakpoints themselves on the linear segment (x <= 0.0031308,
    # c <= 0.04045). There the power segment differs by 8e-7 (relative) going forward and
    # 7e-7 going back, about 9 float32 ulps; the float32 product / quotient of the exact
    # inputs is within half an ulp (6e-8 relative) of the float64 reference: rtol 2e-7.
    x = torch.tensor(0.0031308)  # the float32 nearest the breakpoint (and below it)
    c = torch.tensor(0.04045)
    forward = rgb_to_srgb(x.expand(1, 3))[0]
    back = srgb_to_rgb(c.expand(1, 3))[0]
    torch.testing.assert_close(
        forward.double(), torch.full((3,), float(x) * 12.92, dtype=torch.float64), rtol=2e-7, atol=0
    )
    torch.testing.assert_close(
        back.double(), torch.full((3,), float(c) / 12.92, dtype=torch.float64), rtol=2e-7, atol=0
    )


@pytest.mark.parametrize("convert", [rgb_to_srgb, srgb_to_rgb])
def test_srgb_gradients_are_finite_and_match_finite_differences(convert):
    # Negative, zero and out-of-range values are what a network outputs early in training; the
    # power segment must not turn their gradient into NaN. On the linear segment the slope is
    # the defining constant (12.92 forward, 1 / 12.92 back); elsewhere gradcheck compares the
    # float64 autograd gradient with central finite differences.
    x = torch.tensor([[-0.5, -0.01, 0.0]], dtype=torch.float64, requires_grad=True)
    convert(x).sum().backward()
    slope = 12.92 if convert is rgb_to_srgb else 1 / 12.92
    torch.testing.assert_close(x.grad, torch.full((1, 3), slope, dtype=torch.float64))
    away = torch.tensor([[0.2, 0.5, 1.5]], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(convert, (away,))


def test_srgb_conversion_refuses_images_without_three_or_four_channels():
    with pytest.raises(ValueError, match="expected 3 or 4 channels"):
        rgb_to_srgb(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="expected 3 or 4 channels"):
        srgb_to_rgb(torch.zeros(2, 1))


# ----------------------------------------------------------------------------- PSNR
def test_psnr_per_image_on_hand_computed_errors():
    # Linear 0 and 1 are sRGB 0 and 1. Image 0: one of 4 pixels off by 1 in all channels ->
    # MSE = 1 / 4 -> PSNR = -10 log10(0.25) = 6.0206 dB. Image 1: every pixel off by 1 ->
    # MSE 1 -> 0 dB. A -20 log10 or a summed error would give 12.04 dB / -10.8 dB.
    ref = torch.zeros(2, 2, 2, 3)
    img = ref.clone()
    img[0, 0, 0] = 1.0
    img[1] = 1.0
    want = torch.tensor([-10 * math.log10(0.25), 0.0])
    torch.testing.assert_close(psnr(img, ref), want, rtol=1e-6, atol=1e-6)  # float32 log10


def test_psnr_compares_clamped_srgb_and_caps_a_perfect_match_at_100_db():
    # Values beyond [0, 1] in sRGB are clamped before the error: 2.0 vs 1.0 and -1.0 vs 0.0
    # are perfect matches, whose MSE is floored at 1e-10 -> exactly 100 dB.
    ones, zeros = torch.ones(1, 2, 2, 3), torch.zeros(1, 2, 2, 3)
    assert float(psnr(ones * 2, ones)) == pytest.approx(100.0, abs=1e-4)
    assert float(psnr(ones, ones * 2)) == pytest.approx(100.0, abs=1e-4)
    assert float(psnr(-ones, zeros)) == pytest.approx(100.0, abs=1e-4)
    assert float(psnr(zeros, -ones)) == pytest.approx(100.0, abs=1e-4)
    assert float(psnr(ones, ones)) == pytest.approx(100.0, abs=1e-4)


# ----------------------------------------------------------------------------- image files
def test_8bit_save_rounds_to_nearest_and_clamps(tmp_path):
    # k / 255 + 0.4 / 255 -> code k; k / 255 + 0.6 / 255 -> code k + 1; beyond [0, 1] the end
    # codes. Read back as code / 255 exactly.
    codes = torch.tensor([0.0, 10.0, 127.0, 200.0])
    img = torch.cat([(codes + 0.4) / 255, (codes + 0.6) / 255, torch.tensor([-0.5, 1.5, 2.0, 1.0])])
    save_image(tmp_path / "a.png", img.reshape(3, 4, 1).expand(3, 4, 3))
    got = load_image(tmp_path / "a.png")[..., 0].reshape(-1)
    want = torch.cat([codes, codes + 1, torch.tensor([0.0, 255.0, 255.0, 255.0])]) / 255
    assert torch.equal(got, want)


def test_single_channel_images_save_and_load_as_grey(tmp_path):
    # [H, W, 1] is written as a grey PNG and read back as [H, W, 1]; to_linear leaves grey
    # values as stored (only RGB / RGBA are converted).
    codes = torch.tensor([[0.0, 51.0, 255.0], [128.0, 7.0, 99.0]])
    save_image(tmp_path / "g.png", (codes / 255)[..., None])
    got = load_image(tmp_path / "g.png")
    assert got.shape == (2, 3, 1)
    assert torch.equal(got[..., 0], codes / 255)
    assert torch.equal(load_image(tmp_path / "g.png", to_linear=True), got)


def test_to_linear_converts_the_colour_of_rgba_images_and_keeps_alpha(tmp_path):
    # sRGB code 128 -> ((128 / 255 + 0.055) / 1.055) ** 2.4 = 0.2158605 (float64 here); alpha
    # code 51 stays 51 / 255 = 0.2. float32 pow: rtol 1e-6.
    save_image(tmp_path / "a.png", torch.tensor([128.0, 128.0, 128.0, 51.0]).expand(2, 2, 4) / 255)
    got = load_image(tmp_path / "a.png", to_linear=True)
    colour = ((128 / 255 + 0.055) / 1.055) ** 2.4
    torch.testing.assert_close(got[..., :3], torch.full((2, 2, 3), colour), rtol=1e-6, atol=0)
    assert torch.equal(got[..., 3], torch.full((2, 2), 51 / 255))


def test_ycbcr_tiff_reads_as_rgb(tmp_path):
    Image = pytest.importorskip("PIL.Image")
    Image.new("RGB", (1, 1)).convert("YCbCr").save(tmp_path / "probe.tif")
    with Image.open(tmp_path / "probe.tif") as probe:
        if probe.mode != "YCbCr":  # the refusal's test below covers this Pillow
            pytest.skip(f"Pillow {Image.__version__} opens an uncompressed YCbCr TIFF as RGB")
    # Pillow stores pure red as (Y, Cb, Cr) = (76, 84, 255); read as RGB it is red again
    # (within the 8-bit YCbCr round trip: 2 / 255), not the raw (76, 84, 255) / 255.
    Image.new("RGB", (4, 3), (255, 0, 0)).convert("YCbCr").save(tmp_path / "a.tif")
    got = load_image(tmp_path / "a.tif")
    assert got.shape == (3, 4, 3)
    torch.testing.assert_close(got, torch.tensor([1.0, 0, 0]).expand(3, 4, 3), rtol=0, atol=2 / 255)


def test_ycbcr_tiff_that_pillow_opens_as_rgb_is_refused_in_one_line(tmp_path, monkeypatch):
    Image = pytest.importorskip("PIL.Image")
    from PIL import TiffImagePlugin

    # Pillow 12.3.0 (the newest for Python 3.10) maps 8-bit YCbCr TIFFs to ("RGB", "RGBX"),
    # which decodes uncompressed Y, Cb, Cr samples as colours; imageio then read pure red as
    # (76, 84, 255) / 255. Pillow 13.0.0 maps them to YCbCr: its table patched back here.
    for order in (b"II", b"MM"):
        monkeypatch.setitem(TiffImagePlugin.OPEN_INFO, (order, 6, (1,), 1, (8, 8, 8), ()),
                            ("RGB", "RGBX"))  # fmt: skip
    Image.new("RGB", (4, 3), (255, 0, 0)).convert("YCbCr").save(tmp_path / "a.tif")
    with pytest.raises(RuntimeError) as info:
        load_image(tmp_path / "a.tif")
    assert str(info.value) == (
        f"load_image: cannot read {tmp_path / 'a.tif'} (ValueError: Pillow {Image.__version__} "
        "opens this uncompressed YCbCr TIFF as RGB, its Y, Cb, Cr samples as colours (Pillow "
        ">= 13.0 reads it))"
    )


def test_float_format_suffix_is_recognised_in_any_letter_case(tmp_path):
    img = torch.rand(3, 4, 3, generator=torch.Generator().manual_seed(1)) * 4  # above 1: HDR
    try:
        save_image(tmp_path / "a.EXR", img)
    except RuntimeError as exc:  # no EXR plugin here: the float-format message, not PNG bytes
        assert "plugin" in str(exc)
        return
    torch.testing.assert_close(load_image(tmp_path / "a.EXR")[..., :3], img)


# ----------------------------------------------------------------------------- texture
def _bilinear_reference(tex, u, v, mode):
    """One float64 bilinear lookup by the definition: texel (i, j) centred at
    ((i + 0.5) / W, (j + 0.5) / H); neighbours wrap (Python's % is non-negative) or clamp."""
    height, width = tex.shape[0], tex.shape[1]
    x, y = u * width - 0.5, v * height - 0.5
    x0, y0 = math.floor(x), math.floor(y)
    fx, fy = x - x0, y - y0
    out = [0.0] * tex.shape[2]
    for dx, dy, weight in ((0, 0, (1 - fx) * (1 - fy)), (1, 0, fx * (1 - fy)),
                           (0, 1, (1 - fx) * fy), (1, 1, fx * fy)):  # fmt: skip
        if mode == "wrap":
            i, j = (x0 + dx) % width, (y0 + dy) % height
        else:
            i, j = min(max(x0 + dx, 0), width - 1), min(max(y0 + dy, 0), height - 1)
        for ch in range(tex.shape[2]):
            out[ch] += weight * float(tex[j, i, ch])
    return out


@pytest.mark.parametrize("mode", ["wrap", "clamp"])
@pytest.mark.parametrize("height, width", [(3, 5), (5, 3)])
def test_bilinear_lookup_matches_a_per_sample_loop(mode, height, width):
    # Non-square, two textures (one per batch entry), two channels, UVs from -1.5 to 2.5 so
    # that every wrap / clamp case occurs. float64 throughout: the same sums in another
    # order, within 1e-12.
    gen = torch.Generator().manual_seed(7)
    tex = torch.rand(2, height, width, 2, generator=gen, dtype=torch.float64)
    uv = torch.rand(2, 3, 4, 2, generator=gen, dtype=torch.float64) * 4 - 1.5
    got = texture(tex, uv, boundary_mode=mode, backend="torch")
    want = torch.tensor(
        [[[_bilinear_reference(tex[b], float(uv[b, r, c, 0]), float(uv[b, r, c, 1]), mode)
           for c in range(4)] for r in range(3)] for b in range(2)],
        dtype=torch.float64,
    )  # fmt: skip
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    # One shared texture serves every batch entry alike.
    shared = texture(tex[:1], uv, boundary_mode=mode, backend="torch")
    torch.testing.assert_close(shared[1:], texture(tex[:1], uv[1:], boundary_mode=mode,
                                                   backend="torch"), rtol=0, atol=0)  # fmt: skip
    torch.testing.assert_close(shared[:1], got[:1], rtol=0, atol=0)


def test_texture_refuses_mismatched_shapes():
    tex = torch.zeros(1, 2, 2, 3)
    with pytest.raises(ValueError, match=r"uv: expected shape \[B, h, w, 2\]"):
        texture(tex, torch.zeros(1, 2, 2, 3), backend="torch")
    with pytest.raises(ValueError, match=r"tex: expected shape \[B, H, W, C\]"):
        texture(tex[0], torch.zeros(1, 2, 2, 2), backend="torch")
    with pytest.raises(ValueError, match="tex: expected batch size 1 or 2, received 3"):
        texture(torch.zeros(3, 2, 2, 3), torch.zeros(2, 2, 2, 2), backend="torch")


# ----------------------------------------------------------------------------- meshes, materials
def test_vertex_normals_weight_faces_by_area():
    # Face A (v0, v1, v2): (1,0,0) x (0,1,0) = (0, 0, 1), twice its area 1/2.
    # Face B (v0, v3, v4): (0,0,2) x (2,0,0) = (0*0 - 2*0, 2*2 - 0*0, 0*0 - 0*2) = (0, 4, 0).
    # v0 sums both: (0, 4, 1) / sqrt(17) (unweighted would be (0, 1, 1) / sqrt(2)); v1, v2 get
    # A's normal, v3, v4 B's; v5, used by no face, the documented fallback (0, 0, 1).
    v_pos = torch.tensor(
        [[0.0, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 2], [2, 0, 0], [5, 5, 5]], dtype=torch.float64
    )
    got = vertex_normals(v_pos, torch.tensor([[0, 1, 2], [0, 3, 4]], dtype=torch.int32))
    r = 1 / math.sqrt(17)
    want = torch.tensor(
        [[0, 4 * r, r], [0, 0, 1], [0, 0, 1], [0, 1, 0], [0, 1, 0], [0, 0, 1]], dtype=torch.float64
    )
    torch.testing.assert_close(got, want, rtol=0, atol=1e-15)  # float64 sums of small integers


def test_map_kd_offset_alone_moves_the_lookup():
    # -o 0.25 0.1 with the default scale: u -> u + 0.25, v_obj = 1 - v -> v_obj + 0.1, so
    # (0.1, 0.3) -> (0.35, 1 - (0.7 + 0.1)) = (0.35, 0.2). A scale alone: -s 2 1 -> (0.2, 0.3).
    uv = torch.tensor([[0.1, 0.3]], dtype=torch.float64)
    offset = Material("m", torch.ones(3), torch.zeros(2, 2, 3), uv_offset=(0.25, 0.1))
    scale = Material("m", torch.ones(3), torch.zeros(2, 2, 3), uv_scale=(2.0, 1.0))
    torch.testing.assert_close(
        offset.texture_uv(uv), torch.tensor([[0.35, 0.2]], dtype=torch.float64)
    )
    torch.testing.assert_close(
        scale.texture_uv(uv), torch.tensor([[0.2, 0.3]], dtype=torch.float64)
    )


def test_mesh_to_moves_its_materials_too():
    mat = Material("m", torch.tensor([0.1, 0.2, 0.3]), torch.rand(2, 2, 3))
    mesh = Mesh(
        v_pos=torch.zeros(3, 3), t_pos_idx=torch.tensor([[0, 1, 2]], dtype=torch.int32),
        materials=[mat], t_mat_idx=torch.zeros(1, dtype=torch.int32),
    )  # fmt: skip
    moved = mesh.to("cpu")
    assert isinstance(moved.materials[0], Material)
    assert torch.equal(moved.materials[0].kd_texture, mat.kd_texture)
    assert moved.kd is None and moved.v_tex is None


def test_a_textured_mesh_without_uv_indices_is_refused_by_name():
    mesh = Mesh(
        v_pos=torch.zeros(3, 3), t_pos_idx=torch.tensor([[0, 1, 2]], dtype=torch.int32),
        v_tex=torch.zeros(3, 2), kd_texture=torch.ones(2, 2, 3),
    )  # fmt: skip
    rast = torch.tensor([[[[0.5, 0.25, 0.0, 1.0]]]])
    with pytest.raises(ValueError, match="has a texture but no UVs"):
        shade_kd(mesh, rast, backend="torch")


def test_a_mesh_with_only_a_texture_is_shaded_from_it():
    # kd_texture without kd: one material, the texture; a constant texture gives its colour.
    colour = torch.tensor([0.25, 0.5, 0.75])
    idx = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    mesh = Mesh(
        v_pos=torch.zeros(3, 3), t_pos_idx=idx, v_tex=torch.rand(3, 2), t_tex_idx=idx,
        kd_texture=colour.expand(2, 2, 3).contiguous(),
    )  # fmt: skip
    rast = torch.tensor([[[[0.5, 0.25, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]]]])
    rgb = shade_kd(mesh, rast, backend="torch")
    # a bilinear blend of equal texels: float32 weights summing to 1 within an ulp.
    torch.testing.assert_close(rgb[0, 0, 0], colour, rtol=1e-6, atol=0)
    assert torch.equal(rgb[0, 0, 1], torch.zeros(3))


# ----------------------------------------------------------------------------- rasterizer
# One affine triangle (w = 1) covering the lower-left half of NDC: vertex 0 at (-1, -1),
# 1 at (1, -1), 2 at (-1, 1). Solving p = b0 V0 + b1 V1 + (1 - b0 - b1) V2 by hand:
#   x = 2 b1 - 1 -> b1 = (x + 1) / 2;  y = 1 - 2 b0 - 2 b1 -> b0 = -(x + y) / 2.
HALF = [[-1.0, -1.0, 0.1, 1.0], [1.0, -1.0, 0.3, 1.0], [-1.0, 1.0, -0.2, 1.0]]
TRI1 = torch.tensor([[0, 1, 2]], dtype=torch.int32)


def _solve_barycentrics(verts, px, py):
    """Perspective-correct barycentrics by their definition, in float64: the weights b with
    sum b = 1 whose clip-space point sum b_k V_k projects to (px, py)."""
    rows = [[v[0] - px * v[3] for v in verts], [v[1] - py * v[3] for v in verts], [1.0] * 3]
    return torch.linalg.solve(torch.tensor(rows, dtype=torch.float64),
                              torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64))  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "verts",
    [HALF, [[-0.9, -0.8, 0.5, 1.0], [1.6, -0.6, 0.2, 2.0], [-0.3, 2.1, 0.9, 3.0]]],
    ids=["affine", "perspective"],
)
def test_rasterized_barycentrics_and_depth_match_the_definition(dtype, verts):
    # Every covered pixel (i, j) is sampled at NDC ((2i + 1) / W - 1, (2j + 1) / H - 1); there
    # (u, v) = (b0, b1) and z/w = sum b_k z_k / sum b_k w_k. float64 outputs agree with the
    # float64 solve to 1e-12; float32 ones are float32 arithmetic on O(1) values: 2e-6.
    height, width = 6, 10
    rast, _ = rasterize(torch.tensor(verts, dtype=dtype), TRI1, (height, width), backend="torch")
    assert rast.dtype == dtype
    covered = 0
    for j in range(height):
        for i in range(width):
            if rast[0, j, i, 3] == 0:
                continue
            covered += 1
            px, py = (2 * i + 1) / width - 1, (2 * j + 1) / height - 1
            b = _solve_barycentrics(verts, px, py)
            zw = sum(b[k] * verts[k][2] for k in range(3)) / sum(
                b[k] * verts[k][3] for k in range(3)
            )
            want = torch.tensor([b[0], b[1], zw, 1.0], dtype=torch.float64)
            tol = 1e-12 if dtype == torch.float64 else 2e-6
            torch.testing.assert_close(rast[0, j, i].double(), want, rtol=0, atol=tol)
    assert covered > 10


def test_rast_db_holds_barycentric_derivatives_per_pixel():
    # On the affine triangle b0 = -(x + y) / 2 and b1 = (x + 1) / 2 in NDC; one pixel is 2 / W
    # in x and 2 / H in y, so per pixel du/dX = -1/2 * 2/W = -1/W, du/dY = -1/H, dv/dX = 1/W,
    # dv/dY = 0. H = 4, W = 8: (du/dX, du/dY, dv/dX, dv/dY) = (-1/8, -1/4, 1/8, 0).
    rast, rast_db = rasterize(torch.tensor(HALF), TRI1, (4, 8), backend="torch")
    covered = rast[..., 3] > 0
    assert int(covered.sum()) > 5
    want = torch.tensor([-1 / 8, -1 / 4, 1 / 8, 0.0]).expand(int(covered.sum()), 4)
    # float32 quotients of O(1) edge products: a few ulps.
    torch.testing.assert_close(rast_db[covered], want, rtol=0, atol=1e-6)
    assert torch.equal(rast_db[~covered], torch.zeros(int((~covered).sum()), 4))


def test_interpolate_matches_a_per_pixel_loop_with_shared_and_batched_attributes():
    # out = u A0 + v A1 + (1 - u - v) A2 of the pixel's triangle; 0 on background. A [1, V, C]
    # attribute table serves every batch entry, as a [V, C] one does.
    pos = torch.tensor([HALF, [[1.0, 1.0, 0.0, 1.0], [-1.0, 1.0, 0.0, 1.0], [1.0, -1.0, 0.0, 1.0]]])
    rast, _ = rasterize(pos, TRI1, (4, 6), backend="torch")
    attr = torch.tensor([[1.0, 10.0], [2.0, 20.0], [4.0, 40.0]], dtype=torch.float64)
    for table in (attr, attr[None]):
        out, _ = interpolate(table, rast, TRI1, backend="torch")
        assert out.shape == (2, 4, 6, 2)
        for b in range(2):
            for j in range(4):
                for i in range(6):
                    u, v, _, tid = rast[b, j, i].tolist()
                    want = [0.0, 0.0] if tid == 0 else [
                        u * attr[0, c] + v * attr[1, c] + (1 - u - v) * attr[2, c] for c in range(2)
                    ]  # fmt: skip
                    # float64 attributes, float32 weights promoted: the same products, 1e-12.
                    want = torch.tensor(want, dtype=torch.float64)
                    torch.testing.assert_close(out[b, j, i], want, rtol=0, atol=1e-12)


def test_interpolate_refuses_triangle_ids_beyond_tri():
    rast = torch.zeros(1, 1, 2, 4)
    rast[0, 0, 0, 3] = 2.0  # triangle id 1, but tri holds one triangle (id 0)
    with pytest.raises(ValueError, match="rast: triangle ids exceed the 1 triangles of tri"):
        interpolate(torch.zeros(3, 1), rast, TRI1, backend="torch")
    with pytest.raises(ValueError, match=r"rast: expected shape \[B, H, W, 4\]"):
        interpolate(torch.zeros(3, 1), torch.zeros(1, 1, 2, 3), TRI1, backend="torch")
    with pytest.raises(ValueError, match="attr: expected batch size 1 or 1"):
        interpolate(torch.zeros(2, 3, 1), rast, TRI1, backend="torch")


def _covered_by_definition(verts, height, width):
    """Pixel coverage of one triangle by the documented rule, in exact rational arithmetic:
    a sample (pixel centre) is covered when every edge function of the counter-clockwise
    triangle is positive, or zero on an edge walked downwards (-y) or, if horizontal, towards
    +x. ``verts``: three (x, y) NDC points on the 1/16-pixel grid (so snapping is exact)."""
    from fractions import Fraction

    p = [(Fraction(x), Fraction(y)) for x, y in verts]
    area = (p[1][0] - p[0][0]) * (p[2][1] - p[0][1]) - (p[1][1] - p[0][1]) * (p[2][0] - p[0][0])
    if area < 0:
        p = [p[0], p[2], p[1]]
    out = torch.zeros(height, width, dtype=torch.bool)
    for j in range(height):
        for i in range(width):
            sx, sy = Fraction(2 * i + 1, width) - 1, Fraction(2 * j + 1, height) - 1
            inside = True
            for k in range(3):
                (x0, y0), (x1, y1) = p[k], p[(k + 1) % 3]
                dx, dy = x1 - x0, y1 - y0
                e = dx * (sy - y0) - dy * (sx - x0)
                inclusive = dy < 0 or (dy == 0 and dx > 0)
                inside &= e > 0 or (e == 0 and inclusive)
            out[j, i] = inside
    return out


@pytest.mark.parametrize(
    "verts",
    [
        # edges through whole columns / rows of pixel centres (NDC (2i + 1) / 8 - 1): a left
        # edge on column 3 (x = -0.125) and a bottom edge on row 3, then top / right edges
        [(-0.125, -0.125), (0.875, -0.125), (-0.125, 0.875)],
        [(0.625, 0.625), (-0.375, 0.625), (0.625, -0.375)],
        [(-0.625, -0.875), (0.875, 0.125), (-0.625, 0.625)],
        # corners on pixel centres, a diagonal edge through them, and the clockwise copy
        [(-0.875, -0.875), (0.875, 0.875), (-0.875, 0.875)],
        [(-0.875, -0.875), (-0.875, 0.875), (0.875, 0.875)],
        # a vertex on the bottom-left pixel centre and edges along the viewport's sample edges
        [(-0.875, -0.875), (0.875, -0.875), (0.875, 0.875)],
    ],
)
def test_coverage_of_edges_through_pixel_centres_follows_the_tie_rule(verts):
    height = width = 8
    pos = torch.tensor([[x, y, 0.0, 1.0] for x, y in verts])
    rast, _ = rasterize(pos, TRI1, (height, width), backend="torch")
    want = _covered_by_definition(verts, height, width)
    assert int(want.sum()) > 0
    assert torch.equal(rast[0, ..., 3] > 0, want)


def test_barycentrics_stay_in_the_triangle_where_snapping_moves_its_edge():
    # 4x4 pixels (a sub-pixel is 1/32 in NDC). The edge from vertex 0 to vertex 1 lies at
    # x = -0.249 and snaps to -0.25, onto the centres of column 1, which lie 0.001 outside the
    # exact triangle: there the third weight is -0.001 / 1.149, so u + v = 1.00087 before the
    # documented clamp u + v <= 1. float32 rescaling: u + v within 2 ulps of 1.
    pos = torch.tensor([[-0.249, -0.9, 0.0, 1.0], [-0.249, 0.9, 0.0, 1.0], [0.9, -0.9, 0.0, 1.0]])
    rast = rasterize(pos, TRI1, (4, 4), backend="torch")[0][0]
    assert torch.all(rast[:, 1, 3] == 1)  # the snapped edge keeps its samples
    total = rast[..., 0] + rast[..., 1]
    assert float(total.max()) <= 1 + 2.4e-7
    torch.testing.assert_close(total[:, 1], torch.ones(4), rtol=0, atol=2.4e-7)
    assert float(rast[..., :2].min()) >= 0.0


def test_a_flat_triangle_that_snapping_opens_gives_finite_outputs():
    # 8x8 pixels (a sub-pixel is 1/64 in NDC). In sub-pixels A = (-20, 7.5), B = (40, 9) and
    # C = (10, 8.25) lie on one line (slope 1.5 / 60 = 0.75 / 30): the exact triangle is flat.
    # Snapped (round half to even) they are (-20, 8), (40, 9), (10, 8): a thin triangle whose
    # edge A -> C is horizontal, walked towards +x, through the centre (8, 8) of pixel (4, 4),
    # so that pixel is drawn. Its barycentric derivatives must still be finite numbers.
    sub = [(-20.0, 7.5), (40.0, 9.0), (10.0, 8.25)]
    pos = torch.tensor([[x / 64, y / 64, 0.0, 1.0] for x, y in sub])
    rast, rast_db = rasterize(pos, TRI1, (8, 8), backend="torch")
    assert float(rast[0, 4, 4, 3]) == 1.0
    assert bool(torch.isfinite(rast_db).all())
    assert bool(torch.isfinite(rast[..., :2]).all())


def test_rasterize_refuses_integer_positions():
    with pytest.raises(ValueError, match="pos: expected a floating-point tensor"):
        rasterize(torch.zeros(3, 4, dtype=torch.int64), TRI1, (4, 4), backend="torch")


# ----------------------------------------------------------------------------- OBJ / MTL
TRIANGLE = "v 0 0 0\nv 1 0 0\nv 0 1 0\n"


@pytest.mark.parametrize(
    "text, match",
    [
        ("v 0 nan 0\n", r"t\.obj:1: 'v' has a non-finite value"),
        ("v 0 0 0\nvt 0 inf\n", r"t\.obj:2: 'vt' has a non-finite value"),
        ("v 0 0 0\nvn 0 0 -inf\n", r"t\.obj:2: 'vn' has a non-finite value"),
        ("v 0 0 0\0\n", r"t\.obj: not a text file"),
    ],
)
def test_unreadable_obj_content_is_one_line_naming_the_file(tmp_path, text, match):
    (tmp_path / "t.obj").write_bytes(text.encode())
    with pytest.raises(ValueError, match=match) as info:
        load_obj(tmp_path / "t.obj")
    assert "\n" not in str(info.value)


def test_latin1_material_names_are_read_as_written(tmp_path):
    # An MTL and OBJ from an older exporter: "café" in Latin-1 (0xE9), not valid UTF-8.
    (tmp_path / "m.mtl").write_bytes("newmtl café\nKd 1 0 0\n".encode("latin-1"))
    obj = "mtllib m.mtl\nusemtl café\n" + TRIANGLE + "f 1 2 3\n"
    (tmp_path / "t.obj").write_bytes(obj.encode("latin-1"))
    mesh = load_obj(tmp_path / "t.obj")
    assert [m.name for m in mesh.materials] == ["café"]
    torch.testing.assert_close(mesh.kd, torch.tensor([1.0, 0.0, 0.0]))


@pytest.mark.parametrize(
    "text, match",
    [
        (
            TRIANGLE + "vt 0 0\nvn 0 0 1\nf 1/1/1/1 2/1/1 3/1/1\n",
            r"t\.obj:6: malformed face vertex",
        ),
        (TRIANGLE + "vn 0 0 1\nf 1//1 2//1 3\n", r"t\.obj:5: a face mixes corners"),
    ],
)
def test_malformed_face_corners_are_refused_with_the_line(tmp_path, text, match):
    (tmp_path / "t.obj").write_text(text)
    with pytest.raises(ValueError, match=match):
        load_obj(tmp_path / "t.obj")


def test_vt_without_v_and_vp_lines_follow_the_spec(tmp_path):
    # "vt u" has v = 0 (the OBJ default), stored flipped: 1 - 0 = 1. "vp" (free-form
    # parameter vertices) does not change a triangle mesh and is skipped.
    (tmp_path / "t.obj").write_text(TRIANGLE + "vt 0.25\nvp 0.5 0.5\nf 1/1 2/1 3/1\n")
    mesh = load_obj(tmp_path / "t.obj")
    assert mesh.v_tex.tolist() == [[0.25, 1.0]]


def test_kd_with_one_value_is_grey(tmp_path):
    # "Kd 0.5": g and b equal r. sRGB 0.5 -> linear ((0.5 + 0.055) / 1.055) ** 2.4 = 0.2140411.
    (tmp_path / "m.mtl").write_text("newmtl g\nKd 0.5\n")
    (tmp_path / "t.obj").write_text("mtllib m.mtl\nusemtl g\n" + TRIANGLE + "f 1 2 3\n")
    want = ((0.5 + 0.055) / 1.055) ** 2.4
    # float32 pow: a few ulps.
    torch.testing.assert_close(
        load_obj(tmp_path / "t.obj").kd, torch.full((3,), want), rtol=1e-6, atol=0
    )


def test_a_broken_material_is_reported_at_its_first_use(tmp_path):
    (tmp_path / "m.mtl").write_text("newmtl a\nmap_Kd nowhere.png\n")
    (tmp_path / "t.obj").write_text(
        "mtllib m.mtl\n" + TRIANGLE + "vt 0 0\nusemtl a\nf 1/1 2/1 3/1\nf 3/1 2/1 1/1\n"
    )
    with pytest.raises(ValueError, match=r"\(material 'a', used at line 7\)$"):
        load_obj(tmp_path / "t.obj")


def test_a_flat_polygon_keeps_its_fan(tmp_path):
    # All four corners on one line: no area, no normal to clip ears in; the fan is kept.
    (tmp_path / "t.obj").write_text("v 0 0 0\nv 1 0 0\nv 2 0 0\nv 3 0 0\nf 1 2 3 4\n")
    assert load_obj(tmp_path / "t.obj").t_pos_idx.tolist() == [[0, 1, 2], [0, 2, 3]]


def test_a_corner_on_a_straight_edge_keeps_the_fan_despite_rounding(tmp_path):
    # Corners 0, 1, 2 lie on one line through the origin (1 and 2 are 0.5305680820582117 /
    # 0.11369316044104537 = 4.6667 times their x); in floating point the fan triangle
    # (0, 1, 2) comes out a hair clockwise, but a triangle that flat counts as flat: the
    # polygon is convex and keeps the fan around corner 0.
    (tmp_path / "t.obj").write_text(
        "v 0 0 0\nv 0.11369316044104537 0.5305680820582117 0\n"
        "v 0.21308573712462675 0.9944001065815914 0\nv -0.3 1.7 0\nf 1 2 3 4\n"
    )
    assert load_obj(tmp_path / "t.obj").t_pos_idx.tolist() == [[0, 1, 2], [0, 2, 3]]


def _inside(polygon, x, y):
    """Even-odd point-in-polygon test (a ray towards +x)."""
    inside = False
    for (x0, y0), (x1, y1) in zip(polygon, polygon[1:] + polygon[:1]):
        if (y0 > y) != (y1 > y) and x < x0 + (y - y0) * (x1 - x0) / (y1 - y0):
            inside = not inside
    return inside


def test_ear_clipping_skips_a_corner_whose_triangle_holds_another_corner(tmp_path):
    # (0,0) (4,0) (4,4) (2,1) (0,4): a notch down to (2, 1). The fan from corner 0 turns back
    # at (0, 2, 3); the ear at corner 0, (0,4)-(0,0)-(4,0), holds (2, 1) (2 + 1 <= 4) and would
    # cover the notch. Shoelace area: (0 + 16 - 4 + 8 + 0) / 2 = 10.
    polygon = [(0, 0), (4, 0), (4, 4), (2, 1), (0, 4)]
    (tmp_path / "t.obj").write_text("".join(f"v {x} {y} 0\n" for x, y in polygon) + "f 1 2 3 4 5\n")
    mesh = load_obj(tmp_path / "t.obj")
    p = mesh.v_pos[mesh.t_pos_idx.long()].double()
    e1, e2 = p[:, 1] - p[:, 0], p[:, 2] - p[:, 0]
    area = (e1[:, 0] * e2[:, 1] - e1[:, 1] * e2[:, 0]) / 2
    assert bool((area > 0).all()) and float(area.sum()) == 10.0
    for centre in p.mean(dim=1).tolist():
        assert _inside(polygon, centre[0], centre[1]), centre


def _textured(tmp_path, mtl_lines):
    """An OBJ with one triangle using material 'a' of an MTL holding ``mtl_lines``."""
    save_image(tmp_path / "t.png", torch.ones(2, 2, 3))
    (tmp_path / "m.mtl").write_text(mtl_lines)
    (tmp_path / "t.obj").write_text(
        "mtllib m.mtl\nusemtl a\n" + TRIANGLE + "vt 0 0\nf 1/1 2/1 3/1\n"
    )
    return tmp_path / "t.obj"


@pytest.mark.parametrize(
    "line, scale, offset, clamp",
    [
        ("map_Kd -s 2 t.png", (2.0, 1.0), (0.0, 0.0), False),  # v and w default to 1
        ("map_Kd -o 0.5 t.png", (1.0, 1.0), (0.5, 0.0), False),  # v and w default to 0
        ("map_Kd -clamp ON t.png", (1.0, 1.0), (0.0, 0.0), True),  # on / off in any case
        ("map_Kd -s 3 4 1 -o 0.25 0.5 0 -clamp off t.png", (3.0, 4.0), (0.25, 0.5), False),
    ],
)
def test_map_kd_options_are_read_with_their_defaults(tmp_path, line, scale, offset, clamp):
    material = load_obj(_textured(tmp_path, f"newmtl a\n{line}\n")).materials[0]
    assert (material.uv_scale, material.uv_offset, material.clamp) == (scale, offset, clamp)


def test_map_kd_colour_gain_is_refused(tmp_path):
    # -mm base gain: only the no-op 0 1 is accepted; a gain of 2 would change the colours.
    with pytest.raises(ValueError, match=r"m\.mtl:2: map_Kd option -mm"):
        load_obj(_textured(tmp_path, "newmtl a\nmap_Kd -mm 0 2 t.png\n"))


def test_mtl_comments_names_with_spaces_and_the_first_error(tmp_path):
    # A comment after a statement is not part of it; "newmtl" takes the whole rest of the line
    # as the name; of two problems with one material the first (line 3) is reported.
    (tmp_path / "m.mtl").write_text(
        "newmtl red paint # the body\nKd 1 0 0 # pure red\n"
        "newmtl broken\nmap_Kd first.png\nmap_Kd second.png\n"
    )
    (tmp_path / "t.obj").write_text("mtllib m.mtl\nusemtl red paint\n" + TRIANGLE + "f 1 2 3\n")
    mesh = load_obj(tmp_path / "t.obj")
    assert mesh.materials[0].name == "red paint"
    torch.testing.assert_close(mesh.kd, torch.tensor([1.0, 0.0, 0.0]))
    (tmp_path / "t.obj").write_text(
        "mtllib m.mtl\nusemtl broken\n" + TRIANGLE + "vt 0 0\nf 1/1 2/1 3/1\n"
    )
    with pytest.raises(ValueError, match=r"m\.mtl:4: map_Kd texture .*first\.png does not exist"):
        load_obj(tmp_path / "t.obj")


def test_write_obj_round_trips_several_textured_materials_and_normals_without_uvs(tmp_path):
    # Two textured materials (red and blue, each its own file), one with -s, -o and -clamp, and a
    # Kd-only one; faces carry normals but no UVs in the second file. Read back: Kd to float32
    # pow rounding (rtol 1e-6), 8-bit textures of 0 and 1 exactly, options as written.
    idx = torch.tensor([[0, 1, 2], [2, 1, 0], [0, 2, 1]], dtype=torch.int32)
    red, blue = torch.tensor([1.0, 0, 0]), torch.tensor([0.0, 0, 1])
    materials = [
        Material("red", torch.tensor([0.2, 0.5, 0.8]), red.expand(2, 2, 3).contiguous()),
        Material("blue", torch.ones(3), blue.expand(2, 3, 3).contiguous(), uv_scale=(2.0, 3.0),
                 uv_offset=(0.25, 0.5), clamp=True),
        Material("plain", torch.tensor([0.05, 0.3, 0.9])),
    ]  # fmt: skip
    mesh = Mesh(
        v_pos=torch.tensor([[0.0, 0, 0], [1, 0, 0], [0, 1, 0]]), t_pos_idx=idx,
        v_tex=torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]]), t_tex_idx=idx,
        v_nrm=torch.tensor([[0.0, 0, 1], [0, 1, 0]]),
        t_nrm_idx=torch.tensor([[0, 0, 1]] * 3, dtype=torch.int32),
        materials=materials, t_mat_idx=torch.tensor([0, 1, 2], dtype=torch.int32),
    )  # fmt: skip
    write_obj(tmp_path / "a.obj", mesh)
    back = load_obj(tmp_path / "a.obj")
    assert [m.name for m in back.materials] == ["red", "blue", "plain"]
    assert torch.equal(back.materials[0].kd_texture, red.expand(2, 2, 3))
    assert torch.equal(back.materials[1].kd_texture, blue.expand(2, 3, 3))
    got = back.materials[1]
    assert (got.uv_scale, got.uv_offset, got.clamp) == ((2.0, 3.0), (0.25, 0.5), True)
    for got, want in zip(back.materials, materials):
        torch.testing.assert_close(got.kd, want.kd, rtol=1e-6, atol=1e-7)

    no_uv = Mesh(v_pos=mesh.v_pos, t_pos_idx=idx, v_nrm=mesh.v_nrm, t_nrm_idx=mesh.t_nrm_idx)
    write_obj(tmp_path / "b.obj", no_uv)
    back = load_obj(tmp_path / "b.obj")
    assert back.v_tex is None
    assert torch.equal(back.t_nrm_idx, no_uv.t_nrm_idx)
    assert torch.equal(back.v_nrm, no_uv.v_nrm)


def test_a_non_finite_map_kd_scale_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"m\.mtl:2: map_Kd option -s has a non-finite value"):
        load_obj(_textured(tmp_path, "newmtl a\nmap_Kd -s inf 1 t.png\n"))


@pytest.mark.parametrize("resolution", [(2.5, 4), (4, 3.5), ("4", "4")])
def test_a_resolution_that_is_not_whole_pixels_is_refused(resolution):
    # 2.5 rows cannot be drawn; truncating them to 2 would hide the caller's mistake.
    with pytest.raises(ValueError, match="resolution: expected"):
        rasterize(torch.tensor(HALF), TRI1, resolution, backend="torch")


def test_a_whole_float_or_numpy_resolution_is_accepted():
    import numpy as np

    want, _ = rasterize(torch.tensor(HALF), TRI1, (4, 6), backend="torch")
    for resolution in [(4.0, 6.0), (np.int64(4), np.int32(6)), torch.Size([4, 6])]:
        got, _ = rasterize(torch.tensor(HALF), TRI1, resolution, backend="torch")
        assert torch.equal(got, want)


@pytest.mark.parametrize("points", [[[1.0, 2.0, 3.0]] * 3, []], ids=["one point", "no vertex"])
def test_unit_size_of_a_mesh_without_extent_is_one_clear_error(points):
    # No side to scale to 2: a ValueError naming the mesh, not a ZeroDivisionError.
    mesh = Mesh(
        v_pos=torch.tensor(points).reshape(-1, 3), t_pos_idx=torch.zeros(0, 3, dtype=torch.int32)
    )
    with pytest.raises(ValueError, match="mesh: expected vertices spanning"):
        unit_size(mesh)


def test_depth_of_a_flat_triangle_that_snapping_opens_is_clamped_like_nvdiffrast():
    # The triangle of the test above has all three edge functions' sum 0 at pixel (4, 4)
    # (it is exactly flat), so z/w = 0 / 0. nvdiffrast's output kernel clamps with
    # fmaxf(fminf(z/w, 1), -1), and fminf(NaN, 1) = 1: the pixel's depth is 1.0, not NaN.
    sub = [(-20.0, 7.5), (40.0, 9.0), (10.0, 8.25)]
    for dtype in (torch.float32, torch.float64):
        pos = torch.tensor([[x / 64, y / 64, 0.0, 1.0] for x, y in sub], dtype=dtype)
        rast, _ = rasterize(pos, TRI1, (8, 8), backend="torch")
        assert float(rast[0, 4, 4, 2]) == 1.0
        assert bool(torch.isfinite(rast).all())


# ----------------------------------------------------------------------------- argument checks
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"fovy": 0.0}, "fovy: expected radians in (0, pi), got 0.0"),
        ({"fovy": math.pi}, f"fovy: expected radians in (0, pi), got {math.pi!r}"),
        ({"fovy": float("nan")}, "fovy: expected radians in (0, pi), got nan"),
        ({"aspect": 0.0}, "aspect: expected width / height > 0, got 0.0"),
        ({"near": 0.0}, "near: expected a clip distance > 0, got 0.0"),
        ({"near": -0.1}, "near: expected a clip distance > 0, got -0.1"),
        ({"near": 2.0, "far": 2.0}, "far: expected a clip distance beyond near (2.0), got 2.0"),
    ],
)
def test_a_projection_outside_its_ranges_is_one_line_naming_the_argument(kwargs, message):
    # Each of these divided by zero (near == far, aspect 0, tan(0)) or flipped the clip volume.
    with pytest.raises(ValueError) as info:
        perspective(**kwargs)
    assert str(info.value) == message


@pytest.mark.parametrize("views", [orbit_views, random_views])
@pytest.mark.parametrize("n_views", [0, -1, 2.0, True])
def test_a_view_count_that_is_not_a_positive_integer_is_named(views, n_views):
    with pytest.raises(ValueError) as info:
        views(n_views)
    assert str(info.value) == f"n_views: expected an integer >= 1, got {n_views!r}"


def test_a_numpy_view_count_is_a_count():
    assert orbit_views(np.int64(2)).mv.shape == (2, 4, 4)


@pytest.mark.parametrize("shape", [(1, 0, 4, 3), (1, 4, 0, 3)])
def test_a_texture_without_texels_is_one_line_naming_tex(shape):
    with pytest.raises(ValueError) as info:
        texture(torch.zeros(shape), torch.zeros(1, 2, 2, 2), backend="torch")
    assert str(info.value) == (
        f"tex: expected at least one texel (H, W >= 1), received {list(shape)}"
    )


def test_texture_samples_come_in_the_dtype_tex_and_uv_promote_to():
    tex = torch.rand(1, 4, 4, 3)
    uv = torch.rand(1, 2, 2, 2)
    assert texture(tex, uv.double(), backend="torch").dtype == torch.float64
    assert texture(tex.half(), uv, backend="torch").dtype == torch.float32
    assert texture(tex, uv, backend="torch").dtype == torch.float32


def test_a_textured_material_without_uvs_is_refused_even_where_no_pixel_shows_it():
    # Two triangles, the second textured; the view sees only the first. The mesh cannot be
    # shaded from another view either, so it is refused whatever this one covers.
    red = Material("red", kd=torch.tensor([1.0, 0.0, 0.0]))
    textured = Material("wood", kd=torch.tensor([0.5, 0.5, 0.5]), kd_texture=torch.ones(2, 2, 3))
    mesh = Mesh(
        v_pos=torch.zeros(4, 3), t_pos_idx=torch.tensor([[0, 1, 2], [1, 3, 2]], dtype=torch.int32),
        materials=[red, textured], t_mat_idx=torch.tensor([0, 1], dtype=torch.int32),
    )  # fmt: skip
    rast = torch.tensor([[[[0.5, 0.25, 0.0, 1.0]]]])  # triangle 0 only
    with pytest.raises(ValueError) as info:
        shade_kd(mesh, rast, backend="torch")
    assert str(info.value) == "mesh: material 'wood' has a texture but no UVs"
    # a textured material no face uses is no reason to refuse
    mesh.t_mat_idx = torch.tensor([0, 0], dtype=torch.int32)
    assert shade_kd(mesh, rast, backend="torch")[0, 0, 0].tolist() == [1.0, 0.0, 0.0]


def test_a_usemtl_before_the_mtllib_that_defines_it_does_not_warn(tmp_path):
    # The material is read from the later library: the file is complete, nothing to warn of.
    (tmp_path / "m.mtl").write_text("newmtl red\nKd 1 0 0\n")
    (tmp_path / "m.obj").write_text(
        "v 0 0 0\nv 1 0 0\nv 0 1 0\nusemtl red\nf 1 2 3\nmtllib m.mtl\n"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mesh = load_obj(tmp_path / "m.obj")
    assert [m.name for m in mesh.materials] == ["red"]
    assert mesh.materials[0].kd.tolist() == [1.0, 0.0, 0.0]
