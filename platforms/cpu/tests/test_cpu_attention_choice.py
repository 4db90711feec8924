"""The attention option (alias PODIUM_CPU_ATTENTION): which attention backend the CPU platform runs,
forced or automatic.

Runs in `make test` (no IPEX: forcing ipex is an error naming the missing package) and in
`make test-ipex` (IPEX imports: forcing it gives IPEX's backend; test_cpu_engine runs SmolLM2
through it and the conformance kit runs with it there).
"""

from __future__ import annotations

import os

import pytest

from podium.commands.platforms import format_table, platform_rows
from podium_cpu import CpuPlatform, ipex_support, native_kernels
from podium_cpu.ipex_support import ipex_status
from podium_cpu.platform import ATTENTION_ENV
from podium_plugin_api import resolve_options

EXPECTED_NAMES = {"native": "cpu-paged-native", "torch": "cpu-paged", "ipex": "cpu-ipex"}


def activated(given: dict | None = None) -> CpuPlatform:
    """A CPU platform activated as the engine does: ``given`` options, then the alias, then defaults."""
    platform = CpuPlatform()
    platform.activate(resolve_options("cpu", platform.options(), given))
    return platform


def backend_name(monkeypatch, value: str | None) -> str:
    """The backend chosen when the alias is ``value`` (None: unset)."""
    if value is None:
        monkeypatch.delenv(ATTENTION_ENV, raising=False)
    else:
        monkeypatch.setenv(ATTENTION_ENV, value)
    return activated().attention_backend().name


def ipex_loads() -> bool:
    if ipex_status()[0] is None and os.environ.get("PODIUM_EXPECT_IPEX"):
        pytest.fail(f"intel_extension_for_pytorch did not load: {ipex_status()[1] or 'not installed'}")
    return ipex_status()[0] is not None


@pytest.mark.parametrize("value", ["native", "torch", " Torch ", "NATIVE"])
def test_forced_backend_runs(monkeypatch, value):
    assert backend_name(monkeypatch, value) == EXPECTED_NAMES[value.strip().lower()]
    assert "forced by the attention option" in activated().attention_note


@pytest.mark.parametrize("value", [None, "", "auto"])
def test_auto_prefers_the_native_kernel(monkeypatch, value):
    assert backend_name(monkeypatch, value) == "cpu-paged-native"
    assert activated().attention_note == ""


def test_the_option_wins_over_its_alias_and_a_new_activation_takes_effect(monkeypatch):
    monkeypatch.setenv(ATTENTION_ENV, "torch")
    platform = activated({"attention": "native"})
    assert platform.attention_backend().name == "cpu-paged-native"
    platform.activate(resolve_options("cpu", platform.options(), {"attention": "torch"}))
    assert platform.attention_backend().name == "cpu-paged" and not platform.capabilities().graph_capture


def test_creating_the_platform_reads_no_environment(monkeypatch):
    monkeypatch.setenv(ATTENTION_ENV, "flash")  # a bad alias fails activation, never creation
    assert CpuPlatform().attention_backend().name == "cpu-paged-native"  # not activated: the default


def test_auto_without_a_compiler_takes_ipex_else_torch(monkeypatch):
    monkeypatch.setattr(native_kernels, "COMPILERS", ("no-such-compiler-podium",))
    monkeypatch.setattr(native_kernels, "_LOADED", {})
    monkeypatch.delenv(ATTENTION_ENV, raising=False)
    platform = activated()
    assert platform.attention_backend().name == ("cpu-ipex" if ipex_loads() else "cpu-paged")
    assert "no C compiler" in platform.attention_note


def test_forced_native_without_a_compiler_is_an_error(monkeypatch):
    monkeypatch.setattr(native_kernels, "COMPILERS", ("no-such-compiler-podium",))
    monkeypatch.setattr(native_kernels, "_LOADED", {})
    with pytest.raises(RuntimeError, match=r"attention option is native, but the native kernels did not load.*"
                                           r"no C compiler"):
        backend_name(monkeypatch, "native")


def test_forced_ipex(monkeypatch):
    if ipex_loads():
        assert backend_name(monkeypatch, "ipex") == "cpu-ipex"
        return
    with pytest.raises(RuntimeError, match=r"attention option is ipex, but intel_extension_for_pytorch is not "
                                           r"installed"):
        backend_name(monkeypatch, "ipex")


def test_forced_ipex_that_fails_to_import_says_why(monkeypatch):
    monkeypatch.setattr(ipex_support, "_STATUS", {"ipex": (None, "intel_extension_for_pytorch is installed but "
                                                                  "failed to import (ImportError: boom)")})
    with pytest.raises(RuntimeError, match=r"failed to import \(ImportError: boom\)"):
        backend_name(monkeypatch, "ipex")


def test_unknown_value_names_the_option_and_the_choices(monkeypatch):
    with pytest.raises(ValueError, match=r"PODIUM_CPU_ATTENTION='flash' \(the alias of platform 'cpu'\'s option "
                                         r"'attention'\): 'flash' is not allowed; choose one of auto, native, ipex, torch"):
        backend_name(monkeypatch, "flash")
    with pytest.raises(ValueError, match=r"platform option attention='flash' \('cpu'\).*auto, native, ipex, torch"):
        activated({"attention": "flash"})


def test_platforms_verbose_shows_the_option(monkeypatch):
    monkeypatch.setenv(ATTENTION_ENV, "torch")
    rows, _ = platform_rows("cpu")
    table = format_table(rows, verbose=True)
    assert "option attention=torch  [str (auto|native|ipex|torch), default 'auto'; alias $PODIUM_CPU_ATTENTION]" in table
    monkeypatch.setenv(ATTENTION_ENV, "flash")
    rows, _ = platform_rows("cpu")  # a bad value is shown, not fatal to the listing
    assert "option attention=invalid: PODIUM_CPU_ATTENTION='flash'" in format_table(rows, verbose=True)
