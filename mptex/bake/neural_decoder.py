"""A NumPy reference decoder for mptex's neural export (:func:`mptex.bake.decode.export_neural`).

This module imports NumPy and the standard library only (no torch, nothing else of mptex): copy
it next to a ``.safetensors`` export and decode on any machine with NumPy. It reads the file's
format itself (an 8-byte little-endian header length, a JSON header, raw little-endian tensors),
including BF16 and F8_E4M3, which NumPy has no dtype for.

Decoding (the precisions of :mod:`mptex.bake.decode`): positions are normalised into the
texture's AABB and clamped to [0, 1]; each level of tcnn's hash grid places a point at
``fmaf(scale_l, x, 0.5)``, interpolates the ``2^D`` corners of its cell (dense index or tcnn's
XOR-of-primes hash) with weights multiplied in tcnn's order; the features are summed with one
fused multiply-add per corner as tcnn 2.0 does, in f32 (``f32``, ``bf16``: then rounded to bf16)
or as tcnn's half mode (the weight rounded to f16, each fma rounded to f16: ``f16``, ``fp8``,
``fp8_rowwise``, ``int8``). The MLP: inputs padded with ones where the file
says, each bias-free layer in the file's precision (f32; f16/bf16 operands, f32 accumulation,
output rounded; fp8: E4M3 input with the stored input scale, saturating, times the E4M3
weight, both scales applied to the f32 sum; fp8_rowwise: each point's input E4M3 with its own
scale ``448 / amax`` (float32 division; 1 for an all-zero input), times the E4M3 weight with
its channel's stored inverse scale, the exact sum of the products rounded once to float32, then
multiplied by the point's inverse scale and by the channel's, in that order; int8:
``s_c * sum_j q_cj x_j`` on f16 inputs, output rounded to f16), ReLU between layers, then
``lo + sigmoid(z) * (hi - lo)`` in f32.

It reproduces :func:`mptex.bake.decode.decode_texture` up to the order of float32 sums (NumPy's
matrix product sums in another order than torch's), whose effect each precision's tolerance in
``tests/test_decode.py`` states.

Usage::

    from neural_decoder import load
    texture = load("texture_neural.safetensors")
    rgb = texture.decode(points)   # points: [N, 3] world positions -> [N, C] float32
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

__all__ = ["NeuralTexture", "load", "read_safetensors", "round_to_bf16", "round_to_e4m3"]

_HASH_PRIMES = (1, 2654435761, 805459861, 3674653429, 2097192037, 1434869437, 2165219737)
_E4M3_MAX = 448.0


def _e4m3_table() -> np.ndarray:
    """float32 value of each E4M3 (``float8_e4m3fn``) byte; NaN for 0x7F and 0xFF."""
    codes = np.arange(256)
    exponent, mantissa = (codes >> 3) & 0xF, codes & 0x7
    sign = np.where(codes & 0x80, -1.0, 1.0)
    normal = (1 + mantissa / 8.0) * np.exp2(exponent - 7.0)
    subnormal = mantissa / 8.0 * 2.0**-6
    values = sign * np.where(exponent == 0, subnormal, normal)
    values[(codes & 0x7F) == 0x7F] = np.nan
    return values.astype(np.float32)


_E4M3_VALUES = _e4m3_table()


def _bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    return (raw.astype(np.uint32) << 16).view(np.float32)


def round_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 ``x`` rounded to bfloat16 (nearest, ties to even), returned as float32."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    out = (rounded & 0xFFFFFFFF).astype(np.uint32).view(np.float32)
    return np.where(np.isnan(x), x, out).astype(np.float32)


def round_to_e4m3(x: np.ndarray) -> np.ndarray:
    """float32 ``x`` rounded to E4M3 (nearest, ties to even, subnormals below 2^-6), saturated
    at +-448, returned as float32 (exact)."""
    x = np.asarray(x, dtype=np.float32)
    magnitude = np.minimum(np.abs(x).astype(np.float64), _E4M3_MAX)
    with np.errstate(divide="ignore"):
        exponent = np.floor(np.log2(np.where(magnitude > 0, magnitude, 1.0)))
    # log2 of a float64 may land one off at exact powers of two: correct it.
    exponent = np.where(np.exp2(exponent) > magnitude, exponent - 1, exponent)
    exponent = np.where(np.exp2(exponent + 1) <= magnitude, exponent + 1, exponent)
    ulp = np.exp2(np.maximum(exponent, -6.0) - 3.0)
    rounded = np.minimum(np.rint(magnitude / ulp) * ulp, _E4M3_MAX)  # rint: ties to even
    return (np.sign(x) * rounded).astype(np.float32)


_DTYPES = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "F8_E4M3": np.dtype("u1"),
    "I8": np.dtype("i1"),
}


def read_safetensors(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """``(tensors, metadata)`` of a safetensors file; BF16 and F8_E4M3 tensors are returned
    as their float32 values, F16 as float16, I8 as int8, F32 as float32."""
    data = Path(path).read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    metadata = header.pop("__metadata__", {}) or {}
    body = memoryview(data)[8 + length :]
    tensors = {}
    for name, info in header.items():
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name}: unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        raw = np.frombuffer(body[start:end], dtype=_DTYPES[info["dtype"]]).reshape(info["shape"])
        if info["dtype"] == "BF16":
            raw = _bf16_to_f32(raw)
        elif info["dtype"] == "F8_E4M3":
            raw = _E4M3_VALUES[raw]
        tensors[name] = raw.copy()
    return tensors, metadata


def _fma_f32(a: np.ndarray, b: np.ndarray, c: float) -> np.ndarray:
    # The float64 product of two float32 is exact; one more rounding to float32 is fmaf's except
    # where the float64 sum sits exactly on a float32 midpoint (rare; covered by the tolerance).
    return (a.astype(np.float64) * b.astype(np.float64) + c).astype(np.float32)


class NeuralTexture:
    """A decoded neural export: :meth:`decode` evaluates it at world positions.

    Args:
        tensors, metadata: :func:`read_safetensors`'s result for a neural export.
    """

    def __init__(self, tensors: dict[str, np.ndarray], metadata: dict[str, str]):
        if not metadata.get("format", "").startswith("mptex-neural-texture/"):
            raise ValueError(f"metadata: not an mptex neural export: {metadata.get('format')!r}")
        self.precision = metadata["precision"]
        self.aabb = np.asarray(json.loads(metadata["aabb"]), dtype=np.float32)
        self.min_max = np.asarray(json.loads(metadata["min_max"]), dtype=np.float32)
        self.grid = json.loads(metadata["grid"])
        self.input_padding = int(metadata["input_padding"])
        self.n_outputs = int(metadata["n_outputs"])
        self.table = tensors["grid.table"].astype(np.float32)
        self.layers = []
        index = 0
        while f"mlp.{index}.weight" in tensors:
            self.layers.append({k.split(".", 2)[2]: v for k, v in tensors.items()
                                if k.startswith(f"mlp.{index}.")})  # fmt: skip
            index += 1

    # ------------------------------------------------------------------ grid
    def _rows(self, cells: np.ndarray, level: int) -> np.ndarray:
        """[N] table rows (level offset included) of corner cells [N, D] (uint64)."""
        g = self.grid
        size, res = g["table_sizes"][level], g["resolutions"][level]
        if g["hashed"][level]:
            index = np.zeros(cells.shape[0], dtype=np.uint64)
            for dim in range(cells.shape[1]):
                index ^= (cells[:, dim] * np.uint64(_HASH_PRIMES[dim])) & np.uint64(0xFFFFFFFF)
        else:
            index, stride = np.zeros(cells.shape[0], dtype=np.uint64), 1
            for dim in range(cells.shape[1]):
                index = (index + cells[:, dim] * np.uint64(stride)) & np.uint64(0xFFFFFFFF)
                stride *= res
        return index % np.uint64(size) + np.uint64(g["offsets"][level])

    def features(self, unit: np.ndarray) -> np.ndarray:
        """[N, L * F] float32 grid features of points [N, D] in [0, 1]."""
        g = self.grid
        n_points, dims = unit.shape
        n_features = g["n_features_per_level"]
        half = self.precision in ("f16", "fp8", "fp8_rowwise", "int8")
        table = self.table.reshape(-1, n_features)
        out = []
        for level, scale in enumerate(g["scales"]):
            pos = _fma_f32(np.float32(scale), unit, 0.5)
            floor = np.floor(pos)
            frac = (pos - floor).astype(np.float32)
            cell = floor.astype(np.int64).astype(np.uint64)
            acc = np.zeros((n_points, n_features), dtype=np.float16 if half else np.float32)
            for corner in range(2**dims):
                weight = np.ones(n_points, dtype=np.float32)
                corner_cells = np.empty_like(cell)
                for dim in range(dims):
                    bit = (corner >> dim) & 1
                    axis = frac[:, dim] if bit else np.float32(1) - frac[:, dim]
                    weight = (weight * axis).astype(np.float32)
                    corner_cells[:, dim] = cell[:, dim] + np.uint64(bit)
                values = table[self._rows(corner_cells, level)].astype(np.float64)
                if half:  # __hfma2(half(weight), value, acc): float64 holds w * v + acc exactly
                    weight = weight.astype(np.float16)
                # one rounding of the float64 value, fmaf's (up to float32 midpoints: rare)
                acc = (weight[:, None].astype(np.float64) * values + acc).astype(acc.dtype)
            out.append(acc.astype(np.float32))
        features = np.concatenate(out, axis=1)
        return round_to_bf16(features) if self.precision == "bf16" else features

    # ------------------------------------------------------------------ MLP
    def _layer(self, h: np.ndarray, layer: dict[str, np.ndarray]) -> np.ndarray:
        weight = layer["weight"]
        if self.precision == "f32":
            return (h @ weight.astype(np.float32).T).astype(np.float32)
        if self.precision == "f16":
            x = h.astype(np.float16).astype(np.float32)
            out = x @ weight.astype(np.float32).T
            return out.astype(np.float16).astype(np.float32)
        if self.precision == "bf16":
            return round_to_bf16(round_to_bf16(h) @ weight.astype(np.float32).T)
        if self.precision == "int8":
            x = h.astype(np.float16).astype(np.float32)
            out = (x @ weight.astype(np.float32).T) * layer["weight_scale"][None, :]
            return out.astype(np.float32).astype(np.float16).astype(np.float32)
        if self.precision == "fp8_rowwise":
            amax = np.abs(h).max(axis=1, keepdims=True).astype(np.float32)
            with np.errstate(divide="ignore"):
                scale = np.where(amax > 0, np.float32(_E4M3_MAX) / amax, np.float32(1))
            scale = scale.astype(np.float32)
            x_q = round_to_e4m3((h * scale).astype(np.float32))
            # float64 holds each E4M3 x E4M3 product and these sums exactly: one rounding.
            acc = (x_q.astype(np.float64) @ weight.astype(np.float64).T).astype(np.float32)
            inv = (np.float32(1) / scale).astype(np.float32)
            row = (acc * inv).astype(np.float32)
            return (row * layer["weight_scale_inv"][None, :]).astype(np.float32)
        scale = np.float32(layer["input_scale"][0])
        x_q = round_to_e4m3((h * scale).astype(np.float32))
        alpha = np.float32(np.float32(1) / scale) * np.float32(layer["weight_scale_inv"][0])
        return ((x_q @ weight.astype(np.float32).T).astype(np.float32) * alpha).astype(np.float32)

    def decode(self, points: np.ndarray) -> np.ndarray:
        """Texture values at world ``points`` ``[N, 3]`` -> ``[N, C]`` float32."""
        points = np.asarray(points, dtype=np.float32).reshape(-1, self.aabb.shape[1])
        lo, hi = self.aabb
        unit = np.clip(((points - lo) / (hi - lo)).astype(np.float32), 0.0, 1.0)
        h = self.features(unit)
        if self.input_padding:
            h = np.concatenate([h, np.ones((h.shape[0], self.input_padding), np.float32)], 1)
        for index, layer in enumerate(self.layers):
            h = self._layer(h, layer)
            if index < len(self.layers) - 1:
                h = np.maximum(h, np.float32(0))
        logits = h[:, : self.n_outputs].astype(np.float32)
        value = (np.float32(1) / (np.float32(1) + np.exp(-logits))).astype(np.float32)
        low, high = self.min_max
        return (value * (high - low) + low).astype(np.float32)


def load(path: str | os.PathLike) -> NeuralTexture:
    """Read a neural export (``.safetensors``) into a :class:`NeuralTexture`."""
    return NeuralTexture(*read_safetensors(path))
