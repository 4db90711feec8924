/* What both native kernels share: the bf16 type, its exact conversions to and from float32
 * (round to nearest even, as torch's .to(bfloat16); NaN stays NaN; branch-free, so loops over it
 * vectorise) and float32 vectors of VL lanes (GCC vector extensions) with unaligned loads and
 * stores, bf16 rows widened by a 16-bit shift and narrowed with the same rounding (AVX512-BF16's
 * vcvtneps2bf16 where the CPU has it: it rounds alike but flushes subnormals, so vectors holding
 * one take the integer path).
 *
 * VL is the CPU's register width: 16 lanes with AVX-512, 8 with AVX2, else 4 (SSE, NEON). A wider
 * vector than the registers has no register mode in GCC and lives on the stack: 16-lane vectors on
 * an AVX2 CPU (AMD Zen 3) made the attention kernel ~4x slower than its memory traffic. */
#ifndef PODIUM_BF16_H
#define PODIUM_BF16_H

#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define VL 16
#elif defined(__AVX__)
#define VL 8
#else
#define VL 4
#endif

typedef uint16_t bf16_t;
typedef float vf __attribute__((vector_size(4 * VL)));
typedef uint32_t vu __attribute__((vector_size(4 * VL)));
typedef uint16_t vh __attribute__((vector_size(2 * VL)));

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

static inline vf loadv(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void storev(float *p, vf v) { memcpy(p, &v, sizeof v); }

static inline vf loadv_bf16(const bf16_t *p) {
#if VL == 16 /* one vpmovzxwd: GCC 12 splits the generic widening below into four instructions */
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#elif VL == 8 && defined(__AVX2__)
    return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
    vh h;
    memcpy(&h, p, sizeof h);
    const vu u = __builtin_convertvector(h, vu) << 16;
    vf f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

/* f32_to_bf16 on VL lanes */
static inline vh narrowv(vf f) {
    vu u;
    memcpy(&u, &f, sizeof u);
#ifdef __AVX512BF16__
    const __m512i bits = (__m512i)u;
    const __mmask16 subnormal = _mm512_testn_epi32_mask(bits, _mm512_set1_epi32(0x7f800000)) &
                                _mm512_test_epi32_mask(bits, _mm512_set1_epi32(0x007fffff));
    if (__builtin_expect(subnormal == 0, 1)) {
        const __m256bh h = _mm512_cvtneps_pbh((__m512)f);
        vh out;
        memcpy(&out, &h, sizeof out);
        return out;
    }
#endif
    const vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const vu nan = (u >> 16) | 0x40u;
    const vu is_nan = (vu)((u & 0x7fffffffu) > 0x7f800000u);
    return __builtin_convertvector((nan & is_nan) | (rounded & ~is_nan), vh);
}

static inline void storev_bf16(bf16_t *p, vf f) {
    const vh h = narrowv(f);
    memcpy(p, &h, sizeof h);
}

static inline void storev_f32(float *p, vf v) { storev(p, v); }

/* f rounded to bf16 and widened again: the float32 value of torch's bf16 result (f32_to_bf16's
 * rounding done in place on the float's bits: no narrowing and widening) */
static inline vf roundv_bf16(vf f) {
    vu u;
    memcpy(&u, &f, sizeof u);
    const vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    const vu nan = (u | 0x400000u) & 0xffff0000u;
    const vu is_nan = (vu)((u & 0x7fffffffu) > 0x7f800000u);
    const vu bits = (nan & is_nan) | (rounded & ~is_nan);
    vf r;
    memcpy(&r, &bits, sizeof r);
    return r;
}

#endif
