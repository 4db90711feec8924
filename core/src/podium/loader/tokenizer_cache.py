"""A GGUF file's tokenizer, converted once and kept on disk as a ``save_pretrained`` folder.

Converting a GGUF vocabulary is a slow part of a start (transformers re-reads the metadata with
``gguf.GGUFReader`` and imports ``transformers.models``: ~1.1 s for SmolLM2 on a 2-core machine);
loading the same tokenizer back from its ``tokenizer.json`` takes ~0.2 s. So the first start
converts and saves (~0.07 s more), later ones load the saved folder. Both pay transformers' import.

    $XDG_CACHE_HOME/podium/tokenizers/<file stem>-<key>/   (~/.cache by default)
        tokenizer.json, tokenizer_config.json, ...         what save_pretrained writes
        podium-tokenizer-cache.json                        MANIFEST: the key's inputs, the added tokens

key = sha256 of (absolute path, size, mtime_ns, transformers and tokenizers versions, FORMAT_VERSION):
a changed file, library or layout misses. Invariants:

- A folder at its final name is complete: it is written under a temporary name next to it and
  renamed into place. A process that loses the race to rename discards its copy.
- The cache never fails a load: an entry that cannot be read is reported, replaced and converted
  anew; one that cannot be written is reported and skipped.
- ``EngineConfig.tokenizer_cache=False`` turns the cache off (every start converts, nothing is
  written); left at None, its alias ``PODIUM_TOKENIZER_CACHE`` decides (0 turns it off).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

CACHE_ENV = "PODIUM_TOKENIZER_CACHE"
FORMAT_VERSION = 1  # bump when what is saved, or how it is loaded back, changes
MANIFEST = "podium-tokenizer-cache.json"
_ON, _OFF = ("", "1", "on", "true", "yes"), ("0", "off", "false", "no")
ADDED_TOKEN_FIELDS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")


def cache_enabled(setting: bool | None = None) -> bool:
    """``setting`` when given; else whether ``PODIUM_TOKENIZER_CACHE`` leaves the cache on (unset: on)."""
    if setting is not None:
        return setting
    value = os.environ.get(CACHE_ENV, "").strip().lower()
    if value in _ON or value in _OFF:
        return value in _ON
    raise ValueError(f"{CACHE_ENV}={os.environ[CACHE_ENV]!r} is not a switch; "
                     f"set it to 0 to turn the tokenizer cache off or 1 (the default) to keep it on")


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "podium" / "tokenizers"


def key_inputs(path: Path) -> dict[str, Any]:
    """Everything the converted tokenizer depends on (the manifest records it)."""
    import tokenizers
    import transformers

    stat = path.stat()
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
            "format": FORMAT_VERSION}


def entry_folder(inputs: dict[str, Any]) -> Path:
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:20]
    return cache_root() / f"{Path(inputs['path']).stem}-{key}"


def load_or_convert(path: Path, convert: Callable[[Path], Any], enabled: bool | None = None) -> Any:
    """The tokenizer of the GGUF file ``path``: the cached one, else ``convert(path)``, then cached.
    ``enabled``: the engine's ``tokenizer_cache`` setting (None: the environment's alias decides)."""
    if not cache_enabled(enabled):
        return convert(path)
    try:
        inputs = key_inputs(path)
        folder = entry_folder(inputs)
    except OSError as error:
        logger.warning("tokenizer cache: cannot key %s (%s); converting it", path, error)
        return convert(path)
    if folder.exists():
        try:
            return _load(folder, inputs, path)
        except Exception as error:  # any unreadable entry: convert instead, never fail the start
            logger.warning("tokenizer cache: entry %s is unreadable (%s: %s); replacing it", folder,
                           type(error).__name__, error)
            _discard(folder)
    logger.debug("tokenizer cache: miss for %s; converting", path)
    tokenizer = convert(path)
    _store(tokenizer, folder, inputs)
    return tokenizer


def _load(folder: Path, inputs: dict[str, Any], path: Path) -> Any:
    from transformers import PreTrainedTokenizerFast  # the class the GGUF conversion returns

    manifest = json.loads((folder / MANIFEST).read_text())
    if manifest.get("key") != inputs:
        raise ValueError(f"its manifest is for {manifest.get('key')}, not {inputs}")
    # Without added_tokens_decoder (transformers 5 leaves it out of tokenizer_config.json),
    # from_pretrained takes the added tokens from tokenizer.json, parsing all 3.5 MB in Python (~0.2 s).
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True,
                                                        added_tokens_decoder=manifest["added_tokens"])
    tokenizer.name_or_path = str(path.parent)  # what the converted one says
    logger.debug("tokenizer cache: hit %s", folder)
    return tokenizer


def _store(tokenizer: Any, folder: Path, inputs: dict[str, Any]) -> None:
    """Save ``tokenizer`` to ``folder`` atomically; a failure is reported, never raised."""
    temporary = None
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        temporary = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
        tokenizer.save_pretrained(str(temporary))
        added = {str(index): {name: getattr(token, name) for name in ADDED_TOKEN_FIELDS}
                 for index, token in tokenizer.added_tokens_decoder.items()}
        (temporary / MANIFEST).write_text(json.dumps({"key": inputs, "added_tokens": added}, indent=2))
        os.rename(temporary, folder)
        temporary = None
        logger.debug("tokenizer cache: wrote %s", folder)
    except OSError as error:
        if folder.is_dir():  # another process renamed its copy into place first
            logger.debug("tokenizer cache: %s was written concurrently", folder)
        else:
            logger.warning("tokenizer cache: cannot write %s (%s); turn it off with tokenizer_cache=False or %s=0",
                           folder, error, CACHE_ENV)
    except Exception as error:  # save_pretrained's own failures: skip caching, keep the tokenizer
        logger.warning("tokenizer cache: cannot save the tokenizer to %s (%s: %s)", folder, type(error).__name__, error)
    finally:
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)


def _discard(folder: Path) -> None:
    """Move a bad entry aside, then delete it (a concurrent writer can then rename a good one in)."""
    try:
        aside = Path(tempfile.mkdtemp(prefix=f".{folder.name}.bad.", dir=folder.parent))
        os.rename(folder, aside / folder.name)
    except OSError as error:
        logger.debug("tokenizer cache: cannot move %s aside (%s)", folder, error)
        return
    shutil.rmtree(aside, ignore_errors=True)
