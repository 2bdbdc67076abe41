"""Throughput of HashGridEncoding, forward and forward+backward, per backend and dtype.

Usage: python benchmarks/encoding.py [--device cpu|cuda] [--log2-points 16 18]

Config: nvdiffrec's (3-D, 16 levels, 2 features, log2 19, base 16, max resolution 4096).
Prints a Markdown table: what, size, median time, throughput (million points/s), machine.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, median_seconds, print_table  # noqa: E402

from mptex import HashGridEncoding, has_tcnn  # noqa: E402

NVDIFFREC = dict(
    n_levels=16,
    n_features_per_level=2,
    log2_hashmap_size=19,
    base_resolution=16,
    per_level_scale=float(np.exp(np.log(4096 / 16) / 15)),
)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--log2-points", type=int, nargs="+", default=[16, 18])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    device = torch.device(args.device)
    backends = ["torch"] + (["tcnn"] if device.type == "cuda" and has_tcnn() else [])
    rows = []
    for backend in backends:
        for dtype in (torch.float32, torch.float16):
            enc = HashGridEncoding(
                3, backend=backend, dtype=dtype, device=device, seed=0, **NVDIFFREC
            )
            for log2_points in args.log2_points:
                n = 2**log2_points
                x = torch.rand(n, 3, device=device, generator=None)

                def forward(enc=enc, x=x):
                    with torch.no_grad():
                        enc(x)

                def forward_backward(enc=enc, x=x):
                    enc.params.grad = None
                    enc(x).float().sum().backward()

                for name, fn in (("forward", forward), ("forward+backward", forward_backward)):
                    seconds = median_seconds(fn, device, repeats=args.repeats)
                    rows.append(
                        [
                            f"{backend} {str(dtype)[6:]} {name}",
                            f"2^{log2_points}",
                            f"{seconds * 1e3:.1f} ms",
                            f"{n / seconds / 1e6:.3f} Mpts/s",
                        ]
                    )
    print_table(["what", "points", "median time", "throughput"], rows)
    print(f"\nmachine: {machine(device)}")


if __name__ == "__main__":
    main()
