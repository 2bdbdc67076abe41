"""Shared helpers of the benchmark scripts: timing and a description of the machine."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch

from mptex.report.markdown import markdown_table
from mptex.train.runinfo import cpu_model

__all__ = ["machine", "median_seconds", "print_table", "synchronize"]


def synchronize(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def median_seconds(
    fn: Callable[[], object], device="cpu", warmup: int = 2, repeats: int = 7
) -> float:
    """Median wall time of ``fn`` after ``warmup`` calls, synchronising the device around it."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def machine(device: torch.device | str = "cpu") -> str:
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return f"{name}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    threads = torch.get_num_threads()
    capability = torch.backends.cpu.get_cpu_capability()
    return (f"{cpu_model()}, {os.cpu_count()} cores ({capability}), {threads} torch threads, "
            f"torch {torch.__version__}")  # fmt: skip


def print_table(headers: list[str], rows: list[list[object]]) -> None:
    """Print a Markdown table."""
    print(markdown_table(headers, rows))
