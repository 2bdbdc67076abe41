"""How often the ablation report's verdicts are wrong, measured end to end on simulated sweeps.

    python benchmarks/report_calibration.py [--sweeps 4000] [--seed 0] [--json PATH] [--quick]

Each simulated sweep is a folder of run directories (``metrics.json`` with the fields the
report reads) whose truth is known, read by the report's own code: ``collect_runs``,
``group_runs``, ``summarize_groups`` (pairing, intervals, Bonferroni's k, verdicts) and
``render_report`` (the reading a user gets). A design's folder is written and read once; each
draw then sets the PSNR, time and status of the runs ``collect_runs`` returned (the fields the
statistics read), and the first draws of every design are also written out as run directories
and read back from disk, which must give the same rows (else the script stops).

The truth. PSNR of arm a on scene c at seed s: 60 dB + u[c, s] (a seed effect shared by every
arm, normal, sd ``seed_sd``) + Δ[a, c] + e[a, c, s] (normal, sd ``noise``); time per iteration
0.1 s x exp(v[c, s] + w[a, c, s]) (v: sd 0.3, shared by every arm; w: sd 0.05). The designs:

- null: every Δ = 0; seeds 2, 3, 5, 10; k compared arms; noise 0.1-1 dB.
- delta: Δ = -1, -0.3, 0, +0.5 dB; does each interval hold its true Δ (coverage)? The same
  draws with the seed effect's sd 0 and 10 dB: the intervals must not differ (pairing).
- margin: two arms at Δ = -m, two at +m (m = 0.5 dB): how often "at f32's quality" (the
  interval's lower end at or above -m) and "no detectable difference within ±m" are said.
- speed: equal times; how often an arm's per-seed speed-up interval lies above 1 (``faster``)
  and how often the reading names a fastest arm faster than f32.
- missing: two scenes, f32 at seeds 0-5 and the arms at seeds 2-7, each run failed or
  diverged with probability 0.2, seed effect sd 10 dB: every pair must be the same seed in the
  same scene (its difference free of the seed effect), and the intervals must cover.
- skewed: an arm's run loses 2 dB with probability 0.1 (the true Δ is their mean, -0.2 dB), as
  a seed now and then trains worse: the coverage of Student-t intervals, whose 95 % assumes
  normal differences, measured (not checked).

``--quick``: one or two settings of each design (no skewed one), for the test suite.

Bounds: a rate is compared with its nominal value p0 within 4 sigma of a binomial over the
sweeps, 4 sqrt(p0 (1 - p0) / sweeps): the sweeps are the independent units (a sweep's k
comparisons share f32's runs; the mean of k dependent indicators has a variance of at most
p0 (1 - p0)). "= p0": the method's rate is exactly p0 (Student-t intervals of normal
differences), checked both ways; "<= p0": an upper bound (a union bound, or a test at the
margin that is conservative); "~ p0": measured beside the nominal rate, not checked.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import tempfile
from pathlib import Path

from mptex.intervals import faster
from mptex.report import collect, markdown, stats, writer

MARGIN_DB = 0.5
BASE_PSNR, BASELINE_PSNR, BASE_TIME = 60.0, 10.0, 0.1
TIME_SEED_SD, TIME_NOISE_SD = 0.3, 0.05
# Compared arms, the first k of them in a design (the reference is collect.REFERENCE_ARM).
ARMS = ("nvdiffrec", "f16_dynamic", "amp", "bf16", "fp8", "fp8_current", "fp8_rowwise",
        "int8_qat")  # fmt: skip
REF = collect.REFERENCE_ARM
SIGMAS = 4.0  # the Monte Carlo tolerance, in binomial standard deviations
VERIFY_DRAWS = 2  # draws per design also written out and read back from disk
READ_DRAWS = 25  # draws per design whose reading's lines are checked against the rows


def _record(scene, arm, seed, status, psnr, time) -> dict:
    """A run's metrics.json, as far as the report reads it."""
    done = status == "completed"
    history = [{"iteration": 10, "loss": 0.1, "psnr": (psnr - 5.0) if done else None,
                "loss_scale": 1.0, "skipped": False},
               {"iteration": 20, "loss": 0.05, "psnr": psnr if done else None,
                "loss_scale": 1.0, "skipped": False}]  # fmt: skip
    return {
        "status": status, "psnr": psnr if done else None, "baseline_psnr": BASELINE_PSNR,
        "precision": arm, "scene": scene, "seed": seed, "iterations": 20,
        "iterations_planned": 20, "time_per_iter_s": time if done else None,
        "skipped_steps": 0, "final_loss_scale": 1.0,
        "diverged_at": 7 if status == "diverged" else None,
        "failed_at": 3 if status == "failed" else None,
        "error": "simulated failure" if status == "failed" else None, "device": "cpu",
        "history": history,
        "config": {"precision": {"name": arm, "loss_scaling": "none"},
                   "scene": {"name": scene}, "train": {"seed": seed}},
    }  # fmt: skip


def _write(root: Path, draw: dict) -> None:
    for (scene, arm, seed), (status, psnr, time) in draw.items():
        job = root / f"{scene}_{arm}_{seed}"
        job.mkdir(parents=True)
        (job / "metrics.json").write_text(json.dumps(_record(scene, arm, seed, status, psnr, time)))


def _report(runs, adjust: str, root: Path | None = None):
    """The rows (and, with ``root``, report.md's text) of the runs, as write_report makes them."""
    if root is None:
        return writer.summarize(runs, MARGIN_DB, adjust), None
    keys, groups, (duplicates, unidentified), rows = writer._tables(runs, MARGIN_DB, adjust)
    text = markdown.render_report(root, runs, keys, rows, groups, stats.sections(rows),
                                  duplicates, unidentified, {}, MARGIN_DB, 1)  # fmt: skip
    return rows, text


# The row fields the simulations read: what reading from disk must reproduce.
_STAT_FIELDS = ("scene", "precision", "reference", "pairs", "unpaired_seeds", "delta",
                "verdict", "family", "confidence", "seed_times", "speedup_ci")  # fmt: skip


class Sweep:
    """One design's run directories, collected once; :meth:`set` gives them a draw's values."""

    def __init__(self, work: Path, name: str, plan: dict):
        self.work, self.name = work, name
        self.root = work / name
        _write(self.root, {key: ("completed", BASE_PSNR, BASE_TIME) for key in plan})
        self.runs = collect.collect_runs(self.root)
        self.by_key = {(r["scene"], r["precision"], r["seed"]): r for r in self.runs}
        if sorted(self.by_key) != sorted(plan):
            raise SystemExit(f"{name}: the report read {len(self.by_key)} runs of {len(plan)}")
        self.verified = 0

    def set(self, draw: dict) -> None:
        for key, (status, psnr, time) in draw.items():
            run = self.by_key[key]
            done = status == "completed"
            run.update(status=status, psnr=psnr if done else None,
                       time_per_iter_s=time if done else None)  # fmt: skip

    def rows(self, draw: dict, adjust: str, read: bool = False):
        """The draw's rows (and report.md's text with ``read``); the first draws are also
        written to disk and read back, which must give the same rows."""
        self.set(draw)
        rows, text = _report(self.runs, adjust, self.root if read else None)
        if self.verified < VERIFY_DRAWS:
            self.verified += 1
            root = self.work / f"{self.name}_check{self.verified}_{adjust}"
            _write(root, draw)
            again, _ = _report(collect.collect_runs(root), adjust)
            mine = [{k: r[k] for k in _STAT_FIELDS} for r in rows]
            theirs = [{k: r[k] for k in _STAT_FIELDS} for r in again]
            if mine != theirs:
                raise SystemExit(f"{self.name}: the rows of runs read from disk differ from "
                                 "those of the collected runs given the same values")  # fmt: skip
        return rows, text


def _plan(scenes, seeds_of: dict) -> dict:
    return {(scene, arm, seed): None for scene in scenes for arm, seeds in seeds_of.items()
            for seed in seeds}  # fmt: skip


def _draw(rng, plan, delta, noise, seed_sd, fail=0.0, seed_scale=1.0) -> dict:
    """One sweep's values: ``{(scene, arm, seed): (status, psnr, time)}``; ``delta(arm,
    scene)``: the true difference to the reference."""
    shared = {}
    draw = {}
    for scene, arm, seed in plan:
        if (scene, seed) not in shared:
            shared[scene, seed] = (rng.gauss(0.0, seed_sd), rng.gauss(0.0, TIME_SEED_SD))
        u, v = shared[scene, seed]
        psnr = BASE_PSNR + seed_scale * u + delta(arm, scene) + rng.gauss(0.0, noise)
        time = BASE_TIME * math.exp(v + rng.gauss(0.0, TIME_NOISE_SD))
        status = "completed"
        if fail and rng.random() < fail:
            status = rng.choice(("failed", "diverged"))
        draw[scene, arm, seed] = (status, psnr, time)
    return draw


class Tally:
    """Counts of one rate: ``hits`` of ``trials`` over ``units`` independent sweeps."""

    def __init__(self, design, what, adjust, nominal, kind):
        self.design, self.what, self.adjust = design, what, adjust
        self.nominal, self.kind = nominal, kind
        self.hits = self.trials = self.units = 0

    def add(self, hits: int, trials: int) -> None:
        self.hits += hits
        self.trials += trials
        self.units += trials > 0

    def record(self) -> dict:
        rate = self.hits / self.trials if self.trials else None
        tolerance = SIGMAS * math.sqrt(self.nominal * (1 - self.nominal) / max(self.units, 1))
        if rate is None:
            ok = False
        elif self.kind == "=":
            ok = abs(rate - self.nominal) <= tolerance
        elif self.kind == "<=":
            ok = rate <= self.nominal + tolerance
        else:  # measured, not checked
            ok = None
        return {"design": self.design, "what": self.what, "adjust": self.adjust,
                "hits": self.hits, "trials": self.trials, "units": self.units, "rate": rate,
                "nominal": self.nominal, "kind": self.kind, "tolerance": tolerance,
                "ok": ok}  # fmt: skip


def _claims(rows) -> list:
    return [r for r in rows if r["verdict"] in ("better", "worse")]


def _check_reading(name, rows, text) -> None:
    """The reading's `Better than` / `Worse than` lines name exactly the rows so judged."""
    for verdict, lead in (("better", f"- Better than `{REF}`: "),
                          ("worse", f"- Worse than `{REF}`: ")):  # fmt: skip
        named = {arm for line in text.splitlines() if line.startswith(lead)
                 for arm in re.findall(r"`(\w+)` \(", line[len(lead):])}  # fmt: skip
        said = {r["precision"] for r in rows if r["verdict"] == verdict}
        if named != said:
            raise SystemExit(f"{name}: the reading's {verdict} line names {sorted(named)}, the "
                             f"rows {sorted(said)}")  # fmt: skip


def null_designs(work, rng, sweeps, quick=False) -> list[dict]:
    out = []
    settings = ((2, 5, 0.3), (3, 5, 0.3), (5, 5, 0.3), (10, 5, 0.3), (3, 1, 1.0), (5, 8, 0.1))
    for n, k, noise in settings[::3] if quick else settings:
        name = f"null n={n} k={k} noise={noise}"
        arms = (REF, *ARMS[:k])
        plan = _plan(("builtin",), {a: range(n) for a in arms})
        sweep = Sweep(work, f"null{n}_{k}", plan)
        each = {a: Tally(name, "false better/worse, per comparison", a, 0.05 if a == "none"
                         else 0.05 / k, "=") for a in ("none", "bonferroni")}  # fmt: skip
        some = {"none": Tally(name, "some false better/worse, per sweep", "none",
                              1 - 0.95**k, "<="),
                "bonferroni": Tally(name, "some false better/worse, per sweep", "bonferroni",
                                    0.05, "<=")}  # fmt: skip
        for i in range(sweeps):
            draw = _draw(rng, plan, lambda arm, scene: 0.0, noise, seed_sd=3.0)
            for adjust in ("none", "bonferroni"):
                rows, text = sweep.rows(draw, adjust, read=i < READ_DRAWS)
                if text is not None:
                    _check_reading(name, rows, text)
                compared = [r for r in rows if r["verdict"] is not None]
                if len(compared) != k or any(r["family"] != k for r in rows):
                    raise SystemExit(f"{name}: {len(compared)} comparisons, family "
                                     f"{rows[0]['family']}, expected {k}")  # fmt: skip
                hits = len(_claims(rows))
                each[adjust].add(hits, k)
                some[adjust].add(int(hits > 0), 1)
        out += [t.record() for t in (*each.values(), *some.values())]
    return out


def delta_designs(work, rng, sweeps, quick=False) -> tuple[list[dict], float]:
    truth = dict(zip(ARMS, (-1.0, -0.3, 0.0, 0.5)))
    k = len(truth)
    out, widest = [], 0.0
    for n in (3,) if quick else (3, 5, 10):
        name = f"delta n={n} k={k} noise=0.3"
        plan = _plan(("builtin",), {a: range(n) for a in (REF, *truth)})
        sweep = Sweep(work, f"delta{n}", plan)
        cover = {a: Tally(name, "interval holds the true Δ", a, c, "=")
                 for a, c in (("none", 0.95), ("bonferroni", 1 - 0.05 / k))}  # fmt: skip
        for i in range(sweeps):
            stream = rng.getrandbits(64)  # the sweep's own generator, to draw it again below

            def draw_of(scale, stream=stream, plan=plan):
                return _draw(random.Random(stream), plan, lambda arm, scene: truth.get(arm, 0.0),
                             0.3, seed_sd=3.0, seed_scale=scale)  # fmt: skip

            draw = draw_of(1.0)
            for adjust, tally in cover.items():
                rows, _ = sweep.rows(draw, adjust)
                compared = [r for r in rows if r["verdict"] is not None]
                held = sum(r["delta"]["low"] <= truth[r["precision"]] <= r["delta"]["high"]
                           for r in compared)  # fmt: skip
                tally.add(held, len(compared))
            if i < READ_DRAWS:  # the same noise without the seed effect, and with ten times it
                widths = [
                    [
                        r["delta"]["half_width"]
                        for r in sweep.rows(draw_of(scale), "none")[0]
                        if r["verdict"] is not None
                    ]
                    for scale in (0.0, 10.0 / 3.0)
                ]
                widest = max([widest, *(abs(a - b) for a, b in zip(*widths))])
        out += [t.record() for t in cover.values()]
    return out, widest


def _per_adjust(k: int, make) -> dict:
    """``{adjust: make(adjust, one_sided)}`` for both adjustments, ``one_sided`` being what one
    side of each of k intervals leaves out (2.5 % unadjusted)."""
    return {adjust: make(adjust, (1 - stats.family_confidence(k, adjust)) / 2)
            for adjust in ("none", "bonferroni")}  # fmt: skip


def margin_designs(work, rng, sweeps, quick=False) -> list[dict]:
    truth = dict(zip(ARMS, (-MARGIN_DB, -MARGIN_DB, MARGIN_DB, MARGIN_DB)))
    k = len(truth)
    out = []
    for n in (3,) if quick else (3, 5):
        name = f"margin n={n} k={k} noise=0.3"
        plan = _plan(("builtin",), {a: range(n) for a in (REF, *truth)})
        sweep = Sweep(work, f"margin{n}", plan)
        tallies = _per_adjust(k, lambda adjust, one_sided, name=name: (
            Tally(name, f"at {REF}'s quality at Δ = -m", adjust, one_sided, "="),
            Tally(name, "no detectable difference at Δ = ±m", adjust, one_sided, "<="),
        ))  # fmt: skip
        for _ in range(sweeps):
            draw = _draw(rng, plan, lambda arm, scene: truth.get(arm, 0.0), 0.3, seed_sd=3.0)
            for adjust, (inferior, equivalent) in tallies.items():
                rows, _ = sweep.rows(draw, adjust)
                low = [r for r in rows if r["verdict"] is not None and
                       truth[r["precision"]] < 0]  # fmt: skip
                inferior.add(sum(stats.non_inferior(r, MARGIN_DB) for r in low), len(low))
                compared = [r for r in rows if r["verdict"] is not None]
                equivalent.add(sum(r["verdict"] == "no detectable difference"
                                   for r in compared), len(compared))  # fmt: skip
        out += [t.record() for pair in tallies.values() for t in pair]
    return out


def speed_designs(work, rng, sweeps, quick=False) -> list[dict]:
    k = 5
    out = []
    for n in (3,) if quick else (3, 5):
        name = f"speed n={n} k={k} equal times"
        plan = _plan(("builtin",), {a: range(n) for a in (REF, *ARMS[:k])})
        sweep = Sweep(work, f"speed{n}", plan)
        tallies = _per_adjust(k, lambda adjust, one_sided, name=name: (
            Tally(name, f"faster than {REF}, per comparison", adjust, one_sided, "="),
            Tally(name, "the reading names an arm faster, per sweep", adjust,
                  1 - (1 - one_sided) ** k if adjust == "none" else 0.025, "<="),
        ))  # fmt: skip
        for _ in range(sweeps):
            # Δ = 0 with little noise: (about) every arm is at f32's quality, so (about) every
            # arm's speed is tested by the reading (at 0.005 dB, a Bonferroni interval of 3
            # seeds is wider than ±0.5 dB with a probability below 1e-60).
            draw = _draw(rng, plan, lambda arm, scene: 0.0, 0.005, seed_sd=3.0)
            for adjust, (each, some) in tallies.items():
                rows, text = sweep.rows(draw, adjust, read=True)
                compared = [r for r in rows if r["verdict"] is not None]
                fast = sum(faster(r["speedup_ci"]) for r in compared)
                tested = sum(faster(r["speedup_ci"]) for r in compared
                             if stats.at_reference_quality(r, MARGIN_DB))  # fmt: skip
                named = f"- Fastest arm at `{REF}`'s quality: **" in text
                if named != (tested > 0):
                    raise SystemExit(f"{name}: the reading names a fastest arm: {named}, rows "
                                     f"at {REF}'s quality shown faster: {tested}")  # fmt: skip
                each.add(fast, len(compared))
                some.add(int(named), 1)
        out += [t.record() for pair in tallies.values() for t in pair]
    return out


def missing_designs(work, rng, sweeps) -> tuple[list[dict], int]:
    scenes = ("builtin", "torus")
    truth = {("nvdiffrec", "builtin"): 0.4, ("nvdiffrec", "torus"): -0.4,
             ("bf16", "builtin"): 0.0, ("bf16", "torus"): 0.8,
             ("fp8", "builtin"): -0.6, ("fp8", "torus"): 0.2}  # fmt: skip
    arms = sorted({a for a, _ in truth})
    seeds_of = {REF: range(0, 6), **{a: range(2, 8) for a in arms}}
    plan = _plan(scenes, seeds_of)
    name = "missing: 2 scenes, seeds 0-5 / 2-7, 20 % lost"
    sweep = Sweep(work, "missing", plan)
    # Coverage unadjusted (Bonferroni's k varies with the losses); both adjustments are
    # checked for the pairs and the family's size.
    cover = Tally(name, "interval holds the true Δ", "none", 0.95, "=")
    mispaired = 0
    for _ in range(sweeps):
        draw = _draw(rng, plan, lambda arm, scene: truth.get((arm, scene), 0.0), 0.3,
                     seed_sd=10.0, fail=0.2)  # fmt: skip
        done = {key for key, (status, _, _) in draw.items() if status == "completed"}
        for adjust in ("none", "bonferroni"):
            rows, _ = sweep.rows(draw, adjust)
            with_interval = [r for r in rows if r["delta"]["low"] is not None]
            for r in rows:
                if r["precision"] == REF:
                    continue
                scene, arm = r["scene"], r["precision"]
                mine = {s for (c, a, s) in done if (c, a) == (scene, arm)}
                ref = {s for (c, a, s) in done if (c, a) == (scene, REF)}
                # Same seed, same scene: a difference holds Δ and two runs' noise, never the
                # seed effect (sd 10 dB).
                residual = [d - (draw[scene, arm, s][1] - draw[scene, REF, s][1])
                            for s, d in r["pairs"]]  # fmt: skip
                if (sorted(s for s, _ in r["pairs"]) != sorted(mine & ref)
                        or sorted(r["unpaired_seeds"]) != sorted(mine - ref)
                        or any(abs(x) > 1e-9 for x in residual)
                        or r["family"] != len(with_interval)):  # fmt: skip
                    mispaired += 1
            if adjust == "none":
                cover.add(sum(r["delta"]["low"] <= truth[r["precision"], r["scene"]]
                              <= r["delta"]["high"] for r in with_interval),
                          len(with_interval))  # fmt: skip
    return [cover.record()], mispaired


def skewed_designs(work, rng, sweeps) -> list[dict]:
    out = []
    for n in (3, 5, 10):
        name = f"skewed n={n} k=1 noise=0.3, 10 % of runs -2 dB"
        plan = _plan(("builtin",), {a: range(n) for a in (REF, ARMS[0])})
        sweep = Sweep(work, f"skewed{n}", plan)
        cover = Tally(name, "interval holds the true Δ", "none", 0.95, "~")
        for _ in range(sweeps):
            draw = _draw(rng, plan, lambda arm, scene: 0.0, 0.3, seed_sd=3.0)
            for key, (status, psnr, time) in draw.items():
                if key[1] != REF and rng.random() < 0.1:
                    draw[key] = (status, psnr - 2.0, time)
            rows, _ = sweep.rows(draw, "none")
            (row,) = [r for r in rows if r["verdict"] is not None]
            cover.add(int(row["delta"]["low"] <= -0.2 <= row["delta"]["high"]), 1)
        out.append(cover.record())
    return out


def simulate(sweeps: int, seed: int, quick: bool = False) -> dict:
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="mptex-calibration-") as tmp:
        work = Path(tmp)
        rates = null_designs(work, rng, sweeps, quick)
        covered, widest = delta_designs(work, rng, sweeps, quick)
        rates += covered + margin_designs(work, rng, sweeps, quick)
        rates += speed_designs(work, rng, sweeps, quick)
        covered, mispaired = missing_designs(work, rng, sweeps)
        rates += covered + ([] if quick else skewed_designs(work, rng, sweeps))
    return {"sweeps": sweeps, "seed": seed, "sigmas": SIGMAS, "rates": rates,
            "pairing_width_change_db": widest, "mispaired_rows": mispaired}  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweeps", type=int, default=4000, help="simulated sweeps per design")
    parser.add_argument("--seed", type=int, default=0, help="the simulation's random seed")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="one or two settings of each design (the test suite's run)",
    )
    args = parser.parse_args(argv)
    if args.sweeps < 1:
        parser.error(f"--sweeps: expected an integer >= 1, got {args.sweeps}")
    result = simulate(args.sweeps, args.seed, args.quick)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    rows = [[r["design"], r["what"], r["adjust"], f"{r['hits']} / {r['trials']}",
             f"{100 * r['rate']:.2f} %", f"{r['kind']} {100 * r['nominal']:.2f} %",
             f"± {100 * r['tolerance']:.2f} %",
             {True: "ok", False: "OFF", None: "measured"}[r["ok"]]]
            for r in result["rates"]]  # fmt: skip
    print(
        f"{args.sweeps} simulated sweeps per design, seed {args.seed}; tolerance "
        f"{SIGMAS:g} binomial sigmas over the sweeps\n"
    )
    print(markdown.markdown_table(["design", "rate of", "adjust", "count", "rate", "nominal",
                                   "tolerance", ""], rows))  # fmt: skip
    print(
        f"\nLargest change of an interval's half-width between a seed effect of sd 0 and "
        f"10 dB (same noise): {result['pairing_width_change_db']:.3g} dB"
    )
    print(
        f"Rows paired with another seed or scene, or a wrong family size: "
        f"{result['mispaired_rows']}"
    )
    bad = [r for r in result["rates"] if r["ok"] is False]
    return 1 if bad or result["mispaired_rows"] or result["pairing_width_change_db"] > 1e-9 else 0


if __name__ == "__main__":
    sys.exit(main())
