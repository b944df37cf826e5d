"""Prompt lookup (vLLM's "ngram" method): the sequence's last n tokens are looked up in its own
earlier tokens, prompt and output, and what followed their latest earlier occurrence is the
draft. Strong where the output copies its context (edits, quotes, code, agent loops); it costs no
model, only a search per step.

Each sequence's tokens are mirrored as a growing byte string of 4-byte ids, so a lookup is one
C-speed `rfind` over it (a hit at an offset inside an id is skipped), and a step appends only the
tokens the sequence gained.
"""
from __future__ import annotations

from array import array

_ID = array("i").itemsize


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, lookup_min: int, lookup_max: int):
        self.k = num_speculative_tokens
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max
        self._texts: dict[int, bytearray] = {}  # seq_id -> its tokens, as bytes

    def release(self, seq_id: int, token_ids: list[int] = (), num_prompt_tokens: int = 0) -> None:
        self._texts.pop(seq_id, None)

    def propose(self, seq_id: int, token_ids: list[int], max_drafts: int,
                num_prompt_tokens: int = 0) -> list[int]:
        """Up to min(k, max_drafts) tokens that followed the latest earlier occurrence of the
        longest suffix of token_ids (lookup_max down to lookup_min tokens); [] when none."""
        text = self._texts.get(seq_id)
        num_known = len(text) // _ID if text is not None else 0
        if text is None or num_known > len(token_ids):  # new, or shortened (never, but cheap)
            text = self._texts[seq_id] = bytearray(array("i", token_ids).tobytes())
        elif num_known < len(token_ids):
            text += array("i", token_ids[num_known:]).tobytes()
        num = len(token_ids)
        max_drafts = min(self.k, max_drafts)
        if max_drafts <= 0:
            return []
        # The occurrence must end before the last token, so that a token follows it.
        end = (num - 1) * _ID
        for n in range(min(self.lookup_max, num - 1), self.lookup_min - 1, -1):
            pattern = bytes(text[(num - n) * _ID:])
            stop = end
            while True:
                at = text.rfind(pattern, 0, stop)
                if at < 0:
                    break
                if at % _ID == 0:
                    first = at // _ID + n
                    return token_ids[first:first + max_drafts]
                stop = at + len(pattern) - 1  # a hit across ids: look before it
        return []
