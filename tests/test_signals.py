"""Cluster faults. A stop signal (Slurm's SIGTERM on preemption or scancel, a
pre-timeout SIGUSR1/SIGUSR2, Ctrl-C) and a full disk lose nothing.

Stop signals go through the real ``mptex-train`` in a subprocess, sent from outside at a random
iteration or while a checkpoint is being written; the requeue path runs under Hydra's
``submitit_local`` launcher, whose job process gets the signal. A full disk is a patched writer
that raises ``OSError(ENOSPC)`` at a chosen write (in-process and through the CLI), and, where
this machine lets the test mount one, a real tmpfs that is full.

The subprocesses are slowed without touching the package: ``faults_site/sitecustomize.py``
(its folder first on ``PYTHONPATH``) sleeps in every iteration, pauses half-way through each
``torch.save`` or fails a chosen atomic write, as ``MPTEX_TEST_*`` environment variables ask.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import mptex.train.checkpoint as checkpoint_module
import mptex.train.validation as validation
from mptex.cli import CONFIG_DIR, EXIT_CODES
from mptex.report import collect_runs
from mptex.train import load_checkpoint, train
from mptex.train.checkpoint import CHECKPOINT_KEYS, DiskFullError

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "train=tiny", "texture=tiny", "scene.resolution=24", "scene.n_train_views=2",
    "scene.n_val_views=1", "scene.tubular_segments=32", "scene.radial_segments=6",
    "train.val_interval=0", "train.stats_interval=0", "train.progress=false",
]  # fmt: skip
ITERATIONS = 60
RUN = [*TINY, f"train.iterations={ITERATIONS}", "train.checkpoint_interval=10"]
# Put first on the subprocesses' PYTHONPATH: its sitecustomize.py holds the test hooks.
SITE = Path(__file__).resolve().parent / "faults_site"


def tiny_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("config", overrides=[*RUN, *overrides])


def read_metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def temporaries(folder: Path) -> list[Path]:
    return [p for p in folder.rglob(".*.tmp")]


def assert_same_weights(a: Path, b: Path) -> None:
    wa = load_checkpoint(a / "checkpoint.pt")["texture"]
    wb = load_checkpoint(b / "checkpoint.pt")["texture"]
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="module")
def site() -> Path:
    return SITE


def cli(site: Path, cwd: Path, *args: str, session: bool = False, **hooks: float
        ) -> subprocess.Popen:  # fmt: skip
    """``mptex-train *args`` in a subprocess, slowed or failed by the ``hooks`` of :data:`SITE`;
    ``session``: in a process group of its own, as a shell's job or a Slurm job step is."""
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1"}
    env = {k: v for k, v in env.items() if not k.startswith(("MPTEX_TEST_", "SLURM_"))}
    env.update({f"MPTEX_TEST_{key.upper()}": str(value) for key, value in hooks.items()})
    return subprocess.Popen(
        [sys.executable, "-m", "mptex.cli", *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=session,
    )  # fmt: skip


def wait_for(proc: subprocess.Popen, marker: str) -> None:
    for line in proc.stdout:
        if line.strip() == marker:
            return
    raise AssertionError(f"mptex-train ended before {marker}: {proc.stderr.read()}")


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    _, err = proc.communicate(timeout=300)
    return proc.returncode, err


@pytest.fixture(scope="module")
def reference(site, tmp_path_factory) -> Path:
    """The uninterrupted run every resumed run must equal, bit for bit (CPU)."""
    run_dir = tmp_path_factory.mktemp("reference")
    code, err = finish(cli(site, run_dir, f"hydra.run.dir={run_dir}", *RUN))
    assert code == 0, err
    return run_dir


def assert_interrupted(run_dir: Path, code: int, err: str, name: str) -> int:
    """Exit 3, one stderr line, checkpoint and metrics of the same iteration; returns it."""
    assert code == EXIT_CODES["interrupted"] == 3, err
    assert len(err.splitlines()) == 1, err
    metrics = read_metrics(run_dir)
    at = metrics["interrupted_at"]
    assert err.startswith(f"mptex-train: interrupted by {name} after iteration {at} of ")
    assert metrics["status"] == "interrupted" and metrics["signal"] == name
    assert metrics["iterations"] == at and 0 < at < ITERATIONS
    assert metrics["psnr"] is None and not (run_dir / "images").exists()
    ckpt = load_checkpoint(run_dir / "checkpoint.pt", required=CHECKPOINT_KEYS)
    assert ckpt["iteration"] == at
    assert not temporaries(run_dir)
    return at


def assert_resumes_to_reference(site, run_dir: Path, reference: Path, stops: list) -> None:
    """The same command again continues (train.resume=auto) to the reference's weights."""
    code, err = finish(cli(site, run_dir, f"hydra.run.dir={run_dir}", *RUN))
    assert code == 0, err
    metrics = read_metrics(run_dir)
    assert metrics["status"] == "completed" and metrics["iterations"] == ITERATIONS
    assert metrics["resume_count"] == len(stops)
    assert metrics["interruptions"] == [{"iteration": i, "signal": s} for i, s in stops]
    assert metrics["resumed_from"] == stops[-1][0]
    assert metrics["psnr"] == read_metrics(reference)["psnr"]
    assert_same_weights(run_dir, reference)


# ----------------------------------------------------------------------------- stop signals
@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT", "SIGUSR1"])
def test_a_stop_signal_at_a_random_iteration_checkpoints_exits_3_and_resumes_bit_exactly(
    site, reference, tmp_path, name
):
    rng = random.Random(f"21-{name}")
    proc = cli(site, tmp_path, f"hydra.run.dir={tmp_path}", *RUN, iter_sleep_s=0.05)
    wait_for(proc, "ITERATING")
    time.sleep(rng.uniform(0.1, 1.5))  # somewhere in the 60 iterations of >= 0.05 s
    proc.send_signal(signal.Signals[name])
    code, err = finish(proc)
    at = assert_interrupted(tmp_path, code, err, name)
    assert_resumes_to_reference(site, tmp_path, reference, [(at, name)])


@pytest.mark.parametrize("name, second", [("SIGTERM", "SIGTERM"), ("SIGINT", "SIGINT"),
                                          ("SIGUSR1", "SIGTERM")])  # fmt: skip
def test_signals_during_checkpoint_writes_keep_the_writes_atomic(
    site, reference, tmp_path, name, second
):
    # The first signal lands in the middle of the interval checkpoint after iteration 10, the
    # second in the middle of the checkpoint the stop writes: neither write is cut short.
    proc = cli(site, tmp_path, f"hydra.run.dir={tmp_path}", *RUN, slow_save_s=0.5)
    wait_for(proc, "WRITING")
    proc.send_signal(signal.Signals[name])
    wait_for(proc, "WRITING")
    proc.send_signal(signal.Signals[second])
    code, err = finish(proc)
    assert assert_interrupted(tmp_path, code, err, name) == 10
    assert_resumes_to_reference(site, tmp_path, reference, [(10, name)])


def test_two_interruptions_are_both_counted(site, reference, tmp_path):
    stops, walls = [], []
    for name in ("SIGUSR1", "SIGTERM"):
        proc = cli(site, tmp_path, f"hydra.run.dir={tmp_path}", *RUN, slow_save_s=0.2)
        wait_for(proc, "WRITING")  # the first interval checkpoint after this start
        proc.send_signal(signal.Signals[name])
        stops.append((assert_interrupted(tmp_path, *finish(proc), name), name))
        walls.append(read_metrics(tmp_path)["wall_time_s"])
    assert [at for at, _ in stops] == [10, 20]
    assert_resumes_to_reference(site, tmp_path, reference, stops)
    # the three processes' times, each whole (their records say it), added in their order
    metrics = read_metrics(tmp_path)
    assert metrics["wall_time_total_s"] == sum(walls) + metrics["wall_time_s"]
    assert metrics["time_total_complete"] is True


_TIME_TOTALS = ("wall_time_total_s", "train_time_total_s", "time_total_complete")


def _own_time(metrics: dict) -> tuple:
    return metrics["wall_time_s"], metrics["train_time_s"], True


def test_a_stopped_and_resumed_run_adds_up_both_processes_time(tmp_path):
    # metrics.json's wall_time_s and train_time_s are the last process's; the totals are the
    # run's: what it cost, however often it stopped.
    alone = train(tiny_cfg(), tmp_path / "alone")
    assert alone["resume_count"] == 0
    assert tuple(alone[k] for k in _TIME_TOTALS) == _own_time(alone)
    first = train(tiny_cfg("train.inject_signal_at=4"), tmp_path / "run")
    assert first["status"] == "interrupted" and first["interrupted_at"] == 5
    assert tuple(first[k] for k in _TIME_TOTALS) == _own_time(first)
    ckpt = load_checkpoint(tmp_path / "run" / "checkpoint.pt")
    # the checkpoint holds the time up to its write; the record all of the stopped process's
    assert 0 < ckpt["wall_time_total_s"] < first["wall_time_s"]
    assert ckpt["train_time_total_s"] == first["train_time_s"]
    second = train(tiny_cfg(), tmp_path / "run")
    assert (second["status"], second["resume_count"]) == ("completed", 1)
    assert second["wall_time_total_s"] == first["wall_time_s"] + second["wall_time_s"]
    assert second["train_time_total_s"] == first["train_time_s"] + second["train_time_s"]
    assert second["time_total_complete"] is True


def test_a_checkpoint_without_time_totals_resumes_and_says_its_total_is_partial(tmp_path):
    # A run stopped before checkpoints carried the totals: neither its checkpoint nor its
    # record holds them, so what it trained before is not known and is not made up.
    train(tiny_cfg("train.inject_signal_at=4"), tmp_path)
    ckpt = load_checkpoint(tmp_path / "checkpoint.pt")
    record = read_metrics(tmp_path)
    for key in _TIME_TOTALS:
        del ckpt[key], record[key]
    torch.save(ckpt, tmp_path / "checkpoint.pt")
    (tmp_path / "metrics.json").write_text(json.dumps(record))
    resumed = train(tiny_cfg(), tmp_path)
    assert (resumed["status"], resumed["resume_count"]) == ("completed", 1)
    assert resumed["wall_time_total_s"] == resumed["wall_time_s"]
    assert resumed["train_time_total_s"] == resumed["train_time_s"]
    assert resumed["time_total_complete"] is False


def test_an_interrupted_run_is_failed_in_the_report_with_its_reason(tmp_path):
    train(tiny_cfg("train.inject_signal_at=4", "train.inject_signal=SIGUSR1"), tmp_path / "0")
    [run] = collect_runs(tmp_path)
    assert run["status"] == "failed"
    assert run["error"] == "interrupted by SIGUSR1 after iteration 5 and not resumed"


def test_stop_signals_are_checked_at_start(tmp_path):
    with pytest.raises(ValueError, match=r"^train\.stop_signals: expected a list of signal"):
        train(tiny_cfg("train.stop_signals=[SIGKILL]"), tmp_path)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # nothing left installed


def test_without_stop_signals_the_default_action_stays(site, tmp_path):
    proc = cli(site, tmp_path, f"hydra.run.dir={tmp_path}", *RUN, "train.stop_signals=[]",
               iter_sleep_s=0.05)  # fmt: skip
    wait_for(proc, "ITERATING")
    proc.send_signal(signal.SIGTERM)
    code, _ = finish(proc)
    assert code == -signal.SIGTERM and not (tmp_path / "metrics.json").exists()


# ----------------------------------------------------------------------------- parallel sweeps
@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM"])
def test_a_stop_signal_to_a_parallel_sweep_stops_its_jobs_cleanly_and_the_sweep_continues(
    site, reference, tmp_path, name
):
    # hydra/launcher=local_parallel runs 2 jobs at a time in joblib's worker processes; Ctrl-C
    # (SIGINT) or Slurm's SIGTERM reaches the whole process group while both jobs train and the
    # third waits. Each job under way checkpoints, the third never starts, the sweep's process
    # writes the report and exits 3; the same command into the same folder then continues.
    sweep = tmp_path / "sweep"
    command = ["-m", "hydra/launcher=local_parallel", f"hydra.sweep.dir={sweep}", *RUN,
               "train.seed=0,1,2"]  # fmt: skip
    proc = cli(site, tmp_path, *command, session=True, iter_sleep_s=0.1)
    deadline = time.monotonic() + 120
    while len(list(sweep.glob("*/checkpoint.pt"))) < 2:  # both jobs are past iteration 10
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.05)
    os.killpg(proc.pid, signal.Signals[name])
    try:
        code = proc.wait(timeout=120)
    finally:  # nothing of the sweep outlives its process (a worker would hold the pipes open)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    err = proc.stderr.read()
    assert code == EXIT_CODES["interrupted"], err
    started = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert [p.name[:2] for p in started] == ["0_", "1_"], err  # job 2 has no directory
    stops = {}
    for run_dir in started:
        metrics = read_metrics(run_dir)
        assert metrics["status"] == "interrupted" and metrics["signal"] == name
        at = metrics["interrupted_at"]
        assert 10 <= at < ITERATIONS
        assert load_checkpoint(run_dir / "checkpoint.pt")["iteration"] == at
        assert not temporaries(run_dir)
        stops[run_dir.name[0]] = at
    assert f"mptex-train: sweep stopped by {name}" in err
    report = (sweep / "report.md").read_text()
    assert "**Incomplete sweep**: 1 of the 3 jobs" in report

    again = cli(site, tmp_path, *command, "hydra.callbacks.fresh_sweep_dir.enabled=false")
    code, err = finish(again)
    assert code == 0, err
    runs = {p.name[0]: read_metrics(p) for p in sorted(sweep.glob("*_*")) if p.is_dir()}
    assert sorted(runs) == ["0", "1", "2"]
    for num, metrics in runs.items():
        assert metrics["status"] == "completed" and metrics["iterations"] == ITERATIONS
        resumed = [{"iteration": stops[num], "signal": name}] if num in stops else []
        assert metrics["interruptions"] == resumed and metrics["resume_count"] == len(resumed)
    [seed0] = sweep.glob("0_*")  # train.seed=0: the reference run's config
    assert runs["0"]["psnr"] == read_metrics(reference)["psnr"]
    assert_same_weights(seed0, reference)
    assert [r["status"] for r in collect_runs(sweep)] == ["completed"] * 3


def test_a_stop_signal_to_one_worker_alone_stops_its_jobs_and_the_sweep_exits_3(
    site, reference, tmp_path
):
    # A SIGTERM to one of joblib's worker processes (an OOM killer's, an operator's kill of the
    # pid), not to the sweep's process: that worker's job under way checkpoints and returns,
    # the worker starts no other job, the other worker goes on. The sweep's process saw no
    # signal, and exited 0 as if every job had run; it exits 3, naming the stopped jobs.
    sweep = tmp_path / "sweep"
    command = ["-m", "hydra/launcher=local_parallel", f"hydra.sweep.dir={sweep}", *RUN,
               "train.seed=0,1,2"]  # fmt: skip
    proc = cli(site, tmp_path, *command, session=True, iter_sleep_s=0.1)
    try:
        deadline = time.monotonic() + 120
        while len(list(sweep.glob("*/checkpoint.pt"))) < 2:  # both jobs are past iteration 10
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        workers = [pid for pid in _descendants(proc.pid)
                   if b"popen_loky_posix" in Path(f"/proc/{pid}/cmdline").read_bytes()]  # fmt: skip
        assert len(workers) == 2, workers
        os.kill(workers[0], signal.SIGTERM)
        code = proc.wait(timeout=180)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    err = proc.stderr.read()
    assert code == EXIT_CODES["interrupted"], err
    runs = {
        p.name: read_metrics(p) for p in sorted(sweep.iterdir()) if (p / "metrics.json").is_file()
    }
    interrupted = [name for name, m in runs.items() if m["status"] == "interrupted"]
    assert len(interrupted) == 1 and runs[interrupted[0]]["signal"] == "SIGTERM", err
    # the third job ran on the other worker (completed) or was refused by the stopped one
    completed = [name for name, m in runs.items() if m["status"] == "completed"]
    stopped = 3 - len(completed)
    assert stopped in (1, 2) and len(runs) == 3 - (stopped - 1), err
    last = err.splitlines()[-1]
    assert last.startswith(
        f"mptex-train: sweep ended with {stopped} of its jobs stopped by a signal to their "
        f"worker process ({interrupted[0]}: interrupted"
    ), err
    assert f"hydra.sweep.dir={sweep} hydra.callbacks.fresh_sweep_dir.enabled=false" in last
    again = cli(site, tmp_path, *command, "hydra.callbacks.fresh_sweep_dir.enabled=false")
    code, err = finish(again)
    assert code == 0, err
    assert [r["status"] for r in collect_runs(sweep)] == ["completed"] * 3


def signal_while_workers_start(proc: subprocess.Popen, marks: Path, name: str
                               ) -> tuple[int, str]:  # fmt: skip
    """Send ``name`` to the process group of ``proc`` (a parallel sweep in a session of its
    own) once both of its worker processes are starting (their marks in ``marks``, made by
    :data:`SITE`'s hook); its exit status and stderr. Nothing of the sweep outlives it."""
    deadline = time.monotonic() + 120
    while len(list(marks.iterdir())) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.02)
    os.killpg(proc.pid, signal.Signals[name])
    try:
        code = proc.wait(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return code, proc.stderr.read()


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="holds signals by mask")
@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM"])
def test_a_stop_signal_while_a_parallel_sweeps_workers_start_starts_no_job(
    site, reference, tmp_path, name
):
    # The signal reaches the process group while joblib's worker processes are still starting
    # (an interpreter and torch's import: seconds, here held at their start by the test hook):
    # it killed them, and joblib ended the sweep with its error (exit 1). Now it waits in each
    # worker until the worker's handler is in place: no job starts, the sweep's process writes
    # the report and exits 3, and the command it names runs the sweep.
    sweep, marks = tmp_path / "sweep", tmp_path / "marks"
    marks.mkdir()
    command = ["-m", "hydra/launcher=local_parallel", f"hydra.sweep.dir={sweep}", *RUN,
               "train.seed=0,1,2"]  # fmt: skip
    proc = cli(site, tmp_path, *command, session=True, worker_start_s=3, mark_dir=str(marks))
    code, err = signal_while_workers_start(proc, marks, name)
    assert code == EXIT_CODES["interrupted"], err
    assert "Traceback" not in err and "TerminatedWorkerError" not in err, err
    assert err.count("mptex-train: not started: the sweep was stopped by " + name) == 3, err
    assert err.splitlines()[-1].startswith(f"mptex-train: sweep stopped by {name}: "), err
    assert not [p for p in sweep.iterdir() if p.is_dir() and p.name[0].isdigit()], err
    assert "**Incomplete sweep**: 3 of the 3 jobs" in (sweep / "report.md").read_text()
    if name != "SIGINT":
        return
    again = cli(site, tmp_path, *command, "hydra.callbacks.fresh_sweep_dir.enabled=false")
    code, err = finish(again)
    assert code == 0, err
    runs = [read_metrics(p) for p in sorted(sweep.glob("*_*")) if p.is_dir()]
    assert [(r["status"], r["resume_count"]) for r in runs] == [("completed", 0)] * 3
    assert runs[0]["psnr"] == read_metrics(reference)["psnr"]


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="holds signals by mask")
def test_mptex_search_under_the_parallel_launcher_stops_as_mptex_train_does(site, tmp_path):
    # The same hold and the same check at a job's start: a signal while the workers start
    # starts no search, and the sweep's process exits 3 with the command that continues it.
    sweep, marks = tmp_path / "sweep", tmp_path / "marks"
    marks.mkdir()
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1",
           "MPTEX_TEST_WORKER_START_S": "3", "MPTEX_TEST_MARK_DIR": str(marks)}  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "mptex.cli.search", "-m", "hydra/launcher=local_parallel",
         f"hydra.sweep.dir={sweep}", *TINY, "train.iterations=6,7,8"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    code, err = signal_while_workers_start(proc, marks, "SIGINT")
    assert code == EXIT_CODES["interrupted"] and "Traceback" not in err, err
    assert err.count("mptex-search: not started: the sweep was stopped by SIGINT") == 3, err
    assert err.splitlines()[-1].startswith("mptex-search: sweep stopped by SIGINT: "), err


def test_a_search_stopped_in_a_parallel_sweeps_job_returns_to_the_sweep(monkeypatch, capsys):
    # In a worker process the job returns (the sweep's process exits 3 once its jobs under way
    # are done); a SystemExit there made joblib end the sweep and kill the other workers.
    import mptex.search
    from mptex.cli.app import SWEEP_PARENT_ENV
    from mptex.cli.search import run_search_command

    def stopped(cfg, run_dir):
        raise mptex.search.SearchInterrupted("stopped by SIGTERM")

    monkeypatch.setattr(mptex.search, "run_search", stopped)
    monkeypatch.setenv(SWEEP_PARENT_ENV, str(os.getpid() + 1))
    assert run_search_command({}, "unused") is None
    assert capsys.readouterr().err == "mptex-search: interrupted: stopped by SIGTERM\n"
    monkeypatch.delenv(SWEEP_PARENT_ENV)  # a run of its own: exit 3
    with pytest.raises(SystemExit) as info:
        run_search_command({}, "unused")
    assert info.value.code == EXIT_CODES["interrupted"]


# ----------------------------------------------------------------------------- submitit requeue
def _descendants(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children")
    kids = [int(c) for c in children.read_text().split()] if children.exists() else []
    return kids + [d for kid in kids for d in _descendants(kid)]


def _submitit_job(pid: int) -> int:
    """The submitit_local job process under ``mptex-train -m`` (pid), as Slurm's would be."""
    for child in _descendants(pid):
        try:
            if b"submitit.core._submit" in Path(f"/proc/{child}/cmdline").read_bytes():
                return child
        except OSError:
            continue
    raise AssertionError("no submitit job process")


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the job through /proc")
def test_submitit_local_requeues_a_signalled_job_which_resumes_in_its_run_dir(
    site, reference, tmp_path
):
    # submitit's pre-timeout / preemption signal (SUBMITIT_PREEMPT_SIGNAL, USR2 by default)
    # sent to the running job: mptex-train checkpoints, submitit requeues the job (exit 144
    # under submitit_local, scontrol requeue on Slurm) and the requeued job resumes.
    sweep = tmp_path / "sweep"
    proc = cli(site, tmp_path, "-m", "hydra/launcher=submitit_local", f"hydra.sweep.dir={sweep}",
               *RUN, iter_sleep_s=0.05)  # fmt: skip
    deadline = time.monotonic() + 120
    while not list(sweep.glob("*/checkpoint.pt")):  # the job is past iteration 10
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.05)
    time.sleep(random.Random(21).uniform(0.0, 1.0))
    job = _submitit_job(proc.pid)
    os.kill(job, signal.SIGUSR2)
    code, err = finish(proc)
    assert code == 0, err
    [run_dir] = [p.parent for p in sweep.glob("*/metrics.json")]  # one run dir, reused
    metrics = read_metrics(run_dir)
    [stop] = metrics["interruptions"]
    assert stop["signal"] == "SIGUSR2" and 10 <= stop["iteration"] < ITERATIONS
    assert metrics["status"] == "completed" and metrics["resume_count"] == 1
    assert metrics["resumed_from"] == stop["iteration"]
    assert metrics["psnr"] == read_metrics(reference)["psnr"]
    assert_same_weights(run_dir, reference)
    logs = "".join(p.read_text() for p in sweep.glob(".submitit/*/*_log.*"))
    assert "Requeued job" in logs
    assert [r["status"] for r in collect_runs(sweep)] == ["completed"]


@pytest.mark.parametrize("overrides, delay_s, timeouts", [
    ([], 120, 5),  # configs/hydra/launcher/slurm_gpu.yaml
    (["hydra.launcher.signal_delay_s=180", "hydra.launcher.max_num_timeout=10"], 180, 10),
])  # fmt: skip
def test_slurm_gpu_asks_slurm_for_the_pre_timeout_signal_and_requeues_time_limits(
    site, tmp_path, monkeypatch, overrides, delay_s, timeouts
):
    # What `mptex-train -m hydra/launcher=slurm_gpu` submits (docs/cluster.md), through the real
    # launcher up to sbatch: a stand-in sbatch keeps the batch script and refuses the job.
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text("#!/bin/sh\nexit 1\n")  # submitit looks for srun on PATH
    (fake / "sbatch").write_text('#!/bin/sh\ncp "$1" "$SBATCH_COPY"\nexit 1\n')
    for tool in fake.iterdir():
        tool.chmod(0o755)
    script = tmp_path / "job.sh"
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SBATCH_COPY", str(script))
    sweep = tmp_path / "sweep"
    proc = cli(site, tmp_path, "-m", "hydra/launcher=slurm_gpu", f"hydra.sweep.dir={sweep}",
               "hydra.launcher.timeout_min=90", *overrides, *RUN)  # fmt: skip
    code, err = finish(proc)
    assert code != 0 and "FailedJobError" in err  # the stand-in refused it
    lines = script.read_text().splitlines()
    assert f"#SBATCH --signal=USR2@{delay_s}" in lines and "#SBATCH --time=90" in lines
    assert "#SBATCH --gpus-per-node=1" in lines
    assert any(line.startswith("srun ") and "submitit.core._submit" in line for line in lines)
    # The job submitit would have run: the launcher (whose checkpoint() resubmits the same
    # overrides) with max_num_timeout requeues after a time limit left.
    from submitit.helpers import DelayedSubmission

    [pickled] = sweep.glob(".submitit/*.pkl")
    job = DelayedSubmission.load(pickled)
    assert job._timeout_countdown == timeouts and job._timeout_min == 90
    assert callable(job.function.checkpoint)


# ----------------------------------------------------------------------------- a full disk
def _failing_writes(monkeypatch, at: int, sticky: bool) -> None:
    spec = importlib.util.spec_from_file_location("faults_site", SITE / "sitecustomize.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)  # without MPTEX_TEST_* variables it only defines
    writer = hooks.failing_writer(checkpoint_module.atomic_write_bytes, at, sticky)
    monkeypatch.setattr(checkpoint_module, "atomic_write_bytes", writer)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    assert train(tiny_cfg("train.iterations=6", "train.checkpoint_interval=2"), run_dir)
    return run_dir


# The resumed run (iterations 3..5) writes: 1 metrics.json, the interrupted run's record
# marked as counted (time_total_taken), 2 the checkpoint after iteration 4, 3 the final
# checkpoint, 4 metrics.json.
@pytest.mark.parametrize("at, name", [(2, "checkpoint.pt"), (3, "checkpoint.pt"),
                                      (4, "metrics.json")])  # fmt: skip
@pytest.mark.parametrize("sticky", [True, False], ids=["stays-full", "room-for-metrics"])
def test_a_full_disk_keeps_the_last_good_files_and_resumes(
    monkeypatch, tmp_path, uninterrupted, at, name, sticky
):
    run_dir = tmp_path / "0"
    cfg = ("train.iterations=6", "train.checkpoint_interval=2")
    first = train(tiny_cfg(*cfg, "train.inject_signal_at=2"), run_dir)
    assert first["status"] == "interrupted" and first["interrupted_at"] == 3
    good = {f: (run_dir / f).read_bytes() for f in ("checkpoint.pt", "metrics.json")}

    _failing_writes(monkeypatch, at, sticky)
    with pytest.raises(DiskFullError) as info:
        train(tiny_cfg(*cfg), run_dir)
    path = run_dir / name
    assert str(info.value) == f"{path}: no space left on device (ENOSPC); {path} is unchanged"
    assert not temporaries(tmp_path)
    # The last good checkpoint: the interrupted run's, or the last one written before.
    if at == 2:
        assert (run_dir / "checkpoint.pt").read_bytes() == good["checkpoint.pt"]
    else:
        assert load_checkpoint(run_dir / "checkpoint.pt")["iteration"] == {3: 4, 4: 6}[at]
    if sticky:  # nothing more could be written: metrics.json is the interrupted run's
        kept = {**json.loads(good["metrics.json"]), "time_total_taken": True}
        assert read_metrics(run_dir) == kept
    else:  # a small file still fits: the failure is recorded for the report
        metrics = read_metrics(run_dir)
        assert metrics["status"] == "failed" and metrics["failed_writing"] == str(path)
        [run] = collect_runs(tmp_path)
        assert run["status"] == "failed" and run["error"] == str(info.value)

    monkeypatch.undo()  # space freed: the same command continues from the last good checkpoint
    again = train(tiny_cfg(*cfg), run_dir)
    assert again["status"] == "completed" and again["resume_count"] >= 1
    assert again["psnr"] == read_metrics(uninterrupted)["psnr"]
    assert_same_weights(run_dir, uninterrupted)


def test_a_full_disk_that_keeps_the_record_unmarked_leaves_the_total_partial(monkeypatch, tmp_path):
    # The interrupted run's record, not marked as counted, would be counted again by a resume
    # after this process were killed: its total is not known whole, and says so.
    cfg = ("train.iterations=6", "train.checkpoint_interval=2")
    assert train(tiny_cfg(*cfg, "train.inject_signal_at=2"), tmp_path)["status"] == "interrupted"
    carried = load_checkpoint(tmp_path / "checkpoint.pt")["wall_time_total_s"]
    _failing_writes(monkeypatch, 1, sticky=False)
    again = train(tiny_cfg(*cfg), tmp_path)
    assert (again["status"], again["resume_count"]) == ("completed", 1)
    assert again["wall_time_total_s"] == carried + again["wall_time_s"]
    assert again["time_total_complete"] is False


def test_a_run_continued_after_a_full_disk_counts_the_failed_process_whole(monkeypatch, tmp_path):
    # Stopped after iteration 3; continued, it checkpoints iteration 4 and fails writing the
    # final checkpoint (the disk full, a small file still fits): its record holds its time, so
    # that the run continued once space is freed counts all three processes.
    cfg = ("train.iterations=6", "train.checkpoint_interval=2")
    assert train(tiny_cfg(*cfg, "train.inject_signal_at=2"), tmp_path)["status"] == "interrupted"
    _failing_writes(monkeypatch, 3, sticky=False)
    with pytest.raises(DiskFullError):
        train(tiny_cfg(*cfg), tmp_path)
    failed = read_metrics(tmp_path)
    checkpoint = str(tmp_path / "checkpoint.pt")
    assert (failed["status"], failed["failed_writing"]) == ("failed", checkpoint)
    assert failed["resume_count"] == 1 and failed["time_total_complete"] is True
    assert failed["wall_time_total_s"] > failed["wall_time_s"] >= failed["train_time_s"] > 0
    monkeypatch.undo()
    again = train(tiny_cfg(*cfg), tmp_path)
    assert (again["status"], again["resumed_from"], again["resume_count"]) == ("completed", 4, 2)
    assert again["wall_time_total_s"] == failed["wall_time_total_s"] + again["wall_time_s"]
    assert again["train_time_total_s"] == failed["train_time_total_s"] + again["train_time_s"]
    assert again["time_total_complete"] is True


def test_a_full_disk_while_saving_a_val_image_names_it_and_leaves_no_half_png(
    monkeypatch, tmp_path
):
    def full(path, *args, **kwargs):
        Path(path).write_bytes(b"\x89PNG half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(validation, "save_image", full)
    with pytest.raises(DiskFullError) as info:
        train(tiny_cfg("train.iterations=2"), tmp_path)
    png = tmp_path / "images" / "val_000.png"
    assert str(info.value) == (
        f"{png}: no space left on device (ENOSPC); the partial image was removed"
    )
    assert not png.exists() and read_metrics(tmp_path)["failed_writing"] == str(png)


def test_cli_full_disk_is_one_line_naming_the_file_with_exit_2(site, tmp_path):
    # Write 2 of the run: the first interval checkpoint is write 1, the second write 2.
    proc = cli(site, tmp_path, f"hydra.run.dir={tmp_path}", *RUN, enospc_at=2)
    code, err = finish(proc)
    path = tmp_path / "checkpoint.pt"
    assert code == EXIT_CODES["error"] == 2
    assert err == (
        f"mptex-train: error: {path}: no space left on device (ENOSPC); {path} is unchanged\n"
    )
    assert load_checkpoint(path)["iteration"] == 10 and not temporaries(tmp_path)
    assert (tmp_path / "metrics.json").exists() is False  # the disk stayed full


def _mount_tmpfs(where: Path, size_kib: int) -> bool:
    where.mkdir()
    cmd = ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(where)]
    try:
        return subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0
    except OSError:
        return False


def test_a_real_full_tmpfs(site, tmp_path):
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, 4096):
        pytest.skip("cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN)")
    try:
        run_dir = disk / "run"
        args = (f"hydra.run.dir={run_dir}", *RUN)
        code, err = finish(cli(site, tmp_path, *args, "train.inject_signal_at=12"))
        assert code == 3, err
        good = {f: (run_dir / f).read_bytes() for f in ("checkpoint.pt", "metrics.json")}
        # Leave less room than a checkpoint needs and more than metrics.json does.
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        filler = disk / f"filler-{uuid.uuid4().hex}"
        filler.write_bytes(b"\0" * (free - len(good["checkpoint.pt"]) // 2))
        code, err = finish(cli(site, tmp_path, *args))
        path = run_dir / "checkpoint.pt"
        assert code == 2 and err.splitlines() == [
            f"mptex-train: error: {path}: no space left on device (ENOSPC); {path} is unchanged"
        ]
        assert path.read_bytes() == good["checkpoint.pt"] and not temporaries(disk)
        assert read_metrics(run_dir)["failed_writing"] == str(path)
        filler.unlink()
        code, err = finish(cli(site, tmp_path, *args))
        assert code == 0, err
        assert read_metrics(run_dir)["status"] == "completed"
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True, timeout=30)


# ----------------------------------------------------------------------------- Adam on resume
# Adam has two parameter groups, the grid's and the MLP's (train.mlp_lr_scale), each with an
# lr_scale applied on top of the schedule: a resume restores both, at this run's rates.
ADAM_RUN = ("train.iterations=6", "train.checkpoint_interval=2")


def _adam_groups(run_dir: Path) -> list[dict]:
    return load_checkpoint(run_dir / "checkpoint.pt")["optimizer"]["param_groups"]


def _assert_same_adam_state(a: Path, b: Path) -> None:
    sa, sb = (load_checkpoint(d / "checkpoint.pt")["optimizer"]["state"] for d in (a, b))
    assert sa.keys() == sb.keys() and all(
        sa[i].keys() == sb[i].keys() and all(torch.equal(sa[i][k], sb[i][k]) for k in sa[i])
        for i in sa
    )


def test_a_resume_restores_both_adam_groups_bit_exactly(tmp_path):
    cfg = (*ADAM_RUN, "train.mlp_lr_scale=0.25")
    whole = train(tiny_cfg(*cfg), tmp_path / "whole")
    first = train(tiny_cfg(*cfg, "train.inject_signal_at=2"), tmp_path / "resumed")
    assert first["status"] == "interrupted"
    grid, mlp = _adam_groups(tmp_path / "resumed")
    assert (grid["lr_scale"], mlp["lr_scale"]) == (1.0, 0.25) and mlp["lr"] == grid["lr"] * 0.25
    again = train(tiny_cfg(*cfg), tmp_path / "resumed")
    assert again["status"] == "completed" and again["resume_count"] == 1
    assert again["psnr"] == whole["psnr"] and again["history"] == whole["history"]
    assert_same_weights(tmp_path / "resumed", tmp_path / "whole")
    _assert_same_adam_state(tmp_path / "resumed", tmp_path / "whole")
    assert _adam_groups(tmp_path / "resumed") == _adam_groups(tmp_path / "whole")


def test_a_resume_runs_the_mlp_at_its_own_configs_rate(tmp_path):
    # As train.lr, train.mlp_lr_scale is this run's: the checkpoint's lr_scale does not win.
    train(tiny_cfg(*ADAM_RUN, "train.inject_signal_at=2"), tmp_path)
    assert [g["lr_scale"] for g in _adam_groups(tmp_path)] == [1.0, 1.0]
    again = train(tiny_cfg(*ADAM_RUN, "train.mlp_lr_scale=0.5"), tmp_path)
    assert again["status"] == "completed" and again["config"]["train"]["mlp_lr_scale"] == 0.5
    grid, mlp = _adam_groups(tmp_path)
    assert mlp["lr_scale"] == 0.5 and mlp["lr"] == grid["lr"] * 0.5


def test_a_resume_runs_adam_with_its_own_configs_epsilon_and_betas(tmp_path):
    train(tiny_cfg(*ADAM_RUN, "train.inject_signal_at=2"), tmp_path / "resumed")
    assert [g["eps"] for g in _adam_groups(tmp_path / "resumed")] == [1e-8, 1e-8]
    changed = ("train.adam_eps=1e-15", "train.betas=[0.8,0.99]")
    again = train(tiny_cfg(*ADAM_RUN, *changed), tmp_path / "resumed")
    assert again["status"] == "completed" and again["resume_count"] == 1
    for group in _adam_groups(tmp_path / "resumed"):
        assert group["eps"] == 1e-15 and tuple(group["betas"]) == (0.8, 0.99)
    # and the epsilon is used: the same 6 iterations at 1e-8 throughout end elsewhere
    whole = train(tiny_cfg(*ADAM_RUN), tmp_path / "whole")
    assert again["psnr"] != whole["psnr"]


def test_a_checkpoint_with_one_adam_group_resumes_bit_exactly(tmp_path, uninterrupted):
    # Checkpoints written before train.mlp_lr_scale hold one group of all the texture's
    # parameters in texture.parameters() order; at mlp_lr_scale 1 they continue as before.
    from mptex.train import load_texture
    from mptex.train.checkpoint import save_checkpoint
    from mptex.train.loop import _param_groups

    train(tiny_cfg(*ADAM_RUN, "train.inject_signal_at=2"), tmp_path)
    path = tmp_path / "checkpoint.pt"
    ckpt = load_checkpoint(path)
    texture = load_texture(path)
    position = {id(p): i for i, p in enumerate(texture.parameters())}
    grouped = [p for group in _param_groups(texture, 1.0) for p in group["params"]]
    assert sorted(position[id(p)] for p in grouped) == list(range(len(grouped)))
    adam = ckpt["optimizer"]
    old_group = {k: v for k, v in adam["param_groups"][0].items() if k != "lr_scale"}
    ckpt["optimizer"] = {
        "state": {position[id(p)]: adam["state"][i] for i, p in enumerate(grouped)},
        "param_groups": [{**old_group, "params": list(range(len(grouped)))}],
    }
    save_checkpoint(path, ckpt)

    again = train(tiny_cfg(*ADAM_RUN), tmp_path)
    assert again["status"] == "completed" and again["resume_count"] == 1
    assert again["psnr"] == read_metrics(uninterrupted)["psnr"]
    assert_same_weights(tmp_path, uninterrupted)
    _assert_same_adam_state(tmp_path, uninterrupted)


def test_an_adam_state_that_fits_no_texture_is_one_line_naming_the_checkpoint(tmp_path):
    from mptex.train import ConfigError
    from mptex.train.checkpoint import save_checkpoint

    train(tiny_cfg(*ADAM_RUN, "train.inject_signal_at=2"), tmp_path)
    path = tmp_path / "checkpoint.pt"
    ckpt = load_checkpoint(path)
    ckpt["optimizer"]["param_groups"].append(dict(ckpt["optimizer"]["param_groups"][1]))
    save_checkpoint(path, ckpt)
    with pytest.raises(ConfigError) as info:
        train(tiny_cfg(*ADAM_RUN), tmp_path)
    message = str(info.value)
    assert message.startswith(f"train.resume: checkpoint {path}: its optimizer state does not ")
    assert "\n" not in message
    # left as they were: the run is still the interrupted one
    assert load_checkpoint(path)["iteration"] == 3
    assert read_metrics(tmp_path)["status"] == "interrupted"


@pytest.mark.parametrize("outcome", ["completed", "diverged"])
def test_a_refused_command_keeps_a_finished_runs_record(tmp_path, outcome):
    # A mistyped resume in a finished run's directory (another seed under train.resume=true) is
    # refused before any work; the run's record (its PSNR, history, status) stays, with the
    # attempt added, beside the checkpoint it describes. A later start failure is added too.
    from mptex.train import ConfigError

    extra = ("precision=f16_naive", "train.lr=1e30") if outcome == "diverged" else ()
    first = train(tiny_cfg(*ADAM_RUN, *extra), tmp_path)
    assert first["status"] == outcome
    record = read_metrics(tmp_path)
    checkpoint = tmp_path / "checkpoint.pt"
    weights = checkpoint.read_bytes() if checkpoint.exists() else None
    errors = []
    for mistake in (("train.resume=true", "train.seed=7"), ("train.lr=-1",)):
        with pytest.raises(ConfigError) as info:
            train(tiny_cfg(*ADAM_RUN, *extra, *mistake), tmp_path)
        errors.append(str(info.value))
        after = read_metrics(tmp_path)
        tries = after.pop("start_failures")
        assert tries == [{"error": e, "failed_at": "start"} for e in errors]
        assert after == record
        assert (checkpoint.read_bytes() if checkpoint.exists() else None) == weights
    (run,) = collect_runs(tmp_path)
    assert run["status"] == ("completed" if outcome == "completed" else "diverged")


def test_a_refused_command_replaces_an_earlier_refusals_record(tmp_path):
    # A record of a start failure holds no results: the next refusal's record replaces it.
    from mptex.train import ConfigError

    for mistake in ("train.lr=-1", "train.iterations=-3"):
        with pytest.raises(ConfigError) as info:
            train(tiny_cfg(*ADAM_RUN, mistake), tmp_path)
        after = read_metrics(tmp_path)
        assert after["status"] == "failed" and after["failed_at"] == "start"
        assert after["error"] == str(info.value) and "start_failures" not in after


@pytest.mark.parametrize("mistake", ["train.iterations=2", "precision=bf16", "train.seed=7",
                                     "train.lr=-1"])  # fmt: skip
def test_a_refused_command_leaves_an_interrupted_run_to_the_right_one(tmp_path, uninterrupted,
                                                                      mistake):  # fmt: skip
    # A mistyped command in an interrupted run's directory is refused in one line, and the
    # directory keeps its record (status interrupted) and checkpoint: the right command then
    # continues the run, bit for bit, instead of starting over.
    from mptex.train import ConfigError

    train(tiny_cfg(*ADAM_RUN, "train.inject_signal_at=2"), tmp_path)
    record, weights = read_metrics(tmp_path), (tmp_path / "checkpoint.pt").read_bytes()
    with pytest.raises(ConfigError) as info:
        train(tiny_cfg(*ADAM_RUN, mistake), tmp_path)
    assert "\n" not in str(info.value)
    # The stopped run's record stays, with the refused attempt added to it.
    after = read_metrics(tmp_path)
    assert after.pop("start_failures") == [{"error": str(info.value), "failed_at": "start"}]
    assert after == record and (tmp_path / "checkpoint.pt").read_bytes() == weights
    (run,) = collect_runs(tmp_path)
    assert run["status"] == "failed" and run["error"].endswith(
        f"and not resumed; 1 attempt to continue it failed at start, the last: {info.value}"
    )
    again = train(tiny_cfg(*ADAM_RUN), tmp_path)
    assert again["status"] == "completed" and again["resume_count"] == 1
    assert again["psnr"] == read_metrics(uninterrupted)["psnr"]
    assert_same_weights(tmp_path, uninterrupted)


def test_the_mlp_rate_ramp_runs_at_the_ramps_rate_and_resumes_mid_ramp_bit_exactly(tmp_path):
    # train.mlp_lr_ramp_to: the MLP's factor goes 0.1 -> 0.4 linearly over 4 iterations; the
    # Adam lr of the MLP group at the last step (iteration 5: past the ramp) is the grid's x 0.4.
    from mptex.train.loop import mlp_rate_factor

    ramp = {"mlp_lr_scale": 0.1, "mlp_lr_ramp_to": 0.4, "mlp_lr_ramp_iter": 4}
    assert [mlp_rate_factor(ramp, i) for i in (0, 2, 4, 9)] == pytest.approx([0.1, 0.25, 0.4, 0.4])
    assert mlp_rate_factor({**ramp, "mlp_lr_ramp_to": None}, 2) == 0.1
    cfg = (*ADAM_RUN, "train.mlp_lr_scale=0.1", "train.mlp_lr_ramp_to=0.4",
           "train.mlp_lr_ramp_iter=4")  # fmt: skip
    whole = train(tiny_cfg(*cfg), tmp_path / "whole")
    grid, mlp = _adam_groups(tmp_path / "whole")
    assert mlp["lr"] == pytest.approx(grid["lr"] * 0.4, rel=1e-12)
    plain = train(tiny_cfg(*ADAM_RUN, "train.mlp_lr_scale=0.1"), tmp_path / "plain")
    assert plain["psnr"] != whole["psnr"]  # the ramp changes the run
    first = train(tiny_cfg(*cfg, "train.inject_signal_at=2"), tmp_path / "resumed")  # mid-ramp
    assert first["status"] == "interrupted"
    again = train(tiny_cfg(*cfg), tmp_path / "resumed")
    assert again["psnr"] == whole["psnr"] and again["history"] == whole["history"]
    _assert_same_adam_state(tmp_path / "resumed", tmp_path / "whole")


def test_a_relaying_handler_records_the_signal_and_passes_it_to_child_processes():
    # The precision search's handler (mptex.search.pool): the search process only records the
    # signal; its worker processes get it and stop their runs. Here the child is a plain sleep,
    # which SIGUSR1's default action ends.
    import multiprocessing

    from mptex.train.signals import StopSignals, send_signal

    child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
    child.start()
    stop = StopSignals(relay=True)
    try:
        stop.install(["SIGUSR1"])
        send_signal("SIGUSR1")
        time.sleep(0.1)  # the handler runs between bytecodes of the main thread
    finally:
        stop.uninstall()
    child.join(30)
    assert stop.received == ["SIGUSR1"]
    assert child.exitcode == -signal.SIGUSR1


def test_a_handler_installed_over_another_takes_what_it_received_and_passes_new_signals_on():
    # A parallel sweep's job process keeps a handler between its jobs; a run's handler over it
    # stops the run for a signal that came while the run started, and the process's handler
    # knows of the signals the run got (the process then starts no other job).
    from mptex.train.signals import StopSignals, send_signal

    outer, inner = StopSignals(), StopSignals()
    try:
        outer.install(["SIGUSR1", "SIGUSR2"])
        send_signal("SIGUSR1")
        inner.install(["SIGUSR1", "SIGUSR2"])
        assert inner.received == ["SIGUSR1"]
        send_signal("SIGUSR2")
        assert inner.received == ["SIGUSR1", "SIGUSR2"] == outer.received
        inner.uninstall()
        assert signal.getsignal(signal.SIGUSR2) == outer._handle
    finally:
        inner.uninstall()
        outer.uninstall()
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL


def test_a_stopped_sweep_job_names_the_command_that_continues_the_sweep(tmp_path, capsys):
    # A sweep's directory refuses a second sweep unless told to continue into it: the line a
    # stopped job prints gives that command, a single run's the plain one.
    from mptex.cli.train import _interrupted

    metrics = {"signal": "SIGTERM", "interrupted_at": 5, "iterations_planned": 20}
    for multirun, sweep_dir, expected in (
        (True, tmp_path / "sweep", f"the same command with hydra.sweep.dir={tmp_path / 'sweep'} "
         "hydra.callbacks.fresh_sweep_dir.enabled=false continues the sweep (its completed runs "
         f"train again), or mptex-train hydra.run.dir={tmp_path / 'job'} with this job's "
         "overrides (.hydra/overrides.yaml) continues this run alone (train.resume=auto)"),
        (False, None, "the same command continues it (train.resume=auto)"),
    ):  # fmt: skip
        with pytest.raises(SystemExit) as info:
            _interrupted(metrics, tmp_path / "job", multirun, sweep_dir)
        assert info.value.code == EXIT_CODES["interrupted"]
        err = capsys.readouterr().err
        assert err.splitlines() == [
            f"mptex-train: interrupted by SIGTERM after iteration 5 of 20: checkpoint and "
            f"metrics in {tmp_path / 'job'}; {expected}"
        ]


# ------------------------------------------------------ a stop signal after the last iteration
# A run of 4 iterations that validates and checkpoints only at its end.
SHORT = [*TINY, "train.iterations=4", "train.checkpoint_interval=10"]
EXPORT = ["export.enabled=true", "export.resolution=64", "export.formats=[obj]",
          "export.measure=false"]  # fmt: skip


def short_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("config", overrides=[*SHORT, *overrides])


@pytest.fixture(scope="module")
def short_reference(tmp_path_factory) -> Path:
    """The short run without a signal: a signalled run's results must be these."""
    run_dir = tmp_path_factory.mktemp("short_reference")
    assert train(short_cfg(), run_dir)["status"] == "completed"
    return run_dir


class _SignallingExporter:
    """An exporter that is sent SIGTERM while it exports, and exports nothing."""

    def preflight(self, *args) -> None:
        pass

    def export(self, *args) -> dict:
        os.kill(os.getpid(), signal.SIGTERM)
        return {}


def _signal_during(monkeypatch, during: str) -> tuple[list[str], object]:
    """Overrides and an exporter that make SIGTERM arrive in the part ``during`` of the short
    run, after its last iteration has begun."""
    import mptex.train.loop as loop

    def sending(function, when=lambda *args: True):
        sent = []

        def wrapped(*args, **kwargs):
            if not sent and when(*args):
                sent.append(True)
                os.kill(os.getpid(), signal.SIGTERM)
            return function(*args, **kwargs)

        return wrapped

    if during == "last iteration":  # the hook sends it in the forward of iteration 3 (0-based)
        return ["train.inject_signal_at=3"], None
    if during == "export":
        return ["export.enabled=true"], _SignallingExporter()
    name, when = {
        "final validation": ("validate", lambda run, completed: completed == run.n_iter),
        "final checkpoint": ("save_checkpoint", lambda path, state: state["iteration"] == 4),
        "images": ("save_val_images", lambda *args: True),
        "metrics": ("write_metrics", lambda *args: True),
    }[during]
    monkeypatch.setattr(loop, name, sending(getattr(loop, name), when))
    return [], None


@pytest.mark.parametrize("during", ["last iteration", "final validation", "final checkpoint",
                                    "images", "export", "metrics"])  # fmt: skip
def test_a_stop_signal_after_the_last_iteration_leaves_the_whole_run_and_records_the_stop(
    monkeypatch, tmp_path, short_reference, during
):
    overrides, exporter = _signal_during(monkeypatch, during)
    metrics = train(short_cfg(*overrides), tmp_path, exporter=exporter)
    monkeypatch.undo()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is removed
    recorded = read_metrics(tmp_path)
    expected = {"signal": "SIGTERM", "during": during}
    assert metrics["stop_requested"] == recorded["stop_requested"] == expected
    # The run is the one without the signal: completed, its weights, PSNR and images.
    assert recorded["status"] == "completed" and recorded["iterations"] == 4
    assert recorded["interruptions"] == [] and recorded["interrupted_at"] is None
    assert recorded["psnr"] == read_metrics(short_reference)["psnr"]
    assert_same_weights(tmp_path, short_reference)
    assert load_checkpoint(tmp_path / "checkpoint.pt")["iteration"] == 4
    assert sorted(p.name for p in (tmp_path / "images").iterdir()) == sorted(
        p.name for p in (short_reference / "images").iterdir()
    )


def test_a_run_without_a_stop_signal_records_no_stop_request(short_reference):
    assert read_metrics(short_reference)["stop_requested"] is None


def _stopped_after_training_line(during: str, then: str) -> str:
    return (
        f"mptex-train: stop requested by SIGTERM during the {during}, after training had "
        "ended: the run is completed with its results whole (metrics.json: stop_requested); "
        f"{then}"
    )


_DURING = [
    pytest.param("validation", "final validation", id="validation"),
    pytest.param("checkpoint", "final checkpoint", id="checkpoint"),
    pytest.param("export", "export", id="export"),
]


@pytest.mark.requires_xatlas  # the export at the run's end
@pytest.mark.requires_trimesh
@pytest.mark.parametrize("signal_in, during", _DURING)
def test_a_run_signalled_after_its_last_iteration_completes_and_exits_3(
    site, tmp_path, signal_in, during
):
    # Slurm's SIGTERM (a time limit, scancel) while the run validates, checkpoints or exports
    # at its end: the run's results stand, and the command stops with the stop status.
    proc = cli(site, tmp_path, f"hydra.run.dir={tmp_path}", *SHORT, *EXPORT, signal_in=signal_in)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_CODES["interrupted"] == 3, err
    assert out.splitlines()[0].startswith("mptex-train: completed: PSNR "), out
    assert err.splitlines()[-1] == _stopped_after_training_line(
        during, "nothing is left to continue"
    ), err
    metrics = read_metrics(tmp_path)
    assert metrics["status"] == "completed" and metrics["iterations"] == 4
    assert metrics["stop_requested"] == {"signal": "SIGTERM", "during": during}
    # the export at the run's end is whole too
    assert "error" not in metrics["export"] and metrics["export"]["resolution"] == 64
    assert (tmp_path / "export" / "mesh.obj").is_file()


@pytest.mark.requires_xatlas  # the export at the run's end
@pytest.mark.requires_trimesh
@pytest.mark.parametrize("signal_in, during", _DURING)
def test_a_sweep_signalled_after_a_jobs_last_iteration_stops_before_its_next_job(
    site, tmp_path, signal_in, during
):
    # Hydra's basic launcher runs the jobs one after another in this process: a SIGTERM while
    # job 0 validates, checkpoints or exports at its end stops the sweep as one mid-iteration
    # does (exit 3), job 0 completed and jobs 1 and 2 never started.
    sweep = tmp_path / "sweep"
    proc = cli(site, tmp_path, "-m", f"hydra.sweep.dir={sweep}", *SHORT, *EXPORT,
               "train.seed=0,1,2", signal_in=signal_in)  # fmt: skip
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_CODES["interrupted"] == 3, err
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert len(jobs) == 1 and jobs[0].startswith("0_"), (jobs, err)  # job 0 only
    metrics = read_metrics(sweep / jobs[0])
    assert metrics["status"] == "completed"
    assert metrics["stop_requested"] == {"signal": "SIGTERM", "during": during}
    then = (f"the sweep stops here; the same command with hydra.sweep.dir={sweep} "
            "hydra.callbacks.fresh_sweep_dir.enabled=false continues the sweep (its completed "
            "runs train again)")  # fmt: skip
    assert _stopped_after_training_line(during, then) in err.splitlines(), err


def _submitit_sweep_not_requeued(site, tmp_path, *overrides, signal_in):
    """A one-job SHORT sweep under submitit_local, sent SIGUSR2 at ``signal_in``: it ends with
    status 0, its run completed without a resume and its job not requeued; returns the run's
    metrics and the job's logs."""
    sweep = tmp_path / "sweep"
    proc = cli(site, tmp_path, "-m", "hydra/launcher=submitit_local", f"hydra.sweep.dir={sweep}",
               *SHORT, *overrides, signal_in=signal_in, signal="SIGUSR2")  # fmt: skip
    code, err = finish(proc)
    assert code == 0, err
    [run_dir] = [p.parent for p in sweep.glob("*/metrics.json")]
    metrics = read_metrics(run_dir)
    assert metrics["status"] == "completed" and metrics["resume_count"] == 0
    logs = "".join(p.read_text() for p in sweep.glob(".submitit/*/*_log.*"))
    assert "Requeued job" not in logs
    return metrics, logs


@pytest.mark.requires_xatlas  # the export at the run's end
@pytest.mark.requires_trimesh
def test_submitit_local_does_not_requeue_a_job_signalled_after_its_last_iteration(site, tmp_path):
    # submitit's own signal (SIGUSR2) while the job exports: the run is done, so the job ends
    # normally instead of being requeued (a requeue would find a completed run).
    metrics, logs = _submitit_sweep_not_requeued(site, tmp_path, *EXPORT, signal_in="export")
    assert metrics["stop_requested"] == {"signal": "SIGUSR2", "during": "export"}
    assert _stopped_after_training_line("export", "this job ends and is not requeued").replace(
        "SIGTERM", "SIGUSR2") in logs, logs  # fmt: skip


def test_submitit_local_does_not_requeue_a_job_signalled_after_its_run_ended(site, tmp_path):
    # submitit's own signal (SIGUSR2) just after train() has removed its handlers, before the
    # job's process exits (the local controller's pre-timeout signal as the run completes):
    # it reached submitit's handler, whose requeue ran the job again, and without
    # SLURM_RESTART_COUNT train.resume=auto trained the completed run again from the start.
    metrics, logs = _submitit_sweep_not_requeued(site, tmp_path, signal_in="end")
    assert metrics["stop_requested"] is None  # it came after the run, which recorded nothing
    assert logs.count("mptex-train: completed") == 1, logs  # trained once


def test_a_parallel_sweeps_job_signalled_after_its_last_iteration_returns_to_the_sweep(
    monkeypatch, tmp_path, capsys
):
    # In a worker process of a parallel sweep the completed job returns (a SystemExit there
    # made joblib end the sweep) and leaves the note the sweep's process reads to exit 3.
    from mptex.cli.app import SWEEP_PARENT_ENV, SWEEP_STOPPED_ENV
    from mptex.cli.train import _stopped_after_training

    notes = tmp_path / "notes.txt"
    monkeypatch.setenv(SWEEP_PARENT_ENV, str(os.getpid() + 1))
    monkeypatch.setenv(SWEEP_STOPPED_ENV, str(notes))
    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    metrics = {"status": "completed", "stop_requested": {"signal": "SIGINT", "during": "metrics"}}
    job = tmp_path / "0_train.seed=0"
    assert _stopped_after_training(metrics, job, True, tmp_path) is None
    assert notes.read_text() == "0_train.seed=0: completed, stop requested\n"
    assert capsys.readouterr().err.startswith(
        "mptex-train: stop requested by SIGINT during the metrics.json write, after training "
        "had ended: the run is completed with its results whole"
    )
