"""This CPU's two ceilings: memory read bandwidth (torch, 1 GiB) and the float32 FMA peak per core.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/cpu_ceilings.py [--threads 2]

Bandwidth: a float32 sum over 1 GiB (bytes read / best time of 5) and a copy (read + write).
FMA peak: a C loop of 12 independent 8-lane FMA chains (AVX2 + FMA) compiled with the system C
compiler, one per thread under OpenMP, each thread's GFLOP/s; skipped where no compiler or no AVX2.
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


def fma_peak(threads: int) -> None:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        print("FMA peak: skipped (no C compiler)")
        return
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "fma.c", Path(tmp) / "fma"
        source.write_text(FMA_LOOP)
        build = subprocess.run([compiler, "-O3", "-march=native", "-fopenmp", "-o", str(binary), str(source)],
                               capture_output=True, text=True)
        if build.returncode != 0:
            print(f"FMA peak: skipped (no AVX2 + FMA build here: {build.stderr.strip().splitlines()[-1]})")
            return
        run = subprocess.run([str(binary)], capture_output=True, text=True, env={"OMP_NUM_THREADS": str(threads)})
        print("FMA peak (float32, 8 lanes):", "; ".join(run.stdout.strip().splitlines()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bandwidth()
    fma_peak(args.threads)


if __name__ == "__main__":
    main()
