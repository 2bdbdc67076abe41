"""Decisions of the ablation report and of the precision search at their edges: which runs are
compared and kept, where the verdict and non-inferiority rules draw their lines, what an arm's
lost runs do to its standing, and which candidate the search screens, certifies and records.

Sweeps are hand-made run directories (as in test_report.py); the search runs against a pool
that returns hand-chosen PSNRs instead of training. Every expected number is worked out by
hand in the comments (Student t from the table: t(0.975, 1) = 12.706, t(0.975, 2) = 4.303).
"""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from report_runs import metrics as _metrics
from report_runs import write_run as _write

from mptex.report import collect_runs, stats, summarize, write_report
from mptex.report import markdown as md
from mptex.report.collect import concurrent_jobs, partial_keys
from mptex.search import driver
from mptex.search.config import check_search_config
from mptex.search.pool import RunPool, run_summary
from mptex.search.results import summarise
from mptex.search.space import enumerate_space, reference_candidate


# ----------------------------------------------------------------------------- builders
def _collapsed(arm, seed, t=0.1):
    # A plateau at 20.04 dB with 16 % of the covered pixels stuck in channel 2, above the
    # 13.36 dB baseline: the "plateau, stuck" collapse (the real-asset torus, tcnn_fused seed 1).
    psnrs = [20.03, 20.04, 20.04]
    history = [{"iteration": 800 * (i + 1), "loss": 0.03, "psnr": p,
                "stuck_fraction": [0.0, 0.0, 0.1616]} for i, p in enumerate(psnrs)]  # fmt: skip
    m = _metrics(arm, seed, psnr=psnrs[-1], t=t, baseline=13.36, iterations=2400,
                 iterations_planned=2400)  # fmt: skip
    m.update(history=history, saturation={"stuck_fraction": [0.0, 0.0, 0.1616],
                                          "saturated_fraction": [0.5, 0.3, 0.91]})  # fmt: skip
    return m


def _rows(folder):
    return {r["precision"]: r for r in summarize(collect_runs(folder))}


def _seeds(root, arm, psnrs, t, first=0, **kw):
    for seed, psnr in enumerate(psnrs, start=first):
        _write(root, f"{arm}_{seed}", _metrics(arm, seed, psnr=psnr, t=t, **kw))


def _report(root, margin_db=0.5):
    write_report(root, margin_db=margin_db)
    return (root / "report.md").read_text()


def _line(text, start):
    return next((line for line in text.splitlines() if line.startswith(start)), None)


# ----------------------------------------------------------------------------- rule boundaries
def test_an_interval_whose_lower_end_is_exactly_minus_the_margin_is_non_inferior():
    # "at or above -m": the end itself counts (as the margin's ends count for the verdict).
    row = {"precision": "bf16", "verdict": "worse", "delta": {"low": -0.5, "high": -0.1, "n": 3},
           "diverged": 0, "collapsed": 0, "failed": 0}  # fmt: skip
    assert stats.non_inferior(row, 0.5) and stats.at_reference_quality(row, 0.5)
    below = {**row, "delta": {"low": -0.5000001, "high": -0.1, "n": 3}}
    assert not stats.non_inferior(below, 0.5)


@pytest.mark.parametrize(
    "verdict, low, high, cell",
    [("worse", -0.5, -0.1, "worse, by at most 0.5 dB"),
     ("better", 0.1, 0.5, "better, by at most 0.5 dB"),
     ("better", 0.1, 0.5000001, "better")],
)  # fmt: skip
def test_by_at_most_the_margin_includes_the_margins_ends(verdict, low, high, cell):
    # The verdict cell adds "by at most m dB" when the interval lies inside [-m, +m], ends
    # included (the same closed interval as "no detectable difference").
    row = {"precision": "bf16", "verdict": verdict, "delta": {"low": low, "high": high, "n": 3}}
    assert md.verdict_text(row, 0.5) == cell


@pytest.mark.parametrize("lost", ["collapsed", "failed"])
def test_an_arm_that_lost_a_run_to_collapse_or_failure_is_not_at_f32s_quality(tmp_path, lost):
    # bf16 is 6x faster and its three completed seeds are within 0.02 dB of f32 (diffs +0.01,
    # -0.01, +0.02: mean 0.0067, sd 0.0153, half width 4.303 * 0.0153 / sqrt(3) = 0.038, well
    # inside ±0.5), but its fourth run collapsed (or failed): it is never named the fastest arm
    # at f32's quality, and the reading says why.
    _seeds(tmp_path, "f32", [40.0, 41.0, 42.0, 43.0], t=0.30)
    _seeds(tmp_path, "bf16", [40.01, 40.99, 42.02], t=0.05)
    if lost == "collapsed":
        _write(tmp_path, "bf16_3", _collapsed("bf16", 3, t=0.05))
    else:
        _write(tmp_path, "bf16_3", _metrics("bf16", 3, t=0.05, status="failed", error="boom"))
    text = _report(tmp_path)
    row = _rows(tmp_path)["bf16"]
    assert row[lost] == 1 and row["n_seeds"] == 3 and row["verdict"] == "no detectable difference"
    assert stats.non_inferior(row, 0.5) and not stats.at_reference_quality(row, 0.5)
    assert "`f32` itself" in _line(text, "- Fastest arm")
    assert ("- Not at `f32`'s quality although the Δ of their completed runs is within 0.5 dB: "
            f"`bf16` (1 {lost} of 4 runs).") in text  # fmt: skip


def test_an_arm_clearly_worse_with_a_diverged_run_is_not_listed_as_within_the_margin(tmp_path):
    # fp8: diffs -2.0, -2.1, -1.9 (mean -2, half width 4.303 * 0.1 / sqrt(3) = 0.248: interval
    # [-2.25, -1.75], outside the margin) and a diverged seed. The line "within 0.5 dB although
    # runs were lost" is for arms whose completed runs are within the margin: not this one.
    _seeds(tmp_path, "f32", [40.0, 41.0, 42.0, 43.0], t=0.30)
    _seeds(tmp_path, "fp8", [38.0, 38.9, 40.1], t=0.05)
    _write(tmp_path, "fp8_3", _metrics("fp8", 3, t=0.05, status="diverged", diverged_at=7))
    text = _report(tmp_path)
    assert _rows(tmp_path)["fp8"]["verdict"] == "worse"
    assert "although the Δ of their completed runs" not in text
    assert "Worse than `f32`: `fp8`" in text


# ----------------------------------------------------------------------------- pairing
def test_a_diverged_run_whose_f32_partner_collapsed_is_not_listed_as_excluded(tmp_path):
    # f32 seed 1 collapsed; bf16 seed 1 diverged. Only completed runs are taken out of the pairs
    # by a partner's collapse: the diverged run was never a pair, it is counted as diverged.
    for seed in (0, 2, 3):
        _write(tmp_path, f"f32_{seed}", _metrics("f32", seed, psnr=40.0 + seed))
        _write(tmp_path, f"bf16_{seed}", _metrics("bf16", seed, psnr=39.9 + seed))
    _write(tmp_path, "f32_1", _collapsed("f32", 1))
    _write(tmp_path, "bf16_1", _metrics("bf16", 1, status="diverged", diverged_at=5))
    rows = _rows(tmp_path)
    assert rows["bf16"]["excluded"] == [] and rows["bf16"]["diverged"] == 1
    assert [s for s, _ in rows["bf16"]["pairs"]] == [0, 2, 3]
    assert rows["f32"]["excluded"] == [{"seed": 1, "run_dir": "f32_1", "why": "collapsed"}]
    text = _report(tmp_path)
    assert "- Excluded from the paired differences: `f32` seed 1 (collapsed). A collapse" in text


def test_a_completed_run_whose_f32_partner_collapsed_is_left_out_of_the_pairs(tmp_path):
    # f32 seed 1 collapsed at 20.04 dB; bf16 completed every seed. Seed 1's difference (+20.9
    # dB, a collapse, not a precision effect) is not a pair: Δ over seeds 0, 2, 3 is -0.1,
    # -0.2, 0.0: mean -0.1, sd 0.1, half 4.3027 * 0.1 / sqrt(3) = 0.2484, [-0.348, +0.148].
    for seed in (0, 2, 3):
        _write(tmp_path, f"f32_{seed}", _metrics("f32", seed, psnr=40.0 + seed))
    _write(tmp_path, "f32_1", _collapsed("f32", 1))
    for seed, psnr in enumerate((39.9, 40.95, 41.8, 43.0)):
        _write(tmp_path, f"bf16_{seed}", _metrics("bf16", seed, psnr=psnr))
    bf16 = _rows(tmp_path)["bf16"]
    assert [s for s, _ in bf16["pairs"]] == [0, 2, 3]
    assert bf16["excluded"] == [{"seed": 1, "run_dir": "bf16_1", "why": "its f32 run collapsed"}]
    assert bf16["delta"]["n"] == 3
    assert bf16["delta"]["mean"] == pytest.approx(-0.1, abs=1e-9)
    assert bf16["delta"]["low"] == pytest.approx(-0.1 - 4.302653 * 0.1 / 3**0.5, abs=1e-6)
    assert bf16["verdict"] == "no detectable difference"


def test_only_an_inconclusive_row_gets_a_count_of_seeds_to_settle_it(tmp_path):
    # bf16: Δ -1.0, -1.1, -1.2, [-1.348, -0.852]: worse, settled (one more seed would also
    # exclude 0, but nothing is left to settle); amp: Δ -0.6, +0.4, -0.3, mean -0.1667, sd 0.513,
    # half 1.274: inconclusive, and it gets its estimate.
    for seed in range(3):
        _write(tmp_path, f"f32_{seed}", _metrics("f32", seed, psnr=40.0 + seed))
        _write(tmp_path, f"bf16_{seed}", _metrics("bf16", seed, psnr=39.0 + seed - 0.1 * seed))
        amp = 40.0 + seed + (-0.6, 0.4, -0.3)[seed]
        _write(tmp_path, f"amp_{seed}", _metrics("amp", seed, psnr=amp))
    rows = _rows(tmp_path)
    assert rows["bf16"]["verdict"] == "worse" and rows["bf16"]["seeds_to_settle"] is None
    assert rows["amp"]["verdict"] == "inconclusive"
    assert rows["amp"]["seeds_to_settle"] == stats.seeds_to_settle(rows["amp"]["delta"], 0.5)
    assert rows["amp"]["seeds_to_settle"] is not None


def test_an_arm_is_never_paired_with_f32_of_another_scene(tmp_path):
    # bf16 ran on two meshes, f32 only on the cube: the duck's bf16 row has no reference (it
    # is "not compared"), and the cube's is paired with the cube's f32 (diffs -1.0 each).
    for mesh in ("duck.obj", "cube.obj"):
        for seed in range(3):
            config = {"scene.path": mesh}
            if mesh == "cube.obj":
                _write(
                    tmp_path,
                    f"f32_{mesh}_{seed}",
                    _metrics("f32", seed, psnr=40.0 + seed, scene="mesh", config=config),
                )
            _write(
                tmp_path,
                f"bf16_{mesh}_{seed}",
                _metrics("bf16", seed, psnr=39.0 + seed, scene="mesh", config=config),
            )
    rows = {(r["precision"], r["keys"]["scene.path"]): r
            for r in summarize(collect_runs(tmp_path))}  # fmt: skip
    duck, cube = rows[("bf16", "duck.obj")], rows[("bf16", "cube.obj")]
    assert duck["reference"] is None and duck["verdict"] is None and duck["pairs"] == []
    assert cube["pairs"] == [[0, -1.0], [1, -1.0], [2, -1.0]]
    text = _report(tmp_path)
    assert "| `bf16` | `duck.obj` | 3 | 40.00 ± 1.00 | – | no reference |" in text
    assert "| `bf16` | `cube.obj` | 3 | 40.00 ± 1.00 | -1.00 [-1.00, -1.00] | worse |" in text


def test_a_run_exactly_at_the_constant_colour_baseline_is_flagged(tmp_path):
    # "at or below the baseline": a PSNR equal to it learned nothing beyond the mean colour.
    _write(tmp_path, "0", _metrics("f32", 0, psnr=20.0, baseline=20.0))
    _write(tmp_path, "1", _metrics("f32", 1, psnr=20.5, baseline=20.0))
    assert _rows(tmp_path)["f32"]["below_baseline"] == ["0"]


def test_the_reference_row_has_no_unpaired_seeds(tmp_path):
    # The reference is not compared with itself: none of its seeds is "completed but unpaired".
    _seeds(tmp_path, "f32", [40.0, 41.0, 42.0], t=0.3)
    _seeds(tmp_path, "bf16", [40.1, 41.0], t=0.1)
    rows = _rows(tmp_path)
    assert rows["f32"]["unpaired_seeds"] == [] and rows["f32"]["pairs"] == []
    assert rows["bf16"]["unpaired_seeds"] == []  # seeds 0, 1 both paired


def test_an_arm_sharing_no_seed_with_f32_has_no_paired_seeds(tmp_path):
    # bf16 ran seeds 3, 4, 5 and f32 seeds 0, 1, 2: nothing to pair, which is not the "cannot
    # judge" of a single pair. f16_naive completed nothing: it belongs in the diverged line,
    # not in the line about seeds without a partner.
    _seeds(tmp_path, "f32", [40.0, 41.0, 42.0], t=0.3)
    _seeds(tmp_path, "bf16", [43.0, 44.0, 45.0], t=0.1, first=3)
    _write(tmp_path, "naive_0", _metrics("f16_naive", 0, status="diverged", diverged_at=3))
    rows = _rows(tmp_path)
    assert rows["bf16"]["verdict"] == "no paired seeds" and rows["bf16"]["pairs"] == []
    assert rows["f16_naive"]["verdict"] == "no paired seeds" and rows["f16_naive"]["n_seeds"] == 0
    text = _report(tmp_path)
    # No Δ to quote: the arm is named without an empty "(– dB)".
    assert _line(text, "- No seed completed in both the arm and `f32`:") == (
        "- No seed completed in both the arm and `f32`: `bf16`."
    )
    assert "Cannot judge" not in text
    # Its verdict cell is "–", and the key under the tables says what that verdict means.
    assert "| `bf16` | 3 | 44.00 ± 1.00 | – | – |" in text
    assert "(`–` where no seed completed in both the arm and `f32`)" in text


def test_one_pair_for_one_arm_and_none_for_another_is_at_most_one_per_arm(tmp_path):
    # bf16 shares seed 0 with f32 (one pair); fp8 ran seed 5 only (no pair). No interval
    # anywhere: the headline counts the pairs per arm, and fp8 has none, not one.
    _seeds(tmp_path, "f32", [40.0, 41.0], t=0.3)
    _seeds(tmp_path, "bf16", [40.5], t=0.1)
    _seeds(tmp_path, "fp8", [40.5], t=0.1, first=5)
    text = _report(tmp_path)
    assert "- Cannot judge any arm against `f32`: at most 1 paired seed per arm," in text


def test_two_pairs_are_enough_for_a_headline_beside_an_arm_with_one(tmp_path):
    # bf16 has 2 pairs (diffs +0.10, +0.12: mean 0.11, sd 0.01414, half width
    # 12.706 * 0.01414 / sqrt(2) = 0.127: [-0.017, +0.237], within ±0.5); amp has 1 pair only.
    # One arm with an interval is enough for the reading to name the fastest arm.
    _seeds(tmp_path, "f32", [40.0, 41.0], t=0.3)
    _seeds(tmp_path, "bf16", [40.1, 41.12], t=0.1)
    _seeds(tmp_path, "amp", [40.0], t=0.2)
    text = _report(tmp_path)
    rows = _rows(tmp_path)
    assert rows["bf16"]["delta"]["low"] == pytest.approx(0.11 - 0.127, abs=1e-3)
    assert rows["amp"]["verdict"] == "cannot judge"
    assert "**`bf16`**" in _line(text, "- Fastest arm at `f32`'s quality:")
    assert "Cannot judge any arm" not in text


def test_a_zero_difference_on_every_seed_is_named_identical_not_zero_spread(tmp_path):
    # bf16 reproduced f32 to the bit on every seed: Δ = 0 with sd 0 is named by the
    # bit-identical line; the zero-spread warning is for a constant non-zero Δ.
    _seeds(tmp_path, "f32", [40.0, 41.0, 42.0], t=0.3)
    _seeds(tmp_path, "bf16", [40.0, 41.0, 42.0], t=0.1)
    text = _report(tmp_path)
    assert "Zero spread" not in text
    assert "- `f32` and `bf16` gave bit-identical PSNR for every seed" in text


def test_a_small_constant_difference_is_printed_in_the_zero_spread_line_as_in_its_cell(tmp_path):
    # bf16 is 2^-8 = 0.00390625 dB below f32 on every seed (exact in binary, so the spread is
    # exactly 0): the interval is the point -0.0039, wholly below 0, and the verdict is worse.
    # Two decimals print -0.00, which reads as no difference; the cell prints -0.004, and the
    # zero-spread line must print the same number.
    _seeds(tmp_path, "f32", [40.0, 41.0, 42.0], t=0.3)
    _seeds(tmp_path, "bf16", [40.0 - 2**-8, 41.0 - 2**-8, 42.0 - 2**-8], t=0.1)
    text = _report(tmp_path)
    assert _rows(tmp_path)["bf16"]["verdict"] == "worse"
    assert "- Worse than `f32`: `bf16` (-0.004 [-0.004, -0.004] dB)." in text
    assert "- Zero spread: `bf16` (Δ -0.004 dB on each of 3 seeds)." in text


def test_psnrs_and_times_whose_sum_overflows_float64_are_reported(tmp_path):
    # Two seeds at PSNR 1e308 dB and 1.5e308 s per iteration (valid JSON, finite numbers): the
    # sums overflow float64, the means do not. The report is written, not refused; f32 and
    # bf16 agree on each seed: Δ 0 on both, the speed-up 1 on both.
    for arm in ("f32", "bf16"):
        _seeds(tmp_path, arm, [1e308, 1e308], t=1.5e308)
    text = _report(tmp_path)
    rows = _rows(tmp_path)
    assert rows["bf16"]["psnr_mean"] == 1e308 and rows["bf16"]["time_per_iter_s"] == 1.5e308
    assert rows["bf16"]["delta"]["mean"] == 0.0 and rows["bf16"]["speedup_ci"]["ratio"] == 1.0
    assert "| `bf16` | 2 | " in text


def test_a_zero_difference_on_every_paired_seed_beside_an_unpaired_one_is_zero_spread(tmp_path):
    # bf16 equals f32 to the bit on seeds 0-2 and also ran seed 3, which f32 did not: the rows
    # are not bit-identical (bf16 has a seed more), yet the interval is [0, 0], without width.
    # The zero-spread line names it (docs/report.md: a line names every such interval).
    _seeds(tmp_path, "f32", [40.0, 41.0, 42.0], t=0.3)
    _seeds(tmp_path, "bf16", [40.0, 41.0, 42.0, 45.0], t=0.1)
    text = _report(tmp_path)
    assert "bit-identical" not in text
    assert "- Zero spread: `bf16` (Δ +0.00 dB on each of 3 seeds)." in text


# ----------------------------------------------------------------------------- reading runs
def test_a_completed_run_is_counted_before_an_unavailable_one_of_its_seed(tmp_path):
    # tcnn_fused refused at start on a machine without tinycudann (unavailable), then run
    # elsewhere: the completed run is counted, whatever the directories' order.
    why = "precision.mlp_backend='tcnn' needs tinycudann and a CUDA device"
    refused = _metrics("tcnn_fused", 0, status="failed", failed_at="start", error=why)
    refused["config"]["precision"]["mlp_backend"] = "tcnn"
    done = _metrics("tcnn_fused", 0, psnr=41.0)
    done["config"]["precision"]["mlp_backend"] = "tcnn"
    _write(tmp_path, "a/0", refused)
    _write(tmp_path, "b/0", done)
    (row,) = summarize(collect_runs(tmp_path))
    assert row["completed"] == 1 and row["unavailable"] == 0 and row["psnr_mean"] == 41.0


def test_seeds_are_ordered_as_numbers(tmp_path):
    # Seeds 2 and 10: 2 first (as text, "10" < "2").
    for seed in (10, 2):
        _write(tmp_path, f"f32_{seed}", _metrics("f32", seed, psnr=40.0 + seed))
        _write(tmp_path, f"bf16_{seed}", _metrics("bf16", seed, psnr=39.0 + seed))
    assert [r["seed"] for r in collect_runs(tmp_path)] == [2, 10, 2, 10]
    rows = _rows(tmp_path)
    assert rows["f32"]["seeds"] == [2, 10]
    assert rows["bf16"]["pairs"] == [[2, -1.0], [10, -1.0]]


def test_a_resumed_run_stays_in_its_arms_row(tmp_path):
    # seed 1 was stopped and resumed (train.resume=true): how it was driven, not what it
    # computed, so no row of its own.
    for seed in range(3):
        config = {"train.resume": seed == 1}
        _write(tmp_path, f"f32_{seed}", _metrics("f32", seed, psnr=40.0 + seed, config=config))
    rows = summarize(collect_runs(tmp_path))
    assert len(rows) == 1 and rows[0]["seeds"] == [0, 1, 2]


def test_a_rerun_that_only_checkpoints_or_writes_images_differently_stays_in_its_row(tmp_path):
    # How often a run checkpoints, how many validation images it writes and which signals stop
    # it change no result (the same weights and PSNR): seed 2 was rerun with other such
    # settings, and stays a seed of its arm. A learning rate does change the result.
    default = {"train.checkpoint_interval": 100, "train.n_val_images": 4,
               "train.stop_signals": ["SIGTERM", "SIGINT"]}  # fmt: skip
    driven = [default, {**default, "train.checkpoint_interval": 1, "train.n_val_images": 0},
              {**default, "train.stop_signals": ["SIGTERM"]}]  # fmt: skip
    for seed in range(3):
        _write(tmp_path, f"f32_{seed}", _metrics("f32", seed, psnr=40.0, config=driven[seed]))
    _write(tmp_path, "f32_lr", _metrics("f32", 3, psnr=40.0, config={**default, "train.lr": 0.5}))
    rows = summarize(collect_runs(tmp_path))
    assert sorted(r["seeds"] for r in rows) == [[0, 1, 2], [3]]


def test_partial_keys_are_the_train_and_texture_groups_only(tmp_path):
    # A mesh scene has scene.path, the built-in one none: that follows from the scene, it is not
    # a key of another mptex version.
    _write(tmp_path, "0", _metrics("f32", 0))
    _write(tmp_path, "1", _metrics("f32", 0, scene="mesh", config={"scene.path": "duck.obj"}))
    assert partial_keys(collect_runs(tmp_path)) == {}


def test_a_joblib_sweep_of_one_job_at_a_time_is_not_shared(tmp_path):
    # n_jobs: 1 runs one job at a time: 1, not "as many as the machine's cores" (0).
    (tmp_path / "multirun.yaml").write_text(
        "hydra:\n  launcher:\n    _target_: hydra_plugins.hydra_joblib_launcher.joblib_launcher."
        "JoblibLauncher\n    n_jobs: 1\n"
    )
    assert concurrent_jobs(tmp_path) == 1


_SUBMITIT_LOCAL = (
    "hydra:\n"
    "  launcher:\n"
    "    _target_: hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher\n"
    "  sweeper:\n"
    "    _target_: hydra._internal.core_plugins.basic_sweeper.BasicSweeper\n"
    "    params:\n"
    "      precision: f32,bf16,fp8\n"
    "      train.seed: 0,1\n"
)


@pytest.mark.parametrize("batch, shared", [("", 6), ("    max_batch_size: 4\n", 4),
                                           ("    max_batch_size: 10\n", 6)])  # fmt: skip
def test_submitit_local_runs_a_batch_of_jobs_at_once(tmp_path, batch, shared):
    # submitit's local launcher starts each job of a batch as its own process at once: the
    # 3 x 2 jobs planned, or the sweeper's batch when it is smaller.
    (tmp_path / "multirun.yaml").write_text(_SUBMITIT_LOCAL + batch)
    assert concurrent_jobs(tmp_path) == shared


# ----------------------------------------------------------------------------- nvdiffrec #154
def _gap_sweep(root, arms, seeds=range(3), **kw):
    for arm, (base, config) in arms.items():
        for seed in seeds:
            psnr = base + seed + (0.05 * seed if arm != "nvdiffrec" else 0.0)
            _write(root, f"{arm}_{seed}", _metrics(arm, seed, psnr=psnr, config=config, **kw))


def _gaps(root):
    write_report(root)
    return json.loads((root / "results.json").read_text())["nvdiffrec154"]


def test_nvdiffrec154_arms_with_their_own_loss_scaling_are_one_context(tmp_path):
    # Each arm sets its own precision.loss_scaling (a function of the arm, as in the real
    # configs): that is no setting swept within an arm, so the arms are still paired.
    # diffs -2.0, -1.95, -1.9: mean -1.95, sd 0.05, half width 4.303 * 0.05 / sqrt(3) = 0.124.
    _gap_sweep(
        tmp_path,
        {
            "nvdiffrec": (30.0, {"precision.loss_scaling": "nvdiffrec"}),
            "tcnn_fused_swap154": (28.0, {"precision.loss_scaling": "tcnn"}),
        },
    )
    (gap,) = _gaps(tmp_path)
    assert gap["context"] == {}
    assert gap["gap"]["n"] == 3
    assert gap["gap"]["final"]["mean"] == pytest.approx(-1.95)
    assert gap["gap"]["final"]["half_width"] == pytest.approx(4.303 * 0.05 / 3**0.5, abs=1e-3)


def test_nvdiffrec154_prints_the_digits_a_small_gap_needs_beside_its_verdict(tmp_path):
    # The swap is 0.003, 0.004, 0.005 dB above nvdiffrec on seeds 0, 1, 2: mean 0.004, sd
    # 0.001, half width 4.303 * 0.001 / sqrt(3) = 0.0025, so [+0.0015, +0.0065]: better. At two
    # decimals the lower end prints +0.00, which reads as touching 0; three say +0.002.
    for seed in range(3):
        _write(tmp_path, f"nvdiffrec_{seed}", _metrics("nvdiffrec", seed, psnr=30.0 + seed))
        psnr = 30.0 + seed + 0.003 + 0.001 * seed
        _write(tmp_path, f"swap_{seed}", _metrics("tcnn_fused_swap154", seed, psnr=psnr))
    write_report(tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert ("| **the gap: the swap as #154 made it** | `tcnn_fused_swap154` − `nvdiffrec` | 3 | "
            "+0.004 [+0.002, +0.006] | better |") in text  # fmt: skip
    # The curve (the same differences at both validations) prints them the same way.
    assert "| ΔPSNR (dB) | +0.004 [+0.002, +0.006] | +0.004 [+0.002, +0.006] |" in text


def test_nvdiffrec154_curve_only_at_iterations_every_pair_has(tmp_path):
    # The swap's seed 2 has no validation at iteration 10: a mean over two of the three pairs
    # there would mix seeds; the curve keeps iteration 20 only.
    _gap_sweep(tmp_path, {"nvdiffrec": (30.0, None), "tcnn_fused_swap154": (28.0, None)})
    job = tmp_path / "tcnn_fused_swap154_2" / "metrics.json"
    metrics = json.loads(job.read_text())
    metrics["history"] = metrics["history"][1:]
    job.write_text(json.dumps(metrics))
    (gap,) = _gaps(tmp_path)
    assert sorted(gap["gap"]["curve"]) == ["20"]
    assert gap["gap"]["curve"]["20"]["n"] == 3


def test_nvdiffrec154_leaves_a_collapsed_run_out_of_its_pairs(tmp_path):
    # nvdiffrec's seed 1 collapsed: the gap is over seeds 0 and 2 (diffs -2.0, -1.9).
    _gap_sweep(tmp_path, {"nvdiffrec": (30.0, None), "tcnn_fused_swap154": (28.0, None)})
    (tmp_path / "nvdiffrec_1" / "metrics.json").write_text(json.dumps(_collapsed("nvdiffrec", 1)))
    (gap,) = _gaps(tmp_path)
    assert gap["gap"]["n"] == 2
    assert gap["gap"]["final"]["mean"] == pytest.approx(-1.95)


def test_nvdiffrec154_does_not_flag_the_fused_network_against_f32(tmp_path):
    # tcnn_fused - f32 compares two implementations by design (tinycudann's network against
    # the f32 twin); only the switch terms against tcnn_fused are meant to differ in one effect.
    backends = {
        "tcnn": {"encoder": "triton", "mlp": "tcnn", "raster": "nvdiffrast"},
        "torch": {"encoder": "triton", "mlp": "torch", "raster": "nvdiffrast"},
    }
    arms = {"nvdiffrec": "torch", "tcnn_fused_swap154": "tcnn", "tcnn_fused": "tcnn",
            "f32": "torch"}  # fmt: skip
    for arm, mlp in arms.items():
        for seed in range(2):
            _write(tmp_path, f"{arm}_{seed}", _metrics(arm, seed, psnr=30.0 + 0.1 * seed,
                                                       backends=backends[mlp]))  # fmt: skip
    text = _report(tmp_path)
    row = next(line for line in text.splitlines() if "`tcnn_fused` − `f32`" in line)
    assert "| 2 |" in row and "not like for like" not in row


# ----------------------------------------------------------------------------- the search
_NAMES = {"ref": "e32-f32.f32-none", "enc": "e16-f32.f32-dyn", "l0": "e32-f16.f32-dyn",
          "l1": "e32-f32.f16-dyn"}  # fmt: skip


class _Pool:
    """Runs that return hand-chosen results at once: ``table[(short name, seed)]`` is a PSNR
    difference to f32 (f32 itself: 30 + seed) or a full result dict."""

    def __init__(self, table):
        self.table, self.results, self.jobs = table, {}, []
        self.base = {"scene": {"name": "builtin"}}
        self.trained = self.reused = 0
        self.short = {v: k for k, v in _NAMES.items()}

    def run(self, jobs):
        for c, seed in jobs:
            self.jobs.append((self.short.get(c.name, c.name), seed))
            ref = 30.0 + seed
            entry = self.table.get((self.short.get(c.name), seed), 0.0)
            if c.name == _NAMES["ref"]:
                entry = {}
            if not isinstance(entry, dict):
                entry = {"psnr": ref + entry}
            self.results[(c.name, seed)] = {"status": "completed", "psnr": ref,
                                            "time_per_iter_s": 0.01, "device": "cpu",
                                            "ran_beside": 0, **entry}  # fmt: skip
            self.trained += 1


def _state(tmp_path, table, costs, **search):
    # Two layers; the space: grid f16/f32, layers f32/f16, masters, no scaling or dynamic. The
    # one-part screens are then enc, l0 and l1 (_NAMES); no combination or variant is screened.
    space = {"encoder_dtypes": ["f16", "f32"], "layer_dtypes": ["f32", "f16"],
             "master_weights": [True], "loss_scaling": ["none", "dynamic"], "fused": False,
             "quantized": []}  # fmt: skip
    settings = check_search_config({"certify_seeds": 2, "max_combinations": 0,
                                    "max_variants": 0, "workers": 1, "space": space,
                                    **search})  # fmt: skip
    kept, pruned = enumerate_space(2, 32, settings["space"])
    ref = reference_candidate(2)
    kept = set(kept) | {ref}
    cost = {_NAMES[k]: v for k, v in {"ref": 10.0, **costs}.items()}
    model = {c.name: {"seconds": cost.get(c.name, 5.0), "parts": []} for c in kept}
    result = tmp_path / "configs" / "precision" / "t.yaml"
    return driver.SearchState(
        settings=settings, ref=ref, kept=kept, pruned=pruned, model=model, points=1,
        shape=SimpleNamespace(), name="t", result_path=result, out=tmp_path, start=0.0,
        pool=_Pool(table),
    )  # fmt: skip


def _search(state, monkeypatch):
    monkeypatch.setattr(driver, "write_results", lambda state, certified: certified)
    return driver._search(state).name


_COSTS = {"enc": 7.0, "l0": 8.0, "l1": 9.0}


def test_a_screen_passes_on_the_size_of_the_difference_both_ways(tmp_path, monkeypatch):
    # At the screens' seed 0 the grid's lowering is 2 dB worse and layer 0's 2 dB better: both
    # fail |Δ| <= 0.5, although both would certify on seeds 1, 2 (Δ 0.0 there). layer 1 (Δ 0.3)
    # passes and certifies (its interval over Δ 0.0, 0.0 is [0, 0]).
    table = {("enc", 0): -2.0, ("l0", 0): 2.0, ("l1", 0): 0.3}
    state = _state(tmp_path, table, _COSTS)
    assert _search(state, monkeypatch) == _NAMES["l1"]
    # the one-part screens take the first kept loss scaling of dynamic, static, none: "-dyn"
    screens = sorted(job for job in state.pool.jobs if job[0] != "ref" and job[1] == 0)
    assert screens == [("enc", 0), ("l0", 0), ("l1", 0)]
    assert ("enc", 1) not in state.pool.jobs and ("l0", 1) not in state.pool.jobs
    rows = {r["candidate"]: r for r in summarise(state, state.ref)["candidates"]}
    assert [rows[_NAMES[k]]["screen_passed"] for k in ("enc", "l0", "l1")] == [False, False, True]


def test_delta_is_the_candidate_minus_f32(tmp_path, monkeypatch):
    # f32 at seed 1: 31.0; the grid's lowering 30.6: Δ = 30.6 - 31.0 = -0.4 dB (a loss < 0).
    state = _state(tmp_path, {("enc", 1): -0.4, ("enc", 2): -0.3}, _COSTS)
    _search(state, monkeypatch)
    c = next(c for c in state.kept if c.name == _NAMES["enc"])
    assert state.delta(c, 1) == pytest.approx(-0.4)
    row = next(r for r in summarise(state, c)["candidates"] if r["candidate"] == c.name)
    assert row["delta_db"]["1"] == pytest.approx(-0.4)
    # the certificate over Δ -0.4, -0.3: mean -0.35, half width 12.706 * 0.0707 / sqrt(2) = 0.635
    assert row["certificate"]["mean"] == pytest.approx(-0.35)
    assert row["certificate"]["low"] == pytest.approx(-0.35 - 0.635, abs=1e-3)


def test_a_certification_run_that_did_not_complete_certifies_nothing(tmp_path, monkeypatch):
    # The grid's lowering passes its screen; at seed 2 it diverged: no certificate, f32 is the
    # answer (l0 and l1 fail their screens).
    table = {("enc", 2): {"status": "diverged", "psnr": None}, ("l0", 0): 1.0, ("l1", 0): 1.0}
    state = _state(tmp_path, table, _COSTS)
    assert _search(state, monkeypatch) == _NAMES["ref"]
    c = next(c for c in state.kept if c.name == _NAMES["enc"])
    cert = state.certificate(c)
    assert cert["certified"] is False and cert["n"] == 1
    assert cert["reason"] == "runs not completed: ['completed', 'diverged']"


def test_only_candidates_cheaper_than_f32_are_certified(tmp_path, monkeypatch):
    # Every lowering passes and would certify (Δ 0 everywhere), but the model finds the grid's
    # lowering dearer than f32 (12 against 10) and the layers' too: f32 is the answer, and none
    # is run at the certification seeds.
    state = _state(tmp_path, {}, {"enc": 12.0, "l0": 10.5, "l1": 11.0})
    assert _search(state, monkeypatch) == _NAMES["ref"]
    assert not [job for job in state.pool.jobs if job[0] != "ref" and job[1] > 0]


def test_at_most_max_certify_candidates_are_certified(tmp_path, monkeypatch):
    # max_certify 1: the cheapest passing candidate (enc) fails its certification (Δ -1.0,
    # -1.2: worse); l0 would certify but is never tried.
    table = {("enc", 1): -1.0, ("enc", 2): -1.2}
    state = _state(tmp_path, table, _COSTS, max_certify=1)
    assert _search(state, monkeypatch) == _NAMES["ref"]
    assert ("l0", 1) not in state.pool.jobs and ("l0", 2) not in state.pool.jobs


def test_the_cheapest_certified_candidate_is_the_answer(tmp_path, monkeypatch):
    # All three certify (Δ 0); layer 1's lowering is the cheapest (6), though its name sorts
    # last: it is the answer, and the dearer ones are not certified after it.
    state = _state(tmp_path, {}, {"enc": 7.0, "l0": 8.0, "l1": 6.0})
    assert _search(state, monkeypatch) == _NAMES["l1"]
    certified = [job for job in state.pool.jobs if job[0] != "ref" and job[1] > 0]
    assert certified == [("l1", 1), ("l1", 2)]


def test_summary_uses_the_median_measured_time_and_orders_rows_by_the_cost_used(tmp_path):
    # l1 ran alone on a GPU at 4, 2 and 3 ms / iteration (seeds 0, 1, 2): its cost is the
    # median, 3 ms, which puts it before every modelled cost (enc 7 s, l0 8 s, f32 10 s).
    cuda = {"device": "cuda:0", "ran_beside": 0}
    table = {("l1", s): {"psnr": 30.0 + s, "time_per_iter_s": t, **cuda}
             for s, t in ((0, 0.004), (1, 0.002), (2, 0.003))}  # fmt: skip
    state = _state(tmp_path, table, _COSTS)
    l1 = next(c for c in state.kept if c.name == _NAMES["l1"])
    enc = next(c for c in state.kept if c.name == _NAMES["enc"])
    state.pool.run([(state.ref, s) for s in (0, 1, 2)] + [(l1, s) for s in (0, 1, 2)]
                   + [(enc, 0)])  # fmt: skip
    state.stages.update({state.ref.name: "reference", l1.name: "screen: one part",
                         enc.name: "screen: one part"})  # fmt: skip
    rows = summarise(state, l1)["candidates"]
    assert [r["candidate"] for r in rows] == [l1.name, enc.name, state.ref.name]
    assert rows[0]["measured_s"] == 0.003 and rows[0]["cost_source"] == "measured"


# ----------------------------------------------------------------------------- the search's pool
def _pool(tmp_path):
    settings = {"workers": 1, "threads": 1}
    return RunPool({"train": {}}, tmp_path, settings, SimpleNamespace(received=[]))


@pytest.mark.parametrize("status, read_back",
                         [("completed", True), ("diverged", True), ("failed", False),
                          ("interrupted", False)])  # fmt: skip
def test_finished_runs_are_completed_or_diverged(tmp_path, status, read_back):
    # A diverged run is a result (read back, never trained again); a failed or interrupted one
    # is trained (again).
    _write(tmp_path, "run", _metrics("f32", 0, status=status))
    got = _pool(tmp_path)._finished(tmp_path / "run")
    assert (got is not None) == read_back
    if read_back:
        assert got["status"] == status


def test_a_collapsed_run_is_not_completed_for_the_search(tmp_path):
    summary = run_summary(_collapsed("f32", 1))
    assert summary["status"] == "collapsed"
    assert summary["note"].startswith("16% of covered pixels stuck in channel 2")


def test_a_run_trained_alone_records_no_run_beside_it(tmp_path, monkeypatch):
    # One worker: the run had the device to itself, 0 runs beside it (in the result and in the
    # record kept beside metrics.json for a later search that reads it back).
    import mptex.search.pool as pool_module

    def train_run(cfg, run_dir):  # a run's directory and its result, without training
        Path(run_dir).mkdir(parents=True)
        return {"status": "completed", "psnr": 30.0}

    monkeypatch.setattr(pool_module, "_train_run", train_run)
    pool = _pool(tmp_path)
    ref = reference_candidate(2)
    pool.run([(ref, 0)])
    assert pool.results[(ref.name, 0)]["ran_beside"] == 0
    record = pool.run_dir(ref, 0) / "search_sharing.json"
    assert json.loads(record.read_text()) == {"ran_beside": 0}


def test_writing_the_reports_pdfs_logs_nothing_at_info(tmp_path, caplog):
    # Under Hydra the console shows INFO records; embedding fonts in the PDFs made fontTools
    # log hundreds of lines at the end of every sweep.
    import logging

    _seeds(tmp_path, "f32", [40.0, 41.0, 42.0], t=0.3)
    _seeds(tmp_path, "bf16", [40.1, 41.1, 42.2], t=0.1)
    with caplog.at_level(logging.INFO):
        _report(tmp_path)
    assert (tmp_path / "psnr_curves.pdf").is_file()
    noisy = [r for r in caplog.records if r.name.startswith("fontTools")]
    assert noisy == [], [r.getMessage() for r in noisy[:3]]
    assert logging.getLogger("fontTools").level == logging.NOTSET  # put back as it was


def test_an_arm_of_another_network_is_named_as_not_precision_alone(tmp_path):
    # tcnn's fused network against f32's linear layers: its Δ is the networks' difference too,
    # in report.md's reading and in results.tex (a mark and its caption note); bf16 shares
    # f32's network and gets neither.
    linear, fused = {"precision.mlp": "linear"}, {"precision.mlp": "fused"}
    _seeds(tmp_path, "f32", [40.0, 41.0, 42.0], t=0.3, config=linear)
    _seeds(tmp_path, "bf16", [40.1, 41.1, 42.2], t=0.1, config=linear)
    _seeds(tmp_path, "tcnn_fused", [42.0, 43.1, 44.0], t=0.2, config=fused)
    text = _report(tmp_path)
    lines = [line for line in text.splitlines() if line.startswith("- Not precision alone:")]
    assert len(lines) == 1 and lines[0].startswith(
        "- Not precision alone: `tcnn_fused` is tcnn's fully fused network ("
    ), lines
    assert "while `f32` is nvdiffrec's MLP (" in lines[0]
    assert "Better than `f32`: `tcnn_fused`" in text  # the verdict stands as measured
    tex = (tmp_path / "results.tex").read_text()
    assert r"\texttt{tcnn\_fused}\textsuperscript{\ddag} &" in tex
    assert r"\texttt{bf16} &" in tex and r"\texttt{bf16}\textsuperscript" not in tex
    assert "so its $\\Delta$ is not precision alone." in tex
    # Without another network in the sweep, neither the line nor the note.
    for job in tmp_path.glob("tcnn_fused_*"):
        for path in sorted(job.rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
        job.rmdir()
    text = _report(tmp_path)
    assert "- Not precision alone:" not in text
    assert r"\ddag" not in (tmp_path / "results.tex").read_text()


def test_unpaired_seeds_are_named_when_no_arm_can_be_judged(tmp_path):
    # f32 completed seed 0 only: every arm has one pair ("cannot judge"), and the seeds 1, 2
    # they completed are in their rows' seeds and PSNR but not in Δ: a line says so.
    _seeds(tmp_path, "f32", [40.0], t=0.3)
    _seeds(tmp_path, "bf16", [40.1, 41.1, 42.2], t=0.1)
    text = _report(tmp_path)
    assert _line(text, "- Cannot judge any arm against `f32`:") is not None
    assert _line(text, "- Completed but not paired") == (
        "- Completed but not paired (no completed `f32` run with that seed): `bf16` seeds 1, 2; "
        "in the row's seeds and PSNR, not in its Δ."
    )


def test_a_section_title_names_its_scene_once(tmp_path):
    # Two scenes, learning rate swept too: each section's title is "scene <name>" and the
    # shown keys outside the precision group, scene.name not repeated as a key.
    for scene in ("duck", "spot"):
        for lr in (0.01, 0.02):
            for arm in ("f32", "bf16"):
                _write(tmp_path, f"{scene}_{lr}_{arm}",
                       _metrics(arm, 0, scene=scene, config={"train.lr": lr}))  # fmt: skip
    rows = summarize(collect_runs(tmp_path))
    assert [(title, len(indices)) for title, indices in stats.sections(rows)] == [
        ("scene duck, train.lr=0.01", 2), ("scene duck, train.lr=0.02", 2),
        ("scene spot, train.lr=0.01", 2), ("scene spot, train.lr=0.02", 2),
    ]  # fmt: skip
