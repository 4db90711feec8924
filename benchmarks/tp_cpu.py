"""Tensor parallelism on the CPU: TP=n against TP=1 on the same cores, and the plan channels.

    python benchmarks/tp_cpu.py                                  # SmolLM2 (GGUF), TP=3 (its one split), 32 x 128
    python benchmarks/tp_cpu.py --tp 2 --model qwen3-0.6b-shape  # a shape that 2 divides
    python benchmarks/tp_cpu.py --num-prompts 4 --output-len 8   # a quick check that it runs

Runs the same greedy batch (random token prompts, ``--input-len`` / ``--output-len``) with TP=1,
then TP=n with the plan sent through the shared-memory ring and through a torch.distributed
broadcast. For each TP run it reports output tok/s, the ratio to TP=1, and rank 0's per-step
communication time: sending the plan (the control plane) and the time spent inside the model's
collectives (all-reduce, all-gather: this includes waiting for the slower rank). On 2 cores TP
is not expected to win; the numbers show what the control plane costs.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from podium import LLM, SamplingParams


class Timed:
    """Wraps a callable, summing its wall time."""

    def __init__(self, fn) -> None:
        self.fn, self.seconds, self.calls = fn, 0.0, 0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


def run(args, tp: int, channel: str) -> dict:
    llm = LLM(args.model, tensor_parallel_size=tp, plan_broadcast=channel, dtype=args.dtype, device="cpu",
              max_model_len=args.input_len + args.output_len + 8, seed=0)
    engine = llm.engine
    send = comm = None
    if engine.tp is not None:
        group = engine.tp.group
        send = group.channel.send = Timed(group.channel.send)
        comm = group.comm
        comm.all_reduce, comm.all_gather = Timed(comm.all_reduce), Timed(comm.all_gather)
    g = torch.Generator().manual_seed(0)
    vocab = engine.source.hf_config.vocab_size
    prompts = [{"prompt_token_ids": torch.randint(10, vocab - 10, (args.input_len,), generator=g).tolist()}
               for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)  # warm up
    steps = [0]
    step = engine.step

    def counted():
        steps[0] += 1
        return step()

    engine.step = counted
    if send is not None:
        send.seconds = comm.all_reduce.seconds = comm.all_gather.seconds = 0.0
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {"tp": tp, "channel": channel if tp > 1 else "-", "output_tok_s": tokens / seconds, "steps": steps[0],
              "seconds": seconds, "tokens": [o.outputs[0].token_ids for o in outs]}
    if send is not None:
        result["plan_send_ms_per_step"] = 1e3 * send.seconds / max(1, steps[0])
        result["collectives_ms_per_step"] = 1e3 * (comm.all_reduce.seconds + comm.all_gather.seconds) / max(1, steps[0])
    engine.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tp", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--json-out")
    args = parser.parse_args()
    base = run(args, 1, "shm")
    rows = [base] + [run(args, args.tp, channel) for channel in ("shm", "torch")]
    print(f"{args.model} {args.num_prompts} x {args.input_len}/{args.output_len} {args.dtype}, "
          f"{torch.get_num_threads()} threads")
    for row in rows:
        extra = ""
        if row["tp"] > 1:
            extra = (f"  plan send {row['plan_send_ms_per_step']:.3f} ms/step, collectives "
                     f"{row['collectives_ms_per_step']:.2f} ms/step, same tokens as TP=1: {row['tokens'] == base['tokens']}")
        print(f"TP={row['tp']} {row['channel']:>5}: {row['output_tok_s']:8.1f} out tok/s "
              f"(x{row['output_tok_s'] / base['output_tok_s']:.2f} of TP=1), {row['steps']} steps{extra}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "tokens"} for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
