"""The ablation report: aggregate a sweep's ``metrics.json`` files into tables and plots.

``mptex-report SWEEP_DIR`` (:func:`report_main`), or :class:`ReportCallback` at the end of a
Hydra multirun, reads every job under ``SWEEP_DIR`` and writes into it:

- ``report.md``: per scene, one row per precision arm: PSNR mean ± std over seeds, ΔPSNR and
  speed-up against ``f32``, time per iteration, peak memory, skipped steps, final loss scale,
  and how many runs completed, diverged, failed or were unavailable; the device and versions;
  an automatic reading (the fastest arm within 0.1 dB of ``f32``, the arms that diverged).
- ``results.csv`` / ``results.json``: the raw per-run numbers (and, in the JSON, the per-arm
  summary that the tables show).
- ``psnr_curves.png``, ``loss_scale.png``: validation PSNR and loss scale against iteration, one
  line per arm (mean over seeds) with a min–max band.
- ``images.png``: one validation view, the reference and every arm's prediction side by side,
  with a zoomed crop where the reference has the most fine detail.

A job is a directory holding ``metrics.json`` (written by ``mptex-train``) or, for a job that
crashed before writing it, a Hydra ``.hydra/`` folder: the arm, scene and seed then come from
``.hydra/config.yaml`` and the run counts as failed. Nothing here imports the training loop:
``metrics.json`` is the contract. Extra keys are ignored, except precision statistics whose
names end in ``grad_zero_frac`` / ``grad_subnormal_frac`` (at the top level or in ``history``
entries, nested dicts flattened with dots), which get their own table.
"""

from __future__ import annotations

import argparse
import atexit
import csv
import json
import math
import statistics
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

__all__ = [
    "STATUSES",
    "ARM_ORDER",
    "REFERENCE_ARM",
    "QUALITY_TOLERANCE_DB",
    "REPORT_FILES",
    "collect_runs",
    "summarize",
    "write_report",
    "report_main",
    "ReportCallback",
]

# Run outcomes. "unavailable": the arm needs a library or device this machine lacks (e.g.
# tcnn_fused without tinycudann); it is listed, never silently dropped.
STATUSES = ("completed", "diverged", "failed", "unavailable")
# Table order: the reference first, then the order of arms; unknown arms follow by name.
ARM_ORDER = ("f32", "nvdiffrec", "f16_naive", "f16_static", "f16_dynamic", "amp", "bf16",
             "per_layer", "tcnn_fused")  # fmt: skip
REFERENCE_ARM = "f32"
QUALITY_TOLERANCE_DB = 0.1  # "as good as f32": ΔPSNR >= -0.1 dB
REPORT_FILES = ("report.md", "results.csv", "results.json", "psnr_curves.png", "loss_scale.png",
                "images.png")  # fmt: skip

_UNDERFLOW_SUFFIXES = ("grad_zero_frac", "grad_subnormal_frac")
# Per-run scalars copied from metrics.json into results.csv/json, in column order.
_RUN_FIELDS = (
    "scene", "precision", "seed", "status", "psnr", "baseline_psnr", "time_per_iter_s",
    "peak_memory_bytes", "peak_memory_kind", "skipped_steps", "final_loss_scale", "iterations",
    "iterations_planned", "diverged_at", "failed_at", "error", "wall_time_s", "train_time_s",
    "n_params", "device", "device_name", "torch_threads", "run_dir",
)  # fmt: skip
# A backend a config asks for, the versions flag saying whether this machine has it, and the
# config key that mptex-train's error message names when it refuses the run for that reason.
_BACKEND_FLAGS = (
    (("precision", "mlp_backend"), "tcnn", "tcnn_available", "precision."),
    (("texture", "backend"), "tcnn", "tcnn_available", "texture.backend"),
    (("scene", "raster_backend"), "nvdiffrast", "nvdiffrast_available", "scene."),
)


# ----------------------------------------------------------------------------- reading runs
def _get(mapping: Any, path: Sequence[str]) -> Any:
    for key in path:
        if not isinstance(mapping, Mapping):
            return None
        mapping = mapping.get(key)
    return mapping


def _flatten(mapping: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


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


def _status(metrics: Mapping[str, Any]) -> str:
    status = metrics.get("status")
    # The loop refuses a config that needs a missing backend at start, as any config error; for
    # the report that arm is unavailable on this machine, not a failed run.
    if status == "failed" and metrics.get("failed_at") == "start" and _missing_backend(metrics):
        return "unavailable"
    return status if status in STATUSES else "failed"


def _underflow(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Precision statistics of one run: ``{name: value}`` for names ending in an underflow
    suffix; a top-level value wins, otherwise the mean over the history entries that have it."""

    def wanted(flat):
        return {k: v for k, v in flat.items() if k.endswith(_UNDERFLOW_SUFFIXES) and _is_number(v)}

    stats = wanted(_flatten({k: v for k, v in metrics.items() if k not in ("history", "config")}))
    samples: dict[str, list[float]] = {}
    for entry in metrics.get("history") or []:
        if isinstance(entry, Mapping):
            for key, value in wanted(_flatten(entry)).items():
                samples.setdefault(key, []).append(float(value))
    for key, values in samples.items():
        stats.setdefault(key, statistics.fmean(values))
    return dict(sorted(stats.items()))


def _read_yaml(path: Path) -> Any:
    from omegaconf import OmegaConf

    try:
        return OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception:  # a half-written or foreign file: the run stays anonymous, not fatal
        return None


def _from_metrics(path: Path) -> dict[str, Any]:
    try:
        metrics = json.loads(path.read_text())
        if not isinstance(metrics, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        # A truncated file is a failed run with a reason, not a report crash.
        run = _from_hydra(path.parent)
        run["error"] = f"unreadable metrics.json: {exc}"
        return run
    run = {key: metrics.get(key) for key in _RUN_FIELDS}
    run["status"] = _status(metrics)
    if run["status"] == "unavailable" and not run.get("error"):
        run["error"] = f"needs {_missing_backend(metrics)}"
    run["history"] = [h for h in metrics.get("history") or [] if isinstance(h, Mapping)]
    run["underflow"] = _underflow(metrics)
    run["versions"] = metrics.get("versions") or {}
    run["_from"] = "metrics.json"
    return run


def _from_hydra(job_dir: Path) -> dict[str, Any]:
    """A job without metrics.json: identity from Hydra's saved config, status failed."""
    config = _read_yaml(job_dir / ".hydra" / "config.yaml") or {}
    run: dict[str, Any] = dict.fromkeys(_RUN_FIELDS)
    run.update(
        scene=_get(config, ("scene", "name")),
        precision=_get(config, ("precision", "name")),
        seed=_get(config, ("train", "seed")),
        status="failed",
        error="no metrics.json: the job crashed or was killed before writing it",
        history=[],
        underflow={},
        versions={},
        _from=".hydra",
    )
    return run


def collect_runs(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """Every job under ``sweep_dir`` (searched recursively), sorted by scene, arm, seed.

    Returns:
        one dict per job: the scalars of :data:`_RUN_FIELDS` (``None`` where absent), ``status``
        normalised to :data:`STATUSES`, ``history`` (list of dicts), ``underflow`` (name ->
        value), ``versions``; ``run_dir`` is relative to ``sweep_dir``.
    """
    sweep_dir = Path(sweep_dir).resolve()
    job_dirs: set[Path] = set()
    for marker in ("metrics.json", ".hydra"):
        for path in sweep_dir.rglob(marker):
            # submitit's own folders hold pickles and logs, not jobs.
            if ".submitit" not in path.relative_to(sweep_dir).parts:
                job_dirs.add(path.parent)
    runs = []
    for job_dir in sorted(job_dirs):
        metrics = job_dir / "metrics.json"
        if metrics.is_file():
            run = _from_metrics(metrics)
        elif job_dir == sweep_dir or not (job_dir / ".hydra" / "config.yaml").is_file():
            continue  # the sweep's own folder or an unrelated .hydra: not a job
        else:
            run = _from_hydra(job_dir)
        run["run_dir"] = str(job_dir.relative_to(sweep_dir)) or "."
        run["scene"] = run.get("scene") or "unknown"
        run["precision"] = run.get("precision") or "unknown"
        runs.append(run)
    runs.sort(key=lambda r: (str(r["scene"]), _arm_key(r["precision"]), _seed_key(r["seed"])))
    return runs


def _arm_key(arm: str) -> tuple[int, str]:
    return (ARM_ORDER.index(arm) if arm in ARM_ORDER else len(ARM_ORDER), str(arm))


def _seed_key(seed: Any) -> tuple[int, str]:
    return (seed, "") if isinstance(seed, int) else (sys.maxsize, str(seed))


# ----------------------------------------------------------------------------- aggregation
def _mean(values: Iterable[float]) -> float | None:
    values = [float(v) for v in values if _is_number(v)]
    return statistics.fmean(values) if values else None


def _std(values: Iterable[float]) -> float | None:
    # Sample standard deviation over seeds; undefined (None) for fewer than two runs.
    values = [float(v) for v in values if _is_number(v)]
    return statistics.stdev(values) if len(values) >= 2 else None


def summarize(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One summary per (scene, arm), in table order.

    PSNR, time, memory, skipped steps and loss scale are over the arm's completed runs only (a
    diverged run's last PSNR says nothing about the arm's quality; it is counted instead).
    ``delta_psnr_db`` and ``speedup`` compare with the scene's ``f32`` summary and are ``None``
    without completed ``f32`` runs. ``speedup`` = f32 time per iteration / the arm's.

    Returns:
        dicts with ``scene``, ``precision``, ``n_runs``, one count per status in
        :data:`STATUSES`, ``seeds``, ``psnr_mean``, ``psnr_std``, ``delta_psnr_db``,
        ``time_per_iter_s``, ``speedup``, ``peak_memory_bytes`` (max), ``peak_memory_kind``,
        ``skipped_steps`` (mean), ``final_loss_scale`` (list of distinct values),
        ``diverged_at`` (list), ``errors`` (distinct messages) and ``underflow`` (name -> mean).
    """
    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["scene"], run["precision"]), []).append(run)
    summaries = []
    for (scene, arm), group in sorted(
        groups.items(), key=lambda kv: (kv[0][0], _arm_key(kv[0][1]))
    ):
        done = [r for r in group if r["status"] == "completed"]
        # Diverged runs' statistics are kept: they show why the arm diverged.
        measured = [r for r in group if r["status"] in ("completed", "diverged")]
        underflow_keys = sorted({k for r in measured for k in r.get("underflow", {})})
        summary = {
            "scene": scene,
            "precision": arm,
            "n_runs": len(group),
            **{status: sum(r["status"] == status for r in group) for status in STATUSES},
            "seeds": [r["seed"] for r in group],
            "psnr_mean": _mean(r["psnr"] for r in done),
            "psnr_std": _std(r["psnr"] for r in done),
            "time_per_iter_s": _mean(r["time_per_iter_s"] for r in done),
            "peak_memory_bytes": max((r["peak_memory_bytes"] for r in done
                                      if _is_number(r["peak_memory_bytes"])), default=None),
            "peak_memory_kind": next((r["peak_memory_kind"] for r in done
                                      if r.get("peak_memory_kind")), None),
            "skipped_steps": _mean(r["skipped_steps"] for r in done),
            "final_loss_scale": sorted({float(r["final_loss_scale"]) for r in done
                                        if _is_number(r["final_loss_scale"])}),
            "diverged_at": [r["diverged_at"] for r in group if r["status"] == "diverged"],
            "errors": sorted({str(r["error"]) for r in group
                              if r["status"] in ("failed", "unavailable") and r.get("error")}),
            "underflow": {k: _mean(r["underflow"].get(k) for r in measured)
                          for k in underflow_keys},
        }  # fmt: skip
        summaries.append(summary)
    for summary in summaries:
        ref = next((s for s in summaries if s["scene"] == summary["scene"]
                    and s["precision"] == REFERENCE_ARM), None)  # fmt: skip
        ok = ref is not None and summary["psnr_mean"] is not None
        summary["delta_psnr_db"] = (summary["psnr_mean"] - ref["psnr_mean"]
                                    if ok and ref["psnr_mean"] is not None else None)  # fmt: skip
        t, t_ref = summary["time_per_iter_s"], ref["time_per_iter_s"] if ref else None
        summary["speedup"] = t_ref / t if _is_number(t) and t > 0 and _is_number(t_ref) else None
    return summaries


def _reading(scene_summaries: Sequence[Mapping[str, Any]]) -> list[str]:
    """The automatic reading of one scene's table, as Markdown bullet lines."""
    lines = []
    ref = next((s for s in scene_summaries if s["precision"] == REFERENCE_ARM), None)
    if ref is None or ref["psnr_mean"] is None:
        lines.append(f"- No completed `{REFERENCE_ARM}` run: ΔPSNR and speed-up are undefined.")
    else:
        good = [s for s in scene_summaries if s["delta_psnr_db"] is not None
                and s["delta_psnr_db"] >= -QUALITY_TOLERANCE_DB
                and _is_number(s["time_per_iter_s"])]  # fmt: skip
        if good:
            best = min(good, key=lambda s: s["time_per_iter_s"])
            lines.append(
                f"- Fastest arm within {QUALITY_TOLERANCE_DB} dB of `{REFERENCE_ARM}`: "
                f"**`{best['precision']}`** ({_fmt_signed(best['delta_psnr_db'])} dB, "
                f"{_fmt(best['time_per_iter_s'] * 1e3, '.1f')} ms/iteration, "
                f"{_fmt(best['speedup'], '.2f')}x `{REFERENCE_ARM}`'s speed)."
            )
        worse = [s for s in scene_summaries if s["delta_psnr_db"] is not None
                 and s["delta_psnr_db"] < -QUALITY_TOLERANCE_DB]  # fmt: skip
        if worse:
            items = ", ".join(f"`{s['precision']}` ({_fmt_signed(s['delta_psnr_db'])} dB)"
                              for s in worse)  # fmt: skip
            lines.append(f"- Arms more than {QUALITY_TOLERANCE_DB} dB below "
                         f"`{REFERENCE_ARM}`: {items}.")  # fmt: skip
    diverged = [s for s in scene_summaries if s["diverged"]]
    if diverged:
        items = ", ".join(
            f"`{s['precision']}` ({s['diverged']}/{s['n_runs']} runs, at iteration "
            f"{', '.join(str(i) for i in s['diverged_at'])})"
            for s in diverged
        )
        lines.append(f"- Diverged: {items}.")
    else:
        lines.append("- No arm diverged.")
    for status in ("failed", "unavailable"):
        hit = [s for s in scene_summaries if s[status]]
        if hit:
            items = "; ".join(
                f"`{s['precision']}` ({s[status]}/{s['n_runs']} runs: "
                f"{' / '.join(s['errors']) or 'no message'})"
                for s in hit
            )
            lines.append(f"- {status.capitalize()}: {items}.")
    return lines


# ----------------------------------------------------------------------------- formatting
def _fmt(value: Any, spec: str) -> str:
    return format(value, spec) if _is_number(value) else "–"


def _fmt_signed(value: Any) -> str:
    return _fmt(value, "+.2f")


def _fmt_scale(values: Sequence[float]) -> str:
    if not values:
        return "–"
    text = [f"{v:g}" for v in (values[0], values[-1])]
    return text[0] if len(values) == 1 else f"{text[0]}–{text[1]}"


def _psnr_cell(summary: Mapping[str, Any]) -> str:
    if summary["psnr_mean"] is None:
        return "–"
    std = summary["psnr_std"]
    return f"{summary['psnr_mean']:.2f}" + (f" ± {std:.2f}" if std is not None else "")


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _environment(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    def distinct(key):
        return sorted({str(r[key]) for r in runs if r.get(key) is not None})

    versions: dict[str, set[str]] = {}
    for run in runs:
        for key, value in (run.get("versions") or {}).items():
            versions.setdefault(key, set()).add(str(value))
    version_text = ", ".join(f"{k} {' / '.join(sorted(v))}" for k, v in sorted(versions.items()))
    return [
        f"- Device: {' / '.join(distinct('device')) or '–'} "
        f"({' / '.join(distinct('device_name')) or 'unknown'}); torch threads per run: "
        f"{' / '.join(distinct('torch_threads')) or '–'}",
        f"- Versions: {version_text or '–'}",
    ]


def _markdown(sweep_dir: Path, runs, summaries, plots: Mapping[str, bool]) -> str:
    counts = {status: sum(r["status"] == status for r in runs) for status in STATUSES}
    lines = [
        "# mptex precision ablation",
        "",
        f"Sweep `{sweep_dir}`: {len(runs)} runs, "
        + ", ".join(f"{n} {status}" for status, n in counts.items())
        + ".",
        "",
        *_environment(runs),
        "",
    ]
    header = ["arm", "PSNR (dB)", f"Δ vs {REFERENCE_ARM} (dB)", "ms / iter",
              f"speed-up vs {REFERENCE_ARM}", "peak mem (MiB)", "skipped steps",
              "final loss scale", "runs ok / div / fail / n.a."]  # fmt: skip
    for scene in sorted({s["scene"] for s in summaries}):
        scene_summaries = [s for s in summaries if s["scene"] == scene]
        scene_runs = [r for r in runs if r["scene"] == scene]
        iters = sorted({r["iterations_planned"] for r in scene_runs
                        if r.get("iterations_planned") is not None})  # fmt: skip
        seeds = sorted({str(r["seed"]) for r in scene_runs})
        lines += [f"## Scene `{scene}`", "",
                  f"Iterations: {', '.join(map(str, iters)) or '–'}; seeds: {', '.join(seeds)}.",
                  ""]  # fmt: skip
        rows = []
        for s in scene_summaries:
            rows.append([
                f"`{s['precision']}`", _psnr_cell(s), _fmt_signed(s["delta_psnr_db"]),
                _fmt(s["time_per_iter_s"] * 1e3 if _is_number(s["time_per_iter_s"]) else None,
                     ".1f"),
                _fmt(s["speedup"], ".2f"),
                _fmt(s["peak_memory_bytes"] / 2**20 if _is_number(s["peak_memory_bytes"])
                     else None, ".0f"),
                _fmt(s["skipped_steps"], "g"), _fmt_scale(s["final_loss_scale"]),
                " / ".join(str(s[k]) for k in STATUSES),
            ])  # fmt: skip
        lines += _table(header, rows) + ["", *_reading(scene_summaries), ""]
        underflow_keys = sorted({k for s in scene_summaries for k in s["underflow"]
                                 if _shown_in_report(k)})  # fmt: skip
        if underflow_keys:
            lines += ["Gradient underflow (fraction of the gradient elements that the compute "
                      "dtype flushed to zero or holds as subnormals; mean over the sampled "
                      "iterations of completed and diverged runs):", ""]  # fmt: skip
            rows = [[f"`{s['precision']}`", *(_fmt(s["underflow"].get(k), ".3g")
                                               for k in underflow_keys)]
                    for s in scene_summaries]  # fmt: skip
            lines += _table(["arm", *(f"`{k}`" for k in underflow_keys)], rows) + [""]
    kinds = sorted({r["peak_memory_kind"] for r in runs if r.get("peak_memory_kind")})
    lines += [
        "## How to read this",
        "",
        f"- PSNR: nvdiffrec's validation PSNR (sRGB, clamped) of completed runs, mean ± sample "
        f"std over seeds; Δ and speed-up are against `{REFERENCE_ARM}` on the same scene "
        "(speed-up > 1: faster). ms / iter: median time per training iteration, averaged over "
        "seeds.",
        f"- Peak memory: the largest over the arm's runs ({', '.join(kinds) or 'unknown'}). "
        "cuda_max_allocated: the GPU allocator's peak during the run. run_peak_rss: the "
        "process's resident memory sampled during the run; it includes what the process held "
        "before (Python, torch, earlier jobs under Hydra's basic launcher), so compare arms "
        "within one sweep. process_peak_rss (no /proc): the process's lifetime peak; compare it "
        "across arms only with a launcher that runs each job in its own process (submitit).",
        "- runs: completed / diverged (non-finite loss without loss scaling, or too many skipped "
        "steps in a row) / failed (config error or crash) / not available on this machine.",
        "- Raw numbers: `results.csv`, `results.json`. Plots: "
        + ", ".join(f"`{name}`" for name, made in plots.items() if made)
        + ".",
        "",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- plots
def _figure(n_panels: int, width: float = 6.0, height: float = 4.0):
    # matplotlib's object API with the Agg canvas: headless, and no global pyplot state that
    # could disturb a user's own figures when this runs inside their process.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * n_panels, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, n_panels, squeeze=False)[0]
    return fig, axes


def _curve(runs: Sequence[Mapping[str, Any]], key: str):
    """Iterations and per-iteration mean/min/max of ``history[key]`` over runs."""
    by_iter: dict[int, list[float]] = {}
    for run in runs:
        for entry in run["history"]:
            if _is_number(entry.get("iteration")) and _is_number(entry.get(key)):
                by_iter.setdefault(int(entry["iteration"]), []).append(float(entry[key]))
    its = sorted(by_iter)
    return (its, [statistics.fmean(by_iter[i]) for i in its], [min(by_iter[i]) for i in its],
            [max(by_iter[i]) for i in its])  # fmt: skip


def _plot_history(path: Path, runs, key: str, ylabel: str, log2: bool = False) -> bool:
    scenes = sorted({r["scene"] for r in runs})
    plotted = [r for r in runs if r["status"] in ("completed", "diverged") and r["history"]]
    if not plotted:
        return False
    fig, axes = _figure(len(scenes))
    for ax, scene in zip(axes, scenes):
        arms = sorted({r["precision"] for r in plotted if r["scene"] == scene}, key=_arm_key)
        for arm in arms:
            its, mean, lo, hi = _curve([r for r in plotted if r["scene"] == scene
                                        and r["precision"] == arm], key)  # fmt: skip
            if not its:
                continue
            (line,) = ax.plot(its, mean, label=arm, marker="." if len(its) < 30 else None)
            ax.fill_between(its, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
        if log2:
            ax.set_yscale("log", base=2)
        ax.set(title=f"scene {scene}", xlabel="iteration", ylabel=ylabel)
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize="small")
    fig.suptitle(f"{ylabel}: mean over seeds, band min–max")
    fig.savefig(path, dpi=100)
    return True


def _read_image(path: Path):
    import imageio.v3 as iio
    import numpy as np

    image = np.asarray(iio.imread(path))
    if image.ndim == 2:
        image = np.stack([image] * 3, axis=-1)
    return image[..., :3]


def _detail_window(image, size: int) -> tuple[int, int]:
    """Top-left (row, col) of the ``size`` x ``size`` window with the most fine detail (the
    largest sum of absolute Laplacian): where a precision loss in fine levels shows first."""
    import numpy as np

    gray = image.astype(np.float64).mean(-1)
    lap = np.zeros_like(gray)
    lap[1:-1, 1:-1] = np.abs(4 * gray[1:-1, 1:-1] - gray[:-2, 1:-1] - gray[2:, 1:-1]
                             - gray[1:-1, :-2] - gray[1:-1, 2:])  # fmt: skip
    integral = np.pad(lap.cumsum(0).cumsum(1), ((1, 0), (1, 0)))
    sums = (integral[size:, size:] - integral[:-size, size:] - integral[size:, :-size]
            + integral[:-size, :-size])  # fmt: skip
    row, col = np.unravel_index(int(np.argmax(sums)), sums.shape)
    return int(row), int(col)


def _first_image(run: Mapping[str, Any], sweep_dir: Path) -> Path | None:
    images = sorted((sweep_dir / run["run_dir"] / "images").glob("*.png"))
    return images[0] if images else None


def _plot_images(path: Path, sweep_dir: Path, runs) -> bool:
    """Per scene: the reference and each arm's first validation image (lowest seed among the
    completed runs), full view on top and the detail crop below."""
    from matplotlib.patches import Rectangle

    blocks = []
    for scene in sorted({r["scene"] for r in runs}):
        panels = []
        for run in runs:  # runs are sorted by arm, then seed
            if run["scene"] != scene or run["status"] != "completed":
                continue
            if any(p[0] == run["precision"] for p in panels):
                continue
            image_path = _first_image(run, sweep_dir)
            if image_path is None:
                continue
            side = _read_image(image_path)  # the loop writes [reference | prediction]
            width = side.shape[1] // 2
            if not panels:
                panels.append(("reference", side[:, :width], None))
            panels.append((run["precision"], side[:, width : 2 * width], run["psnr"]))
        if panels:
            blocks.append((scene, panels))
    if not blocks:
        return False
    n_cols = max(len(panels) for _, panels in blocks)
    fig, _ = _figure(1)
    fig.clear()
    fig.set_size_inches(2.2 * n_cols, 4.6 * len(blocks))
    grid = fig.subplots(2 * len(blocks), n_cols, squeeze=False)
    for ax in grid.flat:
        ax.axis("off")
    for b, (scene, panels) in enumerate(blocks):
        ref = panels[0][1]
        size = max(8, min(ref.shape[:2]) // 4)
        row, col = _detail_window(ref, size)
        for c, (name, image, value) in enumerate(panels):
            top, bottom = grid[2 * b, c], grid[2 * b + 1, c]
            top.imshow(image, interpolation="nearest")
            top.add_patch(Rectangle((col - 0.5, row - 0.5), size, size, fill=False,
                                    edgecolor="red", linewidth=1))  # fmt: skip
            label = name if value is None else f"{name}\n{_fmt(value, '.2f')} dB"
            top.set_title(f"{scene}: {label}" if c == 0 else label, fontsize="small")
            bottom.imshow(image[row : row + size, col : col + size], interpolation="nearest")
            bottom.set_title("zoom (red box)", fontsize="x-small")
    fig.savefig(path, dpi=100)
    return True


def _shown_in_report(key: str) -> bool:
    # Weight gradients of each layer, and the gradient reaching the encoder's output and table.
    # Left out: out_grad_zero_frac of MLP layers (mostly ReLU's zeros, not underflow) and the
    # table's grad_zero_frac (entries no point touched).
    if key.startswith("net"):
        return ".out_grad_" not in key
    return key in ("encoder.out_grad_subnormal_frac", "encoder.grad_subnormal_frac")


# ----------------------------------------------------------------------------- writing
def _csv_value(value: Any) -> Any:
    return "" if value is None else value


def write_report(sweep_dir: str | Path) -> dict[str, Path]:
    """Aggregate the jobs under ``sweep_dir`` and write the report files into it.

    Never raises for a bad job (failed, diverged, crashed without ``metrics.json``, unreadable
    file): it becomes a row. A plot with nothing to show is not written.

    Returns:
        file name -> path of each file written (see :data:`REPORT_FILES`).

    Raises:
        FileNotFoundError: ``sweep_dir`` does not exist or holds no job.
    """
    sweep_dir = Path(sweep_dir).resolve()
    if not sweep_dir.is_dir():
        raise FileNotFoundError(f"{sweep_dir}: no such directory")
    runs = collect_runs(sweep_dir)
    if not runs:
        raise FileNotFoundError(f"{sweep_dir}: no job directories (metrics.json or .hydra/)")
    summaries = summarize(runs)
    written: dict[str, Path] = {}

    path = sweep_dir / "results.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(_RUN_FIELDS)
        writer.writerows([_csv_value(run.get(k)) for k in _RUN_FIELDS] for run in runs)
    written[path.name] = path

    path = sweep_dir / "results.json"
    plain_runs = [{k: v for k, v in run.items() if k not in ("history",) and not k.startswith("_")}
                  for run in runs]  # fmt: skip
    document = {"sweep_dir": str(sweep_dir), "runs": plain_runs, "summary": summaries}
    path.write_text(json.dumps(document, indent=2, allow_nan=False) + "\n")
    written[path.name] = path

    plots = {
        "psnr_curves.png": _plot_history(
            sweep_dir / "psnr_curves.png", runs, "psnr", "validation PSNR (dB)"
        ),  # fmt: skip
        "loss_scale.png": _plot_history(
            sweep_dir / "loss_scale.png", runs, "loss_scale", "loss scale", log2=True
        ),  # fmt: skip
        "images.png": _plot_images(sweep_dir / "images.png", sweep_dir, runs),
    }
    written.update({name: sweep_dir / name for name, made in plots.items() if made})

    path = sweep_dir / "report.md"
    path.write_text(_markdown(sweep_dir, runs, summaries, plots))
    written[path.name] = path
    return written


def report_main(argv: Sequence[str] | None = None) -> int:
    """``mptex-report SWEEP_DIR``: write the report files into SWEEP_DIR, print report.md's path."""
    parser = argparse.ArgumentParser(
        prog="mptex-report",
        description="Aggregate an mptex sweep (every metrics.json under SWEEP_DIR) into "
        "report.md, results.csv/json and plots, written into SWEEP_DIR.",
    )
    parser.add_argument("sweep_dir", type=Path, help="a multirun directory (or any folder of runs)")
    args = parser.parse_args(argv)
    try:
        written = write_report(args.sweep_dir)
    except FileNotFoundError as exc:
        print(f"mptex-report: error: {exc}", file=sys.stderr)
        return 2
    print(f"mptex-report: report in {written['report.md']}")
    return 0


class ReportCallback(Callback):
    """Hydra callback: write the report into ``hydra.sweep.dir`` when a multirun ends.

    Registered in ``configs/config.yaml`` (``hydra.callbacks.report``). Hydra skips
    ``on_multirun_end`` when a job raised, so the report is also written at interpreter exit
    if the multirun did not end normally: a crashed job never costs the others' report.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._pending: Path | None = None

    def on_multirun_start(self, config, **kwargs: Any) -> None:
        if self.enabled:
            self._pending = Path(str(config.hydra.sweep.dir)).resolve()
            atexit.register(self._write_pending)

    def on_multirun_end(self, config, **kwargs: Any) -> None:
        if self.enabled:
            self._pending = Path(str(config.hydra.sweep.dir)).resolve()
            self._write_pending()

    def _write_pending(self) -> None:
        sweep_dir, self._pending = self._pending, None
        if sweep_dir is None:
            return
        try:
            written = write_report(sweep_dir)
        except Exception as exc:  # the sweep's results are on disk; mptex-report can retry
            print(f"mptex-report: no report for {sweep_dir}: {type(exc).__name__}: {exc}",
                  file=sys.stderr)  # fmt: skip
            return
        print(f"mptex-report: report in {written['report.md']}", flush=True)


if __name__ == "__main__":
    sys.exit(report_main())
