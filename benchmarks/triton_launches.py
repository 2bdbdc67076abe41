"""What mptex's Triton launches cost the host on CUDA, measured on any machine (no GPU needed).

    python benchmarks/triton_launches.py [--sizes 48] [--calls 300] [--json FILE]

Each training iteration issues a few dozen Triton launches (the hash grid, the fused loss, the
FP8 quantisations and GEMMs). On a GPU their host-side work is on the iteration's critical path
whenever the host, not the device, is what the loop waits for. Two things about that work are
set by mptex's code, not by the GPU, and this script measures both on a CPU, running Triton's
own launch path for an sm_90 (H100/H200) target with the driver's side replaced by stubs (the
current device is 0, the stream 0, a compiled kernel is an object whose launch does nothing):

1. **Compile variants.** Triton compiles a kernel for each new *specialisation* of its
   arguments: an integer argument is specialised on being divisible by 16 or equal to 1, a
   pointer on its alignment. Each launch site below is called at ``--sizes`` batch sizes (the
   covered points ``M``, which change with every training batch, from 500,000 up, with
   multiples of 16, 1024 and 2^19 among them), and the distinct specialisation keys each
   kernel saw are counted: each one is a compile (a second or so on a GPU machine, once per
   process and cache). No compile should depend on a count that only bounds a loop: at most
   two keys per kernel and site (a bound of a contiguous axis that is a multiple of 16 or
   not), one where no such bound varies.
2. **Host time per call** at ``M = 50,003`` (every site takes the same launch path as at
   500,000): the site's Python wrapper (argument checks, output allocations on the CPU's
   allocator, launch sizes), Triton's binder and cache lookup, and the launch up to Triton's C
   launcher, which is not run. The CUDA driver's launch and CUDA's caching allocator add their
   own cost on a GPU machine (the GPU kit's ``fp8`` stage measures whole calls there).

The table says, per site: the launches one call makes, the compile variants over the sizes
(kernel: keys) and the host µs per call (the best of ``--repeats`` timings of ``--calls``
calls: the machine's other work only ever adds to a timing).
``tests/test_triton_launches.py`` runs the variant count and asserts those bounds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine, print_table  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit("triton_launches.py measures compiled launches: unset TRITON_INTERPRET")

TIMED_M = 50_003
UNPROBED = 3  # the exit status where this Triton cannot be probed


def sizes(count: int) -> list[int]:
    """``count`` batch sizes: consecutive values from 500,000 (every residue mod 16 within 16 of
    them), then multiples of 16, 1024 and 2^19."""
    special = [500_224, 501_760, 2**19, 3 * 2**17 + 2**10]
    return [500_000 + i for i in range(max(count - len(special), 0))] + special[:count]


class _Stub:
    """A compiled kernel whose launch does nothing (no GPU here)."""

    function = None
    packed_metadata = None

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, *args):
        return None


class _Driver:
    """Triton's active driver, as far as a launch asks it: device 0, stream 0, sm_90."""

    def __init__(self, target):
        self.target = target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 0

    def get_current_target(self):
        return self.target


class LaunchProbe:
    """What the stubbed launches saw: ``keys`` (kernel name -> the specialisation keys it
    compiled for), ``launches`` (kernel name -> launches)."""

    def __init__(self):
        self.keys: dict[str, set] = defaultdict(set)
        self.launches: Counter = Counter()
        self.kernels: dict[str, object] = {}

    def reset(self) -> None:
        """Forget the counts and the compiled (stub) kernels: the next launches compile again."""
        self.keys.clear()
        self.launches.clear()
        for kernel in self.kernels.values():
            for caches in kernel.device_caches.values():
                caches[0].clear()


@contextlib.contextmanager
def stubbed_cuda_launches(arch: int = 90):
    """Within: every ``@triton.jit`` kernel launch runs Triton's launch path for a CUDA ``arch``
    target up to the C launcher, compiling nothing; yields a :class:`LaunchProbe`. Exits the
    process with status ``UNPROBED`` where this Triton lacks the CUDA backend or the launch path
    this relies on (``JITFunction._do_compile`` and ``device_caches``: Triton 3.6 and 3.9)."""
    try:
        import triton.backends.nvidia  # noqa: F401
        import triton.runtime.jit as jit
        from triton.backends.compiler import GPUTarget

        compile_original, run_original = jit.JITFunction._do_compile, jit.JITFunction.run
        driver_original = jit.driver
    except (ImportError, AttributeError) as exc:
        print(f"this triton cannot be probed without a GPU: {exc}")
        sys.exit(UNPROBED)
    probe = LaunchProbe()

    def do_compile(self, key, signature, device, constexprs, options, attrs, warmup):
        probe.keys[self.__name__].add(key)
        self.device_caches[device][0][key] = kernel = _Stub()
        return kernel

    def run(self, *args, **kwargs):
        probe.launches[self.__name__] += 1
        probe.kernels[self.__name__] = self
        return run_original(self, *args, **kwargs)

    class _Active:
        active = _Driver(GPUTarget("cuda", arch, 32))

    jit.JITFunction._do_compile, jit.JITFunction.run, jit.driver = do_compile, run, _Active()
    try:
        yield probe
    finally:
        jit.JITFunction._do_compile, jit.JITFunction.run = compile_original, run_original
        jit.driver = driver_original


def launch_sites() -> dict[str, callable]:
    """Each Triton launch site of a training iteration: ``prepare(M)`` makes its inputs for a
    batch of ``M`` covered points (the MLP's width 32, its output 3 channels, nvdiffrec's grid
    levels) and returns the call, the host wrapper the training loop calls on CUDA."""
    import torch

    import mptex._fp8_triton as quantize
    from mptex._fp8_layout_triton import padded_copy
    from mptex._fp8_mm_triton import fp8_mm_triton
    from mptex._grid_torch import grid_geometry
    from mptex._grid_triton import _TritonGridFunction
    from mptex.fp8 import E4M3, E5M2
    from mptex.train import _loss_triton as loss

    one, history = torch.ones(()), torch.zeros(16)
    # nvdiffrec's levels with a small table: the launches are the same, and the backward's
    # zeroed gradient table costs the CPU no more than its launch costs a GPU's host
    geometry = grid_geometry(3, 16, 2, 12, 16, 1.3819)
    params = torch.empty(geometry.n_params)
    sites: dict[str, callable] = {}

    def quantisation(recipe: int, fmt: int, shape, pads: tuple[int, int]):
        def prepare(m):
            x = torch.empty(m if shape[0] is None else shape[0], shape[1])
            dtype = E5M2 if fmt else E4M3
            return lambda: quantize.fp8_quantize_triton(x, one, history, fmt, recipe, 0, True,
                                                        True, dtype, *pads)  # fmt: skip

        return prepare

    for name, recipe in (("delayed", 0), ("current", 1), ("rowwise", 2)):
        sites[f"quantise {name}: activation [M, 32], both layouts"] = quantisation(
            recipe, 0, (None, 32), (16, 16)
        )
        sites[f"quantise {name}: gradient [M, 3] E5M2, both layouts"] = quantisation(
            recipe, 1, (None, 3), (16, 16)
        )
        sites[f"quantise {name}: activation [M, 32], as it lies"] = quantisation(
            recipe, 0, (None, 32), (0, 0)
        )
        sites[f"quantise {name}: weight [32, 32], both layouts"] = quantisation(
            recipe, 0, (32, 32), (16, 16)
        )
    scale = torch.ones(())

    def gemm(a_shape, a_dtype, b_shape, b_dtype, transpose_a: bool):
        def prepare(m):
            a = torch.empty(*[m if d is None else d for d in a_shape], dtype=a_dtype)
            b = torch.empty(*[m if d is None else d for d in b_shape], dtype=b_dtype)
            a = a.t() if transpose_a else a
            return lambda: fp8_mm_triton(a, b, scale, scale)

        return prepare

    sites["FP8 GEMM (triton): forward [M, 32] x [32, 32]"] = gemm(
        (None, 32), E4M3, (32, 32), E4M3, False
    )
    sites["FP8 GEMM (triton): weight gradient [32, M] x [M, 32]"] = gemm(
        (None, 32), E5M2, (None, 32), E4M3, True
    )

    def copy(m):
        x = torch.empty(m, 3, dtype=torch.uint8)
        return lambda: padded_copy(x, -(-m // 16) * 16, 16, False)

    sites["padded copy: [M, 3] to [pad(M), 16]"] = copy

    def grid(m):
        x = torch.empty(m, 3)
        return lambda: _TritonGridFunction.forward(_Ctx(), x, params, geometry, torch.float32)

    def grid_backward(m):
        ctx = _Ctx()
        ctx.saved_tensors = (torch.empty(m, 3), params)
        ctx.geometry, ctx.out_dtype = geometry, torch.float32
        ctx.needs_input_grad = (False, True, False, False)
        grad = torch.empty(m, geometry.n_output_dims)
        return lambda: _TritonGridFunction.backward(ctx, grad)

    sites["hash grid (triton): forward, M points"] = grid
    sites["hash grid (triton): backward, M points"] = grid_backward

    def smoothness(gradient: bool):
        def prepare(m):
            tex, jitter, g = torch.empty(m, 4), torch.empty(m, 4), torch.ones(())
            if gradient:
                return lambda: loss.kd_grad(tex, jitter, g, 4 * 512 * 512, False)
            return lambda: loss.kd_partials(tex, jitter)

        return prepare

    sites["fused loss: smoothness partials [M, 4]"] = smoothness(False)
    sites["fused loss: smoothness gradient [M, 4]"] = smoothness(True)

    def image_loss(m):
        pixels = 4 * 512 * 512  # the views' pixels: not the batch's covered points
        pred, rgba, bg = torch.empty(pixels, 3), torch.empty(pixels, 4), torch.empty(pixels, 3)
        return lambda: loss.loss_partials(pred, rgba, bg, False)

    sites["fused loss: image partials (l1), 512^2 x 4"] = image_loss
    return sites


class _Ctx:
    """The autograd context the grid's forward and backward are called with directly."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def _allow_cpu_tensors() -> None:
    """The wrappers refuse CPU tensors outside Triton's interpreter; here nothing runs."""
    import mptex._grid_triton as grid
    from mptex.train import _loss_triton as loss

    grid.check_device = lambda device: None
    loss._check_runnable = lambda device: None


def _keep_freed_blocks() -> None:
    """glibc hands blocks of more than 128 KiB back to the system on every free and maps them
    again on the next allocation, where CUDA's caching allocator keeps them: keep them (up to
    its 32 MiB cap) in the heap here too, so that the wrappers' output allocations cost what an
    allocator that reuses blocks costs."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: the timings include the system's allocation cost
        return
    libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD


def measure(n_sizes: int, calls: int, repeats: int, timed: bool = True) -> list[dict]:
    _allow_cpu_tensors()
    _keep_freed_blocks()
    results = []
    with stubbed_cuda_launches() as probe:
        for site, prepare in launch_sites().items():
            probe.reset()
            for m in sizes(n_sizes):
                prepare(m)()
            variants = {name: len(found) for name, found in probe.keys.items()}
            call = prepare(TIMED_M)
            probe.launches.clear()
            call()
            per_call = dict(probe.launches)
            host_us = None
            if timed:
                runs = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    for _ in range(calls):
                        call()
                    runs.append((time.perf_counter() - start) / calls * 1e6)
                host_us = min(runs)  # the least disturbed timing
            results.append({"site": site, "launches": per_call, "variants": variants,
                            "host_us": host_us})  # fmt: skip
    return results


def print_results(results: list[dict], n_sizes: int) -> None:
    rows = []
    for r in results:
        variants = ", ".join(f"{k.strip('_')}: {v}" for k, v in r["variants"].items()) or "–"
        host = "–" if r["host_us"] is None else f"{r['host_us']:.1f}"
        rows.append([r["site"], str(sum(r["launches"].values())), variants, host])
    print(f"compile variants over {n_sizes} batch sizes; host µs per call at M = {TIMED_M:,}; "
          f"{machine('cpu')}\n")  # fmt: skip
    print_table(["launch site", "launches / call", "compile variants (kernel: keys)",
                 "host µs / call"], rows)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, default=48, help="batch sizes per site")
    parser.add_argument("--calls", type=int, default=300, help="calls per timing")
    parser.add_argument("--repeats", type=int, default=7, help="timings per site, the best kept")
    parser.add_argument("--no-timing", action="store_true", help="count compile variants only")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if args.sizes < 1 or args.calls < 1 or args.repeats < 1:
        parser.error("--sizes, --calls and --repeats: expected positive integers")
    import torch

    torch.set_num_threads(1)
    results = measure(args.sizes, args.calls, args.repeats, timed=not args.no_timing)
    print_results(results, args.sizes)
    if args.json:
        import triton

        payload = {"machine": machine("cpu"), "triton": triton.__version__,
                   "sizes": sizes(args.sizes), "results": results}  # fmt: skip
        args.json.write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    main()
