"""JSON read incrementally and written back canonically: call arguments streamed as they arrive.

JsonText reads exactly one JSON value from a Cursor, a character at a time across any number
of calls, and returns the value's canonical text as it becomes certain: the text
json.dumps(json.loads(value)) writes (", " and ": " separators, ASCII escapes, numbers as
Python writes them), except that object keys keep the model's order and repeats. Numbers and
true / false / null are held until they end; string characters go out as they come. The
concatenation of its outputs is therefore the same however the text was split, which is what
lets a streamed call's argument deltas add up to its non-streamed arguments. Strings may hold
raw control characters (json.loads(strict=False), as models write them); nesting has no limit
(an explicit stack, no recursion).

CallObject reads one `{"name": NAME, "arguments" | "parameters": ARGS, ...}` call object into a
Sink: "name" must be the first key (a string of at most MAX_NAME_CHARS), which is when the call
opens; the arguments stream through a JsonText; other keys are read and dropped; a missing
arguments key gives {}.
"""
from __future__ import annotations

import json
import re
from typing import Optional

from radixserve.parsers.tool_formats.stream import MAX_NAME_CHARS, Cursor, Sink

_PLAIN = re.compile(r'[ !#-\[\]-~]+')       # printable ASCII but " and \: written as read
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_ESCAPES = {'"': '\\"', "\\": "\\\\", "/": "/", "b": "\\b", "f": "\\f", "n": "\\n", "r": "\\r",
            "t": "\\t"}
_HEX = frozenset("0123456789abcdefABCDEF")
_LITERALS = ("true", "false", "null")
MAX_NUMBER_CHARS = 4096     # longer is refused (Python's int conversion stops at 4300 digits)
_WS = " \t\r\n"

(_VALUE, _OBJ_FIRST, _OBJ_KEY, _COLON, _ARR_FIRST, _AFTER, _STR, _ESC, _UHEX, _NUM, _LIT,
 _DONE, _FAIL) = range(13)


def _canon_char(ch: str) -> str:
    return json.dumps(ch)[1:-1]


class JsonText:
    """One JSON value, read incrementally; see the module docstring. read(cur) consumes what it
    can and returns the canonical text that became certain; then done or failed may be set.
    A number at the very end of a final text completes it."""

    def __init__(self, max_chars: Optional[int] = None):
        self._stack: list = []
        self._state = _VALUE
        self._tok = ""
        self._key = False
        self._left = max_chars          # canonical characters still allowed (None: no limit)

    @property
    def done(self) -> bool:
        return self._state == _DONE

    @property
    def failed(self) -> bool:
        return self._state == _FAIL

    def read(self, cur: Cursor) -> str:
        out = []
        text, pos, n = cur.text, cur.pos, len(cur.text)
        if self._left is not None:            # canonical text is at least half the raw text
            n = min(n, pos + 2 * self._left + 16)
        while pos < n and self._state < _DONE:
            st, ch = self._state, text[pos]
            if st == _STR:
                m = _PLAIN.match(text, pos, n)
                if m is not None:
                    out.append(m.group())
                    pos = m.end()
                elif ch == '"':
                    out.append('"')
                    pos += 1
                    if self._key:
                        self._state = _COLON
                    else:
                        self._after_value()
                elif ch == "\\":
                    self._state = _ESC
                    pos += 1
                else:
                    out.append(_canon_char(ch))
                    pos += 1
                continue
            if st in (_VALUE, _OBJ_FIRST, _OBJ_KEY, _COLON, _ARR_FIRST, _AFTER) and ch in _WS:
                pos += 1
                continue
            pos += self._step(st, ch, out)
        at_end = pos == len(text)
        if cur.final and at_end and self._state == _NUM and not self._stack:
            self._end_number(out)
        elif self._state < _DONE and (pos == n < len(text) or (cur.final and at_end)):
            self._state = _FAIL                 # past the length limit, or the text ended
        cur.pos = pos
        piece = "".join(out)
        if self._left is not None:
            self._left -= len(piece)
            if self._left < 0:
                self._state = _FAIL
        return piece

    # ---------------------------------------------------------------- states
    def _step(self, st: int, ch: str, out: list) -> int:
        """Handle ch (not whitespace where whitespace is skipped) in state st; how many
        characters were consumed (0: ch is seen again in the new state)."""
        if st == _VALUE or st == _ARR_FIRST:
            if st == _ARR_FIRST and ch == "]":
                return self._close("[", "]", out)
            if ch == "{" or ch == "[":
                self._stack.append(ch)
                out.append(ch)
                self._state = _OBJ_FIRST if ch == "{" else _ARR_FIRST
            elif ch == '"':
                out.append('"')
                self._key, self._state = False, _STR
            elif ch == "-" or "0" <= ch <= "9":
                self._tok, self._state = ch, _NUM
            elif ch in "tfn":
                self._tok, self._state = ch, _LIT
            else:
                self._state = _FAIL
            return 1
        if st == _OBJ_FIRST and ch == "}":
            return self._close("{", "}", out)
        if st == _OBJ_FIRST or st == _OBJ_KEY:
            if ch != '"':
                self._state = _FAIL
                return 0
            out.append('"')
            self._key, self._state = True, _STR
            return 1
        if st == _COLON:
            if ch != ":":
                self._state = _FAIL
                return 0
            out.append(": ")
            self._state = _VALUE
            return 1
        if st == _AFTER:
            top = self._stack[-1]
            if ch == ",":
                out.append(", ")
                self._state = _OBJ_KEY if top == "{" else _VALUE
                return 1
            if (top, ch) in (("{", "}"), ("[", "]")):
                return self._close(top, ch, out)
            self._state = _FAIL
            return 0
        if st == _ESC:
            if ch == "u":
                self._tok, self._state = "", _UHEX
            elif ch in _ESCAPES:
                out.append(_ESCAPES[ch])
                self._state = _STR
            else:
                self._state = _FAIL
            return 1
        if st == _UHEX:
            if ch not in _HEX:
                self._state = _FAIL
                return 0
            self._tok += ch
            if len(self._tok) == 4:
                out.append(_canon_char(chr(int(self._tok, 16))))
                self._state = _STR
            return 1
        if st == _NUM:
            if ch in _NUMBER_CHARS and len(self._tok) < MAX_NUMBER_CHARS:
                self._tok += ch
                return 1
            self._end_number(out)
            return 0
        # _LIT
        tok = self._tok + ch
        if tok in _LITERALS:
            out.append(tok)
            self._after_value()
        elif any(lit.startswith(tok) for lit in _LITERALS):
            self._tok = tok
        else:
            self._state = _FAIL
            return 0
        return 1

    def _close(self, opener: str, closer: str, out: list) -> int:
        self._stack.pop()
        out.append(closer)
        self._after_value()
        return 1

    def _end_number(self, out: list) -> None:
        if _NUMBER.fullmatch(self._tok) is None:
            self._state = _FAIL
            return
        out.append(json.dumps(json.loads(self._tok)))
        self._after_value()

    def _after_value(self) -> None:
        self._state = _AFTER if self._stack else _DONE


def canonical_json(text: str) -> Optional[str]:
    """The canonical text of a whole JSON value (surrounding whitespace allowed), or None when
    text is not exactly one."""
    cur = Cursor()
    cur.text, cur.final = text, True
    reader = JsonText()
    out = reader.read(cur)
    return out if reader.done and not cur.ws() else None


ARG_KEYS = ("arguments", "parameters")
(_OPEN, _FIRST_KEY, _NAME_COLON, _NAME, _MEMBER_END, _KEY, _KEY_COLON, _MEMBER) = range(8)


class CallObject:
    """One call object read into a Sink (see the module docstring). advance(cur) -> None while
    it needs more text; True when it ended with its arguments complete (the call is closed
    ok); False when it failed (`opened` tells whether the call had opened: then it is closed
    broken at the failure; else nothing was emitted)."""

    def __init__(self, sink: Sink, raw_start: int):
        self.sink, self.raw_start = sink, raw_start
        self.opened = False
        self._state = _OPEN
        self._text: Optional[JsonText] = None
        self._piece = ""            # canonical text of the key or name being read
        self._key = ""
        self._args: Optional[JsonText] = None    # the arguments' reader once found
        self._args_done = False
        self._result: Optional[bool] = None     # once ended: what advance returned

    def advance(self, cur: Cursor) -> Optional[bool]:
        if self._result is None:
            self._result = self._advance(cur)
        return self._result

    def _advance(self, cur: Cursor) -> Optional[bool]:
        while True:
            st = self._state
            if st in (_OPEN, _NAME_COLON, _MEMBER_END, _KEY_COLON) or \
                    (st in (_FIRST_KEY, _NAME, _KEY, _MEMBER) and self._text is None):
                if not cur.ws():
                    if cur.final:
                        return self._fail(cur)
                    return None
            if st == _OPEN:
                if cur.text[cur.pos] != "{":
                    return self._fail(cur)
                cur.pos += 1
                self._begin(_FIRST_KEY)
            elif st in (_NAME_COLON, _KEY_COLON):
                if cur.text[cur.pos] != ":":
                    return self._fail(cur)
                cur.pos += 1
                self._begin(_NAME if st == _NAME_COLON else _MEMBER)
            elif st == _MEMBER_END:
                ch = cur.text[cur.pos]
                if ch == ",":
                    cur.pos += 1
                    self._begin(_KEY)
                elif ch == "}":
                    cur.pos += 1
                    return self._end(cur)
                else:
                    return self._fail(cur)
            else:
                result = self._read_value(cur, st)
                if result is not None:
                    return result
                if self._state == st:           # the value needs more text
                    return None

    # ---------------------------------------------------------------- parts
    def _begin(self, state: int) -> None:
        self._state, self._text, self._piece = state, None, ""

    def _read_value(self, cur: Cursor, st: int) -> Optional[bool]:
        """Read the key or value of state st; None to go on (state changed when it ended)."""
        if self._text is None:
            first = cur.text[cur.pos]
            if st in (_FIRST_KEY, _KEY, _NAME) and first != '"':
                return self._fail(cur)
            streams = st == _MEMBER and self._key in ARG_KEYS and self._args is None
            self._text = JsonText(None if st == _MEMBER else MAX_NAME_CHARS + 2)
            if streams:
                self._args = self._text
        reader = self._text
        piece = reader.read(cur)
        if reader is self._args:
            if piece:
                self.sink.args(piece)
        elif st != _MEMBER:
            self._piece += piece
        if reader.failed:
            return self._fail(cur)
        if not reader.done:
            return None
        if st == _FIRST_KEY:
            if json.loads(self._piece) != "name":
                return self._fail(cur)
            self._begin(_NAME_COLON)
        elif st == _NAME:
            self.sink.open(json.loads(self._piece), self.raw_start)
            self.opened = True
            self._begin(_MEMBER_END)
        elif st == _KEY:
            self._key = json.loads(self._piece)
            self._begin(_KEY_COLON)
        else:
            if reader is self._args:
                self._args_done = True
            self._begin(_MEMBER_END)
        return None

    def _end(self, cur: Cursor) -> bool:
        if not self._args_done:
            self.sink.args("{}")
        self.sink.close(True, cur.pos)
        return True

    def _fail(self, cur: Cursor) -> bool:
        """Failed at cur.pos. Complete arguments make the call complete all the same (what
        follows them is not part of it); else an open call closes broken."""
        if self.opened:
            if self._args_done:
                self.sink.close(True, cur.pos)
                return True
            self.sink.close(False, cur.pos)
        return False
