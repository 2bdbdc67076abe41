"""Multiresolution hash-grid encoding with three interchangeable backends.

``backend="torch"`` is a pure-PyTorch twin of tiny-cuda-nn's grid encoding (runs on any
device); ``backend="tcnn"`` wraps ``tinycudann.Encoding``; ``backend="triton"`` runs Triton
kernels that perform the twin's operations in the twin's order (tested under Triton's CPU
interpreter and on an H100, where it was the fastest for forward+backward: ``"auto"`` takes it
on CUDA, :meth:`HashGridEncoding.resolved_backend`). All hold ONE flat float32
``params`` vector in tcnn's layout, so copying ``params`` (or a ``state_dict``) between
backends gives the same outputs.
"""

from __future__ import annotations

import difflib
import inspect
import math
import warnings
from collections.abc import Mapping
from numbers import Integral, Real
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from mptex import _backends
from mptex._grid_torch import (
    EXP2_MODES,
    GRID_TYPES,
    INTERPOLATIONS,
    GridGeometry,
    grid_geometry,
    hash_grid_encode,
)
from mptex._triton_launch import on_operand_device
from mptex.config_schema import check_seed
from mptex.numbers import as_int

__all__ = ["HashGridEncoding", "hash_grid_encode", "GridGeometry"]

Backend = Literal["auto", "torch", "tcnn", "triton"]
BACKENDS = ("auto", "torch", "tcnn", "triton")
_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


# The finest level's resolution is capped where float32 grid coordinates stop being exact
# integers (2^24): beyond it ``floor(pos)`` and the cell fraction lose meaning, and a position
# scaled past the float32 range becomes inf, whose fraction is NaN.
_MAX_RESOLUTION = 2**24


def _check_int(name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    """``value`` as a Python int (a numpy integer taken), or ``ValueError`` naming ``name``."""
    number = as_int(value)
    if number is None or number < minimum or (maximum is not None and number > maximum):
        upper = f" and <= {maximum}" if maximum is not None else ""
        raise ValueError(f"{name} must be an integer >= {minimum}{upper}, got {value!r}")
    return number


# tcnn's grid encodings (src/encoding.cu registers them; names compare case-insensitively) and
# the grid type each implies when the config has no "type" (create_grid_encoding_templated_2).
_GRID_OTYPES = {"grid": "Hash", "hashgrid": "Hash", "densegrid": "Dense"}
_GRID_TYPE_NAMES = {"hash": "Hash", "dense": "Dense"}
_INTERPOLATION_NAMES = {name.lower(): name for name in INTERPOLATIONS}
# Keys tcnn's grid reads that mptex reproduces at tcnn's default value only.
_TCNN_FIXED_KEYS = {"fixed_point_pos": False, "stochastic_interpolation": False,
                    "hash": "CoherentPrime"}  # fmt: skip
_TCNN_GRID_KEYS = (
    "otype", "type", "n_levels", "n_features", "n_grid_features", "n_features_per_level",
    "log2_hashmap_size", "base_resolution", "per_level_scale", "interpolation",
    *_TCNN_FIXED_KEYS,
)  # fmt: skip


def _config_int(arg: str, key: str, value: Any) -> int:
    """An integer-valued config entry: ints, numpy integers, and floats that are whole (JSON has
    one number type; tcnn reads 16.0 as 16). Anything else fails: tcnn would truncate 16.5."""
    if isinstance(value, (bool, np.bool_)):
        pass  # a JSON true is no number to tcnn either
    elif isinstance(value, Integral):
        return int(value)
    elif isinstance(value, Real) and math.isfinite(value) and float(value).is_integer():
        return int(value)
    raise ValueError(f"{arg}.{key}: expected a whole number, got {value!r}")


def _config_name(arg: str, key: str, value: Any, names: Mapping[str, str], what: str) -> str:
    """A case-insensitive name (tcnn's ``equals_case_insensitive``), in mptex's spelling."""
    if isinstance(value, str) and value.lower() in names:
        return names[value.lower()]
    raise ValueError(f"{arg}.{key}: expected {what}, got {value!r}")


def _grid_kwargs_from_tcnn(config: Mapping[str, Any], arg: str) -> dict[str, Any]:
    """The grid keyword arguments of :class:`HashGridEncoding` from a tcnn encoding config.

    Reads the keys tcnn's grid reads (include/tiny-cuda-nn/encodings/grid.h,
    ``create_grid_encoding``), with tcnn's defaults and case-insensitive names. Keys tcnn does
    not read are ignored, as tcnn ignores them, with one warning naming them. Errors name
    ``<arg>.<key>`` (``arg``: the caller's name for the config).
    """
    if not isinstance(config, Mapping):
        raise ValueError(f"{arg}: expected a mapping of tcnn grid keys, got {config!r}")
    # A missing otype is tcnn's "OneBlob"; for a class that is a grid, a grid is meant.
    otype = config.get("otype", "HashGrid")
    if not isinstance(otype, str) or otype.lower() not in _GRID_OTYPES:
        raise ValueError(
            f"{arg}.otype: HashGridEncoding implements tcnn's grid encodings "
            f"'HashGrid', 'Grid' and 'DenseGrid' ('TiledGrid' is not implemented), got {otype!r}"
        )
    unknown = [key for key in config if key not in _TCNN_GRID_KEYS]
    if unknown:
        hints = [difflib.get_close_matches(str(k), _TCNN_GRID_KEYS, n=1) for k in unknown]
        said = [f"{k!r} (did you mean {h[0]!r}?)" if h else repr(k) for k, h in zip(unknown, hints)]
        warnings.warn(
            f"{arg}: ignoring {', '.join(said)}: tcnn's {otype} encoding does not read "
            "these keys", UserWarning, stacklevel=3,
        )  # fmt: skip
    for key, default in _TCNN_FIXED_KEYS.items():
        value = config.get(key, default)
        if isinstance(default, str):
            same = isinstance(value, str) and value.lower() == default.lower()
        else:
            same = isinstance(value, (bool, np.bool_)) and bool(value) == default
        if not same:
            raise ValueError(
                f"{arg}.{key}: mptex implements tcnn's default {default!r} only, got {value!r}"
            )
    default_type = _GRID_OTYPES[otype.lower()]
    grid_type = _config_name(arg, "type", config.get("type", default_type), _GRID_TYPE_NAMES,
                             "'Hash' or 'Dense' ('Tiled' is not implemented)")  # fmt: skip
    sizes = {key: _config_int(arg, key, config.get(key, default)) for key, default in
             (("n_levels", 16), ("n_features_per_level", 2), ("log2_hashmap_size", 19),
              ("base_resolution", 16))}  # fmt: skip
    n_levels, per_level = sizes["n_levels"], sizes["n_features_per_level"]
    for key in ("n_features", "n_grid_features"):
        if key not in config:
            continue
        if "n_levels" in config:
            raise ValueError(
                f"{arg}.{key}: may not be given with n_levels (one determines the other, as in "
                "tcnn)"
            )
        n_features = _config_int(arg, key, config[key])
        if per_level < 1 or n_features % per_level:
            raise ValueError(f"{arg}.{key}: expected a multiple of n_features_per_level "
                             f"({per_level}), got {n_features}")  # fmt: skip
        n_levels = n_features // per_level
        break
    base_resolution = sizes["base_resolution"]
    if "per_level_scale" in config:
        per_level_scale = config["per_level_scale"]
        if isinstance(per_level_scale, bool) or not isinstance(per_level_scale, Real):
            raise ValueError(f"{arg}.per_level_scale: expected a number, got {per_level_scale!r}")
        per_level_scale = float(per_level_scale)
    elif grid_type == "Dense":
        if n_levels < 2 or base_resolution < 1:
            raise ValueError(
                f"{arg}.per_level_scale: required here: tcnn's default for a dense grid, "
                "exp(log(256 / base_resolution) / (n_levels - 1)), needs n_levels >= 2"
            )
        # In float32 as tcnn: std::exp(std::log(256.0f / (float)base) / (n_levels - 1)).
        ratio = np.float32(256.0) / np.float32(base_resolution)
        exponent = np.float32(math.log(ratio)) / np.float32(n_levels - 1)
        per_level_scale = float(np.float32(math.exp(exponent)))
        if per_level_scale < 1.0:  # base_resolution above 256: levels would grow coarser
            raise ValueError(
                f"{arg}.per_level_scale: not given, and tcnn's default for a dense grid, "
                f"exp(log(256 / base_resolution) / (n_levels - 1)) = {per_level_scale:.4g} "
                f"with base_resolution={base_resolution}, is below 1 (each level would be "
                "coarser than the one before): set per_level_scale (a number >= 1), or a "
                "base_resolution of at most 256"
            )
    else:
        per_level_scale = 2.0
    return dict(
        n_levels=n_levels,
        n_features_per_level=per_level,
        log2_hashmap_size=sizes["log2_hashmap_size"],
        base_resolution=base_resolution,
        per_level_scale=per_level_scale,
        interpolation=_config_name(arg, "interpolation", config.get("interpolation", "Linear"),
                                   _INTERPOLATION_NAMES, f"one of {INTERPOLATIONS}"),
        grid_type=grid_type,
    )  # fmt: skip


class HashGridEncoding(nn.Module):
    """tiny-cuda-nn's ``HashGrid`` encoding, as a module with a torch and a tcnn backend.

    Level ``l`` has scale ``s_l = exp2f(l * log2f(per_level_scale)) * base_resolution - 1``
    (float32) and resolution ``ceil(s_l) + 1``; its table holds ``min(2^log2_hashmap_size,
    next_multiple(res^D, 8))`` entries of ``n_features_per_level`` values, indexed densely
    (x fastest) or, where ``res^D`` exceeds the table, by tcnn's XOR-of-primes hash. A point
    ``x`` is placed at ``pos = fmaf(s_l, x, 0.5)`` and interpolated from the ``2^D`` corners of
    cell ``floor(pos)``. Nothing is clamped: at ``x = 1`` dense levels wrap around, as in tcnn.

    Two call shapes:

    * tcnn's, ``HashGridEncoding(n_input_dims, encoding_config, seed=1337, dtype=None,
      *, backend="auto", device=None)``, as ``tinycudann.Encoding`` (nvdiffrec's
      ``tcnn.Encoding(3, enc_cfg)`` becomes ``HashGridEncoding(3, enc_cfg)``). The config is
      read as tcnn reads it: otypes "HashGrid", "Grid" and "DenseGrid" and tcnn's grid keys
      with tcnn's defaults (``n_levels`` 16, ``n_features_per_level`` 2, ``log2_hashmap_size``
      19, ``base_resolution`` 16, ``per_level_scale`` 2, or for a dense grid
      ``exp(log(256 / base_resolution) / (n_levels - 1))``, ``interpolation`` "Linear",
      ``n_features`` instead of ``n_levels``), names compared case-insensitively, whole numbers
      given as floats (16.0) or numpy scalars accepted; keys tcnn does not read are ignored
      with one warning naming them. Where mptex differs from tcnn, it says so instead of
      guessing: an integer key given a fraction (16.5) raises ``ValueError`` (tcnn truncates
      it), as do "TiledGrid", non-default ``hash``, ``fixed_point_pos`` or
      ``stochastic_interpolation`` (not implemented), and a missing ``otype`` means "HashGrid"
      (tcnn's default encoding is "OneBlob", which is no grid). ``dtype=None`` is tcnn's
      preferred precision, float16 (tcnn's on every GPU it builds half support for); the
      initial values are drawn from ``torch.Generator().manual_seed(seed)`` in tcnn's range,
      not from tcnn's pcg32 stream, so they are reproducible but not tcnn's own values (copy
      ``params`` from a tcnn module to get those). A dense grid with ``base_resolution``
      above 256 needs ``per_level_scale``: tcnn's default falls below 1 there (refused, in one
      line saying so).
    * mptex's keyword form below (also :meth:`from_tcnn_config`), whose defaults differ from
      tcnn's on purpose: ``dtype=torch.float32`` (the exact reference; the half mode is tcnn's
      performance choice on tensor cores, emulated and slower on a CPU) and ``seed=None``
      (drawn from torch's global generator, as ``torch.nn`` modules are initialised, so that
      ``torch.manual_seed`` governs it).

    Args:
        n_input_dims: D, 2, 3 or 4.
        encoding_config: (tcnn's call shape) tcnn's encoding dict, read as above.
        n_levels: number of levels L.
        n_features_per_level: F, 1, 2, 4 or 8.
        log2_hashmap_size: log2 of the maximum entries per level.
        base_resolution: resolution parameter of level 0.
        per_level_scale: growth factor of the scale between levels.
        interpolation: "Linear", "Smoothstep" or "Nearest".
        backend: "torch", "tcnn", "triton", or "auto" (on CUDA the fastest measured that
            imports: triton, then tcnn; else torch; decided at each forward from the
            parameters' device, :meth:`resolved_backend`). "triton": Triton kernels with the
            twin's results (f32, half and bfloat16 forward to the bit, parameter gradients to
            float32 atomic-summation order) for float32
            ``params`` (no float64), on GPU tensors, or on CPU tensors under
            ``TRITON_INTERPRET=1`` (slow; for testing).
        dtype: float32, or float16 for tcnn's half mode (float32 master ``params``, half table
            reads and accumulation, half output, backward with tcnn's loss scale of 128), or
            bfloat16, which tcnn does not have (backends "torch" and "triton"; ``"auto"``
            resolves to "triton" on CUDA, or to "torch" with a warning without triton):
            the **parameters** stay the float32 master ``params``; the forward reads the
            table rounded to bfloat16, interpolates in float32 and returns bfloat16; the
            **gradients** are the float32 path's on the bfloat16 ``dL/dy``, summed in float32
            into a float32 ``params.grad`` (no loss scale: bfloat16 has float32's range); the
            **optimizer state** is therefore float32 too (Adam's moments of the f32 masters).
            What it saves is the table's bytes read per lookup on hardware that reads a
            bfloat16 copy; the twin and the Triton kernels gather from the f32 table and
            round.
        device: where ``params`` is created.
        seed: seed of the uniform [-1e-4, 1e-4] initialisation (tcnn's range); None draws
            from torch's global generator.
        grid_type: "Hash" or "Dense" (tcnn's ``type``).
        exp2: how the level scales' ``exp2f`` is evaluated (see ``grid_geometry``):
            "auto" (default) uses tcnn's own instruction, PTX ``ex2.approx.ftz.f32``, on the
            CUDA device a forward runs on (NVIDIA GPUs with Triton; computed once), and the
            correctly rounded value elsewhere (tcnn's within 0..+1 float32 ulp, measured on an
            H100); "correctly-rounded", "cuda-ex2" or "h100-table" (tcnn's values measured on
            an H100 for the inputs of three configs) force one.

    Attributes:
        params: [n_params] float32 parameter, entry ``i`` of level ``l``, feature ``f`` at
            ``(offsets[l] + i) * F + f``.
        n_params: the length of ``params``.
        n_output_dims: L * F.
        geometry: the per-level constants (scales, resolutions, table offsets).

    Raises:
        ValueError: naming the argument or ``encoding_config.<key>``, for a value out of range,
            of the wrong type, or not implemented.
        TypeError: for arguments that fit neither call shape (as Python's own).
    """

    def __init__(self, n_input_dims: int, *args: Any, **kwargs: Any) -> None:
        # Two call shapes, told apart by the second argument (a config, or n_levels); the
        # keyword form's signature is _build's, tcnn's is _tcnn_call_shape's.
        super().__init__()
        if (args and isinstance(args[0], Mapping)) or "encoding_config" in kwargs:
            call = _TCNN_CALL.bind(n_input_dims, *args, **kwargs)
            call.apply_defaults()
            tcnn_call = call.arguments
            dtype = tcnn_call["dtype"]
            self._build(
                n_input_dims,
                **_grid_kwargs_from_tcnn(tcnn_call["encoding_config"], "encoding_config"),
                # tcnn's preferred precision: half wherever it was built with half support.
                dtype=torch.float16 if dtype is None else dtype,
                seed=tcnn_call["seed"],
                backend=tcnn_call["backend"],
                device=tcnn_call["device"],
            )
        else:
            self._build(n_input_dims, *args, **kwargs)

    def _build(
        self,
        n_input_dims: int,
        n_levels: int = 16,
        n_features_per_level: int = 2,
        log2_hashmap_size: int = 19,
        base_resolution: int = 16,
        per_level_scale: float = 2.0,
        interpolation: str = "Linear",
        backend: Backend = "auto",
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        seed: int | None = None,
        grid_type: str = "Hash",
        exp2: str = "auto",
    ) -> None:
        n_input_dims = _check_int("n_input_dims", n_input_dims, 2, 4)
        n_levels = _check_int("n_levels", n_levels, 1, 32)
        seed = check_seed("seed", seed, allow_none=True)
        if as_int(n_features_per_level) not in (1, 2, 4, 8):
            raise ValueError(
                f"n_features_per_level must be 1, 2, 4 or 8, got {n_features_per_level!r}"
            )
        n_features_per_level = int(n_features_per_level)
        log2_hashmap_size = _check_int("log2_hashmap_size", log2_hashmap_size, 1, 30)
        base_resolution = _check_int("base_resolution", base_resolution, 1, _MAX_RESOLUTION)
        if (
            isinstance(per_level_scale, bool)
            or not isinstance(per_level_scale, Real)
            or not math.isfinite(per_level_scale)
            or per_level_scale < 1.0
        ):
            raise ValueError(
                f"per_level_scale must be a finite number >= 1, got {per_level_scale!r}"
            )
        finest = math.log2(base_resolution) + (n_levels - 1) * math.log2(per_level_scale)
        if finest > math.log2(_MAX_RESOLUTION):
            raise ValueError(
                f"per_level_scale must keep the finest resolution, base_resolution * "
                f"per_level_scale**(n_levels - 1), at most 2**24 (float32 grid coordinates), "
                f"got {per_level_scale!r} (2**{finest:.1f})"
            )
        if interpolation not in INTERPOLATIONS:
            raise ValueError(
                f"interpolation must be one of {INTERPOLATIONS}, got {interpolation!r}"
            )
        if grid_type not in GRID_TYPES:
            raise ValueError(f"grid_type must be one of {GRID_TYPES}, got {grid_type!r}")
        if exp2 not in ("auto", *EXP2_MODES):
            raise ValueError(f"exp2 must be one of {('auto', *EXP2_MODES)}, got {exp2!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if dtype not in _DTYPES:
            raise ValueError(
                f"dtype must be torch.float32, torch.float16 or torch.bfloat16, got {dtype!r}"
            )
        if dtype == torch.bfloat16 and backend == "tcnn":
            raise ValueError(
                "dtype: tcnn has no bfloat16 grid; torch.bfloat16 runs on backend 'torch', "
                f"'triton' or 'auto', got backend {backend!r}"
            )
        self.config = dict(
            n_levels=n_levels,
            n_features_per_level=n_features_per_level,
            log2_hashmap_size=log2_hashmap_size,
            base_resolution=base_resolution,
            per_level_scale=float(per_level_scale),
            interpolation=interpolation,
            type=grid_type,
        )
        self.n_input_dims = n_input_dims
        self.dtype = dtype
        self.backend = backend
        self.exp2 = exp2
        self._geometry_args = (
            n_input_dims,
            n_levels,
            n_features_per_level,
            log2_hashmap_size,
            base_resolution,
            per_level_scale,
            interpolation,
            grid_type,
        )
        self.geometry = grid_geometry(
            *self._geometry_args, exp2="correctly-rounded" if exp2 == "auto" else exp2
        )
        self._cuda_geometry: GridGeometry | None = None
        # Refuse what cannot fit before allocating: the f32 table plus the temporaries of its
        # initialisation (two vectors of its size at once), drawn on the CPU whatever the
        # device (the same values everywhere for a seed), then on the device.
        needed = 2 * 4 * self.geometry.n_params
        for where in dict.fromkeys((torch.device("cpu"), torch.device(device or "cpu"))):
            available = _backends.available_bytes(where)
            if available is not None and needed > available:
                raise ValueError(
                    f"log2_hashmap_size: {n_levels} levels of up to 2**{log2_hashmap_size} "
                    f"entries x {n_features_per_level} features need {needed / 2**30:.1f} GiB "
                    f"to build, only {available / 2**30:.1f} GiB is available on {where}"
                    " (lower log2_hashmap_size or n_levels)"
                )
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        initial = torch.rand(self.geometry.n_params, generator=generator) * 2e-4 - 1e-4
        self.params = nn.Parameter(initial.to(device))
        self._tcnn_module = None  # built lazily: tinycudann is imported only when used
        if backend == "tcnn":
            _backends.import_tcnn()  # fail at construction, not at the first forward
        elif backend == "triton":
            _backends.import_triton()

    @classmethod
    def from_tcnn_config(
        cls, n_input_dims: int, config: Mapping[str, Any], **kwargs: Any
    ) -> HashGridEncoding:
        """Build from the dict passed to ``tinycudann.Encoding`` (nvdiffrec's ``enc_cfg``), with
        mptex's defaults for the rest.

        The config is read as in tcnn's call shape (the class docstring); ``kwargs`` go to the
        keyword form (``backend``, ``dtype`` default float32, ``device``, ``seed`` default
        None), where ``HashGridEncoding(n_input_dims, config)`` has tcnn's (float16, 1337).
        """
        return cls(n_input_dims, **_grid_kwargs_from_tcnn(config, "config"), **kwargs)

    def tcnn_config(self) -> dict[str, Any]:
        """The equivalent ``tinycudann.Encoding`` config dict."""
        config = dict(self.config)
        config["otype"] = "Grid"
        return config

    @property
    def n_params(self) -> int:
        return self.geometry.n_params

    @property
    def n_output_dims(self) -> int:
        return self.geometry.n_output_dims

    def resolved_backend(self) -> str:
        """The backend the next forward uses ("torch", "tcnn" or "triton").

        ``"auto"`` takes what was measured fastest for forward+backward on the device: on
        CUDA, Triton where it imports and ``params`` are float32 (nvdiffrec's grid on an
        H100: 1.51-1.65x tcnn's throughput in float32 and 1.13-1.22x in half, and the only
        fast bfloat16 grid: 4.4-6.4x the torch twin; docs/gpu.md), else tcnn (float32 and
        half), else the torch twin (with a warning); the twin off CUDA, and for float64
        ``params`` (after ``.double()``, for gradcheck), which neither kernel computes in.
        """
        if self.backend != "auto":
            return self.backend
        if self.params.device.type != "cuda" or self.params.dtype != torch.float32:
            return "torch"
        if _backends.has_triton():
            return "triton"
        if self.dtype == torch.bfloat16:
            _backends.warn_fallback_once(
                "HashGridEncoding(backend='auto', dtype=torch.bfloat16)",
                "tcnn has no bfloat16 grid and triton is not importable",
            )
            return "torch"
        if _backends.has_tcnn():
            return "tcnn"
        _backends.warn_fallback_once(
            "HashGridEncoding(backend='auto')", "neither triton nor tinycudann is importable"
        )
        return "torch"

    def _check_input(self, x: torch.Tensor, values: bool = True) -> None:
        if not isinstance(x, torch.Tensor):
            raise ValueError(
                f"x must be a torch.Tensor of shape [N, {self.n_input_dims}], got {type(x)}"
            )
        if x.dim() != 2 or x.shape[1] != self.n_input_dims:
            raise ValueError(f"x must have shape [N, {self.n_input_dims}], got {list(x.shape)}")
        if self.params.dtype not in (torch.float32, torch.float64):
            # A module-wide .half() / .to(torch.bfloat16) casts the master table; the backward
            # cannot scatter float32 gradients into it, and tcnn's contract is an f32 master.
            raise ValueError(
                f"params: expected float32 master parameters (float64 after .double(), for "
                f"gradcheck), got {self.params.dtype}: the grid computes in dtype= "
                f"({self.dtype}) from an f32 table, so cast the module with .float(), not "
                ".half() or .to(torch.bfloat16)"
            )
        allowed = (
            (torch.float32, torch.float64)
            if self.params.dtype == torch.float64
            else (torch.float32,)
        )
        if x.dtype not in allowed:
            expected = " or ".join(map(str, allowed))
            raise ValueError(f"x must be {expected} (params: {self.params.dtype}), got {x.dtype}")
        if x.device != self.params.device:
            raise ValueError(f"x is on {x.device} but params are on {self.params.device}")
        if not values:
            return
        # One reduction and one sync for both checks: NaN fails the comparison. The grid's
        # domain is [0, 1]; tcnn wraps points outside it, which stays defined while the finest
        # level's coordinate pos = scale * x + 0.5 is an exact float32 integer range.
        limit = _MAX_RESOLUTION / max(self.geometry.scales[-1], 1.0)
        largest = float(x.detach().abs().max()) if x.numel() else 0.0
        if not math.isfinite(largest):
            raise ValueError("x contains non-finite values (inf or NaN)")
        if largest > limit:
            raise ValueError(
                f"x must lie within |x| <= {limit:.4g} (the domain is [0, 1]; beyond the limit "
                "the finest level's float32 grid coordinates are no longer exact), got values up "
                f"to {largest:g}"
            )

    def forward(self, x: torch.Tensor, *, check_values: bool = True) -> torch.Tensor:
        """Encode points.

        Args:
            x: [N, D] float32 in [0, 1] (float64 allowed after ``.double()``, for gradcheck);
                values outside wrap as in tcnn, but must be finite and within
                ``|x| <= 2**24 / scale`` of the finest level (``ValueError`` naming ``x``).
            check_values: check that (one reduction and one read on the host, which waits for
                a device); False for a caller whose points are in [0, 1] by construction
                (shape, dtype and device are checked either way).

        Returns:
            [N, n_output_dims] in ``dtype`` (float64 after ``.double()``), level-major.

        Raises:
            ValueError: naming ``x`` (shape, dtype, device, values) or ``params`` (a table
                cast to float16 or bfloat16 by a module-wide ``.half()``: the master stays
                float32, ``dtype`` is the compute dtype).
        """
        self._check_input(x, check_values)
        x = x.contiguous()
        forward = {
            "torch": self._forward_torch,
            "tcnn": self._forward_tcnn,
            "triton": self._forward_triton,
        }[self.resolved_backend()]
        return forward(x)

    def geometry_on(self, device: torch.device) -> GridGeometry:
        """The geometry the twin uses on ``device``: with ``exp2="auto"`` on an NVIDIA CUDA
        device where Triton compiles, the level scales come from the device's own
        ``ex2.approx.ftz.f32`` (tcnn's, computed once); elsewhere ``self.geometry``."""
        if self.exp2 != "auto" or device.type != "cuda" or torch.version.hip is not None:
            return self.geometry
        if self._cuda_geometry is None:
            if not _backends.has_triton():
                _backends.warn_fallback_once(
                    "HashGridEncoding(exp2='auto') on CUDA",
                    "Triton is not importable: correctly rounded level scales (tcnn's within "
                    "one float32 ulp)",
                )
                return self.geometry
            self._cuda_geometry = grid_geometry(*self._geometry_args, exp2="cuda-ex2")
        return self._cuda_geometry

    def _forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        out_dtype = torch.float64 if self.params.dtype == torch.float64 else self.dtype
        return hash_grid_encode(x, self.params, self.geometry_on(x.device), out_dtype)

    def _forward_triton(self, x: torch.Tensor) -> torch.Tensor:
        _backends.import_triton()
        from mptex._grid_triton import hash_grid_encode_triton  # imports triton: only here

        geometry = self.geometry_on(x.device)
        return hash_grid_encode_triton(x, self.params, geometry, self.dtype)

    @on_operand_device  # tinycudann, too, works on the current device
    def _forward_tcnn(self, x: torch.Tensor) -> torch.Tensor:
        if self.params.device.type != "cuda":
            raise RuntimeError(
                f"backend 'tcnn' needs the module on CUDA, params are on {self.params.device}"
            )
        if self.params.dtype != torch.float32:
            raise RuntimeError(
                f"backend 'tcnn' needs float32 master params, got {self.params.dtype}"
            )
        tcnn = _backends.import_tcnn()
        native = _backends.tcnn_module_sharing(
            self, lambda: tcnn.Encoding(self.n_input_dims, self.tcnn_config(), dtype=self.dtype)
        )
        return native(x)

    def extra_repr(self) -> str:
        cfg = self.config
        return (
            f"n_input_dims={self.n_input_dims}, n_levels={cfg['n_levels']}, "
            f"n_features_per_level={cfg['n_features_per_level']}, "
            f"log2_hashmap_size={cfg['log2_hashmap_size']}, "
            f"base_resolution={cfg['base_resolution']}, "
            f"per_level_scale={cfg['per_level_scale']:.6g}, "
            f"interpolation={cfg['interpolation']!r}, "
            f"backend={self.backend!r}, dtype={_DTYPES.get(self.dtype)}, n_params={self.n_params}"
        )


def _tcnn_call_shape(
    n_input_dims: int,
    encoding_config: Mapping[str, Any],
    seed: int = 1337,
    dtype: torch.dtype | None = None,
    *,
    backend: Backend = "auto",
    device: torch.device | str | None = None,
) -> None:
    """``tinycudann.Encoding``'s parameters (bindings/torch/tinycudann/modules.py), with mptex's
    ``backend`` and ``device`` after them: what :class:`HashGridEncoding` binds its arguments to
    when the second one is a config."""


_TCNN_CALL = inspect.signature(_tcnn_call_shape)
