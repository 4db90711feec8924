/* bfloat16 linear layers on AVX512-BF16's dot products (vdpbf16ps: 16 lanes, each adding the two
 * products of a bf16 pair to a float32 sum), for CPUs with AVX512_BF16 but no AMX (AMD Zen 4/5,
 * Intel Cooper Lake). linear.h says what every linear kernel computes.
 *
 * Weight layout: amx_linear.c's, packed by its packer. A column block's data is one contiguous
 * stream, pair p of its 16 columns at p * 32 elements, exactly one vdpbf16ps operand:
 *
 *     packed [N/16][K/32][16 k-pairs][16 columns][2]  ==  [N/16][K/2 rounded up to 16][16][2]
 *
 * (N padded with zero columns to a multiple of 32, K with zero pairs to a multiple of 32.)
 *
 * Work items are (chunk of CHUNK rows, group of GROUP column blocks); an item walks its chunk
 * ROWS rows at a time, each row block keeping ROWS x GROUP float32 accumulators over all K/2
 * pairs: per pair, GROUP weight loads, ROWS broadcasts of an x pair, ROWS x GROUP vdpbf16ps (24 of
 * the 32 zmm registers hold sums). A decode step's batch is one chunk, so the weights stream from
 * memory once per call; the other row blocks of the chunk find the group's weights in L2.
 *
 * vdpbf16ps treats bf16 subnormals as zero and rounds its float32 sums to nearest even (as AMX's
 * tiles do). x rows are read in place unless a prologue computes them or K is odd (a pair needs a
 * zero after the last input); then they are staged in the calling thread's scratch, K rounded up
 * to even, in the same OpenMP region as the matmul.
 */
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "linear.h"
#include "scratch.h"

#define ROWS 6    /* rows of a register block */
#define GROUP 4   /* column blocks (16 columns each) of a register block */
#define CHUNK 64  /* rows of a work item: a decode step of up to 64 rows streams the weights once */

#if defined(__AVX512BF16__)
#include <immintrin.h>

int podium_dpbf16_ready(void) { return 1; }

/* The pair (x[2p], x[2p + 1]) of a bf16 row in every lane */
static inline __m512bh pair_at(const bf16_t *x) {
    int32_t u;
    memcpy(&u, x, sizeof u);
    return (__m512bh)_mm512_set1_epi32(u);
}

/* out rows [0, R) (row stride out_stride) x the C blocks' columns from n0 = sums + bias, rounded
 * to bf16; columns past N dropped */
static inline __attribute__((always_inline)) void store_block(__m512 a[ROWS][GROUP], const int R, const int C,
                                                              int64_t n0, int64_t N, const float *bias,
                                                              bf16_t *out, int64_t out_stride) {
    for (int r = 0; r < R; r++)
        for (int j = 0; j < C; j++) {
            const int64_t n = n0 + 16 * j, cols = N - n < 16 ? N - n : 16;
            if (cols <= 0) continue;
            if (cols == 16) {
                const vf sums = bias ? (vf)a[r][j] + loadv(bias + n) : (vf)a[r][j];
                storev_bf16(out + r * out_stride + n, sums);
            } else {
                float c[16];
                _mm512_storeu_ps(c, a[r][j]);
                store_sums_bf16(c, bias ? bias + n : NULL, out + r * out_stride + n, cols);
            }
        }
}

/* Prefetch of the weights a thread's next item reads (fma_linear.c's, the same reasoning): its
 * first row block waits on memory for them, the others find them in L2 while the dot products are
 * the bound; each row block asks for its share of the next item's lines into L2 (`lines` from
 * `pf`, `per_p` a pair) */
typedef struct {
    const char *pf;
    int64_t lines;
    int per_p;
} Ahead;

static inline Ahead ahead_of(const void *next, int64_t bytes, int64_t b, int64_t count, int64_t pairs) {
    const int64_t lines = (bytes + 63) / 64, share = (lines + count - 1) / count, first = b * share;
    Ahead ahead = {(const char *)next + 64 * first, first >= lines ? 0 : lines - first < share ? lines - first : share, 0};
    ahead.per_p = (int)((ahead.lines + pairs - 1) / pairs);
    return ahead;
}

/* R rows of x (row stride xs) x C column blocks from w (block stride bs elements), all pairs;
 * R and C are constants after inlining: the sums stay in registers */
static inline __attribute__((always_inline)) void row_block(const bf16_t *restrict x, int64_t xs, int64_t pairs,
                                                            const bf16_t *restrict w, int64_t bs, const int R,
                                                            const int C, int64_t n0, int64_t N, const float *bias,
                                                            bf16_t *out, int64_t out_stride, const Ahead ahead) {
    __m512 a[ROWS][GROUP];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < C; j++) a[r][j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        for (int j = 0; j < ahead.per_p; j++) {
            const int64_t line = p * ahead.per_p + j;
            if (line < ahead.lines) _mm_prefetch(ahead.pf + 64 * line, _MM_HINT_T1);
        }
        __m512bh wv[GROUP];
        for (int j = 0; j < C; j++) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * bs + p * 32);
        for (int r = 0; r < R; r++) {
            const __m512bh xr = pair_at(x + r * xs + 2 * p);
            for (int j = 0; j < C; j++) a[r][j] = _mm512_dpbf16_ps(a[r][j], wv[j], xr);
        }
    }
    store_block(a, R, C, n0, N, bias, out, out_stride);
}

/* rows [0, rows) of x x the C column blocks from w, in register blocks of at most ROWS rows as
 * even as they go (32 rows: 6, 6, 5, 5, 5, 5, not five 6s and a 2 whose few sums wait on each
 * other) */
static inline __attribute__((always_inline)) void item_rows(const bf16_t *x, int64_t xs, int64_t rows, int64_t pairs,
                                                            const bf16_t *w, int64_t bs, const int C, int64_t n0,
                                                            int64_t N, const float *bias, bf16_t *out,
                                                            int64_t out_stride, const void *next, int64_t next_bytes) {
    const int64_t count = (rows + ROWS - 1) / ROWS;
    for (int64_t b = 0, r0 = 0; b < count; b++) {
        const int64_t rb = rows / count + (b < rows % count);
        const bf16_t *xr = x + r0 * xs;
        bf16_t *o = out + r0 * out_stride;
        const Ahead ahead = ahead_of(next, next ? next_bytes : 0, b, count, pairs);
        r0 += rb;
        switch (rb) {
            case 6: row_block(xr, xs, pairs, w, bs, 6, C, n0, N, bias, o, out_stride, ahead); break;
            case 5: row_block(xr, xs, pairs, w, bs, 5, C, n0, N, bias, o, out_stride, ahead); break;
            case 4: row_block(xr, xs, pairs, w, bs, 4, C, n0, N, bias, o, out_stride, ahead); break;
            case 3: row_block(xr, xs, pairs, w, bs, 3, C, n0, N, bias, o, out_stride, ahead); break;
            case 2: row_block(xr, xs, pairs, w, bs, 2, C, n0, N, bias, o, out_stride, ahead); break;
            default: row_block(xr, xs, pairs, w, bs, 1, C, n0, N, bias, o, out_stride, ahead); break;
        }
    }
}

/* The fused entry (linear.h) */
int podium_dpbf16_fused_linear_bf16(FUSED_LINEAR_PARAMS(bf16_t)) {
    const Prologue pro = PROLOGUE_OF_ARGS;
    const int64_t pairs = (K + 1) / 2, kb = (K + 31) / 32, bs = kb * 512, blocks = 2 * ((N + 31) / 32);
    const int staged = has_prologue(&pro) || K % 2;
    const int64_t ks = 2 * pairs; /* a staged row: K values and a zero when K is odd */
    bf16_t *h = staged ? (bf16_t *)thread_scratch(sizeof(bf16_t) * (size_t)(M * ks)) : NULL;
    if (staged && !h) return -1;
    const bf16_t *xin = staged ? h : x;
    const int64_t xs = staged ? ks : x_stride;
    const int64_t groups = (blocks + GROUP - 1) / GROUP, chunks = (M + CHUNK - 1) / CHUNK, items = groups * chunks;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        if (staged) {
#pragma omp for schedule(static)
            for (int64_t m = 0; m < M; m++) {
                bf16_t *row = h + m * ks;
                const bf16_t *in = input_row_bf16(x, x_stride, &pro, m, K, row);
                if (in != row) memcpy(row, in, (size_t)K * sizeof(bf16_t));
                if (ks > K) row[K] = 0;
            }
        } /* the loop's barrier: every input row is ready before any item reads it */
        if (chunks == 1) { /* a decode batch: each thread an even share of the column blocks */
            int64_t b0, b1;
            even_pair_share(blocks, &b0, &b1);
            for (int64_t first = b0; first < b1;) {
                const int64_t c = b1 - first >= GROUP ? GROUP : 2, after = first + c;
                const int64_t next_blocks = b1 - after >= GROUP ? GROUP : b1 - after;
                const bf16_t *w = packed + first * bs, *next = next_blocks > 0 ? packed + after * bs : NULL;
                const int64_t next_bytes = next_blocks * bs * (int64_t)sizeof(bf16_t);
                if (c == GROUP)
                    item_rows(xin, xs, M, pairs, w, bs, GROUP, 16 * first, N, bias, out, out_stride, next, next_bytes);
                else
                    item_rows(xin, xs, M, pairs, w, bs, 2, 16 * first, N, bias, out, out_stride, next, next_bytes);
                first = after;
            }
        } else
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; it++) {
            const int64_t ch = it / groups, g = it % groups, m0 = ch * CHUNK;
            const int64_t rows = M - m0 < CHUNK ? M - m0 : CHUNK, first = g * GROUP;
            const bf16_t *w = packed + first * bs, *xr = xin + m0 * xs;
            bf16_t *o = out + m0 * out_stride;
            /* the weights of this thread's next item: the next group's (a new chunk starts at group 0) */
            const int64_t next_blocks = g + 1 < groups ? (blocks - first - GROUP < GROUP ? blocks - first - GROUP : GROUP) : 0;
            const bf16_t *next = next_blocks > 0 ? w + GROUP * bs : NULL;
            const int64_t next_bytes = next_blocks * bs * (int64_t)sizeof(bf16_t);
            if (blocks - first >= GROUP)
                item_rows(xr, xs, rows, pairs, w, bs, GROUP, 16 * first, N, bias, o, out_stride, next, next_bytes);
            else /* blocks come in pairs: a last group of 2 */
                item_rows(xr, xs, rows, pairs, w, bs, 2, 16 * first, N, bias, o, out_stride, next, next_bytes);
        }
    }
    return 0;
}

DEFINE_PLAIN_LINEAR(podium_dpbf16_linear_bf16, podium_dpbf16_fused_linear_bf16, bf16_t)

#else /* no AVX512-BF16 in this build */
int podium_dpbf16_ready(void) { return 0; }

DEFINE_LINEAR_STUBS(podium_dpbf16_fused_linear_bf16, podium_dpbf16_linear_bf16, bf16_t)
#endif
