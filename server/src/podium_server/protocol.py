"""The OpenAI wire format: request and response models for every endpoint, in one place.

Requests reject unknown fields ("Unrecognized request argument supplied", as OpenAI does) so a
typo is never silently ignored. Features the engine does not have yet (images, audio) are
declared here so they can be refused with a clear 400 by the handlers.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's
    include_obfuscation: bool | None = None  # OpenAI pads chunks against side channels; ignored here


class SamplingFields(StrictModel):
    """Sampling fields shared by completions and chat completions (OpenAI names plus vLLM's extras)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    priority: int = Field(0, ge=-(2**63), le=2**63 - 1)  # vLLM's: admission order under --scheduling-policy priority
    # vLLM's structured output fields (structured_outputs.py)
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    # accepted and ignored (a debug log line): bookkeeping fields of OpenAI's API that do not change
    # the output here (IGNORED_FIELDS)
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None  # prefix caching needs no key: it matches the prompt's blocks
    safety_identifier: str | None = None

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.lstrip("-").isdigit():
                raise ValueError(f"keys must be token ids, got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"values must be in [-100, 100], got {bias} for token {key}")
        return value

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return value


# -- completions -------------------------------------------------------------------------------
Prompt = str | list[str] | list[int] | list[list[int]]


# fields accepted from OpenAI's API that change nothing here: a debug log line names them
IGNORED_FIELDS = ("store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier", "user",
                  "verbosity", "web_search_options", "prompt_cache_retention")


class CompletionRequest(SamplingFields):
    # checked by _check_prompt (pydantic's union errors are unreadable); the schema declares the union
    prompt: Any = Field(json_schema_extra={"anyOf": [
        {"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1},
        {"type": "array", "items": {"type": "integer"}, "minItems": 1},
        {"type": "array", "items": {"type": "array", "items": {"type": "integer"}, "minItems": 1}, "minItems": 1}]})
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value: Any) -> Prompt:
        shape = "a string, a list of strings, a list of token ids or a list of token-id lists"
        if isinstance(value, str):
            return value
        if not isinstance(value, list) or not value:
            raise ValueError(f"must be {shape} (and not empty)")
        if all(isinstance(p, str) for p in value):
            return value
        if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return value
        if all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
               for p in value):
            return value
        raise ValueError(f"must be {shape}")


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# -- chat completions --------------------------------------------------------------------------
class ContentPart(BaseModel):
    """One part of a message's content; only ``text`` parts are supported yet (checked by the handler)."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    # function_call and audio are refused by the handler (with "not supported yet"), any other key
    # too, so the schema declares no other keys
    model_config = ConfigDict(extra="allow", json_schema_extra={"additionalProperties": False})
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls (reach the chat template)
    tool_call_id: str | None = None  # a tool message's answer to that call
    refusal: str | None = None  # an assistant message's refusal, as OpenAI returns it (not shown to the model)


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class PredictionText(BaseModel):
    type: Literal["text"]
    text: str


class Prediction(BaseModel):
    """OpenAI's Predicted Outputs: text the answer is expected to repeat. With n-gram speculation
    (``--speculative-config '{"method": "ngram", ...}'``) its tokens join the request's lookup, so
    the parts of the answer that match it are drafted from it; otherwise it changes nothing."""

    type: Literal["content"]
    content: str | list[PredictionText]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    # the chat template's thinking switch (enable_thinking) where the template has one
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    prediction: Prediction | None = None  # predicted output: drafts for n-gram speculation
    web_search_options: dict[str, Any] | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    # vLLM's extras
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the template (enable_thinking)


class ChatLogprobTop(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(ChatLogprobTop):
    top_logprobs: list[ChatLogprobTop] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobToken] | None = None


class FunctionCall(BaseModel):
    """A call's function: whole (name and arguments), or in a streamed piece only what it adds."""

    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ToolCall(BaseModel):
    """A tool call, whole (a response) or a streamed piece of one (``index`` set; id, type and name
    come in its first piece, argument fragments after)."""

    index: int | None = None
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCall

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class _OmitsUnusedParts(BaseModel):
    """Leaves out ``reasoning_content`` and ``tool_calls`` when there are none (plain chat bytes stay
    as they are)."""

    @model_serializer(mode="wrap")
    def _omit_unused(self, handler):
        data = handler(self)
        for key in ("reasoning_content", "tool_calls"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


class ChatResponseMessage(_OmitsUnusedParts):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class DeltaMessage(BaseModel):
    """Only the fields a chunk sets are written (OpenAI sends the role in the first chunk only)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _set_fields_only(self, handler: Any) -> dict:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


# -- the small endpoints -----------------------------------------------------------------------
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "podium"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's ``POST /v1/load_lora_adapter`` body."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's ``POST /v1/unload_lora_adapter`` body (``lora_int_id`` accepted, the name decides)."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


class TokenizeRequest(StrictModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


# -- embeddings --------------------------------------------------------------------------------
EmbeddingInput = str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(StrictModel):
    """``POST /v1/embeddings``: OpenAI's fields plus vLLM's ``normalize`` and ``add_special_tokens``."""

    input: EmbeddingInput
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM extras
    normalize: bool | None = None  # None: the model's own setting
    add_special_tokens: bool = True


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64: the little-endian float32 bytes


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("embd"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
