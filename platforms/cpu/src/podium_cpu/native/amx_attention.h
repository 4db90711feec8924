/* A prefill tile of bf16 attention on AMX tiles (paged_attention.c's DEFINE_TILE, the same result
 * within float32 summation order): for CPUs with AMX, where the AVX512-BF16 tile spent most of a
 * long prompt's time scoring and summing 16-key blocks one query row at a time.
 *
 * The R = count x G query rows of one kv head go 16 at a time (a row group: A tiles of 16 rows).
 * A group meets the sequence's key blocks two at a time (32 keys, the depth of one dot product):
 *
 *   scores  S [16][32] = Q [16][D] . K^T: the bf16 key cache's block tile [D/2][B][2] *is* AMX's B
 *           operand (dims in pairs down its rows, 16 keys across), so each block is two tile loads
 *           straight from the cache and two tdpbf16ps (D = 64);
 *   softmax the online softmax of each row over its visible keys (online_softmax_row, as the
 *           AVX512-BF16 tile does), weights rounded to bf16 into P [16][32];
 *   values  O [16][D] += P . V: the two value blocks [B][D] interleaved into key pairs once per
 *           group and block pair ([16 pairs][D][2], as weigh_values_bf16 does), D/16 tdpbf16ps.
 *
 * O stays in four accumulator tiles (16 rows x 16 dims each) for the whole group; a row whose
 * running max moves (rarely: online_softmax_row moves it only by more than RESCALE_MARGIN) has its
 * sums rescaled through memory. Tiles: 0-3 O, 4-5 S of the two blocks, 6 an A operand (Q or P), 7
 * a B operand (K or V), all 16 rows x 64 bytes, configured and released by each call. Only for
 * D = 64 and B = 16 (amx_tile_fits): four accumulator tiles hold a group's sums; other shapes take the
 * AVX512-BF16 tile. The process must hold AMX permission (podium_attention_amx).
 */
#ifndef PODIUM_AMX_ATTENTION_H
#define PODIUM_AMX_ATTENTION_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "attention_math.h"
#include "bf16.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_AMX_ATTENTION 1

#define AMX_D 64       /* the head size the tile runs */
#define AMX_B 16       /* the block size it runs */
#define AMX_KEYS 32    /* keys of one step: two blocks */

static inline int amx_tile_fits(int64_t D, int64_t B) { return D == AMX_D && B == AMX_B; }

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} AttentionTileConfig;

static inline void amx_attention_configure(void) {
    AttentionTileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

/* the floats of scratch amx_tile needs for a tile of up to R query rows */
static inline size_t amx_tile_floats(int64_t R, int64_t blocks) {
    const int64_t rows = (R + 15) / 16 * 16;
    return (size_t)(rows * AMX_D / 2        /* Q [rows][D] bf16 */
                    + 16 * AMX_KEYS + 16    /* S [16][32] float32 and the softmax's overread */
                    + 16 * AMX_KEYS / 2     /* P [16][32] bf16 */
                    + (blocks + 1) * AMX_B * AMX_D / 2 /* value pairs [blocks + 1][8][D][2] bf16 */
                    + 16 * AMX_D            /* O through memory [16][D] */
                    + 2 * 16                /* max, weight sum */
                    + 16 * 16);             /* the weight sums lane by lane */
}

/* value block v [B][D] (keys 0..15) -> vp [8 pairs][D][2]: dims of keys 2j and 2j + 1 side by side */
static inline void amx_value_pairs(const bf16_t *v, bf16_t *vp) {
    for (int j = 0; j < AMX_B / 2; j++)
        interleave_key_pair(v + 2 * j * AMX_D, v + (2 * j + 1) * AMX_D, vp + j * 2 * AMX_D, AMX_D);
}

/* online_softmax_row for one row of the 32-key window, with the window in two registers and no
 * horizontal sum or max a block where it can go without: x[0..32) the row's raw scores, keys
 * [a, e) visible (0 <= a < e <= 32); the weights (0 where not visible) go to p as bf16. The row's
 * running max *m moves, as there, only when a visible score exceeds it by RESCALE_MARGIN (the
 * block's max is taken only then); the weights are summed lane by lane into lv [16] (the row's
 * weight sum is their total, taken once at the end). Returns alpha, the factor the row's sums (lv
 * already) take. */
static inline float amx_softmax_row(const float *x, int64_t a, int64_t e, float scale, float *m, float *lv,
                                    bf16_t *p) {
    const __mmask32 in = (__mmask32)((e >= 32 ? 0xffffffffu : (1u << e) - 1) & ~((1u << a) - 1));
    const __mmask16 in0 = (__mmask16)in, in1 = (__mmask16)(in >> 16);
    const __m512 low = _mm512_set1_ps(-INFINITY), s = _mm512_set1_ps(scale);
    const __m512 x0 = _mm512_mask_mul_ps(low, in0, _mm512_loadu_ps(x), s);
    const __m512 x1 = _mm512_mask_mul_ps(low, in1, _mm512_loadu_ps(x + 16), s);
    const __m512 limit = _mm512_set1_ps(*m + RESCALE_MARGIN);
    float m_new = *m;
    if (*m == -INFINITY || _mm512_cmp_ps_mask(x0, limit, _CMP_GT_OQ) || _mm512_cmp_ps_mask(x1, limit, _CMP_GT_OQ)) {
        const float block_max = _mm512_reduce_max_ps(_mm512_max_ps(x0, x1));
        m_new = block_max > *m + RESCALE_MARGIN ? block_max : *m;
    }
    const float alpha = m_new == *m ? 1.f : *m == -INFINITY ? 0.f : expf(*m - m_new);
    const __m512 mv = _mm512_set1_ps(m_new), lo = _mm512_set1_ps(EXP_LO);
    const __m512 w0 = _mm512_maskz_mov_ps(in0, (__m512)expv((vf)_mm512_mask_sub_ps(lo, in0, x0, mv)));
    const __m512 w1 = _mm512_maskz_mov_ps(in1, (__m512)expv((vf)_mm512_mask_sub_ps(lo, in1, x1, mv)));
    const __m512 sums = _mm512_loadu_ps(lv);
    _mm512_storeu_ps(lv, _mm512_add_ps(alpha == 1.f ? sums : _mm512_mul_ps(sums, _mm512_set1_ps(alpha)),
                                       _mm512_add_ps(w0, w1)));
    *m = m_new;
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(w0));
    _mm256_storeu_si256((__m256i *)(p + 16), (__m256i)_mm512_cvtneps_pbh(w1));
    return alpha;
}

/* One kv head h for `count` consecutive query tokens of one sequence (rows tok0.., positions
 * pos0..), as DEFINE_TILE(tile_bf16) computes it; the tiles must be configured on this thread. */
static void amx_tile(const bf16_t *query, const bf16_t *kc, const bf16_t *vc, bf16_t *out, const int32_t *table,
                     int64_t tok0, int64_t pos0, int64_t count, int64_t h, int64_t G, int64_t Hkv,
                     int64_t q_stride, int64_t o_stride, int64_t window, float scale, float soft_cap,
                     float *scratch) {
    const int64_t D = AMX_D, B = AMX_B, R = count * G, tile_size = B * D, last_pos = pos0 + count - 1;
    const int64_t groups = (R + 15) / 16;
    bf16_t *q = (bf16_t *)scratch;                          /* [groups * 16][D] */
    float *S = (float *)(q + groups * 16 * D);              /* [16][32] (+16) */
    bf16_t *P = (bf16_t *)(S + 16 * AMX_KEYS + 16);          /* [16][32] */
    const int64_t lo = (window > 0 && pos0 - window + 1 > 0) ? pos0 - window + 1 : 0;
    const int64_t first = lo / B, last = last_pos / B, blocks = last - first + 1;
    /* every block's value pairs [blocks + 1][8 pairs][D][2], made by the first row group for all:
     * blocks b, b + 1 are 16 contiguous pairs; the extra block is zeros (the pair of the last block) */
    bf16_t *vall = P + 16 * AMX_KEYS;
    float *O = (float *)(vall + (blocks + 1) * B * D);       /* [16][D] */
    float *m = O + 16 * D, *l = m + 16, *lv = l + 16; /* lv [16][16]: amx_softmax_row's sums */
    for (int64_t i = 0; i < count; i++)
        memcpy(q + i * G * D, query + (tok0 + i) * q_stride + h * G * D, sizeof(bf16_t) * G * D);
    memset(q + R * D, 0, sizeof(bf16_t) * (size_t)((groups * 16 - R) * D)); /* rows past R: zeros */
    memset(vall + blocks * B * D, 0, sizeof(bf16_t) * (size_t)(B * D));
    amx_attention_configure(); /* per call: the thread's tiles may have been configured by a linear */
    for (int64_t grp = 0; grp < groups; grp++) {
        const bf16_t *qg = q + grp * 16 * D;
        const int64_t r0 = grp * 16, rows = R - r0 < 16 ? R - r0 : 16;
        for (int r = 0; r < 16; r++) m[r] = -INFINITY, l[r] = 0.f;
        memset(lv, 0, sizeof(float) * 16 * 16);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t b = first; b <= last; b += 2) {
            const int64_t nb = b + 1 <= last ? 2 : 1;
            const int64_t base0 = ((int64_t)table[b] * Hkv + h) * tile_size;
            const int64_t base1 = nb == 2 ? ((int64_t)table[b + 1] * Hkv + h) * tile_size : base0;
            if (b + 2 <= last) /* the next pair's key tiles */
                prefetch_tile(kc + ((int64_t)table[b + 2] * Hkv + h) * tile_size, tile_size * 2, 3);
            if (b + 3 <= last)
                prefetch_tile(kc + ((int64_t)table[b + 3] * Hkv + h) * tile_size, tile_size * 2, 3);
            _tile_zero(4);
            _tile_zero(5);
            _tile_loadd(6, qg, D * 2);                 /* dims 0..31 of the 16 rows */
            _tile_loadd(7, kc + base0, 64);            /* dim pairs 0..15 of block b's keys */
            _tile_dpbf16ps(4, 6, 7);
            if (nb == 2) {
                _tile_loadd(7, kc + base1, 64);
                _tile_dpbf16ps(5, 6, 7);
            }
            _tile_loadd(6, qg + 32, D * 2);            /* dims 32..63 */
            _tile_loadd(7, kc + base0 + 512, 64);      /* dim pairs 16..31 */
            _tile_dpbf16ps(4, 6, 7);
            if (nb == 2) {
                _tile_loadd(7, kc + base1 + 512, 64);
                _tile_dpbf16ps(5, 6, 7);
            }
            _tile_stored(4, S, AMX_KEYS * 4);
            _tile_stored(5, S + 16, AMX_KEYS * 4);
            /* keys [t0, t1) of the two blocks are the tile's (t relative to block b's first key) */
            const int64_t t0 = b == first ? lo - b * B : 0, t1 = b + nb - 1 == last ? last_pos - b * B + 1 : nb * B;
            int rescale = 0;
            float alpha[16];
            for (int64_t r = 0; r < 16; r++) {
                float *x = S + r * AMX_KEYS;
                alpha[r] = 1.f;
                int64_t a = 0, e = 0;
                if (r < rows) {
                    const int64_t pos = pos0 + (r0 + r) / G;
                    const int64_t row_lo = (window > 0 && pos - window + 1 > 0) ? pos - window + 1 : 0;
                    a = row_lo - b * B > t0 ? row_lo - b * B : t0;
                    e = pos - b * B + 1 < t1 ? pos - b * B + 1 : t1;
                }
                bf16_t *p = P + r * AMX_KEYS;
                if (a >= e) {
                    memset(p, 0, sizeof(bf16_t) * AMX_KEYS);
                    continue;
                }
                if (soft_cap > 0.f) { /* the general row (tanh first), its weights of [t0, t1) kept */
                    alpha[r] = online_softmax_row(x, t0, t1, a, e, scale, soft_cap, m + r, l + r);
                    const __mmask32 in = (__mmask32)((t1 >= 32 ? 0xffffffffu : (1u << t1) - 1) & ~((1u << t0) - 1));
                    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps((__mmask16)in, x)));
                    _mm256_storeu_si256((__m256i *)(p + 16),
                                        (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps((__mmask16)(in >> 16), x + 16)));
                } else {
                    alpha[r] = amx_softmax_row(x, a, e, scale, m + r, lv + 16 * r, p);
                }
                rescale |= alpha[r] != 1.f && alpha[r] != 0.f; /* 0: no sums yet to scale */
            }
            if (rescale) {
                _tile_stored(0, O, D * 4);
                _tile_stored(1, O + 16, D * 4);
                _tile_stored(2, O + 32, D * 4);
                _tile_stored(3, O + 48, D * 4);
                for (int r = 0; r < 16; r++)
                    if (alpha[r] != 1.f)
                        for (int64_t d = 0; d < D; d++) O[r * D + d] *= alpha[r];
                _tile_loadd(0, O, D * 4);
                _tile_loadd(1, O + 16, D * 4);
                _tile_loadd(2, O + 32, D * 4);
                _tile_loadd(3, O + 48, D * 4);
            }
            const bf16_t *vp = vall + (b - first) * B * D; /* pairs of blocks b and b + 1 (or zeros) */
            if (grp == 0) {
                amx_value_pairs(vc + base0, vall + (b - first) * B * D);
                if (nb == 2) amx_value_pairs(vc + base1, vall + (b + 1 - first) * B * D);
            }
            _tile_loadd(6, P, AMX_KEYS * 2);
            _tile_loadd(7, vp, 2 * D * 2); /* dims 0..15 of the 16 key pairs */
            _tile_dpbf16ps(0, 6, 7);
            _tile_loadd(7, vp + 32, 2 * D * 2);
            _tile_dpbf16ps(1, 6, 7);
            _tile_loadd(7, vp + 64, 2 * D * 2);
            _tile_dpbf16ps(2, 6, 7);
            _tile_loadd(7, vp + 96, 2 * D * 2);
            _tile_dpbf16ps(3, 6, 7);
        }
        _tile_stored(0, O, D * 4);
        _tile_stored(1, O + 16, D * 4);
        _tile_stored(2, O + 32, D * 4);
        _tile_stored(3, O + 48, D * 4);
        for (int64_t r = 0; r < rows; r++) {
            const int64_t row = r0 + r;
            const float inv = 1.f / (soft_cap > 0.f ? l[r] : _mm512_reduce_add_ps(_mm512_loadu_ps(lv + 16 * r)));
            bf16_t *o = out + (tok0 + row / G) * o_stride + (h * G + row % G) * D;
            for (int64_t d = 0; d < D; d += 16) storev_bf16(o + d, loadv(O + r * D + d) * inv);
        }
    }
    _tile_release();
}

#else
#define HAVE_AMX_ATTENTION 0
#endif

#endif
