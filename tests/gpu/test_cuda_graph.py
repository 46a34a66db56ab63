"""Decode as CUDA graphs (model/cuda_graph_runner.py) against the eager forward.

A ModelRunner on a random-weight Llama (load_format dummy, weights rescaled so logits are O(1)),
bf16 and fp16, head_dim 64 and 128, GQA 2: requests are prefilled eagerly, then one decode
batch runs eagerly and through the graph of its bucket. The logits must agree (the only
difference is the decode kernel's split count, fixed by the graph's KV capacity), a padded
bucket must write no KV slot but the batch's own and the padding slot 0, and the K/V the graph
writes must equal what the eager step wrote.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from _gpu import requires_kernels
from radixserve import ops
from radixserve.config import ModelConfig, ServerArgs
from radixserve.model.forward_batch import ForwardBatch, ForwardMode

pytestmark = requires_kernels


def _model_dir(tmp_path_factory, head_dim: int) -> str:
    path = tmp_path_factory.mktemp(f"llama_d{head_dim}")
    heads = 4
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000,
           "hidden_size": heads * head_dim, "intermediate_size": 384, "num_hidden_layers": 2,
           "num_attention_heads": heads, "num_key_value_heads": 2, "head_dim": head_dim,
           "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "tie_word_embeddings": False, "eos_token_id": 2, "bos_token_id": 1}
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


@pytest.fixture(scope="module", params=[(torch.bfloat16, 64), (torch.float16, 128)],
                ids=["bf16_d64", "fp16_d128"])
def runner(request, tmp_path_factory):
    from radixserve.model.runner import ModelRunner

    dtype, head_dim = request.param
    path = _model_dir(tmp_path_factory, head_dim)
    args = ServerArgs(model_path=path, load_format="dummy", device="cuda",
                      dtype="bfloat16" if dtype == torch.bfloat16 else "float16",
                      max_total_tokens=6000, max_running_requests=32, cuda_graph_max_bs=24)
    r = ModelRunner(args, ModelConfig.from_path(path), path, context_len=512)
    assert r.graph_runner is not None and r.graph_runner.buckets == [1, 2, 4, 8, 16, 24]
    # O(1) logits: the dummy init (std 0.02) makes them nearly flat
    gen = torch.Generator(device="cuda").manual_seed(3)
    with torch.no_grad():
        for name, p in r.model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen, device="cuda"))
            else:
                p.copy_(torch.randn(p.shape, generator=gen, device="cuda") / math.sqrt(p.shape[-1]))
    return r


def _prefill(runner, lens, gen):
    """Eager prefill of one request per length; returns (rows, slot tensors, next input ids)."""
    rows, slots = [], []
    for n in lens:
        row = runner.req_to_token_pool.alloc()
        s = runner.kv_pool.alloc(n + 1)                  # the prompt + the decode token
        runner.req_to_token_pool.write(row, 0, s)
        rows.append(row)
        slots.append(s)
    dev = runner.device
    ids = torch.randint(3, 1000, (sum(lens),), generator=gen, device=dev)
    positions = torch.cat([torch.arange(n, device=dev) for n in lens])
    qo = torch.tensor([0] + lens, device=dev).cumsum(0).to(torch.int32)
    fb = _batch(runner, ForwardMode.EXTEND, rows, lens, ids, positions,
                torch.cat([s[:n] for s, n in zip(slots, lens)]).to(dev), qo)
    runner.model(fb)
    return rows, slots


def _batch(runner, mode, rows, seq_lens, ids, positions, out_cache_loc, qo_indptr):
    dev = runner.device
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    kv_indptr = torch.zeros(len(rows) + 1, dtype=torch.int32, device=dev)
    kv_indices = torch.empty(max(1, sum(seq_lens)), dtype=torch.int32, device=dev)
    ops.build_kv_indices(runner.req_to_token_pool.req_to_token,
                         torch.tensor(rows, device=dev), seq, kv_indptr, kv_indices)
    n = ids.numel()
    logits_rows = (qo_indptr[1:] - 1).long()
    return ForwardBatch(mode=mode, batch_size=len(rows), input_ids=ids, positions=positions,
                        out_cache_loc=out_cache_loc, qo_indptr=qo_indptr, kv_indptr=kv_indptr,
                        kv_indices=kv_indices, seq_lens=seq, logits_indices=logits_rows[:n],
                        kv_pool=runner.kv_pool)


def _release(runner, rows, slots):
    for row, s in zip(rows, slots):
        runner.req_to_token_pool.free(row)
        runner.kv_pool.free(s)


@pytest.mark.parametrize("bs", [1, 3, 17, 24])
def test_graph_decode_equals_eager(runner, bs):
    gen = torch.Generator(device="cuda").manual_seed(bs)
    lens = torch.randint(1, 200, (bs,), generator=gen, device="cuda").tolist()
    rows, slots = _prefill(runner, lens, gen)
    dev = runner.device
    ids = torch.randint(3, 1000, (bs,), generator=gen, device=dev)
    positions = torch.tensor(lens, dtype=torch.int64, device=dev)
    loc = torch.stack([s[n] for s, n in zip(slots, lens)]).to(dev)
    qo = torch.arange(bs + 1, dtype=torch.int32, device=dev)
    fb = _batch(runner, ForwardMode.DECODE, rows, [n + 1 for n in lens], ids, positions, loc, qo)
    assert runner.graph_runner.can_run(fb)

    eager = runner.forward(fb).clone()                              # [bs, vocab]
    k_eager = [k[loc.long()].clone() for k in runner.kv_pool.k_buffers]
    k_before = [k.clone() for k in runner.kv_pool.k_buffers]
    v_before = [v.clone() for v in runner.kv_pool.v_buffers]
    graph = runner.graph_runner.replay(fb).clone()
    torch.cuda.synchronize()

    assert graph.shape == eager.shape and torch.isfinite(graph).all()
    scale = eager.abs().max().item()
    assert scale > 1.0, "logits too flat for the comparison to mean anything"
    tol = 0.03 if runner.dtype == torch.bfloat16 else 0.005
    assert (graph - eager).abs().max().item() <= tol * scale
    top2 = eager.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * tol * scale
    assert torch.equal(graph.argmax(-1)[clear], eager.argmax(-1)[clear])

    # KV: only the batch's slots and the padding slot 0 may change, and the batch's slots hold
    # what the eager step wrote (same K projections of the same inputs)
    allowed = torch.zeros(runner.kv_pool.k_buffers[0].shape[0], dtype=torch.bool, device=dev)
    allowed[loc.long()] = True
    allowed[0] = True
    for layer, (k, v) in enumerate(zip(runner.kv_pool.k_buffers, runner.kv_pool.v_buffers)):
        changed = ((k != k_before[layer]) | (v != v_before[layer])).flatten(1).any(1)
        assert not (changed & ~allowed).any(), f"layer {layer}: graph wrote foreign KV slots"
        torch.testing.assert_close(k[loc.long()].float(), k_eager[layer].float(),
                                   atol=2e-2, rtol=2e-2)
    _release(runner, rows, slots)


def test_graph_rejects_what_it_cannot_run(runner):
    gen = torch.Generator(device="cuda").manual_seed(7)
    rows, slots = _prefill(runner, [5, 9], gen)
    dev = runner.device
    qo = torch.tensor([0, 5, 14], dtype=torch.int32, device=dev)
    ids = torch.randint(3, 1000, (14,), generator=gen, device=dev)
    pos = torch.cat([torch.arange(5, device=dev), torch.arange(9, device=dev)])
    loc = torch.cat([slots[0][:5], slots[1][:9]]).to(dev)
    extend = _batch(runner, ForwardMode.EXTEND, rows, [5, 9], ids, pos, loc, qo)
    assert not runner.graph_runner.can_run(extend)
    with pytest.raises(ValueError, match="exceeds"):
        runner.graph_runner.bucket_for(25)
    _release(runner, rows, slots)


def test_run_step_decode_goes_through_graphs(tmp_path_factory, monkeypatch):
    """ModelRunner.run_step sends a decode step to CudaGraphRunner.replay (bf16: graphs on) and
    --disable-cuda-graph keeps it off; the greedy ids agree with an eager argmax either way."""
    from radixserve.model import cuda_graph_runner as cgr
    from radixserve.model.runner import ModelRunner

    calls = {"n": 0}
    real = cgr.CudaGraphRunner.replay

    def counting(self, fb):
        calls["n"] += 1
        return real(self, fb)

    monkeypatch.setattr(cgr.CudaGraphRunner, "replay", counting)
    path = _model_dir(tmp_path_factory, 64)
    for disable in (False, True):
        args = ServerArgs(model_path=path, load_format="dummy", device="cuda", dtype="bfloat16",
                          max_total_tokens=4000, max_running_requests=8, cuda_graph_max_bs=8,
                          disable_cuda_graph=disable)
        r = ModelRunner(args, ModelConfig.from_path(path), path, context_len=256)
        assert (r.graph_runner is None) == disable
        before = calls["n"]
        gen = torch.Generator(device="cuda").manual_seed(1)
        rows, slots = _prefill(r, [4, 6, 8], gen)
        dev = r.device
        fb = _batch(r, ForwardMode.DECODE, rows, [5, 7, 9],
                    torch.tensor([5, 6, 7], device=dev), torch.tensor([4, 6, 8], device=dev),
                    torch.stack([slots[0][4], slots[1][6], slots[2][8]]).to(dev),
                    torch.arange(4, dtype=torch.int32, device=dev))

        class _Step:  # the fields run_step reads
            forward_batch = fb
            num_prompt_rows = 0
            prompt_counts = [0, 0, 0]
            sampling_info = _greedy_info(3, dev)

        eager_ids = r.forward(fb).argmax(-1).tolist()
        out = r.run_step(_Step)
        assert len(out.sample.ids) == 3
        if disable:
            assert out.sample.ids == eager_ids
        assert (calls["n"] > before) == (not disable)
        _release(r, rows, slots)
        del r
        torch.cuda.empty_cache()


def _greedy_info(n: int, dev):
    from radixserve.sampling.penalties import PenaltyInfo
    from radixserve.sampling.sampler import SamplingBatchInfo

    f32 = dict(dtype=torch.float32, device=dev)
    return SamplingBatchInfo(
        temperature=torch.zeros(n, **f32), top_k=torch.full((n,), -1, dtype=torch.int32, device=dev),
        top_p=torch.ones(n, **f32), min_p=torch.zeros(n, **f32),
        seeds=torch.zeros(n, dtype=torch.int64, device=dev),
        offsets=torch.zeros(n, dtype=torch.int64, device=dev), penalties=PenaltyInfo(),
        logprob_rows=[], top_logprobs_num=[0] * n, all_greedy=True)
