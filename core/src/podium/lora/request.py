"""``LoRARequest``: which adapter a request runs with (vLLM's shape), and the engine's handle on one.

    from podium import LLM, SamplingParams
    from podium.lora import LoRARequest
    llm = LLM(model, enable_lora=True, max_lora_rank=16)
    llm.generate(prompts, params, lora_request=LoRARequest("sql", 1, "/adapters/sql"))

``lora_name`` is how clients (the server's ``model`` field) name it, ``lora_int_id`` a positive id
unique per adapter, ``lora_path`` the PEFT folder. The engine registers an adapter the first time a
request names it (or by ``add_lora``) and then knows it by name and id.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None  # accepted as vLLM has it; the engine serves one base model

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str):
            raise ValueError(f"LoRARequest.lora_path must be a folder path, got {self.lora_path!r}")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


@dataclass(frozen=True)
class AdapterRef:
    """A registered adapter as the scheduler, the plans and every rank see it (picklable).

    ``key`` is unique per registration: unloading an adapter and loading another under the same
    name or id gives a new key, so neither its slot nor its prefix-cache blocks are mistaken for the old one's."""

    key: int
    name: str
    lora_int_id: int
    path: str
    rank: int
