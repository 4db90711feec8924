"""A deliberately broken copy of the example NPU platform: it must fail the conformance kit.

Its backend declares a head-major cache, ``[2, num_blocks, num_kv_heads, block_size, head_size]``
(the layout some NPU kernels want), but keeps ``AttentionBackend``'s default ``write_kv``,
``read_kv`` and ``attend``, which index the default ``[num_blocks, block_size, num_kv_heads,
head_size]`` layout. ``pytest --podium-platform broken-npu`` must say: wrong cache layout.
"""

from podium_plugin_api import AttentionBackend, Platform, hookimpl


class HeadMajorBackend(AttentionBackend):
    name = "head-major"

    def kv_cache_shape(self, spec, num_blocks):
        # the bug: a new layout without the methods that index it
        return (2, num_blocks, spec.num_kv_heads, spec.block_size, spec.head_size)


class BrokenNpuPlatform(Platform):
    name = "broken-npu"
    device_type = "cpu"
    priority = 0
    api_version = "2.0"

    def attention_backend(self):
        return HeadMajorBackend()


@hookimpl
def podium_platforms():
    return [BrokenNpuPlatform]
