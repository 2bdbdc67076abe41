"""Command-line entry points (Hydra apps).

``mptex-train`` (:func:`train_main`) composes ``configs/config.yaml`` (groups ``scene``,
``precision``, ``texture``, ``train``) and runs :func:`mptex.train.train` in Hydra's run
directory::

    mptex-train                                   # builtin scene, f32, CPU-sized texture
    mptex-train precision=f16_dynamic train.iterations=1000
    mptex-train -m precision=f32,f16_dynamic,bf16 train.seed=0,1
    mptex-train hydra.run.dir=outputs/a train.iterations=2000 train.resume=true  # continue

The configs are read from the ``configs/`` folder next to the ``mptex`` package, i.e. from a
source checkout or an editable install (``pip install -e .``); they are deliberately not package
data, because users edit them and ``experiments/`` sits beside them (see the README).
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from omegaconf import OmegaConf

from mptex.scenes.assets import suite_path

__all__ = ["CONFIG_DIR", "EXPERIMENTS_DIR", "job_dirname", "register_experiments", "train_main"]

# configs/ and experiments/ at the repository root, next to the package (source checkout or
# editable install).
CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
EXPERIMENTS_DIR = CONFIG_DIR.parent / "experiments"

_PROG = "mptex-train"
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

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    try:
        metrics = train(cfg, run_dir)
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
        sys.exit(2)
    status = metrics["status"]
    detail = f" at iteration {metrics['diverged_at']}" if status == "diverged" else ""
    print(
        f"{_PROG}: {status}{detail}: PSNR {metrics['psnr']:.2f} dB "
        f"(constant-colour baseline {metrics['baseline_psnr']:.2f} dB), "
        f"{metrics['iterations']} iterations, {metrics['time_per_iter_s'] or 0:.4f} s/iteration"
    )
    print(f"{_PROG}: results in {run_dir}")
    print(f"{_PROG}: metrics in {run_dir / 'metrics.json'}")


def register_experiments(directory: Path = EXPERIMENTS_DIR) -> list[str]:
    """Make ``experiments/*.yaml`` the ``experiment`` config group (``+experiment=NAME``).

    Sweeps live beside ``configs/`` rather than in it (one place for what to run, one for how);
    Hydra finds a group only under a search-path root, so they are stored in its ConfigStore
    at the ``_global_`` package, as their ``# @package _global_`` header says.
    """
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    store, names = ConfigStore.instance(), []
    for path in sorted(directory.glob("*.yaml")):
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
    # amplifies such differences (docs/benchmarks.md, "Measurement protocol"). MKL reads the
    # variable at its first call, hence here, before any tensor work; a user's value is kept.
    os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")


def train_main() -> None:
    """``mptex-train``: Hydra app over ``configs/config.yaml``; see the module docstring."""
    _reproducible_blas()
    if not (CONFIG_DIR / "config.yaml").is_file():
        _error(
            f"configs not found at {CONFIG_DIR}; mptex-train needs a source checkout or an "
            "editable install (pip install -e .) so that configs/ sits next to the mptex package"
        )
        sys.exit(2)
    import hydra

    register_experiments()
    app = hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="config")(_run)
    app()


if __name__ == "__main__":
    train_main()
