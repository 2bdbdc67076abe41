"""A stated cost model of one training iteration of the texture on a named GPU, used on a CPU.

CPU wall time says nothing about a GPU (f16 is emulated on a CPU), so the search ranks candidates
by this model; where a GPU is present it uses the measured ms / iteration instead.

Model (:func:`iteration_cost`). One iteration of the texture's own work is a list of kernels,
grouped in parts (grid forward/backward, each MLP layer's forward/backward, casts, optimizer,
loss scaling). A part costs ``max(bytes / bandwidth, flops / rate(dtype)) + kernels * launch_s
+ host_syncs * sync_s``: a roofline per part plus a fixed cost per kernel launch and per
device-to-host synchronisation. The iteration's cost is the sum over parts. Assumptions:

- Scope: the texture (hash grid, MLP, their casts, Adam, loss scaling). Rasterisation, shading,
  the loss and the sigmoid are the same for every candidate and left out.
- ``N`` texture queries per iteration (``points``): covered pixels x views x 2 with nvdiffrec's kd
  smoothness term (the texture is sampled at the points and at jittered copies).
- Hash grid (tcnn's semantics): forward reads 8 corners x ``F`` features x ``L`` levels per query in
  the encoder dtype; backward adds to as many gradient entries (an atomic add = read + write, in
  the encoder dtype, tcnn's gradient type; f32 for mptex's bf16 grid, which has no tcnn
  counterpart and accumulates its gradient in f32). No cache reuse and no sector over-fetch is
  modelled: the gather/scatter bytes are a lower bound. With an f16 grid the f32 master table is
  cast to an f16 copy once per step and the f16 gradient back to f32 for the optimizer (one pass
  each); a bf16 grid casts the table only.
- Linear MLP (:class:`~mptex.PrecisionMLP`): per layer a GEMM forward (``2 N in out`` FLOPs) and
  two backward (``4 N in out``: input and weight gradients; the first layer's input gradient
  feeds the grid), activations read and written once per pass, a cast kernel (forward and
  backward) wherever a value changes dtype, and with f32 masters a weight cast to a non-f32
  compute dtype (and its gradient back). FLOP rates: f32 on the CUDA cores (PyTorch keeps TF32
  off for matmuls by default), f16 / bf16 on the tensor cores with f32 accumulation (cuBLAS).
- Fused MLP (tcnn's FullyFusedMLP): one forward kernel and one backward kernel for the whole
  network plus one weight-gradient GEMM per layer, f16 tensor-core rate with half
  accumulation; input padded to a multiple of 16 and output to 16 columns; the hidden
  activations are written in the forward and read in the backward (tcnn keeps them for the
  backward pass); its loss scale is folded into its kernels.
- FP8 GEMMs (candidates ``fp8``, ``fp8_current``, ``fp8_rowwise``; :mod:`mptex.fp8`): per
  layer the input and the weight are quantised (an amax reduction over f32, then a
  scale-and-cast kernel writing one byte per value) and the output gradient likewise in the
  backward; the three GEMMs (forward, input and weight gradients) run at the FP8 tensor-core
  rate with f32 accumulation, reading one-byte operands and writing f32; the delayed recipe
  updates each of the three amax histories and scales (2 kernels each). Row-wise scaling
  (``fp8_rowwise``) writes and reads one f32 amax/scale per row of each quantised operand, and
  quantises the input, the weight and the output gradient a second time along the other axis
  for the backward GEMMs (the scales sit on the indices a GEMM does not reduce over). A GPU
  without FP8 tensor cores runs mptex's emulation: the operands converted to f32 and an f32
  GEMM.
- QAT (``int8_qat``, ``fp8_qat``, ``fp8_rowwise_qat``): the f32 MLP plus each weight's fake
  quantisation forward (``QAT_KERNELS`` small kernels over the weight: its amax, scale, divide,
  round, multiply); ``fp8_rowwise_qat`` fake-quantises each layer's input the same way.
- Adam (PyTorch's multi-tensor ``foreach``): per parameter read p, g, m, v and write p, m, v in
  the parameter dtype (28 B for f32), ``ADAM_KERNELS`` kernels per parameter group (grid, MLP).
- Loss scaling: ``static``/``dynamic`` scale the loss (1 kernel), unscale and check every gradient
  (read + write, 1 kernel) and read the found-inf flag on the host (1 sync); ``dynamic`` updates
  the scale (1 kernel). ``none`` and tcnn's internal scale cost nothing.
- Launch and sync: ``launch_s`` (5 µs) per kernel, PyTorch eager's dispatch and launch of a
  small kernel, and ``sync_s`` (10 µs) per host sync: assumptions, not vendor figures. At the
  CPU-sized texture these terms dominate (a few thousand queries per view keep every kernel
  small), so fewer kernels (the fused network, no casts) is cheaper there; at nvdiffrec's scale
  the bytes and FLOPs take over.

GPU constants (:data:`GPUS`), dense (no sparsity) rates:

- ``h100``: NVIDIA H100 SXM5, NVIDIA H100 Tensor Core GPU datasheet (SXM5 column): HBM3
  3.35 TB/s, FP32 67 TFLOPS, FP16 and BF16 tensor 989.4 TFLOPS (the datasheet's 1,979 is with
  sparsity); the same rate with half accumulation; FP8 tensor 1,979 TFLOPS (the datasheet's
  3,958 is with sparsity).
- ``rtx4090``: NVIDIA GeForce RTX 4090, NVIDIA Ada Lovelace GPU architecture whitepaper v1.03,
  Appendix A, Table 2: 1008 GB/s, FP32 82.6 TFLOPS, FP16/BF16 tensor with FP32 accumulate
  165.2 TFLOPS, FP16 tensor with FP16 accumulate 330.3 TFLOPS, FP8 tensor with FP32 accumulate
  330.3 TFLOPS.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mptex._grid_torch import grid_geometry
from mptex.config_schema import Integer, OneOf, OrNull, Text, setting
from mptex.search.space import Candidate

__all__ = [
    "GPU",
    "GPUS",
    "CostConfig",
    "TextureShape",
    "iteration_cost",
    "shape_from_config",
    "ADAM_KERNELS",
]

BYTES = {"f32": 4, "f16": 2, "bf16": 2, "fp8": 1}
ADAM_KERNELS = 5  # foreach Adam per parameter group: m, v updates, bias corrections, step
QAT_KERNELS = 5  # fake quantisation of one weight: amax, scale, divide, round + clamp, multiply
FP8_HISTORY_KERNELS = 2  # delayed recipe, per tensor role: roll the history, new scale


@dataclass(frozen=True)
class GPU:
    """A GPU's figures for the cost model (rates in FLOP/s, bandwidth in B/s)."""

    name: str
    bandwidth: float
    f32: float
    f16: float  # tensor cores, f32 accumulation (cuBLAS's default)
    bf16: float
    f16_half_acc: float  # tensor cores, f16 accumulation (tcnn's fully fused network)
    source: str
    launch_s: float = 5e-6
    sync_s: float = 10e-6
    fp8: float | None = None  # FP8 tensor cores, f32 accumulation; None: none (emulated in f32)

    def rate(self, dtype: str) -> float:
        if dtype == "fp8":
            return self.fp8 if self.fp8 else self.f32
        return {"f32": self.f32, "f16": self.f16, "bf16": self.bf16}[dtype]


GPUS: dict[str, GPU] = {
    "h100": GPU(
        "NVIDIA H100 SXM5",
        3.35e12,
        66.9e12,
        989.4e12,
        989.4e12,
        989.4e12,
        "NVIDIA H100 Tensor Core GPU datasheet, SXM5 column (dense rates)",
        fp8=1979e12,
    ),
    "rtx4090": GPU(
        "NVIDIA GeForce RTX 4090",
        1.008e12,
        82.6e12,
        165.2e12,
        165.2e12,
        330.3e12,
        "NVIDIA Ada Lovelace GPU architecture whitepaper v1.03, Appendix A, Table 2",
        fp8=330.3e12,
    ),
}


@dataclass
class CostConfig:
    """The ``search.cost`` group: where the candidates' cost is modelled."""

    gpu: str = setting("h100", OneOf(sorted(GPUS)))
    """The target GPU (:data:`GPUS`)."""
    points: int | None = setting(
        None, OrNull(Integer(min=1), "this run's texture queries per iteration")
    )
    """Texture queries per iteration."""
    texture: str | None = setting(
        None, OrNull(Text(what="a configs/texture name"), "this run's texture group")
    )
    """The texture the cost is modelled for: a ``configs/texture`` name."""


@dataclass(frozen=True)
class TextureShape:
    """What the cost depends on besides the candidate.

    Args:
        points: texture queries per iteration (``N``).
        n_levels, n_features: the hash grid's ``L`` and ``F``.
        grid_params: trainable grid entries (all levels, all features).
        n_layers, width, n_outputs: the MLP (``hidden + 1`` bias-free layers).
    """

    points: int
    n_levels: int
    n_features: int
    grid_params: int
    n_layers: int
    width: int
    n_outputs: int

    @property
    def n_inputs(self) -> int:
        return self.n_levels * self.n_features

    def layer_dims(self) -> list[tuple[int, int]]:
        dims = [self.n_inputs] + [self.width] * (self.n_layers - 1) + [self.n_outputs]
        return list(zip(dims[:-1], dims[1:], strict=True))

    @property
    def mlp_params(self) -> int:
        return sum(i * o for i, o in self.layer_dims())


@dataclass
class Part:
    """One part of the iteration: its traffic, arithmetic and launches."""

    name: str
    bytes: float = 0.0
    flops: float = 0.0
    rate: float = 0.0  # FLOP/s for the flops (0: no flops)
    kernels: int = 0
    syncs: int = 0
    seconds: float = field(default=0.0)

    def finish(self, gpu: GPU) -> Part:
        compute = self.flops / self.rate if self.flops else 0.0
        self.seconds = (
            max(self.bytes / gpu.bandwidth, compute)
            + self.kernels * gpu.launch_s
            + self.syncs * gpu.sync_s
        )
        return self


def _cast(name: str, n: float, src: str, dst: str) -> Part:
    """A cast kernel over ``n`` values (read in ``src``, write in ``dst``)."""
    return Part(name, bytes=n * (BYTES[src] + BYTES[dst]), kernels=1)


def _grid(c: Candidate, s: TextureShape) -> list[Part]:
    b, n, lf = BYTES[c.encoder], s.points, s.n_levels * s.n_features
    # tcnn's half grid accumulates its gradient in half; mptex's bf16 grid in f32.
    g = BYTES["f32"] if c.encoder == "bf16" else b
    parts = [
        Part("grid forward", bytes=n * lf * 8 * b + n * 3 * 4 + n * lf * b, kernels=1),
        Part("grid backward", bytes=n * lf * 8 * 2 * g + n * lf * b + n * 3 * 4, kernels=1),
        Part("grid gradient zero", bytes=s.grid_params * g, kernels=1),
    ]
    if c.encoder != "f32":
        parts.append(_cast(f"grid f32 -> {c.encoder} table", s.grid_params, "f32", c.encoder))
    if c.encoder == "f16":
        parts.append(_cast("grid f16 -> f32 gradient", s.grid_params, c.encoder, "f32"))
    return parts


def _linear_mlp(c: Candidate, s: TextureShape, gpu: GPU) -> list[Part]:
    parts, n, current = [], s.points, c.encoder
    dims = s.layer_dims()
    for i, ((fan_in, fan_out), d) in enumerate(zip(dims, c.layers, strict=True)):
        b, rate = BYTES[d], gpu.rate(d)
        if current != d:  # the input changes dtype: a cast forward and its gradient's backward
            parts.append(_cast(f"layer {i} input cast", 2 * n * fan_in, current, d))
        if c.master_weights and d != "f32":
            parts.append(_cast(f"layer {i} weight cast", 2 * fan_in * fan_out, "f32", d))
        w_bytes = fan_in * fan_out * b
        parts.append(
            Part(
                f"layer {i} forward",
                flops=2 * n * fan_in * fan_out,
                rate=rate,
                bytes=n * (fan_in + fan_out) * b + w_bytes,
                kernels=1,
            )
        )
        parts.append(
            Part(
                f"layer {i} backward",
                flops=4 * n * fan_in * fan_out,
                rate=rate,
                bytes=n * (2 * fan_out + 2 * fan_in) * b + 2 * w_bytes,
                kernels=2,
            )
        )
        if i < len(dims) - 1:  # ReLU forward (read, write) and backward (grad, output, write)
            parts.append(Part(f"layer {i} activation", bytes=5 * n * fan_out * b, kernels=2))
        current = d
    if current != "f32":  # the texture's output goes on in f32
        parts.append(_cast("output cast", 2 * n * s.n_outputs, current, "f32"))
    return parts


def _fp8_mlp(c: Candidate, s: TextureShape, gpu: GPU) -> list[Part]:
    """The MLP with FP8 GEMMs (module docstring); values between the layers f32."""
    parts, n, current = [], s.points, c.encoder
    rate, delayed, rowwise = gpu.rate("fp8"), c.quant == "fp8", c.quant == "fp8_rowwise"
    dims = s.layer_dims()
    if current != "f32":  # the grid's features become the f32 input of the first layer
        parts.append(_cast("layer 0 input cast", 2 * n * dims[0][0], current, "f32"))
    for i, (fan_in, fan_out) in enumerate(dims):
        w = fan_in * fan_out
        # amax (read f32) + scale-and-cast (read f32, write 1 B) of input and weight
        parts.append(Part(f"layer {i} quantise", bytes=(n * fan_in + w) * (4 + 4 + 1), kernels=4))
        parts.append(Part(f"layer {i} forward", flops=2 * n * w, rate=rate,
                          bytes=n * fan_in + w + n * fan_out * 4, kernels=1))  # fmt: skip
        parts.append(Part(f"layer {i} gradient quantise", bytes=n * fan_out * 9, kernels=2))
        parts.append(Part(f"layer {i} backward", flops=4 * n * w, rate=rate,
                          bytes=2 * (n * fan_out + n * fan_in + w) + (n * fan_in + w) * 4,
                          kernels=2))  # fmt: skip
        if delayed:
            parts.append(Part(f"layer {i} amax histories", kernels=3 * FP8_HISTORY_KERNELS))
        if rowwise:
            # One f32 scale per row written and read, for the row-wise operands (input and
            # gradient per sample, weight per output channel) ...
            rows = 2 * n + fan_out
            parts.append(Part(f"layer {i} row scales", bytes=rows * 4 * 2))
            # ... and input, weight and gradient again along their other axis for the
            # backward GEMMs: amax + scale-and-cast as above, plus their scales.
            again = n * fan_in + w + n * fan_out
            scales = (2 * fan_in + fan_out) * 8
            parts.append(Part(f"layer {i} column-wise quantise", bytes=again * 9 + scales,
                              kernels=6))  # fmt: skip
        if i < len(dims) - 1:
            parts.append(Part(f"layer {i} activation", bytes=5 * n * fan_out * 4, kernels=2))
    return parts


def _qat(c: Candidate, s: TextureShape) -> list[Part]:
    """Each weight's fake quantisation in the forward (read and write the weight a few times),
    and for ``fp8_rowwise_qat`` each layer input's."""
    parts = [
        Part(f"layer {i} fake quantisation", bytes=4 * fan_in * fan_out * 2 * QAT_KERNELS,
             kernels=QAT_KERNELS)
        for i, (fan_in, fan_out) in enumerate(s.layer_dims())
    ]  # fmt: skip
    if c.quant == "fp8_rowwise_qat":
        parts += [
            Part(f"layer {i} input fake quantisation",
                 bytes=4 * s.points * fan_in * 2 * QAT_KERNELS, kernels=QAT_KERNELS)
            for i, (fan_in, _) in enumerate(s.layer_dims())
        ]  # fmt: skip
    return parts


def _pad16(k: int) -> int:
    return -(-k // 16) * 16


def _fused_mlp(c: Candidate, s: TextureShape, gpu: GPU) -> list[Part]:
    n, parts = s.points, []
    n_in, n_out = _pad16(s.n_inputs), _pad16(s.n_outputs)
    macs = n_in * s.width + (s.n_layers - 2) * s.width * s.width + s.width * n_out
    hidden = n * s.width * (s.n_layers - 1) * 2  # f16 hidden activations, stored for backward
    if c.encoder != "f16":
        parts.append(_cast("fused input cast", 2 * n * s.n_inputs, c.encoder, "f16"))
    parts.append(_cast("fused weight cast", 2 * s.mlp_params, "f32", "f16"))
    parts.append(
        Part(
            "fused forward",
            flops=2 * n * macs,
            rate=gpu.f16_half_acc,
            bytes=n * (n_in + n_out) * 2 + hidden,
            kernels=1,
        )
    )
    parts.append(
        Part(
            "fused backward",
            flops=4 * n * macs,
            rate=gpu.f16_half_acc,
            bytes=n * (n_in + n_out) * 2 + 2 * hidden,
            kernels=1 + s.n_layers,
        )
    )
    parts.append(_cast("output cast", 2 * n * s.n_outputs, "f16", "f32"))
    return parts


def _optimizer(c: Candidate, s: TextureShape) -> list[Part]:
    mlp_dtype = "f32" if c.master_weights or c.mlp == "fused" else c.layers[0]
    return [
        Part("Adam grid", bytes=7 * 4 * s.grid_params, kernels=ADAM_KERNELS),
        Part("Adam MLP", bytes=7 * BYTES[mlp_dtype] * s.mlp_params, kernels=ADAM_KERNELS),
    ]


def _loss_scaling(c: Candidate, s: TextureShape) -> list[Part]:
    if c.loss_scaling not in ("static", "dynamic"):
        return []
    grads = (s.grid_params + s.mlp_params) * 4 * 2
    part = Part(f"loss scaling ({c.loss_scaling})", bytes=grads, kernels=2, syncs=1)
    if c.loss_scaling == "dynamic":
        part.kernels += 1
    return [part]


def iteration_cost(
    candidate: Candidate, shape: TextureShape, gpu: GPU | str = "h100"
) -> dict[str, Any]:
    """Modelled seconds of one iteration of ``candidate``'s texture on ``gpu`` (module docstring).

    Returns:
        ``{"seconds", "bytes", "flops", "kernels", "syncs", "gpu", "parts": [{name, bytes, flops,
        rate, kernels, syncs, seconds}, ...]}``.
    """
    gpu = GPUS[gpu] if isinstance(gpu, str) else gpu
    if candidate.mlp == "fused":
        mlp = _fused_mlp(candidate, shape, gpu)
    elif candidate.quant in ("fp8", "fp8_current", "fp8_rowwise"):
        mlp = _fp8_mlp(candidate, shape, gpu)
    else:
        mlp = _linear_mlp(candidate, shape, gpu)
        if candidate.quant in ("int8_qat", "fp8_qat", "fp8_rowwise_qat"):
            mlp += _qat(candidate, shape)
    parts = _grid(candidate, shape) + mlp
    parts += _optimizer(candidate, shape) + _loss_scaling(candidate, shape)
    for part in parts:
        part.finish(gpu)
    return {
        "seconds": sum(p.seconds for p in parts),
        "bytes": sum(p.bytes for p in parts),
        "flops": sum(p.flops for p in parts),
        "kernels": sum(p.kernels for p in parts),
        "syncs": sum(p.syncs for p in parts),
        "gpu": gpu.name,
        "parts": [dict(vars(p)) for p in parts],
    }


def shape_from_config(cfg: Mapping[str, Any], points: int) -> TextureShape:
    """The :class:`TextureShape` of a run config's ``texture`` group with ``points`` queries
    (the grid's size from tcnn's layout, :func:`mptex.encoding.GridGeometry`)."""
    tex = cfg["texture"]
    enc = tex["encoder"]
    geometry = grid_geometry(
        3,
        int(enc["n_levels"]),
        int(enc["n_features_per_level"]),
        int(enc["log2_hashmap_size"]),
        int(enc["base_resolution"]),
        float(enc["per_level_scale"]),
    )
    return TextureShape(
        points=int(points),
        n_levels=geometry.n_levels,
        n_features=int(enc["n_features_per_level"]),
        grid_params=geometry.n_params,
        n_layers=int(tex["hidden"]) + 1,
        width=int(tex["internal_dims"]),
        n_outputs=int(tex["channels"]),
    )
