"""``LLM``: the offline API, shaped like vLLM's so switching is a change of import.

    from podium import LLM, SamplingParams
    llm = LLM("smollm2-135m-instruct")
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
    print(outputs[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
from typing import Any

from tqdm.auto import tqdm

from .config import DEFAULT_MODEL, EngineConfig
from .engine import LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams

Prompt = str | dict[str, Any]


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (strings or ``{"prompt_token_ids": [...]}``); outputs in input order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = self._params_for(len(prompts), sampling_params)
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                rid = str(next(self._ids))
                self.engine.add_request(rid, self._prompt_input(prompt), p, output_kind="final")
                ids.append(rid)
        except Exception:
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.engine.apply_chat_template(c, add_generation_prompt)}
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    @staticmethod
    def _params_for(count: int, params) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * count
        if isinstance(params, SamplingParams):
            return [params] * count
        if len(params) != count:
            raise ValueError(f"got {len(params)} sampling_params for {count} prompts; give one or one per prompt")
        return list(params)

    @staticmethod
    def _prompt_input(prompt: Prompt) -> str | list[int]:
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return prompt["prompt"]
        raise ValueError(f"a prompt must be a string or a dict with 'prompt_token_ids'; got {type(prompt).__name__}")

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm or len(ids) < 2)
        try:
            while len(finished) < len(ids) and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
            self.engine.abort_request([i for i in ids if i not in finished])
        return [finished[i] for i in ids]
