"""Streaming a parser's result: the difference between the parse of the text so far and what was sent.

Deltas follow OpenAI's ``tool_calls`` stream: a call's first delta carries its id and name (and
empty arguments); the next ones carry argument fragments. A call is announced only once every
call before it has been, so indices arrive in order. If the text stops being well-formed tool
calls, everything not yet streamed goes out as content.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .base import TextParse, ToolParser


@dataclass(frozen=True)
class ToolCallDelta:
    index: int
    id: str | None = None  # with the name, in a call's first delta
    name: str | None = None
    arguments: str = ""


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ToolCallStream:
    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self._content_sent = 0
        self._args_sent: list[int] = []  # per announced call
        self._plain = False  # the text turned out not to be tool calls

    @property
    def num_calls(self) -> int:
        return len(self._args_sent)

    def update(self, text: str, final: bool) -> StreamDelta:
        """What ``text`` (the whole text so far) adds to what was streamed."""
        parsed = TextParse(text)
        if not self._plain:
            try:
                parsed = self.parser.parse(text, final)
            except ValueError:
                self._plain = True
        delta = StreamDelta()
        if len(parsed.content) > self._content_sent:
            delta.content = parsed.content[self._content_sent:]
            self._content_sent = len(parsed.content)
        for index, draft in enumerate(parsed.calls):
            if index == len(self._args_sent):
                if draft.name is None:
                    break
                delta.tool_calls.append(ToolCallDelta(index, self.parser.new_call_id(), draft.name))
                self._args_sent.append(0)
            sent = self._args_sent[index]
            if len(draft.arguments) > sent:
                delta.tool_calls.append(ToolCallDelta(index, arguments=draft.arguments[sent:]))
                self._args_sent[index] = len(draft.arguments)
        return delta
