"""Per-iteration overhead of the training loop: aten ops and host synchronisations, per arm.

    python benchmarks/loop_overhead.py                      # the main arms, table + JSON
    python benchmarks/loop_overhead.py --arms f32 fp8 --json out.json
    python benchmarks/loop_overhead.py --compare before.json after.json
    python benchmarks/loop_overhead.py --host-ms --arms f32 fp8 fp8_rowwise
    python benchmarks/loop_overhead.py --arms fp8 fp8_rowwise --fp8-gemm scaled_mm
    python benchmarks/loop_overhead.py --arms fp8 fp8_rowwise --fp8-gemm triton --fused-loss
    python benchmarks/loop_overhead.py --arms f32 fp8 --fused-loss

A GPU iteration of a small texture is bound by kernel launches and by the host waiting for the
device, not by arithmetic (an H100 profile of nvdiffrec's texture at 512^2: 266 kernel launches
and 10.2 ms per iteration, ~3 ms of it the texture's kernels). Both are properties of the code,
not of the device, so they are counted here on the CPU: a run of ``mptex.train.train`` at
64 x 64 pixels on the built-in scene with nvdiffrec's texture (``texture=default``, the quick
protocol's training settings, ``train.batch_size=4``), under a ``TorchDispatchMode`` that sees
every op that reaches a kernel, over the iterations ``[--start, --stop)`` (10-50 by default).
Per iteration: the ``step`` calls of those iterations and the loop's bookkeeping between
them (history; the precision statistics every ``stats_interval``, 10, are inside ``step``).
The validation (every ``val_interval``: once in the window, after 50 iterations) and
checkpoints are counted per call, apart: they run at their own interval.

What counts:

* **op**: an operator call on run data that reaches a backend kernel (one launch or more on
  CUDA), i.e. every op the dispatch mode sees except ops on host data only (below: no device
  kernel; counted apart as ``host_ops_per_iter``) and those that only make a view or touch
  metadata
  (``OpOverload.is_view``: ``view``, ``reshape`` as a view, ``t``, ``select``, ``slice``,
  ``expand``, ``detach``, ``alias``, ``lift_fresh``...) and the profiler's scope markers
  (``record_function``: no kernel). In-place ops and copies count. A custom op counts as
  one (``mptex::fp8_quantize``, the FP8 arms' quantisation: one C call on the CPU, two
  Triton launches on CUDA); work done by calls outside the dispatcher (the CPU grid's and
  the fused network's C kernels, tcnn, Triton kernels called directly) is not seen.
* **host synchronisation** (a *sync*): an op that would make the host wait for a CUDA device:
  a read of a device value to the host (``aten::_local_scalar_dense``: ``.item()``,
  ``bool()``, ``float()``, ``int()``; ``aten::is_nonzero``; ``aten::equal``), an op whose
  output size depends on the values (``nonzero``, ``masked_select``, ``unique``...,
  ``repeat_interleave`` without ``output_size``), a copy between the host and the device
  (a ``_to_copy``/``copy_`` across devices, when the run is on one; on the CPU:
  ``Tensor.tolist()``/``Tensor.numpy()`` of run data, which bypass the dispatcher, and
  ``torch.tensor(..., device=...)``/``new_tensor`` of run data, which on a device are a
  blocking copy from pageable memory: PyTorch's blocking copy synchronises the stream), and
  a wait outside the dispatcher (``torch.cuda.synchronize``, a stream's or an event's
  ``synchronize``). Reads of tensors that live on the host by design are not syncs: the
  views' indices drawn from the run's CPU generator (``RunState.generators["views"]``) and
  anything computed only from them, tensors made from Python data without a ``device``,
  Adam's ``step`` counters where they are on the host (torch keeps them there unless
  ``fused``/``capturable``; fused Adam's, on the device, are counted as any op), found by
  identity, and the host scalars torch's optimizers make for them. In a run on a device, host
  data copied there is a launch and a sync, and what the copy made is the device's.

``--host-ms`` measures what the counts stand for: the host's time per iteration when the
kernels cost next to nothing (the built-in scene at 8 x 8 pixels, batch 4, ``texture=tiny``,
one thread, 200 iterations per run, ``--host-runs`` runs per arm taken in turn; overrides
after ``--`` apply), i.e. Python, the dispatcher, autograd and the kernels' launch overhead. A
GPU iteration takes at least that long on a host of the same speed, whatever its kernels cost.
Per arm: the median of the runs' median iteration times, their range and the ratio to
``f32``'s (same machine, same process, runs interleaved).

``--fp8-gemm scaled_mm`` sends the FP8 arms' GEMMs through ``torch._scaled_mm`` (torch has a CPU
kernel for it) as on a GPU with FP8 tensor cores, so that the counts include that path's
padding and layout copies; this CPU kernel's own host time makes ``--host-ms`` under it no
measure of a GPU's. ``--fp8-gemm triton`` runs them in their Triton kernels
(``texture.fp8_gemm=triton``) under Triton's CPU interpreter, each launch counted as one op.

``--fp8-quantize triton`` runs the FP8 quantisations (``mptex::fp8_quantize``, one op on the
CPU) in their Triton kernels, as on CUDA, under the interpreter: each launch counted as one op
(``triton:<kernel>``), so that the counts are a CUDA run's launches, not estimates.

``--fused-loss`` runs the image loss in its Triton kernels (``train.fused_loss``, CUDA's path)
under Triton's CPU interpreter, so that the counts are those of a CUDA run's loss: its kernels
are launches outside the dispatcher, not counted, as a GPU's Triton grid is not; the
interpreter's own cost makes ``--host-ms`` under it no measure of a GPU's.

The table: per arm, ops/iter and syncs/iter, the split of syncs by kind, ops and syncs per
validation, and the three Python frames (innermost first, mptex's own code) of the most
frequent sync sites. ``--json`` writes
everything, including the op counts by name.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, print_table  # noqa: E402

from mptex.diagnostics.overhead import OverheadCounter  # noqa: E402
from mptex.diagnostics.overhead import patch_host_reads as _patch_host_reads  # noqa: E402

ARMS = ("f32", "nvdiffrec", "f16_dynamic", "fp8", "fp8_current", "bf16_grid", "f16_naive")


def run_config(arm: str, resolution: int, iterations: int, overrides: list[str],
               texture: str = "default"):  # fmt: skip
    from hydra import compose, initialize_config_dir

    from mptex.cli import CONFIG_DIR, register_experiments

    register_experiments()
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        return compose("config", overrides=[
            "+experiment=quick", f"texture={texture}", f"precision={arm}",
            f"scene.resolution={resolution}", "train.batch_size=4",
            f"train.iterations={iterations}", "train.progress=false", "train.threads=1",
            "train.device=cpu", *overrides,
        ])  # fmt: skip


def count_arm(arm: str, start: int, stop: int, resolution: int, overrides: list[str],
              texture: str = "default") -> dict:  # fmt: skip
    """Train one run of ``arm`` and count the loop's ops and syncs in iterations
    ``[start, stop)``; returns the counts (per iteration and by name/site)."""
    from mptex.train import loop

    cfg = run_config(arm, resolution, stop + 5, overrides, texture)
    state: dict = {}
    counter_ref: list = [None]
    # Iterations are counted from their forward and backward (loop._forward_backward), which
    # with train.overlap is queued before the previous iteration's read: a window then holds
    # the read of the iteration before it instead of its own last one, the same per iteration.
    original_step, original_setup = loop._forward_backward, loop.setup
    originals = {name: getattr(loop, name) for name in ("validate", "checkpoint")}

    def phased(name):
        def call(*args, **kwargs):
            counter = counter_ref[0]
            if counter is None:
                return originals[name](*args, **kwargs)
            counter.phase = name
            state[name + "s"] = state.get(name + "s", 0) + 1
            try:
                return originals[name](*args, **kwargs)
            finally:
                counter.phase = "step"

        return call

    def setup(*args, **kwargs):
        state["run"] = run = original_setup(*args, **kwargs)
        return run

    def step(run, it):
        if it == start:
            counter = OverheadCounter(run.device, [run.generators["views"]])
            for param_state in run.optimizer.state.values():
                step_count = param_state.get("step")
                # on the CPU for the foreach and loop implementations; fused Adam (CUDA's)
                # keeps them on the device, where its increment is a launch
                if isinstance(step_count, torch.Tensor) and step_count.device.type == "cpu":
                    counter.mark_host(step_count)
            counter_ref[0] = counter
            counter.__enter__()
        if it == stop and counter_ref[0] is not None:
            counter_ref[0].__exit__(None, None, None)
            state["counter"], counter_ref[0] = counter_ref[0], None
        if counter_ref[0] is not None:
            state["counted"] = state.get("counted", 0) + 1
        return original_step(run, it)

    undo = _patch_host_reads(counter_ref)
    loop._forward_backward, loop.setup = step, setup
    for name in originals:
        setattr(loop, name, phased(name))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            metrics = loop.train(cfg, tmp)
    finally:
        loop._forward_backward, loop.setup = original_step, original_setup
        for name, original in originals.items():
            setattr(loop, name, original)
        undo()
        if counter_ref[0] is not None:  # the run ended inside the window (diverged)
            counter_ref[0].__exit__(None, None, None)
            state["counter"], counter_ref[0] = counter_ref[0], None
    if "counter" not in state:  # e.g. f16_naive diverges within a few iterations
        return {"arm": arm, "iterations": None, "status": metrics["status"],
                "ended_at": metrics.get("diverged_at"), "ops_per_iter": None,
                "syncs_per_iter": None, "syncs_by_kind": {}, "sync_sites": []}  # fmt: skip
    counter = state["counter"]
    n = max(1, state.get("counted", stop - start))

    def per(counts, phase, scale):
        return {k[1]: v / scale for k, v in counts.most_common() if k[0] == phase}

    phases = {"validate": max(1, state.get("validations", 0)),
              "checkpoint": max(1, state.get("checkpoints", 0))}  # fmt: skip
    return {
        "arm": arm,
        "iterations": [start, start + n],
        "status": metrics["status"],
        "ops_per_iter": sum(per(counter.ops, "step", n).values()),
        "syncs_per_iter": sum(per(counter.syncs, "step", n).values()),
        "syncs_by_kind": per(counter.syncs, "step", n),
        "host_ops_per_iter": sum(per(counter.host_ops, "step", n).values()),
        "per_call": {
            phase: {
                "calls": state.get(phase + "s", 0),
                "ops": sum(per(counter.ops, phase, calls).values()),
                "syncs": sum(per(counter.syncs, phase, calls).values()),
            }
            for phase, calls in phases.items()
        },
        "sync_sites": [
            {"phase": phase, "kind": kind, "site": site, "per_iter": count / n}
            for (phase, kind, site), count in counter.sites.most_common()
        ],
        "ops_by_name": per(counter.ops, "step", n),
        "ops_by_file": per(counter.op_files, "step", n),
        "ops_by_site": [
            {"op": op, "site": site, "per_iter": v / n}
            for (phase, op, site), v in counter.op_sites.most_common()
            if phase == "step"
        ],  # fmt: skip
    }


def host_ms(arms: list[str], runs: int, iterations: int = 200, overrides=()) -> list[dict]:
    """Per arm, each run's median iteration time in ms at a negligible size (module docstring),
    the runs taken in turn over the arms; ``overrides`` (e.g. ``train.device=cuda``) last."""
    from mptex.train import loop

    overrides = [f"train.val_interval={iterations}", "train.checkpoint_interval=0",
                 "train.n_val_images=0", *overrides]  # fmt: skip
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    for _ in range(runs):
        for arm in arms:
            cfg = run_config(arm, 8, iterations, overrides, texture="tiny")
            with tempfile.TemporaryDirectory() as tmp:
                seconds = loop.train(cfg, tmp)["time_per_iter_s"]
            # None: the run stopped before a timed iteration (its row says so)
            times[arm].append(None if seconds is None else seconds * 1e3)
    return [{"arm": arm, "host_ms_runs": ms} for arm, ms in times.items()]


def print_host_ms(results: list[dict]) -> None:
    f32_runs = next((r["host_ms_runs"] for r in results if r["arm"] == "f32"), [])
    f32_runs = [m for m in f32_runs if m is not None]
    f32 = statistics.median(f32_runs) if f32_runs else None
    rows = []
    for r in results:
        ms = [m for m in r["host_ms_runs"] if m is not None]
        if not ms:
            rows.append([r["arm"], "–", "no timed iteration", "0", "–"])
            continue
        median = statistics.median(ms)
        rows.append([r["arm"], f"{median:.2f}", f"{min(ms):.2f}-{max(ms):.2f}", str(len(ms)),
                     f"{median / f32:.2f}" if f32 else "–"])  # fmt: skip
    print_table(["arm", "host ms / iter (median of runs)", "range over runs", "runs", "x f32"],
                rows)  # fmt: skip


def print_results(results: list[dict], top_sites: int) -> None:
    rows = []
    for r in results:
        if r["ops_per_iter"] is None:
            rows.append([r["arm"], "–", "–", f"{r['status']} at iteration {r['ended_at']}, "
                         "before the window", "–"])  # fmt: skip
            continue
        kinds = ", ".join(f"{k} {v:g}" for k, v in r["syncs_by_kind"].items()) or "–"
        val = r["per_call"]["validate"]
        rows.append([r["arm"], f"{r['ops_per_iter']:.1f}", f"{r['syncs_per_iter']:.2f}", kinds,
                     f"{val['ops']:.0f} / {val['syncs']:.0f}"])  # fmt: skip
    print_table(["arm", "ops/iter", "syncs/iter", "syncs by kind (per iter)",
                 "per validation: ops / syncs"], rows)  # fmt: skip
    for r in results:
        if not r["sync_sites"]:
            continue
        print(f"\n{r['arm']}: sync sites (per iteration; innermost mptex frames first)")
        for site in r["sync_sites"][:top_sites]:
            print(f"  {site['per_iter']:6.3f}  {site['phase']}: {site['kind']}: {site['site']}")


def compare(before_path: Path, after_path: Path) -> None:
    before = {r["arm"]: r for r in json.loads(before_path.read_text())["results"]}
    after = {r["arm"]: r for r in json.loads(after_path.read_text())["results"]}

    def cell(result, key, digits):
        value = None if result is None else result.get(key)
        return "–" if value is None else f"{value:.{digits}f}"

    rows = []
    for arm in after:
        b, a = before.get(arm), after[arm]
        rows.append([arm, cell(b, "ops_per_iter", 1), cell(a, "ops_per_iter", 1),
                     cell(b, "syncs_per_iter", 2), cell(a, "syncs_per_iter", 2)])  # fmt: skip
    print_table(["arm", "ops/iter before", "ops/iter after", "syncs/iter before",
                 "syncs/iter after"], rows)  # fmt: skip


def _route_fp8_gemms_through_scaled_mm() -> None:
    """Make ``"auto"`` pick the ``scaled_mm`` GEMM backend on any device, for this process:
    the ops the FP8 arms make on a GPU with FP8 tensor cores (its padding and layout copies),
    counted here. The CPU's ``torch._scaled_mm`` kernel costs more host time than a GPU's
    launch may, so ``--host-ms`` under this option is not a GPU's host time."""
    import mptex.fp8

    if not hasattr(torch, "_scaled_mm"):
        raise SystemExit("--fp8-gemm scaled_mm: this torch has no torch._scaled_mm")
    mptex.fp8.has_fp8_tensor_cores = lambda device, rowwise=False: True


def _interpret_triton(option: str) -> None:
    """Triton's CPU interpreter for the kernels decorated from now on; the padded copy of
    ``torch._scaled_mm``'s operands, which then runs in its kernel as on CUDA, counted one op
    per launch."""
    import os

    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit(f"{option}: triton was imported before TRITON_INTERPRET was set")
    os.environ["TRITON_INTERPRET"] = "1"
    import mptex._fp8_layout_triton as layout

    # Both routes come here (--fp8-gemm triton --fused-loss): the kernel is wrapped once.
    if not isinstance(layout._padded_copy_kernel, _CountedLaunch):
        layout._padded_copy_kernel = _CountedLaunch(layout._padded_copy_kernel,
                                                    "padded_copy_kernel")  # fmt: skip


def _route_fp8_gemms_through_triton() -> None:
    """The FP8 GEMMs' Triton kernels (``texture.fp8_gemm=triton``) under the interpreter, each
    launch counted as one op, as on a GPU."""
    _interpret_triton("--fp8-gemm triton")
    import mptex._fp8_mm_triton as kernels

    for name in ("_mm_kernel", "_split_sum_kernel"):
        setattr(kernels, name, _CountedLaunch(getattr(kernels, name), name.strip("_")))


def _route_quantisations_through_triton() -> None:
    """``mptex::fp8_quantize`` in its Triton kernels (its CUDA implementation) under the
    interpreter, each launch counted as one op; the allocations of its outputs are counted as
    they would be on CUDA (``empty``, no kernel)."""
    _interpret_triton("--fp8-quantize triton")
    import mptex._fp8_triton as kernels
    import mptex.fp8

    for name in ("_amax_partials_kernel", "_scale_cast_kernel", "_row_partials_kernel",
                 "_rowwise_kernel", "_row_statistics_kernel", "_rowwise_both_kernel"):  # fmt: skip
        setattr(kernels, name, _CountedLaunch(getattr(kernels, name), name.strip("_")))
    original = mptex.fp8.fp8_quantize

    def quantize(x, *args):
        if x.dtype != torch.float32:  # where the op itself would run its twin
            return original(x, *args)
        return kernels.fp8_quantize_triton(x.detach(), *args)

    mptex.fp8.fp8_quantize = quantize


def _route_loss_through_triton() -> None:
    """Run the image loss in its Triton kernels on the CPU, under Triton's interpreter, as
    ``train.fused_loss`` runs them on CUDA: the ops of a CUDA run's loss, counted here."""
    _interpret_triton("--fused-loss")
    import mptex.train._loss_triton as kernels
    import mptex.train.fused_loss as fused_loss
    import mptex.train.loop as loop

    def problem(device, loss):  # the interpreter lifts the device's and libdevice's needs
        fused = loss is None or loss in fused_loss.FUSED_LOSSES
        return None if fused else f"a loss in {list(fused_loss.FUSED_LOSSES)}"

    fused_loss.fused_loss_problem = loop.fused_loss_problem = problem
    # The run-time check compares the kernels with eager torch to the bit; interpreted, their
    # log and pow are correctly rounded where the CPU's are an ulp off now and then, which
    # changes no count.
    loop.fused_loss_check = lambda device, loss: None
    for name in ("_partials_kernel", "_grad_kernel", "_kd_partials_kernel", "_kd_grad_kernel"):
        setattr(kernels, name, _CountedLaunch(getattr(kernels, name), name.strip("_")))


class _CountedLaunch:
    """An interpreted Triton kernel whose launch counts as one op (``triton:<name>``), as on a
    GPU, and whose interpreter's own tensor copies are kept from the counting mode."""

    def __init__(self, kernel, name: str):
        self.kernel, self.name = kernel, name

    def __getitem__(self, grid):
        from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode

        from mptex.diagnostics.overhead import OverheadCounter

        launch = self.kernel[grid]

        def run(*args, **kwargs):
            mode = _get_current_dispatch_mode()
            if not isinstance(mode, OverheadCounter):
                return launch(*args, **kwargs)
            with _disable_current_modes():
                out = launch(*args, **kwargs)
            mode.record_launch(f"triton:{self.name}")
            return out

        return run


def _run_device(overrides: list[str]) -> str:
    """The runs' device: the last ``train.device=`` override (``run_config`` puts the CPU
    first), for the machine line."""
    devices = [o.split("=", 1)[1] for o in overrides if o.startswith("train.device=")]
    device = devices[-1] if devices else "cpu"
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _write_json(args: argparse.Namespace, results: list[dict], **extra) -> None:
    payload = {"machine": machine(_run_device(args.overrides)), "fp8_gemm": args.fp8_gemm,
               "fp8_quantize": args.fp8_quantize, "fused_loss": args.fused_loss, **extra,
               "results": results}  # fmt: skip
    args.json.write_text(json.dumps(payload, indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arms", nargs="+", default=list(ARMS))
    parser.add_argument("--start", type=int, default=10)
    parser.add_argument("--stop", type=int, default=50)
    parser.add_argument("--resolution", type=int, default=64)
    parser.add_argument("--texture", default="default", help="texture config (nvdiffrec's)")
    parser.add_argument("--top-sites", type=int, default=6)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--compare", type=Path, nargs=2, metavar=("BEFORE", "AFTER"))
    parser.add_argument(
        "--host-ms",
        action="store_true",
        help="time the host's work per iteration at a negligible size instead",
    )
    parser.add_argument("--host-runs", type=int, default=3)
    parser.add_argument(
        "--fp8-gemm",
        choices=("auto", "scaled_mm", "triton"),
        default="auto",
        help="scaled_mm: the FP8 arms' GEMMs through torch._scaled_mm, as on a GPU with FP8 "
        "tensor cores (torch has a CPU kernel for it); triton: in their Triton kernels, "
        "interpreted, each launch one op",
    )
    parser.add_argument(
        "--fp8-quantize",
        choices=("auto", "triton"),
        default="auto",
        help="triton: the FP8 quantisations in their Triton kernels (CUDA's), interpreted, "
        "each launch one op",
    )
    parser.add_argument(
        "--fused-loss",
        action="store_true",
        help="the image loss in its Triton kernels under Triton's interpreter, as on CUDA",
    )
    parser.add_argument("overrides", nargs="*", help="more Hydra overrides, after --")
    args = parser.parse_args(argv)
    if args.compare:
        compare(*args.compare)
        return
    torch.set_num_threads(1)
    if args.fp8_gemm == "scaled_mm":
        _route_fp8_gemms_through_scaled_mm()
    if args.fp8_gemm == "triton":
        _route_fp8_gemms_through_triton()
        args.overrides = ["texture.fp8_gemm=triton", *args.overrides]
    if args.fused_loss:
        _route_loss_through_triton()
        args.overrides = ["train.fused_loss=true", *args.overrides]
    if args.fp8_quantize == "triton":
        _route_quantisations_through_triton()
    if args.host_ms:
        if args.host_runs < 1:
            parser.error(f"--host-runs: expected at least 1, got {args.host_runs}")
        fixed = [f"--{name}" for name in ("start", "stop", "resolution", "texture")
                 if getattr(args, name) != parser.get_default(name)]  # fmt: skip
        if fixed:
            parser.error(f"{', '.join(fixed)}: --host-ms times every iteration at 8 x 8 with "
                         "texture=tiny; those options are the counts'")  # fmt: skip
        results = host_ms(args.arms, args.host_runs, overrides=args.overrides)
        print(f"builtin scene 8x8, batch 4, texture=tiny, 200 iterations per run; "
              f"{machine(_run_device(args.overrides))}\n")  # fmt: skip
        print_host_ms(results)
        if args.json is not None:
            _write_json(args, results)
        return
    results = []
    for arm in args.arms:
        results.append(count_arm(arm, args.start, args.stop, args.resolution, args.overrides,
                                 args.texture))  # fmt: skip
        if args.json is not None:  # after each arm: a long run keeps what it counted
            _write_json(args, results)
    loss = "fused (Triton, interpreted)" if args.fused_loss else "eager"
    print(
        f"builtin scene {args.resolution}x{args.resolution}, batch 4, texture={args.texture}, "
        f"iterations [{args.start}, {args.stop}), FP8 GEMMs {args.fp8_gemm}, FP8 quantisations "
        f"{args.fp8_quantize}, loss {loss}; {machine(_run_device(args.overrides))}\n"
    )
    print_results(results, args.top_sites)
    if args.json is not None:
        _write_json(args, results, resolution=args.resolution, overrides=args.overrides)


if __name__ == "__main__":
    main()
