"""Cameras in nvdiffrec's conventions (``render/util.py`` and ``dataset/dataset_mesh.py``).

All matrices are 4x4 float32 acting on column vectors (``clip = mvp @ [x, y, z, 1]``). The
projection flips y, as nvdiffrec's ``util.perspective`` does, so that image row 0 of the
rasterized output (NDC y = -1) is the top of the picture a user expects.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch

__all__ = [
    "Cameras",
    "perspective",
    "translate",
    "rotate_x",
    "rotate_y",
    "look_at",
    "fovx_to_fovy",
    "random_rotation_translation",
    "random_views",
    "orbit_views",
    "cameras_from_mv",
]


@dataclass
class Cameras:
    """A batch of cameras.

    Attributes:
        mv: [B, 4, 4] float32 world-to-camera (model-view) matrices.
        mvp: [B, 4, 4] float32 world-to-clip matrices, ``proj @ mv``.
        campos: [B, 3] float32 camera positions in world space.
    """

    mv: torch.Tensor
    mvp: torch.Tensor
    campos: torch.Tensor

    def __len__(self) -> int:
        return self.mv.shape[0]


def _matrix(rows, device=None) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32, device=device)


def perspective(
    fovy: float = math.radians(45.0),
    aspect: float = 1.0,
    near: float = 0.1,
    far: float = 1000.0,
    device=None,
) -> torch.Tensor:
    """OpenGL perspective projection with y flipped, as nvdiffrec's ``util.perspective``.

    Args:
        fovy: vertical field of view in radians, in (0, pi).
        aspect: width / height (> 0).
        near, far: clip plane distances, ``0 < near < far``.

    Returns:
        [4, 4] float32 projection matrix.

    Raises:
        ValueError: naming the argument outside those ranges (the matrix would divide by zero
            or hold infinities).
    """
    if not 0 < fovy < math.pi:
        raise ValueError(f"fovy: expected radians in (0, pi), got {fovy!r}")
    if not aspect > 0:
        raise ValueError(f"aspect: expected width / height > 0, got {aspect!r}")
    if not near > 0:
        raise ValueError(f"near: expected a clip distance > 0, got {near!r}")
    if not far > near:
        raise ValueError(f"far: expected a clip distance beyond near ({near!r}), got {far!r}")
    y = math.tan(fovy / 2)
    return _matrix(
        [
            [1 / (y * aspect), 0, 0, 0],
            [0, -1 / y, 0, 0],
            [0, 0, -(far + near) / (far - near), -(2 * far * near) / (far - near)],
            [0, 0, -1, 0],
        ],
        device,
    )


def translate(x: float, y: float, z: float, device=None) -> torch.Tensor:
    """[4, 4] float32 translation by (x, y, z)."""
    return _matrix([[1, 0, 0, x], [0, 1, 0, y], [0, 0, 1, z], [0, 0, 0, 1]], device)


def rotate_x(angle: float, device=None) -> torch.Tensor:
    """[4, 4] float32 rotation about x by ``angle`` radians (nvdiffrec's sign convention)."""
    s, c = math.sin(angle), math.cos(angle)
    return _matrix([[1, 0, 0, 0], [0, c, s, 0], [0, -s, c, 0], [0, 0, 0, 1]], device)


def rotate_y(angle: float, device=None) -> torch.Tensor:
    """[4, 4] float32 rotation about y by ``angle`` radians (nvdiffrec's sign convention)."""
    s, c = math.sin(angle), math.cos(angle)
    return _matrix([[c, 0, s, 0], [0, 1, 0, 0], [-s, 0, c, 0], [0, 0, 0, 1]], device)


def look_at(eye, at, up=(0.0, 1.0, 0.0), device=None) -> torch.Tensor:
    """World-to-camera matrix of a camera at ``eye`` looking at ``at`` (camera looks down -z).

    Args:
        eye, at, up: 3-vectors (sequences or tensors).

    Returns:
        [4, 4] float32 model-view matrix ``rotate @ translate(-eye)``.
    """
    eye, at, up = (torch.as_tensor(t, dtype=torch.float32, device=device) for t in (eye, at, up))
    w = eye - at
    w = w / torch.linalg.norm(w)
    u = torch.linalg.cross(up, w)
    u = u / torch.linalg.norm(u)
    v = torch.linalg.cross(w, u)
    rotate = torch.eye(4, device=device)
    rotate[0, :3], rotate[1, :3], rotate[2, :3] = u, v, w
    shift = torch.eye(4, device=device)
    shift[:3, 3] = -eye
    return rotate @ shift


def fovx_to_fovy(fovx: float, aspect: float) -> float:
    """Vertical field of view from the horizontal one (radians); ``aspect`` = width / height."""
    return 2.0 * math.atan(math.tan(fovx / 2) / aspect)


def random_rotation_translation(
    max_translation: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Random rotation plus a uniform translation in [-t, t]^3, as nvdiffrec's util.

    Rows are built from Gaussian samples and orthogonalised by cross products (not a uniform
    draw from SO(3), but the distribution nvdiffrec trains with). Sampled in float64 on the CPU
    so that a seeded generator gives the same views on every device.
    """
    m = torch.randn(3, 3, generator=generator, dtype=torch.float64)
    m[1] = torch.linalg.cross(m[0], m[2])
    m[2] = torch.linalg.cross(m[0], m[1])
    m = m / torch.linalg.norm(m, dim=1, keepdim=True)
    out = torch.eye(4, dtype=torch.float64)
    out[:3, :3] = m
    t = torch.rand(3, generator=generator, dtype=torch.float64)
    out[:3, 3] = (2 * t - 1) * max_translation
    return out.float()


def cameras_from_mv(mv: torch.Tensor, proj: torch.Tensor) -> Cameras:
    """Cameras from [B, 4, 4] model-view matrices and one [4, 4] projection."""
    mvp = proj.to(mv.device) @ mv
    campos = torch.linalg.inv(mv)[:, :3, 3]
    return Cameras(mv=mv.contiguous(), mvp=mvp.contiguous(), campos=campos.contiguous())


def _check_views(n_views) -> None:
    try:
        count = None if isinstance(n_views, bool) else operator.index(n_views)
    except TypeError:
        count = None
    if count is None or count < 1:
        raise ValueError(f"n_views: expected an integer >= 1, got {n_views!r}")


def random_views(
    n_views: int,
    radius: float = 3.0,
    fovy: float = math.radians(45.0),
    aspect: float = 1.0,
    near: float = 0.1,
    far: float = 1000.0,
    max_translation: float = 0.25,
    generator: torch.Generator | None = None,
    device=None,
) -> Cameras:
    """Random training views as nvdiffrec's ``DatasetMesh._random_scene``.

    ``mv = translate(0, 0, -radius) @ random_rotation_translation(0.25)``: the object is rotated
    at random, jittered by up to ``max_translation`` and placed ``radius`` in front of the camera.
    ``n_views`` >= 1 (a ``ValueError`` naming it otherwise).
    """
    _check_views(n_views)
    mv = torch.stack(
        [
            translate(0, 0, -radius) @ random_rotation_translation(max_translation, generator)
            for _ in range(n_views)
        ]
    )
    return cameras_from_mv(mv.to(device), perspective(fovy, aspect, near, far, device))


def orbit_views(
    n_views: int,
    radius: float = 3.0,
    elevation: float = -0.4,
    fovy: float = math.radians(45.0),
    aspect: float = 1.0,
    near: float = 0.1,
    far: float = 1000.0,
    device=None,
) -> Cameras:
    """Evenly spaced views on an orbit, as nvdiffrec's ``DatasetMesh._rotate_scene``.

    ``mv = translate(0, 0, -radius) @ rotate_x(elevation) @ rotate_y(2 pi k / n_views)``;
    ``n_views`` >= 1 (a ``ValueError`` naming it otherwise).
    """
    _check_views(n_views)
    mv = torch.stack(
        [
            translate(0, 0, -radius) @ rotate_x(elevation) @ rotate_y(2 * math.pi * k / n_views)
            for k in range(n_views)
        ]
    )
    return cameras_from_mv(mv.to(device), perspective(fovy, aspect, near, far, device))
