"""The report's error rates, end to end: ``benchmarks/report_calibration.py`` simulates sweeps of
known truth through the report's own code (run directories, collect, group, summarize, the
reading), and every rate must hold its nominal value within a Monte Carlo bound; and a pair is
one seed in one scene, never another."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from report_runs import metrics as _metrics
from report_runs import write_run as _write

from mptex.report import collect_runs, summarize

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "report_calibration.py"
SWEEPS = 300
# The Monte Carlo tolerance: 4 binomial standard deviations of the nominal rate p0 over the
# sweeps, 4 sqrt(p0 (1 - p0) / sweeps). The sweeps are the independent units: a sweep's k
# comparisons share f32's runs, and the mean of k dependent indicators has a variance of at
# most p0 (1 - p0). At 300 sweeps that is ±5.0 % at p0 = 5 %, ±3.6 % at 2.5 %: wide enough
# for a seeded run of a correct report, narrow enough for the failures it is for (unadjusted
# familywise rates of 20 % and more under --adjust bonferroni, z for t at 2 seeds: 30 %,
# coverage of 100 % from unpaired differences). Mispairing is checked exactly besides.
SIGMAS = 4.0
DESIGNS = {"null", "delta", "margin", "speed", "missing"}


@pytest.fixture(scope="module")
def calibration(tmp_path_factory):
    out = tmp_path_factory.mktemp("calibration") / "rates.json"
    # This checkout's report, whichever mptex is installed.
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--sweeps", str(SWEEPS), "--json", str(out)],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
        env={**os.environ, "PYTHONPATH": path},
    )  # fmt: skip
    assert out.is_file(), done.stderr[-3000:]
    return done, json.loads(out.read_text())


def test_every_rate_holds_its_nominal_value_within_the_monte_carlo_bound(calibration):
    done, result = calibration
    assert result["sweeps"] == SWEEPS and result["rates"]
    assert {r["design"].split()[0].rstrip(":") for r in result["rates"]} == DESIGNS
    off = []
    for rate in result["rates"]:
        assert rate["units"] == SWEEPS, rate
        p0 = rate["nominal"]
        tolerance = SIGMAS * math.sqrt(p0 * (1 - p0) / rate["units"])
        observed = rate["hits"] / rate["trials"]
        if rate["kind"] == "=":  # the method's rate is exactly p0: too few claims is off too
            ok = abs(observed - p0) <= tolerance
        else:
            assert rate["kind"] == "<=", rate
            ok = observed <= p0 + tolerance
        if not ok:
            off.append(f"{rate['design']}, {rate['what']} ({rate['adjust']}): {observed:.4f}, "
                       f"nominal {rate['kind']} {p0:.4f} ± {tolerance:.4f}")  # fmt: skip
    assert not off, off
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_unadjusted_and_adjusted_families_are_both_measured(calibration):
    _, result = calibration
    family = {(r["design"].split()[0], r["what"], r["adjust"]) for r in result["rates"]}
    for design, what in (("null", "some false better/worse, per sweep"),
                         ("speed", "the reading names an arm faster, per sweep")):  # fmt: skip
        assert {(design, what, "none"), (design, what, "bonferroni")} <= family


def test_pairs_hold_no_seed_effect_and_no_other_seed_or_scene(calibration):
    # Missing and failed runs, unequal seed sets, two scenes, a seed effect of sd 10 dB: every
    # pair's difference is that seed's two runs in that scene, and the family counts the
    # intervals; the same noise under seed effects of sd 0 and 10 dB gives the same intervals.
    _, result = calibration
    assert result["mispaired_rows"] == 0
    assert result["pairing_width_change_db"] < 1e-9  # float64 rounding of PSNRs near 60 dB


def test_a_pair_is_one_seed_in_one_scene(tmp_path):
    # PSNR = 30 + 7 seed (+ 11 on the torus) + the arm's Δ: a difference holding another seed or
    # scene would be off by a multiple of 7 or by 11 dB.
    delta = {("bf16", "builtin"): -0.25, ("bf16", "torus"): 0.75}
    seeds = {("f32", "builtin"): range(0, 5), ("f32", "torus"): range(1, 6),
             ("bf16", "builtin"): range(2, 7), ("bf16", "torus"): range(2, 7)}  # fmt: skip
    lost = {("f32", "builtin", 3): "failed", ("bf16", "torus", 4): "diverged"}
    for (arm, scene), arm_seeds in seeds.items():
        for seed in arm_seeds:
            psnr = 30.0 + 7.0 * seed + 11.0 * (scene == "torus") + delta.get((arm, scene), 0.0)
            status = lost.get((arm, scene, seed), "completed")
            _write(tmp_path, f"{scene}_{arm}_{seed}",
                   _metrics(arm, seed, psnr=psnr, status=status, scene=scene))  # fmt: skip
    rows = {(r["precision"], r["scene"]): r for r in summarize(collect_runs(tmp_path))}
    for scene, paired, unpaired in (("builtin", [2, 4], [3, 5, 6]), ("torus", [2, 3, 5], [6])):
        row = rows["bf16", scene]
        assert [seed for seed, _ in row["pairs"]] == paired
        assert [d for _, d in row["pairs"]] == pytest.approx([delta["bf16", scene]] * len(paired),
                                                             abs=1e-9)  # fmt: skip
        assert row["unpaired_seeds"] == unpaired
        assert row["delta"]["n"] == len(paired) and row["family"] == 2
