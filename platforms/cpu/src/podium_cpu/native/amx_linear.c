/* bfloat16 linear layers on AMX tiles: out [M, N] = bf16(x [M, K] . w [N, K]^T + bias), float32 sums.
 *
 * Weight layout (packed once at load, linear_packing.py): w padded with zeros to N % 32 == 0 and
 * K % 32 == 0, then cut into tiles of 16 output columns x 32 inputs, each stored as AMX's B operand
 * wants it, the inputs k and k+1 of a column side by side:
 *
 *     packed [N/16][K/32][16 k-pairs][16 columns][2]      (1 KiB per tile, a column block's tiles
 *                                                         contiguous in K order)
 *
 * One work item is a pair of column blocks (32 outputs): for each chunk of 32 rows of x it keeps
 * four 16 x 16 float32 accumulator tiles (2 row tiles x 2 column blocks) and walks K 32 inputs at a
 * time: two A loads (rows of x, straight from the caller's memory), two B loads, four
 * tdpbf16ps. Items split statically over the threads, so each weight byte is read once per chunk
 * of 32 rows; a decode step's batch fits one chunk and the weights stream from memory once.
 *
 * Every output element sums its K products in the same order whatever M is and whichever chunk
 * its row falls in: a row's result does not depend on the other rows of the call (batch
 * invariance). Bias is added in float32 before the one rounding to bf16 (round to nearest even).
 * Rows of a last partial chunk, and x when K % 32 != 0, go through a zero-padded copy.
 *
 * With a prologue (podium_amx_fused_linear_bf16, the API 1.5 ops rms_norm_linear and
 * silu_and_mul_linear) the input rows are first computed by the op before the linear, RMSNorm
 * (+ residual add) or SiLU-and-mul, row by row with the same code as the op alone (prologue.h,
 * compiled with -ffp-contract=off like fused_ops.c) into a zero-padded [chunks * 32, K rounded up
 * to 32] scratch, split over the threads in the same OpenMP region as the matmul: the result is
 * "op, then linear" bit for bit, in one call instead of two. The scratch belongs to the calling
 * thread and is kept between calls (grown when a call needs more), so a decode step's calls do not
 * go to the allocator.
 *
 * AMX state is per thread: each thread loads its tile configuration on entry and releases the
 * tiles on exit (other AMX users, oneDNN, configure their own). The process asks the kernel for
 * AMX tile data once (podium_amx_init). The caller (linear_packing.py) validates shapes, strides
 * and dtypes: this code trusts its arguments.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "bf16.h"
#include "linear.h"
#include "scratch.h"

/* w [N, K] (rows contiguous) -> packed (the layout above), zeros where N or K are padded; threads
 * split the 16-column blocks. Plain C (no AMX needed). A (k, k+1) pair of one column is one 32-bit
 * word of a tile, so each row is copied a word at a time into its column of 16-word tile rows. */
int podium_amx_pack_bf16(const bf16_t *w, int64_t N, int64_t K, bf16_t *packed, int num_threads) {
    const int64_t kb = (K + 31) / 32, blocks = 2 * ((N + 31) / 32), pairs = K / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int64_t nb = 0; nb < blocks; nb++) {
        uint32_t *block = (uint32_t *)(packed + nb * kb * 512); /* [kb][16 k-pairs][16 columns] words */
        for (int64_t col = 0; col < 16; col++) {
            const int64_t n = nb * 16 + col;
            uint32_t *dst = block + col; /* k-pair p of this column: dst[(p / 16) * 256 + (p % 16) * 16] */
            int64_t p = 0;
            if (n < N) {
                const bf16_t *row = w + n * K;
                for (; p < pairs; p++) {
                    uint32_t word;
                    memcpy(&word, row + 2 * p, sizeof word);
                    dst[(p >> 4) * 256 + (p & 15) * 16] = word;
                }
                if (K % 2) dst[(p >> 4) * 256 + (p & 15) * 16] = row[K - 1], p++; /* its pair's second half: 0 */
            }
            for (; p < kb * 16; p++) dst[(p >> 4) * 256 + (p & 15) * 16] = 0;
        }
    }
    return 0;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>

#define ARCH_GET_XCOMP_PERM 0x1022
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* 0 when this process may use AMX tiles (asking the kernel for them if needed), else -1 */
int podium_amx_init(void) {
    unsigned long bitmask = 0;
    if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &bitmask) == 0 && (bitmask & (1ul << XFEATURE_XTILEDATA)))
        return 0;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return -1;
    return syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &bitmask) == 0 &&
                   (bitmask & (1ul << XFEATURE_XTILEDATA))
               ? 0
               : -1;
}

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* tiles 0-3: accumulators (16 x 16 float32); 4, 5: rows of x (16 x 32 bf16); 6, 7: weight tiles */
static void configure_tiles(void) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* out rows [m0, m0 + rows) x columns [n0, n0 + 32) (those below N) from the accumulator tiles */
static void store_block(float *restrict c, int64_t rows, int64_t n0, int64_t N, const float *bias,
                        bf16_t *out, int64_t out_stride) {
    _tile_stored(0, c, 128);
    _tile_stored(1, c + 16, 128);
    if (rows > 16) {
        _tile_stored(2, c + 16 * 32, 128);
        _tile_stored(3, c + 16 * 32 + 16, 128);
    }
    const int64_t cols = N - n0 < 32 ? N - n0 : 32;
    for (int64_t r = 0; r < rows; r++) {
        float *row = c + r * 32;
        if (bias)
            for (int64_t j = 0; j < cols; j++) row[j] += bias[n0 + j];
        bf16_t *o = out + r * out_stride + n0;
        if (cols == 32) {
            storev_bf16(o, loadv(row));
            storev_bf16(o + 16, loadv(row + 16));
        } else {
            for (int64_t j = 0; j < cols; j++) o[j] = f32_to_bf16(row[j]);
        }
    }
}

/* Ask for the weight tiles WEIGHTS_AHEAD bytes past tile k of both column blocks (into L2): the
 * weights stream from memory once per call, and the hardware prefetcher alone kept too few of
 * their lines in flight for one core's share of the read bandwidth */
#define WEIGHTS_AHEAD 8192
static inline void prefetch_weights(const bf16_t *b0, const bf16_t *b1, int64_t k) {
    const char *p0 = (const char *)(b0 + k * 512) + WEIGHTS_AHEAD, *p1 = (const char *)(b1 + k * 512) + WEIGHTS_AHEAD;
    for (int l = 0; l < 1024; l += 64) {
        _mm_prefetch(p0 + l, _MM_HINT_T1);
        _mm_prefetch(p1 + l, _MM_HINT_T1);
    }
}

/* One chunk of up to 32 rows (a, row stride a_stride bytes) times one column-block pair; `ahead`:
 * prefetch the weights ahead (the first chunk of a pair, which reads them from memory) */
static inline void chunk_pair(const bf16_t *a, int64_t a_stride, int64_t rows, const bf16_t *b0,
                              const bf16_t *b1, int64_t kb, int ahead) {
    _tile_zero(0);
    _tile_zero(1);
    if (rows > 16) {
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t k = 0; k < kb; k++) {
            if (ahead) prefetch_weights(b0, b1, k);
            _tile_loadd(4, a + k * 32, a_stride);
            _tile_loadd(5, (const char *)(a + k * 32) + 16 * a_stride, a_stride);
            _tile_loadd(6, b0 + k * 512, 64);
            _tile_loadd(7, b1 + k * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    } else {
        for (int64_t k = 0; k < kb; k++) {
            if (ahead) prefetch_weights(b0, b1, k);
            _tile_loadd(4, a + k * 32, a_stride);
            _tile_loadd(6, b0 + k * 512, 64);
            _tile_loadd(7, b1 + k * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
        }
    }
}

/* Prefill-sized batches: x no longer fits L2, so rows are taken BLOCK_CHUNKS chunks (256 rows) at a
 * time against a group of column-block pairs whose weight tiles (GROUP_TILES per pair-sized K
 * block, 1 KiB each) stay in L2 meanwhile; without the blocking every pair re-read all of x and a
 * 2048-row call ran 1.5-2.2x oneDNN's time. A decode batch is one block: the loop is as before. */
#define BLOCK_CHUNKS 8
#define GROUP_TILES 128

/* The fused entry (linear.h) */
int podium_amx_fused_linear_bf16(FUSED_LINEAR_PARAMS(bf16_t)) {
    const Prologue pro = PROLOGUE_OF_ARGS;
    const int64_t kb = (K + 31) / 32, kp = kb * 32, pairs = (N + 31) / 32;
    const int prologue = has_prologue(&pro);
    const int64_t full = !prologue && K % 32 == 0 ? M / 32 : 0; /* chunks read in place */
    const int64_t chunks = (M + 31) / 32;
    /* rows of the chunks not read in place: the prologue's output or a copy of x, zero padded to 32
     * rows and kp columns */
    bf16_t *pad = NULL;
    if (chunks > full) {
        const int64_t rows = (chunks - full) * 32, used = M - full * 32;
        pad = (bf16_t *)thread_scratch((size_t)(rows * kp) * sizeof(bf16_t));
        if (!pad) return -1;
        if (kp > K)
            for (int64_t r = 0; r < used; r++) memset(pad + r * kp + K, 0, (size_t)(kp - K) * sizeof(bf16_t));
        memset(pad + used * kp, 0, (size_t)((rows - used) * kp) * sizeof(bf16_t));
    }
    const int parallel = num_threads > 1 && (pairs > 1 || prologue);
#pragma omp parallel num_threads(num_threads) if (parallel)
    {
        if (chunks > full) {
#pragma omp for schedule(static)
            for (int64_t r = full * 32; r < M; r++) {
                bf16_t *h = pad + (r - full * 32) * kp;
                const bf16_t *row = input_row_bf16(x, x_stride, &pro, r, K, h);
                if (row != h) memcpy(h, row, (size_t)K * sizeof(bf16_t));
            }
        } /* the loop's barrier: every input row is ready before any tile reads it */
        float c[32 * 32];
        configure_tiles();
        /* a group of pairs whose weights stay in L2 meets each block of rows that stays in L2; a
         * decode batch (one block of rows) shares out single pairs, as whole groups would split
         * SmolLM2's 18 o-projection pairs 14 / 4 over two threads */
        const int64_t group = chunks <= BLOCK_CHUNKS || kb >= GROUP_TILES ? 1 : GROUP_TILES / kb;
        const int64_t groups = (pairs + group - 1) / group;
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t p_end = (g + 1) * group < pairs ? (g + 1) * group : pairs;
            for (int64_t c0 = 0; c0 < chunks; c0 += BLOCK_CHUNKS) {
                const int64_t c_end = c0 + BLOCK_CHUNKS < chunks ? c0 + BLOCK_CHUNKS : chunks;
                for (int64_t p = g * group; p < p_end; p++) {
                    const bf16_t *b0 = packed + 2 * p * kb * 512, *b1 = b0 + kb * 512;
                    for (int64_t ch = c0; ch < c_end; ch++) {
                        const int64_t m0 = ch * 32, rows = M - m0 < 32 ? M - m0 : 32;
                        if (ch < full)
                            chunk_pair(x + m0 * x_stride, x_stride * 2, rows, b0, b1, kb, ch == 0);
                        else
                            chunk_pair(pad + (m0 - full * 32) * kp, kp * 2, rows, b0, b1, kb, ch == 0);
                        store_block(c, rows, 32 * p, N, bias, out + m0 * out_stride, out_stride);
                    }
                }
            }
        }
        _tile_release();
    }
    return 0;
}

/* x [M, K] (row stride x_stride elements), packed weights for [N, K], bias [N] float32 or NULL,
 * out [M, N] (row stride out_stride). Returns 0, or -1 when scratch memory could not be allocated. */
DEFINE_PLAIN_LINEAR(podium_amx_linear_bf16, podium_amx_fused_linear_bf16, bf16_t)

#else /* no AMX in this build (-march=native on a CPU without it): nothing to run */
int podium_amx_init(void) { return -1; }

DEFINE_LINEAR_STUBS(podium_amx_fused_linear_bf16, podium_amx_linear_bf16, bf16_t)
#endif
