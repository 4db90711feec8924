"""Importing the CUDA plugin is cheap and safe everywhere: no triton import, no CUDA needed."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = """
import sys
import podium_cuda, podium_cuda.hooks, podium_cuda.tuning
platform = podium_cuda.CudaPlatform()
availability = platform.availability()
caps = platform.capabilities()
loaded = sorted(name for name in sys.modules if name == "triton" or name.startswith("triton."))
print("TRITON_MODULES", loaded)
print("AVAILABLE", availability.ok, availability.reason)
"""


def test_importing_podium_cuda_does_not_import_triton():
    run = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "TRITON_MODULES []" in run.stdout, run.stdout
    assert "AVAILABLE" in run.stdout


def test_platform_turns_off_the_cublas_workspace_unless_the_user_set_one():
    probe = "import os, podium_cuda; podium_cuda.CudaPlatform(); print(os.environ['CUBLAS_WORKSPACE_CONFIG'])"
    for preset, want in ((None, ":0:0"), (":4096:8", ":4096:8")):
        env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
        if preset is not None:
            env["CUBLAS_WORKSPACE_CONFIG"] = preset
        run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip().splitlines()[-1] == want


def test_split_plan_is_a_power_of_two_and_grows_only_for_few_long_sequences():
    from podium_cuda.tuning import SplitPolicy, plan_splits

    policy = SplitPolicy(target_programs=264, min_keys_per_split=256, max_splits=64)  # not the default: fixed here
    assert plan_splits(256, 8, 8192, policy) == 1  # enough programs already
    assert plan_splits(1, 8, 511, policy) == 1  # two splits would hold under 256 keys each
    assert plan_splits(1, 8, 512, policy) == 2
    assert plan_splits(1, 8, 8192, policy) == 32  # 8 * 32 = 256 < 264 programs; 8192 / 32 = 256 keys a split
    assert plan_splits(4, 8, 100_000, policy) == 16  # 32 * 8 = 256 programs is still under 264: one more
    for seqs in (1, 2, 3, 5, 17):
        for length in (1, 300, 1000, 5000, 100_000):
            splits = plan_splits(seqs, 8, length, policy)
            assert splits & (splits - 1) == 0 and 1 <= splits <= 64


def test_fused_ops_env_override_names_known_ops_or_fails_clearly():
    import pytest

    from podium_cuda.tuning import fused_ops_from_env

    known = {"rms_norm": 1, "argmax": 2}
    assert fused_ops_from_env(None, ("rms_norm",), known) == ("rms_norm",)
    assert fused_ops_from_env("rms_norm, argmax", ("rms_norm",), known) == ("rms_norm", "argmax")
    assert fused_ops_from_env("none", ("rms_norm",), known) == ()
    assert fused_ops_from_env("", ("rms_norm",), known) == ()
    with pytest.raises(ValueError, match=r"PODIUM_CUDA_FUSED_OPS.*'rms_nrom'.*known"):
        fused_ops_from_env("rms_nrom", ("rms_norm",), known)


def test_tuning_env_overrides_int_bool_and_tiling_fields_or_fails_clearly():
    import pytest

    from podium_cuda.tuning import KernelTuning, tuning_from_env

    base = KernelTuning()
    assert tuning_from_env(None, base) is base
    changed = tuning_from_env("decode_rotary_in_attention=0, reduce_num_warps=8", base)
    assert changed.decode_rotary_in_attention is False and changed.reduce_num_warps == 8
    assert changed.decode == base.decode
    tilings = tuning_from_env("decode=16/128/8/3, fp8_decode=none", base)
    assert (tilings.decode.block_n, tilings.decode.num_warps, tilings.decode.num_stages) == (128, 8, 3)
    assert tilings.fp8_decode is None and tuning_from_env("fp8_decode=32/64/4/2", base).fp8_decode.block_m == 32
    assert tilings.decode.table_blocks == 0 and tuning_from_env("prefill=64/32/4/3/16", base).prefill.table_blocks == 16
    for bad in ("decode=3", "decode=none", "decode=16/24/4/2", "fp8_decode=16/32", "prefill=64/32/4/3/48",
                "prefill=64/32/4/3/16/1", "no_such=1", "decode_rotary_in_attention=maybe", "reduce_num_warps", "reduce_num_warps=4.5"):
        with pytest.raises(ValueError, match="PODIUM_CUDA_TUNING"):
            tuning_from_env(bad, base)
