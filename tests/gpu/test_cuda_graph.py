"""Decode as CUDA graphs (model/cuda_graph_runner.py) against the eager forward.

A ModelRunner on a random-weight Llama (load_format dummy, weights rescaled so logits are O(1)),
bf16 and fp16, head_dim 64 and 128, GQA 2, and a Qwen3 (q/k norms) in bf16: requests are
prefilled eagerly, then one decode batch runs eagerly and through the graph of its bucket (which
also runs the decode prologue: table writes, kv indices, input ids read from the runner's
next_ids). The logits must agree
(the only difference is the decode kernel's split count, fixed by the graph's KV capacity), a
padded bucket must write no KV slot but the batch's own and the padding slot 0 and no table row
but the batch's and the padding row, and the K/V the graph writes must equal the eager step's.
"""
from __future__ import annotations

import json

import pytest
import torch

from _gpu import requires_kernels, rescale_dummy_weights
from radixserve import ops
from radixserve.config import ModelConfig, ServerArgs
from radixserve.model.forward_batch import ForwardBatch, ForwardMode

pytestmark = requires_kernels


def _model_dir(tmp_path_factory, head_dim: int, arch: str = "LlamaForCausalLM") -> str:
    path = tmp_path_factory.mktemp(f"{arch}_d{head_dim}")
    heads = 4
    cfg = {"architectures": [arch], "model_type": "llama", "vocab_size": 1000,
           "hidden_size": heads * head_dim, "intermediate_size": 384, "num_hidden_layers": 2,
           "num_attention_heads": heads, "num_key_value_heads": 2, "head_dim": head_dim,
           "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "tie_word_embeddings": False, "eos_token_id": 2, "bos_token_id": 1}
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


@pytest.fixture(scope="module", params=[(torch.bfloat16, 64, "LlamaForCausalLM"),
                                        (torch.float16, 128, "LlamaForCausalLM"),
                                        (torch.bfloat16, 128, "Qwen3ForCausalLM")],
                ids=["bf16_d64", "fp16_d128", "qwen3_bf16_d128"])
def runner(request, tmp_path_factory):
    from radixserve.model.runner import ModelRunner

    dtype, head_dim, arch = request.param
    path = _model_dir(tmp_path_factory, head_dim, arch)
    args = ServerArgs(model_path=path, load_format="dummy", device="cuda",
                      dtype="bfloat16" if dtype == torch.bfloat16 else "float16",
                      max_total_tokens=6000, max_running_requests=32, cuda_graph_max_bs=24)
    r = ModelRunner(args, ModelConfig.from_path(path), path, context_len=512)
    assert r.graph_runner is not None and r.graph_runner.buckets == [1, 2, 4, 8, 16, 24]
    rescale_dummy_weights(r.model)
    return r


def _prefill(runner, lens, gen):
    """Eager prefill of one request per length into rows 0..; returns (rows, slot tensors)."""
    rows, slots = [], []
    for row, n in enumerate(lens):
        s = runner.kv_pool.alloc(n + 1)                  # the prompt + the decode token
        runner.req_to_token[row, :n + 1] = s.to(runner.device, torch.int32)
        rows.append(row)
        slots.append(s)
    dev = runner.device
    ids = torch.randint(3, 1000, (sum(lens),), generator=gen, device=dev)
    positions = torch.cat([torch.arange(n, device=dev) for n in lens])
    qo = torch.tensor([0] + lens, device=dev).cumsum(0).to(torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32, device=dev)
    kv_indptr = torch.zeros(len(rows) + 1, dtype=torch.int32, device=dev)
    kv_indices = torch.empty(sum(lens), dtype=torch.int32, device=dev)
    ops.build_kv_indices(runner.req_to_token, torch.tensor(rows, device=dev), seq, kv_indptr,
                         kv_indices)
    fb = ForwardBatch(ForwardMode.EXTEND, len(rows), ids, positions,
                      torch.cat([s[:n] for s, n in zip(slots, lens)]).to(dev), qo, kv_indptr,
                      kv_indices, seq, (qo[1:] - 1).long(), runner.kv_pool)
    with torch.inference_mode():
        runner.model(fb)
    return rows, slots


def _release(runner, slots):
    for s in slots:
        runner.kv_pool.free(s)


def _eager_decode(runner, rows_t, seq_t, loc):
    from radixserve.model.forward_batch import decode_prologue

    dev = runner.device
    kv_indptr = torch.zeros(rows_t.numel() + 1, dtype=torch.int32, device=dev)
    kv_indices = torch.empty(int(seq_t.sum()), dtype=torch.int32, device=dev)
    with torch.inference_mode():
        ids, pos = decode_prologue(runner.req_to_token, runner.next_ids, rows_t, seq_t, loc,
                                   kv_indptr, kv_indices)
        fb = ForwardBatch(ForwardMode.DECODE, rows_t.numel(), ids, pos, loc, kv_indptr,
                          kv_indptr, kv_indices, seq_t, None, runner.kv_pool)
        return runner.compute_logits(runner.model(fb))


@pytest.mark.parametrize("bs", [1, 3, 17, 24])
def test_graph_decode_equals_eager(runner, bs):
    gen = torch.Generator(device="cuda").manual_seed(bs)
    lens = torch.randint(1, 200, (bs,), generator=gen, device="cuda").tolist()
    rows, slots = _prefill(runner, lens, gen)
    dev = runner.device
    rows_t = torch.tensor(rows, dtype=torch.int64, device=dev)
    runner.next_ids[rows_t] = torch.randint(3, 1000, (bs,), generator=gen, device=dev)
    seq_t = torch.tensor([n + 1 for n in lens], dtype=torch.int32, device=dev)
    loc = torch.stack([s[n] for s, n in zip(slots, lens)]).to(dev)
    assert runner.graph_runner.can_run(bs)

    eager = _eager_decode(runner, rows_t, seq_t, loc).clone()        # [bs, vocab]
    k_eager = [k[loc.long()].clone() for k in runner.kv_pool.k_buffers]
    k_before = [k.clone() for k in runner.kv_pool.k_buffers]
    v_before = [v.clone() for v in runner.kv_pool.v_buffers]
    table_before = runner.req_to_token.clone()
    graph = runner.graph_runner.replay(bs, rows_t, seq_t, loc).clone()
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
    # table: the batch's rows hold the same slots as after the eager step; no other row moved
    # but the padding row
    changed_rows = (runner.req_to_token != table_before).any(1).nonzero().flatten().tolist()
    assert set(changed_rows) <= {runner.padding_row}
    _release(runner, slots)


@pytest.mark.parametrize("bs", [1, 3])
def test_context_class_graph_equals_full_context_graph(runner, bs):
    """Small buckets also have graphs for short contexts (their decode grid planned for fewer
    tokens): replay() with the batch's longest length takes the smallest class that holds it,
    and its logits agree with the full-context graph's as two split plans agree; the K/V it
    writes are the same bits."""
    gen = torch.Generator(device="cuda").manual_seed(50 + bs)
    lens = torch.randint(20, 200, (bs,), generator=gen, device="cuda").tolist()
    rows, slots = _prefill(runner, lens, gen)
    dev = runner.device
    rows_t = torch.tensor(rows, dtype=torch.int64, device=dev)
    runner.next_ids[rows_t] = torch.randint(3, 1000, (bs,), generator=gen, device=dev)
    seq_t = torch.tensor([n + 1 for n in lens], dtype=torch.int32, device=dev)
    loc = torch.stack([s[n] for s, n in zip(slots, lens)]).to(dev)
    gr = runner.graph_runner
    bucket = gr.bucket_for(bs)
    assert len(gr.capacities[bucket]) > 1 and (bucket, gr.capacities[bucket][0]) in gr.graphs
    full = gr.replay(bs, rows_t, seq_t, loc).clone()
    k_full = [k[loc.long()].clone() for k in runner.kv_pool.k_buffers]
    short = gr.replay(bs, rows_t, seq_t, loc, max(n + 1 for n in lens)).clone()
    torch.cuda.synchronize()
    assert torch.isfinite(short).all() and full.abs().max() > 1.0
    tol = 0.03 if runner.dtype == torch.bfloat16 else 0.005
    assert (short - full).abs().max().item() <= tol * full.abs().max().item()
    assert all(torch.equal(k[loc.long()], kf) for k, kf in zip(runner.kv_pool.k_buffers, k_full))
    _release(runner, slots)


def test_graph_bounds(runner):
    assert not runner.graph_runner.can_run(25) and not runner.graph_runner.can_run(0)
    with pytest.raises(ValueError, match="exceeds"):
        runner.graph_runner.bucket_for(25)


def _decode_step(rows, seq_lens, loc):
    from radixserve.model.step_io import StepInput
    from radixserve.sampling.batch import SamplingInputs

    n = len(rows)
    si = SamplingInputs(temperature=[0.0] * n, top_k=[-1] * n, top_p=[1.0] * n, min_p=[0.0] * n,
                        seeds=[0] * n, offsets=[0] * n, top_logprobs_num=[0] * n)
    return StepInput(ForwardMode.DECODE, n, list(rows), list(seq_lens), loc, list(rows), si)


def test_launch_decode_goes_through_graphs(tmp_path_factory, monkeypatch):
    """ModelRunner.launch sends a decode step to CudaGraphRunner.replay (bf16: graphs on, up to
    the running limit by default) and --disable-cuda-graph keeps it off; the greedy ids agree
    with an eager argmax either way and land in next_ids as the rows' next inputs."""
    from radixserve.model import cuda_graph_runner as cgr
    from radixserve.model.runner import ModelRunner

    calls = {"n": 0}
    real = cgr.CudaGraphRunner.replay

    def counting(self, *a):
        calls["n"] += 1
        return real(self, *a)

    monkeypatch.setattr(cgr.CudaGraphRunner, "replay", counting)
    path = _model_dir(tmp_path_factory, 64)
    for disable in (False, True):
        args = ServerArgs(model_path=path, load_format="dummy", device="cuda", dtype="bfloat16",
                          max_total_tokens=4000, max_running_requests=8,
                          disable_cuda_graph=disable)
        r = ModelRunner(args, ModelConfig.from_path(path), path, context_len=256)
        assert (r.graph_runner is None) == disable
        if not disable:
            assert r.graph_runner.max_bs == 8          # every batch the running limit allows
        before = calls["n"]
        gen = torch.Generator(device="cuda").manual_seed(1)
        rows, slots = _prefill(r, [4, 6, 8], gen)
        dev = r.device
        r.next_ids[torch.tensor(rows, device=dev)] = torch.tensor([5, 6, 7], device=dev)
        loc = torch.stack([slots[0][4], slots[1][6], slots[2][8]])
        table = r.req_to_token.clone()
        eager_ids = _eager_decode(r, torch.tensor(rows, device=dev),
                                  torch.tensor([5, 7, 9], dtype=torch.int32, device=dev),
                                  loc.to(dev)).argmax(-1).tolist()
        r.req_to_token.copy_(table)
        r.next_ids[torch.tensor(rows, device=dev)] = torch.tensor([5, 6, 7], device=dev)
        out = r.run_step(_decode_step(rows, [5, 7, 9], loc))
        assert len(out.sample.ids) == 3 and all(out.sample.finite)
        if disable:
            assert out.sample.ids == eager_ids
        assert r.next_ids[torch.tensor(rows, device=dev)].tolist() == out.sample.ids
        assert (calls["n"] > before) == (not disable)
        _release(r, slots)
        del r
        torch.cuda.empty_cache()
