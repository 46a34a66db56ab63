"""Sampler and penalties: formulas against naive per-token loops, penalty state kept on the
device across steps, min_new_tokens, seeded sampling, logprobs / top_logprobs from the sampler's
own outputs, non-finite rows flagged, chunked prompt logprobs."""
import math

import torch

from radixserve.engine.req import Req
from radixserve.engine.schedule_batch import ScheduleBatch
from radixserve.model.forward_batch import ForwardMode
from radixserve.sampling import sampler
from radixserve.sampling.params import SamplingParams
from radixserve.sampling.penalties import PenaltyState

VOCAB = 50
EOS = 3


def make_req(rid="r", prompt=(5, 6, 7), output=(), **sp_kw):
    logprob_kw = {k: sp_kw.pop(k) for k in ("return_logprob", "top_logprobs_num") if k in sp_kw}
    seed = sp_kw.pop("seed", 1234)
    sp = SamplingParams(seed=seed, **sp_kw)
    req = Req(rid, list(prompt), sp, max_new_tokens=100, **logprob_kw)
    req.output_ids = list(output)
    return req


def run(logits, reqs, eos=(EOS,), state=None):
    """One sampling step of reqs (rows 0..n-1) as the runner does it: inputs from a
    ScheduleBatch, penalty rows initialised on first use, host results. Returns
    (ids, logprobs, top_logprobs, finite, state)."""
    batch = ScheduleBatch(ForwardMode.DECODE)
    for i, r in enumerate(reqs):
        r.req_pool_idx = i
        r.num_output_scheduled = len(r.output_ids)
        batch.add(r, 0, 1, torch.tensor([1]), sample=True, from_device=True)
    si = batch.sampling_inputs(list(eos), VOCAB)
    state = state or PenaltyState(len(reqs), VOCAB, torch.device("cpu"))
    state.init_rows(si.penalty_init)
    st = si.to_device(torch.device("cpu"))
    out = sampler.sample(logits, si, st, torch.arange(len(reqs)), state)
    ids = out.ids.tolist()
    tv = out.top_values.tolist() if out.top_values is not None else None
    ti = out.top_ids.tolist() if out.top_ids is not None else None
    lp, top, finite = sampler.host_result(si, ids, out.logprobs.tolist(), tv, ti)
    return ids, lp, top, finite, state


def naive_penalized(logits, req):
    out = logits.clone()
    sp = req.sampling_params
    seen = set(req.origin_input_ids) | set(req.output_ids)
    for t in range(VOCAB):
        x = out[t].item()
        if t in seen and sp.repetition_penalty != 1.0:
            x = x / sp.repetition_penalty if x > 0 else x * sp.repetition_penalty
        c = req.output_ids.count(t)
        x -= sp.frequency_penalty * c + sp.presence_penalty * (1.0 if c > 0 else 0.0)
        out[t] = x
    return out


def penalized_logits(logits, reqs):
    """What the sampler would sample from: apply the device state of reqs to logits."""
    batch = ScheduleBatch(ForwardMode.DECODE)
    for i, r in enumerate(reqs):
        r.req_pool_idx = i
        r.num_output_scheduled = len(r.output_ids)
        batch.add(r, 0, 1, torch.tensor([1]), sample=True)
    si = batch.sampling_inputs([EOS], VOCAB)
    state = PenaltyState(len(reqs), VOCAB, torch.device("cpu"))
    state.init_rows(si.penalty_init)
    st = si.to_device(torch.device("cpu"))
    work = logits.clone()
    state.apply(work, st.penalty_rows, st.penalty_rows, st.repetition, st.frequency, st.presence)
    return work


def test_penalties_match_naive_formulas():
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) * 3
    reqs = [
        make_req("a", prompt=(1, 2, 9), output=(9, 9, 4, 11), repetition_penalty=1.3),
        make_req("b", prompt=(2,), output=(7, 7, 7, 8), frequency_penalty=0.5, presence_penalty=0.25),
        make_req("c", prompt=(1,), output=(1, 1), repetition_penalty=0.8, frequency_penalty=-0.3,
                 presence_penalty=1.0),
    ]
    work = penalized_logits(logits, reqs)
    for i, r in enumerate(reqs):
        torch.testing.assert_close(work[i], naive_penalized(logits[i], r))
    # a penalty changes the greedy choice: the token that leads gets pushed below the runner-up
    logits2 = torch.zeros(1, VOCAB)
    logits2[0, 10], logits2[0, 11] = 2.0, 1.9
    r = make_req(output=(10, 10), temperature=0.0, frequency_penalty=1.0)
    assert run(logits2, [r])[0] == [11]
    assert run(logits2, [make_req(output=(10, 10), temperature=0.0)])[0] == [10]


def test_penalty_state_counts_each_sampled_token_on_the_device():
    """Across steps the state is updated incrementally (record), never rebuilt: after k greedy
    steps under a frequency penalty its counts equal the bincount of the k outputs, and each
    step's choice equals the naive formula's."""
    torch.manual_seed(4)
    base = torch.randn(2, VOCAB)
    reqs = [make_req("a", temperature=0.0, frequency_penalty=0.7, presence_penalty=0.1),
            make_req("b", temperature=0.0, repetition_penalty=1.5, prompt=(4, 8))]
    state = None
    for step in range(6):
        want = [int(naive_penalized(base[i], r).argmax()) for i, r in enumerate(reqs)]
        ids, _, _, _, state = run(base, reqs, state=state)
        assert ids == want, f"step {step}"
        for r, t in zip(reqs, ids):
            r.output_ids.append(t)
    for i, r in enumerate(reqs):
        counts = torch.bincount(torch.tensor(r.output_ids), minlength=VOCAB).to(torch.int32)
        assert torch.equal(state.counts[i], counts)
    assert len(set(reqs[0].output_ids)) > 1       # the penalty moved the choice at least once


def test_min_new_tokens_blocks_eos_and_stop_ids():
    logits = torch.zeros(2, VOCAB)
    logits[:, EOS] = 10.0
    logits[:, 20] = 9.0
    logits[:, 30] = 8.0
    blocked = make_req("a", output=(1,), temperature=0.0, min_new_tokens=3, stop_token_ids=[20])
    free = make_req("b", output=(1, 2, 3), temperature=0.0, min_new_tokens=3, stop_token_ids=[20])
    assert run(logits, [blocked, free])[0] == [30, EOS]
    # sampling (temperature > 0) never draws a blocked token either
    hot = make_req("c", output=(), temperature=1.0, min_new_tokens=1, stop_token_ids=[20])
    for seed in range(20):
        hot.seed = seed
        assert run(logits[:1], [hot])[0][0] not in (EOS, 20)


def test_seeded_sampling_reproducible_and_batch_independent():
    torch.manual_seed(1)
    logits = torch.randn(4, VOCAB)
    reqs = [make_req(f"r{i}", output=(1,) * i, temperature=1.0, seed=100 + i) for i in range(4)]
    batch = run(logits, reqs)[0]
    assert run(logits, reqs)[0] == batch
    # each row alone (or in another order) draws the same token as inside the batch
    for i in range(4):
        assert run(logits[i:i + 1], [reqs[i]])[0] == [batch[i]]
    assert run(logits.flip(0), reqs[::-1])[0] == batch[::-1]
    # the stream depends on the seed: over several seeds the draws are not all equal
    draws = set()
    for seed in range(8):
        draws.add(run(logits[:1], [make_req(output=(), temperature=1.0, seed=seed)])[0][0])
    assert len(draws) > 1


def test_logprobs_and_top_logprobs_consistent():
    torch.manual_seed(2)
    logits = torch.randn(3, VOCAB) * 2
    reqs = [make_req("a", temperature=0.0, return_logprob=True, top_logprobs_num=5),
            make_req("b", temperature=0.0),
            make_req("c", temperature=0.7, return_logprob=True, top_logprobs_num=0,
                     repetition_penalty=1.5)]
    ids, lps, tops, finite, _ = run(logits, reqs)
    ref = torch.log_softmax(logits, dim=-1)
    assert lps[1] is None and tops[1] is None
    assert abs(lps[0] - ref[0, ids[0]].item()) < 1e-5
    assert abs(lps[2] - ref[2, ids[2]].item()) < 1e-5   # raw logits, pre-penalty
    top = tops[0]
    assert len(top) == 5
    values = [v for v, _ in top]
    assert values == sorted(values, reverse=True)
    assert top[0][1] == ids[0] and abs(top[0][0] - lps[0]) < 1e-6   # greedy = top-1
    for v, t in top:
        assert abs(v - ref[0, t].item()) < 1e-5
    assert tops[2] is None
    assert finite == [True, True, True]


def test_non_finite_rows_are_flagged_alone():
    torch.manual_seed(5)
    logits = torch.randn(4, VOCAB)
    logits[1, 7] = float("nan")
    logits[2, 9] = float("inf")
    reqs = [make_req(f"r{i}", temperature=t) for i, t in enumerate((0.0, 0.0, 0.9, 0.9))]
    ids, _, _, finite, _ = run(logits, reqs)
    assert finite == [True, False, False, True]
    assert ids[0] == int(logits[0].argmax()) and 0 <= ids[3] < VOCAB


def test_prompt_logprobs_chunked_equals_direct():
    torch.manual_seed(3)
    weight = torch.randn(VOCAB, 16)
    hidden = torch.randn(sampler.PROMPT_LOGPROB_CHUNK * 2 + 7, 16)
    targets = torch.randint(0, VOCAB, (hidden.shape[0],))
    values, tops = sampler.prompt_logprobs(lambda h: h @ weight.T, hidden, targets, top_k=3)
    ref = torch.log_softmax(hidden @ weight.T, dim=-1)
    torch.testing.assert_close(torch.tensor(values), ref.gather(-1, targets[:, None])[:, 0])
    assert len(tops) == hidden.shape[0]
    for row, entries in enumerate(tops):
        assert [t for _, t in entries] == torch.topk(ref[row], 3).indices.tolist()
    assert all(math.isfinite(v) for v in values)


def test_sparse_penalty_update_equals_the_dense_one():
    """On the CPU the penalties touch only the seen (row, token) entries (apply_sparse); the
    logits equal apply_dense's, which computes every entry, bit for bit."""
    g = torch.Generator().manual_seed(6)
    vocab, rows = 3000, 6
    state = PenaltyState(10, vocab, torch.device("cpu"))
    state.init_rows([(r, torch.randint(0, vocab, (40,), generator=g).tolist(),
                      torch.randint(0, vocab, (25,), generator=g).tolist()) for r in range(10)])
    logits = torch.randn(8, vocab, generator=g) * 4
    logits[2, :50] = float("-inf")                    # banned tokens stay -inf
    batch_rows = torch.tensor([0, 2, 3, 5, 6, 7])
    pool_rows = torch.tensor([9, 1, 4, 0, 7, 3])
    repetition = torch.tensor([1.3, 1.0, 0.7, 1.1, 2.0, 1.0])
    frequency = torch.tensor([0.5, -0.3, 0.0, 1.5, -2.0, 0.2])
    presence = torch.tensor([0.25, 1.0, -0.5, 0.0, 0.3, -1.0])
    dense, sparse = logits.clone(), logits.clone()
    state.apply_dense(dense, batch_rows, pool_rows, repetition, frequency, presence)
    state.apply_sparse(sparse, batch_rows, pool_rows, repetition, frequency, presence)
    assert not torch.equal(dense, logits)
    assert torch.equal(sparse, dense)
    cpu = logits.clone()                              # apply picks the sparse path on the CPU
    state.apply(cpu, batch_rows, pool_rows, repetition, frequency, presence)
    assert torch.equal(cpu, dense)


def test_cpu_sampler_draws_with_the_cpu_path():
    """sampler.sample on CPU tensors samples with cpu_sampling.bitmask_sample (not the sorting
    reference), after the penalties: its ids are that function's on the penalized logits."""
    from radixserve.sampling import cpu_sampling

    torch.manual_seed(7)
    logits = torch.randn(8, VOCAB)
    def reqs():
        return [make_req(f"r{i}", output=(1, 2) * i, temperature=1.0, seed=300 + i,
                         top_k=(0, 10)[i % 2], frequency_penalty=0.4 * (i % 3)) for i in range(8)]

    ids = run(logits, reqs())[0]
    work = penalized_logits(logits, reqs())
    n = len(ids)
    want, _ = cpu_sampling.bitmask_sample(
        work, None, torch.ones(n), torch.tensor([(-1, 10)[i % 2] for i in range(n)],
                                                dtype=torch.int32),
        torch.ones(n), torch.zeros(n), torch.tensor([300 + i for i in range(n)]),
        torch.tensor([2 * i for i in range(n)]))
    assert ids == want.tolist()
