"""Throughput of HashGridEncoding, forward and forward+backward, per backend and dtype.

Usage: python benchmarks/encoding.py [--device cpu|cuda] [--log2-points 18 20]
       [--backends torch tcnn triton]

Config: nvdiffrec's (3-D, 16 levels, 2 features, log2 19, base 16, max resolution 4096).
Backends: the torch twin always; tcnn on CUDA where importable; triton where importable and
the device is a GPU, or on the CPU only under TRITON_INTERPRET=1 (Triton's interpreter: a
correctness tool, orders of magnitude slower, not a speed measurement). Skipped backends are
listed with the reason. Default sizes: 2^18 and 2^20 points on a GPU, 2^16 and 2^18 on a CPU.
Dtypes: float32, half mode and bfloat16 mode (torch and triton only: tcnn has no bfloat16 grid).
Prints a Markdown table: what, size, median time, throughput (million points/s), machine.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, median_seconds, print_table  # noqa: E402

from mptex import HashGridEncoding, has_tcnn, has_triton  # noqa: E402

NVDIFFREC = dict(
    n_levels=16,
    n_features_per_level=2,
    log2_hashmap_size=19,
    base_resolution=16,
    per_level_scale=float(np.exp(np.log(4096 / 16) / 15)),
)


def usable_backends(device: torch.device, wanted: list[str]) -> tuple[list[str], list[str]]:
    """(backends to run, "backend: why skipped" lines) for ``device``."""
    run, skipped = [], []
    for backend in wanted:
        if backend == "tcnn" and not (device.type == "cuda" and has_tcnn()):
            skipped.append("tcnn: needs tinycudann and a CUDA device")
        elif backend == "triton" and not has_triton():
            skipped.append("triton: not importable (pip install triton)")
        elif (
            backend == "triton"
            and device.type == "cpu"
            and os.environ.get("TRITON_INTERPRET", "0") != "1"
        ):
            skipped.append(
                "triton: CPU tensors run only under TRITON_INTERPRET=1 (the interpreter; "
                "slow, a correctness tool)"
            )
        else:
            run.append(backend)
    return run, skipped


def measure(
    device: torch.device, backends: list[str], log2_points: list[int], repeats: int = 7
) -> tuple[list[list[str]], dict]:
    """Time forward and forward+backward of every backend, dtype and size, in this process.

    Returns:
        (table rows: what, points, median time, throughput; ``{(backend, dtype, pass,
        log2_points): points per second}``).
    """
    rows, throughput = [], {}
    for backend in backends:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            if backend == "tcnn" and dtype == torch.bfloat16:
                continue  # tcnn has no bfloat16 grid
            enc = HashGridEncoding(
                3, backend=backend, dtype=dtype, device=device, seed=0, **NVDIFFREC
            )
            for log2 in log2_points:
                n = 2**log2
                x = torch.rand(n, 3, device=device, generator=None)

                # check_values=False: the input check reads a maximum back to the host, a
                # wait on the device in every call (the training loop skips it too)
                def forward(enc=enc, x=x):
                    with torch.no_grad():
                        enc(x, check_values=False)

                def forward_backward(enc=enc, x=x):
                    enc.params.grad = None
                    enc(x, check_values=False).float().sum().backward()

                for name, fn in (("forward", forward), ("forward+backward", forward_backward)):
                    seconds = median_seconds(fn, device, repeats=repeats)
                    throughput[backend, dtype, name, log2] = n / seconds
                    rows.append(
                        [
                            f"{backend} {str(dtype)[6:]} {name}",
                            f"2^{log2}",
                            f"{seconds * 1e3:.1f} ms",
                            f"{n / seconds / 1e6:.3f} Mpts/s",
                        ]
                    )
    return rows, throughput


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--log2-points", type=int, nargs="+", default=None)
    parser.add_argument("--backends", nargs="+", default=["torch", "tcnn", "triton"])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.log2_points is None:
        args.log2_points = [16, 18] if device.type == "cpu" else [18, 20]
    backends, skipped = usable_backends(device, args.backends)
    rows, throughput = measure(device, backends, args.log2_points, args.repeats)
    print_table(["what", "points", "median time", "throughput"], rows)
    print_ratios(throughput)
    print(f"\nmachine: {machine(device)}")
    if "triton" in backends and device.type == "cpu":
        print("triton ran under Triton's CPU interpreter: its rows are not a speed measurement")
    for line in skipped:
        print(f"skipped {line}")


def ratio_rows(throughput: dict) -> list[list[str]]:
    """triton's throughput over tcnn's and the twin's, per dtype, size and pass (the goals:
    >= 0.7x tcnn and >= 5x the twin, forward+backward on the same GPU)."""
    rows = []
    for (backend, dtype, name, log2_points), value in throughput.items():
        if backend != "triton":
            continue
        ratios = []
        for other in ("tcnn", "torch"):
            base = throughput.get((other, dtype, name, log2_points))
            ratios.append(f"{value / base:.2f}x" if base else "–")
        rows.append([f"{str(dtype)[6:]} {name}", f"2^{log2_points}", *ratios])
    return rows


RATIO_HEADERS = ["triton vs", "points", "tcnn", "torch twin"]


def print_ratios(throughput: dict) -> None:
    rows = ratio_rows(throughput)
    if rows:
        print()
        print_table(RATIO_HEADERS, rows)


if __name__ == "__main__":
    main()
