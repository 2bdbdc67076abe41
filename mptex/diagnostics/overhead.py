"""Counting what a piece of PyTorch code costs a GPU's queue: operator calls that reach a
kernel, and host synchronisations (reads of device values, data-sized ops, copies to the host).

``OverheadCounter`` is a ``TorchDispatchMode`` that counts them while active; what counts as an
op and as a synchronisation is defined in ``benchmarks/loop_overhead.py``'s docstring, which runs
it on training runs per arm. ``patch_host_reads`` also catches the host reads that bypass the
dispatcher (``Tensor.tolist``, ``Tensor.numpy``, ``torch.tensor(..., device=...)``) and returns
the function that undoes the patch. Call order: ``undo = patch_host_reads([counter])``, then
``with counter:`` around the code, then ``undo()``.
"""

from __future__ import annotations

import collections
import os
import traceback
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OverheadCounter", "patch_host_reads"]

_REPO = Path(__file__).resolve().parents[2]
_SELF = Path(__file__).resolve().relative_to(_REPO)

_READS = {"_local_scalar_dense", "is_nonzero", "equal"}
_DATA_SIZED = {"nonzero", "nonzero_static", "masked_select", "unique_dim", "_unique",
               "_unique2", "unique_consecutive", "unique_dim_consecutive",
               "argwhere"}  # fmt: skip


def _name(func) -> str:
    return func._schema.name.split("::", 1)[-1]


def _sites(limit: int = 3) -> str:
    """The innermost ``limit`` frames of the mptex package's code on the stack, innermost
    first, this counter's own frames left out (the factories' wrappers record from here)."""
    frames = []
    for frame in reversed(traceback.extract_stack()[:-3]):
        path = Path(frame.filename)
        try:
            rel = path.resolve().relative_to(_REPO)
        except ValueError:
            continue
        if rel.parts[0] != "mptex" or rel == _SELF:
            continue
        frames.append(f"{rel.as_posix()}:{frame.lineno} {frame.name}")
        if len(frames) == limit:
            break
    return " < ".join(frames) or "(outside mptex)"


def _in_optimizer() -> bool:
    return any(f"{os.sep}torch{os.sep}optim{os.sep}" in frame.filename
               for frame in traceback.extract_stack()[:-2])  # fmt: skip


class OverheadCounter(TorchDispatchMode):
    """Counts ops and host synchronisations (module docstring) while active.

    Args:
        device: the run's device (``cpu`` counts cross-device copies as none).
        host_generators: generators whose draws live on the host by design.
    """

    def __init__(self, device: torch.device, host_generators=()):
        super().__init__()
        self.device = torch.device(device)
        # Dispatch hands a generator over as a new Python wrapper: known by seed and device.
        self.host_generators = {(g.device, g.initial_seed()) for g in host_generators}
        self._host: dict[int, weakref.ref] = {}
        self.phase = "step"  # or "validate", "checkpoint": set by count_arm's wrappers
        self.host_ops: collections.Counter = collections.Counter()
        self.ops: collections.Counter = collections.Counter()
        self.op_files: collections.Counter = collections.Counter()  # innermost mptex file
        self.op_sites: collections.Counter = collections.Counter()  # (op, innermost frame)
        self.syncs: collections.Counter = collections.Counter()  # kind -> count
        self.sites: collections.Counter = collections.Counter()  # (kind, site) -> count

    # host-resident tensors, by identity
    def mark_host(self, tensor: torch.Tensor) -> None:
        key = id(tensor)
        self._host[key] = weakref.ref(tensor, lambda _ref, key=key: self._host.pop(key, None))

    def is_host(self, tensor) -> bool:
        ref = self._host.get(id(tensor)) if isinstance(tensor, torch.Tensor) else None
        return ref is not None and ref() is tensor

    def record_sync(self, kind: str) -> None:
        self.syncs[(self.phase, kind)] += 1
        self.sites[(self.phase, kind, _sites())] += 1

    def _count_op(self, name: str) -> None:
        self.ops[(self.phase, name)] += 1
        site = _sites(1)
        self.op_files[(self.phase, site.split(":")[0])] += 1
        self.op_sites[(self.phase, name, site)] += 1

    def record_launch(self, name: str) -> None:
        """Count one op ``name`` for a kernel launched outside the dispatcher (a Triton kernel
        whose ops, under Triton's interpreter, the caller kept from this mode)."""
        self._count_op(name)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = _name(func)
        tensors = [a for a in torch.utils._pytree.tree_leaves((args, kwargs))
                   if isinstance(a, torch.Tensor)]  # fmt: skip
        generator = kwargs.get("generator")
        host_out = (
            generator is not None
            and (generator.device, generator.initial_seed()) in self.host_generators
        ) or (bool(tensors) and all(self.is_host(t) for t in tensors))
        if host_out and self.device.type != "cpu":
            # In a run on a device, host data copied there (or any op that puts its result
            # there) is a launch, and its result is the device's: not host data any more.
            outputs = [t for t in torch.utils._pytree.tree_leaves(out)
                       if isinstance(t, torch.Tensor)]  # fmt: skip
            host_out = all(t.device.type == "cpu" for t in outputs)
        if host_out:
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.mark_host(t)
        if name == "lift_fresh":  # torch.tensor(...): _patch_host_reads decides
            return out
        if func.is_view or name.startswith("_record_function") or func.namespace == "profiler":
            return out
        if host_out:  # host data only: no kernel on the device, nothing to wait for
            self.host_ops[(self.phase, name)] += 1
            return out
        self._count_op(name)
        if name in _READS:
            self.record_sync("read (.item/bool/float)")
        elif name in _DATA_SIZED or (name == "repeat_interleave" and "output_size" not in kwargs):
            self.record_sync(f"data-sized ({name})")
        elif name in ("index", "index_put", "index_put_") and any(
            t.dtype == torch.bool for t in tensors[1:]
        ):
            self.record_sync(f"data-sized ({name} by a boolean mask)")
        elif name in ("_to_copy", "copy_") and self.device.type != "cpu":
            devices = {t.device.type for t in tensors}
            if isinstance(out, torch.Tensor):
                devices.add(out.device.type)
            if "cpu" in devices and len(devices) > 1:
                self.record_sync("copy host<->device")
        return out


def patch_host_reads(counter_ref: list):
    """Count ``Tensor.tolist``/``Tensor.numpy`` of run data (on the CPU they bypass the
    dispatcher; on a device they are a device-to-host copy), and sort tensors made from Python
    data: ``torch.tensor``/``torch.as_tensor`` without ``device`` and ``new_tensor`` of host
    data make host tensors; with a ``device`` (or ``new_tensor`` of run data) they are a
    host-to-device copy. Returns an undo function."""
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}
    factories = {name: getattr(torch, name) for name in ("tensor", "as_tensor")}
    new_tensor = torch.Tensor.new_tensor

    def sort(out, to_device: bool):
        counter = counter_ref[0]
        if counter is not None and isinstance(out, torch.Tensor):
            if to_device and not _in_optimizer():
                counter.record_sync("host-to-device (torch.tensor)")
            else:
                # torch's optimizers make host scalars for their host step counters.
                counter.mark_host(out)
        return out

    def factory(original):
        def make(data, *args, **kwargs):
            out = original(data, *args, **kwargs)
            if isinstance(data, torch.Tensor) and data is out:
                # as_tensor of a tensor already there: no copy, and the tensor stays what it
                # was (the run's data is not host data because it passed through here)
                return out
            return sort(out, kwargs.get("device") is not None)

        return make

    def make_new(self, data, *args, **kwargs):
        counter = counter_ref[0]
        out = new_tensor(self, data, *args, **kwargs)
        on_device = kwargs.get("device") is not None or (
            counter is not None and not counter.is_host(self)
        )
        return sort(out, on_device)

    for name, original in factories.items():
        setattr(torch, name, factory(original))
    torch.Tensor.new_tensor = make_new

    def wrap(name, original):
        def method(self, *args, **kwargs):
            counter = counter_ref[0]
            # In a run on the CPU the read stands for the device-to-host copy a device run
            # makes. In a run on a device the dispatcher sees that copy itself (a device
            # tensor's tolist copies it to the host through it), and a host tensor's read
            # waits for nothing.
            if counter is not None and counter.device.type == "cpu" and not counter.is_host(self):
                counter.record_sync(f"copy to host ({name})")
            return original(self, *args, **kwargs)

        return method

    for name, original in originals.items():
        setattr(torch.Tensor, name, wrap(name, original))

    # The waits that are not ops: the host blocks until the device (a stream, an event) is
    # done. (Nothing in the training loop calls them; counted so that nothing can hide there.)
    waits = [(torch.cuda, "synchronize"), (torch.cuda.Stream, "synchronize"),
             (torch.cuda.Event, "synchronize")]  # fmt: skip
    waited = [(owner, name, getattr(owner, name)) for owner, name in waits]

    def wait(what, original):
        def method(*args, **kwargs):
            counter = counter_ref[0]
            if counter is not None:
                counter.record_sync(f"wait for the device ({what})")
            return original(*args, **kwargs)

        return method

    for owner, name, original in waited:
        what = "torch.cuda.synchronize" if owner is torch.cuda else f"{owner.__name__}.{name}"
        setattr(owner, name, wait(what, original))

    def undo():
        for owner, name, original in waited:
            setattr(owner, name, original)
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        for name, original in factories.items():
            setattr(torch, name, original)
        torch.Tensor.new_tensor = new_tensor

    return undo
