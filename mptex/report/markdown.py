"""report.md: the tables, the automatic reading and how to read them."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from mptex.collapse import PARTLY_STUCK_RULE
from mptex.collapse import RULE as COLLAPSE_RULE
from mptex.intervals import faster, percent, ratio_text
from mptex.numbers import is_number
from mptex.report.collect import (
    REFERENCE_ARM,
    STATUSES,
    partial_keys,
    planned_swept_keys,
    sorted_seeds,
    unstarted_jobs,
)
from mptex.report.stats import (
    CONFIDENCE,
    SETTLE_MAX_SEEDS,
    at_reference_quality,
    differs_from_reference,
    non_inferior,
    speed_candidates,
    speed_ratio,
)

__all__ = ["render_report", "delta_cell", "interval_text", "verdict_text", "runs_at_once"]


# ----------------------------------------------------------------------------- formatting
def _fmt(value: Any, spec: str) -> str:
    return format(value, spec) if is_number(value) else "–"


def _confidence(row: Mapping[str, Any]) -> float:
    """The two-sided confidence of the row's interval (adjusted or not)."""
    return row.get("confidence", CONFIDENCE)


def _signed(value: Any) -> str:
    return _fmt(value, "+.2f")


def _scale(values: Sequence[float]) -> str:
    if not values:
        return "–"
    text = [f"{v:g}" for v in (values[0], values[-1])]
    return text[0] if len(values) == 1 else f"{text[0]}–{text[1]}"


def _psnr(row: Mapping[str, Any]) -> str:
    if row["psnr_mean"] is None:
        return "–"
    std = row["psnr_std"]
    text = f"{row['psnr_mean']:.2f}" + (f" ± {std:.2f}" if std is not None else "")
    # Marked where a run did no better than painting the mean colour.
    return text + (" ⚠" if row["below_baseline"] else "")


def interval_text(delta: Mapping[str, Any], margin_db: float) -> tuple[str, str, str]:
    """Mean, low and high as printed: two decimals, or as many more (up to six) as it takes for
    the printed bounds to say what the exact ones say about 0 and ±``margin_db`` (a low of
    0.004 printed +0.00 would read as touching 0 under a verdict of ``better``); beyond six,
    the shortest text that reads back as the exact values."""
    low, high = delta["low"], delta["high"]

    def facts(lo: float, hi: float) -> tuple[bool, ...]:
        return lo > 0, hi < 0, lo >= -margin_db, hi <= margin_db

    for digits in range(2, 7):
        text = [format(v, f"+.{digits}f") for v in (delta["mean"], low, high)]
        if facts(float(text[1]), float(text[2])) == facts(low, high):
            return text[0], text[1], text[2]
    return format(delta["mean"], "+.6f"), format(low, "+"), format(high, "+")


def runs_at_once(shared: int) -> str:
    """How many runs trained at a time, in words: ``up to 4``, or ``as many as the machine's
    cores`` for 0 (:func:`~mptex.report.collect.concurrent_jobs`)."""
    return "as many as the machine's cores" if shared == 0 else f"up to {shared}"


def delta_cell(
    row: Mapping[str, Any], margin_db: float, number=lambda text: text, none: str = "–"
) -> str:
    """The Δ column's cell: ``+0.12 [-0.05, +0.29]``, ``(n pairs)`` where they are not the
    row's seeds, ``+0.20 (1 seed)`` without an interval, ``none`` without a comparison;
    ``number`` wraps each printed number (LaTeX's math mode)."""
    delta = row["delta"]
    if row["verdict"] is None or delta["mean"] is None:
        return none
    if delta["half_width"] is None:
        return f"{number(_signed(delta['mean']))} (1 seed)"
    mean, low, high = interval_text(delta, margin_db)
    # The pairs are the seeds both completed: said where that is not the row's seeds column.
    n = delta["n"]
    pairs = f" ({n} pairs)" if n != row["n_seeds"] else ""
    return f"{number(mean)} [{number(low)}, {number(high)}]{pairs}"


def _settle(row: Mapping[str, Any]) -> str:
    """An inconclusive row's estimate of the paired seeds that would settle it."""
    if row["verdict"] != "inconclusive":
        return ""
    n = row.get("seeds_to_settle")
    if n is None:
        return f"; more than {SETTLE_MAX_SEEDS} seeds at this mean and spread"
    return f"; about {n} paired seeds at this mean and spread"


def verdict_text(row: Mapping[str, Any], margin_db: float) -> str:
    """The verdict column's cell: the row's verdict, with the margin (``no detectable
    difference within ±0.5 dB``, ``worse, by at most 0.5 dB``), the paired seeds of ``cannot
    judge``, ``reference`` or ``no reference`` for a row not compared."""
    if row["verdict"] is None:
        return "reference" if row["precision"] == REFERENCE_ARM else "no reference"
    if row["verdict"] == "no paired seeds":
        return "–"
    if row["verdict"] == "no detectable difference":
        return f"no detectable difference within ±{margin_db:g} dB"
    if row["verdict"] == "cannot judge":
        return f"cannot judge ({row['delta']['n']} paired seed{'s' * (row['delta']['n'] != 1)})"
    low, high = row["delta"]["low"], row["delta"]["high"]
    if -margin_db <= low and high <= margin_db:  # a difference shown, and shown to be small
        return f"{row['verdict']}, by at most {margin_db:g} dB"
    return row["verdict"]


def _duplicate_result(run: Mapping[str, Any]) -> str:
    """A run's status and PSNR, for the line that names it a duplicate (two completed runs of
    one config and seed that disagree show it there)."""
    psnr = run.get("psnr")
    return f"{run.get('status')}" + (f", PSNR {psnr:.2f} dB" if is_number(psnr) else "")


def _lost_runs(row: Mapping[str, Any]) -> str:
    """``"2 diverged / 1 failed"``: the row's runs that did not complete, by status."""
    return " / ".join(f"{row[k]} {k}" for k in ("diverged", "collapsed", "failed") if row[k])


def _value(value: Any) -> str:
    return "–" if value is None else f"`{value}`"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table with columns padded to their widest cell (readable as plain text)."""
    cells = [list(map(str, header))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _shown_underflow(key: str) -> bool:
    # Weight gradients of each layer, and the gradient reaching the encoder's output and table.
    # Left out: out_grad_zero_frac of MLP layers (mostly ReLU's zeros, not underflow) and the
    # table's grad_zero_frac (entries no point touched).
    if key.startswith("net"):
        return ".out_grad_" not in key
    return key in ("encoder.out_grad_subnormal_frac", "encoder.grad_subnormal_frac")


def _swept(sweep_dir: str | os.PathLike, shown: Sequence[str]) -> str:
    """The header's swept keys: those the runs vary; where they vary none, what the sweep's
    multirun.yaml planned (one run of a planned precision x seed sweep swept something)."""
    if shown:
        return ", ".join(f"`{k}`" for k in shown)
    planned = planned_swept_keys(sweep_dir)
    if planned:
        return (f"nothing among these runs (its multirun.yaml plans "
                f"{' x '.join(f'`{k}`' for k in planned)})")  # fmt: skip
    return "nothing"


def _start_memory(runs: Sequence[Mapping[str, Any]]) -> str:
    """The sentence on what the peak-memory column leaves out: the runs' starts."""
    done = [r for r in runs if r.get("status") == "completed"]
    starts = [r["start_peak_memory_bytes"] for r in done
              if is_number(r.get("start_peak_memory_bytes"))]  # fmt: skip
    text = ("A run's start (the scene with the training views' G-buffers, the texture, "
            "set-up) is measured apart, the same way: `metrics.json`'s "
            "`start_peak_memory_bytes`")  # fmt: skip
    if not starts:
        return text + "."
    text += f"; the largest over the completed runs is {max(starts) / 2**20:.0f} MiB"
    peaks = [r["peak_memory_bytes"] for r in done if is_number(r.get("peak_memory_bytes"))]
    if peaks and max(starts) > max(peaks):
        text += ", more than the column's largest: a job needs that much"
    return text + "."


def _environment(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    def distinct(key):
        return sorted({str(r[key]) for r in runs if r.get(key) is not None})

    versions: dict[str, set[str]] = {}
    for run in runs:
        for key, value in (run.get("versions") or {}).items():
            versions.setdefault(key, set()).add(str(value))
    backends: dict[str, set[str]] = {}
    for run in runs:
        parts = [run.get(f"{part}_backend") for part in ("encoder", "mlp", "raster")]
        if run.get("fp8_gemm_backend"):  # FP8 tensor cores or the emulation
            parts[1] = f"{parts[1] or '–'} (FP8 GEMMs {run['fp8_gemm_backend']})"
        if any(parts):
            backends.setdefault(str(run.get("precision")), set()).add(
                " / ".join(part or "–" for part in parts)
            )
    backend_text = "; ".join(f"`{arm}` {', '.join(sorted(b))}" for arm, b in backends.items())
    backend_text = backend_text or "–"
    version_text = ", ".join(f"{k} {' / '.join(sorted(v))}" for k, v in sorted(versions.items()))
    return [
        f"- Device: {' / '.join(distinct('device')) or '–'} "
        f"({' / '.join(distinct('device_name')) or 'unknown'}); torch threads per run: "
        f"{' / '.join(distinct('torch_threads')) or '–'}",
        f"- Versions: {version_text or '–'}",
        f"- Backends that ran (encoder / MLP / rasterizer; torch = mptex's PyTorch twin): "
        f"{backend_text}",
    ]


# ----------------------------------------------------------------------------- reading
# How a line names each part of a run that metrics.json's stop_requested.during records
# (anything else as it is written: "last iteration", "final validation", "export", ...).
_DURING = {"metrics": "metrics.json write", "images": "validation images"}


def during_text(during: str) -> str:
    """The part of a run that ``stop_requested.during`` names, as a line says it: ``"the
    export"``, ``"the metrics.json write"``."""
    return f"the {_DURING.get(during, during)}"


def _name(row: Mapping[str, Any]) -> str:
    extra = [f"{k}={v}" for k, v in row["keys"].items()
             if k.startswith("precision.") and k != "precision.name"]  # fmt: skip
    return f"`{' '.join([str(row['precision']), *extra])}`"


# Adam epsilons on the grid at or below this were measured not to matter: nvdiffrec's arm (an
# effective 1e-8 / 128) against itself at 1e-15, -0.03 [-0.18, +0.11] dB on the real-asset
# torus, where the grid's sqrt(v) has median 2.3e-8 (docs/archive/adam-epsilon.md). Above it,
# two arms' different epsilons are named under the table.
NEGLIGIBLE_GRID_EPS = 1e-8 / 128


def _epsilon_lines(compared: Sequence[Mapping[str, Any]], ref: Mapping[str, Any]) -> list[str]:
    """A line per compared arm whose Adam epsilon on the grid differs from the reference's
    (:func:`mptex.report.stats.grid_adam_eps`): its Δ is not precision alone."""
    lines = []
    ref_eps = ref.get("grid_adam_eps") or []
    for row in compared:
        if not differs_from_reference(row, ref, "grid_adam_eps"):
            continue
        eps = row["grid_adam_eps"]
        if max(*eps, *ref_eps) <= NEGLIGIBLE_GRID_EPS:
            continue  # both below where epsilon was measured not to matter
        lines.append(
            f"- Not precision alone: {_name(row)} runs Adam on the grid with an effective epsilon "
            f"of {' / '.join(f'{e:.3g}' for e in eps)} against `{REFERENCE_ARM}`'s "
            f"{' / '.join(f'{e:.3g}' for e in ref_eps)}: the arm leaves nvdiffrec's loss scale "
            f"(x{_fmt(ref_eps[0] / eps[0], 'g')}) on the grid's gradient, and Adam is invariant "
            "to that factor except through epsilon, which damps the grid's small steps "
            "(docs/archive/adam-epsilon.md: +0.29 dB on the real-asset torus by itself). "
            "Its Δ holds both. To measure the precision alone, run every arm at "
            "`train.adam_eps=1e-15`, where neither epsilon matters (`nvdiffrec_scale1` is no "
            "substitute: without the scale its f16 grid's gradient underflows)."
        )
    return lines


# What each MLP kind (precision.mlp) is, as far as a comparison across kinds must say.
_NETWORKS = {
    "linear": "nvdiffrec's MLP (PyTorch linear layers, Kaiming-initialised, bias-free)",
    "fused": "tcnn's fully fused network (Xavier-initialised, its input padded with ones, "
             "which acts as a first-layer bias)",
}  # fmt: skip


def _network_lines(compared: Sequence[Mapping[str, Any]], ref: Mapping[str, Any]) -> list[str]:
    """A line per compared arm whose MLP is another kind of network than the reference's
    (``precision.mlp``): its Δ holds the network's difference, not its precision alone."""
    lines = []
    for row in compared:
        if not differs_from_reference(row, ref, "network"):
            continue
        what, ref_what = (" / ".join(_NETWORKS.get(n, f"`precision.mlp={n}`") for n in r["network"])
                          for r in (row, ref))  # fmt: skip
        lines.append(
            f"- Not precision alone: {_name(row)} is {what}, while `{REFERENCE_ARM}` is "
            f"{ref_what}: its Δ holds the difference between the networks too. Compare it "
            "with arms of its own network (tcnn's: the `tcnn_fused_*` arms, "
            "`+experiment=nvdiffrec154`)."
        )
    return lines


def _headline(
    ref: Mapping[str, Any], mine: Sequence[Mapping[str, Any]], ref_name: str, margin_db: float,
    after: str,
) -> tuple[list[str], bool, bool]:  # fmt: skip
    """The reading's lines about one reference row and the rows compared with it (``mine``):
    ``(lines, judged, timed)``: whether the rows could be judged against it (a completed
    reference, some row with two pairs), and whether a fastest arm was named by speed."""
    if ref["psnr_mean"] is None:
        collapsed = " (collapsed runs are not compared)" if ref["collapsed"] else ""
        return ([f"- No completed {ref_name} run{collapsed}: no arm can be compared with it."],
                False, False)  # fmt: skip
    if any(r["verdict"] == "cannot judge" for r in mine) and not any(
        r["delta"]["n"] >= 2 for r in mine
    ):
        n = max(r["delta"]["n"] for r in mine)
        # "at most" where some arm has fewer (no seed in common with the reference)
        most = "at most " if any(r["delta"]["n"] != n for r in mine) else ""
        return ([
            f"- Cannot judge any arm against {ref_name}: {most}{n} paired "
            f"seed{'s' * (n != 1)}{after} per arm, and a confidence interval needs at least 2 "
            "(run 3 or more, e.g. `train.seed=0,1,2`). The Δ column is a single difference, not "
            "a result."
        ], False, False)  # fmt: skip
    lines = []
    timed = speed_candidates(mine, ref, margin_db)
    # Faster than the reference only where the per-seed speed-up's interval lies above 1,
    # whichever arm had the lowest mean time.
    fast = [r for r in timed if r is not ref and faster(r["speedup_ci"])]
    best = fast[0] if fast else (ref if timed else None)
    if not timed:
        lines.append(f"- No timings: the fastest arm at {ref_name}'s quality is undefined.")
    elif fast:
        d = best["delta"]
        mean, low, high = interval_text(d, margin_db)
        lines.append(
            f"- Fastest arm at {ref_name}'s quality: **{_name(best)}** "
            f"({verdict_text(best, margin_db)}: Δ {mean} dB, {percent(_confidence(best))} CI "
            f"[{low}, {high}] over {d['n']} seeds; "
            f"{_fmt(best['time_per_iter_s'] * 1e3, '.1f')} ms/iteration, "
            f"{_fmt(best['speedup'], '.2f')}x {ref_name}'s speed, a ratio of mean times; per "
            f"seed {ratio_text(best['speedup_ci'])})."
        )
    elif timed[0] is ref:
        lines.append(
            f"- Fastest arm at {ref_name}'s quality: {ref_name} itself (no faster arm whose "
            f"{percent(_confidence(ref))} interval's lower end is within {margin_db:g} dB of "
            f"{ref_name} with every run completed)."
        )
    else:
        # A lower mean time is no evidence of speed where the timings vary as much.
        low_mean = timed[0]
        speed = low_mean["speedup_ci"]
        why = (f"per seed its speed-up is {ratio_text(speed)}, not above 1"
               if speed["low"] is not None else
               f"its speed cannot be compared seed by seed ({ratio_text(speed)})")  # fmt: skip
        lines.append(
            f"- Fastest arm at {ref_name}'s quality: none measurably faster than {ref_name}. "
            f"{_name(low_mean)} had the lowest mean time "
            f"({_fmt(low_mean['time_per_iter_s'] * 1e3, '.1f')} ms/iteration, "
            f"{_fmt(low_mean['speedup'], '.2f')}x {ref_name}'s speed, a ratio of mean times), "
            f"but {why}."
        )
    if fast or (timed and timed[0] is ref):
        # The arm with the lowest mean time besides the one named: told apart from it?
        runner = next((r for r in timed if r is not best), None)
        versus = speed_ratio(runner, best, _confidence(ref)) if runner is not None else None
        names = [_name(r) if r is not ref else ref_name for r in (best, runner) if r is not None]
        if versus is not None and versus["high"] is not None and versus["high"] < 1:
            # The runner is shown faster than the arm named, though not shown faster than the
            # reference (on the seeds it shares with each).
            own = runner["speedup_ci"] or speed_ratio(ref, runner, _confidence(ref))
            why = (f"its own speed-up over {ref_name} per seed is {ratio_text(own)}, not above 1"
                   if own["low"] is not None else
                   f"its speed cannot be compared with {ref_name}'s seed by seed "
                   f"({ratio_text(own)})")  # fmt: skip
            lines.append(
                f"- Faster per seed than {names[0]}, but not shown faster than {ref_name}: "
                f"{names[1]} (also at {ref_name}'s quality): {names[0]} over {names[1]} per "
                f"seed {ratio_text(versus)}, while {why}; more seeds may make it the fastest."
            )
        elif versus is not None and not faster(versus):
            lines.append(
                f"- Not told apart by speed: {names[0]} and {names[1]} (also at {ref_name}'s "
                f"quality): the first over the second per seed {ratio_text(versus)}; either "
                "may be the faster."
            )
    # Within the margin on their completed runs, but with runs lost
    lost = [r for r in mine
            if non_inferior(r, margin_db) and not at_reference_quality(r, margin_db)]  # fmt: skip
    if lost:
        items = ", ".join(f"{_name(r)} ({_lost_runs(r)} of {r['n_runs']} runs)" for r in lost)
        lines.append(
            f"- Not at {ref_name}'s quality although the Δ of their completed runs is within "
            f"{margin_db:g} dB: {items}. Runs an arm loses are part of its quality."
        )
    return lines, True, best is not None


def _reading(
    rows: Sequence[Mapping[str, Any]],
    margin_db: float,
    on_cpu: bool,
    shared: int | None = 1,
    all_rows: Sequence[Mapping[str, Any]] | None = None,
) -> list[str]:
    """The automatic reading of one section's table, as Markdown bullet lines; ``shared``: how
    many runs trained at a time on one machine (:func:`~mptex.report.collect.concurrent_jobs`;
    0: as many as its cores); ``all_rows``: the report's rows, which the rows' ``reference``
    indices point into (default ``rows``). A section with several reference rows (a
    ``precision.*`` key swept over f32 too) gets a headline per reference row."""
    all_rows = rows if all_rows is None else all_rows
    lines = []
    compared = [r for r in rows if r["verdict"] is not None]
    refs = [r for r in rows if r["precision"] == REFERENCE_ARM and r["verdict"] is None]
    # Collapses leave runs out of the pairs; the sentences that count pairs say so.
    after = " left by the collapses" if any(r.get("excluded") for r in rows) else ""
    if not refs:
        lines.append(f"- No completed `{REFERENCE_ARM}` run: no arm can be compared with it.")
    judged_refs, timed = [], False
    for ref in refs:
        mine = [r for r in compared if r["reference"] is not None
                and all_rows[r["reference"]] is ref]  # fmt: skip
        ref_name = _name(ref) if len(refs) > 1 else f"`{REFERENCE_ARM}`"
        ref_lines, judged, named = _headline(ref, mine, ref_name, margin_db, after)
        lines += ref_lines
        timed = timed or named
        if judged:
            judged_refs.append((ref, mine))
    if judged_refs:
        compared = [r for _, mine in judged_refs for r in mine]
        if timed and shared != 1 and shared is not None:
            at_once = runs_at_once(shared)
            lines.append(
                f"- The runs trained {at_once} at a time on one machine (the sweep's launcher: "
                "joblib's `n_jobs`, or submitit's local launcher, which starts a batch at once): "
                "each ms / iteration holds the work of the runs beside it, so the "
                "speed columns and the fastest arm compare arms only as far as each ran beside "
                "a similar mix. An arm's own speed needs its runs alone on the device "
                "(`hydra.launcher.n_jobs=1`, `hydra.sweeper.max_batch_size=1` under submitit's "
                "local launcher, or one job per allocation on Slurm)."
            )
        if timed and on_cpu:
            lines.append(
                "- Speed here was measured on a CPU, where f16 and bf16 math is emulated or "
                "runs on vector units (AVX-512 FP16/BF16 where the CPU has them), not on tensor "
                "cores: the speed ranking says nothing about a GPU."
            )
        for name in ("worse", "better", "inconclusive", "cannot judge", "no paired seeds"):
            # Rows with no completed run are in the diverged / failed / collapsed lines below.
            hit = [r for r in compared if r["verdict"] == name and r["n_seeds"]]
            if hit:
                # A row without a pair has no Δ to quote (the lines below say why).
                items = ", ".join(f"{_name(r)} ({delta_cell(r, margin_db)} dB{_settle(r)})"
                                  if r["delta"]["mean"] is not None else _name(r)
                                  for r in hit)  # fmt: skip
                lead = {
                    "worse": f"Worse than `{REFERENCE_ARM}`",
                    "better": f"Better than `{REFERENCE_ARM}`",
                    "no paired seeds": f"No seed completed in both the arm and `{REFERENCE_ARM}`",
                }.get(name, name.capitalize())
                lines.append(f"- {lead}: {items}.")

        # A Δ of 0 on every seed is named by the bit-identical line instead, where the two rows
        # completed exactly the paired seeds (_identical compares all their completed seeds).
        def identical(r):
            ref = all_rows[r["reference"]]
            return r["delta"]["mean"] == 0 and r["n_seeds"] == r["delta"]["n"] == ref["n_seeds"]

        flat = [r for r in compared if r["delta"]["sd"] == 0 and not identical(r)]
        if flat:
            # Printed as the Δ cell prints it: -0.004 is not -0.00 beside a verdict of worse.
            items = ", ".join(f"{_name(r)} (Δ {interval_text(r['delta'], margin_db)[0]} dB on "
                              f"each of {r['delta']['n']} seeds)" for r in flat)  # fmt: skip
            lines.append(
                f"- Zero spread: {items}. Every seed gave the same difference, so the interval "
                "has no width; check that `train.seed` varies these runs (runs that ignore the "
                "seed, or a setting given to one arm's runs only, give such differences)."
            )
        for ref, mine in judged_refs:
            lines += _network_lines(mine, ref)
            lines += _epsilon_lines(mine, ref)
    # Whether or not any arm could be judged: the Δ cells count fewer seeds than the rows.
    unpaired = [r for r in rows if r["verdict"] is not None and r.get("unpaired_seeds")]
    if unpaired:
        items = ", ".join(f"{_name(r)} seed{'s' * (len(r['unpaired_seeds']) != 1)} "
                          f"{', '.join(map(str, r['unpaired_seeds']))}"
                          for r in unpaired)  # fmt: skip
        lines.append(
            f"- Completed but not paired (no completed `{REFERENCE_ARM}` run with that seed): "
            f"{items}; in the row's seeds and PSNR, not in its Δ."
        )
    unmatched = [r for r in rows if r["verdict"] is None and r["precision"] != REFERENCE_ARM]
    if unmatched and refs:
        lines.append(
            f"- Not compared (no `{REFERENCE_ARM}` row with the same settings to pair with): "
            f"{', '.join(_name(r) for r in unmatched)}."
        )
    diverged = [r for r in rows if r["diverged"]]
    if diverged:
        # None: a run recorded as completed whose final PSNR is not finite
        where = [", ".join("end (no finite PSNR)" if i is None else str(i)
                           for i in r["diverged_at"]) for r in diverged]  # fmt: skip
        items = ", ".join(
            f"{_name(r)} ({r['diverged']}/{r['n_runs']} runs, at iteration {at})"
            for r, at in zip(diverged, where, strict=True)
        )
        lines.append(f"- Diverged: {items}.")
    else:
        lines.append("- No arm diverged.")
    collapsed = [r for r in rows if r["collapsed"]]
    if collapsed:
        items = "; ".join(f"{_name(r)} seed {c['seed']}: {c['reason']}"
                          for r in collapsed for c in r["collapsed_runs"])  # fmt: skip
        n = sum(r["collapsed"] for r in collapsed)
        lines.append(
            f"- Collapsed ({n} run{'s' * (n != 1)}; counted apart from the completed runs, not in "
            f"their PSNR, Δ or verdict): {items}."
        )
    partly = [(r, p) for r in rows for p in r.get("partly_stuck_runs", [])]
    if partly:
        items = "; ".join(f"{_name(r)} seed {p['seed']}: {p['reason']}" for r, p in partly)
        lines.append(
            f"- Partly stuck ({len(partly)} run{'s' * (len(partly) != 1)}; completed and counted "
            f"in PSNR, Δ and verdict, but a few stuck pixels hold most of the squared error, so "
            f"the run's deficit is those pixels, not the precision's rounding): {items}."
        )
    stopped = [(r, s) for r in rows for s in r.get("stop_requested_runs", [])]
    if stopped:
        items = "; ".join(f"{_name(r)} seed {s['seed']} ({s['status']}; {s['signal']} during "
                          f"{during_text(s['during'])})"
                          for r, s in stopped)  # fmt: skip
        lines.append(
            f"- Stop requested after the last iteration had begun ({len(stopped)} "
            f"run{'s' * (len(stopped) != 1)}; the signal cut none of them short: each ended where "
            "it would have without it (a completed run after all its iterations, a diverged one "
            "at the iteration that diverged) and is counted as its status says, but a stop "
            "signal came (the cluster or a user wanted it stopped) and "
            "`mptex-train` exited 3, on which a plain sbatch script requeues the job: its "
            f"requeue repeats the final validation and export): {items}."
        )
    excluded = [(r, e) for r in rows for e in r.get("excluded", [])]
    if excluded:
        items = ", ".join(f"{_name(r)} seed {e['seed']} ({e['why']})" for r, e in excluded)
        lines.append(
            f"- Excluded from the paired differences: {items}. A collapse is not read as a "
            "precision effect; how often an arm collapses is its run count above."
        )
    below = [r for r in rows if r["below_baseline"]]
    if below:
        items = ", ".join(f"{_name(r)} ({len(r['below_baseline'])} of {r['n_seeds']} runs)"
                          for r in below)  # fmt: skip
        lines.append(f"- ⚠ At or below the constant-colour baseline: {items}.")
    for status in ("failed", "unavailable"):
        hit = [r for r in rows if r[status]]
        if hit:
            items = "; ".join(
                f"{_name(r)} ({r[status]}/{r['n_runs']} runs: "
                f"{' / '.join(r['errors']) or 'no message'})"
                for r in hit
            )
            lines.append(f"- {status.capitalize()}: {items}.")
    for row in rows:
        for note in row["notes"]:
            lines.append(f"- Counted as diverged: `{note}`.")
    return lines


def _identical(rows: Sequence[Mapping[str, Any]], groups) -> list[str]:
    """Pairs of arms whose every seed gave the same PSNR to the last bit."""
    lines = []
    by_row = [{r["seed"]: r["psnr"] for r in g if r["status"] == "completed"} for g in groups]
    for i in range(len(rows)):
        for j in range(i + 1, len(rows)):
            if len(by_row[i]) and by_row[i] == by_row[j]:
                lines.append(
                    f"- {_name(rows[i])} and {_name(rows[j])} gave bit-identical PSNR for every "
                    "seed: on this device the two arms computed the same numbers, so their rows "
                    "are one measurement, not two agreeing ones."
                )
    return lines


# The quantisation table's columns: (heading, key suffixes after net.<i>.q_, format).
_QUANT_COLUMNS = (
    ("input rel. error", ("input_rel_error",), ".3g"),
    ("weight rel. error", ("weight_rel_error",), ".3g"),
    ("grad rel. error", ("grad_rel_error",), ".3g"),
    ("underflow input / weight / grad",
     ("input_underflow_frac", "weight_underflow_frac", "grad_underflow_frac"), ".2g"),
    ("overflows input / weight / grad", ("input_overflows", "weight_overflows", "grad_overflows"),
     "g"),
    ("non-finite", ("input_nonfinite", "weight_nonfinite", "grad_nonfinite"), "g"),
    ("amax input / weight / grad", ("input_amax", "weight_amax", "grad_amax"), ".3g"),
    ("row-scale spread input / weight / grad (binades)",
     ("input_scale_spread", "weight_scale_spread", "grad_scale_spread"), ".3g"),
    ("underflow with one scale input / weight / grad",
     ("input_tensor_underflow_frac", "weight_tensor_underflow_frac",
      "grad_tensor_underflow_frac"), ".2g"),
    ("weight rel. error (QAT)", ("w_rel_error",), ".3g"),
    ("weight underflow (QAT)", ("w_underflow_frac",), ".2g"),
    ("input rel. error / underflow (QAT)", ("x_rel_error", "x_underflow_frac"), ".3g"),
    ("row-scale spread input / weight (QAT, binades)", ("x_scale_spread", "w_scale_spread"),
     ".3g"),
    ("underflow with one scale input / weight (QAT)",
     ("x_tensor_underflow_frac", "w_tensor_underflow_frac"), ".2g"),
)  # fmt: skip


def _quantization_table(section: Sequence[Mapping[str, Any]]) -> list[str]:
    """The per-layer quantisation table of the section's quantised arms (none: no lines)."""
    rows = [r for r in section if r.get("quantization")]
    if not rows:
        return []
    layers = sorted({int(k.split(".")[1]) for r in rows for k in r["quantization"]})
    present = {k.split(".q_", 1)[1] for r in rows for k in r["quantization"]}
    columns = [c for c in _QUANT_COLUMNS if present.intersection(c[1])]
    table = []
    for row in rows:
        stats = row["quantization"]
        for layer in layers:
            if not any(k.startswith(f"net.{layer}.q_") for k in stats):
                continue
            cells = [" / ".join(_fmt(stats.get(f"net.{layer}.q_{n}"), spec) for n in names)
                     for _, names, spec in columns]  # fmt: skip
            table.append([_name(row), f"net.{layer}", *cells])
    return [
        "Quantisation (per layer of the arms below f16: relative error ‖q − x‖ / ‖x‖ and the "
        "fraction of non-zero values quantised to 0, means over the sampled iterations; "
        "overflows: calls whose recipe scale would have overflowed and used the tensor's own "
        "(counts per run); non-finite: calls with an inf or NaN; amax: the largest seen; "
        "row-wise arms: the row scales' spread, log2 of the largest over the smallest, and the "
        "fraction of non-zero values one scale for the whole tensor would have quantised to 0; "
        "each "
        "the mean over the row's completed and diverged runs):",
        "",
        *_table(["arm", "layer", *(c[0] for c in columns)], table),
        "",
    ]


def _multiplicity(adjust: str, family: int, level: float) -> str:
    """How to read the intervals as a family (``mptex-report --adjust``)."""
    if adjust == "none":
        return (
            f"Each interval is {percent(level)} for its own comparison, not adjusted for the "
            f"number of arms compared: of k arms that truly equal `{REFERENCE_ARM}`, up to "
            f"1 − {level:g}^k of sweeps show at least one `better` or `worse` by chance (about "
            f"{1 - level**5:.0%} at k = 5; `mptex-report --adjust bonferroni`, or "
            "`hydra.callbacks.report.adjust=bonferroni` on the sweep's command, holds all of a "
            "report's intervals together at 95%)."
        )
    if family <= 1:
        held = "no comparison" if family == 0 else "one comparison"
        return (f"Adjusted for multiplicity ({adjust}), but the report's tables hold {held} "
                f"with an interval: it is {percent(level)} as it stands.")  # fmt: skip
    return (
        f"The intervals are adjusted for the k = {family} comparisons with an interval in this "
        f"report's tables (Bonferroni: each at 1 − {1 - CONFIDENCE:g}/{family} = "
        f"{percent(level)}), so that all of them hold together with at least "
        f"{percent(CONFIDENCE)} confidence: among arms that truly equal `{REFERENCE_ARM}`, the "
        f"chance of any `better` or `worse` by chance is at most {1 - CONFIDENCE:.0%}. The "
        "verdicts and the fastest arm follow these intervals; an nvdiffrec #154 section's "
        f"intervals stay {percent(CONFIDENCE)} each."
    )


# ----------------------------------------------------------------------------- document
def render_report(
    sweep_dir: str | os.PathLike,
    runs: Sequence[Mapping[str, Any]],
    keys: Sequence[str],
    rows: Sequence[Mapping[str, Any]],
    groups: Sequence[Sequence[Mapping[str, Any]]],
    sections: Sequence[tuple[str, Sequence[int]]],
    duplicates: Sequence[Mapping[str, Any]],
    unidentified: Sequence[Mapping[str, Any]],
    plots: Mapping[str, Any],
    margin_db: float,
    shared: int | None = None,
) -> str:
    """report.md's text. Every run under the sweep appears: in a row's counts, as a duplicate
    not counted, or as an unreadable run listed by path. ``shared``: how many runs trained at a
    time on one machine (:func:`~mptex.report.collect.concurrent_jobs`; None: unknown)."""
    counts = {s: sum(r["status"] == s for r in runs) for s in STATUSES}
    shown = list(rows[0]["keys"]) if rows else []
    seeds = sorted_seeds(r.get("seed") for r in runs)
    lines = [
        "# mptex precision ablation",
        "",
        f"Sweep `{sweep_dir}`: {len(runs)} runs, "
        + ", ".join(f"{n} {status}" for status, n in counts.items())
        + f". Swept: {_swept(sweep_dir, shown)}"
        + (
            f" (and {len(keys) - len(shown)} key{'s' * (len(keys) - len(shown) != 1)} that "
            f"follow{'s' * (len(keys) - len(shown) == 1)} from the arm or scene)"
            if len(keys) > len(shown)
            else ""
        )
        + f"; seeds: {', '.join(seeds) or '–'}.",
        "",
        *_environment(runs),
    ]
    partial = partial_keys(runs)
    if partial:
        n = sum(r.get("config") is not None for r in runs)

        def items(keys):
            return "; ".join(
                f"`{k}` ({sum(k in (r.get('config') or {}) for r in runs)} of {n}: "
                f"{', '.join(f'`{v}`' for v in partial[k])})"
                for k in keys
            )

        one = [k for k, values in partial.items() if len(values) == 1]
        several = [k for k, values in partial.items() if len(values) > 1]
        lines += ["", "**Config keys some runs lack** (runs of another mptex version, or a "
                  "hand-made config):"]  # fmt: skip
        if one:
            lines.append(f"- {items(one)}: one value among the runs that have it, so it splits "
                         "no rows, and the runs without it are compared with the others as if "
                         "they agreed: check that they do.")  # fmt: skip
        if several:
            lines.append(f"- {items(several)}: swept among the runs that have it; the runs "
                         "without it are compared only among themselves (their value shown as "
                         "`None` or `–`).")  # fmt: skip
    unstarted = unstarted_jobs(sweep_dir, [run["run_dir"] for run in runs])
    if unstarted is not None and unstarted[0] > 0:
        missing, planned = unstarted
        lines += ["", f"**Incomplete sweep**: {missing} of the {planned} jobs its "
                  "multirun.yaml plans have no run directory (never started: a sweep stopped "
                  "by a signal continues when the same command runs again with "
                  "`hydra.sweep.dir=<this directory> hydra.callbacks.fresh_sweep_dir.enabled="
                  "false`, docs/cluster.md); every count below is of the runs that "
                  "exist."]  # fmt: skip
    if duplicates:
        lines += ["", f"Not counted ({len(duplicates)} runs repeat the config and seed of "
                  "another run; a run that ran is counted before one that failed to run, then "
                  "the first by directory name: a re-run does not replace a diverged or "
                  "collapsed result):"]  # fmt: skip
        counted = {r["run_dir"]: r for r in runs}
        for run in duplicates:
            kept = counted.get(run["duplicate_of"], {})
            both = [_duplicate_result(r) for r in (run, kept)]
            lines.append(f"- `{run['run_dir']}` ({both[0]}): same as `{run['duplicate_of']}` "
                         f"({both[1]})")  # fmt: skip
    unreadable = [r for r in runs if r.get("unreadable")]
    if unreadable:
        lines += ["", f"Unreadable runs ({len(unreadable)}; counted as failed"
                  + (f", {len(unidentified)} of them in no row: no config to place them"
                     if unidentified else "") + "):"]  # fmt: skip
        lines += [f"- `{r['run_dir']}/metrics.json`: {r['error']}" for r in unreadable]
    lines.append("")
    on_cpu = any(r.get("device") == "cpu" for r in runs)
    # Each interval's confidence, and the family it was adjusted over (stats.summarize_groups)
    level = _confidence(rows[0]) if rows else CONFIDENCE
    adjust = rows[0].get("adjust", "none") if rows else "none"
    family = rows[0].get("family", 0) if rows else 0
    adjusted = adjust != "none" and family > 1
    ci = f"{percent(level)} CI" + (f", Bonferroni k = {family}" if adjusted else "")
    # the quantile as computed: 0.975, or 1 - 0.05/(2k) adjusted (not a rounded decimal)
    quantile = f"1 − {1 - CONFIDENCE:g}/{2 * family}" if adjusted else f"{(1 + level) / 2:g}"
    key_columns = [k for k in shown if k != "precision.name"]
    header = ["arm", *(f"`{k}`" for k in key_columns), "seeds", "PSNR (dB)",
              f"Δ vs {REFERENCE_ARM} (dB) [{ci}]", "verdict",
              "baseline (dB)", "ms / iter", f"speed-up vs {REFERENCE_ARM}", "peak mem (MiB)",
              "skipped steps", "eff. loss scale",
              "runs ok / coll. / div / fail / n.a."]  # fmt: skip
    # Runs trained with export.enabled=true: the baked texture's PSNR against the neural one.
    baked = any(is_number(r.get("bake_psnr")) for r in rows)
    if baked:
        header.append("bake vs neural (dB)")
    for _title, indices in sections:  # the Markdown heading is built with backticks below
        section = [rows[i] for i in indices]
        first = section[0]
        extras = [f"`{k}={v}`" for k, v in first["keys"].items()
                  if not k.startswith("precision.") and k != "scene.name"]  # fmt: skip
        its = [str(n) for n in sorted({r["iterations_planned"] for i in indices
                                       for r in groups[i]
                                       if is_number(r.get("iterations_planned"))})]  # fmt: skip
        views = sorted({r["val_views"] for i in indices for r in groups[i]
                        if r.get("val_views") is not None})  # fmt: skip
        spps = sorted({r["val_spp"] for i in indices for r in groups[i]
                       if is_number(r.get("val_spp")) and r["val_spp"] > 1})  # fmt: skip
        sampling = "".join(f", {k} x {k} samples per pixel" for k in spps)
        lines += [f"## Scene `{first['scene']}`" + "".join(f", {e}" for e in extras), "",
                  f"Iterations: {', '.join(its) or '–'}; validation views: "
                  f"{', '.join(map(str, views)) or '–'}{sampling}.", ""]  # fmt: skip
        table = [[
            f"`{r['precision']}`", *(_value(r["keys"].get(k)) for k in key_columns),
            str(r["n_seeds"]), _psnr(r), delta_cell(r, margin_db), verdict_text(r, margin_db),
            _fmt(r["baseline_psnr"], ".2f"),
            _fmt(r["time_per_iter_s"] * 1e3 if is_number(r["time_per_iter_s"]) else None, ".1f"),
            _fmt(r["speedup"], ".2f"),
            _fmt(r["peak_memory_bytes"] / 2**20 if is_number(r["peak_memory_bytes"]) else None,
                 ".0f"),
            _fmt(r["skipped_steps"], "g"), _scale(r["final_loss_scale"]),
            " / ".join(str(r[k]) for k in STATUSES),
        ] + ([_fmt(r.get("bake_psnr"), ".2f")] if baked else []) for r in section]  # fmt: skip
        lines += _table(header, table)
        lines += ["", *_reading(section, margin_db, on_cpu, shared, rows),
                  *_identical(section, [groups[i] for i in indices]), ""]  # fmt: skip
        underflow_keys = sorted({k for r in section for k in r["underflow"] if _shown_underflow(k)})
        if underflow_keys:
            lines += ["Gradient underflow (fraction of the gradient elements that the compute "
                      "dtype flushed to zero or holds as subnormals; mean over the sampled "
                      "iterations of completed and diverged runs):", ""]  # fmt: skip
            table = [[_name(r), *(_fmt(r["underflow"].get(k), ".3g") for k in underflow_keys)]
                     for r in section]  # fmt: skip
            lines += _table(["arm", *(f"`{k}`" for k in underflow_keys)], table) + [""]
        lines += _quantization_table(section)
    kinds = sorted({r["peak_memory_kind"] for r in runs if r.get("peak_memory_kind")})
    gain = plots.get("images.png")
    lines += [
        "## How to read this",
        "",
        "- Rows: one per combination of the swept config values (read from each job's own "
        "saved config), over seeds. seeds: completed runs in the row. PSNR: nvdiffrec's "
        "validation PSNR (sRGB, clamped) of the completed runs, mean ± sample std over seeds; ⚠: "
        "a completed run at or below the constant-colour baseline (the best single colour, scored "
        "the same way), i.e. it learned nothing useful, without being named collapsed.",
        f"- Collapsed: {COLLAPSE_RULE}. Stuck pixels: the texture's output sigmoid is saturated "
        "(sigmoid' < 3.4e-4, so the pixel barely learns) at a value that is wrong; a pure-colour "
        "texture saturates correctly, which is why saturation alone is not a collapse. "
        "`metrics.json`'s `saturation` and the validation entries of its `history` hold the "
        "fractions per channel. A collapsed run is counted in `coll.`, not in seeds, PSNR, Δ or "
        f"the verdict; it and its `{REFERENCE_ARM}` partner (or, for a collapsed "
        f"`{REFERENCE_ARM}` run, every arm's run of that seed) leave the paired differences, "
        "listed under the table.",
        f"- Partly stuck: {PARTLY_STUCK_RULE}. Such a run stays in its row's PSNR, Δ and "
        "verdict; the line under the table names it with its stuck pixels' share of the error "
        "and about what the PSNR would gain without them (−10 log10(1 − share)).",
        f"- Δ vs `{REFERENCE_ARM}`: the mean of the paired differences PSNR(arm) − "
        f"PSNR(`{REFERENCE_ARM}`) over the seeds both completed, with the same other swept "
        f"values; [{ci}]: mean ± t({quantile}, n−1) · sd / √n (Student t on the n "
        "paired differences, sample sd); one seed gives no interval.",
        f"- verdict: `better` / `worse` when the whole interval lies above / below 0; `no "
        f"detectable difference within ±{margin_db:g} dB` when it lies inside ±{margin_db:g} dB "
        f"(the equivalence margin, `--margin-db`); `inconclusive` otherwise (more seeds "
        "needed: the reading estimates how many paired seeds an interval of the measured mean "
        f"and spread would need to exclude 0 or to fit inside ±{margin_db:g} dB, a planning "
        "figure, as both move with more seeds); `cannot judge` with fewer than 2 paired seeds "
        f"(`–` where no seed completed in both the arm and `{REFERENCE_ARM}`); "
        f"`, by at most {margin_db:g} dB` after `better` or `worse` when the interval lies inside "
        f"±{margin_db:g} dB too. " + _multiplicity(adjust, family, level),
        f"- The fastest arm at `{REFERENCE_ARM}`'s quality is chosen by mean ms / iteration "
        f"among `{REFERENCE_ARM}` and the arms whose interval's lower end is at or above "
        f"−{margin_db:g} dB (at most {margin_db:g} dB worse, at {percent((1 + level) / 2)} "
        "one-sided confidence) and whose every run completed (no diverged, collapsed or failed "
        f"run). It is called faster than `{REFERENCE_ARM}` only where its per-seed speed-up "
        "lies above 1 with the intervals' confidence: the ratios of the paired runs' ms / "
        "iteration (same seed), a Student-t interval of their mean logarithm, exponentiated; "
        "the reading names the next arm at that quality when the two are not told apart that "
        "way, or when it is faster per seed than the arm named without being shown faster "
        f"than `{REFERENCE_ARM}`.",
        "- ms / iter: median time per training iteration, averaged over seeds; speed-up > 1: "
        "faster than the reference.",
        f"- Peak memory: the largest over the row's completed runs, from the end of each "
        f"run's start ({', '.join(kinds) or 'unknown'}). "
        "cuda_max_allocated: the GPU allocator's peak. run_peak_rss: the "
        "process's resident memory, sampled; it includes what the process held "
        "before (Python, torch, earlier jobs under Hydra's basic launcher), so compare arms "
        "within one sweep. process_peak_rss (no /proc): the process's lifetime peak. "
        f"{_start_memory(runs)}",
        "- eff. loss scale: the factor the f16 gradients carried at the end: GradScaler's scale, "
        "times the fixed ×128 inside the graph of the `nvdiffrec` and `tcnn` arms; 1 without "
        "loss scaling.",
        "- runs: completed / collapsed / diverged (non-finite loss or gradient without loss "
        "scaling, too many skipped steps in a row, or recorded as completed without a finite "
        "PSNR) / failed (config error, crash, full disk, stopped by a signal and not resumed, "
        "or an unreadable metrics.json) / not available on this machine. A run that a stop "
        "signal reached once its last iteration had begun (metrics.json's `stop_requested`) "
        "ran to its end: counted as its status says, and named under the table.",
        "- Raw numbers: `results.csv`, `results.json`. Plots: "
        + (", ".join(f"`{name}`" for name, made in plots.items() if made) or "none")
        + ". The curves: per row, the mean at each logged iteration over its completed and "
        "diverged runs, band min–max; after a run diverges, the mean is over the runs still "
        "training."
        + (f" `images.png`: error maps are |prediction − reference| of the 8-bit sRGB images × "
           f"{gain} (one scale for every arm)." if gain else ""),
        "",
    ]  # fmt: skip
    return "\n".join(lines)
