"""mptex.bake: dilation against a brute-force reference, texture-space coverage, seams, UVs."""

from __future__ import annotations

import itertools

import pytest
import torch

import mptex
from mptex.bake import (
    bake_texture,
    check_bake_memory,
    dilate,
    needs_unwrap,
    texel_positions,
    unwrap_mesh,
    uv_problem,
)
from mptex.render import Mesh, texture
from mptex.scenes.builtin import torus_knot

TINY_GRID = {"otype": "HashGrid", "n_levels": 2, "log2_hashmap_size": 10, "base_resolution": 4,
             "per_level_scale": 2.0}  # fmt: skip


def tiny_texture(aabb, channels: int = 3, seed: int = 0) -> mptex.MLPTexture3D:
    torch.manual_seed(seed)
    return mptex.MLPTexture3D(aabb, channels=channels, internal_dims=8, hidden=1,
                              precision="f32", encoder=TINY_GRID)  # fmt: skip


# ----------------------------------------------------------------------------- dilation
def brute_force_dilate(image, mask, padding):
    """Per texel: the masked texel of smallest Euclidean distance within Chebyshev distance
    ``padding`` on the torus, ties by (dy, dx); the definition ``dilate`` promises."""
    height, width, _ = image.shape
    out, filled = image.clone(), mask.clone()
    sources = [(y, x) for y in range(height) for x in range(width) if mask[y, x]]
    for y, x in itertools.product(range(height), range(width)):
        if mask[y, x]:
            continue
        best = None
        for sy, sx in sources:
            # The torus offset in (-size/2, size/2]: images here are larger than the window.
            dy = (sy - y + height // 2) % height - height // 2
            dx = (sx - x + width // 2) % width - width // 2
            if max(abs(dy), abs(dx)) <= padding:
                key = (dy * dy + dx * dx, dy, dx)
                if best is None or key < best[0]:
                    best = (key, sy, sx)
        if best is not None:
            out[y, x] = image[best[1], best[2]]
            filled[y, x] = True
    return out, filled


@pytest.mark.parametrize("padding", [0, 1, 2, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_dilate_matches_brute_force(padding, seed):
    gen = torch.Generator().manual_seed(seed)
    image = torch.rand(13, 17, 2, generator=gen)
    mask = torch.rand(13, 17, generator=gen) < 0.08
    mask[0, 5] = mask[12, 16] = True  # sources on the borders: their padding wraps around
    expected, expected_filled = brute_force_dilate(image, mask, padding)
    got, filled = dilate(image, mask, padding)
    assert torch.equal(filled, expected_filled)
    assert torch.equal(got, expected)


def test_dilate_fills_exactly_the_chebyshev_band_and_keeps_masked_values():
    image = torch.zeros(20, 20, 1)
    mask = torch.zeros(20, 20, dtype=torch.bool)
    mask[10, 10] = True
    image[10, 10] = 7.0
    got, filled = dilate(image, mask, 3)
    assert filled.sum() == 49 and bool(filled[7:14, 7:14].all())
    assert float(got[7:14, 7:14].min()) == 7.0 and float(got.sum()) == 7.0 * 49


def test_dilate_rejects_bad_arguments():
    with pytest.raises(ValueError, match="^padding"):
        dilate(torch.zeros(4, 4, 3), torch.zeros(4, 4, dtype=torch.bool), -1)
    with pytest.raises(ValueError, match="^mask"):
        dilate(torch.zeros(4, 4, 3), torch.zeros(4, 5, dtype=torch.bool), 1)


# ----------------------------------------------------------------------------- coverage, seams
def islands_mesh() -> Mesh:
    """Three UV islands: a square touching the left, top and bottom borders, a square touching
    the right border, and a sliver too thin to cover any texel centre at 32^2."""
    quad_a = [[0.0, 0.0], [0.5, 0.0], [0.5, 1.0], [0.0, 1.0]]
    quad_b = [[0.75, 0.25], [1.0, 0.25], [1.0, 0.75], [0.75, 0.75]]
    # x in texel units (u * 32 - 0.5) from 18.7 to 18.9: between the centres of columns 18, 19.
    sliver = [[0.6, 0.1], [0.6 + 0.2 / 32, 0.1], [0.6 + 0.1 / 32, 0.9]]
    uv = torch.tensor(quad_a + quad_b + sliver)
    # Positions: the islands laid out on a tilted plane (a volume for the texture's AABB).
    pos = torch.cat([uv * 2 - 1, (uv[:, :1] - uv[:, 1:]) * 0.5], dim=1)
    faces = torch.tensor(
        [[0, 1, 2], [0, 2, 3], [4, 5, 6], [4, 6, 7], [8, 9, 10]], dtype=torch.int32
    )
    return Mesh(v_pos=pos, t_pos_idx=faces, v_tex=uv, t_tex_idx=faces.clone())


def surface_uvs(mesh: Mesh, n: int = 400, seed: int = 0):
    """Random points on every triangle (edges and corners included): UVs and positions."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(mesh.t_pos_idx.shape[0], n, 3, generator=gen) ** 3
    weights[:, :3] = torch.eye(3)  # the corners
    weights = weights / weights.sum(-1, keepdim=True)
    uv = torch.einsum("tnk,tkc->tnc", weights, mesh.v_tex[mesh.t_tex_idx.long()])
    pos = torch.einsum("tnk,tkc->tnc", weights, mesh.v_pos[mesh.t_pos_idx.long()])
    return uv.reshape(-1, 2), pos.reshape(-1, 3)


def test_texture_space_rows_follow_v():
    # One triangle in the v < 0.25 band: its texels are rows 0 .. N/4 (v = 0 is row 0).
    uv = torch.tensor([[0.1, 0.05], [0.9, 0.05], [0.5, 0.2]])
    mesh = Mesh(v_pos=torch.cat([uv, torch.zeros(3, 1)], 1),
                t_pos_idx=torch.tensor([[0, 1, 2]], dtype=torch.int32), v_tex=uv,
                t_tex_idx=torch.tensor([[0, 1, 2]], dtype=torch.int32))  # fmt: skip
    index, position, n_covered = texel_positions(mesh, 32, backend="torch")
    rows, cols = index[:n_covered] // 32, index[:n_covered] % 32
    assert n_covered > 0 and int(rows.max()) < 8 and int(rows.min()) >= 1
    # Interpolated positions are the texel centres' UVs here (positions = UVs).
    centres = torch.stack([(cols + 0.5) / 32, (rows + 0.5) / 32], -1)
    torch.testing.assert_close(position[:n_covered, :2], centres, rtol=0, atol=1e-5)


def test_seam_padding_never_reads_background():
    mesh = islands_mesh()
    tex = tiny_texture(mesh.aabb)
    n, padding = 32, 2
    result = bake_texture(tex, mesh, n, padding=padding, backend="torch")
    assert result.uv_source == "mesh" and result.unwrap_reason is None
    # Islands touch every atlas border: the padding wraps to the opposite side.
    assert bool(result.evaluated[:, 0].any()) and bool(result.evaluated[:, -1].any())
    assert bool(result.evaluated[0].any()) and bool(result.evaluated[-1].any())
    # Every texel within the padding (Chebyshev, on the torus) of an evaluated texel is filled.
    near = torch.zeros_like(result.evaluated)
    for dy, dx in itertools.product(range(-padding, padding + 1), repeat=2):
        near |= torch.roll(result.evaluated, shifts=(dy, dx), dims=(0, 1))
    assert torch.equal(result.filled, near)
    # A bilinear lookup anywhere on the surface (sliver included) reads only evaluated texels:
    # the lookup of the evaluated mask is exactly 1 wherever any texel weight is non-zero.
    uv, pos = surface_uvs(mesh)
    read = texture(result.evaluated.float()[None, ..., None], uv[None, None], backend="torch")
    assert float(read.min()) == pytest.approx(1.0, abs=1e-6)
    # ... and the baked values are the neural texture's, up to bilinear interpolation.
    baked = texture(result.texture[None], uv[None, None], backend="torch")[0, 0]
    assert float((baked - tex.sample(pos).detach()).abs().max()) < 0.05


def test_sliver_texels_hold_the_surface_value():
    mesh = islands_mesh()
    tex = tiny_texture(mesh.aabb)
    result = bake_texture(tex, mesh, 32, padding=0, backend="torch")
    # The sliver covers no texel centre; its texels come from the conservative ring.
    assert not bool(result.covered[:, 17:21].any())
    assert bool(result.evaluated[4:28, 18:20].all())
    assert not bool(result.evaluated[:, 21].any())  # beyond sqrt(2) texels of it


def test_chunked_evaluation_gives_the_same_bake():
    # Outputs spread over (0, 1), not all near sigmoid(0): a chunk's last elements, which
    # ATen's loops would compute with a scalar exp, then round differently (before the bake
    # padded its calls, 68 of these 73 chunk sizes changed some bits on an AVX-512 Xeon
    # under MKL_CBWR=AUTO,STRICT).
    mesh = islands_mesh()
    tex = tiny_texture(mesh.aabb)
    with torch.no_grad():
        tex.encoder.params.uniform_(-1, 1, generator=torch.Generator().manual_seed(1))
        for param in tex.net.parameters():
            param.mul_(4)
    whole = bake_texture(tex, mesh, 32, backend="torch")
    assert 0.1 < whole.texture.std() and whole.texture.unique().numel() > 1000
    for chunk_size in (*range(1, 70), 100, 127, 129, 500):
        pieces = bake_texture(tex, mesh, 32, chunk_size=chunk_size, backend="torch")
        assert torch.equal(whole.texture, pieces.texture), chunk_size


@pytest.mark.requires_cuda
def test_a_bake_on_cuda_matches_the_cpu_bake():
    # The texture and the mesh on the GPU: the conservative ring, the masks and the dilation
    # are the CPU's exactly; the values are the same texture's, evaluated there.
    mesh = islands_mesh()
    tex = tiny_texture(mesh.aabb)
    on_cpu = bake_texture(tex, mesh, 32, backend="torch")
    on_cuda = bake_texture(tex.to("cuda"), mesh, 32, backend="torch")
    for mask in ("covered", "evaluated", "filled"):
        assert torch.equal(getattr(on_cuda, mask).cpu(), getattr(on_cpu, mask)), mask
    assert torch.allclose(on_cuda.texture.cpu(), on_cpu.texture, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- UVs and checks
def test_uv_problems_are_named():
    mesh = islands_mesh()
    assert uv_problem(mesh) is None
    assert "no UVs" in uv_problem(Mesh(v_pos=mesh.v_pos, t_pos_idx=mesh.t_pos_idx))
    outside = Mesh(v_pos=mesh.v_pos, t_pos_idx=mesh.t_pos_idx, v_tex=mesh.v_tex * 1.5,
                   t_tex_idx=mesh.t_tex_idx)  # fmt: skip
    assert "leave [0, 1]" in uv_problem(outside)
    # Faces without vt (load_obj: all corners at one extra UV vertex) need new UVs.
    no_vt = mesh.t_tex_idx.clone()
    no_vt[0] = len(mesh.v_tex)
    kd_only = Mesh(v_pos=mesh.v_pos, t_pos_idx=mesh.t_pos_idx, t_tex_idx=no_vt,
                   v_tex=torch.cat([mesh.v_tex, torch.zeros(1, 2)]))  # fmt: skip
    assert "1 of the mesh's triangles have no UVs" in uv_problem(kd_only)
    # Palette-style UVs (every face in a small patch of [0, 1]^2): a few texels per triangle.
    squeezed = Mesh(v_pos=mesh.v_pos, t_pos_idx=mesh.t_pos_idx, v_tex=mesh.v_tex * 0.05,
                    t_tex_idx=mesh.t_tex_idx)  # fmt: skip
    from mptex.bake.bake import _signed_areas, _uv_triangles

    area = float(_signed_areas(_uv_triangles(squeezed)).abs().sum())
    assert area < 0.01 and uv_problem(squeezed) == (
        f"the mesh's UV triangles cover only {area:.3g} of [0, 1]^2 (below 0.01): a baked "
        "texture would give them a few texels each"
    )
    # The built-in knot's UVs wrap around the tube: the seam's triangles span the atlas.
    assert "overlap" in needs_unwrap(torus_knot(12, 6), backend="torch")
    assert needs_unwrap(mesh, backend="torch") is None
    assert "requested" in needs_unwrap(mesh, "always")


def test_mirrored_uvs_are_detected_as_overlap():
    mesh = islands_mesh()
    uv = torch.tensor([[0.0, 0.0], [1.0, 0.0], [1.0, 1.0]])
    mirrored = Mesh(v_pos=mesh.v_pos[:6], t_pos_idx=torch.tensor([[0, 1, 2], [3, 4, 5]],
                    dtype=torch.int32), v_tex=uv, t_tex_idx=torch.tensor([[0, 1, 2], [0, 2, 1]],
                    dtype=torch.int32))  # fmt: skip
    assert "overlap" in needs_unwrap(mirrored, backend="torch")


def test_memory_check_names_the_resolution(monkeypatch):
    import mptex.bake.bake as bake_module

    with pytest.raises(ValueError, match="^resolution: expected at most"):
        check_bake_memory(50000, 3)
    with pytest.raises(ValueError, match="^resolution: expected an integer"):
        check_bake_memory(1.5, 3)
    monkeypatch.setattr(bake_module, "available_bytes", lambda device: 1 << 20)
    with pytest.raises(ValueError, match=r"^resolution: a 256x256 bake .* GiB available"):
        check_bake_memory(256, 3)


@pytest.mark.requires_xatlas
def test_xatlas_atlas_fits_the_bake_resolution_with_padding():
    knot = torus_knot(24, 6)
    mesh = Mesh(v_pos=knot.v_pos, t_pos_idx=knot.t_pos_idx)
    unwrapped = unwrap_mesh(mesh, 64)
    assert unwrapped.t_tex_idx.shape == mesh.t_pos_idx.shape
    assert float(unwrapped.v_tex.min()) >= 0 and float(unwrapped.v_tex.max()) <= 1
    assert uv_problem(unwrapped) is None
    assert needs_unwrap(unwrapped, backend="torch") is None  # charts do not overlap
    tex = tiny_texture(mesh.aabb)
    result = bake_texture(tex, mesh, 64, backend="torch")
    assert result.uv_source == "xatlas" and "no UVs" in result.unwrap_reason
    assert 0.05 < result.stats["coverage"] < 1
    with pytest.raises(ValueError, match="^pack_options.resolution"):
        unwrap_mesh(mesh, 64, pack_options={"resolution": 8})
    with pytest.raises(ValueError, match="^chart_options.nonsense"):
        unwrap_mesh(mesh, 64, chart_options={"nonsense": 1})


def test_missing_xatlas_is_one_line(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "xatlas", None)
    mesh = Mesh(v_pos=islands_mesh().v_pos, t_pos_idx=islands_mesh().t_pos_idx)
    with pytest.raises(RuntimeError, match=r"^mesh: the mesh has no UVs; .*pip install xatlas"):
        bake_texture(tiny_texture(mesh.aabb), mesh, 16)


def test_every_public_name_resolves_and_import_loads_no_optional_library():
    import subprocess
    import sys

    import mptex.bake

    assert len(set(mptex.bake.__all__)) == len(mptex.bake.__all__)
    for name in mptex.bake.__all__:
        assert getattr(mptex.bake, name) is not None, name
    code = "import sys, mptex.bake; print(sorted({'xatlas', 'trimesh'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
