"""Constrained decoding: grammars compiled off the loop (backend.py), one matcher per request
(grammar.py), token bitmasks for the sampler, and jump-forward (jump_forward.py)."""
from radixserve.constrained.backend import GrammarBackend, GrammarError
from radixserve.constrained.grammar import RequestGrammar, full_bitmask

__all__ = ["GrammarBackend", "GrammarError", "RequestGrammar", "full_bitmask"]
