"""llama3 (= llama3_json): bare `{"name": ..., "parameters": {...}}` objects, several joined by
"; " (Llama 3.1 / 3.2 / 3.3 with JSON tool calling).

Reading: a call begins at `{` + `"name":` (any whitespace), read by json_text.CallObject
("parameters" or "arguments"); a `;` after a call (with the whitespace around it) separates
calls and is not content; `<|python_tag|>` (in the text when special tokens are kept) is dropped
wherever it appears. A JSON object that does not open with "name" is content.
"""
from __future__ import annotations

import json
import re
from typing import Any, Tuple

from radixserve.parsers.tool_formats.base import ToolFormat
from radixserve.parsers.tool_formats.json_text import CallObject
from radixserve.parsers.tool_formats.stream import DONE, MORE, RETRY, Block, Cursor, Sink

PYTHON_TAG = "<|python_tag|>"     # Llama 3's tool-call token, in text when special tokens are kept


class SeparatedObjectBlock(Block):
    """One call object, then `;` (and the whitespace after it) when one follows."""

    def __init__(self, sink: Sink, start: int):
        super().__init__(sink, start)
        self.obj = CallObject(sink, start)
        self.read = self.separated = False

    def advance(self, cur: Cursor) -> Tuple[str, int]:
        if not self.read:
            result = self.obj.advance(cur)
            if result is None:
                return MORE, 0
            if result is False:
                return (DONE, cur.pos) if self.obj.opened else (RETRY, 0)
            self.read = True
        if not self.separated:
            sep = cur.lit(";", ws=True)
            if sep is None:
                return MORE, 0
            if not sep:
                return DONE, cur.pos
            self.separated = True
        if not cur.ws() and not cur.final:     # the whitespace after ";" is the separator's
            return MORE, 0
        return DONE, cur.pos


class Llama3Format(ToolFormat):
    """See the module docstring."""
    joiner = "; "
    trigger = '{"name": '
    opener_re = re.compile(r'\{\s*"name"\s*:')
    opener_tail_re = re.compile(r'\{\s*(?:"(?:n(?:a(?:m(?:e(?:"\s*)?)?)?)?)?)?\Z')
    ignored = (PYTHON_TAG,)

    def call_text(self, name: str, args: Any) -> str:
        return json.dumps({"name": name, "parameters": args})

    def tag(self, fn: dict) -> dict:
        return {"type": "tag", "begin": f'{{"name": {json.dumps(fn["name"])}, "parameters": ',
                "content": {"type": "json_schema", "json_schema": fn["parameters"]}, "end": "}"}

    def call_block(self, text: str, start: int, sink: Sink) -> Block:
        return SeparatedObjectBlock(sink, start)
