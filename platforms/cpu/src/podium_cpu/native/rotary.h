/* Neox (rotate-half) rotary embedding of one token's [heads, D] rows, shared by the fused ops
 * (the rotary_embedding op) and the attention kernel (rotation fused into its cache write):
 * [x1 c - x2 s, x2 c + x1 s] in float32 with every product rounded before the sum, as torch's
 * separate kernels round, so both equal podium_plugin_api.ops.rotary_embedding bit for bit. The
 * attention kernel's file is compiled with FMA contraction allowed: NO_CONTRACTION turns it off
 * for these functions (GCC's optimize attribute; clang contracts only within one expression, and
 * the products here are separate statements). */
#ifndef PODIUM_ROTARY_H
#define PODIUM_ROTARY_H

#include <stdint.h>

#include "bf16.h"

#if defined(__GNUC__) && !defined(__clang__)
#define NO_CONTRACTION __attribute__((optimize("fp-contract=off")))
#else
#define NO_CONTRACTION
#endif

/* One [heads, D] row rotated by (cos, sin) [D/2 each] into out. */
#define DEFINE_ROTATE(NAME, T, LOAD, STORE, LOADV, STOREV)                                          \
NO_CONTRACTION static void NAME(const T *x, T *out, const float *cs, int64_t heads, int64_t D) {       \
    const int64_t half = D / 2;                                                                       \
    const float *c = cs, *s = cs + half;                                                              \
    for (int64_t h = 0; h < heads; h++) {                                                             \
        const T *xh = x + h * D;                                                                      \
        T *oh = out + h * D;                                                                          \
        int64_t i = 0;                                                                                \
        for (; i + VL <= half; i += VL) {                                                             \
            const vf x1 = LOADV(xh + i), x2 = LOADV(xh + i + half);                               \
            const vf cv = loadv(c + i), sv = loadv(s + i);                                        \
            const vf a = x1 * cv, b = x2 * sv, e = x2 * cv, f = x1 * sv;                            \
            STOREV(oh + i, a - b);                                                                   \
            STOREV(oh + i + half, e + f);                                                            \
        }                                                                                             \
        for (; i < half; i++) {                                                                       \
            const float x1 = LOAD(xh[i]), x2 = LOAD(xh[i + half]);                                    \
            const float a = x1 * c[i], b = x2 * s[i], e = x2 * c[i], f = x1 * s[i];                   \
            oh[i] = STORE(a - b);                                                                     \
            oh[i + half] = STORE(e + f);                                                              \
        }                                                                                             \
    }                                                                                                 \
}

DEFINE_ROTATE(rotate_f32, float, load_f32, store_f32, loadv, storev_f32)
DEFINE_ROTATE(rotate_bf16, bf16_t, bf16_to_f32, f32_to_bf16, loadv_bf16, storev_bf16)

#endif
