"""The tokenizer cache: a cached SmolLM2 tokenizer behaves exactly like transformers' GGUF conversion,
a changed file or library misses, a broken entry is replaced, and the cache can be turned off.

The reference is the tokenizer transformers converts from the GGUF file (what Podium used before
the cache). Every test runs in a temporary XDG_CACHE_HOME (the ``tokenizer_cache`` fixture).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from podium.detokenizer import IncrementalDetokenizer
from podium.loader import embedded_gguf_path, gguf_source
from podium.loader import tokenizer_cache as cache

gguf = pytest.importorskip("gguf")

TEXTS = [
    "Hello world",
    "The capital of France is",
    "  leading spaces,\ttabs\t\tand\n\nnewlines\r\n   trailing   ",
    " " * 17 + "x" + "\n" * 9,
    "naïve café, Größe, ½ ≠ ∞, Ελληνικά, русский, 日本語のテキスト, 한국어, عربى, हिन्दी",
    "emoji 🙂👍🏽👨‍👩‍👧 and a lone combining accent e\u0301",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>podium<file_sep>a.py<filename>b<gh_stars>10<jupyter_code>",
    "<|im_start <|im_end |> <|im_end|><|im_end|>x",
    "",
    "a" * 300,
    "1234567890 3.14159 -42 0x1F 1e-9",
]
CHATS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Name a planet."}],
    [{"role": "user", "content": "Größe? 🙂"}, {"role": "assistant", "content": "  two  spaces\n"},
     {"role": "user", "content": "<|im_end|> inside"}],
]


class CountingConvert:
    """``convert`` for load_or_convert: transformers' GGUF conversion, counted."""

    def __init__(self, result=None) -> None:
        self.calls, self._result = 0, result

    def __call__(self, path):
        self.calls += 1
        return self._result if self._result is not None else gguf_source.convert_gguf_tokenizer(path)


@pytest.fixture(scope="module")
def converted():
    """transformers' conversion of the embedded GGUF: the reference."""
    return gguf_source.convert_gguf_tokenizer(embedded_gguf_path())


@pytest.fixture
def fake_gguf(tmp_path, converted):
    """(a small file standing in for a GGUF, a convert returning the reference): tests of the cache's keying."""
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF stand-in")
    return path, CountingConvert(converted)


def entries(root) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def assert_same_tokenizer(cached, reference) -> None:
    assert type(cached) is type(reference)
    assert cached.backend_tokenizer.to_str() == reference.backend_tokenizer.to_str()
    assert (len(cached), cached.vocab_size) == (len(reference), reference.vocab_size)
    assert cached.get_vocab() == reference.get_vocab()
    assert cached.added_tokens_decoder == reference.added_tokens_decoder
    assert cached.chat_template == reference.chat_template
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id", "eos_token_id", "pad_token_id",
                 "unk_token_id", "all_special_tokens", "all_special_ids", "model_max_length", "padding_side",
                 "truncation_side", "clean_up_tokenization_spaces", "add_bos_token", "add_eos_token", "name_or_path",
                 "special_tokens_map", "extra_special_tokens", "split_special_tokens", "add_prefix_space", "is_fast"):
        assert getattr(cached, name) == getattr(reference, name), name
    for text in TEXTS:
        ids = reference.encode(text)
        assert cached.encode(text) == ids, text
        assert cached.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)
        assert cached.tokenize(text) == reference.tokenize(text)
        for skip in (False, True):
            assert cached.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    assert cached(TEXTS, padding=True)["input_ids"] == reference(TEXTS, padding=True)["input_ids"]
    for chat in CHATS:
        for prompt in (False, True):
            kwargs = {"add_generation_prompt": prompt}
            assert cached.apply_chat_template(chat, tokenize=False, **kwargs) == \
                reference.apply_chat_template(chat, tokenize=False, **kwargs)
            assert list(cached.apply_chat_template(chat, tokenize=True, **kwargs)["input_ids"]) == \
                list(reference.apply_chat_template(chat, tokenize=True, **kwargs)["input_ids"])


def streamed_text(tokenizer, prompt: str, output: str) -> list[str]:
    """The text deltas Podium's detokenizer streams for ``output``'s tokens after ``prompt``."""
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt))
    return [detokenizer.append_token(token) for token in tokenizer.encode(output)]


# --------------------------------------------------------------------------- the real SmolLM2 GGUF
def test_cached_smollm2_tokenizer_equals_the_converted_one(tokenizer_cache, converted):
    path, convert = embedded_gguf_path(), CountingConvert()
    first = cache.load_or_convert(path, convert)  # miss: converts and writes
    assert convert.calls == 1 and len(entries(tokenizer_cache)) == 1
    assert entries(tokenizer_cache)[0].startswith("SmolLM2-135M-Instruct.Q4_1-")
    cached = cache.load_or_convert(path, convert)  # hit: loaded from the folder
    assert convert.calls == 1
    assert_same_tokenizer(first, converted)
    assert_same_tokenizer(cached, converted)
    for prompt, output in [("Hi", " naïve café 🙂👍🏽 日本語<|im_end|>"), ("", "  x\n\n\ty")]:
        assert streamed_text(cached, prompt, output) == streamed_text(converted, prompt, output)


def test_cached_tokenizer_follows_bos_and_eos_flags_like_the_converted_one(tokenizer_cache):
    """Setting add_bos_token / add_eos_token later rebuilds the post-processor in both (the saved config omits them)."""
    path = embedded_gguf_path()
    cache.load_or_convert(path, gguf_source.convert_gguf_tokenizer)
    cached, reference = cache.load_or_convert(path, CountingConvert()), gguf_source.convert_gguf_tokenizer(path)
    for tokenizer in (cached, reference):
        tokenizer.add_bos_token = True
        tokenizer.add_eos_token = True
    assert cached.encode("Hello world") == reference.encode("Hello world") == \
        [reference.bos_token_id, *reference.encode("Hello world", add_special_tokens=False), reference.eos_token_id]


def test_resolved_model_tokenizer_comes_from_the_cache(tokenizer_cache, monkeypatch, converted):
    from podium.loader import resolve_model

    first = resolve_model("smollm2-135m-instruct")
    monkeypatch.setattr(gguf_source, "convert_gguf_tokenizer", lambda path: pytest.fail("converted on a cache hit"))
    source = resolve_model("smollm2-135m-instruct")
    assert source.load_seconds["tokenizer"] > 0
    assert source.tokenizer.encode(TEXTS[4]) == first.tokenizer.encode(TEXTS[4]) == converted.encode(TEXTS[4])


def test_cache_hit_imports_neither_gguf_nor_transformers_models(tokenizer_cache):
    """The point of the cache: a hit loads tokenizer.json, without the GGUF reader or transformers' model registry."""
    gguf_source.gguf_tokenizer(embedded_gguf_path())  # fill
    code = """
import json, sys
from podium.loader import embedded_gguf_path, gguf_source
gguf_source.gguf_tokenizer(embedded_gguf_path())
print(json.dumps(sorted(m for m in sys.modules if m == "gguf" or m.startswith(("gguf.", "transformers.models")))))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.splitlines()[-1]) == []


# --------------------------------------------------------------------------- keys
def test_same_file_hits(tokenizer_cache, fake_gguf):
    path, convert = fake_gguf
    cache.load_or_convert(path, convert)
    cache.load_or_convert(path, convert)
    assert convert.calls == 1 and len(entries(tokenizer_cache)) == 1
    manifest = json.loads((tokenizer_cache / entries(tokenizer_cache)[0] / cache.MANIFEST).read_text())
    assert manifest["key"] == cache.key_inputs(path) and manifest["key"]["path"] == str(path.resolve())


def change_key(change: str, path, monkeypatch) -> None:
    """Change one input of ``path``'s cache key."""
    import tokenizers
    import transformers

    mtime = path.stat().st_mtime_ns
    if change == "mtime":
        os.utime(path, ns=(mtime, mtime + 1_000))
    elif change == "size":
        path.write_bytes(path.read_bytes() + b"!")
        os.utime(path, ns=(mtime, mtime))  # the same mtime: the size alone must miss
    elif change == "transformers":
        monkeypatch.setattr(transformers, "__version__", "0.0.0-other")
    elif change == "tokenizers":
        monkeypatch.setattr(tokenizers, "__version__", "0.0.0-other")
    else:
        monkeypatch.setattr(cache, "FORMAT_VERSION", cache.FORMAT_VERSION + 1)


@pytest.mark.parametrize("change", ["mtime", "size", "transformers", "tokenizers", "format"])
def test_a_changed_key_misses(tokenizer_cache, fake_gguf, monkeypatch, change):
    path, convert = fake_gguf
    cache.load_or_convert(path, convert)
    change_key(change, path, monkeypatch)
    cache.load_or_convert(path, convert)
    assert convert.calls == 2 and len(entries(tokenizer_cache)) == 2
    cache.load_or_convert(path, convert)
    assert convert.calls == 2  # the new key hits from then on


# --------------------------------------------------------------------------- broken, unwritable, raced, off
def _garbage(folder):
    (folder / "tokenizer.json").write_text("{not json")


def _truncated(folder):
    data = (folder / "tokenizer.json").read_bytes()
    (folder / "tokenizer.json").write_bytes(data[: len(data) // 2])


def _no_manifest(folder):
    (folder / cache.MANIFEST).unlink()


def _manifest_of_another_file(folder):
    manifest = json.loads((folder / cache.MANIFEST).read_text())
    manifest["key"]["mtime_ns"] += 1
    (folder / cache.MANIFEST).write_text(json.dumps(manifest))


def _empty(folder):
    for file in folder.iterdir():
        file.unlink()


def _a_file(folder):
    _empty(folder)
    folder.rmdir()
    folder.write_text("not a folder")


@pytest.mark.parametrize("corrupt", [_garbage, _truncated, _no_manifest, _manifest_of_another_file, _empty, _a_file],
                         ids=lambda f: f.__name__.strip("_"))
def test_a_broken_entry_falls_back_to_converting_and_is_replaced(tokenizer_cache, fake_gguf, converted, caplog,
                                                                 corrupt):
    path, convert = fake_gguf
    cache.load_or_convert(path, convert)
    [name] = entries(tokenizer_cache)
    corrupt(tokenizer_cache / name)
    with caplog.at_level(logging.WARNING, logger=cache.__name__):
        tokenizer = cache.load_or_convert(path, convert)
    assert tokenizer is converted and convert.calls == 2
    assert any("unreadable" in r.getMessage() and name in r.getMessage() for r in caplog.records)
    assert entries(tokenizer_cache) == [name]  # replaced, nothing left aside
    assert cache.load_or_convert(path, convert).encode(TEXTS[5]) == converted.encode(TEXTS[5])
    assert convert.calls == 2


def test_disabled_cache_neither_reads_nor_writes(tokenizer_cache, fake_gguf, monkeypatch):
    path, convert = fake_gguf
    monkeypatch.setenv(cache.CACHE_ENV, "0")
    cache.load_or_convert(path, convert)
    assert convert.calls == 1 and not tokenizer_cache.exists()
    monkeypatch.setenv(cache.CACHE_ENV, "1")
    cache.load_or_convert(path, convert)  # fills
    monkeypatch.setenv(cache.CACHE_ENV, "off")
    cache.load_or_convert(path, convert)
    assert convert.calls == 3  # the entry there is not read either


def test_the_engine_setting_wins_over_its_environment_alias(tokenizer_cache, fake_gguf, monkeypatch):
    path, convert = fake_gguf
    monkeypatch.setenv(cache.CACHE_ENV, "1")
    cache.load_or_convert(path, convert, enabled=False)  # EngineConfig.tokenizer_cache=False
    assert convert.calls == 1 and not tokenizer_cache.exists()
    monkeypatch.setenv(cache.CACHE_ENV, "0")
    cache.load_or_convert(path, convert, enabled=True)  # fills despite the alias
    cache.load_or_convert(path, convert, enabled=True)
    assert convert.calls == 2 and len(entries(tokenizer_cache)) == 1


def test_an_unknown_switch_value_is_an_error(monkeypatch, fake_gguf):
    monkeypatch.setenv(cache.CACHE_ENV, "sometimes")
    with pytest.raises(ValueError, match="PODIUM_TOKENIZER_CACHE='sometimes'.*set it to 0"):
        cache.load_or_convert(*fake_gguf)


def test_an_unwritable_cache_still_loads(tmp_path, monkeypatch, fake_gguf, converted, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("XDG_CACHE_HOME points here, so no folder can be made under it")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    monkeypatch.setenv(cache.CACHE_ENV, "1")
    with caplog.at_level(logging.WARNING, logger=cache.__name__):
        assert cache.load_or_convert(*fake_gguf) is converted
    assert any("cannot write" in r.getMessage() and cache.CACHE_ENV in r.getMessage() for r in caplog.records)


def test_a_process_that_loses_the_rename_race_keeps_the_winners_entry(tokenizer_cache, fake_gguf, converted,
                                                                       caplog):
    path, _ = fake_gguf
    inputs = cache.key_inputs(path)
    folder = cache.entry_folder(inputs)
    cache._store(converted, folder, inputs)  # the winner
    (folder / "winner").write_text("")
    with caplog.at_level(logging.WARNING, logger=cache.__name__):
        cache._store(converted, folder, inputs)  # the loser: its rename fails, its copy goes
    assert caplog.records == []
    assert entries(tokenizer_cache) == [folder.name] and (folder / "winner").exists()


class FailingSave:
    """A tokenizer whose save_pretrained writes part of the folder, then fails."""

    def save_pretrained(self, folder):
        with open(os.path.join(folder, "tokenizer.json"), "w") as f:
            f.write("{")
        raise RuntimeError("disk full")


def test_a_failed_write_leaves_no_entry(tokenizer_cache, fake_gguf, caplog):
    path, _ = fake_gguf
    tokenizer = FailingSave()
    with caplog.at_level(logging.WARNING, logger=cache.__name__):
        assert cache.load_or_convert(path, lambda p: tokenizer) is tokenizer
    assert entries(tokenizer_cache) == []  # no half-written entry, no temporary folder left
    assert any("disk full" in r.getMessage() for r in caplog.records)
