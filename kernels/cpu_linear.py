"""The LM head on the CPU: bf16 hidden states x bf16 weights -> float32 logits, a C kernel on
AVX512-BF16 (built on first use by cpu_build.py) beside its torch reference.

Why: oneDNN's bf16 linear returns bf16, and bf16 logits of magnitude 16-32 are spaced 0.125
apart, so near-ties between the top tokens collapse into exact ties that greedy decoding breaks by
token id (SmolLM2's first answer token to "What is the capital of France?" was such a tie under a
one-ulp change of one layer's RMSNorm). Here each logit is a float32 sum of exact bf16 products,
the same for a row whatever else is in the batch, at oneDNN's speed or better:

    w packed once (`pack_pairs`): [N/16, K/2, 16, 2], channel n's weights for k = 2j, 2j + 1 side
    by side, so one 64-byte load feeds vdpbf16ps for 16 channels x 2 k
    for each tile of 32 channels (a task):
        for each row block (all rows up to 4, else 8 rows at a time):
            for each k pair: acc[m, c] += x[m, 2j:2j+2] . w pairs            (fp32 accumulators)
    logits = acc

Each task prefetches its two weight streams PREFETCH lines ahead: called after a forward pass
(whose weights have just gone through the caches) the hardware prefetcher alone left the head
at about 60% of its bandwidth at one row and 40% at four (bench/results/lm_head_cpu.md).

The k order of every sum is fixed (pairs in order), so tilings give bitwise the same logits.
N is padded to a multiple of 32 at packing (zero rows; their logits are cut off).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from .cpu_build import build

TILE_N = 32  # N is padded to this; a task is 32 channels

_SOURCE = r"""
#include <stdint.h>
#include <string.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>

#define PREFETCH 32  /* 64-byte lines ahead in a weight stream */

/* rows 0 .. M - 1 (M <= R) x C tiles of 16 channels: R, C and M constants after inlining, so
   the M x C accumulators stay in registers */
static inline __attribute__((always_inline)) void tile(
        const uint16_t *x, int64_t ldx, const int M, const int C, const uint16_t *w, int64_t K,
        float *out, int64_t ldo) {
    __m512 acc[16][2];
    for (int m = 0; m < M; m++)
        for (int c = 0; c < C; c++) acc[m][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < K / 2; j++) {
        __m512bh wv[2];
        for (int c = 0; c < C; c++) {
            _mm_prefetch((const char *)(w + (c * K / 2 + j + PREFETCH) * 32), _MM_HINT_T0);
            wv[c] = (__m512bh)_mm512_loadu_si512(w + (c * K / 2 + j) * 32);
        }
        for (int m = 0; m < M; m++) {
            int32_t pair;
            memcpy(&pair, x + m * ldx + 2 * j, 4);
            __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            for (int c = 0; c < C; c++) acc[m][c] = _mm512_dpbf16_ps(acc[m][c], xb, wv[c]);
        }
    }
    for (int m = 0; m < M; m++)
        for (int c = 0; c < C; c++) _mm512_storeu_ps(out + m * ldo + c * 16, acc[m][c]);
}

int ready(void) { return 1; }

/* rows m0 .. of the block: a literal row count per case (R rows at most), so tile() inlines with
   constant M and C */
#define CASE(V, R, C) case V: tile(xm, ldx, V <= R ? V : 1, C, w, K, om, ldo); break;
#define CASES(R, C) switch (M - m0 < R ? M - m0 : R) { \
    CASE(1, R, C) CASE(2, R, C) CASE(3, R, C) CASE(4, R, C) CASE(5, R, C) CASE(6, R, C) \
    CASE(7, R, C) CASE(8, R, C) CASE(9, R, C) CASE(10, R, C) CASE(11, R, C) CASE(12, R, C) \
    CASE(13, R, C) CASE(14, R, C) CASE(15, R, C) CASE(16, R, C) }

/* x [M, K] bf16 (row stride ldx), w packed pairs for N channels (N % 32 == 0), out [M, N] fp32
   (row stride ldo). Tasks of 32 channels: up to 4 rows all at once, more 8 rows at a time. */
void linear_f32(const uint16_t *x, int64_t ldx, int64_t M, const uint16_t *packed, int64_t N,
                int64_t K, float *out, int64_t ldo) {
    #pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < N / 32; t++) {
        const uint16_t *w = packed + t * K * 32;
        for (int64_t m0 = 0; m0 < M; m0 += 8) {
            const uint16_t *xm = x + m0 * ldx;
            float *om = out + m0 * ldo + t * 32;
            if (M <= 4) {
                CASES(4, 2)
            } else {
                CASES(8, 2)
            }
        }
    }
}
#else
int ready(void) { return 0; }  /* no AVX512-BF16: callers keep oneDNN's bf16 linear */
void linear_f32(void) {}
#endif
"""


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = build("cpu_linear", _SOURCE)
    if lib is None or not lib.ready():
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.linear_f32.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, i64]
    lib.linear_f32.restype = None
    return lib


def available() -> bool:
    """Whether this CPU runs the kernel (AVX512-BF16 and a C compiler; built on first ask)."""
    return _library() is not None


def pack_pairs(weight: torch.Tensor) -> torch.Tensor:
    """bf16 [N, K] (K even) -> [ceil(N / 32) * 2, K / 2, 16, 2], zero rows padding N."""
    n, k = weight.shape
    padded = torch.zeros(-(-n // TILE_N) * TILE_N, k, dtype=torch.bfloat16)
    padded[:n] = weight
    return padded.view(-1, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def linear_f32(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """logits [M, n] float32 = x [M, K] bf16 @ w.T, w [n, K] packed by `pack_pairs`. ValueError on
    other dtypes, shapes or strides, or when the kernel is unavailable."""
    padded_n, k = packed.shape[0] * 16, packed.shape[1] * 2
    if x.dim() != 2 or x.shape[1] != k or x.dtype != torch.bfloat16 or x.stride(1) != 1 \
            or packed.dtype != torch.bfloat16 or not packed.is_contiguous() \
            or not padded_n - TILE_N < n <= padded_n or not available():
        raise ValueError(f"linear_f32: needs x bf16 [M, {k}] with unit column stride, packed from "
                         f"pack_pairs of a [{n}, {k}] weight, and a CPU with AVX512-BF16; got x "
                         f"{x.dtype} {tuple(x.shape)}, packed {tuple(packed.shape)}")
    out = torch.empty(x.shape[0], padded_n, dtype=torch.float32)
    _library().linear_f32(x.data_ptr(), x.stride(0), x.shape[0], packed.data_ptr(), padded_n, k,
                          out.data_ptr(), out.stride(0))
    return out[:, :n]


def linear_f32_torch(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Reference: x [M, K] @ weight [N, K].T in float64, as float32."""
    return (x.double() @ weight.double().T).float()
