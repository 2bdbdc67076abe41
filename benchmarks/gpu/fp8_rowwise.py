"""Row-wise scaled FP8 GEMMs on the GPU: mptex's emulation against ``torch._scaled_mm``'s
row-wise path, for ``benchmarks/gpu/validate.py`` to import.

:func:`compare_fp8_rowwise` quantises the operands of the MLP's three GEMM shapes with one scale
per row of ``a`` and per column of ``b`` (:func:`mptex.fp8.quantize_fp8_rowwise`; rows and
columns of magnitudes 1e-3 to 10 apart and one all-zero row, so that the scales differ), runs
:func:`mptex.fp8.scaled_mm_rowwise` with both backends on the same float8 tensors and scales,
and reports each backend's largest error against float64 as a share of
``sum_k |a_ik b_kj| |scale_a[i] scale_b[j]|``, the share of elements on which the two backends
agree bit for bit, and median times. Rows have ``compare_fp8``'s keys (validate.py) plus
``bit_equal_frac``. Where ``torch._scaled_mm``'s row-wise path has no float32 result
(:func:`mptex.fp8.has_fp8_tensor_cores` with ``rowwise``: ``--device cpu``, or a GPU other than
compute capability 9.x with CUDA 12.9+) the ``scaled_mm`` entries are None and only the
emulation is checked.

Bounds: the emulation sums exactly (float64) and rounds three times in float32 (the sum, then the
two scale multiplications), so its error is at most ``3 * 2^-24`` of the magnitude. The tensor
cores keep about 14 bits over a block of K before promoting the partial sum to float32
(DeepSeek-V3 technical report, section 3.3.2, measured on H800; blocks of 128 assumed), plus the
float32 roundings: ``min(K, 128) * 2^-14 + (K + 2) * 2^-24``.
"""

from __future__ import annotations

import functools
import time
from typing import Any

_ACCUMULATION_BITS = 14  # an FP8 tensor core's accumulator over one promotion block
_PROMOTION_BLOCK = 128


def rowwise_cases(n: int) -> list[tuple[str, int, int, int, str]]:
    """(name, M, K, N, dtype of a) of the MLP's GEMMs at a batch of ``n + 5`` points (``b`` is
    E4M3; validate.py's ``fp8_gemm_cases`` says why not a multiple of 16)."""
    rows = n + 5
    return [
        ("forward, hidden layer", rows, 32, 32, "e4m3"),
        ("forward, output layer", rows, 32, 3, "e4m3"),
        ("input gradient", rows, 32, 32, "e5m2"),
        ("input gradient, output layer", rows, 3, 32, "e5m2"),
        ("weight gradient", 32, rows, 32, "e5m2"),
        ("weight gradient, output layer", 3, rows, 32, "e5m2"),
    ]


def _operand(rows: int, cols: int, device: str, gen) -> Any:
    """``[rows, cols]`` f32 whose rows span magnitudes 1e-3 .. 10, row 0 all zero."""
    import torch

    x = torch.randn(rows, cols, device=device, generator=gen)
    x = x * 10.0 ** (torch.rand(rows, 1, device=device, generator=gen) * 4 - 3)
    x[0] = 0.0
    return x


def median_us(fn, device: str, repeats: int) -> float:
    """``fn()``'s median time in µs over ``repeats`` calls, the device synchronised around each."""
    import torch

    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        tick = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - tick)
    return sorted(times)[len(times) // 2] * 1e6


def compare_fp8_rowwise(device: str, n: int, repeats: int = 20) -> list[dict[str, Any]]:
    """Each case's emulated and ``torch._scaled_mm`` row-wise GEMM on the same operands and
    scales (module docstring).

    Args:
        device: ``"cuda"``, ``"cuda:0"`` or ``"cpu"`` (emulation only).
        n: the batch (rows of the activations; the weight gradient's K).
        repeats: timed calls per backend (the median is reported).

    Returns:
        One dict per case: ``case``, ``shape``, ``k``, ``emulated_err``, ``emulated_us``,
        ``emulated_bound``, ``scaled_mm_err``, ``scaled_mm_us``, ``scaled_mm_bound`` (None
        without FP8 tensor cores), ``bit_equal_frac`` and ``ok``.
    """
    import torch

    from mptex.fp8 import E4M3, E5M2, has_fp8_tensor_cores, quantize_fp8_rowwise
    from mptex.fp8 import scaled_mm_rowwise as gemm

    hardware = has_fp8_tensor_cores(device, rowwise=True)
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for name, m, k, n_cols, dtype_a in rowwise_cases(n):
        da = E5M2 if dtype_a == "e5m2" else E4M3
        qa, sa, _, _ = quantize_fp8_rowwise(_operand(m, k, device, gen), da)
        qb_t, sb_t, _, _ = quantize_fp8_rowwise(_operand(n_cols, k, device, gen), E4M3)
        qb, sb = qb_t.t(), sb_t.t()  # b's columns carry the scales
        scale = sa.double() * sb.double()  # [M, N]
        reference = (qa.double() @ qb.double()) * scale
        magnitude = ((qa.double().abs() @ qb.double().abs()) * scale.abs()).clamp_min(1e-300)
        row: dict[str, Any] = {"case": name, "shape": f"{m} x {k} x {n_cols}", "k": k}
        outs = {}
        for backend in ("emulated", "scaled_mm"):
            if backend == "scaled_mm" and not hardware:
                row.update(scaled_mm_err=None, scaled_mm_us=None)
                continue
            outs[backend] = out = gemm(qa, qb, sa, sb, backend=backend)
            row[f"{backend}_err"] = float(((out.double() - reference).abs() / magnitude).max())
            call = functools.partial(gemm, qa, qb, sa, sb, backend=backend)
            row[f"{backend}_us"] = median_us(call, device, repeats)
        row["emulated_bound"] = 3 * 2.0**-24
        row["scaled_mm_bound"] = (
            min(k, _PROMOTION_BLOCK) * 2.0**-_ACCUMULATION_BITS + (k + 2) * 2.0**-24
            if hardware
            else None
        )
        row["bit_equal_frac"] = (
            float((outs["scaled_mm"] == outs["emulated"]).double().mean()) if hardware else None
        )
        row["ok"] = row["emulated_err"] <= row["emulated_bound"] and (
            not hardware or row["scaled_mm_err"] <= row["scaled_mm_bound"]
        )
        rows.append(row)
    return rows


if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--n", type=int, default=65536)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    print(json.dumps(compare_fp8_rowwise(args.device, args.n, args.repeats), indent=1))
