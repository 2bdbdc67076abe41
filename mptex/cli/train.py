"""``mptex-train``: train one texture, or sweep arms × seeds × scenes (a Hydra app).

``mptex-train`` (:func:`train_main`) composes ``configs/config.yaml`` (groups ``scene``,
``precision``, ``texture``, ``train``, ``export``) and runs :func:`mptex.train.train` in
Hydra's run directory::

    mptex-train                                   # builtin scene, f32, CPU-sized texture
    mptex-train precision=f16_dynamic train.iterations=1000
    mptex-train -m precision=f32,f16_dynamic,bf16 train.seed=0,1
    mptex-train hydra.run.dir=outputs/a train.iterations=2000 train.resume=true  # continue

Exit status (:data:`EXIT_CODES`): 0 the run ended (completed or diverged: ``metrics.json``
says which); 2 a bad config value or input file at start, or a full disk (one line on stderr,
naming the key or the file); 3 stopped by a stop signal (``train.stop_signals``) after writing
``checkpoint.pt`` and ``metrics.json`` (``status: "interrupted"``): run the same command again
to continue (``train.resume=auto``); also a stop signal that came once the last iteration
had begun, after which the run ended as it would have, completed or diverged
(``metrics.json``'s ``stop_requested``; nothing to
continue: a sweep under the basic launcher stops before its next job, and a submitit job ends
normally without a requeue); and a Ctrl-C while no training loop runs (Hydra
composing the config, before a run's handler is in place), which writes nothing. In a
submitit job (``hydra/launcher=submitit_local`` or ``submitit_slurm``/``slurm_gpu``) submitit's
own signal (``SIGUSR2``) is handed back to submitit after the checkpoint, which requeues the
job (exit 144 under ``submitit_local``), and the other stop signals end the job normally, so
the sweep's report lists it; one that comes after the run has ended is recorded and dropped
until the job's process exits (:func:`_hold_submitit_signal`). In a sweep whose jobs run in
worker processes (``hydra/launcher=local_parallel``, joblib) a stopped job returns too, the jobs
not yet started do not start, and the sweep's process exits 3 after the report
(:class:`mptex.cli.app.ParallelSweepStopCallback`); so it does where the signal reached one
worker process alone, which starts no other job (:func:`mptex.cli.app.record_stopped_job`).

The configs are ``configs/`` and ``experiments/`` at the top of a source checkout (an editable
install reads them there), shipped inside the package by a wheel install (:mod:`mptex._paths`),
so ``mptex-train`` runs from any folder. Add your own groups with Hydra's ``--config-dir DIR``
(e.g. a precision search's result: ``DIR/precision/<name>.yaml``).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from mptex._paths import CONFIG_DIR, EXPERIMENTS_DIR
from mptex.cli.app import (
    EXIT_CODES,
    _stop_signal_names,
    continue_sweep,
    job_dirname,
    path_override,
    record_stopped_job,
    register_experiments,
    run_hydra_app,
    stopped_before_start,
    sweep_job_process,
)
from mptex.train.signals import StopSignals

__all__ = [
    "CONFIG_DIR",
    "EXIT_CODES",
    "EXPERIMENTS_DIR",
    "job_dirname",
    "register_experiments",
    "train_main",
]


_PROG = "mptex-train"


def _error(message: str) -> None:
    print(f"{_PROG}: error: {message}", file=sys.stderr)


def _run(cfg) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from mptex.bake import TrainingExport
    from mptex.train import ConfigError, train
    from mptex.train.checkpoint import DiskFullError

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    if hydra_cfg.mode == RunMode.MULTIRUN and stopped_before_start(cfg, run_dir, _PROG):
        return  # a parallel sweep stopped by a signal before this job: it does not start
    if "search" in cfg:  # mptex-train +experiment=precision_search: mptex-search's alias
        from mptex.cli.search import run_search_command

        run_search_command(cfg, run_dir, _PROG)
        return
    _hold_submitit_signal(cfg)
    try:
        metrics = train(cfg, run_dir, exporter=TrainingExport())
    except DiskFullError as exc:
        # metrics.json says failed where it could still be written; the sweep goes on (its
        # report lists the run as failed with this reason).
        _error(str(exc))
        if hydra_cfg.mode == RunMode.MULTIRUN:
            return
        sys.exit(EXIT_CODES["error"])
    except ConfigError as exc:
        # A config error (train() checks everything before working): one line, no traceback.
        if hydra_cfg.mode == RunMode.MULTIRUN:
            # Let the sweep go on: metrics.json records the failure, and the report lists an
            # arm this machine cannot run (tcnn_fused without tinycudann) as unavailable.
            available, _ = _arm_available(cfg)
            what = "unavailable on this machine" if not available else "error"
            print(f"{_PROG}: {what}: {exc}", file=sys.stderr)
            return
        _error(str(exc))
        sys.exit(EXIT_CODES["error"])
    status = metrics["status"]
    if status == "interrupted":
        multirun = hydra_cfg.mode == RunMode.MULTIRUN
        _interrupted(metrics, run_dir, multirun, hydra_cfg.sweep.dir if multirun else None)
        return
    print(_summary_line(metrics))
    print(f"{_PROG}: results in {run_dir}")
    print(f"{_PROG}: metrics in {run_dir / 'metrics.json'}")
    export = metrics.get("export")
    if isinstance(export, dict) and export.get("error"):
        # The training completed and stands; the export at its end did not (metrics.json's
        # export.error): said, not only recorded.
        print(f"{_PROG}: export failed: {export['error']}", file=sys.stderr)
    if metrics.get("stop_requested"):
        multirun = hydra_cfg.mode == RunMode.MULTIRUN
        _stopped_after_training(metrics, run_dir, multirun,
                                hydra_cfg.sweep.dir if multirun else None)  # fmt: skip


def _submitit_signal() -> signal.Signals | None:
    """The signal submitit's job handler requeues on, in a submitit job; else None.

    submitit reads it from ``SUBMITIT_PREEMPT_SIGNAL`` (default ``USR2``) and sets
    ``SUBMITIT_EXECUTOR`` in every job it starts (``submitit.core.job_environment``).
    """
    if not os.environ.get("SUBMITIT_EXECUTOR"):
        return None
    return getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"), None)


# In a submitit job: a flag-only handler for submitit's own signal, kept from just before the
# run to the end of the job's process (_hold_submitit_signal).
_SUBMITIT_HOLD = StopSignals()


def _hold_submitit_signal(cfg) -> None:
    """In a submitit job whose ``train.stop_signals`` names submitit's signal (``SIGUSR2``):
    install over submitit's handler one that only records the signal, for the rest of the
    job's process. The run's own handler goes over it and, when the run ends, puts this one
    back rather than submitit's: a signal between the run's end and the process's exit (the
    local controller's pre-timeout signal as the run completes) reached submitit, whose
    requeue ran the job again, and under ``submitit_local`` (no ``SLURM_RESTART_COUNT``, so
    ``train.resume=auto`` starts over) trained the completed run again from the start. Only
    :func:`_interrupted` hands the signal back to submitit, for a run it stopped."""
    signum = _submitit_signal()
    if signum is None or _SUBMITIT_HOLD.installed or signum.name not in _stop_signal_names(cfg):
        return
    _SUBMITIT_HOLD.install([signum.name], owner="a submitit job")


def _summary_line(metrics: dict) -> str:
    """The line a finished run ends with: status, PSNR, baseline, iterations and time per
    iteration (none where no iteration was timed: a run that diverged at its first)."""
    status = metrics["status"]
    detail = f" at iteration {metrics['diverged_at']}" if status == "diverged" else ""
    per_iter = metrics.get("time_per_iter_s")
    timing = "no iteration timed" if per_iter is None else f"{per_iter:.4f} s/iteration"
    return (
        f"{_PROG}: {status}{detail}: PSNR {metrics['psnr']:.2f} dB "
        f"(constant-colour baseline {metrics['baseline_psnr']:.2f} dB), "
        f"{metrics['iterations']} iterations, {timing}"
    )


def _interrupted(metrics: dict, run_dir: Path, multirun: bool, sweep_dir=None) -> None:
    """After a stop signal: say so in one line, then requeue (submitit) or exit 3.
    ``sweep_dir``: the sweep's directory, for a job of a multirun."""
    name = metrics["signal"]
    requeue = _submitit_signal()
    if requeue is not None and name == requeue.name:
        _SUBMITIT_HOLD.uninstall()  # submitit's handler is back, for the hand-back below
    requeued = requeue is not None and name == requeue.name and callable(
        signal.getsignal(requeue))  # fmt: skip
    if requeued:
        again = "submitit requeues this job, which continues it (train.resume=auto)"
    elif multirun:
        # A sweep's directory refuses a second sweep unless told to continue into it, and a
        # sweep run again trains its completed runs again: the run alone is the other way.
        again = (
            f"{continue_sweep(sweep_dir)} (its completed runs train again), or mptex-train "
            f"{path_override('hydra.run.dir', run_dir)} with "
            "this job's overrides (.hydra/overrides.yaml) continues this run alone "
            "(train.resume=auto)"
        )
    else:
        again = "the same command continues it (train.resume=auto)"
    print(
        f"{_PROG}: interrupted by {name} after iteration {metrics['interrupted_at']} of "
        f"{metrics['iterations_planned']}: checkpoint and metrics in {run_dir}; {again}",
        file=sys.stderr,
    )
    if requeued:
        # train() has put submitit's handler back: it calls the launcher's checkpoint(), which
        # resubmits the same job (same run dir, resumed by train.resume=auto), and requeues it
        # (scontrol requeue; exit 144 under submitit_local).
        signal.raise_signal(requeue)
    if multirun and (requeue is not None or sweep_job_process()):
        # a submitit job that ends normally: the sweep's report lists it; or a job of a
        # parallel sweep (joblib), whose own process exits 3 once its jobs under way are done
        record_stopped_job(run_dir, "interrupted")
        return
    sys.exit(EXIT_CODES["interrupted"])


def _stopped_after_training(metrics: dict, run_dir: Path, multirun: bool, sweep_dir=None) -> None:
    """After a stop signal that came once the run's last iteration had begun (metrics.json's
    ``stop_requested``): the run ended and its results are whole, so nothing is continued; say
    so in one line, then exit 3 so that nothing more starts (a sweep under the basic launcher
    stops before its next job). A submitit job ends normally and is not requeued, whatever
    the signal (a requeue would train nothing: its run is done); a job of a parallel sweep
    returns (its worker process starts no other job; the sweep's process exits 3)."""
    from mptex.report.markdown import during_text

    name, during = metrics["stop_requested"]["signal"], metrics["stop_requested"]["during"]
    submitit = _submitit_signal() is not None
    if submitit:
        then = "this job ends and is not requeued"
    elif multirun:
        then = f"the sweep stops here; {continue_sweep(sweep_dir)} (its completed runs train again)"
    else:
        then = "nothing is left to continue"
    print(
        f"{_PROG}: stop requested by {name} during {during_text(during)}, after "
        f"training had ended: the run is {metrics['status']} with its results whole "
        f"(metrics.json: stop_requested); {then}",
        file=sys.stderr,
    )
    if multirun and (submitit or sweep_job_process()):
        record_stopped_job(run_dir, f"{metrics['status']}, stop requested")
        return
    sys.exit(EXIT_CODES["interrupted"])


def _arm_available(cfg) -> tuple[bool, str]:
    from mptex.precision import PrecisionPolicy

    try:
        return PrecisionPolicy.from_config(cfg.precision).availability()
    except (ValueError, AttributeError, TypeError):  # a bad precision config: not "unavailable"
        return True, ""


def _sweep_value_problem(cfg, local: bool = False) -> str | None:
    """The run's own check of one composed config of a sweep, before its first job: the
    config alone (:func:`mptex.train.validate_config` with ``machine=False``, and the scene
    group, which a run checks when it builds its scene), not what the run needs from a
    machine: the jobs may run elsewhere (a cluster's GPU nodes), and a device, a backend or
    memory this machine lacks is each job's to say. ``local``: the sweep's launcher runs its
    jobs on this machine, from this folder, so the scene's input files are looked for too
    (:func:`mptex.scenes.build.missing_file_problem`). None where the config passes or is a
    precision search (which checks its own)."""
    if "search" in cfg:
        return None
    from mptex.config_schema import plain
    from mptex.scenes.assets import SUITE
    from mptex.scenes.build import missing_file_problem
    from mptex.scenes.config import check_scene_config
    from mptex.train import validate_config

    try:
        config = validate_config(dict(plain(cfg)), machine=False)
    except ValueError as exc:
        return " ".join(str(exc).split())
    try:
        scene = check_scene_config(config["scene"])
    except ValueError as exc:
        if config["scene"].get("name") in SUITE:
            return None  # a suite asset's file is in pybullet_data where the job runs
        return " ".join(str(exc).split())
    return missing_file_problem(scene) if local else None


def train_main() -> None:
    """``mptex-train``: Hydra app over ``configs/config.yaml``; see the module docstring."""
    run_hydra_app(_run, _PROG, check=_sweep_value_problem)


if __name__ == "__main__":
    train_main()
