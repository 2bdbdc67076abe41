"""The GPU kit's ``loss`` stage: the training loss's terms fused (Triton) vs eager.

:func:`compare_fused_loss` runs :func:`mptex.train.fused_loss.masked_image_loss` both ways on
the same inputs, nvdiffrec's batch at 512² (a prediction, a reference with alpha, a random
background), with a gradient of :data:`GRADIENT`: the share of ``dL/dpred`` elements that
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
from typing import Any

# The stage's batch on a GPU (nvdiffrec's: 4 views at 512²) and on the CPU dry run.
SHAPE = (4, 512, 512)
DRY_RUN_SHAPE = (1, 8, 8)
# dL/dloss: for both batches' element and pixel counts, 100 / count and 100 * float32(1 /
# count) round apart (as do the smoothness term's next division by 3 and its reciprocal), so
# the comparison tells whether the kernels divide the means' gradients as torch does on the
# device. A power of two (128) gives the same bits either way at these counts.
GRADIENT = 100.0


def compare_fused_loss(device: str, shape: tuple[int, ...], repeats: int = 20) -> list[dict]:
    """One row per loss in :data:`mptex.train.fused_loss.FUSED_LOSSES`, then one for the
    smoothness term (docstring above)."""
    on_cpu = device == "cpu"
    if on_cpu:  # the kernels' module is first imported here, in this stage's own process
        if "triton" in sys.modules:
            raise RuntimeError("triton was imported before its interpreter could be selected")
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from mptex.train import fused_loss

    gen = torch.Generator().manual_seed(0)
    pred = (torch.rand(*shape, 3, generator=gen) * 1.9 - 0.3).to(device)
    rgba = torch.rand(*shape, 4, generator=gen)
    rgba[..., 3] = torch.where(torch.rand(shape, generator=gen) > 0.4, 1.0, 0.0)
    rgba = rgba.to(device)
    background = torch.rand(*shape, 3, generator=gen).to(device)
    scale = torch.tensor(GRADIENT, device=device)
    rows: list[dict[str, Any]] = []
    for loss in fused_loss.FUSED_LOSSES:

        def run(fused: bool, loss: str = loss):
            x = pred.clone().requires_grad_()
            if fused and on_cpu:  # the interpreter lifts the kernels' CUDA requirement
                value = fused_loss._FusedMaskedLoss.apply(x, rgba, background, loss == "logl1")
            else:
                value = fused_loss.masked_image_loss(x, rgba, background, loss, fused=fused)
            value.backward(scale)
            return value.detach(), x.grad

        # Interpreted, log and pow are correctly rounded where the CPU's are an ulp off at
        # times: closeness there, the bits on a GPU.
        rows.append(_both_ways(loss, pred.numel(), run, device, repeats, exact=not on_cpu))
    pixels = 1
    for size in shape:
        pixels *= size
    # The smoothness term on as many points as a third of the pixels (the built-in scene's
    # coverage), nine channels (its kd and the rest, which get no gradient).
    tex = torch.rand(pixels // 3, 9, generator=gen)
    tex_jitter = tex + torch.randn(tex.shape, generator=gen) * 0.01
    # Every 50th point unmoved by its jitter (a saturated texture's output does this): a zero
    # difference, whose gradient with respect to tex is -0 in eager torch (its neg), which the
    # kernel must give as well.
    tex_jitter[::50] = tex[::50]
    tex, tex_jitter = tex.to(device), tex_jitter.to(device)

    def smoothness(fused: bool):
        a, b = tex.clone().requires_grad_(), tex_jitter.clone().requires_grad_()
        if fused and on_cpu:
            value = fused_loss._FusedSmoothness.apply(a, b, pixels)
        else:
            value = fused_loss.kd_smoothness(a, b, pixels, fused=fused)
        value.backward(scale)
        return value.detach(), torch.cat([a.grad, b.grad])

    # No log or pow: bit-equal under the interpreter too.
    rows.append(_both_ways("kd smoothness", tex.numel(), smoothness, device, repeats, exact=True))
    return rows


def _both_ways(name: str, elements: int, run, device: str, repeats: int, exact: bool) -> dict:
    """The row of one term: ``run(False)`` (eager) and ``run(True)`` (fused), each returning
    ``(loss value, gradient)``, compared bit by bit, and each one's median time in ms; ``ok``:
    every element bit-equal (``exact``) or within 2e-6."""
    import torch
    from fp8_rowwise import median_us  # benchmarks/gpu/fp8_rowwise.py

    (eager_value, eager), (fused_value, fused) = run(False), run(True)
    bit_equal = float((fused.view(torch.int32) == eager.view(torch.int32)).float().mean())
    close = bool(torch.allclose(fused, eager, rtol=2e-6, atol=0, equal_nan=True))
    return {
        "loss": name,
        "elements": elements,
        "bit_equal": bit_equal,
        "max_abs_diff": float((fused - eager).abs().max()),
        "eager_value": float(eager_value),
        "fused_value": float(fused_value),
        "eager_ms": median_us(lambda: run(False), device, repeats) / 1e3,
        "fused_ms": median_us(lambda: run(True), device, repeats) / 1e3,
        "ok": bit_equal == 1.0 if exact else close,
    }
