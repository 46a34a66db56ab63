"""JSON in and out of the server, through orjson.

`dumps` serializes every JSON response body and SSE event and never raises for a value the
server builds (a lone surrogate or an integer beyond 64 bits falls back to the standard
library, which escapes the first and writes the second). `loads_request` parses a request body
under the rules the door promises (see security.read_json_object): UTF-8, no NaN/Infinity, no
lone UTF-16 surrogates anywhere (named by their field), nesting at most MAX_JSON_DEPTH.
`error_response` renders a radixserve.errors.ApiError as the error body every route returns.
"""
from __future__ import annotations

import json
import logging
import math
from typing import Any, List, Optional, Tuple

from starlette.responses import JSONResponse as _StarletteJSONResponse

from radixserve.errors import ApiError

try:
    import orjson
except ImportError as e:  # pragma: no cover - orjson is a declared dependency (setup.py)
    raise ImportError("radixserve's HTTP server needs orjson: `pip install orjson` "
                      "(or reinstall radixserve, which depends on it)") from e

logger = logging.getLogger(__name__)

# Deeper bodies are refused with a 400. Chat templates, grammar compilation and error paths
# walk request structures recursively; 64 levels is far beyond any real request (tool schemas
# included) and far below Python's recursion limit.
MAX_JSON_DEPTH = 64

_DUMPS_OPTIONS = orjson.OPT_NON_STR_KEYS


def _default(obj: Any) -> Any:
    """What orjson does not serialize natively: NamedTuples (as arrays), numpy / torch scalars
    and arrays (as numbers / lists)."""
    if isinstance(obj, tuple):
        return list(obj)
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def dumps(obj: Any) -> bytes:
    """Compact UTF-8 JSON (non-ASCII kept verbatim; NaN and infinities written as null)."""
    try:
        return orjson.dumps(obj, default=_default, option=_DUMPS_OPTIONS)
    except TypeError as first:  # orjson.JSONEncodeError is a TypeError
        # a lone surrogate (written as a \\udXXX escape) or an int beyond 64 bits
        logger.debug("orjson could not serialize a response (%s); using json", first)
        return json.dumps(obj, default=_default, ensure_ascii=True,
                          separators=(",", ":")).encode("ascii")


class JSONResponse(_StarletteJSONResponse):
    """starlette's JSONResponse, rendered by `dumps`."""

    def render(self, content: Any) -> bytes:
        return dumps(content)


def error_response(err: ApiError, headers: Optional[dict] = None) -> JSONResponse:
    """The OpenAI-style error body of err (radixserve.errors.ApiError) with its status and
    headers (headers given here win)."""
    merged = {**(err.headers or {}), **(headers or {})} or None
    return JSONResponse(err.body(), status_code=err.status, headers=merged)


class JSONInputError(ValueError):
    """A request body the server refuses; `param` names the offending field (or None)."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.message = message
        self.param = param


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def _path(parent: str, key: Any) -> str:
    if isinstance(key, int):
        return f"{parent}[{key}]"
    key = _printable(key)
    return f"{parent}.{key}" if parent else key


def _printable(s: str) -> str:
    """s with lone surrogates written as \\udXXX escapes (safe to put in an error body)."""
    return s.encode("utf-8", "backslashreplace").decode("utf-8")


def _has_lone_surrogate(s: str) -> bool:
    if s.isascii():
        return False
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def check_structure(obj: Any, check_strings: bool) -> None:
    """Raise JSONInputError if `obj` nests deeper than MAX_JSON_DEPTH or (with
    `check_strings`) holds a string or key with a lone surrogate. Iterative: no recursion."""
    stack: List[Tuple[Any, str, int]] = [(obj, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, dict):
            items = value.items()
        elif isinstance(value, list):
            items = enumerate(value)
        else:
            if check_strings and isinstance(value, str) and _has_lone_surrogate(value):
                raise _surrogate_error(path)
            continue
        if depth > MAX_JSON_DEPTH:
            raise JSONInputError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels "
                                 f"(at {path or 'the top level'}); flatten it", param=path or None)
        for key, item in items:
            if check_strings and isinstance(key, str) and _has_lone_surrogate(key):
                raise JSONInputError(f"a key of {path or 'the request body'} ({_printable(key)!r}) "
                                     "contains a lone UTF-16 surrogate; send valid Unicode",
                                     param=path or None)
            if isinstance(item, (dict, list)) or (check_strings and isinstance(item, str)):
                stack.append((item, _path(path, key), depth + 1))


def _surrogate_error(path: str) -> JSONInputError:
    where = path or "the request body"
    return JSONInputError(f"{where} contains a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
                          "escape); send valid Unicode text", param=path or None)


def loads_request(raw: bytes) -> Any:
    """Parse a request body. orjson first; what it refuses is parsed again by the standard
    library, to name the field holding a lone surrogate or to report the syntax error the way
    clients already know (line and column). Raises JSONInputError."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    else:
        check_structure(obj, check_strings=False)   # orjson refuses lone surrogates itself
        return obj
    try:
        obj = json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        raise JSONInputError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels; "
                             "flatten it") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise JSONInputError(f"the request body is not valid JSON ({e}); send a JSON object") from None
    check_structure(obj, check_strings=True)
    return obj
