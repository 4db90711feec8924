"""Graph capture on the CPU: a decode step's native kernel calls, recorded once and replayed from C.

A CPU has no graph API, but a decode step of a model whose every op is one of this platform's
native kernels (linears on AMX tiles, AVX512-BF16 dot products or FMA units with their fused
norms, in bf16 or float32 as ``linear_choice`` picks them; the paged attention with its rotary and
cache write; the embedding lookup) is a fixed list of C calls over fixed memory.
Capture runs the step's Python once with a recorder installed (``native_kernels.RECORDER``, per
thread): each ``NativeEntry`` call is stored with its arguments and not executed (it answers
success), so a capture costs the Python and allocations of a step, not its kernels. That is safe
because nothing in a captured step reads what a kernel computed: the guard below refuses every op
that would look at tensor values, so no later call's arguments depend on an earlier call's
results. Replay makes the same calls in order from C (graph_replay.c), in one ctypes call: the model's Python, the op dispatch,
the argument checks and the output allocations of ~150 ops a step are gone (about 140 us a layer
of SmolLM2's decode step at 32 sequences, measured with a 64-wide model where the kernels cost
next to nothing).

What makes a replay correct is what makes a CUDA graph's: the step reads only memory that stays
put. The engine refills the step's static inputs in place before each replay (token ids,
positions, slots, sequence lengths, block tables); the attention reads them through a Step built
for capture (``attention_kernel.captured_step``: lengths, slots and tables straight from those
tensors, none of the host-side planning an eager step does); every tensor the captured step
allocated is kept alive with the graph (``_CaptureGuard``), so replays write into the same
buffers and return the same output tensor.

A step that is not all native cannot be replayed this way: while capturing, the guard lets
through only ops that allocate or view memory (and index tensors built once, ``arange``); any
other torch op (a oneDNN linear, a torch fallback of an op) raises
``GraphCaptureUnsupported``, and the engine runs its steps eagerly. Graphs cover decode batches up
to ``MAX_GRAPH_BATCH`` rows: above that the kernels' own time dwarfs what a replay saves, and the
graphs keep the largest one's intermediate tensors (~0.5 MB a row for SmolLM2; smaller sizes
reuse them) and cost startup time (a forward each).
"""

from __future__ import annotations

import ctypes
import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from podium_plugin_api import GraphCaptureUnsupported, GraphRunner

from .native_kernels import RECORDER, NativeEntry, load_kernels

MAX_GRAPH_BATCH = 64
MAX_INT_ARGS = 16

aten = torch.ops.aten
# ops a captured step may run: they allocate or view memory, nothing a replay would have to redo
# (aten.empty.memory_format, torch.empty's, goes through _CaptureGuard._empty: shared buffers)
_ALLOCATING = {aten.empty, aten.empty_strided, aten.arange}
_VIEWING = {
    aten.view, aten._unsafe_view, aten.alias, aten.as_strided, aten.split_with_sizes, aten.split, aten.slice,
    aten.select, aten.narrow, aten.t, aten.transpose, aten.permute, aten.unsqueeze, aten.squeeze, aten.expand,
    aten.detach, aten.unbind,
}
# these view when they can and copy when they must: allowed only when the result shares the input's memory
_VIEWING_IF_POSSIBLE = {aten.reshape, aten.to, aten.contiguous, aten.flatten}


class Call(ctypes.Structure):
    """Mirror of graph_replay.c's ``Call``: the kernel's signature kind, its address, its integer and
    pointer arguments in order, its one float argument."""

    _fields_ = [("kind", ctypes.c_int64), ("fn", ctypes.c_void_p), ("a", ctypes.c_int64 * MAX_INT_ARGS),
                ("f", ctypes.c_float)]


class Recorder:
    """The native calls of one capture, in order, and the ctypes objects their pointers point into."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.names: list[str] = []
        self.keep: list = []

    def record(self, entry: NativeEntry, args: tuple) -> None:
        if entry.kind is None:
            raise GraphCaptureUnsupported(f"the native call {entry.name} has no replay form")
        call = Call(kind=entry.kind, fn=entry.address)
        count = 0
        for value, argtype in zip(args, entry.argtypes, strict=True):
            if argtype is ctypes.c_float:
                call.f = float(value)
                continue
            if isinstance(value, ctypes.Structure):  # a pointer argument given as the struct itself
                self.keep.append(value)
                value = ctypes.addressof(value)
            call.a[count] = 0 if value is None else int(value)
            count += 1
        self.calls.append(call)
        self.names.append(entry.name)


def capturing() -> bool:
    """Whether a graph capture is in progress in this thread (the attention takes its captured path)."""
    return RECORDER.get() is not None


class _CaptureGuard(TorchDispatchMode):
    """While capturing: keeps every tensor the step allocates alive (a replay writes into them
    again) and refuses torch ops that compute (a replay would not run them).

    ``shared``: the allocations of an earlier capture of the same step (a larger batch), in order.
    The step allocates the same tensors in the same order at every batch size, so its i-th
    allocation becomes a view of the i-th one there when it fits (same dtype, no more elements): the
    graphs of all sizes share one set of buffers, as CUDA graphs share a memory pool. Only one graph
    replays at a time and the engine reads its output before the next, so sharing is safe; no two
    allocations of one capture share memory."""

    def __init__(self, shared: list[torch.Tensor] | None = None) -> None:
        super().__init__()
        self.kept: list[torch.Tensor] = []
        self.allocated: list[torch.Tensor] = []
        self.shared = shared or []

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in dynamo.disable unless the mode says no: the
        # wrapper's first call imports torch._dynamo, ~0.9 s of startup; nothing compiles during a capture
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket
        if func is aten.empty.memory_format:
            out = self._empty(*args, **(kwargs or {}))
            self.allocated.append(out)
            self.kept.append(out)
            return out
        if packet not in _ALLOCATING and packet not in _VIEWING and packet not in _VIEWING_IF_POSSIBLE:
            raise GraphCaptureUnsupported(f"the step runs {func}, which is not a native kernel a replay can repeat")
        out = func(*args, **(kwargs or {}))
        if packet in _VIEWING_IF_POSSIBLE and not _shares_memory(out, args[0]):
            raise GraphCaptureUnsupported(f"the step's {func} copies its input, which a replay would not repeat")
        self.kept.extend(t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor))
        return out

    def _empty(self, size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
        earlier = self.shared[len(self.allocated)] if len(self.allocated) < len(self.shared) else None
        numel = math.prod(size)
        dtype = dtype or torch.get_default_dtype()
        plain = memory_format in (None, torch.contiguous_format) and not pin_memory and layout in (None, torch.strided)
        if earlier is not None and plain and earlier.dtype == dtype and earlier.numel() >= numel \
                and (device is None or torch.device(device).type == "cpu"):
            return earlier.view(-1)[:numel].view(size)
        return aten.empty.memory_format(size, dtype=dtype, layout=layout, device=device, pin_memory=pin_memory,
                                        memory_format=memory_format)


def _shares_memory(out, source) -> bool:
    return (isinstance(out, torch.Tensor) and isinstance(source, torch.Tensor)
            and out.untyped_storage().data_ptr() == source.untyped_storage().data_ptr())


class CpuGraphRunner(GraphRunner):
    """Captures a decode step as its list of native calls (module docstring). The engine captures
    its largest batch first; later (smaller) captures reuse that one's buffers (``_CaptureGuard``)."""

    max_batch_size = MAX_GRAPH_BATCH

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []  # the first capture's allocations, in order

    def capture(self, fn):
        kernels, why = load_kernels()
        if kernels is None:
            raise GraphCaptureUnsupported(why)
        recorder, guard = Recorder(), _CaptureGuard(self._buffers)
        token = RECORDER.set(recorder)
        try:
            with guard:
                outputs = fn()
        finally:
            RECORDER.reset(token)
        if not recorder.calls:
            raise GraphCaptureUnsupported("the step made no native kernel calls")
        if not self._buffers:
            self._buffers = guard.allocated
        program = (Call * len(recorder.calls))(*recorder.calls)
        address, count, names, replay_calls = ctypes.addressof(program), len(recorder.calls), recorder.names, kernels.replay
        kept = (program, recorder.keep, guard.kept, fn, outputs)  # everything the calls' pointers point into

        def replay():
            failed = replay_calls(address, count)
            if failed:
                raise MemoryError(f"replaying the captured step: {names[failed - 1]} (call {failed - 1}) failed "
                                  "to allocate its scratch memory")
            return kept[-1]

        return replay
