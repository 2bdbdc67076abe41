"""Gradient flow: every trainable parameter receives a finite, non-zero gradient."""

from __future__ import annotations

import torch
from torch import nn

from mptex.host import to_host


# --------------------------------------------------------------------------- gradient flow
def check_gradient_flow(
    module: nn.Module, loss: torch.Tensor, retain_graph: bool = False
) -> list[str]:
    """Problems with the gradient ``loss`` sends to each trainable parameter of ``module``.

    Uses ``torch.autograd.grad`` (``allow_unused=True``), so ``.grad`` is left untouched.

    Args:
        module: its parameters with ``requires_grad`` are checked, named as in
            ``named_parameters()``.
        loss: a scalar tensor computed from ``module``.
        retain_graph: keep the graph for a later backward.

    Returns:
        One line per problem, ``"<name>: <what>"``, empty when all is well: no gradient (the
        parameter is not in ``loss``'s graph: a detached tensor, ``torch.no_grad``, a
        non-differentiable op upstream of it), inf/NaN elements, or an all-zero gradient.

    Raises:
        ValueError: ``loss`` is not a scalar tensor that requires grad (a graph broken
            before the loss is reached).
    """
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(f"loss: expected a scalar tensor, got {loss!r}")
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("module: has no trainable parameters")
    if not loss.requires_grad:
        raise ValueError(
            "loss: does not require grad, so no parameter gets a gradient (computed under "
            "torch.no_grad, or every path from the parameters to it is detached)"
        )
    grads = torch.autograd.grad(
        loss, [p for _, p in named], retain_graph=retain_graph, allow_unused=True
    )
    present = [(name, g) for (name, _), g in zip(named, grads) if g is not None]
    problems = {
        name: "no gradient (not in the loss's graph: detached, no_grad or non-differentiable)"
        for (name, _), g in zip(named, grads)
        if g is None
    }
    if present:
        # One host copy for all parameters: [non-finite count, non-zero count, numel] each.
        summary = torch.stack(
            [
                torch.stack(
                    [
                        (~torch.isfinite(g)).sum(),
                        (g != 0).sum(),
                        torch.tensor(g.numel(), device=g.device),
                    ]
                ).to(present[0][1].device)
                for _, g in present
            ]
        )
        for (name, _), (nonfinite, nonzero, numel) in zip(present, to_host(summary).tolist()):
            if nonfinite:
                problems[name] = f"inf/NaN gradient in {nonfinite} of {numel} elements"
            elif not nonzero:
                problems[name] = f"all-zero gradient ({numel} elements)"
    return [f"{name}: {problems[name]}" for name, _ in named if name in problems]
