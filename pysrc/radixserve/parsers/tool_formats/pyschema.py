"""The grammar (xgrammar EBNF) of Python keyword arguments that follow a JSON schema: what the
pythonic format forces a call's `name(` ... `)` to hold.

kwargs_grammar(parameters) -> EBNF whose root is `key=value` pairs separated by ", " (the space
optional), one per property in the schema's order, the required ones always, the others when the
model chooses; values are Python literals (pyliteral.literal_value reads them back):
  string   a double-quoted literal (JSON's escapes but \\/), minLength / maxLength honoured
  integer / number   JSON's number syntax; boolean True / False; null None
  array    [items, ...] with minItems / maxItems; object  {"key": value, ...} by its properties
  enum / const   exactly those values; anyOf / oneOf and type lists: any of them
  $ref     #/$defs/... and #/definitions/... of the parameters schema (recursion allowed)
Anything else (no type, pattern, format, numeric bounds, additionalProperties) is not
constrained beyond "a literal of that type". A property name that is not a Python identifier
cannot be a keyword argument: ValueError.
"""
from __future__ import annotations

import json
import keyword
from typing import Any, Dict, List, Optional, Tuple

from radixserve.parsers.tool_formats.pyliteral import py_literal

BASE_RULES = r'''
py_sep ::= "," " "?
py_char ::= [^"\\\r\n] | "\\" py_escape
py_escape ::= ["\\bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F]
py_str ::= "\"" py_char* "\""
py_int ::= "-"? ("0" | [1-9] [0-9]*)
py_num ::= py_int ("." [0-9]+)? ([eE] [+-]? [0-9]+)?
py_bool ::= "True" | "False"
py_none ::= "None"
py_list ::= "[" (py_any (py_sep py_any)*)? "]"
py_dict ::= "{" (py_str ": " py_any (py_sep py_str ": " py_any)*)? "}"
py_any ::= py_str | py_num | py_bool | py_none | py_list | py_dict
py_ident ::= [A-Za-z_] [A-Za-z0-9_]*
py_kwargs ::= (py_ident "=" py_any (py_sep py_ident "=" py_any)*)?
'''
_TYPES = {"string": "py_str", "integer": "py_int", "number": "py_num", "boolean": "py_bool",
          "null": "py_none"}


def ebnf_literal(s: str) -> str:
    """s as an EBNF string literal."""
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") \
        .replace("\r", "\\r").replace("\t", "\\t") + '"'


def is_identifier(name: str) -> bool:
    return name.isidentifier() and not keyword.iskeyword(name) and name.isascii()


class _Builder:
    def __init__(self, root: dict):
        self.root = root
        self.rules: Dict[str, str] = {}
        self.refs: Dict[str, str] = {}

    def rule(self, body: str) -> str:
        name = f"s{len(self.rules)}"
        self.rules[name] = body
        return name

    def value(self, schema: Any) -> str:
        """The rule (or inline expression) of a Python literal that follows schema."""
        if not isinstance(schema, dict):
            return "py_any"
        if isinstance(schema.get("$ref"), str):
            return self._ref(schema["$ref"])
        if "const" in schema:
            return ebnf_literal(py_literal(schema["const"]))
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return self.rule(" | ".join(ebnf_literal(py_literal(v)) for v in schema["enum"]))
        for key in ("anyOf", "oneOf"):
            subs = schema.get(key)
            if isinstance(subs, list) and subs:
                return self.rule(" | ".join(self.value(s) for s in subs))
        all_of = schema.get("allOf")
        if isinstance(all_of, list) and len(all_of) == 1:
            return self.value(all_of[0])
        t = schema.get("type")
        if isinstance(t, list) and t:
            return self.rule(" | ".join(self.value({**schema, "type": x}) for x in t))
        if t is None:
            t = "object" if "properties" in schema else "array" if "items" in schema else None
        if t == "string":
            return self._string(schema)
        if t == "array":
            return self._array(schema)
        if t == "object":
            return self._object(schema)
        return _TYPES.get(t, "py_any")

    def _ref(self, ref: str) -> str:
        if ref not in self.refs:
            target: Any = None
            for prefix in ("#/$defs/", "#/definitions/"):
                if ref.startswith(prefix):
                    target = (self.root.get(prefix[2:-1]) or {}).get(ref[len(prefix):])
            if target is None:
                return "py_any"
            name = self.refs[ref] = self.rule("")          # named first: it may recurse
            self.rules[name] = self.value(target)
        return self.refs[ref]

    def _string(self, schema: dict) -> str:
        lo, hi = _bound(schema.get("minLength")), _bound(schema.get("maxLength"))
        if lo is None and hi is None:
            return "py_str"
        return self.rule(f'"\\"" py_char{_repeat(lo or 0, hi)} "\\""')

    def _array(self, schema: dict) -> str:
        item = self.value(schema.get("items", {}))
        lo, hi = _bound(schema.get("minItems")) or 0, _bound(schema.get("maxItems"))
        if hi == 0:
            return ebnf_literal("[]")
        more = f"(py_sep {item}){_repeat(max(lo - 1, 0), None if hi is None else hi - 1)}"
        some = f'"[" {item} {more} "]"'
        return self.rule(some if lo > 0 else f'"[" "]" | {some}')

    def _object(self, schema: dict) -> str:
        props = schema.get("properties")
        if not isinstance(props, dict) or not props:
            return "py_dict"
        required = set(schema.get("required") or [])
        items = [(f'{ebnf_literal(json.dumps(k))} ": " {self.value(v)}', k in required)
                 for k, v in props.items()]
        return self.rule(f'"{{" {self.sequence(items)} "}}"')

    def sequence(self, items: List[Tuple[str, bool]]) -> str:
        """items in order, separated by py_sep, each (expression, required): the required
        ones always, the others optionally."""
        first, rest = '""', '""'                 # rules for items[i:] with no item before / some
        for expr, req in reversed(items):
            more = self.rule(f"py_sep {expr} {rest}" + ("" if req else f" | {rest}"))
            first = self.rule(f"{expr} {rest}" + ("" if req else f" | {first}"))
            rest = more
        return first


def _bound(v: Any) -> Optional[int]:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _repeat(lo: int, hi: Optional[int]) -> str:
    return f"{{{lo},}}" if hi is None else f"{{{lo},{max(hi, lo)}}}"


def kwargs_grammar(parameters: Any) -> str:
    """The EBNF of `name(` ... `)`'s inside for a function with these parameters."""
    b = _Builder(parameters if isinstance(parameters, dict) else {})
    props = parameters.get("properties") if isinstance(parameters, dict) else None
    if not isinstance(props, dict) or not props:
        root = "py_kwargs"
    else:
        for key in props:
            if not is_identifier(key):
                raise ValueError(f"parameter {key!r} is not a Python identifier")
        required = set(parameters.get("required") or [])
        root = b.sequence([(f'{ebnf_literal(key + "=")} {b.value(v)}', key in required)
                           for key, v in props.items()])
    rules = "\n".join(f"{name} ::= {body}" for name, body in b.rules.items())
    return f"root ::= {root}\n{rules}\n{BASE_RULES}"
