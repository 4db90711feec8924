"""Chat prompts: messages rendered to token ids by the model's chat template, in one place.

The engine renders a ``ChatPrompt`` when the request is added (``LLMEngine.add_request``), so a
server hands the conversation over as it is and a template that rejects it comes back as a
``ChatTemplateError`` naming the problem. ``render_chat`` is also what ``/tokenize`` and
``LLM.chat`` use: one definition of how messages become tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ChatTemplateError

# the switch Qwen3-style templates read to think before answering (chat_template_kwargs)
THINKING_SWITCH = "enable_thinking"


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation for the engine to render: ``messages`` as the template takes them
    (``{"role", "content"}`` dicts), plus the template's own variables."""

    messages: list[dict]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # a template's text or a file holding one; None: the model's
    tools: list[dict] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)


def read_chat_template(template: str | None) -> str | None:
    """A chat template given as its text or as a file holding it (vLLM takes both)."""
    if template is None or "{" in template:
        return template
    path = Path(template).expanduser()
    if not path.is_file():
        raise ChatTemplateError(f"chat_template {template!r} is neither a Jinja template nor a readable file",
                                param="chat_template")
    return path.read_text()


def template_source(tokenizer: Any, chat_template: str | None = None) -> str | None:
    """The template's text that would render: the given one, else the tokenizer's (None: no template)."""
    template = read_chat_template(chat_template)
    if template is None and tokenizer is not None:
        template = getattr(tokenizer, "chat_template", None)
    return template if isinstance(template, str) else None


def render_chat(tokenizer: Any, prompt: ChatPrompt, model_name: str = "this model") -> list[int]:
    """Token ids of ``prompt`` through its template; ``ChatTemplateError`` when it cannot render."""
    template = read_chat_template(prompt.chat_template)
    if tokenizer is None or not (template or getattr(tokenizer, "chat_template", None)):
        raise ChatTemplateError(f"model {model_name!r} has no chat template; pass chat_template= or use "
                                "completions with a plain prompt", param="messages")
    if prompt.continue_final_message and prompt.add_generation_prompt:
        raise ChatTemplateError("continue_final_message=True continues the last message: set "
                                "add_generation_prompt=False", param="continue_final_message")
    try:
        ids = tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=prompt.add_generation_prompt,
                                            tokenize=True, chat_template=template, tools=prompt.tools,
                                            continue_final_message=prompt.continue_final_message,
                                            **prompt.template_kwargs)
    except Exception as exc:  # the template's own raise_exception(), a Jinja error, a bad message shape
        raise ChatTemplateError(f"cannot apply the chat template to these messages: {exc}",
                                param="messages") from exc
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
