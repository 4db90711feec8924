"""LoRA adapters for the tests, made by PEFT itself: ``get_peft_model`` on a tiny random transformers
model, lora_B drawn at random (PEFT starts it at zero, which would hide every bug), saved with
``save_pretrained``. The PEFT model on the same base is the reference."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(base_folder, folder: Path, seed: int, rank: int = 8, alpha: int = 16,
                 targets: tuple[str, ...] = ALL_TARGETS, use_rslora: bool = False, rank_pattern: dict | None = None,
                 alpha_pattern: dict | None = None, scale: float = 0.3):
    """A PEFT adapter on the model saved in ``base_folder`` (or that transformers model itself),
    written to ``folder``; returns the PEFT model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = base_folder if isinstance(base_folder, torch.nn.Module) else \
        AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32).eval()
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora,
                        rank_pattern=rank_pattern or {}, alpha_pattern=alpha_pattern or {}, lora_dropout=0.0)
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale / param.shape[-1] ** 0.5)
    model.save_pretrained(folder)
    return model.eval()


def peft_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of a transformers/PEFT model, computed by full forwards (no cache)."""
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(max_tokens):
            logits = model(torch.tensor([tokens])).logits[0, -1]
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]
