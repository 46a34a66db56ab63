"""The starlette app over one AsyncEngine, and `serve`: uvicorn and the engine's scheduling task
in ONE process and ONE uvloop event loop (with --engine-process, the engine in a second process
and engine/client.EngineClient in its place here).

The app's lifespan starts the engine (engine.start() creates its scheduling task in the
running loop) and shuts it down. Every request first passes the door (server/security.py:
Host, Origin/CORS, API key, body size); every route then runs inside `_guarded`, which hands it
the engine as the requesting client sees it (security.ClientView: request ownership) and turns
ApiError into its 4xx/5xx body and anything unexpected into a 500 body (logged); the loop keeps
serving either way.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Awaitable, Callable, Optional

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from radixserve.config import ServerArgs
from radixserve.errors import ApiError
from radixserve.server import (anthropic_api, anthropic_render, anthropic_schemas,
                               embeddings_api, native_api, openai_api, openapi, responses_api,
                               sagemaker_api, score_api, tokenize_api)
from radixserve.server import dashboard as dashboard_module
from radixserve.server.jsonio import error_response
from radixserve.server.security import (ClientView, Door, DoorPolicy, ErrorRenderer, RequestOwners,
                                        client_identity, is_loopback_bind)

logger = logging.getLogger(__name__)

Handler = Callable[[Request, object], Awaitable[Response]]

# paths whose every error (the door's, the guard's, 404 / 405) takes another shape than OpenAI's
ERROR_SHAPES = {**{path: anthropic_render.error_response for path in anthropic_schemas.PATHS},
                "/v1/score": score_api.error_response}     # OpenAI's plus SGLang's fields

# Seconds uvicorn gives open connections to close once the engine has drained (SIGTERM). The
# whole shutdown takes --shutdown-timeout plus this (plus well under a second of the engine's
# own), which the default --shutdown-timeout keeps below Kubernetes' default grace period
# (terminationGracePeriodSeconds, 30 s), after which the process would be killed mid-drain.
CONNECTION_CLOSE_S = 5
KUBERNETES_DEFAULT_GRACE_S = 30


def _guarded(handler: Handler, engine,
             errors: ErrorRenderer = error_response) -> Callable[[Request], Awaitable[Response]]:
    """`handler` behind the guard; `errors` renders its error bodies (the Anthropic routes'
    shape differs from OpenAI's)."""
    async def endpoint(request: Request) -> Response:
        try:
            view = ClientView(engine, client_identity(request), request.app.state.request_owners)
            return await handler(request, view)
        except ApiError as e:
            return errors(e, None)
        except RecursionError:   # a structure deep enough to exhaust the stack came from the client
            logger.warning("RecursionError in %s %s", request.method, request.url.path, exc_info=True)
            return errors(ApiError("the request is nested too deeply to process; flatten it", 400), None)
        except Exception as e:  # noqa: BLE001 - nothing a client sends may take the server down
            logger.exception("unhandled error in %s %s", request.method, request.url.path)
            return errors(ApiError(f"internal server error: {type(e).__name__}: {e}", 500), None)
    endpoint.__name__ = handler.__name__
    return endpoint


async def _http_error(request: Request, exc: HTTPException) -> Response:
    if exc.status_code == 404:
        msg = f"no route {request.url.path}; see /v1/models, /v1/chat/completions, /v1/completions, /generate"
    elif exc.status_code == 405:
        msg = f"method {request.method} is not allowed on {request.url.path}"
    else:
        msg = str(exc.detail)
    render = ERROR_SHAPES.get(request.url.path, error_response)
    return render(ApiError(msg, exc.status_code), exc.headers)   # 405: Allow


def create_app(engine, policy: Optional[DoorPolicy] = None) -> Starlette:
    """The ASGI app serving `engine` (an AsyncEngine or anything with its interface) behind
    the door `policy` (default: from engine.server_args)."""
    if policy is None:
        policy = DoorPolicy.from_server_args(engine.server_args)

    def route(path, handler, methods):
        return Route(path, _guarded(handler, engine, ERROR_SHAPES.get(path, error_response)),
                     methods=methods)

    def generating(handler: Handler) -> Handler:
        """A generation route: a 400 on a --is-embedding server (embeddings_api)."""
        async def gated(request: Request, view) -> Response:
            refused = embeddings_api.generation_off(engine)
            if refused is not None:
                raise refused
            return await handler(request, view)
        gated.__name__ = handler.__name__
        return gated

    handlers = {                 # path -> (handler, methods)
        "/v1/chat/completions": (generating(openai_api.chat_completions), ["POST"]),
        "/v1/completions": (generating(openai_api.completions), ["POST"]),
        "/v1/responses": (generating(responses_api.create_response), ["POST"]),
        "/v1/responses/{response_id}": (responses_api.stored_response, ["GET", "DELETE"]),
        "/v1/models": (openai_api.list_models, ["GET"]),
        "/v1/models/{model_id:path}": (openai_api.retrieve_model, ["GET"]),
        "/generate": (generating(native_api.generate), ["POST"]),
        "/v1/score": (generating(score_api.score), ["POST"]),
        "/v1/embeddings": (embeddings_api.embeddings, ["POST"]),
        "/v1/rerank": (embeddings_api.rerank, ["POST"]),
        "/v1/messages": (generating(anthropic_api.messages), ["POST"]),
        "/v1/messages/count_tokens": (anthropic_api.count_tokens, ["POST"]),
        "/tokenize": (tokenize_api.tokenize, ["POST"]),
        "/detokenize": (tokenize_api.detokenize, ["POST"]),
        "/health": (native_api.health, ["GET"]),
        "/health_generate": (native_api.health_generate, ["GET"]),
        "/get_model_info": (native_api.get_model_info, ["GET"]),
        "/get_server_info": (native_api.get_server_info, ["GET"]),
        # the worker surface of SGLang's model gateway (native_api's docstring): its names
        "/model_info": (native_api.get_model_info, ["GET"]),
        "/server_info": (native_api.get_server_info, ["GET"]),
        "/v1/loads": (native_api.get_loads, ["GET"]),
        "/get_load": (native_api.get_load, ["GET"]),
        "/flush_cache": (native_api.flush_cache, ["POST"]),
        "/abort_request": (native_api.abort_request, ["POST"]),
        "/metrics": (native_api.metrics, ["GET"]),
        "/openapi.json": (openapi.openapi_json, ["GET"]),
        # SageMaker's entry points, as vLLM serves them (server/sagemaker_api.py): /invocations
        # hands a body to one of the handlers above, gates included
        "/ping": (sagemaker_api.ping, ["GET", "POST"]),
    }
    handlers["/invocations"] = (sagemaker_api.invocations_handler(
        {path: handler for path, (handler, _) in handlers.items()}), ["POST"])
    routes = [route(path, handler, methods) for path, (handler, methods) in handlers.items()]
    # --enable-dashboard: the cache dashboard and advisor (server/dashboard.py); 404s without
    dashboard = None
    if getattr(engine.server_args, "enable_dashboard", False):
        dashboard = dashboard_module.Dashboard(
            engine, show_text=getattr(engine.server_args, "dashboard_show_text", True))
        routes += [route(path, handler, ["GET"]) for path, handler in dashboard_module.ROUTES]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        engine.start()
        logger.info("engine started in %s", type(asyncio.get_running_loop()).__module__)
        if dashboard is not None:
            dashboard.start()
        try:
            yield
        finally:
            if dashboard is not None:
                await dashboard.stop()
            await engine.shutdown()

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_error},
                    middleware=[Middleware(Door, policy=policy, errors=ERROR_SHAPES)])
    app.state.engine = engine
    app.state.door_policy = policy
    app.state.request_owners = RequestOwners()
    app.state.response_store = responses_api.ResponseStore()     # stored /v1/responses
    app.state.metrics_registry = native_api.metrics_registry(engine)
    app.state.dashboard = dashboard                               # None without the flag
    if dashboard is not None:                 # its own CPU seconds on /metrics
        app.state.metrics_registry.register(dashboard_module.CpuCollector(
            dashboard, app.state.metrics_registry.prefix))
    return app


def serve(server_args: ServerArgs) -> int:
    """Load the engine (blocking), then run uvicorn on a uvloop loop that also runs the
    engine's scheduling task. Returns the process exit status when the server stops: 0 after
    SIGINT / SIGTERM, 1 when the engine's loop died (the server stops itself then, so a
    supervisor watching the process restarts it, instead of a live process answering 503)."""
    if server_args.resolved_engine_process():   # the engine in its own process (engine/process.py)
        from radixserve.engine.client import EngineClient
        engine = EngineClient(server_args)
    else:
        from radixserve.engine.async_engine import AsyncEngine
        engine = AsyncEngine(server_args)
    app = create_app(engine)
    _log_door(server_args, app.state.door_policy)
    # http "auto" is httptools (a dependency) where it imports, else h11: with httptools the
    # loop spends ~8% less time per streamed token (2-core CPU, 128 streams: 52.9 against
    # 57.4 us of loop-thread CPU per token), time the steps share with every stream
    config = uvicorn.Config(
        app, host=server_args.host, port=server_args.port, loop="uvloop",
        log_level=server_args.log_level, access_log=server_args.log_level == "debug",
        timeout_keep_alive=5, timeout_graceful_shutdown=CONNECTION_CLOSE_S,  # after the drain
    )
    server = _Server(config, engine, server_args.shutdown_timeout)

    def on_fatal(error: BaseException) -> None:
        logger.critical("the engine's loop died (%s: %s); stopping the server",
                        type(error).__name__, error)
        server.should_exit = True

    engine.on_fatal = on_fatal
    server.run()
    return 1 if engine.loop_error is not None else 0


def _log_door(server_args: ServerArgs, policy: DoorPolicy) -> None:
    if not policy.requires_key and not is_loopback_bind(server_args.host):
        logger.warning("listening on %s without an API key: anyone who can reach this port can "
                       "use the model; set --api-key or RADIXSERVE_API_KEY", server_args.host)
    clients = sorted(set(policy.client_keys.values()))      # identities, never keys
    logger.info("door: API keys %s; admin key %s; Host check %s; CORS origins %s; max request "
                "body %d bytes",
                f"required ({len(clients)} client{'s' * (len(clients) != 1)}: {', '.join(clients)})"
                if clients else "off", "set" if policy.admin_key else "off",
                "off" if policy.allowed_hosts is None else ", ".join(policy.allowed_hosts)
                + (" (and IP addresses)" if policy.any_ip_host else " (and loopback addresses)"),
                ", ".join(policy.allowed_origins) or "none", policy.max_request_bytes)


class _Server(uvicorn.Server):
    """uvicorn.Server that logs the address it actually listens on (the port may be 0) and
    shuts down gracefully: on SIGINT / SIGTERM the engine drains first (new requests get 503,
    live ones get --shutdown-timeout seconds, then end with finish reason "abort"), so no
    stream is cut mid-body; then uvicorn closes the connections."""

    def __init__(self, config, engine, shutdown_timeout: float):
        super().__init__(config)
        self.engine = engine
        self.model_name = engine.served_model_name
        self.shutdown_timeout = shutdown_timeout

    async def shutdown(self, sockets=None) -> None:
        if self.engine.is_healthy():
            logger.info("shutting down: draining live requests (--shutdown-timeout %.0f s)",
                        self.shutdown_timeout)
            await self.engine.drain(self.shutdown_timeout)
        await super().shutdown(sockets)
        # uvicorn re-raises the signal it caught once it is done (the process then dies of
        # SIGTERM); a drained server has handled it and exits with serve()'s status instead
        getattr(self, "_captured_signals", []).clear()

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.should_exit:
            return
        for server in self.servers:
            for sock in server.sockets:
                host, port = sock.getsockname()[:2]
                logger.info("radixserve serving %s on http://%s:%d (loop: %s)", self.model_name,
                            host, port, type(asyncio.get_running_loop()).__module__)
