"""Linear layers with weights pre-packed at load. bfloat16: the native AMX kernel, else oneDNN's,
else the native AVX2 FMA kernel; float32: oneDNN's.

``F.linear`` on a bf16 CPU tensor hands oneDNN a plain [out, in] weight, which it reorders into
its blocked matmul layout on every call; packing once at load time removes that reorder, about a
third of a small-batch decode step's matmul time here, with bit-identical results (the same
kernel runs on the same blocked weights). float32 linears are packed for oneDNN too: ``F.linear``
runs them on MKL's sgemm, which oneDNN's packed fp32 matmul beat 1.3-2.7x at 8-32 rows on an AVX2
CPU (equal at prefill sizes). Neither is bit-identical with the other (transformers' float32 greedy
tokens stay the same, tested), and neither promises a row the same bits at every batch size (MKL's
did not; torch 2.13's oneDNN did at 1-256 rows, torch 2.8's did not).

Where the CPU has AMX, ``AmxLinear`` goes further for the rows of a decode step (up to
``AMX_MAX_ROWS``): the native kernel (native/amx_linear.c) streams its tiled weights once per 32
rows with ~20 us less fixed cost per call than oneDNN's packed path, whose per-call setup and
weight stream took a decode step's linears to half this machine's read bandwidth. Each row's
result is independent of the other rows (batch invariance); larger batches (prefill chunks) go to
oneDNN through ``F.linear``, whose per-call reorder is small next to their matmul.

Where oneDNN has no bf16 matmul (AVX2 without AVX-512, e.g. AMD Zen 3), ``FmaLinear`` runs every
bf16 linear on the native FMA kernel (native/fma_linear.c: bf16 weight panels widened in
registers, float32 sums, rows independent of each other); torch's own bf16 matmul there is ~5x
slower than its float32 one.

This is a transformation applied to a loaded model (``pack_linear_layers``); the model's modules
keep their names and parameters, so nothing else changes. Re-loading weights afterwards would leave
the packed copies stale: pack last.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

PACK_BATCH_HINT = 32  # oneDNN picks its blocking for this many rows; any row count works
AMX_MAX_ROWS = 256  # AmxLinear's kernel up to this many rows, oneDNN above (measured alike at 256-512)


PACKABLE = (torch.bfloat16, torch.float32)


def can_pack(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs and runs ``dtype`` linears here (bf16 or fp32; see ``packing_unavailable``)."""
    return dtype in PACKABLE and not packing_unavailable(dtype)


@functools.cache
def packing_unavailable(dtype: torch.dtype = torch.bfloat16) -> str:
    """Why oneDNN cannot pack ``dtype`` linear weights in this process ("" when it can).

    Its bf16 matmul needs AVX512BW/VL/DQ or AVX-NE-CONVERT: on an AVX2-only CPU (AMD Zen 3, say)
    ``_reorder_linear_weight`` raises, so one tiny weight is packed and used once to find out.
    """
    name = str(dtype).removeprefix("torch.")
    if dtype not in PACKABLE:
        return f"oneDNN linear packing is for {', '.join(str(d).removeprefix('torch.') for d in PACKABLE)}, not {name}"
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "this torch has no oneDNN linear ops"
    try:
        weight = torch.ones(32, 32, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
        out = _linear_op()(torch.ones(2, 32, dtype=dtype), packed, None, "none", [], "")
    except RuntimeError as exc:
        return f"oneDNN cannot pack {name} weights on this CPU ({str(exc).splitlines()[0]})"
    if not bool((out == 32).all()):
        return f"oneDNN's packed {name} linear gave a wrong result on this CPU"
    return ""


@functools.cache
def _linear_op():
    """``torch.ops.mkldnn._linear_pointwise.default``, looked up once (not on every call)."""
    return torch.ops.mkldnn._linear_pointwise.default


class PackedLinear(nn.Module):
    """Drop-in for an ``nn.Linear`` holding bf16 or fp32 weights: same parameters, oneDNN's matmul
    over weights packed once."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        dtype = linear.weight.dtype
        if dtype not in PACKABLE or linear.weight.device.type != "cpu":
            raise ValueError(f"PackedLinear needs a bfloat16 or float32 CPU weight, got {dtype} on {linear.weight.device}")
        self.in_features, self.out_features, self.dtype = linear.in_features, linear.out_features, dtype
        self.weight = linear.weight  # kept: state_dict, tied references and introspection see the usual parameter
        self.bias = linear.bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_BATCH_HINT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == self.dtype and x.is_contiguous():  # the model's [T, in] rows
            return _linear_op()(x, self.packed, self.bias, "none", [], "")  # [T, out]
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features).to(self.dtype).contiguous()  # [N, in]
        out = _linear_op()(rows, self.packed, self.bias, "none", [], "")  # [N, out]
        return out.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"packed=onednn {str(self.dtype).removeprefix('torch.')}")


def amx_tiles(weight: torch.Tensor, pack=None) -> torch.Tensor:
    """weight [N, K] bf16 -> the AMX kernel's layout [N/16, K/32, 16, 16, 2], zero padded to N % 32 == 0
    and K % 32 == 0: tiles of 16 outputs x 32 inputs, inputs k and k+1 of an output side by side.
    ``pack`` (``NativeKernels.amx_pack[torch.bfloat16]``) writes it in one parallel pass; without
    it torch pads and permutes (the definition the native packer is tested against)."""
    n, k = weight.shape
    n_pad, k_pad = n + -n % 32, k + -k % 32
    if pack is not None:
        source = weight.detach().contiguous()
        tiles = torch.empty(n_pad // 16, k_pad // 32, 16, 16, 2, dtype=torch.bfloat16)
        pack(source.data_ptr(), n, k, tiles.data_ptr(), torch.get_num_threads())
        return tiles
    padded = F.pad(weight.detach(), (0, k_pad - k, 0, n_pad - n))  # [Np, Kp]
    return padded.view(n_pad // 16, 16, k_pad // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


def fma_panels(weight: torch.Tensor, pack=None) -> torch.Tensor:
    """weight [N, K] bf16 -> the FMA kernel's layout [N/16, K, 16], zero rows padding N to N % 16 == 0:
    panels of 16 outputs, k-major, a k's 16 columns in ``FMA_COLUMN_ORDER``. ``pack`` (``NativeKernels.fma_pack[torch.bfloat16]``) writes it in
    one parallel pass; without it torch pads and transposes (the definition the packer is tested against)."""
    n, k = weight.shape
    n_pad = n + -n % 16
    if pack is not None:
        source = weight.detach().contiguous()
        panels = torch.empty(n_pad // 16, k, 16, dtype=torch.bfloat16)
        pack(source.data_ptr(), n, k, panels.data_ptr(), torch.get_num_threads())
        return panels
    padded = F.pad(weight.detach(), (0, 0, 0, n_pad - n))  # [Np, K]
    panels = padded.view(n_pad // 16, 16, k).transpose(1, 2)  # [P, K, 16], columns in order
    return panels[:, :, FMA_COLUMN_ORDER].contiguous()


# the column each of a panel's 16 slots holds: what AVX2's in-lane 16-bit unpacks with zero widen
# into columns 0-7 (unpacklo) and 8-15 (unpackhi) (fma_linear.c's SLOT)
FMA_COLUMN_ORDER = [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]


class NativeLinear(nn.Module):
    """Drop-in for an ``nn.Linear`` holding bf16 weights: same parameters, a native kernel over
    weights packed once at load (``layout(weight, pack)``), for batches of up to ``max_rows`` rows
    (None: any); other inputs go to ``F.linear``."""

    kind = "native"
    max_rows: int | None = None

    def __init__(self, linear: nn.Linear, kernel, pack=None) -> None:
        super().__init__()
        if linear.weight.dtype != torch.bfloat16 or linear.weight.device.type != "cpu":
            raise ValueError(f"{type(self).__name__} needs a bfloat16 CPU weight, got {linear.weight.dtype} "
                             f"on {linear.weight.device}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # kept: other batches, state_dict, tied references see the usual parameter
        self.bias = linear.bias
        self.packed = self.layout(linear.weight, pack)
        self.bias_f32 = None if linear.bias is None else linear.bias.detach().float().contiguous()
        self.kernel = kernel

    @staticmethod
    def layout(weight: torch.Tensor, pack=None) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x  # [M, in]
        m = rows.shape[0]
        too_many = self.max_rows is not None and m > self.max_rows
        if too_many or m == 0 or rows.dtype != torch.bfloat16 or rows.stride(-1) != 1:
            return F.linear(x, self.weight, self.bias)
        if rows.shape[1] != self.in_features:
            raise ValueError(f"input has {rows.shape[1]} features; this layer takes {self.in_features}")
        out = torch.empty((m, self.out_features), dtype=torch.bfloat16)  # [M, out]
        bias = None if self.bias_f32 is None else self.bias_f32.data_ptr()
        rc = self.kernel(rows.data_ptr(), rows.stride(0), m, self.packed.data_ptr(), self.out_features,
                         self.in_features, bias, out.data_ptr(), self.out_features, torch.get_num_threads())
        if rc != 0:
            raise MemoryError(f"the {self.kind} linear kernel could not allocate its scratch rows")
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed={self.kind}"


class AmxLinear(NativeLinear):
    """The native AMX kernel (amx_linear.c) for decode-sized batches; oneDNN through F.linear above."""

    kind, max_rows = "amx", AMX_MAX_ROWS
    layout = staticmethod(amx_tiles)


class FmaLinear(NativeLinear):
    """The native AVX2 FMA kernel (fma_linear.c) for every batch: where oneDNN has no bf16 matmul,
    torch's bf16 F.linear is ~5x slower than its float32 one, so nothing goes back to it."""

    kind = "fma"
    layout = staticmethod(fma_panels)


def pack_linear_layers(model: nn.Module, amx_kernel=None, amx_pack=None, fma_kernel=None, fma_pack=None,
                       float32: bool = True) -> int:
    """Replace the CPU ``nn.Linear`` modules of ``model``; returns how many were replaced.

    bf16 ones, in this order of preference: an ``AmxLinear`` (given the native AMX kernel and its
    packer, ``NativeKernels.amx_linear`` / ``amx_pack``), a ``PackedLinear`` (where oneDNN packs
    bf16), an ``FmaLinear`` (given ``NativeKernels.fma_linear`` / ``fma_pack``). fp32 ones (with
    ``float32``): a ``PackedLinear`` where oneDNN packs fp32."""
    makers = {}
    if amx_kernel is not None:
        makers[torch.bfloat16] = lambda child: AmxLinear(child, amx_kernel, amx_pack)
    elif can_pack(torch.bfloat16):
        makers[torch.bfloat16] = PackedLinear
    elif fma_kernel is not None:
        makers[torch.bfloat16] = lambda child: FmaLinear(child, fma_kernel, fma_pack)
    if float32 and can_pack(torch.float32):
        makers[torch.float32] = PackedLinear
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            make = makers.get(child.weight.dtype) if type(child) is nn.Linear else None
            if make is not None and child.weight.device.type == "cpu":
                setattr(parent, name, make(child))
                count += 1
    return count
