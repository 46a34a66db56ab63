"""FP8 checkpoints and --quantization fp8 (quant/fp8.py, model/loader.py, model/llama.py): what a
quantization_config means, the start-up errors, tiny random Llama and Qwen3 checkpoints written
in the compressed-tensors (llm-compressor FP8_DYNAMIC and FP8) and ModelOpt FP8 layouts loading
and matching their dequantized references, quantization at load, tensor-parallel shards, dummy
FP8 weights, the bench presets and the flag."""
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from radixserve import ops
from radixserve.cache.kv_pool import KVPool
from radixserve.config import ModelConfig, ServerArgs
from radixserve.model import llama
from radixserve.model.forward_batch import ForwardBatch, ForwardMode
from radixserve.model.llama import (ColumnParallelLinear, QKVParallelLinear, RowParallelLinear,
                                    get_model_class)
from radixserve.model.loader import load_model
from radixserve.ops import reference as ref
from radixserve.quant import (Fp8Scheme, QuantConfig, checkpoint_quant_config, quantization_name,
                              quantize_weight_per_channel, resolve_quant_config)

E4M3 = torch.float8_e4m3fn

# ----------------------------------------------------------------------------- the configs
# quantization_config as llm-compressor writes it for its FP8_DYNAMIC and FP8 presets
# (QuantizationModifier(targets="Linear", scheme=..., ignore=["lm_head"])), and as ModelOpt's HF
# export writes it (config.json, and the older hf_quant_config.json)


def _ct_args(strategy, dynamic, observer):
    return {"actorder": None, "block_structure": None, "dynamic": dynamic, "group_size": None,
            "num_bits": 8, "observer": observer, "observer_kwargs": {}, "strategy": strategy,
            "symmetric": True, "type": "float"}


def ct_config(static: bool = False, weight_only: bool = False, ignore=("lm_head",)):
    acts = None if weight_only else (_ct_args("tensor", False, "minmax") if static
                                     else _ct_args("token", True, None))
    weights = _ct_args("tensor" if static else "channel", False, "minmax")
    return {"config_groups": {"group_0": {"input_activations": acts, "output_activations": None,
                                          "targets": ["Linear"], "weights": weights}},
            "format": "float-quantized", "global_compression_ratio": None,
            "ignore": list(ignore), "kv_cache_scheme": None,
            "quant_method": "compressed-tensors", "quantization_status": "compressed"}


MODELOPT_CONFIG = {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": None,
                   "exclude_modules": ["lm_head"]}
MODELOPT_SIDECAR = {"producer": {"name": "modelopt", "version": "0.19.0"},
                    "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
                                     "exclude_modules": ["lm_head"]}}


@pytest.mark.parametrize("qc,method,scheme", [
    (ct_config(), "compressed-tensors", Fp8Scheme("channel", "dynamic", True)),
    (ct_config(static=True), "compressed-tensors", Fp8Scheme("tensor", "static", True)),
    (ct_config(weight_only=True), "compressed-tensors", Fp8Scheme("channel", "none", True)),
    (MODELOPT_CONFIG, "modelopt", Fp8Scheme("tensor", "static", True)),
    ({"quant_method": "modelopt", **MODELOPT_SIDECAR}, "modelopt",
     Fp8Scheme("tensor", "static", True)),
    ({"quant_method": "modelopt", "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN", "ignore": ["lm_head"]},
     "modelopt",
     Fp8Scheme("channel", "dynamic", True)),
    ({"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}, "fp8",
     Fp8Scheme("tensor", "static", True)),
])
def test_quantization_configs_parse(qc, method, scheme):
    config = checkpoint_quant_config({"quantization_config": qc})
    assert config.method == method
    assert config.scheme_for(["model.layers.3.self_attn.q_proj"]) == scheme
    assert config.scheme_for(["lm_head"]) is None
    assert method in config.describe()


def test_ignore_and_targets_pick_layers():
    qc = ct_config(ignore=["lm_head", "re:.*layers\\.0\\..*", "model.layers.1.mlp.down_proj"])
    qc["config_groups"]["group_0"]["targets"] = ["re:.*self_attn\\.(q|k|v|o)_proj$",
                                                 "re:.*mlp\\.(gate|up|down)_proj$"]
    config = checkpoint_quant_config({"quantization_config": qc})
    assert config.scheme_for(["model.layers.0.self_attn.q_proj"]) is None
    assert config.scheme_for(["model.layers.1.mlp.down_proj"]) is None
    assert config.scheme_for(["model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"])
    glob = checkpoint_quant_config({"quantization_config": {
        **MODELOPT_CONFIG, "exclude_modules": ["lm_head", "model.layers.2.*"]}})
    assert glob.scheme_for(["model.layers.2.self_attn.o_proj"]) is None
    assert glob.scheme_for(["model.layers.20.self_attn.o_proj"]) is not None
    two = QuantConfig("compressed-tensors", (
        (("re:.*q_proj$",), Fp8Scheme("tensor", "static", True)),
        (("Linear",), Fp8Scheme("channel", "dynamic", True))))
    with pytest.raises(ValueError, match="differently"):       # one fused q|k|v, two schemes
        two.scheme_for(["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"])


@pytest.mark.parametrize("qc,message", [
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
     "weight_block_size"),
    ({**ct_config(), "format": "int-quantized"}, "format 'int-quantized'"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "quant_algo 'NVFP4'"),
])
def test_unsupported_quantization_is_a_startup_error_naming_the_method(tmp_path, qc, message):
    with pytest.raises(ValueError, match=message):
        checkpoint_quant_config({"quantization_config": qc})
    group = ct_config()
    group["config_groups"]["group_0"]["weights"]["strategy"] = "block"
    group["config_groups"]["group_0"]["weights"]["block_structure"] = [128, 128]
    with pytest.raises(ValueError, match="strategy 'block'"):
        checkpoint_quant_config({"quantization_config": group})
    # through load_model: the start fails before any weight is read
    path = _write_dir(tmp_path, _tiny_config("llama"), {}, quantization_config=qc)
    with pytest.raises(ValueError, match=message):
        load_model(path, ModelConfig.from_path(path), "auto", torch.float32, "cpu")


def test_resolve_with_the_flag():
    plain = {"architectures": ["LlamaForCausalLM"]}
    fp8_ckpt = {"quantization_config": ct_config()}
    assert resolve_quant_config(plain) is None
    online = resolve_quant_config(plain, "fp8")
    assert online.method == "fp8" and not online.checkpoint
    assert online.scheme_for(["model.layers.0.mlp.down_proj"]) == Fp8Scheme("channel", "dynamic",
                                                                            False)
    for flag in (None, "fp8", "compressed-tensors"):
        assert resolve_quant_config(fp8_ckpt, flag).method == "compressed-tensors"
    with pytest.raises(ValueError, match="does not match"):
        resolve_quant_config(fp8_ckpt, "modelopt")
    with pytest.raises(ValueError, match="unquantized"):
        resolve_quant_config(plain, "modelopt")
    with pytest.raises(ValueError, match="int8"):
        resolve_quant_config(plain, "int8")


# ----------------------------------------------------------------------------- tiny checkpoints

PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _tiny_config(arch: str):
    common = {"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "hidden_act": "silu",
              "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
    if arch == "llama":
        return {**common, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "rope_theta": 10000.0, "tie_word_embeddings": False, "attention_bias": False}
    return {**common, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
            "head_dim": 32, "rope_theta": 1000000.0, "tie_word_embeddings": True,
            "attention_bias": False}


def _tiny_weights(cfg, seed: int):
    """HF-named tensors of a random model of cfg, O(1) logits (fp32)."""
    g = torch.Generator().manual_seed(seed)
    h, inter, heads, kv = (cfg["hidden_size"], cfg["intermediate_size"],
                           cfg["num_attention_heads"], cfg["num_key_value_heads"])
    hd = cfg.get("head_dim", h // heads)
    shapes = {"self_attn.q_proj": (heads * hd, h), "self_attn.k_proj": (kv * hd, h),
              "self_attn.v_proj": (kv * hd, h), "self_attn.o_proj": (h, heads * hd),
              "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h), "mlp.down_proj": (h, inter)}
    w = {"model.embed_tokens.weight": torch.randn(cfg["vocab_size"], h, generator=g),
         "model.norm.weight": 1 + 0.1 * torch.randn(h, generator=g)}
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = 0.3 * torch.randn(cfg["vocab_size"], h, generator=g)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name, shape in shapes.items():
            w[p + name + ".weight"] = 0.15 * torch.randn(*shape, generator=g)
        for name in ("input_layernorm", "post_attention_layernorm"):
            w[p + name + ".weight"] = 1 + 0.1 * torch.randn(h, generator=g)
        if cfg["architectures"] == ["Qwen3ForCausalLM"]:
            for name in ("self_attn.q_norm", "self_attn.k_norm"):
                w[p + name + ".weight"] = 1 + 0.1 * torch.randn(hd, generator=g)
    return w


def _write_dir(root, cfg, tensors, quantization_config=None, sidecar=None, name="m"):
    path = os.path.join(str(root), name)
    os.makedirs(path, exist_ok=True)
    config = dict(cfg)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    if sidecar is not None:
        with open(os.path.join(path, "hf_quant_config.json"), "w") as f:
            json.dump(sidecar, f)
    if tensors:
        save_file({k: v.contiguous() for k, v in tensors.items()},
                  os.path.join(path, "model.safetensors"))
    return path


def _quantize_tensor(w: torch.Tensor):
    scale = (w.abs().amax() / 448.0).reshape(1)
    return (w / scale).clamp(-448, 448).to(E4M3), scale


def _fp8_checkpoint(weights, fmt: str, seed: int, scale_dtype=torch.float32):
    """(tensors as the tool writes them, dequantized fp32 weights, input scales by module).
    fmt: ct-dynamic (llm-compressor FP8_DYNAMIC: weight e4m3 + weight_scale [N, 1] in
    scale_dtype: llm-compressor stores a bf16 model's scales in bf16), ct-static
    (llm-compressor FP8: weight_scale [1], input_scale [1]), modelopt (weight_scale and
    input_scale 0-dim fp32, k_proj.k_scale / v_proj.v_scale)."""
    g = torch.Generator().manual_seed(seed)
    out, deq, input_scales = {}, {}, {}
    for name, w in weights.items():
        module = name[:-len(".weight")]
        if not module.endswith(PROJ):
            out[name] = w
            continue
        if fmt == "ct-dynamic":
            q, s = quantize_weight_per_channel(w)
            s = s.to(scale_dtype)
            out[module + ".weight_scale"] = s.reshape(-1, 1)               # [N, 1]
            deq[name] = q.float() * s.float()[:, None]
        else:
            q, s = _quantize_tensor(w)
            # a calibrated activation scale: inputs of these layers reach about 3-5
            a = torch.tensor([(3.0 + 2 * torch.rand(1, generator=g).item()) / 448.0])
            if fmt == "modelopt":
                out[module + ".weight_scale"] = s.reshape(())              # 0-dim F32
                out[module + ".input_scale"] = a.reshape(())
            else:
                out[module + ".weight_scale"] = s                          # [1]
                out[module + ".input_scale"] = a
            deq[name] = q.float() * s
            input_scales[module] = a
        out[name] = q
    if fmt == "modelopt":
        for i in range(2):
            out[f"model.layers.{i}.self_attn.k_proj.k_scale"] = torch.tensor(0.5 + i)
            out[f"model.layers.{i}.self_attn.v_proj.v_scale"] = torch.tensor(0.25)
    return out, deq, input_scales


def _prefill_logits(model, cfg: ModelConfig, seqs, dtype=torch.float32):
    """One EXTEND of several new sequences -> logits of every token [num_tokens, vocab] f32."""
    n = sum(len(s) for s in seqs)
    pool = KVPool(n + 1, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, dtype, "cpu")
    lens = torch.tensor([len(s) for s in seqs], dtype=torch.int32)
    indptr = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    indptr[1:] = lens.cumsum(0)
    fb = ForwardBatch(mode=ForwardMode.EXTEND, batch_size=len(seqs),
                      input_ids=torch.tensor([t for s in seqs for t in s]),
                      positions=torch.cat([torch.arange(len(s)) for s in seqs]),
                      out_cache_loc=torch.arange(1, n + 1), qo_indptr=indptr,
                      kv_indptr=indptr.clone(), kv_indices=torch.arange(1, n + 1, dtype=torch.int32),
                      seq_lens=lens, logits_indices=torch.arange(n), kv_pool=pool)
    return model.compute_logits(model(fb))


def _fake_quant_hooks(reference, fp8_model):
    """Forward pre-hooks on the reference model's linear layers: their input rounded as the FP8
    model's W8A8 GEMM rounds it (per token, or with the layer's static input_scale)."""
    handles = []
    for name, module in reference.named_modules():
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        twin = fp8_model.get_submodule(name)
        if twin.quant is None:
            continue
        scale = twin.input_scale if twin.quant.activation == "static" else None

        def hook(mod, args, scale=scale):
            x = args[0]
            q, s = ref.fp8_quantize(x, scale)
            return ((q.float() * s).to(x.dtype),) + tuple(args[1:])
        handles.append(module.register_forward_pre_hook(hook))
    return handles


SEQS = [[5, 17, 33, 2, 90, 41, 7, 7, 64, 12, 3, 88, 51], [9, 1, 76, 30, 4]]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("fmt", ["ct-dynamic", "ct-static", "modelopt"])
def test_tiny_fp8_checkpoint_matches_its_dequantized_reference(tmp_path, monkeypatch, arch, fmt):
    cfg = _tiny_config(arch)
    weights = _tiny_weights(cfg, seed=len(arch) + len(fmt))
    tensors, deq, input_scales = _fp8_checkpoint(
        weights, fmt, seed=3, scale_dtype=torch.bfloat16 if arch == "qwen3" else torch.float32)
    qc = {"ct-dynamic": ct_config(), "ct-static": ct_config(static=True),
          "modelopt": MODELOPT_CONFIG}[fmt]
    path = _write_dir(tmp_path, cfg, tensors, qc, name="fp8")
    ref_path = _write_dir(tmp_path, cfg, {**weights, **deq}, name="dequantized")
    config = ModelConfig.from_path(path)
    model = load_model(path, config, "auto", torch.float32, "cpu")
    reference = load_model(ref_path, ModelConfig.from_path(ref_path), "auto", torch.float32, "cpu")
    method = "modelopt" if fmt == "modelopt" else "compressed-tensors"
    assert quantization_name(model) == method and quantization_name(reference) is None
    # every projection is FP8 and dequantizes to the checkpoint's values exactly; q|k|v and
    # gate|up keep each part's own scale; the head and embeddings stay fp32
    for i in range(2):
        layer = model.model.layers[i]
        p = f"model.layers.{i}."
        parts = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                 "self_attn.o_proj": ("self_attn.o_proj",),
                 "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
                 "mlp.down_proj": ("mlp.down_proj",)}
        for fused, names in parts.items():
            module = layer.get_submodule(fused)
            assert module.weight.dtype == E4M3 and module.weight_scale.dtype == torch.float32
            got = module.weight.float() * module.weight_scale[:, None]
            want = torch.cat([deq[p + n + ".weight"] for n in names])
            assert torch.equal(got, want), fused
            if fmt != "ct-dynamic":
                assert torch.equal(module.input_scale,
                                   torch.stack([input_scales[p + n] for n in names]).max().reshape(1))
            else:
                assert module.input_scale is None
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert model.lm_head.weight.dtype == torch.float32
    if fmt == "modelopt":       # KV-cache scales are kept for the KV cache, not dropped silently
        assert model.checkpoint_kv_scales == {"model.layers.0.self_attn.k_scale": 0.5,
                                              "model.layers.0.self_attn.v_scale": 0.25,
                                              "model.layers.1.self_attn.k_scale": 1.5,
                                              "model.layers.1.self_attn.v_scale": 0.25}
    # weight-only GEMMs (FP8 weights, math in the model dtype): the dequantized model's logits
    monkeypatch.setattr(llama, "FP8_SKINNY_ROWS", 10 ** 9)
    ours = _prefill_logits(model, config, SEQS)
    want = _prefill_logits(reference, config, SEQS)
    assert want.abs().max() > 0.5
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4)
    # W8A8 GEMMs (activations quantized per token or with input_scale): the dequantized model
    # with its linear layers' inputs rounded the same way
    monkeypatch.setattr(llama, "FP8_SKINNY_ROWS", 0)
    ours = _prefill_logits(model, config, SEQS)
    handles = _fake_quant_hooks(reference, model)
    try:
        want = _prefill_logits(reference, config, SEQS)
    finally:
        for h in handles:
            h.remove()
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4)
    unhooked = _prefill_logits(reference, config, SEQS)
    assert (ours - unhooked).abs().max() > 1e-4          # the activations were quantized


def test_modelopt_hf_quant_config_sidecar(tmp_path, monkeypatch):
    """The older ModelOpt export: config.json without quantization_config, the scheme in
    hf_quant_config.json beside it."""
    cfg = _tiny_config("llama")
    weights = _tiny_weights(cfg, seed=5)
    tensors, deq, _ = _fp8_checkpoint(weights, "modelopt", seed=6)
    path = _write_dir(tmp_path, cfg, tensors, sidecar=MODELOPT_SIDECAR)
    config = ModelConfig.from_path(path)
    model = load_model(path, config, "auto", torch.float32, "cpu")
    assert model.quant_config.method == "modelopt" and "FP8" in model.quant_config.describe()
    qkv = model.model.layers[1].self_attn.qkv_proj
    torch.testing.assert_close(qkv.weight.float() * qkv.weight_scale[:, None],
                               torch.cat([deq[f"model.layers.1.self_attn.{n}_proj.weight"]
                                          for n in "qkv"]), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantization_fp8_at_load(tmp_path, dtype):
    """--quantization fp8 on a bf16 checkpoint: each weight row quantized per output channel
    (scale = amax / 448); nothing else changes; the model runs (decode-sized and prefill-sized
    GEMMs) close to the unquantized one."""
    cfg = _tiny_config("llama")
    weights = {k: v.to(torch.bfloat16) for k, v in _tiny_weights(cfg, seed=7).items()}
    path = _write_dir(tmp_path, cfg, weights)
    config = ModelConfig.from_path(path)
    model = load_model(path, config, "auto", dtype, "cpu", quantization="fp8")
    plain = load_model(path, config, "auto", dtype, "cpu")
    assert model.quant_config.method == "fp8" and not model.quant_config.checkpoint
    down = model.model.layers[0].mlp.down_proj
    q, s = quantize_weight_per_channel(weights["model.layers.0.mlp.down_proj.weight"])
    assert torch.equal(down.weight.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(down.weight_scale, s)
    gate_up = model.model.layers[1].mlp.gate_up_proj
    q_up, s_up = quantize_weight_per_channel(weights["model.layers.1.mlp.up_proj.weight"])
    assert torch.equal(gate_up.weight[96:].view(torch.uint8), q_up.view(torch.uint8))
    assert torch.equal(gate_up.weight_scale[96:], s_up)
    assert model.lm_head.weight.dtype == dtype
    logits = _prefill_logits(model, config, SEQS, dtype)
    want = _prefill_logits(plain, config, SEQS, dtype)
    assert torch.isfinite(logits).all()
    # FP8's rounding (3 mantissa bits: ~2.6% per weight, relative) shows, bounded
    rel = ((logits - want).norm() / want.norm()).item()
    assert 1e-4 < rel < 0.1, rel


def test_quantization_fp8_on_an_fp8_checkpoint_uses_its_scales(tmp_path):
    cfg = _tiny_config("qwen3")
    tensors, deq, _ = _fp8_checkpoint(_tiny_weights(cfg, seed=8), "ct-dynamic", seed=9)
    path = _write_dir(tmp_path, cfg, tensors, ct_config())
    model = load_model(path, ModelConfig.from_path(path), "auto", torch.float32, "cpu",
                       quantization="fp8")
    assert model.quant_config.method == "compressed-tensors"
    o = model.model.layers[0].self_attn.o_proj
    assert torch.equal(o.weight.float() * o.weight_scale[:, None],
                       deq["model.layers.0.self_attn.o_proj.weight"])
    with pytest.raises(ValueError, match="does not match"):
        load_model(path, ModelConfig.from_path(path), "auto", torch.float32, "cpu",
                   quantization="modelopt")


def test_fp8_checkpoint_errors_and_an_fp8_lm_head(tmp_path):
    cfg = _tiny_config("llama")
    weights = _tiny_weights(cfg, seed=10)
    tensors, _, _ = _fp8_checkpoint(weights, "ct-dynamic", seed=11)
    # a bf16 weight where the config says FP8
    bad = dict(tensors)
    bad["model.layers.0.mlp.down_proj.weight"] = weights["model.layers.0.mlp.down_proj.weight"]
    path = _write_dir(tmp_path, cfg, bad, ct_config(), name="bf16-in-fp8")
    with pytest.raises(ValueError, match="down_proj.*float8_e4m3fn|float8_e4m3fn"):
        load_model(path, ModelConfig.from_path(path), "auto", torch.float32, "cpu")
    # a missing weight_scale
    missing = {k: v for k, v in tensors.items()
               if k != "model.layers.1.self_attn.o_proj.weight_scale"}
    path = _write_dir(tmp_path, cfg, missing, ct_config(), name="no-scale")
    with pytest.raises(ValueError, match="o_proj.weight_scale"):
        load_model(path, ModelConfig.from_path(path), "auto", torch.float32, "cpu")
    # an FP8 lm_head (ignore without lm_head) loads dequantized into the fp32 head
    head_q, head_s = quantize_weight_per_channel(weights["lm_head.weight"])
    with_head = {**tensors, "lm_head.weight": head_q, "lm_head.weight_scale": head_s[:, None]}
    path = _write_dir(tmp_path, cfg, with_head, ct_config(ignore=()), name="fp8-head")
    model = load_model(path, ModelConfig.from_path(path), "auto", torch.float32, "cpu")
    assert model.lm_head.weight.dtype == torch.float32
    assert torch.equal(model.lm_head.weight, head_q.float() * head_s[:, None])
    no_scale = {k: v for k, v in with_head.items() if k != "lm_head.weight_scale"}
    path = _write_dir(tmp_path, cfg, no_scale, ct_config(ignore=()), name="fp8-head-no-scale")
    with pytest.raises(ValueError, match="lm_head.weight is FP8"):
        load_model(path, ModelConfig.from_path(path), "auto", torch.float32, "cpu")


# ----------------------------------------------------------------------------- tensor parallel


@pytest.mark.parametrize("online", [False, True])
def test_tensor_parallel_shards_keep_the_single_device_math(online):
    """tp_size 2: column-parallel ranks hold their output rows and those rows' scales (the
    per-tensor scale of each of q, k, v expanded over its rows), row-parallel ranks their input
    columns and every output channel's scale; concatenated (column) or summed (row) outputs
    equal tp_size 1's in weight-only mode, and each rank's W8A8 column output too."""
    g = torch.Generator().manual_seed(12)
    hidden, heads, kv_heads, hd = 64, 4, 2, 16
    w = {n: 0.2 * torch.randn(r, hidden, generator=g) for n, r in
         (("q", heads * hd), ("k", kv_heads * hd), ("v", kv_heads * hd))}
    w_o = 0.2 * torch.randn(hidden, heads * hd, generator=g)
    scheme = Fp8Scheme("channel" if online else "tensor", "dynamic", not online)

    def load(layer, name, tensor, sid=0):
        if online:
            layer.load_weight(name, tensor, sid)
        else:
            q, s = _quantize_tensor(tensor)
            layer.load_weight("weight", q, sid)
            layer.load_weight("weight_scale", s.reshape(()), sid)

    def qkv(rank, size):
        layer = QKVParallelLinear(hidden, hd, heads, kv_heads, False, torch.float32, rank, size,
                                  quant=scheme)
        for sid, n in enumerate("qkv"):
            load(layer, "weight", w[n], sid)
        return layer

    def o_proj(rank, size):
        layer = RowParallelLinear(heads * hd, hidden, False, torch.float32, rank, size,
                                  quant=scheme)
        load(layer, "weight", w_o)
        return layer

    x = torch.randn(5, hidden, generator=g)
    one, shards = qkv(0, 1), [qkv(r, 2) for r in range(2)]
    # rank r: q rows [r * 32, r * 32 + 32), k rows [r * 16, ...), v rows likewise
    for r, shard in enumerate(shards):
        rows = torch.cat([torch.arange(r * 32, r * 32 + 32), 64 + torch.arange(r * 16, r * 16 + 16),
                          96 + torch.arange(r * 16, r * 16 + 16)])
        assert torch.equal(shard.weight.view(torch.uint8), one.weight[rows].view(torch.uint8))
        assert torch.equal(shard.weight_scale, one.weight_scale[rows])
        for mode in ("none", "dynamic"):
            got = ops.fp8_linear(x, shard.weight, shard.weight_scale, None, act_quant=mode)
            want = ops.fp8_linear(x, one.weight, one.weight_scale, None, act_quant=mode)[:, rows]
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    if not online:      # each of q, k, v keeps its own per-tensor scale (no common requantization)
        assert len(set(one.weight_scale.tolist())) == 3
    y = torch.randn(5, heads * hd, generator=g)
    one_o, ranks_o = o_proj(0, 1), [o_proj(r, 2) for r in range(2)]
    for r, shard in enumerate(ranks_o):
        assert torch.equal(shard.weight_scale, one_o.weight_scale)     # whole on every rank
        assert torch.equal(shard.weight.view(torch.uint8),
                           one_o.weight[:, r * 32:(r + 1) * 32].view(torch.uint8))
    partial = sum(ops.fp8_linear(y[:, r * 32:(r + 1) * 32], s.weight, s.weight_scale, None,
                                 act_quant="none") for r, s in enumerate(ranks_o))
    torch.testing.assert_close(partial, ops.fp8_linear(y, one_o.weight, one_o.weight_scale, None,
                                                       act_quant="none"), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- dummy, presets, flag


def test_dummy_fp8_weights(tmp_path):
    cfg = _tiny_config("qwen3")
    for qc in (ct_config(), MODELOPT_CONFIG):
        path = _write_dir(tmp_path, cfg, {}, qc, name=qc["quant_method"])
        config = ModelConfig.from_path(path)
        model = load_model(path, config, "dummy", torch.bfloat16, "cpu")
        down = model.model.layers[1].mlp.down_proj
        assert down.weight.dtype == E4M3 and bool((down.weight_scale > 0).all())
        w = down.weight.float() * down.weight_scale[:, None]
        assert 0.01 < w.std().item() < 0.03                         # normal(0, 0.02)
        if qc is MODELOPT_CONFIG:
            assert down.input_scale.item() == pytest.approx(8 / 448)
        logits = _prefill_logits(model, config, SEQS, torch.bfloat16)
        assert torch.isfinite(logits).all()


FP8_PRESETS = {"llama-3.1-8b-fp8": "llama-3.1-8b", "qwen3-8b-fp8": "qwen3-8b",
               "llama-3.1-70b-fp8": None}


@pytest.mark.parametrize("name", sorted(FP8_PRESETS))
def test_fp8_bench_presets(tmp_path, name):
    from radixserve.bench import presets

    preset = presets.PRESETS[name]
    path = presets.build_preset(name, str(tmp_path / name))
    config = ModelConfig.from_path(path)
    quant = checkpoint_quant_config(config.hf_config, path)
    assert quant.method == "compressed-tensors"
    assert quant.scheme_for(["model.layers.0.mlp.down_proj"]) == Fp8Scheme("channel", "dynamic",
                                                                           True)
    base = FP8_PRESETS[name]
    if base is not None:      # the base model's published config, plus quantization_config
        assert {k: v for k, v in preset.config.items() if k != "quantization_config"} == \
            presets.PRESETS[base].config
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config, params_dtype=torch.bfloat16)
    params = dict(model.named_parameters())
    assert sum(p.numel() for n, p in params.items()
               if not n.endswith(("weight_scale", "input_scale"))) == preset.num_params
    fp8 = [n for n, p in params.items() if p.dtype == E4M3]
    assert len(fp8) == 4 * config.num_hidden_layers
    assert params["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert params["lm_head.weight"].dtype == torch.bfloat16


def test_quantization_flag(capsys):
    from radixserve import cli
    from radixserve.config import REFUSED_SGLANG_FLAGS

    assert "--quantization" not in REFUSED_SGLANG_FLAGS
    parser = cli.build_parser()
    for value in ("fp8", "compressed-tensors", "modelopt"):
        args = ServerArgs.from_cli_args(parser.parse_args(["serve", "--quantization", value]))
        assert args.quantization == value
        args.check()
    assert ServerArgs.from_cli_args(parser.parse_args(["serve"])).quantization is None
    assert cli.main(["serve", "--quantization", "int8"]) == 2
    assert "invalid choice: 'int8'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--quantization"):
        ServerArgs(quantization="awq").check()


def test_fp8_mlp_takes_the_gated_op_for_decode_sized_batches(tmp_path, monkeypatch):
    """The MLP of an FP8 model sends a decode-sized input (<= FP8_SKINNY_ROWS rows: weight-only
    math) through ops.fp8_skinny_gated_linear, whose CUDA form is one kernel, and a larger one
    through the projection then silu_and_mul; both give what the two separate layers give."""
    from radixserve import ops
    from radixserve.model import llama

    cfg = _tiny_config("llama")
    path = _write_dir(tmp_path, cfg, _tiny_weights(cfg, seed=11))
    model = load_model(path, ModelConfig.from_path(path), "auto", torch.bfloat16, "cpu",
                       quantization="fp8")
    mlp = model.model.layers[0].mlp
    calls = []
    real = ops.fp8_skinny_gated_linear

    def recorder(x, *args):
        calls.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(ops, "fp8_skinny_gated_linear", recorder)
    g = torch.Generator().manual_seed(3)
    for rows in (1, llama.FP8_SKINNY_ROWS, llama.FP8_SKINNY_ROWS + 1):
        x = torch.randn(rows, cfg["hidden_size"], generator=g).to(torch.bfloat16)
        want = mlp.down_proj(ops.silu_and_mul(mlp.gate_up_proj(x)))
        assert torch.equal(mlp(x), want)
    assert calls == [1, llama.FP8_SKINNY_ROWS]
