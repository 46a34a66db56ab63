"""Speculative decoding (--speculative-algorithm ngram) on the default model: greedy outputs are
exactly the unspeculated ones, drafts get accepted on repetitive text, rejected drafts give
their KV slots back (check_integrity after every step), and requests that may not speculate
run as before."""
import pytest

from radixserve.config import ServerArgs
from radixserve.engine.req import Req
from radixserve.sampling.params import SamplingParams

from conftest import run_to_completion
from spec_forced import force_drafts

SPEC = dict(speculative_algorithm="ngram", speculative_num_draft_tokens=5)


def greedy_req(rid, ids, n, **kw):
    sp = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, **kw)
    return Req(rid, list(ids), sp, n)


@pytest.fixture(scope="module")
def repeat_prompts(default_tokenizer, text_prompts):
    """Prompts whose text repeats, so the model's continuation repeats them too (drafts hit)."""
    texts = ["one two three four five six seven eight nine ten. one two three four five six "
             "seven eight nine ten. one two three four",
             "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef",
             "A B C D E F G A B C D E F G A B C"]
    return [default_tokenizer.encode(t) for t in texts]


@pytest.fixture(scope="module")
def make_scheduler_for(tmp_path_factory):
    """Schedulers over a tiny random Llama (vocab 97; transformers-made, O(1) logits, so a
    temperature-1 draw is far from one-hot), given ServerArgs overrides."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from radixserve.config import ModelConfig
    from radixserve.engine.scheduler import Scheduler
    from radixserve.model.runner import ModelRunner

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, prm in hf.named_parameters():
            noise = torch.randn(prm.shape, generator=gen)
            prm.copy_(1.0 + 0.1 * noise if "norm" in name else 0.15 * noise)
    path = str(tmp_path_factory.mktemp("tiny_spec"))
    hf.save_pretrained(path, safe_serialization=True)
    config = ModelConfig.from_path(path)

    def make(**overrides):
        kw = dict(model_path=path, device="cpu", max_total_tokens=2048, load_format="safetensors",
                  max_running_requests=48, context_length=256, dtype="float32")
        kw.update(overrides)
        args = ServerArgs(**kw)
        return Scheduler(args, ModelRunner(args, config, path, context_len=args.context_length))

    return make


def run(make_scheduler, prompts, n, spec, **kw):
    sched = make_scheduler(**(SPEC if spec else {}), **kw)
    reqs = [greedy_req(f"r{i}", p, n) for i, p in enumerate(prompts)]
    run_to_completion(sched, reqs)
    return sched, [r.output_ids for r in reqs]


@pytest.mark.parametrize("overlap", [True, False])
def test_greedy_identical_single_and_accepted(make_scheduler, repeat_prompts, overlap):
    for p in repeat_prompts:
        _, ref = run(make_scheduler, [p], 24, spec=False,
                     disable_overlap_schedule=not overlap)
        sched, out = run(make_scheduler, [p], 24, spec=True,
                         disable_overlap_schedule=not overlap)
        assert out == ref
    c = sched.counters
    assert c["spec_verify_steps"] > 0 and c["spec_draft_tokens"] > 0
    assert c["spec_accepted_tokens"] > 0
    m = sched.metrics()
    assert m["spec_accept_length"] > 1.0


def test_greedy_identical_batched_with_staggered_arrivals(make_scheduler, repeat_prompts,
                                                          text_prompts):
    prompts = (repeat_prompts + text_prompts) * 3           # 33 requests, some repeating
    lens = [8 + (i * 7) % 21 for i in range(len(prompts))]
    outs = {}
    for spec in (False, True):
        sched = make_scheduler(**(SPEC if spec else {}), max_running_requests=40)
        reqs = [greedy_req(f"b{i}", p, lens[i]) for i, p in enumerate(prompts)]
        arrivals = {0: reqs[:10], 2: reqs[10:20], 5: reqs[20:]}
        run_to_completion(sched, reqs, arrivals=arrivals)
        outs[spec] = [r.output_ids for r in reqs]
        assert all(len(o) == n for o, n in zip(outs[spec], lens))
    assert outs[True] == outs[False]
    assert sched.counters["spec_accepted_tokens"] > 0


def test_chunked_prefill_and_tiny_pool(make_scheduler, repeat_prompts, text_prompts):
    prompts = text_prompts[:8] + repeat_prompts[2:]
    _, ref = run(make_scheduler, prompts, 40, spec=False)
    for kw in (dict(chunked_prefill_size=16), dict(max_total_tokens=200)):
        sched, out = run(make_scheduler, prompts, 40, spec=True, **kw)
        assert out == ref, kw
    assert sched.counters["num_retractions"] > 0      # the tiny pool retracted under speculation


def test_stops_inside_accepted_drafts(make_scheduler, repeat_prompts, default_tokenizer):
    """A stop token or string that an accepted draft contains finishes the request there."""
    p = repeat_prompts[0]
    _, [ref] = run(make_scheduler, [p], 24, spec=False)
    stop_tok = ref[6]
    outs = {}
    for spec in (False, True):
        sched = make_scheduler(**(SPEC if spec else {}))
        a = greedy_req("a", p, 24, stop_token_ids=[stop_tok])
        b = greedy_req("b", p, 24, stop=[default_tokenizer.decode(ref[9:11]).strip()])
        run_to_completion(sched, [a, b])
        outs[spec] = [(r.output_ids, dict(r.finish_reason)) for r in (a, b)]
    assert outs[True] == outs[False]
    assert outs[True][0][0][-1] == stop_tok


def test_abort_mid_speculation(make_scheduler, repeat_prompts):
    sched = make_scheduler(**SPEC)
    reqs = [greedy_req(f"x{i}", p, 40) for i, p in enumerate(repeat_prompts)]
    for r in reqs:
        sched.add_request(r)
    for step in range(200):
        if not sched.has_work():
            break
        if step == 4:
            sched.abort("x0")
        sched.step()
        sched.check_integrity()
    assert reqs[0].finish_reason["type"] == "abort"
    assert all(r.finished for r in reqs)


def _sampled(rid, p, n, **kw):
    kw.setdefault("temperature", 0.8)
    return Req(rid, list(p), SamplingParams(max_new_tokens=n, ignore_eos=True, **kw), n,
               return_logprob=kw.pop("_lp", False) if "_lp" in kw else False)


def _mixed_reqs(p, tag):
    """Sampled requests of every per-row knob, a logprobs request, and the two kinds that
    run unspeculated (penalties here; a grammar: test_constrained.py's
    test_speculation_beside_grammar_rows_changes_nothing)."""
    return [
        Req(f"{tag}s", list(p), SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9,
                                               top_k=20, seed=7, ignore_eos=True), 16),
        Req(f"{tag}m", list(p), SamplingParams(max_new_tokens=16, temperature=1.0, min_p=0.05,
                                               seed=11, ignore_eos=True), 16),
        Req(f"{tag}b", list(p), SamplingParams(max_new_tokens=16, temperature=0.0,
                                               logit_bias={p[-1]: 5.0}, ignore_eos=True), 16),
        Req(f"{tag}l", list(p), SamplingParams(max_new_tokens=16, temperature=0.0,
                                               ignore_eos=True), 16,
            return_logprob=True, top_logprobs_num=3),
        Req(f"{tag}n", list(p), SamplingParams(max_new_tokens=16, temperature=0.7, seed=3,
                                               min_new_tokens=12), 16),
        greedy_req(f"{tag}p", p, 16, repetition_penalty=1.3),
    ]


def test_sampled_logprobs_and_per_row_knobs_identical(make_scheduler, repeat_prompts):
    """Sampled rows draw the same tokens with speculation (the draw is a function of the seed,
    the output offset and the distribution): outputs and logprobs equal the unspeculated run;
    penalties run unspeculated."""
    from radixserve.engine.scheduler.spec import SpecDecoder

    p = repeat_prompts[0]
    runs = {}
    for spec in (False, True):
        sched = make_scheduler(**(SPEC if spec else {}))
        reqs = _mixed_reqs(p, "x")
        lps, tops = [], []
        reqs[3].sink = lambda out: (lps.extend(out.output_token_logprobs_delta),
                                    tops.extend(out.output_top_logprobs_delta))
        run_to_completion(sched, reqs)
        runs[spec] = (sched, reqs, lps, tops)
    (_, ref, lp_ref, top_ref), (sched, got, lp_got, top_got) = runs[False], runs[True]
    assert [r.output_ids for r in got] == [r.output_ids for r in ref]
    assert len(lp_got) == len(lp_ref) == 16 and len(top_got) == 16
    for a, b in zip(lp_got, lp_ref):
        assert a[1] == b[1] and a[0] == pytest.approx(b[0], abs=1e-4)
    for a, b in zip(top_got, top_ref):
        assert [t for _, t, _ in a] == [t for _, t, _ in b]
    assert not SpecDecoder.eligible(got[5])                  # penalties
    assert all(SpecDecoder.eligible(r) for r in got[:5])
    assert got[5].spec is None                               # never drafted
    assert sched.counters["spec_accepted_tokens"] > 0
    # some sampled request had drafts accepted (its ReqSpec saw verifies)
    assert any(r.spec is not None for r in got[:2])


def test_sampled_distribution_tiny_random_model(make_scheduler_for):
    """The sampled path over a tiny random model: across 48 seeds at temperature 1, every
    output equals the unspeculated one (so the distributions are equal), and the outputs do
    vary with the seed (the rows really sample)."""
    sched_off, sched_on = make_scheduler_for(), make_scheduler_for(**SPEC)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    outs = {}
    for name, sched in (("off", sched_off), ("on", sched_on)):
        outs[name] = []
        for wave in range(2):           # 24 at a time: within the batch gate (SPEC_MAX_BATCH)
            reqs = [Req(f"d{i}", list(prompt), SamplingParams(
                max_new_tokens=12, temperature=1.0, seed=i, ignore_eos=True), 12)
                for i in range(24 * wave, 24 * wave + 24)]
            run_to_completion(sched, reqs)
            outs[name] += [tuple(r.output_ids) for r in reqs]
    assert outs["on"] == outs["off"]
    assert len(set(outs["on"])) > 24
    assert sched_on.counters["spec_verify_steps"] > 0


def test_suffix_drafts_from_the_radix_tree(make_scheduler, text_prompts):
    """--speculative-algorithm suffix: a prompt served once leaves prompt + output in the radix
    tree; served again, its drafts come from that continuation (text the ngram index of the
    request alone cannot predict), outputs are unchanged, and nearly every draft is accepted."""
    p = text_prompts[0]
    _, [ref] = run(make_scheduler, [p], 32, spec=False)
    accepted = {}
    for algo in ("ngram", "suffix"):
        sched = make_scheduler(speculative_algorithm=algo, speculative_num_draft_tokens=5)
        first = greedy_req("f", p, 32)
        run_to_completion(sched, [first])                  # publishes prompt + output
        before = sched.counters["spec_accepted_tokens"]
        again = greedy_req("g", p, 32)
        run_to_completion(sched, [again])
        assert first.output_ids == again.output_ids == ref
        accepted[algo] = sched.counters["spec_accepted_tokens"] - before
    assert accepted["suffix"] >= 16 and accepted["suffix"] > accepted["ngram"], accepted


@pytest.mark.parametrize("corrupt_every", [0, 3])
def test_verify_steps_overlap_and_rejections_void_the_step_after(
        monkeypatch, make_scheduler, repeat_prompts, text_prompts, corrupt_every):
    """Issue 39 point 4: a verify step is scheduled while the one before it is in flight,
    assuming that one's drafts accepted. With true continuations as drafts every draft is
    accepted and almost every step overlaps the one before (none voided); with every third
    draft wrong at its second token, the step after each such verify is voided for that
    request (device: its next input kept; host: results dropped, slots freed), and the
    outputs stay exactly the unspeculated ones, check_integrity after every step."""
    prompts = repeat_prompts + text_prompts[:3]
    n = 30
    _, ref = run(make_scheduler, prompts, n, spec=False)
    force_drafts(monkeypatch, {f"r{i}": out for i, out in enumerate(ref)}, corrupt_every)
    sched, out = run(make_scheduler, prompts, n, spec=True)
    assert out == ref
    c = sched.counters
    assert c["spec_verify_steps"] > 0
    assert c["spec_overlapped_verify_steps"] >= c["spec_verify_steps"] - 2
    if corrupt_every:
        assert c["spec_voided_steps"] > 0
        assert c["spec_accepted_tokens"] < c["spec_draft_tokens"]
    else:
        assert c["spec_voided_steps"] == 0
        assert c["spec_accepted_tokens"] == c["spec_draft_tokens"]
        # k + 1 = 5 tokens a verify row: far fewer decode steps than tokens
        assert c["num_decode_steps"] * 3 < n


def test_verify_overlap_with_sampled_rows(monkeypatch, make_scheduler, repeat_prompts):
    """Seeded sampled rows, logprobs and an unspeculated (penalties) row ride in overlapped
    verify steps with forced drafts (right and wrong): outputs and logprobs equal the
    unspeculated run."""
    p = repeat_prompts[0]
    runs = {}
    for spec in (False, True):
        if spec:
            force_drafts(monkeypatch, {r.rid: r.output_ids for r in runs[False][1]},
                           corrupt_every=4)
        sched = make_scheduler(**(SPEC if spec else {}))
        reqs = _mixed_reqs(p, "x")
        lps = []
        reqs[3].sink = lambda out: lps.extend(out.output_token_logprobs_delta)
        run_to_completion(sched, reqs)
        runs[spec] = (sched, reqs, lps)
    (_, ref, lp_ref), (sched, got, lp_got) = runs[False], runs[True]
    assert [r.output_ids for r in got] == [r.output_ids for r in ref]
    assert [t for _, t, _ in lp_got] == [t for _, t, _ in lp_ref]
    for a, b in zip(lp_got, lp_ref):
        assert a[0] == pytest.approx(b[0], abs=1e-4)
    c = sched.counters
    assert c["spec_overlapped_verify_steps"] > 0 and c["spec_voided_steps"] > 0


@pytest.mark.parametrize("kw", [dict(enable_mixed_chunk=True, chunked_prefill_size=32),
                                dict(enable_priority_scheduling=True, max_running_requests=4)],
                         ids=["mixed-chunk", "priority"])
def test_speculation_with_mixed_chunks_and_priorities(make_scheduler, repeat_prompts,
                                                      text_prompts, kw):
    """Mixed chunks (decode rows riding in prefill steps; none over a verify in flight) and
    priority scheduling (an urgent late arrival preempts speculating requests) with speculation
    overlapped: outputs equal the same configuration without speculation, integrity after
    every step."""
    prompts = repeat_prompts + text_prompts[:5]

    def reqs():
        out = [greedy_req(f"m{i}", p, 24) for i, p in enumerate(prompts)]
        for i, r in enumerate(out):
            r.priority = 20 if i == len(out) - 1 else 0
        return out

    outs = {}
    for spec in (False, True):
        sched = make_scheduler(**(SPEC if spec else {}), **kw)
        rs = reqs()
        run_to_completion(sched, rs, arrivals={3: rs[-2:]})
        outs[spec] = [r.output_ids for r in rs]
        counters = sched.counters
    assert outs[True] == outs[False]
    assert counters["spec_verify_steps"] > 0
    if "enable_priority_scheduling" in kw:
        assert counters["num_priority_retractions"] > 0


def test_overlap_is_chosen_where_it_pays():
    """RADIXSERVE_SPEC_OVERLAP=auto: verify steps overlap at a batch size once a serial verify
    step's measured period is at least 1.5x its device time (host work and launch latency to
    hide: a GPU with a small model), never where the forward is the period (the CPU); serial
    periods are measured first and again every PROBE_EVERY overlapped verify steps."""
    from radixserve.engine.scheduler.spec import PROBE_EVERY, RateGate

    gpu, cpu = RateGate(), RateGate()
    t = 0.0
    for gate, period, device in ((gpu, 2.8e-3, 0.6e-3), (cpu, 0.110, 0.105)):
        assert not gate.overlap_pays(1)                 # nothing measured: serial
        t = 0.0
        for _ in range(4):                              # serial verify steps at B = 1
            gate.step_scheduled("verify", 1, t)
            gate.verify_ran(1, device)
            t += period
        gate.step_scheduled("decode", 1, t)
    assert gpu.overlap_pays(1) and not cpu.overlap_pays(1)
    assert not gpu.overlap_pays(2)                      # per batch size
    for _ in range(PROBE_EVERY):                        # overlapped verify steps at B = 1
        t += 1e-3
        gpu.step_scheduled("verify_over", 1, t)
    assert not gpu.overlap_pays(1)                      # time to measure a serial one again
    gpu.step_scheduled("verify", 1, t + 1e-3)           # the probe
    assert not gpu.overlap_pays(1)                      # until its period is measured
    gpu.step_scheduled("decode", 1, t + 1e-3 + 2.8e-3)  # scheduled once the probe was processed
    assert gpu.overlap_pays(1)


def test_a_step_scheduled_over_a_serial_verify_does_not_measure_it():
    """A serial verify step's period is its host + device time only where the next step
    waited for it; one scheduled over it (overlap turned on meanwhile) ends its period at once,
    which would read as no host time to hide and turn overlap off again (measured on an H200:
    only 110 of 528 verify steps overlapped). Such a period is not counted."""
    from radixserve.engine.scheduler.spec import RateGate

    gate = RateGate()
    t = 0.0
    for _ in range(3):                                  # serial: 2.8 ms periods, 0.6 ms device
        gate.step_scheduled("verify", 1, t)
        gate.verify_ran(1, 0.6e-3)
        t += 2.8e-3
    gate.step_scheduled("verify", 1, t)
    gate.verify_ran(1, 0.6e-3)
    assert gate.overlap_pays(1)
    serial = gate.periods[("verify", 1)]
    for _ in range(8):
        t += 0.05e-3                                    # over the serial verify in flight
        gate.step_scheduled("verify_over", 1, t, over_last=True)
        gate.verify_ran(1, 0.6e-3)
        assert gate.overlap_pays(1)
    assert gate.periods[("verify", 1)] == serial


def test_auto_overlap_stays_on_where_host_time_dominates(monkeypatch, make_scheduler,
                                                         repeat_prompts, text_prompts):
    """The whole loop under auto with a GPU's timing, a clock of our own: processing a step's
    results costs 2.5 ms of host time, scheduling one 0.05 ms, a verify step 0.6 ms of device
    time. Serial verify periods (2.55 ms) are then over 1.5x their device time, so verify steps
    overlap, and keep overlapping: the step scheduled over a verify must not be taken for that
    verify's period (as it was on an H200, where only 110 of 528 verify steps overlapped). Only
    the measurements (the first serial periods of each batch size) and the probes every
    PROBE_EVERY overlapped verifies run serially, and each request's first verify (the step
    after its prefill, which is resolved first). Outputs equal the unspeculated ones."""
    import types

    from radixserve import knobs
    from radixserve.engine.scheduler import Scheduler
    from radixserve.engine.scheduler import core as core_mod
    from radixserve.engine.scheduler import spec as spec_mod

    prompts = repeat_prompts + text_prompts[:3]
    n = 60
    _, ref = run(make_scheduler, prompts, n, spec=False)
    force_drafts(monkeypatch, {f"r{i}": out for i, out in enumerate(ref)})
    clock = [0.0]

    def perf_counter():
        clock[0] += 0.05e-3
        return clock[0]

    monkeypatch.setattr(core_mod, "time", types.SimpleNamespace(perf_counter=perf_counter))
    processed = Scheduler.process_batch_result

    def process(self, batch, out):
        clock[0] += 2.5e-3
        processed(self, batch, out)

    monkeypatch.setattr(Scheduler, "process_batch_result", process)
    monkeypatch.setattr(spec_mod.SpecDecoder, "verify_ran",
                        lambda self, b, device_s: self.rate_gate.verify_ran(b, 0.6e-3))
    with knobs.override("RADIXSERVE_SPEC_OVERLAP", "auto"):
        sched = make_scheduler(**SPEC)
        out = []
        for i, p in enumerate(prompts):       # one at a time: every verify step at batch 1
            req = greedy_req(f"r{i}", p, n)
            run_to_completion(sched, [req])
            out.append(req.output_ids)
    assert out == ref
    c = sched.counters
    serial = c["spec_verify_steps"] - c["spec_overlapped_verify_steps"]
    # ~12 verify steps a request (k + 1 = 5 tokens each). Serial ones: each request's first
    # (its prefill is resolved before it), 3 that measure batch 1, and the probes
    assert c["spec_verify_steps"] > 60
    assert serial <= len(prompts) + 3 + c["spec_verify_steps"] // spec_mod.PROBE_EVERY, c


def test_auto_overlap_keeps_the_cpu_serial(make_scheduler, repeat_prompts):
    """On the CPU (auto) verify steps run with no step in flight, as the measured periods say;
    the knob set to on overlaps them; outputs equal either way."""
    outs, counters = {}, {}
    for mode in ("auto", "on"):
        from radixserve import knobs
        with knobs.override("RADIXSERVE_SPEC_OVERLAP", mode):
            sched, outs[mode] = run(make_scheduler, repeat_prompts, 32, spec=True)
        counters[mode] = sched.counters
    assert outs["auto"] == outs["on"]
    assert counters["auto"]["spec_verify_steps"] > 0
    assert counters["auto"]["spec_overlapped_verify_steps"] == 0
    assert counters["on"]["spec_overlapped_verify_steps"] > 0


def test_flags_checked():
    ServerArgs(**SPEC).check()
    ServerArgs(speculative_algorithm="suffix").check()
    with pytest.raises(ValueError, match="num-draft-tokens"):
        ServerArgs(speculative_algorithm="ngram", speculative_num_draft_tokens=1).check()
    with pytest.raises(ValueError, match="num-draft-tokens"):
        ServerArgs(speculative_algorithm="ngram", speculative_num_draft_tokens=33).check()
    ServerArgs(speculative_algorithm="ngram", speculative_num_draft_tokens=32).check()
    with pytest.raises(ValueError, match="tp-size"):
        ServerArgs(**SPEC, tp_size=2, device="cpu").check()
    with pytest.raises(ValueError, match="window"):
        ServerArgs(speculative_algorithm="ngram", speculative_ngram_min_match_window_size=5,
                   speculative_ngram_max_match_window_size=3).check()
