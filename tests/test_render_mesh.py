"""OBJ/MTL reading and writing, normals."""

import pytest
import torch

from mptex.render import Mesh, load_obj, vertex_normals, write_obj
from mptex.scenes import torus_knot


def test_round_trip_with_texture(tmp_path):
    mesh = torus_knot(12, 5)
    gen = torch.Generator().manual_seed(0)
    mesh.kd_texture = torch.rand(8, 6, 3, generator=gen)
    write_obj(tmp_path / "knot.obj", mesh)
    back = load_obj(tmp_path / "knot.obj")
    assert torch.equal(back.v_pos, mesh.v_pos)  # 9 significant digits reproduce float32
    assert torch.equal(back.t_pos_idx, mesh.t_pos_idx)
    assert torch.equal(back.t_tex_idx, mesh.t_tex_idx)
    # v is written as 1 - v and flipped back: one float32 rounding each way.
    torch.testing.assert_close(back.v_tex, mesh.v_tex, rtol=0, atol=1e-7)
    torch.testing.assert_close(back.v_nrm, mesh.v_nrm, rtol=0, atol=1e-7)
    # 8-bit sRGB quantisation: at most half a step of 1/255 in sRGB, < 0.01 in linear.
    torch.testing.assert_close(back.kd_texture, mesh.kd_texture, rtol=0, atol=0.01)
    assert back.kd_texture.shape == (8, 6, 3)


def test_quads_are_fans_and_missing_normals_are_computed(tmp_path):
    (tmp_path / "q.obj").write_text(
        "# a unit quad and a pentagon, no normals\n"
        "v 0 0 0\nv 1 0 0\nv 1 1 0\nv 0 1 0\nv 2 0 0\n"
        "vt 0 0\nvt 1 0\nvt 1 1\nvt 0 1\nvt 1 0\n"
        "f 1/1 2/2 3/3 4/4\n"
        "f 2/2 5/5 3/3\n"
    )
    mesh = load_obj(tmp_path / "q.obj")
    expected = torch.tensor([[0, 1, 2], [0, 2, 3], [1, 4, 2]], dtype=torch.int32)
    assert torch.equal(mesh.t_pos_idx, expected)
    assert torch.equal(mesh.t_tex_idx, expected)
    torch.testing.assert_close(mesh.v_tex[3], torch.tensor([0.0, 0.0]))  # v flipped: 1 - 1
    torch.testing.assert_close(mesh.v_nrm, torch.tensor([[0.0, 0, 1]]).expand(5, 3))


def test_vertex_normals_are_area_weighted():
    # Vertex 0 joins a triangle in z = 0 (area 2) and one in x = 0 (area 0.5):
    # normal ~ 2 * (0, 0, 1) + 0.5 * (1, 0, 0), normalised.
    v_pos = torch.tensor([[0.0, 0, 0], [2, 0, 0], [0, 2, 0], [0, 1, 0], [0, 0, 1]])
    tri = torch.tensor([[0, 1, 2], [0, 3, 4]], dtype=torch.int32)
    n = vertex_normals(v_pos, tri)
    torch.testing.assert_close(n[0], torch.tensor([0.5, 0.0, 2.0]) / (4.25**0.5))


def test_negative_indices_and_kd_only_material(tmp_path):
    (tmp_path / "m.mtl").write_text("newmtl red\nKd 1 0 0\n")
    (tmp_path / "t.obj").write_text(
        "mtllib m.mtl\nusemtl red\nv 0 0 0\nv 1 0 0\nv 0 1 0\nvn 0 0 2\nf -3//-1 -2//-1 -1//-1\n"
    )
    mesh = load_obj(tmp_path / "t.obj")
    assert torch.equal(mesh.t_pos_idx, torch.tensor([[0, 1, 2]], dtype=torch.int32))
    torch.testing.assert_close(mesh.v_nrm, torch.tensor([[0.0, 0, 1]]))  # normalised on load
    torch.testing.assert_close(mesh.kd, torch.tensor([1.0, 0, 0]))
    assert mesh.kd_texture is None and mesh.v_tex is None


@pytest.mark.parametrize(
    "text, match",
    [
        ("v 0 0\n", r"bad\.obj:1: 'v' needs 3 numbers"),
        ("v 0 0 0\nv 1 0 0\nv a 1 0\n", r"bad\.obj:3: 'v' has a non-numeric"),
        ("v 0 0 0\nv 1 0 0\nv 0 1 0\nf 1 2 4\n", r"bad\.obj:4: position index 4 out of range"),
        ("v 0 0 0\nv 1 0 0\nf 1 2\n", r"bad\.obj:3: a face needs at least 3"),
        ("v 0 0 0\nv 1 0 0\nv 0 1 0\nvt 0 0\nf 1/1 2/1 3\n", r"bad\.obj:5: faces mix"),
        ("mtllib missing.mtl\n", r"bad\.obj:1: material library .* does not exist"),
        ("usemtl nothing\n", r"bad\.obj:1: material 'nothing' is not defined"),
        ("bogus 1 2 3\n", r"bad\.obj:1: unknown OBJ statement 'bogus'"),
        ("v 0 0 0\n", r"bad\.obj: no faces"),
    ],
)
def test_malformed_obj_names_file_and_line(tmp_path, text, match):
    (tmp_path / "bad.obj").write_text(text)
    with pytest.raises(ValueError, match=match):
        load_obj(tmp_path / "bad.obj")


def test_missing_texture_and_file(tmp_path):
    (tmp_path / "m.mtl").write_text("newmtl a\nmap_Kd nowhere.png\n")
    (tmp_path / "t.obj").write_text("mtllib m.mtl\n")
    with pytest.raises(ValueError, match=r"m\.mtl:2: map_Kd texture .*nowhere\.png"):
        load_obj(tmp_path / "t.obj")
    with pytest.raises(FileNotFoundError):
        load_obj(tmp_path / "absent.obj")


def test_mesh_aabb_and_to():
    mesh = Mesh(
        v_pos=torch.tensor([[0.0, -1, 2], [1, 3, -2]]),
        t_pos_idx=torch.tensor([[0, 1, 1]], dtype=torch.int32),
    )
    torch.testing.assert_close(mesh.aabb, torch.tensor([[0.0, -1, -2], [1, 3, 2]]))
    assert mesh.to("cpu").v_tex is None
