"""What the batch-invariant mode costs on the CPU: offline throughput with and without it, same run.

    python benchmarks/invariant_cpu.py [--num-prompts 32] [--input-len 48] [--output-len 128] [--rounds 3]

Two engines on the same model (SmolLM2 in bf16 by default), one with ``batch_invariant=True``, run
the same greedy batch in alternated rounds (so a busy machine slows both alike); prints each
round's output tokens/s and the median ratio mode / default. Also checks that the mode's outputs
are the same in every round (they must be: nothing else changes between rounds).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from podium import LLM, SamplingParams

WORDS = "alpha beta gamma delta river mountain code python music light paris tokyo seven blue".split()


def prompts(tokenizer, count: int, input_len: int) -> list[list[int]]:
    rng = random.Random(0)
    out = []
    for _ in range(count):
        ids = tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(2 * input_len)))
        out.append(ids[:input_len])
    return out


def timed(llm: LLM, batch: list[list[int]], params: SamplingParams) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": ids} for ids in batch], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return sum(map(len, tokens)) / elapsed, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=48)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    engines = {mode: LLM(args.model, dtype=args.dtype, batch_invariant=mode == "invariant")
               for mode in ("default", "invariant")}
    batch = prompts(engines["default"].get_tokenizer(), args.num_prompts, args.input_len)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for llm in engines.values():  # warm-up: kernels built, graphs captured
        timed(llm, batch[:4], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    ratios, seen = [], []
    for r in range(args.rounds):
        rates = {}
        for mode, llm in engines.items():
            rates[mode], tokens = timed(llm, batch, params)
            if mode == "invariant":
                seen.append(tokens)
        ratios.append(rates["invariant"] / rates["default"])
        print(f"round {r + 1}: default {rates['default']:.1f} out tok/s, batch-invariant {rates['invariant']:.1f} "
              f"({ratios[-1]:.2f}x)", flush=True)
    print(f"batch-invariant / default, {args.num_prompts} x {args.input_len}/{args.output_len} {args.dtype}: "
          f"median {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")
    print("mode's outputs the same every round:", all(t == seen[0] for t in seen))


if __name__ == "__main__":
    main()
