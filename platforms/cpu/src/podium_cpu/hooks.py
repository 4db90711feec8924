"""Entry point of the CPU plugin (group ``podium``), registered exactly as a vendor's would be."""

from podium_plugin_api import hookimpl

from .platform import CpuPlatform


@hookimpl
def podium_platforms():
    return [CpuPlatform]
