"""The shared kernel cache: one checkout's build never deletes a build another checkout may load."""

import os
import time

from podium_cpu import native_kernels


def test_remove_stale_keeps_recent_builds_of_other_sources(tmp_path):
    keep = tmp_path / "attn-aaaa.so"
    recent = tmp_path / "attn-bbbb.so"  # another checkout's source, built a minute ago
    old = tmp_path / "attn-cccc.so"  # nobody built or loaded it for longer than the limit
    other_lib = tmp_path / "linear-dddd.so"
    for path in (keep, recent, old, other_lib):
        path.write_bytes(b"")
    now = time.time()
    os.utime(recent, (now - 60, now - 60))
    os.utime(old, (now - native_kernels.STALE_AFTER_S - 60,) * 2)
    os.utime(other_lib, (now - native_kernels.STALE_AFTER_S - 60,) * 2)
    native_kernels._remove_stale("attn", keep, now=now)
    assert keep.exists() and recent.exists() and other_lib.exists()
    assert not old.exists()
