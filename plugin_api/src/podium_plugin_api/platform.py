"""The ``Platform`` base class: what a hardware plugin supplies besides attention.

Every method has a working default aimed at a device that behaves like a CPU tensor device, so
the smallest plugin sets ``name``/``device_type``/``priority`` and returns itself from the
``podium_platforms`` hook. The core never asks which vendor a platform is; it reads
``capabilities()`` and calls these methods.

Lifecycle: discovery creates every installed platform and asks ``availability()`` (so creating one
must have no side effects: no environment writes, no heavy imports); the engine then selects one,
resolves its ``options()`` and calls ``activate(options)`` once, where process-wide settings belong,
then ``device_count()`` / ``set_device(index)``, and uses the rest.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from .attention import AttentionBackend
from .distributed import Communicator
from .metadata import KVCacheSpec
from .options import PlatformOption
from .step_shape import StepShaping
from .version import API_VERSION


@dataclass(frozen=True)
class Availability:
    """Whether a platform can run here; ``reason`` says why not (or what was found)."""

    ok: bool
    reason: str = ""


@dataclass(frozen=True)
class MemoryInfo:
    free_bytes: int
    total_bytes: int


@dataclass(frozen=True)
class Capabilities:
    """What a platform can do. The core branches on these, never on a platform's name."""

    dtypes: tuple[torch.dtype, ...] = (torch.float32,)  # model dtypes; the engine refuses others
    default_dtype: torch.dtype = torch.float32  # dtype "auto"
    graph_capture: bool = False  # capture/replay of the decode step (GraphRunner)
    sliding_window: bool = True  # attention honours AttentionLayerSpec.sliding_window (else such models are refused)
    soft_cap: bool = True  # attention honours AttentionLayerSpec.soft_cap (else such models are refused)
    fp8: str | None = None  # e.g. "e4m3fn" or "e4m3fnuz"; None = no fp8 (kv_cache_dtype fp8)
    distributed_backend: str = "gloo"  # the torch.distributed backend of this device (tensor parallelism)
    pinned_memory: bool = False  # host staging buffers are pinned, so host -> device copies are asynchronous
    kv_cache_from_free_memory: bool = False  # size the cache from free memory after profiling
    inference_mode: bool = True  # steps may run under torch.inference_mode (False: torch.no_grad)
    # kernels whose every reduction order is fixed per row (batch_invariant mode): a request's
    # output does not depend on its batch, its chunking or prefix-cache hits (use_batch_invariant_kernels)
    batch_invariant: bool = False
    extra: dict[str, Any] = field(default_factory=dict)  # facts for people: podium platforms --verbose prints them

    def as_dict(self) -> dict[str, Any]:
        return {
            "dtypes": [str(d).replace("torch.", "") for d in self.dtypes],
            "default_dtype": str(self.default_dtype).replace("torch.", ""),
            "graph_capture": self.graph_capture,
            "sliding_window": self.sliding_window,
            "soft_cap": self.soft_cap,
            "fp8": self.fp8,
            "distributed_backend": self.distributed_backend,
            "pinned_memory": self.pinned_memory,
            "kv_cache_from_free_memory": self.kv_cache_from_free_memory,
            "inference_mode": self.inference_mode,
            "batch_invariant": self.batch_invariant,
            **self.extra,
        }


class GraphCaptureUnsupported(RuntimeError):
    """Raised by ``GraphRunner.capture`` when this step cannot be captured here (the model runs an
    op the platform's graphs do not cover, say); the core then runs every step eagerly."""


class GraphRunner:
    """Captures a step function once and replays it (CUDA/HIP graphs and the like).

    The core keeps the step's input and output tensors static: before a replay it copies new
    inputs into the same tensors the captured function read, and reads the same output tensors.
    """

    # the largest batch worth a graph here (None: every size up to the engine's max_num_seqs); the
    # core captures bucketed sizes up to it and runs larger decode steps eagerly
    max_batch_size: int | None = None

    def capture(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        """Run ``fn`` under capture; return a callable that replays it and returns its outputs.

        May raise ``GraphCaptureUnsupported`` (the core then stays eager)."""
        raise NotImplementedError


class Platform:
    """Base class of every platform. Subclass it, set the class attributes, override as needed."""

    name: ClassVar[str] = ""
    device_type: ClassVar[str] = "cpu"
    priority: ClassVar[int] = 0
    api_version: ClassVar[str] = API_VERSION

    # identity -------------------------------------------------------------------------------
    def availability(self) -> Availability:
        """Can this platform run here? Must not raise; heavy imports belong here, lazily."""
        return Availability(True, "")

    def capabilities(self) -> Capabilities:
        return Capabilities()

    def config_defaults(self) -> dict[str, Any]:
        """Defaults this platform suggests for engine settings the user left unset."""
        return {}

    # options, activation ----------------------------------------------------------------------
    def options(self) -> tuple[PlatformOption, ...]:
        """The settings this platform accepts (``podium_plugin_api.options``); default: none."""
        return ()

    def activate(self, options: Mapping[str, Any]) -> None:
        """Called by the engine once, on the selected platform, before anything else it calls.

        ``options`` holds a validated value for every option ``options()`` declares. Apply
        process-wide settings here (environment for a runtime library, global hooks), never when
        the platform is created: every installed platform is created at discovery. Default: nothing.
        """
        return None

    def use_batch_invariant_kernels(self) -> None:
        """Called by the engine once, right after ``activate``, when the user asked for the
        batch-invariant mode and ``capabilities().batch_invariant`` is True: from then on every op
        this platform runs (linears, norms, attention, sampling helpers) reduces each row in one
        fixed order, whatever the number of rows, the chunking of a prompt or a cached prefix.
        Added in API 2.3; the default refuses (a platform declaring the capability overrides it)."""
        raise NotImplementedError(f"platform {self.name!r} has no batch-invariant kernels")

    # device ---------------------------------------------------------------------------------
    def device_count(self) -> int:
        """How many devices of this platform this process can use (the engine needs at least one)."""
        return 1

    def torch_device(self, index: int = 0) -> torch.device:
        return torch.device(self.device_type) if self.device_type == "cpu" else torch.device(self.device_type, index)

    def set_device(self, index: int) -> None:
        """Bind this process to device ``index`` (< ``device_count()``); the engine calls it at startup."""
        return None

    def device_key(self, index: int = 0) -> str:
        """An identity of the hardware device ``index`` runs on, equal in every process that shares it
        and different for devices that compute side by side (a router counts the queued work of
        replicas with one key as one device's: they time-share it). Called after ``set_device``.
        Added in API 2.7; default: the host's name, the device type and the index (a platform whose
        index is not the physical device, or whose devices a host splits, overrides it)."""
        return f"{socket.gethostname()}/{self.device_type}:{index}"

    def synchronize(self) -> None:
        return None

    # distributed (tensor parallelism; the backend's name is ``capabilities().distributed_backend``)
    def rank_device(self, rank: int, world_size: int) -> int:
        """The device index rank ``rank`` of ``world_size`` binds to (the core passes it to
        ``set_device`` in that rank's process). Default: ``rank``, which must be below
        ``device_count()``; a platform whose ranks share one device (a CPU) returns 0."""
        return rank

    def communicator(self, rank: int, world_size: int) -> Communicator:
        """The collectives the sharded model calls, created in each rank's process after the core
        joined the ranks with ``torch.distributed.init_process_group``. Default: torch.distributed's
        own (``podium_plugin_api.distributed.Communicator``); override with a faster all-reduce."""
        return Communicator(rank, world_size)

    def seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    # memory ---------------------------------------------------------------------------------
    def memory_info(self) -> MemoryInfo:
        """Free and total memory the KV cache can come from (host RAM by default)."""
        page = os.sysconf("SC_PAGE_SIZE")
        return MemoryInfo(os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page)

    def reset_peak_memory(self) -> None:
        return None

    def peak_memory(self) -> int:
        """Peak bytes allocated since ``reset_peak_memory`` (0 where unknown)."""
        return 0

    def empty_cache(self) -> None:
        return None

    def attention_backend(self) -> AttentionBackend:
        return AttentionBackend()

    def allocate_kv_cache(self, spec: KVCacheSpec, num_blocks: int) -> list[torch.Tensor]:
        """One zeroed cache tensor per layer, in the attention backend's layout."""
        shape = self.attention_backend().kv_cache_shape(spec, num_blocks)
        device = self.torch_device()
        return [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]

    # graphs, step shapes, ops ---------------------------------------------------------------
    def graph_runner(self) -> GraphRunner | None:
        """A GraphRunner when ``capabilities().graph_capture``; None otherwise."""
        return None

    def step_shaping(self) -> StepShaping:
        """How steps are shaped for this device (``podium_plugin_api.step_shape``); default: exact shapes."""
        return StepShaping()

    def custom_ops(self) -> dict[str, Callable[..., Any]]:
        """Named ops overriding the core's pure-torch versions (see ``podium_plugin_api.ops``).

        The one route for a platform's ops: the engine asks once, after ``activate``."""
        return {}

    # model ----------------------------------------------------------------------------------
    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Transform a loaded model for this device; the core runs what this returns.

        Called by the core once, after the weights are loaded and before the first forward pass
        (KV-cache sizing included). A platform may swap modules for device-specific ones (pre-packed
        weights, fused layers) or return a new module; it must keep the model's interface
        (``forward``, ``compute_logits``) and its outputs. Default: the model unchanged.
        """
        return model
