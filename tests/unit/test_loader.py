"""Weight loading: sharded safetensors, dummy weights, errors; resolve_model_path and the
once-only, atomic GGUF conversion cache (with a stand-in converter: no download here)."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixserve import ops
from radixserve.cache.kv_pool import KVPool
from radixserve.config import ModelConfig
from radixserve.model import default_model, gguf_convert
from radixserve.model.forward_batch import ForwardBatch, ForwardMode
from radixserve.model.loader import load_model, resolve_model_path
from radixserve.model.rope import build_cos_sin_cache

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 120,
    "hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "eos_token_id": 2,
}


def _prefill_logits(model, config: ModelConfig, ids) -> torch.Tensor:
    """One request, one EXTEND pass; logits of every token [len(ids), vocab]."""
    n = len(ids)
    pool = KVPool(64, config.num_hidden_layers, config.num_key_value_heads, config.head_dim,
                  torch.float32, "cpu")
    slots = pool.alloc(n)
    fb = ForwardBatch(mode=ForwardMode.EXTEND, batch_size=1, input_ids=torch.tensor(ids),
                      positions=torch.arange(n), out_cache_loc=slots,
                      qo_indptr=torch.tensor([0, n], dtype=torch.int32),
                      kv_indptr=torch.tensor([0, n], dtype=torch.int32),
                      kv_indices=slots.to(torch.int32), seq_lens=torch.tensor([n], dtype=torch.int32),
                      logits_indices=torch.arange(n), kv_pool=pool)
    return model.compute_logits(model(fb))


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A tiny Llama saved by transformers twice: one file, and sharded with an index."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in TINY_CONFIG.items()
                                         if k not in ("architectures", "model_type")}))
    single = tmp_path_factory.mktemp("single")
    sharded = tmp_path_factory.mktemp("sharded")
    hf.save_pretrained(single, safe_serialization=True)
    hf.save_pretrained(sharded, safe_serialization=True, max_shard_size="40KB")
    return single, sharded


def _load(path, load_format="auto"):
    config = ModelConfig.from_path(str(path))
    return load_model(str(path), config, load_format, torch.float32, "cpu"), config


def test_sharded_equals_single_file(tiny_checkpoint):
    single, sharded = tiny_checkpoint
    assert os.path.isfile(sharded / "model.safetensors.index.json")
    assert len(list(sharded.glob("*.safetensors"))) > 1
    a, config = _load(single)
    b, _ = _load(sharded)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name
    # the fused q|k|v rows are the HF q, k, v rows in order
    hf = load_file(str(single / "model.safetensors"))
    qkv = a.model.layers[1].self_attn.qkv_proj.weight
    expected = torch.cat([hf[f"model.layers.1.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(qkv, expected)
    assert not a.model.embed_tokens.weight.requires_grad


def test_dummy_weights_from_config_alone(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    model, config = _load(tmp_path, "dummy")
    assert sorted(os.listdir(tmp_path)) == ["config.json"]
    logits = _prefill_logits(model, config, [5, 6, 7, 8])
    assert logits.shape == (4, TINY_CONFIG["vocab_size"]) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all() and logits.abs().max() > 0
    weight = model.model.layers[0].mlp.down_proj.weight
    assert 0.01 < weight.std().item() < 0.04          # normal(0, 0.02)-ish, not zeros or ones


def test_missing_tensor_is_reported(tiny_checkpoint, tmp_path):
    single, _ = tiny_checkpoint
    tensors = load_file(str(single / "model.safetensors"))
    del tensors["model.layers.0.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((single / "config.json").read_text())
    with pytest.raises(ValueError, match="gate_up_proj"):
        _load(tmp_path)


def test_unexpected_tensor_is_reported(tiny_checkpoint, tmp_path):
    single, _ = tiny_checkpoint
    tensors = load_file(str(single / "model.safetensors"))
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((single / "config.json").read_text())
    with pytest.raises(ValueError, match="mlp.extra.weight"):
        _load(tmp_path)


def test_no_weights_and_bad_format(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        _load(tmp_path)
    with pytest.raises(ValueError, match="load format"):
        _load(tmp_path, "pickle")


def test_unknown_architecture_names_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**TINY_CONFIG, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="LlamaForCausalLM.*MistralForCausalLM.*Qwen2ForCausalLM"):
        _load(tmp_path, "dummy")


def test_unsupported_rope_scaling(tmp_path):
    cfg = {**TINY_CONFIG, "rope_scaling": {"rope_type": "longrope", "factor": 4.0}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="longrope"):
        _load(tmp_path, "dummy")


def test_linear_rope_scaling_divides_frequencies():
    plain = build_cos_sin_cache(16, 64, 10000.0, None)
    linear = build_cos_sin_cache(16, 64, 10000.0, {"rope_type": "linear", "factor": 4.0})
    assert plain.shape == (64, 16)
    # position 8 with factor 4 rotates like position 2 without scaling
    assert torch.allclose(linear[8], plain[2], atol=1e-6)


# ----------------------------------------------------------------------------- model paths


def test_resolve_model_path_directory_and_errors(tiny_checkpoint, tmp_path):
    single, _ = tiny_checkpoint
    assert resolve_model_path(str(single)) == str(single)
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model_path(str(tmp_path))
    with pytest.raises(ValueError, match="neither a directory"):
        resolve_model_path(str(tmp_path / "missing"))


def _fake_converter(calls):
    def convert(gguf_path, out_dir):
        calls.append((gguf_path, out_dir))
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(TINY_CONFIG, f)
        return out_dir
    return convert


def test_gguf_path_converted_once_into_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(cache))
    calls = []
    monkeypatch.setattr(gguf_convert, "convert_gguf", _fake_converter(calls))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF-stand-in")
    first = resolve_model_path(str(gguf))
    second = resolve_model_path(str(gguf))
    assert first == second and first.startswith(str(cache))
    assert os.path.isfile(os.path.join(first, "config.json"))
    assert len(calls) == 1 and calls[0][0] == str(gguf)
    assert calls[0][1] != first                 # converted in a temporary dir, then renamed
    assert not [p for p in os.listdir(cache) if p.startswith(".convert-")]


def test_failed_conversion_leaves_nothing(tmp_path, monkeypatch):
    def broken(gguf_path, out_dir):
        with open(os.path.join(out_dir, "partial"), "w") as f:
            f.write("x")
        raise RuntimeError("conversion failed")

    monkeypatch.setattr(gguf_convert, "convert_gguf", broken)
    out = tmp_path / "model"
    with pytest.raises(RuntimeError):
        default_model.convert_cached(str(tmp_path / "x.gguf"), str(out))
    assert not out.exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".convert-")]


def test_default_model_uses_installed_distribution(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    installed = tmp_path / "site" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    monkeypatch.setattr(default_model, "_installed_gguf", lambda: str(installed))

    def no_download(root):
        raise AssertionError("must not download when the distribution is installed")

    monkeypatch.setattr(default_model, "_downloaded_gguf", no_download)
    calls = []
    monkeypatch.setattr(gguf_convert, "convert_gguf", _fake_converter(calls))
    path = default_model.default_model_path()
    assert path == str(tmp_path / "SmolLM2-135M-Instruct")
    assert calls[0][0] == str(installed)
    assert default_model.default_model_path() == path and len(calls) == 1


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "a"))
    assert default_model.cache_dir() == str(tmp_path / "a")
    monkeypatch.delenv("RADIXSERVE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_model.cache_dir() == str(tmp_path / "xdg" / "radixserve")


def test_default_conversion_matches_gguf_tensors(default_model_path, default_gguf_path):
    """The converted default model holds the GGUF's weights: dequantized independently here
    with the gguf package, Q/K rows un-permuted from llama.cpp's rotary layout."""
    import gguf
    import numpy as np
    from safetensors import safe_open

    reader = gguf.GGUFReader(default_gguf_path)
    tensors = {t.name: t for t in reader.tensors}
    config = ModelConfig.from_path(default_model_path)

    def dequantized(name):
        t = tensors[name]
        return torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))

    def unpermute(w, heads):
        # llama.cpp stores each head's rows as interleaved pairs; HF keeps the two halves apart
        return w.reshape(heads, w.shape[0] // heads // 2, 2, w.shape[1]).transpose(1, 2).reshape(w.shape)

    layer = config.num_hidden_layers - 1
    pairs = [
        ("token_embd.weight", "model.embed_tokens.weight", None),
        (f"blk.{layer}.attn_q.weight", f"model.layers.{layer}.self_attn.q_proj.weight",
         config.num_attention_heads),
        (f"blk.{layer}.attn_k.weight", f"model.layers.{layer}.self_attn.k_proj.weight",
         config.num_key_value_heads),
        (f"blk.{layer}.attn_v.weight", f"model.layers.{layer}.self_attn.v_proj.weight", None),
        (f"blk.{layer}.ffn_down.weight", f"model.layers.{layer}.mlp.down_proj.weight", None),
        ("output_norm.weight", "model.norm.weight", None),
    ]
    with safe_open(os.path.join(default_model_path, "model.safetensors"), "pt") as f:
        for gguf_name, hf_name, heads in pairs:
            expected = dequantized(gguf_name).float()
            if heads is not None:
                expected = unpermute(expected, heads)
            assert torch.equal(f.get_tensor(hf_name), expected), hf_name


def test_yarn_extends_the_context_and_longer_requests_are_refused():
    from radixserve.config import ModelConfig
    from radixserve.engine.async_engine import check_context_length

    qwen3 = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 10, "hidden_size": 8,
             "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1,
             "max_position_embeddings": 40960}
    plain = ModelConfig.from_dict(qwen3)
    assert plain.max_context == 40960 and check_context_length(None, plain) == 40960
    yarn = ModelConfig.from_dict({**qwen3, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}})
    assert yarn.max_context == 131072 and check_context_length(100000, yarn) == 100000
    with pytest.raises(ValueError, match="--context-length 131073 exceeds the model's 131072"):
        check_context_length(131073, yarn)
    with pytest.raises(ValueError, match="exceeds"):
        check_context_length(40961, plain)
    # without original_max_position_embeddings, yarn's pretraining length is the config's
    bare = ModelConfig.from_dict({**qwen3, "rope_scaling": {"type": "yarn", "factor": 2.0}})
    assert bare.rope_scaling["original_max_position_embeddings"] == 40960
    assert bare.max_context == 81920
    table = build_cos_sin_cache(8, bare.max_context, 10000.0, bare.rope_scaling)
    assert table.shape == (81920, 8) and torch.isfinite(table).all()


def test_a_config_we_cannot_read_is_a_clear_error_not_a_key_error():
    # Llava-style: the text model nested under text_config, which we unwrap only for Gemma 3
    llava = {"architectures": ["LlavaForConditionalGeneration"],
             "text_config": {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
                             "num_hidden_layers": 1, "num_attention_heads": 1},
             "vision_config": {"hidden_size": 8}}
    with pytest.raises(ValueError, match=r"\(LlavaForConditionalGeneration\) has no integer "
                                         r"vocab_size, hidden_size, intermediate_size, "
                                         r"num_hidden_layers, num_attention_heads: it is not a "
                                         r"decoder-only text model"):
        ModelConfig.from_dict(llava)
    bert_like = {"architectures": ["BertModel"], "vocab_size": 10, "hidden_size": 8,
                 "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": None}
    with pytest.raises(ValueError, match=r"\(BertModel\) has no integer num_attention_heads:"):
        ModelConfig.from_dict(bert_like)
