/* GGUF blocks dequantized to float32, one block at a time, with the arithmetic of
 * podium_plugin_api.gguf_blocks._dequantize_blocks (so the embedding's rows are bit-exact with
 * gguf-py's dequantize: built with -ffp-contract=off, a product and a sum round separately), and the
 * scalar pieces the integer unpacking (gguf_unpack.h) shares: fp16 scales, K-quant scales and mins. */
#ifndef PODIUM_GGUF_DEQUANT_H
#define PODIUM_GGUF_DEQUANT_H

#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

/* fp16 -> float32, exact (normals, subnormals, infinities, NaN): one F16C instruction where the
 * CPU has it (every AVX2 CPU does), else by bits; a block's scales are converted once per block */
static inline float half_to_f32(const uint8_t *p) {
    const uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#if defined(__F16C__)
    return _cvtsh_ss(h);
#endif
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else { /* zero or subnormal: mant * 2^-24 */
        float f = (float)mant * 5.9604644775390625e-8f;
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* One block of each format -> float32 weights (the arithmetic of gguf_blocks._dequantize_blocks) */
static void block_q8_0(const uint8_t *b, float *y) {
    const float d = half_to_f32(b);
    const int8_t *q = (const int8_t *)(b + 2);
    for (int j = 0; j < 32; j++) y[j] = d * (float)q[j];
}

static void block_q4_0(const uint8_t *b, float *y) {
    const float d = half_to_f32(b);
    for (int j = 0; j < 16; j++) y[j] = d * (float)((b[2 + j] & 0x0f) - 8);
    for (int j = 0; j < 16; j++) y[j + 16] = d * (float)((b[2 + j] >> 4) - 8);
}

static void block_q4_1(const uint8_t *b, float *y) {
    const float d = half_to_f32(b), m = half_to_f32(b + 2);
    for (int j = 0; j < 16; j++) y[j] = d * (float)(b[4 + j] & 0x0f) + m;
    for (int j = 0; j < 16; j++) y[j + 16] = d * (float)(b[4 + j] >> 4) + m;
}

/* Q4_K/Q5_K's 6-bit scale and min of sub-block j from the 12 packed bytes */
static inline void k_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63, *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

static void block_q4_k(const uint8_t *b, float *y) {
    const float d = half_to_f32(b), dmin = half_to_f32(b + 2);
    const uint8_t *scales = b + 4, *qs = b + 16;
    for (int i = 0; i < 4; i++) {  /* 64 weights: 32 low nibbles (sub-block 2i), 32 high (2i+1) */
        int sc0, m0, sc1, m1;
        k_scale_min(scales, 2 * i, &sc0, &m0);
        k_scale_min(scales, 2 * i + 1, &sc1, &m1);
        const float d0 = d * (float)sc0, min0 = dmin * (float)m0, d1 = d * (float)sc1, min1 = dmin * (float)m1;
        for (int l = 0; l < 32; l++) y[64 * i + l] = d0 * (float)(qs[32 * i + l] & 0x0f) - min0;
        for (int l = 0; l < 32; l++) y[64 * i + 32 + l] = d1 * (float)(qs[32 * i + l] >> 4) - min1;
    }
}

static void block_q5_k(const uint8_t *b, float *y) {
    const float d = half_to_f32(b), dmin = half_to_f32(b + 2);
    const uint8_t *scales = b + 4, *qh = b + 16, *qs = b + 48;
    for (int i = 0; i < 4; i++) {  /* sub-block j takes bit j of each high byte as its bit 4 */
        int sc0, m0, sc1, m1;
        k_scale_min(scales, 2 * i, &sc0, &m0);
        k_scale_min(scales, 2 * i + 1, &sc1, &m1);
        const float d0 = d * (float)sc0, min0 = dmin * (float)m0, d1 = d * (float)sc1, min1 = dmin * (float)m1;
        for (int l = 0; l < 32; l++) {
            const int lo = (qs[32 * i + l] & 0x0f) | (((qh[l] >> (2 * i)) & 1) << 4);
            const int hi = (qs[32 * i + l] >> 4) | (((qh[l] >> (2 * i + 1)) & 1) << 4);
            y[64 * i + l] = d0 * (float)lo - min0;
            y[64 * i + 32 + l] = d1 * (float)hi - min1;
        }
    }
}

static void block_q6_k(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = half_to_f32(b + 208);
    for (int h = 0; h < 2; h++) {  /* halves of 128: quarter q of a half is ql's low/high nibbles, qh's bits 2q */
        for (int l = 0; l < 32; l++) {
            const int q1 = ((ql[64 * h + l] & 0x0f) | (((qh[32 * h + l] >> 0) & 3) << 4)) - 32;
            const int q2 = ((ql[64 * h + l + 32] & 0x0f) | (((qh[32 * h + l] >> 2) & 3) << 4)) - 32;
            const int q3 = ((ql[64 * h + l] >> 4) | (((qh[32 * h + l] >> 4) & 3) << 4)) - 32;
            const int q4 = ((ql[64 * h + l + 32] >> 4) | (((qh[32 * h + l] >> 6) & 3) << 4)) - 32;
            const int s = 8 * h + l / 16;
            y[128 * h + l] = d * (float)sc[s] * (float)q1;
            y[128 * h + l + 32] = d * (float)sc[s + 2] * (float)q2;
            y[128 * h + l + 64] = d * (float)sc[s + 4] * (float)q3;
            y[128 * h + l + 96] = d * (float)sc[s + 6] * (float)q4;
        }
    }
}

typedef void (*block_fn)(const uint8_t *, float *);

#endif
