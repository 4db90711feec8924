"""One choice's output text -> reasoning, content and tool calls, for every chat-like endpoint.

``OutputParsing`` holds the parsers a request uses (a reasoning parser if the server has one; a
tool parser if the request has tools and lets the model choose, or a forced-call parser when a
grammar makes the calls). The reasoning split runs first; the tool parser reads only the answer
after it, which is also all that a constraint applies to (``after_reasoning``). ``final`` gives the
non-streamed message; ``OutputStream`` (one per streamed choice) turns the text so far into the
deltas that are new.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from podium.sampling_params import StructuredOutputsParams

from .errors import bad_request
from .reasoning import ReasoningParser, get_reasoning_parser
from .tool_parsers import ToolCall, ToolCallDelta, ToolCallStream, ToolParser, get_tool_parser
from .tool_parsers.forced import AnyToolParser, NamedToolParser, any_tool_schema


@dataclass(frozen=True)
class ParsedOutput:
    reasoning: str | None
    content: str
    tool_calls: list[ToolCall]


@dataclass
class OutputDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


@dataclass(frozen=True)
class OutputParsing:
    reasoning: ReasoningParser | None = None
    tools: ToolParser | None = None
    # special tokens' texts: when the text keeps them (``keeps_special_tokens``), the one that ended
    # the output (EOS) is not part of the answer
    end_texts: tuple[str, ...] = ()

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tools is not None

    @property
    def keeps_special_tokens(self) -> bool:
        return self.tools is not None and self.tools.keeps_special_tokens

    def without_end(self, text: str) -> str:
        for end in self.end_texts:
            if end and text.endswith(end):
                return text[:-len(end)]
        return text

    def final(self, text: str) -> ParsedOutput:
        text = self.without_end(text)
        reasoning, content = self.reasoning.split(text, final=True) if self.reasoning else (None, text)
        if self.tools is None:
            return ParsedOutput(reasoning, content, [])
        extracted = self.tools.extract(content)
        return ParsedOutput(reasoning, extracted.content, extracted.calls)

    def stream(self) -> OutputStream:
        return OutputStream(self)

    def after_reasoning(self, constraint: StructuredOutputsParams | None, tokenizer) -> StructuredOutputsParams | None:
        """``constraint`` applied to the answer only, after the reasoning parser's section (as vLLM
        does: the grammar does not constrain the thinking)."""
        if constraint is None or self.reasoning is None or tokenizer is None:
            return constraint
        return replace(constraint, reasoning=self.reasoning.markers(tokenizer))


class OutputStream:
    def __init__(self, parsing: OutputParsing) -> None:
        self.parsing = parsing
        self._reasoning_sent = 0
        self._content_sent = 0
        self._tools = ToolCallStream(parsing.tools) if parsing.tools is not None else None

    @property
    def num_tool_calls(self) -> int:
        return self._tools.num_calls if self._tools is not None else 0

    def update(self, text: str, final: bool) -> OutputDelta:
        """What ``text`` (the choice's whole text so far) adds to what was sent."""
        if final:
            text = self.parsing.without_end(text)
        reasoning, content = (self.parsing.reasoning.split(text, final) if self.parsing.reasoning
                              else (None, text))
        delta = OutputDelta()
        if reasoning is not None and len(reasoning) > self._reasoning_sent:
            delta.reasoning = reasoning[self._reasoning_sent:]
            self._reasoning_sent = len(reasoning)
        if self._tools is not None:
            if content or final:
                tools = self._tools.update(content, final)
                delta.content, delta.tool_calls = tools.content, tools.tool_calls
        elif len(content) > self._content_sent:
            delta.content = content[self._content_sent:]
            self._content_sent = len(content)
        return delta


def output_parsing(ctx, tools_auto: bool, forced: ToolParser | None = None) -> OutputParsing:
    """The parsers for one request of the server ``ctx`` (``tools_auto``: it has tools, the model
    chooses; ``forced``: the parser of calls a grammar makes)."""
    reasoning = get_reasoning_parser(ctx.reasoning_parser) if ctx.reasoning_parser else None
    tools = forced
    if tools_auto and forced is None:
        if not (ctx.auto_tool_choice and ctx.tool_call_parser):
            raise bad_request('tool_choice "auto" needs the server started with --enable-auto-tool-choice and '
                              "--tool-call-parser NAME (the model family's tool-call format)", param="tool_choice")
        tools = get_tool_parser(ctx.tool_call_parser)
    end_texts = ()
    if tools is not None and tools.keeps_special_tokens:
        end_texts = tuple(sorted(getattr(ctx.tokenizer, "all_special_tokens", None) or (), key=len, reverse=True))
    return OutputParsing(reasoning, tools, end_texts)


def tool_call_handling(ctx, choice: str, tools: dict[str, dict], named: str | None = None,
                       param: str = "tool_choice") -> tuple[OutputParsing, StructuredOutputsParams | None]:
    """(parsing, structured_outputs) for a tool choice: ``auto`` (the tool-call parser reads free text),
    ``none``, ``required`` (any tool, forced by a grammar) or ``named`` (that tool, forced)."""
    if choice in ("auto", "none"):
        return output_parsing(ctx, tools_auto=choice == "auto" and bool(tools)), None
    if not tools:
        raise bad_request(f"tool_choice {choice!r} needs tools", param=param)
    if choice == "named":
        if named not in tools:
            raise bad_request(f"tool_choice names the tool {named!r}, which is not among the tools "
                              f"({', '.join(tools)})", param=param)
        return output_parsing(ctx, False, NamedToolParser(named)), StructuredOutputsParams(json=tools[named])
    return output_parsing(ctx, False, AnyToolParser()), StructuredOutputsParams(json=any_tool_schema(list(tools.items())))
