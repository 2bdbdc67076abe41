"""How often a family of intervals makes a chance claim, unadjusted and Bonferroni-adjusted.

    python benchmarks/multiplicity.py [--sweeps 20000] [--seed 0]

Two simulations with the report's and the search's own interval code
(:func:`mptex.intervals.family_confidence`, Student-t intervals at that confidence):

1. **Report**: k = 5 arms that truly equal f32, 3 seeds each; each arm's differences are
   paired with the same f32 runs (as in a sweep, so the k intervals are dependent), PSNRs drawn
   from a normal with sd 1 dB. Counted: the sweeps where some interval excludes 0 (a chance
   ``better`` or ``worse``).
2. **Search**: 3 candidates each exactly 0.5 dB below f32 (at the margin), 3 seeds, sd 0.2 dB
   per run. Counted: the searches where some candidate's interval lies inside +-0.5 dB (a
   false certification).

Each rate is printed with its 95 % binomial half-width (1.96 sqrt(p (1 - p) / sweeps)).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import print_table  # noqa: E402

from mptex.intervals import family_confidence, t_quantile  # noqa: E402


def _half(values, t):
    return t * statistics.stdev(values) / math.sqrt(len(values))


def chance_verdicts(adjust: str, sweeps: int, rng: random.Random, k=5, n=3) -> float:
    """The share of sweeps of k arms equal to f32 where some interval excludes 0."""
    t = t_quantile(0.5 + family_confidence(k, adjust) / 2, n - 1)
    hits = 0
    for _ in range(sweeps):
        ref = [rng.gauss(0.0, 1.0) for _ in range(n)]
        for _ in range(k):
            d = [rng.gauss(0.0, 1.0) - r for r in ref]
            if abs(statistics.fmean(d)) > _half(d, t):
                hits += 1
                break
    return hits / sweeps


def false_certifications(adjust: str, sweeps: int, rng: random.Random, k=3, n=3,
                         margin=0.5) -> float:  # fmt: skip
    """The share of searches of k candidates at -margin where some candidate certifies."""
    t = t_quantile(0.5 + family_confidence(k, adjust) / 2, n - 1)
    hits = 0
    for _ in range(sweeps):
        ref = [rng.gauss(0.0, 0.2) for _ in range(n)]
        for _ in range(k):
            d = [-margin + rng.gauss(0.0, 0.2) - r for r in ref]
            mean, half = statistics.fmean(d), _half(d, t)
            if -margin <= mean - half and mean + half <= margin:
                hits += 1
                break
    return hits / sweeps


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweeps", type=int, default=20000, help="simulated sweeps per row")
    parser.add_argument("--seed", type=int, default=0, help="the simulation's random seed")
    args = parser.parse_args(argv)
    if args.sweeps < 1:
        parser.error(f"--sweeps: expected an integer >= 1, got {args.sweeps}")
    rows = []
    for what, simulate in (("report: some chance verdict, 5 equal arms", chance_verdicts),
                           ("search: some false certification, 3 candidates at -0.5 dB",
                            false_certifications)):  # fmt: skip
        for adjust in ("none", "bonferroni"):
            p = simulate(adjust, args.sweeps, random.Random(args.seed))
            half = 1.96 * math.sqrt(p * (1 - p) / args.sweeps)
            rows.append([what, adjust, f"{100 * p:.1f} % ± {100 * half:.1f} %"])
    print(f"{args.sweeps} simulated sweeps per row, 3 seeds, seed {args.seed}\n")
    print_table(["family", "adjust", "rate (95 % binomial)"], rows)


if __name__ == "__main__":
    main()
