"""The training loss's image and smoothness terms, eager or fused.

nvdiffrec's colour loss compares the prediction and the reference composited over the same
background, both multiplied by the reference alpha (``train.py``'s ``color_ref`` masking)::

    a = rgba[..., 3:4]
    ref = composite(rgba[..., :3], a, background)     # background + (rgb - background) * a
    loss = image_loss(pred * a, ref * a, loss)         # e.g. mean |T(pred a) - T(ref a)|

:func:`masked_image_loss` computes it so, in eager torch ops (the twin, everywhere), or with
``fused`` in two Triton kernels (:mod:`mptex.train._loss_triton`): one forward launch instead of
about twenty element-wise ops, one backward launch instead of as many again. On a GPU the
training iteration is bound by the host's launches (docs/gpu.md), so this is launches saved in
every arm. The fused backward performs autograd's float32 operations in the same order and
returns the same ``dL/dpred``, to the bit (the kernels' module docstring states how; the GPU kit
compares the two on the device); the loss value is summed in another order and may differ from
the eager one in its last bits.

The kd smoothness term (nvdiffrec's ``kd_grad``: the mean over the batch's pixels of each covered
point's ``sum(|kd(p + jitter) - kd(p)|) / 3``) is :func:`kd_smoothness`, fused the same way: one
forward and one backward launch for about a dozen ops, the same gradients bit for bit.

:func:`fused_loss_check` runs both paths once on a small batch on the device and compares their
gradients to the bit: the training loop uses the kernels only where that holds (the claim made
true on each machine, whatever its Triton, libdevice or GPU), and says so where it does not.

:func:`fused_loss_problem` says why the fused path cannot run for a device and loss (``None``
when it can): it needs a CUDA device, Triton with the compile option that keeps libdevice's
``log`` and ``pow`` from flushing subnormals, one of :data:`FUSED_LOSSES` (``logl1``,
nvdiffrec's default, and ``l1``; the other losses run eager) and, for ``logl1``, the libdevice
of a CUDA toolkit of torch's CUDA version
(:func:`mptex.train._loss_triton.torch_libdevice`).
"""

from __future__ import annotations

import functools
import math

import torch

from mptex._backends import has_triton
from mptex.train.losses import image_loss

__all__ = [
    "FUSED_LOSSES",
    "fused_loss_problem",
    "fused_loss_check",
    "masked_image_loss",
    "kd_smoothness",
]

# loss name -> whether the kernels apply nvdiffrec's log-sRGB tone map first.
_TONEMAP = {"logl1": True, "l1": False}
FUSED_LOSSES = tuple(_TONEMAP)


@functools.cache
def fused_loss_problem(device: torch.device | str, loss: str | None) -> str | None:
    """Why :func:`masked_image_loss` cannot run fused on ``device`` for ``loss`` (None: why
    :func:`kd_smoothness` cannot), in words that complete "needs ..."; None when it can.
    Cached: the fused calls ask it every iteration, and its answer is the process's."""
    if loss is not None and loss not in _TONEMAP:
        return f"a loss in {list(FUSED_LOSSES)} (got {loss!r}, which runs eager)"
    if torch.device(device).type != "cuda":
        return f"a CUDA device (got {torch.device(device)})"
    if not has_triton():
        return "triton (not importable)"
    from mptex.train._loss_triton import LAUNCH_OPTIONS

    if LAUNCH_OPTIONS is None:
        return "a Triton whose CUDA backend has the enable_reflect_ftz compile option"
    if loss is not None and _TONEMAP[loss]:
        from mptex.train._loss_triton import torch_libdevice

        path, why = torch_libdevice()
        return why if path is None else None
    return None


def _mean_by_reciprocal(device: torch.device) -> bool:
    """Whether torch divides by a host scalar (a mean's count) on ``device`` as a multiplication
    by its float32 reciprocal (CUDA) rather than by a division (the CPU): how the eager
    backward divides, which the kernels repeat (:func:`fused_loss_check` verifies it)."""
    return device.type == "cuda"


class _FusedMaskedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, pred, rgba, background, tonemap):
        from mptex.train._loss_triton import loss_partials

        ctx.save_for_backward(pred, rgba, background)
        ctx.tonemap = tonemap
        return loss_partials(pred, rgba, background, tonemap).sum() / pred.numel()

    @staticmethod
    def backward(ctx, grad):
        from mptex.train._loss_triton import loss_grad

        pred, rgba, background = ctx.saved_tensors
        reciprocal = _mean_by_reciprocal(pred.device)
        return loss_grad(pred, rgba, background, grad, ctx.tonemap, reciprocal), None, None, None


def masked_image_loss(
    pred: torch.Tensor,
    rgba: torch.Tensor,
    background: torch.Tensor,
    loss: str = "logl1",
    fused: bool = False,
) -> torch.Tensor:
    """``image_loss(pred * a, composite(rgba[..., :3], a, background) * a, loss)`` with ``a =
    rgba[..., 3:4]`` (module docstring).

    Args:
        pred: ``[..., 3]`` linear RGB prediction (any float dtype; the gradient flows to it).
        rgba: ``[..., 4]`` float32 reference, linear RGB and alpha.
        background: ``[..., 3]`` float32, the background both are composited over.
        loss: a key of :data:`mptex.train.losses.LOSSES`.
        fused: the Triton kernels; ``RuntimeError`` where :func:`fused_loss_problem` names a
            problem.

    Returns:
        scalar float32.
    """
    if fused:
        problem = fused_loss_problem(pred.device, loss)
        if problem is not None:
            raise RuntimeError(f"masked_image_loss: fused needs {problem}")
        return _FusedMaskedLoss.apply(pred, rgba, background, _TONEMAP[loss])
    alpha = rgba[..., 3:4]
    ref = background + (rgba[..., 0:3] - background) * alpha  # mptex.train.shading.composite
    return image_loss(pred * alpha, ref * alpha, loss)


class _FusedSmoothness(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tex, tex_jitter, pixels):
        from mptex.train._loss_triton import kd_partials

        ctx.save_for_backward(tex, tex_jitter)
        ctx.pixels = pixels
        return kd_partials(tex, tex_jitter).sum() / (3 * pixels)

    @staticmethod
    def backward(ctx, grad):
        from mptex.train._loss_triton import kd_grad

        tex, tex_jitter = ctx.saved_tensors
        reciprocal = _mean_by_reciprocal(tex.device)
        grad_jitter, grad_tex = kd_grad(tex, tex_jitter, grad, ctx.pixels, reciprocal)
        return grad_tex, grad_jitter, None


def kd_smoothness(
    tex: torch.Tensor, tex_jitter: torch.Tensor, pixels: int, fused: bool = False
) -> torch.Tensor:
    """nvdiffrec's kd smoothness term: ``sum(|tex_jitter[:, :3] - tex[:, :3]|, -1) / 3``
    summed over the points and divided by ``pixels`` (the batch's pixels: the mean over every
    pixel of a term that is zero on the background).

    Args:
        tex, tex_jitter: ``[N, C]`` texture values at the covered points and at the jittered
            points (C >= 3; the first three channels are kd); float32 for ``fused``.
        pixels: the batch's pixel count, > 0.
        fused: the Triton kernels (module docstring); ``RuntimeError`` where
            :func:`fused_loss_problem` names a problem for ``tex``'s device.

    Returns:
        scalar, ``tex``'s dtype.
    """
    if fused:
        problem = fused_loss_problem(tex.device, None)
        if problem is not None:
            raise RuntimeError(f"kd_smoothness: fused needs {problem}")
        return _FusedSmoothness.apply(tex, tex_jitter, pixels)
    per_point = torch.sum(torch.abs(tex_jitter[..., 0:3] - tex[..., 0:3]), dim=-1) / 3
    return per_point.sum() / pixels


def _device_fault(device: str, exc: Exception) -> bool:
    """Whether ``exc`` came with a fault of ``device`` itself (torch's "CUDA error: ...",
    Triton's "Triton Error [CUDA]: ..."), or the device can no longer synchronise after it."""
    if "CUDA error" in str(exc) or "Error [CUDA]" in str(exc):
        return True
    if torch.device(device).type != "cuda":
        return False
    try:
        torch.cuda.synchronize(device)
    except Exception:  # the context is broken: whatever raised first, it is a device fault
        return True
    return False


# fused_loss_check's gradient: over its 2 x 17 x 19 pixels, 120 / count and 120 * float32(1 /
# count) differ in float32 for both terms' counts (the image term's 1938 elements; the
# smoothness term's 646 pixels, then its division by 3).
_CHECK_GRADIENT = 120.0


@functools.cache
def fused_loss_check(device: str, loss: str) -> str | None:
    """Both terms of the loss for ``loss`` eager and fused on ``device``, once, on a small batch
    (two 17 x 19 views with a fractional alpha, a random background, 200 texture points of 9
    channels; a gradient of 120): None when every gradient is the eager one bit for bit, else
    what differs or what the kernels raised, in words that complete "needs ...". Cached per
    device and loss. The kernels must be able to run there (:func:`fused_loss_problem`).

    The sizes and the gradient are chosen so that dividing by the means' counts and multiplying
    by their float32 reciprocals round apart in both terms: the check tells whether the kernels
    divide as torch does on the device (:func:`_mean_by_reciprocal`). A power-of-two gradient
    over power-of-two counts (128 over 2 x 16 x 16 pixels) gives the same bits either way."""
    gen = torch.Generator().manual_seed(0)
    shape = (2, 17, 19)
    pred = torch.rand(*shape, 3, generator=gen) * 1.9 - 0.3
    rgba = torch.rand(*shape, 4, generator=gen)
    background = torch.rand(*shape, 3, generator=gen)
    tex = torch.rand(200, 9, generator=gen)
    tex_jitter = tex + torch.randn(200, 9, generator=gen) * 0.01
    inputs = [t.to(device) for t in (pred, rgba, background, tex, tex_jitter)]
    pred, rgba, background, tex, tex_jitter = inputs
    scale = torch.tensor(_CHECK_GRADIENT, device=device)
    pixels = math.prod(shape)

    def gradients(fused: bool) -> list[torch.Tensor]:
        x, a, b = (t.clone().requires_grad_() for t in (pred, tex, tex_jitter))
        if fused:
            image = _FusedMaskedLoss.apply(x, rgba, background, _TONEMAP[loss])
            smooth = _FusedSmoothness.apply(a, b, pixels)
        else:
            image = masked_image_loss(x, rgba, background, loss)
            smooth = kd_smoothness(a, b, pixels)
        (image + smooth).backward(scale)
        return [x.grad, a.grad, b.grad]

    try:
        eager, fused = gradients(False), gradients(True)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)  # a fault inside the kernels surfaces here
    except Exception as exc:  # the kernels' compile or launch on this machine
        if _device_fault(device, exc):
            # A fault on the device leaves its context unusable: the eager loss could not run
            # either, so this is the run's error, not a reason to fall back.
            raise
        raised = f"{type(exc).__name__}: {exc}".splitlines()[0]
        return f"kernels that run on {device} (they raised {raised})"
    for name, want, got in zip(("dL/dpred", "dL/dtex", "dL/dtex_jitter"), eager, fused,
                               strict=True):  # fmt: skip
        same = want.view(torch.int32) == got.view(torch.int32)
        if not bool(same.all()):
            return (f"the eager gradients bit for bit on {device}: {name} differs in "
                    f"{int((~same).sum())} of {same.numel()} elements")  # fmt: skip
    return None
