/* Fused elementwise ops of a decoder layer, one pass over memory each, with the exact rounding
 * steps of the pure-torch references in podium_plugin_api/ops.py:
 *
 *   rms_norm            out = w * to_dtype(x * rsqrt(mean(x^2) + eps))   (x in float32)
 *   fused_add_rms_norm  s = to_dtype(x + residual); (rms_norm(s), s)
 *   rotary_embedding    neox rotate-half: [x1 c - x2 s, x2 c + x1 s] in float32, then to_dtype
 *   silu_and_mul        to_dtype(to_dtype(g / (1 + e^-g)) * u)               (g, u in float32)
 *
 * Compiled with -ffp-contract=off so a*b - c*d rounds like torch's separate kernels: the rotary
 * embedding equals the reference bit for bit. rms_norm's sum of squares runs in another order than
 * torch's reduction, so it may differ from the reference by float32 rounding, and SiLU's e^x
 * (fast_exp.h) is not torch's (a sweep of every bf16 gate still rounded to torch's results; in
 * float32 a few ulps). Rows go VL floats at a time (GCC vector extensions, bf16.h)
 * with scalar or padded tails. Below PARALLEL_MIN elements an op runs on the calling thread:
 * waking a sleeping OpenMP worker costs more than the work.
 * The caller (fused_ops.py) validates shapes, strides and dtypes; this code trusts them.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "bf16.h"
#include "prologue.h"
#include "rotary.h"
#include "transpose.h"

#define PARALLEL_MIN 65536       /* elements of a norm or rotary call */
#define SILU_PARALLEL_MIN 16384  /* output elements of silu_and_mul: e^x and a division each */

/* rows of x [rows, cols] (row stride x_stride); residual may be NULL (then sum_out is unused);
 * out and sum_out contiguous. */
#define DEFINE_RMS_NORM(NAME, T, ROW)                                                                 \
int NAME(const T *x, int64_t x_stride, const T *res, int64_t res_stride, const T *w, T *out, T *sum_out, \
         int64_t rows, int64_t cols, float eps, int num_threads) {                                    \
    if (rows * cols < PARALLEL_MIN) { /* no OpenMP region at all: even a one-thread team costs */    \
        for (int64_t r = 0; r < rows; r++)                                                            \
            ROW(x + r * x_stride, res ? res + r * res_stride : NULL, w, out + r * cols,               \
                res ? sum_out + r * cols : NULL, cols, eps);                                          \
        return 0;                                                                                     \
    }                                                                                                 \
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)")                             \
    for (int64_t r = 0; r < rows; r++)                                                                \
        ROW(x + r * x_stride, res ? res + r * res_stride : NULL, w, out + r * cols,                   \
            res ? sum_out + r * cols : NULL, cols, eps);                                              \
    return 0;                                                                                         \
}
DEFINE_RMS_NORM(podium_rms_norm_bf16, bf16_t, norm_row)
DEFINE_RMS_NORM(podium_rms_norm_f32, float, norm_row_f32)

/* x [rows, 2I] = [gate | up] (row stride x_stride) -> out [rows, I] contiguous, silu(gate) * up:
 * torch's silu then mul, each rounded to the row type (prologue.h). */
#define DEFINE_SILU_AND_MUL(NAME, T, ROW)                                                             \
int NAME(const T *x, int64_t x_stride, T *out, int64_t rows, int64_t I, int num_threads) {           \
    _Pragma("omp parallel for num_threads(num_threads) schedule(static) if (rows * I >= SILU_PARALLEL_MIN)") \
    for (int64_t r = 0; r < rows; r++) ROW(x + r * x_stride, out + r * I, I);                         \
    return 0;                                                                                         \
}
DEFINE_SILU_AND_MUL(podium_silu_and_mul_bf16, bf16_t, silu_mul_row)
DEFINE_SILU_AND_MUL(podium_silu_and_mul_f32, float, silu_mul_row_f32)

/* q [T, H, D] (token stride q_stride, heads contiguous), k [T, Hkv, D] likewise; cos_sin
 * [num_positions, D] float32 (cos | sin); outputs contiguous. Returns 0, or -1 (nothing written)
 * when a position is outside [0, num_positions). */
#define DEFINE_ROTARY(NAME, ROTATE, T)                                                                \
int NAME(const T *q, int64_t q_stride, const T *k, int64_t k_stride, T *q_out, T *k_out,              \
         const int64_t *positions, const float *cos_sin, int64_t num_positions, int64_t tokens,        \
         int64_t H, int64_t Hkv, int64_t D, int num_threads) {                                        \
    for (int64_t t = 0; t < tokens; t++)                                                              \
        if (positions[t] < 0 || positions[t] >= num_positions) return -1;                             \
    _Pragma("omp parallel for num_threads(num_threads) if (tokens * (H + Hkv) * D >= PARALLEL_MIN)")         \
    for (int64_t t = 0; t < tokens; t++) {                                                            \
        const float *cs = cos_sin + positions[t] * D;                                                 \
        ROTATE(q + t * q_stride, q_out + t * H * D, cs, H, D);                                        \
        ROTATE(k + t * k_stride, k_out + t * Hkv * D, cs, Hkv, D);                                    \
    }                                                                                                 \
    return 0;                                                                                         \
}

DEFINE_ROTARY(podium_rotary_f32, rotate_f32, float)
DEFINE_ROTARY(podium_rotary_bf16, rotate_bf16, bf16_t)

/* The embedding lookup: out [n, dim] = table [ids[i]] for table [num_rows, dim] (rows contiguous).
 * Returns 0, or -1 (nothing written) when an id is outside [0, num_rows). */
#define DEFINE_EMBED(NAME, T)                                                                         \
int NAME(const T *table, int64_t num_rows, int64_t dim, const int64_t *ids, int64_t n, T *out,        \
         int num_threads) {                                                                           \
    for (int64_t i = 0; i < n; i++)                                                                   \
        if (ids[i] < 0 || ids[i] >= num_rows) return -1;                                              \
    _Pragma("omp parallel for num_threads(num_threads) if (n * dim >= 4 * PARALLEL_MIN)")             \
    for (int64_t i = 0; i < n; i++) memcpy(out + i * dim, table + ids[i] * dim, (size_t)dim * sizeof(T)); \
    return 0;                                                                                         \
}

DEFINE_EMBED(podium_embed_rows_f32, float)
DEFINE_EMBED(podium_embed_rows_bf16, bf16_t)

/* The same lookup from a tied LM head's packed weight (linear_packing.py's layouts), so a model
 * whose embedding is its head keeps one copy of the table. Row r of the [num_rows, dim] weight is
 * column r of the packed matrix: every 16th value of its panel (FMA panels), or one bf16 of every
 * 32-bit word of its AMX tile column. Reads stride through memory (one cache line a k or k pair), a
 * few microseconds a row: a decode step's handful of tokens is nothing beside its matmuls. */
#define PANEL_AT(r, dim, SLOT) (((r) >> 4) * (dim) * 16 + SLOT((r) & 15))
#define NATURAL_SLOT(j) (j)
#define FMA_SLOT(j) (((j) & 3) | (((j) & 4) << 1) | (((j) & 8) >> 1)) /* fma_linear.c's SLOT */
#define DEFINE_PANEL_ROWS(NAME, T, SLOT)                                                              \
int NAME(const T *panels, int64_t num_rows, int64_t dim, const int64_t *ids, int64_t n, T *out,       \
         int num_threads) {                                                                           \
    for (int64_t i = 0; i < n; i++)                                                                   \
        if (ids[i] < 0 || ids[i] >= num_rows) return -1;                                              \
    _Pragma("omp parallel for num_threads(num_threads) if (n * dim >= 4 * PARALLEL_MIN)")             \
    for (int64_t i = 0; i < n; i++) {                                                                 \
        const T *src = panels + PANEL_AT(ids[i], dim, SLOT);                                          \
        T *dst = out + i * dim;                                                                       \
        for (int64_t k = 0; k < dim; k++) dst[k] = src[k * 16];                                       \
    }                                                                                                 \
    return 0;                                                                                         \
}

DEFINE_PANEL_ROWS(podium_panel_rows_f32, float, NATURAL_SLOT)
DEFINE_PANEL_ROWS(podium_panel_rows_bf16, bf16_t, FMA_SLOT)

/* AMX tiles [N/16][K/32][16 k pairs][16 columns][2]: value (r, k) is half k % 2 of the word of
 * column r % 16, k pair (k % 32) / 2, in tile (r / 16, k / 32). */
int podium_tile_rows_bf16(const bf16_t *tiles, int64_t num_rows, int64_t dim, const int64_t *ids, int64_t n,
                          bf16_t *out, int num_threads) {
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= num_rows) return -1;
    const int64_t kb = (dim + 31) / 32;
#pragma omp parallel for num_threads(num_threads) if (n * dim >= 4 * PARALLEL_MIN)
    for (int64_t i = 0; i < n; i++) {
        const bf16_t *block = tiles + (ids[i] >> 4) * kb * 512 + (ids[i] & 15) * 2;
        bf16_t *dst = out + i * dim;
        for (int64_t k = 0; k < dim; k++) dst[k] = block[(k >> 5) * 512 + ((k & 31) >> 1) * 32 + (k & 1)];
    }
    return 0;
}

/* Rows 0 .. rows-1 of dst (dst_stride bytes apart) get words r of src's 16 rows of 16 32-bit words
 * (64 bytes apart): a 16 x 16 transpose of words (transpose.h with AVX-512, else word by word). */
static inline void transpose_words(const void *src, void *dst, int64_t dst_stride, int64_t rows) {
#ifdef __AVX512F__
    __m512i v[16];
    for (int i = 0; i < 16; i++) v[i] = _mm512_loadu_si512((const char *)src + 64 * i);
    transpose16_words(v);
    for (int64_t r = 0; r < rows; r++) _mm512_storeu_si512((char *)dst + r * dst_stride, v[r]);
#else
    for (int64_t r = 0; r < rows; r++) {
        uint32_t line[16];
        for (int i = 0; i < 16; i++) memcpy(&line[i], (const char *)src + 64 * i + 4 * r, 4);
        memcpy((char *)dst + r * dst_stride, line, 64);
    }
#endif
}

/* The plain [n, k] weight's rows [n0, n1) (n0 a multiple of 16) rebuilt from its AMX tiles
 * (linear_packing.amx_tiles: [N/16, K/32, 16 pairs, 16 rows, 2]) into out (leading dimension ld):
 * what oneDNN multiplies above the AMX kernel's rows, so the plain weight need not stay resident.
 * A tile's pair p of row r is one 32-bit word, so a full 32-column tile is a 16 x 16 transpose of
 * words; padded column blocks go element by element. */
int podium_tile_unpack_bf16(const bf16_t *tiles, int64_t n, int64_t k, int64_t n0, int64_t n1, bf16_t *out,
                            int64_t ld, int num_threads) {
    if (n0 < 0 || n1 > n || n0 > n1 || (n0 & 15) || ld < k) return -1;
    const int64_t kb_count = (k + 31) / 32, full = k / 32;
#pragma omp parallel for num_threads(num_threads) schedule(static) if ((n1 - n0) * k >= 4 * PARALLEL_MIN)
    for (int64_t b = n0 >> 4; b < (n1 + 15) >> 4; b++) {
        const int64_t rows = b * 16 + 16 <= n1 ? 16 : n1 - b * 16;
        for (int64_t kb = 0; kb < kb_count; kb++) {
            const bf16_t *tile = tiles + (b * kb_count + kb) * 512;
            bf16_t *dst = out + (b * 16 - n0) * ld + kb * 32;
            if (kb < full) {  /* 16 pairs (rows of the tile) of 16 rows' words -> 16 rows of 16 pairs */
                transpose_words(tile, dst, 2 * ld, rows);
                continue;
            }
            for (int64_t r = 0; r < rows; r++)
                for (int64_t c = 0; c < k - kb * 32; c++) dst[r * ld + c] = tile[(c >> 1) * 32 + r * 2 + (c & 1)];
        }
    }
    return 0;
}

/* The plain [n, k] float32 weight's rows [n0, n1) (n0 a multiple of 16) rebuilt from its FMA panels
 * (linear_packing.f32_panels: [panels][K][16], a k's 16 columns contiguous) into out (leading
 * dimension ld): 16 k's of a panel are a 16 x 16 transpose of words, the K tail element by element. */
int podium_panel_unpack_f32(const float *panels, int64_t n, int64_t k, int64_t n0, int64_t n1, float *out,
                            int64_t ld, int num_threads) {
    if (n0 < 0 || n1 > n || n0 > n1 || (n0 & 15) || ld < k) return -1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if ((n1 - n0) * k >= 4 * PARALLEL_MIN)
    for (int64_t p = n0 >> 4; p < (n1 + 15) >> 4; p++) {
        const int64_t rows = p * 16 + 16 <= n1 ? 16 : n1 - p * 16;
        const float *panel = panels + p * k * 16;
        float *dst = out + (p * 16 - n0) * ld;
        int64_t k0 = 0;
        for (; k0 + 16 <= k; k0 += 16)  /* 16 k's of 16 columns -> 16 columns of 16 k's */
            transpose_words(panel + k0 * 16, dst + k0, 4 * ld, rows);
        for (int64_t r = 0; r < rows; r++)
            for (int64_t kk = k0; kk < k; kk++) dst[r * ld + kk] = panel[kk * 16 + r];
    }
    return 0;
}

/* Structured output's mask, in place: logits[rows[i]][t] = -inf where bit t % 32 of word t / 32 of
 * mask row i is clear (a forbidden token), for t < vocab; rows may be NULL (row i for mask row i).
 * Only forbidden entries are written; a word of all-allowed tokens (all bits set, the common case
 * of a permissive grammar) is skipped, one of all-forbidden tokens is a plain fill. */
#define DEFINE_TOKEN_BITMASK(NAME, T, NEG_INF)                                                        \
int NAME(T *logits, int64_t row_stride, const int32_t *mask, int64_t words, const int64_t *rows,     \
         int64_t n, int64_t vocab, int num_threads) {                                                 \
    _Pragma("omp parallel for num_threads(num_threads) if (n * vocab >= 16 * PARALLEL_MIN)")          \
    for (int64_t i = 0; i < n; i++) {                                                                 \
        T *row = logits + (rows ? rows[i] : i) * row_stride;                                          \
        const uint32_t *bits = (const uint32_t *)(mask + i * words);                                  \
        for (int64_t w = 0; w < words; w++) {                                                         \
            uint32_t word = bits[w];                                                                  \
            if (word == 0xffffffffu) continue;                                                        \
            int64_t base = w * 32, count = vocab - base < 32 ? vocab - base : 32;                     \
            if (word == 0) {                                                                          \
                for (int64_t b = 0; b < count; b++) row[base + b] = NEG_INF;                          \
                continue;                                                                             \
            }                                                                                         \
            for (int64_t b = 0; b < count; b++)                                                       \
                if (!((word >> b) & 1u)) row[base + b] = NEG_INF;                                     \
        }                                                                                             \
    }                                                                                                 \
    return 0;                                                                                         \
}

DEFINE_TOKEN_BITMASK(podium_token_bitmask_f32, float, -INFINITY)
DEFINE_TOKEN_BITMASK(podium_token_bitmask_bf16, bf16_t, (bf16_t)0xFF80)

/* Greedy sampling's argmax: out[r] = the first index of row r's maximum, NaN counting as the
 * maximum (torch.argmax's rule), x [rows, vocab] (row stride x_stride). One pass a row: each lane
 * keeps its largest value and where it first saw it (a later equal value does not replace it), so
 * the answer is the smallest index among the lanes holding the row's maximum; a row holding a NaN
 * is scanned again for its first NaN. torch's CPU argmax over a long row ran ~10x slower than a
 * max; this reads the logits once. */
#define DEFINE_ARGMAX(NAME, T, LOADV, LOAD)                                                           \
int NAME(const T *x, int64_t x_stride, int64_t rows, int64_t vocab, int64_t *out, int num_threads) {  \
    _Pragma("omp parallel for num_threads(num_threads) schedule(static) if (rows * vocab >= 16 * PARALLEL_MIN)") \
    for (int64_t r = 0; r < rows; r++) {                                                              \
        const T *row = x + r * x_stride;                                                              \
        int64_t i = 0, best_at = 0;                                                                   \
        float best = LOAD(row[0]);                                                                    \
        int nan = best != best;                                                                       \
        if (vocab >= VL) {                                                                            \
            vf top = LOADV(row);                                                                      \
            vi at, lane = {0};                                                                        \
            for (int k = 0; k < VL; k++) at[k] = k, lane[k] = k;                                      \
            vi any_nan = (vi)(top != top);                                                            \
            for (i = VL; i + VL <= vocab; i += VL) {                                                  \
                const vf v = LOADV(row + i);                                                          \
                const vi more = (vi)(v > top);                                                        \
                any_nan |= (vi)(v != v);                                                              \
                top = selectv(more, v, top);                                                          \
                at = (more & (lane + (int32_t)i)) | (~more & at);                                     \
            }                                                                                         \
            for (int k = 0; k < VL; k++) nan |= any_nan[k] != 0;                                      \
            best = top[0], best_at = at[0];                                                           \
            for (int k = 1; k < VL; k++)                                                              \
                if (top[k] > best || (top[k] == best && at[k] < best_at)) best = top[k], best_at = at[k]; \
        } else {                                                                                      \
            i = 1;                                                                                    \
        }                                                                                             \
        for (; i < vocab; i++) { /* the tail (or a short row) */                                      \
            const float v = LOAD(row[i]);                                                             \
            nan |= v != v;                                                                            \
            if (v > best) best = v, best_at = i;                                                      \
        }                                                                                             \
        if (nan)                                                                                      \
            for (i = 0; i < vocab; i++)                                                               \
                if (LOAD(row[i]) != LOAD(row[i])) {                                                   \
                    best_at = i;                                                                      \
                    break;                                                                            \
                }                                                                                     \
        out[r] = best_at;                                                                             \
    }                                                                                                 \
    return 0;                                                                                         \
}

DEFINE_ARGMAX(podium_argmax_f32, float, loadv, load_f32)
DEFINE_ARGMAX(podium_argmax_bf16, bf16_t, loadv_bf16, bf16_to_f32)
