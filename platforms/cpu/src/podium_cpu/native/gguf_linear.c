/* Linear layers and the embedding over GGUF weights kept in ggml's block formats (layouts:
 * podium_plugin_api/gguf_blocks.py): out = x . w^T + bias on the blocks as stored.
 *
 * Entries, one per (block type, row type), with the plain linear's C signature (linear.h) so that a
 * decode step of them is captured and replayed like any other native linear (graphs.py):
 *
 *     podium_gguf_<type>_linear_<f32|bf16>(x, x_stride, M, w, N, K, bias, out, out_stride, threads)
 *     podium_gguf_<type>_embed_<f32|bf16>(w, num_rows, dim, ids, n, out, threads)
 *
 * Numerics (llama.cpp's): each x row is quantized to int8 per 32 values, x ~ d_x q_x with
 * d_x = max|x| / 127 and q_x = round(x / d_x) (to nearest even), and each weight chunk of 32 is
 * scale * mult * q + bias in integers (gguf_unpack.h), so a chunk's product is
 *
 *     scale d_x sum(mult q q_x)  +  bias s_x          (s_x = d_x sum(q_x))
 *
 * the sum exact in int32 (AVX2: u8 x s8 pair products, then pairs of those), the rest float32. The
 * activations' rounding (at most d_x / 2 a value, of the order of a bf16 row's) is all that differs
 * from x . dequantize(w)^T: far below the weights' own 4-8 bits.
 *
 * Work: a thread takes output columns NB at a time and multiplies every x row by them, two x rows
 * at a time, 8 chunks at a time: their 8 exact sums reduced into one vector whose lane i is chunk i's,
 * converted once and scaled by the 8 chunks' scales x d_x in one multiply-add (plus their bias x s_x).
 * A decode call (M <= 2) unpacks each weight chunk into a register where it is used; a batch unpacks
 * the NB rows into the thread's scratch once and reuses them for every x row. Both add the same
 * float32 terms in the same order, so a row's result does not depend on M.
 * Embedding rows are dequantized to float exactly (gguf_dequant.h). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "gguf_amx.h"
#include "gguf_dequant.h"
#include "gguf_unpack.h"
#include "gguf_xquant.h"
#include "scratch.h"

#define NB 8           /* output columns (weight rows) a thread takes at a time: a vector's lanes */
#define DIRECT_ROWS 2  /* calls of at most this many rows unpack weights into registers */
#define BATCH_ROWS 4   /* x rows a batch's pass multiplies */
#define PARALLEL_MIN_GROUPS 2
#define AMX_MIN_ROWS 8  /* calls of at least this many rows run on AMX tiles where on (gguf_amx.h): below, a
                           * tile of 16 x rows is mostly padding, and the VNNI path was as fast or faster */
#define INLINE static inline __attribute__((always_inline))

/* Whether batches run on AMX tiles: set by podium_gguf_amx once the process holds AMX permission
 * (native_kernels.py, after amx_linear.c's podium_amx_init); the tests turn it off to compare */
static int amx_on;

int podium_gguf_amx(int on) { /* on < 0: only answer */
    if (on >= 0) amx_on = HAVE_GGUF_AMX && on;
    return amx_on;
}

/* Whether batches that AMX does not take run gguf_amx.h's tile layout on AVX-512 VNNI instead (on
 * where built; the tests turn it off to compare with the AVX2 / VNNI-256 rows) */
static int vnni512_on = HAVE_GGUF_VNNI512;

int podium_gguf_vnni512(int on) { /* on < 0: only answer */
    if (on >= 0) vnni512_on = HAVE_GGUF_VNNI512 && on;
    return vnni512_on;
}


/* Q6_K's multipliers of chunk c: its two sub-block scales (one per 16 weights) as two int16 */
static inline int32_t q6_k_mult(const uint8_t *row, int64_t c) {
    const int8_t *sc = (const int8_t *)(SUPER(row, c, 210) + 192) + 2 * (c & 7);
    return (int32_t)((uint32_t)(uint16_t)sc[0] | ((uint32_t)(uint16_t)sc[1] << 16));
}

#if defined(__AVX2__)
/* sum(mult q q_x) of one chunk as 8 int32 lanes */
INLINE __m256i chunk_isum(__m256i w, __m256i x, __m256i mult, const int is_signed, const int has_mult) {
    if (is_signed) x = _mm256_sign_epi8(x, w), w = _mm256_sign_epi8(w, w);
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
    if (!has_mult) {  /* the same exact sums in one instruction */
#if defined(__AVXVNNI__)
        return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x);
#else
        return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
#endif
    }
#endif
    (void)has_mult;
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), mult);
}

static inline __m256i mult_vector(int32_t packed) {  /* words 0-7: the first multiplier, 8-15 the second */
    return _mm256_set_m128i(_mm_set1_epi16((short)(packed >> 16)), _mm_set1_epi16((short)(packed & 0xffff)));
}

/* lane j of the result: the sum of v[j]'s lanes */
static inline __m256i reduce8(const __m256i v[8]) {
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

/* v[j] (row j's 32 bytes as 8 groups of 4) -> v[t]: group t of each row j at bytes 4j .. 4j + 3 */
static inline void transpose8(__m256i v[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 2)
        t[i] = _mm256_unpacklo_epi32(v[i], v[i + 1]), t[i + 1] = _mm256_unpackhi_epi32(v[i], v[i + 1]);
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]), u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]), u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++)
        v[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20), v[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
}

/* acc (lane j: row j) += chunk sums x (scale d_x) + bias s_x: the one float order of both paths */
INLINE __m256 chunk_step(__m256i isum, scales8 s, float dx, float sx, __m256 acc, const int has_bias) {
    acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(dx)), s.d, acc);
    return has_bias ? _mm256_fmadd_ps(s.b, _mm256_set1_ps(sx), acc) : acc;
}

/* A batch's unpacked chunk of 8 rows (the thread's scratch): q transposed (w[t]: group t of each row),
 * for signed q their magnitudes too, the scales, and Q6_K's multipliers of the chunk's two halves */
typedef struct {
    __m256i w[8], magnitude[8], mult[2];
    float d[8], b[8];
} unpacked_chunk;

#define DEFINE_ROWS(TYPE, SIGNED, HAS_BIAS, MULT, MAX_Q)                                                 \
/* acc[r] (lane j) = rows[j] . x row m0 + r for r < R: each weight chunk unpacked into registers */     \
INLINE void direct_##TYPE(const uint8_t *const rows[8], const xquant *xq, int64_t m0, const int R, int64_t K, \
                          const uint8_t *next, int64_t next_lines, __m256 acc[DIRECT_ROWS]) {            \
    const int64_t Cp = padded_chunks(K), C = K / 32;                                                     \
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();                                            \
    for (int64_t c = 0; c < C; c++) {                                                                    \
        for (int64_t l = c * next_lines / C; l < (c + 1) * next_lines / C; l++)                          \
            _mm_prefetch((const char *)next + 64 * l, _MM_HINT_T0);                                      \
        __m256i x[DIRECT_ROWS], v[DIRECT_ROWS][8];                                                       \
        for (int r = 0; r < R; r++) x[r] = load32((const uint8_t *)xq->q + (m0 + r) * K + 32 * c);       \
        for (int j = 0; j < 8; j++) {                                                                    \
            const __m256i w = q_##TYPE##_v(rows[j], c);                                                  \
            const __m256i mult = MULT ? mult_vector(q6_k_mult(rows[j], c)) : _mm256_set1_epi16(1);       \
            for (int r = 0; r < R; r++) v[r][j] = chunk_isum(w, x[r], mult, SIGNED, MULT);               \
        }                                                                                                \
        const scales8 s = scales8_##TYPE(rows, c);                                                       \
        for (int r = 0; r < R; r++)                                                                      \
            acc[r] = chunk_step(reduce8(v[r]), s, xq->d[(m0 + r) * Cp + c], xq->s[(m0 + r) * Cp + c], acc[r], HAS_BIAS); \
    }                                                                                                    \
}                                                                                                        \
static void unpack_##TYPE(const uint8_t *const rows[8], int64_t K, unpacked_chunk *u) {                  \
    for (int64_t c = 0; c < K / 32; c++, u++) {                                                          \
        for (int j = 0; j < 8; j++) u->w[j] = q_##TYPE##_v(rows[j], c);                                  \
        transpose8(u->w);                                                                                \
        for (int t = 0; SIGNED && t < 8; t++) u->magnitude[t] = _mm256_sign_epi8(u->w[t], u->w[t]);      \
        const scales8 s = scales8_##TYPE(rows, c);                                                       \
        _mm256_storeu_ps(u->d, s.d), _mm256_storeu_ps(u->b, s.b);                                        \
        for (int half = 0; MULT && half < 2; half++) {                                                   \
            int16_t m[16];                                                                               \
            for (int j = 0; j < 8; j++) m[2 * j] = m[2 * j + 1] = (int16_t)(q6_k_mult(rows[j], c) >> (16 * half)); \
            memcpy(&u->mult[half], m, sizeof m);                                                         \
        }                                                                                                \
    }                                                                                                    \
}                                                                                                        \
/* the same sums from the unpacked rows: row j's 4-weight groups against x's, broadcast; unsigned q \
 * small enough (MAX_Q) sum 32767 / (254 MAX_Q) groups' pair products in int16 */                      \
INLINE void batch_##TYPE(const unpacked_chunk *u, const xquant *xq, int64_t m0, const int R, int64_t K,  \
                         __m256 acc[BATCH_ROWS]) {                                                       \
    const int64_t Cp = padded_chunks(K);                                                                 \
    const int run = SIGNED ? 1 : 32767 / (254 * (MAX_Q)) >= 8 ? 8 : 4;                                   \
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();                                            \
    for (int64_t c = 0; c < K / 32; c++, u++) {                                                          \
        const scales8 s = {_mm256_loadu_ps(u->d), _mm256_loadu_ps(u->b)};                                \
        for (int r = 0; r < R; r++) {                                                                    \
            const int32_t *x = (const int32_t *)(xq->q + (m0 + r) * K + 32 * c);                         \
            __m256i isum = _mm256_setzero_si256();                                                       \
            for (int t0 = 0; t0 < 8; t0 += run) {                                                        \
                __m256i p = _mm256_setzero_si256();                                                      \
                for (int t = t0; t < t0 + run; t++) {                                                    \
                    __m256i xt = _mm256_set1_epi32(x[t]);                                                \
                    if (SIGNED) xt = _mm256_sign_epi8(xt, u->w[t]);                                      \
                    p = _mm256_add_epi16(p, _mm256_maddubs_epi16(SIGNED ? u->magnitude[t] : u->w[t], xt)); \
                }                                                                                        \
                isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, MULT ? u->mult[t0 / 4] : _mm256_set1_epi16(1))); \
            }                                                                                            \
            acc[r] = chunk_step(isum, s, xq->d[(m0 + r) * Cp + c], xq->s[(m0 + r) * Cp + c], acc[r], HAS_BIAS); \
        }                                                                                                \
    }                                                                                                    \
}

/* out rows m0 .. m0 + R - 1, columns n0 + j for j < cols, from acc lanes (+ the layer's bias) */
static inline void store_rows(const __m256 *acc, int R, int64_t m0, int64_t n0, int64_t cols, const float *bias,
                              void *out, int64_t out_stride, int out_bf16) {
    for (int r = 0; r < R; r++) {
        float v[8];
        _mm256_storeu_ps(v, acc[r]);
        for (int64_t j = 0; j < cols; j++) {
            const float y = bias ? v[j] + bias[n0 + j] : v[j];
            const int64_t at = (m0 + r) * out_stride + n0 + j;
            if (out_bf16) ((bf16_t *)out)[at] = f32_to_bf16(y);
            else ((float *)out)[at] = y;
        }
    }
}

#define DEFINE_GROUP(TYPE)                                                                               \
/* one group of 8 rows (a short last group repeats its last row; its sums are dropped) for every x row */ \
static int group_##TYPE(const uint8_t *const rows[8], int64_t cols, int64_t n0, const xquant *xq, int64_t M, \
                        int64_t K, const float *bias, void *out, int64_t out_stride, int out_bf16,       \
                        const uint8_t *next, int64_t next_bytes) {                                       \
    if (M <= DIRECT_ROWS) {  /* a decode row streams the weights: the next group's are fetched meanwhile */ \
        __m256 acc[DIRECT_ROWS];                                                                         \
        if (M == 2) direct_##TYPE(rows, xq, 0, 2, K, next, (next_bytes + 63) / 64, acc);                 \
        else direct_##TYPE(rows, xq, 0, 1, K, next, (next_bytes + 63) / 64, acc);                        \
        store_rows(acc, (int)M, 0, n0, cols, bias, out, out_stride, out_bf16);                           \
        return 0;                                                                                        \
    }                                                                                                    \
    unpacked_chunk *u = thread_scratch((size_t)(K / 32) * sizeof(unpacked_chunk) + 32);                  \
    if (!u) return -1;                                                                                   \
    u = (unpacked_chunk *)(((uintptr_t)u + 31) & ~(uintptr_t)31);                                        \
    unpack_##TYPE(rows, K, u);                                                                           \
    for (int64_t m0 = 0; m0 < M; m0 += BATCH_ROWS) {                                                     \
        __m256 acc[BATCH_ROWS];                                                                          \
        const int R = M - m0 < BATCH_ROWS ? (int)(M - m0) : BATCH_ROWS;                                  \
        switch (R) {                                                                                     \
        case 4: batch_##TYPE(u, xq, m0, 4, K, acc); break;                                               \
        case 3: batch_##TYPE(u, xq, m0, 3, K, acc); break;                                               \
        case 2: batch_##TYPE(u, xq, m0, 2, K, acc); break;                                               \
        default: batch_##TYPE(u, xq, m0, 1, K, acc);                                                     \
        }                                                                                                \
        store_rows(acc, R, m0, n0, cols, bias, out, out_stride, out_bf16);                               \
    }                                                                                                    \
    return 0;                                                                                            \
}
#else
/* The same sums in plain C (a CPU without AVX2) */
#define DEFINE_ROWS(TYPE, SIGNED, HAS_BIAS, MULT, MAX_Q)
#define DEFINE_GROUP(TYPE)                                                                               \
static int group_##TYPE(const uint8_t *const rows[8], int64_t cols, int64_t n0, const xquant *xq, int64_t M, \
                        int64_t K, const float *bias, void *out, int64_t out_stride, int out_bf16,       \
                        const uint8_t *next, int64_t next_bytes) {                                       \
    (void)next, (void)next_bytes;                                                                        \
    const int64_t Cp = padded_chunks(K);                                                                 \
    for (int64_t j = 0; j < cols; j++)                                                                   \
        for (int64_t m = 0; m < M; m++) {                                                                \
            float acc = 0.f;                                                                             \
            for (int64_t c = 0; c < K / 32; c++) {                                                       \
                const chunk_scales s = scales_##TYPE(rows[j], c);                                        \
                int8_t w[32];                                                                            \
                q_##TYPE##_s(rows[j], c, w);                                                             \
                const int8_t *x = xq->q + m * K + 32 * c;                                                \
                int32_t isum = 0;                                                                        \
                for (int k = 0; k < 32; k++) isum += (int32_t)w[k] * x[k] * s.mult[k / 16];              \
                acc += (float)isum * xq->d[m * Cp + c] * s.scale + s.bias * xq->s[m * Cp + c];           \
            }                                                                                            \
            const float y = bias ? acc + bias[n0 + j] : acc;                                             \
            if (out_bf16) ((bf16_t *)out)[m * out_stride + n0 + j] = f32_to_bf16(y);                     \
            else ((float *)out)[m * out_stride + n0 + j] = y;                                            \
        }                                                                                                \
    return 0;                                                                                            \
}
#endif

/* out [M][out_stride] = x . w^T + bias (module comment) */
#define DEFINE_LINEAR(TYPE, QK, BYTES, SIGNED, HAS_BIAS, MULT, MAX_Q)                                    \
DEFINE_ROWS(TYPE, SIGNED, HAS_BIAS, MULT, MAX_Q)                                                         \
DEFINE_GROUP(TYPE)                                                                                       \
DEFINE_AMX(TYPE, SIGNED, HAS_BIAS, MULT)                                                                 \
static int linear_##TYPE(const xquant *xq, int64_t M, const uint8_t *w, int64_t N, int64_t K, const float *bias, \
                         void *out, int64_t out_stride, int out_bf16, int num_threads) {                 \
    const int64_t groups = (N + NB - 1) / NB, row_bytes = K / (QK) * (BYTES);                            \
    int failed = 0;                                                                                      \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (groups >= PARALLEL_MIN_GROUPS)") \
    for (int64_t grp = 0; grp < groups; grp++) {                                                         \
        const int64_t n0 = grp * NB, cols = N - n0 < NB ? N - n0 : NB;                                   \
        const uint8_t *rows[NB];                                                                         \
        for (int j = 0; j < NB; j++) rows[j] = w + (n0 + (j < cols ? j : cols - 1)) * row_bytes;         \
        const int64_t next_rows = N - n0 - NB < NB ? (N - n0 - NB > 0 ? N - n0 - NB : 0) : NB;           \
        if (group_##TYPE(rows, cols, n0, xq, M, K, bias, out, out_stride, out_bf16, w + (n0 + NB) * row_bytes, \
                         next_rows * row_bytes)) failed = 1;                                             \
    }                                                                                                    \
    return failed ? -1 : 0;                                                                              \
}

/* (type, weights and bytes a block, q signed, a bias term, Q6_K's multipliers, the largest q) */
DEFINE_LINEAR(q4_0, 32, 18, 0, 1, 0, 15)
DEFINE_LINEAR(q4_1, 32, 20, 0, 1, 0, 15)
DEFINE_LINEAR(q8_0, 32, 34, 1, 0, 0, 128)
DEFINE_LINEAR(q4_k, 256, 144, 0, 1, 0, 15)
DEFINE_LINEAR(q5_k, 256, 176, 0, 1, 0, 31)
DEFINE_LINEAR(q6_k, 256, 210, 1, 0, 1, 32)

/* The row loops are inlined into each format's entries, so each block function is a direct,
 * inlined call whose loops GCC vectorises, not a call through a pointer per block. */
INLINE void dequant_row(block_fn fn, int qk, int bytes, const uint8_t *row, int64_t K, float *y) {
    for (int64_t b = 0; b < K / qk; b++) fn(row + b * bytes, y + b * qk);
}

/* ids -> rows of w dequantized; -1 (nothing written) for an id outside [0, num_rows) */
INLINE int gguf_embed(block_fn fn, int qk, int bytes, const uint8_t *w, int64_t num_rows, int64_t dim,
                      const int64_t *ids, int64_t n, void *out, int out_bf16, int num_threads) {
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= num_rows) return -1;
    const int64_t row_bytes = dim / qk * bytes;
    int failed = 0;
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (n >= 8)")
    for (int64_t i = 0; i < n; i++) {
        float *row = out_bf16 ? thread_scratch((size_t)dim * sizeof(float)) : (float *)out + i * dim;
        if (!row) {
            failed = 1;
            continue;
        }
        dequant_row(fn, qk, bytes, w + ids[i] * row_bytes, dim, row);
        if (out_bf16)
            for (int64_t k = 0; k < dim; k++) ((bf16_t *)out)[i * dim + k] = f32_to_bf16(row[k]);
    }
    return failed ? -1 : 0;
}

#define DEFINE_GGUF(TYPE, FN, QK, BYTES)                                                                 \
static int gguf_linear_##TYPE(const void *x, int64_t x_stride, int64_t M, const uint8_t *w, int64_t N,   \
                              int64_t K, const float *bias, void *out, int64_t out_stride, int is_bf16,  \
                              int num_threads) {                                                         \
    if ((amx_on || vnni512_on) && M >= AMX_MIN_ROWS)                                                     \
        return amx_linear_##TYPE(x, x_stride, M, w, N, K, K / (QK) * (BYTES), bias, out, out_stride, is_bf16, \
                                 num_threads, amx_on);                                                   \
    xquant xq;                                                                                           \
    if (quantize_rows(x, x_stride, M, K, is_bf16, num_threads, &xq)) return -1;                          \
    return linear_##TYPE(&xq, M, w, N, K, bias, out, out_stride, is_bf16, num_threads);                  \
}                                                                                                        \
int podium_gguf_##TYPE##_linear_f32(const float *x, int64_t x_stride, int64_t M, const uint8_t *w,       \
                                    int64_t N, int64_t K, const float *bias, float *out, int64_t out_stride, \
                                    int num_threads) {                                                   \
    return gguf_linear_##TYPE(x, x_stride, M, w, N, K, bias, out, out_stride, 0, num_threads);           \
}                                                                                                        \
int podium_gguf_##TYPE##_linear_bf16(const bf16_t *x, int64_t x_stride, int64_t M, const uint8_t *w,     \
                                     int64_t N, int64_t K, const float *bias, bf16_t *out,               \
                                     int64_t out_stride, int num_threads) {                              \
    return gguf_linear_##TYPE(x, x_stride, M, w, N, K, bias, out, out_stride, 1, num_threads);           \
}                                                                                                        \
int podium_gguf_##TYPE##_embed_f32(const uint8_t *w, int64_t num_rows, int64_t dim, const int64_t *ids, \
                                   int64_t n, float *out, int num_threads) {                             \
    return gguf_embed(FN, QK, BYTES, w, num_rows, dim, ids, n, out, 0, num_threads);                     \
}                                                                                                        \
int podium_gguf_##TYPE##_embed_bf16(const uint8_t *w, int64_t num_rows, int64_t dim, const int64_t *ids, \
                                    int64_t n, bf16_t *out, int num_threads) {                           \
    return gguf_embed(FN, QK, BYTES, w, num_rows, dim, ids, n, out, 1, num_threads);                     \
}

DEFINE_GGUF(q4_0, block_q4_0, 32, 18)
DEFINE_GGUF(q4_1, block_q4_1, 32, 20)
DEFINE_GGUF(q8_0, block_q8_0, 32, 34)
DEFINE_GGUF(q4_k, block_q4_k, 256, 144)
DEFINE_GGUF(q5_k, block_q5_k, 256, 176)
DEFINE_GGUF(q6_k, block_q6_k, 256, 210)
