"""KV-cache conformance: allocation, layout, and writes by slot mapping.

A platform may lay its cache out however its kernels like, as long as ``kv_cache_shape``,
``split_cache``, ``write_kv``, ``read_kv`` and ``attend`` agree with each other. The default
methods of ``AttentionBackend`` all assume the default layout, so a backend that changes
``kv_cache_shape`` must override the methods that index the cache too.
"""

from __future__ import annotations

import torch

from ..attention import AttentionBackend
from ..metadata import KVCacheSpec
from ..platform import Platform
from .report import ConformanceError, check_close, dtype_name, guarded

INDEXING_METHODS = ("write_kv", "read_kv", "attend")


def kit_spec(dtype: torch.dtype, num_layers: int = 2) -> KVCacheSpec:
    return KVCacheSpec(num_layers=num_layers, num_kv_heads=2, head_size=64, block_size=16, dtype=dtype)


def check_allocation(platform: Platform, backend: AttentionBackend, spec: KVCacheSpec, num_blocks: int = 7) -> None:
    """``allocate_kv_cache`` gives one distinct tensor per layer of the backend's shape, dtype and device."""
    expected = tuple(
        guarded("attention_backend().kv_cache_shape(spec, num_blocks)", backend.kv_cache_shape, spec, num_blocks)
    )
    caches = guarded(
        f"allocate_kv_cache({spec}, num_blocks={num_blocks})", platform.allocate_kv_cache, spec, num_blocks
    )
    what = f"allocate_kv_cache({spec}, num_blocks={num_blocks})"
    if not isinstance(caches, (list, tuple)) or len(caches) != spec.num_layers:
        raise ConformanceError(
            f"{what} returned {type(caches).__name__} of length {len(caches) if hasattr(caches, '__len__') else '?'}; expected a list of {spec.num_layers} tensors, one per layer"
        )
    device = platform.torch_device()
    for i, cache in enumerate(caches):
        if not isinstance(cache, torch.Tensor):
            raise ConformanceError(f"{what}: layer {i} is {type(cache).__name__}, not a tensor")
        if tuple(cache.shape) != expected:
            raise ConformanceError(
                f"{what}: layer {i} has shape {list(cache.shape)} but kv_cache_shape says {list(expected)}"
            )
        if cache.dtype != spec.dtype:
            raise ConformanceError(
                f"{what}: layer {i} has dtype {dtype_name(cache.dtype)}, expected {dtype_name(spec.dtype)}"
            )
        if cache.device.type != device.type:
            raise ConformanceError(f"{what}: layer {i} is on {cache.device}, expected the platform's device {device}")
    pointers = {c.data_ptr() for c in caches}
    if len(pointers) != len(caches):
        raise ConformanceError(f"{what}: layers share storage; every layer needs its own cache tensor")


def default_methods(backend: AttentionBackend) -> list[str]:
    """Which of the cache-indexing methods the backend inherits unchanged from ``AttentionBackend``."""
    return [m for m in INDEXING_METHODS if getattr(type(backend), m) is getattr(AttentionBackend, m)]


def check_layout(platform: Platform, backend: AttentionBackend, spec: KVCacheSpec, num_blocks: int = 7) -> None:
    """``split_cache`` views can hold every slot, in the layout the backend's methods index."""
    cache = guarded("allocate_kv_cache", platform.allocate_kv_cache, spec, num_blocks)[0]
    shape = list(backend.kv_cache_shape(spec, num_blocks))
    key, value = guarded("split_cache(kv_cache)", backend.split_cache, cache)
    default = [num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size]
    slots = num_blocks * spec.block_size * spec.num_kv_heads * spec.head_size
    head = f"wrong cache layout: kv_cache_shape(spec, num_blocks={num_blocks}) is {shape} and split_cache gives key {list(key.shape)} / value {list(value.shape)}"
    for name, view in (("key", key), ("value", value)):
        if view.numel() < slots:
            raise ConformanceError(
                f"{head}; the {name} view holds {view.numel()} elements, fewer than num_blocks * block_size * "
                f"num_kv_heads * head_size = {slots}: split_cache does not match kv_cache_shape"
            )
    inherited = default_methods(backend)
    for view in (key, value):
        if inherited and list(view.shape) != default:
            raise ConformanceError(
                f"{head}; but {type(backend).__name__} uses AttentionBackend's default {', '.join(inherited)}, which "
                f"index the default layout [num_blocks, block_size, num_kv_heads, head_size] = {default}: override "
                f"those methods for your layout, or return the default shape from kv_cache_shape"
            )


def _slot_locator(block_size: int, slots: list[int]):
    def locate(index: tuple[int, ...]) -> str:
        slot = slots[index[0]]
        return (
            f"slot {slot} (block {slot // block_size}, offset {slot % block_size}), kv head {index[1]}, dim {index[2]}"
        )

    return locate


def check_write_read(
    platform: Platform, backend: AttentionBackend, spec: KVCacheSpec, seed: int = 0, num_blocks: int = 7
) -> None:
    """``write_kv`` stores each token at its slot (skipping -1) and ``read_kv`` returns it unchanged."""
    gen = torch.Generator().manual_seed(seed)
    device = platform.torch_device()
    cache = guarded("allocate_kv_cache", platform.allocate_kv_cache, spec, num_blocks)[0]
    n = num_blocks * spec.block_size
    shape = (n, spec.num_kv_heads, spec.head_size)
    first_k, first_v = (torch.randn(shape, generator=gen).to(spec.dtype) for _ in range(2))
    order = torch.randperm(n, generator=gen)  # write every slot, in a scrambled order
    context = f"cache {list(cache.shape)} from kv_cache_shape; key/value [{n}, {spec.num_kv_heads}, {spec.head_size}]"
    guarded(
        "write_kv (every slot, scrambled order)",
        backend.write_kv,
        cache,
        first_k[order].to(device),
        first_v[order].to(device),
        order.to(device),
        context=context,
    )
    # overwrite half the slots; -1 entries carry junk that must not land anywhere
    chosen = order[: n // 2]
    slot_mapping = torch.stack([chosen, torch.full_like(chosen, -1)], dim=1).flatten()  # [n]: slot, -1, slot, -1...
    new_shape = (len(slot_mapping), spec.num_kv_heads, spec.head_size)
    new_k, new_v = (torch.randn(new_shape, generator=gen).to(spec.dtype) for _ in range(2))
    guarded(
        "write_kv (half the slots, with -1 padding)",
        backend.write_kv,
        cache,
        new_k.to(device),
        new_v.to(device),
        slot_mapping.to(device),
        context=context,
    )
    expect_k, expect_v = first_k.clone(), first_v.clone()
    written = slot_mapping >= 0
    expect_k[slot_mapping[written]] = new_k[written]
    expect_v[slot_mapping[written]] = new_v[written]
    everything = torch.arange(n)
    got_k, got_v = guarded("read_kv (every slot)", backend.read_kv, cache, everything.to(device), context=context)
    locate = _slot_locator(spec.block_size, everything.tolist())
    what = f"KV write by slot mapping then read_kv ({dtype_name(spec.dtype)}, block_size {spec.block_size}, -1 = skip)"
    check_close(got_k, expect_k, what=f"{what}: keys", dtype=spec.dtype, locate=locate, exact=True)
    check_close(got_v, expect_v, what=f"{what}: values", dtype=spec.dtype, locate=locate, exact=True)


def extra_cache_dtypes(backend: AttentionBackend, model_dtype: torch.dtype) -> list[torch.dtype]:
    """The cache dtypes other than the model's that the backend lists."""
    return [d for d in backend.kv_cache_dtypes(model_dtype) if d != model_dtype]


def check_cache_dtype(platform: Platform, backend: AttentionBackend, model_dtype: torch.dtype,
                      cache_dtype: torch.dtype, seed: int = 0, num_blocks: int = 6) -> None:
    """A cache of ``cache_dtype`` (listed in ``kv_cache_dtypes``) for a ``model_dtype`` model:
    ``write_kv`` stores exactly ``to_cache_dtype`` of the model-dtype keys/values (beyond-range
    values saturating), and ``attend`` over it equals the reference over the same stored values."""
    from ..attention import to_cache_dtype
    from ..metadata import AttentionLayerSpec, AttentionMetadata
    from ..reference import reference_paged_attention

    gen = torch.Generator().manual_seed(seed)
    device = platform.torch_device()
    spec = KVCacheSpec(num_layers=1, num_kv_heads=2, head_size=64, block_size=16, dtype=cache_dtype)
    cache = guarded(f"allocate_kv_cache({spec})", platform.allocate_kv_cache, spec, num_blocks)[0]
    n = num_blocks * spec.block_size
    shape = (n, spec.num_kv_heads, spec.head_size)
    key, value = ((torch.randn(shape, generator=gen) * 3).to(model_dtype) for _ in range(2))
    key[5] = key[5] * 1e4  # beyond an fp8 format's range: saturates
    order = torch.randperm(n, generator=gen)
    what = f"{dtype_name(cache_dtype)} cache for a {dtype_name(model_dtype)} model"
    guarded(f"write_kv into a {what}", backend.write_kv, cache, key[order].to(device), value[order].to(device),
            order.to(device))
    got_k, got_v = guarded(f"read_kv of a {what}", backend.read_kv, cache, torch.arange(n).to(device))
    locate = _slot_locator(spec.block_size, list(range(n)))
    check_close(got_k, to_cache_dtype(key, cache_dtype), what=f"write_kv then read_kv, {what}: keys",
                dtype=cache_dtype, locate=locate, exact=True)
    check_close(got_v, to_cache_dtype(value, cache_dtype), what=f"write_kv then read_kv, {what}: values",
                dtype=cache_dtype, locate=locate, exact=True)
    # slot s holds token s: as a default-layout cache, blocks in order
    ref_k = to_cache_dtype(key, cache_dtype).view(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
    ref_v = to_cache_dtype(value, cache_dtype).view(ref_k.shape)
    lens, tables = [1, 37, 90], [[0], [1, 2, 3], [4, 5, 0, 1, 2, 3]]  # decodes and a 5-token chunk
    query_lens = [1, 1, 5]
    layer = AttentionLayerSpec(4, 2, 64, 0.125)
    query = torch.randn(sum(query_lens), 4, 64, generator=gen).to(model_dtype)
    meta = AttentionMetadata.from_lengths(query_lens, lens, tables, spec.block_size, device=device)
    got = guarded(f"attend over a {what}", backend.attend, layer, query.to(device), cache, meta)
    want = reference_paged_attention(query, ref_k, ref_v, AttentionMetadata.from_lengths(
        query_lens, lens, tables, spec.block_size, device="cpu"), scale=layer.scale)
    check_close(got, want, what=f"attend over a {what}", dtype=model_dtype)
