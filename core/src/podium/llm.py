"""``LLM``: the offline API, shaped like vLLM's so switching is a change of import.

    from podium import LLM, SamplingParams
    llm = LLM("smollm2-135m-instruct")
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
    print(outputs[0].outputs[0].text)

    llm = LLM(model, enable_lora=True)  # LoRA adapters: one per prompt, or one for all (podium.lora)
    outputs = llm.generate(prompts, params, lora_request=LoRARequest("sql", 1, "/adapters/sql"))

    embedder = LLM("/models/all-MiniLM-L6-v2")  # a pooling model (runner="pooling" for a decoder)
    vectors = [o.outputs.embedding for o in embedder.embed(["Hello", "World"])]

``LLM(model, **kwargs)`` takes ``EngineConfig``'s fields and vLLM's engine arguments
(``podium.engine_args``: accepted, ignored with a warning, or refused with the reason). Prompts
are strings, ``TextPrompt`` / ``TokensPrompt`` dicts or lists of these (``podium.inputs``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from .config import DEFAULT_MODEL
from .engine import LLMEngine
from .engine_args import engine_config
from .inputs import PromptType, parse_prompts
from .lora.request import LoRARequest
from .outputs import EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput
from .pooling_params import PoolingParams
from .sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **kwargs: Any) -> None:
        self.engine = LLMEngine(engine_config(model=model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation defaults (what a request that sets nothing gets)."""
        return SamplingParams(**self.engine.sampling_defaults)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs in input order. ``lora_request``: the LoRA adapter of
        every prompt, or a list with one per prompt (None: the base model). ``priority`` (one per
        prompt, lower first) orders admission when the engine runs ``scheduling_policy="priority"``."""
        inputs = parse_prompts(prompts)
        params = self._params_for(len(inputs), sampling_params)
        loras = self._loras_for(len(inputs), lora_request)
        if priority is not None and len(priority) != len(inputs):
            raise ValueError(f"got {len(priority)} priorities for {len(inputs)} prompts; give one per prompt")
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(inputs, params)):
                rid = str(next(self._ids))
                self.engine.add_request(rid, prompt, p, output_kind="final",
                                        priority=0 if priority is None else int(priority[i]), lora_request=loras[i])
                ids.append(rid)
        except Exception:
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the chat template
        (``chat_template``: another template, as text or a file; ``tools`` and ``chat_template_kwargs``
        go to the template, which renders them)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.engine.apply_chat_template(
            c, add_generation_prompt, chat_template=chat_template, tools=tools,
            continue_final_message=continue_final_message, **(chat_template_kwargs or {}))}
            for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: Any = None,
        pooling_task: str | None = None,
    ) -> list[PoolingRequestOutput]:
        """A pooling model's output for every prompt (``outputs.data``: a float32 tensor), in input
        order. ``pooling_task``: "embed" (or None); other tasks are not served yet."""
        if pooling_task not in (None, "embed", "encode"):
            raise ValueError(f"pooling_task={pooling_task!r} is not supported; Podium's pooling models embed")
        if lora_request is not None:
            raise ValueError("lora_request: LoRA adapters are served for text generation, not pooling models")
        inputs = parse_prompts(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params = [pooling_params or PoolingParams()] * len(inputs)
        elif len(pooling_params) != len(inputs):
            raise ValueError(f"got {len(pooling_params)} pooling_params for {len(inputs)} prompts; give one or one "
                             "per prompt")
        else:
            params = list(pooling_params)
        ids = []
        try:
            for prompt, p in zip(inputs, params):
                rid = str(next(self._ids))
                self.engine.add_request(rid, prompt, p)
                ids.append(rid)
        except Exception:
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm, desc="Embedding")

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        lora_request: Any = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (``outputs.embedding``: a list of floats), in input order."""
        outputs = self.encode(prompts, pooling_params, use_tqdm=use_tqdm, lora_request=lora_request)
        return [EmbeddingRequestOutput.from_base(out) for out in outputs]

    @staticmethod
    def _loras_for(count: int, lora_request) -> list:
        if lora_request is None or isinstance(lora_request, (LoRARequest, str)):  # (a str: a loaded adapter's name)
            return [lora_request] * count
        if not isinstance(lora_request, (list, tuple)):
            raise ValueError(f"lora_request must be a LoRARequest, a loaded adapter's name or a list of them (one "
                             f"per prompt), got {type(lora_request).__name__}")
        if len(lora_request) != count:
            raise ValueError(f"got {len(lora_request)} lora_request entries for {count} prompts; give one or one "
                             "per prompt")
        return list(lora_request)

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine (vLLM's name): ``llm.llm_engine.add_lora(...)``, ``remove_lora``, ``list_loras``."""
        return self.engine

    @staticmethod
    def _params_for(count: int, params) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * count
        if isinstance(params, SamplingParams):
            return [params] * count
        if len(params) != count:
            raise ValueError(f"got {len(params)} sampling_params for {count} prompts; give one or one per prompt")
        return list(params)

    def _run(self, ids: list[str], use_tqdm: bool, desc: str = "Generating") -> list:
        finished: dict[str, Any] = {}
        bar = tqdm(total=len(ids), desc=desc, unit="req", disable=not use_tqdm or len(ids) < 2)
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
