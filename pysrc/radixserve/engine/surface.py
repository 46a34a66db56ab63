"""EngineSurface: the half of an engine the server's routes talk to that needs no model, shared
by the engine itself (async_engine.AsyncEngine) and its client in another process
(client.EngineClient, --engine-process): request validation, the waiting-queue admission check,
and the delivery of a request's outputs from its queue to its consumer.

A subclass sets, before serving: server_args, model_config, context_len, served_model_name,
pooling_method and lm_head_loaded; it implements max_total_tokens (the KV pool's tokens) and
waiting_count() (sequences in the waiting queue), and keeps _draining.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import AsyncIterator, Optional

from radixserve.engine import validation
from radixserve.engine.io import GenerateOutput, GenerateReqInput
from radixserve.engine.pooling import POOLING_METHODS
from radixserve.errors import EngineOverloaded, RequestError


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


async def deliver(queue: asyncio.Queue, interval: int) -> AsyncIterator[GenerateOutput]:
    """A request's outputs as its consumer should see them, from the queue its engine sink
    fills: outputs that piled up while the consumer was busy merged into one; with
    --stream-interval N > 1, after the first output, one per N new tokens (the last at once).
    An exception in the queue (the request was refused after it was sent: client.EngineClient)
    is raised. Ends after the output with finished=True."""
    held: Optional[GenerateOutput] = None       # --stream-interval: tokens not yet yielded
    sent_tokens: Optional[int] = None           # completion_tokens at the last yield
    while True:
        out = await queue.get()
        if isinstance(out, BaseException):
            raise out
        while not out.finished and not queue.empty():
            # the consumer fell behind the steps: one merged delta, not one per step
            nxt = queue.get_nowait()
            if isinstance(nxt, BaseException):
                raise nxt
            out = merge_outputs(out, nxt)
        if held is not None:
            out, held = merge_outputs(held, out), None
        if (interval > 1 and not out.finished and sent_tokens is not None
                and out.completion_tokens - sent_tokens < interval):
            held = out                      # the first output and the last go at once
            continue
        sent_tokens = out.completion_tokens
        yield out
        if out.finished:
            return


class EngineSurface:
    """validate / check_capacity over the facts a subclass sets (the module's docstring)."""

    _draining = False

    @property
    def max_total_tokens(self) -> int:
        """Tokens the KV pool holds."""
        raise NotImplementedError

    def waiting_count(self) -> int:
        """Sequences in the engine's waiting queue now."""
        raise NotImplementedError

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
        pool = self.max_total_tokens
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
        waiting = self.waiting_count()
        if waiting + num_new > limit:
            raise EngineOverloaded(f"the server is busy: {waiting} sequences are waiting and "
                                   f"--max-queued-requests is {limit}; retry shortly",
                                   retry_after_s=1)
