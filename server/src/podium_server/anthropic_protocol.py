"""Anthropic's Messages wire format (``/v1/messages``): the request models; responses are built as dicts.

Requests reject unknown fields, as the other endpoints do. Content blocks are checked by the handler
(``serving_messages``), which names the block that is wrong.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class AnthropicModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Block(BaseModel):
    """One content block; which fields it needs depends on ``type`` (checked by the handler)."""

    model_config = ConfigDict(extra="allow")
    type: str


class AnthropicMessage(AnthropicModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="allow")  # cache_control, type ("custom") and the like
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]


class AnthropicToolChoice(AnthropicModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class CountTokensRequest(AnthropicModel):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    output_config: dict[str, Any] | None = None  # {"format": {"type": "json_schema", "schema"}}; effort ignored
