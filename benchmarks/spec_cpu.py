"""Speculative decoding on the CPU: SmolLM2 with n-gram prompt lookup against plain decoding, batch 1.

The workload is where prompt lookup pays: a document and a request to repeat it with small edits,
so most of the answer is in the prompt. Both engines run in this process on the same requests,
alternated ``--pairs`` times; each figure is the median. Reports ms per output token, the ratio
plain / speculative, and the acceptance rate and mean accepted length of the n-gram engine. ms per
output token is decode time: from a request's first token to its last, over the tokens after the
first (the prompt's prefill is the same in both and left out).

    python benchmarks/spec_cpu.py --pairs 3 --k 4
    python benchmarks/spec_cpu.py --smoke     # a quick check that it runs

``--oracle`` (any model, e.g. a random-weight shape): the proposer is replaced by one that proposes
the plain engine's own greedy output, recorded first: every draft is accepted, as with the model as
its own draft but without a draft's cost, so the ratio is the verify step's ceiling at that k and
its overhead shows where it falls short of k + 1. ``--device cuda`` runs the same on a GPU.
"""

from __future__ import annotations

import argparse
import statistics

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

    def propose(self, token_ids: list[int], k: int | None = None) -> list[int]:
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


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
    """(decode seconds, tokens after the first) for the prompts one at a time (batch 1): from each
    request's first token to its last, so the prompt's prefill (the same for both) is left out."""
    seconds, tokens = 0.0, 0
    for prompt in prompts:
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        seconds += out.metrics.last_token_time - out.metrics.first_token_time
        tokens += len(out.outputs[0].token_ids) - 1
    return seconds, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--oracle", action="store_true", help="propose the recorded greedy output (100%% accepted)")
    parser.add_argument("--smoke", action="store_true", help="1 request, 16 tokens, 1 pair")
    args = parser.parse_args()
    if args.smoke:
        args.requests, args.max_tokens, args.pairs = 1, 16, 1
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": args.lookup_max,
            "prompt_lookup_min": 1}
    common = dict(device=args.device, dtype=args.dtype, enable_prefix_caching=False, max_num_seqs=8,
                  max_model_len=args.max_model_len)
    plain = LLM(args.model, **common)
    ngram = LLM(args.model, speculative_config=spec, **common)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=args.oracle)
    if args.oracle:
        prompts = random_prompts(args.requests, 64, plain.engine.source.hf_config.vocab_size)
        outs = plain.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        ngram.engine.proposer = OracleProposer(args.k, [(p, o.outputs[0].token_ids) for p, o in zip(prompts, outs)])
    else:
        prompts = requests(plain.engine, args.requests)
    run(plain, prompts[:1], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    run(ngram, prompts[:1], SamplingParams(temperature=0, max_tokens=4))
    ms = {"plain": [], "ngram": []}
    for _ in range(args.pairs):
        for name, llm in (("plain", plain), ("ngram", ngram)):
            seconds, tokens = run(llm, prompts, params)
            ms[name].append(1000 * seconds / tokens)
    stats = ngram.engine.stats().spec_decoding
    plain_ms, ngram_ms = statistics.median(ms["plain"]), statistics.median(ms["ngram"])
    workload = "random 64-token prompts, oracle drafts" if args.oracle else "repeat-with-edits requests"
    print(f"{args.model} on {args.device}, batch 1, {args.requests} {workload} x {args.max_tokens} tokens, "
          f"{args.pairs} alternated pairs (median)")
    print(f"plain      {plain_ms:7.2f} ms/token   runs {', '.join(f'{x:.2f}' for x in ms['plain'])}")
    print(f"{'oracle' if args.oracle else 'ngram'} k={args.k}  {ngram_ms:7.2f} ms/token   runs {', '.join(f'{x:.2f}' for x in ms['ngram'])}")
    print(f"ratio (plain / speculative ms/token): {plain_ms / ngram_ms:.2f}x")
    print(f"acceptance rate {stats.acceptance_rate:.3f}, mean accepted length {stats.mean_accepted_length:.2f}, "
          f"per position {', '.join(f'{r:.2f}' for r in stats.acceptance_rate_per_position)}")


if __name__ == "__main__":
    main()
