"""The token bitmask: one buffer for the whole batch, allocated once, reused every step.

llguidance writes each constrained row's allowed tokens as bits (one int32 word per 32 tokens)
in parallel threads without the GIL; the bits are unpacked into a "disallowed" byte buffer,
also allocated once, and the logits of those rows are set to -inf in place. Unconstrained rows
are never touched. (vLLM once allocated its bitmask per step and lost half its decode speed.)
"""
from __future__ import annotations

import llguidance
import numpy as np
import torch

# Byte value -> its 8 bits as "disallowed" flags, token 8b+i at bit i (little-endian words).
_DISALLOWED = np.array([[not (byte >> i) & 1 for i in range(8)] for byte in range(256)],
                       dtype=np.uint8)


class TokenBitmask:
    def __init__(self, max_num_seqs: int, vocab_size: int, device: torch.device,
                 unpack_with_torch: bool | None = None):
        """unpack_with_torch: unpack with torch ops on `device` (default: off the CPU only)."""
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        self.device = device
        self.host = torch.full((max_num_seqs, self.num_words), -1, dtype=torch.int32)
        self._executor = llguidance.LLExecutor()
        self._numpy = device.type == "cpu" if unpack_with_torch is None else not unpack_with_torch
        if self._numpy:
            # Unpacked by a table lookup in numpy (several times faster than torch's bit ops).
            self._unpacked = np.empty((max_num_seqs, self.num_words * 4, 8), dtype=np.uint8)
            self._disallowed = torch.from_numpy(self._unpacked).view(torch.bool).view(
                max_num_seqs, -1)
        else:
            self._bits = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=device)
            self._unpacked_dev = torch.empty((max_num_seqs, self.num_words * 4, 8),
                                             dtype=torch.uint8, device=device)
            self._disallowed = torch.empty((max_num_seqs, self.num_words * 32), dtype=torch.bool,
                                           device=device)

    @property
    def max_rows(self) -> int:
        return self.host.shape[0]

    def apply(self, logits: torch.Tensor, rows: list[int], matchers: list,
              also_allowed: list[int | None] | None = None) -> None:
        """Mask logits[rows[j]] with matchers[j]'s allowed tokens, in place; also_allowed[j], a
        token row j may take besides (None: none)."""
        for start in range(0, len(rows), self.max_rows):
            end = start + self.max_rows
            self._apply(logits, rows[start:end], matchers[start:end],
                        also_allowed[start:end] if also_allowed else None)

    def _apply(self, logits: torch.Tensor, rows: list[int], matchers: list,
               also_allowed: list[int | None] | None) -> None:
        n, vocab = len(rows), logits.shape[1]
        host = self.host[:n]
        # llguidance.torch's helper does the same, but importing it compiles with torch.compile.
        self._executor.unsafe_compute_mask_ptr([(m, j) for j, m in enumerate(matchers)],
                                               host.data_ptr(), self.num_words * 4, n)
        if also_allowed:
            words = host.numpy().view(np.uint32)
            for j, token in enumerate(also_allowed):
                if token is not None:
                    words[j, token >> 5] |= np.uint32(1 << (token & 31))
        if self._numpy:
            np.take(_DISALLOWED, host.numpy().view(np.uint8), axis=0, out=self._unpacked[:n])
        else:
            words = host.to(self.device, non_blocking=True)
            unpacked = self._unpacked_dev[:n]
            torch.bitwise_and(words.view(torch.uint8)[:, :, None], self._bits, out=unpacked)
            torch.eq(unpacked.view(n, -1), 0, out=self._disallowed[:n])
        disallowed = self._disallowed[:n, :vocab]
        if n == logits.shape[0]:
            logits.masked_fill_(disallowed, float("-inf"))
        else:  # row by row: views of logits, no gather and scatter of the whole rows
            for j, row in enumerate(rows):
                logits[row].masked_fill_(disallowed[j], float("-inf"))
