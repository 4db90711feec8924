"""The reference backend: transformers ``generate``, run the way a plain transformers user would.

Requests are taken in order in batches of ``batch_size``, left padded; each batch generates until
its longest request's ``output_len`` (EOS suppressed: ``min_new_tokens == max_new_tokens``), so
a batch with mixed output lengths pays for its longest member. Throughput counts only the tokens
the requests asked for (what Podium produces), and reports the overshoot as ``generated_tokens``.

The model is built from the same source Podium uses: a GGUF file (dequantized by transformers' own
GGUF reader), a Hugging Face folder with weights, or a config (``config.json``, a named shape)
with random weights built directly on the device.
"""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm.auto import tqdm

from podium.config import DEFAULT_MODEL

from .datasets import BenchRequest
from .metrics import ThroughputResult


def gguf_path(model: str, path: str | None = None) -> Path | None:
    """The GGUF file behind ``model`` (the embedded name, a .gguf file, a folder holding one), else None."""
    if model == DEFAULT_MODEL:
        from podium.loader import embedded_gguf_path

        return embedded_gguf_path()
    candidate = Path(path or model)
    if candidate.is_file() and candidate.suffix == ".gguf":
        return candidate
    if candidate.is_dir() and not (candidate / "config.json").is_file():
        files = sorted(candidate.glob("*.gguf"))
        return files[0] if len(files) == 1 else None
    return None


def _has_weights(folder: Path) -> bool:
    return any(folder.glob("*.safetensors")) or any(folder.glob("pytorch_model*.bin"))


def _load_gguf(path: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    bar = gguf_utils.tqdm
    gguf_utils.tqdm = functools.partial(bar, disable=True)  # its per-tensor bar would bury the benchmark's output
    try:
        tensors = gguf_utils.load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    finally:
        gguf_utils.tqdm = bar
    result = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(result.missing_keys) - tied or result.unexpected_keys:
        raise ValueError(f"{path}: GGUF tensors do not match the transformers model: missing "
                         f"{sorted(set(result.missing_keys) - tied)[:5]}, unexpected {result.unexpected_keys[:5]}")
    return model.to(device=device, dtype=dtype)


def _config_of(model: str):
    """A transformers config for a config.json file/folder, else whatever Podium's loader resolves."""
    path = Path(model)
    if (path.name == "config.json" and path.is_file()) or (path / "config.json").is_file():
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(path)
    from podium.loader import resolve_model

    return resolve_model(model).hf_config


def load_hf_model(model: str, dtype: torch.dtype, device: torch.device, seed: int = 0, hf_config=None,
                  path: str | None = None):
    """A transformers causal LM for ``model`` (loaded from ``path`` if given); random weights when
    the source has none (a config.json, a named shape: then ``hf_config`` is used if given)."""
    from transformers import AutoModelForCausalLM

    gguf = gguf_path(model, path)
    folder = Path(path or model)
    if gguf is not None:
        built = _load_gguf(gguf, dtype, device)
    elif folder.is_dir() and _has_weights(folder):
        built = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device)
    else:
        config = copy.deepcopy(hf_config if hf_config is not None else _config_of(model))
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        torch.manual_seed(seed)
        with torch.device(device):  # random init directly on the device (an 8B shape on a GPU)
            built = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return built.eval()


def left_padded(batch: list[BenchRequest], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask, both [B, longest prompt], prompts aligned to the right."""
    width = max(r.input_len for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, req in enumerate(batch):
        ids[row, width - req.input_len:] = torch.tensor(req.prompt_token_ids, dtype=torch.long)
        mask[row, width - req.input_len:] = 1
    return ids.to(device), mask.to(device)


class HFBackend:
    """transformers ``generate`` over a request list, timed the way ``throughput`` needs."""

    name = "hf"

    def __init__(self, model: torch.nn.Module, device: torch.device, batch_size: int = 64,
                 pad_token_id: int = 0, eos_token_id: int | None = None,
                 synchronize: Callable[[], None] = lambda: None) -> None:
        """``synchronize``: waits for the device (the platform's ``synchronize``), so a timed batch has ended."""
        if batch_size < 1:
            raise ValueError(f"--hf-batch-size must be >= 1, got {batch_size}")
        self.model, self.device, self.batch_size = model, device, batch_size
        self.synchronize = synchronize
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id if eos_token_id is not None else _first_eos(model)

    def batches(self, requests: list[BenchRequest]) -> list[list[BenchRequest]]:
        return [requests[i:i + self.batch_size] for i in range(0, len(requests), self.batch_size)]

    @torch.inference_mode()
    def generate_tokens(self, batch: list[BenchRequest]) -> torch.Tensor:
        """Greedy tokens for one batch: [B, longest output_len], EOS suppressed until the end."""
        from transformers import GenerationConfig

        new_tokens = max(r.output_len for r in batch)
        ids, mask = left_padded(batch, self.pad_token_id, self.device)
        config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  pad_token_id=self.pad_token_id, eos_token_id=self.eos_token_id, use_cache=True)
        out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=config)  # [B, width + new]
        self.synchronize()
        if out.shape[1] - ids.shape[1] != new_tokens:
            raise RuntimeError(f"transformers generated {out.shape[1] - ids.shape[1]} tokens per row, expected {new_tokens}")
        return out[:, ids.shape[1]:]

    def generate_batch(self, batch: list[BenchRequest]) -> int:
        """Generate for one batch; returns the number of tokens produced (rows x new tokens)."""
        return self.generate_tokens(batch).numel()

    def warmup(self, requests: list[BenchRequest]) -> None:
        """One untimed batch, the first: transformers' first pass over new shapes is slow."""
        if requests:
            self.generate_batch(self.batches(requests)[0])

    def run(self, requests: list[BenchRequest], progress: bool = True) -> ThroughputResult:
        bar = tqdm(total=len(requests), desc="transformers", unit="req", disable=not progress or len(requests) < 2)
        generated = 0
        start = time.perf_counter()
        try:
            for batch in self.batches(requests):
                generated += self.generate_batch(batch)
                bar.update(len(batch))
        finally:
            bar.close()
        elapsed = time.perf_counter() - start
        return ThroughputResult(self.name, elapsed, len(requests), sum(r.input_len for r in requests),
                                sum(r.output_len for r in requests), generated_tokens=generated)


def _first_eos(model: torch.nn.Module) -> int | None:
    eos = getattr(model.generation_config, "eos_token_id", None) or getattr(model.config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        return int(eos[0]) if eos else None
    return None if eos is None else int(eos)
