"""vLLM's engine arguments and what Podium does with each: one table for ``LLM(...)`` and the CLI.

A script or command line written for vLLM runs unchanged where Podium has the feature, and fails
with a message naming the argument where it does not. The fields of ``EngineConfig`` carry vLLM's
names where vLLM has the setting (``dtype``, ``max_model_len``, ``enforce_eager``,
``generation_config``, ``scheduling_policy``, ...) and are taken as they are; ``VLLM_ARGS`` holds
the other arguments vLLM users pass, each one:

    accepted   sets an ``EngineConfig`` field (``field``), e.g. vLLM's name for a Podium setting
    ignored    runs as asked but changes nothing here; a warning names the argument and says why
    refused    the values outside ``supported`` raise ValueError with the reason

A row may combine them: ``pipeline_parallel_size`` is accepted at 1 and refused above.
``tensor_parallel_size`` is an ``EngineConfig`` field of the same name (``-tp`` on the command line).
``podium serve`` and ``podium bench`` build their flags from the same rows (``engine_flags``).
"""

from __future__ import annotations

import difflib
import logging
from dataclasses import dataclass, fields
from typing import Any

from .config import EngineConfig

logger = logging.getLogger(__name__)

ANY = None  # Row.supported: every value


@dataclass(frozen=True)
class Row:
    """One vLLM argument: what a value does here (see the module docstring), and its CLI flag's type."""

    name: str  # vLLM's keyword; the CLI flag is --name-with-dashes
    field: str | None = None  # the EngineConfig field it sets (None: sets nothing)
    supported: tuple | None = ANY  # the values Podium runs as asked
    refused: str = ""  # why a value outside ``supported`` cannot run
    ignored: str = ""  # why a supported value changes nothing (a warning when given); "" when it does
    quiet: tuple = (None,)  # supported values that need no warning (the "off" ones)
    type: type = str  # the CLI flag's type (bool: --name / --no-name)
    aliases: tuple[str, ...] = ()  # vLLM's short flags (-tp)
    default: Any = None  # vLLM's default, as --help shows it (None: not given)

    def resolve(self, value: Any) -> tuple[str | None, str]:
        """(the EngineConfig field to set or None, a note to log or ""); ValueError when refused."""
        if self.supported is not ANY and value not in self.supported:
            raise ValueError(f"{self.name}={value!r} is not supported: {self.refused}")
        note = f"{self.name}={value!r} is ignored: {self.ignored}" if self.ignored and value not in self.quiet else ""
        return self.field, note

    @property
    def help(self) -> str:
        """What the flag does here and its default, for ``--help``."""
        if self.field is not None:
            return f"vLLM's name for {self.field}"
        runs = [] if self.supported is ANY else [v for v in self.supported if v is not None]
        if self.type is not bool:
            runs = [v for v in runs if not isinstance(v, bool)]
        parts = [f"accepted, no effect: {self.ignored}"] if self.ignored else []
        if self.supported is not ANY:
            parts.append(f"only {', '.join(map(str, runs))} runs: {self.refused}" if runs else
                         f"refused: {self.refused}")
        return f"{'; '.join(parts)} (default: {'not given' if self.default is None else self.default})"


OFF = (None, False, 0)

VLLM_ARGS: tuple[Row, ...] = (
    Row("pipeline_parallel_size", supported=(1,), type=int, default=1, aliases=("-pp",),
        refused="pipeline parallelism is not implemented; Podium runs a model on one device"),
    Row("trust_remote_code", supported=(False, None), type=bool, default=False,
        refused="Podium runs no code from a model folder; its model architectures are built in"),
    Row("revision", supported=(None,),
        refused="Podium downloads nothing; pass a local folder or .gguf file at the revision you want"),
    Row("tokenizer_revision", supported=(None,),
        refused="Podium downloads nothing; pass a local tokenizer folder as tokenizer"),
    Row("download_dir", supported=(None,),
        refused="Podium downloads nothing; pass a local folder or .gguf file as the model"),
    Row("enable_chunked_prefill", type=bool, quiet=(True, None), default=True,
        ignored="Podium always chunks long prompts (greedy outputs do not depend on it)"),
    Row("swap_space", type=float, quiet=OFF,
        ignored="Podium preempts by recomputing; it swaps no KV blocks to host memory"),
    Row("cpu_offload_gb", supported=OFF, type=float, default=0,
        refused="Podium keeps every weight on the device; offloading is not implemented"),
    Row("tokenizer_mode", supported=("auto", "hf", None), quiet=("auto", None), default="auto",
        refused="Podium loads tokenizers through transformers (auto or hf)",
        ignored="transformers' tokenizer is the one Podium loads"),
    Row("max_seq_len_to_capture", type=int, quiet=OFF,
        ignored="decode graphs are captured per batch size and cover every sequence length"),
    Row("disable_log_stats", type=bool, quiet=OFF, default=False,
        ignored="Podium's engine logs no periodic stats (the server's are at /metrics)"),
    Row("disable_custom_all_reduce", type=bool, quiet=OFF, default=False, ignored="Podium has no custom all-reduce"),
    Row("fully_sharded_loras", type=bool, quiet=OFF, default=False,
        ignored="LoRA slots are sharded like their projections' weights (B by output rows, A by input columns)"),
    Row("lora_dtype", supported=("auto", None), quiet=("auto", None), default="auto",
        refused="LoRA slot weights take the model's dtype"),
    Row("long_lora_scaling_factors", supported=(None,), refused="long-context LoRA (LongLoRA) is not served"),
    Row("kv_cache_memory_bytes", field="kv_cache_memory"),
    Row("task", field="runner"),  # vLLM's older name: task="embed" is runner="pooling"
    Row("num_gpu_blocks_override", field="num_kv_blocks"),
)
ROWS = {row.name: row for row in VLLM_ARGS}
CONFIG_FIELDS = frozenset(f.name for f in fields(EngineConfig))


def resolve_args(kwargs: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """vLLM-style keyword arguments -> (EngineConfig keyword arguments, notes to log).

    Raises ValueError for a refused value and TypeError for a name neither Podium nor the table knows.
    """
    config: dict[str, Any] = {}
    named: dict[str, str] = {}  # field -> the argument that set it
    notes: list[str] = []
    for name, value in kwargs.items():
        if name in CONFIG_FIELDS:
            field, note = name, ""
        elif name in ROWS:
            field, note = ROWS[name].resolve(value)
        else:
            raise TypeError(unknown_argument(name))
        if field is not None:
            if field in config and config[field] != value:
                raise ValueError(f"{named[field]}={config[field]!r} and {name}={value!r} set the same thing; give one")
            config[field], named[field] = value, name
        if note:
            notes.append(note)
    return config, notes


def engine_config(**kwargs: Any) -> EngineConfig:
    """``EngineConfig`` from Podium's and vLLM's argument names; each ignored argument is logged."""
    config, notes = resolve_args(kwargs)
    for note in notes:
        logger.warning("%s", note)
    return EngineConfig(**config)


def unknown_argument(name: str) -> str:
    known = sorted(CONFIG_FIELDS | ROWS.keys())
    close = difflib.get_close_matches(name, known, n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return f"unknown engine argument {name!r}{hint} (known: {', '.join(known)})"
