"""Triangle meshes: the ``Mesh`` container and a small Wavefront OBJ/MTL reader and writer.

Conventions follow nvdiffrec's ``render/obj.py``: polygons are split into triangle fans, the
OBJ ``v`` texture coordinate is flipped (``v -> 1 - v``) so that UV (0, 0) addresses row 0 of
the texture tensor (nvdiffrast's convention), the diffuse texture (``map_Kd``) and ``Kd`` are
stored in linear RGB (files hold sRGB), and missing normals are computed as area-weighted vertex
normals. Only one material per mesh is supported: the first one a face uses.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch

from mptex.render.image import load_image, rgb_to_srgb, save_image, srgb_to_rgb

__all__ = ["Mesh", "load_obj", "write_obj", "vertex_normals", "unit_size"]


@dataclass
class Mesh:
    """A triangle mesh with optional UVs, normals and a diffuse texture.

    Attributes:
        v_pos: [V, 3] float32 vertex positions.
        t_pos_idx: [T, 3] int32 position indices per triangle.
        v_tex: [Vt, 2] float32 UVs (v = 0 is texture row 0), or None.
        t_tex_idx: [T, 3] int32 UV indices, or None.
        v_nrm: [Vn, 3] float32 unit normals, or None.
        t_nrm_idx: [T, 3] int32 normal indices, or None.
        kd_texture: [H, W, 3] float32 linear-RGB diffuse texture, or None.
        kd: [3] float32 linear-RGB diffuse colour (used when there is no texture), or None.
    """

    v_pos: torch.Tensor
    t_pos_idx: torch.Tensor
    v_tex: torch.Tensor | None = None
    t_tex_idx: torch.Tensor | None = None
    v_nrm: torch.Tensor | None = None
    t_nrm_idx: torch.Tensor | None = None
    kd_texture: torch.Tensor | None = None
    kd: torch.Tensor | None = None

    def to(self, device) -> Mesh:
        """A copy with every tensor on ``device``."""
        moved = {
            f.name: (None if getattr(self, f.name) is None else getattr(self, f.name).to(device))
            for f in fields(self)
        }
        return Mesh(**moved)

    @property
    def aabb(self) -> torch.Tensor:
        """[2, 3] float32: per-axis minimum and maximum of the vertex positions."""
        return torch.stack([self.v_pos.amin(dim=0), self.v_pos.amax(dim=0)])


def vertex_normals(v_pos: torch.Tensor, t_pos_idx: torch.Tensor) -> torch.Tensor:
    """Area-weighted vertex normals.

    Args:
        v_pos: [V, 3] float32 positions.
        t_pos_idx: [T, 3] int32 indices.

    Returns:
        [V, 3] float32 unit normals (a vertex used by no triangle gets (0, 0, 1)).
    """
    idx = t_pos_idx.long()
    p0, p1, p2 = v_pos[idx[:, 0]], v_pos[idx[:, 1]], v_pos[idx[:, 2]]
    # The cross product's length is twice the area: summing it weights faces by area.
    face = torch.linalg.cross(p1 - p0, p2 - p0)
    acc = torch.zeros_like(v_pos)
    for k in range(3):
        acc.index_add_(0, idx[:, k], face)
    length = torch.linalg.norm(acc, dim=-1, keepdim=True)
    fallback = torch.tensor([0.0, 0.0, 1.0], dtype=v_pos.dtype, device=v_pos.device)
    return torch.where(length > 0, acc / length.clamp_min(1e-20), fallback)


def unit_size(mesh: Mesh) -> Mesh:
    """Centre the mesh's AABB at the origin and scale its longest side to 2 (fits [-1, 1]^3)."""
    lo, hi = mesh.aabb
    scale = 2.0 / float((hi - lo).max())
    return replace(mesh, v_pos=(mesh.v_pos - (lo + hi) / 2) * scale)


# ---------------------------------------------------------------------------------------------
# OBJ / MTL reading
# ---------------------------------------------------------------------------------------------


def _floats(tokens: list[str], count: int, path: Path, lineno: int, what: str) -> list[float]:
    if len(tokens) < count:
        raise ValueError(f"{path}:{lineno}: '{what}' needs {count} numbers, found {len(tokens)}")
    try:
        values = [float(t) for t in tokens[:count]]
    except ValueError as exc:
        raise ValueError(f"{path}:{lineno}: '{what}' has a non-numeric value: {exc}") from exc
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"{path}:{lineno}: '{what}' has a non-finite value: {tokens[:count]}")
    return values


def _text_lines(path: Path) -> list[str]:
    """The lines of an OBJ or MTL file: UTF-8, else Latin-1 (older exporters write material and
    file names in it); a file with NUL bytes is binary, not OBJ/MTL text."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if b"\0" in data:
        raise ValueError(f"{path}: not a text file (NUL bytes): not a Wavefront OBJ/MTL file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = data.decode("latin-1")
    return text.splitlines()


def _index(token: str, n_defined: int, path: Path, lineno: int, what: str) -> int:
    try:
        i = int(token)
    except ValueError as exc:
        raise ValueError(f"{path}:{lineno}: bad {what} index {token!r}") from exc
    # OBJ indices are 1-based; negative ones count back from the last defined element.
    i = i - 1 if i > 0 else n_defined + i
    if not 0 <= i < n_defined or token in ("0", "-0"):
        raise ValueError(
            f"{path}:{lineno}: {what} index {token} out of range (1..{n_defined} defined so far)"
        )
    return i


def _load_mtl(path: Path) -> dict[str, dict]:
    materials: dict[str, dict] = {}
    current = None
    for lineno, raw in enumerate(_text_lines(path), start=1):
        tokens = raw.split("#", 1)[0].split()
        if not tokens:
            continue
        key, args = tokens[0], tokens[1:]
        if key == "newmtl":
            if not args:
                raise ValueError(f"{path}:{lineno}: 'newmtl' needs a name")
            current = materials.setdefault(args[0], {})
        elif current is None:
            continue
        elif key == "Kd":
            current["kd"] = _floats(args, 3, path, lineno, "Kd")
        elif key == "map_Kd":
            if not args:
                raise ValueError(f"{path}:{lineno}: 'map_Kd' needs a file name")
            # Options such as "-s 1 1 1" come first; the file name is the last token.
            texture_path = path.parent / args[-1]
            if not texture_path.is_file():
                raise ValueError(f"{path}:{lineno}: map_Kd texture {texture_path} does not exist")
            current["map_kd"] = texture_path
    return materials


def load_obj(path: str | os.PathLike) -> Mesh:
    """Read a Wavefront OBJ file with its MTL material and diffuse texture.

    Args:
        path: the ``.obj`` file; ``mtllib`` and ``map_Kd`` paths are relative to its folder.

    Returns:
        A ``Mesh`` with normals always present (computed when the file has none).

    Raises:
        FileNotFoundError: when ``path`` does not exist.
        ValueError: for a malformed file, naming the file and the line.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"load_obj: no such file {path}")
    positions: list[list[float]] = []
    texcoords: list[list[float]] = []
    normals: list[list[float]] = []
    faces_pos: list[list[int]] = []
    faces_tex: list[list[int]] = []
    faces_nrm: list[list[int]] = []
    materials: dict[str, dict] = {}
    used_materials: list[str] = []
    has_tex = has_nrm = None

    for lineno, raw in enumerate(_text_lines(path), start=1):
        tokens = raw.split("#", 1)[0].split()
        if not tokens:
            continue
        key, args = tokens[0], tokens[1:]
        if key == "v":
            positions.append(_floats(args, 3, path, lineno, "v"))
        elif key == "vt":
            u, v = _floats(args, 2, path, lineno, "vt")
            texcoords.append([u, 1.0 - v])
        elif key == "vn":
            normals.append(_floats(args, 3, path, lineno, "vn"))
        elif key == "f":
            if len(args) < 3:
                raise ValueError(f"{path}:{lineno}: a face needs at least 3 vertices")
            corners = []
            for token in args:
                parts = token.split("/")
                if len(parts) > 3 or parts[0] == "":
                    raise ValueError(f"{path}:{lineno}: malformed face vertex {token!r}")
                p = _index(parts[0], len(positions), path, lineno, "position")
                t = (
                    _index(parts[1], len(texcoords), path, lineno, "texcoord")
                    if (len(parts) > 1 and parts[1])
                    else None
                )
                n = (
                    _index(parts[2], len(normals), path, lineno, "normal")
                    if (len(parts) > 2 and parts[2])
                    else None
                )
                corners.append((p, t, n))
            tex_given = [c[1] is not None for c in corners]
            nrm_given = [c[2] is not None for c in corners]
            face_tex, face_nrm = all(tex_given), all(nrm_given)
            consistent = face_tex == any(tex_given) and face_nrm == any(nrm_given)
            if has_tex is None and consistent:
                has_tex, has_nrm = face_tex, face_nrm
            elif not consistent or face_tex != has_tex or face_nrm != has_nrm:
                raise ValueError(
                    f"{path}:{lineno}: faces mix vertex formats (with and without texcoords "
                    "or normals); use one format for the whole mesh"
                )
            for k in range(1, len(corners) - 1):  # triangle fan around the first corner
                tri = (corners[0], corners[k], corners[k + 1])
                faces_pos.append([c[0] for c in tri])
                if has_tex:
                    faces_tex.append([c[1] for c in tri])
                if has_nrm:
                    faces_nrm.append([c[2] for c in tri])
        elif key == "mtllib":
            if not args:
                raise ValueError(f"{path}:{lineno}: 'mtllib' needs a file name")
            mtl_path = path.parent / " ".join(args)
            if not mtl_path.is_file():
                raise ValueError(f"{path}:{lineno}: material library {mtl_path} does not exist")
            materials.update(_load_mtl(mtl_path))
        elif key == "usemtl":
            if not args:
                raise ValueError(f"{path}:{lineno}: 'usemtl' needs a material name")
            if args[0] not in materials:
                raise ValueError(f"{path}:{lineno}: material {args[0]!r} is not defined")
            if args[0] not in used_materials:
                used_materials.append(args[0])
        elif key in ("o", "g", "s", "l", "p", "vp"):
            continue  # groups, smoothing and non-triangle elements do not affect the mesh
        else:
            raise ValueError(f"{path}:{lineno}: unknown OBJ statement {key!r}")

    if not faces_pos:
        raise ValueError(f"{path}: no faces")
    v_pos = torch.tensor(positions, dtype=torch.float32)
    t_pos_idx = torch.tensor(faces_pos, dtype=torch.int32)
    mesh = Mesh(v_pos=v_pos, t_pos_idx=t_pos_idx)
    if has_tex:
        mesh.v_tex = torch.tensor(texcoords, dtype=torch.float32)
        mesh.t_tex_idx = torch.tensor(faces_tex, dtype=torch.int32)
    if has_nrm:
        v_nrm = torch.tensor(normals, dtype=torch.float32)
        mesh.v_nrm = v_nrm / torch.linalg.norm(v_nrm, dim=-1, keepdim=True).clamp_min(1e-20)
        mesh.t_nrm_idx = torch.tensor(faces_nrm, dtype=torch.int32)
    else:
        mesh.v_nrm = vertex_normals(v_pos, t_pos_idx)
        mesh.t_nrm_idx = t_pos_idx.clone()

    if used_materials:
        if len(used_materials) > 1:
            warnings.warn(
                f"{path}: {len(used_materials)} materials used; only {used_materials[0]!r} "
                "is loaded",
                stacklevel=2,
            )
        material = materials[used_materials[0]]
        if "kd" in material:
            mesh.kd = srgb_to_rgb(torch.tensor(material["kd"], dtype=torch.float32))
        if "map_kd" in material:
            try:
                image = load_image(material["map_kd"], to_linear=True)
            except (OSError, RuntimeError) as exc:
                raise ValueError(
                    f"{material['map_kd']}: map_Kd texture of {path} cannot be read as an image "
                    f"({' '.join(str(exc.__cause__ or exc).split())[:200]})"
                ) from None
            if image.shape[-1] in (1, 2):  # grey (+ alpha): the same value in R, G and B
                # (load_image converts only RGB/RGBA from sRGB; convert the grey value here)
                image = srgb_to_rgb(image[..., :1].expand(*image.shape[:-1], 3))
            mesh.kd_texture = image[..., :3].contiguous()
    return mesh


# ---------------------------------------------------------------------------------------------
# OBJ writing
# ---------------------------------------------------------------------------------------------


def write_obj(path: str | os.PathLike, mesh: Mesh) -> None:
    """Write ``mesh`` as OBJ (+ ``<name>.mtl`` and ``<name>_kd.png`` when it has a material).

    The inverse of ``load_obj`` up to float formatting (9 significant digits, enough to
    reproduce float32 exactly) and 8-bit quantisation of the texture.
    """
    path = Path(path)
    lines = []
    has_material = mesh.kd is not None or mesh.kd_texture is not None
    if has_material:
        mtl_path = path.with_suffix(".mtl")
        mtl = ["newmtl material0"]
        kd = mesh.kd if mesh.kd is not None else torch.ones(3)
        mtl.append("Kd " + " ".join(f"{x:.9g}" for x in rgb_to_srgb(kd.cpu()).tolist()))
        if mesh.kd_texture is not None:
            tex_name = f"{path.stem}_kd.png"
            save_image(path.parent / tex_name, mesh.kd_texture, to_srgb=True)
            mtl.append(f"map_Kd {tex_name}")
        mtl_path.write_text("\n".join(mtl) + "\n")
        lines += [f"mtllib {mtl_path.name}", "usemtl material0"]
    lines += [f"v {x:.9g} {y:.9g} {z:.9g}" for x, y, z in mesh.v_pos.tolist()]
    if mesh.v_tex is not None:
        lines += [f"vt {u:.9g} {1.0 - v:.9g}" for u, v in mesh.v_tex.tolist()]
    if mesh.v_nrm is not None:
        lines += [f"vn {x:.9g} {y:.9g} {z:.9g}" for x, y, z in mesh.v_nrm.tolist()]
    pos_i = mesh.t_pos_idx.tolist()
    tex_i = mesh.t_tex_idx.tolist() if mesh.t_tex_idx is not None else None
    nrm_i = mesh.t_nrm_idx.tolist() if mesh.t_nrm_idx is not None else None
    for f in range(len(pos_i)):
        corners = []
        for k in range(3):
            p = str(pos_i[f][k] + 1)
            t = str(tex_i[f][k] + 1) if tex_i is not None else ""
            n = str(nrm_i[f][k] + 1) if nrm_i is not None else ""
            corners.append(p + (f"/{t}" if t or n else "") + (f"/{n}" if n else ""))
        lines.append("f " + " ".join(corners))
    path.write_text("\n".join(lines) + "\n")
