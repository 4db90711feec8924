/* What both native kernels share: the bf16 type, its exact conversions to and from float32
 * (round to nearest even, as torch's .to(bfloat16); NaN stays NaN; branch-free, so loops over it
 * vectorise) and 16-lane float32 vectors (GCC vector extensions) with unaligned loads and stores,
 * bf16 rows widened by a 16-bit shift. */
#ifndef PODIUM_BF16_H
#define PODIUM_BF16_H

#include <stdint.h>
#include <string.h>

typedef uint16_t bf16_t;
typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

static inline float bf16_to_f32(bf16_t x) {
    const uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline bf16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t nan = (u >> 16) | 0x40u;
    return (bf16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

static inline v16f load16(const float *p) { v16f v; memcpy(&v, p, sizeof v); return v; }
static inline void store16(float *p, v16f v) { memcpy(p, &v, sizeof v); }

static inline v16f load16_bf16(const bf16_t *p) {
    v16h h;
    memcpy(&h, p, sizeof h);
    const v16u u = __builtin_convertvector(h, v16u) << 16;
    v16f f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#endif
