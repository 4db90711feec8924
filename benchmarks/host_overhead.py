"""Host work of one engine step with 256 running decodes: everything except the model's math.

    python benchmarks/host_overhead.py [--num-seqs 256] [--steps 30] [--output-kind delta|cumulative|final]

Runs the real engine (SmolLM2 on the CPU platform) with ``num_seqs`` running decodes and times
each ``engine.step()``; the model's forward and logits are timed separately (on a CPU they are
synchronous), and so is the sampler (on a CPU its argmax over [256, vocab] is tensor work that a GPU
does on the device; it is reported apart). The rest is the host overhead: scheduling, building the
flat batch, detokenizing, stop checks and building per-token outputs. ``--output-kind delta`` (the
default) is a streaming server's case: each step reports only what is new; ``cumulative`` reports
every request's whole output every step. Prints medians per step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import podium.engine
import podium.runner.eager
import podium.runner.model_runner
from podium import LLM, SamplingParams


class Stopwatch:
    """Sums the time spent in wrapped calls on ``clock``."""

    def __init__(self, clock) -> None:
        self.clock = clock
        self.total = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            start = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total += self.clock() - start
        return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--clock", default="wall", choices=("wall", "thread"),
                        help="wall: perf_counter; thread: this thread's CPU time (robust on a busy machine)")
    parser.add_argument("--output-kind", default="delta", choices=("delta", "cumulative", "final"))
    args = parser.parse_args()
    llm = LLM(args.model, dtype="float32", max_num_seqs=args.num_seqs, max_num_batched_tokens=8192)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=args.steps + 64, ignore_eos=True)
    for i in range(args.num_seqs):
        engine.add_request(str(i), f"Request {i}: tell me about the number {i}.", params,
                           output_kind=args.output_kind)
    while engine.scheduler.num_waiting or any(  # until every prompt is computed: pure decode from here
            s.seq.num_computed_tokens < s.seq.num_prompt_tokens for r in engine._requests.values() for s in r.sequences):
        engine.step()
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    model_time, sampler_time, direct = Stopwatch(clock), Stopwatch(clock), Stopwatch(clock)
    engine.model.forward = model_time.wrap(engine.model.forward)
    engine.model.compute_logits = model_time.wrap(engine.model.compute_logits)
    engine.sampler.sample = sampler_time.wrap(engine.sampler.sample)
    # the host work itself, timed where it happens: plan, flat batch + metadata, book tokens, reports
    scheduler, runner = engine.scheduler, engine.runner
    scheduler.schedule = direct.wrap(scheduler.schedule)
    scheduler.advance = direct.wrap(scheduler.advance)
    podium.engine.plan_step = direct.wrap(podium.engine.plan_step)
    podium.runner.model_runner.host_batch = direct.wrap(podium.runner.model_runner.host_batch)
    podium.runner.eager.device_metadata = direct.wrap(podium.runner.eager.device_metadata)
    runner.backend.prepare_metadata = direct.wrap(runner.backend.prepare_metadata)
    engine._take_tokens = direct.wrap(engine._take_tokens)
    engine._collect = direct.wrap(engine._collect)
    host, sampling, measured = [], [], []
    for _ in range(args.steps):
        model_time.total = sampler_time.total = direct.total = 0.0
        start = clock()
        outputs = engine.step()
        elapsed = clock() - start
        host.append(elapsed - model_time.total - sampler_time.total)
        measured.append(direct.total)
        sampling.append(sampler_time.total)
        assert len(outputs) == (0 if args.output_kind == "final" else args.num_seqs)  # all advanced a token
    engine.abort_request([str(i) for i in range(args.num_seqs)])
    print(f"{args.num_seqs} running decodes ({args.output_kind} outputs), {args.steps} steps, {args.clock} clock:\n"
          f"  host work (scheduler, flat batch + metadata, token booking, reports), timed directly: "
          f"median {statistics.median(measured) * 1e3:.2f} ms, min {min(measured) * 1e3:.2f} ms\n"
          f"  step minus model minus sampler (adds unattributed time: freeing the step's tensors, GC): "
          f"median {statistics.median(host) * 1e3:.2f} ms, min {min(host) * 1e3:.2f} ms\n"
          f"  sampler (greedy argmax on the CPU): median {statistics.median(sampling) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
