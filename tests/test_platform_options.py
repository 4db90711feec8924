"""Typed platform options: declared by each platform, validated once at engine start, given by the CLI,
``LLM`` or an environment alias; the engine starts its platform through one plugin manager, activates
it before anything else, binds its device and refuses models whose attention it cannot run."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest
from engine_fixtures import run_engines_on
from model_fixtures import save_tiny_model
from torch import nn

import podium.platform_setup as platform_setup
from podium import LLM
from podium.config import EngineConfig
from podium.platform_setup import attention_specs, check_attention_support
from podium_cpu import CpuPlatform
from podium_cuda import CudaPlatform
from podium_plugin_api import AttentionLayerSpec, Capabilities, Platform, PlatformOption, resolve_options
from podium_plugin_api.options import parse_option_pairs
from podium_rocm import RocmPlatform
from podium_tpu import TpuPlatform

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "platform-options.md"
OPTIONS = (
    PlatformOption("kernel", str, "auto", "which kernel", choices=("auto", "fast", "safe"), env="NPU_KERNEL"),
    PlatformOption("warps", int, 4, "warps a program", env="NPU_WARPS"),
    PlatformOption("trace", bool, False, "log every launch"),
    PlatformOption("scale", float, 1.0, "a factor"),
    PlatformOption("ops", str, "", "op list", parse=lambda text: tuple(t for t in text.split(",") if t)),
)


# --- resolution --------------------------------------------------------------------------------


def test_defaults_aliases_and_explicit_values_in_that_order_of_precedence():
    values = resolve_options("npu", OPTIONS, {}, environ={})
    assert dict(values) == {"kernel": "auto", "warps": 4, "trace": False, "scale": 1.0, "ops": ()}
    values = resolve_options("npu", OPTIONS, {}, environ={"NPU_KERNEL": "fast", "NPU_WARPS": " 8 "})
    assert (values["kernel"], values["warps"]) == ("fast", 8)
    values = resolve_options("npu", OPTIONS, {"kernel": "SAFE", "warps": 2, "trace": "on", "scale": "0.5",
                                              "ops": "a,b"}, environ={"NPU_KERNEL": "fast"})
    assert dict(values) == {"kernel": "safe", "warps": 2, "trace": True, "scale": 0.5, "ops": ("a", "b")}
    with pytest.raises(TypeError):
        values["kernel"] = "fast"  # read-only


@pytest.mark.parametrize(("given", "environ", "message"), [
    ({"kernal": "fast"}, {}, r"platform 'npu' has no option 'kernal'; its options: kernel, ops, scale, trace, warps"),
    ({"kernel": "turbo"}, {}, r"platform option kernel='turbo' \('npu'\): 'turbo' is not allowed; choose one of "
                              r"auto, fast, safe"),
    ({"warps": "many"}, {}, r"platform option warps='many' \('npu'\): 'many' is not an integer"),
    ({"trace": "maybe"}, {}, r"'maybe' is not a switch; use one of 1/0, true/false, yes/no, on/off"),
    ({"warps": True}, {}, r"True is not an integer"),
    ({}, {"NPU_WARPS": "4.5"}, r"NPU_WARPS='4.5' \(the alias of platform 'npu'\'s option 'warps'\): '4.5' is not "
                               r"an integer"),
])
def test_bad_options_name_the_option_and_what_is_allowed(given, environ, message):
    with pytest.raises(ValueError, match=message):
        resolve_options("npu", OPTIONS, given, environ=environ)


def test_cli_pairs():
    assert parse_option_pairs(["attention=native", " tuning = decode=16/64/4/2 "]) == {
        "attention": "native", "tuning": "decode=16/64/4/2"}
    for bad, message in ((["attention"], "takes NAME=VALUE"), (["=x"], "takes NAME=VALUE"),
                         (["a=1", "a=2"], "given twice")):
        with pytest.raises(ValueError, match=message):
            parse_option_pairs(bad)


def test_a_platform_option_needs_a_plain_type():
    with pytest.raises(TypeError, match="type must be one of bool, int, float, str"):
        PlatformOption("x", list, [], "no")
    with pytest.raises(TypeError, match="choices need type str"):
        PlatformOption("x", int, 1, "no", choices=("1",))


# --- the one table in the docs -------------------------------------------------------------------

BUILT_IN = {"cpu": CpuPlatform, "cuda": CudaPlatform, "rocm": RocmPlatform, "tpu": TpuPlatform}


def doc_rows(section: str) -> list[list[str]]:
    text = DOC.read_text().split(f"## {section}")[1].split("\n## ")[0]
    return [[cell.strip().strip("`") for cell in line.strip("|").split("|")]
            for line in text.splitlines() if line.startswith("| ") and not line.startswith("| ---")][1:]


def test_the_docs_list_every_built_in_option_with_its_default():
    documented = {(platform, row[1]): row[3] for row in doc_rows("Options of the platforms in this repository")
                  for platform in row[0].split(", ")}
    declared = {(name, o.name): o for name, cls in BUILT_IN.items() for o in cls().options()}
    assert set(documented) == set(declared)
    for key, option in declared.items():
        assert documented[key] in (str(option.default).lower(), "(none)" if option.default == "" else None), key


def test_the_docs_table_lists_every_environment_variable_the_code_reads():
    table = {row[0]: (row[1], row[2]) for row in doc_rows("Environment variables")}
    for cls in BUILT_IN.values():
        for option in cls().options():
            if option.env:
                assert table[option.env][0] == "alias" and f"`{option.name}`" in DOC.read_text()
    sources = [p for folder in ("core/src", "server/src", "plugin_api/src", "platforms") for p in
               (ROOT / folder).rglob("*.py")]
    used = {name for path in sources for name in re.findall(r"\bPODIUM_[A-Z_]+\b", path.read_text())}
    assert used <= set(table), f"not in docs/platform-options.md: {sorted(used - set(table))}"


# --- the engine --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny")
    save_tiny_model("llama", {"tie_word_embeddings": True}, folder)
    return str(folder)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("mistral")
    save_tiny_model("mistral", {"sliding_window": 5, "tie_word_embeddings": False}, folder)
    return str(folder)


def test_llm_takes_platform_options_and_validates_them_at_start(tiny, monkeypatch):
    monkeypatch.delenv("PODIUM_CPU_ATTENTION", raising=False)
    llm = LLM(tiny, device="cpu", dtype="float32", platform_options={"attention": "torch"}, enforce_eager=True)
    assert llm.engine.runner.backend.name == "cpu-paged"
    with pytest.raises(ValueError, match=r"platform 'cpu' has no option 'tuning'; its options: amx, amx_plain_weights, attention, kv_cache_commit, linears"):
        LLM(tiny, device="cpu", platform_options={"tuning": "decode=16/64/4/2"})
    with pytest.raises(ValueError, match=r"attention='flash' \('cpu'\).*choose one of auto, native, ipex, torch"):
        LLM(tiny, device="cpu", platform_options={"attention": "flash"})


def test_the_config_keeps_options_frozen_and_picklable():
    config = EngineConfig(platform_options={"b": 1, "a": "x"})
    assert config.platform_options == (("a", "x"), ("b", 1)) and config.platform_option_values == {"a": "x", "b": 1}
    assert pickle.loads(pickle.dumps(config)) == config  # the server sends it to its engine process
    with pytest.raises(ValueError, match="platform_options must map option names to values"):
        EngineConfig(platform_options=[("a", 1, 2)])


def test_serve_and_bench_take_platform_options():
    from podium.cli import build_parser
    from podium_bench.cli import engine_options
    from podium_server.cli import settings_from_args

    parser = build_parser()
    args = parser.parse_args(["serve", "--platform-option", "attention=torch", "--platform-option", "x=1"])
    engine = settings_from_args(args).engine
    assert engine.platform_option_values == {"attention": "torch", "x": "1"} and engine.tokenizer_cache is None
    assert settings_from_args(parser.parse_args(["serve", "--no-tokenizer-cache"])).engine.tokenizer_cache is False
    args = parser.parse_args(["bench", "throughput", "--platform-option", "attention=native"])
    assert engine_options(args).config.platform_option_values == {"attention": "native"}
    with pytest.raises(ValueError, match="takes NAME=VALUE"):
        settings_from_args(parser.parse_args(["serve", "--platform-option", "attention"]))


class Recording(CpuPlatform):
    """The CPU platform, recording the engine's calls in order."""

    name = "recording-cpu"

    def __init__(self, devices: int = 1) -> None:
        super().__init__()
        self.calls, self.devices = [], devices

    def activate(self, options):
        self.calls.append(("activate", dict(options)))
        super().activate(options)

    def device_count(self) -> int:
        self.calls.append(("device_count",))
        return self.devices

    def set_device(self, index: int) -> None:
        self.calls.append(("set_device", index))
        super().set_device(index)

    def custom_ops(self):
        self.calls.append(("custom_ops",))
        return super().custom_ops()


def test_the_engine_activates_once_then_binds_its_device_through_one_plugin_manager(tiny, monkeypatch):
    loads = []
    platform = Recording()
    run_engines_on(monkeypatch, platform)
    patched = platform_setup.load_plugins
    monkeypatch.setattr(platform_setup, "load_plugins", lambda: loads.append(1) or patched())
    LLM(tiny, dtype="float32", enforce_eager=True, platform_options={"attention": "torch"})
    assert loads == [1]  # one discovery, one plugin manager, per engine
    assert platform.calls[:3] == [("activate", {"attention": "torch", "kv_cache_commit": False, "linears": "auto",
                                                  "amx": True, "amx_plain_weights": False}), ("device_count",),
                                 ("set_device", 0)]
    assert ("custom_ops",) in platform.calls[3:]


def test_a_platform_without_devices_is_an_error_naming_it(tiny, monkeypatch):
    run_engines_on(monkeypatch, Recording(devices=0))
    with pytest.raises(RuntimeError, match=r"platform 'recording-cpu' has 0 device\(s\) here"):
        LLM(tiny, dtype="float32")


class NoSlidingWindow(CpuPlatform):
    name = "no-window-cpu"

    def capabilities(self) -> Capabilities:
        base = super().capabilities()
        return Capabilities(dtypes=base.dtypes, default_dtype=base.default_dtype, sliding_window=False)


def test_a_platform_without_sliding_windows_refuses_such_a_model_with_the_reason(tiny, mistral, monkeypatch):
    run_engines_on(monkeypatch, NoSlidingWindow())
    with pytest.raises(ValueError, match=r"uses a sliding attention window \(sliding_window=5 in 3 of 3 attention "
                                         r"layers\), which platform 'no-window-cpu' does not support "
                                         r"\(capabilities\(\).sliding_window is False\); run it on another platform"):
        LLM(mistral, dtype="float32")
    LLM(tiny, dtype="float32", enforce_eager=True)  # full attention runs there


def test_soft_capped_layers_need_the_capability():
    class Capped(nn.Module):
        def __init__(self):
            super().__init__()
            self.spec = AttentionLayerSpec(num_heads=2, num_kv_heads=1, head_size=8, scale=0.3, soft_cap=30.0)

    class NoSoftCap(Platform):
        name = "no-cap"

        def capabilities(self):
            return Capabilities(soft_cap=False)

    model = nn.Sequential(Capped(), Capped())
    assert [s.soft_cap for s in attention_specs(model)] == [30.0, 30.0]
    check_attention_support(model, Platform(), "capped")  # the default claims soft-capping
    with pytest.raises(ValueError, match=r"soft-capped attention scores \(soft_cap=30.0 in 2 of 2"):
        check_attention_support(model, NoSoftCap(), "capped")


def test_unparsed_values_are_what_the_user_wrote_validated_all_the_same():
    assert dict(resolve_options("npu", OPTIONS, {"ops": "a,b"}, environ={}, parsed=False))["ops"] == "a,b"
    with pytest.raises(ValueError, match="choose one of auto, fast, safe"):
        resolve_options("npu", OPTIONS, {"kernel": "x"}, environ={}, parsed=False)
