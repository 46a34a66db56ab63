"""StepPipeline: the step loop of DESIGN.md ("The step pipeline"), in one place.

    turn:  [resolve N-1 first, if N can't be scheduled over it] -> schedule N -> launch N
           -> resolve N-1 (wait for its results, process them)
           -> [the grammar slot: fill N's token bitmask, then sample N] -> N is now in flight

With overlap (the default) the host processes step N-1's results (stop checks, detokenizing,
streaming, admission) and builds step N+1 while the device runs step N. A step is scheduled
over the one in flight only when the host state it needs is known without that step's
results: after a decode step, when no retraction is needed (neither for memory,
Scheduler.decode_memory_short, nor for fairness or priority, Scheduler.preempt_pending); with
speculation (engine/scheduler/spec.py), after a verify step too where verify steps overlap
(Scheduler.spec_overlaps: the step scheduled over it assumes its drafts accepted, and the
device and the host drop what a rejection made wrong), and where they do not, a decode step is
resolved first when a verify step could be built (Scheduler.spec_wants_host); after a prefill
step whose requests all end their prompts there (no chunk to publish, no prompt
logprobs), a step that prefills other waiting requests (Scheduler.can_prefill_over; its
requests join the running batch when it is resolved, so no decode is scheduled over it).
Otherwise the step in flight is resolved first. --disable-overlap-schedule resolves every step
right after launching it (the serial loop, for A/B runs).

The grammar slot: a step with grammar rows is launched up to its logits; its token bitmask needs
the grammar state after step N-1's tokens, so the host fills it (Scheduler.grammar_bitmask)
after resolving N-1, while the device runs N's forward, and then hands it to sample(handle,
bitmask), which samples N. Free rows of the same batch sample under an all-ones mask.

The executor runs the device side of a step, and the pipeline gets it once, at construction:
launch(step_input) -> handle, sample(handle, bitmask) -> handle, wait(handle) -> StepOutput,
all coroutines (StepExecutor). SyncExecutor runs them on the calling thread (Scheduler.step(),
tests, the benchmarks); ThreadedExecutor hands them to AsyncEngine's worker threads. A launch,
sample or wait that raises fails that step's batch (Scheduler.fail_batch), not the loop.

The pipeline owns the step in flight (`inflight`: its batch and handle); the scheduler reads
which batch that is (inflight_batch) and never the handle.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import Any, Optional, Protocol, Tuple

from radixserve.model.forward_batch import ForwardMode

logger = logging.getLogger(__name__)


class StepExecutor(Protocol):
    """Runs a step on the device. Handles are the executor's own; the pipeline only passes them
    back. A coroutine that raises fails the step's batch."""

    async def launch(self, step_input: Any) -> Any:
        """Start the step (up to its logits where it has grammar rows); returns its handle."""

    async def sample(self, handle: Any, bitmask: Any) -> Any:
        """The grammar slot: sample a launched step under bitmask; returns the new handle."""

    async def wait(self, handle: Any) -> Any:
        """The step's StepOutput, once its results reached the host."""


class SyncExecutor:
    """The runner's calls on the calling thread; its coroutines never suspend, so a pipeline
    turn over it runs to completion under run_sync (Scheduler.step)."""

    def __init__(self, runner: Any):
        self.runner = runner

    async def launch(self, step_input):
        return self.runner.launch(step_input)

    async def sample(self, handle, bitmask):
        return self.runner.sample_masked(handle, bitmask)

    async def wait(self, handle):
        return handle.wait()


class ThreadedExecutor:
    """AsyncEngine's executor: launch and sample run on one forward worker thread (in order, so
    a sample finds its launch done), and the blocking event wait of a step on a waiter thread;
    the loop thread only awaits. start() before the first step, shutdown() after the last."""

    def __init__(self, runner: Any):
        self.runner = runner
        self._forward: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._waiter: Optional[concurrent.futures.ThreadPoolExecutor] = None

    def start(self) -> int:
        """Start the worker threads; returns the forward worker's thread ident."""
        self._forward = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="radixserve-forward")
        self._waiter = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="radixserve-wait")
        return self._forward.submit(threading.get_ident).result()

    def shutdown(self) -> None:
        """Release the worker threads (their queued jobs run first)."""
        for pool in (self._forward, self._waiter):
            if pool is not None:
                pool.shutdown(wait=True)
        self._forward = self._waiter = None

    async def launch(self, step_input):
        """Hand the step to the forward worker; the handle is that worker's (concurrent) future."""
        return self._forward.submit(self.runner.launch, step_input)

    async def sample(self, handle, bitmask):
        """On the forward worker after its launch (the worker runs jobs in order)."""
        return self._forward.submit(lambda: self.runner.sample_masked(handle.result(), bitmask))

    async def wait(self, handle):
        pending = await asyncio.wrap_future(handle)    # launched (CUDA) or computed (CPU)
        if pending.ready():
            return pending.wait()
        return await asyncio.get_running_loop().run_in_executor(self._waiter, pending.wait)


class StepPipeline:
    """scheduler: schedule(prefill_only=), can_prefill_over(batch), decode_memory_short(),
    preempt_pending(), spec_overlaps(batch), spec_wants_host(), grammar_bitmask(batch),
    process_batch_result(batch, out), fail_batch(batch, error), looked up on it at every call. executor: a StepExecutor.
    overlap: schedule over the step in flight where its inputs allow (module docstring)."""

    def __init__(self, scheduler: Any, executor: StepExecutor, overlap: bool):
        self.scheduler = scheduler
        self.executor = executor
        self.overlap = overlap
        self.inflight: Optional[Tuple[Any, Any]] = None     # (ScheduleBatch, handle)
        self.num_overlapped = 0    # steps launched while the previous one was still in flight
        self.num_over_extend = 0   # of those, prefills launched over an extend step in flight

    @property
    def inflight_batch(self):
        """The batch of the step in flight (launched, its results not processed), or None."""
        return None if self.inflight is None else self.inflight[0]

    async def turn(self) -> bool:
        """One turn; False when there was nothing to schedule and nothing in flight."""
        sched = self.scheduler
        had_inflight = self.inflight is not None
        batch = await self._schedule()
        launched = None
        if batch is not None:
            if self.inflight is not None:
                self.num_overlapped += 1
                self.num_over_extend += self.inflight[0].mode is ForwardMode.EXTEND
            try:
                launched = (batch, await self.executor.launch(batch.step_input))
            except Exception as e:       # noqa: BLE001 - a failed launch fails its batch
                logger.exception("launching a step failed")
                sched.fail_batch(batch, e)
        if self.inflight is not None:
            await self._resolve()
        if launched is not None and batch.step_input.sampling.grammar_rows:
            launched = await self._sample_masked(launched)
        self.inflight = launched
        if launched is not None and not self.overlap:
            await self._resolve()
        return batch is not None or had_inflight

    async def _schedule(self):
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
        await self._resolve()
        return sched.schedule()

    async def _sample_masked(self, launched):
        """The grammar slot: N-1 is processed, so each grammar row's state is current."""
        batch, handle = launched
        try:
            return batch, await self.executor.sample(handle, self.scheduler.grammar_bitmask(batch))
        except Exception as e:           # noqa: BLE001 - a failed sample fails its batch
            logger.exception("sampling a grammar step failed")
            self.scheduler.fail_batch(batch, e)
            return None

    def _can_schedule_over(self, batch) -> bool:
        return (self.overlap and batch.mode is ForwardMode.DECODE
                and (not batch.verifies or self.scheduler.spec_overlaps(batch))
                and not self.scheduler.decode_memory_short()
                and not self.scheduler.preempt_pending()
                and not self.scheduler.spec_wants_host())

    async def drain(self) -> None:
        """Resolve the step in flight, if any (shutdown, tests)."""
        if self.inflight is not None:
            await self._resolve()

    async def _resolve(self) -> None:
        batch, handle = self.inflight
        self.inflight = None
        try:
            out = await self.executor.wait(handle)
        except Exception as e:           # noqa: BLE001 - a failed step fails its batch
            logger.exception("a step failed on the device")
            self.scheduler.fail_batch(batch, e)
            return
        self.scheduler.process_batch_result(batch, out)

    def inflight_reqs(self):
        """The requests of the step in flight ([] when none)."""
        return [] if self.inflight is None else self.inflight[0].reqs


def run_sync(coro):
    """Run a coroutine that never suspends (synchronous launch/wait) to its result."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("a synchronous pipeline turn suspended")
