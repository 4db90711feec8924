/* A prefill tile of bf16 attention on AVX512-BF16 without AMX (paged_attention.c's DEFINE_TILE, the
 * same result within float32 summation order), with the query rows across the vector lanes.
 *
 * DEFINE_TILE keeps a row's 16 scores of a block in one vector, so every row and block pays two
 * horizontal reductions (max, sum) and a scalar rescaling test: on a CPU without AMX those took
 * more time than the dot products. Here lane i of a vector is query row 16 v + i (up to 48 rows:
 * count tokens x the G query heads of a kv head), so the online softmax is lane-wise arithmetic:
 *
 *   scores  S[t][rows] = sum over pairs p of vdpbf16ps(Q^T pair p of 16 rows, key t's pair p
 *           broadcast), the key tile [D/2][B][2] read as it lies in the cache; scaled;
 *   softmax per lane: the block's max over its visible keys (causal, sliding window), the running
 *           max moved only when that is more than RESCALE_MARGIN above it (as online_softmax_row),
 *           weights e^(s - m) (0 where not visible), the weight sum, weights rounded to bf16 in
 *           pairs of keys;
 *   values  O^T[d][rows] += vdpbf16ps(weight pairs of 16 rows, (v_2j[d], v_2j+1[d]) broadcast),
 *           the value tile interleaved into key pairs once per block (as weigh_values_bf16).
 *
 * Keys go DPB_BLOCKS cache blocks a step (the softmax's bookkeeping and the O^T loads and stores
 * once per 32 keys). A 4 x 512-token prefill layer of SmolLM2's shape took 5.4-5.6 ms here against
 * DEFINE_TILE's 8.2-8.5 on a 2-core AMD EPYC (Zen 4) (benchmarks/cpu_kernels.py --only prefill).
 *
 * O^T and Q^T live in the scratch; each row's sums do not depend on the other rows of its tile, so
 * a row's result is the same however the prompt was cut into tiles and chunks. Soft-capped scores
 * and other shapes take DEFINE_TILE (dpbf16_tile_fits).
 */
#ifndef PODIUM_DPBF16_ATTENTION_H
#define PODIUM_DPBF16_ATTENTION_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "attention_math.h"
#include "bf16.h"
#include "transpose.h"

#if defined(__AVX512BF16__) && VL == 16
#include <immintrin.h>
#define HAVE_DPBF16_TILE 1

#define DPB_MAX_ROWS 48 /* three vectors of rows: attention_plan.py's TILE_ROWS */
#define DPB_BLOCKS 2    /* cache blocks a step of the online softmax takes (32 keys at B = 16) */

static inline int dpbf16_tile_fits(int64_t R, int64_t D, int64_t B, float soft_cap) {
    return R <= DPB_MAX_ROWS && D % 32 == 0 && D <= 256 && B % 16 == 0 && B <= 64 && !(soft_cap > 0.f);
}

/* the floats of scratch dpbf16_tile needs for tiles of up to R rows */
static inline size_t dpbf16_tile_floats(int64_t R, int64_t D, int64_t B) {
    const int64_t L = (R + 15) / 16 * 16;
    const int64_t K = DPB_BLOCKS * B;
    return (size_t)(D / 2 * L + D * L + K * L + K / 2 * L + K * D / 2 + 32);
}

/* S[t][v] for keys t0k..t0k + KT of one key tile kt [D/2][B][2]: KT x RV accumulators, one chain each */
static inline __attribute__((always_inline)) void dpb_scores(const uint32_t *restrict qp, const bf16_t *restrict kt,
                                                             float *restrict S, int64_t L, int64_t P, int64_t B,
                                                             int64_t t0k, float scale, const int RV, const int KT) {
    __m512 a[8][3];
    for (int k = 0; k < KT; k++)
        for (int v = 0; v < RV; v++) a[k][v] = _mm512_setzero_ps();
    for (int64_t p = 0; p < P; p++) {
        __m512bh q[3];
        for (int v = 0; v < RV; v++) q[v] = (__m512bh)_mm512_loadu_si512(qp + p * L + 16 * v);
        for (int k = 0; k < KT; k++) {
            const __m512bh kb = (__m512bh)pair_broadcast(kt + p * 2 * B + 2 * (t0k + k));
            for (int v = 0; v < RV; v++) a[k][v] = _mm512_dpbf16_ps(a[k][v], q[v], kb);
        }
    }
    const __m512 sc = _mm512_set1_ps(scale);
    for (int k = 0; k < KT; k++)
        for (int v = 0; v < RV; v++) _mm512_storeu_ps(S + (t0k + k) * L + 16 * v, _mm512_mul_ps(a[k][v], sc));
}

/* accT[d][v] for dims d0..d0 + DB += the weight pairs pp [B/2][L] of pairs [j0, j1) dot the value pairs vp */
static inline __attribute__((always_inline)) void dpb_values(float *restrict accT, const uint32_t *restrict pp,
                                                             const bf16_t *restrict vp, int64_t L, int64_t D,
                                                             int64_t j0, int64_t j1, int64_t d0, const int RV,
                                                             const int DB) {
    __m512 a[8][3];
    for (int dd = 0; dd < DB; dd++)
        for (int v = 0; v < RV; v++) a[dd][v] = _mm512_loadu_ps(accT + (d0 + dd) * L + 16 * v);
    for (int64_t j = j0; j < j1; j++) {
        __m512bh w[3];
        for (int v = 0; v < RV; v++) w[v] = (__m512bh)_mm512_loadu_si512(pp + j * L + 16 * v);
        for (int dd = 0; dd < DB; dd++) {
            const __m512bh vb = (__m512bh)pair_broadcast(vp + j * 2 * D + 2 * (d0 + dd));
            for (int v = 0; v < RV; v++) a[dd][v] = _mm512_dpbf16_ps(a[dd][v], w[v], vb);
        }
    }
    for (int dd = 0; dd < DB; dd++)
        for (int v = 0; v < RV; v++) _mm512_storeu_ps(accT + (d0 + dd) * L + 16 * v, a[dd][v]);
}

static inline __attribute__((always_inline)) void dpb_tile_rv(
    const bf16_t *query, const bf16_t *kc, const bf16_t *vc, bf16_t *out, const int32_t *table, int64_t tok0,
    int64_t pos0, int64_t count, int64_t G, int64_t Hkv, int64_t h, int64_t q_stride, int64_t o_stride, int64_t D,
    int64_t B, int64_t window, float scale, float *scratch, const int RV) {
    const int KT = 8, DB = 8; /* accumulators: KT x RV, DB x RV <= 24 of the 32 registers */
    const int64_t R = count * G, L = 16 * RV, P = D / 2, tile_size = B * D, last_pos = pos0 + count - 1;
    const int64_t K = DPB_BLOCKS * B;       /* keys of one step */
    uint32_t *qp = (uint32_t *)scratch;     /* [P][L]: (q_r[2p], q_r[2p+1]) */
    float *accT = scratch + P * L;          /* [D][L] */
    float *S = accT + D * L;                /* [K][L] scores, then weights */
    uint32_t *pp = (uint32_t *)(S + K * L); /* [K/2][L] weight pairs */
    bf16_t *vp = (bf16_t *)(pp + K / 2 * L); /* [K/2][D][2] value pairs */
    int32_t pos_of[DPB_MAX_ROWS], lo_of[DPB_MAX_ROWS], at_of[DPB_MAX_ROWS];
    for (int64_t r = 0; r < L; r++) { /* rows past R repeat the last row (computed, never written out) */
        const int64_t rr = r < R ? r : R - 1, pos = pos0 + rr / G;
        at_of[r] = (int32_t)((rr / G) * q_stride + (rr % G) * D); /* the row's query, from its tile's first */
        pos_of[r] = (int32_t)pos;
        lo_of[r] = (int32_t)(window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0);
    }
    const bf16_t *q0 = query + tok0 * q_stride + h * G * D;
    for (int v = 0; v < RV; v++) /* Q^T pairs: 16 rows' words p0 .. p0 + 15 a transpose */
        for (int64_t p0 = 0; p0 < P; p0 += 16) {
            __m512i w[16];
            for (int i = 0; i < 16; i++) w[i] = _mm512_loadu_si512(q0 + at_of[16 * v + i] + 2 * p0);
            transpose16_words(w);
            for (int j = 0; j < 16; j++) _mm512_storeu_si512(qp + (p0 + j) * L + 16 * v, w[j]);
        }
    memset(accT, 0, sizeof(float) * (size_t)(D * L));
    __m512 m[3], l[3];
    __m512i posv[3], lov[3];
    for (int v = 0; v < RV; v++) {
        m[v] = _mm512_set1_ps(-INFINITY), l[v] = _mm512_setzero_ps();
        posv[v] = _mm512_loadu_si512(pos_of + 16 * v), lov[v] = _mm512_loadu_si512(lo_of + 16 * v);
    }
    const int32_t min_pos = (int32_t)pos0, max_lo = lo_of[R - 1];
    const int64_t lo = lo_of[0], first = lo / B, last = last_pos / B;
    __m512i pair_idx; /* after cvtne2ps: lanes 0-15 key 2j, 16-31 key 2j + 1 -> (2j, 2j + 1) pairs */
    for (int k = 0; k < 32; k++) ((int16_t *)&pair_idx)[k] = (int16_t)(k / 2 + (k % 2) * 16);
    const __m512 margin = _mm512_set1_ps(RESCALE_MARGIN), one = _mm512_set1_ps(1.f), zero = _mm512_setzero_ps();
    for (int64_t b = first; b <= last && b < first + PREFETCH_AHEAD; b++)
        prefetch_tile(kc + ((int64_t)table[b] * Hkv + h) * tile_size, tile_size * (int64_t)sizeof(bf16_t), 3);
    /* steps of DPB_BLOCKS blocks, aligned to the sequence's blocks (not the tile's) so that a row meets
     * the same steps in any tile; keys [g0, g1) of a step are the ones in the tile's range */
    for (int64_t step = first / DPB_BLOCKS; step <= last / DPB_BLOCKS; step++) {
        const int64_t b_lo = step * DPB_BLOCKS > first ? step * DPB_BLOCKS : first;
        const int64_t b_hi = step * DPB_BLOCKS + DPB_BLOCKS - 1 < last ? step * DPB_BLOCKS + DPB_BLOCKS - 1 : last;
        const int64_t k0 = step * K; /* the step's first key position */
        const int64_t g0 = b_lo == first ? lo - k0 : (b_lo - step * DPB_BLOCKS) * B;
        const int64_t g1 = b_hi == last ? last_pos - k0 + 1 : (b_hi - step * DPB_BLOCKS + 1) * B;
        const bf16_t *vt[DPB_BLOCKS];
        for (int64_t b = b_lo; b <= b_hi; b++) {
            const int64_t base = ((int64_t)table[b] * Hkv + h) * tile_size, i = b - step * DPB_BLOCKS;
            if (b + PREFETCH_AHEAD <= last)
                prefetch_tile(kc + ((int64_t)table[b + PREFETCH_AHEAD] * Hkv + h) * tile_size,
                              tile_size * (int64_t)sizeof(bf16_t), 3);
            prefetch_tile(vc + base, tile_size * (int64_t)sizeof(bf16_t), 3);
            vt[i] = vc + base;
            for (int64_t t = 0; t < B; t += KT) dpb_scores(qp, kc + base, S + i * B * L, L, P, B, t, scale, RV, KT);
        }
        /* every key of [g0, g1) visible to every row: no masks */
        const int all = k0 + g0 >= max_lo && k0 + g1 - 1 <= min_pos;
        __m512 top[3];
        for (int v = 0; v < RV; v++) top[v] = _mm512_set1_ps(-INFINITY);
        for (int64_t t = g0; t < g1; t++)
            for (int v = 0; v < RV; v++) {
                const __m512 s = _mm512_loadu_ps(S + t * L + 16 * v);
                if (all) {
                    top[v] = _mm512_max_ps(top[v], s);
                } else {
                    const __m512i kp = _mm512_set1_epi32((int32_t)(k0 + t));
                    const __mmask16 vis = _mm512_cmple_epi32_mask(kp, posv[v]) & _mm512_cmple_epi32_mask(lov[v], kp);
                    top[v] = _mm512_mask_max_ps(top[v], vis, top[v], s);
                }
            }
        for (int v = 0; v < RV; v++) { /* the running max moves only by more than the margin */
            const __mmask16 up = _mm512_cmp_ps_mask(top[v], _mm512_add_ps(m[v], margin), _CMP_GT_OQ);
            if (!up) continue;
            const __m512 m_new = _mm512_mask_mov_ps(m[v], up, top[v]);
            const __mmask16 was_inf = _mm512_cmp_ps_mask(m[v], _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ);
            __m512 alpha = (__m512)expv((vf)_mm512_sub_ps(_mm512_mask_mov_ps(m_new, ~was_inf & up, m[v]), m_new));
            alpha = _mm512_mask_mov_ps(_mm512_mask_mov_ps(one, up, alpha), was_inf & up, zero);
            l[v] = _mm512_mul_ps(l[v], alpha);
            for (int64_t d = 0; d < D; d++)
                _mm512_storeu_ps(accT + d * L + 16 * v, _mm512_mul_ps(_mm512_loadu_ps(accT + d * L + 16 * v), alpha));
            m[v] = m_new;
        }
        const int64_t j0 = g0 / 2, j1 = (g1 + 1) / 2;
        for (int64_t j = j0; j < j1; j++)
            for (int v = 0; v < RV; v++) {
                __m512 w[2];
                for (int e = 0; e < 2; e++) {
                    const int64_t t = 2 * j + e;
                    const __m512 s = _mm512_loadu_ps(S + t * L + 16 * v);
                    const __m512i kp = _mm512_set1_epi32((int32_t)(k0 + t));
                    const __mmask16 vis = t < g0 || t >= g1 ? 0
                                          : all ? (__mmask16)0xffff
                                                : _mm512_cmple_epi32_mask(kp, posv[v]) & _mm512_cmple_epi32_mask(lov[v], kp);
                    const __m512 x = _mm512_mask_mov_ps(_mm512_set1_ps(EXP_LO), vis, _mm512_sub_ps(s, m[v]));
                    w[e] = _mm512_maskz_mov_ps(vis, (__m512)expv((vf)x));
                    l[v] = _mm512_add_ps(l[v], w[e]);
                }
                const __m512i pair = (__m512i)_mm512_cvtne2ps_pbh(w[1], w[0]);
                _mm512_storeu_si512(pp + j * L + 16 * v, _mm512_permutexvar_epi16(pair_idx, pair));
            }
        for (int64_t j = j0; j < j1; j++) { /* keys 2j, 2j + 1: rows of one block's value tile */
            const bf16_t *v0 = vt[2 * j / B] + (2 * j % B) * D;
            interleave_key_pair(v0, v0 + D, vp + j * 2 * D, D);
        }
        for (int64_t d = 0; d < D; d += DB) dpb_values(accT, pp, vp, L, D, j0, j1, d, RV, DB);
    }
    bf16_t *o0 = out + tok0 * o_stride + h * G * D;
    for (int v = 0; v < RV && 16 * v < R; v++) { /* O^T / l back to rows: 16 rows' words p0 .. p0 + 15 a transpose */
        const __m512 inv = _mm512_div_ps(one, l[v]);
        const int64_t rows = R - 16 * v < 16 ? R - 16 * v : 16;
        for (int64_t p0 = 0; p0 < P; p0 += 16) {
            __m512i w[16]; /* lane i of w[j]: dims 2 (p0 + j), + 1 of row 16 v + i, a bf16 pair */
            for (int j = 0; j < 16; j++) {
                const int64_t d = 2 * (p0 + j);
                const __m512 x0 = _mm512_mul_ps(_mm512_loadu_ps(accT + d * L + 16 * v), inv);
                const __m512 x1 = _mm512_mul_ps(_mm512_loadu_ps(accT + (d + 1) * L + 16 * v), inv);
                w[j] = _mm512_permutexvar_epi16(pair_idx, (__m512i)_mm512_cvtne2ps_pbh(x1, x0));
            }
            transpose16_words(w);
            for (int64_t i = 0; i < rows; i++) {
                const int64_t r = 16 * v + i;
                _mm512_storeu_si512(o0 + (r / G) * o_stride + (r % G) * D + 2 * p0, w[i]);
            }
        }
    }
}

static void dpbf16_tile(const bf16_t *query, const bf16_t *kc, const bf16_t *vc, bf16_t *out, const int32_t *table,
                        int64_t tok0, int64_t pos0, int64_t count, int64_t G, int64_t Hkv, int64_t h, int64_t q_stride,
                        int64_t o_stride, int64_t D, int64_t B, int64_t window, float scale, float *scratch) {
    switch ((count * G + 15) / 16) {
        case 1: dpb_tile_rv(query, kc, vc, out, table, tok0, pos0, count, G, Hkv, h, q_stride, o_stride, D, B, window, scale, scratch, 1); break;
        case 2: dpb_tile_rv(query, kc, vc, out, table, tok0, pos0, count, G, Hkv, h, q_stride, o_stride, D, B, window, scale, scratch, 2); break;
        default: dpb_tile_rv(query, kc, vc, out, table, tok0, pos0, count, G, Hkv, h, q_stride, o_stride, D, B, window, scale, scratch, 3); break;
    }
}

#else
#define HAVE_DPBF16_TILE 0
#endif

#endif
