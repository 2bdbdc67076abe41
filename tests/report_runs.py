"""Hand-made run directories for the report's tests: a job's ``metrics.json`` as the training
loop writes it (the fields the report reads), with its saved config."""

import json
from pathlib import Path


def metrics(arm, seed, psnr=30.0, t=0.1, status="completed", scene="builtin", config=None,
            baseline=20.0, **extra):  # fmt: skip
    """One job's metrics.json: a run of ``arm`` at ``seed`` with that outcome; ``config``
    (``{"group.key": value}``) adds to its saved config, ``extra`` to its fields."""
    history = [
        {"iteration": 10, "loss": 0.1, "psnr": psnr - 1, "loss_scale": 1.0, "skipped": False},
        {"iteration": 20, "loss": 0.05, "psnr": psnr, "loss_scale": 1.0, "skipped": False,
         "net.0.grad_zero_frac": 0.25},
    ]  # fmt: skip
    full = {
        "precision": {"name": arm, "mlp_backend": "torch", "loss_scaling": "none",
                      "static_loss_scale": 128.0},
        "scene": {"name": scene}, "train": {"seed": seed, "lr": 0.01},
    }  # fmt: skip
    for key, value in (config or {}).items():
        group, leaf = key.split(".", 1)
        full.setdefault(group, {})[leaf] = value
    record = {
        "status": status, "psnr": psnr if status == "completed" else None,
        "baseline_psnr": baseline, "precision": arm, "scene": scene, "seed": seed,
        "iterations": 20, "iterations_planned": 20, "time_per_iter_s": t,
        "peak_memory_bytes": 2**20 * seed + 2**20, "peak_memory_kind": "process_peak_rss",
        "skipped_steps": 0, "final_loss_scale": 1.0, "diverged_at": None, "error": None,
        "failed_at": None, "device": "cpu",
        "versions": {"torch": "x", "tcnn_available": False, "nvdiffrast_available": False},
        "history": history, "config": full,
    }  # fmt: skip
    record.update(extra)
    return record


def write_run(root: Path, name: str, metrics: dict | str) -> Path:
    """``root/name/metrics.json`` holding ``metrics`` (a dict as JSON, a string as it is)."""
    job = root / name
    job.mkdir(parents=True)
    text = metrics if isinstance(metrics, str) else json.dumps(metrics)
    (job / "metrics.json").write_text(text)
    return job
