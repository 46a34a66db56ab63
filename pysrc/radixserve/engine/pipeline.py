"""StepPipeline: the step loop of DESIGN.md ("The step pipeline"), in one place.

    turn:  [resolve N-1 first, if N can't be scheduled over it] -> schedule N -> launch N
           -> resolve N-1 (wait for its results, process them)
           -> [the grammar slot: fill N's token bitmask, then sample N] -> N is now in flight

With overlap (the default) the host processes step N-1's results (stop checks, detokenizing,
streaming, admission) and builds step N+1 while the device runs step N. A step is scheduled
over the one in flight only when the host state it needs is known without that step's
results: after a decode step, when no retraction is needed (neither for memory,
Scheduler.decode_memory_short, nor for fairness, Scheduler.fair_preempt_pending); after a
prefill step whose requests all end their prompts there (no chunk to publish, no prompt
logprobs), a step that prefills other waiting requests (Scheduler.can_prefill_over; its
requests join the running batch when it is resolved, so no decode is scheduled over it).
Otherwise the step in flight is resolved first. --disable-overlap-schedule resolves every step
right after launching it (the serial loop, for A/B runs).

The grammar slot: a step with grammar rows is launched up to its logits; its token bitmask needs
the grammar state after step N-1's tokens, so the host fills it (Scheduler.grammar_bitmask)
after resolving N-1, while the device runs N's forward, and then hands it to sample(handle,
bitmask), which samples N. Free rows of the same batch sample under an all-ones mask.

launch(step_input) -> handle, sample(handle, bitmask) -> handle and wait(handle) -> StepOutput
are coroutines the owner supplies: AsyncEngine hands them to its worker threads;
Scheduler.step() runs them synchronously (tests). A launch, sample or wait that raises fails
that step's batch (Scheduler.fail_batch), not the loop.
"""
from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable, Optional, Tuple

from radixserve.model.forward_batch import ForwardMode

logger = logging.getLogger(__name__)

Launch = Callable[[Any], Awaitable[Any]]
Sample = Callable[[Any, Any], Awaitable[Any]]
Wait = Callable[[Any], Awaitable[Any]]


class StepPipeline:
    def __init__(self, scheduler, overlap: bool):
        self.scheduler = scheduler
        self.overlap = overlap
        self.inflight: Optional[Tuple[Any, Any]] = None     # (ScheduleBatch, handle)
        self.num_overlapped = 0    # steps launched while the previous one was still in flight
        self.num_over_extend = 0   # of those, prefills launched over an extend step in flight

    async def turn(self, launch: Launch, wait: Wait, sample: Optional[Sample] = None) -> bool:
        """One turn; False when there was nothing to schedule and nothing in flight."""
        sched = self.scheduler
        had_inflight = self.inflight is not None
        batch = await self._schedule(wait)
        launched = None
        if batch is not None:
            if self.inflight is not None:
                self.num_overlapped += 1
                self.num_over_extend += self.inflight[0].mode is ForwardMode.EXTEND
            try:
                launched = (batch, await launch(batch.step_input))
            except Exception as e:       # noqa: BLE001 - a failed launch fails its batch
                logger.exception("launching a step failed")
                sched.fail_batch(batch, e)
        if self.inflight is not None:
            await self._resolve(wait)
        if launched is not None and batch.step_input.sampling.grammar_rows:
            launched = await self._sample_masked(launched, sample)
        self.inflight = launched
        if launched is not None and not self.overlap:
            await self._resolve(wait)
        return batch is not None or had_inflight

    async def _schedule(self, wait: Wait):
        """Step N's batch (or None): scheduled over the step in flight where its inputs allow
        (a decode after a decode; a prefill after a prefill whose requests all end their
        prompts), else after resolving that step."""
        sched = self.scheduler
        if self.inflight is None or self._can_schedule_over(self.inflight[0]):
            return sched.schedule()
        if self.overlap and sched.can_prefill_over(self.inflight[0]):
            batch = sched.schedule(prefill_only=True)
            if batch is not None:
                return batch
        await self._resolve(wait)
        return sched.schedule()

    async def _sample_masked(self, launched, sample: Sample):
        """The grammar slot: N-1 is processed, so each grammar row's state is current."""
        batch, handle = launched
        try:
            return batch, await sample(handle, self.scheduler.grammar_bitmask(batch))
        except Exception as e:           # noqa: BLE001 - a failed sample fails its batch
            logger.exception("sampling a grammar step failed")
            self.scheduler.fail_batch(batch, e)
            return None

    def _can_schedule_over(self, batch) -> bool:
        return (self.overlap and batch.mode is ForwardMode.DECODE
                and not self.scheduler.decode_memory_short()
                and not self.scheduler.fair_preempt_pending())

    async def drain(self, wait: Wait) -> None:
        """Resolve the step in flight, if any (shutdown, tests)."""
        if self.inflight is not None:
            await self._resolve(wait)

    async def _resolve(self, wait: Wait) -> None:
        batch, handle = self.inflight
        self.inflight = None
        try:
            out = await wait(handle)
        except Exception as e:           # noqa: BLE001 - a failed step fails its batch
            logger.exception("a step failed on the device")
            self.scheduler.fail_batch(batch, e)
            return
        self.scheduler.process_batch_result(batch, out)

    def inflight_reqs(self):
        return [] if self.inflight is None else self.inflight[0].reqs


def run_sync(coro):
    """Run a coroutine that never suspends (synchronous launch/wait) to its result."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("a synchronous pipeline turn suspended")
