"""train.overlap: an iteration's forward and backward queued before the previous one's read.

On CUDA the loop's Adam is fused, which decides a skipped step on the device, and the overlap
is on by default. Here on the CPU the loop is given fused Adam as on CUDA (torch has a CPU
kernel for it), so that the overlapped order runs; every comparison is between runs that
differ only in ``train.overlap``, with the same optimizer.
"""

from __future__ import annotations

import pytest
import torch
from test_train import tiny_cfg

import mptex.train.loop as loop
from mptex.mlp import FP8Linear
from mptex.train import ConfigError, load_checkpoint, train

FUSED = {"fused": True, "foreach": False}
# What differs between two runs of the same config besides the results: times and paths.
_TIMES = {"time_per_iter_s", "wall_time_s", "train_time_s", "time_split_s", "wall_time_total_s",
          "train_time_total_s", "peak_memory_bytes", "peak_memory_kind",
          "start_peak_memory_bytes", "run_dir", "config",
          "versions", "device_name"}  # fmt: skip


@pytest.fixture
def fused_adam(monkeypatch):
    monkeypatch.setattr(loop, "_adam_implementation", lambda texture, device: dict(FUSED))


@pytest.fixture
def trace(monkeypatch):
    """The order of the loop's forward-and-backward and read calls, by iteration."""
    events: list[tuple[str, int]] = []
    forward, read = loop._forward_backward, loop._read

    def traced_forward(run, it):
        events.append(("forward", it))
        return forward(run, it)

    def traced_read(run, launched):
        events.append(("read", launched.enqueued.it))
        return read(run, launched)

    monkeypatch.setattr(loop, "_forward_backward", traced_forward)
    monkeypatch.setattr(loop, "_read", traced_read)
    return events


_FINISH = loop.finish


def _run(tmp_path, monkeypatch, name, *overrides):
    """Train; returns metrics.json's dict and the texture's and the optimizer's state at the
    end (a diverged run writes no checkpoint)."""
    kept: dict = {}

    def capture(run, *args, **kwargs):
        # (a module's extra state comes as copies already: the FP8 layers' dicts)
        kept["texture"] = {k: v.clone() if isinstance(v, torch.Tensor) else v
                           for k, v in run.texture.state_dict().items()}  # fmt: skip
        kept["exp_avg"] = [s["exp_avg"].clone() for s in run.optimizer.state.values()]
        kept["step"] = [float(s["step"]) for s in run.optimizer.state.values()]
        return _FINISH(run, *args, **kwargs)

    monkeypatch.setattr(loop, "finish", capture)
    return train(tiny_cfg(*overrides), tmp_path / name), kept


def _equal(a, b, where):
    """Bit-equal tensors, also inside a module's extra state (the FP8 layers' dicts)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _equal(a[key], b[key], f"{where}.{key}")
    else:
        # bit for bit, NaNs included (a diverged FP8 layer's last amax)
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where


def _same(a, b):
    (ma, ka), (mb, kb) = a, b
    assert {k: v for k, v in ma.items() if k not in _TIMES} == {
        k: v for k, v in mb.items() if k not in _TIMES
    }
    assert ka.keys() == kb.keys()
    for key in ka["texture"]:
        _equal(ka["texture"][key], kb["texture"][key], key)
    assert all(torch.equal(x, y) for x, y in zip(ka["exp_avg"], kb["exp_avg"], strict=True))
    assert ka["step"] == kb["step"]


def _pairs(events):
    """Iterations whose read came after the next iteration's forward."""
    position = {event: i for i, event in enumerate(events)}
    reads = [it for kind, it in events if kind == "read"]
    end = len(events)
    return sorted(it for it in reads
                  if position.get(("forward", it + 1), end) < position[("read", it)])  # fmt: skip


CASES = {
    # validations, checkpoints and sampled statistics inside the run
    "f32": [
        "precision=f32",
        "train.iterations=12",
        "train.val_interval=5",
        "train.checkpoint_interval=4",
        "train.stats_interval=3",
    ],  # fmt: skip
    # a non-finite loss without loss scaling: the run ends there, diverged
    "f32_diverges": ["precision=f32", "train.iterations=12", "train.inject_nonfinite_at=6"],
    # a skipped step under dynamic loss scaling
    "f16_dynamic_skips": [
        "precision=f16_dynamic",
        "train.iterations=12",
        "train.inject_nonfinite_at=6",
        "train.stats_interval=2",
    ],  # fmt: skip
    # the fused network's twin, nvdiffrec's fixed scale
    "tcnn_fused": ["precision=tcnn_fused", "train.iterations=8"],
    # FP8 GEMMs: scaling state recorded by every forward and backward (delayed: amax history;
    # row-wise: a weight's quantisation reused by the second forward of an iteration)
    "fp8": [
        "precision=fp8",
        "train.iterations=12",
        "train.val_interval=5",
        "train.stats_interval=3",
    ],  # fmt: skip
    "fp8_rowwise": ["precision=fp8_rowwise", "train.iterations=8", "train.stats_interval=2"],
    # a divergence with an FP8 look-ahead dropped: its recording undone
    "fp8_diverges": [
        "precision=fp8",
        "train.iterations=12",
        "train.inject_nonfinite_at=6",
        "train.stats_interval=4",
    ],  # fmt: skip
    # a loss-scaled FP8 run stopped by max_consecutive_skips with a look-ahead queued
    "fp8_skips_out": [
        "precision=fp8",
        "precision.loss_scaling=dynamic",
        "train.iterations=12",
        "train.inject_nonfinite_at=6",
        "train.max_consecutive_skips=1",
    ],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_overlap_gives_the_runs_results_bit_for_bit(tmp_path, monkeypatch, fused_adam, trace,
                                                    case):  # fmt: skip
    overrides = CASES[case]
    plain = _run(tmp_path, monkeypatch, "plain", *overrides, "train.overlap=false")
    assert _pairs(trace) == []
    trace.clear()
    overlapped = _run(tmp_path, monkeypatch, "overlap", *overrides, "train.overlap=true")
    assert overlapped[0]["backends"].pop("loop") == "overlap"
    assert "loop" not in plain[0]["backends"]
    _same(plain, overlapped)
    ahead = _pairs(trace)
    if case == "f32":
        # every iteration but those before a validation (5, 10), a checkpoint (4, 8) and the
        # last: 1-based completed counts, so 0-based iterations 3, 4, 7, 9, 11 read first
        assert ahead == [0, 1, 2, 5, 6, 8, 10]
    elif case in ("f32_diverges", "fp8_diverges", "fp8_skips_out"):
        # iteration 6 diverged with iteration 7 queued behind it: dropped, never stepped
        assert plain[0]["status"] == "diverged" and plain[0]["diverged_at"] == 6
        assert ahead == [0, 1, 2, 3, 4, 5, 6] and ("forward", 7) in trace
        assert ("read", 7) not in trace
    else:
        assert ahead, trace


def test_a_stop_signal_during_a_queued_iteration_stops_after_it(tmp_path, monkeypatch,
                                                                  fused_adam):  # fmt: skip
    # The signal comes during iteration 4's forward, which is queued before iteration 3's
    # read: the run stops after iteration 4, as without the overlap, and its resumed run
    # ends where the uninterrupted one does.
    overrides = ["precision=f16_dynamic", "train.iterations=10", "train.inject_signal_at=4",
                 "train.val_interval=10", "train.checkpoint_interval=0"]  # fmt: skip
    runs = {}
    for overlap in ("false", "true"):
        first = train(tiny_cfg(*overrides, f"train.overlap={overlap}"), tmp_path / overlap)
        assert first["status"] == "interrupted" and first["interrupted_at"] == 5
        runs[overlap] = load_checkpoint(tmp_path / overlap / "checkpoint.pt")
        resumed = train(tiny_cfg(*overrides[:2], f"train.overlap={overlap}",
                                 "train.val_interval=10", "train.checkpoint_interval=0"),
                        tmp_path / overlap)  # fmt: skip
        assert resumed["status"] == "completed" and resumed["resumed_from"] == 5
        runs[overlap + "_end"] = load_checkpoint(tmp_path / overlap / "checkpoint.pt")
    for key in ("false", "false_end"):
        other = runs[key.replace("false", "true")]
        for name, value in runs[key]["texture"].items():
            assert torch.equal(value, other["texture"][name]), (key, name)
        for name, value in runs[key]["rng"].items():
            same = (
                torch.equal(value, other["rng"][name])
                if isinstance(value, torch.Tensor)
                else repr(value) == repr(other["rng"][name])
            )
            assert same, (key, name)
        assert runs[key]["history"] == other["history"]


def test_overlap_true_where_it_cannot_hold_fails_at_start(tmp_path, monkeypatch):
    # On the CPU the loop's Adam is foreach: the step waits for the read.
    with pytest.raises(ConfigError, match="train.overlap: true needs the optimizer step"):
        train(tiny_cfg("precision=f32", "train.overlap=true"), tmp_path / "cpu")
    monkeypatch.setattr(loop, "_adam_implementation", lambda texture, device: dict(FUSED))
    # A module with state of its own that cannot snapshot and restore it.
    monkeypatch.delattr(FP8Linear, "snapshot")
    with pytest.raises(ConfigError, match=r"net.net.0 \(FP8Linear\) cannot"):
        train(tiny_cfg("precision=fp8", "train.overlap=true"), tmp_path / "fp8")
    # auto turns it off there, and on where it holds
    seen = []
    setup = loop.setup

    def spy(*args, **kwargs):
        run = setup(*args, **kwargs)
        seen.append(run.overlap)
        return run

    monkeypatch.setattr(loop, "setup", spy)
    for arm in ("fp8", "f32"):
        train(tiny_cfg(f"precision={arm}", "train.iterations=2"), tmp_path / f"auto-{arm}")
    monkeypatch.undo()
    monkeypatch.setattr(loop, "_adam_implementation", lambda texture, device: dict(FUSED))
    monkeypatch.setattr(loop, "setup", spy)
    train(tiny_cfg("precision=fp8", "train.iterations=2"), tmp_path / "auto-fp8-restorable")
    assert seen == [False, True, True]


@pytest.mark.requires_cuda
def test_on_cuda_the_overlapped_read_returns_each_iterations_own_values(tmp_path, monkeypatch,
                                                                         trace):  # fmt: skip
    # The read runs on a side stream behind an event while the next iteration's kernels run on
    # the main stream; a read that did not wait for its event would return another
    # iteration's loss. The grid's backward sums with atomics on CUDA (no bit-equality between
    # two runs), so the losses are compared within float32 noise over the first iterations.
    overrides = ["precision=f32", "train.device=cuda", "train.iterations=12",
                 "train.stats_interval=3"]  # fmt: skip
    plain, _ = _run(tmp_path, monkeypatch, "plain", *overrides, "train.overlap=false")
    trace.clear()
    overlapped, _ = _run(tmp_path, monkeypatch, "overlap", *overrides)  # auto: on
    assert overlapped["backends"]["loop"] == "overlap" and "loop" not in plain["backends"]
    assert _pairs(trace) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 10]
    losses = [[h["loss"] for h in m["history"][:6]] for m in (plain, overlapped)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)
    assert [h["iteration"] for h in overlapped["history"]] == list(range(1, 13))


class _OnCuda(torch.Tensor):
    """A CPU tensor that says it is on ``cuda:0`` (this machine may have no CUDA)."""

    @property
    def device(self):
        return torch.device("cuda:0")


def test_the_overlapped_read_waits_for_its_own_iterations_event_on_the_side_stream(
    tmp_path, monkeypatch, fused_adam, trace
):  # fmt: skip
    # On CUDA, an iteration read after the next one was queued records an event behind its
    # packed values on the main stream, and its read copies them on the side stream after
    # waiting for that event only; any other read copies on the main stream. Here torch.cuda's
    # events and streams are stand-ins that log what the loop asks of them, and the packed
    # tensor says it is on CUDA: each wait must name the event recorded for the same
    # iteration before the next one's forward, and the copy must run inside the side stream.
    log: list[tuple] = []
    state = {"stream": "main", "n": 0}

    class Event:
        def __init__(self, *args, **kwargs):
            self.name = None

        def record(self, stream):
            assert stream == "main"
            state["n"] += 1
            self.name = state["n"]
            log.append(("record", self.name))

    class Stream:
        def __init__(self, device=None):
            assert torch.device(device).type == "cuda"

        def wait_event(self, event):
            assert event.name is not None, "a wait for an event never recorded"
            log.append(("wait", event.name))

    class StreamContext:
        def __init__(self, stream):
            assert isinstance(stream, Stream)

        def __enter__(self):
            state["stream"] = "side"

        def __exit__(self, *exc):
            state["stream"] = "main"

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", StreamContext)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "main")
    to_host = loop.to_host

    def copy(value):
        log.append(("copy", state["stream"]))
        return to_host(value)

    monkeypatch.setattr(loop, "to_host", copy)
    launch, setup = loop._launch_step, loop.setup

    def launched(run, enqueued):
        out = launch(run, enqueued)
        log.append(("launched", enqueued.it))
        out.packed = out.packed.as_subclass(_OnCuda)
        return out

    def on_cuda(*args, **kwargs):
        run = setup(*args, **kwargs)
        if run.overlap:
            run.read_stream = torch.cuda.Stream("cuda")  # as setup makes it on CUDA
        return run

    overrides = CASES["f16_dynamic_skips"]
    plain = _run(tmp_path, monkeypatch, "plain", *overrides, "train.overlap=false")
    monkeypatch.setattr(loop, "_launch_step", launched)
    monkeypatch.setattr(loop, "setup", on_cuda)
    trace.clear()
    log.clear()
    overlapped = _run(tmp_path, monkeypatch, "overlap", *overrides, "train.overlap=true")
    assert overlapped[0]["backends"].pop("loop") == "overlap"
    _same(plain, overlapped)
    ahead = _pairs(trace)
    # all but the last and the one before configs/train/tiny.yaml's validation at 10
    assert ahead == [0, 1, 2, 3, 4, 5, 6, 7, 8, 10]
    # Per iteration: launched, (record), the next forward, (wait), copy.
    reads = [i for i, e in enumerate(log) if e[0] == "copy"]
    assert len(reads) == 12
    for it, at in enumerate(reads):
        start = log.index(("launched", it))
        if it in ahead:
            recorded = log[start + 1]
            assert recorded[0] == "record", (it, log[start : at + 1])
            assert log[at - 1] == ("wait", recorded[1]) and log[at] == ("copy", "side")
        else:
            assert log[start + 1] == ("copy", "main"), (it, log[start : at + 1])
