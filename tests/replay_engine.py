"""An engine that replays recorded model outputs through the real SmolLM2 tokenizer (server tests).

``ReplayEngine`` answers a request with the script whose key appears in its decoded prompt, one
real token per step and EOS last, its text made by the engine's own incremental detokenizer (so
EOS shows in the text when special tokens are kept, as in the engine); max_tokens and stop strings
end it as the engine would. So the server's parsing and wire formats are tested on exactly
the text a model family would produce, with known expected results. ``params`` records what each
request asked for (the translation of the API's fields is checked through it).
"""

from __future__ import annotations

from scripted_engine import ScriptedEngine

from podium.chat_template import ChatPrompt, render_chat
from podium.detokenizer import IncrementalDetokenizer
from podium.errors import InvalidParameter, check_context
from podium.outputs import CompletionOutput
from podium.sampling_params import SamplingParams


class ReplayEngine(ScriptedEngine):
    def __init__(self, tokenizer, scripts: dict[str, str], default: str = "Hello there.") -> None:
        super().__init__(max_model_len=4096)
        self.tokenizer, self.model_name, self.platform_name = tokenizer, "replay", "replay"
        self.scripts, self.default = scripts, default
        self.params: dict[str, SamplingParams] = {}
        self.prompts: dict[str, str] = {}

    def add_request(self, request_id, prompt, params: SamplingParams, arrival_time=None, priority=0,
                    output_kind="cumulative", tenant=None) -> int:
        if params.structured_outputs is not None:
            raise InvalidParameter("structured_outputs: no grammar backend in the replay engine",
                                   param="structured_outputs")
        ids = render_chat(self.tokenizer, prompt, self.model_name) if isinstance(prompt, ChatPrompt) else list(prompt)
        check_context(self.max_model_len, len(ids), params.max_tokens)
        text = self.tokenizer.decode(ids)
        script = next((s for key, s in self.scripts.items() if key in text), self.default)
        self.params[request_id], self.prompts[request_id] = params, text
        self.requests[request_id] = {
            "ids": ids, "params": params, "blocks": 0, "script": [*self.tokenizer.encode(script, add_special_tokens=False), self.tokenizer.eos_token_id],
            "detok": IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens),
            "outs": [CompletionOutput(0, "", [])], "tenant": tenant, "kind": output_kind, "sent": [[0, 0, False]]}
        return len(ids)

    def _advance(self, req: dict, out: CompletionOutput, p: SamplingParams) -> None:
        script = req["script"]
        token = script[len(out.token_ids)]
        out.token_ids.append(token)
        out.text += req["detok"].append_token(token)
        for s in p.stop:
            if s in out.text:
                out.text, out.finish_reason, out.stop_reason = out.text[: out.text.index(s)], "stop", s
                return
        if len(out.token_ids) == len(script):
            out.finish_reason, out.stop_reason = "stop", None  # EOS, as the engine reports it
        elif p.max_tokens is not None and len(out.token_ids) >= p.max_tokens:
            out.finish_reason = "length"


def replay_with_smollm2_tokenizer(scripts: dict[str, str]) -> ReplayEngine:
    """A factory for an engine process: the tokenizer is loaded there."""
    from podium.loader import embedded_gguf_path, gguf_source

    return ReplayEngine(gguf_source.convert_gguf_tokenizer(embedded_gguf_path()), scripts)
