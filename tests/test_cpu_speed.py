"""benchmarks/cpu_speed.py: its tables run, and its results.json comparison ignores timings only."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "cpu_speed.py"
_SPEC = importlib.util.spec_from_file_location("cpu_speed", _PATH)
cpu_speed = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(cpu_speed)  # a script directory, not a package


def test_results_comparison_ignores_timings_and_paths_only():
    before = {"sweep_dir": "/a", "runs": [{"psnr": 52.5, "time_per_iter_s": 0.1,
                                          "peak_memory_bytes": 1, "run_dir": "x"}],
              "summary": [{"verdict": "better", "speedup": 1.0}]}  # fmt: skip
    after = {"sweep_dir": "/b", "runs": [{"psnr": 52.5, "time_per_iter_s": 0.05,
                                         "peak_memory_bytes": 2, "run_dir": "y"}],
             "summary": [{"verdict": "better", "speedup": 2.0}]}  # fmt: skip
    assert cpu_speed.result_differences(before, after) == []
    after["runs"][0]["psnr"] = 52.500001
    assert cpu_speed.result_differences(before, after) == ["/runs[0]/psnr: 52.5 -> 52.500001"]
    after["summary"].append({})
    assert "/summary: 1 vs 2 entries" in cpu_speed.result_differences(before, after)


def test_the_mlp_and_grid_tables_run():
    rows = cpu_speed.bench_mlp(300, repeats=1)
    assert [row[0] for row in rows] == [
        "MLP f32 forward+backward",
        "MLP tcnn_fused forward+backward",
    ]
    rows = cpu_speed.bench_grid(["cpu"], [8], repeats=1)
    assert rows[0][0] == "grid cpu gather + scatter floor" and rows[0][3] == "1.00x"
    assert len(rows) == 3
