"""The GPU kit's verdicts and tables on constructed inputs whose answer is known by hand.

The stages behind them need CUDA or minutes of training; here their summarising functions get
synthetic runs, records and results, so that an ``ok`` compared the wrong way, a ratio inverted
or a row left out shows up on the CPU in seconds.
"""

import argparse
import itertools
import json
import shutil
import sys
import time
from pathlib import Path

import pytest
from test_gpu_kit import kit

stages_loop = kit.stages_loop


class FakeStage:
    """What the summarising functions use of a stage's context."""

    def __init__(self, small=True, device="cpu", remaining=300.0):
        self.small, self.device, self._remaining = small, device, remaining
        self.result = {"status": "running", "tables": [], "data": {}}
        self.args = argparse.Namespace(device=device, native_grid="tcnn", n154_iterations=3)

    def remaining(self):
        return self._remaining

    def table(self, title, headers, rows, note=""):
        rows = [[str(c) for c in r] for r in rows]
        self.result["tables"].append({"title": title, "headers": headers, "rows": rows,
                                      "note": note})  # fmt: skip

    def save(self):
        pass


# ------------------------------------------------------------------------------- arms
def test_the_arms_run_in_the_planned_order():
    order = ["f32", "f16", "fp8", "f16_naive"]
    plan = kit.arms_plan(order)
    loop = [(f"f32, {v}", "f32", v) for v in kit.LOOP_VARIANTS]
    assert plan == [
        ("f32", "f32", None), ("f16", "f16", None), ("fp8", "fp8", None), *loop,
        ("fp8, texture.fp8_gemm=triton", "fp8", "texture.fp8_gemm=triton"),
        ("f16_naive", "f16_naive", None),
    ]  # fmt: skip


def test_a_run_that_did_not_complete_is_not_blamed_on_the_loss():
    runs = [
        {"precision": "f32", "status": "completed", "backends": {"loss": "triton"}},
        {"precision": "f16_naive", "status": "diverged", "backends": None},
        {"precision": "fp8", "status": "completed", "backends": {"loss": "torch"}},
    ]
    assert kit.fused_loss_checks(runs, None) == [
        "fp8: the loss ran eager, not fused (its start-up check failed: the warning is in log.txt)"
    ]


# ------------------------------------------------------------------------------- tests stage
@pytest.mark.parametrize(
    "returncode, outcomes, expected",
    [
        (0, ["passed"], []),
        (5, [], []),  # nothing collected: no GPU test on this machine is not a failure
        (1, ["passed", "failure: assert 1 == 2", "error: fixture", "skipped: no cuda"], [1, 2]),
        (1, ["passed"], ["pytest"]),  # pytest failed with every case passed (a crash): named
        (2, [], ["pytest"]),
        (None, ["passed", "running when the box ran out"], ["pytest: stopped by the stage's box"]),
    ],
)
def test_failed_tests_by_outcome(returncode, outcomes, expected):
    rows = [[f"t.py::test_{i}", o, "0.1"] for i, o in enumerate(outcomes)]
    named = [f"t.py::test_{e}" if isinstance(e, int) else e for e in expected]
    assert kit._failed_tests(returncode, rows) == named


# ------------------------------------------------------------------------------- nvdiffrec154
def _run_nvdiffrec154(monkeypatch, psnr):
    """The stage with each run's PSNR from ``psnr[(arm, seed)]`` (None: the run diverged)."""
    monkeypatch.setattr(stages_loop, "compose_config", lambda overrides: overrides)

    def train_run(overrides):
        arm = next(o.split("=")[1] for o in overrides if o.startswith("precision="))
        seed = int(next(o.split("=")[1] for o in overrides if o.startswith("train.seed=")))
        value = psnr[(arm, seed)]
        return {"psnr": value, "status": "completed" if value else "diverged", "backends": {}}

    monkeypatch.setattr(kit, "_train_run", train_run)
    ctx = FakeStage()
    kit.stage_nvdiffrec154(ctx)
    return ctx.result


def test_nvdiffrec154_pairs_each_arm_with_nvdiffrec_by_seed(monkeypatch):
    psnr = {("nvdiffrec", 0): 30.0, ("nvdiffrec", 1): 31.0,
            ("tcnn_fused_swap154", 0): 29.0, ("tcnn_fused_swap154", 1): 30.5,
            ("tcnn_fused_dynamic", 0): 30.25, ("tcnn_fused_dynamic", 1): 31.75}  # fmt: skip
    result = _run_nvdiffrec154(monkeypatch, psnr)
    data = result["data"]
    # the arm minus nvdiffrec, seed by seed: negative where the arm is worse
    swap, dynamic = data["pairs"]["tcnn_fused_swap154"], data["pairs"]["tcnn_fused_dynamic"]
    assert swap["differences"] == [-1.0, -0.5] and dynamic["differences"] == [0.25, 0.75]
    assert swap["ci"]["mean"] == -0.75 and dynamic["ci"]["mean"] == 0.5
    # the first pair also under the keys earlier runs of the kit wrote
    assert data["differences"] == swap["differences"] and data["ci"] == swap["ci"]
    paired = result["tables"][1]["rows"]
    assert [row[:3] for row in paired] == [
        ["tcnn_fused_swap154 − nvdiffrec", "2", "-0.75"],
        ["tcnn_fused_dynamic − nvdiffrec", "2", "+0.50"],
    ]


def test_nvdiffrec154_leaves_out_a_seed_where_any_arm_diverged(monkeypatch):
    psnr = {("nvdiffrec", 0): 30.0, ("nvdiffrec", 1): 31.0,
            ("tcnn_fused_swap154", 0): 29.0, ("tcnn_fused_swap154", 1): None,
            ("tcnn_fused_dynamic", 0): 30.25, ("tcnn_fused_dynamic", 1): 31.75}  # fmt: skip
    data = _run_nvdiffrec154(monkeypatch, psnr)["data"]
    assert data["psnr"] == {"nvdiffrec": [30.0], "tcnn_fused_swap154": [29.0],
                            "tcnn_fused_dynamic": [30.25]}  # fmt: skip
    assert data["pairs"]["tcnn_fused_dynamic"] == {"differences": [0.25], "ci": None,
                                                   "verdict": None}  # fmt: skip


# ------------------------------------------------------------------------------- main job
def _write_metrics(sweep, job, **metrics):
    (sweep / job).mkdir(parents=True)
    (sweep / job / "metrics.json").write_text(json.dumps(metrics))


def test_the_main_jobs_records_come_in_job_order(tmp_path):
    for n in (10, 2, 0):  # as text "10_" sorts before "2_"
        _write_metrics(tmp_path, f"{n}_precision=f32", precision="f32", seed=n,
                       status="completed", psnr=30.0, time_per_iter_s=0.004, wall_time_s=9.0,
                       time_split_s={"start": 2.0})  # fmt: skip
    (tmp_path / "3_half").mkdir()
    (tmp_path / "3_half" / "metrics.json").write_text("{")  # being written
    runs = stages_loop._sweep_runs(tmp_path)
    assert [r["seed"] for r in runs] == [0, 2, 10]
    assert runs[0] == {"job": "0_precision=f32", "precision": "f32", "seed": 0,
                       "status": "completed", "psnr": 30.0, "ms_per_iter": 4.0, "wall_s": 9.0,
                       "start_s": 2.0, "backends": {}}  # fmt: skip


def test_the_main_jobs_table_by_hand():
    def run(arm, status, ms, psnr, wall, start):
        return {"precision": arm, "status": status, "ms_per_iter": ms, "psnr": psnr,
                "wall_s": wall, "start_s": start, "backends": {"encoder": "triton"}}  # fmt: skip

    runs = [
        run("fp8", "completed", 1.0, 30.0, 10.0, 1.0),
        run("fp8", "completed", 2.0, 31.0, 20.0, 3.0),
        run("fp8", "completed", 6.0, 32.0, 60.0, 5.0),
        run("fp8", "diverged", 100.0, 5.0, 900.0, 9.0),  # not a completed run: left out
        run("f32", "diverged", None, None, None, None),
    ]
    # per arm, sorted: completed / all, median ms, mean PSNR, mean wall / mean start
    assert stages_loop._sweep_summary(runs) == [
        ["f32", "0/1", "–", "–", "–", "encoder=triton"],
        ["fp8", "3/4", "2.00", "31.00", "30.0 / 3.0", "encoder=triton"],
    ]


# ------------------------------------------------------------------------------- profile
def test_the_host_floor_table_by_hand():
    class LoopOverhead:
        @staticmethod
        def host_ms(arms, runs, iterations, overrides):
            return [{"arm": "f32", "host_ms_runs": [2.0]}, {"arm": "fp8", "host_ms_runs": [3.0]},
                    {"arm": "f16_dynamic", "host_ms_runs": [None]}]  # fmt: skip

    ctx = FakeStage()
    stages_loop._host_floor(ctx, LoopOverhead)
    assert ctx.result["tables"][0]["rows"] == [["f32", "2.00", "1.00"], ["fp8", "3.00", "1.50"],
                                               ["f16_dynamic", "–", "–"]]  # fmt: skip


# ------------------------------------------------------------------------------- results.md
def test_results_markdown_by_hand():
    results = {
        "command": "python validate.py", "started": "then", "device": "cuda",
        "installed": ["a.whl"],
        "stages": {  # in the order they ran; the markdown follows the kit's order
            "arms": {"status": "timed out", "reason": "stopped", "seconds": 10.4, "box": 20.0,
                     "tables": [{"title": "T", "headers": ["arm", "x"],
                                 "rows": [["f32", "a|b"]], "note": "n"}]},
            "env": {"status": "ok", "seconds": 1.0, "box": 40.0, "tables": [],
                    "data": {"gpu": "H200", "torch": "2.9"}},
        },
    }  # fmt: skip
    assert kit.markdown(results) == "\n".join([
        "# mptex GPU kit results", "", "- command: `python validate.py`", "- started: then",
        "- device: cuda", "- gpu: H200", "- torch: 2.9", "- installed from the kit: a.whl", "",
        "## Environment (`env`)", "", "status: **ok** (1 s of a 40 s box)", "",
        "## Every arm at nvdiffrec's scale (`arms`)", "",
        "status: **timed out**: stopped (10 s of a 20 s box)", "", "**T**", "", "| arm | x |",
        "|---|---|", "| f32 | a\\|b |", "", "n",
    ]) + "\n"  # fmt: skip


def test_results_are_written_whole(tmp_path):
    results = {"command": "c", "started": "s", "device": "cpu", "stages": {}}
    kit.write_results(tmp_path, results)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json", "results.md"]
    assert json.loads((tmp_path / "results.json").read_text()) == results
    assert (tmp_path / "results.md").read_text() == kit.markdown(results)


def test_a_stage_table_keeps_every_row(tmp_path):
    ctx = kit.StageContext(argparse.Namespace(device="cpu"), tmp_path / "r.json", time.time())
    ctx.table("t", ["a", "b"], [[1, 2.5], ["x", None]], "note")
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["tables"] == [{"title": "t", "headers": ["a", "b"],
                                "rows": [["1", "2.5"], ["x", "None"]], "note": "note"}]  # fmt: skip


# ------------------------------------------------------------------------------- comparisons
# The comparison stages pointed at a "native" backend that is the twin with a known error added.
def _grid_with_error(monkeypatch, forward, grad_scale):
    """compare_grid on the coarse config with the native output's largest value moved by
    ``forward(value, dtype)`` and its parameter gradient scaled by ``grad_scale``."""
    import mptex

    class Perturbed(mptex.HashGridEncoding):
        def forward(self, x, **kw):
            if self.backend != "perturbed":
                return super().forward(x, **kw)
            self.backend = "torch"
            try:
                out = super().forward(x, **kw)
            finally:
                self.backend = "perturbed"
            # the gradient scaled, the value kept bit for bit
            out = out + (out - out.detach()) * (grad_scale - 1)
            flat = out.detach().flatten()
            i = int(flat.float().abs().argmax())
            moved = flat.clone()
            moved[i] = forward(flat[i], out.dtype)
            return out + (moved.view_as(out) - out.detach())

    monkeypatch.setattr(mptex, "HashGridEncoding", Perturbed)
    rows = kit.compare_grid("cpu", "perturbed", {"coarse": kit.GRID_CONFIGS["coarse"]}, 512)
    return {r["dtype"]: r for r in rows}


def _next_up(value, dtype):
    import torch

    return torch.nextafter(value, torch.tensor(float("inf"), dtype=dtype))


def test_grid_rows_take_their_dtypes_tolerance(monkeypatch):
    # One value one ulp off: within f32's 2.5e-7 and half's 2^-11 (values in (-1, 1)), but a
    # half ulp near 1 (2^-11) is far over f32's tolerance.
    rows = _grid_with_error(monkeypatch, _next_up, 1.0)
    assert rows["float32"]["ok"] and rows["float16"]["ok"], rows
    assert 2.5e-7 < rows["float16"]["forward_max_abs_err"] <= 2**-11
    assert rows["float32"]["forward_equal"] == 1 - 1 / (512 * 8)
    # 1e-5 off: over f32's 2.5e-7, within half's 2^-11
    rows = _grid_with_error(monkeypatch, lambda v, dtype: (v.float() + 1e-5).to(dtype), 1.0)
    assert not rows["float32"]["ok"]


def test_grid_rows_judge_the_gradient_against_the_native_ones_norm(monkeypatch):
    # native gradient twice the twin's: |g_t - g_n| / |g_n| = 1/2
    rows = _grid_with_error(monkeypatch, lambda v, dtype: v, 2.0)
    assert [rows[d]["grad_rel_err"] for d in ("float32", "float16")] == [0.5, 0.5]
    assert not rows["float32"]["ok"] and not rows["float16"]["ok"]
    # 1e-3: over f32's 1e-6, within half's 4e-3
    rows = _grid_with_error(monkeypatch, lambda v, dtype: v, 1.001)
    assert not rows["float32"]["ok"] and rows["float16"]["ok"], rows


def test_network_tolerance_is_exact_only_on_the_measured_capability(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    assert kit.network_tolerance("cuda:0") == dict.fromkeys(kit.NETWORK_TOLERANCE, (0.0, 0.0))
    assert kit.network_tolerance("cpu") == kit.NETWORK_TOLERANCE
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 9))
    assert kit.network_tolerance("cuda:0") == kit.NETWORK_TOLERANCE


def _raster_with_error(monkeypatch, perturb):
    import mptex.render

    rasterize = mptex.render.rasterize

    def fake(clip, tri, res, backend="auto", **kw):
        if backend != "perturbed":
            return rasterize(clip, tri, res, backend=backend, **kw)
        rast, *rest = rasterize(clip, tri, res, backend="torch", **kw)
        return (perturb(rast.clone()), *rest)

    interpolate = mptex.render.interpolate
    monkeypatch.setattr(mptex.render, "rasterize", fake)
    monkeypatch.setattr(mptex.render, "interpolate", lambda *a, backend="auto", **kw: interpolate(
        *a, backend="torch" if backend == "perturbed" else backend, **kw))  # fmt: skip
    meshes = kit.raster_meshes("cpu", None)
    return kit.compare_raster("cpu", "perturbed", meshes, 32, 1)[0]


def _covered(rast):
    return (rast[..., 3] > 0).nonzero()


def test_raster_ids_agree_over_the_pixels_either_side_covers(monkeypatch):
    def perturb(rast):
        (b0, y0, x0), (b1, y1, x1) = _covered(rast)[:2].tolist()
        rast[b0, y0, x0, 3] = 0.0  # the native side leaves a pixel uncovered
        rast[b1, y1, x1, 3] += 1.0  # and names another triangle in one
        return rast

    row = _raster_with_error(monkeypatch, perturb)
    covered = row["covered_pixels"]
    # (the kit divides the two counts as float32 tensors)
    assert row["id_agreement"] == pytest.approx((covered - 2) / covered, rel=2**-23)
    ours = _raster_with_error(monkeypatch, lambda rast: rast)
    assert ours["covered_pixels"] == covered and ours["id_agreement"] == 1.0 and ours["ok"]
    # the tolerance met exactly is met
    monkeypatch.setitem(kit.RASTER_TOLERANCE, "id_agreement", row["id_agreement"])
    assert _raster_with_error(monkeypatch, perturb)["ok"]


@pytest.mark.parametrize(
    "channel, error, ok",
    [(0, 5e-7, True), (0, 2e-6, False), (2, 5e-7, True), (2, 5e-6, False)],
)
def test_raster_barycentrics_and_depth_against_1e_6(monkeypatch, channel, error, ok):
    def perturb(rast):
        b, y, x = _covered(rast)[0].tolist()
        rast[b, y, x, channel] += error
        return rast

    assert _raster_with_error(monkeypatch, perturb)["ok"] is ok


def _fp8_with_error(monkeypatch, share):
    """compare_fp8 with each backend's result moved by ``share[backend]`` times its bound
    (errors are shares of sum |a b| |scales|)."""
    import mptex.fp8

    scaled_mm = mptex.fp8.scaled_mm

    def fake(qa, qb, sa, sb, backend="auto"):
        out = scaled_mm(qa, qb, sa, sb, backend="emulated")
        k = qa.shape[1]
        bound = {"emulated": (k + 2) * 2.0**-24,
                 "scaled_mm": min(k, 128) * 2.0**-14 + (k + 2) * 2.0**-24}[backend]  # fmt: skip
        magnitude = (qa.double().abs() @ qb.double().abs()) * (sa.double() * sb.double()).abs()
        return (out.double() + share[backend] * bound * magnitude).to(out.dtype)

    monkeypatch.setattr(mptex.fp8, "scaled_mm", fake)
    monkeypatch.setattr(mptex.fp8, "triton_gemm_problem", lambda device: "no triton here")
    rows = kit.compare_fp8("cpu", 27, repeats=1)
    assert [r["k"] for r in rows] == [32, 32, 32, 3, 32, 32]  # the batch's 27 + 5 rows as K
    return [r["ok"] for r in rows]


def test_fp8_rows_hold_every_backend_to_its_own_bound(monkeypatch):
    assert _fp8_with_error(monkeypatch, {"emulated": 0.5, "scaled_mm": 0.5}) == [True] * 6
    # _scaled_mm at twice its bound (still under 128 x 2^-14 at K = 32), emulation exact
    assert _fp8_with_error(monkeypatch, {"emulated": 0.0, "scaled_mm": 2.0}) == [False] * 6
    assert _fp8_with_error(monkeypatch, {"emulated": 2.0, "scaled_mm": 0.0}) == [False] * 6


def test_the_arms_stage_starts_a_run_only_when_its_box_holds_it(monkeypatch):
    # 30 s left, every run instant: a slow arm whose known time x 1.3 is over 30 s
    # (tcnn_fused_f32acc 28 s, tcnn_fused_nosplitk 120 s) is not started, fp8_rowwise (17 s) is.
    monkeypatch.setattr(stages_loop, "compose_config", lambda overrides: overrides)
    ms = {"f32": 4.0, "f16_dynamic": 8.0}  # f16_dynamic at 2x: a miss, were the dry run judged

    def train_run(overrides):
        arm = overrides[0].split("=")[1]
        return {"precision": arm, "status": "completed", "psnr": 30.0,
                "time_per_iter_s": ms.get(arm, 6.0) / 1e3, "wall_time_s": 0.0,
                "time_split_s": {"start": 0.0, "iterations": 0.0}, "peak_memory_bytes": 2**20,
                "peak_memory_kind": "cpu", "skipped_steps": 0, "backends": {}}  # fmt: skip

    monkeypatch.setattr(kit, "_train_run", train_run)
    ctx = FakeStage(remaining=30.0)
    kit.stage_arms(ctx)
    rows = {row[0]: row for row in ctx.result["tables"][0]["rows"]}
    assert rows["tcnn_fused_f32acc"][1] == rows["tcnn_fused_nosplitk"][1] == "not run: time box"
    assert rows["fp8_rowwise"][1] == "completed"
    assert rows["f32"][4] == "1.00" and rows["f16_dynamic"][4] == "2.00"
    assert rows["fp8"][4] == "1.50"
    assert "failed_checks" not in ctx.result  # the dry run's times are not judged


def _network_with_error(monkeypatch, output_shift, grad_scale):
    """compare_network (texture config, CPU tolerance) with the native output shifted by
    ``output_shift`` and every gradient scaled by ``grad_scale``."""
    import mptex

    class Perturbed(mptex.FullyFusedMLP):
        def forward(self, x):
            if self.backend != "perturbed":
                return super().forward(x)
            self.backend = "torch"
            try:
                out = super().forward(x)
            finally:
                self.backend = "perturbed"
            return out + (out - out.detach()) * (grad_scale - 1) + output_shift

    monkeypatch.setattr(mptex, "FullyFusedMLP", Perturbed)
    configs = {"32x2 (texture)": kit.NETWORK_CONFIGS["32x2 (texture)"]}
    return kit.compare_network("cpu", "perturbed", configs, 256)[0]


def test_network_rows_fail_on_any_quantity_outside_its_tolerance(monkeypatch):
    assert _network_with_error(monkeypatch, 0.0, 1.0)["ok"]
    # outputs 0.25 off (over 2e-3 + 2e-3 |b| for outputs of the initial MLP), gradients exact
    row = _network_with_error(monkeypatch, 0.25, 1.0)
    assert row["output"]["outside_tol"] == 1.0 and row["weight_grad"]["outside_tol"] == 0.0
    assert not row["ok"]
    # gradients 5 % off: over rtol 1e-2 wherever |grad| is well over the atol of 1e-5 (input
    # gradients of this cotangent, N(0, 1e-3^2), are mostly under it)
    row = _network_with_error(monkeypatch, 0.0, 1.05)
    assert row["input_grad"]["outside_tol"] > 0.1 and not row["ok"], row


# ------------------------------------------------------------------------------- the driver
def _drive(tmp_path, monkeypatch, budget_s, stages, status="ok"):
    """The driver on a GPU's boxes with every stage's process replaced by one that writes its
    result at once: the boxes it gives, what it records."""

    waits = []

    class Stage:
        returncode, pid = 0, -1

        def __init__(self, cmd, **kw):
            result = Path(cmd[cmd.index("--result-file") + 1])
            result.write_text(json.dumps({"status": status, "tables": []}))

        def wait(self, timeout=None):
            waits.append(timeout)
            return 0

    monkeypatch.setattr(kit.subprocess, "Popen", Stage)
    monkeypatch.setattr(kit, "STARTED", time.time())
    args = kit.parse_args(["--device", "cuda", "--out", str(tmp_path / "out"),
                           "--budget-s", str(budget_s), "--stages", *stages])  # fmt: skip
    assert kit.drive(args) == 0
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["log.txt", "results.json", "results.md"]
    stages = json.loads((out / "results.json").read_text())["stages"]
    # a stage's own deadline is its box; the driver waits 15 s more before it kills it
    started = [s["box"] for s in stages.values() if s["status"] != "not run"]
    assert waits == [pytest.approx(box + 15, abs=1) for box in started]
    return stages


def test_each_stage_gets_its_box_and_what_the_earlier_ones_left(tmp_path, monkeypatch):
    # env (40 s), loss (40 s), arms (180 s) in 300 s: env may use all but the later boxes
    # (300 - 220), loss likewise (300 - 180, the stages here take no time), arms the rest.
    stages = _drive(tmp_path, monkeypatch, 300, ["arms", "env", "loss"])
    assert list(stages) == ["env", "loss", "arms"]
    boxes = [stages[s]["box"] for s in stages]
    assert boxes == [pytest.approx(80, abs=1), pytest.approx(120, abs=1), pytest.approx(300, abs=1)]
    assert {s["status"] for s in stages.values()} == {"ok"}


def test_a_box_never_exceeds_the_budget_left(tmp_path, monkeypatch):
    # 100 s for boxes of 40, 40 and 180: each keeps its own box, but none past the budget.
    stages = _drive(tmp_path, monkeypatch, 100, ["env", "loss", "arms"])
    boxes = [stages[s]["box"] for s in stages]
    assert boxes == [pytest.approx(40, abs=1), pytest.approx(40, abs=1), pytest.approx(100, abs=1)]
    stages = _drive(tmp_path, monkeypatch, 3, ["env"])  # under 5 s: not started
    assert stages["env"] == {"status": "not run", "reason": "budget spent", "box": 0,
                             "seconds": 0, "tables": []}  # fmt: skip


def test_a_stage_that_never_reported_its_end_failed(tmp_path, monkeypatch):
    stages = _drive(tmp_path, monkeypatch, 300, ["loss"], status="running")
    assert list(stages) == ["loss"] and stages["loss"]["status"] == "failed"


# ------------------------------------------------------------------------------- pack_kit.sh
def test_the_kit_packs_hydra_with_what_its_no_deps_install_leaves_out():
    # validate.py installs the kit with --no-deps: every Hydra package mptex depends on, and
    # their own pure-Python dependencies, must be packed by name.
    import re

    script = (kit.HERE / "pack_kit.sh").read_text()
    packed = set(re.search(r"^for dist in (.+); do$", script, re.M)[1].split())
    assert packed == {"hydra-core", "omegaconf", "antlr4-python3-runtime",
                      "hydra-joblib-launcher", "hydra-submitit-launcher", "submitit"}  # fmt: skip
    assert 'cp "$assets/duck.obj" "$assets/duck.mtl" "$assets/duckCM.png"' in script


def _mainjob(tmp_path, monkeypatch, clock, returncode=0, remaining=300.0):
    """The main job's stage on a GPU's sizes with the job replaced by one that ends at once
    (exit ``returncode``) having written one run and its report; ``clock``: time.time()'s
    readings, the job's start then its end."""
    calls = []

    class Job:
        pid = -1

        def __init__(self, command, **kw):
            calls.append(command)
            sweep = Path(
                next(o.split("=", 1)[1] for o in command if o.startswith("hydra.sweep.dir="))
            )
            _write_metrics(sweep, "0_precision=f32", precision="f32", seed=0, status="completed",
                           psnr=30.0, time_per_iter_s=0.004, wall_time_s=9.0)  # fmt: skip
            (sweep / "report.md").write_text("# report\n")
            self.returncode = returncode

        def wait(self, timeout=None):
            return self.returncode

        def poll(self):
            return self.returncode

    readings = iter(clock)
    monkeypatch.setattr(stages_loop.subprocess, "Popen", Job)
    monkeypatch.setattr(stages_loop.time, "time", lambda: next(readings))
    ctx = FakeStage(small=False, device="cuda", remaining=remaining)
    ctx.args.results_dir = str(tmp_path)
    scratch = tmp_path / "scratch"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    stages_loop._mainjob(ctx, scratch)
    return ctx.result, calls


def test_the_main_job_is_held_to_600_s(tmp_path, monkeypatch):
    result, calls = _mainjob(tmp_path, monkeypatch, [1000.0, 1599.0])
    assert len(calls) == 1 and "failed_checks" not in result, result
    assert result["data"]["wall_s"] == 599.0 and result["data"]["target_s"] == 600.0
    assert (tmp_path / "mainjob-report.md").read_text() == "# report\n"
    result, _ = _mainjob(tmp_path, monkeypatch, [1000.0, 1630.0])
    assert result["failed_checks"] == ["wall 630 s over the 600 s target"]
    result, _ = _mainjob(tmp_path, monkeypatch, [1000.0, 1100.0], returncode=1)
    assert result["failed_checks"] == ["mptex-train exited 1"]


def test_the_main_job_is_stopped_20_s_before_its_box_ends(tmp_path, monkeypatch):
    result, _ = _mainjob(tmp_path, monkeypatch, [1000.0, 1010.0], remaining=15.0)
    assert result["failed_checks"] == [
        "stopped after 10 s (the stage's box), before the sweep ended"]  # fmt: skip


def test_fp8_times_are_the_median_call(monkeypatch):
    # every call times 3, 1 and 2 µs in turn: the median, 2 µs
    _fp8_with_error(monkeypatch, {"emulated": 0.0, "scaled_mm": 0.0})  # its scaled_mm stand-in
    ticks = itertools.cycle([0.0, 3e-6, 10.0, 10.0 + 1e-6, 20.0, 20.0 + 2e-6])
    monkeypatch.setattr(kit.time, "perf_counter", lambda: next(ticks))
    rows = kit.compare_fp8("cpu", 27, repeats=3)
    assert [r[f"{b}_us"] for r in rows for b in ("emulated", "scaled_mm")] == pytest.approx(
        [2.0] * 12, rel=1e-6)  # fmt: skip


def test_pytest_gets_the_stages_box_less_5_s(tmp_path, monkeypatch):
    seen = []

    def run(cmd, timeout, **kw):
        seen.append(timeout)
        raise kit.subprocess.TimeoutExpired(cmd, timeout, output="")

    monkeypatch.setattr(kit.subprocess, "run", run)
    for remaining in (100.0, 3.0):
        assert kit._run_pytest(FakeStage(remaining=remaining), [], None, tmp_path / "j.xml") == (
            None, "", None)  # fmt: skip
    assert seen == [95.0, 10]  # at least 10 s


def test_pytest_rows_name_failures_errors_and_skips(monkeypatch):
    import xml.etree.ElementTree as ET

    xml = """<testsuite>
      <testcase classname="t" name="a" time="0.25"/>
      <testcase classname="t" name="b" time="1"><failure message="assert 1 == 2&#10;more"/>
      </testcase>
      <testcase classname="t" name="c"><error message="fixture 'x' not found"/></testcase>
      <testcase classname="t" name="d"><skipped message="needs CUDA"/></testcase>
    </testsuite>"""
    cases = list(ET.fromstring(xml).iter("testcase"))
    monkeypatch.setattr(
        kit, "_run_pytest", lambda ctx, args, env, report: (1, "x\n1 failed\n", cases)
    )
    ctx = FakeStage()
    returncode, rows, last = kit._pytest_rows(ctx, [])
    assert rows == [["t::a", "passed", "0.2"], ["t::b", "failure: assert 1 == 2", "1.0"],
                    ["t::c", "error: fixture 'x' not found", "0.0"],
                    ["t::d", "skipped: needs CUDA", "0.0"]]  # fmt: skip
    assert last == "1 failed" and kit._failed_tests(returncode, rows) == ["t::b", "t::c"]


def _profile(monkeypatch, f32_syncs, remaining=300.0):
    """The profile stage with every profiled run and count synthetic: f32 counted with
    ``f32_syncs`` host synchronisations per iteration (None: stopped before the window)."""
    import types

    order = []

    def count_arm(arm, start, stop, size, overrides, texture):
        order.append(arm)
        syncs = f32_syncs if arm == "f32" else 0.0
        return {"arm": arm, "status": "completed", "ops_per_iter": None if syncs is None else 9.0,
                "syncs_per_iter": syncs, "sync_sites": []}  # fmt: skip

    def host_ms(arms, runs, iterations, overrides):
        order.append("host floor")
        return [{"arm": a, "host_ms_runs": [1.0]} for a in arms]

    fake = types.SimpleNamespace(count_arm=count_arm, host_ms=host_ms)
    monkeypatch.setitem(sys.modules, "loop_overhead", fake)
    monkeypatch.setattr(stages_loop, "_profile_arm", lambda ctx, arm, iterations: {
        "arm": arm, "status": "completed", "ms_per_iter": 4.0, "device_busy_ms_per_iter": 1.0,
        "launches_per_iter": 100.0, "stream_syncs_per_iter": 1.0, "dtoh_per_iter": 1.0,
        "parts_device_ms_per_iter": {}, "top_ops": [], "top_host_ops": [],
        "backends": {}})  # fmt: skip
    ctx = FakeStage(small=False, device="cuda", remaining=remaining)
    stages_loop.stage_profile(ctx)
    return ctx.result, order


def test_the_profile_stage_allows_f32_one_host_sync_per_iteration(monkeypatch):
    result, order = _profile(monkeypatch, 1.0)
    # f32's count first, then the host floors, then the other arms' counts
    assert order == ["f32", "host floor", *stages_loop.PROFILE_ARMS[1:]]
    assert "failed_checks" not in result
    result, _ = _profile(monkeypatch, 1.25)
    assert result["failed_checks"] == ["f32: 1.25 host syncs per iteration, over 1"]
    result, _ = _profile(monkeypatch, None)  # not counted is not passed
    assert result["failed_checks"] == [
        "f32: host syncs per iteration not counted (time box or failure)"]  # fmt: skip
    # 30 s left: one profiled arm, no host floor (it needs 45 s), no count
    result, order = _profile(monkeypatch, 1.0, remaining=30.0)
    assert order == [] and result["data"]["host_floor"] == "not run: time box"
    assert result["failed_checks"] == [
        "f32: host syncs per iteration not counted (time box or failure)"]  # fmt: skip
