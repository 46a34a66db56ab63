"""AsyncEngine: the one object the server (and the offline Engine) talks to.

Threads. Everything runs on the event-loop thread except the steps themselves:
  * loop thread: the Scheduler (queues, requests, KV free list, host ReqToToken rows, prefix
    cache), detokenizers, output queues; the step pipeline (engine/pipeline.py) runs here;
  * forward worker (one thread): ModelRunner.launch(step_input): on the CPU it computes the step,
    on CUDA it enqueues it on the compute stream and returns. It touches only the StepInput, the
    weights and the runner's device state; it never sees a Req;
  * waiter (one thread, CUDA): PendingStep.wait(), the one blocking event wait per step.
Both belong to the pipeline's executor (engine/pipeline.ThreadedExecutor), given to the
Scheduler (and so to its pipeline) once, at construction.
With overlap the loop processes step N-1 and builds step N+1 while the worker (CPU) or the GPU
runs step N. Slots freed while a step is in flight are safe to hand out again: the step that
uses them next runs after it, in stream (or worker) order. The loop sleeps on an asyncio.Event
when there is no work (no busy polling). If the loop itself ever dies, the engine reports
unhealthy and calls on_fatal (the server then exits non-zero so a supervisor restarts it).
"""
from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
import sys
from typing import Any, AsyncIterator, Callable, Dict, Optional, Tuple

from radixserve import knobs
from radixserve.config import ModelConfig, ServerArgs
from radixserve.constrained import GrammarBackend
from radixserve.engine import validation
from radixserve.engine.io import GenerateOutput, GenerateReqInput
from radixserve.engine.pipeline import ThreadedExecutor
from radixserve.engine.pooling import rerank_label_ids, resolve_pooling_method
from radixserve.engine.req import FinishReason, Req
from radixserve.engine.scheduler import Scheduler
from radixserve.engine.surface import EngineSurface, deliver, merge_outputs  # noqa: F401
from radixserve.engine.thread_cpu import ThreadCPU

logger = logging.getLogger(__name__)


# Allocations between young-generation collections while an engine runs (CPython's default:
# 700). Serving allocates many short-lived objects per token that reference counting frees;
# at 700 the collector still runs thousands of times a run, each tenth of those also collects
# the middle generation, and full collections follow whenever the survivors grew by a quarter:
# each stalls the loop while the device runs out of queued work.
# The knob RADIXSERVE_GC_GEN0 (knobs.py; serve's hidden --debug-gc-gen0) overrides it (700:
# CPython's behaviour, for A/B runs).
GC_GEN0_THRESHOLD = knobs.KNOBS["RADIXSERVE_GC_GEN0"].default     # 50,000


def freeze_startup_objects() -> tuple:
    """Move every object alive now (the model's modules and parameters, the tokenizer, the CUDA
    graphs: start-up's objects, which live as long as the engine) out of the garbage
    collector's scans (gc.freeze), so that the full collections serving triggers walk only
    what serving allocates, and raise the young generation's threshold to GC_GEN0_THRESHOLD.
    Returns the previous thresholds; shutdown restores them and unfreezes. Measured on the
    H200 (offline 256 x 1k/256, bench/results/logs/offline-gc-h200.txt): the freeze took GC
    pauses 0.41-0.58 s of an ~11.7 s run -> 0.19-0.23 s, device idle before decode steps
    0.38-0.53 s -> 0.15-0.18 s; the threshold took the rest, 0.17 s (3 full collections) -> 0,
    which the overlapped loop now mostly hides anyway: the run took 10.97 against 10.99 s
    (logs/offline-step-order-h200.txt). What stays is a loop thread without pauses of tens of
    milliseconds, which streaming requests see as inter-token latency."""
    gc.collect()
    gc.freeze()
    before = gc.get_threshold()
    gen0 = knobs.value("RADIXSERVE_GC_GEN0")
    gc.set_threshold(max(gen0, 1), *before[1:])
    return before


# The interpreter's thread switch interval while an engine runs, in microseconds (CPython's
# default: 5,000). The loop thread (HTTP, detokenizing, streaming, scheduling) and the forward
# worker (a step's uploads and launches) share the GIL. Every time the worker gives the GIL up
# inside a step's launch (a CUDA event recorded, a copy enqueued, a graph replayed: calls that
# release it), a busy loop thread keeps it until the switch interval runs out, so a launch that
# needs a millisecond of the GIL can take several intervals and the device idles meanwhile.
# Measured on an H100 (Llama-3.1-8B shape, random fixed 1024/1024 at 16 req/s, one run each,
# bench/results/h100-2026-12-07-late.md): 5,000 us -> 200 us took the FP8 + FP8 KV server from
# 5,833 to 7,070 output tok/s (mean decode step 15.9 -> 12.5 ms) and bf16 from 6,360 to 6,529.
# The knob RADIXSERVE_SWITCH_INTERVAL_US (knobs.py; serve's hidden --debug-switch-interval-us)
# overrides it (5000: CPython's behaviour, for A/B runs).
SWITCH_INTERVAL_US = knobs.KNOBS["RADIXSERVE_SWITCH_INTERVAL_US"].default     # 200


def shorten_switch_interval() -> float:
    """Set the thread switch interval to the knob's value (at least 1 us); returns the previous
    interval in seconds, which shutdown restores (the interval is the whole process's)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(max(knobs.value("RADIXSERVE_SWITCH_INTERVAL_US"), 1) * 1e-6)
    return before


def check_context_length(requested: Optional[int], model_config: ModelConfig) -> int:
    """--context-length, or by default the model's max_context; ValueError beyond it (the rope
    table has no rows for later positions)."""
    limit = model_config.max_context
    if requested is not None and requested > limit:
        raise ValueError(f"--context-length {requested} exceeds the model's {limit} positions "
                         f"(max_position_embeddings, or what its rope scaling extends it to)")
    return requested or limit


class AsyncEngine(EngineSurface):
    """The engine: model, KV pool, scheduler and their loop (the module's docstring); its request
    validation is EngineSurface's."""

    def __init__(self, server_args: ServerArgs):
        """Blocking: resolves the model, loads tokenizer, config, weights, KV pool, scheduler."""
        from radixserve.model.loader import resolve_model_path
        from radixserve.model.runner import ModelRunner
        from radixserve.tokenizer.tokenizer import Tokenizer

        server_args.check()
        self.server_args = server_args
        self.model_path = resolve_model_path(server_args.model_path)
        self.model_config = ModelConfig.from_path(self.model_path)
        self.tokenizer = Tokenizer.from_path(server_args.tokenizer_path or self.model_path)
        chat_template = server_args.resolved_chat_template()
        if chat_template is not None:                     # --chat-template replaces the model's
            self.tokenizer.set_chat_template(chat_template)
        self.tokenizer.byte_level_pieces()   # built here, not by the first streamed request
        self.served_model_name = (server_args.served_model_name
                                  or os.path.basename(os.path.normpath(self.model_path)))
        self.context_len = check_context_length(server_args.context_length, self.model_config)
        # --is-embedding (engine/pooling.py): /v1/embeddings' pooling, the reranker's yes / no
        # token ids (None, and why in rerank_unavailable, where there are none)
        self.pooling_method: Optional[str] = None
        self.rerank_labels: Optional[Tuple[int, int]] = None
        self.rerank_unavailable: Optional[str] = "the server was started without --is-embedding"
        if server_args.is_embedding:
            self.pooling_method = resolve_pooling_method(server_args.pooling_method,
                                                         self.model_path)
            self.rerank_labels, self.rerank_unavailable = rerank_label_ids(
                self.tokenizer, server_args.resolved_rerank_token_ids(),
                self.model_config.vocab_size)
        self.runner = ModelRunner(server_args, self.model_config, self.model_path,
                                  context_len=self.context_len)
        shards = getattr(self.runner.model, "shards", None) or [self.runner.model]
        # False for a checkpoint without its LM head (--is-embedding loads one): no logits
        self.lm_head_loaded = all(getattr(m, "lm_head_loaded", True) for m in shards)
        if server_args.is_embedding:
            if not self.lm_head_loaded:
                self.rerank_labels = None
                self.rerank_unavailable = ("the checkpoint has no LM head (an embedding model's "
                                           "backbone): /v1/rerank needs a reranker's logits")
            logger.info("serving embeddings (--is-embedding): %s-token pooling; rerank %s",
                        self.pooling_method, f"scores P(yes) over token ids {self.rerank_labels}"
                        if self.rerank_labels else f"off: {self.rerank_unavailable}")
        self.executor = ThreadedExecutor(self.runner)     # the pipeline's: started by start()
        self.scheduler = Scheduler(server_args, self.runner, tokenizer=self.tokenizer,
                                   detokenizer_factory=self._make_detokenizer,
                                   executor=self.executor)
        self.grammars = GrammarBackend(self.tokenizer, self.model_config.vocab_size,
                                       self.scheduler.eos_ids,
                                       cache_size=server_args.grammar_cache_size,
                                       timeout_s=server_args.grammar_compile_timeout)
        self.on_fatal: Optional[Callable[[BaseException], None]] = None
        self._draining = False
        self._wakeup: Optional[asyncio.Event] = None
        self._task: Optional[asyncio.Task] = None
        self._gc_thresholds: Optional[tuple] = None   # set by start(): restored at shutdown
        self._switch_interval: Optional[float] = None  # likewise (seconds)
        self._stopping = False
        self._loop_error: Optional[BaseException] = None
        self._thread_cpu = ThreadCPU()      # loop thread and forward worker, while started

    def _make_detokenizer(self, req: Req):
        from radixserve.tokenizer.detokenizer import IncrementalDetokenizer

        sp = req.sampling_params
        return IncrementalDetokenizer(self.tokenizer, sp.stop_strs, sp.no_stop_trim,
                                      sp.skip_special_tokens, sp.spaces_between_special_tokens,
                                      stop_regexes=sp.stop_regexes)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the scheduling loop; call inside the running event loop (once)."""
        if self._task is not None:
            return
        forward_thread = self.executor.start()
        self._wakeup = asyncio.Event()
        self._stopping = False
        self._thread_cpu.add_current("loop_thread_cpu_seconds")
        self._thread_cpu.add("forward_thread_cpu_seconds", forward_thread)
        self._task = asyncio.get_running_loop().create_task(self._run_loop(),
                                                            name="radixserve-scheduler")
        self._gc_thresholds = freeze_startup_objects()
        self._switch_interval = shorten_switch_interval()

    async def drain(self, timeout_s: float) -> None:
        """Graceful stop, part one: refuse new requests (check_capacity raises), let the live
        ones run for up to timeout_s seconds, then abort the rest ("the server is shutting
        down"), so every stream ends with its finish reason rather than being cut. Returns when
        no request is live. Loop thread."""
        self._draining = True
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.scheduler.reqs and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        live = list(self.scheduler.reqs)
        if live:
            logger.info("shutdown: aborting %d requests still running after %.0f s", len(live),
                        timeout_s)
        for rid in live:
            self.abort(rid, "the server is shutting down")
        while self.scheduler.reqs and self.is_healthy():
            await asyncio.sleep(0.02)

    async def shutdown(self) -> None:
        """Abort every live request, stop the loop, release the worker thread."""
        if self._task is None:
            return
        for rid in list(self.scheduler.reqs):
            self.scheduler.abort(rid, "the server is shutting down")
        self._stopping = True
        self._wakeup.set()
        try:
            await self._task
        except BaseException:   # the loop's own error was logged already
            pass
        self._task = None
        self._thread_cpu.forget()
        self.executor.shutdown()
        close = getattr(self.scheduler.cache, "close", None)
        if close is not None:       # the radix cache's KV-event publisher (--kv-events-config)
            close()
        gc.unfreeze()      # this engine's start-up objects may be collected again
        if self._gc_thresholds is not None:
            gc.set_threshold(*self._gc_thresholds)
            self._gc_thresholds = None
        if self._switch_interval is not None:
            sys.setswitchinterval(self._switch_interval)
            self._switch_interval = None

    async def _run_loop(self) -> None:
        sched = self.scheduler
        pipeline = sched.pipeline
        try:
            while not self._stopping:
                if await pipeline.turn():
                    await asyncio.sleep(0)     # let HTTP handlers and consumers run between turns
                    continue
                if self.server_args.debug_integrity:
                    sched.check_integrity()
                self._wakeup.clear()
                if not sched.has_work():
                    await self._wakeup.wait()
                else:
                    # work exists but nothing fits now (cannot last: admission refuses what can
                    # never fit); wait for a change, briefly
                    try:
                        await asyncio.wait_for(self._wakeup.wait(), 0.05)
                    except asyncio.TimeoutError:
                        pass
            # shutdown: finish the requests marked for abort above, so their consumers end
            await pipeline.drain()
            sched.handle_aborts()
        except BaseException as e:
            self._loop_error = e
            logger.exception("the scheduling loop stopped; the engine cannot serve")
            for req in list(sched.reqs.values()):
                try:
                    sched.finish(req, FinishReason.abort(f"internal error: {e}"))
                except Exception:     # noqa: BLE001 - the consumers must still be woken
                    if req.sink is not None:
                        req.sink(GenerateOutput(req.rid, "", [], True, FinishReason.abort(
                            f"internal error: {e}").to_dict()))
            if self.on_fatal is not None:
                self.on_fatal(e)
            raise

    # ------------------------------------------------------------------ requests
    @property
    def max_total_tokens(self) -> int:
        return self.runner.max_total_tokens

    def waiting_count(self) -> int:
        return len(self.scheduler.waiting)

    def submit_nowait(self, req: GenerateReqInput, sink: Callable[[GenerateOutput], None],
                      grammar: Any = None) -> None:
        """Queue `req` (validated already) in the scheduler; every output of it goes to
        `sink` (called on the loop thread, once per step that produced tokens; the last has
        finished=True). grammar: its compiled matcher (submit compiles it). ValueError for an
        rid in use, RuntimeError when the engine is not running. Loop thread."""
        if self._task is None:
            raise RuntimeError("AsyncEngine.start() has not been called")
        if self._loop_error is not None:
            raise RuntimeError(f"the engine's scheduling loop failed: {self._loop_error}")
        sp = req.sampling_params
        max_new = (sp.max_new_tokens if sp.max_new_tokens is not None   # None: all that fits
                   else min(self.context_len, self.max_total_tokens) - len(req.input_ids))
        r = Req(req.rid, req.input_ids, sp, max_new, return_logprob=req.return_logprob,
                logprob_start_len=req.logprob_start_len if req.return_logprob else -1,
                top_logprobs_num=req.top_logprobs_num if req.return_logprob else 0,
                return_text_in_logprobs=req.return_text_in_logprobs, stream=req.stream,
                sink=sink, client_id=req.client_id, cache_salt=req.cache_salt,
                pool=req.pool, priority=req.priority)
        r.grammar = grammar
        self.scheduler.add_request(r)
        self._wakeup.set()

    async def submit(self, req: GenerateReqInput,
                     sink: Callable[[GenerateOutput], None]) -> None:
        """submit_nowait, after compiling req's grammar (in the grammar pool; only this request
        waits; ValueError for a grammar that does not compile)."""
        grammar = None
        key = req.sampling_params.grammar_key
        if key is not None:
            grammar = self.grammars.matcher(await self.grammars.compile_async(key))
        self.submit_nowait(req, sink, grammar)

    async def generate(self, req: GenerateReqInput,
                       validated: bool = False) -> AsyncIterator[GenerateOutput]:
        """Yield one GenerateOutput per step that produced tokens (deltas; the last has
        finished=True); with --stream-interval N > 1, after the first one, one per N new
        tokens (surface.deliver). Raises ValueError before yielding anything for a bad request.
        Closing the iterator early (client gone, task cancelled) aborts the request.
        validated: the caller ran validate(req) on this req and has not changed it since
        (Engine does, to refuse a bad batch before any of it runs; the server's routes do,
        through validate_all), so it is not walked twice."""
        if not validated:
            self.validate(req)
        if self._task is None:
            raise RuntimeError("AsyncEngine.start() has not been called")
        queue: asyncio.Queue = asyncio.Queue()
        await self.submit(req, queue.put_nowait)
        finished = False
        try:
            async for out in deliver(queue, self.server_args.stream_interval):
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(req.rid)

    def abort(self, rid: str, message: str = "aborted") -> None:
        """Abort a request (no-op for an unknown or finished rid). Loop thread."""
        if self.scheduler.abort(rid, message) and self._wakeup is not None:
            self._wakeup.set()

    async def flush_cache(self) -> bool:
        ok = self.scheduler.flush_cache()
        if ok:
            logger.info("Cache flushed")
        return ok

    # ------------------------------------------------------------------ introspection
    def server_info(self) -> Dict[str, Any]:
        """Ours (server_args nested, the model's shape, ...) and, beside them, SGLang's names:
        every server argument at the top level, max_total_num_tokens, max_req_input_len,
        version and internal_states (what SGLang's clients and dashboards read)."""
        from radixserve.version import __version__
        from radixserve.quant import quantization_name
        mc = self.model_config
        args = dataclasses.asdict(self.server_args)
        sglang = {**args, "max_total_num_tokens": self.runner.max_total_tokens,
                  "max_req_input_len": validation.max_prompt_tokens(self.context_len), "version": __version__,
                  "internal_states": [{"last_gen_throughput": self.scheduler.gen_throughput}]}
        return {
            **sglang,
            "server_args": args,
            "model_path": self.model_path,
            "served_model_name": self.served_model_name,
            "context_len": self.context_len,
            "max_total_tokens": self.runner.max_total_tokens,
            "max_running_requests": self.scheduler.max_running_requests,
            "chunked_prefill_size": self.scheduler.chunk_size,
            "device": str(self.runner.device),
            "dtype": str(self.runner.dtype).replace("torch.", ""),
            "quantization": quantization_name(self.runner.model),
            "prefix_cache": type(self.scheduler.cache).__name__,
            "pooling_method": self.pooling_method,      # None unless --is-embedding
            "model": {"architecture": mc.architecture, "vocab_size": mc.vocab_size,
                      "hidden_size": mc.hidden_size, "num_hidden_layers": mc.num_hidden_layers,
                      "num_attention_heads": mc.num_attention_heads,
                      "num_key_value_heads": mc.num_key_value_heads, "head_dim": mc.head_dim,
                      "max_position_embeddings": mc.max_position_embeddings},
        }

    def metrics(self) -> Dict[str, Any]:
        """The scheduler's totals and gauges, plus the CPU seconds of the loop thread and the
        forward worker (`loop_thread_cpu_seconds`, `forward_thread_cpu_seconds`; while started,
        on Linux)."""
        m = self.scheduler.metrics()
        m.update(self._thread_cpu.seconds())
        return m

    @property
    def loop_error(self) -> Optional[BaseException]:
        """Why the scheduling loop died, or None while it runs (or never started)."""
        return self._loop_error

    def is_healthy(self) -> bool:
        return self._task is not None and not self._task.done() and self._loop_error is None
