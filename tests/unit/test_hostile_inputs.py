"""Hostile inputs, as property tests.

1. Sampling parameters: whatever a client sends, SamplingParams either refuses it with a
   ValueError (a 400 upstream) or every value survives the trip into the sampler's tensors
   (int64 seeds including seed + n - 1, int32 top_k, float32 temperatures and penalties) and a
   sampling step over them gives in-range ids: nothing a client sends can overflow while the
   scheduler builds a step (that used to stop the engine loop for good).
2. Request bodies: random, often malformed bodies through all three generation routes of the
   app (over the fake engine) never get a 5xx, and the app keeps serving a normal request.
"""
import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from radixserve.engine.req import Req
from radixserve.engine.schedule_batch import ScheduleBatch
from radixserve.model.forward_batch import ForwardMode
from radixserve.model.staging import Packer
from radixserve.sampling import sampler
from radixserve.sampling.batch import SamplingTensors
from radixserve.sampling.params import SamplingParams
from radixserve.sampling.penalties import PenaltyState

VOCAB = 64
NASTY_NUMBERS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 2**63 - 1, 2**63, -(2**63), 10**400]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e-50, 1e-39, 5e-324, 1e38, 3.5e38, 1e400, -0.0]),
)
NASTY = st.one_of(NASTY_NUMBERS, st.booleans(), st.none(), st.text(max_size=5),
                  st.lists(st.integers(-5, 100), max_size=4))
FIELDS = ["temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
          "repetition_penalty", "seed", "n", "max_new_tokens", "min_new_tokens",
          "stop_token_ids"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(FIELDS), NASTY, max_size=6))
def test_sampling_params_refused_or_safe_in_the_sampler(d):
    try:
        sp = SamplingParams.from_dict(d)
    except ValueError:      # a 400 upstream; anything else would be a 500
        return
    # the server's expansion gives sample j the seed seed + j
    seeds = [None if sp.seed is None else sp.seed + j for j in range(sp.n)]
    reqs = []
    for j, seed in enumerate(seeds[:4]):
        r = Req(f"r{j}", [1, 2, 3], sp, max_new_tokens=sp.max_new_tokens or 1)
        r.seed = seed if seed is not None else 7
        r.req_pool_idx = j
        reqs.append(r)
    batch = ScheduleBatch(ForwardMode.DECODE)
    for r in reqs:
        batch.add(r, 0, 1, torch.tensor([1]), sample=True)
    si = batch.sampling_inputs([2], VOCAB)
    # the runner's packed upload (sampling/batch.py packs it)
    ints, floats = Packer(torch.int64), Packer(torch.float32)
    si.pack(ints, floats)
    up_i, up_f = ints.upload(torch.device("cpu")), floats.upload(torch.device("cpu"))
    assert torch.isfinite(up_f["temperature"]).all()
    assert up_i["top_k"].to(torch.int32).tolist() == si.top_k     # fits int32 exactly
    assert up_i["seeds"].tolist() == si.seeds                     # fits int64 exactly
    if si.repetition:
        assert (up_f["repetition"] > 0).all()                     # never 0 in float32
    st_ = SamplingTensors.from_upload(up_i, up_f)
    state = PenaltyState(len(reqs), VOCAB, torch.device("cpu"))
    state.init_rows(si.penalty_init)
    logits = torch.randn(len(reqs), VOCAB)
    out = sampler.sample(logits, si, st_, torch.arange(len(reqs)), state)
    ids = out.ids.tolist()
    assert all(0 <= t < VOCAB for t in ids)
    assert all(math.isfinite(v) for v in out.logprobs.tolist())


JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
              st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8)),
    lambda children: st.one_of(st.lists(children, max_size=3),
                               st.dictionaries(st.text(max_size=6), children, max_size=3)),
    max_leaves=12)


def _bodies():
    prompt = st.one_of(st.text(max_size=20), st.lists(st.integers(-3, 300), max_size=6),
                       JSON_VALUES)
    sampling = st.dictionaries(st.sampled_from(FIELDS + ["stop", "max_tokens"]),
                               st.one_of(NASTY_NUMBERS.filter(
                                   lambda v: not (isinstance(v, float) and not math.isfinite(v))),
                                   JSON_VALUES), max_size=4)
    generate = st.fixed_dictionaries({"text": prompt}, optional={
        "sampling_params": st.one_of(sampling, JSON_VALUES), "stream": st.booleans(),
        "return_logprob": JSON_VALUES, "rid": JSON_VALUES})
    completions = st.fixed_dictionaries({"model": st.just("fake"), "prompt": prompt}, optional={
        "max_tokens": JSON_VALUES, "n": JSON_VALUES, "temperature": JSON_VALUES,
        "logprobs": JSON_VALUES, "stream": st.booleans(), "seed": JSON_VALUES,
        "stop": JSON_VALUES})
    chat = st.fixed_dictionaries({"model": st.just("fake"), "messages": st.one_of(
        st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "bogus"]),
                                        "content": st.one_of(st.text(max_size=10),
                                                             JSON_VALUES)}), max_size=3),
        JSON_VALUES)}, optional={"max_tokens": JSON_VALUES, "temperature": JSON_VALUES,
                                 "top_logprobs": JSON_VALUES, "stream": st.booleans()})
    return st.one_of(st.tuples(st.just("/generate"), generate),
                     st.tuples(st.just("/v1/completions"), completions),
                     st.tuples(st.just("/v1/chat/completions"), chat))


@settings(max_examples=250, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(_bodies())
def test_random_bodies_never_get_a_5xx(route_body):
    from test_server_fake_engine import LOCAL, FakeEngine

    from radixserve.server.app import create_app

    route, body = route_body
    engine = FakeEngine()
    with TestClient(create_app(engine), base_url=LOCAL, raise_server_exceptions=False) as client:
        r = client.post(route, json=body)
        assert r.status_code < 500, (route, body, r.status_code, r.text[:300])
        ok = client.post("/generate", json={"text": "hi", "sampling_params":
                                            {"max_new_tokens": 2, "temperature": 0}})
        assert ok.status_code == 200
