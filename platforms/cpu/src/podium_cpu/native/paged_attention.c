/* Paged attention of a flat ragged batch on the CPU, reading K/V straight through the block tables.
 *
 * Cache layout (one layer; H_kv kv heads, block size B, head size D):
 *
 *     float32 key_cache   [num_blocks, H_kv, D, B]       each (block, head) tile transposed: for a
 *                                                        fixed d, the block's B keys are contiguous
 *     bf16    key_cache   [num_blocks, H_kv, D/2, B, 2]  the same, with dims d and d+1 of a key
 *                                                        side by side (one 32-bit pair)
 *             value_cache [num_blocks, H_kv, B, D]
 *
 * The transposed key tile turns q.k into B-wide vector FMAs (one per d) with no horizontal sums;
 * bf16 pairs feed AVX512-BF16's dot product (two d per instruction, no conversion) where the CPU
 * has it, are widened in registers on AVX2 (a shift and a mask a pair word) and into a float32
 * tile otherwise; every query head of a group is scored in the same pass over the tile. Values are summed row by row in float32 (bf16 rows widened in
 * registers), up to 3 heads x ACC_NV vectors of accumulators at once so the FMAs of a row do not wait on
 * each other. One work item is (query token, kv head): the
 * G = H / H_kv query heads sharing that kv head go together, so each tile is read once for all.
 * A token at position p attends to [max(0, p - window + 1), p]; scores are scaled, optionally
 * soft-capped, soft-maxed in float32 (scores first, then the weighted sum of values) and written
 * in the query's dtype. query [T, H, D] rows are q_token_stride apart (heads contiguous); out
 * likewise with o_token_stride. A layer's call first stores the step's new key/value rows, then
 * attends (one ctypes call, one OpenMP region per layer). Tiles are scattered, so each is asked
 * for ahead of its use: key tiles into L1 PREFETCH_AHEAD blocks ahead of the scores, value tiles
 * into L2 during the scores and into L1 V_AHEAD blocks ahead of the weighted sum (without the last,
 * most of the sum's time went to waiting on its value loads, more so at longer contexts).
 *
 * The caller (attention.py) validates every shape, stride, dtype and index range: this code
 * trusts its arguments. Compiled on first use with the system C compiler and cached
 * (native_kernels.py).
 */
#include <math.h>
#include <stdint.h>
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "fast_exp.h"
#include "rotary.h"
#include "scratch.h"

typedef struct { /* one layer's call: its strides (elements) and attention parameters */
    int64_t q_token_stride, o_token_stride, k_token_stride, v_token_stride;
    int64_t num_heads, num_kv_heads, head_size, block_size;
    int64_t window;        /* <= 0: no sliding window */
    float scale, soft_cap; /* soft_cap <= 0: none */
} Shape;

typedef struct { /* one step's batch, the same for every layer */
    const int32_t *block_tables; /* [S, bt_stride] */
    int64_t bt_stride;
    const int64_t *tokens, *seqs, *positions; /* [num_tokens] each: the query tokens to compute */
    int64_t num_tokens;
    int64_t max_span;     /* the most keys any of them sees (sizes the per-thread score buffer) */
    const int64_t *slots; /* [num_writes]: the cache slot of each new token (negative: none) */
    int64_t num_writes;
    /* NULL: query and key come rotated; else each new token's query and key rows are rotated by
     * cos_sin [*, D] (cos | sin) at rope_positions [num_writes] first (rotary.h) */
    const float *cos_sin;
    const int64_t *rope_positions;
    /* NULL: token i sits at positions[i]; else every token is its sequence's last one (a decode
     * step), at seq_lens[seqs[i]] - 1: a captured step reads the lengths of each replay from here */
    const int32_t *seq_lens;
} Step;

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

/* scratch: qf [G*D], tile [B*D], row [G*B], acc [G*D], scores [G*n] */
#define DEFINE_ITEM(NAME, T, SCORES, ACCUMULATE, LOAD, STORE)                                             \
static void NAME(const T *query, const T *kc, const T *vc, T *out, const int32_t *table,             \
                 int64_t token, int64_t pos, int64_t h, const Shape *s, float *scratch) {             \
    const int64_t G = s->num_heads / s->num_kv_heads, D = s->head_size, B = s->block_size;            \
    const int64_t lo = (s->window > 0 && pos - s->window + 1 > 0) ? pos - s->window + 1 : 0;          \
    const int64_t n = pos - lo + 1, first = lo / B, last = pos / B, tile_size = B * D;                \
    float *qf = scratch, *tile = qf + G * D, *row = tile + B * D, *acc = row + G * B;                 \
    float *scores = acc + G * D;                                                                      \
    const T *q = query + token * s->q_token_stride + h * G * D;                                       \
    for (int64_t i = 0; i < G * D; i++) qf[i] = LOAD(q[i]);                                           \
    for (int64_t b = first; b <= last && b < first + PREFETCH_AHEAD; b++)                            \
        prefetch_tile(kc + ((int64_t)table[b] * s->num_kv_heads + h) * tile_size,                     \
                      tile_size * (int64_t)sizeof(T), 3);                                             \
    for (int64_t b = first; b <= last; b++) {                                                         \
        const int64_t base = ((int64_t)table[b] * s->num_kv_heads + h) * tile_size;                   \
        const int64_t t0 = b == first ? lo - b * B : 0, t1 = b == last ? pos - b * B + 1 : B;         \
        if (b + PREFETCH_AHEAD <= last)                                                               \
            prefetch_tile(kc + ((int64_t)table[b + PREFETCH_AHEAD] * s->num_kv_heads + h) * tile_size, \
                          tile_size * (int64_t)sizeof(T), 3);                                         \
        prefetch_tile(vc + base, tile_size * (int64_t)sizeof(T), 2); /* for the value pass, into L2 */ \
        SCORES(q, qf, kc + base, tile, row, G, D, B);                                                 \
        for (int64_t g = 0; g < G; g++) { /* key positions b * B + t0 .. b * B + t1 - 1 */           \
            float *sg = scores + g * n + b * B + t0 - lo;                                             \
            for (int64_t t = t0; t < t1; t++) sg[t - t0] = row[g * B + t] * s->scale;                 \
        }                                                                                             \
    }                                                                                                 \
    for (int64_t g = 0; g < G; g++) softmax_row(scores + g * n, n, s->soft_cap);                     \
    for (int64_t i = 0; i < G * D; i++) acc[i] = 0.f;                                                 \
    for (int64_t b = first; b <= last; b++) {                                                         \
        const int64_t base = ((int64_t)table[b] * s->num_kv_heads + h) * tile_size;                   \
        const int64_t t0 = b == first ? lo - b * B : 0, t1 = b == last ? pos - b * B + 1 : B;         \
        if (b + V_AHEAD <= last) /* L2 -> L1 while this tile accumulates */                           \
            prefetch_tile(vc + ((int64_t)table[b + V_AHEAD] * s->num_kv_heads + h) * tile_size,         \
                          tile_size * (int64_t)sizeof(T), 3);                                         \
        ACCUMULATE(scores, n, b * B - lo, vc + base, acc, G, D, t0, t1);                                \
    }                                                                                                 \
    T *o = out + token * s->o_token_stride + h * G * D;                                               \
    for (int64_t i = 0; i < G * D; i++) o[i] = STORE(acc[i]);                                         \
}

DEFINE_ITEM(item_f32, float, SCORES_F32, tile_accumulate_f32, load_f32, store_f32)
DEFINE_ITEM(item_bf16, bf16_t, SCORES_BF16, tile_accumulate_bf16, bf16_to_f32, f32_to_bf16)

/* Store one new token's key and value rows [H_kv, D] (heads contiguous) at cache slot
 * block * B + offset in the layout above. KEY_AT(d, offset) is the key element's index in its tile. */
#define KEY_AT_F32(d, offset, B) ((d) * (B) + (offset))
#define KEY_AT_PAIRS(d, offset, B) (((d) >> 1) * 2 * (B) + 2 * (offset) + ((d) & 1))
#define DEFINE_WRITE_TOKEN(NAME, T, KEY_AT)                                                           \
static inline void NAME(const T *k, const T *v, T *kc, T *vc, int64_t slot, int64_t Hkv, int64_t D,   \
                        int64_t B) {                                                                  \
    const int64_t block = slot / B, offset = slot % B;                                                \
    for (int64_t h = 0; h < Hkv; h++) {                                                               \
        const int64_t base = (block * Hkv + h) * B * D;                                               \
        for (int64_t d = 0; d < D; d++) kc[base + KEY_AT(d, offset, B)] = k[h * D + d];               \
        for (int64_t d = 0; d < D; d++) vc[base + offset * D + d] = v[h * D + d];                     \
    }                                                                                                 \
}
DEFINE_WRITE_TOKEN(write_token_f32, float, KEY_AT_F32)
DEFINE_WRITE_TOKEN(write_token_bf16, bf16_t, KEY_AT_PAIRS)

/* One layer of a step: first the step's new key/value rows [num_writes, H_kv, D] (token strides
 * in the Shape; key NULL: nothing to write) go to their slots, then every query token of the Step
 * is attended over the cache, new rows included; one OpenMP region for both. With the Step's
 * cos_sin, each new token's key is rotated on its way into the cache and its query rotated into
 * out's row, which the attention then reads as its query (a work item reads its query heads before
 * writing the same heads' output). Returns 0, or -1 when scratch memory could not be allocated. */
#define DEFINE_ENTRY(NAME, ITEM, WRITE, ROTATE, T)                                                    \
int NAME(const T *query, const T *key, const T *value, T *kc, T *vc, T *out, const Step *st,          \
         const Shape *s, int num_threads) {                                                           \
    const int64_t G = s->num_heads / s->num_kv_heads, D = s->head_size, B = s->block_size;            \
    const int64_t Hkv = s->num_kv_heads, items = st->num_tokens * Hkv;                                \
    const int64_t span = s->window > 0 && s->window < st->max_span ? s->window : st->max_span;        \
    const int rope = key && st->cos_sin;                                                              \
    Shape sq = *s; /* the query's rows: out's once rotated into it */                                 \
    if (rope) sq.q_token_stride = s->o_token_stride;                                                  \
    const T *q = rope ? out : query;                                                                  \
    int failed = 0;                                                                                   \
    _Pragma("omp parallel num_threads(num_threads) reduction(|:failed)")                              \
    {                                                                                                 \
        if (key) {                                                                                    \
            T *k_rot = rope ? (T *)malloc(sizeof(T) * Hkv * D) : NULL;                                \
            if (rope && !k_rot) failed = 1;                                                           \
            _Pragma("omp for schedule(static)")                                                       \
            for (int64_t t = 0; t < st->num_writes; t++) {                                            \
                const T *k = key + t * s->k_token_stride;                                             \
                if (rope && k_rot) {                                                                  \
                    const float *cs = st->cos_sin + st->rope_positions[t] * D;                        \
                    ROTATE(query + t * s->q_token_stride, out + t * s->o_token_stride, cs,            \
                           s->num_heads, D);                                                          \
                    ROTATE(k, k_rot, cs, Hkv, D);                                                     \
                    k = k_rot;                                                                        \
                }                                                                                     \
                if (st->slots[t] >= 0 && (k_rot || !rope))                                            \
                    WRITE(k, value + t * s->v_token_stride, kc, vc, st->slots[t], Hkv, D, B);        \
            }                                                                                         \
            free(k_rot);                                                                              \
        } /* the loop's barrier: every row is written (and every query rotated) before any is read */\
        const size_t floats = (size_t)(2 * G * D + B * D + G * B + G * span);                        \
        float *scratch = items ? (float *)thread_scratch(sizeof(float) * floats) : NULL;              \
        if (items && !scratch) failed = 1;                                                            \
        _Pragma("omp for schedule(dynamic, 4)")                                                       \
        for (int64_t it = 0; it < items; it++) {                                                      \
            if (!scratch || failed) continue;                                                         \
            const int64_t i = it / Hkv, h = it % Hkv, seq = st->seqs[i];                              \
            const int64_t pos = st->seq_lens ? (int64_t)st->seq_lens[seq] - 1 : st->positions[i];     \
            ITEM(q, kc, vc, out, st->block_tables + seq * st->bt_stride, st->tokens[i], pos, h, &sq,  \
                 scratch);                                                                            \
        }                                                                                             \
    }                                                                                                 \
    return failed ? -1 : 0;                                                                           \
}

DEFINE_ENTRY(podium_paged_attention_f32, item_f32, write_token_f32, rotate_f32, float)
DEFINE_ENTRY(podium_paged_attention_bf16, item_bf16, write_token_bf16, rotate_bf16, bf16_t)

/* Only the writes: new rows [T, H_kv, D] (token strides k_stride / v_stride) at slots (negative: skip) */
#define DEFINE_WRITE(NAME, T, WRITE)                                                                  \
int NAME(const T *key, int64_t k_stride, const T *value, int64_t v_stride, T *kc, T *vc,              \
         const int64_t *slots, int64_t tokens, int64_t Hkv, int64_t D, int64_t B) {                  \
    for (int64_t t = 0; t < tokens; t++)                                                              \
        if (slots[t] >= 0) WRITE(key + t * k_stride, value + t * v_stride, kc, vc, slots[t], Hkv, D, B); \
    return 0;                                                                                         \
}

DEFINE_WRITE(podium_write_kv_f32, float, write_token_f32)
DEFINE_WRITE(podium_write_kv_bf16, bf16_t, write_token_bf16)
