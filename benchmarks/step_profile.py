"""Where a throughput run's time goes, step by step: mixed (prefill) steps vs pure-decode steps.

    python benchmarks/step_profile.py --model llama-3.1-8b-shape --num-prompts 256 --input-len 512 --output-len 256

Times every ``engine.step()`` (host + device, synchronized by the token fetch) and the host-only
part (the step minus the runner's execute), then prints totals per step kind. With async scheduling
(the CUDA default) a step's time is its launch plus the wait for the previous step's tokens, so
totals per kind still add up to the run. ``--kernels`` then profiles one mixed and one decode step
(synchronously) with torch.profiler and prints the top device kernels of each.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from podium import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3.1-8b-shape")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--kernels", action="store_true", help="profile one mixed and one decode step")
    args = parser.parse_args()
    t0 = time.perf_counter()
    llm = LLM(args.model, max_model_len=args.max_model_len, async_scheduling=args.async_scheduling,
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_dtype=args.kv_cache_dtype)
    engine = llm.engine
    print(f"startup {time.perf_counter() - t0:.1f} s: {engine.startup_seconds}")
    vocab = engine.source.hf_config.vocab_size
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for warm in (True, False):
        n = 16 if warm else args.num_prompts
        for i in range(n):
            engine.add_request(f"{warm}-{i}", [rng.randrange(vocab) for _ in range(args.input_len)], params)
        runner, records = engine.runner, []
        execute = runner.execute

        def timed(plan, *rest, _execute=execute, _records=records, **options):
            start = time.perf_counter()
            result = _execute(plan, *rest, **options)
            _records[-1]["execute"] = time.perf_counter() - start
            return result

        runner.execute = timed
        begin = time.perf_counter()
        while engine.has_unfinished_requests():
            records.append({})
            start = time.perf_counter()
            engine.step()
            rec = records[-1]
            rec["step"] = time.perf_counter() - start
            rec["kind"] = "decode" if engine.runner.last_used_graph else "mixed"
        runner.execute = execute
        if warm:
            continue
        total = time.perf_counter() - begin
        print(f"{args.num_prompts} x {args.input_len}/{args.output_len}: {total:.2f} s, "
              f"{args.num_prompts * args.output_len / total:.0f} output tok/s, {len(records)} steps")
        for kind in ("mixed", "decode"):
            recs = [r for r in records if r.get("kind") == kind and "execute" in r]
            if recs:
                steps = [r["step"] for r in recs]
                host = [r["step"] - r["execute"] for r in recs]
                print(f"  {kind:6s}: {len(recs)} steps, {sum(steps):.2f} s, median step {statistics.median(steps) * 1e3:.2f} ms, "
                      f"median host outside execute {statistics.median(host) * 1e3:.2f} ms")
    if args.kernels:
        profile_kernels(engine, args, vocab, rng, params)


def profile_kernels(engine, args, vocab, rng, params) -> None:
    """One mixed step (prefill chunks) and one decode step under torch.profiler, synchronous."""
    from torch.profiler import ProfilerActivity, profile

    engine.async_scheduling = False
    for i in range(args.num_prompts):
        engine.add_request(f"k-{i}", [rng.randrange(vocab) for _ in range(args.input_len)], params)
    for kind in ("mixed", "decode"):
        found = False
        while engine.has_unfinished_requests() and not found:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                engine.step()
            found = ("decode" if engine.runner.last_used_graph else "mixed") == kind
        if not found:
            print(f"--- no {kind} step (decode steps are the graph-replayed ones) ---")
            continue
        print(f"--- one {kind} step: top device kernels ---")
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=int(os.environ.get("PROFILE_ROWS", "12")), max_name_column_width=60))
    engine.abort_request([f"k-{i}" for i in range(args.num_prompts)])


if __name__ == "__main__":
    main()
