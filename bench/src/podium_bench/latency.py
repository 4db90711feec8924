"""``podium bench latency``: how long one batch takes to prefill and to decode each token.

Each iteration times two generates of ``batch_size`` random prompts of ``input_len`` tokens:
one with ``max_tokens=1`` (prefill: the batch's time to first token) and one with
``max_tokens=output_len`` (the full run). Decode time per token is
``(full - prefill) / (output_len - 1)``. Every generate gets fresh prompts, so prefix caching
never shortens a prefill. Medians over ``num_iters`` iterations, after warm-up iterations.
"""

from __future__ import annotations

from tqdm.auto import tqdm

from .backends import EngineOptions, free_memory, hf_backend, podium_backend, target_of, target_without_engine
from .datasets import DatasetSpec, build_requests
from .metrics import latency_summary
from .report import environment, format_rows


def _batch(space, batch_size: int, input_len: int, output_len: int, seed: int):
    spec = DatasetSpec("random", num_prompts=batch_size, input_len=input_len, output_len=output_len, seed=seed)
    return build_requests(spec, space)


def _time_iteration(backend, space, batch_size: int, input_len: int, output_len: int, seed: int) -> tuple[float, float]:
    prefill = backend.run(_batch(space, batch_size, input_len, 1, 2 * seed + 1), progress=False).elapsed_s
    full = backend.run(_batch(space, batch_size, input_len, output_len, 2 * seed + 2), progress=False).elapsed_s
    return prefill, full


def run_latency(options: EngineOptions, backend_name: str = "podium", batch_size: int = 8, input_len: int = 32,
                output_len: int = 128, num_iters: int = 3, num_warmup: int = 1, progress: bool = True) -> dict:
    for name, value, low in (("batch_size", batch_size, 1), ("input_len", input_len, 1), ("output_len", output_len, 2),
                             ("num_iters", num_iters, 1), ("num_iters_warmup", num_warmup, 0)):
        if value < low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")
    if backend_name == "podium":
        backend = podium_backend(options)
        target = target_of(backend)
        backend.warmup()
    elif backend_name == "hf":
        target = target_without_engine(options)
        backend = hf_backend(options, target, batch_size)
    else:
        raise ValueError(f"--backend must be podium or hf, got {backend_name!r}")
    if input_len + output_len > target.space.max_model_len:
        raise ValueError(f"--input-len {input_len} + --output-len {output_len} exceeds the context of "
                         f"{target.space.max_model_len}")
    base_seed = options.config.seed * 10_000
    for i in range(num_warmup):
        _time_iteration(backend, target.space, batch_size, input_len, output_len, base_seed + 5_000 + i)
    prefill, full = [], []
    for i in tqdm(range(num_iters), desc="iterations", disable=not progress):
        p, f = _time_iteration(backend, target.space, batch_size, input_len, output_len, base_seed + i)
        prefill.append(p)
        full.append(f)
    backend = None
    free_memory(target.platform)
    return {
        "command": "latency",
        "environment": environment(target.platform_name, target.platform),
        "config": {**options.as_dict(), "backend": backend_name, "input_len": input_len,
                   "resolved_dtype": str(target.dtype).replace("torch.", ""), "resolved_device": str(target.device)},
        "results": latency_summary(prefill, full, output_len, batch_size),
    }


def format_latency(payload: dict) -> str:
    r, c = payload["results"], payload["config"]
    rows: list[tuple[str, object]] = [
        ("Model", c["model"]),
        ("Backend", c["backend"]),
        ("Batch x input / output", f"{r['batch_size']} x {c['input_len']} / {r['output_len']}"),
        ("Iterations", r["num_iters"]),
        ("Prefill, median (ms)", r["prefill_s_median"] * 1000),
        ("Decode per token, median (ms)", r["decode_per_token_s_median"] * 1000),
        ("Full generate, median (s)", r["full_s_median"]),
        ("Decode tokens/s (batch)", r["decode_tokens_per_s"]),
    ]
    return format_rows("Latency Benchmark Result", rows)
