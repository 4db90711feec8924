"""Structured output: constrain a sequence's tokens to a grammar (JSON schema, regex, choice, EBNF).

    backend.py            the interface (``GrammarBackend``, ``Matcher``) and the canonical ``GrammarSpec``
    xgrammar_backend.py   the default backend
    llguidance_backend.py the second backend
    service.py            compilation off the step path, cached by (backend, spec) per tokenizer
    bitmask.py            the sampler's batched mask: matchers fill host rows, one copy, one masked fill
    reasoning_gate.py     a thinking model's grammar starts after its reasoning section

The engine takes a constrained request through ``GrammarService.request`` (validation now, a
compile future), keeps it out of the scheduler until the grammar is compiled, and hands the
compiled grammar to the sampler through ``Sequence.grammar``; the sampler keeps one matcher per
sequence, advanced with the sequence's output tokens before each mask.
"""

from .backend import GrammarBackend, GrammarSpec, Matcher
from .bitmask import GrammarMasks, PendingTokens
from .service import BACKENDS, CompiledGrammar, GrammarService

__all__ = ["BACKENDS", "CompiledGrammar", "GrammarBackend", "GrammarMasks", "GrammarService", "GrammarSpec",
           "Matcher", "PendingTokens"]
