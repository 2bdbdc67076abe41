"""A small C kernel for the fused-MLP twin's sequential arithmetic, compiled on first use.

What it computes: :func:`mptex._fused_mlp_torch.half_matmul` and
:func:`~mptex._fused_mlp_torch.split_k_weight_grads`, the twin's two loops, under the same
arithmetic model: products of half values formed exactly in float64, summed per k-block in k
order starting from +0.0 (as MKL's float64 GEMM does: an all-zero block sums to +0.0), each
block sum added to the accumulator and rounded once to float32, then to half (half
accumulators). The inputs arrive as float64 copies of the half operands and the accumulators
leave as float64 holding the rounded values, so every conversion a caller sees is exact.

Why C: the half accumulation is sequential along the batch, one rounding per block of 8
samples, ~530 steps per weight gradient at any batch size. Eager PyTorch pays ~3 µs of dispatch
per op and step, about as much as the rest of the network; a loop does a step in a few hundred
nanoseconds. The kernel is plain C (no torch headers, no Python API): the system compiler
builds it in well under a second, ``ctypes`` loads it.

Bits: float64 sums of exact products are exact, so their order cannot matter unless a block's
terms span more than ~31 binary orders of magnitude, and a float64 difference then survives
the float32 rounding only at a tie; ``tests/test_fused_mlp_torch.py`` holds both paths to the
eager implementation's golden tensors. One thread: the bits do not depend on torch's thread
count.

Fallback: without a C compiler (``cc``, or ``$CC``), or with ``MPTEX_NATIVE=0``, the twin runs
its eager PyTorch loops (a warning says so, once). Builds are cached under
``$MPTEX_CACHE_DIR`` (default ``$XDG_CACHE_HOME/mptex`` or ``~/.cache/mptex``), one file per
source, compiler flags and CPU (``-march=native``), written atomically.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from mptex._backends import warn_fallback_once

__all__ = ["native_kernels", "half_matmul_native", "weight_grads_native"]

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__F16C__)
#define MPTEX_AVX512 1
#endif

typedef uint16_t half_bits;

/* Conversions, rounding to nearest even: F16C where the CPU has it, else _Float16. */
#ifdef __F16C__
static inline float half_to_float(half_bits h) { return _cvtsh_ss(h); }
static inline half_bits float_to_half(float v) {
    return _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
#else
static inline float half_to_float(half_bits h) {
    _Float16 value;
    memcpy(&value, &h, sizeof value);
    return (float)value;
}
static inline half_bits float_to_half(float v) {
    _Float16 value = (_Float16)v;
    half_bits h;
    memcpy(&h, &value, sizeof h);
    return h;
}
#endif

static inline double half_to_double(half_bits h) { return (double)half_to_float(h); }
static inline half_bits double_to_half(double v) { return float_to_half((float)v); }

/* float64 -> float32 (one rounding) -> half (one rounding) -> float64 (exact). */
static inline double round_acc(double value, int half) {
    float single = (float)value;
    return half ? (double)half_to_float(float_to_half(single)) : (double)single;
}

static void halves_to_doubles(const half_bits *src, double *dst, int64_t n) {
    int64_t e = 0;
#ifdef MPTEX_AVX512
    for (; e + 8 <= n; e += 8)
        _mm512_storeu_pd(dst + e, _mm512_cvtps_pd(_mm256_cvtph_ps(
                                      _mm_loadu_si128((const __m128i *)(src + e)))));
#endif
    for (; e < n; ++e) dst[e] = half_to_double(src[e]);
}

#ifdef MPTEX_AVX512
static inline __m512d round_acc8(__m512d value, int half) {
    __m256 single = _mm512_cvtpd_ps(value);
    if (half)
        single = _mm256_cvtph_ps(
            _mm256_cvtps_ph(single, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    return _mm512_cvtps_pd(single);
}
#endif

/* out [n, m] (half) = a [n, k] @ b [k, m] (half) in k-blocks of k_block: each block's
   products summed in k order from +0.0, added to the accumulator, rounded (round_acc); the
   accumulator stored as half at the end. scratch: k * m + m doubles. */
int mptex_half_matmul(const half_bits *a, const half_bits *b, half_bits *out, double *scratch,
                      int64_t n, int64_t k, int64_t m, int64_t k_block, int half) {
    double *b64 = scratch, *acc = scratch + k * m;
    halves_to_doubles(b, b64, k * m);
    double a_row[4096];
    if (k > 4096) return 1;
    for (int64_t row = 0; row < n; ++row) {
        halves_to_doubles(a + row * k, a_row, k);
        int64_t col = 0;
#ifdef MPTEX_AVX512
        for (; col + 32 <= m; col += 32) { /* four independent chains */
            __m512d acc[4] = {_mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd(),
                              _mm512_setzero_pd()};
            for (int64_t k0 = 0; k0 < k || k0 == 0; k0 += k_block) {
                __m512d sum[4] = {_mm512_setzero_pd(), _mm512_setzero_pd(),
                                  _mm512_setzero_pd(), _mm512_setzero_pd()};
                int64_t k1 = k0 + k_block < k ? k0 + k_block : k;
                for (int64_t kk = k0; kk < k1; ++kk) {
                    __m512d scale = _mm512_set1_pd(a_row[kk]);
                    for (int q = 0; q < 4; ++q)
                        sum[q] = _mm512_fmadd_pd(scale, _mm512_loadu_pd(b64 + kk * m + col + 8 * q),
                                                 sum[q]);
                }
                for (int q = 0; q < 4; ++q) acc[q] = round_acc8(_mm512_add_pd(acc[q], sum[q]), half);
                if (k == 0) break;
            }
            for (int q = 0; q < 4; ++q)
                _mm_storeu_si128((__m128i *)(out + row * m + col + 8 * q),
                                 _mm256_cvtps_ph(_mm512_cvtpd_ps(acc[q]),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
        for (; col + 8 <= m; col += 8) {
            __m512d acc8 = _mm512_setzero_pd();
            for (int64_t k0 = 0; k0 < k || k0 == 0; k0 += k_block) {
                __m512d sum = _mm512_setzero_pd();
                int64_t k1 = k0 + k_block < k ? k0 + k_block : k;
                for (int64_t kk = k0; kk < k1; ++kk)
                    /* exact products: a fused multiply-add rounds as the add alone */
                    sum = _mm512_fmadd_pd(_mm512_set1_pd(a_row[kk]),
                                          _mm512_loadu_pd(b64 + kk * m + col), sum);
                acc8 = round_acc8(_mm512_add_pd(acc8, sum), half);
                if (k == 0) break;
            }
            __m128i h = _mm256_cvtps_ph(_mm512_cvtpd_ps(acc8),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            _mm_storeu_si128((__m128i *)(out + row * m + col), h);
        }
#endif
        if (col < m) {
            int64_t width = m - col;
            for (int64_t j = 0; j < width; ++j) acc[j] = 0.0;
            for (int64_t k0 = 0; k0 < k || k0 == 0; k0 += k_block) {
                int64_t k1 = k0 + k_block < k ? k0 + k_block : k;
                for (int64_t j = 0; j < width; ++j) {
                    double sum = 0.0;
                    for (int64_t kk = k0; kk < k1; ++kk) sum += a_row[kk] * b64[kk * m + col + j];
                    acc[j] = round_acc(acc[j] + sum, half);
                }
                if (k == 0) break;
            }
            for (int64_t j = 0; j < width; ++j) out[row * m + col + j] = double_to_half(acc[j]);
        }
    }
    return 0;
}

/* One slice of a split-K weight gradient: acc [o, i] (float64 holding the accumulator's
   values) accumulates g[r, :]^T a[r, :] (half) over the rows [lo, hi) in blocks of k_block
   rows counted from lo (at most 64). scratch: k_block * (o + i) doubles. counts (if not NULL):
   [0] += non-zero block sums, [1] += those that left their accumulator unchanged. */
int mptex_weight_grad_slice(const half_bits *g, const half_bits *a, double *acc, double *scratch,
                            int64_t lo, int64_t hi, int64_t o, int64_t i, int64_t k_block,
                            int half, int64_t *counts) {
    if (k_block > 64) return 1;
    double *g64 = scratch, *a64 = scratch + k_block * o;
    for (int64_t r0 = lo; r0 < hi; r0 += k_block) {
        int64_t rows = (r0 + k_block < hi ? r0 + k_block : hi) - r0;
        halves_to_doubles(g + r0 * o, g64, rows * o);
        halves_to_doubles(a + r0 * i, a64, rows * i);
        for (int64_t out = 0; out < o; ++out) {
            double *acc_row = acc + out * i;
            int64_t in = 0;
#ifdef MPTEX_AVX512
            for (; in + 32 <= i; in += 32) { /* four independent chains */
                __m512d sum[4] = {_mm512_setzero_pd(), _mm512_setzero_pd(),
                                  _mm512_setzero_pd(), _mm512_setzero_pd()};
                for (int64_t r = 0; r < rows; ++r) {
                    __m512d scale = _mm512_set1_pd(g64[r * o + out]);
                    for (int q = 0; q < 4; ++q)
                        sum[q] = _mm512_fmadd_pd(scale, _mm512_loadu_pd(a64 + r * i + in + 8 * q),
                                                 sum[q]);
                }
                for (int q = 0; q < 4; ++q) {
                    __m512d old = _mm512_loadu_pd(acc_row + in + 8 * q);
                    __m512d new_ = round_acc8(_mm512_add_pd(old, sum[q]), half);
                    if (counts) {
                        __mmask8 nonzero =
                            _mm512_cmp_pd_mask(sum[q], _mm512_setzero_pd(), _CMP_NEQ_UQ);
                        __mmask8 same = _mm512_cmp_pd_mask(new_, old, _CMP_EQ_OQ);
                        counts[0] += __builtin_popcount((unsigned)nonzero);
                        counts[1] += __builtin_popcount((unsigned)(nonzero & same));
                    }
                    _mm512_storeu_pd(acc_row + in + 8 * q, new_);
                }
            }
            for (; in + 8 <= i; in += 8) {
                __m512d sum = _mm512_setzero_pd();
                for (int64_t r = 0; r < rows; ++r)
                    sum = _mm512_fmadd_pd(_mm512_set1_pd(g64[r * o + out]),
                                          _mm512_loadu_pd(a64 + r * i + in), sum);
                __m512d old = _mm512_loadu_pd(acc_row + in);
                __m512d new_ = round_acc8(_mm512_add_pd(old, sum), half);
                if (counts) {
                    __mmask8 nonzero = _mm512_cmp_pd_mask(sum, _mm512_setzero_pd(), _CMP_NEQ_UQ);
                    __mmask8 same = _mm512_cmp_pd_mask(new_, old, _CMP_EQ_OQ);
                    counts[0] += __builtin_popcount((unsigned)nonzero);
                    counts[1] += __builtin_popcount((unsigned)(nonzero & same));
                }
                _mm512_storeu_pd(acc_row + in, new_);
            }
#endif
            for (; in < i; ++in) {
                double sum = 0.0;
                for (int64_t r = 0; r < rows; ++r) sum += g64[r * o + out] * a64[r * i + in];
                double old = acc_row[in], new_ = round_acc(old + sum, half);
                if (counts && sum != 0.0) {
                    counts[0] += 1;
                    counts[1] += new_ == old;
                }
                acc_row[in] = new_;
            }
        }
    }
    return 0;
}
"""

_CFLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=c11")


def _cache_dir() -> Path:
    root = os.environ.get("MPTEX_CACHE_DIR")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mptex"


def _cpu_key() -> str:
    """What -march=native depends on: the CPU model and flags (Linux), else the platform."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return platform.machine() + line
    except OSError:
        pass
    return platform.machine() + platform.processor()


def _build(compiler: str) -> Path:
    key = hashlib.sha256("\0".join((_SOURCE, compiler, *_CFLAGS, _cpu_key())).encode()).hexdigest()[
        :16
    ]
    target = _cache_dir() / f"fused_mlp_cpu-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        source = Path(tmp) / "fused_mlp_cpu.c"
        source.write_text(_SOURCE)
        built = Path(tmp) / target.name
        subprocess.run(
            [compiler, *_CFLAGS, str(source), "-o", str(built)],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.replace(built, target)  # atomic: a concurrent build writes the same bytes
    return target


@functools.cache
def native_kernels() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use; None where it cannot be (warned once)."""
    if os.environ.get("MPTEX_NATIVE", "1") == "0":
        return None  # asked for: no warning
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    reason = "no C compiler (cc) on PATH"
    if compiler is not None:
        try:
            lib = ctypes.CDLL(str(_build(compiler)))
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            reason = f"{type(exc).__name__}: {exc} {detail.decode(errors='replace')[:300]}"
        else:
            i64, ptr = ctypes.c_int64, ctypes.c_void_p
            lib.mptex_half_matmul.argtypes = [ptr] * 4 + [i64] * 4 + [ctypes.c_int]
            lib.mptex_weight_grad_slice.argtypes = [ptr] * 4 + [i64] * 5 + [ctypes.c_int, ptr]
            return lib
    warn_fallback_once(
        "the fused-MLP twin's C kernel",
        f"{reason}; its eager PyTorch loops compute the same bits, several times slower",
    )
    return None


def _ptr(tensor: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(tensor.data_ptr())


def half_matmul_native(
    lib: ctypes.CDLL, a: torch.Tensor, b: torch.Tensor, k_block: int, half: bool
) -> torch.Tensor:
    """``half_matmul`` of ``a [N, K]`` and ``b [K, M]`` (float16, CPU): ``[N, M]`` float16."""
    a = a.contiguous()
    b = b.contiguous()
    n, k = a.shape
    m = b.shape[1]
    out = torch.empty(n, m, dtype=torch.float16)
    scratch = torch.empty(k * m + m, dtype=torch.float64)
    status = lib.mptex_half_matmul(_ptr(a), _ptr(b), _ptr(out), _ptr(scratch), n, k, m,
                                   k_block, int(half))  # fmt: skip
    if status:
        raise ValueError(f"a: at most 4096 columns in the C kernel, got {k}")
    return out


def weight_grads_native(
    lib: ctypes.CDLL,
    layers: list[tuple[torch.Tensor, torch.Tensor]],
    bounds: list[tuple[int, int]],
    k_block: int,
    half: bool,
    counts: list[list[int]] | None,
) -> list[torch.Tensor]:
    """Per layer, its split-K accumulators ``[slices, out, in]`` (float64 holding the
    accumulators' values) from float16 ``(grad_out [B, out], act_in [B, in])`` pairs;
    ``counts[layer]`` receives [non-zero block sums, absorbed ones]."""
    out = []
    for index, (grad_out, act_in) in enumerate(layers):
        grad_out, act_in = grad_out.contiguous(), act_in.contiguous()
        n_out, n_in = grad_out.shape[1], act_in.shape[1]
        acc = torch.zeros(len(bounds), n_out, n_in, dtype=torch.float64)
        scratch = torch.empty(k_block * (n_out + n_in), dtype=torch.float64)
        tally = (ctypes.c_int64 * 2)(0, 0) if counts is not None else None
        for s, (lo, hi) in enumerate(bounds):
            lib.mptex_weight_grad_slice(_ptr(grad_out), _ptr(act_in), _ptr(acc[s]),
                                        _ptr(scratch), lo, hi, n_out, n_in, k_block,
                                        int(half), tally)  # fmt: skip
        if counts is not None:
            counts[index] = [tally[0], tally[1]]
        out.append(acc)
    return out
