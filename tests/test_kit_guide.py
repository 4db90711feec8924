"""docs/writing-a-platform-plugin.md works as written.

The guide shows files as ``File `PATH`:`` followed by a code block. Blocks without a step are the
example's files and must match ``examples/npu-plugin`` verbatim; blocks marked ``(step N)`` are
what the guide tells the reader to write next. A plugin built from the example plus every step's
blocks, installed like a vendor would, passes the kit with graph capture exercised.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from podium_plugin_api.testing import ConformanceError
from podium_plugin_api.testing.kv_cache_checks import check_layout, kit_spec

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "writing-a-platform-plugin.md"
EXAMPLE = ROOT / "examples" / "npu-plugin"
BROKEN = ROOT / "examples" / "broken-npu-plugin" / "src" / "podium_example_broken_npu" / "__init__.py"
FILE_BLOCK = re.compile(r"^File `([^`]+)`(?: \(step (\d+)\))?:\n\n```\w*\n(.*?)^```$", re.M | re.S)


def guide_files() -> list[tuple[str, int, str]]:
    """(path, step or 0, text) of every file block, in the order the guide shows them."""
    return [(path, int(step or 0), text) for path, step, text in FILE_BLOCK.findall(GUIDE.read_text())]


def example_files() -> dict[str, str]:
    files = [EXAMPLE / "pyproject.toml", *sorted((EXAMPLE / "src").rglob("*.py"))]
    return {str(f.relative_to(EXAMPLE)): f.read_text() for f in files}


def test_guide_shows_every_file_of_the_example_verbatim():
    shown = {path: text for path, step, text in guide_files() if step == 0}
    assert shown == example_files()


def test_guide_steps_are_numbered_in_order():
    steps = [step for _, step, _ in guide_files() if step]
    assert steps == sorted(steps) and set(steps) == {2, 3}


def test_guide_quotes_what_the_kit_says_about_the_broken_example():
    spec = importlib.util.spec_from_file_location("podium_example_broken_npu", BROKEN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    platform = module.BrokenNpuPlatform()
    with pytest.raises(ConformanceError) as info:
        check_layout(platform, platform.attention_backend(), kit_spec(torch.float32))
    quoted = re.search(r"```text\n(wrong cache layout.*?)```", GUIDE.read_text(), re.S).group(1)
    assert " ".join(quoted.split()) == " ".join(str(info.value).split())


def build_guide_plugin(folder: Path, up_to_step: int) -> Path:
    """The example's files, then each step's files (a later block replaces an earlier one)."""
    shutil.copytree(EXAMPLE, folder, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    for path, step, text in guide_files():
        if 0 < step <= up_to_step:
            (folder / path).write_text(text)
    return folder


def run_kit(tmp_path: Path, site: Path) -> tuple[int, str]:
    workdir = tmp_path / "empty"
    workdir.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")])), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", "--podium-platform", "example-npu"]
    result = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=600)
    return result.returncode, result.stdout + result.stderr


@pytest.mark.slow
def test_plugin_built_from_the_guides_steps_passes_the_kit_with_graph_capture(tmp_path):
    source = build_guide_plugin(tmp_path / "npu-plugin", up_to_step=3)
    site = tmp_path / "site"
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
        str(site),
        str(source),
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
    code, out = run_kit(tmp_path, site)
    assert code == 0, out
    assert "attention backend NpuAttentionBackend" in out  # step 2's backend is the one tested
    assert "podium-kit::test_graph_capture_replay_equals_eager[float32] PASSED" in out  # step 3's capture
    assert "podium-kit::test_attention_matches_reference[float32-soft-cap] PASSED" in out
