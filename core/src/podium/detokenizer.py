"""Incremental detokenization: the text each new token adds, without decoding the whole sequence.

Decoding one token alone is wrong in two ways: a SentencePiece decoder strips the leading space
of the first token it sees ("▁world" alone -> "world"), and a character split over several byte
tokens (byte-fallback ``<0xE4>``, or byte-level BPE pieces of an emoji) decodes to U+FFFD until its
last byte arrives. So each sequence keeps a small *window* of token ids and decodes only that:

    ids:  [ context ... | emitted ... | pending ... ]
           ^ window start              ^ read: tokens before it have been emitted as text

    full = decode(window)                  one small decode per step
    if full ends in U+FFFD: emit nothing   (a character is still incomplete; wait for more bytes)
    else: emit full[emitted:]              (``emitted`` = characters of ``full`` already emitted)

The window keeps at least one emitted token in front of the new ones (so leading spaces come out
right) and slides forward once it holds ``WINDOW`` tokens, always to a token where an earlier
step ended cleanly (never mid-character). Sliding costs one extra decode, so a step costs about
one decode of a few tokens. With ``skip_special_tokens`` special tokens never enter the window.

Byte-level BPE tokenizers (GPT-2 style: Llama 3, Qwen, SmolLM2) have a faster exact path: their
decoder maps every token to fixed bytes, so a token's bytes are memoised and fed to a streaming
UTF-8 decoder, which holds back an incomplete character by itself; no decode call at all.
"""

from __future__ import annotations

import codecs
import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

REPLACEMENT = "\ufffd"
PROMPT_CONTEXT = 5  # prompt tokens decoded in front of the first output token
WINDOW = 8  # slide the window forward once it holds this many tokens
METHODS = ("auto", "window", "bytes")


def _byte_level_chars() -> dict[str, int]:
    """The byte-level BPE alphabet: printable bytes stand for themselves, the rest for 256 + n."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF_CHAR = _byte_level_chars()


@dataclass
class _TokenizerInfo:
    """What the detokenizers of one tokenizer share: how to decode, which ids are special."""

    decode: Callable[[list[int], bool], str]  # (ids, skip_special_tokens) -> text
    special_ids: frozenset[int]
    anchor: list[int]  # ids of a short text decoded in front of a lone token (keeps its leading space)
    anchor_len: int
    id_to_token: Callable[[int], str | None] | None  # set only for a pure byte-level decoder
    token_text: dict[int, str] = field(default_factory=dict)
    token_bytes: dict[int, bytes] = field(default_factory=dict)

    def bytes_of(self, token_id: int) -> bytes:
        """The bytes a byte-level decoder gives for one token (memoised)."""
        data = self.token_bytes.get(token_id)
        if data is None:
            token = self.id_to_token(token_id)
            if token is None:
                # an id past the tokenizer's vocabulary: a model's embedding is often padded beyond it
                # (Qwen2.5: 151,936 rows for 151,665 tokens) and can sample there. It has no text, as in
                # the tokenizer's own decode; raising would fail every request of the step.
                self.token_bytes[token_id] = b""
                return b""
            try:
                data = bytes(_BYTE_OF_CHAR[c] for c in token)
            except KeyError:  # an added token outside the byte alphabet stands for its own text
                data = token.encode()
            self.token_bytes[token_id] = data
        return data


_INFO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> _TokenizerInfo (a memo)


def _make_decode(tokenizer) -> Callable[[list[int], bool], str]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # a fast tokenizer: call the Rust decoder directly (~1 µs)
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def _byte_level_lookup(tokenizer) -> Callable[[int], str | None] | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        from tokenizers.decoders import ByteLevel
    except ImportError:
        return None
    return backend.id_to_token if isinstance(backend.decoder, ByteLevel) else None


def _special_ids(tokenizer) -> frozenset[int]:
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids = {i for i, tok in added.items() if getattr(tok, "special", False)}
    return frozenset(ids | set(getattr(tokenizer, "all_special_ids", []) or []))


def _anchor(tokenizer, decode: Callable[[list[int], bool], str]) -> tuple[list[int], int]:
    try:
        ids = list(tokenizer.encode("a", add_special_tokens=False))
    except (AttributeError, TypeError, ValueError):
        return [], 0
    text = decode(ids, False)
    return (ids, len(text)) if text == "a" else ([], 0)


def _tokenizer_info(tokenizer) -> _TokenizerInfo:
    try:
        info = _INFO.get(tokenizer)
    except TypeError:  # not weak-referenceable or not hashable: no memo
        info = None
    if info is None:
        decode = _make_decode(tokenizer)
        anchor, anchor_len = _anchor(tokenizer, decode)
        info = _TokenizerInfo(decode, _special_ids(tokenizer), anchor, anchor_len, _byte_level_lookup(tokenizer))
        try:
            _INFO[tokenizer] = info
        except TypeError:
            pass
    return info


def decode_token(tokenizer, token_id: int) -> str:
    """One token's text as it reads inside a sequence (leading space kept), for logprob display.

    Special tokens show as their text; a token holding part of a character shows U+FFFD. Memoised
    per tokenizer.
    """
    info = _tokenizer_info(tokenizer)
    text = info.token_text.get(token_id)
    if text is None:
        text = info.decode([*info.anchor, token_id], False)[info.anchor_len:]
        info.token_text[token_id] = text
    return text


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte-fallback pieces


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The raw bytes one token stands for (OpenAI's logprob ``bytes``): a byte-level BPE token's
    bytes, a byte-fallback piece's one byte, else the UTF-8 of its text. A token holding part of a
    character gives those bytes, not U+FFFD. Memoised per tokenizer.
    """
    info = _tokenizer_info(tokenizer)
    data = info.token_bytes.get(token_id)
    if data is not None:
        return data
    if info.id_to_token is not None and info.id_to_token(token_id) is not None:
        return info.bytes_of(token_id)  # memoises in token_bytes too
    piece = tokenizer.convert_ids_to_tokens(token_id) if hasattr(tokenizer, "convert_ids_to_tokens") else None
    match = _BYTE_FALLBACK.fullmatch(piece) if isinstance(piece, str) else None
    data = info.token_bytes[token_id] = bytes([int(match.group(1), 16)]) if match else decode_token(tokenizer, token_id).encode()
    return data


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text, a delta per ``append``; ``text`` is the sum.

    ``spaces_between_special_tokens`` is accepted for vLLM compatibility; like Hugging Face fast
    tokenizers (and vLLM with them) the tokenizer's own decoder decides the spacing. ``method``:
    "window" (any tokenizer), "bytes" (byte-level BPE only) or "auto" (bytes where it applies).
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True, *, method: str = "auto") -> None:
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        info = _tokenizer_info(tokenizer)
        if method == "bytes" and info.id_to_token is None:
            raise ValueError("method 'bytes' needs a fast tokenizer with a byte-level decoder")
        self._info = info
        self._skip = skip_special_tokens
        self._special = info.special_ids if skip_special_tokens else frozenset()
        self.text = ""
        self._utf8 = None
        if method != "window" and info.id_to_token is not None:
            self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
            return
        self._decode = info.decode
        context = self._keep(prompt_token_ids)[-PROMPT_CONTEXT:]
        # never start the window inside a character: drop leading tokens that decode to U+FFFD
        while context and self._decode(context, self._skip).startswith(REPLACEMENT):
            context = context[1:]
        self._ids = context  # the window
        self._read = len(context)  # ids[:read] are emitted (or context)
        self._last_clean = 0  # an earlier clean boundary before ``read``: where a slide may go
        self._emitted = len(self._decode(context, self._skip)) if context else 0

    def _keep(self, token_ids: list[int]) -> list[int]:
        special = self._special
        return [t for t in token_ids if t not in special] if special else list(token_ids)

    def append_token(self, token_id: int) -> str:
        """``append([token_id])`` without the list: the per-step call of a byte-level tokenizer."""
        if self._utf8 is None:
            return self.append([token_id])
        if token_id in self._special:
            return ""
        data = self._info.token_bytes.get(token_id) or self._info.bytes_of(token_id)
        delta = self._utf8.decode(data)
        if delta:
            self.text += delta
        return delta

    def append(self, token_ids: list[int]) -> str:
        """Add newly sampled tokens; returns the text they complete (may be empty)."""
        if self._utf8 is not None and len(token_ids) == 1:  # the per-step common case, kept lean
            token_id = token_ids[0]
            if token_id in self._special:
                return ""
            data = self._info.token_bytes.get(token_id) or self._info.bytes_of(token_id)
            delta = self._utf8.decode(data)
            self.text += delta
            return delta
        new = self._keep(token_ids)
        if not new:
            return ""
        if self._utf8 is not None:
            delta = self._utf8.decode(b"".join(self._info.bytes_of(t) for t in new))
        else:
            delta = self._window_step(new)
        self.text += delta
        return delta

    def _window_step(self, new: list[int]) -> str:
        ids = self._ids
        ids.extend(new)
        full = self._decode(ids, self._skip)
        if full.endswith(REPLACEMENT) or len(full) < self._emitted:
            return ""  # a character is still incomplete
        delta = full[self._emitted:]
        self._emitted = len(full)
        self._last_clean, self._read = self._read, len(ids)
        if len(ids) >= WINDOW and self._last_clean > 0:
            self._slide()
        return delta

    def _slide(self) -> None:
        """Drop the tokens before the last clean boundary; the window then decodes afresh."""
        self._ids = self._ids[self._last_clean:]
        self._read = len(self._ids)
        self._last_clean = 0
        self._emitted = len(self._decode(self._ids, self._skip))
