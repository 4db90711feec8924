"""The plugin API's version contract: semantic version, refusal of incompatible plugins, deprecations,
and hooks that gain arguments without breaking plugins written against the older signature."""

from __future__ import annotations

import re
from importlib.metadata import version

import pytest
import torch

from podium_plugin_api import (
    API_VERSION,
    Platform,
    PluginApiDeprecationWarning,
    compatibility_problem,
    hookimpl,
    hookspec,
    hookspecs,
    parse_version,
)
from podium_plugin_api.discovery import PluginError, load_plugins


def test_api_version_is_semantic_and_matches_the_distribution():
    major, minor, _ = parse_version(API_VERSION)
    assert API_VERSION.count(".") == 2
    assert parse_version(version("podium-plugin-api"))[:2] == (major, minor)
    assert Platform.api_version == API_VERSION  # a plugin that declares nothing targets this API


def test_the_contract_is_2_8_and_2_0_to_2_7_plugins_still_load():
    """1.x plugins (the contract before its renovation) are refused with the major-version reason; 2.1
    added tensor parallelism's pieces (rank_device, communicator), 2.2 quantization methods and the
    GGUF/fp8 ops (references as defaults), 2.3 the batch-invariant mode (Capabilities.batch_invariant,
    use_batch_invariant_kernels), 2.4 the apply_token_bitmask, int4_linear and batched LoRA ops
    (references as defaults), 2.5 quantized layers naming their op (quantized_call), 2.6 LoRAMapping.num_slotted_rows, 2.7
    Platform.device_key, 2.8 the AWQ_MMA INT4 layout, so plugins built for 2.0 to 2.7 keep running."""
    assert API_VERSION == "2.8.0"
    assert "major versions differ" in compatibility_problem("1.6", API_VERSION)
    assert compatibility_problem("2.0", API_VERSION) is None
    assert compatibility_problem("2.1.0", API_VERSION) is None
    assert compatibility_problem("2.2", API_VERSION) is None
    assert compatibility_problem("2.3", API_VERSION) is None
    assert compatibility_problem("2.4", API_VERSION) is None
    assert compatibility_problem("2.5", API_VERSION) is None
    assert compatibility_problem("2.6", API_VERSION) is None
    assert compatibility_problem("2.7", API_VERSION) is None
    assert "needs plugin API 2.9" in compatibility_problem("2.9", API_VERSION)


@pytest.mark.parametrize("plugin", ["1.0", "1.0.7", "1.2.0", "1.3"])
def test_same_major_with_an_older_or_equal_minor_is_accepted(plugin):
    assert compatibility_problem(plugin, "1.3.0") is None


@pytest.mark.parametrize(
    ("plugin", "expected"),
    [
        ("2.0.0", r"built for plugin API 2.0.0 but this Podium provides 1.3.0 \(major versions differ\)"),
        ("0.9", r"built for plugin API 0.9 but this Podium provides 1.3.0"),
        ("1.4", r"needs plugin API 1.4 but this Podium provides only 1.3.0; upgrade podium-plugin-api and podium"),
        ("one", r"not a semantic version: 'one'"),
    ],
)
def test_incompatible_versions_say_why(plugin, expected):
    assert compatibility_problem(plugin, "1.3.0") is not None
    assert re.search(expected, compatibility_problem(plugin, "1.3.0"))


def plugin_for(api_version: str):
    class OldNpu(Platform):
        name = "old-npu"

    OldNpu.api_version = api_version

    class Plugin:
        @hookimpl
        def podium_platforms(self):
            return [OldNpu]

    return Plugin()


def test_core_refuses_an_incompatible_major_naming_plugin_versions_and_fix():
    old_major = f"{parse_version(API_VERSION)[0] - 1}.9"
    with pytest.raises(PluginError) as info:
        load_plugins(extra_plugins={"podium-old-npu": plugin_for(old_major)})
    message = str(info.value)
    assert "podium plugin podium-old-npu" in message and "platform 'old-npu'" in message
    assert old_major in message and API_VERSION in message
    assert f"install a plugin release built for API {parse_version(API_VERSION)[0]}.x" in message


def test_core_accepts_a_plugin_declaring_the_current_major():
    plugins = load_plugins(extra_plugins={"podium-old-npu": plugin_for(f"{parse_version(API_VERSION)[0]}.0")})
    assert "old-npu" in [e.name for e in plugins.platforms]


# --- deprecation: pluggy's warn_on_impl, surfaced by the core naming the distribution ---------------


@hookspec(
    warn_on_impl=PluginApiDeprecationWarning("podium_legacy_ops is deprecated; return ops from Platform.custom_ops")
)
def podium_legacy_ops() -> dict:
    """A hook the API is phasing out (test-only: the real API has no deprecated hook yet)."""


class LegacyPlugin:
    @hookimpl
    def podium_legacy_ops(self):
        return {"silu_and_mul": None}


def test_implementing_a_deprecated_hook_warns_naming_the_plugin_and_still_works(monkeypatch):
    monkeypatch.setattr(hookspecs, "podium_legacy_ops", podium_legacy_ops, raising=False)
    with pytest.warns(PluginApiDeprecationWarning) as caught:
        plugins = load_plugins(extra_plugins={"podium-legacy": LegacyPlugin()})
    messages = [str(w.message) for w in caught]
    assert any(
        m.startswith("podium plugin podium-legacy ") and "podium_legacy_ops is deprecated" in m for m in messages
    )
    assert caught[0].filename == __file__  # pointed at the plugin's implementation, not at the core
    assert plugins.manager.hook.podium_legacy_ops() == [{"silu_and_mul": None}]
    assert any("podium_legacy_ops is deprecated" in m for m in plugins.deprecations)  # for the kit


def test_plugins_without_deprecated_hooks_do_not_warn(recwarn):
    load_plugins()
    assert not [w for w in recwarn if issubclass(w.category, PluginApiDeprecationWarning)]


# --- adding an argument to a hook breaks no plugin ------------------------------------------------


class TinyModel(torch.nn.Module):
    pass


class WrittenForAnOlderSignature:
    """Implements podium_model_architectures exactly as the spec declares it today (no arguments)."""

    @hookimpl
    def podium_model_architectures(self):
        return {"TinyForCausalLM": TinyModel}


@hookspec
def podium_model_architectures_2_1(platform, dtype) -> dict:
    """podium_model_architectures as a later minor version might declare it, with two more arguments."""


def test_a_spec_that_gains_arguments_still_calls_the_older_impl(monkeypatch):
    monkeypatch.setattr(hookspecs, "podium_model_architectures", podium_model_architectures_2_1)
    plugins = load_plugins(extra_plugins={"written-for-2.0": WrittenForAnOlderSignature()})
    hook = plugins.manager.hook.podium_model_architectures
    assert hook.spec.argnames == ("platform", "dtype")
    assert {"TinyForCausalLM": TinyModel} in hook(platform=Platform(), dtype=torch.float16)


def test_an_impl_declaring_some_of_the_arguments_gets_those(monkeypatch):
    monkeypatch.setattr(hookspecs, "podium_model_architectures", podium_model_architectures_2_1)

    class WrittenFor2_1:
        @hookimpl
        def podium_model_architectures(self, platform):
            return {"TinyForCausalLM": TinyModel} if isinstance(platform, Platform) else {}

    plugins = load_plugins(extra_plugins={"written-for-2.1": WrittenFor2_1()})
    assert {"TinyForCausalLM": TinyModel} in plugins.manager.hook.podium_model_architectures(
        platform=Platform(), dtype=torch.float16)
