"""mptex.diagnostics.thread_check: the op-by-op 1-vs-2-thread comparison of a training run."""

import torch

from mptex.diagnostics import thread_check  # noqa: E402


def test_written_arguments_are_copied_so_in_place_ops_apply_once():
    threads = torch.get_num_threads()
    try:
        x = torch.zeros(5)
        out = torch.empty(5)
        with thread_check.make_checker(show=0) as checker:
            x.add_(1.0)
            torch.mul(x, 3.0, out=out)
        assert torch.equal(x, torch.ones(5)) and torch.equal(out, torch.full((5,), 3.0))
        assert checker.ops == 2 and not checker.differing
    finally:
        torch.set_num_threads(threads)


def test_counts_exactly_the_ops_whose_bits_depend_on_the_thread_count():
    # torch.sigmoid above 32768 elements: each thread's chunk ends in a scalar loop, so whether
    # a size differs depends on the CPU. The checker must report exactly the sizes for which a
    # direct 1-vs-2-thread comparison differs, whatever their number here.
    gen = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    try:
        inputs = [torch.randn(n, generator=gen) * 4 for n in range(32769, 32769 + 20 * 97, 97)]
        direct = 0
        for x in inputs:
            torch.set_num_threads(1)
            one = torch.sigmoid(x)
            torch.set_num_threads(2)
            direct += not torch.equal(one, torch.sigmoid(x))
        with thread_check.make_checker(show=0) as checker:
            for x in inputs:
                torch.sigmoid(x)
        assert checker.ops == len(inputs)
        assert checker.differing.get("aten.sigmoid.default", 0) == direct
    finally:
        torch.set_num_threads(threads)
