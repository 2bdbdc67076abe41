"""The ablation report on hand-made sweep directories (numbers chosen so results are exact)."""

import json
import math
from pathlib import Path

import pytest

from mptex.report import REPORT_FILES, collect_runs, report_main, summarize, write_report


def _metrics(arm, seed, psnr=30.0, t=0.1, status="completed", scene="builtin", **extra):
    history = [
        {"iteration": 10, "loss": 0.1, "psnr": psnr - 1, "loss_scale": 1.0, "skipped": False},
        {"iteration": 20, "loss": 0.05, "psnr": psnr, "loss_scale": 1.0, "skipped": False,
         "net.0.grad_zero_frac": 0.25},
    ]  # fmt: skip
    metrics = {
        "status": status, "psnr": psnr if status == "completed" else None, "baseline_psnr": 20.0,
        "precision": arm, "scene": scene, "seed": seed, "iterations": 20,
        "iterations_planned": 20, "time_per_iter_s": t, "peak_memory_bytes": 2**20 * seed + 2**20,
        "peak_memory_kind": "process_peak_rss", "skipped_steps": 0, "final_loss_scale": 1.0,
        "diverged_at": None, "error": None, "failed_at": None, "device": "cpu",
        "versions": {"torch": "x", "tcnn_available": False, "nvdiffrast_available": False},
        "history": history, "config": {"precision": {"name": arm, "mlp_backend": "torch"}},
    }  # fmt: skip
    metrics.update(extra)
    return metrics


def _write(root: Path, name: str, metrics: dict) -> None:
    job = root / name
    job.mkdir(parents=True)
    (job / "metrics.json").write_text(json.dumps(metrics))


@pytest.fixture
def sweep(tmp_path):
    _write(tmp_path, "0", _metrics("f32", 0, psnr=30.0, t=0.10))
    _write(tmp_path, "1", _metrics("f32", 1, psnr=32.0, t=0.30))
    _write(tmp_path, "2", _metrics("bf16", 0, psnr=29.0, t=0.05))
    _write(tmp_path, "3", _metrics("bf16", 1, psnr=29.0, t=0.15))
    _write(tmp_path, "4", _metrics("f16_naive", 0, status="diverged", diverged_at=3))
    why = "precision.name: precision arm 'tcnn_fused' needs tinycudann and a CUDA device"
    tcnn = _metrics("tcnn_fused", 0, status="failed", failed_at="start", error=why)
    tcnn["config"]["precision"]["mlp_backend"] = "tcnn"
    _write(tmp_path, "5", tcnn)
    crashed = tmp_path / "6" / ".hydra"  # killed before writing metrics.json
    crashed.mkdir(parents=True)
    (crashed / "config.yaml").write_text(
        "precision:\n  name: amp\nscene:\n  name: builtin\ntrain:\n  seed: 0\n"
    )
    return tmp_path


def test_summary_numbers(sweep):
    summary = {s["precision"]: s for s in summarize(collect_runs(sweep))}
    assert summary["f32"]["psnr_mean"] == 31.0
    assert summary["f32"]["psnr_std"] == pytest.approx(math.sqrt(2.0))  # sample std of 30, 32
    assert summary["bf16"]["delta_psnr_db"] == pytest.approx(-2.0)
    # mean time 0.2 (f32) vs 0.1 (bf16): 2x faster
    assert summary["bf16"]["speedup"] == pytest.approx(2.0)
    assert summary["f16_naive"]["diverged"] == 1 and summary["f16_naive"]["diverged_at"] == [3]
    assert summary["tcnn_fused"]["unavailable"] == 1 and summary["tcnn_fused"]["failed"] == 0
    assert summary["amp"]["failed"] == 1
    assert summary["f32"]["underflow"]["net.0.grad_zero_frac"] == pytest.approx(0.25)


def test_report_files_and_rows(sweep):
    written = write_report(sweep)
    # images.png needs the jobs' validation PNGs (the real sweep test checks it).
    assert set(REPORT_FILES) - {"images.png"} <= set(written)
    report = (sweep / "report.md").read_text()
    for arm in ("f32", "bf16", "f16_naive", "tcnn_fused", "amp"):
        assert f"| `{arm}` |" in report
    assert "Diverged: `f16_naive`" in report
    assert "Unavailable: `tcnn_fused`" in report
    assert "Failed: `amp`" in report
    assert "| `bf16` | 29.00 ± 0.00 | -2.00 |" in report


def test_results_json_equals_the_jobs_metrics(sweep):
    write_report(sweep)
    results = json.loads((sweep / "results.json").read_text())
    for job in sweep.iterdir():
        if (job / "metrics.json").is_file():
            metrics = json.loads((job / "metrics.json").read_text())
            key = (metrics["precision"], metrics["seed"])
            run = next(r for r in results["runs"] if (r["precision"], r["seed"]) == key)
            for field in ("psnr", "time_per_iter_s", "peak_memory_bytes", "skipped_steps"):
                assert run[field] == metrics[field]
    assert (sweep / "results.csv").read_text().count("\n") == 1 + 7


def test_no_reference_arm_and_all_failed(tmp_path):
    _write(tmp_path, "0", _metrics("bf16", 0, status="failed", error="boom", failed_at=2))
    write_report(tmp_path)
    report = (tmp_path / "report.md").read_text()
    assert "Failed: `bf16` (1/1 runs: boom)" in report


def test_cli_errors_on_missing_directory(tmp_path, capsys):
    assert report_main([str(tmp_path / "nope")]) == 2
    assert "no such directory" in capsys.readouterr().err


def test_a_tcnn_run_refused_for_another_key_is_failed_not_unavailable(tmp_path):
    metrics = _metrics("tcnn_fused", 0, status="failed", failed_at="start",
                       error="train.iterations: expected an integer >= 0, got -1")  # fmt: skip
    metrics["config"]["precision"]["mlp_backend"] = "tcnn"
    _write(tmp_path, "0", metrics)
    (summary,) = summarize(collect_runs(tmp_path))
    assert summary["failed"] == 1 and summary["unavailable"] == 0
