"""Discovery as a user sees it: an out-of-tree plugin installed for real, overrides and their errors,
plugins that break the contract, and platforms whose hardware is missing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from podium_plugin_api import Platform, hookimpl
from podium_plugin_api.discovery import PlatformSelectionError, PluginError, load_plugins

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "npu-plugin"


def install(target: Path, *sources: Path) -> Path:
    """pip-install plugin folders into ``target`` (from copies, so the checkout gets no build files)."""
    copies = []
    for src in sources:
        copy = target.parent / f"src-{src.name}"
        shutil.copytree(src, copy, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        copies.append(str(copy))
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "--no-compile",
        "--target",
        str(target),
        *copies,
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
    return target


def run_podium(*args: str, site: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "PODIUM_DEVICE"}
    if site is not None:
        environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), environ.get("PYTHONPATH")]))
    environ.update(env)
    return subprocess.run(
        [sys.executable, "-m", "podium.cli", *args], capture_output=True, text=True, env=environ, timeout=300
    )


@pytest.fixture(scope="module")
def example_site(tmp_path_factory) -> Path:
    return install(tmp_path_factory.mktemp("example") / "site", EXAMPLE)


def rows_by_name(result: subprocess.CompletedProcess) -> dict[str, dict]:
    assert result.returncode == 0, result.stderr
    return {row["name"]: row for row in json.loads(result.stdout)}


# --- the example plugin, installed for real -------------------------------------------------------


def test_installed_example_is_listed_available_but_not_preferred(example_site):
    rows = rows_by_name(run_podium("platforms", "--json", site=example_site))
    npu = rows["example-npu"]
    assert (npu["distribution"], npu["version"], npu["available"], npu["priority"]) == (
        "podium-example-npu",
        "0.1.0",
        True,
        1,
    )
    assert npu["api_version"] == "2.0" and npu["selected"] is False
    assert rows["cpu"]["selected"] is True  # priority 10 beats 1


def test_example_is_not_there_without_its_distribution():
    assert "example-npu" not in [e.name for e in load_plugins().platforms]


def test_example_is_selectable_with_podium_device(example_site):
    rows = rows_by_name(run_podium("platforms", "--json", site=example_site, PODIUM_DEVICE="example-npu"))
    assert [name for name, row in rows.items() if row["selected"]] == ["example-npu"]


def test_table_shows_the_example_selected_with_device_and_why_others_are_unavailable(example_site):
    result = run_podium("platforms", "--verbose", "--device", "example-npu", site=example_site)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    npu = next(line for line in lines if line.startswith("example-npu "))
    assert npu.split()[1:6] == ["podium-example-npu", "0.1.0", "yes", "1", "*"]  # available and selected
    assert not any(line.split()[5:6] == ["*"] for line in lines if not line.startswith(("example-npu ", " ")))
    if not torch.cuda.is_available():
        cuda = next(line for line in lines if line.startswith("cuda "))
        assert " no " in cuda and "CUDA" in cuda
    assert "distributed_backend: gloo" in result.stdout  # --verbose prints capabilities


# --- overrides and their errors -------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="cuda is available here")
def test_requesting_an_unavailable_platform_says_why_and_lists_the_choices(monkeypatch):
    monkeypatch.delenv("PODIUM_DEVICE", raising=False)
    plugins = load_plugins()
    entries = plugins.platforms
    with pytest.raises(PlatformSelectionError) as info:
        plugins.select("cuda")
    message = str(info.value)
    cuda = next(e for e in entries if e.name == "cuda")
    assert message.startswith(f"platform 'cuda' is unavailable here: {cuda.availability.reason}")
    for entry in entries:
        assert f"  {entry.name} ({entry.distribution}, priority {entry.platform.priority}):" in message
    assert (
        "tpu (podium-tpu, priority 90): unavailable: " in message
        and "cpu (podium-cpu, priority 10): available" in message
    )


def test_requesting_an_unknown_platform_lists_the_choices(monkeypatch):
    plugins = load_plugins()
    monkeypatch.setenv("PODIUM_DEVICE", "nope")
    with pytest.raises(PlatformSelectionError, match=r"no platform named 'nope' is installed; choices:") as info:
        plugins.select(None)
    assert all(f"  {e.name} (" in str(info.value) for e in plugins.platforms)


@pytest.mark.skipif(torch.cuda.is_available(), reason="cuda (priority 100) is available here")
def test_without_a_request_the_available_platform_of_highest_priority_wins(monkeypatch):
    monkeypatch.delenv("PODIUM_DEVICE", raising=False)

    class Better(Platform):
        name = "better-npu"
        priority = 50

    class Plugin:
        @hookimpl
        def podium_platforms(self):
            return [Better]

    assert load_plugins().select(None).name == "cpu"
    assert load_plugins(extra_plugins={"better": Plugin()}).select(None).name == "better-npu"


# --- plugins that break the contract --------------------------------------------------------------


class ExtraArgument:
    @hookimpl
    def podium_platforms(self, device):  # 'device' is not an argument of the spec
        return []


class UnknownHook:
    @hookimpl
    def podium_make_coffee(self):
        return "espresso"


def test_a_hook_with_an_argument_not_in_the_spec_fails_naming_the_plugin():
    with pytest.raises(
        PluginError, match=r"(?s)podium plugin podium-bad-signature .* breaks the hook contract: .*'device'"
    ):
        load_plugins(extra_plugins={"podium-bad-signature": ExtraArgument()})


def test_an_unknown_hook_fails_naming_the_plugin():
    with pytest.raises(PluginError, match=r"(?s)podium plugin podium-coffee .*does not define.*podium_make_coffee"):
        load_plugins(extra_plugins={"podium-coffee": UnknownHook()})


def test_an_installed_broken_distribution_is_named_by_the_cli(tmp_path):
    src = tmp_path / "badhooks"
    (src / "podium_badhooks").mkdir(parents=True)
    (src / "pyproject.toml").write_text(
        textwrap.dedent("""\
        [build-system]
        requires = ["setuptools>=64"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "podium-badhooks-npu"
        version = "0.3.0"

        [project.entry-points.podium]
        badhooks = "podium_badhooks"
    """)
    )
    (src / "podium_badhooks" / "__init__.py").write_text(
        textwrap.dedent("""\
        from podium_plugin_api import hookimpl

        @hookimpl
        def podium_platforms(device_index):
            return []
    """)
    )
    site = install(tmp_path / "site", src)
    result = run_podium("platforms", site=site)
    assert result.returncode == 1
    assert "podium plugin podium-badhooks-npu 0.3.0 breaks the hook contract" in result.stderr
    assert "device_index" in result.stderr


# --- built-in platforms whose hardware is missing -------------------------------------------------

PROBE = """
import json, sys
import podium_cuda, podium_rocm, podium_tpu
heavy = {name: name in sys.modules for name in ("triton", "torch_xla")}
report = {}
for platform in (podium_cuda.CudaPlatform(), podium_rocm.RocmPlatform(), podium_tpu.TpuPlatform()):
    a = platform.availability()
    report[platform.name] = [a.ok, a.reason]
print(json.dumps({"heavy_after_import": heavy, "availability": report}))
"""


NO_SIDE_EFFECTS = """
import json, os, sys
before = dict(os.environ)
from podium_plugin_api import load_plugins
plugins = load_plugins()  # creates every installed platform and asks each availability()
created = {e.name: type(e.platform).__name__ for e in plugins.platforms}
heavy = [name for name in ("triton", "torch_xla") if name in sys.modules]
print(json.dumps({"created": created, "env_changed": sorted(set(os.environ.items()) ^ set(before.items())),
                  "heavy": heavy}))
"""


def test_discovery_creates_every_platform_without_side_effects():
    """No environment written (CUBLAS_WORKSPACE_CONFIG waits for the cuda platform's activation), no
    heavy runtime imported, and a bad option alias (read at activation) does not break discovery."""
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    env.update(PODIUM_CUDA_TUNING="no_such_field=1", PODIUM_CPU_ATTENTION="flash")
    result = subprocess.run([sys.executable, "-c", NO_SIDE_EFFECTS], capture_output=True, text=True, timeout=300,
                            env=env)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert {"cpu", "cuda", "rocm", "tpu"} <= set(report["created"])
    assert report["env_changed"] == [] and report["heavy"] == []


def test_gpu_and_tpu_packages_import_lazily_and_report_unavailable_with_a_reason():
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["heavy_after_import"] == {"triton": False, "torch_xla": False}
    for name in ("cuda", "rocm", "tpu"):
        ok, reason = report["availability"][name]
        if name in ("cuda", "rocm") and torch.cuda.is_available():
            continue
        assert ok is False and reason, f"{name}: {reason!r}"
