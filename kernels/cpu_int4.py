"""4-bit linear for a few rows on the CPU: bf16 x [M <= 16, K] times int4 w [N, K] (groups of 32
along K, w = (q - 8) * scale + zero with bf16 scale and zero: worker/model/int4.py's weights),
bf16 out, a C kernel on AMX-BF16 (built on first use by cpu_build.py) beside its torch reference.

Why: torch's int4 kernel (`_weight_int4pack_mm_for_cpu`) is compute bound from a few rows (each
row pays its own multiply of every weight on the vector units), so a speculative verify of four
rows cost SmolLM2-135M's linears ~1.8x a decode row and eight ~3.3x (bench/results/
cpu_int4_probe.md). AMX multiplies a tile of up to 16 rows by 16 channels x 32 k in one
instruction; what is left per weight is turning its nibble into bf16, done once for all rows:

    w packed once (`pack_tiles`): per task of 32 channels and group g of 32 k, 640 bytes: the
    two 16-channel tiles' nibbles laid out so that widening a 32-byte chunk to 16-bit lanes
    gives two rows of AMX's pair-interleaved B tile (low nibbles one row, high the next), then
    the 32 channels' bf16 scales and zeros
    for each task, for each group g:
        B = bf16(128 + q)      (bits 0x4300 | q: exact, one OR a lane)
        C = x[:, g] @ B        (AMX: fp32 sums of exact bf16 products, C zeroed per group)
        acc[m] += scale * C[m] + (zero - 136 * scale) * xs[m, g]
                               (xs[m, g]: the group's sum of x[m]; 136 = 128 + 8 undoes the
                                offset and the kernel's centre together)
    out = bf16(acc)

Each row's operations and their order do not depend on M (AMX computes every row of a tile on
its own), so a verify's rows are the bits decode steps compute (worker/model/int4.py keeps a
verify of up to 15 drafts on this path). The 128 offset costs precision only at fp32's
2**-24 of 136 * scale * sum|x| a group, far under the bf16 output's rounding.

The Linux kernel hands AMX's tile state to a process that asks (arch_prctl); `ready()` asks and
reports 0 where it is refused or the CPU lacks AMX, and callers keep torch's kernel.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from .cpu_build import build

GROUP = 32
MAX_ROWS = 16  # an AMX tile's rows
TASK_N = 32  # channels a task: two 16-channel tiles
TASK_GROUP_BYTES = 640  # per task and group: 2 x 256 bytes of nibbles, 32 scales, 32 zeros

_SOURCE = r"""
#include <stdint.h>
#include <string.h>

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define GROUP_BYTES 640
#define PREFETCH (4 * GROUP_BYTES)  /* bytes ahead in a task's stream */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

int ready(void) {  /* 1 once the kernel grants this process AMX's tile data */
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
}

static inline __m512 bf16_to_ps(const uint16_t *p) {  /* 16 bf16 -> fp32, exactly */
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

/* The 32 B rows of one group: 16 chunks of 32 bytes, each widened to 16-bit lanes, low nibbles
   one row and high ones the next, as bf16 128 + q. */
static inline __attribute__((always_inline)) void decode(const uint8_t *p, uint16_t *b) {
    const __m512i low = _mm512_set1_epi16(0x000f), bias = _mm512_set1_epi16(0x4300);
    for (int i = 0; i < 16; i++) {
        __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(p + 32 * i)));
        _mm512_store_si512(b + 64 * i, _mm512_ternarylogic_epi32(v, low, bias, 0xEA));
        _mm512_store_si512(b + 64 * i + 32, _mm512_or_si512(_mm512_srli_epi16(v, 4), bias));
    }
}

/* One task: rows 0 .. M - 1 (M constant after inlining, so the accumulators stay in registers)
   x 32 channels. Tiles: 0 = x's group (M x 32 bf16), 1 and 2 = the two B tiles, 4 and 5 = their
   products (M x 16 fp32). A software pipeline, so that no step waits on the one before it: while
   AMX multiplies group g (its B rows decoded the step before), the vector units decode group
   g + 1 and fold group g - 1's products into the accumulators. */
static inline __attribute__((always_inline)) void task(
        const uint16_t *x, int64_t ldx, const int M, const float *xs, const uint8_t *p,
        int64_t G, uint16_t *out, int64_t ldo, uint16_t *b, float *c) {
    __m512 acc[16][2];
    for (int m = 0; m < M; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    const __m512 centre = _mm512_set1_ps(136.0f);
    decode(p, b);
    for (int64_t g = 0; g <= G; g++) {
        uint16_t *bg = b + 1024 * (g & 1);
        float *cg = c + 512 * (g & 1), *cp = c + 512 * ((g + 1) & 1);
        if (g < G) {
            const uint8_t *pg = p + g * GROUP_BYTES;
            for (int line = 0; line < GROUP_BYTES; line += 64)
                _mm_prefetch((const char *)(pg + PREFETCH + line), _MM_HINT_T0);
            /* g + 1's B rows first: their stores then need not wait behind g's C */
            if (g + 1 < G) decode(pg + GROUP_BYTES, b + 1024 * ((g + 1) & 1));
            _tile_loadd(0, x + g * 32, ldx * 2);
            _tile_loadd(1, bg, 64);
            _tile_loadd(2, bg + 512, 64);
            _tile_zero(4);
            _tile_zero(5);
            _tile_dpbf16ps(4, 0, 1);
            _tile_dpbf16ps(5, 0, 2);
            _tile_stored(4, cg, 64);
            _tile_stored(5, cg + 256, 64);
        }
        if (g > 0) {  /* fold group g - 1 */
            const uint16_t *sz = (const uint16_t *)(p + (g - 1) * GROUP_BYTES + 512);
            for (int h = 0; h < 2; h++) {
                __m512 s = bf16_to_ps(sz + 16 * h), z = bf16_to_ps(sz + 32 + 16 * h);
                __m512 zc = _mm512_fnmadd_ps(centre, s, z);  /* zero - 136 * scale */
                for (int m = 0; m < M; m++) {
                    acc[m][h] = _mm512_fmadd_ps(s, _mm512_load_ps(cp + 256 * h + 16 * m),
                                                acc[m][h]);
                    acc[m][h] = _mm512_fmadd_ps(zc, _mm512_set1_ps(xs[m * G + g - 1]),
                                                acc[m][h]);
                }
            }
        }
    }
    for (int m = 0; m < M; m++)
        for (int h = 0; h < 2; h++)
            _mm256_storeu_si256((__m256i *)(out + m * ldo + 16 * h),
                                (__m256i)_mm512_cvtneps_pbh(acc[m][h]));
}

#define CASE(V) case V: task(x, ldx, V, xs, p, G, o, N, b, c); break;

/* x bf16 [M, K] (row stride ldx, 1 <= M <= 16), packed [N / 32, K / 32, 640] bytes, out bf16
   [M, N]. */
void linear_int4(const uint16_t *x, int64_t ldx, int64_t M, const uint8_t *packed, int64_t N,
                 int64_t K, uint16_t *out) {
    const int64_t G = K / 32;
    float xs[M * G];  /* the groups' sums of x: at most 16 x K / 32 floats */
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < G; g++) {  /* a fixed order: the same sums for any M */
            const uint16_t *r = x + m * ldx + g * 32;
            __m512 sum = _mm512_add_ps(bf16_to_ps(r), bf16_to_ps(r + 16));
            xs[m * G + g] = _mm512_reduce_add_ps(sum);
        }
    #pragma omp parallel
    {
        tile_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        cfg.rows[0] = cfg.rows[4] = cfg.rows[5] = (uint8_t)M;
        cfg.rows[1] = cfg.rows[2] = 16;
        for (int i = 0; i < 6; i++) cfg.colsb[i] = i == 3 ? 0 : 64;
        cfg.rows[3] = 0;
        _tile_loadconfig(&cfg);
        uint16_t b[2048] __attribute__((aligned(64)));
        float c[1024] __attribute__((aligned(64)));
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < N / 32; t++) {
            const uint8_t *p = packed + t * G * GROUP_BYTES;
            uint16_t *o = out + t * 32;
            switch (M) {
                CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
                CASE(9) CASE(10) CASE(11) CASE(12) CASE(13) CASE(14) CASE(15) CASE(16)
            }
        }
        _tile_release();
    }
}
#else
int ready(void) { return 0; }  /* no AMX-BF16: callers keep torch's int4 kernel */
void linear_int4(void) {}
#endif
"""


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = build("cpu_int4", _SOURCE)
    if lib is None or not lib.ready():
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.linear_int4.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr]
    lib.linear_int4.restype = None
    return lib


def available() -> bool:
    """Whether this CPU runs the kernel (AMX-BF16 granted, a C compiler; built on first ask)."""
    return _library() is not None


@dataclass(frozen=True)
class Int4Tiles:
    """An [n, k] int4 weight in the kernel's layout (`pack_tiles`), checked once so that a call
    checks only x."""

    packed: torch.Tensor  # uint8 [ceil(n / 32), k / 32, 640]
    n: int
    k: int

    @property
    def padded_n(self) -> int:
        return self.packed.shape[0] * TASK_N


def pack_tiles(q: torch.Tensor, scales_zeros: torch.Tensor) -> Int4Tiles:
    """q int [N, K] in 0..15 (K a multiple of 32) and bf16 (scale, zero) [K / 32, N, 2] (int4.py's)
    -> the kernel's layout: uint8 [ceil(N / 32), K / 32, 640]; padding channels have q = 0 and
    scale = zero = 0. ValueError on other shapes or dtypes, or where the kernel is unavailable."""
    n, k = q.shape
    if k % GROUP or scales_zeros.shape != (k // GROUP, n, 2) \
            or scales_zeros.dtype != torch.bfloat16 or not available():
        raise ValueError(f"pack_tiles: needs q [N, K] with K a multiple of {GROUP}, bf16 "
                         f"(scale, zero) [K / {GROUP}, N, 2] and a CPU with AMX-BF16; got q "
                         f"{tuple(q.shape)}, scales_zeros {scales_zeros.dtype} "
                         f"{tuple(scales_zeros.shape)}")
    tasks, groups = -(-n // TASK_N), k // GROUP
    padded = torch.zeros(tasks * TASK_N, k, dtype=torch.uint8)
    padded[:n] = q
    # k = 32 g + 4 c + 2 half + e; chunk c of tile h holds, at byte 2 * channel + e, q at
    # k = 4 c + e in its low nibble and at k = 4 c + 2 + e in its high one
    q7 = padded.view(tasks, 2, 16, groups, 8, 2, 2).permute(0, 3, 1, 4, 2, 6, 5)
    nibbles = (q7[..., 0] | (q7[..., 1] << 4)).reshape(tasks, groups, 512)
    sz = torch.zeros(groups, tasks * TASK_N, 2, dtype=torch.bfloat16)
    sz[:, :n] = scales_zeros
    sz = sz.view(groups, tasks, TASK_N, 2).permute(1, 0, 3, 2).contiguous()  # [T, G, 2, 32]
    packed = torch.cat([nibbles, sz.view(torch.uint8).view(tasks, groups, 128)], dim=-1)
    return Int4Tiles(packed, n, k)


def linear_int4(x: torch.Tensor, w: Int4Tiles) -> torch.Tensor:
    """bf16 [M, n] = x [M <= MAX_ROWS, k] bf16 @ dequantized(w).T. ValueError on another dtype,
    shape or column stride of x."""
    m, k = x.shape
    if k != w.k or not 1 <= m <= MAX_ROWS or x.dtype != torch.bfloat16 or x.stride(1) != 1:
        raise ValueError(f"linear_int4: needs x bf16 [1..{MAX_ROWS}, {w.k}] with unit column "
                         f"stride; got {x.dtype} {tuple(x.shape)}")
    out = torch.empty(m, w.padded_n, dtype=torch.bfloat16)
    _library().linear_int4(x.data_ptr(), x.stride(0), m, w.packed.data_ptr(), w.padded_n, k,
                           out.data_ptr())
    return out if w.n == w.padded_n else out[:, :w.n]


def linear_int4_torch(x: torch.Tensor, q: torch.Tensor, scales_zeros: torch.Tensor
                      ) -> torch.Tensor:
    """The reference: q [N, K] and (scale, zero) [K / 32, N, 2] dequantized in float32, x @ w.T
    in float32, rounded to bf16."""
    n, k = q.shape
    scale, zero = scales_zeros.float().transpose(0, 1).unbind(-1)  # [N, G] each
    w = (q.float().view(n, -1, GROUP) - 8) * scale[..., None] + zero[..., None]
    return (x.float() @ w.view(n, k).T).to(torch.bfloat16)
