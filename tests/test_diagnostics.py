"""Diagnostics: statistics on constructed tensors, the monitor in a training loop (f16_naive's
underflow made visible), the gradient-flow check, host copies, and compare_setups catching and
localising injected faults while passing every healthy arm."""

import json
import math
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from mptex import MLPTexture3D, PrecisionPolicy, PrecisionStepper
from mptex.diagnostics import (
    TEXTURE_CONFIGS,
    PrecisionMonitor,
    Setup,
    check_gradient_flow,
    compare_setups,
    saturation_statistics,
    subnormal_threshold,
    tensor_statistics,
    to_host,
)

PACKAGE = Path(__file__).resolve().parents[1] / "mptex"
AABB = [[-1.0, -1.0, -1.0], [1.0, 1.0, 1.0]]
CPU_ARMS = [n for n in PrecisionPolicy.names() if PrecisionPolicy.named(n).mlp == "linear"]
# compare_setups' bounds model dtypes; the quantised arms are refused (tested below).
DTYPE_ARMS = [n for n in CPU_ARMS if not PrecisionPolicy.named(n).quantized]


def _texture(arm="f32", seed=0):
    torch.manual_seed(seed)
    return MLPTexture3D(AABB, precision=arm, backend="torch", **TEXTURE_CONFIGS["small"])


def _batch(n=2048, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, generator=gen) * 2 - 1, torch.rand(n, 3, generator=gen)


# ----------------------------------------------------------------------------- statistics
def test_subnormal_thresholds():
    assert subnormal_threshold(torch.float16) == 2.0**-14
    assert subnormal_threshold(torch.bfloat16) == 2.0**-126
    assert subnormal_threshold(torch.float32) == 2.0**-126


def test_statistics_reproduce_constructed_counts():
    # 1024 elements: 100 zeros, 37 f16-subnormal (both signs, down to the smallest), 3 inf/NaN,
    # the rest normal; the largest finite magnitude is 7.5.
    values = torch.full((1024,), 0.5, dtype=torch.float16)
    values[:100] = 0
    values[100:137] = torch.tensor([2.0**-24, -(2.0**-15), 2.0**-14 - 2.0**-24] * 12 + [1e-6])
    values[137:140] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    values[140] = -7.5
    values[141] = 2.0**-14  # the smallest normal: not subnormal
    stats = tensor_statistics(values)
    # Power-of-two numel: the fractions are exact.
    assert stats == {
        "zero_frac": 100 / 1024,
        "subnormal_frac": 37 / 1024,
        "nonfinite_frac": 3 / 1024,
        "maxabs": 7.5,
    }
    # The f32 master copy of an f16 gradient holds the same values: same counts with dtype=f16,
    # none subnormal in f32's own range.
    assert tensor_statistics(values.float(), torch.float16) == stats
    assert tensor_statistics(values.float())["subnormal_frac"] == 0.0


@pytest.mark.parametrize("tensor_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("int32_below", [2**30, 4])
def test_statistics_match_a_per_element_count(monkeypatch, tensor_dtype, int32_below):
    # Every class of value at its edges: 0 and -0, the dtype's smallest positive subnormal (not
    # a zero), its largest subnormal and smallest normal, tiny(f16) (below which an f32 master
    # holds f16 subnormals), +-inf, NaN, normal values; with the counts summed in int32 and,
    # below 4 elements, in int64.
    import mptex.train.monitor as monitor

    monitor._thresholds.cache_clear()
    monkeypatch.setattr(monitor, "_INT32_COUNTS", int32_below)
    smallest = torch.nextafter(torch.zeros((), dtype=tensor_dtype),
                               torch.ones((), dtype=tensor_dtype)).item()  # fmt: skip
    tiny = torch.finfo(tensor_dtype).tiny
    edges = [0.0, -0.0, smallest, -smallest, tiny - smallest, tiny, 2.0**-14, 2.0**-14 * 0.75,
             float("inf"), float("-inf"), float("nan"), 1.0, -3.5, 1e-3]  # fmt: skip
    values = torch.tensor(edges * 3, dtype=tensor_dtype)
    for dtype in (tensor_dtype, torch.float16, torch.float32):
        bound = torch.tensor(torch.finfo(dtype).tiny, dtype=tensor_dtype).item()
        mags = [abs(v) for v in values.tolist()]
        zero = sum(m == 0 for m in mags)
        below = sum(m < bound for m in mags)
        finite = [m for m in mags if math.isfinite(m)]
        n = len(mags)
        assert tensor_statistics(values, dtype) == {
            "zero_frac": zero / n,
            "subnormal_frac": (below - zero) / n,
            "nonfinite_frac": (n - len(finite)) / n,
            "maxabs": max(finite),
        }, dtype
    monitor._thresholds.cache_clear()


def test_merged_counts_leave_int32_before_they_could_pass_its_range():
    from mptex.train.monitor import _Tally

    a, b = _Tally(torch.zeros(4), torch.float32), _Tally(torch.ones(4), torch.float32)
    assert a.below.dtype == torch.int32
    a.numel = b.numel = 2**30  # as if each had counted 2**30 elements
    merged = a.merge(b)
    assert merged.below.dtype == torch.int64 and merged.below.tolist() == [4, 4, 8]


def test_statistics_bf16_threshold_and_bad_input():
    values = torch.tensor([0.0, 1e-39, 1.0, 1e-30], dtype=torch.float32)  # 1e-39 < 2^-126
    assert tensor_statistics(values, torch.bfloat16)["subnormal_frac"] == 0.25
    with pytest.raises(ValueError, match="tensor"):
        tensor_statistics(torch.arange(3))


def _train(arm, monitor_every=2, steps=5):
    texture = _texture(arm)
    points, target = _batch()
    optimizer = torch.optim.Adam(texture.parameters(), lr=1e-2, eps=1e-4)
    stepper = PrecisionStepper(arm, optimizer)
    monitor = PrecisionMonitor(texture, every=monitor_every)
    history = []
    for it in range(steps):
        optimizer.zero_grad(set_to_none=True)
        monitor.start(it)
        loss = nn.functional.mse_loss(texture.sample(points), target)
        stepper.backward(loss)
        result = stepper.step()
        stats = monitor.collect(result)
        if stats is not None:
            history.append(stats)
    monitor.remove()
    return history


def test_monitor_keys_sampling_and_json():
    history = _train("f16_dynamic")
    assert [h["iteration"] for h in history] == [0, 2, 4]
    stats = history[-1]
    json.dumps(stats)  # plain floats/bools: goes into metrics.json as is
    for site in ("encoder", "net.0", "net.1", "net.2"):
        for key in ("grad_zero_frac", "grad_subnormal_frac", "grad_nonfinite_frac", "grad_maxabs",
                    "act_maxabs", "act_nonfinite_frac", "out_grad_zero_frac",
                    "out_grad_subnormal_frac", "out_grad_nonfinite_frac"):  # fmt: skip
            assert 0.0 <= stats[f"{site}.{key}"] < float("inf"), (site, key)
    assert stats["loss_scale"] == 65536.0 and stats["skipped"] is False
    with pytest.raises(ValueError, match="every"):
        PrecisionMonitor(_texture(), every=0)


def test_monitor_records_the_fused_twins_half_statistics_on_sampled_iterations_only():
    history = _train("tcnn_fused")
    assert [h["iteration"] for h in history] == [0, 2, 4]
    texture_layers = 3  # TEXTURE_CONFIGS["small"]: hidden=2 -> three weight matrices
    for stats in history:
        json.dumps(stats)
        for layer in range(texture_layers):
            for name in ("absorbed_frac", "zero_frac", "subnormal_frac", "scaled_zero_frac",
                         "flushed_by_unscale_frac"):  # fmt: skip
                assert 0.0 <= stats[f"net.{layer}.fused_{name}"] <= 1.0, (layer, name)
    # tcnn's x128 is undone in half: entries below 2**-24 * 128 of the scaled gradient flush to
    # zero there, so the unscaled gradient has at least as many zeros as the scaled one.
    last = history[-1]
    assert last["net.0.fused_zero_frac"] >= last["net.0.fused_scaled_zero_frac"]
    # Between samples the twin does not pay for its statistics.
    texture = _texture("tcnn_fused")
    monitor = PrecisionMonitor(texture, every=2)
    assert monitor.start(0) and texture.net.net.collect_stats
    monitor.collect()
    assert not monitor.start(1) and not texture.net.net.collect_stats


@pytest.mark.parametrize(
    "arm", ["fp8", "fp8_current", "fp8_rowwise", "int8_qat", "fp8_qat", "fp8_rowwise_qat"]
)
def test_monitor_records_quantisation_statistics_per_layer(arm):
    history = _train(arm)
    assert [h["iteration"] for h in history] == [0, 2, 4]
    fp8 = PrecisionPolicy.named(arm).fp8_gemm
    rowwise = arm.startswith("fp8_rowwise")
    per_role = ["amax", "scale", "overflows", "nonfinite", "rel_error", "underflow_frac"]
    per_role += ["scale_spread", "tensor_underflow_frac"] if rowwise else []
    names = (
        [f"{role}_{name}" for role in ("input", "weight", "grad") for name in per_role]
        if fp8 else ["w_rel_error", "w_underflow_frac"]
    )  # fmt: skip
    if rowwise and not fp8:
        names += ["x_rel_error", "x_underflow_frac", "x_scale_spread", "w_scale_spread",
                  "x_tensor_underflow_frac", "w_tensor_underflow_frac"]  # fmt: skip
    for stats in history:
        json.dumps(stats)
        for layer in range(3):
            for name in names:
                assert math.isfinite(stats[f"net.{layer}.q_{name}"]), (layer, name)
    last = history[-1]
    # E4M3 keeps 3 fraction bits (relative rounding error at most 2**-4 per normal value),
    # int8 at most half a step of 1/127 of the row's largest weight per value.
    worst = 2.0**-4 if arm != "int8_qat" else 0.5 / 127 * 32**0.5
    for layer in range(3):
        error = last[f"net.{layer}.q_{'weight_rel_error' if fp8 else 'w_rel_error'}"]
        assert 0.0 < error <= worst, (layer, error)
    if fp8:
        assert last["net.0.q_weight_amax"] > 0 and last["net.0.q_input_scale"] > 0
        assert last["net.0.q_grad_nonfinite"] == 0.0
    if rowwise:
        # Row scales of a trained layer differ, and one scale per tensor flushes at least as
        # many values as one per row (the row's amax is never above the tensor's).
        spread = "weight_scale_spread" if fp8 else "w_scale_spread"
        assert all(last[f"net.{layer}.q_{spread}"] > 0 for layer in range(3))
        own, one = (("input_underflow_frac", "input_tensor_underflow_frac") if fp8
                    else ("x_underflow_frac", "x_tensor_underflow_frac"))  # fmt: skip
        for layer in range(3):
            assert last[f"net.{layer}.q_{one}"] >= last[f"net.{layer}.q_{own}"]
    # Between samples the layers do not pay for the error statistics.
    texture = _texture(arm)
    monitor = PrecisionMonitor(texture, every=2)
    assert monitor.start(0) and all(layer.collect_stats for layer in texture.net.layers)
    monitor.collect()
    assert not monitor.start(1) and not any(layer.collect_stats for layer in texture.net.layers)


def test_compare_setups_refuses_a_quantised_arm_in_one_line():
    with pytest.raises(ValueError, match="^setup: fp8 quantises its MLP") as info:
        compare_setups("small", "f32", "fp8", points=64)
    assert "\n" not in str(info.value)


def test_f16_naive_underflow_is_visible_and_loss_scaling_removes_it():
    """The mechanism by which f16_naive loses quality: without a loss scale, the gradients of a
    mean loss are mostly subnormal (or zero) in f16; f16_dynamic's x65536 keeps them normal."""
    naive, dynamic = _train("f16_naive")[-1], _train("f16_dynamic")[-1]
    for key in ("net.0.grad_subnormal_frac", "net.1.grad_subnormal_frac",
                "encoder.out_grad_subnormal_frac", "net.2.out_grad_subnormal_frac"):  # fmt: skip
        assert naive[key] > 0.5, key  # measured: 0.95-1.0
        assert dynamic[key] < 0.01, key  # measured: <= 0.001
    assert naive["loss_scale"] == 1.0


def test_monitor_merges_several_forwards_and_is_idle_between_samples():
    texture = _texture("f32")
    monitor = PrecisionMonitor(texture, every=10)
    points, _ = _batch(64)
    assert monitor.start(3) is False
    texture.sample(points).sum().backward()
    assert monitor.collect() is None and not monitor._acc  # nothing computed off-sample
    assert monitor.start(10) is True
    (texture.sample(points).sum() + texture.sample(points * 0.5).sum()).backward()
    stats = monitor.collect()
    assert stats["iteration"] == 10 and "loss_scale" not in stats
    assert stats["net.2.act_maxabs"] > 0


def test_monitor_records_the_output_saturation_per_channel():
    texture = _texture("f32")
    monitor = PrecisionMonitor(texture, every=1)
    points, _ = _batch(256)
    monitor.start(0)
    texture.sample(points)
    healthy = monitor.collect()
    # tcnn's grid init (|entries| <= 1e-4) keeps every logit near 0: nothing saturates.
    assert [healthy[f"output.saturated_frac.{c}"] for c in range(3)] == [0.0, 0.0, 0.0]
    with torch.no_grad():
        texture.encoder.params.mul_(1e4)  # features of order 1
        last = texture.net.layers[-1].weight
        last.copy_(torch.tensor([1e3, 0.0, -1e3])[:, None].expand_as(last))
    logits = []
    hook = texture.net.register_forward_hook(lambda module, args, out: logits.append(out))
    monitor.start(1)
    texture.sample(points)
    texture.sample(points[:64])  # a second forward (the smoothness term's) is merged
    stats = monitor.collect()
    hook.remove()
    saturation = saturation_statistics(torch.cat(logits))
    assert [stats[f"output.saturated_frac.{c}"] for c in range(3)] == pytest.approx(
        saturation["saturated_fraction"]
    )
    assert stats["output.saturated_frac.0"] > 0.9 and stats["output.saturated_frac.2"] > 0.9
    assert stats["output.saturated_frac.1"] == 0.0  # a zero row of weights: logit exactly 0


def test_saturation_statistics_hand_computed():
    logits = torch.tensor([
        [9.0, 0.0, -9.0, 50.0],  # ch 0, 2 saturated and right; ch 3 has no reference
        [7.9, -8.5, 0.0, 0.0],  # ch 0 wrong but just short of saturated; ch 1 stuck
        [-100.0, 8.01, 0.0, 0.0],  # ch 0 and ch 1 stuck
        [12.0, 0.0, 30.0, 0.0],  # ch 0, 2 saturated and wrong, but no surface in the reference
    ])  # fmt: skip
    values = torch.sigmoid(logits[:, :3])
    reference = torch.tensor([
        [1.0, 0.5, 0.0],
        [0.5, 0.5, 0.5],
        [0.95, 0.0, 0.5],
        [0.0, 0.5, 0.0],
    ])  # fmt: skip
    valid = torch.tensor([True, True, True, False])
    got = saturation_statistics(logits, values, reference, valid)
    assert got["saturated_fraction"] == [3 / 4, 2 / 4, 2 / 4, 1 / 4]
    assert got["stuck_fraction"] == [1 / 4, 2 / 4, 0.0, None]
    assert got["covered_pixels"] == 4 and got["threshold_logit"] == 8.0
    assert got["stuck_tolerance"] == 0.1

    # The stuck pixels' share of the squared error, in sRGB clamped to [0, 1] (the PSNR's):
    # rows 1 and 2 hold stuck channels; row 3 is not a valid pixel.
    def srgb(v):
        v = max(0.0, min(1.0, v))
        return v * 12.92 if v <= 0.0031308 else 1.055 * v ** (1 / 2.4) - 0.055

    errors = [sum((srgb(float(a)) - srgb(float(b))) ** 2 for a, b in zip(v, r))
              for v, r in zip(values.tolist(), reference.tolist())][:3]  # fmt: skip
    assert got["stuck_error_fraction"] == pytest.approx((errors[1] + errors[2]) / sum(errors))
    # Without a valid mask the reference-less row counts: ch 0 and ch 2 gain a stuck pixel.
    assert saturation_statistics(logits, values, reference)["stuck_fraction"] == [
        2 / 4, 2 / 4, 1 / 4, None
    ]  # fmt: skip
    assert saturation_statistics(logits)["stuck_fraction"] is None
    assert saturation_statistics(logits)["stuck_error_fraction"] is None
    with pytest.raises(ValueError, match="values, reference"):
        saturation_statistics(logits, values[:2], reference[:2])


# ----------------------------------------------------------------------------- gradient flow
def test_gradient_flow_healthy_and_detached():
    texture = _texture()
    points, target = _batch(256)
    assert check_gradient_flow(texture, (texture.sample(points) - target).square().mean()) == []
    # A detached tensor in the middle of the graph: everything upstream (the encoder table)
    # gets no gradient; the layers downstream still do.
    handle = texture.encoder.register_forward_hook(lambda module, inputs, out: out.detach())
    problems = check_gradient_flow(texture, texture.sample(points).sum())
    handle.remove()
    assert len(problems) == 1 and problems[0].startswith("encoder.params: no gradient")


def test_gradient_flow_nan_zero_and_broken_loss():
    texture = _texture()
    points, _ = _batch(256)
    with torch.no_grad():
        texture.net.layers[0].weight[0, 0] = float("nan")
    problems = check_gradient_flow(texture, texture.sample(points).sum())
    assert any(p.startswith("net.net.0.weight: inf/NaN") for p in problems)
    texture = _texture()
    assert check_gradient_flow(texture, texture.sample(points).sum() * 0) == [
        f"{name}: all-zero gradient ({p.numel()} elements)"
        for name, p in texture.named_parameters()
    ]
    with torch.no_grad():
        loss = texture.sample(points).sum()
    with pytest.raises(ValueError, match="loss: does not require grad"):
        check_gradient_flow(texture, loss)


# ----------------------------------------------------------------------------- host copies
def test_to_host_copies_nested_structures():
    value = {"a": torch.arange(4.0), "b": [torch.ones(2, requires_grad=True), 3], "c": "x"}
    host = to_host(value)
    assert host["a"].device.type == "cpu" and torch.equal(host["a"], torch.arange(4.0))
    assert not host["b"][0].requires_grad and host["b"][1] == 3 and host["c"] == "x"


@pytest.mark.requires_cuda
def test_to_host_waits_for_a_big_kernel_on_cuda():
    x = torch.randn(4096, 4096, device="cuda")
    expected = (x.double() @ x.double()).sum().cpu()
    for _ in range(3):
        y = x @ x  # queued asynchronously; to_host must wait for it
    value = to_host(y.sum())
    torch.testing.assert_close(value.double(), expected, rtol=1e-3, atol=1e-2)


def test_no_unsynchronised_non_blocking_copies_in_the_package():
    """A non_blocking device-to-host copy is read before it lands unless the stream is
    synchronised; the package makes none (lint over the source)."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        for match in re.finditer(r"non_blocking\s*=\s*True", text):
            window = text[match.end() : match.end() + 400]
            if "synchronize" not in window:
                offenders.append(f"{path.name}:{text[: match.start()].count(chr(10)) + 1}")
    assert offenders == []


# ----------------------------------------------------------------------------- compare_setups
# nvdiffrec_scale1 is nvdiffrec without the x128 on the grid's incoming gradient: the #154
# mechanism, flagged on purpose (test_training_sized_gradients_flag_the_grid_without_x128).
@pytest.mark.parametrize("arm", [a for a in DTYPE_ARMS if a != "nvdiffrec_scale1"])
def test_every_healthy_arm_is_within_its_bounds(arm):
    # f16_naive is healthy only for gradients far larger than training's (see the next test).
    scale = 1 / 1024 if arm == "f16_naive" else None
    report = compare_setups("small", "f32", arm, points=1024, seed=0, cotangent_scale=scale)
    assert report.ok, report.format_table()
    worst = max(e.local / e.bound for errors in report.errors.values() for e in errors)
    assert worst < 0.5  # calibration margin of SAFETY (measured <= 0.21)


def test_training_sized_gradients_flag_the_grid_without_x128():
    """nvdiffrec #154's mechanism: without nvdiffrec's x128 on the gradient entering the f16
    grid (what swapping _MLP for tcnn's network removes), training-sized gradients underflow
    there; with it (nvdiffrec) they do not."""
    unscaled = compare_setups("small", "f32", "nvdiffrec_scale1", points=1024, seed=0)
    assert not unscaled.ok
    assert unscaled.first_exceeding[unscaled.setups[1]] == "encoder.out.grad"
    assert compare_setups("small", "f32", "nvdiffrec", points=1024, seed=0).ok


def test_training_sized_gradients_flag_the_arm_without_loss_scaling():
    """By default the cotangent is as small as training's (~1e-5), where f16
    gradients without loss scaling fall into the subnormal range; f16_dynamic's scale saves
    them."""
    naive = compare_setups("small", "f32", "f16_naive", points=1024, seed=0)
    assert not naive.ok and naive.first_exceeding[naive.setups[1]].endswith(".grad")
    assert compare_setups("small", "f32", "f16_dynamic", points=1024, seed=0).ok


def _bf16_layer(texture):
    texture.net.layers[1].compute_dtype = torch.bfloat16  # declares f32, computes bf16


def _dropout(texture):
    texture.net.net.insert(4, nn.Dropout(0.1))  # after net.1's ReLU, before net.2


def test_wrong_dtype_layer_is_localised():
    report = compare_setups("small", "f32", Setup("f32", modify=_bf16_layer), points=1024)
    a, b = report.setups
    assert report.first_exceeding == {a: None, b: "net.1"} and not report.ok
    by_stage = {e.stage: e for e in report.errors[b]}
    assert not by_stage["encoder"].exceeds and not by_stage["net.0"].exceeds
    # The error flows downstream, but only the stage that made it is blamed.
    assert by_stage["net.2"].max_abs > 1e-4 and not by_stage["net.2"].exceeds
    # Within an f16 setup too: bf16 where f16 is declared exceeds f16's bound.
    f16 = compare_setups("small", "f16_dynamic", Setup("f16_dynamic", modify=_bf16_layer),
                         points=1024)  # fmt: skip
    assert f16.first_exceeding[f16.setups[1]] == "net.1"


def test_dropout_left_in_train_mode_is_localised_and_eval_passes():
    report = compare_setups("small", "f32", Setup("f32", modify=_dropout), points=1024)
    assert report.first_exceeding[report.setups[1]] == "net.2"
    evaluated = compare_setups("small", "f32", Setup("f32", modify=_dropout, mode="eval"))
    assert evaluated.ok


def test_detached_tensor_shows_as_missing_gradient():
    def detach(texture):
        texture.encoder.register_forward_hook(lambda module, inputs, out: out.detach())

    report = compare_setups("small", "f32", Setup("f32", modify=detach), points=512)
    errors = {e.stage: e for e in report.errors[report.setups[1]]}
    assert report.first_exceeding[report.setups[1]] == "encoder.out.grad"
    assert errors["encoder.params.grad"].exceeds and errors["encoder.params.grad"].local == float(
        "inf"
    )


def test_no_grad_mode_and_report_outputs(tmp_path):
    report = compare_setups("small", "f32", Setup("f16_dynamic", mode="no_grad"), points=256)
    b = report.setups[1]
    assert report.ok and [e.stage for e in report.errors[b]] == [
        "encoder", "net.0", "net.1", "net.2", "output",
    ]  # fmt: skip
    table = report.format_table()
    assert "n/a" in table and "every stage within" in table
    data = json.loads(report.to_json(str(tmp_path / "check.json")))
    assert data["ok"] is True and json.loads((tmp_path / "check.json").read_text()) == data


def test_compare_setups_bad_arguments():
    with pytest.raises(ValueError, match="points"):
        compare_setups("small", "f32", "f32", points=0)
    with pytest.raises(ValueError, match="texture"):
        compare_setups("huge", "f32", "f32")
    with pytest.raises(ValueError, match="mode"):
        Setup("f32", mode="inference")
    with pytest.raises(ValueError, match="device"):
        Setup("f32", device="tpu")


def test_compare_setups_takes_a_texture_and_points():
    texture = _texture("f32", seed=3)
    points, _ = _batch(300)
    report = compare_setups(texture, "f32", "bf16", points=points)
    assert report.ok and report.info["points"] == 300


@pytest.mark.requires_cuda
def test_cpu_vs_cuda_is_within_bounds():
    report = compare_setups("small", "f32", Setup("f32", device="cuda"), points=4096)
    assert report.ok, report.format_table()
