"""Tensor parallelism on CUDA (issue 37): NCCL made in this process through ctypes
(parallel/nccl.py) and the model split over local GPUs (model/tensor_parallel.py).

On one GPU: the library loads, a one-rank communicator all-reduces and all-gathers (identity
and copy), eagerly and captured inside a CUDA graph (how the decode graphs will hold them),
with the result checked after replays on new inputs; the TP machinery over ONE rank (a
TensorParallelModel of one shard on an NcclGroup of GPU 0: the sharded KV pool, the rank
streams, the per-GPU decode graphs with the input broadcast and the LM-head gather inside)
gives the same greedy ids as the plain model, graphs and eager. On two or more GPUs (issue 42's machine):
a tiny random Llama and Qwen3 in float32 with --tp-size 2 give the same logits as --tp-size 1
(1e-3) and the offline Engine the same greedy ids.
"""
import pytest
import torch

from radixserve.parallel.nccl import Nccl

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
requires_2 = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@requires_cuda
def test_one_rank_nccl_eager_and_in_a_graph():
    nccl = Nccl.get()
    assert nccl.version() == ".".join(map(str, torch.cuda.nccl.version()))
    [comm] = nccl.init_all([0])
    try:
        x = torch.randn(3, 4096, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(x)
        nccl.all_reduce(x, out, comm, torch.cuda.current_stream().cuda_stream)
        torch.testing.assert_close(out, x, rtol=0, atol=0)
        gathered = torch.empty(1, 3, 4096, device="cuda", dtype=torch.bfloat16)
        nccl.all_gather(x, gathered, comm, torch.cuda.current_stream().cuda_stream)
        torch.testing.assert_close(gathered[0], x, rtol=0, atol=0)

        static_in = torch.zeros(8, 512, device="cuda")
        static_out = torch.zeros_like(static_in)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            with torch.cuda.graph(graph, stream=stream):
                y = static_in * 2
                nccl.all_reduce(y, static_out, comm, stream.cuda_stream)
        torch.cuda.current_stream().wait_stream(stream)
        for seed in range(3):
            static_in.copy_(torch.randn(8, 512, device="cuda",
                                        generator=torch.Generator("cuda").manual_seed(seed)))
            graph.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(static_out, static_in * 2, rtol=0, atol=0)
    finally:
        nccl.destroy(comm)


def _greedy(path, model, prompts, graphs: bool, tp_size=None, dtype="bfloat16",
            new_tokens=16, chunk=32):
    """(scheduler, greedy ids of prompts) through the scheduler on CUDA; model None: loaded
    from path with tp_size ranks."""
    from radixserve.config import ModelConfig, ServerArgs
    from radixserve.engine.req import Req
    from radixserve.engine.scheduler import Scheduler
    from radixserve.model.runner import ModelRunner
    from radixserve.sampling.params import SamplingParams

    sa = ServerArgs(model_path=path, device="cuda", dtype=dtype, max_total_tokens=2048,
                    max_running_requests=8, context_length=256, chunked_prefill_size=chunk,
                    tp_size=tp_size or getattr(model, "tp_size", 1),
                    disable_cuda_graph=not graphs)
    sched = Scheduler(sa, ModelRunner(sa, ModelConfig.from_path(path), path, context_len=256,
                                      model=model))
    reqs = [Req(f"r{i}", p, SamplingParams(max_new_tokens=new_tokens, temperature=0.0,
                                             ignore_eos=True), new_tokens)
            for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add_request(r)
    steps = 0
    while sched.has_work():
        sched.step()
        steps += 1
        assert steps < 500
    return sched, [r.output_ids for r in reqs]


@requires_cuda
def test_one_rank_tp_graphs_equal_the_plain_model(tmp_path_factory):
    from radixserve.cache.kv_pool import ShardedKVPool
    from radixserve.config import ModelConfig
    from radixserve.model.cuda_graph_runner import TPCudaGraphRunner
    from radixserve.model.loader import load_model, load_model_shards
    from radixserve.model.tensor_parallel import TensorParallelModel
    from radixserve.ops._ext import kernels_available

    if not kernels_available():
        pytest.skip("needs radixserve._C (the graphs need the kernels)")
    path = _tiny(tmp_path_factory, "llama", head_dim=64)
    config = ModelConfig.from_path(path)
    gen = torch.Generator().manual_seed(7)
    shared = torch.randint(3, 90, (40,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, 90, (k,), generator=gen).tolist() for k in (9, 2, 30)]
    plain = load_model(path, config, "safetensors", torch.bfloat16, "cuda")
    [shard] = load_model_shards(path, config, "safetensors", torch.bfloat16,
                                [torch.device("cuda", 0)])
    tp = TensorParallelModel([shard], single_ok=True)
    assert tp.group.backend == "nccl"
    _, want = _greedy(path, plain, prompts, graphs=True)
    sched, got = _greedy(path, tp, prompts, graphs=True)
    assert isinstance(sched.runner.graph_runner, TPCudaGraphRunner)
    assert isinstance(sched.runner.kv_pool, ShardedKVPool)
    assert got == want
    _, eager = _greedy(path, tp, prompts, graphs=False)
    assert eager == want


def _tiny(path_factory, arch: str, head_dim: int = 32) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    common = dict(hidden_size=4 * head_dim, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if arch == "llama":
        hf = LlamaForCausalLM(LlamaConfig(vocab_size=97, tie_word_embeddings=False, **common))
    else:
        hf = Qwen3ForCausalLM(Qwen3Config(vocab_size=103, head_dim=head_dim,
                                          tie_word_embeddings=True, **common))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else noise / p.shape[-1] ** 0.5)
    path = path_factory.mktemp(arch)
    hf.save_pretrained(path, safe_serialization=True)
    return str(path)


@requires_2
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tp2_scheduler_greedy_equals_tp1(tmp_path_factory, arch):
    """The scheduler end to end (radix cache, chunked prefill) in float32 on GPUs 0 and 1:
    greedy ids under --tp-size 2 equal --tp-size 1's; the KV pool is sharded over both GPUs."""
    from radixserve.cache.kv_pool import ShardedKVPool

    path = _tiny(tmp_path_factory, arch)
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 90, (40,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, 90, (k,), generator=gen).tolist() for k in (10, 3, 7)]
    outs = {}
    for tp in (1, 2):
        sched, outs[tp] = _greedy(path, None, prompts, graphs=False, tp_size=tp,
                                  dtype="float32", new_tokens=12, chunk=24)
        if tp == 2:
            assert isinstance(sched.runner.kv_pool, ShardedKVPool)
            assert [s.device.index for s in sched.runner.kv_pool.shards] == [0, 1]
    assert outs[2] == outs[1]


@requires_2
def test_tp2_decode_graphs_equal_tp2_eager(tmp_path_factory):
    """bf16 on GPUs 0 and 1: the per-GPU decode graphs (all-reduces, input broadcast and
    LM-head gather captured) give the ids the eager TP=2 steps give."""
    from radixserve.config import ModelConfig
    from radixserve.model.cuda_graph_runner import TPCudaGraphRunner
    from radixserve.model.tensor_parallel import load_tp_model

    path = _tiny(tmp_path_factory, "llama", head_dim=64)
    config = ModelConfig.from_path(path)
    tp = load_tp_model(path, config, "safetensors", torch.bfloat16, torch.device("cuda", 0), 2)
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 90, (k,), generator=gen).tolist() for k in (12, 40, 3)]
    sched, graphs = _greedy(path, tp, prompts, graphs=True)
    assert isinstance(sched.runner.graph_runner, TPCudaGraphRunner)
    _, eager = _greedy(path, tp, prompts, graphs=False)
    assert graphs == eager

