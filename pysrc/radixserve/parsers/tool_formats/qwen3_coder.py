"""qwen3_coder: the XML-ish calls of Qwen3-Coder and Qwen3.5 (their chat templates' form):

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    ...
    </function>
    </tool_call>

Values are raw text (one newline after `>` and one before `</parameter>` belong to the layout),
converted by the tool's parameter schema (convert_value): a string stays the text; integer,
number, boolean, null, object and array are read as JSON (objects and arrays also as Python
literals); a value that does not read as its type stays the text. A parameter the schema does
not name (or a function the request did not send) stays a string.
Reading: the call opens at `<function=NAME>`; each parameter goes out as one argument delta
when it ends (`</parameter>`, or the next `<parameter=` / `</function>` when the model left it
open); `</function>` closes the arguments. Several `<function=...>` in one `<tool_call>` are
several calls. A value ends at the first `</parameter>`, `<parameter=` or `</function>` in it.
"""
from __future__ import annotations

import json
import math
import re
from typing import Any, Dict, Optional, Set, Tuple

from radixserve.parsers.tool_formats.base import ToolFormat
from radixserve.parsers.tool_formats.hermes import BEGIN, END
from radixserve.parsers.tool_formats.pyliteral import literal_value
from radixserve.parsers.tool_formats.stream import (DONE, MAX_NAME_CHARS, MORE, RETRY, Block,
                                                    Cursor, Sink)

FUNC, FUNC_END = "<function=", "</function>"
PARAM, PARAM_END = "<parameter=", "</parameter>"
_VALUE_ENDS = (PARAM_END, PARAM, FUNC_END)
_HOLD = max(len(t) for t in _VALUE_ENDS) - 1
_INTEGER = re.compile(r"[+-]?[0-9]+")
_JSON_TYPES = {str: "string", bool: "boolean", int: "integer", float: "number",
               type(None): "null", list: "array", dict: "object"}
_NOTHING = object()


# --------------------------------------------------------------------------- values

def schema_types(schema: Any) -> Set[str]:
    """The JSON types a schema allows, as far as type / enum / const / anyOf / oneOf say (an
    empty set: it does not say)."""
    if not isinstance(schema, dict):
        return set()
    t = schema.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    if "const" in schema:
        return {_JSON_TYPES.get(type(schema["const"]), "string")}
    if isinstance(schema.get("enum"), list):
        return {_JSON_TYPES.get(type(v), "string") for v in schema["enum"]}
    out: Set[str] = set()
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            out |= schema_types(sub)
    return out


def _as(kind: str, text: str) -> Any:
    """text read as a value of JSON type kind, or _NOTHING."""
    if kind == "null":
        return None if text in ("null", "None") else _NOTHING
    if kind == "boolean":
        return {"true": True, "false": False}.get(text.lower(), _NOTHING)
    if kind == "integer":
        if _INTEGER.fullmatch(text) and len(text) < 4300:
            return int(text)
        v = _as("number", text)
        return int(v) if isinstance(v, float) and v.is_integer() else _NOTHING
    try:
        v = json.loads(text, strict=False)
    except (ValueError, RecursionError):
        if kind not in ("object", "array"):
            return _NOTHING
        try:
            v = literal_value(text)
        except ValueError:
            return _NOTHING
    if kind == "number":
        number = isinstance(v, int) and not isinstance(v, bool) or \
            isinstance(v, float) and math.isfinite(v)
        return v if number else _NOTHING
    return v if isinstance(v, dict if kind == "object" else list) else _NOTHING


def convert_value(raw: str, schema: Optional[dict]) -> Any:
    """The value of one parameter: raw is the text between `<parameter=...>` and its end;
    schema its property schema (None: not in the tool's schema). See the module docstring."""
    text = raw[1:] if raw.startswith("\n") else raw
    text = text[:-1] if text.endswith("\n") else text
    if schema is None:
        return text
    types = schema_types(schema)
    stripped = text.strip()
    for kind in ("null", "boolean", "integer", "number", "object", "array"):
        if kind in types:
            v = _as(kind, stripped)
            if v is not _NOTHING:
                return v
    if types and "string" not in types:       # typed, but not as its type: JSON, else the text
        for kind in ("number", "object", "array"):
            v = _as(kind, stripped)
            if v is not _NOTHING:
                return v
        return text
    choices = schema.get("enum") if isinstance(schema.get("enum"), list) else \
        [schema["const"]] if "const" in schema else None
    if choices and text not in choices and stripped in choices:
        return stripped                       # `<parameter=unit> celsius </parameter>`
    return text


# --------------------------------------------------------------------------- reading

class QwenXmlBlock(Block):
    """`<tool_call>` + one or more `<function=...>...</function>` + `</tool_call>`."""

    def __init__(self, sink: Sink, start: int, functions: Dict[str, dict]):
        super().__init__(sink, start)
        self.functions = functions
        self.stage = "function"
        self.calls = 0
        self.item = start               # where the call being read began
        self.props: Dict[str, Any] = {}
        self.params = 0                 # parameters sent of the open call
        self.key = ""
        self.value_from = self.scan_from = 0

    def advance(self, cur: Cursor) -> Tuple[str, int]:
        if cur.pos < self.start + len(BEGIN):
            cur.pos = self.start + len(BEGIN)
        while True:
            step = getattr(self, "_" + self.stage)(cur)
            if step is not None:
                return step

    def _function(self, cur: Cursor) -> Optional[Tuple[str, int]]:
        at = cur.lit(FUNC, ws=True)
        if at is None:
            return MORE, 0
        if not at:
            return self._fail(cur)
        self.stage = "name"
        return None

    def _name(self, cur: Cursor) -> Optional[Tuple[str, int]]:
        found = cur.until(">", MAX_NAME_CHARS)
        if found is None:
            return MORE, 0
        name, after = found
        name = name.strip()
        if after < 0 or not name or any(c in name for c in "<\n"):
            return self._fail(cur)
        cur.pos = after
        self.sink.open(name, self.item)
        self.calls += 1
        schema = self.functions.get(name)
        self.props = schema.get("properties") or {} if isinstance(schema, dict) else {}
        if not isinstance(self.props, dict):
            self.props = {}
        self.params = 0
        self.stage = "param"
        return None

    def _param(self, cur: Cursor) -> Optional[Tuple[str, int]]:
        which = cur.choose((PARAM, FUNC_END), ws=True)
        if which is None:
            return MORE, 0
        if which < 0:
            return self._fail(cur)
        if which == 0:
            self.stage = "key"
            return None
        self.sink.args("}" if self.params else "{}")
        self.sink.close(True, cur.pos)
        self.stage = "after"
        return None

    def _key(self, cur: Cursor) -> Optional[Tuple[str, int]]:
        found = cur.until(">", MAX_NAME_CHARS)
        if found is None:
            return MORE, 0
        key, after = found
        key = key.strip()
        if after < 0 or not key or any(c in key for c in "<\n"):
            return self._fail(cur)
        cur.pos = self.value_from = self.scan_from = after
        self.key, self.stage = key, "value"
        return None

    def _value(self, cur: Cursor) -> Optional[Tuple[str, int]]:
        text = cur.text
        ends = [(j, t) for j, t in ((text.find(t, self.scan_from), t) for t in _VALUE_ENDS)
                if j >= 0]
        if not ends:
            if cur.final:
                cur.pos = len(text)
                return self._fail(cur)
            self.scan_from = max(self.value_from, len(text) - _HOLD)
            return MORE, 0
        j, term = min(ends)
        schema = self.props.get(self.key)
        value = convert_value(text[self.value_from:j], schema if isinstance(schema, dict)
                              else ({} if self.key in self.props else None))
        piece = f"{json.dumps(self.key)}: {json.dumps(value)}"
        self.sink.args(("{" if not self.params else ", ") + piece)
        self.params += 1
        cur.pos = j + len(term) if term == PARAM_END else j
        self.stage = "param"
        return None

    def _after(self, cur: Cursor) -> Optional[Tuple[str, int]]:
        which = cur.choose((END, FUNC), ws=True)
        if which is None:
            return MORE, 0
        if which == 1:                           # another call in the same block
            self.item = cur.pos - len(FUNC)
            self.stage = "name"
            return None
        return DONE, cur.pos

    def _fail(self, cur: Cursor) -> Tuple[str, int]:
        if self.stage in ("param", "key", "value"):      # the open call breaks here
            self.sink.close(False, cur.pos)
            return DONE, cur.pos
        return (DONE, self.item) if self.calls else (RETRY, 0)


class Qwen3CoderFormat(ToolFormat):
    """See the module docstring."""
    trigger = BEGIN
    openers = (BEGIN,)
    markers = (BEGIN, END)

    def call_text(self, name: str, args: Any) -> str:
        lines = [BEGIN, f"{FUNC}{name}>"]
        if isinstance(args, dict):
            for key, value in args.items():
                lines += [f"{PARAM}{key}>", value if isinstance(value, str)
                          else json.dumps(value), PARAM_END]
        else:                                    # arguments that did not parse, as sent
            lines.append(args if isinstance(args, str) else json.dumps(args))
        return "\n".join(lines + [FUNC_END, END])

    def example_text(self) -> str:
        return "\n".join([BEGIN, f"{FUNC}<function name>>", f"{PARAM}<parameter name>>",
                          "<value: text, or JSON for numbers, booleans, arrays, objects>",
                          PARAM_END, "(one <parameter=...> block per argument)", FUNC_END, END])

    def tag(self, fn: dict) -> dict:
        return {"type": "tag", "begin": f"{BEGIN}\n{FUNC}{fn['name']}>\n",
                "content": {"type": "json_schema", "json_schema": fn["parameters"],
                            "style": "qwen_xml"},
                "end": f"\n{FUNC_END}\n{END}"}

    def call_block(self, text: str, start: int, sink: Sink) -> Block:
        return QwenXmlBlock(sink, start, self.functions)
