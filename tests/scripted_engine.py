"""A scripted stand-in for ``LLMEngine`` (the server's tests): fast, no model, every output known.

``ScriptedEngine`` has ``LLMEngine``'s public interface and a rule a bug would break: the k-th
token of a request is ``(sum(prompt) + 7 * sample_index + k) % 26``, shown as one letter. So every
stream's expected text is known exactly, whatever else runs. Blocks are accounted like the real
block manager's (a block per 4 tokens, freed on finish and abort), so leaks show in ``/metrics``.
Like the engine it renders a ``ChatPrompt``, raises ``podium.errors``' typed refusals, reports
``output_kind="delta"`` (what the server asks for) and holds back text a stop string could cut.

It lives in a module of its own (not a test module) so an engine process can import it: the
server's tests run it on a thread and in a child process. ``Knobs`` are the settings a test turns
while it runs (step time, a crash), in shared memory so a child process sees them too.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import dataclass

from podium.chat_template import ChatPrompt, render_chat
from podium.config import EngineConfig
from podium.errors import InvalidParameter, check_context
from podium.outputs import CompletionOutput, Logprob, RequestOutput
from podium.sampling_params import SamplingParams
from podium.stop import safe_text_len

LETTERS = "abcdefghijklmnopqrstuvwxyz"
BLOCK = 4


class LetterTokenizer:
    """One token per lowercase letter; ids 0..25; 26 is EOS. Its chat template: each message's role
    initial and content, then "a"."""

    chat_template = "letters"
    eos_token_id = 26

    def __len__(self) -> int:
        return 27

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [LETTERS.index(ch) for ch in text.lower() if ch in LETTERS]

    def decode(self, ids: list[int], **_) -> str:
        return "".join(LETTERS[i] for i in ids if i < 26)

    def convert_ids_to_tokens(self, ids):
        return [self.decode([i]) for i in ids] if isinstance(ids, list) else self.decode([ids])

    def get_vocab(self) -> dict[str, int]:
        return {ch: i for i, ch in enumerate(LETTERS)}

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, **template_kwargs) -> list[int]:
        if any(not isinstance(m.get("content"), str) for m in messages):
            raise TypeError("the letters template takes text content only")
        return self.encode("".join(m["role"][0] + m["content"] for m in messages) + "a")


class Knobs:
    """Step time and a crash switch, shared with an engine in a child process (pass it at spawn)."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self._step_seconds = ctx.RawValue("d", 0.002)
        self._crash = ctx.RawValue("b", 0)

    @property
    def step_seconds(self) -> float:
        return self._step_seconds.value

    @step_seconds.setter
    def step_seconds(self, value: float) -> None:
        self._step_seconds.value = value

    @property
    def crash_on_step(self) -> bool:
        return bool(self._crash.value)

    @crash_on_step.setter
    def crash_on_step(self, value: bool) -> None:
        self._crash.value = int(value)


@dataclass
class Stats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage: float
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0


def expected(prompt_ids: list[int], index: int, k: int) -> str:
    return "".join(LETTERS[(sum(prompt_ids) + 7 * index + j) % 26] for j in range(k))


FAULT_SEED = 666  # a request with this seed fails after two tokens, as the engine reports a step fault


class ScriptedEngine:
    def __init__(self, knobs: Knobs | None = None, num_blocks: int = 4096, max_model_len: int = 64) -> None:
        self.knobs = knobs or Knobs()
        self.tokenizer = LetterTokenizer()
        self.model_name, self.max_model_len, self.platform_name = "letters", max_model_len, "scripted"
        self.config = EngineConfig(model="letters")
        self.kv_capacity_tokens = num_blocks * BLOCK
        self.num_blocks, self.free_blocks = num_blocks, num_blocks
        self.requests: dict[str, dict] = {}
        self.tenants: dict[str, object] = {}  # request id -> the tenant it came with (None: default)

    def add_request(self, request_id, prompt, params: SamplingParams, arrival_time=None, priority=0,
                    output_kind="cumulative", tenant=None) -> int:
        if isinstance(prompt, ChatPrompt):
            ids = render_chat(self.tokenizer, prompt, self.model_name)
        else:
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise InvalidParameter("the prompt is empty; give at least one token", param="prompt")
        if any(not 0 <= t < 27 for t in ids):
            raise InvalidParameter("prompt token ids must be in [0, 27)", param="prompt")
        check_context(self.max_model_len, len(ids), params.max_tokens)
        outs = [CompletionOutput(i, "", [], logprobs=[] if params.logprobs is not None else None)
                for i in range(params.n)]
        blocks = params.n * -(-len(ids) // BLOCK)
        self.free_blocks -= blocks
        self.requests[request_id] = {"ids": ids, "params": params, "outs": outs, "blocks": blocks, "tenant": tenant,
                                     "kind": output_kind, "sent": [[0, 0, False] for _ in outs]}
        self.tenants[request_id] = tenant
        return len(ids)

    def abort_request(self, request_id) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            req = self.requests.pop(rid, None)
            if req is not None:
                self.free_blocks += req["blocks"]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        if self.knobs.crash_on_step:
            raise RuntimeError("scripted crash")
        time.sleep(self.knobs.step_seconds)
        outputs = []
        for rid, req in list(self.requests.items()):
            p: SamplingParams = req["params"]
            if p.seed == FAULT_SEED and len(req["outs"][0].token_ids) >= 2:  # the engine failed this request
                outputs.append(RequestOutput(rid, None, req["ids"], [], True, error="scripted fault in this request"))
                self.abort_request(rid)
                continue
            for out in req["outs"]:
                if out.finish_reason is None:
                    self._advance(req, out, p)
            finished = all(o.finish_reason for o in req["outs"])
            report = _deltas(req, p) if req["kind"] == "delta" else _whole(req, p)
            outputs.append(RequestOutput(rid, None, req["ids"], report, finished))
            if finished:
                self.abort_request(rid)
        return outputs

    def _advance(self, req: dict, out: CompletionOutput, p: SamplingParams) -> None:
        token = (sum(req["ids"]) + 7 * out.index + len(out.token_ids)) % 26
        out.token_ids.append(token)
        if out.logprobs is not None:
            entry = {token: Logprob(-0.5, 1, LETTERS[token])}
            for r in range(1, p.logprobs):
                entry[(token + r) % 26] = Logprob(-1.0 - r, r + 1, LETTERS[(token + r) % 26])
            out.logprobs.append(entry)
        out.text += LETTERS[token]
        if (len(req["ids"]) + len(out.token_ids)) % BLOCK == 1:
            req["blocks"] += 1
            self.free_blocks -= 1
        for s in p.stop:
            if s in out.text:
                cut = out.text.index(s) + (len(s) if p.include_stop_str_in_output else 0)
                out.text, out.finish_reason, out.stop_reason = out.text[:cut], "stop", s
                return
        if len(out.token_ids) >= (p.max_tokens or self.max_model_len - len(req["ids"])):
            out.finish_reason = "length"

    def stats(self) -> Stats:
        used = self.num_blocks - self.free_blocks
        return Stats(len(self.requests), 0, self.free_blocks, self.num_blocks, used / self.num_blocks)


def _visible(out: CompletionOutput, p: SamplingParams) -> int:
    """As the engine: unfinished text that a stop string could still cut is held back."""
    return len(out.text) if out.finish_reason or not p.stop else safe_text_len(out.text, p.stop)


def _whole(req: dict, p: SamplingParams) -> list[CompletionOutput]:
    return [CompletionOutput(o.index, o.text[:_visible(o, p)], list(o.token_ids), None,
                             list(o.logprobs) if o.logprobs is not None else None, o.finish_reason, o.stop_reason)
            for o in req["outs"]]


def _deltas(req: dict, p: SamplingParams) -> list[CompletionOutput]:
    """``output_kind="delta"``: per sample, what is new since its last report (nothing: left out)."""
    report = []
    for o, sent in zip(req["outs"], req["sent"]):
        tokens, chars, finish_sent = sent
        if len(o.token_ids) == tokens and (finish_sent or not o.finish_reason):
            continue
        visible = max(_visible(o, p), chars)
        logprobs = o.logprobs[tokens:] if o.logprobs is not None else None
        report.append(CompletionOutput(o.index, o.text[chars:visible], o.token_ids[tokens:], None, logprobs,
                                       o.finish_reason, o.stop_reason))
        sent[:] = [len(o.token_ids), visible, bool(o.finish_reason)]
    return report


def broken_engine() -> ScriptedEngine:
    """An engine factory that fails the way a bad model argument does."""
    raise ValueError("unknown model 'nope'; pass a local folder")
