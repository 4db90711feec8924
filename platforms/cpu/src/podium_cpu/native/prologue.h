/* The elementwise ops that come before a linear, one row at a time, rounding where the pure-torch
 * references round (podium_plugin_api/ops.py): RMSNorm with or without the residual add, and
 * SiLU-and-mul. fused_ops.c runs them alone; fma_linear.c runs them in a linear's input pass (the
 * API 1.5 ops rms_norm_linear / silu_and_mul_linear), so the fused call equals "op, then linear"
 * bit for bit. Both sources are compiled with -ffp-contract=off (native_kernels.py): no a * b + c
 * contracted into one rounding where torch rounds twice. */
#ifndef PODIUM_PROLOGUE_H
#define PODIUM_PROLOGUE_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "fast_exp.h"

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* One row: s = bf16(x + res) into sum (res NULL: s = x), out = bf16(w * bf16(s * rsqrt(mean(s^2) + eps))).
 * VL lanes at a time with scalar tails; the second pass re-reads s (bf16) from the first. */
static void norm_row(const bf16_t *x, const bf16_t *res, const bf16_t *w, bf16_t *out, bf16_t *sum, int64_t cols,
                     float eps) {
    vf acc = {0};
    float ss = 0.f;
    int64_t i = 0;
    if (res) {
        for (; i + VL <= cols; i += VL) {
            const vf s = roundv_bf16(loadv_bf16(x + i) + loadv_bf16(res + i));
            storev_bf16(sum + i, s);
            acc += s * s;
        }
        for (; i < cols; i++) {
            const float s = round_bf16(bf16_to_f32(x[i]) + bf16_to_f32(res[i]));
            sum[i] = f32_to_bf16(s);
            ss += s * s;
        }
    } else {
        for (; i + VL <= cols; i += VL) {
            const vf s = loadv_bf16(x + i);
            acc += s * s;
        }
        for (; i < cols; i++) ss += bf16_to_f32(x[i]) * bf16_to_f32(x[i]);
    }
    for (int k = 0; k < VL; k++) ss += acc[k];
    const float scale = 1.f / sqrtf(ss / (float)cols + eps);
    const bf16_t *s_row = res ? sum : x;
    for (i = 0; i + VL <= cols; i += VL)
        storev_bf16(out + i, loadv_bf16(w + i) * roundv_bf16(loadv_bf16(s_row + i) * scale));
    for (; i < cols; i++) out[i] = f32_to_bf16(bf16_to_f32(w[i]) * round_bf16(bf16_to_f32(s_row[i]) * scale));
}

/* bf16(silu(g) * u) on VL lanes: silu(g) = g / (1 + e^-g) in float32 rounded to bf16 (torch's
 * silu on a bf16 tensor), then the product (exact in float32 for two bf16 values) rounded by the caller */
static inline vf silu_mulv(vf g, vf u) { return roundv_bf16(g / (1.f + expv(-g))) * u; }

/* One row of x = [gate | up] (I each) -> o [I] = bf16(silu(gate) * up); the last I % VL lanes go
 * through a padded copy. */
static void silu_mul_row(const bf16_t *x, bf16_t *o, int64_t I) {
    const bf16_t *gate = x, *up = x + I;
    int64_t i = 0;
    for (; i + VL <= I; i += VL) storev_bf16(o + i, silu_mulv(loadv_bf16(gate + i), loadv_bf16(up + i)));
    if (i < I) {
        bf16_t g[VL] = {0}, u[VL] = {0}, h[VL];
        memcpy(g, gate + i, (size_t)(I - i) * sizeof(bf16_t));
        memcpy(u, up + i, (size_t)(I - i) * sizeof(bf16_t));
        storev_bf16(h, silu_mulv(loadv_bf16(g), loadv_bf16(u)));
        memcpy(o + i, h, (size_t)(I - i) * sizeof(bf16_t));
    }
}

/* A fused linear's entry (fma_linear.c, amx_linear.c) in a build without the instructions it needs:
 * the same signature, so the library still binds, and nothing to run (-1) */
#define DEFINE_FUSED_LINEAR_STUB(NAME)                                                                \
    int NAME(const bf16_t *x, int64_t x_stride, const bf16_t *res, int64_t res_stride, const bf16_t *norm_w,  \
             float eps, bf16_t *sum_out, int silu, int64_t M, const bf16_t *packed, int64_t N, int64_t K,   \
             const float *bias, bf16_t *out, int64_t out_stride, int num_threads) {                     \
        (void)x, (void)x_stride, (void)res, (void)res_stride, (void)norm_w, (void)eps, (void)sum_out;       \
        (void)silu, (void)M, (void)packed, (void)N, (void)K, (void)bias, (void)out, (void)out_stride;       \
        (void)num_threads;                                                                            \
        return -1;                                                                                    \
    }

#endif
