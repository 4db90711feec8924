"""Model loading: resolve a model argument to a config, tokenizer and weight stream."""

from .resolve import EMBEDDED_DEFAULT, embedded_gguf_path, resolve_model, resolve_tokenizer
from .source import DTYPES, ModelSource, resolve_dtype, sampling_defaults

__all__ = ["DTYPES", "EMBEDDED_DEFAULT", "ModelSource", "embedded_gguf_path", "resolve_dtype", "resolve_model",
           "resolve_tokenizer", "sampling_defaults"]
