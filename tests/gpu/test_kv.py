"""store_kv and build_kv_indices kernels against the torch reference (radixserve.ops.reference)."""
import pytest
import torch

from _gpu import requires_kernels
from radixserve.ops import reference as ref

pytestmark = [pytest.mark.gpu, requires_kernels]

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _ops():
    return torch.ops.radixserve


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("num_tokens", [1, 19, 99])
@pytest.mark.parametrize("heads,head_dim", [(8, 128), (2, 64), (1, 64), (3, 5)])
def test_store_kv_matches_reference(dtype, idx_dtype, num_tokens, heads, head_dim):
    g = torch.Generator(device="cuda").manual_seed(num_tokens * 31 + heads)
    num_slots = 1000
    k_cache = torch.randn(num_slots, heads, head_dim, device="cuda", generator=g).to(dtype)
    v_cache = torch.randn(num_slots, heads, head_dim, device="cuda", generator=g).to(dtype)
    k = torch.randn(num_tokens, heads, head_dim, device="cuda", generator=g).to(dtype)
    v = torch.randn(num_tokens, heads, head_dim, device="cuda", generator=g).to(dtype)
    slots = torch.randperm(num_slots, device="cuda", generator=g)[:num_tokens].to(idx_dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    ref.store_kv(want_k, want_v, k, v, slots)
    _ops().store_kv(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, want_k)
    assert torch.equal(v_cache, want_v)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_store_kv_strided_views_of_fused_qkv(dtype):
    # k and v as views into a fused [tokens, (hq + 2 hk) * d] buffer: token stride != row size
    tokens, hq, hk, d = 17, 8, 2, 128
    qkv = torch.randn(tokens, (hq + 2 * hk) * d, device="cuda").to(dtype)
    k = qkv[:, hq * d:(hq + hk) * d].view(tokens, hk, d)
    v = qkv[:, (hq + hk) * d:].view(tokens, hk, d)
    assert not k.is_contiguous()
    k_cache = torch.randn(300, hk, d, device="cuda").to(dtype)
    v_cache = torch.randn(300, hk, d, device="cuda").to(dtype)
    slots = torch.randperm(300, device="cuda")[:tokens].to(torch.int32)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    ref.store_kv(want_k, want_v, k, v, slots)
    _ops().store_kv(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_store_kv_rejects_bad_inputs():
    k_cache = torch.randn(10, 2, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(3, 2, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="int32 or int64"):
        _ops().store_kv(k_cache, k_cache.clone(), k, k, torch.zeros(3, device="cuda", dtype=torch.float32))
    with pytest.raises(RuntimeError, match="dtype"):
        _ops().store_kv(k_cache, k_cache.clone(), k.float(), k.float(),
                        torch.arange(3, device="cuda", dtype=torch.int32))
    with pytest.raises(RuntimeError):
        _ops().store_kv(k_cache, k_cache.clone(), k[:, :1], k[:, :1], torch.arange(3, device="cuda"))


def _kv_case(batch, lens, idx_dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    max_len = max(lens)
    max_reqs = batch + 5
    req_to_token = torch.randint(1, 1 << 20, (max_reqs, max_len + 3), device="cuda",
                                 dtype=torch.int32, generator=g)
    req_pool_indices = torch.randperm(max_reqs, device="cuda", generator=g)[:batch].to(idx_dtype)
    seq_lens = torch.tensor(lens, device="cuda", dtype=idx_dtype)
    return req_to_token, req_pool_indices, seq_lens


@pytest.mark.parametrize("batch", [1, 19, 99, 1500])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_build_kv_indices_matches_reference(batch, idx_dtype):
    g = torch.Generator().manual_seed(batch)
    choices = torch.tensor([1, 17, 989, 4097] if batch < 1000 else [1, 17, 33])
    lens = choices[torch.randint(0, len(choices), (batch,), generator=g)].tolist()
    r2t, rpi, seq_lens = _kv_case(batch, lens, idx_dtype, batch)
    total = sum(lens)
    kv_indptr = torch.full((batch + 1,), -7, device="cuda", dtype=torch.int32)  # poisoned
    kv_indices = torch.full((total + 11,), -7, device="cuda", dtype=torch.int32)
    want_indptr = torch.empty_like(kv_indptr)
    want_indices = torch.full_like(kv_indices, -7)
    ref.build_kv_indices(r2t, rpi, seq_lens, want_indptr, want_indices)
    _ops().build_kv_indices(r2t, rpi, seq_lens, kv_indptr, kv_indices)
    assert torch.equal(kv_indptr, want_indptr)
    assert torch.equal(kv_indices[:total], want_indices[:total])
    assert (kv_indices[total:] == -7).all(), "wrote past sum(seq_lens)"


def test_build_kv_indices_is_graph_capturable():
    batch, lens = 19, [1, 17, 989, 4097] * 4 + [5, 6, 7]
    r2t, rpi, seq_lens = _kv_case(batch, lens, torch.int32, 3)
    kv_indptr = torch.zeros(batch + 1, device="cuda", dtype=torch.int32)
    kv_indices = torch.zeros(sum(lens) + 100, device="cuda", dtype=torch.int32)
    _ops().build_kv_indices(r2t, rpi, seq_lens, kv_indptr, kv_indices)  # warm up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _ops().build_kv_indices(r2t, rpi, seq_lens, kv_indptr, kv_indices)
    # new lengths (same total bound) replayed without re-capture
    seq_lens.copy_(torch.tensor(list(reversed(lens)), device="cuda", dtype=torch.int32))
    kv_indptr.fill_(-1)
    kv_indices.fill_(-1)
    graph.replay()
    want_indptr = torch.empty_like(kv_indptr)
    want_indices = torch.full_like(kv_indices, -1)
    ref.build_kv_indices(r2t, rpi, seq_lens, want_indptr, want_indices)
    torch.cuda.synchronize()
    assert torch.equal(kv_indptr, want_indptr)
    assert torch.equal(kv_indices, want_indices)
