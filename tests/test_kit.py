"""The conformance kit's checks, in process: correct platforms pass, each planted bug is caught and named."""

from __future__ import annotations

import pytest
import torch

from podium_plugin_api import (
    AttentionBackend,
    Capabilities,
    GraphRunner,
    MemoryInfo,
    Platform,
    PluginApiDeprecationWarning,
    discovery,
    hookimpl,
    hookspec,
    hookspecs,
)
from podium_plugin_api.ops import REFERENCE_OPS, build_op_table
from podium_plugin_api.reference import reference_paged_attention
from podium_plugin_api.testing import ConformanceError, KitSetupError, find_platform
from podium_plugin_api.testing.attention_checks import check_attention, check_attention_rotary, check_graph_capture
from podium_plugin_api.testing.batches import ATTENTION_CASES
from podium_plugin_api.testing.generation import check_generation
from podium_plugin_api.testing.kv_cache_checks import check_allocation, check_layout, check_write_read, kit_spec
from podium_plugin_api.testing.op_checks import check_op
from podium_plugin_api.testing.platform_checks import (
    check_api_version,
    check_device_and_memory,
    check_distributed_backend,
)

CASES = {case.name: case for case in ATTENTION_CASES}
CPU = torch.device("cpu")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These tensors are tiny: extra threads only contend on a shared CI machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def platform_with(backend: AttentionBackend, **caps) -> Platform:
    class Stub(Platform):
        name = "stub"

        def attention_backend(self):
            return backend

        def capabilities(self):
            return Capabilities(**caps)

    return Stub()


# --- planted bugs -------------------------------------------------------------------------------


class NoSlidingWindow(AttentionBackend):
    def attend(self, layer, query, kv_cache, meta):
        k, v = self.split_cache(kv_cache)
        return reference_paged_attention(query, k, v, meta, scale=layer.scale, soft_cap=layer.soft_cap)


class WrongGqaGrouping(AttentionBackend):
    """Query head h reads kv head h % num_kv_heads instead of h // group."""

    def attend(self, layer, query, kv_cache, meta):
        group = layer.num_heads // layer.num_kv_heads
        order = torch.arange(layer.num_heads).reshape(layer.num_kv_heads, group).T.flatten()  # [H]
        inverse = torch.argsort(order)
        return super().attend(layer, query[:, order], kv_cache, meta)[:, inverse]


class DecodeMissesNewestToken(AttentionBackend):
    """Decodes attend to everything but the token just written (an off-by-one in the decode path)."""

    def attend(self, layer, query, kv_cache, meta):
        k, v = self.split_cache(kv_cache)
        lens = meta.seq_lens.clone()
        q_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
        shorter = torch.where((q_lens == 1) & (lens > 1), lens - 1, lens)
        out = torch.empty_like(query)
        starts = meta.query_start_loc.tolist()
        for i, n in enumerate(shorter.tolist()):
            lo, hi = starts[i], starts[i + 1]
            sub = type(meta).from_lengths([hi - lo], [n], [meta.block_tables[i].tolist()], k.shape[1])
            out[lo:hi] = reference_paged_attention(
                query[lo:hi], k, v, sub, scale=layer.scale, sliding_window=layer.sliding_window, soft_cap=layer.soft_cap
            )
        return out


class WritesPadding(AttentionBackend):
    """Forgets that slot -1 means 'skip': padding lands in the last slot of the cache."""

    def write_kv(self, kv_cache, key, value, slot_mapping):
        k, v = self.split_cache(kv_cache)
        flat_k, flat_v = k.flatten(0, 1), v.flatten(0, 1)  # [num_blocks * block_size, Hkv, D]
        flat_k[slot_mapping] = key.to(k.dtype)
        flat_v[slot_mapping] = value.to(v.dtype)


class HeadMajor(AttentionBackend):
    """A correct custom layout: [2, num_blocks, num_kv_heads, block_size, head_size], all methods agree."""

    def kv_cache_shape(self, spec, num_blocks):
        return (2, num_blocks, spec.num_kv_heads, spec.block_size, spec.head_size)

    def write_kv(self, kv_cache, key, value, slot_mapping):
        keep = slot_mapping >= 0
        blocks, offsets = slot_mapping[keep] // kv_cache.shape[3], slot_mapping[keep] % kv_cache.shape[3]
        kv_cache[0][blocks, :, offsets] = key[keep]
        kv_cache[1][blocks, :, offsets] = value[keep]

    def read_kv(self, kv_cache, slot_mapping):
        blocks, offsets = slot_mapping // kv_cache.shape[3], slot_mapping % kv_cache.shape[3]
        return kv_cache[0][blocks, :, offsets], kv_cache[1][blocks, :, offsets]

    def attend(self, layer, query, kv_cache, meta):
        k, v = kv_cache[0].transpose(1, 2), kv_cache[1].transpose(1, 2)  # default-layout views
        return reference_paged_attention(
            query, k, v, meta, scale=layer.scale, sliding_window=layer.sliding_window, soft_cap=layer.soft_cap
        )


class HeadMajorDefaultIndexing(AttentionBackend):
    """The broken example's bug: a new layout, the default indexing methods."""

    def kv_cache_shape(self, spec, num_blocks):
        return (2, num_blocks, spec.num_kv_heads, spec.block_size, spec.head_size)


# --- lookup ---------------------------------------------------------------------------------------


def test_lookup_finds_the_cpu_platform_through_entry_points():
    found = find_platform("cpu")
    assert found.platform.name == "cpu" and found.distribution == "podium-cpu"


def test_lookup_activates_the_platform_with_its_options(monkeypatch):
    monkeypatch.delenv("PODIUM_CPU_ATTENTION", raising=False)
    assert find_platform("cpu", {"attention": "torch"}).platform.attention_backend().name == "cpu-paged"
    monkeypatch.setenv("PODIUM_CPU_ATTENTION", "torch")  # the alias, as the engine reads it
    assert find_platform("cpu").platform.attention_backend().name == "cpu-paged"
    with pytest.raises(KitSetupError, match=r"attention='flash'.*choose one of auto, native, ipex, torch"):
        find_platform("cpu", {"attention": "flash"})
    with pytest.raises(KitSetupError, match=r"platform 'cpu' has no option 'tuning'; its options: amx, amx_plain_weights, attention, kv_cache_commit, linears"):
        find_platform("cpu", {"tuning": "decode=16/64/4/2"})


def test_lookup_of_an_unknown_platform_lists_the_installed_ones():
    with pytest.raises(KitSetupError, match=r"no platform named 'nope'") as info:
        find_platform("nope")
    assert "cpu (podium-cpu" in str(info.value) and "tpu (podium-tpu" in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="cuda is available here")
def test_lookup_of_an_unavailable_platform_gives_its_reason():
    with pytest.raises(KitSetupError, match=r"'cuda' \(podium-cuda [^)]*\) is installed but unavailable here: .*CUDA"):
        find_platform("cuda")


# --- attention ------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", [AttentionBackend(), HeadMajor()], ids=["default-layout", "head-major"])
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: c.name)
def test_correct_backends_pass_every_attention_case(backend, case):
    check_attention(platform_with(backend), backend, case, torch.float32)


def test_bfloat16_attention_passes_with_its_tolerance():
    backend = AttentionBackend()
    check_attention(platform_with(backend), backend, CASES["mixed-gqa"], torch.bfloat16)


def test_ignoring_the_sliding_window_is_caught_and_located():
    backend = NoSlidingWindow()
    check_attention(platform_with(backend), backend, CASES["mixed-gqa"], torch.float32)  # no window: fine
    with pytest.raises(ConformanceError) as info:
        check_attention(platform_with(backend), backend, CASES["sliding-window-small"], torch.float32)
    message = str(info.value)
    assert "sliding_window 8" in message and "forward vs reference_paged_attention" in message
    assert "max abs error" in message and "query [" in message
    # the first query past the window: sequence 0 is a decode at position 39, the first token of the batch
    assert "first difference at token 0 (sequence 0: 1 new over 39 cached, position 39)" in message


def test_wrong_gqa_grouping_is_caught_but_mha_is_unaffected():
    backend = WrongGqaGrouping()
    check_attention(platform_with(backend), backend, CASES["mha"], torch.float32)
    with pytest.raises(ConformanceError, match=r"GQA 8:2 heads.*max abs error"):
        check_attention(platform_with(backend), backend, CASES["mixed-gqa"], torch.float32)


def test_a_decode_off_by_one_is_caught():
    backend = DecodeMissesNewestToken()
    with pytest.raises(ConformanceError, match=r"decodes: .*first difference at token \d+ \(sequence \d+: 1 new over"):
        check_attention(platform_with(backend), backend, CASES["decodes"], torch.float32)


def test_forward_that_does_not_store_new_tokens_is_caught():
    class NoWrite(AttentionBackend):
        def forward(self, layer, query, key, value, kv_cache, meta):
            reference = AttentionBackend()
            scratch = kv_cache.clone()
            reference.write_kv(scratch, key, value, meta.slot_mapping)
            return reference.attend(layer, query, scratch, meta)

    backend = NoWrite()
    with pytest.raises(ConformanceError, match="forward did not store the new tokens' keys at slot_mapping"):
        check_attention(platform_with(backend), backend, CASES["mixed-gqa"], torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_default_and_the_cpu_forward_rotary_pass(dtype):
    from podium_cpu import CpuPlatform

    check_attention_rotary(platform_with(AttentionBackend()), AttentionBackend(), CASES["mixed-gqa"], dtype)
    cpu = CpuPlatform()
    for case in ATTENTION_CASES:  # the native backend fuses the rotation for its short-sequence steps
        check_attention_rotary(cpu, cpu.attention_backend(), case, dtype)


def test_forward_rotary_that_skips_the_rotation_is_caught():
    class NoRotation(AttentionBackend):
        def forward_rotary(self, layer, query, key, value, kv_cache, meta, rotary):
            return self.forward(layer, query, key, value, kv_cache, meta)

    backend = NoRotation()
    with pytest.raises(ConformanceError, match=r"forward_rotary vs rotary_embedding \+ forward.*max abs error"):
        check_attention_rotary(platform_with(backend), backend, CASES["decodes"], torch.float32)


# --- KV cache -------------------------------------------------------------------------------------


def test_cache_checks_accept_a_consistent_custom_layout():
    backend = HeadMajor()
    platform = platform_with(backend)
    for check in (check_allocation, check_layout, check_write_read):
        check(platform, backend, kit_spec(torch.float32))


def test_a_new_layout_with_default_indexing_is_called_a_wrong_cache_layout():
    backend = HeadMajorDefaultIndexing()
    platform = platform_with(backend)
    check_allocation(platform, backend, kit_spec(torch.float32))  # allocation itself is consistent
    with pytest.raises(
        ConformanceError,
        match=r"wrong cache layout: kv_cache_shape\(spec, num_blocks=7\) is \[2, 7, 2, 16, 64\]"
        r".*default write_kv, read_kv, attend.*\[7, 16, 2, 64\]",
    ):
        check_layout(platform, backend, kit_spec(torch.float32))


def test_writing_padding_slots_is_caught_at_the_slot_it_clobbers():
    backend = WritesPadding()
    with pytest.raises(ConformanceError, match=r"KV write by slot mapping.*slot 111 \(block 6, offset 15\)"):
        check_write_read(platform_with(backend), backend, kit_spec(torch.float32))


def test_layers_sharing_one_tensor_are_caught():
    class Shared(Platform):
        def allocate_kv_cache(self, spec, num_blocks):
            one = torch.zeros(AttentionBackend().kv_cache_shape(spec, num_blocks), dtype=spec.dtype)
            return [one] * spec.num_layers

    with pytest.raises(ConformanceError, match="layers share storage"):
        check_allocation(Shared(), AttentionBackend(), kit_spec(torch.float32))


def test_a_cache_in_the_wrong_dtype_is_caught():
    class AlwaysFloat32(Platform):
        def allocate_kv_cache(self, spec, num_blocks):
            shape = AttentionBackend().kv_cache_shape(spec, num_blocks)
            return [torch.zeros(shape) for _ in range(spec.num_layers)]

    with pytest.raises(ConformanceError, match="layer 0 has dtype float32, expected bfloat16"):
        check_allocation(AlwaysFloat32(), AttentionBackend(), kit_spec(torch.bfloat16))


# --- graph capture --------------------------------------------------------------------------------


class RerunRunner(GraphRunner):
    def capture(self, fn):
        fn()
        return fn


class StaleRunner(GraphRunner):
    """Replays the outputs of capture time without recomputing: what a broken capture looks like."""

    def capture(self, fn):
        outputs = fn()
        return lambda: outputs


def test_graph_replay_that_recomputes_passes():
    platform = platform_with(AttentionBackend(), graph_capture=True)
    platform.graph_runner = RerunRunner
    check_graph_capture(platform, platform.attention_backend(), torch.float32)


def test_stale_graph_replay_is_caught():
    platform = platform_with(AttentionBackend(), graph_capture=True)
    platform.graph_runner = StaleRunner
    with pytest.raises(ConformanceError, match=r"replay 1 .*vs eager forward.*max abs error"):
        check_graph_capture(platform, platform.attention_backend(), torch.float32)


def test_claiming_graph_capture_without_a_runner_is_caught():
    platform = platform_with(AttentionBackend(), graph_capture=True)
    with pytest.raises(ConformanceError, match="graph_capture is True but graph_runner"):
        check_graph_capture(platform, platform.attention_backend(), torch.float32)


# --- ops, platform facts --------------------------------------------------------------------------


def test_correct_op_overrides_pass():
    def silu_and_mul(x):
        half = x.shape[-1] // 2
        return torch.nn.functional.silu(x[..., :half]) * x[..., half:]

    for dtype in (torch.float32, torch.bfloat16):
        check_op("silu_and_mul", silu_and_mul, dtype, CPU, "test")
        for name, fn in REFERENCE_OPS.items():
            check_op(name, fn, dtype, CPU, "test")


def test_a_wrong_op_override_is_caught_with_its_error():
    def gelu_and_mul(x):
        half = x.shape[-1] // 2
        return torch.nn.functional.gelu(x[..., :half]) * x[..., half:]

    with pytest.raises(
        ConformanceError,
        match=r"custom op silu_and_mul from platform.custom_ops\(\) \(float32; arguments \[7, 192\]\).*max abs error",
    ):
        check_op("silu_and_mul", gelu_and_mul, torch.float32, CPU, "platform.custom_ops()")


def test_a_one_row_fast_path_that_drops_the_bias_or_the_residual_is_caught():
    """The *_linear ops run at 1, 2 and 7 rows: a bug only in a batch-1 kernel cannot hide."""
    good = REFERENCE_OPS["rms_norm_linear"]

    def no_bias_at_one_row(x, residual, weight, eps, linear):
        if x.shape[0] == 1:
            return good(x, residual, weight, eps, lambda h: h @ linear.weight.T)
        return good(x, residual, weight, eps, linear)

    def residual_not_returned(x, residual, weight, eps, linear):
        out, _ = good(x, residual, weight, eps, linear)
        return out, x

    with pytest.raises(ConformanceError, match=r"rms_norm_linear .*arguments \[1, 96\], None, \[96\], 1e-06, "
                                               r"Linear\(96, 40, bias=True\)\).*max abs error"):
        check_op("rms_norm_linear", no_bias_at_one_row, torch.float32, CPU, "test")
    with pytest.raises(ConformanceError, match=r"rms_norm_linear .*arguments \[1, 96\], \[1, 96\].*output 1"):
        check_op("rms_norm_linear", residual_not_returned, torch.float32, CPU, "test")

    def gelu_down(x, linear):
        half = x.shape[-1] // 2
        return linear(torch.nn.functional.gelu(x[..., :half]) * x[..., half:])

    with pytest.raises(ConformanceError, match=r"silu_and_mul_linear .*arguments \[1, 192\]"):
        check_op("silu_and_mul_linear", gelu_down, torch.float32, CPU, "test")


def test_the_composite_ops_use_the_tables_own_primitives():
    """A platform that fuses only rms_norm gets it inside rms_norm_linear too (build_op_table)."""
    calls = []

    def counted_rms_norm(x, weight, eps):
        calls.append(x.shape)
        return REFERENCE_OPS["rms_norm"](x, weight, eps)

    table = build_op_table({"rms_norm": counted_rms_norm})
    linear = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8)
    out, residual = table["rms_norm_linear"](x, None, torch.ones(8), 1e-6, linear)
    assert calls == [(3, 8)] and residual is x
    torch.testing.assert_close(out, linear(REFERENCE_OPS["rms_norm"](x, torch.ones(8), 1e-6)))
    overriding = build_op_table({"rms_norm": counted_rms_norm, "rms_norm_linear": good_rms_norm_linear})
    assert overriding["rms_norm_linear"] is good_rms_norm_linear


def good_rms_norm_linear(x, residual, weight, eps, linear):
    return REFERENCE_OPS["rms_norm_linear"](x, residual, weight, eps, linear)


def test_top_k_off_by_one_is_caught_naming_the_row():
    def top_k_plus_one(logits, top_k, top_p):
        return REFERENCE_OPS["top_k_top_p"](logits, torch.where(top_k > 0, top_k + 1, top_k), top_p)

    with pytest.raises(
        ConformanceError, match=r"row 1 \(top_k=1, top_p=1.0\) keeps tokens \[\d+, \d+\], the reference keeps \[\d+\]"
    ):
        check_op("top_k_top_p", top_k_plus_one, torch.float32, CPU, "test")


def test_an_argmax_taking_the_last_tie_or_skipping_nan_is_caught():
    from podium.sampler import first_argmax

    def last_tie(logits):  # the last index of the maximum
        return logits.shape[-1] - 1 - logits.flip(-1).argmax(dim=-1)

    def nan_blind(logits):
        return torch.nan_to_num(logits, nan=float("-inf")).argmax(dim=-1)

    for wrong in (last_tie, nan_blind):
        with pytest.raises(ConformanceError, match=r"custom op argmax from test .*the reference \(first index"):
            check_op("argmax", wrong, torch.float32, CPU, "test")
    for dtype in (torch.float32, torch.bfloat16):
        check_op("argmax", first_argmax, dtype, CPU, "test")  # the core's chunked CPU argmax


def test_an_unknown_op_name_is_caught():
    with pytest.raises(ConformanceError, match="overrides unknown op 'gelu_tanh'"):
        check_op("gelu_tanh", lambda x: x, torch.float32, CPU, "platform.custom_ops()")


def test_distributed_backend_names():
    for name in ("gloo", "nccl", "xla", "hccl"):
        check_distributed_backend(Capabilities(distributed_backend=name))
    with pytest.raises(ConformanceError, match=r"distributed_backend is 'cuda', not a torch.distributed backend"):
        check_distributed_backend(Capabilities(distributed_backend="cuda"))


def test_memory_and_version_facts():
    check_device_and_memory(Platform())

    class Inverted(Platform):
        def memory_info(self):
            return MemoryInfo(free_bytes=2, total_bytes=1)

    with pytest.raises(ConformanceError, match="free=2, total=1"):
        check_device_and_memory(Inverted())

    class Nameless(Platform):
        def device_key(self, index=0):
            return ""

    with pytest.raises(ConformanceError, match=r"device_key\(0\) returned ''"):
        check_device_and_memory(Nameless())

    class Future(Platform):
        api_version = "3.0.0"

    with pytest.raises(ConformanceError, match=r"Platform.api_version '3.0.0': .*major versions differ"):
        check_api_version(Future())


# --- end to end -----------------------------------------------------------------------------------


def test_tiny_generation_on_the_reference_platform_matches():
    check_generation(Platform(), torch.float32)


def test_tiny_generation_catches_a_decode_bug_and_names_the_sequence_and_position():
    backend = DecodeMissesNewestToken()
    with pytest.raises(
        ConformanceError,
        match=r"sequence \d \(prompt of \d+ tokens\) differs from the CPU float64 "
        r"reference at generated position \d+ .*max abs error",
    ):
        check_generation(platform_with(backend), torch.float32)


def test_tiny_generation_uses_the_platforms_custom_ops():
    def broken_rms_norm(x, weight, eps):
        return REFERENCE_OPS["rms_norm"](x, weight, eps) * 1.5

    with pytest.raises(ConformanceError, match="differs from the CPU float64 reference"):
        check_generation(Platform(), torch.float32, ops={"rms_norm": broken_rms_norm})


def test_lookup_reports_deprecated_hooks_naming_the_distribution(monkeypatch):
    @hookspec(warn_on_impl=PluginApiDeprecationWarning("podium_old_hook is deprecated; use podium_new_hook"))
    def podium_old_hook():
        """A deprecated hook (test-only)."""

    class OldPlugin:
        @hookimpl
        def podium_old_hook(self):
            return 1

    monkeypatch.setattr(hookspecs, "podium_old_hook", podium_old_hook, raising=False)
    installed = discovery._candidates
    monkeypatch.setattr(discovery, "_candidates",
                        lambda extra: [*installed(extra), ("old", OldPlugin(), ("podium-old-npu", "0.2.0"))])
    assert find_platform("cpu").deprecations == (
        "podium plugin podium-old-npu 0.2.0: podium_old_hook is deprecated; use podium_new_hook",)


class _Fp8Backend(AttentionBackend):
    name = "fp8-listing"

    def kv_cache_dtypes(self, model_dtype):
        return (model_dtype, torch.float8_e4m3fn, torch.float8_e5m2)


class _UnsaturatedFp8Backend(_Fp8Backend):
    """Planted bug: a plain cast on store, so e5m2 overflows to infinity instead of saturating."""

    def write_kv(self, kv_cache, key, value, slot_mapping):
        block_size = kv_cache.shape[2]
        kv_cache[0][slot_mapping // block_size, slot_mapping % block_size] = key.to(kv_cache.dtype)
        kv_cache[1][slot_mapping // block_size, slot_mapping % block_size] = value.to(kv_cache.dtype)


class _Fp8ReadsRawBytesBackend(_Fp8Backend):
    """Planted bug: attention reads an fp8 cache's bytes as integers."""

    def attend(self, layer, query, kv_cache, meta):
        raw = kv_cache.view(torch.uint8).to(query.dtype)
        return reference_paged_attention(query, raw[0], raw[1], meta, scale=layer.scale)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_kit_fp8_cache_check_passes_the_reference_and_the_cpu_backend(cache_dtype):
    from podium_cpu import CpuPlatform
    from podium_plugin_api.testing.kv_cache_checks import check_cache_dtype, extra_cache_dtypes

    assert extra_cache_dtypes(AttentionBackend(), torch.float32) == []
    check_cache_dtype(Platform(), _Fp8Backend(), torch.bfloat16, cache_dtype)
    cpu = CpuPlatform()
    assert cache_dtype in extra_cache_dtypes(cpu.attention_backend(), torch.bfloat16)
    check_cache_dtype(cpu, cpu.attention_backend(), torch.bfloat16, cache_dtype)


@pytest.mark.parametrize("backend,message", [(_UnsaturatedFp8Backend(), "write_kv then read_kv.*keys"),
                                             (_Fp8ReadsRawBytesBackend(), "attend over a float8_e4m3fn cache")])
def test_kit_fp8_cache_check_names_planted_bugs(backend, message):
    from podium_plugin_api.testing.kv_cache_checks import check_cache_dtype

    dtype = torch.float8_e5m2 if isinstance(backend, _UnsaturatedFp8Backend) else torch.float8_e4m3fn
    with pytest.raises(ConformanceError, match=message):
        check_cache_dtype(Platform(), backend, torch.bfloat16, dtype)
