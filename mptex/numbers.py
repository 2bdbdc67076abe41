"""What counts as a number in a measurement: the one test every reader of ``metrics.json``
values and every statistic shares (a NaN, an infinity, a bool or a missing value is not a
measurement)."""

from __future__ import annotations

import math
from numbers import Integral
from typing import Any

__all__ = ["is_number", "as_int"]


def is_number(value: Any) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def as_int(value: Any) -> int | None:
    """``value`` as a Python ``int`` where it is an integer (an int, or a numpy integer such as
    one from ``np.arange``), else None: a bool (YAML's ``true`` is no count) and a float that
    happens to be whole are not integers."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        return None
    return int(value)
