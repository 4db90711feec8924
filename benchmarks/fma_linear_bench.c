/* Times the CPU platform's bf16 FMA linear (platforms/cpu/src/podium_cpu/native/fma_linear.c)
 * outside Python, for A/B runs of two versions of the kernel (benchmarks/fma_linear_ab.sh):
 *
 *     fma_linear_bench M N K THREADS CALLS    ->  "M .. N .. K .. threads ..: <us> us <GF/s> GF/s"
 *
 * Best of 5 timings of CALLS calls on fixed pseudo-random bf16 inputs (weights packed once). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "bf16.h"

int podium_fma_pack_bf16(const bf16_t *w, int64_t N, int64_t K, bf16_t *packed, int num_threads);
int podium_fma_linear_bf16(const bf16_t *x, int64_t x_stride, int64_t M, const bf16_t *packed, int64_t N,
                           int64_t K, const float *bias, bf16_t *out, int64_t out_stride, int num_threads);

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static bf16_t random_bf16(uint64_t *state) { /* uniform in [-1, 1), rounded to bf16 */
    *state = *state * 6364136223846793005ull + 1442695040888963407ull;
    return f32_to_bf16((float)((*state >> 40) / (double)(1ull << 24)) * 2.0f - 1.0f);
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s M N K THREADS CALLS\n", argv[0]);
        return 2;
    }
    const int64_t M = atoll(argv[1]), N = atoll(argv[2]), K = atoll(argv[3]);
    const int threads = atoi(argv[4]), calls = atoi(argv[5]);
    const int64_t n_pad = (N + 15) / 16 * 16;
    bf16_t *w = malloc(sizeof(bf16_t) * N * K), *packed = malloc(sizeof(bf16_t) * n_pad * K);
    bf16_t *x = malloc(sizeof(bf16_t) * M * K), *out = malloc(sizeof(bf16_t) * M * N);
    if (!w || !packed || !x || !out) return 1;
    uint64_t state = 42;
    for (int64_t i = 0; i < N * K; i++) w[i] = random_bf16(&state);
    for (int64_t i = 0; i < M * K; i++) x[i] = random_bf16(&state);
    podium_fma_pack_bf16(w, N, K, packed, threads);
    if (podium_fma_linear_bf16(x, K, M, packed, N, K, NULL, out, N, threads) != 0) return 1;
    double best = 1e30;
    for (int trial = 0; trial < 5; trial++) {
        const double start = now();
        for (int c = 0; c < calls; c++) podium_fma_linear_bf16(x, K, M, packed, N, K, NULL, out, N, threads);
        const double seconds = (now() - start) / calls;
        best = seconds < best ? seconds : best;
    }
    printf("M %ld N %ld K %ld threads %d: %.0f us %.1f GF/s\n", (long)M, (long)N, (long)K, threads, best * 1e6,
           2.0 * M * N * K / best / 1e9);
    return 0;
}
