"""``python -m mptex.cli``: ``mptex-train``."""

from mptex.cli.train import train_main

train_main()
