"""The tiny training run of the fault and kill-point tests: the torus knot at few segments,
24 x 24 views, the tiny texture and recipe (seconds per run on a CPU)."""

from __future__ import annotations

from hydra import compose, initialize_config_dir

from mptex.cli import CONFIG_DIR

TINY = [
    "train=tiny", "texture=tiny", "scene.resolution=24", "scene.n_train_views=2",
    "scene.n_val_views=1", "scene.tubular_segments=32", "scene.radial_segments=6",
]  # fmt: skip


def tiny_cfg(*overrides: str):
    """The composed config of :data:`TINY` and ``overrides`` (``scene=mesh`` without the
    knot's keys)."""
    base = TINY if "scene=mesh" not in overrides else TINY[:-2]  # the knot's keys
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("config", overrides=[*base, *overrides])
