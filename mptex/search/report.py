"""The precision search's report section: ``search.md`` and its Pareto figure ``pareto.png``."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mptex.intervals import CONFIDENCE, faster, percent, ratio_text

__all__ = ["write_search_report", "pareto_front", "confidence_text"]


def confidence_text(summary: Mapping[str, Any], bare: bool = False) -> str:
    """The certification intervals' confidence as the search's texts state it: ``95%``, or
    ``98.33% (Bonferroni over max_certify = 3)``; ``bare``: the level alone. Written as the
    sweep report and the speed-up intervals write a percentage."""
    level = percent(summary.get("confidence", CONFIDENCE))
    if bare or summary.get("adjust", "none") == "none" or summary.get("max_certify", 1) <= 1:
        return level
    return f"{level} (Bonferroni over max_certify = {summary['max_certify']})"


def _multiplicity(summary: Mapping[str, Any]) -> str:
    """What the certification's error rate is for the search as a whole."""
    if summary.get("max_certify", 1) <= 1:
        return ("one candidate at most is tried: the chance that it certifies although truly "
                "outside the margin is at most 2.5%")  # fmt: skip
    if summary.get("adjust", "none") != "none":
        return (f"adjusted so that the chance that any of the up to {summary['max_certify']} "
                "candidates tried certifies although truly outside the margin is at most "
                "2.5%")  # fmt: skip
    return ("each candidate tried is a test of its own: with k tried, one truly outside the "
            "margin certifies with a chance up to k x 2.5%; `search.adjust=bonferroni` holds "
            "the search to 2.5%")  # fmt: skip


def _interval(cert: Mapping[str, Any] | None) -> str:
    if not cert or cert.get("low") is None:
        return "-"
    return f"{cert['mean']:+.2f} [{cert['low']:+.2f}, {cert['high']:+.2f}]"


def _quality(row: Mapping[str, Any], seed: int) -> float | None:
    """Mean Δ over the certification seeds where all ran, else the screen seed's Δ."""
    cert = row.get("certificate")
    if cert and cert.get("mean") is not None:
        return float(cert["mean"])
    return row["delta_db"].get(str(seed))


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both objectives: cost (lower is better)
    and distance to f32, ``|Δ|`` (lower is better: the search asks for f32's quality, and a
    candidate far above f32 is as far from being equivalent as one below); ordered by cost.
    Equal points keep the first index."""
    front, dist = [], [(cost, abs(delta)) for cost, delta in points]
    for i, (cost, gap) in enumerate(dist):
        dominated = any((c <= cost and g <= gap) and (c < cost or g < gap) for c, g in dist)
        duplicate = any(dist[j] == (cost, gap) for j in front)
        if not dominated and not duplicate:
            front.append(i)
    return sorted(front, key=lambda i: points[i][0])


def _plot(path: Path, summary: Mapping[str, Any]) -> bool:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    seed0 = summary["screen_seed"]
    rows = [r for r in summary["candidates"] if _quality(r, seed0) is not None]
    if not rows:
        return False
    fig = Figure(figsize=(7.0, 4.5), layout="constrained")  # no pyplot: no global state
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    margin = summary["margin_db"]
    ax.axhspan(-margin, margin, color="0.9", zorder=0, label=f"±{margin} dB (margin)")
    ax.axhline(0.0, color="0.5", lw=0.8)
    for row in rows:
        x, y = row["cost_s"] * 1e6, _quality(row, seed0)
        cert = row.get("certificate")
        if cert and cert.get("low") is not None:
            color = "tab:green" if cert["certified"] else "tab:red"
            ax.errorbar(
                [x],
                [y],
                yerr=[[y - cert["low"]], [cert["high"] - y]],
                fmt="o",
                color=color,
                capsize=3,
                zorder=3,
            )
        else:
            ax.plot([x], [y], "o", mfc="none", color="tab:blue", zorder=2)
    points = [(r["cost_s"], _quality(r, seed0)) for r in rows]
    front = pareto_front(points)
    ax.plot(
        [points[i][0] * 1e6 for i in front],
        [points[i][1] for i in front],
        "--",
        color="0.3",
        lw=1,
        label="Pareto front",
        zorder=1,
    )
    best = next(r for r in rows if r["candidate"] == summary["certified"])
    ax.plot(
        [best["cost_s"] * 1e6],
        [_quality(best, seed0)],
        "*",
        ms=16,
        color="gold",
        mec="k",
        zorder=4,
        label=f"certified: {summary['certified']}",
    )
    for row in rows:
        ax.annotate(
            row["candidate"],
            (row["cost_s"] * 1e6, _quality(row, seed0)),
            fontsize=6,
            xytext=(3, 3),
            textcoords="offset points",
        )
    what = "measured" if summary["cost"]["measured"] else "modelled"
    ax.set_xlabel(f"{what} µs / iteration on {summary['cost']['gpu_name']}")
    ax.set_ylabel("PSNR − PSNR(f32) [dB]")
    ax.set_title(
        f"Precision search: cost vs quality (hollow: one seed; bars: paired "
        f"{confidence_text(summary, bare=True)} CI)",
        fontsize=9,
    )
    ax.legend(fontsize=7, loc="best")
    fig.savefig(path, dpi=120)
    return True


def _measured_speedup(row: Mapping[str, Any]) -> str:
    """The certified candidate's measured speed-up over f32 seed by seed, as a clause (empty
    where no seed was timed alone on the GPU in both): a medians' ratio alone is no evidence
    that it runs faster."""
    speed = row.get("measured_speedup")
    if not speed:
        return ""
    if faster(speed):
        return f"; per seed {ratio_text(speed)}"
    return f"; per seed {ratio_text(speed)}: not measurably faster than f32 on this GPU"


def write_search_report(out: str | os.PathLike, summary: Mapping[str, Any]) -> Path:
    """Write ``search.md`` (and ``pareto.png``) into ``out``; returns the markdown's path."""
    out = Path(out)
    plotted = _plot(out / "pareto.png", summary)
    seeds, margin, s0 = summary["seeds"], summary["margin_db"], summary["screen_seed"]
    ref = next(r for r in summary["candidates"] if r["candidate"] == summary["reference"])
    best = next(r for r in summary["candidates"] if r["candidate"] == summary["certified"])
    cost = summary["cost"]
    what = ("measured on this machine's GPU where a candidate ran on CUDA, modelled elsewhere"
            if cost["measured"] else "modelled")  # fmt: skip
    measured = best.get("cost_source") == ref.get("cost_source") == "measured"
    where = "measured on this machine's GPU" if measured else f"modelled on {cost['gpu_name']}"
    lines = ["## Precision search", ""]
    if summary["certified_is_reference"]:
        lines.append(
            f"**No assignment cheaper than f32 was certified** within ±{margin} dB over seeds "
            f"{seeds}: the answer is f32 ({summary['reference']})."
        )
    else:
        lines.append(
            f"**Certified cheapest: `{best['candidate']}`** — PSNR − PSNR(f32) "
            f"{_interval(best['certificate'])} dB (paired {confidence_text(summary)} Student-t "
            "interval, seeds "
            f"{seeds}, inside ±{margin} dB); cost {best['cost_s'] * 1e6:.1f} µs / "
            f"iteration vs f32's {ref['cost_s'] * 1e6:.1f} µs "
            f"({ref['cost_s'] / best['cost_s']:.2f}x less), {where}{_measured_speedup(best)}."
        )
        verdict = (best["certificate"] or {}).get("verdict")
        if verdict in ("better", "worse"):
            lines.append(
                f"(The report's verdict is `{verdict}`: the interval excludes 0, so the "
                "difference is detectable, but it lies inside the margin, which is what "
                "certification asks.)"
            )
    lines += [
        "",
        f"`{summary['reproduce']}` trains it with the search's protocol and seed {s0} "
        f"(its config: `{summary['result_config']}`; `--config-dir` adds the search's "
        "`configs/` to mptex's, so `precision=` finds it).",
        "",
        f"Method: every candidate trains with this config's protocol; screens run one seed "
        f"({s0}) and pass when |Δ| <= {summary['screen_db']} dB (Δ = PSNR − PSNR(f32), "
        f"same seed); passing candidates cheaper than f32 are run over seeds {seeds} (fresh "
        f"seeds: the screen's, which chose them, would pull the interval towards 0), "
        f"cheapest first, and certified when the paired {confidence_text(summary)} interval "
        f"of Δ lies within ±{margin} dB (a collapsed, diverged or failed run is never "
        f"certified; {_multiplicity(summary)}). Cost: "
        f"{what} (model: one iteration of the texture on {cost['gpu_name']}, {cost['source']}, "
        f"{cost['points']} texture queries per iteration; its assumptions are in "
        "`mptex/search/cost.py` and the README).",
        "",
    ]
    if plotted:
        lines += ["![cost vs quality](pareto.png)", ""]
    lines += [
        "| candidate | stage | µs / it | vs f32 | Δ seed "
        f"{s0} [dB] | Δ mean [{confidence_text(summary, bare=True)} CI] | verdict | "
        "certified | runs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in summary["candidates"]:
        cert = row.get("certificate") or {}
        d0 = row["delta_db"].get(str(s0))
        statuses = Counter(r["status"] for r in row["runs"].values())
        if row is ref:  # compared with itself: Δ 0 by construction, no verdict to give
            delta, interval, verdict, certified = "-", "-", "reference", "-"
        else:
            delta = "-" if d0 is None else f"{d0:+.2f}"
            interval, verdict = _interval(cert), cert.get("verdict", cert.get("reason", "-"))
            certified = "yes" if cert.get("certified") else "no"
        lines.append(
            f"| `{row['candidate']}` | {row['stage']} | {row['cost_s'] * 1e6:.1f} | "
            f"{row['cost_s'] / ref['cost_s']:.2f} | {delta} | {interval} | {verdict} | "
            f"{certified} | {', '.join(f'{n} {s}' for s, n in sorted(statuses.items()))} |"
        )
    better = [r["candidate"] for r in summary["candidates"]
              if (r["delta_db"].get(str(s0)) or 0.0) > summary["screen_db"]]  # fmt: skip
    if better:
        names = ", ".join(f"`{n}`" for n in better)
        lines += [
            "",
            f"Above f32 by more than {summary['screen_db']} dB at seed {s0}: {names}. Not "
            "equivalent to f32, so never certified: a different function (e.g. tcnn's fused "
            "network has its own initialisation), not a precision effect; compare it as an arm "
            "of its own.",
        ]
    skipped = summary.get("not_trained")
    if skipped and skipped["count"]:
        lines += [
            "",
            f"Not trained: {skipped['count']} kept candidates. Combinations and variants are "
            "screened only while modelled cheaper than the cheapest candidate that has passed "
            f"its screen so far; the answer here, `{best['candidate']}`, costs "
            f"{best['cost_s'] * 1e6:.1f} µs / it.",
        ]
        if skipped["cheapest_by_kind"]:
            lines += ["", "The cheapest of each kind below f16 and of the bfloat16 grid:", ""]
            lines += [
                f"- {k['kind']}: `{k['candidate']}`, {k['model_s'] * 1e6:.1f} µs / it "
                f"({k['model_s'] / ref['cost_s']:.2f} of f32's)"
                for k in skipped["cheapest_by_kind"]
            ]
    reasons = Counter((p["rule"], p["reason"]) for p in summary["space"]["pruned"])
    lines += [
        "",
        f"Space: {summary['space']['kept']} candidates kept, "
        f"{len(summary['space']['pruned'])} pruned before training:",
        "",
    ]
    for (rule, reason), n in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0])):
        lines.append(f"- {n} × {rule}: {reason}")
    budget = summary["budget"]
    # a run killed without a record, or one that failed, left time that no file holds
    at_least = "" if budget["run_wall_complete"] else "at least "
    lines += [
        "",
        f"Budget: {budget['runs']} runs ({budget['trained']} trained now, {budget['reused']} "
        f"read back from an earlier start), {budget['iterations']} iterations, "
        f"{at_least}{budget['run_wall_s']:.0f} s of run time, {budget['search_wall_s']:.0f} s wall "
        f"({budget['workers']} at a time).",
        "",
    ]
    path = out / "search.md"
    path.write_text("\n".join(lines))
    return path
