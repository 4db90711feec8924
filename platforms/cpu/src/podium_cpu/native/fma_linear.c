/* Linear layers on the FMA units (linear.h says what every linear kernel computes):
 *
 *   float32   out = x . w^T + bias on AVX-512 (zmm) or AVX2 (ymm) FMAs, float32 weights;
 *   bfloat16  the same with bf16 weights widened in registers and float32 sums, on AVX2, for CPUs
 *             whose oneDNN has no bf16 matmul (AVX2 without AVX-512: AMD Zen 2/3, older Intel),
 *             where torch's bf16 F.linear runs ~5x slower than its float32 one.
 *
 * Weight layouts (packed once at load, linear_packing.py): panels of 16 output columns stored
 * k-major, so one k's 16 weights are contiguous:
 *
 *     float32   packed [G * 4][K][16]   N padded with zero columns to G * 64: a register block's
 *                                       4 panels always exist (the AVX2 build skips the padding)
 *     bfloat16  packed [N/16][K][16]    N padded to a multiple of 16; a k's 16 columns in the order
 *                                       two in-lane 16-bit unpacks with zero widen into columns 0-7
 *                                       and 8-15 (a bf16 is the top half of its float32): memory
 *                                       holds columns 0-3, 8-11, 4-7, 12-15 (SLOT)
 *
 * Work items are (chunk of CHUNK rows, column group); an item walks its chunk ROWS rows at a time,
 * each row block keeping ROWS x GROUP_VECTORS accumulators over all K: per k, the group's weight
 * vectors loaded (or widened) once, ROWS broadcasts of x, ROWS x GROUP_VECTORS FMAs. A group is 4
 * panels (4 zmm) with AVX-512 and 1 panel (2 ymm) with AVX2: 24 of 32 zmm or 12 of 16 ymm hold
 * sums. A decode step's batch is one chunk, so the weights stream from memory once per call.
 * bf16 x rows are widened to float32 once per call into the calling thread's scratch; float32 x
 * rows are read in place unless a prologue computes them first. On AMD Zen 3 the bf16 kernel's
 * in-register widening is faster than widening each panel once per item into a float32 scratch at
 * every row count, most at 1 row (no panel pass for one row); 4-row blocks and blocking K were
 * slower. Register blocks write their sums to the item's [rows][group] scratch and
 * the rounding follows all of them (with the sums of one block in a small local, GCC 12 kept a
 * weight vector in memory and reloaded it in each FMA).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "linear.h"
#include "scratch.h"

#define PANEL 16      /* output columns of a panel */
#define F32_GROUP 4   /* panels the float32 layout pads N to a multiple of */
#define ROWS 6        /* rows of a register block */
#define CHUNK 48      /* rows of a work item (8 row blocks): its float32 rows stay in L2 */
/* where column j of a bf16 panel sits among its k's 16 values: the order AVX2's in-lane 16-bit
 * unpacks widen into columns 0-7 (unpacklo) and 8-15 (unpackhi) */
#define SLOT(j) (((j) & 3) | (((j) & 4) << 1) | (((j) & 8) >> 1))

/* w [N, K] (rows contiguous) -> packed [panels][K][16], zero columns past N, column j of a panel at
 * slot(j); threads split panels. */
#define DEFINE_PACK(NAME, T, PANELS, AT)                                                                 \
int NAME(const T *w, int64_t N, int64_t K, T *packed, int num_threads) {                                 \
    const int64_t panels = PANELS;                                                                       \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)")           \
    for (int64_t p = 0; p < panels; p++) {                                                               \
        T *dst = packed + p * K * PANEL;                                                                 \
        for (int64_t j = 0; j < PANEL; j++) {                                                            \
            const int64_t n = p * PANEL + j, at = AT(j);                                                 \
            for (int64_t k = 0; k < K; k++) dst[k * PANEL + at] = n < N ? w[n * K + k] : 0;              \
        }                                                                                                \
    }                                                                                                    \
    return 0;                                                                                            \
}
#define IDENTITY(j) (j)
DEFINE_PACK(podium_fma_pack_bf16, bf16_t, (N + PANEL - 1) / PANEL, SLOT)
DEFINE_PACK(podium_fma_pack_f32, float, (N + PANEL * F32_GROUP - 1) / (PANEL * F32_GROUP) * F32_GROUP, IDENTITY)

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

int podium_fma_ready(void) { return 1; }

/* a * b + c, one rounding, on VL lanes (the sources are compiled with -ffp-contract=off) */
/* *p in every lane, as one broadcast load: `(vf){0} + *p` is a scalar add of +0.0 (kept: it turns
 * -0.0 into +0.0) and a register broadcast, two FP-pipe uops beside each row's FMAs, which held the
 * AVX2 kernel at ~50% of the FMA peak on Zen 3 */
#if VL == 16
static inline vf fmav(vf a, vf b, vf c) { return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
static inline vf bcastv(const float *p) { return (vf)_mm512_set1_ps(*p); }
#define GROUP_PANELS 4 /* float32 panels of a register block: 4 zmm */
#else
static inline vf fmav(vf a, vf b, vf c) { return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
static inline vf bcastv(const float *p) { return (vf)_mm256_broadcast_ss(p); }
#define GROUP_PANELS 1 /* one panel: 2 ymm */
#endif
#define PANEL_VECTORS (PANEL / VL)
#define GROUP_VECTORS (GROUP_PANELS * PANEL_VECTORS)
#define GROUP_COLS (GROUP_PANELS * PANEL)

/* Prefetch of the weights a thread's next item reads: its first row block reads them from memory,
 * the others from L2 while the FMAs are the bound. With AVX-512 each row block asks for its share of
 * the next item's lines into L2 (`lines` of them from `pf`, `per_k` a k), so the next item starts
 * with its weights at hand instead of waiting on memory for a whole row block. With AVX2 that per-k
 * loop cost more than it saved with the weights in cache (AMD Zen 3, float32 at SmolLM2's shapes,
 * 32 rows: 125-142 GF/s with it, 150-187 without); there the first row block alone asks for the
 * next item's whole panel (`pf`, its line k at each k: a float32 panel's k is one line, a bf16
 * panel's half of one) while it streams its own from memory. A decode step's linears, weights from
 * memory, on Zen 3 (python benchmarks/cpu_kernels.py --only step --seqs N --variant-flags=-DFMA_AHEAD=0):
 * 32 rows 0.98x the time in float32 and 0.94x in bf16, 1 row bf16 0.83-0.99x (median 0.91x); at 1 row float32 a
 * first version took 1.05-1.10x, so float32 rows alone do not ask (the entry). */
typedef struct {
    const char *pf;
    int64_t lines;
    int per_k;
} Ahead;

static inline __attribute__((always_inline)) void ask_ahead(const Ahead *ahead, int64_t k) {
    for (int j = 0; j < ahead->per_k; j++) {
        const int64_t line = k * ahead->per_k + j;
        if (line < ahead->lines) _mm_prefetch(ahead->pf + 64 * line, _MM_HINT_T1);
    }
}

#ifndef FMA_AHEAD /* 0: the AVX2 build asks for nothing ahead (benchmarks/cpu_kernels.py --variant-flags) */
#define FMA_AHEAD 1
#endif
/* The share of a row block b of `count` (lines of `bytes` from `next`, spread evenly; AVX2: all of
 * them, for the first row block only) */
static inline Ahead ahead_of(const void *next, int64_t bytes, int64_t b, int64_t count, int64_t K) {
#if VL != 16 /* the first row block asks for the whole next item */
    (void)count, (void)K;
    Ahead whole = {FMA_AHEAD && b == 0 && bytes > 0 ? (const char *)next : NULL, 0, 0};
    return whole;
#else
    const int64_t lines = (bytes + 63) / 64, share = (lines + count - 1) / count, first = b * share;
    Ahead ahead = {(const char *)next + 64 * first, first >= lines ? 0 : lines - first < share ? lines - first : share, 0};
    ahead.per_k = (int)((ahead.lines + K - 1) / K);
    return ahead;
#endif
}

/* c[r][0..NP * 16) = sum_k x[r][k] * w[k][...] for R rows of float32 x (row stride xs) and NP
 * float32 panels (panel stride K * 16); R and NP constants after inlining */
static inline __attribute__((always_inline)) void row_block_np(const float *restrict x, int64_t xs, int64_t K,
                                                                const float *restrict w, float *restrict c,
                                                                const int R, const Ahead ahead, const int NP) {
    const int NV = NP * PANEL_VECTORS;
    vf a[ROWS][GROUP_VECTORS];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NV; j++) a[r][j] = (vf){0};
    for (int64_t k = 0; k < K; k++) {
#if VL == 16
        ask_ahead(&ahead, k);
#else
        if (ahead.pf) _mm_prefetch(ahead.pf + 64 * k, _MM_HINT_T1);
#endif
        vf wv[GROUP_VECTORS];
        for (int j = 0; j < NV; j++)
            wv[j] = loadv(w + (j / PANEL_VECTORS) * K * PANEL + k * PANEL + (j % PANEL_VECTORS) * VL);
        for (int r = 0; r < R; r++) {
            const vf xr = bcastv(x + r * xs + k);
            for (int j = 0; j < NV; j++) a[r][j] = fmav(xr, wv[j], a[r][j]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NV; j++) storev(c + r * NP * PANEL + j * VL, a[r][j]);
}

/* a register group's panels, and two of them (a thread's last item of a decode batch's even split) */
static inline __attribute__((always_inline)) void row_block_f32(const float *restrict x, int64_t xs, int64_t K,
                                                                 const float *restrict w, float *restrict c,
                                                                 const int R, const Ahead ahead) {
    row_block_np(x, xs, K, w, c, R, ahead, GROUP_PANELS);
}
static inline __attribute__((always_inline)) void row_block_f32_pair(const float *restrict x, int64_t xs, int64_t K,
                                                                      const float *restrict w, float *restrict c,
                                                                      const int R, const Ahead ahead) {
    row_block_np(x, xs, K, w, c, R, ahead, 2);
}

/* The same for bf16 panels (SLOT order, one panel a group) widened in registers, on AVX2 */
static inline __attribute__((always_inline)) void row_block_bf16(const float *restrict x, int64_t xs, int64_t K,
                                                                  const bf16_t *restrict wp, float *restrict c,
                                                                  const int R, const Ahead ahead) {
    __m256 a[ROWS][2];
    const __m256i zero = _mm256_setzero_si256();
    for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
#if VL == 16
    (void)ahead; /* (AVX-512 builds: not measured) */
#endif
    for (int64_t k = 0; k < K; k++) {
#if VL != 16
        if (ahead.pf && !(k & 1)) _mm_prefetch(ahead.pf + 32 * k, _MM_HINT_T1);
#endif
        const __m256i v = _mm256_loadu_si256((const __m256i *)(wp + k * PANEL));
        const __m256 w0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));
        const __m256 w1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v));
        for (int r = 0; r < R; r++) {
            const __m256 xr = _mm256_broadcast_ss(x + r * xs + k);
            a[r][0] = _mm256_fmadd_ps(xr, w0, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(xr, w1, a[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(c + r * PANEL, a[r][0]);
        _mm256_storeu_ps(c + r * PANEL + 8, a[r][1]);
    }
}

/* Rows [m0, m0 + rows) of float32 input xf (row stride xs) x one column group from column n0: register blocks
 * of ROWS rows into the item's sums, then bias, the rounding and the store (columns past N
 * dropped). WIDTH: the group's columns; W_T: the weights' type. */
#define DEFINE_ITEM(NAME, W_T, T, BLOCK, WIDTH, STORE)                                                  \
static void NAME(const float *xf, int64_t xs, int64_t K, const W_T *group, int64_t n0, int64_t N,        \
                 const float *bias, T *out, int64_t out_stride, int64_t m0, int64_t rows,                \
                 const void *next, int64_t next_bytes) {                                                 \
    float c[CHUNK * WIDTH]; /* the item's sums, [rows][WIDTH] */                                         \
    const int64_t count = (rows + ROWS - 1) / ROWS; /* blocks as even as they go: 32 rows 6, 6, 5, 5, 5, 5 */ \
    for (int64_t b = 0, r0 = 0; b < count; b++) {                                                        \
        const int64_t rb = rows / count + (b < rows % count);                                            \
        const float *x = xf + (m0 + r0) * xs;                                                            \
        float *cr = c + r0 * WIDTH;                                                                      \
        const Ahead ahead = ahead_of(next, next ? next_bytes : 0, b, count, K);                          \
        r0 += rb;                                                                                        \
        switch (rb) {                                                                                    \
            case 6: BLOCK(x, xs, K, group, cr, 6, ahead); break;                                         \
            case 5: BLOCK(x, xs, K, group, cr, 5, ahead); break;                                         \
            case 4: BLOCK(x, xs, K, group, cr, 4, ahead); break;                                         \
            case 3: BLOCK(x, xs, K, group, cr, 3, ahead); break;                                         \
            case 2: BLOCK(x, xs, K, group, cr, 2, ahead); break;                                         \
            default: BLOCK(x, xs, K, group, cr, 1, ahead); break;                                        \
        }                                                                                                \
    }                                                                                                    \
    for (int64_t r = 0; r < rows; r++)                                                                   \
        for (int64_t j = 0; j < WIDTH && n0 + j < N; j += PANEL) {                                       \
            const int64_t cols = N - n0 - j < PANEL ? N - n0 - j : PANEL;                                \
            STORE(c + r * WIDTH + j, bias ? bias + n0 + j : NULL, out + (m0 + r) * out_stride + n0 + j, cols); \
        }                                                                                                \
}
DEFINE_ITEM(item_f32, float, float, row_block_f32, GROUP_COLS, store_sums_f32)
#if VL == 16
DEFINE_ITEM(item_f32_pair, float, float, row_block_f32_pair, 2 * PANEL, store_sums_f32)
#endif
DEFINE_ITEM(item_bf16, bf16_t, bf16_t, row_block_bf16, PANEL, store_sums_bf16)

/* bf16: every input row (the prologue's, else x's) widened into the float32 rows xf [M, K] */
static void stage_bf16(const bf16_t *x, int64_t x_stride, const Prologue *pro, int64_t m, int64_t K, bf16_t *h,
                       float *xf) {
    const bf16_t *row = input_row_bf16(x, x_stride, pro, m, K, h);
    for (int64_t k = 0; k < K; k++) xf[k] = bf16_to_f32(row[k]);
}

/* The fused entries (linear.h). The input rows are staged in the same OpenMP region as the matmul,
 * split over the threads; the staging scratch belongs to the calling thread and is kept between
 * calls, so a decode step's calls do not go to the allocator. */
int podium_fma_fused_linear_bf16(FUSED_LINEAR_PARAMS(bf16_t)) {
    const Prologue pro = PROLOGUE_OF_ARGS;
    const size_t h_bytes = has_prologue(&pro) ? sizeof(bf16_t) * (size_t)(M * K) : 0;
    float *xf = (float *)thread_scratch(sizeof(float) * (size_t)(M * K) + h_bytes);
    if (!xf) return -1;
    bf16_t *h = (bf16_t *)(xf + M * K);
    const int64_t panels = (N + PANEL - 1) / PANEL, chunks = (M + CHUNK - 1) / CHUNK, items = chunks * panels;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) stage_bf16(x, x_stride, &pro, m, K, h + m * K, xf + m * K);
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; it++) {
            const int64_t ch = it / panels, p = it % panels, m0 = ch * CHUNK;
            const bf16_t *next = p + 1 < panels ? packed + (p + 1) * K * PANEL : NULL;
            item_bf16(xf, K, K, packed + p * K * PANEL, p * PANEL, N, bias, out, out_stride, m0,
                      M - m0 < CHUNK ? M - m0 : CHUNK, next, (int64_t)sizeof(bf16_t) * K * PANEL);
        }
    }
    return 0;
}

int podium_fma_fused_linear_f32(FUSED_LINEAR_PARAMS(float)) {
    const Prologue pro = PROLOGUE_OF_ARGS;
    const int staged = has_prologue(&pro);
    float *h = staged ? (float *)thread_scratch(sizeof(float) * (size_t)(M * K)) : NULL;
    if (staged && !h) return -1;
    const float *xf = staged ? h : x;
    const int64_t xs = staged ? K : x_stride;
    const int64_t groups = (N + GROUP_COLS - 1) / GROUP_COLS, chunks = (M + CHUNK - 1) / CHUNK;
    const int64_t items = chunks * groups;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        if (staged) {
#pragma omp for schedule(static)
            for (int64_t m = 0; m < M; m++) input_row_f32(x, x_stride, &pro, m, K, h + m * K);
        } /* the loop's barrier: every input row is ready before any item reads it */
#if VL == 16
        if (chunks == 1) { /* a decode batch: each thread an even share of the panels */
            int64_t p0, p1;
            even_pair_share((N + PANEL - 1) / PANEL, &p0, &p1);
            for (int64_t p = p0; p < p1;) {
                const int64_t np = p1 - p >= GROUP_PANELS ? GROUP_PANELS : 2, after = p + np;
                const int64_t next_np = p1 - after >= GROUP_PANELS ? GROUP_PANELS : p1 - after;
                const float *w = packed + p * K * PANEL, *next = next_np > 0 ? packed + after * K * PANEL : NULL;
                const int64_t bytes = (int64_t)sizeof(float) * next_np * K * PANEL;
                if (np == GROUP_PANELS)
                    item_f32(xf, xs, K, w, p * PANEL, N, bias, out, out_stride, 0, M, next, bytes);
                else
                    item_f32_pair(xf, xs, K, w, p * PANEL, N, bias, out, out_stride, 0, M, next, bytes);
                p = after;
            }
        } else
#endif
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; it++) {
            const int64_t ch = it / groups, g = it % groups, m0 = ch * CHUNK;
            /* the weights of this thread's next item (the next group; a new chunk starts again at 0);
             * none for one row (AVX2, where a decode batch takes this loop: see Ahead) */
            const int64_t bytes = (int64_t)sizeof(float) * GROUP_PANELS * K * PANEL;
            const float *next = g + 1 < groups && M > 1 ? packed + (g + 1) * GROUP_PANELS * K * PANEL : NULL;
            item_f32(xf, xs, K, packed + g * GROUP_PANELS * K * PANEL, g * GROUP_COLS, N, bias, out, out_stride, m0,
                     M - m0 < CHUNK ? M - m0 : CHUNK, next, bytes);
        }
    }
    return 0;
}

DEFINE_PLAIN_LINEAR(podium_fma_linear_bf16, podium_fma_fused_linear_bf16, bf16_t)
DEFINE_PLAIN_LINEAR(podium_fma_linear_f32, podium_fma_fused_linear_f32, float)

#else /* no AVX2 + FMA in this build: nothing to run (oneDNN or torch serve these linears) */
int podium_fma_ready(void) { return 0; }

DEFINE_LINEAR_STUBS(podium_fma_fused_linear_bf16, podium_fma_linear_bf16, bf16_t)
DEFINE_LINEAR_STUBS(podium_fma_fused_linear_f32, podium_fma_linear_f32, float)
#endif
