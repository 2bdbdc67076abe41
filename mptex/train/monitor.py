"""Training-time precision statistics: per site (the encoder and each MLP layer), the fraction of
gradient elements that are zero or subnormal in the compute dtype, inf/NaN fractions, activation
max-abs; and per output channel, the fraction of the batch's logits where the output sigmoid
saturates."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from mptex.host import to_host
from mptex.numbers import as_int
from mptex.precision import StepResult
from mptex.texture import MLPTexture3D
from mptex.train.saturation import SATURATION_LOGIT, saturated_counts


# --------------------------------------------------------------------------- statistics
def subnormal_threshold(dtype: torch.dtype) -> float:
    """Smallest positive normal number of ``dtype``: below it (and != 0) a value is subnormal.

    f16: 2**-14 (6.1e-5); bf16 and f32: 2**-126; f64: 2**-1022.
    """
    return float(torch.finfo(dtype).tiny)


def _counts(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[5] on ``tensor``'s device: zeros, values below ``tiny(dtype)`` (zeros included),
    finite values, numel, max |finite| (:func:`_fractions` turns them into the statistics).

    A gradient that reached an f32 master through a cast from ``dtype`` holds exactly the values
    ``dtype`` had, so counting ``0 < |g| < tiny(dtype)`` on it counts ``dtype``'s subnormals.
    Counted as the host subtracts them (subnormals = below tiny - zeros, non-finite = numel -
    finite: exact integers in float64).
    """
    acc = _accumulator(tensor.device)
    if tensor.numel() == 0:
        return torch.zeros(5, dtype=acc, device=tensor.device)
    below, largest = _partial_counts(tensor, dtype)
    numel = torch.full((1,), float(tensor.numel()), dtype=acc, device=tensor.device)
    return torch.cat([below, numel, largest.reshape(1).to(acc)])  # float64 numel: all float64


def _accumulator(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64


@functools.lru_cache(maxsize=32)
def _thresholds(tensor_dtype: torch.dtype, dtype: torch.dtype, device: torch.device):
    """``[3, 1]`` bounds ``b`` in ``tensor_dtype`` (f16, bf16 or f32) with ``|x| < b`` meaning:
    ``|x| == 0``, ``|x| < tiny(dtype)`` and ``|x|`` finite, for ``|x|`` in ``tensor_dtype``.

    The first is ``tensor_dtype``'s smallest positive (subnormal) value, below which only 0
    lies; ``tiny(dtype)`` is rounded to ``tensor_dtype``, as ``|x| < tiny`` with a Python float
    compares in ``tensor_dtype`` (the bound is 0 where it underflows there). Comparing in the
    tensor's own dtype converts nothing."""
    zero = torch.zeros((), dtype=tensor_dtype)
    smallest = torch.nextafter(zero, torch.ones((), dtype=tensor_dtype)).item()
    tiny = torch.tensor(subnormal_threshold(dtype), dtype=tensor_dtype).item()
    bounds = [smallest, tiny, float("inf")]
    return torch.tensor(bounds, dtype=tensor_dtype).reshape(3, 1).to(device)


# Counts of tensors below this many elements are summed in int32 (exact; a merge of two stays
# below 2**31): on a CPU a sum of booleans converts them to its dtype first, and int32 costs
# half of int64's or float64's. Larger tensors are summed in int64.
_INT32_COUNTS = 2**30


def _partial_counts(
    tensor: torch.Tensor, dtype: torch.dtype, largest: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``([3] counts of zeros, of values below tiny(dtype), of finite values; the largest
    finite |x|)`` of a non-empty ``tensor``, on its device: the counts as integers (f16, bf16
    and f32 tensors; float64 for float64 tensors, float32 on MPS), the largest in ``tensor``'s
    dtype (None unless ``largest``).

    The three counts are one comparison of ``|x|`` against three bounds (:func:`_thresholds`)
    and one sum: 5 ops per tensor, where a comparison and a sum per count are 8. The
    comparisons are those of ``|x| == 0``, ``|x| < tiny`` and ``|x| < inf`` (``|x|`` is >= 0 or
    NaN, and NaN compares false), so the counts are the same integers. They are summed as
    integers (int32 below :data:`_INT32_COUNTS` elements, else int64); whoever concatenates
    them with float64 values gets them exactly as float64."""
    acc = _accumulator(tensor.device)
    magnitude = tensor.detach().abs()
    if acc == torch.float64 and tensor.dtype in (torch.float16, torch.bfloat16, torch.float32):
        bounds = _thresholds(tensor.dtype, dtype, tensor.device)
        counts = torch.int32 if tensor.numel() < _INT32_COUNTS else torch.int64
        below = (magnitude.reshape(1, -1) < bounds).sum(dim=1, dtype=counts)
    else:  # float64 values (no normal bound below their subnormals) or no float64 (MPS)
        below = torch.stack([
            (magnitude == 0).sum(dtype=acc),
            (magnitude < subnormal_threshold(dtype)).sum(dtype=acc),
            (magnitude < float("inf")).sum(dtype=acc),
        ])  # fmt: skip
    if not largest:
        return below, None
    # inf and NaN as 0 in one op (magnitude >= 0): the largest finite value.
    return below, torch.nan_to_num(magnitude, nan=0.0, posinf=0.0).amax()


class _Tally:
    """A site's statistics merged over the sampled iteration's calls: the counts and (unless
    ``largest`` is False: output gradients report none) the largest value on the device, the
    element count on the host (1 or 2 ops per merge)."""

    __slots__ = ("below", "largest", "numel")

    def __init__(self, tensor: torch.Tensor, dtype: torch.dtype, largest: bool = True):
        acc = _accumulator(tensor.device)
        if tensor.numel():
            self.below, self.largest = _partial_counts(tensor, dtype, largest)
        else:
            self.below = torch.zeros(3, dtype=acc, device=tensor.device)
            self.largest = torch.zeros((), dtype=tensor.dtype, device=tensor.device)
        self.largest = self.largest if largest else None
        self.numel = tensor.numel()

    def merge(self, other: _Tally) -> _Tally:
        if self.numel + other.numel >= 2**31 and self.below.dtype == torch.int32:
            self.below = self.below.to(torch.int64)  # the sum could pass int32's range
        self.below = self.below + other.below.to(self.below.device)
        if self.largest is not None:
            self.largest = torch.maximum(self.largest, other.largest.to(self.largest.device))
        self.numel += other.numel
        return self

    def parts(self, device: torch.device) -> list[torch.Tensor]:
        """The device values :meth:`PrecisionMonitor.pending` reads: the 3 counts, the largest."""
        parts = [self.below.to(device)]
        return parts if self.largest is None else parts + [self.largest.reshape(1).to(device)]


def _fractions(counts: list[float]) -> dict[str, float]:
    zero, below_tiny, finite, numel, maxabs = counts
    subnormal, nonfinite = below_tiny - zero, numel - finite  # exact: integers in float64
    numel = max(numel, 1.0)
    return {
        "zero_frac": zero / numel,
        "subnormal_frac": subnormal / numel,
        "nonfinite_frac": nonfinite / numel,
        "maxabs": maxabs,
    }


def tensor_statistics(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> dict[str, float]:
    """Underflow/overflow statistics of one tensor (what :class:`PrecisionMonitor` records).

    Args:
        tensor: any shape, any float dtype, any device.
        dtype: the dtype whose subnormal range counts (default: ``tensor.dtype``). Pass the
            compute dtype when ``tensor`` is an f32 copy of a lower-precision value.

    Returns:
        ``{"zero_frac", "subnormal_frac", "nonfinite_frac", "maxabs"}``: fractions of the
        elements that are exactly 0, subnormal in ``dtype`` (``0 < |x| < tiny(dtype)``), inf or
        NaN; and the largest finite ``|x|`` (0.0 for an empty tensor). One host copy.
    """
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        raise ValueError(f"tensor: expected a floating-point torch.Tensor, got {tensor!r}")
    return _fractions(to_host(_counts(tensor, dtype or tensor.dtype)).tolist())


def _site_params(texture: MLPTexture3D) -> list[tuple[str, str, nn.Parameter, torch.dtype]]:
    """(site, key suffix, parameter, compute dtype) for every trainable parameter."""
    policy = texture.policy
    sites = [("encoder", "", texture.encoder.params, texture.encoder.dtype)]
    if not texture.net.layers:  # tcnn FullyFusedMLP: one flat f16 parameter
        sites += [("net", "", p, torch.float16) for p in texture.net.parameters()]
    for index, layer in enumerate(texture.net.layers):
        dtype = layer.compute_dtype or policy.mlp_dtypes[0]
        sites.append((f"net.{index}", "", layer.weight, dtype))
        if layer.bias is not None:
            sites.append((f"net.{index}", ".bias", layer.bias, dtype))
    return [site for site in sites if site[2].requires_grad]


def _site_modules(texture: MLPTexture3D) -> list[tuple[str, nn.Module, torch.dtype]]:
    policy = texture.policy
    modules = [("encoder", texture.encoder, texture.encoder.dtype)]
    if not texture.net.layers:
        modules.append(("net", texture.net, torch.float16))
    for index, layer in enumerate(texture.net.layers):
        modules.append((f"net.{index}", layer, layer.compute_dtype or policy.mlp_dtypes[0]))
    return modules


class PrecisionMonitor:
    """Per-site underflow/overflow statistics of an :class:`~mptex.MLPTexture3D`, sampled.

    Sites: ``encoder`` (the hash grid: its output and its table ``params``) and ``net.<i>``, the
    ``i``-th linear layer of ``texture.net.layers`` (``net.0`` is the input layer; state-dict key
    ``net.net.<2i>.weight``); ``net`` for tcnn's fused MLP. Per sampled iteration, keys
    (all floats, fractions in [0, 1]):

    ==============================  ===========================================================
    ``<site>.act_maxabs``           largest finite ``|output|`` of the site (its compute dtype)
    ``<site>.act_nonfinite_frac``   fraction of outputs that are inf/NaN (forward overflow)
    ``<site>.out_grad_zero_frac``   fraction of dL/d(output) elements that are exactly 0
    ``<site>.out_grad_subnormal_frac``  ... that are subnormal in the compute dtype
    ``<site>.out_grad_nonfinite_frac``  ... that are inf/NaN (backward overflow)
    ``<site>.grad_zero_frac``       fraction of the parameter gradient that is exactly 0
    ``<site>.grad_subnormal_frac``  ... subnormal in the compute dtype (about to underflow)
    ``<site>.grad_nonfinite_frac``  ... inf/NaN
    ``<site>.grad_maxabs``          largest finite ``|grad|``
    ``net.<i>.fused_<name>``        the fused network's twin only (tcnn's FullyFusedMLP, layer
                                    ``i``): its half-arithmetic statistics of the weight
                                    gradient, ``FullyFusedMLP.last_stats`` (``absorbed_frac``:
                                    non-zero contributions the half accumulator flushed;
                                    ``zero_frac``/``subnormal_frac`` after the half ``/ scale``;
                                    ``flushed_by_unscale_frac``; ``scaled_*`` before it)
    ``output.saturated_frac.<c>``   fraction of the batch's logits in output channel ``c``
                                    (the texture's MLP output, before the sigmoid) with
                                    ``|z| > 8`` (:data:`~mptex.train.saturation.
                                    SATURATION_LOGIT`): the sigmoid's gradient there is below
                                    3.4e-4 (the validation's ``stuck_fraction`` says
                                    which of them are also wrong)
    ``net.<i>.q_<role>_<name>``     quantised arms only (:attr:`~mptex.PrecisionPolicy.quantized`),
                                    layer ``i``'s quantisation: FP8 GEMMs (roles ``input``,
                                    ``weight``, ``grad``; :meth:`~mptex.mlp.FP8Linear.
                                    quant_statistics`): ``amax`` and ``scale`` of the
                                    iteration's last call, ``overflows`` and ``nonfinite``
                                    (counts since the start), ``rel_error`` (``||q - x|| /
                                    ||x||``) and ``underflow_frac`` (non-zero values quantised
                                    to 0); fake-quantised weights (``w_rel_error``,
                                    ``w_underflow_frac``)
    ``loss_scale``, ``skipped``     from the :class:`~mptex.StepResult` (scale after the update)
    ``iteration``
    ==============================  ===========================================================

    (``.bias`` is inserted before ``.grad_`` for layers with a bias.) Gradients are recorded as
    the backward pass produces them, i.e. *scaled* by the loss scale and before GradScaler
    unscales them: the numbers show what the compute dtype had to represent, which is why loss
    scaling helps. A gradient that reaches an f32 master through a cast holds exactly the
    compute-dtype values, so zeros/subnormals are counted with the compute dtype's threshold
    (f16: ``0 < |g| < 2**-14``; bf16: ``2**-126``). The encoder table's ``grad_zero_frac``
    includes the rows no point of the batch touched; its ``out_grad_*`` (dense) is the one to
    read for underflow. With ``loss_scaling="nvdiffrec"`` the table gradient carries nvdiffrec's
    x128.

    Call order in a training loop (with :class:`~mptex.PrecisionStepper`)::

        monitor = PrecisionMonitor(texture, every=50)
        for it in range(n):
            optimizer.zero_grad(set_to_none=True)
            monitor.start(it)                     # arms the hooks when it % every == 0
            loss = loss_fn(texture.sample(points), target)    # forward hooks: activations
            stepper.backward(loss)                # tensor hooks: scaled compute-dtype grads
            result = stepper.step()
            stats = monitor.collect(result)       # dict on sampled iterations, else None
            if stats is not None:
                history.append({"iteration": it, "loss": ..., **stats})

    ``start`` goes right before the training forward: any forward/backward of the texture
    between ``start`` and ``collect`` is included (several ``sample`` calls, e.g. the smoothness
    regulariser's with ``train.kd_smooth_joint=false``, are merged: counts summed, max-abs
    maxed). Validation forwards
    should not run in between. On other iterations the hooks return at once.

    Cost on a sampled iteration: a few elementwise reductions per site, all on the device, and
    ONE synchronous device-to-host copy in :meth:`collect` (everything stacked first).

    Args:
        texture: the texture being trained (hooks are registered on its modules and params).
        every: sample iterations with ``iteration % every == 0`` (> 0).

    Call :meth:`remove` to detach the hooks.
    """

    def __init__(self, texture: MLPTexture3D, every: int = 50):
        if not isinstance(texture, MLPTexture3D):
            raise ValueError(f"texture: expected an MLPTexture3D, got {type(texture).__name__}")
        if as_int(every) is None or every < 1:
            raise ValueError(f"every: expected a positive integer, got {every!r}")
        self.texture, self.every = texture, int(every)
        self._armed = False
        self._iteration: int | None = None
        self._acc: dict[str, torch.Tensor] = {}
        # [saturated count per channel..., rows]: the texture's logits, merged over forwards.
        self._saturation: torch.Tensor | None = None
        self._handles = []
        # The fused network's twin counts what its half accumulators flush inside its backward
        # (invisible to tensor hooks); tcnn's real network has no such hook.
        fused = texture.net.net if texture.policy.mlp == "fused" else None
        self._fused = fused if fused is not None and fused.resolved_backend() == "torch" else None
        # FP8 and fake-quantised layers keep their own statistics (scales, amaxes, errors).
        self._quantized = [
            (index, layer)
            for index, layer in enumerate(texture.net.layers)
            if hasattr(layer, "quant_statistics")
        ]
        for site, module, dtype in _site_modules(texture):
            self._handles.append(module.register_forward_hook(self._forward_hook(site, dtype)))
        for site, suffix, param, dtype in _site_params(texture):
            self._handles.append(param.register_hook(self._record(f"{site}{suffix}.grad", dtype)))
        self._handles.append(texture.net.register_forward_hook(self._record_saturation))

    def _record_saturation(self, module, inputs, logits) -> None:
        if not self._armed or not isinstance(logits, torch.Tensor) or logits.ndim != 2:
            return
        counts = saturated_counts(logits, SATURATION_LOGIT)
        counts = torch.cat([counts, counts.new_full((1,), logits.shape[0])])
        old = self._saturation
        self._saturation = counts if old is None else old + counts.to(old.device)

    def _record(self, key: str, dtype: torch.dtype) -> Callable[[torch.Tensor], None]:
        def hook(tensor: torch.Tensor) -> None:
            if self._armed:
                tally = _Tally(tensor, dtype, largest=not key.endswith(".out_grad"))
                old = self._acc.get(key)
                self._acc[key] = tally if old is None else old.merge(tally)

        return hook

    def _forward_hook(self, site: str, dtype: torch.dtype):
        record_act, record_grad = (
            self._record(f"{site}.act", dtype),
            self._record(f"{site}.out_grad", dtype),
        )

        def hook(module, inputs, output) -> None:
            if not self._armed or not isinstance(output, torch.Tensor):
                return
            record_act(output)
            if output.requires_grad:
                output.register_hook(record_grad)

        return hook

    def should_sample(self, iteration: int) -> bool:
        """Whether ``iteration`` is a sampled one (``iteration % every == 0``)."""
        return iteration % self.every == 0

    def start(self, iteration: int) -> bool:
        """Arm the hooks for this iteration if it is sampled; returns whether it is."""
        self._acc.clear()
        self._saturation = None
        self._iteration = iteration
        self._armed = self.should_sample(iteration)
        if self._fused is not None:
            self._fused.collect_stats = self._armed
        for _, layer in self._quantized:
            layer.collect_stats = self._armed
        return self._armed

    def collect(self, result: StepResult | None = None) -> dict[str, float] | None:
        """The statistics recorded since :meth:`start` (None on an iteration not sampled).

        Args:
            result: this iteration's :meth:`PrecisionStepper.step` result, for ``loss_scale``
                and ``skipped`` (omitted from the dict when None).

        Returns:
            A flat dict of floats (JSON-serialisable), keys in the class docstring, sorted.
        """
        pending = self.pending()
        if pending is None:
            return None
        flat, decode = pending
        return decode(None if flat is None else to_host(flat).tolist(), result)

    def pending(self):
        """:meth:`collect` in two halves, for a caller that reads other device values in the
        same host copy: None on an iteration not sampled, else ``(flat, decode)``: ``flat``, a
        1-D float64 tensor on the device (float32 on MPS) holding every statistic, or None
        when there is none; ``decode(values, result)``, the dict :meth:`collect` returns, from
        ``flat``'s values read on the host (a list of floats, None when ``flat`` is None)."""
        if not self._armed:
            return None
        self._armed = False
        keys = sorted(self._acc)
        saturation = self._saturation
        quantized = {
            f"net.{index}.q_{name}": value
            for index, layer in self._quantized
            for name, value in sorted(layer.quant_statistics().items())
        }
        for _, layer in self._quantized:
            layer.collect_stats = False
        # The fused twin's statistics: 0-d tensors its backward left on the device.
        fused_stats = {}
        if self._fused is not None:
            fused_stats = {
                f"net.{layer}.fused_{name}": value
                for layer, values in sorted(self._fused.last_stats_on_device.items())
                for name, value in sorted(values.items())
            }
            self._fused.collect_stats = False
        flat = None
        if keys or saturation is not None or quantized or fused_stats:
            first = self._acc[keys[0]].below if keys else saturation
            first = first if first is not None else next(iter([*quantized.values(),
                                                               *fused_stats.values()]))  # fmt: skip
            # float64 counts where the device has float64 (_counts' accumulator).
            device = first.device
            acc = torch.float32 if device.type == "mps" else torch.float64
            # Per site the counts and the largest (its element count stays on the host).
            parts = [part for k in keys for part in self._acc[k].parts(device)]
            if saturation is not None:
                parts.append(saturation.to(device))
            # Quantisation statistics, then the fused twin's, go last, one value each.
            parts += [value.reshape(1).to(device) for value in quantized.values()]
            parts += [value.reshape(1).to(device) for value in fused_stats.values()]
            # cat converts to the widest dtype: with its first part in float64 (float32 on
            # MPS), every part, the integer counts and the float32 and float16 values, is
            # converted exactly.
            parts[0] = parts[0].to(acc)
            flat = torch.cat(parts)
        numels = [self._acc[k].numel for k in keys]
        widths = [3 if self._acc[k].largest is None else 4 for k in keys]
        self._acc.clear()
        self._saturation = None
        iteration = self._iteration

        def decode(host, result: StepResult | None = None) -> dict[str, float]:
            stats: dict[str, float] = {"iteration": iteration}
            fused_values: list[float] = []
            if host is not None:
                host = list(host)
                if fused_stats:
                    fused_values, host = host[-len(fused_stats) :], host[: -len(fused_stats)]
                n_quantized = len(quantized)
                if n_quantized:
                    for key, value in zip(quantized, host[-n_quantized:], strict=True):
                        stats[key] = value
                    host = host[:-n_quantized]
                start = 0
                for index, key in enumerate(keys):
                    zero, below_tiny, finite, *maxabs = host[start : start + widths[index]]
                    start += widths[index]
                    fractions = _fractions([zero, below_tiny, finite, float(numels[index]),
                                            maxabs[0] if maxabs else 0.0])  # fmt: skip
                    wanted = ("maxabs", "nonfinite_frac") if key.endswith(".act") else fractions
                    if key.endswith(".out_grad"):
                        wanted = ("zero_frac", "subnormal_frac", "nonfinite_frac")
                    for name in wanted:
                        stats[f"{key}_{name}"] = fractions[name]
                if saturation is not None:
                    *per_channel, rows = host[start:]
                    for channel, count in enumerate(per_channel):
                        stats[f"output.saturated_frac.{channel}"] = count / max(rows, 1.0)
            stats.update(zip(fused_stats, fused_values, strict=True))
            if result is not None:
                stats["loss_scale"] = float(result.loss_scale)
                stats["skipped"] = bool(result.skipped)
            return stats

        return flat, decode

    def remove(self) -> None:
        """Remove every hook this monitor registered."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
