"""The one synchronous device-to-host copy that results are read with."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


# --------------------------------------------------------------------------- host copies
def to_host(value: Any) -> Any:
    """Copy tensors (alone or inside dicts/lists/tuples) to CPU, synchronously.

    ``Tensor.to("cpu")`` without ``non_blocking`` returns only once the copy is complete, so the
    result can be read at once. A non-blocking device-to-host copy returns before the
    data has arrived and reads garbage unless the stream is synchronised first; mptex never
    makes one (``tests/test_diagnostics.py`` greps the package for it).

    Args:
        value: a tensor, or a (nested) dict/list/tuple (a namedtuple included) holding
            tensors; other leaves are kept.

    Returns:
        The same structure with every tensor detached and on the CPU.
    """
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu")
    if isinstance(value, Mapping):
        return {key: to_host(item) for key, item in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple: by position
        return type(value)(*(to_host(item) for item in value))
    if isinstance(value, (list, tuple)):
        return type(value)(to_host(item) for item in value)
    return value
