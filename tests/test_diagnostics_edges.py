"""Diagnostics and rescoring against independent references.

Half-precision ULP distances against a brute-force enumeration of every finite float16, their
summary and the tolerance rule against hand-computed values, the gradient-flow report's
counts and order, the fit's PSNR at its ends, and the one-line refusals and tables of
``mptex-rescore`` and ``mptex-check``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from mptex.cli import rescore
from mptex.cli.check import check_main
from mptex.diagnostics import (
    Setup,
    check_gradient_flow,
    compare_setups,
    half_ulps,
    outside_tolerance,
    ulp_summary,
)
from mptex.diagnostics.compare import _source_texture
from mptex.diagnostics.fit import fit_psnr
from mptex.train.checkpoint import CheckpointError


# ----------------------------------------------------------------------------- ULPs
def _every_finite_half() -> np.ndarray:
    """Every finite float16 value once (+0 and -0 as one), ascending, as float64."""
    values = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    values = values[np.isfinite(values)].astype(np.float64)
    return np.unique(values)  # sorts, and -0.0 == 0.0 keeps one zero


def test_half_ulps_count_the_halves_between_two_values():
    ordered = _every_finite_half()
    assert len(ordered) == 2 * (31 * 1024) - 1  # 31 exponents x 1024 mantissas a sign, one 0
    gen = np.random.default_rng(0)
    a = gen.choice(ordered, 4000)
    b = np.concatenate([gen.choice(ordered, 3000), a[3000:] * (1 + 2.0**-9)])  # near pairs
    expected = np.abs(
        np.searchsorted(ordered, a.astype(np.float16).astype(np.float64))
        - np.searchsorted(ordered, b.astype(np.float16).astype(np.float64))
    )
    got = half_ulps(torch.from_numpy(a), torch.from_numpy(b).float())
    assert got.dtype == torch.int64 and np.array_equal(got.numpy(), expected)


def test_half_ulps_at_zero_one_and_the_non_finite():
    tiny = 2.0**-24  # the smallest positive subnormal half
    a = torch.tensor([1.0, 0.0, -tiny, -1.0, 65504.0, float("inf"), 1.0, float("nan"), 2.0])
    b = torch.tensor([1.0 + 2**-10, -0.0, tiny, 1.0, -65504.0, 1.0, -float("inf"), 1.0, 2.0])
    # one ulp; +0 is -0; a subnormal on each side of zero; 1.0 is 15 exponents of 1024 halves
    # above zero on each side; the largest half is 30 x 1024 + 1023 above zero on each side
    assert half_ulps(a, b).tolist() == [1, 0, 2, 2 * 15360, 2 * 31743, -1, -1, -1, 0]


def test_half_ulps_refuse_tensors_of_two_shapes():
    with pytest.raises(ValueError) as info:
        half_ulps(torch.zeros(3), torch.zeros(1))
    assert str(info.value) == "a and b: expected one shape, got [3] and [1]"


def test_an_ulp_summary_of_hand_counted_distances():
    one = 1.0
    a = torch.tensor([one, one, one, one, float("inf")])
    b = torch.tensor([one, one + 2**-10, one + 2**-9, one, one])
    # distances 0, 1, 2, 0 and one pair with inf; the median of [0, 0, 1, 2] is torch's lower
    # one, 0; the 0.99 quantile interpolates between 1 and 2 at 0.97
    summary = ulp_summary(a, b)
    assert summary == {"median": 0.0, "p99": pytest.approx(1.97, abs=1e-12), "max": 2.0,
                       "equal": 0.5, "nonfinite": 1}  # fmt: skip
    nan = torch.tensor([float("nan"), float("inf")])
    assert ulp_summary(nan, torch.ones(2)) == {"median": None, "p99": None, "max": None,
                                               "equal": None, "nonfinite": 2}  # fmt: skip


def test_the_tolerance_rule_is_assert_closes_with_its_bound_included():
    # |actual - expected| <= atol + rtol * |expected|, in binary-exact values: 0.5 <= 0.5 is
    # inside at both 4.5 and 3.5 (the bound scales with the expected value, not the actual).
    expected = torch.tensor([4.0, 4.0, 4.0, 4.0])
    actual = torch.tensor([4.5, 3.5, float("nan"), 4.0])
    assert outside_tolerance(actual, expected, rtol=0.125, atol=0.0) == 1 / 4  # the NaN
    just_past = torch.tensor([4.5 + 2**-20, 3.5 - 2**-20])
    assert outside_tolerance(just_past, torch.tensor([4.0, 4.0]), rtol=0.125, atol=0.0) == 1.0
    assert outside_tolerance(torch.tensor([1.25]), torch.tensor([1.0]), 0.0, 0.25) == 0.0
    assert outside_tolerance(torch.zeros(0), torch.zeros(0), 0.1, 0.1) == 0.0


# ----------------------------------------------------------------------------- gradient flow
class _Three(nn.Module):
    def __init__(self):
        super().__init__()
        self.zeroed = nn.Parameter(torch.ones(3))
        self.unused = nn.Parameter(torch.ones(2))
        self.blown = nn.Parameter(torch.ones(2))
        self.frozen = nn.Parameter(torch.ones(4), requires_grad=False)
        self.fine = nn.Parameter(torch.ones(1))

    def forward(self):
        scale = torch.tensor([float("inf"), 1.0])
        return ((self.zeroed * 0).sum() + (self.blown * scale).sum() + self.fine.sum()
                + self.frozen.sum())  # fmt: skip


def test_gradient_problems_are_counted_and_listed_in_the_modules_order():
    module = _Three()
    assert check_gradient_flow(module, module()) == [
        "zeroed: all-zero gradient (3 elements)",
        "unused: no gradient (not in the loss's graph: detached, no_grad or non-differentiable)",
        "blown: inf/NaN gradient in 1 of 2 elements",
    ]


def test_gradient_flow_refuses_a_loss_that_is_no_scalar_and_a_frozen_module():
    module = _Three()
    with pytest.raises(ValueError, match=r"^loss: expected a scalar tensor, got tensor\("):
        check_gradient_flow(module, module.fine * torch.ones(2))
    frozen = nn.Linear(2, 1).requires_grad_(False)
    with pytest.raises(ValueError) as info:
        check_gradient_flow(frozen, frozen(torch.ones(1, 2)).sum())
    assert str(info.value) == "module: has no trainable parameters"


# ----------------------------------------------------------------------------- fit
def test_the_fits_psnr_at_hand_computed_errors_and_its_ends():
    ref = torch.full((4, 3), 0.5)
    assert fit_psnr(ref + 2**-5, ref) == pytest.approx(10 * np.log10(1024), abs=1e-12)
    assert fit_psnr(ref, ref) == pytest.approx(300.0)  # MSE floored at 1e-30
    for bad in (float("inf"), float("nan")):
        assert np.isnan(fit_psnr(torch.full((4, 3), bad), ref))


# ----------------------------------------------------------------------------- mptex-rescore
def test_rescore_takes_sixteen_samples_and_refuses_seventeen(tmp_path, capsys):
    assert rescore.rescore_main([str(tmp_path), "--val-spp", "1", "16"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"mptex-rescore: {tmp_path}: no checkpoint.pt (not a finished mptex-train run)"
    assert rescore.rescore_main([str(tmp_path), "--val-spp", "17", "4", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "mptex-rescore: error: --val-spp: expected integers in [1, 16], got [17, 0]"


def test_rescore_names_a_run_given_relative_and_absolute_once(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    assert rescore.rescore_main(["run", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "mptex-rescore: 1 run directory given more than once: each is scored once",
        "mptex-rescore: run: no checkpoint.pt (not a finished mptex-train run)",
    ]


def _scored(tmp_path, monkeypatch, psnrs: dict[str, list[tuple[int, float, float | None]]]):
    """Run folders with a checkpoint.pt each, scored as ``psnrs`` says: per run, rows of
    (val_spp, psnr, own); each run its own seed (its place in ``psnrs``), as in a sweep, so
    that the summary counts every run."""
    seeds = {name: i for i, name in enumerate(psnrs)}
    for name in psnrs:
        (tmp_path / name).mkdir()
        (tmp_path / name / "checkpoint.pt").write_bytes(b"x")

    def fake(run_dir, spps, device, n_val_views=None):
        rows = psnrs[run_dir.name]
        if rows is None:
            raise CheckpointError(f"{run_dir / 'checkpoint.pt'}: not a readable checkpoint")
        return [{"run": str(run_dir), "scene": "builtin", "arm": "f32",
                 "seed": seeds[run_dir.name], "val_spp": spp, "psnr": psnr,
                 "baseline_psnr": 10.0, "own": own, "seconds": 0.5, "psnr_per_image": [psnr]}
                for spp, psnr, own in rows]  # fmt: skip

    monkeypatch.setattr(rescore, "rescore", fake)
    return [str(tmp_path / name) for name in psnrs]


def test_rescore_tables_the_sample_std_per_setting_and_the_runs_own_psnr(
    tmp_path, monkeypatch, capsys
):
    runs = _scored(tmp_path, monkeypatch, {
        "s0": [(1, 20.0, 20.0), (4, 21.0, None)],
        "s1": [(1, 22.0, 21.5), (4, 24.0, None)],
        "s2": [(1, 24.0, None), (4, 30.0, None)],
    })  # fmt: skip
    out = tmp_path / "scores.json"
    assert rescore.rescore_main([*runs, "--json", str(out)]) == 0
    text = "\n".join(" ".join(line.split()) for line in capsys.readouterr().out.splitlines())
    # val_spp 1: 20, 22, 24 -> mean 22, sample std 2 (population std 1.63)
    # val_spp 4: 21, 24, 30 -> mean 25, sample std sqrt(21) = 4.58
    assert "| builtin | f32 | 1 | 3 | 22.00 ± 2.00 |" in text
    assert "| builtin | f32 | 4 | 3 | 25.00 ± 4.58 |" in text
    own = [
        line.split("|")[8].strip()
        for line in text.splitlines()
        if line.startswith(("| s0 ", "| s1 ", "| s2 "))
    ]
    assert own == ["equal", "-", "21.50", "-", "-", "-"]
    assert len(json.loads(out.read_text())["scores"]) == 6


def test_rescore_stops_at_an_unreadable_checkpoint_among_several(tmp_path, monkeypatch, capsys):
    runs = _scored(tmp_path, monkeypatch, {"bad": None, "good": [(1, 20.0, None)]})
    assert rescore.rescore_main(runs) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == (
        f"mptex-rescore: error: {tmp_path / 'bad' / 'checkpoint.pt'}: not a readable checkpoint"
    )
    assert captured.out == ""


# ----------------------------------------------------------------------------- mptex-check
@pytest.mark.parametrize("value", ["0", "inf", "nan", "-0.001", "big"])
def test_check_refuses_a_cotangent_scale_that_is_no_finite_positive_number(value, capsys):
    assert check_main(["--points", "16", "--cotangent-scale", value]) == 2
    assert capsys.readouterr().err.strip() == (
        f"mptex-check: error: --cotangent-scale: expected 'training' or a number > 0, got {value!r}"
    )


def test_check_refuses_an_out_path_that_is_a_folder_before_any_work(tmp_path, capsys):
    assert check_main(["--points", "16", "--out", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == (
        f"mptex-check: error: --out: cannot write {tmp_path} (not a writable file location)"
    )
    assert captured.out == ""


def test_check_refuses_a_texture_config_that_is_no_mapping(tmp_path, capsys):
    path = tmp_path / "list.yaml"
    path.write_text("- channels\n- 3\n")
    assert check_main(["--points", "16", "--texture-config", str(path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"mptex-check: error: --texture-config: {path}: expected a mapping of texture keys"
    )


def test_check_names_its_own_points_flag_when_refusing_none(capsys):
    assert check_main(["--points", "0"]) == 2
    assert capsys.readouterr().err.strip() == (
        "mptex-check: error: --points: expected a positive integer, got 0"
    )


def test_a_stage_whose_error_is_nan_is_flagged_not_passed():
    # A NaN weight makes the layer's output (and its f64 reference) NaN: an error that no
    # dtype explains, never one within its bound.
    texture = _source_texture("small", 0)
    with torch.no_grad():
        texture.net.layers[1].weight[0, 0] = float("nan")
    report = compare_setups(texture, Setup("f32"), Setup("f32"), points=64, seed=0)
    assert not report.ok
    assert set(report.first_exceeding.values()) == {"net.1"}
