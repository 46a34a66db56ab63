"""The starlette app over one AsyncEngine, and `serve`: uvicorn and the engine's scheduling task
in ONE process and ONE uvloop event loop.

The app's lifespan starts the engine (engine.start() creates its scheduling task in the
running loop) and shuts it down. Every route runs inside `_guarded`: ApiError -> its 4xx/5xx
body, anything unexpected -> a 500 body (logged); the loop keeps serving either way.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Awaitable, Callable

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from radixserve.config import ServerArgs
from radixserve.server import native_api, openai_api
from radixserve.server.errors import ApiError, error_response

logger = logging.getLogger(__name__)

Handler = Callable[[Request, object], Awaitable[Response]]


def _guarded(handler: Handler, engine) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request, engine)
        except ApiError as e:
            return error_response(e)
        except Exception as e:  # noqa: BLE001 - nothing a client sends may take the server down
            logger.exception("unhandled error in %s %s", request.method, request.url.path)
            return error_response(ApiError(f"internal server error: {type(e).__name__}: {e}", 500))
    endpoint.__name__ = handler.__name__
    return endpoint


async def _http_error(request: Request, exc: HTTPException) -> Response:
    if exc.status_code == 404:
        msg = f"no route {request.url.path}; see /v1/models, /v1/chat/completions, /v1/completions, /generate"
    elif exc.status_code == 405:
        msg = f"method {request.method} is not allowed on {request.url.path}"
    else:
        msg = str(exc.detail)
    return error_response(ApiError(msg, exc.status_code))


def create_app(engine) -> Starlette:
    """The ASGI app serving `engine` (an AsyncEngine or anything with its interface)."""
    def route(path, handler, methods):
        return Route(path, _guarded(handler, engine), methods=methods)

    routes = [
        route("/v1/chat/completions", openai_api.chat_completions, ["POST"]),
        route("/v1/completions", openai_api.completions, ["POST"]),
        route("/v1/models", openai_api.list_models, ["GET"]),
        route("/generate", native_api.generate, ["POST"]),
        route("/health", native_api.health, ["GET"]),
        route("/health_generate", native_api.health_generate, ["GET"]),
        route("/get_model_info", native_api.get_model_info, ["GET"]),
        route("/get_server_info", native_api.get_server_info, ["GET"]),
        route("/flush_cache", native_api.flush_cache, ["POST", "GET"]),
        route("/abort_request", native_api.abort_request, ["POST"]),
        route("/metrics", native_api.metrics, ["GET"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        engine.start()
        logger.info("engine started in %s", type(asyncio.get_running_loop()).__module__)
        try:
            yield
        finally:
            await engine.shutdown()

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_error})
    app.state.engine = engine
    app.state.metrics_registry = native_api.metrics_registry(engine)
    return app


def serve(server_args: ServerArgs) -> None:
    """Load the engine (blocking), then run uvicorn on a uvloop loop that also runs the
    engine's scheduling task. Returns when the server is stopped (SIGINT / SIGTERM)."""
    from radixserve.engine.async_engine import AsyncEngine

    engine = AsyncEngine(server_args)
    app = create_app(engine)
    config = uvicorn.Config(
        app, host=server_args.host, port=server_args.port, loop="uvloop",
        log_level=server_args.log_level, access_log=server_args.log_level == "debug",
        timeout_keep_alive=5, timeout_graceful_shutdown=5,
    )
    _Server(config, engine.served_model_name).run()


class _Server(uvicorn.Server):
    """uvicorn.Server that logs the address it actually listens on (the port may be 0)."""

    def __init__(self, config, model_name: str):
        super().__init__(config)
        self.model_name = model_name

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.should_exit:
            return
        for server in self.servers:
            for sock in server.sockets:
                host, port = sock.getsockname()[:2]
                logger.info("radixserve serving %s on http://%s:%d (loop: %s)", self.model_name,
                            host, port, type(asyncio.get_running_loop()).__module__)
