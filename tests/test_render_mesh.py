"""OBJ/MTL reading and writing, normals."""

import numpy as np
import pytest
import torch
from test_render_image import write_png16

from mptex.render import Mesh, load_obj, srgb_to_rgb, vertex_normals, write_obj
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
        ("v 0 0 0\nv 1 0 0\nv 0 1 0\nvt 0 0\nf 1/1 2/1 3\n", r"bad\.obj:5: a face mixes corners"),
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


def _write_texture(path, kind):
    """A 2 x 1 texture of one kind and its expected linear RGB [1, 2, 3]."""
    if kind == "jpeg":  # a uniform colour decodes exactly at quality 100, no subsampling
        Image.new("RGB", (2, 1), (200, 100, 50)).save(path, quality=100, subsampling=0)
        return _srgb(200, 100, 50).expand(1, 2, 3)
    if kind == "rgba":  # alpha is dropped: the diffuse colour has none
        Image.new("RGBA", (2, 1), (10, 20, 30, 0)).save(path)
        return _srgb(10, 20, 30).expand(1, 2, 3)
    if kind in ("grey", "grey_alpha"):
        image = Image.frombytes("L", (2, 1), bytes([0, 128]))
        (image.convert("LA") if kind == "grey_alpha" else image).save(path)
        return torch.stack([_srgb(0, 0, 0), _srgb(128, 128, 128)]).unsqueeze(0)
    if kind == "palette":
        image = Image.frombytes("P", (2, 1), bytes([1, 0]))
        image.putpalette([255, 0, 0, 0, 64, 255])
        image.save(path)
        return torch.stack([_srgb(0, 64, 255), _srgb(255, 0, 0)]).unsqueeze(0)
    if kind == "grey16":
        Image.fromarray(np.array([[300, 65535]], np.uint16)).save(path)
        grey = torch.tensor([300.0, 65535.0]).repeat_interleave(3).reshape(1, 2, 3)
        return srgb_to_rgb(grey / 65535)
    assert kind == "rgb16"
    words = np.array([[[300, 257, 65535], [0, 40000, 1]]], np.uint16)
    write_png16(path, words)
    return srgb_to_rgb(torch.from_numpy(words.astype(np.float32) / 65535))


@pytest.mark.parametrize(
    "kind", ["jpeg", "rgba", "grey", "grey_alpha", "palette", "grey16", "rgb16"]
)
def test_texture_formats_load_as_linear_rgb(tmp_path, kind):
    suffix = ".jpg" if kind == "jpeg" else ".png"
    expected = _write_texture(tmp_path / f"tex{suffix}", kind)
    (tmp_path / "m.mtl").write_text(f"newmtl a\nmap_Kd tex{suffix}\n")
    (tmp_path / "t.obj").write_text(QUADS + "mtllib m.mtl\nusemtl a\nf 1/1 2/2 3/3\n")
    got = load_obj(tmp_path / "t.obj").kd_texture
    assert got.shape == (1, 2, 3) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
