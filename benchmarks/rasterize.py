"""Rasterizer timings: torch (and nvdiffrast where present) on a ~20k-triangle mesh.

Run: ``python benchmarks/rasterize.py``. Prints a markdown table: what, size, median time,
throughput and machine.
"""

from __future__ import annotations

import functools
import math
import os
import platform
import statistics
import time

import torch

from mptex._backends import has_nvdiffrast
from mptex.render import orbit_views, rasterize
from mptex.scenes import GBufferCache, torus_knot


def _median_time(fn, device: str, repeats: int = 7) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _machine(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def main() -> None:
    mesh = torus_knot(400, 25)  # 20,000 triangles
    n_tri = mesh.t_pos_idx.shape[0]
    cams = orbit_views(1, radius=3.0, elevation=-0.4)
    v_hom = torch.nn.functional.pad(mesh.v_pos, (0, 1), value=1.0)
    rows = []
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        pos = (v_hom @ cams.mvp[0].T).unsqueeze(0).to(device)
        tri = mesh.t_pos_idx.to(device)
        backends = ["torch"] + (["nvdiffrast"] if device == "cuda" and has_nvdiffrast() else [])
        for backend in backends:
            for res in (256, 512):
                run = functools.partial(rasterize, pos, tri, (res, res), backend=backend)
                t = _median_time(run, device)
                rows.append((f"rasterize {backend} ({device})", f"{n_tri} tris, {res}x{res}", t,
                             f"{n_tri / t / 1e6:.2f} Mtri/s, {res * res / t / 1e6:.1f} Mpix/s",
                             _machine(device)))  # fmt: skip
        cache = GBufferCache(mesh.to(device), (256, 256), backend="auto")
        mvp = cams.mvp.to(device)

        def miss(cache=cache, mvp=mvp):
            cache.clear()
            cache.get([0], mvp)

        t_miss = _median_time(miss, device)
        cache.get([0], mvp)
        t_hit = _median_time(functools.partial(cache.get, [0], mvp), device)
        rows.append((f"G-buffer miss ({device})", f"{n_tri} tris, 256x256", t_miss,
                     "rasterize + 2 interpolates", _machine(device)))  # fmt: skip
        rows.append((f"G-buffer hit ({device})", "256x256", t_hit,
                     f"{t_miss / t_hit:.0f}x faster than a miss", _machine(device)))  # fmt: skip

    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, nvdiffrast: {has_nvdiffrast()}")
    print("| what | size | median time | throughput | machine |")
    print("|---|---|---|---|---|")
    for what, size, t, thr, machine in rows:
        ms = f"{t * 1e3:.2f} ms" if t >= 1e-3 else f"{t * 1e6:.1f} us"
        print(f"| {what} | {size} | {ms} | {thr} | {machine} |")
    assert math.isfinite(rows[0][2])


if __name__ == "__main__":
    main()
