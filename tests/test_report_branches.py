"""report.md's rarer branches on hand-made sweeps: no reference run, a reference that only
collapsed, the multiplicity sentence for each family size, mixed backends in one arm, plots that
failed, a stop request whose part is not recorded, and the #154 section's figure and statistics
table."""

import pytest
from report_runs import metrics as _metrics
from report_runs import write_run as _write
from test_collect_edges import _run as _collected
from test_report_writers import _collapsed, _report_md

from mptex.report import attribution as attr
from mptex.report import collect_runs, markdown, plots, write_report


def test_without_a_reference_row_no_arm_is_compared_and_none_is_called_unmatched(tmp_path):
    for seed in range(2):
        _write(tmp_path, f"b{seed}", _metrics("bf16", seed))
    text = _report_md(tmp_path)
    assert "- No completed `f32` run: no arm can be compared with it." in text
    assert "Not compared (no `f32` row" not in text  # said once, by the line above


def test_a_reference_whose_runs_all_collapsed_says_so(tmp_path):
    for seed in range(2):
        _write(tmp_path, f"f{seed}", _collapsed("f32", seed))
        _write(tmp_path, f"b{seed}", _metrics("bf16", seed))
    assert ("- No completed `f32` run (collapsed runs are not compared): no arm can be compared "
            "with it.") in _report_md(tmp_path)  # fmt: skip


def test_the_multiplicity_sentence_for_each_family():
    # k = 4 Bonferroni: each interval at 1 - 0.05/4 = 98.75 %
    text = markdown._multiplicity("bonferroni", 4, 1 - 0.05 / 4)
    assert text.startswith("The intervals are adjusted for the k = 4 comparisons with an interval")
    assert "(Bonferroni: each at 1 − 0.05/4 = 98.75%)" in text
    assert markdown._multiplicity("bonferroni", 1, 0.95) == (
        "Adjusted for multiplicity (bonferroni), but the report's tables hold one comparison "
        "with an interval: it is 95% as it stands."
    )
    assert "hold no comparison with an interval" in markdown._multiplicity("bonferroni", 0, 0.95)
    # unadjusted: 1 - 0.95^5 = 0.226 of sweeps of five equal arms show a false verdict
    assert "(about 23% at k = 5;" in markdown._multiplicity("none", 3, 0.95)


def test_an_arm_whose_runs_ran_different_backends_names_each(tmp_path):
    for seed, encoder in ((0, "tcnn"), (1, "torch")):
        _write(tmp_path, f"f{seed}", _metrics("f32", seed, backends={"encoder": encoder,
                                                                     "mlp": "torch"}))  # fmt: skip
    assert ("- Backends that ran (encoder / MLP / rasterizer; torch = mptex's PyTorch twin): "
            "`f32` tcnn / torch / –, torch / torch / –") in _report_md(tmp_path)  # fmt: skip


def test_a_plot_that_fails_is_named_under_the_report(tmp_path, monkeypatch):
    def fails(*args):
        raise RuntimeError("no display")

    monkeypatch.setattr(plots, "plot_history", lambda *args: False)
    monkeypatch.setattr(plots, "plot_images", fails)
    for seed in range(2):
        _write(tmp_path, f"f{seed}", _metrics("f32", seed))
    written = write_report(tmp_path)
    assert "images.png" not in written
    text = (tmp_path / "report.md").read_text()
    assert text.endswith("\nPlots not drawn:\n- images.png: RuntimeError: no display\n")


def test_a_stop_request_without_its_part_reads_unknown(tmp_path):
    _write(tmp_path, "f0", _metrics("f32", 0, stop_requested={"signal": "SIGTERM"}))
    (run,) = collect_runs(tmp_path)
    assert run["stop_requested"] == {"signal": "SIGTERM", "during": "unknown"}


def _gap_runs(history_key=None):
    runs = []
    for seed in range(2):
        history = [{"iteration": 10, "psnr": 20.0}, {"iteration": 20, "psnr": 21.0}]
        if history_key:
            history = [{**h, history_key: 0.5} for h in history]
        runs += [_collected(attr.BASE, seed, 30.0 + seed, history=history),
                 _collected(attr.SWAP, seed, 29.0 + seed, history=history)]  # fmt: skip
    return runs


@pytest.mark.parametrize("plotted", [True, False])
def test_the_gap_section_shows_its_figure_only_where_it_was_drawn(plotted):
    lines = attr.render(attr.attribution(_gap_runs(), 0.5), 0.5, plotted=plotted)
    figure = "![the gap and its terms over iterations](gap_curves.png)"
    assert (figure in lines) is plotted


def test_the_gap_statistics_table_puts_the_encoders_columns_first_and_dashes_what_is_missing():
    result = attr.attribution(_gap_runs(), 0.5)
    result["statistics"] = {"tcnn_fused": {"net.0.fused_zero_frac": 0.25,
                                           "encoder.out_grad_zero_frac": 0.125},
                            "nvdiffrec": {"net.0.fused_zero_frac": 0.5}}  # fmt: skip
    lines = attr.render(result, 0.5, plotted=False)
    at = lines.index("| arm | `encoder.out_grad_zero_frac` | `net.0.fused_zero_frac` |")
    assert lines[at + 2 : at + 4] == ["| `tcnn_fused` | 0.125 | 0.25 |",
                                      "| `nvdiffrec` | – | 0.5 |"]  # fmt: skip


BASIC_SWEEP = """hydra:
  sweeper:
    _target_: hydra._internal.core_plugins.basic_sweeper.BasicSweeper
  overrides:
    task:
    - precision=f32,bf16
    - train.seed=0
"""


def test_a_job_continued_with_more_overrides_and_one_without_them_count_as_started(tmp_path):
    # f32's job was continued alone with train.resume=true (its overrides are a superset of
    # the planned ones); bf16's directory has no overrides.yaml (one started job, unnamed):
    # no job is missing, and the report says nothing of an incomplete sweep.
    from mptex.report.collect import unstarted_jobs

    (tmp_path / "multirun.yaml").write_text(BASIC_SWEEP)
    f32 = _write(tmp_path, "0", _metrics("f32", 0))
    (f32 / ".hydra").mkdir()
    (f32 / ".hydra" / "overrides.yaml").write_text(
        "- precision=f32\n- train.seed=0\n- train.resume=true\n"
    )
    _write(tmp_path, "1", _metrics("bf16", 0))
    assert unstarted_jobs(tmp_path, ["0", "1"]) == (0, 2)
    assert "Incomplete sweep" not in _report_md(tmp_path)
    assert unstarted_jobs(tmp_path, ["0"]) == (1, 2)  # bf16's never started


def test_a_joblib_sweep_on_all_cores_ran_as_many_at_once_as_the_machine_has(tmp_path):
    from mptex.report.collect import concurrent_jobs

    launcher = "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"
    for n_jobs, at_once in ((-1, 0), (3, 3)):
        (tmp_path / "multirun.yaml").write_text(
            f"hydra:\n  launcher:\n    _target_: {launcher}\n    n_jobs: {n_jobs}\n"
        )
        assert concurrent_jobs(tmp_path) == at_once


def test_the_gap_table_shows_every_sixth_validation_and_the_last():
    # 30 validations (10 ... 300): 30 // 6 = 5, so 10, 60, ..., 260, and the last, 300
    runs = []
    for seed in range(2):
        history = [{"iteration": 10 * (k + 1), "psnr": 20.0} for k in range(30)]
        runs += [_collected(attr.BASE, seed, 30.0 + seed, history=history),
                 _collected(attr.SWAP, seed, 29.0 + seed, history=history)]  # fmt: skip
    lines = attr.render(attr.attribution(runs, 0.5), 0.5, plotted=False)
    assert "| iteration | 10 | 60 | 110 | 160 | 210 | 260 | 300 |" in lines


def test_the_sweeps_report_callback_says_where_the_report_is(tmp_path, monkeypatch, capsys):
    from mptex.report import writer

    report = tmp_path / "written" / "report.md"
    monkeypatch.setattr(writer, "write_report", lambda *args: {"report.md": report})
    callback = writer.ReportCallback()
    callback._pending = tmp_path
    callback._write_pending()
    assert capsys.readouterr().out == f"mptex-report: report in {report}\n"


def test_the_sweeps_report_callback_refuses_a_bad_margin_with_exit_2(capsys):
    from mptex.report.writer import ReportCallback

    with pytest.raises(SystemExit) as info:
        ReportCallback(margin_db=0.0)
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        "mptex-train: error: hydra.callbacks.report.margin_db: expected a finite number > 0, "
        "got 0.0\n"
    )


def test_a_sweep_folder_in_use_is_refused_naming_its_first_three_jobs(tmp_path, capsys):
    from omegaconf import OmegaConf

    from mptex.report.writer import FreshSweepDirCallback

    for name in ("0_a", "1_b", "2_c", "3_d"):
        _write(tmp_path, name, _metrics("f32", 0))
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    with pytest.raises(SystemExit) as info:
        FreshSweepDirCallback().on_multirun_start(config)
    assert info.value.code == 2
    assert f"{tmp_path} already holds a sweep (0_a, 1_b, 2_c); " in capsys.readouterr().err


def test_one_unpaired_seed_is_named_in_the_singular(tmp_path):
    for seed in range(2):
        _write(tmp_path, f"f{seed}", _metrics("f32", seed))
    for seed in range(3):
        _write(tmp_path, f"b{seed}", _metrics("bf16", seed))
    assert ("- Completed but not paired (no completed `f32` run with that seed): `bf16` seed 2; "
            "in the row's seeds and PSNR, not in its Δ.") in _report_md(tmp_path)  # fmt: skip


def test_unreadable_runs_count_those_without_a_config_apart(tmp_path):
    # Two unreadable metrics.json: one job has Hydra's config (placed in f32's row), one has
    # none (in no row).
    for seed in range(2):
        _write(tmp_path, f"f{seed}", _metrics("f32", seed))
    placed = _write(tmp_path, "placed", "{not json")
    (placed / ".hydra").mkdir()
    (placed / ".hydra" / "config.yaml").write_text(
        "precision:\n  name: f32\nscene:\n  name: builtin\ntrain:\n  seed: 5\n"
    )
    _write(tmp_path, "lost", "{not json")
    assert ("Unreadable runs (2; counted as failed, 1 of them in no row: no config to place "
            "them):") in _report_md(tmp_path)  # fmt: skip


def test_one_swept_key_that_follows_from_the_arm_is_said_in_the_singular(tmp_path):
    for seed in range(2):
        _write(tmp_path, f"f{seed}", _metrics("f32", seed))
        static = _metrics("f16_static", seed, config={"precision.loss_scaling": "static"})
        _write(tmp_path, f"s{seed}", static)
    assert "(and 1 key that follows from the arm or scene)" in _report_md(tmp_path)
