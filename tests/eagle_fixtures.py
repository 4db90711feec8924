"""Random EAGLE-1 / EAGLE-3 heads saved in their checkpoint layouts, and a float64 reference of
what such a head drafts (pure torch, independent of Podium's layers)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch


def save_eagle_head(folder: Path, target_config, eagle3: bool, seed: int, draft_vocab: int | None = None,
                    aux_layers: tuple[int, ...] | None = None) -> dict[str, torch.Tensor]:
    """A random head for ``target_config`` (config.json + model.safetensors); returns its tensors.
    EAGLE-3 with ``draft_vocab``: a random subset of the target's ids (``d2t`` offsets)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    hidden, inter = target_config.hidden_size, target_config.intermediate_size
    heads, kv_heads = target_config.num_attention_heads, target_config.num_key_value_heads
    head_dim = hidden // heads
    vocab = target_config.vocab_size

    def rand(*shape, scale=0.08):
        return (torch.randn(*shape, generator=g) * scale).contiguous()

    def norm():
        return (1.0 + 0.1 * torch.randn(hidden, generator=g)).contiguous()

    qkv_in = 2 * hidden if eagle3 else hidden
    layer = {"self_attn.q_proj.weight": rand(heads * head_dim, qkv_in), "self_attn.k_proj.weight": rand(kv_heads * head_dim, qkv_in),
             "self_attn.v_proj.weight": rand(kv_heads * head_dim, qkv_in), "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
             "post_attention_layernorm.weight": norm(), "mlp.gate_proj.weight": rand(inter, hidden),
             "mlp.up_proj.weight": rand(inter, hidden), "mlp.down_proj.weight": rand(hidden, inter)}
    config = {**target_config.to_dict(), "num_hidden_layers": 1, "architectures": ["LlamaForCausalLM"]}
    if eagle3:
        layer.update({"input_layernorm.weight": norm(), "hidden_norm.weight": norm()})
        tensors = {f"midlayer.{k}": v for k, v in layer.items()}
        draft_vocab = draft_vocab or vocab
        ids = torch.sort(torch.randperm(vocab, generator=g)[:draft_vocab]).values
        tensors.update({"fc.weight": rand(hidden, 3 * hidden), "norm.weight": norm(),
                        "lm_head.weight": rand(draft_vocab, hidden, scale=0.3), "d2t": ids - torch.arange(draft_vocab),
                        "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True)})
        config.update({"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": draft_vocab})
        if aux_layers is not None:
            config["eagle_aux_hidden_state_layer_ids"] = list(aux_layers)
    else:
        tensors = {f"layers.0.{k}": v for k, v in layer.items()}
        tensors["fc.weight"] = rand(hidden, 2 * hidden)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return tensors


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotate(x, positions, theta):  # x [T, heads, D], HF's rotate_half convention
    dim = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = positions[:, None].double() * inv[None]  # [T, D/2]
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
    half = torch.cat([-x[..., dim // 2:], x[..., :dim // 2]], -1)
    return x * cos + half * sin


def _layer(x_attn_in, residual, w, p, config):
    """One head layer over all positions (causal): attention over ``x_attn_in``, then MLP."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    hd = config.hidden_size // heads
    T = x_attn_in.shape[0]
    q = (x_attn_in @ w[p + "self_attn.q_proj.weight"].T).view(T, heads, hd)
    k = (x_attn_in @ w[p + "self_attn.k_proj.weight"].T).view(T, kv_heads, hd)
    v = (x_attn_in @ w[p + "self_attn.v_proj.weight"].T).view(T, kv_heads, hd)
    pos = torch.arange(T)
    theta = getattr(config, "rope_theta", None) or (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    q, k = _rotate(q, pos, theta), _rotate(k, pos, theta)
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(hd)
    scores = scores.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
    attn = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(T, -1) @ w[p + "self_attn.o_proj.weight"].T
    h = attn + residual
    n = _rms(h, w[p + "post_attention_layernorm.weight"], config.rms_norm_eps)
    mlp = (torch.nn.functional.silu(n @ w[p + "mlp.gate_proj.weight"].T) * (n @ w[p + "mlp.up_proj.weight"].T))
    return mlp @ w[p + "mlp.down_proj.weight"].T, h  # (mlp output, residual)


def reference_drafts(hf, tensors: dict, eagle3: bool, tokens: list[int], k: int,
                     aux_layers: tuple[int, ...] | None = None) -> list[int]:
    """The k tokens the head drafts after ``tokens`` (the last one not yet computed by the target),
    in float64: entries (token i + 1, target state i) for every earlier position, then its own states."""
    w = {name: t.double() for name, t in tensors.items()}
    config = hf.config
    with torch.no_grad():
        out = hf(torch.tensor([tokens[:-1]]), output_hidden_states=True)
    embed = hf.model.embed_tokens.weight.double()
    if eagle3:
        layers = aux_layers or (2, config.num_hidden_layers // 2, config.num_hidden_layers - 3)
        states = torch.cat([out.hidden_states[i][0].double() for i in layers], -1) @ w["fc.weight"].T  # [T, H]
    else:
        states = out.hidden_states[-1][0].double()  # the last, normed state
    inputs, drafts = list(tokens[1:]), []
    for _ in range(k):
        emb = embed[torch.tensor(inputs)]
        if eagle3:
            normed = _rms(states, w["midlayer.hidden_norm.weight"], config.rms_norm_eps)
            attn_in = torch.cat([_rms(emb, w["midlayer.input_layernorm.weight"], config.rms_norm_eps), normed], -1)
            mlp, residual = _layer(attn_in, states, w, "midlayer.", config)
            following = mlp + residual
            logits = _rms(following, w["norm.weight"], config.rms_norm_eps) @ w["lm_head.weight"].T
            token = int(logits[-1].argmax()) + int(tensors["d2t"][int(logits[-1].argmax())])
        else:
            x = torch.cat([emb, states], -1) @ w["fc.weight"].T
            mlp, residual = _layer(x, x, w, "layers.0.", config)
            following = mlp + residual
            token = int((following[-1:] @ hf.lm_head.weight.double().T).argmax())
        drafts.append(token)
        states = torch.cat([states, following[-1:]])
        inputs.append(token)
    return drafts
