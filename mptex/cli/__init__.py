"""Every command of mptex, one module each:

==================  =============================  ============================================
command             module                         what
==================  =============================  ============================================
``mptex-train``     :mod:`mptex.cli.train`         train a texture; ``-m`` sweeps into a report
``mptex-search``    :mod:`mptex.cli.search`        the precision search
``mptex-report``    :mod:`mptex.cli.report`        the ablation report of a sweep
``mptex-check``     :mod:`mptex.cli.check`         where two setups part ways (f64 reference)
``mptex-export``    :mod:`mptex.cli.export`        bake a finished run into OBJ/MTL/PNG/GLB
``mptex-rescore``   :mod:`mptex.cli.rescore`       score finished runs again, other validation
==================  =============================  ============================================

Argument parsing, exit codes and one-line errors live here; the work is done by the library
(``mptex.train``, ``mptex.search``, ``mptex.report``, ``mptex.diagnostics``, ``mptex.bake``),
which never imports this package. ``python -m mptex.cli`` is ``mptex-train``.
"""

from mptex._paths import CONFIG_DIR, EXPERIMENTS_DIR
from mptex.cli.app import EXIT_CODES, job_dirname, register_experiments
from mptex.cli.train import train_main

# the name benchmark scripts and older code use
from mptex.train.runinfo import reproducible_blas as _reproducible_blas  # noqa: F401

__all__ = [
    "CONFIG_DIR",
    "EXPERIMENTS_DIR",
    "EXIT_CODES",
    "job_dirname",
    "register_experiments",
    "train_main",
]
