"""bitmask_sample kernel: greedy rows, logprobs, masks, determinism, and the sampled distribution
(many draws of one row, distinct offsets) against reference.filtered_probs."""
import math

import pytest
import torch

from _gpu import requires_kernels
from radixserve.ops import reference as ref

pytestmark = [pytest.mark.gpu, requires_kernels]


def _sample(logits, bitmask, temperature, top_k, top_p, min_p, seeds, offsets):
    return torch.ops.radixserve.bitmask_sample(logits, bitmask, temperature, top_k, top_p, min_p,
                                               seeds, offsets)


def _params(batch, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1234):
    dev = "cuda"
    return dict(
        temperature=torch.full((batch,), temperature, device=dev, dtype=torch.float32),
        top_k=torch.full((batch,), top_k, device=dev, dtype=torch.int32),
        top_p=torch.full((batch,), top_p, device=dev, dtype=torch.float32),
        min_p=torch.full((batch,), min_p, device=dev, dtype=torch.float32),
        seeds=torch.full((batch,), seed, device=dev, dtype=torch.int64),
        offsets=torch.arange(batch, device=dev, dtype=torch.int64),
    )


def _random_mask(batch, vocab, keep=0.6, seed=0):
    g = torch.Generator().manual_seed(seed)
    allowed = torch.rand(batch, vocab, generator=g) < keep
    words = (vocab + 31) // 32
    padded = torch.zeros(batch, words * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    bits = (padded.view(batch, words, 32) << torch.arange(32)).sum(-1)
    bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    return bits.cuda(), allowed.cuda()


def _distinct_logits(vocab, dtype, seed, num_top=256):
    """Low bulk plus num_top distinct, exactly representable top values: no ties at any
    threshold, so the kernel's tie-breaking (by token id) cannot differ from torch.sort's."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(vocab, generator=g) * 0.5 - 6.0
    pos = torch.randperm(vocab, generator=g)[:num_top]
    x[pos] = torch.arange(num_top, dtype=torch.float32) / 32.0  # 8 significant bits: exact in bf16
    return x.to(dtype).cuda()


def _tv_check(ids, probs, label):
    n = ids.numel()
    freq = torch.bincount(ids, minlength=probs.numel()).double() / n
    p = probs.double().cpu()
    freq = freq.cpu()
    outside = (freq > 0) & (p == 0)
    assert not outside.any(), f"{label}: sampled tokens outside the kept set: {outside.nonzero()[:5].flatten().tolist()}"
    tv = 0.5 * (freq - p).abs().sum().item()
    expected = 0.5 * torch.sqrt(2 * p * (1 - p) / (math.pi * n)).sum().item()
    assert tv <= 1.5 * expected + 0.005, f"{label}: TV {tv:.4f} vs expected {expected:.4f}"
    return tv


def _one_row_mask(masked, vocab, draws, seed):
    """(bits [1, words] or None, allowed [1, vocab] bool, bits expanded to `draws` rows or None)."""
    if not masked:
        return None, torch.ones(1, vocab, dtype=torch.bool, device="cuda"), None
    bits, allowed = _random_mask(1, vocab, keep=0.6, seed=seed)
    return bits, allowed, bits.expand(draws, -1)


def _draw_one_row(row, bits, allowed, bits_e, prm, check_logprobs=True):
    """Samples `row` once per entry of prm (row stride 0, distinct offsets), asserts that no
    masked token comes back and (check_logprobs) that the logprobs are the raw log-softmax;
    returns (ids, logprobs, the filtered distribution the draws should follow)."""
    draws, vocab = prm["seeds"].numel(), row.numel()
    ids, logprobs = _sample(row[None, :].expand(draws, vocab), bits_e, **prm)
    assert allowed[0, ids].all(), "a masked token was sampled"
    if check_logprobs:
        want_lp = torch.log_softmax(row.float(), -1)[ids]
        torch.testing.assert_close(logprobs, want_lp, atol=1e-4, rtol=1e-5)
    probs = ref.filtered_probs(row[None], bits, prm["temperature"][:1], prm["top_k"][:1],
                               prm["top_p"][:1], prm["min_p"][:1])[0]
    return ids, logprobs, probs


CASES = [
    # name, dtype, vocab, temperature, top_k, top_p, min_p
    ("topk50_topp0.9", torch.float32, 32000, 1.0, 50, 0.9, 0.0),
    ("topk20_bf16_oddvocab", torch.bfloat16, 50257, 0.8, 20, 1.0, 0.0),
    ("topk1000_minp", torch.float32, 4097, 1.3, 1000, 1.0, 0.01),
    ("topk300_bf16_topp", torch.bfloat16, 128256, 0.9, 300, 0.95, 0.0),
    # top_p / min_p without top_k: the buffer path with k = 256 holds these rows' kept sets
    ("topp0.8_spec", torch.float32, 8192, 0.7, 0, 0.8, 0.0),
    ("topp0.9_bf16_spec", torch.bfloat16, 989, 1.0, 0, 0.9, 0.0),
    ("minp0.05_spec", torch.float32, 17, 1.5, 0, 1.0, 0.05),
    # plain sampling: one pass, the draw placed in one thread's elements (thread_order_draw); past 32
    # tiles (262,144 tokens) its warp walks the tiles 32 at a time
    ("plain_stream", torch.float32, 4097, 1.0, 0, 1.0, 0.0),
    ("plain_t0.7_bf16", torch.bfloat16, 128256, 0.7, 0, 1.0, 0.0),
    ("plain_wide_vocab", torch.float32, 300007, 1.2, 0, 1.0, 0.0),
    ("topk2000_topp_stream", torch.float32, 8191, 2.0, 2000, 0.95, 0.0),
]


@pytest.mark.parametrize("name,dtype,vocab,temperature,top_k,top_p,min_p", CASES)
@pytest.mark.parametrize("masked", [False, True])
def test_distribution_matches_filtered_probs(name, dtype, vocab, temperature, top_k, top_p, min_p, masked):
    draws = 1 << 16
    row = _distinct_logits(vocab, dtype, seed=vocab + top_k, num_top=min(256, vocab))
    bits, allowed, bits_e = _one_row_mask(masked, vocab, draws, seed=vocab)
    logits = row[None, :].expand(draws, vocab)  # row stride 0: one row, 2^16 draws
    prm = _params(draws, temperature, top_k, top_p, min_p)
    ids, logprobs, probs = _draw_one_row(row, bits, allowed, bits_e, prm)
    assert ids.dtype == torch.int64 and logprobs.dtype == torch.float32
    _tv_check(ids, probs, name)
    ids2, _ = _sample(logits, bits_e, **prm)
    assert torch.equal(ids, ids2), "same (seed, offset) must give the same draw"
    prm["seeds"] += 1
    ids3, _ = _sample(logits, bits_e, **prm)
    assert not torch.equal(ids, ids3) or probs.max() > 0.999, "a new seed should change the draws"


def _flat_logits(vocab, num_high, seed):
    """num_high distinct values spread over [5, 5 + num_high / 1024) and a bulk far below:
    the top_p / min_p kept set is a large share of the num_high tokens."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(vocab, generator=g) * 0.5 - 20.0
    pos = torch.randperm(vocab, generator=g)[:num_high]
    x[pos] = 5.0 + torch.randperm(num_high, generator=g).float() / 1024.0
    return x.cuda()


@pytest.mark.parametrize("num_high,top_p,min_p", [
    (200, 0.6, 0.0),     # kept ~120 (masked: ~72) of the kSpecK = 128 buffered: one pass
    (200, 0.9, 0.0),     # kept ~180 (masked: ~108): past the buffer unmasked, inside it masked
    (300, 0.8, 0.0),     # kept ~240: the buffer does not cover it
    (300, 0.9, 0.0),     # kept ~270
    (20000, 0.9, 0.0),   # top_p keeps the ~2360 tokens within ln 10 of the max
    (20000, 1.0, 0.9),   # min_p keeps the ~108 within -ln 0.9 of the max: one pass (kSpecKMinP)
    (20000, 1.0, 0.5),   # min_p keeps the ~710 within ln 2: the streaming path
    (20000, 0.9, 0.5),   # top_p and min_p: the 128-token buffer, then the two-pass draw
])
@pytest.mark.parametrize("masked", [False, True])
def test_top_p_min_p_rows_whose_kept_set_the_buffer_may_not_hold(num_high, top_p, min_p, masked):
    """top_p / min_p rows without top_k try a candidate buffer first (sampling.cuh: 128 tokens
    with top_p, 256 for min_p alone); when the kept set is larger, the two-pass draw or the
    streaming threshold search must take over. Either way: the filtered distribution, no
    masked token, raw logprobs."""
    draws, vocab = 1 << 16, 32000
    row = _flat_logits(vocab, num_high, seed=num_high + int(top_p * 100))
    bits, allowed, bits_e = _one_row_mask(masked, vocab, draws, seed=3)
    ids, _, probs = _draw_one_row(row, bits, allowed, bits_e, _params(draws, 1.0, 0, top_p, min_p))
    kept = int((probs > 0).sum())
    assert kept > 30, f"the case should keep many tokens, kept {kept}"
    _tv_check(ids, probs, f"num_high {num_high} top_p {top_p} min_p {min_p}: {kept} kept")


def _normal_logits(vocab, std, seed, first_tile_shift=0.0, spike=0.0):
    """Random normal rows (the flat rows of bench/kernels.py at std 3); first_tile_shift moves
    the first 8192 tokens (the two-pass top-p anchor's tile) down; spike > 0 puts token 5 that
    far above the row's max (the anchor well above the bulk)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(vocab, generator=g) * std
    x[:8192] -= first_tile_shift
    if spike:
        x[5] = x.max() + spike
    return x.cuda()


@pytest.mark.parametrize("vocab,std,temperature,top_p,min_p,shift,spike", [
    (128256, 3.0, 1.0, 0.9, 0.0, 0.0, 0.0),      # the benchmark's flat rows: ~5400 tokens kept
    (128256, 3.0, 1.5, 0.5, 0.0, 0.0, 0.0),      # temperature: ~2950 kept
    (128256, 3.0, 1.0, 0.9, 0.001, 0.0, 0.0),    # min_p cuts above the top-p cut: ~1200 kept
    (128256, 3.0, 1.0, 0.9, 0.0001, 0.0, 0.0),   # min_p under it
    (128256, 1.0, 1.0, 0.5, 0.0, 0.0, 0.0),      # dense bins at the cut: ~20000 kept
    (50257, 2.0, 1.3, 0.8, 0.0, 0.0, 0.0),       # odd vocab (scalar loads): ~12000 kept
    (128256, 3.0, 1.0, 0.9, 0.0, 0.0, 2.0),      # a spike in the first tile over a flat row
    (128256, 3.0, 1.0, 0.9999, 0.0, 0.0, 0.0),   # the cut under the bins' span: the streaming search
    (128256, 0.05, 1.0, 0.9, 0.0, 0.0, 0.0),     # nearly uniform: an overfull window, the search
    (128256, 3.0, 1.0, 0.9, 0.0, 12.0, 0.0),     # the anchor far under the max: the cut above the bins
])
@pytest.mark.parametrize("masked", [False, True])
def test_top_p_without_top_k_on_flat_rows(vocab, std, temperature, top_p, min_p, shift, spike, masked):
    """Flat rows whose nucleus the 128-token buffer misses take the two-pass draw (pass-1 bins,
    the cut resolved in a window of bins on pass 2), or, where the bins cannot place the cut
    (overfull window, cut in a catch-all bin), the streaming search: the filtered distribution
    either way, and reproducible."""
    draws = 1 << 16
    row = _normal_logits(vocab, std, seed=vocab + int(std * 10) + int(shift), first_tile_shift=shift,
                         spike=spike)
    bits, allowed, bits_e = _one_row_mask(masked, vocab, draws, seed=5)
    prm = _params(draws, temperature, 0, top_p, min_p)
    ids, _, probs = _draw_one_row(row, bits, allowed, bits_e, prm)
    kept = int((probs > 0).sum())
    assert kept > 256, f"the case should keep more than the buffer holds, kept {kept}"
    _tv_check(ids, probs, f"std {std} t {temperature} top_p {top_p} min_p {min_p}: {kept} kept")
    ids2, _ = _sample(row[None, :].expand(draws, vocab), bits_e, **prm)
    assert torch.equal(ids, ids2), "same (seed, offset) must give the same draw"


@pytest.mark.parametrize("top_k", [300, 700, 1000])
@pytest.mark.parametrize("masked", [False, True])
def test_large_top_k_over_many_tiles(top_k, masked):
    """top_k above the free-running limit (and above 512, where the first tile cannot set the
    threshold) over 16 tiles: 20000 distinct values 1/1024 apart, so the k kept tokens are
    nearly equally likely and a wrong token at the boundary would be drawn many times."""
    draws, vocab = 1 << 16, 128256
    row = _flat_logits(vocab, 20000, seed=top_k)
    bits, allowed, bits_e = _one_row_mask(masked, vocab, draws, seed=top_k)
    ids, _, probs = _draw_one_row(row, bits, allowed, bits_e, _params(draws, 1.0, top_k, 1.0, 0.0),
                                  check_logprobs=False)
    assert int((probs > 0).sum()) == top_k
    _tv_check(ids, probs, f"top_k {top_k}")


@pytest.mark.parametrize("top_k", [1, 50, 64, 256, 300, 1000])
@pytest.mark.parametrize("masked", [False, True])
def test_ascending_logits_overflow_the_first_tiles_threshold(top_k, masked):
    """Logits rising with the token id: the threshold the kernel derives from the first tile is
    below every later token, so a free-running pass (top_k <= 256) overflows its candidate
    buffer and must collect again block-synchronised; larger top_k, which selects only when the
    buffer nears full, overflows too and must collect again the strict way.
    The draws must still follow the filtered distribution."""
    draws, vocab = 1 << 16, 128256
    row = (torch.arange(vocab, dtype=torch.float32) * 0.01).cuda()
    bits, allowed, bits_e = _one_row_mask(masked, vocab, draws, seed=top_k)
    ids, _, probs = _draw_one_row(row, bits, allowed, bits_e, _params(draws, 1.0, top_k, 1.0, 0.0))
    if top_k == 1:
        assert torch.equal(ids, torch.full_like(ids, int(probs.argmax())))
    else:
        _tv_check(ids, probs, f"ascending top_k={top_k}")


@pytest.mark.parametrize("gap", [30.0, 100.0])
@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (50, 0.9)])
def test_temperature_one_with_the_allowed_max_far_below_the_raw_max(gap, top_k, top_p):
    """At temperature 1 the kernel sums Z relative to the raw max. Here every masked token sits
    `gap` above the allowed ones: at 30 that sum is exact enough; at 100 every allowed term
    underflows relative to the raw max, and Z must be summed again relative to the allowed max.
    Either way the draws follow the filtered distribution and the logprobs stay raw."""
    draws, vocab = 1 << 16, 32000
    row = _distinct_logits(vocab, torch.float32, seed=7)
    bits, allowed = _random_mask(1, vocab, keep=0.6, seed=11)
    row = torch.where(allowed[0], row, row + gap)
    ids, _, probs = _draw_one_row(row, bits, allowed, bits.expand(draws, -1),
                                  _params(draws, 1.0, top_k, top_p, 0.0))
    _tv_check(ids, probs, f"gap {gap} top_k {top_k}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,vocab", [(1, 128256), (19, 32000), (99, 989), (19, 17)])
def test_mixed_batch_greedy_and_sampled_rows(dtype, batch, vocab):
    g = torch.Generator(device="cuda").manual_seed(batch * vocab)
    logits = (torch.randn(batch, vocab, device="cuda", generator=g) * 3).to(dtype)
    bits, allowed = _random_mask(batch, vocab, keep=0.5, seed=batch)
    # mask the raw argmax of every row so a correct kernel must look past it
    top = logits.float().argmax(-1)
    for b in range(batch):
        t = int(top[b])
        allowed[b, t] = False
        bits[b, t // 32] &= ~(1 << (t % 32)) if (t % 32) != 31 else 0x7FFFFFFF
    gen = torch.Generator().manual_seed(7)
    temperature = torch.where(torch.rand(batch, generator=gen) < 0.4, 0.0,
                              0.3 + torch.rand(batch, generator=gen)).cuda()
    top_k = torch.randint(-1, 100, (batch,), generator=gen, dtype=torch.int32).cuda()
    top_p = torch.where(torch.rand(batch, generator=gen) < 0.5, 1.0,
                        0.5 + 0.5 * torch.rand(batch, generator=gen)).cuda()
    min_p = torch.where(torch.rand(batch, generator=gen) < 0.7, 0.0,
                        0.2 * torch.rand(batch, generator=gen)).cuda()
    seeds = torch.randint(0, 2**62, (batch,), generator=gen).cuda()
    offsets = torch.randint(0, 1000, (batch,), generator=gen).cuda()
    ids, logprobs = _sample(logits, bits, temperature, top_k, top_p, min_p, seeds, offsets)
    assert allowed.gather(1, ids[:, None]).all(), "a masked token was returned"
    raw = torch.log_softmax(logits.float(), -1)
    torch.testing.assert_close(logprobs, raw.gather(1, ids[:, None])[:, 0], atol=1e-4, rtol=1e-5)
    masked_logits = ref.apply_bitmask(logits.float(), bits)
    greedy = temperature == 0
    assert torch.equal(ids[greedy], masked_logits.argmax(-1)[greedy])
    sampled = ~greedy
    if sampled.any():
        probs = ref.filtered_probs(logits[sampled], bits[sampled], temperature[sampled], top_k[sampled],
                                   top_p[sampled], min_p[sampled])
        # kept set up to ties (bf16 logits tie often; the kernel breaks ties by token id, the
        # reference by torch.sort's order): the id's logit is >= the smallest kept logit
        x = masked_logits[sampled]
        thr = torch.where(probs > 0, x, torch.full_like(x, float("inf"))).min(-1).values
        assert (x.gather(1, ids[sampled][:, None])[:, 0] >= thr).all(), "id outside the kept set"


def test_unmasked_rows_without_bitmask_and_extreme_params():
    vocab = 5000
    logits = torch.randn(4, vocab, device="cuda") * 2
    prm = _params(4, temperature=1.0)
    prm["top_k"] = torch.tensor([1, vocab, vocab + 10, -5], device="cuda", dtype=torch.int32)
    prm["top_p"] = torch.tensor([1.0, 1e-6, 1.0, 1.0], device="cuda")
    ids, _ = _sample(logits, None, **prm)
    am = logits.argmax(-1)
    assert ids[0] == am[0], "top_k=1 must be greedy"
    assert ids[1] == am[1], "a tiny top_p keeps only the first token"
    assert ((ids >= 0) & (ids < vocab)).all()


def test_all_masked_row_returns_zero():
    logits = torch.randn(2, 100, device="cuda")
    bits = torch.zeros(2, 4, device="cuda", dtype=torch.int32)
    prm = _params(2, temperature=1.0, top_k=5)
    prm["temperature"][1] = 0.0
    ids, logprobs = _sample(logits, bits, **prm)
    assert ids.tolist() == [0, 0]
    assert torch.isfinite(logprobs).all()


def test_rejects_bad_inputs():
    logits = torch.randn(2, 100, device="cuda")
    prm = _params(2)
    with pytest.raises(RuntimeError, match="bitmask"):
        _sample(logits, torch.zeros(2, 3, device="cuda", dtype=torch.int32), **prm)
    bad = dict(prm, top_k=prm["top_k"].long())
    with pytest.raises(RuntimeError, match="top_k"):
        _sample(logits, None, **bad)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        _sample(logits.half(), None, **prm)


def test_no_host_sync_under_graph_capture():
    batch, vocab = 8, 32000
    logits = torch.randn(batch, vocab, device="cuda")
    bits, _ = _random_mask(batch, vocab)
    prm = _params(batch, temperature=1.0, top_k=50, top_p=0.9)
    _sample(logits, bits, **prm)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _sample(logits, bits, **prm)
    graph.replay()
    ids_eager, _ = _sample(logits, bits, **prm)
    torch.cuda.synchronize()
    assert torch.equal(out[0], ids_eager)
