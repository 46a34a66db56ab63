"""ResultProcessor: a step's sampled tokens become output, stop checks, deltas, finishes.

process(batch, out) runs on the event-loop thread when the pipeline resolves a step. With
overlap, the step after it is already running: a request that finished (or was aborted, or
jumped forward) since this step was scheduled is skipped here, so the extra token it computed
is dropped and its output equals the serial loop's. A row whose logits were not finite fails
alone (an abort with a clear message); its batch-mates go on.

It moves a request whose prefill ended into the Scheduler's running set (publishing its prompt
to the cache), and one that jumped forward (GrammarSlot.plan_jump) back to the front of the
waiting queue; finishing is the Scheduler's (Scheduler.finish). emit() turns a request's
pending deltas into one GenerateOutput for its sink.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, List, Optional

from radixserve.engine.io import GenerateOutput, LogprobEntry
from radixserve.engine.req import FinishReason, Req, ReqStatus
from radixserve.engine.schedule_batch import ScheduleBatch
from radixserve.engine.scheduler.grammar import GrammarSlot, Jump
from radixserve.engine.scheduler.kv import SlotLedger
from radixserve.engine.scheduler.stats import SchedulerStats
from radixserve.model.step_io import StepOutput

if TYPE_CHECKING:
    from radixserve.engine.scheduler.core import Scheduler

logger = logging.getLogger("radixserve.engine.scheduler")

NON_FINITE_MESSAGE = ("the model produced non-finite logits for this request (NaN or infinity); "
                      "check the sampling parameters and the model's weights")
NON_FINITE_POOLED = ("the model produced non-finite hidden states or logits for this pooling "
                     "request (NaN or infinity); check the model's weights and --dtype")


class ResultProcessor:
    """sched: the Scheduler (running, waiting, eos_ids, finish, abort_reason). tokenizer:
    token text for logprobs (optional). page_size: a prompt is published at its prefill's end
    only when it fills whole pages."""

    def __init__(self, sched: "Scheduler", ledger: SlotLedger, grammar: GrammarSlot,
                 stats: SchedulerStats, tokenizer: Any, context_len: int, page_size: int):
        self.sched = sched
        self.ledger = ledger
        self.grammar = grammar
        self.stats = stats
        self.tokenizer = tokenizer
        self.context_len = context_len
        self.page_size = page_size

    def process(self, batch: ScheduleBatch, out: StepOutput) -> int:
        """Append sampled tokens, check stops, stream outputs, finish requests. Returns the
        output tokens appended."""
        sched = self.sched
        sample_i = 0
        pool_i = 0
        generated = 0
        self.stats.step_processed(batch.mode, batch.batch_size, out)
        for i, req in enumerate(batch.reqs):
            n_rows = batch.num_samples(i)       # its sampling rows: row .. row + n_rows - 1
            row, sample_i = sample_i, sample_i + n_rows
            draft = batch.drafts[i] if batch.drafts is not None else None
            span = batch.pool_spans[i]
            if span is not None:
                pool_i += 1                               # its pooled span: pool_i - 1
            if not batch.current(i):
                continue                                  # finished or jumped while this ran
            if req.pool is not None:
                self._pooled(req, batch, i, out, pool_i - 1 if span is not None else None)
                continue
            if batch.prompt_lp[i] is not None:
                self._add_prompt_logprobs(req, batch.prompt_lp[i], out.prompt_logprobs[i],
                                          out.prompt_top_logprobs[i])
            if not batch.sample[i]:
                self._after_chunk(req)
                continue
            if req.status == ReqStatus.PREFILL:
                self._start_running(req)
            if req.to_abort:
                sched.finish(req, sched.abort_reason(req))
                continue
            if not all(out.sample.finite[row:row + n_rows]):
                logger.warning("request %s: non-finite logits; failing it alone", req.rid)
                req.abort_message = NON_FINITE_MESSAGE
                sched.finish(req, FinishReason.abort(NON_FINITE_MESSAGE))
                continue
            if req.max_new_tokens == 0:
                sched.finish(req, FinishReason.length())
                continue
            if draft:
                generated += self._apply_verify(req, draft, out, row)
                continue
            tok = out.sample.ids[row]
            if req.grammar is not None:
                refused = self.grammar.refusal(req, tok)
                if refused is not None:
                    sched.finish(req, refused)
                    continue
            self._append_token(req, tok, out.sample.logprobs[row], out.sample.top_logprobs[row])
            generated += 1
            if not req.finished:
                jump = self.grammar.plan_jump(req)
                if jump is not None:
                    self._apply_jump(req, jump)
        self.stats.tokens_generated(generated)
        return generated

    # ------------------------------------------------------------------ transitions
    def _pooled(self, req: Req, batch: ScheduleBatch, i: int, out: StepOutput,
                p: Optional[int]) -> None:
        """A pooling request's extend step (engine/pooling.py): add its pooled span (out's
        span p, None for none) to its sum; a chunk before the last is published as any chunk
        is; after the last, the request finishes (its KV published and freed by finish) with
        its embedding and label logits, or an abort when they are not finite."""
        if p is not None:
            start, count = batch.extend_starts[i] + batch.pool_spans[i][0], batch.pool_spans[i][1]
            req.pool_state.add(start, out.pooled[p], count, out.pool_logits[p])
        if not batch.pool_final[i]:
            self._after_chunk(req)
            return
        if req.to_abort:
            self.sched.finish(req, self.sched.abort_reason(req))
            return
        if not req.pool_state.finite():
            logger.warning("request %s: non-finite hidden states; failing it alone", req.rid)
            req.abort_message = NON_FINITE_POOLED
            self.sched.finish(req, FinishReason.abort(NON_FINITE_POOLED))
            return
        self.sched.finish(req, FinishReason.length())

    def _after_chunk(self, req: Req) -> None:
        """A non-final prefill chunk finished: publish it (or finish an aborted request)."""
        if req.to_abort:
            self.sched.finish(req, self.sched.abort_reason(req))
        elif self.ledger.cache.supports_sharing:
            self.ledger.publish(req)

    def _start_running(self, req: Req) -> None:
        """The prefill ended: publish the prompt now, not at finish, so requests arriving while
        this one decodes (or waiting on it, see PrefillPlanner._waits_for_batch_prefix) reuse
        it; req joins the running set."""
        if self.ledger.cache.supports_sharing and req.kv_len % self.page_size == 0:
            self.ledger.publish(req)
        req.status = ReqStatus.RUNNING
        if req.wants_prompt_logprobs and not req.prompt_logprobs_done:
            if req.input_token_logprobs is None:     # nothing to score (short prompt)
                self._add_prompt_logprobs(req, (0, 0), [], None)
            req.prompt_logprobs_done = True
        self.sched.running.append(req)

    def _apply_jump(self, req: Req, jump: Jump) -> None:
        """req leaves the decode batch: its KV of fill positions before the first replaced
        token (old ids: they are what the KV holds) is published, the rest and its row freed,
        and a step of it in flight is dropped from now on (epoch); its output tail is replaced
        and streamed; unless that finished it, it waits at the front of the queue."""
        self.sched.running.remove(req)
        self.ledger.release(req, keep=req.seq_len - max(jump.num_removed, 1))
        req.epoch += 1
        self._append_jumped(req, jump.num_removed, jump.new_ids)
        if not req.finished:
            req.status = ReqStatus.WAITING
            self.sched.waiting.appendleft(req)
            self.stats.count("num_jumps")

    def _apply_verify(self, req: Req, draft: List[int], out: StepOutput, row: int) -> int:
        """A verify row (spec.py) sampled at its k + 1 positions, out.sample rows row ..
        row + k, each with the request's own parameters at its own output offset: keep the
        longest prefix of draft that equals the samples, then the sample at the first position
        where they differ (or the bonus sample after a fully accepted draft). Each kept token is
        the token the request draws there without speculation (the draw is a function of the
        seed, the offset and the distribution, and the distribution is conditioned on the same
        accepted tokens), so the output is unchanged; for a draft token x this is the standard
        accept/resample rule with a one-hot proposal (accepted with probability p(x), else a
        draw from p without x). The tokens pass the stop checks one by one, exactly as decoded
        ones; a stop on one drops the rest. Returns the tokens appended.
        A step scheduled over this one assumed the whole draft accepted (spec.py). When a
        draft token is rejected, that step computed this request from wrong positions: its
        entry is voided (req.epoch: the results are dropped when it is processed; the device
        kept the true next token, StepInput.spec_cond_rows), and the rejected tail's KV slots
        and that step's are freed (SlotLedger.rollback), num_output_scheduled counted anew."""
        ids = out.sample.ids
        j = 0
        while j < len(draft) and draft[j] == ids[row + j]:
            j += 1
        self.stats.spec_accepted(j)
        if req.spec is not None:
            req.spec.observe(len(draft), j)
        if j < len(draft):
            if req.kv_len > req.seq_len + len(draft):   # a later step of it is in flight
                req.epoch += 1
                self.stats.count("spec_voided_steps")
            # KV of positions [0, seq_len - 1 + j) is the request's (last token and the
            # accepted drafts); the step wrote len(draft) - j more, a later one maybe more
            self.ledger.rollback(req, req.seq_len + j)
            req.num_output_scheduled = len(req.output_ids) + j + 1
        n = 0
        for t in range(j + 1):
            self._append_token(req, ids[row + t], out.sample.logprobs[row + t],
                               out.sample.top_logprobs[row + t])
            n += 1
            if req.finished:
                break
        return n

    # ------------------------------------------------------------------ tokens and stops
    def _append_token(self, req: Req, tok: int, lp: Optional[float], top) -> None:
        req.output_ids.append(tok)
        if req.return_logprob:
            req.pending_logprobs.append(self._entry(req, lp, tok))
            if req.top_logprobs_num > 0:
                req.pending_top_logprobs.append([self._entry(req, v, t) for v, t in (top or [])])
        reason = self._stop_by_token(req, tok)
        trim_token = reason is not None and reason.kind == "stop" and \
            not req.sampling_params.no_stop_trim
        if req.detokenizer is not None and not trim_token:
            res = req.detokenizer.push([tok])
            req.pending_text += res.text_delta
            if reason is None and res.stop_matched is not None:
                reason = FinishReason.stop(res.stop_matched)
                req.stop_str_matched = True
        req.pending_ids.append(tok)
        if reason is not None:
            self.sched.finish(req, reason)
        else:
            emit(req, finished=False)

    def _stop_by_token(self, req: Req, tok: int) -> Optional[FinishReason]:
        sp = req.sampling_params
        if not sp.ignore_eos and tok in self.sched.eos_ids:
            return FinishReason.stop(tok)
        if req.grammar is not None and req.grammar.terminated:   # the grammar's end
            return FinishReason.stop(tok)
        if sp.stop_token_ids and tok in sp.stop_token_ids:
            return FinishReason.stop(tok)
        if len(req.output_ids) >= req.max_new_tokens or req.seq_len >= self.context_len:
            return FinishReason.length()
        return None

    def _append_jumped(self, req: Req, num_removed: int, new_ids: List[int]) -> None:
        """Replace the last num_removed output ids with new_ids and stream the change."""
        del req.output_ids[len(req.output_ids) - num_removed:]
        req.output_ids.extend(new_ids)
        req.num_jumped_tokens += len(new_ids)
        req.num_output_scheduled = len(req.output_ids)
        req.penalty_ready = False
        reason = None
        if req.detokenizer is not None:
            res = req.detokenizer.replace_tail(num_removed, new_ids)
            req.pending_text += res.text_delta
            if res.stop_matched is not None:
                reason = FinishReason.stop(res.stop_matched)
                req.stop_str_matched = True
        req.pending_rollback += num_removed
        req.pending_ids.extend(new_ids)
        if reason is None and (len(req.output_ids) >= req.max_new_tokens
                               or req.seq_len >= self.context_len):
            reason = FinishReason.length()
        self.stats.count("generation_tokens", len(new_ids) - num_removed)
        self.stats.count("jump_forward_tokens", len(new_ids))
        if reason is not None:
            self.sched.finish(req, reason)
        else:
            emit(req, finished=False)

    # ------------------------------------------------------------------ logprobs
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


def emit(req: Req, finished: bool) -> None:
    """Send req's pending deltas (text, ids, rollback, logprobs) to its sink as one
    GenerateOutput, with the finish reason rendered (FinishReason.to_dict()) when finished,
    and clear them; without a sink they are just cleared."""
    if req.sink is None:
        req.pending_ids, req.pending_text, req.pending_rollback = [], "", 0
        req.pending_logprobs, req.pending_top_logprobs = [], []
        return
    out = GenerateOutput(
        rid=req.rid,
        text_delta=req.pending_text,
        output_ids_delta=req.pending_ids,
        finished=finished,
        finish_reason=req.finish_reason.to_dict() if finished else None,
        prompt_tokens=len(req.origin_input_ids),
        completion_tokens=len(req.output_ids),
        cached_tokens=req.cached_tokens or 0,
        output_token_logprobs_delta=req.pending_logprobs,
        output_top_logprobs_delta=req.pending_top_logprobs,
        output_ids_rollback=req.pending_rollback,
    )
    if finished and req.pool is not None and not req.finish_reason.is_abort:
        out.embedding = req.pool_state.embedding(req.pool)
        out.label_logits = list(req.pool_state.label_logits)
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
