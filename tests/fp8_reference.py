"""Per-element references for the quantisers below f16, written from the formats' definitions
with exact rationals and float64, independent of mptex and of torch's casts."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import torch

# (exponent bits, mantissa bits, bias) of the OCP formats torch implements: float8_e4m3fn (no
# infinity, 0x7F/0xFF NaN) and float8_e5m2 (IEEE-like).
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FORMATS = {E4M3: (4, 3, 7), E5M2: (5, 2, 15)}


def fp8_code(value: float, dtype: torch.dtype) -> int:
    """The float8 bit pattern of a finite float32 ``value`` within the format's range: round to
    nearest, ties to even, with subnormals. Written from the formats' definitions, with exact
    rationals."""
    ebits, mbits, bias = FORMATS[dtype]
    sign = 0x80 if math.copysign(1.0, value) < 0 else 0
    a = abs(Fraction(value))
    if a == 0:
        return sign
    emin = 1 - bias
    e = max(math.floor(math.log2(a)), emin)
    while Fraction(2) ** e > a and e > emin:  # log2 of a Fraction can be off by one
        e -= 1
    while Fraction(2) ** (e + 1) <= a:
        e += 1
    ulp = Fraction(2) ** (e - mbits)
    n = a / ulp
    m = math.floor(n)
    rest = n - m
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and m % 2 == 1):
        m += 1
    if m == 2 ** (mbits + 1):
        e, m = e + 1, 2**mbits
    if m < 2**mbits:  # subnormal (only possible at e == emin)
        assert e == emin
        return sign | m
    code = sign | ((e + bias) << mbits) | (m - 2**mbits)
    assert code & 0x7F <= (0x7E if dtype == E4M3 else 0x7B), "beyond the format's largest"
    return code


def fp8_value(code: int, dtype: torch.dtype) -> float:
    """The value of a float8 bit pattern (finite codes only)."""
    ebits, mbits, bias = FORMATS[dtype]
    sign = -1.0 if code & 0x80 else 1.0
    exponent, mantissa = (code >> mbits) & ((1 << ebits) - 1), code & ((1 << mbits) - 1)
    if exponent == 0:
        return sign * mantissa * 2.0 ** (1 - bias - mbits)
    return sign * (1 + mantissa / 2**mbits) * 2.0 ** (exponent - bias)


def fake_quantize_reference(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """float64 values of an int8 (per output channel, symmetric) or FP8 (E4M3, per tensor)
    fake-quantised weight: each step one float32 rounding, as mptex.quantize documents."""
    w = weight.detach().numpy().astype(np.float32)
    out = np.zeros(w.shape, dtype=np.float64)
    if kind == "int8":
        for c, row in enumerate(w):
            amax = np.float32(np.abs(row).max())
            scale = np.float32(amax / np.float32(127)) if amax > 0 else np.float32(1)
            for j, v in enumerate(row):
                ratio = np.float32(v / scale)
                q = max(-127.0, min(127.0, float(np.round(np.float64(ratio)))))
                out[c, j] = float(np.float32(np.float32(q) * scale))
        return torch.from_numpy(out)
    amax = np.float32(np.abs(w).max())
    scale = np.float32(np.float32(448.0) / amax)
    inverse = np.float32(np.float32(1.0) / scale)
    for index, v in np.ndenumerate(w):
        code = fp8_code(float(np.float32(v * scale)), torch.float8_e4m3fn)
        out[index] = float(np.float32(np.float32(fp8_value(code, torch.float8_e4m3fn)) * inverse))
    return torch.from_numpy(out)


def seen_weight(layer, policy):
    """float64 weight the layer's forward uses: the stored one, or for a QAT arm its
    fake-quantised values from the per-element reference (tests/fp8_reference.py)."""
    if policy.weight_quant != "none":
        return fake_quantize_reference(layer.weight, policy.weight_quant)
    return layer.weight.double()
