"""Phi-3 (and Phi-3.5 / Phi-4-mini): the Llama decoder with Phi's checkpoint and rope conventions.

Its checkpoints already hold the merged projections Podium runs (``self_attn.qkv_proj``,
``mlp.gate_up_proj``: gate rows first), so they load whole. Long-context variants use ``longrope``
(short/long factors by ``original_max_position_embeddings``) and Phi-4-mini a
``partial_rotary_factor`` below 1: both are the rotary module's (``rope_scaling``). A
``sliding_window`` in the config applies to every layer, as in transformers.
"""

from __future__ import annotations

from .llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(config) -> dict:
        return {"qkv_bias": False, "o_bias": False, "qk_norm": False}
