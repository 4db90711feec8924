/* The arithmetic of the paged-attention kernel (paged_attention.c) over one cache block's tiles:
 * scores of G query rows against a key tile (float32 tiles, or bf16 pair tiles through
 * AVX512-BF16's dot product, AVX2's in-register widening, or a float32 copy), softmax of a row of
 * scores, and the weighted sum of a value tile's rows into G accumulators. Query rows come as
 * [G][D], contiguous: G is a kv head's query heads for one token (decodes) or for a tile of tokens
 * (prefill). */
#ifndef PODIUM_ATTENTION_MATH_H
#define PODIUM_ATTENTION_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "fast_exp.h"

/* ask for a tile before it is needed (a sequence's tiles are scattered); locality 3: L1, 2: L2 */
#define prefetch_tile(p, bytes, locality)                                                             \
    do {                                                                                              \
        for (int64_t off_ = 0; off_ < (bytes); off_ += 64)                                            \
            __builtin_prefetch((const char *)(p) + off_, 0, locality);                                \
    } while (0)

/* value tiles asked into L1 this many blocks ahead of the one being summed (2: the same) */
#ifndef V_AHEAD
#define V_AHEAD 1
#endif
/* key tiles asked for this many blocks ahead of the one being scored (blocks are scattered, so the
 * hardware prefetcher cannot guess them; one block of scoring is shorter than a DRAM round trip) */
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 2
#endif

/* the largest and the sum of a vector's lanes */
#if VL == 16
static inline float hmaxv(vf v) { return _mm512_reduce_max_ps((__m512)v); }
static inline float hsumv(vf v) { return _mm512_reduce_add_ps((__m512)v); }
#else
static inline float hmaxv(vf v) {
    float top = v[0];
    for (int i = 1; i < VL; i++) top = v[i] > top ? v[i] : top;
    return top;
}
static inline float hsumv(vf v) {
    float sum = 0.f;
    for (int i = 0; i < VL; i++) sum += v[i];
    return sum;
}
#endif

/* x[0..n) <- softmax(soft_cap * tanh(x / soft_cap)) (soft_cap <= 0: no cap), in place */
static void softmax_row(float *restrict x, int64_t n, float soft_cap) {
    if (soft_cap > 0.f)
        for (int64_t j = 0; j < n; j++) x[j] = soft_cap * tanhf(x[j] / soft_cap);
    vf mv = {0};
    int64_t j = 0;
    float m = x[0];
    if (n >= VL) {
        mv = loadv(x);
        for (j = VL; j + VL <= n; j += VL) {
            mv = maxv(loadv(x + j), mv);
        }
        for (int k = 0; k < VL; k++) m = mv[k] > m ? mv[k] : m;
    }
    for (; j < n; j++) m = x[j] > m ? x[j] : m;
    vf sumv = {0};
    for (j = 0; j + VL <= n; j += VL) {
        const vf e = expv(loadv(x + j) - m);
        storev(x + j, e);
        sumv += e;
    }
    float sum = 0.f;
    for (int k = 0; k < VL; k++) sum += sumv[k];
    if (j < n) { /* the last n % VL scores through a padded copy */
        float tail[VL] = {0};
        memcpy(tail, x + j, (size_t)(n - j) * sizeof(float));
        const vf e = expv(loadv(tail) - m);
        for (int64_t k = 0; k < n - j; k++) sum += (x[j + k] = e[k]);
    }
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t k = 0; k < n; k++) x[k] *= inv;
}

/* row[g * B + t] = q_g . k_t for one key tile kt [D][B] (keys transposed); qf [G][D] */
static void tile_scores(const float *restrict qf, const float *restrict kt, float *restrict row,
                        int64_t G, int64_t D, int64_t B) {
    for (int64_t g = 0; g < G; g++) {
        const float *restrict qg = qf + g * D;
        if (B % VL == 0) { /* VL keys per vector; four independent chains over d */
            for (int64_t t = 0; t < B; t += VL) {
                vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
                int64_t d = 0;
                for (; d + 4 <= D; d += 4) {
                    a0 += qg[d] * loadv(kt + d * B + t);
                    a1 += qg[d + 1] * loadv(kt + (d + 1) * B + t);
                    a2 += qg[d + 2] * loadv(kt + (d + 2) * B + t);
                    a3 += qg[d + 3] * loadv(kt + (d + 3) * B + t);
                }
                for (; d < D; d++) a0 += qg[d] * loadv(kt + d * B + t);
                storev(row + g * B + t, (a0 + a1) + (a2 + a3));
            }
        } else {
            for (int64_t t = 0; t < B; t++) row[g * B + t] = 0.f;
            for (int64_t d = 0; d < D; d++)
                for (int64_t t = 0; t < B; t++) row[g * B + t] += qg[d] * kt[d * B + t];
        }
    }
}

/* A bf16 pair tile [D/2][B][2] widened to the float32 tile [D][B] */
static void widen_pairs(const bf16_t *restrict kt, float *restrict out, int64_t D, int64_t B) {
    for (int64_t p = 0; p < D / 2; p++) {
        const bf16_t *src = kt + p * 2 * B;
        float *even = out + 2 * p * B, *odd = even + B;
        for (int64_t t = 0; t < B; t++) {
            even[t] = bf16_to_f32(src[2 * t]);
            odd[t] = bf16_to_f32(src[2 * t + 1]);
        }
    }
}

#ifdef __AVX512BF16__
static inline __m512 pair_broadcast(const bf16_t *q) { /* q[0], q[1] as one 32-bit pair in every lane */
    uint32_t u;
    memcpy(&u, q, sizeof u);
    return (__m512)_mm512_set1_epi32((int)u);
}

/* row[g * B + t + i] for i < 16 and GS heads from g0: vdpbf16ps, 16 keys x one (d, d+1) pair per
 * instruction, two chains (even and odd pairs) per head, every head in flight at once */
static inline __attribute__((always_inline)) void pair_scores_block(
    const bf16_t *restrict q, const bf16_t *restrict kt, float *restrict row, int64_t D, int64_t B, int64_t t,
    int64_t g0, const int GS) {
    __m512 a[4][2];
    for (int g = 0; g < GS; g++) a[g][0] = a[g][1] = _mm512_setzero_ps();
    int64_t p = 0;
    for (; p + 2 <= D / 2; p += 2) {
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + p * 2 * B + 2 * t);
        const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kt + (p + 1) * 2 * B + 2 * t);
        for (int g = 0; g < GS; g++) {
            const bf16_t *qg = q + (g0 + g) * D + 2 * p;
            a[g][0] = _mm512_dpbf16_ps(a[g][0], k0, (__m512bh)pair_broadcast(qg));
            a[g][1] = _mm512_dpbf16_ps(a[g][1], k1, (__m512bh)pair_broadcast(qg + 2));
        }
    }
    if (p < D / 2) {
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + p * 2 * B + 2 * t);
        for (int g = 0; g < GS; g++)
            a[g][0] = _mm512_dpbf16_ps(a[g][0], k0, (__m512bh)pair_broadcast(q + (g0 + g) * D + 2 * p));
    }
    for (int g = 0; g < GS; g++) _mm512_storeu_ps(row + (g0 + g) * B + t, _mm512_add_ps(a[g][0], a[g][1]));
}
#endif

#if !defined(__AVX512BF16__) && defined(__AVX2__) && VL == 8
/* row[g * B + t + i] for i < 8 and GS heads from g0 on AVX2: a 32-bit pair word (d even | d odd)
 * widens with one shift (even) and one mask (odd) in registers, so the tile is never widened into
 * memory, and every head of the group uses the same widened keys. The FMAs and their order are
 * tile_scores' over the widened tile (chains d % 4, then (a0 + a1) + (a2 + a3)): the same bits. */
static inline __attribute__((always_inline)) void pair_scores_block_avx2(
    const float *restrict qf, const bf16_t *restrict kt, float *restrict row, int64_t D, int64_t B, int64_t t,
    int64_t g0, const int GS) {
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    __m256 a[3][4];
    for (int g = 0; g < GS; g++) a[g][0] = a[g][1] = a[g][2] = a[g][3] = _mm256_setzero_ps();
    int64_t p = 0;
    for (; p + 2 <= D / 2; p += 2) {
        for (int half = 0; half < 2; half++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(kt + (p + half) * 2 * B + 2 * t));
            const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
            const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(w, high));
            for (int g = 0; g < GS; g++) {
                const float *qg = qf + (g0 + g) * D + 2 * (p + half);
                a[g][2 * half] = _mm256_fmadd_ps(_mm256_set1_ps(qg[0]), even, a[g][2 * half]);
                a[g][2 * half + 1] = _mm256_fmadd_ps(_mm256_set1_ps(qg[1]), odd, a[g][2 * half + 1]);
            }
        }
    }
    if (p < D / 2) { /* D % 4 == 2: the last pair into the first chain, as tile_scores' remainder */
        const __m256i w = _mm256_loadu_si256((const __m256i *)(kt + p * 2 * B + 2 * t));
        const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
        const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(w, high));
        for (int g = 0; g < GS; g++) {
            const float *qg = qf + (g0 + g) * D + 2 * p;
            a[g][0] = _mm256_fmadd_ps(_mm256_set1_ps(qg[1]), odd, _mm256_fmadd_ps(_mm256_set1_ps(qg[0]), even, a[g][0]));
        }
    }
    for (int g = 0; g < GS; g++)
        _mm256_storeu_ps(row + (g0 + g) * B + t,
                         _mm256_add_ps(_mm256_add_ps(a[g][0], a[g][1]), _mm256_add_ps(a[g][2], a[g][3])));
}
#endif

/* row[g * B + t] = q_g . k_t for a bf16 pair tile; q [G][D] bf16, qf the same widened */
static void tile_scores_pairs(const bf16_t *restrict q, const float *restrict qf, const bf16_t *restrict kt,
                              float *restrict tile, float *restrict row, int64_t G, int64_t D, int64_t B) {
#ifdef __AVX512BF16__
    if ((B & 15) == 0) {
        for (int64_t t = 0; t < B; t += 16)
            for (int64_t g = 0; g < G; g += 4) {
                const int64_t gs = G - g < 4 ? G - g : 4;
                if (gs == 4) pair_scores_block(q, kt, row, D, B, t, g, 4);
                else if (gs == 3) pair_scores_block(q, kt, row, D, B, t, g, 3);
                else if (gs == 2) pair_scores_block(q, kt, row, D, B, t, g, 2);
                else pair_scores_block(q, kt, row, D, B, t, g, 1);
            }
        return;
    }
#elif defined(__AVX2__) && VL == 8
    if ((B & 7) == 0 && (D & 1) == 0) {
        for (int64_t t = 0; t < B; t += 8)
            for (int64_t g = 0; g < G; g += 3) {
                const int64_t gs = G - g < 3 ? G - g : 3;
                if (gs == 3) pair_scores_block_avx2(qf, kt, row, D, B, t, g, 3);
                else if (gs == 2) pair_scores_block_avx2(qf, kt, row, D, B, t, g, 2);
                else pair_scores_block_avx2(qf, kt, row, D, B, t, g, 1);
            }
        return;
    }
#endif
    (void)q;
    widen_pairs(kt, tile, D, B);
    tile_scores(qf, tile, row, G, D, B);
}

#if VL == 16
/* A decode item's scores, several 16-key units of its key tiles (unit[u]: 16 consecutive keys of a
 * tile, their d pairs / dims `ps` elements apart) for GS query heads from g0 at once: each key load
 * serves every head and each query broadcast every unit, where scoring a block at a time reloads
 * the keys for each head (pair_scores_block) or each head for each key (tile_scores). Every (unit,
 * head) keeps the chains of those functions in their order, so the sums are the same bits; the
 * scaled scores go straight to the item's score rows (dst[u] + g * n, lanes mask[u]: the keys the
 * query sees). NU and GS are constants after inlining. */
#ifdef __AVX512BF16__
static inline __attribute__((always_inline)) void pair_scores_units(
    const bf16_t *restrict q, const bf16_t *const *unit, int64_t ps, float *const *dst, const __mmask16 *mask,
    int64_t n, int64_t D, int64_t g0, float scale, const int GS, const int NU) {
    __m512 a[2][4][2];
    for (int u = 0; u < NU; u++)
        for (int g = 0; g < GS; g++) a[u][g][0] = a[u][g][1] = _mm512_setzero_ps();
    int64_t p = 0;
    for (; p + 2 <= D / 2; p += 2) {
        __m512bh k0[2], k1[2];
        for (int u = 0; u < NU; u++) {
            k0[u] = (__m512bh)_mm512_loadu_si512(unit[u] + p * ps);
            k1[u] = (__m512bh)_mm512_loadu_si512(unit[u] + (p + 1) * ps);
        }
        for (int g = 0; g < GS; g++) {
            const bf16_t *qg = q + (g0 + g) * D + 2 * p;
            const __m512bh qa = (__m512bh)pair_broadcast(qg), qb = (__m512bh)pair_broadcast(qg + 2);
            for (int u = 0; u < NU; u++) {
                a[u][g][0] = _mm512_dpbf16_ps(a[u][g][0], k0[u], qa);
                a[u][g][1] = _mm512_dpbf16_ps(a[u][g][1], k1[u], qb);
            }
        }
    }
    if (p < D / 2)
        for (int g = 0; g < GS; g++) {
            const __m512bh qa = (__m512bh)pair_broadcast(q + (g0 + g) * D + 2 * p);
            for (int u = 0; u < NU; u++)
                a[u][g][0] = _mm512_dpbf16_ps(a[u][g][0], (__m512bh)_mm512_loadu_si512(unit[u] + p * ps), qa);
        }
    const __m512 sc = _mm512_set1_ps(scale);
    for (int u = 0; u < NU; u++)
        for (int g = 0; g < GS; g++)
            _mm512_mask_storeu_ps(dst[u] + (g0 + g) * n, mask[u], _mm512_mul_ps(_mm512_add_ps(a[u][g][0], a[u][g][1]), sc));
}
#endif

/* The float32 form: key tiles [D][B], qf [G][D]; tile_scores' four chains (d mod 4) a (unit, head),
 * added as (a0 + a1) + (a2 + a3) */
static inline __attribute__((always_inline)) void f32_scores_units(
    const float *restrict qf, const float *const *unit, int64_t ps, float *const *dst, const __mmask16 *mask,
    int64_t n, int64_t D, int64_t g0, float scale, const int GS, const int NU) {
    __m512 a[2][3][4];
    for (int u = 0; u < NU; u++)
        for (int g = 0; g < GS; g++) a[u][g][0] = a[u][g][1] = a[u][g][2] = a[u][g][3] = _mm512_setzero_ps();
    int64_t d = 0;
    for (; d + 4 <= D; d += 4)
        for (int c = 0; c < 4; c++) {
            __m512 k[2];
            for (int u = 0; u < NU; u++) k[u] = _mm512_loadu_ps(unit[u] + (d + c) * ps);
            for (int g = 0; g < GS; g++) {
                const __m512 qv = _mm512_set1_ps(qf[(g0 + g) * D + d + c]);
                for (int u = 0; u < NU; u++) a[u][g][c] = _mm512_fmadd_ps(qv, k[u], a[u][g][c]);
            }
        }
    for (; d < D; d++) {
        __m512 k[2];
        for (int u = 0; u < NU; u++) k[u] = _mm512_loadu_ps(unit[u] + d * ps);
        for (int g = 0; g < GS; g++) {
            const __m512 qv = _mm512_set1_ps(qf[(g0 + g) * D + d]);
            for (int u = 0; u < NU; u++) a[u][g][0] = _mm512_fmadd_ps(qv, k[u], a[u][g][0]);
        }
    }
    const __m512 sc = _mm512_set1_ps(scale);
    for (int u = 0; u < NU; u++)
        for (int g = 0; g < GS; g++) {
            const __m512 sum = _mm512_add_ps(_mm512_add_ps(a[u][g][0], a[u][g][1]), _mm512_add_ps(a[u][g][2], a[u][g][3]));
            _mm512_mask_storeu_ps(dst[u] + (g0 + g) * n, mask[u], _mm512_mul_ps(sum, sc));
        }
}
#endif

/* VL values as float32: float data as is, bf16 widened (a 16-bit shift) */
static inline vf loadv_f32(const float *p) { return loadv(p); }

/* acc[g][d0 + VL j] += sum over t in [t0, t1) of w[g * n + shift + t] * v_t[d0 + VL j], for GS heads
 * from g0 and NV vectors from d0: GS * NV independent accumulators per value row, so the FMAs of one
 * row overlap instead of waiting on each other (one accumulator per chain is latency-bound). GS and
 * NV are constants after inlining: the accumulators live in registers. */
#define DEFINE_ACC_BLOCK(NAME, T, LOADV)                                                              \
static inline __attribute__((always_inline)) void NAME(                                               \
    const float *restrict w, int64_t n, int64_t shift, const T *restrict vt, float *restrict acc,     \
    int64_t D, int64_t t0, int64_t t1, int64_t g0, int64_t d0, const int GS, const int NV) {          \
    vf a[4][4];                                                                                     \
    for (int g = 0; g < GS; g++)                                                                      \
        for (int j = 0; j < NV; j++) a[g][j] = loadv(acc + (g0 + g) * D + d0 + VL * j);              \
    for (int64_t t = t0; t < t1; t++) {                                                               \
        vf v[4];                                                                                    \
        for (int j = 0; j < NV; j++) v[j] = LOADV(vt + t * D + d0 + VL * j);                          \
        for (int g = 0; g < GS; g++) {                                                                \
            const float wt = w[(g0 + g) * n + shift + t];                                             \
            for (int j = 0; j < NV; j++) a[g][j] += wt * v[j];                                        \
        }                                                                                             \
    }                                                                                                 \
    for (int g = 0; g < GS; g++)                                                                      \
        for (int j = 0; j < NV; j++) storev(acc + (g0 + g) * D + d0 + VL * j, a[g][j]);              \
}
DEFINE_ACC_BLOCK(acc_block_f32, float, loadv_f32)
DEFINE_ACC_BLOCK(acc_block_bf16, bf16_t, loadv_bf16)

#if VL == 16
#define ACC_NV 4
#else
#define ACC_NV 2
#endif

/* acc[g] += sum over t in [t0, t1) of w[g * n + shift + t] * v_t, for one value tile vt [B][D]:
 * blocks of up to 3 heads x ACC_NV vectors, then one-vector remainders; D not a multiple of VL:
 * scalar. 3 x ACC_NV accumulators and ACC_NV value vectors fit the registers (32 zmm with AVX-512;
 * 16 ymm with AVX2, where 3 x 4 would spill). */
#define DEFINE_ACCUMULATE(NAME, T, BLOCK, LOAD)                                                       \
static void NAME(const float *restrict w, int64_t n, int64_t shift, const T *restrict vt,             \
                 float *restrict acc, int64_t G, int64_t D, int64_t t0, int64_t t1) {                 \
    if (D % VL == 0) {                                                                                \
        for (int64_t g = 0; g < G; g += 3) {                                                          \
            const int64_t gs = G - g < 3 ? G - g : 3;                                                 \
            int64_t d = 0;                                                                            \
            for (; d + VL * ACC_NV <= D; d += VL * ACC_NV) {                                          \
                if (gs == 3) BLOCK(w, n, shift, vt, acc, D, t0, t1, g, d, 3, ACC_NV);                 \
                else if (gs == 2) BLOCK(w, n, shift, vt, acc, D, t0, t1, g, d, 2, ACC_NV);            \
                else BLOCK(w, n, shift, vt, acc, D, t0, t1, g, d, 1, ACC_NV);                         \
            }                                                                                         \
            for (; d < D; d += VL) {                                                                  \
                if (gs == 3) BLOCK(w, n, shift, vt, acc, D, t0, t1, g, d, 3, 1);                      \
                else if (gs == 2) BLOCK(w, n, shift, vt, acc, D, t0, t1, g, d, 2, 1);                 \
                else BLOCK(w, n, shift, vt, acc, D, t0, t1, g, d, 1, 1);                              \
            }                                                                                         \
        }                                                                                             \
        return;                                                                                       \
    }                                                                                                 \
    for (int64_t g = 0; g < G; g++)                                                                   \
        for (int64_t t = t0; t < t1; t++) {                                                           \
            const float wt = w[g * n + shift + t];                                                    \
            for (int64_t d = 0; d < D; d++) acc[g * D + d] += wt * LOAD(vt[t * D + d]);               \
        }                                                                                             \
}
DEFINE_ACCUMULATE(tile_accumulate_f32, float, acc_block_f32, load_f32)
DEFINE_ACCUMULATE(tile_accumulate_bf16, bf16_t, acc_block_bf16, bf16_to_f32)

/* scores of key tile kt into row: float32 tiles directly, bf16 pair tiles through tile_scores_pairs */
#define SCORES_F32(q, qf, kt, tile, row, G, D, B) tile_scores(qf, kt, row, G, D, B)
#define SCORES_BF16(q, qf, kt, tile, row, G, D, B) tile_scores_pairs(q, qf, kt, tile, row, G, D, B)

#define RESCALE_MARGIN 8.f

/* One query row of a flash tile meets one key block (online softmax): x[t0..t1) are the row's raw
 * scores of the block's keys, of which [a, e) are visible to it (a < e). Scales and caps the visible
 * ones, then rewrites x[t0..t1) as the weights e^(x - m') (0 where not visible) with m' the row's
 * running max *m (-inf before its first visible key), raised to the block's visible max if that is
 * more than RESCALE_MARGIN above it;
 * adds the weights to *l, sets *m = m', and returns e^(m - m'), the factor the row's earlier sums
 * (and *l before the addition) must be scaled by. VL scores at a time, lanes outside [a, e) masked;
 * reads up to VL - 1 floats past x[t1) (the caller's scratch has them), writes none. */
static inline float online_softmax_row(float *restrict x, int64_t t0, int64_t t1, int64_t a, int64_t e,
                                       float scale, float soft_cap, float *restrict m, float *restrict l) {
    if (soft_cap > 0.f)
        for (int64_t t = a; t < e; t++) x[t] = soft_cap * tanhf(x[t] * scale / soft_cap);
    const float factor = soft_cap > 0.f ? 1.f : scale;
    vi lane;
    for (int i = 0; i < VL; i++) lane[i] = i;
    const vf zero = {0}, low = zero - INFINITY;
    /* the vectors start at a multiple of VL, not at t0: key t is always in lane t % VL, so the sum's
     * lanes (and its horizontal sum's order) do not depend on where the tile's first visible key falls,
     * which a sliding window moves with the tile's first row (a row's result must not depend on how its
     * prompt was chunked); the lanes below t0 are outside [a, e) and weigh 0 */
    const int64_t c0 = t0 - t0 % VL;
    vf top = low;
    for (int64_t c = c0; c < t1; c += VL) {
        const vi at = lane + (int32_t)c, visible = (at >= (int32_t)a) & (at < (int32_t)e);
        top = maxv(top, selectv(visible, loadv(x + c) * factor, low));
    }
    /* the running max moves only when the block's exceeds it by RESCALE_MARGIN: weights up to
     * e^RESCALE_MARGIN relative to it are exact in float32, and most blocks skip the rescaling */
    const float block_max = hmaxv(top);
    const float m_new = block_max > *m + RESCALE_MARGIN ? block_max : *m;
    const float alpha = m_new == *m ? 1.f : *m == -INFINITY ? 0.f : expf(*m - m_new);
    vf sum = zero;
    for (int64_t c = c0; c < t1; c += VL) {
        const vi at = lane + (int32_t)c, visible = (at >= (int32_t)a) & (at < (int32_t)e);
        const vf w = selectv(visible, expv(selectv(visible, loadv(x + c) * factor - m_new, zero + EXP_LO)), zero);
        if (c + VL <= t1)
            storev(x + c, w);
        else /* the row's last lanes: the next row's scores follow */
            for (int64_t i = 0; i < t1 - c; i++) x[c + i] = w[i];
        sum += w;
    }
    *l = *l * alpha + hsumv(sum);
    *m = m_new;
    return alpha;
}

/* rows t0..t1 of a bf16 value tile [B][D] widened into vt [B][D] (float32); returns vt */
static inline const float *widen_rows(const bf16_t *restrict v, float *restrict vt, int64_t t0, int64_t t1, int64_t D) {
    int64_t i = t0 * D;
    for (; i + VL <= t1 * D; i += VL) storev(vt + i, loadv_bf16(v + i));
    for (; i < t1 * D; i++) vt[i] = bf16_to_f32(v[i]);
    return vt;
}

/* Weighted sums of a float32 value tile's rows t0..t1 into R accumulators: acc[r] += w[r][t] v_t */
static inline void weigh_values_f32(const float *w, const float *v, float *vt, float *acc, int64_t R, int64_t D,
                                    int64_t B, int64_t t0, int64_t t1) {
    (void)vt;
    tile_accumulate_f32(w, B, 0, v, acc, R, D, t0, t1);
}

#ifdef __AVX512BF16__
/* rows r0..r0 + NR of acc [R][D] (NV vectors of 16 a row) += sum over key pairs j in [j0, j1) of the
 * row's bf16 weight pair j (pb, row stride ps elements) dot the value pair tile vp [B/2][D][2]: each
 * vdpbf16ps adds two keys' weighted values to 16 dims. NR, NV constants after inlining. */
static inline __attribute__((always_inline)) void weigh_pairs(float *restrict acc, const bf16_t *restrict pb,
                                                              int64_t ps, const bf16_t *restrict vp, int64_t D,
                                                              int64_t j0, int64_t j1, int64_t r0, const int NR,
                                                              const int NV) {
    __m512 a[8][8];
    for (int r = 0; r < NR; r++)
        for (int v = 0; v < NV; v++) a[r][v] = _mm512_loadu_ps(acc + (r0 + r) * D + 16 * v);
    for (int64_t j = j0; j < j1; j++) {
        __m512bh vv[8];
        for (int v = 0; v < NV; v++) vv[v] = (__m512bh)_mm512_loadu_si512(vp + j * 2 * D + 32 * v);
        for (int r = 0; r < NR; r++) {
            int32_t pair;
            memcpy(&pair, pb + (r0 + r) * ps + 2 * j, sizeof pair);
            const __m512bh w = (__m512bh)_mm512_set1_epi32(pair);
            for (int v = 0; v < NV; v++) a[r][v] = _mm512_dpbf16_ps(a[r][v], vv[v], w);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int v = 0; v < NV; v++) _mm512_storeu_ps(acc + (r0 + r) * D + 16 * v, a[r][v]);
}

/* vpermt2w indices putting dims d of key rows a and b side by side: dims 0-15 (LO), 16-31 (HI) */
static const int16_t PAIR_LO[32] __attribute__((aligned(64))) = {
    0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
    8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
static const int16_t PAIR_HI[32] __attribute__((aligned(64))) = {
    16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
    24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};

/* dst [D][2] = (a[d], b[d]): two keys' value rows as one vdpbf16ps operand a dim; D a multiple of 32 */
static inline void interleave_key_pair(const bf16_t *restrict a, const bf16_t *restrict b, bf16_t *restrict dst,
                                       int64_t D) {
    const __m512i lo = _mm512_load_si512(PAIR_LO), hi = _mm512_load_si512(PAIR_HI);
    for (int64_t d = 0; d < D; d += 32) {
        const __m512i x = _mm512_loadu_si512(a + d), y = _mm512_loadu_si512(b + d);
        _mm512_storeu_si512(dst + 2 * d, _mm512_permutex2var_epi16(x, lo, y));
        _mm512_storeu_si512(dst + 2 * d + 32, _mm512_permutex2var_epi16(x, hi, y));
    }
}

/* all R rows, NV = D / 16 vectors a row, in groups of as many rows as the registers hold */
#define WEIGH_PAIRS_ROWS(NR, NV)                                                                      \
    for (; r + NR <= R; r += NR) weigh_pairs(acc, pb, ps, vp, D, j0, j1, r, NR, NV);                  \
    for (; r < R; r++) weigh_pairs(acc, pb, ps, vp, D, j0, j1, r, 1, NV);
#endif

/* Weighted sums of a bf16 value tile's rows t0..t1 into R accumulators: acc[r] += w[r][t] v_t. With
 * AVX512-BF16 (D a multiple of 32, B of 16): each row's weights rounded to bf16 (as torch's CPU
 * flash attention rounds them for its bf16 matmul) and summed with vdpbf16ps over pairs of keys, the
 * value tile interleaved once into key pairs (vt's memory); w's rows are overwritten. Else the
 * rows widened to float32 once and float32 FMAs. */
static inline void weigh_values_bf16(float *w, const bf16_t *v, float *vt, float *acc, int64_t R, int64_t D,
                                     int64_t B, int64_t t0, int64_t t1) {
#ifdef __AVX512BF16__
    if (D % 32 == 0 && D <= 128 && B % 16 == 0) {
        bf16_t *vp = (bf16_t *)vt, *pb = (bf16_t *)w;
        const int64_t j0 = t0 / 2, j1 = (t1 + 1) / 2, ps = 2 * B; /* pb: each row's bf16 in its own floats */
        for (int64_t j = j0; j < j1; j++) interleave_key_pair(v + 2 * j * D, v + (2 * j + 1) * D, vp + j * 2 * D, D);
        for (int64_t r = 0; r < R; r++) /* weights outside [t0, t1) are 0; in place, 16 at a time */
            for (int64_t c = 0; c < B; c += 16) {
                const int64_t first = t0 - c < 0 ? 0 : t0 - c < 16 ? t0 - c : 16, end = t1 - c < 0 ? 0 : t1 - c < 16 ? t1 - c : 16;
                const __mmask16 in = (__mmask16)(((1u << end) - 1) & ~((1u << first) - 1)); /* lanes [first, end) */
                const __m512 x = _mm512_maskz_loadu_ps(in, w + r * B + c);
                _mm256_storeu_si256((__m256i *)(pb + r * ps + c), (__m256i)_mm512_cvtneps_pbh(x));
            }
        int64_t r = 0;
        switch (D / 16) {
            case 2: WEIGH_PAIRS_ROWS(8, 2) break;
            case 4: WEIGH_PAIRS_ROWS(5, 4) break;
            case 6: WEIGH_PAIRS_ROWS(3, 6) break;
            default: WEIGH_PAIRS_ROWS(2, 8) break;
        }
        return;
    }
#endif
    tile_accumulate_f32(w, B, 0, widen_rows(v, vt, t0, t1, D), acc, R, D, t0, t1);
}

#endif
