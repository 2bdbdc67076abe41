"""The ``search`` config group (``experiments/precision_search.yaml`` sets every key).

:class:`SearchConfig` nests :class:`~mptex.search.space.SpaceConfig` (what the search varies)
and :class:`~mptex.search.cost.CostConfig` (where the cost is modelled);
:func:`check_search_config` checks a group against them before any training.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mptex.config_schema import (
    ConfigError,
    FilePath,
    Integer,
    Name,
    Number,
    OneOf,
    OrNull,
    check_group,
    defaults_of,
    setting,
)
from mptex.intervals import ADJUSTMENTS
from mptex.search.cost import CostConfig
from mptex.search.space import SpaceConfig

# SearchConfig is the group's schema and documentation; code reads the group through
# check_search_config. It stays out of __all__, mptex's public API, whose path parameters take
# str | os.PathLike: its config_dir is a YAML string (OmegaConf's structured configs allow no
# such union).
__all__ = ["SEARCH_DEFAULTS", "SearchError", "check_search_config"]

_MARGIN = Number(min=0, min_open=True)


class SearchError(ValueError):
    """A bad ``search`` config or a search directory that cannot be used; one line."""


@dataclass
class SearchConfig:
    """The ``search`` group: the precision search's seeds, margins and budget
    (:func:`mptex.search.run_search` states the method)."""

    name: str | None = setting(None, OrNull(Name()))
    """The result's precision arm name; null: ``search_<scene>`` (``my_search_<scene>`` where
    mptex ships a ``search_<scene>``: builtin, soccer)."""
    seed: int = setting(0, Integer(min=0))
    """The screens' seed; the certification runs at the next ``certify_seeds`` seeds (``seed +
    1, ..., seed + certify_seeds``: fresh, not the seed that chose the candidate)."""
    certify_seeds: int = setting(3, Integer(min=2, note="an interval needs two paired seeds"))
    """Seeds of a certification (the reference runs at all of them and at the screens')."""
    margin_db: float = setting(0.5, _MARGIN)
    """The report's equivalence margin (:data:`mptex.intervals.EQUIVALENCE_MARGIN_DB`)."""
    screen_db: float = setting(0.5, _MARGIN)
    """A one-seed screen passes when ``|PSNR - PSNR(f32)|`` is at most this."""
    max_combinations: int = setting(3, Integer(min=0))
    """Screens of combined lowerings."""
    max_variants: int = setting(4, Integer(min=0))
    """Screens of loss-scaling, master-weight and fused variants."""
    max_certify: int = setting(3, Integer(min=1))
    """Candidates run over the certification seeds, cheapest first (each a test of its own:
    with k tried, one truly outside the margin certifies with a chance up to k x 2.5 %)."""
    adjust: str = setting("none", OneOf(ADJUSTMENTS))
    """``none``: each certification's interval at 95 %; ``bonferroni``: at 1 - 0.05 /
    ``max_certify``, so that the chance that any candidate tried certifies although truly
    outside the margin is at most 2.5 % for the search as a whole."""
    workers: int = setting(2, Integer(min=1))
    """Training runs at a time, one process each."""
    threads: int = setting(1, Integer(min=1))
    """Torch threads per run."""
    space: SpaceConfig = field(default_factory=SpaceConfig)
    cost: CostConfig = field(default_factory=CostConfig)
    config_dir: str | None = setting(None, OrNull(FilePath(), "<search dir>/configs"))
    """Where ``precision/<name>.yaml`` is written (nothing goes into mptex's own configs)."""


SEARCH_DEFAULTS = defaults_of(SearchConfig)


def check_search_config(search: Mapping[str, Any] | None) -> dict[str, Any]:
    """``search`` with defaults filled in; :class:`SearchError` naming the first bad key."""
    search = dict(search or {})
    # ``enabled`` is accepted and kept as given (an early spelling of the experiment's switch).
    kept = {key: search.pop(key) for key in ("enabled",) if key in search}
    try:
        return {**check_group(SearchConfig, search, "search"), **kept}
    except ConfigError as exc:
        raise SearchError(str(exc)) from None
