"""Pure-PyTorch twin of tiny-cuda-nn's FullyFusedMLP (forward, backward, initialisation).

The twin reproduces what ``tinycudann.Network({"otype": "FullyFusedMLP", ...})`` computes, under
an explicit model of the half-precision tensor-core arithmetic (tensor cores do not document the
order and rounding inside one MMA, so a model has to be chosen; how far it is from a real GPU is
measured there, not assumed).

Arithmetic model (``accumulate="half"``, tcnn's):
    A matrix product ``C[n, m] = sum_k A[n, k] B[k, m]`` of half operands is computed in k-blocks
    of ``k_block`` consecutive k (16 for the fused kernel's ``wmma 16x16x16``, i.e. one
    ``mma.m16n8k16`` per output element and block; 8 for the CUTLASS GEMMs, whose instruction
    shape tcnn sets to ``GemmShape<16, 8, 8>``), blocks in increasing k, from a zero
    accumulator. One step (:func:`_tensor_core_step`) adds a block to the half accumulator
    ``c`` as the tensor core does: each product ``a_k b_k`` is exact, with the exponent
    ``e(a_k) + e(b_k)`` (``e(v) = floor(log2 |v|)``, at least -14: half's subnormals share the
    smallest normal exponent); ``E`` is the largest exponent among the non-zero products and
    ``e(c)``; every product and ``c`` is truncated toward zero to a multiple of ``2^(E - 25)``;
    the truncated terms are summed exactly and the sum is rounded once to half (to nearest
    even). The split-K slices' half results are added in order, each sum rounded once to half
    (CUTLASS ``ReduceSplitK`` with half ``ReduceAdd``).
    ``accumulate="float"`` keeps the accumulator in float32 instead (same blocks, each block's
    exact sum added and rounded to float32; not measured on a GPU) and rounds the finished sum
    to half once: the switch that removes half accumulation.

    Measured against tinycudann 2.0 on an H100 (``tests/gpu_golden/``,
    ``tests/test_gpu_golden_network.py``): outputs, input gradients and parameter gradients of
    the 32x2, 64x3 and 128x5 ReLU networks of the GPU kit are bit-equal, 8209 points each.
    Two simpler models that were measured first: the exact block sum rounded to float32, then to
    half, matched 96.1 % of the 128x5 outputs and 46 % of its weight gradients (p99 156 half
    ulps); the exact block sum rounded once to half, 99.1 % and 92.9 % (p99 4).

What the twin does, in tcnn's order (``Network`` = ``NetworkWithInputEncoding`` with an
``Identity`` encoding, see ``src/cpp_api.cu`` ``create_network``):
    forward
        1. ``x`` (f32) padded with zero rows to a multiple of 256 samples (the bindings'
           ``BATCH_SIZE_GRANULARITY``), cast to half, and padded with columns of **1.0** up to a
           multiple of 16 (the Identity encoding writes 1 into its padded outputs, so the padded
           columns of the first weight matrix act as a bias);
        2. per layer ``h = act(half_matmul(h, W^T, k_block=16))`` in half; the last layer uses
           ``output_activation`` and has ``next_multiple(n_output_dims, 16)`` rows (k_block 8 if
           wider than 16 outputs: CUTLASS computes that layer);
        3. the bindings return ``[:N, :n_output_dims]`` of the half output.
    backward (torch hands in ``dL/doutput`` in half, the output's dtype)
        1. ``dL/doutput x loss_scale`` in half (``modules.py`` ``_module_function_backward``);
        2. output activation backward (in half), then back through the layers:
           ``g = act_backward(half_matmul(g, W, k_block=16), forward activation below)``;
        3. each weight gradient ``g^T h_below`` by split-K: the padded batch is cut into
           ``split_k = batch // min(4096, batch)`` slices (CUTLASS ``GemmSplitKParallel``:
           ``gemm_k_size = (batch // 32 // split_k) * 32``, the last slice takes the rest), each
           slice accumulates in half with k_block 8, the slices are summed in half in order;
        4. the input gradient ``g W_0`` (k_block 16 when the padded input width equals the network
           width, the fused kernel; else 8, CUTLASS), rounded to half, then divided by
           ``loss_scale`` in float32; the parameter gradient is divided by ``loss_scale`` **in
           half** (it can underflow there) and reaches the f32 master as f32.

Speed on a CPU: the two loops of the model, :func:`half_matmul` and
:func:`split_k_weight_grads`, run in a small C kernel (:mod:`mptex._native_cpu`, built with the
system C compiler on first use) with the same bits as their eager PyTorch spelling, which runs
on other devices, without a compiler, or with ``MPTEX_NATIVE=0`` (both held to the same golden
tensors, ``tests/test_fused_mlp_torch.py``). The half accumulation is sequential along the
batch, ~530 rounding steps per weight gradient, and eager PyTorch pays its dispatch cost per op
and step.

Parameter layout (``src/fully_fused_mlp.cu`` constructor and ``set_params_impl``): one flat
vector, the matrices one after the other, each row-major ``[out, in]``: first layer
``[width, in_pad]``, ``n_hidden_layers - 1`` hidden ``[width, width]``, last ``[out_pad, width]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from mptex._native_cpu import half_matmul_native, native_kernels, weight_grads_native
from mptex._profiler_scope import profiler_scope

__all__ = [
    "FusedMLPSpec",
    "ACCUMULATE_MODES",
    "ACTIVATIONS",
    "BATCH_GRANULARITY",
    "SPLIT_K_SLICE",
    "half_matmul",
    "split_k_weight_grad",
    "split_k_weight_grads",
    "fused_mlp",
    "xavier_uniform_params",
    "pcg32_floats",
]

# tcnn's include/tiny-cuda-nn/common.h: BATCH_SIZE_GRANULARITY = 256.
BATCH_GRANULARITY = 256
# src/fully_fused_mlp.cu backward_impl: split_k_factor = batch_size / std::min(1u << 12u, batch).
SPLIT_K_SLICE = 4096
# CUTLASS threadblock K of tcnn's FullLayerK config (GemmShape<64, 64, 32>): slice granularity.
_CUTLASS_TB_K = 32
# The activations FullyFusedMLP's forward_impl switch accepts (src/fully_fused_mlp.cu).
ACTIVATIONS = (
    "None",
    "ReLU",
    "LeakyReLU",
    "Exponential",
    "Sigmoid",
    "Squareplus",
    "Softplus",
    "Tanh",
)
_K_ACT = 10.0  # common_device.h K_ACT (Squareplus, Softplus)


def _next_multiple(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


# The accumulator of the twin's matrix products: tcnn's half, or float32 (the ablation switch).
ACCUMULATE_MODES = ("half", "float")


@dataclass
class FusedMLPSpec:
    """Sizes and switches of one fused network (everything the autograd function needs).

    Attributes:
        n_input_dims, n_output_dims, width, n_hidden_layers, activation, output_activation: as
            tcnn's network config.
        loss_scale: the bindings' static scale (tcnn: 128 for half).
        accumulate: ``"half"`` (tcnn) or ``"float"`` (float32 accumulators, the ablation switch).
        split_k: slice the weight-gradient reduction every 4096 samples (tcnn) or not.
        collect_stats: fill ``stats`` during backward (see :func:`split_k_weight_grad`).
        stats: per-layer precision statistics of the last backward (layer 0 = input layer), 0-d
            tensors on the device.
    """

    n_input_dims: int
    n_output_dims: int
    width: int
    n_hidden_layers: int
    activation: str = "ReLU"
    output_activation: str = "None"
    loss_scale: float = 128.0
    accumulate: str = "half"
    split_k: bool = True
    collect_stats: bool = False
    stats: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Every path tests accumulate == "half" and runs float otherwise: a typo must not
        # silently select the float32 accumulators.
        if self.accumulate not in ACCUMULATE_MODES:
            raise ValueError(
                f"accumulate: expected one of {ACCUMULATE_MODES}, got {self.accumulate!r}"
            )

    @property
    def input_pad(self) -> int:
        return _next_multiple(self.n_input_dims, 16)

    @property
    def output_pad(self) -> int:
        return _next_multiple(self.n_output_dims, 16)

    def shapes(self) -> list[tuple[int, int]]:
        """``[out, in]`` of each weight matrix, input layer first, padding included."""
        return (
            [(self.width, self.input_pad)]
            + [(self.width, self.width)] * (self.n_hidden_layers - 1)
            + [(self.output_pad, self.width)]
        )

    @property
    def n_params(self) -> int:
        return sum(o * i for o, i in self.shapes())


# ----------------------------------------------------------------------------- arithmetic
def _native(tensor: torch.Tensor):
    """The C kernel (mptex._native_cpu) for CPU tensors where it builds, else None."""
    return native_kernels() if tensor.device.type == "cpu" else None


def _half_once(value: torch.Tensor) -> torch.Tensor:
    """float64 -> half with one rounding to nearest even (not float64 -> float32 -> half).

    The float64 value is first rounded to float32 *to odd* (toward zero, the last bit set where
    that was inexact); float32 keeps 13 bits more than half, so the rounding to half that
    follows gives the nearest half of the float64 value itself (Boldo and Melquiond, "When
    double rounding is odd", 2005). PyTorch's float64 -> half conversion goes through float32
    with two roundings to nearest, which differs where the first creates a tie.
    """
    single = value.to(torch.float32)
    away = single.to(torch.float64).abs() > value.abs()
    single = torch.where(away, torch.nextafter(single, torch.zeros_like(single)), single)
    inexact = (single.to(torch.float64) != value).to(torch.int32)
    return (single.view(torch.int32) | inexact).view(torch.float32).to(torch.float16)


def _round_acc(value: torch.Tensor, accumulate: str) -> torch.Tensor:
    """float64 -> the accumulator: half (one rounding) or float32."""
    return _half_once(value) if accumulate == "half" else value.to(torch.float32)


# The tensor core's alignment: terms truncated to multiples of 2^(E - 25), E the largest exponent.
TC_ALIGN_BITS = 25
_NO_TERM = -100000  # exponent of a zero term (below any other)


def _half_exponent(values: torch.Tensor) -> torch.Tensor:
    """``floor(log2 |v|)`` of half values held in float64, at least -14 (half's subnormals share
    the smallest normal exponent); ``_NO_TERM`` for zeros. int64, same shape."""
    field = (values.view(torch.int64) >> 52) & 0x7FF
    return torch.where(values != 0, torch.clamp_min(field - 1023, -14), _NO_TERM)


def _power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """``2.0 ** exponent`` (int64, |exponent| < 1000) as float64, exactly (from the bits)."""
    return ((exponent + 1023) << 52).view(torch.float64)


def _tensor_core_step(
    acc: torch.Tensor, products: torch.Tensor, exponents: torch.Tensor, dim: int
) -> torch.Tensor:
    """One step of a half accumulator (the module docstring's tensor-core model).

    Args:
        acc: ``[...]`` float64 holding half values.
        products: float64 exact products, the block's terms along ``dim`` (else ``acc``'s shape).
        exponents: int64 like ``products``: the sums of the factors' :func:`_half_exponent`.
        dim: the block's dimension of ``products``.

    Returns:
        the new accumulator, float64 holding half values.
    """
    exponents = torch.where(products != 0, exponents, _NO_TERM)
    top = torch.maximum(exponents.amax(dim), _half_exponent(acc))
    top = torch.where(top == _NO_TERM, 0, top)  # every term zero: any scale gives +0.0
    scale = _power_of_two(TC_ALIGN_BITS - top)
    terms = torch.trunc(products * scale.unsqueeze(dim)).sum(dim) + torch.trunc(acc * scale)
    # integers below 2^32: exact in any order; + 0.0 makes a zero sum +0.0 (as the C kernel)
    return _half_once((terms + 0.0) * _power_of_two(top - TC_ALIGN_BITS)).double()


def half_matmul(
    a: torch.Tensor, b: torch.Tensor, k_block: int, accumulate: str = "half"
) -> torch.Tensor:
    """``a @ b`` of half operands under the module docstring's MMA model.

    Args:
        a: ``[N, K]`` float16.
        b: ``[K, M]`` float16.
        k_block: products summed exactly per block of this many k before each accumulator
            rounding (16: fused wmma; 8: CUTLASS m16n8k8).
        accumulate: ``"half"`` or ``"float"`` accumulator.

    Returns:
        ``[N, M]`` float16 (the float accumulator is rounded to half once at the end).
    """
    lib = _native(a)
    if lib is None:
        return _half_matmul_eager(a, b, k_block, accumulate)
    return half_matmul_native(lib, a, b, k_block, accumulate == "half")


def _half_matmul_eager(
    a: torch.Tensor, b: torch.Tensor, k_block: int, accumulate: str = "half"
) -> torch.Tensor:
    """:func:`half_matmul` in eager PyTorch ops (any device)."""
    if accumulate == "half":
        return _half_matmul_tensor_core(a, b, k_block)
    n, k = a.shape
    m = b.shape[1]
    n_blocks = max(1, math.ceil(k / k_block))
    pad = n_blocks * k_block - k
    a64 = a.to(torch.float64)
    b64 = b.to(torch.float64)
    if pad:  # zero products leave every accumulator unchanged
        a64 = torch.nn.functional.pad(a64, (0, pad))
        b64 = torch.nn.functional.pad(b64, (0, 0, 0, pad))
    acc32 = torch.empty(n, m, dtype=torch.float32, device=a.device)
    acc64 = None
    for j in range(n_blocks):
        part = a64[:, j * k_block : (j + 1) * k_block] @ b64[j * k_block : (j + 1) * k_block]
        if acc64 is not None:
            part += acc64
        if accumulate == "half":
            acc = _half_once(part)
        else:
            acc = acc32.copy_(part)  # the one rounding of the float64 sum to float32
        if j + 1 < n_blocks:
            acc64 = acc.to(torch.float64)
    return acc.to(torch.float16)


# Rows of ``a`` whose [rows, k_block, M] products are formed at once (bounds the scratch).
_ROWS_CHUNK = 1024


def _half_matmul_tensor_core(a: torch.Tensor, b: torch.Tensor, k_block: int) -> torch.Tensor:
    """:func:`half_matmul` with a half accumulator in eager ops: :func:`_tensor_core_step` per
    k-block, blocks in increasing k."""
    n, k = a.shape
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    exp_a, exp_b = _half_exponent(a64), _half_exponent(b64)
    out = torch.empty(n, b.shape[1], dtype=torch.float16, device=a.device)
    for r0 in range(0, n, _ROWS_CHUNK):
        rows = slice(r0, min(n, r0 + _ROWS_CHUNK))
        acc = torch.zeros(rows.stop - r0, b.shape[1], dtype=torch.float64, device=a.device)
        for k0 in range(0, k, k_block):
            block = slice(k0, min(k, k0 + k_block))
            products = a64[rows, block].unsqueeze(2) * b64[block].unsqueeze(0)
            exponents = exp_a[rows, block].unsqueeze(2) + exp_b[block].unsqueeze(0)
            acc = _tensor_core_step(acc, products, exponents, 1)
        out[rows] = acc.to(torch.float16)
    return out


def _slice_bounds(batch: int, split_k: bool) -> list[tuple[int, int]]:
    """CUTLASS GemmSplitKParallel's K ranges for tcnn's split_k_factor."""
    slices = batch // min(SPLIT_K_SLICE, batch) if split_k and batch > 0 else 1
    if slices <= 1:
        return [(0, batch)]
    size = (batch // _CUTLASS_TB_K // slices) * _CUTLASS_TB_K
    bounds = [(s * size, (s + 1) * size) for s in range(slices)]
    bounds[-1] = (bounds[-1][0], batch)
    return bounds


def split_k_weight_grad(
    grad_out: torch.Tensor,
    act_in: torch.Tensor,
    accumulate: str = "half",
    split_k: bool = True,
    stats: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Weight gradient ``grad_out^T @ act_in`` as tcnn's split-K CUTLASS GEMM computes it.

    Each slice (:func:`_slice_bounds`) accumulates its samples in blocks of 8 (k_block of
    CUTLASS's m16n8k8) under the module docstring's model; the slices' results are then added in
    order in the accumulator type (CUTLASS ``ReduceSplitK``). A shorter slice is padded with
    zero samples, which leave an accumulator unchanged.

    Args:
        grad_out: ``[B, out]`` float16, dL/d(pre-activation) (scaled by the loss scale).
        act_in: ``[B, in]`` float16, the layer's input activations.
        accumulate: ``"half"`` or ``"float"``.
        split_k: slice the batch as tcnn does or use one slice (the ablation switch).
        stats: if a dict, receives ``absorbed_frac``: the fraction of non-zero 8-sample block
            contributions that left the accumulator unchanged (flushed by the accumulation), a
            0-d tensor on the device (counted there: no host read).

    Returns:
        ``[out, in]`` float16 (float accumulation is rounded to half at the end, where tcnn
        would store it).
    """
    layer_stats = None if stats is None else [stats]
    return split_k_weight_grads([(grad_out, act_in)], accumulate, split_k, layer_stats)[0]


# Blocks whose exact sums are formed at once (bounds the float64 scratch).
_PARTS_CHUNK = 64


def split_k_weight_grads(
    layers: list[tuple[torch.Tensor, torch.Tensor]],
    accumulate: str = "half",
    split_k: bool = True,
    stats: list[dict[str, torch.Tensor]] | None = None,
) -> list[torch.Tensor]:
    """:func:`split_k_weight_grad` of several layers that share one batch.

    On a CPU the C kernel of :mod:`mptex._native_cpu` runs the accumulation loops; elsewhere (or
    without a C compiler) eager PyTorch ops do, with the same bits.

    Args:
        layers: ``(grad_out [B, out_l], act_in [B, in_l])`` float16 pairs, one per layer.
        accumulate, split_k: as :func:`split_k_weight_grad`.
        stats: if a list, one dict per layer receives ``absorbed_frac``.

    Returns:
        the ``[out_l, in_l]`` float16 weight gradients, in the order of ``layers``.
    """
    k_block = 8
    bounds = _slice_bounds(layers[0][0].shape[0], split_k)
    lib = _native(layers[0][0])
    if lib is None:
        return _split_k_weight_grads_eager(layers, accumulate, split_k, stats)
    counts = [[0, 0] for _ in layers] if stats is not None else None
    slices = weight_grads_native(lib, layers, bounds, k_block, accumulate == "half", counts)
    out = []
    for index, acc in enumerate(slices):
        total = acc[0]
        for s in range(1, len(bounds)):
            total = _round_acc(total + acc[s], accumulate).to(torch.float64)
        if stats is not None:
            seen, done = counts[index]
            stats[index]["absorbed_frac"] = _fraction(done, seen, total.device)
        out.append(total.to(torch.float16))
    return out


def _split_k_weight_grads_eager(
    layers: list[tuple[torch.Tensor, torch.Tensor]],
    accumulate: str = "half",
    split_k: bool = True,
    stats: list[dict[str, torch.Tensor]] | None = None,
) -> list[torch.Tensor]:
    """:func:`split_k_weight_grads` in eager PyTorch ops (any device).

    Half accumulators: :func:`_split_k_weight_grads_tensor_core`. Float accumulators: the
    accumulation is sequential along the batch (one rounding per block of 8 samples), and
    eager PyTorch's cost is the number of steps, not their width: the accumulators of every
    layer and slice sit side by side in one ``[slices, sum of out * in]`` row and take each
    step together, as two kernels: the float64 sum stored as float32 (one rounding) and back
    to float64. The block sums (batched GEMMs) are formed ``_PARTS_CHUNK`` blocks at a time.
    """
    if accumulate == "half":
        return _split_k_weight_grads_tensor_core(layers, split_k, stats)
    k_block = 8
    batch = layers[0][0].shape[0]
    device = layers[0][0].device
    bounds = _slice_bounds(batch, split_k)
    longest = max(hi - lo for lo, hi in bounds)
    length = max(1, math.ceil(longest / k_block)) * k_block
    n_slices, n_blocks = len(bounds), length // k_block
    operands, segments, width = [], [], 0
    for grad_out, act_in in layers:
        n_out, n_in = grad_out.shape[1], act_in.shape[1]
        g = grad_out.new_zeros(n_slices, length, n_out, dtype=torch.float64)
        a = act_in.new_zeros(n_slices, length, n_in, dtype=torch.float64)
        for s, (lo, hi) in enumerate(bounds):
            g[s, : hi - lo] = grad_out[lo:hi]
            a[s, : hi - lo] = act_in[lo:hi]
        operands.append(
            (g.view(n_slices, n_blocks, k_block, n_out), a.view(n_slices, n_blocks, k_block, n_in))
        )
        segments.append((width, width + n_out * n_in, n_out, n_in))
        width += n_out * n_in
    chunk = min(_PARTS_CHUNK, n_blocks)
    # history[j]: the accumulators after step j of the chunk (history[0]: before its first)
    history = torch.zeros(chunk + 1, n_slices, width, dtype=torch.float32, device=device)
    acc64 = torch.zeros(n_slices, width, dtype=torch.float64, device=device)
    parts = torch.empty(chunk, n_slices, width, dtype=torch.float64, device=device)
    absorbed = [0] * len(layers)
    contributions = [0] * len(layers)
    for j0 in range(0, n_blocks, chunk):
        count = min(chunk, n_blocks - j0)
        for (g, a), (lo, hi, n_out, n_in) in zip(operands, segments):
            # the exact sum of each block's 8 products, [S, count, out, in]
            block_sums = torch.einsum(
                "sjko,sjki->sjoi", g[:, j0 : j0 + count], a[:, j0 : j0 + count]
            )
            parts[:count, :, lo:hi].view(count, n_slices, n_out, n_in).copy_(
                block_sums.transpose(0, 1)
            )
        for j in range(count):
            torch.add(acc64, parts[j], out=history[j + 1])
            acc64.copy_(history[j + 1])
        if stats is not None:  # counted on the device: no host read inside the backward
            nonzero = parts[:count] != 0
            unchanged = nonzero & (history[1 : count + 1] == history[:count])
            for index, (lo, hi, _, _) in enumerate(segments):
                contributions[index] = contributions[index] + nonzero[..., lo:hi].sum()
                absorbed[index] = absorbed[index] + unchanged[..., lo:hi].sum()
        history[0].copy_(history[count])
    acc = history[0]
    total = acc[0]
    for s in range(1, n_slices):
        total = _round_acc(total.to(torch.float64) + acc[s].to(torch.float64), accumulate)
    if stats is not None:
        for layer_stats, done, seen in zip(stats, absorbed, contributions):
            layer_stats["absorbed_frac"] = _fraction(done, seen, device)
    return [total[lo:hi].view(n_out, n_in).to(torch.float16) for lo, hi, n_out, n_in in segments]


# float64 + int64 elements of products formed at once by the eager weight gradients (~64 MiB).
_STEP_ELEMENTS = 1 << 22


def _split_k_weight_grads_tensor_core(
    layers: list[tuple[torch.Tensor, torch.Tensor]],
    split_k: bool = True,
    stats: list[dict[str, torch.Tensor]] | None = None,
) -> list[torch.Tensor]:
    """:func:`split_k_weight_grads` with half accumulators in eager ops: every slice takes a
    :func:`_tensor_core_step` per block of 8 rows (zero rows pad the shorter slices), then the
    slices are added in order, each sum rounded once to half. The accumulators of all layers
    and slices sit side by side in one ``[slices, sum of out * in]`` row and take each step
    together; the products of several blocks are formed at once."""
    k_block = 8
    bounds = _slice_bounds(layers[0][0].shape[0], split_k)
    longest = max(hi - lo for lo, hi in bounds)
    length = max(1, math.ceil(longest / k_block)) * k_block
    n_slices, n_blocks = len(bounds), length // k_block
    padded, segments, width = [], [], 0
    for grad_out, act_in in layers:
        g = grad_out.new_zeros(n_slices, length, grad_out.shape[1], dtype=torch.float64)
        a = act_in.new_zeros(n_slices, length, act_in.shape[1], dtype=torch.float64)
        for s, (lo, hi) in enumerate(bounds):
            g[s, : hi - lo] = grad_out[lo:hi]
            a[s, : hi - lo] = act_in[lo:hi]
        padded.append((g, a, _half_exponent(g), _half_exponent(a)))
        segments.append((width, width + g.shape[2] * a.shape[2], g.shape[2], a.shape[2]))
        width += g.shape[2] * a.shape[2]
    acc = layers[0][0].new_zeros(n_slices, width, dtype=torch.float64)
    chunk = max(1, min(n_blocks, _STEP_ELEMENTS // (n_slices * k_block * width)))
    seen, absorbed = [0] * len(layers), [0] * len(layers)
    for j0 in range(0, n_blocks, chunk):
        rows = slice(j0 * k_block, min(n_blocks, j0 + chunk) * k_block)
        count = (rows.stop - rows.start) // k_block
        shape = (n_slices, count, k_block, -1)
        products = torch.cat(
            [(g[:, rows, :, None] * a[:, rows, None, :]).reshape(shape) for g, a, _, _ in padded],
            dim=3,
        )
        exponents = torch.cat(
            [
                (eg[:, rows, :, None] + ea[:, rows, None, :]).reshape(shape)
                for _, _, eg, ea in padded
            ],
            dim=3,
        )
        for j in range(count):
            new = _tensor_core_step(acc, products[:, j], exponents[:, j], 1)
            if stats is not None:  # counted on the device: no host read inside the backward
                nonzero = (products[:, j] != 0).any(1)
                unchanged = nonzero & (new == acc)
                for index, (lo, hi, _, _) in enumerate(segments):
                    seen[index] = seen[index] + nonzero[:, lo:hi].sum()
                    absorbed[index] = absorbed[index] + unchanged[:, lo:hi].sum()
            acc = new
    total = acc[0]
    for s in range(1, n_slices):
        total = _round_acc(total + acc[s], "half").to(torch.float64)
    if stats is not None:
        for layer_stats, done, count in zip(stats, absorbed, seen):
            layer_stats["absorbed_frac"] = _fraction(done, count, acc.device)
    return [total[lo:hi].view(n_out, n_in).to(torch.float16) for lo, hi, n_out, n_in in segments]


# ----------------------------------------------------------------------------- activations
def _f32(fn, x: torch.Tensor) -> torch.Tensor:
    """``fn`` of float32 ``x`` evaluated in float64 and rounded once to float32.

    PyTorch's float32 ``exp``, ``log``, ``sqrt`` and ``tanh`` on a CPU come from the vendor's
    vector library (MKL's VML, Sleef), whose code path, and so whose last bit, depends on the
    CPU and on ``ATEN_CPU_CAPABILITY`` / ``MKL_ENABLE_INSTRUCTIONS``: measured here, torch's
    float32 ``sqrt`` differs from the correctly rounded one at 17 % of inputs and its ``exp`` at
    1 %, and both change with ``ATEN_CPU_CAPABILITY``. The float64 evaluation is within about
    one float64 ulp on every path, so its rounding to float32 is the correctly rounded float32
    value except where the exact result lies within ~2^-29 float32 ulps of a rounding boundary.
    """
    return fn(x.double()).float()


def _activate(name: str, x: torch.Tensor) -> torch.Tensor:
    """common_device.h warp_activation on half values: float32 math (each elementary function
    correctly rounded, :func:`_f32`), one rounding to half."""
    if name == "None":
        return x
    if name == "ReLU":
        return torch.clamp_min(x, 0)
    xf = x.float()
    if name == "LeakyReLU":
        return (xf * torch.where(xf > 0, 1.0, 0.01).half().float()).half()
    if name == "Exponential":
        return _f32(torch.exp, xf).half()
    if name == "Sigmoid":
        return (1.0 / (1.0 + _f32(torch.exp, -xf))).half()
    if name == "Squareplus":
        z = xf * _K_ACT
        return (0.5 * (z + _f32(torch.sqrt, z * z + 4)) / _K_ACT).half()
    if name == "Softplus":
        return (_f32(torch.log, _f32(torch.exp, xf * _K_ACT) + 1.0) / _K_ACT).half()
    if name == "Tanh":
        return _f32(torch.tanh, xf).half()
    raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {name!r}")


def _activate_backward(name: str, grad: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """common_device.h warp_activation_backward: from the post-activation ``out``, in half."""
    if name == "None":
        return grad
    if name == "ReLU":
        return torch.where(out > 0, grad, 0.0)
    of = out.float()
    if name == "LeakyReLU":
        factor = torch.where(of > 0, 1.0, 0.01).half()
    elif name == "Exponential":
        factor = out
    elif name == "Sigmoid":
        factor = (of * (1.0 - of).half().float()).half()
    elif name == "Squareplus":
        y = of * _K_ACT
        factor = (y * y / (y * y + 1)).half()
    elif name == "Softplus":
        factor = (1.0 - _f32(torch.exp, -of * _K_ACT)).half()
    elif name == "Tanh":
        factor = (1.0 - of * of).half()
    else:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {name!r}")
    return (grad.float() * factor.float()).half()


# ----------------------------------------------------------------------------- the network
def _weights(params: torch.Tensor, spec: FusedMLPSpec) -> list[torch.Tensor]:
    out, offset = [], 0
    for rows, cols in spec.shapes():
        out.append(params[offset : offset + rows * cols].view(rows, cols))
        offset += rows * cols
    return out


def _forward(x_half: torch.Tensor, weights: list[torch.Tensor], spec: FusedMLPSpec):
    """All half activations, input first; the last entry is the (padded) output."""
    acts = [x_half]
    for index, w in enumerate(weights):
        last = index == len(weights) - 1
        k_block = 8 if last and spec.output_pad > 16 else 16
        pre = half_matmul(acts[-1], w.t(), k_block, spec.accumulate)
        acts.append(_activate(spec.output_activation if last else spec.activation, pre))
    return acts


class _FusedMLPFunction(torch.autograd.Function):
    """tcnn's ``_module_function`` + ``_module_function_backward`` with the twin inside."""

    @staticmethod
    def forward(ctx, x32, params_half, spec):
        with profiler_scope("mptex.mlp.forward"):
            return _FusedMLPFunction._forward(ctx, x32, params_half, spec)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        with profiler_scope("mptex.mlp.backward"):
            return _FusedMLPFunction._backward(ctx, grad_output)

    @staticmethod
    def _forward(ctx, x32, params_half, spec):
        weights = _weights(params_half, spec)
        # identity.h: f32 -> half, the padded columns set to 1
        x_half = torch.ones(x32.shape[0], spec.input_pad, dtype=torch.float16, device=x32.device)
        x_half[:, : spec.n_input_dims] = x32.to(torch.float16)
        with torch.no_grad():
            acts = _forward(x_half, weights, spec)
        ctx.spec = spec
        ctx.save_for_backward(params_half, *acts)
        return acts[-1]

    @staticmethod
    def _backward(ctx, grad_output):
        spec: FusedMLPSpec = ctx.spec
        params_half, *acts = ctx.saved_tensors
        weights = _weights(params_half, spec)
        scale = float(spec.loss_scale)
        # modules.py: scaled_grad = doutput * loss_scale, in doutput's dtype (half)
        grad = (grad_output.to(torch.float16).float() * scale).half()
        grad = _activate_backward(spec.output_activation, grad, acts[-1])
        # dL/d(pre-activation) of each layer, top down; the weight gradients need all of them
        # and come after, in one pass over the batch (split_k_weight_grads).
        layer_grads: list[torch.Tensor] = [None] * len(weights)  # type: ignore[list-item]
        for index in range(len(weights) - 1, -1, -1):
            layer_grads[index] = grad
            if index > 0:
                k_block = 8 if index == len(weights) - 1 and spec.output_pad > 16 else 16
                down = half_matmul(grad, weights[index], k_block, spec.accumulate)
                grad = _activate_backward(spec.activation, down, acts[index])
        stats: dict[int, dict[str, torch.Tensor]] = {}
        if ctx.needs_input_grad[1]:
            layer_stats = [{} for _ in weights] if spec.collect_stats else None
            grads_w = split_k_weight_grads(
                list(zip(layer_grads, acts[:-1])), spec.accumulate, spec.split_k, layer_stats
            )
            if layer_stats is not None:
                for index, (entry, grad_w) in enumerate(zip(layer_stats, grads_w)):
                    entry.update(_grad_stats(grad_w, scale))
                    stats[index] = entry
        spec.stats = dict(sorted(stats.items()))
        grad_x = grad_params = None
        if ctx.needs_input_grad[0]:
            k_block = 16 if spec.input_pad == spec.width else 8
            grad_in = half_matmul(grad, weights[0], k_block, spec.accumulate)
            # identity.h passes the half gradient on as f32; modules.py divides in f32
            grad_x = grad_in[:, : spec.n_input_dims].float() / scale
        if ctx.needs_input_grad[1]:
            flat = torch.cat([g.reshape(-1) for g in grads_w])
            # modules.py: params_grad / loss_scale in the params' precision (half)
            grad_params = (flat.float() / scale).half()
        return grad_x, grad_params, None


def _fraction(part, whole, device: torch.device) -> torch.Tensor:
    """``part / max(whole, 1)`` of two counts as a 0-d tensor, without a host read: float64,
    exact for counts below 2**53 (float32 on MPS, which has no float64). Counts the host holds
    (Python ints: the C kernel's) give a host tensor; a count on ``device`` keeps it there, and
    ``whole`` may then be a Python int (an element count, passed to the kernel as a scalar)."""
    dtype = torch.float32 if device.type == "mps" else torch.float64
    if not isinstance(part, torch.Tensor):
        if isinstance(whole, torch.Tensor):
            raise TypeError("part: expected a tensor when whole is one")
        return torch.tensor(part / max(whole, 1), dtype=dtype)
    if isinstance(whole, torch.Tensor):
        return part.to(dtype) / whole.to(dtype).clamp(min=1)
    return part.to(dtype) / max(whole, 1)


def _grad_stats(grad_half: torch.Tensor, scale: float) -> dict[str, torch.Tensor]:
    """Zero / subnormal fractions of a scaled half weight gradient, before and after / scale,
    as 0-d tensors on its device (:func:`_fraction`: no host read)."""
    tiny = torch.finfo(torch.float16).tiny
    unscaled = (grad_half.float() / scale).half()
    n = grad_half.numel()

    def frac(mask: torch.Tensor) -> torch.Tensor:
        return _fraction(mask.sum(), n, mask.device)

    return {
        "scaled_zero_frac": frac(grad_half == 0),
        "scaled_subnormal_frac": frac((grad_half != 0) & (grad_half.abs() < tiny)),
        "zero_frac": frac(unscaled == 0),
        "subnormal_frac": frac((unscaled != 0) & (unscaled.abs() < tiny)),
        "flushed_by_unscale_frac": frac((grad_half != 0) & (unscaled == 0)),
    }


def fused_mlp(x: torch.Tensor, params: torch.Tensor, spec: FusedMLPSpec) -> torch.Tensor:
    """The twin's forward as tcnn's bindings run it (``modules.py`` ``Module.forward``).

    Args:
        x: ``[N, n_input_dims]`` float (cast to float32, as the bindings do).
        params: ``[n_params]`` float32 master parameters (cast to half here, in the graph).
        spec: sizes and switches.

    Returns:
        ``[N, n_output_dims]`` float16.
    """
    batch = x.shape[0]
    padded_batch = _next_multiple(batch, BATCH_GRANULARITY)
    x32 = x.to(torch.float32)
    if padded_batch != batch:
        x32 = torch.nn.functional.pad(x32, (0, 0, 0, padded_batch - batch))
    out = _FusedMLPFunction.apply(x32.contiguous(), params.to(torch.float16), spec)
    return out[:batch, : spec.n_output_dims]


# ----------------------------------------------------------------------------- initialisation
_PCG_MULT = 0x5851F42D4C957F2D
_MASK64 = (1 << 64) - 1


def pcg32_floats(seed: int, count: int) -> np.ndarray:
    """``count`` values of tcnn's ``pcg32{seed}.next_float()`` (dependencies/pcg32/pcg32.h).

    ``seed(initstate, initseq=1)``: state 0, inc ``(1 << 1) | 1``, step, state += seed, step;
    ``next_float`` puts the top 23 bits of ``next_uint`` under exponent 0 and subtracts 1.
    """
    inc = (1 << 1) | 1
    state = 0
    state = (state * _PCG_MULT + inc) & _MASK64
    state = (state + seed) & _MASK64
    state = (state * _PCG_MULT + inc) & _MASK64
    words = np.empty(count, dtype=np.uint32)
    for i in range(count):
        old = state
        state = (old * _PCG_MULT + inc) & _MASK64
        xorshifted = (((old >> 18) ^ old) >> 27) & 0xFFFFFFFF
        rot = old >> 59
        words[i] = ((xorshifted >> rot) | (xorshifted << ((-rot) & 31))) & 0xFFFFFFFF
    bits = (words >> np.uint32(9)) | np.uint32(0x3F800000)
    return bits.view(np.float32) - np.float32(1.0)


def xavier_uniform_params(spec: FusedMLPSpec, seed: int = 1337) -> torch.Tensor:
    """tcnn's initial params: ``initialize_xavier_uniform`` on each matrix in layout order.

    gpu_matrix.h: ``scale = sqrt(6 / (fan_in + fan_out))`` (float32; fan_in = cols, fan_out =
    rows of the row-major ``[out, in]`` matrix, padding included), value ``next_float() * 2 *
    scale - scale`` in float32, one pcg32 stream (``pcg32 rng{seed}``, cpp_api.cu) across all
    matrices.
    """
    uniforms = pcg32_floats(seed, spec.n_params)
    out, offset = [], 0
    for rows, cols in spec.shapes():
        scale = np.sqrt(np.float32(6.0) / np.float32(rows + cols), dtype=np.float32)
        u = uniforms[offset : offset + rows * cols]
        out.append((u * np.float32(2.0)) * scale - scale)
        offset += rows * cols
    return torch.from_numpy(np.concatenate(out).astype(np.float32))
