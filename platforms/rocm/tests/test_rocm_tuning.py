"""The ROCm tuning table reaches podium-cuda's kernel launches, checked without a GPU or triton;
importing the plugin does not import triton.

A subprocess puts a recording stand-in for triton in ``sys.modules`` before podium_cuda's kernel
modules import: ``kernel[grid](...)`` then records the grid and keyword arguments (block sizes,
num_warps, num_stages) instead of compiling. The ROCm platform's attention backend and fused ops
run one step on CPU tensors, so every launch podium_cuda's launchers make is seen as the GPU
would get it; the CUDA platform runs the same step for contrast.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from podium_cuda.tuning import CUDA_TUNING, plan_splits
from podium_rocm.tuning import ROCM_TUNING

PROBE = r"""
import json, sys, types

# 1. importing the plugin and asking it everything but its kernels must not import triton
import podium_rocm, podium_rocm.hooks
platform = podium_rocm.RocmPlatform()
platform.availability(), platform.capabilities(), platform.tuning()
triton_after_import = sorted(name for name in sys.modules if name == "triton" or name.startswith("triton."))

# 2. a recording stand-in for triton, then one step through each platform's kernels
launches = []

class RecordingKernel:
    def __init__(self, fn):
        self.name = fn.__name__

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            scalars = {k: v for k, v in kwargs.items() if isinstance(v, (bool, int, float, str))}
            launches.append({"kernel": self.name, "grid": list(grid), **scalars})
        return launch

class Language(types.ModuleType):
    def __getattr__(self, name):  # tl.constexpr(...), tl.float32, ...: placeholders, never run
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: None

triton = types.ModuleType("triton")
triton.jit = lambda fn=None, **options: RecordingKernel(fn) if fn else RecordingKernel
triton.cdiv = lambda a, b: -(-a // b)
triton.language = Language("triton.language")
sys.modules["triton"], sys.modules["triton.language"] = triton, triton.language

import torch
from podium_cuda import CudaPlatform
from podium_plugin_api import AttentionLayerSpec, AttentionMetadata
from podium_rocm import RocmPlatform

HEADS, KV_HEADS, HEAD, BLOCK = 8, 2, 64, 16

def step(platform, query_lens, seq_lens):
    backend = platform.attention_backend()
    blocks = [list(range(sum(-(-s // BLOCK) for s in seq_lens[:i]), sum(-(-s // BLOCK) for s in seq_lens[: i + 1])))
              for i in range(len(seq_lens))]
    meta = AttentionMetadata.from_lengths(query_lens, seq_lens, blocks, BLOCK)
    cache = torch.zeros(2, sum(map(len, blocks)), BLOCK, KV_HEADS, HEAD)
    q = torch.zeros(sum(query_lens), HEADS, HEAD)
    k = torch.zeros(sum(query_lens), KV_HEADS, HEAD)
    backend.forward(AttentionLayerSpec(HEADS, KV_HEADS, HEAD, HEAD ** -0.5), q, k, k.clone(), cache, meta)

def ops(platform):
    table = platform.custom_ops()
    x = torch.zeros(5, 96)
    table["rms_norm"](x, torch.ones(96), 1e-6)
    table["fused_add_rms_norm"](x, x.clone(), torch.ones(96), 1e-6)
    table["rotary_embedding"](torch.zeros(5, dtype=torch.long), torch.zeros(5, HEADS, HEAD),
                              torch.zeros(5, KV_HEADS, HEAD), torch.zeros(32, HEAD))
    table["silu_and_mul"](torch.zeros(5, 192))
    return sorted(table)

from podium_rocm.tuning import ROCM_TUNING
report = {"triton_after_import": triton_after_import, "tuning_is_the_table": RocmPlatform().tuning() == ROCM_TUNING}
for platform in (RocmPlatform(), CudaPlatform()):
    launches.clear()
    step(platform, [7, 1, 30], [7, 40, 50])  # a mixed step: prefill, decode, chunk over a prefix
    step(platform, [1], [4096])  # a long single decode: split over the keys
    names = ops(platform)
    backend = platform.attention_backend()
    report[platform.name] = {
        "backend": type(backend).__name__,
        "backend_tuning_is_platform_tuning": platform.name != "rocm" or backend.tuning == platform.tuning(),
        "ops": names,
        "launches": list(launches),
    }
report["triton_is_the_stand_in"] = sys.modules["triton"] is triton
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def recorded() -> dict:
    # no GPU visible (on a GPU machine too): the platform then uses ROCM_TUNING exactly as written
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": ""}
    env.pop("PODIUM_ROCM_FORCE_ON_CUDA", None)
    run = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["triton_is_the_stand_in"]
    return report


def launches_of(report: dict, platform: str, kernel: str) -> list[dict]:
    return [launch for launch in report[platform]["launches"] if launch["kernel"] == kernel]


def test_rocm_backend_carries_the_platform_tuning(recorded):
    assert recorded["tuning_is_the_table"]  # no device seen: nothing fitted to a device's CU count
    assert recorded["rocm"]["backend"] == "RocmAttentionBackend"
    assert recorded["rocm"]["backend_tuning_is_platform_tuning"]
    assert recorded["rocm"]["ops"] == sorted(ROCM_TUNING.fused_ops)


def test_attention_launches_use_the_rocm_tiles(recorded):
    prefill, decode = launches_of(recorded, "rocm", "paged_attention_kernel")
    tiles = ROCM_TUNING.prefill, ROCM_TUNING.decode
    for launch, tiling, decoding in zip((prefill, decode), tiles, (False, True)):
        assert launch["IS_DECODE"] is decoding
        # head size 64 and a GQA group of 4: the launcher keeps the table's rows as they are
        assert (launch["BLOCK_M"], launch["BLOCK_N"]) == (tiling.block_m, tiling.block_n)
        assert (launch["num_warps"], launch["num_stages"]) == (tiling.num_warps, tiling.num_stages)
    assert prefill["BLOCK_Q"] == ROCM_TUNING.prefill.block_m // 4


def test_decode_splits_follow_the_rocm_split_policy(recorded):
    _, decode = launches_of(recorded, "rocm", "paged_attention_kernel")
    splits = plan_splits(1, 2, 4096, ROCM_TUNING.split)
    assert splits > 1 and decode["grid"] == [1, 2, splits] and decode["SPLIT"] is True
    (merge,) = launches_of(recorded, "rocm", "merge_splits_kernel")
    assert merge["NUM_SPLITS"] == splits and merge["num_warps"] == ROCM_TUNING.reduce_num_warps


def test_data_movement_launches_use_the_rocm_warps(recorded):
    writes = launches_of(recorded, "rocm", "write_kv_kernel")
    assert len(writes) == 2 and all(w["num_warps"] == ROCM_TUNING.kv_write_num_warps for w in writes)
    for kernel in ("rms_norm_kernel", "rotary_kernel", "silu_and_mul_kernel"):
        found = launches_of(recorded, "rocm", kernel)
        assert found and all(launch["num_warps"] == ROCM_TUNING.elementwise_num_warps for launch in found), kernel


def test_the_same_step_on_the_cuda_platform_launches_with_cudas_table(recorded):
    """Guards the probe itself: launch parameters come from each platform's table, not the probe."""
    cuda_prefill, cuda_decode = launches_of(recorded, "cuda", "paged_attention_kernel")
    for launch, tiling in ((cuda_prefill, CUDA_TUNING.prefill), (cuda_decode, CUDA_TUNING.decode)):
        assert (launch["BLOCK_M"], launch["BLOCK_N"]) == (tiling.block_m, tiling.block_n)
        assert (launch["num_warps"], launch["num_stages"]) == (tiling.num_warps, tiling.num_stages)
    assert cuda_decode["grid"][2] == plan_splits(1, 2, 4096, CUDA_TUNING.split)
    writes = launches_of(recorded, "cuda", "write_kv_kernel")
    assert all(w["num_warps"] == CUDA_TUNING.kv_write_num_warps for w in writes)
    assert recorded["cuda"]["launches"] != recorded["rocm"]["launches"]


def test_importing_podium_rocm_does_not_import_triton(recorded):
    assert recorded["triton_after_import"] == []
