"""Scheduler on the default model, stepped directly with check_integrity() after every step:
continuous batching, chunked prefill, retraction, abort, prefix reuse, policies, stops."""
import logging
import random

import pytest
import torch

from radixserve.engine import policy
from radixserve.engine.req import Req
from radixserve.sampling.params import SamplingParams

from conftest import run_to_completion


def greedy_req(rid, ids, n, **kw):
    sp = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, **kw)
    return Req(rid, list(ids), sp, n)


def random_prompt(rng, n):
    return [rng.randrange(256, 49152) for _ in range(n)]


def assert_all_slots_home(sched):
    """Nothing live: every slot is free or owned by the cache (evictable), every row free."""
    assert not sched.has_work()
    assert sched.kv_pool.available_size() + sched.cache.evictable_size() == sched.kv_pool.num_slots
    assert sched.cache.protected_size() == 0
    assert sched.req_to_token_pool.available_size() == sched.req_to_token_pool.size


@pytest.mark.parametrize("radix", [True, False])
def test_continuous_batching_staggered_equals_alone(make_scheduler, greedy_alone, text_prompts,
                                                    radix):
    sched = make_scheduler(disable_radix_cache=not radix)
    lens = [6, 12, 9, 4, 10, 7]
    reqs = [greedy_req(f"r{i}", text_prompts[i], n) for i, n in enumerate(lens)]
    # two at once, the rest joining while others decode (some mid-prefill of others)
    arrivals = {0: reqs[:2], 1: [reqs[2]], 3: [reqs[3]], 4: [reqs[4]], 8: [reqs[5]]}
    run_to_completion(sched, reqs, arrivals=arrivals)
    for i, r in enumerate(reqs):
        assert r.finish_reason == {"type": "length", "matched": None}
        assert r.output_ids == greedy_alone(text_prompts[i], lens[i]), f"request {i}"
    assert sched.counters["num_finished_requests"] == len(reqs)
    assert sched.counters["generation_tokens"] == sum(lens)
    assert_all_slots_home(sched)


@pytest.mark.parametrize("radix", [True, False])
def test_chunked_prefill_matches_unchunked(make_scheduler, radix):
    rng = random.Random(7)
    prompts = [random_prompt(rng, 100), random_prompt(rng, 100), random_prompt(rng, 37)]
    outs = {}
    for chunk in (-1, 16):
        sched = make_scheduler(chunked_prefill_size=chunk, disable_radix_cache=not radix)
        reqs = [greedy_req(f"c{i}", p, 6) for i, p in enumerate(prompts)]
        run_to_completion(sched, reqs)
        outs[chunk] = [r.output_ids for r in reqs]
        if chunk == 16:
            # 237 prompt tokens at 16 per prefill step
            assert sched.counters["num_prefill_steps"] >= 237 // 16
        else:
            assert sched.counters["num_prefill_steps"] == 1
        assert_all_slots_home(sched)
    assert outs[16] == outs[-1]


def test_retraction_under_tiny_pool(make_scheduler, text_prompts, caplog):
    prompts = text_prompts[:8]
    ref_sched = make_scheduler()
    ref = [greedy_req(f"ref{i}", p, 40) for i, p in enumerate(prompts)]
    run_to_completion(ref_sched, ref, check=False)
    sched = make_scheduler(max_total_tokens=200)
    reqs = [greedy_req(f"t{i}", p, 40) for i, p in enumerate(prompts)]
    with caplog.at_level(logging.WARNING, logger="radixserve.engine.scheduler"):
        run_to_completion(sched, reqs)
    assert sched.counters["num_retractions"] > 0
    assert any("Retract requests: #retracted:" in rec.getMessage() for rec in caplog.records)
    assert any(r.num_retractions > 0 for r in reqs)
    for r, want in zip(reqs, ref):
        assert r.finish_reason["type"] == "length"
        assert r.output_ids == want.output_ids, r.rid
    assert_all_slots_home(sched)


@pytest.mark.parametrize("radix", [True, False])
def test_abort_mid_flight_frees_everything(make_scheduler, radix):
    rng = random.Random(3)
    sched = make_scheduler(chunked_prefill_size=16, disable_radix_cache=not radix)
    outputs = {}
    reqs = []
    for i, n in enumerate([30, 70, 12, 25]):
        r = greedy_req(f"a{i}", random_prompt(rng, n), 50)
        r.sink = lambda out, rid=r.rid: outputs.setdefault(rid, []).append(out)
        reqs.append(r)
        sched.add_request(r)
    for _ in range(4):
        sched.step()
        sched.check_integrity()
    assert sched.chunked_req is reqs[1]           # the 70-token prompt is mid-prefill
    running = [r for r in reqs if r in sched.running]
    assert running, "some request should be decoding by now"
    assert sched.abort(reqs[1].rid)               # chunked
    assert sched.abort(running[0].rid)            # decoding
    assert sched.abort(reqs[3].rid)               # still waiting, or running
    assert not sched.abort("no-such-request")
    run_to_completion(sched, [])
    for r in (reqs[1], running[0], reqs[3]):
        assert r.finish_reason["type"] == "abort"
        assert outputs[r.rid][-1].finished and outputs[r.rid][-1].finish_reason["type"] == "abort"
    survivors = [r for r in reqs if r.finish_reason["type"] != "abort"]
    assert survivors and all(len(r.output_ids) == 50 for r in survivors)
    assert sched.counters["num_aborted_requests"] == 3
    assert_all_slots_home(sched)


def test_prefix_reuse_reports_cached_tokens(make_scheduler, text_prompts):
    sched = make_scheduler()
    ids = text_prompts[2]
    first = greedy_req("p1", ids, 8)
    run_to_completion(sched, [first])
    second = greedy_req("p2", ids, 8)
    run_to_completion(sched, [second])
    assert first.cached_tokens == 0
    assert second.cached_tokens == len(ids) - 1     # the last prompt token is always computed
    assert second.output_ids == first.output_ids
    # an extension of a previous prompt + output reuses both
    third = greedy_req("p3", ids + first.output_ids + [11], 4)
    run_to_completion(sched, [third])
    assert third.cached_tokens >= len(ids) + len(first.output_ids) - 1
    assert sched.counters["cached_tokens"] == second.cached_tokens + third.cached_tokens
    assert sched.flush_cache()
    assert sched.cache.evictable_size() == 0
    assert sched.kv_pool.available_size() == sched.kv_pool.num_slots


def test_lpm_orders_by_prefix_and_falls_back(make_scheduler, text_prompts):
    sched = make_scheduler(schedule_policy="lpm")
    long_ids = text_prompts[2]
    warm = greedy_req("warm", long_ids, 2)
    run_to_completion(sched, [warm])
    cold = greedy_req("cold", text_prompts[0], 2)
    hit = greedy_req("hit", long_ids + [42, 43], 2)
    order = policy.lpm([cold, hit], sched.cache)
    assert [r.rid for r in order] == ["hit", "cold"]
    assert [r.rid for r in policy.fcfs([cold, hit], sched.cache)] == ["cold", "hit"]
    many = [greedy_req(f"m{i}", text_prompts[0], 2) for i in range(policy.LPM_MAX_QUEUE_LEN)]
    queue = [cold] + many + [hit]
    assert policy.lpm(queue, sched.cache) == queue        # deep queue: fcfs order
    run_to_completion(sched, [cold, hit])
    assert hit.cached_tokens >= len(long_ids)


def test_stop_token_and_eos(make_scheduler, greedy_alone, text_prompts):
    ids = text_prompts[1]
    ref = greedy_alone(ids, 10)
    target = ref[4]
    k = ref.index(target)
    sched = make_scheduler()
    r = greedy_req("s", ids, 10, stop_token_ids=[target])
    run_to_completion(sched, [r])
    assert r.output_ids == ref[:k + 1]
    assert r.finish_reason == {"type": "stop", "matched": target}
    # the same token as an EOS id stops too, unless ignore_eos
    sched.eos_ids = [target]
    e = Req("e", list(ids), SamplingParams(max_new_tokens=10, temperature=0.0), 10)
    i = greedy_req("i", ids, 10)
    run_to_completion(sched, [e, i])
    assert e.finish_reason == {"type": "stop", "matched": target} and e.output_ids == ref[:k + 1]
    assert i.output_ids == ref


def test_prompt_logprobs_chunked_match_hf(make_scheduler, hf_gguf_model, text_prompts):
    ids = text_prompts[2]
    sched = make_scheduler(chunked_prefill_size=4)
    sp = SamplingParams(max_new_tokens=2, temperature=0.0)
    r = Req("lp", list(ids), sp, 2, return_logprob=True, logprob_start_len=3, top_logprobs_num=2)
    run_to_completion(sched, [r])
    with torch.no_grad():
        logits = hf_gguf_model(torch.tensor([ids])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)
    got = r.input_token_logprobs
    assert [t for _, t, _ in got] == ids[3:]
    for j, (lp, tok, _) in enumerate(got):
        assert abs(lp - ref[3 + j - 1, tok].item()) < 2e-3
    assert len(r.input_top_logprobs) == len(ids) - 3
    assert r.input_top_logprobs[0][0][1] == int(ref[2].argmax())


@pytest.mark.parametrize("cap", [None, 2, 4])
def test_one_clients_fan_out_cannot_starve_another(make_scheduler, text_prompts, cap):
    """--max-running-requests-per-client: client a's 8 requests fill all 4 running slots while
    nobody else waits (work conserving); once client b waits, a is over its share of 2, so one
    of a's running requests is retracted and b is admitted before a's queued requests
    (test_fair_preemption.py). Without the cap the share is the same, 4 slots // 2 clients. A
    cap of 4 (= the slots) turns fairness off: fcfs, b waits behind all of them."""
    sched = make_scheduler(max_running_requests=4, max_running_requests_per_client=cap)
    fan_out = [greedy_req(f"a{i}", text_prompts[i % 8], 6 + i) for i in range(8)]
    for r in fan_out:
        r.client_id = "a"
        sched.add_request(r)
    sched.step()
    assert sum(r.status.name != "WAITING" for r in fan_out) == 4
    queued_a = [r for r in fan_out if r.status.name == "WAITING"]
    other = greedy_req("b", text_prompts[0], 3)
    other.client_id = "b"
    run_to_completion(sched, [other])
    assert all(r.finish_reason["type"] == "length" for r in fan_out + [other])
    if cap == 4:
        assert other.admit_order > max(r.admit_order for r in queued_a)
        assert sched.counters["num_fair_retractions"] == 0
    else:
        assert other.admit_order < min(r.admit_order for r in queued_a)
        assert sched.counters["num_fair_retractions"] == 1
    assert_all_slots_home(sched)


@pytest.mark.parametrize("order", ["alternate", "prefill-first"])
def test_step_order(make_scheduler, greedy_alone, order):
    """Four prompts, one per prefill step (the budget holds one): alternate interleaves a decode
    step after each prefill once requests decode; prefill-first prefills all four before the
    first decode step. The outputs are the greedy outputs of each prompt alone either way."""
    from radixserve.model.forward_batch import ForwardMode

    rng = random.Random(3)
    prompts = [random_prompt(rng, 12) for _ in range(4)]
    sched = make_scheduler(step_order=order, max_prefill_tokens=12, chunked_prefill_size=-1)
    modes = []
    schedule = sched.schedule

    def recording_schedule(**kw):
        batch = schedule(**kw)
        if batch is not None:
            modes.append("E" if batch.mode == ForwardMode.EXTEND else "D")
        return batch

    sched.schedule = recording_schedule
    reqs = [greedy_req(f"o{i}", p, 5) for i, p in enumerate(prompts)]
    run_to_completion(sched, reqs)
    first_decodes = "".join(modes[:7])
    assert first_decodes == ("EDEDEDE" if order == "alternate" else "EEEEDDD"), modes
    assert modes.count("E") == 4
    for p, r in zip(prompts, reqs):
        assert r.output_ids == greedy_alone(p, 5)
    assert_all_slots_home(sched)


def test_server_step_order_default_and_check():
    """The server's default (no --step-order) is alternate; an unknown order names the flag."""
    from radixserve.config import ServerArgs

    assert ServerArgs().step_order == "alternate"
    with pytest.raises(ValueError, match="--step-order"):
        ServerArgs(step_order="decode-first").check()


def test_decode_rows_count_every_decode_row(make_scheduler):
    """decode_rows / decode_row_device_seconds (the mean decode step a generated token waited
    for, /metrics): each decode step adds its rows, and its device time once per row. Serial
    loop, so no step runs past a request's end: 2 requests x 4 tokens = 2 x 3 decode rows (the
    prefill samples each first token)."""
    rng = random.Random(5)
    sched = make_scheduler(disable_overlap_schedule=True)
    steps = []
    process = sched.process_batch_result

    def recording(batch, out):
        from radixserve.model.forward_batch import ForwardMode
        if batch.mode == ForwardMode.DECODE:
            steps.append((batch.batch_size, out.device_time))
        return process(batch, out)

    sched.process_batch_result = recording
    run_to_completion(sched, [greedy_req(f"d{i}", random_prompt(rng, 8), 4) for i in range(2)])
    m = sched.metrics()
    assert m["decode_rows"] == sum(n for n, _ in steps) == 6
    assert m["decode_row_device_seconds"] == pytest.approx(sum(n * t for n, t in steps))
    assert m["decode_row_device_seconds"] > 0
    assert m["weight_floor_seconds"] == 0.0          # measured on CUDA only
    assert m["streamed_weight_bytes"] == 0
    pool = sched.kv_pool                             # K and V, every layer, the pool's dtype
    assert m["kv_cache_bytes_per_token"] == 2 * pool.num_layers * pool.num_kv_heads * \
        pool.head_dim * pool.k_buffers[0].element_size()
