"""Speculative decoding's device-only checks (CUDA): verify steps replayed from graphs change nothing.

On SmolLM2 in float32, greedy, four prompts (two that repeat text, so n-gram drafts are accepted):
the plain engine's tokens are the reference; n-gram k=4 with its verify steps replayed from
captured graphs, the same with them run eagerly, the model as its own draft (every draft accepted),
and a random EAGLE-3 head (the target's hidden states kept through the graphs) must give the same
tokens. Prints one PASS/FAIL line per check and the verify-graph replays counted.

    python benchmarks/spec_gpu_check.py --model /path/SmolLM2-135M-Instruct.Q4_1.gguf
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from podium import LLM, SamplingParams

PROMPTS = [
    "Repeat this exactly: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat.",
    "Copy the list: alpha, beta, gamma, delta, alpha, beta, gamma, delta, alpha, beta,",
    "List three colors:",
    "Explain what a KV cache is in one sentence.",
]


def generate(llm: LLM, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def count_verify_replays(llm: LLM) -> list[int]:
    """Wraps the runner's execute: [verify steps, those replayed from a graph]."""
    runner, counts = llm.engine.runner, [0, 0]
    execute = runner.execute

    def counted(plan, *args):
        step = execute(plan, *args)
        if plan.sample_drafts:
            counts[0] += 1
            counts[1] += step.used_graph
        return step

    runner.execute = counted
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tokenizer", default=None, help="for a model without one (a shape's config.json)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--device", default="cuda", help="cpu runs the same checks without verify graphs")
    args = parser.parse_args()
    common = dict(device=args.device, dtype="float32", max_num_seqs=8, max_model_len=512, kv_cache_memory="1GiB")
    if args.tokenizer:
        common["tokenizer"] = args.tokenizer
    want = generate(LLM(args.model, **common), args.max_tokens)
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    failures = 0

    def check(name: str, llm: LLM, eager_verify: bool = False) -> None:
        nonlocal failures
        if eager_verify:
            llm.engine.runner.verify_graphs.captured.clear()
        counts = count_verify_replays(llm)
        got = generate(llm, args.max_tokens)
        same = sum(g == w for g, w in zip(got, want))
        spec = llm.engine.stats().spec_decoding
        ok = same == len(want) and (eager_verify or counts[1] > 0 or args.device == "cpu")
        failures += not ok
        print(f"{'PASS' if ok else 'FAIL'} {name}: {same}/{len(want)} outputs equal plain; verify steps {counts[0]}, "
              f"replayed {counts[1]}; acceptance {spec.acceptance_rate:.3f}", flush=True)

    check("ngram k=4, verify graphs", LLM(args.model, speculative_config=ngram, **common))
    check("ngram k=4, eager verify", LLM(args.model, speculative_config=ngram, **common), eager_verify=True)
    self_draft = {"method": "draft_model", "model": args.model, "num_speculative_tokens": 4}
    llm = LLM(args.model, speculative_config=self_draft, **common)
    check("draft_model (itself) k=4", llm)
    rate = llm.engine.stats().spec_decoding.acceptance_rate
    # 1.0 where both compute alike; a near-tie may flip between the draft's and the verify's batch shapes
    print(f"{'PASS' if rate >= 0.98 else 'FAIL'} self-draft acceptance {rate:.4f} (~1.0: the draft's cache is the "
          "target's)")
    failures += rate < 0.98
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from eagle_fixtures import save_eagle_head

    with tempfile.TemporaryDirectory() as folder:
        save_eagle_head(Path(folder), llm.engine.source.hf_config, eagle3=True, seed=1,
                        draft_vocab=2048)
        head = {"method": "eagle3", "model": folder, "num_speculative_tokens": 3}
        check("eagle3 random head k=3", LLM(args.model, speculative_config=head, **common))
    print("ALL PASS" if not failures else f"{failures} FAILED")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
