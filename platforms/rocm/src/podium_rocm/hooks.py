"""Entry point of the ROCm plugin (group ``podium``)."""

from podium_plugin_api import hookimpl

from .platform import RocmPlatform


@hookimpl
def podium_platforms():
    return [RocmPlatform]
