"""FP8 KV cache (--kv-cache-dtype fp8_e4m3 / fp8_e5m2) on the CPU, through the torch references.

(a) Quantization: store_kv writes fp8(fp32(x) * fp32(1 / scale)), saturated (reference.quantize_fp8),
    through the reference store and the fused rope + store alike; 16/32-bit caches ignore scales.
(b) Attention over FP8 pages is exactly "dequantize (times k_scale / v_scale), then attend", for
    decode and extend, untiled and in tiles (reference.attention_plan), and through the CPU decode
    table (model/cpu_attention.py).
(c) The pool: one byte per element, so the runner's pool holds 2x the tokens of bf16 (4x fp32)
    for the same memory; the flag; a scheduler with the radix cache runs on an FP8 pool.
(d) Checkpoint scales: self_attn.k_scale / v_scale (compressed-tensors), k_proj.k_scale
    (ModelOpt) and k_proj.output_scale (older exports) reach the layers (set_kv_cache_scales);
    a tiny model with an FP8 cache stays close to its fp32-cache logits.
(e) The default model (real weights), bf16, teacher forced on its own greedy continuations with
    the bf16 cache, against the same with the fp8_e4m3 cache: top-1 agreement and mean
    KL(bf16 cache || fp8 cache). The issue's bounds (>= 98%, <= 0.02 nats) are asserted by the
    full run (64 prompts x 64 positions, RADIXSERVE_ACCEPTANCE=1). Measured on this model (CPU,
    torch references, scales 1.0): 95.4% and 0.0081 nats at 64 x 64, so the KL bound holds and
    the top-1 bound does not; quantizing K alone accounts for nearly all of it (16 x 32: K only
    94.9% / 0.0070, V only 97.5% / 0.0019, both 94.9% / 0.0096), and per-layer scales
    calibrated to each layer's K/V maximum change nothing (e4m3's 3 mantissa bits, not its
    range, set the error). The default run (8 prompts x 16 positions: 91.4%, 0.0107 nats
    measured) asserts the KL bound and a top-1 floor of 85% against regressions.
"""
from __future__ import annotations

import math
import os
from typing import List, Sequence, Tuple

import pytest
import torch

from radixserve import ops
from radixserve.cache.kv_pool import KVPool, ReqToTokenPool
from radixserve.config import ModelConfig, ServerArgs
from radixserve.model.cpu_attention import CpuDecodeAttention
from radixserve.model.forward_batch import ForwardBatch, ForwardMode
from radixserve.ops import reference as ref

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


# ----------------------------------------------------------------------------- (a) quantization


@pytest.mark.parametrize("dtype", FP8, ids=str)
@pytest.mark.parametrize("scale", [1.0, 0.37, 4.0, 2.0 ** -5])
def test_quantize_saturates_and_rounds_like_torch(dtype, scale):
    g = torch.Generator().manual_seed(1)
    fmax = torch.finfo(dtype).max
    x = torch.cat([torch.randn(997, generator=g) * 3, torch.randn(97, generator=g) * fmax,
                   torch.tensor([0.0, -0.0, 1e-12, -3e-5, fmax * 4 * scale, -math.inf, math.inf])])
    q = ref.quantize_fp8(x, dtype, scale)
    assert q.dtype == dtype
    want = (x * (1.0 / scale)).clamp(-fmax, fmax).to(dtype)
    assert torch.equal(_u8(q), _u8(want))
    back = q.float()
    assert torch.isfinite(back).all()                           # saturated, never inf / NaN
    assert back[-3] == fmax and back[-2] == -fmax and back[-1] == fmax
    # round to nearest: within half a step (e4m3: 2^-4 relative; e5m2: 2^-3) of x / scale
    # where x / scale is a normal number of the format
    rel = 2.0 ** -4 if dtype == torch.float8_e4m3fn else 2.0 ** -3
    y = x / scale
    normal = (y.abs() >= torch.finfo(dtype).tiny) & (y.abs() <= fmax)
    assert ((back - y).abs()[normal] <= rel * y.abs()[normal] + 1e-30).all()
    assert torch.isnan(ref.quantize_fp8(torch.tensor([math.nan]), dtype, scale).float()).all()


@pytest.mark.parametrize("dtype", FP8, ids=str)
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,head_dim", [(3, 5), (2, 64)])
def test_store_kv_reference_quantizes_scattered_rows(dtype, src_dtype, heads, head_dim):
    g = torch.Generator().manual_seed(heads * 100 + head_dim)
    num_slots, n = 53, 19
    k_cache = torch.zeros(num_slots, heads, head_dim, dtype=dtype)
    v_cache = torch.zeros(num_slots, heads, head_dim, dtype=dtype)
    k = (torch.randn(n, heads, head_dim, generator=g) * 5).to(src_dtype)
    v = (torch.randn(n, heads, head_dim, generator=g) * 0.1).to(src_dtype)
    slots = torch.randperm(num_slots - 1, generator=g)[:n] + 1
    ops.store_kv(k_cache, v_cache, k, v, slots.to(torch.int32), 0.5, 0.01)
    assert torch.equal(_u8(k_cache[slots]), _u8(ref.quantize_fp8(k, dtype, 0.5)))
    assert torch.equal(_u8(v_cache[slots]), _u8(ref.quantize_fp8(v, dtype, 0.01)))
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[slots] = False
    assert not _u8(k_cache[untouched]).any() and not _u8(v_cache[untouched]).any()
    # read back within the format's step of the stored value
    assert torch.allclose(ref.dequantize_fp8(v_cache[slots], 0.01), v.float(), rtol=0.13, atol=1e-4)


def test_store_kv_ignores_scales_for_16_and_32_bit_caches():
    k = torch.randn(4, 2, 8)
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.zeros(9, 2, 8, dtype=dtype)
        b = torch.zeros(9, 2, 8, dtype=dtype)
        ops.store_kv(a, a.clone(), k.to(dtype), k.to(dtype), torch.tensor([1, 3, 5, 7]), 0.25, 8.0)
        ops.store_kv(b, b.clone(), k.to(dtype), k.to(dtype), torch.tensor([1, 3, 5, 7]))
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_rotary_store_kv_reference_quantizes_the_rotated_rows(dtype):
    g = torch.Generator().manual_seed(7)
    n, hq, hkv, d = 11, 6, 2, 16
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=g)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(n, hq, d), k.view(n, hkv, d), v.view(n, hkv, d)
    pos = torch.randint(0, 100, (n,), generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ang = torch.arange(128).float()[:, None] * inv[None]
    cos_sin = torch.cat([ang.cos(), ang.sin()], -1)
    k_cache = torch.zeros(40, hkv, d, dtype=dtype)
    v_cache = torch.zeros(40, hkv, d, dtype=dtype)
    slots = torch.arange(3, 3 + n)
    q2, k2 = q.clone(), k.clone()
    ops.rotary_embedding_store_kv(pos, q, k, v, cos_sin, k_cache, v_cache, slots, 1.5, 0.75)
    ref.rotary_embedding(pos, q2, k2, cos_sin)
    assert torch.equal(q, q2) and torch.equal(k, k2)          # rotated in place, unquantized
    assert torch.equal(_u8(k_cache[slots]), _u8(ref.quantize_fp8(k2, dtype, 1.5)))
    assert torch.equal(_u8(v_cache[slots]), _u8(ref.quantize_fp8(v, dtype, 0.75)))


# ----------------------------------------------------------------------------- (b) attention


def _fp8_pool(kv_lens: Sequence[int], hkv: int, d: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    nnz = sum(kv_lens)
    num_slots = nnz + nnz // 2 + 7
    k = ref.quantize_fp8(torch.randn(num_slots, hkv, d, generator=g) * 3, dtype, 0.8)
    v = ref.quantize_fp8(torch.randn(num_slots, hkv, d, generator=g), dtype, 0.05)
    kv_indices = (torch.randperm(num_slots, generator=g)[:nnz]).to(torch.int32)
    kv_indptr = torch.zeros(len(kv_lens) + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.tensor(kv_lens).cumsum(0)
    return k, v, kv_indptr, kv_indices


@pytest.mark.parametrize("dtype", FP8, ids=str)
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
def test_decode_attention_over_fp8_pages_is_dequantize_then_attend(dtype, qdtype):
    kv_lens, hq, hkv, d = [1, 17, 130, 5], 9, 3, 24
    k8, v8, indptr, indices = _fp8_pool(kv_lens, hkv, d, dtype, seed=2)
    q = torch.randn(len(kv_lens), hq, d).to(qdtype)
    got = ops.paged_decode_attention(q, k8, v8, indptr, indices, 0.2, 0.8, 0.05)
    want = ops.paged_decode_attention(q, ref.dequantize_fp8(k8, 0.8), ref.dequantize_fp8(v8, 0.05),
                                      indptr, indices, 0.2)
    assert got.dtype == qdtype and torch.equal(got, want)
    table = CpuDecodeAttention(indptr, indices)
    assert torch.equal(table(q.float(), k8, v8, 0.2, 0.8, 0.05),
                       ops.paged_decode_attention(q.float(), k8, v8, indptr, indices, 0.2, 0.8, 0.05))


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_extend_attention_over_fp8_pages_is_dequantize_then_attend(dtype):
    q_lens, prefix, hq, hkv, d = [7, 1, 33], [0, 40, 3], 8, 2, 16
    kv_lens = [a + b for a, b in zip(q_lens, prefix)]
    k8, v8, kv_indptr, indices = _fp8_pool(kv_lens, hkv, d, dtype, seed=3)
    qo_indptr = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qo_indptr[1:] = torch.tensor(q_lens).cumsum(0)
    q = torch.randn(sum(q_lens), hq, d)
    got = ops.paged_extend_attention(q, k8, v8, qo_indptr, kv_indptr, indices, 0.25, 0.8, 0.05)
    want = ops.paged_extend_attention(q, ref.dequantize_fp8(k8, 0.8), ref.dequantize_fp8(v8, 0.05),
                                      qo_indptr, kv_indptr, indices, 0.25)
    assert torch.equal(got, want)


def test_fp8_attention_in_tiles_matches_one_tile(monkeypatch):
    """A budget small enough to cut requests into head and row ranges: same values."""
    dtype = torch.float8_e4m3fn
    q_lens, prefix, hq, hkv, d = [70, 3, 129], [0, 200, 60], 8, 4, 32
    kv_lens = [a + b for a, b in zip(q_lens, prefix)]
    k8, v8, kv_indptr, indices = _fp8_pool(kv_lens, hkv, d, dtype, seed=4)
    qo_indptr = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qo_indptr[1:] = torch.tensor(q_lens).cumsum(0)
    q = torch.randn(sum(q_lens), hq, d)
    whole = ref.paged_extend_attention(q, k8, v8, qo_indptr, kv_indptr, indices, 0.2, 1.3, 0.1)
    monkeypatch.setattr(ref, "TILE_BYTES", 600_000)
    plan = ref.attention_plan(q_lens, kv_lens, hq, hkv, d, 1)
    assert len(plan) > len(q_lens)                      # really tiled
    tiled = ref.paged_extend_attention(q, k8, v8, qo_indptr, kv_indptr, indices, 0.2, 1.3, 0.1)
    assert torch.allclose(tiled, whole, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- (c) pool and flag


def test_pool_bytes_per_token_and_dtype():
    for dtype in FP8:
        pool = KVPool(10, 2, 3, 8, dtype, "cpu")
        assert pool.is_fp8 and pool.k_buffers[0].dtype == dtype and pool.k_buffers[0].shape == (11, 3, 8)
        assert pool.size_bytes == 10 * 2 * 2 * 3 * 8
    bf16 = KVPool.bytes_per_token(30, 3, 64, torch.bfloat16)
    assert bf16 == 2 * KVPool.bytes_per_token(30, 3, 64, torch.float8_e4m3fn)
    assert not KVPool(4, 1, 1, 8, torch.bfloat16, "cpu").is_fp8


def test_kv_cache_dtype_flag():
    from radixserve import cli

    def parse(*argv):
        return ServerArgs.from_cli_args(cli.build_parser().parse_args(["serve", *argv]))

    assert parse().kv_cache_dtype == "auto"
    assert parse().resolved_kv_cache_dtype() == parse().resolved_dtype()
    assert parse("--kv-cache-dtype", "fp8_e4m3").resolved_kv_cache_dtype() == torch.float8_e4m3fn
    assert parse("--kv-cache-dtype", "fp8_e5m2").resolved_kv_cache_dtype() == torch.float8_e5m2
    assert cli.main(["serve", "--kv-cache-dtype", "int8"]) == 2
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        ServerArgs(kv_cache_dtype="fp8").check()


def test_runner_pool_holds_more_tokens_in_fp8(make_scheduler, monkeypatch):
    """Sized from memory (no --max-total-tokens): the fp32 model's pool on the CPU takes 4 bytes
    a value, the FP8 pool 1, so the same budget holds 4x the tokens (2x a bf16 pool's)."""
    from radixserve.model import runner as runner_mod

    monkeypatch.setattr(runner_mod, "_cpu_available_bytes", lambda: 64 << 20)
    tokens = {}
    for kv in ("auto", "fp8_e4m3"):
        sched = make_scheduler(max_total_tokens=None, kv_cache_dtype=kv, max_running_requests=64,
                               context_length=4096)
        pool = sched.kv_pool
        tokens[kv] = pool.num_slots
        assert pool.dtype == (torch.float32 if kv == "auto" else torch.float8_e4m3fn)
    assert tokens["fp8_e4m3"] == pytest.approx(4 * tokens["auto"], abs=4)


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_scheduler_with_radix_cache_on_fp8_pool(make_scheduler, kv):
    from conftest import run_to_completion

    from radixserve.engine.req import Req
    from radixserve.sampling.params import SamplingParams

    sched = make_scheduler(kv_cache_dtype=kv)
    assert sched.kv_pool.is_fp8
    prefix = list(range(100, 140))
    sp = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    reqs = [Req(f"r{i}", prefix + [200 + i, 300 + i], sp, 6) for i in range(3)]
    run_to_completion(sched, reqs[:1])
    run_to_completion(sched, reqs[1:])                  # hits the first one's cached prefix
    assert all(len(r.output_ids) == 6 for r in reqs)
    # the same prompt again, now fully cached but its last token, gives the same tokens
    again = Req("again", list(reqs[0].origin_input_ids), sp, 6)
    run_to_completion(sched, [again])
    assert again.output_ids == reqs[0].output_ids


# ----------------------------------------------------------------------------- model runs


class MiniRunner:
    """A pool of any dtype (the cache under test), a token table, and ForwardBatch construction
    for EXTEND / DECODE steps over several requests."""

    def __init__(self, model, config: ModelConfig, kv_dtype: torch.dtype, num_slots: int = 8192,
                 max_reqs: int = 64, max_context: int = 512):
        self.model = model
        self.pool = KVPool(num_slots, config.num_hidden_layers, config.num_key_value_heads,
                           config.head_dim, kv_dtype, "cpu")
        self.req_to_token = ReqToTokenPool(max_reqs, max_context)
        self.seq_lens: dict = {}

    def new_request(self) -> int:
        row = self.req_to_token.alloc()
        self.seq_lens[row] = 0
        return row

    def step(self, rows: Sequence[int], new_ids: Sequence[Sequence[int]], mode: ForwardMode,
             all_logits: bool = False) -> torch.Tensor:
        lens = [len(ids) for ids in new_ids]
        slots = self.pool.alloc(sum(lens))
        positions, offset = [], 0
        for row, n in zip(rows, lens):
            start = self.seq_lens[row]
            self.req_to_token.write(row, start, slots[offset:offset + n])
            positions.append(torch.arange(start, start + n))
            self.seq_lens[row] = start + n
            offset += n
        seq_lens = torch.tensor([self.seq_lens[r] for r in rows], dtype=torch.int32)
        kv_indptr = torch.zeros(len(rows) + 1, dtype=torch.int32)
        kv_indices = torch.zeros(int(seq_lens.sum()), dtype=torch.int32)
        ops.build_kv_indices(self.req_to_token.req_to_token, torch.tensor(rows), seq_lens,
                             kv_indptr, kv_indices)
        qo_indptr = torch.zeros(len(rows) + 1, dtype=torch.int32)
        qo_indptr[1:] = torch.cumsum(torch.tensor(lens), 0)
        n = sum(lens)
        logits_indices = torch.arange(n) if all_logits else qo_indptr[1:].long() - 1
        fb = ForwardBatch(mode=mode, batch_size=len(rows),
                          input_ids=torch.tensor([t for ids in new_ids for t in ids]),
                          positions=torch.cat(positions), out_cache_loc=slots,
                          qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices,
                          seq_lens=seq_lens, logits_indices=logits_indices, kv_pool=self.pool)
        return self.model.compute_logits(self.model(fb)[fb.logits_indices]).float()


def _tiny_llama_checkpoint(path, scales: dict) -> None:
    """A tiny random Llama written by transformers, plus extra tensors (the KV-cache scales)."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False)
    hf = LlamaForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.15 * noise)
    hf.save_pretrained(path, safe_serialization=True)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    tensors.update({k: torch.tensor(v, dtype=torch.float32).reshape(s)
                    for k, (v, s) in scales.items()})
    save_file(tensors, file, metadata={"format": "pt"})


def test_checkpoint_kv_scales_reach_the_layers(tmp_path):
    from radixserve.model.llama import set_kv_cache_scales
    from radixserve.model.loader import load_model

    scales = {"model.layers.0.self_attn.k_scale": (0.5, ()),                 # compressed-tensors
              "model.layers.0.self_attn.v_scale": (0.25, (1,)),
              "model.layers.1.self_attn.k_proj.output_scale": (2.0, ()),       # older exports
              "model.layers.1.self_attn.v_proj.v_scale": (0.125, ())}          # ModelOpt
    _tiny_llama_checkpoint(str(tmp_path), scales)
    config = ModelConfig.from_path(str(tmp_path))
    model = load_model(str(tmp_path), config, "safetensors", torch.float32, "cpu")
    layers = [layer.self_attn for layer in model.model.layers]
    assert [(a.k_scale, a.v_scale) for a in layers] == [(1.0, 1.0), (1.0, 1.0)]   # not yet set
    assert set_kv_cache_scales(model) == 2
    assert [(a.k_scale, a.v_scale) for a in layers] == [(0.5, 0.25), (2.0, 0.125)]
    model.checkpoint_kv_scales["model.layers.0.self_attn.k_scale"] = float("nan")
    assert set_kv_cache_scales(model) == 2                   # layer 0 still has its v_scale
    assert layers[0].k_scale == 1.0


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_tiny_model_fp8_cache_close_to_fp32_cache(tmp_path, dtype):
    """Prefill, a chunk over the cached prefix and decode steps with the FP8 pool (and the
    checkpoint's scales) against the same steps with an fp32 pool."""
    from radixserve.model.llama import set_kv_cache_scales
    from radixserve.model.loader import load_model

    scales = {f"model.layers.{i}.self_attn.{w}_scale": (s, ())
              for i in range(2) for w, s in (("k", 0.05), ("v", 0.02))}
    _tiny_llama_checkpoint(str(tmp_path), scales)
    config = ModelConfig.from_path(str(tmp_path))
    model = load_model(str(tmp_path), config, "safetensors", torch.float32, "cpu")
    set_kv_cache_scales(model)
    out = {}
    for kv in (torch.float32, dtype):
        r = MiniRunner(model, config, kv, num_slots=512, max_reqs=4, max_context=128)
        rows = [r.new_request(), r.new_request()]
        logits = [r.step(rows, [[5, 9, 11, 3, 7], [2, 4]], ForwardMode.EXTEND, all_logits=True),
                  r.step(rows, [[8, 1, 1], [6]], ForwardMode.EXTEND, all_logits=True)]
        for t in range(4):
            logits.append(r.step(rows, [[10 + t], [20 + t]], ForwardMode.DECODE))
        out[kv] = torch.cat(logits)
    ref_logits, got = out[torch.float32], out[dtype]
    assert ref_logits.abs().max() > 0.5
    err = (got - ref_logits).abs().max().item()
    tol = 0.15 if dtype == torch.float8_e4m3fn else 0.3
    assert err < tol * ref_logits.abs().max().item(), err
    assert (got.argmax(-1) == ref_logits.argmax(-1)).float().mean() >= 0.8


# ----------------------------------------------------------------------------- (e) default model

_TOPICS = ["the ocean", "volcanoes", "the Roman Empire", "photosynthesis", "jazz music",
           "black holes", "the printing press", "honeybees", "chess", "the human heart",
           "electric cars", "the Great Wall of China", "rainforests", "the internet",
           "ancient Egypt", "mountain climbing"]
_FORMS = ["Write a short paragraph about {}.", "Explain {} to a ten-year-old.",
          "List three facts about {}:", "Here is a brief history of {}:"]


def _prompts(tokenizer, n: int) -> List[List[int]]:
    texts = [f.format(t) for f in _FORMS for t in _TOPICS][:n]
    return [tokenizer.encode_chat([{"role": "user", "content": text}]) for text in texts]


def teacher_forced_fp8_vs_bf16(model, config, prompts: List[List[int]], positions: int,
                               kv_dtype=torch.float8_e4m3fn) -> Tuple[float, float]:
    """The bf16 model run greedily with a bf16 cache (prefill, then positions - 1 decode steps),
    and again with the FP8 cache fed the same tokens (teacher forcing: its own choices are
    ignored). Returns (top-1 agreement, mean KL(bf16 cache || FP8 cache) in nats, top-1
    agreement up to ties) over every (prompt, position): the distributions of the continuation's
    positions tokens. The bf16 model's logits are bf16 values (steps of 0.125 at 16-32), so
    exact ties occur; "up to ties" also counts an FP8 choice whose bf16-cache logit equals the
    maximum."""
    def run(kv, forced=None):
        r = MiniRunner(model, config, kv, num_slots=sum(len(p) for p in prompts) +
                       len(prompts) * positions + 8, max_reqs=len(prompts),
                       max_context=max(len(p) for p in prompts) + positions + 1)
        rows = [r.new_request() for _ in prompts]
        logits = [r.step(rows, prompts, ForwardMode.EXTEND)]                  # [B, vocab]
        tokens = [forced[:, 0] if forced is not None else logits[-1].argmax(-1)]
        for i in range(1, positions):
            logits.append(r.step(rows, [[t] for t in tokens[-1].tolist()], ForwardMode.DECODE))
            tokens.append(forced[:, i] if forced is not None else logits[-1].argmax(-1))
        return torch.stack(logits, 1), torch.stack(tokens, 1)               # [B, positions, ...]

    base, teacher = run(torch.bfloat16)
    fp8, _ = run(kv_dtype, forced=teacher)
    choice = fp8.argmax(-1)
    agree = (choice == base.argmax(-1)).float().mean().item()
    tied = (base.gather(-1, choice[..., None])[..., 0] == base.max(-1).values).float().mean().item()
    lp, lq = torch.log_softmax(base, -1), torch.log_softmax(fp8, -1)
    kl = (lp.exp() * (lp - lq)).sum(-1).mean().item()
    return agree, kl, tied


@pytest.fixture(scope="module")
def bf16_default_model():
    from radixserve.model.default_model import default_model_path
    from radixserve.model.loader import load_model
    from radixserve.tokenizer.tokenizer import Tokenizer

    try:
        path = default_model_path()
    except Exception as e:   # no GGUF here and none to fetch: as the other real-weight tests
        pytest.skip(f"the default model's weights are not available: {e}")
    config = ModelConfig.from_path(path)
    return load_model(path, config, "auto", torch.bfloat16, "cpu"), config, Tokenizer.from_path(path)


def test_default_model_fp8_cache_agrees_with_bf16_cache(bf16_default_model):
    model, config, tokenizer = bf16_default_model
    agree, kl, tied = teacher_forced_fp8_vs_bf16(model, config, _prompts(tokenizer, 8), 16)
    print(f"fp8_e4m3 cache vs bf16 cache, 8 prompts x 16 positions: top-1 agreement "
          f"{agree:.4f} ({tied:.4f} up to ties), mean KL {kl:.5f} nats")
    assert kl <= 0.02, (agree, kl)
    assert agree >= 0.85, (agree, kl)        # a floor (91.4% measured), not the 98%


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("RADIXSERVE_ACCEPTANCE") != "1",
                    reason="the full acceptance run (64 prompts x 64 positions, twice, bf16 on "
                           "the CPU) takes many minutes on 2 CPU cores; set RADIXSERVE_ACCEPTANCE=1")
def test_acceptance_fp8_cache_64_prompts_64_positions(bf16_default_model):
    model, config, tokenizer = bf16_default_model
    agree, kl, tied = teacher_forced_fp8_vs_bf16(model, config, _prompts(tokenizer, 64), 64)
    print(f"fp8_e4m3 cache vs bf16 cache, 64 prompts x 64 positions: top-1 agreement "
          f"{agree:.4f} ({tied:.4f} up to ties), mean KL {kl:.5f} nats")
    assert kl <= 0.02, (agree, kl)
    assert agree >= 0.98, (agree, kl)   # the bound: 95.4% measured on this model
