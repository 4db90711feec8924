"""Speculative decoding on the CPU: SmolLM2 with a proposer (n-gram lookup by default) against plain decoding, batch 1.

The workload is where prompt lookup pays: a document and a request to repeat it with small edits,
so most of the answer is in the prompt. Both engines run in this process on the same requests,
alternated ``--pairs`` times; each figure is the median. Reports ms per output token, the ratio
plain / speculative, and the acceptance rate and mean accepted length of the n-gram engine. ms per
output token is decode time: from a request's first token to its last, over the tokens after the
first (the prompt's prefill is the same in both and left out).

    python benchmarks/spec_cpu.py --pairs 3 --k 4
    python benchmarks/spec_cpu.py --method draft_model --draft smollm2-135m-instruct   # its own draft
    python benchmarks/spec_cpu.py --smoke     # a quick check that it runs

``--method draft_model --draft MODEL`` drafts with a model (the target itself: every greedy draft is
accepted, so the ratio is that of a perfect draft as costly as the target, the ceiling for a real
smaller one is between); ``--method eagle|eagle3 --draft FOLDER`` with an EAGLE head checkpoint.

``--oracle`` (any model, e.g. a random-weight shape): the proposer is replaced by one that proposes
the plain engine's own greedy output, recorded first: every draft is accepted, as with the model as
its own draft but without a draft's cost, so the ratio is the verify step's ceiling at that k and
its overhead shows where it falls short of k + 1. ``--device cuda`` runs the same on a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

from podium import LLM, SamplingParams

DOCUMENT = (
    "Podium is an inference engine for large language models. It keeps the key and value cache in "
    "fixed-size blocks, batches requests continuously, splits long prompts into chunks and reuses the "
    "blocks of shared prefixes. A platform plugin supplies the attention kernels, memory sizing and "
    "graph capture for each kind of hardware, so the core stays the same everywhere. The server speaks "
    "the OpenAI API, streams tokens as they are produced and reports its load to a router."
)
EDITS = "Repeat the following text exactly, but write 'engine' instead of 'inference engine' and 'GPU' instead of 'hardware'."


def requests(engine, count: int) -> list[list[int]]:
    prompts = []
    for i in range(count):
        messages = [{"role": "user", "content": f"{EDITS}\n\n{DOCUMENT}" + (" " * i)}]
        prompts.append(engine.apply_chat_template(messages))
    return prompts


class OracleProposer:
    """Proposes the recorded greedy continuation of each prompt (the ``Proposer`` interface)."""

    def __init__(self, k: int, records: list[tuple[list[int], list[int]]]) -> None:
        self.k, self.records = k, records

    def propose(self, token_ids: list[int], k: int | None = None, prediction=None, position: int = 0) -> list[int]:
        k = self.k if k is None else k
        for prompt, output in self.records:
            if token_ids[:len(prompt)] == prompt:
                done = len(token_ids) - len(prompt)
                return output[done:done + k] if output[:done] == token_ids[len(prompt):] else []
        return []


def random_prompts(count: int, length: int, vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


class StepClock:
    """Times each engine step of one engine, noting whether the step verified drafts.

    A random-weight model's near-ties flip between a one-token decode and a (k + 1)-token verify in
    bf16, and a recorded oracle stops proposing once the output leaves the record; so the tokens a
    step yields understate a verify step's ceiling. The step times do not: a verify step of k + 1
    tokens against a plain decode step is the ceiling (k + 1) x decode / verify, whatever was accepted.
    """

    def __init__(self, llm: LLM) -> None:
        self.steps: list[tuple[float, bool]] = []  # (seconds, verified drafts)
        self._drafted = False
        engine = llm.engine
        if engine.speculator is not None:
            propose = engine.speculator.propose

            def noted(running, max_model_len):
                propose(running, max_model_len)
                self._drafted = any(seq.draft_token_ids for seq in running)

            engine.speculator.propose = noted
        step = engine.step

        def timed():
            self._drafted = False
            started = time.perf_counter()
            outputs = step()
            self.steps.append((time.perf_counter() - started, self._drafted))
            return outputs

        engine.step = timed

    def request_done(self) -> None:
        """Drops the request's first step (its prefill) from what ``ms_per_step`` averages."""
        self._kept = getattr(self, "_kept", [])
        self._kept.extend(self.steps[1:])
        self.steps = []

    def ms_per_step(self, drafted: bool) -> float | None:
        times = [s for s, d in getattr(self, "_kept", []) if d == drafted]
        return 1000 * statistics.median(times) if times else None


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams, clock: StepClock | None = None) -> tuple[float, int]:
    """(decode seconds, tokens after the first) for the prompts one at a time (batch 1): from each
    request's first token to its last, so the prompt's prefill (the same for both) is left out."""
    seconds, tokens = 0.0, 0
    for prompt in prompts:
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        if clock is not None:
            clock.request_done()
        seconds += out.metrics.last_token_time - out.metrics.first_token_time
        tokens += len(out.outputs[0].token_ids) - 1
    return seconds, tokens


def speculative_engines(args, common: dict, plain: LLM, prompts, params) -> dict[str, LLM]:
    """One engine per k (named like ``ngram k=4``); with ``--oracle`` each proposes the plain run's output."""
    engines = {}
    records = None
    if args.oracle:
        outs = plain.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        records = [(p, o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
    for k in args.ks:
        if args.method == "ngram":
            spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": args.lookup_max,
                    "prompt_lookup_min": 1}
        else:
            spec = {"method": args.method, "num_speculative_tokens": k, "model": args.draft or args.model}
        llm = LLM(args.model, speculative_config=spec, **common)
        if records is not None:
            llm.engine.speculator.proposer = OracleProposer(k, records)
        engines[f"{'oracle' if args.oracle else args.method} k={k}"] = llm
    return engines


class VerifyGraphSwitch:
    """Runs an engine's verify steps eagerly or from its captured verify graphs, in turn (``--verify-graphs-ab``)."""

    def __init__(self, llm: LLM) -> None:
        self.graphs = llm.engine.runner.verify_graphs.captured
        self.saved = dict(self.graphs)

    def set(self, on: bool) -> None:
        self.graphs.clear()
        if on:
            self.graphs.update(self.saved)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--k", default="4", help="num_speculative_tokens, or a list (2,4,8): one engine each")
    parser.add_argument("--method", default="ngram", choices=("ngram", "draft_model", "eagle", "eagle3"))
    parser.add_argument("--draft", default=None, help="the draft model (draft_model) or head folder (eagle, eagle3)")
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-memory", default=None,
                        help="KV cache bytes per engine (default: 4GiB off the CPU, where several engines share a device)")
    parser.add_argument("--oracle", action="store_true", help="propose the recorded greedy output (100%% accepted)")
    parser.add_argument("--verify-graphs-ab", action="store_true",
                        help="also time each speculative engine with its verify steps eager (not replayed)")
    parser.add_argument("--smoke", action="store_true", help="1 request, 16 tokens, 1 pair")
    args = parser.parse_args()
    if args.smoke:
        args.requests, args.max_tokens, args.pairs = 1, 16, 1
    args.ks = [int(k) for k in args.k.split(",")]
    if args.oracle and args.method != "ngram":
        parser.error("--oracle replaces the n-gram proposer; leave --method at ngram")
    memory = args.kv_cache_memory or (None if args.device == "cpu" else "4GiB")
    common = dict(device=args.device, dtype=args.dtype, enable_prefix_caching=False, max_num_seqs=8,
                  max_model_len=args.max_model_len, **({"kv_cache_memory": memory} if memory else {}))
    plain = LLM(args.model, **common)
    tokenizer = plain.engine.tokenizer
    random_workload = args.oracle or tokenizer is None  # a shape without a tokenizer: random prompts
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=random_workload)
    if random_workload:
        prompts = random_prompts(args.requests, 64, plain.engine.source.hf_config.vocab_size)
    else:
        prompts = requests(plain.engine, args.requests)
    engines = {"plain": plain, **speculative_engines(args, common, plain, prompts, params)}
    runs = dict(engines.items())
    if args.verify_graphs_ab:
        for name, llm in list(engines.items())[1:]:
            runs[name + " eager verify"] = llm
    switches = {name: VerifyGraphSwitch(llm) for name, llm in engines.items() if name != "plain"}
    for llm in engines.values():  # warm-up
        run(llm, prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=random_workload))
    ms: dict[str, list[float]] = {name: [] for name in runs}
    clocks = {name: StepClock(llm) for name, llm in engines.items()}
    for _ in range(args.pairs):
        for name, llm in runs.items():
            base = name.removesuffix(" eager verify")
            if base in switches:
                switches[base].set(not name.endswith(" eager verify"))
            clock = clocks[base] if base == name else None  # step times of graph-replayed verify steps
            seconds, tokens = run(llm, prompts, params, clock)
            clocks[base].steps.clear()  # an eager-verify run's steps are not kept
            ms[name].append(1000 * seconds / tokens)
    report(args, engines, switches, ms, "random 64-token prompts" + (", oracle drafts" if args.oracle else "")
           if random_workload else "repeat-with-edits requests")
    report_steps(args, clocks)


def report(args, engines: dict[str, LLM], switches: dict, ms: dict[str, list[float]], workload: str) -> None:
    print(f"{args.model} on {args.device}, batch 1, {args.requests} {workload} x {args.max_tokens} tokens, "
          f"{args.pairs} alternated rounds (median)")
    plain_ms = statistics.median(ms["plain"])
    for name, values in ms.items():
        median = statistics.median(values)
        ratio = "" if name == "plain" else f"   ratio {plain_ms / median:.2f}x"
        print(f"{name:28s} {median:8.2f} ms/token   runs {', '.join(f'{x:.2f}' for x in values)}{ratio}")
    for name, llm in engines.items():
        stats = llm.engine.stats().spec_decoding
        if stats is not None:
            sizes = sorted(switches[name].saved) or "none (eager)"
            print(f"{name}: acceptance rate {stats.acceptance_rate:.3f}, mean accepted length "
                  f"{stats.mean_accepted_length:.2f}, per position "
                  f"{', '.join(f'{r:.2f}' for r in stats.acceptance_rate_per_position)}; verify graph sizes: {sizes}")


def report_steps(args, clocks: dict[str, StepClock]) -> None:
    """Median step times: a plain decode step against each engine's verify steps, and the ceiling."""
    decode = clocks["plain"].ms_per_step(False)
    if decode is None:
        return
    print(f"plain decode step {decode:.2f} ms (median)")
    for name, clock in clocks.items():
        verify = clock.ms_per_step(True)
        if name == "plain" or verify is None:
            continue
        k = int(name.rsplit("k=", 1)[1])
        print(f"{name}: verify step of {k + 1} tokens {verify:.2f} ms = {verify / decode:.2f}x a decode step; "
              f"ceiling with every draft accepted {(k + 1) * decode / verify:.2f}x")


if __name__ == "__main__":
    main()
