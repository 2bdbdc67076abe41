"""Fit a fixed 3D function with MLPTexture3D under every precision arm; print PSNR and time per
step.

Usage::

    python benchmarks/fit_arms.py                    # all arms available here, 300 steps
    python benchmarks/fit_arms.py --steps 1000 --arms f32 f16_dynamic

The target is a smooth 3-channel function with detail at several frequencies on [-1, 1]^3; each
step draws ``--batch`` random points, takes an MSE loss and steps Adam (lr 1e-2, nvdiffrec's)
through the arm's :class:`mptex.PrecisionStepper`. PSNR is measured on a fixed set of held-out
points (``-10 log10(MSE)``, values in [0, 1]). Every arm starts from the same weights (same seed).
The test suite imports :func:`fit_arm` from this file (tests/test_texture.py).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, print_table  # noqa: E402

from mptex import MLPTexture3D, PrecisionPolicy  # noqa: E402

# Small grid for CPU speed: 8 levels, 2^14 entries, resolutions 4 .. ~68.
SMALL_ENCODER = {
    "otype": "HashGrid",
    "n_levels": 8,
    "n_features_per_level": 2,
    "log2_hashmap_size": 14,
    "base_resolution": 4,
    "per_level_scale": 1.5,
}
AABB = [[-1.0, -1.0, -1.0], [1.0, 1.0, 1.0]]


def target(points: torch.Tensor) -> torch.Tensor:
    """The fixed function to fit: ``[N, 3]`` in [-1, 1]^3 -> ``[N, 3]`` in [0, 1]."""
    x, y, z = points.unbind(-1)
    pi = math.pi
    channels = [
        torch.sin(2 * pi * x) * torch.cos(1.5 * pi * y) + 0.3 * torch.sin(7 * pi * z),
        torch.cos(3 * pi * (x + y)) * torch.sin(pi * z) + 0.2 * torch.sin(11 * pi * x * y),
        torch.sin(pi * (x - z)) + 0.4 * torch.cos(5 * pi * y) * torch.sin(4 * pi * z),
    ]
    return (torch.stack(channels, -1) / 1.4 * 0.5 + 0.5).clamp(0, 1)


def psnr(pred: torch.Tensor, ref: torch.Tensor) -> float:
    """``-10 log10(MSE)`` for values in [0, 1]; ``nan`` when the prediction is not finite."""
    mse = torch.mean((pred.double() - ref.double()) ** 2).item()
    return float("nan") if not math.isfinite(mse) else -10.0 * math.log10(max(mse, 1e-30))


def fit_arm(
    arm: str,
    steps: int = 300,
    batch: int = 4096,
    seed: int = 0,
    encoder: dict | None = None,
    lr: float = 1e-2,
    n_eval: int = 16384,
) -> dict:
    """Train one arm; returns ``psnr``, ``median_step_s`` (wall), ``median_step_cpu_s`` (process
    CPU time, all threads: robust to other jobs on the machine), ``skipped``, ``final_loss_scale``,
    ``diverged`` (a non-finite loss with no loss scaling to catch it) and ``steps_run``."""
    torch.manual_seed(seed)
    texture = MLPTexture3D(AABB, precision=arm, encoder=encoder or SMALL_ENCODER, backend="torch")
    optimizer = torch.optim.Adam(texture.parameters(), lr=lr)
    stepper = texture.policy.stepper(optimizer)
    gen = torch.Generator().manual_seed(seed + 1)
    eval_points = torch.rand(n_eval, 3, generator=gen) * 2 - 1
    eval_target = target(eval_points)
    times, cpu_times, skipped, diverged, steps_run = [], [], 0, False, 0
    for _ in range(steps):
        steps_run += 1
        points = torch.rand(batch, 3, generator=gen) * 2 - 1
        start, cpu_start = time.perf_counter(), time.process_time()
        optimizer.zero_grad(set_to_none=True)
        loss = torch.mean((texture.sample(points) - target(points)) ** 2)
        result = stepper(loss)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
        skipped += result.skipped
        if not math.isfinite(loss.item()) and stepper.scaler is None:
            diverged = True
            break
    with torch.no_grad():
        value = psnr(texture.sample(eval_points), eval_target)
    return {
        "arm": arm,
        "psnr": value,
        "median_step_s": statistics.median(times),
        "median_step_cpu_s": statistics.median(cpu_times),
        "skipped": skipped,
        "final_loss_scale": stepper.loss_scale,
        "diverged": diverged or not math.isfinite(value),
        "steps_run": steps_run,
    }


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
