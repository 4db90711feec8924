"""Multi-LoRA serving: PEFT adapters applied to the plain model, many per batch (docs/lora.md).

    request.py      LoRARequest (vLLM's shape) and AdapterRef (the engine's handle on one)
    peft_folder.py  reading and checking a PEFT adapter folder
    layers.py       LoRALinear (an adapted projection) and LoRAState (the step's row -> slot mapping)
    transform.py    apply_lora: the model's projections adapted; adapters prepared and written to slots
    step.py         the runner's side: slot loads from the host cache, each step's mapping staged
    slots.py        the scheduler's side: which adapter holds which slot, admission by slot
    registry.py     the engine's adapters by name and id
"""

from __future__ import annotations

from .request import AdapterRef, LoRARequest

__all__ = ["AdapterRef", "LoRARequest"]
