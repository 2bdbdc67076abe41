"""``mptex::fp8_quantize`` where a recipe's comparison is decided by a rounding, against values
worked out by hand: the eager twin (:func:`mptex._fp8_fused.fp8_quantize_reference`), the C
kernel (the op on the CPU) and the Triton kernels (under Triton's CPU interpreter, in ONE
subprocess, tests/fp8_triton_interpreted.py).

The delayed recipe keeps its scale unless ``amax * scale > fp8_max``. With amax 227.93044 and
scale 1.965512 the float32 product rounds to exactly 448: no overflow, so the scale used is the
given one, although ``448 / amax`` rounds to its neighbour 1.9655119; a ``>=`` in its place
would use that neighbour (and its reciprocal) instead.

The padded layouts (``q_pad``, ``t_pad``) of a per-tensor recipe hold zeros past the matrix
whatever scale the cast used: a delayed scale of NaN, or of inf on a zero tensor (whose amax
is 0, so the scale is kept), makes ``0 * used`` a NaN, whose code must not reach the padding.
"""

import numpy as np
import pytest
import torch
from golden_io import bits
from test_fp8_fused import OUTPUTS
from test_fp8_triton import _op
from triton_subprocess import run_cases

import mptex
from mptex._fp8_fused import fp8_quantize_reference

E4M3 = torch.float8_e4m3fn
AMAX = 227.93044
SCALE = 1.965512


def _x():
    """The amax and a few smaller values of both signs."""
    return torch.tensor([AMAX, -100.0, 3.5, -0.25, 0.0, 17.0], dtype=torch.float32)


def _case():
    return _op("product-rounds-to-fp8-max", _x(), 0, 0, E4M3, scale=torch.tensor(SCALE),
               history=torch.tensor([1.0, 2.0]))  # fmt: skip


def test_the_product_rounds_to_fp8_max_and_the_quotient_does_not_give_the_scale():
    f = np.float32
    assert f(AMAX) * f(SCALE) == f(448.0)
    assert f(448.0) / f(AMAX) != f(SCALE)


def _check(outputs):
    """The hand-worked outputs: the given scale used, its float32 reciprocal, the amax."""
    q, scale_inv, amax, used = outputs[:4]
    assert torch.equal(bits(used), bits(torch.tensor(SCALE)))
    assert torch.equal(bits(scale_inv), bits(torch.tensor(1.0) / torch.tensor(SCALE)))
    assert amax.item() == np.float32(AMAX)
    assert q.view(torch.uint8)[0].item() == 0x7E  # 448, E4M3's largest


def test_twin_keeps_the_scale():
    _check(fp8_quantize_reference(*_case()["args"]))


def test_c_kernel_keeps_the_scale():
    from mptex._native_cpu import native_kernels

    if native_kernels() is None:
        pytest.skip("no C kernel (no compiler, or MPTEX_NATIVE=0)")
    _check(torch.ops.mptex.fp8_quantize(*_case()["args"]))


def _padding_cases():
    x = torch.linspace(-3.0, 5.0, 35).view(5, 7)
    nan, inf = torch.tensor(float("nan")), torch.tensor(float("inf"))
    return [_op("padding-nan-scale", x, 0, 0, E4M3, scale=nan, q_pad=16, t_pad=16),
            _op("padding-inf-scale-zeros", torch.zeros(3, 5), 1, 0, torch.float32, scale=inf,
                q_pad=16, t_pad=16)]  # fmt: skip


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    if not mptex.has_triton():
        pytest.skip("needs triton importable")
    cases = [_case(), *_padding_cases()]
    return run_cases("fp8_triton_interpreted.py", cases, tmp_path_factory.mktemp("fp8"), 600)


def _assert_twins_bits(got, case):
    for output, g, w in zip(OUTPUTS, got, fp8_quantize_reference(*case["args"])):
        assert torch.equal(bits(g), bits(w)), output


@pytest.mark.requires_triton
@pytest.mark.slow
def test_triton_kernels_keep_the_scale(interpreted):
    case = _case()
    got = interpreted[case["name"]]
    _check(got)
    _assert_twins_bits(got, case)


@pytest.mark.requires_triton
@pytest.mark.slow
@pytest.mark.parametrize("index", [0, 1])
def test_triton_padding_is_zero_whatever_the_scale(interpreted, index):
    case = _padding_cases()[index]
    got = interpreted[case["name"]]
    q, q_t = got[0], got[6]
    rows, cols = case["args"][0].shape
    assert torch.isnan(got[3]).item() or torch.isinf(got[3]).item()  # the scale used
    assert not bits(q[:, cols:]).any() and not bits(q_t[:, rows:]).any()  # +0 codes or values
    _assert_twins_bits(got, case)
