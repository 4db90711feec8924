"""The batch-invariant mode through the engine on a GPU: one model, one mode, a process (run by
benchmarks/invariant_gpu.sh, which also runs invariant_gpu_kernels.py and writes the summary).

    python benchmarks/invariant_gpu.py engine --model llama-3.1-8b-shape --mode on --out DIR [--throughput] [--streams]
    python benchmarks/invariant_gpu.py summary --out DIR

64 target requests (56 greedy, 8 seeded top-k/top-p samples; random token prompts of 40-300 tokens,
16 new tokens each) are run every way the issue names, and each way's tokens are kept in
DIR/<model>-<mode>.json:
- engine A (no prefix cache, 256 rows, whole prompts in a step up to the 8192-token budget):
  ``alone`` (each target its own batch: the reference), ``batches of 8`` (4 targets among 4
  fillers), ``64 rows`` (the targets together), ``256 rows`` (among 192 fillers; past the budget,
  so some prompts are chunked), then ``--streams``: the 64 targets and 192 fillers as 256
  concurrent streams through the server's engine loop (podium_server.ThreadEngine, in process:
  the device image has no fastapi/uvicorn), each target's deltas concatenated;
- engine B (prefix cache, 64-token step budget, 96 KV blocks): ``prefix hit`` (groups of 4
  targets run twice; the second run's tokens, read over their cached blocks), ``chunked +
  preempted`` (the targets among 48 fillers of up to 128 new tokens: 64-token chunks, preemptions
  by recompute).
``--throughput``: ``podium bench throughput``'s workload, 256 x 512/256 random prompts, greedy, EOS
ignored, timed after a warm-up, output tokens/s. ``summary`` compares every way with ``alone`` of
the same model and mode, and the mode's throughput with the default's.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import sys
import time
from pathlib import Path

NUM_TARGETS, NEW_TOKENS = 64, 16
B_BLOCKS = 96  # engine B's KV: 1536 tokens, four targets' prompts, far from the 96 sequences at once
VOCAB_LOW, VOCAB_HIGH = 1000, 30000  # token ids every Llama-3 shape has


def targets() -> list[tuple[list[int], dict]]:
    rng = random.Random(34)
    out = []
    for i in range(NUM_TARGETS):
        prompt = [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(rng.randint(40, 300))]
        seeded = i % 8 == 7
        params = dict(temperature=0.8, top_p=0.9, top_k=50, seed=i) if seeded else dict(temperature=0.0)
        out.append((prompt, dict(max_tokens=NEW_TOKENS, ignore_eos=True, **params)))
    return out


def fillers(count: int, seed: int, max_tokens: int = 24) -> list[tuple[list[int], dict]]:
    rng = random.Random(seed)
    return [([rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(rng.randint(10, 200))],
             dict(temperature=rng.choice([0.0, 1.0]), max_tokens=rng.randint(1, max_tokens), ignore_eos=True))
            for _ in range(count)]


def generate(llm, requests) -> list[list[int]]:
    from podium import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p, _ in requests], [SamplingParams(**s) for _, s in requests],
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def run_mixed(llm, group: list[int], extra, seed: int) -> dict[int, list[int]]:
    """Targets ``group`` shuffled among ``extra`` fillers in one generate call -> tokens by target."""
    tgt = targets()
    batch = [(i, tgt[i]) for i in group] + [(None, f) for f in extra]
    random.Random(seed).shuffle(batch)
    tokens = generate(llm, [r for _, r in batch])
    return {i: t for (i, _), t in zip(batch, tokens) if i is not None}


def engine_a(llm, streams: bool) -> dict[str, dict[int, list[int]]]:
    tgt = targets()
    ways: dict[str, dict[int, list[int]]] = {"alone": {i: generate(llm, [tgt[i]])[0] for i in range(NUM_TARGETS)}}
    ways["batches of 8"] = {}
    for g in range(0, NUM_TARGETS, 4):
        ways["batches of 8"].update(run_mixed(llm, list(range(g, g + 4)), fillers(4, g), g))
    ways["64 rows"] = run_mixed(llm, list(range(NUM_TARGETS)), [], 64)
    ways["256 rows"] = run_mixed(llm, list(range(NUM_TARGETS)), fillers(192, 256), 256)
    if streams:
        ways["256 streams"] = asyncio.run(concurrent_streams(llm.engine))
    return ways


async def concurrent_streams(engine) -> dict[int, list[int]]:
    """256 requests at once through the server's engine loop, each target's deltas concatenated."""
    from podium import SamplingParams
    from podium_server.thread_engine import ThreadEngine

    tgt = targets()
    batch = [(i, r) for i, r in enumerate(tgt)] + [(None, f) for f in fillers(192, 999)]
    random.Random(9).shuffle(batch)
    served = ThreadEngine(engine)
    served.start()

    async def one(n: int, request) -> list[int]:
        stream = await served.add(f"r{n}", request[0], SamplingParams(**request[1]))
        tokens = []
        async for delta in stream.outputs():
            tokens += delta.outputs[0].token_ids
        return tokens

    try:
        results = await asyncio.gather(*(one(n, r) for n, (_, r) in enumerate(batch)))
    finally:
        await served.stop()
    return {i: t for (i, _), t in zip(batch, results) if i is not None}


def engine_b(llm) -> tuple[dict[str, dict[int, list[int]]], dict]:
    tgt, ways = targets(), {"prefix hit": {}}
    hits_before = llm.engine.stats().prefix_cache_hits
    for g in range(0, NUM_TARGETS, 4):
        group = [tgt[i] for i in range(g, g + 4)]
        generate(llm, group)  # fills the cache
        ways["prefix hit"].update(dict(zip(range(g, g + 4), generate(llm, group))))
    hits = llm.engine.stats().prefix_cache_hits - hits_before
    preemptions = llm.engine.stats().num_preemptions
    ways["chunked + preempted"] = run_mixed(llm, list(range(NUM_TARGETS)), fillers(48, 5, max_tokens=128), 5)
    return ways, {"prefix_cache_hits": hits, "preemptions": llm.engine.stats().num_preemptions - preemptions}


def throughput(llm) -> dict:
    from podium import SamplingParams

    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(512)]} for _ in range(256)]
    params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    llm.generate(prompts[:8], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"workload": "256 x 512/256", "output_tokens": tokens, "seconds": seconds, "out_tok_s": tokens / seconds}


def engine_main(args) -> None:
    import torch

    from podium import LLM

    path = Path(args.out) / f"{Path(args.model).name.removesuffix('.json')}-{args.mode}.json"
    result: dict = {"model": args.model, "mode": args.mode, "ways": {}, "stats": {}, "seconds": {}}
    common = dict(dtype="bfloat16", device=args.device, batch_invariant=args.mode == "on", max_model_len=1024,
                  seed=0)

    def save() -> None:
        path.write_text(json.dumps(result))

    begin = time.perf_counter()
    llm = LLM(args.model, enable_prefix_caching=False, max_num_seqs=256, num_kv_blocks=args.blocks, **common)
    result["seconds"]["engine A start"] = time.perf_counter() - begin
    begin = time.perf_counter()
    result["ways"].update(engine_a(llm, args.streams))
    result["seconds"]["engine A ways"] = time.perf_counter() - begin
    save()
    if args.throughput:
        result["throughput"] = throughput(llm)
        save()
    llm.engine.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if args.skip_b:
        return
    begin = time.perf_counter()
    llm = LLM(args.model, enable_prefix_caching=True, max_num_seqs=64, max_num_batched_tokens=64,
              num_kv_blocks=B_BLOCKS, **common)
    ways, result["stats"] = engine_b(llm)
    result["ways"].update(ways)
    result["seconds"]["engine B"] = time.perf_counter() - begin
    save()
    llm.engine.shutdown()


def summary_main(args) -> None:
    out = Path(args.out)
    runs = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*-on.json")) + sorted(out.glob("*-off.json"))}
    lines = []
    for name, run in runs.items():
        alone = run["ways"].get("alone")
        if not alone:
            lines.append(f"{name}: no reference run (see log.txt)")
            continue
        seeded = {str(i) for i in range(NUM_TARGETS) if i % 8 == 7}
        parts = []
        for way, tokens in run["ways"].items():
            if way == "alone":
                continue
            differ = [i for i in alone if tokens.get(i) != alone[i]]
            parts.append(f"{way}: {len(differ)}/{len(alone)} differ ({len(set(differ) & seeded)} seeded)")
        stats = run.get("stats") or {}
        extra = f"; engine B: {stats.get('prefix_cache_hits', '?')} prefix-cache hit tokens, " \
                f"{stats.get('preemptions', '?')} preemptions" if stats else ""
        lines.append(f"{name}: " + "; ".join(parts) + extra)
    for model in sorted({r["model"] for r in runs.values()}):
        on, off = runs.get(f"{model}-on", {}).get("throughput"), runs.get(f"{model}-off", {}).get("throughput")
        if on and off:
            lines.append(f"{model} throughput {on['workload']}: batch-invariant {on['out_tok_s']:.0f} out tok/s, "
                         f"default {off['out_tok_s']:.0f}: {on['out_tok_s'] / off['out_tok_s']:.2f}x")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    engine = sub.add_parser("engine")
    engine.add_argument("--model", required=True)
    engine.add_argument("--mode", choices=("on", "off"), required=True)
    engine.add_argument("--out", required=True)
    engine.add_argument("--device", default="cuda")
    engine.add_argument("--blocks", type=int, default=12800, help="engine A's KV blocks (256 x 768 tokens fit)")
    engine.add_argument("--throughput", action="store_true")
    engine.add_argument("--streams", action="store_true")
    engine.add_argument("--skip-b", action="store_true", help="engine A only")
    summary = sub.add_parser("summary")
    summary.add_argument("--out", required=True)
    args = parser.parse_args()
    (engine_main if args.command == "engine" else summary_main)(args)


if __name__ == "__main__":
    sys.exit(main())
