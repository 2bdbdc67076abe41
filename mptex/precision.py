"""Precision policies: the dtype each part of the texture computes in, and how gradients are scaled.

A :class:`PrecisionPolicy` is a frozen description (buildable from a dict or a Hydra config);
:class:`PrecisionStepper` is the stateful part that a training loop calls once per iteration to
run backward, unscale, check for overflow, step the optimizer (or skip) and update the loss scale.

Named arms (``PrecisionPolicy.named(name)``, one YAML file each under ``configs/precision/``):

============  =========  =====================  =======  ============  ===================
arm           encoder    MLP math               masters  loss scaling  notes
============  =========  =====================  =======  ============  ===================
nvdiffrec     f16        f32 (``enc.float()``)  f32      nvdiffrec     x128 / /128 hooks
f32           f32        f32                    f32      none
f16_naive     f16        f16                    none     none          f16 params, f16 Adam
f16_static    f16        f16                    f32      static 128    tcnn's constant
f16_dynamic   f16        f16                    f32      dynamic       GradScaler
amp           f16        autocast f16           f32      dynamic       torch.autocast
bf16          f32        bf16                   f32      none          tcnn has no bf16 grid
bf16_grid     bf16       bf16                   f32      none          torch or Triton grid
per_layer     f16        f16, f16, f32          f32      dynamic       explicit casts
tcnn_fused    f16        FullyFusedMLP f16      f32      tcnn (x128)   tcnn on CUDA, else twin
============  =========  =====================  =======  ============  ===================

Arms for nvdiffrec issue #154 (the fused network in place of nvdiffrec's f32 ``_MLP``), each
differing from ``tcnn_fused`` in one thing (the switches exist in the torch twin only):

======================  ====================================================================
arm                     differs from ``tcnn_fused`` by
======================  ====================================================================
tcnn_fused_swap154      nvdiffrec's encoder /128 hook kept (``encoder_hook``): the swap as #154
                        made it (the x128 hook sat on ``_MLP`` and left with it)
tcnn_fused_dynamic      an outer dynamic loss scale (GradScaler) on top of tcnn's 128
tcnn_fused_f32acc       float32 instead of half accumulators (``fused_accumulate: float``)
tcnn_fused_nosplitk     no split-K in the weight gradients (``fused_split_k: false``)
tcnn_fused_scale1024    static scale 1024 instead of 128 (``fused_loss_scale``)
nvdiffrec_scale1        (from ``nvdiffrec``) its x128 / /128 hooks with scale 1: the grid's
                        gradients without nvdiffrec's x128, the f32 MLP kept
======================  ====================================================================

Arms below f16 (:mod:`mptex.fp8`, :mod:`mptex.quantize`; f32 master weights throughout):

================  =========  ========================================  ============  ==============
arm               encoder    MLP GEMMs                                 loss scaling  weights seen
================  =========  ========================================  ============  ==============
fp8               f16        FP8: E4M3 inputs/weights, E5M2 gradients  nvdiffrec     E4M3
                             per-tensor, delayed scaling (TE defaults)
fp8_current       f16        FP8 as ``fp8``, current scaling           nvdiffrec     E4M3
fp8_rowwise       f16        FP8 as ``fp8``, one current scale per     nvdiffrec     E4M3
                             row/channel of each GEMM operand
int8_qat          f32        f32                                       none          int8 (fake)
fp8_qat           f32        f32                                       none          E4M3 (fake)
fp8_rowwise_qat   f32        f32, layer inputs E4M3 per row (fake)     none          E4M3 per
                                                                                     channel (fake)
================  =========  ========================================  ============  ==============

``fp8`` and ``fp8_current`` are ``nvdiffrec`` with the MLP's GEMMs in FP8 (``fp8_gemm``):
``torch._scaled_mm`` on CUDA devices with FP8 tensor cores, an emulation with the same casts
elsewhere. The QAT arms train for an int8 or FP8 decoder: the forward sees the weights
fake-quantised (``weight_quant``: int8 per output channel, FP8 per tensor), the gradient
passes straight through to the f32 master weights. ``fp8_rowwise`` scales every GEMM operand
per row or channel (:mod:`mptex.fp8`, *Row-wise scaling*) instead of per tensor, and
``fp8_rowwise_qat`` trains for a decoder that runs so: its forward sees the weights E4M3 per
output channel and each layer's inputs E4M3 per row (sample), both straight through.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mptex.config_schema import (
    Integer,
    Number,
    OneOf,
    Text,
    check_fields,
    check_keys,
    plain,
    setting,
)
from mptex.fp8 import AMAX_COMPUTE_ALGOS, RECIPES
from mptex.quantize import WEIGHT_QUANT

__all__ = [
    "PrecisionPolicy",
    "PrecisionStepper",
    "StepResult",
    "PendingStep",
    "LOSS_SCALING_MODES",
    "parse_dtype",
    "dtype_name",
    "scale_grad",
    "all_finite",
    "optimizer_state_tensors",
    "grid_gradient_factor",
]

LOSS_SCALING_MODES = ("none", "static", "dynamic", "nvdiffrec", "tcnn")
_MLP_KINDS = ("linear", "fused")
_MLP_BACKENDS = ("torch", "tcnn", "auto")
_ACCUMULATE = ("half", "float")
# A loss scale: > 0 and a float32 number (a larger one cannot multiply the float32 loss: torch
# refuses it, "value cannot be converted to type float without overflow").
_SCALE = Number(0, float(torch.finfo(torch.float32).max), min_open=True, note="a float32 factor")

_DTYPE_ALIASES = {
    "f32": torch.float32,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "f16": torch.float16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}
_DTYPE_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def parse_dtype(value: str | torch.dtype, field: str = "dtype") -> torch.dtype:
    """The ``torch.dtype`` for ``value``: ``"f16"``/``"float16"``/``"half"``, ``"bf16"``,
    ``"f32"``/``"float32"``, or one of those dtypes; ``ValueError`` naming ``field`` otherwise."""
    if isinstance(value, torch.dtype):
        if value in _DTYPE_NAMES:
            return value
    elif isinstance(value, str) and value.lower() in _DTYPE_ALIASES:
        return _DTYPE_ALIASES[value.lower()]
    raise ValueError(
        f"{field}: expected one of {sorted(_DTYPE_ALIASES)} (or torch.float16/bfloat16/float32), "
        f"got {value!r}"
    )


def dtype_name(dtype: torch.dtype) -> str:
    """Short config name of a supported dtype: ``"f32"``, ``"f16"`` or ``"bf16"``."""
    return _DTYPE_NAMES[dtype]


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_out):
        return grad_out * ctx.factor, None


def scale_grad(x: torch.Tensor, factor: float) -> torch.Tensor:
    """Identity in the forward pass; multiplies the gradient flowing back through it by ``factor``.

    This is nvdiffrec's gradient scaling written as an autograd function instead of a full backward
    hook: it does the same arithmetic (``grad * factor`` in the gradient's dtype) and, unlike the
    hook, does nothing at all when ``x`` does not require grad (nvdiffrec's hook divides ``None``).
    """
    if not x.requires_grad:
        return x
    return _ScaleGrad.apply(x, factor)


def grid_gradient_factor(loss_scaling: str, static_loss_scale: float) -> float:
    """The factor the hash grid's own gradient still carries when the optimizer reads it.

    nvdiffrec's hook multiplies the gradient flowing from its MLP into the encoder by
    ``static_loss_scale`` (128) and divides back only the positions' gradient, never the
    table's: under ``loss_scaling="nvdiffrec"`` Adam reads the grid's gradient x
    ``static_loss_scale``. Every other scheme divides its scale back before the step
    (GradScaler's unscale; tcnn's bindings divide ``input_grad`` by their scale): factor 1.

    Adam is invariant to a constant factor on a gradient except through epsilon, so the grid's
    *effective* epsilon is ``adam_eps / factor``: two arms whose factors differ also differ in
    how much epsilon damps the grid's small steps (docs/archive/adam-epsilon.md: on the
    real-asset torus that alone is +0.29 dB). The report names it under a comparison.

    Args:
        loss_scaling: the policy's ``loss_scaling`` (:data:`LOSS_SCALING_MODES`).
        static_loss_scale: the policy's ``static_loss_scale``.
    """
    return float(static_loss_scale) if loss_scaling == "nvdiffrec" else 1.0


@dataclass(frozen=True)
class PrecisionPolicy:
    """Where the texture computes in which dtype, and how its gradients are kept representable.

    Args:
        name: arm name, used in reports (``"f16_dynamic"``, or anything for a custom policy).
        encoder_dtype: hash-grid compute/output dtype, ``f32``, ``f16`` (tcnn's half mode: f32
            master table, f16 output) or ``bf16`` (mptex's bfloat16 mode of the torch grid,
            which tcnn does not have: f32 master table, bf16 table reads, bf16 output; see
            :class:`~mptex.HashGridEncoding`).
        mlp_dtypes: the MLP's compute dtype, one for all layers (a single dtype or a 1-list) or one
            per ``torch.nn.Linear`` layer, input layer first (``per_layer``). With ``autocast``
            it is the autocast dtype and must be a single dtype.
        master_weights: keep the MLP's parameters in f32 and cast a copy to the compute dtype inside
            ``forward`` (gradients reach the f32 master as f32, as in tcnn's bindings). ``False``
            stores the parameters themselves in the (single) compute dtype: ``f16_naive``.
        loss_scaling: ``"none"``; ``"static"`` (fixed ``static_loss_scale``, skip steps with inf/NaN
            gradients); ``"dynamic"`` (``torch.amp.GradScaler``); ``"nvdiffrec"`` (no loss scaling,
            but the MLP's input gradient is multiplied by ``static_loss_scale`` and the encoder's
            input gradient divided by it, as nvdiffrec's backward hooks do); ``"tcnn"`` (no outer
            scale: the fused network scales by ``fused_loss_scale`` inside; only with
            ``mlp="fused"``, which also allows ``"static"``/``"dynamic"`` on top).
        static_loss_scale: the fixed factor of ``"static"`` and ``"nvdiffrec"`` (default 128,
            tcnn's).
        init_scale, growth_factor, backoff_factor, growth_interval: ``"dynamic"``'s GradScaler
            arguments (defaults 2**16, 2.0, 0.5, 2000: GradScaler's).
        autocast: run the MLP under ``torch.autocast(device, dtype=mlp_dtypes[0])`` with f32 layers.
        mlp: ``"linear"`` (:class:`~mptex.PrecisionMLP`'s ``torch.nn.Linear`` layers) or
            ``"fused"`` (:class:`~mptex.FullyFusedMLP`, tcnn's all-f16 network).
        mlp_backend: the fused network's backend: ``"auto"`` (tinycudann on CUDA where
            importable, the torch twin elsewhere), ``"torch"`` or ``"tcnn"``; ``"torch"`` for
            ``mlp="linear"``.
        fused_loss_scale: the fused network's static internal loss scale (tcnn: 128).
        fused_accumulate: ``"half"`` (tcnn) or ``"float"`` accumulators (twin only).
        fused_split_k: split the weight-gradient sums every 4096 samples (tcnn) (twin only).
        encoder_hook: divide the gradient w.r.t. the encoder's input positions by
            ``static_loss_scale`` (nvdiffrec's encoder hook) without the MLP's x128 hook: what
            the swap of nvdiffrec #154 left in place. Implied by ``loss_scaling="nvdiffrec"``.
        fp8_gemm: the linear layers' GEMMs in FP8 (:func:`mptex.fp8.fp8_linear`: inputs and
            weights E4M3, output gradients E5M2, per-tensor scales, f32 accumulation, f32
            output); needs ``mlp_dtypes [f32]`` (the values between the GEMMs) and f32 masters.
        fp8_recipe: ``"delayed"`` (an amax history: Transformer Engine's ``DelayedScaling``),
            ``"current"`` (each tensor's own amax) or ``"rowwise"`` (each row's or channel's own
            amax, :func:`mptex.fp8.scaled_mm_rowwise`).
        fp8_margin: ``scale = fp8_max / amax / 2**fp8_margin`` (Transformer Engine: 0).
        fp8_amax_history_len: the delayed recipe's history length (Transformer Engine: 1024).
        fp8_amax_compute_algo: ``"max"`` of the history (Transformer Engine) or
            ``"most_recent"``.
        weight_quant: ``"none"``, or quantisation-aware training for an ``"int8"`` (per output
            channel, symmetric), ``"fp8"`` (E4M3, per tensor) or ``"fp8_rowwise"`` (E4M3 per
            output channel, and the layer inputs E4M3 per row) decoder: the forward uses the
            fake-quantised weights (:func:`mptex.quantize.fake_quantize`), the gradient reaches
            the f32 masters straight through.

    Raises:
        ValueError: naming the field, for an unknown dtype or mode, a bad number, or a combination
            that cannot train (e.g. loss scaling with f16 parameters: GradScaler refuses to unscale
            f16 gradients).
    """

    name: str = setting("custom", Text(non_empty=True, note="the arm's name in reports"))
    encoder_dtype: torch.dtype = torch.float32
    mlp_dtypes: tuple[torch.dtype, ...] = (torch.float32,)
    master_weights: bool = True
    loss_scaling: str = setting("none", OneOf(LOSS_SCALING_MODES))
    static_loss_scale: float = setting(128.0, _SCALE)
    init_scale: float = setting(2.0**16, _SCALE)
    growth_factor: float = setting(2.0, Number(min=1, min_open=True, note="GradScaler's rule"))
    backoff_factor: float = setting(0.5, Number(0, 1, min_open=True, max_open=True))
    growth_interval: int = setting(2000, Integer(min=1))
    autocast: bool = False
    mlp_backend: str = setting("torch", OneOf(_MLP_BACKENDS))
    mlp: str = setting("linear", OneOf(_MLP_KINDS))
    fused_loss_scale: float = setting(128.0, _SCALE)
    fused_accumulate: str = setting("half", OneOf(_ACCUMULATE))
    fused_split_k: bool = True
    encoder_hook: bool = False
    fp8_gemm: bool = False
    fp8_recipe: str = setting("delayed", OneOf(RECIPES))
    fp8_margin: int = setting(0, Integer(min=0, max=64))
    fp8_amax_history_len: int = setting(1024, Integer(min=1))
    fp8_amax_compute_algo: str = setting("max", OneOf(AMAX_COMPUTE_ALGOS))
    weight_quant: str = setting("none", OneOf(WEIGHT_QUANT))

    def __post_init__(self) -> None:
        # Normalise user-friendly spellings (strings, single dtype) once, so the fields are typed.
        set_ = object.__setattr__
        set_(self, "encoder_dtype", parse_dtype(self.encoder_dtype, "encoder_dtype"))
        dtypes = self.mlp_dtypes
        if isinstance(dtypes, (str, torch.dtype)):
            dtypes = (dtypes,)
        if not isinstance(dtypes, Sequence) or len(dtypes) == 0:
            raise ValueError(
                f"mlp_dtypes: expected a dtype or a non-empty list of dtypes, got {dtypes!r}"
            )
        set_(self, "mlp_dtypes", tuple(parse_dtype(d, "mlp_dtypes") for d in dtypes))
        self._validate()

    def _validate(self) -> None:
        # Each field's value first: a YAML ``no`` given as a string, or ``init_scale=big``, must
        # not reach the rules below (a non-empty string is true; float("big") names no field).
        check_fields(self)
        if not self.master_weights:
            if len(self.mlp_dtypes) != 1:
                raise ValueError(
                    "master_weights: False needs a single mlp_dtypes (the parameters' dtype)"
                )
            if self.loss_scaling in ("static", "dynamic"):
                raise ValueError(
                    "master_weights: False cannot be combined with loss_scaling "
                    f"{self.loss_scaling!r}: GradScaler refuses to unscale non-f32 gradients "
                    "('Attempting to unscale FP16 gradients'); keep f32 master weights"
                )
            if self.autocast:
                raise ValueError(
                    "master_weights: autocast needs f32 parameters (master_weights: true)"
                )
        if self.autocast and len(self.mlp_dtypes) != 1:
            raise ValueError("mlp_dtypes: autocast takes a single dtype, got a per-layer list")
        self._validate_quantized()
        if self.mlp == "linear":
            if self.mlp_backend != "torch":
                raise ValueError(
                    f"mlp_backend: {self.mlp_backend!r} is for mlp 'fused'; the linear MLP is "
                    "torch only"
                )
            if self.loss_scaling == "tcnn":
                raise ValueError("loss_scaling: 'tcnn' goes with mlp 'fused' (tcnn's network)")
        else:
            if self.loss_scaling not in ("tcnn", "static", "dynamic"):
                raise ValueError(
                    "loss_scaling: the fused network scales inside ('tcnn'), optionally under "
                    f"an outer 'static' or 'dynamic' scale; got {self.loss_scaling!r}"
                )
            if self.mlp_dtypes != (torch.float16,) or not self.master_weights or self.autocast:
                raise ValueError(
                    "mlp_dtypes: tcnn's FullyFusedMLP computes in f16 on f32 masters "
                    "(mlp_dtypes [f16], master_weights true, autocast false)"
                )
            twin_only = self.fused_accumulate != "half" or not self.fused_split_k
            if twin_only and self.mlp_backend == "tcnn":
                raise ValueError(
                    "mlp_backend: fused_accumulate/fused_split_k switches exist only in the "
                    "torch twin; use mlp_backend 'torch' or 'auto'"
                )

    def _validate_quantized(self) -> None:
        if not self.quantized:
            return
        field = "fp8_gemm" if self.fp8_gemm else "weight_quant"
        if self.mlp != "linear" or not self.master_weights or self.autocast:
            raise ValueError(
                f"{field}: needs the linear MLP on f32 master weights without autocast (mlp "
                "'linear', master_weights true, autocast false)"
            )
        if self.fp8_gemm and self.weight_quant != "none":
            raise ValueError(
                "weight_quant: fp8_gemm already rounds the weights to E4M3 in every GEMM; "
                "use one of them"
            )
        if self.fp8_gemm and set(self.mlp_dtypes) != {torch.float32}:
            names = [dtype_name(d) for d in self.mlp_dtypes]
            raise ValueError(
                "mlp_dtypes: fp8_gemm's GEMMs take FP8 operands and return f32, so the values "
                f"between them are f32 (mlp_dtypes [f32]), got {names}"
            )

    # ------------------------------------------------------------------ construction
    @classmethod
    def named(cls, name: str) -> PrecisionPolicy:
        """The registered arm ``name`` (module docstring); ``ValueError`` listing the names."""
        if name not in _ARMS:
            raise ValueError(f"name: unknown precision arm {name!r}; known arms: {sorted(_ARMS)}")
        return _ARMS[name]

    @classmethod
    def names(cls) -> list[str]:
        """Names of the registered arms, in the module docstring's order."""
        return list(_ARMS)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any] | PrecisionPolicy | str) -> PrecisionPolicy:
        """Build a policy from a dict or an OmegaConf/Hydra ``DictConfig``.

        A :class:`PrecisionPolicy` is returned as is and a string is an arm name. Keys are the
        field names. When ``cfg["name"]`` is a registered arm, unspecified fields take that
        arm's values, so ``{"name": "f16_dynamic", "growth_interval": 100}`` is f16_dynamic with a
        shorter interval; otherwise they take the dataclass defaults. Unknown keys raise
        ``ValueError``, and so does an unregistered name close to a registered one (a typo)
        when fields are left unspecified: they would silently be f32's.
        """
        if isinstance(cfg, PrecisionPolicy):
            return cfg
        if isinstance(cfg, str):
            return cls.named(cfg)
        if not isinstance(cfg, Mapping):
            raise ValueError(
                f"precision: expected an arm name, a mapping or a PrecisionPolicy, got {cfg!r}"
            )
        cfg = plain(cfg)
        check_keys(cls, cfg)
        name = cfg.get("name")
        # (a list or a mapping is no arm, and no key of _ARMS: the field's check names it)
        registered = isinstance(name, str) and name in _ARMS
        if not registered and len(cfg) < len(dataclasses.fields(cls)):
            # A typo keeps the length within one letter and is no extension of the arm's name
            # (f16_dyanmic); a variant's own name (f16_dynamic_100, bf16_nogrid) is neither.
            close = [
                arm
                for arm in difflib.get_close_matches(str(name), list(_ARMS), n=1, cutoff=0.8)
                if abs(len(arm) - len(str(name))) <= 1 and not str(name).startswith(arm)
            ]
            if close:
                raise ValueError(
                    f"name: {name!r} is not a registered arm (did you mean {close[0]!r}?); a "
                    "policy of its own under a new name gives every field"
                )
        base = _ARMS[name] if registered else cls()
        return dataclasses.replace(base, **cfg)

    def to_config(self) -> dict[str, Any]:
        """Plain dict (dtypes as ``"f16"``-style strings) that :meth:`from_config` reads back."""
        out = dataclasses.asdict(self)
        out["encoder_dtype"] = dtype_name(self.encoder_dtype)
        out["mlp_dtypes"] = [dtype_name(d) for d in self.mlp_dtypes]
        return out

    # ------------------------------------------------------------------ queries
    @property
    def quantized(self) -> bool:
        """Whether the MLP rounds below its dtypes: FP8 GEMMs or fake-quantised weights."""
        return self.fp8_gemm or self.weight_quant != "none"

    @property
    def grid_grad_factor(self) -> float:
        """:func:`grid_gradient_factor` of this policy (128 for ``nvdiffrec``, else 1)."""
        return grid_gradient_factor(self.loss_scaling, self.static_loss_scale)

    def layer_dtypes(self, n_layers: int) -> list[torch.dtype]:
        """Compute dtype of each of ``n_layers`` linear layers (a single dtype is broadcast)."""
        if len(self.mlp_dtypes) == 1:
            return list(self.mlp_dtypes) * n_layers
        if len(self.mlp_dtypes) != n_layers:
            raise ValueError(
                f"mlp_dtypes: policy {self.name!r} lists {len(self.mlp_dtypes)} dtypes but the MLP "
                f"has {n_layers} linear layers (n_hidden_layers + 1)"
            )
        return list(self.mlp_dtypes)

    def availability(self) -> tuple[bool, str]:
        """``(True, "")`` when this policy can run here, else ``(False, reason)``; never raises.

        The reason names the key that asked for what is missing (``precision.mlp_backend``),
        why it is missing, and that the arm itself runs on the CPU with the torch twin.
        """
        if self.mlp_backend == "tcnn":  # "auto" falls back to the torch twin
            from mptex._backends import unavailable_message

            instead = f"the arm {self.name} runs on the CPU with mlp_backend='torch'"
            why = unavailable_message("tcnn", "precision.mlp_backend", instead)
            if why is not None:
                return False, why
        return True, ""

    def check_available(self) -> None:
        """Raise ``RuntimeError`` at start when this policy cannot run on this machine."""
        ok, why = self.availability()
        if not ok:
            raise RuntimeError(why)

    def stepper(self, optimizer: torch.optim.Optimizer) -> PrecisionStepper:
        """Shorthand for ``PrecisionStepper(self, optimizer)``."""
        return PrecisionStepper(self, optimizer)


_f16, _f32, _bf16 = torch.float16, torch.float32, torch.bfloat16
_ARMS: dict[str, PrecisionPolicy] = {
    p.name: p
    for p in (
        PrecisionPolicy("nvdiffrec", _f16, (_f32,), loss_scaling="nvdiffrec"),
        PrecisionPolicy("f32", _f32, (_f32,)),
        PrecisionPolicy("f16_naive", _f16, (_f16,), master_weights=False),
        PrecisionPolicy("f16_static", _f16, (_f16,), loss_scaling="static"),
        PrecisionPolicy("f16_dynamic", _f16, (_f16,), loss_scaling="dynamic"),
        PrecisionPolicy("amp", _f16, (_f16,), loss_scaling="dynamic", autocast=True),
        PrecisionPolicy("bf16", _f32, (_bf16,)),
        PrecisionPolicy("per_layer", _f16, (_f16, _f16, _f32), loss_scaling="dynamic"),
        PrecisionPolicy(
            "tcnn_fused", _f16, (_f16,), loss_scaling="tcnn", mlp="fused", mlp_backend="auto"
        ),
    )
}
_FUSED = _ARMS["tcnn_fused"]
for _arm in (
    dataclasses.replace(_FUSED, name="tcnn_fused_swap154", encoder_hook=True),
    dataclasses.replace(_FUSED, name="tcnn_fused_dynamic", loss_scaling="dynamic"),
    dataclasses.replace(_FUSED, name="tcnn_fused_f32acc", fused_accumulate="float"),
    dataclasses.replace(_FUSED, name="tcnn_fused_nosplitk", fused_split_k=False),
    dataclasses.replace(_FUSED, name="tcnn_fused_scale1024", fused_loss_scale=1024.0),
    dataclasses.replace(_ARMS["nvdiffrec"], name="nvdiffrec_scale1", static_loss_scale=1.0),
    dataclasses.replace(_ARMS["nvdiffrec"], name="fp8", fp8_gemm=True),
    dataclasses.replace(
        _ARMS["nvdiffrec"], name="fp8_current", fp8_gemm=True, fp8_recipe="current"
    ),  # fmt: skip
    dataclasses.replace(
        _ARMS["nvdiffrec"], name="fp8_rowwise", fp8_gemm=True, fp8_recipe="rowwise"
    ),  # fmt: skip
    PrecisionPolicy("int8_qat", _f32, (_f32,), weight_quant="int8"),
    PrecisionPolicy("fp8_qat", _f32, (_f32,), weight_quant="fp8"),
    PrecisionPolicy("fp8_rowwise_qat", _f32, (_f32,), weight_quant="fp8_rowwise"),
    PrecisionPolicy("bf16_grid", _bf16, (_bf16,)),
):
    _ARMS[_arm.name] = _arm


def all_finite(tensors: Sequence[torch.Tensor | None]) -> bool:
    """Whether every element of every tensor is finite (``None`` entries are ignored).

    One fused reduction (``torch._foreach_norm`` with ``ord=inf``: the largest magnitude per
    tensor, which is NaN or inf exactly when the tensor holds one and, unlike the 2-norm, never
    overflows for finite values) and one read of the result, i.e. one CPU-device sync.
    """
    present = [t for t in tensors if t is not None and t.numel()]
    if not present:
        return True
    norms = torch._foreach_norm(present, float("inf"))
    return bool(torch.isfinite(torch.stack([n.float() for n in norms])).all())


def optimizer_state_tensors(state: Mapping[Any, Mapping[str, Any]]) -> list[torch.Tensor]:
    """The floating-point tensors of an optimizer's per-parameter state but its ``step``
    counters: ``state`` is ``optimizer.state`` or ``optimizer.state_dict()["state"]`` (Adam's
    ``exp_avg`` and ``exp_avg_sq``). A counter counts steps, and outside a fused or capturable
    optimizer it sits on the CPU, where a check on the parameters' device cannot take it.

    They are checked beside the weights because a finite gradient can still make them inf:
    Adam's second moment adds ``(1 - beta2) g^2``, which overflows float16 from a gradient of
    about 8.1e3 (Adam in ``f16_naive``) and float32 from about 5.8e20 (torch 2.13's Adam at
    ``beta2 = 0.999``, measured), and a parameter whose ``exp_avg_sq`` is inf stops moving (its
    update is ``m / inf = 0``) while it stays finite.
    """
    return [value for per_param in state.values() for key, value in per_param.items()
            if key != "step" and torch.is_tensor(value) and value.is_floating_point()]  # fmt: skip


@dataclass(frozen=True)
class StepResult:
    """What one :meth:`PrecisionStepper.step` did.

    Attributes:
        skipped: ``optimizer.step()`` was not called because a gradient was inf/NaN.
        loss_scale: the loss scale after this step's update, i.e. the factor the next
            :meth:`PrecisionStepper.backward` multiplies the loss by (1.0 without loss scaling).
        diverged: the run cannot go on: a gradient was inf/NaN in an arm without loss scaling
            (no scale to back off; the step was skipped, parameters and optimizer state are
            untouched), or the step itself turned a parameter or Adam's state inf/NaN
            (``master_weights=False``: Adam's arithmetic in f16, whose ``eps = 1e-8`` rounds to
            0 and whose second moment overflows from a gradient of about 8.1e3). Loss-scaled arms
            never set it: their non-finite gradients are ordinary skipped steps.
    """

    skipped: bool
    loss_scale: float
    diverged: bool = False


@dataclass(frozen=True)
class PendingStep:
    """A step whose outcome is still on the device (:meth:`PrecisionStepper.step_async`).

    Attributes:
        flags: ``[n]`` float32 on the device: ``found_inf`` (> 0 when a checked value was
            inf/NaN), then the loss scale after the update (loss-scaled arms), then whether a
            parameter is non-finite after the step (``master_weights=False`` with the step
            decided on the device).
        host_decides: the optimizer step waits for the host's read of ``flags``
            (:meth:`PrecisionStepper.finish` takes it); otherwise it was already taken, or
            skipped, on the device.
    """

    flags: torch.Tensor
    host_decides: bool


@functools.lru_cache(maxsize=8)
def _one(device: torch.device) -> torch.Tensor:
    """A ``[1]`` float32 1.0 on ``device``, made once (GradScaler's unscale factor argument;
    the kernel only reads it)."""
    return torch.ones(1, dtype=torch.float32, device=device)


def _non_finite_flag(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``[1]`` float32 on ``device``: 1.0 when any element of ``tensors`` is inf/NaN, else 0.

    ``torch._amp_foreach_non_finite_check_and_unscale_`` with the factor 1.0: GradScaler's own
    check (one multi-tensor kernel per dtype on CUDA); ``x * 1.0`` is ``x`` bit for bit, so the
    tensors are unchanged, and nothing is read on the host. CUDA's kernel takes float32,
    float64 and float16 only (the CPU's takes bfloat16 too): other dtypes are checked on float32
    copies, which hold every bfloat16 value, inf and NaN included.
    """
    found = torch.zeros(1, dtype=torch.float32, device=device)
    one = _one(device)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for dtype, group in by_dtype.items():
        if dtype not in _AMP_CHECK_DTYPES:
            group = [t.float() for t in group]
        torch._amp_foreach_non_finite_check_and_unscale_(group, found, one)
    return found


# The dtypes CUDA's non-finite check dispatches (AT_DISPATCH_FLOATING_TYPES_AND_HALF).
_AMP_CHECK_DTYPES = (torch.float32, torch.float64, torch.float16)


class PrecisionStepper:
    """Backward, unscale, overflow check, optimizer step (or skip) and scale update for a policy.

    Call order in a training loop (the same as ``torch.amp.GradScaler``'s)::

        stepper = PrecisionStepper(policy, optimizer)    # or policy.stepper(optimizer)
        for it in range(n):
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(texture.sample(points), target)
            stepper.backward(loss)                        # loss * scale, then .backward()
            # optional: stepper.unscale_() to read true gradients (clipping, statistics)
            result = stepper.step()                       # StepResult(skipped, loss_scale)
            scheduler.step()

    ``stepper(loss)`` does ``backward`` then ``step(loss)`` in one call (``step(loss)`` checks
    the loss with the gradients in arms without loss scaling, as the training loop does).

    Algorithm per ``policy.loss_scaling``, every check on the device:
        * ``"dynamic"``: ``torch.amp.GradScaler(device, init_scale, growth_factor, backoff_factor,
          growth_interval)`` itself. ``backward`` = ``scaler.scale(loss).backward()``; ``step``:
          ``scaler.unscale_(optimizer)`` (divides the f32 master gradients in place and records
          whether any is inf/NaN, ``found_inf``), ``scaler.update()`` (scale x backoff_factor
          after a skipped step, x growth_factor after ``growth_interval`` clean steps in a row;
          it needs only ``found_inf``, so it runs before the optimizer), then
          ``optimizer.step()`` unless ``found_inf``: GradScaler's ``step`` and ``update``
          without GradScaler's host read of ``found_inf``.
        * ``"static"``: the same, but ``update(new_scale=static_loss_scale)`` pins the scale: the
          overflow check and the skip are GradScaler's, not reimplemented. (GradScaler alone
          cannot be static: it requires ``backoff_factor < 1``.)
        * ``"none"``, ``"nvdiffrec"``, ``"tcnn"``: ``loss.backward()``, then every gradient (and
          the loss, when :meth:`step_async` is given it) is checked with GradScaler's kernel at
          the factor 1 (:func:`_non_finite_flag`); only if all are finite ``optimizer.step()``,
          else the step is skipped and ``StepResult.diverged`` is set (nvdiffrec's and tcnn's
          fixed x128 happen inside the autograd graph, not on the loss). With
          ``master_weights=False`` the parameters and the optimizer's state are checked after
          the step as well: f16 Adam can turn finite gradients into NaN weights or an inf
          second moment (:func:`optimizer_state_tensors`).

    Where the skip is decided: an optimizer built with ``fused=True`` (the training loop's on
    CUDA) takes ``found_inf`` itself (``optimizer.found_inf``, as GradScaler hands it to fused
    optimizers) and skips on the device: its kernel leaves parameters and moments untouched and
    takes back its ``step`` increment. Any other optimizer is stepped, or not, by
    :meth:`finish` after the host has read ``found_inf``. Either way a skipped step leaves every
    parameter and all optimizer state (Adam's ``exp_avg``, ``exp_avg_sq``, ``step``)
    bit-identical, and gradients are not zeroed.

    Host reads: :meth:`step` reads the outcome once (one ``[n]`` tensor: ``found_inf``, the new
    scale, the parameters' finiteness). A training loop that reads other values each step too
    calls :meth:`step_async`, reads :attr:`PendingStep.flags` together with them in one copy, and
    passes them to :meth:`finish` (``mptex.train.loop.step`` does). ``master_weights=False`` with
    a host-decided step reads once more, after the step (the finiteness of the parameters and
    the optimizer's state).

    GradScaler refuses f16 gradients, which is why the scaled arms keep f32 master weights. The
    device is taken from the optimizer's first parameter.

    Args:
        policy: the precision policy (a :class:`PrecisionPolicy`, arm name or config mapping).
        optimizer: the optimizer over the texture's parameters.
    """

    def __init__(
        self, policy: PrecisionPolicy | str | Mapping[str, Any], optimizer: torch.optim.Optimizer
    ):
        self.policy = PrecisionPolicy.from_config(policy)
        self.optimizer = optimizer
        self.scaler: torch.amp.GradScaler | None = None
        if self.policy.loss_scaling in ("static", "dynamic"):
            params = [p for group in optimizer.param_groups for p in group["params"]]
            if not params:
                raise ValueError("optimizer: has no parameters")
            static = self.policy.loss_scaling == "static"
            self.scaler = torch.amp.GradScaler(
                params[0].device.type,
                init_scale=float(
                    self.policy.static_loss_scale if static else self.policy.init_scale
                ),
                growth_factor=float(self.policy.growth_factor),
                backoff_factor=float(self.policy.backoff_factor),
                growth_interval=int(self.policy.growth_interval),
            )

    @property
    def loss_scale(self) -> float:
        """The factor the next :meth:`backward` multiplies the loss by (1.0 without loss
        scaling)."""
        return 1.0 if self.scaler is None else float(self.scaler.get_scale())

    def backward(self, loss: torch.Tensor, **backward_kwargs: Any) -> None:
        """``(loss * loss_scale).backward(**backward_kwargs)``."""
        if self.scaler is None:
            loss.backward(**backward_kwargs)
        else:
            self.scaler.scale(loss).backward(**backward_kwargs)

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _stepped(self) -> list[torch.Tensor]:
        """What an optimizer step writes: the parameters and the optimizer's state."""
        params = [p.detach() for p in self._params()]
        return params + optimizer_state_tensors(self.optimizer.state)

    def _unscaled(self) -> bool:
        from torch.amp.grad_scaler import OptState

        state = self.scaler._per_optimizer_states[id(self.optimizer)]
        return state["stage"] is OptState.UNSCALED

    def unscale_(self) -> None:
        """Divide the gradients by the loss scale in place now (optional; :meth:`step` does it)."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)

    def _device_decides(self) -> bool:
        # Only torch's fused optimizers take found_inf (GradScaler's _step_supports_amp_scaling).
        return bool(self.optimizer.defaults.get("fused"))

    def step_async(self, loss: torch.Tensor | None = None) -> PendingStep:
        """Unscale, check and update the scale on the device, and step the optimizer when the
        skip can be decided there; nothing is read on the host.

        Args:
            loss: the iteration's (unscaled) loss, checked with the gradients in arms without
                loss scaling (a non-finite loss skips the step there even where the gradients
                are finite); not used by the loss-scaled arms (GradScaler checks gradients only).

        Returns:
            the :class:`PendingStep`; :meth:`finish` it with its ``flags`` read on the host.
        """
        params = self._params()
        device = params[0].device if params else torch.device("cpu")
        if self.scaler is not None:
            if not self._unscaled():
                self.scaler.unscale_(self.optimizer)
            per_device = list(self.scaler._found_inf_per_device(self.optimizer).values())
            found = sum(per_device[1:], per_device[0]).reshape(1)
            # update() needs only found_inf: the scale after it is known before the step.
            if self.policy.loss_scaling == "static":
                self.scaler.update(new_scale=float(self.policy.static_loss_scale))
            else:
                self.scaler.update()
            parts = [found, self.scaler._scale.reshape(1)]
        else:
            checked = [p.grad for p in params if p.grad is not None]
            if loss is not None:
                # Checked in place at the factor 1 (bits kept); backward is done with it.
                checked.append(loss.detach().float().reshape(1))
            found = _non_finite_flag(checked, device)
            parts = [found]
        if not self._device_decides():
            return PendingStep(torch.cat(parts) if len(parts) > 1 else found, host_decides=True)
        # 0-dim, as GradScaler hands it over (fused Adam subtracts it from its step counters).
        self.optimizer.found_inf, self.optimizer.grad_scale = found.reshape(()), None
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.found_inf, self.optimizer.grad_scale
        if self.scaler is None and not self.policy.master_weights:
            with torch.no_grad():  # x * 1.0 in place: the parameters keep their bits
                parts.append(_non_finite_flag(self._stepped(), device))
        return PendingStep(torch.cat(parts) if len(parts) > 1 else found, host_decides=False)

    def finish(self, pending: PendingStep, flags: Sequence[float]) -> StepResult:
        """The step's :class:`StepResult` from ``flags``, ``pending.flags`` read on the host;
        steps the optimizer first when the host decides (``pending.host_decides``) and no
        checked value was inf/NaN."""
        found = flags[0] > 0
        if self.scaler is not None:
            if pending.host_decides and not found:
                self.optimizer.step()
            return StepResult(skipped=found, loss_scale=float(flags[1]))
        if found:
            return StepResult(skipped=True, loss_scale=1.0, diverged=True)
        if pending.host_decides:
            self.optimizer.step()
            broken = not self.policy.master_weights and not all_finite(self._stepped())
        else:
            broken = not self.policy.master_weights and flags[1] > 0
        return StepResult(skipped=False, loss_scale=1.0, diverged=broken)

    def step(self, loss: torch.Tensor | None = None) -> StepResult:
        """Unscale, check, step or skip, update the scale; see the class docstring. One host
        read of the outcome. ``loss``: as :meth:`step_async`'s (checked with the gradients in
        arms without loss scaling)."""
        pending = self.step_async(loss)
        return self.finish(pending, pending.flags.detach().to("cpu").tolist())

    def __call__(self, loss: torch.Tensor) -> StepResult:
        """``backward(loss)`` then ``step(loss)``: in arms without loss scaling a non-finite
        loss skips the step even where every gradient is finite."""
        self.backward(loss)
        return self.step(loss)

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (scale, growth tracker) for checkpoints; empty without loss
        scaling."""
        return {} if self.scaler is None else self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
