"""Shading of texture samples, compositing over a background, and rendering views of a texture."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from mptex.texture import MLPTexture3D
from mptex.train.fused_loss import kd_smoothness

__all__ = ["shade", "light_direction", "composite", "draw_background", "render_batch"]

_BACKGROUNDS = ("random", "white", "black")
_SHADINGS = ("kd", "diffuse")


# ----------------------------------------------------------------------------- shading, PSNR
def shade(
    tex: torch.Tensor,
    normal: torch.Tensor | None,
    shading: str = "kd",
    light_dir: torch.Tensor | None = None,
    ambient: float = 0.25,
) -> torch.Tensor:
    """Colour of surface points from their texture values.

    ``"kd"``: the albedo, ``tex[..., 0:3]`` (nvdiffrec's ``kd`` buffer).
    ``"diffuse"`` (``channels=9``: kd, ks, normal as nvdiffrec's ``kd_ks_normal``)::

        n     = normalize(normal + 2 * tex[..., 6:9] - 1)   # the texture perturbs the normal
        color = kd * (ambient + (1 - ambient) * max(0, dot(n, light_dir)))

    The normal channels are a world-space offset (a sigmoid output of 0.5 leaves the
    geometric normal unchanged) because the G-buffer has no tangent frame for nvdiffrec's
    tangent-space normals; ``ks`` (channels 3:6) is not used: no specular term.

    Args:
        tex: ``[N, C]`` float32 texture values (C >= 3; 9 for ``"diffuse"``).
        normal: ``[N, 3]`` float32 unit geometric normals (``"diffuse"`` only; None for
            ``"kd"``).
        shading: ``"kd"`` or ``"diffuse"``.
        light_dir: ``[3]`` unit direction towards the light (``"diffuse"`` only).
        ambient: ambient fraction in [0, 1] (``"diffuse"`` only).

    Returns:
        ``[N, 3]`` float32 linear RGB.
    """
    kd = tex[..., 0:3]
    if shading == "kd":
        return kd
    if shading != "diffuse":
        raise ValueError(f"train.shading: expected one of {_SHADINGS}, got {shading!r}")
    if tex.shape[-1] < 9:
        raise ValueError("train.shading: 'diffuse' needs texture.channels=9 (kd, ks, normal)")
    n = torch.nn.functional.normalize(normal + 2.0 * tex[..., 6:9] - 1.0, dim=-1)
    cos = torch.clamp((n * light_dir).sum(-1, keepdim=True), min=0.0)
    return kd * (ambient + (1.0 - ambient) * cos)


def light_direction(settings: Mapping[str, Any], device=None) -> torch.Tensor:
    """``settings["light_dir"]`` (towards the light, world space) as a unit ``[3]`` float32."""
    direction = torch.tensor(settings["light_dir"], dtype=torch.float32, device=device)
    return torch.nn.functional.normalize(direction, dim=0)


def composite(rgb: torch.Tensor, alpha: torch.Tensor, background: torch.Tensor) -> torch.Tensor:
    """``lerp(background, rgb, alpha)``: ``[B, H, W, 3]`` over ``[B, H, W, 3]`` by ``[B, H, W, 1]``
    (nvdiffrec's ``prepare_batch``)."""
    return background + (rgb - background) * alpha


def draw_background(kind: str, shape, device, generator: torch.Generator | None) -> torch.Tensor:
    """A background image of ``shape`` (``[B, H, W, 3]``) float32: ones (``"white"``), zeros
    (``"black"``) or ``"random"``, uniform noise drawn from ``generator``."""
    if kind == "white":
        return torch.ones(shape, device=device)
    if kind == "black":
        return torch.zeros(shape, device=device)
    # nvdiffrec's 'random': independent uniform noise per pixel and channel.
    return torch.rand(shape, device=device, generator=generator)


def render_batch(
    texture: MLPTexture3D,
    views,
    settings: Mapping[str, Any],
    background: torch.Tensor,
    light_dir: torch.Tensor,
    jitter: Callable[[torch.Tensor], torch.Tensor] | None = None,
    fused: bool = False,
    joint: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Shaded prediction ``[B, H, W, 3]`` composited over ``background`` and the kd smoothness
    term (mean over all pixels of the covered points' kd gradient; None without ``jitter``).

    ``views``: a :class:`~mptex.scenes.ViewBatch`, or a :class:`~mptex.scenes.TrainingBatch`
    whose covered pixels (indices, points, normals) were gathered beforehand: the same values,
    without the ``nonzero`` that would make the host wait for a device. ``fused``: the
    smoothness term in its Triton kernels (:func:`mptex.train.fused_loss.kd_smoothness`).
    ``joint`` (with ``jitter``): one texture forward on the covered points and their jittered
    copies together, ``[2N, 3]``, split after (``train.kd_smooth_joint``); else two forwards,
    the points' then the jittered copies'.
    """
    if hasattr(views, "covered"):  # a TrainingBatch
        covered, points, coverage = views.covered, views.points, views.coverage
        normal = views.normals if settings["shading"] != "kd" else None
        shape = coverage.shape[:-1]
    else:
        mask = views.mask
        # Only covered pixels reach the texture: their indices once, for the points, the
        # normals (diffuse shading only) and the image (the same gathers and scatter as
        # boolean indexing).
        covered = mask.reshape(-1).nonzero().squeeze(1)
        points = views.position.reshape(-1, 3).index_select(0, covered)  # [N, 3]
        normal = (views.gbuffer.normal.reshape(-1, 3).index_select(0, covered)
                  if settings["shading"] != "kd" else None)  # fmt: skip
        coverage, shape = None, mask.shape
    # Training positions come from the G-buffers (finite): the texture's NaN check, a read of
    # the device, is left out there.
    check = not hasattr(views, "covered")
    joint = joint and jitter is not None
    if joint:
        # One pass through the grid and the MLP (forward and backward) instead of two: each
        # costs the host a fixed number of kernel launches, whatever its number of points. The
        # noise is drawn from the same generator at the same point of the iteration.
        n = points.shape[0]
        both = texture.sample(torch.cat([points, jitter(points)]), check=check)
        tex, tex_jitter = both.split([n, n])
    else:
        tex = texture.sample(points, check=check)
    color = shade(tex, normal, settings["shading"], light_dir, settings["ambient"])
    pixels = math.prod(shape)
    image = torch.zeros(pixels, 3, device=points.device, dtype=color.dtype)
    image = image.index_copy(0, covered, color).view(*shape, 3)
    if coverage is None or coverage.dtype != image.dtype:
        coverage = (views.mask.unsqueeze(-1) if coverage is None else coverage).to(image.dtype)
    pred = composite(image, coverage, background)
    kd_grad = None
    if jitter is not None:
        if not joint:
            tex_jitter = texture.sample(jitter(points), check=check)
        # nvdiffrec: mean over every pixel of kd_grad * alpha (zero on background).
        kd_grad = kd_smoothness(tex, tex_jitter, pixels, fused=fused)
    return pred, kd_grad
