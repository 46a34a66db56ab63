"""Sampler and penalties: formulas against naive per-token loops, min_new_tokens, seeded
sampling, logprobs / top_logprobs, chunked prompt logprobs."""
import torch

from radixserve.engine.req import Req
from radixserve.sampling import sampler
from radixserve.sampling.params import SamplingParams

VOCAB = 50
EOS = 3


def make_req(rid="r", prompt=(5, 6, 7), output=(), **sp_kw):
    logprob_kw = {k: sp_kw.pop(k) for k in ("return_logprob", "top_logprobs_num") if k in sp_kw}
    seed = sp_kw.pop("seed", 1234)
    sp = SamplingParams(seed=seed, **sp_kw)
    req = Req(rid, list(prompt), sp, max_new_tokens=100, **logprob_kw)
    req.output_ids = list(output)
    return req


def info_for(reqs, eos=(EOS,)):
    return sampler.sampling_batch_info(reqs, VOCAB, list(eos), torch.device("cpu"))


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


def test_penalties_match_naive_formulas():
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) * 3
    reqs = [
        make_req("a", prompt=(1, 2, 9), output=(9, 9, 4, 11), repetition_penalty=1.3),
        make_req("b", prompt=(2,), output=(7, 7, 7, 8), frequency_penalty=0.5, presence_penalty=0.25),
        make_req("c", prompt=(1,), output=(1, 1), repetition_penalty=0.8, frequency_penalty=-0.3,
                 presence_penalty=1.0),
    ]
    info = info_for(reqs)
    work = logits.clone()
    sampler.apply_penalties(work, info.penalties)
    for i, r in enumerate(reqs):
        torch.testing.assert_close(work[i], naive_penalized(logits[i], r))
    # a penalty changes the greedy choice: the token that leads gets pushed below the runner-up
    logits2 = torch.zeros(1, VOCAB)
    logits2[0, 10], logits2[0, 11] = 2.0, 1.9
    r = make_req(output=(10, 10), temperature=0.0, frequency_penalty=1.0)
    assert sampler.sample(logits2, info_for([r])).ids == [11]
    assert sampler.sample(logits2, info_for([make_req(output=(10, 10), temperature=0.0)])).ids == [10]


def test_min_new_tokens_blocks_eos_and_stop_ids():
    logits = torch.zeros(2, VOCAB)
    logits[:, EOS] = 10.0
    logits[:, 20] = 9.0
    logits[:, 30] = 8.0
    blocked = make_req("a", output=(1,), temperature=0.0, min_new_tokens=3, stop_token_ids=[20])
    free = make_req("b", output=(1, 2, 3), temperature=0.0, min_new_tokens=3, stop_token_ids=[20])
    res = sampler.sample(logits, info_for([blocked, free]))
    assert res.ids == [30, EOS]
    # sampling (temperature > 0) never draws a blocked token either
    hot = make_req("c", output=(), temperature=1.0, min_new_tokens=1, stop_token_ids=[20])
    for seed in range(20):
        hot.seed = seed
        assert sampler.sample(logits[:1], info_for([hot])).ids[0] not in (EOS, 20)


def test_seeded_sampling_reproducible_and_batch_independent():
    torch.manual_seed(1)
    logits = torch.randn(4, VOCAB)
    reqs = [make_req(f"r{i}", output=(1,) * i, temperature=1.0, seed=100 + i) for i in range(4)]
    batch = sampler.sample(logits, info_for(reqs)).ids
    again = sampler.sample(logits, info_for(reqs)).ids
    assert batch == again
    # each row alone (or in another order) draws the same token as inside the batch
    for i in range(4):
        assert sampler.sample(logits[i:i + 1], info_for([reqs[i]])).ids == [batch[i]]
    rev = sampler.sample(logits.flip(0), info_for(reqs[::-1])).ids
    assert rev == batch[::-1]
    # the stream depends on the seed: over several seeds the draws are not all equal
    draws = set()
    for seed in range(8):
        r = make_req(output=(), temperature=1.0, seed=seed)
        draws.add(sampler.sample(logits[:1], info_for([r])).ids[0])
    assert len(draws) > 1


def test_logprobs_and_top_logprobs_consistent():
    torch.manual_seed(2)
    logits = torch.randn(3, VOCAB) * 2
    reqs = [make_req("a", temperature=0.0, return_logprob=True, top_logprobs_num=5),
            make_req("b", temperature=0.0),
            make_req("c", temperature=0.7, return_logprob=True, top_logprobs_num=0,
                     repetition_penalty=1.5)]
    res = sampler.sample(logits, info_for(reqs))
    ref = torch.log_softmax(logits, dim=-1)
    assert res.logprobs[1] is None and res.top_logprobs[1] is None
    assert abs(res.logprobs[0] - ref[0, res.ids[0]].item()) < 1e-5
    assert abs(res.logprobs[2] - ref[2, res.ids[2]].item()) < 1e-5   # raw logits, pre-penalty
    top = res.top_logprobs[0]
    assert len(top) == 5
    values = [v for v, _ in top]
    assert values == sorted(values, reverse=True)
    assert top[0][1] == res.ids[0] and abs(top[0][0] - res.logprobs[0]) < 1e-6   # greedy = top-1
    for v, t in top:
        assert abs(v - ref[0, t].item()) < 1e-5
    assert res.top_logprobs[2] is None


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
