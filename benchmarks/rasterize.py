"""Rasterizer timings: torch (and nvdiffrast where present) on a ~20k-triangle mesh, and the
torch rasterizer's time and peak memory on a 1M-triangle height field drawn 16 views at once.

Run: ``python benchmarks/rasterize.py``. Prints a markdown table: what, size, median time,
throughput (and, for the large mesh, peak resident memory) and machine.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, median_seconds  # noqa: E402

from mptex._backends import has_nvdiffrast  # noqa: E402
from mptex.render import orbit_views, random_views, rasterize  # noqa: E402
from mptex.scenes import GBufferCache, torus_knot  # noqa: E402
from mptex.scenes import gbuffer as gbuffer_module  # noqa: E402
from mptex.train.memory import RunPeakRss  # noqa: E402

# The large mesh: a height field of 708 x 708 vertices (999,698 triangles, as a scanned
# terrain or a dense photogrammetry patch), 16 views at 128 x 128 in one call (a scene's
# prepare_training chunk), the median of 3 after a warm-up call.
_GRID, _VIEWS, _RES, _REPEATS = 708, 16, 128, 3


def height_field(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[n * n, 3] float32 vertices of a gently waved grid over [-1, 1]^2, and its
    [2 (n - 1)^2, 3] int32 triangles."""
    t = torch.linspace(-1.0, 1.0, n)
    y, x = torch.meshgrid(t, t, indexing="ij")
    z = 0.02 * torch.sin(6 * x) * torch.cos(5 * y)
    v_pos = torch.stack([x, y, z], dim=-1).reshape(-1, 3)
    i = torch.arange(n - 1)
    corner = (i[:, None] * n + i[None, :]).reshape(-1)
    quads = torch.stack([corner, corner + 1, corner + n + 1, corner + n], dim=1)
    tri = torch.cat([quads[:, [0, 1, 2]], quads[:, [0, 2, 3]]])
    return v_pos, tri.to(torch.int32)


def large_mesh_row() -> tuple:
    """Median time and peak resident memory (sampled) of one torch rasterize call on the
    large mesh; the memory as the call's peak over its start (what the rasterizer adds)."""
    v_pos, tri = height_field(_GRID)
    cams = random_views(_VIEWS, generator=torch.Generator().manual_seed(0))
    pos = torch.nn.functional.pad(v_pos, (0, 1), value=1.0) @ cams.mvp.transpose(1, 2)
    run = functools.partial(rasterize, pos, tri, (_RES, _RES), backend="torch")
    rss = RunPeakRss().start()
    start = rss.peak
    run()
    rss.stop()
    times = []
    for _ in range(_REPEATS):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    t = sorted(times)[_REPEATS // 2]
    n_tri = tri.shape[0]
    memory = (f"peak RSS {rss.peak / 2**20:.0f} MiB, +{(rss.peak - start) / 2**20:.0f} MiB "
              "over the call's start")  # fmt: skip
    return (f"rasterize torch (cpu), {_VIEWS} views", f"{n_tri} tris, {_RES}x{_RES}", t,
            f"{n_tri * _VIEWS / t / 1e6:.1f} Mtri-views/s; {memory}", machine("cpu"))  # fmt: skip


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
    rows.append(large_mesh_row())

    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, nvdiffrast: {has_nvdiffrast()}")
    print("| what | size | median time | throughput | machine |")
    print("|---|---|---|---|---|")
    for what, size, t, thr, where in rows:
        ms = f"{t * 1e3:.2f} ms" if t >= 1e-3 else f"{t * 1e6:.1f} us"
        print(f"| {what} | {size} | {ms} | {thr} | {where} |")
    assert math.isfinite(rows[0][2])


if __name__ == "__main__":
    main()
