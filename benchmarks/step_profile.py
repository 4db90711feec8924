"""Where a throughput run's time goes, step by step: mixed (prefill) steps vs pure-decode steps.

    python benchmarks/step_profile.py --model llama-3.1-8b-shape --num-prompts 256 --input-len 512 --output-len 256

Times every ``engine.step()`` (host + device, synchronized by the token fetch) and the host-only
part (the step minus the runner's execute), then prints totals per step kind. With async scheduling
(the CUDA default) a step's time is its launch plus the wait for the previous step's tokens, so
totals per kind still add up to the run. ``--kernels`` then profiles one mixed and one decode step
(synchronously) with torch.profiler and prints the top device kernels of each.

``--clocks`` samples the GPU's SM clock and power (NVML, every 10 ms) during the timed run and prints
them by the kind of step running. ``--timeline`` then runs the workload again under torch.profiler
(CUDA activity) and splits the GPU's whole run into graph replays (decode steps) and eager work
(mixed steps, inputs): busy and idle time of each, the idle before each replay, and the kernels'
totals by family, so a run's device time can be set against one profiled step's.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import statistics
import tempfile
import threading
import time

import torch
from graph_gaps import short  # benchmarks/ is the script's folder, first on sys.path

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
    parser.add_argument("--clocks", action="store_true", help="sample SM clock and power during the run (NVML)")
    parser.add_argument("--timeline", action="store_true", help="profile a whole second run's GPU timeline")
    args = parser.parse_args()
    t0 = time.perf_counter()
    llm = LLM(args.model, max_model_len=args.max_model_len, async_scheduling=args.async_scheduling,
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_dtype=args.kv_cache_dtype)
    engine = llm.engine
    print(f"startup {time.perf_counter() - t0:.1f} s: {engine.startup_seconds}")
    vocab = engine.source.hf_config.vocab_size
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    sampler = ClockSampler() if args.clocks else None
    for warm in (True, False):
        n = 16 if warm else args.num_prompts
        for i in range(n):
            engine.add_request(f"{warm}-{i}", [rng.randrange(vocab) for _ in range(args.input_len)], params)
        runner, records = engine.runner, []
        if sampler and not warm:
            sampler.start()
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
            if sampler:
                sampler.kind = rec["kind"]
        runner.execute = execute
        if warm:
            continue
        if sampler:
            sampler.stop()
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
        if sampler:
            sampler.report()
    if args.timeline:
        timeline(engine, args, vocab, rng, params)
    if args.kernels:
        profile_kernels(engine, args, vocab, rng, params)


class ClockSampler:
    """SM clock (MHz), power (W) and clock-event reasons from NVML every 10 ms, tagged with ``kind``:
    the kind of the step the engine last ran (async scheduling: the GPU may be one step behind)."""

    def __init__(self, period: float = 0.01):
        import pynvml

        pynvml.nvmlInit()
        self.nvml, self.handle, self.period = pynvml, pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device()), period
        self.kind, self.samples, self.running = "start", [], False
        self.reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            pynvml.nvmlDeviceGetCurrentClocksThrottleReasons

    def start(self) -> None:
        self.running = True
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.running = False
        self.thread.join()

    def _loop(self) -> None:
        nvml, handle = self.nvml, self.handle
        while self.running:
            clock = nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)
            power = nvml.nvmlDeviceGetPowerUsage(handle) / 1e3
            reasons = self.reasons(handle)
            self.samples.append((self.kind, clock, power, reasons))
            time.sleep(self.period)

    def report(self) -> None:
        names = {v: k for k, v in vars(self.nvml).items() if k.startswith(("nvmlClocksEventReason", "nvmlClocksThrottleReason")) and isinstance(v, int)}
        for kind in ("mixed", "decode"):
            rows = [s for s in self.samples if s[0] == kind]
            if not rows:
                continue
            clocks, powers = sorted(r[1] for r in rows), sorted(r[2] for r in rows)
            reasons = collections.Counter(name for r in rows for bit, name in names.items()
                                          if bit and r[3] & bit == bit and bin(bit).count("1") == 1)
            print(f"  clocks while {kind:6s} steps run: SM {clocks[0]}-{clocks[-1]} MHz (median {statistics.median(clocks):.0f}), "
                  f"power {powers[0]:.0f}-{powers[-1]:.0f} W (median {statistics.median(powers):.0f}), {len(rows)} samples, "
                  f"reasons {dict(reasons.most_common(4))}")


def timeline(engine, args, vocab, rng, params) -> None:
    """The workload once more under torch.profiler: the GPU's run split into graph replays and eager work."""
    from torch.profiler import ProfilerActivity, profile

    for i in range(args.num_prompts):
        engine.add_request(f"t-{i}", [rng.randrange(vocab) for _ in range(args.input_len)], params)
    torch.cuda.synchronize()
    begin = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        while engine.has_unfinished_requests():
            engine.step()
        torch.cuda.synchronize()
    wall = time.perf_counter() - begin
    path = os.path.join(tempfile.mkdtemp(), "run.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    print_timeline(events, wall)


def print_timeline(events: list[dict], wall: float) -> None:
    """Chrome-trace events -> graph-launch segments and eager segments, printed (see ``timeline``)."""
    launches = {e["args"]["correlation"]: e["name"] for e in events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    ops = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    # segments: consecutive operations of one graph launch (a decode step), or eager operations between them
    segments, end = [], ops[0]["ts"]
    for op in ops:
        corr = op.get("args", {}).get("correlation")
        key = ("graph", corr) if "GraphLaunch" in launches.get(corr, "") else ("eager", None)
        if not segments or segments[-1]["key"] != key:
            segments.append({"key": key, "start": op["ts"], "end": op["ts"], "busy": 0.0, "idle": 0.0,
                             "before": max(op["ts"] - end, 0.0), "ops": 0, "families": collections.Counter()})
        seg = segments[-1]
        if seg["ops"]:
            seg["idle"] += max(op["ts"] - end, 0.0)
        seg["busy"] += op["dur"]
        seg["ops"] += 1
        seg["families"][short(op["name"])] += op["dur"]
        end = max(end, op["ts"] + op["dur"])
        seg["end"] = end
    span = (end - ops[0]["ts"]) / 1e3
    busy = sum(op["dur"] for op in ops) / 1e3
    print(f"--- timeline: {len(ops)} GPU operations, wall {wall:.2f} s (profiled), GPU span {span:.1f} ms, "
          f"busy {busy:.1f} ms, idle {span - busy:.1f} ms ---")
    for seg in segments:  # eager work: a mixed step's forward (many kernels) or a decode step's input copies
        seg["kind"] = seg["key"][0] if seg["key"][0] == "graph" else "mixed" if seg["ops"] >= 50 else "inputs"
    for kind in ("graph", "mixed", "inputs"):
        segs = [s for s in segments if s["kind"] == kind]
        if not segs:
            continue
        spans = [(s["end"] - s["start"]) / 1e3 for s in segs]
        print(f"  {kind:6s}: {len(segs)} segments, span {sum(spans):.1f} ms (median {statistics.median(spans):.3f}), "
              f"busy {sum(s['busy'] for s in segs) / 1e3:.1f} ms, idle inside {sum(s['idle'] for s in segs) / 1e3:.1f} ms "
              f"(median {statistics.median(s['idle'] for s in segs) / 1e3:.3f}), idle before "
              f"{sum(s['before'] for s in segs) / 1e3:.1f} ms (median {statistics.median(s['before'] for s in segs) / 1e3:.3f}), "
              f"median {statistics.median(s['ops'] for s in segs):.0f} operations")
        families = collections.Counter()
        for s in segs:
            families.update(s["families"])
        for name, total in families.most_common(8):
            print(f"      {name:48s} {total / 1e3:9.1f} ms ({total / 1e3 / len(segs):.3f} a segment)")
    graphs = [s for s in segments if s["kind"] == "graph"]
    if graphs:  # the decode steps over the run: does a replay slow down as contexts grow or clocks fall?
        tenth = max(len(graphs) // 10, 1)
        cells = [f"{statistics.median((s['end'] - s['start']) / 1e3 for s in graphs[i:i + tenth]):.2f}"
                 for i in range(0, len(graphs), tenth)]
        print(f"  graph replay span by tenth of the run (ms): {' '.join(cells)}")


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
