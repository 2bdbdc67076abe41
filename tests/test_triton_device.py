"""Triton launches a kernel on the current CUDA device, whatever device its tensors are on: every
mptex function that launches one makes its operands' device current (``on_operand_device``),
so that code on ``cuda:N`` runs without ``torch.cuda.device(N)`` around it."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from mptex._triton_launch import on_operand_device

PACKAGE = Path(__file__).resolve().parents[1] / "mptex"


class _OnCuda1(torch.Tensor):
    """A CPU tensor that says it is on ``cuda:1`` (this machine may have no CUDA)."""

    @property
    def device(self):
        return torch.device("cuda:1")


class _OnCuda0(torch.Tensor):
    @property
    def device(self):
        return torch.device("cuda:0")


def _fake_cuda(monkeypatch):
    """torch.cuda with device 0 current and a device context that records what it makes
    current; returns the list of current devices seen by the launcher."""
    state = {"current": 0}

    class Device:
        def __init__(self, device):
            self.idx = torch.device(device).index

        def __enter__(self):
            self.prev, state["current"] = state["current"], self.idx

        def __exit__(self, *exc):
            state["current"] = self.prev

    monkeypatch.setattr(torch.cuda, "current_device", lambda: state["current"])
    monkeypatch.setattr(torch.cuda, "device", Device)
    return state


def test_a_launcher_runs_with_its_first_tensors_device_current(monkeypatch):
    state = _fake_cuda(monkeypatch)
    seen = []

    @on_operand_device
    def launcher(ctx, x, y, flag=False):
        seen.append((state["current"], flag))
        return x

    x1 = torch.zeros(2).as_subclass(_OnCuda1)
    assert launcher(None, x1, torch.zeros(1), flag=True) is x1  # ctx first: not a tensor
    assert seen == [(1, True)] and state["current"] == 0  # restored afterwards
    launcher(None, torch.zeros(2).as_subclass(_OnCuda0), x1)  # current already: unchanged
    assert seen[-1] == (0, False)
    assert launcher.__name__ == "launcher"


def test_cpu_operands_never_ask_for_a_cuda_device(monkeypatch):
    # Triton's interpreter runs the launchers on CPU tensors, where torch may have no CUDA.
    def no_cuda():
        raise AssertionError("torch.cuda.current_device called for CPU tensors")

    monkeypatch.setattr(torch.cuda, "current_device", no_cuda)
    assert on_operand_device(lambda x, y: x + y)(torch.ones(1), torch.ones(1)).item() == 2.0
    assert on_operand_device(lambda n: n)(3) == 3  # no tensor at all


def _decorated(fn: ast.FunctionDef) -> bool:
    return any(ast.unparse(d) == "on_operand_device" for d in fn.decorator_list)


def _launches(tree: ast.Module) -> list[tuple[ast.Call, bool]]:
    """Each Triton launch in ``tree`` (``<name ending in kernel>[grid](...)``) and whether it is
    covered: its function is decorated, it runs inside ``with launching_on(...)``, or its
    function is a private helper called only from covered functions of its module."""
    parent = {ch: node for node in ast.walk(tree) for ch in ast.iter_child_nodes(node)}
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)]

    def enclosing(node):
        while node in parent and not isinstance(node, ast.FunctionDef):
            node = parent[node]
        return node if isinstance(node, ast.FunctionDef) else None

    def guarded(node):
        while node in parent:
            node = parent[node]
            if isinstance(node, ast.With) and any(
                "launching_on" in ast.unparse(item.context_expr) for item in node.items
            ):
                return True
        return False

    def covered(fn, seen=()):
        if fn is None or fn.name in seen:
            return False
        if _decorated(fn):
            return True
        if not fn.name.startswith("_") or fn.name in ("forward", "backward"):
            return False
        callers = [c for c in calls if isinstance(c.func, ast.Name) and c.func.id == fn.name]
        return bool(callers) and all(
            guarded(c) or covered(enclosing(c), (*seen, fn.name)) for c in callers
        )

    found = []
    for call in calls:
        target = call.func.value if isinstance(call.func, ast.Subscript) else None
        name = getattr(target, "id", None) or getattr(target, "attr", "")
        if name.endswith("kernel"):
            found.append((call, guarded(call) or covered(enclosing(call))))
    return found


def test_every_function_that_launches_a_triton_kernel_makes_its_device_current():
    launches = 0
    for path in sorted(PACKAGE.rglob("*.py")):
        for call, covered in _launches(ast.parse(path.read_text())):
            launches += 1
            assert covered, f"{path.relative_to(PACKAGE.parent)}:{call.lineno}"
    assert launches >= 15  # the grid, the loss, the FP8 quantisations, GEMMs and copies


def test_every_tinycudann_call_makes_its_device_current():
    # tinycudann's bindings also work on the current device: they allocate their outputs and
    # initial parameters on it and run on its stream.
    callers = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, ast.FunctionDef) and "tcnn_module_sharing(" in ast.unparse(fn):
                if fn.name != "tcnn_module_sharing":
                    callers.append((f"{path.relative_to(PACKAGE.parent)}:{fn.name}", fn))
    assert len(callers) >= 2  # the encoding's and the network's tinycudann forward
    for where, fn in callers:
        assert _decorated(fn), where
