"""Command-line entry points (Hydra apps).

``mptex-train`` (:func:`train_main`) composes ``configs/config.yaml`` (groups ``scene``,
``precision``, ``texture``, ``train``) and runs :func:`mptex.train.train` in Hydra's run
directory::

    mptex-train                                   # builtin scene, f32, CPU-sized texture
    mptex-train precision=f16_dynamic train.iterations=1000
    mptex-train -m precision=f32,f16_dynamic,bf16 train.seed=0,1
    mptex-train hydra.run.dir=outputs/a train.iterations=2000 train.resume=true  # continue

Exit status (:data:`EXIT_CODES`): 0 the run ended (completed or diverged: ``metrics.json``
says which); 2 a bad config value or input file at start, or a full disk (one line on stderr,
naming the key or the file); 3 stopped by a stop signal (``train.stop_signals``) after writing
``checkpoint.pt`` and ``metrics.json`` (``status: "interrupted"``): run the same command again
to continue (``train.resume=auto``). In a submitit job (``hydra/launcher=submitit_local`` or
``submitit_slurm``/``slurm_gpu``) submitit's own signal (``SIGUSR2``) is handed back to
submitit after the checkpoint, which requeues the job (exit 144 under ``submitit_local``), and
the other stop signals end the job normally, so the sweep's report lists it.

The configs are ``configs/`` and ``experiments/`` at the top of a source checkout (an editable
install reads them there), shipped inside the package by a wheel install (:mod:`mptex._paths`),
so ``mptex-train`` runs from any folder. Add your own groups with Hydra's ``--config-dir DIR``
(e.g. a precision search's result: ``DIR/precision/<name>.yaml``).
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
from pathlib import Path

from omegaconf import OmegaConf

from mptex._paths import CONFIG_DIR, EXPERIMENTS_DIR
from mptex.scenes.assets import suite_path

__all__ = [
    "CONFIG_DIR",
    "EXIT_CODES",
    "EXPERIMENTS_DIR",
    "job_dirname",
    "register_experiments",
    "train_main",
]


_PROG = "mptex-train"
# mptex-train's exit statuses (module docstring).
EXIT_CODES = {"ok": 0, "error": 2, "interrupted": 3}
# A job directory name (with its "<num>_" prefix) stays under the 255 bytes most file systems
# allow, and long enough that the usual overrides, swept values included, are all in it.
_MAX_DIRNAME = 200


def job_dirname(overrides: str) -> str:
    """A sweep job's directory name from Hydra's ``override_dirname`` (``"precision=f32,
    train.seed=0"``): ``/`` becomes ``%2F`` (a mesh path would otherwise nest directories),
    and a name longer than 200 characters keeps its first 191 and ends in ``~`` and 8 hex digits
    of its md5 (distinct override lists keep distinct names). Used by ``hydra.sweep.subdir`` in
    configs/config.yaml as ``${mptex_dirname:${hydra.job.override_dirname}}``."""
    name = str(overrides).replace("%", "%25").replace("/", "%2F").replace("\\", "%5C") or "job"
    if len(name) > _MAX_DIRNAME:
        digest = hashlib.md5(name.encode()).hexdigest()[:8]
        name = f"{name[: _MAX_DIRNAME - 9]}~{digest}"
    return name


# Registered at import: sweep jobs resolve hydra.sweep.subdir in the job's process, which under
# the submitit and joblib launchers imports this module to unpickle the task, not train_main.
OmegaConf.register_new_resolver("mptex_dirname", job_dirname, replace=True)
# configs/scene/<asset>.yaml: the real-asset suite's OBJ path, found in pybullet_data at run time.
OmegaConf.register_new_resolver("mptex_asset", suite_path, replace=True)


def _error(message: str) -> None:
    print(f"{_PROG}: error: {message}", file=sys.stderr)


def _run(cfg) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from mptex.train import ConfigError, train
    from mptex.train.checkpoint import DiskFullError

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    if "search" in cfg:
        _search(cfg, run_dir)
        return
    try:
        metrics = train(cfg, run_dir)
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
        _interrupted(metrics, run_dir, hydra_cfg.mode == RunMode.MULTIRUN)
        return
    detail = f" at iteration {metrics['diverged_at']}" if status == "diverged" else ""
    print(
        f"{_PROG}: {status}{detail}: PSNR {metrics['psnr']:.2f} dB "
        f"(constant-colour baseline {metrics['baseline_psnr']:.2f} dB), "
        f"{metrics['iterations']} iterations, {metrics['time_per_iter_s'] or 0:.4f} s/iteration"
    )
    print(f"{_PROG}: results in {run_dir}")
    print(f"{_PROG}: metrics in {run_dir / 'metrics.json'}")


def _search(cfg, run_dir: Path) -> None:
    """``+experiment=precision_search``: the precision search instead of one training run."""
    from mptex.search import SearchError, SearchInterrupted, run_search

    try:
        summary = run_search(cfg, run_dir)
    except (SearchError, ValueError) as exc:
        _error(str(exc))
        sys.exit(EXIT_CODES["error"])
    except SearchInterrupted as exc:
        print(f"{_PROG}: interrupted: {exc}", file=sys.stderr)
        sys.exit(EXIT_CODES["interrupted"])
    row = next(r for r in summary["candidates"] if r["candidate"] == summary["certified"])
    cert = row["certificate"] or {}
    interval = (f"[{cert['low']:+.2f}, {cert['high']:+.2f}] dB"
                if cert.get("low") is not None else "-")  # fmt: skip
    budget = summary["budget"]
    print(f"{_PROG}: precision search: certified {summary['certified']} "
          f"(PSNR - PSNR(f32) {interval}, seeds {summary['seeds']}); "
          f"{budget['runs']} runs, {budget['search_wall_s']:.0f} s")  # fmt: skip
    print(f"{_PROG}: {summary['reproduce']} trains it ({summary['result_config']})")
    print(f"{_PROG}: report in {run_dir / 'search.md'}")


def _submitit_signal() -> signal.Signals | None:
    """The signal submitit's job handler requeues on, in a submitit job; else None.

    submitit reads it from ``SUBMITIT_PREEMPT_SIGNAL`` (default ``USR2``) and sets
    ``SUBMITIT_EXECUTOR`` in every job it starts (``submitit.core.job_environment``).
    """
    if not os.environ.get("SUBMITIT_EXECUTOR"):
        return None
    return getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"), None)


def _interrupted(metrics: dict, run_dir: Path, multirun: bool) -> None:
    """After a stop signal: say so in one line, then requeue (submitit) or exit 3."""
    name = metrics["signal"]
    print(
        f"{_PROG}: interrupted by {name} after iteration {metrics['interrupted_at']} of "
        f"{metrics['iterations_planned']}: checkpoint and metrics in {run_dir}; the same "
        f"command continues it (train.resume=auto)",
        file=sys.stderr,
    )
    requeue = _submitit_signal()
    if requeue is not None and name == requeue.name:
        handler = signal.getsignal(requeue)
        if callable(handler):
            # train() has put submitit's handler back: it calls the launcher's checkpoint(),
            # which resubmits the same job (same run dir, resumed by train.resume=auto), and
            # requeues it (scontrol requeue; exit 144 under submitit_local).
            signal.raise_signal(requeue)
    if requeue is not None and multirun:
        return  # a submitit job that ends normally: the sweep's report lists it
    sys.exit(EXIT_CODES["interrupted"])


def register_experiments(directory: str | os.PathLike = EXPERIMENTS_DIR) -> list[str]:
    """Make ``experiments/*.yaml`` the ``experiment`` config group (``+experiment=NAME``).

    Sweeps live beside ``configs/`` rather than in it (one place for what to run, one for how);
    Hydra finds a group only under a search-path root, so they are stored in its ConfigStore
    at the ``_global_`` package, as their ``# @package _global_`` header says.
    """
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    store, names = ConfigStore.instance(), []
    for path in sorted(Path(directory).glob("*.yaml")):
        store.store(group="experiment", name=path.stem, node=OmegaConf.load(path),
                    package="_global_")  # fmt: skip
        names.append(path.stem)
    return names


def _arm_available(cfg) -> tuple[bool, str]:
    from mptex.precision import PrecisionPolicy

    try:
        return PrecisionPolicy.from_config(cfg.precision).availability()
    except (ValueError, AttributeError, TypeError):  # a bad precision config: not "unavailable"
        return True, ""


def _reproducible_blas() -> None:
    # MKL's strict conditional numerical reproducibility: its GEMMs return the same bits for any
    # thread count. Without it torch's CPU matmuls split the reduction over points between
    # threads, so 1 and 2 threads gave different MLP weight gradients, and a training run
    # amplifies such differences (docs/archive/thread-count.md). MKL reads the
    # variable at its first call, hence here, before any tensor work; a user's value is kept.
    os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")


def train_main() -> None:
    """``mptex-train``: Hydra app over ``configs/config.yaml``; see the module docstring."""
    _reproducible_blas()
    if not (CONFIG_DIR / "config.yaml").is_file():
        _error(
            f"configs not found at {CONFIG_DIR}: this mptex is neither a wheel install "
            "(mptex/configs) nor a source checkout (configs/ beside mptex/); reinstall it"
        )
        sys.exit(2)
    import hydra

    register_experiments()
    app = hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="config")(_run)
    app()


if __name__ == "__main__":
    train_main()
