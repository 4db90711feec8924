"""What structured output costs: JSON-schema decoding against unconstrained decoding, same run.

Throughput: ``--batch`` requests, once with every request constrained by a JSON schema (an array of
20-24 small records, so outputs run long) and once unconstrained, alternated ``--pairs`` times (each
run's prompts are its own, so neither gains from the other's prefix cache); output tokens per second of each, and the ratio constrained / unconstrained (1.0:
free). Both runs are greedy with the same max_tokens; the unconstrained one ignores EOS so its rows
run to max_tokens, the constrained one ends where its grammar ends, so throughput (not time) is
compared.

Time to first token of one request with a schema the engine has never seen (its grammar compiles
first) against the same schema again (a cache hit), median of ``--ttft-runs``.

    python benchmarks/structured_cost.py                                   # CPU, SmolLM2, batch 32
    python benchmarks/structured_cost.py --model llama-3.1-8b-shape --vocab-size 49152 --tokenizer DIR \
        --batch 256 --device cuda
    python benchmarks/structured_cost.py --export-tokenizer DIR            # SmolLM2's tokenizer as a folder

``--backend llguidance`` measures the second backend. Prints one JSON line per result and a summary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid

RECORDS = {"type": "object", "properties": {"records": {"type": "array", "minItems": 20, "maxItems": 24, "items": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                                     "name": {"type": "string", "maxLength": 12},
                                     "tag": {"enum": ["alpha", "beta", "gamma"]},
                                     "ok": {"type": "boolean"}},
    "required": ["id", "name", "tag", "ok"], "additionalProperties": False}}},
    "required": ["records"], "additionalProperties": False}
PROMPT = "List records as JSON with fields id, name, tag and ok:"


def _throughput(llm, params, batch: int, run: str) -> tuple[float, int]:
    prompts = [f"Run {run}, item {i}. {PROMPT}" for i in range(batch)]  # no prefix-cache hits across runs
    start = time.perf_counter()
    outs = llm.generate(prompts, [params] * batch, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / seconds, tokens


def _ttft(llm, schema: dict, backend: str) -> float:
    from podium import SamplingParams
    from podium.sampling_params import StructuredOutputsParams

    engine = llm.engine
    rid = f"ttft-{uuid.uuid4().hex}"
    params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False,
                            structured_outputs=StructuredOutputsParams(json=schema, backend=backend))
    start = time.perf_counter()
    engine.add_request(rid, PROMPT, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.outputs[0].token_ids:
                first = time.perf_counter() - start
                engine.abort_request(rid)
                return first
    raise RuntimeError("the request produced no token")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--ttft-runs", type=int, default=5)
    parser.add_argument("--backend", default="xgrammar")
    parser.add_argument("--vocab-size", type=int, help="a named shape with this vocabulary (the tokenizer's)")
    parser.add_argument("--export-tokenizer", metavar="DIR", help="save the model's tokenizer to DIR and exit")
    args = parser.parse_args()

    from podium import LLM, SamplingParams
    from podium.sampling_params import StructuredOutputsParams

    if args.export_tokenizer:
        from podium.loader import resolve_model
        resolve_model(args.model, args.tokenizer, None).tokenizer.save_pretrained(args.export_tokenizer)
        print(f"tokenizer of {args.model} saved to {args.export_tokenizer}")
        return
    model = args.model
    if args.vocab_size:  # the shape's config with the tokenizer's vocabulary, in a folder of its own
        import tempfile
        from pathlib import Path

        from podium.shapes import NAMED_SHAPES
        folder = Path(tempfile.mkdtemp(prefix="structured-shape-"))
        (folder / "config.json").write_text(json.dumps({**NAMED_SHAPES[args.model], "vocab_size": args.vocab_size}))
        model = str(folder / "config.json")
    kwargs = {"dtype": args.dtype, "max_num_seqs": args.batch, "structured_outputs_backend": args.backend}
    if args.tokenizer:
        kwargs["tokenizer"] = args.tokenizer
    if args.device:
        kwargs["device"] = args.device
    llm = LLM(model, **kwargs)
    # no text: a shape's random weights pick ids past a smaller tokenizer's vocabulary
    plain = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False)
    constrained = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, detokenize=False,
                                 structured_outputs=StructuredOutputsParams(json=RECORDS))
    _throughput(llm, constrained, min(args.batch, 4), "warm-up a")  # compiles the grammar; first steps
    _throughput(llm, plain, min(args.batch, 4), "warm-up b")
    ratios = []
    for pair in range(args.pairs):  # alternated, each first in every other pair
        if pair % 2:
            ours, our_tokens = _throughput(llm, constrained, args.batch, f"{pair}a")
            base, base_tokens = _throughput(llm, plain, args.batch, f"{pair}b")
        else:
            base, base_tokens = _throughput(llm, plain, args.batch, f"{pair}a")
            ours, our_tokens = _throughput(llm, constrained, args.batch, f"{pair}b")
        ratios.append(ours / base)
        print(json.dumps({"pair": pair, "unconstrained_tok_s": round(base, 1), "unconstrained_tokens": base_tokens,
                          "json_schema_tok_s": round(ours, 1), "json_schema_tokens": our_tokens,
                          "ratio": round(ours / base, 3)}), flush=True)
    compile_ttft, cached_ttft = [], []
    for _ in range(args.ttft_runs):
        schema = json.loads(json.dumps(RECORDS))
        schema["properties"][f"f{uuid.uuid4().hex[:8]}"] = {"type": "integer"}  # a schema never seen
        compile_ttft.append(_ttft(llm, schema, args.backend))
        cached_ttft.append(_ttft(llm, schema, args.backend))
    summary = {"model": args.model, "backend": args.backend, "batch": args.batch, "max_tokens": args.max_tokens,
               "throughput_ratio_median": round(statistics.median(ratios), 3),
               "ttft_compile_ms_median": round(1000 * statistics.median(compile_ttft), 1),
               "ttft_cached_ms_median": round(1000 * statistics.median(cached_ttft), 1)}
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
