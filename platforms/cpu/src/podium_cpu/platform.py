"""The CPU platform: host memory for the KV cache, a native paged-attention kernel, fused ops.

Choices made here, from what the machine offers (``cpu_info``):
- dtype: bfloat16 by default where the CPU computes in bf16 natively (AVX512_BF16 / AMX), float32
  otherwise; every dtype stays selectable.
- threads: ``set_device`` caps torch's thread count at the physical cores this process may use
  (affinity and cgroup quota), never raising a count the user lowered.
- linears: a native kernel (AMX, AVX512-BF16 or FMA) or oneDNN's packed matmul per dtype and batch
  size, by the rule in ``linear_choice``; ``linear_kernel`` says which runs for a shape and why,
  ``podium platforms --verbose`` shows each dtype's rule. The platform option ``linears`` forces
  one kernel for the dtypes it computes (``linear_choice.forced_rules``); the option ``amx`` off runs
  the CPU as one without AMX (linears and attention), to measure that kind on an AMX machine.
- graphs: decode steps captured as their native kernel calls and replayed from C (graphs.py), where
  the attention is the native kernel's; a model with an op outside the native kernels (a oneDNN
  linear, say) stays eager.
- attention: the native C kernel (compiled on first use), else IPEX's paged attention when
  ``intel_extension_for_pytorch`` imports (optional), else pure torch. The platform option
  ``attention`` (``native``, ``ipex`` or ``torch``; ``auto``: that order; alias
  ``PODIUM_CPU_ATTENTION``) forces one, and an explicit choice that cannot load is an error, never a
  silent fallback. ``attention_backend().name`` says which one runs, ``attention_note`` why (a
  forced choice, or why not a faster one).
- batch-invariant mode (``use_batch_invariant_kernels``): where the native kernels build and the
  attention is theirs. Linears run on one native kernel for every batch (``batch_invariant_rules``:
  each output element sums its products in one order whatever the rows), norms are per row
  already, and attention takes every query token alone (``attention_plan.EVERY_TOKEN_ALONE``), so a
  prompt token is computed exactly as a decode would be; top-k / top-p is the reference's full sort
  (no pre-filter); a dtype without a native linear is refused.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
from collections.abc import Mapping
from functools import partial
from itertools import groupby
from typing import Any

import torch
from torch import nn

from podium_plugin_api import AttentionBackend, Capabilities, GraphRunner, KVCacheSpec, Platform, PlatformOption

from . import gguf_ops
from .attention import CpuAttentionBackend
from .attention_plan import EVERY_TOKEN_ALONE, TILE_MIN_QUERY
from .cpu_info import has_native_bf16, usable_cores, usable_cpus
from .embedding import native_embeddings
from .fused_ops import cpu_ops
from .graphs import CpuGraphRunner
from .host_memory import release_freed_heap, zeroed_host_tensor
from .ipex_support import ipex_status
from .linear_choice import (
    LINEAR_CHOICES,
    LinearChoice,
    LinearRule,
    batch_invariant_rules,
    choose,
    forced_rules,
    linear_rules,
)
from .linear_packing import pack_linear_layers
from .moe import pack_experts
from .native_kernels import compiler_found, load_kernels

logger = logging.getLogger(__name__)

ATTENTION_ENV = "PODIUM_CPU_ATTENTION"  # the alias of the attention option
ATTENTION_CHOICES = ("auto", "native", "ipex", "torch")
ATTENTION_OPTION = PlatformOption(
    "attention", str, "auto", "the paged attention that runs: the native C kernel, IPEX's, or pure torch "
    "(auto: native, else IPEX, else torch); a forced choice that cannot load is an error",
    choices=ATTENTION_CHOICES, env=ATTENTION_ENV)
KV_COMMIT_OPTION = PlatformOption(
    "kv_cache_commit", bool, False, "commit the KV cache's pages when it is allocated (host_memory): RSS "
    "is the full cache from the start and a host that cannot hold it fails at startup, for about 0.5 s "
    "of startup per GiB; off: pages fault in as blocks are first used, so RSS rises to the cache's size "
    "over the first minutes of serving (a plateau, not a leak)")
AMX_OPTION = PlatformOption(
    "amx", bool, True, "use AMX tiles where the CPU has them (bf16 linears up to 256 rows, bf16 prefill "
    "attention, GGUF batches on AMX-INT8); off: the CPU runs as one with AVX512-BF16 and no AMX (the avx512-bf16 "
    "linear kernel for every batch, AVX512-BF16 attention tiles, GGUF batches on AVX-512 VNNI), to measure that "
    "kind on an AMX machine")
PLAIN_WEIGHTS_OPTION = PlatformOption(
    "amx_plain_weights", bool, False, "keep each AMX linear's plain bf16 weight beside its tiles, for oneDNN's "
    "batches above 256 rows (prefill); off: those batches multiply a copy unpacked from the tiles for the call, "
    "and the model holds one copy of its weights")
LINEARS_OPTION = PlatformOption(
    "linears", str, "auto", "the kernel of the linear layers (auto: the rule per dtype and batch, see `podium "
    "platforms --verbose`); a named kernel replaces the rule of every dtype it computes (amx, avx512-bf16: "
    "bfloat16; fma, onednn: bfloat16 and float32); one that runs no dtype here is an error",
    choices=LINEAR_CHOICES)


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    priority = 10

    def __init__(self) -> None:
        self._attention = "auto"  # the attention option; activate() sets it
        self._commit_kv = False  # the kv_cache_commit option
        self._linears = "auto"  # the linears option
        self._amx = True  # the amx option
        self._plain_weights = False  # the amx_plain_weights option
        self._backend: AttentionBackend | None = None
        self._backend_note = ""
        self._capabilities: Capabilities | None = None
        self._linear_rules: dict[torch.dtype, LinearRule] | None = None
        self._invariant = False  # the batch-invariant mode (use_batch_invariant_kernels)

    def options(self) -> tuple[PlatformOption, ...]:
        return (ATTENTION_OPTION, KV_COMMIT_OPTION, LINEARS_OPTION, AMX_OPTION, PLAIN_WEIGHTS_OPTION)

    def activate(self, options: Mapping[str, Any]) -> None:
        """Take the attention choice, the KV commit and the linears' kernel (nothing process-wide to
        set: threads are sized in set_device)."""
        self._attention = options["attention"]
        self._commit_kv = options["kv_cache_commit"]
        self._linears = options["linears"]
        self._amx = options["amx"]
        self._plain_weights = options["amx_plain_weights"]
        self._backend, self._capabilities, self._linear_rules = None, None, None

    def capabilities(self) -> Capabilities:
        """Worked out once (the runner asks every step): reads /proc and /sys."""
        if self._capabilities is None:
            gguf_ops.allow_amx(load_kernels()[0], self._amx)  # before "gguf batches" reports the switch
            native_bf16 = has_native_bf16()
            invariant_why = _batch_invariant_problem(self._attention)
            self._capabilities = Capabilities(
                dtypes=(torch.float32, torch.bfloat16, torch.float16),
                default_dtype=torch.bfloat16 if native_bf16 else torch.float32,
                graph_capture=_graphs_possible(self._attention),
                batch_invariant=not invariant_why,
                fp8="e4m3fn",  # fp8 KV caches (torch's CPU casts): see CpuAttentionBackend.kv_cache_dtypes
                distributed_backend="gloo",
                extra={"native_bf16": native_bf16, "threads": usable_cores(),
                       "attention": _attention_setting(self._attention),
                       "batch_invariant": invariant_why or ("on" if self._invariant else "available"),
                       **{f"linears {str(dtype).removeprefix('torch.')}": rule.summary()
                          for dtype, rule in self.linear_rules().items()},
                       "gguf batches": gguf_ops.batch_path(*load_kernels())},
            )
        return self._capabilities

    def use_batch_invariant_kernels(self) -> None:
        """The batch-invariant mode from here on: native linears for every batch, attention token by token."""
        problem = _batch_invariant_problem(self._attention)
        if problem:
            raise NotImplementedError(f"the cpu platform's batch-invariant mode needs its native kernels: {problem}")
        self._invariant = True
        self._backend, self._capabilities, self._linear_rules = None, None, None

    def config_defaults(self) -> dict:
        return {"kv_cache_memory": 1 << 30}

    def set_device(self, index: int) -> None:
        """Called once when the engine starts on this platform: size torch's thread pool."""
        if index != 0:
            raise ValueError(f"the CPU platform has one device (index 0), got index {index}")
        cores = usable_cores()
        if torch.get_num_threads() > cores:
            torch.set_num_threads(cores)

    def device_key(self, index: int = 0) -> str:
        """The host and the cores this process may run on: replicas pinned to disjoint cores compute side
        by side, unpinned ones share every core."""
        runs = [[c for _, c in run] for _, run in groupby(enumerate(sorted(usable_cpus())), lambda ic: ic[1] - ic[0])]
        spans = [str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs]  # 0-3,8 style
        return f"{socket.gethostname()}/cpu:{','.join(spans)}"

    def rank_device(self, rank: int, world_size: int) -> int:
        """Every tensor-parallel rank runs on the host's one device (the core splits the threads)."""
        return 0

    def attention_backend(self) -> AttentionBackend:
        if self._backend is None:
            self._backend, self._backend_note = _make_backend(self._attention, self._invariant, self._amx)
        return self._backend

    @property
    def attention_note(self) -> str:
        self.attention_backend()
        return self._backend_note

    def allocate_kv_cache(self, spec: KVCacheSpec, num_blocks: int) -> list[torch.Tensor]:
        """Zeroed caches from calloc'd pages, which the OS zeroes on first touch: startup pays only for
        the bytes a run uses (``torch.zeros`` writes every byte, about half a second per GiB). With
        ``kv_cache_commit`` the pages are committed here instead (``host_memory``), without a write."""
        shape = self.attention_backend().kv_cache_shape(spec, num_blocks)
        return [zeroed_host_tensor(shape, spec.dtype, commit=self._commit_kv) for _ in range(spec.num_layers)]

    def custom_ops(self) -> dict:
        """The native ops; in the batch-invariant mode without the top-k pre-filter, which runs only
        when every row of the batch has a top-k, and whose partial sort ranks tied logits unlike the
        reference's full sort: a row's kept set at its k-th rank would depend on its company."""
        kernels = load_kernels()[0]
        gguf_ops.allow_amx(kernels, self._amx)
        ops = cpu_ops(kernels)
        if self._invariant:
            ops.pop("top_k_top_p", None)
        return ops

    def linear_rules(self) -> dict[torch.dtype, LinearRule]:
        """Each dtype's linear kernels here (``linear_choice``); builds the native kernels on first use."""
        if self._linear_rules is None:
            kernels, why_not = load_kernels()
            if kernels is not None and not self._amx:  # the amx option off: as a CPU without AMX
                kernels = dataclasses.replace(kernels, amx_linear={}, amx_fused_linear={})
                why_not = why_not or "AMX is off (the amx option)"
            if kernels is not None and self._plain_weights:  # no unpack: the AMX layers keep the plain weight
                kernels = dataclasses.replace(kernels, tile_unpack={})
            if self._invariant:
                self._linear_rules = batch_invariant_rules(kernels, why_not, self._linears)
            else:
                self._linear_rules = forced_rules(linear_rules(kernels, why_not), self._linears, kernels, why_not)
        return self._linear_rules

    def linear_kernel(self, dtype: torch.dtype, out_features: int, in_features: int, rows: int) -> LinearChoice:
        """Which kernel a linear of this dtype and shape runs on for a batch of ``rows``, and why."""
        return choose(self.linear_rules(), dtype, out_features, in_features, rows)

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Called once the weights are loaded: linear weights (experts' too) packed for the kernel
        ``linear_rules`` picks for their dtype; embeddings to the native lookup. Returns the model."""
        rules = self.linear_rules()
        if self._invariant:
            _check_invariant_dtypes(model, rules)
        pack = partial(pack_linear_layers, rules=rules)
        packed = pack(model)
        pack_experts(model, pack)  # mixture-of-experts weights: the same packed linears, per expert
        for dtype in sorted({p.dtype for p in model.parameters()} & set(rules), key=str):
            logger.info("%s linears (%d packed): %s", str(dtype).removeprefix("torch."), packed, rules[dtype].summary())
        kernels = load_kernels()[0]
        if kernels is not None:
            native_embeddings(model, kernels)
        release_freed_heap()  # the load's temporaries and dropped plain weights: RSS, not just free lists
        return model

    def graph_runner(self) -> GraphRunner | None:
        """Capture of decode steps as their native calls (graphs.py), where the native kernels run."""
        return CpuGraphRunner() if self.capabilities().graph_capture else None


def _graphs_possible(choice: str) -> bool:
    """Decode steps can be captured (graphs.py) where the attention is the native kernel's: not forced
    elsewhere, and a C compiler to build it (cheap to ask; the build itself happens on first use)."""
    return choice in ("auto", "native") and compiler_found()


def _attention_setting(choice: str) -> str:
    """The attention choice as ``podium platforms --verbose`` shows it; cheap (builds nothing)."""
    if choice == "auto":
        return "auto: native kernel, else IPEX, else torch (the attention option forces one)"
    return f"{choice} (forced by the attention option)"


def _batch_invariant_problem(choice: str) -> str:
    """Why the batch-invariant mode cannot run here ("" when it can): it needs the native kernels."""
    if choice not in ("auto", "native"):
        return f"the attention option is {choice}, whose prefill and decode paths reduce in different orders"
    if not compiler_found():
        return "no C compiler to build the native kernels"
    return ""


def _check_invariant_dtypes(model: nn.Module, rules: dict[torch.dtype, LinearRule]) -> None:
    """Refuse a model whose weights' dtype has no native linear (the mode's linears are all native)."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    missing = sorted(str(d).removeprefix("torch.") for d in dtypes - set(rules))
    if missing:
        have = ", ".join(str(d).removeprefix("torch.") for d in rules) or "none (the native kernels did not load)"
        raise ValueError(f"the cpu platform's batch-invariant mode has no native linear for {', '.join(missing)} "
                         f"on this CPU (it has: {have}); choose another --dtype or run without --batch-invariant")


def _make_backend(choice: str = "auto", invariant: bool = False, amx: bool = True) -> tuple[AttentionBackend, str]:
    """(backend, note) for ``choice``; auto: the native kernel when it builds, else IPEX's, else torch.

    The native kernel comes first because it measured faster here: 32 bf16 decodes over ~100
    tokens of context took 377 us per layer against IPEX 2.8's 660 us (flash_attn_varlen_func) or
    468 us (single_query_cached_kv_attention, attention alone). IPEX covers machines without a C
    compiler. A forced choice that cannot load raises RuntimeError saying why.
    """
    forced, reason = f"forced by the attention option ({choice}; alias {ATTENTION_ENV})", ""
    if choice == "torch":
        return CpuAttentionBackend(None), forced
    if choice in ("auto", "native"):
        kernels, reason = load_kernels()
        if kernels is not None:
            tile_min_query = EVERY_TOKEN_ALONE if invariant else TILE_MIN_QUERY
            return CpuAttentionBackend(kernels, tile_min_query, amx), forced if choice == "native" else ""
        if choice == "native":
            raise RuntimeError(f"the cpu platform's attention option is native, but the native kernels did not "
                               f"load: {reason}")
    if invariant:
        raise RuntimeError(f"the cpu platform's batch-invariant mode needs the native attention kernel, which did "
                           f"not load: {reason}")
    ipex, why = ipex_status()
    if ipex is not None:
        from .ipex_attention import IpexAttentionBackend

        return IpexAttentionBackend(ipex), forced if choice == "ipex" else reason
    if choice == "ipex":
        raise RuntimeError(f"the cpu platform's attention option is ipex, but "
                           f"{why or 'intel_extension_for_pytorch is not installed'} "
                           "(install intel-extension-for-pytorch built for this torch release)")
    return CpuAttentionBackend(None), "; ".join(x for x in (reason, why) if x)
