"""The tables of a ``benchmarks/cpu_session.sh`` results folder (Markdown on stdout, summary.json beside).

    python benchmarks/cpu_session_summary.py RESULTS_DIR [--failed "step step"]

Throughputs are medians over the folder's repeats (each run is listed in brackets); ratios are
of the medians. Missing files (a skipped or failed step) show as "-".
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

STARTUP_ROWS = ("python_start", "imports", "platform", "config", "tokenizer", "custom_ops", "model_build", "weights",
                "kv_cache", "graph_capture", "engine", "ready", "first_request")


def load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def repeats(folder: Path, pattern: str) -> list[dict]:
    """Every JSON in ``folder`` whose name matches ``pattern`` (``r<N>`` repeats), in repeat order."""
    found = sorted((int(m.group(1)), p) for p in folder.glob("*.json") if (m := re.fullmatch(pattern, p.name)))
    return [d for _, p in found if (d := load(p)) is not None]


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def cell(values: list[float], digits: int = 1) -> str:
    if not values:
        return "-"
    runs = f" [{', '.join(f'{v:.{digits}f}' for v in values)}]" if len(values) > 1 else ""
    return f"{median(values):.{digits}f}{runs}"


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else "-"


def same_workload(folder: Path, dtypes: list[str]) -> tuple[list[str], dict]:
    lines = ["| dtype | Podium out tok/s | transformers out tok/s | vLLM-CPU out tok/s | Podium / transformers "
             "| Podium / vLLM | vLLM load-to-ready s |", "| --- | --- | --- | --- | --- | --- | --- |"]
    data = {}
    for dtype in dtypes:
        ours = repeats(folder, rf"a_{dtype}_r(\d+)\.json")
        vllm = repeats(folder, rf"c_vllm_{dtype}_r(\d+)\.json")
        podium = [d["results"]["podium"]["output_tokens_per_s"] for d in ours if "podium" in d.get("results", {})]
        hf = [d["results"]["hf"]["output_tokens_per_s"] for d in ours if "hf" in d.get("results", {})]
        peer = [d["output_tokens_per_s"] for d in vllm]
        ready = [d["load_to_ready_s"] for d in vllm]
        lines.append(f"| {dtype} | {cell(podium)} | {cell(hf)} | {cell(peer)} | {ratio(median(podium), median(hf))} "
                     f"| {ratio(median(podium), median(peer))} | {cell(ready)} |")
        data[dtype] = {"podium": podium, "hf": hf, "vllm": peer, "vllm_load_to_ready_s": ready}
    return lines, data


def issue5(folder: Path) -> tuple[list[str], dict]:
    lines = ["| workload | requests | mean in / out | Podium out tok/s | Podium total tok/s | transformers out tok/s "
             "| Podium / transformers |", "| --- | --- | --- | --- | --- | --- | --- |"]
    data = {}
    for name, label in (("b_fixed", "fixed in / out"), ("b_sharegpt", "sharegpt-like")):
        d = load(folder / f"{name}.json")
        if d is None:
            lines.append(f"| {label} | - | - | - | - | - | - |")
            continue
        stats, results = d.get("dataset_stats", {}), d.get("results", {})
        podium, hf = results.get("podium", {}), results.get("hf", {})
        p_out, h_out = podium.get("output_tokens_per_s"), hf.get("output_tokens_per_s")
        lines.append(f"| {label} | {stats.get('num_requests', '-')} | {stats.get('mean_input_len', 0):.0f} / "
                     f"{stats.get('mean_output_len', 0):.0f} | {p_out or 0:.1f} | "
                     f"{podium.get('total_tokens_per_s') or 0:.1f} | {h_out or 0:.1f} | {ratio(p_out, h_out)} |")
        data[name] = {"dataset_stats": stats, "podium": podium, "hf": hf}
    return lines, data


def best_pairs(folder: Path, podium_dtype: str, vllm_dtype: str) -> tuple[list[str], dict]:
    """(e): each pair's Podium / vLLM ratio, and the median of the ratios."""
    ours = {int(m.group(1)): d for p in folder.glob("e_podium_p*.json")
            if (m := re.fullmatch(r"e_podium_p(\d+)\.json", p.name)) and (d := load(p)) is not None}
    peer = {int(m.group(1)): d for p in folder.glob("e_vllm_p*.json")
            if (m := re.fullmatch(r"e_vllm_p(\d+)\.json", p.name)) and (d := load(p)) is not None}
    pairs = sorted(set(ours) & set(peer))
    if not pairs:
        return ["(no best-against-best pairs)"], {}
    lines = [f"| pair (first engine) | Podium {podium_dtype} out tok/s | vLLM-CPU {vllm_dtype} out tok/s | ratio |",
             "| --- | --- | --- | --- |"]
    ratios = []
    for n in pairs:
        a, b = ours[n]["results"]["podium"]["output_tokens_per_s"], peer[n]["output_tokens_per_s"]
        ratios.append(a / b)
        lines.append(f"| {n} ({'Podium' if n % 2 else 'vLLM'}) | {a:.1f} | {b:.1f} | {a / b:.2f} |")
    lines.append(f"\nmedian ratio {median(ratios):.2f}, lowest {min(ratios):.2f} ({len(pairs)} pairs)")
    return lines, {"pairs": pairs, "ratios": ratios, "median_ratio": median(ratios)}


def startup(folder: Path, dtypes: list[str]) -> tuple[list[str], dict]:
    found = {dtype: d for dtype in dtypes if (d := load(folder / f"d_startup_{dtype}.json")) is not None}
    if not found:
        return ["(no startup results)"], {}
    lines = ["| stage (median s) | " + " | ".join(found) + " |", "| --- |" + " --- |" * len(found)]
    for row in STARTUP_ROWS:
        values = [f"{d['median'][row]:.2f}" if row in d["median"] else "-" for d in found.values()]
        lines.append(f"| {'**' + row + '**' if row == 'ready' else row} | " + " | ".join(values) + " |")
    runs = ", ".join(f"{dtype}: {len(d['runs'])} runs" for dtype, d in found.items())
    lines.append(f"\n({runs}; fresh processes after one untimed warm start)")
    return lines, {dtype: d["median"] for dtype, d in found.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--failed", default="", help="names of steps that failed (listed in the summary)")
    parser.add_argument("--dtypes", default="bfloat16 float32")
    parser.add_argument("--b-dtype", default="bfloat16", help="the dtype of the fixed and sharegpt-like runs (for the heading)")
    parser.add_argument("--best", default="bfloat16 float32", help="the dtypes of the (e) pairs: Podium's, vLLM's")
    args = parser.parse_args()
    dtypes = args.dtypes.split()
    env = (args.folder / "environment.txt").read_text().strip() if (args.folder / "environment.txt").exists() else ""
    same, same_data = same_workload(args.folder, dtypes)
    fixed, fixed_data = issue5(args.folder)
    boot, boot_data = startup(args.folder, dtypes)
    best, best_data = best_pairs(args.folder, *args.best.split())
    failed = args.failed.split()
    report = ["# CPU session", "", "```", env, "```", "",
              "## SmolLM2-135M, same request file for every engine (greedy, EOS ignored)", "", *same, "",
              "## Best against best: Podium's fastest dtype against vLLM-CPU's, alternated pairs", "", *best, "",
              f"## Fixed and sharegpt-like workloads: Podium vs transformers ({args.b_dtype})", "", *fixed, "",
              "## Podium startup, LLM(model) load to ready", "", *boot, "",
              f"Failed steps: {', '.join(failed) if failed else 'none'}"]
    print("\n".join(report))
    summary = {"same_workload": same_data, "issue5": fixed_data, "startup": boot_data, "best_pairs": best_data,
               "failed": failed}
    (args.folder / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
