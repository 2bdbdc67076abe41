"""Brute-force, per-element reference of the fused-MLP arithmetic model (no torch).

Written independently of ``mptex/_fused_mlp_torch.py`` from the model stated in its docstring:
scalar Python floats, one accumulator per output element, NumPy float16/float32 for every
rounding. Slow on purpose; tests keep the sizes small.

Model: a dot product of half values is accumulated block by block (``k_block`` consecutive
terms). Half accumulators (``"half"``): the block's products and the accumulator are each
truncated toward zero to a multiple of 2^(E - 25), E the largest exponent among them (a
product's exponent: the sum of its factors' floor(log2 |v|), at least -14), summed as integers
and rounded once to float16. Float accumulators (``"float"``): the block's exact sum
(``math.fsum``) is added and rounded to float32; the result is rounded to half at the end.
"""

from __future__ import annotations

import math

import numpy as np


def to_half(value: float) -> float:
    return float(np.float16(np.float32(value)))


def to_acc(value: float, accumulate: str) -> float:
    # NumPy rounds float64 to float16 once (not through float32)
    return float(np.float16(value)) if accumulate == "half" else float(np.float32(value))


def exponent(v: float) -> int | None:
    """floor(log2 |v|) of a half value, at least -14; None for zero."""
    return None if v == 0 else max(math.frexp(v)[1] - 1, -14)


def tensor_core_step(acc: float, a: list[float], b: list[float]) -> float:
    """A half accumulator plus sum a[k] b[k]: every term (and ``acc``) truncated toward zero
    to a multiple of 2^(E - 25), E the largest of the products' exponent sums and acc's
    exponent, the integers summed, the result rounded once to half."""
    terms = [(x * y, exponent(x) + exponent(y)) for x, y in zip(a, b) if x * y != 0]
    if acc != 0:
        terms.append((acc, exponent(acc)))
    if not terms:
        return 0.0
    top = max(e for _, e in terms)
    units = sum(math.trunc(t * 2.0 ** (25 - top)) for t, _ in terms)
    return float(np.float16(units * 2.0 ** (top - 25)))


def dot(a: list[float], b: list[float], k_block: int, accumulate: str) -> float:
    """Half result of sum_k a[k] b[k] under the model."""
    acc = 0.0
    for start in range(0, len(a), k_block):
        end = min(start + k_block, len(a))
        if accumulate == "half":
            acc = tensor_core_step(acc, a[start:end], b[start:end])
        else:
            acc = to_acc(acc + math.fsum(a[k] * b[k] for k in range(start, end)), accumulate)
    return to_half(acc)


def f32(value: float) -> float:
    return float(np.float32(value))


def activation(name: str, v: float) -> float:
    """tcnn's activation of one half value ``v`` as the twin's model states it: float32 math,
    each elementary function correctly rounded to float32 (``math``'s float64 value rounded
    once), the result rounded to half."""
    k = 10.0  # common_device.h K_ACT
    if name == "None":
        return v
    if name == "ReLU":
        return relu(v)
    if name == "LeakyReLU":
        return to_half(f32(v * (1.0 if v > 0 else to_half(0.01))))
    if name == "Exponential":
        return to_half(f32(math.exp(v)))
    if name == "Sigmoid":
        return to_half(f32(1.0 / f32(1.0 + f32(math.exp(-v)))))
    if name == "Squareplus":
        z = f32(v * k)
        root = f32(math.sqrt(f32(f32(z * z) + 4.0)))
        return to_half(f32(f32(0.5 * f32(z + root)) / k))
    if name == "Softplus":
        inner = f32(f32(math.exp(f32(v * k))) + 1.0)
        return to_half(f32(f32(math.log(inner)) / k))
    if name == "Tanh":
        return to_half(f32(math.tanh(v)))
    raise ValueError(name)


def activation_backward_factor(name: str, out: float) -> float:
    """The factor of warp_activation_backward from the post-activation half ``out``, as a half
    value: float32 math where tcnn converts to float (each elementary function correctly
    rounded), half products where it multiplies two halves; the gradient is then
    ``to_half(grad * factor)``."""
    k = 10.0
    if name == "None":
        return 1.0
    if name == "ReLU":
        return 1.0 if out > 0 else 0.0
    if name == "LeakyReLU":
        return 1.0 if out > 0 else to_half(0.01)
    if name == "Exponential":
        return out
    if name == "Sigmoid":  # out * (half)(1.0f - out): a product of two halves
        return to_half(out * to_half(1.0 - out))
    if name == "Squareplus":
        y = f32(out * k)
        return to_half(f32(f32(y * y) / f32(f32(y * y) + 1.0)))
    if name == "Softplus":
        return to_half(f32(1.0 - f32(math.exp(f32(-out * k)))))
    if name == "Tanh":
        return to_half(f32(1.0 - f32(out * out)))
    raise ValueError(name)


def relu(v: float) -> float:
    return v if v > 0 else 0.0


def next_multiple(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def matrices(params: list[float], shapes: list[tuple[int, int]]) -> list[list[list[float]]]:
    """Row-major [out][in] matrices from the flat vector, in order."""
    out, pos = [], 0
    for rows, cols in shapes:
        out.append([[params[pos + r * cols + c] for c in range(cols)] for r in range(rows)])
        pos += rows * cols
    return out


def network(x, params, n_out, width, n_hidden, loss_scale=128.0, grad_out=None,
            accumulate="half", split_k=True, activation_name="ReLU",
            output_activation="None"):  # fmt: skip
    """Forward (and with ``grad_out``, backward) of a FullyFusedMLP (default: ReLU, output
    activation None).

    Args:
        x: N rows of n_in floats (f32 values).
        params: flat float list (f32 masters).
        grad_out: N rows of n_out floats: dL/doutput as torch hands it in (half values).

    Returns:
        (output rows [N][n_out] floats, grad_x [N][n_in] or None, grad_params list or None).
    """
    n, n_in = len(x), len(x[0])
    in_pad, out_pad = next_multiple(n_in, 16), next_multiple(n_out, 16)
    batch = next_multiple(n, 256)
    shapes = [(width, in_pad)] + [(width, width)] * (n_hidden - 1) + [(out_pad, width)]
    weights = [[[to_half(v) for v in row] for row in m] for m in matrices(params, shapes)]
    # identity encoding: half input, ones in the padded columns; zero rows pad the batch
    rows = [[to_half(v) for v in r] + [1.0] * (in_pad - n_in) for r in x]
    rows += [[0.0] * n_in + [1.0] * (in_pad - n_in) for _ in range(batch - n)]
    acts = [rows]
    for index, w in enumerate(weights):
        last = index == len(weights) - 1
        kb = 8 if last and out_pad > 16 else 16
        layer = []
        name = output_activation if last else activation_name
        for r in acts[-1]:
            layer.append([activation(name, dot(r, w[o], kb, accumulate)) for o in range(len(w))])
        acts.append(layer)
    output = [row[:n_out] for row in acts[-1][:n]]
    if grad_out is None:
        return output, None, None

    # backward: dL/doutput (half) x loss scale in half, zero for cut outputs and padded rows
    grad = [[0.0] * out_pad for _ in range(batch)]
    for i in range(n):
        for o in range(n_out):
            grad[i][o] = to_half(to_half(grad_out[i][o]) * loss_scale)
    grad = [
        [to_half(g * activation_backward_factor(output_activation, v)) for g, v in zip(gs, vs)]
        for gs, vs in zip(grad, acts[-1])
    ]
    grads_w = [None] * len(weights)
    for index in range(len(weights) - 1, -1, -1):
        w, below = weights[index], acts[index]
        n_rows, n_cols = len(w), len(w[0])
        grads_w[index] = [
            [weight_grad([g[o] for g in grad], [a[c] for a in below], accumulate, split_k)
             for c in range(n_cols)]
            for o in range(n_rows)
        ]  # fmt: skip
        if index == 0:
            break
        kb = 8 if index == len(weights) - 1 and out_pad > 16 else 16
        new = []
        for b in range(batch):
            new.append([
                to_half(dot(grad[b], [w[o][c] for o in range(n_rows)], kb, accumulate)
                    * activation_backward_factor(activation_name, below[b][c]))
                for c in range(n_cols)
            ])  # fmt: skip
        grad = new
    kb = 16 if in_pad == width else 8
    w0 = weights[0]
    grad_x = [
        [float(np.float32(dot(grad[b], [w0[o][c] for o in range(width)], kb, accumulate))
               / np.float32(loss_scale)) for c in range(n_in)]
        for b in range(n)
    ]  # fmt: skip
    grad_params = []
    for m in grads_w:
        for row in m:
            grad_params += [to_half(float(np.float32(v) / np.float32(loss_scale))) for v in row]
    return output, grad_x, grad_params


def weight_grad(g: list[float], a: list[float], accumulate: str, split_k: bool) -> float:
    """One weight-gradient entry sum_b g[b] a[b]: CUTLASS split-K slices, blocks of 8."""
    batch = len(g)
    slices = batch // min(4096, batch) if split_k else 1
    size = (batch // 32 // slices) * 32
    partials = []
    for s in range(slices):
        lo, hi = s * size, (batch if s == slices - 1 else (s + 1) * size)
        partials.append(slice_dot(g[lo:hi], a[lo:hi], accumulate))
    total = partials[0]
    for p in partials[1:]:
        total = to_acc(total + p, accumulate)
    return to_half(total)


def slice_dot(g: list[float], a: list[float], accumulate: str) -> float:
    """Accumulator value (not rounded to half at the end) of one slice, blocks of 8."""
    acc = 0.0
    for start in range(0, len(g), 8):
        end = min(start + 8, len(g))
        if accumulate == "half":
            acc = tensor_core_step(acc, g[start:end], a[start:end])
        else:
            acc = to_acc(acc + math.fsum(g[k] * a[k] for k in range(start, end)), accumulate)
    return acc


def pcg32_next_floats(seed: int, count: int) -> list[float]:
    """tcnn's pcg32 (dependencies/pcg32/pcg32.h) next_float, written out per step."""
    mult, mask = 6364136223846793005, 2**64 - 1
    inc = 3  # (initseq = 1) << 1 | 1
    state = 0
    state = (state * mult + inc) & mask
    state = (state + seed) & mask
    state = (state * mult + inc) & mask
    out = []
    for _ in range(count):
        old = state
        state = (old * mult + inc) & mask
        xorshifted = ((old >> 18) ^ old) >> 27 & 0xFFFFFFFF
        rot = old >> 59
        word = ((xorshifted >> rot) | (xorshifted << ((32 - rot) % 32))) & 0xFFFFFFFF
        mantissa = word >> 9
        out.append(mantissa / 2.0**23)  # (1 + m / 2^23) - 1, exact in f32
    return out


HALF_UNIT_ROUNDOFF = 2.0**-11


def forward_error_bound(weights: list[np.ndarray], x: np.ndarray) -> np.ndarray:
    """Bound on |fused(x) - exact(x)| of a bias-free ReLU network run under the model, [N, out].

    Standard forward error analysis (Higham, "Accuracy and Stability of Numerical Algorithms",
    3.5): every rounding of a half value or of an accumulator holding a partial sum of a row is
    a relative error of at most u = 2^-11, bounded by the row's sum of |w| |h|; ReLU is
    1-Lipschitz, so errors pass on through |W|. With n roundings on the longest path (the input
    cast, then per layer the weight cast and one accumulator rounding per k-block of the padded
    width, counted with the smaller block of 8), |error| <= gamma_n |W_L| ... |W_1| |x| with
    gamma_n = n u / (1 - n u).

    Args:
        weights: the unpadded [out, in] matrices, input layer first (zero padding adds nothing).
        x: [N, in] inputs.
    """
    n = 1 + sum(1 + next_multiple(w.shape[1], 16) // 8 for w in weights)
    chain = np.abs(np.asarray(x, dtype=np.float64))
    for w in weights:
        chain = chain @ np.abs(np.asarray(w, dtype=np.float64)).T
    gamma = n * HALF_UNIT_ROUNDOFF / (1 - n * HALF_UNIT_ROUNDOFF)
    return gamma * chain
