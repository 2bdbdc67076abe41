"""Writing the report (:func:`write_report`, which ``mptex-report`` runs) and the Hydra callbacks.

Order of work in :func:`write_report`: read every job, group, summarise (nothing written yet, so
a bad file can never leave half a report); then results.csv, results.json, results.tex, the
plots (a plot that fails is named in report.md, never fatal) and report.md last.
"""

from __future__ import annotations

import atexit
import csv
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from mptex.report import attribution, collect, latex, markdown, plots, stats

__all__ = ["REPORT_FILES", "SweepDirInUse", "summarize", "write_report",
           "ReportCallback", "FreshSweepDirCallback"]  # fmt: skip

REPORT_FILES = ("report.md", "results.csv", "results.json", "results.tex", "psnr_curves.png",
                "psnr_curves.pdf", "loss_scale.png", "loss_scale.pdf", "images.png")  # fmt: skip
# Created (O_EXCL) in a sweep directory by FreshSweepDirCallback: the sweep that owns it.
SWEEP_MARKER = ".mptex_sweep"


def _plain(value: Any) -> Any:
    """JSON-safe: non-finite floats become null (results.json is strict JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def summarize(
    runs: Sequence[dict[str, Any]],
    margin_db: float = stats.EQUIVALENCE_MARGIN_DB,
    adjust: str = "none",
) -> list[dict[str, Any]]:
    """The table rows of a sweep's runs (:func:`~mptex.report.collect.collect_runs`): grouped by
    every swept key (:func:`~mptex.report.collect.group_runs`), each with its paired comparison
    (:func:`~mptex.report.stats.summarize_groups`). Duplicates and config-less runs are in no
    row. ``adjust``: the intervals' multiplicity adjustment
    (:data:`~mptex.report.stats.ADJUSTMENTS`)."""
    return _tables(runs, margin_db, adjust)[3]


def _tables(runs, margin_db, adjust):
    keys, groups, duplicates, unidentified = collect.group_runs(runs)
    shown = collect.shown_keys([r for g in groups for r in g], keys)
    rows = stats.summarize_groups(groups, shown, margin_db, adjust)
    return keys, groups, (duplicates, unidentified), rows


def write_report(
    sweep_dir: str | os.PathLike,
    margin_db: float = stats.EQUIVALENCE_MARGIN_DB,
    adjust: str = "none",
) -> dict[str, Path]:
    """Aggregate the jobs of one sweep and write the report files into ``sweep_dir``.

    Never raises for a bad job (failed, diverged, crashed without ``metrics.json``, unreadable or
    non-strict JSON): it is counted and listed. A plot with nothing to show is not written.

    Args:
        sweep_dir: one sweep (see :func:`mptex.report.collect.find_sweeps`).
        margin_db: the equivalence margin of the verdicts, in dB.
        adjust: ``"none"`` (each interval 95 % on its own) or ``"bonferroni"`` (the table's
            k intervals at 1 - 0.05/k each, so that all hold together at 95 %;
            :func:`~mptex.report.stats.summarize_groups`). The nvdiffrec #154 section's
            intervals stay 95 % each.

    Returns:
        file name -> path of each file written (see :data:`REPORT_FILES`).

    Raises:
        FileNotFoundError: ``sweep_dir`` does not exist.
        SweepLayoutError: it holds no job, or several sweeps (report each of
            :func:`~mptex.report.collect.find_sweeps`).
    """
    sweep_dir = Path(sweep_dir).resolve()
    found = collect.find_sweeps(sweep_dir)
    if found != [sweep_dir]:
        names = ", ".join(str(s.relative_to(sweep_dir)) for s in found)
        raise collect.SweepLayoutError(f"{sweep_dir}: holds {len(found)} sweeps ({names})")
    runs = collect.collect_runs(sweep_dir)
    keys, groups, (duplicates, unidentified), rows = _tables(runs, margin_db, adjust)
    counted = [r for g in groups for r in g]
    # The #154 section, per context (scene, settings): pairs never cross one.
    gaps = [(context, attribution.attribution(members, margin_db))
            for context, members in attribution.contexts(counted)
            if attribution.applies(members)]  # fmt: skip
    sections = stats.sections(rows)
    written: dict[str, Path] = {}

    path = sweep_dir / "results.csv"
    fields = [*collect.RUN_FIELDS, "collapsed", *keys, "counted", "note"]
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(fields)
        for run in runs:
            duplicate = run.get("duplicate_of")
            record = {
                **{k: run.get(k) for k in (*collect.RUN_FIELDS, "collapsed")},
                **(run.get("keys") or {}),
                "counted": duplicate is None and run.get("config") is not None,
                "note": f"duplicate of {duplicate}" if duplicate else run.get("note"),
            }
            writer.writerow(["" if record.get(k) is None else record[k] for k in fields])
    written[path.name] = path

    path = sweep_dir / "results.json"
    plain_runs = [{k: v for k, v in run.items() if k not in ("history", "config")
                   and not k.startswith("_")} for run in runs]  # fmt: skip
    study = [{"context": context, **gap} for context, gap in gaps] or None
    family = {
        "adjust": adjust,
        "comparisons": rows[0]["family"] if rows else 0,
        "interval_confidence": rows[0]["confidence"] if rows else stats.CONFIDENCE,
    }
    document = {"sweep_dir": str(sweep_dir), "swept_keys": keys, "margin_db": margin_db,
                "intervals": family, "runs": plain_runs, "summary": rows,
                "nvdiffrec154": study}  # fmt: skip
    path.write_text(json.dumps(_plain(document), indent=2, allow_nan=False, default=str) + "\n")
    written[path.name] = path

    path = sweep_dir / "results.tex"
    shared = collect.concurrent_jobs(sweep_dir)  # for results.tex's captions and report.md
    devices = sorted({str(r["device"]) for r in runs if r.get("device")})
    path.write_text(latex.render_latex(rows, sections, margin_db, str(sweep_dir), devices,
                                       shared))  # fmt: skip
    written[path.name] = path

    made: dict[str, Any] = {}
    failures = []
    for name, draw in (
        ("psnr_curves.png", lambda p: plots.plot_history(p, sections, rows, groups, "psnr")),
        ("loss_scale.png", lambda p: plots.plot_history(p, sections, rows, groups, "loss_scale")),
        ("images.png", lambda p: plots.plot_images(p, sweep_dir, sections, rows, groups)),
        ("gap_curves.png", lambda p: bool(gaps) and attribution.plot_gap(p, gaps)),
    ):
        try:
            made[name] = draw(sweep_dir / name)
        except Exception as exc:  # a picture never costs the tables
            made[name] = None
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
    written.update({name: sweep_dir / name for name, value in made.items() if value})
    for name in ("psnr_curves.png", "loss_scale.png"):  # each with its vector copy
        if made[name]:
            written[name[:-4] + ".pdf"] = sweep_dir / (name[:-4] + ".pdf")

    path = sweep_dir / "report.md"
    text = markdown.render_report(sweep_dir, runs, keys, rows, groups, sections, duplicates,
                                  unidentified, made, margin_db, shared)  # fmt: skip
    if gaps:  # the #154 sections go before "How to read this"
        plotted = bool(made["gap_curves.png"])
        section = "\n".join(
            line for context, gap in gaps
            for line in attribution.render(gap, margin_db, plotted, context)
        )  # fmt: skip
        head, sep, tail = text.partition("## How to read this")
        text = head + section + "\n" + sep + tail
    if failures:
        text += "\nPlots not drawn:\n" + "".join(f"- {f}\n" for f in failures)
    path.write_text(text)
    written[path.name] = path
    return written


class ReportCallback(Callback):
    """Hydra callback: write the report into ``hydra.sweep.dir`` when a multirun ends.

    Registered in ``configs/config.yaml`` (``hydra.callbacks.report``). Hydra skips
    ``on_multirun_end`` when a job raised, so the report is also written at interpreter exit
    if the multirun did not end normally: a crashed job never costs the others' report.

    Args:
        enabled: write the report at all.
        margin_db: the verdicts' equivalence margin in dB (> 0).
        adjust: the intervals' multiplicity adjustment, ``none`` or ``bonferroni``
            (:func:`write_report`).

    A value outside those stops the multirun before any job, with one line on stderr (exit 2),
    rather than costing the report after every job has trained.
    """

    def __init__(self, enabled: bool = True, margin_db: float = stats.EQUIVALENCE_MARGIN_DB,
                 adjust: str = "none") -> None:  # fmt: skip
        try:
            stats.check_settings(margin_db, adjust)
        except ValueError as problem:
            print(f"mptex-train: error: hydra.callbacks.report.{problem}", file=sys.stderr,
                  flush=True)  # fmt: skip
            raise SystemExit(2) from None
        self.enabled = enabled
        self.margin_db = margin_db
        self.adjust = adjust
        self._pending: Path | None = None

    def on_multirun_start(self, config, **kwargs: Any) -> None:
        if self.enabled:
            self._pending = Path(str(config.hydra.sweep.dir)).resolve()
            atexit.register(self._write_pending)

    def on_multirun_end(self, config, **kwargs: Any) -> None:
        if self.enabled:
            self._pending = Path(str(config.hydra.sweep.dir)).resolve()
            self._write_pending()

    def _write_pending(self) -> None:
        sweep_dir, self._pending = self._pending, None
        if sweep_dir is None:
            return
        try:
            written = write_report(sweep_dir, self.margin_db, self.adjust)
        except Exception as exc:  # the sweep's results are on disk; mptex-report can retry
            print(f"mptex-report: no report for {sweep_dir}: {type(exc).__name__}: {exc}",
                  file=sys.stderr)  # fmt: skip
            return
        print(f"mptex-report: report in {written['report.md']}", flush=True)


class SweepDirInUse(SystemExit):
    """Raised (as a one-line exit 2) when a multirun would write into another sweep's folder."""


class FreshSweepDirCallback(Callback):
    """Hydra callback: refuse to start a multirun in a directory another sweep already uses.

    Job directories are named ``<job num>_<overrides>``; two sweeps in one directory would give
    their jobs the same names and overwrite each other's results. At multirun start (before
    Hydra writes anything there) this creates ``<sweep dir>/.mptex_sweep`` exclusively
    (``O_CREAT | O_EXCL``: atomic, so two sweeps started at once cannot both get it), and
    refuses when it already exists, or when the folder already holds ``multirun.yaml`` or job
    directories of a sweep from before this guard. Registered in ``configs/config.yaml``
    (``hydra.callbacks.fresh_sweep_dir``); ``enabled=false`` turns it off (to re-run a sweep into
    its own folder on purpose, e.g. with ``train.resume=true``).

    Hydra turns an exception in a callback into a warning, so the refusal is a ``SystemExit``
    with status 2 and one line on stderr.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled

    def on_multirun_start(self, config, **kwargs: Any) -> None:
        if not self.enabled:
            return
        sweep_dir = Path(str(config.hydra.sweep.dir)).resolve()
        sweep_dir.mkdir(parents=True, exist_ok=True)
        existing = [p.name for p in sorted(sweep_dir.iterdir())
                    if p.name == "multirun.yaml" or (p / "metrics.json").is_file()
                    or (p / ".hydra").is_dir()][:3]  # fmt: skip
        try:
            fd = os.open(sweep_dir / SWEEP_MARKER, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
        except FileExistsError:
            existing = [SWEEP_MARKER, *existing]
        else:
            os.close(fd)
            if existing:
                os.unlink(sweep_dir / SWEEP_MARKER)
        if existing:
            print(
                f"mptex-train: error: hydra.sweep.dir: {sweep_dir} already holds a sweep "
                f"({', '.join(existing)}); choose a new directory, or set "
                "hydra.callbacks.fresh_sweep_dir.enabled=false to write into it anyway",
                file=sys.stderr,
                flush=True,
            )
            raise SweepDirInUse(2)
