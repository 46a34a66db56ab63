"""GGUF file -> HF-style model directory (config.json, model.safetensors, tokenizer, chat template).

transformers does the hard parts: dequantization (Q4_0/Q4_1/Q8_0/K-quants...) and undoing the
row permutation llama.cpp applies to Q/K weights. We load the GGUF as a float32 model and save
it unquantized, together with its tokenizer and generation config. `radixserve convert` calls
convert_gguf; default_model.py calls it once per cache entry.
"""
from __future__ import annotations

import json
import logging
import os

logger = logging.getLogger(__name__)


def convert_gguf(gguf_path: str, out_dir: str) -> str:
    """Write an HF-style directory for gguf_path into out_dir (created if needed); return out_dir.

    Weights are saved as float32 safetensors (the parity oracle runs in fp32). The tokenizer is
    saved as tokenizer.json + tokenizer_config.json (with "chat_template" when the GGUF has one)
    and generation_config.json carries the EOS/BOS ids. Raises ValueError when gguf_path is not
    a file. Writes only inside out_dir; not atomic (see default_model.convert_cached for that).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.isfile(gguf_path):
        raise ValueError(f"GGUF file {gguf_path!r} does not exist")
    gguf_dir, gguf_name = os.path.split(os.path.abspath(gguf_path))
    os.makedirs(out_dir, exist_ok=True)
    logger.info("converting %s into %s (dequantizing to float32)", gguf_path, out_dir)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    # The GGUF quantizer marks the model "not serializable"; after loading, the weights are plain
    # float32 tensors, so dropping the quantizer and its config saves an ordinary checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    tokenizer.save_pretrained(out_dir)
    _embed_chat_template(out_dir, tokenizer.chat_template)
    del model
    logger.info("converted %s", gguf_path)
    return out_dir


def _embed_chat_template(out_dir: str, chat_template) -> None:
    """Also store the chat template inside tokenizer_config.json (older readers look only there)."""
    if not chat_template:
        return
    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path) as f:
        config = json.load(f)
    config["chat_template"] = chat_template
    with open(path, "w") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
