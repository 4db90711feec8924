"""A GGUF file's config without transformers' config classes: the same fields, fewer imports.

Reference: transformers' ``AutoConfig.for_model`` for the same metadata, field by field (its
defaults for keys a file lacks and the values its ``__post_init__`` derives), on the real SmolLM2
file and on synthetic files of each architecture with every key and with only the required ones.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
from engine_fixtures import smollm2_gguf
from model_fixtures import write_gguf

from podium.loader.gguf_config import gguf_config, gguf_config_kwargs
from podium.loader.gguf_reader import read_gguf

pytest.importorskip("gguf")

# what building transformers' LlamaConfig imports (its type validators pull torch.distributed.tensor
# and sympy: ~1.4 s of a 2-core CPU's start), and what torch's empty_like on meta tensors pulls
HEAVY_MODULES = ("transformers.configuration_utils", "transformers.utils.type_validators", "torch.distributed.tensor",
                 "sympy")


def transformers_fields(model_type: str, kwargs: dict) -> dict:
    """Every model field of transformers' config for ``kwargs`` (PreTrainedConfig's generic ones left out)."""
    from transformers import AutoConfig, PreTrainedConfig

    config = AutoConfig.for_model(model_type, **copy.deepcopy(kwargs))
    generic = {f.name for f in dataclasses.fields(PreTrainedConfig)} - {"architectures"}
    fields = {name: value for name, value in vars(config).items() if not name.startswith("_") and name not in generic}
    return {**fields, "model_type": config.model_type}


def full_metadata(arch: str) -> dict:
    return {f"{arch}.block_count": 3, f"{arch}.context_length": 512, f"{arch}.embedding_length": 64,
            f"{arch}.feed_forward_length": 128, f"{arch}.attention.head_count": 4,
            f"{arch}.attention.head_count_kv": 2, f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
            f"{arch}.rope.freq_base": 500000.0, f"{arch}.attention.key_length": 32, f"{arch}.vocab_size": 96,
            f"{arch}.rope.scaling.type": "linear", f"{arch}.rope.scaling.factor": 2.0,
            "tokenizer.ggml.bos_token_id": 5, "tokenizer.ggml.eos_token_id": 6, "tokenizer.ggml.padding_token_id": 7}


def required_metadata(arch: str) -> dict:
    """Only what Podium requires: every other field takes transformers' default for the architecture."""
    return {f"{arch}.block_count": 2, f"{arch}.embedding_length": 64, f"{arch}.feed_forward_length": 128,
            f"{arch}.attention.head_count": 4}


SYNTHETIC = {f"{arch}-{variant}": (arch, metadata) for arch in ("llama", "qwen2", "qwen3")
             for variant, metadata in (("full", full_metadata), ("required", required_metadata))}


@pytest.fixture(params=["smollm2", *SYNTHETIC])
def gguf_file(request, tmp_path):
    if request.param == "smollm2":
        return read_gguf(smollm2_gguf())
    arch, metadata = SYNTHETIC[request.param]
    tensors = [("token_embd.weight", np.zeros((4, 64), dtype=np.float32), None)]
    if request.param.endswith("full"):  # untied: its own output matrix
        tensors.append(("output.weight", np.zeros((4, 64), dtype=np.float32), None))
    path = tmp_path / f"{request.param}.gguf"
    write_gguf(path, arch, metadata(arch), tensors)
    return read_gguf(path)


def test_every_field_equals_transformers_config(gguf_file):
    model_type, kwargs = gguf_config_kwargs(gguf_file)
    ours = gguf_config(gguf_file).to_dict()
    theirs = transformers_fields(model_type, kwargs)
    assert ours == theirs, {name: (ours.get(name, "<missing>"), theirs.get(name, "<missing>"))
                            for name in ours.keys() | theirs.keys() if ours.get(name) != theirs.get(name)}


def test_smollm2_fields():
    config = gguf_config(read_gguf(smollm2_gguf()))
    assert (config.model_type, config.architectures) == ("llama", ["LlamaForCausalLM"])
    heads = (config.num_attention_heads, config.num_key_value_heads, config.head_dim)
    assert config.hidden_size == 576 and heads == (9, 3, 64)
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 100000.0}
    assert config.tie_word_embeddings and not hasattr(config, "rope_freq_factors")


def test_loading_a_gguf_model_imports_no_config_machinery():
    """Resolving the embedded GGUF (config and tokenizer) and building its model, in a fresh process."""
    code = f"""
import json, sys
import torch
from podium.loader import resolve_model
from podium.models.registry import build_model
from podium_plugin_api.ops import build_op_table
heavy = {HEAVY_MODULES!r}
source = resolve_model("smollm2-135m-instruct")
resolved = [name for name in heavy if name in sys.modules]
build_model(source.hf_config, build_op_table(), torch.bfloat16, "cpu")
print(json.dumps({{"resolved": resolved, "built": [name for name in heavy if name in sys.modules],
                  "tokenizer": source.tokenizer is not None, "transformers": "transformers" in sys.modules}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.splitlines()[-1])
    assert seen["tokenizer"] and seen["transformers"]  # transformers' GGUF tokenizer was loaded
    assert seen["resolved"] == [], f"loading the GGUF config and tokenizer imported {seen['resolved']}"
    assert seen["built"] == [], f"building the model imported {seen['built']}"
