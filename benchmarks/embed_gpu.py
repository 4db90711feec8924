"""Embedding models on one device: correctness against transformers, then embeddings/s against it.

    python benchmarks/embed_gpu.py --device cuda --out DIR      # what benchmarks/embed_gpu.sh runs
    python benchmarks/embed_gpu.py --device cpu --smoke          # a quick check that it runs (CPU)

1. ``check``: tiny random models saved with ``save_pretrained``: a ``BertModel`` with a
   sentence-transformers folder (mean pooling + Normalize), and a Qwen3 decoder run with
   ``runner="pooling"`` (last token). Podium's embeddings of ragged token-id inputs against
   transformers' hidden states pooled here (mean over the attention mask / last token), float32 and
   bfloat16: the minimum cosine similarity and the largest absolute difference.
2. ``throughput``: a BERT-base shape (12 layers, hidden 768; random weights, no download), N inputs
   of 32-256 tokens: Podium's ``LLM.embed`` against transformers' ``BertModel`` on the same device
   in batches of 64 sorted by length (what sentence-transformers does), bf16, alternated.
Results: one line per figure on stdout and in ``DIR/summary.txt``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from podium import LLM

TINY_BERT = {"vocab_size": 120, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
             "intermediate_size": 96, "max_position_embeddings": 128}
BERT_BASE = {"vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
             "intermediate_size": 3072, "max_position_embeddings": 512}
TINY_QWEN3 = {"vocab_size": 120, "hidden_size": 64, "intermediate_size": 112, "num_hidden_layers": 3,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 256,
              "tie_word_embeddings": True}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def save_bert(folder: Path, shape: dict, seed: int = 0):
    """A random BertModel with sentence-transformers files (mean pooling, Normalize); returns it."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    model = BertModel(BertConfig(**shape), add_pooling_layer=False).eval()
    model.save_pretrained(folder)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    return model


def save_qwen3(folder: Path, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**TINY_QWEN3)).eval()
    model.save_pretrained(folder)
    return model


def inputs(count: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def reference(model, prompts: list[list[int]], device: str, dtype: torch.dtype, pooling: str) -> torch.Tensor:
    """transformers' last hidden states, padded batch with an attention mask, pooled here (float32)."""
    model = model.to(device=device, dtype=dtype)
    longest = max(map(len, prompts))
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros(len(prompts), longest, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, :len(p)], mask[i, :len(p)] = torch.tensor(p), 1
    with torch.no_grad():
        if pooling == "last":  # one at a time: a decoder's padding would need left-padding care
            rows = [model(torch.tensor([p], device=device), output_hidden_states=True).hidden_states[-1][0, -1]
                    for p in prompts]
            return torch.nn.functional.normalize(torch.stack(rows).float(), dim=-1).cpu()
        hidden = model(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state.float()
        m = mask.to(device)[..., None].float()
        return torch.nn.functional.normalize((hidden * m).sum(1) / m.sum(1), dim=-1).cpu()


def embed(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in llm.embed([{"prompt_token_ids": p} for p in prompts],
                                                                use_tqdm=False)])


def check(device: str, lines: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for name, pooling in (("bert", "mean"), ("qwen3", "last")):
            folder = Path(tmp) / name
            folder.mkdir()
            hf = save_bert(folder, TINY_BERT) if name == "bert" else save_qwen3(folder)
            prompts = inputs(24, 1, 100, 120, seed=1)
            for dtype in DTYPES:
                llm = LLM(str(folder), device=device, dtype=dtype, runner="pooling", max_num_seqs=8)
                got = embed(llm, prompts)
                want = reference(hf, prompts, device, DTYPES[dtype], pooling)
                cos = torch.nn.functional.cosine_similarity(got.double(), want.double(), dim=-1).min()
                lines.append(f"check {name} ({pooling} pooling) {dtype}: min cosine {float(cos):.7f}, "
                             f"max abs diff {float((got - want).abs().max()):.2e} over {len(prompts)} ragged inputs")
                del llm


def throughput(device: str, count: int, pairs: int, lines: list[str], shape: dict = BERT_BASE) -> None:
    from transformers import BertModel

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        save_bert(folder, shape)
        longest = min(256, shape["max_position_embeddings"])
        prompts = inputs(count, min(32, longest), longest, shape["vocab_size"], seed=2)
        tokens = sum(map(len, prompts))
        llm = LLM(str(folder), device=device, dtype="bfloat16", max_num_seqs=256, max_num_batched_tokens=16384)
        hf = BertModel.from_pretrained(str(folder), dtype=torch.bfloat16, attn_implementation="sdpa",
                                       add_pooling_layer=False).to(device).eval()
        order = sorted(range(count), key=lambda i: len(prompts[i]))

        def transformers_run() -> None:
            for start in range(0, count, 64):
                batch = [prompts[i] for i in order[start:start + 64]]
                reference(hf, batch, device, torch.bfloat16, "mean")

        def podium_run() -> None:
            embed(llm, prompts)

        def timed(fn) -> float:
            torch.cuda.synchronize() if device == "cuda" else None
            started = time.perf_counter()
            fn()
            torch.cuda.synchronize() if device == "cuda" else None
            return count / (time.perf_counter() - started)

        podium_run(), transformers_run()  # warm-up
        ours, theirs = [], []
        for _ in range(pairs):
            ours.append(timed(podium_run))
            theirs.append(timed(transformers_run))
        a, b = statistics.median(ours), statistics.median(theirs)
        name = "BERT-base" if shape is BERT_BASE else "tiny BERT"
        lines.append(f"throughput {name} shape bf16, {count} inputs ({tokens} tokens): podium {a:.0f} embeddings/s, "
                     f"transformers (batch 64, sorted) {b:.0f}/s, ratio {a / b:.2f}x (median of {pairs} pairs)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--count", type=int, default=4096)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="a few inputs of a tiny BERT, one pair")
    args = parser.parse_args()
    count, pairs = (16, 1) if args.smoke else (args.count, args.pairs)
    lines: list[str] = []
    check(args.device, lines)
    for line in lines:
        print(line, flush=True)
    throughput(args.device, count, pairs, lines, TINY_BERT if args.smoke else BERT_BASE)
    print(lines[-1], flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "summary.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
