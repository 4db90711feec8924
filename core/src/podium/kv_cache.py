"""Sizing and allocating the paged KV cache through the platform's memory hooks.

Where the platform says so (``kv_cache_from_free_memory``), the cache gets what is left of
``gpu_memory_utilization`` of the device after the weights and a profiling forward pass at the
largest batch the scheduler can form; elsewhere (CPU) it gets ``kv_cache_memory`` bytes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from podium_plugin_api import AttentionBackend, AttentionMetadata, ForwardContext, KVCacheSpec, Platform, fp8_dtypes

from .config import EngineConfig, parse_size
from .explicit_fields import explicit_fields

DEFAULT_KV_CACHE_MEMORY = 1 << 30


_NAMED = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, platform: Platform,
                           backend: AttentionBackend) -> torch.dtype:
    """The dtype the KV cache stores for ``kv_cache_dtype=name`` (config.KV_CACHE_DTYPES).

    "auto" is the model's dtype; "fp8"/"fp8_e4m3" and "fp8_e5m2" are the platform's fp8 flavour
    of each format (``Capabilities.fp8``). The attention backend must list the result among its
    ``kv_cache_dtypes``; otherwise a ValueError names what it does support."""
    if name == "auto":
        return model_dtype
    if name in _NAMED:
        dtype = _NAMED[name]
    else:
        flavour = platform.capabilities().fp8
        formats = fp8_dtypes(flavour)
        fmt = "e5m2" if name == "fp8_e5m2" else "e4m3"
        if fmt not in formats:
            raise ValueError(f"kv_cache_dtype={name!r}: platform {platform.name!r} has no fp8 formats")
        dtype = formats[fmt]
    listed = backend.kv_cache_dtypes(model_dtype)
    if dtype not in listed:
        names = ", ".join(["auto"] + [dtype_name(d) for d in listed if d != model_dtype])
        raise ValueError(
            f"kv_cache_dtype={name!r} ({dtype_name(dtype)}) is not supported by platform {platform.name!r}'s "
            f"attention backend {backend.name!r} for a {dtype_name(model_dtype)} model; it supports: {names}")
    return dtype


def kv_cache_spec(hf_config, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
    heads = hf_config.num_attention_heads
    head_size = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return KVCacheSpec(
        num_layers=hf_config.num_hidden_layers,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_size=head_size,
        block_size=block_size,
        dtype=dtype,
    )


def profile_activation_bytes(platform: Platform, forward: Callable[[], None]) -> int:
    """Peak bytes a forward pass at the largest batch adds on top of what is allocated now."""
    platform.synchronize()
    platform.reset_peak_memory()
    base = platform.peak_memory()
    forward()
    platform.synchronize()
    peak = platform.peak_memory()
    platform.empty_cache()
    return max(0, peak - base)


def profile_batch(token_budget: int, max_num_seqs: int, max_model_len: int, block_size: int) -> tuple[list[int], list[int]]:
    """(query_lens, seq_lens) of the largest step the scheduler can form: ``token_budget`` tokens (at
    most ``max_num_seqs * max_model_len``), the running sequences' decodes first as the scheduler
    orders them (at most half the tokens and ``max_num_seqs - 1`` sequences, each over one cached
    block), then prompt chunks of up to ``max_model_len`` tokens. A step shaped like the serving
    run's mixed steps also builds the kernels those launch before the first request arrives."""
    tokens = min(token_budget, max_num_seqs * max_model_len)
    decodes = 0
    if max_model_len > 1:  # D decodes leave room for the chunks: D + ceil((tokens - D) / L) <= S
        decodes = min(max_num_seqs - 1, tokens // 2, (max_num_seqs * max_model_len - tokens) // (max_model_len - 1))
    context = min(block_size, max_model_len - 1)  # a decode's cached keys before its new one
    prefill = tokens - decodes
    chunk = min(max_model_len, prefill)
    lens = [chunk] * (prefill // chunk) + ([prefill % chunk] if prefill % chunk else [])
    return [1] * decodes + lens, [context + 1] * decodes + lens


def profile_forward(model: torch.nn.Module, platform: Platform, spec: KVCacheSpec, query_lens: list[int],
                    seq_lens: list[int], max_num_seqs: int) -> None:
    """A forward pass of the step ``profile_batch`` describes (and the logits of up to ``max_num_seqs``
    rows) on the platform's backend, into a throwaway cache."""
    bs, device = spec.block_size, platform.torch_device()
    tables, next_block = [], 0
    for n in seq_lens:
        tables.append(list(range(next_block, next_block + -(-n // bs))))
        next_block += len(tables[-1])
    caches = platform.allocate_kv_cache(spec, next_block)
    backend = platform.attention_backend()
    meta = backend.prepare_metadata(AttentionMetadata.from_lengths(query_lens, seq_lens, tables, bs, device))
    tokens = sum(query_lens)
    ids = torch.zeros(tokens, dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(n - q, n, device=device) for q, n in zip(query_lens, seq_lens)])
    hidden = model(ids, positions, ForwardContext(meta, caches, backend))
    model.compute_logits(hidden[: min(tokens, max_num_seqs)])
    del caches, hidden


def kv_cache_bytes(config: EngineConfig, platform: Platform, activation_bytes: int) -> int:
    if platform.capabilities().kv_cache_from_free_memory and config.kv_cache_memory is None:
        info = platform.memory_info()
        used = info.total_bytes - info.free_bytes
        budget = int(info.total_bytes * config.gpu_memory_utilization) - used - activation_bytes
        if budget <= 0:
            raise RuntimeError(
                f"no memory left for the KV cache: {used / 2**30:.1f} GiB in use plus {activation_bytes / 2**30:.1f} GiB "
                f"of activations exceed gpu_memory_utilization={config.gpu_memory_utilization} of "
                f"{info.total_bytes / 2**30:.1f} GiB; raise gpu_memory_utilization or lower max_num_batched_tokens"
            )
        return budget
    return parse_size(config.kv_cache_memory if config.kv_cache_memory is not None else DEFAULT_KV_CACHE_MEMORY)


def kv_sizing_note(config: EngineConfig, platform: Platform) -> str:
    """Why a gpu_memory_utilization the user set changes nothing here ("" when it is used)."""
    if "gpu_memory_utilization" not in explicit_fields(config):
        return ""
    if config.num_kv_blocks is not None:
        why = f"num_kv_blocks={config.num_kv_blocks} sets the KV cache's size"
    elif not platform.capabilities().kv_cache_from_free_memory:
        why = (f"platform {platform.name!r} does not size the KV cache from a fraction of free memory; it takes "
               f"kv_cache_memory_bytes (now {config.kv_cache_memory or 'its default'})")
    elif config.kv_cache_memory is not None:
        why = f"kv_cache_memory_bytes={config.kv_cache_memory} sets the KV cache's size"
    else:
        return ""
    return f"gpu_memory_utilization={config.gpu_memory_utilization} is ignored: {why}"


def num_kv_blocks(config: EngineConfig, spec: KVCacheSpec, nbytes: int, max_model_len: int,
                  extra_bytes_per_block: int = 0) -> int:
    """Blocks of ``spec`` in ``nbytes`` (or ``config.num_kv_blocks``); ``extra_bytes_per_block``: what
    another cache laid out in the same blocks (a speculative draft's) costs per block."""
    blocks = config.num_kv_blocks or nbytes // (spec.bytes_per_block + extra_bytes_per_block)
    needed = -(-max_model_len // spec.block_size)
    if blocks < needed:
        raise ValueError(
            f"the KV cache holds {blocks} blocks ({blocks * spec.block_size} tokens) but one sequence of "
            f"max_model_len={max_model_len} needs {needed} blocks; give the cache more memory "
            f"(kv_cache_memory / gpu_memory_utilization / num_kv_blocks) or lower max_model_len"
        )
    return int(blocks)
