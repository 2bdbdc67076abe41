"""The statistics behind the report and the training loop at their edges, against independent
references: scipy's Student t, hand-computed values, per-element and float64 brute force."""

import math
import random
import re
from fractions import Fraction

import numpy as np
import pytest
import scipy.stats
import torch

from mptex.collapse import classify_collapse, classify_partly_stuck, flat_since
from mptex.diagnostics import saturation_statistics
from mptex.intervals import (
    family_confidence,
    faster,
    finite_mean,
    mean_ci,
    percent,
    ratio_ci,
    ratio_text,
    t_quantile,
    verdict,
)
from mptex.numbers import as_int, is_number
from mptex.report import stats as report_stats
from mptex.train import image_loss, lr_schedule
from mptex.train.rng import rng_state, seed_everything, set_rng_state

# t(0.975, 9) by a 50-digit mpmath inversion of the incomplete beta function; scipy 1.17.1's
# t.ppf agrees to the last bit, scipy 1.15.3's (the last for Python 3.10) is 2.5e-11 off.
_T_975_9 = 2.2621571627982055


# ----------------------------------------------------------------------------- Student t
@pytest.mark.parametrize("dof", [1, 2, 3, 7, 30, 1000, 1e5])
@pytest.mark.parametrize("p", [0.4, 0.45, 0.6, 0.9, 0.975, 0.9995, 0.999975])
def test_t_quantile_matches_scipy_over_probabilities_and_degrees_of_freedom(p, dof):
    # Both sides of the median (0.4 and 0.45 are negative quantiles), and the far tails that
    # Bonferroni's adjustment reaches (1 - 0.05 / 2000 / 2). The incomplete beta converges to
    # 1e-15 and the bisection stops at 1e-12 relative: 1e-9 leaves room for both.
    assert t_quantile(p, dof) == pytest.approx(scipy.stats.t.ppf(p, dof), rel=1e-9, abs=1e-12)


def test_a_cached_quantile_still_refuses_a_bool_dof():
    # t_quantile caches its values; True == 1 and hash(True) == hash(1), so an untyped cache
    # would hand 1's quantile to a dof of True instead of refusing it.
    assert t_quantile(0.975, 1) == pytest.approx(12.7062, abs=1e-4)
    with pytest.raises(ValueError, match=r"^dof: expected a finite number > 0, got True$"):
        t_quantile(0.975, True)


def test_a_probability_of_zero_is_refused_as_itself():
    # p = 0 has no quantile; the message names the value given, not its mirror image 1.
    with pytest.raises(ValueError, match=r"^p: expected a probability in \(0, 1\), got 0\.0$"):
        t_quantile(0.0, 3)


# ----------------------------------------------------------------------------- intervals
@pytest.mark.parametrize("confidence", [0.8, 0.95, 0.99])
@pytest.mark.parametrize(
    "values", [[3.0, 5.0], [0.25, -1.5, 2.0, 0.75], [10.0, 10.5, 9.25, 11.0, 10.0, 9.5, 12.0]]
)
def test_mean_ci_is_scipys_student_interval(values, confidence):
    # scipy: t.interval(c, n - 1, loc=mean, scale=sem), sem = sd(ddof=1) / sqrt(n) (numpy);
    # float64 throughout and a quantile good to 1e-12: 1e-10 relative.
    n = len(values)
    mean, sd = float(np.mean(values)), float(np.std(values, ddof=1))
    low, high = scipy.stats.t.interval(confidence, n - 1, loc=mean, scale=sd / math.sqrt(n))
    ci = mean_ci(values, confidence)
    assert ci["n"] == n
    assert ci["mean"] == pytest.approx(mean, rel=1e-12)
    assert ci["sd"] == pytest.approx(sd, rel=1e-12)
    assert ci["low"] == pytest.approx(low, rel=1e-10)
    assert ci["high"] == pytest.approx(high, rel=1e-10)
    assert ci["half_width"] == pytest.approx((high - low) / 2, rel=1e-10)


def test_the_mean_of_values_whose_sum_overflows_is_their_exact_mean():
    # 1.5e308 + 1.2e308 + 1.7e308 is beyond float64's 1.8e308, but the mean is not: the exact
    # rational mean (Fraction arithmetic) rounded once to a float.
    values = [1.5e308, 1.2e308, 1.7e308]
    exact = float(sum(map(Fraction, values)) / 3)
    assert finite_mean(values) == exact
    assert report_stats._mean([*values, None]) == exact  # the report's row means, too
    ci = mean_ci(values)
    assert ci["mean"] == exact and ci["n"] == 3
    # sd: numpy's on the values scaled by 2^-1000 (exact: a power of two), scaled back; a few
    # float64 roundings in numpy's sum of squares: 1e-14.
    scaled = np.std(np.array(values) / 2.0**1000, ddof=1) * 2.0**1000
    assert ci["sd"] == pytest.approx(scaled, rel=1e-14)


@pytest.mark.parametrize("values", [
    [1.7e308, -1.7e308] * 50,  # differences of 3.4e308: sd 1.7e308, half width 3.4e307
    [1.7e308, -1.6e308, 1.5e308, -1.7e308, 0.0, 1e-300],
    [-1.7e308, -1.75e308, 1.2e308, -1.79e308, 1.6e308] * 3,
])  # fmt: skip
def test_values_whose_differences_overflow_get_their_finite_interval(values):
    # The variance (or t * sd) of such values is beyond float64, their interval is not.
    # Reference: scipy's t interval of the values scaled by 2^-1024 (exact: a power of two),
    # scaled back; numpy's and scipy's float64 sums of squares differ from the exact variance
    # by a few roundings: 1e-13.
    n, scale = len(values), 2.0**-1024
    scaled = np.array(values) * scale
    low, high = scipy.stats.t.interval(0.95, n - 1, loc=finite_mean(values) * scale,
                                       scale=scipy.stats.sem(scaled))  # fmt: skip
    ci = mean_ci(values)
    assert ci["sd"] == pytest.approx(np.std(scaled, ddof=1) / scale, rel=1e-13)
    assert ci["half_width"] == pytest.approx((high - low) / 2 / scale, rel=1e-9)
    assert ci["low"] == pytest.approx(low / scale, rel=1e-9)
    assert ci["high"] == pytest.approx(high / scale, rel=1e-9)
    assert all(math.isfinite(ci[k]) for k in ("sd", "half_width", "low", "high"))


def test_an_interval_beyond_float64_has_infinite_bounds():
    # [1.7e308, -1.7e308]: sd 2.4e308, beyond float64, and so is the interval (12.7 sd / 1.41
    # each side): infinite, not an OverflowError. [1.7e308, 1.6e308]: a finite sd and low end
    # (scipy's, on the values scaled by 2^-1024), but its high end, 2.3e308, is beyond.
    assert mean_ci([1.7e308, -1.7e308]) == dict(n=2, mean=0.0, sd=math.inf,
                                                half_width=math.inf, low=-math.inf,
                                                high=math.inf)  # fmt: skip
    ci = mean_ci([1.7e308, 1.6e308])
    scale = 2.0**-1024
    scaled = np.array([1.7e308, 1.6e308]) * scale
    low, high = scipy.stats.t.interval(0.95, 1, loc=scaled.mean(), scale=scipy.stats.sem(scaled))
    assert ci["low"] == pytest.approx(low / scale, rel=1e-9)
    assert float(high) / scale == math.inf and ci["high"] == math.inf
    assert math.isfinite(ci["sd"]) and math.isfinite(ci["half_width"])


def test_values_whose_largest_magnitude_is_negative_get_their_finite_interval():
    # [-1.7e308, 0] x 5: t * sd (2.26 * 0.9e308) overflows, the interval does not; the value of
    # largest magnitude is negative (the scaling must come from |v|, not from the largest, 0).
    # By hand: mean -0.85e308 (exact), each deviation +-0.85e308, so sd = 0.85e308 *
    # sqrt(10/9); half width t(0.975, 9) * (sd / sqrt(10)) (t: _T_975_9; t_quantile's
    # bisection stops within 1e-12 of it, so the half width and bounds to 1e-11; the sd to a
    # few roundings).
    values = [-1.7e308, 0.0] * 5
    sd = 0.85e308 * math.sqrt(10 / 9)
    half = _T_975_9 * (sd / math.sqrt(10))
    ci = mean_ci(values)
    assert ci["mean"] == -0.85e308
    assert ci["sd"] == pytest.approx(sd, rel=1e-14)
    assert ci["half_width"] == pytest.approx(half, rel=1e-11)
    assert ci["low"] == pytest.approx(-0.85e308 - half, rel=1e-11)
    assert ci["high"] == pytest.approx(-0.85e308 + half, rel=1e-11)


@pytest.mark.parametrize("dof", [1.5e5, 3e5])
@pytest.mark.parametrize("p", [1e-20, 1e-10, 0.975, 1.0 - 2.0**-40])
def test_t_quantile_just_above_its_expansion_threshold_matches_scipy_in_both_tails(p, dof):
    # Above 1e5 degrees of freedom the quantile comes from the expansion about the normal
    # quantile; its 1/dof^2 term is about 4e-11 relative here at p = 1e-20, and p = 1e-20 has
    # no float64 complement (1 - p == 1). scipy agrees with a 40-digit mpmath inversion of the
    # incomplete beta function to 3e-16 at these points, and so does t_quantile: 1e-14.
    assert t_quantile(p, dof) == pytest.approx(scipy.stats.t.ppf(p, dof), rel=1e-14)


@pytest.mark.parametrize(
    ("p", "reference"),
    [(1e-15, -8.070151264738689),  # scipy's t.ppf (1.15.3 and 1.17.1 alike)
     (1.0 - 2.0**-40, 7.1378578322607968)],  # 50-digit mpmath (scipy 1.15.3: 7.137857832420)
)  # fmt: skip
def test_t_quantile_below_its_expansion_threshold_is_the_bisections_far_in_either_tail(
    p, reference
):
    # At 1001 degrees of freedom the expansion about the normal quantile would be 9e-11 off
    # at p = 1e-15 (its first omitted term grows with |z|^11 / dof^5); the bisection on the
    # incomplete beta function is good to its 1e-12 stopping width, which bounds the
    # tolerance.
    assert t_quantile(p, 1001.0) == pytest.approx(reference, rel=1e-11)


def test_two_values_are_enough_for_an_interval():
    # [3, 5]: mean 4, sd sqrt(2), t(0.975, 1) = 12.7062 -> 4 ± 12.7062 * sqrt(2) / sqrt(2)
    ci = mean_ci([3.0, 5.0])
    assert ci["half_width"] == pytest.approx(12.7062, abs=1e-4)
    assert mean_ci([]) == dict(n=0, mean=None, sd=None, half_width=None, low=None, high=None)


def test_a_confidence_of_one_is_refused():
    with pytest.raises(ValueError, match=r"^confidence: expected a number in \(0, 1\), got 1$"):
        mean_ci([1.0, 2.0], confidence=1)


@pytest.mark.parametrize(
    "ci, expected",
    [
        ({"low": 0.0, "high": 0.3}, "no detectable difference"),  # touches 0: not above it
        ({"low": -0.3, "high": 0.0}, "no detectable difference"),  # touches 0: not below it
        ({"low": 0.0, "high": 0.7}, "inconclusive"),
        ({"low": 0.1, "high": None}, "cannot judge"),  # half an interval is none
        ({"low": None, "high": -0.1}, "cannot judge"),
        ({}, "cannot judge"),
    ],
)
def test_verdict_at_zero_and_without_both_ends(ci, expected):
    assert verdict(ci, margin_db=0.5) == expected


# ----------------------------------------------------------------------------- speed ratios
def test_ratio_ci_is_the_geometric_mean_of_slower_over_faster():
    # ln(2 / 1) and ln(8 / 1): mean ln 4 -> ratio 4 (the second of each pair is faster).
    # sd of the logs: |ln 8 - ln 2| / sqrt(2) = 2 ln 2 / sqrt(2); t(0.975, 1) = 12.7062:
    # half width 12.7062 * ln 2 * sqrt(2) / sqrt(2) = 12.7062 * ln 2 = 8.8073.
    got = ratio_ci([(2.0, 1.0), (8.0, 1.0)])
    assert got["n"] == 2 and got["ratio"] == pytest.approx(4.0, rel=1e-12)
    assert got["low"] == pytest.approx(4.0 * math.exp(-8.8073), rel=1e-4)
    assert got["high"] == pytest.approx(4.0 * math.exp(8.8073), rel=1e-4)
    assert got["confidence"] == 0.95


@pytest.mark.parametrize("pair", [(1.0, 0.0), (0.0, 1.0)])
def test_ratio_ci_refuses_a_zero_time_on_either_side(pair):
    with pytest.raises(ValueError, match=r"^pairs: expected positive finite numbers, got .* at "
                       r"index 0$"):  # fmt: skip
        ratio_ci([pair, (2.0, 1.0)])


@pytest.mark.parametrize(
    "ratio, expected",
    [
        (None, False),
        ({}, False),
        ({"n": 1, "ratio": 3.0, "low": None, "high": None}, False),  # one seed: no interval
        ({"n": 3, "ratio": 1.2, "low": 1.0, "high": 1.4}, False),  # touches 1: not shown
        ({"n": 3, "ratio": 1.2, "low": 1.0 + 1e-12, "high": 1.4}, True),
        ({"n": 3, "ratio": 0.5, "low": 0.4, "high": 0.6}, False),
    ],
)
def test_faster_needs_an_interval_wholly_above_one(ratio, expected):
    assert faster(ratio) is expected


def test_ratio_text_uses_as_many_digits_as_the_bounds_need_up_to_six():
    # A lower bound 1 + 4e-6 needs six decimals to print above 1 (1.000004); five would show
    # 1.00000.
    speed = {"n": 4, "ratio": 1.00001, "low": 1.000004, "high": 1.00002, "confidence": 0.95}
    assert ratio_text(speed) == "1.000010x [1.000004, 1.000020], 95% CI over 4 seeds"


@pytest.mark.parametrize(
    "low, high, expected",
    [
        # 1 + 1e-7 is above 1 (faster() holds), but six decimals print it as 1.000000.
        (1.0000001, 1.02, "1.010000x [1.0000001, 1.02], 95% CI over 3 seeds"),
        # 1 - 1e-7 is below 1: at six decimals it would print 1.000000 as well.
        (0.98, 0.9999999, "0.990000x [0.98, 0.9999999], 95% CI over 3 seeds"),
    ],
)
def test_ratio_text_prints_a_bound_within_a_millionth_of_one_exactly(low, high, expected):
    ratio = 1.01 if low > 1 else 0.99
    speed = {"n": 3, "ratio": ratio, "low": low, "high": high, "confidence": 0.95}
    text = ratio_text(speed)
    assert text == expected
    printed = [float(v) for v in re.search(r"\[(\S+), (\S+)\]", text).groups()]
    assert (printed[0] > 1, printed[1] < 1) == (low > 1, high < 1)


# ----------------------------------------------------------------------------- families
@pytest.mark.parametrize("confidence", [0.1, 0.3, 0.95])
def test_one_interval_is_no_family_and_keeps_its_confidence_exactly(confidence):
    # k = 1 is no family: the confidence as given, not 1 - (1 - c) / 1, which for c < 0.5 is
    # c to within one rounding only (1 - 0.1 rounds, so 1 - (1 - 0.1) is 0.09999999999999998).
    assert family_confidence(1, "bonferroni", confidence) == confidence
    assert family_confidence(0, "bonferroni", confidence) == confidence


@pytest.mark.parametrize(
    "confidence, text",
    [
        (0.95, "95%"),
        (0.975, "97.5%"),
        (1 - 0.05 / 3, "98.33%"),
        # 99.9999 rounds to 100.00 at two decimals: more digits until it reads below 100.
        (0.999999, "99.9999%"),
        (1 - 0.05 / 1000, "99.995%"),
    ],
)
def test_percent_never_rounds_a_confidence_below_one_to_100(confidence, text):
    assert percent(confidence) == text


# ----------------------------------------------------------------------------- collapse
def _history(*points):
    """metrics.json history entries from (iteration, psnr[, stuck fraction per channel])."""
    return [{"iteration": p[0], "psnr": p[1], **({"stuck_fraction": p[2]} if len(p) > 2 else {})}
            for p in points]  # fmt: skip


def _metrics(psnr, baseline, history, stuck=None, iterations=300, **saturation):
    sat = {"stuck_fraction": stuck, **saturation} if stuck is not None else saturation
    return {"status": "completed", "psnr": psnr, "baseline_psnr": baseline,
            "iterations": iterations, "history": history, "saturation": sat}  # fmt: skip


def test_a_plateaus_spread_is_over_all_its_validations_not_each_against_the_last():
    # 19.85, 20.15, 20.0: each within 0.2 dB of the last one (0.15, 0.15), but together they
    # spread 0.3 dB: the flat stretch is only the last two, too short to count.
    history = _history((100, 19.85), (200, 20.15), (300, 20.0))
    assert flat_since(history, 300) is None


def test_two_flat_validations_are_no_plateau_however_long_they_span():
    # The last two (150 and 300) are flat and span half the run; a third is needed.
    history = _history((100, 10.0), (150, 20.0), (300, 20.0))
    assert flat_since(history, 300) is None
    assert flat_since(_history((100, 20.0), (150, 20.0), (300, 20.0)), 300) == 100


def test_a_run_is_never_shorter_than_its_last_validation():
    # Flat from 700 to 1000: 300 iterations, under half of the 1000 the history shows, though
    # over half of a recorded length of 500.
    history = _history((700, 20.0), (800, 20.0), (1000, 20.0))
    assert flat_since(history, 500) is None
    assert flat_since(history, 600) is None


def test_validations_are_read_in_iteration_order_and_training_entries_are_skipped():
    # Entries without a PSNR (training iterations) and an unsorted history: the flat stretch is
    # 100-300 by iteration, whatever the order written.
    history = _history((300, 20.0), (100, 20.05), (200, 20.1))
    history.insert(1, {"iteration": 150, "psnr": None, "loss": 0.1})
    history.append({"iteration": 50, "psnr": 12.0})
    assert flat_since(history, 300) == 100


def test_a_stuck_stretch_at_exactly_a_tenth_counts_from_its_start():
    # At least STUCK_BELOW_BASELINE (0.1) in channel 2 from iteration 200 on.
    history = _history(
        (100, 15.0, [0, 0, 0.05]), (200, 16.0, [0, 0, 0.1]), (300, 17.0, [0, 0, 0.1])
    )
    got = classify_collapse(_metrics(17.0, 20.0, history, stuck=[0.0, 0.0, 0.1]))
    assert got["rule"] == "below baseline, stuck" and got["stuck_since"] == 200


def test_a_history_entry_with_fewer_channels_is_not_stuck_in_the_missing_one():
    # Channel 2 is the worst at the end; an older entry recorded two channels only.
    history = _history((100, 15.0, [0.0, 0.3]), (200, 16.0, [0, 0, 0.3]), (300, 17.0, [0, 0, 0.3]))
    got = classify_collapse(_metrics(17.0, 20.0, history, stuck=[0.0, 0.0, 0.3],
                                     saturated_fraction=[0.9]))  # fmt: skip
    assert got["stuck_channel"] == 2 and got["stuck_since"] == 200
    assert got["saturated_fraction"] is None  # no value recorded for channel 2


def test_the_reason_omits_a_since_when_the_last_validation_was_not_stuck():
    # Stuck at the end (the final saturation) but not at the last validation of the history:
    # no "since" to name.
    history = _history((100, 15.0, [0, 0, 0.6]), (200, 16.0, [0, 0, 0.6]), (300, 17.0, [0, 0, 0]))
    got = classify_collapse(_metrics(17.0, 20.0, history, stuck=[0.0, 0.0, 0.6]))
    assert got["rule"] == "stuck" and got["stuck_since"] is None
    assert got["reason"] == ("60% of covered pixels stuck in channel 2, PSNR 17.00 dB ≤ baseline "
                             "20.00 dB")  # fmt: skip


def test_a_plateau_from_iteration_zero_is_named():
    # Flat from the first validation, at iteration 0: 0 is an iteration like any other.
    history = _history((0, 20.0), (100, 20.05), (200, 20.1))
    got = classify_collapse(_metrics(20.1, 21.0, history, iterations=200))
    assert got["rule"] == "below baseline, plateau" and got["flat_since"] == 0
    assert got["reason"] == "PSNR 20.10 dB ≤ baseline 21.00 dB, flat since iteration 0"


@pytest.mark.parametrize("baseline", [None, math.nan, "21.0"])
def test_a_baseline_that_is_no_number_is_reported_as_none(baseline):
    got = classify_collapse(_metrics(17.0, baseline, [], stuck=[0.0, 0.0, 0.6]))
    assert got["rule"] == "stuck" and got["baseline_psnr"] is None
    assert got["reason"] == ("60% of covered pixels stuck in channel 2, PSNR 17.00 dB (no "
                             "baseline)")  # fmt: skip


def _partly(share, stuck=(0.0, 0.0, 0.002), status="completed"):
    history = _history((100, 10.0), (200, 20.0), (300, 30.0))  # learning: no plateau
    m = _metrics(30.0, 20.0, history, stuck=list(stuck), stuck_error_fraction=share)
    return {**m, "status": status}


def test_partly_stuck_with_all_of_the_error_has_no_gain_to_state():
    # share 1: -10 log10(0) has no value; the reason says nothing about a gain.
    got = classify_partly_stuck(_partly(1.0))
    assert got["gain_db"] is None and got["stuck_error_fraction"] == 1.0
    assert got["reason"] == ("0.20% of covered pixels stuck in channel 2 hold 100% of the squared "
                             "error, PSNR 30.00 dB > baseline 20.00 dB")  # fmt: skip


def test_partly_stuck_needs_a_stuck_pixel_and_a_completed_run():
    # A share of the error without any stuck pixel is no finding; nor is a diverged run.
    assert classify_partly_stuck(_partly(0.9, stuck=(0.0, 0.0, 0.0))) is None
    assert classify_partly_stuck(_partly(0.9, status="diverged")) is None
    assert classify_partly_stuck(_partly(0.9))["stuck_error_fraction"] == 0.9


def test_a_collapsed_run_is_not_also_partly_stuck():
    # Above the baseline but half its pixels stuck: a collapse, so not "partly".
    m = _partly(0.9, stuck=(0.0, 0.0, 0.5))
    assert classify_collapse(m)["rule"] == "stuck"
    assert classify_partly_stuck(m) is None


# ----------------------------------------------------------------------------- saturation
def _srgb64(v: float) -> float:
    """sRGB of a linear value in float64, clamped to [0, 1] afterwards (what the PSNR sees)."""
    s = v * 12.92 if v <= 0.0031308 else 1.055 * abs(v) ** (1 / 2.4) - 0.055
    return min(1.0, max(0.0, s))


def test_a_logit_of_exactly_the_threshold_is_not_saturated():
    # |z| > 8 saturates; 8 itself and -8 do not (values exact in float32).
    logits = torch.tensor([[8.0, -8.0], [8.0, 9.0], [-8.0001, -8.0], [0.0, 8.0]])
    values = torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    reference = torch.ones(4, 2)  # every value 1.0 wrong
    got = saturation_statistics(logits, values, reference)
    # saturated: channel 0 only row 2; channel 1 only row 1
    assert got["saturated_fraction"] == [1 / 4, 1 / 4]
    assert got["stuck_fraction"] == [1 / 4, 1 / 4]


def test_a_value_exactly_the_tolerance_from_its_reference_is_not_wrong():
    # |0.875 - 0.75| = 0.125 = tolerance (exact binary fractions): not wrong;
    # |0.875 - 0.7421875| = 0.1328125 > 0.125: wrong.
    logits = torch.full((2, 1), 20.0)
    values = torch.tensor([[0.875], [0.875]])
    reference = torch.tensor([[0.75], [0.7421875]])
    got = saturation_statistics(logits, values, reference, tolerance=0.125)
    assert got["stuck_fraction"] == [1 / 2] and got["stuck_tolerance"] == 0.125


def test_every_channel_may_have_a_reference():
    # K = C = 3: every channel has a stuck fraction (no None).
    logits = torch.tensor([[9.0, 9.0, 9.0], [0.0, 0.0, 0.0]])
    values = torch.tensor([[1.0, 1.0, 1.0], [0.5, 0.5, 0.5]])
    reference = torch.tensor([[0.0, 1.0, 0.5], [0.5, 0.5, 0.5]])
    got = saturation_statistics(logits, values, reference)
    assert got["stuck_fraction"] == [1 / 2, 0.0, 1 / 2]


def test_no_covered_pixel_gives_zero_fractions():
    empty = torch.zeros(0, 3)
    got = saturation_statistics(empty, empty, empty, torch.zeros(0, dtype=torch.bool))
    assert got["saturated_fraction"] == [0.0, 0.0, 0.0]
    assert got["stuck_fraction"] == [0.0, 0.0, 0.0]
    assert got["stuck_error_fraction"] == 0.0 and got["covered_pixels"] == 0


def test_without_any_error_the_stuck_share_is_zero():
    # Stuck pixels (linear values 0.3 from the reference) that the PSNR cannot see: both above
    # 1, so sRGB clamped to [0, 1] puts both at 1. Zero error in all: share 0.0, not None.
    logits = torch.tensor([[20.0], [0.0]])
    values = torch.tensor([[1.5], [0.5]])
    reference = torch.tensor([[1.2], [0.5]])
    got = saturation_statistics(logits, values, reference)
    assert got["stuck_fraction"] == [1 / 2] and got["stuck_error_fraction"] == 0.0


def test_the_stuck_share_of_the_error_is_measured_clamped_like_the_psnr():
    # Row 0 stuck at 1.5 against 0.5 (clamped sRGB: 1 against sRGB(0.5)); row 1 not saturated,
    # 0.2 against 0.4. Unclamped, row 0's error would be larger than the PSNR sees.
    logits = torch.tensor([[20.0], [0.0]])
    values = torch.tensor([[1.5], [0.2]])
    reference = torch.tensor([[0.5], [0.4]])
    stuck = (_srgb64(1.5) - _srgb64(0.5)) ** 2
    other = (_srgb64(0.2) - _srgb64(0.4)) ** 2
    got = saturation_statistics(logits, values, reference)
    # float32 sRGB of each value (a few ulp of 1e-7) in squared differences of ~0.1: 1e-5.
    assert got["stuck_error_fraction"] == pytest.approx(stuck / (stuck + other), rel=1e-5)


# ----------------------------------------------------------------------------- losses
def test_the_cosine_schedule_needs_the_runs_length():
    with pytest.raises(ValueError, match=r"^iterations: the cosine schedule needs"):
        lr_schedule(5, kind="cosine")


def test_the_cosine_schedule_stays_at_zero_past_the_end():
    # progress is capped at 1: 0.5 * (1 + cos(pi)) = 0, not cos's way back up (0.5 at 1.5).
    assert lr_schedule(300, kind="cosine", iterations=200) == 0.0
    assert lr_schedule(210, 10, kind="cosine", iterations=110) == 0.0


def test_a_run_no_longer_than_its_warmup_has_a_cosine_rate():
    # iterations == warmup_iter: no division by zero; (10 - 10) / max(1, 0) = 0 -> rate 1.
    assert lr_schedule(10, 10, kind="cosine", iterations=10) == 1.0
    assert lr_schedule(11, 10, kind="cosine", iterations=10) == 0.0


def _log_srgb64(v: float) -> float:
    """nvdiffrec's log tonemap in float64: the sRGB curve (unclamped) of ln(clamp(v) + 1)."""
    f = math.log(min(max(v, 0.0), 65535.0) + 1.0)
    return 1.055 * f ** (1 / 2.4) - 0.055 if f > 0.0031308 else 12.92 * f


@pytest.mark.parametrize(
    "a, b",
    [
        (0.001, 0.0),  # ln(1.001) = 0.0009995 < 0.0031308: the linear segment, 12.92 x
        (-0.5, 0.0),  # negative light counts as 0
        (1e6, 65535.0),  # beyond 65535 counts as 65535
        (3.0, 0.002),
    ],
)
def test_logl1_is_the_float64_tonemap_of_each_pixel(a, b):
    img, target = torch.full((1, 2, 2, 3), a), torch.full((1, 2, 2, 3), b)
    want = abs(_log_srgb64(a) - _log_srgb64(b))
    # float32: v + 1 rounds by up to half an ulp of 1 (6e-8) before the log, 12.92x that on
    # the linear segment (8e-7 absolute); log and pow of values up to ln(65536) = 11.1 within
    # a few ulp (relative 1e-6).
    assert image_loss(img, target, "logl1").item() == pytest.approx(want, rel=1e-6, abs=1e-6)


def test_logl1_has_finite_gradients_at_black():
    # A black pixel sits on the linear segment; the curve's other branch (a power with an
    # infinite slope at 0) must not leak a NaN into the gradient.
    img = torch.zeros(1, 2, 2, 3, requires_grad=True)
    image_loss(img, torch.full((1, 2, 2, 3), 0.5), "logl1").backward()
    assert torch.isfinite(img.grad).all()


def test_smape_divides_by_the_magnitudes():
    # |-0.5 - 0.25| / (|-0.5| + |0.25| + 0.01) = 0.75 / 0.76
    img, target = torch.full((1, 1, 1, 3), -0.5), torch.full((1, 1, 1, 3), 0.25)
    assert image_loss(img, target, "smape").item() == pytest.approx(0.75 / 0.76, rel=1e-6)


def test_an_unknown_loss_is_named():
    with pytest.raises(ValueError, match=r"^train\.loss: expected one of .*, got 'l3'$"):
        image_loss(torch.zeros(1, 3), torch.zeros(1, 3), "l3")


# ----------------------------------------------------------------------------- numbers
@pytest.mark.parametrize(
    "value, expected",
    [(3, True), (-2.5, True), (0.0, True), (True, False), (False, False), (math.inf, False),
     (-math.inf, False), (math.nan, False), ("1", False), (None, False)],
)  # fmt: skip
def test_is_number_is_a_finite_int_or_float_and_not_a_bool(value, expected):
    assert is_number(value) is expected


@pytest.mark.parametrize(
    "value, expected",
    [(3, 3), (np.int64(7), 7), (np.uint8(255), 255), (True, None), (False, None), (3.0, None),
     ("3", None), (None, None)],
)  # fmt: skip
def test_as_int_takes_integers_only(value, expected):
    got = as_int(value)
    assert got == expected and (got is None or type(got) is int)


# ----------------------------------------------------------------------------- generators
@pytest.fixture
def global_generators():
    """Leaves Python's, NumPy's and torch's global generators as the test found them."""
    saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
    yield
    random.setstate(saved[0])
    np.random.set_state(saved[1])
    torch.set_rng_state(saved[2])


@pytest.mark.parametrize("seed", [5, 2**31 + 7, 2**32 + 7])
def test_seed_everything_seeds_each_generator_as_its_own_seed_would(seed, global_generators):
    # NumPy's seed is taken mod 2**32: 2**31 + 7 stays itself, 2**32 + 7 becomes 7.
    seed_everything(seed)
    got = random.random(), np.random.random(), torch.rand(2)
    want_numpy = np.random.RandomState(seed % 2**32).random_sample()
    assert got[0] == random.Random(seed).random()
    assert got[1] == want_numpy
    assert torch.equal(got[2], torch.rand(2, generator=torch.Generator().manual_seed(seed)))


def test_restored_state_repeats_every_generators_draws(global_generators):
    gen = torch.Generator().manual_seed(11)
    seed_everything(3)
    saved = rng_state({"views": gen})
    first = random.random(), np.random.random(), torch.rand(1).item(), torch.rand(1, generator=gen)
    seed_everything(99)
    gen.manual_seed(99)
    set_rng_state(saved, {"views": gen})
    again = random.random(), np.random.random(), torch.rand(1).item(), torch.rand(1, generator=gen)
    assert first[:3] == again[:3] and torch.equal(first[3], again[3])


def test_a_run_stuck_since_iteration_zero_says_so():
    # A run whose every validation, the first at iteration 0, is stuck: the evidence's
    # stuck_since is 0, and the reason names it like any other iteration.
    history = _history((0, 15.0, [0, 0, 0.6]), (100, 16.0, [0, 0, 0.6]), (200, 17.0, [0, 0, 0.6]))
    got = classify_collapse(_metrics(17.0, 20.0, history, stuck=[0.0, 0.0, 0.6], iterations=200))
    assert got["rule"] == "stuck" and got["stuck_since"] == 0
    assert got["reason"].startswith("60% of covered pixels stuck in channel 2 (since iteration 0)")


def test_t_quantile_beyond_its_search_says_so_instead_of_a_wrong_number():
    # With 0.01 degrees of freedom the 0.975 quantile is about 6.4e128, within the search's
    # 2^500 (3.3e150); the 0.99 one is about 6.7e152, beyond it, where t^2 would overflow and
    # the CDF read 1: an error naming dof, not a number that is no quantile.
    # Reference: a 50-digit mpmath inversion (scipy 1.17.1 agrees to 1e-13; scipy 1.15.3, the
    # last for Python 3.10, returns 1e100, its t.ppf's cap).
    assert t_quantile(0.975, 0.01) == pytest.approx(6.3641819284006163e128, rel=1e-9)
    with pytest.raises(ValueError, match=r"^dof: the 0\.99 quantile .* exceeds 3\.27e\+150"):
        t_quantile(0.99, 0.01)
