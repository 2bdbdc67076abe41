"""The checkout's ``pyproject.toml`` as a dict, on every Python mptex supports (>= 3.10).

``tomllib`` joined the standard library in Python 3.11; on 3.10 pytest itself depends on
``tomli`` (pytest >= 7 requires it there), the same parser under its first name.
"""

from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def pyproject() -> dict:
    """``pyproject.toml`` at the root of this checkout, parsed."""
    return tomllib.loads((ROOT / "pyproject.toml").read_text())
