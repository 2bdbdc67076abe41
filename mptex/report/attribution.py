"""nvdiffrec #154: the gap of the fused f16 network, over iterations, and what accounts for it.

Read from a sweep that holds the #154 arms (``+experiment=nvdiffrec154``); every number is a
paired difference (same seed, same other swept values) with the Student-t interval of
:func:`mptex.report.stats.mean_ci` and the verdict of :func:`mptex.report.stats.verdict`. A
sweep over more than the arms and seeds (two scenes, two learning rates, a ``precision.*`` key
swept within an arm) has one section per combination of those values (:func:`contexts`): runs
are paired only within one, and no interval pools them.

The gap is decomposed along a chain of arms that each change one thing, so that the terms add
up to the gap exactly (per seed, hence also in the mean)::

    swap154 - nvdiffrec = (nvdiffrec_scale1 - nvdiffrec)      the grid loses nvdiffrec's x128
                        + (tcnn_fused - nvdiffrec_scale1)     the f16 fused network itself
                        + (swap154 - tcnn_fused)              nvdiffrec's /128 encoder hook

and the network term is taken apart by the twin's switches, each against ``tcnn_fused``: float32
instead of half accumulators, no split-K, static scale 1024 instead of 128, an outer dynamic
scale. A switch term is what removing that one effect recovers; the switch terms need not add
up (effects interact). Precision statistics (the monitor's ``history`` entries) back the terms:
the grid's incoming gradient (``encoder.out_grad_*``) and, per layer of the fused twin, what
its half arithmetic flushed (``net.<i>.fused_*``).
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from mptex.numbers import is_number
from mptex.report.markdown import interval_text
from mptex.report.stats import CONFIDENCE, mean_ci, verdict

__all__ = ["DECOMPOSITION", "SWITCHES", "applies", "contexts", "attribution", "render", "plot_gap"]

BASE = "nvdiffrec"
SWAP = "tcnn_fused_swap154"
# (arm, minus arm, what the difference measures): the chain that adds up to the gap.
DECOMPOSITION = (
    ("nvdiffrec_scale1", BASE, "the grid's gradients lose nvdiffrec's x128 (f32 MLP kept)"),
    ("tcnn_fused", "nvdiffrec_scale1", "the f16 fused network in place of the f32 MLP"),
    (SWAP, "tcnn_fused", "nvdiffrec's /128 encoder hook left in place"),
)
SWITCHES = (
    ("tcnn_fused_f32acc", "tcnn_fused", "float32 instead of half accumulators"),
    ("tcnn_fused_nosplitk", "tcnn_fused", "no split-K in the weight gradients"),
    ("tcnn_fused_scale1024", "tcnn_fused", "static scale 1024 instead of tcnn's 128"),
    ("tcnn_fused_dynamic", "tcnn_fused", "an outer dynamic loss scale on top of 128"),
    ("tcnn_fused", "f32", "the fused network against the all-f32 reference"),
)
# Monitor keys shown per arm (means over the sampled iterations, then over seeds).
_GRID_KEYS = ("encoder.out_grad_zero_frac", "encoder.out_grad_subnormal_frac")
_FUSED_NAMES = ("absorbed_frac", "zero_frac", "subnormal_frac", "flushed_by_unscale_frac")


def applies(runs: Sequence[Mapping[str, Any]]) -> bool:
    """Whether the sweep holds the gap's two ends (the swap and nvdiffrec's baseline)."""
    arms = {r.get("precision") for r in runs}
    return SWAP in arms and BASE in arms


def _within_arm_keys(runs: Sequence[Mapping[str, Any]]) -> set[str]:
    """The ``precision.*`` keys (not the name) with two or more values among one arm's runs: a
    setting swept on top of the arms (``precision.static_loss_scale=64,1024``), not one that
    follows from the arm."""
    values: dict[tuple[str, str], set[str]] = {}
    for run in runs:
        for key, value in (run.get("keys") or {}).items():
            if key.startswith("precision.") and key != "precision.name":
                values.setdefault((str(run.get("precision")), key), set()).add(repr(value))
    return {key for (_, key), seen in values.items() if len(seen) > 1}


def _key_of(run: Mapping[str, Any], within: set[str]) -> tuple:
    # repr, not str: 0.01 and "0.01" (a hand-made config) are rows apart, so contexts apart.
    return tuple(sorted((k, repr(v)) for k, v in (run.get("keys") or {}).items()
                        if not k.startswith("precision.") or k in within))  # fmt: skip


def contexts(runs: Sequence[Mapping[str, Any]]) -> list[tuple[dict[str, Any], list]]:
    """The sweep's runs split by what the section compares within: the same values of every
    swept key outside the precision group (scene, learning rate, ...) and of every
    ``precision.*`` key swept within an arm. ``[(values, runs)]`` in the runs' order; ``values``
    maps each such key to its value (empty for a sweep of the arms and seeds alone)."""
    within = _within_arm_keys(runs)
    out: dict[tuple, tuple[dict[str, Any], list]] = {}
    for run in runs:
        key = _key_of(run, within)
        if key not in out:
            values = {k: v for k, v in (run.get("keys") or {}).items()
                      if not k.startswith("precision.") or k in within}  # fmt: skip
            out[key] = (values, [])
        out[key][1].append(run)
    return list(out.values())


def _completed(runs, arm) -> dict[str, Mapping[str, Any]]:
    """Seed -> the arm's completed run with a PSNR, from the runs of one context."""
    done: dict[str, Mapping[str, Any]] = {}
    for run in runs:
        if (
            run.get("precision") == arm
            and run["status"] == "completed"
            and is_number(run.get("psnr"))
        ):
            seed = str(run["seed"])
            if seed in done:
                raise ValueError(
                    f"runs: `{arm}` has two completed runs with seed {seed} "
                    f"({done[seed].get('run_dir')}, {run.get('run_dir')}); pass the runs of "
                    "one context (contexts())"
                )
            done[seed] = run
    return done


def _psnr_at(run: Mapping[str, Any]) -> dict[int, float]:
    return {int(h["iteration"]): float(h["psnr"]) for h in run.get("history") or []
            if is_number(h.get("psnr")) and is_number(h.get("iteration"))}  # fmt: skip


def _term(runs, arm, minus, what, margin_db, one_effect=False) -> dict[str, Any] | None:
    """One paired difference; ``one_effect``: the two arms are meant to differ by one switch
    of the twin's arithmetic (a switch term against ``tcnn_fused``), so a difference of
    implementation between them is named (``mixed``)."""
    a, b = _completed(runs, arm), _completed(runs, minus)
    pairs = sorted(set(a) & set(b))
    if not pairs:
        return None
    final = mean_ci([a[p]["psnr"] - b[p]["psnr"] for p in pairs])
    curve: dict[int, list[float]] = {}
    for p in pairs:
        pa, pb = _psnr_at(a[p]), _psnr_at(b[p])
        for it in sorted(set(pa) & set(pb)):
            curve.setdefault(it, []).append(pa[it] - pb[it])
    over = {it: mean_ci(d) for it, d in sorted(curve.items()) if len(d) == len(pairs)}
    return dict(arm=arm, minus=minus, what=what, n=len(pairs), final=final,
                verdict=verdict(final, margin_db), curve=over,
                mixed=_mixed_backends(arm, minus, [a[p] for p in pairs], [b[p] for p in pairs])
                if one_effect else None)  # fmt: skip


def _mixed_backends(arm, minus, runs_a, runs_b) -> str | None:
    """Where the two arms' grid or network ran different implementations (on a GPU the
    ``tcnn_fused`` arms run tinycudann's network, the twin-only switches the twin): the
    difference then holds the implementations' difference too. None where they match."""
    notes = []
    for key, part in (("mlp_backend", "network"), ("encoder_backend", "grid")):
        ran_a = sorted({str(r.get(key)) for r in runs_a if r.get(key)})
        ran_b = sorted({str(r.get(key)) for r in runs_b if r.get(key)})
        if ran_a and ran_b and ran_a != ran_b:
            notes.append(f"{part}: `{arm}` ran {'/'.join(ran_a)}, `{minus}` {'/'.join(ran_b)}")
    return "; ".join(notes) or None


def _stat_means(runs, arm) -> dict[str, float]:
    per_run: dict[str, list[float]] = {}
    for run in _completed(runs, arm).values():
        values: dict[str, list[float]] = {}
        for entry in run.get("history") or []:
            for key, value in entry.items():
                if (key in _GRID_KEYS or ".fused_" in key) and is_number(value):
                    values.setdefault(key, []).append(float(value))
        for key, series in values.items():
            per_run.setdefault(key, []).append(statistics.fmean(series))
    return {k: statistics.fmean(v) for k, v in per_run.items()}


def attribution(runs: Sequence[Mapping[str, Any]], margin_db: float) -> dict[str, Any]:
    """The gap, its decomposition, the switch terms and the precision statistics of the runs of
    one context (:func:`contexts`).

    Args:
        runs: runs after :func:`mptex.report.collect.group_runs` (``keys`` set), of one
            context (:class:`ValueError` otherwise: pairs across contexts would mix scenes or
            settings).
        margin_db: the equivalence margin of the verdicts.

    Returns:
        ``{"gap", "decomposition", "switches", "statistics"}``; a term is None where one of its
        arms has no completed run; a term: ``arm``, ``minus``, ``what``, ``n`` (pairs),
        ``final`` (:func:`mean_ci` of the final-PSNR differences), ``verdict``, ``curve``
        (iteration -> :func:`mean_ci` of the validation-PSNR differences).
    """
    if len(contexts(runs)) > 1:
        raise ValueError("runs: they span several contexts (scenes or settings); pass the runs "
                         "of one context (contexts())")  # fmt: skip
    arms = [SWAP, "tcnn_fused", BASE, "nvdiffrec_scale1", "f32",
            *(s[0] for s in SWITCHES)]  # fmt: skip
    return dict(
        gap=_term(runs, SWAP, BASE, "the swap as #154 made it", margin_db),
        decomposition=[_term(runs, *t, margin_db) for t in DECOMPOSITION],
        switches=[_term(runs, *t, margin_db, one_effect=t[1] == "tcnn_fused") for t in SWITCHES],
        statistics={
            arm: _stat_means(runs, arm) for arm in dict.fromkeys(arms) if _completed(runs, arm)
        },  # fmt: skip
    )


def _ci(ci: Mapping[str, Any], margin_db: float) -> str:
    """An interval as printed, with the digits its bounds need to say what the exact ones say
    about 0 and ±``margin_db`` (:func:`mptex.report.markdown.interval_text`)."""
    if ci.get("low") is None:
        return f"{ci['mean']:+.2f} (one pair: no interval)"
    mean, low, high = interval_text(ci, margin_db)
    return f"{mean} [{low}, {high}]"


def _row(term: Mapping[str, Any] | None, spec: tuple[str, str, str], margin_db: float) -> str:
    arm, minus, what = spec
    if term is None:
        return f"| {what} | `{arm}` − `{minus}` | – | – | not run (an arm has no completed run) |"
    mixed = term.get("mixed")
    note = f" (not like for like: {mixed})" if mixed else ""
    return (f"| {what} | `{arm}` − `{minus}` | {term['n']} | {_ci(term['final'], margin_db)} | "
            f"{term['verdict']}{note} |")  # fmt: skip


def _title(context: Mapping[str, Any]) -> str:
    return ", ".join(f"`{k}={v}`" for k, v in context.items())


def render(
    result: Mapping[str, Any],
    margin_db: float,
    plotted: bool,
    context: Mapping[str, Any] | None = None,
) -> list[str]:
    """report.md lines of the section "nvdiffrec #154: the gap and what accounts for it", for
    the runs of ``context`` (:func:`contexts`' values, named in the heading when not empty)."""
    header = ["| effect | difference | pairs | ΔPSNR (dB) "
              f"[{CONFIDENCE:.0%} CI] | verdict (±{margin_db:g} dB) |",
              "|---|---|---|---|---|"]  # fmt: skip
    gap = result["gap"]
    where = f": {_title(context)}" if context else ""
    lines = [f"## nvdiffrec #154: the gap and what accounts for it{where}", ""]
    if gap is None:
        return lines + ["The swap or nvdiffrec's baseline has no completed run: no gap.", ""]
    lines += [
        "Paired differences of the final validation PSNR (same seed, same other swept values); "
        f"interval: Student t, {CONFIDENCE:.0%}, over the pairs. The first three terms add up "
        "to the gap exactly (per seed); each switch term is what removing one effect from "
        "`tcnn_fused` recovers (switch terms may interact and need not add up).",
        "",
        *header,
        _row(gap, (SWAP, BASE, "**the gap: the swap as #154 made it**"), margin_db),
        *(_row(t, spec, margin_db) for t, spec in zip(result["decomposition"], DECOMPOSITION)),
        *(_row(t, spec, margin_db) for t, spec in zip(result["switches"], SWITCHES)),
        "",
    ]
    if gap["curve"]:
        its = list(gap["curve"])
        step = max(1, len(its) // 6)
        shown = sorted(set(its[::step]) | {its[-1]})
        lines += ["The gap over iterations (validation PSNR, swap − nvdiffrec, mean "
                  f"[{CONFIDENCE:.0%} CI] over {gap['n']} seeds):", "",
                  "| iteration | " + " | ".join(str(i) for i in shown) + " |",
                  "|---" * (len(shown) + 1) + "|",
                  "| ΔPSNR (dB) | "
                  + " | ".join(_ci(gap["curve"][i], margin_db) for i in shown) + " |",
                  ""]  # fmt: skip
        if plotted:
            lines += ["![the gap and its terms over iterations](gap_curves.png)", ""]
    stats = result["statistics"]
    keys = sorted({k for values in stats.values() for k in values},
                  key=lambda k: (not k.startswith("encoder"), k))  # fmt: skip
    if keys:
        lines += ["Precision statistics (mean over the sampled iterations, then over seeds): "
                  "`encoder.out_grad_*`: the grid's incoming gradient dL/d(encoding), zero or "
                  "subnormal in f16 as the grid's backward receives it; `net.<i>.fused_*`: the "
                  "fused twin's weight gradient of layer i: `absorbed_frac`, non-zero "
                  "contributions the half accumulator left unchanged; `zero_frac` / "
                  "`subnormal_frac` after tcnn's half `/ scale`; `flushed_by_unscale_frac`, "
                  "non-zero entries that division made 0.", "",
                  "| arm | " + " | ".join(f"`{k}`" for k in keys) + " |",
                  "|---" * (len(keys) + 1) + "|"]  # fmt: skip
        for arm, values in stats.items():
            cells = [f"{values[k]:.3g}" if k in values else "–" for k in keys]
            lines.append(f"| `{arm}` | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def plot_gap(
    path: str | os.PathLike, results: Sequence[tuple[Mapping[str, Any], Mapping[str, Any]]]
) -> bool:
    """``gap_curves.png``: the gap and the decomposition terms against iteration, mean with its
    confidence band, one panel per ``(context, result)`` with a curve (:func:`contexts`,
    :func:`attribution`). False (nothing written) without a curve."""
    panels = []
    for context, result in results:
        terms = [t for t in (result["gap"], *result["decomposition"]) if t and t["curve"]]
        if terms:
            panels.append((context, terms))
    if not panels:
        return False
    from mptex.report.plots import _figure

    fig, axes = _figure(1, n_rows=len(panels), width=7.5, height=4.5)
    for (context, terms), ax in zip(panels, axes[:, 0]):
        _draw_gap(ax, terms, context)
    fig.savefig(path, dpi=100)
    return True


def _draw_gap(ax, terms, context: Mapping[str, Any]) -> None:
    from mptex.report.plots import arm_color

    for k, term in enumerate(terms):
        its = list(term["curve"])
        mean = [term["curve"][i]["mean"] for i in its]
        label = f"{term['arm']} − {term['minus']}" + (" (the gap)" if k == 0 else "")
        color = arm_color(term["arm"]) if k else "black"
        ax.plot(its, mean, label=label, color=color, linewidth=2.0 if k == 0 else 1.2,
                linestyle="-" if k == 0 else ("--", "-.", ":")[(k - 1) % 3])  # fmt: skip
        low = [term["curve"][i]["low"] for i in its]
        if all(v is not None for v in low):
            high = [term["curve"][i]["high"] for i in its]
            ax.fill_between(its, low, high, color=color, alpha=0.15, linewidth=0)
    ax.axhline(0.0, color="grey", linewidth=0.8)
    where = "".join(f", {k}={v}" for k, v in context.items())
    ax.set(xlabel="iteration", ylabel="ΔPSNR (dB), paired by seed",
           title=f"nvdiffrec #154: gap and terms, mean and {CONFIDENCE:.0%} CI{where}")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
