"""How f16 gradient underflow grows with the number of pixels in a training batch.

nvdiffrec's loss is a mean over the batch's pixels, so each surface point's gradient shrinks as
1 / (pixels per batch): at nvdiffrec's 512 x 512, batch 4 it is 32x smaller than at the CPU
protocol's 128 x 128, batch 2. The half arithmetic that #154 is about (the hash grid's f16
backward, the fused network's half accumulators and its half ``/ 128``) flushes what falls
below f16's range, so a gap absent at CPU scale may appear at nvdiffrec's.

This script takes trained checkpoints (e.g. the ``nvdiffrec154`` sweep's ``checkpoint.pt``),
renders one training batch of the run's scene at several resolutions, runs one forward and
backward of the run's training loss (nvdiffrec's alpha MSE + colour loss on the covered pixels;
no smoothness term) and prints the :class:`mptex.diagnostics.PrecisionMonitor` statistics: the
grid's incoming gradient (``encoder.out_grad_*``) and, for the fused twin, what its half
arithmetic flushed per layer (``net.<i>.fused_*``). Nothing is stepped.

Usage::

    python benchmarks/underflow_scale.py RUN_DIR [RUN_DIR ...] --resolutions 128 256 512 --batch 4
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, print_table  # noqa: E402

from mptex.diagnostics import PrecisionMonitor  # noqa: E402
from mptex.scenes import build_scene  # noqa: E402
from mptex.train import composite, image_loss, load_checkpoint  # noqa: E402
from mptex.train.checkpoint import TEXTURE_KEYS, texture_from_checkpoint  # noqa: E402
from mptex.train.shading import light_direction, render_batch  # noqa: E402

KEYS = (
    "encoder.out_grad_zero_frac",
    "encoder.out_grad_subnormal_frac",
    "net.0.fused_absorbed_frac",
    "net.0.fused_flushed_by_unscale_frac",
    "net.0.fused_zero_frac",
)


def batch_statistics(run_dir: Path, resolution: int, batch: int) -> dict[str, float]:
    """Monitor statistics of one training batch of ``run_dir``'s trained texture."""
    ckpt = load_checkpoint(run_dir / "checkpoint.pt", required=TEXTURE_KEYS)
    config = ckpt["config"]
    texture = texture_from_checkpoint(ckpt)
    scene_cfg = {**config["scene"], "resolution": resolution, "n_train_views": batch}
    scene = build_scene(scene_cfg)
    settings = config["train"]
    views = scene.sample_train_batch(batch, torch.Generator().manual_seed(0))
    background = torch.ones(views.mask.shape + (3,))  # masked out of the colour loss anyway
    light_dir = light_direction(settings)
    monitor = PrecisionMonitor(texture, every=1)
    monitor.start(0)
    pred, _ = render_batch(texture, views, settings, background, light_dir)
    ref_alpha = views.rgba[..., 3:4]
    ref = composite(views.rgba[..., 0:3], ref_alpha, background)
    loss = image_loss(pred * ref_alpha, ref * ref_alpha, settings["loss"])
    loss.backward()
    stats = monitor.collect()
    monitor.remove()
    stats["pixels"] = float(views.mask.numel())
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories with checkpoint.pt")
    parser.add_argument("--resolutions", nargs="+", type=int, default=[128, 256, 512])
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    rows = []
    for run_dir in args.runs:
        arm = load_checkpoint(run_dir / "checkpoint.pt")["precision"]["name"]
        for resolution in args.resolutions:
            stats = batch_statistics(run_dir, resolution, args.batch)
            rows.append([arm, f"{resolution}^2 x {args.batch}", f"{stats['pixels']:.0f}",
                         *(f"{stats[k]:.3f}" if k in stats else "–" for k in KEYS)])  # fmt: skip
    print(f"machine: {machine()}; one batch of each run's trained texture, nothing stepped")
    print_table(["arm", "views", "pixels", *KEYS], rows)


if __name__ == "__main__":
    main()
