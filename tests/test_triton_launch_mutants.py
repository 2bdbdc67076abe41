"""mptex._triton_launch where its other tests leave a choice open: ``cdiv`` at exact multiples,
``launching_on`` given a ``torch.device`` (what ``mptex-export`` and ``mptex-rescore`` pass) or
an indexed device of another type, and ``on_operand_device`` passing keyword arguments on when
no device changes."""

import contextlib
import math

import torch

from mptex._triton_launch import cdiv, launching_on, on_operand_device


def test_cdiv_is_the_ceiling_of_the_quotient_at_and_between_multiples():
    for b in range(1, 18):
        for a in range(0, 4 * b + 2):
            assert cdiv(a, b) == math.ceil(a / b), (a, b)
    assert cdiv(2**19, 1024) == 512 and cdiv(2**19 + 1, 1024) == 513


def _two_cuda_devices(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_a_torch_device_is_made_current_as_its_name_is(monkeypatch):
    # mptex-export and mptex-rescore hand launching_on the torch.device they parsed.
    _two_cuda_devices(monkeypatch)
    guard = launching_on(torch.device("cuda:1"))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    assert isinstance(launching_on(torch.device("cuda:2")), contextlib.nullcontext)
    assert isinstance(launching_on(torch.device("cpu")), contextlib.nullcontext)


def test_an_indexed_device_of_another_type_changes_nothing(monkeypatch):
    # Only CUDA has a current device Triton launches on; "xpu:1" is not "cuda:1".
    _two_cuda_devices(monkeypatch)
    for value in ("xpu:1", "meta:1", torch.device("xpu:0")):
        assert isinstance(launching_on(value), contextlib.nullcontext), value


def test_keyword_arguments_reach_a_launcher_whose_device_is_current():
    @on_operand_device
    def launcher(x, scale=1.0, *, out=None):
        return x * scale if out is None else out.copy_(x * scale)

    x = torch.ones(2)
    assert torch.equal(launcher(x, scale=3.0), torch.full((2,), 3.0))
    out = torch.zeros(2)
    assert launcher(x, scale=2.0, out=out) is out and torch.equal(out, torch.full((2,), 2.0))
