"""The CPU platform's native kernels: C sources compiled on first use, cached, called through ctypes.

Why native: paged attention in pure torch must either gather every sequence's K/V into a dense
copy per layer (which doubles the step's memory traffic) or loop per sequence in Python; a small
C kernel reads each key/value row once, straight through the block table. The decoder's
RMSNorm, rotary embedding and SiLU-and-mul are one pass each in C instead of 2-10 torch ops. Linear
layers run on AMX tiles (amx_linear.c), AVX512-BF16 dot products (dpbf16_linear.c) or the FMA
units (fma_linear.c, bf16 and float32), by the rule in linear_choice.py.

Build: the system C compiler (``cc``, ``gcc`` or ``clang``) with ``-O3 -march=native -fopenmp``,
about a second (the libraries build in parallel), once per (source, compiler, CPU) into ``$XDG_CACHE_HOME/podium/cpu-kernels``
(``~/.cache`` by default); later processes load the cached library in milliseconds. The library
links the same ``libgomp.so.1`` torch has already loaded, so it shares torch's thread pool. Where
no compiler works, ``load_kernels`` says why and the backend runs its pure-torch paths.
"""

from __future__ import annotations

import contextvars
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

NATIVE_DIR = Path(__file__).parent / "native"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math")
# library name -> (source, extra flags); fused ops round like torch's separate kernels (no FMA contraction)
LIBRARIES = {
    "paged_attention": (NATIVE_DIR / "paged_attention.c", ()),
    "fused_ops": (NATIVE_DIR / "fused_ops.c", ("-ffp-contract=off",)),
    "amx_linear": (NATIVE_DIR / "amx_linear.c", ("-ffp-contract=off",)),  # its prologues are fused_ops' rows
    "fma_linear": (NATIVE_DIR / "fma_linear.c", ("-ffp-contract=off",)),
    "dpbf16_linear": (NATIVE_DIR / "dpbf16_linear.c", ("-ffp-contract=off",)),
    "graph_replay": (NATIVE_DIR / "graph_replay.c", ()),
    "gguf_linear": (NATIVE_DIR / "gguf_linear.c", ("-ffp-contract=off",)),  # GGUF blocks: int8 dots, exact embedding rows
}
# ggml type id -> the name in gguf_linear.c's entries (podium_gguf_q4_1_linear_bf16, ...)
GGUF_TYPES = {2: "q4_0", 3: "q4_1", 8: "q8_0", 12: "q4_k", 13: "q5_k", 14: "q6_k"}
COMPILERS = ("cc", "gcc", "clang")
COMPILE_TIMEOUT_S = 120


class Shape(ctypes.Structure):
    """Mirror of the C ``Shape`` struct: one layer's strides (elements) and attention parameters."""

    _fields_ = [
        (name, ctypes.c_int64)
        for name in (
            "q_token_stride", "o_token_stride", "k_token_stride", "v_token_stride",
            "num_heads", "num_kv_heads", "head_size", "block_size", "window",
        )
    ] + [("scale", ctypes.c_float), ("soft_cap", ctypes.c_float), ("amx_tiles", ctypes.c_int64)]


class Step(ctypes.Structure):
    """Mirror of the C ``Step`` struct: one step's batch (pointers to tensors the caller keeps alive)."""

    _fields_ = [
        ("block_tables", ctypes.c_void_p), ("bt_stride", ctypes.c_int64),
        ("tokens", ctypes.c_void_p), ("seqs", ctypes.c_void_p), ("positions", ctypes.c_void_p),
        ("num_tokens", ctypes.c_int64), ("max_span", ctypes.c_int64),
        ("slots", ctypes.c_void_p), ("num_writes", ctypes.c_int64),
        ("cos_sin", ctypes.c_void_p), ("rope_positions", ctypes.c_void_p), ("seq_lens", ctypes.c_void_p),
        ("tiles", ctypes.c_void_p), ("num_tiles", ctypes.c_int64), ("max_tile", ctypes.c_int64),
    ]


@dataclass
class NativeKernels:
    """The loaded libraries' entry points, by op name and dtype (``paged_attention[torch.bfloat16]``)."""

    paths: list[Path]
    paged_attention: dict
    write_kv: dict
    rms_norm: dict
    rotary: dict
    silu_and_mul: dict
    amx_linear: dict  # empty where this CPU or process cannot use AMX tiles
    amx_pack: dict  # the weight layout amx_linear and dpbf16_linear read (plain C, present wherever the library loads)
    fma_linear: dict  # float32 and bf16; empty where this build has no AVX2 + FMA
    fma_pack: dict  # the weight layouts fma_linear reads (plain C)
    dpbf16_linear: dict = field(default_factory=dict)  # bf16 on AVX512-BF16; empty where the build has none
    # the linears with the RMSNorm (+ residual add) or SiLU-mul before them in their input pass (linear.h)
    fma_fused_linear: dict = field(default_factory=dict)
    amx_fused_linear: dict = field(default_factory=dict)
    dpbf16_fused_linear: dict = field(default_factory=dict)
    embed_rows: dict = field(default_factory=dict)  # the embedding lookup
    # the same lookup from a tied head's packed weight: FMA panels (f32, bf16) and AMX tiles (bf16)
    panel_rows: dict = field(default_factory=dict)
    tile_rows: dict = field(default_factory=dict)
    # AMX tiles back to plain rows (the weight oneDNN multiplies above the AMX kernel's rows)
    tile_unpack: dict = field(default_factory=dict)
    panel_unpack: dict = field(default_factory=dict)  # float32 FMA panels back to plain rows
    token_bitmask: dict = field(default_factory=dict)  # structured output's mask, in place
    argmax: dict = field(default_factory=dict)  # greedy sampling's first index of each row's maximum
    # GGUF blocks kept quantized (gguf_linear.c): {ggml type id: {dtype: entry}}
    gguf_linear: dict = field(default_factory=dict)
    gguf_embed: dict = field(default_factory=dict)
    replay: ctypes._CFuncPtr | None = None  # graph_replay.c: a captured step's calls (graphs.py)
    # paged_attention.c's podium_attention_amx(on) -> on: bf16 prefill tiles on AMX tiles (set at load
    # where AMX runs; the tests turn it off to compare with the AVX512-BF16 tiles)
    attention_amx: ctypes._CFuncPtr | None = None
    # gguf_linear.c's podium_gguf_amx(on) -> on: GGUF batches on AMX-INT8 tiles (set at load where AMX
    # runs; the tests turn it off to compare with the AVX2 / VNNI paths)
    gguf_amx: ctypes._CFuncPtr | None = None
    # gguf_linear.c's podium_gguf_vnni512(on) -> on: GGUF batches AMX does not take in gguf_amx.h's
    # layout on AVX-512 VNNI (on where the build has it; the tests turn it off to compare likewise)
    gguf_vnni512: ctypes._CFuncPtr | None = None


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "podium" / "cpu-kernels"


def _cpu_flags() -> str:
    """The CPU's feature flags (``-march=native`` code is only valid on a CPU that has them)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return os.uname().machine


def _compiler() -> tuple[str, str] | None:
    """(path, version line) of the first C compiler found, or None."""
    for name in COMPILERS:
        path = shutil.which(name)
        if path is None:
            continue
        try:
            out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.SubprocessError):
            continue
        if out.returncode == 0:
            return path, out.stdout.splitlines()[0] if out.stdout else name
    return None


@functools.cache
def compiler_found() -> bool:
    """Whether a C compiler answers here (asked once per process)."""
    return _compiler() is not None


def _build(compiler: str, source: Path, flags: tuple[str, ...], target: Path) -> None:
    """Compile ``source`` to ``target`` atomically (a concurrent process may build the same file)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [compiler, *flags, "-o", tmp, str(source), "-lm"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {out.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


# A build another checkout (or another version installed beside this one) may still be about to load
# shares this folder: only builds untouched for this long are dropped, never one just written.
STALE_AFTER_S = 7 * 24 * 3600


def _remove_stale(name: str, keep: Path, now: float | None = None) -> None:
    """Drop builds of other sources that nobody has built or loaded for ``STALE_AFTER_S`` (a process
    still using one keeps its mapping after unlink; a fresh one would only rebuild it)."""
    now = time.time() if now is None else now
    for old in keep.parent.glob(f"{name}-*.so"):
        if old == keep:
            continue
        try:
            if now - old.stat().st_mtime > STALE_AFTER_S:
                old.unlink()
        except OSError:
            pass


class NativeEntry:
    """One bound kernel entry point. Calling it calls the C function; while a graph capture is in
    progress in this thread (``RECORDER``, graphs.py), the call is handed to the recorder instead and
    answers 0 (success) without running: the replays run it.

    ``kind`` names the C signature (graph_replay.c's enum) a replay makes the call through, or is
    None for entries a captured step never calls (the packers)."""

    __slots__ = ("fn", "name", "kind", "address")

    def __init__(self, fn, name: str, kind: int | None) -> None:
        self.fn, self.name, self.kind = fn, name, kind
        self.address = ctypes.cast(fn, ctypes.c_void_p).value

    @property
    def argtypes(self):
        return self.fn.argtypes

    def __call__(self, *args):
        recorder = RECORDER.get()
        if recorder is not None:
            recorder.record(self, args)
            return 0
        return self.fn(*args)

    def __repr__(self) -> str:
        return f"NativeEntry({self.name})"


# the graph capture in progress in this thread (graphs.Recorder), or None
RECORDER: contextvars.ContextVar = contextvars.ContextVar("podium_cpu_recorder", default=None)

_PTR, _I64, _INT, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
# graph_replay.c's call kinds, by C function prefix
REPLAY_KINDS = {
    "podium_amx_fused_linear": 0, "podium_fma_fused_linear": 0, "podium_dpbf16_fused_linear": 0,
    "podium_amx_linear": 1, "podium_fma_linear": 1, "podium_dpbf16_linear": 1,
    "podium_paged_attention": 2, "podium_rms_norm": 3, "podium_embed_rows": 4, "podium_silu_and_mul": 5,
    "podium_rotary": 6, "podium_write_kv": 7, "podium_panel_rows": 4, "podium_tile_rows": 4,
    **{f"podium_gguf_{name}_linear": 1 for name in GGUF_TYPES.values()},
    **{f"podium_gguf_{name}_embed": 4 for name in GGUF_TYPES.values()},
}
_LINEAR = [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64, _INT]
_FUSED_LINEAR = [_PTR, _I64, _PTR, _I64, _PTR, _F32, _PTR, _INT, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64, _INT]
_PACK = [_PTR, _I64, _I64, _PTR, _INT]
_ROWS = [_PTR, _I64, _I64, _PTR, _I64, _PTR, _INT]  # (table, rows, dim, ids, n, out, threads)
SIGNATURES = {  # C function prefix -> (argtypes, dtypes it exists for)
    "podium_paged_attention": ([_PTR] * 6 + [ctypes.POINTER(Step), ctypes.POINTER(Shape), _INT], ("f32", "bf16")),
    "podium_write_kv": ([_PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64], ("f32", "bf16")),
    "podium_rms_norm": ([_PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _F32, _INT], ("f32", "bf16")),
    "podium_rotary": ([_PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _INT],
                      ("f32", "bf16")),
    "podium_silu_and_mul": ([_PTR, _I64, _PTR, _I64, _I64, _INT], ("f32", "bf16")),
    "podium_amx_linear": (_LINEAR, ("bf16",)),
    "podium_amx_pack": (_PACK, ("bf16",)),
    "podium_amx_fused_linear": (_FUSED_LINEAR, ("bf16",)),
    "podium_dpbf16_linear": (_LINEAR, ("bf16",)),
    "podium_dpbf16_fused_linear": (_FUSED_LINEAR, ("bf16",)),
    "podium_fma_linear": (_LINEAR, ("f32", "bf16")),
    "podium_fma_pack": (_PACK, ("f32", "bf16")),
    "podium_fma_fused_linear": (_FUSED_LINEAR, ("f32", "bf16")),
    "podium_embed_rows": (_ROWS, ("f32", "bf16")),
    "podium_panel_rows": (_ROWS, ("f32", "bf16")),
    "podium_tile_rows": (_ROWS, ("bf16",)),
    "podium_tile_unpack": ([_PTR, _I64, _I64, _I64, _I64, _PTR, _I64, _INT], ("bf16",)),
    "podium_panel_unpack": ([_PTR, _I64, _I64, _I64, _I64, _PTR, _I64, _INT], ("f32",)),
    "podium_token_bitmask": ([_PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _INT], ("f32", "bf16")),
    "podium_argmax": ([_PTR, _I64, _I64, _I64, _PTR, _INT], ("f32", "bf16")),
    **{f"podium_gguf_{name}_linear": (_LINEAR, ("f32", "bf16")) for name in GGUF_TYPES.values()},
    **{f"podium_gguf_{name}_embed": ([_PTR, _I64, _I64, _PTR, _I64, _PTR, _INT], ("f32", "bf16"))
       for name in GGUF_TYPES.values()},
}
SUFFIX_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def _bind(libs: list[ctypes.CDLL]) -> dict[str, dict]:
    """Entry points by C prefix and dtype, with ctypes signatures set."""
    entries: dict[str, dict] = {}
    for prefix, (argtypes, suffixes) in SIGNATURES.items():
        entries[prefix] = {}
        for suffix in suffixes:
            name = f"{prefix}_{suffix}"
            fn = _symbol(libs, name)
            if fn is None:
                raise AttributeError(f"native library lacks {name}")
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
            entries[prefix][SUFFIX_DTYPES[suffix]] = NativeEntry(fn, name, REPLAY_KINDS.get(prefix))
    return entries


def _target(name: str, source: Path, flags: tuple[str, ...], compiler_version: str) -> Path:
    """The cached library's path, keyed by everything the build depends on."""
    key = hashlib.sha256(
        b"\0".join([source.read_bytes(), *(h.read_bytes() for h in sorted(NATIVE_DIR.glob("*.h"))),
                    compiler_version.encode(), " ".join(flags).encode(), _cpu_flags().encode()])
    ).hexdigest()[:16]
    return cache_dir() / f"{name}-{key}.so"


_LOADED: dict[str, tuple[NativeKernels | None, str]] = {}


def load_kernels() -> tuple[NativeKernels | None, str]:
    """(kernels, "") or (None, why not), built and loaded once per process. Never raises."""
    if "kernels" not in _LOADED:
        _LOADED["kernels"] = _load()
    return _LOADED["kernels"]


def _load() -> tuple[NativeKernels | None, str]:
    found = _compiler()
    if found is None:
        return None, f"no C compiler found (tried {', '.join(COMPILERS)}); using pure-torch attention and ops"
    compiler, version = found
    try:
        targets = {name: _target(name, source, FLAGS + extra, version) for name, (source, extra) in LIBRARIES.items()}
        missing = [name for name, target in targets.items() if not target.exists()]
        with ThreadPoolExecutor(max_workers=max(1, len(missing))) as pool:  # one compiler process per library
            builds = [pool.submit(_build, compiler, LIBRARIES[name][0], FLAGS + LIBRARIES[name][1], targets[name])
                      for name in missing]
            for build in builds:
                build.result()
        for name in missing:
            _remove_stale(name, targets[name])
        paths = list(targets.values())
        for path in paths:  # a load counts as use: _remove_stale keeps builds in use anywhere
            try:
                os.utime(path)
            except OSError:
                pass
        libs = [ctypes.CDLL(str(p)) for p in paths]
        entries = _bind(libs)
        amx_ready = _amx_ready(libs)
        attention_amx = _switch_entry(libs, "podium_attention_amx")
        attention_amx(1 if amx_ready else 0)  # bf16 prefill tiles on AMX where the process may use it
        gguf_amx = _switch_entry(libs, "podium_gguf_amx")
        gguf_amx(1 if amx_ready else 0)  # GGUF batches on AMX-INT8 tiles likewise (the build must have them)
        gguf_vnni512 = _switch_entry(libs, "podium_gguf_vnni512")
        gguf_vnni512(1)  # else on AVX-512 VNNI, where the build has it
        fma_ready = _ready(libs, "podium_fma_ready") == 1
        dpbf16_ready = _ready(libs, "podium_dpbf16_ready") == 1
        replay = _replay_entry(libs)
    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as exc:
        return None, f"native kernels unavailable ({exc}); using pure-torch attention and ops"
    return NativeKernels(
        paths=paths,
        paged_attention=entries["podium_paged_attention"],
        write_kv=entries["podium_write_kv"],
        rms_norm=entries["podium_rms_norm"],
        rotary=entries["podium_rotary"],
        silu_and_mul=entries["podium_silu_and_mul"],
        amx_linear=entries["podium_amx_linear"] if amx_ready else {},
        amx_pack=entries["podium_amx_pack"],
        fma_linear=entries["podium_fma_linear"] if fma_ready else {},
        fma_pack=entries["podium_fma_pack"],
        dpbf16_linear=entries["podium_dpbf16_linear"] if dpbf16_ready else {},
        fma_fused_linear=entries["podium_fma_fused_linear"] if fma_ready else {},
        amx_fused_linear=entries["podium_amx_fused_linear"] if amx_ready else {},
        dpbf16_fused_linear=entries["podium_dpbf16_fused_linear"] if dpbf16_ready else {},
        embed_rows=entries["podium_embed_rows"],
        panel_rows=entries["podium_panel_rows"],
        tile_rows=entries["podium_tile_rows"],
        tile_unpack=entries["podium_tile_unpack"],
        panel_unpack=entries["podium_panel_unpack"],
        token_bitmask=entries["podium_token_bitmask"],
        argmax=entries["podium_argmax"],
        gguf_linear={t: entries[f"podium_gguf_{name}_linear"] for t, name in GGUF_TYPES.items()},
        gguf_embed={t: entries[f"podium_gguf_{name}_embed"] for t, name in GGUF_TYPES.items()},
        replay=replay,
        attention_amx=attention_amx,
        gguf_amx=gguf_amx,
        gguf_vnni512=gguf_vnni512,
    ), ""


def _symbol(libs: list[ctypes.CDLL], name: str):
    """The first library's function ``name``, or None where none has it."""
    return next((getattr(lib, name) for lib in libs if hasattr(lib, name)), None)


def _replay_entry(libs: list[ctypes.CDLL]):
    """graph_replay.c's ``podium_replay(const Call *calls, int64_t n)``."""
    fn = _symbol(libs, "podium_replay")
    if fn is None:
        raise AttributeError("native library lacks podium_replay")
    fn.argtypes, fn.restype = [_PTR, _I64], ctypes.c_int
    return fn


def _switch_entry(libs: list[ctypes.CDLL], name: str):
    """A kernel's ``int name(int on)`` switch (paged_attention.c's podium_attention_amx, gguf_linear.c's
    podium_gguf_amx and podium_gguf_vnni512): it answers whether the kernel is on (the GGUF ones: -1
    only asks)."""
    fn = _symbol(libs, name)
    if fn is None:
        raise AttributeError(f"native library lacks {name}")
    fn.argtypes, fn.restype = [_INT], ctypes.c_int
    return fn


def _ready(libs: list[ctypes.CDLL], name: str) -> int:
    """What the library's ``int name(void)`` answers (-1 where no library has it)."""
    fn = _symbol(libs, name)
    if fn is None:
        return -1
    fn.argtypes, fn.restype = [], ctypes.c_int
    return fn()


def _amx_ready(libs: list[ctypes.CDLL]) -> bool:
    """Whether AMX tiles work here: built with them (-march=native on an AMX CPU) and granted by the
    OS to this process (the C side asks once; oneDNN asks the same)."""
    return _ready(libs, "podium_amx_init") == 0
