"""One streamed request to an OpenAI-compatible server, timed chunk by chunk.

The request streams (``"stream": true``) and asks for usage in the final chunk
(``stream_options.include_usage``). A chunk "carries tokens" when it has a choice and, for chat,
its delta has content (possibly "", e.g. a partial UTF-8 character) and is not the role-only
opening chunk nor an empty closing ``{}`` delta. Completions chunks with a choice always count,
as in vLLM's client: their text is "" when a model has no tokenizer. Token counts come from the
server's usage when it sends one, else the output count is the number of token-carrying chunks
and the input count the dataset's.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from .datasets import BenchRequest
from .metrics import RequestTiming

ENDPOINTS = {"completions": "/completions", "chat": "/chat/completions"}


@dataclass(frozen=True)
class PayloadOptions:
    endpoint: str = "completions"
    model: str = ""
    ignore_eos: bool = False
    temperature: float = 0.0
    extra_body: dict | None = None

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")


def api_url(base_url: str, endpoint: str) -> str:
    """``{base}/v1/completions`` or ``{base}/v1/chat/completions``; ``base`` may end in ``/v1``."""
    base = base_url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ValueError(f"--base-url must start with http:// or https://, got {base_url!r}")
    if not base.endswith("/v1"):
        base += "/v1"
    return base + ENDPOINTS[endpoint]


def prompt_of(request: BenchRequest, tokenizer: Any, endpoint: str) -> str | list[int]:
    """The prompt to send: the dataset's text, the decoded token ids, or (completions) the ids."""
    if request.prompt is not None:
        return request.prompt
    if tokenizer is not None:
        return tokenizer.decode(list(request.prompt_token_ids))
    if endpoint == "chat":
        raise ValueError("the chat endpoint needs text prompts: give --tokenizer (a model folder, GGUF or name)")
    return list(request.prompt_token_ids)


def build_payload(request: BenchRequest, prompt: str | list[int], options: PayloadOptions,
                  max_tokens: int | None = None) -> dict:
    payload: dict[str, Any] = {
        "model": options.model,
        "max_tokens": max_tokens or request.output_len,
        "temperature": options.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if options.endpoint == "chat":
        payload["messages"] = [{"role": "user", "content": prompt}]
    else:
        payload["prompt"] = prompt
    if options.ignore_eos:
        payload["ignore_eos"] = True
    payload.update(options.extra_body or {})
    return payload


def carries_tokens(chunk: dict) -> bool:
    """Whether a parsed stream chunk delivers generated tokens (see the module docstring)."""
    choices = chunk.get("choices") or []
    if not choices:
        return False
    choice = choices[0]
    if "delta" not in choice:
        return True  # completions: one chunk per step; its text may be "" (no tokenizer, partial UTF-8)
    delta = choice.get("delta") or {}
    if delta.get("content") or delta.get("reasoning_content"):
        return True
    return "role" not in delta and delta.get("content") is not None


def parse_sse_line(line: str) -> dict | str | None:
    """A parsed ``data:`` payload, ``"[DONE]"``, or None for comments, blank and other fields."""
    if not line.startswith("data:"):
        return None
    data = line[len("data:"):].strip()
    if data == "[DONE]":
        return data
    return json.loads(data) if data else None


async def send_streaming(client, url: str, payload: dict, expected_input_len: int,
                         headers: dict | None = None) -> RequestTiming:
    """POST ``payload`` with streaming, recording when each token-carrying chunk arrives."""
    start = time.perf_counter()
    timing = RequestTiming(success=False, start=start, end=start, input_tokens=expected_input_len)
    usage = None
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", "replace")
                timing.error = f"HTTP {response.status_code}: {body[:300]}"
            else:
                async for line in response.aiter_lines():
                    now = time.perf_counter()
                    data = parse_sse_line(line)
                    if data is None or data == "[DONE]":
                        continue
                    if "error" in data:
                        timing.error = f"stream error: {str(data['error'])[:300]}"
                        break
                    if carries_tokens(data):
                        timing.chunk_times.append(now)
                    usage = data.get("usage") or usage
    except Exception as exc:  # a failed request is a result, never a crash of the benchmark
        timing.error = f"{type(exc).__name__}: {exc}"
    timing.end = time.perf_counter()
    if not timing.error and not timing.chunk_times:
        timing.error = "the stream carried no generated text"
    timing.success = not timing.error
    timing.output_tokens = len(timing.chunk_times)
    if usage:
        timing.output_tokens = int(usage.get("completion_tokens") or timing.output_tokens)
        timing.input_tokens = int(usage.get("prompt_tokens") or timing.input_tokens)
    return timing
