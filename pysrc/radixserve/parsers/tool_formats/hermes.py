"""hermes (= qwen25): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks,
anywhere in the output (Hermes, Qwen2.5 / Qwen3, SmolLM2).

Reading: after `<tool_call>` comes one call object (json_text.CallObject: "name" first, then
"arguments" or "parameters"); the call opens with its name and its arguments stream as they
come; `</tool_call>` after it is consumed when present (a call is complete once its arguments
are). Anything else after `<tool_call>` is content.
"""
from __future__ import annotations

import json
from typing import Any, List, Optional, Tuple

from radixserve.parsers.tool_formats.base import ToolFormat, chosen_functions, structural_tag
from radixserve.parsers.tool_formats.json_text import CallObject
from radixserve.parsers.tool_formats.stream import DONE, MORE, RETRY, Block, Cursor, Sink

BEGIN, END = "<tool_call>", "</tool_call>"


class TaggedObjectBlock(Block):
    """`BEGIN` + one call object + an optional `END` (after whitespace)."""

    def __init__(self, sink: Sink, start: int, begin: str, end: str):
        super().__init__(sink, start)
        self.end = end
        self.obj = CallObject(sink, start)
        self.pos0 = start + len(begin)
        self.read = False

    def advance(self, cur: Cursor) -> Tuple[str, int]:
        if not self.read:
            if cur.pos < self.pos0:
                cur.pos = self.pos0
            result = self.obj.advance(cur)
            if result is None:
                return MORE, 0
            if result is False:
                return (DONE, cur.pos) if self.obj.opened else (RETRY, 0)
            self.read = True
        closed = cur.lit(self.end, ws=True)
        return (MORE, 0) if closed is None else (DONE, cur.pos)


class HermesFormat(ToolFormat):
    """See the module docstring."""
    trigger = BEGIN
    openers = (BEGIN,)
    markers = (BEGIN, END)

    def call_text(self, name: str, args: Any) -> str:
        return f'{BEGIN}\n{json.dumps({"name": name, "arguments": args})}\n{END}'

    def tag(self, fn: dict) -> dict:
        schema = {"type": "object", "properties": {"name": {"const": fn["name"]},
                                                   "arguments": fn["parameters"]},
                  "required": ["name", "arguments"]}
        return {"type": "tag", "begin": BEGIN + "\n",
                "content": {"type": "json_schema", "json_schema": schema}, "end": "\n" + END}

    def grammar(self, functions: List[dict], choice: Any, parallel: bool = True) -> Optional[str]:
        """One tag for all chosen functions (the name inside the JSON picks one)."""
        chosen = chosen_functions(functions, choice)
        if not chosen:
            return None
        tags = [self.tag(f) for f in chosen]
        schemas = [t["content"]["json_schema"] for t in tags]
        tag = {**tags[0], "content": {"type": "json_schema", "json_schema":
                                      schemas[0] if len(schemas) == 1 else {"anyOf": schemas}}}
        if choice == "auto":
            fmt = {"type": "triggered_tags", "triggers": [BEGIN], "tags": [tag],
                   "at_least_one": False, "stop_after_first": not parallel}
        else:
            fmt = tag
        return structural_tag(fmt)

    def call_block(self, text: str, start: int, sink: Sink) -> Block:
        return TaggedObjectBlock(sink, start, BEGIN, END)
