"""The training loop at its floor: views gathered on the device, the stepper's decision on the
device, one host read per iteration (counted by benchmarks/loop_overhead.py), and the GPU preset
that refuses a machine without CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_fp8 import _skip_without_cpu_rowwise_scaled_mm
from triton_subprocess import require_faithful_interpreter

from mptex.diagnostics.overhead import OverheadCounter, patch_host_reads
from mptex.precision import PendingStep, PrecisionStepper, StepResult
from mptex.scenes import build_scene
from mptex.train.device_check import device_problem
from mptex.train.shading import render_batch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def scene():
    return build_scene({"name": "builtin", "resolution": 24, "n_train_views": 6}, "cpu")


def test_training_batch_is_the_views_batch_gathered(scene):
    # The same indices from the same generator state, and every field equal to what the
    # loop used to compute per batch from Scene.views (boolean mask, nonzero, gathers).
    batch = scene.training_batch(5, torch.Generator().manual_seed(3), normals=True)
    index = torch.randint(scene.n_train_views, (5,), generator=torch.Generator().manual_seed(3))
    views = scene.views("train", index)
    assert batch.index == index.tolist()
    covered = views.mask.reshape(-1).nonzero().squeeze(1)
    assert torch.equal(batch.rgba, views.rgba)
    assert torch.equal(batch.coverage, views.mask.unsqueeze(-1).float())
    assert torch.equal(batch.mask, views.mask)
    assert torch.equal(batch.covered, covered)
    assert torch.equal(batch.points, views.position.reshape(-1, 3)[covered])
    assert torch.equal(batch.normals, views.gbuffer.normal.reshape(-1, 3)[covered])


@pytest.mark.parametrize("shading", ["kd", "diffuse"])
def test_render_batch_bits_equal_from_a_training_batch(scene, shading):
    from mptex.texture import MLPTexture3D

    torch.manual_seed(0)
    channels = 9 if shading == "diffuse" else 3
    texture = MLPTexture3D(scene.aabb, channels=channels, encoder=dict(
        otype="HashGrid", n_levels=4, n_features_per_level=2, log2_hashmap_size=12,
        base_resolution=16, per_level_scale=2.0), internal_dims=16)  # fmt: skip
    settings = {"shading": shading, "ambient": 0.25}
    light = torch.nn.functional.normalize(torch.tensor([0.5, 0.8, 0.3]), dim=0)
    batch = scene.training_batch(3, torch.Generator().manual_seed(1), normals=True)
    views = scene.views("train", batch.index)
    background = torch.rand(views.mask.shape + (3,), generator=torch.Generator().manual_seed(2))

    def jitter(points):
        return points + 0.01 * torch.randn(points.shape, generator=torch.Generator().manual_seed(4))

    got = render_batch(texture, batch, settings, background, light, jitter)
    want = render_batch(texture, views, settings, background, light, jitter)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(64)), torch.nn.Parameter(torch.randn(8, 4))]


def _adam(params, **kw):
    return torch.optim.Adam([{"params": params[:1]}, {"params": params[1:]}], lr=0.01, **kw)


def _state(params, optimizer):
    tensors = [p.detach().clone() for p in params]
    for p in params:
        for value in optimizer.state[p].values():
            tensors.append(torch.as_tensor(value).detach().clone())
    return tensors


@pytest.mark.parametrize("arm", ["f32", "f16_dynamic", "f16_static"])
def test_device_decided_skip_leaves_weights_and_adam_bit_identical(arm):
    # fused Adam takes the stepper's found_inf (the loop's choice on CUDA; fused Adam also
    # runs on the CPU): a non-finite gradient skips the step on the device. Remove the
    # optimizer.found_inf hand-over in step_async and this fails (the step is taken).
    params = _params()
    optimizer = _adam(params, fused=True)
    stepper = PrecisionStepper(arm, optimizer)
    for step in range(3):
        optimizer.zero_grad(set_to_none=True)
        stepper.backward(sum((p * (step + 1)).square().sum() for p in params))
        pending = stepper.step_async()
        assert isinstance(pending, PendingStep) and not pending.host_decides
        result = stepper.finish(pending, pending.flags.tolist())
        assert not result.skipped
    before = _state(params, optimizer)
    scale = stepper.loss_scale
    optimizer.zero_grad(set_to_none=True)
    stepper.backward(params[0].sum() * float("inf"))
    pending = stepper.step_async()
    result = stepper.finish(pending, pending.flags.tolist())
    assert result.skipped
    assert all(torch.equal(a, b) for a, b in zip(before, _state(params, optimizer), strict=True))
    if arm == "f16_dynamic":
        assert result.loss_scale == stepper.loss_scale == scale * 0.5
    else:
        assert result.loss_scale == stepper.loss_scale == scale
        assert result.diverged == (arm == "f32")


@pytest.mark.parametrize("arm", ["f32", "f16_dynamic"])
def test_step_async_with_a_host_read_equals_step(arm):
    # The loop's split (step_async, one read, finish) takes the same steps as step().
    results, states = [], []
    for split in (False, True):
        params = _params()
        optimizer = _adam(params, foreach=True)
        stepper = PrecisionStepper(arm, optimizer)
        got = []
        for step in range(4):
            optimizer.zero_grad(set_to_none=True)
            loss = sum((p * (step + 1)).square().sum() for p in params)
            if step == 2:
                loss = loss * float("inf")
            stepper.backward(loss)
            if split:
                pending = stepper.step_async(loss)
                assert pending.host_decides
                got.append(stepper.finish(pending, pending.flags.tolist()))
            else:
                got.append(stepper.step())
        results.append(got)
        states.append(_state(params, optimizer))
    assert results[0] == results[1]
    assert results[0][2] == (StepResult(True, 1.0, True) if arm == "f32"
                             else StepResult(True, 2.0**15))  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(*states, strict=True))


def test_a_non_finite_loss_alone_skips_without_loss_scaling():
    # The loss is checked with the gradients: an inf term without a gradient path.
    params = _params()
    optimizer = _adam(params, foreach=True)
    stepper = PrecisionStepper("f32", optimizer)
    loss = params[0].sum() + torch.tensor(float("inf"))
    stepper.backward(loss)
    before = _state(params, optimizer)
    pending = stepper.step_async(loss)
    result = stepper.finish(pending, pending.flags.tolist())
    assert result == StepResult(True, 1.0, True)
    assert all(torch.equal(a, b) for a, b in zip(before, _state(params, optimizer), strict=True))


def _loop_overhead(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "loop_overhead.py"), *args],
        capture_output=True, text=True, env={**os.environ, "OMP_WAIT_POLICY": "passive"},
    )  # fmt: skip


@pytest.mark.parametrize("arm", ["f32", "tcnn_fused", "f16_dynamic"])
def test_the_loop_reads_the_host_once_per_iteration(tmp_path, arm):
    # benchmarks/loop_overhead.py's count on a small run: one host read per iteration (the
    # loss, the step's flags and, every stats_interval, the statistics, in one copy; with the
    # fused network's twin its own statistics too; under GradScaler its found_inf and scale
    # among the flags). Reading the loss apart again (float(loss)) makes it 2.
    out = tmp_path / "overhead.json"
    run = _loop_overhead("--arms", arm, "--start", "2", "--stop", "8", "--resolution", "24",
                         "--texture", "tiny", "--json", str(out), "--", "scene.n_train_views=4",
                         "scene.n_val_views=1", "train.stats_interval=3")  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    (result,) = json.loads(out.read_text())["results"]
    assert result["status"] == "completed"
    assert result["syncs_per_iter"] == 1.0, result["sync_sites"]
    assert result["syncs_by_kind"] == {"copy to host (tolist)": 1.0}


def _count_fp8(tmp_path, gemm: str, arm: str = "fp8", *options: str) -> dict:
    """``arm``'s counts over iterations [2, 4) at 16 x 16 with ``--fp8-gemm gemm``; one
    sync."""
    out = tmp_path / f"{arm}-{gemm}{''.join(options)}.json"
    run = _loop_overhead("--arms", arm, "--start", "2", "--stop", "4", "--resolution", "16",
                         "--texture", "tiny", "--fp8-gemm", gemm, *options, "--json", str(out),
                         "--", "scene.n_train_views=4", "scene.n_val_views=1")  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    payload = json.loads(out.read_text())
    assert payload["fp8_gemm"] == gemm
    (result,) = payload["results"]
    assert result["syncs_per_iter"] == 1.0, result["sync_sites"]
    return result


@pytest.mark.requires_triton
@pytest.mark.parametrize(
    "arm, kernel",
    [("fp8_current", "triton:scale_cast_kernel"), ("fp8_rowwise", "triton:rowwise_both_kernel")],
)
def test_the_quantisations_can_be_counted_as_cuda_launches(tmp_path, arm, kernel):
    # --fp8-quantize triton: each quantisation in its Triton kernels under the interpreter,
    # each launch an op, where the op mptex::fp8_quantize counted one; every other op the
    # same (both runs interpret the other Triton kernels too: --fused-loss).
    require_faithful_interpreter()
    if arm == "fp8_rowwise":
        _skip_without_cpu_rowwise_scaled_mm()  # its GEMMs on this CPU's torch._scaled_mm
    counts = {q: _count_fp8(tmp_path, "scaled_mm", arm, "--fused-loss", "--fp8-quantize", q)
              for q in ("auto", "triton")}  # fmt: skip
    auto, triton = (counts[q]["ops_by_name"] for q in ("auto", "triton"))
    assert auto["fp8_quantize"] > 0 and "fp8_quantize" not in triton and triton[kernel] > 0
    added = {k: v for k, v in triton.items() if k not in auto}
    assert (
        all(k.startswith("triton:") for k in added) and sum(added.values()) >= auto["fp8_quantize"]
    )
    assert {k: v for k, v in auto.items() if k not in ("fp8_quantize", "empty")} == {
        k: v for k, v in triton.items() if k not in added and k != "empty"
    }


def test_the_fp8_gemms_can_be_counted_as_on_a_gpu(tmp_path):
    # --fp8-gemm scaled_mm: the FP8 arm's GEMMs go through torch._scaled_mm (its CPU kernel),
    # the path a GPU with FP8 tensor cores takes, so its padding and layout copies are counted.
    counts = {gemm: _count_fp8(tmp_path, gemm)["ops_by_name"] for gemm in ("auto", "scaled_mm")}
    assert counts["auto"].get("_scaled_mm", 0) == 0 and counts["auto"]["mm"] > 0
    assert counts["scaled_mm"]["_scaled_mm"] == counts["auto"]["mm"]
    assert counts["scaled_mm"].get("mm", 0) == 0


@pytest.mark.requires_triton
def test_the_triton_fp8_gemms_are_counted_as_launches_without_copies(tmp_path):
    # --fp8-gemm triton: each GEMM one interpreted launch (at this size no split of K), where
    # the scaled_mm path pads some of its operands in copies first (this texture's 8 encoder
    # outputs and 3 colour outputs are not multiples of 16). Launches: ops less the
    # allocations (``empty``: no kernel), which the Triton GEMMs' outputs add.
    require_faithful_interpreter()
    counts = {gemm: _count_fp8(tmp_path, gemm) for gemm in ("scaled_mm", "triton")}
    scaled, triton = counts["scaled_mm"]["ops_by_name"], counts["triton"]["ops_by_name"]
    assert triton["triton:mm_kernel"] == scaled["_scaled_mm"] > 0
    assert "_scaled_mm" not in triton and "new_zeros" not in triton and scaled["new_zeros"] > 0
    launches = {gemm: c["ops_per_iter"] - c["ops_by_name"].get("empty", 0)
                for gemm, c in counts.items()}  # fmt: skip
    assert launches["triton"] < launches["scaled_mm"], launches


@pytest.mark.requires_triton
def test_the_fused_loss_can_be_counted_as_on_a_gpu(tmp_path):
    # --fused-loss: the image loss runs in its Triton kernels under the interpreter, each
    # launch one op (the interpreter's own copies kept out), the eager loss's ops gone.
    counts = {}
    for fused in (False, True):
        out = tmp_path / f"{fused}.json"
        run = _loop_overhead("--arms", "f32", "--start", "2", "--stop", "4", "--resolution",
                             "16", "--texture", "tiny", *(["--fused-loss"] if fused else []),
                             "--json", str(out), "--", "scene.n_train_views=4",
                             "scene.n_val_views=1")  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
        payload = json.loads(out.read_text())
        assert payload["fused_loss"] is fused
        (result,) = payload["results"]
        assert result["syncs_per_iter"] == 1.0, result["sync_sites"]
        counts[fused] = result
    eager, fused = counts[False], counts[True]
    assert fused["ops_by_name"]["triton:partials_kernel"] == 1.0
    assert fused["ops_by_name"]["triton:grad_kernel"] == 1.0
    assert "log" not in fused["ops_by_name"] and eager["ops_by_name"]["log"] == 2.0
    assert fused["ops_per_iter"] <= eager["ops_per_iter"] - 40


def test_host_time_is_each_runs_median_per_arm(tmp_path):
    # --host-ms: per arm, one median iteration time per run, the runs taken in turn; the table
    # gives each arm's ratio to f32.
    out = tmp_path / "host.json"
    run = _loop_overhead("--host-ms", "--arms", "f32", "fp8", "--host-runs", "2",
                         "--json", str(out))  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert [r["arm"] for r in results] == ["f32", "fp8"]
    for r in results:
        assert len(r["host_ms_runs"]) == 2 and all(0 < t < 1000 for t in r["host_ms_runs"]), r
    assert "x f32" in run.stdout and "| fp8 " in run.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["--host-runs", "0"], "--host-runs: expected at least 1, got 0"),
        (["--resolution", "32"], "--resolution: --host-ms times every iteration at 8 x 8"),
    ],
)
def test_host_time_refuses_what_it_cannot_honour(args, message):
    run = _loop_overhead("--host-ms", "--arms", "f32", *args)
    assert run.returncode == 2
    assert message in run.stderr


def test_the_counter_sees_reads_and_data_sized_ops():
    counter = OverheadCounter(torch.device("cpu"))
    undo = patch_host_reads([counter])
    try:
        x = torch.arange(6.0)
        with counter:
            float(x.sum())
            x[x > 2].sum()
            x.nonzero()
            x.tolist()
            torch.tensor([1.0, 2.0])  # host data, no device: not a sync
            x.view(2, 3).t()  # views: not ops
    finally:
        undo()
    assert dict(counter.syncs) == {
        ("step", "read (.item/bool/float)"): 1,
        ("step", "data-sized (index by a boolean mask)"): 1,
        ("step", "data-sized (nonzero)"): 1,
        ("step", "copy to host (tolist)"): 1,
    }
    # sum, the read itself, gt, index, sum, nonzero
    assert sum(counter.ops.values()) == 6


def test_in_a_device_run_a_host_tensors_read_is_not_a_second_sync():
    # A run on a device reads its values as to_host(x).tolist(): the copy is the one sync
    # (counted by the dispatch mode on the device); the read of its host result waits for
    # nothing. No CUDA here: the counter is told the run's device, the tensor stays on the CPU.
    counter = OverheadCounter(torch.device("cuda"))
    undo = patch_host_reads([counter])
    try:
        with counter:
            torch.arange(3.0).tolist()
            torch.arange(3.0).numpy()
    finally:
        undo()
    assert dict(counter.syncs) == {}


def test_in_a_device_run_host_data_copied_to_the_device_is_a_launch_and_a_sync():
    # Host data (torch.tensor without a device) moved to the run's device is a copy that
    # waits for the host, and what it made is the device's: later ops on it are launches.
    # The meta device stands in for a GPU (no CUDA here).
    counter = OverheadCounter(torch.device("meta"))
    undo = patch_host_reads([counter])
    try:
        with counter:
            host = torch.tensor([1.0, 2.0])
            host * 2  # host data only: no launch
            on_device = host.to("meta")
            on_device * 2
    finally:
        undo()
    assert dict(counter.syncs) == {("step", "copy host<->device"): 1}
    assert dict(counter.ops) == {("step", "_to_copy"): 1, ("step", "mul"): 1}
    assert dict(counter.host_ops) == {("step", "mul"): 1}


def test_waits_for_the_device_outside_the_dispatcher_are_syncs(monkeypatch):
    # torch.cuda.synchronize and a stream's or an event's synchronize block the host without
    # an op: each counts. Stand-ins for the waits themselves, with or without a GPU.
    for owner in (torch.cuda, torch.cuda.Stream, torch.cuda.Event):
        monkeypatch.setattr(owner, "synchronize", lambda *args, **kwargs: None)
    originals = torch.cuda.synchronize, torch.cuda.Event.synchronize
    counter = OverheadCounter(torch.device("cuda"))
    undo = patch_host_reads([counter])
    try:
        torch.cuda.synchronize()
        torch.cuda.Event.synchronize(None)
        torch.cuda.Stream.synchronize(None)
    finally:
        undo()
    assert (torch.cuda.synchronize, torch.cuda.Event.synchronize) == originals
    assert dict(counter.syncs) == {
        ("step", "wait for the device (torch.cuda.synchronize)"): 1,
        ("step", "wait for the device (Event.synchronize)"): 1,
        ("step", "wait for the device (Stream.synchronize)"): 1,
    }


def test_device_check_names_what_is_missing():
    assert device_problem("cpu") is None
    if not torch.cuda.is_available():
        assert "needs a CUDA GPU" in device_problem("cuda")
    assert "train.device" in device_problem("nonsense")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_gpu_preset_refuses_a_machine_without_cuda_in_one_line(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "passive"}
    run = subprocess.run(
        ["mptex-train", "-m", "+experiment=gpu_main", f"hydra.sweep.dir={tmp_path / 's'}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 2
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert lines == [
        "mptex-train: error: this preset needs a CUDA GPU and none is available here "
        "(train.device=cuda)"
    ]


def test_gpu_preset_is_nvdiffrecs_scale():
    from hydra import compose, initialize_config_dir

    from mptex.cli import CONFIG_DIR, register_experiments
    from mptex.precision import PrecisionPolicy

    assert "gpu_main" in register_experiments()
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["+experiment=gpu_main"], return_hydra_config=True)
    params = cfg.hydra.sweeper.params
    assert set(str(params.precision).split(",")) <= set(PrecisionPolicy.names())
    assert len(str(params["train.seed"]).split(",")) == 5
    assert (cfg.scene.resolution, cfg.train.batch_size, cfg.train.device) == (512, 4, "cuda")
    assert cfg.texture.encoder.log2_hashmap_size == 19 and cfg.texture.encoder.n_levels == 16


@pytest.mark.slow
def test_gpu_preset_runs_at_test_size_on_the_cpu_and_reports(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "passive",
           "PYTHONPATH": str(ROOT)}  # fmt: skip
    small = ["precision=f32,fp8", "train.seed=0", "train.device=cpu", "texture=tiny",
             "train.iterations=2", "train.val_interval=1", "train.n_val_images=1",
             "scene.resolution=24", "scene.n_train_views=2", "scene.n_val_views=1",
             f"hydra.sweep.dir={tmp_path / 's'}"]  # fmt: skip
    command = [sys.executable, "-m", "mptex.cli", "-m", "+experiment=gpu_main", *small]
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(list((tmp_path / "s").glob("*/metrics.json"))) == 2
    assert (tmp_path / "s" / "report.md").is_file()
