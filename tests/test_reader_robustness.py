"""The OBJ/MTL and NeRF readers on many generated files, from a fixed seed.

Files written from known values load as those values (positions as the float32 nearest to the
text, 1-based and negative indices as the zero-based ones they address, UVs with v flipped,
normals of unit length along the written direction). Damaged files (a token replaced by a
wrong one, a line dropped or added, a key of ``transforms.json`` given a wrong type or value)
either load with finite values and indices in range, or raise one ``ValueError`` line that
starts with the file it is about; never another exception.
"""

from __future__ import annotations

import json
import math
import random
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mptex.render import UndefinedMaterialWarning, load_obj
from mptex.scenes import load_nerf_split

_FORMS = ("{p}", "{p}/{t}", "{p}//{n}", "{p}/{t}/{n}")


def _number(rng: random.Random) -> float:
    """A coordinate of any size float32 holds, written with 7 significant digits."""
    return float(f"{rng.uniform(-1, 1):.6e}") * 10.0 ** rng.choice([0, 0, 0, -30, 20, 37])


def _reference(index: int, count: int) -> str:
    """An OBJ reference to zero-based ``index`` of ``count`` defined: 1-based or negative."""
    return str(index + 1) if index % 2 else str(index - count)


def _triangle_file(rng: random.Random) -> tuple[str, dict]:
    """An OBJ of random vertices, UVs, normals and triangles, and what it holds."""
    n_pos, n_tex, n_nrm = rng.randint(3, 9), rng.randint(1, 5), rng.randint(1, 5)
    form = rng.choice(_FORMS)
    pos = [[_number(rng) for _ in range(3)] for _ in range(n_pos)]
    tex = [[rng.uniform(-2, 2), rng.uniform(-2, 2)] for _ in range(n_tex)]
    nrm = [[_number(rng) for _ in range(3)] for _ in range(n_nrm)]
    for n in nrm:
        n[rng.randrange(3)] = rng.choice([-1.0, 1.0])  # never the zero vector
    lines = [f"v {x!r} {y!r} {z!r}" for x, y, z in pos]
    lines += [f"vt {u!r} {v!r}" for u, v in tex] + [f"vn {x!r} {y!r} {z!r}" for x, y, z in nrm]
    faces = []
    for _ in range(rng.randint(1, 6)):
        face = [(rng.randrange(n_pos), rng.randrange(n_tex), rng.randrange(n_nrm)) for _ in "abc"]
        faces.append(face)
        corners = [
            form.format(p=_reference(p, n_pos), t=_reference(t, n_tex), n=_reference(n, n_nrm))
            for p, t, n in face
        ]
        lines.append("f " + " ".join(corners))
    return "\n".join(lines) + "\n", {"pos": pos, "tex": tex, "nrm": nrm, "faces": faces,
                                     "form": form}  # fmt: skip


@pytest.mark.parametrize("seed", range(40))
def test_generated_triangle_files_load_as_written(tmp_path, seed):
    text, held = _triangle_file(random.Random(seed))
    (tmp_path / "t.obj").write_text(text)
    mesh = load_obj(tmp_path / "t.obj")
    # the float32 nearest to each written decimal, rounded by numpy from the float64 value
    assert mesh.v_pos.tolist() == np.float32(held["pos"]).tolist()
    assert mesh.t_pos_idx.tolist() == [[p for p, _, _ in face] for face in held["faces"]]
    if "{t}" in held["form"]:
        assert mesh.v_tex.tolist() == np.float32([[u, 1.0 - v] for u, v in held["tex"]]).tolist()
        assert mesh.t_tex_idx.tolist() == [[t for _, t, _ in face] for face in held["faces"]]
    else:
        assert mesh.v_tex is None and mesh.t_tex_idx is None
    if "{n}" in held["form"]:
        # the written direction, normalised in float64 (per element, not through torch)
        unit = [[c / math.sqrt(sum(d * d for d in n)) for c in n] for n in held["nrm"]]
        # one float32 ulp of a value below 1 (5.96e-8): the float32 rounding of a unit normal
        # computed in float64 from the written numbers
        torch.testing.assert_close(
            mesh.v_nrm, torch.tensor(unit, dtype=torch.float64).float(), rtol=0, atol=6e-8
        )
        assert mesh.t_nrm_idx.tolist() == [[n for _, _, n in face] for face in held["faces"]]
    else:
        assert torch.isfinite(mesh.v_nrm).all()
        norms = torch.linalg.norm(mesh.v_nrm.double(), dim=-1)
        torch.testing.assert_close(norms, torch.ones_like(norms), rtol=0, atol=1e-6)


_BAD_TOKENS = ["nan", "inf", "-inf", "1e39", "-4e38", "1e400", "", "x", "0", "-0", "99",
               "-99", "1/", "/1", "1//", "1/2/3/4", "//", "1.5", "2**3", "0x10", "\\",
               "99999999999999999999999", "#"]  # fmt: skip
_BAD_LINES = ["f 1 2", "f", "vt", "vn 1 2", "v 1 2", "usemtl", "usemtl nowhere", "mtllib",
              "mtllib none.mtl", "bogus 1", "\ufeffv 0 0 0", "f 1 1 1", "f 1 2 3 \\", "\x0c",
              "v 0 0 0 0 0 0", "f -1 -2 -3 -4 -5 -6 -7"]  # fmt: skip
_MTL = "newmtl red\nKd 1 0 0\nnewmtl tex\nmap_Kd t.png\nnewmtl broken\nmap_Kd -cc on t.png\n"
_BAD_MTL_LINES = ["Kd 1e39 0 0", "Kd nan 0 0", "Kd", "map_Kd", "map_Kd -s 1e39 t.png",
                  "map_Kd missing.png", "map_Kd notes.png", "newmtl",
                  "Kd spectral x.rfl"]  # fmt: skip


def _damage(rng: random.Random, lines: list[str], bad_lines: list[str]) -> list[str]:
    lines = list(lines)
    kind = rng.randrange(4)
    if kind == 0 and lines:
        i = rng.randrange(len(lines))
        tokens = lines[i].split()
        tokens[rng.randrange(len(tokens))] = rng.choice(_BAD_TOKENS)
        lines[i] = " ".join(tokens)
    elif kind == 1 and lines:
        del lines[rng.randrange(len(lines))]
    elif kind == 2:
        lines.insert(rng.randrange(len(lines) + 1), rng.choice(bad_lines))
    else:
        lines = lines[: rng.randrange(len(lines) + 1)]
    return lines


def _load_damaged_obj(folder: Path, seed: int) -> str:
    """Load a damaged OBJ + MTL pair made from ``seed``: "loaded" or "refused"."""
    rng = random.Random(seed)
    folder.mkdir()
    Image.new("RGB", (2, 2), (255, 0, 0)).save(folder / "t.png")
    (folder / "notes.png").write_text("not an image")
    text, _ = _triangle_file(rng)
    material = rng.choice(["red", "tex", "broken"])
    obj = ["mtllib m.mtl", f"usemtl {material}", *text.splitlines()]
    obj, mtl = _damage(rng, obj, _BAD_LINES), _MTL.splitlines()
    if rng.random() < 0.5:
        mtl = _damage(rng, mtl, _BAD_MTL_LINES)
    (folder / "m.mtl").write_text("\n".join(mtl) + "\n")
    (folder / "t.obj").write_text("\n".join(obj) + "\n")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UndefinedMaterialWarning)
            mesh = load_obj(folder / "t.obj")
    except ValueError as exc:
        message = str(exc)
        assert "\n" not in message, (seed, message)
        assert message.startswith((str(folder / "t.obj"), str(folder / "m.mtl"))), (seed, message)
        return "refused"
    v_pos, t_pos_idx = mesh.v_pos, mesh.t_pos_idx
    assert torch.isfinite(v_pos).all() and torch.isfinite(mesh.v_nrm).all(), seed
    assert 0 <= int(t_pos_idx.min()) and int(t_pos_idx.max()) < v_pos.shape[0], seed
    assert 0 <= int(mesh.t_nrm_idx.min()) and int(mesh.t_nrm_idx.max()) < mesh.v_nrm.shape[0]
    if mesh.v_tex is not None:
        assert torch.isfinite(mesh.v_tex).all(), seed
        assert 0 <= int(mesh.t_tex_idx.min()) and int(mesh.t_tex_idx.max()) < mesh.v_tex.shape[0]
    for m in mesh.materials or []:
        assert torch.isfinite(m.kd).all(), seed
        assert all(math.isfinite(x) for x in (*m.uv_scale, *m.uv_offset)), seed
    return "loaded"


def test_damaged_obj_and_mtl_files_load_or_fail_in_one_line_naming_the_file(tmp_path):
    outcomes = [_load_damaged_obj(tmp_path / str(seed), seed) for seed in range(200)]
    # (the damages are neither all refused nor all harmless: both outcomes are checked)
    assert 20 < outcomes.count("loaded") < 180


_IDENTITY_AT_4 = [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 4], [0, 0, 0, 1]]
_BAD_VALUES = [None, True, 0, -1, 7, 1e39, float("nan"), float("inf"), "x", "", [], {}, [1, 2],
               "./train/r_*", "./train/notes", "./train/grey", "./train/missing"]  # fmt: skip


def _replace_or_remove(rng: random.Random, mapping: dict, keys: list[str], value) -> None:
    """One of ``keys`` of ``mapping`` removed (one time in five) or set to ``value``."""
    key = rng.choice(keys)
    if rng.random() < 0.2:
        del mapping[key]
    else:
        mapping[key] = value


def _damage_transforms(rng: random.Random, meta: dict) -> dict:
    """``meta`` with one value (a top-level key, a frame, a frame's key or one matrix entry)
    replaced by a wrong one, or one key removed."""
    value = rng.choice(_BAD_VALUES)
    where = rng.randrange(5)
    frame = rng.choice(meta["frames"])
    if where == 0:
        _replace_or_remove(rng, meta, ["camera_angle_x", "frames"], value)
    elif where == 1:
        meta["frames"][rng.randrange(len(meta["frames"]))] = value
    elif where == 2:
        _replace_or_remove(rng, frame, ["file_path", "transform_matrix"], value)
    else:
        row = frame["transform_matrix"][rng.randrange(4)]
        row[rng.randrange(4)] = value
    return meta


def _load_damaged_transforms(folder: Path, seed: int) -> str:
    """Load a NeRF split whose transforms file ``seed`` damaged: "loaded" or "refused"."""
    rng = random.Random(seed)
    (folder / "train").mkdir(parents=True)
    for n in range(2):
        Image.new("RGBA", (8, 6), (128, 128, 128, 255)).save(folder / "train" / f"r_{n}.png")
    Image.new("L", (8, 6), 128).save(folder / "train" / "grey.png")
    (folder / "train" / "notes.png").write_text("not an image")
    frames = [{"file_path": f"./train/r_{n}", "transform_matrix": [list(r) for r in _IDENTITY_AT_4]}
              for n in range(2)]  # fmt: skip
    meta = _damage_transforms(rng, {"camera_angle_x": 0.69, "frames": frames})
    json_path = folder / "transforms_train.json"
    json_path.write_text(json.dumps(meta))
    try:
        cameras, rgba = load_nerf_split(folder, "train")
    except ValueError as exc:
        message = str(exc)
        assert "\n" not in message, (seed, message)
        assert message.startswith((str(json_path), str(folder / "train"))), (seed, message)
        return "refused"
    assert torch.isfinite(cameras.mv).all() and torch.isfinite(cameras.mvp).all(), seed
    assert torch.isfinite(rgba).all() and rgba.shape[1:] == (6, 8, 4), seed
    return "loaded"


def test_damaged_transforms_files_load_or_fail_in_one_line_naming_the_file(tmp_path):
    outcomes = [_load_damaged_transforms(tmp_path / str(seed), seed) for seed in range(120)]
    assert 5 < outcomes.count("loaded") < 115
