/* The elementwise ops that come before a linear, one row at a time, rounding where the pure-torch
 * references round (podium_plugin_api/ops.py): RMSNorm with or without the residual add, and
 * SiLU-and-mul, for bf16 rows and float32 rows. fused_ops.c runs them alone; the linear kernels
 * run them in their input pass (linear.h's input rows: the API 1.5 ops rms_norm_linear and
 * silu_and_mul_linear), so the fused call equals "op, then linear" bit for bit.
 * Every source that includes this is compiled with -ffp-contract=off (native_kernels.py): no
 * a * b + c contracted into one rounding where torch rounds twice. */
#ifndef PODIUM_PROLOGUE_H
#define PODIUM_PROLOGUE_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "fast_exp.h"

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }
static inline float round_f32(float f) { return f; }
static inline vf roundv_f32(vf f) { return f; }

/* One row: s = T(x + res) into sum (res NULL: s = x), out = T(w * T(s * rsqrt(mean(s^2) + eps))), T the
 * row type's rounding (none for float32). VL lanes at a time with scalar tails; the second pass
 * re-reads s from the first. */
#define DEFINE_NORM_ROW(NAME, T, LOAD, STORE, ROUND, LOADV, STOREV, ROUNDV)                              \
static void NAME(const T *x, const T *res, const T *w, T *out, T *sum, int64_t cols, float eps) {        \
    vf acc = {0};                                                                                        \
    float ss = 0.f;                                                                                      \
    int64_t i = 0;                                                                                       \
    if (res) {                                                                                           \
        for (; i + VL <= cols; i += VL) {                                                                \
            const vf s = ROUNDV(LOADV(x + i) + LOADV(res + i));                                          \
            STOREV(sum + i, s);                                                                          \
            acc += s * s;                                                                                \
        }                                                                                                \
        for (; i < cols; i++) {                                                                          \
            const float s = ROUND(LOAD(x[i]) + LOAD(res[i]));                                            \
            sum[i] = STORE(s);                                                                           \
            ss += s * s;                                                                                 \
        }                                                                                                \
    } else {                                                                                             \
        for (; i + VL <= cols; i += VL) {                                                                \
            const vf s = LOADV(x + i);                                                                   \
            acc += s * s;                                                                                \
        }                                                                                                \
        for (; i < cols; i++) ss += LOAD(x[i]) * LOAD(x[i]);                                             \
    }                                                                                                    \
    for (int k = 0; k < VL; k++) ss += acc[k];                                                           \
    const float scale = 1.f / sqrtf(ss / (float)cols + eps);                                             \
    const T *s_row = res ? sum : x;                                                                      \
    for (i = 0; i + VL <= cols; i += VL) STOREV(out + i, LOADV(w + i) * ROUNDV(LOADV(s_row + i) * scale)); \
    for (; i < cols; i++) out[i] = STORE(LOAD(w[i]) * ROUND(LOAD(s_row[i]) * scale));                    \
}
DEFINE_NORM_ROW(norm_row, bf16_t, bf16_to_f32, f32_to_bf16, round_bf16, loadv_bf16, storev_bf16, roundv_bf16)
DEFINE_NORM_ROW(norm_row_f32, float, load_f32, store_f32, round_f32, loadv, storev, roundv_f32)

/* One row of x = [gate | up] (I each) -> o [I] = T(T(silu(g)) * u): silu(g) = g / (1 + e^-g) in float32
 * (torch's silu), rounded to the row type, times up (exact in float32 for two bf16 values), rounded;
 * the last I % VL lanes go through a padded copy. */
#define DEFINE_SILU_MUL_ROW(NAME, T, LOADV, STOREV, ROUNDV)                                              \
static void NAME(const T *x, T *o, int64_t I) {                                                          \
    const T *gate = x, *up = x + I;                                                                      \
    int64_t i = 0;                                                                                       \
    for (; i + VL <= I; i += VL) {                                                                       \
        const vf g = LOADV(gate + i);                                                                    \
        STOREV(o + i, ROUNDV(g / (1.f + expv(-g))) * LOADV(up + i));                                     \
    }                                                                                                    \
    if (i < I) {                                                                                         \
        T g[VL] = {0}, u[VL] = {0}, h[VL];                                                               \
        memcpy(g, gate + i, (size_t)(I - i) * sizeof(T));                                                \
        memcpy(u, up + i, (size_t)(I - i) * sizeof(T));                                                 \
        const vf gv = LOADV(g);                                                                          \
        STOREV(h, ROUNDV(gv / (1.f + expv(-gv))) * LOADV(u));                                            \
        memcpy(o + i, h, (size_t)(I - i) * sizeof(T));                                                   \
    }                                                                                                    \
}
DEFINE_SILU_MUL_ROW(silu_mul_row_f32, float, loadv, storev, roundv_f32)

#if VL == 16
/* bf16 rows on AVX-512: a bf16 gate has 65536 values, so T(silu(g)) of every one is computed once (at
 * load, by the vector code above: the same e^x, division and rounding) into this table, and a row
 * gathers it 16 gates at a time: the row's result is bit for bit the computed one, without an e^x
 * and a division per 16 values (about 60 cycles of a prefill's ~1.2 ms SiLU-mul a layer, 2048
 * tokens x 1536). 256 KiB, in each library that includes this. */
static float silu_bf16_table[65536] __attribute__((unused));

__attribute__((constructor, unused)) static void build_silu_bf16_table(void) {
    for (int i = 0; i < 65536; i += VL) {
        vf g;
        for (int k = 0; k < VL; k++) g[k] = bf16_to_f32((bf16_t)(i + k));
        const vf s = roundv_bf16(g / (1.f + expv(-g)));
        memcpy(silu_bf16_table + i, &s, sizeof s);
    }
}

static __attribute__((unused)) void silu_mul_row(const bf16_t *x, bf16_t *o, int64_t I) {
    const bf16_t *gate = x, *up = x + I;
    int64_t i = 0;
    for (; i + VL <= I; i += VL) {
        const __m512i g = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(gate + i)));
        storev_bf16(o + i, (vf)_mm512_i32gather_ps(g, silu_bf16_table, 4) * loadv_bf16(up + i));
    }
    for (; i < I; i++) o[i] = f32_to_bf16(silu_bf16_table[gate[i]] * bf16_to_f32(up[i]));
}
#else
DEFINE_SILU_MUL_ROW(silu_mul_row, bf16_t, loadv_bf16, storev_bf16, roundv_bf16)
#endif

#endif
