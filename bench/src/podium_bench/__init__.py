"""``podium bench``: reproducible performance measurements with a reference in the same run.

- ``datasets``: the workloads (random, sharegpt-like, prefix-repetition, a JSON/JSONL file),
  deterministic from a seed, as :class:`BenchRequest` lists.
- ``metrics``: the arithmetic (throughput, TTFT/TPOT/ITL/E2E, percentiles), pure functions.
- ``podium_backend`` / ``hf_backend``: run a request list through Podium's ``LLM`` or through
  transformers ``generate``; ``backends`` builds both on the same model, dtype and device;
  ``throughput`` and ``latency`` time them.
- ``serve`` / ``serve_client``: a streaming HTTP client for any OpenAI-compatible server;
  ``tokenizers`` gives it a model's token space without building an engine.
- ``report``: the machine description and the JSON/table output.

Metric definitions follow vLLM's ``vllm bench`` so numbers can be compared across engines.
"""
