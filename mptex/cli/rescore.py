"""``mptex-rescore``: score finished ``mptex-train`` runs again, at other validation settings.

Each run directory's ``checkpoint.pt`` gives the trained texture and the config it was trained
with; the scene is rebuilt from that config and validated with
:func:`mptex.train.validation.evaluate` at each ``--val-spp`` (and, optionally, another number
of validation views). Validation reads the texture under ``torch.no_grad`` and draws no random
number, so ``--val-spp`` equal to the run's own reproduces its ``metrics.json`` PSNR to the
last bit (checked and printed per run: ``own``). This is how the same checkpoints were scored
point-sampled and supersampled (docs/archive/supersampled-validation.md,
docs/archive/torus-lost-side.md)::

    mptex-rescore outputs/2026-11-26/*/ --val-spp 1 4
    mptex-rescore runs/torus_s* --val-spp 4 --json torus.json

Prints a Markdown table (run, scene, arm, seed, val_spp, PSNR, constant-colour baseline,
seconds) and per ``(scene, arm, val_spp)`` the mean ± sample std over the runs' seeds, runs
whose configs differ in other keys (the report's swept keys, e.g. ``train.iterations``) in
rows of their own, with a ``config`` column naming those keys' values, and a seed scored twice
in a row (a copied run directory) counted once;
``--json`` also writes every view's PSNR. Runs on the CPU by default (``--device``), one torch
thread unless ``--threads``. A sweep folder (Hydra's ``multirun.yaml``, or run directories
below it) stands for its run directories, as for ``mptex-report``. A run directory named twice
is scored once; files among the paths (a glob such as ``SWEEP/*`` names ``report.md`` too) are
skipped, in one line; among several, one without a checkpoint (a diverged run writes none) is
named and skipped; a checkpoint of a run that did not complete (interrupted, or killed before
its last iteration), or whose ``metrics.json`` is missing or unreadable, is scored with a line
saying how many of its iterations it holds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import torch

from mptex.cli.app import output_file_problem
from mptex.numbers import is_number
from mptex.report.collect import flatten_config, job_dirs, shown_keys, swept_keys
from mptex.report.markdown import markdown_table
from mptex.train.runinfo import device_name

__all__ = ["rescore", "rescore_main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mptex-rescore", description=__doc__.splitlines()[0])
    parser.add_argument(
        "runs", nargs="+", help="mptex-train run directories (checkpoint.pt), or sweep folders"
    )
    parser.add_argument("--val-spp", type=int, nargs="+", default=[1],
                        help="validation samples per pixel along each axis (1-16)")  # fmt: skip
    parser.add_argument("--n-val-views", type=int, default=None,
                        help="validation views (default: the run's scene.n_val_views)")  # fmt: skip
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None, help="write every score (and view) here")
    return parser


def rescore(run_dir: str | os.PathLike, spps: list[int], device: torch.device,
            n_val_views: int | None = None) -> list[dict]:  # fmt: skip
    """The run's checkpoint validated at each of ``spps``; one dict per value."""
    from mptex.scenes.build import build_scene, raster_backend_problem
    from mptex.train.checkpoint import (
        TEXTURE_KEYS,
        load_checkpoint,
        read_metrics,
        texture_from_checkpoint,
        unfinished_note,
    )
    from mptex.train.shading import light_direction
    from mptex.train.validation import evaluate

    run_dir = Path(run_dir)
    checkpoint = run_dir / "checkpoint.pt"
    ckpt = load_checkpoint(checkpoint, map_location="cpu", required=TEXTURE_KEYS)
    config = ckpt["config"]
    scene_cfg = dict(config["scene"])
    if n_val_views is not None:
        scene_cfg["n_val_views"] = n_val_views
    problem = raster_backend_problem(scene_cfg.get("raster_backend", "auto"), device)
    if problem is not None:
        # A GPU run's rasterizer (nvdiffrast) where it cannot run: the device's default draws
        # the same views (the twin's triangle ids and barycentrics are nvdiffrast's).
        warnings.warn(f"scene.raster_backend: the run's {scene_cfg['raster_backend']!r} cannot "
                      f"run here ({problem}); the views are drawn with 'auto'",
                      stacklevel=2)  # fmt: skip
        scene_cfg["raster_backend"] = "auto"
    scene = build_scene(scene_cfg, device)
    texture = texture_from_checkpoint(ckpt, device)
    settings = dict(config["train"])
    light_dir = light_direction(settings, device)
    # A missing, corrupt or non-mapping metrics.json leaves the run's own PSNR unknown; the
    # checkpoint is still scored, and the note below says the run's status could not be read.
    metrics = read_metrics(run_dir) or {}
    own, status = metrics.get("psnr"), metrics.get("status")
    if not is_number(own):
        own = None
    note = unfinished_note(ckpt, run_dir, metrics)
    if note is not None:  # its weights are not the run's result: said
        print(f"mptex-rescore: {run_dir}: scoring {note}", file=sys.stderr)
    rows = []
    for spp in spps:
        start = time.perf_counter()
        scored = evaluate(texture, scene, {**settings, "val_spp": spp}, light_dir)
        # The run's own setting: its val_spp and its views (--n-val-views absent or equal).
        own_views = scene_cfg.get("n_val_views") == config["scene"].get("n_val_views")
        same_setting = spp == int(settings.get("val_spp", 1)) and own_views
        rows.append({
            "run": str(run_dir), "scene": scene_cfg["name"], "arm": config["precision"]["name"],
            "seed": settings["seed"], "val_spp": spp, "n_val_views": scene.n_val_views,
            "psnr": scored["psnr"], "baseline_psnr": scored["baseline_psnr"],
            "psnr_per_image": scored["psnr_per_image"], "seconds": time.perf_counter() - start,
            "iterations": int(ckpt["iteration"]), "status": status,
            # the run's own metrics.json PSNR when this is its own validation setting
            "own": own if same_setting else None, "config": config,
        })  # fmt: skip
    return rows


def _with_sweeps_expanded(paths: list[str]) -> list[Path]:
    """``paths`` with each sweep folder replaced by its run directories, saying so: a folder
    that is no run itself (no checkpoint.pt, metrics.json or .hydra/config.yaml) and holds
    Hydra's ``multirun.yaml`` or run directories below it (as ``mptex-report`` reads one)."""
    out: list[Path] = []
    for given in map(Path, paths):
        markers = ("checkpoint.pt", "metrics.json", ".hydra/config.yaml")
        is_run = any((given / name).is_file() for name in markers)
        runs = job_dirs(given) if given.is_dir() and not is_run else []
        sweep = given.is_dir() and not is_run and (given / "multirun.yaml").is_file()
        if not (runs or sweep):
            out.append(given)
            continue
        what = "a sweep folder" if sweep else "a folder of runs"
        count = f"{len(runs)} run director{'y' if len(runs) == 1 else 'ies'}"
        print(f"mptex-rescore: {given}: {what}; scoring its {count}", file=sys.stderr)
        out += runs
    return out


def _files_skipped(files: list[Path]) -> str:
    """The one line saying which of the paths given are files, not run directories (the
    first five named)."""
    if len(files) == 1:
        return f"{files[0]}: a file, not a run directory"
    names = ", ".join(str(path) for path in files[:5])
    more = f" and {len(files) - 5} more" if len(files) > 5 else ""
    return f"{len(files)} files, not run directories, skipped: {names}{more}"


def rescore_main(argv: list[str] | None = None) -> int:
    from mptex._backends import cuda_device_problem
    from mptex._triton_launch import launching_on
    from mptex.train.checkpoint import CheckpointError, no_checkpoint_reason

    args = _parser().parse_args(argv)
    bad = [k for k in args.val_spp if not 1 <= k <= 16]
    if bad:
        print(f"mptex-rescore: error: --val-spp: expected integers in [1, 16], got {bad}",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.threads < 1:
        print(f"mptex-rescore: error: --threads: expected an integer >= 1, got {args.threads}",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.n_val_views is not None and args.n_val_views < 1:
        print("mptex-rescore: error: --n-val-views: expected an integer >= 1, got "
              f"{args.n_val_views}", file=sys.stderr)  # fmt: skip
        return 2
    problem = output_file_problem("--json", args.json) if args.json else None
    if problem is not None:
        print(f"mptex-rescore: error: {problem}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    try:
        device = torch.device(args.device)
    except RuntimeError:
        print(f"mptex-rescore: error: --device: expected a torch device such as cpu, cuda or "
              f"cuda:1, got {args.device!r}", file=sys.stderr)  # fmt: skip
        return 2
    problem = cuda_device_problem(device, str(device)) if device.type == "cuda" else None
    if problem is not None:
        print(f"mptex-rescore: error: --device: {problem}", file=sys.stderr)
        return 2
    rows = []
    # Each run once, as the report counts it (a glob and a path may name the same one).
    unique: dict[Path, Path] = {}
    named = Counter()
    for run in _with_sweeps_expanded(args.runs):
        key = Path(run).resolve()
        unique.setdefault(key, Path(run))
        named[key] += 1
    run_dirs = list(unique.values())
    if len(run_dirs) < sum(named.values()):
        # directories named more than once, each counted once however often it is named
        twice = sum(1 for times in named.values() if times > 1)
        what = "run directory" if twice == 1 else "run directories"
        print(f"mptex-rescore: {twice} {what} given more than once: each is scored once",
              file=sys.stderr)  # fmt: skip
    # Files among the paths (a glob such as SWEEP/* also names report.md, results.csv, ...):
    # skipped, in one line however many there are.
    files = [path for path in run_dirs if path.is_file()]
    if files:
        run_dirs = [path for path in run_dirs if not path.is_file()]
        print(f"mptex-rescore: {_files_skipped(files)}", file=sys.stderr)
        if not run_dirs:
            print("mptex-rescore: error: no run directory given", file=sys.stderr)
            return 2
    for run_dir in run_dirs:
        if not run_dir.is_dir():
            print(f"mptex-rescore: {run_dir}: no such run directory", file=sys.stderr)
            continue
        if not (run_dir / "checkpoint.pt").is_file():
            print(f"mptex-rescore: {run_dir}: {no_checkpoint_reason(run_dir)}", file=sys.stderr)
            continue  # one of several (a diverged run writes none): the others are scored
        try:
            # Triton's kernels launch on the current CUDA device: the rescore's
            with launching_on(device):
                rows += rescore(run_dir, args.val_spp, device, args.n_val_views)
        except CheckpointError as exc:  # unreadable, corrupt or not an mptex checkpoint
            print(f"mptex-rescore: error: {exc}", file=sys.stderr)
            return 2
        except (ValueError, RuntimeError) as exc:  # what this machine cannot run, in one line
            why = " ".join(str(exc).split()) or type(exc).__name__
            print(f"mptex-rescore: error: {run_dir}: {why}", file=sys.stderr)
            return 2
    if not rows:  # nothing scored: every run was skipped, each said why
        if len(run_dirs) > 1:
            print(f"mptex-rescore: error: none of the {len(run_dirs)} run directories could be "
                  "scored", file=sys.stderr)  # fmt: skip
        return 2
    print(f"machine: {device_name(device)}\n")
    print(markdown_table(
        ["run", "scene", "arm", "seed", "val_spp", "PSNR (dB)", "baseline (dB)", "own", "s"],
        [[Path(r["run"]).name, r["scene"], r["arm"], r["seed"], r["val_spp"], f"{r['psnr']:.2f}",
          f"{r['baseline_psnr']:.2f}",
          "-" if r["own"] is None else ("equal" if r["own"] == r["psnr"] else f"{r['own']:.2f}"),
          f"{r['seconds']:.1f}"] for r in rows],
    ))  # fmt: skip
    # Runs whose configs differ in more than the seed (a swept key, as the report reads them)
    # are not seeds of one setting: the summary keeps them apart and names the keys.
    runs = [{"config": flatten_config(r.pop("config", {}))} for r in rows]
    keys = [k for k in swept_keys(runs) if k not in ("scene.name", "precision.name")]
    keys = shown_keys(runs, ["scene.name", "precision.name", *keys])[2:]
    groups: dict[tuple, list[float]] = {}
    # A seed of a setting counts once (a copied or re-run run directory), as in the report.
    counted: dict[tuple, str] = {}
    for r, run in zip(rows, runs):
        config = " ".join(f"{k}={run['config'].get(k)}" for k in keys)
        group = (r["scene"], r["arm"], config, r["val_spp"])
        first = counted.setdefault((*group, str(r["seed"])), r["run"])
        if first != r["run"]:
            if r["val_spp"] == rows[0]["val_spp"]:  # said once per run, not per setting
                print(f"mptex-rescore: {r['run']}: seed {r['seed']} again (as {first}): "
                      "counted once in the summary", file=sys.stderr)  # fmt: skip
            continue
        groups.setdefault(group, []).append(r["psnr"])
    print()
    print(markdown_table(
        ["scene", "arm", *(["config"] if keys else []), "val_spp", "runs",
         "mean ± sample std (dB)"],
        [[scene, arm, *([config] if keys else []), spp, len(v), f"{statistics.mean(v):.2f} ± "
          + (f"{statistics.stdev(v):.2f}" if len(v) > 1 else "-")]
         for (scene, arm, config, spp), v in groups.items()],
    ))  # fmt: skip
    if args.json:
        try:
            Path(args.json).write_text(json.dumps({"machine": device_name(device),
                                                   "scores": rows}, indent=1))  # fmt: skip
        except OSError as exc:  # a folder that is read-only, a full disk: the table stands
            print(f"mptex-rescore: error: --json: cannot write {args.json} ({exc.strerror or exc})",
                  file=sys.stderr)  # fmt: skip
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(rescore_main())
