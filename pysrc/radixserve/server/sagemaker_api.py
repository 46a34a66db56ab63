"""The SageMaker entry points vLLM serves: GET/POST /ping (the container's health check) and
POST /invocations (every inference request of a SageMaker endpoint arrives here).

/invocations picks the route a body is meant for by its keys, in this order (the first
match wins), and hands the request to that route unchanged, so it answers exactly as the
route would, errors included:

    "messages"               -> /v1/chat/completions
    "prompt"                 -> /v1/completions
    "input"                  -> /v1/embeddings        (only where the server has that route)
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

InvocationRoute = Tuple[Tuple[str, ...], str, Handler]
"""(the body keys that select it, its path, its handler)."""

GENERATION_ROUTES: List[InvocationRoute] = [
    (("messages",), "/v1/chat/completions", openai_api.chat_completions),
    (("prompt",), "/v1/completions", openai_api.completions),
    (("text", "input_ids"), "/generate", native_api.generate),
]


def pick_route(body: Dict[str, object], routes: List[InvocationRoute]) -> Tuple[str, Handler]:
    """(path, handler) of the first route whose selecting keys the body carries; a 400 listing
    every route's keys when none does."""
    for keys, path, handler in routes:
        if any(k in body for k in keys):
            return path, handler
    expected = "; ".join(f"{' or '.join(repr(k) for k in keys)} for {path}"
                         for keys, path, _ in routes)
    raise bad_request(f"/invocations cannot tell which route this body is for: send {expected}")


def invocations_handler(routes: List[InvocationRoute]) -> Handler:
    """The /invocations handler over `routes` (create_app's list: GENERATION_ROUTES, with
    ("input",) -> /v1/embeddings ahead of /generate where embeddings are served)."""
    routes = list(routes)

    async def invocations(request: Request, engine) -> Response:
        body = await read_json_object(request)   # the chosen route reads the cached body again
        _, handler = pick_route(body, routes)
        return await handler(request, engine)
    return invocations


async def ping(request: Request, engine) -> Response:
    return await native_api.health(request, engine)
