"""Prompts as vLLM takes them: strings, ``TextPrompt`` / ``TokensPrompt`` dicts, or a list of these.

    from podium.inputs import TokensPrompt
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3]), "Hello", {"prompt": "Hi"}])

``parse_prompts`` turns any of them into what ``LLMEngine.add_request`` takes (text or token ids),
and names what it cannot run: multimodal data (Podium serves text models), unknown keys, a bare
list of token ids (ambiguous with a list of prompts: wrap it in ``TokensPrompt``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypedDict


class TextPrompt(TypedDict):
    """A prompt as text; the engine tokenizes it."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt as token ids, used as they are."""

    prompt_token_ids: list[int]


PromptType = str | TextPrompt | TokensPrompt

_MULTIMODAL = ("multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids")


def parse_prompt(prompt: PromptType) -> str | list[int]:
    """One prompt -> text or token ids; ValueError naming what is wrong with it."""
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, dict):
        raise ValueError(f"a prompt must be a string, a TextPrompt {{'prompt': ...}} or a TokensPrompt "
                         f"{{'prompt_token_ids': [...]}}; got {type(prompt).__name__}")
    multimodal = [k for k in _MULTIMODAL if k in prompt]
    if multimodal:
        raise ValueError(f"prompt has {', '.join(multimodal)}: Podium serves text models only")
    unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
    if unknown:
        raise ValueError(f"prompt has unknown key(s) {unknown}; a prompt dict holds 'prompt' (text) or "
                         "'prompt_token_ids'")
    if "prompt_token_ids" in prompt:
        if "prompt" in prompt:
            raise ValueError("a prompt dict holds 'prompt' or 'prompt_token_ids', not both")
        ids = prompt["prompt_token_ids"]
        if isinstance(ids, (str, bytes)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("prompt_token_ids must be a list of integers")
        return list(ids)
    if "prompt" in prompt:
        if not isinstance(prompt["prompt"], str):
            raise ValueError(f"'prompt' must be text, got {type(prompt['prompt']).__name__}; token ids go in "
                             "'prompt_token_ids'")
        return prompt["prompt"]
    raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")


def parse_prompts(prompts: PromptType | Sequence[PromptType]) -> list[str | list[int]]:
    """One prompt or a sequence of them -> a list of texts / token-id lists, in order."""
    if isinstance(prompts, (str, dict)):
        return [parse_prompt(prompts)]
    if not isinstance(prompts, Sequence):
        raise ValueError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
    if prompts and all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        raise ValueError("got a list of integers: for one prompt of token ids pass "
                         "TokensPrompt(prompt_token_ids=[...]) (or {'prompt_token_ids': [...]})")
    return [parse_prompt(p) for p in prompts]
