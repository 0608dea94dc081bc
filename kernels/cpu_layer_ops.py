"""The decoder layer's elementwise steps on the CPU, each one C call (built on first use by
cpu_build.py): the same operations, arguments and rounding points as kernels/layer_ops.py (whose
torch references define them), for float32 and bfloat16.

In plain torch each step is 3 to 6 ops with a full pass over memory each (casts, chunks, products,
a concat), a real share of a SmolLM2 decode step (bench/results/engine_cpu.md). Here each is one
pass, in fp32, rounding where the reference rounds; rows are spread over torch's OpenMP threads
when there is enough work.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from .cpu_build import build

DTYPES = (torch.float32, torch.bfloat16)

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float load(const void *p, int64_t i, int bf16) {
    if (!bf16) return ((const float *)p)[i];
    uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* v rounded to the activation dtype (round to nearest even for bf16, as torch's cast; a NaN
   stays a NaN), branch-free so the loops vectorize */
static inline float round_to(float v, int bf16) {
    if (!bf16) return v;
    uint32_t u, r;
    memcpy(&u, &v, 4);
    r = (u + 0x7fff + ((u >> 16) & 1)) & 0xffff0000u;
    r = (u & 0x7fffffffu) > 0x7f800000u ? (u | 0x00400000u) & 0xffff0000u : r;
    memcpy(&v, &r, 4);
    return v;
}

static inline void store(void *p, int64_t i, float v, int bf16) {  /* v already rounded */
    if (!bf16) { ((float *)p)[i] = v; return; }
    uint32_t u;
    memcpy(&u, &v, 4);
    ((uint16_t *)p)[i] = (uint16_t)(u >> 16);
}

/* exp(x) for x <= 0: 2^n * p(r), r = x - n ln2, p of degree 6 (relative error < 2e-7) */
static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float shifter = 12582912.0f;  /* 1.5 * 2^23: adding it rounds to an integer */
    float n = (x * 1.44269504088896341f + shifter) - shifter;
    float r = x - n * 0.693145751953125f - n * 1.42860682030941723e-6f;
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120
              + r * (1.0f / 720))))));
    int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, 4);
    return p * two_n;
}

#define INLINE static inline __attribute__((always_inline))

/* One row of rms_norm: out = weight * round(r / rms(r)), r = round(residual + x) written back to
   residual when has_residual, else r = x. */
INLINE void rms_norm_row(const char *x, char *residual, const void *weight, char *out, int64_t n,
                         float eps, int has_residual, const int bf16) {
    float r[n], part[16] = {0};
    for (int64_t i = 0; i < n; i++)
        r[i] = has_residual ? round_to(load(residual, i, bf16) + load(x, i, bf16), bf16)
                            : load(x, i, bf16);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)  /* 16 partial sums: a vectorizable order */
        for (int j = 0; j < 16; j++) part[j] += r[i + j] * r[i + j];
    float sum = 0.0f;
    for (; i < n; i++) sum += r[i] * r[i];
    for (int j = 0; j < 16; j++) sum += part[j];
    if (has_residual)
        for (i = 0; i < n; i++) store(residual, i, r[i], bf16);
    float inv = 1.0f / sqrtf(sum / n + eps);
    for (i = 0; i < n; i++)
        store(out, i, round_to(round_to(r[i] * inv, bf16) * load(weight, i, bf16), bf16), bf16);
}

/* One row of silu_and_mul: x [2n] (gate, then up) -> out [n] = round(round(silu(gate)) * up) */
INLINE void silu_row(const char *x, char *out, int64_t n, const int bf16) {
    for (int64_t i = 0; i < n; i++) {
        float g = load(x, i, bf16), e = exp_nonpos(-fabsf(g));
        float sig = (g >= 0.0f ? 1.0f : e) / (1.0f + e);  /* sigmoid without overflow */
        store(out, i, round_to(round_to(g * sig, bf16) * load(x, n + i, bf16), bf16), bf16);
    }
}

/* One token of apply_rotary: its heads [heads, 2 half] (rotate-half) with c, s its table rows */
INLINE void rotary_token(char *qk, int64_t sh, const float *c, const float *s, int64_t heads,
                         int64_t half, const int bf16) {
    int64_t esize = bf16 ? 2 : 4;
    for (int64_t h = 0; h < heads; h++) {
        char *row = qk + h * sh * esize;
        for (int64_t i = 0; i < half; i++) {
            float x1 = load(row, i, bf16), x2 = load(row, half + i, bf16);
            store(row, i, round_to(x1 * c[i] - x2 * s[i], bf16), bf16);
            store(row, half + i, round_to(x2 * c[i] + x1 * s[i], bf16), bf16);
        }
    }
}

/* The exported ops: a loop over rows (in parallel when there is enough work), written out once
   per dtype so that `bf16` is a constant inside each OpenMP body and the row loops vectorize.
   Strides in elements. */
#define FOR_EACH_DTYPE(rows, work, body)                                                     \
    const int64_t parallel_work = (work);                                                    \
    if (bf16) {                                                                              \
        const int64_t esize = 2; const int BF = 1;                                           \
        _Pragma("omp parallel for schedule(static) if (parallel_work >= 16384)")             \
        for (int64_t row = 0; row < rows; row++) body                                        \
    } else {                                                                                 \
        const int64_t esize = 4; const int BF = 0;                                           \
        _Pragma("omp parallel for schedule(static) if (parallel_work >= 16384)")             \
        for (int64_t row = 0; row < rows; row++) body                                        \
    }

void rms_norm(const void *x, int64_t sx, void *residual, int64_t sr, const void *weight,
              void *out, int64_t so, int64_t rows, int64_t n, float eps, int has_residual,
              int bf16) {
    FOR_EACH_DTYPE(rows, rows * n, {
        rms_norm_row((const char *)x + row * sx * esize, (char *)residual + row * sr * esize,
                     weight, (char *)out + row * so * esize, n, eps, has_residual, BF);
    })
}

/* x [rows, 2n] (gate, then up) -> out [rows, n] */
void silu_and_mul(const void *x, int64_t sx, void *out, int64_t so, int64_t rows, int64_t n,
                  int bf16) {
    FOR_EACH_DTYPE(rows, rows * n, {
        silu_row((const char *)x + row * sx * esize, (char *)out + row * so * esize, n, BF);
    })
}

/* qk [tokens, heads, 2 half] rotated in place at positions[t] of the fp32 cos/sin tables
   [max_positions, half] */
void apply_rotary(void *qk, int64_t st, int64_t sh, const int64_t *positions, const float *cos,
                  const float *sin, int64_t tokens, int64_t heads, int64_t half, int bf16) {
    FOR_EACH_DTYPE(tokens, tokens * heads * half, {
        rotary_token((char *)qk + row * st * esize, sh, cos + positions[row] * half,
                     sin + positions[row] * half, heads, half, BF);
    })
}
"""


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = build("cpu_layer_ops", _SOURCE)
    if lib is not None:
        i64, ptr, i32, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
        lib.rms_norm.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, f32, i32, i32]
        lib.silu_and_mul.argtypes = [ptr, i64, ptr, i64, i64, i64, i32]
        lib.apply_rotary.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, i64, i64, i32]
    return lib


def available(dtype: torch.dtype) -> bool:
    """Whether these ops serve CPU tensors of `dtype` here (builds the library on first ask)."""
    return dtype in DTYPES and _library() is not None


def _check(fn: str, *tensors: torch.Tensor) -> None:
    x = tensors[0]
    if not available(x.dtype) or x.dim() != 2 or any(
            t.dtype != x.dtype or t.device.type != "cpu" or t.stride(-1) != 1 for t in tensors):
        raise ValueError(f"{fn}: need 2-D CPU tensors of one dtype of {DTYPES} with contiguous "
                         f"rows (and the compiled library); got "
                         f"{[(t.dtype, tuple(t.shape), t.stride()) for t in tensors]}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rmsnorm(x) for x [T, N], weight [N] of x's dtype; a new tensor."""
    return _rms_norm(x, None, weight, eps)


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> torch.Tensor:
    """residual += x in place, then weight * rmsnorm(residual) (a new tensor). x, residual
    [T, N]."""
    if residual.shape != x.shape:
        raise ValueError(f"add_rms_norm_: residual {tuple(residual.shape)} != x {tuple(x.shape)}")
    return _rms_norm(x, residual, weight, eps)


def _rms_norm(x, residual, weight, eps):
    _check("rms_norm", x, *([] if residual is None else [residual]))
    if weight.shape != x.shape[-1:] or weight.dtype != x.dtype or not weight.is_contiguous():
        raise ValueError(f"rms_norm: weight must be a contiguous {x.dtype} [{x.shape[-1]}]")
    out = torch.empty_like(x)
    res = x if residual is None else residual
    _library().rms_norm(x.data_ptr(), x.stride(0), res.data_ptr(), res.stride(0),
                        weight.data_ptr(), out.data_ptr(), out.stride(0), x.shape[0], x.shape[1],
                        eps, residual is not None, x.dtype == torch.bfloat16)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2N] (gate, then up) -> silu(gate) * up [T, N]."""
    _check("silu_and_mul", x)
    if x.shape[1] % 2:
        raise ValueError(f"silu_and_mul: last dim must be even, got {x.shape[1]}")
    out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
    _library().silu_and_mul(x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), x.shape[0],
                            out.shape[1], x.dtype == torch.bfloat16)
    return out


def apply_rotary_(qk: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """Rotate qk [T, H, D] in place (rotate-half RoPE) at positions [T] (int64, each below
    max_positions: unchecked) with fp32 tables cos, sin [max_positions, D / 2]; returns qk."""
    if qk.dim() != 3 or not available(qk.dtype) or qk.device.type != "cpu" \
            or qk.stride(-1) != 1 or qk.shape[-1] % 2 or positions.shape != qk.shape[:1] \
            or positions.dtype != torch.int64 or not positions.is_contiguous() \
            or cos.shape != sin.shape or cos.shape[-1] * 2 != qk.shape[-1] \
            or cos.dtype != torch.float32 or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError(f"apply_rotary_: need CPU qk [T, H, D] ({DTYPES}) with contiguous heads, "
                         f"int64 positions [T], fp32 contiguous cos/sin [max_positions, D/2]; got "
                         f"qk {qk.dtype} {tuple(qk.shape)}, positions {positions.dtype} "
                         f"{tuple(positions.shape)}, cos {cos.dtype} {tuple(cos.shape)}")
    _library().apply_rotary(qk.data_ptr(), qk.stride(0), qk.stride(1), positions.data_ptr(),
                            cos.data_ptr(), sin.data_ptr(), qk.shape[0], qk.shape[1],
                            qk.shape[2] // 2, qk.dtype == torch.bfloat16)
    return qk
