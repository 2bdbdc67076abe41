"""What one call of each FP8 building block costs the host, for the GPU kit's ``fp8`` stage.

On an H200 the FP8 GEMM arms took 2.2-3.6x ``f32``'s time per iteration while their host floor
on a CPU was 1.7-2.2x and their op count 1.6-2.6x: some of their calls cost the GPU's host far
more than an op of ``f32`` does. :func:`host_costs` times, for each building block at the
training batch's size (``rows`` covered points, the MLP's width 32), ``calls`` calls issued back
to back without waiting for the device, as a training iteration issues them: the host's time per
call (the queue is drained before and after, untimed) and, from CUDA events around the same
calls, the device's. A block whose host time is well above ``torch.add``'s is expensive to issue;
``torch._scaled_mm`` is timed with the same ``M`` each call and with ``M`` one row more each call
(the covered points change with every batch), which tells a cost that depends on new shapes
(cuBLASLt chooses an algorithm per shape) from one that does not. The same GEMMs through the
``triton`` backend (:mod:`mptex._fp8_mm_triton`: no operand copies, one launch; two for the
weight gradient) come last.

On the CPU dry run the same calls run on the CPU (``mptex::fp8_quantize``'s C kernel, the CPU's
``torch._scaled_mm``); the numbers say nothing about a GPU.
"""

from __future__ import annotations

import time
from typing import Any


def host_costs(device: str, rows: int, calls: int = 200) -> list[dict[str, Any]]:
    """One row per building block: ``what``, ``host_us`` and ``device_us`` per call (device
    None off CUDA)."""
    import torch

    from mptex._fp8_fused import RECIPE_CODES, fp8_quantize
    from mptex.fp8 import E4M3, E5M2, scaled_mm

    on_cuda = device.startswith("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(rows + calls, 32, device=device, generator=gen)
    w = torch.randn(32, 32, device=device, generator=gen)
    one = torch.ones((), device=device)
    history = torch.zeros(1024, device=device)
    empty = x.new_empty(0)
    x_q = x.to(E4M3)
    w_q = w.to(E4M3)
    g_q = x.to(E5M2)

    def quantize(recipe: str, record: bool, tensor=x[:rows], pads=()):
        scale, hist = (one, history) if recipe == "delayed" else (empty, empty)
        return lambda i: fp8_quantize(tensor, scale, hist, 0, RECIPE_CODES[recipe], 0, False,
                                      record, E4M3, *pads)  # fmt: skip

    def triton_floor(i):  # the cheapest Triton launch mptex makes: a padded copy of one byte
        from mptex._fp8_layout_triton import padded_copy

        return padded_copy(x_q[:1, :1], 16, 16, False)

    blocks = [
        ("torch.add of two scalars (a launch's floor)", lambda i: one + one),
        ("torch.mm f32, [M, 32] x [32, 32]", lambda i: torch.mm(x[:rows], w)),
        ("torch.mm f32, M one row more each call", lambda i: torch.mm(x[: rows + i], w)),
        ("fp8_quantize [M, 32], current scaling", quantize("current", True)),
        ("fp8_quantize [M, 32], delayed, recording", quantize("delayed", True)),
        ("fp8_quantize [32, 32] weight, delayed, recording", quantize("delayed", True, w)),
        ("fp8_quantize [M, 32], row-wise", quantize("rowwise", True)),
        ("fp8_quantize [M, 32], row-wise, and its transpose (q_pad, t_pad 16)",
         quantize("rowwise", True, pads=(16, 16))),
        ("fp8_quantize [32, 32] weight, row-wise, and its transpose",
         quantize("rowwise", True, w, pads=(16, 16))),
        ("fp8_quantize [M, 32], current scaling, and its transpose (q_pad, t_pad 16)",
         quantize("current", True, pads=(16, 16))),
        ("scaled_mm forward [M, 32] x [32, 32]",
         lambda i: scaled_mm(x_q[:rows], w_q.t(), one, one)),
        ("scaled_mm forward, M one row more each call",
         lambda i: scaled_mm(x_q[: rows + i], w_q.t(), one, one)),
        ("scaled_mm weight gradient [32, M] x [M, 32]",
         lambda i: scaled_mm(g_q[:rows].t(), x_q[:rows], one, one)),
        ("a Triton launch (mptex's padded copy of a [1, 1] FP8 operand)", triton_floor),
        ("Triton FP8 GEMM forward [M, 32] x [32, 32]",
         lambda i: scaled_mm(x_q[:rows], w_q.t(), one, one, backend="triton")),
        ("Triton FP8 GEMM forward, M one row more each call",
         lambda i: scaled_mm(x_q[: rows + i], w_q.t(), one, one, backend="triton")),
        ("Triton FP8 GEMM weight gradient [32, M] x [M, 32]",
         lambda i: scaled_mm(g_q[:rows].t(), x_q[:rows], one, one, backend="triton")),
    ]  # fmt: skip
    cycles_per_ms = _sleep_rate(device) if on_cuda else None
    rows_out = []
    for what, call in blocks:
        try:
            host_us, device_us = _per_call(call, calls, device, cycles_per_ms)
            rows_out.append({"what": what, "host_us": host_us, "device_us": device_us})
        except Exception as exc:  # a block this device cannot run is a row, not the stage's end
            rows_out.append({"what": what, "error": f"{type(exc).__name__}: {exc}".splitlines()[0]})
    return rows_out


def _sleep_rate(device: str) -> float:
    """GPU clock cycles per millisecond of ``torch.cuda._sleep``, measured."""
    import torch

    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10**7)
    end.record()
    torch.cuda.synchronize(device)
    return 10**7 / max(start.elapsed_time(end), 1e-3)


def _per_call(call, calls: int, device: str, cycles_per_ms: float | None):
    """``(host µs, device µs or None)`` per call of ``call(i)`` over ``calls`` calls. The host's:
    the calls issued back to back, the queue drained before and after. The device's: the same
    calls queued behind a sleeping kernel long enough for the host to issue them all, so that
    CUDA events around them time their execution without the host's gaps."""
    import torch

    on_cuda = cycles_per_ms is not None
    for i in range(3):  # first calls: compilation, cuBLASLt's first choice
        call(i)
    if on_cuda:
        torch.cuda.synchronize(device)
    tick = time.perf_counter()
    for i in range(calls):
        call(i)
    host_s = time.perf_counter() - tick
    if not on_cuda:
        return host_s * 1e6 / calls, None
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(cycles_per_ms * (2e3 * host_s + 5.0)))
    start.record()
    for i in range(calls):
        call(i)
    end.record()
    torch.cuda.synchronize(device)
    return host_s * 1e6 / calls, start.elapsed_time(end) * 1e3 / calls
