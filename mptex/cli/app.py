"""What every Hydra command of mptex shares: exit statuses, the experiments group, the sweep
directories' names, and starting the app over mptex's configs."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from omegaconf import OmegaConf

from mptex._paths import CONFIG_DIR, EXPERIMENTS_DIR
from mptex.scenes.assets import suite_path
from mptex.train.runinfo import reproducible_blas

__all__ = ["EXIT_CODES", "job_dirname", "register_experiments", "run_hydra_app"]

# The commands' exit statuses (mptex.cli.train's docstring).
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


def run_hydra_app(task, prog: str) -> None:
    """Run ``task(cfg)`` as a Hydra app over mptex's ``configs/config.yaml`` with the
    experiments registered; the common start of ``mptex-train`` and ``mptex-search``."""
    reproducible_blas()
    if not (CONFIG_DIR / "config.yaml").is_file():
        print(
            f"{prog}: error: configs not found at {CONFIG_DIR}: this mptex is neither a wheel "
            "install (mptex/configs) nor a source checkout (configs/ beside mptex/); reinstall it",
            file=sys.stderr,
        )
        sys.exit(EXIT_CODES["error"])
    import hydra

    register_experiments()
    app = hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="config")(task)
    app()
