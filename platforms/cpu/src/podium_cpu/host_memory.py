"""Host memory for the KV cache: zeroed, aligned, and (on request) resident from the start.

The KV cache is the engine's one large allocation. Left to fault in on first touch (calloc'd
pages, the default), it makes the process's RSS climb for as long as the block manager hands out
blocks it has never used, and with a prefix cache that is until every block has held something:
growth that looks like a leak from outside but stops at the cache's size. The platform option
``kv_cache_commit`` commits the pages once, when the cache is allocated, so RSS is flat from the
start and a host that cannot hold the cache fails at startup: ``madvise(MADV_POPULATE_WRITE)``
(Linux 5.14+) faults them in without writing them, and where the kernel refuses it one write per
page does the same, slower. ``resident_bytes`` says how much of a tensor is in memory
(``mincore``), for diagnostics such as ``benchmarks/rss_offline.py``.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import mmap
import os
import sys

import numpy as np
import torch

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h


def zeroed_host_tensor(shape: tuple[int, ...], dtype: torch.dtype, commit: bool) -> torch.Tensor:
    """A zeroed, page-aligned tensor; ``commit``: its every page resident already."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    raw = fresh_pages(nbytes)
    if commit:
        commit_pages(raw)
    return torch.from_numpy(raw).view(dtype).view(shape)


def fresh_pages(nbytes: int) -> np.ndarray:
    """``nbytes`` of zero pages that no process has touched, as uint8 (page-aligned; freed to the OS
    with the array). An anonymous mapping of its own: calloc may instead hand out a freed region of
    the heap, which it zeroes by writing it (all resident), and does in a long-lived process that
    has freed large buffers before."""
    if nbytes == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=np.uint8)


def commit_pages(array: np.ndarray) -> None:
    """Fault in every page of ``array`` (contiguous) for writing, leaving its contents as they are."""
    if array.nbytes == 0:
        return
    page = mmap.PAGESIZE
    address = array.ctypes.data
    start = address - address % page
    if _populate_write(start, address + array.nbytes - start):
        return
    flat = array.reshape(-1).view(np.uint8)
    first = -address % page  # the first byte of each page the array covers
    # a write per page, values unchanged (a copy: numpy skips assigning a view to itself)
    flat[first::page] = flat[first::page].copy()
    flat[:1] = flat[:1].copy()


def resident_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the pages under ``tensor`` (contiguous, host) that are in memory now, from ``mincore``
    (a diagnostic: what of a cache a process holds); 0 where this is not Linux."""
    mincore = _libc_function("mincore", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p))
    if mincore is None:
        return 0
    page = mmap.PAGESIZE
    address = tensor.data_ptr()
    start = address - address % page
    length = address + tensor.numel() * tensor.element_size() - start
    pages = (ctypes.c_ubyte * -(-length // page))()
    if mincore(start, length, pages) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed on a tensor's pages")
    return int((np.frombuffer(pages, dtype=np.uint8) & 1).sum()) * page


def release_freed_heap() -> bool:
    """Hand the heap's free pages back to the OS (glibc's ``malloc_trim(0)``); False where there is no
    glibc. Loading and packing free a model's worth of temporaries (dequantized blocks, the plain
    weights a packed-only layer drops) that glibc keeps mapped, and RSS with them, for reuse."""
    if not sys.platform.startswith("linux") or not os.confstr("CS_GNU_LIBC_VERSION"):
        return False
    trim = _libc_function("malloc_trim", (ctypes.c_size_t,))
    if trim is None:
        return False
    trim(0)  # (1 when it released memory, 0 when there was none to release)
    return True


def _populate_write(start: int, length: int) -> bool:
    """``madvise(MADV_POPULATE_WRITE)`` over the range; False where this OS or kernel has no such advice."""
    madvise = _libc_function("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int))
    if madvise is None:
        return False
    if madvise(start, length, MADV_POPULATE_WRITE) == 0:
        return True
    logger.debug("madvise(MADV_POPULATE_WRITE) failed (errno %d): committing the KV cache page by page",
                 ctypes.get_errno())
    return False


@functools.cache
def _libc_function(name: str, argtypes: tuple | list):
    """libc's ``name`` on Linux (the advice numbers used here are Linux's), else None."""
    if not sys.platform.startswith("linux"):
        return None
    function = getattr(ctypes.CDLL(None, use_errno=True), name, None)
    if function is None:
        return None
    function.argtypes = list(argtypes)
    function.restype = ctypes.c_int
    return function
