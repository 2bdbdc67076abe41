"""Triangle rasterization and attribute interpolation with nvdiffrast's conventions.

Two backends sit behind ``rasterize`` / ``interpolate``:

* ``"torch"``: a tiled, vectorised PyTorch rasterizer (CPU or GPU; on Apple's MPS, which lacks
  float64, it runs on the CPU) that reproduces nvdiffrast's CUDA rasterizer
  (``RasterizeCudaContext``). Visibility is resolved without autograd; the outputs of the
  winning triangle are then recomputed with autograd, so ``rast[..., :3]`` (and everything
  interpolated from it) is differentiable w.r.t. ``pos``.
* ``"nvdiffrast"``: ``nvdiffrast.torch.rasterize`` / ``interpolate`` on a cached
  ``RasterizeCudaContext`` (one per device).

``"auto"`` picks nvdiffrast for CUDA tensors when it is importable, otherwise torch (with a
one-time warning when the tensors are on CUDA, where nvdiffrast would have been faster).

Conventions reproduced from nvdiffrast:
    * ``rast[b, j, i] = (u, v, z/w, triangle_id + 1)``; zeros where nothing is drawn.
    * ``u, v`` are the perspective-correct barycentric weights of the triangle's vertices 0 and 1.
    * Pixel ``(i, j)`` has its centre at NDC ``((2i + 1) / W - 1, (2j + 1) / H - 1)``; row 0 is
      the bottom of the image (NDC y = -1).
    * Both windings are drawn; the nearest z/w wins.

What the torch backend reproduces of nvdiffrast 0.4.0 (253ac4f, its cudaraster pipeline:
TriangleSetup.inl, FineRaster.inl, Util.inl; its output kernel: common/rasterize.cu):
    * Triangles wholly outside a frustum plane (``|x|, |y|, |z| <= w``) are dropped; those not
      wholly inside are clipped to the frustum in their barycentric frame and fanned into
      sub-triangles, in float32 as cudaraster does.
    * Vertices snap to 1/16 pixel: ``round_half_even(x * (1 / w) * 8 W)`` sub-pixels from the
      viewport centre, in float32; pixel ``(i, j)`` samples at ``(16 i + 8 - 8 W, 16 j + 8 -
      8 H)``. Coverage is the sign of the integer edge functions of the snapped triangle
      (vertices ordered counter-clockwise); a sample exactly on an edge belongs to a triangle
      only when its counter-clockwise boundary walks that edge downwards (-y) or, for a
      horizontal edge, towards +x, so a shared edge's samples are drawn exactly once.
    * Depth is cudaraster's 32-bit fixed-point plane through the vertices' float32 z/w, built
      with its integer arithmetic and evaluated modulo 2^32 at each pixel; the smallest depth
      wins, and at equal depth the higher triangle id (cudaraster draws in id order and lets a
      fragment through when it is not farther).
    * The output ``u, v, z/w`` are recomputed from the unsnapped clip-space vertices with the
      output kernel's float32 operations (its fused multiply-adds included) and clamps: ``u``
      and ``v`` to [0, 1], then ``u + v <= 1``, z/w to [-1, 1].

Work and memory: what the setup computes from one vertex alone (its frustum outcodes, ``1 / w``,
its snapped position and the first and last pixel samples around it) is computed once per
vertex of each view, in groups of views holding at most 3 x ``_MAX_TRIS_PER_BLOCK`` vertices
(or one view), and gathered per triangle corner: each is an elementwise float32 function of the
vertex, so the bits are those of computing it per corner. The torch backend then sets up and
draws the B x T triangle instances (a triangle of one view) in blocks of
``_MAX_TRIS_PER_BLOCK``, and tests their (triangle, tile) pairs in chunks of at most
``_MAX_EVALS_PER_CHUNK`` pixel evaluations; triangles wholly inside the frustum whose snapped
bounding box holds no sample are dropped before the integer setup. Its transient memory stays
near 200 MB however many triangles and views it draws; what grows is the input, the float32
copy of ``pos``, the per-vertex tables of one group of views (22 bytes a vertex; one view's
where a view has more vertices) and the per-pixel buffers (the outputs and one int64 depth key
per pixel).

Measured against nvdiffrast 0.4.0's CUDA context on an NVIDIA H100 (tests/gpu_golden/, the
built-in torus knot and the duck, 4 views each at 512x512): every triangle id equal, and
``u, v, z/w`` equal to the bit at every covered pixel. Not reproduced: ``rast_db`` is
evaluated in ``pos``'s dtype without the kernel's operation order (not compared with
nvdiffrast's: the golden data does not hold it), and viewports above 2048 pixels, which
nvdiffrast renders in tiles with their own snapping origin.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as Fn

from mptex._backends import has_nvdiffrast, import_nvdiffrast, warn_fallback_once

__all__ = ["rasterize", "interpolate", "resolved_backend", "Backend"]

Backend = Literal["auto", "torch", "nvdiffrast"]

# Screen tiles are TILE x TILE pixels; each (triangle, tile) pair evaluates all pixels of the
# tile. 4 measured fastest (vs 8, 16) on a 20k-triangle mesh at 256 and 512 px on a 2-core CPU.
_TILE = 4
# Triangle instances (a triangle of one view) set up and drawn at once, so that memory does not
# grow with the mesh x the views: setup holds about 400 bytes per instance, a block of 65536
# about 25 MB. 65536 measured fastest (vs 16384 and 262144) on a 1M-triangle mesh x 16 views at
# 128x128 on a 2-core CPU.
_MAX_TRIS_PER_BLOCK = 1 << 16
# Upper bound on (pair, pixel) evaluations per chunk (a triangle's tiles are split across chunks
# where it has more): 1M evaluations hold 25 MB of float64 edge values, and each covered sample
# some 150 bytes of indices and depth keys: a chunk whose samples are all covered (a quad over
# a 1024x1024 view) peaks near 150 MB. As fast as 2M on a 20k-triangle mesh at 256 and 512 px,
# faster at 2048.
_MAX_EVALS_PER_CHUNK = 1 << 20

_NVDR_CONTEXTS: dict[torch.device, object] = {}


# ---------------------------------------------------------------------------------------------
# Input checks
# ---------------------------------------------------------------------------------------------


def _check_resolution(resolution) -> tuple[int, int]:
    try:
        height, width = (int(r) for r in resolution)
        whole = (height, width) == tuple(resolution)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"resolution: expected (height, width), received {resolution!r}") from exc
    if not whole:  # int() would truncate 2.5 rows to 2 (or parse "4")
        raise ValueError(
            f"resolution: expected whole numbers of pixels (height, width), received {resolution!r}"
        )
    if height <= 0 or width <= 0:
        raise ValueError(f"resolution: expected positive (height, width), received {resolution!r}")
    return height, width


def _check_pos(pos: torch.Tensor) -> torch.Tensor:
    if not isinstance(pos, torch.Tensor):
        raise ValueError(f"pos: expected a torch.Tensor, received {type(pos).__name__}")
    if pos.dim() == 2:
        pos = pos.unsqueeze(0)
    if pos.dim() != 3 or pos.shape[-1] != 4:
        raise ValueError(f"pos: expected shape [B, V, 4] or [V, 4], received {list(pos.shape)}")
    if not pos.is_floating_point():
        raise ValueError(f"pos: expected a floating-point tensor, received {pos.dtype}")
    return pos


def _check_tri(tri: torch.Tensor, n_vertices: int, device: torch.device) -> torch.Tensor:
    if not isinstance(tri, torch.Tensor):
        raise ValueError(f"tri: expected a torch.Tensor, received {type(tri).__name__}")
    if tri.dtype != torch.int32:
        raise ValueError(f"tri: expected dtype torch.int32, received {tri.dtype}")
    if tri.dim() != 2 or tri.shape[1] != 3:
        raise ValueError(f"tri: expected shape [T, 3], received {list(tri.shape)}")
    if tri.device != device:
        raise ValueError(f"tri: expected device {device} (same as pos), received {tri.device}")
    if tri.numel() > 0:
        lo, hi = int(tri.min()), int(tri.max())
        if lo < 0 or hi >= n_vertices:
            raise ValueError(
                f"tri: expected vertex indices in [0, {n_vertices - 1}], "
                f"received range [{lo}, {hi}]"
            )
    return tri


def resolved_backend(backend: str, device: torch.device | str) -> str:
    """The rasterizer ``rasterize`` runs for ``backend`` on tensors on ``device``: ``"auto"``
    is nvdiffrast on a CUDA device when it is importable, else torch; ``"torch"`` and
    ``"nvdiffrast"`` are themselves. Checks nothing and warns about nothing (what a run
    records in metrics.json; ``rasterize`` itself refuses an unusable ``"nvdiffrast"``).

    Raises:
        ValueError: ``backend`` is not ``"auto"``, ``"torch"`` or ``"nvdiffrast"``.
    """
    if backend not in ("auto", "torch", "nvdiffrast"):
        raise ValueError(
            f"backend: expected one of 'auto', 'torch', 'nvdiffrast', received {backend!r}"
        )
    if backend != "auto":
        return backend
    return "nvdiffrast" if torch.device(device).type == "cuda" and has_nvdiffrast() else "torch"


def _resolve_backend(backend: str, device: torch.device, what: str) -> str:
    chosen = resolved_backend(backend, device)
    if backend == "nvdiffrast":
        import_nvdiffrast()  # raises RuntimeError saying why it is unusable
        if device.type != "cuda":
            raise RuntimeError(
                f"backend='nvdiffrast' needs CUDA tensors, received device {device}; "
                "backend='torch' runs on any device"
            )
        return chosen
    if backend == "auto" and device.type == "cuda" and chosen == "torch":
        warn_fallback_once(what, "nvdiffrast is not importable")
    return chosen


def _nvdiffrast_context(device: torch.device):
    dr = import_nvdiffrast()
    if device not in _NVDR_CONTEXTS:
        _NVDR_CONTEXTS[device] = dr.RasterizeCudaContext(device=device)
    return _NVDR_CONTEXTS[device]


# ---------------------------------------------------------------------------------------------
# nvdiffrast's CUDA rasterizer (cudaraster), reproduced
# ---------------------------------------------------------------------------------------------

# Vertices snap to 1/16 pixel (cudaraster's CR_SUBPIXEL_LOG2 = 4).
_SUBPIXEL_LOG2 = 4
# Depth is a 32-bit unsigned fixed-point value: z/w in [-1, 1] maps to [_DEPTH_MIN, _DEPTH_MAX],
# a margin kept for the plane equation's interpolation error (cudaraster's CR_LERP_ERROR(3)).
_DEPTH_MIN = 2200 << 3
_DEPTH_MAX = 0xFFFFFFFF - _DEPTH_MIN
_U32 = 0xFFFFFFFF


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 fused multiply-add ``round(a * b + c)``, as CUDA's contracted ``a * b + c``.

    The float64 product of two float32 values is exact; rounding the sum to float64 and then to
    float32 can differ from one rounding only when the float64 sum lands exactly half-way
    between two float32 values (the golden meshes' outputs came out equal to the bit).
    """
    return (a.double() * b.double() + c.double()).float()


def _clip_polygon_with_plane(bary, count, c0, c1, c2):
    """One Sutherland-Hodgman step in the triangle's barycentric frame (cudaraster's clipper).

    The plane value at barycentric (s, t) is ``c0 + c1 s + c2 t`` (>= 0 inside). The polygon
    ``bary[m, :count[m]]`` ([M, K, 2] float32) is walked edge by edge from its last vertex: a
    sign change emits the crossing, then an inside end point emits itself.
    """
    n_poly, width, _ = bary.shape
    j = torch.arange(width, device=bary.device)
    value = _fma(c2[:, None], bary[..., 1], _fma(c1[:, None], bary[..., 0], c0[:, None]))
    prev = torch.where(j == 0, count[:, None] - 1, j - 1).clamp(min=0)
    a_val = value.gather(1, prev)
    a_bary = bary.gather(1, prev.unsqueeze(-1).expand(-1, -1, 2))
    valid = (j < count[:, None]) & (count[:, None] >= 3)
    crossing = valid & (a_val * value < 0)
    t_b = a_val / torch.where(crossing, a_val - value, torch.ones_like(value))
    t_a = 1 - t_b
    cut = _fma(a_bary, t_a.unsqueeze(-1), bary * t_b.unsqueeze(-1))
    keep = valid & (value >= 0)
    emitted = torch.stack([cut, bary], dim=2).reshape(n_poly, 2 * width, 2)
    emit = torch.stack([crossing, keep], dim=2).reshape(n_poly, 2 * width)
    slot = torch.where(emit, emit.cumsum(1) - 1, torch.full_like(j[:1], 2 * width))
    out = bary.new_zeros(n_poly, 2 * width + 1, 2)
    out.scatter_(1, slot.unsqueeze(-1).expand(-1, -1, 2), emitted)
    new_count = emit.sum(1)
    return out[:, : max(int(new_count.max()), 3) if n_poly else 3], new_count


def _clip_to_frustum(verts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip triangles against -w <= x, y, z <= w and fan the polygons into triangles.

    Args:
        verts: [M, 3, 4] float32 clip-space triangles.

    Returns:
        (sub, owner): [S, 3, 4] float32 sub-triangles and [S] int64 index of the triangle each
        came from, in triangle order. Axes are clipped only for triangles with a vertex outside
        them (as cudaraster does), so untouched axes add no rounding.
    """
    device = verts.device
    n_poly = verts.shape[0]
    v0 = verts[:, 0]
    d1, d2 = verts[:, 1] - v0, verts[:, 2] - v0
    bary = torch.zeros(n_poly, 3, 2, device=device)
    bary[:, 1, 0] = 1
    bary[:, 2, 1] = 1
    count = torch.full((n_poly,), 3, device=device)
    for axis in range(3):
        need = (verts[..., 3] < verts[..., axis].abs()).any(dim=1)
        if not bool(need.any()):
            continue
        for sign in (1.0, -1.0):
            planes = [v[:, 3] + sign * v[:, axis] for v in (v0, d1, d2)]
            new_bary, new_count = _clip_polygon_with_plane(bary, count, *planes)
            width = max(new_bary.shape[1], bary.shape[1])
            bary = Fn.pad(bary, (0, 0, 0, width - bary.shape[1]))
            new_bary = Fn.pad(new_bary, (0, 0, 0, width - new_bary.shape[1]))
            bary = torch.where(need[:, None, None], new_bary, bary)
            count = torch.where(need, new_count, count)
    # Polygon vertex k is v0 + s_k d1 + t_k d2; fan k = 2.. count-1: (P0, P_{k-1}, P_k).
    corners = _fma(
        d2[:, None, :], bary[..., 1:2], _fma(d1[:, None, :], bary[..., 0:1], v0[:, None, :])
    )  # [M, K, 4]
    n_fan = (count - 2).clamp(min=0)
    owner = torch.repeat_interleave(torch.arange(n_poly, device=device), n_fan)
    first = torch.cumsum(n_fan, 0) - n_fan
    k = torch.arange(owner.numel(), device=device) - torch.repeat_interleave(first, n_fan) + 2
    sub = torch.stack([corners[owner, 0], corners[owner, k - 1], corners[owner, k]], dim=1)
    return sub, owner


def _setup_plane(values, zv0, d1, d2, area):
    """cudaraster's integer depth plane: ``depth(px, py) = zx px + zy py + zb`` modulo 2^32.

    Args:
        values: [S, 3] float32 fixed-point depths of the vertices (below 2^32).
        zv0: [S, 2] int64 vertex 0 in sub-pixels from pixel (0, 0)'s centre.
        d1, d2: [S, 2] int64 edges P1 - P0, P2 - P0 in sub-pixels; area: [S] int64 > 0.

    Returns:
        (zx, zy, zb): [S] int64 holding unsigned 32-bit values.
    """
    top = values.amax(dim=1)
    sh = ((top.view(torch.int32) >> 23).long() - (127 + 22)).clamp(0, 8)
    t = values.double().clamp(0, _U32).long() >> sh[:, None]  # float -> u32 truncates
    t0, t1, t2 = t[:, 0], t[:, 1] - t[:, 0], t[:, 2] - t[:, 0]
    area_rcp = 1.0 / area.float()
    bits = area_rcp.view(torch.int32).long()
    rcp_mant = (bits & 0x007FFFFF) | 0x00800000
    rcp_shift = (23 + 127) - (bits >> 23)
    xc = (t1 * d2[:, 1] - t2 * d1[:, 1]) * rcp_mant
    yc = (t2 * d1[:, 0] - t1 * d2[:, 0]) * rcp_mant
    zx = (xc >> (rcp_shift - (sh + _SUBPIXEL_LOG2))) & _U32
    zy = (yc >> (rcp_shift - (sh + _SUBPIXEL_LOG2))) & _U32
    zero = torch.zeros_like(area)
    lo = torch.minimum(torch.minimum(d1, d2), zero[:, None])
    hi = torch.maximum(torch.maximum(d1, d2), zero[:, None])
    centre = (zv0 * 2 + lo + hi) >> (_SUBPIXEL_LOG2 + 1)  # [S, 2], pixels
    vc = zv0 - (centre << _SUBPIXEL_LOG2)
    offset = ((xc >> 13) * vc[:, 0] + (yc >> 13) * vc[:, 1]) >> (rcp_shift - (sh + 13))
    zb = (t0 << sh) - offset - zx * centre[:, 0] - zy * centre[:, 1]
    return zx, zy, zb & _U32


@dataclass(frozen=True)
class _Instances:
    """A block of triangle instances (a triangle of one view) as rows of per-vertex tables.

    cudaraster's setup starts with what depends on one vertex alone: its frustum outcodes,
    ``1 / w`` and its snapped position. The tables hold these once per vertex of a view (about
    six corners of a closed mesh share a vertex); each is an elementwise float32 function of
    the vertex, so gathering it per corner gives the bits computing it per corner gives.

    Attributes:
        corners: [N, 3] int64 rows of the tables, the instances' vertices.
        positions: [n, 4] float32 clip-space vertices.
        cull: [n, 5] int16 (int32 for viewports of 32767 pixels or more) per vertex: frustum
            flags (bit k, k = 0, 1, 2, set where ``w < x_k``, bit 3 + k where ``w < -x_k``, bit
            6 where ``w >= max |x_k|``), then pixel (x, y) of the first sample at or after the
            snapped vertex, clamped to [0, size], and of the last at or before it, clamped to
            [-1, size - 1] (the clamps change no triangle's ``_sample_span`` from empty to not).
        snap: [n, 3] float32 per vertex: ``1 / w`` and the snapped position, from ``_snap``.
    """

    corners: torch.Tensor
    positions: torch.Tensor
    cull: torch.Tensor
    snap: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        """[N, 3], the block's size: that of ``corners``."""
        return self.corners.shape


_OUTSIDE_FLAGS, _INSIDE_FLAG = 0b0111111, 0b1000000


def _vertex_setup(
    verts: torch.Tensor, height: int, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(cull, snap)`` tables of ``_Instances`` for the [n, 4] float32 clip-space
    ``verts``, filled ``_MAX_TRIS_PER_BLOCK`` vertices at a time (bounded temporaries)."""
    device = verts.device
    cull_dtype = torch.int16 if max(height, width) < 2**15 - 1 else torch.int32
    cull = torch.empty(verts.shape[0], 5, dtype=cull_dtype, device=device)
    snap = torch.empty(verts.shape[0], 3, device=device)
    size = torch.tensor([width, height], device=device)
    for lo in range(0, verts.shape[0], _MAX_TRIS_PER_BLOCK):
        chunk = verts[lo : lo + _MAX_TRIS_PER_BLOCK]
        xyz, w = chunk[:, :3], chunk[:, 3:]
        flags = (w >= xyz.abs().amax(dim=1, keepdim=True)).to(cull_dtype) << 6
        for k in range(3):
            flags |= (w < xyz[:, k : k + 1]).to(cull_dtype) << k
            flags |= (w < -xyz[:, k : k + 1]).to(cull_dtype) << (3 + k)
        rcp_w, snapped = _snap(chunk, height, width)
        first, last = _pixel_bounds(snapped.long(), height, width)
        rows = slice(lo, lo + chunk.shape[0])
        cull[rows] = torch.cat(
            [flags, first.clamp(min=0).minimum(size), last.clamp(min=-1).minimum(size - 1)], dim=1
        )
        snap[rows, 0] = rcp_w
        snap[rows, 1:] = snapped
    return cull, snap


def _setup_triangles(instances: _Instances, height: int, width: int) -> dict[str, torch.Tensor]:
    """cudaraster's triangle setup: frustum cull / clip, snap, orient, edge and depth planes.

    Args:
        instances: N triangle instances (see ``_Instances``).

    Returns:
        Per drawn (sub-)triangle S: ``owner`` [S] (index into N), ``edges`` [S, 3, 3] int64
        ``(dx, dy, c)`` such that a sample (sx, sy) in sub-pixels from the viewport centre is
        covered iff ``dx sy - dy sx + c >= 0`` for all three edges (the tie rule folded into c),
        ``plane`` [S, 3] int64 depth plane (see ``_setup_plane``), pixel spans ``x0, x1, y0,
        y1`` [S] int64 (inclusive).
    """
    device = instances.corners.device
    # (index_select gathers rows faster than indexing with a 2-D index.)
    cull = instances.cull.index_select(0, instances.corners.reshape(-1)).reshape(-1, 3, 5)
    # A triangle wholly outside one frustum plane (all three corners outside it) is dropped;
    # one wholly inside goes straight to setup; the rest are clipped to the frustum first.
    # (Reductions over the 3 corners are written out: torch's small-axis reductions are slow.)
    flags = _all3(cull[..., 0])
    culled = (flags & _OUTSIDE_FLAGS) != 0
    inside = (flags & _INSIDE_FLAG) != 0
    # Most triangles of a dense mesh fall between the samples: those wholly inside whose
    # snapped bounding box holds no sample are dropped here, before the integer setup.
    first = torch.minimum(torch.minimum(cull[:, 0, 1:3], cull[:, 1, 1:3]), cull[:, 2, 1:3])
    last = torch.maximum(torch.maximum(cull[:, 0, 3:5], cull[:, 1, 3:5]), cull[:, 2, 3:5])
    hit = torch.nonzero(~culled & inside & _any_sample(first, last)).squeeze(1)
    slow = torch.nonzero(~culled & ~inside).squeeze(1)
    fast = instances.corners[hit]
    fast_snap = instances.snap[fast]  # [F, 3, 3]
    sub, sub_owner = _clip_to_frustum(instances.positions[instances.corners[slow]])
    sub_rcp_w, sub_p = _snap(sub, height, width)
    z = torch.cat([instances.positions[fast, 2], sub[..., 2]])
    owner = torch.cat([hit, slow[sub_owner]])
    rcp_w = torch.cat([fast_snap[..., 0], sub_rcp_w])
    p = torch.cat([fast_snap[..., 1:], sub_p]).long()  # [S, 3, 2]

    d1, d2 = p[:, 1] - p[:, 0], p[:, 2] - p[:, 0]
    area = d1[:, 0] * d2[:, 1] - d1[:, 1] * d2[:, 0]
    first, last = _sample_span(p, height, width)
    keep = torch.nonzero((area != 0) & _any_sample(first, last)).squeeze(1)
    z, owner, rcp_w, p = z[keep], owner[keep], rcp_w[keep], p[keep]
    d1, d2, area, first, last = d1[keep], d2[keep], area[keep], first[keep], last[keep]
    # Both windings are drawn: clockwise triangles swap vertices 1 and 2.
    swap = area < 0
    order = torch.where(
        swap[:, None], torch.tensor([0, 2, 1], device=device), torch.arange(3, device=device)
    )
    p = p.gather(1, order[..., None].expand(-1, -1, 2))
    rcp_w = rcp_w.gather(1, order)
    z = z.gather(1, order)
    d1, d2, area = (
        torch.where(swap[:, None], d2, d1),
        torch.where(swap[:, None], d1, d2),
        area.abs(),
    )

    # Edge k runs P_k -> P_{k+1}. A sample exactly on an edge belongs to the triangle only when
    # the edge points down, or is horizontal and points right (x+): a shared edge is walked in
    # opposite directions by its two triangles, so exactly one of them gets the sample.
    start, end = p, p.roll(-1, dims=1)
    dx, dy = (end - start).unbind(-1)
    exclusive = (dy > 0) | ((dy == 0) & (dx <= 0))
    c = dy * start[..., 0] - dx * start[..., 1] - exclusive.long()
    edges = torch.stack([dx, dy, c], dim=-1)

    # Depth: z/w mapped to [_DEPTH_MIN, _DEPTH_MAX] per vertex in float32, then a fixed-point
    # plane through them relative to pixel (0, 0)'s sample.
    z_scale = torch.tensor(float(_DEPTH_MAX - _DEPTH_MIN), device=device) * 0.5
    z_bias = torch.tensor(float(_DEPTH_MAX + _DEPTH_MIN), device=device) * 0.5
    values = _fma(z * z_scale, rcp_w, z_bias.expand_as(z))
    bias = _sample_bias(height, width, device)
    plane = torch.stack(_setup_plane(values, p[:, 0] + bias, d1, d2, area), dim=1)
    return {
        "owner": owner,
        "edges": edges,
        "plane": plane,
        "x0": first[:, 0],
        "x1": last[:, 0],
        "y0": first[:, 1],
        "y1": last[:, 1],
    }


def _snap(tris: torch.Tensor, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(1 / w, snapped)``: [...] float32 and [..., 2] float32 whole numbers, the [..., 4]
    clip-space vertices in sub-pixels from the viewport centre, rounded half to even and
    saturated (exact as int64)."""
    rcp_w = 1.0 / tris[..., 3]
    scale = torch.tensor(
        [float(width << (_SUBPIXEL_LOG2 - 1)), float(height << (_SUBPIXEL_LOG2 - 1))],
        device=tris.device,
    )
    snapped = torch.round(tris[..., :2] * rcp_w[..., None] * scale)
    return rcp_w, torch.nan_to_num(snapped, nan=0.0).clamp(-(2.0**31), 2.0**31 - 128)


def _all3(flags: torch.Tensor) -> torch.Tensor:
    """``flags[:, 0] & flags[:, 1] & flags[:, 2]``: ``flags.all(dim=1)`` for [S, 3, ...] bool
    flags, the bits set in all three for integer ones."""
    return flags[:, 0] & flags[:, 1] & flags[:, 2]


def _any_sample(first: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """[S] bool: the spans of ``_sample_span`` hold a sample."""
    return (first[:, 0] <= last[:, 0]) & (first[:, 1] <= last[:, 1])


def _sample_bias(height: int, width: int, device: torch.device) -> torch.Tensor:
    """Sub-pixels from the viewport centre to pixel (0, 0)'s sample, negated, as [2] (x, y)."""
    half = torch.tensor(
        [width << (_SUBPIXEL_LOG2 - 1), height << (_SUBPIXEL_LOG2 - 1)], device=device
    )
    return half - (1 << (_SUBPIXEL_LOG2 - 1))


def _pixel_bounds(p: torch.Tensor, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(first, last)``: [..., 2] int64 pixel (x, y) of the first sample at or after and the
    last at or before the snapped positions ``p`` [..., 2] (int64), unclamped.

    Pixel (i, j)'s sample sits at 16 i + 8 - 8 W sub-pixels from the centre (row 0 at the
    bottom).
    """
    bias = _sample_bias(height, width, p.device)
    step = 1 << _SUBPIXEL_LOG2
    return (p + bias + step - 1) >> _SUBPIXEL_LOG2, (p + bias) >> _SUBPIXEL_LOG2


def _sample_span(p: torch.Tensor, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(first, last)``: [S, 2] int64 inclusive pixel (x, y) spans of the samples inside the
    bounding boxes of the snapped triangles ``p`` [S, 3, 2] (int64); empty where ``first >
    last``."""
    lo = torch.minimum(torch.minimum(p[:, 0], p[:, 1]), p[:, 2])
    hi = torch.maximum(torch.maximum(p[:, 0], p[:, 1]), p[:, 2])
    first, last = _pixel_bounds(lo, height, width)[0], _pixel_bounds(hi, height, width)[1]
    first = torch.maximum(first, torch.zeros_like(first))
    last = torch.minimum(last, torch.tensor([width - 1, height - 1], device=p.device))
    return first, last


@torch.no_grad()
def _visibility(pos: torch.Tensor, tri: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Index of the triangle nvdiffrast draws at each pixel (-1 for background), shape [B*H*W].

    The views go in groups (see the module docstring): first the per-vertex setup of their
    vertices (``_vertex_setup``), then their triangle instances (a triangle of one view) go
    through setup (``_setup_triangles``: integer edge functions and depth planes) and coverage
    in blocks of at most ``_MAX_TRIS_PER_BLOCK``, so that memory does not grow with B x T (nor
    with B x V). In each block the drawn triangles are binned by their pixel span into TILE x
    TILE pixel tiles, every (triangle, tile) pair tests all pixels of its tile in one vectorised
    batch, and one ``scatter_reduce`` keeps, per pixel, the smallest fixed-point depth, the
    highest triangle index among equal depths (cudaraster draws in index order and a fragment
    passes the depth test when not farther); a minimum does not depend on the order the blocks
    come in. The returned indices count over the batch: ``b * T + t``.
    """
    batch, n_vert = pos.shape[:2]
    n_tri = tri.shape[0]
    device = pos.device
    flat_pos = pos.float().reshape(batch * n_vert, 4)
    tri_long = tri.long()
    best = torch.full((batch * height * width,), torch.iinfo(torch.int64).max, device=device)
    # The views are set up in groups that hold no more vertices than a block holds corners (or
    # one view): first their vertices' tables, then their triangle instances in blocks.
    views_per_group = max(1, 3 * _MAX_TRIS_PER_BLOCK // max(n_vert, 1))
    for view_lo in range(0, batch if n_tri else 0, views_per_group):
        view_hi = min(batch, view_lo + views_per_group)
        positions = flat_pos[view_lo * n_vert : view_hi * n_vert]
        cull, snap = _vertex_setup(positions, height, width)
        for lo in range(view_lo * n_tri, view_hi * n_tri, _MAX_TRIS_PER_BLOCK):
            hi = min(lo + _MAX_TRIS_PER_BLOCK, view_hi * n_tri)
            view, first = divmod(lo, n_tri)
            if first + hi - lo <= n_tri:  # one view: its triangles are a slice of tri
                corners = tri_long[first : first + hi - lo] + (view - view_lo) * n_vert
            else:
                instance = torch.arange(lo, hi, device=device)
                view = instance // n_tri
                corners = tri_long[instance - view * n_tri] + ((view - view_lo) * n_vert)[:, None]
            setup = _setup_triangles(_Instances(corners, positions, cull, snap), height, width)
            setup["owner"] += lo
            _draw(best, setup, n_tri, height, width)
        del cull, snap  # before the next group's tables are allocated
    winner = _U32 - (best & _U32)
    return torch.where(best == torch.iinfo(torch.int64).max, torch.full_like(winner, -1), winner)


def _draw(
    best: torch.Tensor, setup: dict[str, torch.Tensor], n_tri: int, height: int, width: int
) -> None:
    """Lower ``best`` [B*H*W] int64 depth keys to those of the triangles of ``setup`` (from
    ``_setup_triangles``, ``owner`` counting over the batch) at the samples they cover."""
    device = best.device
    owner, edges, plane = setup["owner"], setup["edges"], setup["plane"]
    x0, x1, y0, y1 = setup["x0"], setup["x1"], setup["y0"], setup["y1"]
    tx0, tx1 = x0 // _TILE, x1 // _TILE
    ty0, ty1 = y0 // _TILE, y1 // _TILE
    n_tx = tx1 - tx0 + 1
    n_tiles = n_tx * (ty1 - ty0 + 1)

    offs = torch.arange(_TILE * _TILE, device=device)
    basis = torch.stack([torch.ones_like(offs), offs % _TILE, offs // _TILE]).double()  # [3, 16]
    half_x = (width - 1) << (_SUBPIXEL_LOG2 - 1)
    half_y = (height - 1) << (_SUBPIXEL_LOG2 - 1)
    # Key: depth in the high word (made signed), 2^32 - 1 - index in the low word, so that the
    # minimum is the nearest fragment and, among equal depths, the highest index.
    low = _U32 - owner

    # (triangle, tile) pairs in chunks of max_pairs, a triangle's tiles split across chunks
    # where it has more, so that no chunk holds more than _MAX_EVALS_PER_CHUNK evaluations.
    max_pairs = max(1, _MAX_EVALS_PER_CHUNK // (_TILE * _TILE))
    cum = torch.cumsum(n_tiles, 0)
    total = int(cum[-1]) if cum.numel() else 0
    for done in range(0, total, max_pairs):
        pair_index = torch.arange(done, min(done + max_pairs, total), device=device)
        ids = torch.searchsorted(cum, pair_index, right=True)
        local = pair_index - (cum[ids] - n_tiles[ids])
        tx = tx0[ids] + local % n_tx[ids]
        ty = ty0[ids] + local // n_tx[ids]
        # Edge functions at the tile's 16 samples, E = E(origin) + (-16 dy) i + (16 dx) j, as one
        # float64 matrix product (exact: |E| < 2^53).
        e = edges[ids]  # [P, 3, 3]: dx, dy, c
        sx0 = ((tx * _TILE) << _SUBPIXEL_LOG2) - half_x
        sy0 = ((ty * _TILE) << _SUBPIXEL_LOG2) - half_y
        e0 = e[..., 0] * sy0[:, None] - e[..., 1] * sx0[:, None] + e[..., 2]
        coef = torch.stack([e0, -e[..., 1] << _SUBPIXEL_LOG2, e[..., 0] << _SUBPIXEL_LOG2], dim=-1)
        edge_values = (coef.double().reshape(-1, 3) @ basis).reshape(-1, 3, _TILE * _TILE)
        # A sample inside the triangle is inside the viewport (clipping keeps triangles in it).
        pair, lane = torch.nonzero((edge_values >= 0).all(dim=1), as_tuple=True)
        px = tx[pair] * _TILE + lane % _TILE
        py = ty[pair] * _TILE + lane // _TILE
        hit = ids[pair]
        pl = plane[hit]
        depth = (pl[:, 0] * px + pl[:, 1] * py + pl[:, 2]) & _U32
        ok = depth <= _DEPTH_MAX
        pixel = ((owner[hit] // n_tri) * height + py) * width + px
        key = ((depth - (1 << 31)) << 32) | low[hit]
        best.scatter_reduce_(0, pixel[ok], key[ok], reduce="amin")


def _pixel_centres(px, py, height, width, dtype):
    """NDC pixel centres as nvdiffrast computes them: ``fma(2/W, i, 1/W - 1)`` in float32."""
    if dtype != torch.float32:
        return (2 * px + 1).to(dtype) / width - 1, (2 * py + 1).to(dtype) / height - 1
    out = []
    for idx, size in ((px, width), (py, height)):
        one = torch.ones((), dtype=torch.float32, device=px.device)
        scale, offset = 2 * one / size, one / size - 1
        out.append(_fma(scale.expand(idx.shape), idx.float(), offset.expand(idx.shape)))
    return out[0], out[1]


def _shade(v0, v1, v2, fx, fy):
    """nvdiffrast's per-pixel output: clamped perspective-correct ``(b0, b1)`` and ``z/w``.

    For float32 inputs every step is the CUDA kernel's float32 operation, contracted multiply-
    adds included, so the values match to the bit on the golden meshes; other dtypes evaluate
    the same formula in their precision. The clamps (each weight to [0, 1], then
    ``b0 + b1 <= 1``, and z/w to [-1, 1]) act only where the pixel centre lies outside the
    triangle in floating point but inside its snapped copy. Differentiable w.r.t. the vertices,
    clamps included (zero gradient where clamped; nvdiffrast's backward pass ignores them).
    """
    exact = v0.dtype == torch.float32
    fma = _fma if exact else (lambda a, b, c: a * b + c)
    q = [(fma(-fx, v[:, 3], v[:, 0]), fma(-fy, v[:, 3], v[:, 1])) for v in (v0, v1, v2)]
    a = [fma(q[i][0], q[j][1], -(q[i][1] * q[j][0])) for i, j in ((1, 2), (2, 0), (0, 1))]
    inv = 1 / (a[0] + a[1] + a[2])
    b0, b1 = a[0] * inv, a[1] * inv
    z = fma(v2[:, 2], a[2], fma(v0[:, 2], a[0], v1[:, 2] * a[1]))
    w = fma(v2[:, 3], a[2], fma(v0[:, 3], a[0], v1[:, 3] * a[1]))
    zw = z / w
    # nvdiffrast clamps with fmaxf(fminf(z/w, 1), -1), where fminf(NaN, 1) = 1: a 0 / 0 (an
    # exactly flat triangle that snapping opened) comes out 1, where torch's clamp keeps NaN.
    zw = torch.where(torch.isnan(zw), torch.ones_like(zw), zw)
    b0, b1 = (torch.where(torch.isnan(b), torch.zeros_like(b), b).clamp(0, 1) for b in (b0, b1))
    shrink = 1 / torch.clamp(b0 + b1, min=1)
    return b0 * shrink, b1 * shrink, zw.clamp(-1, 1)


def _rasterize_torch(
    pos: torch.Tensor, tri: torch.Tensor, height: int, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, n_tri = pos.shape[0], tri.shape[0]
    winner = _visibility(pos, tri, height, width)
    covered = torch.nonzero(winner >= 0).squeeze(1)
    tri_flat = winner[covered]
    b_idx = tri_flat // n_tri
    t_idx = tri_flat % n_tri
    pix = covered % (height * width)
    px, py = pix % width, pix // width
    ndc_x, ndc_y = _pixel_centres(px, py, height, width, pos.dtype)

    # The winner's outputs are recomputed from the unsnapped vertices, with autograd, so u, v
    # (and z/w) carry gradients to pos.
    vidx = tri.long()[t_idx]  # [N, 3]
    v0, v1, v2 = (pos[b_idx, vidx[:, k]] for k in range(3))
    b0, b1, zw = _shade(v0, v1, v2, ndc_x, ndc_y)
    values = torch.stack([b0, b1, zw, (t_idx + 1).to(pos.dtype)], dim=-1)
    rast = pos.new_zeros(batch * height * width, 4).index_put((covered,), values)

    # Image-space derivatives (du/dX, du/dY, dv/dX, dv/dY) in pixel units, as nvdiffrast's
    # rast_db. With n = a x c (a_k = X_k - x W_k, c_k = Y_k - y W_k), da_k/dx = -W_k and
    # dc_k/dy = -W_k; one pixel is 2/W (resp. 2/H) in NDC.
    verts = (v0, v1, v2)
    a = [vk[:, 0] - ndc_x * vk[:, 3] for vk in verts]
    c = [vk[:, 1] - ndc_y * vk[:, 3] for vk in verts]
    minus_w = [-vk[:, 3] for vk in verts]
    n = _cross(a, c)
    s = n[0] + n[1] + n[2]
    s = torch.where(s == 0, torch.ones_like(s), s)
    derivs = []
    for dn, pixel_size in ((_cross(minus_w, c), 2.0 / width), (_cross(a, minus_w), 2.0 / height)):
        ds = dn[0] + dn[1] + dn[2]
        derivs.append([(dn[k] * s - n[k] * ds) / (s * s) * pixel_size for k in (0, 1)])
    (du_dx, dv_dx), (du_dy, dv_dy) = derivs
    db_values = torch.stack([du_dx, du_dy, dv_dx, dv_dy], dim=-1)
    rast_db = pos.new_zeros(batch * height * width, 4).index_put((covered,), db_values)
    shape = (batch, height, width, 4)
    return rast.reshape(shape), rast_db.reshape(shape)


def _cross(a, c):
    return [a[1] * c[2] - a[2] * c[1], a[2] * c[0] - a[0] * c[2], a[0] * c[1] - a[1] * c[0]]


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


def rasterize(
    pos: torch.Tensor,
    tri: torch.Tensor,
    resolution: tuple[int, int],
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rasterize triangles, reproducing ``nvdiffrast.torch.rasterize`` (instanced mode).

    The torch backend draws what nvdiffrast's CUDA rasterizer draws (see the module docstring):
    vertices snapped to 1/16 pixel, integer edge functions with nvdiffrast's rule for samples on
    an edge, frustum clipping, fixed-point depth (the nearest wins; at equal depth, the higher
    triangle id), both windings. Its outputs are nvdiffrast's float32 arithmetic on the
    unsnapped vertices: on the golden meshes every id and every ``u, v, z/w`` is equal to the
    bit. For a float64 ``pos``, coverage is decided on ``pos.float()`` and the outputs are
    computed in float64.

    Args:
        pos: [B, V, 4] or [V, 4] (treated as B = 1) float32 clip-space vertex positions.
        tri: [T, 3] int32 vertex indices, shared by all batch entries.
        resolution: (height, width) of the output in pixels.
        backend: "auto" (nvdiffrast for CUDA tensors when importable, else torch), "torch" or
            "nvdiffrast" (RuntimeError when unusable).

    Returns:
        (rast, rast_db), each [B, H, W, 4] in ``pos``'s dtype (float32 from nvdiffrast).
        ``rast = (u, v, z/w, triangle_id + 1)``, zeros on background; ``u, v, z/w`` are
        differentiable w.r.t. ``pos``. ``rast_db`` holds the
        image-space derivatives ``(du/dX, du/dY, dv/dX, dv/dY)`` per pixel, as nvdiffrast's.
        Pixel (i, j) is centred at NDC ((2i+1)/W - 1, (2j+1)/H - 1); row 0 is the bottom.

    Raises:
        ValueError: on a bad shape, dtype, index range or resolution, naming the argument.
    """
    pos = _check_pos(pos)
    height, width = _check_resolution(resolution)
    tri = _check_tri(tri, pos.shape[1], pos.device)
    chosen = _resolve_backend(backend, pos.device, "mptex.render.rasterize")
    if chosen == "nvdiffrast":
        dr = import_nvdiffrast()
        ctx = _nvdiffrast_context(pos.device)
        return dr.rasterize(ctx, pos.float().contiguous(), tri.contiguous(), (height, width))
    if pos.device.type == "mps":
        # The exact arithmetic needs float64, which MPS lacks: rasterize on the CPU (autograd
        # follows the copies).
        rast, rast_db = _rasterize_torch(pos.cpu().contiguous(), tri.cpu(), height, width)
        return rast.to(pos.device), rast_db.to(pos.device)
    return _rasterize_torch(pos.contiguous(), tri.contiguous(), height, width)


def interpolate(
    attr: torch.Tensor,
    rast: torch.Tensor,
    tri: torch.Tensor,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Interpolate vertex attributes over the image, reproducing ``nvdiffrast.torch.interpolate``.

    On covered pixels ``out = u * A0 + v * A1 + (1 - u - v) * A2`` for the triangle whose id is
    stored in ``rast``; background pixels are 0. Differentiable w.r.t. ``attr`` and, through
    ``rast[..., :2]``, w.r.t. the clip-space positions that produced ``rast``.

    Args:
        attr: [B, V, C] or [V, C] (shared by all batch entries) floating-point attributes.
        rast: [B, H, W, 4] output of ``rasterize``.
        tri: [T, 3] int32 vertex indices (the ones given to ``rasterize``).
        backend: "auto", "torch" or "nvdiffrast", as in ``rasterize``.

    Returns:
        (out, out_da): out is [B, H, W, C] in attr's dtype; out_da is an empty tensor, as
        nvdiffrast returns when no attribute derivatives are requested.
    """
    if not isinstance(rast, torch.Tensor) or rast.dim() != 4 or rast.shape[-1] != 4:
        got = list(rast.shape) if isinstance(rast, torch.Tensor) else type(rast).__name__
        raise ValueError(f"rast: expected shape [B, H, W, 4], received {got}")
    if not isinstance(attr, torch.Tensor) or attr.dim() not in (2, 3):
        got = list(attr.shape) if isinstance(attr, torch.Tensor) else type(attr).__name__
        raise ValueError(f"attr: expected shape [B, V, C] or [V, C], received {got}")
    if attr.dim() == 3 and attr.shape[0] not in (1, rast.shape[0]):
        raise ValueError(
            f"attr: expected batch size 1 or {rast.shape[0]} (as rast), received {attr.shape[0]}"
        )
    n_vertices = attr.shape[-2]
    tri = _check_tri(tri, n_vertices, rast.device)
    chosen = _resolve_backend(backend, rast.device, "mptex.render.interpolate")
    if chosen == "nvdiffrast":
        dr = import_nvdiffrast()
        attr_in = attr if attr.dim() == 3 else attr.unsqueeze(0)
        return dr.interpolate(attr_in.contiguous(), rast.contiguous(), tri.contiguous())

    batch, height, width, _ = rast.shape
    channels = attr.shape[-1]
    flat = rast.reshape(-1, 4)
    tri_id = flat[:, 3].detach().round().long() - 1
    covered = torch.nonzero(tri_id >= 0).squeeze(1)
    if covered.numel() and int(tri_id[covered].max()) >= tri.shape[0]:
        raise ValueError(f"rast: triangle ids exceed the {tri.shape[0]} triangles of tri")
    vidx = tri.long()[tri_id[covered]]  # [N, 3]
    if attr.dim() == 2 or attr.shape[0] == 1:
        table = attr.reshape(n_vertices, channels)
        a0, a1, a2 = (table[vidx[:, k]] for k in range(3))
    else:
        b_idx = covered // (height * width)
        a0, a1, a2 = (attr[b_idx, vidx[:, k]] for k in range(3))
    u = flat[covered, 0:1].to(attr.dtype)
    v = flat[covered, 1:2].to(attr.dtype)
    values = u * a0 + v * a1 + (1 - u - v) * a2
    out = attr.new_zeros(batch * height * width, channels).index_put((covered,), values)
    return out.reshape(batch, height, width, channels), attr.new_empty(0)
