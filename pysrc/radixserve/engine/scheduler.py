"""Scheduler: owns every live request and decides what each step computes.

A step is schedule() -> (the forward worker runs batch.step_input) -> process_batch_result().
schedule() and process_batch_result() run on the event-loop thread and are the only code that
mutates requests, the waiting queue, the running batch, the KV pool's free list, the ReqToToken
rows and the prefix cache. step() runs the three in a row (tests, offline use).

Per step:
  1. finish requests marked for abort;
  2. prefill (unless the previous step was a prefill and requests are decoding: prefill and decode
     steps alternate under load so neither starves): continue the chunked request, then admit
     waiting requests in policy order under the token budget (max_prefill_tokens, and
     chunked_prefill_size which splits a long prompt across steps), the request cap, a free
     ReqToToken row, and memory (free + evictable slots must cover the new prefill tokens plus a
     reserve for the running requests' future decode tokens, scaled by new_token_ratio);
  3. else a decode step over all running requests; if the pool cannot give each its next slot
     even after eviction, the latest-admitted requests are retracted to the front of the queue
     (their computed KV is published to the cache, so resuming re-matches it).
Slot ownership follows cache/base.py and engine/req.py; check_integrity() verifies it.
"""
from __future__ import annotations

import collections
import logging
import random
import time
from typing import Any, Callable, Deque, Dict, List, Optional

import torch

from radixserve.cache.base import PrefixCache
from radixserve.cache.chunk_cache import ChunkCache
from radixserve.cache.kv_pool import KVPool
from radixserve.config import ServerArgs
from radixserve.engine.io import GenerateOutput, LogprobEntry
from radixserve.engine.policy import get_policy
from radixserve.engine.req import Req, ReqStatus
from radixserve.engine.schedule_batch import ScheduleBatch, StepOutput
from radixserve.model.forward_batch import ForwardMode
from radixserve.sampling.sampler import sampling_batch_info

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.7       # x conservativeness: share of remaining max_new_tokens reserved
MIN_NEW_TOKEN_RATIO = 0.1        # the ratio decays to this (x conservativeness) while nothing retracts
NEW_TOKEN_RATIO_DECAY_STEPS = 600
RESERVE_CLIP = 4096              # per-request cap on the decode reserve
IN_BATCH_SHARE_MIN = 32          # a waiting request sharing this many uncached tokens with one in
                                 # the prefill batch waits a step to reuse them (see below)
DECODE_LOG_INTERVAL = 40


def make_prefix_cache(server_args: ServerArgs, kv_pool: KVPool) -> PrefixCache:
    """RadixCache unless --disable-radix-cache (or the module is missing: ChunkCache + a warning)."""
    if not server_args.disable_radix_cache:
        try:
            from radixserve.cache.radix_cache import RadixCache
        except ImportError as e:
            logger.warning("radix cache unavailable (%s); falling back to ChunkCache (no prefix "
                           "sharing)", e)
        else:
            return RadixCache(kv_pool, page_size=server_args.page_size)
    return ChunkCache(kv_pool, page_size=server_args.page_size)


class Scheduler:
    """runner: provides kv_pool, req_to_token_pool, model_config, context_len, run_step(StepInput).
    tokenizer: optional; gives EOS ids, token_text for logprobs, and detokenizers (via
    detokenizer_factory(req) -> IncrementalDetokenizer or None)."""

    def __init__(self, server_args: ServerArgs, runner: Any, tokenizer: Any = None,
                 detokenizer_factory: Optional[Callable[[Req], Any]] = None,
                 cache: Optional[PrefixCache] = None):
        self.server_args = server_args
        self.runner = runner
        self.tokenizer = tokenizer
        self.detokenizer_factory = detokenizer_factory
        self.kv_pool: KVPool = runner.kv_pool
        self.req_to_token_pool = runner.req_to_token_pool
        self.vocab_size = runner.model_config.vocab_size
        self.context_len = runner.context_len
        self.device = self.kv_pool.device
        self.cache = cache if cache is not None else make_prefix_cache(server_args, self.kv_pool)
        self.policy = get_policy(server_args.schedule_policy)
        self.max_running_requests = min(runner.max_running_requests, self.req_to_token_pool.size)
        self.chunk_size = server_args.resolved_chunked_prefill_size()
        self.max_prefill_tokens = server_args.max_prefill_tokens
        eos = set(runner.model_config.eos_token_ids)
        if tokenizer is not None:
            tok_eos = getattr(tokenizer, "eos_token_ids", None)
            tok_eos = tok_eos() if callable(tok_eos) else tok_eos
            eos |= set(tok_eos or [])
        self.eos_ids = sorted(eos)
        cons = server_args.schedule_conservativeness
        self.init_new_token_ratio = min(INIT_NEW_TOKEN_RATIO * cons, 1.0)
        self.min_new_token_ratio = min(MIN_NEW_TOKEN_RATIO * cons, self.init_new_token_ratio)
        self.new_token_ratio = self.init_new_token_ratio
        self._rng = random.Random(server_args.random_seed)
        # request state
        self.waiting: Deque[Req] = collections.deque()
        self.running: List[Req] = []
        self.chunked_req: Optional[Req] = None
        self.reqs: Dict[str, Req] = {}
        self._admit_counter = 0
        self._last_was_prefill = False
        self._num_decode_steps = 0
        self._decode_log_tokens = 0
        self._decode_log_time = time.perf_counter()
        self.counters: Dict[str, int] = {
            "num_requests": 0, "num_finished_requests": 0, "num_aborted_requests": 0,
            "prompt_tokens": 0, "cached_tokens": 0, "generation_tokens": 0,
            "num_retractions": 0, "num_prefill_steps": 0, "num_decode_steps": 0,
        }

    # ------------------------------------------------------------------ queue API (loop thread)
    def add_request(self, req: Req) -> None:
        if req.rid in self.reqs:
            raise ValueError(f"request id {req.rid!r} is already in use; send a unique rid")
        if req.seed is None:
            req.seed = self._rng.randrange(1 << 62)
        if req.detokenizer is None and self.detokenizer_factory is not None:
            req.detokenizer = self.detokenizer_factory(req)
        req.status = ReqStatus.WAITING
        self.reqs[req.rid] = req
        self.waiting.append(req)
        self.counters["num_requests"] += 1

    def abort(self, rid: str, message: str = "aborted") -> bool:
        """Abort a live request: at once if it is waiting, else at the next step boundary (its
        slots may be in use by the forward in flight). Returns False for an unknown rid."""
        req = self.reqs.get(rid)
        if req is None or req.finished:
            return False
        req.abort_message = message
        if req.status == ReqStatus.WAITING:
            self.waiting.remove(req)
            self._finish(req, {"type": "abort", "matched": None, "message": message})
        else:
            req.to_abort = True
        return True

    def has_work(self) -> bool:
        """Any live request (waiting, in the step in flight, decoding, or mid-chunk)."""
        return bool(self.reqs)

    @property
    def num_running(self) -> int:
        return len(self.running) + (self.chunked_req is not None)

    # ------------------------------------------------------------------ a step
    def step(self) -> Optional[ScheduleBatch]:
        """Schedule, run and process one step synchronously; None when there was nothing to do."""
        batch = self.schedule()
        if batch is None:
            return None
        self.process_batch_result(batch, self.runner.run_step(batch.step_input))
        return batch

    def schedule(self) -> Optional[ScheduleBatch]:
        """Pick this step's batch, allocate its slots and build its StepInput. Loop thread."""
        self.handle_aborts()
        batch = None
        if not (self._last_was_prefill and self.running):
            batch = self._prefill_batch()
        if batch is None:
            batch = self._decode_batch()
        if batch is None:
            self._last_was_prefill = False
            self._drop_unschedulable()
            return None
        self._last_was_prefill = batch.mode == ForwardMode.EXTEND
        info = sampling_batch_info(batch.sampling_reqs, self.vocab_size, self.eos_ids, self.device)
        batch.step_input = batch.prepare(self.req_to_token_pool, self.kv_pool, info)
        return batch

    def _drop_unschedulable(self) -> None:
        """Nothing runs and the head of the queue still cannot be admitted: it can never fit
        (its prompt exceeds what the pool can hold), so finish it rather than wait forever."""
        if self.waiting and not self.running and self.chunked_req is None:
            req = self.waiting.popleft()
            self._finish(req, {"type": "abort", "matched": None,
                               "message": f"the request needs {req.seq_len} KV slots but the pool "
                                          f"holds {self.kv_pool.num_slots}; raise "
                                          f"--max-total-tokens or shorten the prompt"})

    def fail_batch(self, batch: ScheduleBatch, error: BaseException) -> None:
        """The forward of batch raised: finish its requests with an abort (their new KV is not
        trustworthy, so it is freed, not published). Loop thread."""
        message = f"internal error: {type(error).__name__}: {error}"
        for req in batch.reqs:
            if req.finished:
                continue
            if req.req_pool_idx is not None:
                rows = self.req_to_token_pool.req_to_token
                own = rows[req.req_pool_idx, req.prefix_len:req.kv_len].to("cpu", torch.int64)
                self.kv_pool.free(own)
                req.kv_len = req.prefix_len
            req.abort_message = message
            self._finish(req, {"type": "abort", "matched": None, "message": message})

    # ------------------------------------------------------------------ prefill
    def _alloc(self, n: int) -> Optional[torch.Tensor]:
        if self.kv_pool.available_size() < n:
            self.cache.evict(n - self.kv_pool.available_size())
        return self.kv_pool.alloc(n)

    def _reserve(self, req: Req) -> float:
        return min(req.remaining_new_tokens(), RESERVE_CLIP) * self.new_token_ratio

    def _prompt_lp_range(self, req: Req, start: int, n: int):
        """Positions of [start, start+n) whose logits score prompt tokens for req (or None)."""
        if not req.wants_prompt_logprobs or req.prompt_logprobs_done:
            return None
        first = max(req.logprob_start_len, 1) - 1
        last = len(req.origin_input_ids) - 1             # exclusive: position P-1 predicts output
        p0, p1 = max(start, first), min(start + n, last)
        return (p0, p1) if p1 > p0 else None

    def _prefill_batch(self) -> Optional[ScheduleBatch]:
        if self.chunked_req is None and not self.waiting:
            return None
        budget = self.max_prefill_tokens
        if self.chunk_size is not None:
            budget = min(budget, self.chunk_size)
        batch = ScheduleBatch(ForwardMode.EXTEND)
        num_cached = 0
        num_new_seqs = 0
        # the request being prefilled in chunks goes first
        req = self.chunked_req
        if req is not None:
            remaining = req.seq_len - req.kv_len
            n = min(remaining, budget, self.kv_pool.available_size() + self.cache.evictable_size())
            slots = self._alloc(n) if n > 0 else None
            if slots is None:
                return None
            self._add_extend(batch, req, slots, final=n == remaining)
            budget -= n
            if n < remaining:
                return self._log_prefill(batch, num_new_seqs, num_cached)
        reserve = sum(self._reserve(r) for r in self.running)
        num_admitted = 0
        for req in self.policy(list(self.waiting), self.cache):
            if budget <= 0 or self.num_running + num_admitted >= self.max_running_requests:
                break
            if self.req_to_token_pool.available_size() == 0:
                break
            key = req.fill_ids
            match = self.cache.match_prefix(key[:req.max_prefix_len()])
            prefix_len = int(match.indices.numel())
            if self._waits_for_batch_prefix(req, batch, prefix_len):
                continue
            remaining = len(key) - prefix_len
            if remaining > budget and (self.chunk_size is None) and batch.batch_size > 0:
                break
            n = remaining if self.chunk_size is None else min(remaining, budget)
            self.cache.inc_lock_ref(match.last_node)
            own_reserve = self._reserve(req) if n == remaining else 0.0
            available = self.kv_pool.available_size() + self.cache.evictable_size()
            idle = not self.running and batch.batch_size == 0
            if (n > available) or (not idle and n + own_reserve + reserve > available):
                self.cache.dec_lock_ref(match.last_node)
                break
            slots = self._alloc(n)
            if slots is None:
                self.cache.dec_lock_ref(match.last_node)
                break
            row = self.req_to_token_pool.alloc()
            self.waiting.remove(req)
            req.req_pool_idx = row
            req.prefix_indices = match.indices
            req.last_node = match.last_node
            req.kv_len = prefix_len
            if prefix_len:
                self.req_to_token_pool.write(row, 0, match.indices)
            req.status = ReqStatus.PREFILL
            req.admit_order = self._admit_counter
            self._admit_counter += 1
            if req.cached_tokens is None:
                req.cached_tokens = prefix_len
                self.counters["prompt_tokens"] += len(req.origin_input_ids)
                self.counters["cached_tokens"] += prefix_len
            num_cached += prefix_len
            num_new_seqs += 1
            num_admitted += 1
            self._add_extend(batch, req, slots, final=n == remaining)
            budget -= n
            reserve += own_reserve
            if n < remaining:
                self.chunked_req = req
                break
        if batch.batch_size == 0:
            return None
        return self._log_prefill(batch, num_new_seqs, num_cached)

    def _waits_for_batch_prefix(self, req: Req, batch: ScheduleBatch, prefix_len: int) -> bool:
        """In-batch prefix sharing: if req's uncached part starts with IN_BATCH_SHARE_MIN tokens
        that a request already in this prefill batch is computing, req waits: that request
        publishes its prompt after the prefill (process_batch_result), so req then reuses it
        (identical prompts arriving together prefill once, not once each)."""
        if not self.cache.supports_sharing:
            return False
        end = prefix_len + IN_BATCH_SHARE_MIN
        if len(req.fill_ids) - 1 < end:
            return False
        head = req.fill_ids[:end]
        return any(other.fill_ids[:end] == head for other in batch.reqs)

    def _add_extend(self, batch: ScheduleBatch, req: Req, slots: torch.Tensor, final: bool) -> None:
        start, n = req.kv_len, int(slots.numel())
        self.req_to_token_pool.write(req.req_pool_idx, start, slots)
        req.kv_len += n
        batch.add(req, start, n, slots, sample=final,
                  prompt_lp=self._prompt_lp_range(req, start, n))
        if not final:
            self.chunked_req = req

    def _log_prefill(self, batch: ScheduleBatch, num_new_seqs: int, num_cached: int) -> ScheduleBatch:
        self.counters["num_prefill_steps"] += 1
        logger.info("Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, "
                    "token usage: %.2f, #running-req: %d, #queue-req: %d",
                    num_new_seqs, batch.num_tokens, num_cached, self.token_usage(),
                    len(self.running), len(self.waiting))
        return batch

    # ------------------------------------------------------------------ decode
    def _decode_batch(self) -> Optional[ScheduleBatch]:
        if not self.running:
            return None
        self._ensure_decode_memory()
        if not self.running:
            return None
        slots = self.kv_pool.alloc(len(self.running))
        batch = ScheduleBatch(ForwardMode.DECODE)
        for i, req in enumerate(self.running):
            slot = slots[i:i + 1]
            self.req_to_token_pool.write(req.req_pool_idx, req.kv_len, slot)
            batch.add(req, req.kv_len, 1, slot, sample=True)
            req.kv_len += 1
        self.new_token_ratio = max(
            self.new_token_ratio - (self.init_new_token_ratio - self.min_new_token_ratio)
            / NEW_TOKEN_RATIO_DECAY_STEPS, self.min_new_token_ratio)
        self._num_decode_steps += 1
        self.counters["num_decode_steps"] += 1
        if self._num_decode_steps % DECODE_LOG_INTERVAL == 0:
            now = time.perf_counter()
            throughput = self._decode_log_tokens / max(now - self._decode_log_time, 1e-9)
            self._decode_log_tokens, self._decode_log_time = 0, now
            logger.info("Decode batch. #running-req: %d, #token: %d, token usage: %.2f, "
                        "gen throughput (token/s): %.2f, #queue-req: %d",
                        len(self.running), self.num_used_tokens(), self.token_usage(),
                        throughput, len(self.waiting))
        return batch

    def _ensure_decode_memory(self) -> None:
        """Make one free slot per running request: evict, then retract (latest admitted first)."""
        retracted: List[Req] = []
        while self.running:
            short = len(self.running) - self.kv_pool.available_size()
            if short <= 0:
                break
            self.cache.evict(short)
            if len(self.running) <= self.kv_pool.available_size():
                break
            if len(self.running) == 1:
                # a lone request that fills the whole pool cannot continue
                req = self.running[0]
                self._finish(req, {"type": "abort", "matched": None,
                                   "message": "the KV pool is full; raise --max-total-tokens"})
                break
            victim = max(self.running, key=lambda r: r.admit_order)
            self._retract(victim)
            retracted.append(victim)
        if retracted:
            old = self.new_token_ratio
            self.new_token_ratio = self.init_new_token_ratio
            self.counters["num_retractions"] += len(retracted)
            logger.warning("Retract requests: #retracted: %d, #new-token-ratio: %.4f -> %.4f",
                           len(retracted), old, self.new_token_ratio)

    def _retract(self, req: Req) -> None:
        self.running.remove(req)
        self._release_kv(req)
        req.status = ReqStatus.WAITING
        req.num_retractions += 1
        # the earliest-admitted of the retracted ends up first (each later victim is pushed first)
        self.waiting.appendleft(req)

    # ------------------------------------------------------------------ results
    def process_batch_result(self, batch: ScheduleBatch, out: StepOutput) -> None:
        """Append sampled tokens, check stops, stream outputs, finish requests. Loop thread."""
        sample_i = 0
        generated = 0
        for i, req in enumerate(batch.reqs):
            if batch.prompt_lp[i] is not None:
                self._add_prompt_logprobs(req, batch.prompt_lp[i], out.prompt_logprobs[i],
                                          out.prompt_top_logprobs[i])
            if not batch.sample[i]:
                if req.to_abort:
                    self.chunked_req = None
                    self._finish(req, self._abort_reason(req))
                elif self.cache.supports_sharing:
                    self._publish_chunk(req)
                continue
            tok = out.sample.ids[sample_i]
            lp = out.sample.logprobs[sample_i]
            top = out.sample.top_logprobs[sample_i]
            sample_i += 1
            if req.status == ReqStatus.PREFILL:
                if self.chunked_req is req:
                    self.chunked_req = None
                if self.cache.supports_sharing and req.kv_len % self.server_args.page_size == 0:
                    # publish the prompt now, not at finish: requests arriving while this one
                    # decodes (or waiting on it, see _waits_for_batch_prefix) reuse it
                    self._publish_chunk(req)
                req.status = ReqStatus.RUNNING
                if req.wants_prompt_logprobs and not req.prompt_logprobs_done:
                    if req.input_token_logprobs is None:     # nothing to score (short prompt)
                        self._add_prompt_logprobs(req, (0, 0), [], None)
                    req.prompt_logprobs_done = True
                self.running.append(req)
            if req.to_abort:
                self._finish(req, self._abort_reason(req))
                continue
            if req.max_new_tokens == 0:
                self._finish(req, {"type": "length", "matched": None})
                continue
            req.output_ids.append(tok)
            generated += 1
            if req.return_logprob:
                req.pending_logprobs.append(self._entry(req, lp, tok))
                if req.top_logprobs_num > 0:
                    req.pending_top_logprobs.append(
                        [self._entry(req, v, t) for v, t in (top or [])])
            reason = self._check_stop_token(req, tok)
            trim_token = reason is not None and reason["type"] == "stop" and \
                not req.sampling_params.no_stop_trim
            if req.detokenizer is not None and not trim_token:
                res = req.detokenizer.push([tok])
                req.pending_text += res.text_delta
                if reason is None and res.stop_matched is not None:
                    reason = {"type": "stop", "matched": res.stop_matched}
                    req.stop_str_matched = True
            req.pending_ids.append(tok)
            if reason is not None:
                self._finish(req, reason)
            else:
                self._emit(req, finished=False)
        self.counters["generation_tokens"] += generated
        self._decode_log_tokens += generated

    def _check_stop_token(self, req: Req, tok: int) -> Optional[Dict[str, Any]]:
        sp = req.sampling_params
        if not sp.ignore_eos and tok in self.eos_ids:
            return {"type": "stop", "matched": tok}
        if sp.stop_token_ids and tok in sp.stop_token_ids:
            return {"type": "stop", "matched": tok}
        if len(req.output_ids) >= req.max_new_tokens or req.seq_len >= self.context_len:
            return {"type": "length", "matched": None}
        return None

    def _publish_chunk(self, req: Req) -> None:
        """After a non-final chunk: hand the chunk's slots to the cache and lock the new path."""
        kv = req.kv_len
        key = req.fill_ids[:kv]
        slots = self.req_to_token_pool.req_to_token[req.req_pool_idx, :kv].to("cpu", torch.int64)
        self.cache.insert(key, slots)
        match = self.cache.match_prefix(key)
        self.cache.inc_lock_ref(match.last_node)
        self.cache.dec_lock_ref(req.last_node)
        req.last_node = match.last_node
        req.prefix_indices = match.indices
        self.req_to_token_pool.write(req.req_pool_idx, 0, match.indices)
        # a cache that publishes whole pages only may keep less: those tokens get recomputed
        req.kv_len = int(match.indices.numel())

    def _release_kv(self, req: Req) -> None:
        """Give the request's computed tokens to the cache (ChunkCache frees them), unlock its
        prefix and free its row. Only between steps: the KV of [0, kv_len) is computed."""
        if req.req_pool_idx is None:
            return
        kv = req.kv_len
        slots = self.req_to_token_pool.req_to_token[req.req_pool_idx, :kv].to("cpu", torch.int64)
        self.cache.insert(req.fill_ids[:kv], slots)
        self.cache.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.last_node = None
        req.prefix_indices = torch.empty(0, dtype=torch.int64)
        req.kv_len = 0

    def _abort_reason(self, req: Req) -> Dict[str, Any]:
        return {"type": "abort", "matched": None, "message": req.abort_message or "aborted"}

    def handle_aborts(self) -> None:
        """Finish every request marked for abort (between steps only)."""
        for req in [r for r in self.running if r.to_abort]:
            self._finish(req, self._abort_reason(req))
        if self.chunked_req is not None and self.chunked_req.to_abort:
            req, self.chunked_req = self.chunked_req, None
            self._finish(req, self._abort_reason(req))

    def _finish(self, req: Req, reason: Dict[str, Any]) -> None:
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        if self.chunked_req is req:
            self.chunked_req = None
        self._release_kv(req)
        req.status = ReqStatus.FINISHED
        self.reqs.pop(req.rid, None)
        if reason["type"] == "abort":
            self.counters["num_aborted_requests"] += 1
        else:
            self.counters["num_finished_requests"] += 1
        if req.detokenizer is not None and reason["type"] != "abort" and \
                not req.stop_str_matched:
            req.pending_text += req.detokenizer.flush()
        self._emit(req, finished=True)

    # ------------------------------------------------------------------ outputs
    def _entry(self, req: Req, logprob: Optional[float], tok: int) -> LogprobEntry:
        text = None
        if req.return_text_in_logprobs and self.tokenizer is not None:
            text = self.tokenizer.token_text(tok)
        return (logprob, tok, text)

    def _add_prompt_logprobs(self, req: Req, rng, values: List[float], tops) -> None:
        if req.input_token_logprobs is None:
            req.input_token_logprobs = []
            req.input_top_logprobs = [] if req.top_logprobs_num > 0 else None
            if req.logprob_start_len == 0:
                req.input_token_logprobs.append(self._entry(req, None, req.origin_input_ids[0]))
                if req.input_top_logprobs is not None:
                    req.input_top_logprobs.append([])
        p0, _ = rng
        targets = req.origin_input_ids[p0 + 1:p0 + 1 + len(values)]
        req.input_token_logprobs += [self._entry(req, v, t) for v, t in zip(values, targets)]
        if req.input_top_logprobs is not None and tops is not None:
            req.input_top_logprobs += [[self._entry(req, v, t) for v, t in row] for row in tops]

    def _emit(self, req: Req, finished: bool) -> None:
        if req.sink is None:
            req.pending_ids, req.pending_text = [], ""
            req.pending_logprobs, req.pending_top_logprobs = [], []
            return
        out = GenerateOutput(
            rid=req.rid,
            text_delta=req.pending_text,
            output_ids_delta=req.pending_ids,
            finished=finished,
            finish_reason=req.finish_reason if finished else None,
            prompt_tokens=len(req.origin_input_ids),
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens or 0,
            output_token_logprobs_delta=req.pending_logprobs,
            output_top_logprobs_delta=req.pending_top_logprobs,
        )
        if req.wants_prompt_logprobs and not req.input_logprobs_sent and \
                req.input_token_logprobs is not None and (req.prompt_logprobs_done or finished):
            out.input_token_logprobs = req.input_token_logprobs
            out.input_top_logprobs = req.input_top_logprobs
            req.input_logprobs_sent = True
        req.pending_ids, req.pending_text = [], ""
        req.pending_logprobs, req.pending_top_logprobs = [], []
        req.sink(out)

    # ------------------------------------------------------------------ cache, stats, checks
    def flush_cache(self) -> bool:
        """Reset the prefix cache; refused (False, nothing changes) while any request is live."""
        if self.has_work():
            return False
        self.cache.reset()
        return True

    def num_used_tokens(self) -> int:
        return self.kv_pool.num_slots - self.kv_pool.available_size() - self.cache.evictable_size()

    def token_usage(self) -> float:
        return self.num_used_tokens() / max(self.kv_pool.num_slots, 1)

    def metrics(self) -> Dict[str, Any]:
        m: Dict[str, Any] = dict(self.counters)
        m.update(num_running_reqs=len(self.running) + (self.chunked_req is not None),
                 num_waiting_reqs=len(self.waiting), token_usage=self.token_usage(),
                 num_used_tokens=self.num_used_tokens(), max_total_tokens=self.kv_pool.num_slots,
                 evictable_tokens=self.cache.evictable_size())
        return m

    def check_integrity(self) -> None:
        """Every slot is free, cache-owned, or owned by one live request; exactly once each.
        Raises AssertionError naming the inconsistency. Only between steps."""
        total = self.kv_pool.num_slots
        holders = [r for r in self.reqs.values() if r.req_pool_idx is not None]
        parts = [self.kv_pool.free_slots(), self.cache.owned_slots().to(torch.int64)]
        rows = self.req_to_token_pool.req_to_token
        for r in holders:
            assert r.prefix_len <= r.kv_len, f"{r}: prefix beyond kv"
            row = rows[r.req_pool_idx].to("cpu", torch.int64)
            assert torch.equal(row[:r.prefix_len], r.prefix_indices), f"{r}: row != prefix"
            parts.append(row[r.prefix_len:r.kv_len])
            if r.status == ReqStatus.RUNNING:
                assert r.kv_len == r.seq_len - 1, f"{r}: kv_len != seq_len - 1"
        allslots = torch.cat(parts)
        assert allslots.numel() == total, \
            f"slot accounting: {allslots.numel()} accounted != {total} total"
        assert int(allslots.unique().numel()) == total, "a slot is owned twice"
        assert int(allslots.min()) >= 1 and int(allslots.max()) <= total, "slot out of range"
        used_rows = [r.req_pool_idx for r in holders]
        assert len(set(used_rows)) == len(used_rows), "a ReqToToken row is held twice"
        assert self.req_to_token_pool.available_size() + len(used_rows) == \
            self.req_to_token_pool.size, "ReqToToken rows leaked"
        for r in self.running:
            assert r.req_pool_idx is not None and r.status == ReqStatus.RUNNING
        self.cache.check_integrity()
