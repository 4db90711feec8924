/* What the native linear kernels share (amx_linear.c, dpbf16_linear.c, fma_linear.c): their entry
 * signatures, the op a fused entry runs on its input rows first (prologue.h), and the rounding of
 * float32 sums to the output type.
 *
 * Every kernel computes out [M, N] (row stride out_stride) = h . w^T + bias: h [M, K] the linear's
 * input, x [M, K] (row stride x_stride) itself or what the Prologue makes of it; packed the weights
 * for [N, K] in the kernel's layout; bias [N] float32 or NULL, added in float32 before the one
 * rounding. Each output element is one chain of sums over k in a fixed order whatever M is and
 * wherever its row falls: a row's result does not depend on the other rows of the call (batch
 * invariance). Entries return 0, or -1 when scratch memory could not be allocated (or, for a
 * kernel this build lacks, always). */
#ifndef PODIUM_LINEAR_H
#define PODIUM_LINEAR_H

#include <omp.h>
#include <stdint.h>

#include "bf16.h"
#include "prologue.h"

/* What a fused entry computes before its matmul: with norm_w, rms_norm(x + res) (res NULL:
 * rms_norm(x); else x + res also goes to sum_out [M, K] contiguous, as fused_add_rms_norm returns
 * it); with silu, silu(gate) * up of x [M, 2K] = [gate | up]; neither: x itself. */
typedef struct {
    const void *res;
    int64_t res_stride;
    const void *norm_w;
    float eps;
    void *sum_out;
    int silu;
} Prologue;

static inline int has_prologue(const Prologue *pro) { return pro->norm_w || pro->silu; }

/* The calling OpenMP thread's share [*lo, *hi) of `units` column units (blocks, panels), the units
 * split evenly between the threads in pairs: a decode batch's items, where a static split of
 * 4-unit groups left one thread a group more (5 of 9 at N = 576) */
static inline void even_pair_share(int64_t units, int64_t *lo, int64_t *hi) {
    const int64_t T = omp_get_num_threads(), t = omp_get_thread_num(), pairs = (units + 1) / 2;
    *lo = 2 * (pairs * t / T), *hi = 2 * (pairs * (t + 1) / T);
}

/* The linear's input row m of K values: x's own row (no prologue), or the prologue's output
 * computed into h (K values), exactly as the op alone would store it. Returns the row. */
#define DEFINE_INPUT_ROW(NAME, T, NORM, SILU)                                                            \
static inline const T *NAME(const T *x, int64_t x_stride, const Prologue *pro, int64_t m, int64_t K, T *h) { \
    const T *row = x + m * x_stride;                                                                     \
    if (pro->norm_w) {                                                                                   \
        const T *res = (const T *)pro->res;                                                              \
        NORM(row, res ? res + m * pro->res_stride : NULL, (const T *)pro->norm_w, h,                     \
             res ? (T *)pro->sum_out + m * K : NULL, K, pro->eps);                                       \
        return h;                                                                                        \
    }                                                                                                    \
    if (pro->silu) {                                                                                     \
        SILU(row, h, K);                                                                                 \
        return h;                                                                                        \
    }                                                                                                    \
    return row;                                                                                          \
}
DEFINE_INPUT_ROW(input_row_bf16, bf16_t, norm_row, silu_mul_row)
DEFINE_INPUT_ROW(input_row_f32, float, norm_row_f32, silu_mul_row_f32)

/* out[0..cols) = T(c[0..cols) + bias[0..cols)) (bias NULL: none), cols <= 16 */
#define DEFINE_STORE_SUMS(NAME, T, STORE)                                                                \
static inline void NAME(const float *c, const float *bias, T *out, int64_t cols) {                      \
    for (int64_t j = 0; j < cols; j++) out[j] = STORE(bias ? c[j] + bias[j] : c[j]);                    \
}
DEFINE_STORE_SUMS(store_sums_bf16, bf16_t, f32_to_bf16)
DEFINE_STORE_SUMS(store_sums_f32, float, store_f32)

/* The C signature of every fused entry (graph_replay.c's FUSED_LINEAR), T its row type */
#define FUSED_LINEAR_PARAMS(T)                                                                           \
    const T *x, int64_t x_stride, const T *res, int64_t res_stride, const T *norm_w, float eps, T *sum_out, \
        int silu, int64_t M, const T *packed, int64_t N, int64_t K, const float *bias, T *out, int64_t out_stride, \
        int num_threads
/* a fused entry's prologue arguments as a Prologue */
#define PROLOGUE_OF_ARGS {res, res_stride, norm_w, eps, sum_out, silu}

/* The plain entry (graph_replay.c's LINEAR): the fused entry without a prologue */
#define DEFINE_PLAIN_LINEAR(NAME, FUSED, T)                                                              \
int NAME(const T *x, int64_t x_stride, int64_t M, const T *packed, int64_t N, int64_t K, const float *bias, \
         T *out, int64_t out_stride, int num_threads) {                                                  \
    return FUSED(x, x_stride, NULL, 0, NULL, 0.f, NULL, 0, M, packed, N, K, bias, out, out_stride, num_threads); \
}

/* A kernel's entries in a build without the instructions it needs: the same signatures, so the
 * library still binds, and nothing to run (-1) */
#define DEFINE_LINEAR_STUBS(FUSED, PLAIN, T)                                                             \
    int FUSED(FUSED_LINEAR_PARAMS(T)) {                                                                  \
        (void)x, (void)x_stride, (void)res, (void)res_stride, (void)norm_w, (void)eps, (void)sum_out;    \
        (void)silu, (void)M, (void)packed, (void)N, (void)K, (void)bias, (void)out, (void)out_stride;    \
        (void)num_threads;                                                                               \
        return -1;                                                                                       \
    }                                                                                                    \
    DEFINE_PLAIN_LINEAR(PLAIN, FUSED, T)

#endif
