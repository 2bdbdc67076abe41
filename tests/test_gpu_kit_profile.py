"""The GPU kit's profile summary on profiler events built by hand.

``stages_loop._profile_arm`` turns ``torch.profiler``'s averaged events into the ``profile``
table's numbers (launches, stream synchronisations, device-to-host copies and device ms per
iteration, the loop's parts, the top ops). Without CUDA the profiler records no kernel, so the
profiler and the run are replaced here by fakes whose events are known, and every number is
worked out by hand from them.
"""

import types

import pytest
from test_gpu_kit import kit
from test_gpu_kit_verdicts import FakeStage
from torch.autograd import DeviceType

stages_loop = kit.stages_loop
CPU, CUDA = DeviceType.CPU, DeviceType.CUDA


def _event(key, count, device=CPU, device_us=0.0, self_cpu_us=0.0, annotation=False):
    """One entry of ``prof.key_averages()``: times in microseconds, as torch's are."""
    return types.SimpleNamespace(key=key, count=count, device_type=device,
                                 device_time_total=device_us, self_cpu_time_total=self_cpu_us,
                                 is_user_annotation=annotation)  # fmt: skip


# 10 profiler steps recorded (the window asked for more: the run ended inside it). Device-side
# copies of the ranges (annotations) carry large times that must count nowhere.
EVENTS = [
    _event("ProfilerStep*", 10, self_cpu_us=5000.0),
    _event("ProfilerStep*", 10, CUDA, device_us=99_000.0, annotation=True),
    _event("mptex.forward", 10, device_us=20_000.0, self_cpu_us=900.0),
    _event("mptex.forward", 10, CUDA, device_us=55_000.0, annotation=True),
    _event("mptex.backward", 10, device_us=30_000.0, self_cpu_us=800.0),
    _event("aten::mm", 40, device_us=40_000.0, self_cpu_us=3000.0),
    _event("cudaLaunchKernel", 300, self_cpu_us=4000.0),
    _event("cudaStreamSynchronize", 10, self_cpu_us=700.0),
    _event("cudaDeviceSynchronize", 5, self_cpu_us=600.0),
    _event("ampere_sgemm", 200, CUDA, device_us=40_000.0),
    _event("triton_grid_fwd", 100, CUDA, device_us=10_000.0),
    _event("Memcpy DtoH (Device -> Pageable)", 20, CUDA, device_us=1_000.0),
    _event("Memcpy DtoH (Device -> Pinned)", 10, CUDA, device_us=500.0),
    _event("Memset (Device)", 50, CUDA, device_us=500.0),
]


class FakeProfile:
    """torch.profiler.profile's surface that ``_profile_arm`` uses."""

    def __init__(self, events, calls):
        self.events, self.calls = events, calls

    def __call__(self, activities, schedule):
        self.calls["activities"], self.calls["schedule"] = activities, schedule
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def step(self):
        pass

    def key_averages(self):
        return self.events


def _profile(monkeypatch, events=EVENTS, device="cuda", arm="f32", iterations=30,
             time_per_iter_s=0.004):  # fmt: skip
    import torch.profiler

    import mptex.train

    calls = {}
    monkeypatch.setattr(torch.profiler, "profile", FakeProfile(events, calls))
    monkeypatch.setattr(torch.profiler, "schedule", lambda **window: window)
    monkeypatch.setattr(stages_loop, "compose_config", lambda overrides: overrides)

    def train(cfg, run_dir):
        calls["cfg"] = cfg
        return {"status": "completed", "time_per_iter_s": time_per_iter_s,
                "backends": {"encoder": "torch"}}  # fmt: skip

    monkeypatch.setattr(mptex.train, "train", train)
    ctx = FakeStage(small=True, device=device)
    return stages_loop._profile_arm(ctx, arm, iterations), calls


def test_the_profile_counts_per_recorded_iteration(monkeypatch):
    run, calls = _profile(monkeypatch)
    # 30 iterations: the first third skipped, one warm-up step, 30 - 10 - 2 active
    assert calls["schedule"] == {"skip_first": 10, "wait": 0, "warmup": 1, "active": 18,
                                 "repeat": 1}  # fmt: skip
    assert run["arm"] == "f32" and run["status"] == "completed"
    assert run["ms_per_iter"] == pytest.approx(4.0)
    # per the 10 recorded steps, not the 18 planned: (200 + 100) kernels, Memcpy/Memset apart
    assert run["launches_per_iter"] == pytest.approx(30.0)
    assert run["stream_syncs_per_iter"] == pytest.approx(1.5)  # (10 + 5) / 10
    assert run["dtoh_per_iter"] == pytest.approx(3.0)  # (20 pageable + 10 pinned) / 10
    # the kernels', copies' and memsets' own device time, annotations left out, in ms
    assert run["device_busy_ms_per_iter"] == pytest.approx((40 + 10 + 1 + 0.5 + 0.5) / 10)
    # a scope's host range (its kernels' sum), not its device-side annotation
    assert run["parts_device_ms_per_iter"] == pytest.approx({"mptex.forward": 2.0,
                                                             "mptex.backward": 3.0})  # fmt: skip
    assert run["backends"] == {"encoder": "torch"}


def test_the_top_ops_are_by_device_time_per_iteration(monkeypatch):
    run, _ = _profile(monkeypatch)
    # The scopes, the steps and the annotations are not ops; ten kept, largest first
    assert run["top_ops"] == [
        ["aten::mm", "4.000", 40], ["ampere_sgemm", "4.000", 200],
        ["triton_grid_fwd", "1.000", 100], ["Memcpy DtoH (Device -> Pageable)", "0.100", 20],
        ["Memcpy DtoH (Device -> Pinned)", "0.050", 10], ["Memset (Device)", "0.050", 50],
        ["cudaLaunchKernel", "0.000", 300], ["cudaStreamSynchronize", "0.000", 10],
        ["cudaDeviceSynchronize", "0.000", 5],
    ]  # fmt: skip
    many = [*EVENTS, *(_event(f"op{i}", 1, CUDA, device_us=100_000.0 + i) for i in range(12))]
    top, _ = _profile(monkeypatch, events=many)
    assert [row[0] for row in top["top_ops"]] == [f"op{i}" for i in range(11, 1, -1)]
    # host: own CPU time per iteration, largest first, twelve at most
    assert run["top_host_ops"][:3] == [["ProfilerStep*", "0.500", 10],
                                       ["cudaLaunchKernel", "0.400", 300],
                                       ["aten::mm", "0.300", 40]]  # fmt: skip
    assert len(run["top_host_ops"]) == 12


def test_without_a_recorded_step_the_planned_window_counts(monkeypatch):
    events = [e for e in EVENTS if not e.key.startswith("ProfilerStep")]
    run, _ = _profile(monkeypatch, events=events)
    assert run["launches_per_iter"] == pytest.approx(300 / 18)
    assert run["dtoh_per_iter"] == pytest.approx(30 / 18)


def test_events_of_a_torch_without_user_annotations_count_as_work(monkeypatch):
    # An older torch's averaged events lack is_user_annotation: none of them is a range's
    # device-side copy, so every kernel and copy counts.
    events = []
    for e in EVENTS:
        if not e.is_user_annotation:
            e = types.SimpleNamespace(**vars(e))
            del e.is_user_annotation
            events.append(e)
    run, _ = _profile(monkeypatch, events=events)
    assert run["launches_per_iter"] == pytest.approx(30.0)
    assert run["dtoh_per_iter"] == pytest.approx(3.0)
    assert run["device_busy_ms_per_iter"] == pytest.approx(5.2)


def test_a_cpu_profile_has_no_device_busy_time_and_an_untimed_run_no_ms(monkeypatch):
    run, calls = _profile(monkeypatch, device="cpu", time_per_iter_s=None)
    assert run["device_busy_ms_per_iter"] is None and run["ms_per_iter"] is None
    assert len(calls["activities"]) == 1  # the CPU's alone


def test_a_variant_is_named_as_profiled_and_runs_its_override(monkeypatch):
    run, calls = _profile(monkeypatch, arm=stages_loop.EMULATED)
    assert run["arm"] == stages_loop.EMULATED
    assert calls["cfg"][0] == "precision=fp8"
    assert calls["cfg"][-1] == "texture.fp8_gemm=emulated"


def test_the_profile_table_puts_each_number_in_its_column(monkeypatch):
    monkeypatch.setattr(stages_loop, "PROFILED", ("f32",))
    monkeypatch.setattr(stages_loop, "PROFILE_ARMS", ())
    monkeypatch.setitem(__import__("sys").modules, "loop_overhead", types.SimpleNamespace())
    monkeypatch.setattr(stages_loop, "_profile_arm", lambda ctx, arm, iterations: {
        "arm": arm, "status": "completed", "ms_per_iter": 4.0, "device_busy_ms_per_iter": 1.5,
        "launches_per_iter": 120.0, "stream_syncs_per_iter": 0.5, "dtoh_per_iter": 2.0,
        "parts_device_ms_per_iter": {"mptex.zeta": 0.25, "mptex.alpha": 0.125},
        "top_ops": [["aten::mm", "0.700", 3]], "top_host_ops": [],
        "backends": {"encoder": "torch", "mlp": "tcnn"}})  # fmt: skip
    ctx = FakeStage(small=False, device="cuda")
    stages_loop.stage_profile(ctx)
    main, parts = ctx.result["tables"][0], ctx.result["tables"][1]
    assert main["headers"][2:7] == ["ms / iter", "device busy ms / iter", "launches / iter",
                                    "stream syncs / iter", "DtoH / iter"]  # fmt: skip
    assert main["rows"] == [["f32", "completed", "4.00", "1.50", "120", "0.5", "2.0",
                             "encoder=torch, mlp=tcnn"]]  # fmt: skip
    assert parts["rows"] == [["mptex.alpha", "0.125", ""], ["mptex.zeta", "0.250", ""],
                             ["aten::mm", "0.700", "3"]]  # fmt: skip
