"""One process's place in a tensor-parallel group: joining it, its collectives, the plan channel.

Every rank (the engine's process is rank 0; ``worker`` runs the others) joins the group over the
platform's ``distributed_backend`` (TCP rendezvous on localhost), binds its device
(``Platform.rank_device``) and gets the platform's ``Communicator``. Control traffic (the KV block
count every rank agrees on, the plan when ``plan_broadcast="torch"``) goes over a gloo group: host
tensors, whatever the device's backend.
"""

from __future__ import annotations

import random
import socket
from datetime import timedelta

import torch

from .channel import ShmRing, TorchBroadcast
from .sharding import Split, check_split, connect_model, shard_model

# a collective waits this long for a rank before failing: long enough for the slowest rank's load
# (rank 0 also loads the tokenizer), and the bound on how long a hung (not dead) rank can stall the
# engine; a dead rank is seen at once (the worker monitor, and gloo's closed connections)
COLLECTIVE_TIMEOUT = timedelta(seconds=300)


_PORTS = random.Random()  # seeded from the OS: concurrent processes pick different ports


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (Linux: ``ip_local_port_range``; 32768 elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing is bound to now, for a listener started afterwards (the group's
    rendezvous, a test's server). It comes from below the ephemeral range: a port from bind(0) is one any
    outgoing connection may take before the listener binds it, and the ranks connect to each other while
    a server starts (``podium serve -tp 2`` then failed to bind, "address already in use")."""
    high = _ephemeral_low()
    low = max(1024, high - 12000)
    for _ in range(500):
        port = _PORTS.randrange(low, high)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # every port below the range taken: the kernel's choice
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RankOrderSum:
    """The batch-invariant mode's all-reduce: every rank's partial gathered, then summed in rank
    order, so each element is ((r0 + r1) + r2) + ... whatever the tensor's size. A backend's own
    all-reduce (a ring, say) may cut a tensor into chunks by its size, each summed from another
    rank: with three or more ranks a row's sum would then depend on the batch. The other
    collectives are the platform communicator's."""

    def __init__(self, comm) -> None:
        self.inner = comm

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.inner.world_size == 1:
            return x
        parts = self.inner.all_gather(x.unsqueeze(0), dim=0)  # [world, *x.shape]
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return x.copy_(total)


class TensorParallelGroup:
    """This rank's ``Split``, communicator, control group and plan channel."""

    def __init__(self, platform, rank: int, world_size: int, port: int, plan_broadcast: str,
                 ring: ShmRing | str | None = None, batch_invariant: bool = False) -> None:
        """``ring``: rank 0's ShmRing (created before the workers start), or its name on a worker;
        ``batch_invariant``: sum partial outputs in rank order (``RankOrderSum``)."""
        self.platform, self.rank, self.world_size = platform, rank, world_size
        self.split = Split(rank, world_size)
        # a rank's host threads share the host's cores with the other ranks (restored by close())
        self._threads = torch.get_num_threads()
        torch.set_num_threads(max(1, self._threads // world_size))
        backend = platform.capabilities().distributed_backend
        if torch.distributed.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed group (another tensor-parallel "
                               "engine still running?); call shutdown() on it first")
        torch.distributed.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                             world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
        self.control = None if backend == "gloo" else torch.distributed.new_group(backend="gloo")
        self.comm = platform.communicator(rank, world_size)
        if batch_invariant:
            self.comm = RankOrderSum(self.comm)
        if plan_broadcast == "shm":
            self.channel = ring if isinstance(ring, ShmRing) else ShmRing(world_size - 1, ring, rank - 1)
        else:
            self.channel = TorchBroadcast(self.control, rank)

    # -- the model ----------------------------------------------------------------------------
    def shard(self, model, hf_config):
        check_split(hf_config, self.world_size)
        return shard_model(model, self.split)

    def connect(self, model, vocab_size: int):
        return connect_model(model, self.comm, self.split, vocab_size)

    def kv_heads(self, hf_config) -> int:
        heads = hf_config.num_attention_heads
        return self.split.kv_heads(heads, getattr(hf_config, "num_key_value_heads", None) or heads)[1]

    def smallest(self, value: int) -> int:
        """The smallest ``value`` over the ranks (every rank calls it)."""
        t = torch.tensor([value], dtype=torch.int64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.control)
        return int(t.item())

    # -- steps --------------------------------------------------------------------------------
    def feed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The previous step's sampled tokens [N] from rank 0, for this step's placeholders."""
        return self.comm.broadcast(tokens, src=0)

    def close(self) -> None:
        torch.set_num_threads(self._threads)
        self.channel.close(unlink=self.rank == 0)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

