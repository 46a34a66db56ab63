"""Tensor parallelism on the CPU (issue 37, point 4): the same code as tp_size 1 split over N
rank threads of this one process (parallel/group.py, model/tensor_parallel.py).

(a) Logits: tiny random Llama (llama3 rope, GQA 4 q / 2 KV heads, untied LM head) and Qwen3
    (q/k norms, head_dim != hidden / heads, tied embeddings), checkpoints written by
    transformers, loaded sharded: TP=2 and TP=4 (KV heads replicated: 2 < 4) logits equal
    TP=1's within 1e-4 in fp32 for a 2-request prefill of different lengths, an extend over a
    cached prefix (chunked prefill) and batched decode steps; each rank's KV shard holds its
    heads of TP=1's KV at the same (global) slots.
(b) The scheduler end to end (ModelRunner + Scheduler: radix cache, chunked prefill, mixed
    chunks) and the offline Engine (overlap pipeline, a regex-constrained request): greedy
    outputs under TP=2 / TP=4 equal TP=1's.
(c) The group: rank-order fp32 sums, a failing rank neither hangs the others nor breaks the
    next step; CUDA ranks need distinct GPUs, as many as --tp-size; --tp-size checks; NCCL's
    library loads here (the same version torch reports); dummy weights shard;
    the TP presets' shapes.
"""
from typing import List, Sequence

import pytest
import torch

from radixserve import ops
from radixserve.cache.kv_pool import KVPool, ReqToTokenPool, ShardedKVPool
from radixserve.config import ModelConfig, ServerArgs
from radixserve.model.forward_batch import ForwardBatch, ForwardMode
from radixserve.model.loader import load_model
from radixserve.model.tensor_parallel import TensorParallelModel, check_tp_size, load_tp_model
from radixserve.parallel import group as tp_group


# ----------------------------------------------------------------------------- tiny checkpoints


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights with O(1) logits (as test_model_parity), so that 1e-4 means something."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.15 * noise)


def _tiny_llama(vocab_size: int = 97):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 64})
    return LlamaForCausalLM(cfg)


def _tiny_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=103, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      max_position_embeddings=256, tie_word_embeddings=True, rms_norm_eps=1e-6,
                      rope_theta=1000000.0)
    return Qwen3ForCausalLM(cfg)


TINY = {"llama": _tiny_llama, "qwen3": _tiny_qwen3}


def _save(hf, path) -> str:
    _randomize(hf.eval(), seed=1)
    hf.save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory):
    torch.manual_seed(0)
    return {name: _save(make(), tmp_path_factory.mktemp(name)) for name, make in TINY.items()}


@pytest.fixture(scope="module")
def tiny_models(tiny_paths):
    """{(name, tp): model} for tp 1, 2 and 4, loaded from the same checkpoint (sharded)."""
    out = {}
    for name, path in tiny_paths.items():
        config = ModelConfig.from_path(path)
        out[(name, 1)] = load_model(path, config, "safetensors", torch.float32, "cpu")
        for tp in (2, 4):
            out[(name, tp)] = load_tp_model(path, config, "safetensors", torch.float32,
                                            torch.device("cpu"), tp)
    return out


# ----------------------------------------------------------------------------- (a) logits


class Driver:
    """A KV pool (sharded for a TensorParallelModel), a token-to-slot table and ForwardBatch
    construction, as tests/unit/test_model_parity.MiniRunner."""

    def __init__(self, model, config: ModelConfig, num_slots: int = 512):
        self.model, self.config = model, config
        if isinstance(model, TensorParallelModel):
            self.pool = model.make_kv_pool(num_slots, torch.float32)
        else:
            self.pool = KVPool(num_slots, config.num_hidden_layers, config.num_key_value_heads,
                               config.head_dim, torch.float32, "cpu")
        self.req_to_token = ReqToTokenPool(4, 256)
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
        logits_indices = (torch.arange(sum(lens)) if all_logits else qo_indptr[1:].long() - 1)
        fb = ForwardBatch(mode, len(rows), torch.tensor([t for ids in new_ids for t in ids]),
                          torch.cat(positions), slots, qo_indptr, kv_indptr, kv_indices, seq_lens,
                          logits_indices, self.pool)
        hidden = self.model(fb)[fb.logits_indices]
        return self.model.compute_logits(hidden)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == torch.float32
    assert want.abs().max() > 0.5, "logits too small for 1e-4 to mean something"
    diff = (got - want).abs().max().item()
    assert diff < 1e-4, f"max abs logit difference {diff}"


def _run_script(model, config) -> List[torch.Tensor]:
    """Prefill of two lengths, an extend over a cached prefix, batched decode steps: the logits."""
    gen = torch.Generator().manual_seed(3)
    a = torch.randint(0, config.vocab_size, (40,), generator=gen).tolist()
    b = torch.randint(0, config.vocab_size, (9,), generator=gen).tolist()
    d = Driver(model, config)
    ra, rb = d.new_request(), d.new_request()
    out = [d.step([ra, rb], [a[:30], b], ForwardMode.EXTEND, all_logits=True),
           d.step([ra], [a[30:]], ForwardMode.EXTEND, all_logits=True)]   # over the cached 30
    nxt = [out[-1][-1].argmax().item(), out[0][-1].argmax().item()]
    for _ in range(4):
        logits = d.step([ra, rb], [[nxt[0]], [nxt[1]]], ForwardMode.DECODE)
        out.append(logits)
        nxt = logits.argmax(-1).tolist()
    out.append(d)
    return out


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", sorted(TINY))
def test_tp_logits_equal_tp1(tiny_models, tiny_paths, name, tp):
    config = ModelConfig.from_path(tiny_paths[name])
    assert config.num_key_value_heads == 2          # tp 4: each KV head on 2 ranks
    *ref, ref_driver = _run_script(tiny_models[(name, 1)], config)
    *got, driver = _run_script(tiny_models[(name, tp)], config)
    for g, r in zip(got, ref):
        _close(g, r)
    # each rank's shard holds its KV heads of TP=1's pool, at the same global slots
    pool = driver.pool
    assert isinstance(pool, ShardedKVPool) and len(pool.shards) == tp
    assert pool.available_size() == ref_driver.pool.available_size()
    used = torch.arange(1, 512 - pool.available_size() + 1)
    for rank, shard in enumerate(pool.shards):
        head = rank // max(1, tp // config.num_key_value_heads)
        assert shard.k_buffers[0].shape[1] == 1
        for layer in range(config.num_hidden_layers):
            for mine, full in ((shard.k_buffers[layer], ref_driver.pool.k_buffers[layer]),
                               (shard.v_buffers[layer], ref_driver.pool.v_buffers[layer])):
                torch.testing.assert_close(mine[used, 0], full[used, head], rtol=0, atol=1e-4)


def test_tp_shards_hold_only_their_slices(tiny_models):
    one, four = tiny_models[("llama", 1)], tiny_models[("llama", 4)]
    total = sum(p.numel() for p in one.parameters())
    for shard in four.shards:
        n = sum(p.numel() for p in shard.parameters())
        assert n < total / 2.5                      # replicated: norms only (and K/V heads)
    attn = four.shards[3].model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (1, 1)
    # rank 3's q head is TP=1's head 3, its KV head TP=1's KV head 1 (replicated on ranks 2, 3)
    w1 = one.model.layers[0].self_attn.qkv_proj.weight          # [(4 + 2 + 2) * 16, 64]
    w4 = attn.qkv_proj.weight                                   # [(1 + 1 + 1) * 16, 64]
    assert torch.equal(w4[:16], w1[48:64])
    assert torch.equal(w4[16:32], w1[64 + 16:64 + 32])
    assert torch.equal(w4[32:], w1[96 + 16:96 + 32])


# ----------------------------------------------------------------------------- (b) end to end


def _scheduler(path: str, model, tp: int, **overrides):
    from radixserve.engine.scheduler import Scheduler
    from radixserve.model.runner import ModelRunner

    kw = dict(model_path=path, device="cpu", max_total_tokens=1024, max_running_requests=8,
              context_length=256, tp_size=tp, chunked_prefill_size=24)
    kw.update(overrides)
    args = ServerArgs(**kw)
    args.check()
    runner = ModelRunner(args, ModelConfig.from_path(path), path, context_len=256, model=model)
    return Scheduler(args, runner)


def _greedy_through_scheduler(sched, prompts, n, arrivals_at=3):
    from radixserve.engine.req import Req
    from radixserve.sampling.params import SamplingParams

    sp = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    reqs = [Req(f"r{i}", p, sp, n) for i, p in enumerate(prompts)]
    late = reqs[len(reqs) // 2:]                 # these arrive while the first ones decode
    for r in reqs[:len(reqs) // 2]:
        sched.add_request(r)
    steps = 0
    while sched.has_work() or late:
        if steps == arrivals_at:
            for r in late:
                sched.add_request(r)
            late = []
        sched.step()
        sched.check_integrity()
        steps += 1
        assert steps < 500
    return [r.output_ids for r in reqs], [r.cached_tokens for r in reqs]


@pytest.mark.parametrize("mixed", [False, True])
def test_scheduler_greedy_equals_tp1(tiny_models, tiny_paths, mixed):
    """Radix cache (shared prefixes), chunked prefill (24-token chunks of 50-token prompts),
    requests arriving mid-decode (mixed chunks with --enable-mixed-chunk)."""
    path = tiny_paths["llama"]
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 97, (40,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, 97, (k,), generator=gen).tolist() for k in (10, 3, 7, 12)]
    outs = {}
    for tp in (1, 2, 4):
        sched = _scheduler(path, tiny_models[("llama", tp)], tp, enable_mixed_chunk=mixed)
        outs[tp] = _greedy_through_scheduler(sched, prompts, 12)
    assert outs[2] == outs[1] and outs[4] == outs[1]
    assert max(outs[1][1]) >= 40                    # the shared prefix came from the radix cache


@pytest.fixture(scope="module")
def engine_model_path(tmp_path_factory, default_model_path):
    """A tiny random Llama over the default model's vocabulary, whose tokenizer it uses."""
    torch.manual_seed(0)
    return _save(_tiny_llama(vocab_size=49152), tmp_path_factory.mktemp("tiny-49152"))


def test_offline_engine_greedy_equals_tp1(engine_model_path, default_model_path):
    """The offline Engine (overlap pipeline, prefill-first) with --tp-size 2 and 4 (sharded
    load from safetensors), also a regex-constrained request (the grammar slot and
    jump-forward): the same greedy outputs as --tp-size 1."""
    from radixserve import Engine

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
               "List three colors:"]
    greedy = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    constrained = {"max_new_tokens": 12, "temperature": 0, "regex": r"(yes|no), [0-9]{2,4}!"}
    outs = {}
    for tp in (1, 2, 4):
        engine = Engine(engine_model_path, tokenizer_path=default_model_path, device="cpu",
                        max_total_tokens=2048, max_running_requests=8, context_length=256,
                        tp_size=tp)
        try:
            runner = engine.async_engine.runner
            assert getattr(runner.model, "tp_size", 1) == tp
            got = engine.generate(prompts, greedy)
            regex = engine.generate("Answer:", constrained)
        finally:
            engine.shutdown()
        outs[tp] = ([o["output_ids"] for o in got], regex["text"])
    assert all(len(ids) == 10 for ids in outs[1][0])
    assert outs[2] == outs[1] and outs[4] == outs[1]
    import re
    assert re.fullmatch(r"(yes|no), [0-9]{2,4}!", outs[1][1])


# ----------------------------------------------------------------------------- (c) pieces


def test_thread_group_sums_in_rank_order_and_survives_a_failing_rank():
    group = tp_group.ThreadGroup(3, timeout_s=20)
    workers = tp_group.RankWorkers(group)
    parts = [torch.tensor([1e8, 1.0]), torch.tensor([1.0, 2.0]), torch.tensor([-1e8, 3.0])]

    def step(r):
        x = parts[r].clone()
        s = tp_group.all_reduce(x, 3)
        assert torch.equal(x, parts[r])                       # never written in place
        g = tp_group.gather_last_dim(x, 3)
        return s, g

    results = workers.run(step)
    want = (parts[0] + parts[1]) + parts[2]                  # rank order: 1e8 + 1 rounds to 1e8
    for s, _ in results:
        assert torch.equal(s, want)
    assert torch.equal(results[0][1], torch.cat(parts)) and results[1][1] is None

    def failing(r):
        if r == 1:
            raise ValueError("rank 1 rejects its input")
        return tp_group.all_reduce(parts[r], 3)             # the others wait for rank 1

    with pytest.raises(ValueError, match="rank 1 rejects"):
        workers.run(failing)
    assert torch.equal(workers.run(step)[2][0], want)          # the group works again
    with pytest.raises(RuntimeError, match="outside its rank's thread"):
        tp_group.all_reduce(parts[0], 3)
    workers.close()


def test_cuda_and_bad_sizes_are_refused(tiny_paths):
    with pytest.raises(ValueError, match="one GPU per rank, distinct"):
        tp_group.make_group([torch.device("cuda", 0), torch.device("cuda", 0)])
    with pytest.raises(ValueError, match="must all be CPU or all CUDA"):
        tp_group.make_group([torch.device("cpu"), torch.device("cuda", 0)])
    ServerArgs(tp_size=4, device="cpu").check()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    n = gpus + 2                                    # more GPUs than this host has, and > 1
    with pytest.raises(ValueError, match=f"--tp-size {n} needs {n} GPUs \\(one per "
                                         f"rank\\); this host has {gpus}"):
        ServerArgs(tp_size=n, device="cuda").check()
    config = ModelConfig.from_path(tiny_paths["llama"])
    with pytest.raises(ValueError, match="--tp-size 3 does not fit LlamaForCausalLM: its 4 "
                                         "attention heads are not divisible by 3"):
        check_tp_size(config, 3)
    with pytest.raises(ValueError, match=f"--tp-size {n} needs GPUs 0..{n - 1}, but this "
                                         f"host has {gpus}"):
        load_tp_model(tiny_paths["llama"], config, "dummy", torch.float32, torch.device("cuda"), n)


def test_nccl_library_loads_and_checks_its_arguments():
    from radixserve.parallel.nccl import Nccl, NcclError

    nccl = Nccl.get()
    assert nccl.version() == ".".join(map(str, torch.cuda.nccl.version()))
    with pytest.raises(NcclError, match="distinct GPUs"):
        nccl.init_all([0, 0])
    with pytest.raises(NcclError, match="no type for torch.complex64"):
        nccl.all_reduce(torch.zeros(2, dtype=torch.complex64), torch.zeros(2), 0, 0)


def test_dummy_weights_shard(tiny_paths):
    path = tiny_paths["qwen3"]
    config = ModelConfig.from_path(path)
    model = load_tp_model(path, config, "dummy", torch.float32, torch.device("cpu"), 2)
    a, b = (dict(s.named_parameters()) for s in model.shards)
    for name in a:
        if "norm" in name or name.endswith("o_proj.bias"):
            assert torch.equal(a[name], b[name]), name          # whole on every rank: equal
    logits = _run_script(model, config)[0]
    assert torch.isfinite(logits).all() and logits.shape[1] == config.vocab_size


@pytest.mark.parametrize("name,params", [("llama-3.1-70b", 70_553_706_496),
                                         ("qwen3-32b", 32_762_123_264)])
def test_tp_presets(name, params):
    """The TP bench presets have the published shapes and split 8 ways (each rank ~1/8)."""
    from radixserve.bench import presets
    from radixserve.model.llama import get_model_class

    preset = presets.PRESETS[name]
    assert preset.num_params == params
    cfg = ModelConfig.from_dict(preset.config)
    check_tp_size(cfg, 8)
    with torch.device("meta"):
        whole = get_model_class(cfg.architecture)(cfg, params_dtype=torch.bfloat16)
        shard = get_model_class(cfg.architecture)(cfg, params_dtype=torch.bfloat16, tp_rank=7,
                                                  tp_size=8)
    assert sum(p.numel() for p in whole.parameters()) == params
    per_rank = sum(p.numel() for p in shard.parameters())
    assert params / 8 < per_rank < params / 8 * 1.01
