"""Where a result came from (machine, platform, versions, date) and how it is printed and saved."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else ``platform.processor()``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_description(device_platform) -> str | None:
    """What a Podium platform found here (its availability reason: ``1 x NVIDIA H200``, ...), or None."""
    if device_platform is None:
        return None
    try:
        return device_platform.availability().reason or device_platform.name
    except Exception:  # a broken driver must not break the report
        return device_platform.name


def environment(podium_platform: str | None = None, device_platform=None) -> dict:
    """Everything a reader needs to know about where a number was measured (``device_platform``:
    the podium_plugin_api Platform that ran it, if any)."""
    import torch

    try:
        import transformers

        transformers_version = transformers.__version__
    except ImportError:
        transformers_version = None
    from podium import __version__

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "cpu": cpu_model(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "device": device_description(device_platform),
            "arch": platform.machine(),
        },
        "platform": platform.platform(),
        "podium_platform": podium_platform,
        "python": sys.version.split()[0],
        "podium_version": __version__,
        "torch_version": torch.__version__,
        "transformers_version": transformers_version,
        "argv": sys.argv,
    }


def write_json(path: str | Path, payload: dict) -> Path:
    path = Path(path)
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n", encoding="utf-8")
    return path


def result_path(args, command: str, model: str) -> Path | None:
    """Where ``--save-result`` (or ``--result-filename``) writes, vLLM's way: ``--result-dir`` /
    ``--result-filename``, else ``COMMAND-MODEL-YYYYMMDD-HHMMSS.json``; None when not asked."""
    if not (args.save_result or args.result_filename):
        return None
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    name = args.result_filename or f"{command}-{Path(model).name or 'model'}-{stamp}.json"
    return Path(args.result_dir or ".") / name


def format_rows(title: str, rows: list[tuple[str, object]], width: int = 50) -> str:
    """A vLLM-style block: a centred title and ``label: value`` lines."""
    lines = [f"{' ' + title + ' ':=^{width}}"]
    for label, value in rows:
        if label.startswith("---"):
            lines.append(f"{' ' + label.strip('- ') + ' ':-^{width}}")
            continue
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label + ':':<{width - 12}}{text:>12}")
    lines.append("=" * width)
    return "\n".join(lines)
