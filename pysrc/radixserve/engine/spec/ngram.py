"""NgramIndex: n-gram (prompt-lookup) drafts from one request's token history.

Given the history T (prompt + output, len L), a draft is found by taking the last n tokens
T[L-n:], for n from max_window down to min_window, and looking up the most recent earlier
occurrence of those n tokens; the (up to k) tokens that followed that occurrence are the draft.
The longest window with a match wins (a longer match predicts better); among occurrences of
that window the latest wins (recent text repeats most).

The index is incremental: every n-gram (min_window <= n <= max_window) ending at a position
e <= L-1 maps to its latest end e (exclusive). The n-grams ending at L itself (the current
suffix) are not indexed yet, so a lookup of the suffix finds an earlier occurrence, whose
continuation T[e:] has at least one token. sync() indexes what was appended since the last
call (output tokens only ever append for the requests that speculate; a history that shrank or
changed is re-indexed from scratch). Cost: O(max_window - min_window + 1) dict updates per new
token, O(max_window - min_window + 1) lookups per draft.

Pure host code, no torch; the event-loop thread owns each index (one per request: Req.spec).
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple


class NgramIndex:
    def __init__(self, min_window: int, max_window: int):
        if not 1 <= min_window <= max_window:
            raise ValueError(f"n-gram windows must satisfy 1 <= min <= max, got "
                             f"{min_window}, {max_window}")
        self.min_window = min_window
        self.max_window = max_window
        self.tokens: List[int] = []          # the history indexed so far (a copy)
        self.last_end: Dict[Tuple[int, ...], int] = {}
        self._indexed_to = 0                 # n-grams ending at e <= _indexed_to are indexed

    def sync(self, history: Sequence[int]) -> None:
        """Bring the index up to date with history (the request's prompt + output)."""
        n_old = len(self.tokens)
        if len(history) < n_old or (n_old and history[n_old - 1] != self.tokens[-1]):
            self.tokens, self.last_end, self._indexed_to = [], {}, 0   # rolled back: rebuild
            n_old = 0
        self.tokens.extend(history[n_old:])
        toks = self.tokens
        # index every n-gram ending at e for e in (_indexed_to, len - 1]
        for end in range(self._indexed_to + 1, len(toks)):
            for n in range(self.min_window, min(self.max_window, end) + 1):
                self.last_end[tuple(toks[end - n:end])] = end
        self._indexed_to = max(self._indexed_to, len(toks) - 1)

    def propose(self, k: int, extra: Sequence[int] = ()) -> List[int]:
        """Up to k draft tokens following the history given to the last sync() and then extra
        (tokens assumed to follow it, not indexed: a verify step in flight's draft); [] for
        none. The match is looked up among the indexed n-grams (ending in the synced history);
        its continuation runs on into extra where it reaches the history's end."""
        toks, extra = self.tokens, list(extra)
        length, n_extra = len(toks), len(extra)
        total = length + n_extra
        if k <= 0 or total < self.min_window + 1:
            return []
        for n in range(min(self.max_window, total - 1), self.min_window - 1, -1):
            if n <= n_extra:
                key = tuple(extra[n_extra - n:])
            else:
                key = tuple(toks[length - (n - n_extra):]) + tuple(extra)
            end = self.last_end.get(key)
            if end is not None:
                out = toks[end:end + k]
                if len(out) < k:
                    out += extra[:k - len(out)]
                return out
        return []


def propose(history: Sequence[int], k: int, min_window: int, max_window: int) -> List[int]:
    """One-shot draft of history (tests, tools): NgramIndex(...).sync(history); propose(k)."""
    index = NgramIndex(min_window, max_window)
    index.sync(history)
    return index.propose(k)
