"""The CUDA platform: device memory sizing, CUDA graphs, Triton attention (imported lazily).

Options (``podium platforms --verbose``): ``tuning`` changes the kernels' launch table
(``tuning.KernelTuning``; alias ``PODIUM_CUDA_TUNING``), ``fused_ops`` picks the fused Triton ops
installed (alias ``PODIUM_CUDA_FUSED_OPS``), ``compile_log`` logs every Triton kernel variant built
(alias ``PODIUM_TRITON_COMPILE_LOG``). They and the process-wide settings (the cuBLAS workspace,
the compile-log hook) take effect in ``activate``, on the selected platform only.

The batch-invariant mode (``use_batch_invariant_kernels``, after ``activate``) swaps the attention
backend, the op table and the model's linears for kernels that reduce every row in one order
whatever the batch (invariant_mode.py); the default mode's kernels and code paths are untouched.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import replace
from functools import partial
from typing import Any

import torch

from podium_plugin_api import (
    AttentionBackend,
    Availability,
    Capabilities,
    GraphRunner,
    MemoryInfo,
    Platform,
    PlatformOption,
)

from .tuning import CUDA_TUNING, FUSED_OPS_ENV, TUNING_ENV, KernelTuning, parse_fused_ops, parse_tuning

# No cuBLAS workspace by default. Without one cuBLAS picks GEMM kernels that do not split K into a
# second reduction kernel: on the H200 batch-1 decode of the Llama-3.1-8B shape got ~3% faster (the
# step's 64 split-K reduces and their launch gaps gone), and batch-256 throughput did not move.
# torch reads the variable when it creates the process's first cuBLAS workspace, so it is set when
# the platform is activated, before any model runs; a value the user set is kept. Not on ROCm builds.
CUBLAS_WORKSPACE_ENV = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_WORKSPACE_DEFAULT = ":0:0"
COMPILE_LOG_ENV = "PODIUM_TRITON_COMPILE_LOG"  # the alias of the compile_log option

TRITON_OPTIONS = (
    PlatformOption("tuning", str, "", "changes to the kernels' launch table, 'field=value,...': int and bool "
                   "fields of KernelTuning, tilings as block_m/block_n/num_warps/num_stages[/table_blocks], the "
                   "batch-invariant GEMM's plan as invariant_gemm=[kernel/]m/n/k/w/s;N:K=[kernel/]m/n/k/w/s;... "
                   "(e.g. decode_rotary_in_attention=0,decode=16/64/4/2)", env=TUNING_ENV, parse=parse_tuning),
    PlatformOption("fused_ops", str, "auto", "the fused Triton ops installed: comma-separated op names, auto "
                   "(the tuning's list) or none (the torch references); the batch-invariant mode installs its own "
                   "set", env=FUSED_OPS_ENV, parse=parse_fused_ops),
    PlatformOption("compile_log", bool, False, "log every Triton kernel variant this process builds or loads "
                   "(finds variants compiled in the middle of serving)", env=COMPILE_LOG_ENV),
)


def cuda_availability() -> Availability:
    """Available when torch is a CUDA (not HIP) build that sees a device and triton is importable."""
    if getattr(torch.version, "hip", None):
        return Availability(False, f"torch {torch.__version__} is a ROCm/HIP build; use the rocm platform")
    if not torch.version.cuda:
        return Availability(False, f"torch {torch.__version__} was built without CUDA")
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return Availability(False, f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device")
    if importlib.util.find_spec("triton") is None:
        return Availability(False, "triton is not installed (pip install 'podium-cuda[triton]')")
    return Availability(True, f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")


class CudaGraphRunner(GraphRunner):
    """CUDA graphs through torch's graph API; all captures share one memory pool."""

    def __init__(self) -> None:
        self._pool = None

    def capture(self, fn):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm-up outside the graph (allocator, autotuning)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = fn()

        def replay():
            graph.replay()
            return outputs

        return replay


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    priority = 100

    def __init__(self) -> None:
        self._backend: AttentionBackend | None = None
        self._changes: dict = {}  # the tuning option's field changes
        self._fused_ops: tuple[str, ...] | None = None  # the fused_ops option (None: the tuning's list)
        self._invariant = False  # the batch-invariant mode (use_batch_invariant_kernels)

    def availability(self) -> Availability:
        return cuda_availability()

    def options(self) -> tuple[PlatformOption, ...]:
        return TRITON_OPTIONS

    def activate(self, options: Mapping[str, Any]) -> None:
        """Take the options; turn off the cuBLAS workspace (NVIDIA) and install the compile log if asked."""
        self._changes, self._fused_ops = dict(options["tuning"]), options["fused_ops"]
        self._backend, self._invariant = None, False
        if not getattr(torch.version, "hip", None):  # measured on NVIDIA only; hipBLAS keeps its default
            os.environ.setdefault(CUBLAS_WORKSPACE_ENV, CUBLAS_WORKSPACE_DEFAULT)
        if options["compile_log"]:
            from .compile_log import install  # triton is imported here, not before

            install()

    def capabilities(self) -> Capabilities:
        bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return Capabilities(
            dtypes=(torch.float32, torch.float16, torch.bfloat16) if bf16 else (torch.float32, torch.float16),
            default_dtype=torch.bfloat16 if bf16 else torch.float16,
            graph_capture=True,
            fp8="e4m3fn",
            distributed_backend="nccl",
            pinned_memory=True,
            kv_cache_from_free_memory=True,
            batch_invariant=True,
            extra={"batch_invariant": "on" if self._invariant else "available (--batch-invariant)"},
        )

    def use_batch_invariant_kernels(self) -> None:
        """From here on: the batch-invariant attention, op table and linears (invariant_mode.py)."""
        self._invariant = True
        self._backend = None

    def config_defaults(self) -> dict:
        return {"gpu_memory_utilization": 0.90, "max_num_batched_tokens": 8192, "async_scheduling": True}

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def set_device(self, index: int) -> None:
        torch.cuda.set_device(index)

    def device_key(self, index: int = 0) -> str:
        """The GPU's UUID: the same card under any CUDA_VISIBLE_DEVICES numbering, in any process."""
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        return f"{self.device_type}:{uuid}" if uuid else super().device_key(index)

    def torch_device(self, index: int | None = None) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device() if index is None else index)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        torch.cuda.manual_seed_all(seed)

    def memory_info(self) -> MemoryInfo:
        free, total = torch.cuda.mem_get_info()
        return MemoryInfo(free, total)

    def reset_peak_memory(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def peak_memory(self) -> int:
        return torch.cuda.max_memory_allocated()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def attention_backend(self) -> AttentionBackend:
        if self._backend is None:
            self._backend = self._new_backend()
        return self._backend

    def _new_backend(self) -> AttentionBackend:
        if self._invariant:
            from .invariant_attention import InvariantAttentionBackend  # triton is imported here, not before

            return InvariantAttentionBackend(tuning=self.tuning(), fp8_flavour=self._fp8_cache_flavour())
        from .attention import TritonAttentionBackend  # triton is imported here, not before

        return TritonAttentionBackend(tuning=self.tuning(), fp8_flavour=self._fp8_cache_flavour())

    def _fp8_cache_flavour(self) -> str | None:
        """fp8 KV caches where Triton converts fp8 e4m3 in hardware: compute capability 8.9 (Ada) and up."""
        if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
            return None
        return self.capabilities().fp8

    def graph_runner(self) -> GraphRunner:
        return CudaGraphRunner()

    def base_tuning(self) -> KernelTuning:
        """This platform's launch table before the tuning option (ROCm overrides it)."""
        return CUDA_TUNING

    def tuning(self) -> KernelTuning:
        """The launch parameters this platform gives the kernels: its table with the tuning option applied."""
        base = self.base_tuning()
        return replace(base, **self._changes) if self._changes else base

    def custom_ops(self) -> dict:
        """The fused Triton ops of the fused_ops option, by default those that measured faster than the
        torch reference (``KernelTuning.fused_ops``), launched with this platform's tuning. In the
        batch-invariant mode its own fixed set instead (``invariant_mode.invariant_ops``)."""
        if self._invariant:
            from .invariant_mode import invariant_ops  # triton is imported here, not before

            return invariant_ops()
        tuning, kernels = self.tuning(), op_kernels()
        names = tuning.fused_ops if self._fused_ops is None else self._fused_ops
        missing = [n for n in names if n not in kernels]
        if missing:
            raise ValueError(f"fused_ops: podium-cuda has no fused kernel for {missing}; it has {sorted(kernels)}")
        return {name: kernels[name] if tuning is CUDA_TUNING else partial(kernels[name], tuning=tuning)
                for name in names}  # (the kernels' default tuning is CUDA_TUNING: no wrapper on the default path)

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """One-row bf16/fp16 linears (o_proj, lm_head at batch-1 decode) take the Triton GEMV
        (``KernelTuning.gemv_batch1``): the model's nn.Linear modules become BatchOneLinear in place.
        In the batch-invariant mode every linear becomes an InvariantLinear instead, or the model is
        refused with the reason (``invariant_mode.prepare_invariant_model``)."""
        tuning = self.tuning()
        if self._invariant:
            from .invariant_mode import prepare_invariant_model  # triton is imported here, not before

            return prepare_invariant_model(model, tuning)
        if tuning.gemv_batch1:
            from .gemv import use_batch_one_linears  # triton is imported here, not before

            use_batch_one_linears(model, tuning)
        if tuning.int4_gemv_mma:  # AWQ weights to the AWQ_MMA layout, in place
            from .awq_mma_gemv import convert_model

            convert_model(model)
        return model


def op_kernels() -> dict:
    """Every Triton op podium-cuda has, by op name (which are installed is the tuning's choice)."""
    from .fp8_linear import fp8_linear
    from .fused_linear import FUSED_LINEAR_OPS
    from .fused_ops import FUSED_OPS  # triton is imported here, not before
    from .gguf import GGUF_OPS
    from .int4 import INT4_OPS
    from .lora import LORA_OPS
    from .moe import fused_moe
    from .token_bitmask import apply_token_bitmask

    return {**FUSED_OPS, **FUSED_LINEAR_OPS, **GGUF_OPS, **INT4_OPS, **LORA_OPS, "fused_moe": fused_moe,
            "fp8_linear": fp8_linear, "apply_token_bitmask": apply_token_bitmask}
