"""The eager FP8 cast (mptex._fp8_scaling._to_fp8) on a torch whose own float32 ->
float8_e4m3fn conversion gives NaN past 464 (torch before 2.13, the GPU machines' builds), as
this machine's torch 2.13 saturates: the clamp that makes both builds give the same codes is
then the only thing between an out-of-range value and a NaN code."""

import math

import pytest
import torch
from fp8_reference import fp8_code

from mptex._fp8_scaling import _to_fp8

E4M3 = torch.float8_e4m3fn


@pytest.fixture
def nan_past_464(monkeypatch):
    """``Tensor.to`` as torch 2.11 casts float32 to float8_e4m3fn: NaN (sign kept) wherever
    ``|x| > 464`` (the tie between 448 and the NaN slot above it), infinities included."""
    original = torch.Tensor.to

    def to(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if out.dtype == E4M3 and self.dtype == torch.float32:
            codes = out.view(torch.uint8).clone()
            past = self.abs() > 464.0
            codes[past] = (0x7F | (self.signbit().to(torch.uint8) << 7))[past]
            out = codes.view(E4M3)
        return out

    monkeypatch.setattr(torch.Tensor, "to", to)


def test_the_emulated_old_cast_gives_nan_past_464(nan_past_464):
    x = torch.tensor([464.0, 465.0, -465.0, math.inf])
    assert x.to(E4M3).view(torch.uint8).tolist() == [0x7E, 0x7F, 0xFF, 0x7F]


def test_the_eager_cast_saturates_both_signs_under_a_cast_that_gives_nan(nan_past_464):
    values = [448.0, 465.0, 1e30, math.inf, -465.0, -1e30, -math.inf, -448.0, 0.5]
    want = [fp8_code(max(-448.0, min(448.0, v)), E4M3) for v in values]
    assert want[:4] == [0x7E] * 4 and want[4:8] == [0xFE] * 4  # by hand: +-448
    assert _to_fp8(torch.tensor(values), E4M3).view(torch.uint8).tolist() == want
    nan = _to_fp8(torch.tensor([math.nan, -math.nan]), E4M3).view(torch.uint8)
    assert nan.tolist() == [0x7F, 0xFF]  # a NaN stays NaN, its sign kept
