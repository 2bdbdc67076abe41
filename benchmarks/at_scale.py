"""Time and peak resident memory of the user-facing paths as their inputs grow.

Run: ``python benchmarks/at_scale.py [--quick]``. Each case runs in a process of its own (peak
memory is its, above the interpreter with mptex imported) and prints one Markdown table:

- ``load_obj`` on generated grid OBJs (triangles, or near-planar quads, with and without
  ``vt`` / ``vn``) of 0.1M, 1M and 2M triangles, beside the size of the tensors it returns,
  and ``write_obj`` of the 1M-triangle mesh with UVs and normals;
- ``mptex-report`` on fabricated sweeps of 10, 100 and 1000 runs (5 arms x 2 scenes x seeds),
  each run's history that of a 2000-iteration run (an entry per iteration, precision
  statistics every 10th, a validation every 50th), its entries copied from a real 20-iteration
  run trained here first;
- ``export_mesh`` (OBJ only, no measurement) of the 20,000-triangle knot at 1024², 2048², 4096²;
- the precision search's space (:func:`~mptex.search.space.enumerate_space`) and cost model for
  3, 5 and 7 linear layers.

``--quick`` runs the smallest size of each (a smoke check of the script), ``--obj`` only the
OBJ rows. About 6 minutes and 1.5 GB at most on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, print_table  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ARMS = ("f32", "nvdiffrec", "f16_dynamic", "bf16", "fp8")
SCENES = ("builtin", "other")


def write_grid_obj(path: Path, n_faces: int, quads: bool, vt: bool, vn: bool) -> None:
    """A height-field grid of about ``n_faces`` triangles (``quads``: half as many quads)."""
    cells = n_faces // 2
    w = int(math.sqrt(cells))
    h = cells // w
    with open(path, "w") as f:
        for j in range(h + 1):
            z = [0.05 * math.sin(6.0 * i / w) * math.cos(4.0 * j / h) for i in range(w + 1)]
            f.write("".join(f"v {i / w:.6f} {j / h:.6f} {z[i]:.6f}\n" for i in range(w + 1)))
        if vt:
            for j in range(h + 1):
                f.write("".join(f"vt {i / w:.6f} {j / h:.6f}\n" for i in range(w + 1)))
        if vn:
            f.write("vn 0 0 1\n" * ((w + 1) * (h + 1)))

        def corner(i: int) -> str:
            s = str(i + 1)
            return s + (f"/{s}" if vt else ("/" if vn else "")) + (f"/{s}" if vn else "")

        for j in range(h):
            rows = []
            for i in range(w):
                a, b = j * (w + 1) + i, j * (w + 1) + i + 1
                d, e = a + w + 1, a + w + 2
                a, b, d, e = corner(a), corner(b), corner(d), corner(e)
                rows.append(f"f {a} {b} {e} {d}\n" if quads else f"f {a} {b} {e}\nf {a} {e} {d}\n")
            f.write("".join(rows))


def fabricate_sweep(root: Path, n_runs: int, iterations: int, real_history: list[dict]) -> None:
    """``n_runs`` job directories as a multirun leaves them (metrics.json only)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from report_runs import metrics, write_run

    stats, plain = real_history[0], real_history[1]
    per_cell = max(1, n_runs // (len(ARMS) * len(SCENES)))
    job = 0
    for scene in SCENES:
        for arm in ARMS:
            for seed in range(per_cell):
                history = []
                for it in range(1, iterations + 1):
                    entry = dict(stats if it % 10 == 0 else plain, iteration=it, loss=1.0 / it)
                    psnr = 20.0 + 10.0 * it / iterations + 0.01 * seed
                    entry["psnr"] = psnr if it % 50 == 0 else None
                    history.append(entry)
                record = metrics(arm, seed, psnr=history[-1]["psnr"], scene=scene,
                                 iterations=iterations, iterations_planned=iterations)  # fmt: skip
                record["history"] = history
                write_run(root, f"{job}_precision={arm},train.seed={seed},scene={scene}", record)
                job += 1


def _child(kind: str, arg: str) -> dict:
    """One measurement, in this process: seconds and peak resident bytes above the start."""
    import torch

    from mptex.train.memory import RunPeakRss

    extra: dict = {}
    if kind == "obj":
        from mptex.render import load_obj

        work = lambda: load_obj(arg)  # noqa: E731
    elif kind == "write_obj":
        from mptex.render import load_obj, write_obj

        mesh = load_obj(arg)
        work = lambda: write_obj(Path(arg).with_name("written.obj"), mesh)  # noqa: E731
    elif kind == "report":
        from mptex.report import write_report

        work = lambda: write_report(arg)  # noqa: E731
    elif kind == "export":
        import yaml

        from mptex.bake import export_mesh
        from mptex.scenes import torus_knot
        from mptex.texture import MLPTexture3D

        mesh = torus_knot(400, 25)
        cfg = yaml.safe_load((ROOT / "configs" / "texture" / "cpu.yaml").read_text())
        aabb = torch.stack([mesh.v_pos.amin(0), mesh.v_pos.amax(0)])
        texture = MLPTexture3D(aabb, **cfg, precision="f32")
        out = tempfile.mkdtemp()
        work = lambda: export_mesh(texture, mesh, out, resolution=int(arg), formats="obj",  # noqa: E731
                                   measure=False)  # fmt: skip
    else:  # space
        import yaml

        from mptex.search.cost import iteration_cost, shape_from_config
        from mptex.search.space import enumerate_space

        n_layers = int(arg)
        preset = yaml.safe_load((ROOT / "configs" / "texture" / "default.yaml").read_text())
        texture = {"texture": {**preset, "hidden": n_layers - 1}}

        def work():
            kept, pruned = enumerate_space(n_layers, 32, {"encoder_dtypes": ["f16", "f32", "bf16"]})
            shape = shape_from_config(texture, 1 << 18)
            for c in kept:
                iteration_cost(c, shape)
            extra["candidates"] = f"{len(kept) + len(pruned)} ({len(kept)} kept)"

    monitor = RunPeakRss(0.002).start()
    base = monitor.peak  # its first sample: the resident memory before the work
    start = time.perf_counter()
    result = work()
    seconds = time.perf_counter() - start
    monitor.stop()
    if kind == "obj":
        tensors = [result.v_pos, result.t_pos_idx, result.v_tex, result.t_tex_idx, result.v_nrm,
                   result.t_nrm_idx, result.t_mat_idx]  # fmt: skip
        extra["tensors"] = sum(t.numel() * t.element_size() for t in tensors if t is not None)
        extra["faces"] = int(result.t_pos_idx.shape[0])
    return {"seconds": seconds, "peak": monitor.peak - base, **extra}


def measure(kind: str, arg: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "passive"}
    out = subprocess.run([sys.executable, __file__, "--child", kind, arg], env=env, check=True,
                         capture_output=True, text=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def _other_rows(tmp: Path, quick: bool) -> list[tuple]:
    """The rows of mptex-report, export_mesh and the search space."""
    rows = []
    real = tmp / "real"
    train = ["mptex-train", "train=tiny", "scene.resolution=32", "scene.n_train_views=4",
             "scene.n_val_views=1", f"hydra.run.dir={real}"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(train, check=True, capture_output=True, env=env)
    history = json.loads((real / "metrics.json").read_text())["history"]
    for n_runs in (10,) if quick else (10, 100, 1000):
        sweep = tmp / f"sweep{n_runs}"
        fabricate_sweep(sweep, n_runs, 2000, history)
        size = sum(p.stat().st_size for p in sweep.rglob("metrics.json"))
        got = measure("report", str(sweep))
        rows.append(("mptex-report (write_report)", f"{n_runs} runs x 2000 iterations, "
                     f"{size / 2**20:.0f} MiB of metrics.json", f"{got['seconds']:.1f} s",
                     _mib(got["peak"]), ""))  # fmt: skip
    for resolution in (1024,) if quick else (1024, 2048, 4096):
        got = measure("export", str(resolution))
        rows.append(("export_mesh (OBJ, no measurement)", f"20k triangles, {resolution}²",
                     f"{got['seconds']:.1f} s", _mib(got["peak"]), "xatlas UVs"))  # fmt: skip
    for n_layers in (3,) if quick else (3, 5, 7):
        got = measure("space", str(n_layers))
        rows.append(("search space + cost model", f"{n_layers} layers, {got['candidates']}",
                     f"{got['seconds']:.1f} s", _mib(got["peak"]), ""))  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the smallest size of each path")
    parser.add_argument("--obj", action="store_true", help="only the OBJ rows (read, write)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(*args.child)))
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        objs = [(100_000, False, False, False), (1_000_000, False, False, False),
                (2_000_000, False, False, False), (1_000_000, False, True, True),
                (1_000_000, True, True, True)]  # fmt: skip
        for n_faces, quads, vt, vn in [(100_000, False, True, True)] if args.quick else objs:
            path = tmp / "grid.obj"
            write_grid_obj(path, n_faces, quads, vt, vn)
            got = measure("obj", str(path))
            what = "load_obj, " + ("quads" if quads else "triangles") + (", vt + vn" if vt else "")
            mib = path.stat().st_size / 2**20
            size = f"{got['faces'] / 1e6:.1f}M triangles, {mib:.0f} MiB file"
            rows.append((what, size, f"{got['seconds']:.1f} s", _mib(got["peak"]),
                         f"tensors {_mib(got['tensors'])}"))  # fmt: skip
            if vt and not quads:
                got = measure("write_obj", str(path))
                rows.append(("write_obj, triangles, vt + vn", size, f"{got['seconds']:.1f} s",
                             _mib(got["peak"]), ""))  # fmt: skip
        if not args.obj:
            rows += _other_rows(tmp, args.quick)
    print(f"Machine: {machine()}\n")
    print_table(["what", "size", "time", "peak RSS above start", "note"], rows)


if __name__ == "__main__":
    main()
