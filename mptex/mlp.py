"""The configurable-precision MLP: nvdiffrec's small ReLU network with a compute dtype per layer."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mptex.config_schema import is_int
from mptex.fp8 import (
    E4M3,
    E5M2,
    GEMM_BACKENDS,
    ScalingRecipe,
    ScalingState,
    fp8_linear,
    quantize_fp8_rowwise,
    resolve_gemm_backend,
    rowwise_spread,
    statistics,
)
from mptex.network import FullyFusedMLP
from mptex.precision import PrecisionPolicy, scale_grad
from mptex.quantize import fake_quantize, fake_quantize_input, quantization_error

__all__ = [
    "PrecisionMLP", "CastLinear", "FP8Linear", "QuantizedLinear", "reduced_linear",
    "float32_gemm_sums",
]  # fmt: skip

_ACTIVATIONS = {"ReLU": nn.ReLU, "LeakyReLU": nn.LeakyReLU, "Sigmoid": nn.Sigmoid, "Tanh": nn.Tanh}


@contextlib.contextmanager
def float32_gemm_sums():
    """Within: cuBLAS's half and bfloat16 GEMMs sum in float32 throughout, as
    :func:`reduced_linear` models them. torch lets cuBLAS reduce a split sum's partial results
    in the reduced type by default (``torch.backends.cuda.matmul``'s
    ``allow_fp16_reduced_precision_reduction`` and ``allow_bf16_reduced_precision_reduction``),
    likeliest in a weight gradient's long sum over the batch; both are False within and
    restored after. The settings are the process's. ``mptex-train`` trains inside it, and
    ``mptex-check`` compares inside it."""
    matmul = torch.backends.cuda.matmul
    # Kept whole, as torch's getters give them (newer torch adds whether split-K is allowed,
    # which setting a bool resets), and set back the same way.
    kept = (torch._C._get_cublas_allow_fp16_reduced_precision_reduction(),
            torch._C._get_cublas_allow_bf16_reduced_precision_reduction())  # fmt: skip
    matmul.allow_fp16_reduced_precision_reduction = False
    matmul.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        (matmul.allow_fp16_reduced_precision_reduction,
         matmul.allow_bf16_reduced_precision_reduction) = kept  # fmt: skip


def reduced_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """``F.linear`` with operands rounded to ``dtype``, float32 accumulation, output in ``dtype``.

    This is what a half or bfloat16 GEMM computes on a GPU (cuBLAS's f32 accumulation, within
    :func:`float32_gemm_sums`: torch's default lets cuBLAS reduce split sums in ``dtype``) and on
    a CPU (oneDNN's f16/bf16 GEMM). Off the CPU it *is* that GEMM. On a CPU the operands are
    rounded to ``dtype`` and the GEMM runs in float32, then the result is rounded once: a product
    of two 11-bit (8-bit for bf16) significands is exact in float32, so only the order of the
    float32 sum can differ from oneDNN's (1 ulp on ~0.1 % of outputs, measured). The reason: with
    the reduction over the batch in the weight gradient (``grad_out^T @ x``, 10^4 rows), oneDNN
    splits the sum between threads, so its f16 result depends on the torch thread count, and
    ``MKL_CBWR`` does not reach oneDNN; float32 GEMMs go to MKL, which under ``MKL_CBWR=...,STRICT``
    (set by ``mptex-train``) gives the same bits for any thread count. The backward follows from
    autograd: the casts round ``dL/dx`` and ``dL/dW`` to ``dtype`` once, as a half GEMM would.

    Shapes: ``x [N, in]``, ``weight [out, in]``, ``bias [out]`` or ``None`` -> ``[N, out]`` in
    ``dtype``.
    """
    if x.device.type != "cpu" or dtype not in (torch.float16, torch.bfloat16):
        b = None if bias is None else bias.to(dtype)
        return F.linear(x.to(dtype), weight.to(dtype), b)
    b = None if bias is None else bias.to(dtype).float()
    return F.linear(x.to(dtype).float(), weight.to(dtype).float(), b).to(dtype)


class CastLinear(nn.Linear):
    """A ``torch.nn.Linear`` that computes in ``compute_dtype``.

    ``forward`` casts the input, the weight and the bias to ``compute_dtype`` and returns the
    product in that dtype (:func:`reduced_linear`: float32 accumulation, one rounding, the same
    bits for any CPU thread count). The parameters keep their own dtype (the f32 "master" copy);
    the cast is part of the autograd graph, so their gradients arrive in their own dtype, as in
    tcnn's bindings. ``compute_dtype=None`` casts nothing itself: on a CPU under an enabled
    ``torch.autocast`` whose dtype is f16 or bf16 the layer computes as autocast's linear would
    (operands cast to the autocast dtype, output in it), through :func:`reduced_linear` with
    autocast switched off for the call; otherwise it is ``nn.Linear``. A layer whose weight is
    float64 (after ``.double()``: a float64 reference, ``gradcheck``) computes in float64
    whatever its ``compute_dtype``, as :class:`~mptex.HashGridEncoding` does with a float64
    table (:attr:`working_dtype`). State-dict keys are ``nn.Linear``'s.

    Shapes: ``x [N, in_features]`` (any float dtype) -> ``[N, out_features]`` in
    ``compute_dtype``.
    """

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, *, compute_dtype=None, **kw
    ):
        super().__init__(in_features, out_features, bias=bias, **kw)
        self.compute_dtype: torch.dtype | None = compute_dtype

    @property
    def working_dtype(self) -> torch.dtype | None:
        """The dtype ``forward`` computes in: float64 for a float64 weight, else
        ``compute_dtype`` (None: the input's, or autocast's)."""
        return torch.float64 if self.weight.dtype == torch.float64 else self.compute_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.working_dtype
        if dtype is not None:
            return reduced_linear(x, self.weight, self.bias, dtype)
        device = x.device.type
        if device == "cpu" and torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            if dtype in (torch.float16, torch.bfloat16):
                with torch.autocast(device, enabled=False):
                    return reduced_linear(x, self.weight, self.bias, dtype)
        return super().forward(x)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, compute_dtype={self.compute_dtype}"


class QuantizedLinear(CastLinear):
    """A :class:`CastLinear` whose forward sees its weight fake-quantised for an int8 or FP8
    decoder (:func:`mptex.quantize.fake_quantize`: int8 per output channel, or E4M3 per tensor),
    with a straight-through gradient to the f32 master weight: quantisation-aware training.

    Args:
        weight_quant: ``"int8"``, ``"fp8"`` or ``"fp8_rowwise"`` (E4M3 per output channel,
            and the layer input E4M3 per row: :func:`mptex.quantize.fake_quantize_input`); the
            other arguments are :class:`CastLinear`'s.

    Attributes:
        collect_stats: when set, each forward records the weight's quantisation error (and
            for ``"fp8_rowwise"`` the input's; :meth:`quant_statistics`); the precision monitor
            sets it on sampled iterations.
    """

    def __init__(self, in_features, out_features, bias=True, *, weight_quant="int8", **kw):
        super().__init__(in_features, out_features, bias=bias, **kw)
        self.weight_quant = weight_quant
        self.collect_stats = False
        self._stats: dict[str, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        quantized = fake_quantize_input(x, self.weight_quant)
        weight = fake_quantize(self.weight, self.weight_quant)
        if self.collect_stats:
            self._stats = self._collect(x, quantized, weight)
        dtype = self.compute_dtype or torch.float32
        return reduced_linear(quantized, weight, self.bias, dtype)

    @torch.no_grad()
    def _collect(self, x, quantized, weight) -> dict[str, torch.Tensor]:
        error = quantization_error(self.weight, weight)
        stats = {"w_rel_error": error[0], "w_underflow_frac": error[1]}
        if self.weight_quant == "fp8_rowwise":
            # The row scales are recomputed here (sampled iterations only) for their spread.
            for prefix, value in (("w", self.weight), ("x", x.reshape(-1, x.shape[-1]))):
                _, _, amax, used = quantize_fp8_rowwise(value.detach(), E4M3)
                spread = rowwise_spread(value.detach(), used, amax, E4M3)
                stats.update({f"{prefix}_scale_spread": spread[0],
                              f"{prefix}_tensor_underflow_frac": spread[1]})  # fmt: skip
            error = quantization_error(x, quantized)
            stats.update(x_rel_error=error[0], x_underflow_frac=error[1])
        return stats

    def quant_statistics(self) -> dict[str, torch.Tensor]:
        """Device scalars of the last collected forward: ``w_rel_error`` (``||q(W) - W|| /
        ||W||``) and ``w_underflow_frac`` (non-zero weights quantised to 0); for
        ``"fp8_rowwise"`` also ``x_rel_error``, ``x_underflow_frac`` (the layer input's) and
        ``<w|x>_scale_spread``, ``<w|x>_tensor_underflow_frac``
        (:func:`mptex.fp8.rowwise_spread`); empty before. Reading them hands them over: a
        second read before the next collected forward is empty, so a sampled iteration whose
        forward collected none never reports an earlier one's."""
        stats, self._stats = self._stats or {}, None
        return stats

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, weight_quant={self.weight_quant!r}"


class FP8Linear(CastLinear):
    """A :class:`CastLinear` whose GEMMs run in FP8 (:func:`mptex.fp8.fp8_linear`): input and
    weight E4M3, output gradient E5M2, each with its own per-tensor scale under ``recipe``,
    f32 accumulation and output. The f32 master weight gets an f32 gradient.

    The three :class:`~mptex.fp8.ScalingState` (``input``, ``weight``, ``grad``) are part of the
    module's state dict (``<prefix>_extra_state``: amax histories, scales, counters), so a
    resumed run continues the delayed recipe where it stopped; they follow ``.to(device)``.

    Args:
        recipe: the :class:`~mptex.fp8.ScalingRecipe`.
        gemm_backend: :func:`mptex.fp8.scaled_mm`'s backend (``"auto"``); the other arguments
            are :class:`CastLinear`'s (``compute_dtype`` f32 or None: the GEMM's output is f32).
    """

    ROLES = ("input", "weight", "grad")

    def __init__(
        self, in_features, out_features, bias=True, *, recipe=None, gemm_backend="auto", **kw
    ):
        super().__init__(in_features, out_features, bias=bias, **kw)
        self.recipe = recipe or ScalingRecipe()
        self.gemm_backend = gemm_backend
        device = self.weight.device
        self.scaling = {
            role: ScalingState(E5M2 if role == "grad" else E4M3, self.recipe, device)
            for role in self.ROLES
        }
        # The weight does not change between the training forwards of one iteration.
        self.scaling["weight"].reuse = True

    @property
    def collect_stats(self) -> bool:
        return self.scaling["input"].collect

    @collect_stats.setter
    def collect_stats(self, value: bool) -> None:
        for state in self.scaling.values():
            state.collect = bool(value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        states = tuple(self.scaling[role] for role in self.ROLES)
        try:
            return fp8_linear(x, self.weight, self.bias, states, self.gemm_backend)
        except ValueError as exc:
            # fp8_linear's GEMM backend is this layer's fp8_gemm (resolved per call, for the
            # device the layer runs on): the error names the argument the caller set.
            message = str(exc)
            if message.startswith(_GEMM_ARG):
                raise ValueError("fp8_gemm: " + message[len(_GEMM_ARG) :]) from None
            raise

    def quant_statistics(self) -> dict[str, torch.Tensor]:
        """Device scalars ``<role>_<name>`` for roles ``input``, ``weight``, ``grad`` and the
        names of :func:`mptex.fp8.statistics` (``amax``, ``scale``, ``overflows``,
        ``nonfinite``, and with ``collect_stats`` ``rel_error``, ``underflow_frac``)."""
        return {
            f"{role}_{name}": value
            for role, state in self.scaling.items()
            for name, value in statistics(state).items()
        }

    def get_extra_state(self) -> dict[str, Any]:
        return {role: state.state_dict() for role, state in self.scaling.items()}

    def snapshot(self) -> dict[str, Any]:
        """Every role's :meth:`ScalingState.snapshot` (no device work)."""
        return {role: state.snapshot() for role, state in self.scaling.items()}

    def restore(self, snapshot: dict[str, Any]) -> None:
        """Back to a :meth:`snapshot`: forgets what forwards and backwards since recorded."""
        for role, kept in snapshot.items():
            self.scaling[role].restore(kept)

    def set_extra_state(self, state: Any) -> None:
        for role, values in (state or {}).items():
            if role in self.scaling:
                self.scaling[role].load_state_dict(values)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        # The scaling state stays f32 whatever the module is cast to; it follows the device.
        for state in self.scaling.values():
            state.to(self.weight.device)
        return self

    def extra_repr(self) -> str:
        r = self.recipe
        return (
            f"{super().extra_repr()}, fp8 recipe={r.recipe!r}, margin={r.margin}, "
            f"amax_history_len={r.amax_history_len}, amax_compute_algo={r.amax_compute_algo!r}"
        )


_GEMM_ARG = "backend: "  # how mptex.fp8.resolve_gemm_backend's errors name the backend


def _check_fp8_gemm(backend: str) -> None:
    if backend not in GEMM_BACKENDS:
        raise ValueError(f"fp8_gemm: expected one of {GEMM_BACKENDS}, got {backend!r}")


def _linear_class(policy: PrecisionPolicy, fp8_gemm: str):
    """The layer class and its extra arguments for ``policy``."""
    if policy.fp8_gemm:
        recipe = ScalingRecipe(
            policy.fp8_recipe,
            policy.fp8_margin,
            policy.fp8_amax_history_len,
            policy.fp8_amax_compute_algo,
        )
        return FP8Linear, {"recipe": recipe, "gemm_backend": fp8_gemm}
    if policy.weight_quant != "none":
        return QuantizedLinear, {"weight_quant": policy.weight_quant}
    return CastLinear, {}


class PrecisionMLP(nn.Module):
    """nvdiffrec's texture MLP with the precision of a :class:`~mptex.PrecisionPolicy`.

    Architecture (nvdiffrec's ``_MLP`` by default): ``Linear(n_input_dims, n_neurons)``,
    activation, ``n_hidden_layers - 1`` times ``Linear(n_neurons, n_neurons)`` and activation,
    then ``Linear(n_neurons, n_output_dims)`` with no output activation: ``n_hidden_layers + 1``
    bias-free linear layers, weights ``kaiming_uniform_(nonlinearity="relu")``. They live in
    ``self.net``, an ``nn.Sequential`` with nvdiffrec's indices (state-dict keys
    ``net.0.weight``, ``net.2.weight``, ... as nvdiffrec's), and are listed in ``self.layers``;
    each is a :class:`CastLinear` (an ``nn.Linear``) whose ``compute_dtype`` is its policy dtype.

    Precision:
        * parameters are f32 masters, except with ``policy.master_weights=False``
          (``f16_naive``), where they are stored in the compute dtype;
        * layer ``i`` casts its input and weight to ``policy.layer_dtypes(n)[i]``; the activation
          runs in that dtype; the next layer casts again (the casts between layers are explicit);
        * ``policy.autocast``: f32 layers, no casts, the whole net under
          ``torch.autocast(x.device.type, dtype=policy.mlp_dtypes[0])``;
        * ``policy.loss_scaling == "nvdiffrec"``: the gradient w.r.t. the (cast) input is
          multiplied by ``policy.static_loss_scale`` (nvdiffrec's backward hook on its ``_MLP``),
          in the first layer's dtype, before the cast's backward takes it to ``x``'s dtype:
          nvdiffrec's order (its MLP is f32, so an f16 encoder output gets the x128 in f32,
          then one rounding to f16). With an f16 first layer and an f32 ``x`` (no nvdiffrec arm
          has it) the x128 is applied in f16 and can overflow there;
        * ``policy.mlp == "fused"``: a :class:`~mptex.FullyFusedMLP` instead (tcnn's all-f16
          network, its own xavier init and internal loss scale ``policy.fused_loss_scale``;
          backend ``policy.mlp_backend``: tinycudann on CUDA, the torch twin elsewhere with
          ``"auto"``); ``self.layers`` is then empty and the weights are the flat
          ``self.net.params`` (``self.net.layer_weights()`` gives the matrices).
          ``mlp_backend="tcnn"`` without tcnn + CUDA raises ``RuntimeError``;
        * ``policy.fp8_gemm``: each layer is an :class:`FP8Linear` (FP8 GEMMs, per-tensor
          scales under the policy's recipe, f32 between the layers; the GEMMs' backend is
          ``fp8_gemm``);
        * ``policy.weight_quant``: each layer is a :class:`QuantizedLinear` (fake-quantised
          weights, straight-through gradients).

    Args:
        n_input_dims: input features (the encoder's ``n_output_dims``).
        n_output_dims: output channels.
        n_hidden_layers: hidden layers (>= 1), as nvdiffrec's and tcnn's ``n_hidden_layers``.
        n_neurons: width of the hidden layers.
        policy: a :class:`PrecisionPolicy`, an arm name or a config mapping.
        bias: add biases (nvdiffrec: no).
        activation: hidden activation, ``"ReLU"`` (default), ``"LeakyReLU"``, ``"Sigmoid"`` or
            ``"Tanh"``.
        fp8_gemm: the FP8 layers' GEMM backend (:data:`mptex.fp8.GEMM_BACKENDS`: ``"auto"``,
            ``"scaled_mm"``, ``"emulated"``, ``"triton"``), resolved on each call for the
            parameters' device (:func:`mptex.fp8.resolve_gemm_backend`).

    Shapes: ``forward(x: [N, n_input_dims] float) -> [N, n_output_dims]`` in the last layer's
    compute dtype (the autocast dtype with autocast; f16 for tcnn). The caller casts to f32 where
    it needs to.
    """

    def __init__(
        self,
        n_input_dims: int,
        n_output_dims: int,
        n_hidden_layers: int,
        n_neurons: int,
        policy: PrecisionPolicy | str | Mapping[str, Any] = "f32",
        bias: bool = False,
        activation: str = "ReLU",
        fp8_gemm: str = "auto",
    ):
        super().__init__()
        for arg, value in (
            ("n_input_dims", n_input_dims),
            ("n_output_dims", n_output_dims),
            ("n_hidden_layers", n_hidden_layers),
            ("n_neurons", n_neurons),
        ):
            if not is_int(value) or value < 1:
                raise ValueError(f"{arg}: expected a positive integer, got {value!r}")
        n_input_dims, n_output_dims = int(n_input_dims), int(n_output_dims)
        n_hidden_layers, n_neurons = int(n_hidden_layers), int(n_neurons)
        if activation not in _ACTIVATIONS:
            raise ValueError(
                f"activation: expected one of {sorted(_ACTIVATIONS)}, got {activation!r}"
            )
        _check_fp8_gemm(fp8_gemm)
        self.policy = PrecisionPolicy.from_config(policy)
        self.n_input_dims, self.n_output_dims = n_input_dims, n_output_dims
        self.n_hidden_layers, self.n_neurons = n_hidden_layers, n_neurons

        self.layers: list[CastLinear] = []
        if self.policy.mlp == "fused":
            if bias:
                raise ValueError(
                    f"bias: policy {self.policy.name!r} runs tcnn's fully fused network, which "
                    "has no biases; bias=True needs a linear MLP"
                )
            self.policy.check_available()
            self.net = FullyFusedMLP(
                n_input_dims,
                n_output_dims,
                {
                    "otype": "FullyFusedMLP",
                    "activation": activation,
                    "output_activation": "None",
                    "n_neurons": n_neurons,
                    "n_hidden_layers": n_hidden_layers,
                },
                backend=self.policy.mlp_backend,
                accumulate=self.policy.fused_accumulate,
                split_k=self.policy.fused_split_k,
                loss_scale=self.policy.fused_loss_scale,
            )
            return

        dims = [n_input_dims] + [n_neurons] * n_hidden_layers + [n_output_dims]
        dtypes = self.policy.layer_dtypes(len(dims) - 1)
        layer_class, layer_kwargs = _linear_class(self.policy, fp8_gemm)
        modules: list[nn.Module] = []
        for i, dtype in enumerate(dtypes):
            if i > 0:
                modules.append(_ACTIVATIONS[activation]())
            modules.append(
                layer_class(
                    dims[i],
                    dims[i + 1],
                    bias=bias,
                    compute_dtype=None if self.policy.autocast else dtype,
                    **layer_kwargs,
                )
            )
        self.net = nn.Sequential(*modules)
        self.layers = [m for m in self.net if isinstance(m, CastLinear)]
        for layer in self.layers:
            nn.init.kaiming_uniform_(layer.weight, nonlinearity="relu")
            if layer.bias is not None:
                nn.init.zeros_(layer.bias)
        if not self.policy.master_weights:
            # Initialise in f32, then round once: f16_naive starts from the same weights as the
            # others.
            self.net.to(dtypes[0])

    def resolved_backend(self) -> str:
        """What computes the MLP next: ``"torch"`` (linear layers or the fused twin) or
        ``"tcnn"`` (tinycudann's fused network)."""
        return self.net.resolved_backend() if self.policy.mlp == "fused" else "torch"

    def set_fp8_gemm(self, backend: str) -> None:
        """Run the FP8 layers' GEMMs on ``backend`` from now on (``fp8_gemm`` of the
        constructor); nothing to do without FP8 layers."""
        _check_fp8_gemm(backend)
        for layer in self.modules():
            if isinstance(layer, FP8Linear):
                layer.gemm_backend = backend

    def fp8_gemm_backend(self) -> str | None:
        """How the FP8 layers' GEMMs run next, resolved from the parameters' device and the
        recipe (:func:`mptex.fp8.resolve_gemm_backend`): ``"scaled_mm"`` (FP8 tensor cores),
        ``"emulated"`` or ``"triton"``; None without FP8 layers. ``ValueError`` where the
        backend asked for cannot run there."""
        layer = next((m for m in self.modules() if isinstance(m, FP8Linear)), None)
        if layer is None:
            return None
        rowwise = layer.recipe.recipe == "rowwise"
        return resolve_gemm_backend(layer.gemm_backend, layer.weight.device, rowwise=rowwise)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim != 2 or x.shape[1] != self.n_input_dims:
            raise ValueError(f"x: expected shape [N, {self.n_input_dims}], got {list(x.shape)}")
        if self.policy.mlp == "fused":
            return self.net(x)
        if self.policy.loss_scaling == "nvdiffrec":
            # nvdiffrec feeds enc.float() and scales the gradient w.r.t. that f32 input by 128,
            # so the f16 encoder backward receives 128 x its true gradient (rounded in f16).
            x = scale_grad(
                x.to(self.layers[0].working_dtype or x.dtype), self.policy.static_loss_scale
            )
        ctx = (
            torch.autocast(x.device.type, dtype=self.policy.mlp_dtypes[0])
            if self.policy.autocast
            else contextlib.nullcontext()
        )
        with ctx:
            return self.net(x)
