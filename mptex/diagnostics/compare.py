"""``mptex-check``'s engine: the same weights and points under two setups, every stage compared
with a float64 CPU reference against a per-stage bound of what its dtypes explain."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mptex._triton_launch import launching_on
from mptex.host import to_host
from mptex.mlp import float32_gemm_sums
from mptex.precision import PrecisionPolicy, dtype_name
from mptex.texture import NVDIFFREC_ENCODER_CONFIG, MLPTexture3D

# --------------------------------------------------------------------------- setups
# Texture configurations for mptex-check. "small" is the tests' grid (a 4-level, 2^12 table);
# "nvdiffrec" is nvdiffrec's (16 levels up to 4096, 2^19 entries per level).
TEXTURE_CONFIGS: dict[str, dict[str, Any]] = {
    "small": dict(
        channels=3,
        internal_dims=32,
        hidden=2,
        encoder={
            "otype": "HashGrid",
            "n_levels": 4,
            "n_features_per_level": 2,
            "log2_hashmap_size": 12,
            "base_resolution": 4,
            "per_level_scale": 2.0,
        },  # fmt: skip
    ),
    "nvdiffrec": dict(channels=3, internal_dims=32, hidden=2, encoder=NVDIFFREC_ENCODER_CONFIG),
}
_AABB = [[-1.0, -1.0, -1.0], [1.0, 1.0, 1.0]]
# The size of the gradient training puts on one texture output: the image loss is a mean over
# batch_size * H * W * 3 values (the default run: 2 views of 128 x 128), so each covered
# pixel's colour gets about 1 / (2 * 128 * 128 * 3) = 1.0e-5 times the loss's own derivative
# (logl1: at most 1). An N(0, 1) cotangent of that size shows what f16 gradients lose to
# underflow without loss scaling, which a unit-sized one hides.
TRAINING_COTANGENT_SCALE = 1.0 / (2 * 128 * 128 * 3)
_MODES = ("train", "eval", "no_grad")


@dataclass(frozen=True)
class Setup:
    """One way of running an :class:`~mptex.MLPTexture3D`, for :func:`compare_setups`.

    Args:
        precision: arm name, :class:`~mptex.PrecisionPolicy` or config mapping.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"xpu"``, ``"mps"``.
        backend: hash-grid backend, ``"torch"``, ``"tcnn"`` or ``"auto"``.
        mode: ``"train"`` (``module.train()``, forward and backward), ``"eval"``
            (``module.eval()``, forward and backward) or ``"no_grad"`` (train mode, forward
            under ``torch.no_grad``: no gradient stages).
        modify: called with the built texture before it runs (e.g. to inject a fault, or to
            swap a module); its declared precision stays the policy's.
        label: name in the report (default: built from the fields).
    """

    precision: Any = "f32"
    device: str = "cpu"
    backend: str = "torch"
    mode: str = "train"
    modify: Callable[[MLPTexture3D], None] | None = field(default=None, compare=False)
    label: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "precision", PrecisionPolicy.from_config(self.precision))
        if self.mode not in _MODES:
            raise ValueError(f"mode: expected one of {_MODES}, got {self.mode!r}")
        if self.backend not in ("torch", "tcnn", "auto"):
            raise ValueError(f"backend: expected 'torch', 'tcnn' or 'auto', got {self.backend!r}")
        _check_device(self.device, "device")

    @property
    def name(self) -> str:
        """The label, or ``"<arm> (<device>, <backend>, <mode>)"``."""
        return self.label or (f"{self.precision.name} ({self.device}, {self.backend}, {self.mode})")


def _check_device(device: str, arg: str) -> None:
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"{arg}: not a device: {device!r} ({error})") from None
    available = {
        "cpu": lambda: True,
        "cuda": torch.cuda.is_available,
        "xpu": lambda: hasattr(torch, "xpu") and torch.xpu.is_available(),
        "mps": lambda: torch.backends.mps.is_available(),
    }
    if kind not in available:
        raise ValueError(f"{arg}: expected cpu, cuda, xpu or mps, got {device!r}")
    if not available[kind]():
        raise ValueError(f"{arg}: {device!r} is not available on this machine")


def build_texture(source: MLPTexture3D, setup: Setup) -> MLPTexture3D:
    """A copy of ``source`` (architecture, AABB, min_max, state dict) run as ``setup`` says.

    The copy is built on the CPU with ``setup``'s precision and encoder backend, loads
    ``source.state_dict()`` (cast to the copy's parameter dtypes), moves to ``setup.device``,
    then ``setup.modify`` is applied.
    """
    if not source.net.layers or setup.precision.mlp == "fused":
        raise ValueError(
            "setup: tcnn's fused MLP keeps its weights in its own layout; compare_setups "
            "supports the linear MLPs (every arm except tcnn_fused and its #154 variants)"
        )
    if setup.precision.quantized:
        raise ValueError(
            f"setup: {setup.precision.name} quantises its MLP below its dtypes (FP8 GEMMs or "
            "fake-quantised weights), which the per-stage dtype bounds do not model; its "
            "quantisation error is in the training's metrics (net.<i>.q_*) and the report"
        )
    texture = MLPTexture3D(
        source.AABB.detach().to("cpu", torch.float32),
        channels=source.channels,
        internal_dims=source.internal_dims,
        hidden=source.net.n_hidden_layers,
        min_max=source.min_max.detach().to("cpu", torch.float32),
        precision=setup.precision,
        encoder=source.encoder.tcnn_config(),
        backend=setup.backend,
    )
    texture.load_state_dict(to_host(source.state_dict()))
    texture.to(setup.device)
    if setup.modify is not None:
        setup.modify(texture)
    return texture


def _source_texture(texture: MLPTexture3D | str | Mapping[str, Any], seed: int) -> MLPTexture3D:
    if isinstance(texture, MLPTexture3D):
        return texture
    if isinstance(texture, str):
        if texture not in TEXTURE_CONFIGS:
            raise ValueError(
                f"texture: expected an MLPTexture3D, a mapping or one of "
                f"{sorted(TEXTURE_CONFIGS)}, got {texture!r}"
            )
        texture = TEXTURE_CONFIGS[texture]
    if not isinstance(texture, Mapping):
        raise ValueError(f"texture: expected an MLPTexture3D, a name or a mapping, got {texture!r}")
    kwargs = {k: v for k, v in dict(texture).items() if k not in ("backend", "precision")}
    kwargs.setdefault("AABB", _AABB)
    torch.manual_seed(seed)
    source = MLPTexture3D(precision="f32", backend="torch", **kwargs)
    with torch.no_grad():
        # A trained-looking table (features of order 1) instead of tcnn's +-1e-4 init, under
        # which every stage after the encoder is nearly constant and checks little.
        generator = torch.Generator().manual_seed(seed)
        source.encoder.params.copy_(torch.rand(source.encoder.n_params, generator=generator))
        source.encoder.params.mul_(2).sub_(1)
    return source


# --------------------------------------------------------------------------- staged runs
def _unit_roundoff(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps) / 2


def _forward_stages(n_layers: int) -> list[str]:
    return ["encoder", *[f"net.{i}" for i in range(n_layers)], "output"]


def _backward_stages(n_layers: int) -> list[str]:
    stages = []
    for i in reversed(range(n_layers)):
        stages += [f"net.{i}.out.grad", f"net.{i}.weight.grad"]
    return stages + ["encoder.out.grad", "encoder.params.grad"]


def _head(texture: MLPTexture3D, z: torch.Tensor) -> torch.Tensor:
    """MLPTexture3D.sample's last step (sigmoid into min_max) in ``z``'s dtype."""
    lo, hi = texture.min_max[0].to(z), texture.min_max[1].to(z)
    return torch.sigmoid(z) * (hi - lo)[None] + lo[None]


def _run(
    texture: MLPTexture3D,
    points: torch.Tensor,
    cotangent: torch.Tensor,
    mode: str,
    loss_scale: float = 1.0,
) -> dict[str, torch.Tensor]:
    """Every stage's tensor (forward outputs, output gradients, parameter gradients) on the CPU.

    The loss is ``(output * cotangent * loss_scale).sum()``; gradients are divided by
    ``loss_scale`` (a power of two: exact) before they are returned. The float64 reference is
    the texture after ``.double()``, whose ``sample`` computes in float64 throughout.
    """
    layers = texture.net.layers
    captured: dict[str, torch.Tensor] = {}

    def keep(name: str, with_input: bool = False):
        def hook(module, inputs, output):
            captured[name] = output
            if with_input:
                captured[f"{name}.in"] = inputs[0]

        return hook

    handles = [texture.encoder.register_forward_hook(keep("encoder", with_input=True))]
    handles += [layer.register_forward_hook(keep(f"net.{i}")) for i, layer in enumerate(layers)]
    texture.train(mode != "eval")
    try:
        with torch.no_grad() if mode == "no_grad" else torch.enable_grad():
            output = texture.sample(points.to(texture.AABB.device))
    finally:
        for handle in handles:
            handle.remove()
    stages = {"output": output, "encoder.in": captured["encoder.in"]}
    stages.update({name: captured[name] for name in _forward_stages(len(layers))[:-1]})
    if mode != "no_grad":
        loss = (output * (cotangent * loss_scale).to(output)).sum()
        wrt = {
            "encoder.out.grad": captured["encoder"],
            **{f"net.{i}.out.grad": captured[f"net.{i}"] for i in range(len(layers))},
            "encoder.params.grad": texture.encoder.params,
            **{f"net.{i}.weight.grad": layer.weight for i, layer in enumerate(layers)},
        }
        # A tensor cut from the graph (detached, no_grad) has no gradient: left missing.
        wrt = {name: t for name, t in wrt.items() if t.requires_grad}
        grads = torch.autograd.grad(loss, list(wrt.values()), allow_unused=True)
        stages.update(
            {name: g.double() / loss_scale for name, g in zip(wrt, grads) if g is not None}
        )
        policy = texture.policy
        if policy.loss_scaling == "nvdiffrec":
            # nvdiffrec's documented x128 on the encoder's output gradient and its table
            # gradient (see MLPTexture3D); divided out to compare with the reference.
            for name in ("encoder.out.grad", "encoder.params.grad"):
                if name in stages:
                    stages[name] = stages[name].double() / policy.static_loss_scale
    return {name: tensor.double() for name, tensor in to_host(stages).items()}


def _run_scaled(
    source: MLPTexture3D, setup: Setup, positions: torch.Tensor, cotangent: torch.Tensor
) -> tuple[dict[str, torch.Tensor], float]:
    """:func:`_run` under the loss scale ``setup``'s policy trains with: ``static_loss_scale``
    for ``"static"``; for ``"dynamic"`` GradScaler's rule, starting at ``init_scale`` and
    multiplying by ``backoff_factor`` while a gradient is inf/NaN (what the scaler settles on
    for this batch: the steps it skips on the way are not errors); 1 otherwise."""
    policy = setup.precision
    texture = build_texture(source, setup)
    if setup.mode == "no_grad" or policy.loss_scaling not in ("static", "dynamic"):
        return _run(texture, positions, cotangent, setup.mode), 1.0
    scale = float(
        policy.static_loss_scale if policy.loss_scaling == "static" else policy.init_scale
    )
    while True:
        stages = _run(texture, positions, cotangent, setup.mode, loss_scale=scale)
        grads = [t for name, t in stages.items() if name.endswith(".grad")]
        finite = all(bool(torch.isfinite(g).all()) for g in grads)
        if finite or policy.loss_scaling == "static" or scale < 1.0:
            return stages, scale
        scale *= policy.backoff_factor


# --------------------------------------------------------------------------- local bounds
def _declared_dtypes(policy: PrecisionPolicy, n_layers: int) -> dict[str, torch.dtype]:
    layer_dtypes = policy.layer_dtypes(n_layers)
    dtypes = {"encoder": policy.encoder_dtype, "output": torch.float32}
    for i, dtype in enumerate(layer_dtypes):
        dtypes[f"net.{i}"] = dtype
    return dtypes


def _rounded(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` (f64) with its value rounded to ``dtype``, gradient passed straight through:
    the cast a correct implementation makes, without a rounding of the gradient in f64 that
    the real backward does not make."""
    return tensor + (tensor.detach().to(dtype).double() - tensor.detach())


def _linear_local(layer_ref, activation, z_prev, g_out, dtype: torch.dtype, want_grad: bool):
    """Layer recomputed in f64 from the previous stage's output ``z_prev`` of the setup, with
    its input and weight rounded to the declared ``dtype`` as a correct implementation casts.

    Returns (z, dL/dz_prev, dL/dW, |W||x|, |W|^T|g|, |g|^T|x|) with ``None`` for the gradient
    parts when ``want_grad`` is False.
    """
    weight = layer_ref.weight.detach().double().requires_grad_(want_grad)
    z_prev = z_prev.detach().requires_grad_(want_grad)
    with torch.enable_grad():
        x = activation(z_prev) if activation is not None else z_prev
        x, weight_cast = _rounded(x, dtype), _rounded(weight, dtype)
        z = nn.functional.linear(x, weight_cast)
    abs_x, abs_w = x.detach().abs(), weight_cast.detach().abs()
    abs_fwd = (abs_x @ abs_w.T).max()
    if not want_grad:
        return z.detach(), None, None, abs_fwd, None, None
    g_prev, g_weight = torch.autograd.grad(z, [z_prev, weight], g_out)
    return (
        z.detach(),
        g_prev,
        g_weight,
        abs_fwd,
        (g_out.abs() @ abs_w).max(),
        (g_out.abs().T @ abs_x).max(),
    )


def _encoder_local(
    encoder64, unit, g_out, dtype: torch.dtype, want_grad: bool
) -> dict[str, torch.Tensor]:
    """Encoder (an f64 copy, its table rounded to the declared ``dtype`` as half mode reads
    it) on the setup's own positions ``unit``, with magnitudes for bounds.

    Keys: ``out``; ``abs_fwd`` = max of sum_c w_c |f_c| (the encoder with |params|: corner
    weights are >= 0); ``pos_fwd`` = max of sum_d |d out / d x_d| (central differences, exact
    inside a cell: the interpolation is piecewise linear); with ``want_grad``: ``grad`` (the
    table gradient for ``g_out``), ``abs_grad`` = max of sum_n w |g_n| and ``sq_grad`` = max of
    sum_n w g_n^2 per table entry.
    """
    from mptex.encoding import hash_grid_encode

    geometry = encoder64.geometry
    params = encoder64.params.detach().to(dtype).double()

    def encode(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return hash_grid_encode(x, table, geometry, torch.float64)

    def table_grad(cotangent: torch.Tensor) -> torch.Tensor:
        probe = params.clone().requires_grad_(True)
        with torch.enable_grad():
            (grad,) = torch.autograd.grad(encode(unit, probe), probe, cotangent)
        return grad

    step = 1e-7  # f64 differences of an O(1) piecewise-linear function: ~1e-9 relative error
    sensitivity = torch.zeros((), dtype=torch.float64)
    for dim in range(unit.shape[1]):
        offset = torch.zeros_like(unit)
        offset[:, dim] = step
        diff = (encode(unit + offset, params) - encode(unit - offset, params)).abs() / (2 * step)
        sensitivity = sensitivity + diff
    result = {
        "out": encode(unit, params),
        "abs_fwd": encode(unit, params.abs()).max(),
        "pos_fwd": sensitivity.max(),
    }
    if want_grad:
        result["grad"] = table_grad(g_out)
        result["abs_grad"] = table_grad(g_out.abs()).max()
        result["sq_grad"] = table_grad(g_out.square()).max()
    return result


# Safety factor on every first-order bound below: the bounds use sqrt(K) (probabilistic
# accumulation of K rounding errors, Higham & Mary 2019) rather than the worst-case K, and a
# check over ~1e5 elements samples the tails. Calibrated on healthy arms (tests: the largest
# err/bound ratio of every CPU arm stays below 0.5) and still 10^2-10^4 times smaller than the
# errors of the injected faults.
SAFETY = 4.0


def _max_err(value: torch.Tensor, local: torch.Tensor) -> float:
    if value.shape != local.shape:
        return math.inf
    diff = (value - local).abs()
    return (
        math.inf
        if not bool(torch.isfinite(diff).all())
        else float(
            diff.max(),
        )
    )


def _local_errors(
    reference: MLPTexture3D,
    stages: dict[str, torch.Tensor],
    policy: PrecisionPolicy,
    cotangent: torch.Tensor,
    want_grad: bool,
) -> dict[str, tuple[float, float]]:
    """Per stage: (max |setup - stage recomputed in f64 from the setup's own input|, bound).

    Each stage is recomputed in float64 from the *previous stage's output in this setup* (for
    gradients, also this setup's incoming gradient), with the casts a correct implementation
    makes (inputs, weights and the half-mode table rounded to the declared dtype), so what is
    left is the rounding inside the stage. The bound is first order in the unit roundoff ``u``
    of the declared dtype (``2**-11`` f16, ``2**-8`` bf16, ``2**-24`` f32) and ``u32`` (f32,
    which every backend accumulates matrix products and the grid's scatter in), with
    magnitudes taken as f64 sums of absolute terms so that cancellation cannot shrink it, times
    :data:`SAFETY`:

    * encoder: ``2**D u max sum_c w_c|f_c|`` (each corner product rounded, then summed) ``+
      2 u32 max sum_d |dy/dx_d|`` (``pos = s x + 0.5`` is f32 arithmetic in every setup and
      the output's slope reaches the finest level's scale);
    * linear layer (K inputs): ``u max|z| + sqrt(K) u32 max |W||x|`` (output rounding plus
      accumulation, sqrt: independent rounding errors); its output gradient likewise with
      ``|W|^T|g|`` and the output width; its weight gradient over N points ``u max|dW| +
      sqrt(N) u32 max |g|^T|x|``;
    * output (sigmoid into min_max, f32): ``4 u32 max(|y| + |min|)``; its gradient
      ``4 u max |g|`` (the f32 gradient is rounded into the last layer's dtype);
    * encoder table gradient: ``u max|dparams| + sqrt(N) u32 max sum w|g|`` ``+ D s_max 2 u32
      sqrt(2**D max sum w g^2)`` (the positions' f32 rounding moves each point's corner weights
      by up to ``s_max`` per unit, independently per point).
    """
    n_layers = len(reference.net.layers)
    dtypes = _declared_dtypes(policy, n_layers)
    u = {name: _unit_roundoff(dtype) for name, dtype in dtypes.items()}
    u32 = _unit_roundoff(torch.float32)
    n_points = stages["encoder.in"].shape[0]
    found: dict[str, tuple[float, float]] = {}

    def put(name: str, local: torch.Tensor, bound: torch.Tensor | float) -> None:
        err = _max_err(stages[name], local) if name in stages else math.inf
        found[name] = (err, SAFETY * float(bound))

    geometry = reference.encoder.geometry
    corners, dims = 2**geometry.n_input_dims, geometry.n_input_dims
    encoder = _encoder_local(
        reference.encoder,
        stages["encoder.in"],
        stages.get("encoder.out.grad"),
        dtypes["encoder"],
        want_grad and "encoder.out.grad" in stages,
    )
    put(
        "encoder",
        encoder["out"],
        corners * u["encoder"] * encoder["abs_fwd"] + 2 * u32 * encoder["pos_fwd"],
    )
    for i, layer in enumerate(reference.net.layers):
        name = f"net.{i}"
        previous = "encoder" if i == 0 else f"net.{i - 1}"
        activation = None if i == 0 else reference.net.net[2 * i - 1]
        grad_here = stages.get(f"{name}.out.grad") if want_grad else None
        want = grad_here is not None
        z, g_prev, g_weight, abs_fwd, abs_back, abs_weight = _linear_local(
            layer, activation, stages[previous], grad_here, dtypes[name], want
        )
        put(name, z, u[name] * z.abs().max() + math.sqrt(layer.in_features) * u32 * abs_fwd)
        if want:
            put(
                f"{name}.weight.grad",
                g_weight,
                u[name] * g_weight.abs().max() + math.sqrt(n_points) * u32 * abs_weight,
            )
            put(
                f"{previous}.out.grad",
                g_prev,
                max(u[name], u[previous]) * g_prev.abs().max()
                + math.sqrt(layer.out_features) * u32 * abs_back,
            )
        elif want_grad:
            put(f"{name}.weight.grad", torch.zeros(()), 0.0)
            put(f"{previous}.out.grad", torch.zeros(()), 0.0)
    last = f"net.{n_layers - 1}"
    z_last = stages[last].detach().requires_grad_(want_grad)
    with torch.enable_grad():
        output = _head(reference, z_last)
    floor = reference.min_max[0].abs().max()
    put("output", output.detach(), 4 * u32 * (output.detach().abs().max() + floor))
    if want_grad:
        (g_last,) = torch.autograd.grad(output, z_last, cotangent.double())
        put(f"{last}.out.grad", g_last, 4 * max(u32, u[last]) * g_last.abs().max())
        if "grad" in encoder:
            bound = (
                u["encoder"] * encoder["grad"].abs().max()
                + math.sqrt(n_points) * u32 * encoder["abs_grad"]
                + dims * max(geometry.scales) * 2 * u32 * torch.sqrt(corners * encoder["sq_grad"])
            )
            put("encoder.params.grad", encoder["grad"], bound)
        else:
            put("encoder.params.grad", torch.zeros(()), 0.0)
    return found


@dataclass(frozen=True)
class StageError:
    """One stage of one setup in a :class:`CheckReport`.

    Attributes:
        stage: ``"encoder"``, ``"net.<i>"`` (layer output, before the activation),
            ``"output"``, ``"net.<i>.out.grad"`` (dL/d layer output), ``"net.<i>.weight.grad"``,
            ``"encoder.out.grad"``, ``"encoder.params.grad"``.
        dtype: the stage's declared compute dtype (``"f16"`` ...).
        max_abs: max |setup - float64 reference| (inf: missing or non-finite).
        rel: ``max_abs / max |reference|``.
        local: max |setup - the stage recomputed in f64 from this setup's own input|: the error
            this stage added.
        bound: what the stage's dtype explains (see :func:`compare_setups`).
        exceeds: ``local > bound``.
    """

    stage: str
    dtype: str
    max_abs: float
    rel: float
    local: float
    bound: float
    exceeds: bool


@dataclass
class CheckReport:
    """What :func:`compare_setups` found. ``ok`` is True when no stage of either setup exceeds.

    Attributes:
        setups: the two setups' names, A then B.
        stages: stage names, forward order then backward order.
        errors: per setup name, one :class:`StageError` per stage it has.
        first_exceeding: per setup name, the first stage beyond its bound, or None.
        diff_ab: per stage, max |A - B| (where both have it).
        info: points, seed, texture description, reference.
    """

    setups: list[str]
    stages: list[str]
    errors: dict[str, list[StageError]]
    first_exceeding: dict[str, str | None]
    diff_ab: dict[str, float]
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(stage is None for stage in self.first_exceeding.values())

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable (inf written as the string ``"inf"``)."""

        def clean(value: Any) -> Any:
            if isinstance(value, float) and not math.isfinite(value):
                return str(value)
            if isinstance(value, dict):
                return {k: clean(v) for k, v in value.items()}
            if isinstance(value, list):
                return [clean(v) for v in value]
            return value

        return clean(
            {
                "ok": self.ok,
                "setups": self.setups,
                "stages": self.stages,
                "first_exceeding": self.first_exceeding,
                "errors": {
                    name: [dataclasses.asdict(e) for e in errors]
                    for name, errors in self.errors.items()
                },
                "diff_ab": self.diff_ab,
                "info": self.info,
            }
        )

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """The report as JSON text, also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            with open(path, "w") as file:
                file.write(text + "\n")
        return text

    def format_table(self) -> str:
        """A fixed-width table: per stage and setup, dtype, max-abs and relative error vs the
        f64 reference, and err/bound (local error over the dtype's bound; > 1 is flagged)."""
        a, b = self.setups
        by_stage = {name: {e.stage: e for e in errors} for name, errors in self.errors.items()}
        scales = self.info.get("loss_scale", {})
        lines = [
            f"A: {a}   (loss scale {scales.get(a, 1.0):g})",
            f"B: {b}   (loss scale {scales.get(b, 1.0):g})",
            "reference: " + str(self.info.get("reference", "")),
            "max|err|, rel: vs the reference; err/bound: the stage's own error over what its "
            "dtype explains (! when > 1)",
        ]
        head = (
            f"{'stage':<20}"
            + "".join(
                f" | {tag} {'dtype':<5} {'max|err|':>9} {'rel':>9} {'err/bound':>9}" for tag in "AB"
            )
            + f" | {'max|A-B|':>9}"
        )
        lines += [head, "-" * len(head)]
        for stage in self.stages:
            row = f"{stage:<20}"
            for name in self.setups:
                e = by_stage[name].get(stage)
                if e is None:
                    row += f" | - {'':<5} {'n/a':>9} {'':>9} {'':>9}"
                    continue
                ratio = e.local / e.bound if e.bound > 0 else math.inf
                flag = " <-" if e.exceeds else ""
                row += (
                    f" | {'!' if e.exceeds else ' '} {e.dtype:<5} {e.max_abs:>9.2e} "
                    f"{e.rel:>9.2e} {ratio:>9.3g}"
                )
                row = row + flag if flag and name == self.setups[-1] else row
            diff = self.diff_ab.get(stage)
            row += f" | {diff:>9.2e}" if diff is not None else f" | {'n/a':>9}"
            lines.append(row)
        for name, tag in zip(self.setups, "AB"):
            first = self.first_exceeding[name]
            lines.append(
                f"{tag}: "
                + (
                    f"first stage beyond its dtype's bound: {first}"
                    if first
                    else "every stage within its dtype's bound"
                )
            )
        return "\n".join(lines)


def compare_setups(
    texture: MLPTexture3D | str | Mapping[str, Any],
    setup_a: Setup | str,
    setup_b: Setup | str,
    points: int | torch.Tensor = 4096,
    seed: int = 0,
    cotangent_scale: float | None = None,
) -> CheckReport:
    """Run one texture under two setups and compare every stage with a float64 reference.

    Both setups get the same weights (``texture``'s state dict, copied by
    :func:`build_texture`), the same points and the same output cotangent; the loss is
    ``(sample(points) * cotangent).sum()`` with ``cotangent ~ N(0, 1) * cotangent_scale``,
    by default :data:`TRAINING_COTANGENT_SCALE` (the size of the gradient training puts on one
    output), multiplied by each setup's loss scale: an arm without loss scaling whose
    gradients underflow is flagged. The reference is the same module
    on the CPU in float64 (``.double()``: the hash grid computes in f64 with f64 params, every
    layer's ``compute_dtype`` set to f64). nvdiffrec's documented x128 on the encoder's
    gradients is divided out.

    Per stage (forward: encoder output, each layer's output before its activation, the final
    output; backward, in backward order: each layer's output gradient and weight gradient, the
    encoder's output gradient and table gradient) and per setup the report gives max-abs and
    relative error against the reference and the *local* error: the stage recomputed in f64
    from the setup's own previous stage, so an error that entered upstream is not blamed on the
    stages it flows through. A stage exceeds when its local error passes the first-order bound
    of its declared dtype (see ``_local_errors``' docstring for the formulas); the first such
    stage is named. A module computing in another dtype than it declares, a dropout left in
    train mode, a missing or non-finite gradient all exceed.

    Args:
        texture: an :class:`~mptex.MLPTexture3D` (its weights), a name in
            :data:`TEXTURE_CONFIGS`, or a mapping of MLPTexture3D arguments (then built with
            ``seed``, table uniform in [-1, 1]).
        setup_a, setup_b: :class:`Setup` s (or arm names, meaning CPU, torch backend, train).
        points: how many random points in the AABB (seeded), or a ``[N, 3]`` tensor.
        seed: seed of the points, the cotangent and (for configs) the texture.
        cotangent_scale: standard deviation of the output gradient (default
            :data:`TRAINING_COTANGENT_SCALE`); ``1 / points`` is a mean loss over the points.

    Returns:
        A :class:`CheckReport` (``.format_table()``, ``.to_json(path)``, ``.ok``).
    """
    setups = [s if isinstance(s, Setup) else Setup(s) for s in (setup_a, setup_b)]
    names = [s.name for s in setups]
    if names[0] == names[1]:
        names = [f"A: {names[0]}", f"B: {names[1]}"]
    source = _source_texture(texture, seed)
    generator = torch.Generator().manual_seed(seed)
    if isinstance(points, torch.Tensor):
        if points.ndim != 2 or points.shape[1] != 3:
            raise ValueError(f"points: expected shape [N, 3], got {list(points.shape)}")
        positions = points.detach().to("cpu", torch.float32)
    elif isinstance(points, int) and not isinstance(points, bool) and points > 0:
        lo, hi = source.AABB[0].detach().cpu(), source.AABB[1].detach().cpu()
        positions = lo + (hi - lo) * torch.rand(points, 3, generator=generator)
    else:
        raise ValueError(f"points: expected a positive integer or an [N, 3] tensor, got {points!r}")
    if cotangent_scale is None:
        cotangent_scale = TRAINING_COTANGENT_SCALE
    if not (isinstance(cotangent_scale, (int, float)) and math.isfinite(cotangent_scale)
            and cotangent_scale > 0):  # fmt: skip
        raise ValueError(f"cotangent_scale: expected a finite number > 0, got {cotangent_scale!r}")
    # The output gradient of the loss (each setup multiplies it by its policy's loss scale, see
    # _run_scaled), by default as small as training's, so that underflow shows.
    cotangent = torch.randn(positions.shape[0], source.channels, generator=generator)
    cotangent *= cotangent_scale

    reference = build_texture(source, Setup("f32")).double()
    for layer in reference.net.layers:
        layer.compute_dtype = torch.float64
    ref_stages = _run(reference, positions, cotangent, "train")
    n_layers = len(reference.net.layers)
    stage_names = _forward_stages(n_layers) + _backward_stages(n_layers)

    results: dict[str, dict[str, torch.Tensor]] = {}
    errors: dict[str, list[StageError]] = {}
    first: dict[str, str | None] = {}
    scales: dict[str, float] = {}
    for name, setup in zip(names, setups):
        # cuBLAS's half GEMMs as training runs them; Triton launching on the setup's device
        with float32_gemm_sums(), launching_on(setup.device):
            stages, scales[name] = _run_scaled(source, setup, positions, cotangent)
        results[name] = stages
        want_grad = setup.mode != "no_grad"
        local = _local_errors(reference, stages, setup.precision, cotangent, want_grad)
        dtypes = _declared_dtypes(setup.precision, n_layers)
        rows = []
        for stage in stage_names:
            if stage not in local:
                continue
            ref = ref_stages[stage]
            if stage in stages:
                max_abs = _max_err(stages[stage], ref)
            else:
                max_abs = math.inf
            scale = float(ref.abs().max())
            err, bound = local[stage]
            site = stage.split(".out.")[0].split(".weight.")[0].split(".params.")[0]
            rows.append(
                StageError(
                    stage=stage,
                    dtype=dtype_name(dtypes.get(site, torch.float32)),
                    max_abs=max_abs,
                    rel=max_abs / scale if scale > 0 else math.inf,
                    local=err,
                    bound=bound,
                    exceeds=not err <= bound,
                )
            )
        errors[name] = rows
        first[name] = next((row.stage for row in rows if row.exceeds), None)
    diff_ab = {
        stage: _max_err(results[names[0]][stage], results[names[1]][stage])
        for stage in stage_names
        if stage in results[names[0]] and stage in results[names[1]]
    }
    info = {
        "points": int(positions.shape[0]),
        "seed": seed,
        "texture": texture if isinstance(texture, str) else type(texture).__name__,
        "reference": "float64 on the CPU (same weights, f64 grid and layers)",
        "safety": SAFETY,
        "loss_scale": scales,
        "torch": torch.__version__,
    }
    return CheckReport(names, stage_names, errors, first, diff_ab, info)
