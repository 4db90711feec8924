"""LoRA on a GPU end to end: a tiny random Llama with four random adapters, float32, greedy; the engine
on ``--device`` (decode graphs captured with the adapters in them, async scheduling as the platform
chooses) must give the CPU platform's tokens for a batch mixing the adapters and the base model,
and for the same prompts on the base model alone (steps without adapters: graphs captured without
them), and each request alone the same tokens as in the mix. Prints one line per check and exits
non-zero on a mismatch (benchmarks/lora_gpu.sh runs it).

    python benchmarks/lora_gpu_check.py --device cuda
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from lora_cpu import write_adapter

from podium import LLM, SamplingParams
from podium.lora.request import LoRARequest

TINY = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False}


def tiny_model(folder: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1.0 + 0.1 * torch.randn_like(param) if "norm" in name else 0.08 * torch.randn_like(param))
    model.save_pretrained(folder)


def generate(folder: Path, device: str, prompts, loras, eager: bool) -> list[list[int]]:
    """The mixed batch's tokens, then the same prompts' on the base model alone (steps without any
    adapter: on a GPU, the decode graphs captured without the adapters' ops)."""
    llm = LLM(str(folder), device=device, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
              max_model_len=256, max_num_seqs=16, enforce_eager=eager)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    mixed = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in mixed]
    base = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    alone = [llm.generate([{"prompt_token_ids": p}], params, lora_request=lora, use_tqdm=False)[0].outputs[0].token_ids
             for p, lora in zip(prompts[:4], loras[:4])]
    if alone != tokens[:4]:
        print(f"FAIL {device}: a request alone differs from the same request in the mixed batch")
        sys.exit(1)
    graphs = sorted(llm.engine.runner.graphs)
    runner = llm.engine.runner
    with_adapters = bool(graphs) and runner.lora.graphs_have_adapters
    base_only = "a second set" if runner.base_graphs is not None else "the same" if graphs else "none"
    print(f"{device}: {len(prompts)} requests, graphs {graphs or 'none'}, graphs with adapters: {with_adapters}, "
          f"graphs for steps without adapters: {base_only}")
    return tokens + [o.outputs[0].token_ids for o in base]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        root = Path(root)
        tiny_model(root / "base")
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(root / "base")
        loras = []
        for i in range(4):
            write_adapter(root / f"a{i}", config, 16, seed=i)
            loras.append(LoRARequest(f"a{i}", i + 1, str(root / f"a{i}")))
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, 512, (int(n),), generator=gen).tolist() for n in torch.randint(2, 60, (12,), generator=gen)]
        which = [loras[i % 5] if i % 5 < 4 else None for i in range(12)]
        want = generate(root / "base", "cpu", prompts, which, eager=True)
        got = generate(root / "base", args.device, prompts, which, eager=False)
        bad = [i for i, (a, b) in enumerate(zip(want, got)) if a != b]
        if bad:
            print(f"FAIL: requests {bad} differ between {args.device} and cpu (first: {got[bad[0]]} vs {want[bad[0]]}; "
                  f"past {len(prompts) - 1}: the base-only batch)")
            sys.exit(1)
        print(f"OK: {args.device} equals cpu for all {len(prompts)} requests (4 adapters over 2 slots, and the base), "
              f"and for the same prompts on the base model alone")


if __name__ == "__main__":
    main()
