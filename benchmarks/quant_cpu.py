"""SmolLM2-135M Q4_1 kept quantized on the CPU, against its references measured in the same run:

    python benchmarks/quant_cpu.py [--decode-tokens 128] [--batch 32] [--batch-tokens 128] [--trials 3]

decode: batch-1 greedy decode, tokens/s, of the embedded GGUF kept in its blocks (``quantization``
unset: the gguf method), of the same file dequantized at load to bf16 (``quantization="none"``), and of
llama.cpp on the same file and cores (``llama-cpp-python``, where installed: it is a benchmark-only
dependency, ``pip install llama-cpp-python``; it compiles for a few minutes).
batch: ``--batch`` prompts x ``--batch-tokens`` output tokens, output tokens/s, kept quantized vs the
bf16 path. Each line's ratio is against the bf16 path; trials interleave the variants so that a busy
machine slows them alike (the best trial counts). Leave OMP_WAIT_POLICY unset, as for any benchmark.
"""

from __future__ import annotations

import argparse
import os
import time

from podium import LLM, SamplingParams
from podium.loader import embedded_gguf_path

PROMPT = "Once upon a time, in a small village,"


def podium_rate(llm: LLM, prompts: int, tokens: int) -> float:
    """Output tokens/s of ``prompts`` copies of PROMPT, ``tokens`` each (EOS ignored)."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate([PROMPT] * prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm
    started = time.perf_counter()
    llm.generate([PROMPT] * prompts, params, use_tqdm=False)
    return prompts * tokens / (time.perf_counter() - started)


def llama_cpp_rate(tokens: int, threads: int) -> float | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    model = Llama(str(embedded_gguf_path()), n_threads=threads, n_ctx=512, verbose=False)
    model(PROMPT, max_tokens=4, temperature=0)
    started = time.perf_counter()
    out = model(PROMPT, max_tokens=tokens, temperature=0, ignore_eos=True) if _takes_ignore_eos() else \
        model(PROMPT, max_tokens=tokens, temperature=0)
    return out["usage"]["completion_tokens"] / (time.perf_counter() - started)


def _takes_ignore_eos() -> bool:
    import inspect

    from llama_cpp import Llama

    return "ignore_eos" in inspect.signature(Llama.__call__).parameters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--batch-tokens", type=int, default=128)
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    threads = len(os.sched_getaffinity(0))
    kept = LLM("smollm2-135m-instruct", device="cpu", dtype="bfloat16")
    plain = LLM("smollm2-135m-instruct", device="cpu", dtype="bfloat16", quantization="none")
    rates: dict[str, list[float]] = {}
    for _ in range(args.trials):
        for name, llm in (("kept", kept), ("bf16", plain)):
            rates.setdefault(f"decode {name}", []).append(podium_rate(llm, 1, args.decode_tokens))
            rates.setdefault(f"batch {name}", []).append(podium_rate(llm, args.batch, args.batch_tokens))
        cpp = llama_cpp_rate(args.decode_tokens, threads)
        if cpp is not None:
            rates.setdefault("decode llama.cpp", []).append(cpp)
    best = {name: max(values) for name, values in rates.items()}
    print(f"SmolLM2-135M Q4_1, {threads} threads, best of {args.trials}")
    for name, rate in best.items():
        kind = name.split()[0]
        print(f"{name:18s} {rate:9.1f} tok/s   x{rate / best[f'{kind} bf16']:.2f} of the bf16 path")
    if "decode llama.cpp" not in best:
        print("llama.cpp: not measured (pip install llama-cpp-python to compare)")
    else:
        print(f"kept / llama.cpp decode: x{best['decode kept'] / best['decode llama.cpp']:.2f}")


if __name__ == "__main__":
    main()
