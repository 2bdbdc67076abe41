"""Host-side arithmetic for launching mptex's Triton kernels, kept cheap, and the device they
launch on.

Each training iteration launches a few dozen Triton kernels, and on a GPU their host-side work
is on the critical path. ``triton.cdiv`` is a ``constexpr_function`` in Triton 3.6 and 3.9:
called from host code it unwraps its arguments through Triton's machinery, 2.0 us per call on a
2-core AMD EPYC against 0.01 us for the integer expression (``timeit``, both versions).

Triton compiles a kernel again for each new combination of its integer arguments being
divisible by 16 or equal to 1, and the covered points change with every batch. The kernels
therefore take their batch-dependent integers that only bound loops or mask a strided axis
(block, tile and chunk counts, row counts of row-major tiles, the grid's point count) with
``do_not_specialize``: no compile depends on them. A batch-dependent bound of a contiguous
axis stays specialised, since knowing it divisible by 16 lets the compiler vectorise that
axis's accesses, and so do strides and padded widths: those sites compile two variants (a
batch size that is a multiple of 16 and one that is not). ``benchmarks/triton_launches.py``
counts the variants per launch site over batch sizes: at most 2, where up to 4 were compiled
before.

Triton launches a kernel on the current CUDA device, whatever device its tensors are on, so a
kernel for tensors on ``cuda:1`` launched while ``cuda:0`` is current reads the other device's
memory. The training loop, ``mptex-check``, ``mptex-export`` and ``mptex-rescore`` make their
run's device current (``launching_on``); every function that launches a kernel, and each
tinycudann forward (its bindings allocate and run on the current device too), also makes its
first tensor's device current while it runs (``on_operand_device``), so that a user's own code
on ``cuda:N`` needs no ``torch.cuda.device(N)``. Where the device is current already, the check
is one ``torch.cuda.current_device()`` call.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from mptex._backends import cuda_device_problem

__all__ = ["cdiv", "launching_on", "on_operand_device"]


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers, ``b > 0``."""
    return -(-a // b)


def launching_on(device: str | torch.device | None) -> contextlib.AbstractContextManager:
    """Within: ``device`` (``cuda:N``) is the current CUDA device. Triton launches its kernels
    on the current device and its stream, whatever device their tensors are on: work on
    ``cuda:1`` with ``cuda:0`` current would read another device's memory. Anything else (the
    CPU, ``cuda``, a value that is not a device, an index this machine does not have, for the
    caller's own check to name) changes nothing."""
    try:
        device = torch.device(device) if isinstance(device, (str, torch.device)) else None
    except RuntimeError:
        device = None
    if device is None or device.type != "cuda" or device.index is None:
        return contextlib.nullcontext()
    if cuda_device_problem(device, str(device)) is not None:
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def on_operand_device(launcher):
    """Decorator: ``launcher`` (a function that launches Triton kernels) runs with the device of
    its first tensor argument current, where that is a CUDA device other than the current one.
    Nothing changes for tensors on the CPU (Triton's interpreter) or on the current device."""

    @functools.wraps(launcher)
    def wrapper(*args, **kwargs):
        for arg in args:
            if isinstance(arg, torch.Tensor):
                device = arg.device
                if device.type == "cuda" and device.index != torch.cuda.current_device():
                    with torch.cuda.device(device):
                        return launcher(*args, **kwargs)
                break
        return launcher(*args, **kwargs)

    return wrapper
