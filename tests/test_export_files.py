"""What the export's files hold, read back from the bytes against the formats' own specs.

GLB accessors are decoded by hand from glTF 2.0's layout (12-byte header, JSON chunk, BIN
chunk; TEXCOORD_0 has its origin at the image's top-left, v growing downwards, which is
mptex's v), 16-bit PNG words from the PNG spec (zlib-compressed scanlines, filter 0 as
``write_png16`` writes them, big-endian words). Each test names the mutant of
``mptex/bake/export.py`` it was written against, which the bake and export tests let pass.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from mptex.bake import write_glb, write_texture_images
from mptex.bake.export import write_png16
from mptex.render import Mesh

# glTF 2.0 accessor componentType -> numpy dtype, type -> components.
_COMPONENT = {5121: np.uint8, 5123: np.uint16, 5125: np.uint32, 5126: np.float32}
_WIDTH = {"SCALAR": 1, "VEC2": 2, "VEC3": 3, "VEC4": 4}


def _glb_attributes(path: Path) -> dict[str, np.ndarray]:
    """The first primitive's POSITION, TEXCOORD_0 and indices of a .glb, decoded by hand."""
    data = path.read_bytes()
    assert data[:4] == b"glTF"
    json_len = struct.unpack_from("<I", data, 12)[0]
    gltf = json.loads(data[20 : 20 + json_len])
    binary = data[20 + json_len + 8 :]

    def accessor(index: int) -> np.ndarray:
        acc = gltf["accessors"][index]
        view = gltf["bufferViews"][acc["bufferView"]]
        dtype = np.dtype(_COMPONENT[acc["componentType"]]).newbyteorder("<")
        width = _WIDTH[acc["type"]]
        start = view.get("byteOffset", 0) + acc.get("byteOffset", 0)
        assert view.get("byteStride", dtype.itemsize * width) == dtype.itemsize * width
        flat = np.frombuffer(binary, dtype, acc["count"] * width, start)
        return flat.reshape(acc["count"], width)

    primitive = gltf["meshes"][0]["primitives"][0]
    return {
        "position": accessor(primitive["attributes"]["POSITION"]),
        "uv": accessor(primitive["attributes"]["TEXCOORD_0"]),
        "faces": accessor(primitive["indices"]).reshape(-1, 3),
    }


def test_glb_corners_keep_their_own_uv_where_uv_and_position_indices_differ(tmp_path):
    pytest.importorskip("trimesh", reason="GLB export needs trimesh")
    # Mutant caught: _split_at_seams taking the UVs by the position index (v_tex[unique[:, 0]]),
    # which every mesh whose t_tex_idx equals its t_pos_idx hides. Here a quad's 4 positions
    # have 5 UVs listed in another order, corner (0, 0) of the square twice (a seam).
    pos = torch.tensor([[0.0, 0, 0], [1, 0, 0], [1, 1, 0], [0, 1, 0]])
    t_pos = torch.tensor([[0, 1, 2], [0, 2, 3]], dtype=torch.int32)
    uv = torch.tensor([[0.75, 0.5], [0.25, 0.125], [0.5, 0.875], [0.125, 0.375], [0.625, 0.25]])
    t_tex = torch.tensor([[3, 1, 2], [4, 2, 0]], dtype=torch.int32)
    write_glb(tmp_path / "m.glb", Mesh(v_pos=pos, t_pos_idx=t_pos, v_tex=uv, t_tex_idx=t_tex),
              torch.full((4, 4, 3), 0.5))  # fmt: skip
    got = _glb_attributes(tmp_path / "m.glb")
    assert got["faces"].shape == (2, 3)
    for face in range(2):
        for corner in range(3):
            vertex = got["faces"][face, corner]
            # glTF's TEXCOORD_0 and mptex's UVs share the origin (top-left, v down): equal
            np.testing.assert_array_equal(got["position"][vertex], pos[t_pos[face, corner]])
            np.testing.assert_array_equal(got["uv"][vertex], uv[t_tex[face, corner]])


def _png16_words(path: Path) -> np.ndarray:
    """[H, W, 3] uint16 words of a filter-0 16-bit RGB PNG (one IDAT, as write_png16 writes)."""
    data = path.read_bytes()
    width, height, depth, colour = struct.unpack_from(">IIBB", data, 16)
    assert (depth, colour) == (16, 2)
    start = data.index(b"IDAT") + 4
    length = int.from_bytes(data[start - 8 : start - 4], "big")
    raw = np.frombuffer(zlib.decompress(data[start : start + length]), np.uint8)
    raw = raw.reshape(height, 1 + width * 6)
    assert not raw[:, 0].any()  # filter type 0 on every scanline
    return raw[:, 1:].copy().view(">u2").reshape(height, width, 3).astype(np.uint16)


def test_png16_ks_and_normal_images_hold_linear_words(tmp_path):
    # Mutant caught: the 16-bit writer sRGB-encoding every group, not the albedo alone (the
    # 8-bit path was pinned, the 16-bit one was not). The same values in kd are sRGB words:
    # IEC 61966-2-1, 1.055 * 0.25^(1 / 2.4) - 0.055 = 0.537098.
    values = torch.tensor([0.25, 0.5, 0.75])
    texture = values.repeat(3)[None, None].expand(2, 2, 9).contiguous()
    names = write_texture_images(tmp_path, texture, "png16")
    assert names == {"kd": "texture_kd.png", "ks": "texture_ks.png", "n": "texture_n.png"}
    linear = [round(0.25 * 65535), round(0.5 * 65535), round(0.75 * 65535)]
    for name in ("texture_ks.png", "texture_n.png"):
        assert _png16_words(tmp_path / name)[0, 0].tolist() == linear
    srgb = [1.055 * x ** (1 / 2.4) - 0.055 for x in (0.25, 0.5, 0.75)]
    kd = _png16_words(tmp_path / "texture_kd.png")[0, 0].astype(np.float64) / 65535
    np.testing.assert_allclose(kd, srgb, rtol=0, atol=0.5 / 65535 + 1e-6)  # word rounding


def test_png16_writes_values_outside_0_1_as_0_and_65535(tmp_path):
    # Mutant caught: no clamp before the 16-bit conversion, where 1.5 wrapped to 32767 and -0.25
    # to 49152 (uint16 modulo) instead of the 65535 and 0 a PNG can hold.
    image = torch.tensor([[[-0.25, 1.5, 1.0], [0.0, 2.0, -3.0]]])
    write_png16(tmp_path / "x.png", image)
    assert _png16_words(tmp_path / "x.png").tolist() == [[[0, 65535, 65535], [0, 65535, 0]]]
