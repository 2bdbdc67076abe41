"""A small C kernel for the CPU twins' loops, compiled on first use.

What it computes, each under its PyTorch spelling's arithmetic, bit for bit:

* the fused-MLP twin's two loops (:func:`mptex._fused_mlp_torch.half_matmul` and
  :func:`~mptex._fused_mlp_torch.split_k_weight_grads`): with half accumulators the tensor
  core's step of :func:`mptex._fused_mlp_torch._tensor_core_step` (products and accumulator
  truncated to a multiple of 2^(E - 25), summed exactly, rounded once to half through float32
  rounded to odd); with float accumulators, products of half values formed exactly in float64,
  summed per k-block in k order from +0.0 (as MKL's float64 GEMM does: an all-zero block sums
  to +0.0), each block sum added to the accumulator and rounded once to float32;
* the torch hash grid's forward and backward (:func:`mptex._grid_torch.hash_grid_encode`):
  tcnn's positions (``fmaf``), cells, hash and dense indices in uint32 arithmetic, weights in
  corner order, the eager op's complex64 products (signs of zeros included), sums in corner
  order, float32 or tcnn's half mode, and the parameter gradient scattered in the eager op's
  order (chunk, level, corner, point), so that its float32 sums round alike.

With AVX-512 (``-march=native`` on a CPU that has it) the tensor core's step runs for 8 outputs
at once, and the grid's half-mode sums (one fused multiply-add per corner, rounded to odd, then
to half) for 8 points at once, with the same operations per lane, so the same bits as the
one-at-a-time loops that the other builds run (``tests/test_fused_mlp_torch.py`` and
``tests/test_grid_torch.py`` compare them).

Why C: the half accumulation is sequential along the batch, one rounding per block of 8
samples, ~530 steps per weight gradient at any batch size, and eager PyTorch pays ~3 µs of
dispatch per op and step; the grid's eager ops make ~20 passes over ``[level, corner, point]``
arrays around the one gather and one scatter it needs. A loop does either in place. The kernel
is plain C (no torch headers, no Python API): the system compiler builds it in about a second,
``ctypes`` loads it. ``-ffp-contract=off`` keeps every float32 expression rounding as the eager
op's; the MLP's fused multiply-adds take exact products, so they round as the add alone.

Bits: float64 sums of exact products are exact, so their order cannot matter unless a block's
terms span more than ~31 binary orders of magnitude, and a float64 difference then survives
the float32 rounding only at a tie. ``tests/test_fused_mlp_torch.py`` and
``tests/test_grid_torch.py`` hold both paths to golden tensors of the first (eager)
implementation. One thread: the bits do not depend on torch's thread count.

Fallback: without a C compiler (``cc``, or ``$CC``), or with ``MPTEX_NATIVE=0``, the eager
PyTorch ops run (a warning says so, once). Builds are cached under ``$MPTEX_CACHE_DIR``
(default ``$XDG_CACHE_HOME/mptex`` or ``~/.cache/mptex``), one file per source, compiler flags
and CPU (``-march=native``), written atomically.
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
import threading
from pathlib import Path

import torch

from mptex._backends import warn_fallback_once

__all__ = [
    "native_kernels",
    "build_kernels",
    "half_matmul_native",
    "weight_grads_native",
    "grid_supported",
    "grid_forward_native",
    "grid_backward_native",
]

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#if defined(__F16C__) || defined(__SSE2__)
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

/* float64 -> float32 rounded to odd (toward zero, last bit set where inexact): float32 keeps
   13 bits more than half, so rounding that to half rounds the float64 value once. */
static inline float round_to_odd_float(double value) {
    float single = (float)value;
    if (fabs((double)single) > fabs(value)) single = nextafterf(single, 0.0f);
    if ((double)single != value) {
        uint32_t bits;
        memcpy(&bits, &single, sizeof bits);
        bits |= 1u;
        memcpy(&single, &bits, sizeof single);
    }
    return single;
}

/* float64 -> half (one rounding to nearest even) or float32 (one rounding) -> float64. */
static inline double round_acc(double value, int half) {
    if (half) return (double)half_to_float(float_to_half(round_to_odd_float(value)));
    return (double)(float)value;
}

/* The tensor core's step with a half accumulator (H100, HMMA with f16 accumulation, as measured
   against tinycudann 2.0): each product's exponent is the sum of its factors' exponents
   (floor(log2 |v|), at least -14 for half subnormals), the accumulator's its own; every term is
   truncated toward zero to a multiple of 2^(E - 25), E the largest exponent among the non-zero
   terms; the truncated terms are summed exactly (integers below 2^32 times 2^(E - 25)) and
   the sum is rounded once to half. */
#define MPTEX_NO_TERM (-100000)
#define MPTEX_TC_BITS 25
static inline int64_t half_value_exponent(double v) {
    if (v == 0.0) return MPTEX_NO_TERM;
    uint64_t bits;
    memcpy(&bits, &v, sizeof bits);
    int64_t e = (int64_t)((bits >> 52) & 0x7ff) - 1023;
    return e < -14 ? -14 : e;
}
static inline double power_of_two(int64_t e) { /* 2^e, |e| < 1000 */
    uint64_t bits = (uint64_t)(e + 1023) << 52;
    double v;
    memcpy(&v, &bits, sizeof v);
    return v;
}
/* products p[0..n) with exponents pe[0..n), accumulator acc (a half value) -> new half value */
static inline double tc_step_half(double acc, const double *p, const int64_t *pe, int64_t n) {
    int64_t top = half_value_exponent(acc);
    for (int64_t q = 0; q < n; ++q)
        if (p[q] != 0.0 && pe[q] > top) top = pe[q];
    if (top == MPTEX_NO_TERM) return 0.0;
    double scale = power_of_two(MPTEX_TC_BITS - top), sum = trunc(acc * scale);
    for (int64_t q = 0; q < n; ++q) sum += trunc(p[q] * scale);
    return round_acc(sum * power_of_two(top - MPTEX_TC_BITS), 1);
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

/* halves_to_doubles, and each value's half_value_exponent. */
static void halves_with_exponents(const half_bits *src, double *dst, int64_t *dst_e, int64_t n) {
    halves_to_doubles(src, dst, n);
    for (int64_t e = 0; e < n; ++e) dst_e[e] = half_value_exponent(dst[e]);
}

#ifdef MPTEX_AVX512
static inline __m512d round_acc8(__m512d value, int half) {
    if (!half) return _mm512_cvtps_pd(_mm512_cvtpd_ps(value));
    /* round_acc's rounding to odd, then to half */
    __m256 single = _mm512_cvt_roundpd_ps(value, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    __mmask8 inexact = _mm512_cmp_pd_mask(_mm512_cvtps_pd(single), value, _CMP_NEQ_UQ);
    __m256i odd = _mm512_cvtepi64_epi32(_mm512_maskz_set1_epi64(inexact, 1));
    single = _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(single), odd));
    single = _mm256_cvtph_ps(
        _mm256_cvtps_ph(single, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    return _mm512_cvtps_pd(single);
}
#endif

#ifdef MPTEX_AVX512
/* tc_step_half on 8 lanes at once (the lanes: 8 outputs), with the same operations in the same
   order per lane, so the same bits: every step (products of two half values, multiplications by
   powers of two, truncations, sums of integers below 2^53) is exact in float64 but the last
   rounding, which round_acc8 does as round_acc. The same holds where a value is not finite (an
   accumulator that overflowed to inf, an inf or NaN input): the exponents come from the same
   bits, the powers of two are built by the same 64-bit shift, and the vector instructions treat
   inf and NaN as their scalar forms do. */
static inline __m512i half_value_exponent8(__m512d v) {
    __m512i e = _mm512_sub_epi64(
        _mm512_and_si512(_mm512_srli_epi64(_mm512_castpd_si512(v), 52), _mm512_set1_epi64(0x7ff)),
        _mm512_set1_epi64(1023));
    e = _mm512_max_epi64(e, _mm512_set1_epi64(-14));
    __mmask8 zero = _mm512_cmp_pd_mask(v, _mm512_setzero_pd(), _CMP_EQ_OQ);
    return _mm512_mask_mov_epi64(e, zero, _mm512_set1_epi64(MPTEX_NO_TERM));
}
static inline __m512d power_of_two8(__m512i e) {
    return _mm512_castsi512_pd(_mm512_slli_epi64(_mm512_add_epi64(e, _mm512_set1_epi64(1023)), 52));
}
static inline __m512d tc_step_half8(__m512d acc, const __m512d *p, const __m512i *pe, int64_t n) {
    __m512i top = half_value_exponent8(acc);
    for (int64_t q = 0; q < n; ++q) {
        __mmask8 nonzero = _mm512_cmp_pd_mask(p[q], _mm512_setzero_pd(), _CMP_NEQ_UQ);
        top = _mm512_mask_max_epi64(top, nonzero, top, pe[q]);
    }
    __mmask8 none = _mm512_cmpeq_epi64_mask(top, _mm512_set1_epi64(MPTEX_NO_TERM));
    top = _mm512_mask_mov_epi64(top, none, _mm512_setzero_si512()); /* any exponent: unused */
    __m512d scale = power_of_two8(_mm512_sub_epi64(_mm512_set1_epi64(MPTEX_TC_BITS), top));
    __m512d sum = _mm512_roundscale_pd(_mm512_mul_pd(acc, scale),
                                       _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    for (int64_t q = 0; q < n; ++q)
        sum = _mm512_add_pd(sum, _mm512_roundscale_pd(_mm512_mul_pd(p[q], scale),
                                                      _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC));
    __m512i back = _mm512_sub_epi64(top, _mm512_set1_epi64(MPTEX_TC_BITS));
    __m512d out = round_acc8(_mm512_mul_pd(sum, power_of_two8(back)), 1);
    out = _mm512_mask_mov_pd(out, none, _mm512_setzero_pd());
    return out;
}
#endif

/* half_matmul with half accumulators: tc_step_half per k-block. a's rows and b are converted
   once to float64 with their exponents; with AVX-512, 8 output columns take each step together
   (tc_step_half8), the rest one by one. */
static int tc_half_matmul(const half_bits *a, const half_bits *b, half_bits *out, int64_t n,
                          int64_t k, int64_t m, int64_t k_block) {
    double *b64 = malloc((size_t)(k * m + k) * sizeof(double));
    int64_t *b_e = malloc((size_t)(k * m + k) * sizeof(int64_t));
    if (!b64 || !b_e) {
        free(b64);
        free(b_e);
        return 1;
    }
    double *a_row = b64 + k * m, p[64];
    int64_t *a_e = b_e + k * m, pe[64];
    halves_with_exponents(b, b64, b_e, k * m); /* [k, m]: a column's entries m apart */
    for (int64_t row = 0; row < n; ++row) {
        halves_with_exponents(a + row * k, a_row, a_e, k);
        int64_t col = 0;
#ifdef MPTEX_AVX512
        for (; col + 8 <= m; col += 8) {
            __m512d acc = _mm512_setzero_pd(), pv[64];
            __m512i pev[64];
            for (int64_t k0 = 0; k0 < k; k0 += k_block) {
                int64_t count = (k0 + k_block < k ? k0 + k_block : k) - k0;
                for (int64_t q = 0; q < count; ++q) {
                    int64_t kk = k0 + q;
                    pv[q] = _mm512_mul_pd(_mm512_set1_pd(a_row[kk]),
                                          _mm512_loadu_pd(b64 + kk * m + col));
                    __m512i b_exp = _mm512_loadu_si512((const void *)(b_e + kk * m + col));
                    pev[q] = _mm512_add_epi64(_mm512_set1_epi64(a_e[kk]), b_exp);
                }
                acc = tc_step_half8(acc, pv, pev, count);
            }
            /* the accumulator holds half values: converting them is exact */
            _mm_storeu_si128((__m128i *)(out + row * m + col),
                             _mm256_cvtps_ph(_mm512_cvtpd_ps(acc),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
#endif
        for (; col < m; ++col) {
            double acc = 0.0;
            for (int64_t k0 = 0; k0 < k; k0 += k_block) {
                int64_t count = (k0 + k_block < k ? k0 + k_block : k) - k0;
                for (int64_t q = 0; q < count; ++q) {
                    p[q] = a_row[k0 + q] * b64[(k0 + q) * m + col];
                    pe[q] = a_e[k0 + q] + b_e[(k0 + q) * m + col];
                }
                acc = tc_step_half(acc, p, pe, count);
            }
            out[row * m + col] = double_to_half(acc);
        }
    }
    free(b64);
    free(b_e);
    return 0;
}

/* One slice of the weight gradient with half accumulators: tc_step_half per block of rows. Each
   block's rows are converted once to float64 with their exponents; with AVX-512, 8 inputs of an
   output take each step together (tc_step_half8), the rest one by one. */
static int tc_weight_grad_slice(const half_bits *g, const half_bits *a, double *acc, int64_t lo,
                                int64_t hi, int64_t o, int64_t i, int64_t k_block,
                                int64_t *counts) {
    double *g64 = malloc((size_t)(k_block * (o + i)) * sizeof(double));
    int64_t *g_e = malloc((size_t)(k_block * (o + i)) * sizeof(int64_t));
    if (!g64 || !g_e) {
        free(g64);
        free(g_e);
        return 1;
    }
    double *a64 = g64 + k_block * o, p[64];
    int64_t *a_e = g_e + k_block * o, pe[64];
    for (int64_t r0 = lo; r0 < hi; r0 += k_block) {
        int64_t rows = (r0 + k_block < hi ? r0 + k_block : hi) - r0;
        halves_with_exponents(g + r0 * o, g64, g_e, rows * o); /* [rows, o] */
        halves_with_exponents(a + r0 * i, a64, a_e, rows * i); /* [rows, i] */
        for (int64_t out = 0; out < o; ++out) {
            int64_t in = 0;
#ifdef MPTEX_AVX512
            for (; in + 8 <= i; in += 8) {
                __m512d pv[64];
                __m512i pev[64];
                __mmask8 any = 0;
                for (int64_t r = 0; r < rows; ++r) {
                    pv[r] = _mm512_mul_pd(_mm512_set1_pd(g64[r * o + out]),
                                          _mm512_loadu_pd(a64 + r * i + in));
                    __m512i a_exp = _mm512_loadu_si512((const void *)(a_e + r * i + in));
                    pev[r] = _mm512_add_epi64(_mm512_set1_epi64(g_e[r * o + out]), a_exp);
                    any |= _mm512_cmp_pd_mask(pv[r], _mm512_setzero_pd(), _CMP_NEQ_UQ);
                }
                __m512d old = _mm512_loadu_pd(acc + out * i + in);
                __m512d new_ = tc_step_half8(old, pv, pev, rows);
                if (counts) {
                    __mmask8 same = _mm512_cmp_pd_mask(new_, old, _CMP_EQ_OQ);
                    counts[0] += __builtin_popcount((unsigned)any);
                    counts[1] += __builtin_popcount((unsigned)(any & same));
                }
                _mm512_storeu_pd(acc + out * i + in, new_);
            }
#endif
            for (; in < i; ++in) {
                int any = 0;
                for (int64_t r = 0; r < rows; ++r) {
                    p[r] = g64[r * o + out] * a64[r * i + in];
                    pe[r] = g_e[r * o + out] + a_e[r * i + in];
                    any |= p[r] != 0.0;
                }
                double old = acc[out * i + in], new_ = tc_step_half(old, p, pe, rows);
                if (counts && any) {
                    counts[0] += 1;
                    counts[1] += new_ == old;
                }
                acc[out * i + in] = new_;
            }
        }
    }
    free(g64);
    free(g_e);
    return 0;
}

/* out [n, m] (half) = a [n, k] @ b [k, m] (half) in k-blocks of k_block: each block's
   products summed in k order from +0.0, added to the accumulator, rounded (round_acc); the
   accumulator stored as half at the end. scratch: k * m + m doubles. */
int mptex_half_matmul(const half_bits *a, const half_bits *b, half_bits *out, double *scratch,
                      int64_t n, int64_t k, int64_t m, int64_t k_block, int half) {
    if (half) return k_block > 64 ? 1 : tc_half_matmul(a, b, out, n, k, m, k_block);
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
                for (int q = 0; q < 4; ++q)
                    acc[q] = round_acc8(_mm512_add_pd(acc[q], sum[q]), half);
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
    if (half) return tc_weight_grad_slice(g, a, acc, lo, hi, o, i, k_block, counts);
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

/* ------------------------------------------------------------------------------------------
   The torch hash grid (mptex._grid_torch), in its order of operations: position
   fmaf(scale, x, 0.5), cell floor, fraction, tcnn's corner order (dimension 0 fastest), weights
   ((w_0 * w_1) * w_2) ..., rows (XOR of the primes' products masked by the table size, or the
   dense index mod the size, in uint32 arithmetic); the forward takes tcnn's one fused
   multiply-add per corner from zero (fmaf, or half mode's __hfma2 as half_fma), the backward
   the eager op's arithmetic of weight x gradient: two features move as one complex64 value
   times the weight as complex64 (w, 0), so re = g0 * w - g1 * 0 and im = g0 * 0 + g1 * w
   (signs of zeros included). As the eager op, a level's rows and weights are computed for a
   block of points first (loops the compiler vectorizes), then gathered or scattered in one
   tight loop per corner. */

#define MPTEX_MAX_DIMS 4
#define MPTEX_MAX_CORNERS 16
#define MPTEX_MAX_FEATURES 64
static const uint32_t MPTEX_PRIMES[MPTEX_MAX_DIMS] = {1u, 2654435761u, 805459861u, 3674653429u};

typedef struct {
    int64_t n_dims, n_levels, n_features, interpolation; /* 0 Linear, 1 Smoothstep, 2 Nearest */
    const float *scales;         /* [L] */
    const uint8_t *hashed;       /* [L] */
    const uint32_t *sizes;       /* [L] */
    const int64_t *offsets;      /* [L] */
    const uint32_t *resolutions; /* [L] */
} mptex_grid;

static inline float half_round(float v) { return half_to_float(float_to_half(v)); }

/* v[e] = half_round(v[e] + add[e]) (add may be NULL: v[e] = half_round(v[e])), vectorized by
   hand: compilers vectorize no _Float16 conversion without AVX-512 FP16. */
static void round_half_array(float *restrict v, const float *restrict add, int64_t n) {
    int64_t e = 0;
#ifdef MPTEX_AVX512
    for (; e + 16 <= n; e += 16) {
        __m512 x = _mm512_loadu_ps(v + e);
        if (add) x = _mm512_add_ps(x, _mm512_loadu_ps(add + e));
        x = _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        _mm512_storeu_ps(v + e, x);
    }
#endif
    for (; e < n; ++e) v[e] = half_round(add ? v[e] + add[e] : v[e]);
}

/* Per block of points, one level: axis weights and derivatives [D][n] (grid_axes), and one
   corner's rows and weights [n] (grid_corner). */
typedef struct {
    float *w0, *w1, *derivative; /* [D * n] each */
    uint32_t *cells;             /* [D * n] */
} mptex_axes;

static int64_t grid_corners(const mptex_grid *grid) {
    return grid->interpolation == 2 ? 1 : (int64_t)1 << grid->n_dims;
}

/* xs: the points' coordinates, dimension-major [D][stride], from the block's first point. */
static void grid_axes(const mptex_grid *grid, int64_t level, const float *xs, int64_t stride,
                      int64_t n, const mptex_axes *a) {
    float scale = grid->scales[level];
    for (int64_t d = 0; d < grid->n_dims; ++d) {
        const float *restrict x = xs + d * stride;
        float *restrict w0 = a->w0 + d * n, *restrict w1 = a->w1 + d * n;
        float *restrict dv = a->derivative + d * n;
        uint32_t *restrict cell = a->cells + d * n;
        int64_t q = 0;
#ifdef MPTEX_AVX512
        /* compilers vectorize no fmaf: by hand, one rounding as fmaf's; the cell as the low 32
           bits of an int64 where |floor| < 2^31 (else the lanes go through the scalar loop) */
        const __m512 vscale = _mm512_set1_ps(scale), half = _mm512_set1_ps(0.5f);
        const __m512 limit = _mm512_set1_ps(2147483648.0f);
        for (; q + 16 <= n; q += 16) {
            __m512 pos = _mm512_fmadd_ps(vscale, _mm512_loadu_ps(x + q), half);
            __m512 low = _mm512_roundscale_ps(pos, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
            if (_mm512_cmp_ps_mask(_mm512_abs_ps(low), limit, _CMP_LT_OQ) != 0xFFFF) break;
            _mm512_storeu_ps(w1 + q, _mm512_sub_ps(pos, low));
            _mm512_storeu_si512((void *)(cell + q), _mm512_cvttps_epi32(low));
        }
#endif
        for (; q < n; ++q) {
            float pos = fmaf(scale, x[q], 0.5f);
            float low = floorf(pos);
            w1[q] = pos - low; /* the fraction, for now */
            cell[q] = (uint32_t)(int64_t)low;
        }
        if (grid->interpolation == 1) {
            for (int64_t q = 0; q < n; ++q) {
                float frac = w1[q];
                w1[q] = (frac * frac) * (3.0f - 2.0f * frac);
                dv[q] = (6.0f * frac) * (1.0f - frac);
            }
        } else {
            for (int64_t q = 0; q < n; ++q) dv[q] = 1.0f;
        }
        for (int64_t q = 0; q < n; ++q) w0[q] = 1.0f - w1[q];
    }
}

/* Rows and weights [n] of corner c of the points [from, from + n) of axes laid out for
   `stride` points. index: scratch of n uint32. */
static void grid_corner(const mptex_grid *grid, int64_t level, const mptex_axes *a,
                        int64_t stride, int64_t from, int64_t n, int64_t c,
                        uint32_t *restrict index, int64_t *restrict rows,
                        float *restrict weights) {
    int64_t dims = grid->n_dims;
    uint32_t size = grid->sizes[level], mask = size - 1u, stride_d = 1;
    int64_t offset = grid->offsets[level];
    /* one loop per dimension, each one the compiler vectorizes */
    for (int64_t d = 0; d < dims; ++d) {
        const uint32_t *restrict cell = a->cells + d * stride + from;
        uint32_t bit = (uint32_t)(c >> d) & 1u;
        if (grid->hashed[level]) {
            uint32_t prime = MPTEX_PRIMES[d];
            if (d == 0)
                for (int64_t q = 0; q < n; ++q) index[q] = (cell[q] + bit) * prime;
            else
                for (int64_t q = 0; q < n; ++q) index[q] ^= (cell[q] + bit) * prime;
        } else {
            if (d == 0)
                for (int64_t q = 0; q < n; ++q) index[q] = (cell[q] + bit) * stride_d;
            else
                for (int64_t q = 0; q < n; ++q) index[q] += (cell[q] + bit) * stride_d;
            stride_d *= grid->resolutions[level];
        }
    }
    if (grid->hashed[level])
        for (int64_t q = 0; q < n; ++q) rows[q] = offset + (int64_t)(index[q] & mask);
    else { /* index % size: one subtraction inside the unit cube (index < 2 size), else % */
        uint32_t beyond = 0;
        for (int64_t q = 0; q < n; ++q) {
            uint32_t v = index[q] >= size ? index[q] - size : index[q];
            beyond |= v >= size;
            rows[q] = offset + (int64_t)v;
        }
        if (beyond)
            for (int64_t q = 0; q < n; ++q) rows[q] = offset + (int64_t)(index[q] % size);
    }
    if (grid->interpolation == 2) {
        for (int64_t q = 0; q < n; ++q) weights[q] = 1.0f;
        return;
    }
    const float *restrict first = ((c & 1) ? a->w1 : a->w0) + from;
    for (int64_t q = 0; q < n; ++q) weights[q] = first[q];
    for (int64_t d = 1; d < dims; ++d) {
        const float *restrict part = (((c >> d) & 1) ? a->w1 : a->w0) + d * stride + from;
        for (int64_t q = 0; q < n; ++q) weights[q] = weights[q] * part[q];
    }
}

/* term = value * weight as the eager op computes it (see above). */
static inline void weighted(const float *value, float weight, int64_t n_features, float *term) {
    if (n_features % 2 == 0) {
        for (int64_t f = 0; f < n_features; f += 2) {
            term[f] = value[f] * weight - value[f + 1] * 0.0f;
            term[f + 1] = value[f] * 0.0f + value[f + 1] * weight;
        }
    } else {
        for (int64_t f = 0; f < n_features; ++f) term[f] = value[f] * weight;
    }
}

/* Scratch of a pass over blocks of `block` points and sub-blocks of `sub` points: axes
   [4 D block] floats, then per sub-block index, rows, weights and features. */
typedef struct {
    mptex_axes axes;
    uint32_t *index;
    int64_t *rows;
    float *weights, *values, *acc;
} mptex_scratch;

#define MPTEX_SUB_BLOCK 2048

static int64_t scratch_layout(const mptex_grid *grid, int64_t block, void *base,
                              mptex_scratch *s) {
    int64_t dims = grid->n_dims, features = grid->n_features, sub = MPTEX_SUB_BLOCK;
    char *p = (char *)base;
    int64_t *rows = (int64_t *)p;
    p += sub * 8 * MPTEX_MAX_CORNERS;
    float *f = (float *)p;
    if (s) {
        s->rows = rows;
        s->axes.w0 = f;
        s->axes.w1 = f + dims * block;
        s->axes.derivative = f + 2 * dims * block;
        s->axes.cells = (uint32_t *)(f + 3 * dims * block);
        s->index = s->axes.cells + dims * block;
        s->weights = (float *)(s->index + sub);
        s->values = s->weights + sub * MPTEX_MAX_CORNERS;
        s->acc = s->values + sub * features;
    }
    return sub * 8 * MPTEX_MAX_CORNERS +
           4 * (4 * dims * block + sub + sub * MPTEX_MAX_CORNERS + 2 * sub * features);
}

int64_t mptex_grid_scratch_bytes(const mptex_grid *grid, int64_t block) {
    return scratch_layout(grid, block, NULL, NULL);
}

/* values [n * F] = the table rows of one corner: a loop with nothing but the loads, so that
   many of them are in flight at once (the tables are larger than the caches). */
__attribute__((optimize("no-tree-vectorize"))) /* scalar loads: AVX-512 gathers are slower */
static void gather_rows(const float *params, const int64_t *rows, int64_t n, int64_t features,
                        float *restrict values) {
    if (features == 2) {
        const uint64_t *table = (const uint64_t *)params;
        uint64_t *out = (uint64_t *)values;
        for (int64_t q = 0; q < n; ++q) out[q] = table[rows[q]];
        return;
    }
    for (int64_t q = 0; q < n; ++q)
        for (int64_t f = 0; f < features; ++f)
            values[q * features + f] = params[rows[q] * features + f];
}

/* grad_params[row] += term, point by point in order (pairs of features): a loop of nothing
   but the scattered adds (the products come before it), so that many are in flight at once. */
__attribute__((optimize("no-tree-vectorize")))
static void scatter_pairs(float *grad_params, const int64_t *rows, const float *terms, int64_t n) {
    for (int64_t q = 0; q < n; ++q) {
        float *target = grad_params + rows[q] * 2;
#ifdef __SSE2__ /* both features in one 8-byte load and store: two float adds, as apart */
        __m128 sum = _mm_add_ps(_mm_castpd_ps(_mm_load_sd((const double *)target)),
                                _mm_castpd_ps(_mm_load_sd((const double *)(terms + 2 * q))));
        _mm_store_sd((double *)target, _mm_castps_pd(sum));
#else
        target[0] += terms[2 * q];
        target[1] += terms[2 * q + 1];
#endif
    }
}

/* tcnn's half step result = __hfma2(half(weight), value, result) of half values held in float:
   the product is exact in float (11 + 11 bits), the float sum is made round-to-odd with its
   exact error (TwoSum), and the one rounding to half is then the correct rounding of
   w * v + acc. Needs -ffp-contract=off (the TwoSum must round each step). */
static inline float half_fma(float w, float v, float acc) {
    float p = w * v, s = p + acc, b = s - p;
    float err = (p - (s - b)) + (acc - b);
    uint32_t bits;
    memcpy(&bits, &s, 4);
    if (err != 0.0f && !(bits & 1u)) s = nextafterf(s, err > 0.0f ? INFINITY : -INFINITY);
    return s;
}

/* The forward's sum over corners for two features, tcnn's one fused multiply-add per corner
   from a zero result: acc = fmaf(w, value, acc) (float32), or half mode's __hfma2 with the
   weight rounded to half and table values already rounded to half (half_fma, then one
   rounding to half). */
#ifdef MPTEX_AVX512
/* half_fma on 16 lanes: the same TwoSum, and the step to odd as nextafterf takes it for a
   finite non-zero sum (one ulp away from zero when the error has the sum's sign, else towards
   it); a lane whose sum is 0 or not finite, or whose error is NaN, is recomputed by half_fma. */
static inline __m512 half_fma16(__m512 w, __m512 v, __m512 acc) {
    __m512 p = _mm512_mul_ps(w, v), s = _mm512_add_ps(p, acc), b = _mm512_sub_ps(s, p);
    __m512 err = _mm512_add_ps(_mm512_sub_ps(p, _mm512_sub_ps(s, b)), _mm512_sub_ps(acc, b));
    __m512i bits = _mm512_castps_si512(s);
    __mmask16 even = _mm512_testn_epi32_mask(bits, _mm512_set1_epi32(1));
    __mmask16 need = _mm512_cmp_ps_mask(err, _mm512_setzero_ps(), _CMP_NEQ_UQ) & even;
    if (!need) return s;
    __m512 magnitude = _mm512_castsi512_ps(
        _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)));
    __mmask16 odd_case = _mm512_cmp_ps_mask(magnitude, _mm512_set1_ps(INFINITY), _CMP_NLT_UQ) |
                         _mm512_cmp_ps_mask(s, _mm512_setzero_ps(), _CMP_EQ_OQ) |
                         _mm512_cmp_ps_mask(err, err, _CMP_UNORD_Q);
    __mmask16 up = _mm512_cmp_ps_mask(err, _mm512_setzero_ps(), _CMP_GT_OQ);
    __mmask16 negative = _mm512_cmp_ps_mask(s, _mm512_setzero_ps(), _CMP_LT_OQ);
    __mmask16 away = (__mmask16)(up ^ negative); /* the magnitude grows */
    __m512i step = _mm512_mask_blend_epi32(away, _mm512_set1_epi32(-1), _mm512_set1_epi32(1));
    bits = _mm512_mask_add_epi32(bits, need, bits, step);
    __m512 out = _mm512_castsi512_ps(bits);
    __mmask16 redo = need & odd_case;
    if (redo) {
        float ws[16], vs[16], as[16], os[16];
        _mm512_storeu_ps(ws, w);
        _mm512_storeu_ps(vs, v);
        _mm512_storeu_ps(as, acc);
        _mm512_storeu_ps(os, out);
        for (int lane = 0; lane < 16; ++lane)
            if ((redo >> lane) & 1) os[lane] = half_fma(ws[lane], vs[lane], as[lane]);
        out = _mm512_loadu_ps(os);
    }
    return out;
}
#endif

static void accumulate_pairs(float *restrict values, const float *restrict weights, int64_t n,
                             int first, int half, float *restrict acc) {
    if (first)
        for (int64_t e = 0; e < 2 * n; ++e) acc[e] = 0.0f;
    if (half) {
        round_half_array(values, NULL, 2 * n);
        int64_t q = 0;
#ifdef MPTEX_AVX512
        /* 8 points (16 features) at a time: each weight, rounded to half, for its two features */
        const __m512i pairs = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
        for (; q + 8 <= n; q += 8) {
            __m256 w8 = _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps(weights + q),
                                                        _MM_FROUND_TO_NEAREST_INT |
                                                            _MM_FROUND_NO_EXC));
            __m512 w = _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(w8));
            __m512 v = _mm512_loadu_ps(values + 2 * q);
            _mm512_storeu_ps(values + 2 * q, half_fma16(w, v, _mm512_loadu_ps(acc + 2 * q)));
        }
#endif
        for (; q < n; ++q) {
            float w = half_round(weights[q]);
            values[2 * q] = half_fma(w, values[2 * q], acc[2 * q]);
            values[2 * q + 1] = half_fma(w, values[2 * q + 1], acc[2 * q + 1]);
        }
        for (int64_t e = 0; e < 2 * n; ++e) acc[e] = values[e];
        round_half_array(acc, NULL, 2 * n);
    } else {
        for (int64_t q = 0; q < n; ++q) {
            float w = weights[q];
            acc[2 * q] = fmaf(w, values[2 * q], acc[2 * q]);
            acc[2 * q + 1] = fmaf(w, values[2 * q + 1], acc[2 * q + 1]);
        }
    }
}

/* out [n, L * F]: float32, or half bits (half: table values and weights rounded to half, one
   half fma per corner in corner order). xs [D][n]; scratch:
   mptex_grid_scratch_bytes(MPTEX_SUB_BLOCK). A point's result does not depend on the blocks. */
int mptex_grid_forward(const mptex_grid *grid, const float *xs, int64_t n, const float *params,
                       int half, void *out, void *scratch) {
    int64_t levels = grid->n_levels, features = grid->n_features, corners = grid_corners(grid);
    int64_t block = MPTEX_SUB_BLOCK;
    if (grid->n_dims > MPTEX_MAX_DIMS || features > MPTEX_MAX_FEATURES) return 1;
    mptex_scratch s;
    scratch_layout(grid, block, scratch, &s);
    for (int64_t start = 0; start < n; start += block) {
        int64_t count = start + block < n ? block : n - start;
        for (int64_t level = 0; level < levels; ++level) {
            grid_axes(grid, level, xs + start, n, count, &s.axes);
            for (int64_t c = 0; c < corners; ++c) {
                /* axes laid out for `block` points, so stride block */
                grid_corner(grid, level, &s.axes, count, 0, count, c, s.index, s.rows, s.weights);
                gather_rows(params, s.rows, count, features, s.values);
                if (features == 2 && corners > 1) {
                    accumulate_pairs(s.values, s.weights, count, c == 0, half, s.acc);
                    continue;
                }
                for (int64_t q = 0; q < count; ++q) {
                    const float *v = s.values + q * features;
                    float *a = s.acc + q * features;
                    if (corners == 1) { /* Nearest: the value itself (tcnn: no fma) */
                        for (int64_t f = 0; f < features; ++f)
                            a[f] = half ? half_round(v[f]) : v[f];
                        continue;
                    }
                    float w = half ? half_round(s.weights[q]) : s.weights[q];
                    for (int64_t f = 0; f < features; ++f) {
                        float acc = c == 0 ? 0.0f : a[f];
                        a[f] = half ? half_round(half_fma(w, half_round(v[f]), acc))
                                    : fmaf(w, v[f], acc);
                    }
                }
            }
            for (int64_t q = 0; q < count; ++q) {
                int64_t base = (start + q) * levels * features + level * features;
                for (int64_t f = 0; f < features; ++f) {
                    if (half)
                        ((half_bits *)out)[base + f] = float_to_half(s.acc[q * features + f]);
                    else
                        ((float *)out)[base + f] = s.acc[q * features + f];
                }
            }
        }
    }
    return 0;
}

/* Backward from grad [L, n, F] float32, level-major (a level's gradients read once from the
   cache for all its corners; half mode: already rounded to half and times the loss scale, as
   the eager op does). grad_params [E * F] (zeroed by the caller) receives the
   weighted gradients in the eager op's scatter order: chunk by chunk of `chunk` points, level
   by level, corner by corner, point by point. grad_x [n, D] (if not NULL): dL/dx in the eager
   op's order (features, corners, then levels, each summed first term first). xs [D][n];
   scratch: mptex_grid_scratch_bytes(min(chunk, n)). */
int mptex_grid_backward(const mptex_grid *grid, const float *xs, int64_t n, const float *params,
                        int half, const float *grad, int64_t chunk, float *grad_params,
                        float *grad_x, void *scratch) {
    int64_t dims = grid->n_dims, levels = grid->n_levels, features = grid->n_features;
    int64_t corners = grid_corners(grid), sub = MPTEX_SUB_BLOCK;
    if (dims > MPTEX_MAX_DIMS || features > MPTEX_MAX_FEATURES) return 1;
    int64_t capacity = chunk < n ? chunk : n;
    mptex_scratch s;
    scratch_layout(grid, capacity, scratch, &s);
    for (int64_t start = 0; start < n; start += chunk) {
        int64_t count = start + chunk < n ? chunk : n - start;
        for (int64_t level = 0; level < levels; ++level) {
            grid_axes(grid, level, xs + start, n, count, &s.axes);
            for (int64_t c = 0; c < corners; ++c) {
                for (int64_t from = 0; from < count; from += sub) {
                    int64_t m = from + sub < count ? sub : count - from;
                    grid_corner(grid, level, &s.axes, count, from, m, c, s.index, s.rows,
                                s.weights);
                    const float *g = grad + (level * n + start + from) * features;
                    /* in order, point by point: a row hit twice adds as scatter_add_ does */
                    if (features == 2) {
                        float *restrict terms = s.values;
                        const float *restrict w = s.weights;
                        for (int64_t q = 0; q < m; ++q) {
                            float g0 = g[2 * q], g1 = g[2 * q + 1];
                            terms[2 * q] = g0 * w[q] - g1 * 0.0f;
                            terms[2 * q + 1] = g0 * 0.0f + g1 * w[q];
                        }
                        scatter_pairs(grad_params, s.rows, terms, m);
                    } else {
                        for (int64_t q = 0; q < m; ++q)
                            weighted(g + q * features, s.weights[q], features,
                                     s.values + q * features);
                        for (int64_t q = 0; q < m; ++q)
                            for (int64_t f = 0; f < features; ++f)
                                grad_params[s.rows[q] * features + f] +=
                                    s.values[q * features + f];
                    }
                }
            }
            if (grad_x == NULL) continue;
            /* dL/dx, sub-block by sub-block: every corner's rows and weights of each point */
            for (int64_t from = 0; from < count; from += sub) {
                int64_t m = from + sub < count ? sub : count - from;
                for (int64_t c = 0; c < corners; ++c)
                    grid_corner(grid, level, &s.axes, count, from, m, c, s.index,
                                s.rows + c * m, s.weights + c * m);
                for (int64_t q = 0; q < m; ++q) {
                    int64_t p = start + from + q;
                    float *gx = grad_x + p * dims;
                    if (grid->interpolation == 2) {
                        for (int64_t d = 0; d < dims; ++d) gx[d] = 0.0f;
                        continue;
                    }
                    const float *g = grad + (level * n + p) * features;
                    float corner_grad[MPTEX_MAX_CORNERS];
                    for (int64_t c = 0; c < corners; ++c) {
                        const float *row = params + s.rows[c * m + q] * features;
                        float sum = 0.0f;
                        for (int64_t f = 0; f < features; ++f) {
                            float v = half ? half_round(row[f]) : row[f];
                            sum = f == 0 ? v * g[f] : sum + v * g[f];
                        }
                        corner_grad[c] = sum;
                    }
                    for (int64_t dim = 0; dim < dims; ++dim) {
                        float d_frac = 0.0f;
                        for (int64_t c = 0; c < corners; ++c) {
                            float w = 1.0f;
                            for (int64_t d = 0; d < dims; ++d) {
                                int64_t bit = (c >> d) & 1;
                                float part = d == dim ? (bit ? 1.0f : -1.0f)
                                                      : (bit ? s.axes.w1 : s.axes.w0)
                                                            [d * count + from + q];
                                w = d == 0 ? part : w * part;
                            }
                            float t = w * corner_grad[c];
                            d_frac = c == 0 ? t : d_frac + t;
                        }
                        float d_pos = (d_frac * s.axes.derivative[dim * count + from + q]) *
                                      grid->scales[level];
                        gx[dim] = level == 0 ? d_pos : gx[dim] + d_pos;
                    }
                }
            }
        }
    }
    return 0;
}

/* tcnn's half gradient table, unscaled in half: g = half(half(g) / scale), as the eager op's
   (grad.to(float16) / scale).to(float32). */
int mptex_half_unscale(float *g, int64_t n, float scale) {
    int64_t e = 0;
#ifdef MPTEX_AVX512
    const __m512 divisor = _mm512_set1_ps(scale);
    for (; e + 16 <= n; e += 16) {
        __m512 x = _mm512_loadu_ps(g + e);
        x = _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        x = _mm512_div_ps(x, divisor);
        x = _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        _mm512_storeu_ps(g + e, x);
    }
#endif
    for (; e < n; ++e) g[e] = half_round(half_round(g[e]) / scale);
    return 0;
}

/* ------------------------------------------------------------------ FP8 quantisation */
/* mptex._fp8_fused's op: amax, scale and cast of one tensor (or of each row) in two passes.
   Float32 arithmetic as the eager ops (-ffp-contract=off), the cast rounding to nearest even as
   the eager ops' (mptex._fp8_scaling._to_fp8): E4M3 (float8_e4m3fn) saturates at 448 (infinity
   included), E5M2 overflows to infinity, a NaN becomes sign | 0x7f. Written without branches
   in the element loops, so that they vectorise. */
#define FP8_INF_BITS 0x7f800000u

static inline uint32_t f32_bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }

static inline uint8_t fp8_from_f32(float f, int e5m2) {
    const uint32_t b = f32_bits(f), sign = (b >> 24) & 0x80u, a = b & 0x7fffffffu;
    const uint32_t mbits = e5m2 ? 2u : 3u, bias = e5m2 ? 15u : 7u;
    /* At or above the format's smallest normal: the float32 significand rounded to mbits bits
       (to nearest, ties to even) in integer arithmetic, the exponent rebiased. */
    const uint32_t shift = 23u - mbits, odd = (a >> shift) & 1u;
    const uint32_t normal = ((a + (1u << (shift - 1u)) - 1u + odd) >> shift)
        - ((127u - bias) << mbits);
    /* Below it: adding 2^23 subnormal steps (2^-9 for E4M3, 2^-16 for E5M2) rounds |f| to a
       whole number of steps, to nearest even, in one float32 addition (the sum's ulp is the
       step); that number is the code, up to the smallest normal's. */
    const float magic = e5m2 ? 128.0f : 16384.0f;
    const uint32_t sub = f32_bits(fabsf(f) + magic) - f32_bits(magic);
    uint32_t r = (a >> 23) >= 128u - bias ? normal : sub;
    const uint32_t top = e5m2 ? 0x7cu : 0x7eu;  /* E5M2: infinity; E4M3: 448 */
    r = r > top ? top : r;
    r = a > FP8_INF_BITS ? 0x7fu : r;
    return (uint8_t)(sign | r);
}

/* A NaN code's float32 as torch converts it: quiet, its sign and mantissa bits kept on top. */
static inline float fp8_nan_f32(uint8_t c, int mbits) {
    const uint32_t b = ((uint32_t)(c & 0x80u) << 24) | 0x7fc00000u
        | ((uint32_t)(c & ((1u << mbits) - 1u)) << (23 - mbits));
    float f;
    memcpy(&f, &b, 4);
    return f;
}

static inline float fp8_to_f32(uint8_t c, int e5m2) {
    const float sign = (c & 0x80u) ? -1.0f : 1.0f;
    if (e5m2) {
        const int e = (c >> 2) & 31, m = c & 3;
        if (e == 31) return m ? fp8_nan_f32(c, 2) : sign * INFINITY;
        return sign * (e ? ldexpf((float)(4 + m), e - 17) : ldexpf((float)m, -16));
    }
    const int e = (c >> 3) & 15, m = c & 7;
    if (e == 15 && m == 7) return fp8_nan_f32(c, 3);
    return sign * (e ? ldexpf((float)(8 + m), e - 10) : ldexpf((float)m, -9));
}

/* The largest of m and |v|, NaN once either is (torch's max-norm propagates NaN). */
static inline float fp8_max_abs(float m, float v) {
    v = fabsf(v);
    return (v > m || v != v) ? v : m;
}

/* Largest |x| over n strided values; NaN if one is NaN, 0 if n is 0. */
static float fp8_amax(const float *x, int64_t n, int64_t stride) {
    float m = 0.0f;
    if (stride == 1) {
        for (int64_t i = 0; i < n; ++i) m = fp8_max_abs(m, x[i]);
    } else {
        for (int64_t i = 0; i < n; ++i) m = fp8_max_abs(m, x[i * stride]);
    }
    return m != m ? NAN : m;  /* torch's NaN, whatever the input's payload */
}

/* q_kind: 0 the FP8 codes (uint8), 1 their values in float32, 2 in float64 (from lut, the
   256 codes' values). One loop per kind, here and in the column-major cast: each vectorises,
   where one loop storing through a branch on q_kind did not (up to 3-4 times slower). */
static void fp8_cast_row(const float *x, int64_t n, int64_t stride, float used, int e5m2,
                         const float *lut, void *q, int q_kind, int64_t q_stride) {
    if (q_kind == 0) {
        uint8_t *o = (uint8_t *)q;
        for (int64_t i = 0; i < n; ++i) o[i * q_stride] = fp8_from_f32(x[i * stride] * used, e5m2);
    } else if (q_kind == 1) {
        float *o = (float *)q;
        for (int64_t i = 0; i < n; ++i)
            o[i * q_stride] = lut[fp8_from_f32(x[i * stride] * used, e5m2)];
    } else {
        double *o = (double *)q;
        for (int64_t i = 0; i < n; ++i)
            o[i * q_stride] = (double)lut[fp8_from_f32(x[i * stride] * used, e5m2)];
    }
}

static inline float fp8_with_margin(float unscaled, int margin) {
    return margin ? unscaled / ldexpf(1.0f, margin) : unscaled;
}

/* A row's recipe scale and the scale its cast uses (the row-wise recipe). */
static inline void fp8_row_scale(float amax, float fmax, int margin, float *rscale, float *used) {
    const float unscaled = fmax / amax;
    *rscale = (unscaled > 0.0f && unscaled < INFINITY) ? fp8_with_margin(unscaled, margin) : 1.0f;
    *used = amax * *rscale > fmax ? unscaled : *rscale;
}

/* The row-wise recipe's per-tensor statistics: the largest row amax (NaN once a row's is; row
   amaxes are >= 0, inf or NaN) and the smallest used scale (>= 0, never NaN); (0, 1) for no
   rows, a zero tensor's. */
static void fp8_row_statistics(const float *amax, const float *used, int64_t rows, float *out) {
    float top = 0.0f, low = rows ? INFINITY : 1.0f;
    for (int64_t r = 0; r < rows; ++r) {
        if (amax[r] > top || amax[r] != amax[r]) top = amax[r];
        if (used[r] < low) low = used[r];
    }
    out[0] = top; out[1] = low;
}

/* recipe 0 delayed, 1 current, 2 rowwise (one scale per row). x is [rows, cols] with strides
   (per-tensor recipes: the whole tensor as one row). Outputs per row (rowwise) or one each:
   scale_inv, amax, used, next_scale (delayed: the next call's scale when recording, else the
   given one; current: used; rowwise: each row's recipe scale), and next_history (delayed and
   recording: the amax history after this call, most recent first; rowwise and recording: the
   two statistics of fp8_row_statistics). */
int mptex_fp8_quantize(const float *x, int64_t rows, int64_t cols, int64_t stride_r,
                       int64_t stride_c, int e5m2, int recipe, int margin, int most_recent,
                       int record, const float *scale, const float *history, int64_t hlen,
                       void *q, int q_kind, int64_t q_stride_r, int64_t q_stride_c,
                       float *scale_inv, float *amax_out, float *used_out, float *next_scale,
                       float *next_history) {
    const float fmax = e5m2 ? 57344.0f : 448.0f;
    const int64_t q_size = q_kind == 0 ? 1 : (q_kind == 1 ? 4 : 8);
    float lut[256];
    if (q_kind) for (int c = 0; c < 256; ++c) lut[c] = fp8_to_f32((uint8_t)c, e5m2);
    if (recipe == 2 && stride_r == 1 && stride_c != 1 && q_stride_r == 1 && rows > 1) {
        /* Column-major (a transposed operand): the same values, visited column by column so
           that the inner loops read memory in order. */
        for (int64_t r = 0; r < rows; ++r) amax_out[r] = 0.0f;
        for (int64_t c = 0; c < cols; ++c) {
            const float *xc = x + c * stride_c;
            for (int64_t r = 0; r < rows; ++r) amax_out[r] = fp8_max_abs(amax_out[r], xc[r]);
        }
        for (int64_t r = 0; r < rows; ++r) {
            if (amax_out[r] != amax_out[r]) amax_out[r] = NAN;
            fp8_row_scale(amax_out[r], fmax, margin, next_scale + r, used_out + r);
            scale_inv[r] = 1.0f / used_out[r];
        }
        for (int64_t c = 0; c < cols; ++c) {
            const float *xc = x + c * stride_c;
            char *qc = (char *)q + c * q_stride_c * q_size;
            if (q_kind == 0)
                for (int64_t r = 0; r < rows; ++r)
                    ((uint8_t *)qc)[r] = fp8_from_f32(xc[r] * used_out[r], e5m2);
            else if (q_kind == 1)
                for (int64_t r = 0; r < rows; ++r)
                    ((float *)qc)[r] = lut[fp8_from_f32(xc[r] * used_out[r], e5m2)];
            else
                for (int64_t r = 0; r < rows; ++r)
                    ((double *)qc)[r] = (double)lut[fp8_from_f32(xc[r] * used_out[r], e5m2)];
        }
        if (record) fp8_row_statistics(amax_out, used_out, rows, next_history);
        return 0;
    }
    if (recipe == 2) {
        for (int64_t r = 0; r < rows; ++r) {
            const float amax = fp8_amax(x + r * stride_r, cols, stride_c);
            float rscale, used;
            fp8_row_scale(amax, fmax, margin, &rscale, &used);
            fp8_cast_row(x + r * stride_r, cols, stride_c, used, e5m2, lut,
                         (char *)q + r * q_stride_r * q_size, q_kind, q_stride_c);
            amax_out[r] = amax; used_out[r] = used; next_scale[r] = rscale;
            scale_inv[r] = 1.0f / used;
        }
        if (record) fp8_row_statistics(amax_out, used_out, rows, next_history);
        return 0;
    }
    if (rows != 1) return 1;
    const float amax = fp8_amax(x, cols, stride_c);
    const float unscaled = fmax / amax;
    float used;
    if (recipe == 1) {
        used = unscaled < INFINITY ? fp8_with_margin(unscaled, margin) : 1.0f;
        *next_scale = used;
    } else {
        used = amax * scale[0] > fmax ? unscaled : scale[0];
        *next_scale = scale[0];
        if (record) {
            /* Finite amaxes only enter the history (a NaN or inf keeps it as it was). */
            if (amax < INFINITY) {
                if (hlen > 0) next_history[0] = amax;
                for (int64_t i = 1; i < hlen; ++i) next_history[i] = history[i - 1];
            } else {
                for (int64_t i = 0; i < hlen; ++i) next_history[i] = history[i];
            }
            const float reduced = most_recent ? next_history[0] : fp8_amax(next_history, hlen, 1);
            const float u = fmax / reduced;
            if (u < INFINITY) *next_scale = fp8_with_margin(u, margin);
        }
    }
    fp8_cast_row(x, cols, stride_c, used, e5m2, lut, q, q_kind, q_stride_c);
    *amax_out = amax; *used_out = used; *scale_inv = 1.0f / used;
    return 0;
}
"""

# -ffp-contract=off: the grid's float32 expressions round as the eager ops' (no fused
# multiply-add where they round twice); the MLP's products are exact, so its fmadd is the add.
# -fno-tree-loop-distribute-patterns: no library memcpy for a copy of two features per point.
_CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-tree-loop-distribute-patterns",
           "-shared", "-fPIC", "-std=c11")  # fmt: skip


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


def _build(compiler: str, flags: tuple[str, ...]) -> Path:
    key = "\0".join((_SOURCE, compiler, *flags, _cpu_key()))
    target = _cache_dir() / f"mptex_cpu-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        source = Path(tmp) / "mptex_cpu.c"
        source.write_text(_SOURCE)
        built = Path(tmp) / target.name
        subprocess.run(
            [compiler, *flags, str(source), "-o", str(built), "-lm"],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.replace(built, target)  # atomic: a concurrent build writes the same bytes
    return target


def build_kernels(flags: tuple[str, ...] = _CFLAGS) -> ctypes.CDLL:
    """Build (or take from the cache) and load the kernel compiled with ``flags``.

    Raises:
        OSError, subprocess.SubprocessError: no compiler, or the build failed.
    """
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc) on PATH")
    lib = ctypes.CDLL(str(_build(compiler, flags)))
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.mptex_half_matmul.argtypes = [ptr] * 4 + [i64] * 4 + [c_int]
    lib.mptex_weight_grad_slice.argtypes = [ptr] * 4 + [i64] * 5 + [c_int, ptr]
    lib.mptex_grid_scratch_bytes.argtypes = [ptr, i64]
    lib.mptex_grid_scratch_bytes.restype = i64
    lib.mptex_grid_forward.argtypes = [ptr, ptr, i64, ptr, c_int, ptr, ptr]
    lib.mptex_grid_backward.argtypes = [ptr, ptr, i64, ptr, c_int, ptr, i64, ptr, ptr, ptr]
    lib.mptex_half_unscale.argtypes = [ptr, i64, ctypes.c_float]
    lib.mptex_fp8_quantize.argtypes = ([ptr] + [i64] * 4 + [c_int] * 5 + [ptr, ptr, i64, ptr,
                                       c_int, i64, i64] + [ptr] * 5)  # fmt: skip
    return lib


@functools.cache
def native_kernels() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use; None where it cannot be (warned once)."""
    if os.environ.get("MPTEX_NATIVE", "1") == "0":
        return None  # asked for: no warning
    try:
        return build_kernels()
    except (OSError, subprocess.SubprocessError) as exc:
        detail = (getattr(exc, "stderr", b"") or b"").decode(errors="replace")[:300]
        reason = f"{type(exc).__name__}: {exc} {detail}".strip()
    warn_fallback_once(
        "the C kernel of the fused-MLP twin and the hash grid",
        f"{reason}; their eager PyTorch ops compute the same bits, several times slower",
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


# ----------------------------------------------------------------------------- the hash grid
class _Grid(ctypes.Structure):
    _fields_ = [
        ("n_dims", ctypes.c_int64),
        ("n_levels", ctypes.c_int64),
        ("n_features", ctypes.c_int64),
        ("interpolation", ctypes.c_int64),
        ("scales", ctypes.c_void_p),
        ("hashed", ctypes.c_void_p),
        ("sizes", ctypes.c_void_p),
        ("offsets", ctypes.c_void_p),
        ("resolutions", ctypes.c_void_p),
    ]


GRID_MAX_DIMS = 4  # MPTEX_MAX_DIMS
HALF_LOSS_SCALE = 128.0  # mptex._grid_torch.TCNN_HALF_LOSS_SCALE
GRID_MAX_FEATURES = 64
_INTERPOLATIONS = {"Linear": 0, "Smoothstep": 1, "Nearest": 2}


@functools.lru_cache(maxsize=64)
def _grid_struct(geometry) -> tuple[_Grid, tuple[torch.Tensor, ...]]:
    """The C view of a ``GridGeometry`` and the tensors it points into (kept alive here)."""
    tensors = (
        torch.tensor(geometry.scales, dtype=torch.float32),
        torch.tensor(geometry.hashed, dtype=torch.uint8),
        torch.tensor(geometry.table_sizes, dtype=torch.int64).to(torch.int32),
        torch.tensor(geometry.offsets[:-1], dtype=torch.int64),
        torch.tensor(geometry.resolutions, dtype=torch.int64).to(torch.int32),
    )
    grid = _Grid(geometry.n_input_dims, geometry.n_levels, geometry.n_features_per_level,
                 _INTERPOLATIONS[geometry.interpolation],
                 *(t.data_ptr() for t in tensors))  # fmt: skip
    return grid, tensors


def grid_supported(geometry) -> bool:
    """Whether the C kernel takes this geometry (else the eager ops run)."""
    return (
        geometry.n_input_dims <= GRID_MAX_DIMS
        and geometry.n_features_per_level <= GRID_MAX_FEATURES
        and geometry.interpolation in _INTERPOLATIONS
        and max(geometry.table_sizes) < 2**31
        and max(geometry.resolutions) < 2**31
    )


# Points per block of the forward (MPTEX_SUB_BLOCK; any size gives the same bits): a level's
# rows and weights of a block stay in the L2 cache between computing and gathering them.
GRID_BLOCK = 2048


# The kernels' scratch memory, one buffer per thread (the C calls release the GIL), kept
# between calls and grown when a call needs more: no allocation per call.
_SCRATCH = threading.local()


def _scratch(lib: ctypes.CDLL, grid: _Grid, points: int) -> torch.Tensor:
    """Uninitialised bytes, at least what the grid kernels need for ``points`` points (they
    lay out no more than that and read nothing they did not write)."""
    size = lib.mptex_grid_scratch_bytes(ctypes.byref(grid), max(points, 1))
    buffer = getattr(_SCRATCH, "buffer", None)
    if buffer is None or buffer.numel() < size:
        buffer = _SCRATCH.buffer = torch.empty(size, dtype=torch.uint8)
    return buffer


def _check(status: int, geometry) -> None:
    if status:  # grid_supported keeps such geometries on the eager ops
        raise RuntimeError(f"the C kernel refused the grid geometry {geometry}")


def grid_points(x: torch.Tensor) -> torch.Tensor:
    """``x [N, D]`` as the kernels read it: ``[D, N]`` contiguous, one axis after the other
    (the caller keeps it for the backward: one copy per forward and backward instead of two)."""
    return x.t().contiguous()


def grid_forward_native(
    lib: ctypes.CDLL, geometry, x: torch.Tensor, params: torch.Tensor, half: bool,
    xs: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """``hash_grid_encode``'s forward: x [N, D] and params float32 (CPU) -> [N, L * F] in
    float32, or float16 in tcnn's half mode. ``xs``: :func:`grid_points` of ``x``, when made."""
    grid, _ = _grid_struct(geometry)
    xs, params = grid_points(x) if xs is None else xs, params.contiguous()
    n_points = x.shape[0]
    out = torch.empty(n_points, geometry.n_output_dims,
                      dtype=torch.float16 if half else torch.float32)  # fmt: skip
    scratch = _scratch(lib, grid, GRID_BLOCK)  # held: C writes into it
    status = lib.mptex_grid_forward(ctypes.byref(grid), _ptr(xs), n_points, _ptr(params),
                                    int(half), _ptr(out), _ptr(scratch))  # fmt: skip
    _check(status, geometry)
    return out


def grid_backward_native(
    lib: ctypes.CDLL,
    geometry,
    x: torch.Tensor,
    params: torch.Tensor,
    half: bool,
    grad: torch.Tensor,
    chunk: int,
    want_x: bool,
    xs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dL/dparams float32 accumulated in the eager op's scatter order, dL/dx or None) from
    ``grad`` [N, L * F] float32 (half mode: already rounded to half and scaled; dL/dparams is
    returned unscaled as tcnn's half table is, dL/dx still scaled). ``xs``: the forward's
    :func:`grid_points` of ``x``."""
    grid, _ = _grid_struct(geometry)
    n_points = x.shape[0]
    xs, params = grid_points(x) if xs is None else xs, params.contiguous()
    grad = grad.reshape(n_points, geometry.n_levels, geometry.n_features_per_level)
    grad = grad.transpose(0, 1).contiguous()
    grad_params = torch.zeros_like(params)
    grad_x = torch.empty_like(x) if want_x else None
    scratch = _scratch(lib, grid, min(chunk, n_points))
    status = lib.mptex_grid_backward(ctypes.byref(grid), _ptr(xs), n_points, _ptr(params),
                                     int(half), _ptr(grad), chunk, _ptr(grad_params),
                                     _ptr(grad_x) if want_x else None, _ptr(scratch))  # fmt: skip
    _check(status, geometry)
    if half:
        lib.mptex_half_unscale(_ptr(grad_params), grad_params.numel(), HALF_LOSS_SCALE)
    return grad_params, grad_x
