"""Pooling: a pooling model's hidden states -> one embedding per input.

What to pool is read from the model folder the way sentence-transformers reads it:
``modules.json`` lists the pipeline (Transformer -> Pooling -> optional Normalize);
``1_Pooling/config.json`` (the Pooling module's folder) says mean, CLS or last-token;
``sentence_bert_config.json`` caps the input length (``max_seq_length``). A folder without them
takes the architecture's default: CLS for an encoder, the last token for a decoder, normalised
(vLLM's defaults). ``PoolerConfig`` overrides either. Modules Podium does not apply (a ``Dense``
projection, max pooling) are refused at load, naming them, rather than giving other vectors.

A pooling step computes whole inputs (the scheduler does not chunk them), so pooling sees every
token of each sequence in one flat batch::

    hidden [T, hidden], seq_lens [S] -> pooled [S, hidden] (float32)

Then per request: Matryoshka truncation to ``dimensions`` (where the model was trained for it:
``is_matryoshka`` / ``matryoshka_dimensions`` in config.json, vLLM's names), then normalisation.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import InvalidParameter
from .pooling_config import PoolerConfig
from .pooling_params import PoolingParams

logger = logging.getLogger(__name__)

_ST_POOLING_MODES = {"pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS",
                     "pooling_mode_lasttoken": "LAST"}
_ST_UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                         "pooling_mode_weightedmean_tokens")
_ST_APPLIED = ("Transformer", "Pooling", "Normalize")


@dataclass(frozen=True)
class FolderPooling:
    """What a sentence-transformers folder says (None: it does not say)."""

    pooling_type: str | None = None
    normalize: bool | None = None
    max_seq_length: int | None = None


def read_folder_pooling(folder: str | Path | None) -> FolderPooling:
    """The pooling a model folder's sentence-transformers files describe; ValueError for a module or
    mode Podium does not apply."""
    if folder is None or not Path(folder).is_dir():
        return FolderPooling()
    folder = Path(folder)
    max_len = _read_json(folder / "sentence_bert_config.json").get("max_seq_length")
    modules = _read_json(folder / "modules.json", default=[])
    if not modules:
        return FolderPooling(max_seq_length=max_len)
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules}
    other = [f"{m.get('path') or m.get('name')} ({kind})" for kind, m in kinds.items() if kind not in _ST_APPLIED]
    if other:
        raise ValueError(f"{folder}/modules.json has module(s) Podium does not apply: {', '.join(other)}; "
                         f"it applies {', '.join(_ST_APPLIED)}")
    pooling_type = None
    if "Pooling" in kinds:
        pooling_type = _pooling_mode(folder / kinds["Pooling"].get("path", "1_Pooling") / "config.json")
    return FolderPooling(pooling_type, "Normalize" in kinds, max_len)


def _pooling_mode(file: Path) -> str:
    config = _read_json(file)
    unsupported = [key for key in _ST_UNSUPPORTED_MODES if config.get(key)]
    modes = [mode for key, mode in _ST_POOLING_MODES.items() if config.get(key)]
    if unsupported or len(modes) != 1:
        asked = ", ".join(unsupported + [k for k, m in _ST_POOLING_MODES.items() if config.get(k)]) or "none"
        raise ValueError(f"{file} asks for pooling {asked}; Podium pools with exactly one of "
                         f"{', '.join(_ST_POOLING_MODES)}")
    return modes[0]


def _read_json(file: Path, default=None):
    if not file.exists():
        return {} if default is None else default
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"cannot read {file}: {error}") from None


def matryoshka_dimensions(hf_config) -> tuple[bool, list[int] | None]:
    """(whether ``dimensions`` may shorten embeddings, the allowed sizes or None for any)."""
    sizes = getattr(hf_config, "matryoshka_dimensions", None)
    allowed = bool(getattr(hf_config, "is_matryoshka", False)) or bool(sizes)
    return allowed, [int(s) for s in sizes] if sizes else None


class Pooler:
    """One model's pooling: the type, the default normalisation and what ``dimensions`` may be."""

    def __init__(self, pooling_type: str, normalize: bool, hidden_size: int, hf_config=None) -> None:
        self.pooling_type, self.normalize, self.hidden_size = pooling_type, normalize, hidden_size
        self.matryoshka, self.dimension_sizes = matryoshka_dimensions(hf_config)

    @classmethod
    def for_model(cls, hf_config, folder: FolderPooling, overrides: PoolerConfig | None, encoder: bool) -> Pooler:
        """The folder's pooling with ``overrides`` applied; else the architecture's default."""
        overrides = overrides or PoolerConfig()
        kind = overrides.pooling_type or folder.pooling_type or ("CLS" if encoder else "LAST")
        normalize = next(v for v in (overrides.normalize, folder.normalize, True) if v is not None)
        return cls(kind, normalize, hf_config.hidden_size, hf_config)

    def describe(self) -> str:
        return f"{self.pooling_type} pooling, {'normalised' if self.normalize else 'not normalised'}"

    def check(self, params: PoolingParams, model_name: str) -> None:
        """Refuse ``params`` this model cannot honour (InvalidParameter naming the parameter)."""
        dims = params.dimensions
        if dims is None:
            return
        if not self.matryoshka:
            raise InvalidParameter(f"dimensions={dims}: model {model_name!r} does not support Matryoshka embeddings "
                                   f"(its embeddings have {self.hidden_size} dimensions); leave dimensions unset",
                                   param="dimensions")
        if self.dimension_sizes is not None and dims not in self.dimension_sizes:
            raise InvalidParameter(f"dimensions={dims}: model {model_name!r} supports dimensions "
                                   f"{self.dimension_sizes}", param="dimensions")
        if dims > self.hidden_size:
            raise InvalidParameter(f"dimensions={dims} exceeds the model's embedding size {self.hidden_size}",
                                   param="dimensions")

    def pool(self, hidden: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """hidden [T, hidden] of whole sequences end to end -> [S, hidden] float32 on the host."""
        lens = torch.tensor(seq_lens, device=hidden.device)
        ends = lens.cumsum(0)  # [S]
        if self.pooling_type == "CLS":
            pooled = hidden[ends - lens].float()
        elif self.pooling_type == "LAST":
            pooled = hidden[ends - 1].float()
        else:  # MEAN: a sum per sequence (index_add over each token's sequence) over its length
            owner = torch.repeat_interleave(torch.arange(len(seq_lens), device=hidden.device), lens)  # [T]
            sums = torch.zeros(len(seq_lens), hidden.shape[1], dtype=torch.float32, device=hidden.device)
            pooled = sums.index_add_(0, owner, hidden.float()) / lens[:, None].float()
        return pooled.cpu()

    def finish(self, pooled: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        """One request's embedding: [hidden] -> [dimensions or hidden], normalised as asked."""
        if params.dimensions is not None:
            pooled = pooled[:params.dimensions]
        normalize = self.normalize if params.normalize is None else params.normalize
        return torch.nn.functional.normalize(pooled, dim=-1) if normalize else pooled
