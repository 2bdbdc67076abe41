"""Rasterizer timings: torch (and nvdiffrast where present) on a ~20k-triangle mesh.

Run: ``python benchmarks/rasterize.py``. Prints a markdown table: what, size, median time,
throughput and machine.
"""

from __future__ import annotations

import functools
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, median_seconds  # noqa: E402

from mptex._backends import has_nvdiffrast  # noqa: E402
from mptex.render import orbit_views, rasterize  # noqa: E402
from mptex.scenes import GBufferCache, torus_knot  # noqa: E402
from mptex.scenes import gbuffer as gbuffer_module  # noqa: E402


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
                t = median_seconds(run, device)
                rows.append((f"rasterize {backend} ({device})", f"{n_tri} tris, {res}x{res}", t,
                             f"{n_tri / t / 1e6:.2f} Mtri/s, {res * res / t / 1e6:.1f} Mpix/s",
                             machine(device)))  # fmt: skip
        cache = GBufferCache(mesh.to(device), (256, 256), backend="auto")
        mvp = cams.mvp.to(device)

        def miss(cache=cache, mvp=mvp):
            cache.clear()
            gbuffer_module._SHARED.clear()  # else the process-wide store serves the view
            cache.get([0], mvp)

        t_miss = median_seconds(miss, device)
        cache.get([0], mvp)
        t_hit = median_seconds(functools.partial(cache.get, [0], mvp), device)
        rows.append((f"G-buffer miss ({device})", f"{n_tri} tris, 256x256", t_miss,
                     "rasterize + 2 interpolates", machine(device)))  # fmt: skip
        rows.append((f"G-buffer hit ({device})", "256x256", t_hit,
                     f"{t_miss / t_hit:.0f}x faster than a miss", machine(device)))  # fmt: skip

    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, nvdiffrast: {has_nvdiffrast()}")
    print("| what | size | median time | throughput | machine |")
    print("|---|---|---|---|---|")
    for what, size, t, thr, where in rows:
        ms = f"{t * 1e3:.2f} ms" if t >= 1e-3 else f"{t * 1e6:.1f} us"
        print(f"| {what} | {size} | {ms} | {thr} | {where} |")
    assert math.isfinite(rows[0][2])


if __name__ == "__main__":
    main()
