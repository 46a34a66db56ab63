"""GrammarSlot: constrained decoding's part of the scheduler, over the requests' grammar matchers.
It holds no queue state and calls no other part; event-loop thread.

  * bitmask(batch): the step's token bitmask, one row per sampling row, filled after the
    previous step's tokens were processed (pipeline.py, "the grammar slot"). A matcher that
    fails to fill fails its request alone: its row is all ones, the request is marked to abort
    and its token is dropped.
  * refusal(tok): the sampled token advances the request's matcher; a token the grammar refuses
    (possible only when a row's mask allowed nothing) gives the abort that fails that request
    alone (status_code 400: its own constraint failed it).
  * plan_jump(req): after a token, when the grammar forces a string, the tokens that replace
    the output's tail (constrained/jump_forward.py re-tokenizes the seam), with the matcher
    already moved past them. The ResultProcessor (results.py) applies the jump: the request
    leaves the decode batch, its KV up to the first re-tokenized position is published to the
    prefix cache (never beyond the last token with KV), the replaced tokens are rolled back in
    the streamed ids (GenerateOutput.output_ids_rollback), and it goes to the front of the
    queue, where admission re-matches that prefix and the next extend computes the new tokens.
    A step of it already in flight is dropped (Req.epoch).
"""
from __future__ import annotations

import logging
from typing import Any, List, NamedTuple, Optional

import torch

from radixserve.constrained.grammar import full_bitmask
from radixserve.constrained.jump_forward import plan_jump
from radixserve.engine.req import FinishReason, Req
from radixserve.engine.schedule_batch import ScheduleBatch

logger = logging.getLogger("radixserve.engine.scheduler")


class Jump(NamedTuple):
    """Replace the last num_removed output ids with new_ids (the matcher is there already)."""
    num_removed: int
    new_ids: List[int]


class GrammarSlot:
    """vocab_size: the bitmask's width. pin: pinned host masks (CUDA). tokenizer: token text for
    messages, and jump-forward's re-tokenizing (none: no jumps). context_len: a jump never
    takes a request past it. jump_forward: whether to jump (--disable-jump-forward; writable)."""

    def __init__(self, vocab_size: int, tokenizer: Any, context_len: int, pin: bool,
                 jump_forward: bool = True):
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.context_len = context_len
        self.pin = pin
        self.jump_forward = jump_forward

    def bitmask(self, batch: ScheduleBatch) -> torch.Tensor:
        """[S, ceil(vocab / 32)] int32 host bitmask (pinned on CUDA) of batch's sampling rows."""
        grammars = batch.sampling_grammars()
        owners = [batch.reqs[i] for i in batch.sampling_owners()]
        mask = full_bitmask(len(grammars), self.vocab_size, pin_memory=self.pin)
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

    def refusal(self, req: Req, tok: int) -> Optional[FinishReason]:
        """Advance req's matcher on tok: None if it accepts, else the abort that finishes req
        (req.abort_message set)."""
        if req.grammar.accept(tok):
            return None
        text = self.tokenizer.token_text(tok) if self.tokenizer is not None else str(tok)
        message = (f"the grammar does not allow the sampled token {tok} ({text!r}); the "
                   f"request's constraint leaves no valid continuation here")
        logger.warning("request %s: %s", req.rid, message)
        req.abort_message = message
        # the request's own constraint failed it: a 400 on the OpenAI routes (SGLang's key)
        return FinishReason.abort(message, status_code=400)

    def plan_jump(self, req: Req) -> Optional[Jump]:
        """The jump after req's last token, if jump-forward applies and the grammar forces text
        that fits (max_new_tokens, the context length); the matcher is moved past it. None
        (nothing changed) otherwise."""
        if not (self.jump_forward and req.can_jump_forward):
            return None
        text = req.grammar.jump_forward_string()
        if not text or self.tokenizer is None:
            return None
        if req.detokenizer is not None and not req.detokenizer.caught_up:
            return None                 # its text ends inside a character: jump next time
        plan = plan_jump(self.tokenizer, req.output_ids, text)
        if plan is None:
            return None
        removed = req.output_ids[len(req.output_ids) - plan.num_removed:]
        room = min(req.max_new_tokens - (len(req.output_ids) - plan.num_removed),
                   self.context_len - (req.seq_len - plan.num_removed) - 1)
        new_ids = plan.new_ids[:max(room, 0)]
        if not new_ids or (len(new_ids) < len(plan.new_ids) and removed):
            return None                 # no room (a cut jump must not drop streamed text)
        req.grammar.rollback(len(removed))
        if not req.grammar.accept_all(new_ids):
            req.grammar.accept_all(removed)     # back to where it was; no jump
            return None
        return Jump(len(removed), list(new_ids))
