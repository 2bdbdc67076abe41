"""Fit a fixed 3D function with MLPTexture3D under every precision arm; print PSNR and time per
step.

Usage::

    python benchmarks/fit_arms.py                    # all arms available here, 300 steps
    python benchmarks/fit_arms.py --steps 1000 --arms f32 f16_dynamic

The target is a smooth 3-channel function with detail at several frequencies on [-1, 1]^3; each
step draws ``--batch`` random points, takes an MSE loss and steps Adam (lr 1e-2, nvdiffrec's)
through the arm's :class:`mptex.PrecisionStepper`. PSNR is measured on a fixed set of held-out
points (``-10 log10(MSE)``, values in [0, 1]). Every arm starts from the same weights (same seed).
The fit itself is :func:`mptex.diagnostics.fit.fit_arm` (tests/test_texture.py runs it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, print_table  # noqa: E402

from mptex import PrecisionPolicy  # noqa: E402
from mptex.diagnostics.fit import SMALL_ENCODER, fit_arm  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arms", nargs="*", default=PrecisionPolicy.names())
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"# {machine()}; {args.steps} steps, batch {args.batch}, encoder {SMALL_ENCODER}")
    headers = [
        "arm",
        "PSNR (dB)",
        "median ms/step",
        "median CPU ms/step",
        "skipped steps",
        "final loss scale",
        "status",
    ]
    rows = []
    for arm in args.arms:
        ok, why = PrecisionPolicy.named(arm).availability()
        if not ok:
            rows.append([arm, "–", "–", "–", "–", "–", f"unavailable: {why}"])
            continue
        r = fit_arm(arm, steps=args.steps, batch=args.batch, seed=args.seed)
        status = f"diverged at step {r['steps_run']}" if r["diverged"] else "ok"
        rows.append([
            arm, f"{r['psnr']:.2f}", f"{1000 * r['median_step_s']:.1f}",
            f"{1000 * r['median_step_cpu_s']:.1f}", r["skipped"], f"{r['final_loss_scale']:g}",
            status,
        ])  # fmt: skip
        print(f"# {arm} done", file=sys.stderr, flush=True)
    print_table(headers, rows)


if __name__ == "__main__":
    main()
