"""Tensor parallelism's pieces on their own: the shared-memory plan ring across processes, lazy
checkpoint slices (safetensors by slice, GGUF by rows, q/k un-permuted per head) against whole
tensors, and the weight loader filling a shard from them."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch
from model_fixtures import ARCHITECTURES, single_thread  # noqa: F401  (module fixture, used below)

from podium.parallel.channel import SLOTS, PeerGone, ShmRing


def _echo(name: str, count: int, results) -> None:
    ring = ShmRing(1, name, reader=0)
    try:
        results.put([ring.recv() for _ in range(count)])
    finally:
        ring.close()


def test_the_ring_delivers_every_message_in_order_across_a_process():
    """More messages than slots (the writer waits for the reader), of very different sizes."""
    ring = ShmRing(1)
    ctx = mp.get_context("fork")  # the reader needs only numpy and pickle; a fork starts at once
    results = ctx.Queue()
    messages = [{"step": i, "tokens": list(range(i * 997 % 5000))} for i in range(4 * SLOTS + 3)] + [None]
    proc = ctx.Process(target=_echo, args=(ring.name, len(messages), results), daemon=True)
    proc.start()
    try:
        for message in messages:
            ring.send(message)
        assert results.get(timeout=120) == messages
    finally:
        proc.join(timeout=30)
        ring.close(unlink=True)


def test_a_writer_whose_reader_is_gone_raises_instead_of_waiting_forever():
    ring = ShmRing(1)
    alive = [True]
    ring.alive = lambda: alive[0]
    try:
        for i in range(SLOTS):  # fills every slot; nobody reads
            ring.send(i)
        alive[0] = False
        with pytest.raises(PeerGone, match="tensor-parallel rank is gone"):
            ring.send("one too many")
    finally:
        ring.close(unlink=True)


def test_a_plan_larger_than_a_slot_is_a_clear_error():
    ring = ShmRing(1)
    try:
        with pytest.raises(ValueError, match="exceeds the ring's .*plan_broadcast='torch'"):
            ring.send(bytes(5 << 20))
    finally:
        ring.close(unlink=True)


def test_safetensors_lazy_slices_equal_the_whole_tensors_slices(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from podium.loader.lazy import safetensors_lazy

    tensor = torch.randn(12, 10)
    save_file({"w": tensor}, str(tmp_path / "w.safetensors"))
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as handle:
        lazy = safetensors_lazy(handle, "w")
        assert lazy.shape == tensor.shape
        assert torch.equal(lazy.narrow(0, 3, 4), tensor[3:7])
        assert torch.equal(lazy.narrow(1, 5, 5), tensor[:, 5:])
        assert torch.equal(lazy.load(), tensor)
        with pytest.raises(ValueError, match="outside shape"):
            lazy.narrow(0, 10, 4)


def test_gguf_lazy_rows_equal_the_whole_dequantized_tensors_rows():
    """SmolLM2's Q4_1 tensors read by rows: q (9 heads) and k (3 KV heads) un-permuted per head,
    an MLP projection by rows and by columns, the tied embedding by vocabulary rows."""
    from podium.loader.gguf_reader import read_gguf
    from podium.loader.gguf_weights import gguf_weights
    from podium.loader.resolve import embedded_gguf_path

    gguf = read_gguf(embedded_gguf_path())
    whole = dict(gguf_weights(gguf, 9, 3))
    lazy = dict(gguf_weights(gguf, 9, 3, lazy=True))
    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    gate, embed = "model.layers.1.mlp.gate_proj.weight", "model.embed_tokens.weight"
    assert torch.equal(lazy[q].narrow(0, 3 * 64, 3 * 64), whole[q][3 * 64:6 * 64])
    assert torch.equal(lazy[k].narrow(0, 2 * 64, 64), whole[k][2 * 64:])
    assert torch.equal(lazy[gate].narrow(0, 512, 512), whole[gate][512:1024])
    assert torch.equal(lazy[gate].narrow(1, 0, 288), whole[gate][:, :288])
    assert torch.equal(lazy[embed].narrow(0, 16384, 16384), whole[embed][16384:32768])
    with pytest.raises(ValueError, match="split a head of 64 rows"):
        lazy[q].narrow(0, 32, 64)


class ThreadComm:
    """A communicator for ranks run as threads of one process: each collective deposits this rank's
    tensor, waits for the others, and combines them in rank order (so every rank gets the same bits)."""

    def __init__(self, rank: int, world: int, slots: list, barrier) -> None:
        self.rank, self.world_size, self.slots, self.barrier = rank, world, slots, barrier

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        self.slots[self.rank] = x.clone()
        self.barrier.wait()
        parts = list(self.slots)
        self.barrier.wait()
        return parts

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(x)
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return x.copy_(total)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat(self._exchange(x), dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        return x.copy_(self._exchange(x)[src])


@pytest.mark.parametrize("name", list(ARCHITECTURES))
@pytest.mark.usefixtures("single_thread")
def test_two_shards_compute_the_whole_models_logits(name, tmp_path):
    """Every architecture, sharded over two ranks (threads here, so no process starts): each rank
    loads only its checkpoint slices, and its logits equal the unsharded model's on a ragged,
    chunked batch. Phi-3's checkpoint holds merged q|k|v and gate|up: their slices are ranges."""
    import copy
    import threading
    from functools import partial

    from model_fixtures import FlatBatchRunner, load_podium, save_tiny_model

    from podium.models.registry import build_model
    from podium.parallel.sharding import Split, connect_model, shard_model
    from podium_plugin_api.ops import build_op_table

    model_type, overrides = ARCHITECTURES[name]
    save_tiny_model(model_type, overrides, tmp_path)
    source, whole = load_podium(tmp_path)
    config = source.hf_config
    steps = [{0: [5, 17, 33, 2, 9, 41, 7], 1: [3, 3, 8]}, {0: [11, 12], 1: [60]}, {0: [1], 1: [2], 2: [4, 5, 6]}]
    ref = FlatBatchRunner(whole, config, 4)
    want = [ref.step(chunk) for chunk in steps]

    world, slots, barrier = 2, [None, None], threading.Barrier(2)
    got: list = [None, None]
    errors: list = []

    def rank_main(rank: int) -> None:
        try:
            split = Split(rank, world)
            model = build_model(config, build_op_table(), torch.float32, "cpu",
                                transform=partial(shard_model, split=split))
            model.load_weights(source.weights(lazy=True))
            model = connect_model(model, ThreadComm(rank, world, slots, barrier), split, config.vocab_size)
            local = copy.copy(config)
            heads = config.num_attention_heads
            local.num_key_value_heads = split.kv_heads(heads, getattr(config, "num_key_value_heads", heads))[1]
            runner = FlatBatchRunner(model, local, 4)
            got[rank] = [runner.step(chunk) for chunk in steps]
        except BaseException as exc:  # noqa: BLE001 -- reported below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    for rank in range(world):
        for step, (a, b) in enumerate(zip(want, got[rank])):
            for seq in a:
                worst = float((a[seq] - b[seq]).abs().max())
                assert worst < 1e-4, f"rank {rank} step {step} sequence {seq}: logits differ by {worst}"
