"""The CPU fast paths of model/llama.py and model/cpu_attention.py give bit-identical values to
the paths they replace (so greedy outputs cannot change): the transposed GEMM orientation
(llama.linear, the LM head's slices, the MLP's transposed activations) and the once-per-step
decode attention table. Shapes are the default model's (SmolLM2-135M) unless noted.

sampling/cpu_sampling.py keeps the reference's filtered distribution exactly (the same floats as
reference.filtered_probs), draws from it (frequencies of many draws), and draws as a function
of (seed, offset, row) alone."""
import math

import pytest
import torch
import torch.nn.functional as F

from radixserve.model import llama
from radixserve.ops import reference as ref

# (out, in) of the default model's qkv, o, gate_up and down projections, and an odd shape
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (1000, 333)]


@pytest.mark.parametrize("m", list(llama.CPU_GEMM_T_ROWS))
@pytest.mark.parametrize("out_in", SHAPES)
def test_transposed_linear_is_bit_identical(m, out_in):
    out_f, in_f = out_in
    g = torch.Generator().manual_seed(m * 7 + out_f)
    x = torch.randn(m, in_f, generator=g)
    w = torch.randn(out_f, in_f, generator=g) * 0.05
    b = torch.randn(out_f, generator=g)
    assert llama.cpu_transposed_gemm_ok(x)
    got = llama.linear(x, w)
    assert got.is_contiguous() and torch.equal(got, F.linear(x, w))
    assert torch.equal(llama.linear(x, w, b), F.linear(x, w, b))
    view = llama.linear(x, w, contiguous=False)
    assert not view.is_contiguous() and torch.equal(view, F.linear(x, w))


@pytest.mark.parametrize("m", [1, 8, 12, 15, 65])
def test_linear_outside_the_rows_is_f_linear(m):
    x = torch.randn(m, 576)
    assert not llama.cpu_transposed_gemm_ok(x)
    assert not llama.cpu_transposed_gemm_ok(torch.randn(16, 576, dtype=torch.bfloat16))
    w = torch.randn(960, 576)
    assert torch.equal(llama.linear(x, w), F.linear(x, w))


@pytest.mark.parametrize("m", [16, 32])
def test_transposed_lm_head_slices_are_bit_identical(m):
    """The head's transposed slices give exactly the logits of the untransposed slices."""
    g = torch.Generator().manual_seed(m)
    hidden = torch.randn(m, 576, generator=g)
    weight = torch.randn(49152 + 77, 576, generator=g)
    rows = llama.CPU_LM_HEAD_ROWS
    got = llama._linear_in_row_slices(hidden, weight, rows)
    want = torch.cat([F.linear(hidden, weight[s:s + rows]) for s in range(0, weight.shape[0], rows)], 1)
    assert got.is_contiguous() and torch.equal(got, want)


def test_silu_and_mul_on_the_transposed_view_is_bit_identical():
    """The MLP feeds gate_up's transposed view to silu_and_mul and down_proj."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 576, generator=g)
    w_gu = torch.randn(3072, 576, generator=g) * 0.05
    w_d = torch.randn(576, 1536, generator=g) * 0.05
    want = F.linear(ref.silu_and_mul(F.linear(x, w_gu)), w_d)
    got = llama.linear(ref.silu_and_mul(llama.linear(x, w_gu, contiguous=False)), w_d)
    assert torch.equal(got, want)


@pytest.mark.parametrize("lens", [[1], [5, 1, 9], [120] * 16, [3, 70, 12, 1, 44, 8, 8, 30]])
def test_cpu_decode_attention_is_bit_identical_to_the_reference(lens):
    from radixserve.model.cpu_attention import CpuDecodeAttention

    g = torch.Generator().manual_seed(len(lens))
    num_slots, hq, hkv, d = 2048, 9, 3, 64
    k_cache = torch.randn(num_slots + 1, hkv, d, generator=g)
    v_cache = torch.randn(num_slots + 1, hkv, d, generator=g)
    kv_indptr = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    kv_indices = (torch.randperm(num_slots, generator=g)[:sum(lens)] + 1).to(torch.int32)
    attn = CpuDecodeAttention(kv_indptr, kv_indices)
    for layer in range(2):      # one table, several layers' caches
        q = torch.randn(len(lens), hq, d, generator=g)
        want = ref.paged_decode_attention(q, k_cache, v_cache, kv_indptr, kv_indices, d ** -0.5)
        assert torch.equal(attn(q, k_cache, v_cache, d ** -0.5), want)
        k_cache, v_cache = v_cache, k_cache


def test_cpu_decode_table_only_for_fp32_cpu_decode():
    from radixserve.model.cpu_attention import CpuDecodeAttention
    from radixserve.model.forward_batch import ForwardBatch, ForwardMode

    indptr = torch.tensor([0, 2], dtype=torch.int32)
    fb = ForwardBatch(ForwardMode.DECODE, 1, torch.tensor([5]), torch.tensor([1]),
                      torch.tensor([2]), indptr, indptr, torch.tensor([1, 2], dtype=torch.int32),
                      torch.tensor([2], dtype=torch.int32), None, None)
    assert CpuDecodeAttention.for_batch(fb, torch.float32) is not None
    assert CpuDecodeAttention.for_batch(fb, torch.bfloat16) is None
    fb.mode = ForwardMode.EXTEND
    assert CpuDecodeAttention.for_batch(fb, torch.float32) is None


# ----------------------------------------------------------------------------- sampling
# sampling/cpu_sampling.py: the reference's filtered distribution without a sort of the
# vocabulary, drawn with the CUDA kernel's counter-based uniform.

def _bits(allowed):
    """[batch, vocab] bool -> packed [batch, ceil(vocab / 32)] int32 (bit t % 32 of word t // 32)."""
    b, vocab = allowed.shape
    words = (vocab + 31) // 32
    padded = torch.zeros(b, words * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    packed = (padded.view(b, words, 32) << torch.arange(32)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _rows(n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """Per-row parameter tensors [n] as the sampler passes them."""
    return (torch.full((n,), temperature), torch.full((n,), top_k, dtype=torch.int32),
            torch.full((n,), top_p), torch.full((n,), min_p))


def _peaked_logits(rows, vocab, seed, scale=4.0):
    """Logits shaped like a model's: a heavy-tailed spread with a few clear leaders."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 1.5
    lead = torch.randint(0, vocab, (rows, 8), generator=g)
    x.scatter_(1, lead, scale + 2 * torch.rand(rows, 8, generator=g))
    return x


def test_philox_known_answers():
    """Philox4x32-10's published known-answer vectors (Random123's kat_vectors): the uniform of a
    row is the CUDA kernel's (csrc/include/radixserve/sampling.cuh: philox4x32_10)."""
    import numpy as np

    from radixserve.sampling.cpu_sampling import philox4x32_10

    def run(key, ctr):
        a = lambda v: np.array([v], dtype=np.uint64)   # noqa: E731
        return [int(w[0]) for w in philox4x32_10(a(key[0]), a(key[1]), tuple(a(c) for c in ctr))]

    m = 0xFFFFFFFF
    assert run((0, 0), (0, 0, 0, 0)) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert run((m, m), (m, m, m, m)) == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    assert run((0xA4093822, 0x299F31D0), (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344)) == \
        [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


def test_uniforms_are_the_kernels_uniform_from():
    """uniform_from(seed, offset) = 53 bits of Philox(key = seed; counter = (offset lo, offset
    hi, 0, 0)) / 2^53, for every int64 seed and offset (negative ones by their two's complement)."""
    from radixserve.sampling.cpu_sampling import uniforms

    u = uniforms(torch.tensor([0]), torch.tensor([0]))
    assert u.dtype == torch.float64
    assert u.item() == ((0x6627E8D5 >> 5) << 26 | (0xE169C58D >> 6)) / 2.0 ** 53
    seeds = torch.tensor([0, 1, 1 << 32, -1, -2**63, 2**63 - 1, 7, 7])
    offsets = torch.tensor([0, 0, 0, 0, 5, 5, 2**40, -1])
    u = uniforms(seeds, offsets)
    assert ((u >= 0) & (u < 1)).all()
    assert len(set(u.tolist())) == len(u)        # each word of seed and offset is used
    for i in range(len(u)):                      # a row's value does not depend on the others
        assert uniforms(seeds[i:i + 1], offsets[i:i + 1]).item() == u[i].item()


# (name, vocab, temperature, top_k, top_p, min_p, logits scale): peaked rows (64 candidates
# hold the kept set), flat rows (the kept set needs 1,024 candidates or the full sort), top_k
# beyond the candidate rounds, disabled filters
FILTER_CASES = [
    ("topk50_topp0.9", 49152, 0.8, 50, 0.9, 0.0, 4.0),
    ("topp0.95", 49152, 0.8, 0, 0.95, 0.0, 4.0),
    ("minp0.05", 49152, 0.8, 0, 1.0, 0.05, 4.0),
    ("all_three", 49152, 0.7, 40, 0.8, 0.02, 4.0),
    ("topk1", 1000, 1.0, 1, 1.0, 0.0, 4.0),
    ("topk_eq_vocab", 500, 1.0, 500, 1.0, 0.0, 4.0),
    ("topk_past_vocab_topp", 500, 1.0, 800, 0.7, 0.0, 4.0),
    ("flat_topp_1024", 8192, 2.0, 0, 0.3, 0.0, 0.0),
    ("flat_topp_full_sort", 8192, 2.0, 0, 0.9, 0.0, 0.0),
    ("topk2000_full_sort", 8192, 1.0, 2000, 1.0, 0.0, 0.0),
    ("flat_minp", 4097, 1.5, 0, 1.0, 0.5, 0.0),
    ("plain", 4097, 0.8, 0, 1.0, 0.0, 4.0),
]


@pytest.mark.parametrize("name,vocab,temperature,top_k,top_p,min_p,scale", FILTER_CASES)
@pytest.mark.parametrize("masked", [False, True])
def test_cpu_filtered_probs_equal_the_reference(name, vocab, temperature, top_k, top_p, min_p,
                                                scale, masked):
    """The kept sets of cpu_sampling (top-k candidates, full sort only where needed) give
    reference.filtered_probs' distribution exactly: the same floats, token for token."""
    from radixserve.sampling import cpu_sampling

    logits = _peaked_logits(6, vocab, seed=vocab + top_k, scale=scale)
    bits = None
    if masked:
        g = torch.Generator().manual_seed(vocab)
        allowed = torch.rand(6, vocab, generator=g) < 0.6
        allowed[:, 0] = True
        bits = _bits(allowed)
    params = _rows(6, temperature, top_k, top_p, min_p)
    want = ref.filtered_probs(logits, bits, *params)
    got = cpu_sampling.filtered_probs(logits, bits, *params)
    assert torch.equal(got, want), name


def test_cpu_filtered_probs_break_ties_by_token_id():
    """Tied probabilities at the cut: the reference keeps the lowest token ids (a stable sort),
    and so does the fast path (torch.topk orders ties its own way, so a tie at the cut takes the
    sort)."""
    from radixserve.sampling import cpu_sampling

    vocab = 5000
    logits = torch.zeros(3, vocab)
    logits[:, 3::7] = 2.0                                # 714 tied leaders
    logits[1, 100] = 3.0                                 # one clear leader, then the tie
    params = _rows(3, 1.0, 5, 1.0, 0.0)
    params[1][2] = 0                                     # row 2: top_p cuts inside the tie
    params[2][2] = 0.5
    want = ref.filtered_probs(logits, None, *params)
    assert (want[0] > 0).nonzero().flatten().tolist() == [3, 10, 17, 24, 31]
    assert (want[1] > 0).nonzero().flatten().tolist() == [3, 10, 17, 24, 100]
    assert torch.equal(cpu_sampling.filtered_probs(logits, None, *params), want)


def test_reference_top_p_one_keeps_the_whole_tail():
    """top_p = 1 disables top-p: tail tokens whose running float32 sum has rounded up to 1 stay."""
    logits = torch.full((1, 4096), -20.0)
    logits[0, 0] = 0.0
    p = ref.filtered_probs(logits, None, *_rows(1, 1.0, 0, 1.0, 0.0))
    assert (p > 0).all()


def _tv_check(ids, probs, label):
    """Sampled frequencies of one row against its distribution: no token outside the support,
    total variation within 1.5x its expectation under exact sampling (+ slack)."""
    n = ids.numel()
    freq = torch.bincount(ids, minlength=probs.numel()).double() / n
    p = probs.double()
    assert not ((freq > 0) & (p == 0)).any(), f"{label}: a token outside the kept set"
    tv = 0.5 * (freq - p).abs().sum().item()
    expected = 0.5 * torch.sqrt(2 * p * (1 - p) / (math.pi * n)).sum().item()
    assert tv <= 1.5 * expected + 0.005, f"{label}: TV {tv:.4f} vs expected {expected:.4f}"


@pytest.mark.parametrize("name,vocab,temperature,top_k,top_p,min_p,scale", [
    ("plain", 2048, 1.0, 0, 1.0, 0.0, 1.0),
    ("plain_odd_vocab", 1001, 0.7, 0, 1.0, 0.0, 2.0),
    ("topk20_topp0.9", 2048, 1.0, 20, 0.9, 0.0, 2.0),
    ("minp", 2048, 1.2, 0, 1.0, 0.1, 2.0),
    ("flat_topp_full_sort", 2048, 3.0, 0, 0.8, 0.0, 0.0),
])
@pytest.mark.parametrize("masked", [False, True])
def test_cpu_draws_follow_the_filtered_distribution(name, vocab, temperature, top_k, top_p, min_p,
                                                    scale, masked):
    """Many draws of one row (distinct offsets) land on the reference's filtered distribution,
    never outside its support; no masked token comes back."""
    from radixserve.sampling import cpu_sampling

    draws = 1 << 13
    row = _peaked_logits(1, vocab, seed=vocab, scale=scale)
    allowed = torch.ones(1, vocab, dtype=torch.bool)
    bits = None
    if masked:
        allowed = torch.rand(1, vocab, generator=torch.Generator().manual_seed(5)) < 0.5
        allowed[0, 0] = True
        bits = _bits(allowed)
    params = _rows(draws, temperature, top_k, top_p, min_p)
    ids, logprobs = cpu_sampling.bitmask_sample(
        row.expand(draws, vocab), None if bits is None else bits.expand(draws, -1), *params,
        torch.full((draws,), 99, dtype=torch.int64), torch.arange(draws))
    assert ids.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert allowed[0, ids].all()
    probs = ref.filtered_probs(row, bits, *(t[:1] for t in params))[0]
    _tv_check(ids, probs, name)
    torch.testing.assert_close(logprobs, torch.log_softmax(row, -1)[0, ids])


def test_cpu_draws_are_a_function_of_seed_offset_and_row():
    """Same (seed, offset, row) -> the same id, alone or in any batch, in any order; a greedy row
    is the masked argmax; a non-finite row keeps the argmax and its logprob flags it."""
    from radixserve.sampling import cpu_sampling

    batch, vocab = 8, 49152
    logits = _peaked_logits(batch, vocab, seed=1, scale=3.0)
    logits[5, 17] = float("nan")
    g = torch.Generator().manual_seed(2)
    allowed = torch.rand(batch, vocab, generator=g) < 0.7
    bits = _bits(allowed)
    temperature = torch.tensor([0.8, 0.0, 1.0, 0.8, 0.6, 0.9, 1.2, 0.0])
    top_k = torch.tensor([0, 0, 50, 0, 5, 0, 2000, 3], dtype=torch.int32)
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.95, 1.0, 1.0, 1.0, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.05, 0.0])
    seeds = torch.tensor([3, 3, -7, 2**62, 11, 12, 13, 14])
    offsets = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])
    args = (temperature, top_k, top_p, min_p, seeds, offsets)
    ids, logprobs = cpu_sampling.bitmask_sample(logits, bits, *args)
    assert allowed.gather(1, ids[:, None]).all()
    masked = ref.apply_bitmask(logits, bits)
    for row in (1, 5, 7):
        assert ids[row] == masked[row].argmax()
    assert math.isnan(logprobs[5]) and torch.isfinite(logprobs[[0, 1, 2, 3, 4, 6, 7]]).all()
    again, _ = cpu_sampling.bitmask_sample(logits, bits, *args)
    assert torch.equal(ids, again)
    for row in range(batch):
        alone, _ = cpu_sampling.bitmask_sample(logits[row:row + 1], bits[row:row + 1],
                                               *(t[row:row + 1] for t in args))
        assert alone.item() == ids[row].item(), row
    perm = torch.randperm(batch, generator=g)
    shuffled, _ = cpu_sampling.bitmask_sample(logits[perm], bits[perm], *(t[perm] for t in args))
    assert torch.equal(shuffled, ids[perm])
    # the offset moves the draw: over 16 offsets a plain row does not repeat one token
    draws = {cpu_sampling.bitmask_sample(logits[:1], None, *(t[:1] for t in args[:4]),
                                         seeds[:1], torch.tensor([k]))[0].item()
             for k in range(16)}
    assert len(draws) > 1


@pytest.mark.parametrize("m", [1, 64, 255, 256, 257, 49152, 50257])
def test_two_level_draw_is_the_inverse_cdf(m):
    """_draw picks the first column whose running sum exceeds u * total, in both levels of its
    blocks, and never a zero weight, also at u = 0 and u just below 1."""
    from radixserve.sampling.cpu_sampling import _draw

    g = torch.Generator().manual_seed(m)
    w = torch.rand(4, m, generator=g) * (torch.rand(4, m, generator=g) < 0.3)
    w[:, m // 2] = 0.5                                   # a positive weight in every row
    w[3, m // 2 + 1:] = 0                                # trailing zeros: u ~ 1 must stop before
    u = torch.tensor([0.0, 0.37, 0.9, 1 - 2.0 ** -53], dtype=torch.float64)
    col = _draw(w, u)
    cdf = w.double().cumsum(-1)
    want = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    assert (w.gather(1, col[:, None]) > 0).all()
    assert col[0] == (w[0] > 0).nonzero()[0, 0]          # u = 0: the first positive weight
    assert col[3] == m // 2                              # u -> 1: the last positive weight
    # rows 1 and 2: the one-level float64 inverse CDF (the two levels may differ from it only
    # where a running sum rounds to the target: not with these weights)
    assert col[1:3].tolist() == want[1:3].tolist()
