/* What both native kernels share: the bf16 type, its exact conversions to and from float32
 * (round to nearest even, as torch's .to(bfloat16); NaN stays NaN; branch-free, so loops over it
 * vectorise) and 16-lane float32 vectors (GCC vector extensions) with unaligned loads and stores,
 * bf16 rows widened by a 16-bit shift and narrowed with the same rounding (AVX512-BF16's
 * vcvtneps2bf16 where the CPU has it: it rounds alike but flushes subnormals, so vectors holding
 * one take the integer path). */
#ifndef PODIUM_BF16_H
#define PODIUM_BF16_H

#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

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

/* float32 rows through the same element-type-generic code as bf16 rows: identity conversions */
static inline float load_f32(float x) { return x; }
static inline float store_f32(float x) { return x; }

static inline v16f load16(const float *p) { v16f v; memcpy(&v, p, sizeof v); return v; }
static inline void store16(float *p, v16f v) { memcpy(p, &v, sizeof v); }

static inline v16f load16_bf16(const bf16_t *p) {
#ifdef __AVX512F__ /* one vpmovzxwd: GCC 12 splits the generic widening below into four instructions */
    return (v16f)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#else
    v16h h;
    memcpy(&h, p, sizeof h);
    const v16u u = __builtin_convertvector(h, v16u) << 16;
    v16f f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

/* f32_to_bf16 on 16 lanes */
static inline v16h narrow16(v16f f) {
    v16u u;
    memcpy(&u, &f, sizeof u);
#ifdef __AVX512BF16__
    const __m512i bits = (__m512i)u;
    const __mmask16 subnormal = _mm512_testn_epi32_mask(bits, _mm512_set1_epi32(0x7f800000)) &
                                _mm512_test_epi32_mask(bits, _mm512_set1_epi32(0x007fffff));
    if (__builtin_expect(subnormal == 0, 1)) {
        const __m256bh h = _mm512_cvtneps_pbh((__m512)f);
        v16h out;
        memcpy(&out, &h, sizeof out);
        return out;
    }
#endif
    const v16u rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const v16u nan = (u >> 16) | 0x40u;
    const v16u is_nan = (v16u)((u & 0x7fffffffu) > 0x7f800000u);
    return __builtin_convertvector((nan & is_nan) | (rounded & ~is_nan), v16h);
}

static inline void store16_bf16(bf16_t *p, v16f f) {
    const v16h h = narrow16(f);
    memcpy(p, &h, sizeof h);
}

static inline void store16_f32(float *p, v16f v) { store16(p, v); }

/* f rounded to bf16 and widened again: the float32 value of torch's bf16 result (f32_to_bf16's
 * rounding done in place on the float's bits: no narrowing and widening) */
static inline v16f round16_bf16(v16f f) {
    v16u u;
    memcpy(&u, &f, sizeof u);
    const v16u rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    const v16u nan = (u | 0x400000u) & 0xffff0000u;
    const v16u is_nan = (v16u)((u & 0x7fffffffu) > 0x7f800000u);
    const v16u bits = (nan & is_nan) | (rounded & ~is_nan);
    v16f r;
    memcpy(&r, &bits, sizeof r);
    return r;
}

#endif
