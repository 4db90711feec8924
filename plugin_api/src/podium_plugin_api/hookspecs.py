"""The whole plugin contract's hooks: pluggy hook specifications for the project name ``podium``.

Plugins are distributions exposing a module under the entry-point group ``podium``; the module
holds functions decorated with ``hookimpl``. Hooks are always called with keyword arguments, so a
later API version may add an argument without breaking an implementation that omits it.

Lifecycle, in the order the core calls them:
  1. discovery   ``podium_platforms``            -> the platforms a plugin provides
  2. model setup ``podium_model_architectures``  -> extra model classes by HF architecture name
                 ``podium_quantization_methods`` -> extra quantization methods by name

Everything a platform supplies beyond that (attention, options, ops, graphs, step shaping) is a
method of its ``Platform`` object (``podium_plugin_api.platform``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:  # type names only: importing the hook specs must not import torch
    from torch import nn

    from .platform import Platform
    from .quantization import QuantizationMethod

PROJECT_NAME = "podium"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class PluginApiDeprecationWarning(DeprecationWarning):
    """A plugin implements a hook (or hook argument) that a later major API version will remove.

    Deprecating a hook keeps it working for a whole major version and warns its implementers at
    registration, naming their distribution (``podium_plugin_api.discovery`` does that, for the core
    and the test kit alike)::

        @hookspec(warn_on_impl=PluginApiDeprecationWarning(
            "podium_old is deprecated since plugin API 2.1 and goes in 3.0; implement podium_new"))
        def podium_old(): ...

    A deprecated argument uses ``warn_on_impl_args={"arg": PluginApiDeprecationWarning(...)}``.
    """


@hookspec
def podium_platforms() -> list[type[Platform] | Platform]:
    """Return the platforms this plugin provides: ``Platform`` subclasses (or instances).

    Called by discovery once per process, for every plugin (not firstresult: the results of all
    plugins are concatenated). Must be cheap and must not import heavy runtimes (triton, torch_xla,
    ...); a class is instantiated right away, so its constructor must have no side effects either.
    """


@hookspec
def podium_model_architectures() -> dict[str, type[nn.Module]]:
    """Return extra model classes keyed by Hugging Face architecture name (``LlamaForCausalLM``).

    Called by the engine when it builds its architecture registry (not firstresult: dicts of all
    plugins are merged; a plugin's entry replaces a built-in one of the same name). A class is
    constructed as ``cls(config, ops)`` (the transformers config, the op table) and its
    ``forward(input_ids, positions, ctx: podium_plugin_api.ForwardContext)`` returns hidden states;
    ``compute_logits(hidden)`` turns rows of them into logits.
    """


@hookspec
def podium_quantization_methods() -> dict[str, type[QuantizationMethod]]:
    """Return extra quantization methods keyed by name (``"fp8"``, ``"my-format"``): subclasses of
    ``podium_plugin_api.quantization.QuantizationMethod``.

    Called by the engine when it resolves the model's quantization (not firstresult: dicts of all
    plugins are merged; a plugin's entry replaces a built-in method of the same name). The engine
    constructs ``cls(config, online=...)`` and applies it to the model before its weights load.
    Added in plugin API 2.2.
    """
