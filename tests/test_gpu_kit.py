"""The GPU kit (benchmarks/gpu/): its CPU dry run, its comparisons, and the ULP measures."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mptex import PrecisionPolicy
from mptex.diagnostics import half_ulps, outside_tolerance, ulp_summary
from mptex.scenes import suite_available

ROOT = Path(__file__).resolve().parents[1]
VALIDATE = ROOT / "benchmarks" / "gpu" / "validate.py"
STAGES = ["env", "loss", "golden", "tests", "arms", "profile", "nvdiffrec154", "grid", "network",
          "raster", "fp8", "throughput"]  # fmt: skip
FIXTURES = ROOT / "tests" / "gpu_golden"
_spec = importlib.util.spec_from_file_location("gpu_kit_validate", VALIDATE)
kit = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = kit  # its dataclasses look their module up there
_spec.loader.exec_module(kit)


def _validate(tmp_path, *args, check=True):
    out = tmp_path / "out"
    # The kit's scratch space (its installs, the stages' and the main job's temporary folders)
    # goes where TMPDIR says, and nothing of it is left there when the command ends.
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    proc = subprocess.run(
        [sys.executable, str(VALIDATE), "--device", "cpu", "--out", str(out), *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"OMP_WAIT_POLICY": "passive", **os.environ, "TMPDIR": str(scratch)},
    )
    assert sorted(p.name for p in scratch.iterdir()) == []
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    results_file = out / "results.json"
    results = json.loads(results_file.read_text()) if results_file.is_file() else None
    return proc, results, out


# ------------------------------------------------------------------------------- ULPs
def test_half_ulps_counts_representable_halves():
    one = torch.tensor([1.0], dtype=torch.float16)
    next_up = torch.nextafter(one, torch.tensor([2.0], dtype=torch.float16))
    tiny = torch.tensor([2.0**-24])  # the smallest positive half subnormal
    cases = [
        (one, one, 0),
        (one, next_up, 1),
        (torch.tensor([0.0]), torch.tensor([-0.0]), 0),
        (tiny, -tiny, 2),  # crossing zero: -tiny, (-)0, +tiny
        (torch.tensor([1.0]), torch.tensor([2.0]), 1024),  # one binade: 2^10 mantissa steps
        (torch.tensor([-1.0]), torch.tensor([-2.0]), 1024),
        (torch.tensor([float("inf")]), one.float(), -1),
        (torch.tensor([float("nan")]), one.float(), -1),
    ]
    for a, b, expected in cases:
        assert int(half_ulps(a, b)[0]) == expected, (a, b)
        assert int(half_ulps(b, a)[0]) == expected, (b, a)


def test_half_ulps_matches_a_per_element_reference():
    # Reference: the index of each value in the sorted list of every finite half.
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    halves = bits.view(torch.float16)
    finite = halves[torch.isfinite(halves)].float().unique()  # -0 and +0 merge
    gen = torch.Generator().manual_seed(0)
    a = finite[torch.randint(len(finite), (500,), generator=gen)]
    b = finite[torch.randint(len(finite), (500,), generator=gen)]
    index = {v: i for i, v in enumerate(finite.tolist())}
    expected = torch.tensor([abs(index[x] - index[y]) for x, y in zip(a.tolist(), b.tolist())])
    assert torch.equal(half_ulps(a, b), expected)


def test_half_ulps_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="a and b: expected one shape"):
        half_ulps(torch.zeros(3), torch.zeros(4))


def test_ulp_summary_and_outside_tolerance_by_hand():
    a = torch.tensor([1.0, 1.0, 1.0, float("nan")])
    b = torch.tensor([1.0, 1.0 + 2**-10, 1.0 + 3 * 2**-10, 1.0])
    summary = ulp_summary(a, b)
    # distances 0, 1, 3; p99 by linear interpolation at rank 0.99 * 2 = 1.98: 1 + 0.98 * 2
    assert summary == {"median": 1.0, "p99": pytest.approx(2.96), "max": 3.0,
                       "equal": pytest.approx(1 / 3), "nonfinite": 1}  # fmt: skip
    # |a - b| <= atol + rtol * |b|: 0 and 2^-10 are inside 1e-3 * 1.001 + 0, 3 * 2^-10 is not,
    # NaN never is.
    assert outside_tolerance(a, b, rtol=1e-3, atol=0.0) == 0.5
    assert outside_tolerance(a, b, rtol=0.0, atol=0.01) == 0.25


# ------------------------------------------------------------------------------- dry run
@pytest.mark.slow
def test_dry_run_runs_every_stage_and_records_why_native_ones_cannot(tmp_path):
    proc, results, out = _validate(tmp_path)
    for stage in STAGES:
        assert f"[validate] {stage}:" in proc.stdout
    stages = results["stages"]
    assert list(stages) == STAGES
    assert stages["env"]["status"] == "ok"
    assert stages["env"]["data"]["torch"] == torch.__version__
    for name, lib in (("golden", "tcnn"), ("grid", "tcnn"), ("network", "tcnn"),
                      ("raster", "nvdiffrast")):  # fmt: skip
        assert stages[name]["status"] == "unavailable", stages[name]
        assert stages[name]["reason"] == f"{lib} needs a CUDA device (--device cpu)"
    assert stages["fp8"]["status"] == "unavailable", stages["fp8"]
    assert stages["fp8"]["reason"] == (
        "torch._scaled_mm needs a CUDA device with FP8 tensor cores (--device cpu)"
    )
    loss = stages["loss"]  # the kernels under Triton's interpreter: close, not bit-equal
    assert loss["status"] == "ok", loss
    assert [(r["loss"], r["ok"]) for r in loss["data"]["rows"]] == [
        ("logl1", True), ("l1", True), ("kd smoothness", True)]  # fmt: skip
    arms = stages["arms"]
    assert arms["status"] == "ok", arms
    ran = {run["precision"]: run for run in arms["data"]["runs"]}
    # f32 first (the reference of the ratios), the arms not judged by speed last, every arm once.
    assert list(ran) == kit.arm_order() and sorted(ran) == sorted(PrecisionPolicy.names())
    assert list(ran)[0] == "f32" and list(ran)[-3:] == list(kit.ARMS_NOT_JUDGED)
    assert all(set(run["time_split_s"]) >= {"start", "iterations"} for run in ran.values())
    assert {r["status"] for r in ran.values()} <= {"completed", "diverged"}
    assert ran["f32"]["status"] == "completed" and ran["f32"]["time_per_iter_s"] > 0
    assert all(run["backends"]["encoder"] == "torch" for run in ran.values())
    # f32 with each loop feature off, kept apart from the judged runs
    variants = arms["data"]["variants"]
    assert [v["variant"] for v in variants] == list(kit.LOOP_VARIANTS)
    assert all(v["precision"] == "f32" and v["status"] == "completed" for v in variants)
    rows = {row[0]: row for row in arms["tables"][0]["rows"]}
    # Every judged arm first (a box cuts the end), then the runs that are not judged: f32 with a
    # loop feature off, the FP8 GEMM arms with Triton's GEMMs (not on this CPU), and last the
    # arms not judged by speed.
    judged = [a for a in kit.arm_order() if a not in kit.ARMS_NOT_JUDGED]
    extra = [
        *[f"f32, {v}" for v in kit.LOOP_VARIANTS],
        *[f"{a}, {o}" for a in kit.arm_order() for o in kit.ARM_VARIANTS.get(a, ())],
    ]
    assert list(rows) == [*judged, *extra, *kit.ARMS_NOT_JUDGED]
    for arm, overrides in kit.ARM_VARIANTS.items():
        assert rows[f"{arm}, {overrides[0]}"][1].startswith("not run: cpu tensors need Triton")
    for name, stage in stages.items():  # every table well formed, "not run" rows included
        for table in stage["tables"]:
            assert all(len(r) == len(table["headers"]) for r in table["rows"]), (name, table)
    assert stages["throughput"]["status"] == "ok"
    assert any(row[0].startswith("torch float32 forward+backward")
               for row in stages["throughput"]["tables"][0]["rows"])  # fmt: skip
    study = stages["nvdiffrec154"]
    assert study["status"] == "ok" and len(study["data"]["differences"]) == 2
    assert set(study["data"]["pairs"]) == {"tcnn_fused_swap154", "tcnn_fused_dynamic"}
    assert all(len(p["differences"]) == 2 for p in study["data"]["pairs"].values())
    profile = stages["profile"]
    assert profile["status"] == "ok", profile
    assert all(len(run["top_host_ops"]) == 12 for run in profile["data"]["profile"])
    assert all(run["device_busy_ms_per_iter"] is None for run in profile["data"]["profile"])
    profiled = {row[0]: row[1] for row in profile["tables"][0]["rows"]}
    assert list(profiled) == list(kit.stages_loop.PROFILED)
    assert profiled[kit.stages_loop.TRITON].startswith("not run: cpu tensors need Triton")
    emulated = next(r for r in profile["data"]["profile"] if r["arm"] == kit.stages_loop.EMULATED)
    assert emulated["backends"]["fp8_gemm"] == "emulated"
    counted = {r["arm"]: r for r in profile["data"]["loop_overhead"]}
    assert counted["f32"]["syncs_per_iter"] <= 1.0
    floor = {r["arm"]: r["host_ms_runs"] for r in profile["data"]["host_floor"]}
    assert list(floor) == [*kit.stages_loop.PROFILE_ARMS, "fp8_rowwise"]
    assert all(len(ms) == 1 and ms[0] > 0 for ms in floor.values()), floor
    ci = study["data"]["ci"]
    assert ci["low"] <= ci["mean"] <= ci["high"]
    assert stages["tests"]["status"] == "ok"
    assert all(r[1].startswith("skipped") for r in stages["tests"]["tables"][0]["rows"])
    markdown = (out / "results.md").read_text()
    assert "## Every arm at nvdiffrec's scale (`arms`)" in markdown
    assert "| f32 | completed |" in markdown
    assert sorted(p.name for p in out.iterdir()) == ["log.txt", "results.json", "results.md"]


@pytest.mark.slow
def test_comparisons_of_the_twin_with_itself_are_exact(tmp_path):
    # The comparison stages pointed at the twin on both sides: every error is exactly 0, which
    # they are only if both sides read the same parameters, points and cotangents.
    proc, results, out = _validate(
        tmp_path, "--stages", "golden", "grid", "network", "raster", "--native-grid", "torch",
        "--native-mlp", "torch", "--native-raster", "torch",
    )  # fmt: skip
    for name in ("golden", "grid", "network", "raster"):
        assert results["stages"][name]["status"] == "ok", results["stages"][name]
    # The golden stage, fed the twins instead of the libraries: a full fixture set comes back in
    # the committed fixtures' format, one row per committed array.
    golden = results["stages"]["golden"]["data"]
    committed = sorted(p.name for p in FIXTURES.glob("*.npz"))
    if not suite_available():  # the duck's mesh is read from pybullet_data: captured without it
        committed.remove("raster_duck.npz")
    assert committed and sorted(p.name for p in (out / "golden").glob("*.npz")) == committed
    rows = {(r["file"], r["array"]): r for r in golden["arrays"]}
    assert len(rows) == len(golden["arrays"])
    for name in committed:
        with np.load(FIXTURES / name) as fixture:
            for key in fixture.files:
                assert rows[(name, key)]["status"] in ("same", "differs"), rows[(name, key)]
    grid = results["stages"]["grid"]["data"]["rows"]
    assert len(grid) == 6 and {(r["config"], r["dtype"]) for r in grid} >= {
        ("nvdiffrec", "float16"), ("2d-smoothstep", "float32")}  # fmt: skip
    assert all(r["forward_max_abs_err"] == 0 and r["grad_rel_err"] == 0 for r in grid)
    for row in results["stages"]["network"]["data"]["rows"]:
        for key in ("output", "input_grad", "weight_grad"):
            assert row[key]["max"] == 0 and row[key]["equal"] == 1.0
    raster = results["stages"]["raster"]["data"]["rows"]
    assert [r["id_agreement"] for r in raster] == [1.0] * len(raster)
    assert raster[0]["covered_pixels"] > 0


@pytest.mark.slow
def test_the_main_job_stage_runs_only_when_named_and_keeps_its_report(tmp_path):
    proc, results, out = _validate(tmp_path, "--stages", "mainjob")
    assert list(results["stages"]) == ["mainjob"]
    mainjob = results["stages"]["mainjob"]
    assert mainjob["status"] == "ok", mainjob
    assert mainjob["data"]["returncode"] == 0
    report = out / "mainjob-report.md"
    assert mainjob["data"]["report"] == str(report) and report.is_file()
    arms = {row[0] for row in mainjob["tables"][0]["rows"]}
    assert arms == {"f32", "fp8"}
    # each run's own record kept (a job stopped by its box still says which runs finished); the
    # sweep itself stays out of the results folder (in scratch space, removed at the end)
    records = {(r["precision"], r["seed"], r["status"]) for r in mainjob["data"]["runs"]}
    assert records == {("f32", 0, "completed"), ("fp8", 0, "completed")}
    assert all(r["ms_per_iter"] > 0 and r["wall_s"] > 0 for r in mainjob["data"]["runs"])
    assert sorted(p.name for p in out.iterdir()) == ["log.txt", "mainjob-report.md",
                                                     "results.json", "results.md"]  # fmt: skip


def test_the_main_job_keeps_the_kits_packages_on_the_python_path():
    # On a GPU machine Hydra and OmegaConf are importable only through the PYTHONPATH
    # validate.py sets for its stages (the kit installed into a scratch folder).
    env = kit.stages_loop.job_env({"PYTHONPATH": "/scratch/site", "HOME": "/root"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(ROOT), "/scratch/site"]
    assert env["HOME"] == "/root" and env["OMP_WAIT_POLICY"] == "passive"
    assert kit.stages_loop.job_env({})["PYTHONPATH"] == str(ROOT)


def test_a_pytest_stage_stopped_by_its_box_keeps_the_finished_tests(tmp_path, monkeypatch):
    tests = tmp_path / "test_box.py"
    tests.write_text(
        "import time\n"
        "def test_fast():\n    pass\n"
        "def test_fails():\n    assert False\n"
        "def test_hangs():\n    time.sleep(120)\n"
    )
    args = kit.argparse.Namespace(device="cpu")
    ctx = kit.StageContext(args, tmp_path / "r.json", kit.time.time() + 15)  # pytest gets 10 s
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(kit.tempfile, "tempdir", str(scratch))
    returncode, rows, last = kit._pytest_rows(ctx, [str(tests)])
    assert list(scratch.iterdir()) == []  # its JUnit report's folder removed
    names = [(row[0].split("::")[-1], row[1]) for row in rows]
    assert returncode is None, ctx.result["data"]["pytest"]["tail"]
    assert names == [("test_fast", "passed"), ("test_fails", "failed"),
                     ("test_hangs", "running when the box ran out")]  # fmt: skip
    assert last == "stopped by the stage's box after 3 tests"
    assert kit._failed_tests(returncode, rows) == [rows[1][0], "pytest: stopped by the stage's box"]


def test_a_stage_that_fails_is_recorded_and_the_next_one_runs(tmp_path):
    # An unknown backend makes the grid stage raise; the network stage still runs after it.
    proc, results, _ = _validate(
        tmp_path, "--stages", "grid", "network", "--native-grid", "nonsense",
        "--native-mlp", "torch",
    )  # fmt: skip
    grid, network = results["stages"]["grid"], results["stages"]["network"]
    assert grid["status"] == "failed" and grid["reason"] == "KeyError: 'nonsense'"
    assert network["status"] == "ok"


def test_the_speed_checks_by_hand(monkeypatch):
    order = kit.arm_order()
    assert order[0] == "f32" and order[-3:] == list(kit.ARMS_NOT_JUDGED)
    judged = [a for a in order if a != "f32" and a not in kit.ARMS_NOT_JUDGED]

    def runs(times_ms):
        return [
            {"precision": a, "status": "completed" if t else "diverged",
             "time_per_iter_s": t / 1e3 if t else None}
            for a, t in times_ms.items()
        ]  # fmt: skip

    # f32 at the target, every judged arm at 1.5x exactly: no check fails; the arms not judged
    # may be as slow as they are.
    at_limit = {"f32": 4.0, **dict.fromkeys(judged, 6.0), "f16_naive": None,
                "tcnn_fused_f32acc": 94.0, "tcnn_fused_nosplitk": 300.0}  # fmt: skip
    assert kit.speed_checks(runs(at_limit), order) == []
    # Over the f32 target, one arm over 1.5x (1.51x), one arm that did not complete, one missing.
    slow = {**at_limit, "f32": 4.1, judged[0]: 6.2, judged[1]: None}
    del slow[judged[2]]
    assert kit.speed_checks(runs(slow), order) == [
        "f32: 4.10 ms / iteration, over 4.0 ms",
        f"{judged[0]}: 1.51x f32, over 1.5x",
        f"{judged[1]}: not timed (no completed run)",
        f"{judged[2]}: not timed (no completed run)",
    ]
    assert kit.speed_checks(runs({"nvdiffrec": 3.0}), order) == [
        "f32: no completed run to compare with"
    ]
    # The targets with the FP8 GEMM arms on a variant: its runs take their arms' places.
    fp8_slow = {**at_limit, "fp8": 9.0, "fp8_current": 7.0}
    variants = [{**run, "variant": "texture.fp8_gemm=triton"}
                for run in runs({"fp8": 5.0, "fp8_current": 6.5})]  # fmt: skip
    assert kit.speed_checks(runs(fp8_slow), order) == [
        "fp8: 2.25x f32, over 1.5x", "fp8_current: 1.75x f32, over 1.5x"]  # fmt: skip
    swapped = kit.with_variant(runs(fp8_slow), variants, "texture.fp8_gemm=triton")
    assert kit.speed_checks(swapped, order) == ["fp8_current: 1.62x f32, over 1.5x"]
    assert kit.with_variant(runs(fp8_slow), variants, "train.overlap=false") == runs(fp8_slow)

    class Stage:  # what judge_arms uses of the stage's context
        def __init__(self, device="cpu"):
            self.result, self.tables, self.saved, self.device = {"data": {}}, [], 0, device

        def table(self, title, headers, rows, note=""):
            self.tables.append((title, rows))

        def save(self):
            self.saved += 1

    ctx = Stage()
    kit.judge_arms(ctx, runs(fp8_slow), variants, order)
    assert ctx.result["failed_checks"][0] == "fp8: 2.25x f32, over 1.5x" and ctx.saved == 1
    # judged again after every run: the latest verdict replaces the earlier one
    again = Stage()
    kit.judge_arms(again, runs(fp8_slow), variants, order)
    kit.judge_arms(again, runs(at_limit), [], order)
    assert "failed_checks" not in again.result
    assert ctx.result["data"]["targets_with"] == {
        "texture.fp8_gemm=triton": ["fp8_current: 1.62x f32, over 1.5x"]}  # fmt: skip
    assert ctx.tables[0][1] == [["texture.fp8_gemm=triton", "fp8_current: 1.62x f32, over 1.5x"]]
    # On CUDA every completed run must have run the fused loss (its start-up check falls back
    # to the eager loss with only a warning): the runs above name no loss backend.
    import mptex.train.fused_loss

    monkeypatch.setattr(mptex.train.fused_loss, "fused_loss_problem", lambda device, loss: None)
    ctx = Stage("cuda")
    fused = [{**run, "backends": {"loss": "triton"}} for run in runs(at_limit)]
    kit.judge_arms(ctx, fused, [], order)
    assert "failed_checks" not in ctx.result
    fused[0]["backends"] = {"encoder": "triton"}
    ctx = Stage("cuda")
    kit.judge_arms(ctx, fused, [], order)
    assert ctx.result["failed_checks"] == [
        "f32: the loss ran eager, not fused (its start-up check failed: the warning is in "
        "log.txt)"]  # fmt: skip
    assert kit.fused_loss_checks(fused, "a libdevice") == [
        "f32: the loss ran eager, not fused (the fused loss needs a libdevice)"]  # fmt: skip


def test_a_spent_budget_leaves_stages_not_run(tmp_path):
    _, results, _ = _validate(tmp_path, "--budget-s", "1", "--stages", "env", "arms")
    assert [s["status"] for s in results["stages"].values()] == ["not run", "not run"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--budget-s", "0"], "--budget-s: expected a positive number of seconds"),
        (["--arm-iterations", "0"], "--arm-iterations: expected a positive integer"),
        (["--device", "tpu"], "--device: expected cuda, cuda:N or cpu, got 'tpu'"),
    ],
)
def test_bad_options_are_one_line(tmp_path, args, message):
    proc, _, _ = _validate(tmp_path, *args, check=False)
    assert proc.returncode == 2 and message in proc.stderr


def test_an_empty_kit_is_one_line(tmp_path):
    kit = tmp_path / "kit"
    kit.mkdir()
    proc, _, _ = _validate(tmp_path, "--kit", str(kit), check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        f"validate.py: --kit {kit}: no *.whl in it (make it with pack_kit.sh)"
    )


@pytest.mark.requires_triton
def test_the_kits_libdevice_stands_in_only_where_the_machine_has_none(tmp_path, monkeypatch,
                                                                      no_cuda_toolkit):  # fmt: skip
    lt = no_cuda_toolkit
    packed = tmp_path / "kit" / "libdevice" / "cuda-13.0" / "libdevice.10.bc"
    packed.parent.mkdir(parents=True)
    packed.write_bytes(b"BC")
    kit._kit_libdevice(tmp_path / "kit")
    assert os.environ["MPTEX_LIBDEVICE"] == str(packed) and lt.torch_libdevice()[0] == str(packed)
    # A machine with a toolkit of torch's release keeps its own.
    monkeypatch.setenv("MPTEX_LIBDEVICE", "")
    own = tmp_path / "system" / "cuda-13.0" / "nvvm" / "libdevice" / "libdevice.10.bc"
    own.parent.mkdir(parents=True)
    own.write_bytes(b"BC")
    lt.torch_libdevice.cache_clear()
    kit._kit_libdevice(tmp_path / "kit")
    assert not os.environ["MPTEX_LIBDEVICE"] and lt.torch_libdevice()[0] == str(own)
    # Another release's copy is not used.
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    lt.torch_libdevice.cache_clear()
    kit._kit_libdevice(tmp_path / "kit")
    assert not os.environ["MPTEX_LIBDEVICE"]


def test_the_fp8_stage_runs_on_the_cpu_with_torchs_scaled_mm_held_to_cudas_checks(
    tmp_path, monkeypatch
):
    # The fp8 stage needs FP8 tensor cores, so the dry run skips it; here it runs with the
    # device's FP8 capability assumed and torch._scaled_mm held to what its CUDA kernels check
    # (layouts, K and N multiples of 16, alignment), so a shape or layout the GPU refuses fails
    # on the CPU first.
    from test_fp8 import _skip_without_cpu_rowwise_scaled_mm, _strict_scaled_mm

    import mptex.fp8

    _skip_without_cpu_rowwise_scaled_mm()  # the stage runs row-wise GEMMs too
    calls = []
    monkeypatch.setattr(mptex.fp8, "has_fp8_tensor_cores", lambda device, rowwise=False: True)
    monkeypatch.setattr(torch, "_scaled_mm", _strict_scaled_mm(calls))
    result = tmp_path / "fp8.json"
    args = kit.parse_args(["--device", "cpu", "--stage", "fp8", "--result-file", str(result),
                           "--deadline", str(kit.time.time() + 300)])  # fmt: skip
    ctx = kit.StageContext(args, result, args.deadline)
    kit.stage_fp8(ctx)
    assert "failed_checks" not in ctx.result, ctx.result["failed_checks"]
    titles = [t["title"] for t in ctx.result["tables"]]
    assert len(titles) == 3 and titles[2].startswith("What a call costs the host")
    rows = ctx.result["data"]["rows"] + ctx.result["data"]["rowwise"]
    assert rows and all(r["ok"] for r in rows) and calls
    for table in ctx.result["tables"]:
        assert all(len(r) == len(table["headers"]) for r in table["rows"]), table["title"]


def test_host_costs_run_every_block_on_the_cpu():
    # benchmarks/gpu/host_costs.py (the fp8 stage's last table, which needs FP8 tensor cores):
    # every block runs here too, so the probe cannot rot between GPU runs.
    spec = importlib.util.spec_from_file_location("gpu_kit_host_costs",
                                                  VALIDATE.parent / "host_costs.py")  # fmt: skip
    host_costs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host_costs)
    costs = host_costs.host_costs("cpu", 64, calls=3)
    # The Triton launch and the Triton FP8 GEMMs (the last four) run on a CPU only under
    # Triton's interpreter.
    ran, (launch, *triton) = costs[:13], costs[13:]
    assert "Triton launch" in launch["what"] and "error" in launch, launch
    assert len(triton) == 3 and all("Triton" in c["what"] for c in triton)
    assert all("error" not in c for c in ran), costs
    assert all(c["host_us"] > 0 and c["device_us"] is None for c in ran)
    assert all("'triton' cannot run on cpu" in c["error"] for c in triton), triton


def _kit_module(name: str):
    spec = importlib.util.spec_from_file_location(f"gpu_kit_{name}", VALIDATE.parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("small", [False, True])
def test_the_loss_stages_gradient_tells_the_two_divisions_apart(small):
    # The loss stage holds the fused loss's gradients to the eager ones bit for bit on the GPU,
    # where torch divides a mean's gradient by multiplying with the count's float32 reciprocal
    # and the kernels must do the same. Its gradient and sizes must make that visible: for the
    # image term's element count and for the smoothness term's pixel count followed by its
    # division by 3, dividing and multiplying by the reciprocal must round apart in float32.
    fused_loss = _kit_module("fused_loss")
    shape = fused_loss.DRY_RUN_SHAPE if small else fused_loss.SHAPE
    f32 = np.float32
    grad, pixels = f32(fused_loss.GRADIENT), f32(np.prod(shape))
    elements = pixels * f32(3)
    assert grad / elements != grad * (f32(1) / elements)
    assert (grad / pixels) / f32(3) != (grad * (f32(1) / pixels)) * (f32(1) / f32(3))
