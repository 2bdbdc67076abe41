"""Randomised cross-checks of the numerical core against independent references.

Each test draws its configurations and inputs from a seeded generator (the same cases on every
run) and compares the product code with a reference written from the documented behaviour:
scipy for the statistics, per-element loops for the grid, the fused MLP and the FP8 formats.
"""

from __future__ import annotations

import random

import pytest
from scipy import stats

from mptex.intervals import t_quantile

# ------------------------------------------------------------------------------ intervals


def _random_dof(rng: random.Random) -> float:
    return rng.choice(
        [
            rng.uniform(0.05, 1.0),  # fractional, below one
            rng.uniform(1.0, 30.0),
            float(rng.randint(1, 60)),
            10 ** rng.uniform(2, 5),
            10 ** rng.uniform(5, 300),  # beyond any seed count: the normal limit
        ]
    )


def test_t_quantile_matches_scipy_over_random_dofs_and_probabilities():
    rng = random.Random(11)
    for _ in range(300):
        dof = _random_dof(rng)
        p = rng.choice([rng.uniform(0.5, 0.99999), rng.uniform(1e-5, 0.5), 0.975])
        want = stats.t.ppf(p, dof)
        # bisection to 1e-12 of the bracket; the continued fraction's own error is below 1e-8
        # relative at 1e5 degrees of freedom, where it hands over to the normal expansion
        assert t_quantile(p, dof) == pytest.approx(want, rel=1e-8, abs=1e-10), (p, dof)


@pytest.mark.parametrize("dof", [1e6, 1e10, 1e16, 1e20, 1e300])
def test_t_quantile_with_huge_dof_tends_to_the_normal_quantile(dof):
    # scipy: 1.959963984540054 for dof -> infinity, above it by ~2.4e-7 * 1e6 / dof
    assert t_quantile(0.975, dof) == pytest.approx(stats.t.ppf(0.975, dof), rel=1e-12)
    assert t_quantile(0.6, dof) == pytest.approx(stats.t.ppf(0.6, dof), rel=1e-12)
