"""Entry point of the TPU plugin (group ``podium``)."""

from podium_plugin_api import hookimpl

from .platform import TpuPlatform


@hookimpl
def podium_platforms():
    return [TpuPlatform]
