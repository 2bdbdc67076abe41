"""Naming a collapse: a completed run whose texture output saturated at the wrong
colour, or whose PSNR sat on a plateau below the constant-colour baseline or held there by stuck
pixels.

Such a run says nothing about precision: the same collapse happens in f32 (the duck under one
learning rate: every covered pixel (1, 1, 0), docs/archive/mlp-learning-rate.md), so the report
counts it apart from the completed runs and leaves it out of the paired differences. The rule
(:func:`classify_collapse`, stated in every report.md):

- **stuck**: the final ``saturation.stuck_fraction`` of metrics.json (covered validation pixels
  whose logit is past ±8 *and* whose value is more than 0.1 from the reference's) is at least
  :data:`STUCK_COLLAPSED` in some channel: collapsed, whatever the PSNR; or
- **below the baseline**: the final PSNR is at or below ``baseline_psnr`` (the best single
  colour) and either some channel's stuck fraction is at least :data:`STUCK_BELOW_BASELINE`, or
  the PSNR is on a plateau: the last :data:`PLATEAU_MIN_VALIDATIONS` or more validation PSNRs
  of ``history`` lie within :data:`PLATEAU_DB` of each other and that flat stretch spans at least
  :data:`PLATEAU_MIN_SPAN` of the run's iterations; or
- **plateau, stuck**: above the baseline, the PSNR on such a plateau and some channel's stuck
  fraction at least :data:`STUCK_BELOW_BASELINE` (tcnn's fused network on the real-asset torus,
  seed 1: flat at 20.04 dB from iteration 800 of 2400, 16 % of the blue channel stuck, where
  the other seeds reach 57-58 dB; no f32 run of the real-asset protocol has had more than 0.06 %
  stuck, docs/archive/collapse-rule.md).

A metrics.json from before the saturation keys is judged by the plateau rule alone; a run
without three validations in its history by the stuck rules alone. Nothing here reads tensors:
metrics.json is the contract (docs/metrics.md).

A run can also be **partly stuck** (:func:`classify_partly_stuck`, not a collapse): completed
above its baseline and not collapsed, but with a few stuck pixels that hold most of its squared
error (``saturation.stuck_error_fraction`` at least :data:`PARTLY_STUCK_ERROR`). Such a run
counts in its row's PSNR and Δ like any completed run (it is what the arm produced), and the
report names it, because its PSNR deficit is those pixels, not the precision's rounding: an
nvdiffrec run on the real-asset duck lost 16 dB to 0.18 % stuck pixels (the white of the eye)
and showed only as an inconclusive Δ (docs/archive/collapse-rule.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from mptex.numbers import is_number

__all__ = [
    "STUCK_COLLAPSED",
    "STUCK_BELOW_BASELINE",
    "PLATEAU_DB",
    "PLATEAU_MIN_VALIDATIONS",
    "PLATEAU_MIN_SPAN",
    "RULE",
    "PARTLY_STUCK_ERROR",
    "PARTLY_STUCK_RULE",
    "classify_collapse",
    "classify_partly_stuck",
    "flat_since",
]

# Half of the covered pixels pinned at a rail more than 0.1 from their colour in one channel: a
# healthy fit has ~0 such pixels (its saturated pixels are right: a pure-colour channel), and
# half the picture wrong by a tenth of the range is no texture, whatever its PSNR says.
STUCK_COLLAPSED = 0.5
# A run already at or below the single-colour baseline with a tenth of its pixels stuck: the
# saturation is what holds it there (a slow but healthy run below the baseline is unsaturated).
STUCK_BELOW_BASELINE = 0.1
# Flat: within 0.2 dB, about the seed-to-seed spread of f32 under the measurement protocol
# (0.19 dB, docs/archive/quick-experiment-length.md) and far below what a learning run gains
# between validations.
PLATEAU_DB = 0.2
# At least three validations (two intervals), so that one quiet interval is no plateau.
PLATEAU_MIN_VALIDATIONS = 3
# Spanning at least half the run: the cosine schedule of the protocol slows every run near its
# end, so a flat last stretch alone is expected; a collapse is flat from early on (the collapsed
# duck runs of docs/archive/mlp-learning-rate.md sat still from iteration ~10).
PLATEAU_MIN_SPAN = 0.5
# The rule in one sentence, as report.md states it.
RULE = (
    f"a completed run is collapsed when ≥ {STUCK_COLLAPSED:.0%} of its covered validation "
    f"pixels are stuck in some channel (logit beyond ±8, value more than 0.1 from the "
    f"reference's), or when it ends at or below the constant-colour baseline with "
    f"≥ {STUCK_BELOW_BASELINE:.0%} stuck or with its validation PSNR flat (the last "
    f"≥ {PLATEAU_MIN_VALIDATIONS} validations within {PLATEAU_DB:g} dB, over ≥ "
    f"{PLATEAU_MIN_SPAN:.0%} of the run), or when its validation PSNR is flat that way with "
    f"≥ {STUCK_BELOW_BASELINE:.0%} stuck, above the baseline too"
)


# "Most of its squared error": more than half. Where stuck pixels hold a share s of the MSE,
# fixing them would gain -10 log10(1 - s) dB: 3 dB at one half, 16 dB at 97.5 % (the duck).
PARTLY_STUCK_ERROR = 0.5
PARTLY_STUCK_RULE = (
    f"a completed run above its constant-colour baseline and not collapsed is partly stuck when "
    f"its stuck pixels (in any channel) hold ≥ {PARTLY_STUCK_ERROR:.0%} of its squared error on "
    f"the covered validation pixels (sRGB, clamped, as the PSNR)"
)


def _validations(history: Sequence[Any]) -> list[tuple[int, dict[str, Any]]]:
    """(iteration, entry) of the history entries with a finite PSNR, by iteration (the last
    entry of an iteration wins: a resumed run may repeat one)."""
    by_iteration: dict[int, dict[str, Any]] = {}
    for entry in history or []:
        if isinstance(entry, Mapping) and is_number(entry.get("psnr")):
            if is_number(entry.get("iteration")):
                by_iteration[int(entry["iteration"])] = dict(entry)
    return sorted(by_iteration.items())


def flat_since(history: Sequence[Any], iterations: Any = None) -> int | None:
    """The iteration from which the validation PSNR stays flat to the end, or None.

    The longest final stretch of validations whose PSNRs lie within :data:`PLATEAU_DB` of each
    other counts when it holds at least :data:`PLATEAU_MIN_VALIDATIONS` validations and spans
    at least :data:`PLATEAU_MIN_SPAN` of the run (``iterations``, else the last validation's).

    Args:
        history: metrics.json's ``history`` (entries with ``iteration`` and ``psnr``).
        iterations: the run's completed iterations.
    """
    points = _validations(history)
    if len(points) < PLATEAU_MIN_VALIDATIONS:
        return None
    start = len(points) - 1
    low = high = points[start][1]["psnr"]
    while start > 0:
        psnr = points[start - 1][1]["psnr"]
        if max(high, psnr) - min(low, psnr) >= PLATEAU_DB:
            break
        low, high, start = min(low, psnr), max(high, psnr), start - 1
    length = points[-1][0] if not is_number(iterations) else max(int(iterations), points[-1][0])
    span = points[-1][0] - points[start][0]
    if len(points) - start < PLATEAU_MIN_VALIDATIONS or span < PLATEAU_MIN_SPAN * length:
        return None
    return points[start][0]


def _worst_channel(stuck: Any) -> tuple[int, float] | None:
    if not isinstance(stuck, Sequence) or isinstance(stuck, str):
        return None
    values = [(c, float(v)) for c, v in enumerate(stuck) if is_number(v)]
    return max(values, key=lambda item: item[1]) if values else None


def _stuck_since(history: Sequence[Any], channel: int) -> int | None:
    """How fast it set in: the first validation from which ``channel``'s stuck fraction stays at
    :data:`STUCK_BELOW_BASELINE` or more to the end (None if the last one is below it)."""
    since = None
    for iteration, entry in _validations(history):
        worst = entry.get("stuck_fraction")
        value = worst[channel] if isinstance(worst, list) and len(worst) > channel else None
        if is_number(value) and value >= STUCK_BELOW_BASELINE:
            since = iteration if since is None else since
        else:
            since = None
    return since


def classify_collapse(metrics: Mapping[str, Any]) -> dict[str, Any] | None:
    """Whether a completed run collapsed, by the module's rule; the evidence if it did.

    Args:
        metrics: one run's metrics.json (any status; only ``completed`` runs can collapse).

    Returns:
        None, or ``{"rule": "stuck" | "below baseline, stuck" | "below baseline, plateau" |
        "plateau, stuck",
        "stuck_fraction", "stuck_channel", "stuck_since", "saturated_fraction" (that channel's),
        "psnr", "baseline_psnr", "flat_since", "reason"}`` (None where a value is unknown);
        ``reason`` is the one line the report prints, e.g. ``"97 % of covered pixels stuck in
        channel 0 (since iteration 10), PSNR 11.18 dB ≤ baseline 21.00 dB, flat since iteration
        10"``.
    """
    psnr, baseline = metrics.get("psnr"), metrics.get("baseline_psnr")
    if metrics.get("status") != "completed" or not is_number(psnr):
        return None
    saturation = metrics.get("saturation")
    saturation = saturation if isinstance(saturation, Mapping) else {}
    worst = _worst_channel(saturation.get("stuck_fraction"))
    stuck = worst[1] if worst else None
    below = is_number(baseline) and psnr <= baseline
    history = metrics.get("history") or []
    flat = flat_since(history, metrics.get("iterations"))
    some_stuck = stuck is not None and stuck >= STUCK_BELOW_BASELINE
    if stuck is not None and stuck >= STUCK_COLLAPSED:
        rule = "stuck"
    elif below and some_stuck:
        rule = "below baseline, stuck"
    elif below and flat is not None:
        rule = "below baseline, plateau"
    elif flat is not None and some_stuck:
        rule = "plateau, stuck"  # stopped learning above the baseline, pinned by its stuck pixels
    else:
        return None
    channel = worst[0] if worst else None
    saturated = saturation.get("saturated_fraction")
    evidence = {
        "rule": rule,
        "stuck_fraction": stuck,
        "stuck_channel": channel,
        "stuck_since": None if worst is None else _stuck_since(history, channel),
        "saturated_fraction": saturated[channel]
        if channel is not None and isinstance(saturated, list) and len(saturated) > channel
        else None,
        "psnr": psnr,
        "baseline_psnr": baseline if is_number(baseline) else None,
        "flat_since": flat,
    }
    evidence["reason"] = _reason(evidence)
    return evidence


def _reason(evidence: Mapping[str, Any]) -> str:
    parts = []
    if evidence["stuck_fraction"] is not None:
        since = evidence["stuck_since"]
        parts.append(
            f"{evidence['stuck_fraction']:.0%} of covered pixels stuck in channel "
            f"{evidence['stuck_channel']}"
            + (f" (since iteration {since})" if since is not None else "")
        )
    psnr, baseline = evidence["psnr"], evidence["baseline_psnr"]
    if baseline is None:
        parts.append(f"PSNR {psnr:.2f} dB (no baseline)")
    else:
        parts.append(f"PSNR {psnr:.2f} dB {'≤' if psnr <= baseline else '>'} baseline "
                     f"{baseline:.2f} dB")  # fmt: skip
    if evidence["flat_since"] is not None:
        parts.append(f"flat since iteration {evidence['flat_since']}")
    return ", ".join(parts)


def classify_partly_stuck(metrics: Mapping[str, Any]) -> dict[str, Any] | None:
    """Whether a completed, not collapsed run above its baseline is partly stuck, by
    :data:`PARTLY_STUCK_RULE`; the evidence if it is.

    Args:
        metrics: one run's metrics.json.

    Returns:
        None, or ``{"stuck_fraction" (the worst channel's), "stuck_channel",
        "stuck_error_fraction", "gain_db" (``-10 log10(1 - share)``: what the PSNR would gain
        with those pixels right, if every view had the same share; None at a share of 1),
        "psnr", "baseline_psnr", "reason"}``; ``reason`` is the line the report prints, e.g.
        ``"0.18 % of covered pixels stuck in channel 2 hold 97 % of the squared error (about
        +16.0 dB without them), PSNR 31.20 dB > baseline 21.00 dB"``.
    """
    psnr, baseline = metrics.get("psnr"), metrics.get("baseline_psnr")
    if metrics.get("status") != "completed" or not is_number(psnr):
        return None
    if not is_number(baseline) or psnr <= baseline or classify_collapse(metrics) is not None:
        return None
    saturation = metrics.get("saturation")
    saturation = saturation if isinstance(saturation, Mapping) else {}
    share = saturation.get("stuck_error_fraction")
    worst = _worst_channel(saturation.get("stuck_fraction"))
    if not is_number(share) or share < PARTLY_STUCK_ERROR or worst is None or worst[1] <= 0:
        return None
    gain = -10.0 * math.log10(1.0 - share) if share < 1.0 else None
    evidence = {
        "stuck_fraction": worst[1],
        "stuck_channel": worst[0],
        "stuck_error_fraction": float(share),
        "gain_db": gain,
        "psnr": psnr,
        "baseline_psnr": baseline,
    }
    without = f" (about +{gain:.1f} dB without them)" if gain is not None else ""
    evidence["reason"] = (
        f"{worst[1]:.2%} of covered pixels stuck in channel {worst[0]} hold {share:.0%} of the "
        f"squared error{without}, PSNR {psnr:.2f} dB > baseline {baseline:.2f} dB"
    )
    return evidence
