"""nvdiffrec's learning-rate schedule, image losses and PSNR."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

# psnr lives with the sRGB conversion (mptex.bake measures with it too); re-exported here.
from mptex.render.image import psnr

__all__ = ["LR_SCHEDULES", "LOSSES", "lr_schedule", "image_loss", "psnr"]

LR_SCHEDULES = ("exponential", "cosine")


# ----------------------------------------------------------------------------- schedule, losses
def lr_schedule(
    iteration: int,
    warmup_iter: int = 0,
    lr_decay: float = 0.0002,
    kind: str = "exponential",
    iterations: int | None = None,
) -> float:
    """Learning-rate factor for 0-based ``iteration``.

    ``iteration / warmup_iter`` while ``iteration < warmup_iter``; then, for ``kind``:

    * ``"exponential"`` (nvdiffrec's ``lr_schedule``): ``10 ** (-lr_decay * (iteration -
      warmup_iter))``; with nvdiffrec's 0.0002 the rate falls 10x every 5000 iterations.
    * ``"cosine"``: ``0.5 * (1 + cos(pi * (iteration - warmup_iter) / (iterations -
      warmup_iter)))``, from 1 down to 0 at ``iterations`` (``lr_decay`` is not used). The run
      ends at a rate near 0, so its last iterations settle instead of oscillating, and its
      final PSNR is a property of the arm rather than of where the last step landed
      (docs/archive/lr-schedule.md).

    Args:
        iterations: the run's length; needed by ``"cosine"``.
    """
    if iteration < warmup_iter:
        return iteration / warmup_iter
    if kind == "exponential":
        return max(0.0, 10.0 ** (-(iteration - warmup_iter) * lr_decay))
    if kind != "cosine":
        raise ValueError(f"train.lr_schedule: expected one of {LR_SCHEDULES}, got {kind!r}")
    if iterations is None:
        raise ValueError("iterations: the cosine schedule needs the run's length")
    progress = min(1.0, (iteration - warmup_iter) / max(1, iterations - warmup_iter))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def _tonemap_srgb(f: torch.Tensor) -> torch.Tensor:
    # nvdiffrec's loss.py _tonemap_srgb (the sRGB curve without the clamp to [0, 1]).
    return torch.where(
        f > 0.0031308,
        torch.pow(torch.clamp(f, min=0.0031308), 1.0 / 2.4) * 1.055 - 0.055,
        12.92 * f,
    )


def _log_srgb(f: torch.Tensor) -> torch.Tensor:
    return _tonemap_srgb(torch.log(torch.clamp(f, min=0, max=65535) + 1))


def _l1(img, target):
    return torch.nn.functional.l1_loss(img, target)


def _mse(img, target):
    return torch.nn.functional.mse_loss(img, target)


def _smape(img, target, eps: float = 0.01):
    return torch.mean(torch.abs(img - target) / (torch.abs(img) + torch.abs(target) + eps))


def _relmse(img, target, eps: float = 0.1):
    return torch.mean((img - target) ** 2 / (img * img + target * target + eps))


# name -> (tonemapper or None, error); nvdiffrec's render/loss.py get_loss_fn.
LOSSES: dict[str, tuple[Callable | None, Callable]] = {
    "logl1": (_log_srgb, _l1),
    "logl2": (_log_srgb, _mse),
    "l1": (None, _l1),
    "mse": (None, _mse),
    "relmse": (None, _relmse),
    "smape": (None, _smape),
}


def image_loss(img: torch.Tensor, target: torch.Tensor, loss: str = "logl1") -> torch.Tensor:
    """nvdiffrec's image loss ``loss`` (a key of :data:`LOSSES`) between linear RGB images.

    Args:
        img, target: ``[..., 3]`` float32 linear RGB of the same shape.

    Returns:
        scalar float32, the mean over all elements.
    """
    if loss not in LOSSES:
        raise ValueError(f"train.loss: expected one of {sorted(LOSSES)}, got {loss!r}")
    tonemap, error = LOSSES[loss]
    if tonemap is not None:
        img, target = tonemap(img), tonemap(target)
    return error(img, target)
