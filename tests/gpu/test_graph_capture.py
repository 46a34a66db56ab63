"""CUDA-graph safety of the op seam (radixserve.ops), as a decode step would use it.

Each test captures the op once, into a torch.cuda.CUDAGraph, on static buffers sized for the maxima
(max batch, max KV length), with the smallest contents; then, several times, writes other
contents in place (new requests, lengths, slots, rows, logits, masks, sampling parameters), replays,
and compares that replay's outputs with ops/reference.py on the same buffers. A captured op that
read a shape, a length or a pointer at capture time, or that synchronised with the host, fails
here: torch raises on its own synchronising calls (sync debug mode "error" around every call of
the op), and CUDA refuses a synchronising call while the stream is capturing.

Acceptance: paged_decode_attention "safe under CUDA graph capture (no host sync, launch shape fixed
by maxima)"; bitmask_sample "no host sync"; store_kv and build_kv_indices take fixed shapes
(num_tokens = max batch, kv_indices sized for max batch x max length) and are captured together
with decode attention, as one decode step.
"""
from __future__ import annotations

import contextlib
import math

import pytest
import torch

from _gpu import requires_kernels
from radixserve import ops
from radixserve.ops import reference as ref

pytestmark = [pytest.mark.gpu, requires_kernels]

DEVICE = "cuda"
# relative Frobenius error, max-abs tolerance (scaled by the reference's largest value): the
# attention tolerances of test_attention.py
ATTN_TOL = {torch.bfloat16: (1e-2, 3e-2), torch.float16: (2e-3, 5e-3)}


@contextlib.contextmanager
def _forbid_host_sync():
    """torch raises on any synchronising call of its own (.item(), .tolist(), nonzero, D2H)."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def _capture(fn):
    """Warm fn up on a side stream (torch.cuda.graphs' recipe), capture it; -> (graph, fn's outputs)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), _forbid_host_sync():
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        with _forbid_host_sync():
            out = fn()
    return graph, out


def _check_attention(out: torch.Tensor, expect: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert out.shape == expect.shape and out.dtype == dtype, what
    out = out.float()
    assert torch.isfinite(out).all(), f"{what}: non-finite output (unwritten by the replay?)"
    rel_tol, abs_tol = ATTN_TOL[dtype]
    rel = ((out - expect).norm() / expect.norm()).item()
    max_abs = (out - expect).abs().max().item()
    scale = max(1.0, expect.abs().max().item())
    assert rel < rel_tol, f"{what}: relative error {rel:.3e}"
    assert max_abs < abs_tol * scale, f"{what}: max abs error {max_abs:.3e}"


def _randn(shape, dtype, gen) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype).to(DEVICE)


# ----------------------------------------------------------------------------- decode attention

DECODE_CASES = [
    # dtype, head_dim, num_q_heads, num_kv_heads, max_batch, max_kv_len
    (torch.bfloat16, 128, 32, 8, 16, 1100),  # GQA 4; the kernel splits the sequence
    (torch.float16, 64, 8, 8, 16, 200),      # GQA 1; one split
    (torch.bfloat16, 64, 9, 3, 7, 700),      # the default model's heads (GQA 3)
]


def _decode_layouts(max_bs: int, max_kv_len: int, gen: torch.Generator):
    """(name, KV lengths of the real requests) per replay; the rows after them are padding."""
    random_lens = torch.randint(1, max_kv_len + 1, (max_bs,), generator=gen).tolist()
    return [
        ("max", [max_kv_len] * max_bs),
        ("random", random_lens),
        ("partial", [1, 17, max_kv_len, 2, max_kv_len // 3]),
        ("single", [1]),
        ("random-again", list(reversed(random_lens))),
    ]


def _fill_decode(q, kv_indptr, kv_indices, lens, num_slots, gen) -> None:
    """Write one batch into the static buffers, in place.

    Real request b has lens[b] KV tokens on distinct slots >= 1; a padding row (b >= len(lens))
    has one token, the padding slot 0 (every request has at least one KV token). kv_indices past
    the batch's tokens holds valid slots that a correct kernel never reads.
    """
    max_bs = q.shape[0]
    full = list(lens) + [1] * (max_bs - len(lens))
    indptr = torch.zeros(max_bs + 1, dtype=torch.int64)
    indptr[1:] = torch.tensor(full).cumsum(0)
    num_real = sum(lens)
    indices = torch.randint(1, num_slots, (kv_indices.numel(),), generator=gen)
    indices[:num_real] = torch.randperm(num_slots - 1, generator=gen)[:num_real] + 1
    indices[num_real:int(indptr[-1])] = 0
    kv_indptr.copy_(indptr.to(torch.int32))
    kv_indices.copy_(indices.to(torch.int32))
    q.copy_(torch.randn(q.shape, generator=gen).to(q.dtype))


@pytest.mark.parametrize("dtype,head_dim,hq,hkv,max_bs,max_kv_len", DECODE_CASES,
                         ids=lambda v: str(v).replace("torch.", ""))
def test_paged_decode_attention_replays(dtype, head_dim, hq, hkv, max_bs, max_kv_len):
    gen = torch.Generator().manual_seed(max_bs * 1000 + head_dim + hq)
    num_slots = max_bs * max_kv_len + 97  # slot 0 is the padding slot
    k_cache = _randn((num_slots, hkv, head_dim), dtype, gen)
    v_cache = _randn((num_slots, hkv, head_dim), dtype, gen)
    # static inputs, sized for the maxima
    q = torch.empty(max_bs, hq, head_dim, dtype=dtype, device=DEVICE)           # [max_bs, hq, d]
    kv_indptr = torch.empty(max_bs + 1, dtype=torch.int32, device=DEVICE)       # [max_bs + 1]
    kv_indices = torch.empty(max_bs * max_kv_len, dtype=torch.int32, device=DEVICE)  # [max nnz]
    scale = 1.0 / math.sqrt(head_dim)

    def decode():
        return ops.paged_decode_attention(q, k_cache, v_cache, kv_indptr, kv_indices, scale)

    _fill_decode(q, kv_indptr, kv_indices, [1], num_slots, gen)  # captured on the smallest batch
    graph, out = _capture(decode)

    for name, lens in _decode_layouts(max_bs, max_kv_len, gen):
        _fill_decode(q, kv_indptr, kv_indices, lens, num_slots, gen)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        expect = ref.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), kv_indptr,
                                            kv_indices, scale)
        _check_attention(out, expect, dtype, name)
        # same buffers, same shapes, so the same launch: a replay must equal a fresh launch exactly
        assert torch.equal(out, decode()), f"{name}: replay differs from an eager launch"


# ----------------------------------------------------------------------------- bitmask_sample


def _pack_bits(allowed: torch.Tensor) -> torch.Tensor:
    """[batch, vocab] bool -> [batch, ceil(vocab / 32)] int32, bit t % 32 of word t // 32."""
    batch, vocab = allowed.shape
    words = (vocab + 31) // 32
    padded = torch.zeros(batch, words * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    bits = (padded.view(batch, words, 32) << torch.arange(32)).sum(-1)
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)


def _greedy_logits(batch: int, vocab: int, masked: bool, gen: torch.Generator):
    """Logits with one clear winner per row among the allowed tokens (no ties, in bf16 too).

    Masked: row 0 allows a single token, row 1 every token, the others a random 20-90 %; a
    disallowed token of each row gets the row's largest logit, so ignoring the mask changes the
    answer. Returns (logits [batch, vocab] f32, allowed [batch, vocab] bool, winner [batch]).
    """
    x = torch.randn(batch, vocab, generator=gen).clamp(-4.0, 4.0)
    if masked:
        keep = 0.2 + 0.7 * torch.rand(batch, 1, generator=gen)
        allowed = torch.rand(batch, vocab, generator=gen) < keep
        allowed[0] = False
        allowed[0, torch.randint(0, vocab, (1,), generator=gen)] = True
        allowed[1] = True
    else:
        allowed = torch.ones(batch, vocab, dtype=torch.bool)
    winner = torch.multinomial(allowed.float(), 1, generator=gen)[:, 0]
    rows = torch.arange(batch)
    x[rows, winner] = 6.0
    if masked:
        has_decoy = (~allowed).any(-1)
        decoy = torch.multinomial((~allowed).float() + (~has_decoy)[:, None].float(), 1,
                                  generator=gen)[:, 0]
        x[rows[has_decoy], decoy[has_decoy]] = 7.0
    return x, allowed, winner


@pytest.mark.parametrize("dtype,vocab", [(torch.float32, 32000), (torch.bfloat16, 50257)],
                         ids=["f32-32000", "bf16-50257"])
@pytest.mark.parametrize("masked", [True, False], ids=["bitmask", "no-bitmask"])
def test_bitmask_sample_replays(dtype, vocab, masked):
    max_bs = 12
    gen = torch.Generator().manual_seed(vocab + masked)
    # static inputs, sized for the maximum batch
    logits = torch.empty(max_bs, vocab, dtype=dtype, device=DEVICE)             # [max_bs, vocab]
    bitmask = (torch.empty(max_bs, (vocab + 31) // 32, dtype=torch.int32, device=DEVICE)
               if masked else None)                                             # [max_bs, words]
    temperature = torch.zeros(max_bs, dtype=torch.float32, device=DEVICE)       # [max_bs] each
    top_k = torch.zeros(max_bs, dtype=torch.int32, device=DEVICE)
    top_p = torch.ones(max_bs, dtype=torch.float32, device=DEVICE)
    min_p = torch.zeros(max_bs, dtype=torch.float32, device=DEVICE)
    seeds = torch.zeros(max_bs, dtype=torch.int64, device=DEVICE)
    offsets = torch.zeros(max_bs, dtype=torch.int64, device=DEVICE)
    params = (temperature, top_k, top_p, min_p, seeds, offsets)

    def fill(sampled_rows: int):
        """New logits and mask; rows >= max_bs - sampled_rows sample, the others are greedy."""
        x, allowed, winner = _greedy_logits(max_bs, vocab, masked, gen)
        logits.copy_(x.to(dtype))
        if masked:
            bitmask.copy_(_pack_bits(allowed))
        greedy = torch.arange(max_bs) < max_bs - sampled_rows
        temperature.copy_(torch.where(greedy, 0.0, 0.5 + torch.rand(max_bs, generator=gen)))
        top_k.copy_(torch.where(greedy, 0, torch.randint(-1, 100, (max_bs,), generator=gen)).int())
        top_p.copy_(torch.where(greedy, 1.0, 0.5 + 0.5 * torch.rand(max_bs, generator=gen)))
        min_p.copy_(torch.where(greedy, 0.0, 0.1 * torch.rand(max_bs, generator=gen)))
        seeds.copy_(torch.randint(0, 2**62, (max_bs,), generator=gen))
        offsets.copy_(torch.randint(0, 1000, (max_bs,), generator=gen))
        return allowed.to(DEVICE), winner.to(DEVICE), greedy.to(DEVICE)

    def sample():
        return ops.bitmask_sample(logits, bitmask, *params)

    fill(sampled_rows=0)
    graph, out = _capture(sample)

    for replay, sampled_rows in enumerate([0, 0, max_bs // 2, 0, max_bs // 3]):
        allowed, winner, greedy = fill(sampled_rows)
        out.ids.fill_(-1)
        out.logprobs.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        what = f"replay {replay} ({sampled_rows} sampled rows)"
        want_ids, _ = ref.bitmask_sample(logits, bitmask, *params)
        assert out.ids.dtype == torch.int64 and out.logprobs.dtype == torch.float32
        assert torch.equal(out.ids[greedy], want_ids[greedy]), f"{what}: greedy ids != reference"
        assert torch.equal(out.ids[greedy], winner[greedy]), f"{what}: greedy ids != the winners"
        assert allowed.gather(1, out.ids[:, None]).all(), f"{what}: a masked token was returned"
        raw = torch.log_softmax(logits.float(), -1)
        torch.testing.assert_close(out.logprobs, raw.gather(1, out.ids[:, None])[:, 0],
                                   atol=1e-4, rtol=1e-5, msg=lambda m: f"{what}: logprobs: {m}")
        if sampled_rows:
            # a draw is a pure function of (seed, offset, probs): the replay read this batch's
            # parameters if it equals a fresh launch; and the id lies in the kept set (up to ties)
            eager = sample()
            assert torch.equal(out.ids, eager.ids), f"{what}: replay differs from an eager launch"
            s = ~greedy
            x = logits.float() if bitmask is None else ref.apply_bitmask(logits.float(), bitmask)
            probs = ref.filtered_probs(logits[s], None if bitmask is None else bitmask[s],
                                       temperature[s], top_k[s], top_p[s], min_p[s])
            thr = torch.where(probs > 0, x[s], torch.full_like(x[s], float("inf"))).min(-1).values
            assert (x[s].gather(1, out.ids[s][:, None])[:, 0] >= thr).all(), \
                f"{what}: a sampled id outside the kept set"


# ----------------------------------------------------------------------------- one decode step


def test_decode_step_replays():
    """store_kv (each request's new token) -> build_kv_indices -> paged_decode_attention, captured
    as one graph, replayed with other requests, rows, lengths, slots and K/V."""
    dtype, head_dim, hq, hkv = torch.bfloat16, 64, 9, 3
    max_bs, max_context_len = 8, 300
    max_reqs = 3 * max_bs        # rows 0..max_bs-1 of req_to_token are padding rows
    num_slots = max_bs * max_context_len + max_bs + 101
    gen = torch.Generator().manual_seed(77)
    scale = 1.0 / math.sqrt(head_dim)
    k_cache = _randn((num_slots, hkv, head_dim), dtype, gen)                    # [num_slots, hkv, d]
    v_cache = _randn((num_slots, hkv, head_dim), dtype, gen)
    # static inputs and outputs, sized for the maxima
    req_to_token = torch.empty(max_reqs, max_context_len, dtype=torch.int32, device=DEVICE)
    req_pool_indices = torch.empty(max_bs, dtype=torch.int64, device=DEVICE)    # [max_bs]
    seq_lens = torch.empty(max_bs, dtype=torch.int32, device=DEVICE)            # [max_bs]
    slot_indices = torch.empty(max_bs, dtype=torch.int64, device=DEVICE)        # [max_bs]
    k_new = torch.empty(max_bs, hkv, head_dim, dtype=dtype, device=DEVICE)      # [max_bs, hkv, d]
    v_new = torch.empty(max_bs, hkv, head_dim, dtype=dtype, device=DEVICE)
    q = torch.empty(max_bs, hq, head_dim, dtype=dtype, device=DEVICE)           # [max_bs, hq, d]
    kv_indptr = torch.empty(max_bs + 1, dtype=torch.int32, device=DEVICE)       # [max_bs + 1]
    kv_indices = torch.empty(max_bs * max_context_len, dtype=torch.int32, device=DEVICE)

    def fill(lens):
        """Real requests get distinct rows >= max_bs and distinct slots; padding row p has one
        token on its own scratch slot (so store_kv sees no duplicate slot). A request's new token
        is its last position: its K/V is stored there, then attended with the rest."""
        real = len(lens)
        table = torch.randint(1, num_slots, (max_reqs, max_context_len), generator=gen)  # stale rows
        scratch = num_slots - 1 - torch.arange(max_bs)
        table[:max_bs] = scratch[:, None]
        rows = (max_bs + torch.randperm(max_reqs - max_bs, generator=gen)[:real]).tolist()
        slots = torch.randperm(num_slots - max_bs - 1, generator=gen)[:sum(lens)] + 1
        start = 0
        for row, n in zip(rows, lens):
            table[row, :n] = slots[start:start + n]
            start += n
        rpi = torch.tensor(rows + list(range(max_bs - real)), dtype=torch.int64)
        full = torch.tensor(list(lens) + [1] * (max_bs - real), dtype=torch.int64)
        req_to_token.copy_(table.to(torch.int32))
        req_pool_indices.copy_(rpi)
        seq_lens.copy_(full.to(torch.int32))
        slot_indices.copy_(table[rpi, full - 1])
        k_new.copy_(torch.randn(k_new.shape, generator=gen).to(dtype))
        v_new.copy_(torch.randn(v_new.shape, generator=gen).to(dtype))
        q.copy_(torch.randn(q.shape, generator=gen).to(dtype))
        return int(full.sum())

    def step():
        ops.store_kv(k_cache, v_cache, k_new, v_new, slot_indices)
        ops.build_kv_indices(req_to_token, req_pool_indices, seq_lens, kv_indptr, kv_indices)
        return ops.paged_decode_attention(q, k_cache, v_cache, kv_indptr, kv_indices, scale)

    fill([1])
    graph, out = _capture(step)

    random_lens = torch.randint(1, max_context_len + 1, (max_bs,), generator=gen).tolist()
    layouts = [("max", [max_context_len] * max_bs), ("random", random_lens),
               ("partial", [1, max_context_len, 17]), ("single", [1]),
               ("random-again", list(reversed(random_lens)))]
    for name, lens in layouts:
        total = fill(lens)
        want_k, want_v = k_cache.clone(), v_cache.clone()
        ref.store_kv(want_k, want_v, k_new, v_new, slot_indices)
        want_indptr = torch.empty_like(kv_indptr)
        want_indices = torch.full_like(kv_indices, -1)
        ref.build_kv_indices(req_to_token, req_pool_indices, seq_lens, want_indptr, want_indices)
        kv_indptr.fill_(-1)
        kv_indices.fill_(-1)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v), f"{name}: store_kv"
        assert torch.equal(kv_indptr, want_indptr), f"{name}: kv_indptr"
        assert torch.equal(kv_indices[:total], want_indices[:total]), f"{name}: kv_indices"
        assert (kv_indices[total:] == -1).all(), f"{name}: kv_indices written past sum(seq_lens)"
        expect = ref.paged_decode_attention(q.float(), want_k.float(), want_v.float(), want_indptr,
                                            want_indices, scale)
        _check_attention(out, expect, dtype, name)
