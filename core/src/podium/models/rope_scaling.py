"""Rotary frequencies by rope type, as ``transformers.modeling_rope_utils`` computes them.

Each pair ``i`` of a head's first ``R`` dimensions (``R = head_dim * partial_rotary_factor``) turns
by ``position * inv_freq[i]`` with ``inv_freq[i] = theta ** (-2i / R)``, rescaled per rope type:

    default   as is
    linear    / factor (positions interpolated)
    llama3    low frequencies / factor, high ones kept, a smooth band between (Llama 3.1)
    yarn      interpolated below the ``beta_slow`` band, extrapolated above ``beta_fast``, a linear
              ramp between; cos and sin scaled by ``attention_factor`` (0.1 ln(factor) + 1 by default)
    dynamic   NTK: theta grown with the sequence length L beyond ``max_position_embeddings``,
              ``theta * (factor * L / max_pos - (factor - 1)) ** (R / (R - 2))``
    longrope  divided per pair by ``short_factor``, or by ``long_factor`` once L exceeds
              ``original_max_position_embeddings`` (Phi-3); cos and sin scaled by
              ``sqrt(1 + ln(max_pos / original) / ln(original))``

``dynamic`` and ``longrope`` depend on the sequence length L. transformers recomputes them for each
forward from its largest position, so a token's rotation would depend on what else is in the pass.
Podium rotates each position ``p`` with the frequencies of ``L = p + 1``: exactly what transformers
does for a token generated one at a time (its decode), the same for a prompt within the original
length, and independent of chunking, batching and prefix caching. (A prompt longer than that, run
by transformers in one pass, gets the long frequencies at every position instead.)
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
LENGTH_DEPENDENT = ("dynamic", "longrope")


def head_dim_of(config) -> int:
    """Per-head size: ``config.head_dim`` when set, else hidden_size / num_attention_heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def nested_rope(config) -> bool:
    """Whether the config keeps rope settings per layer type (Gemma 3: ``{"sliding_attention": {...}, ...}``)."""
    params = getattr(config, "rope_parameters", None) or {}
    return any(isinstance(value, dict) for value in params.values())


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """The rope settings of ``layer_type``'s layers as one dict with ``rope_type`` and ``rope_theta``.

    transformers >= 5 keeps them in ``config.rope_parameters`` (per layer type for some models; None:
    the full-attention layers'); older versions in ``rope_theta`` plus an optional ``rope_scaling`` dict
    (whose type key may be spelled ``type``) and ``partial_rotary_factor`` on the config.
    """
    params = getattr(config, "rope_parameters", None)
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    elif nested_rope(config):
        params = params[layer_type or "full_attention"]
    params = dict(params)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    params.setdefault("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    return params


def rotary_dim(config, params: dict) -> int:
    """R: the leading dimensions of each head that rotate (the rest pass through)."""
    return int(head_dim_of(config) * float(params["partial_rotary_factor"]))


def original_length(config, params: dict) -> int:
    return int(params.get("original_max_position_embeddings")
               or getattr(config, "original_max_position_embeddings", None) or config.max_position_embeddings)


def scaled_context_length(config) -> int:
    """Positions the model can address: ``max_position_embeddings``, times ``factor`` for linear and
    dynamic rope, the original length times ``factor`` for yarn (configs that set both keep the larger)."""
    length = int(config.max_position_embeddings)
    if nested_rope(config):  # per-layer-type settings (Gemma 3) already count in max_position_embeddings
        return length
    params = rope_parameters(config)
    if params["rope_type"] in ("linear", "dynamic"):
        length = int(length * float(params["factor"]))
    elif params["rope_type"] == "yarn":
        length = max(length, int(original_length(config, params) * float(params["factor"])))
    return length


def _llama3(inv_freq: torch.Tensor, params: dict, config, seq_len: int | None) -> torch.Tensor:
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_len = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)  # 0 at the low band edge, 1 at the high one
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    in_band = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(in_band, blended, scaled)


def _yarn(inv_freq: torch.Tensor, params: dict, config, seq_len: int | None) -> torch.Tensor:
    dim, base = 2 * inv_freq.numel(), float(params["rope_theta"])
    factor = float(params.get("factor") or config.max_position_embeddings / original_length(config, params))
    fast, slow = float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1)

    def pair_index(rotations: float) -> float:  # the pair that turns ``rotations`` times over the original length
        return dim * math.log(original_length(config, params) / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_index(fast), pair_index(slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # 0: extrapolate
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def _dynamic_base(params: dict, config, seq_len: torch.Tensor, dim: int) -> torch.Tensor:
    """theta for sequence lengths ``seq_len`` (float32, any shape), as transformers' dynamic NTK."""
    max_pos, factor = float(config.max_position_embeddings), float(params["factor"])
    seq_len = seq_len.clamp(min=max_pos)
    return float(params["rope_theta"]) * (factor * seq_len / max_pos - (factor - 1)) ** (dim / (dim - 2))


def _dynamic(inv_freq: torch.Tensor, params: dict, config, seq_len: int | None) -> torch.Tensor:
    dim = 2 * inv_freq.numel()
    base = _dynamic_base(params, config, torch.tensor(float(seq_len or 0)), dim)
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _longrope(inv_freq: torch.Tensor, params: dict, config, seq_len: int | None) -> torch.Tensor:
    long = seq_len is not None and seq_len > original_length(config, params)
    factors = torch.tensor(params["long_factor" if long else "short_factor"], dtype=torch.float32)
    if factors.shape != inv_freq.shape:
        raise ValueError(f"longrope factors have {factors.numel()} entries; the rotary dimension needs {inv_freq.numel()}")
    return inv_freq / factors


_SCALERS: dict[str, Callable[[torch.Tensor, dict, object, int | None], torch.Tensor]] = {
    "default": lambda inv_freq, params, config, seq_len: inv_freq,
    "linear": lambda inv_freq, params, config, seq_len: inv_freq / float(params["factor"]),
    "llama3": _llama3,
    "yarn": _yarn,
    "dynamic": _dynamic,
    "longrope": _longrope,
}


def checked_rope_parameters(config, layer_type: str | None = None) -> dict:
    params = rope_parameters(config, layer_type)
    if params["rope_type"] not in _SCALERS:
        raise ValueError(f"rope_type {params['rope_type']!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    return params


def inverse_frequencies(config, layer_type: str | None = None, seq_len: int | None = None) -> torch.Tensor:
    """[R / 2] float32 inverse frequencies (on the CPU) for sequences of ``seq_len`` tokens (None: any
    within the original length; only ``dynamic`` and ``longrope`` depend on it)."""
    params = checked_rope_parameters(config, layer_type)
    dim = rotary_dim(config, params)
    plain = 1.0 / (float(params["rope_theta"]) ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    inv_freq = _SCALERS[params["rope_type"]](plain, params, config, seq_len)
    factors = getattr(config, "rope_freq_factors", None)
    if factors is not None:
        factors = torch.as_tensor(factors, dtype=torch.float32, device="cpu")
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope_freq_factors has {factors.numel()} entries; rotary dimension {dim} needs {dim // 2}")
        inv_freq = inv_freq / factors
    return inv_freq


def attention_factor(config, layer_type: str | None = None) -> float:
    """The scale transformers applies to cos and sin (yarn, longrope; 1 otherwise)."""
    params = checked_rope_parameters(config, layer_type)
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    kind = params["rope_type"]
    if kind == "yarn":
        factor = float(params.get("factor") or config.max_position_embeddings / original_length(config, params))
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")

        def yarn_mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if mscale and mscale_all:
            return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
        return yarn_mscale(factor)
    if kind == "longrope":
        original = original_length(config, params)
        factor = float(params.get("factor") or config.max_position_embeddings / original)
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return 1.0


def rotary_angles(config, positions: torch.Tensor, layer_type: str | None = None) -> torch.Tensor:
    """positions [P] -> [P, R / 2] float32 angles: each position turned by the frequencies of a
    sequence ending there (module docstring), on ``positions``' device."""
    params = checked_rope_parameters(config, layer_type)
    p = positions.float()[:, None]
    kind = params["rope_type"]
    if kind == "longrope":
        short = inverse_frequencies(config, layer_type).to(positions.device)
        long = inverse_frequencies(config, layer_type, original_length(config, params) + 1).to(positions.device)
        return torch.where(p + 1 > original_length(config, params), p * long, p * short)
    if kind == "dynamic":
        dim = rotary_dim(config, params)
        base = _dynamic_base(params, config, p + 1, dim)  # [P, 1]
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=positions.device).float() / dim
        return p * (1.0 / (base ** exponents[None, :]))
    return p * inverse_frequencies(config, layer_type).to(positions.device)[None, :]
