"""The commands' arguments, exit codes, one-line errors and outputs at their edges.

``mptex-check``, ``mptex-rescore``, ``mptex-report`` and ``mptex-export`` called in-process on
hand-built inputs: one tiny training run (shared by the module), hand-made sweeps, and scores
whose tables are computed by hand.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from report_runs import metrics as sweep_metrics
from report_runs import write_run

import mptex.diagnostics
from mptex.cli import CONFIG_DIR, rescore
from mptex.cli.check import check_main
from mptex.cli.export import export_main
from mptex.cli.report import report_main
from mptex.train import train


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A finished 4-iteration bf16 run of seed 3 on a small torus knot, and its metrics."""
    overrides = [
        "texture=tiny", "train=tiny", "train.iterations=4", "train.val_interval=0",
        "scene.resolution=24", "scene.n_train_views=2", "scene.n_val_views=2",
        "scene.tubular_segments=48", "scene.radial_segments=8", "train.device=cpu",
        "precision=bf16", "train.seed=3",
    ]  # fmt: skip
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    run_dir = tmp_path_factory.mktemp("tiny") / "run"
    metrics = train(cfg, run_dir)
    return run_dir, metrics


def _copy(run_dir, tmp_path, name="run"):
    """A copy of the run to change (its metrics.json) without touching the shared one."""
    return shutil.copytree(run_dir, tmp_path / name)


def _lines(text: str) -> list[str]:
    """Table lines with runs of spaces folded, as the Markdown tables pad their cells."""
    return [" ".join(line.split()) for line in text.splitlines()]


# ----------------------------------------------------------------------------- mptex-check
def test_check_defaults_are_f32_against_f32_on_4096_points_of_the_small_texture(tmp_path, capsys):
    out = tmp_path / "check.json"
    assert check_main(["--out", str(out)]) == 0
    stdout = capsys.readouterr().out.splitlines()
    # two setups of one name are told apart by their letter
    assert stdout[0] == "A: A: f32 (cpu, torch, train)   (loss scale 1)"
    assert stdout[1] == "B: B: f32 (cpu, torch, train)   (loss scale 1)"
    assert stdout[-1] == f"report: {out}"  # said last, once the file is written
    report = json.loads(out.read_text())
    assert report["ok"] is True
    assert report["setups"] == ["A: f32 (cpu, torch, train)", "B: f32 (cpu, torch, train)"]
    assert report["info"]["points"] == 4096
    assert report["info"]["seed"] == 0
    assert report["info"]["texture"] == "small"


def test_check_hands_its_flags_to_the_comparison(tmp_path, monkeypatch, capsys):
    seen = {}
    real = mptex.diagnostics.compare_setups

    def spy(texture, a, b, **kwargs):
        seen.update(kwargs, a=a.name, b=b.name)
        return real(texture, a, b, **kwargs)

    monkeypatch.setattr(mptex.diagnostics, "compare_setups", spy)
    argv = ["--a", "bf16", "--mode-b", "eval", "--points", "7", "--seed", "5",
            "--cotangent-scale", "0.25"]  # fmt: skip
    assert check_main(argv) == 0
    assert seen == {"points": 7, "seed": 5, "cotangent_scale": 0.25,
                    "a": "bf16 (cpu, torch, train)", "b": "f32 (cpu, torch, eval)"}  # fmt: skip
    assert check_main(["--points", "1"]) == 0  # one point is a positive number of points
    assert seen["points"] == 1 and seen["cotangent_scale"] is None  # None: the training size
    assert capsys.readouterr().err == ""


def test_check_names_an_unreadable_texture_config_with_the_errors_type_cut_to_200_chars(
    tmp_path, capsys
):
    missing = tmp_path / ("n" * 250 + ".yaml")
    assert check_main(["--points", "16", "--texture-config", str(missing)]) == 2
    why = f"[Errno 2] No such file or directory: '{missing}'"
    assert len(why) > 200
    assert capsys.readouterr().err == (
        "mptex-check: error: --texture-config: expected ['nvdiffrec', 'small'] or a readable "
        f"YAML file, got '{missing}' (FileNotFoundError: {why[:200]})\n"
    )


@pytest.mark.parametrize("backend", ["", "backend: torch\n", "backend: auto\n"])
def test_a_texture_config_without_another_backend_runs_without_a_word(tmp_path, capsys, backend):
    path = tmp_path / "texture.yaml"
    path.write_text(backend + "encoder:\n  n_levels: 2\n  log2_hashmap_size: 8\n")
    assert check_main(["--points", "16", "--texture-config", str(path)]) == 0
    assert capsys.readouterr().err == ""


def test_check_refuses_an_out_folder_it_cannot_write_before_any_work(tmp_path, monkeypatch,
                                                                    capsys):  # fmt: skip
    # As root every folder is writable: the permission is what os.access says.
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    out = tmp_path / "check.json"
    assert check_main(["--points", "16", "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.err == (
        f"mptex-check: error: --out: cannot write {out} (not a writable file location)\n"
    )
    assert captured.out == ""


def test_check_refuses_no_points_before_writing_any_report(tmp_path, capsys):
    out = tmp_path / "check.json"
    assert check_main(["--points", "0", "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        "mptex-check: error: --points: expected a positive integer, got 0\n"
    )
    assert not out.exists()


def test_a_grid_backend_this_machine_lacks_is_one_line_with_exit_2(capsys):
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    assert check_main(["--points", "16", "--backend-b", "tcnn"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mptex-check: error: backend='tcnn' needs tinycudann and a CUDA device")
    assert err.count("\n") == 1


def test_an_error_whose_text_holds_a_line_break_is_still_one_line(capsys):
    # torch's own message repeats the device string, line break and all
    assert check_main(["--points", "16", "--device-b", "cuda:\n0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mptex-check: error: --device-b: not a device: 'cuda:\\n0' (")
    assert err.count("\n") == 1


def test_an_out_link_into_a_missing_folder_is_refused_before_any_work(tmp_path, capsys):
    # The link's own folder is writable; the file it names would be made in a folder that does
    # not exist, so the write at the end would fail after the whole comparison.
    out = tmp_path / "check.json"
    out.symlink_to(tmp_path / "gone" / "check.json")
    assert check_main(["--points", "16", "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.err == (
        f"mptex-check: error: --out: cannot write {out} (not a writable file location)\n"
    )
    assert captured.out == ""


def test_an_out_link_into_a_writable_folder_is_written_through(tmp_path, capsys):
    (tmp_path / "real").mkdir()
    out = tmp_path / "check.json"
    out.symlink_to(tmp_path / "real" / "check.json")
    assert check_main(["--points", "16", "--out", str(out)]) == 0
    assert json.loads((tmp_path / "real" / "check.json").read_text())


def test_an_out_file_that_cannot_be_opened_is_exit_2_not_a_crash(tmp_path, monkeypatch, capsys):
    # The location passes the check, the open itself fails (a full disk, a file system that
    # refuses it): one line with exit 2 after the table, not a traceback.
    out = tmp_path / "check.json"
    real_open = open

    def refusing_open(file, *args, **kwargs):
        if str(file) == str(out):
            raise OSError(28, "No space left on device", str(out))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", refusing_open)
    assert check_main(["--points", "16", "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"mptex-check: error: [Errno 28] No space left on device: '{out}'\n"
    )


# ----------------------------------------------------------------------------- mptex-rescore
def test_rescore_scores_a_run_at_one_view_with_its_seed_arm_and_the_machine(
    tiny_run, tmp_path, capsys
):
    run_dir, metrics = tiny_run
    out = tmp_path / "scores.json"
    assert rescore.rescore_main([str(run_dir), "--n-val-views", "1", "--json", str(out)]) == 0
    document = json.loads(out.read_text())
    (row,) = document["scores"]
    assert row["n_val_views"] == 1 and len(row["psnr_per_image"]) == 1
    assert row["seed"] == 3 and row["arm"] == "bf16" and row["scene"] == "builtin"
    assert row["own"] is None  # fewer views than the run's own validation
    assert row["seconds"] > 0
    stdout = capsys.readouterr().out.splitlines()
    assert stdout[0] == f"machine: {document['machine']}" and document["machine"]
    assert stdout[1] == ""


def test_rescore_sets_the_torch_threads_it_is_given(tiny_run, monkeypatch):
    monkeypatch.setattr(rescore, "rescore", lambda *args: [])
    before = torch.get_num_threads()
    try:
        rescore.rescore_main([str(tiny_run[0]), "--threads", "2"])
        assert torch.get_num_threads() == 2
        rescore.rescore_main([str(tiny_run[0])])
        assert torch.get_num_threads() == 1  # the default
    finally:
        torch.set_num_threads(before)


def test_rescore_counts_the_directories_given_twice_and_names_a_file(tmp_path, monkeypatch,
                                                                    capsys):  # fmt: skip
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "notes.txt").write_text("")
    argv = ["a", "b", "a/.", str(tmp_path / "b"), "notes.txt"]
    assert rescore.rescore_main(argv) == 2
    assert capsys.readouterr().err.splitlines() == [
        "mptex-rescore: 2 run directories given more than once: each is scored once",
        "mptex-rescore: notes.txt: a file, not a run directory",
        "mptex-rescore: a: no checkpoint.pt (not a finished mptex-train run)",
        "mptex-rescore: b: no checkpoint.pt (not a finished mptex-train run)",
        "mptex-rescore: error: none of the 2 run directories could be scored",
    ]


def test_rescore_skips_the_files_a_glob_names_in_one_line(tmp_path, monkeypatch, capsys):
    # SWEEP/* names the report's files beside the run directories: one line for all of them.
    monkeypatch.chdir(tmp_path)
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    files = ["multirun.yaml", "report.md", "results.csv", "results.json", "results.tex",
             "summary.png"]  # fmt: skip
    for name in files:
        (tmp_path / name).write_text("")
    assert rescore.rescore_main(["a", "b", *files]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "mptex-rescore: 6 files, not run directories, skipped: multirun.yaml, report.md, "
        "results.csv, results.json, results.tex and 1 more",
        "mptex-rescore: a: no checkpoint.pt (not a finished mptex-train run)",
        "mptex-rescore: b: no checkpoint.pt (not a finished mptex-train run)",
        "mptex-rescore: error: none of the 2 run directories could be scored",
    ]
    assert rescore.rescore_main(files[:2]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "mptex-rescore: 2 files, not run directories, skipped: multirun.yaml, report.md",
        "mptex-rescore: error: no run directory given",
    ]


def test_rescore_counts_a_directory_given_three_times_as_one(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a").mkdir()
    assert rescore.rescore_main(["a", "a/.", str(tmp_path / "a")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "mptex-rescore: 1 run directory given more than once: each is scored once",
        "mptex-rescore: a: no checkpoint.pt (not a finished mptex-train run)",
    ]


def test_rescore_says_when_neither_of_two_runs_could_be_scored(tmp_path, capsys):
    first, second = tmp_path / "first", tmp_path / "second"
    assert rescore.rescore_main([str(first), str(second)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"mptex-rescore: {first}: no such run directory",
        f"mptex-rescore: {second}: no such run directory",
        "mptex-rescore: error: none of the 2 run directories could be scored",
    ]


def test_a_checkpoint_that_is_a_folder_is_no_checkpoint(tmp_path, capsys):
    (tmp_path / "checkpoint.pt").mkdir()
    assert rescore.rescore_main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"mptex-rescore: {tmp_path}: no checkpoint.pt (not a finished mptex-train run)\n"
    )
    assert export_main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"mptex-export: error: {tmp_path}: no checkpoint.pt (not a finished mptex-train run)\n"
    )


def _scored(tmp_path, monkeypatch, runs: dict):
    """Run folders with a checkpoint.pt each, scored as ``runs`` says: per run, a list of
    (scene, arm, val_spp, psnr) rows, or an exception that scoring it raises; each run's seed
    is its position in ``runs`` (0, 1, ...)."""
    for name in runs:
        (tmp_path / name).mkdir()
        (tmp_path / name / "checkpoint.pt").write_bytes(b"x")

    def fake(run_dir, spps, device, n_val_views=None):
        rows = runs[run_dir.name]
        if isinstance(rows, Exception):
            raise rows
        seed = list(runs).index(run_dir.name)
        return [{"run": str(run_dir), "scene": scene, "arm": arm, "seed": seed, "val_spp": spp,
                 "psnr": psnr, "baseline_psnr": 10.004, "own": None, "seconds": 1.26,
                 "psnr_per_image": [psnr]} for scene, arm, spp, psnr in rows]  # fmt: skip

    monkeypatch.setattr(rescore, "rescore", fake)
    return [str(tmp_path / name) for name in runs]


def test_rescore_groups_by_scene_arm_and_setting_with_the_sample_std_of_two(
    tmp_path, monkeypatch, capsys
):
    runs = _scored(tmp_path, monkeypatch, {
        "a": [("builtin", "f32", 1, 20.126)],
        "b": [("builtin", "f32", 1, 21.0)],
        "c": [("builtin", "bf16", 1, 30.0)],
        "d": [("mesh", "f32", 1, 40.0)],
    })  # fmt: skip
    assert rescore.rescore_main(runs) == 0
    lines = _lines(capsys.readouterr().out)
    # the run's folder name, the PSNRs to 0.01 dB, the seconds to 0.1 s
    assert "| a | builtin | f32 | 0 | 1 | 20.13 | 10.00 | - | 1.3 |" in lines
    # 20.126 and 21.0: mean 20.563, sample std |21.0 - 20.126| / sqrt(2) = 0.618
    assert "| builtin | f32 | 1 | 2 | 20.56 ± 0.62 |" in lines
    assert "| builtin | bf16 | 1 | 1 | 30.00 ± - |" in lines
    assert "| mesh | f32 | 1 | 1 | 40.00 ± - |" in lines


@pytest.mark.parametrize(
    "error, why",
    [(RuntimeError("no kernel\n  for this device"), "no kernel for this device"),
     (ValueError(), "ValueError")],
)  # fmt: skip
def test_a_run_this_machine_cannot_score_stops_the_batch_in_one_line(
    tmp_path, monkeypatch, capsys, error, why
):
    runs = _scored(tmp_path, monkeypatch, {"bad": error, "good": [("builtin", "f32", 1, 20.0)]})
    assert rescore.rescore_main(runs) == 2
    captured = capsys.readouterr()
    assert captured.err == f"mptex-rescore: error: {tmp_path / 'bad'}: {why}\n"
    assert captured.out == ""


@pytest.mark.parametrize("where", ["missing folder", "a folder"])
def test_rescore_refuses_a_json_path_it_cannot_write_before_scoring(tmp_path, monkeypatch,
                                                                    capsys, where):  # fmt: skip
    runs = _scored(tmp_path, monkeypatch, {"a": [("builtin", "f32", 1, 20.0)]})
    target = tmp_path / "no" / "scores.json" if where == "missing folder" else tmp_path
    assert rescore.rescore_main([*runs, "--json", str(target)]) == 2
    captured = capsys.readouterr()
    assert captured.err == (
        f"mptex-rescore: error: --json: cannot write {target} (not a writable file location)\n"
    )
    assert captured.out == ""  # nothing scored


# ----------------------------------------------------------------------------- mptex-report
@pytest.mark.parametrize("margin", ["0", "inf", "nan", "-0.5"])
def test_report_refuses_a_margin_that_is_no_finite_positive_number(tmp_path, capsys, margin):
    assert report_main([str(tmp_path), "--margin-db", margin]) == 2
    captured = capsys.readouterr()
    assert captured.err == (
        f"mptex-report: error: --margin-db: expected a finite number > 0, got {float(margin)}\n"
    )
    assert captured.out == ""


def test_report_of_one_sweep_uses_the_margin_given_and_half_a_db_by_default(tmp_path, capsys):
    for seed in (0, 1):
        write_run(tmp_path, f"{seed}", sweep_metrics("f32", seed, psnr=30.0 + seed))
    assert report_main([str(tmp_path), "--margin-db", "0.25"]) == 0
    # one sweep: no count of sweeps, only where its report is
    assert capsys.readouterr().out == f"mptex-report: report in {tmp_path / 'report.md'}\n"
    assert json.loads((tmp_path / "results.json").read_text())["margin_db"] == 0.25
    assert report_main([str(tmp_path)]) == 0
    assert json.loads((tmp_path / "results.json").read_text())["margin_db"] == 0.5


# ----------------------------------------------------------------------------- mptex-export
def test_export_of_a_missing_run_directory_is_one_line(tmp_path, capsys):
    assert export_main([str(tmp_path / "gone")]) == 2
    assert capsys.readouterr().err == (
        f"mptex-export: error: {tmp_path / 'gone'}: no such run directory\n"
    )


def test_export_names_a_bad_device_by_its_flag(tiny_run, tmp_path, capsys):
    assert export_main([str(tiny_run[0]), "--out", str(tmp_path), "--device", "gpu"]) == 2
    assert capsys.readouterr().err == (
        "mptex-export: error: --device: expected auto or a torch device such as cpu, cuda or "
        "cuda:1, got 'gpu'\n"
    )


def test_export_says_an_unfinished_run_then_names_a_bad_padding_flag(tiny_run, tmp_path,
                                                                     capsys):  # fmt: skip
    run_dir = _copy(tiny_run[0], tmp_path)
    record = json.loads((run_dir / "metrics.json").read_text())
    record["status"] = "interrupted"
    (run_dir / "metrics.json").write_text(json.dumps(record))
    assert export_main([str(run_dir), "--out", str(tmp_path / "out"), "--padding", "-1"]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"mptex-export: {run_dir}: exporting a checkpoint of 4 of 4 iterations (the run is "
        "interrupted)",
        "mptex-export: error: --padding: expected an integer >= 0, got -1",
    ]
    assert captured.out == ""


@pytest.mark.parametrize(
    "error, said",
    [(PermissionError(13, "Permission denied", "/x"),
      "PermissionError: [Errno 13] Permission denied: '/x'"),
     (ValueError("resolution: the charts\n  do not pack"), "resolution: the charts do not pack")],
)  # fmt: skip
def test_export_problems_the_bake_finds_are_one_line(tiny_run, tmp_path, monkeypatch, capsys,
                                                     error, said):  # fmt: skip
    import mptex.bake.export as export_module

    def fails(*args, **kwargs):
        raise error

    monkeypatch.setattr(export_module, "export_asset", fails)
    argv = [str(tiny_run[0]), "--out", str(tmp_path / "out"), "--resolution", "16"]
    assert export_main(argv) == 2
    assert capsys.readouterr().err == f"mptex-export: error: {said}\n"


def test_export_prints_the_files_the_texels_and_the_psnrs_it_wrote(
    tiny_run, tmp_path, monkeypatch, capsys
):
    import mptex.bake.export as export_module

    given = {}
    summary = {
        "files": {"kd": "texture_kd.png", "obj": "mesh.obj", "mtl": "mesh.mtl"},
        "resolution": 64, "uv_source": "xatlas", "coverage": 0.29049, "texels_per_unit": 12.34,
        "bake_time_s": 3.66, "psnr_baked_vs_neural": 57.634, "psnr_baked_vs_reference": 56.566,
        "psnr_neural_vs_reference": 55.255,
    }  # fmt: skip

    def export_asset(texture, scene, out, options, background, source=None):
        given.update(out=out, options=options, background=background, source=source)
        return summary

    monkeypatch.setattr(export_module, "export_asset", export_asset)
    out = tmp_path / "asset"
    argv = [str(tiny_run[0]), "--out", str(out), "--resolution", "64", "--format", "obj"]
    assert export_main(argv) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"mptex-export: wrote texture_kd.png, mesh.obj, mesh.mtl and export.json to {out}",
        "mptex-export: 64^2 texels, UVs from xatlas, coverage 0.290, 12.3 texels/unit, bake 3.7 s",
        "mptex-export: PSNR baked vs neural 57.63 dB, baked vs reference 56.57 dB (neural vs "
        "reference 55.26 dB)",
    ]
    assert given["out"] == out and given["background"] == "white"
    assert given["options"]["resolution"] == 64 and given["options"]["formats"] == ["obj"]
    assert given["source"]["checkpoint"] == str((tiny_run[0] / "checkpoint.pt").resolve())
    assert given["source"]["iterations"] == 4 and given["source"]["status"] == "completed"
    # Measured without reference views: the first PSNR alone.
    for key in ("psnr_baked_vs_reference", "psnr_neural_vs_reference"):
        del summary[key]
    assert export_main(argv) == 0
    assert capsys.readouterr().out.splitlines()[2:] == [
        "mptex-export: PSNR baked vs neural 57.63 dB"
    ]


@pytest.mark.requires_xatlas
def test_export_takes_a_zero_padding_and_no_measure_from_its_flags(tiny_run, tmp_path, capsys):
    pytest.importorskip("xatlas")
    out = tmp_path / "out"
    argv = [str(tiny_run[0]), "--out", str(out), "--resolution", "64", "--format", "obj",
            "--padding", "0", "--no-measure", "--decode", ""]  # fmt: skip
    assert export_main(argv) == 0
    summary = json.loads((out / "export.json").read_text())
    assert summary["padding"] == 0 and summary["measure_skipped"] == "export.measure=false"
    stdout = capsys.readouterr().out.splitlines()
    assert stdout[0].startswith("mptex-export: wrote ") and stdout[0].endswith(
        f" and export.json to {out}"
    )
    assert stdout[1].startswith("mptex-export: 64^2 texels, UVs from xatlas, coverage ")
    assert len(stdout) == 2  # nothing measured, no PSNR line


def test_rescore_says_in_one_line_when_its_json_cannot_be_written_after_the_scoring(
    tmp_path, monkeypatch, capsys
):
    # A folder that exists but refuses the file (read-only, a full disk) is found only when
    # writing: the table is printed, then one line and exit 2, not a traceback.
    runs = _scored(tmp_path, monkeypatch, {"a": [("builtin", "f32", 1, 20.0)]})
    target = tmp_path / "scores.json"

    def refuse(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "write_text", refuse)
    assert rescore.rescore_main([*runs, "--json", str(target)]) == 2
    captured = capsys.readouterr()
    assert captured.err == (
        f"mptex-rescore: error: --json: cannot write {target} (Permission denied)\n"
    )
    assert "20.00 ± -" in captured.out  # the scores were printed first
