"""Reading one output's tool calls as its text arrives: the machinery every format shares.

CallStream(fmt) is fed the output's text in pieces of any size and gives
  * content: the text outside calls, as soon as no call can start in it (feed's return);
  * call deltas (take_deltas): per call, {index, id, type, function: {name, arguments}} the
    first time (the name before any argument text is known, or with what is known), then
    {index, function: {arguments}} pieces whose concatenation is the call's arguments JSON;
  * at the end (finish): the rest of the content and every call as a whole tool_calls entry.
Whatever the pieces, the result is the same as one feed of the whole text (the format's
non-streaming parse is exactly that). One exception, which no stream can avoid: a call that
breaks (the output ends inside it, or its syntax fails) after its name was taken by
take_deltas stays a call, its arguments what was read; when nothing of it was taken its raw
text goes back into the content, in place, as the non-streaming parse has it.

A format supplies (duck-typed, see base.ToolFormat): find_start(text, pos) -> (index,
certain), where a call block may begin; block(text, index, sink) -> a Block that reads the
calls of one block from that index; new_id() -> a call id. A Block reports through the sink:
open(name, raw_start) once the name is certain (the call is then committed), args(text) as
canonical argument text becomes certain, close(ok, raw_end). advance(cursor) returns (MORE, _)
to wait for text (never when the cursor is final), (DONE, resume) with the index where the
text outside calls goes on, or (RETRY, _) when no call was there after all (nothing emitted):
the block's first character is content and the search resumes after it.
Work is linear in the text: each block reads its text once, and a block that was not a call
fails within its opener (formats bound names to MAX_NAME_CHARS) before the search moves on.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, List, Optional, Pattern, Tuple

MORE, DONE, RETRY = "more", "done", "retry"
MAX_NAME_CHARS = 256          # a function or parameter name longer than this is not one
_WS = " \t\r\n"


class Cursor:
    """The unread text as blocks see it: text (the buffer), pos (the next character), final
    (no more text will come)."""
    __slots__ = ("text", "pos", "final")

    def __init__(self) -> None:
        self.text, self.pos, self.final = "", 0, False

    def ws(self) -> bool:
        """Skip whitespace; True when a character follows (False: the text ran out)."""
        text, i, n = self.text, self.pos, len(self.text)
        while i < n and text[i] in _WS:
            i += 1
        self.pos = i
        return i < n

    def list_separator(self) -> Optional[Tuple[str, int]]:
        """After an item of a bracketed list `[a, b, ...]`: consume the ',' before the next item
        (None: the next item starts at pos); else the block's answer: (MORE, 0) while the text
        may still go on, (DONE, index after ']') at the list's end, (DONE, pos) at anything
        else (the list ends there unclosed)."""
        if not self.ws():
            return (DONE, self.pos) if self.final else (MORE, 0)
        ch = self.text[self.pos]
        if ch == "]":
            return DONE, self.pos + 1
        if ch != ",":
            return DONE, self.pos
        self.pos += 1
        return None

    def lit(self, s: str, ws: bool = False) -> Optional[bool]:
        """Consume s (after whitespace when ws): True when consumed; False when the text
        differs (nothing consumed); None when it may still come (only when not final)."""
        text, i, n = self.text, self.pos, len(self.text)
        if ws:
            while i < n and text[i] in _WS:
                i += 1
        have = text[i:i + len(s)]
        if have == s:
            self.pos = i + len(s)
            return True
        if len(have) < len(s) and s.startswith(have) and not self.final:
            return None
        return False

    def choose(self, options: Tuple[str, ...], ws: bool = False) -> Optional[int]:
        """Consume whichever of options comes next (after whitespace when ws; no option may be
        a prefix of another): its index; -1 when none can (nothing consumed); None while one
        may still come (only when not final)."""
        waiting = False
        for k, s in enumerate(options):
            got = self.lit(s, ws)
            if got:
                return k
            waiting = waiting or got is None
        return None if waiting else -1

    def word(self, pattern: Pattern) -> Optional[str]:
        """Consume a match of pattern that is certainly whole (text follows it, or the text is
        final): the match; "" when there is none here (or it is longer than MAX_NAME_CHARS);
        None while it may still come or go on."""
        m = pattern.match(self.text, self.pos)
        at_end = (m.end() if m is not None else self.pos) == len(self.text)
        if at_end and not self.final:
            return None
        if m is None or m.end() - m.start() > MAX_NAME_CHARS:
            return ""
        self.pos = m.end()
        return m.group()

    def until(self, stop: str, limit: int) -> Optional[Tuple[str, int]]:
        """(text up to stop, index after stop) when stop comes within limit characters; None
        while it may still come; ("", -1) when it cannot (limit passed, or the text is final)."""
        j = self.text.find(stop, self.pos, self.pos + limit + len(stop))
        if j >= 0:
            return self.text[self.pos:j], j + len(stop)
        if self.final or len(self.text) - self.pos > limit + len(stop):
            return "", -1
        return None


class Sink(ABC):
    """Where a Block reports the calls it reads."""

    @abstractmethod
    def open(self, name: str, raw_start: int) -> None:
        """A call to name begins at raw_start (the index of its first character)."""

    @abstractmethod
    def args(self, text: str) -> None:
        """More of the open call's arguments JSON."""

    @abstractmethod
    def close(self, ok: bool, raw_end: int) -> None:
        """The open call ends at raw_end: ok when its arguments are complete."""


class Block(ABC):
    """Reads the calls of one block, from the format's certain start, into sink."""

    def __init__(self, sink: Sink, start: int):
        self.sink, self.start = sink, start

    @abstractmethod
    def advance(self, cur: Cursor) -> Tuple[str, int]:
        """(MORE, 0) | (DONE, resume index) | (RETRY, 0); see the module docstring."""


class SkipBlock(Block):
    """A token the format drops from the content (Llama's <|python_tag|>, ...)."""

    def __init__(self, sink: Sink, start: int, length: int):
        super().__init__(sink, start)
        self.length = length

    def advance(self, cur: Cursor) -> Tuple[str, int]:
        return DONE, self.start + self.length


class _Call:
    __slots__ = ("index", "id", "name", "args", "raw_start", "ok", "sent_name", "sent_args")

    def __init__(self, index: int, call_id: str, name: str, raw_start: int):
        self.index, self.id, self.name, self.raw_start = index, call_id, name, raw_start
        self.args: List[str] = []
        self.ok: Optional[bool] = None          # None while open
        self.sent_name, self.sent_args = False, 0

    def entry(self) -> dict:
        args = "".join(self.args)
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": args}}


class CallStream(Sink):
    """One output's content and calls, fed piece by piece (see the module docstring).
    feed(text) -> content to send now; take_deltas() -> call deltas since the last take;
    finish() -> (content left, every call as a tool_calls entry)."""

    def __init__(self, fmt: Any):
        self._fmt = fmt
        self._cur = Cursor()
        self._block: Optional[Block] = None
        self._content: List[str] = []
        self._calls: List[_Call] = []
        self._open: Optional[_Call] = None
        self._finished = False

    # ---------------------------------------------------------------- sink
    def open(self, name: str, raw_start: int) -> None:
        call = _Call(len(self._calls), self._fmt.new_id(), name, raw_start)
        self._calls.append(call)
        self._open = call

    def args(self, text: str) -> None:
        if text:
            self._open.args.append(text)

    def close(self, ok: bool, raw_end: int) -> None:
        call, self._open = self._open, None
        if ok or call.sent_name:
            call.ok = ok
            return
        self._calls.pop()                       # nothing of it sent: its text is content
        self._content.append(self._cur.text[call.raw_start:raw_end])

    # ---------------------------------------------------------------- the consumer
    @property
    def called(self) -> bool:
        """Whether the output has a call so far (a broken one that was sent included)."""
        return bool(self._calls)

    @property
    def whole(self) -> int:
        """How many calls ended whole (their arguments complete)."""
        return sum(c.ok is True for c in self._calls)

    @property
    def broken(self) -> bool:
        """Whether a call that was sent broke (the output ended inside it, or it went wrong)."""
        return any(c.ok is False for c in self._calls)

    def feed(self, delta: str) -> str:
        self._run(delta, final=False)
        return self._take_content()

    def finish(self) -> Tuple[str, List[dict]]:
        if not self._finished:
            self._finished = True
            self._run("", final=True)
        return self._take_content(), [c.entry() for c in self._calls]

    def take_deltas(self) -> List[dict]:
        """Call deltas (OpenAI delta.tool_calls entries) not taken yet, one per call index; a
        taken name commits its call (it can no longer turn back into content)."""
        out = []
        for call in self._calls:
            args = "".join(call.args[call.sent_args:])
            if call.sent_name and not args:
                continue
            if call.sent_name:
                entry = {"index": call.index, "function": {"arguments": args}}
            else:
                entry = {"index": call.index, "id": call.id, "type": "function",
                         "function": {"name": call.name, "arguments": args}}
                call.sent_name = True
            call.sent_args = len(call.args)
            out.append(entry)
        return out

    # ---------------------------------------------------------------- the reading
    def _take_content(self) -> str:
        out = "".join(self._content)
        self._content.clear()
        return out

    def _run(self, delta: str, final: bool) -> None:
        cur = self._cur
        if self._block is None and cur.pos:
            cur.text, cur.pos = cur.text[cur.pos:], 0
        cur.text += delta
        cur.final = final
        while True:
            if self._block is None and not self._outside():
                return
            block = self._block
            status, resume = block.advance(cur)
            if status == MORE:
                assert not final, f"{type(block).__name__} asked for more text at the end"
                return
            self._block = None
            if status == RETRY:
                self._content.append(cur.text[block.start])
                cur.pos = block.start + 1
            else:
                cur.pos = resume

    def _outside(self) -> bool:
        """Send the text before the next call start; open a block there when it is certain.
        False when the text ran out first."""
        cur = self._cur
        text, pos = cur.text, cur.pos
        start, certain = self._fmt.find_start(text, pos)
        if start < 0 or (not certain and cur.final):
            start, certain = len(text), False
        if start > pos:
            self._content.append(text[pos:start])
            cur.pos = start
        if not certain:
            return False
        self._block = self._fmt.block(text, start, self)
        return True
