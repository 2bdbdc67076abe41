"""Precision diagnostics: where an MLPTexture3D loses precision, and whether two setups agree.

Tools, all for :class:`~mptex.MLPTexture3D` (the encoder and each MLP layer are "sites"):

* :class:`PrecisionMonitor`: training-time statistics, sampled every ``every`` iterations, cheap
  enough to leave on: per site, the fraction of gradient elements that are zero or subnormal in
  the compute dtype (underflow), inf/NaN fractions (overflow) and activation max-abs.
* :func:`compare_setups` (the ``mptex-check`` command): the same weights and points under two
  setups (precision arms, encoder backends, devices, grad/no_grad, train/eval), every stage
  compared with a float64 CPU reference against a per-stage bound of what its dtypes explain.
* :func:`check_gradient_flow`: every trainable parameter receives a finite, non-zero gradient.
* :func:`saturation_statistics`: per output channel, the fraction of the texture's logits where
  its output sigmoid saturates (``|z| > 8``), and of those the ones that are wrong ("stuck", the
  signature of a collapsed run); measured at every validation by ``mptex-train``.
* :func:`half_ulps`, :func:`ulp_summary`, :func:`outside_tolerance`: how far a twin's results are
  from the native library's, in float16 ULPs and against a stated tolerance.

And :func:`to_host`, the one synchronous device-to-host copy the code above reads results with.
"""

from mptex.diagnostics.compare import (
    TEXTURE_CONFIGS,
    TRAINING_COTANGENT_SCALE,
    CheckReport,
    Setup,
    StageError,
    build_texture,
    compare_setups,
)
from mptex.diagnostics.flow import check_gradient_flow
from mptex.diagnostics.ulp import half_ulps, outside_tolerance, ulp_summary
from mptex.host import to_host
from mptex.train.monitor import PrecisionMonitor, subnormal_threshold, tensor_statistics
from mptex.train.saturation import (
    SATURATION_LOGIT,
    STUCK_TOLERANCE,
    saturated_counts,
    saturation_statistics,
)

__all__ = [
    "to_host",
    "tensor_statistics",
    "subnormal_threshold",
    "PrecisionMonitor",
    "SATURATION_LOGIT",
    "STUCK_TOLERANCE",
    "saturated_counts",
    "saturation_statistics",
    "check_gradient_flow",
    "Setup",
    "StageError",
    "CheckReport",
    "compare_setups",
    "build_texture",
    "TEXTURE_CONFIGS",
    "TRAINING_COTANGENT_SCALE",
    "half_ulps",
    "ulp_summary",
    "outside_tolerance",
]
