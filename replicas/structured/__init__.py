"""Grammar-constrained decoding (llguidance): compile off the engine loop, match per sequence,
mask logits in one reused bitmask buffer."""
from pagedserve.replicas.structured.compiler import GrammarCompiler
from pagedserve.replicas.structured.matcher import GrammarMatcher, attach_grammar, is_constrained

__all__ = ["GrammarCompiler", "GrammarMatcher", "attach_grammar", "is_constrained"]
