"""Reading a sweep: its jobs, each job's own config, and the keys the sweep varied.

A *job* is a directory holding ``metrics.json`` (written by ``mptex-train``) or, for a job that
crashed before writing it, a Hydra ``.hydra/config.yaml``. A *sweep* is a directory holding
Hydra's ``multirun.yaml`` (written by every ``mptex-train -m``), or, for a folder without one
(hand-made, or copied jobs), the folder itself.

What makes two runs comparable is read from each job's own saved config (``metrics.json``
``config``, else ``.hydra/config.yaml``), flattened to dotted keys. The *swept keys* are the
keys with two or more distinct values among the sweep's runs, except :data:`NOT_SWEPT` (the seed,
which the statistics pair over, and switches that do not change a result). Runs with equal
values of every swept key form one *group* (one table row); one (group, seed) counts once.

Nothing here imports the training loop: ``metrics.json`` is the contract (docs/metrics.md).
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from mptex.collapse import classify_collapse, classify_partly_stuck
from mptex.numbers import is_number

__all__ = [
    "STATUSES",
    "REFERENCE_ARM",
    "ARM_ORDER",
    "NOT_SWEPT",
    "NOT_SWEPT_GROUPS",
    "RUN_FIELDS",
    "partial_keys",
    "SweepLayoutError",
    "find_sweeps",
    "job_dirs",
    "collect_runs",
    "planned_jobs",
    "planned_swept_keys",
    "unstarted_jobs",
    "concurrent_jobs",
    "swept_keys",
    "shown_keys",
    "flatten_config",
    "group_runs",
    "seed_key",
    "sorted_seeds",
    "is_number",
]

# Run outcomes. "collapsed": completed, but its output saturated at the wrong colour or its PSNR
# sat flat below the constant-colour baseline (mptex.collapse): counted apart from the
# completed runs and out of their statistics. "unavailable": the arm needs a library or device
# this machine lacks (tcnn_fused without tinycudann); it is listed, never silently dropped. An
# unreadable metrics.json is a failed run (its error says why, its path is listed).
STATUSES = ("completed", "collapsed", "diverged", "failed", "unavailable")
REFERENCE_ARM = "f32"
# Table order: the reference first, then the registered arms in a fixed order; unknown arms
# follow by name.
ARM_ORDER = ("f32", "nvdiffrec", "f16_naive", "f16_static", "f16_dynamic", "amp", "bf16",
             "per_layer", "tcnn_fused", "fp8", "fp8_current", "fp8_rowwise", "int8_qat", "fp8_qat",
             "fp8_rowwise_qat")  # fmt: skip
# Config keys that never separate rows. train.seed: seeds are what the statistics pair over.
# train.resume / progress / tensorboard / checkpoint_interval / n_val_images / stop_signals: how
# a run was driven and what it wrote besides its results, not what it computed (a resumed job,
# or a rerun that checkpoints more often, would otherwise become a row of its own; a run's
# weights, Adam state, history and PSNR do not depend on them).
NOT_SWEPT = ("train.seed", "train.resume", "train.progress", "train.tensorboard",
             "train.checkpoint_interval", "train.n_val_images", "train.stop_signals")  # fmt: skip
# Per-run scalars copied from metrics.json into results.csv/json, in column order.
RUN_FIELDS = (
    "scene", "precision", "seed", "status", "psnr", "baseline_psnr", "time_per_iter_s",
    "peak_memory_bytes", "peak_memory_kind", "start_peak_memory_bytes", "skipped_steps",
    "final_loss_scale", "iterations",
    "iterations_planned", "val_views", "val_spp", "diverged_at", "failed_at", "error",
    "wall_time_s", "train_time_s", "wall_time_total_s", "train_time_total_s",
    "time_total_complete", "n_params", "device", "device_name", "torch_threads",
    "encoder_backend", "mlp_backend", "fp8_gemm_backend", "raster_backend", "bake_psnr",
    "run_dir",
)  # fmt: skip
# Config groups that never separate rows: how a finished run was exported, not what it trained.
NOT_SWEPT_GROUPS = ("export.",)
_UNDERFLOW_SUFFIXES = ("grad_zero_frac", "grad_subnormal_frac")
# Quantisation statistics of the arms below f16 (PrecisionMonitor's net.<i>.q_<name>): counts
# since the start of the run (the last sample holds the total), the largest amax, and means of
# the rest (relative errors, underflow fractions, scales) over the sampled iterations.
_QUANT_MARK = ".q_"
_QUANT_LAST = ("_overflows", "_nonfinite")
_QUANT_MAX = ("_amax",)
# A backend a config asks for, the versions flag saying whether this machine has it, and the
# config key that mptex-train's error message names when it refuses the run for that reason.
_BACKEND_FLAGS = (
    (("precision", "mlp_backend"), "tcnn", "tcnn_available", "precision."),
    (("texture", "backend"), "tcnn", "tcnn_available", "texture.backend"),
    (("scene", "raster_backend"), "nvdiffrast", "nvdiffrast_available", "scene."),
)


class SweepLayoutError(ValueError):
    """A folder that is not one sweep: several sweeps mixed with loose jobs, or nothing."""


# ----------------------------------------------------------------------------- sweeps
def _skipped(path: Path, root: Path) -> bool:
    # submitit's own folders hold pickles and logs, not jobs.
    return ".submitit" in path.relative_to(root).parts


def _job_dirs(root: Path) -> list[Path]:
    dirs: set[Path] = set()
    for marker in ("metrics.json", ".hydra"):
        for path in root.rglob(marker):
            if not _skipped(path, root):
                dirs.add(path.parent)
    jobs = []
    for job in sorted(dirs):
        if (job / "metrics.json").is_file():
            jobs.append(job)
        elif job != root and (job / ".hydra" / "config.yaml").is_file():
            jobs.append(job)  # crashed before metrics.json (the sweep's own folder is no job)
    return jobs


def job_dirs(folder: str | os.PathLike) -> list[Path]:
    """The job directories under ``folder``, sorted: each holding ``metrics.json``, or
    ``.hydra/config.yaml`` for a job that crashed before writing it (``folder`` itself only for
    ``metrics.json``); submitit's own folders are skipped. Paths start with ``folder`` as
    given."""
    return _job_dirs(Path(folder))


def find_sweeps(folder: str | os.PathLike) -> list[Path]:
    """The sweeps under ``folder``, each reported on its own.

    Rule: a directory holding ``multirun.yaml`` is one sweep. ``folder`` itself holding one, or
    holding none anywhere below, is one sweep (``[folder]``). Otherwise every directory below
    holding one is a sweep, and jobs outside all of them are refused.

    Raises:
        FileNotFoundError: ``folder`` does not exist.
        SweepLayoutError: ``folder`` holds sweeps and also jobs that belong to none of them
            (the message names both), or holds no job at all.
    """
    folder = Path(folder).resolve()
    if folder.is_file():
        raise FileNotFoundError(f"{folder}: a file, not a directory (give the sweep's folder)")
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such directory")
    if (folder / "multirun.yaml").is_file():
        return [folder]
    roots = sorted(p.parent for p in folder.rglob("multirun.yaml") if not _skipped(p, folder))
    if not roots:
        if not _job_dirs(folder):
            raise SweepLayoutError(f"{folder}: no job directories (metrics.json or .hydra/)")
        return [folder]
    loose = [j for j in _job_dirs(folder) if not any(r in j.parents or r == j for r in roots)]
    if loose:
        names = ", ".join(str(j.relative_to(folder)) for j in loose[:5])
        more = f" and {len(loose) - 5} more" if len(loose) > 5 else ""
        sweeps = ", ".join(str(r.relative_to(folder)) for r in roots)
        raise SweepLayoutError(
            f"{folder}: holds the sweeps {sweeps} and jobs outside them ({names}{more}); "
            "run mptex-report on each sweep directory"
        )
    return roots


# ----------------------------------------------------------------------------- one run
def _get(mapping: Any, path: Sequence[str]) -> Any:
    for key in path:
        if not isinstance(mapping, Mapping):
            return None
        mapping = mapping.get(key)
    return mapping


def flatten_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A nested run config as the report reads it: dotted keys (``train.seed``) to values."""
    return _flatten(config)


def _flatten(mapping: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def _missing_backend(metrics: Mapping[str, Any]) -> str | None:
    """The backend a run's config needs, its machine lacks (per ``versions``) and its error
    names; else None (a run refused for another bad key is a failed run)."""
    versions = metrics.get("versions") or {}
    error = str(metrics.get("error") or "")
    for path, wanted, flag, key in _BACKEND_FLAGS:
        if (
            _get(metrics.get("config"), path) == wanted
            and versions.get(flag) is False
            and error.startswith(key)
        ):
            return wanted
    return None


def _status(metrics: Mapping[str, Any]) -> tuple[str, str | None]:
    """The report's status of a run (before the collapse check of :func:`_read_job`) and, where
    it differs from the recorded one, why."""
    status = metrics.get("status")
    # The loop refuses a config that needs a missing backend at start, as any config error; for
    # the report that arm is unavailable on this machine, not a failed run.
    if status == "failed" and metrics.get("failed_at") == "start" and _missing_backend(metrics):
        return "unavailable", None
    if status == "interrupted":
        # Stopped by a signal and not (yet) resumed: no result; its reason is in _read_job.
        return "failed", None
    if status == "completed" and not is_number(metrics.get("psnr")):
        # An older loop wrote NaN weights as "completed, psnr null": the run did not produce a
        # texture, so it is counted with the diverged runs, never dropped from the row unseen.
        return "diverged", "recorded as completed, but its PSNR is not a finite number"
    if status not in STATUSES:
        return "failed", f"unknown status {status!r}"
    return status, None


def _underflow(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Precision statistics of one run: ``{name: value}`` for names ending in an underflow
    suffix; a top-level value wins, otherwise the mean over the history entries that have it."""

    def wanted(flat):
        return {k: v for k, v in flat.items() if k.endswith(_UNDERFLOW_SUFFIXES) and is_number(v)}

    stats = wanted(_flatten({k: v for k, v in metrics.items() if k not in ("history", "config")}))
    samples: dict[str, list[float]] = {}
    for entry in metrics.get("history") or []:
        if isinstance(entry, Mapping):
            for key, value in wanted(_flatten(entry)).items():
                samples.setdefault(key, []).append(float(value))
    for key, values in samples.items():
        stats.setdefault(key, statistics.fmean(values))
    return dict(sorted(stats.items()))


def _quantization(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Quantisation statistics of one run, ``{"net.<i>.q_<name>": value}`` from the history's
    sampled entries: counts (``_overflows``, ``_nonfinite``) their last value, ``_amax`` the
    largest, the others their mean."""
    samples: dict[str, list[float]] = {}
    for entry in metrics.get("history") or []:
        if isinstance(entry, Mapping):
            for key, value in entry.items():
                if _QUANT_MARK in str(key) and is_number(value):
                    samples.setdefault(str(key), []).append(float(value))
    stats = {}
    for key, values in samples.items():
        if key.endswith(_QUANT_LAST):
            stats[key] = values[-1]
        elif key.endswith(_QUANT_MAX):
            stats[key] = max(values)
        else:
            stats[key] = statistics.fmean(values)
    return dict(sorted(stats.items()))


def planned_jobs(sweep_dir: str | os.PathLike) -> int | None:
    """How many jobs the sweep in ``sweep_dir`` was to run, from its ``multirun.yaml``: the
    product of the value counts of its swept overrides (``hydra.sweeper.params``, then the
    command line's, which win for the same key: Hydra's basic sweeper), or None where that file
    is missing, unreadable or names another sweeper."""
    counts = _planned_value_counts(sweep_dir)
    return None if counts is None else math.prod(counts.values())


def planned_swept_keys(sweep_dir: str | os.PathLike) -> list[str] | None:
    """The keys the sweep in ``sweep_dir`` was to sweep over more than one value, as its
    ``multirun.yaml`` names them (``precision``, ``train.seed``), in their order there; None
    where :func:`planned_jobs` cannot tell. An incomplete sweep's runs may vary none of them
    yet (one run of a precision x seed sweep)."""
    counts = _planned_value_counts(sweep_dir)
    return None if counts is None else [key for key, n in counts.items() if n > 1]


def _planned_value_counts(sweep_dir: str | os.PathLike) -> dict[str, int] | None:
    """Each override key of the sweep's ``multirun.yaml`` with its number of values (1 for a
    plain override), or None where that file is missing, unreadable, names another sweeper
    or holds an override this Hydra cannot parse."""
    lines = _basic_sweep_lines(sweep_dir)
    if lines is None:
        return None
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        counts: dict[str, int] = {}
        for override in OverridesParser.create().parse_overrides(lines):
            sweep = override.is_sweep_override()
            counts[override.get_key_element()] = (
                len(list(override.sweep_string_iterator())) if sweep else 1
            )
    except Exception:  # an override this Hydra cannot parse: unknown, not a guess
        return None
    return counts


def _basic_sweep_lines(sweep_dir: str | os.PathLike) -> list[str] | None:
    """The overrides Hydra's basic sweeper expanded into the sweep's jobs (its
    ``hydra.sweeper.params`` as ``key=value``, then the command line's), from
    ``multirun.yaml``; None where that file is missing, unreadable or names another sweeper."""
    hydra = _multirun_hydra(sweep_dir)
    if hydra is None:
        return None
    sweeper = hydra.get("sweeper") or {}
    if not str(sweeper.get("_target_", "")).endswith("BasicSweeper"):
        return None
    params = sweeper.get("params") or {}
    task = (hydra.get("overrides") or {}).get("task") or []
    return [f"{key}={value}" for key, value in params.items()] + list(task)


def unstarted_jobs(
    sweep_dir: str | os.PathLike, run_dirs: Sequence[str | os.PathLike]
) -> tuple[int, int] | None:
    """``(jobs without a run directory, jobs planned)`` of the sweep whose ``multirun.yaml``
    is in ``sweep_dir``, or None where :func:`planned_jobs` cannot tell.

    A folder may hold the runs of earlier sweeps too (a seed added with
    ``hydra.callbacks.fresh_sweep_dir.enabled=false``: ``multirun.yaml`` is the last sweep's),
    so a planned job counts as started when a run directory's ``.hydra/overrides.yaml`` holds
    its overrides (Hydra's basic sweeper expands them the same way; more may be there: a job
    continued alone with ``train.resume=true``); a run directory without
    a readable ``overrides.yaml`` (a hand-made or damaged one) counts as one started job.

    Args:
        sweep_dir: the sweep's folder.
        run_dirs: its run directories (relative to ``sweep_dir`` or absolute).
    """
    lines = _basic_sweep_lines(sweep_dir)
    if lines is None:
        return None
    try:
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
        from hydra.core.override_parser.overrides_parser import OverridesParser

        overrides = OverridesParser.create().parse_overrides(lines)
        jobs = [frozenset(job) for job in BasicSweeper.split_arguments(overrides, None)[0]]
    except Exception:  # an override this Hydra cannot parse: unknown, not a guess
        return None
    started, anonymous = [], 0
    for run_dir in run_dirs:
        written = _read_yaml(Path(sweep_dir) / run_dir / ".hydra" / "overrides.yaml")
        if isinstance(written, list) and all(isinstance(item, str) for item in written):
            started.append(frozenset(written))
        else:
            anonymous += 1
    # A job continued alone may have been given more overrides (train.resume=true): its own
    # are among them.
    missing = sum(not any(job <= run for run in started) for job in jobs)
    return max(missing - anonymous, 0), len(jobs)


def concurrent_jobs(sweep_dir: str | os.PathLike) -> int | None:
    """How many of the sweep's jobs ran at a time on one machine, from its ``multirun.yaml``:
    the joblib launcher's ``n_jobs`` (-1 or below: as many as the machine's cores, returned as
    0); for submitit's local launcher, which starts every job of a batch at once as a process
    of its own, the sweeper's ``max_batch_size`` or else the sweep's job count
    (:func:`planned_jobs`); 1 for a launcher that runs jobs one after another on the machine
    (Hydra's basic one) or each on an allocation of its own (submitit's Slurm one); None where
    the file is missing or unreadable, names another launcher, or the count is unknown."""
    hydra = _multirun_hydra(sweep_dir)
    launcher = hydra.get("launcher") if hydra is not None else None
    if not isinstance(launcher, Mapping):
        return None
    target = str(launcher.get("_target_", ""))
    if target.endswith("JoblibLauncher"):
        n_jobs = launcher.get("n_jobs")
        if isinstance(n_jobs, int) and not isinstance(n_jobs, bool):
            return n_jobs if n_jobs > 0 else 0
        return None
    if target.endswith(("BasicLauncher", "SlurmLauncher")):
        return 1
    if target.endswith("submitit_launcher.LocalLauncher"):
        batch = (hydra.get("sweeper") or {}).get("max_batch_size")
        if isinstance(batch, int) and not isinstance(batch, bool) and batch > 0:
            jobs = planned_jobs(sweep_dir)
            return batch if jobs is None else min(batch, jobs)
        return planned_jobs(sweep_dir)
    return None


def _multirun_hydra(sweep_dir: str | os.PathLike) -> Mapping[str, Any] | None:
    """The ``hydra`` group of the sweep's ``multirun.yaml`` (its sweeper and launcher), or None
    where the file is missing, unreadable or has none."""
    config = _read_yaml(Path(sweep_dir) / "multirun.yaml")
    hydra = config.get("hydra") if isinstance(config, Mapping) else None
    return hydra if isinstance(hydra, Mapping) else None


def _read_yaml(path: Path) -> Any:
    from omegaconf import OmegaConf

    try:
        conf = OmegaConf.load(path)
    except Exception:  # a half-written or foreign file: the run stays anonymous, not fatal
        return None
    try:
        return OmegaConf.to_container(conf, resolve=True)
    except Exception:  # an interpolation that needs Hydra's runtime: keep it as written
        return OmegaConf.to_container(conf, resolve=False)


def _reject_constant(name: str) -> Any:
    # json accepts NaN / Infinity by default; they are not JSON, and a report that read them
    # would crash when it writes results.json. Refuse them where they are read.
    raise ValueError(f"{name} is not valid JSON (metrics.json must be strict JSON)")


def _read_metrics(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    try:
        metrics = json.loads(path.read_text(), parse_constant=_reject_constant)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return None, f"unreadable metrics.json: {exc}"
    if not isinstance(metrics, dict):
        return None, "unreadable metrics.json: not a JSON object"
    return metrics, None


def _empty_run() -> dict[str, Any]:
    run: dict[str, Any] = dict.fromkeys(RUN_FIELDS)
    run.update(history=[], underflow={}, quantization={}, versions={}, config=None, note=None,
               unreadable=False, collapsed=False, collapse=None, partly_stuck=None,
               saturation=None, stop_requested=None)  # fmt: skip
    return run


def _from_hydra(job_dir: Path, run: dict[str, Any]) -> None:
    config = _read_yaml(job_dir / ".hydra" / "config.yaml")
    if isinstance(config, Mapping):
        run["config"] = _flatten(config)
        run.update(
            scene=_get(config, ("scene", "name")),
            precision=_get(config, ("precision", "name")),
            seed=_get(config, ("train", "seed")),
        )


def _read_job(job_dir: Path) -> dict[str, Any]:
    run = _empty_run()
    metrics_path = job_dir / "metrics.json"
    if not metrics_path.is_file():
        _from_hydra(job_dir, run)
        why = "no metrics.json: the job crashed or was killed before writing it"
        run.update(status="failed", _from=".hydra", error=why)
        return run
    metrics, error = _read_metrics(metrics_path)
    if metrics is None:
        _from_hydra(job_dir, run)  # the arm and seed may still be known from Hydra's config
        run.update(status="failed", error=error, unreadable=True, _from=".hydra")
        return run
    run.update({key: metrics.get(key) for key in RUN_FIELDS})
    # How many views the PSNR averages (scene.n_val_views): on few views a handful of edge
    # pixels can decide it (docs/archive/validation-views.md), so the report says.
    per_image = metrics.get("psnr_per_image")
    run["val_views"] = len(per_image) if isinstance(per_image, list) and per_image else None
    # ... and how each pixel is scored: train.val_spp (1, the default, also for runs older
    # than the key: the pixel's centre; k: the k x k box-filtered mean).
    config = metrics.get("config")
    train_cfg = config.get("train") if isinstance(config, Mapping) else None
    spp = train_cfg.get("val_spp", 1) if isinstance(train_cfg, Mapping) else 1
    run["val_spp"] = spp if run["val_views"] is not None else None
    backends = metrics.get("backends")
    if isinstance(backends, Mapping):  # which implementation ran (e.g. tcnn, or mptex's twin)
        run["encoder_backend"], run["mlp_backend"] = backends.get("encoder"), backends.get("mlp")
        run["raster_backend"] = backends.get("raster")  # absent from runs older than the key
        run["fp8_gemm_backend"] = backends.get("fp8_gemm")  # FP8 arms only
    export = metrics.get("export")
    if isinstance(export, Mapping):  # exported runs (export.enabled=true): the bake's PSNR
        run["bake_psnr"] = export.get("psnr_baked_vs_neural")
    run["status"], run["note"] = _status(metrics)
    if metrics.get("status") == "interrupted":
        run["error"] = (f"interrupted by {metrics.get('signal')} after iteration "
                        f"{metrics.get('interrupted_at')} and not resumed")  # fmt: skip
        tries = metrics.get("start_failures")
        if isinstance(tries, list) and tries and isinstance(tries[-1], Mapping):
            # the attempts to continue it that failed before their first iteration: the last
            run["error"] += (f"; {len(tries)} attempt{'s' * (len(tries) != 1)} to continue it "
                             f"failed at start, the last: {tries[-1].get('error')}")  # fmt: skip
    if run["status"] == "completed":
        run["collapse"] = classify_collapse(metrics)
        if run["collapse"] is not None:  # the note is the evidence the report prints
            run.update(status="collapsed", collapsed=True, note=run["collapse"]["reason"])
        else:  # counted as completed, named by the report
            run["partly_stuck"] = classify_partly_stuck(metrics)
    run["saturation"] = metrics.get("saturation")
    run["stop_requested"] = _stop_requested(metrics)
    if run["status"] == "unavailable" and not run.get("error"):
        run["error"] = f"needs {_missing_backend(metrics)}"
    config = metrics.get("config")
    if isinstance(config, Mapping):
        run["config"] = _flatten(config)
    else:  # an older metrics.json without its config: Hydra's copy, if the job has one
        config = _read_yaml(job_dir / ".hydra" / "config.yaml")
        run["config"] = _flatten(config) if isinstance(config, Mapping) else {}
    run["history"] = [h for h in metrics.get("history") or [] if isinstance(h, Mapping)]
    run["underflow"] = _underflow(metrics)
    run["quantization"] = _quantization(metrics)
    run["versions"] = metrics.get("versions") or {}
    run["_from"] = "metrics.json"
    return run


def _stop_requested(metrics: Mapping[str, Any]) -> dict[str, str] | None:
    """metrics.json's ``stop_requested`` (a stop signal that came once the run's last iteration
    had begun: the run ended as it would have) as ``{"signal", "during"}`` of text, or None."""
    stop = metrics.get("stop_requested")
    if not isinstance(stop, Mapping):
        return None
    return {key: str(stop.get(key) or "unknown") for key in ("signal", "during")}


def _arm_key(arm: Any) -> tuple[int, str]:
    return (ARM_ORDER.index(arm) if arm in ARM_ORDER else len(ARM_ORDER), str(arm))


def seed_key(seed: Any) -> tuple[int, str]:
    """Sort key of a seed: non-negative integers by value (2 before 10), anything else after."""
    return (0, f"{seed:020d}") if isinstance(seed, int) and seed >= 0 else (1, str(seed))


def sorted_seeds(seeds: Iterable[Any]) -> list[str]:
    """The distinct seeds (None left out) as text, by value (:func:`seed_key`: 2 before 10)."""
    ordered = sorted({s for s in seeds if s is not None}, key=seed_key)
    return list(dict.fromkeys(map(str, ordered)))


def collect_runs(sweep_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every job under ``sweep_dir`` (searched recursively), sorted by arm, seed and path.

    Returns:
        one dict per job: the scalars of :data:`RUN_FIELDS` (``None`` where absent; ``run_dir``
        relative to ``sweep_dir``), ``status`` normalised to :data:`STATUSES`, ``note`` (why the
        status differs from the recorded one, or None), ``unreadable`` (metrics.json could not
        be parsed), ``config`` (flattened dotted keys, or None when no config was readable),
        ``history`` (list of dicts), ``underflow`` (name -> value), ``quantization`` (the
        quantised arms' ``net.<i>.q_<name>`` -> value), ``versions``, ``collapsed`` (bool),
        ``collapse`` (the evidence of :func:`mptex.collapse.classify_collapse`, or None),
        ``partly_stuck`` (:func:`mptex.collapse.classify_partly_stuck`'s evidence, or None),
        ``saturation`` (metrics.json's, or None) and ``stop_requested`` (metrics.json's
        ``{"signal", "during"}``, or None).
    """
    sweep_dir = Path(sweep_dir).resolve()
    runs = []
    for job_dir in _job_dirs(sweep_dir):
        run = _read_job(job_dir)
        run["run_dir"] = str(job_dir.relative_to(sweep_dir)) or "."
        config = run["config"]
        if config is not None:
            # The identity a key-less hand-made config lacks comes from metrics.json's fields.
            for key, field in (("precision.name", "precision"), ("scene.name", "scene"),
                               ("train.seed", "seed")):  # fmt: skip
                if config.get(key) is None and run.get(field) is not None:
                    config[key] = run[field]
        run["scene"] = run.get("scene") or "unknown"
        run["precision"] = run.get("precision") or "unknown"
        runs.append(run)
    # train.device: auto in a config no check resolved (Hydra's copy of a job that wrote no
    # metrics.json; a run refused at start by an mptex that recorded its config as given): the
    # device the sweep's other runs resolved it to, where they agree, so that it is not a swept
    # value of its own. (Keys such a config lacks make no swept value: only the values present
    # are compared.)
    devices = {(r["config"] or {}).get("train.device") for r in runs}
    resolved = devices - {"auto", None}
    if "auto" in devices and len(resolved) == 1:
        for run in runs:
            if (run["config"] or {}).get("train.device") == "auto":
                run["config"]["train.device"] = next(iter(resolved))
    runs.sort(key=lambda r: (_arm_key(r["precision"]), seed_key(r["seed"]), r["run_dir"]))
    return runs


# ----------------------------------------------------------------------------- grouping
def _hashable(value: Any) -> Any:
    # Lists (betas, mlp_dtypes) and dicts compare by content.
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, sort_keys=True, default=str)
    return value


def swept_keys(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """Config keys with two or more distinct values among the runs that have a config, except
    :data:`NOT_SWEPT` and the groups of :data:`NOT_SWEPT_GROUPS`; sorted, ``precision.name``
    first."""
    values: dict[str, set[Any]] = {}
    for run in runs:
        for key, value in (run.get("config") or {}).items():
            values.setdefault(key, set()).add(_hashable(value))
    ignored = [k for k in values if k in NOT_SWEPT or k.startswith(NOT_SWEPT_GROUPS)]
    keys = [k for k, v in values.items() if len(v) > 1 and k not in ignored]
    return sorted(keys, key=lambda k: (k != "precision.name", k))


# Groups whose keys every run of one mptex version records (a scene's keys depend on its kind:
# a mesh scene has a path, the built-in one none).
_PROTOCOL_GROUPS = ("train.", "texture.")


def partial_keys(runs: Sequence[Mapping[str, Any]]) -> dict[str, list[Any]]:
    """Keys of the ``train`` and ``texture`` groups that some runs' configs have and others lack
    (runs of another mptex version, a hand-made config): key -> the distinct values of the runs
    that have it. With one value such a key splits no rows (:func:`swept_keys` compares the
    values present), so the runs without it are compared with the others as if they agreed;
    with several, it is swept and the runs without it are compared only among themselves."""
    configs = [r["config"] for r in runs if r.get("config") is not None]
    present: dict[str, list[Any]] = {}
    for config in configs:
        for key, value in config.items():
            if key.startswith(_PROTOCOL_GROUPS) and key not in NOT_SWEPT:
                seen = present.setdefault(key, [])
                if _hashable(value) not in map(_hashable, seen):
                    seen.append(value)
    return {k: v for k, v in sorted(present.items())
            if sum(k in c for c in configs) < len(configs)}  # fmt: skip


def shown_keys(runs: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> list[str]:
    """The swept keys a table shows: ``G.x`` is left out when it is a function of ``G.name``
    over these runs (the arm's loss scaling follows from the arm; a mesh scene's resolution
    from the scene), so that a table of arms does not repeat each arm's definition."""
    shown = []
    for key in keys:
        group, _, leaf = key.rpartition(".")
        name_key = f"{group}.name"
        if group and leaf != "name" and name_key in keys:
            seen: dict[Any, set[Any]] = {}
            for run in runs:
                config = run.get("config") or {}
                seen.setdefault(_hashable(config.get(name_key)), set()).add(
                    _hashable(config.get(key))
                )
            if all(len(v) == 1 for v in seen.values()):
                continue
        shown.append(key)
    return shown


def _natural_key(text: str) -> list[Any]:
    """``text`` split into text and numbers, the numbers compared as numbers."""
    return [(0, int(part)) if part.isdecimal() else (1, part)
            for part in re.split(r"(\d+)", text) if part]  # fmt: skip


def group_runs(
    runs: Sequence[dict[str, Any]],
) -> tuple[list[str], list[list[dict[str, Any]]], list[dict[str, Any]], list[dict[str, Any]]]:
    """Split a sweep's runs into rows.

    Returns:
        ``(keys, groups, duplicates, unidentified)``: the swept keys; one list of runs per
        distinct combination of their values (in arm order); the runs not counted because
        another run has the same values and seed (each gets ``duplicate_of``): of such runs one
        that ran is counted before one that failed to run (``failed``, ``unavailable``: a crash
        or a missing library says nothing about the arm), then the first by ``run_dir`` with the
        numbers in it compared as numbers (Hydra's job ``5_...`` before ``12_...``). A diverged
        or collapsed run is a result: a later re-run of its seed does not replace it;
        and the runs without any readable config (unreadable metrics.json and no ``.hydra``),
        which belong to no row and are listed by path.
    """
    identified = [r for r in runs if r.get("config") is not None]
    unidentified = [r for r in runs if r.get("config") is None]
    keys = swept_keys(identified)
    groups: dict[tuple, list[dict[str, Any]]] = {}
    seen: dict[tuple, dict[str, Any]] = {}
    duplicates = []
    for run in sorted(identified, key=lambda r: (r["status"] in ("failed", "unavailable"),
                                                 _natural_key(r["run_dir"]))):  # fmt: skip
        row = tuple(_hashable(run["config"].get(k)) for k in keys)
        run["keys"] = {k: run["config"].get(k) for k in keys}
        first = seen.setdefault((row, _hashable(run["seed"])), run)
        if first is not run:
            run["duplicate_of"] = first["run_dir"]
            duplicates.append(run)
            continue
        groups.setdefault(row, []).append(run)
    ordered = sorted(
        groups.values(),
        key=lambda g: (
            [str(g[0]["keys"].get(k)) for k in keys if not k.startswith("precision.")],
            _arm_key(g[0]["precision"]),
            [str(g[0]["keys"].get(k)) for k in keys],
        ),
    )
    for group in ordered:
        group.sort(key=lambda r: seed_key(r["seed"]))
    return keys, ordered, duplicates, unidentified
