"""Multi-LoRA serving against PEFT: adapters built with PEFT's own ``get_peft_model`` (lora_B random),
saved with ``save_pretrained``, served by the engine; the PEFT model on the same base is the reference.

Greedy tokens equal PEFT's and each step's logprob of the chosen token is within 1e-4 (float32);
a batch mixing four adapters and the base model equals each request run alone; with fewer device
slots than adapters the requests wait for a slot (never more adapters in a step than slots) and
outputs stay equal; an adapter dropped from the host cache (max_cpu_loras) is read again from its
folder and still equals PEFT; prefix-cache hits never cross adapters (the block manager's hit counter);
adapters load and unload at run time; what cannot be served is refused naming the numbers.
"""

from __future__ import annotations

import pytest
import torch
from lora_fixtures import make_adapter, peft_greedy
from model_fixtures import ARCHITECTURES, save_tiny_model

from podium import LLM, SamplingParams
from podium.errors import AdapterNotFound, InvalidParameter
from podium.lora.request import LoRARequest

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

ENGINE = {"dtype": "float32", "device": "cpu", "block_size": 4, "max_num_seqs": 8, "max_num_batched_tokens": 32,
          "num_kv_blocks": 96, "enforce_eager": True, "max_model_len": 64, "enable_lora": True, "max_lora_rank": 8}
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)


def prompts(count: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 90, (int(n),), generator=g).tolist() for n in torch.randint(3, 20, (count,), generator=g)]


def tokens_prompts(ps: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in ps]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("base")
    model_type, overrides = ARCHITECTURES["llama3-rope-untied"]
    save_tiny_model(model_type, overrides, folder)
    return folder


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    """Four adapters of the base: all seven projections; q/v only at rank 4; rsLoRA with a rank and an
    alpha pattern; the MLP only. (name, folder, PEFT model)."""
    root = tmp_path_factory.mktemp("adapters")
    kinds = {"all": {}, "qv": {"rank": 4, "targets": ("q_proj", "v_proj")},
             "rslora": {"use_rslora": True, "rank_pattern": {"k_proj": 2}, "alpha_pattern": {"down_proj": 5}},
             "mlp": {"targets": ("gate_proj", "up_proj", "down_proj"), "alpha": 4}}
    return [(name, root / name, make_adapter(base, root / name, seed=i + 1, **kw))
            for i, (name, kw) in enumerate(kinds.items())]


def lora(adapters, index: int) -> LoRARequest:
    name, folder, _ = adapters[index]
    return LoRARequest(name, index + 1, str(folder))


def chosen_logprobs(sample) -> list[float]:
    return [step[token].logprob for step, token in zip(sample.logprobs, sample.token_ids)]


def peft_logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    steps = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    return [float(steps[i, t]) for i, t in enumerate(tokens)]


TARGETS = {"mixtral-moe": ("q_proj", "k_proj", "v_proj", "o_proj"),
           "phi3-longrope-partial": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}


@pytest.mark.parametrize("arch", ["llama3-rope-untied", "qwen2-bias", "qwen3-qk-norm", "mixtral-moe",
                                  "phi3-longrope-partial"])
def test_outputs_equal_peft(arch, tmp_path):
    """Every projection kind adapted, on models with q/k/v biases, q/k norms and experts (attention
    adapted, the experts not: PEFT's all-linear would target them, so the test names the projections),
    and Phi-3, whose checkpoints (and adapters) hold the merged qkv_proj and gate_up_proj."""
    model_type, overrides = ARCHITECTURES[arch]
    save_tiny_model(model_type, overrides, tmp_path / "base")
    targets = TARGETS.get(arch, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    peft_model = make_adapter(tmp_path / "base", tmp_path / "adapter", seed=7, targets=targets, use_rslora=True)
    llm = LLM(str(tmp_path / "base"), **ENGINE)
    request = LoRARequest("a", 1, str(tmp_path / "adapter"))
    for prompt in prompts(3):
        got = llm.generate(tokens_prompts([prompt]), GREEDY, lora_request=request, use_tqdm=False)[0].outputs[0]
        want = peft_greedy(peft_model, prompt, GREEDY.max_tokens)
        assert got.token_ids == want, f"{arch}: podium {got.token_ids} != peft {want}"
        worst = max(abs(a - b) for a, b in zip(chosen_logprobs(got), peft_logprobs(peft_model, prompt, want)))
        assert worst < 1e-4, f"{arch}: logprobs differ from PEFT's by {worst}"
    with peft_model.disable_adapter():
        base_tokens = peft_greedy(peft_model, prompts(1)[0], GREEDY.max_tokens)
    assert llm.generate(tokens_prompts(prompts(1)), GREEDY, use_tqdm=False)[0].outputs[0].token_ids == base_tokens
    assert base_tokens != peft_greedy(peft_model, prompts(1)[0], GREEDY.max_tokens), "the adapter changed nothing"


def test_each_adapter_equals_peft_and_a_mixed_batch_equals_each_alone(base, adapters):
    """Four adapters and the base in one generate call (max_loras=4: all on the device), prompts
    long enough to be chunked by the 32-token budget; each equals the same request alone, and PEFT."""
    llm = LLM(str(base), **{**ENGINE, "max_loras": 4})
    ps = prompts(10)
    which = [None, 0, 1, 2, 3, 0, None, 3, 2, 1]
    requests = [None if i is None else lora(adapters, i) for i in which]
    mixed = llm.generate(tokens_prompts(ps), GREEDY, lora_request=requests, use_tqdm=False)
    for prompt, index, request, out in zip(ps, which, requests, mixed):
        alone = llm.generate(tokens_prompts([prompt]), GREEDY, lora_request=request, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids, f"adapter {index}: mixed != alone"
        if index is not None:
            assert out.outputs[0].token_ids == peft_greedy(adapters[index][2], prompt, GREEDY.max_tokens)
    assert len({tuple(o.outputs[0].token_ids) for o in mixed[:5]}) == 5, "adapters should change the outputs"
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


class ReplayingRunner:
    """A graph runner that "replays" by running the step again with the state its capture saw: the
    adapted layers then read the graphs' fixed mapping region, or (a capture without the adapters)
    no mapping, as a captured graph's kernels would. Where a platform can capture the adapters' ops."""

    max_batch_size = None

    def __init__(self, states: list) -> None:
        self.states = states  # the engine's LoRAState, once built

    def capture(self, fn):
        state = self.states[-1]
        adapters = state.capture_adapters
        fn()

        def replay():
            saved = state.capturing, state.capture_adapters
            state.capturing, state.capture_adapters = True, adapters
            try:
                return fn()
            finally:
                state.capturing, state.capture_adapters = saved

        return replay


def test_steps_without_adapters_replay_graphs_captured_without_them(base, adapters, monkeypatch):
    """Where the adapters' ops are captured, the decode graphs come twice: with them (steps where a
    row has an adapter) and without (steps where none has: the plain model's kernels only). Tokens
    equal the eager engine's for a batch mixing adapters and the base, and for the base alone."""
    from podium.lora.layers import LoRAState
    from podium_cpu.platform import CpuPlatform

    states, init = [], LoRAState.__init__

    def record(self, *args, **kwargs):
        init(self, *args, **kwargs)
        states.append(self)

    monkeypatch.setattr(LoRAState, "__init__", record)
    monkeypatch.setattr(CpuPlatform, "graph_runner", lambda self: ReplayingRunner(states))
    eager = LLM(str(base), **{**ENGINE, "max_loras": 2})
    graphed = LLM(str(base), **{**ENGINE, "max_loras": 2, "enforce_eager": False})
    runner = graphed.engine.runner
    assert runner.lora.graphs_have_adapters and runner.base_graphs is not None
    assert sorted(runner.base_graphs.captured) == sorted(runner.graphs)
    replays = {"adapters": 0, "base": 0}
    for name, graphs in (("adapters", runner.decode_graphs), ("base", runner.base_graphs)):
        def counted(*args, replay=graphs.replay, name=name):
            replays[name] += 1
            return replay(*args)

        monkeypatch.setattr(graphs, "replay", counted)
    ps = prompts(6, seed=5)
    requests = [lora(adapters, i % 2) if i % 3 else None for i in range(6)]
    for batch in (requests, [None] * 6):
        want = eager.generate(tokens_prompts(ps), GREEDY, lora_request=batch, use_tqdm=False)
        before = dict(replays)
        got = graphed.generate(tokens_prompts(ps), GREEDY, lora_request=batch, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        if batch[1] is None:  # the base alone: only the graphs without the adapters replay
            assert replays["adapters"] == before["adapters"] and replays["base"] > before["base"]
        else:
            assert replays["adapters"] > before["adapters"]


def test_more_adapters_than_slots_wait_for_one(base, adapters):
    """max_loras=2 with four adapters in one call: no step holds more than two adapters, requests
    wait for a slot (admission stops), and every output equals its request alone."""
    llm = LLM(str(base), **{**ENGINE, "max_loras": 2})
    engine = llm.engine
    seen: list[set] = []
    blocked = []  # steps after which the next waiting request's adapter had no slot and could get none

    def record(plan) -> None:
        seen.append({s.seq.lora.name for s in plan.scheduled if s.seq.lora})
        slots, waiting = engine.scheduler.lora_slots, engine.scheduler.waiting()
        held = {slots.holder(i).name for i in range(2) if slots.users(i)}
        blocked.append(bool(waiting) and len(held) == 2 and waiting[0].lora.name not in held)

    engine.fault_injector = record
    ps = prompts(8, seed=5)
    which = [0, 1, 2, 3, 3, 2, 1, 0]
    mixed = llm.generate(tokens_prompts(ps), GREEDY, lora_request=[lora(adapters, i) for i in which], use_tqdm=False)
    assert max(len(s) for s in seen) == 2 and len(set().union(*seen)) == 4
    assert any(blocked), "no request ever waited for a slot"
    for prompt, index, out in zip(ps, which, mixed):
        assert out.outputs[0].token_ids == peft_greedy(adapters[index][2], prompt, GREEDY.max_tokens)
    slots = engine.scheduler.lora_slots
    assert slots.num_users == 0 and all(slots.users(s) == 0 for s in range(2))


def test_adapters_dropped_from_the_host_cache_are_read_again_from_their_folders(base, adapters, monkeypatch):
    """max_loras=1, max_cpu_loras=2, three adapters used in turn, then the first two again: the host
    cache holds the two most recent, so each later use reads its folder again (the LRU's order, counted
    at ``read_adapter``), and every output still equals PEFT's."""
    import podium.lora.step as step

    reads = []
    read_adapter = step.read_adapter
    monkeypatch.setattr(step, "read_adapter", lambda path: reads.append(str(path)) or read_adapter(path))
    llm = LLM(str(base), **{**ENGINE, "max_loras": 1, "max_cpu_loras": 2})
    cache = llm.engine.shard.lora.cache
    prompt = prompts(1, seed=13)[0]
    order = [0, 1, 2, 0, 1, 1]
    held = []
    for index in order:
        out = llm.generate(tokens_prompts([prompt]), GREEDY, lora_request=lora(adapters, index), use_tqdm=False)
        assert out[0].outputs[0].token_ids == peft_greedy(adapters[index][2], prompt, GREEDY.max_tokens), \
            f"adapter {index} after {len(held)} uses"
        held.append(sorted(ref.lora_int_id for ref in llm.engine.lora_adapters() if ref.key in cache))
    folders = [str(adapters[i][1]) for i in range(3)]
    # registration reads each folder once; then adapter 0 (dropped when 2 came) and 1 (dropped when
    # 0 came back) are read again; the last use of 1 finds it held
    assert reads == [folders[0], folders[1], folders[2], folders[0], folders[1]]
    assert held == [[1], [1, 2], [2, 3], [1, 3], [1, 2], [1, 2]]


def test_prefix_cache_hits_never_cross_adapters(base, adapters):
    """One 16-token prompt (four full blocks) under adapter 0, adapter 1, the base model, then
    adapter 0 again: only the last finds cached blocks (12 tokens: its last token is computed)."""
    llm = LLM(str(base), **{**ENGINE, "max_loras": 2})
    manager = llm.engine.block_manager
    prompt = prompts(1, seed=11)[0][:3] * 6
    prompt = prompt[:16]
    hits = []
    outputs = []
    for request in (lora(adapters, 0), lora(adapters, 1), None, lora(adapters, 0)):
        before = manager.prefix_cache_hits
        outputs.append(llm.generate(tokens_prompts([prompt]), GREEDY, lora_request=request,
                                    use_tqdm=False)[0].outputs[0].token_ids)
        hits.append(manager.prefix_cache_hits - before)
    assert hits == [0, 0, 0, 12]
    assert outputs[3] == outputs[0] == peft_greedy(adapters[0][2], prompt, GREEDY.max_tokens)
    assert outputs[1] == peft_greedy(adapters[1][2], prompt, GREEDY.max_tokens)


def test_load_and_unload_at_run_time(base, adapters):
    """add_lora / list_loras / remove_lora (vLLM's), by name through the engine, an unknown name is a
    clear error naming it, and a name reused for another adapter gets neither its slot nor its blocks."""
    llm = LLM(str(base), **{**ENGINE, "max_loras": 1})
    engine = llm.llm_engine
    prompt = prompts(1, seed=2)[0] * 2
    assert engine.add_lora(lora(adapters, 0)) and engine.list_loras() == {1}
    first = llm.generate(tokens_prompts([prompt]), GREEDY, lora_request=lora(adapters, 0), use_tqdm=False)
    assert first[0].outputs[0].token_ids == peft_greedy(adapters[0][2], prompt, GREEDY.max_tokens)
    assert engine.remove_lora(1) and engine.list_loras() == set() and not engine.remove_lora(1)
    with pytest.raises(AdapterNotFound, match="The LoRA adapter 'all' is not loaded"):
        engine.add_request("x", prompt, GREEDY, lora_request="all")
    engine.load_lora("all", str(adapters[3][1]))  # the name again, another adapter's folder
    before = engine.block_manager.prefix_cache_hits
    again = llm.generate(tokens_prompts([prompt]), GREEDY, lora_request=engine.loras.find("all").name, use_tqdm=False)
    assert engine.block_manager.prefix_cache_hits == before, "a reused name found the old adapter's blocks"
    assert again[0].outputs[0].token_ids == peft_greedy(adapters[3][2], prompt, GREEDY.max_tokens)
    engine.unload_lora("all")
    with pytest.raises(AdapterNotFound, match="'all'"):
        engine.unload_lora("all")


def test_refusals_name_the_problem(base, tmp_path, adapters):
    llm = LLM(str(base), **{**ENGINE, "max_lora_rank": 4})
    make_adapter(base, tmp_path / "r16", seed=1, rank=16)
    with pytest.raises(InvalidParameter, match=r"has rank 16, above this engine's max_lora_rank of 4.*"
                                                r"--max-lora-rank 16"):
        llm.generate(tokens_prompts(prompts(1)), GREEDY, lora_request=LoRARequest("r16", 1, str(tmp_path / "r16")))
    assert llm.engine.list_loras() == set()
    with pytest.raises(InvalidParameter, match="already adapter 'qv'"):
        llm.llm_engine.add_lora(lora(adapters, 1))  # rank 4: fits
        llm.llm_engine.add_lora(LoRARequest("other", 2, str(adapters[1][1])))
    with pytest.raises(InvalidParameter, match="no adapter_config.json"):
        llm.llm_engine.add_lora(LoRARequest("missing", 5, str(tmp_path / "nowhere")))
    plain = LLM(str(base), **{**ENGINE, "enable_lora": False})
    with pytest.raises(InvalidParameter, match="start it with enable_lora=True"):
        plain.generate(tokens_prompts(prompts(1)), GREEDY, lora_request=lora(adapters, 0))


def test_unservable_adapters_are_refused(base, tmp_path):
    """DoRA, a trained bias and an embedding target: each refused naming the setting or module."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    llm = LLM(str(base), **ENGINE)
    cases = {"dora": (LoraConfig(r=4, target_modules=["q_proj"], use_dora=True), "DoRA"),
             "bias": (LoraConfig(r=4, target_modules=["q_proj"], bias="lora_only"), "trained biases"),
             "embed": (LoraConfig(r=4, target_modules=["embed_tokens"]), "embedding adapters")}
    for i, (name, (config, message)) in enumerate(cases.items()):
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), config)
        model.save_pretrained(tmp_path / name)
        with pytest.raises(InvalidParameter, match=message):
            llm.llm_engine.add_lora(LoRARequest(name, i + 1, str(tmp_path / name)))
