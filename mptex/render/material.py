"""Diffuse materials of a mesh and the per-pixel diffuse colour they give.

A ``Material`` (defined with ``Mesh`` in :mod:`mptex.render.mesh`) is what ``load_obj`` reads
from an MTL ``newmtl`` block: a ``Kd`` colour and an optional ``map_Kd`` texture with the
``-s`` / ``-o`` / ``-clamp`` options of that statement. :func:`shade_kd` is the one place that
turns a mesh's materials into colours (the mesh scene's reference images use it), so a mesh
with one material and one with several are shaded alike.
"""

from __future__ import annotations

import torch

from mptex.render.mesh import DEFAULT_KD_SRGB, Material, Mesh
from mptex.render.rasterize import Backend, interpolate
from mptex.render.texture import texture

__all__ = ["Material", "DEFAULT_KD_SRGB", "mesh_materials", "shade_kd"]


def mesh_materials(mesh: Mesh) -> tuple[list[Material], torch.Tensor] | None:
    """The mesh's materials and each triangle's material, or None when it has no colour.

    ``mesh.materials`` / ``mesh.t_mat_idx`` when set; otherwise one material made of
    ``mesh.kd`` / ``mesh.kd_texture`` (meshes built in code), used by every triangle.

    Returns:
        (materials, t_mat_idx): the list and [T] int64 indices into it.
    """
    if mesh.materials is not None:
        return mesh.materials, mesh.t_mat_idx.long()
    if mesh.kd is None and mesh.kd_texture is None:
        return None
    kd = mesh.kd if mesh.kd is not None else torch.ones(3, device=mesh.v_pos.device)
    only = Material("material0", kd, mesh.kd_texture)
    return [only], torch.zeros(mesh.t_pos_idx.shape[0], dtype=torch.long, device=kd.device)


def shade_kd(mesh: Mesh, rast: torch.Tensor, backend: Backend = "auto") -> torch.Tensor:
    """The diffuse colour of every pixel: its triangle's material (texture at its UV, or Kd).

    Args:
        mesh: a mesh with colour (``materials``, or ``kd`` / ``kd_texture``); textured
            materials need ``v_tex`` / ``t_tex_idx``.
        rast: [B, H, W, 4] rasterizer output (``rast[..., 3]`` = triangle id + 1, 0 = none).
        backend: for ``interpolate`` and ``texture``.

    Returns:
        [B, H, W, 3] float32 linear RGB; 0 on background pixels.

    Raises:
        ValueError: the mesh has no colour, or a textured material and no UVs.
    """
    found = mesh_materials(mesh)
    if found is None:
        raise ValueError("mesh: no material (Kd or map_Kd) to shade with")
    materials, t_mat_idx = found
    if mesh.v_tex is None or mesh.t_tex_idx is None:
        # Said for any face's textured material, whether or not a pixel shows it.
        used = set(t_mat_idx.unique().tolist())
        for m, material in enumerate(materials):
            if material.kd_texture is not None and m in used:
                raise ValueError(f"mesh: material {material.name!r} has a texture but no UVs")
    tri = rast[..., 3].long() - 1  # [B, H, W]; -1 on background
    covered = tri >= 0
    pixel_mat = torch.full_like(tri, -1)
    pixel_mat[covered] = t_mat_idx[tri[covered]]
    rgb = torch.zeros(*tri.shape, 3, dtype=torch.float32, device=rast.device)
    uv = None
    for m, material in enumerate(materials):
        where = pixel_mat == m
        if not bool(where.any()):
            continue
        if material.kd_texture is None:
            rgb[where] = material.kd.to(rgb)
            continue
        if uv is None:
            uv, _ = interpolate(mesh.v_tex, rast, mesh.t_tex_idx, backend=backend)
        # Only this material's pixels are sampled: [1, 1, N, 2].
        at = material.texture_uv(uv[where]).reshape(1, 1, -1, 2)
        mode = "clamp" if material.clamp else "wrap"
        sampled = texture(material.kd_texture.unsqueeze(0), at, boundary_mode=mode, backend=backend)
        rgb[where] = sampled.reshape(-1, sampled.shape[-1]).to(rgb)
    return rgb
