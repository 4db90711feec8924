"""The whole plugin contract: pluggy hook specifications for the project name ``podium``.

Plugins are distributions exposing a module under the entry-point group ``podium``; the module
holds functions decorated with ``hookimpl``. Hooks are always called with keyword arguments, so a
later API version may add an argument without breaking an implementation that omits it.

Lifecycle, in the order the core calls them:
  1. discovery   ``podium_platforms``            -> the platforms a plugin provides
  2. model setup ``podium_model_architectures``  -> extra model classes by HF architecture name
                 ``podium_custom_ops``           -> op overrides for the selected platform
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

PROJECT_NAME = "podium"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class PluginApiDeprecationWarning(DeprecationWarning):
    """A plugin implements a hook (or hook argument) that a later major API version will remove.

    Deprecating a hook keeps it working for a whole major version and warns its implementers at
    registration, naming their distribution (the core's discovery and the test kit do that)::

        @hookspec(warn_on_impl=PluginApiDeprecationWarning(
            "podium_old is deprecated since plugin API 1.2 and goes in 2.0; implement podium_new"))
        def podium_old(): ...

    A deprecated argument uses ``warn_on_impl_args={"arg": PluginApiDeprecationWarning(...)}``.
    """


@hookspec
def podium_platforms() -> list[Any]:
    """Return the platforms this plugin provides: ``Platform`` subclasses (or instances).

    Called by the core's discovery once per process, for every plugin (not firstresult: the
    results of all plugins are concatenated). Must be cheap and must not import heavy runtimes
    (triton, torch_xla, ...); do that inside ``Platform.availability()`` or later.
    """


@hookspec
def podium_model_architectures() -> dict[str, Callable[..., Any]]:
    """Return extra model classes keyed by Hugging Face architecture name (``LlamaForCausalLM``).

    Called by the core when it builds its architecture registry (not firstresult: dicts of all
    plugins are merged; a plugin's entry replaces a built-in one of the same name). A class is
    constructed as ``cls(config, ops)`` where ``config`` is the core's model config.
    """


@hookspec
def podium_custom_ops(platform: Any) -> dict[str, Callable[..., Any]] | None:
    """Return op overrides (name -> callable) for ``platform``, or None to add nothing.

    Called by the core once after a platform is selected (not firstresult: dicts are merged, later
    plugins win). Names and signatures are listed in ``podium_plugin_api.ops.OP_SIGNATURES``.
    The built-in implementation returns ``platform.custom_ops()``.
    """
