"""The built-in procedural scene: a torus knot with a multi-frequency 3D ground-truth texture.

Nothing is downloaded. The knot's tube bends tightly and occludes itself, so views differ
in what they see; the texture mixes three octaves up to a period of about ten pixels at the
default 128 x 128 views, so that the precision of the fitted texture shows in fine detail.
"""

from __future__ import annotations

import math

import torch

from mptex.render.mesh import Mesh, unit_size, vertex_normals

__all__ = ["torus_knot", "gt_texture"]

# Angular frequencies (radians per world unit, mesh fitted to [-1, 1]^3) and amplitudes of the
# ground-truth octaves.
_OCTAVES = ((2.5, 0.45), (9.0, 0.33), (33.0, 0.22))
_TEXTURE_SEED = 20240613


def torus_knot(
    tubular_segments: int = 200,
    radial_segments: int = 24,
    p: int = 2,
    q: int = 3,
    tube_radius: float = 0.4,
) -> Mesh:
    """A (p, q) torus-knot tube fitted to [-1, 1]^3.

    Args:
        tubular_segments: samples along the knot curve.
        radial_segments: samples around the tube.
        p, q: winding numbers (coprime for a knot).
        tube_radius: tube radius before fitting (the knot curve spans about 6 units).

    Returns:
        A watertight ``Mesh`` with ``2 * tubular_segments * radial_segments`` triangles, UVs
        along/around the tube and vertex normals.
    """
    if tubular_segments < 3 or radial_segments < 3:
        raise ValueError(
            "tubular_segments, radial_segments: expected >= 3, received "
            f"{tubular_segments}, {radial_segments}"
        )
    t = torch.arange(tubular_segments, dtype=torch.float64) * (2 * math.pi / tubular_segments)

    def curve(s: torch.Tensor) -> torch.Tensor:
        r = 2 + torch.cos(q * s)
        return torch.stack([r * torch.cos(p * s), r * torch.sin(p * s), torch.sin(q * s)], -1)

    centre = curve(t)
    tangent = curve(t + 1e-4) - curve(t - 1e-4)
    tangent = tangent / torch.linalg.norm(tangent, dim=-1, keepdim=True)
    # The outward part of the centre point gives a frame without Frenet's flips at inflections.
    normal = centre - (centre * tangent).sum(-1, keepdim=True) * tangent
    normal = normal / torch.linalg.norm(normal, dim=-1, keepdim=True)
    binormal = torch.linalg.cross(tangent, normal)
    phi = torch.arange(radial_segments, dtype=torch.float64) * (2 * math.pi / radial_segments)
    ring = (
        torch.cos(phi)[None, :, None] * normal[:, None]
        + torch.sin(phi)[None, :, None] * (binormal[:, None])
    )
    v_pos = (centre[:, None] + tube_radius * ring).reshape(-1, 3).float()

    i = torch.arange(tubular_segments)[:, None]
    j = torch.arange(radial_segments)[None, :]
    i1, j1 = (i + 1) % tubular_segments, (j + 1) % radial_segments
    a, b = i * radial_segments + j, i1 * radial_segments + j
    c, d = i1 * radial_segments + j1, i * radial_segments + j1
    quads = torch.stack([a, b, c, d], -1).reshape(-1, 4)
    # a -> b runs along the tube (tangent), a -> d around it (binormal at phi = 0), and
    # tangent x binormal = -normal points into the tube: the triangles (a, c, b) and (a, d, c)
    # wind counter-clockwise seen from outside, so the vertex normals point out of the tube and
    # an exported knot is not drawn inside out by viewers that cull back faces.
    t_pos_idx = torch.cat([quads[:, [0, 2, 1]], quads[:, [0, 3, 2]]]).to(torch.int32)

    uu, vv = torch.meshgrid(
        torch.arange(tubular_segments) / tubular_segments,
        torch.arange(radial_segments) / radial_segments,
        indexing="ij",
    )
    mesh = unit_size(Mesh(v_pos=v_pos, t_pos_idx=t_pos_idx))
    mesh.v_tex = torch.stack([uu, vv], -1).reshape(-1, 2).float()
    mesh.t_tex_idx = t_pos_idx.clone()  # the UV seam wraps; fine for a 3D-textured scene
    mesh.v_nrm = vertex_normals(mesh.v_pos, t_pos_idx)
    mesh.t_nrm_idx = t_pos_idx.clone()
    return mesh


def _texture_params(device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(_TEXTURE_SEED)
    n = len(_OCTAVES)
    dirs = torch.nn.functional.normalize(torch.randn(3, n, 2, 3, generator=gen), dim=-1)
    phases = torch.rand(3, n, 2, generator=gen) * 2 * math.pi
    freq_amp = torch.tensor(_OCTAVES)
    return dirs.to(device), phases.to(device), freq_amp.to(device)


def gt_texture(pos: torch.Tensor) -> torch.Tensor:
    """The built-in scene's ground-truth albedo, a smooth 3D function of position.

    Per channel, a sum over octaves ``o`` of ``amp_o * sin(f_o d1 . x + p1) * sin(f_o d2 . x + p2)``
    (crossed sine gratings, checker-like), mapped into (0, 1) by ``0.5 + 0.5 * tanh(2 * sum)``.

    Args:
        pos: [N, 3] float32 positions (the mesh spans [-1, 1]^3).

    Returns:
        [N, 3] float32 linear RGB in [0, 1].
    """
    if pos.dim() != 2 or pos.shape[-1] != 3:
        raise ValueError(f"pos: expected shape [N, 3], received {list(pos.shape)}")
    dirs, phases, freq_amp = _texture_params(pos.device)
    proj = torch.einsum("nk,cosk->ncos", pos.float(), dirs)  # [N, 3, octaves, 2]
    waves = torch.sin(proj * freq_amp[:, 0, None] + phases)
    value = (waves.prod(-1) * freq_amp[:, 1]).sum(-1)
    # tanh raises the contrast (products of sines cluster near 0) and keeps the range open.
    return 0.5 + 0.5 * torch.tanh(2.0 * value)
