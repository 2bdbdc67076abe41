"""``mptex-search``: the precision search, a Hydra app over mptex-train's configs.

It finds the cheapest assignment of dtypes to the hash grid and each MLP layer whose PSNR is
certified within the margin of f32's (:func:`mptex.search.run_search` states the method)::

    mptex-search                                 # the built-in scene, +experiment=precision_search
    mptex-search scene=soccer                    # a real asset
    mptex-search search.certify_seeds=5 train.iterations=600

Without an ``experiment`` override it adds ``+experiment=precision_search`` (the search's
protocol and settings); ``mptex-train +experiment=precision_search`` is the same command under
its older spelling. Results, the result's precision config included, go to the run directory
(``outputs/precision_search/<scene>/``), which it prints with the command that trains the
result. Exit status as ``mptex-train``'s: 0 done, 2 a bad setting (one line), 3 stopped by a
signal (run the same command again to continue).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from mptex.cli.app import (
    EXIT_CODES,
    record_stopped_job,
    run_hydra_app,
    stopped_before_start,
    sweep_job_process,
)

__all__ = ["search_main", "run_search_command"]

_PROG = "mptex-search"


def run_search_command(cfg, run_dir: str | os.PathLike, prog: str = _PROG) -> None:
    """Run the search of a composed config (with its ``search`` block); print the certified
    assignment, the command that trains it and where the report is; exit 2 / 3 as documented."""
    from omegaconf.errors import InterpolationResolutionError

    from mptex.search import SearchError, SearchInterrupted, run_search

    try:
        summary = run_search(cfg, run_dir)
    except InterpolationResolutionError:
        raise  # a ValueError too: run_hydra_app's task says it in one line naming the key
    except (SearchError, ValueError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        sys.exit(EXIT_CODES["error"])
    except SearchInterrupted as exc:
        print(f"{prog}: interrupted: {exc}", file=sys.stderr)
        if sweep_job_process():
            record_stopped_job(run_dir, "interrupted")
            return  # a parallel sweep's job: the sweep's process exits 3 after its report
        sys.exit(EXIT_CODES["interrupted"])
    row = next(r for r in summary["candidates"] if r["candidate"] == summary["certified"])
    cert = row["certificate"] or {}
    interval = (f"[{cert['low']:+.2f}, {cert['high']:+.2f}] dB"
                if cert.get("low") is not None else "-")  # fmt: skip
    budget = summary["budget"]
    print(f"{prog}: precision search: certified {summary['certified']} "
          f"(PSNR - PSNR(f32) {interval}, seeds {summary['seeds']}); "
          f"{budget['runs']} runs, {budget['search_wall_s']:.0f} s")  # fmt: skip
    print(f"{prog}: {summary['reproduce']} trains it ({summary['result_config']})")
    print(f"{prog}: report in {Path(run_dir) / 'search.md'}")


def _run(cfg) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    if hydra_cfg.mode == RunMode.MULTIRUN and stopped_before_start(cfg, run_dir, _PROG):
        return  # a parallel sweep stopped by a signal before this job: it does not start
    if "search" not in cfg:
        print(f"{_PROG}: error: search: the composed config has no search block; use "
              "+experiment=precision_search (the default) or an experiment that has one",
              file=sys.stderr)  # fmt: skip
        sys.exit(EXIT_CODES["error"])
    run_search_command(cfg, run_dir)


def search_main() -> None:
    """Entry point of ``mptex-search``; see the module docstring."""
    sys.argv = [sys.argv[0], *_with_experiment(sys.argv[1:])]
    run_hydra_app(_run, _PROG)


def _with_experiment(args: list[str]) -> list[str]:
    """``args`` with ``+experiment=precision_search`` added unless an experiment is named:
    just before the first override, since Hydra's argument parser takes its overrides as one
    run of words (``-m scene=a,b`` with the addition in front failed as unrecognised
    arguments), and in front where there is no override (``--info`` takes an optional
    word)."""
    if any(a.lstrip("+~").startswith("experiment=") for a in args):
        return list(args)
    at = next((i for i, a in enumerate(args) if "=" in a and not a.startswith("-")), 0)
    return [*args[:at], "+experiment=precision_search", *args[at:]]


if __name__ == "__main__":
    search_main()
