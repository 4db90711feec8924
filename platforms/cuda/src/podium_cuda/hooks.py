"""Entry point of the CUDA plugin (group ``podium``)."""

from podium_plugin_api import hookimpl

from .platform import CudaPlatform


@hookimpl
def podium_platforms():
    return [CudaPlatform]
