"""NCCL (or the platform backend's) all-reduce time of one layer's output, the collective tensor
parallelism runs twice per decoder layer. Run under ``python -m torch.distributed.run --nproc-per-node 2``.

For each hidden size (8B: 4096, 70B: 8192) and token count it prints the median microseconds per
all-reduce in bf16 and what a decode step of the model pays for them (2 per layer); a custom
all-reduce (one-shot over peer memory) would cut the small-message latency that dominates at decode.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from podium_plugin_api import Communicator

LAYERS = {4096: 32, 8192: 80}


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    torch.distributed.init_process_group("nccl")
    comm = Communicator(rank, world)
    for hidden, layers in LAYERS.items():
        for tokens in (1, 8, 64, 256, 2048):
            x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")
            for _ in range(10):
                comm.all_reduce(x)
            times = []
            for _ in range(5):
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(50):
                    comm.all_reduce(x)
                torch.cuda.synchronize()
                times.append((time.perf_counter() - start) / 50)
            us = 1e6 * statistics.median(times)
            if rank == 0:
                print(f"hidden {hidden} tokens {tokens:5d}: {us:8.1f} us per all-reduce, "
                      f"{2 * layers * us / 1000:.2f} ms per step over {layers} layers", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
