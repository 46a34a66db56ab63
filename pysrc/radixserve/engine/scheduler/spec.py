"""SpecDecoder: speculative decoding without a draft model (--speculative-algorithm ngram or
suffix).

Drafts: ngram looks up the request's own history (NgramIndex: the tokens that followed the
latest earlier occurrence of its last n tokens). suffix also asks the prefix cache: the radix
tree holds every recent prompt and finished output, so when another sequence had this
request's whole history as its prefix (a retried or repeated prompt, n > 1 siblings that
finished, an agent loop or RL rollout over the same context), the tokens that followed it there
(PrefixCache.continuation: the most recently used path) are the draft, ahead of the n-gram
proposal (a match of the whole history is the stronger evidence).

Who speculates (eligible()): running requests with no grammar and no penalties (their next
token's distribution depends on the tokens before it only through the model, and on the output
offset through the sampler: min_new_tokens and the seeded draw). Everything else the sampler
does is per row (temperature, top_k/top_p/min_p, logit_bias, logprobs, the EOS ban below
min_new_tokens at each row's own offset), so those requests speculate too. Requests with a
grammar or penalties run unspeculated in the same steps (one row each, as in a decode); n > 1
needs nothing (each sequence is its own request).

A verify step replaces a decode step (DecodeManager._plan_verify): a DECODE step where a request
with a draft d of k tokens takes k + 1 rows, its last token and d (model/step_io.StepInput says
how the draft rows get their inputs and slot tables), so it runs in the decode CUDA graphs. Every
row samples with the request's own parameters at its own output offset. ResultProcessor keeps
the longest prefix of d equal to the samples, then the sample where they first differ (or the
bonus sample after the whole draft); SlotLedger.rollback frees the rest. The sampled draw is a
function of (seed, output offset, the distribution), and a kept token's distribution is
conditioned on the same tokens as without speculation, so every kept token is the token the
request draws without speculation: outputs are unchanged, greedy or sampled (for a one-hot
draft this is the standard accept/resample rule: d[j] is kept with probability p(d[j]), else
the draw comes from p without d[j]).

The gates ("never a slowdown"): a verify step is built only while at most SPEC_MAX_BATCH
requests decode (a busy server's steps are not weight-bound, and extra rows cost real time);
each request drafts by its measured acceptance: ReqSpec keeps an exponential average of the
tokens accepted per verify; the draft length follows it (ceil(average) + 1, at most k), and a
request whose average falls below MIN_ACCEPT stops drafting for COOLDOWN_STEPS of its decode
steps, then probes again with one draft token; and per batch size B a measured cost decides
(RateGate): the mean launch-to-launch period of verify steps and of plain decode steps of B
requests. A verify step is built when its expected tokens (each request 1 + its average
accepted, at most its draft length; 1 for a request without a draft) per verify period beat B
tokens per decode period. Where verify steps cost more than their drafts bring (a CPU, where
every row costs compute; a device already busy; drafts rarely accepted) B runs plain decode,
probing one verify step every PROBE_EVERY steps; where either period is unknown, the step
measures it (the first step of each kind at B is not counted: it carries one-time costs).

Pipeline (issue 39 point 4: the overlapped loop stays on): where it pays (overlap_verify: the
knob RADIXSERVE_SPEC_OVERLAP, auto = RateGate.overlap_pays, measured per batch size: a serial
verify step's period at least 1.5x its device time, i.e. host work and launch latency worth
hiding, as on a GPU with a small model; not on the CPU, where the forward is the period), a
verify step is scheduled over the step in flight as a decode step is, while the device runs
that step. Where it does not pay, a verify step is built only with no step in flight
(Scheduler.spec_wants_host makes the pipeline resolve a decode step first while some request
would draft, and a request that found no draft waits MISS_COOLDOWN steps before it looks
again), and nothing is scheduled over it. Overlapped: The host does not know
what the step in flight computes, so the next step assumes it (DecodeManager._in_flight): a
request it verifies a draft d of is taken to accept all of d (its KV length, output offsets
and num_output_scheduled count d, add_verify), and the token it samples last (its bonus, or a
decode row's token) is unknown here but on the device, where the next step reads it as that
request's first input. The next draft is the proposal for history + d, its first token (a
guess of the unknown one) left out (SpecDecoder.draft); a wrong guess is rejected like any
wrong draft token. Where a draft token is rejected the assumption failed for that request:
  device: the step scheduled over it was told which requests it assumed fully accepted, and
    how many drafts (StepInput.spec_cond_rows); each verify step records every request's
    accepted count (ModelRunner.spec_accepted), and the step after leaves the next input of a
    request whose count differs as it was (the true next token the verify chose), so what it
    computed from the wrong positions never reaches an input;
  host: processing the verify (ResultProcessor._apply_verify) voids the request's entry in the
    step in flight (req.epoch: its results are dropped), frees the rejected tail and that
    step's slots (SlotLedger.rollback) and recounts num_output_scheduled. The step after that
    one is planned from the request's true state.
So a rejection costs the request one step (the voided one), and a fully accepted draft costs
nothing: the next verify was already running. Mixed chunks (--enable-mixed-chunk) carry no
decode rows over a verify in flight (DecodeManager.add_rows: their positions are exact only).

Counters (SchedulerStats): spec_verify_steps, spec_verify_reqs (request-steps with a draft),
spec_draft_tokens, spec_accepted_tokens; mean accept length = (accepted + verify_reqs) /
verify_reqs. Event-loop thread.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Set, Tuple

from radixserve import knobs
from radixserve.cache.base import PrefixCache
from radixserve.config import SPEC_MAX_BATCH, ServerArgs
from radixserve.engine.req import Req
from radixserve.engine.spec.ngram import NgramIndex
from radixserve.model.forward_batch import ForwardMode

EMA_WEIGHT = 0.5        # weight of the newest verify in a request's acceptance average
MIN_ACCEPT = 0.25       # tokens accepted per verify below which a request stops drafting
COOLDOWN_STEPS = 16     # decode steps a request then runs undrafted before it probes again
# decode steps a request runs undrafted after its history had no match, where verify steps run
# serially (each look needs a serial turn); where they overlap, none (a look is an n-gram lookup)
MISS_COOLDOWN = 4
RATE_WEIGHT = 0.3       # weight of the newest step in RateGate's averages
PROBE_EVERY = 32        # decode steps at a batch size before RateGate probes verify again
                        # (and overlapped verify steps before it measures a serial one again)
OVERLAP_MIN_HIDDEN = 1.5   # serial verify period / its device time from which verify overlaps
MAX_INTERVAL_S = 2.0    # a longer period between two steps' scheduling holds idle time


class ReqSpec:
    """One request's drafting state (Req.spec): its n-gram index, the average number of draft
    tokens accepted per verify, and the decode steps left before it drafts again."""

    def __init__(self, index: NgramIndex, num_draft: int):
        self.index = index
        self.num_draft = num_draft
        self.accept_avg = float(num_draft)      # optimistic until measured
        self.cooldown = 0

    def draft_len(self) -> int:
        """Draft tokens to ask for now (0: cooling down)."""
        if self.cooldown > 0:
            return 0
        return min(self.num_draft, math.ceil(self.accept_avg) + 1)

    def observe(self, drafted: int, accepted: int) -> None:
        """A verify of drafted tokens kept accepted of them."""
        self.accept_avg = (1 - EMA_WEIGHT) * self.accept_avg + EMA_WEIGHT * accepted
        if self.accept_avg < MIN_ACCEPT:
            self.cooldown = COOLDOWN_STEPS
            self.accept_avg = 0.0               # probe with one token after the cooldown

    def missed(self, steps: int = MISS_COOLDOWN) -> None:
        """No draft was found: look again after `steps` decode steps."""
        self.cooldown = max(self.cooldown, steps)

    def skipped(self) -> None:
        """A decode step ran without a draft for this request."""
        if self.cooldown > 0:
            self.cooldown -= 1


class RateGate:
    """The mean step period of verify and of plain decode steps, per batch size (see the module
    docstring). A step's period is from its scheduling to the next step's scheduling (with
    overlap the steady step time, serially its host and device time, on the CPU its compute).
    step_scheduled() feeds it, allow() asks it (no side effects)."""

    def __init__(self):
        self.periods: Dict[Tuple[str, int], float] = {}  # (kind, B) -> EMA seconds
        self.seen: Dict[Tuple[str, int], int] = {}        # (kind, B) -> periods measured
        self.since_verify: Dict[int, int] = {}            # B -> decode steps since a verify
        self.since_serial: Dict[int, int] = {}            # B -> overlapped verifies since a serial
        self.verify_device: Dict[int, float] = {}         # B -> EMA device seconds of a verify step
        self._last: Optional[Tuple[str, int, float]] = None   # (kind, B, scheduled at)

    def allow(self, batch_size: int, expected_tokens: float, overlapped: bool = False) -> bool:
        """Build a verify step of batch_size requests expected to yield expected_tokens, over a
        step in flight (overlapped) or not? Each against its own measured period."""
        v = self.periods.get(("verify_over" if overlapped else "verify", batch_size))
        d = self.periods.get(("decode", batch_size))
        if v is None:
            return True                                   # measure verify steps at B
        if d is None:
            return False                                  # measure decode steps at B
        return (expected_tokens / v >= batch_size / d
                or self.since_verify.get(batch_size, 0) >= PROBE_EVERY)

    def overlap_pays(self, batch_size: int) -> bool:
        """Schedule verify steps of batch_size requests over the step in flight? Where a serial
        verify step's period is at least OVERLAP_MIN_HIDDEN x its device time: then more than a
        third of it is host work and launch latency that the overlapped loop hides, which pays
        for the steps a rejection voids (spec.py's "Pipeline": a rejected draft costs its
        request the step after). On the CPU, where the forward is the period, never; on a GPU
        with a small model (host-bound steps), yes. Serial periods are measured first, and
        again every PROBE_EVERY overlapped verify steps."""
        s = self.periods.get(("verify", batch_size))
        d = self.verify_device.get(batch_size)
        if s is None or d is None or self.since_serial.get(batch_size, 0) >= PROBE_EVERY:
            return False
        return s >= OVERLAP_MIN_HIDDEN * d

    def verify_ran(self, batch_size: int, device_s: float) -> None:
        """A verify step of batch_size requests took device_s seconds of device time."""
        old = self.verify_device.get(batch_size)
        self.verify_device[batch_size] = device_s if old is None else \
            (1 - RATE_WEIGHT) * old + RATE_WEIGHT * device_s

    def step_scheduled(self, kind: str, batch_size: int, now: float,
                       over_last: bool = False) -> None:
        """A step was scheduled at now (time.perf_counter()); kind "verify" (nothing in
        flight), "verify_over" (over a step in flight), "decode" or "extend"; over_last: it was
        scheduled while the previous step was still in flight. Ends the previous step's period.
        A serial verify's period is its host and device time only where the step after it was
        scheduled once it was processed: one scheduled over it (overlap_pays turned true
        meanwhile) ends its period at once, and is not counted; the probe of a serial period
        (overlap_pays false after PROBE_EVERY overlapped verifies) ends when it is counted,
        so overlap_pays stays false, and the pipeline resolves the probe, until then."""
        last, self._last = self._last, (kind, batch_size, now)
        if kind in ("verify", "verify_over"):
            self.since_verify[batch_size] = 0
        if kind == "verify_over":
            self.since_serial[batch_size] = self.since_serial.get(batch_size, 0) + 1
        elif kind == "decode":
            self.since_verify[batch_size] = self.since_verify.get(batch_size, 0) + 1
        if last is None:
            return
        kind, batch_size, start = last
        if kind == "extend" or batch_size > SPEC_MAX_BATCH or \
                not 0 < now - start <= MAX_INTERVAL_S:
            return                  # not a decode-phase step, or an idle gap in its period
        if kind == "verify":
            if over_last:
                return              # not a serial period: the next step did not wait for it
            self.since_serial[batch_size] = 0
        key = (kind, batch_size)
        self.seen[key] = self.seen.get(key, 0) + 1
        if self.seen[key] == 1:
            return                  # the first of its kind carries one-time costs: not counted
        old = self.periods.get(key)
        period = now - start
        self.periods[key] = period if old is None else \
            (1 - RATE_WEIGHT) * old + RATE_WEIGHT * period


class SpecDecoder:
    def __init__(self, server_args: ServerArgs, context_len: int,
                 cache: Optional[PrefixCache] = None):
        self.algorithm = server_args.speculative_algorithm
        self.cache = cache                  # suffix drafts read it (continuation)
        self.num_draft = server_args.speculative_num_draft_tokens - 1    # k: drafts a request
        self.min_window = server_args.speculative_ngram_min_match_window_size
        self.max_window = server_args.speculative_ngram_max_match_window_size
        self.context_len = context_len
        self.rate_gate = RateGate()

    @staticmethod
    def eligible(req: Req) -> bool:
        """req's rows may be drafted (see the module docstring)."""
        return req.grammar is None and not req.uses_penalties

    def overlap_verify(self, batch_size: int) -> bool:
        """May a verify step of batch_size requests be scheduled over the step in flight (and a
        step over it)? The knob RADIXSERVE_SPEC_OVERLAP (--debug-spec-overlap): on, off, or
        auto = RateGate.overlap_pays."""
        mode = knobs.value("RADIXSERVE_SPEC_OVERLAP")
        if mode != "auto":
            return mode == "on"
        return self.rate_gate.overlap_pays(batch_size)

    def wants_host(self, decoding: List[Req]) -> bool:
        """Serially (overlap_verify false), a verify step needs every token on the host: may
        one be built next if the step in flight were processed? (The pipeline then resolves
        it instead of scheduling a plain decode over it; only while some request would draft,
        not cooling down.)"""
        return not self.overlap_verify(len(decoding)) and self.gate(decoding) and any(
            self.eligible(r) and (r.spec is None or r.spec.cooldown == 0) for r in decoding)

    def verify_ran(self, batch_size: int, device_s: float) -> None:
        """A verify step's results arrived (RateGate.verify_ran)."""
        self.rate_gate.verify_ran(batch_size, device_s)

    def gate(self, decoding: List[Req], overlapped: bool = False) -> bool:
        """Speculate in a step of these decoding requests (the batch-size and cost gates),
        scheduled over a step in flight (overlapped) or not."""
        n = len(decoding)
        if not 0 < n <= SPEC_MAX_BATCH:
            return False
        expected = 0.0
        for req in decoding:
            state: Optional[ReqSpec] = req.spec
            if not self.eligible(req):
                expected += 1.0
            elif state is None:
                expected += 1.0 + self.num_draft           # unmeasured: optimistic
            else:
                expected += 1.0 + min(state.accept_avg, state.draft_len())
        return self.rate_gate.allow(n, expected, overlapped)

    def step_scheduled(self, batch, now: float, overlapped: bool) -> None:
        """The Scheduler scheduled batch at now, over a step in flight or not
        (RateGate.step_scheduled)."""
        kind = ("verify_over" if overlapped else "verify") if batch.verifies else \
            "decode" if batch.mode is ForwardMode.DECODE else "extend"
        self.rate_gate.step_scheduled(kind, batch.batch_size, now, over_last=overlapped)

    def _state(self, req: Req) -> ReqSpec:
        if req.spec is None:
            req.spec = ReqSpec(NgramIndex(self.min_window, self.max_window), self.num_draft)
        return req.spec

    def drafts(self, reqs: List[Req], pending: Optional[Dict[int, List[int]]] = None,
               unknown: Optional[Set[int]] = None) -> List[List[int]]:
        """Each request's draft for a verify step now ([] for none). pending / unknown: the
        step in flight (DecodeManager._in_flight): {id(req): its draft there}, assumed
        accepted, and {id(req)} of the requests whose next token it computes, not yet known
        here. A request cooling down gets none (and counts nothing: see skip)."""
        pending, unknown = pending or {}, unknown or set()
        miss = 0 if self.overlap_verify(len(reqs)) else MISS_COOLDOWN
        return [self.draft(req, pending.get(id(req), ()), id(req) in unknown, miss)
                for req in reqs]

    def draft(self, req: Req, extra: Sequence[int] = (), unknown: bool = False,
              miss_cooldown: int = MISS_COOLDOWN) -> List[int]:
        """req's draft for its next verify step ([] for none). extra: tokens assumed to
        follow its history (its draft in the step in flight); unknown: the step in flight
        computes one more token after those, which this step reads on the device as its first
        input, so the draft is what follows that token: the proposal for history + extra, its
        first token (a guess of the unknown one) left out. A wrong guess costs only the
        draft: its first token is then rejected as any mismatch is. No draft: the request
        looks again after miss_cooldown decode steps."""
        if not self.eligible(req):
            return []
        state = self._state(req)
        want = state.draft_len()
        if want == 0:
            return []
        # the bonus token counts: at most max_new_tokens - 1 - (output tokens once the steps
        # scheduled so far ran) drafts, and the sequence stays within the context
        room = min(want, req.max_new_tokens - req.num_output_scheduled - 1,
                   self.context_len - len(req.origin_input_ids) - req.num_output_scheduled - 1)
        if room <= 0:
            return []
        skip = 1 if unknown else 0
        history = req.fill_ids
        draft: List[int] = []
        if self.algorithm == "suffix" and self.cache is not None:
            # the whole history matched
            draft = self.cache.continuation(history + list(extra), room + skip)[skip:]
        if not draft:
            state.index.sync(history)
            draft = state.index.propose(room + skip, extra)[skip:]
        if not draft:
            state.missed(miss_cooldown)
        return draft

    def skip(self, reqs: List[Req], drafts: Optional[List[List[int]]] = None) -> None:
        """A step ran in which reqs (those whose drafts entry is empty, when given) computed
        one token without a draft: a step of each one's cooldown passes."""
        for i, req in enumerate(reqs):
            if req.spec is not None and not (drafts and drafts[i]):
                req.spec.skipped()

