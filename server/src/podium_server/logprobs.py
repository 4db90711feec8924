"""The engine's per-token logprobs in OpenAI's two formats.

The engine gives, per generated token, ``{token_id: Logprob(logprob, rank, decoded_token)}``
holding the sampled token and the top-N (rank 1 = most likely). Completions want parallel lists
(``tokens``, ``token_logprobs``, ``top_logprobs`` as ``{text: logprob}`` with the sampled token
added, ``text_offset``); chat wants ``content: [{token, logprob, bytes, top_logprobs: [...]}]``
with exactly the N most likely in ``top_logprobs``. ``bytes`` are the token's raw UTF-8 bytes,
which matter when a token holds only part of a character.
"""

from __future__ import annotations

from podium import token_bytes

from .protocol import ChatLogprobs, ChatLogprobToken, ChatLogprobTop, CompletionLogprobs

_FLOOR = -9999.0  # JSON has no -inf: an impossible token's logprob is shown as this (as vLLM does)


def finite(logprob: float) -> float:
    return logprob if logprob == logprob and logprob > _FLOOR else _FLOOR


class TokenText:
    """Text and raw bytes of single tokens of one tokenizer."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer

    def text(self, token_id: int, decoded: str | None) -> str:
        if decoded is not None:
            return decoded
        return self._tokenizer.decode([token_id]) if self._tokenizer is not None else f"<{token_id}>"

    def bytes(self, token_id: int, decoded: str | None) -> list[int]:
        if self._tokenizer is not None:
            return list(token_bytes(self._tokenizer, token_id))  # memoised per tokenizer in the core
        return list(self.text(token_id, decoded).encode("utf-8"))


def _ranked(position: dict, top_n: int) -> list[tuple[int, object]]:
    """The position's N most likely entries, most likely first."""
    entries = sorted(position.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0, -kv[1].logprob))
    return [(tid, lp) for tid, lp in entries if lp.rank is None or lp.rank <= top_n][:top_n]


def completion_logprobs(token_ids: list[int], positions: list, top_n: int, text_offset: int,
                        texts: TokenText) -> CompletionLogprobs:
    """Completions format for ``token_ids`` (each with its ``positions`` entry); offsets start at ``text_offset``."""
    result = CompletionLogprobs()
    for token_id, position in zip(token_ids, positions):
        if position is None:  # the first prompt token has no logprob
            result.tokens.append(texts.text(token_id, None))
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
        else:
            chosen = position.get(token_id)
            result.tokens.append(texts.text(token_id, chosen.decoded_token if chosen else None))
            result.token_logprobs.append(finite(chosen.logprob) if chosen else None)
            top = {texts.text(tid, lp.decoded_token): finite(lp.logprob) for tid, lp in _ranked(position, top_n)}
            if chosen is not None:
                top.setdefault(result.tokens[-1], finite(chosen.logprob))
            result.top_logprobs.append(top)
        result.text_offset.append(text_offset)
        text_offset += len(result.tokens[-1])
    return result


def chat_logprobs(token_ids: list[int], positions: list, top_n: int, texts: TokenText) -> ChatLogprobs:
    content = []
    for token_id, position in zip(token_ids, positions):
        chosen = position.get(token_id)
        decoded = chosen.decoded_token if chosen else None
        top = [ChatLogprobTop(token=texts.text(tid, lp.decoded_token), logprob=finite(lp.logprob),
                              bytes=texts.bytes(tid, lp.decoded_token)) for tid, lp in _ranked(position, top_n)]
        content.append(ChatLogprobToken(token=texts.text(token_id, decoded),
                                        logprob=finite(chosen.logprob) if chosen else _FLOOR,
                                        bytes=texts.bytes(token_id, decoded), top_logprobs=top))
    return ChatLogprobs(content=content)
