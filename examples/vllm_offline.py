"""A script written for vLLM's offline API, with only the import changed (``vllm`` -> ``podium``).

    python examples/vllm_offline.py [MODEL]

The engine arguments are the ones vLLM scripts commonly pass; Podium accepts them, ignores the
ones that mean nothing here with a warning, and would refuse what it cannot run with the reason
(``tensor_parallel_size=2``, ``trust_remote_code=True``, ...). ``tests/test_vllm_script.py`` runs it.
"""

import sys

from podium import LLM, SamplingParams
from podium.inputs import TextPrompt, TokensPrompt


def main(model: str = "smollm2-135m-instruct") -> dict:
    llm = LLM(
        model=model,
        tokenizer=None,
        tokenizer_mode="auto",
        trust_remote_code=False,
        revision=None,
        dtype="auto",
        quantization=None,
        seed=0,
        max_model_len=512,
        gpu_memory_utilization=0.9,
        swap_space=4,
        enforce_eager=True,
        max_seq_len_to_capture=8192,
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_seqs=8,
        max_num_batched_tokens=2048,
        disable_log_stats=True,
        generation_config="auto",
        scheduling_policy="priority",
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    tokenizer = llm.get_tokenizer()
    question = "The capital of France is"
    outputs = llm.generate(
        [question, TextPrompt(prompt=question), TokensPrompt(prompt_token_ids=tokenizer.encode(question))],
        greedy, use_tqdm=False, priority=[1, 0, 2])
    texts = [o.outputs[0].text for o in outputs]
    chat = llm.chat([{"role": "user", "content": "Name a primary color."}], greedy, use_tqdm=False,
                    chat_template_kwargs={"enable_thinking": False})
    conversations = llm.chat([[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Bye"}]], greedy,
                             use_tqdm=False)
    for text in texts:
        print(f"generate: {question!r} -> {text!r}")
    print(f"chat: {chat[0].outputs[0].text!r}")
    return {"generate": texts, "chat": chat[0].outputs[0].text, "conversations": len(conversations)}


if __name__ == "__main__":
    main(*sys.argv[1:])
