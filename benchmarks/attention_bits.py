"""The CPU platform's native attention outputs over a fixed set of steps, to compare two builds bit for bit:

    python benchmarks/attention_bits.py dump OUT.pt        (at each revision: git stash / worktree)
    python benchmarks/attention_bits.py compare A.pt B.pt  (exit 1 when any output or cache differs)

A kernel change that should not move a bit (a reordering of loads, a fused pass) is checked this way
against the revision before it. The steps: float32 and bf16; G = 3, 4, 1, 7, 2, 6 query heads a kv head
at head sizes 64, 64, 128, 128, 80, 32; blocks of 16 and 32; no window, a 37-token sliding window, a
soft cap of 30; a decode step of 7 sequences (1 to 577 tokens) and a mixed step (a 5-token chunk, two
decodes, a 37-token prompt), over blocks in a random order. Each output and the cache after the step's
writes is kept.
"""

from __future__ import annotations

import argparse
import sys

import torch

from podium_cpu.platform import CpuPlatform
from podium_plugin_api import AttentionLayerSpec, AttentionMetadata, KVCacheSpec

SHAPES = ((9, 3, 64), (8, 2, 64), (8, 8, 128), (28, 4, 128), (4, 2, 80), (12, 2, 32))  # (heads, kv heads, D)
STEPS = {"decode": [(1, n) for n in (1, 2, 15, 16, 17, 100, 577)], "mixed": [(5, 40), (1, 33), (37, 37), (1, 200)]}


def dump(path: str) -> None:
    backend = CpuPlatform().attention_backend()
    out = {}
    configs = [(dtype, shape, block, window, cap) for dtype in (torch.float32, torch.bfloat16) for shape in SHAPES
               for block in (16, 32) for window, cap in ((None, None), (37, None), (None, 30.0))]
    for index, (dtype, (heads, kv_heads, head_size), block, window, cap) in enumerate(configs):
        gen = torch.Generator().manual_seed(index)
        layer = AttentionLayerSpec(num_heads=heads, num_kv_heads=kv_heads, head_size=head_size,
                                   scale=head_size**-0.5, sliding_window=window, soft_cap=cap)
        for name, seqs in STEPS.items():
            blocks = [-(-s // block) for _, s in seqs]
            total = sum(blocks) + 3
            order = torch.randperm(total, generator=gen)
            tables, at = [], 0
            for count in blocks:
                tables.append(order[at:at + count].tolist() + [0] * (max(blocks) - count))
                at += count
            meta = AttentionMetadata.from_lengths([q for q, _ in seqs], [s for _, s in seqs], tables, block,
                                                  device="cpu")
            tokens = sum(q for q, _ in seqs)
            spec = KVCacheSpec(num_layers=1, num_kv_heads=kv_heads, head_size=head_size, block_size=block, dtype=dtype)
            cache = torch.randn(backend.kv_cache_shape(spec, total), generator=gen).to(dtype)
            q = torch.randn(tokens, heads, head_size, generator=gen).to(dtype)
            k, v = (torch.randn(tokens, kv_heads, head_size, generator=gen).to(dtype) for _ in range(2))
            o = backend.forward(layer, q, k, v, cache, backend.prepare_metadata(meta))
            out[f"{index} {dtype} {heads}/{kv_heads}x{head_size} B{block} w{window} c{cap} {name}"] = (o.clone(), cache)
    torch.save(out, path)
    print(f"{len(out)} steps ({backend.name}) -> {path}")


def compare(a: str, b: str) -> int:
    first, second = torch.load(a), torch.load(b)
    if first.keys() != second.keys():
        print("the two files hold different steps")
        return 1
    differ = [k for k in first if not all(torch.equal(x, y) for x, y in zip(first[k], second[k], strict=True))]
    for key in differ:
        print("differs:", key)
    print(f"{len(first) - len(differ)} of {len(first)} steps the same bits")
    return 1 if differ else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("dump").add_argument("out")
    both = sub.add_parser("compare")
    both.add_argument("a")
    both.add_argument("b")
    args = parser.parse_args()
    with torch.inference_mode():
        if args.command == "dump":
            dump(args.out)
            return 0
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
