"""The plugin API's semantic version.

A plugin declares the version it was built for (``Platform.api_version``). The core accepts a
plugin whose major version equals ``API_VERSION``'s major and whose minor is not newer than ours;
anything else is refused at discovery with an error naming the plugin and both versions.

2.0.0 is the contract as it stands, with no minor-version history before it: the 1.x line grew by
minors (prepare_model, forward_rotary, argmax, fp8 caches, fused linears, graph refusals) and then
changed incompatibly (one route for custom ops, ForwardContext in the contract, typed options and
activation, step shaping instead of a static-shapes flag). A plugin built for 1.x is refused with
"major versions differ" rather than half working. From here, an addition is a minor version and a
plugin built for 2.0 keeps running on every 2.x (hooks gain arguments without breaking it).

Minor versions:

- 2.1: tensor parallelism: ``Platform.rank_device`` (which device a rank binds to),
  ``Platform.communicator`` and ``podium_plugin_api.distributed.Communicator`` (all_reduce,
  all_gather, broadcast over torch.distributed by default), and the kit's two-process communicator
  check. A 2.0 plugin inherits the defaults.
- 2.2: quantization: quantization methods (the ``podium_quantization_methods`` hook,
  ``podium_plugin_api.quantization.QuantizationMethod``), the GGUF block-format ops ``gguf_linear``
  / ``gguf_embedding`` (``podium_plugin_api.gguf_blocks``) and ``fp8_linear``
  (``podium_plugin_api.fp8``), each with a reference the kit checks. A 2.0 or 2.1 plugin inherits
  the references.
- 2.3: batch-invariant mode: ``Capabilities.batch_invariant`` and
  ``Platform.use_batch_invariant_kernels`` (the default refuses). A 2.0 plugin inherits the defaults.
- 2.4: structured output's ``apply_token_bitmask`` op (the tokens a grammar forbids set to -inf in
  place), the INT4 weight-only ``int4_linear`` op (``podium_plugin_api.int4``: AWQ / GPTQ layouts),
  and multi-LoRA serving: the batched ``lora_shrink`` / ``lora_expand`` ops over a step's rows
  (``podium_plugin_api.lora``: the slot-weight layout, ``LoRAMapping``), each with a reference the
  kit checks an override against. A 2.0 to 2.3 plugin inherits the references.
- 2.5: quantized layers name the op they compute with (``quantized_op`` / ``quantized_args``, read by
  ``podium_plugin_api.quantization.quantized_call``), so a platform's ``rms_norm_linear`` /
  ``silu_and_mul_linear`` can run the norm or SiLU-and-mul inside its quantized kernel; the FP8 rows'
  scale is ``amax / 448`` divided exactly on every device. A 2.0 to 2.4 plugin keeps calling the
  layer as a module.
- 2.6: ``LoRAMapping.num_slotted_rows`` (how many rows of an eager step have an adapter slot, None
  in a captured graph), so a LoRA kernel's grid can cover only those rows. A 2.0 to 2.5 plugin
  ignores it.
- 2.7: ``Platform.device_key`` (which hardware device a process computes on, equal for processes
  that share it), reported to a router so co-located replicas' queues count as one device's. A 2.0
  to 2.6 plugin inherits the default (host, device type, index).
- 2.8: the INT4 layout ``AWQ_MMA`` (``podium_plugin_api.int4``: AWQ with qweight in the order of
  ``mma.m16n8k16``'s A fragments; ``awq_to_mma`` / ``pack_mma`` / ``unpack_mma``, read by ``dequantize``
  and the ``int4_linear`` reference), which a platform may convert a model's AWQ layers to in
  ``prepare_model``. A 2.0 to 2.7 plugin never sees it: only a platform that converts produces it.
"""

from __future__ import annotations

API_VERSION = "2.8.0"


def parse_version(text: str) -> tuple[int, int, int]:
    """``"1.2.3"`` -> ``(1, 2, 3)``; missing parts are 0. Raises ValueError on garbage."""
    parts = str(text).strip().split(".")
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"not a semantic version: {text!r} (expected MAJOR.MINOR.PATCH)")
    nums = [int(p) for p in parts] + [0] * (3 - len(parts))
    return nums[0], nums[1], nums[2]


def compatibility_problem(plugin_version: str, api_version: str = API_VERSION) -> str | None:
    """Why a plugin built for ``plugin_version`` cannot run on ``api_version``; None if it can."""
    try:
        p_major, p_minor, _ = parse_version(plugin_version)
    except ValueError as exc:
        return str(exc)
    a_major, a_minor, _ = parse_version(api_version)
    if p_major != a_major:
        return (
            f"it was built for plugin API {plugin_version} but this Podium provides {api_version} "
            f"(major versions differ); install a plugin release built for API {a_major}.x "
            f"or a Podium release providing API {p_major}.x"
        )
    if p_minor > a_minor:
        return (
            f"it needs plugin API {plugin_version} but this Podium provides only {api_version}; "
            f"upgrade podium-plugin-api and podium"
        )
    return None
