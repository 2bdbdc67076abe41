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
    """float64 values of an int8 (per output channel, symmetric), FP8 (E4M3, per tensor) or
    ``fp8_rowwise`` (E4M3, per output channel) fake-quantised weight: each step one float32
    rounding, as mptex.quantize documents."""
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
    if kind == "fp8_rowwise":  # E4M3, one scale per output channel
        return torch.from_numpy(np.stack([_e4m3_fake(row) for row in w]))
    return torch.from_numpy(_e4m3_fake(w))


def _e4m3_fake(w: np.ndarray) -> np.ndarray:
    """float64 values of float32 ``w`` fake-quantised to E4M3 with one current scale for all of
    it (448 / amax in float32; 1 for an all-zero ``w``)."""
    out = np.zeros(w.shape, dtype=np.float64)
    codes, inverse = rowwise_codes(w.reshape(1, -1), E4M3)
    for index, code in np.ndenumerate(codes.reshape(w.shape)):
        out[index] = float(np.float32(np.float32(fp8_value(int(code), E4M3)) * inverse[0]))
    return out


def rowwise_codes(x: np.ndarray, dtype: torch.dtype) -> tuple[np.ndarray, np.ndarray]:
    """FP8 codes of float32 ``x`` ``[M, K]`` with one current scale per row, and the float32
    inverse scales ``[M]``, one element at a time: ``scale_i = fp8_max / amax_i`` (one float32
    division; 1 for a zero row), ``code = fp8(float32(x * scale_i))``."""
    fp8_max = np.float32(448.0 if dtype == E4M3 else 57344.0)
    codes = np.zeros(x.shape, dtype=np.int64)
    inverse = np.zeros(x.shape[0], dtype=np.float32)
    for i in range(x.shape[0]):
        amax = np.float32(0.0)
        for v in x[i]:
            amax = max(amax, np.float32(abs(v)))
        scale = np.float32(fp8_max / amax) if amax > 0 else np.float32(1.0)
        inverse[i] = np.float32(1.0) / scale
        for k in range(x.shape[1]):
            codes[i, k] = fp8_code(float(np.float32(x[i, k]) * scale), dtype)
    return codes, inverse


def rowwise_gemm_reference(codes_a, dtype_a, codes_b, dtype_b, scale_a, scale_b) -> np.ndarray:
    """float32 ``[M, N]``: per element the exact sum of the FP8 products (rationals), rounded
    once to float32, then multiplied in float32 by ``scale_a[i]`` and then by ``scale_b[j]``.

    Args:
        codes_a: ``[M, K]`` FP8 codes of ``a``; codes_b: ``[K, N]`` of ``b``.
        scale_a: ``[M]`` float32; scale_b: ``[N]`` float32.
    """
    m, k = codes_a.shape
    n = codes_b.shape[1]
    va = [[Fraction(fp8_value(int(c), dtype_a)) for c in row] for row in codes_a]
    vb = [[Fraction(fp8_value(int(codes_b[t, j]), dtype_b)) for t in range(k)] for j in range(n)]
    out = np.zeros((m, n), dtype=np.float32)
    for i in range(m):
        for j in range(n):
            exact = sum((x * y for x, y in zip(va[i], vb[j], strict=True)), Fraction(0))
            # float() of a Fraction rounds once to float64; it is exact here, so the float32
            # rounding that follows is the only one.
            assert Fraction(float(exact)) == exact, "sum not exact in float64"
            acc = np.float32(float(exact))
            out[i, j] = np.float32(
                np.float32(acc * np.float32(scale_a[i])) * np.float32(scale_b[j])
            )
    return out


def seen_input(h: torch.Tensor, policy) -> torch.Tensor:
    """float64 layer input the decoder of a QAT arm sees: for ``fp8_rowwise`` each row of the
    float32 ``h`` fake-quantised to E4M3 with its own scale (per-element reference); ``h``
    otherwise."""
    if policy.weight_quant != "fp8_rowwise":
        return h
    x = h.detach().float().numpy()
    return torch.from_numpy(np.stack([_e4m3_fake(row) for row in x]))


def seen_weight(layer, policy):
    """float64 weight the layer's forward uses: the stored one, or for a QAT arm its
    fake-quantised values from the per-element reference (tests/fp8_reference.py)."""
    if policy.weight_quant != "none":
        return fake_quantize_reference(layer.weight, policy.weight_quant)
    return layer.weight.double()
