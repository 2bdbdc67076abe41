"""Running Triton kernels in a fresh process, for the tests of the Triton modules.

Triton's CPU interpreter is chosen when ``triton.jit`` decorates the kernels, so
``TRITON_INTERPRET=1`` must be in the environment before the kernels' module is first imported:
a fresh process guarantees it whatever the test process imported before. The scripts run there
(``triton_interpreted.py``, ``fp8_triton_interpreted.py``) also compile kernels for a CUDA
target without a GPU (:func:`cuda_target`).
"""

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mptex

HERE = Path(__file__).resolve().parent


# What the interpreted kernels' checks need of Triton's interpreter, in one kernel: an fma
# rounded once, as the GPU's is (1 + 2^-12 squared is 1 + 2^-11 + 2^-24; rounding the product
# first makes the sum 0), and a loop bounded by an integer argument. It prints "ok", "fma", or
# "loop: " and the interpreter's own error; any other failure is no finding of the probe.
_PROBE = """
import torch, triton, triton.language as tl
from triton.runtime.errors import InterpreterError

@triton.jit
def probe(x_ptr, out_ptr, n):
    r = tl.fma(tl.load(x_ptr), tl.load(x_ptr), tl.load(x_ptr + 1))
    for _ in range(0, n):
        r = r * 1.0
    tl.store(out_ptr, r)

x = torch.tensor([1 + 2**-12, -(1 + 2**-11)])
out = torch.zeros(1)
try:
    probe[(1,)](x, out, 3)
except InterpreterError as exc:
    print("loop: " + " ".join(str(exc).split()))
else:
    print("ok" if out.item() == 2**-24 else "fma")
"""


@functools.cache
def interpreter_problem() -> str | None:
    """Why this Triton's CPU interpreter cannot stand in for the compiled kernels, or None.

    The interpreted kernels are checked bit for bit against their twins, which holds where the
    interpreter computes as the GPU does. Triton 3.6 to 3.8's interpreter rounds ``tl.fma``
    twice (its product, then its sum), and Triton 3.6's fails on a loop bounded by a kernel
    argument under NumPy 2.4; Triton 3.9's does neither."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    import triton

    which = f"triton {triton.__version__}'s CPU interpreter"
    said = (proc.stdout.strip().splitlines() or [""])[-1] if proc.returncode == 0 else ""
    if said.startswith("loop: "):
        return f"{which} fails on a loop bounded by a kernel argument ({said[6:]})"
    if said == "fma":
        return f"{which} rounds tl.fma twice, where a GPU rounds it once"
    # "ok", or a probe that could not run at all: the interpreted tests run and say why they fail
    return None


def require_faithful_interpreter() -> None:
    """Skip the calling test where :func:`interpreter_problem` finds one (the kernels' compile
    checks still run there)."""
    problem = interpreter_problem()
    if problem is not None:
        pytest.skip(f"{problem}: the interpreted kernels are checked with triton >= 3.9")


def run_script(
    script: str, *args: str, interpret: bool, timeout: int
) -> subprocess.CompletedProcess:
    """``tests/<script> ARGS`` in a fresh process with ``TRITON_INTERPRET`` set as asked, this
    checkout's mptex first on the path, one OpenMP thread; an interpreted run skips the calling
    test where :func:`require_faithful_interpreter` does."""
    if interpret:
        require_faithful_interpreter()
    root = str(Path(mptex.__file__).resolve().parents[1])
    env = dict(os.environ, TRITON_INTERPRET="1" if interpret else "0", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, str(HERE / script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_cases(script: str, cases: list, folder: Path, timeout: int, weights_only: bool = True):
    """``tests/<script> CASES.pt RESULTS.pt`` under the interpreter in a fresh process, on
    ``cases`` saved in ``folder``: the results it wrote (``weights_only=False`` where they hold
    more than tensors and containers, e.g. a module's state dict with extra state)."""
    import torch

    torch.save(cases, folder / "cases.pt")
    proc = run_script(script, str(folder / "cases.pt"), str(folder / "results.pt"),
                      interpret=True, timeout=timeout)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(folder / "results.pt", weights_only=weights_only)


def cuda_target(arch: int):
    """Triton's ``GPUTarget`` for compute capability ``arch`` (e.g. 90); exits the process with
    status 3 (the caller's skip) if this triton has no CUDA backend."""
    try:
        from triton.backends.compiler import GPUTarget

        target = GPUTarget("cuda", arch, 32)
        import triton.backends.nvidia  # noqa: F401
    except ImportError as exc:
        print(f"no CUDA backend in this triton: {exc}")
        sys.exit(3)
    return target


def check_compiles(script: str, timeout: int) -> None:
    """Run ``tests/<script> --compile-check`` (not interpreted): skip the calling test if the
    script exits with :func:`cuda_target`'s status 3, fail it on any other non-zero status."""
    proc = run_script(script, "--compile-check", interpret=False, timeout=timeout)
    if proc.returncode == 3:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stderr[-4000:]


def script_main(compile_check, run_cases) -> None:
    """A kernels script's entry point: ``--compile-check``, or ``CASES.pt RESULTS.pt``."""
    if sys.argv[1] == "--compile-check":
        compile_check()
    else:
        run_cases(sys.argv[1], sys.argv[2])
