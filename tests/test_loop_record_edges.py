"""The training loop's per-iteration settings and its metrics record against independent references.

Checked: Adam's two parameter groups (grid and MLP) and the rates, betas and epsilon they
run at, against hand-computed schedule values; the MLP rate's ramp and the learning-rate
schedule at hand-computed points; Adam's implementation flags per device and dtype; the
smoothness jitter against the seeded normal draws times the configured spread; the records
of ``metrics.json`` (``n_params`` against a hand count of the tiny texture's parameters,
``time_per_iter_s`` against the middle of the sorted iteration times, ``time_split_s``'s
parts against the sums of the times they are made of and against known sleeps,
``train_time_s`` against the wall time less the start, ``final_loss_scale`` against the
scaler's hand-computed backoff, ``torch_threads``, ``iterations_planned``, the validation
images written), the PSNR against a float64 per-image formula, and TensorBoard's steps.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings

import pytest
import torch
from test_train import tiny_cfg

import mptex.train.loop as loop
from mptex.scenes import Scene
from mptex.train import ConfigError, load_checkpoint, lr_schedule, train
from mptex.train.checkpoint import build_texture

# The tiny texture (configs/texture/tiny.yaml): a hash grid of 4 levels x 2**12 entries x 2
# features = 32768 parameters, and an MLP of 8 -> 16 -> 16 -> 3 without biases:
# 16 * 8 + 16 * 16 + 3 * 16 = 128 + 256 + 48 = 432 weights; 33200 in all.
TINY_GRID_PARAMS = 4 * 2**12 * 2
TINY_MLP_PARAMS = 16 * 8 + 16 * 16 + 3 * 16


def _tiny_texture():
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(tiny_cfg(), resolve=True)
    aabb = torch.tensor([[-1.0, -1.0, -1.0], [1.0, 1.0, 1.0]])
    return build_texture(aabb, cfg["texture"], cfg["precision"])


# ----------------------------------------------------------------------------- optimizer groups
def test_the_grid_and_the_mlp_are_two_groups_with_their_own_rate_scales():
    texture = _tiny_texture()
    groups = loop._param_groups(texture, 0.25)
    grid, mlp = groups
    assert [id(p) for p in grid["params"]] == [id(texture.encoder.params)]
    assert [id(p) for p in mlp["params"]] == [id(p) for p in texture.net.parameters()]
    assert grid["lr_scale"] == 1.0 and mlp["lr_scale"] == 0.25
    assert sum(p.numel() for p in grid["params"]) == TINY_GRID_PARAMS
    assert sum(p.numel() for p in mlp["params"]) == TINY_MLP_PARAMS


def test_adam_runs_at_the_configured_rates_betas_and_epsilon(tmp_path):
    # Two iterations, no warm-up, no MLP ramp: the last step (iteration 1) runs the grid at
    # 0.02 * 10 ** (-0.0002 * 1) and the MLP at 0.25 of that; Adam's betas and epsilon are
    # the config's.
    m = train(tiny_cfg("train.iterations=2", "train.lr=0.02", "train.mlp_lr_scale=0.25",
                       "train.betas=[0.8,0.95]", "train.adam_eps=1e-6"), tmp_path)  # fmt: skip
    assert m["status"] == "completed"
    grid, mlp = load_checkpoint(tmp_path / "checkpoint.pt")["optimizer"]["param_groups"]
    lr = 0.02 * 10**-0.0002
    # rel 1e-12: a product of two float64 operations
    assert grid["lr"] == pytest.approx(lr, rel=1e-12)
    assert mlp["lr"] == pytest.approx(lr * 0.25, rel=1e-12)
    assert [h["lr"] for h in m["history"]] == pytest.approx([0.02, lr], rel=1e-12)
    for group in (grid, mlp):
        assert tuple(group["betas"]) == (0.8, 0.95) and group["eps"] == 1e-6
    assert len(grid["params"]) == 1 and len(mlp["params"]) == 3


def test_betas_given_as_integers_run_as_those_numbers(tmp_path):
    # The command line reads train.betas=[0,0.99] as an int and a float, [0,0] as two ints.
    for betas in ("[0,0.99]", "[0,0]"):
        m = train(tiny_cfg("train.iterations=1", f"train.betas={betas}"), tmp_path / betas)
        assert m["status"] == "completed"
        groups = load_checkpoint(tmp_path / betas / "checkpoint.pt")["optimizer"]["param_groups"]
        expected = (0.0, 0.99) if betas == "[0,0.99]" else (0.0, 0.0)
        assert [tuple(group["betas"]) for group in groups] == [expected, expected]


def test_mlp_rate_factor_ramps_linearly_then_holds():
    fixed = {"mlp_lr_scale": 0.3, "mlp_lr_ramp_to": None, "mlp_lr_ramp_iter": 10}
    assert [loop.mlp_rate_factor(fixed, it) for it in (0, 5, 1000)] == [0.3, 0.3, 0.3]
    ramp = {"mlp_lr_scale": 0.1, "mlp_lr_ramp_to": 0.5, "mlp_lr_ramp_iter": 8}
    # 0.1 + 0.4 * min(1, it / 8): it 0 -> 0.1, 2 -> 0.2, 6 -> 0.4, 8 -> 0.5, 20 -> 0.5
    # abs 1e-15: one float64 multiply-add of values below 1
    got = [loop.mlp_rate_factor(ramp, it) for it in (0, 2, 6, 8, 20)]
    assert got == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5], abs=1e-15)
    # a ramp downwards is the same line
    down = {"mlp_lr_scale": 1.0, "mlp_lr_ramp_to": 0.2, "mlp_lr_ramp_iter": 4}
    got = [loop.mlp_rate_factor(down, it) for it in (0, 1, 4, 9)]
    assert got == pytest.approx([1.0, 0.8, 0.2, 0.2], abs=1e-15)


# ----------------------------------------------------------------------------- the schedule
def test_the_schedule_warms_up_from_zero_then_decays_from_the_warm_up_end():
    # it / 4 for it < 4: 0, 0.25, 0.5, 0.75; then 10 ** (-0.1 * (it - 4)): 1 at 4, 0.1 at 14,
    # 0.01 at 24 (not counted from iteration 0: 10 ** -1.4 at 14 would be 0.0398).
    assert [lr_schedule(it, 4, 0.1) for it in range(4)] == [0.0, 0.25, 0.5, 0.75]
    assert lr_schedule(4, 4, 0.1) == 1.0
    assert lr_schedule(14, 4, 0.1) == pytest.approx(0.1, rel=1e-14)  # a float64 power
    assert lr_schedule(24, 4, 0.1) == pytest.approx(0.01, rel=1e-14)


def test_the_cosine_schedule_stays_at_zero_past_the_runs_length():
    # progress is clamped to 1: 0.5 * (1 + cos(pi)) = 0 at and after the last iteration,
    # never the cosine's rise (0.5 * (1 + cos(1.25 pi)) = 0.146 at 250).
    for it in (200, 250, 400):
        assert lr_schedule(it, kind="cosine", iterations=200) == pytest.approx(0.0, abs=1e-12)
    # a warm-up as long as the run: the cosine's span is floored at one iteration
    assert lr_schedule(10, 10, kind="cosine", iterations=10) == 1.0


def test_a_cosine_run_decays_over_its_own_length(tmp_path):
    # 4 iterations, no warm-up: iteration i runs at 0.01 * 0.5 * (1 + cos(pi * i / 4)):
    # cos(0) = 1, cos(pi / 4) = 0.70711, cos(pi / 2) = 0, cos(3 pi / 4) = -0.70711, so
    # 0.01, 0.0085355, 0.005, 0.0014645. rel 1e-12: a few float64 operations.
    m = train(tiny_cfg("train.iterations=4", "train.lr_schedule=cosine"), tmp_path)
    half = 0.5 * 2**-0.5
    expected = [0.01, 0.01 * (0.5 + half), 0.005, 0.01 * (0.5 - half)]
    assert [h["lr"] for h in m["history"]] == pytest.approx(expected, rel=1e-12)


# ----------------------------------------------------------------------------- Adam's flags
class _Params:
    def __init__(self, *dtypes):
        self._params = [torch.zeros(2, dtype=d) for d in dtypes]

    def parameters(self):
        return iter(self._params)


def test_adam_is_fused_on_cuda_and_foreach_only_for_float32_parameters_on_a_cpu():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    f32, f16 = torch.float32, torch.float16
    assert loop._adam_implementation(_Params(f32, f16), cuda) == {"fused": True, "foreach": False}
    assert loop._adam_implementation(_Params(f32, f32), cpu) == {"fused": False, "foreach": True}
    assert loop._adam_implementation(_Params(f32, f16), cpu) == {"fused": False, "foreach": False}
    assert loop._adam_implementation(_Params(f16), cpu) == {"fused": False, "foreach": False}


class _Stateful(torch.nn.Module):
    pass


def test_overlap_true_names_the_first_module_that_cannot_snapshot_its_state():
    class Fused:
        defaults = {"fused": True}

    stateful = [("net.a", _Stateful()), ("net.b", _Stateful())]
    with pytest.raises(ConfigError, match=r"train\.overlap: true needs .*; net\.a \(_Stateful\)"):
        loop._resolve_overlap(True, stateful, Fused())
    assert loop._resolve_overlap("auto", stateful, Fused()) is False
    assert loop._resolve_overlap("auto", [], Fused()) is True
    assert loop._resolve_overlap(True, [], Fused()) is True


def test_the_fused_loss_on_auto_stays_eager_on_a_cpu_without_a_warning():
    # A device the kernels cannot run on is no surprise on auto: eager, silently; true is
    # refused naming the key.
    cpu = torch.device("cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert loop._resolve_fused_loss("auto", cpu, "logl1") is False
        assert loop._resolve_fused_loss(False, cpu, "logl1") is False
    assert [str(w.message) for w in caught] == []
    with pytest.raises(ConfigError, match=r"^train\.fused_loss: true needs "):
        loop._resolve_fused_loss(True, cpu, "logl1")


def test_the_fused_loss_that_runs_but_differs_from_eager_is_refused_or_warned(monkeypatch):
    # Where the kernels can run (fused_loss_problem None) their gradients must still be the
    # eager ones bit for bit (fused_loss_check): a difference found there is a warning on
    # auto, which stays eager, and a refusal on true; no difference, and the kernels run.
    cpu = torch.device("cpu")
    checks = []
    monkeypatch.setattr(loop, "fused_loss_problem", lambda device, loss: None)

    def differs(device, loss):
        checks.append((device, loss))
        return "the same bits"

    monkeypatch.setattr(loop, "fused_loss_check", differs)
    with pytest.warns(UserWarning, match=r"^train\.fused_loss: the fused loss needs the same bits; "
                                         r"it runs eager$"):  # fmt: skip
        assert loop._resolve_fused_loss("auto", cpu, "l1") is False
    with pytest.raises(ConfigError, match=r"^train\.fused_loss: true needs the same bits; use "):
        loop._resolve_fused_loss(True, cpu, "l1")
    assert checks == [("cpu", "l1"), ("cpu", "l1")]
    monkeypatch.setattr(loop, "fused_loss_check", lambda device, loss: None)
    assert loop._resolve_fused_loss("auto", cpu, "l1") is True
    assert loop._resolve_fused_loss(True, cpu, "l1") is True


# ----------------------------------------------------------------------------- per iteration
def test_the_smoothness_jitter_is_the_noise_generators_normal_draws_times_the_spread():
    run = object.__new__(loop.RunState)
    run.settings = {"kd_jitter_std": 0.5}
    run.generators = {"noise": torch.Generator().manual_seed(7)}
    points = torch.linspace(-1.0, 1.0, 300).reshape(100, 3)
    noise = torch.randn((100, 3), generator=torch.Generator().manual_seed(7))
    # p + 0.5 * n: one float32 multiply by a power of two (exact) and one add, so exact.
    assert torch.equal(run.jitter(points), points + 0.5 * noise)


def test_a_zero_smoothness_weight_is_the_run_without_the_term(tmp_path):
    # No jittered samples are drawn: the noise generator (random backgrounds, the jitter)
    # ends where a run without the term leaves it, and the losses agree bit for bit.
    settings = ("train.kd_smooth_weight=0", "train.kd_smooth=false")
    runs, noise = [], []
    for i, setting in enumerate(settings):
        cfg = tiny_cfg("train.iterations=3", "train.background=random", setting)
        runs.append(train(cfg, tmp_path / str(i)))
        noise.append(load_checkpoint(tmp_path / str(i) / "checkpoint.pt")["rng"]["gen_noise"])
    assert [h["loss"] for h in runs[0]["history"]] == [h["loss"] for h in runs[1]["history"]]
    assert torch.equal(noise[0], noise[1])


def test_the_alpha_term_is_the_mean_squared_error_of_coverage_against_reference_alpha(
    tmp_path, monkeypatch
):
    # The references' alpha set to 0.25 on covered pixels and the colour term to 0, without
    # the smoothness term: iteration 0's loss is mean((c - 0.25 c) ** 2) over all pixels,
    # 0.5625 * covered / pixels (its absolute error, 0.75 * covered / pixels, is another).
    training_batch = Scene.training_batch
    fractions = []

    def soft_alpha(self, *args, **kwargs):
        batch = training_batch(self, *args, **kwargs)
        rgba = batch.rgba.clone()
        rgba[..., 3:4] = 0.25 * batch.coverage
        fractions.append(batch.coverage.double().mean().item())
        return dataclasses.replace(batch, rgba=rgba)

    monkeypatch.setattr(Scene, "training_batch", soft_alpha)
    monkeypatch.setattr(loop, "masked_image_loss", lambda pred, *a, **k: pred.sum() * 0.0)
    m = train(tiny_cfg("train.iterations=1", "train.kd_smooth=false"), tmp_path)
    assert 0.0 < fractions[0] < 1.0
    # float32 squares (exact: 0.5625) summed over 32 * 32 pixels: a few ulp of 0.1, < 1e-7
    assert m["history"][0]["loss"] == pytest.approx(0.5625 * fractions[0], abs=1e-7)


# ----------------------------------------------------------------------------- the record
def test_the_record_counts_the_textures_parameters_and_the_threads(tmp_path):
    before = torch.get_num_threads()
    try:
        m = train(tiny_cfg("train.iterations=2", "train.threads=2"), tmp_path)
    finally:
        torch.set_num_threads(before)
    assert m["n_params"] == TINY_GRID_PARAMS + TINY_MLP_PARAMS == 33200
    assert m["torch_threads"] == 2
    assert m["iterations"] == 2 and m["iterations_planned"] == 2


def test_time_records_are_the_median_and_the_sums_of_the_iterations_times(tmp_path, monkeypatch):
    # Iteration 0 sleeps 0.3 s in its work: the median of 5 iteration times is one of the
    # four short ones, far from the mean (> 0.06 s). Every validation sleeps 0.05 s: after
    # iterations 2 and 4 and the last (5), whose evaluation the final record reuses: 3 calls.
    forward_backward, finish, evaluate = loop._forward_backward, loop.finish, loop.evaluate
    seen: dict = {"evaluations": 0}

    def slow_first(run, it):
        enqueued = forward_backward(run, it)  # its clock starts in there
        if it == 0:
            time.sleep(0.3)
        return enqueued

    def slow_evaluate(*args, **kwargs):
        seen["evaluations"] += 1
        time.sleep(0.05)
        return evaluate(*args, **kwargs)

    def spy_finish(run, *args, **kwargs):
        seen["times"] = list(run.iter_times)
        return finish(run, *args, **kwargs)

    monkeypatch.setattr(loop, "_forward_backward", slow_first)
    monkeypatch.setattr(loop, "evaluate", slow_evaluate)
    monkeypatch.setattr(loop, "finish", spy_finish)
    m = train(tiny_cfg("train.iterations=5", "train.val_interval=2", "train.stats_interval=2"),
              tmp_path)  # fmt: skip
    times, split = seen["times"], m["time_split_s"]
    assert len(times) == 5 and times[0] >= 0.3
    assert m["time_per_iter_s"] == sorted(times)[2]  # the middle one of five
    assert m["time_per_iter_s"] < sum(times) / 5
    # sums of the same float64 values in the same order: rel 1e-12 covers any reordering
    assert split["iterations"] == pytest.approx(sum(times), rel=1e-12)
    sampled = [h["iteration"] - 1 for h in m["history"] if "encoder.grad_zero_frac" in h]
    assert sampled == [0, 2, 4]
    assert split["sampled_iterations"] == pytest.approx(sum(times[i] for i in sampled), rel=1e-12)
    assert seen["evaluations"] == 3
    assert 3 * 0.05 <= split["validation"] < split["iterations"] + 3 * 0.05 + 5.0
    # The loop's time: its iterations and validations, none of the start or the final record.
    assert split["iterations"] + split["validation"] <= m["train_time_s"]
    assert m["train_time_s"] <= m["wall_time_s"] - split["start"]


def test_a_diverged_runs_final_validation_is_timed(tmp_path, monkeypatch):
    # f32 with an infinite loss at iteration 2 ends there, without a validation in the loop
    # (val_interval 0): the final record's evaluation is the only one, and it sleeps 0.05 s.
    evaluate = loop.evaluate
    calls = []

    def slow_evaluate(*args, **kwargs):
        calls.append(1)
        time.sleep(0.05)
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(loop, "evaluate", slow_evaluate)
    m = train(tiny_cfg("precision=f32", "train.iterations=4", "train.val_interval=0",
                       "train.inject_nonfinite_at=2"), tmp_path)  # fmt: skip
    assert m["status"] == "diverged" and len(calls) == 1
    assert m["time_split_s"]["validation"] >= 0.05


def test_the_final_loss_scale_is_the_scalers_after_its_backoff(tmp_path):
    # f16_dynamic starts at 2**16 and halves on the overflow forced at iteration 1 (its
    # growth interval, 2000, is not reached): 65536, 32768, 32768.
    m = train(tiny_cfg("precision=f16_dynamic", "train.iterations=3",
                       "train.inject_nonfinite_at=1"), tmp_path)  # fmt: skip
    assert [h["loss_scale"] for h in m["history"]] == [65536.0, 32768.0, 32768.0]
    assert [h["skipped"] for h in m["history"]] == [False, True, False]
    assert m["final_loss_scale"] == 32768.0 and m["skipped_steps"] == 1


def test_the_record_of_a_resumed_run_plans_the_whole_run(tmp_path):
    train(tiny_cfg("train.iterations=2"), tmp_path)
    m = train(tiny_cfg("train.iterations=4", "train.resume=true"), tmp_path)
    assert m["resumed_from"] == 2 and m["iterations"] == 4 and m["iterations_planned"] == 4
    assert [h["iteration"] for h in m["history"]] == [1, 2, 3, 4]
    # the final loss is this run's last iteration's, not the checkpoint's (iteration 2's)
    assert m["final_loss"] == m["history"][-1]["loss"] != m["history"][1]["loss"]


def test_as_many_validation_images_as_asked_are_written(tmp_path):
    train(tiny_cfg("train.iterations=1", "train.n_val_images=2"), tmp_path)
    assert sorted(p.name for p in (tmp_path / "images").iterdir()) == ["val_000.png",
                                                                        "val_001.png"]  # fmt: skip


def _srgb64(x: float) -> float:
    # the sRGB curve in float64, then the clamp to [0, 1]
    y = 12.92 * x if x <= 0.0031308 else 1.055 * x ** (1 / 2.4) - 0.055
    return min(1.0, max(0.0, y))


def test_the_psnr_is_the_float64_per_image_formula_on_the_final_render(tmp_path, monkeypatch):
    evaluate = loop.evaluate
    kept = []

    def spy(*args, **kwargs):
        out = evaluate(*args, **kwargs)
        kept.append(out)
        return out

    monkeypatch.setattr(loop, "evaluate", spy)
    m = train(tiny_cfg("train.iterations=3", "train.val_interval=0"), tmp_path)
    pred, ref = kept[-1]["pred"].double(), kept[-1]["ref"].double()
    expected = []
    for b in range(pred.shape[0]):
        a = [_srgb64(v) for v in pred[b].flatten().tolist()]
        r = [_srgb64(v) for v in ref[b].flatten().tolist()]
        mse = sum((x - y) ** 2 for x, y in zip(a, r, strict=True)) / len(a)
        expected.append(-10.0 * math.log10(max(mse, 1e-10)))
    # float32 sRGB values (rel 6e-8 each) and a float32 mean of 32 * 32 * 3 squared errors
    # (relative error at most ~3072 * 6e-8 = 2e-4 of the MSE): 10 / ln 10 * 2e-4 < 1e-3 dB.
    assert m["psnr_per_image"] == pytest.approx(expected, abs=1e-3)
    assert m["psnr"] == pytest.approx(sum(expected) / len(expected), abs=1e-3)
    assert m["history"][-1]["psnr"] == m["psnr"]


def test_tensorboard_gets_each_iterations_values_at_its_completed_count(tmp_path, monkeypatch):
    scalars: list[tuple[str, float, int]] = []

    class Writer:
        def add_scalar(self, tag, value, step):
            scalars.append((tag, value, step))

        def add_images(self, *args, **kwargs):
            pass

        def close(self):
            pass

    monkeypatch.setattr(loop, "tensorboard_writer", lambda run_dir, enabled: Writer())
    m = train(tiny_cfg("train.iterations=4", "train.val_interval=2"), tmp_path)
    history = m["history"]
    by_tag = {tag: [(v, s) for t, v, s in scalars if t == tag] for tag, _, _ in scalars}
    assert by_tag["train/loss"] == [(h["loss"], h["iteration"]) for h in history]
    assert by_tag["train/lr"] == [(h["lr"], h["iteration"]) for h in history]
    assert by_tag["val/psnr"] == [(h["psnr"], h["iteration"]) for h in history if h["psnr"]]
    assert [s for _, s in by_tag["val/psnr"]] == [2, 4]


def test_a_resumed_run_steps_with_its_own_betas_and_epsilon(tmp_path):
    # The checkpoint's Adam groups hold the first run's betas and epsilon; a resume may change
    # train.betas and train.adam_eps (only the seeds of train name the run), and its steps run
    # at the new values: the final checkpoint's groups hold them.
    first = train(tiny_cfg("train.iterations=2", "train.val_interval=0"), tmp_path)
    assert first["status"] == "completed"
    again = train(tiny_cfg("train.iterations=3", "train.val_interval=0", "train.resume=true",
                           "train.betas=[0.8,0.95]", "train.adam_eps=1e-6"), tmp_path)  # fmt: skip
    assert again["status"] == "completed" and again["resumed_from"] == 2
    for group in load_checkpoint(tmp_path / "checkpoint.pt")["optimizer"]["param_groups"]:
        assert tuple(group["betas"]) == (0.8, 0.95) and group["eps"] == 1e-6
