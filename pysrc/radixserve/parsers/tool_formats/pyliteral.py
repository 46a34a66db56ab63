"""Python literals as JSON values, both ways, without evaluating anything.

literal_value(text): the JSON value of one Python literal, read with ast (never eval): str,
int, float (finite), True / False / None, and lists, tuples and dicts of them (dict keys
strings); a sign before a number; the JSON words true / false / null too (models trained on
JSON write them). Anything else (names, calls, f-strings, bytes, sets, operators) is a
ValueError.
py_literal(value): the Python literal that literal_value reads back as value (strings in JSON's
double-quoted form, which Python reads the same).
LiteralEnd: where one literal ends in text that keeps arriving: the first `,` or `)` outside
brackets and string literals (single, double and triple quotes, backslash escapes).
"""
from __future__ import annotations

import ast
import json
import math
import re
from typing import Any, List, Optional

from radixserve.parsers.tool_formats.stream import Cursor

_WORDS = {"true": True, "false": False, "null": None}
_PLAIN = re.compile(r"[^\"'()\[\]{},]+")
_IN_STRING = {'"': re.compile(r'[^"\\]+'), "'": re.compile(r"[^'\\]+")}


def literal_value(text: str) -> Any:
    try:
        node = ast.parse(text.strip(), mode="eval").body
        return _value(node)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError) as e:
        raise ValueError(f"not a literal: {e}") from None


def _value(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant):
        v = node.value
        if v is None or isinstance(v, (bool, int, str)):
            return v
        if isinstance(v, float) and math.isfinite(v):
            return v
        raise ValueError(f"{type(v).__name__} is not a JSON value")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) and \
            isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float):
        v = node.operand.value
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_value(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values):
            if not (isinstance(k, ast.Constant) and isinstance(k.value, str)):
                raise ValueError("dict keys must be strings")
            out[k.value] = _value(v)
        return out
    if isinstance(node, ast.Name) and node.id in _WORDS:
        return _WORDS[node.id]
    raise ValueError(f"{type(node).__name__} is not a literal")


def py_literal(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return {None: "None", True: "True", False: "False"}[value]
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(py_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {py_literal(v)}"
                               for k, v in value.items()) + "}"
    raise ValueError(f"{type(value).__name__} has no literal")


def _may_grow(text: str, i: int, quote: str, final: bool) -> bool:
    """Whether the quotes at text[i:] may still grow into three."""
    have = text[i:i + 3]
    return not final and len(have) < 3 and have == quote * len(have)


class LiteralEnd:
    """Finds the end of one literal that starts at `start` in a growing text. scan(cur) -> the
    index of the `,` or `)` that ends it; None while it may still come; -1 when the text is
    final without one. A `]` or `}` with no bracket open ends it too (the literal then does
    not parse)."""

    def __init__(self, start: int):
        self._i = start
        self._stack: List[str] = []
        self._quote: Optional[str] = None
        self._triple = False
        self._escape = False

    def scan(self, cur: Cursor) -> Optional[int]:
        text, i, n = cur.text, self._i, len(cur.text)
        while i < n:
            ch = text[i]
            if self._quote is not None:
                if self._escape:
                    self._escape = False
                    i += 1
                elif ch == "\\":
                    self._escape = True
                    i += 1
                elif ch == self._quote:
                    if not self._triple:
                        self._quote = None
                        i += 1
                    elif _may_grow(text, i, ch, cur.final):
                        break                       # may still become the closing """
                    elif text.startswith(ch * 3, i):
                        self._quote = None
                        i += 3
                    else:
                        i += 1
                else:
                    m = _IN_STRING[self._quote].match(text, i)
                    i = m.end() if m is not None else i + 1
                continue
            if ch in "\"'":
                if _may_grow(text, i, ch, cur.final):
                    break                           # a string, or a triple-quoted one
                self._triple = text.startswith(ch * 3, i)
                self._quote = ch
                i += 3 if self._triple else 1
            elif ch in "([{":
                self._stack.append(ch)
                i += 1
            elif ch in ")]}":
                if not self._stack:
                    self._i = i
                    return i
                self._stack.pop()
                i += 1
            elif ch == "," and not self._stack:
                self._i = i
                return i
            else:
                m = _PLAIN.match(text, i)
                i = m.end() if m is not None else i + 1
        self._i = i
        return -1 if cur.final else None
