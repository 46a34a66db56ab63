"""The SageMaker entry points vLLM serves: GET/POST /ping (the container's health check) and
POST /invocations (every inference request of a SageMaker endpoint arrives here).

/invocations picks the route a body is meant for by its keys, in this order (the first
match wins), and hands the request to that route unchanged, so it answers exactly as the
route would, errors included:

    "messages"               -> /v1/chat/completions
    "prompt"                 -> /v1/completions
    "input"                  -> /v1/embeddings        (a --is-embedding server)
    "documents"              -> /v1/rerank            (a --is-embedding server)
    "text" or "input_ids"    -> /generate              (SGLang's native request)

A body with none of these keys gets a 400 that lists them. /ping answers as /health does
(200 while the engine runs, 503 once it died or drains).
"""
from __future__ import annotations

from typing import Awaitable, Callable, Dict, List, Tuple

from starlette.requests import Request
from starlette.responses import Response

from radixserve.errors import bad_request
from radixserve.server import native_api, openai_api
from radixserve.server.security import read_json_object

Handler = Callable[[Request, object], Awaitable[Response]]

INVOCATION_KEYS: List[Tuple[Tuple[str, ...], str]] = [
    (("messages",), "/v1/chat/completions"),
    (("prompt",), "/v1/completions"),
    (("input",), "/v1/embeddings"),
    (("documents",), "/v1/rerank"),
    (("text", "input_ids"), "/generate"),
]
"""(the body keys that select a route, its path), first match first."""


def pick_route(body: Dict[str, object], handlers: Dict[str, Handler]) -> Tuple[str, Handler]:
    """(path, handler) of the first INVOCATION_KEYS route whose keys the body carries; a 400
    listing every route's keys when none does."""
    for keys, path in INVOCATION_KEYS:
        if any(k in body for k in keys):
            return path, handlers[path]
    expected = "; ".join(f"{' or '.join(repr(k) for k in keys)} for {path}"
                         for keys, path in INVOCATION_KEYS)
    raise bad_request(f"/invocations cannot tell which route this body is for: send {expected}")


def invocations_handler(handlers: Dict[str, Handler]) -> Handler:
    """The /invocations handler over the app's route handlers (path -> handler; each path of
    INVOCATION_KEYS must be there), so a body is answered exactly as its route answers it,
    the route's gates included (generation routes refuse on a --is-embedding server, the
    embedding routes without it)."""
    missing = [path for _, path in INVOCATION_KEYS if path not in handlers]
    if missing:
        raise ValueError(f"invocations_handler: no handler for {missing}")
    handlers = dict(handlers)

    async def invocations(request: Request, engine) -> Response:
        body = await read_json_object(request)   # the chosen route reads the cached body again
        _, handler = pick_route(body, handlers)
        return await handler(request, engine)
    return invocations


async def ping(request: Request, engine) -> Response:
    return await native_api.health(request, engine)
