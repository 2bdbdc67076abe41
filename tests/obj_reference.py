"""The OBJ reader ``mptex.render.obj.load_obj`` as it was before its vectorised runs: the
oracle of tests/test_render_obj_fast.py (statements read and parsed one line at a time).

``load_obj``, ``_statements`` and ``_lines`` are copied unchanged; the helpers that the new
reader did not change (number and index parsing, triangulation, MTL reading) are imported.
"""

from __future__ import annotations

import codecs
import os
import warnings
from array import array
from collections.abc import Iterator
from pathlib import Path

import torch

from mptex.render.mesh import Mesh, vertex_normals
from mptex.render.obj import (
    UndefinedMaterialWarning,
    _find_file,
    _floats,
    _index,
    _load_mtl,
    _material,
    _rows,
    _triangulate,
)


def _statements(path: Path) -> Iterator[tuple[int, str]]:
    r"""The statements of an OBJ or MTL file, each with the number of its first line.

    The text is UTF-8, else Latin-1 (older exporters write material and file names in it),
    without a leading UTF-8 byte order mark (Windows editors write one); a file with NUL bytes
    is binary, not OBJ/MTL text.

    A line whose statement (its text before any ``#``) ends with ``\`` (spaces or tabs may
    follow it) continues on the next line, as in the OBJ specification's examples and as
    exporters such as Rhino write long faces: the ``\`` becomes a space and the next line is
    appended, again and again while they end so. A ``\`` anywhere else is kept (Windows paths
    in ``map_Kd`` and ``mtllib``), and so is one in a comment (a comment ends with its line).
    A continuation on the last line continues into nothing: the statement ends there.

    The statements come one at a time, the text's lines split a block at a time
    (:func:`_lines`): a reader holds the file's text once, not also a list of its lines and
    one of its statements (a 1M-face OBJ has some 1.5M lines: 116 MB of Python strings).
    """
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if b"\0" in data:
        raise ValueError(f"{path}: not a text file (NUL bytes): not a Wavefront OBJ/MTL file")
    data = data.removeprefix(codecs.BOM_UTF8)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = data.decode("latin-1")
    del data  # the text alone is read from here on
    pending: tuple[int, str] | None = None  # a statement continued on the next line
    for lineno, line in enumerate(_lines(text, _LINES_BLOCK), start=1):
        if pending is not None:
            lineno, line = pending[0], pending[1] + line
        statement = line.split("#", 1)[0].rstrip(" \t")
        if statement.endswith("\\"):
            pending = (lineno, statement[:-1] + " ")
        else:
            pending = None
            yield lineno, line
    if pending is not None:
        yield pending


# Characters per block of :func:`_lines`.
_LINES_BLOCK = 1 << 20


def _lines(text: str, block: int) -> Iterator[str]:
    r"""``text.splitlines()``, one line at a time: ``text`` is split by ``str.splitlines`` in
    blocks of at least ``block`` characters, each ending at a ``\n`` (the first one from its
    ``block``-th character on) or at the end of the text. Every block but the last ends with a
    line break, and no ``\r\n`` pair is cut in two: the lines are those of the whole text."""
    start = 0
    while start < len(text):
        end = text.find("\n", start + block - 1) + 1 or len(text)
        yield from text[start:end].splitlines()
        start = end


def load_obj_reference(path: str | os.PathLike) -> Mesh:
    r"""Read a Wavefront OBJ file with its MTL materials and diffuse textures.

    Supported: polygons (split into triangle fans; concave ones by ear clipping; one that
    intersects itself so that no ear is found is an error), negative (relative) indices,
    several materials (``usemtl`` switching; ``Mesh.materials`` and ``Mesh.t_mat_idx``), one
    or several ``mtllib`` files, faces with and without ``vt`` / ``vn`` in one file (faces
    without ``vt`` need a material without ``map_Kd``; faces without ``vn`` get area-weighted
    vertex normals), ``map_Kd`` options ``-s``, ``-o``, ``-clamp``, ``mtllib`` and ``map_Kd``
    file names with spaces, ``\`` separators or another letter case, UVs outside [0, 1]
    (the texture repeats unless ``-clamp on``), statements continued on the next line by a
    trailing ``\`` in OBJ and MTL files (see ``_statements``).

    Materials: ``Kd`` and ``map_Kd`` are sRGB in the files and linear in the mesh; a texture
    replaces ``Kd``; a material without ``Kd`` gets 0.8 grey (the MTL default), and so do
    faces before the first ``usemtl`` of a file that uses materials, and faces whose ``usemtl``
    names a material no MTL file defines (with one :class:`UndefinedMaterialWarning` per name,
    naming the file and line). Materials come in the
    order faces first use them; only used materials are loaded (a broken material that no
    face uses is no error). With exactly one material, ``kd`` / ``kd_texture`` are its; with
    none (no ``usemtl``), ``materials`` and ``kd`` are None.

    Args:
        path: the ``.obj`` file; ``mtllib`` and ``map_Kd`` paths are relative to its folder.

    Returns:
        A ``Mesh`` with normals always present (computed when the file has none). Faces
        without ``vt`` in a file with UVs get all three UV corners at one extra UV vertex
        (0, 0), so ``t_tex_idx`` covers every triangle.

    Raises:
        FileNotFoundError: when ``path`` does not exist.
        ValueError: for a malformed file or an unsupported feature, one line naming the file
            and the line.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"load_obj: no such file {path}")
    # Flat arrays of C numbers, not a Python list (and float or int object) per value: a
    # 1M-face file's faces and vertices held ~1 GB as lists, these ~70 MB.
    positions = array("d")  # x, y, z of each v
    texcoords = array("d")  # u, 1 - v of each vt
    normals = array("d")
    faces_pos = array("i")  # 3 indices per triangle
    faces_tex = array("i")  # 3 per triangle; -1: the face has no vt
    faces_nrm = array("i")  # 3 per triangle; -1: the face has no vn
    faces_mat = array("i")  # the index of the triangle's material in first_use
    library: dict[str, dict] = {}
    current: str | None = None
    first_use: dict[str | None, int] = {}  # material -> its index, in the order faces use them
    first_line: dict[str | None, int] = {}  # material -> line of its first face
    usemtl_at: dict[str, int] = {}  # material -> line of its first usemtl
    without_vt: dict[str | None, int] = {}  # material -> line of its first face without vt

    for lineno, raw in _statements(path):
        tokens = raw.split("#", 1)[0].split()
        if not tokens:
            continue
        key, args = tokens[0], tokens[1:]
        if key == "v":
            positions.extend(_floats(args, 3, path, lineno, "v"))
        elif key == "vt":
            u = _floats(args, 1, path, lineno, "vt")[0]
            v = _floats(args[1:], 1, path, lineno, "vt")[0] if len(args) > 1 else 0.0  # spec
            texcoords.extend((u, 1.0 - v))
        elif key == "vn":
            normals.extend(_floats(args, 3, path, lineno, "vn"))
        elif key == "f":
            if len(args) < 3:
                raise ValueError(f"{path}:{lineno}: a face needs at least 3 vertices")
            corners = []
            for token in args:
                parts = token.split("/")
                if len(parts) > 3 or parts[0] == "":
                    raise ValueError(f"{path}:{lineno}: malformed face vertex {token!r}")
                p = _index(parts[0], len(positions) // 3, path, lineno, "position")
                t = (
                    _index(parts[1], len(texcoords) // 2, path, lineno, "texcoord")
                    if (len(parts) > 1 and parts[1])
                    else None
                )
                n = (
                    _index(parts[2], len(normals) // 3, path, lineno, "normal")
                    if (len(parts) > 2 and parts[2])
                    else None
                )
                corners.append((p, t, n))
            tex_given = [c[1] is not None for c in corners]
            nrm_given = [c[2] is not None for c in corners]
            if any(tex_given) != all(tex_given) or any(nrm_given) != all(nrm_given):
                raise ValueError(
                    f"{path}:{lineno}: a face mixes corners with and without texcoords or normals"
                )
            if not all(tex_given):
                without_vt.setdefault(current, lineno)
            material = first_use.setdefault(current, len(first_use))
            first_line.setdefault(current, lineno)
            triangles = (
                [(0, 1, 2)]  # what _triangulate gives a triangle, without its corners' positions
                if len(corners) == 3
                else _triangulate([positions[3 * c[0] : 3 * c[0] + 3].tolist() for c in corners])
            )
            if triangles is None:
                raise ValueError(
                    f"{path}:{lineno}: a polygon of {len(corners)} vertices cannot be "
                    "triangulated (it intersects itself)"
                )
            for triangle in triangles:
                tri = [corners[i] for i in triangle]
                faces_pos.extend(c[0] for c in tri)
                faces_tex.extend(c[1] if tex_given[0] else -1 for c in tri)
                faces_nrm.extend(c[2] if nrm_given[0] else -1 for c in tri)
                faces_mat.append(material)
        elif key == "mtllib":
            if not args:
                raise ValueError(f"{path}:{lineno}: 'mtllib' needs a file name")
            # One file whose name may hold spaces, else several files (the spec allows both).
            rest = raw.split("#", 1)[0].split(None, 1)[1].strip()
            found = {rest: _find_file(path.parent, rest)}
            if found[rest] is None and len(args) > 1:
                several = {name: _find_file(path.parent, name) for name in args}
                if any(mtl_path is not None for mtl_path in several.values()):
                    found = several
            for name, mtl_path in found.items():
                if mtl_path is None:
                    raise ValueError(
                        f"{path}:{lineno}: material library {path.parent / name} does not exist"
                    )
                library.update(_load_mtl(mtl_path))
        elif key == "usemtl":
            if not args:
                raise ValueError(f"{path}:{lineno}: 'usemtl' needs a material name")
            current = " ".join(args)
            usemtl_at.setdefault(current, lineno)
        elif key in ("o", "g", "s", "l", "p", "vp"):
            continue  # groups, smoothing and non-triangle elements do not affect the mesh
        else:
            raise ValueError(f"{path}:{lineno}: unknown OBJ statement {key!r}")

    if not faces_pos:
        raise ValueError(f"{path}: no faces")
    for name in first_use:
        if name is not None and name not in library:
            # Exporters write such files (a material renamed in the scene but not in the MTL);
            # Blender and trimesh load the faces with a default material and warn. Judged once
            # every library is read: an mtllib may come after the usemtl that names it.
            warnings.warn(
                f"{path}:{usemtl_at[name]}: material {name!r} is not defined in the MTL files; "
                "its faces get the MTL default (Kd 0.8 grey)",
                UndefinedMaterialWarning,
                stacklevel=2,
            )
    for name, lineno in without_vt.items():
        if "map_kd" in library.get(name, {}):  # judged once every library is read, as above
            raise ValueError(
                f"{path}:{lineno}: face without texcoords (vt) uses material {name!r}, which "
                "has a map_Kd texture"
            )
    for name, lineno in first_line.items():
        if name is not None and "error" in library.get(name, {}):
            raise ValueError(f"{library[name]['error']} (material {name!r}, used at line {lineno})")
    # float64 rounded to float32 once, as torch.tensor(list of floats, dtype=float32) rounds
    v_pos = _rows(positions, 3).float()
    t_pos_idx = _rows(faces_pos, 3).clone()
    mesh = Mesh(v_pos=v_pos, t_pos_idx=t_pos_idx)
    t_tex_idx = _rows(faces_tex, 3)
    no_vt = t_tex_idx[:, 0] < 0
    if not no_vt.all():
        # Faces without vt (their material has no texture) get one extra UV vertex (0, 0).
        t_tex_idx = t_tex_idx.masked_fill(no_vt[:, None], len(texcoords) // 2)
        if no_vt.any():
            texcoords.extend((0.0, 0.0))
        mesh.v_tex = _rows(texcoords, 2).float()
        mesh.t_tex_idx = t_tex_idx
    computed = vertex_normals(v_pos, t_pos_idx)
    t_nrm_idx = _rows(faces_nrm, 3)
    no_vn = t_nrm_idx[:, 0] < 0
    if no_vn.all():
        mesh.v_nrm, mesh.t_nrm_idx = computed, t_pos_idx.clone()
    else:
        # Faces without vn use the area-weighted vertex normals, appended after the file's.
        v_nrm = _rows(normals, 3).float()
        length = torch.linalg.norm(v_nrm, dim=-1, keepdim=True)
        v_nrm = v_nrm / length.clamp_min(1e-20)
        # A float32 length whose square lies outside float32's normal range (components of
        # 1e20 overflow it, of 1e-23 vanish in it) left such a normal zero or not of unit
        # length: those normals are divided by their largest component and normalised in
        # float64 instead. The others keep their float32 bits (the meshes' shading, and so
        # the training results of runs on them, stay what they were).
        extreme = ((length < 1e-18) | ~(length <= 1e18)).squeeze(-1)
        if extreme.any():
            wide = _rows(normals, 3)[extreme]
            wide = wide / wide.abs().amax(dim=-1, keepdim=True).clamp_min(1e-300)
            wide = wide / torch.linalg.norm(wide, dim=-1, keepdim=True).clamp_min(1e-300)
            v_nrm[extreme] = wide.float()
        mesh.v_nrm = torch.cat([v_nrm, computed]) if no_vn.any() else v_nrm
        offset = len(normals) // 3
        mesh.t_nrm_idx = torch.where(no_vn[:, None], t_pos_idx + offset, t_nrm_idx)

    if any(name is not None for name in first_use):
        textures: dict[Path, torch.Tensor] = {}
        mesh.materials = [_material(n, library.get(n, {}), textures) for n in first_use]
        mesh.t_mat_idx = _rows(faces_mat, 1).view(-1).clone()
        if len(mesh.materials) == 1:
            mesh.kd, mesh.kd_texture = mesh.materials[0].kd, mesh.materials[0].kd_texture
    return mesh
