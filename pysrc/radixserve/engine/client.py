"""EngineClient: the engine as the server sees it when the engine runs in a process of its own
(--engine-process; process.py says why and draws the wire).

It has AsyncEngine's surface for the routes: the facts (server_args, model_config, tokenizer,
context_len, served_model_name, model_path, pooling, max_total_tokens), validate and
check_capacity (EngineSurface: the same code over the same facts, so a bad request is refused
here, before it crosses), generate, abort, flush_cache, drain, shutdown, is_healthy, metrics,
server_info, and grammars.compile_async (the engine compiles, and caches for the request).
There is no `scheduler`: what reads it (the cache dashboard, which --engine-process refuses
in ServerArgs.check; /metrics' KV-event counters) finds none.

Threads: everything on the server's event loop. Loading is blocking (the constructor waits for
the engine process's "ready"); start() then attaches the pipe to the running loop, which
reads a step's outputs in one message and hands each to its request's queue.

metrics() answers with the engine's metrics as of the last refresh_metrics() (the /metrics,
/v1/loads and dashboard handlers refresh first), plus this process's own CPU seconds.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import time
from typing import Any, AsyncIterator, Dict, Optional

from radixserve.config import ModelConfig, ServerArgs
from radixserve.engine.io import GenerateOutput, GenerateReqInput
from radixserve.engine.process import (engine_main, error_from_payload, widen_socket_buffers)
from radixserve.engine.surface import EngineSurface, deliver

logger = logging.getLogger(__name__)

# seconds shutdown waits for the engine process to exit after ("stop",) before killing it
STOP_TIMEOUT_S = 30.0


def _log_config() -> tuple:
    """(level, format, date format) of this process's logging, for the engine process."""
    root = logging.getLogger()
    fmt = datefmt = None
    for handler in root.handlers:
        if handler.formatter is not None:
            fmt, datefmt = handler.formatter._fmt, handler.formatter.datefmt
            break
    return root.getEffectiveLevel(), fmt or logging.BASIC_FORMAT, datefmt


class _RemoteGrammars:
    """engine.grammars as server/generation.check_grammars uses it: compile_async(key), in the
    engine process, whose cache then holds it for the request."""

    def __init__(self, client: "EngineClient"):
        self._client = client

    async def compile_async(self, key) -> None:
        await self._client._call("compile_grammar", key)


class EngineClient(EngineSurface):
    def __init__(self, server_args: ServerArgs):
        """Blocking: resolves the model, spawns the engine process (which loads the weights)
        while this one loads the tokenizer and config, then waits for it to be ready. Raises
        the engine's own error (ValueError for a bad flag or model) when loading fails."""
        from radixserve.engine.async_engine import check_context_length
        from radixserve.model.loader import resolve_model_path
        from radixserve.tokenizer.tokenizer import Tokenizer

        server_args.check()
        self.server_args = server_args
        self.model_path = resolve_model_path(server_args.model_path)
        ctx = multiprocessing.get_context("spawn")       # CUDA: never fork a process that may
        self._conn, child_conn = ctx.Pipe(duplex=True)
        widen_socket_buffers(self._conn)
        child_args = dataclasses.replace(server_args, model_path=self.model_path)
        self._proc = ctx.Process(target=engine_main, name="radixserve-engine",
                                 args=(child_args, child_conn, _log_config()))
        self._proc.start()
        child_conn.close()
        try:
            self.model_config = ModelConfig.from_path(self.model_path)
            self.tokenizer = Tokenizer.from_path(server_args.tokenizer_path or self.model_path)
            chat_template = server_args.resolved_chat_template()
            if chat_template is not None:
                self.tokenizer.set_chat_template(chat_template)
            self.context_len = check_context_length(server_args.context_length,
                                                    self.model_config)
            facts = self._wait_ready()
        except BaseException:
            self._kill()
            raise
        self.context_len = facts["context_len"]
        self.served_model_name = facts["served_model_name"]
        self.pooling_method = facts["pooling_method"]
        self.rerank_labels = facts["rerank_labels"]
        self.rerank_unavailable = facts["rerank_unavailable"]
        self.lm_head_loaded = facts["lm_head_loaded"]
        self._max_total_tokens = facts["max_total_tokens"]
        self._server_info: Dict[str, Any] = facts["server_info"]
        self.grammars = _RemoteGrammars(self)
        self.on_fatal = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._queues: Dict[str, asyncio.Queue] = {}
        self._calls: Dict[int, asyncio.Future] = {}
        self._next_call = 0
        self._waiting = 0            # the engine's waiting queue at its last message
        self._sent_since = 0         # submits sent since that message
        self._metrics: Dict[str, Any] = {}
        self._loop_error: Optional[BaseException] = None
        self._stopping = False
        self._closed = False

    def _wait_ready(self) -> Dict[str, Any]:
        while not self._conn.poll(0.5):
            if not self._proc.is_alive():
                raise RuntimeError(f"the engine process exited with code {self._proc.exitcode} "
                                   f"while loading (its log is above)")
        try:
            msg = self._conn.recv()
        except EOFError:
            self._proc.join(5)
            raise RuntimeError(f"the engine process exited with code {self._proc.exitcode} "
                               f"while loading (its log is above)") from None
        if msg[0] == "failed":
            self._proc.join(5)
            raise error_from_payload(msg[1])
        if msg[0] != "ready":
            raise RuntimeError(f"the engine process said {msg[0]!r} before 'ready'")
        return msg[1]

    def _kill(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join(5)
        self._conn.close()

    # ------------------------------------------------------------------ EngineSurface
    @property
    def max_total_tokens(self) -> int:
        return self._max_total_tokens

    def waiting_count(self) -> int:
        """The engine's waiting queue as it last said, plus what was sent since (an upper
        bound until its next message)."""
        return self._waiting + self._sent_since

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Attach the pipe to the running loop (once)."""
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._conn.fileno(), self._on_readable)

    async def drain(self, timeout_s: float) -> None:
        """AsyncEngine.drain, in the engine process: new requests are refused here at once."""
        self._draining = True
        if self.is_healthy():
            await self._call("drain", timeout_s)

    async def shutdown(self) -> None:
        """Stop the engine process (it aborts what still runs; those requests' last outputs
        arrive first) and wait for it to exit (STOP_TIMEOUT_S, then it is killed)."""
        if self._closed:
            return
        self._stopping = True
        if self._proc.is_alive() and self._loop_error is None:
            self._send(("stop",))
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._proc.join, STOP_TIMEOUT_S)
        if self._proc.is_alive():
            logger.error("the engine process did not stop within %.0f s; killing it",
                         STOP_TIMEOUT_S)
            self._proc.kill()
            await loop.run_in_executor(None, self._proc.join, 5)
        self._on_readable()              # what it said before it exited, then its EOF
        self._close_pipe("the server is shutting down")

    # ------------------------------------------------------------------ requests
    async def generate(self, req: GenerateReqInput,
                       validated: bool = False) -> AsyncIterator[GenerateOutput]:
        """AsyncEngine.generate's contract: outputs of req as the engine process produces
        them; a request it refuses raises (ValueError) before anything is yielded; closing
        the iterator early aborts the request there."""
        if not validated:
            self.validate(req)
        self._check_running()
        if req.rid in self._queues:
            raise ValueError(f"request id {req.rid!r} is already in use; send a unique rid")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[req.rid] = queue
        self._sent_since += 1
        finished = False
        try:
            self._send(("submit", req))
            async for out in deliver(queue, self.server_args.stream_interval):
                finished = out.finished
                yield out
        finally:
            if self._queues.get(req.rid) is queue:
                del self._queues[req.rid]
            if not finished:
                self.abort(req.rid)

    def abort(self, rid: str, message: str = "aborted") -> None:
        """Abort a request in the engine process (no-op for an unknown or finished rid)."""
        if not self._closed and self._loop_error is None:
            self._send(("abort", rid, message))

    async def flush_cache(self) -> bool:
        return await self._call("flush_cache")

    # ------------------------------------------------------------------ introspection
    def server_info(self) -> Dict[str, Any]:
        """The engine's server_info as loaded, with its generation throughput as of the last
        metrics refresh."""
        info = dict(self._server_info)
        if "gen_throughput" in self._metrics:
            info["internal_states"] = [{"last_gen_throughput": self._metrics["gen_throughput"]}]
        return info

    async def refresh_metrics(self) -> None:
        """Fetch the engine's metrics (what metrics() then answers); keeps the last ones when
        the engine cannot answer."""
        if self.is_healthy():
            try:
                self._metrics = await self._call("metrics")
            except RuntimeError:
                pass

    def metrics(self) -> Dict[str, Any]:
        """The engine's metrics as of the last refresh_metrics(), and this process's CPU seconds
        (`server_process_cpu_seconds`: HTTP, rendering, streaming)."""
        m = dict(self._metrics)
        m["server_process_cpu_seconds"] = time.process_time()
        return m

    @property
    def loop_error(self) -> Optional[BaseException]:
        return self._loop_error

    def is_healthy(self) -> bool:
        return (self._loop is not None and not self._closed and self._loop_error is None
                and self._proc.is_alive())

    # ------------------------------------------------------------------ the wire
    def _check_running(self) -> None:
        if self._loop is None:
            raise RuntimeError("EngineClient.start() has not been called")
        if self._loop_error is not None:
            raise RuntimeError(f"the engine's scheduling loop failed: {self._loop_error}")
        if self._closed:
            raise RuntimeError("the engine process has stopped")

    def _send(self, msg: tuple) -> None:
        try:
            self._conn.send(msg)
        except (OSError, EOFError, ValueError) as e:   # ValueError: the pipe is closed
            self._engine_gone(f"the engine process cannot be reached ({type(e).__name__})")
            raise RuntimeError("the engine process has stopped") from None

    async def _call(self, name: str, *args: Any) -> Any:
        """Call `name` (process.CALLS) in the engine process; its exception is raised here."""
        self._check_running()
        call_id = self._next_call
        self._next_call += 1
        fut = self._loop.create_future()
        self._calls[call_id] = fut
        try:
            self._send(("call", call_id, name, args))
            return await fut
        finally:
            self._calls.pop(call_id, None)

    def _on_readable(self) -> None:
        if self._closed:
            return
        try:
            while self._conn.poll():
                self._dispatch(self._conn.recv())
        except (EOFError, OSError):
            code = self._proc.exitcode
            self._engine_gone("the server is shutting down" if self._stopping else
                              f"the engine process exited"
                              f"{'' if code is None else f' with code {code}'}")

    def _dispatch(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "out":
            queues = self._queues
            for fields in msg[1]:              # process.pack_output's tuples
                queue = queues.get(fields[0])  # the rid
                if queue is not None:          # else its consumer has gone already
                    queue.put_nowait(GenerateOutput(*fields))
            self._waiting, self._sent_since = msg[2], 0
        elif kind == "refused":
            queue = self._queues.get(msg[1])
            if queue is not None:
                queue.put_nowait(error_from_payload(msg[2]))
        elif kind == "ret":
            fut = self._calls.get(msg[1])
            if fut is not None and not fut.done():
                if msg[2] is not None:
                    fut.set_exception(error_from_payload(msg[2]))
                else:
                    fut.set_result(msg[3])
        elif kind == "fatal":
            self._loop_error = error_from_payload(msg[1])
            logger.critical("the engine process's loop died: %s", self._loop_error)
            if self.on_fatal is not None:
                self.on_fatal(self._loop_error)
        else:
            logger.error("unknown message kind %r from the engine process ignored", kind)

    def _engine_gone(self, why: str) -> None:
        """The pipe closed: end every live request (finish reason abort), fail every call,
        and, unless the server is stopping, report the engine dead (on_fatal)."""
        if self._closed:
            return
        self._close_pipe(why)
        if not self._stopping and self._loop_error is None:
            self._loop_error = RuntimeError(why)
            logger.critical("%s; the server cannot serve", why)
            if self.on_fatal is not None:
                self.on_fatal(self._loop_error)

    def _close_pipe(self, why: str) -> None:
        if self._closed:
            return
        self._closed = True
        if self._loop is not None:
            try:
                self._loop.remove_reader(self._conn.fileno())
            except (OSError, ValueError):
                pass
        self._conn.close()
        for rid, queue in list(self._queues.items()):
            queue.put_nowait(GenerateOutput(rid, "", [], True, {"type": "abort", "matched": None,
                                                                "message": why}))
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(RuntimeError(why))

