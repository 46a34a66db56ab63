"""The CPU fast paths of model/llama.py and model/cpu_attention.py give bit-identical values to
the paths they replace (so greedy outputs cannot change): the transposed GEMM orientation
(llama.linear, the LM head's slices, the MLP's transposed activations) and the once-per-step
decode attention table. Shapes are the default model's (SmolLM2-135M) unless noted."""
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
