"""The GPU kit's ``loss`` stage: the training loss's terms fused (Triton) vs eager.

:func:`compare_fused_loss` runs :func:`mptex.train.fused_loss.masked_image_loss` both ways on
the same inputs, nvdiffrec's batch at 512² (a prediction, a reference with alpha, a random
background), with a loss scale of 128 as the gradient: the share of ``dL/dpred`` elements that
are bit-equal (the claim: all of them on CUDA), the largest difference, both loss values and
the median time of a forward and backward each way, the host's launches included; then the
same for the kd smoothness term (:func:`mptex.train.fused_loss.kd_smoothness`).

On the CPU dry run (``--device cpu``) the kernels run under Triton's interpreter, which
evaluates ``log`` and ``pow`` in float64 rounded once, where torch's CPU functions may be an ulp
off: there the check is closeness (2e-6 relative), not bits, and the times mean nothing.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any


def compare_fused_loss(device: str, shape: tuple[int, ...], repeats: int = 20) -> list[dict]:
    """One row per loss in :data:`mptex.train.fused_loss.FUSED_LOSSES` (docstring above)."""
    on_cpu = device == "cpu"
    if on_cpu:  # the kernels' module is first imported here, in this stage's own process
        if "triton" in sys.modules:
            raise RuntimeError("triton was imported before its interpreter could be selected")
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from mptex.train import fused_loss

    def sync():
        if not on_cpu:
            torch.cuda.synchronize(device)

    gen = torch.Generator().manual_seed(0)
    pred = (torch.rand(*shape, 3, generator=gen) * 1.9 - 0.3).to(device)
    rgba = torch.rand(*shape, 4, generator=gen)
    rgba[..., 3] = torch.where(torch.rand(shape, generator=gen) > 0.4, 1.0, 0.0)
    rgba = rgba.to(device)
    background = torch.rand(*shape, 3, generator=gen).to(device)
    scale = torch.tensor(128.0, device=device)
    rows: list[dict[str, Any]] = []
    for loss in fused_loss.FUSED_LOSSES:

        def run(fused: bool, loss: str = loss):
            x = pred.clone().requires_grad_()
            tonemap = loss == "logl1"
            if fused and on_cpu:  # the interpreter lifts the kernels' CUDA requirement
                value = fused_loss._FusedMaskedLoss.apply(x, rgba, background, tonemap)
            else:
                value = fused_loss.masked_image_loss(x, rgba, background, loss, fused=fused)
            value.backward(scale)
            return value.detach(), x.grad

        results, times = _both_ways(run, repeats, sync)
        (eager_value, eager_grad), (fused_value, fused_grad) = results[False], results[True]
        equal = (fused_grad == eager_grad) | (fused_grad.isnan() & eager_grad.isnan())
        row = {
            "loss": loss,
            "elements": pred.numel(),
            "bit_equal": float(equal.float().mean()),
            "max_abs_diff": float((fused_grad - eager_grad).abs().max()),
            "eager_value": float(eager_value),
            "fused_value": float(fused_value),
            "eager_ms": times[False],
            "fused_ms": times[True],
        }
        if on_cpu:
            row["ok"] = bool(torch.allclose(fused_grad, eager_grad, rtol=2e-6, atol=0))
        else:
            row["ok"] = row["bit_equal"] == 1.0
        rows.append(row)
    rows.append(_smoothness_row(fused_loss, device, shape, scale, repeats, sync))
    return rows


def _both_ways(run, repeats: int, sync) -> tuple[dict, dict]:
    """``run(False)`` and ``run(True)``'s results, and each one's median time in ms over
    ``repeats`` synchronised calls."""
    results, times = {}, {}
    for fused in (False, True):
        results[fused] = run(fused)
        samples = []
        for _ in range(repeats):
            sync()
            tick = time.perf_counter()
            run(fused)
            sync()
            samples.append(time.perf_counter() - tick)
        times[fused] = sorted(samples)[len(samples) // 2] * 1e3
    return results, times


def _smoothness_row(fused_loss, device, shape, scale, repeats, sync) -> dict:
    """The kd smoothness term both ways, on as many points as a third of the pixels (the
    built-in scene's coverage), nine channels (its kd and the rest, which get no gradient)."""
    import torch

    pixels = 1
    for size in shape:
        pixels *= size
    gen = torch.Generator().manual_seed(1)
    tex = torch.rand(pixels // 3, 9, generator=gen)
    tex_jitter = (tex + torch.randn(tex.shape, generator=gen) * 0.01).to(device)
    tex = tex.to(device)

    def run(fused: bool):
        a, b = tex.clone().requires_grad_(), tex_jitter.clone().requires_grad_()
        if fused and device == "cpu":  # the interpreter lifts the kernels' CUDA requirement
            value = fused_loss._FusedSmoothness.apply(a, b, pixels)
        else:
            value = fused_loss.kd_smoothness(a, b, pixels, fused=fused)
        value.backward(scale)
        return value.detach(), torch.cat([a.grad, b.grad])

    results, times = _both_ways(run, repeats, sync)
    (eager_value, eager_grad), (fused_value, fused_grad) = results[False], results[True]
    bit_equal = float((fused_grad.view(torch.int32) == eager_grad.view(torch.int32)).float().mean())
    return {
        "loss": "kd smoothness",
        "elements": tex.numel(),
        "bit_equal": bit_equal,
        "max_abs_diff": float((fused_grad - eager_grad).abs().max()),
        "eager_value": float(eager_value),
        "fused_value": float(fused_value),
        "eager_ms": times[False],
        "fused_ms": times[True],
        "ok": bit_equal == 1.0,  # no log or pow: bit-equal under the interpreter too
    }
