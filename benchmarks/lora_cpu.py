"""Multi-LoRA throughput: a batch whose requests use N adapters, against the same batch on the base model.

Random adapters of rank R on all seven projections (q/k/v/o/gate/up/down) are written as PEFT folders
(adapter_config.json + adapter_model.safetensors) for the model's shapes; the requests' adapters go
round-robin. Three runs of the same requests, alternated ``--pairs`` times (each figure the median):

    plain   the base model in an engine without LoRA
    base    the base model in the LoRA engine (no request names an adapter)
    mixed   the LoRA engine, every request with one of the N adapters

and the ratios mixed / plain (what serving adapters costs) and mixed / base. Output tokens per
second over the whole generate call (prefill included).

    python benchmarks/lora_cpu.py                             # SmolLM2 on the CPU, 4 adapters of rank 16
    python benchmarks/lora_cpu.py --smoke                     # a quick check that it runs
    python benchmarks/lora_cpu.py --device cuda --model llama-3.1-8b-shape --adapters 8 --requests 256 \\
        --input-len 512 --output-len 256 --only lora          # one engine per process (benchmarks/lora_gpu.sh)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from podium import LLM, SamplingParams
from podium.lora.request import LoRARequest

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def projection_shapes(config) -> dict[str, tuple[int, int]]:
    """(out, in) of each adaptable projection of a Llama-family config."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    inter = config.intermediate_size
    return {"q_proj": (heads * head_dim, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
            "o_proj": (hidden, heads * head_dim), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
            "down_proj": (hidden, inter)}


def write_adapter(folder: Path, config, rank: int, seed: int) -> None:
    """A random PEFT LoRA folder for ``config`` (bf16 tensors; B random, so the adapter matters)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for name, (out, inp) in projection_shapes(config).items():
            part = "self_attn" if name in TARGETS[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, inp, generator=gen) / inp**0.5).bfloat16()
            tensors[f"{key}.lora_B.weight"] = (torch.randn(out, rank, generator=gen) / rank**0.5 * 0.1).bfloat16()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(TARGETS), "bias": "none"}))


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams, loras) -> tuple[float, float, float]:
    """Output tokens per second of one generate call over ``prompts``, and its two phases' seconds:
    until every request has its first token (the prompts' prefill, and the decode steps of requests
    already past it), then the rest (decode alone)."""
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras, use_tqdm=False)
    seconds = time.perf_counter() - start
    metrics = [o.metrics for o in outs]
    prefill = decode = float("nan")
    if all(m is not None and m.first_token_time is not None and m.last_token_time is not None for m in metrics):
        first_tokens = max(m.first_token_time for m in metrics)
        prefill = first_tokens - min(m.arrival_time for m in metrics)
        decode = max(m.last_token_time for m in metrics) - first_tokens
    return sum(len(o.outputs[0].token_ids) for o in outs) / seconds, prefill, decode


def engine(args, lora: bool) -> LLM:
    extra = dict(enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank) if lora else {}
    return LLM(args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
               max_num_seqs=args.requests, enable_prefix_caching=False, **extra)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--only", choices=("plain", "lora"), help="build one engine (a process each on a GPU)")
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--smoke", action="store_true", help="4 requests of 16/8 tokens, one pair")
    args = parser.parse_args()
    if args.smoke:
        args.requests, args.input_len, args.output_len, args.pairs = 4, 16, 8, 1
    engines = {}
    if args.only != "lora":
        engines["plain"] = engine(args, lora=False)
    if args.only != "plain":
        engines["lora"] = engine(args, lora=True)
    config = next(iter(engines.values())).engine.source.hf_config
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, config.vocab_size, (args.requests, args.input_len), generator=gen).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    runs = {"plain": [], "base": [], "mixed": []}
    phases = {"plain": [], "base": [], "mixed": []}  # (prefill phase, decode phase) seconds per run
    with tempfile.TemporaryDirectory() as root:
        adapters = []
        if "lora" in engines:
            for i in range(args.adapters):
                write_adapter(Path(root) / f"a{i}", config, args.rank, seed=i)
                adapters.append(LoRARequest(f"a{i}", i + 1, str(Path(root) / f"a{i}")))
        mixed = [adapters[i % len(adapters)] for i in range(args.requests)] if adapters else None
        cases = [("plain", "plain", None), ("base", "lora", None), ("mixed", "lora", mixed)]
        cases = [case for case in cases if case[1] in engines]
        warm = max(1, args.requests // 4)
        for _, which, loras in cases:  # warm-up: graphs, allocator, adapters registered and in slots
            run(engines[which], prompts[:warm], SamplingParams(max_tokens=4), loras and loras[:warm])
        for _ in range(args.pairs):
            for name, which, loras in cases:
                tokens_per_s, prefill, decode = run(engines[which], prompts, params, loras)
                runs[name].append(tokens_per_s)
                phases[name].append((prefill, decode))
    report(args, {name: values for name, values in runs.items() if values},
           {name: values for name, values in phases.items() if values})


def report(args, runs: dict[str, list[float]], phases: dict[str, list[tuple[float, float]]]) -> None:
    median = {name: statistics.median(values) for name, values in runs.items()}
    phase = {name: [statistics.median(p[i] for p in values) for i in (0, 1)] for name, values in phases.items()}
    print(f"{args.model} on {args.device}, {args.requests} requests x {args.input_len} in / {args.output_len} out, "
          f"{args.adapters} adapters of rank {args.rank} (all 7 projections), {args.pairs} alternated runs (median)")
    for name, values in runs.items():
        print(f"{name:6s} {median[name]:9.1f} out tok/s   runs {', '.join(f'{v:.1f}' for v in values)}   "
              f"phases: {phase[name][0]:.2f} s until every first token, {phase[name][1]:.2f} s after")
    ratios = {}
    for num, den in (("mixed", "plain"), ("mixed", "base"), ("base", "plain")):
        if num in median and den in median:
            ratios[f"{num}/{den}"] = median[num] / median[den]
            print(f"ratio {num} / {den}: {ratios[f'{num}/{den}']:.3f}   phases' time {den} / {num}: "
                  f"{phase[den][0] / phase[num][0]:.3f} until every first token, {phase[den][1] / phase[num][1]:.3f} after")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": vars(args), "runs": runs, "median": median,
                                                   "ratios": ratios, "phases": phase}, indent=1))


if __name__ == "__main__":
    main()
