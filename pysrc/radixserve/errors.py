"""The errors a request can cause, for every layer: the ground floor of the import layers
(tests/unit/test_import_layers.py), so the engine, the grammar backend, the parsers, the offline
Engine, the frontend language and the server all raise and catch the same types.

  RequestError      a request the engine refuses, naming the field to change as data (param;
                    a ValueError; the server answers it with a 400, param renamed to the
                    client's field: RequestError.named)
  EngineOverloaded  the waiting queue is full: refused before it started (a 503 + Retry-After)
  ApiError          an error with its HTTP status, a message that says what to change, and the
                    offending request field; `body()` is the OpenAI-style error body every route
                    returns (server/jsonio.error_response renders it):

    {"error": {"message": ..., "type": ..., "param": <field or null>, "code": <status>}}

and the words every layer's messages share for what a client sent (describe, fmt_number).
"""
from __future__ import annotations

from typing import Any, Optional, Union

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    421: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class RequestError(ValueError):
    """A request the engine refuses, naming the field to change (param): a 400 upstream. A
    message about one field starts with its name (param), so a caller that knows the field by
    another name (the client's: max_tokens for max_new_tokens, sampling_params[1].seed) says
    it with `named`; param is never read back out of the message."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param

    @property
    def message(self) -> str:
        return str(self)

    def named(self, name: str) -> str:
        """The message with its field called `name` (the message unchanged without param)."""
        text = str(self)
        if self.param and text.startswith(self.param):
            return name + text[len(self.param):]
        return text


class EngineOverloaded(Exception):
    """The waiting queue is full: the request was refused before it started (a 503 with
    Retry-After upstream); nothing changed in the engine."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ApiError(Exception):
    """An error the client caused (4xx) or must be told about (5xx). Never crashes the loop:
    the route wrapper in server/app.py turns it into `error_response(...)`."""

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None,
                 type: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.headers = headers           # extra response headers (Retry-After on a 503)
        self.message = message
        self.status = status
        self.param = param
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500
                                       else "internal_server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.status}}


def bad_request(message: str, param: Optional[str] = None) -> ApiError:
    return ApiError(message, 400, param)


# --------------------------------------------------------------------------- message words

def short(v: Any, limit: int = 40) -> str:
    r = repr(v)
    return r if len(r) <= limit else r[:limit] + "..."


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object"}.get(type(v), type(v).__name__)


def describe(v: Any) -> str:
    """What a client sent, for "..., got <this>"."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return f"the number {short(v)}"
    if isinstance(v, str):
        return "an empty string" if not v else f"the string {short(v)}"
    if isinstance(v, list):
        if not v:
            return "an empty array"
        kinds = sorted({_kind(x) for x in v[:100]})
        return f"an array of {len(v)} item{'s' * (len(v) != 1)} ({', '.join(kinds)})"
    return "an object" if isinstance(v, dict) else _kind(v)


def fmt_number(x: Union[int, float]) -> str:
    """A bound or a value as the client would write it (long integers cut short)."""
    if isinstance(x, int):
        text = str(x)
        return text if len(text) <= 40 else text[:40] + "..."
    return f"{x:g}" if float(f"{x:g}") == x else repr(x)


def is_number(v: Any) -> bool:
    """An int or a float, not a bool (JSON's true is not 1)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)
