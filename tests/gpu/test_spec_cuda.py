"""Speculative decoding (--speculative-algorithm ngram) on the GPU: verify steps run as decode
steps whose draft positions are rows of their own (the runner's spare req_to_token rows), inside
the decode CUDA graphs. A small random Llama in bf16 loops on its own text, so drafts exist and
get accepted. With speculation every greedy request's output is a greedy sequence of the model
(each token the argmax of a teacher-forced forward, up to bf16 near-ties), most outputs equal the
unspeculated ones token for token (bf16 GEMMs are not batch-invariant, and a verify step has more
rows than a decode step: a near-tie may flip), integrity holds after every step and no KV leaks.
Sampled and seeded requests go through the same rows (their exact equality is the CPU tests'
claim, fp32: tests/unit/test_spec_decode.py)."""
from __future__ import annotations

import json
import random

import pytest
import torch

from _gpu import requires_kernels, rescale_dummy_weights
from spec_forced import force_drafts
from radixserve.config import ModelConfig, ServerArgs

pytestmark = requires_kernels

SPEC = dict(speculative_algorithm="ngram", speculative_num_draft_tokens=5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_spec")
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
           "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
           "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "tie_word_embeddings": False, "eos_token_id": 2, "bos_token_id": 1}
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def _scheduler(model_dir, model=None, **kw):
    from radixserve.engine.scheduler import Scheduler
    from radixserve.model.runner import ModelRunner

    args = ServerArgs(model_path=model_dir, load_format="dummy", device="cuda", dtype="bfloat16",
                      max_total_tokens=kw.pop("max_total_tokens", 8000), max_running_requests=48,
                      context_length=1024, **kw)
    runner = ModelRunner(args, ModelConfig.from_path(model_dir), model_dir, context_len=1024,
                         model=model)
    if model is None:
        rescale_dummy_weights(runner.model)
    return Scheduler(args, runner)


def _requests(tag, n=6, new=48):
    from radixserve.engine.req import Req
    from radixserve.sampling.params import SamplingParams

    rng = random.Random(11)
    reqs = []
    for i in range(n):
        unit = [rng.randrange(3, 512) for _ in range(rng.randint(4, 12))]
        prompt = unit * 4 + unit[:2]                    # repeating text: n-gram drafts hit
        kw = dict(max_new_tokens=new, ignore_eos=True, temperature=0.0)
        if i % 3 == 2:
            kw.update(temperature=0.8, top_p=0.9, seed=40 + i)
        reqs.append(Req(f"{tag}{i}", prompt, SamplingParams(**kw), new,
                        return_logprob=i == 1, top_logprobs_num=2 if i == 1 else 0))
    return reqs


def _run(sched, reqs):
    for r in reqs:
        sched.add_request(r)
    steps = 0
    while sched.has_work():
        sched.step()
        sched.check_integrity()
        steps += 1
        assert steps < 5000
    torch.cuda.synchronize()
    assert sched.kv_pool.available_size() + sched.cache.evictable_size() == \
        sched.kv_pool.num_slots


def _all_logits(runner, ids):
    """Logits at every position of ids ([len(ids), vocab] float32), one extend forward."""
    from radixserve.cache.kv_pool import KVPool
    from radixserve.model.forward_batch import ForwardBatch, ForwardMode

    cfg = runner.model_config
    n = len(ids)
    pool = KVPool(n + 1, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                  torch.bfloat16, "cuda")
    dev = "cuda"
    indptr = torch.tensor([0, n], dtype=torch.int32, device=dev)
    fb = ForwardBatch(mode=ForwardMode.EXTEND, batch_size=1,
                      input_ids=torch.tensor(ids, device=dev),
                      positions=torch.arange(n, device=dev),
                      out_cache_loc=torch.arange(1, n + 1, device=dev),
                      qo_indptr=indptr, kv_indptr=indptr,
                      kv_indices=torch.arange(1, n + 1, dtype=torch.int32, device=dev),
                      seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
                      logits_indices=torch.arange(n, device=dev), kv_pool=pool)
    with torch.no_grad():
        return runner.compute_logits(runner.model(fb)).float()


def test_verify_steps_in_graphs_give_greedy_sequences(model_dir):
    on = _scheduler(model_dir, **SPEC)
    off = _scheduler(model_dir, model=on.runner.model)
    got, ref = _requests("a"), _requests("a")
    _run(on, got)
    _run(off, ref)
    c = on.counters
    assert c["spec_verify_steps"] > 0 and c["spec_accepted_tokens"] > 0, c
    assert on.runner.graph_runner is not None
    assert all(len(r.output_ids) == 48 for r in got)
    for r in got:
        if r.sampling_params.temperature > 0:
            continue
        logits = _all_logits(on.runner, r.origin_input_ids + r.output_ids[:-1])
        rows = logits[len(r.origin_input_ids) - 1:]                     # [48, vocab]
        chosen = rows.gather(1, torch.tensor(r.output_ids, device="cuda")[:, None])[:, 0]
        gap = rows.max(dim=1).values - chosen                           # 0 for an argmax
        assert gap.max().item() < 0.1, (r.rid, gap.max().item())
    same = sum(a.output_ids == b.output_ids for a, b in zip(got, ref))
    assert same >= len(got) - 1, same


def test_verify_under_a_tiny_pool_and_aborts(model_dir):
    """Drafts never retract anyone: under a pool too small for every draft, steps fall back to
    plain decode rows; an abort mid-verify frees everything."""
    on = _scheduler(model_dir, max_total_tokens=420, **SPEC)
    reqs = _requests("t", n=8, new=40)
    for r in reqs:
        on.add_request(r)
    steps = 0
    while on.has_work():
        if steps == 6:
            on.abort(reqs[0].rid)
        on.step()
        on.check_integrity()
        steps += 1
        assert steps < 5000
    torch.cuda.synchronize()
    assert reqs[0].finish_reason["type"] == "abort"
    assert all(len(r.output_ids) == 40 for r in reqs[1:])
    assert on.kv_pool.available_size() + on.cache.evictable_size() == on.kv_pool.num_slots


def _greedy_gap(runner, r):
    """Largest logit gap between the argmax and r's chosen token over its output (0: every
    token an argmax of the teacher-forced forward)."""
    logits = _all_logits(runner, r.origin_input_ids + r.output_ids[:-1])
    rows = logits[len(r.origin_input_ids) - 1:]
    chosen = rows.gather(1, torch.tensor(r.output_ids, device="cuda")[:, None])[:, 0]
    return (rows.max(dim=1).values - chosen).max().item()


@pytest.mark.parametrize("corrupt_every", [0, 3])
def test_overlapped_verify_steps_in_graphs(model_dir, monkeypatch, corrupt_every):
    """Issue 39 point 4 on the GPU: drafts forced to the unspeculated run's continuations (every
    third one wrong at its second token with corrupt_every=3), gates open. Verify steps are
    scheduled while the one before runs (CUDA graphs, the device-side keep of a voided
    request's next input, StepInput.spec_cond_rows); greedy outputs stay greedy sequences of
    the model, integrity holds after every step, no KV leaks; true drafts are (nearly, up to
    bf16 near-ties between the runs) all accepted, wrong ones void the step after."""
    off = _scheduler(model_dir)
    ref = [r for r in _requests("o") if r.sampling_params.temperature == 0]
    _run(off, ref)
    force_drafts(monkeypatch, {r.rid: r.output_ids for r in ref}, corrupt_every, vocab=512)
    on = _scheduler(model_dir, model=off.runner.model, **SPEC)
    got = [r for r in _requests("o") if r.sampling_params.temperature == 0]
    _run(on, got)
    assert on.runner.graph_runner is not None
    c = on.counters
    assert c["spec_verify_steps"] > 0
    assert c["spec_overlapped_verify_steps"] >= c["spec_verify_steps"] - 2, c
    for r in got:
        assert len(r.output_ids) == 48
        assert _greedy_gap(on.runner, r) < 0.1, r.rid
    if corrupt_every:
        assert c["spec_voided_steps"] > 0, c
    else:
        assert c["spec_accepted_tokens"] >= 0.9 * c["spec_draft_tokens"], c
