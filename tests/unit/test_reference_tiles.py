"""The reference ops in bounded memory (radixserve.ops.reference, issue 33): attention runs a batch
in tiles (attention_plan), the row-wise ops in slices of rows (TILE_BYTES), with the results of
the untiled formulas; a 32k-token prompt runs through a tiny random Llama on the CPU.

Boundedness is shown without timing: by the plan's own arithmetic (attention_tile_bytes) at the
real sizes, and by recording every tensor the ops allocate (_Allocations) at a forced small
TILE_BYTES, where the untiled form would allocate more."""
from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from radixserve.ops import reference as ref


class _Allocations(TorchDispatchMode):
    """The storages that the ops run under it return, by address -> bytes, other than those of
    `inputs` (views of an input allocate nothing)."""

    def __init__(self, *inputs: torch.Tensor):
        super().__init__()
        self.inputs = {t.untyped_storage().data_ptr() for t in inputs}
        self.sizes = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage.data_ptr() not in self.inputs:
                    self.sizes[storage.data_ptr()] = max(storage.nbytes(),
                                                         self.sizes.get(storage.data_ptr(), 0))
        return out

    def largest_besides(self, result: torch.Tensor) -> int:
        """The largest allocation other than `result`'s (an op's output is not an intermediate)."""
        own = result.untyped_storage().data_ptr()
        return max((n for ptr, n in self.sizes.items() if ptr != own), default=0)


def _paged(kv_lens, hk, d, seed, dtype=torch.float64):
    """K/V caches with each request's slots scattered through the pool (slot 0 is padding)."""
    g = torch.Generator().manual_seed(seed)
    num_slots = sum(kv_lens) + 13
    k_cache = torch.randn(num_slots, hk, d, generator=g, dtype=dtype)
    v_cache = torch.randn(num_slots, hk, d, generator=g, dtype=dtype)
    kv_indices = (torch.randperm(num_slots - 1, generator=g)[:sum(kv_lens)] + 1).to(torch.int32)
    kv_indptr = torch.tensor([0] + kv_lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    return k_cache, v_cache, kv_indptr, kv_indices, g


def _indptr(lens):
    return torch.tensor([0] + list(lens), dtype=torch.int64).cumsum(0).to(torch.int32)


def _direct_attention(q_rows, k, v, sm_scale, positions):
    """The untiled formula, in float64: q_rows [n, hq, d] at KV positions `positions` over
    k, v [len, hk, d] -> [n, hq, d] = softmax(q k^T * sm_scale, causal by position) v, query head
    h reading KV head h // (hq // hk)."""
    hq, hk = q_rows.shape[1], k.shape[1]
    kk = k.double().repeat_interleave(hq // hk, dim=1)                       # [len, hq, d]
    vv = v.double().repeat_interleave(hq // hk, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q_rows.double(), kk) * sm_scale    # [hq, n, len]
    pos = torch.as_tensor(positions)
    future = torch.arange(k.shape[0])[None, None, :] > pos[None, :, None]
    probs = scores.masked_fill(future, float("-inf")).softmax(-1)
    return torch.einsum("hnl,lhd->nhd", probs, vv)


def _direct_extend(q, k_cache, v_cache, q_lens, kv_lens, kv_indptr, kv_indices, sm_scale):
    out, start = [], 0
    for b, (n, kv) in enumerate(zip(q_lens, kv_lens)):
        slots = kv_indices[kv_indptr[b]:kv_indptr[b + 1]].long()
        out.append(_direct_attention(q[start:start + n], k_cache[slots], v_cache[slots],
                                     sm_scale, [kv - n + i for i in range(n)]))
        start += n
    return torch.cat(out)


# requests with and without a cached prefix, short ones that share tiles and long ones cut
Q_LENS, KV_LENS = [3, 1, 40, 5, 2, 33], [7, 1, 40, 12, 9, 50]


def _small_budget(hq, hk, d, kv_elem_size):
    """A TILE_BYTES that puts short requests together and cuts the long ones (rows; heads too
    where there are several KV heads): the budget of 2 requests padded to 5 rows and 12 KV."""
    return ref.attention_tile_bytes(2, 5, 12, hk, hq // hk, d, kv_elem_size)


@pytest.mark.parametrize("hq,hk", [(8, 2), (6, 1), (4, 4)])
def test_extend_attention_in_tiles_equals_the_direct_formula(hq, hk, monkeypatch):
    d = 8
    k_cache, v_cache, kv_indptr, kv_indices, g = _paged(KV_LENS, hk, d, hq * 7 + hk)
    q = torch.randn(sum(Q_LENS), hq, d, generator=g, dtype=torch.float64)
    monkeypatch.setattr(ref, "TILE_BYTES", _small_budget(hq, hk, d, 8))
    plan = ref.attention_plan(Q_LENS, KV_LENS, hq, hk, d, 8)
    assert any(t.req_end - t.req_start > 1 for t in plan), "no requests padded together"
    assert any(t.q_end - t.q_start < Q_LENS[t.req_start] for t in plan), "no rows cut"
    if hk > 1:
        assert any(t.head_end - t.head_start < hk for t in plan), "no heads cut"
    assert ref.PagedAttention(kv_indptr, kv_indices, _indptr(Q_LENS), hq, hk, d, 8).tiles == plan
    out = ref.paged_extend_attention(q, k_cache, v_cache, _indptr(Q_LENS), kv_indptr,
                                     kv_indices, 0.3)
    want = _direct_extend(q, k_cache, v_cache, Q_LENS, KV_LENS, kv_indptr, kv_indices, 0.3)
    assert out.dtype == q.dtype and out.shape == q.shape
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)   # computed in fp32


@pytest.mark.parametrize("hq,hk", [(8, 2), (6, 1)])
def test_decode_attention_in_tiles_equals_the_direct_formula(hq, hk, monkeypatch):
    d, lens = 8, [1, 7, 19, 60, 3, 44]
    k_cache, v_cache, kv_indptr, kv_indices, g = _paged(lens, hk, d, hq + hk)
    q = torch.randn(len(lens), hq, d, generator=g, dtype=torch.float64)
    budget = ref.attention_tile_bytes(2, 1, 20, hk, hq // hk, d, 8)
    monkeypatch.setattr(ref, "TILE_BYTES", budget)
    plan = ref.attention_plan([1] * len(lens), lens, hq, hk, d, 8)
    assert any(t.req_end - t.req_start > 1 for t in plan) and len(plan) > 3
    if hk > 1:
        assert any(t.head_end - t.head_start < hk for t in plan), "no heads cut"
    out = ref.paged_decode_attention(q, k_cache, v_cache, kv_indptr, kv_indices, 0.25)
    want = _direct_extend(q, k_cache, v_cache, [1] * len(lens), lens, kv_indptr, kv_indices, 0.25)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


def test_cpu_decode_table_reuses_the_tiles_across_layers(monkeypatch):
    from radixserve.model.cpu_attention import CpuDecodeAttention

    d, hq, hk, lens = 8, 6, 2, [5, 30, 2, 17]
    k_cache, v_cache, kv_indptr, kv_indices, g = _paged(lens, hk, d, 11, torch.float32)
    monkeypatch.setattr(ref, "TILE_BYTES", ref.attention_tile_bytes(1, 1, 20, hk, 3, d, 4))
    attn = CpuDecodeAttention(kv_indptr, kv_indices)
    for _ in range(2):              # one table, two layers' caches
        q = torch.randn(len(lens), hq, d, generator=g)
        want = _direct_extend(q, k_cache, v_cache, [1] * len(lens), lens, kv_indptr,
                              kv_indices, d ** -0.5)
        torch.testing.assert_close(attn(q, k_cache, v_cache, d ** -0.5), want.float(),
                                   atol=2e-5, rtol=2e-5)
        k_cache, v_cache = v_cache, k_cache
    assert len(attn._attn[1].tiles) > 1


def test_attention_plan_covers_every_row_and_head_once_within_the_budget():
    rng = random.Random(5)
    for case in range(200):
        hk = rng.choice([1, 2, 3, 8])
        hq, d, elem = hk * rng.choice([1, 3, 4]), rng.choice([4, 16, 128]), rng.choice([2, 4])
        q_lens = [rng.choice([0, 1, rng.randrange(1, 300)]) for _ in range(rng.randrange(1, 7))]
        kv_lens = [n + rng.choice([0, rng.randrange(0, 500)]) for n in q_lens]
        budget = rng.choice([1 << 12, 1 << 16, 1 << 20, 1 << 24])
        plan = ref.attention_plan(q_lens, kv_lens, hq, hk, d, elem, budget)
        seen = {}
        for t in plan:
            reqs = range(t.req_start, t.req_end)
            group_kv = max(kv_lens[b] for b in reqs)
            cost = ref.attention_tile_bytes(len(reqs), t.q_end - t.q_start, group_kv,
                                            t.head_end - t.head_start, hq // hk, d, elem)
            minimal = len(reqs) == 1 and t.q_end - t.q_start == 1 and t.head_end - t.head_start == 1
            assert cost <= budget or minimal, (case, t)
            assert 0 < t.head_end - t.head_start and t.head_end <= hk
            for b in reqs:
                for i in range(t.q_start, min(t.q_end, q_lens[b])):
                    # the tile reads every position that row i sees, and no more than exist
                    assert kv_lens[b] - q_lens[b] + i < t.kv_len <= group_kv, (case, t)
                    for h in range(t.head_start, t.head_end):
                        seen[(b, i, h)] = seen.get((b, i, h), 0) + 1
        want = {(b, i, h) for b, n in enumerate(q_lens) for i in range(n) for h in range(hk)}
        assert set(seen) == want and set(seen.values()) <= {1}, case
        assert [t.req_start for t in plan] == sorted(t.req_start for t in plan)


# Llama-3.1-8B's attention: 32 query heads, 8 KV heads, head_dim 128, a bf16 KV cache
LLAMA_8B = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, kv_elem_size=2)


@pytest.mark.parametrize("tokens", [8192, 32768])
def test_a_long_prompt_tiles_within_the_budget(tokens):
    plan = ref.attention_plan([tokens], [tokens], **LLAMA_8B)
    group, d = 4, 128
    largest = max(ref.attention_tile_bytes(1, t.q_end - t.q_start, tokens,
                                           t.head_end - t.head_start, group, d, 2) for t in plan)
    assert largest <= ref.TILE_BYTES <= 512 << 20
    untiled = ref.attention_tile_bytes(1, tokens, tokens, 8, group, d, 2)
    assert untiled > 16 * ref.TILE_BYTES          # 16.8 GiB at 8k, 264 GiB at 32k
    assert sum((t.q_end - t.q_start) * (t.head_end - t.head_start) for t in plan) == tokens * 8


def test_extend_attention_allocates_within_the_budget(monkeypatch):
    """Every tensor the op allocates but its output stays within TILE_BYTES, where the untiled
    op (TILE_BYTES large) allocates more; the results agree."""
    d, hq, hk, n = 16, 4, 2, 512
    k_cache, v_cache, kv_indptr, kv_indices, g = _paged([n, 40], hk, d, 3, torch.float32)
    q = torch.randn(n + 8, hq, d, generator=g)
    qo_indptr = _indptr([n, 8])
    args = (q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, d ** -0.5)
    budget = 1 << 20      # ~20 tiles; untiled, the padded mask alone takes 4 MiB
    runs = {}
    for tile_bytes in (budget, 1 << 40):
        monkeypatch.setattr(ref, "TILE_BYTES", tile_bytes)
        with _Allocations(*args[:-1]) as spy:
            out = ref.paged_extend_attention(*args)
        runs[tile_bytes] = (out, spy.largest_besides(out))
    assert runs[budget][1] <= budget < runs[1 << 40][1]
    torch.testing.assert_close(runs[budget][0], runs[1 << 40][0], atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------- row-wise ops


def _rowwise_ops(n, seed):
    """(name, fn) pairs: each runs one row-wise reference on fresh inputs of n rows and returns
    (result tensors, inputs it reads)."""
    g = torch.Generator().manual_seed(seed)
    hidden, hq, hk, d = 96, 4, 2, 16
    x = torch.randn(n, hidden, generator=g).bfloat16()
    w = torch.randn(hidden, generator=g).bfloat16()
    res = torch.randn(n, hidden, generator=g)
    gate_up = torch.randn(n, 2 * hidden, generator=g).bfloat16()
    qk = torch.randn(n, (hq + hk) * d, generator=g).bfloat16()
    positions = torch.randint(0, 4096, (n,), generator=g)
    ang = torch.arange(4096, dtype=torch.float64)[:, None] / (1e4 ** (torch.arange(0, d, 2) / d))
    cos_sin = torch.cat([ang.cos(), ang.sin()], -1).float()

    def norm():
        return (ref.rms_norm(x, w, 1e-5),), (x, w)

    def add_norm():
        xc, rc = x.clone(), res.clone()
        ref.fused_add_rms_norm(xc, rc, w, 1e-5)
        return (xc, rc), (xc, rc, w)

    def rope():
        buf = qk.clone()
        q, k = buf[:, :hq * d].view(n, hq, d), buf[:, hq * d:].view(n, hk, d)
        ref.rotary_embedding(positions, q, k, cos_sin)
        return (buf,), (buf, positions, cos_sin)

    def silu():
        return (ref.silu_and_mul(gate_up),), (gate_up,)

    return [("rms_norm", norm), ("fused_add_rms_norm", add_norm), ("rotary_embedding", rope),
            ("silu_and_mul", silu)]


def test_rowwise_ops_in_slices_are_bit_identical_and_bounded(monkeypatch):
    """Each row-wise op at a small TILE_BYTES equals itself unsliced, bit for bit, and allocates
    nothing larger than the budget besides its inputs and outputs; unsliced, its fp32 copy of
    all the rows is larger."""
    n = 1024
    budget = 32 << 10     # a few rows per slice; the whole fp32 rows take 384 KiB and more

    def largest_intermediate(fn):
        spy = _Allocations()
        with spy:
            outs, inputs = fn()
        own = {t.untyped_storage().data_ptr() for t in outs + inputs}
        return outs, max((size for ptr, size in spy.sizes.items() if ptr not in own), default=0)

    for (name, fn), (_, fn_small) in zip(_rowwise_ops(n, 1), _rowwise_ops(n, 1)):
        monkeypatch.setattr(ref, "TILE_BYTES", 1 << 40)
        whole, largest_whole = largest_intermediate(fn)
        monkeypatch.setattr(ref, "TILE_BYTES", budget)
        assert len(ref._row_tiles(n, 96)) > 8
        sliced, largest_sliced = largest_intermediate(fn_small)
        for a, b in zip(whole, sliced):
            assert torch.equal(a, b), name
        assert largest_sliced <= budget < largest_whole, (name, largest_sliced, largest_whole)


def test_build_kv_indices_in_groups_of_requests(monkeypatch):
    g = torch.Generator().manual_seed(9)
    max_reqs, ctx = 12, 300
    req_to_token = torch.randint(0, 10_000, (max_reqs, ctx), generator=g, dtype=torch.int32)
    rows = torch.tensor([3, 0, 7, 11, 5, 2, 9])
    lens = torch.tensor([1, 300, 0, 17, 250, 64, 5], dtype=torch.int32)
    want = torch.cat([req_to_token[r, :n] for r, n in zip(rows.tolist(), lens.tolist())])
    monkeypatch.setattr(ref, "TILE_BYTES", 32 * 300 * 2)       # two requests per group
    assert len(ref._row_tiles(len(rows), 300)) == 4
    kv_indptr = torch.zeros(len(rows) + 1, dtype=torch.int32)
    kv_indices = torch.full((int(lens.sum()) + 5,), -1, dtype=torch.int32)
    ref.build_kv_indices(req_to_token, rows, lens, kv_indptr, kv_indices)
    assert torch.equal(kv_indices[:len(want)], want)
    assert (kv_indices[len(want):] == -1).all()
    assert kv_indptr.tolist() == [0] + lens.cumsum(0).tolist()


# ----------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def tiny_long_context_model(tmp_path_factory):
    """The tiniest Llama that transformers writes: 1 layer, 1 head of dim 4, hidden 8, with a
    context of 33,000 tokens (random weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=1, num_key_value_heads=1, head_dim=4,
                      max_position_embeddings=33_000, tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("tiny-long")
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return str(path)


def test_a_32k_prompt_completes_on_the_cpu(tiny_long_context_model, default_model_path):
    """32,768 prompt tokens and 2 greedy tokens through the offline Engine on the CPU, as a user
    runs it: prefilled in 512-token chunks (the CPU default), the last ones attending over 32k
    cached tokens."""
    import radixserve

    ids = [random.Random(3).randrange(64) for _ in range(32_768)]
    engine = radixserve.Engine(tiny_long_context_model, tokenizer_path=default_model_path,
                               device="cpu", max_total_tokens=33_000, max_running_requests=1)
    try:
        assert engine.server_args.resolved_chunked_prefill_size() == 512
        out = engine.generate(input_ids=ids, sampling_params={
            "temperature": 0.0, "max_new_tokens": 2, "ignore_eos": True})
    finally:
        engine.shutdown()
    assert out["meta_info"]["prompt_tokens"] == 32_768
    assert len(out["output_ids"]) == 2 and all(0 <= t < 64 for t in out["output_ids"])
