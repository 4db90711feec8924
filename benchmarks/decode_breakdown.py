"""Where one pure-decode step's time goes, per part of the model (wall-clock wrappers, no profiler).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/decode_breakdown.py --num-seqs 32 --prompt-len 128
    python benchmarks/decode_breakdown.py --prefill --num-seqs 4 --prompt-len 512   # a prefill step instead

Starts ``--num-seqs`` greedy requests, runs until every one of them decodes, then times
``--steps`` engine steps with each part wrapped: norms, the four linears, the attention backend
(``forward_rotary``: rotary embedding, cache write and attention, which a backend may fuse),
SiLU-and-mul, the model's forward, compute_logits, the sampler. Prints min and median
milliseconds per step, and the step's process CPU time (on a shared machine the CPU time is the
steadier number: wall time includes waiting for a core). ``--prefill``: each timed step is a fresh
batch of ``--num-seqs`` prompts of ``--prompt-len`` tokens prefilled in one step (one token each).
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
import time

import torch

from podium import LLM, SamplingParams


def wrap(obj, attr: str, key: str, acc: dict) -> None:
    fn = getattr(obj, attr)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        acc[key] += time.perf_counter() - start
        return result

    setattr(obj, attr, timed)


def instrument(engine, acc: dict) -> None:
    """The layers' norms run with the projection after them (``RMSNorm.then``: the rms_norm_linear op)
    and SiLU-mul with down (``GatedMLP.down``): those are timed whole, the linears inside them too,
    and ``derive`` subtracts."""
    model = engine.model
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for name, module in (("linear qkv", attn.qkv_proj), ("linear o", attn.o_proj),
                             ("linear gate_up", mlp.gate_up_proj), ("linear down", mlp.down_proj)):
            wrap(module, "forward", name, acc)
        wrap(layer.input_layernorm, "then", "norm + qkv", acc)
        wrap(layer.post_attention_layernorm, "then", "norm + gate_up", acc)
        wrap(mlp, "down", "silu_and_mul + down", acc)
    wrap(model.model.norm, "forward", "final norm", acc)
    wrap(model, "forward", "model forward", acc)
    wrap(model, "compute_logits", "compute_logits", acc)
    wrap(engine.runner.backend, "forward_rotary", "attention (+rotary)", acc)
    wrap(engine.sampler, "sample", "sampler", acc)


def derive(acc: dict) -> None:
    """The norms and SiLU-mul alone where the platform runs them apart: the fused ops' time less the
    linears inside them. Where a platform fuses the pair (CPU FmaLinear, CUDA's batch-1 GEMV) the
    linear modules are not called and only the fused entries ("norm + qkv" ...) are shown."""
    if acc.get("linear qkv") and acc.get("linear down"):
        acc["norms"] = acc.pop("norm + qkv") + acc.pop("norm + gate_up") + acc["final norm"] \
            - acc["linear qkv"] - acc["linear gate_up"]
        acc["silu_and_mul"] = acc.pop("silu_and_mul + down") - acc["linear down"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--prefill", action="store_true", help="time prefill steps of fresh prompts instead")
    args = parser.parse_args()
    # eager: a replayed graph (a CPU decode step with native kernels) runs no Python op to time
    engine = LLM(args.model, dtype=args.dtype, max_model_len=2048, enforce_eager=True).engine
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = random.Random(0)
    vocab = engine.source.hf_config.vocab_size
    if args.prefill:
        return prefill_steps(engine, args, rng, vocab)
    params = SamplingParams(temperature=0, max_tokens=args.steps + 64, ignore_eos=True)
    for i in range(args.num_seqs):
        engine.add_request(str(i), [rng.randrange(vocab) for _ in range(args.prompt_len)], params)
    while engine.scheduler.num_waiting or engine.scheduler.num_running < args.num_seqs:
        engine.step()
    for _ in range(5):  # warm
        engine.step()
    acc: dict = collections.defaultdict(float)
    instrument(engine, acc)
    per_step = collections.defaultdict(list)
    for _ in range(args.steps):
        acc.clear()
        wall, cpu = time.perf_counter(), time.process_time()
        engine.step()
        acc["step (wall)"], acc["step (process CPU)"] = time.perf_counter() - wall, time.process_time() - cpu
        derive(acc)
        for key, seconds in acc.items():
            per_step[key].append(seconds * 1e3)
    report(f"{args.num_seqs} decodes, ~{args.prompt_len} tokens of context, {engine.dtype}, "
           f"{torch.get_num_threads()} threads, {args.steps} steps (ms per step)", per_step)


def report(title: str, per_step: dict) -> None:
    print(title)
    for key, values in per_step.items():
        print(f"  {key:20s} min {min(values):7.2f}  median {statistics.median(values):7.2f}")


def prefill_steps(engine, args, rng: random.Random, vocab: int) -> None:
    """``args.steps`` prefill steps (after one untimed), each of num_seqs fresh prompts of prompt_len
    tokens and one output token; the step must take every prompt whole (max_num_batched_tokens)."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    acc: dict = collections.defaultdict(float)
    per_step = collections.defaultdict(list)
    for step in range(args.steps + 1):
        for i in range(args.num_seqs):
            engine.add_request(f"{step}-{i}", [rng.randrange(vocab) for _ in range(args.prompt_len)], params)
        if step == 1:
            instrument(engine, acc)
        acc.clear()
        wall, cpu = time.perf_counter(), time.process_time()
        engine.step()
        acc["step (wall)"], acc["step (process CPU)"] = time.perf_counter() - wall, time.process_time() - cpu
        if engine.scheduler.num_waiting or engine.scheduler.num_running:
            raise SystemExit("the prompts did not fit one step: raise max_num_batched_tokens or lower the sizes")
        if step:
            derive(acc)
            for key, seconds in acc.items():
                per_step[key].append(seconds * 1e3)
    report(f"{args.num_seqs} prompts of {args.prompt_len} tokens prefilled in one step, {engine.dtype}, "
           f"{torch.get_num_threads()} threads, {args.steps} steps (ms per step)", per_step)


if __name__ == "__main__":
    main()
