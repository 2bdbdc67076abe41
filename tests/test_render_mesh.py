"""OBJ/MTL reading and writing, normals."""

import warnings

import numpy as np
import pytest
import torch
from test_render_image import write_png16

from mptex.render import (
    Material,
    Mesh,
    UndefinedMaterialWarning,
    load_obj,
    srgb_to_rgb,
    vertex_normals,
    write_obj,
)
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
        "# a unit quad and a triangle, no normals\n"
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


@pytest.mark.parametrize("size", [1e20, 3e38, 1e-30, 1e-40])
def test_vertex_normals_of_huge_and_tiny_triangles_keep_their_direction(size):
    # (p1 - p0) x (p2 - p0) = size**2 * ((1, 0, 0) x (0, 0, 1)) = size**2 * (0, -1, 0); its
    # float32 components overflow (size 1e20: 1e40) or vanish (1e-30: 1e-60) unscaled.
    v_pos = torch.tensor([[0.0, 0, 0], [size, 0, 0], [0, 0, size]])
    n = vertex_normals(v_pos, torch.tensor([[0, 1, 2]], dtype=torch.int32))
    assert n.tolist() == [[0.0, -1.0, 0.0]] * 3


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
        ("v 0 0 0\nv 1 0 0\nv 0 1 0\nvt 0 0\nf 1/1 2/1 3\n", r"bad\.obj:5: a face mixes corners"),
        ("mtllib missing.mtl\n", r"bad\.obj:1: material library .* does not exist"),
        ("bogus 1 2 3\n", r"bad\.obj:1: unknown OBJ statement 'bogus'"),
        ("v 0 0 0\n", r"bad\.obj: no faces"),
    ],
)
def test_malformed_obj_names_file_and_line(tmp_path, text, match):
    (tmp_path / "bad.obj").write_text(text)
    with pytest.raises(ValueError, match=match):
        load_obj(tmp_path / "bad.obj")


def test_missing_texture_and_file(tmp_path):
    (tmp_path / "m.mtl").write_text("newmtl a\nmap_Kd nowhere.png\nnewmtl b\nKd 1 1 1\n")
    face = "v 0 0 0\nv 1 0 0\nv 0 1 0\nvt 0 0\nf 1/1 2/1 3/1\n"
    # A broken material that no face uses is no error (files often carry such materials).
    (tmp_path / "t.obj").write_text("mtllib m.mtl\nusemtl b\n" + face)
    assert load_obj(tmp_path / "t.obj").kd is not None
    (tmp_path / "t.obj").write_text("mtllib m.mtl\nusemtl a\n" + face)
    with pytest.raises(ValueError, match=r"m\.mtl:2: map_Kd texture .*nowhere\.png does not "
                       r"exist \(material 'a', used at line 7\)$"):  # fmt: skip
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


# ---------------------------------------------------------------------------------------------
# Real-world OBJ features: several materials, faces without vt, map_Kd options and file names,
# texture formats, UVs outside [0, 1]
# ---------------------------------------------------------------------------------------------

Image = pytest.importorskip("PIL.Image")

QUADS = (
    "v 0 0 0\nv 1 0 0\nv 1 1 0\nv 0 1 0\nv 2 0 0\nv 2 1 0\n"
    "vt 0 0\nvt 1 0\nvt 1 1\nvt 0 1\nvn 0 0 1\n"
)


def _solid_png(path, rgb=(255, 0, 0)):
    Image.new("RGB", (2, 2), rgb).save(path)


def _srgb(*values):
    return srgb_to_rgb(torch.tensor(values, dtype=torch.float32) / 255)


def test_several_materials_and_faces_without_vt(tmp_path):
    (tmp_path / "my tex.png").write_bytes(b"")  # a different file than the one used
    (tmp_path / "tex dir").mkdir()
    _solid_png(tmp_path / "tex dir" / "my tex.png", (255, 0, 0))
    (tmp_path / "m.mtl").write_text(
        "newmtl textured\nKd 1 1 1\n"
        "map_Kd -s 2 2 1 -o 0.5 0 0 -clamp on tex dir/my tex.png\n"
        "newmtl green\nKd 0 1 0\n"
        "newmtl bare\nNs 10\n"
    )
    (tmp_path / "t.obj").write_text(
        QUADS + "mtllib m.mtl\n"
        "f 1//1 2//1 3//1\n"  # before any usemtl: the default material
        "usemtl textured\nf 1/1/1 2/2/1 3/3/1 4/4/1\n"  # a quad: 2 triangles
        "usemtl green\nf 2//1 5//1 6//1 3//1\n"  # no vt: Kd only
        "usemtl bare\nf -5 -2 -1\n"  # no vt, no vn, negative indices
        "usemtl textured\nf 1/1/1 2/2/1 3/3/1\n"  # switching back
    )
    mesh = load_obj(tmp_path / "t.obj")
    names = [m.name for m in mesh.materials]
    assert names == ["(default)", "textured", "green", "bare"]
    assert mesh.t_mat_idx.tolist() == [0, 1, 1, 2, 2, 3, 1]
    assert mesh.kd is None and mesh.kd_texture is None  # several materials: see .materials
    default, textured, green, bare = mesh.materials
    grey = srgb_to_rgb(torch.full((3,), 0.8))  # the MTL default Kd
    torch.testing.assert_close(default.kd, grey)
    torch.testing.assert_close(bare.kd, grey)
    torch.testing.assert_close(green.kd, torch.tensor([0.0, 1, 0]))
    assert green.kd_texture is None
    torch.testing.assert_close(textured.kd_texture, torch.tensor([1.0, 0, 0]).expand(2, 2, 3))
    assert textured.uv_scale == (2.0, 2.0) and textured.uv_offset == (0.5, 0.0)
    assert textured.clamp and not green.clamp
    # Faces without vt point all three UV corners at one extra UV vertex (0, 0).
    assert mesh.v_tex.shape == (5, 2) and mesh.v_tex[4].tolist() == [0.0, 0.0]
    assert mesh.t_tex_idx[[0, 3, 4, 5]].tolist() == [[4, 4, 4]] * 4
    assert mesh.t_tex_idx[1].tolist() == [0, 1, 2]
    # The face without vn gets the computed vertex normals, appended after the file's.
    assert mesh.v_nrm.shape[0] == 1 + 6 and mesh.t_nrm_idx[5].tolist() == [1 + 1, 1 + 4, 1 + 5]
    torch.testing.assert_close(
        mesh.v_nrm[mesh.t_nrm_idx[5].long()], torch.tensor([[0.0, 0, 1]] * 3)
    )
    # The round trip keeps materials, their order, indices and map_Kd options.
    write_obj(tmp_path / "out.obj", mesh)
    back = load_obj(tmp_path / "out.obj")
    assert [m.name for m in back.materials] == names
    assert torch.equal(back.t_mat_idx, mesh.t_mat_idx)
    assert back.materials[1].uv_scale == (2.0, 2.0) and back.materials[1].clamp
    torch.testing.assert_close(back.materials[1].kd_texture, textured.kd_texture)


@pytest.mark.parametrize(
    "line, name",
    [
        ("map_Kd -bm 1 -blendu off -blendv on -boost 2 -texres 512 t.png", "t.png"),
        ("map_Kd -mm 0 1 -cc off -t 0 0 0 t.png", "t.png"),  # no-op values of colour options
        ("map_Kd -s 2 t.png", "t.png"),  # v and w optional
        ("map_Kd sub\\t.png", "sub/t.png"),  # Windows separators
        ("map_Kd C:\\Users\\someone\\assets\\t.png", "t.png"),  # another machine's absolute path
        ('map_Kd "with space.png"', "with space.png"),
        ("map_Kd  -o 0.1 0.2  with  two  spaces.png", "with  two  spaces.png"),
    ],
)
def test_map_kd_options_and_file_names(tmp_path, line, name):
    (tmp_path / "sub").mkdir()
    _solid_png(tmp_path / name, (0, 0, 255))
    (tmp_path / "m.mtl").write_text(f"newmtl a\n{line}\n")
    (tmp_path / "t.obj").write_text(QUADS + "mtllib m.mtl\nusemtl a\nf 1/1 2/2 3/3\n")
    mesh = load_obj(tmp_path / "t.obj")
    torch.testing.assert_close(mesh.kd_texture, torch.tensor([0.0, 0, 1]).expand(2, 2, 3))


@pytest.mark.parametrize(
    "mtl, face, match",
    [
        ("map_Kd -mm 0.2 1 t.png", "f 1/1 2/2 3/3", r"m\.mtl:2: map_Kd option -mm .* not supp"),
        ("map_Kd -cc on t.png", "f 1/1 2/2 3/3", r"m\.mtl:2: map_Kd option -cc on .*not supp"),
        ("map_Kd -imfchan r t.png", "f 1/1 2/2 3/3", r"m\.mtl:2: map_Kd option -imfchan"),
        ("map_Kd -type sphere t.png", "f 1/1 2/2 3/3", r"m\.mtl:2: map_Kd option -type"),
        ("map_Kd -t 1 1 0 t.png", "f 1/1 2/2 3/3", r"m\.mtl:2: map_Kd option -t \(turb"),
        ("map_Kd -halo 2 t.png", "f 1/1 2/2 3/3", r"m\.mtl:2: map_Kd option -halo is not supp"),
        ("map_Kd -clamp maybe t.png", "f 1/1 2/2 3/3", r"m\.mtl:2: .*-clamp expects on or off"),
        ("map_Kd -s t.png", "f 1/1 2/2 3/3", r"m\.mtl:2: map_Kd option -s needs"),
        ("map_Kd -s 1 1", "f 1/1 2/2 3/3", r"m\.mtl:2: map_Kd texture .*1 does not exist"),
        ("Kd spectral ident.rfl", "f 1 2 3", r"m\.mtl:2: 'Kd spectral' is not supported"),
        ("map_Kd notes.png", "f 1/1 2/2 3/3", r"m\.mtl:2: map_Kd texture .*notes\.png cannot be"),
        ("map_Kd t.png", "f 1 2 3", r"t\.obj:\d+: face without texcoords .* 'a', which has a map"),
    ],
)
def test_unsupported_material_features_name_file_and_line(tmp_path, mtl, face, match):
    _solid_png(tmp_path / "t.png")
    (tmp_path / "notes.png").write_text("not an image")
    (tmp_path / "m.mtl").write_text(f"newmtl a\n{mtl}\n")
    (tmp_path / "t.obj").write_text(QUADS + f"mtllib m.mtl\nusemtl a\n{face}\n")
    with pytest.raises(ValueError, match=match) as info:
        load_obj(tmp_path / "t.obj")
    assert "\n" not in str(info.value)


def _write_texture(folder, kind):
    """A 2 x 1 texture of one kind: its file name and its expected linear RGB [1, 2, 3]."""
    if kind in ("jpeg", "grey_jpeg"):  # uniform colours decode exactly at quality 100
        image = Image.new("RGB", (2, 1), (200, 100, 50))
        if kind == "grey_jpeg":
            image = Image.new("L", (2, 1), 128)
        image.save(folder / "tex.jpg", quality=100, subsampling=0)
        rgb = (200, 100, 50) if kind == "jpeg" else (128, 128, 128)
        return "tex.jpg", _srgb(*rgb).expand(1, 2, 3)
    path = folder / "tex.png"
    if kind in ("rgba", "tga", "bmp"):  # alpha is dropped: the diffuse colour has none
        image = Image.frombytes("RGBA", (2, 1), bytes([10, 20, 30, 0, 250, 128, 1, 255]))
        name = {"rgba": "tex.png", "tga": "tex.tga", "bmp": "tex.bmp"}[kind]
        (image if kind != "bmp" else image.convert("RGB")).save(folder / name)
        return name, torch.stack([_srgb(10, 20, 30), _srgb(250, 128, 1)]).unsqueeze(0)
    if kind in ("grey", "grey_alpha"):
        image = Image.frombytes("L", (2, 1), bytes([0, 128]))
        (image.convert("LA") if kind == "grey_alpha" else image).save(path)
        return "tex.png", torch.stack([_srgb(0, 0, 0), _srgb(128, 128, 128)]).unsqueeze(0)
    if kind == "grey1":  # 1-bit: bits 0, 1 -> black, white
        Image.frombytes("1", (2, 1), bytes([0b01000000])).save(path)
        return "tex.png", torch.tensor([[0.0] * 3, [1.0] * 3]).unsqueeze(0)
    if kind in ("palette", "palette_alpha", "gif"):
        image = Image.frombytes("P", (2, 1), bytes([1, 0]))
        image.putpalette([255, 0, 0, 0, 64, 255])
        expected = torch.stack([_srgb(0, 64, 255), _srgb(255, 0, 0)]).unsqueeze(0)
        if kind == "gif":  # animated: the first frame is the texture
            other = Image.frombytes("P", (2, 1), bytes([0, 0]))
            other.putpalette([9, 9, 9, 0, 0, 0])
            image.save(folder / "tex.gif", save_all=True, append_images=[other])
            return "tex.gif", expected
        image.save(path, **({"transparency": 0} if kind == "palette_alpha" else {}))
        return "tex.png", expected
    if kind == "grey16":
        Image.fromarray(np.array([[300, 65535]], np.uint16)).save(path)
        grey = torch.tensor([300.0, 65535.0]).repeat_interleave(3).reshape(1, 2, 3)
        return "tex.png", srgb_to_rgb(grey / 65535)
    if kind == "grey_alpha16":
        write_png16(path, np.array([[[300, 0], [40000, 65535]]], np.uint16))
        grey = torch.tensor([300.0, 40000.0]).repeat_interleave(3).reshape(1, 2, 3)
        return "tex.png", srgb_to_rgb(grey / 65535)
    assert kind in ("rgb16", "rgba16")
    words = np.array([[[300, 257, 65535, 7], [0, 40000, 1, 65535]]], np.uint16)
    write_png16(path, words if kind == "rgba16" else words[..., :3])
    return "tex.png", srgb_to_rgb(torch.from_numpy(words[..., :3].astype(np.float32) / 65535))


TEXTURE_KINDS = ["jpeg", "grey_jpeg", "rgba", "tga", "bmp", "grey", "grey_alpha", "grey1",
                 "palette", "palette_alpha", "gif", "grey16", "grey_alpha16", "rgb16",
                 "rgba16"]  # fmt: skip


@pytest.mark.parametrize("kind", TEXTURE_KINDS)
def test_texture_formats_load_as_linear_rgb(tmp_path, kind):
    name, expected = _write_texture(tmp_path, kind)
    (tmp_path / "m.mtl").write_text(f"newmtl a\nmap_Kd {name}\n")
    (tmp_path / "t.obj").write_text(QUADS + "mtllib m.mtl\nusemtl a\nf 1/1 2/2 3/3\n")
    got = load_obj(tmp_path / "t.obj").kd_texture
    assert got.shape == (1, 2, 3) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def _area_z(mesh):
    """Each triangle's signed area seen from +z (positive: counter-clockwise)."""
    p = mesh.v_pos[mesh.t_pos_idx.long()]
    e1, e2 = p[:, 1] - p[:, 0], p[:, 2] - p[:, 0]
    return (e1[:, 0] * e2[:, 1] - e1[:, 1] * e2[:, 0]) / 2


def test_ngons_convex_fans_and_concave_ear_clipping(tmp_path):
    (tmp_path / "n.obj").write_text(
        "v 0 0 0\nv 1 0 0\nv 2 1 0\nv 1 2 0\nv 0 2 0\nv -1 1 0\n"
        "f 1 2 3 4 5 6\n"  # a convex hexagon: the fan around its first corner
        # An L (the unit square at (1..2, 1..2) missing), starting next to its reflex corner
        # (1, 1): the fan around (2, 1) would cover the missing square. Negative indices.
        "v 2 1 0\nv 1 1 0\nv 1 2 0\nv 0 2 0\nv 0 0 0\nv 2 0 0\n"
        "f -6 -5 -4 -3 -2 -1\n"
        # A dart: its reflex corner (1, 0.3) is corner 1, so the fan's diagonal 0-2 is outside.
        "v 0 0 0\nv 1 0.3 0\nv 2 0 0\nv 1 1 0\n"
        "f 13 14 15 16\n"
    )
    mesh = load_obj(tmp_path / "n.obj")
    assert mesh.t_pos_idx[:4].tolist() == [[0, 1, 2], [0, 2, 3], [0, 3, 4], [0, 4, 5]]
    area = _area_z(mesh)
    assert mesh.t_pos_idx.shape[0] == 4 + 4 + 2
    # Every triangle keeps the polygon's winding (a fan of the L would give one clockwise)...
    assert bool((area > 0).all()), area
    # ... and the triangles add up to each polygon's area: hexagon 4, L 3, dart 0.7.
    torch.testing.assert_close(area[:4].sum(), torch.tensor(4.0))
    torch.testing.assert_close(area[4:8].sum(), torch.tensor(3.0))
    torch.testing.assert_close(area[8:].sum(), torch.tensor(0.7))
    # No L triangle reaches into the missing square (x > 1 and y > 1).
    centres = mesh.v_pos[mesh.t_pos_idx[4:8].long()].mean(dim=1)
    assert not bool(((centres[:, 0] > 1) & (centres[:, 1] > 1)).any())
    # The dart is split along its inner diagonal, corner 1 (1, 0.3) to corner 3 (1, 1).
    assert all({13, 15} <= set(t) for t in mesh.t_pos_idx[8:].tolist())


def test_self_intersecting_polygon_is_one_line(tmp_path):
    (tmp_path / "x.obj").write_text(
        "v 0 0 0\nv 3 2 0\nv 3 1 0\nv 2 1 0\nv 1 3 0\n# edges 1-2 and 4-5 cross\nf 1 2 3 4 5\n"
    )
    with pytest.raises(ValueError, match=r"x\.obj:7: a polygon of 5 vertices cannot be tri"):
        load_obj(tmp_path / "x.obj")


def test_a_trailing_backslash_continues_a_statement_on_the_next_line(tmp_path):
    (tmp_path / "c.obj").write_text(
        "v 0 0 \\\n0\n"  # a vertex on two lines
        "v 1 0 0\nv 1 1 0\nv 0 1 0\nv -0.5 0.5 0\n"
        "f 1 2 \\ \t\n"  # spaces and a tab after the backslash
        "\t3 4 \\  # a comment after the backslash\n"
        "   5\n"
        "# a comment ending with a Windows folder is no continuation: C:\\models\\\n"
        "v 9 9 9 # nor is a statement's comment ending so C:\\models\\\n"
        "v 8 8 8\n"
        "f 1 2\\\n3\n"  # no space before the backslash: still two tokens
        "f -1 1 2 \\\n"  # at the end of the file: the statement ends with the file
    )
    mesh = load_obj(tmp_path / "c.obj")
    assert mesh.v_pos.tolist()[:5] == [[0, 0, 0], [1, 0, 0], [1, 1, 0], [0, 1, 0], [-0.5, 0.5, 0]]
    assert mesh.v_pos.shape[0] == 7  # neither commented line took the vertex after it
    assert mesh.t_pos_idx.tolist() == [[0, 1, 2], [0, 2, 3], [0, 3, 4], [0, 1, 2], [6, 0, 1]]


@pytest.mark.parametrize(
    "text, match",
    [  # an error in a continued statement names its first line; later lines keep their own
        ("v 0 0 0\nv 1 0 0\nv 0 1 0\nf 1 \\\n2 \\\n4\n", r"c\.obj:4: position index 4 out"),
        ("v 0 0 \\\n0\nv 1 0 0\nv 0 1 0 \\\n\nf 1 2 3 \\\n\nbogus\n", r"c\.obj:8: unknown OBJ"),
        ("v 0 0 0\nv 1 0 0\nf 1 2 \\\n", r"c\.obj:3: a face needs at least 3 vertices"),
    ],
)
def test_errors_in_continued_statements_name_their_first_line(tmp_path, text, match):
    (tmp_path / "c.obj").write_text(text)
    with pytest.raises(ValueError, match=match):
        load_obj(tmp_path / "c.obj")


def test_mtl_statements_continue_and_windows_paths_keep_their_backslashes(tmp_path):
    (tmp_path / "sub").mkdir()
    _solid_png(tmp_path / "sub" / "t.png", (0, 0, 255))
    _solid_png(tmp_path / "t.png", (255, 0, 0))
    (tmp_path / "m.mtl").write_text(
        "newmtl a\nKd 1 \\\n  0 0\nmap_Kd -s 2 2 1 \\\n  sub\\t.png\n"
        "newmtl b\nmap_Kd C:\\Users\\someone\\t.png\n"
        "newmtl c\nKd 0 \\\n1 0\n"
    )
    (tmp_path / "t.obj").write_text(
        QUADS + "mtllib m.mtl\nusemtl a\nf 1/1 2/2 3/3\nusemtl b\nf 1/1 2/2 3/3\n"
        "usemtl \\\nc\nf 1 2 3\n"
    )
    a, b, c = load_obj(tmp_path / "t.obj").materials
    blue = torch.tensor([0.0, 0, 1]).expand(2, 2, 3)
    assert a.uv_scale == (2.0, 2.0) and torch.equal(a.kd_texture, blue)
    assert torch.equal(b.kd_texture, torch.tensor([1.0, 0, 0]).expand(2, 2, 3))
    assert c.name == "c" and c.kd.tolist() == [0.0, 1.0, 0.0]


def test_negative_texcoord_and_normal_indices_count_back_from_the_line(tmp_path):
    (tmp_path / "t.obj").write_text(
        QUADS + "f -4/-4/-1 -3/-3/-1 -2/-2/-1 -1/-1/-1\n"  # v 3..6, vt 1..4 (a quad)
        "v 5 5 5\nvt 0.5 0.5\nvn 1 0 0\n"
        "f -1/-1/-1 -6/-5/-2 1/1/1\n"  # -1 now means the new v 7, vt 5, vn 2
    )
    mesh = load_obj(tmp_path / "t.obj")
    assert mesh.t_pos_idx.tolist() == [[2, 3, 4], [2, 4, 5], [6, 1, 0]]
    assert mesh.t_tex_idx.tolist() == [[0, 1, 2], [0, 2, 3], [4, 0, 0]]
    assert mesh.t_nrm_idx.tolist() == [[0, 0, 0], [0, 0, 0], [1, 0, 0]]


def test_mtllib_and_texture_names_with_spaces_several_libraries_and_letter_case(tmp_path):
    folder = tmp_path / "my assets"
    folder.mkdir()
    _solid_png(folder / "wood grain.png", (0, 255, 0))
    (folder / "my materials.mtl").write_text("newmtl wood\nmap_Kd Wood Grain.PNG\n")
    (folder / "a.mtl").write_text("newmtl red\nKd 1 0 0\n")
    (folder / "b.mtl").write_text("newmtl blue\nKd 0 0 1\n")
    (folder / "two libs.obj").write_text(
        QUADS + "mtllib my materials.mtl\nmtllib a.mtl b.mtl\n"
        "usemtl wood\nf 1/1 2/2 3/3\nusemtl blue\nf 1 3 4\nusemtl red\nf 2 5 6\n"
    )
    mesh = load_obj(folder / "two libs.obj")
    assert [m.name for m in mesh.materials] == ["wood", "blue", "red"]
    torch.testing.assert_close(
        mesh.materials[0].kd_texture, torch.tensor([0.0, 1, 0]).expand(2, 2, 3)
    )
    torch.testing.assert_close(mesh.materials[1].kd, torch.tensor([0.0, 0, 1]))
    torch.testing.assert_close(mesh.materials[2].kd, torch.tensor([1.0, 0, 0]))
    # Neither one file nor several: the error names the whole name; one of several missing:
    # that one.
    for line, missing in (("mtllib no such.mtl", "no such.mtl"), ("mtllib a.mtl c.mtl", "c.mtl")):
        (folder / "bad.obj").write_text(f"{line}\n")
        with pytest.raises(ValueError, match=rf"bad\.obj:1: material library .*/my assets/"
                           rf"{missing} does not exist$"):  # fmt: skip
            load_obj(folder / "bad.obj")


def test_uvs_outside_the_unit_square_wrap_and_map_kd_options_through_load_obj(tmp_path):
    """A 2 x 2 texture (red, green / blue, white) sampled at texel centres far outside [0, 1]:
    each triangle's three corners share one vt, so its pixels see one texel."""
    from mptex.render.material import shade_kd

    image = Image.frombytes("RGB", (2, 2), bytes([255, 0, 0, 0, 255, 0, 0, 0, 255, 255, 255, 255]))
    image.save(tmp_path / "four texels.png")
    red, green, blue, white = torch.tensor([[1.0, 0, 0], [0, 1, 0], [0, 0, 1], [1, 1, 1]])
    (tmp_path / "m.mtl").write_text(
        "newmtl wrap\nmap_Kd four texels.png\n"
        "newmtl clamp\nmap_Kd -clamp on four texels.png\n"
        "newmtl shift\nmap_Kd -o 0.5 0 0 four texels.png\n"
        "newmtl scale\nmap_Kd -s 2 2 1 four texels.png\n"
        "newmtl flat\nKd 0.2 0.4 0.6\n"
    )
    # OBJ vt (u, v): v counts up from the image's bottom row; texel centres at 0.25 and 0.75.
    cases = [
        ("wrap", "0.25 0.75", red),  # inside: the top-left texel
        ("wrap", "2.25 -1.25", red),  # two periods right, two down: the same texel
        ("wrap", "-0.25 3.75", green),  # u = -0.25 wraps to 0.75: the right column
        ("wrap", "7.75 -6.75", white),  # bottom right, many periods away
        ("clamp", "2.25 -1.25", white),  # clamped: u -> 1 (right), v -> 0 (bottom row)
        ("clamp", "-0.25 3.75", red),  # u -> 0 (left), v -> 1 (top row)
        ("shift", "0.25 0.75", green),  # -o 0.5: u + 0.5
        ("scale", "0.625 0.625", blue),  # -s 2 2: (1.25, 1.25) wraps to the bottom left
    ]
    lines = ["mtllib m.mtl", "v 0 0 0", "v 1 0 0", "v 0 1 0"]
    lines += [f"vt {uv}" for _, uv, _ in cases]
    for i, (material, _, _) in enumerate(cases, start=1):
        lines += [f"usemtl {material}", f"f 1/{i} 2/{i} 3/{i}"]
    lines += ["usemtl flat", "f 1 2 3"]  # no vt: Kd only
    (tmp_path / "uv wrap.obj").write_text("\n".join(lines) + "\n")
    mesh = load_obj(tmp_path / "uv wrap.obj")
    rast = torch.zeros(1, 1, len(cases) + 1, 4)
    rast[..., 0] = 1.0  # barycentric weight 1 on corner 0
    rast[0, 0, :, 3] = torch.arange(len(cases) + 1, dtype=torch.float32) + 1
    rgb = shade_kd(mesh, rast, backend="torch")[0, 0]
    expected = torch.stack([colour for _, _, colour in cases] + [_srgb(51, 102, 153)])
    torch.testing.assert_close(rgb, expected, rtol=0, atol=1e-6)


def test_a_material_the_mtl_does_not_define_warns_once_and_gets_the_default(tmp_path):
    # As exporters write them: the faces name a material the MTL does not define (here after
    # one that it does); Blender and trimesh load them with a default material and a warning.
    (tmp_path / "m.mtl").write_text("newmtl red\nKd 1 0 0\n")
    (tmp_path / "m.obj").write_text(
        "mtllib m.mtl\nv 0 0 0\nv 1 0 0\nv 0 1 0\nv 1 1 0\n"
        "usemtl red\nf 1 2 3\nusemtl aiStandardSurface3SG\nf 2 4 3\n"
        "usemtl aiStandardSurface3SG\nf 1 2 4\n"
    )
    with pytest.warns(UndefinedMaterialWarning) as record:
        mesh = load_obj(tmp_path / "m.obj")
    assert [str(w.message) for w in record] == [
        f"{tmp_path / 'm.obj'}:8: material 'aiStandardSurface3SG' is not defined in the MTL "
        "files; its faces get the MTL default (Kd 0.8 grey)"
    ]
    assert [m.name for m in mesh.materials] == ["red", "aiStandardSurface3SG"]
    assert mesh.t_mat_idx.tolist() == [0, 1, 1]
    grey = srgb_to_rgb(torch.tensor([0.8, 0.8, 0.8]))
    torch.testing.assert_close(mesh.materials[1].kd, grey, rtol=0, atol=0)
    assert mesh.materials[1].kd_texture is None


_TRIANGLE = "v 0 0 0\nv 1 0 0\nv 0 1 0\nvt 0 0\nvn 0 0 1\n"


@pytest.mark.parametrize(
    "obj, mtl, match",
    [
        # 1e39 is finite as a Python float but beyond float32's largest, 3.40282e38: as a mesh
        # value it would be inf (a position, a UV) or turn a normal NaN.
        ("v 1e39 0 0\n" + _TRIANGLE + "f 2 3 4\n", "", r"t\.obj:1: 'v' has a value beyond"),
        (_TRIANGLE + "vt 0 -4e38\nf 1/2 2/1 3/1\n", "", r"t\.obj:6: 'vt' has a value beyond"),
        (_TRIANGLE + "vn 0 0 1e39\nf 1//2 2//1 3//1\n", "", r"t\.obj:6: 'vn' has a value beyond"),
        (_TRIANGLE + "mtllib m.mtl\nusemtl a\nf 1 2 3\n", "newmtl a\nKd 1e39 0 0\n",
         r"m\.mtl:2: 'Kd' has a value beyond"),
        (_TRIANGLE + "mtllib m.mtl\nusemtl a\nf 1/1 2/1 3/1\n", "newmtl a\nmap_Kd -s 1e39 t.png\n",
         r"m\.mtl:2: map_Kd option -s has a value beyond"),
    ],
)  # fmt: skip
def test_values_beyond_float32_are_refused_naming_file_and_line(tmp_path, obj, mtl, match):
    _solid_png(tmp_path / "t.png")
    (tmp_path / "m.mtl").write_text(mtl)
    (tmp_path / "t.obj").write_text(obj)
    with pytest.raises(ValueError, match=match + r" float32's range") as info:
        load_obj(tmp_path / "t.obj")
    assert "\n" not in str(info.value)


def test_values_near_the_float32_limit_load_unchanged(tmp_path):
    # 3.4e38 < 3.40282e38 (float32's largest): stored as the float32 nearest to it, finite.
    (tmp_path / "t.obj").write_text("v -3.4e38 0 0\nv 3.4e38 0 0\nv 0 1 0\nf 1 2 3\n")
    mesh = load_obj(tmp_path / "t.obj")
    assert mesh.v_pos[:, 0].tolist() == [float(np.float32(-3.4e38)), float(np.float32(3.4e38)), 0.0]


def test_files_starting_with_a_utf8_byte_order_mark_read_as_without_it(tmp_path):
    bom = b"\xef\xbb\xbf"
    (tmp_path / "m.mtl").write_bytes(bom + b"newmtl red\nKd 1 0 0\n")
    obj = b"mtllib m.mtl\nv 0 0 0\nv 1 0 0\nv 0 1 0\nusemtl red\nf 1 2 3\n"
    for first in (b"", b"# exported\n", b"v 5 5 5\n"):
        (tmp_path / "m.obj").write_bytes(bom + first + obj)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UndefinedMaterialWarning)  # red is defined
            mesh = load_obj(tmp_path / "m.obj")
        assert mesh.v_pos[:, :2].tolist()[-3:] == [[0, 0], [1, 0], [0, 1]]
        assert mesh.v_pos.shape[0] == (4 if first.startswith(b"v") else 3)
        # Kd 1 0 0 is linear 1 0 0 (the sRGB curve keeps 0 and 1)
        assert mesh.kd.tolist() == [1.0, 0.0, 0.0]


@pytest.mark.parametrize("mtllib_line", [1, 9])
def test_a_face_without_vt_on_a_textured_material_is_refused_wherever_mtllib_stands(
    tmp_path, mtllib_line
):
    # mtllib first, or last: after the faces that use its materials, as the spec allows. The
    # last face has no vt and its material a texture: no UV to sample the texture at.
    _solid_png(tmp_path / "t.png")
    (tmp_path / "m.mtl").write_text("newmtl tex\nmap_Kd t.png\nnewmtl red\nKd 1 0 0\n")
    body = ["v 0 0 0", "v 1 0 0", "v 0 1 0", "vt 0.5 0.5", "usemtl red", "f 1/1 2/1 3/1",
            "usemtl tex", "f 1 2 3"]  # fmt: skip
    body.insert(mtllib_line - 1, "mtllib m.mtl")
    (tmp_path / "m.obj").write_text("\n".join(body) + "\n")
    face_line = 9 if mtllib_line == 1 else 8
    with pytest.raises(ValueError) as info:
        load_obj(tmp_path / "m.obj")
    assert str(info.value) == (
        f"{tmp_path / 'm.obj'}:{face_line}: face without texcoords (vt) uses material 'tex', "
        "which has a map_Kd texture"
    )


def test_of_several_faces_without_vt_on_a_textured_material_the_first_is_named(tmp_path):
    # Lines 6 and 7 are both such faces: the error names line 6, where a reader starts.
    _solid_png(tmp_path / "t.png")
    (tmp_path / "m.mtl").write_text("newmtl tex\nmap_Kd t.png\n")
    (tmp_path / "m.obj").write_text(
        "mtllib m.mtl\nv 0 0 0\nv 1 0 0\nv 0 1 0\nusemtl tex\nf 1 2 3\nf 3 2 1\n"
    )
    with pytest.raises(ValueError, match=r"m\.obj:6: face without texcoords \(vt\) uses "):
        load_obj(tmp_path / "m.obj")


def test_a_value_of_exactly_float32s_largest_is_in_range(tmp_path):
    # 3.4028234663852886e38 is float32's largest finite value (torch.finfo): held exactly, so
    # the normal (it, 0, 0) loads as the unit normal (1, 0, 0); 4e38 beyond it is refused.
    largest = float(torch.finfo(torch.float32).max)
    for value, loads in ((repr(largest), True), ("4e38", False)):
        (tmp_path / "n.obj").write_text(
            f"v 0 0 0\nv 1 0 0\nv 0 1 0\nvn {value} 0 0\nf 1//1 2//1 3//1\n"
        )
        if loads:
            assert load_obj(tmp_path / "n.obj").v_nrm.tolist() == [[1.0, 0.0, 0.0]]
        else:
            with pytest.raises(ValueError, match=r"n\.obj:4: 'vn' has a value beyond float32"):
                load_obj(tmp_path / "n.obj")


def test_file_normals_of_any_length_become_unit_normals_of_their_direction(tmp_path):
    # (1e20, 1e20, 0): its squared length, 2e40, is beyond float32; (1e-30, 0, 0) and the
    # float32 subnormals (0, 3e-39, 4e-39): theirs vanish in float32. Directions by hand:
    # (1, 1, 0) / sqrt(2), (1, 0, 0), (0, 3, 4) / 5.
    normals = ["vn 1e20 1e20 0", "vn 1e-30 0 0", "vn 0 3e-39 4e-39", "vn 0 0 -2"]
    (tmp_path / "n.obj").write_text(
        "v 0 0 0\nv 1 0 0\nv 0 1 0\n"
        + "\n".join(normals)
        + "\nf 1//1 2//2 3//3\nf 1//4 2//4 3//4\n"
    )
    mesh = load_obj(tmp_path / "n.obj")
    r = 0.5**0.5
    expected = torch.tensor([[r, r, 0.0], [1.0, 0.0, 0.0], [0.0, 0.6, 0.8], [0.0, 0.0, -1.0]])
    # float32 rounding of values computed in float64
    torch.testing.assert_close(mesh.v_nrm, expected, rtol=0, atol=1e-7)


def test_file_normals_of_ordinary_length_keep_their_float32_normalisation(tmp_path):
    # Normals whose squared length float32 holds are divided by their float32 length, as
    # before the wide path existed, so that meshes' shading keeps its bits; an extreme normal
    # in the same file does not change that.
    gen = torch.Generator().manual_seed(7)
    normals = torch.randn(64, 3, generator=gen) * torch.logspace(-6, 6, 64).unsqueeze(-1)
    lines = [f"vn {x!r} {y!r} {z!r}" for x, y, z in normals.tolist()] + ["vn 1e20 1e20 0"]
    faces = [f"f 1//{i + 1} 2//{i + 1} 3//{i + 1}" for i in range(len(lines))]
    (tmp_path / "n.obj").write_text("v 0 0 0\nv 1 0 0\nv 0 1 0\n" + "\n".join(lines + faces) + "\n")
    mesh = load_obj(tmp_path / "n.obj")
    float32 = normals / torch.linalg.norm(normals, dim=-1, keepdim=True)
    assert torch.equal(mesh.v_nrm[:64], float32)
    r = 0.5**0.5
    torch.testing.assert_close(mesh.v_nrm[64], torch.tensor([r, r, 0.0]), rtol=0, atol=1e-7)


def test_load_obj_holds_its_file_a_few_times_over_not_an_object_per_number(tmp_path, monkeypatch):
    """A 1M-face OBJ of 37 MB held ~0.6 GB of Python objects while loading (its lines, its
    statements, and a list and float or int objects for every vertex and face) for 38 MB of
    tensors. Python's own allocations at load_obj's peak (tracemalloc; torch's tensors are not
    among them) are counted here on a file of 4,000 triangles with UVs and normals, its lines
    split in blocks of 4 KB as a large file's are in blocks of 1M characters."""
    import tracemalloc

    import mptex.render.obj as obj

    mesh = torus_knot(100, 20)
    write_obj(tmp_path / "knot.obj", mesh)
    size = (tmp_path / "knot.obj").stat().st_size
    monkeypatch.setattr(obj, "_LINES_BLOCK", 4096, raising=False)
    tracemalloc.start()
    try:
        back = load_obj(tmp_path / "knot.obj")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert torch.equal(back.t_pos_idx, mesh.t_pos_idx)
    # The file's bytes and its decoded text (one byte a character: ASCII) are alive together
    # once; the arrays of numbers take fewer bytes than the text that writes them (8 for a
    # coordinate of ~12 characters, 4 for an index of ~5). With a list per line and per
    # face, it was 13 times the file.
    assert peak < 4 * size, f"{peak} bytes at the peak for a file of {size}"


def test_lines_in_blocks_are_those_of_splitlines():
    from mptex.render.obj import _blocks_of

    def lines(text, block):
        return [line for piece in _blocks_of(text, block) for line in piece.splitlines()]

    text = "v 1 2 3\r\nvt 0 0\rvn 0 0 1\n\nf 1 2 3\x0b\x0c\x1c\x85\u2028#\r\n\r\nlast"
    for block in (1, 2, 3, 5, 8, 13, len(text), 1 << 20):
        assert lines(text, block) == text.splitlines(), block
    assert lines("", 4) == []


def test_write_obj_writes_a_block_of_rows_at_a_time(tmp_path, monkeypatch):
    """write_obj held a 1M-face mesh's whole text and the Python lists of all its numbers
    (~1 GB for a 95 MB file). Python's allocations at its peak (tracemalloc) are counted here
    for 4,000 triangles with UVs, normals and two materials, written 64 rows at a time: the
    file, byte for byte the same in one block or many, is never held whole."""
    import tracemalloc

    import mptex.render.obj as obj

    mesh = torus_knot(100, 20)
    mesh.materials = [Material("a", torch.tensor([0.2, 0.3, 0.4])),
                      Material("b", torch.tensor([0.5, 0.5, 0.5]))]  # fmt: skip
    mesh.t_mat_idx = (torch.arange(mesh.t_pos_idx.shape[0]) // 100 % 2).int()
    write_obj(tmp_path / "one.obj", mesh)
    monkeypatch.setattr(obj, "_WRITE_ROWS", 64)
    tracemalloc.start()
    try:
        write_obj(tmp_path / "blocks.obj", mesh)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    text = (tmp_path / "blocks.obj").read_bytes()
    assert text == (tmp_path / "one.obj").read_bytes().replace(b"one.mtl", b"blocks.mtl")
    assert text.count(b"usemtl") == 40  # the material changes every 100 faces
    # Held whole, the text alone is the file's size; 64 rows of it are ~1/60th.
    assert peak < len(text) / 2, f"{peak} bytes at the peak for a file of {len(text)}"
