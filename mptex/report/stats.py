"""Statistics of an ablation: per-row summaries, paired differences to f32, confidence
intervals and the verdicts they support.

Method (stated in every report.md):

- Pairing: an arm's run and the reference arm's run with the same seed and the same values of
  every other swept key (same scene, same learning rate, ...) form a pair; the difference is
  ``psnr(arm) - psnr(f32)`` in dB. Seeds that completed in only one of the two arms are not
  paired (they are counted in the row's run counts instead). Where ``precision.*`` keys are
  swept over the reference arm too, an arm's row is paired with the reference row of the same
  values of those keys. A collapsed run
  (:mod:`mptex.collapse`) is not completed: it and its partner are left out of the pairs
  and listed (``excluded``), so a collapse is never read as a precision effect; an arm left
  without a pair by them "cannot judge".
- Interval (:mod:`mptex.intervals`): mean of the n paired differences ±
  ``t_{0.975, n-1} * sd / sqrt(n)`` (Student t, two-sided 95 %, sample standard deviation).
  Needs n >= 2; with one pair there is no interval and no verdict ("cannot judge").
- Verdict, with the equivalence margin m (default :data:`EQUIVALENCE_MARGIN_DB`): ``better``
  when the whole interval lies above 0; ``worse`` when it lies below 0; ``no detectable
  difference within ±m dB`` when it lies inside [-m, +m] (and contains 0); otherwise
  ``inconclusive`` (the interval is too wide for either statement: more seeds needed).
- "Fastest arm at f32's quality": chosen among the reference arm and the arms at its quality
  (:func:`at_reference_quality`: the interval's lower end at or above -m, i.e. at most m dB
  worse, whatever the verdict: a precisely measured loss of 0.05 dB is ``worse`` and at f32's
  quality; and every run of the arm completed: an arm that diverged, collapsed or failed on
  some seed is never named, whatever its other seeds gave), ordered by mean ms / iteration
  (:func:`speed_candidates`).
- Speed, compared with an interval too (:func:`speed_ratio`): the per-seed ratio of two arms'
  ms / iteration, paired as the PSNR differences are; the Student-t interval of the mean log
  ratio, exponentiated (a geometric-mean speed-up and its interval, at the rows' confidence,
  adjusted or not, but not counted in the Bonferroni family, whose guarantee covers the Δ
  intervals). The fastest arm named is the fastest of those whose interval lies above 1;
  where none's does, the reading says no arm is measurably faster, and it says when the next
  arm at the reference's quality is not distinguishable from the one named in speed, or is
  faster per seed than the one named without being shown faster than the reference.
- Each interval is 95 % for its own comparison, not adjusted for the number of arms compared,
  unless ``adjust="bonferroni"``: then each is at 1 - 0.05/k over the report's k comparisons
  with an interval, and all k hold together with at least 95 % confidence; the verdicts, the
  non-inferiority and the fastest arm follow the adjusted intervals.
- What else differs: Adam is invariant to a constant factor on a gradient except through its
  epsilon, and nvdiffrec's arm leaves x128 on the grid's gradient, so against an f32 reference
  at the same ``train.adam_eps`` its grid runs with a 128 x smaller effective epsilon
  (:func:`grid_adam_eps`). The verdict stands as measured; report.md names the difference under
  the table, so that it is not read as a precision effect alone.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from mptex.intervals import (
    ADJUSTMENTS,
    CONFIDENCE,
    EQUIVALENCE_MARGIN_DB,
    VERDICTS,
    family_confidence,
    finite_mean,
    mean_ci,
    ratio_ci,
    t_quantile,
    verdict,
)
from mptex.numbers import is_number
from mptex.precision import grid_gradient_factor
from mptex.report.collect import REFERENCE_ARM, STATUSES

__all__ = [
    "EQUIVALENCE_MARGIN_DB",
    "CONFIDENCE",
    "ADJUSTMENTS",
    "VERDICTS",
    "t_quantile",
    "mean_ci",
    "family_confidence",
    "verdict",
    "check_settings",
    "summarize_groups",
    "grid_adam_eps",
    "sections",
    "seeds_to_settle",
    "SETTLE_MAX_SEEDS",
    "non_inferior",
    "at_reference_quality",
    "speed_candidates",
    "speed_ratio",
    "differs_from_reference",
]


# ----------------------------------------------------------------------------- rows
def _mean(values) -> float | None:
    values = [float(v) for v in values if is_number(v)]
    return finite_mean(values) if values else None


def _std(values) -> float | None:
    values = [float(v) for v in values if is_number(v)]
    return statistics.stdev(values) if len(values) >= 2 else None


def _static_scale(config: Mapping[str, Any]) -> float:
    """A run's ``precision.static_loss_scale`` (128, the default, where the config lacks it)."""
    fixed = config.get("precision.static_loss_scale")
    return float(fixed) if is_number(fixed) else 128.0


def _effective_scale(run: Mapping[str, Any], recorded: float) -> float:
    """The factor the f16 gradients carry: the recorded loss scale, times the fixed x128 that
    nvdiffrec's backward hook (``loss_scaling: nvdiffrec``) or tcnn's fused network
    (``tcnn``) applies inside the graph (mptex/precision.py, mptex/mlp.py)."""
    config = run.get("config") or {}
    if config.get("precision.loss_scaling") in ("nvdiffrec", "tcnn"):
        return recorded * _static_scale(config)
    return recorded


def grid_adam_eps(run: Mapping[str, Any]) -> float | None:
    """Adam's effective epsilon on the hash grid of one run: ``train.adam_eps`` (1e-8, torch's
    default, for runs older than the key) over the factor its arm leaves on the grid's
    gradient (:func:`mptex.precision.grid_gradient_factor`: nvdiffrec's x128). None without a
    config (the loss scaling unknown)."""
    config = run.get("config") or {}
    if "precision.loss_scaling" not in config:
        return None
    eps = config.get("train.adam_eps", 1e-8)
    factor = grid_gradient_factor(config["precision.loss_scaling"], _static_scale(config))
    return float(eps) / factor if is_number(eps) else None


def _row(group: Sequence[Mapping[str, Any]], shown: Sequence[str]) -> dict[str, Any]:
    first = group[0]
    done = [r for r in group if r["status"] == "completed"]
    measured = [r for r in group if r["status"] in ("completed", "diverged")]
    underflow_keys = sorted({k for r in measured for k in r.get("underflow", {})})
    quant_keys = sorted({k for r in measured for k in r.get("quantization", {})})
    below = [
        r for r in done if is_number(r.get("baseline_psnr")) and r["psnr"] <= r["baseline_psnr"]
    ]
    return {
        "scene": first["scene"],
        "precision": first["precision"],
        "keys": {k: first["keys"].get(k) for k in shown},
        "all_keys": dict(first["keys"]),
        "n_runs": len(group),
        **{status: sum(r["status"] == status for r in group) for status in STATUSES},
        "seeds": [r["seed"] for r in group],
        "n_seeds": len(done),
        "psnr_mean": _mean(r["psnr"] for r in done),
        "psnr_std": _std(r["psnr"] for r in done),
        "baseline_psnr": _mean(r.get("baseline_psnr") for r in done),
        "below_baseline": [r["run_dir"] for r in below],
        "time_per_iter_s": _mean(r["time_per_iter_s"] for r in done),
        # Each completed run's own time, for speed compared seed by seed (speed_ratio).
        "seed_times": [[r["seed"], float(r["time_per_iter_s"])] for r in done
                       if is_number(r["time_per_iter_s"]) and r["time_per_iter_s"] > 0],
        "bake_psnr": _mean(r.get("bake_psnr") for r in done),
        "peak_memory_bytes": max((r["peak_memory_bytes"] for r in done
                                  if is_number(r["peak_memory_bytes"])), default=None),
        "peak_memory_kind": next((r["peak_memory_kind"] for r in done
                                  if r.get("peak_memory_kind")), None),
        "skipped_steps": _mean(r["skipped_steps"] for r in done),
        "final_loss_scale": sorted({_effective_scale(r, float(r["final_loss_scale"]))
                                    for r in done if is_number(r["final_loss_scale"])}),
        "diverged_at": [r["diverged_at"] for r in group if r["status"] == "diverged"],
        # Adam's effective epsilon on the grid (distinct values over completed runs): an arm
        # whose value differs from its reference's differs in more than precision.
        "grid_adam_eps": sorted({e for e in map(grid_adam_eps, done) if e is not None}),
        # The MLP's kind (precision.mlp: nvdiffrec's linear layers or tcnn's fused network):
        # an arm of another kind than its reference's is another network, not only another
        # precision.
        "network": sorted({str((r.get("config") or {}).get("precision.mlp"))
                           for r in group if (r.get("config") or {}).get("precision.mlp")}),
        # A collapse's note is its evidence, listed with collapsed_runs instead.
        "notes": sorted({f"{r['run_dir']}: {r['note']}" for r in group
                         if r.get("note") and r["status"] != "collapsed"}),
        "collapsed_runs": [{"run_dir": r["run_dir"], "seed": r["seed"], "reason": r.get("note")}
                           for r in group if r["status"] == "collapsed"],
        "errors": sorted({str(r["error"]) for r in group
                          if r["status"] in ("failed", "unavailable") and r.get("error")}),
        "underflow": {k: _mean(r["underflow"].get(k) for r in measured) for k in underflow_keys},
        "quantization": {k: _mean(r.get("quantization", {}).get(k) for r in measured)
                         for k in quant_keys},
        "partly_stuck_runs": [{"run_dir": r["run_dir"], "seed": r["seed"],
                               "reason": r["partly_stuck"]["reason"]}
                              for r in done if r.get("partly_stuck")],
        # Runs a stop signal reached once their last iteration had begun: they ran to their
        # end and are counted as their status says; the report names them.
        "stop_requested_runs": [{"run_dir": r["run_dir"], "seed": r["seed"], "status": r["status"],
                                 **r["stop_requested"]}
                                for r in group if r.get("stop_requested")],
    }  # fmt: skip


def _context(keys: Mapping[str, Any]) -> tuple:
    """What a row is compared within: its key values outside the precision group."""
    return tuple(sorted((k, str(v)) for k, v in keys.items() if not k.startswith("precision.")))


def _reference_for(row: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]):
    """The reference arm's row in the same context: the one matching every key if there is
    one, else the only reference row of the context, else (``precision.*`` keys swept over the
    reference too) the one reference row whose values of the keys that tell the reference
    rows apart are the row's; None when absent or ambiguous."""
    refs = [r for r in rows if r["precision"] == REFERENCE_ARM
            and _context(r["all_keys"]) == _context(row["all_keys"])]  # fmt: skip
    exact = [r for r in refs if {k: v for k, v in r["all_keys"].items() if k != "precision.name"}
             == {k: v for k, v in row["all_keys"].items() if k != "precision.name"}]  # fmt: skip
    if len(exact) == 1:
        return exact[0]
    if len(refs) <= 1:
        return refs[0] if refs else None
    keys = {k for r in refs for k in r["all_keys"]}
    apart = {k for k in keys if len({str(r["all_keys"].get(k)) for r in refs}) > 1}
    same = [
        r
        for r in refs
        if all(str(r["all_keys"].get(k)) == str(row["all_keys"].get(k)) for k in apart)
    ]
    return same[0] if len(same) == 1 else None


def _excluded(group, ref_group) -> list[dict[str, Any]]:
    """The row's seeds that a collapse keeps out of the pairs: its own collapsed runs, and its
    completed runs whose reference partner (same seed) collapsed."""
    ref_collapsed = {r["seed"] for r in ref_group if r["status"] == "collapsed"}
    excluded = []
    for run in group:
        if run["status"] == "collapsed":
            why = "collapsed"
        elif run["status"] == "completed" and run["seed"] in ref_collapsed:
            why = f"its {REFERENCE_ARM} run collapsed"
        else:
            continue
        excluded.append({"seed": run["seed"], "run_dir": run["run_dir"], "why": why})
    return excluded


def check_settings(margin_db: Any, adjust: Any) -> None:
    """The report's settings, checked: ValueError naming the first bad one (``margin_db: ...``,
    ``adjust: ...``) in one line."""
    if not (is_number(margin_db) and margin_db > 0):
        raise ValueError(f"margin_db: expected a finite number > 0, got {margin_db!r}")
    if adjust not in ADJUSTMENTS:
        raise ValueError(f"adjust: expected one of {', '.join(ADJUSTMENTS)}, got {adjust!r}")


def summarize_groups(
    groups: Sequence[Sequence[Mapping[str, Any]]],
    shown: Sequence[str] = (),
    margin_db: float = EQUIVALENCE_MARGIN_DB,
    adjust: str = "none",
) -> list[dict[str, Any]]:
    """One summary per group (table row), in the groups' order, with its paired comparison.

    PSNR, time, memory, skipped steps and loss scale are over the row's completed runs (a
    diverged run's last PSNR says nothing about the arm's quality; it is counted instead, and
    every run is in exactly one count of :data:`STATUSES`).

    Args:
        groups: runs split by :func:`mptex.report.collect.group_runs` (each run has ``keys``).
        shown: the swept keys the table shows (see ``collect.shown_keys``).
        margin_db: equivalence margin m of the verdict, in dB (> 0).
        adjust: how the intervals account for each other (:data:`ADJUSTMENTS`): ``"none"``,
            each at :data:`CONFIDENCE`; ``"bonferroni"``, each at ``1 - (1 - CONFIDENCE) / k``
            over the k rows compared with an interval (in every section), so that all hold
            together at :data:`CONFIDENCE` (:func:`mptex.intervals.family_confidence`).

    Returns:
        dicts with ``scene``, ``precision``, ``keys`` (shown key -> value), ``n_runs``, one
        count per status, ``n_seeds`` (completed runs), ``psnr_mean``, ``psnr_std``,
        ``baseline_psnr``, ``below_baseline`` (run dirs at or under the constant-colour
        baseline), ``time_per_iter_s``, ``seed_times`` (``[seed, s / iteration]`` of each
        completed, timed run), ``speedup`` (reference time / this row's, a ratio of means),
        ``speedup_ci`` (:func:`speed_ratio` of the reference and this row: the per-seed
        speed-up and its interval; None for a reference row or a row without one), peak memory,
        ``skipped_steps``, ``final_loss_scale`` (distinct effective scales), ``grid_adam_eps``
        (distinct values of :func:`grid_adam_eps`), ``network`` (distinct ``precision.mlp``
        values of its runs), ``diverged_at``,
        ``notes``, ``errors``, ``underflow``, ``quantization`` (per ``net.<i>.q_<name>``, the
        mean over the completed and diverged runs), ``collapsed_runs`` (``run_dir``, ``seed``,
        ``reason`` of each collapsed run), ``partly_stuck_runs`` (the same for its completed
        runs that :func:`mptex.collapse.classify_partly_stuck` names), ``stop_requested_runs``
        (``run_dir``, ``seed``, ``status``, ``signal``, ``during`` of each run that a stop
        signal reached once its last iteration had begun), ``reference`` (the
        reference row's index or None),
        ``pairs`` (list of ``[seed, difference]``; empty for the reference itself),
        ``unpaired_seeds`` (the row's completed seeds without a completed reference run of
        that seed: in its PSNR, not in ``delta``), ``excluded`` (``seed``, ``run_dir``, ``why``:
        the row's seeds left out of the pairs because the run or its reference partner
        collapsed), ``delta`` (:func:`mean_ci` of the paired differences at ``confidence``),
        ``verdict``, ``seeds_to_settle`` (inconclusive rows: :func:`seeds_to_settle`, else
        None), and the family's ``confidence`` (each interval's), ``adjust`` and ``family`` (k,
        the comparisons with an interval).
    """
    check_settings(margin_db, adjust)
    rows = [_row(group, shown) for group in groups]
    refs = []
    for row, group in zip(rows, groups):
        ref = _reference_for(row, rows)
        refs.append(ref)
        row["reference"] = None if ref is None else rows.index(ref)
        ref_group = groups[row["reference"]] if ref is not None else []
        ref_psnr = {r["seed"]: r["psnr"] for r in ref_group if r["status"] == "completed"}
        pairs = [[r["seed"], r["psnr"] - ref_psnr[r["seed"]]] for r in group
                 if r["status"] == "completed" and r["seed"] in ref_psnr]  # fmt: skip
        if ref is row:  # the reference is not compared with itself
            pairs = []
        row["pairs"] = pairs
        # The row's completed seeds without a partner (the reference's run of that seed did not
        # complete, or there is none): in its seeds and PSNR, not in Δ.
        paired = {seed for seed, _ in pairs}
        row["unpaired_seeds"] = (
            [r["seed"] for r in group if r["status"] == "completed" and r["seed"] not in paired]
            if ref not in (None, row)
            else []
        )
        row["excluded"] = _excluded(group, ref_group if ref is not row else [])
    # The family: every comparison that gets an interval (two pairs or more), in every section.
    family = sum(ref is not None and ref is not row and len(row["pairs"]) >= 2
                 for row, ref in zip(rows, refs))  # fmt: skip
    confidence = family_confidence(family, adjust)
    for row, ref in zip(rows, refs):
        pairs = row["pairs"]
        row["delta"] = mean_ci([d for _, d in pairs], confidence)
        row["confidence"], row["adjust"], row["family"] = confidence, adjust, family
        if ref is None or ref is row:
            row["verdict"] = None
        elif not pairs and row["excluded"]:  # collapses took every pair: no precision effect
            row["verdict"] = "cannot judge"
        elif not pairs:  # no seed completed in both: nothing to compare (counts say why)
            row["verdict"] = "no paired seeds"
        else:
            row["verdict"] = verdict(row["delta"], margin_db)
        row["seeds_to_settle"] = (seeds_to_settle(row["delta"], margin_db, confidence)
                                  if row["verdict"] == "inconclusive" else None)  # fmt: skip
        t, t_ref = row["time_per_iter_s"], ref["time_per_iter_s"] if ref else None
        row["speedup"] = t_ref / t if is_number(t) and t > 0 and is_number(t_ref) else None
        row["speedup_ci"] = (speed_ratio(ref, row, confidence)
                             if ref is not None and ref is not row else None)  # fmt: skip
    return rows


def speed_ratio(
    slower: Mapping[str, Any], faster: Mapping[str, Any], confidence: float = CONFIDENCE
) -> dict[str, Any]:
    """How many times faster the row ``faster`` ran than the row ``slower``, seed by seed.

    Pairs the two rows' completed, timed runs by seed (their ``seed_times``) and gives the
    pairs ``(t_slower, t_faster)`` to :func:`mptex.intervals.ratio_ci`: ``ratio`` is the
    geometric mean of the per-seed speed-ups, ``low`` and ``high`` its interval (the mean log
    ratio's Student-t interval, exponentiated). A ratio above 1 means ``faster`` took less
    time per iteration; an interval that contains 1 does not tell the two apart.

    Returns:
        ``{"n", "ratio", "low", "high", "confidence"}``; ``ratio`` None without a timed pair,
        ``low`` and ``high`` None with fewer than two.
    """
    times = {seed: t for seed, t in slower.get("seed_times") or []}
    pairs = [(times[seed], t) for seed, t in faster.get("seed_times") or [] if seed in times]
    return ratio_ci(pairs, confidence)


SETTLE_MAX_SEEDS = 200  # beyond this, "more than 200": the estimate means little there


def seeds_to_settle(
    delta: Mapping[str, Any], margin_db: float, confidence: float = CONFIDENCE
) -> int | None:
    """For an inconclusive interval: about how many paired seeds would settle it if the mean and
    the spread of the differences stayed as measured, the smallest n with either
    ``t * sd / sqrt(n) < |mean|`` (the interval excludes 0: a difference shown) or, where
    ``|mean| < margin_db``, ``|mean| + t * sd / sqrt(n) <= margin_db`` (inside the margin: no
    detectable difference), t being ``t_{(1 + confidence)/2, n - 1}``. An estimate from the
    seeds so far, for planning a sweep (both the mean and the sd will move with more seeds);
    None without a spread or beyond :data:`SETTLE_MAX_SEEDS`."""
    mean, sd = delta.get("mean"), delta.get("sd")
    if not (is_number(mean) and is_number(sd) and sd > 0):
        return None
    for n in range(max(int(delta.get("n") or 1) + 1, 2), SETTLE_MAX_SEEDS + 1):
        half = t_quantile(0.5 + confidence / 2.0, n - 1) * sd / n**0.5
        if half < abs(mean) or abs(mean) + half <= margin_db:
            return n
    return None


def sections(rows: Sequence[Mapping[str, Any]]) -> list[tuple[str, list[int]]]:
    """Rows compared within one context (same values of every key outside the precision
    group): ``[(title, row indices)]`` in row order; the title names the scene and the shown
    non-precision keys, e.g. ``"scene builtin, train.lr=0.01"``."""
    out: dict[tuple, tuple[str, list[int]]] = {}
    for index, row in enumerate(rows):
        context = _context(row["all_keys"])
        if context not in out:
            shown = [f"{k}={v}" for k, v in row["keys"].items()
                     if not k.startswith("precision.") and k != "scene.name"]  # fmt: skip
            out[context] = (", ".join([f"scene {row['scene']}", *shown]), [])
        out[context][1].append(index)
    return list(out.values())


def differs_from_reference(row: Mapping[str, Any], ref: Mapping[str, Any], key: str) -> bool:
    """Whether ``row``'s distinct values of ``key`` (a row field listing them, such as
    ``network`` or ``grid_adam_eps``) are known for both rows and differ from its reference
    row's, ``row`` having completed runs: the comparison then differs in more than precision."""
    own, theirs = row.get(key) or [], ref.get(key) or []
    return bool(row.get("n_seeds") and own and theirs) and own != theirs


def non_inferior(row: Mapping[str, Any], margin_db: float) -> bool:
    """Whether a compared row's interval has its lower end at or above ``-margin_db``: at most
    ``margin_db`` worse than the reference, at ``(1 + c) / 2`` one-sided confidence for the
    interval's two-sided c (97.5 % unadjusted; a non-inferiority test over its completed runs'
    pairs)."""
    low = (row.get("delta") or {}).get("low")
    return row.get("verdict") is not None and low is not None and low >= -margin_db


def at_reference_quality(row: Mapping[str, Any], margin_db: float) -> bool:
    """Whether a compared row is at the reference's quality: :func:`non_inferior`, and every
    run it has completed (none diverged, collapsed or failed: an arm that fails some seeds is
    not at the reference's quality, whatever its completed runs gave)."""
    clean = not any(row.get(status) for status in ("diverged", "collapsed", "failed"))
    return non_inferior(row, margin_db) and clean


def speed_candidates(
    rows: Sequence[Mapping[str, Any]],
    reference: Mapping[str, Any],
    margin_db: float = EQUIVALENCE_MARGIN_DB,
) -> list[Mapping[str, Any]]:
    """``reference`` and the rows compared with it that are :func:`at_reference_quality`, those
    with a mean time per iteration, fastest first (ties in the rows' order)."""
    candidates = [reference] + [
        r for r in rows if r is not reference and at_reference_quality(r, margin_db)
    ]
    timed = [r for r in candidates if is_number(r["time_per_iter_s"])]
    return sorted(timed, key=lambda r: r["time_per_iter_s"])
