"""The kit as a vendor runs it: ``pytest --podium-platform NAME`` in an empty folder.

cpu and the installed example pass the whole suite; the deliberately broken example (wrong cache
layout) fails with a message pointing at the cause; an unknown platform is a usage error; and
without the option the kit's pytest plugin adds nothing.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = [ROOT / "examples" / "npu-plugin", ROOT / "examples" / "broken-npu-plugin"]
USAGE_ERROR, NO_TESTS = 4, 5  # pytest exit codes


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """Both examples pip-installed into a folder that only the kit's subprocesses see."""
    base = tmp_path_factory.mktemp("kit-examples")
    copies = []
    for src in EXAMPLES:
        shutil.copytree(src, base / src.name, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        copies.append(str(base / src.name))
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
        str(base / "site"),
        *copies,
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
    return base / "site"


def run_pytest(tmp_path: Path, *args: str, site: Path | None = None) -> tuple[int, str]:
    """pytest in an empty folder (no ini file, no conftest), the examples on PYTHONPATH."""
    workdir = tmp_path / "empty"
    workdir.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PODIUM_DEVICE")}
    env["OMP_NUM_THREADS"] = "1"  # tiny tensors: threads would only contend
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rfEs", *args]
    result = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=600)
    return result.returncode, result.stdout + result.stderr


def counts(output: str) -> dict[str, int]:
    summary = output.strip().splitlines()[-1]
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|error)", summary)}


@pytest.mark.slow
def test_kit_passes_for_cpu(tmp_path):
    code, out = run_pytest(tmp_path, "--podium-platform", "cpu")
    assert code == 0, out
    assert "podium platform kit: platform 'cpu' (podium-cpu" in out
    tally = counts(out)
    assert tally.get("failed", 0) == 0 and tally["passed"] >= 30  # three dtypes, every attention case
    # graphs: float32 and bf16 steps captured and replayed; float16 (no native kernel) declined, saying why
    assert re.search(r"SKIPPED \[1\] .*graph capture of a decode step .*float16.*does not capture it", out), out


@pytest.mark.slow
def test_kit_passes_for_the_example_npu(tmp_path, site):
    code, out = run_pytest(tmp_path, "--podium-platform", "example-npu", "-v", site=site)
    assert code == 0, out
    assert "podium-kit::test_tiny_generation_matches_cpu_reference PASSED" in out
    assert "podium-kit::test_communicator_two_processes PASSED" in out  # two spawned ranks over gloo
    assert "podium-kit::test_attention_matches_reference[float32-sliding-window-small] PASSED" in out


@pytest.mark.slow
def test_kit_fails_the_broken_example_and_points_at_its_cache_layout(tmp_path, site):
    code, out = run_pytest(tmp_path, "--podium-platform", "broken-npu", site=site)
    assert code == 1, out
    assert "FAILED podium-kit::test_kv_cache_layout[float32]" in out
    assert "wrong cache layout: kv_cache_shape(spec, num_blocks=7) is [2, 7, 2, 16, 64]" in out
    assert "HeadMajorBackend uses AttentionBackend's default write_kv, read_kv, attend" in out
    assert "FAILED podium-kit::test_tiny_generation_matches_cpu_reference" in out
    assert "FAILED podium-kit::test_api_version" not in out  # only what is broken fails


def test_kit_reports_an_unknown_platform_as_a_usage_error(tmp_path, site):
    code, out = run_pytest(tmp_path, "--podium-platform", "nope", site=site)
    assert code == USAGE_ERROR, out
    assert "no platform named 'nope' is installed" in out
    assert "example-npu (podium-example-npu 0.1.0)" in out and "cpu (podium-cpu" in out


def test_without_the_option_the_kit_adds_nothing(tmp_path):
    code, out = run_pytest(tmp_path)
    assert code == NO_TESTS, out
    assert "podium platform kit" not in out
