"""The real-asset suite: textured OBJ meshes that users bring, of different character, on which
the measurement protocol is checked (docs/benchmarks.md, "Real assets").

The meshes are not part of mptex (nor of its repository): they come with the ``pybullet``
package's ``pybullet_data`` folder (zlib licence for the package; the assets are its demo data),
installed by ``pip install -e ".[assets]"`` (the ``test`` extra includes it). Only the
``pybullet_data`` directory is used, never the physics engine. Each asset is a scene of its own
name (``scene=duck``: configs/scene/duck.yaml, the mesh scene with ``path`` resolved here), so
the sweep report gives each asset its section.

========  ===================================  ================================================
name      file (in pybullet_data)              character
========  ===================================  ================================================
duck      duck.obj                             saturated flat colours (yellow body, black and
                                               white eye, orange beak): the collapse case
torus     torus/torus_textured.obj             high-frequency pattern: text and shapes, a
                                               texture referenced as ``../cube.png``
aliengo   aliengo/meshes/trunk.obj             photographic RGBA texture (1024²), quads and
                                               18-gons
soccer    soccerball.obj                       sharp black/white pentagon pattern, quads and
                                               triangles, palette colours
========  ===================================  ================================================
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SUITE", "SuiteAsset", "PACKAGE", "suite_available", "suite_path", "same_suite_asset"]

# The pinned package (its data never changed in 3.2.x; pinned so that the suite's numbers in
# docs/benchmarks.md are about the same files).
PACKAGE = "pybullet==3.2.7"


@dataclass(frozen=True)
class SuiteAsset:
    """One mesh of the suite: ``file`` relative to ``pybullet_data``, what it tests."""

    file: str
    character: str


SUITE: dict[str, SuiteAsset] = {
    "duck": SuiteAsset("duck.obj", "saturated flat colours"),
    "torus": SuiteAsset("torus/torus_textured.obj", "high-frequency pattern (text, shapes)"),
    "aliengo": SuiteAsset("aliengo/meshes/trunk.obj", "photographic RGBA texture, n-gons"),
    "soccer": SuiteAsset("soccerball.obj", "sharp two-colour pattern, quads"),
}


def suite_available() -> bool:
    """Whether ``pybullet_data`` (hence the suite's files) is importable."""
    return importlib.util.find_spec("pybullet_data") is not None


def suite_path(name: str) -> str:
    """The absolute path of suite asset ``name``'s OBJ file.

    Raises:
        ValueError: one line naming the asset, for an unknown name, a missing ``pybullet_data``
            (with the install command) or a missing file.
    """
    if name not in SUITE:
        raise ValueError(
            f"real-asset suite: unknown asset {name!r}; expected one of {sorted(SUITE)}"
        )
    if not suite_available():
        raise ValueError(
            f"real-asset suite: scene {name!r} is read from the pybullet package's pybullet_data, "
            f'which is not installed: pip install {PACKAGE} (or pip install -e ".[assets]")'
        )
    import pybullet_data

    path = Path(pybullet_data.getDataPath()) / SUITE[name].file
    if not path.is_file():
        raise ValueError(f"real-asset suite: {path} (asset {name!r}) not found in pybullet_data")
    return str(path)


def is_suite_file(name: str, path: object) -> bool:
    """Whether ``path`` is suite asset ``name``'s file where some machine's ``pybullet_data``
    holds it (a run's config stores the path as its machine resolved it)."""
    if name not in SUITE or not isinstance(path, str):
        return False
    tail = ("pybullet_data", *Path(SUITE[name].file).parts)  # the package's folder name
    return Path(path).parts[-len(tail) :] == tail


def same_suite_asset(name: str, path_a: str, path_b: str) -> bool:
    """Whether ``path_a`` and ``path_b`` are both suite asset ``name``'s file
    (:func:`is_suite_file`), each resolved on its own machine."""
    return is_suite_file(name, path_a) and is_suite_file(name, path_b)
