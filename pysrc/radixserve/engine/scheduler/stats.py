"""SchedulerStats: the scheduler's telemetry, in one object that owns it.

Counters (the /metrics totals), device time per step kind, and the decode log line's rates.
Nothing here decides anything: the other parts record into it (count, step_processed,
tokens_generated, decode_step, prefill_step, prompt_admitted) and Scheduler.metrics() reads it. Event-loop thread.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Deque, Dict, Optional

from radixserve.model.forward_batch import ForwardMode

logger = logging.getLogger("radixserve.engine.scheduler")

DECODE_LOG_INTERVAL = 40         # decode steps between two "Decode batch." log lines

COUNTERS = ("num_requests", "num_finished_requests", "num_aborted_requests",
            "prompt_tokens", "cached_tokens", "generation_tokens",
            "num_retractions", "num_fair_retractions", "num_priority_retractions",
            "num_prefill_steps", "num_decode_steps",
            "num_jumps", "jump_forward_tokens",
            # speculative decoding (spec.py): verify steps, request-steps that verified a draft,
            # draft tokens verified, of them accepted; verify steps scheduled over a step in
            # flight, and request-steps voided because the step before rejected a draft
            "spec_verify_steps", "spec_verify_reqs", "spec_draft_tokens", "spec_accepted_tokens",
            "spec_overlapped_verify_steps", "spec_voided_steps")


class SchedulerStats:
    def __init__(self):
        self.counters: Dict[str, int] = {k: 0 for k in COUNTERS}
        self.total_device_time = 0.0        # device seconds of every step processed
        # the same split by step kind: "decode", and "extend" (prefill chunks, mixed steps)
        self.device_time_by_kind: Dict[str, float] = {"decode": 0.0, "extend": 0.0}
        # device seconds idle just before a step of each kind (CUDA: from the steps' events)
        self.device_idle_before_kind: Dict[str, float] = {"decode": 0.0, "extend": 0.0}
        # decode steps' device seconds x their rows: over a run, divided by the tokens those
        # steps made, the mean decode step a generated token waited for (bench serving puts
        # the median ITL over it)
        self.decode_row_device_time = 0.0
        self.decode_rows = 0
        # the decode log line's rates, refreshed every DECODE_LOG_INTERVAL decode steps
        self.gen_throughput = 0.0
        self.gpu_busy_fraction = 0.0
        self._num_decode_steps = 0
        self._log_tokens = 0
        self._log_device_time = 0.0
        self._log_time = time.perf_counter()
        # the dashboard's sample of recent prompts (server/dashboard.py sets a bounded deque;
        # None: nothing is recorded): (prompt ids, cache-salt offset, cached tokens) appended
        # at each request's first admission, the ids by reference (never copied)
        self.recent_prompts: Optional[Deque[Any]] = None

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def step_processed(self, mode: ForwardMode, batch_size: int, out: Any) -> None:
        """A step's results reached the host: its device time (out.device_time, .idle_before)."""
        self._log_device_time += out.device_time
        self.total_device_time += out.device_time
        kind = "decode" if mode is ForwardMode.DECODE else "extend"
        self.device_time_by_kind[kind] += out.device_time
        self.device_idle_before_kind[kind] += out.idle_before
        if kind == "decode":
            self.decode_row_device_time += out.device_time * batch_size
            self.decode_rows += batch_size

    def tokens_generated(self, n: int) -> None:
        """n output tokens sampled (they count for the decode log line's throughput too)."""
        self.counters["generation_tokens"] += n
        self._log_tokens += n

    def prompt_admitted(self, req: Any, cached: int) -> None:
        """req was admitted for the first time with `cached` prompt tokens from the cache:
        recorded in recent_prompts when the dashboard keeps one. O(1)."""
        if self.recent_prompts is not None:
            self.recent_prompts.append((req.origin_input_ids, req._salt_offset, cached))

    def prefill_step(self, new_seqs: int, new_tokens: int, cached: int, token_usage: float,
                     running: int, queued: int) -> None:
        self.counters["num_prefill_steps"] += 1
        logger.info("Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, "
                    "token usage: %.2f, #running-req: %d, #queue-req: %d",
                    new_seqs, new_tokens, cached, token_usage, running, queued)

    def verify_step(self, num_verifying: int, num_draft_tokens: int, overlapped: bool) -> None:
        """A speculative verify step was scheduled (spec.py), over a step in flight or not."""
        self.counters["spec_verify_steps"] += 1
        self.counters["spec_overlapped_verify_steps"] += overlapped
        self.counters["spec_verify_reqs"] += num_verifying
        self.counters["spec_draft_tokens"] += num_draft_tokens

    def spec_accepted(self, n: int) -> None:
        self.counters["spec_accepted_tokens"] += n

    def decode_step(self) -> bool:
        """A decode step was scheduled; True (and the rates refreshed) when it is one to log."""
        self._num_decode_steps += 1
        self.counters["num_decode_steps"] += 1
        if self._num_decode_steps % DECODE_LOG_INTERVAL:
            return False
        now = time.perf_counter()
        elapsed = max(now - self._log_time, 1e-9)
        self.gen_throughput = self._log_tokens / elapsed
        self.gpu_busy_fraction = min(self._log_device_time / elapsed, 1.0)
        self._log_tokens, self._log_time, self._log_device_time = 0, now, 0.0
        return True

    def log_decode(self, batch_size: int, used_tokens: int, token_usage: float,
                   queued: int) -> None:
        logger.info("Decode batch. #running-req: %d, #token: %d, token usage: %.2f, "
                    "gen throughput (token/s): %.2f, #queue-req: %d",
                    batch_size, used_tokens, token_usage, self.gen_throughput, queued)

    def device_metrics(self) -> Dict[str, Any]:
        """The rates and device-time totals under their /metrics names (the counters are
        `counters`)."""
        return dict(gen_throughput=self.gen_throughput, gpu_busy_fraction=self.gpu_busy_fraction,
                    decode_device_seconds=self.device_time_by_kind["decode"],
                    extend_device_seconds=self.device_time_by_kind["extend"],
                    device_idle_before_decode_seconds=self.device_idle_before_kind["decode"],
                    device_idle_before_extend_seconds=self.device_idle_before_kind["extend"],
                    decode_row_device_seconds=self.decode_row_device_time,
                    decode_rows=self.decode_rows,
                    spec_accept_length=self.spec_accept_length())

    def spec_accept_length(self) -> float:
        """Mean tokens a verifying request gained per verify step (accepted drafts + 1); 0.0
        before any."""
        reqs = self.counters["spec_verify_reqs"]
        return (self.counters["spec_accepted_tokens"] + reqs) / reqs if reqs else 0.0
