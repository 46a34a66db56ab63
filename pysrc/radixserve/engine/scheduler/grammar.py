"""Constrained decoding in the scheduler: the grammar slot's bitmask, advancing matchers, and
jump-forward. Part of Scheduler (core.py); event-loop thread.

  * grammar_bitmask(batch): the step's token bitmask, one row per sampling row, filled after the
    previous step's tokens were processed (pipeline.py, "the grammar slot"). A matcher that
    fails to fill fails its request alone; its row is all ones and its token is dropped.
  * _grammar_accepts(req, tok): the sampled token advances the matcher; a token the grammar
    refuses (possible only when a row's mask allowed nothing) fails that request alone.
  * _jump_forward(req): after a token, when the grammar forces a string, append its tokens
    without forward passes (constrained/jump_forward.py re-tokenizes the seam). The request
    leaves the decode batch: its KV up to the first re-tokenized position is published to the
    prefix cache (never beyond the last token with KV), the replaced tokens are rolled back in
    the matcher and in the streamed ids (GenerateOutput.output_ids_rollback), and it goes to the
    front of the queue, where admission re-matches that prefix and the next extend computes the
    new tokens. A step of it already in flight is dropped (Req.epoch).
"""
from __future__ import annotations

import logging

import torch

from radixserve.constrained.grammar import full_bitmask
from radixserve.constrained.jump_forward import plan_jump
from radixserve.engine.req import Req, ReqStatus
from radixserve.engine.schedule_batch import ScheduleBatch

logger = logging.getLogger("radixserve.engine.scheduler")


class GrammarMixin:
    def grammar_bitmask(self, batch: ScheduleBatch) -> torch.Tensor:
        """[S, ceil(vocab / 32)] int32 host bitmask (pinned on CUDA) of batch's sampling rows."""
        grammars = batch.sampling_grammars()
        owners = [r for i, r in enumerate(batch.reqs) if batch.sample[i]]
        pin = self.kv_pool.device.type == "cuda"
        mask = full_bitmask(len(grammars), self.vocab_size, pin_memory=pin)
        for row, (g, req) in enumerate(zip(grammars, owners)):
            if g is None:
                continue
            try:                        # one matcher's failure must not fail the batch
                g.fill(mask, row)
            except Exception as e:      # noqa: BLE001 - this request fails alone
                logger.exception("request %s: filling its grammar mask failed", req.rid)
                mask[row].fill_(-1)
                req.abort_message = f"internal error in the grammar matcher: {e}"
                req.to_abort = True
        return mask

    def _grammar_accepts(self, req: Req, tok: int) -> bool:
        """Advance req's matcher on tok; False (and req finished with an abort) if refused."""
        if req.grammar.accept(tok):
            return True
        text = self.tokenizer.token_text(tok) if self.tokenizer is not None else str(tok)
        message = (f"the grammar does not allow the sampled token {tok} ({text!r}); the "
                   f"request's constraint leaves no valid continuation here")
        logger.warning("request %s: %s", req.rid, message)
        req.abort_message = message
        # the request's own constraint failed it: a 400 on the OpenAI routes (SGLang's key)
        self._finish(req, {"type": "abort", "matched": None, "message": message,
                           "status_code": 400})
        return False

    def _jump_forward(self, req: Req) -> None:
        """Append the grammar-forced text after req's last token, if any (see the module doc)."""
        text = req.grammar.jump_forward_string()
        if not text or self.tokenizer is None:
            return
        if req.detokenizer is not None and not req.detokenizer.caught_up:
            return                      # its text ends inside a character: jump next time
        plan = plan_jump(self.tokenizer, req.output_ids, text)
        if plan is None:
            return
        removed = req.output_ids[len(req.output_ids) - plan.num_removed:]
        room = min(req.max_new_tokens - (len(req.output_ids) - plan.num_removed),
                   self.context_len - (req.seq_len - plan.num_removed) - 1)
        new_ids = plan.new_ids[:max(room, 0)]
        if not new_ids or (len(new_ids) < len(plan.new_ids) and removed):
            return                      # no room (a cut jump must not drop streamed text)
        req.grammar.rollback(len(removed))
        if not req.grammar.accept_all(new_ids):
            req.grammar.accept_all(removed)     # back to where it was; no jump
            return
        self._leave_batch_for_jump(req, keep=req.seq_len - max(len(removed), 1))
        self._append_jumped(req, len(removed), new_ids)
        if not req.finished:
            req.status = ReqStatus.WAITING
            self.waiting.appendleft(req)
            self.counters["num_jumps"] += 1

    def _leave_batch_for_jump(self, req: Req, keep: int) -> None:
        """Publish req's KV of fill positions [0, keep) (old ids: they are what the KV holds),
        free the rest and its row; a step of it in flight is dropped from now on."""
        self.running.remove(req)
        self._release_kv(req, keep=keep)
        req.epoch += 1

    def _append_jumped(self, req: Req, num_removed: int, new_ids) -> None:
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
                reason = {"type": "stop", "matched": res.stop_matched}
                req.stop_str_matched = True
        req.pending_rollback += num_removed
        req.pending_ids.extend(new_ids)
        if reason is None and (len(req.output_ids) >= req.max_new_tokens
                               or req.seq_len >= self.context_len):
            reason = {"type": "length", "matched": None}
        self.counters["generation_tokens"] += len(new_ids) - num_removed
        self.counters["jump_forward_tokens"] += len(new_ids)
        if reason is not None:
            self._finish(req, reason)
        else:
            self._emit(req, finished=False)
