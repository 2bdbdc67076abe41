"""Triangle meshes: the ``Mesh`` container and the diffuse ``Material`` it holds.

UV (0, 0) addresses row 0 of a texture tensor (nvdiffrast's convention); colours are linear
RGB. Several materials are kept as ``Mesh.materials`` with a material index per triangle;
``mptex.render.material.shade_kd`` gives the diffuse colour they produce. Files are read and
written by :mod:`mptex.render.obj`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch

__all__ = ["Mesh", "Material", "DEFAULT_KD_SRGB", "vertex_normals", "unit_size"]


# The MTL format's Kd when a material gives none (and the colour of faces before any
# ``usemtl``), as sRGB file values: 0.8 grey.
DEFAULT_KD_SRGB = (0.8, 0.8, 0.8)


@dataclass
class Material:
    """One diffuse material.

    Attributes:
        name: the MTL material name.
        kd: [3] float32 linear-RGB diffuse colour, used where ``kd_texture`` is None.
        kd_texture: [H, W, 3] float32 linear-RGB diffuse texture (``map_Kd``), or None. It
            replaces ``kd`` (as nvdiffrec does; ``Kd`` is not multiplied in).
        uv_scale: ``map_Kd -s u v``: the texture is addressed at ``uv * uv_scale + uv_offset``
            in OBJ's UV space (v up), as three.js's ``repeat`` / ``offset``.
        uv_offset: ``map_Kd -o u v``.
        clamp: ``map_Kd -clamp on``: UVs outside [0, 1] take the edge texel; otherwise the
            texture repeats (u and u + 1 give the same colour), as OBJ viewers do.
    """

    name: str
    kd: torch.Tensor
    kd_texture: torch.Tensor | None = None
    uv_scale: tuple[float, float] = (1.0, 1.0)
    uv_offset: tuple[float, float] = (0.0, 0.0)
    clamp: bool = False

    def to(self, device) -> Material:
        """A copy with the tensors on ``device``."""
        tex = None if self.kd_texture is None else self.kd_texture.to(device)
        return replace(self, kd=self.kd.to(device), kd_texture=tex)

    def texture_uv(self, uv: torch.Tensor) -> torch.Tensor:
        """[..., 2] mesh UVs (v = 0 is texture row 0) -> the UVs the texture is sampled at.

        ``-s`` and ``-o`` act in OBJ's UV space, where v points up (v_obj = 1 - v).
        """
        if self.uv_scale == (1.0, 1.0) and self.uv_offset == (0.0, 0.0):
            return uv
        (su, sv), (ou, ov) = self.uv_scale, self.uv_offset
        u = uv[..., 0] * su + ou
        v = 1.0 - ((1.0 - uv[..., 1]) * sv + ov)
        return torch.stack([u, v], dim=-1)


@dataclass
class Mesh:
    """A triangle mesh with optional UVs, normals and diffuse materials.

    Attributes:
        v_pos: [V, 3] float32 vertex positions.
        t_pos_idx: [T, 3] int32 position indices per triangle.
        v_tex: [Vt, 2] float32 UVs (v = 0 is texture row 0), or None.
        t_tex_idx: [T, 3] int32 UV indices, or None.
        v_nrm: [Vn, 3] float32 unit normals, or None.
        t_nrm_idx: [T, 3] int32 normal indices, or None.
        kd_texture: [H, W, 3] float32 linear-RGB diffuse texture, or None.
        kd: [3] float32 linear-RGB diffuse colour (used when there is no texture), or None.
        materials: the materials (``Material``: Kd, map_Kd and its UV options), or None.
            When set they, not ``kd`` / ``kd_texture``, colour the mesh; ``load_obj`` also
            sets ``kd`` / ``kd_texture`` when there is exactly one.
        t_mat_idx: [T] int32 index into ``materials`` per triangle (with ``materials``).

    Read colours through ``mptex.render.material.shade_kd`` / ``mesh_materials``, which
    handle both forms.
    """

    v_pos: torch.Tensor
    t_pos_idx: torch.Tensor
    v_tex: torch.Tensor | None = None
    t_tex_idx: torch.Tensor | None = None
    v_nrm: torch.Tensor | None = None
    t_nrm_idx: torch.Tensor | None = None
    kd_texture: torch.Tensor | None = None
    kd: torch.Tensor | None = None
    materials: list[Material] | None = None
    t_mat_idx: torch.Tensor | None = None

    def to(self, device) -> Mesh:
        """A copy with every tensor (materials' too) on ``device``."""
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                moved[f.name] = None
            elif f.name == "materials":
                moved[f.name] = [m.to(device) for m in value]
            else:
                moved[f.name] = value.to(device)
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
    # Scaled by a power of two (exact: the normals are those of v_pos) to a largest coordinate
    # near 1: cross products of float32 coordinates beyond about 1e19 overflow (NaN normals),
    # of coordinates below about 1e-19 vanish (the fallback instead of the face's direction).
    if v_pos.numel():
        exponent = int(torch.frexp(v_pos.detach().abs().amax().float())[1])
        v_pos = v_pos * 2.0 ** -max(-125, min(125, exponent))
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
    """Centre the mesh's AABB at the origin and scale its longest side to 2 (fits [-1, 1]^3).

    Raises:
        ValueError: the mesh has no vertices, all at one point (no side to scale), or a
            non-finite one.
    """
    v_pos = mesh.v_pos
    side = 0.0
    if v_pos.shape[0]:
        lo, hi = v_pos.amin(dim=0), v_pos.amax(dim=0)
        if not bool(torch.isfinite(hi - lo).all()):
            # A side longer than float32's largest value (coordinates near -3e38 and 3e38)
            # would be inf and the scale 0, putting every vertex at the origin: halved first
            # (exact).
            v_pos, lo, hi = v_pos / 2, lo / 2, hi / 2
        side = float((hi - lo).max())
    if not math.isfinite(side):
        raise ValueError(
            f"mesh: expected finite vertex positions, received a longest side of {side}"
        )
    if not side > 0:
        raise ValueError(
            "mesh: expected vertices spanning a box of non-zero size, received "
            f"{mesh.v_pos.shape[0]} vertices whose longest side is {side}"
        )
    scale = 2.0 / side
    # lo / 2 + hi / 2, not (lo + hi) / 2: the sum of two coordinates near 3e38 overflows.
    return replace(mesh, v_pos=(v_pos - (lo / 2 + hi / 2)) * scale)


# ---------------------------------------------------------------------------------------------
# OBJ / MTL reading
# ---------------------------------------------------------------------------------------------
