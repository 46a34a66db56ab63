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
from radixserve.engine.pooling import (POOLING_METHODS, rerank_label_ids,
                                       resolve_pooling_method)
from radixserve.engine.req import FinishReason, Req
from radixserve.engine.scheduler import Scheduler
from radixserve.engine.thread_cpu import ThreadCPU
from radixserve.errors import EngineOverloaded, RequestError

logger = logging.getLogger(__name__)


def merge_outputs(a: GenerateOutput, b: GenerateOutput) -> GenerateOutput:
    """b's fields, with a's deltas in front of b's (b is the later output of the same request);
    b's rollback eats into a's ids first."""
    kept = max(len(a.output_ids_delta) - b.output_ids_rollback, 0)
    rollback = a.output_ids_rollback + max(b.output_ids_rollback - len(a.output_ids_delta), 0)
    return dataclasses.replace(
        b, text_delta=a.text_delta + b.text_delta,
        output_ids_delta=a.output_ids_delta[:kept] + b.output_ids_delta,
        output_ids_rollback=rollback,
        output_token_logprobs_delta=a.output_token_logprobs_delta + b.output_token_logprobs_delta,
        output_top_logprobs_delta=a.output_top_logprobs_delta + b.output_top_logprobs_delta,
        input_token_logprobs=a.input_token_logprobs if a.input_token_logprobs is not None
        else b.input_token_logprobs,
        input_top_logprobs=a.input_top_logprobs if a.input_top_logprobs is not None
        else b.input_top_logprobs,
        queue_time_s=a.queue_time_s if a.queue_time_s is not None else b.queue_time_s)


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


class AsyncEngine:
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
    def validate(self, req: GenerateReqInput, prompt_checked: bool = False) -> None:
        """Raise ValueError (a RequestError naming the field) with an actionable message for a
        request the engine cannot run. Its SamplingParams are verified unless they were already
        (SamplingParams.verified); its prompt is checked (engine/validation.check_prompt: the
        id scan, the context-length rule) unless `prompt_checked`: the caller checked this
        req's input_ids and max_new_tokens with check_prompt already (the server's routes
        do, in the client's words). A priority on a server without
        --enable-priority-scheduling is ignored, or refused with --abort-on-priority-when-disabled
        (SGLang's rule; its type was checked where the request was parsed)."""
        args = self.server_args
        if req.priority is not None and not args.enable_priority_scheduling and \
                args.abort_on_priority_when_disabled:
            raise RequestError("priority is not accepted by this server: priority scheduling is "
                               "off (--enable-priority-scheduling) and "
                               "--abort-on-priority-when-disabled refuses requests that set it; "
                               "send the request without a priority", param="priority")
        sp = req.sampling_params
        if not sp.verified:
            sp.verify()
        self._check_pool(req)
        ids = req.input_ids
        n = len(ids)
        vocab = self.model_config.vocab_size
        if not prompt_checked:
            validation.check_prompt(ids, vocab, self.context_len, sp.max_new_tokens)
        pool = self.runner.max_total_tokens
        if n >= pool:
            raise ValueError(f"prompt has {n} tokens; the KV pool holds {pool}: shorten the prompt "
                             f"or raise --max-total-tokens")
        if sp.max_new_tokens is not None and n + sp.max_new_tokens > pool:
            # it could be admitted, then never finish: refuse it now, not under pressure later
            raise ValueError(f"prompt has {n} tokens and max_new_tokens is {sp.max_new_tokens}: "
                             f"{n + sp.max_new_tokens} KV slots, but the KV pool holds {pool} "
                             f"({n + sp.max_new_tokens - pool} too many); lower max_new_tokens to "
                             f"at most {pool - n} or raise --max-total-tokens")
        bad_bias = next((t for t in (sp.logit_bias or {}) if not 0 <= t < vocab), None)
        if bad_bias is not None:
            raise RequestError(f"logit_bias names token id {bad_bias}, outside the vocabulary "
                               f"[0, {vocab})", param="logit_bias")
        if req.return_logprob:
            if req.logprob_start_len < -1:
                raise ValueError("logprob_start_len must be -1 (no prompt logprobs) or >= 0")
            if not 0 <= req.top_logprobs_num <= vocab:
                raise ValueError(f"top_logprobs_num must be in [0, {vocab}]")

    def _check_pool(self, req: GenerateReqInput) -> None:
        """A pooling request (req.pool) only with --is-embedding, and nothing else with it; its
        PoolParams within the model (dimensions, label token ids) and no tokens to generate."""
        pool, embedding = req.pool, self.server_args.is_embedding
        if pool is None and embedding:
            raise RequestError(f"{self.served_model_name} is served for embeddings "
                               f"(--is-embedding): generation is off; use /v1/embeddings or "
                               f"/v1/rerank")
        if pool is None:
            return
        if not embedding:
            raise RequestError("embeddings and reranking need a server started with "
                               "--is-embedding")
        if pool.method not in POOLING_METHODS:
            raise RequestError(f"pooling method {pool.method!r} is not one of "
                               f"{', '.join(POOLING_METHODS)}", param="pool")
        hidden = self.model_config.hidden_size
        if pool.dimensions is not None and not 1 <= pool.dimensions <= hidden:
            raise RequestError(f"dimensions must be between 1 and the model's hidden size "
                               f"{hidden}, got {pool.dimensions}", param="dimensions")
        vocab = self.model_config.vocab_size
        bad = next((t for t in pool.label_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"label token id {bad} is outside the vocabulary [0, {vocab})",
                               param="label_ids")
        if pool.label_ids and not self.lm_head_loaded:
            raise RequestError("the checkpoint has no LM head (an embedding model's backbone): "
                               "no logits can be read", param="label_ids")
        if req.sampling_params.max_new_tokens != 0:
            raise RequestError("a pooling request generates no tokens: max_new_tokens must be "
                               "0", param="max_new_tokens")

    def check_capacity(self, num_new: int) -> None:
        """Raise EngineOverloaded when num_new more sequences would take the waiting queue past
        --max-queued-requests, or the server is draining for shutdown (checked before any of a
        request's sequences starts)."""
        if self._draining:
            raise EngineOverloaded("the server is shutting down; send the request to another "
                                   "replica or retry after it restarts", retry_after_s=5)
        limit = self.server_args.max_queued_requests
        waiting = len(self.scheduler.waiting)
        if waiting + num_new > limit:
            raise EngineOverloaded(f"the server is busy: {waiting} sequences are waiting and "
                                   f"--max-queued-requests is {limit}; retry shortly",
                                   retry_after_s=1)

    async def generate(self, req: GenerateReqInput,
                       validated: bool = False) -> AsyncIterator[GenerateOutput]:
        """Yield one GenerateOutput per step that produced tokens (deltas; the last has
        finished=True); with --stream-interval N > 1, after the first one, one per N new
        tokens. Raises ValueError before yielding anything for a bad request. Closing the
        iterator early (client gone, task cancelled) aborts the request. validated: the
        caller ran validate(req) on this req and has not changed it since (Engine does, to
        refuse a bad batch before any of it runs; the server's routes do, through
        validate_all), so it is not walked twice."""
        if not validated:
            self.validate(req)
        if self._task is None:
            raise RuntimeError("AsyncEngine.start() has not been called")
        if self._loop_error is not None:
            raise RuntimeError(f"the engine's scheduling loop failed: {self._loop_error}")
        sp = req.sampling_params
        max_new = (sp.max_new_tokens if sp.max_new_tokens is not None   # None: all that fits
                   else min(self.context_len, self.runner.max_total_tokens) - len(req.input_ids))
        grammar = None
        if sp.grammar_key is not None:      # compiled in the pool; only this request waits
            grammar = self.grammars.matcher(await self.grammars.compile_async(sp.grammar_key))
        queue: asyncio.Queue = asyncio.Queue()
        r = Req(req.rid, req.input_ids, sp, max_new, return_logprob=req.return_logprob,
                logprob_start_len=req.logprob_start_len if req.return_logprob else -1,
                top_logprobs_num=req.top_logprobs_num if req.return_logprob else 0,
                return_text_in_logprobs=req.return_text_in_logprobs, stream=req.stream,
                sink=queue.put_nowait, client_id=req.client_id, cache_salt=req.cache_salt,
                pool=req.pool, priority=req.priority)
        r.grammar = grammar
        self.scheduler.add_request(r)
        self._wakeup.set()
        finished = False
        interval = self.server_args.stream_interval
        held: Optional[GenerateOutput] = None       # --stream-interval: tokens not yet yielded
        sent_tokens: Optional[int] = None           # completion_tokens at the last yield
        try:
            while True:
                out: GenerateOutput = await queue.get()
                while not out.finished and not queue.empty():
                    # the consumer fell behind the steps: one merged delta, not one per step
                    out = merge_outputs(out, queue.get_nowait())
                if held is not None:
                    out, held = merge_outputs(held, out), None
                if (interval > 1 and not out.finished and sent_tokens is not None
                        and out.completion_tokens - sent_tokens < interval):
                    held = out                      # the first output and the last go at once
                    continue
                sent_tokens = out.completion_tokens
                finished = out.finished
                yield out
                if finished:
                    return
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
