"""The conformance suite, collected when pytest runs with ``--podium-platform NAME``.

Each test checks one capability of the platform under test against the contract's pure-torch
references; the checks themselves live in the modules beside this one and raise
``ConformanceError`` with a message naming the capability, the shapes, the largest error and
where the first difference is. Tests that need a capability the platform does not claim are
skipped with the capability's name.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from podium_plugin_api.platform import Capabilities
from podium_plugin_api.testing.attention_checks import check_attention, check_attention_rotary, check_graph_capture
from podium_plugin_api.testing.batches import ATTENTION_CASES
from podium_plugin_api.testing.distributed_checks import check_communicator, declined
from podium_plugin_api.testing.generation import check_generation, generation_dtype
from podium_plugin_api.testing.kv_cache_checks import (
    check_allocation,
    check_cache_dtype,
    check_layout,
    check_write_read,
    extra_cache_dtypes,
    kit_spec,
)
from podium_plugin_api.testing.lookup import FoundPlatform
from podium_plugin_api.testing.op_checks import check_op
from podium_plugin_api.testing.platform_checks import (
    check_api_version,
    check_capabilities,
    check_device_and_memory,
    check_distributed_backend,
)
from podium_plugin_api.testing.pytest_plugin import FOUND_KEY
from podium_plugin_api.testing.report import ConformanceError, dtype_name, guarded

KIT_DIR = str(Path(__file__).parent)


def plugin_traceback(exc: BaseException) -> str:
    """The traceback of what the platform raised, without the kit's own frames."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(KIT_DIR)]
    return "".join(traceback.format_list(frames)) + "".join(traceback.format_exception_only(type(exc), exc))


def run_check(check: Callable[..., Any], *args: Any) -> Any:
    """Run one check; a ConformanceError fails the test with its message (and the platform's traceback)."""
    try:
        return check(*args)
    except ConformanceError as exc:
        message = str(exc)
        if exc.__cause__ is not None:
            message += f"\n\nraised in the platform:\n{plugin_traceback(exc.__cause__)}"
    pytest.fail(message, pytrace=False)  # outside the except block: no chained traceback


def _capabilities(found: FoundPlatform | None) -> Capabilities:
    try:
        return found.platform.capabilities() if found else Capabilities()
    except Exception:  # test_capabilities reports it; parametrize with the defaults meanwhile
        return Capabilities()


def _custom_ops(found: FoundPlatform | None) -> list[tuple[str, Any]]:
    """(op name, callable) for every op ``platform.custom_ops()`` overrides.

    If it raises, one entry whose callable is the exception: its test reports it.
    """
    if found is None:
        return []
    try:
        return list((found.platform.custom_ops() or {}).items())
    except Exception as exc:
        return [("raised", exc)]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    found = metafunc.config.stash.get(FOUND_KEY, None)
    caps = _capabilities(found)
    if "dtype" in metafunc.fixturenames:
        metafunc.parametrize("dtype", caps.dtypes, ids=dtype_name)
    if "case" in metafunc.fixturenames:
        metafunc.parametrize("case", ATTENTION_CASES, ids=lambda c: c.name)
    if "custom_op" in metafunc.fixturenames:
        ops = _custom_ops(found) or [None]
        metafunc.parametrize("custom_op", ops, ids=lambda o: o[0] if o else "none")


@pytest.fixture(scope="session")
def found(request: pytest.FixtureRequest) -> FoundPlatform:
    found = request.config.stash.get(FOUND_KEY, None)
    if found is None:
        pytest.skip("the conformance suite runs with pytest --podium-platform NAME")
    return found


@pytest.fixture(scope="session")
def platform(found):
    return found.platform


@pytest.fixture(scope="session")
def caps(platform) -> Capabilities:
    return run_check(check_capabilities, platform)


@pytest.fixture(scope="session")
def backend(platform):
    return run_check(guarded, "attention_backend()", platform.attention_backend)


def test_api_version(platform):
    run_check(check_api_version, platform)


def test_capabilities(platform):
    run_check(check_capabilities, platform)


def test_device_and_memory(platform):
    run_check(check_device_and_memory, platform)


def test_distributed_backend_name(caps):
    run_check(check_distributed_backend, caps)


def test_communicator_two_processes(platform, request):
    """all_reduce, all_gather and broadcast of ``platform.communicator`` in two spawned ranks."""
    from podium_plugin_api.options import parse_option_pairs

    reason = declined(platform)
    if reason:
        pytest.skip(reason)
    options = parse_option_pairs(request.config.getoption("podium_platform_option"))
    run_check(check_communicator, platform.name, options)


def test_kv_cache_allocation(platform, backend, dtype):
    run_check(check_allocation, platform, backend, kit_spec(dtype))


def test_kv_cache_layout(platform, backend, dtype):
    run_check(check_layout, platform, backend, kit_spec(dtype))


def test_kv_write_read_by_slot_mapping(platform, backend, dtype):
    run_check(check_write_read, platform, backend, kit_spec(dtype, num_layers=1))


def test_extra_kv_cache_dtypes_store_the_cast_and_attend(platform, backend, dtype):
    """Each cache dtype ``kv_cache_dtypes`` lists besides the model's (fp8)."""
    extra = extra_cache_dtypes(backend, dtype)
    if not extra:
        pytest.skip(f"kv_cache_dtypes lists only {dtype_name(dtype)} itself")
    for cache_dtype in extra:
        run_check(check_cache_dtype, platform, backend, dtype, cache_dtype)


def test_attention_matches_reference(platform, backend, caps, case, dtype):
    if case.capability and not getattr(caps, case.capability):
        pytest.skip(f"capabilities().{case.capability} is False")
    run_check(check_attention, platform, backend, case, dtype)


def test_attention_with_rotary_matches_rotary_then_forward(platform, backend, caps, case, dtype):
    if case.capability and not getattr(caps, case.capability):
        pytest.skip(f"capabilities().{case.capability} is False")
    run_check(check_attention_rotary, platform, backend, case, dtype)


def test_graph_capture_replay_equals_eager(platform, backend, caps, dtype):
    if not caps.graph_capture:
        pytest.skip("capabilities().graph_capture is False")
    declined = run_check(check_graph_capture, platform, backend, dtype)
    if declined:
        pytest.skip(declined)


def test_custom_op_matches_reference(platform, custom_op, dtype):
    if custom_op is None:
        pytest.skip("the platform overrides no ops (platform.custom_ops() is empty)")
    name, fn = custom_op
    if isinstance(fn, Exception):
        pytest.fail(f"platform.custom_ops() raised {type(fn).__name__}: {fn}", pytrace=False)
    run_check(check_op, name, fn, dtype, platform.torch_device(), "platform.custom_ops()")


def test_tiny_generation_matches_cpu_reference(found, caps):
    ops = run_check(guarded, "custom_ops()", lambda: found.platform.custom_ops() or {})
    with torch.inference_mode():
        run_check(check_generation, found.platform, generation_dtype(caps.dtypes, caps.default_dtype), ops)
