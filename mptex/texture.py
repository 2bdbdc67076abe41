"""MLPTexture3D: nvdiffrec's neural 3D texture (hash grid + small MLP) with a precision policy."""

from __future__ import annotations

import copy
import gc
import math
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from numbers import Real
from typing import Any

import numpy as np
import torch
from torch import nn

from mptex.config_schema import Group, Integer, OneOf, OrNull, check_group, is_int, plain, setting
from mptex.encoding import BACKENDS as ENCODER_BACKENDS
from mptex.encoding import HashGridEncoding, _grid_kwargs_from_tcnn
from mptex.fp8 import GEMM_BACKENDS
from mptex.mlp import PrecisionMLP
from mptex.network import fused_params_from_linear, linear_weights_from_fused
from mptex.precision import PrecisionPolicy, scale_grad

__all__ = [
    "MLPTexture3D",
    "NVDIFFREC_ENCODER_CONFIG",
    "TextureConfig",
    "GridConfig",
    "check_texture_config",
    "convert_state_dict",
]

# ATen's CPU elementwise kernels hand each thread one contiguous chunk once a tensor has more
# than 32768 elements (at::internal::GRAIN_SIZE). Each chunk runs a vectorised loop and ends in a
# scalar loop, and the two compute exp differently (SLEEF vs libm: 1 ulp apart for some inputs),
# so which elements fall in a scalar tail, hence the bits of a sigmoid, depends on the thread
# count. Measured: f32 training was otherwise bit-identical with 1 and 2 threads until an output
# sigmoid over ~33,000 elements differed. Pieces of at most this many elements never split.
_ELEMENTWISE_GRAIN = 32768


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``torch.sigmoid`` with the same bits for any CPU thread count (pieces of at most
    ``_ELEMENTWISE_GRAIN`` elements, each computed by one thread). Shapes: any -> same."""
    if x.device.type != "cpu" or x.numel() <= _ELEMENTWISE_GRAIN:
        return torch.sigmoid(x)
    pieces = x.reshape(-1).split(_ELEMENTWISE_GRAIN)
    return torch.cat([torch.sigmoid(piece) for piece in pieces]).view(x.shape)


# nvdiffrec's render/mlptexture.py: 16 levels from resolution 16 to 4096.
NVDIFFREC_ENCODER_CONFIG: dict[str, Any] = {
    "otype": "HashGrid",
    "n_levels": 16,
    "n_features_per_level": 2,
    "log2_hashmap_size": 19,
    "base_resolution": 16,
    "per_level_scale": math.exp(math.log(4096 / 16) / (16 - 1)),
}


@dataclass
class GridConfig:
    """The ``texture.encoder`` keys: tcnn's grid encoding config, as nvdiffrec passes it to
    ``tcnn.Encoding`` (:meth:`~mptex.HashGridEncoding.from_tcnn_config` reads it, checks the
    ranges and fills in what is left out; the defaults here are tcnn's)."""

    otype: str = "HashGrid"
    """``HashGrid``, ``Grid`` or ``DenseGrid``."""
    type: str = "Hash"
    """``Hash`` or ``Dense`` (left out: as ``otype`` says)."""
    n_levels: int = 16
    """Resolution levels."""
    n_features_per_level: int = 2
    """Features stored per entry of a level."""
    log2_hashmap_size: int = 19
    """Entries per level: ``2 ** log2_hashmap_size`` at most."""
    base_resolution: int = 16
    """The coarsest level's resolution."""
    per_level_scale: float = 2.0
    """Resolution growth per level (left out for a dense grid: the scale that reaches 256)."""
    interpolation: str = "Linear"
    """``Nearest``, ``Linear`` or ``Smoothstep``."""


@dataclass
class TextureConfig:
    """The ``texture`` group: :class:`MLPTexture3D`'s arguments (``configs/texture/*.yaml``).
    Types are checked here, ranges by the constructors (their errors name the argument, which
    ``mptex.train`` maps to the key)."""

    channels: int = setting(3, Integer(min=1))
    """3: kd; 9: kd + ks + normal (``train.shading=diffuse``)."""
    internal_dims: int = setting(32, Integer(min=1))
    """MLP width (``n_neurons``)."""
    hidden: int = setting(2, Integer(min=1))
    """Hidden layers (``n_hidden_layers``): ``hidden + 1`` linear layers."""
    min_max: Any = None
    """``[[min per channel], [max per channel]]``; null: [0, 1]."""
    backend: str = setting("auto", OneOf(ENCODER_BACKENDS))
    """Hash-grid backend: auto (on CUDA Triton, else tcnn, as
    :meth:`~mptex.HashGridEncoding.resolved_backend`; torch elsewhere), torch, tcnn, triton."""
    fp8_gemm: str = setting("auto", OneOf(GEMM_BACKENDS))
    """The FP8 arms' GEMMs: auto (``torch._scaled_mm`` on FP8 tensor cores, else emulated),
    scaled_mm, emulated, triton (:func:`mptex.fp8.scaled_mm`)."""
    encoder: GridConfig | None = setting(
        None, OrNull(Group(GridConfig, what="a mapping of grid keys"))
    )
    """tcnn's grid config; null: :data:`NVDIFFREC_ENCODER_CONFIG`."""


def check_texture_config(texture: Mapping[str, Any] | None) -> dict[str, Any]:
    """A texture group's keys and types checked (:class:`~mptex.config_schema.ConfigError`, a
    ``ValueError``, ``"texture.<key>: ..."``); the constructors check the ranges.

    Returns:
        the group with :class:`TextureConfig`'s defaults filled in (the constructors' own). The
        encoder's ``type`` and ``per_level_scale``, where left out, follow its ``otype`` and
        sizes as :meth:`~mptex.HashGridEncoding.from_tcnn_config` fills them (a dense grid's
        are not the hash grid's); left out still where that would refuse the encoder, which
        the texture's constructor then says.
    """
    checked = check_group(TextureConfig, texture, "texture")
    given = plain(texture or {}).get("encoder")
    if checked.get("encoder") is not None and isinstance(given, Mapping):
        encoder = checked["encoder"]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # unknown keys: the constructor warns of them
                grid = _grid_kwargs_from_tcnn(given, "texture.encoder")
        except ValueError:
            grid = None
        for key, kwarg in (("type", "grid_type"), ("per_level_scale", "per_level_scale")):
            if key in given:
                continue
            if grid is None:
                del encoder[key]
            else:
                encoder[key] = grid[kwarg]
    return checked


def _float_rows(value: Any) -> torch.Tensor:
    """A detached float32 CPU tensor from a tensor (any device, any grad state), a numpy array, a
    number or nested sequences of these. Bounds are constants of the texture: a tensor that
    carries an autograd graph (nvdiffrec's ``DLMesh`` makes ``v_pos`` a Parameter, so the AABB
    computed from it does) must not keep it, or every step would backpropagate into it."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device="cpu", dtype=torch.float32)
    if isinstance(value, (np.ndarray, Real)) and not isinstance(value, bool):
        return torch.as_tensor(np.asarray(value, dtype=np.float64), dtype=torch.float32)
    if isinstance(value, Sequence) and not isinstance(value, str):
        return torch.stack([_float_rows(item) for item in value])
    raise TypeError(f"not a number: {value!r}")


def _bounds(value: Any, arg: str, width: int | None) -> torch.Tensor:
    """``[2, width]`` float32 CPU tensor (min row, max row), detached, from any form of rows.

    Accepted forms, converted the same way: one ``[2, width]`` tensor (any device, any dtype,
    with or without grad) or numpy array, or two rows ``(min, max)`` as tensors, numpy arrays or
    sequences of numbers (nvdiffrec's ``mesh.aabb()`` returns such a tuple of tensors).
    """
    value = plain(value)
    try:
        if isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 2:
            tensor = torch.stack([_float_rows(row).reshape(-1) for row in value])
        else:
            tensor = _float_rows(value)
    except (TypeError, ValueError, RuntimeError):  # ragged rows, strings, None
        raise ValueError(f"{arg}: expected two rows of numbers [min, max], got {value!r}") from None
    if tensor.ndim != 2 or tensor.shape[0] != 2 or (width is not None and tensor.shape[1] != width):
        want = f"[2, {width}]" if width is not None else "[2, C]"
        raise ValueError(f"{arg}: expected shape {want}, got {list(tensor.shape)}")
    if not torch.isfinite(tensor).all():
        raise ValueError(f"{arg}: expected finite values, got {tensor.tolist()}")
    return tensor.clone()


def _ordered_bounds(
    value: Any, arg: str, width: int, each: str, *, allow_equal: bool = False
) -> torch.Tensor:
    """:func:`_bounds` with min < max in every column, or min <= max with ``allow_equal``
    (``each``: how the message names one). ``AABB``: sample() divides by max - min, so a flat
    or inverted box maps every point to NaN or 0. ``min_max``: the output is min + sigmoid *
    (max - min), so an empty range is a constant channel (nvdiffrec's NeRD configs pin ks's
    occlusion channel to 0 with ``ks_min[0] == ks_max[0] == 0``), an inverted one a flipped
    sigmoid, which is refused."""
    tensor = _bounds(value, arg, width)
    ordered = tensor[0] <= tensor[1] if allow_equal else tensor[0] < tensor[1]
    if not bool(ordered.all()):
        relation = "<=" if allow_equal else "<"
        raise ValueError(f"{arg}: expected min {relation} max {each}, got {tensor.tolist()}")
    return tensor


def _tensor_device(value: Any) -> torch.device | None:
    """The device of bounds given as a tensor or as rows of tensors (the first tensor found;
    nvdiffrec's ``getAABB()`` is a ``(min, max)`` pair of CUDA tensors); None for numbers,
    numpy arrays and nested lists of numbers."""
    if isinstance(value, torch.Tensor):
        return value.device
    if isinstance(value, Sequence) and not isinstance(value, str):
        for item in value:
            device = _tensor_device(item)
            if device is not None:
                return device
    return None


class MLPTexture3D(nn.Module):
    """nvdiffrec's ``MLPTexture3D`` with a selectable precision policy and encoder backend.

    ``sample(texc)`` does what nvdiffrec's does: normalise ``texc`` into the AABB, clamp to
    [0, 1], hash-grid encode, run the MLP, ``sigmoid``, scale into ``[min_max[0], min_max[1]]``.

    Attributes as nvdiffrec's, so its training code runs unchanged: ``encoder`` (a
    :class:`~mptex.HashGridEncoding`; its flat f32 ``params`` is what nvdiffrec's script
    rescales), ``net`` (a :class:`~mptex.PrecisionMLP`; ``net.layers`` are ``torch.nn.Linear``
    modules), ``channels``, ``internal_dims``, ``AABB``, ``min_max``. State-dict keys are
    nvdiffrec's (``encoder.params``, ``net.net.0.weight``, ``net.net.2.weight``, ...) whichever
    encoder backend is used, so a state dict moves between backends and arms.

    Precision (see :class:`~mptex.PrecisionPolicy`): the encoder computes in
    ``policy.encoder_dtype``, the MLP as the policy says, and the MLP output is cast to f32
    before the sigmoid, so ``sample`` returns f32. After ``.double()`` (a float64 reference:
    ``gradcheck``, :func:`mptex.diagnostics.compare_setups`' reference) float64 flows end to
    end: the positions, the bounds, the grid (:class:`~mptex.HashGridEncoding` computes in
    float64 with a float64 table), the linear layers (:class:`~mptex.mlp.CastLinear`, whatever
    their compute dtype: every arm up to ``per_layer``), the sigmoid and the output. Layers
    without a float64 form keep their arithmetic, their output cast to float64: the fake
    quantisation of the ``*_qat`` arms, the FP8 GEMMs and tcnn's fused network (its twin's
    half arithmetic). ``.half()`` or ``.to(torch.bfloat16)`` is refused at the first sample,
    naming ``params``: the master weights are f32. With ``loss_scaling="nvdiffrec"`` the
    gradient w.r.t. the encoder's input positions is divided by ``static_loss_scale`` (128),
    undoing the x128 the MLP puts on the encoder's output gradient, as nvdiffrec's hooks do; the
    table's own gradient keeps the x128 (nvdiffrec's behaviour; Adam is invariant to it up to
    ``eps``: the grid's effective epsilon is ``eps / 128``, see
    :func:`~mptex.precision.grid_gradient_factor`). Unlike nvdiffrec's hook, nothing fails when
    the positions do not require grad.
    ``policy.encoder_hook`` keeps only the encoder's /128 (#154's swap).

    Device: the texture (parameters and the ``AABB``/``min_max`` buffers) is created where
    the AABB is when the AABB is given as a tensor or as rows of tensors, as nvdiffrec's
    ``MLPTexture3D(geometry.getAABB(), ...)`` with CUDA vertices gives a CUDA texture with no
    ``.cuda()`` call; an AABB of numbers or numpy arrays leaves it where torch creates
    parameters (the default device); with a ready ``encoder``, on the encoder's device.
    ``.to(device)`` moves it afterwards. The initial values do not depend on the AABB's
    device: they are drawn where torch creates parameters, then moved.

    Args:
        AABB: ``[2, 3]`` (min corner, max corner) of the texture's domain: one tensor or numpy
            array, or a ``(min, max)`` pair of rows (tensors, arrays or lists; nvdiffrec's
            ``mesh.aabb()``). Every form becomes the same detached float32 buffer on the
            texture's device: an AABB computed from a vertex Parameter keeps no graph. Every
            axis needs min < max (a flat box would divide by zero).
        channels: output channels (nvdiffrec: 3 for kd, 9 for kd + ks + normal).
        internal_dims: MLP width (``n_neurons``).
        hidden: MLP hidden layers (``n_hidden_layers``; ``hidden + 1`` linear layers).
        min_max: ``[2, channels]`` output range, in any form ``AABB`` takes, with min <= max
            per channel (min == max: a constant channel, as nvdiffrec's NeRD configs' ks
            occlusion ``[0, 0]``); ``None`` (nvdiffrec would fail indexing it) means [0, 1]
            per channel, the plain sigmoid.
        precision: a :class:`~mptex.PrecisionPolicy`, an arm name or a config mapping
            (default ``"nvdiffrec"``).
        encoder: ``None`` (nvdiffrec's config, :data:`NVDIFFREC_ENCODER_CONFIG`), a tcnn-style
            config dict (what nvdiffrec passes to ``tcnn.Encoding``), or a ready
            :class:`~mptex.HashGridEncoding` with 3 input dims (used as given, dtype included).
        backend: encoder backend for ``None``/dict encoders: ``"auto"``, ``"torch"``, ``"tcnn"``
            or ``"triton"`` (``"auto"``: Triton on CUDA where it imports, else tcnn;
            :meth:`~mptex.HashGridEncoding.resolved_backend`). A ready encoder keeps its own:
            ``"auto"`` or that backend.
        fp8_gemm: the FP8 arms' GEMM backend (:func:`mptex.fp8.scaled_mm`: ``"auto"``,
            ``"scaled_mm"``, ``"emulated"``, ``"triton"``), resolved for the device the texture
            runs on at each call (:meth:`backends` resolves it now).

    Raises:
        ValueError: naming the argument, for a malformed AABB/min_max, channel count or encoder.
        RuntimeError: at construction, for a policy or backend this machine cannot run
            (``mlp_backend="tcnn"`` or ``backend="tcnn"`` without tinycudann and CUDA,
            ``backend="triton"`` without triton; ``tcnn_fused`` itself runs everywhere: its
            ``"auto"`` backend falls back to the twin).
    """

    def __init__(
        self,
        AABB: torch.Tensor | Sequence[Sequence[float]],
        channels: int = 3,
        internal_dims: int = 32,
        hidden: int = 2,
        min_max: torch.Tensor | Sequence[Sequence[float]] | None = None,
        precision: PrecisionPolicy | str | Mapping[str, Any] = "nvdiffrec",
        encoder: HashGridEncoding | Mapping[str, Any] | None = None,
        backend: str = "auto",
        fp8_gemm: str = "auto",
    ):
        super().__init__()
        for arg, value in (("channels", channels), ("internal_dims", internal_dims),
                           ("hidden", hidden)):  # fmt: skip
            if not is_int(value) or value < 1:
                raise ValueError(f"{arg}: expected a positive integer, got {value!r}")
        channels, internal_dims, hidden = int(channels), int(internal_dims), int(hidden)
        self.policy = PrecisionPolicy.from_config(plain(precision))
        self.policy.check_available()
        self.channels = channels
        self.internal_dims = internal_dims
        # Non-persistent buffers: they follow .to(device) but stay out of the state dict, whose
        # keys are nvdiffrec's.
        home = _tensor_device(AABB)
        aabb = _ordered_bounds(AABB, "AABB", 3, "on every axis")
        self.register_buffer("AABB", aabb, persistent=False)
        if min_max is None:
            min_max = torch.stack([torch.zeros(channels), torch.ones(channels)])
        min_max = _ordered_bounds(
            min_max, "min_max", channels, "for every channel", allow_equal=True
        )
        self.register_buffer("min_max", min_max, persistent=False)
        self._extents: dict[str, tuple[torch.Tensor, int, torch.Tensor]] = {}

        encoder = plain(encoder)
        if encoder is None:
            encoder = NVDIFFREC_ENCODER_CONFIG
        if isinstance(encoder, HashGridEncoding):
            if encoder.n_input_dims != 3:
                raise ValueError(f"encoder: expected 3 input dims, got {encoder.n_input_dims}")
            if backend not in ("auto", encoder.backend):
                raise ValueError(
                    f"backend: a ready encoder keeps its own backend ({encoder.backend!r}); got "
                    f"{backend!r}"
                )
            self.encoder = encoder
            home = encoder.params.device  # used as given: the texture joins it
        elif isinstance(encoder, Mapping):
            # HashGridEncoding.from_tcnn_config's reading, its errors and warning naming this
            # argument (encoder.n_levels) and pointing at the caller's line
            grid = _grid_kwargs_from_tcnn(dict(encoder), "encoder")
            self.encoder = HashGridEncoding(
                3, **grid, backend=backend, dtype=self.policy.encoder_dtype
            )
        else:
            raise ValueError(
                f"encoder: expected None, a config dict or a HashGridEncoding, got {encoder!r}"
            )

        self.net = PrecisionMLP(
            self.encoder.n_output_dims, channels, hidden, internal_dims, self.policy,
            fp8_gemm=fp8_gemm,
        )  # fmt: skip
        # Everything was created where torch creates parameters, from the same draws whatever
        # the AABB's device; the texture now moves where the AABB tensors (or a ready encoder)
        # are. An AABB of numbers leaves the parameters where they were; the bounds join them.
        self.to(home if home is not None else self.encoder.params.device)

    def sample(self, texc: torch.Tensor, *, check: bool = True) -> torch.Tensor:
        """Texture values at positions ``texc``.

        Args:
            texc: ``[..., 3]`` float positions in world space (outside the AABB is clamped;
                NaN raises ``ValueError``).
            check: check for NaN (one read on the host, which waits for a device). False
                leaves it out: a NaN position then gives NaN values (the training loop's
                positions come from G-buffers; a non-finite loss skips its step).

        Returns:
            ``[..., channels]`` float32 (float64 after ``.double()``, computed in float64 as
            the class docstring says), in ``[min_max[0], min_max[1]]`` per channel.
        """
        if not isinstance(texc, torch.Tensor) or not texc.is_floating_point():
            tensor = isinstance(texc, torch.Tensor)
            got = f"a {texc.dtype} tensor" if tensor else type(texc).__name__
            raise ValueError(f"texc: expected a floating-point torch.Tensor [..., 3], got {got}")
        if texc.dim() == 0 or texc.shape[-1] != 3:
            raise ValueError(f"texc: expected shape [..., 3], got {list(texc.shape)}")
        if texc.device != self.AABB.device:
            raise ValueError(f"texc: is on {texc.device} but the texture is on {self.AABB.device}")
        # float32, whatever the positions' dtype; float64 only in a texture cast to it.
        dtype = torch.float64 if self.AABB.dtype == torch.float64 else torch.float32
        flat = texc.reshape(-1, 3).to(dtype)
        lo = self.AABB[0]
        unit = torch.clamp((flat - lo[None]) / self._extent("AABB")[None], min=0, max=1)
        if self.policy.loss_scaling == "nvdiffrec" or self.policy.encoder_hook:
            unit = scale_grad(unit, 1.0 / self.policy.static_loss_scale)
        try:
            features = self.encoder(unit.contiguous(), check_values=check)
        except ValueError as exc:
            # The clamp keeps finite points in [0, 1]; only a NaN in texc gets through to the
            # encoder's finiteness check (inf clamps to a face of the AABB).
            if "non-finite" not in str(exc):
                raise
            raise ValueError("texc: contains NaN values") from None
        out = self.net(features).to(dtype)
        lo_out = self.min_max[0]
        out = _sigmoid(out) * self._extent("min_max")[None] + lo_out[None]
        return out.view(*texc.shape[:-1], self.channels)

    def _extent(self, name: str) -> torch.Tensor:
        """``bounds[1] - bounds[0]`` of the buffer ``name`` (``AABB`` or ``min_max``), computed
        once per version of the buffer (a constant of the texture: one op less per sample)."""
        bounds = getattr(self, name)
        cached = self._extents.get(name)
        # The cache holds the buffer itself: a new buffer (load, .to()) is another object.
        if cached is None or cached[0] is not bounds or cached[1] != bounds._version:
            cached = (bounds, bounds._version, bounds[1] - bounds[0])
            self._extents[name] = cached
        return cached[2]

    def forward(self, texc: torch.Tensor) -> torch.Tensor:
        """Same as :meth:`sample`."""
        return self.sample(texc)

    @torch.no_grad()
    def clamp_(self) -> None:
        """nvdiffrec's in-place clamp after training: a no-op (the sigmoid bounds the output)."""

    def cleanup(self) -> None:
        """Free temporary memory (tcnn's scratch buffers where tcnn is used), as nvdiffrec's."""
        gc.collect()
        if "tcnn" in self.backends().values():
            from mptex._backends import import_tcnn

            import_tcnn().free_temporary_memory()

    def backends(self) -> dict[str, str]:
        """What computes each part now: ``{"encoder": "torch"|"tcnn"|"triton", "mlp":
        "torch"|"tcnn"}``, and for the FP8 arms ``"fp8_gemm": "scaled_mm"|"emulated"|"triton"``
        (FP8 tensor cores, the emulation or mptex's Triton kernels: a timing means little
        without it); ``"auto"`` resolved from the parameters' device and what imports. The
        record for metrics.json."""
        backends = {
            "encoder": self.encoder.resolved_backend(),
            "mlp": self.net.resolved_backend(),
        }
        fp8_gemm = self.net.fp8_gemm_backend()
        if fp8_gemm is not None:
            backends["fp8_gemm"] = fp8_gemm
        return backends

    def extra_repr(self) -> str:
        return (
            f"channels={self.channels}, internal_dims={self.internal_dims}, "
            f"precision={self.policy.name!r}"
        )


# nvdiffrec's _MLP keeps its layers in a Sequential ``net`` (ReLUs between: indices 0, 2, ...);
# tcnn's fused network is one flat vector.
_LINEAR_KEY = re.compile(r"net\.net\.(\d+)\.(weight|bias)")
_FUSED_KEY = "net.net.params"


def convert_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    texture: MLPTexture3D,
    *,
    drop_input_bias: bool = False,
) -> dict[str, torch.Tensor]:
    """``state_dict`` with its MLP in ``texture``'s layout, for ``texture.load_state_dict``.

    Two layouts hold an :class:`MLPTexture3D`'s MLP: nvdiffrec's ``_MLP`` (every arm with
    ``mlp="linear"``: ``net.net.0.weight``, ``net.net.2.weight``, ... ``[out, in]`` bias-free
    matrices) and tcnn's fully fused network (``tcnn_fused`` and its variants: the flat
    ``net.net.params``). This converts between them in either direction
    (:func:`~mptex.network.fused_params_from_linear`,
    :func:`~mptex.network.linear_weights_from_fused`: tcnn's padding of the input and output
    widths to multiples of 16, filled with zeros); a state dict already in ``texture``'s layout
    is returned as a copy. Other entries (``encoder.params``) pass through. So an nvdiffrec
    checkpoint loads into a ``tcnn_fused`` texture::

        tex = mptex.MLPTexture3D(aabb, precision="tcnn_fused")
        tex.load_state_dict(mptex.convert_state_dict(nvdiffrec_state_dict, tex))

    The FP8 arms' layers keep their scaling state in the state dict
    (``net.net.<i>._extra_state``: amax histories, scales, counters). Where ``state_dict`` has
    none for a layer of ``texture`` (an nvdiffrec or f32 checkpoint into ``fp8``), the result
    takes ``texture``'s own, a fresh recipe that starts from the loaded weights as a new run
    would; where ``texture`` keeps none (an ``fp8`` checkpoint into ``f32``), it is dropped.
    Either way ``load_state_dict(..., strict=True)`` accepts the result.

    Args:
        state_dict: a texture state dict in either layout (values are not modified).
        texture: the texture whose layout and sizes the result takes.
        drop_input_bias: fused -> linear only: see
            :func:`~mptex.network.linear_weights_from_fused`.

    Returns:
        a new dict; converted MLP weights are float32 (``load_state_dict`` casts them to the
        parameters' dtype).

    Raises:
        ValueError: naming ``state_dict`` (no MLP, both layouts, biases, sizes that differ from
            ``texture``'s) or ``params``.
    """
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"state_dict: expected a texture's state dict, got {type(state_dict)}")
    if not isinstance(texture, MLPTexture3D):
        raise ValueError(f"texture: expected an MLPTexture3D, got {type(texture)}")
    linear = sorted(
        (int(m.group(1)), key) for key in state_dict if (m := _LINEAR_KEY.fullmatch(key))
    )
    if not linear and _FUSED_KEY not in state_dict:
        raise ValueError(
            "state_dict: no MLP weights (expected nvdiffrec's net.net.<i>.weight or tcnn's "
            f"{_FUSED_KEY})"
        )
    if linear and _FUSED_KEY in state_dict:
        raise ValueError(f"state_dict: holds both layouts ({linear[0][1]} and {_FUSED_KEY})")
    converted = {
        k: v for k, v in state_dict.items() if k != _FUSED_KEY and not _LINEAR_KEY.fullmatch(k)
    }
    net = texture.net
    if ("linear" if linear else "fused") == net.policy.mlp:
        own = texture.state_dict()
        for key, value in state_dict.items():
            if isinstance(value, torch.Tensor) and key in own and value.shape != own[key].shape:
                raise ValueError(
                    f"state_dict: {key} is {list(value.shape)}, the texture's "
                    f"{list(own[key].shape)}"
                )
        return _with_extra_state(dict(state_dict), texture)
    if net.policy.mlp == "fused":
        biases = [key for _, key in linear if key.endswith(".bias")]
        if biases:
            raise ValueError(f"state_dict: {biases[0]}: tcnn's fused network has no biases")
        weights = [state_dict[key] for _, key in linear]
        converted[_FUSED_KEY] = fused_params_from_linear(weights)  # checks the chain
        sizes = (weights[0].shape[1], weights[-1].shape[0], weights[0].shape[0], len(weights) - 1)
        fused = net.net
        wanted = (fused.n_input_dims, fused.n_output_dims, fused.width, fused.n_hidden_layers)
        if sizes != wanted:
            raise ValueError(
                "state_dict: its MLP has (inputs, outputs, width, hidden layers) = "
                f"{sizes}, the texture's is {wanted}"
            )
        return _with_extra_state(converted, texture)
    weights = linear_weights_from_fused(
        state_dict[_FUSED_KEY], net.n_input_dims, net.n_output_dims, net.n_neurons,
        net.n_hidden_layers, drop_input_bias=drop_input_bias,
    )  # fmt: skip
    keys = [f"net.net.{i}.weight" for i, m in enumerate(net.net) if isinstance(m, nn.Linear)]
    converted.update(zip(keys, weights, strict=True))
    return _with_extra_state(converted, texture)


def _with_extra_state(state_dict: dict[str, Any], texture: MLPTexture3D) -> dict[str, Any]:
    # Modules' extra state (the FP8 layers' scaling recipe) as ``texture`` keeps it: its own
    # where the state dict has none, none where it keeps none.
    own = {k: v for k, v in texture.state_dict().items() if k.endswith("._extra_state")}
    out = {k: v for k, v in state_dict.items() if not k.endswith("._extra_state") or k in own}
    for key, value in own.items():
        out.setdefault(key, copy.deepcopy(value))
    return out
