"""A brute-force, per-point grid encoding written from tcnn's kernels, independent of mptex.

Plain Python integers for indices (uint32 arithmetic spelled out with masks), numpy float32
scalars for the float math in tcnn's order of operations, and an exactly rounded fmaf built on
fractions. Slow on purpose: it is an oracle for a few hundred points.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

PRIMES = (1, 2654435761, 805459861, 3674653429, 2097192037, 1434869437, 2165219737)
U32 = 0xFFFFFFFF


def _round(value: Fraction, mantissa_bits: int, min_exponent: int) -> float:
    """Round an exact rational to the nearest binary float with ``mantissa_bits`` stored bits
    and smallest normal exponent ``min_exponent``, ties to even (no overflow handling)."""
    if value == 0:
        return 0.0
    sign = -1 if value < 0 else 1
    value = abs(value)
    exponent = value.numerator.bit_length() - value.denominator.bit_length()
    if Fraction(2) ** exponent > value:
        exponent -= 1
    exponent = max(exponent, min_exponent)  # subnormals share the smallest exponent
    ulp = Fraction(2) ** (exponent - mantissa_bits)
    scaled = value / ulp
    integer = math.floor(scaled)
    rest = scaled - integer
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and integer % 2 == 1):
        integer += 1
    return sign * float(integer * ulp)


def round_to_f32(value: Fraction) -> np.float32:
    """Round an exact rational to the nearest float32, ties to even."""
    return np.float32(_round(value, 23, -126))


def fmaf(a, b, c) -> np.float32:
    return round_to_f32(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)))


def hfma(a, b, c) -> np.float16:
    """fma.rn.f16: half a * b + c rounded once."""
    exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    return np.float16(_round(exact, 10, -14))


def exp2f(value: np.float32) -> np.float32:
    """Correctly rounded float32 2^value, from the float64 power (its error, under one float64
    ulp, could only matter within 2^-40 of a float32 midpoint, which is checked)."""
    power = 2.0 ** float(value)
    result = np.float32(power)
    below = np.nextafter(result, np.float32(-np.inf))
    above = np.nextafter(result, np.float32(np.inf))
    for midpoint in ((float(result) + float(below)) / 2, (float(result) + float(above)) / 2):
        assert abs(power - midpoint) > 2.0**-40 * power, "too close to a float32 midpoint"
    return result


def levels(n_dims, n_levels, log2_size, base_res, per_level_scale, dense_grid=False):
    """Per level: (kernel scale, kernel resolution, table size, offset, hashed)."""
    log2_scale = np.float32(math.log2(float(np.float32(per_level_scale))))
    out, offset = [], 0
    for level in range(n_levels):
        power = exp2f(np.float32(np.float32(level) * log2_scale))
        host_scale = np.float32(np.float32(power * np.float32(base_res)) - np.float32(1))
        host_res = math.ceil(float(host_scale)) + 1
        size = -(-(host_res**n_dims) // 8) * 8
        if not dense_grid:
            size = min(size, 2**log2_size)
        scale = fmaf(power, np.float32(base_res), np.float32(-1))
        res = math.ceil(float(scale)) + 1
        out.append((scale, res, size, offset, res**n_dims > size and not dense_grid))
        offset += size
    return out


def index(coords, res, size, hashed):
    if hashed:
        value = 0
        for dim, c in enumerate(coords):
            value ^= (c * PRIMES[dim]) & U32
    else:
        value, stride = 0, 1
        for c in coords:
            value = (value + c * stride) & U32
            stride *= res
    return value % size


def encode_point(x, params, n_features, geometry, interpolation="Linear", half=False):
    """One point -> list of L * F outputs (float32, or float16 values in half mode)."""
    table = np.asarray(params, dtype=np.float32)
    if half:
        table = table.astype(np.float16).astype(np.float32)
    dims = len(x)
    result = []
    for scale, res, size, offset, hashed in geometry:
        frac, cell = [], []
        for d in range(dims):
            pos = fmaf(scale, np.float32(x[d]), np.float32(0.5))
            floor = np.float32(math.floor(float(pos)))
            f = np.float32(pos - floor)
            if interpolation == "Smoothstep":
                f = np.float32(np.float32(f * f) * np.float32(np.float32(3) - np.float32(2) * f))
            frac.append(f)
            cell.append(int(floor) & U32)
        # tcnn: result = fma((T)weight, value, result) per corner from zero (fmaf, or in half
        # mode __hfma2 with the weight rounded to half); Nearest returns the value itself.
        acc = [np.float16(0) if half else np.float32(0) for _ in range(n_features)]
        corners = [0] if interpolation == "Nearest" else range(2**dims)
        for corner in corners:
            weight = np.float32(1)
            coords = []
            for d in range(dims):
                bit = (corner >> d) & 1
                if interpolation != "Nearest":
                    weight = np.float32(weight * (frac[d] if bit else np.float32(1) - frac[d]))
                coords.append((cell[d] + bit) & U32)
            row = offset + index(coords, res, size, hashed)
            for f in range(n_features):
                value = table[row * n_features + f]
                if interpolation == "Nearest":
                    acc[f] = np.float16(value) if half else value
                elif half:
                    acc[f] = hfma(np.float16(weight), np.float16(value), acc[f])
                else:
                    acc[f] = fmaf(weight, value, acc[f])
        result.extend(float(a) for a in acc)
    return result


def param_gradient(points, grad_out, n_params, n_features, geometry, interpolation="Linear"):
    """dL/dparams for L = sum(grad_out * encode(points)), accumulated in float64."""
    grad = np.zeros(n_params, dtype=np.float64)
    for x, g in zip(points, grad_out):
        dims = len(x)
        for level, (scale, res, size, offset, hashed) in enumerate(geometry):
            frac, cell = [], []
            for d in range(dims):
                pos = fmaf(scale, np.float32(x[d]), np.float32(0.5))
                floor = math.floor(float(pos))
                f = float(pos) - floor
                if interpolation == "Smoothstep":
                    f = f * f * (3 - 2 * f)
                frac.append(f)
                cell.append(floor & U32)
            corners = [0] if interpolation == "Nearest" else range(2**dims)
            for corner in corners:
                weight, coords = 1.0, []
                for d in range(dims):
                    bit = (corner >> d) & 1
                    if interpolation != "Nearest":
                        weight *= frac[d] if bit else 1 - frac[d]
                    coords.append((cell[d] + bit) & U32)
                row = offset + index(coords, res, size, hashed)
                for f in range(n_features):
                    grad[row * n_features + f] += weight * g[level * n_features + f]
    return grad
