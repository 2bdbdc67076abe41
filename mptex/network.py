"""tiny-cuda-nn's fully fused f16 network, with a pure-PyTorch twin that runs on any device.

``FullyFusedMLP(n_input_dims, n_output_dims, network_config, backend, seed)`` has the
constructor of ``tinycudann.Network``. ``backend="tcnn"`` wraps ``tinycudann.Network``;
``backend="torch"`` is the twin in :mod:`mptex._fused_mlp_torch` (its docstring states the
arithmetic model); ``"auto"`` picks tcnn when importable and the module lives on CUDA (decided at
each forward from the parameters' device, as :class:`~mptex.HashGridEncoding`).

What was checked in tiny-cuda-nn's source (commit 6ee3546b, 2026-04-01), and where:

* widths 16/32/64/128 only, anything else refused: ``src/network.cu`` ``create_network``
  (lines 116-123, "FullyFusedMLP only supports 16, 32, 64, and 128 neurons"); the explicit
  instantiations at the end of ``src/fully_fused_mlp.cu`` (lines 895-898). At least one hidden
  layer: the constructor (line 651). Config defaults ``n_neurons`` 128, ``n_hidden_layers`` 5,
  ``activation`` "ReLU", ``output_activation`` "None" (``network.cu`` lines 110-116).
* no biases: the only parameters are the weight matrices (constructor, lines 659-671).
* layout: first ``[width, n_input_padded]``, ``n_hidden_layers - 1`` times ``[width, width]``,
  last ``[next_multiple(n_output_dims, 16), width]`` (``m_padded_output_width``, line 656;
  ``REQUIRED_ALIGNMENT() = 16`` in ``networks/fully_fused_mlp.h`` line 110), each a row-major
  ``GPUMatrix<T, RM>(rows=out, cols=in)``, contiguous in that order (``set_params_impl``, lines
  857-865). The kernels read them as col-major ``wmma`` B operands, i.e. ``W[out][in]``
  (``threadblock_layer``, line 89).
* input width padded to 16: ``tinycudann.Network`` is a ``NetworkWithInputEncoding`` with an
  ``Identity`` encoding (``src/cpp_api.cu`` lines 156-162); the encoding's output is padded to
  the network's alignment 16 (``network_with_input_encoding.h`` line 47, ``encoding.h`` line 71)
  and the padded entries are set to **1** (``encodings/identity.h`` line 63).
* half everywhere in the network: ``wmma`` accumulator fragments of ``__half`` in the forward and
  backward kernels (``fully_fused_mlp.cu`` lines 68, 198, 333, 436; ``OUT_T = __half``); the
  CUTLASS GEMMs (weight gradients, wide outputs/inputs) use ``TypeAccumulator = half_t`` and
  instruction shape ``GemmShape<16, 8, 8>`` on sm75/80 (``cutlass_matmul.h`` lines 67, 80-83).
* activations: forward in half on the accumulator (``warp_activation``), backward from the stored
  post-activations (``warp_activation_backward``, ``common_device.h``); the network's switch
  accepts None, ReLU, LeakyReLU, Exponential, Sigmoid, Squareplus, Softplus, Tanh
  (``fully_fused_mlp.cu`` forward_impl lines 716-725). Sine and SiLU are refused.
* split-K: ``split_k_factor = batch_size / std::min(1u << 12u, batch_size)`` (line 776),
  ``fc_multiply_split_k`` -> CUTLASS ``GemmSplitKParallel`` (``cutlass_matmul.h`` line 299):
  slice size ``(K / 32 / slices) * 32``, the last slice takes the rest, partial sums reduced in
  the accumulator type (CUTLASS ``kernel/gemm_splitk_parallel.h``).
* loss scale: ``default_loss_scale<__half>() = 128`` (``common.h`` line 243), read by the
  bindings (``modules.py`` line 215); ``doutput * loss_scale`` into ``bwd``, ``input_grad /
  loss_scale`` (f32) and ``params_grad / loss_scale`` (half) after it (lines 167-170).
* batch padded to a multiple of ``BATCH_SIZE_GRANULARITY = 256`` with zero rows (``common.h``
  line 246, ``modules.py`` lines 222-226); the output ``[:N, :n_output_dims]`` (line 233).
* f32 master ``params`` (``bindings.cpp`` ``initial_params``, line 245), cast to half per call
  (``modules.py`` line 230); init ``initialize_xavier_uniform`` per matrix in layout order
  (``fully_fused_mlp.cu`` lines 868-893, ``gpu_matrix.h`` lines 292-306) from ``pcg32{seed}``
  (``cpp_api.cu`` line 141), seed 1337 by default (``modules.py`` line 204).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from numbers import Real
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from mptex import _backends
from mptex._fused_mlp_torch import (
    ACCUMULATE_MODES,
    ACTIVATIONS,
    FusedMLPSpec,
    fused_mlp,
    xavier_uniform_params,
)
from mptex._triton_launch import on_operand_device
from mptex.config_schema import check_seed, is_int
from mptex.numbers import as_int

__all__ = [
    "FullyFusedMLP",
    "FUSED_WIDTHS",
    "ACCUMULATE_MODES",
    "fused_params_from_linear",
    "linear_weights_from_fused",
]

Backend = Literal["auto", "torch", "tcnn"]
FUSED_WIDTHS = (16, 32, 64, 128)
_CONFIG_KEYS = {"otype", "n_neurons", "n_hidden_layers", "activation", "output_activation"}
TCNN_LOSS_SCALE = 128.0


class FullyFusedMLP(nn.Module):
    """tcnn's ``FullyFusedMLP`` network: f16, no biases, half accumulators, static loss scale.

    Args:
        n_input_dims: input features (padded to a multiple of 16 with ones inside).
        n_output_dims: output channels (padded to 16 inside; ``forward`` returns the first
            ``n_output_dims``).
        network_config: tcnn's network dict: ``otype`` ("FullyFusedMLP"), ``n_neurons``
            (16, 32, 64 or 128; default 128), ``n_hidden_layers`` (>= 1; default 5),
            ``activation`` (default "ReLU"), ``output_activation`` (default "None").
        backend: "torch" (the twin), "tcnn" (``tinycudann.Network``), or "auto".
        seed: seed of tcnn's xavier-uniform initialisation (pcg32; same values as tcnn's).
        accumulate: twin only: "half" (tcnn) or "float" (float32 accumulators; ablation).
        split_k: twin only: slice weight-gradient sums every 4096 samples (tcnn) or not.
        loss_scale: the static scale inside the backward (tcnn: 128).
        device: where ``params`` is created.

    Attributes:
        params: ``[n_params]`` float32 master parameters in tcnn's layout (module docstring).
        network_config: the tcnn config dict, defaults filled in; ``n_input_dims``,
            ``n_output_dims``, ``n_params``, ``width`` and ``n_hidden_layers`` as named.
        collect_stats: set True to record per-layer precision statistics in ``last_stats``
            during each twin backward (costs a few reductions per layer).
        last_stats: ``{layer: {...}}`` of the last twin backward with ``collect_stats``, as
            floats (a host read; ``last_stats_on_device``: the same as 0-d device tensors):
            ``absorbed_frac`` (non-zero 8-sample contributions to the weight gradient that the
            accumulator flushed), ``scaled_zero_frac`` / ``scaled_subnormal_frac`` (the scaled
            half gradient), ``zero_frac`` / ``subnormal_frac`` (after the half ``/ loss_scale``),
            ``flushed_by_unscale_frac`` (non-zero scaled entries that the division made 0).

    Raises:
        ValueError: naming the argument, for an unsupported width, activation, config key, or a
            switch the tcnn backend cannot honour.
    """

    def __init__(
        self,
        n_input_dims: int,
        n_output_dims: int,
        network_config: Mapping[str, Any],
        backend: Backend = "auto",
        seed: int = 1337,
        *,
        accumulate: str = "half",
        split_k: bool = True,
        loss_scale: float = TCNN_LOSS_SCALE,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("n_input_dims", n_input_dims), ("n_output_dims", n_output_dims)):
            if not is_int(value) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        n_input_dims, n_output_dims = int(n_input_dims), int(n_output_dims)
        if not isinstance(network_config, Mapping):
            raise ValueError(
                f"network_config: expected a mapping of tcnn network keys, got {network_config!r}"
            )
        seed = check_seed("seed", seed)
        config = dict(network_config)
        unknown = sorted(set(config) - _CONFIG_KEYS)
        if unknown:
            raise ValueError(
                f"network_config: unknown key(s) {unknown}; "
                f"FullyFusedMLP takes {sorted(_CONFIG_KEYS)}"
            )
        otype = str(config.get("otype", "FullyFusedMLP"))
        if otype.lower() not in ("fullyfusedmlp", "megakernelmlp"):
            raise ValueError(f"network_config.otype: expected 'FullyFusedMLP', got {otype!r}")
        width = config.get("n_neurons", 128)
        if as_int(width) not in FUSED_WIDTHS:
            raise ValueError(
                f"network_config.n_neurons: FullyFusedMLP supports {FUSED_WIDTHS} neurons, "
                f"got {width!r}"
            )
        n_hidden = config.get("n_hidden_layers", 5)
        if not is_int(n_hidden) or n_hidden < 1:
            raise ValueError(
                f"network_config.n_hidden_layers: expected an integer >= 1, got {n_hidden!r}"
            )
        for key, default in (("activation", "ReLU"), ("output_activation", "None")):
            value = config.get(key, default)
            if value not in ACTIVATIONS:
                raise ValueError(
                    f"network_config.{key}: expected one of {ACTIVATIONS}, got {value!r}"
                )
        if backend not in ("auto", "torch", "tcnn"):
            raise ValueError(f"backend: expected 'auto', 'torch' or 'tcnn', got {backend!r}")
        if accumulate not in ACCUMULATE_MODES:
            raise ValueError(f"accumulate: expected one of {ACCUMULATE_MODES}, got {accumulate!r}")
        if (isinstance(loss_scale, bool) or not isinstance(loss_scale, Real)
                or not math.isfinite(loss_scale) or loss_scale <= 0):  # fmt: skip
            raise ValueError(f"loss_scale: expected a finite positive number, got {loss_scale!r}")
        if not isinstance(split_k, (bool, np.bool_)):
            raise ValueError(f"split_k: expected True or False, got {split_k!r}")
        self.switches_are_tcnns = accumulate == "half" and bool(split_k)
        if backend == "tcnn":
            if not self.switches_are_tcnns:
                raise ValueError(
                    "backend: 'tcnn' computes with half accumulators and split-K; "
                    "accumulate/split_k switches need backend 'torch'"
                )
            _backends.import_tcnn()
        self.n_input_dims, self.n_output_dims = n_input_dims, n_output_dims
        self.width, self.n_hidden_layers = int(width), int(n_hidden)
        self.network_config = {
            "otype": "FullyFusedMLP",
            "activation": config.get("activation", "ReLU"),
            "output_activation": config.get("output_activation", "None"),
            "n_neurons": self.width,
            "n_hidden_layers": self.n_hidden_layers,
        }
        self.backend = backend
        self.seed = seed
        self.spec = FusedMLPSpec(
            n_input_dims,
            n_output_dims,
            self.width,
            self.n_hidden_layers,
            self.network_config["activation"],
            self.network_config["output_activation"],
            loss_scale=float(loss_scale),
            accumulate=accumulate,
            split_k=bool(split_k),
        )
        self.params = nn.Parameter(xavier_uniform_params(self.spec, seed).to(device))
        self._tcnn_module = None  # built lazily: tinycudann is imported only when used

    # ------------------------------------------------------------------ queries
    @property
    def n_params(self) -> int:
        return self.spec.n_params

    @property
    def loss_scale(self) -> float:
        return self.spec.loss_scale

    @property
    def collect_stats(self) -> bool:
        return self.spec.collect_stats

    @collect_stats.setter
    def collect_stats(self, value: bool) -> None:
        self.spec.collect_stats = bool(value)

    @property
    def last_stats(self) -> dict[int, dict[str, float]]:
        return {layer: {name: float(value) for name, value in values.items()}
                for layer, values in self.spec.stats.items()}  # fmt: skip

    @property
    def last_stats_on_device(self) -> dict[int, dict[str, torch.Tensor]]:
        """``last_stats`` as 0-d tensors on the network's device, read by nobody yet: a caller
        that copies them to the host with other values pays one synchronisation for all."""
        return {layer: dict(values) for layer, values in self.spec.stats.items()}

    def layer_shapes(self) -> list[tuple[int, int]]:
        """``[out, in]`` of each weight matrix, padding included, input layer first."""
        return self.spec.shapes()

    def layer_weights(self) -> list[torch.Tensor]:
        """Each layer's weight matrix as an ``[out, in]`` float32 view of ``params``.

        Padding included: the first matrix has ``next_multiple(n_input_dims, 16)`` columns (the
        extra columns multiply the constant-1 padded inputs: a bias), the last has
        ``next_multiple(n_output_dims, 16)`` rows (the extra rows feed outputs that are cut).
        Views share storage with ``params``: writing into them writes the parameters.
        """
        out, offset = [], 0
        for rows, cols in self.layer_shapes():
            out.append(self.params[offset : offset + rows * cols].view(rows, cols))
            offset += rows * cols
        return out

    def resolved_backend(self) -> str:
        """The backend the next forward uses ("torch" or "tcnn")."""
        if self.backend != "auto":
            return self.backend
        if self.params.device.type != "cuda":
            return "torch"
        if _backends.has_tcnn() and self.switches_are_tcnns:
            return "tcnn"
        _backends.warn_fallback_once(
            "FullyFusedMLP(backend='auto')",
            "tinycudann is not importable"
            if self.switches_are_tcnns
            else "accumulate/split_k switches exist only in the twin",
        )
        return "torch"

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run the network.

        Args:
            x: ``[N, n_input_dims]`` float (cast to float32, as tcnn's bindings do).

        Returns:
            ``[N, n_output_dims]`` float16.
        """
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.n_input_dims:
            got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x: expected shape [N, {self.n_input_dims}], got {got}")
        if not x.is_floating_point():
            raise ValueError(f"x: expected a floating-point tensor, got {x.dtype}")
        if x.device != self.params.device:
            raise ValueError(f"x: is on {x.device} but params are on {self.params.device}")
        if self.resolved_backend() == "tcnn":
            return self._forward_tcnn(x)
        return fused_mlp(x, self.params, self.spec)

    @on_operand_device  # tinycudann, too, works on the current device
    def _forward_tcnn(self, x: torch.Tensor) -> torch.Tensor:
        if self.params.device.type != "cuda":
            raise RuntimeError(
                f"backend 'tcnn' needs the module on CUDA, params are on {self.params.device}"
            )
        tcnn = _backends.import_tcnn()
        native = _backends.tcnn_module_sharing(
            self,
            lambda: tcnn.Network(
                self.n_input_dims, self.n_output_dims, self.network_config, seed=self.seed
            ),
        )
        native.loss_scale = self.loss_scale
        return native(x)

    def extra_repr(self) -> str:
        return (
            f"n_input_dims={self.n_input_dims}, n_output_dims={self.n_output_dims}, "
            f"width={self.width}, n_hidden_layers={self.n_hidden_layers}, "
            f"activation={self.network_config['activation']!r}, "
            f"output_activation={self.network_config['output_activation']!r}, "
            f"backend={self.backend!r}, accumulate={self.spec.accumulate!r}, "
            f"split_k={self.spec.split_k}, loss_scale={self.loss_scale:g}, n_params={self.n_params}"
        )


# ----------------------------------------------------------------------------- layouts
def fused_params_from_linear(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """tcnn's flat ``FullyFusedMLP`` params holding a bias-free linear MLP's weights.

    The linear MLP is nvdiffrec's ``_MLP`` (``Linear(in, width)``, ReLU, ...,
    ``Linear(width, out)``, no biases; :class:`~mptex.PrecisionMLP`'s layers). tcnn's layout
    (module docstring): the row-major ``[out, in]`` matrices in layer order, the first with
    ``next_multiple(in, 16)`` columns, the last with ``next_multiple(out, 16)`` rows. The
    padding is written as zeros: tcnn sets the padded inputs to 1, so non-zero padding columns
    would be a first-layer bias, and the padded output rows feed outputs that are cut. The
    fused network then computes the linear MLP's function (in half arithmetic).

    Args:
        weights: the ``[out, in]`` weight matrices, input layer first: at least two, every
            hidden width equal and one of :data:`FUSED_WIDTHS` (tcnn's only fused widths).

    Returns:
        ``[n_params]`` float32, detached, on the weights' device.

    Raises:
        ValueError: naming ``weights[i]``, for a chain that does not fit the fused network.
    """
    weights = list(weights)
    if len(weights) < 2:
        raise ValueError(
            f"weights: expected at least 2 matrices (FullyFusedMLP has >= 1 hidden layer), "
            f"got {len(weights)}"
        )
    for i, weight in enumerate(weights):
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            got = list(weight.shape) if isinstance(weight, torch.Tensor) else type(weight)
            raise ValueError(f"weights[{i}]: expected a 2-D [out, in] tensor, got {got}")
    width = weights[0].shape[0]
    if width not in FUSED_WIDTHS:
        raise ValueError(
            f"weights[0]: FullyFusedMLP supports {FUSED_WIDTHS} neurons, got {width} rows"
        )
    for i in range(1, len(weights)):
        rows, cols = weights[i].shape
        if cols != width or (i < len(weights) - 1 and rows != width):
            expected = f"[*, {width}]" if i == len(weights) - 1 else f"[{width}, {width}]"
            raise ValueError(
                f"weights[{i}]: expected {expected} (one hidden width), got {[rows, cols]}"
            )
    spec = FusedMLPSpec(weights[0].shape[1], weights[-1].shape[0], width, len(weights) - 1)
    padded = []
    for weight, (rows, cols) in zip(weights, spec.shapes()):
        matrix = weight.detach().to(torch.float32)
        pad = (0, cols - matrix.shape[1], 0, rows - matrix.shape[0])
        padded.append(torch.nn.functional.pad(matrix, pad).reshape(-1))
    return torch.cat(padded)


def linear_weights_from_fused(
    params: torch.Tensor,
    n_input_dims: int,
    n_output_dims: int,
    n_neurons: int,
    n_hidden_layers: int,
    *,
    drop_input_bias: bool = False,
) -> list[torch.Tensor]:
    """The weights of a bias-free linear MLP (nvdiffrec's ``_MLP``) from tcnn's flat params.

    The inverse of :func:`fused_params_from_linear`: each matrix of tcnn's layout without its
    padding. The padded output rows are dropped (they feed outputs tcnn cuts, so nothing
    depends on them). The padded input columns multiply tcnn's constant-1 inputs, a bias the
    linear MLP does not have: they must be zero (as :func:`fused_params_from_linear` writes
    them), or ``drop_input_bias=True`` drops them knowingly (the outputs then change; tcnn's
    own xavier initialisation fills them).

    Args:
        params: ``[n_params]`` tcnn's flat parameters.
        n_input_dims, n_output_dims, n_neurons, n_hidden_layers: the fused network's sizes.
        drop_input_bias: drop non-zero padded input columns instead of refusing them.

    Returns:
        ``n_hidden_layers + 1`` float32 ``[out, in]`` matrices (copies), input layer first.

    Raises:
        ValueError: naming ``params``, for a size that does not match, or non-zero padded input
            columns without ``drop_input_bias``.
    """
    spec = FusedMLPSpec(n_input_dims, n_output_dims, n_neurons, n_hidden_layers)
    if not isinstance(params, torch.Tensor) or params.shape != (spec.n_params,):
        got = list(params.shape) if isinstance(params, torch.Tensor) else type(params)
        raise ValueError(
            f"params: expected [{spec.n_params}] for {n_input_dims} inputs, {n_output_dims} "
            f"outputs, {n_hidden_layers} hidden layers of {n_neurons}, got {got}"
        )
    matrices, offset = [], 0
    for rows, cols in spec.shapes():
        matrices.append(params.detach()[offset : offset + rows * cols].view(rows, cols))
        offset += rows * cols
    bias = matrices[0][:, n_input_dims:]
    if bias.numel() and not drop_input_bias and bool(bias.ne(0).any()):
        raise ValueError(
            f"params: the first layer's padding columns {n_input_dims}..{spec.input_pad - 1} "
            f"(a bias on tcnn's constant-1 inputs) hold values up to {float(bias.abs().max()):.3g};"
            " a bias-free linear MLP cannot hold them (drop_input_bias=True drops them)"
        )
    matrices[0] = matrices[0][:, :n_input_dims]
    matrices[-1] = matrices[-1][:n_output_dims]
    return [m.to(torch.float32).clone() for m in matrices]
