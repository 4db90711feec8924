/* gguf_linear.c's batch on AMX tiles (AMX-INT8): the same integer sums as its AVX2 paths, scaled by
 * the same float32 operations in the same order, so a row's result is bit for bit what those give
 * (and what it gives alone, in a decode call).
 *
 * Roles: the weights are AMX's A operand and the quantized x rows its B operand, so a weight row's
 * chunk unpacks to 32 contiguous int8 (gguf_unpack.h's q_<type>_v, no transposition), while x,
 * quantized once per call, is written straight in B's layout (gguf_xquant.h's tiles):
 *
 *     A  weights  [16 weight rows][32 q]          int8, one chunk: a 16 x 32-byte tile
 *     B  x        [8][16 x rows][4 q_x]           int8, the same chunk: 8 x 64 bytes
 *     C  A . B    [16 weight rows][16 x rows]     int32 sum(q q_x) of the chunk, exact (TDPBSSD)
 *
 * One TDPBSSD per chunk, half a tile's 64-byte depth: the next chunk has other scales, so two chunks
 * cannot share a sum (the tiles are far from the bound; the float work per chunk is). Q6_K's
 * multiplier changes every 16 weights: two TDPBSSD of depth 16, and the chunk's sum
 * mult0 S0 + mult1 S1 taken in float32, exactly (|S mult| < 2^23, |sum| < 2^24). Each C row is then
 * what chunk_step adds for 16 x rows at once (lanes: x rows):
 *
 *     acc[n] = fma(float(C[n]) * d_x, scale[n], acc[n]);  acc[n] = fma(s_x, bias_c[n], acc[n])
 *
 * Work: threads take 16 weight rows at a time; each unpacks its rows' chunks and scales once
 * (A tiles [C][16][32] in its scratch) and walks the x rows 16 at a time, four sums in flight.
 * Tiles: 0-3 C, 4-5 A, 6-7 B, configured and released by each thread of a call; the process holds
 * AMX permission before podium_gguf_amx turns this on (native_kernels.py).
 *
 * Without AMX, AVX-512 VNNI computes the same C from the same A and B (vnni_sums): row n of C is 16
 * lanes (the x rows), and each 4-deep step of it is one vpdpbusd of A's 4 bytes of weight row n in
 * every lane against B's 64-byte row (16 x rows x 4 q_x). vpdpbusd's first operand is unsigned: the
 * q of Q4_0, Q4_1, Q4_K and Q5_K are (0..31); signed q (Q8_0, Q6_K) are unpacked with 128 added
 * (q ^ 0x80) and 128 sum(q_x) over the chunk (or half), one more vpdpbusd a B row, comes off.
 * The same exact int32 sums, then the same scaling as the tiles: 8 vpdpbusd a chunk for 16 x 16 sums
 * of 64 products each, where the AVX2 path takes a 32-product vpdpbusd and a reduction per chunk and
 * pair of rows. Included by gguf_linear.c only. */
#ifndef PODIUM_GGUF_AMX_H
#define PODIUM_GGUF_AMX_H

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__) && defined(__AVX2__)
#define HAVE_GGUF_AMX 1
#else
#define HAVE_GGUF_AMX 0
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__) && defined(__AVX2__)
#define HAVE_GGUF_VNNI512 1
#else
#define HAVE_GGUF_VNNI512 0
#endif

#if HAVE_GGUF_AMX || HAVE_GGUF_VNNI512
#include <immintrin.h>

#include "gguf_unpack.h"
#include "gguf_xquant.h"
#include "scratch.h"

#define AMX_SUMS 4  /* C tiles in flight */

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} gguf_tile_config;

/* depth: bytes of K a product takes, 32 (a chunk) or 16 (a Q6_K half) */
#if HAVE_GGUF_AMX
static void gguf_configure_tiles(int depth) {
    gguf_tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 4; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    for (int t = 4; t < 6; t++) cfg.rows[t] = 16, cfg.colsb[t] = (uint16_t)depth;
    for (int t = 6; t < 8; t++) cfg.rows[t] = (uint8_t)(depth / 4), cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}
#endif

/* A weight row group's chunks unpacked: q [C][16][32] int8 (for vnni_sums, signed q with 128 added,
 * as uint8), scale and bias_c [C][16] float32, Q6_K's multipliers [C][2][16] float32 */
typedef struct {
    int8_t *q;
    float *scale, *bias, *mult;
} atiles;

static inline size_t atiles_bytes(int64_t C) { return (size_t)C * (512 + 4 * 16 * sizeof(float)) + 64; }

static inline atiles atiles_at(void *mem, int64_t C) {
    atiles a;
    a.q = (int8_t *)(((uintptr_t)mem + 63) & ~(uintptr_t)63);
    a.scale = (float *)(a.q + C * 512), a.bias = a.scale + C * 16, a.mult = a.bias + C * 16;
    return a;
}

/* The 16 rows' scales of chunk c by gathers: the 4 bytes at `at` of each row (rows: the rows' byte
 * offsets from w), and their halves as fp16 -> float32 */
typedef struct {
    const uint8_t *w;
    __m512i rows;
} group16;

static inline __m512i gather16(group16 g, int64_t at) {
    return _mm512_i32gather_epi32(_mm512_add_epi32(g.rows, _mm512_set1_epi32((int)at)), g.w, 1);
}
static inline __m512 low_half(__m512i v) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)); }
static inline __m512 high_half(__m512i v) { return low_half(_mm512_srli_epi32(v, 16)); }

/* (scale, bias_c) of scales_<type> (gguf_unpack.h) for 16 rows, the same float operations */
static inline void scales16_q4_0(group16 g, int64_t c, __m512 *d, __m512 *b, __m512 *m0, __m512 *m1) {
    (void)m0, (void)m1;
    *d = low_half(gather16(g, 18 * c)), *b = _mm512_mul_ps(*d, _mm512_set1_ps(-8.f));
}
static inline void scales16_q4_1(group16 g, int64_t c, __m512 *d, __m512 *b, __m512 *m0, __m512 *m1) {
    (void)m0, (void)m1;
    const __m512i v = gather16(g, 20 * c);
    *d = low_half(v), *b = high_half(v);
}
static inline void scales16_q8_0(group16 g, int64_t c, __m512 *d, __m512 *b, __m512 *m0, __m512 *m1) {
    (void)m0, (void)m1;
    *d = low_half(gather16(g, 34 * c)), *b = _mm512_setzero_ps();
}
/* Q4_K, Q5_K: k_scale_min's 6-bit scale and min of sub-block j from the 12 bytes s[0..11] at at + 4 */
static inline void k_scales16(group16 g, int64_t c, int64_t bytes, __m512 *d, __m512 *b) {
    const int64_t at = (c >> 3) * bytes;
    const int j = (int)(c & 7), shift = 8 * (j & 3);
    const __m512i head = gather16(g, at), s_lo = gather16(g, at + 4), s_mid = gather16(g, at + 8);
    const __m512i six = _mm512_set1_epi32(63), four = _mm512_set1_epi32(15), three = _mm512_set1_epi32(3);
    __m512i sc, mn;
    if (j < 4) {  /* s[j] & 63, s[j + 4] & 63 */
        sc = _mm512_and_si512(_mm512_srli_epi32(s_lo, shift), six);
        mn = _mm512_and_si512(_mm512_srli_epi32(s_mid, shift), six);
    } else {      /* s[j + 4] low | s[j - 4] >> 6 << 4, s[j + 4] high | s[j] >> 6 << 4 */
        const __m512i s_hi = _mm512_srli_epi32(gather16(g, at + 12), shift);
        const __m512i top_lo = _mm512_and_si512(_mm512_srli_epi32(s_lo, shift + 6), three);
        const __m512i top_mid = _mm512_and_si512(_mm512_srli_epi32(s_mid, shift + 6), three);
        sc = _mm512_or_si512(_mm512_and_si512(s_hi, four), _mm512_slli_epi32(top_lo, 4));
        mn = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(s_hi, 4), four), _mm512_slli_epi32(top_mid, 4));
    }
    *d = _mm512_mul_ps(low_half(head), _mm512_cvtepi32_ps(sc));
    *b = _mm512_xor_ps(_mm512_mul_ps(high_half(head), _mm512_cvtepi32_ps(mn)), _mm512_set1_ps(-0.f));
}
static inline void scales16_q4_k(group16 g, int64_t c, __m512 *d, __m512 *b, __m512 *m0, __m512 *m1) {
    (void)m0, (void)m1;
    k_scales16(g, c, 144, d, b);
}
static inline void scales16_q5_k(group16 g, int64_t c, __m512 *d, __m512 *b, __m512 *m0, __m512 *m1) {
    (void)m0, (void)m1;
    k_scales16(g, c, 176, d, b);
}
static inline void scales16_q6_k(group16 g, int64_t c, __m512 *d, __m512 *b, __m512 *m0, __m512 *m1) {
    const int64_t at = (c >> 3) * 210;
    *d = high_half(gather16(g, at + 206)), *b = _mm512_setzero_ps();  /* d: bytes 208-209, the block's last */
    const __m512i sc = gather16(g, at + 192 + 2 * (c & 7));            /* int8 sc[2j], sc[2j + 1] */
    *m0 = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(sc, 24), 24));
    *m1 = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(sc, 16), 24));
}

#if HAVE_GGUF_AMX
/* Up to AMX_SUMS sums of a step, each into C tile U through A tile TA and B tile TB (literals: GCC's
 * tile intrinsics paste them into the instruction), then stored to isum [U][16][16]: sum U is chunk
 * c0 + U / per_chunk (its half U % per_chunk for Q6_K). The stores come after all products: a
 * store waits for its product's latency, and the tiles seemed to run one instruction after another */
#define TILE_PRODUCT(U, TA, TB)                                                                          \
    if ((U) < sums) {                                                                                    \
        const int64_t c = c0 + (U) / per_chunk, h = (U) % per_chunk;                                     \
        _tile_zero(U);                                                                                   \
        _tile_loadd(TA, aq + 512 * c + 16 * h, 32);                                                      \
        _tile_loadd(TB, xb + 512 * c + 256 * h, 64);                                                     \
        _tile_dpbssd(U, TA, TB);                                                                         \
    }
#define TILE_STORE(U) if ((U) < sums) _tile_stored(U, isum + 256 * (U), 64);
static inline void tile_sums(const int8_t *aq, const int8_t *xb, int64_t c0, int64_t C, const int per_chunk,
                             int32_t *isum) {
    const int64_t sums = (C - c0) * per_chunk < AMX_SUMS ? (C - c0) * per_chunk : AMX_SUMS;
    TILE_PRODUCT(0, 4, 6) TILE_PRODUCT(1, 5, 7) TILE_PRODUCT(2, 4, 6) TILE_PRODUCT(3, 5, 7)
    TILE_STORE(0) TILE_STORE(1) TILE_STORE(2) TILE_STORE(3)
}
#endif

#if HAVE_GGUF_VNNI512
/* -128 sum(q_x) of the 16 x rows over B's first `steps` rows (4 q_x of each x row a row): where A holds
 * signed q + 128, the sums' start */
static inline __m512i minus_128_x(const int8_t *b, int steps) {
    __m512i xsum = _mm512_setzero_si512();
    for (int t = 0; t < steps; t++)
        xsum = _mm512_dpbusd_epi32(xsum, _mm512_set1_epi8(1), _mm512_loadu_si512(b + 64 * t));
    return _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(xsum, 7));
}

/* sum[n] (lanes: the 16 x rows) += A's weight row n (at a + 32 n) . B, over B's first `steps` rows, n < R */
static inline __attribute__((always_inline)) void dpbusd_rows(__m512i *sum, const int8_t *a, const int8_t *b,
                                                              int steps, const int R) {
    for (int t = 0; t < steps; t++) {
        const __m512i bt = _mm512_loadu_si512(b + 64 * t);
#pragma GCC unroll 16
        for (int n = 0; n < R; n++) {
            int32_t w4;
            memcpy(&w4, a + 32 * n + 4 * t, 4);
            sum[n] = _mm512_dpbusd_epi32(sum[n], _mm512_set1_epi32(w4), bt);
        }
    }
}

/* tile_sums' sums without tiles (see the top): sum U of the step from chunk c0 into isum [U][16][16],
 * row n's 16 lanes the x rows; SIGNED: A holds q + 128 */
static inline void vnni_sums(const int8_t *aq, const int8_t *xb, int64_t c0, int64_t C, const int per_chunk,
                             const int SIGNED, int32_t *isum) {
    const int64_t sums = (C - c0) * per_chunk < AMX_SUMS ? (C - c0) * per_chunk : AMX_SUMS;
    const int steps = 8 / per_chunk; /* B's rows in a sum */
    for (int64_t u = 0; u < sums; u++) {
        const int64_t c = c0 + u / per_chunk, h = u % per_chunk;
        const int8_t *a = aq + 512 * c + 16 * h, *b = xb + 512 * c + 256 * h;
        const __m512i start = SIGNED ? minus_128_x(b, steps) : _mm512_setzero_si512();
        __m512i acc[16];
        for (int n = 0; n < 16; n++) acc[n] = start;
        dpbusd_rows(acc, a, b, steps, 16);
        for (int n = 0; n < 16; n++) _mm512_store_si512(isum + 256 * u + 16 * n, acc[n]);
    }
}
#endif

/* r[i][l] <- r[l][i]: bit k of the row and lane indices swapped for k = 8, 4, 2, 1, each a permute of
 * row pairs (i, i + k) by constant indices (built at run time, their stores stalled the loads) */
#define LANE_LO(k, l) ((l) & (k) ? 16 + (l) - (k) : (l))
#define LANE_HI(k, l) ((l) & (k) ? 16 + (l) : (l) + (k))
#define LANES(F, k) _mm512_setr_epi32(F(k, 0), F(k, 1), F(k, 2), F(k, 3), F(k, 4), F(k, 5), F(k, 6), F(k, 7), \
                                      F(k, 8), F(k, 9), F(k, 10), F(k, 11), F(k, 12), F(k, 13), F(k, 14), F(k, 15))
static inline void swap_bit(__m512 r[16], const int k, __m512i lo, __m512i hi) {
    for (int i = 0; i < 16; i++) {
        if (i & k) continue;
        const __m512 a = r[i], b = r[i + k];
        r[i] = _mm512_permutex2var_ps(a, lo, b), r[i + k] = _mm512_permutex2var_ps(a, hi, b);
    }
}
static inline void transpose16(__m512 r[16]) {
    swap_bit(r, 8, LANES(LANE_LO, 8), LANES(LANE_HI, 8));
    swap_bit(r, 4, LANES(LANE_LO, 4), LANES(LANE_HI, 4));
    swap_bit(r, 2, LANES(LANE_LO, 2), LANES(LANE_HI, 2));
    swap_bit(r, 1, LANES(LANE_LO, 1), LANES(LANE_HI, 1));
}

/* out rows m0 .. m0 + rows - 1, columns n0 .. n0 + cols - 1 from acc[n] (lanes: x rows) + the bias,
 * rounded as store_rows does */
static inline void store_tile(__m512 acc[16], int64_t rows, int64_t n0, int64_t cols, const float *bias,
                              void *out, int64_t out_stride, int out_bf16) {
    const __mmask16 mask = (__mmask16)((1u << cols) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
    transpose16(acc);
    for (int64_t m = 0; m < rows; m++) {
        const __m512 y = bias ? _mm512_add_ps(acc[m], b) : acc[m];
        if (out_bf16) {
            const vh h = narrowv((vf)y);
            __m256i bits;
            memcpy(&bits, &h, sizeof bits);
            _mm256_mask_storeu_epi16((bf16_t *)out + m * out_stride + n0, mask, bits);
        } else {
            _mm512_mask_storeu_ps((float *)out + m * out_stride + n0, mask, y);
        }
    }
}

#if HAVE_GGUF_VNNI512
/* amx_rows without tiles or isum, for formats with one sum a chunk (not Q6_K): out rows m0 .. m0 + 15
 * (those below M) of the group's columns. A chunk's 16 sums are made and scaled 8 weight rows at a
 * time in registers (8 int32 sums, 16 float32 accumulators: lanes the x rows), by amx_chunk's float
 * operations in its order, so the results are the tiles' and the AVX2 path's bit for bit. */
static inline __attribute__((always_inline)) void vnni_rows(atiles a, const xtiles *xt, int64_t m0, int64_t M,
                                                            int64_t C, int64_t n0, int64_t cols, const float *bias,
                                                            void *out, int64_t out_stride, int is_bf16,
                                                            const int SIGNED, const int HAS_BIAS) {
    const int8_t *xb = xt->q + m0 * C * 32; /* (m0 / 16) * C * 512 */
    __m512 acc[16];
#pragma GCC unroll 16
    for (int n = 0; n < 16; n++) acc[n] = _mm512_setzero_ps();
    for (int64_t c = 0; c < C; c++) {
        const int8_t *aq = a.q + 512 * c, *b = xb + 512 * c;
        const __m512 dx = _mm512_loadu_ps(xt->d + c * xt->Mp + m0), sx = _mm512_loadu_ps(xt->s + c * xt->Mp + m0);
        const __m512i start = SIGNED ? minus_128_x(b, 8) : _mm512_setzero_si512();
#pragma GCC unroll 2
        for (int g = 0; g < 16; g += 8) { /* unrolled: acc stays in registers */
            __m512i sum[8];
            for (int n = 0; n < 8; n++) sum[n] = start;
            dpbusd_rows(sum, aq + 32 * g, b, 8, 8);
#pragma GCC unroll 8
            for (int n = 0; n < 8; n++) {
                const __m512 f = _mm512_cvtepi32_ps(sum[n]);
                const int64_t at = 16 * c + g + n;
                acc[g + n] = _mm512_fmadd_ps(_mm512_mul_ps(f, dx), _mm512_set1_ps(a.scale[at]), acc[g + n]);
                if (HAS_BIAS) acc[g + n] = _mm512_fmadd_ps(sx, _mm512_set1_ps(a.bias[at]), acc[g + n]);
            }
        }
    }
    store_tile(acc, M - m0 < 16 ? M - m0 : 16, n0, cols, bias, (char *)out + m0 * out_stride * (is_bf16 ? 2 : 4),
               out_stride, is_bf16);
}
#define VNNI_ROWS(a, xt, m0, M, C, n0, cols, bias, out, out_stride, is_bf16, SIGNED, HAS_BIAS)           \
    vnni_rows(a, xt, m0, M, C, n0, cols, bias, out, out_stride, is_bf16, SIGNED, HAS_BIAS)
#else
#define VNNI_ROWS(a, xt, m0, M, C, n0, cols, bias, out, out_stride, is_bf16, SIGNED, HAS_BIAS) ((void)0)
#endif

/* A step's sums on the tiles or by vnni_sums (tiles: which), and the tiles' setup, in a build with either */
#if HAVE_GGUF_AMX && HAVE_GGUF_VNNI512
#define STEP_SUMS(tiles, SIGNED, a, xb, c0, C, per_chunk, isum)                                          \
    ((tiles) ? tile_sums((a).q, xb, c0, C, per_chunk, isum) : vnni_sums((a).q, xb, c0, C, per_chunk, SIGNED, isum))
#elif HAVE_GGUF_AMX
#define STEP_SUMS(tiles, SIGNED, a, xb, c0, C, per_chunk, isum) tile_sums((a).q, xb, c0, C, per_chunk, isum)
#else
#define STEP_SUMS(tiles, SIGNED, a, xb, c0, C, per_chunk, isum) vnni_sums((a).q, xb, c0, C, per_chunk, SIGNED, isum)
#endif
#if HAVE_GGUF_AMX
#define CONFIGURE_TILES(depth) gguf_configure_tiles(depth)
#define RELEASE_TILES() _tile_release()
#else
#define CONFIGURE_TILES(depth) ((void)0)
#define RELEASE_TILES() ((void)0)
#endif

#define DEFINE_AMX(TYPE, SIGNED, HAS_BIAS, MULT)                                                         \
/* The group's rows are contiguous: read them in order (q first, then the scales from cache) and ask \
 * for the next group's bytes meanwhile (next: 16 rows of it, or NULL), so the weights stream from    \
 * memory at its bandwidth rather than its latency */                                                  \
static void amx_unpack_##TYPE(const uint8_t *const rows[16], group16 g, int64_t C, int64_t row_bytes,   \
                              const uint8_t *next, atiles a, int tiles) {                                \
    const __m256i plus128 = _mm256_set1_epi8((char)(SIGNED && !tiles ? 0x80 : 0)); /* vnni_sums' bytes */ \
    for (int j = 0; j < 16; j++) {                                                                       \
        for (int64_t l = 0; next && l < row_bytes; l += 64) _mm_prefetch((const char *)next + j * row_bytes + l, _MM_HINT_T1); \
        for (int64_t c = 0; c < C; c++)                                                                  \
            _mm256_store_si256((__m256i *)(a.q + 512 * c + 32 * j),                                      \
                               _mm256_xor_si256(q_##TYPE##_v(rows[j], c), plus128));                     \
    }                                                                                                    \
    for (int64_t c = 0; c < C; c++) {                                                                    \
        __m512 d, b, m0 = _mm512_setzero_ps(), m1 = m0;                                                  \
        scales16_##TYPE(g, c, &d, &b, &m0, &m1);                                                         \
        _mm512_store_ps(a.scale + 16 * c, d), _mm512_store_ps(a.bias + 16 * c, b);                       \
        if (MULT) _mm512_store_ps(a.mult + 32 * c, m0), _mm512_store_ps(a.mult + 32 * c + 16, m1);       \
    }                                                                                                    \
}                                                                                                        \
/* acc[n] += chunk c's sums (isum: [per_chunk][16][16]) scaled, lanes the 16 x rows: chunk_step's order */ \
INLINE void amx_chunk_##TYPE(atiles a, const xtiles *xt, int64_t m0, int64_t c, const int32_t *isum,     \
                             __m512 acc[16]) {                                                           \
    const __m512 dx = _mm512_loadu_ps(xt->d + c * xt->Mp + m0), sx = _mm512_loadu_ps(xt->s + c * xt->Mp + m0); \
    _Pragma("GCC unroll 16")                                                                             \
    for (int n = 0; n < 16; n++) {                                                                       \
        __m512 f = _mm512_cvtepi32_ps(_mm512_load_si512(isum + 16 * n));                                 \
        if (MULT)  /* exact: see the top */                                                              \
            f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(isum + 256 + 16 * n)),              \
                                _mm512_set1_ps(a.mult[32 * c + 16 + n]), _mm512_mul_ps(f, _mm512_set1_ps(a.mult[32 * c + n]))); \
        acc[n] = _mm512_fmadd_ps(_mm512_mul_ps(f, dx), _mm512_set1_ps(a.scale[16 * c + n]), acc[n]);     \
        if (HAS_BIAS) acc[n] = _mm512_fmadd_ps(sx, _mm512_set1_ps(a.bias[16 * c + n]), acc[n]);          \
    }                                                                                                    \
}                                                                                                        \
/* out rows m0 .. m0 + 15 (those below M) of the group's columns: acc[n] (lanes: those x rows) = weight \
 * row n . the x rows over every chunk, kept in registers; a step's sums are on the tiles while the    \
 * step before is scaled (two isum buffers) */                                                           \
static void amx_rows_##TYPE(atiles a, const xtiles *xt, int64_t m0, int64_t M, int64_t C, int64_t n0,    \
                            int64_t cols, const float *bias, void *out, int64_t out_stride, int is_bf16,  \
                            int tiles) {                                                                 \
    const int per_chunk = MULT ? 2 : 1, step = AMX_SUMS / per_chunk;                                     \
    (void)tiles; /* a build with one of the two paths */                                                 \
    const int8_t *xb = xt->q + m0 * C * 32;  /* (m0 / 16) * C * 512 */                                   \
    int32_t isum[2][AMX_SUMS * 256] __attribute__((aligned(64)));                                        \
    __m512 acc[16];                                                                                      \
    _Pragma("GCC unroll 16")                                                                             \
    for (int n = 0; n < 16; n++) acc[n] = _mm512_setzero_ps();                                           \
    STEP_SUMS(tiles, SIGNED, a, xb, 0, C, per_chunk, isum[0]);                                           \
    for (int64_t c0 = 0, s = 0; c0 < C; c0 += step, s ^= 1) {                                            \
        if (c0 + step < C) STEP_SUMS(tiles, SIGNED, a, xb, c0 + step, C, per_chunk, isum[s ^ 1]);        \
        for (int64_t c = c0; c < c0 + step && c < C; c++)                                                \
            amx_chunk_##TYPE(a, xt, m0, c, isum[s] + 256 * per_chunk * (c - c0), acc);                   \
    }                                                                                                    \
    store_tile(acc, M - m0 < 16 ? M - m0 : 16, n0, cols, bias,                                           \
               (char *)out + m0 * out_stride * (is_bf16 ? 2 : 4), out_stride, is_bf16);                  \
}                                                                                                        \
static int amx_linear_##TYPE(const void *x, int64_t x_stride, int64_t M, const uint8_t *w, int64_t N,    \
                             int64_t K, int64_t row_bytes, const float *bias, void *out, int64_t out_stride, \
                             int is_bf16, int num_threads, int tiles) {                                  \
    xtiles xt;                                                                                           \
    if (quantize_tiles(x, x_stride, M, K, is_bf16, num_threads, &xt)) return -1;                         \
    const int64_t groups = (N + 15) / 16, C = K / 32;                                                    \
    int failed = 0;                                                                                      \
    _Pragma("omp parallel num_threads(num_threads) if (groups >= PARALLEL_MIN_GROUPS)")                   \
    {                                                                                                    \
        void *mem = thread_scratch(atiles_bytes(C));                                                     \
        if (!mem) failed = 1;                                                                            \
        if (tiles) CONFIGURE_TILES(MULT ? 16 : 32);                                                      \
        _Pragma("omp for schedule(static)")                                                              \
        for (int64_t grp = 0; grp < groups; grp++) {                                                     \
            if (!mem) continue;                                                                          \
            const int64_t n0 = 16 * grp, cols = N - n0 < 16 ? N - n0 : 16;                               \
            const uint8_t *rows[16];                                                                     \
            int32_t offsets[16];                                                                         \
            for (int j = 0; j < 16; j++) {  /* a short last group repeats its last row */                \
                offsets[j] = (int32_t)((j < cols ? j : cols - 1) * row_bytes);                           \
                rows[j] = w + n0 * row_bytes + offsets[j];                                               \
            }                                                                                            \
            const group16 g = {w + n0 * row_bytes, _mm512_loadu_si512(offsets)};                         \
            const atiles a = atiles_at(mem, C);                                                          \
            amx_unpack_##TYPE(rows, g, C, row_bytes, n0 + 32 <= N ? w + (n0 + 16) * row_bytes : NULL, a, tiles); \
            for (int64_t m0 = 0; m0 < M; m0 += 16)                                                       \
                if (tiles || MULT)                                                                       \
                    amx_rows_##TYPE(a, &xt, m0, M, C, n0, cols, bias, out, out_stride, is_bf16, tiles);  \
                else                                                                                     \
                    VNNI_ROWS(a, &xt, m0, M, C, n0, cols, bias, out, out_stride, is_bf16, SIGNED, HAS_BIAS); \
        }                                                                                                \
        if (tiles) RELEASE_TILES();                                                                      \
    }                                                                                                    \
    return failed ? -1 : 0;                                                                              \
}

#else /* a build with neither AMX-INT8 nor AVX-512 VNNI: the entry exists, and the switches keep it unused */
#define DEFINE_AMX(TYPE, SIGNED, HAS_BIAS, MULT)                                                         \
static int amx_linear_##TYPE(const void *x, int64_t x_stride, int64_t M, const uint8_t *w, int64_t N,    \
                             int64_t K, int64_t row_bytes, const float *bias, void *out, int64_t out_stride, \
                             int is_bf16, int num_threads, int tiles) {                                  \
    (void)x, (void)x_stride, (void)M, (void)w, (void)N, (void)K, (void)row_bytes, (void)bias, (void)out;  \
    (void)out_stride, (void)is_bf16, (void)num_threads, (void)tiles;                                     \
    return -1;                                                                                           \
}
#endif

#endif
