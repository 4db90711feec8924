/* bfloat16 linear layers on AVX2 FMA units: out [M, N] = bf16(x [M, K] . w [N, K]^T + bias), float32
 * sums, for CPUs whose oneDNN has no bf16 matmul (AVX2 without AVX-512: AMD Zen 2/3, older Intel),
 * where torch's bf16 F.linear runs ~5x slower than its float32 one.
 *
 * Weight layout (packed once at load, linear_packing.py): w padded with zero rows to N % 16 == 0,
 * cut into panels of 16 output columns, each panel stored k-major so one k's 16 weights are 32
 * contiguous bytes, in the order two in-lane 16-bit unpacks with zero widen into columns 0-7 and
 * 8-15 (a bf16 is the top half of its float32): memory holds columns 0-3, 8-11, 4-7, 12-15 (SLOT):
 *
 *     packed [N/16][K][16]
 *
 * x is widened to float32 once per call (a [M, K] scratch, rows in place for the broadcasts).
 * Work items are (chunk of CHUNK rows, panel); an item walks its chunk ROWS rows at a time, each
 * row block keeping ROWS x 2 accumulators of 8 lanes (12 of the 16 ymm registers) over all K: per k
 * one 32-byte weight load and two unpacks (the panel widened in registers), ROWS broadcasts,
 * 2 * ROWS FMAs. A decode step's batch is one chunk, so the weights stream from memory once per
 * call. On AMD Zen 3 this is faster than widening each panel once per item into a float32 scratch
 * at every row count, most at 1 row (no panel pass for one row). The earlier in-loop widening
 * (zero-extend + shift: two more instructions a half) had been slower; 4-row blocks and blocking K were slower too. Register blocks write their sums to the
 * item's [rows][16] scratch and the rounding follows all of them: with the sums of one block in a
 * 6 x 16 local, GCC 12 kept a weight vector in memory and reloaded it in each of its 6 FMAs.
 *
 * Every output element is one FMA chain over k = 0..K-1 whatever M is and wherever its row falls
 * (full row block or remainder): a row's result does not depend on the other rows of the call
 * (batch invariance). Bias is added in float32 before the one rounding to bf16. The caller
 * (linear_packing.py) validates shapes, strides and dtypes: this code trusts its arguments.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "prologue.h"

#define PANEL 16 /* output columns of a panel */
#define ROWS 6   /* rows of a register block */
#define CHUNK 48 /* rows of a work item (8 row blocks): its float32 rows stay in L2 */
/* where column j of a panel sits among its k's 16 values: the order AVX2's in-lane 16-bit unpacks
 * widen into columns 0-7 (unpacklo) and 8-15 (unpackhi) */
#define SLOT(j) (((j) & 3) | (((j) & 4) << 1) | (((j) & 8) >> 1))

/* w [N, K] (rows contiguous) -> packed [N/16][K][16], zero columns past N; threads split panels. */
int podium_fma_pack_bf16(const bf16_t *w, int64_t N, int64_t K, bf16_t *packed, int num_threads) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int64_t p = 0; p < panels; p++) {
        bf16_t *dst = packed + p * K * PANEL;
        for (int64_t j = 0; j < PANEL; j++) {
            const int64_t n = p * PANEL + j, at = SLOT(j);
            if (n < N)
                for (int64_t k = 0; k < K; k++) dst[k * PANEL + at] = w[n * K + k];
            else
                for (int64_t k = 0; k < K; k++) dst[k * PANEL + at] = 0;
        }
    }
    return 0;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

int podium_fma_ready(void) { return 1; }

/* c[r][0..16) = sum_k xf[r][k] * w[k][0..16) for R rows (R a constant after inlining); wp is the
 * bf16 panel in SLOT order, widened in registers */
static inline __attribute__((always_inline)) void row_block(const float *restrict xf, int64_t K,
                                                             const bf16_t *restrict wp, float *restrict c,
                                                             const int R) {
    __m256 a[ROWS][2];
    const __m256i zero = _mm256_setzero_si256();
    for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(wp + k * PANEL));
        const __m256 w0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));
        const __m256 w1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v));
        for (int r = 0; r < R; r++) {
            const __m256 xr = _mm256_broadcast_ss(xf + r * K + k);
            a[r][0] = _mm256_fmadd_ps(xr, w0, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(xr, w1, a[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(c + r * PANEL, a[r][0]);
        _mm256_storeu_ps(c + r * PANEL + 8, a[r][1]);
    }
}

/* rows [m0, m0 + rows) x panel p: sums, bias, the rounding, the store (the last panel's columns
 * past N are dropped) */
static void item(const float *xf, int64_t K, const bf16_t *panel, int64_t p, int64_t N,
                 const float *bias, bf16_t *out, int64_t out_stride, int64_t m0, int64_t rows) {
    float c[CHUNK * PANEL]; /* the item's sums, [rows][16] */
    const int64_t n0 = p * PANEL, cols = N - n0 < PANEL ? N - n0 : PANEL;
    for (int64_t r0 = 0; r0 < rows; r0 += ROWS) {
        const int64_t rb = rows - r0 < ROWS ? rows - r0 : ROWS;
        const float *x = xf + (m0 + r0) * K;
        float *cr = c + r0 * PANEL;
        switch (rb) {
            case 6: row_block(x, K, panel, cr, 6); break;
            case 5: row_block(x, K, panel, cr, 5); break;
            case 4: row_block(x, K, panel, cr, 4); break;
            case 3: row_block(x, K, panel, cr, 3); break;
            case 2: row_block(x, K, panel, cr, 2); break;
            default: row_block(x, K, panel, cr, 1); break;
        }
    }
    for (int64_t r = 0; r < rows; r++) { /* bias, the one rounding, the store */
        float *row = c + r * PANEL;
        if (bias)
            for (int64_t j = 0; j < cols; j++) row[j] += bias[n0 + j];
        bf16_t *o = out + (m0 + r) * out_stride + n0;
        for (int64_t j = 0; j < cols; j++) o[j] = f32_to_bf16(row[j]);
    }
}

/* The linear's input row m, widened to float32 into xf: x itself, or the op before the linear
 * (prologue.h) computed into the bf16 row h first, exactly as the op alone would store it. */
static void input_row(const bf16_t *x, int64_t x_stride, const bf16_t *res, int64_t res_stride, const bf16_t *norm_w,
                      float eps, bf16_t *sum_out, int silu, int64_t m, int64_t K, bf16_t *h, float *xf) {
    const bf16_t *row = x + m * x_stride;
    if (norm_w) {
        norm_row(row, res ? res + m * res_stride : NULL, norm_w, h, res ? sum_out + m * K : NULL, K, eps);
        row = h;
    } else if (silu) {
        silu_mul_row(row, h, K);
        row = h;
    }
    for (int64_t k = 0; k < K; k++) xf[k] = bf16_to_f32(row[k]);
}

/* out [M, N] (row stride out_stride) = h . w^T + bias, h [M, K] the linear's input: x [M, K] (row
 * stride x_stride) itself; with norm_w, rms_norm(x + res) (res NULL: rms_norm(x); else x + res goes
 * to sum_out [M, K] contiguous, as fused_add_rms_norm returns it); with silu, silu(gate) * up of x
 * [M, 2K] = [gate | up]. packed: the weights for [N, K]; bias [N] float32 or NULL. The prologue runs
 * in the rows pass the linear makes anyway (split over the threads), not as a call of its own.
 * Returns 0, or -1 when scratch memory could not be allocated. */
int podium_fma_fused_linear_bf16(const bf16_t *x, int64_t x_stride, const bf16_t *res, int64_t res_stride,
                                 const bf16_t *norm_w, float eps, bf16_t *sum_out, int silu, int64_t M,
                                 const bf16_t *packed, int64_t N, int64_t K, const float *bias, bf16_t *out,
                                 int64_t out_stride, int num_threads) {
    float *xf = (float *)malloc(sizeof(float) * (size_t)(M * K));
    bf16_t *h = (norm_w || silu) ? (bf16_t *)malloc(sizeof(bf16_t) * (size_t)(M * K)) : NULL;
    if (!xf || ((norm_w || silu) && !h)) {
        free(xf), free(h);
        return -1;
    }
    const int64_t panels = (N + PANEL - 1) / PANEL, chunks = (M + CHUNK - 1) / CHUNK, items = chunks * panels;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++)
            input_row(x, x_stride, res, res_stride, norm_w, eps, sum_out, silu, m, K, h ? h + m * K : NULL, xf + m * K);
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; it++) {
            const int64_t ch = it / panels, p = it % panels, m0 = ch * CHUNK;
            item(xf, K, packed + p * K * PANEL, p, N, bias, out, out_stride, m0, M - m0 < CHUNK ? M - m0 : CHUNK);
        }
    }
    free(xf), free(h);
    return 0;
}

/* x [M, K] (row stride x_stride), packed weights for [N, K], bias [N] float32 or NULL, out [M, N]
 * (row stride out_stride). Returns 0, or -1 when scratch memory could not be allocated. */
int podium_fma_linear_bf16(const bf16_t *x, int64_t x_stride, int64_t M, const bf16_t *packed, int64_t N,
                           int64_t K, const float *bias, bf16_t *out, int64_t out_stride, int num_threads) {
    return podium_fma_fused_linear_bf16(x, x_stride, NULL, 0, NULL, 0.f, NULL, 0, M, packed, N, K, bias, out,
                                        out_stride, num_threads);
}

#else /* no AVX2 + FMA in this build: nothing to run (oneDNN or torch serve bf16 linears) */
int podium_fma_ready(void) { return 0; }

int podium_fma_linear_bf16(const bf16_t *x, int64_t x_stride, int64_t M, const bf16_t *packed, int64_t N,
                           int64_t K, const float *bias, bf16_t *out, int64_t out_stride, int num_threads) {
    (void)x, (void)x_stride, (void)M, (void)packed, (void)N, (void)K, (void)bias, (void)out, (void)out_stride;
    (void)num_threads;
    return -1;
}

DEFINE_FUSED_LINEAR_STUB(podium_fma_fused_linear_bf16)
#endif
