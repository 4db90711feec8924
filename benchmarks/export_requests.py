"""Write a ``podium bench`` request list to a JSONL file, so other engines can run the same requests.

    python benchmarks/export_requests.py --out requests.jsonl --num-prompts 32 --input-len 48 --output-len 128

One line per request: ``{"prompt": [token ids], "output_len": n}``, the format ``podium bench
throughput --dataset file --dataset-path`` reads back, built exactly as ``--dataset random`` (or
``sharegpt-like``) would build it for the model: same seed, same token space (special tokens
avoided). Feeding the file to every engine (Podium, transformers, vLLM) pins identical token ids.
"""

from __future__ import annotations

import argparse
import json
import sys

from podium_bench.datasets import DatasetSpec, build_requests, summarize
from podium_bench.tokenizers import token_space_for


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dataset", default="random", choices=("random", "sharegpt-like"))
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=48)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--range-ratio", type=float, default=0.0)
    parser.add_argument("--max-model-len", type=int, default=None, help="the context the requests must fit")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    spec = DatasetSpec(name=args.dataset, num_prompts=args.num_prompts, input_len=args.input_len,
                       output_len=args.output_len, range_ratio=args.range_ratio, seed=args.seed)
    requests = build_requests(spec, token_space_for(args.model, args.max_model_len))
    with open(args.out, "w") as f:
        for r in requests:
            f.write(json.dumps({"prompt": list(r.prompt_token_ids), "output_len": r.output_len}) + "\n")
    stats = summarize(requests)
    print(f"wrote {args.out}: {stats['num_requests']} requests, {stats['total_input_tokens']} prompt tokens "
          f"(mean {stats['mean_input_len']:.1f}), {stats['total_output_tokens']} output tokens", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
