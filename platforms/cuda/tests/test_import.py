"""Importing the CUDA plugin is cheap and safe everywhere: no triton import, no CUDA needed, no side
effect until the platform is activated; its options are validated, naming what is allowed."""

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


ACTIVATE = """
import os, podium_cuda
from podium_plugin_api import resolve_options
platform = podium_cuda.CudaPlatform()
print("CREATED", os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
platform.activate(resolve_options("cuda", platform.options()))
print("ACTIVATED", os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
"""


def test_activation_not_creation_turns_off_the_cublas_workspace_unless_the_user_set_one():
    for preset, want in ((None, ":0:0"), (":4096:8", ":4096:8")):
        env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
        if preset is not None:
            env["CUBLAS_WORKSPACE_CONFIG"] = preset
        run = subprocess.run([sys.executable, "-c", ACTIVATE], capture_output=True, text=True, timeout=120, env=env)
        assert run.returncode == 0, run.stderr
        assert f"CREATED {preset}" in run.stdout and f"ACTIVATED {want}" in run.stdout, run.stdout


def test_a_bad_tuning_alias_fails_activation_not_import_or_discovery():
    probe = ("import podium_cuda\nfrom podium_plugin_api import load_plugins, resolve_options\n"
             "platform = next(e.platform for e in load_plugins().platforms if e.name == 'cuda')\nprint('DISCOVERED')\n"
             "resolve_options('cuda', platform.options())\n")
    env = {**os.environ, "PODIUM_CUDA_TUNING": "decode=3"}
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert "DISCOVERED" in run.stdout and run.returncode != 0
    assert "PODIUM_CUDA_TUNING='decode=3' (the alias of platform 'cuda'\'s option 'tuning'): decode takes " \
           "block_m/block_n/num_warps/num_stages[/table_blocks]" in run.stderr


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


def test_fused_ops_option_names_known_ops_or_fails_clearly():
    import pytest

    from podium_cuda.tuning import parse_fused_ops

    assert parse_fused_ops("auto") is None and parse_fused_ops("") is None  # the tuning's list
    assert parse_fused_ops("rms_norm, argmax") == ("rms_norm", "argmax")
    assert parse_fused_ops("none") == ()
    with pytest.raises(ValueError, match=r"unknown op\(s\) \['rms_nrom'\]; ops: .*'rms_norm'"):
        parse_fused_ops("rms_nrom")


def test_the_platform_applies_its_options():
    from podium_cuda import CudaPlatform
    from podium_cuda.tuning import CUDA_TUNING
    from podium_plugin_api import resolve_options

    platform = CudaPlatform()
    assert platform.tuning() is CUDA_TUNING  # not activated: the table as written
    platform.activate(resolve_options("cuda", platform.options(), {"tuning": "reduce_num_warps=8,decode=16/128/8/3"}))
    tuning = platform.tuning()
    assert tuning.reduce_num_warps == 8 and tuning.decode.block_n == 128 and tuning.prefill == CUDA_TUNING.prefill


def test_tuning_option_sets_int_bool_and_tiling_fields_or_fails_clearly():
    import pytest

    from podium_cuda.tuning import parse_tuning

    assert parse_tuning("") == {}
    changed = parse_tuning("decode_rotary_in_attention=0, reduce_num_warps=8")
    assert changed == {"decode_rotary_in_attention": False, "reduce_num_warps": 8}
    tilings = parse_tuning("decode=16/128/8/3, fp8_decode=none")
    assert (tilings["decode"].block_n, tilings["decode"].num_warps, tilings["decode"].num_stages) == (128, 8, 3)
    assert tilings["fp8_decode"] is None and parse_tuning("fp8_decode=32/64/4/2")["fp8_decode"].block_m == 32
    assert tilings["decode"].table_blocks == 0 and parse_tuning("prefill=64/32/4/3/16")["prefill"].table_blocks == 16
    for bad in ("decode=3", "decode=none", "decode=16/24/4/2", "fp8_decode=16/32", "prefill=64/32/4/3/48",
                "prefill=64/32/4/3/16/1", "no_such=1", "decode_rotary_in_attention=maybe", "reduce_num_warps", "reduce_num_warps=4.5"):
        with pytest.raises(ValueError, match="takes|settable|must be"):
            parse_tuning(bad)


def test_gemm_plan_option_round_trips_and_fails_clearly():
    import pytest

    from podium_cuda.gemm_plan import CANDIDATES, DEFAULT_TILING, GemmPlan, GemmTiling
    from podium_cuda.tuning import CUDA_TUNING, INVARIANT_GEMM_PLAN, parse_tuning

    text = "tma/128/256/64/8/3; 6144:4096=tma/64/128/64/4/4 ;4096:14336=128/64/64/8/3"
    plan = parse_tuning(f"invariant_gemm={text.upper()}, reduce_num_warps=8")["invariant_gemm"]
    assert plan.default == GemmTiling(128, 256, 64, 8, 3, kernel="tma")
    assert plan.entry(6144, 4096) == GemmTiling(64, 128, 64, 4, 4, kernel="tma")
    assert plan.entry(4096, 14336).kernel == "tiles" and plan.entry(4096, 4096) is None
    assert GemmPlan.parse(plan.text()) == plan
    assert GemmPlan.parse("6144:4096=tma/64/128/64/4/4").default == DEFAULT_TILING  # the default when omitted
    assert CUDA_TUNING.invariant_gemm == GemmPlan.parse(INVARIANT_GEMM_PLAN)
    assert all(GemmTiling.parse(t.text()) == t for t in CANDIDATES)
    for bad in ("invariant_gemm=tma/128/128/64/8", "invariant_gemm=wgmma/128/128/64/8/3", "invariant_gemm=128/96/64/8/3",
                "invariant_gemm=6144=tma/64/128/64/4/4", "invariant_gemm=1:2=tma/64/128/64/4/4;1:2=64/64/64/4/4"):
        with pytest.raises(ValueError, match="invariant_gemm: .*(tiling is|must be|shape entry|twice)"):
            parse_tuning(bad)
