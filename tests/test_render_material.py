"""Per-triangle materials: shade_kd picks each pixel's material, wraps or clamps its UVs and
applies map_Kd -s / -o."""

import torch

from mptex.render import Mesh, texture
from mptex.render.material import Material, mesh_materials, shade_kd

# Row 0 = [0, 1], row 1 = [2, 3] in every channel (v = 0 is row 0).
TEX = torch.tensor([[0.0, 1.0], [2.0, 3.0]])[..., None].expand(2, 2, 3).contiguous()


def _pixels(tri_ids, bary):
    """[1, 1, P, 4] rast: barycentrics (u, v) and triangle id + 1 per pixel."""
    rast = torch.zeros(1, 1, len(tri_ids), 4)
    rast[0, 0, :, :2] = torch.tensor(bary, dtype=torch.float32)
    rast[0, 0, :, 3] = torch.tensor(tri_ids, dtype=torch.float32) + 1
    return rast


def _mesh(materials, t_mat_idx, uv):
    """Triangles whose three corners share one UV each: every pixel of triangle t sees uv[t]."""
    t = len(uv)
    idx = torch.arange(t, dtype=torch.int32)[:, None].expand(t, 3).contiguous()
    return Mesh(
        v_pos=torch.zeros(t, 3), t_pos_idx=idx, v_tex=torch.tensor(uv), t_tex_idx=idx,
        materials=materials, t_mat_idx=torch.tensor(t_mat_idx, dtype=torch.int32),
    )  # fmt: skip


def _sample(uv, mode="wrap"):
    at = torch.tensor(uv, dtype=torch.float32).reshape(1, 1, 1, 2)
    return texture(TEX[None], at, boundary_mode=mode, backend="torch").reshape(3)


def test_each_pixel_takes_its_triangles_material():
    kd = torch.tensor([0.1, 0.2, 0.3])
    mats = [Material("tex", torch.ones(3), TEX), Material("kd", kd)]
    uv = [[0.3, 0.6], [0.0, 0.0], [0.3, 0.6]]
    mesh = _mesh(mats, [0, 1, 0], uv)
    rast = _pixels([0, 1, 2, -1], [[0.2, 0.3]] * 4)  # -1 + 1 = 0: background
    rgb = shade_kd(mesh, rast, backend="torch")[0, 0]
    torch.testing.assert_close(rgb[0], _sample([0.3, 0.6]))
    torch.testing.assert_close(rgb[1], kd)
    torch.testing.assert_close(rgb[2], rgb[0])
    torch.testing.assert_close(rgb[3], torch.zeros(3))


def test_uvs_outside_unit_square_wrap_unless_clamped():
    inside, outside = [0.1, 0.2], [1.1, -0.8]  # one period apart
    wrap = [Material("w", torch.ones(3), TEX)]
    clamp = [Material("c", torch.ones(3), TEX, clamp=True)]
    rast = _pixels([0, 1], [[1.0, 0.0]] * 2)
    got = shade_kd(_mesh(wrap, [0, 0], [inside, outside]), rast, backend="torch")[0, 0]
    torch.testing.assert_close(got[1], got[0])
    # u = 0.1 lies left of texel 0's centre: wrap blends in column 1 across the seam.
    torch.testing.assert_close(got[0], _sample(inside))
    assert float(got[0, 0]) > float(_sample(inside, "clamp")[0])
    got = shade_kd(_mesh(clamp, [0, 0], [inside, outside]), rast, backend="torch")[0, 0]
    torch.testing.assert_close(got[0], _sample(inside, "clamp"))
    torch.testing.assert_close(got[1], TEX[0, 1])  # u > 1 -> column 1, v < 0 -> row 0


def test_map_kd_scale_and_offset_act_in_obj_uv_space():
    # -s 2 0.5 -o 0.25 0.1: (u, v_obj) -> (2 u + 0.25, 0.5 v_obj + 0.1); v_obj = 1 - v.
    mat = Material("m", torch.ones(3), TEX, uv_scale=(2.0, 0.5), uv_offset=(0.25, 0.1))
    uv = torch.tensor([[0.1, 0.3]])
    torch.testing.assert_close(mat.texture_uv(uv), torch.tensor([[0.45, 1 - (0.35 + 0.1)]]))
    got = shade_kd(_mesh([mat], [0], [[0.1, 0.3]]), _pixels([0], [[1.0, 0.0]]), backend="torch")
    torch.testing.assert_close(got[0, 0, 0], _sample([0.45, 0.55]))


def test_meshes_without_materials_use_kd_and_kd_texture():
    mesh = Mesh(v_pos=torch.zeros(1, 3), t_pos_idx=torch.zeros(1, 3, dtype=torch.int32))
    assert mesh_materials(mesh) is None
    mesh.kd = torch.tensor([0.5, 0.25, 1.0])
    materials, t_mat_idx = mesh_materials(mesh)
    assert len(materials) == 1 and t_mat_idx.tolist() == [0]
    rgb = shade_kd(mesh, _pixels([0], [[1.0, 0.0]]), backend="torch")
    torch.testing.assert_close(rgb[0, 0, 0], mesh.kd)
