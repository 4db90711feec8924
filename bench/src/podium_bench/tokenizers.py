"""The token space of a model a client benchmarks over HTTP (no engine is built).

Podium's model resolver understands folders, GGUF files, config.json, named shapes and the
embedded model; a plain local tokenizer folder is accepted as well. The token space only shapes
the prompts: the server counts the tokens it actually saw and reports them in its usage.
"""

from __future__ import annotations

import logging
from pathlib import Path

from podium.config import DEFAULT_MODEL

from .datasets import TokenSpace

logger = logging.getLogger(__name__)

UNBOUNDED_CONTEXT = 1 << 20  # when nothing says how long the context is, the server will tell


def token_space_for(name: str, max_model_len: int | None = None) -> TokenSpace:
    try:
        from podium.loader import resolve_model

        source = resolve_model(name)
    except (ValueError, ImportError, OSError) as exc:
        return _from_tokenizer_folder(name, max_model_len, exc)
    length = source.max_model_len if max_model_len is None else min(max_model_len, source.max_model_len)
    specials = list(source.eos_token_ids or []) + [getattr(source.hf_config, "bos_token_id", None)]
    return TokenSpace.build(source.hf_config.vocab_size, length, source.tokenizer, specials)


def _from_tokenizer_folder(name: str, max_model_len: int | None, cause: Exception) -> TokenSpace:
    if not Path(name).is_dir():
        raise ValueError(f"cannot find a tokenizer for {name!r} ({cause}); pass --tokenizer with a local model folder, "
                         f".gguf file, config.json or shape name") from cause
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=True)
    model_len = getattr(tokenizer, "model_max_length", None) or UNBOUNDED_CONTEXT
    length = min(max_model_len or UNBOUNDED_CONTEXT, int(min(model_len, UNBOUNDED_CONTEXT)))
    return TokenSpace.build(len(tokenizer), length, tokenizer)


def token_space_for_served(tokenizer: str | None, served: list[str], max_model_len: int | None = None) -> TokenSpace:
    """``--tokenizer`` if given; else the first of the served model's names that resolves here (a
    server started on a local folder, file or shape name); else the embedded model's, with a
    warning (prompt lengths then follow another vocabulary: the server's usage still counts right)."""
    if tokenizer is not None:
        return token_space_for(tokenizer, max_model_len)
    failures = []
    for name in served:
        try:
            return token_space_for(name, max_model_len)
        except (ValueError, OSError) as exc:
            failures.append(f"{name!r}: {exc}")
    logger.warning("no tokenizer for the served model here (%s); the prompts use %s's vocabulary: pass --tokenizer",
                   "; ".join(failures) or "no name", DEFAULT_MODEL)
    return token_space_for(DEFAULT_MODEL, max_model_len)
