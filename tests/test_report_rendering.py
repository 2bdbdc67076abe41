"""What report.md, results.tex and results.csv print, against values worked out by hand: the
margin's digits in a verdict, which number goes in which column, and which run a line counts.

Each test pins one printed fact that a plausible slip in the rendering (a format spec, a
swapped column, a count of rows instead of runs) would change while every number behind it
stayed right.
"""

import csv
import json

import pytest
from report_runs import metrics as _metrics
from report_runs import write_run as _write

from mptex.report import collect, markdown, stats, write_report
from mptex.report.markdown import verdict_text


def _tables(folder, margin=0.5, adjust="none"):
    runs = collect.collect_runs(folder)
    keys, groups, duplicates, unidentified = collect.group_runs(runs)
    shown = collect.shown_keys([r for g in groups for r in g], keys)
    rows = stats.summarize_groups(groups, shown, margin, adjust)
    return runs, keys, groups, duplicates, unidentified, rows


def _report_md(folder, margin=0.5, adjust="none", shared=1):
    runs, keys, groups, duplicates, unidentified, rows = _tables(folder, margin, adjust)
    return markdown.render_report(folder, runs, keys, rows, groups, stats.sections(rows),
                                  duplicates, unidentified, {}, margin, shared)  # fmt: skip


@pytest.mark.parametrize("margin, text", [(0.25, "±0.25 dB"), (1.0, "±1 dB"), (0.125, "±0.125 dB")])
def test_no_detectable_difference_names_the_margin_with_all_its_digits(margin, text):
    # The margin is printed as given (format "g"): 0.25 must not read 0.2, nor 1 read 1.0.
    row = {"precision": "bf16", "verdict": "no detectable difference", "n_seeds": 3,
           "delta": {"n": 3, "mean": 0.0, "sd": 0.01, "half_width": 0.01, "low": -0.01,
                     "high": 0.01}}  # fmt: skip
    assert verdict_text(row, margin) == f"no detectable difference within {text}"


@pytest.fixture
def no_plots(monkeypatch):
    """write_report without its pictures (the tables' files are what these tests read)."""
    from mptex.report import plots

    monkeypatch.setattr(plots, "plot_history", lambda *args: False)
    monkeypatch.setattr(plots, "plot_images", lambda *args: None)


def test_results_csv_columns_read_back_as_each_run_wrote_them(tmp_path, no_plots):
    # Two arms on seeds 0 and 1, a failed bf16 run on seed 2, a copy of f32's seed 0 (a
    # duplicate, not counted) and a folder whose metrics.json is not JSON (no config: in no
    # row). Each value below is the one its metrics.json holds.
    written = {
        "f32_0": _metrics("f32", 0, psnr=31.5, t=0.025),
        "f32_1": _metrics("f32", 1, psnr=32.25, t=0.0275),
        "bf16_0": _metrics("bf16", 0, psnr=30.75, t=0.0125),
        "bf16_1": _metrics("bf16", 1, psnr=31.0, t=0.015),
        "bf16_2": _metrics("bf16", 2, status="failed", error="boom"),
    }
    for name, record in written.items():
        _write(tmp_path, name, record)
    _write(tmp_path, "z_copy", _metrics("f32", 0, psnr=31.5, t=0.025))
    _write(tmp_path, "broken", "{not json")
    write_report(tmp_path)
    with (tmp_path / "results.csv").open(newline="") as f:
        reader = csv.reader(f)
        header = next(reader)
        lines = list(reader)
    # the swept key (the seed is a run's own column, not a key that splits rows)
    assert header == [*collect.RUN_FIELDS, "collapsed", "precision.name", "counted", "note"]
    runs = {line[header.index("run_dir")]: dict(zip(header, line, strict=True)) for line in lines}
    assert set(runs) == {*written, "z_copy", "broken"}
    for name, record in written.items():
        run = runs[name]
        assert (run["precision"], run["seed"], run["status"]) == (
            record["precision"],
            str(record["seed"]),
            record["status"],
        )
        assert run["psnr"] == ("" if record["psnr"] is None else repr(record["psnr"]))
        assert float(run["time_per_iter_s"]) == record["time_per_iter_s"]
        assert float(run["peak_memory_bytes"]) == record["peak_memory_bytes"]
        assert run["precision.name"] == record["precision"]
        assert run["counted"] == "True" and run["collapsed"] == "False"
    assert runs["bf16_2"]["error"] == "boom"
    assert (runs["z_copy"]["counted"], runs["z_copy"]["note"]) == ("False", "duplicate of f32_0")
    assert runs["broken"]["counted"] == "False" and runs["broken"]["status"] == "failed"
    assert runs["broken"]["precision.name"] == ""  # no config: no key value, not a guess


@pytest.mark.parametrize(
    "adjust, comparisons, confidence", [("none", 2, 0.95), ("bonferroni", 2, 0.975)]
)
def test_results_json_states_the_intervals_family(
    tmp_path, no_plots, adjust, comparisons, confidence
):
    # f32, bf16 and f16_static on seeds 0 and 1: two comparisons with an interval; Bonferroni
    # puts each at 1 - 0.05 / 2 = 0.975. The margin given is the one written.
    for seed in range(2):
        _write(tmp_path, f"f32_{seed}", _metrics("f32", seed, psnr=31.0))
        _write(tmp_path, f"bf16_{seed}", _metrics("bf16", seed, psnr=30.5 + 0.25 * seed))
        _write(tmp_path, f"f16_{seed}", _metrics("f16_static", seed, psnr=30.0 + 0.5 * seed))
    write_report(tmp_path, margin_db=0.25, adjust=adjust)
    document = json.loads((tmp_path / "results.json").read_text())
    assert document["margin_db"] == 0.25
    assert document["intervals"] == {
        "adjust": adjust,
        "comparisons": comparisons,
        "interval_confidence": pytest.approx(confidence, abs=1e-12),
    }
    assert {r["precision"]: r["confidence"] for r in document["summary"]}["bf16"] == (
        pytest.approx(confidence, abs=1e-12)
    )  # 1 - 0.05 / 2 computed in binary


def _tex(folder, margin=0.5, adjust="none", shared=1):
    from mptex.report.latex import render_latex

    runs, keys, groups, duplicates, unidentified, rows = _tables(folder, margin, adjust)
    return render_latex(rows, stats.sections(rows), margin, folder, ("cpu",), shared)


def test_results_tex_of_a_bonferroni_family_states_each_level_and_the_familys(tmp_path):
    # f32, bf16 and f16_static on seeds 0 and 1: k = 2 comparisons, each at 1 - 0.05 / 2 =
    # 97.5 %, all of them together at 95 %.
    for seed in range(2):
        _write(tmp_path, f"f32_{seed}", _metrics("f32", seed, psnr=31.0))
        _write(tmp_path, f"bf16_{seed}", _metrics("bf16", seed, psnr=30.5 + 0.25 * seed))
        _write(tmp_path, f"f16_{seed}", _metrics("f16_static", seed, psnr=30.0 + 0.5 * seed))
    text = _tex(tmp_path, adjust="bonferroni")
    assert (
        r"97.5\% Student-t interval over the paired seeds, Bonferroni-adjusted over the "
        r"report's 2 comparisons (all hold together at 95\%)"
    ) in text
    assert r"(dB) [97.5\% CI]" in text
    plain = _tex(tmp_path)
    assert r"95\% Student-t interval over the paired seeds, each for its own comparison" in plain
    assert r"(dB) [95\% CI]" in plain


def test_results_tex_key_columns_hold_each_rows_own_values_under_their_headings(tmp_path):
    # f32 over two swept precision keys, alpha in (1, 2) x beta in (u, v): each row's cells
    # under the headings \texttt{precision.alpha} and \texttt{precision.beta} are the values
    # its run was configured with.
    written = set()
    for alpha in (1, 2):
        for beta in ("u", "v"):
            config = {"precision.alpha": alpha, "precision.beta": beta}
            _write(tmp_path, f"f32_{alpha}{beta}", _metrics("f32", 0, config=config))
            written.add((str(alpha), beta))
    lines = _tex(tmp_path).splitlines()
    header = next(line for line in lines if line.startswith("Arm & "))
    names = [cell.strip() for cell in header.removesuffix(r" \\").split(" & ")]
    at = {key: names.index(r"\texttt{" + key + "}") for key in ("precision.alpha",
                                                                "precision.beta")}  # fmt: skip
    cells = [line.removesuffix(r" \\").split(" & ") for line in lines
             if line.startswith(r"\texttt{f32}")]  # fmt: skip
    assert len(cells) == 4
    assert {(c[at["precision.alpha"]], c[at["precision.beta"]]) for c in cells} == written


def _fastest_line(text):
    (line,) = [line for line in text.splitlines() if line.startswith("- Fastest arm at")]
    return line


def test_an_arm_shown_faster_per_seed_is_named_fastest_with_its_numbers(tmp_path):
    # f32 at 31 dB and 100 ms on seeds 0-2; bf16 at 31.125, 30.875, 31 dB and 50 ms: Δ per
    # seed +0.125, -0.125, 0 -> mean 0, sd 0.125, half width t(0.975, 2) 0.125 / sqrt(3) =
    # 4.3027 * 0.072169 = 0.3105: [-0.31, +0.31], within ±0.5 dB; every seed's speed-up is
    # exactly 2, an interval [2, 2] above 1.
    for seed, psnr in enumerate((31.125, 30.875, 31.0)):
        _write(tmp_path, f"f32_{seed}", _metrics("f32", seed, psnr=31.0, t=0.1))
        _write(tmp_path, f"bf16_{seed}", _metrics("bf16", seed, psnr=psnr, t=0.05))
    text = _report_md(tmp_path)
    line = _fastest_line(text)
    assert line.startswith(
        "- Fastest arm at `f32`'s quality: **`bf16`** (no detectable difference within ±0.5 dB: "
        "Δ +0.00 dB, 95% CI [-0.31, +0.31] over 3 seeds; 50.0 ms/iteration, 2.00x `f32`'s "
        "speed, a ratio of mean times; per seed 2.00x "
    )
    # f32, the only other arm at f32's quality, is told apart from bf16 (2x on every seed), and
    # bf16 lost no run
    assert "Not told apart by speed" not in text
    assert "Not at `f32`'s quality" not in text


def test_two_arms_faster_than_f32_but_not_than_each_other_are_both_named(tmp_path):
    # bf16 at 50 ms and f16_static at 49, 52, 51 ms on seeds 0-2 (mean 50.7), both about 2x
    # faster than f32 per seed; bf16 over f16_static per seed: 49/50, 52/50, 51/50, an
    # interval around 1.
    for seed, t in enumerate((0.049, 0.052, 0.051)):
        _write(tmp_path, f"f32_{seed}", _metrics("f32", seed, psnr=31.0, t=0.1))
        _write(tmp_path, f"bf16_{seed}", _metrics("bf16", seed, psnr=31.0, t=0.05))
        _write(tmp_path, f"f16_{seed}", _metrics("f16_static", seed, psnr=31.0, t=t))
    text = _report_md(tmp_path)
    assert _fastest_line(text).startswith("- Fastest arm at `f32`'s quality: **`bf16`** (")
    assert (
        "- Not told apart by speed: `bf16` and `f16_static` (also at `f32`'s quality): the "
        "first over the second per seed "
    ) in text


def test_a_lower_mean_time_without_a_per_seed_interval_above_1_names_no_fastest_arm(tmp_path):
    # bf16 at f32's quality (the same Δ as above) with a lower mean time, 95 ms against 100,
    # but per seed speed-ups of 100/90, 100/110, 100/85 = 1.11, 0.91, 1.18: their interval
    # reaches below 1, so no arm is called faster than f32.
    for seed, (psnr, t) in enumerate(((31.125, 0.09), (30.875, 0.11), (31.0, 0.085))):
        _write(tmp_path, f"f32_{seed}", _metrics("f32", seed, psnr=31.0, t=0.1))
        _write(tmp_path, f"bf16_{seed}", _metrics("bf16", seed, psnr=psnr, t=t))
    line = _fastest_line(_report_md(tmp_path))
    # mean time (0.09 + 0.11 + 0.085) / 3 = 0.095 s; f32's 0.1 over it: 1.0526 -> 1.05x
    assert line.startswith(
        "- Fastest arm at `f32`'s quality: none measurably faster than `f32`. `bf16` had the "
        "lowest mean time (95.0 ms/iteration, 1.05x `f32`'s speed, a ratio of mean times), but "
        "per seed its speed-up is "
    )
    assert line.endswith(", not above 1.")


def _cell(text, arm, column):
    """The cell of ``arm``'s row under the heading that starts with ``column``."""
    header = next(line for line in text.splitlines() if line.startswith("| arm "))
    index = next(i for i, name in enumerate(header.split("|")) if name.strip().startswith(column))
    row = next(line for line in text.splitlines() if line.startswith(f"| `{arm}` "))
    return row.split("|")[index].strip()


def test_the_runs_column_counts_each_outcome_under_its_heading(tmp_path):
    # bf16: 1 completed, 2 diverged, 3 failed and 4 unavailable runs (distinct counts, so a
    # count under another outcome's heading shows), its completed run at its 20 dB
    # constant-colour baseline; f32: 2 completed.
    outcomes = ["completed"] + ["diverged"] * 2 + ["failed"] * 3 + ["unavailable"] * 4
    for seed, status in enumerate(outcomes):
        extra = {"diverged_at": 5} if status == "diverged" else {}
        record = _metrics("bf16", seed, psnr=20.0, baseline=20.0, status=status, **extra)
        _write(tmp_path, f"bf16_{seed}", record)
    for seed in range(2):
        _write(tmp_path, f"f32_{seed}", _metrics("f32", seed))
    text = _report_md(tmp_path)
    heading = "runs ok / coll. / div / fail / n.a."
    assert _cell(text, "bf16", heading) == "1 / 0 / 2 / 3 / 4"
    assert _cell(text, "f32", heading) == "2 / 0 / 0 / 0 / 0"
    assert _cell(text, "bf16", "seeds") == "1"
    assert "- Diverged: `bf16` (2/10 runs, at iteration 5, 5)." in text
    assert "- Failed: `bf16` (3/10 runs: " in text
    assert "- Unavailable: `bf16` (4/10 runs: " in text
    # of the completed runs, the ones a baseline is compared with
    assert "- ⚠ At or below the constant-colour baseline: `bf16` (1 of 1 runs)." in text
