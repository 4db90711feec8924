"""The streamed chunks' fast path renders the very bytes pydantic renders, whatever the text."""

from __future__ import annotations

import pytest

from podium_server.protocol import (
    ChatCompletionChunk,
    ChatStreamChoice,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
)
from podium_server.serving_base import ChunkTemplate

TEXTS = ["", " hello", 'say "hi"', "back\\slash", "line\nbreak\ttab\r", "\x01\x1f\x7f", "café ☕ 日本",
         "\u2028\u2029", "</script>", "🙂 emoji"]


def completion(text: str, index: int = 3) -> CompletionResponse:
    return CompletionResponse(id="cmpl-1", created=7, model='m"odel', choices=[CompletionChoice(index=index, text=text)])


def chat(text: str, index: int = 1) -> ChatCompletionChunk:
    return ChatCompletionChunk(id="chatcmpl-1", created=7, model="m",
                               choices=[ChatStreamChoice(index=index, delta=DeltaMessage(content=text))])


@pytest.mark.parametrize("build", [completion, chat])
@pytest.mark.parametrize("text", TEXTS)
def test_rendered_equals_pydantic(build, text):
    assert ChunkTemplate(build(ChunkTemplate.PLACEHOLDER)).render(text) == build(text).model_dump_json()


def test_a_chunk_without_the_placeholder_is_refused():
    with pytest.raises(ValueError, match="placeholder"):
        ChunkTemplate(completion("no placeholder"))
