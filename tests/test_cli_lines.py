"""The lines the commands print when they stop, refuse or end, and their exit statuses, called
in-process (the subprocess tests elsewhere run the same paths end to end, more slowly)."""

from pathlib import Path

import pytest

from mptex.cli import report as report_cli
from mptex.cli.app import SWEEP_PARENT_ENV, SWEEP_STOPPED_ENV


@pytest.fixture
def plain_job(monkeypatch):
    """Neither a submitit job nor a worker of a parallel sweep."""
    for name in ("SUBMITIT_EXECUTOR", SWEEP_PARENT_ENV, SWEEP_STOPPED_ENV):
        monkeypatch.delenv(name, raising=False)


STOP = {"status": "diverged", "stop_requested": {"signal": "SIGTERM", "during": "metrics"}}


def test_a_run_stopped_after_training_exits_3_with_nothing_to_continue(plain_job, capsys):
    from mptex.cli.train import _stopped_after_training

    with pytest.raises(SystemExit) as info:
        _stopped_after_training(STOP, Path("/o/run"), False)
    assert info.value.code == 3
    assert capsys.readouterr().err == (
        "mptex-train: stop requested by SIGTERM during the metrics.json write, after training "
        "had ended: the run is diverged with its results whole (metrics.json: stop_requested); "
        "nothing is left to continue\n"
    )


def test_a_basic_sweeps_job_stopped_after_training_stops_the_sweep(plain_job, capsys):
    from mptex.cli.train import _stopped_after_training

    with pytest.raises(SystemExit) as info:
        _stopped_after_training(STOP, Path("/o/sweep/0_a"), True, Path("/o/sweep"))
    assert info.value.code == 3
    assert capsys.readouterr().err.endswith(
        "(metrics.json: stop_requested); the sweep stops here; the same command with "
        "hydra.sweep.dir=/o/sweep hydra.callbacks.fresh_sweep_dir.enabled=false continues the "
        "sweep (its completed runs train again)\n"
    )


@pytest.fixture
def reports(monkeypatch):
    """write_report replaced: ``[(sweep, margin_db, adjust)]`` of each call."""
    calls = []

    def write_report(sweep, margin_db, adjust):
        calls.append((sweep, margin_db, adjust))
        return {"report.md": sweep / "report.md"}

    monkeypatch.setattr(report_cli, "write_report", write_report)
    return calls


def test_report_of_a_folder_of_sweeps_says_how_many_and_where_each_report_is(
    tmp_path, reports, capsys
):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "multirun.yaml").write_text("{}\n")
    argv = [str(tmp_path), "--margin-db", "0.3", "--adjust", "bonferroni"]
    assert report_cli.report_main(argv) == 0
    assert reports == [(tmp_path / "a", 0.3, "bonferroni"), (tmp_path / "b", 0.3, "bonferroni")]
    assert capsys.readouterr().out.splitlines() == [
        f"mptex-report: {tmp_path} holds 2 sweeps; one report each",
        f"mptex-report: report in {tmp_path / 'a' / 'report.md'}",
        f"mptex-report: report in {tmp_path / 'b' / 'report.md'}",
    ]


def test_report_refuses_an_adjustment_it_does_not_know_naming_the_flag(tmp_path, reports, capsys):
    with pytest.raises(SystemExit) as info:  # argparse's choices: its own one line, status 2
        report_cli.report_main([str(tmp_path), "--adjust", "holm"])
    assert info.value.code == 2 and reports == []
    assert "argument --adjust: invalid choice: 'holm'" in capsys.readouterr().err


def test_rescore_takes_16_samples_per_pixel_and_refuses_17(tmp_path, monkeypatch, capsys):
    import torch

    from mptex.cli.rescore import rescore_main

    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # this process's stays

    missing = str(tmp_path / "none")
    assert rescore_main([missing, "--val-spp", "17"]) == 2
    assert capsys.readouterr().err == (
        "mptex-rescore: error: --val-spp: expected integers in [1, 16], got [17]\n"
    )
    assert rescore_main([missing, "--val-spp", "1", "16"]) == 2  # past the check: no run there
    assert capsys.readouterr().err == f"mptex-rescore: {missing}: no such run directory\n"


def test_rescore_names_five_skipped_files_without_a_count_of_more():
    from mptex.cli.rescore import _files_skipped

    names = [Path(f"f{i}") for i in range(6)]
    assert _files_skipped(names[:5]) == (
        "5 files, not run directories, skipped: f0, f1, f2, f3, f4"
    )
    assert _files_skipped(names).endswith(": f0, f1, f2, f3, f4 and 1 more")


def test_the_search_command_names_the_certified_candidate_and_its_report(
    tmp_path, monkeypatch, capsys
):
    import mptex.search
    from mptex.cli.search import run_search_command

    summary = {
        "candidates": [
            {"candidate": "f32", "certificate": None},
            {"candidate": "bf16", "certificate": {"low": -0.2, "high": 0.1, "certified": True}},
        ],
        "reference": "f32", "certified": "bf16", "seeds": [1, 2],
        "budget": {"runs": 5, "search_wall_s": 61.4}, "reproduce": "mptex-train precision=x",
        "result_config": "configs/precision/x.yaml",
    }  # fmt: skip
    monkeypatch.setattr(mptex.search, "run_search", lambda cfg, out: summary)
    run_search_command({}, tmp_path)
    assert capsys.readouterr().out.splitlines() == [
        "mptex-search: precision search: certified bf16 (PSNR - PSNR(f32) [-0.20, +0.10] dB, "
        "seeds [1, 2]); 5 runs, 61 s",
        "mptex-search: mptex-train precision=x trains it (configs/precision/x.yaml)",
        f"mptex-search: report in {tmp_path / 'search.md'}",
    ]
