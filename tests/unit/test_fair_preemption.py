"""Preemptive fairness between clients (issue 34 point 4; the rule is in
engine/scheduler/prefill.py's docstring): once one client fills the running slots (or the KV
memory), another client's request starts within a few scheduler steps, because the first
client's latest-admitted requests are retracted with their KV kept in the radix tree. Every test
counts scheduler steps (Scheduler.step(): one pipeline turn), never seconds, and checks
integrity after every step and that every slot and row comes back at the end."""
import random
from types import SimpleNamespace

import pytest

from radixserve.engine.req import Req, ReqStatus
from radixserve.model.forward_batch import ForwardMode
from radixserve.sampling.params import SamplingParams

from conftest import run_to_completion

K_STEPS = 4       # a request of a client under its share starts within this many steps


def greedy_req(rid, ids, n, client):
    sp = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    req = Req(rid, list(ids), sp, n, client_id=client)
    return req


def assert_all_slots_home(sched):
    assert not sched.has_work()
    sched.check_integrity()
    assert sched.kv_pool.available_size() + sched.cache.evictable_size() == sched.kv_pool.num_slots
    assert sched.cache.protected_size() == 0
    assert sched.req_to_token_pool.available_size() == sched.req_to_token_pool.size


def record_extends(sched):
    """Every prefill row scheduled: (req, extend start, extend length, retractions so far)."""
    rows = []
    schedule = sched.schedule

    def recording(**kw):
        batch = schedule(**kw)
        if batch is not None and batch.mode is ForwardMode.EXTEND:
            for i, r in enumerate(batch.reqs):
                if not batch.from_device[i]:
                    rows.append((r, batch.extend_starts[i], batch.extend_lens[i],
                                 r.num_retractions))
        return batch

    sched.schedule = recording
    return rows


def step_checked(sched, n=1):
    for _ in range(n):
        sched.step()
        sched.check_integrity()


def steps_until(sched, cond, limit):
    """Steps taken until cond() holds (checked after each step); fails beyond limit."""
    for i in range(1, limit + 1):
        step_checked(sched)
        if cond():
            return i
    raise AssertionError(f"not within {limit} steps")


def scrape(sched) -> str:
    """The /metrics text (prefix radixserve:, model "m") of sched's counters."""
    from prometheus_client import CollectorRegistry, generate_latest

    from radixserve.server.metrics import EngineCollector

    registry = CollectorRegistry()
    registry.register(EngineCollector(SimpleNamespace(served_model_name="m",
                                                      metrics=sched.metrics), "radixserve:"))
    return generate_latest(registry).decode()


def fill_with(sched, client, prompts, n, count):
    """count requests of client, added at once and stepped until all of them decode."""
    reqs = [greedy_req(f"{client}{i}", prompts[i % len(prompts)] + [300 + i], n, client)
            for i in range(count)]
    for r in reqs:
        sched.add_request(r)
    steps_until(sched, lambda: sum(r.status is ReqStatus.RUNNING for r in reqs)
                == min(count, sched.max_running_requests), 20)
    return reqs


@pytest.mark.parametrize("overlap", [True, False])
def test_capped_client_is_preempted_for_another(make_scheduler, greedy_alone, text_prompts,
                                                overlap):
    """The issue's case: --max-running-requests 16, --max-running-requests-per-client 4; client
    a fills all 16 slots with long requests (nobody else waits: work conserving), then client
    b's 8-token request arrives. It has its first token within K_STEPS steps (serial loop: 2,
    the decode step that alternate order owes, then b's prefill; overlap: one more to resolve
    the step in flight before retracting), by one retraction of a's latest-admitted request.
    That victim resumes after b started, re-prefilling only its last token (its KV came back
    from the radix tree), and ends with exactly its unpreempted greedy output."""
    sched = make_scheduler(max_running_requests=16, max_running_requests_per_client=4,
                           disable_overlap_schedule=not overlap)
    extends = record_extends(sched)
    a = fill_with(sched, "a", text_prompts, 16, 16)
    assert sched.num_running == 16 and not sched.waiting
    b = greedy_req("b", text_prompts[3], 8, "b")
    sched.add_request(b)
    admitted = steps_until(sched, lambda: b.status is not ReqStatus.WAITING, K_STEPS)
    first = admitted + (steps_until(sched, lambda: len(b.output_ids) >= 1, K_STEPS)
                        if not b.output_ids else 0)
    assert admitted <= 3 and first <= K_STEPS, (admitted, first)
    assert sched.counters["num_fair_retractions"] == 1
    assert sched.counters["num_retractions"] == 0             # none for memory
    victims = [r for r in a if r.num_retractions]
    assert len(victims) == 1
    victim = victims[0]
    assert victim.status is ReqStatus.WAITING                 # not back before b's first token
    retracted_at = len(victim.output_ids)
    run_to_completion(sched, [])
    assert b.output_ids == greedy_alone(b.origin_input_ids, 8)
    assert victim.output_ids == greedy_alone(victim.origin_input_ids, 16)
    assert all(r.finish_reason["type"] == "length" and len(r.output_ids) == 16 for r in a)
    # the victim restarted after b started, and recomputed only its last token
    resumed = [(start, n) for r, start, n, k in extends if r is victim and k == 1]
    assert victim.admit_order > b.admit_order
    assert sum(n for _, n in resumed) == 1, resumed
    start = resumed[0][0]
    assert start == len(victim.origin_input_ids) + retracted_at - 1
    assert sched.counters["num_fair_retractions"] == 1
    assert_all_slots_home(sched)


def test_without_a_cap_the_fair_share_is_slots_over_clients(make_scheduler, greedy_alone,
                                                             text_prompts):
    """No --max-running-requests-per-client: with two clients live each one's share is
    max_running_requests // 2. Client a's fan-out (12 requests: 8 slots taken, 4 queued) does
    not delay client b's one request beyond K_STEPS steps: one of a's running requests is
    retracted, and b starts ahead of a's queued requests and of the victim."""
    sched = make_scheduler(max_running_requests=8)
    a = fill_with(sched, "a", text_prompts, 12, 12)
    queued = [r for r in a if r.status is ReqStatus.WAITING]
    assert len(queued) == 4 and sched.num_running == 8
    b = greedy_req("b", text_prompts[5], 6, "b")
    sched.add_request(b)
    assert steps_until(sched, lambda: len(b.output_ids) >= 1, K_STEPS) <= K_STEPS
    assert sched.counters["num_fair_retractions"] == 1
    run_to_completion(sched, [])
    victim = next(r for r in a if r.num_retractions)
    assert b.admit_order < min(r.admit_order for r in queued + [victim])
    assert b.output_ids == greedy_alone(b.origin_input_ids, 6)
    assert victim.output_ids == greedy_alone(victim.origin_input_ids, 12)
    assert all(len(r.output_ids) == 12 for r in a)
    assert_all_slots_home(sched)


def test_one_client_alone_is_never_preempted(make_scheduler, text_prompts):
    """A lone client has no share: its 10 requests over 6 slots run in arrival order with no
    retraction, and with all requests one (anonymous) client nothing changes either."""
    for client in ("a", None):
        sched = make_scheduler(max_running_requests=6)
        reqs = [greedy_req(f"r{i}", text_prompts[i % 8], 3 + i % 3, client) for i in range(10)]
        run_to_completion(sched, reqs)
        assert sched.counters["num_fair_retractions"] == 0
        assert [r.admit_order for r in reqs] == sorted(r.admit_order for r in reqs)
        assert_all_slots_home(sched)


@pytest.mark.parametrize("cap", [None, 4])
def test_clients_at_their_share_never_ping_pong(make_scheduler, text_prompts, cap):
    """No thrash: client a holds all 8 slots, then client b's 6 requests arrive (share 4, from
    the cap or from 8 slots // 2 clients). Exactly 4 of a's requests are retracted, one per
    request of b's that starts while b is under its share; from then on both clients sit at
    their share with requests waiting (and a's requests of mixed lengths finish and are
    replaced), and not one more retraction happens, for memory or for fairness, over the rest
    of the run. Neither client ever holds more than its share while the other waits under it."""
    sched = make_scheduler(max_running_requests=8, max_running_requests_per_client=cap)
    a = fill_with(sched, "a", text_prompts, 20, 8)
    a += [greedy_req(f"a-late{i}", text_prompts[i] + [400 + i], 4 + 2 * i, "a") for i in range(4)]
    b = [greedy_req(f"b{i}", text_prompts[4 + i % 4] + [500 + i], 4 + 3 * i, "b")
         for i in range(6)]
    for r in a[8:] + b:
        sched.add_request(r)
    steps = 0
    while sched.has_work():
        step_checked(sched)
        steps += 1
        assert steps < 1000
        running = {c: sum(r.client_id == c and r.status is not ReqStatus.WAITING
                          and not r.finished for r in a + b) for c in "ab"}
        waiting = {c: any(r.client_id == c and r.status is ReqStatus.WAITING for r in a + b)
                   for c in "ab"}
        if sched.counters["num_fair_retractions"] == 4 and sched.pipeline.inflight is None:
            for c, other in (("a", "b"), ("b", "a")):
                if waiting[other] and running[other] < 4:
                    assert running[c] <= 4, (steps, running)
    assert sched.counters["num_fair_retractions"] == 4
    assert sched.counters["num_retractions"] == 0
    assert sum(r.num_retractions for r in a) == 4 and all(r.num_retractions == 0 for r in b)
    assert all(r.finish_reason["type"] == "length" for r in a + b)
    assert_all_slots_home(sched)


def test_clients_arriving_together_share_without_retraction(make_scheduler, text_prompts):
    """Two clients' requests arriving together are admitted share by share (4 + 4 of 8 slots:
    a's fifth is passed over while b is under its share), so the run never retracts."""
    sched = make_scheduler(max_running_requests=8)
    reqs = [greedy_req(f"{c}{i}", text_prompts[i] + [600 + i], 3 + i % 4, c)
            for c in "ab" for i in range(6)]
    for r in reqs:
        sched.add_request(r)
    step_checked(sched)
    if sched.pipeline.inflight is not None:
        step_checked(sched)
    started = [r.rid for r in reqs if r.status is not ReqStatus.WAITING]
    assert sorted(started) == ["a0", "a1", "a2", "a3", "b0", "b1", "b2", "b3"]
    run_to_completion(sched, [])
    assert sched.counters["num_fair_retractions"] == 0
    assert sched.counters["num_retractions"] == 0
    assert_all_slots_home(sched)


def test_kv_memory_taken_by_a_client_over_its_cap(make_scheduler, greedy_alone, text_prompts):
    """The KV memory, not the running slots, is what client a fills: in an 80-slot pool a's two
    requests with their decode reserve leave no room for b's (14 of the 16 running slots are
    free). With a cap
    of 1, b's request is blocked by memory that a client over its share holds: a's latest
    request is retracted (its KV published to the tree), b starts within K_STEPS steps, and
    everything finishes with its greedy output and every slot home."""
    sched = make_scheduler(max_running_requests=16, max_running_requests_per_client=1,
                           max_total_tokens=80)
    extends = record_extends(sched)
    a = [greedy_req(f"a{i}", text_prompts[i] + [300 + i], 30, "a") for i in range(2)]
    for r in a:
        sched.add_request(r)
    steps_until(sched, lambda: all(r.status is ReqStatus.RUNNING for r in a), 10)
    step_checked(sched, 2)
    assert sched.num_running == 2 < sched.max_running_requests    # slots are free
    rng = random.Random(5)
    b = greedy_req("b", [rng.randrange(256, 49152) for _ in range(16)], 12, "b")
    sched.add_request(b)
    assert steps_until(sched, lambda: len(b.output_ids) >= 1, K_STEPS) <= K_STEPS
    assert sched.counters["num_fair_retractions"] == 1
    victim = next(r for r in a if r.num_retractions)
    assert victim is a[1]                                   # the latest admitted of a's
    retracted_at = len(victim.output_ids)
    run_to_completion(sched, [])
    assert sched.counters["num_retractions"] == 0
    assert b.output_ids == greedy_alone(b.origin_input_ids, 12)
    assert victim.output_ids == greedy_alone(victim.origin_input_ids, 30)
    assert all(r.finish_reason["type"] == "length" and len(r.output_ids) == 30 for r in a)
    resumed = [(start, n) for r, start, n, k in extends if r is victim and k == 1]
    assert resumed == [(len(victim.origin_input_ids) + retracted_at - 1, 1)]
    assert_all_slots_home(sched)


def test_fair_retractions_are_a_metric(make_scheduler):
    """num_fair_retractions is a scheduler counter next to num_retractions, and /metrics serves
    it as the counter num_fair_retractions_total."""
    sched = make_scheduler()
    assert sched.metrics()["num_fair_retractions"] == 0
    sched.counters["num_fair_retractions"] = 3
    text = scrape(sched)
    assert "# TYPE radixserve:num_fair_retractions_total counter" in text
    assert 'radixserve:num_fair_retractions_total{model_name="m"} 3.0' in text
    assert 'radixserve:num_retractions_total{model_name="m"} 0.0' in text


def test_random_clients_keep_integrity(make_scheduler):
    """Three clients with random arrivals and lengths under a small pool admitted with little
    decode reserve (conservativeness 0.1), so memory retraction and fair retraction both happen:
    integrity after every step, every request finishes with its full length, every slot comes
    home."""
    rng = random.Random(11)
    sched = make_scheduler(max_running_requests=6, max_total_tokens=120,
                           schedule_conservativeness=0.1)
    reqs, arrivals = [], {}
    for i in range(13):
        client = "a" if i < 6 else rng.choice("abc")
        prompt = [rng.randrange(256, 49152) for _ in range(rng.randrange(4, 20))]
        r = greedy_req(f"x{i}", prompt, rng.randrange(24, 30) if i < 6 else rng.randrange(3, 20),
                       client)
        reqs.append(r)
        arrivals.setdefault(0 if i < 6 else rng.randrange(1, 20), []).append(r)
    run_to_completion(sched, reqs, arrivals=arrivals)
    assert all(r.finish_reason["type"] == "length" and len(r.output_ids) == r.max_new_tokens
               for r in reqs)
    assert sched.counters["num_fair_retractions"] > 0 and sched.counters["num_retractions"] > 0
    assert_all_slots_home(sched)
