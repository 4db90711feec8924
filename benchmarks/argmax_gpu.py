"""GPU argmax over a 128,256-token vocabulary, eager: torch's argmax on float32 and bf16 logits, the
upcast then argmax (what the sampler did while ``compute_logits`` returned float32), a chunked
two-pass argmax (the CPU sampler's trick), and the CUDA platform's Triton argmax (plugin API 1.3
op), eager and as device time (20 calls captured in a CUDA graph, replayed; launch cost excluded).

    python3 benchmarks/argmax_gpu.py      (on a CUDA machine; prints microseconds per call)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platforms" / "cuda" / "scripts"))
from bench_kernels import graph_ms  # noqa: E402  (the kernel benchmarks' graph timing)

VOCAB = 128256


def chunked_argmax(x: torch.Tensor) -> torch.Tensor:
    """Max of each chunk (a divisor of the vocabulary), the first best chunk, the argmax inside it."""
    rows, vocab = x.shape
    chunk = next(c for c in range(512, 0, -1) if vocab % c == 0)
    chunks = x.view(rows, vocab // chunk, chunk)
    best = chunks.amax(-1).argmax(-1)
    return best * chunk + chunks[torch.arange(rows, device=x.device), best].argmax(-1)


def microseconds(fn, iters: int = 200) -> float:
    for _ in range(10):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e3


def graphed_microseconds(fn, calls: int = 20) -> float:
    """Device time per call: ``calls`` calls captured in one CUDA graph (bench_kernels' graph_ms)."""
    return graph_ms([fn] * calls) * 1e3


def main() -> None:
    from podium_cuda.fused_ops import argmax as triton_argmax

    for rows in (1, 4, 256):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, VOCAB, device="cuda").to(dtype)
            assert torch.equal(chunked_argmax(x), x.argmax(-1))
            assert torch.equal(triton_argmax(x), x.argmax(-1))
            plain = microseconds(lambda x=x: x.argmax(-1))
            chunked = microseconds(lambda x=x: chunked_argmax(x))
            upcast = microseconds(lambda x=x: x.float().argmax(-1))
            ours = microseconds(lambda x=x: triton_argmax(x))
            plain_dev = graphed_microseconds(lambda x=x: x.argmax(-1))
            ours_dev = graphed_microseconds(lambda x=x: triton_argmax(x))
            print(f"n={rows} {str(dtype):15s} argmax {plain:7.1f} us  chunked {chunked:7.1f} us  "
                  f"upcast+argmax {upcast:7.1f} us  triton {ours:7.1f} us | device (graph): "
                  f"argmax {plain_dev:6.1f} us  triton {ours_dev:6.1f} us")


if __name__ == "__main__":
    main()
