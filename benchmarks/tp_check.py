"""TP=n against TP=1 greedy tokens for fixed-seed random models (named shapes), one line per case.

    python benchmarks/tp_check.py --tp 2 --shape llama-3.2-1b-shape --dtype bfloat16 --graphs on off
    python benchmarks/tp_check.py --tp 3 --device cpu --shape smollm2-135m-instruct --dtype float32 \
        --num-prompts 2 --output-len 4 --graphs off                   # a CPU dry run (any model works)

A shape model's random weights are the same at every tensor_parallel_size (each rank loads its
slices of the weights TP=1 generates), so the tokens must agree. float32 must match exactly; in
bfloat16 the all-reduce sums partial products in another order, so a random model's near-ties may
flip a token: the line gives the share of prompts whose tokens all agree and the first divergence.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from podium import LLM, SamplingParams


def generate(args, shape: str, dtype: str, tp: int, graphs: bool) -> tuple[list[list[int]], float]:
    llm = LLM(shape, tensor_parallel_size=tp, dtype=dtype, device=args.device, enforce_eager=not graphs,
              max_model_len=args.input_len + args.output_len + 16, seed=0)
    g = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(10, 30000, (args.input_len,), generator=g).tolist()}
               for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    seconds = time.perf_counter() - start
    llm.engine.shutdown()
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--shape", nargs="+", default=["llama-3.2-1b-shape"])
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--graphs", nargs="+", default=["on", "off"], choices=["on", "off"])
    parser.add_argument("--device", default=None)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--json-out")
    args = parser.parse_args()
    rows = []
    for shape in args.shape:
        for dtype in args.dtype:
            for graphs in args.graphs:
                ref, _ = generate(args, shape, dtype, 1, graphs == "on")
                got, _ = generate(args, shape, dtype, args.tp, graphs == "on")
                same = [a == b for a, b in zip(ref, got)]
                first = next((i for i, s in enumerate(same) if not s), None)
                where = ""
                if first is not None:
                    a, b = ref[first], got[first]
                    step = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                    where = f", prompt {first} first differs at token {step}"
                row = {"shape": shape, "dtype": dtype, "graphs": graphs, "tp": args.tp,
                       "prompts_equal": sum(same), "prompts": len(same)}
                rows.append(row)
                print(f"{shape} {dtype} graphs {graphs}: TP={args.tp} == TP=1 for {sum(same)}/{len(same)} prompts"
                      f"{where}", flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
