"""pythonic: a Python list of calls with keyword arguments (Llama 3.2 / Llama 4, and other
models prompted that way):

    [get_weather(city="Paris", unit="celsius"), add(a=1, b=2)]

Arguments are Python literals read with ast (pyliteral.literal_value; nothing is evaluated).
Llama 4's <|python_start|> / <|python_end|> and Llama's <|python_tag|> are dropped from the
content. Reading: a block begins at `[` + a (dotted) identifier + `(`; the call opens at its
first `key=` (or at `()`), so prose such as "[see(below)]" stays content; each argument then
goes out as one argument delta when its value has been read; `)` closes the call, `,` starts
the next one, `]` ends the block. The grammar forces `[name(key=value, ...)]`, one call, its
values typed by the schema (pyschema.kwargs_grammar); a function name or parameter that is not
a Python identifier cannot be written this way (a 400 naming the tool).
"""
from __future__ import annotations

import json
import re
from typing import Any, List, Optional, Tuple

from radixserve.errors import bad_request
from radixserve.parsers.tool_formats.base import ToolFormat, call_args
from radixserve.parsers.tool_formats.pyliteral import LiteralEnd, literal_value, py_literal
from radixserve.parsers.tool_formats.pyschema import is_identifier, kwargs_grammar
from radixserve.parsers.tool_formats.stream import (DONE, MORE, RETRY, Block,
                                                    Cursor, Sink)

_FUNC = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")      # read greedily, then checked by _DOTTED
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
PYTHON_TOKENS = ("<|python_start|>", "<|python_end|>", "<|python_tag|>")


class CallListBlock(Block):
    """`[` call (`,` call)* `]`, each call `name(key=literal, ...)`."""

    def __init__(self, sink: Sink, start: int):
        super().__init__(sink, start)
        self.stage, self.calls = "name", 0
        self.item = start                # where the call being read began
        self.name = ""
        self.opened = False
        self.args = 0
        self.key = ""
        self.value: Optional[LiteralEnd] = None
        self.value_from = 0

    def advance(self, cur: Cursor) -> Tuple[str, int]:
        if cur.pos <= self.start:
            cur.pos = self.start + 1                 # the "["
        while True:
            step = getattr(self, "_" + self.stage.replace(" ", "_"))(cur)
            if step is not None:
                return step

    def _name(self, cur: Cursor) -> Optional[Tuple[str, int]]:
        if not cur.ws():
            return self._wait_or_fail(cur)
        name = cur.word(_FUNC)
        if name is None:
            return MORE, 0
        if not name or _DOTTED.fullmatch(name) is None:
            return self._fail(cur)
        self.name, self.stage = name, "paren"
        return None

    def _paren(self, cur: Cursor) -> Optional[Tuple[str, int]]:
        got = cur.lit("(", ws=True)
        if got is None:
            return MORE, 0
        if not got:
            return self._fail(cur)
        self.opened, self.args, self.stage = False, 0, "key"
        return None

    def _key(self, cur: Cursor) -> Optional[Tuple[str, int]]:
        if not cur.ws():
            return self._wait_or_fail(cur)
        if cur.text[cur.pos] == ")":
            cur.pos += 1
            return self._close_call()
        key = cur.word(_KEY)
        if key is None:
            return MORE, 0
        if not key:
            return self._fail(cur)
        self.key, self.stage = key, "equals"
        return None

    def _equals(self, cur: Cursor) -> Optional[Tuple[str, int]]:
        got = cur.lit("=", ws=True)
        if got is None:
            return MORE, 0
        if not got:
            return self._fail(cur)
        if not self.opened:                          # `name(key=`: a call
            self.sink.open(self.name, self.item)
            self.opened = True
        self.value, self.value_from, self.stage = LiteralEnd(cur.pos), cur.pos, "value"
        return None

    def _value(self, cur: Cursor) -> Optional[Tuple[str, int]]:
        end = self.value.scan(cur)
        if end is None:
            return MORE, 0
        if end < 0 or cur.text[end] not in ",)":
            cur.pos = len(cur.text) if end < 0 else end
            return self._fail(cur)
        try:
            value = literal_value(cur.text[self.value_from:end])
        except ValueError:
            cur.pos = self.value_from
            return self._fail(cur)
        piece = f"{json.dumps(self.key)}: {json.dumps(value)}"
        self.sink.args(("{" if not self.args else ", ") + piece)
        self.args += 1
        cur.pos = end
        if cur.text[end] == ")":
            cur.pos += 1
            return self._close_call()
        cur.pos += 1                                 # the ","
        self.stage = "key"
        return None

    def _close_call(self) -> Optional[Tuple[str, int]]:
        if not self.opened:
            self.sink.open(self.name, self.item)
        self.sink.args("}" if self.args else "{}")
        self.sink.close(True, 0)
        self.opened = False
        self.calls += 1
        self.stage = "next"
        return None

    def _next(self, cur: Cursor) -> Optional[Tuple[str, int]]:
        ended = cur.list_separator()
        if ended is not None:
            return ended
        self.item, self.stage = cur.pos, "name"
        return None

    def _wait_or_fail(self, cur: Cursor) -> Optional[Tuple[str, int]]:
        return self._fail(cur) if cur.final else (MORE, 0)

    def _fail(self, cur: Cursor) -> Tuple[str, int]:
        if self.opened:                              # the open call breaks here
            self.sink.close(False, cur.pos)
            return DONE, cur.pos
        return (DONE, self.item) if self.calls else (RETRY, 0)


class PythonicFormat(ToolFormat):
    """See the module docstring."""
    joiner = ", "
    opener_re = re.compile(r"\[\s*[A-Za-z_][A-Za-z0-9_.]{0,255}\s*\(")
    opener_tail_re = re.compile(r"\[\s*(?:[A-Za-z_][A-Za-z0-9_.]{0,255}\s*)?\Z")
    ignored = PYTHON_TOKENS

    def call_text(self, name: str, args: Any) -> str:
        return f"[{self._call(name, args)}]"

    def render_calls(self, calls: List[dict]) -> str:
        return "[" + ", ".join(self._call(*call_args(c)) for c in calls) + "]"

    def _call(self, name: str, args: Any) -> str:
        if not isinstance(args, dict):               # arguments that did not parse, as sent
            args = {"arguments": args}
        try:
            inner = ", ".join(f"{k}={py_literal(v)}" for k, v in args.items())
        except ValueError:
            inner = f"arguments={py_literal(json.dumps(args))}"
        return f"{name}({inner})"

    def example_text(self) -> str:
        return ("[function_name(param_name=value, other_param=value), other_function(...)] "
                "with Python literals for the values")

    def tag(self, fn: dict) -> dict:
        name = fn["name"]
        if not all(is_identifier(part) for part in name.split(".")):
            raise bad_request(f"tool {name!r}: the pythonic tool-call format can only call "
                              f"functions whose names are Python identifiers", param="tools")
        try:
            grammar = kwargs_grammar(fn["parameters"])
        except ValueError as e:
            raise bad_request(f"tool {name!r}: the pythonic tool-call format cannot write its "
                              f"arguments: {e}", param="tools") from None
        return {"type": "tag", "begin": f"[{name}(",
                "content": {"type": "grammar", "grammar": grammar}, "end": ")]"}

    def triggers(self, chosen: List[dict]) -> List[str]:
        return [f"[{f['name']}(" for f in chosen]

    def call_block(self, text: str, start: int, sink: Sink) -> Block:
        return CallListBlock(sink, start)
