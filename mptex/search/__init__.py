"""Precision search: the cheapest per-part precision whose PSNR is certified against f32.

* :mod:`~mptex.search.config`: the ``search`` group's schema and its check;
* :mod:`~mptex.search.space`: the candidates (encoder dtype, each layer's dtype, master weights,
  loss scaling, linear or fused network) and which are pruned before training, with the reason;
* :mod:`~mptex.search.cost`: the stated cost model of one iteration on a named GPU;
* :mod:`~mptex.search.driver`: the search itself (screens, combinations, certification);
* :mod:`~mptex.search.pool`: the training runs, their worker processes and stop signals;
* :mod:`~mptex.search.results`: ``search.json``, the result's precision config, the search
  directory's record of its settings;
* :mod:`~mptex.search.report`: ``search.md`` and the Pareto figure.

``mptex-train +experiment=precision_search`` runs it (:func:`run_search`).
"""

from mptex.search.config import SEARCH_DEFAULTS, SearchError, check_search_config
from mptex.search.cost import GPUS, CostConfig, TextureShape, iteration_cost, shape_from_config
from mptex.search.driver import certify, run_search
from mptex.search.pool import SearchInterrupted
from mptex.search.report import pareto_front, write_search_report
from mptex.search.space import (
    SPACE_DEFAULTS,
    Candidate,
    SpaceConfig,
    enumerate_space,
    reference_candidate,
)

__all__ = [
    "Candidate",
    "SPACE_DEFAULTS",
    "enumerate_space",
    "reference_candidate",
    "GPUS",
    "TextureShape",
    "iteration_cost",
    "shape_from_config",
    "SpaceConfig",
    "CostConfig",
    "SEARCH_DEFAULTS",
    "SearchError",
    "SearchInterrupted",
    "certify",
    "check_search_config",
    "run_search",
    "pareto_front",
    "write_search_report",
]
