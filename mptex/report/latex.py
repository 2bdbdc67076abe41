"""results.tex: the report's tables as LaTeX, to paste into a paper.

One ``table`` environment per section of report.md (scene and the swept keys outside the
precision group), with booktabs rules (``\\usepackage{booktabs}``; nothing else). Each row:
the arm and its swept precision keys, the completed runs of all its runs, PSNR mean ± sample
std over the completed runs, the paired Δ to f32 with its interval (the same numbers and
digits as report.md, so that a printed bound says what the exact one says about 0 and the
margin), the verdict, ms / iteration and the speed-up. The caption says how many seeds, how
the interval was computed and whether it was adjusted for multiplicity, so that a table
copied without report.md still carries its method.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from mptex.intervals import CONFIDENCE, percent
from mptex.numbers import is_number
from mptex.report.collect import REFERENCE_ARM, sorted_seeds
from mptex.report.markdown import delta_cell, runs_at_once, verdict_text
from mptex.report.stats import differs_from_reference

__all__ = ["escape", "render_latex"]

# Characters with a meaning in LaTeX text and what stands for them there.
_SPECIAL = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
    "<": r"\textless{}",
    ">": r"\textgreater{}",
    "|": r"\textbar{}",
    "±": r"$\pm$",
    "−": "$-$",
    "–": "--",
    "Δ": r"$\Delta$",
}


def escape(text: Any) -> str:
    """``text`` as LaTeX text: every character special to LaTeX escaped (an arm named
    ``fp8_rowwise`` or a path with ``%`` prints as written)."""
    return "".join(_SPECIAL.get(ch, ch) for ch in str(text))


def _math(text: str) -> str:
    """A signed number in math mode, so that its minus is a minus sign."""
    return f"${text}$"


def _psnr(row: Mapping[str, Any]) -> str:
    if row["psnr_mean"] is None:
        return "--"
    std = row["psnr_std"]
    text = f"{row['psnr_mean']:.2f}" + (rf" \pm {std:.2f}" if std is not None else "")
    return f"${text}$" + (r"\textsuperscript{\dag}" if row["below_baseline"] else "")


def _other_network(row: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> bool:
    """Whether the row's MLP is another kind of network than its reference row's
    (``precision.mlp``, e.g. tcnn's fused network against nvdiffrec's linear layers)."""
    ref = rows[row["reference"]] if row.get("reference") is not None else None
    return ref is not None and ref is not row and differs_from_reference(row, ref, "network")


def _row(row: Mapping[str, Any], keys: Sequence[str], margin_db: float,
         other_network: bool = False) -> list[str]:  # fmt: skip
    ms = row["time_per_iter_s"] * 1e3 if is_number(row["time_per_iter_s"]) else None
    mark = r"\textsuperscript{\ddag}" if other_network else ""
    return [
        r"\texttt{" + escape(row["precision"]) + "}" + mark,
        *(escape("--" if row["keys"].get(k) is None else row["keys"][k]) for k in keys),
        f"{row['n_seeds']}/{row['n_runs']}",
        _psnr(row),
        delta_cell(row, margin_db, _math, "--"),
        escape(verdict_text(row, margin_db)),
        "--" if ms is None else f"{ms:.1f}",
        "--" if not is_number(row["speedup"]) else f"{row['speedup']:.2f}",
    ]


def _speed(devices: Sequence[str], shared: int | None) -> str:
    """Where the ms / iteration column was measured, and whether runs shared the machine."""
    where = f" on {escape(', '.join(devices))}" if devices else ""
    text = f"ms / iter: the median time per iteration{where}, mean over the completed runs"
    if shared is not None and shared != 1:
        text += f", {runs_at_once(shared)} runs sharing the machine"
    return text + (
        ". Speed-up: the reference's mean time over the arm's, without an interval "
        "(report.md says which arms are faster by a per-seed interval). "
    )


def _seeds(section: Sequence[Mapping[str, Any]]) -> str:
    """The section's seeds, by value, and how many."""
    seeds = sorted_seeds(s for row in section for s in row.get("seeds", ()))
    return f"Seeds {escape(', '.join(seeds))} ({len(seeds)}). " if seeds else ""


def _caption(section: Sequence[Mapping[str, Any]], title: str, margin_db: float,
             speed: str, other_network: bool = False) -> str:  # fmt: skip
    first = section[0]
    level = first.get("confidence", CONFIDENCE)
    adjust, family = first.get("adjust", "none"), first.get("family", 0)
    interval = escape(percent(level)) + " Student-t interval over the paired seeds"
    if adjust != "none" and family > 1:
        interval += (f", Bonferroni-adjusted over the report's {family} comparisons (all hold "
                     f"together at {escape(percent(CONFIDENCE))})")  # fmt: skip
    else:
        interval += ", each for its own comparison (not adjusted for multiplicity)"
    return (
        f"Precision ablation, {escape(title)}. {_seeds(section)}Runs: completed of all. "
        f"PSNR (dB): mean $\\pm$ "
        f"sample std over the completed runs. $\\Delta$: PSNR(arm) $-$ "
        f"PSNR(\\texttt{{{escape(REFERENCE_ARM)}}}) per seed, mean and {interval}. Verdict: "
        f"better or worse when the interval excludes 0, no detectable difference when it lies "
        f"within $\\pm{margin_db:g}$\\,dB, inconclusive otherwise. {speed}"
        r"\textsuperscript{\dag}: a run at or below the constant-colour baseline."
        + (_OTHER_NETWORK if other_network else "")
    )


_OTHER_NETWORK = (
    r" \textsuperscript{\ddag}: another network than "
    rf"\texttt{{{escape(REFERENCE_ARM)}}}'s (its \texttt{{precision.mlp}} differs: tcnn's fully "
    r"fused network and nvdiffrec's MLP), so its $\Delta$ is not precision alone."
)


def render_latex(
    rows: Sequence[Mapping[str, Any]],
    sections: Sequence[tuple[str, Sequence[int]]],
    margin_db: float,
    sweep_dir: str | os.PathLike,
    devices: Sequence[str] = (),
    shared: int | None = 1,
) -> str:
    """results.tex's text: one table per section (:func:`mptex.report.stats.sections`) of the
    rows (:func:`mptex.report.stats.summarize_groups`), in report.md's order; ``devices``: the
    runs' devices, ``shared``: how many runs ran at a time on one machine
    (:func:`mptex.report.collect.concurrent_jobs`), both for the captions."""
    speed = _speed(devices, shared)
    keys = [k for k in (rows[0]["keys"] if rows else {}) if k.startswith("precision.")
            and k != "precision.name"]  # fmt: skip
    spec = "l" + "l" * len(keys) + "rrllrr"
    ci = escape(percent(rows[0].get("confidence", CONFIDENCE) if rows else CONFIDENCE)) + " CI"
    header = ["Arm", *(r"\texttt{" + escape(k) + "}" for k in keys), "Runs", "PSNR (dB)",
              rf"$\Delta$ vs.\ \texttt{{{escape(REFERENCE_ARM)}}} (dB) [{ci}]", "Verdict",
              "ms / iter", "Speed-up"]  # fmt: skip
    lines = [
        f"% mptex precision ablation of {sweep_dir}, written by mptex-report with "
        "report.md (the same numbers).",
        r"% Needs \usepackage{booktabs}.",
    ]
    stopped = [(r, s) for r in rows for s in r.get("stop_requested_runs", [])]
    if stopped:
        # Said beside the tables, not in them: the runs' numbers are whole and compared.
        items = "; ".join(f"{r['precision']} seed {s['seed']} ({s['signal']} during "
                          f"{s['during']})" for r, s in stopped)  # fmt: skip
        text = (
            f"Stop requested after the last iteration had begun (none cut short by it, "
            f"counted as usual; report.md says more): {items}."
        )
        lines.append("% " + " ".join(text.split()))  # one comment line, whatever a name holds
    for title, indices in sections:
        section = [rows[i] for i in indices]
        other = [_other_network(r, rows) for r in section]
        lines += [
            "",
            r"\begin{table}[t]",
            r"\centering",
            r"\caption{" + _caption(section, title, margin_db, speed, any(other)) + "}",
            r"\begin{tabular}{" + spec + "}",
            r"\toprule",
            " & ".join(header) + r" \\",
            r"\midrule",
            *(" & ".join(_row(r, keys, margin_db, o)) + r" \\" for r, o in zip(section, other)),
            r"\bottomrule",
            r"\end{tabular}",
            r"\end{table}",
        ]
    return "\n".join(lines) + "\n"
