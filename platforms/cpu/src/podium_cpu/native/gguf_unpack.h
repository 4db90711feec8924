/* GGUF weights unpacked 32 at a time (a "chunk": a legacy block, or a K-quant sub-block pair's
 * worth) into the integer form the dot products of gguf_linear.c take:
 *
 *     w[k] = scale * mult[k / 16] * q[k] + bias          k = 0 .. 31 of the chunk
 *
 *     format  q (int8)                 scale        bias           mult
 *     Q4_0    nibble, 0..15            d            -8 d           1
 *     Q4_1    nibble, 0..15            d            m              1
 *     Q8_0    q, -128..127 (signed)    d            0              1
 *     Q4_K    nibble, 0..15            d sc_j       -dmin m_j      1
 *     Q5_K    nibble | bit << 4, 0..31 d sc_j       -dmin m_j      1
 *     Q6_K    q - 32, -32..31 (signed) d            0              sc of each 16 weights (int8)
 *
 * so q . x_q is exact in integers (x_q: the activations as int8, gguf_linear.c): unsigned q go
 * straight into AVX2's u8 x s8 multiply-add; signed ones take their magnitude and move their sign
 * onto x. Every product pair fits int16 (at most 2 x 128 x 127). q_<type>_v returns a chunk's q in
 * a register, scales8_<type> a chunk's scales in 8 rows as vectors (AVX2); plain C writes them as
 * bytes and scalars (q_<type>_s, scales_<type>) for CPUs without it. Layouts: gguf_blocks.py. */
#ifndef PODIUM_GGUF_UNPACK_H
#define PODIUM_GGUF_UNPACK_H

#include <stdint.h>

#include "gguf_dequant.h"

typedef struct {
    float scale, bias;
    int16_t mult[2];
} chunk_scales;

/* chunk c of a row: its block, and (K-quants) which 32 of the block's 256 weights */
#define LEGACY(row, c, BYTES) ((row) + (c) * (BYTES))
#define SUPER(row, c, BYTES) ((row) + ((c) >> 3) * (BYTES))

static inline chunk_scales scales_q4_0(const uint8_t *row, int64_t c) {
    const float d = half_to_f32(LEGACY(row, c, 18));
    return (chunk_scales){d, -8.f * d, {1, 1}};
}

static inline chunk_scales scales_q4_1(const uint8_t *row, int64_t c) {
    const uint8_t *b = LEGACY(row, c, 20);
    return (chunk_scales){half_to_f32(b), half_to_f32(b + 2), {1, 1}};
}

static inline chunk_scales scales_q8_0(const uint8_t *row, int64_t c) {
    return (chunk_scales){half_to_f32(LEGACY(row, c, 34)), 0.f, {1, 1}};
}

static inline chunk_scales k_scales(const uint8_t *b, int64_t c) {  /* Q4_K and Q5_K: same header */
    int sc, mn;
    k_scale_min(b + 4, (int)(c & 7), &sc, &mn);
    return (chunk_scales){half_to_f32(b) * (float)sc, -(half_to_f32(b + 2) * (float)mn), {1, 1}};
}

static inline chunk_scales scales_q4_k(const uint8_t *row, int64_t c) { return k_scales(SUPER(row, c, 144), c); }
static inline chunk_scales scales_q5_k(const uint8_t *row, int64_t c) { return k_scales(SUPER(row, c, 176), c); }

static inline chunk_scales scales_q6_k(const uint8_t *row, int64_t c) {
    const uint8_t *b = SUPER(row, c, 210);
    const int8_t *sc = (const int8_t *)(b + 192) + 2 * (c & 7);
    return (chunk_scales){half_to_f32(b + 208), 0.f, {sc[0], sc[1]}};
}

/* q as bytes (plain C; GCC vectorises the loops) */
static inline void q_q4_0_s(const uint8_t *row, int64_t c, int8_t *q) {
    const uint8_t *n = LEGACY(row, c, 18) + 2;
    for (int j = 0; j < 16; j++) q[j] = (int8_t)(n[j] & 15), q[j + 16] = (int8_t)(n[j] >> 4);
}

static inline void q_q4_1_s(const uint8_t *row, int64_t c, int8_t *q) {
    const uint8_t *n = LEGACY(row, c, 20) + 4;
    for (int j = 0; j < 16; j++) q[j] = (int8_t)(n[j] & 15), q[j + 16] = (int8_t)(n[j] >> 4);
}

static inline void q_q8_0_s(const uint8_t *row, int64_t c, int8_t *q) {
    memcpy(q, LEGACY(row, c, 34) + 2, 32);
}

static inline void q_q4_k_s(const uint8_t *row, int64_t c, int8_t *q) {
    const uint8_t *n = SUPER(row, c, 144) + 16 + 32 * ((c & 7) >> 1);
    const int shift = (int)(c & 1) * 4;
    for (int j = 0; j < 32; j++) q[j] = (int8_t)((n[j] >> shift) & 15);
}

static inline void q_q5_k_s(const uint8_t *row, int64_t c, int8_t *q) {
    const uint8_t *b = SUPER(row, c, 176), *n = b + 48 + 32 * ((c & 7) >> 1), *h = b + 16;
    const int shift = (int)(c & 1) * 4, bit = (int)(c & 7);
    for (int j = 0; j < 32; j++) q[j] = (int8_t)(((n[j] >> shift) & 15) | (((h[j] >> bit) & 1) << 4));
}

static inline void q_q6_k_s(const uint8_t *row, int64_t c, int8_t *q) {
    const int s = (int)(c & 7), half = s >> 2, quarter = s & 3;
    const uint8_t *b = SUPER(row, c, 210), *low = b + 64 * half + 32 * (quarter & 1), *high = b + 128 + 32 * half;
    const int shift = 4 * (quarter >> 1), hshift = 2 * quarter;
    for (int j = 0; j < 32; j++) q[j] = (int8_t)((((low[j] >> shift) & 15) | (((high[j] >> hshift) & 3) << 4)) - 32);
}

#if defined(__AVX2__)
#include <immintrin.h>

static inline __m256i load32(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }

static inline uint16_t load_u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* 16 bytes -> 32 weights: their low nibbles, then their high ones (both halves hold the bytes;
 * the upper half's 32-bit lanes shift by 4, and the mask drops what crossed from the next byte) */
static inline __m256i nibbles(const uint8_t *p) {
    const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    return _mm256_and_si256(_mm256_srlv_epi32(b, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(15));
}

/* (v >> shift) & mask on each byte (a 16-bit shift: the mask drops what crossed from the next byte) */
static inline __m256i shifted(__m256i v, int shift, int mask) {
    return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8((char)mask));
}

static inline __m256i q_q4_0_v(const uint8_t *row, int64_t c) { return nibbles(LEGACY(row, c, 18) + 2); }
static inline __m256i q_q4_1_v(const uint8_t *row, int64_t c) { return nibbles(LEGACY(row, c, 20) + 4); }
static inline __m256i q_q8_0_v(const uint8_t *row, int64_t c) { return load32(LEGACY(row, c, 34) + 2); }

static inline __m256i q_q4_k_v(const uint8_t *row, int64_t c) {
    return shifted(load32(SUPER(row, c, 144) + 16 + 32 * ((c & 7) >> 1)), (int)(c & 1) * 4, 15);
}

static inline __m256i q_q5_k_v(const uint8_t *row, int64_t c) {
    const uint8_t *b = SUPER(row, c, 176);
    const __m256i low = shifted(load32(b + 48 + 32 * ((c & 7) >> 1)), (int)(c & 1) * 4, 15);
    const __m256i bit = _mm256_set1_epi8((char)(1 << (c & 7)));
    const __m256i high = _mm256_cmpeq_epi8(_mm256_and_si256(load32(b + 16), bit), bit);
    return _mm256_or_si256(low, _mm256_and_si256(high, _mm256_set1_epi8(16)));
}

static inline __m256i q_q6_k_v(const uint8_t *row, int64_t c) {
    const int s = (int)(c & 7), half = s >> 2, quarter = s & 3;
    const uint8_t *b = SUPER(row, c, 210);
    const __m256i low = shifted(load32(b + 64 * half + 32 * (quarter & 1)), 4 * (quarter >> 1), 15);
    const __m256i high = _mm256_slli_epi16(shifted(load32(b + 128 + 32 * half), 2 * quarter, 3), 4);
    return _mm256_sub_epi8(_mm256_or_si256(low, high), _mm256_set1_epi8(32));
}

/* Chunk c's scales in 8 weight rows as vectors, lane j row j's: D the scale, B the bias (the values
 * of scales_<type>) */
typedef struct {
    __m256 d, b;
} scales8;

/* the fp16 at byte `at` of each of the 8 rows */
static inline __m256 halves8(const uint8_t *const rows[8], int64_t at) {
#define H(j) (short)load_u16(rows[j] + at)
    return _mm256_cvtph_ps(_mm_setr_epi16(H(0), H(1), H(2), H(3), H(4), H(5), H(6), H(7)));
#undef H
}

static inline scales8 scales8_q4_0(const uint8_t *const rows[8], int64_t c) {
    const __m256 d = halves8(rows, 18 * c);
    return (scales8){d, _mm256_mul_ps(d, _mm256_set1_ps(-8.f))};
}

static inline scales8 scales8_q4_1(const uint8_t *const rows[8], int64_t c) {
    return (scales8){halves8(rows, 20 * c), halves8(rows, 20 * c + 2)};
}

static inline scales8 scales8_q8_0(const uint8_t *const rows[8], int64_t c) {
    return (scales8){halves8(rows, 34 * c), _mm256_setzero_ps()};
}

static inline scales8 k_scales8(const uint8_t *const rows[8], int64_t c, int64_t bytes) {  /* Q4_K, Q5_K */
    const int64_t at = (c >> 3) * bytes;
    int sc[8], mn[8];
    for (int j = 0; j < 8; j++) k_scale_min(rows[j] + at + 4, (int)(c & 7), &sc[j], &mn[j]);
    const __m256 s = _mm256_cvtepi32_ps(_mm256_setr_epi32(sc[0], sc[1], sc[2], sc[3], sc[4], sc[5], sc[6], sc[7]));
    const __m256 m = _mm256_cvtepi32_ps(_mm256_setr_epi32(mn[0], mn[1], mn[2], mn[3], mn[4], mn[5], mn[6], mn[7]));
    return (scales8){_mm256_mul_ps(halves8(rows, at), s),
                     _mm256_xor_ps(_mm256_mul_ps(halves8(rows, at + 2), m), _mm256_set1_ps(-0.f))};
}

static inline scales8 scales8_q4_k(const uint8_t *const rows[8], int64_t c) { return k_scales8(rows, c, 144); }
static inline scales8 scales8_q5_k(const uint8_t *const rows[8], int64_t c) { return k_scales8(rows, c, 176); }

static inline scales8 scales8_q6_k(const uint8_t *const rows[8], int64_t c) {
    return (scales8){halves8(rows, (c >> 3) * 210 + 208), _mm256_setzero_ps()};
}
#endif

#endif
