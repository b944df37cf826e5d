"""Grammar-constrained decoding (llguidance): compile off the engine loop, match per sequence,
mask logits in one reused bitmask buffer."""
from replicas.structured.compiler import GrammarCompiler
from replicas.structured.matcher import GrammarMatcher
from replicas.structured.pending import PendingGrammars, attach_grammar

__all__ = ["GrammarCompiler", "GrammarMatcher", "PendingGrammars", "attach_grammar"]
