"""CPU-side parts of the CUDA graph runner: bucket sizes and when graphs are (not) used.
The graphs themselves are tested on a GPU in tests/gpu/test_cuda_graph.py."""
from radixserve.model.cuda_graph_runner import (CLASS_BUCKET_MAX, CONTEXT_CLASSES, batch_buckets,
                                                capacity_for, context_capacities)


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(5) == [1, 2, 4, 5]
    b = batch_buckets(160)
    assert b[:6] == [1, 2, 4, 8, 16, 24] and b[-1] == 160 and b == sorted(set(b))
    assert batch_buckets(256)[-3:] == [192, 224, 256]
    for n in (3, 37, 100, 255):
        assert all(x <= n for x in batch_buckets(n)) and batch_buckets(n)[-1] == n


def test_context_capacities_and_the_choice_among_them():
    small, full = CONTEXT_CLASSES[0], 131073
    caps = context_capacities(1, full)
    assert caps == sorted(caps) and caps[-1] == full and caps[0] == small
    assert context_capacities(CLASS_BUCKET_MAX + 1, full) == [full]       # one graph per large bucket
    assert context_capacities(1, small) == [small]                     # no class at or past the context
    assert context_capacities(1, full, classes=()) == [full]
    assert capacity_for(caps, 1) == small and capacity_for(caps, small) == small
    assert capacity_for(caps, small + 1) == caps[1]
    assert capacity_for(caps, full) == full and capacity_for(caps, None) == full
    # every choice holds the batch: no request longer than its graph's capacity
    for n in (1, small - 1, small, small + 1, 1024, 1025, full):
        assert capacity_for(caps, n) >= n


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
