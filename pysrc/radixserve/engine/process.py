"""The engine in a process of its own (--engine-process): the child's side and the wire
between it and its client (client.EngineClient, in the server's process).

Why: in one process the event loop's HTTP work (parsing, rendering, SSE, socket writes) and
the engine (scheduling, the step pipeline, the forward worker's launches) share one GIL, and
at a hundred streamed tokens a step the HTTP half alone takes longer than an FP8 step on an
H100 (bench/host_cost.py; bench/results/h100-2026-12-07-late.md). With the engine here, the
server's process keeps HTTP, and this one keeps the model, the scheduler and the
detokenizers, SGLang's and vLLM's split.

The wire is one duplex multiprocessing.Pipe (a Unix socket pair; pickled tuples, first item
the kind):

  client -> engine                       engine -> client
  ("submit", GenerateReqInput)           ("ready", facts)          once, after loading
  ("abort", rid, message)                ("failed", error)         loading failed; exits 1
  ("call", call_id, name, args)          ("out", [GenerateOutput, ...], waiting)
  ("stop",)                              ("refused", rid, error)   submit raised
                                         ("ret", call_id, error, value)
                                         ("fatal", error)          the engine's loop died

`out` carries every output the engine produced since the last one (one message a step, not
one a token; each as pack_output's tuple) and the waiting queue's length then. An `error` is
error_payload(e): (kind, message, param), rebuilt on the other side by error_from_payload. A
submit was validated by the client (EngineSurface.validate, the same code and facts), so the
engine does not walk it again. The engine stops on ("stop",) or when the client's end of the
pipe closes (the server died), aborting what still runs.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import operator
import signal
import socket
import sys
from typing import Any, Dict, List, Optional, Tuple

from radixserve.engine.io import GenerateOutput, GenerateReqInput
from radixserve.errors import EngineOverloaded, RequestError

logger = logging.getLogger(__name__)

# the calls a client may make (EngineHost._call)
CALLS = ("metrics", "server_info", "flush_cache", "compile_grammar", "drain")

# bytes of socket buffer each way: a step's outputs at a few hundred rows are tens of KB, so
# the engine's send does not wait on the server unless the server has fallen far behind
SOCKET_BUFFER_BYTES = 4 << 20

ErrorPayload = Tuple[str, str, Optional[str]]

# A GenerateOutput crosses as the tuple of its fields in declaration order (pack_output; the
# client rebuilds it with GenerateOutput(*fields)): 2.5x faster to pickle than the dataclass
# and 3x faster to read back (64 outputs: 33 against 80 us, 41 against 119 us)
OUTPUT_FIELDS = tuple(f.name for f in dataclasses.fields(GenerateOutput))
pack_output = operator.attrgetter(*OUTPUT_FIELDS)


def error_payload(e: BaseException) -> ErrorPayload:
    """(kind, message, param) of an exception, for the other side of the pipe: kind is
    "request" (RequestError: a 400 naming param), "value" (any other ValueError: a 400),
    "overloaded" (EngineOverloaded) or "runtime" (anything else, named by its type)."""
    if isinstance(e, RequestError):
        return "request", str(e), e.param
    if isinstance(e, ValueError):
        return "value", str(e), None
    if isinstance(e, EngineOverloaded):
        return "overloaded", str(e), None
    return "runtime", f"{type(e).__name__}: {e}", None


def error_from_payload(payload: ErrorPayload) -> Exception:
    """The exception error_payload described (a RuntimeError for "runtime")."""
    kind, message, param = payload
    if kind == "request":
        return RequestError(message, param=param)
    if kind == "value":
        return ValueError(message)
    if kind == "overloaded":
        return EngineOverloaded(message)
    return RuntimeError(message)


def widen_socket_buffers(conn: Any) -> None:
    """Raise the send and receive buffers of a Pipe end (a Unix socket) to
    SOCKET_BUFFER_BYTES; anything else (a platform without socket pairs) is left as it is."""
    try:
        sock = socket.socket(fileno=conn.fileno())
    except OSError:
        return
    try:
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)
    except OSError:
        pass
    finally:
        sock.detach()              # the fd stays the Connection's


def engine_facts(engine: Any) -> Dict[str, Any]:
    """What the client needs of a loaded engine to validate requests and answer the routes that
    do not run the model (EngineClient copies these onto itself)."""
    return {"max_total_tokens": engine.max_total_tokens, "context_len": engine.context_len,
            "served_model_name": engine.served_model_name, "model_path": engine.model_path,
            "pooling_method": engine.pooling_method, "rerank_labels": engine.rerank_labels,
            "rerank_unavailable": engine.rerank_unavailable,
            "lm_head_loaded": engine.lm_head_loaded, "server_info": engine.server_info()}


class EngineHost:
    """Serves one AsyncEngine (started here) to the client at the other end of `conn`, on the
    running loop, until ("stop",) or the pipe closes. Loop thread only."""

    def __init__(self, engine: Any, conn: Any):
        self.engine = engine
        self.conn = conn
        self._outbox: List[GenerateOutput] = []
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._stopped: Optional[asyncio.Future] = None
        self._tasks: set = set()
        self._broken = False                # the pipe failed: nothing more is sent

    async def run(self) -> int:
        """Start the engine, say ready, serve; then shut the engine down (live requests end
        aborted, their last outputs sent). 0, or 1 when the engine's loop died."""
        loop = self._loop = asyncio.get_running_loop()
        self._stopped = loop.create_future()
        self.engine.on_fatal = self._fatal
        self.engine.start()
        self._send(("ready", engine_facts(self.engine)))
        fd = self.conn.fileno()
        loop.add_reader(fd, self._on_readable)
        try:
            await self._stopped
        finally:
            loop.remove_reader(fd)
            for task in list(self._tasks):
                task.cancel()
            await self.engine.shutdown()
            self._flush()
        return 0 if self.engine.loop_error is None else 1

    # ------------------------------------------------------------------ receiving
    def _on_readable(self) -> None:
        try:
            while self.conn.poll():
                self._handle(self.conn.recv())
        except (EOFError, OSError):         # the server's end closed: it stopped or died
            self._broken = True
            self._stop()

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "submit":
            req: GenerateReqInput = msg[1]
            if req.sampling_params.grammar_key is None:
                try:
                    self.engine.submit_nowait(req, self._sink)
                except Exception as e:  # noqa: BLE001 - refused: the client raises it
                    self._send(("refused", req.rid, error_payload(e)))
            else:
                self._spawn(self._submit_compiled(req))
        elif kind == "abort":
            self.engine.abort(msg[1], msg[2])
        elif kind == "call":
            self._spawn(self._call(msg[1], msg[2], msg[3]))
        elif kind == "stop":
            self._stop()
        else:
            logger.error("engine process: unknown message kind %r ignored", kind)

    def _spawn(self, coro) -> None:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _submit_compiled(self, req: GenerateReqInput) -> None:
        try:
            await self.engine.submit(req, self._sink)
        except Exception as e:  # noqa: BLE001 - a grammar that does not compile, an rid in use
            self._send(("refused", req.rid, error_payload(e)))

    async def _call(self, call_id: int, name: str, args: tuple) -> None:
        engine = self.engine
        try:
            if name == "metrics":
                value = engine.metrics()
            elif name == "server_info":
                value = engine.server_info()
            elif name == "flush_cache":
                value = await engine.flush_cache()
            elif name == "compile_grammar":
                await engine.grammars.compile_async(args[0])
                value = None
            elif name == "drain":
                await engine.drain(args[0])
                value = None
            else:
                raise ValueError(f"unknown engine call {name!r}; known: {', '.join(CALLS)}")
        except Exception as e:  # noqa: BLE001 - the caller raises it
            self._send(("ret", call_id, error_payload(e), None))
            return
        self._flush()                # outputs produced meanwhile go first
        self._send(("ret", call_id, None, value))

    # ------------------------------------------------------------------ sending
    def _sink(self, out: GenerateOutput) -> None:
        """Every request's sink: outputs wait in the outbox until the loop finishes what it is
        doing (a step's results), then go in one message."""
        if not self._outbox:
            self._loop.call_soon(self._flush)
        self._outbox.append(out)

    def _flush(self) -> None:
        if not self._outbox:
            return
        outs, self._outbox = self._outbox, []
        self._send(("out", [pack_output(o) for o in outs], self.engine.waiting_count()))

    def _send(self, msg: tuple) -> None:
        if self._broken:
            return
        try:
            self.conn.send(msg)
        except (OSError, EOFError):         # the server is gone (BrokenPipeError among them)
            self._broken = True
            self._stop()

    def _fatal(self, error: BaseException) -> None:
        self._flush()               # the aborted requests' last outputs, first
        self._send(("fatal", error_payload(error)))
        self._stop()

    def _stop(self) -> None:
        if self._stopped is not None and not self._stopped.done():
            self._stopped.set_result(None)


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:       # pragma: no cover - uvloop is a dependency
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


async def _serve(server_args: Any, conn: Any) -> int:
    from radixserve.engine.async_engine import AsyncEngine

    try:
        engine = AsyncEngine(server_args)
    except BaseException as e:       # noqa: BLE001 - said to the client, which raises it
        logger.exception("the engine process could not load the engine")
        try:
            conn.send(("failed", error_payload(e)))
        except (OSError, EOFError):
            pass
        return 1
    return await EngineHost(engine, conn).run()


def engine_main(server_args: Any, conn: Any, log_config: Tuple[int, str, Optional[str]]) -> None:
    """The engine process's entry point (client.EngineClient spawns it): ignore SIGINT and
    SIGTERM (the server stops it), log as the server does (log_config: level, format, date
    format), load the engine, serve it on a uvloop loop of its own until told to stop or the
    pipe closes. Exits 0, or 1 when loading failed or the loop died."""
    # Ctrl-C and a supervisor's SIGTERM reach the whole process group: the server drains, then
    # stops this process over the pipe (or this one stops at the pipe's end if the server died)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    level, fmt, datefmt = log_config
    logging.basicConfig(level=level, format=fmt, datefmt=datefmt, force=True)
    widen_socket_buffers(conn)
    loop = _new_loop()
    asyncio.set_event_loop(loop)
    try:
        code = loop.run_until_complete(_serve(server_args, conn))
    finally:
        loop.close()
        conn.close()
    sys.exit(code)
