"""Overlap scheduling on the CPU: the pipeline schedules step N+1 before step N's tokens reach
the host, and every output equals the serial loop's (--disable-overlap-schedule) token for
token: single requests, staggered arrivals, chunked prefill, retraction under memory pressure,
aborts mid-flight, stop tokens and stop strings (a request that stops at step N must not emit
step N+1's token), seeded sampling and penalties. check_integrity holds after every turn."""
import random

from radixserve.engine.req import Req
from radixserve.sampling.params import SamplingParams

from conftest import run_to_completion


def make_pair(make_scheduler, tokenizer=None, **kw):
    """(overlapped scheduler, serial scheduler) with the same settings."""
    scheds = []
    for serial in (False, True):
        s = make_scheduler(disable_overlap_schedule=serial, **kw)
        if tokenizer is not None:
            from radixserve.tokenizer.detokenizer import IncrementalDetokenizer

            def factory(req, tok=tokenizer):
                sp = req.sampling_params
                return IncrementalDetokenizer(tok, sp.stop_strs, sp.no_stop_trim)
            s.tokenizer, s.detokenizer_factory = tokenizer, factory
        scheds.append(s)
    return scheds


def reqs_for(prompts, n, tag, **sp_kw):
    out = []
    for i, p in enumerate(prompts):
        kw = {"temperature": 0.0, "ignore_eos": True, **sp_kw}
        sp = SamplingParams(max_new_tokens=n, **kw)
        out.append(Req(f"{tag}{i}", list(p), sp, n))
    return out


def collect_streams(reqs):
    """Record every GenerateOutput each request emits."""
    streams = {}
    for r in reqs:
        r.sink = lambda out, rid=r.rid: streams.setdefault(rid, []).append(out)
    return streams


def outputs(reqs):
    return [(r.output_ids, r.finish_reason) for r in reqs]


def random_prompt(rng, n):
    return [rng.randrange(256, 49152) for _ in range(n)]


def run_pair(make_scheduler, build, arrivals=None, tokenizer=None, **kw):
    """Run the same requests (build(tag) -> reqs) through both schedulers; return both."""
    results = []
    for sched, tag in zip(make_pair(make_scheduler, tokenizer, **kw), ("o", "s")):
        reqs = build(tag)
        streams = collect_streams(reqs)
        arr = None
        if arrivals is not None:
            arr = {step: [reqs[i] for i in idx] for step, idx in arrivals.items()}
        run_to_completion(sched, reqs, arrivals=arr)
        results.append((sched, reqs, streams))
    return results


def assert_same(results, expect_overlap=True):
    (o_sched, o_reqs, o_streams), (s_sched, s_reqs, s_streams) = results
    assert outputs(o_reqs) == outputs(s_reqs)
    # the streamed deltas carry the same tokens and text in both loops
    for a, b in zip(o_reqs, s_reqs):
        ids_a = [t for out in o_streams.get(a.rid, []) for t in out.output_ids_delta]
        ids_b = [t for out in s_streams.get(b.rid, []) for t in out.output_ids_delta]
        assert ids_a == ids_b == a.output_ids
        text_a = "".join(out.text_delta for out in o_streams.get(a.rid, []))
        text_b = "".join(out.text_delta for out in s_streams.get(b.rid, []))
        assert text_a == text_b
    assert s_sched.pipeline.num_overlapped == 0
    if expect_overlap:
        assert o_sched.pipeline.num_overlapped > 0, "no step was scheduled over another"
    for sched in (o_sched, s_sched):
        assert sched.kv_pool.available_size() + sched.cache.evictable_size() == \
            sched.kv_pool.num_slots
        assert sched.req_to_token_pool.available_size() == sched.req_to_token_pool.size


def test_single_request_and_greedy_parity(make_scheduler, greedy_alone, text_prompts):
    results = run_pair(make_scheduler, lambda tag: reqs_for(text_prompts[:1], 12, tag))
    assert_same(results)
    assert results[0][1][0].output_ids == greedy_alone(text_prompts[0], 12)


def test_staggered_arrivals_continuous_batching(make_scheduler, text_prompts):
    lens = [6, 12, 9, 4, 10, 7, 15, 3]

    def build(tag):
        return [Req(f"{tag}{i}", list(text_prompts[i]),
                    SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True), n)
                for i, n in enumerate(lens)]
    arrivals = {0: [0, 1], 1: [2], 3: [3], 4: [4], 8: [5], 9: [6], 15: [7]}
    assert_same(run_pair(make_scheduler, build, arrivals=arrivals))


def test_chunked_prefill_with_running_decodes(make_scheduler):
    rng = random.Random(7)
    prompts = [random_prompt(rng, n) for n in (20, 100, 37, 64)]
    for mixed in (False, True):
        results = run_pair(make_scheduler, lambda tag: reqs_for(prompts, 10, tag),
                           arrivals={0: [0], 2: [1, 2], 5: [3]}, chunked_prefill_size=16,
                           enable_mixed_chunk=mixed)
        assert_same(results)
        assert results[0][0].counters["num_prefill_steps"] >= 221 // 16


def test_retraction_under_memory_pressure(make_scheduler, text_prompts):
    results = run_pair(make_scheduler, lambda tag: reqs_for(text_prompts[:8], 40, tag),
                       max_total_tokens=200)
    assert_same(results)
    assert results[0][0].counters["num_retractions"] > 0
    assert any(r.num_retractions > 0 for r in results[0][1])


def test_aborts_mid_flight(make_scheduler):
    rng = random.Random(3)
    prompts = [random_prompt(rng, n) for n in (30, 70, 12, 25)]
    finals = []
    for sched in make_pair(make_scheduler, chunked_prefill_size=16):
        reqs = reqs_for(prompts, 50, "a")
        streams = collect_streams(reqs)
        for r in reqs:
            sched.add_request(r)
        for _ in range(6):
            sched.step()
            sched.check_integrity()
        running = [r for r in reqs if r in sched.running]
        assert running
        assert sched.abort(reqs[1].rid) and sched.abort(running[0].rid)
        run_to_completion(sched, [])
        for r in (reqs[1], running[0]):
            assert r.finish_reason["type"] == "abort"
            assert streams[r.rid][-1].finished
        finals.append([(r.rid, r.finish_reason["type"], r.output_ids) for r in reqs])
        assert sched.kv_pool.available_size() + sched.cache.evictable_size() == \
            sched.kv_pool.num_slots
    # the abort lands at the same step boundary in both loops, so even the aborted outputs match
    assert finals[0] == finals[1]


def test_stop_token_is_last_token(make_scheduler, greedy_alone, text_prompts):
    """The overlapped loop has already scheduled the step after the stop token; that step's
    token is dropped: the output ends at the stop token, exactly as without overlap."""
    ref = greedy_alone(text_prompts[1], 12)
    target = ref[5]
    k = ref.index(target)
    results = run_pair(make_scheduler,
                       lambda tag: reqs_for([text_prompts[1]] * 3, 12, tag,
                                            stop_token_ids=[target]))
    assert_same(results)
    for r in results[0][1]:
        assert r.output_ids == ref[:k + 1]
        assert r.finish_reason == {"type": "stop", "matched": target}


def test_stop_string_ends_the_stream(make_scheduler, default_tokenizer, greedy_alone,
                                     text_prompts):
    ids = text_prompts[2]
    ref_ids = greedy_alone(ids, 16)
    text = default_tokenizer.decode(ref_ids)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    results = run_pair(make_scheduler, lambda tag: reqs_for([ids], 16, tag, stop=stop),
                       tokenizer=default_tokenizer)
    assert_same(results)
    (o_sched, o_reqs, o_streams) = results[0]
    r = o_reqs[0]
    assert r.finish_reason == {"type": "stop", "matched": stop}
    streamed = "".join(out.text_delta for out in o_streams[r.rid])
    assert stop not in streamed and text.startswith(streamed)
    assert len(r.output_ids) < 16 and r.output_ids == ref_ids[:len(r.output_ids)]


def test_seeded_sampling_and_penalties(make_scheduler, text_prompts):
    def build(tag):
        out = []
        for i, p in enumerate(text_prompts[:4]):
            sp = SamplingParams(max_new_tokens=14, temperature=0.8, top_p=0.9, top_k=40,
                                seed=17 + i, ignore_eos=True, frequency_penalty=0.5 * (i % 2),
                                repetition_penalty=1.0 + 0.2 * (i == 2), min_new_tokens=3)
            out.append(Req(f"{tag}{i}", list(p), sp, 14))
        return out
    assert_same(run_pair(make_scheduler, build, arrivals={0: [0, 1], 2: [2], 4: [3]}))


def test_lone_request_that_fits_is_never_aborted(make_scheduler):
    """A request whose prompt + max_new_tokens fits the pool completes under pressure from
    others (retraction, never a false 'pool is full' abort)."""
    rng = random.Random(11)
    prompts = [random_prompt(rng, 10) for _ in range(3)]
    for sched in make_pair(make_scheduler, max_total_tokens=44):
        reqs = reqs_for(prompts, 30, "f")          # 40 slots each: no two fit together
        run_to_completion(sched, reqs)
        assert all(r.finish_reason == {"type": "length", "matched": None} for r in reqs)
        assert all(len(r.output_ids) == 30 for r in reqs)
        assert sched.counters["num_aborted_requests"] == 0


def test_non_finite_logits_fail_only_their_request(make_scheduler, greedy_alone, text_prompts):
    """NaN in one request's cached V makes its logits non-finite: it aborts with a clear
    message, and its batch-mates finish with exactly their solo greedy outputs."""
    sched = make_scheduler()
    reqs = reqs_for(text_prompts[:4], 10, "nan")
    for r in reqs:
        sched.add_request(r)
    while not all(r in sched.running for r in reqs):
        sched.step()
    victim = reqs[2]
    slots = sched.req_to_token_pool.slots(victim.req_pool_idx, 3)
    for v in sched.kv_pool.v_buffers:
        v[slots] = float("nan")
    run_to_completion(sched, [])
    assert victim.finish_reason["type"] == "abort"
    assert "non-finite" in victim.finish_reason["message"]
    for i, r in enumerate(reqs):
        if r is not victim:
            assert r.finish_reason["type"] == "length"
            assert r.output_ids == greedy_alone(text_prompts[i], 10)
    assert sched.counters["num_aborted_requests"] == 1


def test_abort_while_the_prefill_is_in_flight(make_scheduler, text_prompts):
    """Aborted while its prefill runs: the prompt is published when the prefill resolves, and
    the abort must then free nothing the cache owns (found by bench/soak.py: a slot counted both
    free and cached). Integrity after every turn, and every slot home at the end."""
    for overlap in (True, False):
        sched = make_scheduler(disable_overlap_schedule=not overlap)
        reqs = reqs_for(text_prompts[:3], 8, "ab")
        sched.add_request(reqs[0])
        while reqs[0] not in sched.running:        # one request decoding
            sched.step()
        for r in reqs[1:]:
            sched.add_request(r)
        sched.step()                               # their prefill launches (or runs)
        assert sched.abort(reqs[1].rid)
        run_to_completion(sched, [])
        assert reqs[1].finish_reason["type"] == "abort"
        assert reqs[0].finish_reason["type"] == reqs[2].finish_reason["type"] == "length"
        assert sched.kv_pool.available_size() + sched.cache.evictable_size() == \
            sched.kv_pool.num_slots


def test_prefill_scheduled_over_a_prefill_in_flight(make_scheduler):
    """prefill-first, a budget of one prompt per step: each prefill after the first is
    scheduled while the previous one runs (num_over_extend), and the outputs equal the serial
    loop's. max_running_requests 3 of 5 prompts: admission counts the prefill in flight, so
    no more than 3 ever hold a running slot."""
    rng = random.Random(5)
    prompts = [random_prompt(rng, 20) for _ in range(5)]
    results = run_pair(make_scheduler, lambda tag: reqs_for(prompts, 6, tag),
                       step_order="prefill-first", max_prefill_tokens=20,
                       chunked_prefill_size=-1, max_running_requests=3)
    assert_same(results)
    (o_sched, _, _), (s_sched, _, _) = results
    assert o_sched.pipeline.num_over_extend >= 3      # prompts 2, 3 (cap), then 5 after 1-3 end
    assert s_sched.pipeline.num_over_extend == 0


def test_running_cap_counts_the_prefill_in_flight(make_scheduler):
    rng = random.Random(6)
    sched = make_scheduler(step_order="prefill-first", max_prefill_tokens=20,
                           chunked_prefill_size=-1, max_running_requests=2)
    reqs = reqs_for([random_prompt(rng, 20) for _ in range(4)], 4, "cap")
    for r in reqs:
        sched.add_request(r)
    most = 0
    while sched.has_work():
        sched.step()
        sched.check_integrity()
        holding = [r for r in reqs if r.req_pool_idx is not None]
        most = max(most, len(holding))
        assert sched.num_running == len(holding)
    assert most == 2
    assert sched.pipeline.num_over_extend >= 1
    assert all(r.finish_reason["type"] == "length" for r in reqs)


def test_prompt_sharing_a_prefix_with_the_prefill_in_flight_waits_for_it(make_scheduler):
    """B shares 40 tokens with A, whose prefill is in flight when B is scheduled: B waits for A
    to publish its prompt and reuses those 40 tokens instead of computing them again."""
    rng = random.Random(8)
    shared = random_prompt(rng, 40)
    for overlap in (True, False):
        sched = make_scheduler(step_order="prefill-first", max_prefill_tokens=48,
                               chunked_prefill_size=-1, disable_overlap_schedule=not overlap)
        a, b = reqs_for([shared + random_prompt(rng, 8), shared + random_prompt(rng, 8)], 4,
                        "share")
        run_to_completion(sched, [a, b])
        assert a.cached_tokens == 0
        assert b.cached_tokens >= 40, f"overlap={overlap}: B recomputed the shared prefix"
