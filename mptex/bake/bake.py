"""Baking an ``MLPTexture3D`` into a UV texture: texel G-buffer, batched evaluation, dilation.

``bake_texture`` runs, in this order:

1. **UVs.** The mesh's own UVs when they can hold a texture (present, inside [0, 1], not
   overlapping: :func:`uv_problem`), else an xatlas atlas packed at the bake resolution
   (:func:`mptex.bake.unwrap.unwrap_mesh`); ``unwrap="always"`` re-unwraps regardless.
2. **Texel G-buffer.** The mesh is rasterized in texture space with mptex's rasterizer (nvdiffrast
   on CUDA when importable): each vertex's UV becomes its clip-space position ``(2u - 1, 2v - 1,
   0, 1)``. No flip is needed: rasterizer row ``j`` has its centre at NDC ``(2j + 1) / N - 1``, and
   texture row ``j`` at ``v = (j + 0.5) / N`` (v = 0 is row 0 in mptex, as in nvdiffrast). The
   atlas is drawn in horizontal bands of at most ``2**22`` texels, so that the rasterizer's
   buffers stay small at 4096² and beyond. World positions are interpolated at covered texel
   centres.
3. **Conservative ring.** A bilinear lookup at a surface point reads the 4 texels whose centres lie
   within one texel (in x and in y) of it, and a thin or small triangle may cover no texel
   centre at all. Every texel whose centre is within ``sqrt(2)`` texels of some triangle but
   covered by none is therefore evaluated at the closest point of its nearest triangle, so a
   bilinear lookup anywhere on the surface reads only evaluated texels.
4. **Evaluation.** ``texture.sample`` once per evaluated texel, in chunks of ``chunk_size``
   points under ``torch.no_grad`` (memory does not grow with the resolution).
5. **Seam padding.** :func:`dilate` fills every other texel within ``padding`` texels
   (Chebyshev distance) of an evaluated texel with the value of its nearest evaluated texel
   (Euclidean distance), wrapping around the atlas borders as the ``wrap`` sampler of
   nvdiffrast and glTF's default ``REPEAT`` do. Mip level k averages 2^k x 2^k texels, so a
   padding of ``2**k`` texels keeps the first k + 1 levels free of background.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

from mptex._backends import available_bytes
from mptex.numbers import as_int
from mptex.render.mesh import Mesh
from mptex.render.rasterize import Backend, interpolate, rasterize
from mptex.texture import MLPTexture3D

__all__ = [
    "BakeResult",
    "bake_texture",
    "dilate",
    "uv_problem",
    "needs_unwrap",
    "check_bake_memory",
    "texel_positions",
    "sample_in_chunks",
    "MAX_RESOLUTION",
]

# Texel indices are int32 and an atlas is square: N^2 < 2^31.
MAX_RESOLUTION = 46340
# Texels per rasterizer band: the torch rasterizer's per-pixel buffers are ~100 bytes a texel.
_BAND_TEXELS = 1 << 22
# (triangle, texel) pairs tested per chunk of the conservative ring.
_RING_PAIRS_PER_CHUNK = 1 << 21
# A texel is read by a bilinear lookup at p when |dx| < 1 and |dy| < 1 (texel units): every such
# texel lies within sqrt(2) of p. The margin absorbs float rounding at exactly-diagonal points.
_RING_RADIUS = math.sqrt(2.0) + 1e-3
# Own UVs that cover less than this fraction of their summed triangle area overlap (mirrored
# or tiled islands, several materials sharing [0, 1]^2, a wrapping seam).
_MIN_UNION_FRACTION = 0.9
# Own UVs whose triangles cover less than this fraction of [0, 1]^2 (palette-style UVs: each
# material's faces squeezed into a small patch of a colour chart) leave a baked texture a few
# texels per triangle; xatlas charts fill the atlas (the real-asset soccer ball's cover 1.7e-4).
_MIN_UV_AREA = 0.01
# Atlas size of that overlap test (centre sampling at 512^2 measures areas to well under 10 %).
_OVERLAP_RESOLUTION = 512


@dataclass
class BakeResult:
    """A baked texture and what it was baked on.

    Attributes:
        texture: [N, N, C] float32 texel values in the texture's ``min_max`` range, channels in
            the texture's order (nvdiffrec's layout for C = 9: kd 0:3, ks 3:6, normal 6:9);
            row 0 is v = 0 (OBJ writers flip v). Texels beyond the padding hold 0.
        mesh: the mesh with the UVs the texture belongs to (``v_tex``, ``t_tex_idx``); positions
            and normals are the input's.
        covered: [N, N] bool, texels whose centre a triangle covers.
        evaluated: [N, N] bool, texels evaluated by the MLP (covered + conservative ring).
        filled: [N, N] bool, texels holding a value (evaluated + dilated).
        uv_source: ``"mesh"`` (the mesh's own UVs) or ``"xatlas"``.
        unwrap_reason: why xatlas was used (None when the mesh's UVs were kept).
        stats: coverage fractions, texel density, counts and timings (see ``bake_texture``).
    """

    texture: torch.Tensor
    mesh: Mesh
    covered: torch.Tensor
    evaluated: torch.Tensor
    filled: torch.Tensor
    uv_source: str
    unwrap_reason: str | None
    stats: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------


def check_bake_memory(resolution: int, channels: int, device: torch.device | str = "cpu") -> int:
    """Refuse a resolution whose buffers would not fit in the memory available now.

    The estimate counts the full-resolution buffers that live at the same time: the texture
    (``4 C`` bytes a texel) and its dilated copy (``4 C``), the coverage masks and the dilation's
    int32 source indices with their shifted copy (~12 bytes), plus one rasterizer band.

    Args:
        resolution: N, the atlas is N x N texels.
        channels: C, texture channels.
        device: where the bake runs.

    Returns:
        the estimated peak in bytes.

    Raises:
        ValueError: ``"resolution: ..."`` when N is out of range or the estimate exceeds the
            available memory (``MemAvailable`` on Linux, ``cudaMemGetInfo`` on CUDA).
    """
    if as_int(resolution) is None or resolution < 2:
        raise ValueError(f"resolution: expected an integer >= 2, received {resolution!r}")
    resolution = int(resolution)
    if resolution > MAX_RESOLUTION:
        raise ValueError(
            f"resolution: expected at most {MAX_RESOLUTION} (int32 texel indices), "
            f"received {resolution}"
        )
    texels = resolution * resolution
    need = texels * (8 * channels + 12) + min(texels, _BAND_TEXELS) * 128
    available = available_bytes(torch.device(device))
    if available is not None and need > available:
        raise ValueError(
            f"resolution: a {resolution}x{resolution} bake of {channels} channels needs about "
            f"{need / 2**30:.1f} GiB, only {available / 2**30:.1f} GiB available on "
            f"{torch.device(device)}"
        )
    return need


def _uv_triangles(mesh: Mesh) -> torch.Tensor:
    """[T, 3, 2] float32 UVs of every triangle's corners."""
    return mesh.v_tex[mesh.t_tex_idx.long()].float()


def _signed_areas(tri_uv: torch.Tensor) -> torch.Tensor:
    """[T] signed areas of [T, 3, 2] triangles."""
    e1, e2 = tri_uv[:, 1] - tri_uv[:, 0], tri_uv[:, 2] - tri_uv[:, 0]
    return 0.5 * (e1[:, 0] * e2[:, 1] - e1[:, 1] * e2[:, 0])


def uv_problem(mesh: Mesh, covered_texels: int | None = None, resolution: int = 0) -> str | None:
    """Why the mesh's own UVs cannot hold a baked texture, or None when they can.

    A texture baked into UVs gives each texel one value, so the UVs must be present on every
    triangle (not all three corners at one UV vertex, as ``load_obj`` gives faces without
    ``vt``), inside [0, 1]^2, cover at least 1 % of it (:data:`_MIN_UV_AREA`) and must not
    overlap. Overlap (mirrored or tiled islands, several
    materials each using the whole square, a seam that wraps around) is detected from the
    rasterized atlas: the texels covered must be at least 90 % of the triangles' summed UV area.

    Args:
        mesh: the mesh.
        covered_texels: texels the rasterized atlas covers (None: skip the overlap test).
        resolution: N of that atlas.
    """
    if mesh.v_tex is None or mesh.t_tex_idx is None:
        return "the mesh has no UVs"
    if mesh.v_tex.numel() == 0 or not bool(torch.isfinite(mesh.v_tex).all()):
        return "the mesh's UVs are not finite"
    idx = mesh.t_tex_idx
    # load_obj gives faces without vt (Kd-only materials) one shared UV vertex per corner.
    no_uv = int(((idx[:, 0] == idx[:, 1]) & (idx[:, 1] == idx[:, 2])).sum())
    if no_uv:
        return f"{no_uv} of the mesh's triangles have no UVs (all corners at one UV vertex)"
    lo, hi = float(mesh.v_tex.min()), float(mesh.v_tex.max())
    if lo < -1e-6 or hi > 1 + 1e-6:
        return f"the mesh's UVs leave [0, 1] (range [{lo:.3g}, {hi:.3g}])"
    summed = float(_signed_areas(_uv_triangles(mesh)).abs().sum())
    if summed <= 0:
        return "the mesh's UVs have no area"
    if summed < _MIN_UV_AREA:
        return (
            f"the mesh's UV triangles cover only {summed:.3g} of [0, 1]^2 (below "
            f"{_MIN_UV_AREA:g}): a baked texture would give them a few texels each"
        )
    if covered_texels is not None and covered_texels < _MIN_UNION_FRACTION * summed * resolution**2:
        union = covered_texels / (resolution**2)
        return (
            f"the mesh's UV triangles overlap (they cover {union:.3g} of [0, 1]^2, "
            f"their areas sum to {summed:.3g})"
        )
    return None


# ---------------------------------------------------------------------------------------------
# Texel G-buffer: centre coverage by rasterization, then the conservative ring
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def _rasterize_atlas(mesh: Mesh, resolution: int, backend: Backend) -> tuple[torch.Tensor, ...]:
    """Covered texels of the atlas and their world positions, band by band.

    Returns:
        (index, position): [M] int64 flat texel indices ``row * N + column`` and [M, 3] float32
        world positions at those texel centres.
    """
    n = resolution
    uv = mesh.v_tex.float()
    tri_uv = mesh.t_tex_idx.contiguous()
    rows_per_band = max(1, _BAND_TEXELS // n)
    indices, positions = [], []
    for row0 in range(0, n, rows_per_band):
        rows = min(rows_per_band, n - row0)
        # This band's texel rows span NDC [-1, 1]: row (row0 + k) has its centre at
        # (2k + 1) / rows - 1, i.e. y = 2 (v N - row0) / rows - 1.
        clip = torch.stack(
            [2 * uv[:, 0] - 1, 2 * (uv[:, 1] * n - row0) / rows - 1,
             torch.zeros_like(uv[:, 0]), torch.ones_like(uv[:, 0])], dim=-1,
        )  # fmt: skip
        rast, _ = rasterize(clip, tri_uv, (rows, n), backend=backend)
        position, _ = interpolate(mesh.v_pos.float(), rast, mesh.t_pos_idx, backend=backend)
        covered = rast[0, ..., 3] > 0
        flat = torch.nonzero(covered.reshape(-1)).squeeze(1)
        indices.append(flat + row0 * n)
        positions.append(position[0].reshape(-1, 3)[flat])
    return torch.cat(indices), torch.cat(positions)


def _closest_on_triangles(p: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor):
    """Closest point of each 2D triangle (a, b, c) to p, all [P, 2].

    Returns:
        (dist2, bary): [P] squared distance and [P, 3] barycentric weights of the closest point
        (inside: the point's own barycentrics; outside: the nearest point of the nearest edge,
        so degenerate triangles work too).
    """
    e1, e2 = b - a, c - a
    det = e1[:, 0] * e2[:, 1] - e1[:, 1] * e2[:, 0]
    q = p - a
    safe = torch.where(det == 0, torch.ones_like(det), det)
    w1 = (q[:, 0] * e2[:, 1] - q[:, 1] * e2[:, 0]) / safe
    w2 = (e1[:, 0] * q[:, 1] - e1[:, 1] * q[:, 0]) / safe
    w0 = 1 - w1 - w2
    inside = (det != 0) & (w0 >= 0) & (w1 >= 0) & (w2 >= 0)
    best_d2 = torch.full_like(det, float("inf"))
    best = torch.zeros(p.shape[0], 3, dtype=p.dtype, device=p.device)
    # Edge k runs from corner k to corner k + 1; a point t along it weighs them 1 - t and t.
    corners = (a, b, c)
    for k in range(3):
        start, end = corners[k], corners[(k + 1) % 3]
        edge = end - start
        length2 = (edge * edge).sum(-1)
        safe_length2 = torch.where(length2 > 0, length2, torch.ones_like(length2))
        t = (((p - start) * edge).sum(-1) / safe_length2).clamp(0, 1)
        d2 = ((start + t[:, None] * edge - p) ** 2).sum(-1)
        closer = d2 < best_d2
        weights = torch.zeros_like(best)
        weights[:, k] = 1 - t
        weights[:, (k + 1) % 3] = t
        best = torch.where(closer[:, None], weights, best)
        best_d2 = torch.where(closer, d2, best_d2)
    bary = torch.where(inside[:, None], torch.stack([w0, w1, w2], -1), best)
    return torch.where(inside, torch.zeros_like(best_d2), best_d2), bary


@torch.no_grad()
def _conservative_ring(
    mesh: Mesh, resolution: int, covered: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Texels a bilinear lookup on the surface reads whose centre no triangle covers.

    Every (triangle, texel) pair within the triangle's UV bounding box grown by ``sqrt(2)``
    texels is tested; a texel not in ``covered`` and within ``sqrt(2)`` texels of a triangle takes
    the closest point of its nearest triangle (ties: lower triangle index). Texel coordinates
    wrap around the atlas borders.

    Args:
        mesh: the mesh with UVs.
        resolution: N.
        covered: [N * N] bool centre coverage.

    Returns:
        (index, position): [R] int64 flat texel indices and [R, 3] float32 world positions.
    """
    n = resolution
    device = mesh.v_pos.device
    tri_uv = _uv_triangles(mesh) * n - 0.5  # texel units: texel (i, j) has its centre at (i, j)
    n_tri = tri_uv.shape[0]
    lo = torch.floor(tri_uv.amin(1) - _RING_RADIUS).long()
    hi = torch.ceil(tri_uv.amax(1) + _RING_RADIUS).long()
    # [T, 2] texels in x and y. A triangle near a whole border's length reaches some texels
    # twice through the wrap (at different distances): the nearest pair wins below.
    span = hi - lo + 1
    counts = span[:, 0] * span[:, 1]
    best = torch.full((n * n,), torch.iinfo(torch.int64).max, device=device)
    chunks = []
    cum = torch.cumsum(counts, 0)
    start = 0
    while start < n_tri:
        base = int(cum[start - 1]) if start else 0
        # a scalar value: the boundaries may be on a GPU, which a CPU tensor would not match
        end = int(torch.searchsorted(cum, base + _RING_PAIRS_PER_CHUNK, right=True))
        end = max(end, start + 1)
        ids = torch.arange(start, end, device=device)
        tri_ids = torch.repeat_interleave(ids, counts[start:end])
        first = torch.cumsum(counts[start:end], 0) - counts[start:end]
        local = torch.arange(tri_ids.numel(), device=device)
        local = local - torch.repeat_interleave(first, counts[start:end])
        x = lo[tri_ids, 0] + local % span[tri_ids, 0]
        y = lo[tri_ids, 1] + local // span[tri_ids, 0]
        texel = torch.remainder(y, n) * n + torch.remainder(x, n)
        keep = ~covered[texel]
        tri_ids, x, y, texel = tri_ids[keep], x[keep], y[keep], texel[keep]
        corners = tri_uv[tri_ids]
        point = torch.stack([x, y], -1).float()
        d2, bary = _closest_on_triangles(point, corners[:, 0], corners[:, 1], corners[:, 2])
        near = d2 <= _RING_RADIUS**2
        tri_ids, texel, d2, bary = tri_ids[near], texel[near], d2[near], bary[near]
        # One scatter keeps the nearest triangle per texel: d2 >= 0, so its float bits order
        # like its value; the triangle index breaks ties.
        key = d2.contiguous().view(torch.int32).to(torch.int64) * (1 << 32) + tri_ids
        best.scatter_reduce_(0, texel, key, reduce="amin")
        chunks.append((texel, key, tri_ids, bary))
        start = end
    if not chunks:
        return torch.zeros(0, dtype=torch.int64, device=device), mesh.v_pos.new_zeros(0, 3)
    texel, key, tri_ids, bary = (torch.cat(parts) for parts in zip(*chunks))
    winner = key == best[texel]
    # A triangle can reach the same texel twice only through the wrap; keep one pair per texel.
    texel, tri_ids, bary = texel[winner], tri_ids[winner], bary[winner]
    order = torch.argsort(texel, stable=True)
    texel, tri_ids, bary = texel[order], tri_ids[order], bary[order]
    first_of_texel = torch.ones_like(texel, dtype=torch.bool)
    first_of_texel[1:] = texel[1:] != texel[:-1]
    texel, tri_ids, bary = texel[first_of_texel], tri_ids[first_of_texel], bary[first_of_texel]
    corners_pos = mesh.v_pos.float()[mesh.t_pos_idx.long()[tri_ids]]  # [R, 3, 3]
    position = (bary[:, :, None] * corners_pos).sum(1)
    return texel, position


def texel_positions(
    mesh: Mesh, resolution: int, backend: Backend = "auto"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """World positions of the texels a bake evaluates (steps 2 and 3 of the module docstring).

    Args:
        mesh: a mesh with ``v_tex`` / ``t_tex_idx`` in [0, 1] (v = 0 is texel row 0).
        resolution: N, the atlas is N x N.
        backend: rasterizer backend ("auto", "torch", "nvdiffrast").

    Returns:
        (index, position, n_covered): [M] int64 flat texel indices ``row * N + column`` (centre-
        covered texels first, then the conservative ring), [M, 3] float32 world positions, and
        the number of centre-covered texels (the first ``n_covered`` entries).
    """
    covered_index, covered_pos = _rasterize_atlas(mesh, resolution, backend)
    covered = torch.zeros(resolution * resolution, dtype=torch.bool, device=covered_index.device)
    covered[covered_index] = True
    ring_index, ring_pos = _conservative_ring(mesh, resolution, covered)
    index = torch.cat([covered_index, ring_index])
    return index, torch.cat([covered_pos, ring_pos]), covered_index.numel()


def needs_unwrap(mesh: Mesh, unwrap: str = "auto", backend: Backend = "auto") -> str | None:
    """Why ``bake_texture`` will unwrap ``mesh`` with xatlas, or None when it keeps its UVs.

    ``unwrap="always"`` always unwraps; ``"auto"`` unwraps when :func:`uv_problem` finds the UVs
    missing, outside [0, 1] or overlapping (tested on a rasterized atlas of at most
    ``_OVERLAP_RESOLUTION``^2 texels). Cheap enough to call before a run, so that a missing
    xatlas is reported at start.
    """
    if unwrap not in ("auto", "always"):
        raise ValueError(f"unwrap: expected 'auto' or 'always', received {unwrap!r}")
    if unwrap == "always":
        return "re-unwrap requested (unwrap='always')"
    reason = uv_problem(mesh)
    if reason is None:
        index, _ = _rasterize_atlas(mesh, _OVERLAP_RESOLUTION, backend)
        reason = uv_problem(mesh, index.numel(), _OVERLAP_RESOLUTION)
    return reason


# ---------------------------------------------------------------------------------------------
# Dilation
# ---------------------------------------------------------------------------------------------


def _offsets(padding: int) -> list[tuple[int, int]]:
    """Offsets (dy, dx) of the (2 padding + 1)^2 window without (0, 0), nearest first
    (Euclidean distance, then dy, then dx: the tie order ``dilate`` promises)."""
    window = range(-padding, padding + 1)
    offsets = [(dy, dx) for dy in window for dx in window if (dy, dx) != (0, 0)]
    return sorted(offsets, key=lambda o: (o[0] ** 2 + o[1] ** 2, o[0], o[1]))


@torch.no_grad()
def dilate(
    image: torch.Tensor, mask: torch.Tensor, padding: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fill the texels near ``mask`` from their nearest masked texel (seam padding).

    Algorithm: every texel outside ``mask`` whose Chebyshev distance to a masked texel is at
    most ``padding`` (on the torus: distances wrap around the image borders, as wrap-mode
    texture lookups do) takes the value of the masked texel at the smallest Euclidean distance;
    ties go to the smaller dy, then the smaller dx (offsets ``(dy, dx)`` from the texel). It is
    exact: the ``(2 padding + 1)^2 - 1`` offsets are visited nearest first, one shifted copy of
    the mask's source indices each, and a texel keeps the first masked source it meets. Cost
    grows as ``padding^2`` full-image passes (about 80 for the default of 4).

    Args:
        image: [H, W, C] floating-point texture.
        mask: [H, W] bool, the texels holding values.
        padding: texels to fill around the mask (>= 0).

    Returns:
        (dilated, filled): [H, W, C] image (texels beyond the padding keep their input value)
        and [H, W] bool, ``mask`` plus the texels filled.
    """
    if not isinstance(image, torch.Tensor) or image.dim() != 3:
        got = list(image.shape) if isinstance(image, torch.Tensor) else type(image).__name__
        raise ValueError(f"image: expected shape [H, W, C], received {got}")
    if not isinstance(mask, torch.Tensor) or (mask.dtype, mask.shape) != (
        torch.bool,
        image.shape[:2],
    ):
        got = (list(mask.shape), mask.dtype) if isinstance(mask, torch.Tensor) else type(mask)
        raise ValueError(f"mask: expected [H, W] bool matching image, received {got}")
    if as_int(padding) is None or padding < 0:
        raise ValueError(f"padding: expected an integer >= 0, received {padding!r}")
    padding = int(padding)
    height, width, channels = image.shape
    flat_index = torch.arange(height * width, device=image.device, dtype=torch.int32)
    own = torch.where(mask.reshape(-1), flat_index, -1).view(height, width)
    source = own.clone()
    for dy, dx in _offsets(padding):
        # neighbour[y, x] = own[(y + dy) % H, (x + dx) % W]
        neighbour = torch.roll(own, shifts=(-dy, -dx), dims=(0, 1))
        source = torch.where((source < 0) & (neighbour >= 0), neighbour, source)
    filled = source >= 0
    flat = image.reshape(-1, channels)
    dilated = torch.where(filled.reshape(-1, 1), flat[source.reshape(-1).clamp(min=0).long()], flat)
    return dilated.view(height, width, channels), filled


# ---------------------------------------------------------------------------------------------
# The bake
# ---------------------------------------------------------------------------------------------


# Points per texture.sample call in a bake are padded to a multiple of this (see _sample_aligned).
_ALIGN = 64


def _sample_aligned(texture: MLPTexture3D, points: torch.Tensor) -> torch.Tensor:
    """``texture.sample(points)`` with ``points`` padded to a multiple of :data:`_ALIGN` points.

    ATen's elementwise CPU loops compute a tensor's last ``numel mod (2 x vector width)``
    elements in a scalar loop whose ``exp`` rounds unlike the vectorised body, so the output
    sigmoid's bits for a point would depend on where its chunk ends. With a whole number of
    ``_ALIGN`` points per call (``_ALIGN x channels`` elements: whole vectors at every width up
    to 32 floats) every point takes the vectorised path. The padding repeats the first point and
    its values are dropped. Shapes: ``points [M, 3]`` float32 -> ``[M, C]`` float32.
    """
    n = points.shape[0]
    pad = -n % _ALIGN
    if pad:
        points = torch.cat([points, points[:1].expand(pad, 3)])
    return texture.sample(points).float()[:n]


@torch.no_grad()
def sample_in_chunks(texture: MLPTexture3D, points: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """``texture.sample(points)`` in pieces of ``chunk_size`` points, in eval mode, no autograd.

    Args:
        texture: the neural texture.
        points: [M, 3] float32 world positions.
        chunk_size: points per call (bounds the encoder's and the MLP's working memory; each
            call is padded to a multiple of 64 points).

    The values do not depend on ``chunk_size``, bit for bit, where the MLP's GEMMs give a row
    the same bits whatever the number of rows, as MKL's float32 GEMMs do under its strict
    reproducibility mode (``MKL_CBWR=AUTO,STRICT``, which ``mptex-train`` sets). Without that
    mode, and with cuBLAS, the GEMM kernel can depend on the row count, and so can a value's
    last bit.

    Returns:
        [M, C] float32 texture values.
    """
    was_training = texture.training
    texture.eval()
    try:
        pieces = [_sample_aligned(texture, points[lo : lo + chunk_size])
                  for lo in range(0, points.shape[0], chunk_size)]  # fmt: skip
    finally:
        texture.train(was_training)
    return torch.cat(pieces) if pieces else points.new_zeros(0, texture.channels)


def _surface_area(mesh: Mesh) -> float:
    p = mesh.v_pos.double()[mesh.t_pos_idx.long()]
    return float(torch.linalg.cross(p[:, 1] - p[:, 0], p[:, 2] - p[:, 0]).norm(dim=-1).sum() / 2)


@torch.no_grad()
def bake_texture(
    texture: MLPTexture3D,
    mesh: Mesh,
    resolution: int = 1024,
    padding: int = 4,
    unwrap: Literal["auto", "always"] = "auto",
    chart_options: dict[str, Any] | None = None,
    pack_options: dict[str, Any] | None = None,
    chunk_size: int = 1 << 18,
    backend: Backend = "auto",
) -> BakeResult:
    """Bake ``texture`` into an N x N UV texture of ``mesh`` (steps in the module docstring).

    Args:
        texture: the trained neural texture; sampled at world positions of the mesh, so the
            mesh must be in the frame it was trained in (the scene's mesh).
        mesh: triangle mesh; its UVs are used when :func:`uv_problem` finds none wrong.
        resolution: N (default 1024); refused when its buffers would not fit in memory
            (:func:`check_bake_memory`).
        padding: seam padding in texels filled by :func:`dilate` (default 4: bilinear lookups
            and mip levels 0-2 never read background).
        unwrap: ``"auto"`` (xatlas only when the mesh's UVs cannot be used) or ``"always"``.
        chart_options, pack_options: xatlas ``ChartOptions`` / ``PackOptions`` attributes
            (:func:`mptex.bake.unwrap.unwrap_mesh`; packing padding defaults to 2 texels).
        chunk_size: points per ``texture.sample`` call (memory of the evaluation).
        backend: rasterizer backend.

    Returns:
        a :class:`BakeResult`. ``stats`` holds ``coverage`` (centre-covered fraction of the
        atlas), ``evaluated_fraction``, ``filled_fraction``, ``texels_per_unit`` (texels per
        world unit of surface length: sqrt(covered texels / surface area)), ``surface_area``,
        ``resolution``, ``padding``, ``unwrap_time_s`` and ``bake_time_s``.

    Raises:
        ValueError: naming the argument (resolution, padding, unwrap, chunk_size, mesh).
        RuntimeError: xatlas is needed but not installed.
    """
    from mptex.bake.unwrap import unwrap_mesh

    if not isinstance(texture, MLPTexture3D):
        raise ValueError(f"texture: expected an MLPTexture3D, received {type(texture).__name__}")
    if as_int(chunk_size) is None or chunk_size < 1:
        raise ValueError(f"chunk_size: expected an integer >= 1, received {chunk_size!r}")
    if as_int(padding) is None or padding < 0:
        raise ValueError(f"padding: expected an integer >= 0, received {padding!r}")
    chunk_size, padding = int(chunk_size), int(padding)
    if mesh.t_pos_idx.numel() == 0:
        raise ValueError("mesh: expected at least one triangle")
    device = texture.AABB.device
    channels = texture.channels
    check_bake_memory(resolution, channels, device)
    start = time.perf_counter()
    mesh = mesh.to(device)

    reason = needs_unwrap(mesh, unwrap, backend)
    unwrap_time = 0.0
    if reason is not None:
        tick = time.perf_counter()
        mesh = unwrap_mesh(mesh, resolution, chart_options, pack_options, why=reason)
        unwrap_time = time.perf_counter() - tick
    index, position, n_covered = texel_positions(mesh, resolution, backend)

    n_texels = resolution * resolution
    values = torch.zeros(n_texels, channels, device=device)
    values[index] = sample_in_chunks(texture, position, chunk_size)
    covered = torch.zeros(n_texels, dtype=torch.bool, device=device)
    covered[index[:n_covered]] = True
    evaluated = torch.zeros_like(covered)
    evaluated[index] = True
    shape = (resolution, resolution)
    baked, filled = dilate(values.view(*shape, channels), evaluated.view(shape), padding)
    area = _surface_area(mesh)
    stats = dict(
        resolution=resolution,
        padding=padding,
        coverage=n_covered / n_texels,
        evaluated_fraction=index.numel() / n_texels,
        filled_fraction=float(filled.float().mean()),
        surface_area=area,
        texels_per_unit=math.sqrt(n_covered / area) if area > 0 else None,
        unwrap_time_s=unwrap_time,
        bake_time_s=time.perf_counter() - start,
    )
    return BakeResult(
        texture=baked,
        mesh=replace(mesh),
        covered=covered.view(shape),
        evaluated=evaluated.view(shape),
        filled=filled,
        uv_source="mesh" if reason is None else "xatlas",
        unwrap_reason=reason,
        stats=stats,
    )
