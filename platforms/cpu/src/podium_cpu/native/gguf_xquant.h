/* The activations of gguf_linear.c quantized as llama.cpp does: each x row to int8 per 32 values (a
 * "chunk"), x ~ d q with d = max|x| / 127 and q = round(x / d) (to nearest even), and s = d sum(q)
 * for the formats whose weights carry a bias term. Two layouts of the same bytes:
 *
 *     rows  (the AVX2 paths): q [M][K]; d, s [M][Cp]
 *     tiles (the AMX path):   q [M/16][C][8][16][4]: per 16 rows and chunk, AMX's B operand (row t:
 *                             the t-th 4 values of each of the 16 rows side by side); d, s [C][Mp]
 *
 * (C = K / 32 chunks, Cp rounded up to 8, Mp = M rounded up to 16; the padding's q, d and s are 0).
 * Included by gguf_linear.c only. */
#ifndef PODIUM_GGUF_XQUANT_H
#define PODIUM_GGUF_XQUANT_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "scratch.h"

/* x quantized: q int8 [M][K]; d and s = d * sum(q), float32 [M][Cp] (padded_chunks: the missing
 * chunks' values 0) */
typedef struct {
    int8_t *q;
    float *d, *s;
} xquant;

/* chunks of a row rounded up to whole groups of 8 (the scales' vectors) */
static inline int64_t padded_chunks(int64_t K) { return (K / 32 + 7) / 8 * 8; }

/* A second per-thread buffer for the quantized x rows: the calling thread is also one of the team
 * whose thread_scratch holds a batch's unpacked weights. */
DEFINE_THREAD_SCRATCH(x_scratch)

/* 32 float32 values -> q, d, d * sum(q) */
static inline void quantize_chunk(const float *x, int8_t *q, float *d_out, float *s_out) {
#if defined(__AVX2__)
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(x + 8 * i), amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float d = _mm_cvtss_f32(m) / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    __m256i n[4], sum = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));  /* MXCSR: to nearest even */
        sum = _mm256_add_epi32(sum, n[i]);
    }
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    *d_out = d, *s_out = d * (float)_mm_cvtsi128_si32(s);
#else
    float amax = 0.f;
    for (int j = 0; j < 32; j++) amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
    const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    int sum = 0;
    for (int j = 0; j < 32; j++) q[j] = (int8_t)nearbyintf(x[j] * id), sum += q[j];
    *d_out = d, *s_out = d * (float)sum;
#endif
}

/* chunk c of x row m as float32: the row itself, or its bf16 values widened into buf */
static inline const float *x_chunk(const void *x, int64_t x_stride, int64_t m, int64_t c, int is_bf16, float buf[32]) {
    if (!is_bf16) return (const float *)x + m * x_stride + 32 * c;
    for (int j = 0; j < 32; j++) buf[j] = bf16_to_f32(((const bf16_t *)x)[m * x_stride + 32 * c + j]);
    return buf;
}

/* x rows (float32 or bf16) -> the calling thread's xquant; 0, or -1 without memory */
static int quantize_rows(const void *x, int64_t x_stride, int64_t M, int64_t K, int is_bf16, int num_threads,
                         xquant *xq) {
    const int64_t C = K / 32, Cp = padded_chunks(K);
    char *mem = x_scratch((size_t)M * K + 2 * (size_t)M * Cp * sizeof(float));
    if (!mem) return -1;
    xq->d = (float *)mem, xq->s = xq->d + M * Cp, xq->q = (int8_t *)(xq->s + M * Cp);
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (M >= 16)")
    for (int64_t m = 0; m < M; m++) {
        for (int64_t c = 0; c < C; c++) {
            float buf[32];
            quantize_chunk(x_chunk(x, x_stride, m, c, is_bf16, buf), xq->q + m * K + 32 * c, xq->d + m * Cp + c,
                           xq->s + m * Cp + c);
        }
        for (int64_t c = C; c < Cp; c++) xq->d[m * Cp + c] = xq->s[m * Cp + c] = 0.f;
    }
    return 0;
}

/* x quantized in the tiles layout */
typedef struct {
    int8_t *q;
    float *d, *s;
    int64_t Mp;
} xtiles;

/* x rows (float32 or bf16) -> the calling thread's xtiles; 0, or -1 without memory */
static inline int quantize_tiles(const void *x, int64_t x_stride, int64_t M, int64_t K, int is_bf16, int num_threads,
                                 xtiles *xt) {
    const int64_t C = K / 32, Mp = (M + 15) / 16 * 16;
    char *mem = x_scratch((size_t)Mp * K + 2 * (size_t)Mp * C * sizeof(float));
    if (!mem) return -1;
    xt->Mp = Mp, xt->d = (float *)mem, xt->s = xt->d + Mp * C, xt->q = (int8_t *)(xt->s + Mp * C);
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (M >= 16)")
    for (int64_t m = 0; m < Mp; m++) {
        int8_t *tile = xt->q + (m / 16) * C * 512 + 4 * (m % 16);  /* chunk c, row t: + 512 c + 64 t */
        for (int64_t c = 0; c < C; c++) {
            int8_t q[32] = {0};
            float buf[32], d = 0.f, s = 0.f;
            if (m < M) quantize_chunk(x_chunk(x, x_stride, m, c, is_bf16, buf), q, &d, &s);
            for (int t = 0; t < 8; t++) memcpy(tile + 512 * c + 64 * t, q + 4 * t, 4);
            xt->d[c * Mp + m] = d, xt->s[c * Mp + m] = s;
        }
    }
    return 0;
}

#endif
