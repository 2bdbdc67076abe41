"""Cases of the grid encoding's Triton kernels that the main interpreted suite
(tests/test_encoding_triton.py) leaves out, each against the torch twin, bit for bit, under
Triton's CPU interpreter in ONE subprocess (tests/triton_interpreted.py).

- the input gradient of many levels over many coordinates: the kernels write each level's
  d pos and the host sums the levels in order, as the twin does; torch's ``sum(0)`` over the
  levels reorders the additions once there are 5 or more levels and more than a few dozen
  points' coordinates (its vectorised reduction splits the columns), so a 3-d grid of 6 levels
  at 48 points tells the two apart where the main suite's configurations (at most 5 levels, or
  2-d) do not;
- a 4-d smoothstep grid: each dimension's d pos takes its own smoothstep derivative, which
  the 4-d linear configuration of the main suite cannot check (there every derivative is 1).
"""

import pytest
import torch
from test_encoding_triton import _case, _twin, _twin_results, interpret

pytestmark = pytest.mark.requires_triton

# 3-d, 6 levels (2 dense, 4 hashed), 48 points: 144 coordinates per level.
MANY_LEVELS = dict(n_levels=6, log2_hashmap_size=8, base_resolution=4, per_level_scale=1.5)
SMOOTH_4D = dict(n_levels=2, log2_hashmap_size=8, base_resolution=3, per_level_scale=1.7,
                 interpolation="Smoothstep")  # fmt: skip


def _cases():
    x = torch.rand(48, 3, generator=torch.Generator().manual_seed(11))
    x4 = torch.rand(24, 4, generator=torch.Generator().manual_seed(12))
    return [_case("many-levels", 3, MANY_LEVELS, torch.float32, x, 11),
            _case("4d-smoothstep", 4, SMOOTH_4D, torch.float32, x4, 12)]  # fmt: skip


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return interpret(_cases(), tmp_path_factory.mktemp("grid"))


def test_levels_are_summed_in_order(interpreted):
    case, result = interpreted["many-levels"]
    _, out, grad_x, _, _ = _twin_results(case)
    torch.testing.assert_close(result["out"], out, rtol=0, atol=0)
    torch.testing.assert_close(result["grad_x"], grad_x, rtol=0, atol=0)


def test_the_case_tells_an_in_order_sum_from_torchs_sum():
    # Without this the test above could pass with any summation order: the twin's per-level
    # input gradients, summed in order and by torch's sum over the level axis, must differ.
    case = _cases()[0]
    enc = _twin(3, MANY_LEVELS, torch.float32)
    with torch.no_grad():
        enc.params.copy_(case["params"])
    features = enc.geometry.n_features_per_level
    per_level = []
    for level in range(MANY_LEVELS["n_levels"]):
        x = case["x"].clone().requires_grad_(True)
        columns = slice(level * features, (level + 1) * features)
        (grad,) = torch.autograd.grad((enc(x)[:, columns] * case["v"][:, columns]).sum(), x)
        per_level.append(grad)
    in_order = per_level[0]
    for grad in per_level[1:]:
        in_order = in_order + grad
    assert not torch.equal(torch.stack(per_level).sum(0), in_order)


def test_4d_smoothstep_matches_twin(interpreted):
    case, result = interpreted["4d-smoothstep"]
    _, out, grad_x, _, _ = _twin_results(case)
    torch.testing.assert_close(result["out"], out, rtol=0, atol=0)
    torch.testing.assert_close(result["grad_x"], grad_x, rtol=0, atol=0)
