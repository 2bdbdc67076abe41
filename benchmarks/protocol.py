"""Noise of the training protocol: thread-count dependence and seed spread of the final PSNR.

Trains ``mptex-train``'s config (composed with Hydra, any overrides) for each (arm, seed,
threads), in this order, in one process, and prints a table of the final validation PSNR, the
standard deviation over seeds (sample std, n - 1) and the largest 1-vs-2-thread difference per
(arm, seed). As ``mptex-train``, it turns on MKL's strict reproducibility mode
(``MKL_CBWR=AUTO,STRICT``) before any tensor work unless ``--no-mkl-cbwr``.

    python benchmarks/protocol.py --arms f32 --seeds 0 1 2 3 --threads 1 2 -- train=ablation
    python benchmarks/protocol.py --no-mkl-cbwr --seeds 0 1 2 --threads 1 2   # nvdiffrec's recipe
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from mptex.cli import CONFIG_DIR, _reproducible_blas


def run_one(arm: str, seed: int, threads: int, overrides: list[str]) -> dict:
    from hydra import compose, initialize_config_dir

    from mptex.train import train

    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(
            "config",
            overrides=[f"precision={arm}", f"train.seed={seed}", f"train.threads={threads}",
                       "train.progress=false", "train.checkpoint_interval=0",
                       "train.n_val_images=0", "train.stats_interval=0", *overrides],
        )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        metrics = train(cfg, tmp)
        wall = time.perf_counter() - start
    curve = [(h["iteration"], h["psnr"]) for h in metrics["history"] if h["psnr"] is not None]
    return dict(arm=arm, seed=seed, threads=threads, psnr=metrics["psnr"], wall_s=wall,
                status=metrics["status"], curve=curve,
                psnr_per_image=metrics["psnr_per_image"])  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", nargs="+", default=["f32"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--json", type=Path, default=None, help="also write every run here")
    parser.add_argument("--no-mkl-cbwr", action="store_true", help="leave MKL_CBWR unset")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, after --")
    args = parser.parse_args(argv)
    if not args.no_mkl_cbwr:
        _reproducible_blas()
    import torch

    runs = []
    for arm in args.arms:
        for seed in args.seeds:
            for threads in args.threads:
                run = run_one(arm, seed, threads, args.overrides)
                runs.append(run)
                curve = " ".join(f"{p:.2f}" for _, p in run["curve"])
                print(f"{arm} seed {seed} threads {threads}: {run['psnr']:.3f} dB "
                      f"({run['wall_s']:.1f} s) curve: {curve}", flush=True)  # fmt: skip
    print(f"\noverrides: {' '.join(args.overrides) or '(none)'}; torch {torch.__version__}; "
          f"MKL_CBWR={os.environ.get('MKL_CBWR')}")  # fmt: skip
    print("| arm | threads | seeds | PSNR per seed (dB) | mean ± std | max 1 vs 2 threads |")
    print("|---|---|---|---|---|---|")
    for arm in args.arms:
        for threads in args.threads:
            vals = [r["psnr"] for r in runs if r["arm"] == arm and r["threads"] == threads]
            std = statistics.stdev(vals) if len(vals) > 1 else float("nan")
            diffs = []
            for seed in args.seeds:
                by_t = {
                    r["threads"]: r["psnr"] for r in runs if r["arm"] == arm and r["seed"] == seed
                }
                if len(by_t) > 1:
                    diffs.append(max(by_t.values()) - min(by_t.values()))
            diff = f"{max(diffs):.3f}" if diffs else "–"
            per = ", ".join(f"{v:.2f}" for v in vals)
            print(f"| {arm} | {threads} | {len(vals)} | {per} | {statistics.mean(vals):.2f} ± "
                  f"{std:.2f} | {diff} |")  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    sys.exit(main())
