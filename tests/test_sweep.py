"""Sweeps through the real `mptex-train -m` CLI, with each launcher, ending in the report."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mptex.report import REPORT_FILES

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "train=tiny", "texture=tiny", "scene.resolution=24", "scene.n_train_views=2",
    "scene.n_val_views=1", "train.iterations=4", "train.val_interval=2", "train.threads=1",
]  # fmt: skip


def _sweep(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "mptex.cli", "-m", *TINY,
               f"hydra.sweep.dir={tmp_path / 'sweep'}", *overrides]  # fmt: skip
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def _results(tmp_path: Path) -> list[dict]:
    return json.loads((tmp_path / "sweep" / "results.json").read_text())["runs"]


def _check_report_matches_jobs(tmp_path: Path) -> None:
    runs = {(r["precision"], r["seed"]): r for r in _results(tmp_path)}
    for metrics_file in (tmp_path / "sweep").rglob("metrics.json"):
        metrics = json.loads(metrics_file.read_text())
        run = runs[(metrics["precision"], metrics["seed"])]
        for field in ("status", "psnr", "time_per_iter_s", "skipped_steps", "final_loss_scale"):
            assert run[field] == metrics[field], field


def test_basic_launcher_two_arms_one_seed(tmp_path):
    result = _sweep(tmp_path, "precision=f32,f16_dynamic", "train.seed=0")
    sweep = tmp_path / "sweep"
    assert f"report in {sweep / 'report.md'}" in result.stdout
    for name in REPORT_FILES:
        assert (sweep / name).is_file(), name
    report = (sweep / "report.md").read_text()
    assert "| `f32` |" in report and "| `f16_dynamic` |" in report
    _check_report_matches_jobs(tmp_path)


@pytest.mark.parametrize("launcher", ["submitit_local", "joblib"])
def test_plugin_launchers(tmp_path, launcher):
    _sweep(tmp_path, "precision=f32,bf16", f"hydra/launcher={launcher}")
    runs = _results(tmp_path)
    assert sorted(r["precision"] for r in runs) == ["bf16", "f32"]
    assert all(r["status"] == "completed" for r in runs)
    _check_report_matches_jobs(tmp_path)


def test_a_failing_job_is_listed_and_the_report_still_written(tmp_path):
    # The mesh scene's file is there but not a mesh, which only its job finds (the sweep's
    # check before its first job reads the config and looks for the files, it does not parse
    # them); tcnn_fused runs on the twin (its backend is "auto"); the unavailable path (a
    # config that needs tinycudann) is test_report's.
    (tmp_path / "broken.obj").write_text("v 0 0 0\nv 1 0 0\nf 1 2 3\n")  # no third vertex
    _sweep(tmp_path, "precision=f32,tcnn_fused", "scene=builtin,mesh",
           f"scene.path={tmp_path / 'broken.obj'}")  # fmt: skip
    runs = _results(tmp_path)
    status = {(r["scene"], r["precision"]): r["status"] for r in runs}
    assert status[("builtin", "f32")] == "completed"
    assert status[("mesh", "f32")] == "failed"
    assert status[("builtin", "tcnn_fused")] == "completed"
    report = (tmp_path / "sweep" / "report.md").read_text()
    assert "## Scene `mesh`" in report and "Failed: `f32`" in report


def test_job_dirs_name_the_swept_values_and_a_second_sweep_is_refused(tmp_path):
    _sweep(tmp_path, "precision=f32", "train.seed=0,1")
    sweep = tmp_path / "sweep"
    jobs = sorted(p.name for p in sweep.iterdir() if (p / "metrics.json").is_file())
    assert len(jobs) == 2 and all("precision=f32" in j for j in jobs)
    for num, job in enumerate(jobs):
        assert job.startswith(f"{num}_") and f"train.seed={num}" in job, job
    before = {j: (sweep / j / "metrics.json").read_bytes() for j in jobs}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "mptex.cli", "-m", *TINY, f"hydra.sweep.dir={sweep}",
               "precision=f32", "train.seed=0,1"]  # fmt: skip
    second = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert second.returncode == 2, second.stdout + second.stderr
    assert "hydra.sweep.dir" in second.stderr and "already holds a sweep" in second.stderr
    assert {j: (sweep / j / "metrics.json").read_bytes() for j in jobs} == before


def test_the_report_adjustment_is_a_sweep_setting_checked_before_any_job(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "mptex.cli", "-m", *TINY, "precision=f32,bf16",
               f"hydra.sweep.dir={tmp_path / 'bad'}",
               "hydra.callbacks.report.adjust=holm"]  # fmt: skip
    bad = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert bad.returncode == 2, bad.stdout + bad.stderr
    assert ("mptex-train: error: hydra.callbacks.report.adjust: expected one of none, "
            "bonferroni, got 'holm'") in bad.stderr  # fmt: skip
    assert not list((tmp_path / "bad").rglob("metrics.json"))  # no job ran
    _sweep(tmp_path, "precision=f32,bf16", "train.seed=0,1,2",
           "hydra.callbacks.report.adjust=bonferroni")  # fmt: skip
    document = json.loads((tmp_path / "sweep" / "results.json").read_text())
    assert document["intervals"]["adjust"] == "bonferroni"
    assert document["intervals"]["comparisons"] == 1  # bf16 against f32: no family to adjust
    assert "[95% CI]" in (tmp_path / "sweep" / "report.md").read_text()
