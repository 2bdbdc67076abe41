"""The ablation report's writers on small hand-made inputs: the row statistics (effective loss
scale, Adam's epsilon on the grid, pairing, seeds to settle, speed ratios), report.md's cells and
reading, results.tex, results.json / results.csv, the sweep-folder guard, the comparison of two
results.json and the plots' numbers.

References: hand-computed values (the arithmetic in the comments), the defining formulas
written out again here (Student t from scipy, brute-force loops over pixels and windows), and
exact strings where a value is printed.
"""

import json
import math
import re

import numpy as np
import pytest
import scipy.stats
from report_runs import metrics as _metrics
from report_runs import write_run as _write

from mptex.report import (
    collect,
    collect_runs,
    markdown,
    result_differences,
    stats,
    summarize,
    write_report,
)
from mptex.report.latex import render_latex
from mptex.report.markdown import delta_cell, interval_text, runs_at_once, verdict_text
from mptex.report.plots import _detail_window, arm_color, error_gain, image_panels


def _by_arm(folder, **kwargs):
    return {r["precision"]: r for r in summarize(collect_runs(folder), **kwargs)}


def _tables(folder, margin=0.5, adjust="none"):
    """The runs under ``folder``, their groups and rows, as write_report makes them."""
    runs = collect_runs(folder)
    keys, groups, duplicates, unidentified = collect.group_runs(runs)
    shown = collect.shown_keys([r for g in groups for r in g], keys)
    rows = stats.summarize_groups(groups, shown, margin, adjust)
    return runs, keys, groups, duplicates, unidentified, rows


def _report_md(folder, margin=0.5, adjust="none"):
    """report.md's text for the runs under ``folder`` (no plots)."""
    runs, keys, groups, duplicates, unidentified, rows = _tables(folder, margin, adjust)
    return markdown.render_report(folder, runs, keys, rows, groups, stats.sections(rows),
                                  duplicates, unidentified, {}, margin, 1)  # fmt: skip


def _collapsed(arm, seed):
    # A plateau at 20.04 dB with 16 % of the covered pixels stuck in channel 2, above the
    # 13.36 dB baseline: a collapse by mptex.collapse's rule.
    psnrs = [20.03, 20.04, 20.04]
    history = [{"iteration": 800 * (i + 1), "loss": 0.03, "psnr": p,
                "stuck_fraction": [0.0, 0.0, 0.1616]} for i, p in enumerate(psnrs)]  # fmt: skip
    m = _metrics(arm, seed, psnr=psnrs[-1], baseline=13.36, iterations=2400,
                 iterations_planned=2400)  # fmt: skip
    m.update(history=history, saturation={"stuck_fraction": [0.0, 0.0, 0.1616],
                                          "saturated_fraction": [0.5, 0.3, 0.91]})  # fmt: skip
    return m


def _run(arm, seed, psnr=30.0, t=0.1, config=None, drop=(), **extra):
    """A run's metrics.json with the config keys in ``drop`` (``group.key``) removed."""
    record = _metrics(arm, seed, psnr=psnr, t=t, config=config, **extra)
    for key in drop:
        group, leaf = key.split(".", 1)
        record["config"][group].pop(leaf)
    return record


# ----------------------------------------------------------------------------- row statistics
def test_effective_loss_scale_takes_128_where_the_config_lacks_the_static_scale(tmp_path):
    # nvdiffrec's hook multiplies by precision.static_loss_scale, 128 when the key is absent:
    # a recorded GradScaler scale of 2 is an effective 2 * 128 = 256.
    for seed in (0, 1):
        _write(tmp_path, f"f{seed}", _run("f32", seed))
        _write(tmp_path, f"n{seed}", _run("nvdiffrec", seed, final_loss_scale=2.0,
                                          config={"precision.loss_scaling": "nvdiffrec"},
                                          drop=["precision.static_loss_scale"]))  # fmt: skip
    rows = _by_arm(tmp_path)
    assert rows["nvdiffrec"]["final_loss_scale"] == [256.0]
    assert rows["f32"]["final_loss_scale"] == [1.0]  # no loss scaling: the recorded scale


def test_tcnns_fused_network_carries_its_fixed_scale_too(tmp_path):
    # tcnn's bindings scale by static_loss_scale inside the graph: recorded 0.5 * 64 = 32.
    _write(tmp_path, "f0", _run("f32", 0))
    _write(tmp_path, "t0", _run("tcnn_fused", 0, final_loss_scale=0.5,
                                config={"precision.loss_scaling": "tcnn",
                                        "precision.static_loss_scale": 64.0}))  # fmt: skip
    assert _by_arm(tmp_path)["tcnn_fused"]["final_loss_scale"] == [32.0]


def test_grid_epsilon_defaults_to_torchs_1e8_for_runs_without_the_key(tmp_path):
    # train.adam_eps absent: torch's default 1e-8; nvdiffrec leaves x128 on the grid's
    # gradient, so its effective epsilon is 1e-8 / 128 = 7.8125e-11.
    _write(tmp_path, "f0", _run("f32", 0))
    _write(tmp_path, "n0", _run("nvdiffrec", 0, config={"precision.loss_scaling": "nvdiffrec"}))
    rows = _by_arm(tmp_path)
    assert rows["f32"]["grid_adam_eps"] == [1e-8]
    assert rows["nvdiffrec"]["grid_adam_eps"] == [1e-8 / 128]
    assert 1e-8 / 128 == 7.8125e-11


def test_a_run_exactly_at_the_baseline_is_marked(tmp_path):
    # "at or below the constant-colour baseline": 20.0 dB against a 20.0 dB baseline counts.
    _write(tmp_path, "f0", _run("f32", 0, psnr=20.0, baseline=20.0))
    _write(tmp_path, "f1", _run("f32", 1, psnr=20.5, baseline=20.0))
    assert _by_arm(tmp_path)["f32"]["below_baseline"] == ["f0"]


def test_peak_memory_is_the_largest_over_the_rows_runs(tmp_path):
    # the runs' peaks: 2**20 * seed + 2**20 -> 1, 2 and 3 MiB; the row's is 3 MiB.
    for seed in range(3):
        _write(tmp_path, f"f{seed}", _run("f32", seed))
    assert _by_arm(tmp_path)["f32"]["peak_memory_bytes"] == 3 * 2**20


def test_an_untimed_run_is_left_out_of_the_per_seed_times(tmp_path):
    _write(tmp_path, "f0", _run("f32", 0, t=0.25))
    _write(tmp_path, "f1", _run("f32", 1, t=0.0))
    assert _by_arm(tmp_path)["f32"]["seed_times"] == [[0, 0.25]]


def test_an_unavailable_runs_message_is_listed(tmp_path):
    _write(tmp_path, "f0", _run("f32", 0))
    why = "needs tinycudann"
    _write(tmp_path, "t0", _run("tcnn_fused", 0, status="unavailable", error=why))
    assert _by_arm(tmp_path)["tcnn_fused"]["errors"] == [why]


@pytest.mark.parametrize("margin", [0, 0.0, -0.5, float("nan"), "0.5", None])
def test_the_margin_must_be_a_positive_number(margin):
    with pytest.raises(ValueError, match=r"^margin_db: expected a finite number > 0, got "):
        stats.check_settings(margin, "none")


def test_the_adjustment_must_be_a_known_one():
    stats.check_settings(0.5, "bonferroni")  # accepted
    with pytest.raises(ValueError) as info:
        stats.check_settings(0.5, "holm")
    assert str(info.value) == "adjust: expected one of none, bonferroni, got 'holm'"


# ----------------------------------------------------------------------------- seeds to settle
def _settle_reference(mean, sd, n, margin, confidence=0.95):
    """The smallest n' > n (and >= 2) with t * sd / sqrt(n') < |mean| or |mean| + t * sd /
    sqrt(n') <= margin, t from scipy's Student t; None beyond 200."""
    for k in range(max(n + 1, 2), 201):
        half = scipy.stats.t.ppf(0.5 + confidence / 2, k - 1) * sd / math.sqrt(k)
        if half < abs(mean) or abs(mean) + half <= margin:
            return k
    return None


@pytest.mark.parametrize(
    "mean, sd, n, margin, confidence",
    [(0.3, 0.4, 3, 0.5, 0.95), (-0.3, 0.4, 3, 0.5, 0.95), (0.8, 1.5, 2, 0.5, 0.95),
     (0.05, 0.9, 4, 0.5, 0.95), (0.2, 0.3, 3, 0.25, 0.99), (0.01, 2.0, 3, 0.1, 0.95),
     (0.6, 0.2, 1, 0.5, 0.95)],
)  # fmt: skip
def test_seeds_to_settle_is_the_smallest_count_that_would_settle(mean, sd, n, margin, confidence):
    got = stats.seeds_to_settle({"mean": mean, "sd": sd, "n": n}, margin, confidence)
    assert got == _settle_reference(mean, sd, n, margin, confidence)


def test_seeds_to_settle_counts_up_to_200_seeds():
    # mean 0, sd 1.55, margin 0.2: inside the margin needs t * 1.55 / sqrt(n) <= 0.2; at n = 200,
    # t(0.975, 199) = 1.97196, 1.97196 * 1.55 / 14.1421 = 0.21613 > 0.2: none up to 200, while
    # a margin of 0.2162 is met at exactly n = 200 (199 gives 1.97202 * 1.55 / 14.1067 = 0.21668).
    assert stats.seeds_to_settle({"mean": 0.0, "sd": 1.55, "n": 3}, 0.2) is None
    assert stats.seeds_to_settle({"mean": 0.0, "sd": 1.55, "n": 3}, 0.2162) == 200
    assert stats.SETTLE_MAX_SEEDS == 200


def test_seeds_to_settle_starts_above_the_seeds_measured():
    # mean 1, sd 0.1 at n = 2: t(0.975, 1) * 0.1 / sqrt(2) = 0.898 < 1 already at n = 2, but the
    # estimate is of more seeds than measured: 3.
    assert stats.seeds_to_settle({"mean": 1.0, "sd": 0.1, "n": 2}, 0.5) == 3


def test_an_interval_reaching_exactly_zero_or_the_margin():
    # Where the half width at n equals |mean| exactly the interval touches 0 (not a difference
    # shown); where |mean| + half equals the margin exactly it lies inside [-m, m] (settled).
    sd, n = 0.8, 5
    half = stats.t_quantile(0.975, n - 1) * sd / n**0.5
    assert stats.seeds_to_settle({"mean": half, "sd": sd, "n": n - 1}, half / 2) == n + 1
    assert stats.seeds_to_settle({"mean": 0.0, "sd": sd, "n": n - 1}, half) == n


# ----------------------------------------------------------------------------- report.md cells
def _compared(verdict, mean, low, high, n, n_seeds=None, sd=0.1):
    half = None if low is None else (high - low) / 2
    delta = {"n": n, "mean": mean, "sd": sd, "half_width": half, "low": low, "high": high}
    return {"precision": "bf16", "verdict": verdict, "delta": delta,
            "n_seeds": n if n_seeds is None else n_seeds}  # fmt: skip


def test_a_bound_just_above_zero_is_printed_with_the_digits_that_show_it():
    # low = 4e-6 > 0: "+0.00000" at five decimals would read as touching 0, "+0.000004" at six
    # does not; every number of the interval gets the six decimals.
    delta = {"mean": 0.3, "low": 4e-6, "high": 0.6}
    assert interval_text(delta, 0.5) == ("+0.300000", "+0.000004", "+0.600000")


def test_a_bound_just_outside_the_margin_beyond_six_digits_is_printed_exactly():
    # low = -0.5000004 < -0.5: every rounding up to six decimals reads -0.5 (inside the margin),
    # so the bound is printed as the shortest text that reads back as it.
    delta = {"mean": -0.2, "low": -0.5000004, "high": 0.1}
    mean, low, high = interval_text(delta, 0.5)
    assert (mean, low, high) == ("-0.200000", "-0.5000004", "+0.1")
    assert float(low) == -0.5000004


def test_cannot_judge_counts_zero_paired_seeds_in_the_plural():
    row = _compared("cannot judge", None, None, None, 0)
    assert verdict_text(row, 0.5) == "cannot judge (0 paired seeds)"
    row = _compared("cannot judge", 0.2, None, None, 1)
    assert verdict_text(row, 0.5) == "cannot judge (1 paired seed)"


def test_an_interval_ending_exactly_on_the_margin_is_within_it():
    # worse: [-0.5, -0.1] lies inside [-0.5, +0.5] (the margin's ends included).
    row = _compared("worse", -0.3, -0.5, -0.1, 3)
    assert verdict_text(row, 0.5) == "worse, by at most 0.5 dB"
    row = _compared("better", 0.3, 0.1, 0.5000001, 3)
    assert verdict_text(row, 0.5) == "better"


def test_no_paired_seeds_reads_as_a_dash():
    row = _compared("no paired seeds", None, None, None, 0, n_seeds=2)
    assert verdict_text(row, 0.5) == "–"
    assert delta_cell(row, 0.5) == "–"


def test_the_delta_cell_names_the_pairs_where_they_are_fewer_than_the_seeds():
    row = _compared("better", 0.25, 0.125, 0.375, 3, n_seeds=4)
    assert delta_cell(row, 0.5) == "+0.25 [+0.12, +0.38] (3 pairs)"
    row = _compared("better", 0.25, 0.125, 0.375, 3, n_seeds=3)
    assert delta_cell(row, 0.5) == "+0.25 [+0.12, +0.38]"
    row = _compared("cannot judge", 0.25, None, None, 1)
    assert delta_cell(row, 0.5, lambda text: f"${text}$") == "$+0.25$ (1 seed)"


def test_runs_at_once_in_words():
    assert runs_at_once(0) == "as many as the machine's cores"
    assert runs_at_once(4) == "up to 4"


# ----------------------------------------------------------------------------- results.json
def test_results_comparison_skips_the_device_and_compares_values_not_their_text():
    assert result_differences({"device": "cpu", "psnr": 1.0}, {"device": "cuda:0", "psnr": 1}) == []
    assert result_differences({"psnr": "30.5"}, {"psnr": 30.5}) == ["/psnr: '30.5' -> 30.5"]
    assert result_differences({"runs": [{"seed": 1}]}, {"runs": [{}]}) == [
        "/runs[0]/seed: only in before"
    ]


# ----------------------------------------------------------------------------- images
def test_error_gain_is_the_power_of_two_under_255_over_the_995th_percentile():
    # 199 errors of 1 and one of 255: the 99.5th percentile (linear, position 0.995 * 199 =
    # 198.005) is 1 + 0.005 * 254 = 2.27; 255 / 2.27 = 112.3, whose power of two below is 64.
    errors = np.array([1] * 199 + [255])
    assert error_gain([errors]) == 64
    # every error 10: 255 / 10 = 25.5 -> 16 (rounded down, so that the map does not saturate)
    assert error_gain([np.full((4, 4), 10)]) == 16
    # zeros are the background, left out: the same 16 with a thousand zeros beside
    assert error_gain([np.zeros(10000), np.full((4, 4), 10)]) == 16


def test_error_gain_is_at_most_256():
    # 255 / 0.5 = 510 -> 256; 255 / 0.1 = 2550 -> 2048, clamped to 256
    assert error_gain([np.array([0.5])]) == 256
    assert error_gain([np.array([0.1])]) == 256


def _window_reference(image, size):
    """The window with the largest sum of |4 g - the four neighbours| over its interior pixels
    (grey = mean over channels, the image's border pixels counting 0), by brute force; the
    first in row-major order among equals."""
    gray = image.astype(np.float64).mean(-1)
    h, w = gray.shape
    lap = np.zeros((h, w))
    for y in range(1, h - 1):
        for x in range(1, w - 1):
            lap[y, x] = abs(4 * gray[y, x] - gray[y - 1, x] - gray[y + 1, x] - gray[y, x - 1]
                            - gray[y, x + 1])  # fmt: skip
    best, where = -1.0, None
    for y in range(h - size + 1):
        for x in range(w - size + 1):
            total = lap[y : y + size, x : x + size].sum()
            if total > best + 1e-9:
                best, where = total, (y, x)
    return where


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_detail_window_holds_the_most_fine_detail(seed):
    rng = np.random.default_rng(seed)
    image = (rng.random((14, 17, 3)) * 40).astype(np.uint8)
    image[3:9, 8:15] = rng.integers(0, 256, (6, 7, 3), dtype=np.uint8)  # a busy patch
    assert _detail_window(image, 5) == _window_reference(image, 5)


def test_an_image_of_odd_width_splits_into_two_halves_of_equal_width(tmp_path):
    import imageio.v3 as iio

    side = np.zeros((2, 5, 4), dtype=np.uint8)  # [reference | prediction | one extra column]
    side[..., 0] = [[10, 11, 20, 21, 99], [12, 13, 22, 23, 99]]
    side[..., 3] = 255  # an alpha channel, dropped
    (tmp_path / "run" / "images").mkdir(parents=True)
    iio.imwrite(tmp_path / "run" / "images" / "val_000.png", side)
    reference, [(run, prediction)] = image_panels(tmp_path, [{"run_dir": "run"}])
    assert reference.shape == prediction.shape == (2, 2, 3)
    assert reference[..., 0].tolist() == [[10, 11], [12, 13]]
    assert prediction[..., 0].tolist() == [[20, 21], [22, 23]]


# ----------------------------------------------------------------------------- report.md
def test_two_collapsed_runs_are_counted_in_the_plural(tmp_path):
    for seed in range(3):
        _write(tmp_path, f"f{seed}", _run("f32", seed))
    _write(tmp_path, "b0", _run("bf16", 0))
    _write(tmp_path, "b1", _collapsed("bf16", 1))
    _write(tmp_path, "b2", _collapsed("bf16", 2))
    rows = _by_arm(tmp_path)
    assert rows["bf16"]["collapsed"] == 2
    assert "- Collapsed (2 runs; counted apart" in _report_md(tmp_path)


def test_epsilons_both_at_the_negligible_bound_are_not_named(tmp_path):
    # Both arms at train.adam_eps = e: f32's grid has an effective e (factor 1), nvdiffrec's
    # e / 128. With e = 1e-8 / 128 both are at or below 1e-8 / 128, where epsilon was measured
    # not to matter: no line names the difference. With e = 2e-8 / 128 one is above: named.
    for eps, named in ((1e-8 / 128, False), (2e-8 / 128, True)):
        folder = tmp_path / str(named)
        for seed in range(2):
            _write(folder, f"f{seed}", _run("f32", seed, config={"train.adam_eps": eps}))
            _write(folder, f"n{seed}", _run("nvdiffrec", seed, config={
                "train.adam_eps": eps, "precision.loss_scaling": "nvdiffrec"}))  # fmt: skip
        rows = _by_arm(folder)
        assert rows["f32"]["grid_adam_eps"] == [eps]
        assert rows["nvdiffrec"]["grid_adam_eps"] == [eps / 128]
        assert ("runs Adam on the grid with an effective epsilon" in _report_md(folder)) is named


def test_the_quantisation_table_has_a_line_only_for_the_layers_an_arm_recorded(tmp_path):
    def quantised(arm, seed, layers):
        m = _run(arm, seed)
        for entry in m["history"]:
            entry.update({f"net.{i}.q_input_rel_error": 0.01 * (i + 1) for i in layers})
        return m

    _write(tmp_path, "f0", _run("f32", 0))
    _write(tmp_path, "a0", quantised("fp8", 0, [0, 1]))
    _write(tmp_path, "b0", quantised("int8_qat", 0, [1]))
    cells = [line.split("|") for line in _report_md(tmp_path).splitlines()]
    lines = [c for c in cells if len(c) > 3 and c[2].strip().startswith("net.")]
    assert [c[1:3] for c in lines] == [
        [" `fp8` ", " net.0 "], [" `fp8` ", " net.1 "], [" `int8_qat` ", " net.1 "]
    ]  # fmt: skip
    assert lines[2][3].strip() == "0.02"  # net.1's 0.01 * 2


# ----------------------------------------------------------------------------- sweep folder
def test_a_folder_holding_a_job_that_never_wrote_its_metrics_is_another_sweeps(tmp_path, capsys):
    from omegaconf import OmegaConf

    from mptex.report import FreshSweepDirCallback

    (tmp_path / "0_precision=bf16" / ".hydra").mkdir(parents=True)  # a job killed early
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    with pytest.raises(SystemExit) as exc:
        FreshSweepDirCallback().on_multirun_start(config)
    assert exc.value.code == 2
    assert "already holds a sweep (0_precision=bf16)" in capsys.readouterr().err
    assert not (tmp_path / ".mptex_sweep").exists()


def test_an_adjustment_over_a_single_comparison_says_it_changes_nothing(tmp_path):
    # bonferroni over k = 1 comparison: 1 - 0.05 / 1 = 95 %, the interval as it stands.
    for seed in range(2):
        _write(tmp_path, f"f{seed}", _run("f32", seed, psnr=30.0))
        _write(tmp_path, f"b{seed}", _run("bf16", seed, psnr=30.0 + 0.1 * seed))
    text = _report_md(tmp_path, adjust="bonferroni")
    assert ("Adjusted for multiplicity (bonferroni), but the report's tables hold one comparison "
            "with an interval: it is 95% as it stands.") in text  # fmt: skip
    assert "Bonferroni k =" not in text


# ----------------------------------------------------------------------------- images.png
@pytest.mark.slow  # draws a figure: a few seconds
@pytest.mark.parametrize("height, width", [(8, 64), (4, 4), (3, 5)])
def test_images_of_a_small_or_short_view_are_drawn(tmp_path, height, width):
    # A view 8 pixels high and 64 wide: the zoom box is max(8, min(8, 64) // 4) = 8 pixels, the
    # view's height, so that it fits. A view under 8 pixels a side (4 x 4, 3 x 5) is zoomed
    # whole: the box is its shorter side.
    import imageio.v3 as iio

    from mptex.report.plots import plot_images

    rng = np.random.default_rng(0)
    for arm in ("f32", "bf16"):
        run = _write(tmp_path, f"{arm}0", _run(arm, 0))
        (run / "images").mkdir()
        side = rng.integers(0, 256, (height, 2 * width, 3), dtype=np.uint8)
        iio.imwrite(run / "images" / "val_000.png", side)
    runs, keys, groups, duplicates, unidentified, rows = _tables(tmp_path)
    gain = plot_images(tmp_path / "images.png", tmp_path, stats.sections(rows), rows, groups)
    assert gain in (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert (tmp_path / "images.png").stat().st_size > 0


def test_an_unknown_arm_gets_its_colour_from_the_md5_of_its_name():
    # hue = first byte / 255, saturation = 0.65 + 0.35 * second byte / 255, value 0.75
    import colorsys
    import hashlib

    for arm in ("my_arm", "fp4_experiment", "x"):
        digest = hashlib.md5(arm.encode()).digest()
        rgb = colorsys.hsv_to_rgb(digest[0] / 255, 0.65 + 0.35 * digest[1] / 255, 0.75)
        assert arm_color(arm) == "#" + "".join(f"{round(255 * c):02x}" for c in rgb)


# ----------------------------------------------------------------------------- results.tex
@pytest.fixture
def tex_sweep(tmp_path):
    # f32: 31.0 dB on seeds 10 and 2 (sample std 0); bf16: 31.25 and 30.75 (seed 2 at its 30.75
    # baseline), 12.34 ms / iteration against f32's 24.68: a speed-up of 2.00.
    for seed, psnr in ((10, 31.25), (2, 30.75)):
        _write(tmp_path, f"f{seed}", _run("f32", seed, psnr=31.0, t=0.02468))
        _write(tmp_path, f"b{seed}", _run("bf16", seed, psnr=psnr, t=0.01234, baseline=30.75))
    return tmp_path


def _tex(folder, margin=0.5, adjust="none", shared=1):
    runs, keys, groups, duplicates, unidentified, rows = _tables(folder, margin, adjust)
    return render_latex(rows, stats.sections(rows), margin, folder, ("cpu",), shared)


def test_results_tex_rows_hold_the_reports_numbers(tex_sweep):
    lines = _tex(tex_sweep).splitlines()
    f32 = next(line for line in lines if line.startswith(r"\texttt{f32}"))
    bf16 = next(line for line in lines if line.startswith(r"\texttt{bf16}"))
    # 7 columns: arm, runs, PSNR, delta, verdict, ms / iter, speed-up (no precision.* key swept)
    assert r"\begin{tabular}{lrrllrr}" in lines
    assert f32.split(" & ") == ["\\texttt{f32}", "2/2", r"$31.00 \pm 0.00$", "--", "reference",
                                "24.7", r"1.00 \\"]  # fmt: skip
    # bf16: mean 31.0, sd of (31.25, 30.75) = 0.353553 -> 0.35; differences +0.25 and -0.25:
    # mean 0, sd 0.353553, t(0.975, 1) = 12.7062 -> half width 12.7062 * 0.353553 / sqrt(2)
    # = 3.17655: [-3.18, +3.18], inconclusive; the run at the baseline is marked with a dagger.
    assert bf16.split(" & ") == [
        r"\texttt{bf16}", "2/2", r"$31.00 \pm 0.35$\textsuperscript{\dag}",
        "$+0.00$ [$-3.18$, $+3.18$]", "inconclusive",
        "12.3", r"2.00 \\"]  # fmt: skip


def test_results_tex_caption_lists_the_seeds_by_value_and_the_margin(tex_sweep):
    text = _tex(tex_sweep, margin=0.25)
    assert "Seeds 2, 10 (2). " in text
    assert r"within $\pm0.25$\,dB" in text
    assert "runs sharing the machine" not in text  # one run at a time
    assert "up to 4 runs sharing the machine" in _tex(tex_sweep, shared=4)


def test_results_tex_caption_of_an_adjustment_over_one_comparison(tex_sweep):
    text = _tex(tex_sweep, adjust="bonferroni")
    assert "each for its own comparison (not adjusted for multiplicity)" in text
    assert "Bonferroni" not in text


# ----------------------------------------------------------------------------- report.md tables
def _cell(text, arm, column):
    """The cell of ``arm``'s row under the heading that starts with ``column``."""
    lines = [line for line in text.splitlines() if line.startswith("| arm ")]
    header = [c.strip() for c in lines[0].split("|")]
    index = next(i for i, name in enumerate(header) if name.startswith(column))
    row = next(line for line in text.splitlines() if line.startswith(f"| `{arm}` "))
    return row.split("|")[index].strip()


def test_the_loss_scale_column_spans_the_smallest_to_the_largest(tmp_path):
    # three distinct final scales (no loss scaling: as recorded): 1, 128 and 65536
    for seed, scale in enumerate((128.0, 65536.0, 1.0)):
        _write(tmp_path, f"f{seed}", _run("f32", seed, final_loss_scale=scale))
    assert _cell(_report_md(tmp_path), "f32", "eff. loss scale") == "1–65536"


def test_peak_memory_is_printed_in_mebibytes(tmp_path):
    # 100 MiB = 104857600 bytes -> "100" (in megabytes it would read 105)
    _write(tmp_path, "f0", _run("f32", 0, peak_memory_bytes=100 * 2**20))
    assert _cell(_report_md(tmp_path), "f32", "peak mem (MiB)") == "100"


def test_peak_memory_is_the_largest_of_the_completed_runs_as_the_key_says(tmp_path):
    # seed 0 completed at 100 MiB, seed 1 diverged at 300 MiB: the cell shows 100, and the key
    # under the tables says whose peak it is.
    _write(tmp_path, "f0", _run("f32", 0, peak_memory_bytes=100 * 2**20))
    _write(tmp_path, "f1", _run("f32", 1, peak_memory_bytes=300 * 2**20, status="diverged"))
    text = _report_md(tmp_path)
    assert _cell(text, "f32", "peak mem (MiB)") == "100"
    assert ("- Peak memory: the largest over the row's completed runs, from the end of each "
            "run's start (") in text  # fmt: skip
    # runs recorded without their start's peak (written before it was measured): said plainly
    assert "measured apart, the same way: `metrics.json`'s `start_peak_memory_bytes`." in text


def test_the_starts_peak_is_the_largest_over_the_completed_runs(tmp_path):
    _write(tmp_path, "f0", _run("f32", 0, peak_memory_bytes=100 * 2**20,
                                 start_peak_memory_bytes=40 * 2**20))  # fmt: skip
    _write(tmp_path, "f1", _run("f32", 1, peak_memory_bytes=100 * 2**20,
                                 start_peak_memory_bytes=70 * 2**20))  # fmt: skip
    _write(tmp_path, "f2", _run("f32", 2, peak_memory_bytes=100 * 2**20, status="diverged",
                                 start_peak_memory_bytes=900 * 2**20))  # fmt: skip
    text = " ".join(_report_md(tmp_path).split())
    # below the column's largest (100): no advice; the diverged run's 900 is not counted
    assert "the largest over the completed runs is 70 MiB." in text


def test_a_run_at_the_baseline_is_marked_in_the_psnr_cell(tmp_path):
    _write(tmp_path, "f0", _run("f32", 0, psnr=20.0, baseline=20.0))
    assert _cell(_report_md(tmp_path), "f32", "PSNR") == "20.00 ⚠"


def test_the_underflow_table_leaves_out_the_mlp_layers_output_gradient(tmp_path):
    m = _run("f32", 0)
    m["history"][-1]["net.0.out_grad_zero_frac"] = 0.5  # mostly ReLU's zeros, not underflow
    _write(tmp_path, "f0", m)
    text = _report_md(tmp_path)
    assert "`net.0.grad_zero_frac`" in text
    assert "out_grad_zero_frac" not in text


def test_one_sample_per_pixel_is_not_called_supersampling(tmp_path):
    # train.val_spp, read where the run scored views (psnr_per_image)
    for seed, spp in ((0, 1), (1, 4)):
        _write(tmp_path, f"f{seed}", _run("f32", seed, config={"train.val_spp": spp},
                                          psnr_per_image=[30.0, 30.0]))  # fmt: skip
    text = _report_md(tmp_path)
    assert "4 x 4 samples per pixel" in text
    assert "1 x 1 samples per pixel" not in text


def test_the_unadjusted_family_error_at_five_arms(tmp_path):
    # 1 - 0.95^5 = 1 - 0.77378 = 0.22622 -> 23 %
    _write(tmp_path, "f0", _run("f32", 0))
    assert "(about 23% at k = 5;" in _report_md(tmp_path)


def test_the_bonferroni_quantile_is_written_as_computed(tmp_path):
    # two arms compared with an interval: k = 2, each interval at 1 - 0.05/2 = 97.5 %, its
    # quantile 1 - 0.05/4 (two-sided)
    for seed in range(2):
        _write(tmp_path, f"f{seed}", _run("f32", seed, psnr=30.0))
        for arm in ("bf16", "f16_static"):
            _write(tmp_path, f"{arm}{seed}", _run(arm, seed, psnr=30.0 + 0.1 * seed))
    text = _report_md(tmp_path, adjust="bonferroni")
    assert "[97.5% CI, Bonferroni k = 2]: mean ± t(1 − 0.05/4, n−1)" in text


# ----------------------------------------------------------------------------- report.md reading
def test_an_arm_without_a_completed_run_is_not_listed_among_the_verdicts(tmp_path):
    for seed in range(2):
        _write(tmp_path, f"f{seed}", _run("f32", seed))
        _write(tmp_path, f"b{seed}", _run("bf16", seed, status="failed", error="boom"))
        _write(tmp_path, f"a{seed}", _run("amp", seed, status="failed", error="boom"))
    text = _report_md(tmp_path)
    assert "- No seed completed in both" not in text
    assert "bit-identical" not in text  # two rows without a completed run are not one measurement
    assert "- Failed: `amp` (2/2 runs: boom); `bf16` (2/2 runs: boom)." in text


def test_runs_trained_one_at_a_time_are_not_said_to_share_the_machine(tex_sweep):
    # shared = 1 (the basic launcher): no line about runs beside each other
    text = _report_md(tex_sweep)
    assert "- Fastest arm at `f32`'s quality:" in text
    assert "at a time on one machine" not in text


def test_underflow_is_the_mean_over_completed_and_diverged_runs(tmp_path):
    # completed: 0.25, diverged: 0.75 (a diverged run's gradients are measured too) -> 0.5
    _write(tmp_path, "f0", _run("f32", 0))
    diverged = _run("f32", 1, status="diverged", diverged_at=20)
    diverged["history"][-1]["net.0.grad_zero_frac"] = 0.75
    _write(tmp_path, "f1", diverged)
    assert _by_arm(tmp_path)["f32"]["underflow"]["net.0.grad_zero_frac"] == 0.5


def test_an_arm_whose_only_pair_a_collapse_took_cannot_be_judged(tmp_path):
    _write(tmp_path, "f0", _run("f32", 0))
    _write(tmp_path, "b0", _collapsed("bf16", 0))
    row = _by_arm(tmp_path)["bf16"]
    assert row["pairs"] == [] and row["excluded"][0]["why"] == "collapsed"
    assert row["verdict"] == "cannot judge"


def test_another_network_is_named_only_for_an_arm_with_completed_runs(tmp_path):
    # tcnn_fused's fused network against f32's linear layers, every tcnn_fused run failed: there
    # is no delta to qualify, so no line says it is not precision alone.
    for seed in range(2):
        _write(tmp_path, f"f{seed}", _run("f32", seed, config={"precision.mlp": "linear"}))
        _write(tmp_path, f"t{seed}", _run("tcnn_fused", seed, status="failed", error="no GPU",
                                          config={"precision.mlp": "fused"}))  # fmt: skip
    text = _report_md(tmp_path)
    assert "- Failed: `tcnn_fused` (2/2 runs: no GPU)." in text
    assert "Not precision alone" not in text


# ----------------------------------------------------------------------------- written files
@pytest.mark.slow  # writes the whole report, plots included: a few seconds
def test_results_json_and_csv_of_a_sweep_with_an_infinite_value(tmp_path):
    # f32 and two arms on seeds 0 and 1; amp on seed 5 only (no pair), timed at 1e-310 s /
    # iteration (a subnormal): f32's mean 0.1 s over it overflows to an infinite speed-up, which
    # strict JSON writes as null. A folder whose metrics.json is not JSON is a failed run
    # without a config, in no row.
    for seed in range(2):
        _write(tmp_path, f"f32_{seed}", _run("f32", seed))
        _write(tmp_path, f"f16_{seed}", _run("f16_static", seed, psnr=30.0 + 0.1 * seed))
        _write(tmp_path, f"bf16_{seed}", _run("bf16", seed, psnr=30.0 + 0.2 * seed))
    _write(tmp_path, "amp_5", _run("amp", 5, t=1e-310))
    _write(tmp_path, "broken", "{not json")
    assert _by_arm(tmp_path)["amp"]["speedup"] == math.inf
    written = write_report(tmp_path, adjust="bonferroni")
    assert {"loss_scale.png", "loss_scale.pdf", "psnr_curves.pdf"} <= set(written)
    document = json.loads((tmp_path / "results.json").read_text())
    # k = 2 comparisons with an interval: each at 1 - 0.05 / 2
    assert document["intervals"] == {"adjust": "bonferroni", "comparisons": 2,
                                     "interval_confidence": 0.975}  # fmt: skip
    summary = {r["precision"]: r for r in document["summary"]}
    assert summary["amp"]["speedup"] is None and summary["bf16"]["speedup"] == 1.0
    assert not any(key.startswith("_") for r in document["runs"] for key in r)
    import csv

    with (tmp_path / "results.csv").open() as f:
        rows = {r["run_dir"]: r for r in csv.DictReader(f)}
    assert rows["broken"]["counted"] == "False" and rows["f32_0"]["counted"] == "True"


def test_a_collapses_evidence_is_not_a_note_of_a_diverged_run(tmp_path):
    _write(tmp_path, "f0", _run("f32", 0))
    _write(tmp_path, "f1", _collapsed("f32", 1))
    row = _by_arm(tmp_path)["f32"]
    assert [c["seed"] for c in row["collapsed_runs"]] == [1] and row["collapsed_runs"][0]["reason"]
    assert row["notes"] == []


def test_the_reference_row_is_not_paired_with_itself(tmp_path):
    for seed in range(2):
        _write(tmp_path, f"f{seed}", _run("f32", seed, psnr=30.0 + seed))
    (row,) = summarize(collect_runs(tmp_path))
    assert row["reference"] == 0 and row["pairs"] == [] and row["delta"]["n"] == 0
    assert row["verdict"] is None and row["family"] == 0


def test_speed_candidates_are_the_reference_and_the_arms_at_its_quality_fastest_first(tmp_path):
    # bf16 (0.05 s) and f16_static (0.08 s) within the margin on every seed; amp as fast as
    # bf16 but 3 dB worse: not a candidate.
    for seed in range(3):
        _write(tmp_path, f"f{seed}", _run("f32", seed, psnr=30.0 + seed, t=0.1))
        _write(tmp_path, f"s{seed}", _run("f16_static", seed, psnr=30.0 + seed, t=0.08))
        _write(tmp_path, f"b{seed}", _run("bf16", seed, psnr=30.01 + seed, t=0.05))
        _write(tmp_path, f"a{seed}", _run("amp", seed, psnr=27.0 + seed, t=0.05))
    rows = summarize(collect_runs(tmp_path))
    ref = next(r for r in rows if r["precision"] == "f32")
    order = [r["precision"] for r in stats.speed_candidates(rows, ref)]
    assert order == ["bf16", "f16_static", "f32"]


def test_no_curve_is_drawn_without_a_history(tmp_path):
    from mptex.report.plots import plot_history

    m = _run("f32", 0)
    m["history"] = []
    _write(tmp_path, "f0", m)
    runs, keys, groups, duplicates, unidentified, rows = _tables(tmp_path)
    path = tmp_path / "psnr_curves.png"
    assert plot_history(path, stats.sections(rows), rows, groups, "psnr") is False
    assert not path.exists()


def test_results_tex_writes_a_dash_for_a_key_a_row_lacks(tmp_path):
    # precision.block swept over bf16 (32, 64); f32's runs lack the key
    for seed in range(2):
        _write(tmp_path, f"f{seed}", _run("f32", seed))
        for block in (32, 64):
            run = _run("bf16", seed, config={"precision.block": block})
            _write(tmp_path, f"b{block}_{seed}", run)
    lines = _tex(tmp_path).splitlines()
    assert r"\begin{tabular}{llrrllrr}" in lines
    f32 = next(line for line in lines if line.startswith(r"\texttt{f32}"))
    assert f32.split(" & ")[1] == "--"
    assert [line.split(" & ")[1] for line in lines if line.startswith(r"\texttt{bf16}")] == [
        "32", "64"
    ]  # fmt: skip


def test_a_curve_is_the_mean_and_band_over_runs_at_each_iteration():
    from mptex.report.plots import _curve, _psnr

    runs = [{"history": [{"iteration": 10, "psnr": 20.0}, {"iteration": 20, "psnr": 24.0}]},
            {"history": [{"iteration": 10, "psnr": 22.0}, {"iteration": 30, "psnr": 25.0},
                         {"iteration": 20, "psnr": None}]}]  # fmt: skip
    # iteration 10: (20 + 22) / 2 = 21, band 20-22; 20: 24 alone; 30: 25 alone
    assert _curve(runs, _psnr) == ([10, 20, 30], [21.0, 24.0, 25.0], [20.0, 24.0, 25.0],
                                   [22.0, 24.0, 25.0])  # fmt: skip


def test_a_recorded_effective_loss_scale_wins_over_the_one_derived_from_the_config():
    from mptex.report.plots import _scale

    run = {"config": {"precision.loss_scaling": "nvdiffrec"}}
    assert _scale(run, {"loss_scale": 2.0}) == 256.0  # 2 * the default 128
    assert _scale(run, {"loss_scale": 2.0, "effective_loss_scale": 64.0}) == 64.0


def test_a_speed_ratio_of_times_far_apart_is_a_number_not_a_crash():
    # 1 / 1e-310 overflows float64 and 1e-320 / 1e10 underflows to 0, where the ratio's log,
    # ln(a) - ln(b) (about 713.8 and -759.3), is an ordinary number: the report's speed column
    # gets an infinite or zero ratio instead of a traceback from the interval.
    from mptex.intervals import ratio_ci

    fast = ratio_ci([(1.0, 1e-310), (1.0, 1e-310)])
    assert fast["ratio"] == math.inf and fast["n"] == 2
    slow = ratio_ci([(1e-320, 1e10), (1e-320, 1e10)])
    assert slow["ratio"] == 0.0
    # ordinary times are unchanged: (2, 1) and (8, 2) give exp((ln 2 + ln 4) / 2) = sqrt(8)
    assert ratio_ci([(2.0, 1.0), (8.0, 2.0)])["ratio"] == pytest.approx(math.sqrt(8), rel=1e-15)


# ----------------------------------------------------------------------------- cross-check
def _random_sweep(root, rng):
    """A sweep of random, known runs: two learning rates, f32 and three arms on unequal seed
    sets, a few runs diverged / failed / stopped / completed without a PSNR, some seeds run
    twice, and keys that must not split rows (train.progress, export.enabled). Returns
    ``{(lr, arm): {seed: (status, psnr, time)}}`` of the runs the report must count: the first
    job of a seed, or its re-run where the first failed to run."""
    outcomes = ["completed"] * 16 + ["diverged", "failed", "interrupted", "no psnr"]
    truth, job = {}, 0
    for lr in (0.01, 0.003):
        base = {s: 30.0 + rng.gauss(0, 0.3) for s in range(6)}
        for arm in ("f32", "bf16", "fp8", "f16_dynamic"):
            effect, speed = rng.choice([0.0, 0.1, -0.8]), rng.choice([1.0, 3.0])
            n_seeds = rng.randint(4 if arm == "f32" else 1, 6)
            for seed in sorted(rng.sample(range(6), n_seeds)):
                for rerun in range(1 + (rng.random() < 0.15)):
                    job += 1
                    status = rng.choice(outcomes)
                    psnr = base[seed] + (arm != "f32") * (effect + rng.gauss(0, 0.2))
                    t = 0.1 / speed * math.exp(rng.gauss(0, 0.1))
                    m = _metrics(arm, seed, psnr=psnr, t=t,
                                 status={"no psnr": "completed"}.get(status, status),
                                 config={"train.lr": lr, "train.progress": rng.random() < 0.5,
                                         "export.enabled": rng.random() < 0.5})  # fmt: skip
                    if status == "no psnr":  # counted as diverged
                        m["psnr"] = None
                    # Hydra's job numbers: a re-run gets a later (and longer) one
                    _write(root, f"{job + 100 * rerun}_{arm}_{lr}_{seed}", m)
                    kept = truth.setdefault((lr, arm), {}).get(seed)
                    if kept is None or (kept[0] in ("failed", "interrupted")
                                        and status not in ("failed", "interrupted")):  # fmt: skip
                        truth[(lr, arm)][seed] = (status, psnr, t)
    return truth


@pytest.mark.parametrize("sweep_seed", range(4))
def test_rows_match_an_independent_recomputation_on_random_sweeps(tmp_path, sweep_seed):
    # Every number of every row, recomputed from the runs as written: numpy means and sample
    # sds, scipy's Student t, the docs' verdict rule and Bonferroni's 1 - 0.05 / k over the
    # rows with two pairs or more. Float64 sums in another order: 1e-9.
    import random

    rng = random.Random(sweep_seed)
    truth = _random_sweep(tmp_path, rng)
    adjust, margin = ("bonferroni", 0.25) if sweep_seed % 2 else ("none", 0.5)
    rows = {(r["keys"]["train.lr"], r["precision"]): r
            for r in summarize(collect_runs(tmp_path), margin, adjust)}  # fmt: skip
    assert set(rows) == set(truth)
    done = {key: {s: v for s, v in runs.items() if v[0] == "completed"}
            for key, runs in truth.items()}  # fmt: skip
    pairs = {key: sorted(set(done[key]) & set(done[(key[0], "f32")]))
             for key in truth if key[1] != "f32"}  # fmt: skip
    k = sum(len(p) >= 2 for p in pairs.values())
    level = 1 - 0.05 / k if adjust == "bonferroni" and k > 1 else 0.95
    for key, row in rows.items():
        status = {"interrupted": "failed", "no psnr": "diverged"}
        counts = [status.get(v[0], v[0]) for v in truth[key].values()]
        assert [row[s] for s in ("completed", "diverged", "failed")] == [
            counts.count(s) for s in ("completed", "diverged", "failed")
        ]
        psnrs = [v[1] for v in done[key].values()]
        assert row["n_seeds"] == len(psnrs) and row["n_runs"] == len(truth[key])
        if psnrs:
            assert row["psnr_mean"] == pytest.approx(np.mean(psnrs), rel=1e-9)
        if len(psnrs) > 1:
            assert row["psnr_std"] == pytest.approx(np.std(psnrs, ddof=1), rel=1e-9)
        if key[1] == "f32":
            assert row["verdict"] is None
            continue
        ref = done[(key[0], "f32")]
        diffs = [done[key][s][1] - ref[s][1] for s in pairs[key]]
        assert [s for s, _ in row["pairs"]] == pairs[key]
        assert sorted(row["unpaired_seeds"]) == sorted(set(done[key]) - set(ref))
        assert row["confidence"] == pytest.approx(level, rel=1e-15) and row["family"] == k
        if not diffs:
            assert row["verdict"] == "no paired seeds"
            continue
        assert row["delta"]["mean"] == pytest.approx(np.mean(diffs), rel=1e-9, abs=1e-12)
        if len(diffs) == 1:
            assert row["verdict"] == "cannot judge" and row["delta"]["low"] is None
            continue
        half = (scipy.stats.t.ppf((1 + level) / 2, len(diffs) - 1)
                * np.std(diffs, ddof=1) / math.sqrt(len(diffs)))  # fmt: skip
        low, high = np.mean(diffs) - half, np.mean(diffs) + half
        assert row["delta"]["low"] == pytest.approx(low, rel=1e-9, abs=1e-12)
        assert row["delta"]["high"] == pytest.approx(high, rel=1e-9, abs=1e-12)
        expected = ("better" if low > 0 else "worse" if high < 0 else
                    "no detectable difference" if -margin <= low and high <= margin else
                    "inconclusive")  # fmt: skip
        assert row["verdict"] == expected
        if expected == "inconclusive":  # the first n whose interval would exclude 0 or fit
            sd, mean = np.std(diffs, ddof=1), abs(np.mean(diffs))
            widths = {n: scipy.stats.t.ppf((1 + level) / 2, n - 1) * sd / math.sqrt(n)
                      for n in range(len(diffs) + 1, 201)}  # fmt: skip
            settle = [n for n, w in widths.items() if w < mean or mean + w <= margin]
            assert row["seeds_to_settle"] == (settle[0] if settle else None)
        # The printed bounds say what the exact ones say about 0 and the margin.
        printed = re.search(r"\[(\S+), (\S+)\]", delta_cell(row, margin)).groups()
        lo, hi = map(float, printed)
        assert (lo > 0, hi < 0, lo >= -margin, hi <= margin) == (
            low > 0, high < 0, low >= -margin, high <= margin)  # fmt: skip
        # Speed: f32's time over the arm's, per paired seed; the geometric mean's interval.
        logs = [math.log(ref[s][2]) - math.log(done[key][s][2]) for s in pairs[key]]
        half = (scipy.stats.t.ppf((1 + level) / 2, len(logs) - 1)
                * np.std(logs, ddof=1) / math.sqrt(len(logs)))  # fmt: skip
        speed = row["speedup_ci"]
        assert speed["ratio"] == pytest.approx(math.exp(np.mean(logs)), rel=1e-9)
        assert speed["low"] == pytest.approx(math.exp(np.mean(logs) - half), rel=1e-9)
        assert speed["high"] == pytest.approx(math.exp(np.mean(logs) + half), rel=1e-9)
        times = [v[2] for v in done[key].values()]
        ref_times = [v[2] for v in ref.values()]
        assert row["speedup"] == pytest.approx(np.mean(ref_times) / np.mean(times), rel=1e-9)
