"""The engine's command-line flags, defined once for ``podium serve``, ``podium bench`` and later commands.

    add_engine_flags(parser)           the flags, in an "engine" argument group
    engine_kwargs(args)                the flags given, as ``LLM``/``engine_config`` keyword arguments
    engine_config(**engine_kwargs(args))   the validated EngineConfig

Each ``EngineConfig`` setting is one ``Flag``. Its name is vLLM's: where ``engine_args.VLLM_ARGS``
maps a vLLM argument to the field (``kv_cache_memory_bytes`` -> ``kv_cache_memory``) that name
comes first, and Podium's own name stays as an alias (``--kv-cache-memory``). The table's other
rows (accepted-and-ignored, refused) become flags too, resolved by the same code as ``LLM(...)``.
A flag's default is None ("not given"), so only what the user typed reaches the config and a
platform's suggestion fills the rest; the help shows the default that then applies.

To add a setting: a field in ``EngineConfig`` and a ``Flag`` here (or a group of them).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any

from podium_plugin_api.options import parse_option_pairs

from .config import (
    DEFAULT_MODEL,
    DTYPES,
    KV_CACHE_DTYPES,
    PLAN_BROADCASTS,
    SCHEDULING_POLICIES,
    STRUCTURED_OUTPUTS_BACKENDS,
    EngineConfig,
)
from .engine_args import VLLM_ARGS
from .pooling_config import RUNNERS

GROUP_TITLE = "engine"
_DEFAULTS = {f.name: f.default for f in fields(EngineConfig)}


@dataclass(frozen=True)
class Flag:
    """One EngineConfig field on the command line."""

    field: str
    help: str
    type: type | None = str  # bool: --name / --no-name; None: a switch that only turns on; dict: NAME=VALUE, repeated
    choices: tuple | None = None
    default: str | None = None  # the default as --help shows it (None: the EngineConfig default)
    aliases: tuple[str, ...] = ()  # more names (after vLLM's and Podium's own)

    def names(self) -> list[str]:
        """vLLM's flag first (from the argument table where it renames the field), then Podium's."""
        renames = [row.name for row in VLLM_ARGS if row.field == self.field]
        names = [_flag(n) for n in (*renames, self.field)]
        return list(dict.fromkeys([*names, *self.aliases]))

    def help_text(self) -> str:
        default = self.default if self.default is not None else _DEFAULTS[self.field]
        return f"{self.help} (default: {default})"


ENGINE_FLAGS: tuple[Flag, ...] = (
    Flag("model", f"model folder, .gguf file, config.json or named shape ({DEFAULT_MODEL}: the embedded one)"),
    Flag("tokenizer", "a folder with the tokenizer to use instead of the model's own", default="the model's"),
    Flag("served_model_name", "the model name clients use", default="the model argument"),
    Flag("device", "platform name ($PODIUM_DEVICE also works)", default="the best available platform"),
    Flag("dtype", "weights' and activations' dtype", choices=DTYPES, default="auto: the platform's choice"),
    Flag("kv_cache_dtype", "what the KV cache stores: auto (the model's dtype), fp8 (= fp8_e4m3), fp8_e5m2, ...",
         choices=KV_CACHE_DTYPES),
    Flag("max_model_len", "longest prompt plus output, in tokens", type=int, default="the model's context length"),
    Flag("block_size", "tokens per KV-cache block (a power of two)", type=int, default="the platform's choice, else 16"),
    Flag("enable_prefix_caching", "reuse the KV blocks of prompts' shared prefixes", type=bool,
         aliases=("--no-prefix-caching",)),
    Flag("max_num_seqs", "most sequences in one step", type=int),
    Flag("max_num_batched_tokens", "token budget of one step", type=int,
         default="the platform's choice, else max(2048, max_num_seqs)"),
    Flag("kv_cache_memory", "KV-cache size in bytes or like 4GiB, where sized by amount (CPU)",
         default="the platform's choice (CPU: 1GiB)"),
    Flag("num_kv_blocks", "exact number of KV-cache blocks (overrides the sizing)", type=int),
    Flag("gpu_memory_utilization", "fraction of device memory for weights, activations and KV cache, where the "
         "platform sizes the cache from free memory (accelerators)", type=float),
    Flag("enforce_eager", "no graph capture", type=None, default=False),
    Flag("async_scheduling", "plan and launch step N+1 before reading step N's tokens", type=bool,
         default="the platform's choice: on for CUDA/ROCm, off for CPU/TPU"),
    Flag("batch_invariant", "deterministic serving: a request's output never depends on what else runs, on "
         "chunked prefill or on prefix-cache hits (the platform's batch-invariant kernels; costs speed, see "
         "docs/batch_invariant.md)", type=None, default=False),
    Flag("seed", "seeds sampling (and the random weights of a shape model)", type=int),
    Flag("tensor_parallel_size", "ranks (processes, one device each) the model is sharded over", type=int,
         aliases=("-tp",)),
    Flag("plan_broadcast", "how rank 0 sends each step's plan to the other ranks (tensor parallelism)",
         choices=PLAN_BROADCASTS),
    Flag("generation_config", "sampling defaults: auto (the model's generation_config.json), vllm or none "
         "(SamplingParams' own), or a folder holding a generation_config.json"),
    Flag("scheduling_policy", "admission order: fcfs, or priority (lower value first, then arrival)",
         choices=SCHEDULING_POLICIES),
    Flag("platform_options", "an option of the selected platform as NAME=VALUE, repeatable (podium platforms "
         "--verbose lists them)", type=dict, default="none", aliases=("--platform-option",)),
    Flag("runner", "generate text, or pooling: compute embeddings (/v1/embeddings); auto: by architecture "
         "(BertModel pools; *ForCausalLM generates)", choices=RUNNERS + ("embed",)),
    Flag("pooler_config", "a pooling model's pooling over its folder's, as JSON: "
         '\'{"pooling_type": "MEAN" | "CLS" | "LAST", "normalize": true}\'', default="the model folder's"),
    Flag("quantization", "how the weights run quantized: gguf (a GGUF file's blocks kept), fp8 (a float checkpoint "
         "quantized at load), awq (a float checkpoint rounded to INT4 at load), or a plugin's method; none: a GGUF "
         "file dequantized at load",
         default="what the checkpoint's quantization_config says; GGUF files dequantized", aliases=("-q",)),
    Flag("structured_outputs_backend", "grammar library of structured output where a request names none",
         choices=STRUCTURED_OUTPUTS_BACKENDS, aliases=("--guided-decoding-backend",)),
    Flag("tokenizer_cache", "keep a GGUF file's converted tokenizer on disk", type=bool,
         default="on, unless $PODIUM_TOKENIZER_CACHE=0"),
    Flag("enable_lora", "serve LoRA adapters (requests name one as their model; docs/lora.md)", type=None,
         default=False),
    Flag("max_loras", "LoRA adapters on the device at once (slots); requests for more wait", type=int),
    Flag("max_lora_rank", "the largest LoRA rank served (every slot is padded to it)", type=int),
    Flag("max_cpu_loras", "LoRA adapters kept in host memory (least recently used dropped)", type=int,
         default="max_loras"),
    Flag("speculative_config", 'speculative decoding as JSON: method ngram, draft_model, eagle or eagle3, e.g. '
         '\'{"method": "ngram", "num_speculative_tokens": 4}\' or \'{"method": "draft_model", "model": "PATH", '
         '"num_speculative_tokens": 4}\'', default="off"),
)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_engine_flags(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> argparse._ArgumentGroup:
    """The engine's flags in one argument group (``skip``: fields the command sets another way)."""
    group = parser.add_argument_group(GROUP_TITLE, "how the engine runs the model (vLLM's flag names; Podium's "
                                                   "earlier names are aliases)")
    for flag in ENGINE_FLAGS:
        if flag.field not in skip:
            _add(group, flag.names(), flag.field, flag.type, flag.help_text(), flag.choices)
    for row in VLLM_ARGS:
        if row.field is None:
            _add(group, [_flag(row.name), *row.aliases], row.name, row.type, row.help, None)
    return group


def _add(group, names: list[str], dest: str, kind: type | None, help: str, choices) -> None:
    if kind is bool:
        positive = [n for n in names if not n.startswith("--no-")]
        group.add_argument(*positive, dest=dest, action=argparse.BooleanOptionalAction, default=None, help=help)
        for negative in (n for n in names if n.startswith("--no-") and n != "--no-" + positive[0][2:]):
            group.add_argument(negative, dest=dest, action="store_false", default=None,
                               help=f"the same as --no-{positive[0][2:]}")
    elif kind is None:
        group.add_argument(*names, dest=dest, action="store_true", default=None, help=help)
    elif kind is dict:
        group.add_argument(*names, dest=dest, action="append", default=None, metavar="NAME=VALUE", help=help)
    else:
        group.add_argument(*names, dest=dest, type=kind, choices=choices, default=None, help=help)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags given on the command line, as keyword arguments for ``LLM``/``engine_config``."""
    names = [flag.field for flag in ENGINE_FLAGS] + [row.name for row in VLLM_ARGS if row.field is None]
    given = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    for flag in ENGINE_FLAGS:
        if flag.type is dict and flag.field in given:
            given[flag.field] = parse_option_pairs(given[flag.field])
    return given
