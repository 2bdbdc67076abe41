"""Diagnostics where their other tests leave a choice open: the ULP summary over more pairs
than its quantiles take, two shapes of one size, a gradient that is negative or a loss of shape
[1], the fit's target, its counts and what it calls a divergence, against hand-worked values
and a float64 reference."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from mptex.diagnostics import (
    CheckReport,
    Setup,
    StageError,
    check_gradient_flow,
    compare,
    compare_setups,
    half_ulps,
    thread_check,
    ulp,
    ulp_summary,
)
from mptex.diagnostics import fit as fit_module
from mptex.diagnostics.fit import fit_arm, fit_psnr, fit_target
from mptex.diagnostics.overhead import OverheadCounter


# ----------------------------------------------------------------------------- ULPs
def test_half_ulps_refuse_two_shapes_of_one_size():
    with pytest.raises(ValueError) as info:
        half_ulps(torch.zeros(2, 3), torch.zeros(3, 2))
    assert str(info.value) == "a and b: expected one shape, got [2, 3] and [3, 2]"


def _pairs(distances: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs ``distances`` float16 steps apart above 1.0 (1024 halves per unit there)."""
    a = torch.ones(len(distances))
    return a, a + torch.tensor(distances, dtype=torch.float32) * 2**-10


def test_the_summary_takes_its_quantiles_on_a_prefix_and_max_and_equal_on_every_pair(
    monkeypatch,
):
    # Past the limit, median and p99 see the first pairs only; max and equal see all of them.
    monkeypatch.setattr(ulp, "_QUANTILE_LIMIT", 4)
    summary = ulp_summary(*_pairs([1, 1, 1, 1, 0, 0, 0, 0, 9]))
    assert summary["median"] == 1.0 and summary["p99"] == 1.0
    assert summary["max"] == 9.0 and summary["equal"] == 4 / 9 and summary["nonfinite"] == 0


def test_the_quantiles_cover_every_pair_below_torchs_limit():
    # 40 pairs: the first 16 at distance 0, the rest at 3; the lower median of all 40 is 3
    summary = ulp_summary(*_pairs([0] * 16 + [3] * 24))
    assert summary["median"] == 3.0 and summary["equal"] == 16 / 40
    assert ulp._QUANTILE_LIMIT <= 2**24  # torch.quantile refuses more


# ----------------------------------------------------------------------------- gradient flow
def test_a_negative_gradient_and_a_one_element_loss_are_fine():
    weight = nn.Parameter(torch.ones(3))
    module = nn.Module()
    module.weight = weight
    loss = -(weight * torch.tensor([1.0, 2.0, 3.0])).sum()  # gradient -1, -2, -3
    assert check_gradient_flow(module, loss.reshape(1)) == []


# ----------------------------------------------------------------------------- fit
def test_the_fit_target_at_hand_worked_points():
    points = torch.tensor([[0.0, 0.0, 0.0], [0.25, 0.0, 0.0], [-0.25, 0.0, 0.0]])
    # at the origin every channel's sum is 0; at x = +-1/4: sin(2 pi x) = +-1, cos(3 pi x) =
    # -sqrt(1/2) times sin(0) = 0, sin(pi x) = +-sqrt(1/2); then / 1.4 * 0.5 + 0.5
    half = math.sqrt(0.5)
    want = [[0.5, 0.5, 0.5],
            [0.5 + 0.5 / 1.4, 0.5, 0.5 + half * 0.5 / 1.4],
            [0.5 - 0.5 / 1.4, 0.5, 0.5 - half * 0.5 / 1.4]]  # fmt: skip
    got = fit_target(points).double()
    # float32 sin, cos and sums: a few float32 ulps of values below 1
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-6)


def test_the_fit_psnr_is_the_float64_mse_of_the_float32_values():
    gen = torch.Generator().manual_seed(0)
    ref = torch.rand(64, 3, generator=gen)
    pred = ref + 1e-3 * torch.randn(64, 3, generator=gen)
    diff = pred.numpy().astype(np.float64) - ref.numpy().astype(np.float64)
    assert fit_psnr(pred, ref) == pytest.approx(-10 * math.log10(np.mean(diff**2)), abs=1e-12)


def _fake_texture(monkeypatch, nan_from: int | None, scaler, skips=()):
    """fit_arm's texture replaced: a constant colour (NaN from the ``nan_from``-th sample on,
    the evaluation's included), a stepper that skips the steps in ``skips`` (1-based) with
    ``scaler``. Returns the points each sample saw."""
    seen = []

    class Stepper:
        loss_scale, calls = 8.0, 0

        def __init__(self):
            self.scaler = scaler

        def __call__(self, loss):
            Stepper.calls += 1
            return SimpleNamespace(skipped=Stepper.calls in skips)

    class Texture(nn.Module):
        def __init__(self, AABB, precision, encoder, backend):
            super().__init__()
            self.colour = nn.Parameter(torch.full((3,), 0.5))
            self.policy = SimpleNamespace(stepper=lambda optimizer: Stepper())

        def sample(self, points):
            seen.append(points)
            out = self.colour.expand(points.shape[0], 3)
            if nan_from is not None and len(seen) >= nan_from:
                out = out * float("nan")
            return out

    monkeypatch.setattr(fit_module, "MLPTexture3D", Texture)
    return seen


def test_the_fit_counts_every_skipped_step(monkeypatch):
    _fake_texture(monkeypatch, None, scaler=object(), skips=(1, 3))
    result = fit_arm("f32", steps=4, batch=8, n_eval=16)
    assert result["skipped"] == 2 and result["steps_run"] == 4 and not result["diverged"]
    assert result["final_loss_scale"] == 8.0


def test_a_non_finite_loss_without_a_scaler_stops_the_fit(monkeypatch):
    _fake_texture(monkeypatch, 2, scaler=None)
    result = fit_arm("f32", steps=5, batch=8, n_eval=16)
    assert result["diverged"] and result["steps_run"] == 2


def test_a_scaler_fits_on_through_a_non_finite_loss_and_a_non_finite_psnr_diverged(
    monkeypatch,
):
    # the loss scaler skips such steps, so the fit goes on; its evaluation is NaN
    _fake_texture(monkeypatch, 2, scaler=object())
    result = fit_arm("f32", steps=5, batch=8, n_eval=16)
    assert result["steps_run"] == 5 and math.isnan(result["psnr"]) and result["diverged"]


def test_the_fit_evaluates_on_the_whole_cube(monkeypatch):
    seen = _fake_texture(monkeypatch, None, scaler=object())
    fit_arm("f32", steps=1, batch=8, n_eval=4096)
    evaluated = seen[-1]
    assert evaluated.shape == (4096, 3)
    assert bool((evaluated.min(0).values < -0.9).all() and (evaluated.max(0).values > 0.9).all())


def test_the_fits_step_time_is_the_median(monkeypatch):
    _fake_texture(monkeypatch, None, scaler=object())
    clock = iter([0.0, 1.0, 10.0, 15.0, 20.0, 22.0])  # steps of 1, 5 and 2 seconds

    monkeypatch.setattr(fit_module.time, "perf_counter", lambda: next(clock))
    result = fit_arm("f32", steps=3, batch=8, n_eval=16)
    assert result["median_step_s"] == 2.0


# ----------------------------------------------------------------------------- overhead counts
@pytest.mark.parametrize(
    "kwargs, syncs",
    [({"output_size": 6}, {}), ({}, {("step", "data-sized (repeat_interleave)"): 1})],
)
def test_a_repeat_interleave_sized_in_advance_waits_for_nothing(kwargs, syncs):
    counter = OverheadCounter(torch.device("cpu"))
    x, repeats = torch.arange(6.0), torch.arange(6) % 3  # 6 elements out
    with counter:
        torch.repeat_interleave(x, repeats, **kwargs)
    assert dict(counter.syncs) == syncs


# ----------------------------------------------------------------------------- thread check
def test_the_thread_check_holds_nans_equal_where_both_have_them_and_nowhere_else():
    nan = float("nan")
    assert thread_check._same(torch.tensor([nan, 1.0]), torch.tensor([nan, 1.0]))
    assert not thread_check._same(torch.tensor([nan, 1.0]), torch.tensor([0.0, 1.0]))
    assert not thread_check._same(torch.tensor([0.0, 1.0]), torch.tensor([nan, 1.0]))
    assert not thread_check._same(torch.tensor([nan, 1.0]), torch.tensor([nan, 2.0]))
    assert thread_check._same(torch.tensor([3]), torch.tensor([3]))


def _checked(show: int = 0):
    """A thread checker and a function that restores the thread count afterwards."""
    threads = torch.get_num_threads()
    return thread_check.make_checker(show=show), lambda: torch.set_num_threads(threads)


def test_the_thread_check_hands_back_the_runs_own_tensors_and_draws_once():
    checker, restore = _checked()
    try:
        x = torch.zeros(4)
        with checker:
            same = x.add_(1.0)  # an in-place op returns its own tensor, not the copy's result
            torch.add(x, 1.0, out=x)  # out= aliasing an input: written once, from x = 1
            drawn = torch.rand(3, generator=torch.Generator().manual_seed(5))
    finally:
        restore()
    assert same is x and torch.equal(x, torch.full((4,), 2.0))
    assert torch.equal(drawn, torch.rand(3, generator=torch.Generator().manual_seed(5)))
    assert checker.ops == 2 and not checker.differing


@torch.library.custom_op("mptex_tests::thread_count", mutates_args=())
def _thread_count(x: torch.Tensor) -> torch.Tensor:
    """An op whose result is the number of threads it ran with."""
    return torch.full_like(x, float(torch.get_num_threads()))


def test_an_op_that_differs_is_counted_and_the_run_goes_on_with_two_threads_result():
    checker, restore = _checked()
    try:
        with checker:
            out = _thread_count(torch.zeros(3))
    finally:
        restore()
    assert torch.equal(out, torch.full((3,), 2.0))
    assert checker.differing == {"mptex_tests.thread_count.default": 1}


def test_the_thread_check_prints_the_first_show_differing_ops(monkeypatch, capsys):
    monkeypatch.setattr(thread_check, "_same", lambda a, b: False)  # every op differs
    checker, restore = _checked(show=2)
    try:
        x = torch.ones(3)
        with checker:
            for _ in range(4):
                x + 1
    finally:
        restore()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["op 1", "op 2"]
    assert checker.differing == {"aten.add.Tensor": 4}


# ----------------------------------------------------------------------------- mptex-check
def _hand_report() -> CheckReport:
    """Two setups, one stage: A's error a quarter of its bound, B's twice its bound and its
    reference error infinite (a missing gradient)."""
    a = StageError("output", "f32", 1e-3, 2e-3, 1.0, 4.0, False)
    b = StageError("output", "f16", math.inf, math.inf, 8.0, 4.0, True)
    return CheckReport(["A", "B"], ["output"], {"A": [a], "B": [b]},
                       {"A": None, "B": "output"}, {"output": 0.5})  # fmt: skip


def test_the_table_gives_each_stages_error_over_its_bound_and_flags_the_excess():
    table = _hand_report().format_table()
    row = next(line for line in table.splitlines() if line.startswith("output"))
    a, b = row.split(" | ")[1:3]
    assert a.split() == ["f32", "1.00e-03", "2.00e-03", "0.25"]
    assert b.split() == ["!", "f16", "inf", "inf", "2", "<-"]  # the last setup's row: flagged
    assert row.split(" | ")[3].split() == ["5.00e-01"]
    assert "B: first stage beyond its dtype's bound: output" in table


def test_the_json_report_writes_infinities_as_strings():
    data = _hand_report().to_dict()
    assert data["errors"]["B"][0]["max_abs"] == "inf" and data["errors"]["B"][0]["rel"] == "inf"
    assert data["ok"] is False and data["first_exceeding"] == {"A": None, "B": "output"}


def test_a_stage_of_another_shape_is_infinitely_far():
    assert compare._max_err(torch.zeros(2), torch.zeros(3)) == math.inf
    assert compare._max_err(torch.ones(2), torch.tensor([1.0, 3.5])) == 2.5


def test_relative_errors_are_over_the_references_largest_value_and_a_b_is_their_distance():
    points = torch.rand(64, 3, generator=torch.Generator().manual_seed(2)) * 2 - 1
    report = compare_setups("small", "f32", "bf16", points=points, seed=0)
    reference = compare.build_texture(compare._source_texture("small", 0), Setup("f32")).double()
    for layer in reference.net.layers:
        layer.compute_dtype = torch.float64
    output = compare._run(reference, points, torch.zeros(64, 3), "no_grad")["output"]
    rows = {name: {e.stage: e for e in errors} for name, errors in report.errors.items()}
    a, b = (rows[name]["output"] for name in report.setups)
    assert b.max_abs > 0 and b.rel == pytest.approx(b.max_abs / output.abs().max().item(),
                                                    rel=1e-12)  # fmt: skip
    # max|A - B| lies between the difference and the sum of their distances to the reference
    assert abs(a.max_abs - b.max_abs) <= report.diff_ab["output"] <= a.max_abs + b.max_abs
    assert report.diff_ab["output"] > 0


def test_compare_setups_refuses_a_cotangent_scale_of_zero():
    with pytest.raises(ValueError) as info:
        compare_setups("small", "f32", "f32", points=8, cotangent_scale=0.0)
    assert str(info.value) == "cotangent_scale: expected a finite number > 0, got 0.0"


def test_a_dynamic_loss_scale_backs_off_until_it_falls_below_one():
    # gradients that are NaN at every scale: 2^16 halved 17 times is the first scale below 1

    def poison(texture):
        with torch.no_grad():
            texture.net.layers[0].weight.fill_(float("nan"))

    setup = Setup("f16_dynamic", modify=poison, label="poisoned")
    report = compare_setups("small", "f32", setup, points=16, seed=0)
    assert report.info["loss_scale"]["poisoned"] == 0.5 and report.first_exceeding["poisoned"]
