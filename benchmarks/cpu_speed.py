"""CPU speed of the training path: the fused-MLP twin, the torch hash grid, one iteration.

    python benchmarks/cpu_speed.py mlp                  # twin vs the f32 MLP, forward+backward
    python benchmarks/cpu_speed.py grid                 # grid vs its gather/scatter floor
    python benchmarks/cpu_speed.py iteration            # f32 vs tcnn_fused per iteration
    python benchmarks/cpu_speed.py profile --scene builtin --arm tcnn_fused
    python benchmarks/cpu_speed.py sweep multirun/...   # a sweep's time per iteration per arm
    python benchmarks/cpu_speed.py compare before/results.json after/results.json

Every table is measured in one process, the rows of a table back to back (interleaved
repeats, median), on this machine; set ``OMP_WAIT_POLICY=passive`` on a shared machine
(spinning OpenMP threads slow torch 10-20x under load). Ratios are taken within one run.

``mlp``: the texture's MLP (``texture=cpu``: 24 inputs, 32 wide, 2 hidden layers, 3 outputs) at
the rows of one texture sample of the quick protocol (the covered pixels of two views: 9,290 on
the built-in scene, 13,948 on the duck; an iteration samples twice, the points and jittered
points), forward+backward: tcnn's fused network (the PyTorch twin) against the f32 arm's linear
layers.

``grid``: the hash grid's forward+backward (float32 and tcnn's half mode) against its floor:
the bare ``index_select`` of the same table rows (2 features as one complex64 element) and the
``scatter_add_`` of as many values into a zeroed gradient table, chunk by chunk as the grid
does, with the rows computed beforehand. Configs: nvdiffrec's (16 levels, 2^19 entries,
resolution 16 to 4096) and ``texture=cpu``'s (12 levels, 2^16 entries, 16 to 512).

``profile``: one iteration of the quick protocol (``+experiment=quick``'s config, one arm, one
seed, one thread) under the torch profiler, by part: the texture's grid and MLP (forward and
backward), the rest of the forward and the loss, the optimizer step, the G-buffer cache, and
what the protocol does every few iterations (validation every 50, checkpoints every 100,
statistics every 10), per occurrence and spread over the iterations.

``iteration``: each arm's time per iteration (``metrics.json``'s median) in runs of the quick
protocol shortened to ``--iterations``, the arms alternating in one process for ``--rounds``
rounds; the ratio is to the first arm's (f32).

``sweep``: the median time per iteration of each arm of a finished sweep over its seeds (the
runs' ``metrics.json``), its ratio to f32's, and the sweep's wall time.

``compare``: two reports' ``results.json`` (before and after a change), every value but the
timings, memory and paths; exit status 1 if any differs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, print_table  # noqa: E402

from mptex.report.compare import result_differences  # noqa: E402
from mptex.train.checkpoint import run_time_total  # noqa: E402


def grid_config(name: str) -> dict:
    """The grid of ``configs/texture/cpu.yaml`` ("cpu") or nvdiffrec's ("nvdiffrec"), as
    ``grid_geometry`` keywords (3-D)."""
    from omegaconf import OmegaConf

    from mptex.cli import CONFIG_DIR
    from mptex.texture import NVDIFFREC_ENCODER_CONFIG

    if name == "nvdiffrec":
        config = dict(NVDIFFREC_ENCODER_CONFIG)
    else:
        config = dict(OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "texture/cpu.yaml")))[
            "encoder"
        ]
    keys = ("n_levels", "n_features_per_level", "log2_hashmap_size", "base_resolution",
            "per_level_scale")  # fmt: skip
    return {key: config[key] for key in keys}


# Rows of one texture sample in the quick protocol: the covered pixels of two 128 x 128 views,
# averaged over the training views (built-in scene 9,290, the duck 13,948).
SCENE_ROWS = {"builtin": 9290, "duck": 13948}


def interleaved_medians(fns: dict, repeats: int, warmup: int = 2) -> dict[str, float]:
    """Median seconds of each function, the repeats interleaved (a drift hits all alike)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


# ----------------------------------------------------------------------------- mlp
def mlp_nets():
    from mptex.mlp import PrecisionMLP

    nets = {}
    for arm in ("f32", "tcnn_fused"):
        torch.manual_seed(0)
        nets[arm] = PrecisionMLP(24, 3, 2, 32, policy=arm)
    return nets


def bench_mlp(rows: int, repeats: int) -> list[list[str]]:
    nets = mlp_nets()
    gen = torch.Generator().manual_seed(0)
    features = torch.rand(rows, 24, generator=gen) * 2e-4 - 1e-4
    inputs = {"f32": features, "tcnn_fused": features.half()}
    grad = torch.randn(rows, 3, generator=gen) * 1e-3

    def step(arm):
        net, x = nets[arm], inputs[arm].clone().requires_grad_(True)

        def run():
            net.zero_grad(set_to_none=True)
            net(x).float().backward(grad)

        return run

    medians = interleaved_medians({arm: step(arm) for arm in nets}, repeats)
    base = medians["f32"]
    return [
        [f"MLP {arm} forward+backward", f"{rows} rows", f"{seconds * 1e3:.2f} ms",
         f"{seconds / base:.2f}x"]
        for arm, seconds in medians.items()
    ]  # fmt: skip


# ----------------------------------------------------------------------------- grid
def grid_floor(x: torch.Tensor, geometry, params: torch.Tensor):
    """The floor of one grid forward+backward: gather and scatter-add of the grid's own rows."""
    from mptex._grid_torch import _chunk_size, _Lookup, _row_view

    scales = torch.tensor(geometry.scales, dtype=x.dtype)
    chunk = _chunk_size(x.device)
    rows = [
        _Lookup(x[start : start + chunk], geometry, scales, True).rows.reshape(-1)
        for start in range(0, x.shape[0], chunk)
    ]
    n_features = geometry.n_features_per_level
    table = _row_view(params.detach(), n_features)
    values = [table.index_select(0, r) for r in rows]

    def run():
        grad = torch.zeros_like(params)
        grad_rows = _row_view(grad, n_features)
        for r, v in zip(rows, values):
            table.index_select(0, r)
            grad_rows.scatter_add_(0, r, v)

    return run


def bench_grid(
    configs: list[str], log2_points: list[int], repeats: int, eager: bool = False
) -> list[list[str]]:
    """The grid's forward+backward against its floor; ``eager``: also its eager PyTorch ops
    (what runs without the C kernel: the implementation before it)."""
    import mptex._grid_torch as grid_module
    from mptex._grid_torch import grid_geometry, hash_grid_encode

    native = grid_module._native

    rows = []
    for name in configs:
        geometry = grid_geometry(3, **grid_config(name))
        params = (torch.rand(geometry.n_params, generator=torch.Generator().manual_seed(0))
                  * 2e-4 - 1e-4).requires_grad_(True)  # fmt: skip
        for log2 in log2_points:
            n = 2**log2
            x = torch.rand(n, 3, generator=torch.Generator().manual_seed(1))

            def encode(dtype, ops=native, x=x, params=params, geometry=geometry):
                def run():
                    grid_module._native = ops  # the C kernel where it runs, or eager ops
                    params.grad = None
                    hash_grid_encode(x, params, geometry, dtype).float().sum().backward()
                    grid_module._native = native

                return run

            runs = {
                "floor": grid_floor(x, geometry, params),
                "float32": encode(torch.float32),
                "float16": encode(torch.float16),
            }
            if eager:
                runs["float32 eager ops"] = encode(torch.float32, lambda *args: None)
                runs["float16 eager ops"] = encode(torch.float16, lambda *args: None)
            medians = interleaved_medians(runs, repeats)
            for what, seconds in medians.items():
                label = "gather + scatter floor" if what == "floor" else f"{what} fwd+bwd"
                rows.append([f"grid {name} {label}", f"2^{log2} points",
                             f"{seconds * 1e3:.1f} ms",
                             f"{seconds / medians['floor']:.2f}x"])  # fmt: skip
    return rows


# ----------------------------------------------------------------------------- profile
# Scopes the training loop and the twins open (torch.profiler.record_function), and the part of
# the table each one's time goes to. Nested scopes count for the innermost part listed here.
PARTS = [
    ("mptex.grid.forward", "grid forward"),
    ("mptex.grid.backward", "grid backward"),
    ("mptex.mlp.forward", "MLP forward"),
    ("mptex.mlp.backward", "MLP backward"),
    ("mptex.views", "views (G-buffer cache, references)"),
    ("mptex.render", "rest of the forward (sigmoid, shading, image)"),
    ("mptex.loss", "loss"),
    ("mptex.backward", "rest of the backward"),
    ("mptex.optimizer", "optimizer step (Adam, loss scaler)"),
    ("mptex.stats", "precision statistics"),
    ("mptex.validation", "validation"),
    ("mptex.checkpoint", "checkpoints"),
    ("mptex.images", "validation images"),
]


def _mlp_scope_hooks():
    """Global module hooks that put nvdiffrec's linear MLP (mptex.mlp.PrecisionMLP) in
    mptex.mlp.forward / mptex.mlp.backward scopes, as the fused twin's own; their handles."""
    from torch.nn.modules import module as nn_module

    from mptex.mlp import PrecisionMLP

    scopes: dict[str, list] = {"forward": [], "backward": []}

    def linear(module) -> bool:
        return isinstance(module, PrecisionMLP) and module.policy.mlp != "fused"

    def enter(kind):
        def hook(module, *args):
            if linear(module):
                scope = torch.profiler.record_function(f"mptex.mlp.{kind}")
                scope.__enter__()
                scopes[kind].append(scope)

        return hook

    def leave(kind):
        def hook(module, *args):
            if linear(module) and scopes[kind]:
                scopes[kind].pop().__exit__(None, None, None)

        return hook

    return [
        nn_module.register_module_forward_pre_hook(enter("forward")),
        nn_module.register_module_forward_hook(leave("forward")),
        nn_module.register_module_full_backward_pre_hook(enter("backward")),
        nn_module.register_module_full_backward_hook(leave("backward")),
    ]


def _listed_ancestor(event, names: dict[str, str]):
    parent = event.cpu_parent
    while parent is not None and parent.name not in names:
        parent = parent.cpu_parent
    return parent


# Scopes whose listed inner scopes are parts of their own (the grid and MLP inside the
# training forward and backward); every other scope counts whole (validation's own grid).
_CONTAINERS = ("mptex.render", "mptex.backward")


def part_times(events, names: dict[str, str]) -> dict[str, float]:
    """Microseconds per part: each listed scope's time, less the listed scopes inside it where
    it is a container, and nothing for a scope inside another that counts whole."""
    totals = dict.fromkeys(names.values(), 0.0)
    for event in events:
        if event.name not in names:
            continue
        outer = _listed_ancestor(event, names)
        if outer is None:
            totals[names[event.name]] += event.cpu_time_total
        elif outer.name in _CONTAINERS and _listed_ancestor(outer, names) is None:
            totals[names[event.name]] += event.cpu_time_total
            totals[names[outer.name]] -= event.cpu_time_total
    return totals


def profile_run(scene: str, arm: str, seed: int, overrides: list[str]) -> tuple[list, dict]:
    """Train one run of the quick protocol under the profiler; per part: ms in the run."""
    import tempfile

    from mptex.train import train

    cfg = quick_config(scene, arm, seed, overrides)
    hooks = _mlp_scope_hooks()
    try:
        with tempfile.TemporaryDirectory() as tmp, torch.profiler.profile() as prof:
            start = time.perf_counter()
            metrics = train(cfg, tmp)
            wall = time.perf_counter() - start
    finally:
        for handle in hooks:
            handle.remove()
    names = dict(PARTS)
    totals = part_times(prof.events(), names)
    iterations = metrics["iterations"]
    scoped = sum(totals.values()) / 1e6
    totals["start (scene, rasterization, texture) and the rest"] = (wall - scoped) * 1e6
    info = dict(wall_s=wall, iterations=iterations, time_per_iter_s=metrics["time_per_iter_s"],
                psnr=metrics["psnr"])  # fmt: skip
    rows = [
        [part, f"{us / 1e3:.0f} ms", f"{us / 1e3 / iterations:.2f} ms", f"{us / 1e6 / wall:.1%}"]
        for part, us in sorted(totals.items(), key=lambda kv: -kv[1])
    ]
    return rows, info


# ----------------------------------------------------------------------------- iteration
def quick_config(scene: str, arm: str, seed: int, overrides: list[str]):
    """``+experiment=quick``'s config for one run (what the sweep's job composes)."""
    from hydra import compose, initialize_config_dir

    from mptex.cli import CONFIG_DIR, register_experiments

    register_experiments()
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        return compose("config", overrides=["+experiment=quick", f"scene={scene}",
                                            f"precision={arm}", f"train.seed={seed}",
                                            "train.progress=false", *overrides])  # fmt: skip


def iteration_rows(scenes: list[str], arms: list[str], rounds: int, iterations: int):
    """Each arm's median time per iteration (metrics.json's) over ``rounds`` runs of
    ``iterations`` quick-protocol iterations, the arms alternating in one process."""
    import tempfile

    from mptex.train import train

    rows = []
    for scene in scenes:
        times: dict[str, list[float]] = {arm: [] for arm in arms}
        for _ in range(rounds):
            for arm in arms:
                cfg = quick_config(scene, arm, 0, [f"train.iterations={iterations}"])
                with tempfile.TemporaryDirectory() as tmp:
                    times[arm].append(train(cfg, tmp)["time_per_iter_s"])
        base = statistics.median(times[arms[0]])
        for arm in arms:
            median = statistics.median(times[arm])
            rows.append([f"{scene}: {arm} time per iteration", f"{rounds} x {iterations} its",
                         f"{median * 1e3:.1f} ms", f"{median / base:.2f}x"])  # fmt: skip
    return rows


# ----------------------------------------------------------------------------- sweep
def sweep_rows(sweep_dir: Path) -> tuple[list[list[str]], str]:
    per_arm: dict[str, list[float]] = {}
    walls, partial = [], False
    for path in sorted(sweep_dir.glob("*/metrics.json")):
        metrics = json.loads(path.read_text())
        # every process of a run stopped and continued, as the precision search counts them
        total, complete = run_time_total(metrics)
        walls.append(total or 0.0)
        partial = partial or not complete
        if metrics.get("status") == "completed" and metrics.get("time_per_iter_s"):
            per_arm.setdefault(metrics["precision"], []).append(metrics["time_per_iter_s"])
    base = statistics.median(per_arm["f32"]) if "f32" in per_arm else None
    rows = []
    for arm, values in sorted(per_arm.items(), key=lambda kv: -statistics.median(kv[1])):
        median = statistics.median(values)
        ratio = f"{median / base:.2f}x" if base else "–"
        rows.append([f"{arm} time per iteration", f"{len(values)} runs",
                     f"{median * 1e3:.1f} ms", ratio])  # fmt: skip
    at_least = "at least " if partial else ""  # a process killed without a record
    note = f"sum of the runs' wall times: {at_least}{sum(walls):.0f} s over {len(walls)} runs"
    return rows, note


# ----------------------------------------------------------------------------- compare
# What a report's results.json may change without a change of results: timings, memory, the
# timing ratio, where the runs were written.
HEADERS = ["what", "size", "median", "ratio"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    mlp = sub.add_parser("mlp", help="the fused-MLP twin against the f32 MLP")
    mlp.add_argument("--rows", type=int, nargs="+", default=list(SCENE_ROWS.values()))
    grid = sub.add_parser("grid", help="the hash grid against its gather/scatter floor")
    grid.add_argument("--configs", nargs="+", default=["nvdiffrec", "cpu"])
    grid.add_argument("--log2-points", type=int, nargs="+", default=[16])
    grid.add_argument("--eager", action="store_true", help="also time the eager PyTorch ops")
    for p in (mlp, grid):
        p.add_argument("--repeats", type=int, default=15)
        p.add_argument("--threads", type=int, default=1)
    prof = sub.add_parser("profile", help="one quick-protocol run under the torch profiler")
    prof.add_argument("--scene", default="builtin")
    prof.add_argument("--arm", default="f32")
    prof.add_argument("--seed", type=int, default=0)
    prof.add_argument("overrides", nargs="*", help="more Hydra overrides, after --")
    per_iter = sub.add_parser("iteration", help="time per iteration of arms, in one process")
    per_iter.add_argument("--scenes", nargs="+", default=["builtin", "duck"])
    per_iter.add_argument("--arms", nargs="+", default=["f32", "tcnn_fused"])
    per_iter.add_argument("--rounds", type=int, default=3)
    per_iter.add_argument("--iterations", type=int, default=100)
    sweep = sub.add_parser("sweep", help="a finished sweep's time per iteration, per arm")
    sweep.add_argument("sweep_dir", type=Path)
    compare = sub.add_parser("compare", help="two reports' results.json, timings left out")
    compare.add_argument("before", type=Path)
    compare.add_argument("after", type=Path)
    args = parser.parse_args(argv)
    if args.command == "compare":
        before, after = (json.loads(path.read_text()) for path in (args.before, args.after))
        differences = result_differences(before, after)
        for line in differences:
            print(line)
        n_runs = len(after.get("runs", []))
        print(f"{len(differences)} differences in {n_runs} runs (timings, memory, paths left out)")
        sys.exit(1 if differences else 0)
    if args.command == "sweep":
        rows, note = sweep_rows(args.sweep_dir)
        print_table(HEADERS, rows)
        print(f"\n{note}")
        return
    if args.command == "profile":
        from mptex.cli import _reproducible_blas

        _reproducible_blas()
        rows, info = profile_run(args.scene, args.arm, args.seed, args.overrides)
        print_table(["part", "in the run", "per iteration", "share"], rows)
        print(f"\nscene={args.scene} precision={args.arm} train.seed={args.seed}: "
              f"{info['iterations']} iterations, {info['wall_s']:.1f} s under the profiler "
              f"(time per iteration {info['time_per_iter_s'] * 1e3:.1f} ms, PSNR "
              f"{info['psnr']:.2f} dB)")  # fmt: skip
        print(f"machine: {machine('cpu')}")
        return
    if args.command == "iteration":
        from mptex.cli import _reproducible_blas

        _reproducible_blas()
        rows = iteration_rows(args.scenes, args.arms, args.rounds, args.iterations)
        print_table(HEADERS, rows)
        print(f"\nmachine: {machine('cpu')} (the runs: train.threads=1, +experiment=quick)")
        return
    torch.set_num_threads(args.threads)
    if args.command == "mlp":
        rows = [row for n in args.rows for row in bench_mlp(n, args.repeats)]
    else:
        rows = bench_grid(args.configs, args.log2_points, args.repeats, args.eager)
    print_table(HEADERS, rows)
    print(f"\nmachine: {machine('cpu')}")


if __name__ == "__main__":
    main()
