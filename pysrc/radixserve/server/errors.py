"""User-facing errors: ApiError carries an HTTP status, a message that says what to change, and
the offending request field; `error_response` renders the OpenAI-style body every route returns:

    {"error": {"message": ..., "type": ..., "param": <field or null>, "code": <status>}}
"""
from __future__ import annotations

from typing import Optional

from radixserve.server.jsonio import JSONResponse

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


class ApiError(Exception):
    """An error the client caused (4xx) or must be told about (5xx). Never crashes the loop:
    the route wrapper in app.py turns it into `error_response(...)`."""

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


def error_response(err: ApiError, headers: Optional[dict] = None) -> JSONResponse:
    merged = {**(err.headers or {}), **(headers or {})} or None
    return JSONResponse(err.body(), status_code=err.status, headers=merged)
