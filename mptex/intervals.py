"""Confidence intervals and the verdicts they support: the statistics every comparison of arms
in mptex uses (the ablation report, the precision search's certification, the GPU kit).

Interval: mean of n values ± ``t_{(1+c)/2, n-1} * sd / sqrt(n)`` (Student t, two-sided, sample
standard deviation), c = 95 % by default; it needs n >= 2. Verdict, with the equivalence
margin m: ``better`` when the whole interval lies above 0, ``worse`` below 0, ``no detectable
difference`` when it lies inside [-m, +m], ``inconclusive`` otherwise, ``cannot judge``
without an interval.

Several comparisons at once (:func:`family_confidence`): each 95 % interval misses its true
mean 5 % of the time, so of k comparisons some miss more often. Bonferroni's adjustment takes
each interval at 1 - 0.05/k instead; then all k hold together with at least 95 % confidence,
whatever the dependence between them (the union bound).
"""

from __future__ import annotations

import functools
import math
import statistics
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from mptex.numbers import is_number

__all__ = [
    "EQUIVALENCE_MARGIN_DB",
    "CONFIDENCE",
    "ADJUSTMENTS",
    "VERDICTS",
    "t_quantile",
    "finite_mean",
    "mean_ci",
    "family_confidence",
    "ratio_ci",
    "faster",
    "ratio_text",
    "percent",
    "verdict",
]


# The equivalence margin: two arms closer than this are "the same quality" for a paper table.
# 0.5 dB: well above the seed-to-seed spread of f32 that the measurement protocol aims for
# (<= 0.3 dB, docs/archive/index.md) and below the 1-2 dB differences the arms are expected to
# show when precision matters.
EQUIVALENCE_MARGIN_DB = 0.5
CONFIDENCE = 0.95
# How a family of comparisons sets each interval's confidence (family_confidence).
ADJUSTMENTS = ("none", "bonferroni")
VERDICTS = (
    "better",
    "worse",
    "no detectable difference",
    "inconclusive",
    "cannot judge",
    "no paired seeds",
)


# ----------------------------------------------------------------------------- Student t
def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz's method); converges
    fast for x < (a+1)/(a+b+2)."""
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 400):
        # even step d_{2m}, then odd step d_{2m+1} of the fraction's coefficients
        for coef in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + coef * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + coef / c
            c = c if abs(c) > tiny else tiny
            result *= c * d
        if abs(c * d - 1.0) < eps:
            break
    return result


def _betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta I_x(a, b) for 0 <= x <= 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x)
                 + b * math.log1p(-x))  # fmt: skip
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    # The symmetry I_x(a, b) = 1 - I_{1-x}(b, a) keeps the fraction in its fast region.
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def _t_tail(t: float, dof: float) -> float:
    """``P(T > t)`` for ``t >= 0``, computed as itself rather than as ``1 - P(T <= t)``, which
    keeps only the digits above float64's 1e-16 far out in the tail."""
    return 0.5 * _betainc(dof / 2.0, 0.5, dof / (dof + t * t))


# Above this many degrees of freedom the quantile comes from its expansion about the normal
# quantile (_t_quantile_many_dof): the incomplete beta function's continued fraction needs
# about sqrt(dof) steps there and lgamma(dof/2 + 1/2) - lgamma(dof/2) loses its digits (the
# bisection found 90.5 for t_quantile(0.975, 1e20), scipy 1.95996).
_MANY_DOF = 1e5


def _t_quantile_many_dof(p: float, dof: float) -> float:
    """Student's t quantile for large ``dof`` from the normal quantile ``z``: Fisher's
    expansion in powers of 1/dof to the fourth (Abramowitz and Stegun 26.7.5); the first
    omitted term is below 1e-18 relative for dof >= 1e5 and |z| < 40."""
    z = statistics.NormalDist().inv_cdf(p)
    z2 = z * z
    g1 = z * (z2 + 1) / 4
    g2 = z * ((5 * z2 + 16) * z2 + 3) / 96
    g3 = z * (((3 * z2 + 19) * z2 + 17) * z2 - 15) / 384
    g4 = z * ((((79 * z2 + 776) * z2 + 1482) * z2 - 1920) * z2 - 945) / 92160
    w = 1.0 / dof  # Horner in 1/dof: dof**4 overflows beyond 1e77
    return z + w * (g1 + w * (g2 + w * (g3 + w * g4)))


# 2^500: the largest bound the quantile's search doubles to (its square, 2^1000, is finite)
_T_SEARCH_MAX = 2.0**500


# Cached: a bisection of about 40 incomplete beta functions takes about a millisecond, and the
# report asks for the same few quantiles again and again (seeds_to_settle tries up to 200 seed
# counts for each inconclusive row, and a simulated sweep repeats every one of them); typed,
# so that True is refused as a dof after 1 was asked for.
@functools.lru_cache(maxsize=4096, typed=True)
def t_quantile(p: float, dof: float) -> float:
    """Quantile of Student's t distribution: the t with ``P(T <= t) = p``.

    Algorithm: the CDF via the regularised incomplete beta function
    (``P(T > t) = I_{dof/(dof+t^2)}(dof/2, 1/2) / 2``, continued fraction), inverted by
    bisection to 1e-12 (no scipy); above 1e5 degrees of freedom, where that loses its digits,
    Fisher's expansion about the normal quantile. E.g. ``t_quantile(0.975, 2) = 4.3027``.

    Args:
        p: probability in (0, 1).
        dof: degrees of freedom > 0.

    Raises:
        ValueError: ``p`` or ``dof`` out of range, or a quantile beyond 2^500 (``dof`` below
            about 0.01: e.g. ``t_quantile(0.99, 0.01)``, about 6.7e152).
    """
    if not 0.0 < p < 1.0:
        raise ValueError(f"p: expected a probability in (0, 1), got {p!r}")
    if not (is_number(dof) and dof > 0):
        raise ValueError(f"dof: expected a finite number > 0, got {dof!r}")
    if dof > _MANY_DOF:
        return _t_quantile_many_dof(p, dof)
    # The search is on the tail probability beyond |t|, which is exact either way (1 - p is,
    # for p >= 0.5), not on p: near 0 or 1, 1 - p and 1 - CDF keep few of their digits
    # (t_quantile(1e-15, 41) was 0.16 % off).
    tail = 1.0 - p if p >= 0.5 else p
    sign = 1.0 if p >= 0.5 else -1.0
    lo, hi = 0.0, 1.0
    while _t_tail(hi, dof) > tail:
        hi *= 2.0
        if hi > _T_SEARCH_MAX:  # t^2 overflows beyond: the tail would read 0 there
            raise ValueError(f"dof: the {p!r} quantile of a t with {dof!r} degrees of freedom "
                             f"exceeds {_T_SEARCH_MAX:.3g}, beyond what this computes")  # fmt: skip
    while hi - lo > 1e-12 * max(1.0, hi):
        mid = 0.5 * (lo + hi)
        if _t_tail(mid, dof) > tail:
            lo = mid
        else:
            hi = mid
    return sign * 0.5 * (lo + hi)


def finite_mean(values: Sequence[float]) -> float:
    """The mean of finite floats, ``fsum / n`` (:func:`statistics.fmean`), or, where their sum
    overflows float64 (values near 1.8e308), the exact mean rounded once
    (:func:`statistics.mean`): the mean of finite values is finite, whatever their sum."""
    try:
        return statistics.fmean(values)
    except OverflowError:
        return float(statistics.mean(values))


def mean_ci(values: Sequence[float], confidence: float = CONFIDENCE) -> dict[str, Any]:
    """Mean and two-sided Student-t confidence interval of ``values``.

    Returns:
        ``{"n", "mean", "sd", "half_width", "low", "high"}``; ``sd`` is the sample standard
        deviation; ``half_width = t_{(1+confidence)/2, n-1} * sd / sqrt(n)``. With fewer than
        two values ``sd``, ``half_width``, ``low`` and ``high`` are None (no interval). Values
        whose spread overflows float64 on the way (differences near 1.8e308) are computed
        scaled by a power of two, which is exact: a finite ``sd``, ``half_width``, ``low`` or
        ``high`` is returned as such, and one whose true value lies beyond float64's range
        (e.g. ``high`` of values near 1.7e308) is ``inf`` (``-inf`` for ``low``).

    Raises:
        ValueError: a value is NaN or infinite (a diverged run's PSNR has no place in a mean).
    """
    if not (is_number(confidence) and 0.0 < confidence < 1.0):
        raise ValueError(f"confidence: expected a number in (0, 1), got {confidence!r}")
    values = [float(v) for v in values]
    bad = next((i for i, v in enumerate(values) if not math.isfinite(v)), None)
    if bad is not None:
        raise ValueError(f"values: expected finite numbers, got {values[bad]} at index {bad}")
    n = len(values)
    mean = finite_mean(values) if values else None
    if n < 2:
        return dict(n=n, mean=mean, sd=None, half_width=None, low=None, high=None)
    t = t_quantile(0.5 + confidence / 2.0, n - 1)
    try:
        sd = statistics.stdev(values)
        half = t * sd / math.sqrt(n)
        low, high = mean - half, mean + half
        if math.isfinite(low) and math.isfinite(high):
            return dict(n=n, mean=mean, sd=sd, half_width=half, low=low, high=high)
    except OverflowError:  # the exact variance, (1.7e308 - -1.7e308)^2 / 2, as a float
        pass
    # The same arithmetic on the values scaled below 1 by a power of two (exact both ways), so
    # that nothing overflows on the way; what is beyond float64 then is so in truth: +-inf.
    exponent = math.frexp(max(abs(v) for v in values))[1]
    scaled = [math.ldexp(v, -exponent) for v in values]
    sd_s = statistics.stdev(scaled)
    half_s = t * sd_s / math.sqrt(n)
    mean_s = math.ldexp(mean, -exponent)
    low_s, high_s = mean_s - half_s, mean_s + half_s
    sd, half, low, high = (_unscaled(v, exponent) for v in (sd_s, half_s, low_s, high_s))
    return dict(n=n, mean=mean, sd=sd, half_width=half, low=low, high=high)


def _unscaled(value: float, exponent: int) -> float:
    """``value * 2**exponent``: exact, or +-inf beyond float64's range."""
    try:
        return math.ldexp(value, exponent)
    except OverflowError:
        return math.copysign(math.inf, value)


_LOG_FLOAT_MAX = math.log(sys.float_info.max)


def ratio_ci(pairs: Sequence[Sequence[float]], confidence: float = CONFIDENCE) -> dict[str, Any]:
    """How many times ``b`` goes into ``a`` over paired measurements, with an interval: for a
    pair of times per iteration ``(slower, faster)``, the speed-up of the second.

    Algorithm: the log ratios ``ln(a / b)``, their :func:`mean_ci` at ``confidence``, and both
    exponentiated. ``ratio`` is then the geometric mean of the pairs' ratios and ``[low,
    high]`` its interval (not symmetric about it); an interval that contains 1 does not tell
    ``a`` and ``b`` apart.

    Args:
        pairs: ``[(a, b), ...]``, positive finite numbers (e.g. seconds per iteration of two
            runs of the same seed).
        confidence: two-sided, in (0, 1).

    Returns:
        ``{"n", "ratio", "low", "high", "confidence"}``; ``ratio`` None without a pair, ``low``
        and ``high`` None with fewer than two.
    """
    logs = []
    for i, pair in enumerate(pairs):
        a, b = (float(v) for v in pair)
        if not (math.isfinite(a) and math.isfinite(b) and a > 0 and b > 0):
            raise ValueError(f"pairs: expected positive finite numbers, got {tuple(pair)} at "
                             f"index {i}")  # fmt: skip
        # The difference of logs: a / b itself overflows for times far apart (1 / 1e-310).
        logs.append(math.log(a) - math.log(b))
    ci = mean_ci(logs, confidence)

    def exp(v: float | None) -> float | None:
        if v is None:
            return None
        return math.exp(v) if v < _LOG_FLOAT_MAX else math.inf  # beyond float64: infinite

    return {"n": ci["n"], "ratio": exp(ci["mean"]), "low": exp(ci["low"]),
            "high": exp(ci["high"]), "confidence": confidence}  # fmt: skip


def faster(ratio: Mapping[str, Any] | None) -> bool:
    """Whether a :func:`ratio_ci` of times ``(slower, faster)`` shows the second faster: an
    interval (two pairs or more) that lies above 1."""
    return bool(ratio) and ratio.get("low") is not None and ratio["low"] > 1.0


def ratio_text(ratio: Mapping[str, Any]) -> str:
    """A :func:`ratio_ci` as printed: ``1.52x [1.48, 1.56], 95% CI over 3 seeds``, the bounds
    with as many decimals (up to six) as it takes for them to say what the exact ones say about
    1, beyond six the shortest text that reads back as the exact bound (``1.0000001``, not
    ``1.000000`` for an interval above 1); ``1.52x, one seed: no interval``; ``no seed timed in
    both``."""
    if ratio["ratio"] is None:
        return "no seed timed in both"
    if ratio["low"] is None:
        return f"{ratio['ratio']:.2f}x, one seed: no interval"
    low, high = ratio["low"], ratio["high"]
    for digits in range(2, 7):
        text = [format(v, f".{digits}f") for v in (ratio["ratio"], low, high)]
        if (float(text[1]) > 1, float(text[2]) < 1) == (low > 1, high < 1):
            break
    else:  # six decimals round a bound onto 1: print it exactly
        text = [format(ratio["ratio"], ".6f"), repr(float(low)), repr(float(high))]
    return (f"{text[0]}x [{text[1]}, {text[2]}], {percent(ratio['confidence'])} CI over "
            f"{ratio['n']} seeds")  # fmt: skip


def family_confidence(k: int, adjust: str = "none", confidence: float = CONFIDENCE) -> float:
    """The confidence of each of ``k`` intervals so that the family has ``confidence``.

    ``adjust="none"``: ``confidence`` for each interval (each holds on its own; of k true
    differences of 0, the chance that some interval excludes 0 grows towards
    ``1 - confidence**k`` for independent ones). ``"bonferroni"``: ``1 - (1 - confidence) / k``
    for each, so that all k hold together with probability at least ``confidence`` (e.g. k = 5:
    99 % each for 95 % together). k = 0 or 1 is no family: ``confidence``.

    Args:
        k: the number of intervals in the family (>= 0).
        adjust: one of :data:`ADJUSTMENTS`.
        confidence: the family's confidence, in (0, 1).
    """
    if adjust not in ADJUSTMENTS:
        raise ValueError(f"adjust: expected one of {', '.join(ADJUSTMENTS)}, got {adjust!r}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"k: expected an integer >= 0, got {k!r}")
    if not (is_number(confidence) and 0.0 < confidence < 1.0):
        raise ValueError(f"confidence: expected a number in (0, 1), got {confidence!r}")
    if adjust == "none" or k <= 1:
        return float(confidence)
    return 1.0 - (1.0 - confidence) / k


def percent(confidence: float) -> str:
    """A confidence as a percentage, to two decimals where they tell it from 100 %: ``95%``,
    ``97.5%``, ``98.33%`` (Bonferroni's 1 - 0.05/3), ``99.995%`` (1 - 0.05/1000)."""
    for digits in range(2, 10):
        text = f"{confidence * 100:.{digits}f}"
        if float(text) < 100.0 or confidence >= 1.0:
            break
    return text.rstrip("0").rstrip(".") + "%"


def verdict(ci: Mapping[str, Any], margin_db: float = EQUIVALENCE_MARGIN_DB) -> str:
    """The statement an interval supports (the module docstring's rule); one of
    :data:`VERDICTS`."""
    if not (is_number(margin_db) and margin_db > 0):
        raise ValueError(f"margin_db: expected a finite number > 0, got {margin_db!r}")
    low, high = ci.get("low"), ci.get("high")
    if low is None or high is None:
        return "cannot judge"
    if low > 0:
        return "better"
    if high < 0:
        return "worse"
    if -margin_db <= low and high <= margin_db:
        return "no detectable difference"
    return "inconclusive"
