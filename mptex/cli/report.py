"""``mptex-report FOLDER``: the precision ablation report of a sweep, or of each sweep in a folder.

Writes ``report.md``, ``results.csv``, ``results.json``, ``results.tex`` (the tables as LaTeX)
and the plots (PNG, the curves also as PDF) into each sweep directory
(:func:`mptex.report.write_report`); a Hydra multirun writes it by itself at its end
(:class:`mptex.report.ReportCallback`). Exit 0 on success, 2 for a bad option, a missing folder,
a folder without jobs, or jobs outside the sweeps of a folder of sweeps (one line naming them).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from mptex.report import collect, stats
from mptex.report.writer import write_report

__all__ = ["report_main"]


def report_main(argv: Sequence[str] | None = None) -> int:
    """``mptex-report FOLDER``: report each sweep under FOLDER; print each report.md's path.

    Exit 0 on success, 2 for a missing folder, a folder without jobs, or jobs outside the
    sweeps of a folder of sweeps (one line naming them).
    """
    parser = argparse.ArgumentParser(
        prog="mptex-report",
        description="Aggregate mptex sweeps into report.md, results.csv/json/tex and plots, "
        "written into each sweep directory. A folder holding several sweeps (directories with "
        "Hydra's multirun.yaml) gets one report per sweep.",
    )
    parser.add_argument("folder", type=Path, help="a multirun directory, or a folder of them")
    parser.add_argument("--margin-db", type=float, default=stats.EQUIVALENCE_MARGIN_DB,
                        help="equivalence margin of the verdicts in dB (default "
                        f"{stats.EQUIVALENCE_MARGIN_DB})")  # fmt: skip
    parser.add_argument("--adjust", choices=stats.ADJUSTMENTS, default="none",
                        help="the intervals' multiplicity adjustment: none (each 95%% on its "
                        "own, the default) or bonferroni (the k intervals of a report at "
                        "1 - 0.05/k each, so that all hold together at 95%%)")  # fmt: skip
    args = parser.parse_args(argv)
    try:  # the report's own check, before any sweep is read; its key named as the flag
        stats.check_settings(args.margin_db, args.adjust)
    except ValueError as exc:
        key, _, why = str(exc).partition(": ")
        print(f"mptex-report: error: --{key.replace('_', '-')}: {why}", file=sys.stderr)
        return 2
    try:
        sweeps = collect.find_sweeps(args.folder)
        if len(sweeps) > 1:
            print(f"mptex-report: {args.folder} holds {len(sweeps)} sweeps; one report each")
        for sweep in sweeps:
            written = write_report(sweep, args.margin_db, args.adjust)
            print(f"mptex-report: report in {written['report.md']}")
    except (FileNotFoundError, collect.SweepLayoutError) as exc:
        print(f"mptex-report: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(report_main())
