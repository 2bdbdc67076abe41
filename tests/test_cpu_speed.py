"""benchmarks/cpu_speed.py, run as a user runs it: its tables print; its comparison of two
reports' results.json (mptex.report.compare) leaves out timings, paths and where the runs ran
(versions, threads, device) only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from mptex.report import result_differences

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "cpu_speed.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def test_results_comparison_ignores_timings_paths_and_environment_only():
    before = {"sweep_dir": "/a", "runs": [{"psnr": 52.5, "time_per_iter_s": 0.1,
                                          "peak_memory_bytes": 1, "run_dir": "x",
                                          "versions": {"torch": "2.13.0"}, "torch_threads": 1,
                                          "device": "cpu", "device_name": "a CPU"}],
              "summary": [{"verdict": "better", "speedup": 1.0}]}  # fmt: skip
    after = {"sweep_dir": "/b", "runs": [{"psnr": 52.5, "time_per_iter_s": 0.05,
                                         "peak_memory_bytes": 2, "run_dir": "y",
                                         "versions": {"torch": "2.14.0"}, "torch_threads": 2,
                                         "device": "cuda:0", "device_name": "a GPU"}],
             "summary": [{"verdict": "better", "speedup": 2.0}]}  # fmt: skip
    assert result_differences(before, after) == []
    after["runs"][0]["psnr"] = 52.500001
    assert result_differences(before, after) == ["/runs[0]/psnr: 52.5 -> 52.500001"]
    after["summary"].append({})
    assert "/summary: 1 vs 2 entries" in result_differences(before, after)
    after["runs"][0]["verdict"] = "worse"
    assert "/runs[0]/verdict: only in after" in result_differences(before, after)


def test_compare_command_exits_1_on_a_difference(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"runs": [{"psnr": 52.5, "time_per_iter_s": 0.1}]}))
    b.write_text(json.dumps({"runs": [{"psnr": 52.5, "time_per_iter_s": 0.2}]}))
    same = _run("compare", str(a), str(b))
    assert same.returncode == 0 and "0 differences in 1 runs" in same.stdout
    b.write_text(json.dumps({"runs": [{"psnr": 52.4, "time_per_iter_s": 0.2}]}))
    moved = _run("compare", str(a), str(b))
    assert moved.returncode == 1 and "/runs[0]/psnr: 52.5 -> 52.4" in moved.stdout


def test_the_mlp_and_grid_tables_run():
    mlp = _run("mlp", "--rows", "300", "--repeats", "1")
    assert mlp.returncode == 0, mlp.stderr
    assert "MLP f32 forward+backward" in mlp.stdout
    assert "MLP tcnn_fused forward+backward" in mlp.stdout
    grid = _run("grid", "--configs", "cpu", "--log2-points", "8", "--repeats", "1")
    assert grid.returncode == 0, grid.stderr
    floor = [line for line in grid.stdout.splitlines() if "gather + scatter floor" in line]
    assert len(floor) == 1 and "1.00x" in floor[0]


def test_the_sweep_tables_wall_time_counts_every_process_of_a_continued_run(tmp_path):
    # a run stopped and continued: 1 s in its last process, 5 s in all; a record from before
    # the totals of a run never resumed: its wall_time_s, whole
    totals = {"wall_time_s": 1.0, "wall_time_total_s": 5.0, "time_total_complete": True}
    for name, times in (("0_f32", totals), ("1_f32", {"wall_time_s": 2.0, "resume_count": 0})):
        (tmp_path / name).mkdir()
        record = {"status": "completed", "precision": "f32", "time_per_iter_s": 0.01, **times}
        (tmp_path / name / "metrics.json").write_text(json.dumps(record))
    sweep = _run("sweep", str(tmp_path))
    assert sweep.returncode == 0, sweep.stderr
    assert "sum of the runs' wall times: 7 s over 2 runs" in sweep.stdout
    # a record from before the totals of a resumed run: its last process's 2 s, and more
    # before it that no record holds (the precision search counts it so too)
    record["resume_count"] = 1
    (tmp_path / "1_f32" / "metrics.json").write_text(json.dumps(record))
    sweep = _run("sweep", str(tmp_path))
    assert "sum of the runs' wall times: at least 7 s over 2 runs" in sweep.stdout
    # a process of a run killed without a record
    record = {**record, **totals, "wall_time_total_s": 2.0, "time_total_complete": False}
    (tmp_path / "1_f32" / "metrics.json").write_text(json.dumps(record))
    sweep = _run("sweep", str(tmp_path))
    assert "sum of the runs' wall times: at least 7 s over 2 runs" in sweep.stdout
