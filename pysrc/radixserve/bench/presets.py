"""Real model shapes in one command: a model directory with a published config.json and a
generated tokenizer of the same vocabulary, to serve with `--load-format dummy`.

    radixserve bench presets llama-3.1-8b --out /tmp/llama-3.1-8b
    python -m radixserve.launch_server --model-path /tmp/llama-3.1-8b --load-format dummy

A preset directory holds:
  config.json             the published HF config of the (Instruct) model, field for field
  generation_config.json  its bos / eos ids
  tokenizer.json          a byte-level BPE built here with `tokenizers`: the 256 byte symbols,
                          then synthetic letter pieces (each reachable by a merge chain), the
                          real special tokens at their real ids, and filler pieces up to
                          config.vocab_size, so every id in [0, vocab_size) decodes to text and
                          any text encodes (byte fallback) and decodes back unchanged
  tokenizer_config.json   bos / eos tokens and a short chat template of the model's format

The weights are not real: the point is the shapes (parameter count, KV size per token, vocab,
GQA layout), which is what serving speed depends on. Building takes a few seconds.

The -fp8 presets (llama-3.1-8b-fp8, qwen3-8b-fp8, llama-3.1-70b-fp8) add the quantization_config
of the model's FP8_DYNAMIC release to its config.json: with `--load-format dummy` the linear
layers are random FP8 weights with per-channel scales (model/loader.py), the rest bf16.
llama-3.1-70b and qwen3-32b are the bf16 models for tensor-parallel runs (--tp-size N).
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import string
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

LLAMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
    "\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _llama3_specials() -> List[str]:
    """Llama 3.x's 256 special tokens, in id order from 128000."""
    named = {0: "<|begin_of_text|>", 1: "<|end_of_text|>", 4: "<|finetune_right_pad_id|>",
             6: "<|start_header_id|>", 7: "<|end_header_id|>", 8: "<|eom_id|>", 9: "<|eot_id|>",
             10: "<|python_tag|>"}
    out, reserved = [], 0
    for i in range(256):
        if i in named:
            out.append(named[i])
        else:
            out.append(f"<|reserved_special_token_{reserved}|>")
            reserved += 1
    return out


def _qwen2_specials() -> List[str]:
    """Qwen2.5's 22 special tokens, in id order from 151643."""
    return ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
            "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
            "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
            "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
            "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]


def _qwen3_specials() -> List[str]:
    """Qwen3's 26 added tokens, in id order from 151643: Qwen2.5's and the tool-response and
    thinking tags."""
    return _qwen2_specials() + ["<tool_response>", "</tool_response>", "<think>", "</think>"]


def _smollm2_specials() -> List[str]:
    """SmolLM2's 17 special tokens, ids 0..16."""
    return ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<reponame>",
            "<file_sep>", "<filename>", "<gh_stars>", "<issue_start>", "<issue_comment>",
            "<issue_closed>", "<jupyter_start>", "<jupyter_text>", "<jupyter_code>",
            "<jupyter_output>", "<jupyter_script>", "<empty_output>"]


@dataclass(frozen=True)
class Preset:
    """One model: its published config.json, where its special tokens sit, how it chats."""
    hf_name: str                      # the checkpoint whose config this is
    config: Dict
    special_tokens: List[str]
    special_start: int                # id of special_tokens[0]
    bos_token: Optional[str]
    eos_token: str
    chat_template: str
    add_bos: bool                     # the tokenizer prepends bos_token (Llama 3) or not
    generation: Dict = field(default_factory=dict)
    num_params: int = 0               # the published parameter count (embeddings included)


_LLAMA3_ROPE_8K = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}
_LLAMA_COMMON = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                 "attention_bias": False, "attention_dropout": 0.0, "hidden_act": "silu",
                 "initializer_range": 0.02, "mlp_bias": False, "pretraining_tp": 1,
                 "torch_dtype": "bfloat16", "use_cache": True}

# what Qwen2.5 and Qwen3 share: ChatML, no BOS, their special tokens from 151643, the ids
# generation_config.json names
_QWEN_CHAT = dict(special_start=151643, bos_token=None, eos_token="<|im_end|>",
                  chat_template=CHATML_TEMPLATE, add_bos=False)
_QWEN_GEN_IDS = {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643}

PRESETS: Dict[str, Preset] = {
    "llama-3.1-8b": Preset(
        hf_name="meta-llama/Llama-3.1-8B-Instruct",
        config={**_LLAMA_COMMON, "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072,
                "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
                "rope_scaling": {**_LLAMA3_ROPE_8K, "factor": 8.0},
                "tie_word_embeddings": False, "bos_token_id": 128000,
                "eos_token_id": [128001, 128008, 128009]},
        special_tokens=_llama3_specials(), special_start=128000,
        bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
        chat_template=LLAMA3_CHAT_TEMPLATE, add_bos=True,
        generation={"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
                    "do_sample": True, "temperature": 0.6, "top_p": 0.9},
        num_params=8_030_261_248),
    "llama-3.2-1b": Preset(
        hf_name="meta-llama/Llama-3.2-1B-Instruct",
        config={**_LLAMA_COMMON, "hidden_size": 2048, "intermediate_size": 8192,
                "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
                "head_dim": 64, "vocab_size": 128256, "max_position_embeddings": 131072,
                "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
                "rope_scaling": {**_LLAMA3_ROPE_8K, "factor": 32.0},
                "tie_word_embeddings": True, "bos_token_id": 128000,
                "eos_token_id": [128001, 128008, 128009]},
        special_tokens=_llama3_specials(), special_start=128000,
        bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
        chat_template=LLAMA3_CHAT_TEMPLATE, add_bos=True,
        generation={"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
                    "do_sample": True, "temperature": 0.6, "top_p": 0.9},
        num_params=1_235_814_400),
    "qwen2.5-7b": Preset(
        hf_name="Qwen/Qwen2.5-7B-Instruct",
        config={"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                "attention_dropout": 0.0, "hidden_act": "silu", "initializer_range": 0.02,
                "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                "num_attention_heads": 28, "num_key_value_heads": 4, "head_dim": 128,
                "vocab_size": 152064, "max_position_embeddings": 32768, "max_window_layers": 28,
                "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "rope_scaling": None,
                "sliding_window": 131072, "use_sliding_window": False,
                "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
                "bos_token_id": 151643, "eos_token_id": 151645},
        special_tokens=_qwen2_specials(), **_QWEN_CHAT,
        generation={**_QWEN_GEN_IDS, "do_sample": True, "temperature": 0.7, "top_p": 0.8,
                    "top_k": 20, "repetition_penalty": 1.05},
        num_params=7_615_616_512),
    "qwen3-8b": Preset(
        hf_name="Qwen/Qwen3-8B",
        config={"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                "attention_bias": False, "attention_dropout": 0.0, "hidden_act": "silu",
                "initializer_range": 0.02, "hidden_size": 4096, "intermediate_size": 12288,
                "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
                "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
                "max_window_layers": 36, "rms_norm_eps": 1e-06, "rope_theta": 1000000,
                "rope_scaling": None, "sliding_window": None, "use_sliding_window": False,
                "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
                "bos_token_id": 151643, "eos_token_id": 151645},
        special_tokens=_qwen3_specials(), **_QWEN_CHAT,
        generation={**_QWEN_GEN_IDS, "do_sample": True, "temperature": 0.6, "top_p": 0.95,
                    "top_k": 20},
        num_params=8_190_735_360),
    "smollm2-135m": Preset(
        hf_name="HuggingFaceTB/SmolLM2-135M-Instruct",
        config={**_LLAMA_COMMON, "hidden_size": 576, "intermediate_size": 1536,
                "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                "head_dim": 64, "vocab_size": 49152, "max_position_embeddings": 8192,
                "rms_norm_eps": 1e-05, "rope_theta": 100000.0, "rope_scaling": None,
                "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
                "pad_token_id": 2},
        special_tokens=_smollm2_specials(), special_start=0,
        bos_token="<|im_start|>", eos_token="<|im_end|>", chat_template=CHATML_TEMPLATE,
        add_bos=False, generation={"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2},
        num_params=134_515_008),
}


# FP8 checkpoints (issue 35): the base model's published config plus the quantization_config its
# FP8 release carries. llm-compressor's FP8_DYNAMIC scheme (RedHatAI, formerly neuralmagic):
# e4m3 weights with a static scale per output channel, activations quantized per token at run
# time, the LM head left out; the fields are the ones that tool writes (its version-specific
# bookkeeping, global_compression_ratio and version, left null / out).
def _fp8_dynamic_args(strategy: str, dynamic: bool, observer: Optional[str]) -> Dict:
    return {"actorder": None, "block_structure": None, "dynamic": dynamic, "group_size": None,
            "num_bits": 8, "observer": observer, "observer_kwargs": {}, "strategy": strategy,
            "symmetric": True, "type": "float"}


FP8_DYNAMIC_QUANTIZATION_CONFIG = {
    "config_groups": {"group_0": {
        "input_activations": _fp8_dynamic_args("token", True, None),
        "output_activations": None,
        "targets": ["Linear"],
        "weights": _fp8_dynamic_args("channel", False, "minmax")}},
    "format": "float-quantized",
    "global_compression_ratio": None,
    "ignore": ["lm_head"],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}


def _fp8_preset(base: Preset, hf_name: str, config: Optional[Dict] = None) -> Preset:
    """base's model (or `config`, same tokenizer and chat format) as its FP8_DYNAMIC release:
    `--load-format dummy` makes random FP8 weights with per-channel scales for it."""
    return dataclasses.replace(base, hf_name=hf_name, config={
        **(config or base.config), "quantization_config": FP8_DYNAMIC_QUANTIZATION_CONFIG})


PRESETS["llama-3.1-8b-fp8"] = _fp8_preset(PRESETS["llama-3.1-8b"],
                                          "RedHatAI/Meta-Llama-3.1-8B-Instruct-FP8-dynamic")
PRESETS["qwen3-8b-fp8"] = _fp8_preset(PRESETS["qwen3-8b"], "RedHatAI/Qwen3-8B-FP8-dynamic")
# Llama-3.1-70B-Instruct: the 8B's family (tokenizer, chat format, rope), 80 layers of 8192
PRESETS["llama-3.1-70b-fp8"] = dataclasses.replace(
    _fp8_preset(PRESETS["llama-3.1-8b"], "RedHatAI/Meta-Llama-3.1-70B-Instruct-FP8-dynamic",
                {**PRESETS["llama-3.1-8b"].config, "hidden_size": 8192,
                 "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
                 "num_key_value_heads": 8}),
    num_params=70_553_706_496)

# Tensor-parallel runs (issue 37, --tp-size N): bf16 models too large for one GPU, as published.
# Llama-3.1-70B-Instruct: the 8B's family (tokenizer, chat format, rope), 80 layers of 8192
# (64 query heads, 8 KV heads: up to TP=8 without replicating KV heads).
PRESETS["llama-3.1-70b"] = dataclasses.replace(
    PRESETS["llama-3.1-8b"], hf_name="meta-llama/Llama-3.1-70B-Instruct",
    config={**PRESETS["llama-3.1-8b"].config, "hidden_size": 8192, "intermediate_size": 28672,
            "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8},
    num_params=70_553_706_496)
# Qwen3-32B: Qwen3-8B's family (tokenizer, ChatML, sampling defaults), 64 layers of 5120 with
# 64 query heads of 128 (8192 wide) and 8 KV heads, untied LM head
PRESETS["qwen3-32b"] = dataclasses.replace(
    PRESETS["qwen3-8b"], hf_name="Qwen/Qwen3-32B",
    config={**PRESETS["qwen3-8b"].config, "hidden_size": 5120, "intermediate_size": 25600,
            "num_hidden_layers": 64, "max_window_layers": 64, "num_attention_heads": 64,
            "num_key_value_heads": 8},
    num_params=32_762_123_264)


def ordinary_vocab_end(preset: Preset) -> int:
    """Ids below this are ordinary text pieces (no special token): where benchmark prompts draw
    their token ids from. Special tokens sit at the top of Llama 3's and Qwen's vocabularies and
    at the bottom of SmolLM2's."""
    return preset.special_start if preset.special_start else preset.config["vocab_size"]


# ----------------------------------------------------------------------------- the tokenizer

def _byte_symbols() -> List[str]:
    """GPT-2's byte-to-unicode table: the printable symbol standing for each byte 0..255."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    symbols, extra = {}, 0
    for b in range(256):
        if b in keep:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def _synthetic_pieces(count: int) -> List[Tuple[str, str]]:
    """count (left, right) merges over lowercase letters, optionally after the space symbol "Ġ":
    every 2- and 3-letter piece, then 4-letter pieces in a fixed scattered order. Each piece's
    left part is an earlier piece or a byte symbol, so all of them are reachable by BPE."""
    letters = string.ascii_lowercase
    merges: List[Tuple[str, str]] = []
    for length in itertools.count(2):
        layer = [("Ġ" + "".join(p[:-1]), p[-1]) for p in itertools.product(letters, repeat=length - 1)]
        layer += [("".join(p[:-1]), p[-1]) for p in itertools.product(letters, repeat=length)]
        if len(merges) + len(layer) > count:
            # a deterministic stride through the layer, so the chosen pieces are spread over it
            stride = 7919  # prime, coprime with the layer sizes (multiples of 26)
            picked = [layer[(i * stride) % len(layer)] for i in range(count - len(merges))]
            return merges + picked
        merges += layer


def build_tokenizer(preset: Preset):
    """A `tokenizers.Tokenizer` whose vocabulary is exactly config.vocab_size ids: byte symbols,
    synthetic merged pieces, the preset's special tokens at their real ids, filler pieces."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    vocab_size = preset.config["vocab_size"]
    num_special = len(preset.special_tokens)
    special_end = preset.special_start + num_special
    symbols = _byte_symbols()
    num_regular = preset.special_start if preset.special_start else vocab_size - num_special
    if preset.special_start == 0:
        regular_ids = range(num_special, vocab_size)
    else:
        regular_ids = itertools.chain(range(preset.special_start), range(special_end, vocab_size))
    # ordinary pieces: bytes, merged pieces, then fillers for ids past the real vocabulary
    num_fill = vocab_size - special_end if preset.special_start else 0
    merges = _synthetic_pieces(num_regular - len(symbols))
    pieces = symbols + [a + b for a, b in merges]
    pieces += [f"<|vocab_filler_{i}|>" for i in range(num_fill)]
    vocab: Dict[str, int] = {}
    for tid, piece in zip(regular_ids, pieces):
        vocab[piece] = tid
    for i, tok in enumerate(preset.special_tokens):
        vocab[tok] = preset.special_start + i
    assert len(vocab) == vocab_size, (len(vocab), vocab_size)

    tok = Tokenizer(BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # special tokens keep their ids (they are in the vocabulary already)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in preset.special_tokens])
    if preset.add_bos:
        bos_id = vocab[preset.bos_token]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{preset.bos_token}:0 $A:0", pair=f"{preset.bos_token}:0 $A:0 $B:1",
            special_tokens=[(preset.bos_token, bos_id)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


# ----------------------------------------------------------------------------- the directory

def _write_json(path: str, obj: Dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def build_preset(name: str, out_dir: str) -> str:
    """Write preset `name`'s model directory into out_dir (created; files overwritten) and
    return out_dir. Raises KeyError naming the presets when name is unknown."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    preset = PRESETS[name]
    os.makedirs(out_dir, exist_ok=True)
    _write_json(os.path.join(out_dir, "config.json"),
                {**preset.config, "_name_or_path": preset.hf_name,
                 "_radixserve_preset": f"{name}: published config, dummy weights, generated tokenizer"})
    _write_json(os.path.join(out_dir, "generation_config.json"), preset.generation)
    build_tokenizer(preset).save(os.path.join(out_dir, "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": preset.bos_token,
        "eos_token": preset.eos_token,
        "add_bos_token": preset.add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": preset.config["max_position_embeddings"],
        "chat_template": preset.chat_template,
    }
    if "pad_token_id" in preset.generation:
        tok_config["pad_token"] = preset.special_tokens[preset.generation["pad_token_id"]
                                                        - preset.special_start]
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), tok_config)
    return out_dir


def main(argv=None) -> str:
    """`radixserve bench presets NAME --out DIR`: build the directory, print and return its path."""
    p = argparse.ArgumentParser(prog="radixserve bench presets", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", choices=sorted(PRESETS))
    p.add_argument("--out", required=True, help="directory to write (created)")
    args = p.parse_args(argv)
    out = build_preset(args.name, args.out)
    print(out)
    return out
