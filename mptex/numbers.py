"""What counts as a number in a measurement: the one test every reader of ``metrics.json``
values and every statistic shares (a NaN, an infinity, a bool or a missing value is not a
measurement)."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["is_number"]


def is_number(value: Any) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
