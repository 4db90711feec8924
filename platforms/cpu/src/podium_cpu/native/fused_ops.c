/* Fused elementwise ops of a decoder layer, one pass over memory each, with the exact rounding
 * steps of the pure-torch references in podium_plugin_api/ops.py:
 *
 *   rms_norm            out = w * to_dtype(x * rsqrt(mean(x^2) + eps))   (x in float32)
 *   fused_add_rms_norm  s = to_dtype(x + residual); (rms_norm(s), s)
 *   rotary_embedding    neox rotate-half: [x1 c - x2 s, x2 c + x1 s] in float32, then to_dtype
 *
 * Compiled with -ffp-contract=off so a*b - c*d rounds like torch's separate kernels: the rotary
 * embedding equals the reference bit for bit. rms_norm's sum of squares runs in another order than
 * torch's reduction, so it may differ from the reference by float32 rounding: the platform uses it
 * for bfloat16 only. Rotary rows go 16 floats at a time (GCC vector extensions; bf16 widened by a
 * shift, narrowed with round-to-nearest-even) with scalar tails. (SiLU-and-mul is not here: a fused
 * pass measured slower than torch's vectorised silu and mul, whose cost is e^x and the division.)
 * The caller (fused_ops.py) validates shapes, strides and dtypes; this code trusts them.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* f32_to_bf16 on 16 lanes */
static inline v16h narrow16(v16f f) {
    v16u u;
    memcpy(&u, &f, sizeof u);
    const v16u rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const v16u nan = (u >> 16) | 0x40u;
    const v16u is_nan = (v16u)((u & 0x7fffffffu) > 0x7f800000u);
    return __builtin_convertvector((nan & is_nan) | (rounded & ~is_nan), v16h);
}
static inline void store16_bf16(bf16_t *p, v16f f) { const v16h h = narrow16(f); memcpy(p, &h, sizeof h); }

/* rows of x [rows, cols] (row stride x_stride); residual may be NULL. bf16 only. (Plain loops: they
 * measured faster here than the 16-lane vector code used below.) */
int podium_rms_norm_bf16(const bf16_t *x, int64_t x_stride, const bf16_t *res, int64_t res_stride,
                         const bf16_t *w, bf16_t *out, bf16_t *sum_out, int64_t rows, int64_t cols, float eps,
                         int num_threads) {
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (rows * cols >= 65536) reduction(|:failed)
    {
        float *xf = (float *)malloc(sizeof(float) * cols);
        if (!xf) failed = 1;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (!xf) continue;
            const bf16_t *xr = x + r * x_stride;
            if (res) {
                const bf16_t *rr = res + r * res_stride;
                bf16_t *sr = sum_out + r * cols;
                for (int64_t i = 0; i < cols; i++) {
                    const bf16_t s = f32_to_bf16(bf16_to_f32(xr[i]) + bf16_to_f32(rr[i]));
                    sr[i] = s;
                    xf[i] = bf16_to_f32(s);
                }
            } else {
                for (int64_t i = 0; i < cols; i++) xf[i] = bf16_to_f32(xr[i]);
            }
            float ss = 0.f;
#pragma omp simd reduction(+:ss)
            for (int64_t i = 0; i < cols; i++) ss += xf[i] * xf[i];
            const float scale = 1.f / sqrtf(ss / (float)cols + eps);
            bf16_t *o = out + r * cols;
            for (int64_t i = 0; i < cols; i++) o[i] = f32_to_bf16(bf16_to_f32(w[i]) * round_bf16(xf[i] * scale));
        }
        free(xf);
    }
    return failed ? -1 : 0;
}

/* One [heads, D] row rotated by (cos, sin) [D/2 each] into out. */
#define DEFINE_ROTATE(NAME, T, LOAD, STORE, LOAD16, STORE16)                                          \
static inline void NAME(const T *x, T *out, const float *cs, int64_t heads, int64_t D) {              \
    const int64_t half = D / 2;                                                                       \
    const float *c = cs, *s = cs + half;                                                              \
    for (int64_t h = 0; h < heads; h++) {                                                             \
        const T *xh = x + h * D;                                                                      \
        T *oh = out + h * D;                                                                          \
        int64_t i = 0;                                                                                \
        for (; i + 16 <= half; i += 16) {                                                             \
            const v16f x1 = LOAD16(xh + i), x2 = LOAD16(xh + i + half);                               \
            const v16f cv = load16(c + i), sv = load16(s + i);                                        \
            const v16f a = x1 * cv, b = x2 * sv, e = x2 * cv, f = x1 * sv;                            \
            STORE16(oh + i, a - b);                                                                   \
            STORE16(oh + i + half, e + f);                                                            \
        }                                                                                             \
        for (; i < half; i++) {                                                                       \
            const float x1 = LOAD(xh[i]), x2 = LOAD(xh[i + half]);                                    \
            const float a = x1 * c[i], b = x2 * s[i], e = x2 * c[i], f = x1 * s[i];                   \
            oh[i] = STORE(a - b);                                                                     \
            oh[i + half] = STORE(e + f);                                                              \
        }                                                                                             \
    }                                                                                                 \
}

static inline float load_f32(float x) { return x; }
static inline float store_f32(float x) { return x; }
static inline void store16_f32(float *p, v16f v) { store16(p, v); }
DEFINE_ROTATE(rotate_f32, float, load_f32, store_f32, load16, store16_f32)
DEFINE_ROTATE(rotate_bf16, bf16_t, bf16_to_f32, f32_to_bf16, load16_bf16, store16_bf16)

/* q [T, H, D] (token stride q_stride, heads contiguous), k [T, Hkv, D] likewise; cos_sin
 * [num_positions, D] float32 (cos | sin); outputs contiguous. Returns 0, or -1 (nothing written)
 * when a position is outside [0, num_positions). */
#define DEFINE_ROTARY(NAME, ROTATE, T)                                                                \
int NAME(const T *q, int64_t q_stride, const T *k, int64_t k_stride, T *q_out, T *k_out,              \
         const int64_t *positions, const float *cos_sin, int64_t num_positions, int64_t tokens,        \
         int64_t H, int64_t Hkv, int64_t D, int num_threads) {                                        \
    for (int64_t t = 0; t < tokens; t++)                                                              \
        if (positions[t] < 0 || positions[t] >= num_positions) return -1;                             \
    _Pragma("omp parallel for num_threads(num_threads) if (tokens * (H + Hkv) * D >= 65536)")         \
    for (int64_t t = 0; t < tokens; t++) {                                                            \
        const float *cs = cos_sin + positions[t] * D;                                                 \
        ROTATE(q + t * q_stride, q_out + t * H * D, cs, H, D);                                        \
        ROTATE(k + t * k_stride, k_out + t * Hkv * D, cs, Hkv, D);                                    \
    }                                                                                                 \
    return 0;                                                                                         \
}

DEFINE_ROTARY(podium_rotary_f32, rotate_f32, float)
DEFINE_ROTARY(podium_rotary_bf16, rotate_bf16, bf16_t)
