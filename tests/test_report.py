"""The ablation report on hand-made sweep directories (numbers chosen so results are exact)."""

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from report_runs import metrics as _metrics
from report_runs import write_run as _write

import mptex.report as report
from mptex.cli.report import report_main
from mptex.report import (
    REPORT_FILES,
    collect_runs,
    mean_ci,
    summarize,
    t_quantile,
    verdict,
    write_report,
)
from mptex.report.plots import ARM_COLORS, arm_color, error_gain, image_panels


def _rows(folder):
    return {(r["precision"], *(str(v) for k, v in r["keys"].items() if k != "precision.name")): r
            for r in summarize(collect_runs(folder))}  # fmt: skip


@pytest.fixture
def sweep(tmp_path):
    _write(tmp_path, "0", _metrics("f32", 0, psnr=30.0, t=0.10))
    _write(tmp_path, "1", _metrics("f32", 1, psnr=32.0, t=0.30))
    _write(tmp_path, "2", _metrics("bf16", 0, psnr=29.0, t=0.05))
    twins = {"encoder": "torch", "mlp": "torch", "raster": "torch"}
    _write(tmp_path, "3", _metrics("bf16", 1, psnr=29.0, t=0.15, backends=twins))
    _write(tmp_path, "4", _metrics("f16_naive", 0, status="diverged", diverged_at=3))
    why = ("precision.mlp_backend='tcnn' needs tinycudann and a CUDA device: "
           "torch.cuda.is_available() is False; the arm tcnn_fused runs on the CPU with "
           "mlp_backend='torch'")  # fmt: skip
    tcnn = _metrics("tcnn_fused", 0, status="failed", failed_at="start", error=why)
    tcnn["config"]["precision"]["mlp_backend"] = "tcnn"
    _write(tmp_path, "5", tcnn)
    crashed = tmp_path / "6" / ".hydra"  # killed before writing metrics.json
    crashed.mkdir(parents=True)
    (crashed / "config.yaml").write_text(
        "precision:\n  name: amp\nscene:\n  name: builtin\ntrain:\n  seed: 0\n"
    )
    return tmp_path


# ----------------------------------------------------------------------------- statistics
@pytest.mark.parametrize(
    "p, dof, table",
    # Student t table values (any statistics textbook), rounded to 3 decimals.
    [(0.975, 1, 12.706), (0.975, 2, 4.303), (0.975, 3, 3.182), (0.975, 5, 2.571),
     (0.975, 10, 2.228), (0.975, 30, 2.042), (0.995, 4, 4.604), (0.9, 7, 1.415)],
)  # fmt: skip
def test_t_quantile_matches_the_table(p, dof, table):
    assert t_quantile(p, dof) == pytest.approx(table, abs=5e-4)
    assert t_quantile(1 - p, dof) == pytest.approx(-table, abs=5e-4)


def test_t_quantile_tends_to_the_normal_and_rejects_bad_input():
    assert t_quantile(0.975, 1e6) == pytest.approx(1.959964, abs=1e-5)
    assert t_quantile(0.5, 3) == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError, match="p: expected"):
        t_quantile(1.0, 3)
    with pytest.raises(ValueError, match="dof: expected"):
        t_quantile(0.9, 0)


def test_confidence_interval_hand_computed():
    # differences [1, 2, 3]: mean 2, sample sd 1, t(0.975, 2) = 4.303 -> 2 ± 4.303 / sqrt(3)
    ci = mean_ci([1.0, 2.0, 3.0])
    assert ci["n"] == 3 and ci["mean"] == 2.0 and ci["sd"] == 1.0
    assert ci["half_width"] == pytest.approx(4.303 / math.sqrt(3), abs=1e-3)  # 2.484
    assert ci["low"] == pytest.approx(2 - 2.484, abs=1e-3)
    assert mean_ci([5.0])["half_width"] is None


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_confidence_interval_refuses_a_non_finite_value_in_one_line(bad):
    with pytest.raises(ValueError, match=r"^values: expected finite numbers, got .* at index 1$"):
        mean_ci([1.0, bad, 2.0])


def test_printed_bounds_keep_what_the_exact_ones_say_about_zero_and_the_margin():
    from mptex.report.markdown import interval_text

    # +0.004 printed +0.00 would touch 0 under "better": one more digit.
    assert interval_text({"mean": 0.1, "low": 0.004, "high": 0.196}, 0.5) == (
        "+0.100", "+0.004", "+0.196")  # fmt: skip
    # -0.5004 printed -0.50 (or -0.500) would lie inside the margin: four digits.
    assert interval_text({"mean": -0.2, "low": -0.5004, "high": 0.1}, 0.5)[1] == "-0.5004"
    assert interval_text({"mean": -2.1667, "low": -2.88, "high": -1.45}, 0.5) == (
        "-2.17", "-2.88", "-1.45")  # fmt: skip
    # Beyond six digits: the shortest text that reads back as the value.
    assert interval_text({"mean": 0.1, "low": 1e-9, "high": 0.2}, 0.5)[1] == "+1e-09"
    assert interval_text({"mean": -0.2, "low": -0.5000001, "high": 0.1}, 0.5)[1] == "-0.5000001"


@pytest.mark.parametrize(
    "low, high, expected",
    [(0.1, 0.4, "better"), (-2.0, -0.01, "worse"), (-0.3, 0.45, "no detectable difference"),
     (-0.6, 0.2, "inconclusive"), (None, None, "cannot judge"),
     (-0.5, 0.5, "no detectable difference")],  # the margin's ends count as inside it
)  # fmt: skip
def test_verdict_follows_the_interval(low, high, expected):
    assert verdict({"low": low, "high": high}, margin_db=0.5) == expected


# ----------------------------------------------------------------------------- rows
def test_summary_numbers(sweep):
    rows = _rows(sweep)
    f32, bf16 = rows[("f32",)], rows[("bf16",)]
    assert f32["psnr_mean"] == 31.0 and f32["n_seeds"] == 2
    assert f32["psnr_std"] == pytest.approx(math.sqrt(2.0))  # sample std of 30, 32
    # paired differences: seed 0: 29 - 30 = -1, seed 1: 29 - 32 = -3 -> mean -2, sd sqrt(2)
    assert bf16["pairs"] == [[0, -1.0], [1, -3.0]]
    assert bf16["delta"]["mean"] == pytest.approx(-2.0)
    assert bf16["delta"]["half_width"] == pytest.approx(12.706 * math.sqrt(2) / math.sqrt(2),
                                                        abs=1e-3)  # fmt: skip
    assert bf16["verdict"] == "inconclusive"
    assert bf16["speedup"] == pytest.approx(2.0)  # mean time 0.2 (f32) vs 0.1 (bf16)
    assert rows[("f16_naive",)]["diverged"] == 1 and rows[("f16_naive",)]["diverged_at"] == [3]
    assert rows[("tcnn_fused",)]["unavailable"] == 1 and rows[("tcnn_fused",)]["failed"] == 0
    assert rows[("amp",)]["failed"] == 1
    assert f32["underflow"]["net.0.grad_zero_frac"] == pytest.approx(0.25)


def test_report_files_and_rows(sweep):
    written = write_report(sweep)
    # images.png needs the jobs' validation PNGs (test_report_images below).
    assert set(REPORT_FILES) - {"images.png"} <= set(written)
    first = {}
    for name in ("psnr_curves.pdf", "loss_scale.pdf"):  # the curves as vector figures too
        first[name] = written[name].read_bytes()
        assert first[name].startswith(b"%PDF-")
        assert b"/Type3" not in first[name]  # TrueType fonts: venues refuse Type 3 ones
    rewritten = write_report(sweep)  # the same curves give the same bytes (no creation date)
    assert all(rewritten[name].read_bytes() == data for name, data in first.items())
    text = (sweep / "report.md").read_text()
    for arm in ("f32", "bf16", "f16_naive", "tcnn_fused", "amp"):
        assert f"| `{arm}` |" in text
    assert "Diverged: `f16_naive`" in text
    assert "Unavailable: `tcnn_fused`" in text
    assert "Failed: `amp`" in text
    assert "| `bf16` | 2 | 29.00 ± 0.00 | -2.00 [-14.71, +10.71] | inconclusive |" in text
    assert "t(0.975, n−1) · sd / √n" in text  # the method is stated
    assert "emulated" in text  # a CPU run's speed is flagged
    assert (
        "Backends that ran (encoder / MLP / rasterizer; torch = mptex's PyTorch twin): "
        "`bf16` torch / torch / torch" in text
    )


def test_results_json_equals_the_jobs_metrics(sweep):
    write_report(sweep)
    results = json.loads((sweep / "results.json").read_text())
    for job in sweep.iterdir():
        if (job / "metrics.json").is_file():
            metrics = json.loads((job / "metrics.json").read_text())
            key = (metrics["precision"], metrics["seed"])
            run = next(r for r in results["runs"] if (r["precision"], r["seed"]) == key)
            for field in ("psnr", "time_per_iter_s", "peak_memory_bytes", "skipped_steps"):
                assert run[field] == metrics[field]
    assert (sweep / "results.csv").read_text().count("\n") == 1 + 7


def test_no_reference_arm_and_all_failed(tmp_path):
    _write(tmp_path, "0", _metrics("bf16", 0, status="failed", error="boom", failed_at=2))
    write_report(tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert "Failed: `bf16` (1/1 runs: boom)" in text
    assert "No completed `f32` run" in text


def test_cli_errors_on_missing_directory(tmp_path, capsys):
    assert report_main([str(tmp_path / "nope")]) == 2
    assert "no such directory" in capsys.readouterr().err
    (tmp_path / "report.md").write_text("")
    assert report_main([str(tmp_path / "report.md")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("report.md: a file, not a directory (give the sweep's folder)")
    assert report_main([str(tmp_path), "--margin-db", "-1"]) == 2


def test_a_tcnn_run_refused_for_another_key_is_failed_not_unavailable(tmp_path):
    metrics = _metrics("tcnn_fused", 0, status="failed", failed_at="start",
                       error="train.iterations: expected an integer >= 0, got -1")  # fmt: skip
    metrics["config"]["precision"]["mlp_backend"] = "tcnn"
    _write(tmp_path, "0", metrics)
    (row,) = summarize(collect_runs(tmp_path))
    assert row["failed"] == 1 and row["unavailable"] == 0


# ----------------------------------------------------------------------------- the headline
def _three_seeds(root, arm, psnrs, t, **kw):
    for seed, psnr in enumerate(psnrs):
        _write(root, f"{arm}_{seed}", _metrics(arm, seed, psnr=psnr, t=t, **kw))


def _headline(text):
    return next(line for line in text.splitlines() if line.startswith("- Fastest arm"))


def test_headline_never_names_an_arm_the_interval_calls_worse(tmp_path):
    # A contradiction once seen: the fastest arm was named "within 0.1 dB" although its own
    # difference said otherwise. Here the fastest arm (bf16) is clearly worse, the next fastest
    # (amp) is inconclusive (spread too wide): neither may be named; nvdiffrec is better.
    _three_seeds(tmp_path, "f32", [40.0, 41.0, 42.0], t=0.30)
    _three_seeds(tmp_path, "bf16", [39.0, 39.9, 41.1], t=0.05)  # diffs -1.0, -1.1, -0.9
    _three_seeds(tmp_path, "amp", [42.0, 39.0, 42.0], t=0.10)  # diffs +2, -2, 0
    _three_seeds(tmp_path, "nvdiffrec", [41.5, 42.6, 43.55], t=0.20)  # diffs +1.5, +1.6, +1.55
    write_report(tmp_path)
    text = (tmp_path / "report.md").read_text()
    rows = _rows(tmp_path)
    assert rows[("bf16",)]["verdict"] == "worse"
    assert rows[("amp",)]["verdict"] == "inconclusive"
    assert rows[("nvdiffrec",)]["verdict"] == "better"
    headline = _headline(text)
    assert "**`nvdiffrec`**" in headline and "better" in headline
    assert "bf16" not in headline and "amp" not in headline
    assert "Worse than `f32`: `bf16`" in text


def test_headline_with_an_equivalent_faster_arm(tmp_path):
    _three_seeds(tmp_path, "f32", [40.0, 41.0, 42.0], t=0.30)
    _three_seeds(tmp_path, "bf16", [40.1, 40.9, 42.05], t=0.05)  # diffs +0.1, -0.1, +0.05
    write_report(tmp_path, margin_db=0.5)
    text = (tmp_path / "report.md").read_text()
    assert "no detectable difference within ±0.5 dB" in _headline(text)
    assert "**`bf16`**" in _headline(text)
    # A tighter margin than the interval: the same data no longer supports equivalence.
    write_report(tmp_path, margin_db=0.1)
    text = (tmp_path / "report.md").read_text()
    assert "`f32` itself" in _headline(text)
    assert "Inconclusive: `bf16`" in text


def test_a_small_loss_measured_precisely_is_worse_and_at_f32s_quality(tmp_path):
    # diffs -0.05, -0.04, -0.06: mean -0.05, sd 0.01, half width 4.303 * 0.01 / sqrt(3) = 0.0248:
    # [-0.075, -0.025], below 0 (worse) and above -0.5 (at most 0.5 dB worse).
    _three_seeds(tmp_path, "f32", [40.0, 41.0, 42.0], t=0.30)
    _three_seeds(tmp_path, "bf16", [39.95, 40.96, 41.94], t=0.05)
    write_report(tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert _rows(tmp_path)[("bf16",)]["verdict"] == "worse"
    headline = _headline(text)
    assert "**`bf16`**" in headline and "(worse, by at most 0.5 dB: Δ -0.05 dB" in headline
    assert "| -0.05 [-0.07, -0.03] | worse, by at most 0.5 dB |" in text


def test_an_arm_that_lost_runs_is_not_named_at_f32s_quality(tmp_path):
    # fp8's two completed seeds agree with f32 to 0.01 dB, but three of its five runs diverged.
    for seed in range(5):
        _write(tmp_path, f"f32_{seed}", _metrics("f32", seed, psnr=40.0 + seed, t=0.3))
        if seed < 2:
            psnr = 40.0 + seed + (0.01, -0.01)[seed]
            _write(tmp_path, f"fp8_{seed}", _metrics("fp8", seed, psnr=psnr, t=0.05))
        else:
            _write(tmp_path, f"fp8_{seed}", _metrics("fp8", seed, t=0.05, status="diverged"))
    write_report(tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert "`f32` itself" in _headline(text)
    assert ("- Not at `f32`'s quality although the Δ of their completed runs is within 0.5 dB: "
            "`fp8` (3 diverged of 5 runs).") in text  # fmt: skip


def test_pairs_are_counted_in_the_delta_cell_and_unpaired_seeds_named(tmp_path):
    for seed in range(5):
        if seed < 3:
            _write(tmp_path, f"f32_{seed}", _metrics("f32", seed, psnr=40.0 + seed))
        _write(tmp_path, f"bf16_{seed}", _metrics("bf16", seed, psnr=40.0 + seed + 0.1 * seed))
    write_report(tmp_path)
    text = (tmp_path / "report.md").read_text()
    bf16 = next(line for line in text.splitlines() if line.startswith("| `bf16` |"))
    # diffs 0, 0.1, 0.2 over the 3 seeds both ran: mean 0.1, half width 4.303 * 0.1 / sqrt(3)
    assert "| 5 |" in bf16 and "| +0.10 [-0.15, +0.35] (3 pairs) |" in bf16
    assert ("- Completed but not paired (no completed `f32` run with that seed): `bf16` seeds "
            "3, 4; in the row's seeds and PSNR, not in its Δ.") in text  # fmt: skip
    f32 = _rows(tmp_path)[("f32",)]
    assert f32["pairs"] == [] and f32["delta"]["n"] == 0  # the reference is not self-paired


def test_a_train_key_only_some_runs_have_is_named(tmp_path):
    # f32 from a config without train.adam_eps, bf16 with it: the key never splits the rows
    # (only values present are compared), so the report says the runs were compared as if
    # they agreed on it.
    for seed in range(3):
        _write(tmp_path, f"f32_{seed}", _metrics("f32", seed, psnr=40.0 + seed))
        config = {"train.adam_eps": 1e-15}
        _write(tmp_path, f"bf16_{seed}", _metrics("bf16", seed, psnr=40.1 + seed, config=config))
    write_report(tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert ("**Config keys some runs lack** (runs of another mptex version, or a hand-made "
            "config):\n- `train.adam_eps` (3 of 6: `1e-15`): one value among the runs that have "
            "it, so it splits no rows") in text  # fmt: skip
    from mptex.report.collect import partial_keys

    assert partial_keys(collect_runs(tmp_path)) == {"train.adam_eps": [1e-15]}


def test_a_train_key_some_runs_lack_with_several_values_is_swept(tmp_path):
    for seed in range(3):
        _write(tmp_path, f"f32_{seed}", _metrics("f32", seed, psnr=40.0 + seed))
        for eps in (1e-15, 1e-8):
            config = {"train.adam_eps": eps}
            _write(tmp_path, f"bf16_{eps}_{seed}",
                   _metrics("bf16", seed, psnr=40.1 + seed, config=config))  # fmt: skip
    write_report(tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert ("- `train.adam_eps` (6 of 9: `1e-08`, `1e-15`): swept among the runs that have it; "
            "the runs without it are compared only among themselves") in text  # fmt: skip


def test_zero_spread_is_named(tmp_path):
    _three_seeds(tmp_path, "f32", [40.0, 41.0, 42.0], t=0.3)
    _three_seeds(tmp_path, "bf16", [39.0, 40.0, 41.0], t=0.1)
    write_report(tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert "- Zero spread: `bf16` (Δ -1.00 dB on each of 3 seeds)." in text


def test_a_precision_key_swept_over_f32_pairs_each_arm_with_its_setting(tmp_path):
    # precision=f32,f16_static precision.static_loss_scale=64,1024, and one f16_static setting
    # that f32 was not run at. The arms differ in a key of their own (loss_scaling), so no f32
    # row matches an f16_static row in every key.
    cases = [("f32", 64, 0.0), ("f32", 1024, 0.0), ("f16_static", 64, -0.1),
             ("f16_static", 1024, -1.0), ("f16_static", 256, -0.5)]  # fmt: skip
    for arm, scale, offset in cases:
        scaling = "none" if arm == "f32" else "static"
        for seed in range(3):
            config = {"precision.static_loss_scale": scale, "precision.loss_scaling": scaling}
            psnr = 40.0 + seed + (offset + 0.01 * seed if arm != "f32" else 0.0)
            _write(tmp_path, f"{arm}_{scale}_{seed}", _metrics(arm, seed, psnr=psnr, config=config))
    write_report(tmp_path)
    rows = _rows(tmp_path)
    assert rows[("f16_static", "64")]["delta"]["mean"] == pytest.approx(-0.1 + 0.01)
    assert rows[("f16_static", "1024")]["delta"]["mean"] == pytest.approx(-1.0 + 0.01)
    assert rows[("f16_static", "256")]["verdict"] is None
    text = (tmp_path / "report.md").read_text()
    assert ("- Not compared (no `f32` row with the same settings to pair with): `f16_static "
            "precision.static_loss_scale=256`.") in text  # fmt: skip
    # The reading has a headline per reference row, each over the rows paired with it.
    for scale in (64, 1024):
        assert (f"- Fastest arm at `f32 precision.static_loss_scale={scale}`'s quality:"
                in text)  # fmt: skip
    assert "Worse than `f32`: `f16_static precision.static_loss_scale=1024`" in text


def test_a_reference_row_that_did_not_complete_leaves_the_others_judged(tmp_path):
    # f32 at one setting diverged on every seed; the rows of the other setting are still read.
    for scale, f32_status in ((64, "completed"), (1024, "diverged")):
        for seed in range(3):
            config = {"precision.static_loss_scale": scale}
            _write(tmp_path, f"f32_{scale}_{seed}",
                   _metrics("f32", seed, psnr=40.0 + seed, status=f32_status,
                            config={**config, "precision.loss_scaling": "none"}))  # fmt: skip
            _write(tmp_path, f"f16_{scale}_{seed}",
                   _metrics("f16_static", seed, psnr=39.9 + seed + 0.01 * seed,
                            config={**config, "precision.loss_scaling": "static"}))  # fmt: skip
    write_report(tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert ("- No completed `f32 precision.static_loss_scale=1024` run: no arm can be compared "
            "with it.") in text  # fmt: skip
    assert "- Fastest arm at `f32 precision.static_loss_scale=64`'s quality:" in text
    assert "Worse than `f32`: `f16_static precision.static_loss_scale=64`" in text


def test_one_seed_cannot_judge(tmp_path):
    _write(tmp_path, "0", _metrics("f32", 0, psnr=40.0, t=0.3))
    _write(tmp_path, "1", _metrics("nvdiffrec", 0, psnr=41.55, t=0.1))
    write_report(tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert "Cannot judge any arm against `f32`: 1 paired seed per arm" in text
    assert "- Fastest arm" not in text
    assert "| +1.55 (1 seed) | cannot judge (1 paired seed) |" in text


def test_backends_line_names_the_rasterizer_and_a_dash_for_older_runs(tmp_path):
    _write(
        tmp_path,
        "0",
        _metrics("f32", 0, backends={"encoder": "tcnn", "mlp": "torch", "raster": "nvdiffrast"}),
    )
    # metrics.json written before the rasterizer was recorded
    _write(tmp_path, "1", _metrics("f16", 0, backends={"encoder": "torch", "mlp": "tcnn"}))
    # an FP8 arm says whether its GEMMs ran on the tensor cores
    _write(tmp_path, "2", _metrics("fp8", 0, backends={"encoder": "triton", "mlp": "torch",
                                                       "raster": "nvdiffrast",
                                                       "fp8_gemm": "emulated"}))  # fmt: skip
    write_report(tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert "`f32` tcnn / torch / nvdiffrast;" in text and "`f16` torch / tcnn / –" in text
    assert "`fp8` triton / torch (FP8 GEMMs emulated) / nvdiffrast;" in text
    rows = {r["precision"]: r for r in json.loads((tmp_path / "results.json").read_text())["runs"]}
    assert rows["f32"]["raster_backend"] == "nvdiffrast" and rows["f16"]["raster_backend"] is None
    assert rows["fp8"]["fp8_gemm_backend"] == "emulated" and rows["f32"]["fp8_gemm_backend"] is None


# ----------------------------------------------------------------------------- grouping
def test_two_learning_rates_give_two_rows(tmp_path):
    for lr in (0.01, 0.5):
        for seed in (0, 1):
            psnr = 30.0 + seed if lr == 0.01 else 20.0 + seed
            _write(tmp_path, f"f32_{lr}_{seed}", _metrics("f32", seed, psnr=psnr,
                                                          config={"train.lr": lr}))  # fmt: skip
    rows = _rows(tmp_path)
    assert set(rows) == {("f32", "0.01"), ("f32", "0.5")}
    assert rows[("f32", "0.01")]["psnr_mean"] == 30.5 and rows[("f32", "0.01")]["n_seeds"] == 2
    assert rows[("f32", "0.5")]["psnr_mean"] == 20.5
    write_report(tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert "| arm | `train.lr` | seeds |" in text
    assert "## Scene `builtin`, `train.lr=0.01`" in text and "seeds: 0, 1." in text


def test_two_meshes_give_two_rows_and_compare_within_their_mesh(tmp_path):
    for mesh, base in (("duck.obj", 30.0), ("cube.obj", 40.0)):
        for arm, offset in (("f32", 0.0), ("bf16", -1.0)):
            for seed in (0, 1, 2):
                config = {"scene.path": mesh, "scene.resolution": 128}
                _write(tmp_path, f"{arm}_{mesh}_{seed}",
                       _metrics(arm, seed, psnr=base + offset + 0.1 * seed, scene="mesh",
                                config=config))  # fmt: skip
    rows = _rows(tmp_path)
    assert set(rows) == {(a, m) for a in ("f32", "bf16") for m in ("duck.obj", "cube.obj")}
    for mesh in ("duck.obj", "cube.obj"):  # paired with the same mesh's f32: exactly -1 dB
        assert rows[("bf16", mesh)]["delta"]["mean"] == pytest.approx(-1.0)
        assert rows[("bf16", mesh)]["delta"]["sd"] == pytest.approx(0.0, abs=1e-12)


def test_arm_definition_keys_are_not_columns_but_swept_precision_keys_are(tmp_path):
    for arm, scaling in (("f32", "none"), ("f16_dynamic", "dynamic")):
        for init in (1024.0, 65536.0):
            cfg = {"precision.loss_scaling": scaling, "precision.init_scale": init}
            _write(tmp_path, f"{arm}_{init}", _metrics(arm, 0, config=cfg))
    rows = summarize(collect_runs(tmp_path))
    assert {tuple(r["keys"]) for r in rows} == {("precision.name", "precision.init_scale")}
    assert len(rows) == 4


def test_duplicate_config_and_seed_counted_once_and_listed(tmp_path):
    _write(tmp_path, "a/0", _metrics("f32", 0, psnr=47.27))
    _write(tmp_path, "b/0", _metrics("f32", 0, psnr=47.27))  # the same job copied twice
    _write(tmp_path, "b/1", _metrics("f32", 1, psnr=45.0))
    (row,) = summarize(collect_runs(tmp_path))
    assert row["n_runs"] == 2 and row["seeds"] == [0, 1]
    write_report(tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert "- `b/0` (completed, PSNR 47.27 dB): same as `a/0` (completed, PSNR 47.27 dB)" in text
    csv_lines = (tmp_path / "results.csv").read_text().splitlines()
    assert sum("duplicate of a/0" in line for line in csv_lines) == 1


def test_a_completed_duplicate_is_counted_before_a_failed_one_and_job_numbers_by_value(tmp_path):
    # A crashed first attempt and its completed re-run: the completed run is counted, whatever
    # the directory names' order.
    _write(tmp_path, "attempt1/1_f32", _metrics("f32", 1, status="failed"))
    _write(tmp_path, "attempt2/1_f32", _metrics("f32", 1, psnr=40.0))
    # Hydra numbers jobs 0, 1, ..., 12: job 5 comes before job 12, as numbers.
    _write(tmp_path, "attempt2/5_bf16", _metrics("bf16", 1, psnr=32.0))
    _write(tmp_path, "attempt2/12_bf16", _metrics("bf16", 1, psnr=28.0))
    rows = {r["precision"]: r for r in summarize(collect_runs(tmp_path))}
    assert rows["f32"]["completed"] == 1 and rows["f32"]["failed"] == 0
    assert rows["bf16"]["psnr_mean"] == 32.0
    write_report(tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert ("- `attempt1/1_f32` (failed): same as `attempt2/1_f32` (completed, PSNR 40.00 dB)"
            in text)  # fmt: skip
    assert "- `attempt2/12_bf16` (completed, PSNR 28.00 dB): same as `attempt2/5_bf16`" in text


def test_a_rerun_does_not_replace_a_diverged_result(tmp_path):
    # Divergence is the arm's result: re-running the seed until it completes must not hide it.
    for seed in range(3):
        _write(tmp_path, f"1/f32_{seed}", _metrics("f32", seed, psnr=40.0 + seed))
        status = "diverged" if seed == 2 else "completed"
        _write(tmp_path, f"1/bf16_{seed}", _metrics("bf16", seed, psnr=40.0 + seed, status=status))
    _write(tmp_path, "2/bf16_2", _metrics("bf16", 2, psnr=42.0))  # the re-run
    rows = _rows(tmp_path)
    assert rows[("bf16",)]["diverged"] == 1 and rows[("bf16",)]["completed"] == 2
    write_report(tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert "- `2/bf16_2` (completed, PSNR 42.00 dB): same as `1/bf16_2` (diverged)" in text


def test_a_folder_of_two_sweeps_is_reported_per_sweep(tmp_path, capsys):
    for name, psnr in (("s1", 30.0), ("s2", 40.0)):
        sweep_dir = tmp_path / name
        _write(sweep_dir, "0_precision=f32", _metrics("f32", 0, psnr=psnr))
        (sweep_dir / "multirun.yaml").write_text("hydra: {}\n")
    assert report.find_sweeps(tmp_path) == [tmp_path / "s1", tmp_path / "s2"]
    assert report_main([str(tmp_path)]) == 0
    assert "holds 2 sweeps" in capsys.readouterr().out
    for name, psnr in (("s1", 30.0), ("s2", 40.0)):
        (run,) = json.loads((tmp_path / name / "results.json").read_text())["runs"]
        assert run["psnr"] == psnr
    assert not (tmp_path / "report.md").exists()
    with pytest.raises(report.SweepLayoutError, match="2 sweeps"):
        write_report(tmp_path)
    # A job outside every sweep: refused, named.
    _write(tmp_path, "stray", _metrics("f32", 0))
    assert report_main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "stray" in err and "s1, s2" in err


# ----------------------------------------------------------------------------- bad runs
@pytest.mark.parametrize(
    "text, why",
    [('{"status": "completed", "psnr": NaN}', "NaN is not valid JSON"),
     ('{"status": "completed", "psnr": Infinity}', "Infinity is not valid JSON"),
     ('{"status": "compl', "unreadable metrics.json"), ("[1, 2]", "not a JSON object")],
)  # fmt: skip
def test_unreadable_metrics_are_listed_and_the_report_is_written(tmp_path, text, why):
    _write(tmp_path, "0", _metrics("f32", 0))
    _write(tmp_path, "1", text)
    assert report_main([str(tmp_path)]) == 0
    report_text = (tmp_path / "report.md").read_text()
    assert "Unreadable runs (1; counted as failed, 1 of them in no row" in report_text
    assert "- `1/metrics.json`: unreadable metrics.json" in report_text and why in report_text
    assert "2 runs, 1 completed, 0 collapsed, 0 diverged, 1 failed" in report_text
    json.loads((tmp_path / "results.json").read_text())  # strict JSON, complete


def test_unreadable_metrics_with_a_hydra_config_stay_in_their_row(tmp_path):
    _write(tmp_path, "0", _metrics("f32", 0))
    job = _write(tmp_path, "1", '{"psnr": NaN}')
    (job / ".hydra").mkdir()
    (job / ".hydra" / "config.yaml").write_text(
        "precision:\n  name: f32\nscene:\n  name: builtin\ntrain:\n  seed: 1\n  lr: 0.01\n"
    )
    (row,) = summarize(collect_runs(tmp_path))
    assert row["n_runs"] == 2 and row["failed"] == 1 and row["completed"] == 1


def test_completed_without_psnr_is_counted_as_diverged(tmp_path):
    _write(tmp_path, "0", _metrics("f32", 0, psnr=30.0))
    _write(tmp_path, "1", _metrics("f32", 1, psnr=32.0))
    bad = _metrics("f32", 2, psnr=31.0)
    bad["psnr"] = None  # an older loop's "completed, psnr null" with NaN weights
    _write(tmp_path, "2", bad)
    (row,) = summarize(collect_runs(tmp_path))
    assert row["completed"] == 2 and row["diverged"] == 1 and row["n_runs"] == 3
    write_report(tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert "Diverged: `f32` (1/3 runs, at iteration end (no finite PSNR))" in text
    assert "Counted as diverged: `2: recorded as completed, but its PSNR is not a finite" in text


def test_runs_below_the_constant_colour_baseline_are_flagged(tmp_path):
    _write(tmp_path, "0", _metrics("f32", 0, psnr=22.1, baseline=28.2))
    _write(tmp_path, "1", _metrics("f32", 1, psnr=30.0, baseline=28.2))
    write_report(tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert "| 26.05 ± 5.59 ⚠ |" in text and "| 28.20 |" in text
    assert "At or below the constant-colour baseline: `f32` (1 of 2 runs)" in text


# ----------------------------------------------------------------------------- pictures
def test_effective_loss_scale_includes_nvdiffrecs_x128(tmp_path):
    cfg = {"precision.loss_scaling": "nvdiffrec", "precision.static_loss_scale": 128.0}
    _write(tmp_path, "0", _metrics("nvdiffrec", 0, config=cfg))
    dyn = _metrics("f16_dynamic", 0, final_loss_scale=32768.0,
                   config={"precision.loss_scaling": "dynamic"})  # fmt: skip
    _write(tmp_path, "1", dyn)
    _write(tmp_path, "2", _metrics("f32", 0))
    rows = _rows(tmp_path)
    assert rows[("nvdiffrec",)]["final_loss_scale"] == [128.0]
    assert rows[("f16_dynamic",)]["final_loss_scale"] == [32768.0]
    assert rows[("f32",)]["final_loss_scale"] == [1.0]
    from mptex.report.plots import _scale

    (run,) = [r for r in collect_runs(tmp_path) if r["precision"] == "nvdiffrec"]
    assert _scale(run, run["history"][0]) == 128.0


def test_arm_colours_are_fixed_and_distinct():
    assert len(set(ARM_COLORS.values())) == len(ARM_COLORS)
    assert arm_color("f32") == ARM_COLORS["f32"]
    # Unknown arms: deterministic (md5, not Python's salted hash), valid, and not all alike.
    colours = [arm_color(f"custom_{i}") for i in range(5)]
    assert colours == [arm_color(f"custom_{i}") for i in range(5)]
    assert len(set(colours)) == 5 and all(len(c) == 7 and c[0] == "#" for c in colours)


def _side_by_side(path: Path, ref, pred) -> None:
    import imageio.v3 as iio

    path.parent.mkdir(parents=True, exist_ok=True)
    iio.imwrite(path, np.concatenate([ref, pred], axis=1))


def _marked(height=16, width=16, value=0):
    image = np.full((height, width, 3), 255, np.uint8)
    image[:4, :, 0] = 200  # top rows reddish: the mark whose position is checked
    image[height // 2, width // 2, 1] = value
    return image


def test_image_panels_keep_the_saved_orientation(tmp_path):
    ref, pred = _marked(), _marked(value=100)
    _side_by_side(tmp_path / "0" / "images" / "val_000.png", ref, pred)
    reference, ((_, prediction),) = image_panels(tmp_path, [{"run_dir": "0"}])
    np.testing.assert_array_equal(reference, ref)  # row 0 stays the top row
    np.testing.assert_array_equal(prediction, pred)


def test_error_gain_is_one_power_of_two_for_all_arms():
    small = np.full((10, 10), 2, np.int16)
    big = np.full((10, 10), 10, np.int16)
    big[0] = 0  # exact zeros (background) do not count
    # 99.5th percentile over both maps' non-zero errors is 10 -> 255 / 10 = 25.5 -> 16
    assert error_gain([small, big]) == 16
    assert error_gain([small]) == 64  # 255 / 2 = 127.5 -> 64
    assert error_gain([np.zeros((4, 4), np.int16)]) == 256
    assert error_gain([np.full((4, 4), 255, np.int16)]) == 1


def test_report_images(tmp_path):
    for arm, seed, value in (("f32", 0, 0), ("f32", 1, 0), ("bf16", 0, 100), ("bf16", 1, 90)):
        job = _write(tmp_path, f"{arm}_{seed}", _metrics(arm, seed))
        _side_by_side(job / "images" / "val_000.png", _marked(), _marked(value=value))
    written = write_report(tmp_path)
    assert "images.png" in written and (tmp_path / "images.png").stat().st_size > 0
    text = (tmp_path / "report.md").read_text()
    assert "8-bit sRGB images × 2 (one scale for every arm)" in text  # 255 / 100 -> 2


def test_public_names_resolve():
    assert len(set(report.__all__)) == len(report.__all__)
    for name in report.__all__:
        assert getattr(report, name) is not None


# ----------------------------------------------------------------------------- sweep dirs
def test_job_dirname_escapes_paths_and_stays_short():
    from mptex.cli import job_dirname

    assert job_dirname("precision=f32,scene.path=/data/spot.obj") == (
        "precision=f32,scene.path=%2Fdata%2Fspot.obj"
    )
    long_a, long_b = "x=" + "a" * 300, "x=" + "a" * 299 + "b"
    assert len(job_dirname(long_a)) == 200 and job_dirname(long_a) != job_dirname(long_b)
    assert job_dirname("") == "job"


def test_a_second_sweep_into_the_same_directory_is_refused(tmp_path, capsys):
    from omegaconf import OmegaConf

    from mptex.report import FreshSweepDirCallback

    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / "sweep")}}})
    FreshSweepDirCallback().on_multirun_start(config)
    with pytest.raises(SystemExit) as exc:
        FreshSweepDirCallback().on_multirun_start(config)
    assert exc.value.code == 2
    assert "already holds a sweep (.mptex_sweep)" in capsys.readouterr().err
    FreshSweepDirCallback(enabled=False).on_multirun_start(config)  # the escape hatch
    # A sweep from before the guard (multirun.yaml, no marker) is recognised too.
    old = tmp_path / "old"
    old.mkdir()
    (old / "multirun.yaml").write_text("hydra: {}\n")
    with pytest.raises(SystemExit):
        FreshSweepDirCallback().on_multirun_start(
            OmegaConf.create({"hydra": {"sweep": {"dir": str(old)}}})
        )
    assert not (old / ".mptex_sweep").exists()


def test_the_configs_margin_is_the_reports_default():
    from omegaconf import OmegaConf

    config = OmegaConf.load(Path(__file__).resolve().parents[1] / "configs" / "config.yaml")
    assert config.hydra.callbacks.report.margin_db == report.EQUIVALENCE_MARGIN_DB


def test_the_configs_adjustment_is_the_reports_default():
    from omegaconf import OmegaConf

    config = OmegaConf.load(Path(__file__).resolve().parents[1] / "configs" / "config.yaml")
    assert config.hydra.callbacks.report.adjust == "none"
    assert report.ReportCallback().adjust == "none"


@pytest.mark.parametrize(
    "key, value",
    [("adjust", "holm"), ("margin_db", -1.0), ("margin_db", "0.5"), ("margin_db", math.nan)],
)
def test_a_bad_report_setting_stops_the_multirun_at_start_in_one_line(key, value, capsys):
    # The callback is made before any job runs: a bad value there must not cost the report
    # only after every job has trained.
    with pytest.raises(SystemExit) as stop:
        report.ReportCallback(**{key: value})
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith(f"mptex-train: error: hydra.callbacks.report.{key}: expected")


# ----------------------------------------------------------------------------- multiplicity
def _t_dof2(p):
    """Student t's quantile for 2 degrees of freedom in closed form: F(t) = 1/2 + t / (2
    sqrt(2 + t^2)), so t = (2p - 1) sqrt(2 / (1 - (2p - 1)^2))."""
    u = 2 * p - 1
    return u * math.sqrt(2 / (1 - u * u))


def test_family_confidence_hand_values():
    assert report.family_confidence(5, "bonferroni") == pytest.approx(0.99, abs=1e-15)
    assert report.family_confidence(2, "bonferroni") == pytest.approx(0.975, abs=1e-15)
    assert report.family_confidence(4, "bonferroni", 0.9) == pytest.approx(0.975, abs=1e-15)
    for k in (0, 1):  # no family: the confidence as given
        assert report.family_confidence(k, "bonferroni") == 0.95
    assert report.family_confidence(7, "none") == 0.95
    for bad in (dict(k=3, adjust="holm"), dict(k=-1), dict(k=2.0), dict(k=True),
                dict(k=2, confidence=1.0)):  # fmt: skip
        with pytest.raises(ValueError, match=next(iter(set(bad) - {"k"}), "k")):
            report.family_confidence(**{"adjust": "bonferroni", **bad})


def _family_sweep(root):
    # f32, nvdiffrec (+1.0, +1.3, +0.7: mean 1.0, sd 0.3), bf16 (-0.05, -0.04, -0.06: mean
    # -0.05, sd 0.01), amp (one seed: no interval, so not in the family): k = 2.
    _three_seeds(root, "f32", [40.0, 41.0, 42.0], t=0.30)
    _three_seeds(root, "nvdiffrec", [41.0, 42.3, 42.7], t=0.40)
    _three_seeds(root, "bf16", [39.95, 40.96, 41.94], t=0.05)
    _write(root, "amp_0", _metrics("amp", 0, psnr=40.2, t=0.2))


def test_bonferroni_widens_each_interval_to_hold_the_family_together(tmp_path):
    _family_sweep(tmp_path)
    plain = _rows(tmp_path)
    adjusted = {r["precision"]: r for r in summarize(collect_runs(tmp_path), adjust="bonferroni")}
    # Unadjusted: t(0.975, 2) = 4.3027, nvdiffrec's half width 4.3027 * 0.3 / sqrt(3) = 0.745.
    assert plain[("nvdiffrec",)]["delta"]["half_width"] == pytest.approx(
        _t_dof2(0.975) * 0.3 / math.sqrt(3), rel=1e-9)  # fmt: skip
    assert plain[("nvdiffrec",)]["verdict"] == "better"
    assert plain[("nvdiffrec",)]["family"] == 2 and plain[("nvdiffrec",)]["confidence"] == 0.95
    # Bonferroni over k = 2: each interval at 1 - 0.05/2 = 97.5 % two-sided, so the quantile
    # t(1 - 0.05/4, 2) = 6.205 and nvdiffrec's interval [1 - 1.075, 1 + 1.075] now holds 0.
    for arm, sd in (("nvdiffrec", 0.3), ("bf16", 0.01)):
        row = adjusted[arm]
        assert row["family"] == 2 and row["confidence"] == pytest.approx(0.975, abs=1e-15)
        assert row["delta"]["half_width"] == pytest.approx(
            _t_dof2(1 - 0.05 / 4) * sd / math.sqrt(3), rel=1e-9)  # fmt: skip
    assert adjusted["nvdiffrec"]["verdict"] == "inconclusive"
    assert adjusted["bf16"]["verdict"] == "worse"  # [-0.086, -0.014]: still below 0
    assert adjusted["amp"]["verdict"] == "cannot judge" and adjusted["amp"]["delta"]["n"] == 1
    assert adjusted["f32"]["verdict"] is None


def test_the_report_says_how_its_intervals_are_adjusted(tmp_path, capsys):
    _family_sweep(tmp_path)
    assert report_main([str(tmp_path), "--adjust", "bonferroni"]) == 0
    text = (tmp_path / "report.md").read_text()
    assert "| Δ vs f32 (dB) [97.5% CI, Bonferroni k = 2] |" in text
    assert "mean ± t(1 − 0.05/4, n−1) · sd / √n" in text
    assert "adjusted for the k = 2 comparisons with an interval" in text
    assert "at 98.75% one-sided confidence" in text
    headline = _headline(text)
    assert "**`bf16`**" in headline and "97.5% CI [" in headline
    tex = (tmp_path / "results.tex").read_text()
    assert r"(dB) [97.5\% CI]" in tex
    assert "Bonferroni-adjusted over the report's 2 comparisons" in tex
    document = json.loads((tmp_path / "results.json").read_text())
    assert document["intervals"] == {
        "adjust": "bonferroni",
        "comparisons": 2,
        "interval_confidence": pytest.approx(0.975, abs=1e-15),
    }
    # The default: each interval 95 % on its own, and the report says so.
    assert report_main([str(tmp_path)]) == 0
    text = (tmp_path / "report.md").read_text()
    assert "| Δ vs f32 (dB) [95% CI] |" in text and "not adjusted for the" in text
    assert json.loads((tmp_path / "results.json").read_text())["intervals"]["adjust"] == "none"
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        report_main([str(tmp_path), "--adjust", "holm"])
    assert stop.value.code == 2 and "--adjust" in capsys.readouterr().err


def test_the_header_lists_seeds_by_value(tmp_path):
    for seed in (10, 2, 0):
        _write(tmp_path, f"f32_{seed}", _metrics("f32", seed))
    write_report(tmp_path)
    assert "; seeds: 0, 2, 10." in (tmp_path / "report.md").read_text()


def test_seeds_to_settle_an_inconclusive_interval_hand_values():
    from mptex.report.stats import seeds_to_settle

    # mean 0.2, sd 0.5, margin 0.5: inside the margin once t(0.975, n-1) * 0.5 / sqrt(n) <= 0.3,
    # i.e. t / sqrt(n) <= 0.6: n = 13 gives 2.179 / 3.606 = 0.604 (t table, 12 dof), n = 14
    # gives 2.160 / 3.742 = 0.577; excluding 0 would take t / sqrt(n) < 0.4 (n = 27).
    assert seeds_to_settle({"mean": 0.2, "sd": 0.5, "n": 2}, 0.5) == 14
    # |mean| beyond the margin: only a shown difference settles it, t / sqrt(n) < 0.6 / 0.5:
    # n = 5 gives 2.776 / 2.236 = 1.242 (4 dof), n = 6 gives 2.571 / 2.449 = 1.050.
    assert seeds_to_settle({"mean": -0.6, "sd": 0.5, "n": 2}, 0.5) == 6
    # sqrt(n) >= 10 t: about 385 seeds, past the estimate's cap; no spread: nothing to estimate
    assert seeds_to_settle({"mean": 0.0, "sd": 5.0, "n": 3}, 0.5) is None
    assert seeds_to_settle({"mean": 0.1, "sd": 0.0, "n": 3}, 0.5) is None


def test_the_reading_says_how_many_seeds_would_settle_an_inconclusive_arm(tmp_path):
    _three_seeds(tmp_path, "f32", [40.0, 41.0, 42.0], t=0.30)
    _three_seeds(tmp_path, "amp", [44.0, 37.0, 42.0], t=0.10)  # diffs +4, -4, 0: sd 4
    _three_seeds(tmp_path, "bf16", [40.2, 40.6, 42.4], t=0.10)  # diffs +0.2, -0.4, +0.4
    write_report(tmp_path)
    rows = _rows(tmp_path)
    # amp: mean 0, sd 4: inside ±0.5 once 4 t / sqrt(n) <= 0.5, sqrt(n) >= 8 t: about 250
    assert rows[("amp",)]["seeds_to_settle"] is None
    # bf16: mean 0.0667, sd 0.4163; inside ±0.5 once 0.0667 + t * 0.4163 / sqrt(n) <= 0.5
    n = rows[("bf16",)]["seeds_to_settle"]
    assert t_quantile(0.975, n - 1) * 0.41633 / math.sqrt(n) <= 0.5 - 0.06667
    assert t_quantile(0.975, n - 2) * 0.41633 / math.sqrt(n - 1) > 0.5 - 0.06667
    text = (tmp_path / "report.md").read_text()
    assert f"`bf16` (+0.07 [-0.97, +1.10] dB; about {n} paired seeds at this mean and" in text
    assert "`amp` (+0.00 [-9.94, +9.94] dB; more than 200 seeds at this mean and spread)" in text


# ----------------------------------------------------------------------------- LaTeX
def test_latex_escape_hand_cases():
    from mptex.report.latex import escape

    assert escape("fp8_rowwise") == r"fp8\_rowwise"
    assert escape("a%b&c#d$e{f}g") == r"a\%b\&c\#d\$e\{f\}g"
    assert escape("~^\\") == r"\textasciitilde{}\textasciicircum{}\textbackslash{}"
    assert escape("±0.5 dB") == r"$\pm$0.5 dB"
    assert escape("a<b>c|d −1") == r"a\textless{}b\textgreater{}c\textbar{}d $-$1"


def _cells(line):
    """A tabular row's cells, split at the ampersands that are not escaped."""
    assert line.endswith(r" \\"), line
    return [c.strip() for c in re.split(r"(?<!\\)&", line[: -len(r" \\")])]


def _balanced(text):
    depth = 0
    for m in re.finditer(r"(?<!\\)[{}]", text):
        depth += 1 if m.group() == "{" else -1
        assert depth >= 0, text
    return depth == 0


def test_results_tex_holds_report_mds_numbers_per_section(tmp_path):
    # Two scenes (two tables), an arm with an underscore, a diverged run, a run below the
    # baseline, and a precision key swept over every arm (a column).
    for scene, base in (("duck", 30.0), ("spot", 40.0)):
        for scale in (64.0, 128.0):
            for seed in range(3):
                cfg = {"precision.static_loss_scale": scale}
                _write(
                    tmp_path,
                    f"{scene}_{scale}_f32_{seed}",
                    _metrics("f32", seed, psnr=base + seed, scene=scene, config=cfg),
                )
                status = "diverged" if (scene, scale, seed) == ("spot", 64.0, 2) else "completed"
                psnr = base + seed + (-0.2, 0.1, 0.4)[seed]
                _write(tmp_path, f"{scene}_{scale}_f16_{seed}",
                       _metrics("f16_dynamic", seed, psnr=psnr, scene=scene, config=cfg,
                                status=status, baseline=base + 1.5))  # fmt: skip
    assert report_main([str(tmp_path)]) == 0
    tex = (tmp_path / "results.tex").read_text()
    md = (tmp_path / "report.md").read_text()
    assert tex.count(r"\begin{table}") == 2 and _balanced(tex)
    assert r"\begin{tabular}{llrrllrr}" in tex  # arm, the swept key, then six columns
    rows = [line for line in tex.splitlines() if line.startswith(r"\texttt{")]
    assert len(rows) == 8 and all(len(_cells(r)) == 8 for r in rows)
    header = next(line for line in tex.splitlines() if line.startswith("Arm &"))
    assert len(_cells(header)) == 8 and r"\texttt{precision.static\_loss\_scale}" in header
    # Each Δ cell is report.md's with the signs in math mode
    for row in summarize(collect_runs(tmp_path)):
        if row["precision"] != "f16_dynamic":
            continue
        d = row["delta"]
        mean, low, high = (format(v, "+.2f") for v in (d["mean"], d["low"], d["high"]))
        assert f"| {mean} [{low}, {high}]" in md
        line = next(r for r in rows if r.startswith(r"\texttt{f16\_dynamic}")
                    and f"${mean}$ [${low}$, ${high}$]" in r)  # fmt: skip
        assert _cells(line)[2] == f"{row['n_seeds']}/{row['n_runs']}"
    assert any(_cells(r)[2] == "2/3" for r in rows)  # the diverged run counted, not hidden
    # f16_dynamic's seeds 0 and 1 are below their baseline (base + 1.5), f32's never (20 dB)
    assert all((r"\textsuperscript{\dag}" in r) == ("f16" in r) for r in rows)
    assert "95\\% Student-t interval" in tex and "not adjusted for multiplicity" in tex
    assert "scene duck" in tex and "scene spot" in tex
    assert tex.count("Seeds 0, 1, 2 (3).") == 2


# ----------------------------------------------------------------------------- nvdiffrec #154
def test_nvdiffrec154_gap_decomposition_hand_computed(tmp_path):
    psnrs = {
        "nvdiffrec": [30.0, 31.0, 32.0],
        "nvdiffrec_scale1": [29.0, 30.0, 31.0],
        "tcnn_fused": [28.0, 28.5, 30.0],
        "tcnn_fused_swap154": [28.0, 28.5, 30.0],
    }
    for arm, values in psnrs.items():
        for seed, psnr in enumerate(values):
            extra = {"history": [
                {"iteration": 10, "psnr": psnr - 1, "net.0.fused_absorbed_frac": 0.25 * seed},
                {"iteration": 20, "psnr": psnr, "net.0.fused_absorbed_frac": 0.5},
            ]} if arm.startswith("tcnn") else {}  # fmt: skip
            _write(tmp_path, f"{arm}_{seed}", _metrics(arm, seed, psnr=psnr, **extra))
    written = write_report(tmp_path)
    text = (tmp_path / "report.md").read_text()
    # Differences swap - nvdiffrec: [-2, -2.5, -2]: mean -2.1667, sd 0.2887,
    # t(0.975, 2) = 4.303: half width 4.303 * 0.2887 / sqrt(3) = 0.717.
    assert ("| **the gap: the swap as #154 made it** | `tcnn_fused_swap154` − `nvdiffrec` | 3 | "
            "-2.17 [-2.88, -1.45] | worse |") in text  # fmt: skip
    # The chain adds up: -1 (grid x128) + -1.17 (the network) + 0 (the hook) = -2.17.
    assert "| `nvdiffrec_scale1` − `nvdiffrec` | 3 | -1.00 [-1.00, -1.00] | worse |" in text
    assert "| `tcnn_fused` − `nvdiffrec_scale1` | 3 | -1.17 [-1.88, -0.45] | worse |" in text
    assert ("| `tcnn_fused_swap154` − `tcnn_fused` | 3 | +0.00 [+0.00, +0.00] | "
            "no detectable difference |") in text  # fmt: skip
    assert "| `tcnn_fused_f32acc` − `tcnn_fused` | – | – | not run" in text
    # Over iterations: both validations paired; statistics: mean over iterations, then seeds.
    (gap,) = json.loads((tmp_path / "results.json").read_text())["nvdiffrec154"]
    assert gap["context"] == {}
    assert sorted(gap["gap"]["curve"]) == ["10", "20"]
    assert gap["statistics"]["tcnn_fused"]["net.0.fused_absorbed_frac"] == pytest.approx(0.375)
    assert "gap_curves.png" in written and "## nvdiffrec #154" in text
    assert text.index("## nvdiffrec #154") < text.index("## How to read this")


def test_nvdiffrec154_is_computed_per_scene_never_pooled(tmp_path):
    # The swap gains 1 dB on one scene and loses 1 dB on the other: two confident, opposite
    # results, each in its own section (pooled, they would read as an inconclusive +0.05).
    job = 0
    for scene, gap in (("duck", 1.0), ("torus", -1.0)):
        for seed in range(3):
            for arm, psnr in (
                ("nvdiffrec", 30.0 + seed),
                ("tcnn_fused_swap154", 30.0 + seed + gap + 0.05 * seed),
            ):
                _write(tmp_path, f"{job}", _metrics(arm, seed, psnr=psnr, scene=scene))
                job += 1
    write_report(tmp_path)
    text = (tmp_path / "report.md").read_text()
    duck = text.index("## nvdiffrec #154: the gap and what accounts for it: `scene.name=duck`")
    torus = text.index("## nvdiffrec #154: the gap and what accounts for it: `scene.name=torus`")
    # diffs 1.0, 1.05, 1.1: mean 1.05, sd 0.05, half width 4.303 * 0.05 / sqrt(3) = 0.124
    gap = "| **the gap: the swap as #154 made it** | `tcnn_fused_swap154` − `nvdiffrec` | 3 | "
    assert text.index(gap + "+1.05 [+0.93, +1.17] | better |") > duck
    assert text.index(gap + "-0.95 [-1.07, -0.83] | worse |") > torus
    assert "over 3 seeds" in text and "over 6 seeds" not in text
    gaps = json.loads((tmp_path / "results.json").read_text())["nvdiffrec154"]
    assert [g["context"] for g in gaps] == [{"scene.name": "duck"}, {"scene.name": "torus"}]
    runs = [dict(run, keys={"scene.name": run["scene"]}) for run in collect_runs(tmp_path)]
    with pytest.raises(ValueError, match="several contexts"):  # pairs never cross scenes
        report.attribution.attribution(runs, 0.5)


def test_nvdiffrec154_pairs_runs_of_a_precision_key_swept_within_the_arms(tmp_path):
    # Both arms at precision.static_loss_scale 64 and 128: each setting is its own section,
    # and the runs of one setting never stand in for the other's.
    for scale, gap in ((64, 3.0), (128, 0.0)):
        for seed in range(3):
            for arm, psnr in (
                ("nvdiffrec", 30.0 + seed),
                ("tcnn_fused_swap154", 30.0 + seed + gap + 0.05 * seed),
            ):
                config = {"precision.static_loss_scale": scale}
                _write(tmp_path, f"{arm}_{scale}_{seed}",
                       _metrics(arm, seed, psnr=psnr, config=config))  # fmt: skip
    write_report(tmp_path)
    text = (tmp_path / "report.md").read_text()
    gap = "| **the gap: the swap as #154 made it** | `tcnn_fused_swap154` − `nvdiffrec` | 3 | "
    at_64 = text.index("the gap and what accounts for it: `precision.static_loss_scale=64`")
    at_128 = text.index("the gap and what accounts for it: `precision.static_loss_scale=128`")
    assert text.index(gap + "+3.05 [+2.93, +3.17] | better |") > at_64
    assert text.index(gap + "+0.05 [-0.07, +0.17] | no detectable difference |") > at_128


def test_nvdiffrec154_terms_name_arms_that_ran_other_implementations(tmp_path):
    # On a GPU tcnn_fused runs tinycudann's network and the twin-only switches the twin: their
    # difference holds the implementations' difference too, and its row says so.
    runs = {"nvdiffrec": ("torch", 30.0), "tcnn_fused_swap154": ("tcnn", 28.0),
            "tcnn_fused": ("tcnn", 28.0), "tcnn_fused_f32acc": ("torch", 29.0),
            "tcnn_fused_dynamic": ("tcnn", 29.5)}  # fmt: skip
    for arm, (mlp, psnr) in runs.items():
        for seed in range(2):
            backends = {"encoder": "triton", "mlp": mlp, "raster": "nvdiffrast"}
            _write(tmp_path, f"{arm}_{seed}",
                   _metrics(arm, seed, psnr=psnr + 0.1 * seed, backends=backends))  # fmt: skip
    write_report(tmp_path)
    text = (tmp_path / "report.md").read_text()
    lines = text.splitlines()
    f32acc = next(line for line in lines if "`tcnn_fused_f32acc` − `tcnn_fused`" in line)
    assert f32acc.endswith("(not like for like: network: `tcnn_fused_f32acc` ran torch, "
                           "`tcnn_fused` tcnn) |")  # fmt: skip
    dynamic = next(line for line in lines if "`tcnn_fused_dynamic` −" in line)
    assert "not like for like" not in dynamic
    # the gap compares the two networks by design: not flagged
    gap = next(line for line in lines if "**the gap" in line)
    assert "not like for like" not in gap


def test_no_nvdiffrec154_section_without_its_arms(sweep):
    write_report(sweep)
    assert "#154" not in (sweep / "report.md").read_text()
    assert not (sweep / "gap_curves.png").exists()


def test_exported_runs_get_a_bake_column_and_export_keys_do_not_split_rows(tmp_path):
    for seed, (resolution, baked) in enumerate([(512, 57.0), (1024, 63.0)]):
        export = {"dir": "export", "resolution": resolution, "psnr_baked_vs_neural": baked}
        config = {"export.resolution": resolution}
        _write(tmp_path, f"f32_{seed}", _metrics("f32", seed, export=export, config=config))
    _write(tmp_path, "bf16_0", _metrics("bf16", 0))  # not exported: no value in its row
    rows = _rows(tmp_path)
    assert set(rows) == {("f32",), ("bf16",)}  # export.resolution differs but is no row key
    assert rows[("f32",)]["bake_psnr"] == 60.0 and rows[("bf16",)]["bake_psnr"] is None
    write_report(tmp_path)
    text = (tmp_path / "report.md").read_text()
    header = next(line for line in text.splitlines() if line.startswith("| arm |"))
    assert header.endswith("| bake vs neural (dB) |")
    f32_line = next(line for line in text.splitlines() if line.startswith("| `f32` |"))
    assert f32_line.endswith("| 60.00 |")


def test_no_bake_column_without_exported_runs(sweep):
    write_report(sweep)
    assert "bake vs neural" not in (sweep / "report.md").read_text()


def test_each_scene_says_how_many_views_its_psnr_averages(tmp_path):
    # metrics.json's psnr_per_image has one entry per validation view (scene.n_val_views).
    _write(tmp_path, "0", _metrics("f32", 0, psnr_per_image=[30.0] * 64))
    _write(tmp_path, "1", _metrics("f32", 1, psnr_per_image=[31.0] * 64))
    _write(tmp_path, "2", _metrics("f32", 0, scene="duck", psnr_per_image=[40.0] * 8))
    _write(tmp_path, "3", _metrics("f32", 1, scene="duck"))  # an older metrics.json: unknown
    builtin, duck, runs = _scene_headings(tmp_path)
    assert "Iterations: 20; validation views: 64." in builtin
    assert "Iterations: 20; validation views: 8." in duck
    assert sorted(str(r["val_views"]) for r in runs) == ["64", "64", "8", "None"]
    assert sorted(str(r["val_spp"]) for r in runs) == ["1", "1", "1", "None"]


def test_a_scene_scored_with_supersampling_says_so(tmp_path):
    # train.val_spp=4: each pixel the 4 x 4 box-filtered mean; the heading names it, and a run
    # without the key (older metrics.json) was scored at pixel centres (1).
    spp4 = {"train.val_spp": 4}
    _write(tmp_path, "0", _metrics("f32", 0, psnr_per_image=[30.0] * 64, config=spp4))
    _write(tmp_path, "1", _metrics("f32", 1, psnr_per_image=[31.0] * 64, config=spp4))
    _write(tmp_path, "2", _metrics("f32", 0, scene="duck", psnr_per_image=[40.0] * 8))
    builtin, duck, runs = _scene_headings(tmp_path)
    assert "validation views: 64, 4 x 4 samples per pixel." in builtin
    assert "Iterations: 20; validation views: 8." in duck
    assert sorted(r["val_spp"] for r in runs) == [1, 4, 4]


def _scene_headings(root: Path) -> tuple[str, str, list[dict]]:
    """The report's sections of the builtin and duck scenes, and results.json's runs."""
    write_report(root)
    text = (root / "report.md").read_text()
    builtin, duck = (text.split(f"## Scene `{name}`")[1].split("## Scene")[0]
                     for name in ("builtin", "duck"))  # fmt: skip
    return builtin, duck, json.loads((root / "results.json").read_text())["runs"]


# ----------------------------------------------------------------------------- Adam's epsilon
def test_grid_gradient_factor_is_what_adam_reads():
    # The factor each arm leaves on the grid's gradient, measured: the gradient the optimizer
    # reads (after the stepper's unscale) over the same arm's with every scale set to 1 (same
    # initial weights, same batch): what is left of the arm's scaling when Adam steps.
    import dataclasses

    import torch

    from mptex import MLPTexture3D
    from mptex.precision import PrecisionPolicy, PrecisionStepper

    def grid_grad(policy):
        torch.manual_seed(0)
        tex = MLPTexture3D([[0, 0, 0], [1, 1, 1]], precision=policy)
        stepper = PrecisionStepper(tex.policy, torch.optim.Adam(tex.parameters(), lr=1e-3))
        x = torch.rand(2048, 3, generator=torch.Generator().manual_seed(1))
        stepper.backward((tex.sample(x) - 0.3).abs().mean())
        stepper.unscale_()
        return tex.encoder.params.grad.float()

    arms = ("f32", "nvdiffrec", "nvdiffrec_scale1", "f16_static", "f16_dynamic", "bf16",
            "tcnn_fused", "tcnn_fused_swap154")  # fmt: skip
    for arm in arms:
        policy = PrecisionPolicy.named(arm)
        unit = dataclasses.replace(policy, static_loss_scale=1.0, init_scale=1.0,
                                   fused_loss_scale=1.0)  # fmt: skip
        got, ref = grid_grad(policy), grid_grad(unit)
        both = (got != 0) & (ref != 0)  # f16 flushes small gradients, more of them at scale 1
        assert both.sum() > 500, arm
        # each f16 gradient is rounded to 11 bits (relative 2^-11) at both scales: the median
        # ratio lies within 1 % of the factor
        ratio = (got[both] / ref[both]).median().item()
        assert ratio == pytest.approx(policy.grid_grad_factor, rel=1e-2), arm
    assert PrecisionPolicy.named("nvdiffrec").grid_grad_factor == 128.0
    assert PrecisionPolicy.named("tcnn_fused").grid_grad_factor == 1.0


def test_an_arm_with_another_grid_epsilon_is_named_under_the_table(tmp_path):
    nv = {"precision.loss_scaling": "nvdiffrec", "precision.static_loss_scale": 128.0}
    s1 = {"precision.loss_scaling": "nvdiffrec", "precision.static_loss_scale": 1.0}
    _three_seeds(tmp_path, "f32", [40.0, 41.0, 42.0], t=0.30)
    _three_seeds(tmp_path, "nvdiffrec", [40.5, 41.6, 42.55], t=0.2, config=nv)
    _three_seeds(tmp_path, "nvdiffrec_scale1", [40.1, 41.0, 41.9], t=0.2, config=s1)
    write_report(tmp_path)
    text = (tmp_path / "report.md").read_text()
    rows = _rows(tmp_path)
    assert rows[("nvdiffrec",)]["grid_adam_eps"] == [pytest.approx(1e-8 / 128)]
    assert rows[("nvdiffrec_scale1",)]["grid_adam_eps"] == [1e-8]
    assert rows[("f32",)]["grid_adam_eps"] == [1e-8]
    (line,) = [x for x in text.splitlines() if x.startswith("- Not precision alone")]
    assert "`nvdiffrec` runs Adam on the grid with an effective epsilon of 7.81e-11" in line
    assert "`f32`'s 1e-08" in line and "`train.adam_eps=1e-15`" in line and "(x128)" in line
    # the measurement it cites is a page of the docs
    assert "(docs/archive/adam-epsilon.md: +0.29 dB" in line
    assert (Path(__file__).resolve().parents[1] / "docs/archive/adam-epsilon.md").is_file()
    summary = json.loads((tmp_path / "results.json").read_text())["summary"]
    assert {r["precision"]: r["grid_adam_eps"] for r in summary}["nvdiffrec"] == [7.8125e-11]


def test_epsilons_below_where_they_matter_are_not_named(tmp_path):
    nv = {"precision.loss_scaling": "nvdiffrec", "precision.static_loss_scale": 128.0}
    _three_seeds(tmp_path, "f32", [40.0, 41.0, 42.0], t=0.30, config={"train.adam_eps": 1e-15})
    _three_seeds(tmp_path, "nvdiffrec", [40.5, 41.6, 42.55], t=0.2,
                 config={**nv, "train.adam_eps": 1e-15})  # fmt: skip
    write_report(tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert _rows(tmp_path)[("nvdiffrec",)]["grid_adam_eps"] == [pytest.approx(1e-15 / 128)]
    assert "Not precision alone" not in text
    assert "Better than `f32`: `nvdiffrec`" in text


# ----------------------------------------------------------------------------- plateau, stuck
def _validated(psnrs, stuck, baseline=13.36, iterations=2400):
    # validations every 800 iterations, as the real-asset protocol; the last one's saturation
    step = iterations // len(psnrs)
    history = [{"iteration": step * (i + 1), "loss": 0.03, "psnr": p,
                "stuck_fraction": [0.0, 0.0, stuck]} for i, p in enumerate(psnrs)]  # fmt: skip
    m = _metrics("tcnn_fused", 1, psnr=psnrs[-1], baseline=baseline, iterations=iterations,
                 iterations_planned=iterations)  # fmt: skip
    m.update(history=history, saturation={"stuck_fraction": [0.0, 0.0, stuck],
                                          "saturated_fraction": [0.5, 0.3, 0.91]})  # fmt: skip
    return m


def test_a_plateau_held_by_stuck_pixels_above_the_baseline_is_a_collapse(tmp_path):
    from mptex.collapse import classify_collapse

    # tcnn_fused on the real-asset torus, seed 1 (docs/archive/collapse-rule.md)
    got = classify_collapse(_validated([20.03, 20.04, 20.04], stuck=0.1616))
    assert got["rule"] == "plateau, stuck" and got["stuck_channel"] == 2
    assert got["reason"] == (
        "16% of covered pixels stuck in channel 2 (since iteration 800), "
        "PSNR 20.04 dB > baseline 13.36 dB, flat since iteration 800"
    )
    # not a collapse: still learning with the same stuck pixels; flat with few stuck pixels (a
    # run that converged early); and the f32 runs' largest stuck fraction on a plateau
    assert classify_collapse(_validated([20.03, 24.0, 28.0], stuck=0.1616)) is None
    assert classify_collapse(_validated([48.0, 48.1, 48.1], stuck=0.09)) is None
    assert classify_collapse(_validated([48.0, 48.1, 48.1], stuck=5.3e-4)) is None
    # in a report: counted apart and left out of the pairs
    for seed, psnr in enumerate([58.0, 57.5, 57.7]):
        _write(tmp_path, f"f32_{seed}", _metrics("f32", seed, psnr=psnr))
    for seed, psnr in ((0, 57.3), (2, 57.6)):
        _write(tmp_path, f"tf_{seed}", _metrics("tcnn_fused", seed, psnr=psnr))
    _write(tmp_path, "tf_1", _validated([20.03, 20.04, 20.04], stuck=0.1616))
    write_report(tmp_path)
    row = _rows(tmp_path)[("tcnn_fused",)]
    assert row["collapsed"] == 1 and row["n_seeds"] == 2
    assert [s for s, _ in row["pairs"]] == [0, 2]
    assert (
        "flat that way with ≥ 10% stuck, above the baseline too"
        in (tmp_path / "report.md").read_text()
    )


# ----------------------------------------------------------------------------- partly stuck
def _partly_stuck(psnr=48.81, stuck=0.0018, share=0.975, baseline=28.9):
    # The duck, nvdiffrec, seed 0 (docs/archive/collapse-rule.md): 0.18 % stuck in blue, 48.81
    # dB against f32's 65.02, 19.9 dB above the baseline; a share of 97.5 % is that 16 dB.
    m = _metrics("nvdiffrec", 0, psnr=psnr, baseline=baseline)
    m["saturation"] = {"stuck_fraction": [0.0, 0.0, stuck], "saturated_fraction": [0.4, 0.2, 0.6],
                       "stuck_error_fraction": share}  # fmt: skip
    return m


def test_a_run_whose_few_stuck_pixels_hold_most_of_its_error_is_partly_stuck(tmp_path):
    from mptex.collapse import classify_collapse, classify_partly_stuck

    duck = _partly_stuck()
    assert classify_collapse(duck) is None
    got = classify_partly_stuck(duck)
    assert got["stuck_channel"] == 2 and got["stuck_error_fraction"] == 0.975
    assert got["gain_db"] == pytest.approx(-10 * math.log10(0.025))  # 16.0 dB
    assert got["reason"] == ("0.18% of covered pixels stuck in channel 2 hold 98% of the "
                             "squared error (about +16.0 dB without them), PSNR 48.81 dB > "
                             "baseline 28.90 dB")  # fmt: skip
    # not partly stuck: stuck pixels holding half or less of the error; no stuck pixel; at or
    # below the baseline (then the collapse rule judges it); an older metrics.json
    assert classify_partly_stuck(_partly_stuck(share=0.5 - 1e-9)) is None
    assert classify_partly_stuck(_partly_stuck(stuck=0.0)) is None
    assert classify_partly_stuck(_partly_stuck(psnr=20.0)) is None
    older = _partly_stuck()
    del older["saturation"]["stuck_error_fraction"]
    assert classify_partly_stuck(older) is None
    assert classify_partly_stuck(_partly_stuck(share=0.5))["gain_db"] == pytest.approx(3.0103)
    # in a report: counted (in the PSNR and the pairs), and named under the table
    for seed, psnr in enumerate([65.02, 64.8, 64.9]):
        _write(tmp_path, f"f32_{seed}", _metrics("f32", seed, psnr=psnr, baseline=28.9))
    _write(tmp_path, "nv_0", duck)
    for seed, psnr in ((1, 64.9), (2, 65.0)):
        _write(tmp_path, f"nv_{seed}", _metrics("nvdiffrec", seed, psnr=psnr, baseline=28.9))
    write_report(tmp_path)
    row = _rows(tmp_path)[("nvdiffrec",)]
    assert row["n_seeds"] == 3 and [s for s, _ in row["pairs"]] == [0, 1, 2]
    assert [p["seed"] for p in row["partly_stuck_runs"]] == [0]
    text = (tmp_path / "report.md").read_text()
    assert "- Partly stuck (1 run; completed and counted in PSNR, Δ and verdict" in text
    assert "`nvdiffrec` seed 0: 0.18% of covered pixels stuck in channel 2" in text
    assert "is partly stuck when its stuck pixels (in any channel) hold ≥ 50%" in text


def test_a_run_a_stop_signal_reached_after_its_last_iteration_is_named_and_still_compared(
    tmp_path,
):
    # metrics.json's stop_requested: the run completed all its iterations, so it is compared
    # as any completed run, but the signal (a cluster that wanted it stopped; exit 3, which a
    # plain sbatch script requeues on) is said beside the table and in results.tex.
    for seed in (0, 1):
        _write(tmp_path, f"f32_{seed}", _metrics("f32", seed, psnr=30.0 + seed))
        stop = {"signal": "SIGTERM", "during": "metrics"} if seed == 1 else None
        _write(tmp_path, f"bf16_{seed}", _metrics("bf16", seed, psnr=29.0 + seed,
                                                  stop_requested=stop))  # fmt: skip
    write_report(tmp_path)
    rows = _rows(tmp_path)
    assert rows[("bf16",)]["n_seeds"] == 2 and rows[("bf16",)]["delta"]["n"] == 2
    assert rows[("bf16",)]["stop_requested_runs"] == [
        {"run_dir": "bf16_1", "seed": 1, "status": "completed", "signal": "SIGTERM",
         "during": "metrics"}]  # fmt: skip
    assert rows[("f32",)]["stop_requested_runs"] == []
    text = (tmp_path / "report.md").read_text()
    assert ("- Stop requested after the last iteration had begun (1 run; the signal cut none "
            "of them short: each ended where it would have without it") in text  # fmt: skip
    assert "`bf16` seed 1 (completed; SIGTERM during the metrics.json write)." in text
    tex = (tmp_path / "results.tex").read_text()
    assert ("% Stop requested after the last iteration had begun (none cut short by it, "
            "counted as usual; report.md says more): bf16 seed 1 (SIGTERM during metrics).\n"
            ) in tex  # fmt: skip
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    stops = [r["stop_requested"] for r in runs if r["precision"] == "bf16"]
    assert stops == [None, {"signal": "SIGTERM", "during": "metrics"}]


def test_a_diverged_run_a_stop_signal_reached_at_its_end_is_named_too(tmp_path):
    # finish() records stop_requested for a diverged run as well (the signal came as its last
    # iteration ran): the row names it with its status, though it is not a completed run.
    for seed in (0, 1):
        _write(tmp_path, f"f32_{seed}", _metrics("f32", seed, psnr=30.0 + seed))
    late = {"signal": "SIGTERM", "during": "metrics"}
    _write(tmp_path, "bf16_0", _metrics("bf16", 0, psnr=29.0, stop_requested=late))
    stop = {"signal": "SIGINT", "during": "last iteration"}
    _write(tmp_path, "bf16_1", _metrics("bf16", 1, status="diverged", diverged_at=3,
                                        stop_requested=stop))  # fmt: skip
    write_report(tmp_path)
    assert _rows(tmp_path)[("bf16",)]["stop_requested_runs"] == [
        {"run_dir": "bf16_0", "seed": 0, "status": "completed", **late},
        {"run_dir": "bf16_1", "seed": 1, "status": "diverged", **stop},
    ]
    text = (tmp_path / "report.md").read_text()
    assert "- Stop requested after the last iteration had begun (2 runs; " in text
    assert ("`bf16` seed 0 (completed; SIGTERM during the metrics.json write); `bf16` seed 1 "
            "(diverged; SIGINT during the last iteration).") in text  # fmt: skip
    # a diverged run did not run all its iterations: no line may say it did
    assert "all its iterations" not in text.replace("a completed run after all its iterations", "")
    assert "completed all iterations" not in (tmp_path / "results.tex").read_text()


def test_each_part_of_a_run_a_stop_can_come_in_is_named_as_a_line_says_it():
    # The parts the training loop records (mptex.train.loop._note_stop's list), as read in
    # report.md's and mptex-train's lines: "... SIGTERM during the validation images".
    from mptex.report.markdown import during_text

    parts = ["last iteration", "final validation", "final checkpoint", "images", "export",
             "metrics"]  # fmt: skip
    assert [during_text(part) for part in parts] == [
        "the last iteration", "the final validation", "the final checkpoint",
        "the validation images", "the export", "the metrics.json write",
    ]  # fmt: skip


def test_the_quantisation_table_per_layer(tmp_path):
    def fp8_metrics(seed, overflows):
        m = _metrics("fp8", seed, psnr=40.0)
        for entry, error in zip(m["history"], (0.02, 0.04)):
            for layer in (0, 1):
                entry.update({f"net.{layer}.q_input_rel_error": error * (layer + 1),
                              f"net.{layer}.q_input_overflows": overflows,
                              f"net.{layer}.q_input_amax": 3.0 + seed})  # fmt: skip
        return m

    for seed in (0, 1):
        _write(tmp_path, f"f32_{seed}", _metrics("f32", seed, psnr=40.0))
    _write(tmp_path, "fp8_0", fp8_metrics(0, 2.0))
    _write(tmp_path, "fp8_1", fp8_metrics(1, 4.0))
    write_report(tmp_path)
    row = _rows(tmp_path)[("fp8",)]
    # per run: the mean error over the samples (0.03), the last count, the largest amax; then
    # the mean over the runs
    assert row["quantization"]["net.0.q_input_rel_error"] == pytest.approx(0.03)
    assert row["quantization"]["net.1.q_input_rel_error"] == pytest.approx(0.06)
    assert row["quantization"]["net.0.q_input_overflows"] == 3.0
    assert row["quantization"]["net.0.q_input_amax"] == 3.5
    text = (tmp_path / "report.md").read_text()
    assert "| arm | layer | input rel. error | overflows input / weight / grad | amax" in text
    assert "| `fp8` | net.1 | 0.06 | 3 / – / – | 3.5 / – / – |" in text


def test_runs_that_failed_at_start_stay_in_their_arms_row(tmp_path):
    # A run refused at start records its config as a started run would (defaults, the device
    # train.device=auto resolves to, the arm's fields): its arm's row counts it, and no key
    # that only the check resolves (train.device: auto against cpu) becomes a swept value.
    from hydra import compose, initialize_config_dir

    from mptex.cli import CONFIG_DIR
    from mptex.train import ConfigError, train

    tiny = ["train=tiny", "texture=tiny", "scene.resolution=16", "scene.n_train_views=2",
            "scene.n_val_views=1", "scene.tubular_segments=32", "scene.radial_segments=6",
            "train.iterations=2", "train.device=auto"]  # fmt: skip
    for arm in ("f32", "bf16"):
        for seed in (0, 1, -1):
            with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
                cfg = compose("config", overrides=[*tiny, f"precision={arm}",
                                                   f"train.seed={seed}"])  # fmt: skip
            if seed < 0:
                with pytest.raises(ConfigError, match="^train.seed"):
                    train(cfg, tmp_path / f"{arm}_{seed}")
            else:
                train(cfg, tmp_path / f"{arm}_{seed}")
    # and a job that crashed before writing metrics.json: Hydra's copy of its config
    from omegaconf import OmegaConf

    from mptex.report.collect import group_runs

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[*tiny, "precision=f32", "train.seed=2"])
    (tmp_path / "f32_2" / ".hydra").mkdir(parents=True)
    (tmp_path / "f32_2" / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    keys, groups, _, _ = group_runs(collect_runs(tmp_path))
    assert len(groups) == 2 and all(k.startswith("precision.") for k in keys), keys
    rows = {row["precision"]: row for row in summarize(collect_runs(tmp_path))}
    assert set(rows) == {"f32", "bf16"}
    assert rows["bf16"]["n_runs"] == 3 and rows["bf16"]["completed"] == 2
    assert rows["bf16"]["failed"] == 1
    assert rows["f32"]["n_runs"] == 4 and rows["f32"]["completed"] == 2
    assert rows["f32"]["failed"] == 2


@pytest.mark.parametrize(
    "launcher, shared",
    [("hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher\n    n_jobs: 4", 4),
     ("hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher\n    n_jobs: -1", 0),
     ("hydra._internal.core_plugins.basic_launcher.BasicLauncher", 1),
     ("hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher", 1)],
)  # fmt: skip
def test_runs_that_shared_the_machine_are_said_to_have_shared_it(tmp_path, launcher, shared):
    # Four runs at a time on one GPU (the GPU main job): each run's ms / iteration holds its
    # neighbours' work, which the speed columns and the fastest arm then compare.
    (tmp_path / "multirun.yaml").write_text(f"hydra:\n  launcher:\n    _target_: {launcher}\n")
    assert report.collect.concurrent_jobs(tmp_path) == shared
    _three_seeds(tmp_path, "f32", [40.0, 41.0, 42.0], t=0.30)
    _three_seeds(tmp_path, "bf16", [40.1, 40.9, 42.05], t=0.05)
    write_report(tmp_path)
    text = (tmp_path / "report.md").read_text()
    line = next((x for x in text.splitlines() if x.startswith("- The runs trained")), None)
    if shared == 1:
        assert line is None
    else:
        at_once = "as many as the machine's cores" if shared == 0 else "up to 4"
        assert line.startswith(f"- The runs trained {at_once} at a time on one machine")


def test_a_sweep_stopped_before_all_its_jobs_ran_says_so(tmp_path):
    # multirun.yaml plans 2 arms x 3 seeds (one swept in hydra.sweeper.params, one on the
    # command line, which wins over params for the same key); two jobs ran before a stop.
    (tmp_path / "multirun.yaml").write_text(
        "hydra:\n"
        "  sweeper:\n"
        "    _target_: hydra._internal.core_plugins.basic_sweeper.BasicSweeper\n"
        "    params:\n      precision: f32,bf16,fp8\n"
        "  overrides:\n    task: [train=tiny, 'precision=f32,bf16', 'train.seed=0,1,2']\n"
    )
    _write(tmp_path, "0", _metrics("f32", 0))
    _write(tmp_path, "1", _metrics("bf16", 0))
    assert report.collect.planned_jobs(tmp_path) == 6
    write_report(tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert ("**Incomplete sweep**: 4 of the 6 jobs its multirun.yaml plans have no run "
            "directory") in text  # fmt: skip
    for seed in (1, 2):
        _write(tmp_path, f"f32_{seed}", _metrics("f32", seed))
        _write(tmp_path, f"bf16_{seed}", _metrics("bf16", seed))
    write_report(tmp_path)
    assert "Incomplete sweep" not in (tmp_path / "report.md").read_text()


def test_one_run_of_a_planned_sweep_names_the_keys_the_sweep_planned(tmp_path):
    # multirun.yaml plans precision x train.seed (2 x 3 jobs); only f32 seed 0 ran, so the runs
    # vary no key, yet the sweep swept two: the header names them rather than "nothing".
    (tmp_path / "multirun.yaml").write_text(
        "hydra:\n"
        "  sweeper:\n"
        "    _target_: hydra._internal.core_plugins.basic_sweeper.BasicSweeper\n"
        "  overrides:\n    task: [train=tiny, 'precision=f32,bf16', 'train.seed=0,1,2']\n"
    )
    _write(tmp_path, "0", _metrics("f32", 0))
    assert report.collect.planned_swept_keys(tmp_path) == ["precision", "train.seed"]
    write_report(tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert ("Swept: nothing among these runs (its multirun.yaml plans `precision` x "
            "`train.seed`)") in text  # fmt: skip
    assert "Swept: nothing;" not in text


def test_a_folder_without_multirun_yaml_whose_runs_vary_nothing_swept_nothing(tmp_path):
    _write(tmp_path, "0", _metrics("f32", 0))
    assert report.collect.planned_swept_keys(tmp_path) is None
    write_report(tmp_path)
    assert "Swept: nothing; seeds: 0." in (tmp_path / "report.md").read_text()


def test_a_sweep_added_to_a_folder_of_finished_runs_counts_its_own_unstarted_jobs(tmp_path):
    # The first sweep (f32, bf16 x seeds 0, 1) completed; a second one into the same folder
    # (hydra.callbacks.fresh_sweep_dir.enabled=false) planned seed 2 of both arms and was
    # stopped after its first job. multirun.yaml is the second sweep's: 2 jobs, 1 of which
    # (bf16, seed 2) has no run directory, although the folder holds 5 runs.
    def job(name, arm, seed):
        run = _write(tmp_path, name, _metrics(arm, seed))
        (run / ".hydra").mkdir()
        (run / ".hydra" / "overrides.yaml").write_text(
            f"- train=tiny\n- precision={arm}\n- train.seed={seed}\n"
        )

    for number, (arm, seed) in enumerate([("f32", 0), ("f32", 1), ("bf16", 0), ("bf16", 1)]):
        job(f"{number}_precision={arm},train.seed={seed},train=tiny", arm, seed)
    job("0_precision=f32,train.seed=2,train=tiny", "f32", 2)
    (tmp_path / "multirun.yaml").write_text(
        "hydra:\n"
        "  sweeper:\n"
        "    _target_: hydra._internal.core_plugins.basic_sweeper.BasicSweeper\n"
        "  overrides:\n    task: [train=tiny, 'precision=f32,bf16', train.seed=2]\n"
    )
    write_report(tmp_path)
    assert ("**Incomplete sweep**: 1 of the 2 jobs its multirun.yaml plans have no run "
            "directory") in (tmp_path / "report.md").read_text()  # fmt: skip
    # The stopped job continued alone, with an override of its own added, is that job.
    job("1_precision=bf16,train.seed=2,train=tiny", "bf16", 2)
    run = tmp_path / "1_precision=bf16,train.seed=2,train=tiny"
    with (run / ".hydra" / "overrides.yaml").open("a") as overrides:
        overrides.write("- train.resume=true\n")
    write_report(tmp_path)
    assert "Incomplete sweep" not in (tmp_path / "report.md").read_text()
