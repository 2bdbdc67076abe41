"""How far apart two results are, in the units a backend comparison is judged in.

Used to compare mptex's twins with the native libraries they reproduce (tinycudann's grid and
fully fused network, nvdiffrast's rasterizer; ``benchmarks/gpu/validate.py``), where a relative
error hides what matters for half arithmetic: how many representable halves lie between them.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["half_ulps", "ulp_summary", "outside_tolerance"]

# torch.quantile refuses inputs above 2^24 elements; a summary of more is taken on a prefix.
_QUANTILE_LIMIT = 2**24


def half_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance between ``a`` and ``b`` in units in the last place of float16, elementwise.

    Both are rounded to float16 first; the distance counts the float16 values one must step
    through to go from one to the other (0 for equal values; +0 and -0 are equal; crossing zero
    counts the subnormals on both sides).

    Args:
        a, b: tensors of one shape, any floating dtype.

    Returns:
        int64 tensor of that shape; -1 where either member is inf or NaN.
    """
    if a.shape != b.shape:
        raise ValueError(f"a and b: expected one shape, got {list(a.shape)} and {list(b.shape)}")
    a16, b16 = a.to(torch.float16), b.to(torch.float16)

    def ordered(t: torch.Tensor) -> torch.Tensor:
        # float16 bits are sign-magnitude; negating the magnitude of negative values makes
        # the integers run in the same order as the values they encode.
        bits = t.view(torch.int16).to(torch.int64)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    dist = (ordered(a16) - ordered(b16)).abs()
    finite = torch.isfinite(a16) & torch.isfinite(b16)
    return torch.where(finite, dist, torch.full_like(dist, -1))


def ulp_summary(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
    """``median``, ``p99`` and ``max`` of :func:`half_ulps` over the finite pairs, ``equal`` (the
    share of pairs 0 ULPs apart) and ``nonfinite`` (the number of pairs with inf or NaN).

    The median and p99 of more than 2^24 pairs are taken over the first 2^24 (torch.quantile's
    limit); ``max`` and ``equal`` always cover every pair. Statistics are None with no finite
    pair."""
    dist = half_ulps(a.detach().flatten(), b.detach().flatten())
    finite = dist[dist >= 0].to(torch.float64)
    if finite.numel() == 0:
        return {"median": None, "p99": None, "max": None, "equal": None, "nonfinite": dist.numel()}
    head = finite[:_QUANTILE_LIMIT]
    return {
        "median": float(head.median()),
        "p99": float(torch.quantile(head, 0.99)),
        "max": float(finite.max()),
        "equal": float((finite == 0).double().mean()),
        "nonfinite": int((dist < 0).sum()),
    }


def outside_tolerance(
    actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float
) -> float:
    """Share of elements outside ``|actual - expected| <= atol + rtol * |expected|`` (the rule of
    ``torch.testing.assert_close``); a NaN on either side counts as outside."""
    actual, expected = actual.double(), expected.double()
    inside = (actual - expected).abs() <= atol + rtol * expected.abs()
    return float((~inside).double().mean()) if inside.numel() else 0.0
