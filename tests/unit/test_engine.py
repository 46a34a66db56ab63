"""AsyncEngine (the server's API), driven inside the shared Engine's event loop: validation,
streaming deltas, stop strings, abort on early close, staggered continuous batching, flush_cache,
introspection."""
import asyncio
import uuid

import pytest

from radixserve.engine.io import GenerateReqInput
from radixserve.sampling.params import SamplingParams


def in_loop(engine, coro, timeout=600):
    """Run coro on the engine's own loop (where the AsyncEngine lives) and wait for it."""
    return engine._submit(coro).result(timeout)


def make_input(ids, **sp_kw):
    extra = {k: sp_kw.pop(k) for k in ("return_logprob", "logprob_start_len", "top_logprobs_num",
                                       "return_text_in_logprobs", "stream") if k in sp_kw}
    return GenerateReqInput(rid=uuid.uuid4().hex, input_ids=list(ids),
                            sampling_params=SamplingParams(**sp_kw), **extra)


async def collect(ae, req):
    return [out async for out in ae.generate(req)]


def wait_idle(engine):
    async def idle():
        while engine.async_engine.scheduler.has_work():
            await asyncio.sleep(0.01)
    in_loop(engine, idle())


def test_validate_rejects_bad_requests(smol_engine):
    ae = smol_engine.async_engine
    ctx = ae.context_len
    vocab = ae.model_config.vocab_size
    cases = [
        (make_input([]), "empty"),
        (make_input([1, vocab]), "out of range"),
        (make_input([1, -3]), "out of range"),
        (make_input([5] * ctx), f"prompt has {ctx} tokens; the context length is {ctx}"),
        (make_input([5] * 10, max_new_tokens=ctx), "lower max_new_tokens to at most"),
        (make_input([5] * 10, logit_bias={vocab: 1.0}), f"token id {vocab}, outside the vocabulary"),
        (make_input([5] * 10, temperature=-1.0), "temperature"),
    ]
    for req, message in cases:
        with pytest.raises(ValueError, match=message):
            ae.validate(req)

    async def gen_raises():
        with pytest.raises(ValueError, match="empty"):
            async for _ in ae.generate(make_input([])):
                pass
    in_loop(smol_engine, gen_raises())
    ae.validate(make_input([5] * 10, max_new_tokens=None))    # None: up to the context length


def test_streaming_deltas_and_logprobs(smol_engine, default_tokenizer):
    ae = smol_engine.async_engine
    ids = default_tokenizer.encode("The quick brown fox")
    req = make_input(ids, max_new_tokens=6, temperature=0.0, ignore_eos=True, stream=True,
                     return_logprob=True, top_logprobs_num=2, return_text_in_logprobs=True)
    outs = in_loop(smol_engine, collect(ae, req))
    # one output per step, or fewer when the consumer fell behind (deltas merged, none lost)
    assert 1 <= len(outs) <= 6 and all(o.output_ids_delta for o in outs)
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert outs[-1].finish_reason == {"type": "length", "matched": None}
    out_ids = [t for o in outs for t in o.output_ids_delta]
    assert "".join(o.text_delta for o in outs) == default_tokenizer.decode(out_ids)
    assert outs[-1].completion_tokens == 6 and outs[-1].prompt_tokens == len(ids)
    entries = [e for o in outs for e in o.output_token_logprobs_delta]
    assert [e[1] for e in entries] == out_ids
    assert all(e[0] <= 0 and e[2] == default_tokenizer.token_text(e[1]) for e in entries)
    tops = [t for o in outs for t in o.output_top_logprobs_delta]
    assert all(len(t) == 2 and t[0][1] == e[1] and t[0][0] >= t[1][0]
               for t, e in zip(tops, entries))


def test_stop_string_trims_text(smol_engine, default_tokenizer):
    ae = smol_engine.async_engine
    ids = default_tokenizer.encode("def fibonacci(n):")
    full = in_loop(smol_engine, collect(ae, make_input(ids, max_new_tokens=12, temperature=0.0,
                                                      ignore_eos=True)))
    text = "".join(o.text_delta for o in full)
    stop = text.strip()[4:7]
    assert stop and stop in text
    cut = in_loop(smol_engine, collect(ae, make_input(ids, max_new_tokens=12, temperature=0.0,
                                                     ignore_eos=True, stop=stop)))
    assert cut[-1].finish_reason == {"type": "stop", "matched": stop}
    assert "".join(o.text_delta for o in cut) == text[:text.index(stop)]


def test_early_close_aborts_and_frees_slots(smol_engine, default_tokenizer):
    ae = smol_engine.async_engine
    sched = ae.scheduler
    before = sched.counters["num_aborted_requests"]
    ids = default_tokenizer.encode("Once upon a time")

    async def read_two_then_close():
        agen = ae.generate(make_input(ids, max_new_tokens=200, temperature=0.0, ignore_eos=True))
        got = [await agen.__anext__(), await agen.__anext__()]
        await agen.aclose()
        return got

    got = in_loop(smol_engine, read_two_then_close())
    assert not any(o.finished for o in got)
    wait_idle(smol_engine)
    assert sched.counters["num_aborted_requests"] == before + 1
    in_loop(smol_engine, _check_integrity(sched))
    pool = sched.kv_pool
    assert pool.available_size() + sched.cache.evictable_size() == pool.num_slots
    assert sched.cache.protected_size() == 0

    async def cancel_task():      # a cancelled consumer (client gone) aborts too
        task = asyncio.ensure_future(collect(ae, make_input(ids, max_new_tokens=200,
                                                            temperature=0.0, ignore_eos=True)))
        while not sched.reqs:          # cancel only once the request is in the engine
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    in_loop(smol_engine, cancel_task())
    wait_idle(smol_engine)
    assert sched.counters["num_aborted_requests"] == before + 2


async def _check_integrity(sched):
    sched.check_integrity()


def test_staggered_requests_equal_alone(smol_engine, text_prompts, greedy_alone):
    ae = smol_engine.async_engine
    lens = [5, 9, 3, 7, 6]

    async def staggered():
        async def one(i, delay):
            await asyncio.sleep(delay)
            outs = await collect(ae, make_input(text_prompts[i], max_new_tokens=lens[i],
                                                temperature=0.0, ignore_eos=True))
            return [t for o in outs for t in o.output_ids_delta]
        return await asyncio.gather(*(one(i, 0.05 * i) for i in range(len(lens))))

    got = in_loop(smol_engine, staggered())
    for i, ids in enumerate(got):
        assert ids == greedy_alone(text_prompts[i], lens[i]), f"request {i}"


def test_stream_interval_batches_streamed_tokens(smol_engine, default_tokenizer, greedy_alone):
    """--stream-interval N: the first output at once, then one per N new tokens (or more when
    the consumer fell behind), the rest with the last; the tokens are those of the plain run."""
    ae = smol_engine.async_engine
    ids = default_tokenizer.encode("The capital of France is")
    ae.server_args.stream_interval = 4
    try:
        outs = in_loop(smol_engine, collect(ae, make_input(ids, max_new_tokens=11, temperature=0.0,
                                                           ignore_eos=True, stream=True)))
    finally:
        ae.server_args.stream_interval = 1
    counts = [o.completion_tokens for o in outs]
    assert counts[-1] == 11 and outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert all(b - a >= 4 for a, b in zip(counts, counts[1:-1]))    # a chunk: >= 4 new tokens
    assert [t for o in outs for t in o.output_ids_delta] == greedy_alone(ids, 11)
    assert "".join(o.text_delta for o in outs) == default_tokenizer.decode(greedy_alone(ids, 11))


def test_flush_cache_refused_while_busy(smol_engine, default_tokenizer):
    ae = smol_engine.async_engine
    ids = default_tokenizer.encode("Water boils at")

    async def flush_during_and_after():
        agen = ae.generate(make_input(ids, max_new_tokens=5, temperature=0.0, ignore_eos=True))
        await agen.__anext__()
        during = await ae.flush_cache()
        async for _ in agen:
            pass
        return during, await ae.flush_cache()

    during, after = in_loop(smol_engine, flush_during_and_after())
    assert during is False and after is True
    assert ae.scheduler.cache.evictable_size() == 0


def test_introspection(smol_engine):
    ae = smol_engine.async_engine
    info = ae.server_info()
    assert info["served_model_name"] == "SmolLM2-135M-Instruct"
    assert info["max_total_tokens"] == 4096 and info["context_len"] == 1024
    assert info["server_args"]["max_running_requests"] == 16
    m = ae.metrics()
    for key in ("num_requests", "prompt_tokens", "cached_tokens", "generation_tokens",
                "num_running_reqs", "num_waiting_reqs", "token_usage"):
        assert key in m
    assert m["num_requests"] >= m["num_finished_requests"] > 0
    assert ae.is_healthy()


def test_merge_outputs_keeps_every_delta_in_order():
    from radixserve.engine.async_engine import merge_outputs
    from radixserve.engine.io import GenerateOutput

    a = GenerateOutput("r", "Hel", [1, 2], False, completion_tokens=2,
                       output_token_logprobs_delta=[(-0.1, 1, None), (-0.2, 2, None)],
                       input_token_logprobs=[(None, 9, None)], queue_time_s=0.5)
    b = GenerateOutput("r", "lo", [3], True, {"type": "length", "matched": None},
                       completion_tokens=3, output_token_logprobs_delta=[(-0.3, 3, None)])
    m = merge_outputs(a, b)
    assert (m.text_delta, m.output_ids_delta, m.finished) == ("Hello", [1, 2, 3], True)
    assert [e[1] for e in m.output_token_logprobs_delta] == [1, 2, 3]
    assert m.completion_tokens == 3 and m.finish_reason["type"] == "length"
    assert m.input_token_logprobs == [(None, 9, None)] and m.queue_time_s == 0.5


def test_switch_interval_is_short_while_an_engine_runs(default_model_path):
    """While an engine runs, the interpreter hands the GIL over after SWITCH_INTERVAL_US (the
    forward worker's launches wait on a busy loop thread for at most that long), or the
    --debug-switch-interval-us flag's value; shutdown restores the interval it found."""
    import sys

    import radixserve
    from radixserve.engine.async_engine import SWITCH_INTERVAL_US

    saved = sys.getswitchinterval()
    sys.setswitchinterval(0.004)          # a value neither the default nor the flag below
    try:
        engine = radixserve.Engine(default_model_path, device="cpu", max_total_tokens=256,
                                   max_running_requests=2)
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_US * 1e-6, abs=2e-6)
        engine.shutdown()
        assert sys.getswitchinterval() == pytest.approx(0.004)
        engine = radixserve.Engine(default_model_path, device="cpu", max_total_tokens=256,
                                   max_running_requests=2, debug_switch_interval_us=1000)
        assert sys.getswitchinterval() == pytest.approx(1e-3, abs=2e-6)
        engine.shutdown()
        assert sys.getswitchinterval() == pytest.approx(0.004)
    finally:
        sys.setswitchinterval(saved)


def test_startup_objects_are_frozen_until_shutdown(default_model_path):
    """An engine's start-up objects leave the collector's scans (gc.freeze) and the young
    generation's threshold is raised while it serves; shutdown unfreezes them and restores the
    thresholds, so a process that builds engine after engine can free the old ones (the model
    here)."""
    import gc
    import weakref

    import radixserve
    from radixserve.engine.async_engine import GC_GEN0_THRESHOLD

    before = gc.get_threshold()
    engine = radixserve.Engine(default_model_path, device="cpu", max_total_tokens=256,
                               max_running_requests=2)
    model = weakref.ref(engine.async_engine.runner.model)
    assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == (GC_GEN0_THRESHOLD, *before[1:])
    engine.shutdown()
    assert gc.get_freeze_count() == 0
    assert gc.get_threshold() == before
    del engine
    gc.collect()
    assert model() is None
