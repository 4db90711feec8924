"""vLLM's engine arguments (``podium.engine_args``) and the one flag definition (``podium.engine_flags``).

Every row of the argument table has its expected behaviour written out here (a new row without one
fails ``test_every_row_is_covered``); each is checked through ``LLM``'s path and through the CLI's.
"""

from __future__ import annotations

import argparse
import logging

import pytest

from podium import LLM
from podium.config import EngineConfig
from podium.engine_args import ROWS, engine_config, resolve_args
from podium.engine_flags import ENGINE_FLAGS, add_engine_flags, engine_kwargs
from podium.explicit_fields import explicit_fields, with_fallbacks

# row -> (a value vLLM users pass, what it does: "accepted" (field, value) / "ignored" / "refused" + text)
EXPECTED = {
    "pipeline_parallel_size": [(1, "quiet"), (4, "refused", "pipeline parallelism")],
    "trust_remote_code": [(False, "quiet"), (True, "refused", "runs no code from a model folder")],
    "revision": [(None, "quiet"), ("main", "refused", "downloads nothing")],
    "tokenizer_revision": [(None, "quiet"), ("v2", "refused", "downloads nothing")],
    "download_dir": [(None, "quiet"), ("/data", "refused", "downloads nothing")],
    "enable_chunked_prefill": [(True, "quiet"), (False, "ignored", "always chunks")],
    "swap_space": [(0, "quiet"), (4, "ignored", "recomputing")],
    "cpu_offload_gb": [(0, "quiet"), (2.5, "refused", "offloading")],
    "tokenizer_mode": [("auto", "quiet"), ("hf", "ignored", "transformers"), ("mistral", "refused", "auto or hf")],
    "max_seq_len_to_capture": [(8192, "ignored", "per batch size")],
    "disable_log_stats": [(False, "quiet"), (True, "ignored", "no periodic stats")],
    "disable_custom_all_reduce": [(True, "ignored", "no custom all-reduce")],
    "fully_sharded_loras": [(False, "quiet"), (True, "ignored", "sharded like their projections")],
    "lora_dtype": [("auto", "quiet"), ("float16", "refused", "the model's dtype")],
    "long_lora_scaling_factors": [(None, "quiet"), ((4.0,), "refused", "LongLoRA")],
    "kv_cache_memory_bytes": [("2GiB", "accepted", "kv_cache_memory")],
    "num_gpu_blocks_override": [(128, "accepted", "num_kv_blocks")],
    "task": [("generate", "accepted", "runner")],  # task="embed" is runner="pooling" (tests/test_embeddings.py)
}
CASES = [(name, *case) for name, cases in EXPECTED.items() for case in cases]


def test_every_row_is_covered():
    assert set(EXPECTED) == set(ROWS)


def _cli_args(name: str, value) -> list[str]:
    row = ROWS[name]
    flag = "--" + name.replace("_", "-")
    if value is None:
        return []
    if row.type is bool:
        return [flag if value else "--no-" + flag[2:]]
    return [flag, str(value)]


@pytest.mark.parametrize("name,value,outcome,detail", [c if len(c) == 4 else (*c, "") for c in CASES],
                         ids=[f"{c[0]}={c[1]}" for c in CASES])
def test_row(name, value, outcome, detail, caplog):
    """The same outcome through LLM's keyword arguments and through the command line."""
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    from_cli = engine_kwargs(parser.parse_args(_cli_args(name, value)))
    for kwargs in ({name: value}, from_cli):
        caplog.clear()
        if outcome == "refused":
            with pytest.raises(ValueError, match=f"{name}=.*is not supported: .*{detail}"):
                engine_config(**kwargs)
            continue
        with caplog.at_level(logging.WARNING, logger="podium.engine_args"):
            config = engine_config(**kwargs)
        warnings = [r.getMessage() for r in caplog.records]
        if outcome == "ignored":
            assert len(warnings) == 1 and warnings[0].startswith(f"{name}=") and detail in warnings[0]
        else:
            assert warnings == []
        if outcome == "accepted":
            assert getattr(config, detail) == value and detail in explicit_fields(config)
        else:  # nothing of the engine's changes
            assert config == EngineConfig()


def test_unknown_and_conflicting_arguments_name_the_problem():
    with pytest.raises(TypeError, match=r"unknown engine argument 'max_num_seq'; did you mean max_num_seqs"):
        engine_config(max_num_seq=8)
    with pytest.raises(ValueError, match="kv_cache_memory=.*and kv_cache_memory_bytes=.*set the same thing"):
        engine_config(kv_cache_memory="1GiB", kv_cache_memory_bytes="2GiB")
    assert resolve_args({"kv_cache_memory": "1GiB", "kv_cache_memory_bytes": "1GiB"})[0] == {"kv_cache_memory": "1GiB"}
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority"):
        engine_config(scheduling_policy="lifo")
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide the model's attention heads \(9\)"):
        LLM("smollm2-135m-instruct", tensor_parallel_size=2, device="cpu")  # refused before any worker starts


def test_a_value_the_user_set_beats_the_platforms_suggestion_even_when_it_is_the_default():
    suggested = {"block_size": 64, "max_num_seqs": 32, "async_scheduling": True, "not_a_field": 1}
    mine = EngineConfig(block_size=16, max_num_seqs=256)  # both equal to the dataclass defaults
    filled = mine.with_defaults(suggested)
    assert (filled.block_size, filled.max_num_seqs, filled.async_scheduling) == (16, 256, True)
    assert EngineConfig().with_defaults(suggested).block_size == 64
    assert explicit_fields(filled) == {"block_size", "max_num_seqs"}  # suggestions are not the user's
    assert explicit_fields(EngineConfig(max_model_len=None, seed=0)) == {"seed"}  # None: "choose for me"
    assert with_fallbacks(mine, {}) is mine


def test_llm_block_size_wins_over_a_platform_suggesting_64(monkeypatch, tmp_path):
    from model_fixtures import save_tiny_model

    from podium_cpu import CpuPlatform

    save_tiny_model("llama", {}, tmp_path)
    monkeypatch.setattr(CpuPlatform, "config_defaults", lambda self: {"block_size": 64, "kv_cache_memory": 1 << 24})
    assert LLM(str(tmp_path), device="cpu", block_size=16).engine.config.block_size == 16
    llm = LLM(str(tmp_path), device="cpu")
    assert llm.engine.config.block_size == 64 and llm.engine.block_manager.block_size == 64


def test_gpu_memory_utilization_on_a_platform_sizing_by_amount_says_so(tmp_path, caplog):
    from model_fixtures import save_tiny_model

    save_tiny_model("llama", {}, tmp_path)
    with caplog.at_level(logging.WARNING, logger="podium.engine"):
        LLM(str(tmp_path), device="cpu", kv_cache_memory_bytes="16MiB")
    assert not [r for r in caplog.records if "gpu_memory_utilization" in r.getMessage()]
    with caplog.at_level(logging.WARNING, logger="podium.engine"):
        llm = LLM(str(tmp_path), device="cpu", gpu_memory_utilization=0.5, kv_cache_memory_bytes="16MiB")
    notes = [r.getMessage() for r in caplog.records if "gpu_memory_utilization" in r.getMessage()]
    assert notes == ["gpu_memory_utilization=0.5 is ignored: platform 'cpu' does not size the KV cache from a "
                     "fraction of free memory; it takes kv_cache_memory_bytes (now 16MiB)"]
    assert llm.engine.num_kv_blocks * llm.engine.config.block_size == llm.engine.kv_capacity_tokens


def _engine_group(parser: argparse.ArgumentParser) -> dict[str, tuple]:
    """The engine group's flags: dest -> (option strings, default, help)."""
    group = next(g for g in parser._action_groups if g.title == "engine")
    flags: dict[str, list] = {}
    for action in group._group_actions:
        flags.setdefault(action.dest, []).append((tuple(action.option_strings), action.default, action.help))
    return {dest: tuple(entries) for dest, entries in flags.items()}


def _subcommand(argv: list[str]) -> argparse.ArgumentParser:
    from podium.cli import build_parser

    parser = build_parser()
    for name in argv:
        parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    return parser


def test_serve_and_bench_share_one_engine_flag_definition():
    serve, throughput, latency = (_subcommand(a) for a in (["serve"], ["bench", "throughput"], ["bench", "latency"]))
    flags = _engine_group(serve)
    assert flags == _engine_group(throughput) == _engine_group(latency)
    assert {f.field for f in ENGINE_FLAGS} | {r for r in ROWS if ROWS[r].field is None} == set(flags)
    names = {name for entries in flags.values() for entry in entries for name in entry[0]}
    for vllm in ("--enable-prefix-caching", "--no-enable-prefix-caching", "--kv-cache-memory-bytes",
                 "--num-gpu-blocks-override", "--generation-config", "--scheduling-policy", "--tensor-parallel-size",
                 "-tp"):
        assert vllm in names
    for alias in ("--no-prefix-caching", "--kv-cache-memory", "--num-kv-blocks"):  # today's names still work
        assert alias in names
    assert "--kv-cache-memory-bytes" in serve.format_help()  # argparse formats every help string
    for action in serve._actions:  # the server's own flags too: help and default on every one
        if not isinstance(action, argparse._HelpAction) and not action.help.startswith("the same as --no-"):
            assert "(default: " in action.help, action.option_strings or action.dest
    for entries in flags.values():
        for options, default, text in entries:
            assert default is None  # unset unless typed: platform suggestions fill the rest
            assert text and "(default: " in text or text.startswith("the same as --no-"), options


def test_serve_flags_and_aliases_reach_the_engine_config():
    from podium_server import cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    settings = cli.settings_from_args(parser.parse_args(
        ["serve", "m.gguf", "--no-prefix-caching", "--kv-cache-memory", "2GiB", "--num-gpu-blocks-override", "64",
         "--generation-config", "vllm", "--scheduling-policy", "priority", "-tp", "1", "--block-size", "16"]))
    engine = settings.engine
    assert (engine.model, engine.enable_prefix_caching, engine.kv_cache_memory, engine.num_kv_blocks) == \
        ("m.gguf", False, "2GiB", 64)
    assert (engine.generation_config, engine.scheduling_policy, engine.block_size) == ("vllm", "priority", 16)
    assert explicit_fields(engine) == {"model", "enable_prefix_caching", "kv_cache_memory", "num_kv_blocks",
                                       "generation_config", "scheduling_policy", "block_size", "tensor_parallel_size"}
    assert cli.settings_from_args(parser.parse_args(["serve", "--model", "x.gguf"])).engine.model == "x.gguf"
    with pytest.raises(ValueError, match="two models given"):
        cli.settings_from_args(parser.parse_args(["serve", "a.gguf", "--model", "b.gguf"]))
    assert cli.settings_from_args(parser.parse_args(["serve", "-tp", "2"])).engine.tensor_parallel_size == 2
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1, got 0"):
        cli.settings_from_args(parser.parse_args(["serve", "--tensor-parallel-size", "0"]))


def test_the_vllm_guide_names_every_argument_and_flag():
    import pathlib

    guide = (pathlib.Path(__file__).parents[1] / "docs" / "vllm.md").read_text()
    vllm_names = [*ROWS, *(flag.names()[0][2:].replace("-", "_") for flag in ENGINE_FLAGS)]
    assert [name for name in vllm_names if f"`{name}`" not in guide] == []
