"""The ablation report: a sweep's ``metrics.json`` files as tables with confidence intervals,
verdicts and plots.

``mptex-report FOLDER`` (:mod:`mptex.cli.report`), or :class:`ReportCallback` at the end of a Hydra
multirun, writes into each sweep directory:

- ``report.md``: per context (scene and every other swept value outside the precision group),
  one row per arm: n seeds, PSNR mean ± std, the paired difference to ``f32`` with its 95 %
  Student-t interval (or Bonferroni-adjusted: ``--adjust``) and the verdict it supports, the
  constant-colour baseline, time per iteration and speed-up, peak memory, skipped steps,
  effective loss scale and the runs' outcomes; the device and versions; an automatic reading
  (the fastest arm at f32's quality by the interval, arms judged worse, diverged and failed
  runs, runs under the baseline).
- ``results.csv`` / ``results.json``: the raw per-run numbers (and, in the JSON, the row
  summaries the tables show).
- ``results.tex``: report.md's tables as LaTeX tables (booktabs), each with a caption that
  states its seeds, interval and adjustment, to paste into a paper.
- ``psnr_curves.png``, ``loss_scale.png`` (effective scale), each also as a vector PDF, and
  ``images.png`` (reference, each arm, zoom, error map).

Modules: :mod:`~mptex.report.collect` (jobs, configs, sweeps, grouping by the swept keys),
:mod:`~mptex.report.stats` (paired differences, intervals, verdicts),
:mod:`~mptex.report.compare` (two reports' results compared, timings left out),
:mod:`~mptex.report.markdown`, :mod:`~mptex.report.plots`, :mod:`~mptex.report.writer` (writing
the files, and the Hydra callbacks), :mod:`~mptex.report.latex`; the command is
:mod:`mptex.cli.report`. Nothing here imports the training loop: ``metrics.json`` is the
contract (docs/metrics.md).
"""

from mptex.report.collect import (
    ARM_ORDER,
    REFERENCE_ARM,
    STATUSES,
    SweepLayoutError,
    collect_runs,
    find_sweeps,
    group_runs,
)
from mptex.report.compare import result_differences
from mptex.report.stats import (
    ADJUSTMENTS,
    EQUIVALENCE_MARGIN_DB,
    family_confidence,
    mean_ci,
    t_quantile,
    verdict,
)
from mptex.report.writer import (
    REPORT_FILES,
    FreshSweepDirCallback,
    ReportCallback,
    summarize,
    write_report,
)

__all__ = [
    "STATUSES",
    "ARM_ORDER",
    "REFERENCE_ARM",
    "EQUIVALENCE_MARGIN_DB",
    "ADJUSTMENTS",
    "REPORT_FILES",
    "SweepLayoutError",
    "collect_runs",
    "find_sweeps",
    "group_runs",
    "summarize",
    "mean_ci",
    "family_confidence",
    "t_quantile",
    "verdict",
    "write_report",
    "ReportCallback",
    "FreshSweepDirCallback",
    "result_differences",
]
