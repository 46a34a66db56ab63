"""mistral: Mistral's `[TOOL_CALLS]` calls, in both of its tokenizers' forms:

  array    `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (tokenizers before v11:
           Mistral-7B-Instruct-v0.3, Mixtral, Nemo; the space is optional)
  compact  `[TOOL_CALLS]NAME[ARGS]{...}`, one marker per call (v11 and later: Mistral Small
           3.2, Devstral, Magistral); `[CALL_ID]ID` before `[ARGS]` is read and dropped, and a
           text without `[ARGS]` (a tokenizer that drops it) reads too
Both are read, whatever the model. Calls are written (grammar, prompt, history) in the compact
form when the request's tokenizer has an `[ARGS]` token (bind), else in the array form.
`[TOOL_CALLS]` and `[ARGS]` are special tokens of Mistral's tokenizers: a request with tools
keeps special tokens in its text (ToolFormat.keep_special_tokens) or the calls could not be
read. Call ids are 9 letters and digits, as Mistral's tokenizers require.
"""
from __future__ import annotations

import json
import re
import secrets
import string
from typing import Any, List, Optional, Sequence, Tuple

from radixserve.parsers.tool_formats.base import ToolFormat, call_args
from radixserve.parsers.tool_formats.json_text import CallObject, JsonText
from radixserve.parsers.tool_formats.stream import (DONE, MORE, RETRY, Block,
                                                    Cursor, Sink)

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_ALNUM = string.ascii_letters + string.digits
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_ID = re.compile(r"[A-Za-z0-9]+")


class ArrayBlock(Block):
    """`[TOOL_CALLS]` + whitespace + `[` call object (`,` call object)* `]`."""

    def __init__(self, sink: Sink, start: int, pos: int):
        super().__init__(sink, start)
        self.obj: Optional[CallObject] = None
        self.item, self.calls, self.pos0 = start, 0, pos
        self.between = False            # a call object ended; a separator comes next

    def advance(self, cur: Cursor) -> Tuple[str, int]:
        if cur.pos < self.pos0:
            cur.pos = self.pos0
        while True:
            if not self.between:
                if self.obj is None:
                    self.obj = CallObject(self.sink, self.item)
                result = self.obj.advance(cur)
                if result is None:
                    return MORE, 0
                if result is False:
                    if self.obj.opened:
                        return DONE, cur.pos
                    return (DONE, self.item) if self.calls else (RETRY, 0)
                self.calls += 1
                self.between = True
            ended = cur.list_separator()
            if ended is not None:
                return ended
            self.item, self.obj, self.between = cur.pos, None, False


class CompactBlock(Block):
    """`[TOOL_CALLS]` NAME (`[CALL_ID]` ID)? `[ARGS]`? ARGUMENTS."""

    def __init__(self, sink: Sink, start: int, pos: int):
        super().__init__(sink, start)
        self.pos0, self.stage = pos, "name"
        self.name = ""
        self.args: Optional[JsonText] = None

    def advance(self, cur: Cursor) -> Tuple[str, int]:
        if cur.pos < self.pos0:
            cur.pos = self.pos0
        if self.stage == "name":
            name = cur.word(_NAME)
            if name is None:
                return MORE, 0
            if not name:
                return RETRY, 0
            self.name, self.stage = name, "call id"
        if self.stage == "call id":
            marked = cur.lit(CALL_ID)
            if marked is None:
                return MORE, 0
            if marked:
                self.stage = "id"
            else:
                self.stage = "args mark"
        if self.stage == "id":
            if cur.word(_ID) is None:
                return MORE, 0
            self.stage = "args mark"
        if self.stage == "args mark":
            marked = cur.lit(ARGS)
            if marked is None:
                return MORE, 0
            self.stage = "open"
        if self.stage == "open":
            if not cur.ws():
                return (RETRY, 0) if cur.final else (MORE, 0)
            if cur.text[cur.pos] not in "{[":
                return RETRY, 0
            self.sink.open(self.name, self.start)
            self.args, self.stage = JsonText(), "args"
        piece = self.args.read(cur)
        if piece:
            self.sink.args(piece)
        if self.args.done or self.args.failed:
            self.sink.close(self.args.done, cur.pos)
            return DONE, cur.pos
        return MORE, 0


class MistralFormat(ToolFormat):
    """See the module docstring."""
    trigger = TOOL_CALLS
    openers = (TOOL_CALLS,)
    markers = (TOOL_CALLS, ARGS)
    compact = False

    def bind(self, functions: Sequence[dict], tokenizer: Any = None) -> "MistralFormat":
        fmt = super().bind(functions, tokenizer)
        to_id = getattr(tokenizer, "token_to_id", None)
        fmt.compact = to_id is not None and to_id(ARGS) is not None
        return fmt

    def new_id(self) -> str:
        return "".join(secrets.choice(_ALNUM) for _ in range(9))

    def call_text(self, name: str, args: Any) -> str:
        if self.compact:
            return f"{TOOL_CALLS}{name}{ARGS}{json.dumps(args)}"
        return f'{TOOL_CALLS} [{json.dumps({"name": name, "arguments": args})}]'

    def render_calls(self, calls: List[dict]) -> str:
        if self.compact:
            return "".join(self.call_text(*call_args(c)) for c in calls)
        objects = [json.dumps({"name": n, "arguments": a}) for n, a in map(call_args, calls)]
        return f"{TOOL_CALLS} [{', '.join(objects)}]"

    def tag(self, fn: dict) -> dict:
        content = {"type": "json_schema", "json_schema": fn["parameters"]}
        if self.compact:
            return {"type": "tag", "begin": f"{TOOL_CALLS}{fn['name']}{ARGS}",
                    "content": content, "end": ""}
        return {"type": "tag",
                "begin": f'{TOOL_CALLS} [{{"name": {json.dumps(fn["name"])}, "arguments": ',
                "content": content, "end": "}]"}

    def call_block(self, text: str, start: int, sink: Sink) -> Block:
        return MistralBlock(sink, start)


class MistralBlock(Block):
    """`[TOOL_CALLS]`, then the array form when `[` follows (after whitespace), else the
    compact one."""

    def __init__(self, sink: Sink, start: int):
        super().__init__(sink, start)
        self.inner: Optional[Block] = None

    def advance(self, cur: Cursor) -> Tuple[str, int]:
        if self.inner is None:
            cur.pos = max(cur.pos, self.start + len(TOOL_CALLS))
            if not cur.ws():
                return (RETRY, 0) if cur.final else (MORE, 0)
            if cur.text[cur.pos] == "[":
                self.inner = ArrayBlock(self.sink, self.start, cur.pos + 1)
            else:
                self.inner = CompactBlock(self.sink, self.start, cur.pos)
        return self.inner.advance(cur)
