"""The nvdiffrec-style texture training loop behind ``mptex-train``.

One concept per module:

* :mod:`~mptex.train.config`: the ``train`` group's defaults and every check made at start;
* :mod:`~mptex.train.losses`: the learning-rate schedule, nvdiffrec's image losses, PSNR;
* :mod:`~mptex.train.fused_loss`: the training loss's image term masked by the reference alpha,
  eager or in two Triton kernels (:mod:`~mptex.train._loss_triton`);
* :mod:`~mptex.train.shading`: shading, compositing, rendering views of a texture;
* :mod:`~mptex.train.validation`: validation PSNR, the constant-colour baseline, images;
* :mod:`~mptex.train.checkpoint`: atomic writes, ``metrics.json``, ``checkpoint.pt``;
* :mod:`~mptex.train.rng`, :mod:`~mptex.train.memory`, :mod:`~mptex.train.runinfo`: seeds and
  generator state, peak memory, device and versions;
* :mod:`~mptex.train.loop`: :func:`train`, the iteration itself (its docstring states it).
"""

from mptex.train.checkpoint import (
    atomic_write_bytes,
    load_checkpoint,
    load_texture,
    save_checkpoint,
    write_metrics,
)
from mptex.train.config import TRAIN_DEFAULTS, ConfigError, validate_config
from mptex.train.loop import METRICS_KEYS, train
from mptex.train.losses import LOSSES, image_loss, lr_schedule, psnr
from mptex.train.shading import composite, shade
from mptex.train.validation import evaluate

__all__ = [
    "ConfigError",
    "TRAIN_DEFAULTS",
    "METRICS_KEYS",
    "LOSSES",
    "lr_schedule",
    "image_loss",
    "shade",
    "composite",
    "psnr",
    "evaluate",
    "atomic_write_bytes",
    "write_metrics",
    "save_checkpoint",
    "load_checkpoint",
    "load_texture",
    "validate_config",
    "train",
]
