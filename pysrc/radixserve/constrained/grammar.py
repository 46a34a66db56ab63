"""RequestGrammar: one request's grammar matcher, and the batch bitmask the sampler applies.

A RequestGrammar advances with every token the request outputs (accept), fills its row of the
next step's token bitmask (fill), offers a jump-forward string, and rolls back for the seam
re-tokenization of a jump. It is owned by its Req and used on the event-loop thread only.
The bitmask layout is the sampler's (ops.bitmask_sample): [rows, ceil(vocab / 32)] int32, bit
t % 32 of word t // 32 set = token t allowed. Rows without a grammar are all ones.
"""
from __future__ import annotations

from typing import Sequence

import torch


class RequestGrammar:
    def __init__(self, matcher):
        self._m = matcher
        self.num_accepted = 0

    def accept(self, token: int) -> bool:
        """Advance on token; False (state unchanged) when the grammar does not allow it."""
        ok = bool(self._m.accept_token(int(token)))
        if ok:
            self.num_accepted += 1
        return ok

    def accept_all(self, tokens: Sequence[int]) -> bool:
        """Accept every token, or none (rolled back on the first refusal)."""
        done = 0
        for t in tokens:
            if not self.accept(t):
                self.rollback(done)
                return False
            done += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self._m.rollback(num_tokens)
            self.num_accepted -= num_tokens

    @property
    def terminated(self) -> bool:
        """It accepted a stop token: the output is complete."""
        return bool(self._m.is_terminated())

    def jump_forward_string(self) -> str:
        """The longest text the grammar forces from here ("" when the model has a choice)."""
        if self._m.is_terminated():
            return ""
        return self._m.find_jump_forward_string()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """bitmask[row] <- the tokens allowed next (bitmask: CPU int32)."""
        self._m.fill_next_token_bitmask(bitmask, row)

    def fork(self) -> "RequestGrammar":
        """An independent copy in the same state (n > 1 samples of one request)."""
        g = RequestGrammar(self._m.fork())
        g.num_accepted = self.num_accepted
        return g


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def full_bitmask(rows: int, vocab_size: int, pin_memory: bool = False) -> torch.Tensor:
    """[rows, ceil(vocab / 32)] int32 CPU bitmask with every token allowed; RequestGrammar.fill
    then narrows the rows that have a grammar."""
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32,
                      pin_memory=pin_memory)
