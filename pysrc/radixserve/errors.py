"""The errors a request can cause, for every layer: the ground floor of the import layers
(tests/unit/test_import_layers.py), so the engine, the grammar backend, the parsers, the offline
Engine, the frontend language and the server all raise and catch the same types.

  RequestError      a request the engine refuses, naming the field to change (a ValueError;
                    the server answers it with a 400)
  EngineOverloaded  the waiting queue is full: refused before it started (a 503 + Retry-After)
  ApiError          an error with its HTTP status, a message that says what to change, and the
                    offending request field; `body()` is the OpenAI-style error body every route
                    returns (server/jsonio.error_response renders it):

    {"error": {"message": ..., "type": ..., "param": <field or null>, "code": <status>}}
"""
from __future__ import annotations

from typing import Optional

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
    """A request the engine refuses, naming the field to change (param): a 400 upstream."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


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
