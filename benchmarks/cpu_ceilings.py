"""This CPU's ceilings: memory read bandwidth (torch, 1 GiB), the float32 FMA peak and the bf16 dot-product peak.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/cpu_ceilings.py [--threads 2]

Bandwidth: a float32 sum over 1 GiB (bytes read / best time of 5) and a copy (read + write).
FMA peak: a C loop of 12 independent 8-lane FMA chains (AVX2 + FMA) compiled with the system C
compiler, one per thread under OpenMP, each thread's GFLOP/s; skipped where no compiler or no AVX2.
bf16 peak: the same with 24 chains of ``vdpbf16ps`` (AVX512-BF16: 16 lanes, two products each), the
instruction the bf16 linears and prefill attention run on CPUs without AMX; skipped where the CPU
lacks it. A bf16 kernel's GF/s against this sum over the threads is its fraction of the peak.
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


def loop_peak(label: str, loop: str, threads: int) -> None:
    """Build and run one of the C loops above under OpenMP; print each thread's GFLOP/s."""
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
        run = subprocess.run([str(binary)], capture_output=True, text=True, env={"OMP_NUM_THREADS": str(threads)})
        print(f"{label}:", "; ".join(run.stdout.strip().splitlines()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bandwidth()
    loop_peak("FMA peak (float32, 8 lanes)", FMA_LOOP, args.threads)
    loop_peak("bf16 peak (vdpbf16ps, 16 lanes x 2 products)", BF16_LOOP, args.threads)


if __name__ == "__main__":
    main()
