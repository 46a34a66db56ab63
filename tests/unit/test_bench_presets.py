"""radixserve.bench.presets (`radixserve bench presets`): each preset directory loads with
radixserve and has the published shapes."""
import json
import os

import pytest
import torch

from radixserve.bench import presets
from radixserve.config import ModelConfig
from radixserve.model.llama import get_model_class
from radixserve.model.loader import load_model
from radixserve.tokenizer.tokenizer import Tokenizer

TEXT = "Hello, world! The quick brown fox \u2014 na\u00efve caf\u00e9, 12345.\n\tEnd."

# (vocab_size, bos id, an eos id, tied embeddings) as published
EXPECTED = {
    "llama-3.1-8b": (128256, 128000, 128009, False),
    "llama-3.2-1b": (128256, 128000, 128009, True),
    "qwen2.5-7b": (152064, 151643, 151645, False),
    "qwen3-8b": (151936, 151643, 151645, False),
    "smollm2-135m": (49152, 1, 2, True),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("presets")
    return {name: presets.build_preset(name, str(root / name)) for name in EXPECTED}


def test_every_required_preset_exists():
    assert set(EXPECTED) <= set(presets.PRESETS)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_loads_with_radixserve(built, name):
    vocab, bos, eos, tied = EXPECTED[name]
    path = built[name]
    cfg = ModelConfig.from_path(path)
    assert cfg.vocab_size == vocab
    assert cfg.tie_word_embeddings is tied
    assert eos in cfg.eos_token_ids
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["torch_dtype"] == "bfloat16"

    tok = Tokenizer.from_path(path)
    assert tok.vocab_size == vocab
    assert tok.bos_token_id == bos
    assert eos in tok.eos_token_ids
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert all(0 <= i < vocab for i in ids)
    assert len(ids) < len(TEXT.encode())          # merges apply: fewer tokens than bytes
    assert tok.decode(ids) == TEXT
    # every id decodes to text, the last (filler or reserved) ones included
    for tid in (0, 255, 256, vocab // 2, vocab - 1):
        assert tok.token_text(tid) != ""
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert "hi" in prompt and tok.special_tokens["eos_token"] in prompt


def test_llama3_special_ids_and_rope(built):
    tok = Tokenizer.from_path(built["llama-3.1-8b"])
    assert tok.encode("x")[0] == 128000                        # BOS prepended, as Llama 3 does
    assert tok.encode("<|eot_id|>", add_special_tokens=False) == [128009]
    assert tok.encode("<|start_header_id|>", add_special_tokens=False) == [128006]
    for name, factor in (("llama-3.1-8b", 8.0), ("llama-3.2-1b", 32.0)):
        rs = ModelConfig.from_path(built[name]).rope_scaling
        assert rs["rope_type"] == "llama3" and rs["factor"] == factor
        assert rs["original_max_position_embeddings"] == 8192
    qwen = Tokenizer.from_path(built["qwen2.5-7b"])
    assert qwen.encode("<|im_end|>", add_special_tokens=False) == [151645]
    assert qwen.encode("x") == qwen.encode("x", add_special_tokens=False)   # no BOS for Qwen
    qwen3 = Tokenizer.from_path(built["qwen3-8b"])
    assert qwen3.encode("<think>", add_special_tokens=False) == [151667]
    assert ModelConfig.from_path(built["qwen3-8b"]).architecture == "Qwen3ForCausalLM"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_parameter_count_matches_the_published_model(name):
    """radixserve's model class, built on the meta device (no memory), has exactly the
    published parameter count: the config's shapes are the real ones."""
    preset = presets.PRESETS[name]
    cfg = ModelConfig.from_dict(preset.config)
    with torch.device("meta"):
        model = get_model_class(cfg.architecture)(cfg, params_dtype=torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) == preset.num_params


def test_smallest_preset_builds_dummy_weights(built):
    path = built["smollm2-135m"]
    model = load_model(path, ModelConfig.from_path(path), "dummy", torch.float32, "cpu")
    params = list(model.parameters())
    assert sum(p.numel() for p in params) == presets.PRESETS["smollm2-135m"].num_params
    assert all(torch.isfinite(p).all() for p in params[:4])


def test_unknown_preset_names_the_choices(tmp_path):
    with pytest.raises(KeyError, match="llama-3.1-8b"):
        presets.build_preset("gpt-5", str(tmp_path))


def test_bench_presets_subcommand_builds_a_directory(tmp_path, capsys):
    from radixserve import cli
    out = str(tmp_path / "smol")
    assert cli.main(["bench", "presets", "smollm2-135m", "--out", out]) == 0
    assert capsys.readouterr().out.strip() == out
    assert ModelConfig.from_path(out).vocab_size == 49152
