"""Which ops of a training run give different bits with 1 and with 2 torch threads.

Trains ``mptex-train``'s config (composed with Hydra, any overrides) with 2 threads under a
``TorchDispatchMode`` that runs every op a second time with 1 thread, on copies of the
arguments the op writes (its other arguments are only read), and compares the outputs and the
written arguments bit for bit. The run goes on with the 2-thread results, so it follows the
2-thread trajectory. Random ops (``rand``, ``normal``, ...) run once: a second draw would move
the generator; ``empty*`` ops are skipped (uninitialised memory). Prints each differing op (the
first ``--show``), then a count per op. An op that differs is a place where the run's bits
depend on the thread count; whether that reaches the weights depends on what consumes it (the
loss's ``mean`` does not: a mean's gradient does not depend on its value).

    python -m mptex.diagnostics.thread_check --arm f32 --seed 1 --iterations 300
    python -m mptex.diagnostics.thread_check --arm f16_dynamic --iterations 20 -- \
        texture=default train.batch_size=4

As ``mptex-train``, it turns on MKL's strict reproducibility mode first. Costs about 2.5x a
plain run (measured: 202,000 ops for 300 f32 iterations in a few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile

from mptex._paths import CONFIG_DIR
from mptex.train.runinfo import reproducible_blas

_RUN_ONCE = ("aten.empty", "rand", "normal", "bernoulli", "uniform", "exponential",
             "multinomial", "dropout", "geometric", "cauchy", "log_normal")  # fmt: skip


def _same(a, b) -> bool:
    import torch

    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return True
    if a.is_floating_point():  # NaN == NaN for this purpose: compare the bits' meaning
        # (the NaNs where they are, then the values elsewhere: a NaN is no number's equal)
        nan_a, nan_b = torch.isnan(a), torch.isnan(b)
        if not torch.equal(nan_a, nan_b):
            return False
        a, b = a.masked_fill(nan_a, 0.0), b.masked_fill(nan_b, 0.0)
    return torch.equal(a, b)


def _copy(value):
    import torch

    if isinstance(value, torch.Tensor):  # same strides: a contiguous copy may take another path
        out = torch.empty_strided(value.size(), value.stride(), dtype=value.dtype,
                                  device=value.device)  # fmt: skip
        return out.copy_(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(v) for v in value)
    return value


def make_checker(show: int):
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class ThreadCheck(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0
            self.differing: collections.Counter[str] = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if any(name in str(func) for name in _RUN_ONCE):
                return func(*args, **kwargs)
            args1, kwargs1 = list(args), dict(kwargs)
            for i, arg in enumerate(func._schema.arguments):
                if arg.alias_info is None or not arg.alias_info.is_write:
                    continue
                if arg.kwarg_only or i >= len(args):
                    if arg.name in kwargs1:
                        kwargs1[arg.name] = _copy(kwargs1[arg.name])
                else:
                    args1[i] = _copy(args1[i])
            torch.set_num_threads(1)
            out1 = func(*args1, **kwargs1)
            torch.set_num_threads(2)
            out2 = func(*args, **kwargs)
            self.ops += 1
            flat1, _ = tree_flatten((out1, args1, kwargs1))
            flat2, _ = tree_flatten((out2, list(args), kwargs))
            if not all(_same(x, y) for x, y in zip(flat1, flat2)):
                self.differing[str(func)] += 1
                if sum(self.differing.values()) <= show:
                    shapes = [(tuple(t.shape), str(t.dtype)) for t in args
                              if isinstance(t, torch.Tensor)]  # fmt: skip
                    print(f"op {self.ops}: {func} differs; tensor args {shapes}", flush=True)
            return out2

    return ThreadCheck()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arm", default="f32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--show", type=int, default=25, help="print the first N differing ops")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, after --")
    args = parser.parse_args(argv)
    reproducible_blas()
    import torch
    from hydra import compose, initialize_config_dir

    from mptex.train import train

    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(
            "config",
            overrides=["train=ablation", f"precision={args.arm}", f"train.seed={args.seed}",
                       f"train.iterations={args.iterations}", "train.threads=2",
                       "train.progress=false", "train.checkpoint_interval=0",
                       "train.n_val_images=0", "train.stats_interval=0", "train.val_interval=0",
                       *args.overrides],
        )  # fmt: skip
    torch.set_num_threads(2)
    checker = make_checker(args.show)
    with tempfile.TemporaryDirectory() as tmp, checker:
        train(cfg, tmp)
    overrides = " ".join(args.overrides) or "(none)"
    print(f"\n{args.arm}, seed {args.seed}, {args.iterations} iterations, "
          f"overrides: {overrides}: {checker.ops} ops checked")  # fmt: skip
    print("| op | times it differed between 1 and 2 threads |\n|---|---|")
    for op, n in checker.differing.most_common():
        print(f"| `{op}` | {n} |")
    if not checker.differing:
        print("| (none) | 0 |")


if __name__ == "__main__":
    sys.exit(main())
