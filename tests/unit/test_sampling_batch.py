"""sampling/batch.py: a step's sampling batch built from its requests in one call, packed into the
step's upload and read back as the sampler's tensors, row by row against each request's
SamplingParams; and the one field table (TENSOR_DTYPES) that a new knob's path follows agrees
with SamplingInputs and SamplingTensors, so a knob added to one of them and not the others fails
here."""
import dataclasses

import pytest
import torch

from radixserve.engine.req import Req
from radixserve.engine.schedule_batch import ScheduleBatch
from radixserve.model.forward_batch import ForwardMode
from radixserve.model.staging import Packer
from radixserve.sampling.batch import TENSOR_DTYPES, SamplingInputs, SamplingTensors
from radixserve.sampling.params import SamplingParams

VOCAB = 40
EOS = 2
PROMPT = [7, 8, 9]
CPU = torch.device("cpu")


def make_req(rid, pool_idx, output=(), *, seed=None, return_logprob=False, top_logprobs_num=0,
             grammar=None, **sp_kw):
    sp = SamplingParams(seed=seed, **sp_kw)
    r = Req(rid, list(PROMPT), sp, max_new_tokens=16, return_logprob=return_logprob,
            top_logprobs_num=top_logprobs_num)
    r.req_pool_idx = pool_idx
    r.output_ids = list(output)
    r.num_output_scheduled = len(output)
    r.grammar = grammar
    return r


def mixed_batch():
    """An extend batch of five requests, four of which sample, with mixed settings."""
    reqs = [
        # greedy, top_k 0 (off), no seed, logprobs with 3 top entries, logit_bias
        make_req("a", 3, temperature=0.0, top_k=0, return_logprob=True, top_logprobs_num=3,
                 logit_bias={5: 1.5, 11: -2.0}),
        # every filter and every penalty, a seed, two outputs so far
        make_req("b", 0, (4, 4), seed=123, temperature=0.7, top_k=5, top_p=0.9, min_p=0.05,
                 repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=-0.25),
        # a prefill chunk that does not sample
        make_req("c", 1, temperature=0.5, top_k=7, repetition_penalty=1.5),
        # min_new_tokens not reached: EOS and its in-vocabulary stop ids are banned
        make_req("d", 5, (1,), seed=-5, temperature=1.3, min_new_tokens=3,
                 stop_token_ids=[9, VOCAB + 3, EOS]),
        # a grammar (it decides the end: no bans), a penalty, logprobs without top entries
        make_req("e", 2, seed=2**63 - 1, min_new_tokens=5, frequency_penalty=0.1,
                 return_logprob=True, grammar=object()),
    ]
    batch = ScheduleBatch(ForwardMode.EXTEND)
    for r in reqs:
        sample = r.rid != "c"
        batch.add(r, 0, len(PROMPT), torch.arange(len(PROMPT)), sample=sample)
    return batch, [r for r in reqs if r.rid != "c"]


def upload(si):
    """si packed as the runner packs it, between other fields of the step's buffers."""
    ints, floats = Packer(torch.int64), Packer(torch.float32)
    ints.add("rows", [9, 9, 9])
    floats.add("other", [0.5])
    si.pack(ints, floats)
    ints.add("after", [1])
    return SamplingTensors.from_upload(ints.upload(CPU), floats.upload(CPU))


def f32(x):
    return torch.tensor(x, dtype=torch.float32).item()


def test_rows_match_the_requests_sampling_params():
    batch, sampling = mixed_batch()
    si = batch.sampling_inputs([EOS], VOCAB)
    st = upload(si)
    assert [r.rid for r in sampling] == ["a", "b", "d", "e"]
    for name, (_, dtype) in TENSOR_DTYPES.items():
        assert getattr(st, name).dtype == dtype, name
    assert st.temperature.shape == (4,) and si.all_greedy is False
    penalty_rows = st.penalty_rows.tolist()
    bias = list(zip(st.bias_rows.tolist(), st.bias_cols.tolist(), st.bias_values.tolist()))
    banned = list(zip(st.banned_rows.tolist(), st.banned_cols.tolist()))
    for row, r in enumerate(sampling):
        sp = r.sampling_params
        assert st.temperature[row].item() == f32(sp.temperature)
        assert st.top_k[row].item() == (sp.top_k if sp.top_k > 0 else -1)
        assert st.top_p[row].item() == f32(sp.top_p)
        assert st.min_p[row].item() == f32(sp.min_p)
        assert st.seeds[row].item() == (sp.seed if sp.seed is not None else 0)
        assert st.offsets[row].item() == len(r.output_ids)
        # penalties: the row appears iff it uses one, with its own three settings
        if r.uses_penalties:
            p = penalty_rows.index(row)
            assert st.repetition[p].item() == f32(sp.repetition_penalty)
            assert st.frequency[p].item() == f32(sp.frequency_penalty)
            assert st.presence[p].item() == f32(sp.presence_penalty)
        else:
            assert row not in penalty_rows
        assert {(c, v) for rw, c, v in bias if rw == row} == \
            {(c, f32(v)) for c, v in (sp.logit_bias or {}).items()}
        want_banned = set()
        if len(r.output_ids) < sp.min_new_tokens and r.grammar is None:
            want_banned = {t for t in [EOS] + list(sp.stop_token_ids or []) if t < VOCAB}
        assert {c for rw, c in banned if rw == row} == want_banned
        # host-only fields
        assert (row in si.logprob_rows) == r.return_logprob
        assert si.top_logprobs_num[row] == (r.top_logprobs_num if r.return_logprob else 0)
        assert (row in si.grammar_rows) == (r.grammar is not None)
    assert penalty_rows == [1, 3]
    assert banned == [(2, EOS), (2, 9)]      # sorted per row; VOCAB + 3 is out of vocabulary


def test_penalty_state_starts_once():
    batch, sampling = mixed_batch()
    si = batch.sampling_inputs([EOS], VOCAB)
    assert si.penalty_init == [(0, PROMPT, [4, 4]), (2, PROMPT, [])]
    assert [r.penalty_ready for r in sampling] == [False, True, False, True]
    assert batch.sampling_inputs([EOS], VOCAB).penalty_init == []


def test_one_call_from_the_sampling_requests():
    """ScheduleBatch hands sampling/batch.py its sampling rows and their offsets, nothing else."""
    batch, sampling = mixed_batch()
    direct = SamplingInputs.from_requests(sampling, [len(r.output_ids) for r in sampling],
                                          [EOS], VOCAB)
    for r in sampling:
        r.penalty_ready = False
    assert batch.sampling_inputs([EOS], VOCAB) == direct
    with pytest.raises(ValueError, match="offsets"):
        SamplingInputs.from_requests(sampling, [0], [EOS], VOCAB)


def test_field_table_agrees_with_inputs_and_tensors():
    """The path of every device field (a new knob's too): declared once in TENSOR_DTYPES, in
    SamplingTensors' order, held by SamplingInputs, packed once into the buffer of its packed
    dtype."""
    assert tuple(TENSOR_DTYPES) == SamplingTensors._fields
    host_fields = {f.name for f in dataclasses.fields(SamplingInputs)}
    assert set(TENSOR_DTYPES) <= host_fields
    added = {torch.int64: [], torch.float32: []}

    class Recorder:
        def __init__(self, dtype):
            self.dtype = dtype

        def add(self, name, values):
            added[self.dtype].append(name)

    SamplingInputs().pack(Recorder(torch.int64), Recorder(torch.float32))
    for name, (packed, _) in TENSOR_DTYPES.items():
        assert packed in (torch.int64, torch.float32)
        assert added[packed].count(name) == 1, name
    assert sum(map(len, added.values())) == len(TENSOR_DTYPES)


def test_every_field_round_trips_through_the_upload():
    """Distinct values in every device field come back from the packed upload in the sampler's
    dtype, equal to to_device's."""
    si = SamplingInputs()
    for i, (name, (packed, _)) in enumerate(TENSOR_DTYPES.items()):
        n = 3 + i % 4
        values = [10 * i + j for j in range(n)]
        setattr(si, name, [float(v) + 0.25 for v in values] if packed is torch.float32
                else values)
    st, direct = upload(si), si.to_device(CPU)
    for name, (_, dtype) in TENSOR_DTYPES.items():
        got = getattr(st, name)
        assert got.dtype == dtype and getattr(direct, name).dtype == dtype, name
        assert got.tolist() == pytest.approx(getattr(si, name)), name
        assert torch.equal(got, getattr(direct, name)), name


def test_empty_batch():
    st = upload(SamplingInputs())
    assert all(t.numel() == 0 for t in st)
    assert SamplingInputs().all_greedy
