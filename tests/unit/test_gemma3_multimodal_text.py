"""The text model of multimodal Gemma 3 checkpoints (Gemma3ForConditionalGeneration: gemma-3-4b /
12b / 27b), served for text-only prompts.

A tiny random Gemma3ForConditionalGeneration built with HF transformers (the text model as
test_sliding_window's tiny Gemma 3: layer_types mixing sliding and full layers, window 8, local /
global rope bases, linear rope scaling, query_pre_attn_scalar != head_dim; a one-layer SigLIP
vision tower), written two ways:
  * "saved": save_pretrained's files (transformers 5 writes language_model.model.*,
    vision_tower.*, multi_modal_projector.*, no lm_head: tied), and
  * "in_memory": the model's own state_dict names (model.language_model.*, model.vision_tower.*,
    model.multi_modal_projector.*), as other writers of transformers 5 checkpoints store them,
    lm_head.weight included (an untied-looking copy of the embeddings, loaded as tied).
Each loads through our loader; then test_sliding_window's checks run on it unchanged: windows
per layer equal HF's text layers', logits within 1e-4 of HF's text logits (input_ids only, fp32)
over 30 tokens (3.75 windows) in a prefill, a chunked prefill and batched decode steps, the
window being what makes the match, and the engine's chunked prefill + radix reuse across the
window against HF's greedy generate. Also: the config read from text_config (the outer EOS ids
winning), vision tensors skipped and logged once with their count, both layouts giving the same
parameters, an unknown tensor still refused, hub-style sparse text_configs (gemma-3-4b-it's,
gemma-3-27b-it's) read as transformers reads them.
"""
from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch

import test_sliding_window as sw
from radixserve.config import ModelConfig, text_model_config
from radixserve.model.gemma3 import Gemma3ForConditionalGeneration, text_weight_name
from radixserve.model.loader import load_model, safetensors_files

from test_model_parity import _randomize

WINDOW = sw.WINDOW
EOS = [1, 3]                    # outer eos_token_id; text_config's own default is 1
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                   "model.multi_modal_projector.")


def _tiny_multimodal():
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration as HFGemma3MM

    text = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=WINDOW,
                layer_types=sw.GEMMA3_TYPES, max_position_embeddings=256,
                query_pre_attn_scalar=24, rope_theta=5000.0, rope_local_base_freq=300.0,
                rope_scaling={"rope_type": "linear", "factor": 4.0})
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                       boi_token_index=94, eoi_token_index=95, image_token_index=96,
                       eos_token_id=EOS)
    return HFGemma3MM(cfg)


def _tensor_names(path):
    from safetensors import safe_open

    names = []
    for f in safetensors_files(path):
        with safe_open(f, framework="pt") as handle:
            names += list(handle.keys())
    return names


@pytest.fixture(scope="module")
def hf_multimodal():
    torch.manual_seed(0)
    hf = _tiny_multimodal().eval()
    _randomize(hf, seed=1)          # vision tower and projector too: they must not matter
    return hf


@pytest.fixture(scope="module")
def written(hf_multimodal, tmp_path_factory):
    """{"saved": dir, "in_memory": dir}: the same model in both weight layouts."""
    from safetensors.torch import save_file

    saved = str(tmp_path_factory.mktemp("gemma3mm_saved"))
    hf_multimodal.save_pretrained(saved, safe_serialization=True)
    in_memory = str(tmp_path_factory.mktemp("gemma3mm_in_memory"))
    for name in os.listdir(saved):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(saved, name), in_memory)
    state = {k: v.detach().clone().contiguous() for k, v in hf_multimodal.state_dict().items()}
    save_file(state, os.path.join(in_memory, "model.safetensors"))
    return {"saved": saved, "in_memory": in_memory}


@pytest.fixture(scope="module", params=["saved", "in_memory"])
def tiny(request, hf_multimodal, written):
    """test_sliding_window's (name, hf, ours, config, path) for the multimodal checkpoint."""
    path = written[request.param]
    config = ModelConfig.from_path(path)
    ours = load_model(path, config, "safetensors", torch.float32, "cpu")
    return "gemma3", hf_multimodal, ours, config, path


def test_the_two_layouts_are_what_they_claim(written):
    saved, in_memory = (_tensor_names(written[k]) for k in ("saved", "in_memory"))
    assert any(n.startswith("language_model.model.layers.") for n in saved)
    assert not any(n.startswith("model.") for n in saved)
    assert any(n.startswith("model.language_model.layers.") for n in in_memory)
    assert "lm_head.weight" in in_memory
    for names, prefix in ((saved, ""), (in_memory, "model.")):
        assert any(n.startswith(prefix + "vision_tower.") for n in names)
        assert any(n.startswith(prefix + "multi_modal_projector.") for n in names)


def test_config_is_the_text_config(tiny):
    _, hf, ours, config, path = tiny
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    assert "text_config" in raw and "vision_config" in raw
    assert type(ours) is Gemma3ForConditionalGeneration
    assert config.architecture == "Gemma3ForConditionalGeneration"
    text = hf.config.text_config
    assert (config.vocab_size, config.hidden_size, config.intermediate_size,
            config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, config.max_position_embeddings) == \
        (text.vocab_size, text.hidden_size, text.intermediate_size, text.num_hidden_layers,
         text.num_attention_heads, text.num_key_value_heads, text.head_dim,
         text.max_position_embeddings)
    assert config.eos_token_ids == EOS and config.tie_word_embeddings
    assert config.rope_theta == 5000.0 and config.rope_scaling["factor"] == 4.0
    assert "vision_config" not in config.hf_config and config.hf_config["model_type"] == "gemma3"
    assert ours.model.layers[0].self_attn.scaling == 24 ** -0.5


def test_tiny_windows_per_layer(tiny):
    sw.test_tiny_windows_per_layer((tiny[0], _TextView(tiny[1]), *tiny[2:]))


class _TextView:
    """hf.model.layers / hf.config as test_sliding_window reads them from a causal LM."""

    def __init__(self, hf):
        self.model, self.config = hf.model.language_model, hf.config.text_config


def test_tiny_logits_match_hf_across_the_window(tiny):
    sw.test_tiny_logits_match_hf_across_the_window(tiny)


def test_tiny_window_is_what_makes_the_match(tiny):
    sw.test_tiny_window_is_what_makes_the_match(tiny)


def test_engine_chunked_prefill_and_radix_reuse_across_the_window(tiny):
    sw.test_engine_chunked_prefill_and_radix_reuse_across_the_window(tiny)


def test_both_layouts_load_the_same_parameters(hf_multimodal, written):
    models = [load_model(written[k], ModelConfig.from_path(written[k]), "safetensors",
                         torch.float32, "cpu") for k in ("saved", "in_memory")]
    a, b = (dict(m.named_parameters()) for m in models)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # and they are HF's text weights (the embeddings, the norms as 1 + w)
    text = hf_multimodal.model.language_model
    assert torch.equal(a["model.embed_tokens.weight"], text.embed_tokens.weight)
    assert torch.equal(a["model.layers.3.self_attn.k_norm.weight"],
                       1.0 + text.layers[3].self_attn.k_norm.weight)


@pytest.mark.parametrize("layout", ["saved", "in_memory"])
def test_vision_weights_are_skipped_and_logged_once(layout, written, caplog):
    path = written[layout]
    vision = [n for n in _tensor_names(path) if n.startswith(VISION_PREFIXES)]
    assert len(vision) > 20         # the tower's layer and head, the projector
    with caplog.at_level(logging.INFO, logger="radixserve.model.gemma3"):
        load_model(path, ModelConfig.from_path(path), "safetensors", torch.float32, "cpu")
    said = [r.getMessage() for r in caplog.records if "vision tower" in r.getMessage()]
    assert len(said) == 1, said
    assert f"skipped {len(vision)} vision tower / projector tensors" in said[0]


def test_tensor_parallel_shards_log_the_skip_once(written, caplog):
    """Two shards each read every tensor (model/loader.py: load_model_shards): one log line."""
    from radixserve.model.loader import load_model_shards

    path = written["saved"]
    with caplog.at_level(logging.INFO, logger="radixserve.model.gemma3"):
        shards = load_model_shards(path, ModelConfig.from_path(path), "safetensors",
                                   torch.float32, ["cpu", "cpu"])
    said = [r.getMessage() for r in caplog.records if "vision tower" in r.getMessage()]
    assert len(said) == 1 and [s.tp_rank for s in shards] == [0, 1]


def test_text_weight_names():
    assert text_weight_name("language_model.model.layers.0.mlp.up_proj.weight") == \
        "model.layers.0.mlp.up_proj.weight"
    assert text_weight_name("model.language_model.norm.weight") == "model.norm.weight"
    assert text_weight_name("language_model.lm_head.weight") == "lm_head.weight"
    assert text_weight_name("lm_head.weight") == "lm_head.weight"
    for vision in ("vision_tower.vision_model.post_layernorm.weight",
                   "model.vision_tower.encoder.layers.0.mlp.fc1.bias",
                   "multi_modal_projector.mm_input_projection_weight",
                   "model.multi_modal_projector.mm_soft_emb_norm.weight"):
        assert text_weight_name(vision) is None


def test_unknown_and_missing_text_tensors_are_still_refused(tiny):
    _, _, ours, config, _ = tiny
    model = Gemma3ForConditionalGeneration(config)
    with pytest.raises(ValueError, match="matches no parameter"):
        model.load_weights([("language_model.model.layers.0.self_attn.rotary.weight",
                             torch.zeros(3))])
    # vision tensors fill nothing: a checkpoint of only those lacks every text parameter
    loaded = model.load_weights([("vision_tower.post_layernorm.weight", torch.zeros(32))])
    assert loaded == set() and model.expected_weights()


def test_dummy_weights_build_from_the_nested_config(written):
    path = written["saved"]
    model = load_model(path, ModelConfig.from_path(path), "dummy", torch.float32, "cpu")
    assert type(model) is Gemma3ForConditionalGeneration and len(model.model.layers) == 4


# gemma-3-4b-it's and gemma-3-27b-it's config.json on the hub: text_config lists only what
# differs from Gemma3TextConfig's defaults (vision_config trimmed to what is read here)
HUB_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
    "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
    "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "torch_dtype": "bfloat16",
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16,
                      "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False},
}
HUB_27B = {**HUB_4B, "text_config": {
    "head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504, "model_type": "gemma3_text",
    "num_attention_heads": 32, "num_hidden_layers": 62, "num_key_value_heads": 16,
    "query_pre_attn_scalar": 168, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    "sliding_window": 1024}}


@pytest.mark.parametrize("hub", [HUB_4B, HUB_27B], ids=["4b", "27b"])
def test_hub_configs_are_read_as_transformers_reads_them(hub):
    """Our flattened config against transformers' own reading of the same config.json (its
    Gemma3Config with the text config class's defaults): every field the model uses."""
    from transformers import Gemma3Config

    text = Gemma3Config(**json.loads(json.dumps(hub))).text_config
    config = ModelConfig.from_dict(json.loads(json.dumps(hub)))
    assert config.architecture == "Gemma3ForConditionalGeneration"
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                  "max_position_embeddings", "tie_word_embeddings", "attention_bias"):
        assert getattr(config, field) == getattr(text, field), field
    hf = config.hf_config
    for key in ("query_pre_attn_scalar", "sliding_window", "hidden_activation",
                "final_logit_softcapping", "attn_logit_softcapping"):
        assert hf.get(key) == getattr(text, key), key
    assert config.eos_token_ids == [1, 106]
    types = Gemma3ForConditionalGeneration.layer_types(config)
    assert types == list(text.layer_types)
    ropes = Gemma3ForConditionalGeneration.ropes(config, types)
    want = text.rope_parameters
    assert ropes["sliding_attention"] == (want["sliding_attention"]["rope_theta"], None)
    theta, scaling = ropes["full_attention"]
    assert theta == want["full_attention"]["rope_theta"] == 1e6
    assert scaling["rope_type"] == want["full_attention"]["rope_type"] == "linear"
    assert scaling["factor"] == want["full_attention"]["factor"] == 8.0
    assert config.max_context == 131072


def test_other_configs_pass_through_unchanged():
    cfg = {"architectures": ["LlamaForCausalLM"], "text_config": {"vocab_size": 3}}
    assert text_model_config(cfg) is cfg
    with pytest.raises(ValueError, match="text_config must be an object"):
        text_model_config({**HUB_4B, "text_config": [1]})
