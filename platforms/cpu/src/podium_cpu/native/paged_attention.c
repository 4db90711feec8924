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
 * tile otherwise; every query head of a group is scored in the same pass over the tile (with AVX-512,
 * a decode item scores two 16-key units at once for up to three heads: DEFINE_ITEM_UNIT_SCORES). Values are summed row by row in float32 (bf16 rows widened in
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
#include <stdlib.h>
#include <string.h>

#include "amx_attention.h"
#include "attention_math.h"
#include "bf16.h"
#include "dpbf16_attention.h"
#include "rotary.h"
#include "scratch.h"

/* decode items a thread takes at a time (OpenMP's dynamic chunk): within a chunk, each item asks for
 * the next one's key tiles while it sums its values, so memory stays busy through that pass */
#ifndef ITEM_CHUNK
#define ITEM_CHUNK 4
#endif

typedef struct { /* one layer's call: its strides (elements) and attention parameters */
    int64_t q_token_stride, o_token_stride, k_token_stride, v_token_stride;
    int64_t num_heads, num_kv_heads, head_size, block_size;
    int64_t window;        /* <= 0: no sliding window */
    float scale, soft_cap; /* soft_cap <= 0: none */
    int64_t amx_tiles;     /* 0: bf16 prefill tiles never on AMX tiles (the platform's amx option) */
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
    /* [num_tiles][4]: (sequence, first query row, its position, query rows) of each prefill tile,
     * computed flash style (DEFINE_TILE) instead of as tokens; max_tile: the most rows of one */
    const int64_t *tiles;
    int64_t num_tiles, max_tile;
} Step;

/* A decode item's scores a few 16-key units at a time (attention_math.h's *_scores_units: each key load
 * serving every query head of the group, the same sums as SCORES a block at a time), where the build
 * and the shape allow; ps: the elements between a unit's consecutive d (pairs) */
/* UNITS(q, qf, unit, dst, mask, n, s, NU): the units' scores for every query head, three at a time */
#define DEFINE_UNITS(NAME, T, SCORES, Q, PAIR)                                                            \
static inline __attribute__((always_inline)) void NAME(const T *q, const float *qf, const T *const *unit,  \
                                                       float *const *dst, const __mmask16 *mask, int64_t n, \
                                                       const Shape *s, const int NU) {                      \
    (void)q, (void)qf;                                                                                    \
    const int64_t G = s->num_heads / s->num_kv_heads, D = s->head_size, ps = PAIR * s->block_size;       \
    for (int64_t g0 = 0; g0 < G; g0 += 3) {                                                               \
        const int64_t gs = G - g0 < 3 ? G - g0 : 3;                                                       \
        if (gs == 3) SCORES(Q, unit, ps, dst, mask, n, D, g0, s->scale, 3, NU);                           \
        else if (gs == 2) SCORES(Q, unit, ps, dst, mask, n, D, g0, s->scale, 2, NU);                      \
        else SCORES(Q, unit, ps, dst, mask, n, D, g0, s->scale, 1, NU);                                   \
    }                                                                                                     \
}
#if VL == 16
DEFINE_UNITS(units_f32, float, f32_scores_units, qf, 1)
static inline int units_f32_fit(const Shape *s) { return s->block_size % 16 == 0; }
#define UNIT_F32(t) (t)
#endif
#if VL == 16 && defined(__AVX512BF16__)
DEFINE_UNITS(units_bf16, bf16_t, pair_scores_units, q, 2) /* pair tiles: a key's d pairs 2 elements wide */
static inline int units_bf16_fit(const Shape *s) { return s->block_size % 16 == 0 && s->head_size % 2 == 0; }
#define UNIT_BF16(t) (2 * (t))
#endif

/* Ask for block b's value tile (into L2, for the value pass) and, PREFETCH_AHEAD blocks on, the key
 * tile its scores will need; first == b: also the key tiles before that (an item's first block) */
static inline void ask_block_tiles(const char *kc, const char *vc, const int32_t *table, int64_t b, int64_t first,
                                   int64_t last, int64_t h, const Shape *s, int64_t tile_bytes) {
    const int64_t Hkv = s->num_kv_heads;
    if (b == first)
        for (int64_t i = b; i <= last && i < b + PREFETCH_AHEAD; i++)
            prefetch_tile(kc + ((int64_t)table[i] * Hkv + h) * tile_bytes, tile_bytes, 2);
    if (b + PREFETCH_AHEAD <= last)
        prefetch_tile(kc + ((int64_t)table[b + PREFETCH_AHEAD] * Hkv + h) * tile_bytes, tile_bytes, 2);
    prefetch_tile(vc + ((int64_t)table[b] * Hkv + h) * tile_bytes, tile_bytes, 2);
}

/* The item's scaled scores, unit by unit: keys [lo, pos] into scores [G][n], each block's key tile
 * asked for PREFETCH_AHEAD blocks ahead and its value tile into L2 as its keys are scored */
#define DEFINE_ITEM_UNIT_SCORES(NAME, T, UNITS, UNIT_AT)                                                  \
static void NAME(const T *q, const float *qf, const T *kc, const T *vc, const int32_t *table, int64_t lo, \
                 int64_t pos, int64_t h, const Shape *s, float *scores) {                                 \
    const int64_t B = s->block_size, tile_size = B * s->head_size, n = pos - lo + 1;                      \
    const int64_t first = lo / B, last = pos / B;                                                         \
    const T *unit[2];                                                                                     \
    float *dst[2];                                                                                        \
    __mmask16 mask[2];                                                                                    \
    int nu = 0;                                                                                           \
    for (int64_t b = first; b <= last; b++) {                                                             \
        const int64_t base = ((int64_t)table[b] * s->num_kv_heads + h) * tile_size;                       \
        ask_block_tiles((const char *)kc, (const char *)vc, table, b, first, last, h, s,                  \
                        tile_size * (int64_t)sizeof(T));                                                  \
        for (int64_t t = 0; t < B; t += 16) {                                                             \
            const int64_t key0 = b * B + t; /* the unit's keys key0 .. key0 + 15, of which [lo, pos] count */ \
            if (key0 + 16 <= lo || key0 > pos) continue;                                                  \
            const int64_t a = lo > key0 ? lo - key0 : 0, e = pos - key0 + 1 < 16 ? pos - key0 + 1 : 16;  \
            mask[nu] = (__mmask16)(((1u << e) - 1) & ~((1u << a) - 1));                                   \
            unit[nu] = kc + base + UNIT_AT(t);                                                            \
            dst[nu] = scores + (key0 - lo); /* lanes before lo are masked off */                          \
            if (++nu == 2) {                                                                              \
                UNITS(q, qf, unit, dst, mask, n, s, 2);                                                   \
                nu = 0;                                                                                   \
            }                                                                                             \
        }                                                                                                 \
    }                                                                                                     \
    if (nu) UNITS(q, qf, unit, dst, mask, n, s, 1);                                                       \
}
#if VL == 16
DEFINE_ITEM_UNIT_SCORES(unit_scores_f32, float, units_f32, UNIT_F32)
#define UNIT_SCORES_F32(s) units_f32_fit(s)
#else
#define UNIT_SCORES_F32(s) 0
#define unit_scores_f32(...) ((void)0)
#endif
#if VL == 16 && defined(__AVX512BF16__)
DEFINE_ITEM_UNIT_SCORES(unit_scores_bf16, bf16_t, units_bf16, UNIT_BF16)
#define UNIT_SCORES_BF16(s) units_bf16_fit(s)
#else
#define UNIT_SCORES_BF16(s) 0
#define unit_scores_bf16(...) ((void)0)
#endif

/* scratch: qf [G*D], tile [B*D], row [G*B], acc [G*D], scores [G*n]
 * A decode streams its keys and values from memory once, so the tiles asked for ahead go to L2
 * (locality 2), not L1: a prefetch into L1 holds one of the core's few L1 miss buffers until its line
 * arrives, and with the scattered tiles that capped a core's lines in flight (a 32 x 576 step: 24-26
 * against 20-22 ms on AMD Zen 4, benchmarks/cpu_kernels.py --only decode --context 576). */
#define DEFINE_ITEM(NAME, T, SCORES, ACCUMULATE, LOAD, STORE, UNIT_SCORES, UNIT_FIT) \
static void NAME(const T *query, const T *kc, const T *vc, T *out, const int32_t *table,             \
                 int64_t token, int64_t pos, int64_t h, const Shape *s, float *scratch,               \
                 const int32_t *next_table, int64_t next_pos, int64_t next_h) {                       \
    const int64_t G = s->num_heads / s->num_kv_heads, D = s->head_size, B = s->block_size;            \
    const int64_t lo = (s->window > 0 && pos - s->window + 1 > 0) ? pos - s->window + 1 : 0;          \
    const int64_t n = pos - lo + 1, first = lo / B, last = pos / B, tile_size = B * D;                \
    float *qf = scratch, *tile = qf + G * D, *row = tile + B * D, *acc = row + G * B;                 \
    float *scores = acc + G * D;                                                                      \
    const T *q = query + token * s->q_token_stride + h * G * D;                                       \
    for (int64_t i = 0; i < G * D; i++) qf[i] = LOAD(q[i]);                                           \
    if (UNIT_FIT(s))                                                                                  \
        UNIT_SCORES(q, qf, kc, vc, table, lo, pos, h, s, scores);                                     \
    else                                                                                              \
    for (int64_t b = first; b <= last; b++) {                                                         \
        const int64_t base = ((int64_t)table[b] * s->num_kv_heads + h) * tile_size;                   \
        const int64_t t0 = b == first ? lo - b * B : 0, t1 = b == last ? pos - b * B + 1 : B;         \
        ask_block_tiles((const char *)kc, (const char *)vc, table, b, first, last, h, s,              \
                        tile_size * (int64_t)sizeof(T));                                              \
        SCORES(q, qf, kc + base, tile, row, G, D, B);                                                 \
        for (int64_t g = 0; g < G; g++) { /* key positions b * B + t0 .. b * B + t1 - 1 */           \
            float *sg = scores + g * n + b * B + t0 - lo;                                             \
            for (int64_t t = t0; t < t1; t++) sg[t - t0] = row[g * B + t] * s->scale;                 \
        }                                                                                             \
    }                                                                                                 \
    for (int64_t g = 0; g < G; g++) softmax_row(scores + g * n, n, s->soft_cap);                     \
    for (int64_t i = 0; i < G * D; i++) acc[i] = 0.f;                                                 \
    const int64_t next_lo = (s->window > 0 && next_pos - s->window + 1 > 0) ? next_pos - s->window + 1 : 0; \
    const int64_t next_first = next_lo / B, next_last = next_pos / B;                                 \
    for (int64_t b = first; b <= last; b++) {                                                         \
        const int64_t base = ((int64_t)table[b] * s->num_kv_heads + h) * tile_size;                   \
        const int64_t t0 = b == first ? lo - b * B : 0, t1 = b == last ? pos - b * B + 1 : B;         \
        if (b + V_AHEAD <= last) /* L2 -> L1 while this tile accumulates */                           \
            prefetch_tile(vc + ((int64_t)table[b + V_AHEAD] * s->num_kv_heads + h) * tile_size,         \
                          tile_size * (int64_t)sizeof(T), 3);                                         \
        if (next_table && b - first + next_first <= next_last) /* the next item's keys, into L2 */      \
            prefetch_tile(kc + ((int64_t)next_table[b - first + next_first] * s->num_kv_heads + next_h) \
                                   * tile_size, tile_size * (int64_t)sizeof(T), 2);                   \
        ACCUMULATE(scores, n, b * B - lo, vc + base, acc, G, D, t0, t1);                                \
    }                                                                                                 \
    T *o = out + token * s->o_token_stride + h * G * D;                                               \
    for (int64_t i = 0; i < G * D; i++) o[i] = STORE(acc[i]);                                         \
}

DEFINE_ITEM(item_f32, float, SCORES_F32, tile_accumulate_f32, load_f32, store_f32, unit_scores_f32, UNIT_SCORES_F32)
DEFINE_ITEM(item_bf16, bf16_t, SCORES_BF16, tile_accumulate_bf16, bf16_to_f32, f32_to_bf16, unit_scores_bf16, UNIT_SCORES_BF16)

/* Prefill: one kv head h for a tile of `count` consecutive query tokens of one sequence (rows tok0..,
 * positions pos0..), flash style. Its R = count x G query rows (G query heads of h per token) meet
 * the sequence's key blocks one at a time: scores of all R rows against the block's key tile (the
 * decode path's SCORES, with R rows in place of G), each row's online softmax over the keys it sees
 * (causal, sliding window), the row's sums rescaled when its max grows, and the weighted value rows
 * added (weigh_values_*: AVX512-BF16 dot products over pairs of keys for bf16). Each key and value
 * tile is read once per tile of queries instead of once per query token. out: sums / weights, in
 * the query's dtype.
 * scratch (floats): qf [R*D], key tile [B*D], scores [R*B + VL], sums [R*D], max [R], weight sum [R],
 * value tile [B*D], then the R query rows of T. */
#define DEFINE_TILE(NAME, T, SCORES, VALUES, LOAD, STORE)                                                 \
static void NAME(const T *query, const T *kc, const T *vc, T *out, const int32_t *table, int64_t tok0,   \
                 int64_t pos0, int64_t count, int64_t h, const Shape *s, float *scratch) {                \
    const int64_t G = s->num_heads / s->num_kv_heads, D = s->head_size, B = s->block_size, R = count * G; \
    const int64_t Hkv = s->num_kv_heads, tile_size = B * D, last_pos = pos0 + count - 1;                 \
    float *qf = scratch, *ktile = qf + R * D, *S = ktile + B * D, *acc = S + R * B + VL, *m = acc + R * D; \
    float *l = m + R, *vtile = l + R;                                                                    \
    T *q = (T *)(vtile + B * D);                                                                         \
    for (int64_t i = 0; i < count; i++)                                                                  \
        memcpy(q + i * G * D, query + (tok0 + i) * s->q_token_stride + h * G * D, sizeof(T) * G * D);   \
    for (int64_t i = 0; i < R * D; i++) qf[i] = LOAD(q[i]), acc[i] = 0.f;                              \
    for (int64_t r = 0; r < R; r++) m[r] = -INFINITY, l[r] = 0.f;                                        \
    const int64_t lo = (s->window > 0 && pos0 - s->window + 1 > 0) ? pos0 - s->window + 1 : 0;           \
    const int64_t first = lo / B, last = last_pos / B;                                                   \
    for (int64_t b = first; b <= last && b < first + PREFETCH_AHEAD; b++)                               \
        prefetch_tile(kc + ((int64_t)table[b] * Hkv + h) * tile_size, tile_size * (int64_t)sizeof(T), 3); \
    for (int64_t b = first; b <= last; b++) {                                                            \
        const int64_t base = ((int64_t)table[b] * Hkv + h) * tile_size;                                  \
        const int64_t t0 = b == first ? lo - b * B : 0, t1 = b == last ? last_pos - b * B + 1 : B;       \
        if (b + PREFETCH_AHEAD <= last)                                                                  \
            prefetch_tile(kc + ((int64_t)table[b + PREFETCH_AHEAD] * Hkv + h) * tile_size,               \
                          tile_size * (int64_t)sizeof(T), 3);                                            \
        prefetch_tile(vc + base, tile_size * (int64_t)sizeof(T), 3);                                     \
        SCORES(q, qf, kc + base, ktile, S, R, D, B);                                                     \
        for (int64_t r = 0; r < R; r++) { /* keys [a, e) of the block are the row's */                   \
            const int64_t pos = pos0 + r / G;                                                            \
            const int64_t row_lo = (s->window > 0 && pos - s->window + 1 > 0) ? pos - s->window + 1 : 0; \
            const int64_t a = row_lo - b * B > t0 ? row_lo - b * B : t0;                                 \
            const int64_t e = pos - b * B + 1 < t1 ? pos - b * B + 1 : t1;                               \
            float *x = S + r * B;                                                                        \
            if (a >= e) {                                                                                \
                for (int64_t t = t0; t < t1; t++) x[t] = 0.f;                                            \
                continue;                                                                                \
            }                                                                                            \
            const float alpha = online_softmax_row(x, t0, t1, a, e, s->scale, s->soft_cap, m + r, l + r); \
            if (alpha != 1.f)                                                                            \
                for (int64_t d = 0; d < D; d++) acc[r * D + d] *= alpha;                                 \
        }                                                                                                \
        VALUES(S, vc + base, vtile, acc, R, D, B, t0, t1);                                               \
    }                                                                                                    \
    for (int64_t r = 0; r < R; r++) {                                                                    \
        const float inv = 1.f / l[r];                                                                    \
        T *o = out + (tok0 + r / G) * s->o_token_stride + (h * G + r % G) * D;                            \
        for (int64_t d = 0; d < D; d++) o[d] = STORE(acc[r * D + d] * inv);                              \
    }                                                                                                    \
}

DEFINE_TILE(tile_f32, float, SCORES_F32, weigh_values_f32, load_f32, store_f32)
DEFINE_TILE(tile_bf16, bf16_t, SCORES_BF16, weigh_values_bf16, bf16_to_f32, f32_to_bf16)

/* Whether bf16 prefill tiles run on AMX tiles (amx_attention.h): set by podium_attention_amx once the
 * process holds AMX permission (native_kernels.py, after amx_linear.c's podium_amx_init) */
static int amx_tiles_on;

/* Use AMX tiles for bf16 prefill tiles (on != 0) or not; returns whether they now are (0 where this
 * build has no AMX) */
int podium_attention_amx(int on) {
    amx_tiles_on = HAVE_AMX_ATTENTION && on;
    return amx_tiles_on;
}

/* the floats of scratch a bf16 call's AMX or AVX512-BF16 lane tiles need, for tiles of up to R rows
 * (0: neither runs) */
static size_t bf16_tile_floats(int64_t R, const Shape *s, const Step *st) {
#if HAVE_DPBF16_TILE
    const size_t lanes = dpbf16_tile_fits(R, s->head_size, s->block_size, s->soft_cap)
                             ? dpbf16_tile_floats(R, s->head_size, s->block_size) : 0;
#else
    const size_t lanes = 0;
    (void)R, (void)s;
#endif
#if HAVE_AMX_ATTENTION
    if (!amx_tiles_on || !s->amx_tiles || !amx_tile_fits(s->head_size, s->block_size)) return lanes;
    int64_t blocks = 1; /* the most key blocks one tile reads */
    for (int64_t i = 0; i < st->num_tiles; i++) {
        const int64_t pos0 = st->tiles[4 * i + 2], last = (pos0 + st->tiles[4 * i + 3] - 1) / s->block_size;
        const int64_t lo = s->window > 0 && pos0 - s->window + 1 > 0 ? pos0 - s->window + 1 : 0;
        blocks = last - lo / s->block_size + 1 > blocks ? last - lo / s->block_size + 1 : blocks;
    }
    const size_t amx = amx_tile_floats(R, blocks);
    return amx > lanes ? amx : lanes;
#else
    (void)st;
    return lanes;
#endif
}

/* a bf16 prefill tile: on AMX tiles where they run this shape, else with rows across the lanes where
 * AVX512-BF16 runs it (dpbf16_attention.h), else DEFINE_TILE's */
static void tile_bf16_any(const bf16_t *query, const bf16_t *kc, const bf16_t *vc, bf16_t *out, const int32_t *table,
                          int64_t tok0, int64_t pos0, int64_t count, int64_t h, const Shape *s, float *scratch) {
#if HAVE_AMX_ATTENTION
    if (amx_tiles_on && s->amx_tiles && amx_tile_fits(s->head_size, s->block_size)) {
        amx_tile(query, kc, vc, out, table, tok0, pos0, count, h, s->num_heads / s->num_kv_heads, s->num_kv_heads,
                 s->q_token_stride, s->o_token_stride, s->window, s->scale, s->soft_cap, scratch);
        return;
    }
#endif
#if HAVE_DPBF16_TILE
    const int64_t G = s->num_heads / s->num_kv_heads;
    if (dpbf16_tile_fits(count * G, s->head_size, s->block_size, s->soft_cap)) {
        dpbf16_tile(query, kc, vc, out, table, tok0, pos0, count, G, s->num_kv_heads, h, s->q_token_stride,
                    s->o_token_stride, s->head_size, s->block_size, s->window, s->scale, scratch);
        return;
    }
#endif
    tile_bf16(query, kc, vc, out, table, tok0, pos0, count, h, s, scratch);
}
/* float32 tiles have no AMX form */
static size_t no_amx_floats(int64_t R, const Shape *s, const Step *st) {
    (void)R, (void)s, (void)st;
    return 0;
}

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
#define DEFINE_ENTRY(NAME, ITEM, TILE, TILE_EXTRA, WRITE, ROTATE, T)                                  \
int NAME(const T *query, const T *key, const T *value, T *kc, T *vc, T *out, const Step *st,          \
         const Shape *s, int num_threads) {                                                           \
    const int64_t G = s->num_heads / s->num_kv_heads, D = s->head_size, B = s->block_size;            \
    const int64_t Hkv = s->num_kv_heads, items = st->num_tokens * Hkv, tiles = st->num_tiles * Hkv;   \
    const int64_t span = s->window > 0 && s->window < st->max_span ? s->window : st->max_span;        \
    const int64_t R = st->max_tile * G; /* a tile's rows at most */                                   \
    const size_t item_floats = items ? (size_t)(2 * G * D + B * D + G * B + G * span) : 0;            \
    const size_t tile_floats = tiles ? (size_t)(2 * R * D + 2 * B * D + R * B + VL + 2 * R) +         \
                                       (sizeof(T) * R * D + sizeof(float) - 1) / sizeof(float) : 0;   \
    const size_t extra = tiles ? TILE_EXTRA(R, s, st) : 0;                                            \
    const size_t most = item_floats > tile_floats ? item_floats : tile_floats;                        \
    const size_t floats = most > extra ? most : extra;                                                \
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
        float *scratch = floats ? (float *)thread_scratch(sizeof(float) * floats) : NULL;             \
        if (floats && !scratch) failed = 1;                                                           \
        _Pragma("omp for schedule(dynamic, 1) nowait") /* the tiles first, in the order given */      \
        for (int64_t it = 0; it < tiles; it++) {                                                      \
            if (!scratch || failed) continue;                                                         \
            const int64_t *tile = st->tiles + 4 * (it / Hkv);                                         \
            TILE(q, kc, vc, out, st->block_tables + tile[0] * st->bt_stride, tile[1], tile[2], tile[3], \
                 it % Hkv, &sq, scratch);                                                             \
        }                                                                                             \
        _Pragma("omp for schedule(dynamic, ITEM_CHUNK)")                                              \
        for (int64_t it = 0; it < items; it++) {                                                      \
            if (!scratch || failed) continue;                                                         \
            const int64_t i = it / Hkv, h = it % Hkv, seq = st->seqs[i];                              \
            const int64_t pos = st->seq_lens ? (int64_t)st->seq_lens[seq] - 1 : st->positions[i];     \
            /* the item this thread takes next, when its chunk of ITEM_CHUNK has one */              \
            const int64_t nx = (it + 1) % ITEM_CHUNK && it + 1 < items ? it + 1 : -1;                 \
            const int64_t ni = nx < 0 ? 0 : nx / Hkv, nseq = st->seqs[ni];                            \
            const int64_t npos = nx < 0 ? 0 : st->seq_lens ? (int64_t)st->seq_lens[nseq] - 1 : st->positions[ni]; \
            ITEM(q, kc, vc, out, st->block_tables + seq * st->bt_stride, st->tokens[i], pos, h, &sq,  \
                 scratch, nx < 0 ? NULL : st->block_tables + nseq * st->bt_stride, npos, nx < 0 ? 0 : nx % Hkv); \
        }                                                                                             \
    }                                                                                                 \
    return failed ? -1 : 0;                                                                           \
}

DEFINE_ENTRY(podium_paged_attention_f32, item_f32, tile_f32, no_amx_floats, write_token_f32, rotate_f32, float)
DEFINE_ENTRY(podium_paged_attention_bf16, item_bf16, tile_bf16_any, bf16_tile_floats, write_token_bf16, rotate_bf16, bf16_t)

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
