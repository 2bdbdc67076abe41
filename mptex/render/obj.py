"""A Wavefront OBJ/MTL reader and writer for :class:`~mptex.render.mesh.Mesh`.

Conventions follow nvdiffrec's ``render/obj.py``: polygons are split into triangle fans
(concave ones, whose fan would leave the polygon, by ear clipping), the OBJ ``v`` texture
coordinate is flipped (``v -> 1 - v``) so that UV (0, 0) addresses row 0 of the texture tensor
(nvdiffrast's convention), the diffuse texture (``map_Kd``) and ``Kd`` are stored in linear RGB
(files hold sRGB), and missing normals are computed as area-weighted vertex normals.
"""

from __future__ import annotations

import codecs
import heapq
import itertools
import math
import os
import re
import warnings
from array import array
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from mptex.render.image import load_image, rgb_to_srgb, save_image, srgb_to_rgb
from mptex.render.material import mesh_materials
from mptex.render.mesh import DEFAULT_KD_SRGB, Material, Mesh, vertex_normals

__all__ = ["load_obj", "write_obj", "UndefinedMaterialWarning"]


class UndefinedMaterialWarning(UserWarning):
    """A face names a material its MTL files do not define (it gets the MTL default)."""


# The mesh holds float32: a larger magnitude, finite as Python's float64, would become inf.
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _finite_float32(values: list[float], where: str, tokens: list[str]) -> None:
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"{where} has a non-finite value: {tokens}")
    if not all(abs(v) <= _FLOAT32_MAX for v in values):
        raise ValueError(
            f"{where} has a value beyond float32's range (|x| <= {_FLOAT32_MAX:.6g}): {tokens}"
        )


def _floats(tokens: list[str], count: int, path: Path, lineno: int, what: str) -> list[float]:
    if len(tokens) < count:
        raise ValueError(f"{path}:{lineno}: '{what}' needs {count} numbers, found {len(tokens)}")
    try:
        values = [float(t) for t in tokens[:count]]
    except ValueError as exc:
        raise ValueError(f"{path}:{lineno}: '{what}' has a non-numeric value: {exc}") from exc
    _finite_float32(values, f"{path}:{lineno}: '{what}'", tokens[:count])
    return values


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
    (:func:`_pieces`): a reader holds the file's text once, not also a list of its lines and
    one of its statements (a 1M-face OBJ has some 1.5M lines: 116 MB of Python strings).
    """
    for lineno, statement, _ in _pieces(_read_text(path), None):
        yield lineno, statement


def _read_text(path: Path) -> str:
    """The text of an OBJ or MTL file, as :func:`_statements` states it."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if b"\0" in data:
        raise ValueError(f"{path}: not a text file (NUL bytes): not a Wavefront OBJ/MTL file")
    data = data.removeprefix(codecs.BOM_UTF8)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("latin-1")


def _pieces(text: str, runs: re.Pattern | None) -> Iterator[tuple[int, str, str | None]]:
    """The statements of ``text`` (see :func:`_statements`) as ``(lineno, statement, None)``,
    except that each match of ``runs`` (whole lines, each ending with a line break, none of
    them continued from the line before) comes whole as ``(lineno of its first line, its text,
    the name of its group)``. The matches are looked for a block of :func:`_blocks_of` at a
    time."""
    lineno = 1
    pending: tuple[int, str] | None = None  # a statement continued on the next line

    def statements(lines: str) -> Iterator[tuple[int, str, None]]:
        nonlocal lineno, pending
        for line in lines.splitlines():
            start = lineno
            lineno += 1
            if pending is not None:
                start, line = pending[0], pending[1] + line
            statement = line.split("#", 1)[0].rstrip(" \t")
            if statement.endswith("\\"):
                pending = (start, statement[:-1] + " ")
            else:
                pending = None
                yield start, line, None

    for block in _blocks_of(text, _LINES_BLOCK):
        done = 0  # where the block's text not yet given starts
        for match in runs.finditer(block) if runs is not None else ():
            yield from statements(block[done : match.start()])
            done = match.start()
            if pending is None:  # else its first line continues a statement: not a run
                yield lineno, match.group(), match.lastgroup
                lineno += match.group().count("\n")
                done = match.end()
        yield from statements(block[done:])
    if pending is not None:
        yield (*pending, None)


# Characters per block of :func:`_blocks_of`.
_LINES_BLOCK = 1 << 20


def _blocks_of(text: str, block: int) -> Iterator[str]:
    r"""``text`` in blocks of at least ``block`` characters, each ending at a ``\n`` (the first
    one from its ``block``-th character on) or at the end of the text. Every block but the last
    ends with a line break, and no ``\r\n`` pair is cut in two: the blocks' ``splitlines()``,
    one after the other, are the whole text's."""
    start = 0
    while start < len(text):
        end = text.find("\n", start + block - 1) + 1 or len(text)
        yield text[start:end]
        start = end


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


def _triangulate(points: list[list[float]]) -> list[tuple[int, int, int]] | None:
    """Triangles (corner indices, the polygon's winding kept) covering a planar polygon.

    In this order:

    1. Three corners: the triangle (0, 1, 2).
    2. The Newell normal ``N`` of the polygon (twice its vector area, robust for non-planar
       polygons) is zero (no area): the fan around corner 0, ``(0, k, k + 1)``.
    3. Every fan triangle turns the polygon's way: its ``turn`` (twice its area along ``N``,
       see below) is at least ``-eps``, ``eps = 1e-9 * |N|``. This holds for every convex
       polygon and for concave ones star-shaped from corner 0: the fan (as nvdiffrec and
       most readers split polygons).
    4. Otherwise (a concave polygon, e.g. an L-shaped hexagon, whose fan would cover area
       outside it) ear clipping in the polygon's plane. Of the remaining corners, in index
       order and cyclic, corner ``b`` between ``a`` and ``c`` is an ear when
       ``turn(a, b, c) > eps`` and no other remaining corner ``q``, except those at the
       position of ``a``, ``b`` or ``c``, lies in the triangle or within ``eps`` of it
       (``turn(a, b, q)``, ``turn(b, c, q)`` and ``turn(c, a, q)`` all ``>= -eps``). The
       ear with the lowest index is cut off as ``(a, b, c)``, and again, until three
       corners remain: they are the last triangle, in index order. When no corner is an
       ear, the lowest-index corner that is flat (``|turn(a, b, c)| <= eps``: on the line
       between its neighbours, a duplicate, a spike) is dropped without a triangle; when
       none is flat either, there is no triangulation.

    ``turn(a, b, c) = N . ((p_b - p_a) x (p_c - p_a)) / |N|``, in float64 in this order of
    operations. Ear clipping keeps each corner's verdict and judges a corner again only when
    one of its neighbours is cut (any other cut only removes a candidate blocker) or the
    corner that blocked it is cut (its search resumes after that corner); blockers are looked
    for only in the boxes of a k-d tree that :func:`_blocker_search` proves may hold one, not
    among all corners and not only among the reflex ones (a polygon that intersects itself
    or touches itself within ``eps`` can have a convex blocker). The triangles are exactly
    those of the straightforward version, which rescans every corner after each cut (cubic in
    the number of corners at worst); for star-shaped and spiral polygons of ``n`` corners
    this one reads about ``20 * n**1.5`` corners, that one ``6 * n**2``.

    Returns:
        the triangles, or None when ear clipping finds neither an ear nor a flat corner (some
        self-intersecting polygons; others get triangles that cover them in some way).
        A corner on the straight line between its neighbours may be left out of them.
    """
    n = len(points)
    fan = [(0, k, k + 1) for k in range(1, n - 1)]
    if n == 3:
        return fan
    # Newell's normal: twice the polygon's vector area, robust for non-planar polygons.
    nx = ny = nz = 0.0
    for k in range(n):
        (x0, y0, z0), (x1, y1, z1) = points[k], points[(k + 1) % n]
        nx += (y0 - y1) * (z0 + z1)
        ny += (z0 - z1) * (x0 + x1)
        nz += (x0 - x1) * (y0 + y1)
    area2 = math.sqrt(nx * nx + ny * ny + nz * nz)
    if area2 == 0.0:
        return fan
    eps = 1e-9 * area2  # relative: a fan triangle this small counts as flat, not turned back

    def turn(a: int, b: int, c: int) -> float:  # twice the area of (a, b, c) along the normal
        pa, pb, pc = points[a], points[b], points[c]
        u = (pb[0] - pa[0], pb[1] - pa[1], pb[2] - pa[2])
        v = (pc[0] - pa[0], pc[1] - pa[1], pc[2] - pa[2])
        return (
            nx * (u[1] * v[2] - u[2] * v[1])
            + ny * (u[2] * v[0] - u[0] * v[2])
            + nz * (u[0] * v[1] - u[1] * v[0])
        ) / area2

    if all(turn(*t) >= -eps for t in fan):
        return fan
    return _clip_ears(points, turn, eps, *_blocker_search(points, (nx, ny, nz), area2, eps))


def _clip_ears(points, turn, eps, near, forget) -> list[tuple[int, int, int]] | None:
    """Ear clipping as :func:`_triangulate` states it (step 4). ``near(a, b, c)`` gives the
    corners that may block the ear ``b`` (a superset of the blockers, cut ones among them),
    ``forget(q)`` is told of each corner cut."""
    n = len(points)
    prev = [n - 1, *range(n - 1)]  # the remaining corners: a cyclic list in index order
    after = [*range(1, n), 0]
    alive = [True] * n
    corner_turn = [0.0] * n  # turn(prev, b, after) for b's current neighbours
    version = [0] * n  # bumped when b's neighbours change: its older verdicts are void
    searches: list = [None] * n  # b's pending search for blockers (convex corners only)
    waiting: dict[int, list[tuple[int, int]]] = {}  # blocker -> the (corner, version) it blocks
    ears: list[tuple[int, int]] = []  # a heap of (corner, version): the lowest index first

    def blockers(a: int, b: int, c: int):
        # For fixed neighbours the test of each q is fixed and cuts only remove candidates:
        # a search paused at a blocker resumes after it once that blocker is cut.
        corners = (points[a], points[b], points[c])
        for q in near(a, b, c):
            if (
                alive[q]
                and q not in (a, b, c)
                and points[q] not in corners
                and turn(a, b, q) >= -eps
                and turn(b, c, q) >= -eps
                and turn(c, a, q) >= -eps
            ):
                yield q

    def resume(b: int) -> None:
        blocker = next(searches[b], None)
        if blocker is None:
            heapq.heappush(ears, (b, version[b]))
        else:
            waiting.setdefault(blocker, []).append((b, version[b]))

    def judge(b: int) -> None:
        version[b] += 1
        a, c = prev[b], after[b]
        corner_turn[b] = t = turn(a, b, c)
        searches[b] = blockers(a, b, c) if t > eps else None
        if searches[b] is not None:
            resume(b)

    def cut(b: int) -> None:
        alive[b] = False
        forget(b)
        a, c = prev[b], after[b]
        after[a], prev[c] = c, a
        judge(a)
        judge(c)
        for corner, seen in waiting.pop(b, ()):
            if alive[corner] and version[corner] == seen:
                resume(corner)

    for b in range(n):
        judge(b)
    triangles = []
    for _ in range(n - 3):  # each pass cuts or drops one corner
        while ears and not (alive[ears[0][0]] and version[ears[0][0]] == ears[0][1]):
            heapq.heappop(ears)
        if ears:
            b = heapq.heappop(ears)[0]
            triangles.append((prev[b], b, after[b]))
        else:
            flat = [b for b in range(n) if alive[b] and abs(corner_turn[b]) <= eps]
            if not flat:
                return None
            b = flat[0]
        cut(b)
    triangles.append(tuple(b for b in range(n) if alive[b]))
    return triangles


def _blocker_search(points: list[list[float]], normal, area2: float, eps: float):
    """``near(a, b, c)``, ``forget(q)``: the corners in the boxes of a k-d tree over the corners
    that may hold a blocker of the ear ``(a, b, c)`` (see :func:`_triangulate`), and the
    bookkeeping that skips boxes whose corners are all cut.

    Why no box that is skipped holds a blocker. The exact value of ``turn(s, e, q)`` for the
    float inputs is affine in ``q``: ``w . (p_q - p_s)``, ``w = N x (p_e - p_s) / |N|``; its
    largest value over a box is the sum over the axes of the larger of its two ends. A computed
    turn differs from the exact one by less than ``28 * 2**-53 * |p_e - p_s| * |p_q - p_s|``
    (the rounding of 3 subtractions, 9 products, 5 sums and a division), and that largest
    value, computed, by less than ``60 * 2**-53 * |p_e - p_s| * diagonal`` (``w``'s rounding,
    which may also pick the other end where ``w`` is about 0, 3 products, 2 sums); both are below
    ``err = 1e-12 * diagonal**2`` (the polygon's bounding box diagonal) with room to spare. A
    box whose computed largest value of one of the three turns is below ``-eps - 2 * err``
    holds no corner whose computed turns are all ``>= -eps``. Where ``|N| * diagonal**2`` is
    below 1e-250 the products may underflow, and no box is skipped but the cut ones.
    """
    n = len(points)
    lows = [min(p[k] for p in points) for k in range(3)]
    highs = [max(p[k] for p in points) for k in range(3)]
    diagonal = math.sqrt(sum((hi - lo) ** 2 for lo, hi in zip(lows, highs)))
    underflow = not area2 * diagonal * diagonal >= 1e-250  # see above
    limit = -math.inf if underflow else -eps - 2e-12 * diagonal * diagonal
    nx, ny, nz = normal
    # The tree: node -> its box, its parent, its children and (leaves) its corners; each
    # corner's leaf, for the count of corners not yet cut in each box.
    boxes: list[tuple[float, ...]] = []  # low x, y, z, high x, y, z
    parent: list[int] = []
    kids: list[list[int]] = []
    members: list[list[int]] = []
    uncut: list[int] = []
    leaf_of = [0] * n
    stack = [(list(range(n)), -1)]
    while stack:
        corners, up = stack.pop()
        node = len(boxes)
        box_lo = [min(points[q][k] for q in corners) for k in range(3)]
        box_hi = [max(points[q][k] for q in corners) for k in range(3)]
        boxes.append((*box_lo, *box_hi))
        parent.append(up)
        kids.append([])
        uncut.append(len(corners))
        if up >= 0:
            kids[up].append(node)
        if len(corners) <= 8:
            members.append(corners)
            for q in corners:
                leaf_of[q] = node
            continue
        members.append([])
        axis = max(range(3), key=lambda k: box_hi[k] - box_lo[k])
        corners = sorted(corners, key=lambda q: points[q][axis])
        half = len(corners) // 2
        stack.append((corners[half:], node))
        stack.append((corners[:half], node))

    def near(a: int, b: int, c: int):
        edges = []
        for start, end in ((a, b), (b, c), (c, a)):
            ps, pe = points[start], points[end]
            u0, u1, u2 = pe[0] - ps[0], pe[1] - ps[1], pe[2] - ps[2]
            w0, w1, w2 = (
                (ny * u2 - nz * u1) / area2,
                (nz * u0 - nx * u2) / area2,
                (nx * u1 - ny * u0) / area2,
            )
            # The box end where each term is largest: the high one for w >= 0 (a float
            # difference is monotone, so this is the larger of the two computed terms too).
            ends = (3 if w0 >= 0 else 0, 4 if w1 >= 0 else 1, 5 if w2 >= 0 else 2)
            edges.append((w0, w1, w2, ps[0], ps[1], ps[2], *ends))
        todo = [0]
        while todo:
            node = todo.pop()
            if not uncut[node]:
                continue
            box = boxes[node]
            for w0, w1, w2, sx, sy, sz, i0, i1, i2 in edges:
                if w0 * (box[i0] - sx) + w1 * (box[i1] - sy) + w2 * (box[i2] - sz) < limit:
                    break
            else:
                if kids[node]:
                    todo.extend(kids[node])
                else:
                    yield from members[node]

    def forget(q: int) -> None:
        node = leaf_of[q]
        while node >= 0:
            uncut[node] -= 1
            node = parent[node]

    return near, forget


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


# map_Kd options (MTL spec) -> how many arguments they take. -s, -o and -clamp change where
# the texture is sampled and are applied; -bm, -boost, -texres, -blendu and -blendv only tune
# bump maps, mip-mapping or resolution and are accepted and ignored; the others would change
# the colours in ways not implemented and are refused unless they are at their no-op value.
_MAP_OPTIONS = {
    "-s": 3, "-o": 3, "-t": 3, "-clamp": 1, "-blendu": 1, "-blendv": 1, "-cc": 1,
    "-mm": 2, "-bm": 1, "-boost": 1, "-texres": 1, "-imfchan": 1, "-type": 1,
}  # fmt: skip


def _parse_map_kd(text: str, path: Path, lineno: int) -> dict:
    """The options and file name of a ``map_Kd`` line (``text``: the line after ``map_Kd``).

    The file name is the rest of the line after the options, so names with spaces work.

    Returns:
        dict with ``name`` (str), ``uv_scale`` and ``uv_offset`` ((u, v) floats), ``clamp``.
    """
    words = [(m.group(), m.start()) for m in re.finditer(r"\S+", text)]
    where = f"{path}:{lineno}: map_Kd"
    out = {"uv_scale": (1.0, 1.0), "uv_offset": (0.0, 0.0), "clamp": False}
    i = 0
    while i < len(words) - 1 and words[i][0].startswith("-") and not _is_number(words[i][0]):
        option = words[i][0].lower()
        if option not in _MAP_OPTIONS:
            raise ValueError(f"{where} option {words[i][0]} is not supported")
        i += 1
        args = []
        # -s / -o / -t take 1 to 3 numbers (v and w optional); the others a fixed count.
        while i < len(words) - 1 and len(args) < _MAP_OPTIONS[option]:
            if option in ("-s", "-o", "-t", "-mm", "-bm", "-boost", "-texres"):
                if not _is_number(words[i][0]):
                    break
            args.append(words[i][0])
            i += 1
        fixed = option not in ("-s", "-o", "-t")
        if not args or (fixed and len(args) < _MAP_OPTIONS[option]):
            raise ValueError(f"{where} option {option} needs {_MAP_OPTIONS[option]} value(s)")
        if option in ("-s", "-o", "-t", "-mm"):
            values = [float(a) for a in args]
            _finite_float32(values, f"{where} option {option}", args)
        if option in ("-clamp", "-blendu", "-blendv", "-cc") and args[0].lower() not in (
            "on",
            "off",
        ):
            raise ValueError(f"{where} option {option} expects on or off, found {args[0]!r}")
        if option == "-s":
            out["uv_scale"] = (values[0], values[1] if len(values) > 1 else 1.0)
        elif option == "-o":
            out["uv_offset"] = (values[0], values[1] if len(values) > 1 else 0.0)
        elif option == "-clamp":
            out["clamp"] = args[0].lower() == "on"
        elif option == "-t" and any(values):
            raise ValueError(f"{where} option -t (turbulence) is not supported")
        elif option == "-mm" and values != [0.0, 1.0]:
            raise ValueError(f"{where} option -mm (colour base and gain) is not supported")
        elif option == "-cc" and args[0].lower() == "on":
            raise ValueError(f"{where} option -cc on (colour correction) is not supported")
        elif option == "-imfchan":
            raise ValueError(f"{where} option -imfchan (one channel as a scalar) is not supported")
        elif option == "-type":
            raise ValueError(f"{where} option -type (reflection map) is not supported")
    if i >= len(words):
        raise ValueError(f"{where} needs a file name")
    out["name"] = text[words[i][1] :].strip()
    return out


def _find_file(folder: Path, name: str) -> Path | None:
    r"""The file a ``map_Kd`` or ``mtllib`` name refers to, or None.

    Tried in order: the name relative to the OBJ/MTL's folder (or absolute); without
    surrounding quotes; with Windows ``\`` separators as ``/``; the file name alone in that
    folder (exporters write absolute paths of the machine the asset was made on); and the last
    two with the file name's letter case ignored (assets made on Windows or macOS name
    ``Wood.PNG`` what is ``wood.png`` on disk).
    """
    unquoted = name[1:-1] if len(name) > 1 and name[0] == name[-1] == '"' else name
    slashed = unquoted.replace("\\", "/")
    base = slashed.rsplit("/", 1)[-1]
    for candidate in (name, unquoted, slashed, base):
        if candidate and (folder / candidate).is_file():
            return folder / candidate
    for candidate in (slashed, base):
        parent = (folder / candidate).parent
        if candidate and parent.is_dir():
            lower = Path(candidate).name.lower()
            found = sorted(p for p in parent.iterdir() if p.name.lower() == lower and p.is_file())
            if found:
                return found[0]
    return None


def _load_mtl(path: Path) -> dict[str, dict]:
    """The materials of an MTL file: name -> dict with ``kd`` (sRGB list, absent when not
    given), ``map_kd`` (texture path and options, see ``_parse_map_kd``), and ``error``: why
    the material cannot be used (an unsupported option, a missing texture). Such errors are
    raised only when a face uses the material: files often hold broken materials they never use.
    """
    materials: dict[str, dict] = {}
    current = None
    for lineno, raw in _statements(path):
        text = raw.split("#", 1)[0]
        tokens = text.split()
        if not tokens:
            continue
        key, args = tokens[0], tokens[1:]
        if key == "newmtl":
            if not args:
                raise ValueError(f"{path}:{lineno}: 'newmtl' needs a name")
            current = materials.setdefault(" ".join(args), {})
        elif current is None:
            continue
        elif key == "Kd":
            if args and args[0] in ("spectral", "xyz"):
                current.setdefault("error", f"{path}:{lineno}: 'Kd {args[0]}' is not supported")
            elif len(args) == 1:  # "Kd r": g and b equal r
                current["kd"] = _floats(args, 1, path, lineno, "Kd") * 3
            else:
                current["kd"] = _floats(args, 3, path, lineno, "Kd")
        elif key == "map_Kd":
            try:
                found = _parse_map_kd(text.split(None, 1)[1] if args else "", path, lineno)
                texture_path = _find_file(path.parent, found["name"])
                if texture_path is None:
                    raise ValueError(
                        f"{path}:{lineno}: map_Kd texture {path.parent / found['name']} "
                        "does not exist"
                    )
            except ValueError as exc:
                current.setdefault("error", str(exc))
                continue
            current["map_kd"] = {**found, "path": texture_path, "line": lineno, "mtl": path}
    return materials


def _kd_texture(info: dict) -> torch.Tensor:
    """[H, W, 3] float32 linear RGB of a ``map_Kd`` texture: 8-bit or 16-bit, grey, grey +
    alpha, RGB, RGBA or palette, sRGB-decoded; alpha is dropped (the diffuse colour has none)."""
    try:
        image = load_image(info["path"], to_linear=True)
    except (OSError, RuntimeError) as exc:
        why = " ".join(str(exc.__cause__ or exc).split())[:200]
        raise ValueError(
            f"{info['mtl']}:{info['line']}: map_Kd texture {info['path']} cannot be read as an "
            f"image ({why})"
        ) from None
    if image.shape[-1] in (1, 2):  # grey (+ alpha): the same value in R, G and B
        # (load_image converts only RGB/RGBA from sRGB; convert the grey value here)
        image = srgb_to_rgb(image[..., :1].expand(*image.shape[:-1], 3))
    return image[..., :3].contiguous()


def _material(name: str | None, info: dict, textures: dict[Path, torch.Tensor]) -> Material:
    """The ``Material`` of an MTL entry (``name`` None: the default material of faces before
    any ``usemtl``: Kd 0.8 grey, the MTL default). ``textures`` caches decoded files: exporters
    often give many materials one shared texture atlas."""
    kd = srgb_to_rgb(torch.tensor(info.get("kd", DEFAULT_KD_SRGB), dtype=torch.float32))
    texture = info.get("map_kd")
    if texture is None:
        return Material(name or "(default)", kd)
    if texture["path"] not in textures:
        textures[texture["path"]] = _kd_texture(texture)
    return Material(
        name, kd, textures[texture["path"]], uv_scale=texture["uv_scale"],
        uv_offset=texture["uv_offset"], clamp=texture["clamp"],
    )  # fmt: skip


# The plain statements that make up almost all of a large OBJ, read a run of lines at a time
# by NumPy (:func:`_obj_statements`): ``v`` / ``vn`` with three numbers, ``vt`` with two,
# triangles and quads whose corners are all ``a``, ``a/b``, ``a/b/c`` or all ``a//c``, single
# spaces or tabs between tokens, no comment, each line ending with ``\n`` or ``\r\n``. A
# number token holds only the characters of decimal numbers; an index at most 9 digits.
_NUMBER = r"[-+.0-9eE]+"
_INDEX = r"-?[0-9]{1,9}"
_FACE_FORMS = {"p": "{i}", "pt": "{i}/{i}", "ptn": "{i}/{i}/{i}", "pn": "{i}//{i}"}
_FLOAT_RUNS = {"v": 3, "vt": 2, "vn": 3}


def _run_pattern() -> re.Pattern:
    def lines(name: str, key: str, token: str, count: int, optional: int = 0) -> str:
        tokens = rf"[ \t]+{token}"
        line = key + tokens * count + f"(?:{tokens})?" * optional + r"[ \t]*\r?\n"
        return f"(?P<{name}>(?:{line})+)"

    kinds = [lines(key, key, _NUMBER, count) for key, count in _FLOAT_RUNS.items()]
    for form, corner in _FACE_FORMS.items():
        kinds.append(lines(f"f_{form}", "f", corner.format(i=_INDEX), 3, optional=1))
    return re.compile("^(?:" + "|".join(kinds) + ")", re.MULTILINE)


_RUNS = _run_pattern()
# The keys and the index separators become spaces: the numbers are what is left.
_RUN_KEYS = str.maketrans("vtnf/", "     ")


def _obj_statements(text: str, read_run) -> Iterator[tuple[int, str]]:
    """The statements of an OBJ file's ``text`` (see :func:`_statements`) but the runs of
    :data:`_RUNS` that ``read_run(kind, lineno, text)`` reads (it returns True); those it
    refuses come line by line, for the reader to parse and judge one statement at a time."""
    for lineno, statement, kind in _pieces(text, _RUNS):
        if kind is None:
            yield lineno, statement
        elif not read_run(kind, lineno, statement):
            yield from enumerate(statement.splitlines(), start=lineno)


def _run_floats(text: str, width: int) -> np.ndarray | None:
    """``[lines, width]`` float64: the numbers of a run of ``v`` / ``vt`` / ``vn`` lines, or
    None when one is not a number, not finite or beyond float32's range (the lines then go
    one at a time, for the error message). NumPy reads each token with Python's ``float``
    (it accepts and rounds what ``float`` does), as the lines one at a time would."""
    try:
        values = np.array(text.translate(_RUN_KEYS).split(), dtype=np.float64)
    except ValueError:
        return None
    if not (np.abs(values) <= _FLOAT32_MAX).all():  # False for nan as well
        return None
    return values.reshape(-1, width)


def _run_faces(kind: str, text: str, defined: tuple[int, int, int], positions: array):
    """``(position, texcoord or None, normal or None)`` indices, each ``[triangles, 3]``
    ``np.intc``, of a run of ``f`` lines (:data:`_RUNS`' ``kind``: triangles and quads), as
    the lines one at a time would give them; None when an index is out of range (of
    ``defined``: the counts of ``v``, ``vt``, ``vn`` so far) or a quad's fan is not
    :func:`_triangulate`'s triangles."""
    form = kind.removeprefix("f_")
    raw = np.array(text.translate(_RUN_KEYS).split(), dtype=np.int64).reshape(-1, len(form))
    found = {}
    for column, what in enumerate(form):
        given = raw[:, column]
        count = defined["ptn".index(what)]
        # OBJ indices are 1-based; negative ones count back from the last defined element.
        index = np.where(given > 0, given - 1, given + count)
        if not ((given != 0) & (index >= 0) & (index < count)).all():
            return None
        found[what] = index.astype(np.intc)
    lines = text.count("\n")
    if len(raw) in (3 * lines, 4 * lines):  # every line has 3 or 4 corners: all have as many
        corners = np.full(lines, len(raw) // lines)
    else:
        corners = _corners_per_line(text, len(form))
    first = np.cumsum(corners) - corners  # each line's first corner
    # Each line's triangles (corners of the line), at most 2 (a quad's): a triangle's
    # (0, 1, 2); a quad's fan (0, 1, 2), (0, 2, 3), or what _triangulate makes of it.
    local = np.array([[0, 1, 2], [0, 2, 3]])[None].repeat(len(corners), axis=0)
    kept = np.stack((np.ones(len(corners), dtype=bool), corners == 4), axis=1)
    quads = np.flatnonzero(corners == 4)
    if len(quads):
        points = np.frombuffer(positions, dtype=np.float64).reshape(-1, 3)
        points = points[found["p"][first[quads, None] + np.arange(4)]]  # [quads, 4, 3]
        for quad in np.flatnonzero(~_fans(points)).tolist():
            triangles = _triangulate(points[quad].tolist())
            if triangles is None:
                return None  # the lines one at a time raise the error
            local[quads[quad], : len(triangles)] = triangles
            kept[quads[quad]] = np.arange(2) < len(triangles)
    rows = (first[:, None, None] + local)[kept]
    return tuple(found[what][rows] if what in found else None for what in "ptn")


def _corners_per_line(text: str, per_corner: int) -> np.ndarray:
    """The number of corners of each line of a run of ``f`` lines (``per_corner`` indices
    each): the count of its tokens (digits, a leading ``-``) over ``per_corner``."""
    codes = np.frombuffer(text.encode("ascii"), dtype=np.uint8)
    in_token = ((codes >= ord("0")) & (codes <= ord("9"))) | (codes == ord("-"))
    starts = np.flatnonzero(in_token & ~np.concatenate(([False], in_token[:-1])))
    line_of = np.cumsum(codes == ord("\n")) - (codes == ord("\n"))
    return np.bincount(line_of[starts]) // per_corner


def _fans(corner: np.ndarray) -> np.ndarray:
    """Per quad (``[quads, 4, 3]`` corner positions), whether :func:`_triangulate` splits it
    into its fan ``(0, 1, 2), (0, 2, 3)``: its steps 2 and 3 in NumPy, float64 in the same
    order of operations (the same bits, the same verdicts)."""
    with np.errstate(all="ignore"):  # overflow and 0/0 as Python floats give them, no warning
        x, y, z = corner[..., 0], corner[..., 1], corner[..., 2]
        nx = ny = nz = 0.0
        for k in range(4):
            j = (k + 1) % 4
            nx = nx + (y[:, k] - y[:, j]) * (z[:, k] + z[:, j])
            ny = ny + (z[:, k] - z[:, j]) * (x[:, k] + x[:, j])
            nz = nz + (x[:, k] - x[:, j]) * (y[:, k] + y[:, j])
        area2 = np.sqrt(nx * nx + ny * ny + nz * nz)
        eps = 1e-9 * area2

        def turn(a: int, b: int, c: int) -> np.ndarray:
            u = [corner[:, b, k] - corner[:, a, k] for k in range(3)]
            v = [corner[:, c, k] - corner[:, a, k] for k in range(3)]
            return (
                nx * (u[1] * v[2] - u[2] * v[1])
                + ny * (u[2] * v[0] - u[0] * v[2])
                + nz * (u[0] * v[1] - u[1] * v[0])
            ) / area2

        return (area2 == 0.0) | ((turn(0, 1, 2) >= -eps) & (turn(0, 2, 3) >= -eps))


def _rows(values: array, width: int) -> torch.Tensor:
    """``[len(values) / width, width]``: a tensor over an array's buffer (float64 for ``"d"``,
    int32 for ``"i"``), no copy: it shares the array's memory."""
    dtype = torch.float64 if values.typecode == "d" else torch.int32
    if not values:
        return torch.zeros(0, width, dtype=dtype)
    return torch.frombuffer(values, dtype=dtype).view(-1, width)


def load_obj(path: str | os.PathLike) -> Mesh:
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

    Runs of plain ``v``, ``vt``, ``vn`` and triangle or quad ``f`` lines (see ``_RUNS``) are
    read by NumPy a block of lines at a time; any other line, and a run with a value or index
    that NumPy's reading is not sure of, is read one line at a time: the mesh, the warnings
    and the errors (and the lines they name) are those of reading every line so.

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

    def read_run(kind: str, lineno: int, text: str) -> bool:
        # one run of plain lines as the lines below would read them; False: not sure, they do
        if kind in _FLOAT_RUNS:
            values = _run_floats(text, _FLOAT_RUNS[kind])
            if values is None:
                return False
            if kind == "vt":
                values[:, 1] = 1.0 - values[:, 1]
            {"v": positions, "vt": texcoords, "vn": normals}[kind].frombytes(values.tobytes())
            return True
        defined = (len(positions) // 3, len(texcoords) // 2, len(normals) // 3)
        triangles = _run_faces(kind, text, defined, positions)
        if triangles is None:
            return False
        if triangles[1] is None:
            without_vt.setdefault(current, lineno)
        material = first_use.setdefault(current, len(first_use))
        first_line.setdefault(current, lineno)
        for faces, indices in zip((faces_pos, faces_tex, faces_nrm), triangles):
            faces.frombytes(
                indices.tobytes() if indices is not None else b"\xff" * (4 * triangles[0].size)
            )
        faces_mat.frombytes(np.full(len(triangles[0]), material, dtype=np.intc).tobytes())
        return True

    for lineno, raw in _obj_statements(_read_text(path), read_run):
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


# ---------------------------------------------------------------------------------------------
# OBJ writing
# ---------------------------------------------------------------------------------------------


def write_obj(path: str | os.PathLike, mesh: Mesh) -> None:
    """Write ``mesh`` as OBJ (+ ``<name>.mtl`` and one ``<name>_kd*.png`` per textured material
    when it has materials).

    The inverse of ``load_obj`` up to float formatting (9 significant digits, enough to
    reproduce float32 exactly) and 8-bit quantisation of the textures. Several materials are
    written with ``usemtl`` switching and their ``-s`` / ``-o`` / ``-clamp`` options.
    """
    path = Path(path)
    lines = []
    found = mesh_materials(mesh)
    t_mat_idx = None
    if found is not None:
        materials, t_mat_idx = found
        mtl_path = path.with_suffix(".mtl")
        mtl = []
        for i, material in enumerate(materials):
            kd = " ".join(f"{x:.9g}" for x in rgb_to_srgb(material.kd.cpu().float()).tolist())
            mtl += [f"newmtl {material.name}", f"Kd {kd}"]
            if material.kd_texture is not None:
                tex_name = f"{path.stem}_kd.png" if i == 0 else f"{path.stem}_kd{i}.png"
                save_image(path.parent / tex_name, material.kd_texture, to_srgb=True)
                options = ""
                if material.uv_scale != (1.0, 1.0):
                    options += "-s {:.9g} {:.9g} 1 ".format(*material.uv_scale)
                if material.uv_offset != (0.0, 0.0):
                    options += "-o {:.9g} {:.9g} 0 ".format(*material.uv_offset)
                if material.clamp:
                    options += "-clamp on "
                mtl.append(f"map_Kd {options}{tex_name}")
        mtl_path.write_text("\n".join(mtl) + "\n")
        lines.append(f"mtllib {mtl_path.name}")
    # Written a block of rows at a time: the text of a 1M-face mesh (~95 MB) and the Python
    # lists of its numbers took ~1 GB held whole.
    with path.open("w") as out:
        out.writelines(line + "\n" for line in lines)
        for rows in _blocks(mesh.v_pos):
            out.writelines(f"v {x:.9g} {y:.9g} {z:.9g}\n" for x, y, z in rows)
        for rows in _blocks(mesh.v_tex):
            out.writelines(f"vt {u:.9g} {1.0 - v:.9g}\n" for u, v in rows)
        for rows in _blocks(mesh.v_nrm):
            out.writelines(f"vn {x:.9g} {y:.9g} {z:.9g}\n" for x, y, z in rows)
        used = None
        indices = (mesh.t_pos_idx, mesh.t_tex_idx, mesh.t_nrm_idx, t_mat_idx)
        # a missing index tensor gives a None beside each block of the others
        blocks = zip(*(_blocks(t) if t is not None else itertools.repeat(None) for t in indices))
        for pos_i, tex_i, nrm_i, t_mat in blocks:
            for f in range(len(pos_i)):
                if t_mat is not None and t_mat[f] != used:
                    used = t_mat[f]
                    out.write(f"usemtl {found[0][used].name}\n")
                corners = []
                for k in range(3):
                    p = str(pos_i[f][k] + 1)
                    t = str(tex_i[f][k] + 1) if tex_i is not None else ""
                    n = str(nrm_i[f][k] + 1) if nrm_i is not None else ""
                    corners.append(p + (f"/{t}" if t or n else "") + (f"/{n}" if n else ""))
                out.write("f " + " ".join(corners) + "\n")
        if out.tell() == 0:
            out.write("\n")  # a mesh of nothing: one empty line, as "\n".join([]) + "\n"


# Rows of a tensor per .tolist() in write_obj.
_WRITE_ROWS = 1 << 16


def _blocks(values: torch.Tensor | np.ndarray | None) -> Iterator[list]:
    """``values`` as lists (``.tolist()``) of up to ``_WRITE_ROWS`` rows each, in order; none
    for None."""
    if values is None:
        return
    for start in range(0, values.shape[0], _WRITE_ROWS):
        yield values[start : start + _WRITE_ROWS].tolist()
