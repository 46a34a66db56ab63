"""Priority scheduling (issue 40 point 6; the rules are in engine/scheduler/priority.py and
prefill.py's docstring): with --enable-priority-scheduling the waiting queue is ordered by the
request's `priority` (higher values first, SGLang's default; lower ones with
--schedule-low-priority-values-first), a waiting request that beats running ones by more than
--priority-scheduling-preemption-threshold retracts the least urgent of them when the running
slots or the KV memory keep it out, and retraction for memory takes the least urgent first.
Without the flag a priority is ignored (or refused with --abort-on-priority-when-disabled).

Every scheduler test counts scheduler steps (Scheduler.step(): one pipeline turn), never
seconds; integrity is checked after every step and every slot and row must come home."""
import random
from types import SimpleNamespace

import pytest
import torch
from starlette.testclient import TestClient

from radixserve.config import REFUSED_SGLANG_FLAGS, ServerArgs
from radixserve.engine import policy
from radixserve.engine.req import Req, ReqStatus
from radixserve.engine.scheduler.priority import LEAST_URGENT, PriorityOrder
from radixserve.errors import ApiError, RequestError
from radixserve.sampling.params import SamplingParams
from radixserve.server import requests as R
from radixserve.server.app import create_app

from conftest import run_to_completion
from test_fair_preemption import assert_all_slots_home, record_extends, scrape, steps_until
from test_server_fake_engine import LOCAL, FakeEngine, err_of

K_STEPS = 4       # an urgent request that may preempt has its first token within this many steps


def req(rid, ids, n, priority=None):
    sp = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    return Req(rid, list(ids), sp, n, priority=priority)


def run_counting(sched, arrivals, max_steps=2000):
    """Step sched to the end, integrity after every step. arrivals: {step index: [reqs]} added
    before that step (index 0: before the first). Returns ({rid: index of the step after which
    it first had an output token}, {rid: its arrival index}, {rid: the rids still waiting
    when it arrived}); its TTFT in steps is first - arrived."""
    arrivals = dict(arrivals)
    arrived, first, live, queued = {}, {}, [], {}
    step = 0
    while sched.has_work() or arrivals:
        for r in arrivals.pop(step, []):
            queued[r.rid] = [x.rid for x in live if x.status is ReqStatus.WAITING]
            sched.add_request(r)
            arrived[r.rid] = step
            live.append(r)
        sched.step()
        sched.check_integrity()
        step += 1
        for r in live:
            if r.rid not in first and r.output_ids:
                first[r.rid] = step
        assert step < max_steps, "no progress"
    return first, arrived, queued


# ------------------------------------------------------------------ (a) + (e) TTFT in steps

@pytest.mark.parametrize("mode", ["queue-order", "preempt", "off"])
def test_urgent_request_ttft_in_steps_beats_the_queue(make_scheduler, greedy_alone, text_prompts,
                                                      mode):
    """The acceptance case: two running slots, six priority-0 requests sent first (two run,
    four queue), then a priority-50 request. Ordering alone (preemption off) gives it the first
    slot that frees, ahead of the four queued before it; with preemption (threshold 10) it
    retracts a running one and has its first token within K_STEPS steps. Either way its TTFT,
    counted in scheduler steps from its arrival, is lower than every low-priority request's
    that was queued when it came. Without --enable-priority-scheduling (mode off: the default) the
    priority is ignored and it waits behind all of them (fcfs), with no retraction."""
    kw = dict(max_running_requests=2)
    if mode != "off":
        kw.update(enable_priority_scheduling=True,
                  disable_priority_preemption=mode == "queue-order")
    sched = make_scheduler(**kw)
    assert (sched.priority is None) == (mode == "off")
    lens = [10, 14, 10, 10, 10, 10]          # the two running ones free their slots in turn
    lows = [req(f"low{i}", text_prompts[i] + [700 + i], n, priority=0)
            for i, n in enumerate(lens)]
    high = req("high", text_prompts[6] + [777], 6, priority=50)
    first, arrived, queued = run_counting(sched, {0: lows, 3: [high]})
    assert queued["high"] == ["low2", "low3", "low4", "low5"]      # two run, four queue
    waiting_at_arrival = lows[2:]
    ttft = {rid: first[rid] - arrived[rid] for rid in first}
    if mode == "off":
        assert all(first[high.rid] > first[r.rid] for r in waiting_at_arrival), first
        assert high.admit_order > max(r.admit_order for r in lows)           # fcfs
        assert sched.counters["num_priority_retractions"] == 0
    else:
        assert all(first[high.rid] < first[r.rid] for r in waiting_at_arrival), first
        assert all(ttft["high"] < ttft[r.rid] for r in waiting_at_arrival), ttft
        assert high.admit_order < min(r.admit_order for r in waiting_at_arrival)
    if mode == "preempt":
        assert ttft["high"] <= K_STEPS, ttft
        assert sched.counters["num_priority_retractions"] == 1
        victim = next(r for r in lows if r.num_retractions)
        assert victim.output_ids == greedy_alone(victim.origin_input_ids, victim.max_new_tokens)
    if mode == "queue-order":
        assert sched.counters["num_priority_retractions"] == 0
        assert ttft["high"] > K_STEPS                     # it waited for a slot to free
    assert sched.counters["num_retractions"] == 0
    assert high.output_ids == greedy_alone(high.origin_input_ids, 6)
    assert all(r.finish_reason["type"] == "length" for r in lows + [high])
    assert_all_slots_home(sched)


# ------------------------------------------------------------------ (b) which end is urgent

def _fake_reqs(priorities):
    return [req(f"q{i}", [10 + i, 2, 3], 1, priority=p) for i, p in enumerate(priorities)]


def test_order_is_priority_then_policy_stable_by_arrival():
    """PriorityOrder.order: most urgent class first, each class in the policy's order (fcfs:
    arrival), None at the least urgent end unless --default-priority-value places it."""
    reqs = _fake_reqs([None, 3, 3, 7, None, 3])
    rids = lambda order: [r.rid for r in order.order(policy.fcfs)(reqs, None)]   # noqa: E731
    assert rids(PriorityOrder()) == ["q3", "q1", "q2", "q5", "q0", "q4"]
    assert rids(PriorityOrder(low_values_first=True)) == ["q1", "q2", "q5", "q3", "q0", "q4"]
    assert rids(PriorityOrder(default=5)) == ["q3", "q0", "q4", "q1", "q2", "q5"]
    assert rids(PriorityOrder(default=5, low_values_first=True)) == \
        ["q1", "q2", "q5", "q0", "q4", "q3"]
    assert PriorityOrder().urgency(reqs[0]) == LEAST_URGENT
    assert PriorityOrder(low_values_first=True).urgency(reqs[3]) == -7


def test_lpm_orders_within_a_priority_class():
    """With lpm the longest cached prefix goes first, but only within a class: a short-prefix
    urgent request still goes before a long-prefix one of lower priority."""
    reqs = _fake_reqs([1, 1, 9, 9])
    cached = {10: 0, 11: 5, 12: 1, 13: 4}      # keyed by each request's first prompt id

    class Cache:
        supports_sharing = True

        def match_prefix(self, key):
            return SimpleNamespace(indices=torch.empty(cached[key[0]]))

    order = PriorityOrder().order(policy.lpm)
    assert [r.rid for r in order(reqs, Cache())] == ["q3", "q2", "q1", "q0"]


def test_preemption_rule_is_strictly_more_than_the_threshold():
    order = PriorityOrder(threshold=10)
    low, mid, high, none = (req(f"r{p}", [1], 1, priority=p) for p in (0, 10, 11, None))
    assert order.beats(high, low) and not order.beats(mid, low) and not order.beats(low, high)
    assert order.beats(low, none) and not order.beats(none, none)
    flipped = PriorityOrder(threshold=10, low_values_first=True)
    assert flipped.beats(low, high) and not flipped.beats(high, low)
    assert not PriorityOrder(preempt=False).may_preempt(high, [low])


@pytest.mark.parametrize("low_first", [False, True])
def test_the_ordering_flag_flips_which_end_is_urgent(make_scheduler, text_prompts, low_first):
    """One running slot held by a priority-5 request; a priority-1 and then a priority-9 request
    queue behind it (neither beats it by more than 10: no retraction). Higher values first
    (SGLang's default): 9 starts before 1; with --schedule-low-priority-values-first: 1
    before 9."""
    sched = make_scheduler(max_running_requests=1, enable_priority_scheduling=True,
                           schedule_low_priority_values_first=low_first)
    filler = req("filler", text_prompts[0], 4, priority=5)
    one = req("one", text_prompts[1], 3, priority=1)
    nine = req("nine", text_prompts[2], 3, priority=9)
    first, _, queued = run_counting(sched, {0: [filler], 1: [one, nine]})
    assert queued["nine"] == ["one"]
    urgent, other = (one, nine) if low_first else (nine, one)
    assert urgent.admit_order < other.admit_order
    assert first[urgent.rid] < first[other.rid]
    assert sched.counters["num_priority_retractions"] == 0
    assert_all_slots_home(sched)


# --------------------------------------------------------------------------- (c) preemption

@pytest.mark.parametrize("overlap", [True, False])
def test_full_pool_retracts_the_least_urgent_for_an_urgent_arrival(make_scheduler, greedy_alone,
                                                                   text_prompts, overlap):
    """The KV memory, not the running slots, is full: in an 80-slot pool two running requests
    (priorities 0 and 5) with their decode reserve leave no room for a priority-50 request.
    The least urgent one (priority 0, though admitted first) is retracted: its KV goes to the
    radix tree and it goes back to the queue with its output; the urgent request has its first
    token within K_STEPS steps; the victim resumes re-prefilling only its last token and ends
    with exactly its unpressured greedy output; every slot comes home."""
    sched = make_scheduler(max_total_tokens=80, enable_priority_scheduling=True,
                           disable_overlap_schedule=not overlap)
    extends = record_extends(sched)
    running = [req(f"run{i}", text_prompts[i] + [300 + i], 30, priority=p)
               for i, p in enumerate((0, 5))]
    for r in running:
        sched.add_request(r)
    steps_until(sched, lambda: all(r.status is ReqStatus.RUNNING for r in running), 10)
    for _ in range(2):
        sched.step()
        sched.check_integrity()
    assert sched.num_running == 2 < sched.max_running_requests     # slots are free: memory is not
    rng = random.Random(5)
    urgent = req("urgent", [rng.randrange(256, 49152) for _ in range(24)], 12, priority=50)
    sched.add_request(urgent)
    assert steps_until(sched, lambda: len(urgent.output_ids) >= 1, K_STEPS) <= K_STEPS
    assert sched.counters["num_priority_retractions"] == 1
    victim = next(r for r in running if r.num_retractions)
    assert victim is running[0]                               # the least urgent, not the latest
    assert victim.status is ReqStatus.WAITING
    retracted_at = len(victim.output_ids)
    run_to_completion(sched, [])
    assert sched.counters["num_retractions"] == 0              # none for memory at decode
    assert urgent.output_ids == greedy_alone(urgent.origin_input_ids, 12)
    for r in running:
        assert r.output_ids == greedy_alone(r.origin_input_ids, 30), r.rid
    resumed = [(start, n) for r, start, n, k in extends if r is victim and k == 1]
    assert resumed == [(len(victim.origin_input_ids) + retracted_at - 1, 1)]
    assert_all_slots_home(sched)


@pytest.mark.parametrize("urgent_priority, disabled, preempts", [
    (10, False, False),       # a difference equal to the threshold does not preempt
    (11, False, True),        # strictly more does
    (11, True, False),        # --disable-priority-preemption: queue order only
])
def test_running_cap_preemption_threshold_and_switch(make_scheduler, greedy_alone, text_prompts,
                                                     urgent_priority, disabled, preempts):
    """The running slots (--max-running-requests 2) are what is full: two priority-0 requests
    decode. An arrival beating them by more than the threshold (10) retracts the latest
    admitted of them and starts at once; one that only ties the threshold, or any arrival with
    --disable-priority-preemption, waits for a slot."""
    sched = make_scheduler(max_running_requests=2, enable_priority_scheduling=True,
                           disable_priority_preemption=disabled)
    running = [req(f"run{i}", text_prompts[i] + [400 + i], 12, priority=0) for i in range(2)]
    urgent = req("urgent", text_prompts[5], 4, priority=urgent_priority)
    first, arrived, queued = run_counting(sched, {0: running, 3: [urgent]})
    assert queued["urgent"] == []                      # both run: the slots are what is full
    ttft = first["urgent"] - arrived["urgent"]
    assert sched.counters["num_priority_retractions"] == int(preempts)
    if preempts:
        assert ttft <= K_STEPS
        assert [r.num_retractions for r in running] == [0, 1]   # equal priority: the latest
    else:
        assert all(r.num_retractions == 0 for r in running)
        assert ttft > K_STEPS                           # it waited for a running request to end
        assert urgent.admit_order > max(r.admit_order for r in running)
    for r in running + [urgent]:
        assert r.output_ids == greedy_alone(r.origin_input_ids, r.max_new_tokens), r.rid
    assert_all_slots_home(sched)


def test_retraction_for_memory_takes_the_least_urgent_first(make_scheduler, text_prompts):
    """A 200-slot pool and eight 40-token requests: decode runs out of memory and retracts.
    The first victim is the priority-0 request, admitted first (without priorities it would be
    the last one chosen: retraction takes the latest admitted); the others are priority 5 (no
    one beats anyone by more than 10, so nothing is preempted at admission). Outputs equal the
    unpressured ones and every slot comes home."""
    prompts = text_prompts[:8]
    ref_sched = make_scheduler()
    ref = [req(f"ref{i}", p, 40) for i, p in enumerate(prompts)]
    run_to_completion(ref_sched, ref, check=False)
    sched = make_scheduler(max_total_tokens=200, enable_priority_scheduling=True)
    reqs = [req(f"t{i}", p, 40, priority=0 if i == 0 else 5) for i, p in enumerate(prompts)]
    victims = []
    retract = sched.retract

    def recording(r):
        victims.append(r)
        retract(r)

    sched.retract = recording
    sched.add_request(reqs[0])                 # admitted first (admit order 0) ...
    sched.step()
    assert reqs[0].admit_order == 0
    run_to_completion(sched, reqs[1:])         # ... then the rest, more urgent, queue up
    assert sched.counters["num_retractions"] > 0 and victims
    assert victims[0] is reqs[0], [v.rid for v in victims]
    assert sched.counters["num_priority_retractions"] == 0
    for r, want in zip(reqs, ref):
        assert r.output_ids == want.output_ids, r.rid
    assert_all_slots_home(sched)


def test_priority_retractions_are_a_metric(make_scheduler):
    sched = make_scheduler()
    assert sched.metrics()["num_priority_retractions"] == 0
    sched.counters["num_priority_retractions"] = 2
    text = scrape(sched)
    assert 'radixserve:num_priority_retractions_total{model_name="m"} 2.0' in text


# --------------------------------------------------------------------------- (d) requests and flags

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
PARSERS = [(R.parse_chat_request, CHAT), (R.parse_completion_request, {"prompt": "hi"}),
           (R.parse_generate_request, {"text": "hi"})]


@pytest.mark.parametrize("parse, body", PARSERS, ids=["chat", "completions", "generate"])
def test_priority_is_parsed_once_into_the_typed_request(parse, body):
    for value in (0, 7, -3, 2 ** 63 - 1, None):
        assert parse({**body, "priority": value}).priority == value
    assert parse(body).priority is None
    for bad in (True, False, "5", 5.5, 5.0, [1], {"p": 1}, 2 ** 63):
        with pytest.raises(ApiError) as e:
            parse({**body, "priority": bad})
        assert e.value.status == 400 and e.value.param == "priority", bad
        assert e.value.message.startswith("priority must be an integer"), e.value.message


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", {"model": "fake", **CHAT}),
                                        ("/v1/completions", {"prompt": "hi"}),
                                        ("/generate", {"text": "hi"})])
def test_every_route_hands_the_priority_to_each_sequence(path, body):
    """Over HTTP: the routes' sequences carry the priority (n = 2: both); a bool is a 400 naming
    it before anything reaches the engine."""
    engine = FakeEngine()
    n = {"sampling_params": {"n": 2, "max_new_tokens": 2}} if path == "/generate" else \
        {"n": 2, "max_tokens": 2}
    with TestClient(create_app(engine), base_url=LOCAL) as client:
        r = client.post(path, json={**body, **n, "priority": 42})
        assert r.status_code == 200, r.text
        assert [s.priority for s in engine.seen] == [42, 42]
        err_of(client.post(path, json={**body, "priority": True}), 400, "priority")
    assert len(engine.seen) == 2


def test_disabled_priority_is_ignored_or_refused(smol_engine, monkeypatch):
    """Without --enable-priority-scheduling a request's priority is ignored (SGLang's default);
    with --abort-on-priority-when-disabled it is refused with a 400 naming priority (SGLang
    aborts it) before anything runs, while a request without one still runs. The offline
    Engine takes priority too (an int: a bool is a ValueError naming it)."""
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    plain = smol_engine.native("/generate", body)
    assert smol_engine.native("/generate", {**body, "priority": 9})["text"] == plain["text"]
    out = smol_engine.generate("Hello", {"max_new_tokens": 2, "temperature": 0}, priority=-4)
    assert out["meta_info"]["completion_tokens"] == 2
    with pytest.raises(RequestError) as e:
        smol_engine.generate("Hello", {"max_new_tokens": 2}, priority=True)
    assert e.value.param == "priority"
    args = smol_engine.async_engine.server_args
    monkeypatch.setattr(args, "abort_on_priority_when_disabled", True)
    with pytest.raises(ApiError) as e:
        smol_engine.native("/generate", {**body, "priority": 9})
    assert e.value.status == 400 and e.value.param == "priority"
    assert "--enable-priority-scheduling" in e.value.message
    assert smol_engine.native("/generate", body)["text"] == plain["text"]
    monkeypatch.setattr(args, "enable_priority_scheduling", True)   # only the check reads it here
    smol_engine.async_engine.validate(
        smol_engine._requests("Hello", {"max_new_tokens": 2}, None, priority=9)[0][0])


def test_flags_have_sglang_names_and_defaults(capsys):
    from radixserve import cli

    assert "--enable-priority-scheduling" not in REFUSED_SGLANG_FLAGS
    a = ServerArgs()
    assert (a.enable_priority_scheduling, a.schedule_low_priority_values_first,
            a.priority_scheduling_preemption_threshold, a.disable_priority_preemption,
            a.default_priority_value, a.abort_on_priority_when_disabled) == (
        False, False, 10, False, None, False)
    ns = cli.build_parser().parse_args([
        "serve", "--enable-priority-scheduling", "--schedule-low-priority-values-first",
        "--priority-scheduling-preemption-threshold", "3", "--disable-priority-preemption",
        "--default-priority-value", "-2", "--abort-on-priority-when-disabled"])
    a = ServerArgs.from_cli_args(ns)
    assert (a.enable_priority_scheduling, a.schedule_low_priority_values_first,
            a.priority_scheduling_preemption_threshold, a.disable_priority_preemption,
            a.default_priority_value, a.abort_on_priority_when_disabled) == (
        True, True, 3, True, -2, True)
    a.check()
    order = PriorityOrder.from_server_args(a)
    assert (order.low_values_first, order.threshold, order.default, order.preempt) == (
        True, 3, -2, False)
    assert PriorityOrder.from_server_args(ServerArgs()) is None
    with pytest.raises(ValueError, match="--priority-scheduling-preemption-threshold"):
        ServerArgs(enable_priority_scheduling=True,
                   priority_scheduling_preemption_threshold=-1).check()
    assert cli.main(["serve", "--priority-scheduling-preemption-threshold", "-1"]) == 2
    assert "--priority-scheduling-preemption-threshold must be >= 0" in capsys.readouterr().err
