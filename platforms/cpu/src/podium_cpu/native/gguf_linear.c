/* Linear layers and the embedding over GGUF weights kept in ggml's block formats (layouts:
 * podium_plugin_api/gguf_blocks.py): out = x . dequantize(w)^T + bias, dequantized inside the kernel.
 *
 * Entries, one per (block type, row type), with the plain linear's C signature (linear.h) so that a
 * decode step of them is captured and replayed like any other native linear (graphs.py):
 *
 *     podium_gguf_<type>_linear_<f32|bf16>(x, x_stride, M, w, N, K, bias, out, out_stride, threads)
 *     podium_gguf_<type>_embed_<f32|bf16>(w, num_rows, dim, ids, n, out, threads)
 *
 * Work: the output columns in groups of NB; a thread takes a group, dequantizes its NB weight rows
 * into its float32 scratch once (NB x K floats: 24 KB at K = 1536, in L1/L2), then multiplies every
 * x row by them, MB rows at a time with MB x NB vector sums (x loaded once per NB columns, each
 * weight vector once per MB rows). x rows are widened to float32 once per call. So a batch-1 GEMV
 * reads the packed weights once and a batch of M rows dequantizes each weight once per call.
 * Vectors are VL lanes (bf16.h): AVX-512 zmm where the CPU has it, AVX2 ymm otherwise; the
 * dequantization loops are plain C that GCC vectorises for the same target.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "scratch.h"

#define NB 4 /* output columns (weight rows) of a group */
#define MB 4 /* x rows of a register block: MB x NB = 16 vector sums */
#define PARALLEL_MIN_GROUPS 2

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

/* The row loops are inlined into each format's entries (always_inline), so each block function is a
 * direct, inlined call whose loops GCC vectorises, not a call through a pointer per block. */
#define INLINE static inline __attribute__((always_inline))

/* one weight row of K columns (K / qk blocks of `bytes` each) -> float32 */
INLINE void dequant_row(block_fn fn, int qk, int bytes, const uint8_t *row, int64_t K, float *y) {
    for (int64_t b = 0; b < K / qk; b++) fn(row + b * bytes, y + b * qk);
}

static inline float hsum(vf v) {
    float s = 0.f;
    for (int i = 0; i < VL; i++) s += v[i];
    return s;
}

/* sums[MB][NB] = rows x[0..MB) . w[0..NB) over K (K a multiple of VL: every format's block is) */
static inline void block_dot(const float *const *x, const float *w, int64_t K, float sums[MB][NB]) {
    vf acc[MB][NB];
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NB; j++) acc[i][j] = (vf){0};
    for (int64_t k = 0; k < K; k += VL) {
        vf wv[NB];
        for (int j = 0; j < NB; j++) wv[j] = loadv(w + j * K + k);
        for (int i = 0; i < MB; i++) {
            const vf xv = loadv(x[i] + k);
            for (int j = 0; j < NB; j++) acc[i][j] += xv * wv[j];
        }
    }
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NB; j++) sums[i][j] = hsum(acc[i][j]);
}

/* sums[NB] = one x row . w[0..NB) over K: the rows a full MB block does not cover (a decode row) */
static inline void row_dot(const float *x, const float *w, int64_t K, float sums[NB]) {
    vf acc[NB];
    for (int j = 0; j < NB; j++) acc[j] = (vf){0};
    for (int64_t k = 0; k < K; k += VL) {
        const vf xv = loadv(x + k);
        for (int j = 0; j < NB; j++) acc[j] += xv * loadv(w + j * K + k);
    }
    for (int j = 0; j < NB; j++) sums[j] = hsum(acc[j]);
}

/* x float32 rows [M][x_stride]; out [M][out_stride] through `store` (float or bf16) */
INLINE int gguf_linear(block_fn fn, int qk, int bytes, const float *x, int64_t x_stride, int64_t M,
                       const uint8_t *w, int64_t N, int64_t K, const float *bias, void *out, int64_t out_stride,
                       int out_bf16, int num_threads) {
    const int64_t groups = (N + NB - 1) / NB, row_bytes = K / qk * bytes;
    int failed = 0;
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (groups >= PARALLEL_MIN_GROUPS)")
    for (int64_t g = 0; g < groups; g++) {
        float *wf = thread_scratch((size_t)NB * K * sizeof(float));  /* the group's rows, dequantized */
        if (!wf) {
            failed = 1;
            continue;
        }
        const int64_t n0 = g * NB, cols = N - n0 < NB ? N - n0 : NB;
        for (int j = 0; j < NB; j++)  /* a short last group repeats its last row (its sums are dropped) */
            dequant_row(fn, qk, bytes, w + (n0 + (j < cols ? j : cols - 1)) * row_bytes, K, wf + j * K);
        for (int64_t m0 = 0; m0 < M; m0 += MB) {
            const int64_t rows = M - m0 < MB ? M - m0 : MB;
            float sums[MB][NB];
            if (rows == MB) {
                const float *xr[MB];
                for (int i = 0; i < MB; i++) xr[i] = x + (m0 + i) * x_stride;
                block_dot(xr, wf, K, sums);
            } else {
                for (int64_t i = 0; i < rows; i++) row_dot(x + (m0 + i) * x_stride, wf, K, sums[i]);
            }
            for (int64_t i = 0; i < rows; i++)
                for (int64_t j = 0; j < cols; j++) {
                    const float v = bias ? sums[i][j] + bias[n0 + j] : sums[i][j];
                    const int64_t at = (m0 + i) * out_stride + n0 + j;
                    if (out_bf16) ((bf16_t *)out)[at] = f32_to_bf16(v);
                    else ((float *)out)[at] = v;
                }
        }
    }
    return failed ? -1 : 0;
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

/* A second per-thread buffer for the widened x rows: the calling thread is also one of the team
 * whose thread_scratch holds dequantized weight rows. */
static float *x_scratch(size_t bytes) {
    static __thread float *buffer;
    static __thread size_t capacity;
    if (bytes > capacity) {
        float *grown = malloc(bytes);
        if (!grown) return NULL;
        free(buffer);
        buffer = grown, capacity = bytes;
    }
    return buffer;
}

/* bf16 x rows widened to this thread's float32 x scratch [M][K] */
static const float *widen_rows(const bf16_t *x, int64_t x_stride, int64_t M, int64_t K) {
    float *xf = x_scratch((size_t)M * K * sizeof(float));
    if (!xf) return NULL;
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k++) xf[m * K + k] = bf16_to_f32(x[m * x_stride + k]);
    return xf;
}

#define DEFINE_GGUF(TYPE, FN, QK, BYTES)                                                                 \
int podium_gguf_##TYPE##_linear_f32(const float *x, int64_t x_stride, int64_t M, const uint8_t *w,       \
                                    int64_t N, int64_t K, const float *bias, float *out, int64_t out_stride, \
                                    int num_threads) {                                                   \
    return gguf_linear(FN, QK, BYTES, x, x_stride, M, w, N, K, bias, out, out_stride, 0, num_threads);   \
}                                                                                                        \
int podium_gguf_##TYPE##_linear_bf16(const bf16_t *x, int64_t x_stride, int64_t M, const uint8_t *w,     \
                                     int64_t N, int64_t K, const float *bias, bf16_t *out,               \
                                     int64_t out_stride, int num_threads) {                              \
    const float *xf = widen_rows(x, x_stride, M, K);                                                     \
    if (!xf) return -1;                                                                                  \
    return gguf_linear(FN, QK, BYTES, xf, K, M, w, N, K, bias, out, out_stride, 1, num_threads);         \
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
