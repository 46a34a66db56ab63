"""Sliding-window attention and Gemma 2 / 3 on the CPU (issue 40, point 1: the reference half).

The window convention is HF transformers' (masking_utils.sliding_window_causal_mask_function):
a query at position p attends KV positions (p - window, p], `window` positions, itself included.

(a) The reference ops with a window (and Gemma 2's soft-cap) against a dense float64 oracle whose
    mask is HF's own mask function: decode and extend, slots scattered through the pool (page
    size 1), lengths on both sides of the window edge, windows of 1 and of exactly a request's
    length, tiled (rows of one long request cut, requests padded together); slots before every
    query's window hold NaN, so reading one would show; the ops' CUDA routing (windowed calls
    take the kernels, soft-capped ones the reference, logged once) with the kernel path faked;
    CPU decode tables per window.
(b) Mistral with sliding_window 8, a tiny random model written by transformers: our logits within
    1e-4 of HF MistralForCausalLM's (fp32) over 3.75x the window: a prefill, a chunked prefill
    over a cached prefix across the window edge, and decode steps batched with a second request.
    The same model without its window is off by far more, so the window is what is compared.
(c) Tiny Gemma 3 (layer_types mixing sliding and full layers, window 8, rope_local_base_freq for
    the local layers and linear-scaled rope_theta for the global ones, query_pre_attn_scalar !=
    head_dim, q/k norms, tied embeddings) and Gemma 2 (attention and final logit soft-capping):
    logits within 1e-4 of HF Gemma3ForCausalLM / Gemma2ForCausalLM on sequences longer than the
    window, prefill, chunked prefill and decode; the same Gemma 3 weights under a hub-style
    config.json (flat rope_theta / rope_local_base_freq / rope_scaling, sliding_window_pattern,
    no layer_types) give the same logits.
(d) Through the Scheduler (the engine's own prefill planner, radix cache and runner, as
    tests/unit/conftest.make_scheduler drives the default model) on each tiny model above:
    a prompt prefilled in chunks of 5 tokens (smaller than the window of 8), then a second
    prompt sharing a 26-token prefix with it, served from the radix cache (its cached_tokens
    say so) and so reaching back across the window edge into KV it did not compute. Each
    request's greedy output (12 tokens) must equal HF's greedy generate on the same prompt
    (do_sample=False, no EOS), and every token we chose must be the argmax of HF's
    teacher-forced logits over prompt + output: the first check is the end-to-end one, the
    second names the step that differs if it fails.
"""
from __future__ import annotations

import json
import logging
import os
from typing import List

import pytest
import torch

from radixserve import ops
from radixserve.config import ModelConfig
from radixserve.model.forward_batch import ForwardMode
from radixserve.model.loader import load_model
from radixserve.ops import reference as ref

from test_model_parity import MiniRunner, _assert_close, _hf_logits, _randomize

WINDOW = 8


# ----------------------------------------------------------------------------- (a) the ops


def _hf_window_mask(window: int, q_pos: List[int], kv_len: int) -> torch.Tensor:
    """[len(q_pos), kv_len] bool, True where HF's sliding-window causal mask lets the query at
    q_pos[i] see KV position j (transformers.masking_utils' mask function, broadcast)."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    fn = sliding_window_causal_mask_function(window)
    zero = torch.tensor(0)
    mask = fn(zero, zero, torch.tensor(q_pos)[:, None], torch.arange(kv_len)[None, :])
    return mask.expand(len(q_pos), kv_len).bool()


def _oracle(q, k_cache, v_cache, q_lens, kv_lens, kv_indptr, kv_indices, sm_scale, window,
            softcap=None):
    """Dense float64 attention per request over all its KV, masked by HF's mask function."""
    out, start = [], 0
    for b, (n, kv) in enumerate(zip(q_lens, kv_lens)):
        slots = kv_indices[kv_indptr[b]:kv_indptr[b + 1]].long()
        k, v = k_cache[slots].double(), v_cache[slots].double()
        hq, hk = q.shape[1], k.shape[1]
        k, v = k.repeat_interleave(hq // hk, 1), v.repeat_interleave(hq // hk, 1)
        scores = torch.einsum("nhd,lhd->hnl", q[start:start + n].double(), k) * sm_scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        pos = [kv - n + i for i in range(n)]
        visible = _hf_window_mask(window, pos, kv) if window else \
            torch.arange(kv)[None, :] <= torch.tensor(pos)[:, None]
        scores = scores.masked_fill(~visible[None], float("-inf"))
        out.append(torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v))
        start += n
    return torch.cat(out)


def _paged(kv_lens, hk, d, seed):
    """K/V caches with each request's slots scattered through the pool (slot 0 is padding)."""
    g = torch.Generator().manual_seed(seed)
    num_slots = sum(kv_lens) + 11
    k_cache = torch.randn(num_slots, hk, d, generator=g)
    v_cache = torch.randn(num_slots, hk, d, generator=g)
    kv_indices = (torch.randperm(num_slots - 1, generator=g)[:sum(kv_lens)] + 1).to(torch.int32)
    return k_cache, v_cache, _indptr(kv_lens), kv_indices, g


def _indptr(lens):
    return torch.tensor([0] + list(lens), dtype=torch.int64).cumsum(0).to(torch.int32)


def _poison_outside(k_cache, v_cache, q_lens, kv_lens, kv_indptr, kv_indices, window):
    """NaN into every slot that no query of its request may see: before the window of the
    request's first query. Returns how many slots were poisoned."""
    count = 0
    for b, (n, kv) in enumerate(zip(q_lens, kv_lens)):
        first_seen = max(0, kv - n - window + 1)
        slots = kv_indices[kv_indptr[b]:kv_indptr[b] + first_seen].long()
        k_cache[slots] = float("nan")
        v_cache[slots] = float("nan")
        count += slots.numel()
    return count


def test_window_edge_is_hfs():
    """HF's convention, which the ops follow: the query at p sees p - window + 1 .. p."""
    visible = _hf_window_mask(WINDOW, [20], 21)[0]
    assert visible.nonzero().flatten().tolist() == list(range(20 - WINDOW + 1, 21))


@pytest.mark.parametrize("window", [1, 3, WINDOW])
@pytest.mark.parametrize("hq,hk", [(4, 2), (3, 1)])
def test_decode_with_window_matches_the_masked_oracle(window, hq, hk):
    d = 16
    # shorter than, equal to, one past, and far past the window
    lens = [1, window, window + 1, 2 * window + 3, 37]
    k_cache, v_cache, kv_indptr, kv_indices, g = _paged(lens, hk, d, window * 10 + hq)
    q = torch.randn(len(lens), hq, d, generator=g)
    want = _oracle(q, k_cache, v_cache, [1] * len(lens), lens, kv_indptr, kv_indices, 0.3,
                   window)
    assert _poison_outside(k_cache, v_cache, [1] * len(lens), lens, kv_indptr, kv_indices,
                           window) > 0
    got = ops.paged_decode_attention(q, k_cache, v_cache, kv_indptr, kv_indices, 0.3,
                                     window=window)
    assert torch.isfinite(got).all(), "a slot outside the window was read"
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
    # and the window matters: the full-context answer differs where a request is longer
    full = _oracle(q, k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0), [1] * len(lens), lens,
                   kv_indptr, kv_indices, 0.3, 0)
    assert (full[-1] - want[-1]).abs().max() > 1e-3


# requests with and without a cached prefix, prefixes crossing the window, one prompt longer
# than several windows, one exactly a window long
Q_LENS, KV_LENS = [3, 1, 30, 5, 8, 17], [7, 1, 30, 19, 8, 40]


@pytest.mark.parametrize("window", [1, 5, WINDOW])
@pytest.mark.parametrize("tiled", [False, True])
def test_extend_with_window_matches_the_masked_oracle(window, tiled, monkeypatch):
    hq, hk, d = 4, 2, 16
    k_cache, v_cache, kv_indptr, kv_indices, g = _paged(KV_LENS, hk, d, window + 100 * tiled)
    q = torch.randn(sum(Q_LENS), hq, d, generator=g)
    qo_indptr = _indptr(Q_LENS)
    want = _oracle(q, k_cache, v_cache, Q_LENS, KV_LENS, kv_indptr, kv_indices, 0.25, window)
    _poison_outside(k_cache, v_cache, Q_LENS, KV_LENS, kv_indptr, kv_indices, window)
    if tiled:       # short requests padded together, long ones cut into row ranges
        monkeypatch.setattr(ref, "TILE_BYTES", ref.attention_tile_bytes(2, 5, 12, hk, hq // hk,
                                                                         d, 4))
    attn = ref.PagedAttention(kv_indptr, kv_indices, qo_indptr, hq, hk, d, 4, window)
    if tiled:
        assert any(t.req_end - t.req_start > 1 for t in attn.tiles), "no requests padded together"
        assert any(t.kv_start > 0 for t in attn.tiles), "no row range starts past its request's KV"
    # no request reads more than its first query's window back
    assert all(kv == min(full, q + window - 1)
               for kv, full, q in zip(attn.kv_lens, KV_LENS, Q_LENS))
    got = ops.paged_extend_attention(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, 0.25,
                                     window=window)
    assert torch.isfinite(got).all(), "a slot outside the window was read"
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


def test_window_no_request_exceeds_is_the_plain_causal_attention():
    hq, hk, d = 4, 2, 16
    k_cache, v_cache, kv_indptr, kv_indices, g = _paged(KV_LENS, hk, d, 7)
    q = torch.randn(sum(Q_LENS), hq, d, generator=g)
    args = (q, k_cache, v_cache, _indptr(Q_LENS), kv_indptr, kv_indices, 0.25)
    assert torch.equal(ops.paged_extend_attention(*args, window=max(KV_LENS)),
                       ops.paged_extend_attention(*args))


@pytest.mark.parametrize("window", [0, 5])
def test_softcap_matches_the_oracle(window):
    hq, hk, d = 4, 2, 16
    k_cache, v_cache, kv_indptr, kv_indices, g = _paged(KV_LENS, hk, d, 9)
    q = torch.randn(sum(Q_LENS), hq, d, generator=g) * 3       # scores well past the cap
    want = _oracle(q, k_cache, v_cache, Q_LENS, KV_LENS, kv_indptr, kv_indices, 0.5, window,
                   softcap=2.0)
    got = ops.paged_extend_attention(q, k_cache, v_cache, _indptr(Q_LENS), kv_indptr, kv_indices,
                                     0.5, window=window or None, softcap=2.0)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
    uncapped = ops.paged_extend_attention(q, k_cache, v_cache, _indptr(Q_LENS), kv_indptr,
                                          kv_indices, 0.5, window=window or None)
    assert (uncapped.double() - want).abs().max() > 1e-2


def test_windowed_calls_take_the_kernels_and_capped_calls_the_reference(monkeypatch, caplog):
    """With the kernel path on (faked: no GPU here): windowed decode and extend calls reach the
    kernels with their window as the last argument; a soft-capped call of either op runs the
    reference, never torch.ops.radixserve, and says so once per op."""
    assert ops.attention_kernel_takes(None, None) and ops.attention_kernel_takes(0, 0.0)
    assert ops.attention_kernel_takes(WINDOW, None)
    assert not ops.attention_kernel_takes(None, 50.0)
    assert not ops.attention_kernel_takes(WINDOW, 50.0)
    assert ops.attention_kernel_takes(WINDOW, None, 128)
    assert not ops.attention_kernel_takes(None, None, 96)       # Phi-3's; Gemma's 256 likewise
    monkeypatch.setattr(ops, "_use_attention_kernel", lambda q: True)
    monkeypatch.setattr(ops, "_REFERENCE_ROUTES_LOGGED", set())
    calls = {"paged_decode_attention": [], "paged_extend_attention": []}

    class AttentionKernelsOnly:
        def __getattr__(self, name):
            if name not in calls:
                raise AssertionError(f"kernel {name} called")
            return lambda *args: calls[name].append(args) or torch.zeros(1)

    monkeypatch.setattr(torch.ops, "radixserve", AttentionKernelsOnly(), raising=False)
    hq, hk, d = 4, 2, 64
    k_cache, v_cache, kv_indptr, kv_indices, g = _paged(KV_LENS, hk, d, 3)
    q = torch.randn(sum(Q_LENS), hq, d, generator=g)
    qd = q[:len(KV_LENS)]
    with caplog.at_level(logging.WARNING, logger="radixserve.ops"):
        for _ in range(2):
            capped_e = ops.paged_extend_attention(q, k_cache, v_cache, _indptr(Q_LENS),
                                                  kv_indptr, kv_indices, 0.25, window=WINDOW,
                                                  softcap=50.0)
            capped_d = ops.paged_decode_attention(qd, k_cache, v_cache, kv_indptr, kv_indices,
                                                  0.25, window=WINDOW, softcap=50.0)
            ops.paged_decode_attention(qd, k_cache, v_cache, kv_indptr, kv_indices, 0.25,
                                       window=WINDOW)
            ops.paged_extend_attention(q, k_cache, v_cache, _indptr(Q_LENS), kv_indptr,
                                       kv_indices, 0.25, window=WINDOW)
    assert torch.equal(capped_e, ref.paged_extend_attention(
        q, k_cache, v_cache, _indptr(Q_LENS), kv_indptr, kv_indices, 0.25, window=WINDOW,
        softcap=50.0))
    assert torch.equal(capped_d, ref.paged_decode_attention(
        qd, k_cache, v_cache, kv_indptr, kv_indices, 0.25, window=WINDOW, softcap=50.0))
    for name, made in calls.items():
        assert len(made) == 2 and all(c[-1] == WINDOW for c in made), name
    routes = [r.getMessage() for r in caplog.records if "torch reference on CUDA" in r.getMessage()]
    assert len(routes) == 2, routes                  # once per op
    assert all("soft-capping" in r for r in routes)
    with pytest.raises(ValueError, match="window"):
        ops.paged_decode_attention(qd, k_cache, v_cache, kv_indptr, kv_indices, 0.25, window=-1)
    with pytest.raises(ValueError, match="window"):
        ops.paged_extend_attention(q, k_cache, v_cache, _indptr(Q_LENS), kv_indptr, kv_indices,
                                   0.25, window=-1)


def test_cpu_decode_tables_per_window_are_the_reference():
    from radixserve.model.cpu_attention import CpuDecodeAttention

    lens = [1, 7, 8, 9, 30]
    k_cache, v_cache, kv_indptr, kv_indices, g = _paged(lens, 2, 16, 5)
    attn = CpuDecodeAttention(kv_indptr, kv_indices)
    for window in (None, 4, None, 4):              # alternating layers, as Gemma's
        q = torch.randn(len(lens), 4, 16, generator=g)
        want = ref.paged_decode_attention(q, k_cache, v_cache, kv_indptr, kv_indices, 0.25,
                                          window=window)
        assert torch.equal(attn(q, k_cache, v_cache, 0.25, window=window), want)
    assert len(attn._tables) == 2


# ----------------------------------------------------------------------------- tiny models


def _tiny_mistral(head_dim: int = 32):
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=89, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                        max_position_embeddings=256, sliding_window=WINDOW,
                        tie_word_embeddings=False)
    return MistralForCausalLM(cfg)


GEMMA3_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]


def _tiny_gemma3(head_dim: int = 32):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    # query_pre_attn_scalar 24 != head_dim 32; local rope base 300, global 5000 scaled x4
    cfg = Gemma3TextConfig(vocab_size=97, hidden_size=64, intermediate_size=96,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=head_dim, sliding_window=WINDOW, layer_types=GEMMA3_TYPES,
                           max_position_embeddings=256, query_pre_attn_scalar=24,
                           rope_theta=5000.0, rope_local_base_freq=300.0,
                           rope_scaling={"rope_type": "linear", "factor": 4.0})
    return Gemma3ForCausalLM(cfg)


def _tiny_gemma2(head_dim: int = 32):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                       sliding_window=WINDOW, max_position_embeddings=256,
                       query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                       final_logit_softcapping=5.0,
                       # the oracle must soft-cap its scores: transformers 5.17 (the GPU image's)
                       # otherwise picked SDPA for generate, which does not, and its greedy
                       # tokens left ours (and its own forward's) from the first one
                       attn_implementation="eager")
    return Gemma2ForCausalLM(cfg)


# (head_dim 32 here; the GPU tests build them with 64, a head_dim the attention kernels take)
TINY = {"mistral": _tiny_mistral, "gemma3": _tiny_gemma3, "gemma2": _tiny_gemma2}


def _write(hf, path) -> str:
    hf.save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="module", params=sorted(TINY))
def tiny(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = TINY[request.param]().eval()
    _randomize(hf, seed=1)
    path = _write(hf, tmp_path_factory.mktemp(request.param))
    config = ModelConfig.from_path(path)
    ours = load_model(path, config, "safetensors", torch.float32, "cpu")
    return request.param, hf, ours, config, path


def _seq(config, n, seed):
    return torch.randint(0, config.vocab_size, (n,),
                         generator=torch.Generator().manual_seed(seed)).tolist()


def test_tiny_windows_per_layer(tiny):
    name, hf, ours, config, _ = tiny
    windows = [layer.self_attn.window for layer in ours.model.layers]
    # HF's Gemma layers carry their window; Mistral's attention reads the config's
    hf_windows = [getattr(layer.self_attn, "sliding_window", hf.config.sliding_window) or 0
                  for layer in hf.model.layers]
    assert windows == hf_windows
    assert any(windows)
    if name == "gemma3":
        assert windows == [WINDOW if t == "sliding_attention" else 0 for t in GEMMA3_TYPES]
        assert not torch.equal(ours.model.cos_sin_cache_sliding_attention,
                               ours.model.cos_sin_cache_full_attention)


def test_tiny_logits_match_hf_across_the_window(tiny):
    """Prefill of 30 tokens (3.75 windows) alone and beside a short request; then a chunked
    prefill of the same sequence (13 + 12 tokens, the second chunk over the cached first one)
    and 5 decode steps batched with a second request."""
    name, hf, ours, config, _ = tiny
    seq, other = _seq(config, 30, 3), _seq(config, 7, 4)
    ref_logits = _hf_logits(hf, seq)

    runner = MiniRunner(ours, config)
    whole = runner.step([runner.new_request(), runner.new_request()], [seq, other[:5]],
                        ForwardMode.EXTEND, all_logits=True)
    _assert_close(whole[:30], ref_logits)
    _assert_close(whole[30:], _hf_logits(hf, other[:5]))

    runner = MiniRunner(ours, config)
    row, row2 = runner.new_request(), runner.new_request()
    _assert_close(runner.step([row], [seq[:13]], ForwardMode.EXTEND, all_logits=True),
                  ref_logits[:13])
    _assert_close(runner.step([row], [seq[13:25]], ForwardMode.EXTEND, all_logits=True),
                  ref_logits[13:25])
    runner.step([row2], [other[:2]], ForwardMode.EXTEND)
    for i, pos in enumerate(range(25, 30)):
        step = runner.step([row, row2], [[seq[pos]], [other[2 + i]]], ForwardMode.DECODE)
        _assert_close(step[:1], ref_logits[pos:pos + 1])
        _assert_close(step[1:], _hf_logits(hf, other[:3 + i])[-1:])


def test_tiny_window_is_what_makes_the_match(tiny):
    """Our model with its windows switched off misses HF's logits past the window: the parity
    above tests the window, not a context too short to show it."""
    _, hf, ours, config, _ = tiny
    seq = _seq(config, 30, 3)
    saved = [layer.self_attn.window for layer in ours.model.layers]
    try:
        for layer in ours.model.layers:
            layer.self_attn.window = 0
        runner = MiniRunner(ours, config)
        full = runner.step([runner.new_request()], [seq], ForwardMode.EXTEND, all_logits=True)
    finally:
        for layer, w in zip(ours.model.layers, saved):
            layer.self_attn.window = w
    ref_logits = _hf_logits(hf, seq)
    assert (full[:WINDOW] - ref_logits[:WINDOW]).abs().max() < 1e-4     # the window hides nothing yet
    assert (full[WINDOW:] - ref_logits[WINDOW:]).abs().max() > 1e-2


def test_gemma3_hub_style_config_gives_the_same_logits(tmp_path_factory):
    """gemma-3 checkpoints on the hub carry rope_theta, rope_local_base_freq, rope_scaling and
    sliding_window_pattern (no layer_types, no nested rope_parameters): read the same way."""
    torch.manual_seed(0)
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(vocab_size=97, hidden_size=64, intermediate_size=96,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=32, sliding_window=WINDOW, sliding_window_pattern=2,
                           max_position_embeddings=256, query_pre_attn_scalar=24,
                           rope_theta=5000.0, rope_local_base_freq=300.0,
                           rope_scaling={"rope_type": "linear", "factor": 4.0})
    hf = Gemma3ForCausalLM(cfg).eval()
    assert hf.config.layer_types == ["sliding_attention", "full_attention"] * 2
    _randomize(hf, seed=2)
    path = _write(hf, tmp_path_factory.mktemp("gemma3_hub"))
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    for key in ("layer_types", "rope_parameters", "_sliding_window_pattern"):
        raw.pop(key, None)
    raw.update(rope_theta=5000.0, rope_local_base_freq=300.0, sliding_window_pattern=2,
               rope_scaling={"rope_type": "linear", "factor": 4.0})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f)
    config = ModelConfig.from_path(path)
    assert config.rope_theta == 5000.0 and config.tie_word_embeddings
    ours = load_model(path, config, "safetensors", torch.float32, "cpu")
    seq = _seq(config, 24, 5)
    runner = MiniRunner(ours, config)
    got = runner.step([runner.new_request()], [seq], ForwardMode.EXTEND, all_logits=True)
    _assert_close(got, _hf_logits(hf, seq))


def test_gemma3_nested_rope_parameters_are_read(tiny):
    name, _, _, config, _ = tiny
    if name != "gemma3":
        pytest.skip("Gemma 3 only")
    from radixserve.model.gemma3 import Gemma3ForCausalLM

    assert "full_attention" in config.hf_config["rope_parameters"]       # transformers 5's form
    assert config.rope_theta == 5000.0 and config.rope_scaling["factor"] == 4.0
    ropes = Gemma3ForCausalLM.ropes(config, GEMMA3_TYPES)
    assert ropes["sliding_attention"] == (300.0, None)
    assert ropes["full_attention"][0] == 5000.0 and ropes["full_attention"][1]["factor"] == 4.0


def test_only_soft_capping_keeps_cuda_graphs_off(tiny):
    """The attention kernels take windows, so a windowed model (Mistral, Gemma 3) runs every
    layer on them and in CUDA graphs; Gemma 2's soft-cap needs the reference."""
    from radixserve.model.runner import reference_attention

    name, _, ours, _, _ = tiny
    assert reference_attention(ours) == ("attention soft-capping" if name == "gemma2" else None)
    assert reference_attention(ours, 64) == reference_attention(ours)
    assert reference_attention(ours, 32) == "head_dim 32"     # the kernels are built for 64, 128


def test_llama_ignores_sliding_window_as_hf_does():
    from radixserve.model.llama import LlamaForCausalLM, Qwen2ForCausalLM

    base = {"vocab_size": 10, "hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 4,
            "num_attention_heads": 2, "sliding_window": 8}
    llama = ModelConfig.from_dict({**base, "architectures": ["LlamaForCausalLM"]})
    assert LlamaForCausalLM.layer_windows(llama) == [0] * 4
    qwen = {**base, "architectures": ["Qwen2ForCausalLM"]}
    assert Qwen2ForCausalLM.layer_windows(ModelConfig.from_dict(qwen)) == [0] * 4
    on = ModelConfig.from_dict({**qwen, "use_sliding_window": True, "max_window_layers": 2})
    assert Qwen2ForCausalLM.layer_windows(on) == [0, 0, 8, 8]


def test_multimodal_gemma3_serves_its_text_model():
    """Gemma3ForConditionalGeneration resolves to its text model (tests/unit/
    test_gemma3_multimodal_text.py loads one); unknown architectures are still refused."""
    from radixserve.model.architectures import get_model_class
    from radixserve.model.gemma3 import Gemma3ForCausalLM

    cls = get_model_class("Gemma3ForConditionalGeneration")
    assert cls.__name__ == "Gemma3ForConditionalGeneration" and issubclass(cls, Gemma3ForCausalLM)
    assert get_model_class("Gemma3ForCausalLM") is Gemma3ForCausalLM
    with pytest.raises(ValueError, match="not supported; supported: .*Gemma3ForCausalLM"):
        get_model_class("LlavaForConditionalGeneration")


# ----------------------------------------------------------------------------- (d) the engine


def _scheduler(path, config, model, **overrides):
    from radixserve.config import ServerArgs
    from radixserve.engine.scheduler import Scheduler
    from radixserve.model.runner import ModelRunner

    kw = dict(model_path=path, device="cpu", max_total_tokens=512, max_running_requests=4,
              context_length=128, chunked_prefill_size=5, random_seed=0)
    kw.update(overrides)
    args = ServerArgs(**kw)
    runner = ModelRunner(args, config, path, context_len=args.context_length, model=model)
    return Scheduler(args, runner)


def _hf_greedy(hf, prompt: List[int], n: int) -> List[int]:
    """HF's greedy continuation; the attention mask given, or generate would take the prompt's
    pad_token_id tokens for padding."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_engine_chunked_prefill_and_radix_reuse_across_the_window(tiny):
    from conftest import run_to_completion
    from radixserve.engine.req import Req
    from radixserve.sampling.params import SamplingParams

    _, hf, ours, config, path = tiny
    sched = _scheduler(path, config, ours)
    assert sched.chunk_size == 5 < WINDOW
    prompt_a = _seq(config, 30, 11)
    prompt_b = prompt_a[:26] + _seq(config, 6, 12)       # shares 26 > 3 windows
    n = 12
    outputs, prefill_steps = {}, []
    for rid, prompt in (("a", prompt_a), ("b", prompt_b)):
        req = Req(rid, prompt, SamplingParams(max_new_tokens=n, temperature=0.0,
                                              ignore_eos=True), n)
        steps = run_to_completion(sched, [req])
        prefill_steps.append(steps - (n - 1))
        outputs[rid] = (prompt, list(req.output_ids), req.cached_tokens)
    a_cached, b_cached = outputs["a"][2], outputs["b"][2]
    assert a_cached == 0
    assert b_cached >= 26 - 1 > 3 * WINDOW, f"b reused {b_cached} tokens from the radix cache"
    assert prefill_steps[0] >= 30 // 5, "a's prompt was not prefilled in chunks"
    for rid, (prompt, got, _) in outputs.items():
        seq = prompt + got
        teacher = _hf_logits(hf, seq[:-1])[len(prompt) - 1:]            # [n, vocab]
        for i, tok in enumerate(got):
            assert tok == int(teacher[i].argmax()), f"{rid}: token {i} is not HF's argmax"
        assert got == _hf_greedy(hf, prompt, n), rid
