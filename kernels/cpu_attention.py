"""Paged decode attention for the CPU: a C kernel (built on first use by cpu_build.py) beside its
torch reference (`paged_decode_attention_torch` in paged_attention.py).

Why C: on CPU, gathering each context's blocks and calling SDPA per group of requests spends its
time on copies and per-call overhead (a decode query is only Hq // Hkv rows per KV head), not on
arithmetic. This kernel reads the paged cache in place. A task is one request (or one KV head of
it, when there are fewer requests than twice the threads); it walks the context a block at a
time, all its KV heads per block:

    for each 16-token chunk of the request's blocks:   # block_tables[r], positions < seq_len
        s[g, t] = (q[g] . k[t]) * scale                 # the GROUP query heads of a KV head
        online softmax: m, den, acc rescaled when the running max grows
        acc[g] += p[g, t] * v[t]
    out[g] = acc[g] / den[g]                            # fp32 state, one rounding at the end

Attention mass (H2O), when asked: each chunk's scores are stored as they are computed, and at
the end turned in place into probabilities, exp(s - m - log den): mass [B, Hq, width] fp32, one
row per query head (the caller sums them). No second pass over K.

float32 and bfloat16 caches; with AVX512-BF16, bf16 runs q k and p v on vdpbf16ps (p rounded to
bf16 first, as GPU flash attention does). The shape (KV heads, GROUP, head_dim, a multiple of 16)
is compiled in, one library per model shape. Callers check `available()` and otherwise use the
torch path.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from .cpu_build import build

DTYPES = (torch.float32, torch.bfloat16)
MAX_KV_HEADS = 16  # per worker; with MAX_GROUP and MAX_HEAD_DIM these bound the per-task
MAX_GROUP = 16  # fp32 state (query and accumulator vectors) that lives on the stack
MAX_HEAD_DIM = 256
MAX_BLOCK_SIZE = 256

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

/* GROUP (query heads per KV head) and HEAD_DIM (a multiple of 16) are fixed at compile time (-D),
   so every loop over them unrolls and the per-task state lives in registers. Written with GCC
   vector extensions: 16-float vectors, lowered to whatever SIMD -march=native has. */
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));
enum { NV = HEAD_DIM / 16, CHUNK = 16 };

static inline void load_vecs(const char *src, int is_bf16, vf *dst) {
    for (int c = 0; c < NV; c++) {
        if (is_bf16) {
            vh h;
            memcpy(&h, src + c * 32, 32);
            dst[c] = (vf)(__builtin_convertvector(h, vu) << 16);
        } else {
            memcpy(&dst[c], src + c * 64, 64);
        }
    }
}

static inline void store_vecs(const vf *src, int is_bf16, char *dst) {
    for (int c = 0; c < NV; c++) {
        if (is_bf16) {  /* round to nearest even, as torch's float -> bfloat16; NaN stays NaN */
            vu u = (vu)src[c];
            vu r = (u + 0x7fff + ((u >> 16) & 1)) >> 16;
            vi nan = src[c] != src[c];
            r = (r & ~(vu)nan) | (0x7fc0u & (vu)nan);
            vh h = __builtin_convertvector(r, vh);
            memcpy(dst + c * 32, &h, 32);
        } else {
            memcpy(dst + c * 64, &src[c], 64);
        }
    }
}

/* exp(x) for x <= 0 (scores minus their running max): 2^n * p(r), r = x - n ln2 in [-ln2/2,
   ln2/2], p its degree-6 Taylor polynomial (relative error < 2e-7); x < -87 gives ~1e-38. */
static inline vf exp_nonpos(vf x) {
    x = (vf)(((vi)x & ~(vi)(x < -87.0f)) | ((vi)((vf){} - 87.0f) & (vi)(x < -87.0f)));
    const float shifter = 12582912.0f;  /* 1.5 * 2^23: adding it rounds to an integer */
    vf n = (x * 1.44269504088896341f + shifter) - shifter;
    vf r = x - n * 0.693145751953125f - n * 1.42860682030941723e-6f;
    vf p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120
           + r * (1.0f / 720))))));
    return p * (vf)((__builtin_convertvector(n, vi) + 127) << 23);
}

/* v[t] holds 16 partial sums of token t's score; returns the 16 totals, lane t = token t
   (a transpose-and-add tree: 15 pairs of shuffles instead of 16 horizontal sums). */
static inline vf reduce16(vf *v) {
    const vi lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const vi hi8 = lo8 + 8;
    const vi lo4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const vi hi4 = lo4 + 4;
    const vi lo2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const vi hi2 = lo2 + 2;
    const vi lo1 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const vi hi1 = lo1 + 1;
    vf a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], lo8)
             + __builtin_shuffle(v[2 * i], v[2 * i + 1], hi8);
    for (int i = 0; i < 4; i++)
        b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], lo4)
             + __builtin_shuffle(a[2 * i], a[2 * i + 1], hi4);
    for (int i = 0; i < 2; i++)
        c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], lo2)
             + __builtin_shuffle(b[2 * i], b[2 * i + 1], hi2);
    return __builtin_shuffle(c[0], c[1], lo1) + __builtin_shuffle(c[0], c[1], hi1);
}

static inline float hmax(vf v) {
    float m = v[0];
    for (int i = 1; i < 16; i++) m = v[i] > m ? v[i] : m;
    return m;
}

static inline float hsum(vf v) {
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}

/* q . k for tokens 0 .. n - 1 of a chunk (token t's row at kb + at[t]): part[t] = 16 partial
   sums. */
static inline void scores(const vf *qv, const char *kb, int64_t n, const int64_t *at,
                          int is_bf16, vf *part) {
    vf row[NV];
    for (int t = 0; t < CHUNK; t++) part[t] = (vf){};
    for (int64_t t = 0; t < n; t++) {
        load_vecs(kb + at[t], is_bf16, row);
        vf dot = qv[0] * row[0];
        for (int c = 1; c < NV; c++) dot += qv[c] * row[c];
        part[t] = dot;
    }
}

/* acc[g] += sum over the chunk's tokens t of p[g][t] v[t]. */
static inline void values(const vf *p, const char *vb, int64_t n, const int64_t *at,
                          int is_bf16, vf acc[GROUP][NV]) {
    vf row[NV];
    for (int64_t t = 0; t < n; t++) {
        load_vecs(vb + at[t], is_bf16, row);
        for (int g = 0; g < GROUP; g++)
            for (int c = 0; c < NV; c++) acc[g][c] += p[g][t] * row[c];
    }
}

#if defined(__AVX512BF16__) && HEAD_DIM % 32 == 0
#include <immintrin.h>
#define FAST_BF16 1
/* bf16 caches where the CPU has AVX512-BF16: q . k and p v on vdpbf16ps (each lane sums two exact
   bf16 products in fp32), so K and V are never widened to fp32. q stays unscaled (the scores are
   scaled instead); p is rounded to bf16 first, as flash attention does on GPUs. For p v, rows t
   and t + 1 are interleaved by 16-bit unpacks, which leaves each accumulator's dimensions in
   unpack order: unpermute() restores them once at the end. */
static inline void scores_bf16(const __m512i *qb, const char *kb, int64_t n, const int64_t *at,
                               vf *part) {
    for (int t = 0; t < CHUNK; t++) part[t] = (vf){};
    for (int64_t t = 0; t < n; t++) {
        __m512 dot = _mm512_setzero_ps();
        for (int c = 0; c < NV / 2; c++)
            dot = _mm512_dpbf16_ps(dot, (__m512bh)qb[c],
                                   (__m512bh)_mm512_loadu_si512(kb + at[t] + c * 64));
        part[t] = (vf)dot;
    }
}

static inline void values_bf16(const vf *p, const char *vb, int64_t n, const int64_t *at,
                               vf acc[GROUP][NV]) {
    int32_t pairs[GROUP][CHUNK / 2];  /* (p[t], p[t + 1]) as two bf16 in one 32-bit word */
    for (int g = 0; g < GROUP; g++)
        _mm256_storeu_si256((__m256i *)pairs[g], (__m256i)_mm512_cvtneps_pbh((__m512)p[g]));
    for (int64_t t = 0; t < n; t += 2) {
        __m512i lo[NV / 2], hi[NV / 2];
        for (int c = 0; c < NV / 2; c++) {
            __m512i a = _mm512_loadu_si512(vb + at[t] + c * 64);
            __m512i b = t + 1 < n ? _mm512_loadu_si512(vb + at[t + 1] + c * 64)
                                  : _mm512_setzero_si512();  /* past the context: not read */
            lo[c] = _mm512_unpacklo_epi16(a, b);
            hi[c] = _mm512_unpackhi_epi16(a, b);
        }
        for (int g = 0; g < GROUP; g++) {
            __m512bh pp = (__m512bh)_mm512_set1_epi32(pairs[g][t / 2]);
            for (int c = 0; c < NV / 2; c++) {
                acc[g][2 * c] = (vf)_mm512_dpbf16_ps((__m512)acc[g][2 * c], (__m512bh)lo[c], pp);
                acc[g][2 * c + 1] = (vf)_mm512_dpbf16_ps((__m512)acc[g][2 * c + 1],
                                                         (__m512bh)hi[c], pp);
            }
        }
    }
}

/* Per 128-bit lane L of V's 32-dim vector c, the low unpack held dims 8L .. 8L+3 and the high one
   8L+4 .. 8L+7: interleave the 4-float pieces back into dimension order. */
static inline void unpermute(vf *acc) {
    const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i second = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11,
                                            10, 9, 8);
    for (int c = 0; c < NV / 2; c++) {
        __m512 lo = (__m512)acc[2 * c], hi = (__m512)acc[2 * c + 1];
        acc[2 * c] = (vf)_mm512_permutex2var_ps(lo, first, hi);
        acc[2 * c + 1] = (vf)_mm512_permutex2var_ps(lo, second, hi);
    }
}
#else
#define FAST_BF16 0
#endif

/* One request, KV heads h0 .. h1 - 1 (each with its GROUP query heads). q and out point at the
   request's row; strides in elements: heads of q and out (sqh, soh), caches [blocks, block_size,
   Hkv, D] (cb, cs, ch). The context is walked CHUNK tokens at a time (never across a block), all
   of the task's heads per chunk, so a whole-request task reads each block front to back; the
   next block, whose address the hardware cannot guess, is prefetched as a block starts (~10%
   from DRAM). Positions from base_len on are not the table's but the flat slots extra[0 ..
   seq_len - base_len - 1] (a draft tree's row: its ancestors' and its own KV); chunks still
   follow the positions, so a row reads its keys in the order and grouping a decode of the same
   positions would, and gets its bits. */
static void attend(const char *q, const char *kc, const char *vc, const int32_t *table,
                   int64_t seq_len, int64_t base_len, const int32_t *extra, char *out,
                   int64_t h0, int64_t h1, int64_t block_size,
                   int64_t sqh, int64_t soh, int64_t cb, int64_t cs, int64_t ch, int64_t esize,
                   int is_bf16, float scale, float *mass, int64_t mass_width) {
    int fast = FAST_BF16 && is_bf16;
    vf qv[KV_HEADS][GROUP][NV], acc[KV_HEADS][GROUP][NV], part[CHUNK], s[GROUP];
    float m[KV_HEADS][GROUP], den[KV_HEADS][GROUP];
    for (int64_t h = h0; h < h1; h++)
        for (int g = 0; g < GROUP; g++) {
            const char *qrow = q + (h * GROUP + g) * sqh * esize;
            if (fast)  /* the raw bf16 pairs (NV / 2 vectors) */
                memcpy(qv[h][g], qrow, HEAD_DIM * 2);
            else
                load_vecs(qrow, is_bf16, qv[h][g]);
            for (int c = 0; c < NV; c++) {
                if (!fast) qv[h][g][c] *= scale;
                acc[h][g][c] = (vf){};
            }
            m[h][g] = -INFINITY;
            den[h][g] = 0.0f;
        }
    const vi lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    int64_t at[CHUNK];
    for (int64_t pos = 0; pos < seq_len;) {
        int64_t off = pos % block_size;
        int64_t n = block_size - off < CHUNK ? block_size - off : CHUNK;
        n = seq_len - pos < n ? seq_len - pos : n;
        if (pos + n <= base_len) {  /* each token's row: byte offset in the caches */
            int64_t first = ((int64_t)table[pos / block_size] * cb + off * cs) * esize;
            for (int64_t t = 0; t < n; t++) at[t] = first + t * cs * esize;
        } else {
            for (int64_t t = 0; t < n; t++) {
                int64_t p = pos + t, slot = p < base_len
                    ? (int64_t)table[p / block_size] * block_size + p % block_size
                    : (int64_t)extra[p - base_len];
                at[t] = (slot / block_size * cb + slot % block_size * cs) * esize;
            }
        }
        if (off == 0 && pos + block_size < base_len) {  /* prefetch the next block */
            int64_t next = table[pos / block_size + 1];
            for (int64_t t = 0; t < block_size; t++)
                for (int64_t b = 0; b < (h1 - h0) * ch * esize; b += 64) {
                    __builtin_prefetch(kc + (next * cb + t * cs + h0 * ch) * esize + b);
                    __builtin_prefetch(vc + (next * cb + t * cs + h0 * ch) * esize + b);
                }
        }
        for (int64_t h = h0; h < h1; h++) {
            const char *kb = kc + h * ch * esize, *vb = vc + h * ch * esize;
            vi keep = lane < (int32_t)n;
            for (int g = 0; g < GROUP; g++) {
#if FAST_BF16
                if (fast) {
                    scores_bf16((const __m512i *)qv[h][g], kb, n, at, part);
                    s[g] = reduce16(part) * scale;
                } else
#endif
                {
                    scores(qv[h][g], kb, n, at, is_bf16, part);
                    s[g] = reduce16(part);
                }
                s[g] = (vf)(((vi)s[g] & keep) | ((vi)((vf){} - INFINITY) & ~keep));
                if (mass)  /* the raw scores, made probabilities at the end */
                    for (int64_t t = 0; t < n; t++)
                        mass[(h * GROUP + g) * mass_width + pos + t] = s[g][t];
            }
            for (int g = 0; g < GROUP; g++) {
                float mx = hmax(s[g]);
                if (mx > m[h][g]) {  /* the running max grew: rescale what is summed so far */
                    float alpha = exp_nonpos((vf){} + (m[h][g] - mx))[0];
                    den[h][g] *= alpha;
                    for (int c = 0; c < NV; c++) acc[h][g][c] *= alpha;
                    m[h][g] = mx;
                }
                s[g] = exp_nonpos(s[g] - m[h][g]);
                den[h][g] += hsum(s[g]);
            }
#if FAST_BF16
            if (fast)
                values_bf16(s, vb, n, at, acc[h]);
            else
#endif
                values(s, vb, n, at, is_bf16, acc[h]);
        }
        pos += n;
    }
    for (int64_t h = h0; h < h1; h++)
        for (int g = 0; g < GROUP; g++) {
#if FAST_BF16
            if (fast) unpermute(acc[h][g]);
#endif
            float inv = den[h][g] > 0.0f ? 1.0f / den[h][g] : 0.0f;  /* seq_len 0: zeros */
            for (int c = 0; c < NV; c++) acc[h][g][c] *= inv;
            store_vecs(acc[h][g], is_bf16, out + (h * GROUP + g) * soh * esize);
            if (mass && seq_len > 0) {  /* p = exp(s - lse), lse = m + log(den) */
                float *row = mass + (h * GROUP + g) * mass_width;
                float lse = m[h][g] + logf(den[h][g]);
                for (int64_t pos = 0; pos < seq_len; pos += 16) {
                    int64_t n = seq_len - pos < 16 ? seq_len - pos : 16;
                    vf x = (vf){} - INFINITY;
                    memcpy(&x, row + pos, n * sizeof(float));
                    x = exp_nonpos(x - lse);
                    memcpy(row + pos, &x, n * sizeof(float));
                }
            }
        }
}

/* Tasks: whole requests when there are enough to keep the threads busy (each reads its blocks
   front to back), else one (request, KV head) each. */
/* base_lens / extra (NULL: none): row r's positions from base_lens[r] on are the slots
   extra[r * extra_stride ..]. */
void paged_decode(const void *q, const void *k_cache, const void *v_cache,
                  const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                  void *out, int64_t num_seqs, int64_t block_size, int64_t sq, int64_t sqh,
                  int64_t so, int64_t soh, int64_t cb, int64_t cs, int64_t ch, int is_bf16,
                  float scale, int64_t heads_per_task, float *mass, int64_t mass_width,
                  const int32_t *base_lens, const int32_t *extra, int64_t extra_stride) {
    int64_t esize = is_bf16 ? 2 : 4, parts = KV_HEADS / heads_per_task;
    #pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < num_seqs * parts; task++) {
        int64_t r = task / parts, h0 = task % parts * heads_per_task;
        attend((const char *)q + r * sq * esize, (const char *)k_cache, (const char *)v_cache,
               block_tables + r * table_stride, seq_lens[r],
               base_lens ? base_lens[r] : seq_lens[r], extra ? extra + r * extra_stride : 0,
               (char *)out + r * so * esize, h0,
               h0 + heads_per_task, block_size, sqh, soh, cb, cs, ch, esize, is_bf16, scale,
               mass ? mass + r * KV_HEADS * GROUP * mass_width : 0, mass_width);
    }
}
"""

@functools.cache
def _library(num_kv_heads: int, group: int, head_dim: int) -> ctypes.CDLL | None:
    """The kernel compiled for one attention shape (KV heads, query heads per KV head, head_dim);
    None when it cannot be built (cpu_build.py)."""
    lib = build("cpu_attention", _SOURCE, dict(KV_HEADS=num_kv_heads, GROUP=group,
                                                HEAD_DIM=head_dim))
    if lib is not None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.paged_decode.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, ptr, *[i64] * 9, ctypes.c_int,
                                     ctypes.c_float, i64, ptr, i64, ptr, ptr, i64]
        lib.paged_decode.restype = None
    return lib


def available(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
              block_size: int) -> bool:
    """Whether paged_decode_attention_cpu serves this dtype and shape on this machine (builds the
    kernel on first ask)."""
    group = num_heads // num_kv_heads if num_kv_heads else 0
    return (dtype in DTYPES and num_heads == group * num_kv_heads and 1 <= group <= MAX_GROUP
            and num_kv_heads <= MAX_KV_HEADS and head_dim % 16 == 0 and head_dim <= MAX_HEAD_DIM
            and 1 <= block_size <= MAX_BLOCK_SIZE
            and _library(num_kv_heads, group, head_dim) is not None)


def paged_decode_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor,
                               scale: float | None = None, *,
                               out: torch.Tensor | None = None,
                               mass: torch.Tensor | None = None,
                               tree: tuple[torch.Tensor, torch.Tensor] | None = None
                               ) -> torch.Tensor:
    """out [B, Hq, D]: request b's query q[b] attends to its cached positions 0 .. seq_lens[b] - 1
    (as paged_decode_attention). mass: a zeroed fp32 [B, Hq, width >= max seq_len] tensor that
    gets each query head's softmax probabilities (the attention mass of H2O; positions past
    seq_len are left alone). tree: (base_lens [B] int32, extra [B, E] int32): row b's positions
    from base_lens[b] on are not its table's but the flat slots extra[b, 0 .. seq_lens[b] -
    base_lens[b] - 1] (a draft tree's row reads its ancestors' KV). CPU tensors; q and the caches
    one dtype of float32/bfloat16, last dims contiguous; block_tables [B, >= max blocks] and
    seq_lens [B] int32, their values the caller's contract (unchecked). ValueError otherwise, or
    when the kernel is unavailable (check `available()` first)."""
    from .paged_attention import check_attention_args

    num_seqs = q.shape[0] if q.dim() == 3 else -1
    check_attention_args("paged_decode_attention_cpu", q, k_cache, v_cache, out,
           block_tables=(block_tables, (num_seqs, None)), seq_lens=(seq_lens, (num_seqs,)))
    (_, num_heads, head_dim), (_, block_size, num_kv_heads, _) = q.shape, k_cache.shape
    if q.device.type != "cpu" or not available(q.dtype, num_heads, num_kv_heads, head_dim,
                                               block_size):
        raise ValueError(
            f"paged_decode_attention_cpu: needs CPU {DTYPES} tensors, up to {MAX_GROUP} query "
            f"heads per KV head, head_dim <= {MAX_HEAD_DIM}, block_size <= {MAX_BLOCK_SIZE} and "
            f"the compiled kernel; got {q.device} {q.dtype}, {num_heads // num_kv_heads}, "
            f"{head_dim}, {block_size}")
    if mass is not None and (mass.dtype != torch.float32 or not mass.is_contiguous()
                             or mass.shape[:2] != q.shape[:2]
                             or (num_seqs and mass.shape[2] < int(seq_lens.max()))):
        raise ValueError(f"paged_decode_attention_cpu: mass must be a contiguous float32 [B, Hq, "
                         f">= max seq_len] tensor; got {mass.dtype} {tuple(mass.shape)}")
    if tree is not None:
        base_lens, extra = tree
        if base_lens.dtype != torch.int32 or extra.dtype != torch.int32 \
                or base_lens.shape != (num_seqs,) or extra.dim() != 2 \
                or extra.shape[0] != num_seqs or extra.stride(1) != 1 \
                or not base_lens.is_contiguous() \
                or (num_seqs and int((seq_lens - base_lens).max()) > extra.shape[1]) \
                or (num_seqs and int((seq_lens - base_lens).min()) < 0):
            raise ValueError(f"paged_decode_attention_cpu: tree must be int32 base_lens [B] <= "
                             f"seq_lens and extra [B, >= seq_len - base_len] slots; got "
                             f"{base_lens.dtype} {tuple(base_lens.shape)}, {extra.dtype} "
                             f"{tuple(extra.shape)}")
    out = torch.empty(q.shape, dtype=q.dtype) if out is None else out
    scale = head_dim ** -0.5 if scale is None else scale
    paged_decode_attention_cpu_unchecked(q, k_cache, v_cache, block_tables, seq_lens, out, scale,
                                         mass, tree)
    return out


def paged_decode_attention_cpu_unchecked(q, k_cache, v_cache, block_tables, seq_lens, out,
                                         scale: float, mass: torch.Tensor | None = None,
                                         tree: tuple[torch.Tensor, torch.Tensor] | None = None
                                         ) -> None:
    """paged_decode_attention_cpu into `out` without its checks: for a caller that validated the
    shapes once (CPUAttention, chosen by the runner after `available`) and calls every layer."""
    (num_seqs, num_heads, head_dim), (_, block_size, num_kv_heads, _) = q.shape, k_cache.shape
    # whole requests per task when there are enough of them for the threads, else one KV head
    heads_per_task = num_kv_heads if num_seqs >= 2 * torch.get_num_threads() else 1
    _library(num_kv_heads, num_heads // num_kv_heads, head_dim).paged_decode(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        block_tables.stride(0), seq_lens.data_ptr(), out.data_ptr(), num_seqs, block_size,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *k_cache.stride()[:3],
        int(q.dtype == torch.bfloat16), scale, heads_per_task,
        None if mass is None else mass.data_ptr(), 0 if mass is None else mass.shape[2],
        None if tree is None else tree[0].data_ptr(), None if tree is None else tree[1].data_ptr(),
        0 if tree is None else tree[1].stride(0))
