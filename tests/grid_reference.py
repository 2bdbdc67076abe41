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


def param_gradient(
    points, grad_out, n_params, n_features, geometry, interpolation="Linear", magnitude=False
):
    """dL/dparams for L = sum(grad_out * encode(points)), accumulated in float64. With
    ``magnitude``, per entry the sum of ``|grad_out|`` over the terms it receives, each weight
    taken as its bound 1 (the scale of the rounding errors of a float32 computation)."""
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
                    term = g[level * n_features + f]
                    grad[row * n_features + f] += abs(term) if magnitude else weight * term
    return grad


def input_gradient(
    points, grad_out, params, n_features, geometry, interpolation="Linear", magnitude=False
):
    """dL/dx [N][D] for L = sum(grad_out * encode(points)) in float64: per level and corner,
    the corner's value times the derivative of its weight along each axis (the other axes'
    weights, signed by the corner's bit), times the interpolation's derivative and the level's
    scale; positions and cells as tcnn's kernel computes them (float32 fmaf). Nearest is
    piecewise constant: zero. With ``magnitude``, a bound on the sum of the terms' magnitudes
    instead, each weight factor taken as its bound 1 and the slope as its bound 1.5 (the scale
    of the rounding errors of a float32 computation)."""
    table = np.asarray(params, dtype=np.float64)
    size_of = abs if magnitude else (lambda v: v)
    out = np.zeros((len(points), len(points[0])), dtype=np.float64)
    for i, (x, g) in enumerate(zip(points, grad_out)):
        dims = len(x)
        if interpolation == "Nearest":
            continue
        for level, (scale, res, size, offset, hashed) in enumerate(geometry):
            weight, slope, cell = [], [], []
            for d in range(dims):
                pos = fmaf(scale, np.float32(x[d]), np.float32(0.5))
                floor = math.floor(float(pos))
                f = float(pos) - floor
                if interpolation == "Smoothstep":
                    weight.append(f * f * (3 - 2 * f))
                    slope.append(6 * f * (1 - f))
                else:
                    weight.append(f)
                    slope.append(1.0)
                cell.append(floor & U32)
            for corner in range(2**dims):
                bits = [(corner >> d) & 1 for d in range(dims)]
                coords = [(cell[d] + bits[d]) & U32 for d in range(dims)]
                row = offset + index(coords, res, size, hashed)
                value = sum(
                    size_of(table[row * n_features + f] * g[level * n_features + f])
                    for f in range(n_features)
                )
                for d in range(dims):
                    d_weight = 1.0 if bits[d] else -1.0
                    for e in range(dims):
                        if e != d:
                            d_weight *= weight[e] if bits[e] else 1 - weight[e]
                    if magnitude:
                        out[i, d] += value * 1.5 * float(scale)
                    else:
                        out[i, d] += value * d_weight * slope[d] * float(scale)
    return out
