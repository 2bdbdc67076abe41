"""Validation as nvdiffrec reports it (PSNR over the validation views, constant-colour
baseline), the output-sigmoid saturation on the same pixels, and the validation images."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mptex.diagnostics.saturation import saturation_statistics
from mptex.render.image import save_image
from mptex.scenes import Scene
from mptex.texture import MLPTexture3D
from mptex.train.losses import psnr
from mptex.train.shading import _background, _render, composite


# ----------------------------------------------------------------------------- validation
@torch.no_grad()
def evaluate(
    texture: MLPTexture3D, scene: Scene, settings: Mapping[str, Any], light_dir: torch.Tensor
) -> dict[str, Any]:
    """Validation as nvdiffrec reports it, plus the constant-colour baseline and the saturation.

    Returns:
        dict with ``psnr`` (mean over views), ``psnr_per_image`` (list), ``baseline_psnr`` (the
        best constant colour: the mean reference colour over covered pixels, rendered and
        scored the same way), and ``pred``/``ref`` ``[B, H, W, 3]`` composited linear images,
        upright: row 0 is the top of the picture (the camera's projection flips y, as
        nvdiffrec's, so rasterized row 0 is already the top), ready to display without a flip;
        ``saturation``: :func:`~mptex.diagnostics.saturation_statistics` of the texture's logits
        at the covered pixels of the validation views (the same pixels at every validation), its
        ``stuck_fraction`` against the reference's colour where ``shading`` is ``kd`` (there the
        rendered colour is the texture's value; None otherwise).
    """
    views = scene.val_views()
    shape = views.mask.shape + (3,)
    background = _background(settings["val_background"], shape, views.rgba.device, None)
    ref = composite(views.rgba[..., 0:3], views.rgba[..., 3:4], background)
    logits = []
    # The render's own forward: the saturation costs no second evaluation of the texture.
    hook = texture.net.register_forward_hook(lambda module, args, out: logits.append(out))
    try:
        pred, _ = _render(texture, views, settings, background, light_dir)
    finally:
        hook.remove()
    covered, kd = views.mask, settings["shading"] == "kd"
    saturation = saturation_statistics(
        torch.cat(logits).float(),
        # Under kd shading a covered pixel is opaque: pred there is the texture's kd.
        values=pred[covered] if kd else None,
        reference=views.rgba[..., 0:3][covered] if kd else None,
        # Where the reference is mostly background (alpha < 0.5) its colour is no target.
        valid=views.rgba[..., 3][covered] >= 0.5,
    )
    per_image = psnr(pred, ref)
    alpha = views.rgba[..., 3:4]
    mean_color = (views.rgba[..., 0:3] * alpha).sum((0, 1, 2)) / alpha.sum().clamp(min=1e-8)
    constant = composite(mean_color.expand(shape), views.mask.unsqueeze(-1).float(), background)
    return dict(
        psnr=float(per_image.mean().item()),
        psnr_per_image=[float(v) for v in per_image.cpu()],
        baseline_psnr=float(psnr(constant, ref).mean().item()),
        pred=pred,
        ref=ref,
        saturation=saturation,
    )


def _save_val_images(out_dir: Path, evaluation: dict, n_images: int) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    ref, pred = evaluation["ref"].cpu(), evaluation["pred"].cpu()
    for i in range(min(n_images, ref.shape[0])):
        # No flip: the projection already put the camera's up at row 0 (see evaluate).
        side = torch.cat([ref[i], pred[i]], dim=1)
        save_image(out_dir / f"val_{i:03d}.png", side, to_srgb=True)
