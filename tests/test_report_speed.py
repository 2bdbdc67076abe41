"""Speed in the ablation report is compared with an interval, as quality is: the per-seed ratio
of two arms' ms / iteration, its geometric mean and a Student-t interval of the mean log ratio.
The reading calls an arm faster than f32 only where that interval lies above 1, and says when
the next arm at f32's quality cannot be told apart from the fastest.

Sweeps are hand-made run directories (tests/report_runs.py). Expected intervals are computed
here from their definition, with Student t for 2 degrees of freedom in closed form:
t(q, 2) = (2q - 1) / sqrt(2 q (1 - q)), 4.3027 at q = 0.975.
"""

import json
import math

import pytest
from report_runs import metrics as _metrics
from report_runs import write_run as _write

from mptex.intervals import ratio_ci, ratio_text
from mptex.report import collect_runs, stats, summarize, write_report


def _t2(q):
    return (2 * q - 1) / math.sqrt(2 * q * (1 - q))


def _arm(root, arm, psnrs, times, first=0):
    for seed, (psnr, t) in enumerate(zip(psnrs, times, strict=True), start=first):
        _write(root, f"{arm}_{seed}", _metrics(arm, seed, psnr=psnr, t=t))


def _rows(folder, adjust="none"):
    return {r["precision"]: r for r in summarize(collect_runs(folder), adjust=adjust)}


def _report(root):
    write_report(root)
    return (root / "report.md").read_text()


def _line(text, start):
    return next((line for line in text.splitlines() if line.startswith(start)), None)


def _f32_bf16_amp(root, bf16_times, amp_times):
    """A sweep of f32 (0.30 s per iteration on every seed), bf16 and amp at f32's quality, with
    the given times; its report.md."""
    _arm(root, "f32", [40.0, 41.0, 42.0], [0.30, 0.30, 0.30])
    _arm(root, "bf16", [40.1, 41.1, 42.2], bf16_times)
    _arm(root, "amp", [40.1, 41.0, 42.1], amp_times)
    return _report(root)


def _geometric_interval(ratios, q=0.975):
    logs = [math.log(r) for r in ratios]
    n = len(logs)
    mean = sum(logs) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in logs) / (n - 1))
    half = _t2(q) * sd / math.sqrt(n)
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def test_the_speed_up_and_its_interval_are_the_per_seed_ratios_geometric_mean(tmp_path):
    # Per seed f32 / bf16: 0.30/0.10 = 3.0, 0.33/0.10 = 3.3, 0.27/0.10 = 2.7.
    _arm(tmp_path, "f32", [40.0, 41.0, 42.0], [0.30, 0.33, 0.27])
    _arm(tmp_path, "bf16", [40.1, 41.1, 42.2], [0.10, 0.10, 0.10])
    rows = _rows(tmp_path)
    speed = rows["bf16"]["speedup_ci"]
    ratio, low, high = _geometric_interval([3.0, 3.3, 2.7])
    assert speed["n"] == 3 and speed["confidence"] == 0.95
    assert speed["ratio"] == pytest.approx(ratio, rel=1e-12)  # 2.990
    assert speed["low"] == pytest.approx(low, rel=1e-12)  # 2.330
    assert speed["high"] == pytest.approx(high, rel=1e-12)  # 3.837
    # The table's speed-up stays the ratio of the mean times: 0.30 / 0.10.
    assert rows["bf16"]["speedup"] == pytest.approx(3.0)
    assert rows["f32"]["speedup_ci"] is None
    assert sorted(rows["bf16"]["seed_times"]) == [[0, 0.1], [1, 0.1], [2, 0.1]]


def test_speed_pairs_only_seeds_timed_in_both_arms(tmp_path):
    # bf16's seed 3 has no f32 run, and f32's seed 1 diverged: two pairs, seeds 0 and 2.
    _arm(tmp_path, "f32", [40.0], [0.20])
    _write(tmp_path, "f32_1", _metrics("f32", 1, t=0.9, status="diverged", diverged_at=3))
    _arm(tmp_path, "f32", [42.0], [0.40], first=2)
    _arm(tmp_path, "bf16", [40.1, 41.1, 42.1, 43.1], [0.10, 0.10, 0.10, 0.05])
    speed = _rows(tmp_path)["bf16"]["speedup_ci"]
    # Ratios 2 and 4: geometric mean sqrt(8); two logs have sd |ln 2 - ln 4| / sqrt(2), and
    # t(0.975, 1) = tan(0.475 pi) = 12.706.
    mean, sd = math.log(8.0) / 2, math.log(2.0) / math.sqrt(2)
    half = math.tan(0.475 * math.pi) * sd / math.sqrt(2)
    assert speed["n"] == 2
    assert speed["ratio"] == pytest.approx(math.sqrt(8.0), rel=1e-12)
    assert speed["low"] == pytest.approx(math.exp(mean - half), rel=1e-9)
    assert speed["high"] == pytest.approx(math.exp(mean + half), rel=1e-9)


def test_speed_intervals_follow_the_family_adjustment(tmp_path):
    # Bonferroni over the k = 2 comparisons: each interval at 97.5 %, the speed's too.
    _arm(tmp_path, "f32", [40.0, 41.0, 42.0], [0.30, 0.33, 0.27])
    _arm(tmp_path, "bf16", [40.1, 41.1, 42.2], [0.10, 0.10, 0.10])
    _arm(tmp_path, "amp", [40.1, 41.0, 42.1], [0.20, 0.20, 0.20])
    rows = _rows(tmp_path, adjust="bonferroni")
    speed = rows["bf16"]["speedup_ci"]
    assert speed["confidence"] == rows["bf16"]["confidence"] == pytest.approx(0.975)
    ratio, low, high = _geometric_interval([3.0, 3.3, 2.7], q=1 - 0.025 / 2)
    assert speed["low"] == pytest.approx(low, rel=1e-9)
    assert speed["high"] == pytest.approx(high, rel=1e-9)


def test_a_lower_mean_time_within_the_timings_spread_is_not_called_faster(tmp_path):
    # bf16 is at f32's quality (Δ +0.05, +0.05, +0.10: [-0.005, +0.138]) and its mean time is
    # lower (0.24 s against 0.25 s), but per seed f32 / bf16 is 1.5, 0.667, 1.136: an interval
    # around 1. The headline names no arm faster than f32.
    _arm(tmp_path, "f32", [40.0, 41.0, 42.0], [0.30, 0.20, 0.25])
    _arm(tmp_path, "bf16", [40.05, 41.05, 42.1], [0.20, 0.30, 0.22])
    text = _report(tmp_path)
    line = _line(text, "- Fastest arm at `f32`'s quality:")
    _, low, high = _geometric_interval([0.30 / 0.20, 0.20 / 0.30, 0.25 / 0.22])
    assert low < 1 < high
    assert line.startswith("- Fastest arm at `f32`'s quality: none measurably faster than `f32`. "
                           "`bf16` had the lowest mean time")  # fmt: skip
    assert line.endswith(f"but per seed its speed-up is 1.04x [{low:.2f}, {high:.2f}], 95% CI "
                         "over 3 seeds, not above 1.")  # fmt: skip
    assert "Not told apart by speed" not in text  # nothing was called faster
    data = json.loads((tmp_path / "results.json").read_text())
    row = next(r for r in data["summary"] if r["precision"] == "bf16")
    assert row["speedup_ci"]["low"] == pytest.approx(low, rel=1e-9)


def test_a_speed_up_whose_interval_lies_above_one_is_named_with_it(tmp_path):
    _arm(tmp_path, "f32", [40.0, 41.0, 42.0], [0.30, 0.33, 0.27])
    _arm(tmp_path, "bf16", [40.1, 41.1, 42.2], [0.10, 0.10, 0.10])
    _arm(tmp_path, "amp", [40.1, 41.0, 42.1], [0.20, 0.21, 0.19])  # measurably slower than bf16
    text = _report(tmp_path)
    line = _line(text, "- Fastest arm at `f32`'s quality:")
    ratio, low, high = _geometric_interval([3.0, 3.3, 2.7])
    assert line.startswith("- Fastest arm at `f32`'s quality: **`bf16`**")
    assert line.endswith(f"per seed {ratio:.2f}x [{low:.2f}, {high:.2f}], 95% CI over 3 seeds).")
    assert "Not told apart by speed" not in text


def test_the_next_arm_at_f32s_quality_within_the_timings_spread_is_named(tmp_path):
    # bf16 is measurably faster than f32, and fastest by its mean (0.110 s against amp's
    # 0.1117 s), but per seed amp / bf16 is 1.2, 0.833, 1.045: the two are not told apart.
    text = _f32_bf16_amp(tmp_path, [0.10, 0.12, 0.11], [0.12, 0.10, 0.115])
    assert _line(text, "- Fastest arm at `f32`'s quality:").startswith(
        "- Fastest arm at `f32`'s quality: **`bf16`**"
    )
    line = _line(text, "- Not told apart by speed:")
    ratio, low, high = _geometric_interval([0.12 / 0.10, 0.10 / 0.12, 0.115 / 0.11])
    assert low < 1 < high
    assert line == (
        "- Not told apart by speed: `bf16` and `amp` (also at `f32`'s quality): the first "
        f"over the second per seed {ratio:.2f}x [{low:.2f}, {high:.2f}], 95% CI over 3 seeds; "
        "either may be the faster."
    )


def test_f32_itself_and_an_arm_as_fast_are_not_told_apart(tmp_path):
    # f32 has the lowest mean time (0.210 s against bf16's 0.2167 s); per seed bf16 / f32 is
    # 1.05, 0.955, 1.095, an interval around 1.
    _arm(tmp_path, "f32", [40.0, 41.0, 42.0], [0.20, 0.22, 0.21])
    _arm(tmp_path, "bf16", [40.1, 41.1, 42.2], [0.21, 0.21, 0.23])
    text = _report(tmp_path)
    assert "`f32` itself" in _line(text, "- Fastest arm at `f32`'s quality:")
    line = _line(text, "- Not told apart by speed:")
    assert line is not None and line.startswith("- Not told apart by speed: `f32` and `bf16` ")


def test_ratio_text_keeps_what_the_bounds_say_about_one():
    speed = {"n": 3, "ratio": 1.0005, "low": 1.0004, "high": 1.0006, "confidence": 0.95}
    # Two decimals would print a lower bound of 1.00 for an interval that excludes 1.
    assert ratio_text(speed) == "1.0005x [1.0004, 1.0006], 95% CI over 3 seeds"
    # A lower bound under 1 may print as 1.00: the interval is not above 1 either way.
    speed = {"n": 3, "ratio": 1.2, "low": 0.9996, "high": 1.5, "confidence": 0.99}
    assert ratio_text(speed) == "1.20x [1.00, 1.50], 99% CI over 3 seeds"
    speed = {"n": 3, "ratio": 0.9995, "low": 0.9994, "high": 0.9996, "confidence": 0.95}
    assert ratio_text(speed) == "0.9995x [0.9994, 0.9996], 95% CI over 3 seeds"
    assert ratio_text({"n": 1, "ratio": 1.5234, "low": None, "high": None,
                          "confidence": 0.95}) == "1.52x, one seed: no interval"  # fmt: skip
    assert ratio_text({"n": 0, "ratio": None, "low": None, "high": None,
                          "confidence": 0.95}) == "no seed timed in both"  # fmt: skip


def test_speed_ratio_needs_no_report(tmp_path):
    # The function on its own rows: seed keys need not be integers.
    slow = {"seed_times": [["a", 2.0], ["b", 3.0]]}
    fast = {"seed_times": [["b", 1.0], ["c", 9.0], ["a", 1.0]]}
    speed = stats.speed_ratio(slow, fast)
    assert speed["n"] == 2 and speed["ratio"] == pytest.approx(math.sqrt(6.0))
    assert stats.speed_ratio(slow, {"seed_times": []})["ratio"] is None


def test_ratio_ci_refuses_a_time_that_is_not_a_positive_number():
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"^pairs: expected positive finite numbers, got "
                           r"\(.*\) at index 1$"):  # fmt: skip
            ratio_ci([(2.0, 1.0), (1.0, bad)])
    assert ratio_ci([])["ratio"] is None and ratio_ci([(3.0, 2.0)])["ratio"] == pytest.approx(1.5)


def test_the_interval_functions_name_a_bad_setting():
    from mptex.intervals import mean_ci, verdict

    for bad in (95, 0.0, 1.0, float("nan")):
        with pytest.raises(ValueError, match=r"^confidence: expected a number in \(0, 1\), got "):
            mean_ci([1.0, 2.0], confidence=bad)
        with pytest.raises(ValueError, match=r"^confidence: expected a number in \(0, 1\), got "):
            ratio_ci([(2.0, 1.0), (3.0, 1.0)], confidence=bad)
    for bad in (-1, 0, float("inf"), "0.5"):
        with pytest.raises(ValueError, match=r"^margin_db: expected a finite number > 0, got "):
            verdict({"low": -0.1, "high": 0.1}, margin_db=bad)


def test_an_arm_measurably_faster_is_named_though_another_had_a_lower_mean_time(tmp_path):
    # bf16's mean time is the lowest (0.233 s) but its seeds scatter (0.05, 0.60, 0.05: per
    # seed 6x, 0.5x, 6x, an interval around 1); amp is 1.2x f32 on every seed. amp is the
    # fastest arm shown to be faster, and bf16 is not told apart from it.
    text = _f32_bf16_amp(tmp_path, [0.05, 0.60, 0.05], [0.25, 0.25, 0.25])
    assert _line(text, "- Fastest arm at `f32`'s quality:").startswith(
        "- Fastest arm at `f32`'s quality: **`amp`**"
    )
    line = _line(text, "- Not told apart by speed:")
    assert line is not None and line.startswith("- Not told apart by speed: `amp` and `bf16` ")


def test_an_arm_faster_than_the_named_one_but_not_shown_faster_than_f32_is_not_a_tie(tmp_path):
    # f32 takes 0.30 s on 10 seeds; bf16 0.15 s on every seed but seed 1 (0.075 s): per seed
    # 2x, 4x, 2x, ..., shown faster than f32. fp8 ran seeds 0 and 1 only, at 0.06 and 0.03 s:
    # per seed 5x and 10x f32, an interval of exp((ln 5 + ln 10) / 2 ± 12.706 * 0.490 / √2) =
    # [0.09, 578], not above 1, so bf16 is the arm named. But per seed bf16 / fp8 is
    # 0.06 / 0.15 = 0.03 / 0.075 = 0.4 on both seeds: fp8 is shown faster than bf16, and the
    # reading must not call the two "not told apart".
    psnrs = [40.0 + 0.1 * (s % 3) for s in range(10)]
    _arm(tmp_path, "f32", psnrs, [0.30] * 10)
    _arm(tmp_path, "bf16", [p + 0.01 for p in psnrs], [0.15, 0.075] + [0.15] * 8)
    _arm(tmp_path, "fp8", [p + 0.01 * s for s, p in enumerate(psnrs[:2])], [0.06, 0.03])
    text = _report(tmp_path)
    assert _line(text, "- Fastest arm at `f32`'s quality:").startswith(
        "- Fastest arm at `f32`'s quality: **`bf16`**"
    )
    assert _line(text, "- Not told apart by speed:") is None
    # t(0.975, 1) = tan(0.475 π) (Cauchy); the sd of two logs is their distance over √2.
    mean, sd = (math.log(5.0) + math.log(10.0)) / 2, math.log(2.0) / math.sqrt(2.0)
    half = math.tan(0.475 * math.pi) * sd / math.sqrt(2.0)
    low, high = math.exp(mean - half), math.exp(mean + half)
    assert low < 1 < high
    assert _line(text, "- Faster per seed than `bf16`") == (
        "- Faster per seed than `bf16`, but not shown faster than `f32`: `fp8` (also at `f32`'s "
        "quality): `bf16` over `fp8` per seed 0.40x [0.40, 0.40], 95% CI over 2 seeds, while its "
        f"own speed-up over `f32` per seed is {math.sqrt(50):.2f}x [{low:.2f}, {high:.2f}], 95% "
        "CI over 2 seeds, not above 1; more seeds may make it the fastest."
    )


def test_one_timed_seed_is_not_read_as_a_speed(tmp_path):
    # Two paired seeds give bf16 its quality interval, but f32's seed 1 recorded no time: one
    # timed pair, so no interval on the speed, and bf16's lower mean time is not called faster.
    _arm(tmp_path, "f32", [40.0, 41.0], [0.30, 0.30])
    _arm(tmp_path, "bf16", [40.1, 41.1], [0.10, 0.10])
    metrics = json.loads((tmp_path / "f32_1" / "metrics.json").read_text())
    metrics["time_per_iter_s"] = None  # a run that recorded no time
    (tmp_path / "f32_1" / "metrics.json").write_text(json.dumps(metrics))
    text = _report(tmp_path)
    line = _line(text, "- Fastest arm at `f32`'s quality:")
    assert line.endswith("but its speed cannot be compared seed by seed (3.00x, one seed: no "
                         "interval)."), line  # fmt: skip
