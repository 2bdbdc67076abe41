"""Fit a fixed 3-D function with an :class:`~mptex.MLPTexture3D` under one precision arm: a
quick check of an arm, without a scene, a renderer or a training loop.

The target is a smooth 3-channel function with detail at several frequencies on [-1, 1]^3; each
step draws ``batch`` random points, takes an MSE loss and steps Adam (lr 1e-2, nvdiffrec's)
through the arm's :class:`~mptex.precision.PrecisionStepper`. PSNR is measured on a fixed set of
held-out points (``-10 log10(MSE)``, values in [0, 1]). Every arm starts from the same weights
(same seed). ``benchmarks/fit_arms.py`` prints the table of every arm.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from mptex.texture import MLPTexture3D

__all__ = ["SMALL_ENCODER", "fit_arm", "fit_target", "fit_psnr"]

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


def fit_target(points: torch.Tensor) -> torch.Tensor:
    """The fixed function to fit: ``[N, 3]`` in [-1, 1]^3 -> ``[N, 3]`` in [0, 1]."""
    x, y, z = points.unbind(-1)
    pi = math.pi
    channels = [
        torch.sin(2 * pi * x) * torch.cos(1.5 * pi * y) + 0.3 * torch.sin(7 * pi * z),
        torch.cos(3 * pi * (x + y)) * torch.sin(pi * z) + 0.2 * torch.sin(11 * pi * x * y),
        torch.sin(pi * (x - z)) + 0.4 * torch.cos(5 * pi * y) * torch.sin(4 * pi * z),
    ]
    return (torch.stack(channels, -1) / 1.4 * 0.5 + 0.5).clamp(0, 1)


def fit_psnr(pred: torch.Tensor, ref: torch.Tensor) -> float:
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
    eval_target = fit_target(eval_points)
    times, cpu_times, skipped, diverged, steps_run = [], [], 0, False, 0
    for _ in range(steps):
        steps_run += 1
        points = torch.rand(batch, 3, generator=gen) * 2 - 1
        start, cpu_start = time.perf_counter(), time.process_time()
        optimizer.zero_grad(set_to_none=True)
        loss = torch.mean((texture.sample(points) - fit_target(points)) ** 2)
        result = stepper(loss)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
        skipped += result.skipped
        if not math.isfinite(loss.item()) and stepper.scaler is None:
            diverged = True
            break
    with torch.no_grad():
        value = fit_psnr(texture.sample(eval_points), eval_target)
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
