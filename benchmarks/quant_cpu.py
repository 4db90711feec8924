"""SmolLM2-135M Q4_1 kept quantized on the CPU, against its references measured in the same run:

    python benchmarks/quant_cpu.py [--decode-tokens 128] [--batch 32] [--batch-tokens 128] [--trials 3]
                                   [--dtypes float32 bfloat16] [--llama-python /tmp/llamacpp/bin/python]
                                   [--formats Q4_1 Q8_0 Q4_K] [--vector-path]

decode: batch-1 greedy decode, tokens/s (prompt included, as for llama.cpp), of the embedded GGUF kept
in its blocks (``quantization="gguf"``), of the same file dequantized at load (``quantization="none"``,
today's default) in each ``--dtypes``, and of llama.cpp on the same file and cores: ``llama-cpp-python``
run by ``--llama-python`` (an interpreter of a virtual environment that has it: it is a benchmark-only
dependency, ``python3 -m venv /tmp/llamacpp && /tmp/llamacpp/bin/pip install llama-cpp-python``; it
compiles for ~11 minutes), or imported here where installed.
batch: ``--batch`` prompts x ``--batch-tokens`` output tokens, output tokens/s, the same variants.
--formats: the kept variants' files, Q4_1 the embedded one, the others written from it by
benchmarks/gguf_requantize.py (gguf-py; Q4_K only where rows are whole 256-weight blocks, SmolLM2's
down projections). --vector-path: each kept variant also with the GGUF batches off the 512-bit path
(AMX-INT8 tiles, or their layout on AVX-512 VNNI) on the AVX2 / VNNI-256 kernels, where the 512-bit one runs. Ratios are against the fastest dequantized variant; trials interleave every variant (llama.cpp too)
so that a busy machine slows them alike, and the best trial counts. Leave OMP_WAIT_POLICY unset, as
for any benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from podium import LLM, SamplingParams
from podium.loader import embedded_gguf_path

PROMPT = "Once upon a time, in a small village,"

# run by --llama-python: prints the rate of `tokens` greedy tokens on `threads` threads, generated
# whatever they are (EOS does not stop them, as ignore_eos for Podium), the prompt's evaluation included
LLAMA_CPP = """
import json, sys, time
from llama_cpp import Llama
path, prompt, tokens, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
model = Llama(path, n_threads=threads, n_threads_batch=threads, n_ctx=512, verbose=False)
ids = model.tokenize(prompt.encode())

def rate(n):
    model.reset()
    started, made = time.perf_counter(), 0
    for _ in model.generate(ids, temp=0.0, top_k=1, reset=True):
        made += 1
        if made == n:
            break
    return made / (time.perf_counter() - started)

rate(4)
print(json.dumps(rate(tokens)))
"""

def podium_rate(llm: LLM, prompts: int, tokens: int) -> float:
    """Output tokens/s of ``prompts`` copies of PROMPT, ``tokens`` each (EOS ignored)."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate([PROMPT] * prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm
    started = time.perf_counter()
    llm.generate([PROMPT] * prompts, params, use_tqdm=False)
    return prompts * tokens / (time.perf_counter() - started)


def llama_cpp_rate(python: str | None, tokens: int, threads: int) -> float | None:
    """llama.cpp's decode rate, in a child process of ``python`` (or this one); None where it is missing."""
    python = python or sys.executable
    args = [python, "-c", LLAMA_CPP, str(embedded_gguf_path()), PROMPT, str(tokens), str(threads)]
    out = subprocess.run(args, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        if "No module named 'llama_cpp'" in out.stderr:
            return None
        raise RuntimeError(f"llama.cpp run failed: {out.stderr.strip()[-2000:]}")
    return float(json.loads(out.stdout.strip().splitlines()[-1]))


def kept_files(formats: list[str], folder: Path) -> dict[str, str]:
    """{format: model argument}: the embedded file for Q4_1, else a re-quantized copy in ``folder``."""
    sys.path.insert(0, str(Path(__file__).parent))
    from gguf_requantize import requantize

    files = {}
    for fmt in formats:
        if fmt == "Q4_1":
            files[fmt] = "smollm2-135m-instruct"
            continue
        target = folder / f"smollm2-135m-{fmt}.gguf"
        print(f"{fmt}: {requantize(embedded_gguf_path(), target, fmt)}", flush=True)
        files[fmt] = str(target)
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--batch-tokens", type=int, default=128)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--llama-python", default=None, help="a python with llama-cpp-python installed")
    parser.add_argument("--formats", nargs="+", default=["Q4_1"], choices=["Q4_1", "Q8_0", "Q4_K"])
    parser.add_argument("--vector-path", action="store_true",
                        help="kept variants also off the AMX / AVX-512 VNNI batch path")
    args = parser.parse_args()
    threads = len(os.sched_getaffinity(0))
    from podium_cpu.native_kernels import load_kernels

    kernels, _ = load_kernels()
    amx = kernels is not None and bool(kernels.amx_linear) and bool(kernels.gguf_amx(1))
    vnni512 = kernels is not None and not amx and bool(kernels.gguf_vnni512(1))
    wide = "AMX tiles" if amx else "AVX-512 VNNI" if vnni512 else None

    def batches_wide(on: bool) -> None:  # the 512-bit batch path on or off (the AVX2 / VNNI-256 rows)
        if amx:
            kernels.gguf_amx(1 if on else 0)
        elif vnni512:
            kernels.gguf_vnni512(1 if on else 0)

    folder = tempfile.TemporaryDirectory()
    engines = {f"none {dtype}": (LLM("smollm2-135m-instruct", device="cpu", dtype=dtype, quantization="none"), True)
               for dtype in args.dtypes}
    for fmt, model in kept_files(args.formats, Path(folder.name)).items():
        for dtype in args.dtypes:
            llm = LLM(model, device="cpu", dtype=dtype, quantization="gguf")
            engines[f"gguf {fmt} {dtype}"] = (llm, True)
            if args.vector_path and wide:
                engines[f"gguf {fmt} {dtype} vectors"] = (llm, False)
    rates: dict[str, list[float]] = {}
    for _ in range(args.trials):
        for name, (llm, tiles) in engines.items():
            batches_wide(tiles)
            rates.setdefault(f"decode {name}", []).append(podium_rate(llm, 1, args.decode_tokens))
            rates.setdefault(f"batch {name}", []).append(podium_rate(llm, args.batch, args.batch_tokens))
        batches_wide(True)
        cpp = llama_cpp_rate(args.llama_python, args.decode_tokens, threads)
        if cpp is not None:
            rates.setdefault("decode llama.cpp", []).append(cpp)
    best = {name: max(values) for name, values in rates.items()}
    print(f"SmolLM2-135M (kept: {' '.join(args.formats)}), {threads} threads, best of {args.trials}, "
          f"GGUF batches on the 512-bit path: {wide or 'no'}; ratios against the fastest dequantized path")
    for kind in ("decode", "batch"):
        base = max(rate for name, rate in best.items() if name.startswith(f"{kind} none"))
        for name, rate in best.items():
            if name.startswith(kind):
                print(f"{name:32s} {rate:9.1f} tok/s   x{rate / base:.2f}")
    kept = max(rate for name, rate in best.items() if name.startswith("decode gguf"))
    if "decode llama.cpp" in best:
        print(f"kept quantized / llama.cpp, batch-1 decode: x{kept / best['decode llama.cpp']:.2f}")
    else:
        print("llama.cpp: not measured (--llama-python PATH, or pip install llama-cpp-python here)")


if __name__ == "__main__":
    main()
