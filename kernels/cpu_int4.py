"""4-bit linear for a few rows on the CPU: bf16 x [M <= 8, K] times int4 w [N, K] (groups of 32
along K, w = (q - 8) * scale + zero with bf16 scale and zero: worker/model/int4.py's weights),
bf16 out, a C kernel on AVX512 (built on first use by cpu_build.py) beside its torch reference.

Why: torch's int4 kernel (`_weight_int4pack_mm_for_cpu`) is compute bound from a few rows: on
SmolLM2-135M's linears it takes 3.2 ms at one row and 5.7 at four, so a speculative verify of
four rows pays most of its extra there. Here the rows share one decode of each weight:

    w packed once (`pack_tiles`): nibbles [N/16, K/2, 16] (byte = q[n, 2j] | q[n, 2j+1] << 4 for
    16 channels side by side) and (scale, zero) [N/16, K/32, 2, 16] bf16
    for each task of 32 channels (two tiles of 16; the last may have one):
        for each group g of 32 k:
            dq[m] = sum over the group of x[m, k] * q[n, k]        (fp32, q converted exactly)
            acc[m] += scale * (dq[m] - 8 * xs[m, g]) + zero * xs[m, g]
                                              (xs[m, g]: the group's sum of x[m], once for all n)
    out = bf16(acc)

Each row's operations and their order do not depend on M, so a verify's rows are the bits decode
steps compute (worker/model/int4.py keeps a verify of up to 7 drafts on this path). Products of a
bf16 x and a 4-bit q are exact in fp32; the sums round as fp32 sums in a fixed order. The weight
streams are prefetched ahead (as kernels/cpu_linear.py's: after a forward pass the hardware
prefetcher alone leaves bandwidth unused).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from .cpu_build import build

GROUP = 32
MAX_ROWS = 8

_SOURCE = r"""
#include <stdint.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#define PREFETCH 1024  /* bytes ahead in a tile's nibble stream */

static inline __m512 bf16_to_ps(const uint16_t *p) {  /* 16 bf16 -> fp32, exactly */
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

/* rows 0 .. M - 1 x C tiles of 16 channels: M and C constants after inlining, so the
   accumulators stay in registers. x fp32 [M, K], xs fp32 [M, G]; nib: the first tile's
   nibbles (the next tile's follow at K / 2 * 16 bytes), sz its scales and zeros (the next
   tile's at G * 32); out bf16 [M, ldo] at the task's first channel. */
static inline __attribute__((always_inline)) void tile(
        const float *x, const float *xs, const int M, const int C, const uint8_t *nib,
        const uint16_t *sz, int64_t K, uint16_t *out, int64_t ldo) {
    const int64_t G = K / 32;
    __m512 acc[8][2];
    for (int m = 0; m < M; m++)
        for (int c = 0; c < C; c++) acc[m][c] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi32(15);
    for (int64_t g = 0; g < G; g++) {
        __m512 lo_sum[8][2], hi_sum[8][2];  /* even and odd k: two chains a row and tile */
        for (int m = 0; m < M; m++)
            for (int c = 0; c < C; c++) {
                lo_sum[m][c] = _mm512_setzero_ps();
                hi_sum[m][c] = _mm512_setzero_ps();
            }
        for (int j = 0; j < 16; j++) {
            const int64_t k = g * 32 + 2 * j;
            for (int c = 0; c < C; c++) {
                const uint8_t *b = nib + c * (K / 2) * 16 + (g * 16 + j) * 16;
                if ((j & 3) == 0) _mm_prefetch((const char *)(b + PREFETCH), _MM_HINT_T0);
                __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
                __m512 qlo = _mm512_cvtepi32_ps(_mm512_and_si512(v, low));
                __m512 qhi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
                for (int m = 0; m < M; m++) {
                    lo_sum[m][c] = _mm512_fmadd_ps(qlo, _mm512_set1_ps(x[m * K + k]),
                                                   lo_sum[m][c]);
                    hi_sum[m][c] = _mm512_fmadd_ps(qhi, _mm512_set1_ps(x[m * K + k + 1]),
                                                   hi_sum[m][c]);
                }
            }
        }
        for (int c = 0; c < C; c++) {
            __m512 s = bf16_to_ps(sz + c * G * 32 + g * 32);
            __m512 z = bf16_to_ps(sz + c * G * 32 + g * 32 + 16);
            for (int m = 0; m < M; m++) {
                __m512 sx = _mm512_set1_ps(xs[m * G + g]);
                __m512 dq = _mm512_add_ps(lo_sum[m][c], hi_sum[m][c]);
                dq = _mm512_fmadd_ps(_mm512_set1_ps(-8.0f), sx, dq);
                acc[m][c] = _mm512_fmadd_ps(s, dq, acc[m][c]);
                acc[m][c] = _mm512_fmadd_ps(z, sx, acc[m][c]);
            }
        }
    }
    for (int m = 0; m < M; m++)
        for (int c = 0; c < C; c++)
            _mm256_storeu_si256((__m256i *)(out + m * ldo + c * 16),
                                (__m256i)_mm512_cvtneps_pbh(acc[m][c]));
}

int ready(void) { return 1; }

#define CASE(V, C) case V: tile(xf, xs, V, C, nib, s, K, o, N); break;

/* x bf16 [M, K] (row stride ldx, M <= 8), nibbles [N/16, K/2, 16], sz bf16 [N/16, K/32, 2, 16],
   out bf16 [M, N]; xf fp32 [M, K] and xs fp32 [M, K/32] scratch. Tasks of two tiles (the last
   may have one); up to 4 rows both tiles at once, more rows one tile at a time. */
void linear_int4(const uint16_t *x, int64_t ldx, int64_t M, const uint8_t *nibbles,
                 const uint16_t *sz, int64_t N, int64_t K, uint16_t *out, float *xf,
                 float *xs) {
    const int64_t G = K / 32, tiles = N / 16;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < G; g++) {
            float sum = 0.0f;
            for (int64_t i = 0; i < 32; i++) {
                uint32_t bits = (uint32_t)x[m * ldx + g * 32 + i] << 16;
                float v;
                __builtin_memcpy(&v, &bits, 4);
                xf[m * K + g * 32 + i] = v;
                sum += v;
            }
            xs[m * G + g] = sum;
        }
    #pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < (tiles + 1) / 2; t++) {
        const int pair = 2 * t + 1 < tiles;
        for (int c0 = 0; c0 < (M <= 4 ? 1 : 1 + pair); c0++) {
            const int64_t first = 2 * t + c0;
            const uint8_t *nib = nibbles + first * (K / 2) * 16;
            const uint16_t *s = sz + first * G * 32;
            uint16_t *o = out + first * 16;
            if (M <= 4 && pair) {
                switch (M) { CASE(1, 2) CASE(2, 2) CASE(3, 2) CASE(4, 2) }
            } else {
                switch (M) { CASE(1, 1) CASE(2, 1) CASE(3, 1) CASE(4, 1) CASE(5, 1) CASE(6, 1)
                             CASE(7, 1) CASE(8, 1) }
            }
        }
    }
}
#else
int ready(void) { return 0; }  /* no AVX512-BF16: callers keep torch's int4 kernel */
void linear_int4(void) {}
#endif
"""


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = build("cpu_int4", _SOURCE)
    if lib is None or not lib.ready():
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.linear_int4.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, ptr, ptr, ptr]
    lib.linear_int4.restype = None
    return lib


def available() -> bool:
    """Whether this CPU runs the kernel (AVX512-BF16 and a C compiler; built on first ask)."""
    return _library() is not None


def pack_tiles(q: torch.Tensor, scales_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q int [N, K] in 0..15 and bf16 (scale, zero) [K / 32, N, 2] (int4.py's) -> (nibbles
    uint8 [N / 16, K / 2, 16], sz bf16 [N / 16, K / 32, 2, 16])."""
    n, k = q.shape
    pairs = q.to(torch.uint8).view(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3)
    nibbles = (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()
    sz = scales_zeros.view(k // GROUP, n // 16, 16, 2).permute(1, 0, 3, 2).contiguous()
    return nibbles, sz


def linear_int4(x: torch.Tensor, nibbles: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """bf16 [M, N] = x [M <= MAX_ROWS, K] bf16 @ dequantized(w).T, w packed by `pack_tiles`.
    ValueError on other dtypes, shapes or strides, or when the kernel is unavailable."""
    tiles, half, _ = nibbles.shape
    n, k = tiles * 16, half * 2
    if x.dim() != 2 or x.shape[1] != k or not 1 <= x.shape[0] <= MAX_ROWS \
            or x.dtype != torch.bfloat16 or x.stride(1) != 1 or nibbles.dtype != torch.uint8 \
            or not nibbles.is_contiguous() or sz.shape != (tiles, k // GROUP, 2, 16) \
            or sz.dtype != torch.bfloat16 or not sz.is_contiguous() or not available():
        raise ValueError(f"linear_int4: needs x bf16 [1..{MAX_ROWS}, {k}] with unit column "
                         f"stride and a weight from pack_tiles, on a CPU with AVX512-BF16; got x "
                         f"{x.dtype} {tuple(x.shape)}, nibbles {tuple(nibbles.shape)}, sz "
                         f"{tuple(sz.shape)}")
    m = x.shape[0]
    out = torch.empty(m, n, dtype=torch.bfloat16)
    scratch = torch.empty(m * k + m * (k // GROUP), dtype=torch.float32)
    _library().linear_int4(x.data_ptr(), x.stride(0), m, nibbles.data_ptr(), sz.data_ptr(), n,
                           k, out.data_ptr(), scratch.data_ptr(),
                           scratch.data_ptr() + m * k * 4)
    return out


def linear_int4_torch(x: torch.Tensor, nibbles: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """The reference: the dequantized weight in float32, x @ w.T in float32, rounded to bf16."""
    tiles, half, _ = nibbles.shape
    q = torch.stack([nibbles & 15, nibbles >> 4], -1).permute(0, 2, 1, 3)  # [T, 16, K/2, 2]
    q = q.reshape(tiles * 16, half * 2).float()
    scale, zero = sz.float().permute(0, 3, 1, 2).reshape(tiles * 16, -1, 2).unbind(-1)
    w = (q.view(tiles * 16, -1, GROUP) - 8) * scale[..., None] + zero[..., None]
    return (x.float() @ w.view(tiles * 16, -1).T).to(torch.bfloat16)
