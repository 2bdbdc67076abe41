"""Edges of the shared Hydra app runner (``mptex.cli.app``) and of ``mptex-train``'s own
handling of a run's outcome (``mptex.cli.train``), called in-process.

Checked: sweep job directory names (escapes and the 200-character cut, against md5 computed
here), the stop signals a parallel sweep installs, the worker's check at a job's start and its
notes for the sweep's process, the lines and exit statuses at a stopped sweep's end, the
output-file check, the Ctrl-C handler, the override check's messages (Hydra's advice kept where
no key is close, one-line syntax errors, interrupts found through ``__context__``), and
``mptex-train``'s submitit, interruption, disk-full, config-error and export lines, its check of
a sweep's values (suite assets and searches left to their jobs), and where ``mptex-search``
adds its experiment (checked against Hydra's own argument parser). Expected values are the
documented strings and exit statuses (0 ok, 2 bad input, 3 stopped), written out here by hand,
not read back from the code under test.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf, open_dict

from mptex.cli import app
from mptex.train.signals import StopSignals, send_signal

ALL_STOP = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT", "SIGXCPU")


@pytest.fixture
def sweep_env(monkeypatch):
    """No parallel sweep's variables from outside; every stop signal's handler and the
    thread's signal mask as they were, whatever the test installed or blocked."""
    for name in (app.SWEEP_PARENT_ENV, app.SWEEP_HELD_ENV, app.SWEEP_STOPPED_ENV):
        monkeypatch.delenv(name, raising=False)
    handlers = {n: signal.getsignal(signal.Signals[n]) for n in ALL_STOP}
    mask = (
        signal.pthread_sigmask(signal.SIG_BLOCK, []) if hasattr(signal, "pthread_sigmask") else None
    )
    yield monkeypatch
    for n, handler in handlers.items():
        signal.signal(signal.Signals[n], handler)
    if mask is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    for name in (app.SWEEP_PARENT_ENV, app.SWEEP_HELD_ENV, app.SWEEP_STOPPED_ENV):
        os.environ.pop(name, None)


def other_pid() -> str:
    return str(os.getpid() + 1)


# ----------------------------------------------------------------------------- job dirnames
def test_job_dirname_escapes_percent_and_backslash_so_distinct_overrides_stay_distinct():
    # "%" first, so that a literal "%2F" in a value and an escaped "/" cannot meet
    assert app.job_dirname("a=50%") == "a=50%25"
    assert app.job_dirname("a=%2F") == "a=%252F"
    assert app.job_dirname("a=/") == "a=%2F"
    assert app.job_dirname("scene.path=C:\\m\\a.obj") == "scene.path=C:%5Cm%5Ca.obj"


def test_a_name_of_200_characters_is_kept_and_one_of_201_is_cut_to_191_and_a_digest():
    at_limit = "x=" + "a" * 198  # 2 + 198 = 200 characters: kept as it is
    assert app.job_dirname(at_limit) == at_limit
    over = "x=" + "a" * 199  # 201 characters: the first 200 - 9 = 191, "~", 8 hex digits
    digest = hashlib.md5(over.encode()).hexdigest()[:8]
    assert app.job_dirname(over) == over[:191] + "~" + digest
    assert len(app.job_dirname(over)) == 191 + 1 + 8 == 200


# ----------------------------------------------------------------------------- stop signals
def test_a_sweeps_stop_signals_are_the_known_names_the_defaults_or_none_for_a_bad_value():
    given = OmegaConf.create({"train": {"stop_signals": ["SIGTERM", "SIGKILL", "SIGUSR1"]}})
    assert app._stop_signal_names(given) == ["SIGTERM", "SIGUSR1"]  # SIGKILL: not a stop signal
    # no train.stop_signals: train's defaults (configs/train/default.yaml)
    assert app._stop_signal_names(OmegaConf.create({})) == [
        "SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"]  # fmt: skip
    # a string, not a list: none here (the run's own check names the bad value)
    bad = OmegaConf.create({"train": {"stop_signals": "SIGTERM"}})
    assert app._stop_signal_names(bad) == []


def _multirun_config(tmp_path, launcher: str, stop_signals) -> object:
    return OmegaConf.create({
        "hydra": {"launcher": {"_target_": launcher}, "sweep": {"dir": str(tmp_path / "s w")}},
        "train": {"stop_signals": stop_signals},
    })  # fmt: skip


JOBLIB = "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"
BASIC = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"


def test_the_parallel_stop_callback_leaves_a_disabled_callback_an_empty_list_and_other_launchers(
    sweep_env, tmp_path
):
    sweep_env.setattr(app, "_SWEEP_STOP", StopSignals(relay=True))
    before = signal.getsignal(signal.SIGUSR1)
    for callback, config in (
        (
            app.ParallelSweepStopCallback(enabled=False),
            _multirun_config(tmp_path, JOBLIB, ["SIGUSR1"]),
        ),
        (app.ParallelSweepStopCallback(), _multirun_config(tmp_path, JOBLIB, [])),
        (app.ParallelSweepStopCallback(), _multirun_config(tmp_path, BASIC, ["SIGUSR1"])),
    ):  # fmt: skip
        callback.on_multirun_start(config)
        assert app.SWEEP_PARENT_ENV not in os.environ
        assert app.SWEEP_STOPPED_ENV not in os.environ
        assert signal.getsignal(signal.SIGUSR1) is before
        assert not app._SWEEP_STOP.installed


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="holds signals by mask")
def test_the_parallel_stop_callback_under_joblib_records_holds_and_names_the_sweep(
    sweep_env, tmp_path
):
    stop = StopSignals(relay=True)
    sweep_env.setattr(app, "_SWEEP_STOP", stop)
    sweep_env.setattr(app, "_stopped_sweep_dir", [])
    app.ParallelSweepStopCallback().on_multirun_start(
        _multirun_config(tmp_path, JOBLIB, ["SIGUSR1", "SIGUSR2"])
    )
    notes = os.environ[app.SWEEP_STOPPED_ENV]
    try:
        assert os.environ[app.SWEEP_PARENT_ENV] == str(os.getpid())
        assert os.environ[app.SWEEP_HELD_ENV] == "SIGUSR1,SIGUSR2"
        assert Path(notes).is_file() and app._stopped_sweep_dir == [str(tmp_path / "s w")]
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        assert {signal.SIGUSR1, signal.SIGUSR2} <= blocked
        assert signal.getsignal(signal.SIGUSR1) == stop._handle
        app._release_held()
        assert not {signal.SIGUSR1, signal.SIGUSR2} & signal.pthread_sigmask(signal.SIG_BLOCK, [])
    finally:
        stop.uninstall()
        Path(notes).unlink(missing_ok=True)


def test_a_sweep_job_process_is_one_whose_sweep_parent_is_another_process(sweep_env):
    assert not app.sweep_job_process()  # no sweep
    sweep_env.setenv(app.SWEEP_PARENT_ENV, "")
    assert not app.sweep_job_process()
    sweep_env.setenv(app.SWEEP_PARENT_ENV, str(os.getpid()))  # the sweep's own process
    assert not app.sweep_job_process()
    sweep_env.setenv(app.SWEEP_PARENT_ENV, other_pid())
    assert app.sweep_job_process()


# ----------------------------------------------------------------------------- a worker's jobs
def test_a_job_after_a_stop_signal_does_not_start_and_only_hydras_files_are_removed(
    sweep_env, tmp_path, capsys
):
    notes = tmp_path / "notes.txt"
    notes.write_text("")
    sweep_env.setenv(app.SWEEP_PARENT_ENV, other_pid())
    sweep_env.setenv(app.SWEEP_STOPPED_ENV, str(notes))
    stop = StopSignals()
    sweep_env.setattr(app, "_JOB_PROCESS_STOP", stop)
    cfg = OmegaConf.create({"train": {"stop_signals": ["SIGUSR1", "SIGUSR2"]}})
    fresh = tmp_path / "3_train.seed=2"  # what Hydra made for the job: .hydra/ and its log
    (fresh / ".hydra").mkdir(parents=True)
    (fresh / "train.log").write_text("")
    kept = tmp_path / "4_train.seed=3"  # a job that trained before: its files stay
    (kept / ".hydra").mkdir(parents=True)
    (kept / "checkpoint.pt").write_bytes(b"x")
    try:
        assert app.stopped_before_start(cfg, fresh, "mptex-train") is False  # no signal yet
        assert fresh.is_dir() and stop.installed
        send_signal("SIGUSR1")
        send_signal("SIGUSR2")
        assert app.stopped_before_start(cfg, fresh, "mptex-train") is True
        assert app.stopped_before_start(cfg, kept, "mptex-train") is True
    finally:
        stop.uninstall()
    assert not fresh.exists()
    assert sorted(p.name for p in kept.iterdir()) == [".hydra", "checkpoint.pt"]
    assert capsys.readouterr().err.splitlines() == [
        "mptex-train: not started: the sweep was stopped by SIGUSR1 before this job "
        "(3_train.seed=2)",
        "mptex-train: not started: the sweep was stopped by SIGUSR1 before this job "
        "(4_train.seed=3)",
    ]
    assert notes.read_text() == "3_train.seed=2: not started\n4_train.seed=3: not started\n"


def test_outside_a_parallel_sweeps_job_nothing_is_checked_or_noted(sweep_env, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("")
    sweep_env.setenv(app.SWEEP_STOPPED_ENV, str(notes))
    sweep_env.setenv(app.SWEEP_PARENT_ENV, str(os.getpid()))  # the sweep's own process
    assert app.stopped_before_start(OmegaConf.create({}), tmp_path, "mptex-train") is False
    app.record_stopped_job(tmp_path / "0_a", "interrupted")
    assert notes.read_text() == ""


def test_each_stopped_job_adds_its_line_and_the_sweep_reads_them_once(sweep_env, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("")
    sweep_env.setenv(app.SWEEP_STOPPED_ENV, str(notes))
    sweep_env.setenv(app.SWEEP_PARENT_ENV, other_pid())
    app.record_stopped_job(tmp_path / "0_a", "interrupted")
    app.record_stopped_job(str(tmp_path / "1_b"), "not started")
    assert notes.read_text() == "0_a: interrupted\n1_b: not started\n"
    with notes.open("a") as f:
        f.write("\n   \n")  # blank lines are no jobs
    assert app._stopped_jobs() == ["0_a: interrupted", "1_b: not started"]
    assert not notes.exists() and app.SWEEP_STOPPED_ENV not in os.environ
    assert app._stopped_jobs() == []


# ----------------------------------------------------------------------------- output files
def test_an_output_file_that_cannot_be_written_is_one_line_naming_the_flag(tmp_path, monkeypatch):
    assert app.output_file_problem("--out", tmp_path / "r.json") is None
    line = "--out: cannot write {} (not a writable file location)"
    assert app.output_file_problem("--out", tmp_path) == line.format(tmp_path)  # a folder
    missing = tmp_path / "gone" / "r.json"
    assert app.output_file_problem("--out", missing) == line.format(missing)
    link = tmp_path / "link.json"  # judged by where it points
    link.symlink_to(missing)
    assert app.output_file_problem("--out", link) == line.format(link)
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o555)
    try:
        if not os.access(tmp_path / "ro", os.W_OK):  # root may write anywhere
            ro = tmp_path / "ro" / "r.json"
            assert app.output_file_problem("--json", ro) == (
                f"--json: cannot write {ro} (not a writable file location)"
            )
    finally:
        (tmp_path / "ro").chmod(0o755)
    # A folder this process may read but not write, as a non-root user sees a read-only one
    # (root passes every permission check, so the check is asked of os.access here).
    real_access = os.access
    readable_only = str(tmp_path / "ro")
    monkeypatch.setattr(
        os,
        "access",
        lambda p, mode: mode == os.R_OK if str(p) == readable_only else real_access(p, mode),
    )
    ro = tmp_path / "ro" / "r.json"
    assert app.output_file_problem("--json", ro) == (
        f"--json: cannot write {ro} (not a writable file location)"
    )


# ----------------------------------------------------------------------------- Ctrl-C
def test_the_ctrl_c_handler_is_only_installed_over_pythons_own(sweep_env):
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a shell's background job
    try:
        ignored = app._CtrlC()
        ignored.install()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        ignored.uninstall()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        ctrl_c = app._CtrlC()
        ctrl_c.install()
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        assert ctrl_c.received
        ctrl_c.uninstall()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


# ----------------------------------------------------------------------------- a sweep's end
def _run_app_with(tmp_path, monkeypatch, *overrides, task=lambda cfg: None):
    """``run_hydra_app(task)`` as ``mptex-train <overrides>`` into ``tmp_path``: its exit
    code (None where it returned)."""
    from hydra.core.global_hydra import GlobalHydra

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["mptex-train", *overrides, f"hydra.run.dir={tmp_path}"])
    try:
        app.run_hydra_app(task, "mptex-train")
    except SystemExit as exc:
        return exc.code
    finally:
        GlobalHydra.instance().clear()
    return None


def _run_app(tmp_path, monkeypatch, task=lambda cfg: None):
    """``run_hydra_app(task)`` as ``mptex-train train=tiny`` into ``tmp_path``."""
    return _run_app_with(tmp_path, monkeypatch, "train=tiny", task=task)


CONTINUES = (
    "the same command with hydra.sweep.dir='/data/my sweep' hydra.callbacks."
    "fresh_sweep_dir.enabled=false continues the sweep (train.resume=auto; its completed runs "
    "train again)"
)


def test_a_sweep_whose_workers_were_stopped_alone_exits_3_naming_each_job(
    sweep_env, tmp_path, capsys
):
    notes = tmp_path / "notes.txt"
    notes.write_text("0_train.seed=0: interrupted\n2_train.seed=2: not started\n")
    sweep_env.setenv(app.SWEEP_PARENT_ENV, str(os.getpid()))  # this is the sweep's process
    sweep_env.setenv(app.SWEEP_STOPPED_ENV, str(notes))
    sweep_env.setattr(app, "_SWEEP_STOP", StopSignals(relay=True))  # it saw no signal
    sweep_env.setattr(app, "_stopped_sweep_dir", ["/data/my sweep"])  # quoted: a space
    assert _run_app(tmp_path, sweep_env) == 3
    assert capsys.readouterr().err.splitlines() == [
        "mptex-train: sweep ended with 2 of its jobs stopped by a signal to their worker "
        "process (0_train.seed=0: interrupted; 2_train.seed=2: not started): " + CONTINUES
    ]
    assert not notes.exists()


def test_a_sweep_stopped_by_a_signal_exits_3_naming_the_first_signal(sweep_env, tmp_path, capsys):
    stop = StopSignals(relay=True)
    stop.received = ["SIGTERM", "SIGINT"]
    sweep_env.setattr(app, "_SWEEP_STOP", stop)
    sweep_env.setattr(app, "_stopped_sweep_dir", ["/data/my sweep"])
    assert _run_app(tmp_path, sweep_env) == 3
    assert capsys.readouterr().err.splitlines() == [
        "mptex-train: sweep stopped by SIGTERM: the jobs under way wrote their checkpoints, the "
        "others did not start; " + CONTINUES
    ]


def test_a_run_whose_process_is_a_sweeps_worker_leaves_the_notes_to_the_sweep(
    sweep_env, tmp_path, capsys
):
    notes = tmp_path / "notes.txt"
    notes.write_text("0_train.seed=0: interrupted\n")
    sweep_env.setenv(app.SWEEP_PARENT_ENV, other_pid())  # a worker, not the sweep's process
    sweep_env.setenv(app.SWEEP_STOPPED_ENV, str(notes))
    sweep_env.setattr(app, "_SWEEP_STOP", StopSignals(relay=True))
    assert _run_app(tmp_path, sweep_env) is None
    assert notes.read_text() == "0_train.seed=0: interrupted\n"
    assert "sweep" not in capsys.readouterr().err


def test_a_sweep_with_one_worker_stopped_alone_exits_3_naming_it(sweep_env, tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("1_train.seed=1: completed, stop requested\n")
    sweep_env.setenv(app.SWEEP_PARENT_ENV, str(os.getpid()))
    sweep_env.setenv(app.SWEEP_STOPPED_ENV, str(notes))
    sweep_env.setattr(app, "_SWEEP_STOP", StopSignals(relay=True))
    sweep_env.setattr(app, "_stopped_sweep_dir", ["/data/my sweep"])
    assert _run_app(tmp_path, sweep_env) == 3
    assert capsys.readouterr().err.splitlines() == [
        "mptex-train: sweep ended with 1 of its jobs stopped by a signal to their worker "
        "process (1_train.seed=1: completed, stop requested): " + CONTINUES
    ]


def test_hydras_own_error_keeps_its_status_1_without_a_ctrl_c_line(sweep_env, tmp_path, capsys):
    # A task that raises is Hydra's to report (status 1); no Ctrl-C came, so nothing says the
    # command was interrupted.
    def fails(cfg):
        raise RuntimeError("boom")

    assert _run_app_with(tmp_path, sweep_env, "train=tiny", task=fails) == 1
    err = capsys.readouterr().err
    assert "boom" in err and "interrupted" not in err and "SIGINT" not in err


def test_a_bad_value_of_a_sweep_is_one_line_and_exit_2_before_any_job(sweep_env, tmp_path,
                                                                      capsys):  # fmt: skip
    ran = []
    code = _run_app_with(tmp_path, sweep_env, "-m", "train=tiny", "precision=f32,f12",
                         task=ran.append)  # fmt: skip
    assert code == 2 and ran == []
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("mptex-train: error: "), err
    assert "precision/f12" in err[0]


def test_the_sweeps_report_is_written_once_when_the_sweep_ends(tmp_path, monkeypatch, capsys):
    from mptex.report import writer

    calls = []
    report = tmp_path / "report.md"
    monkeypatch.setattr(writer, "write_report",
                        lambda *args: calls.append(args) or {"report.md": report})  # fmt: skip
    registered = []
    monkeypatch.setattr(writer.atexit, "register", registered.append)
    callback = writer.ReportCallback(margin_db=0.25, adjust="bonferroni")
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    callback.on_multirun_start(config)
    callback.on_multirun_end(config)
    for at_exit in registered:  # the interpreter's exit after a sweep that ended normally
        at_exit()
    assert calls == [(tmp_path.resolve(), 0.25, "bonferroni")]
    assert capsys.readouterr().out == f"mptex-report: report in {report}\n"
    # hydra.callbacks.report.enabled=false: no report, also at the interpreter's exit
    registered.clear()
    disabled = writer.ReportCallback(enabled=False)
    disabled.on_multirun_start(config)
    disabled.on_multirun_end(config)
    for at_exit in registered:
        at_exit()
    assert len(calls) == 1 and capsys.readouterr().out == ""


def test_a_report_that_cannot_be_written_is_one_line_naming_the_sweep(tmp_path, monkeypatch,
                                                                      capsys):  # fmt: skip
    from mptex.report import writer

    def fails(*args):
        raise ValueError("no runs with metrics.json")

    monkeypatch.setattr(writer, "write_report", fails)
    callback = writer.ReportCallback()
    callback._pending = tmp_path
    callback._write_pending()
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        f"mptex-report: no report for {tmp_path}: ValueError: no runs with metrics.json\n"
    )


# ----------------------------------------------------------------------------- override check
def test_a_key_not_close_to_any_keeps_hydras_advice_to_append_it():
    # difflib's ratio of "train.qqq" (9 characters) to its nearest key "train.lr" (8): the
    # common "train." is 6 characters, 2 * 6 / (9 + 8) = 0.71 < 0.8: no key is named.
    app.register_experiments()
    assert app.override_problem(["train.qqq=5"]) == (
        "Could not override 'train.qqq'. To append to your config use +train.qqq=5"
    )


def test_an_override_syntax_error_is_one_line():
    problem = app.override_problem(["train.lr=[1,"])
    assert problem.startswith("override syntax: no viable alternative at input '[1,'")
    assert "\n" not in problem and "  " not in problem


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.betas={a:1}", "train.betas: expected a list, got {a:1}"),
        ("train.light_dir={x:1}", "train.light_dir: expected a list, got {x:1}"),
        ("++export.chart_options=[1,2]", "export.chart_options: expected a mapping, got [1,2]"),
    ],
)
def test_a_value_hydra_cannot_merge_into_its_key_says_what_the_key_holds(override, expected):
    # Hydra's line was "Error merging override train.betas={a:1}": the key, not what it takes.
    app.register_experiments()
    assert app.override_problem([override]) == expected


def test_an_interrupt_behind_an_error_is_found_through_its_context_too():
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise AttributeError("half-built node")  # noqa: B904 (its context, not its cause)
    except AttributeError as exc:
        error = exc
    assert error.__cause__ is None and isinstance(error.__context__, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        app._reraise_interrupt(error)
    app._reraise_interrupt(ValueError("of its own"))  # nothing behind it: returns


def test_a_swept_keys_problem_is_left_to_its_job_but_not_one_of_a_key_it_prefixes(tmp_path):
    # An experiment's sweeper sets train.lr in each job: what this check says of train.lr is
    # not about any job; train.lr_decay is another key, whose bad value stops the sweep.
    from mptex.cli.train import _sweep_value_problem

    (tmp_path / "edge_lr_sweep.yaml").write_text(
        "# @package _global_\nhydra:\n  sweeper:\n    params:\n      train.lr: 0.01,0.02\n"
    )
    app.register_experiments(tmp_path)
    app.register_experiments()
    base = ["-m", "+experiment=edge_lr_sweep"]
    assert app.override_problem([*base, "train.lr=-1"], _sweep_value_problem) is None
    assert app.override_problem([*base, "train.lr_decay=-1"], _sweep_value_problem) == (
        "train.lr_decay: expected a finite number >= 0, got -1"
    )


# ----------------------------------------------------------------------------- mptex-train
def test_submitits_requeue_signal_is_its_preempt_signal_usr2_by_default(monkeypatch):
    from mptex.cli.train import _submitit_signal

    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    monkeypatch.setenv("SUBMITIT_PREEMPT_SIGNAL", "USR1")
    assert _submitit_signal() is None  # not a submitit job
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    assert _submitit_signal() is signal.SIGUSR1
    monkeypatch.delenv("SUBMITIT_PREEMPT_SIGNAL")
    assert _submitit_signal() is signal.SIGUSR2


@pytest.fixture
def submitit_job(sweep_env):
    """A submitit job (``SUBMITIT_EXECUTOR`` set) whose SIGUSR2 handler records its calls."""
    calls = []
    sweep_env.setenv("SUBMITIT_EXECUTOR", "local")
    sweep_env.delenv("SUBMITIT_PREEMPT_SIGNAL", raising=False)
    signal.signal(signal.SIGUSR2, lambda signum, frame: calls.append(signum))
    return calls


def test_a_submitit_job_stopped_by_another_signal_is_not_requeued_and_ends_normally(
    submitit_job, tmp_path, capsys
):
    from mptex.cli.train import _interrupted

    metrics = {"signal": "SIGTERM", "interrupted_at": 5, "iterations_planned": 20}
    assert _interrupted(metrics, tmp_path / "job", True, tmp_path / "sweep") is None
    assert submitit_job == []
    err = capsys.readouterr().err
    assert "requeue" not in err and "continues the sweep" in err


def test_a_submitit_job_stopped_by_its_preempt_signal_hands_it_back_to_submitit(
    submitit_job, tmp_path, capsys
):
    from mptex.cli.train import _interrupted

    metrics = {"signal": "SIGUSR2", "interrupted_at": 5, "iterations_planned": 20}
    assert _interrupted(metrics, tmp_path / "job", True, tmp_path / "sweep") is None
    assert submitit_job == [signal.SIGUSR2]
    assert capsys.readouterr().err.splitlines() == [
        f"mptex-train: interrupted by SIGUSR2 after iteration 5 of 20: checkpoint and metrics "
        f"in {tmp_path / 'job'}; submitit requeues this job, which continues it "
        "(train.resume=auto)"
    ]


@pytest.fixture
def held(sweep_env):
    """mptex-train's hold on submitit's signal, released after the test."""
    from mptex.cli import train as cli_train

    yield cli_train
    cli_train._SUBMITIT_HOLD.uninstall()
    cli_train._SUBMITIT_HOLD.received.clear()


def test_submitits_signal_after_a_run_ended_stays_with_the_job_until_a_stopped_run_hands_it_back(
    submitit_job, held, tmp_path, capsys
):
    # A run's handlers are removed at its end; until the job's process exits, submitit's signal
    # is recorded and dropped (submitit's requeue would run the completed run again). A run it
    # stopped hands it back to submitit, which requeues the job to continue it.
    held._hold_submitit_signal(OmegaConf.create({"train": {"stop_signals": ["SIGUSR2"]}}))
    run = StopSignals()
    run.install(["SIGTERM", "SIGUSR2"])
    run.uninstall()
    send_signal("SIGUSR2")
    assert submitit_job == [] and held._SUBMITIT_HOLD.received == ["SIGUSR2"]
    metrics = {"signal": "SIGUSR2", "interrupted_at": 5, "iterations_planned": 20}
    assert held._interrupted(metrics, tmp_path / "job", True, tmp_path / "sweep") is None
    assert submitit_job == [signal.SIGUSR2]
    assert "submitit requeues this job" in capsys.readouterr().err


def test_submitits_signal_is_not_held_where_the_run_leaves_it_alone(submitit_job, held):
    # train.stop_signals=[] (every signal's own action) or without SIGUSR2: submitit's stays.
    for names in ([], ["SIGTERM"]):
        held._hold_submitit_signal(OmegaConf.create({"train": {"stop_signals": names}}))
        assert not held._SUBMITIT_HOLD.installed
    send_signal("SIGUSR2")
    assert submitit_job == [signal.SIGUSR2]


def test_a_stopped_sweep_jobs_line_quotes_folders_with_spaces(sweep_env, capsys):
    from mptex.cli.train import _interrupted

    metrics = {"signal": "SIGINT", "interrupted_at": 3, "iterations_planned": 9}
    with pytest.raises(SystemExit) as info:  # basic launcher: the job's own status
        _interrupted(metrics, Path("/o/my sweep/0_a"), True, Path("/o/my sweep"))
    assert info.value.code == 3
    assert capsys.readouterr().err.splitlines() == [
        "mptex-train: interrupted by SIGINT after iteration 3 of 9: checkpoint and metrics in "
        "/o/my sweep/0_a; the same command with hydra.sweep.dir='/o/my sweep' "
        "hydra.callbacks.fresh_sweep_dir.enabled=false continues the sweep (its completed runs "
        "train again), or mptex-train hydra.run.dir='/o/my sweep/0_a' with this job's overrides "
        "(.hydra/overrides.yaml) continues this run alone (train.resume=auto)"
    ]


def test_a_stopped_sweep_jobs_line_gives_hydra_a_job_folder_named_by_its_overrides(
    sweep_env, capsys
):
    # Hydra names a sweep's job folders <n>_<key>=<value>,<key>=<value>: '=' and ',' are
    # override syntax, so the printed hydra.run.dir must reach Hydra quoted to be one path.
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from mptex.cli.train import _interrupted

    job = Path("/o/sweep/0_precision=f32,train.seed=0")
    metrics = {"signal": "SIGTERM", "interrupted_at": 3, "iterations_planned": 9}
    with pytest.raises(SystemExit):
        _interrupted(metrics, job, True, Path("/o/sweep"))
    line = capsys.readouterr().err.strip()
    words = shlex.split(line.split("or mptex-train ", 1)[1].split(" with this job's")[0])
    (override,) = OverridesParser.create().parse_overrides(words)
    assert override.key_or_group == "hydra.run.dir" and override.value() == str(job)


def test_a_precision_config_that_cannot_be_read_is_not_an_unavailable_arm():
    from mptex.cli.train import _arm_available

    for cfg in ({}, {"precision": 5}, {"precision": {"grid": "f99"}}):  # missing, bad, unknown
        assert _arm_available(OmegaConf.create(cfg)) == (True, ""), cfg


@pytest.fixture
def hydra_job(monkeypatch, tmp_path):
    """``mptex.cli.train._run`` as Hydra calls it: set ``.mode`` (RUN by default)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    job = SimpleNamespace(mode=RunMode.RUN, runtime=SimpleNamespace(output_dir=str(tmp_path)),
                          sweep=SimpleNamespace(dir=str(tmp_path.parent)))  # fmt: skip
    monkeypatch.setattr(HydraConfig, "get", staticmethod(lambda: job))
    monkeypatch.delenv(app.SWEEP_PARENT_ENV, raising=False)
    return job


def _train_raising(monkeypatch, error):
    import mptex.train

    def train(cfg, run_dir, exporter=None):
        raise error

    monkeypatch.setattr(mptex.train, "train", train)


def test_a_full_disk_is_exit_2_in_a_run_and_lets_a_sweep_go_on(hydra_job, monkeypatch, capsys):
    import errno

    from hydra.types import RunMode

    from mptex.cli.train import _run
    from mptex.train.checkpoint import DiskFullError

    message = "/o/checkpoint.pt: no space left on device (ENOSPC); /o/checkpoint.pt is unchanged"
    _train_raising(monkeypatch, DiskFullError(errno.ENOSPC, message, "/o/checkpoint.pt"))
    cfg = OmegaConf.create({"precision": {"name": "f32"}})
    with pytest.raises(SystemExit) as info:
        _run(cfg)
    assert info.value.code == 2
    assert capsys.readouterr().err == f"mptex-train: error: {message}\n"
    hydra_job.mode = RunMode.MULTIRUN
    assert _run(cfg) is None
    assert capsys.readouterr().err == f"mptex-train: error: {message}\n"


def test_a_config_error_is_exit_2_in_a_run_and_in_a_sweep_says_if_the_arm_is_unavailable(
    hydra_job, monkeypatch, capsys
):
    from hydra.types import RunMode

    import mptex.cli.train as train_cli
    from mptex.train import ConfigError

    _train_raising(monkeypatch, ConfigError("precision.mlp_backend=tcnn needs tinycudann"))
    cfg = OmegaConf.create({"precision": {"name": "tcnn_fused"}})
    with pytest.raises(SystemExit) as info:
        train_cli._run(cfg)
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        "mptex-train: error: precision.mlp_backend=tcnn needs tinycudann\n"
    )
    hydra_job.mode = RunMode.MULTIRUN
    for available, word in ((False, "unavailable on this machine"), (True, "error")):
        monkeypatch.setattr(train_cli, "_arm_available", lambda cfg, a=available: (a, ""))
        assert train_cli._run(cfg) is None
        assert capsys.readouterr().err == (
            f"mptex-train: {word}: precision.mlp_backend=tcnn needs tinycudann\n"
        )


def test_a_finished_run_prints_its_summary_and_where_and_says_a_failed_export(
    hydra_job, monkeypatch, tmp_path, capsys
):
    import mptex.train
    from mptex.cli.train import _run

    metrics = {"status": "completed", "psnr": 30.0, "baseline_psnr": 20.0, "iterations": 4,
               "time_per_iter_s": 0.5, "export": {"error": "xatlas: not installed"}}  # fmt: skip
    monkeypatch.setattr(mptex.train, "train", lambda cfg, run_dir, exporter=None: metrics)
    assert _run(OmegaConf.create({})) is None
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        "mptex-train: completed: PSNR 30.00 dB (constant-colour baseline 20.00 dB), "
        "4 iterations, 0.5000 s/iteration",
        f"mptex-train: results in {tmp_path}",
        f"mptex-train: metrics in {tmp_path / 'metrics.json'}",
    ]
    assert err == "mptex-train: export failed: xatlas: not installed\n"


def test_a_config_with_a_search_block_runs_the_search_instead_of_training(
    hydra_job, monkeypatch, tmp_path
):
    import mptex.cli.search
    import mptex.train
    from mptex.cli.train import _run

    calls = []
    monkeypatch.setattr(mptex.train, "train", lambda *a, **k: calls.append("train"))
    monkeypatch.setattr(mptex.cli.search, "run_search_command",
                        lambda cfg, run_dir, prog: calls.append((run_dir, prog)))  # fmt: skip
    assert _run(OmegaConf.create({"search": {"certify_seeds": 2}})) is None
    assert calls == [(tmp_path, "mptex-train")]


def test_mptex_search_adds_no_experiment_where_one_is_removed_or_named():
    from mptex.cli.search import _with_experiment

    for args in (["~experiment=quick"], ["-m", "+experiment=quick", "scene=a,b"],
                 ["++experiment=precision_search"]):  # fmt: skip
        assert _with_experiment(args) == args
    assert _with_experiment(["--info"]) == ["+experiment=precision_search", "--info"]


def test_mptex_search_adds_its_experiment_after_a_flag_written_with_its_value():
    # "--config-dir=DIR" holds "=" but is no override: the addition goes just before the
    # first override, where Hydra's parser takes it with the others.
    from hydra._internal.utils import get_args_parser

    from mptex.cli.search import _with_experiment

    args = _with_experiment(["--config-dir=/my/configs", "-m", "scene=duck,torus"])
    assert args == ["--config-dir=/my/configs", "-m", "+experiment=precision_search",
                    "scene=duck,torus"]  # fmt: skip
    parsed = get_args_parser().parse_args(args)
    assert parsed.overrides == ["+experiment=precision_search", "scene=duck,torus"]
    assert parsed.config_dir == "/my/configs" and parsed.multirun


def _composed(*overrides: str):
    from hydra import compose, initialize_config_dir

    from mptex._paths import CONFIG_DIR

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_a_sweep_of_a_suite_asset_leaves_its_file_to_the_job(monkeypatch):
    # The real-asset suite's file is looked for in pybullet_data where the job runs: a scene
    # check that fails here (no pybullet_data on the submitting machine) is not the sweep's.
    import mptex.scenes.config
    from mptex.cli.train import _sweep_value_problem

    def not_here(cfg):
        raise ValueError("scene.path: file not found: pybullet_data/duck.obj")

    monkeypatch.setattr(mptex.scenes.config, "check_scene_config", not_here)
    cfg = _composed()
    cfg.scene.name = "duck"
    assert _sweep_value_problem(cfg, True) is None
    cfg.scene.name = "mesh"  # any other scene: the check's line, on one line
    assert _sweep_value_problem(cfg, True) == "scene.path: file not found: pybullet_data/duck.obj"


def test_a_precision_search_config_is_left_to_the_search_s_own_check():
    from mptex.cli.train import _sweep_value_problem

    cfg = _composed("train.iterations=-5")
    assert _sweep_value_problem(cfg) == (
        "train.iterations: expected an integer >= 1 (optimizer steps; 0 would train nothing), "
        "got -5"
    )
    with open_dict(cfg):
        cfg.search = {"certify_seeds": 2}
    assert _sweep_value_problem(cfg) is None


@pytest.mark.parametrize("path", [
    "/runs/plain",
    "/runs/with space",
    "/runs/a,b",  # a comma alone: Hydra's sweep syntax, a list of two paths unquoted
    '/runs/say "hi"=1',  # a double quote inside Hydra's double quotes
    "/runs/0_precision=f32,train.seed=0",
    "/runs/it's",
    "/runs/a,b\\",  # a backslash before the closing quote: Hydra reads it as escaping it
    "/runs/a=b\\\\",  # two: Hydra's quoted string reads them as one
    '/runs/x\\"y=1',  # a backslash before a quote of the path
    "/runs/a\\,b",  # a backslash elsewhere stays as it is
    "/runs/a\\\\b",  # two backslashes without other syntax: unquoted, Hydra reads one
    "/home/josé/runs",  # a non-ASCII letter: refused by Hydra's lexer unquoted
    "~/runs",  # a leading ~: refused unquoted
    "/runs/trailing ",  # a space at the end: stripped unquoted
    "/runs/${x}",  # OmegaConf's interpolation: resolved (here: a missing key) unescaped
    "/runs/a\\${x}",  # a backslash before it: OmegaConf's escape of the "${"
    "/runs/a\\\\${now:%H}",  # two: an escaped backslash, then the interpolation
    "/runs/${",  # an interpolation never closed: a grammar error unescaped
    "/runs/$x{y}",  # no "${": as it is
])  # fmt: skip
def test_a_path_override_reads_back_through_the_shell_and_hydra_as_that_one_path(path):
    words = shlex.split(app.path_override("hydra.sweep.dir", path))
    assert _read_back(words, "hydra.sweep.dir") == path


def _read_back(words: list[str], key: str) -> str:
    """What a command's one override ``words`` sets ``key`` to: the shell's word splitting
    (done by the caller, shlex), Hydra's own override parser, then OmegaConf's resolution of
    the value (Hydra resolves its run and sweep folders)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    (override,) = OverridesParser.create().parse_overrides(words)
    assert override.key_or_group == key
    return OmegaConf.create({"value": override.value()}).value


def test_random_paths_read_back_through_the_shell_and_hydra_as_themselves():
    # Paths drawn from Hydra's syntax, the shell's, backslashes, spaces and non-ASCII letters.
    import random

    rng = random.Random(3)
    alphabet = "ab0_/.-=,()[]{}'\"\\ ~$%@:+*?é\t"
    for _ in range(300):
        path = "/" + "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        # and OmegaConf's interpolation start in some: at a random place
        if rng.random() < 0.3:
            at = rng.randint(0, len(path))
            path = path[:at] + "${" + path[at:]
        assert _read_back(shlex.split(app.path_override("k", path)), "k") == path, path


@pytest.mark.parametrize("mode", ["RUN", "MULTIRUN"])
def test_an_interpolation_that_does_not_resolve_is_one_line_and_a_sweep_goes_on(
    monkeypatch, capsys, mode
):
    # A single run exits 2; a sweep's job returns, so that the sweep's next job runs.
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    monkeypatch.delenv("MPTEX_TEST_UNSET_VARIABLE", raising=False)
    monkeypatch.setattr(HydraConfig, "get", staticmethod(lambda: SimpleNamespace(
        mode=RunMode[mode])))  # fmt: skip
    cfg = OmegaConf.create({"train": {"lr": "${oc.env:MPTEX_TEST_UNSET_VARIABLE}"}})
    task = app._InterpolationErrorsInOneLine(lambda cfg: cfg.train.lr, "mptex-train")
    if mode == "RUN":
        with pytest.raises(SystemExit) as info:
            task(cfg)
        assert info.value.code == 2
    else:
        assert task(cfg) is None
    assert capsys.readouterr().err.splitlines() == [
        "mptex-train: error: train.lr: KeyError raised while resolving interpolation: "
        "\"Environment variable 'MPTEX_TEST_UNSET_VARIABLE' not found\""
    ]
