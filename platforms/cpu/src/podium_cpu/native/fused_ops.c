/* Fused elementwise ops of a decoder layer, one pass over memory each, with the exact rounding
 * steps of the pure-torch references in podium_plugin_api/ops.py:
 *
 *   rms_norm            out = w * to_dtype(x * rsqrt(mean(x^2) + eps))   (x in float32)
 *   fused_add_rms_norm  s = to_dtype(x + residual); (rms_norm(s), s)
 *   rotary_embedding    neox rotate-half: [x1 c - x2 s, x2 c + x1 s] in float32, then to_dtype
 *   silu_and_mul        to_dtype(to_dtype(g / (1 + e^-g)) * u)               (g, u in float32)
 *
 * Compiled with -ffp-contract=off so a*b - c*d rounds like torch's separate kernels: the rotary
 * embedding equals the reference bit for bit. rms_norm's sum of squares runs in another order than
 * torch's reduction, so it may differ from the reference by float32 rounding: the platform uses it
 * for bfloat16 only, as SiLU, whose e^x (fast_exp.h) is not torch's (a sweep of every bf16 gate
 * still rounded to torch's results). Rows go VL floats at a time (GCC vector extensions, bf16.h)
 * with scalar or padded tails. Below PARALLEL_MIN elements an op runs on the calling thread:
 * waking a sleeping OpenMP worker costs more than the work.
 * The caller (fused_ops.py) validates shapes, strides and dtypes; this code trusts them.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "fast_exp.h"
#include "rotary.h"

#define PARALLEL_MIN 65536       /* elements of a norm or rotary call */
#define SILU_PARALLEL_MIN 16384  /* output elements of silu_and_mul: e^x and a division each */

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

/* rows of x [rows, cols] (row stride x_stride); residual may be NULL (then sum_out is unused).
 * bf16 only; out and sum_out contiguous. */
int podium_rms_norm_bf16(const bf16_t *x, int64_t x_stride, const bf16_t *res, int64_t res_stride,
                         const bf16_t *w, bf16_t *out, bf16_t *sum_out, int64_t rows, int64_t cols, float eps,
                         int num_threads) {
    if (rows * cols < PARALLEL_MIN) { /* no OpenMP region at all: even a one-thread team costs */
        for (int64_t r = 0; r < rows; r++)
            norm_row(x + r * x_stride, res ? res + r * res_stride : NULL, w, out + r * cols,
                     res ? sum_out + r * cols : NULL, cols, eps);
        return 0;
    }
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        norm_row(x + r * x_stride, res ? res + r * res_stride : NULL, w, out + r * cols,
                 res ? sum_out + r * cols : NULL, cols, eps);
    return 0;
}

/* bf16(silu(g) * u) on VL lanes: silu(g) = g / (1 + e^-g) in float32 rounded to bf16 (torch's
 * silu on a bf16 tensor), then the product (exact in float32 for two bf16 values) rounded by the caller */
static inline vf silu_mulv(vf g, vf u) { return roundv_bf16(g / (1.f + expv(-g))) * u; }

/* x [rows, 2I] = [gate | up] (row stride x_stride) -> out [rows, I] contiguous, bf16(silu(gate) * up):
 * torch's silu then mul, each rounded to bf16. A row's last I % VL lanes go through a padded copy. */
int podium_silu_and_mul_bf16(const bf16_t *x, int64_t x_stride, bf16_t *out, int64_t rows, int64_t I,
                             int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * I >= SILU_PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const bf16_t *gate = x + r * x_stride, *up = gate + I;
        bf16_t *o = out + r * I;
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
    return 0;
}

/* q [T, H, D] (token stride q_stride, heads contiguous), k [T, Hkv, D] likewise; cos_sin
 * [num_positions, D] float32 (cos | sin); outputs contiguous. Returns 0, or -1 (nothing written)
 * when a position is outside [0, num_positions). */
#define DEFINE_ROTARY(NAME, ROTATE, T)                                                                \
int NAME(const T *q, int64_t q_stride, const T *k, int64_t k_stride, T *q_out, T *k_out,              \
         const int64_t *positions, const float *cos_sin, int64_t num_positions, int64_t tokens,        \
         int64_t H, int64_t Hkv, int64_t D, int num_threads) {                                        \
    for (int64_t t = 0; t < tokens; t++)                                                              \
        if (positions[t] < 0 || positions[t] >= num_positions) return -1;                             \
    _Pragma("omp parallel for num_threads(num_threads) if (tokens * (H + Hkv) * D >= PARALLEL_MIN)")         \
    for (int64_t t = 0; t < tokens; t++) {                                                            \
        const float *cs = cos_sin + positions[t] * D;                                                 \
        ROTATE(q + t * q_stride, q_out + t * H * D, cs, H, D);                                        \
        ROTATE(k + t * k_stride, k_out + t * Hkv * D, cs, Hkv, D);                                    \
    }                                                                                                 \
    return 0;                                                                                         \
}

DEFINE_ROTARY(podium_rotary_f32, rotate_f32, float)
DEFINE_ROTARY(podium_rotary_bf16, rotate_bf16, bf16_t)
