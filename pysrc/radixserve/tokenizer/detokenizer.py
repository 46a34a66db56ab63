"""Incremental detokenization with stop strings, one instance per request.

Text is produced by decoding a short window of ids: decode(ids[prefix_offset:]) minus
decode(ids[prefix_offset:read_offset]). The window starts at least one token back so that
decoders which depend on neighbours (sentencepiece's leading-space rule, byte-level BPE) see
them. While the window's text ends in U+FFFD (a UTF-8 character cut between tokens) nothing is
released. The window's start stays put until it is more than WINDOW tokens behind, so the
prefix's text is the previous push's full text, kept rather than decoded again: about one
decode a token instead of two (the loop thread pays this for every token it streams).
A tokenizer that offers byte_level_pieces() (tokenizer/byte_level.py: byte-level BPE, checked
to decode exactly as the table says) needs no window: each token's bytes go to an incremental
UTF-8 decoder, which holds a cut character back until its last byte comes (flush() releases it
as U+FFFD). A jump-forward (replace_tail) moves such a request to the window decoder.

Stop strings: released text is scanned for every stop string; the longest suffix of the
unreleased text that is a prefix of some stop string is held back, so a stop string spanning
token boundaries is still found before any part of it is emitted. On a match, the text up to
the start of the stop string is emitted (up to its end with no_stop_trim) and nothing after.
Stop regexes (stop_regex) are searched in the unreleased text plus the last REGEX_LOOKBACK
characters already released (so a match may span a release); a match that started in released
text cuts at the start of the unreleased part. Nothing is held back for a regex.
Concatenating every text_delta and the final flush() gives the full decode of the pushed ids
(cut at the stop string when one matched).
"""
from __future__ import annotations

import codecs
import re
from typing import List, NamedTuple, Optional, Sequence

REPLACEMENT_CHAR = "\ufffd"
REGEX_LOOKBACK = 256
WINDOW = 8       # ids behind the end at which the decode window's start moves up


class DetokenizeResult(NamedTuple):
    text_delta: str                 # new text to stream (may be empty)
    stop_matched: Optional[str]     # the stop string that ended the output, else None


class IncrementalDetokenizer:
    """push(new_ids) per step, flush() at the end. Not thread-safe (one request, one owner).

    tokenizer: anything with decode(ids, skip_special_tokens, spaces_between_special_tokens).
    After a stop string matched, push() returns empty results and flush() returns "".
    """

    def __init__(self, tokenizer, stop_strs: Optional[Sequence[str]] = (), no_stop_trim: bool = False,
                 skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True,
                 stop_regexes: Optional[Sequence[str]] = ()):
        self._tokenizer = tokenizer
        self._stops: List[str] = [s for s in (stop_strs or ()) if s]
        self._regexes = [re.compile(r) for r in (stop_regexes or ()) if r]
        self._released_tail = ""    # the last REGEX_LOOKBACK released characters
        self._no_stop_trim = no_stop_trim
        self._skip_special = skip_special_tokens
        self._spaces_between_special = spaces_between_special_tokens
        self._ids: List[int] = []
        self._prefix_offset = 0     # window start for decoding
        self._read_offset = 0       # ids before this are already turned into text
        self._prefix_text: Optional[str] = ""   # decode(ids[prefix:read]) when known, else None
        self._pending = ""          # decoded text not yet emitted (held for stop matching)
        self.stop_matched: Optional[str] = None
        self.finished = False
        # the byte path (module docstring): the token bytes table, the ids it skips, and the
        # incremental UTF-8 decoder; None: the window decoder
        pieces = getattr(tokenizer, "byte_level_pieces", None)
        pieces = pieces() if pieces is not None else None
        self._table = pieces.table if pieces is not None else None
        self._skip_ids = pieces.special if pieces is not None and skip_special_tokens else ()
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace") if pieces is not None \
            else None

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special,
                                      spaces_between_special_tokens=self._spaces_between_special)

    def _decode_new(self, final: bool) -> str:
        """Text of the ids past read_offset; "" while it would end in a cut character
        (unless final, when whatever is there is released)."""
        prefix_text = self._prefix_text
        if prefix_text is None:
            prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
            self._prefix_text = prefix_text
        full_text = self._decode(self._ids[self._prefix_offset:])
        if not final and (full_text.endswith(REPLACEMENT_CHAR) or len(full_text) <= len(prefix_text)):
            return ""
        # (where the decoder rewrote the window's start, rare, the difference is the best delta)
        new_text = full_text[len(prefix_text):]
        if len(self._ids) - self._prefix_offset > WINDOW:
            self._prefix_offset = self._read_offset        # its text is not known: decoded next time
            self._prefix_text = None
        else:
            self._prefix_text = full_text                  # the next prefix is this window
        self._read_offset = len(self._ids)
        return new_text

    def _earliest_stop(self, text: str):
        """(start, end, stop) of the stop string that completes first in text, else None.
        Ties on the end position go to the one starting first (the longer)."""
        best = None
        for stop in self._stops:
            start = text.find(stop)
            if start < 0:
                continue
            key = (start + len(stop), start)
            if best is None or key < (best[1], best[0]):
                best = (start, start + len(stop), stop)
        return best

    def _held_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def _earliest_regex(self, text: str):
        """(start, end, pattern) of the regex match that ends first in released tail + text,
        positions relative to text (start clamped to 0), else None."""
        if not self._regexes:
            return None
        lookback = self._released_tail
        hay = lookback + text
        best = None
        for rx in self._regexes:
            m = rx.search(hay)
            if m is None or m.end() <= len(lookback):
                continue
            start, end = max(m.start() - len(lookback), 0), m.end() - len(lookback)
            if best is None or (end, start) < (best[1], best[0]):
                best = (start, end, rx.pattern)
        return best

    def _release(self, new_text: str, final: bool) -> DetokenizeResult:
        self._pending += new_text
        match = self._earliest_stop(self._pending)
        rmatch = self._earliest_regex(self._pending)
        if rmatch is not None and (match is None or rmatch[1] < match[1]):
            match = rmatch
        if match is not None:
            start, end, stop = match
            delta = self._pending[:end if self._no_stop_trim else start]
            self._pending = ""
            self.stop_matched = stop
            self.finished = True
            return DetokenizeResult(delta, stop)
        hold = 0 if final else self._held_suffix_len(self._pending)
        cut = len(self._pending) - hold
        delta, self._pending = self._pending[:cut], self._pending[cut:]
        if self._regexes:
            self._released_tail = (self._released_tail + delta)[-REGEX_LOOKBACK:]
        return DetokenizeResult(delta, None)

    def push(self, new_ids: Sequence[int]) -> DetokenizeResult:
        """Add the step's new token ids; return the text that can be streamed now."""
        if self.finished:
            return DetokenizeResult("", self.stop_matched)
        new = [int(i) for i in new_ids]
        self._ids += new
        if self._utf8 is not None:
            skip = self._skip_ids
            if len(new) == 1:                      # a decode step's one token
                data = b"" if new[0] in skip else self._table[new[0]]
            else:
                data = b"".join(self._table[i] for i in new if i not in skip)
            return self._release(self._utf8.decode(data), final=False)
        return self._release(self._decode_new(final=False), final=False)

    @property
    def caught_up(self) -> bool:
        """Every pushed id is turned into text (none held back inside a cut character)."""
        if self.finished:
            return False
        if self._utf8 is not None:
            return not self._utf8.getstate()[0]       # no bytes of a cut character held
        return self._read_offset == len(self._ids)

    def replace_tail(self, num_removed: int, new_ids: Sequence[int]) -> DetokenizeResult:
        """Jump-forward: the last num_removed ids become new_ids, whose text extends the old
        text (the caller checked decode(new output) == decode(old output) + appended text).
        Only the appended text is new; it goes through the stop-string check like any push.
        Requires caught_up."""
        if self.finished:
            return DetokenizeResult("", self.stop_matched)
        if self._utf8 is not None:      # to the window decoder, everything so far turned to text
            self._utf8 = None
            self._prefix_offset = self._read_offset = len(self._ids)
            self._prefix_text = ""
        keep = len(self._ids) - num_removed
        old_text = self._decode(self._ids[min(self._prefix_offset, keep):])
        self._ids = self._ids[:keep] + [int(i) for i in new_ids]
        self._prefix_offset = min(self._prefix_offset, keep)
        new_text = self._decode(self._ids[self._prefix_offset:])
        appended = new_text[len(old_text):] if new_text.startswith(old_text) else ""
        self._prefix_offset = max(keep, self._prefix_offset)
        self._read_offset = len(self._ids)
        self._prefix_text = None
        return self._release(appended, final=False)

    def flush(self) -> str:
        """End of output: the held-back text (a cut character decodes as U+FFFD, a partial stop
        string is released as text). "" after a stop string matched. If the released text
        completes a stop string, the text is cut there and self.stop_matched is set."""
        if self.finished:
            return ""
        tail = self._utf8.decode(b"", final=True) if self._utf8 is not None \
            else self._decode_new(final=True)
        result = self._release(tail, final=True)
        self.finished = True
        return result.text_delta

    @property
    def output_ids(self) -> List[int]:
        return list(self._ids)
