"""The training loop's control decisions against independent references.

The loss scale against a per-step model of the scaler, the skip counter and its limit (across a
resume too), the learning rates and smoothness weight each iteration runs at, what the host read
records, which iterations reach the history and the validation, the refusal of non-finite
weights at a checkpoint, the collapse rule at its thresholds, and merged monitor statistics.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_faults import _inject_inf_gradient_at
from test_train import read_metrics, tiny_cfg

import mptex.train.loop as loop
from mptex.collapse import (
    PLATEAU_DB,
    PLATEAU_MIN_SPAN,
    STUCK_BELOW_BASELINE,
    STUCK_COLLAPSED,
    classify_collapse,
    classify_partly_stuck,
    flat_since,
)
from mptex.mlp import PrecisionMLP
from mptex.precision import PrecisionPolicy, PrecisionStepper, StepResult
from mptex.train import load_checkpoint, train
from mptex.train.checkpoint import write_metrics
from mptex.train.monitor import _fractions, _Tally


# ----------------------------------------------------------------------------- the stepper
def _mlp(policy: PrecisionPolicy, seed: int = 0) -> PrecisionMLP:
    torch.manual_seed(seed)
    return PrecisionMLP(8, 3, 2, 16, policy)


def _loss(mlp: PrecisionMLP, seed: int = 0) -> torch.Tensor:
    x = torch.rand(64, 8, generator=torch.Generator().manual_seed(seed))
    return mlp(x.to(mlp.policy.encoder_dtype)).float().square().mean()


def test_a_static_scale_multiplies_the_loss_from_the_first_backward():
    # "static" scales every backward by static_loss_scale, the first one included; init_scale
    # (dynamic's starting value) must not leak into it. All-f32 compute: a power-of-two factor
    # on the loss scales every gradient exactly, so the comparison is bitwise.
    policy = PrecisionPolicy.from_config({"name": "f16_static", "encoder_dtype": "f32",
                                          "mlp_dtypes": "f32", "init_scale": 4096.0})  # fmt: skip
    plain, scaled = _mlp(policy), _mlp(policy)
    stepper = PrecisionStepper(policy, torch.optim.SGD(scaled.parameters(), lr=0.0))
    assert stepper.loss_scale == 128.0
    _loss(plain).backward()
    stepper.backward(_loss(scaled))
    for p, q in zip(plain.parameters(), scaled.parameters(), strict=True):
        assert torch.equal(q.grad, p.grad * 128.0)
    assert stepper.step() == StepResult(skipped=False, loss_scale=128.0)


def test_the_dynamic_scale_follows_a_per_step_model_of_growth_and_backoff():
    # GradScaler's rule, written out per step: a skipped step multiplies the scale by
    # backoff_factor and restarts the count of clean steps; growth_interval clean steps in a row
    # multiply it by growth_factor and restart the count. Factors other than the defaults (4
    # and 1/4), so that each of the policy's numbers has to reach the scaler. Powers of two:
    # the scales are exact.
    init, growth, backoff, interval = 2.0**10, 4.0, 0.25, 3
    policy = PrecisionPolicy.from_config({"name": "f16_dynamic", "init_scale": init,
                                          "growth_factor": growth, "backoff_factor": backoff,
                                          "growth_interval": interval})  # fmt: skip
    mlp = _mlp(policy)
    optimizer = torch.optim.Adam(mlp.parameters(), lr=1e-3)
    stepper = PrecisionStepper(policy, optimizer)
    overflow = [0, 0, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0]
    scale, clean, seen = init, 0, []
    for it, bad in enumerate(overflow):
        assert stepper.loss_scale == scale  # the factor this backward multiplies the loss by
        optimizer.zero_grad()
        stepper.backward(_loss(mlp, seed=it))
        if bad:
            mlp.layers[0].weight.grad[0, 0] = float("inf")
        result = stepper.step()
        if bad:
            scale, clean = scale * backoff, 0
        else:
            clean += 1
            if clean == interval:
                scale, clean = scale * growth, 0
        assert result == StepResult(skipped=bool(bad), loss_scale=scale), it
        seen.append(result.loss_scale)
    # the same sequence written out by hand (both rules, each more than once)
    assert seen == [1024, 1024, 256, 256, 256, 1024, 1024, 256, 64, 64, 64, 256, 256, 256,
                    1024, 1024]  # fmt: skip


def test_gradients_unscaled_before_the_step_are_unscaled_once():
    # The documented order for reading true gradients (clipping, statistics): backward,
    # unscale_(), then step(). The step takes those gradients as they are: divided by the scale
    # once, the same as a plain backward's (all-f32 compute and a power-of-two scale: exact).
    policy = PrecisionPolicy.from_config({"name": "f16_dynamic", "encoder_dtype": "f32",
                                          "mlp_dtypes": "f32", "init_scale": 2.0**12})  # fmt: skip
    plain, scaled = _mlp(policy), _mlp(policy)
    _loss(plain).backward()
    stepper = PrecisionStepper(policy, torch.optim.SGD(scaled.parameters(), lr=0.5))
    stepper.backward(_loss(scaled))
    stepper.unscale_()
    for p, q in zip(plain.parameters(), scaled.parameters(), strict=True):
        assert torch.equal(q.grad, p.grad)
    before = [q.detach().clone() for q in scaled.parameters()]
    assert stepper.step() == StepResult(skipped=False, loss_scale=2.0**12)
    for p, q, b in zip(plain.parameters(), scaled.parameters(), before, strict=True):
        assert torch.equal(q.grad, p.grad)
        assert torch.equal(q.detach(), b - 0.5 * p.grad)  # SGD: w - lr * g, one rounding


@pytest.mark.parametrize("lr, broken", [(1e-3, False), (1e10, True)])
def test_a_step_decided_on_the_device_reports_the_weights_it_made_non_finite(lr, broken):
    # f16 parameters (master_weights false) under fused Adam: the optimizer steps on the device,
    # and the parameters' finiteness after the step travels in the same flags as found_inf.
    # A rate of 1e10 moves each weight by ~1e10, past f16's largest value (65504): inf.
    policy = PrecisionPolicy.named("f16_naive")
    mlp = _mlp(policy)
    stepper = PrecisionStepper(policy, torch.optim.Adam(mlp.parameters(), lr=lr, fused=True))
    loss = _loss(mlp)
    stepper.backward(loss)
    pending = stepper.step_async(loss)
    assert not pending.host_decides
    result = stepper.finish(pending, pending.flags.tolist())
    assert result == StepResult(skipped=False, loss_scale=1.0, diverged=broken)
    finite = all(bool(torch.isfinite(p).all()) for p in mlp.parameters())
    assert finite is not broken


# ----------------------------------------------------------------------------- skipped steps
def _at_backward(monkeypatch, iterations: set[int], before=None, after=None) -> None:
    """Train with the loss of the given iterations changed by ``before(loss)`` (returning the
    loss to backpropagate) and, after the backward, ``after(stepper, loss)``."""
    current: dict[str, int] = {}
    forward_backward = loop._forward_backward

    def tracked(run, it):
        current["it"] = it
        return forward_backward(run, it)

    class Stepper(PrecisionStepper):
        def backward(self, loss, **kwargs):
            chosen = current.get("it") in iterations
            super().backward(before(loss) if chosen and before else loss, **kwargs)
            if chosen and after:
                after(self, loss)

    monkeypatch.setattr(loop, "_forward_backward", tracked)
    monkeypatch.setattr(loop, "PrecisionStepper", Stepper)


def _overflow_at(monkeypatch, iterations: set[int]) -> None:
    """Train with every gradient of the given iterations inf/NaN (the loss's backward times
    inf): under loss scaling, skipped steps at exactly those iterations."""
    _at_backward(monkeypatch, iterations, before=lambda loss: loss * float("inf"))


_SKIPS = ("precision=f16_dynamic", "train.max_consecutive_skips=2", "train.val_interval=0",
          "train.stats_interval=0", "train.checkpoint_interval=0")  # fmt: skip


def test_skipped_steps_end_the_run_at_the_limit_of_consecutive_ones(tmp_path, monkeypatch):
    # Two skips in a row with max_consecutive_skips 2: diverged at the second (0-based 2),
    # which is counted as done.
    _overflow_at(monkeypatch, {1, 2})
    m = train(tiny_cfg(*_SKIPS, "train.iterations=6"), tmp_path)
    assert (m["status"], m["diverged_at"], m["iterations"]) == ("diverged", 2, 3)
    assert m["skipped_steps"] == 2
    assert [h["skipped"] for h in m["history"]] == [False, True, True]


def test_a_step_taken_between_two_skips_restarts_the_count(tmp_path, monkeypatch):
    # Two skips with a taken step between them are not consecutive: the run completes.
    _overflow_at(monkeypatch, {1, 3})
    m = train(tiny_cfg(*_SKIPS, "train.iterations=6"), tmp_path)
    assert m["status"] == "completed" and m["skipped_steps"] == 2
    assert [h["skipped"] for h in m["history"]] == [False, True, False, True, False, False]


def test_consecutive_skips_carry_over_a_resume(tmp_path, monkeypatch):
    # A run whose last step was skipped checkpoints one consecutive skip; the resumed run's
    # first step skipped too makes two in a row: the limit, as without the interruption.
    _overflow_at(monkeypatch, {3, 4})
    first = train(tiny_cfg(*_SKIPS, "train.iterations=4"), tmp_path)
    assert first["status"] == "completed" and first["skipped_steps"] == 1
    ckpt = load_checkpoint(tmp_path / "checkpoint.pt")
    assert (ckpt["skipped_steps"], ckpt["consecutive_skips"]) == (1, 1)
    again = train(tiny_cfg(*_SKIPS, "train.iterations=6", "train.resume=true"), tmp_path)
    assert (again["status"], again["diverged_at"], again["skipped_steps"]) == ("diverged", 4, 2)


# ----------------------------------------------------------------------------- learning rates
def test_each_iteration_runs_at_its_own_scheduled_rates(tmp_path):
    # train.lr 0.01 (configs/train/default.yaml), warm-up over 4 iterations: iteration i
    # (0-based; history entry i + 1) runs at 0.01 * i / 4, then 0.01 * 10 ** (-0.0002 * (i - 4)).
    # The MLP's factor ramps 0.1 -> 0.4 over 4 iterations: at the last iteration (i = 5) it is
    # 0.4; at i = 2 it is 0.25. Checked: the history's rate of every iteration, and Adam's two
    # groups at the last step. rel 1e-12: the products of a few float64 operations.
    ramp = ("train.mlp_lr_scale=0.1", "train.mlp_lr_ramp_to=0.4", "train.mlp_lr_ramp_iter=4")
    m = train(tiny_cfg("train.iterations=6", "train.warmup_iter=4", *ramp), tmp_path / "a")
    assert m["config"]["train"]["lr"] == 0.01
    expected = [0.0, 0.0025, 0.005, 0.0075, 0.01, 0.01 * 10**-0.0002]
    assert [h["lr"] for h in m["history"]] == pytest.approx(expected, rel=1e-12, abs=0)
    grid, mlp = load_checkpoint(tmp_path / "a" / "checkpoint.pt")["optimizer"]["param_groups"]
    assert grid["lr"] == pytest.approx(expected[-1], rel=1e-12)
    assert mlp["lr"] == pytest.approx(expected[-1] * 0.4, rel=1e-12)
    # a run that ends mid-ramp: its last step (i = 2) at 0.25 of the grid's 0.005
    train(tiny_cfg("train.iterations=3", "train.warmup_iter=4", *ramp), tmp_path / "b")
    grid, mlp = load_checkpoint(tmp_path / "b" / "checkpoint.pt")["optimizer"]["param_groups"]
    assert grid["lr"] == pytest.approx(0.005, rel=1e-12)
    assert mlp["lr"] == pytest.approx(0.005 * 0.25, rel=1e-12)


def test_the_smoothness_weight_ramps_from_zero(tmp_path, monkeypatch):
    # The kd smoothness term's weight is kd_smooth_weight * min(1, it / kd_smooth_ramp): 0 at
    # iteration 0. With the term replaced by the constant 1 (no gradient: both runs train the
    # same weights, bit for bit), a ramp of 2 and no ramp (0) differ in their losses by
    # 0.03 * (1 - min(1, it / 2)): 0.03, 0.015, 0, 0. abs 1e-7: float32 losses near 0.1-0.2
    # (a few ulp of 1.5e-8).
    render_batch = loop.render_batch

    def constant_term(*args, **kwargs):
        pred, kd_grad = render_batch(*args, **kwargs)
        return pred, torch.ones((), dtype=kd_grad.dtype, device=kd_grad.device)

    monkeypatch.setattr(loop, "render_batch", constant_term)
    losses = {}
    for ramp in (2, 0):
        m = train(tiny_cfg("train.iterations=4", "train.kd_smooth_weight=0.03",
                           f"train.kd_smooth_ramp={ramp}"), tmp_path / str(ramp))  # fmt: skip
        losses[ramp] = [h["loss"] for h in m["history"]]
    difference = [b - a for a, b in zip(losses[2], losses[0], strict=True)]
    assert difference == pytest.approx([0.03, 0.015, 0.0, 0.0], abs=1e-7)


# ----------------------------------------------------------------------------- the host read
@pytest.mark.parametrize("arm", ["f32", "f16_dynamic"])
def test_the_history_records_each_iterations_own_loss(tmp_path, monkeypatch, arm):
    # The one host read packs the loss with the step's flags (one for f32; found_inf and the
    # scale for f16_dynamic) and, on sampled iterations (every 2nd here), the statistics in
    # float64. Whatever the packing, each history entry's loss is its iteration's loss tensor,
    # read before the loop saw it (float32 -> Python float: exact); final_loss is the last.
    losses: list[float] = []
    forward_backward = loop._forward_backward

    def spy(run, it):
        enqueued = forward_backward(run, it)
        losses.append(enqueued.loss.detach().float().item())
        return enqueued

    monkeypatch.setattr(loop, "_forward_backward", spy)
    m = train(tiny_cfg(f"precision={arm}", "train.iterations=5", "train.stats_interval=2"),
              tmp_path)  # fmt: skip
    assert m["status"] == "completed" and len(losses) == 5
    assert all(0.0 < x < 10.0 for x in losses)
    assert [h["loss"] for h in m["history"]] == losses
    assert m["final_loss"] == losses[-1]


@pytest.mark.parametrize("arm, status", [("f32", "diverged"), ("f16_static", "completed")])
def test_a_non_finite_loss_is_recorded_as_such(tmp_path, arm, status):
    # train.inject_nonfinite_at makes iteration 2's loss inf: recorded as inf (null in
    # metrics.json: JSON has no inf), never as another number of the read; f32 ends there (as
    # its final loss), f16_static skips the step and keeps its scale.
    m = train(tiny_cfg(f"precision={arm}", "train.iterations=4", "train.inject_nonfinite_at=2"),
              tmp_path)  # fmt: skip
    written = read_metrics(tmp_path)
    assert m["status"] == status
    if status == "diverged":  # not counted: the history ends with iteration 1
        assert m["diverged_at"] == 2 and len(m["history"]) == 2
        assert m["final_loss"] == float("inf") and written["final_loss"] is None
    else:
        assert m["history"][2]["loss"] == float("inf") and written["history"][2]["loss"] is None
        assert m["history"][2]["skipped"] is True and m["history"][2]["loss_scale"] == 128.0
        assert [h["skipped"] for h in m["history"]] == [False, False, True, False]


# ----------------------------------------------------------------------------- cadence
def test_history_keeps_the_interval_the_sampled_statistics_and_the_end(tmp_path):
    # history_interval 3 over 7 iterations: entries 3 and 6; the precision statistics sampled
    # every 2nd iteration (0-based 0, 2, 4, 6: entries 1, 3, 5, 7) are kept whatever the
    # interval; the last iteration (7) is kept and validated; nothing else is.
    m = train(tiny_cfg("train.iterations=7", "train.history_interval=3",
                       "train.stats_interval=2", "train.val_interval=0"), tmp_path)  # fmt: skip
    assert [h["iteration"] for h in m["history"]] == [1, 3, 5, 6, 7]
    with_stats = [h["iteration"] for h in m["history"] if "encoder.grad_zero_frac" in h]
    assert with_stats == [1, 3, 5, 7]
    assert [h["iteration"] for h in m["history"] if h["psnr"] is not None] == [7]


def test_the_last_iteration_validates_between_intervals(tmp_path):
    # val_interval 2 over 5 iterations: validations after 2, 4 and the last, 5; the final
    # PSNR is the last one's.
    m = train(tiny_cfg("train.iterations=5", "train.val_interval=2"), tmp_path)
    validated = [h for h in m["history"] if h["psnr"] is not None]
    assert [h["iteration"] for h in validated] == [2, 4, 5]
    assert m["psnr"] == validated[-1]["psnr"]


def _poison_weight(it):
    # The step itself leaves a NaN weight (as f16 Adam can).
    finish_step = loop._finish_step

    def poisoned(run, launched, host):
        out = finish_step(run, launched, host)
        if launched.enqueued.it == it:
            with torch.no_grad():
                next(run.texture.parameters()).view(-1)[0] = float("nan")
        return out

    return "_finish_step", poisoned


def _poison_moment(it):
    # A finite float32 gradient of 1e21: Adam squares it into an inf exp_avg_sq, and the weight
    # stays finite but stops moving (m / inf = 0). The weights pass a finiteness check; the
    # optimizer's state does not.
    launch_step = loop._launch_step

    def poisoned(run, enqueued):
        if enqueued.it == it:
            next(run.texture.parameters()).grad.view(-1)[0] = 1e21
        return launch_step(run, enqueued)

    return "_launch_step", poisoned


@pytest.mark.parametrize("poison", [_poison_weight, _poison_moment])
@pytest.mark.parametrize("poison_at, diverged_at, kept", [(3, 3, None), (7, 8, 4)])
def test_a_weight_or_adam_state_gone_non_finite_is_never_checkpointed_and_ends_the_run(
    tmp_path, monkeypatch, poison, poison_at, diverged_at, kept
):
    # A weight made NaN, or Adam's state inf, by iteration poison_at's step (0-based),
    # checkpoints due every 4 of 8 iterations. Iteration 3: the periodic checkpoint after it
    # finds it, writes nothing and ends the run as diverged at 3. Iteration 7, the last: no
    # periodic checkpoint there; the final one finds it and the run ends diverged after its 8
    # iterations (diverged_at 8), with the checkpoint after 4 left as the last good one.
    monkeypatch.setattr(loop, *poison(poison_at))
    m = train(tiny_cfg("precision=f32", "train.iterations=8", "train.checkpoint_interval=4",
                       "train.val_interval=0"), tmp_path)  # fmt: skip
    assert (m["status"], m["diverged_at"]) == ("diverged", diverged_at)
    assert m["iterations"] == poison_at + 1 and m["error"] is None
    path = tmp_path / "checkpoint.pt"
    if kept is None:
        assert not path.exists()
    else:
        ckpt = load_checkpoint(path)
        assert ckpt["iteration"] == kept
        moments = [v for s in ckpt["optimizer"]["state"].values() for v in s.values()]
        assert all(bool(torch.isfinite(v).all()) for v in [*ckpt["texture"].values(), *moments]
                   if torch.is_tensor(v) and v.is_floating_point())  # fmt: skip


def test_a_checkpoint_checks_its_weights_and_adams_state_in_one_reduction(tmp_path, monkeypatch):
    # The check is one fused reduction, i.e. one host read per checkpoint: a run of 8
    # iterations that also checkpoints after 4 makes exactly one more than a run that only
    # writes its final checkpoint, and everything else in the two runs is the same.
    calls = []
    foreach_norm = torch._foreach_norm

    def counted(*args, **kwargs):
        calls.append(1)
        return foreach_norm(*args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_norm", counted)
    counts = []
    for interval in (0, 4):
        calls.clear()
        cfg = tiny_cfg("precision=f32", "train.iterations=8", "train.val_interval=0",
                       f"train.checkpoint_interval={interval}")  # fmt: skip
        m = train(cfg, tmp_path / str(interval))
        assert m["status"] == "completed"
        counts.append(len(calls))
    assert counts[1] - counts[0] == 1, counts


def test_a_diverged_run_keeps_validation_images_of_its_last_good_weights_only_when_finite(
    tmp_path, monkeypatch
):
    # An inf gradient in backward 2 of 4 ends the f32 run as diverged at 2 with the weights
    # before that step, whose render is finite: its validation images are written, as a
    # completed run's. f16_naive's first step makes its weights non-finite: no image.
    _inject_inf_gradient_at(monkeypatch, 2)
    kept = train(tiny_cfg("precision=f32", "train.iterations=4", "train.n_val_images=2"),
                 tmp_path / "kept")  # fmt: skip
    assert kept["status"] == "diverged" and math.isfinite(kept["psnr"])
    assert sorted(p.name for p in (tmp_path / "kept" / "images").iterdir()) == [
        "val_000.png", "val_001.png"]  # fmt: skip
    monkeypatch.undo()
    lost = train(tiny_cfg("precision=f16_naive", "train.iterations=1"), tmp_path / "lost")
    assert lost["status"] == "diverged" and math.isnan(lost["psnr"])
    assert not (tmp_path / "lost" / "images").exists()


def _recorded(run_dir, resume_count=0, **extra):
    """A stopped run's metrics.json in ``run_dir`` with its time totals (5 s, 3 s, whole)."""
    record = {"status": "interrupted", "resume_count": resume_count, "wall_time_total_s": 5.0,
              "train_time_total_s": 3.0, "time_total_complete": True, **extra}  # fmt: skip
    write_metrics(run_dir, record)
    return record


def _carried(resume_count=0):
    """A checkpoint's time totals up to its write (2 s, 1 s)."""
    return {"resume_count": resume_count, "wall_time_total_s": 2.0, "train_time_total_s": 1.0,
            "time_total_complete": True}  # fmt: skip


def test_a_resume_takes_its_checkpoints_writers_record_once(tmp_path):
    # The record of the process that wrote the checkpoint (same resume_count), in the
    # checkpoint's own run directory: its totals replace the checkpoint's, and it is marked
    # taken, so that a later resume from that checkpoint does not take it again.
    record = _recorded(tmp_path)
    ckpt = _carried()
    loop._take_recorded_time(ckpt, tmp_path / "checkpoint.pt", tmp_path)
    assert ckpt == {**_carried(), "wall_time_total_s": 5.0, "train_time_total_s": 3.0}
    assert read_metrics(tmp_path) == {**record, "time_total_taken": True}
    again = _carried()
    loop._take_recorded_time(again, tmp_path / "checkpoint.pt", tmp_path)
    assert again == {**_carried(), "time_total_complete": False}


@pytest.mark.parametrize("case", ["taken", "another process", "another run's checkpoint"])
def test_a_resume_leaves_a_record_it_cannot_count_and_says_its_total_is_partial(tmp_path, case):
    # A record already taken (the process that took it was killed without one of its own), a
    # record of another process than the checkpoint's writer (a later one that failed before
    # its own checkpoint) or a checkpoint from elsewhere: the time after the checkpoint's
    # write is not known, so the checkpoint's totals stay, marked partial.
    record = _recorded(tmp_path, resume_count=1 if case == "another process" else 0,
                       **({"time_total_taken": True} if case == "taken" else {}))  # fmt: skip
    source = tmp_path / "elsewhere" if case == "another run's checkpoint" else tmp_path
    ckpt = _carried()
    loop._take_recorded_time(ckpt, source / "checkpoint.pt", tmp_path)
    assert ckpt == {**_carried(), "time_total_complete": False}
    assert read_metrics(tmp_path) == record


# ----------------------------------------------------------------------------- collapse rule
def _run(psnr, baseline, stuck=0.0, history=(), iterations=300, status="completed"):
    """A metrics.json of a run: ``history`` as (iteration, psnr[, stuck in channel 2])."""
    entries = [{"iteration": h[0], "loss": 0.01, "psnr": h[1],
                "stuck_fraction": [0.0, 0.0, h[2] if len(h) > 2 else 0.0]}
               for h in history]  # fmt: skip
    return {"status": status, "psnr": psnr, "baseline_psnr": baseline, "iterations": iterations,
            "history": entries, "saturation": {"stuck_fraction": [0.0, 0.0, stuck],
                                               "saturated_fraction": [0.0, 0.0, 0.9]}}  # fmt: skip


_RISING = ((100, 10.0), (200, 15.0), (300, 20.0))  # learning: no plateau


def test_collapse_thresholds_are_inclusive():
    # The rule says "at least" for the stuck fractions and "at or below" for the baseline:
    # each exactly at its threshold counts (the other conditions kept clear of theirs).
    assert STUCK_COLLAPSED == 0.5 and STUCK_BELOW_BASELINE == 0.1
    at_half = classify_collapse(_run(30.0, 20.0, stuck=0.5, history=_RISING))
    assert at_half["rule"] == "stuck"
    at_tenth = classify_collapse(_run(15.0, 20.0, stuck=0.1, history=_RISING))
    assert at_tenth["rule"] == "below baseline, stuck"
    at_baseline = classify_collapse(_run(20.0, 20.0, stuck=0.2, history=_RISING))
    assert at_baseline["rule"] == "below baseline, stuck"
    assert "PSNR 20.00 dB ≤ baseline 20.00 dB" in at_baseline["reason"]
    # and just below each threshold: no collapse
    assert classify_collapse(_run(30.0, 20.0, stuck=0.4999, history=_RISING)) is None
    assert classify_collapse(_run(15.0, 20.0, stuck=0.0999, history=_RISING)) is None
    assert classify_collapse(_run(20.0001, 20.0, stuck=0.2, history=_RISING)) is None


def test_only_a_completed_run_can_collapse():
    collapsed = _run(30.0, 20.0, stuck=0.9, history=_RISING)
    assert classify_collapse(collapsed)["rule"] == "stuck"
    for status in ("diverged", "interrupted", "failed"):
        assert classify_collapse({**collapsed, "status": status}) is None


def test_a_plateau_spanning_exactly_half_the_run_counts():
    # Validations at 500, 750 and 1000 of 1000 iterations, flat: the stretch spans 500, exactly
    # PLATEAU_MIN_SPAN of the run ("at least"); starting one iteration later it spans less.
    assert PLATEAU_MIN_SPAN == 0.5
    flat = [{"iteration": i, "psnr": 20.0} for i in (500, 750, 1000)]
    assert flat_since(flat, 1000) == 500
    later = [{"iteration": i, "psnr": 20.0} for i in (501, 750, 1000)]
    assert flat_since(later, 1000) is None


def test_psnrs_exactly_plateau_db_apart_are_not_flat():
    # "Within PLATEAU_DB of each other": a spread of PLATEAU_DB itself breaks the stretch.
    # 0.4 - 0.2 is exactly the float 0.2 (== PLATEAU_DB), so the comparison is at the bound.
    assert PLATEAU_DB == 0.2 and 0.4 - 0.2 == PLATEAU_DB
    history = [{"iteration": i, "psnr": p} for i, p in ((100, 0.2), (200, 0.4), (300, 0.3))]
    assert flat_since(history, 300) is None
    closer = [{"iteration": i, "psnr": p} for i, p in ((100, 0.21), (200, 0.4), (300, 0.3))]
    assert flat_since(closer, 300) == 100


def test_a_plateau_is_measured_against_the_runs_length_not_its_last_validation():
    # Three flat validations at 100-300 of a 1000-iteration run span a fifth of it: no plateau.
    # Without the run's length, the last validation's (300) is the length: two thirds.
    flat = [{"iteration": i, "psnr": 20.0} for i in (100, 200, 300)]
    assert flat_since(flat, 1000) is None
    assert flat_since(flat) == 100
    assert flat_since(flat, 300) == 100


def test_a_resumed_runs_repeated_validation_counts_once_with_its_last_value():
    # A resume may repeat an iteration's entry: the later one is what the run's weights gave.
    # Here the repeat of iteration 200 is flat with the others: a plateau below the baseline
    # from 100 on; its first value (25 dB) would break the plateau.
    history = ((100, 20.0), (200, 25.0), (200, 20.1), (300, 20.05))
    got = classify_collapse(_run(20.05, 21.0, history=history))
    assert got["rule"] == "below baseline, plateau" and got["flat_since"] == 100


def test_stuck_since_is_where_the_last_unbroken_stuck_stretch_began():
    # Stuck in channel 2 at 100, free at 200, stuck again from 300: since 300.
    history = ((100, 15.0, 0.2), (200, 16.0, 0.0), (300, 17.0, 0.2), (400, 18.0, 0.3))
    got = classify_collapse(_run(18.0, 20.0, stuck=0.3, history=history, iterations=400))
    assert got["rule"] == "below baseline, stuck" and got["stuck_since"] == 300
    assert "(since iteration 300)" in got["reason"]


def test_a_run_at_its_baseline_is_not_partly_stuck():
    # Partly stuck is for runs above their baseline; one exactly at it (and not collapsed:
    # few stuck pixels, no plateau) is left to the collapse rule.
    at = _run(20.0, 20.0, stuck=0.002, history=_RISING)
    at["saturation"]["stuck_error_fraction"] = 0.9
    assert classify_collapse(at) is None
    assert classify_partly_stuck(at) is None
    above = {**at, "psnr": 20.01}
    got = classify_partly_stuck(above)
    # -10 log10(1 - 0.9) = 10 dB; rel 1e-12: one log10 of a float64 (1 - 0.9 is 0.1 to 1 ulp)
    assert got is not None and got["gain_db"] == pytest.approx(10.0, rel=1e-12)


# ----------------------------------------------------------------------------- monitor
def test_a_sites_statistics_merged_over_two_calls_are_those_of_all_their_elements():
    # A site called twice in a sampled iteration (train.kd_smooth_joint false: the smoothness
    # term's second evaluation)
    # reports over both calls' elements: counted by hand over the 10 values, 3 zeros, 1 f32
    # subnormal (1e-40 < 2**-126), 2 non-finite (inf, NaN); the largest finite |x| is 5.
    first = torch.tensor([0.0, 3.0, 1e-40, float("inf")])
    second = torch.tensor([0.0, 0.0, -5.0, 2.0, float("nan"), 1.0])
    merged = _Tally(first, torch.float32).merge(_Tally(second, torch.float32))
    assert merged.numel == 10
    values = [*merged.below.tolist(), float(merged.numel), merged.largest.item()]
    assert _fractions(values) == {"zero_frac": 0.3, "subnormal_frac": 0.1,
                                  "nonfinite_frac": 0.2, "maxabs": 5.0}  # fmt: skip


def test_a_non_finite_gradient_without_loss_scaling_ends_the_run_uncounted(tmp_path, monkeypatch):
    # A finite loss whose gradient holds an inf at iteration 2 (0-based) in an arm without
    # loss scaling: the step is not taken and the run ends there as diverged, the iteration not
    # counted (as a non-finite loss's): 2 iterations done, 2 history entries, no skipped step.
    def poison(stepper, loss):
        next(p for p in stepper._params() if p.grad is not None).grad.view(-1)[0] = math.inf

    _at_backward(monkeypatch, {2}, after=poison)
    m = train(tiny_cfg("precision=f32", "train.iterations=4", "train.val_interval=0",
                       "train.stats_interval=0"), tmp_path)  # fmt: skip
    assert (m["status"], m["diverged_at"], m["iterations"]) == ("diverged", 2, 2)
    assert m["skipped_steps"] == 0 and len(m["history"]) == 2
    assert math.isfinite(m["final_loss"])


def test_a_step_decided_on_the_device_skips_a_non_finite_loss_whose_gradients_are_finite(
    tmp_path, monkeypatch
):
    # Fused Adam (the loop's choice on CUDA, forced here on the CPU) takes the skip from the
    # stepper's flag on the device, before the host has read the loss: the flag must cover the
    # loss as well as the gradients. Iteration 2's loss is made NaN after its backward (its
    # gradients finite): the run ends there, and its step changed no weight and no Adam state.
    monkeypatch.setattr(loop, "_adam_implementation",
                        lambda texture, device: {"fused": True, "foreach": False})  # fmt: skip
    launch_step = loop._launch_step
    seen: dict[str, list] = {}

    def poison(stepper, loss):
        with torch.no_grad():
            loss.fill_(math.nan)

    def state(run):
        adam = [v.clone() for s in run.optimizer.state.values() for v in s.values()]
        return [p.detach().clone() for p in run.texture.parameters()] + adam

    def launched(run, enqueued):
        if enqueued.it == 2:
            assert run.optimizer.defaults["fused"]
            seen["before"] = state(run)
        out = launch_step(run, enqueued)
        if enqueued.it == 2:
            seen["after"] = state(run)
        return out

    _at_backward(monkeypatch, {2}, after=poison)
    monkeypatch.setattr(loop, "_launch_step", launched)
    m = train(tiny_cfg("precision=f32", "train.iterations=4", "train.val_interval=0",
                       "train.stats_interval=0"), tmp_path)  # fmt: skip
    assert (m["status"], m["diverged_at"], m["iterations"]) == ("diverged", 2, 2)
    assert len(seen["before"]) == len(seen["after"]) > 0
    assert all(torch.equal(a, b) for a, b in zip(seen["before"], seen["after"], strict=True))


def test_a_step_that_turns_a_weight_non_finite_ends_the_run_counted(tmp_path):
    # f16 parameters with f16 Adam (eps 1e-8 rounds to 0 in f16): the first step turns finite
    # gradients into NaN weights. The step was taken: it is counted and recorded, and the run
    # ends at it as diverged, not later.
    m = train(tiny_cfg("precision=f16_naive", "train.iterations=4", "train.val_interval=0",
                       "train.stats_interval=0"), tmp_path)  # fmt: skip
    assert (m["status"], m["diverged_at"], m["iterations"]) == ("diverged", 0, 1)
    assert [h["iteration"] for h in m["history"]] == [1]
