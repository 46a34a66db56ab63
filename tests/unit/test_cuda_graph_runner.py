"""CPU-side parts of the CUDA graph runner: bucket sizes and when graphs are (not) used.
The graphs themselves are tested on a GPU in tests/gpu/test_cuda_graph.py."""
from radixserve.model.cuda_graph_runner import batch_buckets


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(5) == [1, 2, 4, 5]
    b = batch_buckets(160)
    assert b[:6] == [1, 2, 4, 8, 16, 24] and b[-1] == 160 and b == sorted(set(b))
    assert batch_buckets(256)[-3:] == [192, 224, 256]
    for n in (3, 37, 100, 255):
        assert all(x <= n for x in batch_buckets(n)) and batch_buckets(n)[-1] == n


def test_cpu_runner_has_no_graphs(tmp_path):
    import json

    from radixserve.config import ModelConfig, ServerArgs
    from radixserve.model.runner import ModelRunner

    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
           "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
           "num_key_value_heads": 1, "max_position_embeddings": 64, "rms_norm_eps": 1e-5}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    args = ServerArgs(model_path=str(tmp_path), load_format="dummy", device="cpu",
                      max_total_tokens=128, max_running_requests=4)
    r = ModelRunner(args, ModelConfig.from_path(str(tmp_path)), str(tmp_path))
    assert r.graph_runner is None
