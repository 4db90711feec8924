"""The engine's configuration: one validated, typed object built at the edge, then read-only."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .explicit_fields import remembers_explicit_fields, with_fallbacks
from .pooling_config import PoolerConfig, pooler_config, runner_name
from .spec.config import SpeculativeConfig, speculative_config

DEFAULT_MODEL = "smollm2-135m-instruct"
DTYPES = ("auto", "float32", "bfloat16", "float16")
# what the paged KV cache stores: "auto" = the model's dtype; "fp8" = "fp8_e4m3" = the platform's
# e4m3 flavour (Capabilities.fp8), "fp8_e5m2" the 5-bit-exponent one; unit scale (vLLM's names)
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")
# the order the scheduler admits waiting requests in: arrival, or (priority, arrival), lower first
SCHEDULING_POLICIES = ("fcfs", "priority")
# how rank 0 sends each step's plan to the other tensor-parallel ranks: a shared-memory ring
# ("shm") or a torch.distributed broadcast over a gloo group ("torch"); see parallel.channel
PLAN_BROADCASTS = ("shm", "torch")
# where sampling defaults come from: the model's generation_config.json ("auto"), none ("vllm", as
# vLLM's own defaults, or "none"), or a folder holding a generation_config.json
GENERATION_CONFIG_SOURCES = ("auto", "vllm", "none")
STRUCTURED_OUTPUTS_BACKENDS = ("xgrammar", "llguidance")
_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
               "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string like ``"4GiB"``, ``"512MB"``, ``"1e9"``."""
    if isinstance(value, int):
        size = value
    else:
        match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", str(value))
        if not match or match.group(2).lower() not in _SIZE_UNITS:
            raise ValueError(f"kv_cache_memory: cannot read {value!r} as a size (examples: 4GiB, 512MB, 1000000)")
        size = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])
    if size <= 0:
        raise ValueError(f"kv_cache_memory must be positive, got {value!r}")
    return size


@remembers_explicit_fields
@dataclass(frozen=True)
class EngineConfig:
    """Every field left unset (None counts as unset) may take a platform's suggestion
    (``with_defaults``); a field the caller set keeps its value, even one equal to the default."""

    model: str = DEFAULT_MODEL
    tokenizer: str | None = None  # a folder with a tokenizer, if not the model's own
    device: str | None = None  # platform name; None: $PODIUM_DEVICE or the best available
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"  # see KV_CACHE_DTYPES
    max_model_len: int | None = None  # None: the model's own context length
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: max(2048, max_num_seqs)
    kv_cache_memory: int | str | None = None  # bytes for the KV cache where sized by amount (CPU)
    num_kv_blocks: int | None = None  # exact block count (overrides sizing; tests, tools)
    gpu_memory_utilization: float = 0.90  # where sized from free memory (accelerators)
    enforce_eager: bool = False  # no graph capture
    # plan and launch step N+1 while step N's sampled tokens are still on the device, hiding the
    # host's work behind the device's; None: the platform's choice (config_defaults), else off
    async_scheduling: bool | None = None
    seed: int = 0
    served_model_name: str | None = None
    generation_config: str = "auto"  # see GENERATION_CONFIG_SOURCES
    scheduling_policy: str = "fcfs"  # see SCHEDULING_POLICIES
    # the selected platform's options by name (podium platforms --verbose lists them); given as a
    # mapping, kept as sorted (name, value) pairs so the config stays frozen and picklable
    platform_options: tuple[tuple[str, Any], ...] | Mapping[str, Any] = ()
    # convert a GGUF file's tokenizer once and keep it on disk (loader.tokenizer_cache); None: the
    # alias $PODIUM_TOKENIZER_CACHE decides, on when unset
    tokenizer_cache: bool | None = None
    # ranks one model is sharded over (one process each; parallel.sharding says how)
    tensor_parallel_size: int = 1
    plan_broadcast: str = "shm"  # see PLAN_BROADCASTS
    # speculative decoding (podium.spec): a mapping, its JSON text, or None (off)
    speculative_config: SpeculativeConfig | Mapping[str, Any] | str | None = None
    # what the engine does with the model: "generate" text, "pooling" embeddings, "auto" by
    # architecture (podium.pooling_config; vLLM's task="embed" means "pooling")
    runner: str = "auto"
    # a pooling model's pooling type and normalisation over what its folder says (PoolerConfig,
    # a dict of its fields, or their JSON)
    pooler_config: PoolerConfig | Mapping[str, Any] | str | None = None
    # how the weights run quantized (vLLM's names: gguf, fp8, compressed-tensors, awq, gptq, or a
    # plugin's method); None: what the checkpoint's quantization_config says, and a GGUF file
    # dequantized at load (as "none"); "gguf" keeps its blocks; "fp8" on a float checkpoint quantizes it at load
    quantization: str | None = None
    # every reduction in a fixed order per row (the platform's batch-invariant kernels): a request's
    # output never depends on its batch, its chunking or prefix-cache hits; refused where the
    # platform does not declare the capability
    batch_invariant: bool = False
    # the grammar library of structured output where a request names none (podium.structured)
    structured_outputs_backend: str = "xgrammar"
    # multi-LoRA serving (podium.lora): adapters the device holds at once (its slots), their largest
    # rank (slots are padded to it), and adapters kept on the host (None: max_loras)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "platform_options", _option_pairs(self.platform_options))
        object.__setattr__(self, "speculative_config", speculative_config(self.speculative_config))
        object.__setattr__(self, "runner", runner_name(self.runner))
        object.__setattr__(self, "pooler_config", pooler_config(self.pooler_config))
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory is not None:
            parse_size(self.kv_cache_memory)
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(f"generation_config must be {', '.join(GENERATION_CONFIG_SOURCES)} or a folder holding "
                             f"generation_config.json, got {self.generation_config!r}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {self.tensor_parallel_size!r}")
        if self.plan_broadcast not in PLAN_BROADCASTS:
            raise ValueError(f"plan_broadcast must be one of {', '.join(PLAN_BROADCASTS)}, got {self.plan_broadcast!r}")
        if self.quantization is not None and (not isinstance(self.quantization, str) or not self.quantization):
            raise ValueError(f"quantization must be a method name (gguf, fp8, compressed-tensors, awq, gptq, none) "
                             f"or None, got {self.quantization!r}")
        if self.structured_outputs_backend not in STRUCTURED_OUTPUTS_BACKENDS:
            raise ValueError(f"structured_outputs_backend must be one of {', '.join(STRUCTURED_OUTPUTS_BACKENDS)}, "
                             f"got {self.structured_outputs_backend!r}")
        if self.tokenizer_cache is not None and not isinstance(self.tokenizer_cache, bool):
            raise ValueError(f"tokenizer_cache must be True, False or None (the environment decides), "
                             f"got {self.tokenizer_cache!r}")
        if not isinstance(self.batch_invariant, bool):
            raise ValueError(f"batch_invariant must be True or False, got {self.batch_invariant!r}")
        self._check_lora()

    def _check_lora(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.max_cpu_loras is not None and (not isinstance(self.max_cpu_loras, int)
                                               or self.max_cpu_loras < self.max_loras):
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras!r}) must be an int >= max_loras "
                             f"({self.max_loras}): every adapter on the device is also held on the host")
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be True or False, got {self.enable_lora!r}")

    @property
    def lora_cpu_capacity(self) -> int:
        """Adapters held on the host (max_cpu_loras, else max_loras)."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    @property
    def platform_option_values(self) -> dict[str, Any]:
        return dict(self.platform_options)

    @property
    def token_budget(self) -> int:
        return self.max_num_batched_tokens or max(2048, self.max_num_seqs)

    def with_defaults(self, defaults: dict[str, Any]) -> EngineConfig:
        """Fill the fields the caller left unset with a platform's suggestions (a new object)."""
        return with_fallbacks(self, defaults)


def _option_pairs(options: tuple[tuple[str, Any], ...] | Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """Platform options as sorted (name, value) pairs; the values are checked against the platform's
    declared options when the engine has selected it."""
    pairs = tuple(options.items()) if isinstance(options, Mapping) else tuple(options)
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str) and pair[0]):
            raise ValueError(f"platform_options must map option names to values, got {options!r}")
    return tuple(sorted(pairs, key=lambda pair: pair[0]))
