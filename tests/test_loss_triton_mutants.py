"""The fused loss's Triton kernels (mptex/train/_loss_triton.py) at the sRGB curve's knee,
under Triton's CPU interpreter in ONE subprocess (tests/loss_triton_interpreted.py).

``u = log(c + 1)`` takes only the values of ``log`` at the float32 numbers near 1, 2^-23 apart,
while the knee ``0.0031308`` sits among float32 numbers 2^-32 apart: one ``u`` lies between
float32(0.0031308) and float32(0.0031309) (``c = 26305 * 2^-23``), and no ``u`` equals the knee.
That element is where a knee constant off in its last digits would change the branch: its
gradient is autograd's (the two branches' derivatives there, 12.92 and about 12.70, lie 1.7 %
apart), and its forward term is the mapped branch's value computed here in float64 and rounded
as the kernels round.

The smoothness term's backward with a negative incoming gradient: the channels past kd get
autograd's +0.0 (a slice's backward), not ``g * sign(0)``, which is -0.0 for a negative ``g``;
the cases of tests/test_fused_loss.py all have a positive one.
"""

import math

import numpy as np
import pytest
import torch
from test_fused_loss import _autograd, _distinguishing_grad, _kd_autograd, _kd_case
from triton_subprocess import run_cases

pytestmark = [pytest.mark.requires_triton, pytest.mark.slow]

f32 = np.float32
# c + 1 with u = log(c + 1) just above the knee, and its two neighbours below and above.
JUST_ABOVE = 26305 * 2.0**-23
NEAR = [26304 * 2.0**-23, JUST_ABOVE, 26306 * 2.0**-23]


def _knee_cases():
    """One pixel per value: channel 0 the value, channels 1 and 2 zero; alpha 1 and a black
    reference, so that each program's partial sum is the value's mapped term alone."""
    cases = []
    for i, value in enumerate(NEAR):
        pred = torch.tensor([[[value, 0.0, 0.0]]])
        rgba = torch.tensor([[[0.0, 0.0, 0.0, 1.0]]])
        cases.append(dict(name=f"knee{i}", pred=pred, rgba=rgba, background=torch.zeros(1, 1, 3),
                          grad=_distinguishing_grad(3), tonemap=True))  # fmt: skip
    return cases


def _negative_kd_case():
    case = _kd_case("kd_nine")
    return dict(case, name="kd_nine_negative", grad=-case["grad"])


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    cases = _knee_cases() + [_negative_kd_case()]
    return run_cases("loss_triton_interpreted.py", cases, tmp_path_factory.mktemp("knee"), 600)


def _tone_mapped(x: float) -> float:
    """The log-sRGB value of a float32 x in [0, 65535], each step rounded to float32 as the
    interpreted kernels round it (log and pow in float64, then rounded once)."""
    u = f32(math.log(float(f32(f32(x) + f32(1.0)))))
    knee = f32(0.0031308)
    if u > knee:
        powered = f32(np.exp2(np.log2(np.float64(u)) * float(f32(1.0 / 2.4))))
        return float(f32(powered * f32(1.055)) - f32(0.055))
    return float(u * f32(12.92))


def test_one_log_value_lies_just_above_the_knee():
    # What the cases rest on: u of JUST_ABOVE is within the knee's last digits, the
    # neighbours' are not, and no u equals the knee.
    logs = [f32(math.log(float(f32(v + 1.0)))) for v in NEAR]
    assert f32(0.0031308) < logs[1] <= f32(0.0031309)
    assert logs[0] < f32(0.0031308) and logs[2] > f32(0.0031309)


@pytest.mark.parametrize("index", range(len(NEAR)))
def test_knee_gradient_is_autograds(interpreted, index):
    case = _knee_cases()[index]
    args = case["pred"], case["rgba"], case["background"]
    _, want = _autograd(*args, case["grad"], "logl1")
    got = interpreted[case["name"]]["grad"]
    # torch's CPU pow is an ulp off the correctly rounded value here (which the interpreted
    # kernels compute): a few ulps, as tests/test_fused_loss.py allows such elements; the other
    # branch's gradient is 1.7 % away.
    assert torch.allclose(got, want, rtol=2e-6, atol=0), (got, want)


@pytest.mark.parametrize("index", range(len(NEAR)))
def test_knee_forward_term_is_the_branch_by_hand(interpreted, index):
    partials = interpreted[f"knee{index}"]["partials"]
    assert partials.shape == (1,)
    assert partials.item() == _tone_mapped(NEAR[index])


@pytest.mark.parametrize("reciprocal", [False, True], ids=["cpu_division", "cuda_reciprocal"])
def test_smoothness_gradient_for_a_negative_incoming_gradient(interpreted, reciprocal):
    case = _negative_kd_case()
    assert case["grad"] < 0
    args = case["tex"], case["tex_jitter"], case["grad"], case["pixels"]
    _, want_jitter, want_tex = _kd_autograd(*args, reciprocal)
    got_jitter, got_tex = interpreted[case["name"]]["grad_reciprocal" if reciprocal else "grad"]
    for got, want in ((got_jitter, want_jitter), (got_tex, want_tex)):
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (got, want)
