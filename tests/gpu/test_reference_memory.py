"""The torch reference attention on a GPU in bounded memory (issue 33): what a server without
radixserve._C runs. An 8k-token prompt of Llama-3.1-8B's attention shape (32 query heads, 8 KV
heads, head_dim 128, bf16) used to make 8 GiB of scores at once and ran out of memory; its
extend attention, and a decode batch over long contexts, now stay within TILE_BYTES of device
memory beyond their inputs and output (read from the caching allocator's peak)."""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from radixserve.ops import reference as ref  # noqa: E402

HQ, HK, D = 32, 8, 128
# index tables and kept masks (PagedAttention) beside a tile's intermediates
SLACK = ref._MASK_CACHE_BYTES + (8 << 20)


def _pool(tokens: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    k_cache = torch.randn(tokens + 1, HK, D, generator=g, device="cuda").bfloat16()
    v_cache = torch.randn(tokens + 1, HK, D, generator=g, device="cuda").bfloat16()
    kv_indices = (torch.randperm(tokens, generator=g, device="cuda") + 1).to(torch.int32)
    return k_cache, v_cache, kv_indices, g


def _peak_beyond(fn):
    """(result, bytes allocated at the peak of fn() beyond what was allocated before it)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - before


def _direct_rows(q, k, v, rows, positions, sm_scale):
    """q [n, HQ, D] rows `rows` at KV positions `positions` over k, v [len, HK, D]: fp64."""
    out = []
    for r, p in zip(rows, positions):
        kk = k[:p + 1].double().repeat_interleave(HQ // HK, 1)              # [p + 1, HQ, D]
        vv = v[:p + 1].double().repeat_interleave(HQ // HK, 1)
        s = torch.einsum("hd,lhd->hl", q[r].double(), kk) * sm_scale
        out.append(torch.einsum("hl,lhd->hd", s.softmax(-1), vv))
    return torch.stack(out)


def test_an_8k_prompt_extend_stays_within_the_tile_budget():
    n = 8192
    k_cache, v_cache, kv_indices, g = _pool(n, 1)
    q = torch.randn(n, HQ, D, generator=g, device="cuda").bfloat16()
    indptr = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    out, peak = _peak_beyond(lambda: ref.paged_extend_attention(
        q, k_cache, v_cache, indptr, indptr, kv_indices, D ** -0.5))
    print(f"8k extend: peak {peak / 2**20:.0f} MiB beyond the inputs (output "
          f"{out.numel() * 2 / 2**20:.0f} MiB)")
    assert peak <= ref.TILE_BYTES + out.numel() * out.element_size() + SLACK
    rows = [0, 1, 4097, n - 1]
    slots = kv_indices.long()
    want = _direct_rows(q, k_cache[slots], v_cache[slots], rows, rows, D ** -0.5)
    torch.testing.assert_close(out[rows].double(), want, atol=2e-2, rtol=2e-2)   # bf16 out


def test_a_decode_batch_over_long_contexts_stays_within_the_tile_budget():
    lens = [8192] * 48 + [1, 700, 30000]
    k_cache, v_cache, kv_indices, g = _pool(sum(lens), 2)
    q = torch.randn(len(lens), HQ, D, generator=g, device="cuda").bfloat16()
    indptr = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    out, peak = _peak_beyond(lambda: ref.paged_decode_attention(
        q, k_cache, v_cache, indptr, kv_indices, D ** -0.5))
    print(f"decode of {len(lens)} requests, {sum(lens)} KV tokens: peak "
          f"{peak / 2**20:.0f} MiB beyond the inputs")
    assert peak <= ref.TILE_BYTES + SLACK
    for b in (0, len(lens) - 3, len(lens) - 1):
        slots = kv_indices[indptr[b]:indptr[b + 1]].long()
        want = _direct_rows(q[b:b + 1], k_cache[slots], v_cache[slots], [0], [lens[b] - 1],
                            D ** -0.5)
        torch.testing.assert_close(out[b:b + 1].double(), want, atol=2e-2, rtol=2e-2)
