"""Golden bits do not depend on which kernels the CPU's math libraries pick.

PyTorch picks its vectorised CPU kernels (``exp``, ``sqrt``, reductions) by the CPU's
instruction sets, and MKL picks its GEMM kernels the same way, so a bit that depends on either
differs between an AMD EPYC, an Intel Xeon and an older AVX2 machine. ``ATEN_CPU_CAPABILITY``
and ``MKL_ENABLE_INSTRUCTIONS`` (read once, at process start) make this machine pick what another
CPU would; this module reruns every test marked ``golden_bits`` (the stored golden tensors, the
real libraries' fixtures, bit-identity across thread counts) in subprocesses under such
settings. The suite itself runs under the machine's own choice (AVX-512 where it has it).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Two settings beside the machine's own choice, the one the suite runs under; both run on any
# x86-64 CPU (forcing avx512 on a CPU without it dies of an illegal instruction): AVX2 kernels
# for both libraries (what an AMD EPYC without AVX-512 or an older Intel CPU picks), and
# PyTorch's scalar kernels, whose exp and sqrt are the C library's, not SLEEF's vectorised ones.
SETTINGS = {
    "aten-avx2-mkl-avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "aten-default-mkl-avx2": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "aten-avx512-mkl-avx512": {
        "ATEN_CPU_CAPABILITY": "avx512",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
    },
}
# ATen's AVX-512 kernels need these (aten/src/ATen/cpu/vec/vec512).
AVX512_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def _capability(env: dict[str, str]) -> str:
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, check=True)  # fmt: skip
    return proc.stdout.strip()


@pytest.mark.slow
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_golden_bits_hold_under_another_kernel_dispatch(setting):
    capability = SETTINGS[setting]["ATEN_CPU_CAPABILITY"]
    has_avx512 = AVX512_FLAGS <= _cpu_flags()
    if capability == "avx512" and not has_avx512:
        pytest.skip("this CPU has no AVX-512 (avx512f/bw/vl/dq), so it cannot run those kernels")
    own = _capability({k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"})
    if capability.upper() == own and not has_avx512:
        # MKL cannot pick AVX-512 kernels on this CPU either: the suite's own run is this one.
        pytest.skip(f"the suite itself runs with {own} kernels on this CPU")
    env = {**os.environ, "OMP_WAIT_POLICY": "passive", **SETTINGS[setting]}
    # The setting must take effect, or this test would rerun the default dispatch and prove
    # nothing: torch reports the capability it dispatches to.
    assert _capability(env) == SETTINGS[setting]["ATEN_CPU_CAPABILITY"].upper(), setting
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "golden_bits",
         "-x", str(ROOT / "tests")],
        capture_output=True, text=True, cwd=ROOT, env=env,
    )  # fmt: skip
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, f"{setting}: golden tests failed\n{tail}"
