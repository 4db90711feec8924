"""This CPU's ceilings: memory read bandwidth (torch, 1 GiB), the float32 FMA peak and the bf16 dot-product peak.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/cpu_ceilings.py [--threads 2]

Bandwidth: a float32 sum over 1 GiB (bytes read / best time of 5) and a copy (read + write).
FMA peak: a C loop of 12 independent 8-lane FMA chains (AVX2 + FMA) compiled with the system C
compiler, one per thread under OpenMP, each thread's GFLOP/s; skipped where no compiler or no AVX2.
bf16 peak: the same with 24 chains of ``vdpbf16ps`` (AVX512-BF16: 16 lanes, two products each), the
instruction the bf16 linears and prefill attention run on CPUs without AMX; skipped where the CPU
lacks it. A bf16 kernel's GF/s against this sum over the threads is its fraction of the peak.
Tile reads: 512 MiB read as 2 / 4 / 8 KiB tiles in a random order (as the decode attention reads a
paged KV cache: each tile contiguous, the next one anywhere), every line of the tile AHEAD tiles on
asked for into L2 first, the tiles split between the threads; GB/s over all of them, the best of 3.
The decode attention's KV read rate (benchmarks/cpu_kernels.py --only decode) against this is how
far it is from what the memory gives that pattern.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

FMA_LOOP = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
int main(int argc, char **argv) {
    const long iters = 100000000;
#pragma omp parallel
    {
        __m256 a[12];
        for (int i = 0; i < 12; i++) a[i] = _mm256_set1_ps(0.1f * (i + 1));
        const __m256 b = _mm256_set1_ps(argc * 0.9999f), c = _mm256_set1_ps(0.0001f);
        const double t0 = omp_get_wtime();
        for (long it = 0; it < iters; it++)
            for (int i = 0; i < 12; i++) a[i] = _mm256_fmadd_ps(a[i], b, c);
        const double dt = omp_get_wtime() - t0;
        float s = 0.f;
        for (int i = 0; i < 12; i++) s += a[i][0];
#pragma omp critical
        printf("thread %d: %.1f GFLOP/s (checksum %g)\n", omp_get_thread_num(), iters * 12 * 16.0 / dt / 1e9, s);
    }
    return 0;
}
"""

BF16_LOOP = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
int main(int argc, char **argv) {
    const long iters = 50000000;
#pragma omp parallel
    {
        __m512 a[24];
        for (int i = 0; i < 24; i++) a[i] = _mm512_set1_ps(0.1f * (i + 1));
        __m512bh b = (__m512bh)_mm512_set1_epi32(0x3f803f80 + argc), c = (__m512bh)_mm512_set1_epi32(0x3a803a80);
        const double t0 = omp_get_wtime();
        for (long it = 0; it < iters; it++) {
#pragma GCC unroll 24
            for (int i = 0; i < 24; i++) a[i] = _mm512_dpbf16_ps(a[i], b, c); /* unrolled: a in registers */
            __asm__ volatile("" : "+v"(b));
        }
        const double dt = omp_get_wtime() - t0;
        float s = 0.f;
        for (int i = 0; i < 24; i++) s += _mm512_reduce_add_ps(a[i]);
#pragma omp critical
        printf("thread %d: %.1f GFLOP/s (checksum %g)\n", omp_get_thread_num(), iters * 24 * 64.0 / dt / 1e9, s);
    }
    return 0;
}
"""

TILE_READS = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
int main(int argc, char **argv) {
    const size_t total = 512ul << 20;
    const int tile = atoi(argv[1]), ahead = atoi(argv[2]);
    char *buf = aligned_alloc(4096, total);
    const size_t tiles = total / (size_t)tile;
    int64_t *order = malloc(tiles * sizeof(int64_t));
    for (size_t i = 0; i < total; i += 4096) buf[i] = 1;
    for (size_t i = 0; i < tiles; i++) order[i] = (int64_t)i;
    srand(1);
    for (size_t i = tiles - 1; i > 0; i--) {
        const size_t j = (size_t)rand() % (i + 1);
        const int64_t t = order[i];
        order[i] = order[j], order[j] = t;
    }
    double best = 1e30;
    float check = 0.f;
    for (int rep = 0; rep < 3; rep++) {
        const double t0 = omp_get_wtime();
        float sum = 0.f;
#pragma omp parallel reduction(+ : sum)
        {
            __m256 acc = _mm256_setzero_ps();
#pragma omp for schedule(static)
            for (size_t i = 0; i < tiles; i++) {
                if (ahead && i + ahead < tiles)
                    for (int o = 0; o < tile; o += 64) _mm_prefetch(buf + order[i + ahead] * tile + o, _MM_HINT_T1);
                const char *p = buf + order[i] * tile;
                for (int o = 0; o < tile; o += 64) acc = _mm256_add_ps(acc, _mm256_load_ps((const float *)(p + o)));
            }
            sum += acc[0] + acc[7];
        }
        const double dt = omp_get_wtime() - t0;
        best = dt < best ? dt : best, check += sum;
    }
    printf("%d B tiles, %d ahead: %.1f GB/s (checksum %g)\n", tile, ahead, total / best / 1e9, check);
    return 0;
}
"""


def best(fn, trials: int = 5) -> float:
    fn()
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def bandwidth() -> None:
    x = torch.ones(1 << 28)  # 1 GiB of float32
    y = torch.empty_like(x)
    nbytes = x.numel() * x.element_size()
    read = best(lambda: x.sum())
    copy = best(lambda: y.copy_(x))
    print(f"read {nbytes / read / 1e9:.1f} GB/s, copy (read + write) {2 * nbytes / copy / 1e9:.1f} GB/s, "
          f"{torch.get_num_threads()} threads")


def loop_peak(label: str, loop: str, threads: int, runs: tuple[tuple[str, ...], ...] = ((),)) -> None:
    """Build and run one of the C loops above under OpenMP (once per argument list in ``runs``); print
    what it prints."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        print(f"{label}: skipped (no C compiler)")
        return
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "loop.c", Path(tmp) / "loop"
        source.write_text(loop)
        build = subprocess.run([compiler, "-O3", "-march=native", "-fopenmp", "-o", str(binary), str(source)],
                               capture_output=True, text=True)
        if build.returncode != 0:
            print(f"{label}: skipped (this CPU's build lacks it: {build.stderr.strip().splitlines()[-1]})")
            return
        lines = []
        for args in runs:
            run = subprocess.run([str(binary), *args], capture_output=True, text=True,
                                 env={"OMP_NUM_THREADS": str(threads)})
            lines += run.stdout.strip().splitlines()
        print(f"{label}:", "; ".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bandwidth()
    loop_peak("FMA peak (float32, 8 lanes)", FMA_LOOP, args.threads)
    loop_peak("bf16 peak (vdpbf16ps, 16 lanes x 2 products)", BF16_LOOP, args.threads)
    loop_peak("tile reads (random order)", TILE_READS, args.threads,
              tuple((str(tile), str(ahead)) for tile in (2048, 4096, 8192) for ahead in (0, 2, 4)))


if __name__ == "__main__":
    main()
