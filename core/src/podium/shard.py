"""``ModelShard``: this process's model (or its tensor-parallel shard), KV cache and runner.

The engine builds one in its process; with tensor parallelism every worker process builds one for
its rank the same way (``parallel.worker``), so each step of every rank runs the same code. Build:
the model on the meta device -> quantized (``podium.quantization``, with a method) or sharded
(``parallel.sharding``, with a group; never both, the engine refuses the pair) -> on the device ->
weights (each rank reads its slices; a method's kept tensors come as stored, then its ``finish``)
-> collectives wrapped around partial outputs -> the platform's ``prepare_model`` -> KV cache
sized (the smallest rank's count, with a group) and allocated -> the runner. With ``enable_lora`` the
loaded model's projections are adapted (``podium.lora.transform``) before the cache is sized, so
the slot weights count as the model's memory. Graph capture is the caller's (``capture_graphs``), after the timer lap.
A speculative draft (``companion``, ``podium.spec.draft_device``) is built after the weights, before
the cache is sized: its KV cache has the same blocks, so each block costs both caches' bytes.
A pooling model (``pooling=True``, ``pooling_step``) computes whole inputs in one step, so its token
budget holds the longest input; an encoder among them (``uses_kv_cache = False``: BERT) gets no KV
cache, only bookkeeping blocks for the scheduler's admission; nothing is captured for it.
"""

from __future__ import annotations

import copy
import logging
from functools import partial

import torch

from podium_plugin_api.ops import build_op_table

from .config import EngineConfig
from .kv_cache import (
    dtype_name,
    kv_cache_bytes,
    kv_cache_spec,
    num_kv_blocks,
    profile_activation_bytes,
    profile_batch,
    profile_forward,
    resolve_kv_cache_dtype,
)
from .models.registry import build_model, init_random_weights, model_class
from .platform_setup import StartedPlatform, check_attention_support
from .quantization import weight_bytes_by_dtype
from .quantization.memory import format_weight_bytes
from .runner import ModelRunner

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, platform) -> torch.dtype:
    caps = platform.capabilities()
    dtype = caps.default_dtype if name == "auto" else _DTYPES[name]
    if dtype not in caps.dtypes:
        supported = ", ".join(str(d).replace("torch.", "") for d in caps.dtypes)
        raise ValueError(f"platform {platform.name!r} does not support dtype {name}; it supports {supported}")
    return dtype


class ModelShard:
    def __init__(self, config: EngineConfig, started: StartedPlatform, source, max_model_len: int, grad_off,
                 timer=None, group=None, quantization=None, pooling: bool = False, companion=None) -> None:
        self.config, self.platform, self.source, self.group = config, started.platform, source, group
        self.quantization = quantization  # a QuantizationMethod the engine selected, or None
        self.max_model_len, self.grad_off, self.pooling = max_model_len, grad_off, pooling
        # the most tokens one step computes: a pooling step computes whole inputs
        self.token_budget = max(config.token_budget, max_model_len) if pooling else config.token_budget
        platform = self.platform
        lap = timer.lap if timer is not None else (lambda *a, **k: None)
        self.dtype = resolve_dtype(config.dtype, platform)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype, platform,
                                                     platform.attention_backend())
        self.device = platform.torch_device(platform.rank_device(group.rank, group.world_size) if group else 0)
        platform.seed(config.seed)
        overrides = platform.custom_ops()
        self.ops = build_op_table(overrides)  # the reference ops with the platform's overrides
        lap("custom_ops", detail=f"{len(overrides)} platform ops")
        transform = partial(group.shard, hf_config=source.hf_config) if group else None
        self.architectures = started.plugins.model_architectures()
        self.model = build_model(source.hf_config, self.ops, self.dtype, self.device, self.architectures,
                                 transform=transform, quantization=quantization)
        check_attention_support(self.model, platform, config.served_model_name or config.model)
        detail = dtype_name(self.dtype) + (f", {quantization.describe()}" if quantization else "")
        lap("model_build", detail=detail + (f", rank {group.rank} of {group.world_size}" if group else ""))
        self.random_weights = self._load_weights(config.seed)
        self.weight_bytes = weight_bytes_by_dtype(self.model)
        logger.info("%s", format_weight_bytes(self.weight_bytes))
        lap("weights", detail="random" if self.random_weights else "")
        self.lora = self._adapt() if config.enable_lora else None
        # a speculative draft model or head (podium.spec): its weights now, its cache with ours
        self.companion = companion(self) if companion is not None else None
        if self.companion is not None:
            lap("weights", detail=self.companion.describe())
        self._build_cache_and_runner()
        lap("kv_cache", detail=f"{self.num_kv_blocks} blocks, {self.kv_capacity_tokens} tokens")

    def _load_weights(self, seed: int) -> bool:
        """Load the weights (random ones for a shape without weights: returns True), let the
        quantization method finish its layers, connect the shards' collectives, and let the platform
        prepare the model."""
        method = self.quantization
        weights = self.source.weights(lazy=self.group is not None,
                                      keep=method.kept_checkpoint_names() if method else frozenset())
        if weights is None and method is not None and not method.online:
            raise ValueError(f"quantization {method.name!r} needs the checkpoint's weights; this model has none")
        if weights is None and self.group is None:
            init_random_weights(self.model, seed)
        else:
            self.model.load_weights(weights if weights is not None else self._random_weights(seed))
        if method is not None:
            with torch.no_grad():
                method.finish(self.model)
        if self.group is not None:
            self.model = self.group.connect(self.model, self.source.hf_config.vocab_size)
        self.model = self.platform.prepare_model(self.model.eval())  # device-specific transformations
        return weights is None

    def _adapt(self):
        """The model's projections adapted for ``max_loras`` slots (``podium.lora``); its ``LoRAStep``."""
        from .lora.step import LoRAStep
        from .lora.transform import apply_lora

        config = self.config
        if self.pooling:
            raise ValueError("enable_lora: LoRA adapters are served for text generation; this is a pooling model")
        lora = apply_lora(self.model, self.source.hf_config.hidden_size, config.max_loras, config.max_lora_rank,
                          self.dtype, self.device, self.ops)
        slot_bytes = sum(layer.lora_a.nbytes + layer.lora_b.nbytes for layer in lora.layers)
        logger.info("LoRA: %d projections adapted, %d slots of rank %d (%.1f MiB on the device)", len(lora.layers),
                    config.max_loras, config.max_lora_rank, slot_bytes / 2**20)
        return LoRAStep(lora, config.lora_cpu_capacity)

    def _random_weights(self, seed: int):
        """The whole model's random weights exactly as ``init_random_weights`` makes them for one
        device (the same generator, order and values), one tensor at a time, for a shard to load its
        slices of: a shape model at tensor_parallel_size n computes what it does at 1."""
        with torch.device("meta"):
            whole = model_class(self.source.hf_config, self.architectures)(self.source.hf_config, self.ops)
        generator = torch.Generator(device=self.device).manual_seed(seed)
        for name, param in whole.named_parameters():
            tensor = torch.empty(param.shape, dtype=self.dtype, device=self.device)
            if param.dim() == 1:
                tensor.fill_(1.0 if name.endswith("norm.weight") else 0.0)
            else:
                tensor.normal_(0.0, 0.02, generator=generator)
            yield name, tensor

    def kv_spec(self):
        hf_config = self.source.hf_config
        if self.group is not None:  # this rank's KV heads
            hf_config = copy.copy(hf_config)
            hf_config.num_key_value_heads = self.group.kv_heads(self.source.hf_config)
        return kv_cache_spec(hf_config, self.config.block_size, self.kv_cache_dtype)

    def _build_cache_and_runner(self) -> None:
        config, platform = self.config, self.platform
        if not getattr(self.model, "uses_kv_cache", True):  # an encoder: the blocks only count what a step admits
            blocks = -(-(self.token_budget + config.max_num_seqs * config.block_size) // config.block_size)
            self.num_kv_blocks, self.kv_capacity_tokens = blocks, blocks * config.block_size
            self.kv_caches, self.kv_bytes = [], 0
            self._build_runner()
            return
        spec = self.kv_spec()
        activation = 0
        if platform.capabilities().kv_cache_from_free_memory and config.num_kv_blocks is None:
            activation = profile_activation_bytes(platform, lambda: self._profile_forward(spec))
        nbytes = 0 if config.num_kv_blocks else kv_cache_bytes(config, platform, activation)
        extra = self.companion.bytes_per_block if self.companion is not None else 0
        blocks = num_kv_blocks(config, spec, nbytes, self.max_model_len, extra)
        if self.group is not None:
            blocks = self.group.smallest(blocks)  # every rank holds the same blocks
        self.num_kv_blocks, self.kv_capacity_tokens = blocks, blocks * config.block_size
        self.kv_caches = platform.allocate_kv_cache(spec, blocks)
        self.kv_bytes = blocks * spec.bytes_per_block
        self._build_runner()
        if self.companion is not None:
            self.companion.attach(self)
            self.kv_bytes += blocks * extra

    def _build_runner(self) -> None:
        config = self.config
        self.runner = ModelRunner(self.model, self.platform, self.kv_caches, config.block_size, config.max_num_seqs,
                                  self.max_model_len, self.device, lora=self.lora)

    def _profile_forward(self, spec) -> None:
        """A forward pass at the largest batch the scheduler can form, into a throwaway cache."""
        config = self.config
        query_lens, seq_lens = profile_batch(config.token_budget, config.max_num_seqs, self.max_model_len,
                                             spec.block_size)
        with self.grad_off():
            profile_forward(self.model, self.platform, spec, query_lens, seq_lens, config.max_num_seqs)

    def capture_graphs(self) -> None:
        if self.platform.capabilities().graph_capture and not self.config.enforce_eager and not self.pooling:
            self.runner.capture_graphs(self.config.max_num_seqs, self.grad_off)
            spec = self.config.speculative_config
            if spec is not None:  # verify steps: k + 1 tokens a row, within the step's token budget
                q = spec.num_speculative_tokens + 1
                self.runner.capture_verify_graphs(q - 1, max(1, min(self.config.max_num_seqs, self.token_budget // q)),
                                                  self.grad_off)
            if self.companion is not None:
                self.companion.capture_graphs(self.config.max_num_seqs, self.grad_off)
