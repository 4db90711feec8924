"""A ``.gguf`` file as a ModelSource: config from its metadata, tokenizer through transformers.

The config is built from the metadata (``gguf_config``), because transformers' own path re-parses
every metadata array with ``gguf.GGUFReader`` (~5 s for a 49k vocabulary) and its config classes
import more than the engine needs. The tokenizer is transformers' conversion of the vocabulary,
done once per file and then loaded from the tokenizer cache (``tokenizer_cache``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from .gguf_config import gguf_config
from .gguf_reader import read_gguf
from .gguf_weights import gguf_weights, tensor_types
from .hf_folder import max_model_len
from .source import ModelSource, token_id_list
from .tokenizer_cache import load_or_convert


def gguf_tokenizer(path: Path, cache: bool | None = None):
    """transformers' tokenizer for a GGUF file: from the tokenizer cache, else converted (and cached);
    ``cache``: the engine's tokenizer_cache setting (None: the environment decides)."""
    return load_or_convert(path, convert_gguf_tokenizer, cache)


def convert_gguf_tokenizer(path: Path):
    """transformers' own conversion of a GGUF file's vocabulary (no code from the folder runs)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)


def load_gguf(path: Path, tokenizer: Any | None = None, description: str | None = None,
              tokenizer_cache: bool | None = None) -> ModelSource:
    """``path`` (a .gguf file) as a ModelSource; ``tokenizer`` replaces the file's own if given.

    A file without tokenizer metadata gets no tokenizer (None), like a folder without tokenizer files.
    """
    gguf = read_gguf(path)
    config = gguf_config(gguf)
    meta = gguf.metadata
    eos = token_id_list(*(meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")))
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    started = time.perf_counter()
    if tokenizer is None and "tokenizer.ggml.model" in meta:
        tokenizer = gguf_tokenizer(path, tokenizer_cache)
    tokenizer_seconds = time.perf_counter() - started

    def stream(lazy: bool = False, keep: frozenset[str] = frozenset()):
        return gguf_weights(read_gguf(path), heads, kv_heads, lazy, keep)

    types = tensor_types(gguf)

    return ModelSource(
        hf_config=config,
        tokenizer=tokenizer,
        weight_stream=stream,
        eos_token_ids=eos,
        max_model_len=max_model_len(config),
        description=description or f"GGUF file {path} ({gguf.architecture}, {len(gguf.tensors)} tensors)",
        path=str(path),
        load_seconds={"tokenizer": tokenizer_seconds},
        quantization={"quant_method": "gguf", "tensor_types": types} if types else None,
    )
