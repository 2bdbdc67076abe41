"""The precision search space: every assignment of dtypes to the texture's parts, and which of them
are pruned before any training (with the reason).

A :class:`Candidate` names one assignment: the hash grid's dtype, each linear layer's compute
dtype (input layer first), whether the MLP keeps f32 master weights, the loss-scaling mode (and
its static factor), the network kind (``"linear"``: :class:`~mptex.PrecisionMLP`,
``"fused"``: tcnn's FullyFusedMLP) and its quantisation below f16 (``"fp8"``,
``"fp8_current"``, ``"fp8_rowwise"``: FP8 GEMMs with delayed, current or row-wise scaling;
``"int8_qat"``, ``"fp8_qat"``, ``"fp8_rowwise_qat"``: trained for an int8 / FP8 / row-wise FP8
decoder; f32 values between the layers in each).
:meth:`Candidate.policy` turns it into the :class:`~mptex.PrecisionPolicy` that ``mptex-train``
runs.

Pruning (:func:`enumerate_space`), in this order, each with its reason recorded:

1. ``invalid``: :class:`~mptex.PrecisionPolicy` refuses the combination (its ``ValueError``
   is the reason), e.g. loss scaling without f32 masters
   (GradScaler refuses f16 gradients), the fused network with a width tcnn does not build.
2. ``redundant``: it computes exactly what a kept candidate computes, at a cost the model cannot
   rank lower: ``master_weights: false`` with every layer in f32 (the parameters are f32 either
   way); a loss scale where no value is f16 (a power-of-two scale is exact in f32 and bf16, whose
   exponent range is f32's, and FP8 GEMMs scale each tensor by its own amax, which absorbs it,
   so the run is the unscaled one plus an unscale pass).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mptex.config_schema import Flag, ListOf, Number, OneOf, check_group, defaults_of, setting
from mptex.network import FUSED_WIDTHS, TCNN_LOSS_SCALE
from mptex.precision import PrecisionPolicy

__all__ = [
    "Candidate",
    "SpaceConfig",
    "SPACE_DEFAULTS",
    "QUANT_KINDS",
    "enumerate_space",
    "reference_candidate",
]


# The quantisation of a candidate's MLP: the PrecisionPolicy fields each one sets.
QUANT_KINDS = ("fp8", "fp8_current", "fp8_rowwise", "int8_qat", "fp8_qat", "fp8_rowwise_qat")
_QUANT_FIELDS = {
    "none": {},
    "fp8": {"fp8_gemm": True, "fp8_recipe": "delayed"},
    "fp8_current": {"fp8_gemm": True, "fp8_recipe": "current"},
    "fp8_rowwise": {"fp8_gemm": True, "fp8_recipe": "rowwise"},
    "int8_qat": {"weight_quant": "int8"},
    "fp8_qat": {"weight_quant": "fp8"},
    "fp8_rowwise_qat": {"weight_quant": "fp8_rowwise"},
}
_QUANT_TAGS = {"fp8": "fp8", "fp8_current": "fp8cur", "fp8_rowwise": "fp8row", "int8_qat": "qat8",
               "fp8_qat": "qatfp8", "fp8_rowwise_qat": "qatfp8row"}  # fmt: skip


def _values(allowed: list[str]) -> ListOf:
    return ListOf(OneOf(allowed), non_empty=True, unique=True)


@dataclass
class SpaceConfig:
    """The ``search.space`` group: what the search may vary, each key the values tried."""

    encoder_dtypes: list[str] = setting(["f16", "f32"], _values(["f16", "f32", "bf16"]))
    """The hash grid's dtypes (bf16: mptex's bfloat16 grid, torch and Triton; tcnn has none)."""
    layer_dtypes: list[str] = setting(["f32", "bf16", "f16"], _values(["f32", "bf16", "f16"]))
    """Each linear layer's compute dtypes."""
    master_weights: list[bool] = setting([True, False], ListOf(Flag(), non_empty=True, unique=True))
    """With and/or without f32 master weights."""
    loss_scaling: list[str] = setting(
        ["none", "static", "dynamic"], _values(["none", "static", "dynamic"])
    )
    """The loss-scaling modes."""
    static_loss_scale: float = setting(128.0, Number(min=0, min_open=True))
    """The static mode's factor (tcnn's constant)."""
    fused: bool = True
    """Also try tcnn's fully fused f16 network where the width allows."""
    quantized: list[str] = setting(list(QUANT_KINDS), ListOf(OneOf(QUANT_KINDS), unique=True))
    """Also try the MLP below f16, with each encoder dtype and loss-scaling mode: FP8 GEMMs
    (``fp8``: delayed scaling, ``fp8_current``, ``fp8_rowwise``) and QAT (``int8_qat``,
    ``fp8_qat``, ``fp8_rowwise_qat``); ``[]``: none."""


SPACE_DEFAULTS = defaults_of(SpaceConfig)

_LS_TAGS = {"none": "none", "dynamic": "dyn", "tcnn": "tcnn"}


@dataclass(frozen=True, order=True)
class Candidate:
    """One precision assignment.

    Args:
        encoder: the hash grid's dtype name (``"f16"`` / ``"f32"``).
        layers: one dtype name per linear layer, input layer first (``("f32",)`` for the
            fused network, whose single entry is its f16 compute dtype).
        master_weights: f32 master weights for the MLP.
        loss_scaling: ``"none"``, ``"static"``, ``"dynamic"`` or (fused) ``"tcnn"``.
        static_loss_scale: the factor of ``"static"``.
        mlp: ``"linear"`` or ``"fused"``.
        quant: ``"none"`` or one of :data:`QUANT_KINDS` (``layers`` then all ``"f32"``).
    """

    encoder: str
    layers: tuple[str, ...]
    master_weights: bool = True
    loss_scaling: str = "none"
    static_loss_scale: float = 128.0
    mlp: str = "linear"
    quant: str = "none"

    @property
    def name(self) -> str:
        """A short unique id, e.g. ``e16-f16.f16.f32-dyn``, ``e16-fused-tcnn``,
        ``e32-bf16.bf16.bf16-none-nomaster``, ``e16-fp8-dyn``, ``e32-qat8-none``."""
        body = "fused" if self.mlp == "fused" else ".".join(self.layers)
        if self.quant != "none":
            body = _QUANT_TAGS[self.quant]
        if self.loss_scaling == "static":
            scale = self.static_loss_scale
            tag = f"s{int(scale)}" if float(scale).is_integer() else f"s{scale:g}"
        else:
            tag = _LS_TAGS[self.loss_scaling]
        enc = {"f16": "e16", "f32": "e32"}.get(self.encoder, "e" + self.encoder)
        name = f"{enc}-{body}-{tag}"
        return name if self.master_weights else name + "-nomaster"

    def has_f16(self) -> bool:
        """Whether any value the run computes in is f16 (the encoder or a layer). FP8 GEMMs
        scale each tensor by its own amax, which absorbs a power-of-two loss scale exactly."""
        return self.encoder == "f16" or "f16" in self.layers or self.mlp == "fused"

    def policy_dict(self, name: str | None = None) -> dict[str, Any]:
        """The ``precision`` config group of this candidate (every PrecisionPolicy field)."""
        fused = self.mlp == "fused"
        # One dtype for every layer is written as one entry: the form f16_naive's f16
        # parameters (master_weights false) need, and the same policy otherwise.
        uniform = fused or len(set(self.layers)) == 1
        return {
            "name": name or self.name,
            "encoder_dtype": self.encoder,
            "mlp_dtypes": ["f16"] if fused else list(self.layers[:1] if uniform else self.layers),
            "master_weights": self.master_weights,
            "loss_scaling": self.loss_scaling,
            "static_loss_scale": float(self.static_loss_scale),
            "init_scale": 65536.0,
            "growth_factor": 2.0,
            "backoff_factor": 0.5,
            "growth_interval": 2000,
            "autocast": False,
            "mlp_backend": "auto" if fused else "torch",
            "mlp": self.mlp,
            "fused_loss_scale": TCNN_LOSS_SCALE,
            "fused_accumulate": "half",
            "fused_split_k": True,
            "encoder_hook": False,
            "fp8_gemm": False,
            "fp8_recipe": "delayed",
            "fp8_margin": 0,
            "fp8_amax_history_len": 1024,
            "fp8_amax_compute_algo": "max",
            "weight_quant": "none",
            **_QUANT_FIELDS[self.quant],
        }

    def policy(self) -> PrecisionPolicy:
        """The :class:`~mptex.PrecisionPolicy` (``ValueError`` if the combination is invalid)."""
        return PrecisionPolicy.from_config(self.policy_dict())

    def to_json(self) -> dict[str, Any]:
        return {
            "encoder": self.encoder,
            "layers": list(self.layers),
            "master_weights": self.master_weights,
            "loss_scaling": self.loss_scaling,
            "static_loss_scale": float(self.static_loss_scale),
            "mlp": self.mlp,
            "quant": self.quant,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Candidate:
        return cls(
            encoder=data["encoder"],
            layers=tuple(data["layers"]),
            master_weights=bool(data["master_weights"]),
            loss_scaling=data["loss_scaling"],
            static_loss_scale=float(data["static_loss_scale"]),
            mlp=data["mlp"],
            quant=data.get("quant", "none"),  # search.json files from before the key
        )


def reference_candidate(n_layers: int) -> Candidate:
    """f32 everywhere, no loss scaling: the arm every candidate is certified against."""
    return Candidate("f32", ("f32",) * n_layers)


def _redundant(c: Candidate) -> str | None:
    if not c.master_weights and all(d == "f32" for d in c.layers) and c.mlp == "linear":
        return "master_weights false with f32 layers stores the same f32 parameters"
    if c.loss_scaling in ("static", "dynamic") and not c.has_f16():
        return (
            "loss scaling with no f16 value: a power-of-two scale is exact in f32 and bf16, so "
            "the run is the unscaled one plus an unscale pass"
        )
    return None


def enumerate_space(
    n_layers: int, width: int, space: Mapping[str, Any] | None = None
) -> tuple[list[Candidate], list[dict[str, Any]]]:
    """Every candidate of the space, split into kept and pruned.

    Args:
        n_layers: linear layers of the MLP (``texture.hidden + 1``).
        width: the MLP's hidden width (``texture.internal_dims``); the fused network needs one of
            tcnn's widths (16, 32, 64, 128).
        space: ``search.space`` (:class:`SpaceConfig`'s defaults for missing keys).

    Raises:
        ConfigError: (a ``ValueError``) ``"search.space.<key>: ..."`` for a bad key, one line.

    Returns:
        ``(kept, pruned)``: kept candidates sorted by name; pruned as
        ``{"candidate": name, "rule": "invalid" | "redundant", "reason": str}``.
    """
    s = check_group(SpaceConfig, space, "search.space")
    raw: list[Candidate] = []
    for enc, layers, master, ls in itertools.product(
        s["encoder_dtypes"],
        itertools.product(s["layer_dtypes"], repeat=n_layers),
        s["master_weights"],
        s["loss_scaling"],
    ):
        raw.append(Candidate(enc, tuple(layers), master, ls, float(s["static_loss_scale"])))
    if s["fused"]:
        for enc, ls in itertools.product(s["encoder_dtypes"], ["tcnn", *s["loss_scaling"]]):
            raw.append(Candidate(enc, ("f16",), True, ls, float(s["static_loss_scale"]), "fused"))
    for enc, quant, ls in itertools.product(s["encoder_dtypes"], s["quantized"], s["loss_scaling"]):
        layers = ("f32",) * n_layers
        raw.append(Candidate(enc, layers, True, ls, float(s["static_loss_scale"]), quant=quant))
    kept, pruned = [], []
    for c in dict.fromkeys(raw):
        reason = None
        try:
            c.policy()
        except ValueError as exc:
            reason = ("invalid", str(exc))
        if reason is None and c.mlp == "fused" and width not in FUSED_WIDTHS:
            reason = (
                "invalid",
                f"texture.internal_dims {width}: tcnn's FullyFusedMLP "
                f"builds widths {list(FUSED_WIDTHS)} only",
            )
        if reason is None and (why := _redundant(c)) is not None:
            reason = ("redundant", why)
        if reason is None:
            kept.append(c)
        else:
            pruned.append({"candidate": c.name, "rule": reason[0], "reason": reason[1]})
    kept.sort(key=lambda c: c.name)
    return kept, pruned
