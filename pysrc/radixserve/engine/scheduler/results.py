"""Results and streaming: a step's sampled tokens become output, stop checks, deltas, finishes.

process_batch_result runs on the event-loop thread when the pipeline resolves a step. With
overlap, the step after it is already running: a request that finished (or was aborted, or
jumped forward: grammar.py) since this step was scheduled is skipped here, so the extra token it computed is dropped and its
output equals the serial loop's. A row whose logits were not finite fails alone (an abort with
a clear message); its batch-mates go on. Part of Scheduler (core.py).
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional

from radixserve.engine.io import GenerateOutput, LogprobEntry
from radixserve.engine.req import Req, ReqStatus
from radixserve.engine.schedule_batch import ScheduleBatch
from radixserve.model.forward_batch import ForwardMode
from radixserve.model.step_io import StepOutput

logger = logging.getLogger("radixserve.engine.scheduler")

NON_FINITE_MESSAGE = ("the model produced non-finite logits for this request (NaN or infinity); "
                      "check the sampling parameters and the model's weights")


class ResultsMixin:
    def process_batch_result(self, batch: ScheduleBatch, out: StepOutput) -> None:
        """Append sampled tokens, check stops, stream outputs, finish requests. Loop thread."""
        sample_i = 0
        generated = 0
        self._device_time += out.device_time
        self.total_device_time += out.device_time
        kind = "decode" if batch.mode is ForwardMode.DECODE else "extend"
        self.device_time_by_kind[kind] += out.device_time
        self.device_idle_before_kind[kind] += out.idle_before
        if kind == "decode":
            self.decode_row_device_time += out.device_time * batch.batch_size
            self.decode_rows += batch.batch_size
        for i, req in enumerate(batch.reqs):
            if batch.sample[i]:
                row, sample_i = sample_i, sample_i + 1
            if not batch.current(i):
                continue                                  # finished or jumped while this ran
            if batch.prompt_lp[i] is not None:
                self._add_prompt_logprobs(req, batch.prompt_lp[i], out.prompt_logprobs[i],
                                          out.prompt_top_logprobs[i])
            if not batch.sample[i]:
                self._after_chunk(req)
                continue
            if req.status == ReqStatus.PREFILL:
                self._start_running(req)
            if req.to_abort:
                self._finish(req, self._abort_reason(req))
                continue
            if not out.sample.finite[row]:
                logger.warning("request %s: non-finite logits; failing it alone", req.rid)
                req.abort_message = NON_FINITE_MESSAGE
                self._finish(req, {"type": "abort", "matched": None, "message": NON_FINITE_MESSAGE})
                continue
            if req.max_new_tokens == 0:
                self._finish(req, {"type": "length", "matched": None})
                continue
            tok = out.sample.ids[row]
            if req.grammar is not None and not self._grammar_accepts(req, tok):
                continue
            self._append_token(req, tok, out.sample.logprobs[row], out.sample.top_logprobs[row])
            generated += 1
            if not req.finished and req.can_jump_forward and self.jump_forward:
                self._jump_forward(req)
        self.counters["generation_tokens"] += generated
        self._decode_log_tokens += generated

    def _after_chunk(self, req: Req) -> None:
        """A non-final prefill chunk finished: publish it (or finish an aborted request)."""
        if req.to_abort:
            if self.chunked_req is req:
                self.chunked_req = None
            self._finish(req, self._abort_reason(req))
        elif self.cache.supports_sharing:
            self._publish_chunk(req)

    def _start_running(self, req: Req) -> None:
        """The prefill ended: publish the prompt now, not at finish, so requests arriving while
        this one decodes (or waiting on it, see _waits_for_batch_prefix) reuse it."""
        if self.chunked_req is req:
            self.chunked_req = None
        if self.cache.supports_sharing and req.kv_len % self.server_args.page_size == 0:
            self._publish_chunk(req)
        req.status = ReqStatus.RUNNING
        if req.wants_prompt_logprobs and not req.prompt_logprobs_done:
            if req.input_token_logprobs is None:     # nothing to score (short prompt)
                self._add_prompt_logprobs(req, (0, 0), [], None)
            req.prompt_logprobs_done = True
        self.running.append(req)

    def _append_token(self, req: Req, tok: int, lp: Optional[float], top) -> None:
        req.output_ids.append(tok)
        if req.return_logprob:
            req.pending_logprobs.append(self._entry(req, lp, tok))
            if req.top_logprobs_num > 0:
                req.pending_top_logprobs.append([self._entry(req, v, t) for v, t in (top or [])])
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

    def _check_stop_token(self, req: Req, tok: int) -> Optional[Dict[str, Any]]:
        sp = req.sampling_params
        if not sp.ignore_eos and tok in self.eos_ids:
            return {"type": "stop", "matched": tok}
        if req.grammar is not None and req.grammar.terminated:   # the grammar's end
            return {"type": "stop", "matched": tok}
        if sp.stop_token_ids and tok in sp.stop_token_ids:
            return {"type": "stop", "matched": tok}
        if len(req.output_ids) >= req.max_new_tokens or req.seq_len >= self.context_len:
            return {"type": "length", "matched": None}
        return None

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
            req.pending_ids, req.pending_text, req.pending_rollback = [], "", 0
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
            output_ids_rollback=req.pending_rollback,
        )
        if req.queue_time is not None and not req.queue_time_sent:
            out.queue_time_s = req.queue_time
            req.queue_time_sent = True
        if req.wants_prompt_logprobs and not req.input_logprobs_sent and \
                req.input_token_logprobs is not None and (req.prompt_logprobs_done or finished):
            out.input_token_logprobs = req.input_token_logprobs
            out.input_top_logprobs = req.input_top_logprobs
            req.input_logprobs_sent = True
        req.pending_ids, req.pending_text, req.pending_rollback = [], "", 0
        req.pending_logprobs, req.pending_top_logprobs = [], []
        req.sink(out)
