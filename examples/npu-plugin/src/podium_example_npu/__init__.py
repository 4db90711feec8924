"""An example NPU platform: runs on CPU tensors using only the contract's defaults."""

from podium_plugin_api import Platform, hookimpl


class ExampleNpuPlatform(Platform):
    name = "example-npu"
    device_type = "cpu"  # a real NPU plugin names its torch device type here
    priority = 1
    api_version = "2.0"


@hookimpl
def podium_platforms():
    return [ExampleNpuPlatform]
