"""Build a model from a model directory: safetensors weights (single file or sharded), or random
("dummy") weights from config.json alone. Also resolves what --model-path names.

FP8 (quant/fp8.py): a checkpoint's quantization_config (or hf_quant_config.json) makes its linear
layers FP8 as it ships them; --quantization fp8 quantizes a bf16/fp16 checkpoint at load; dummy
weights of an FP8 config are random FP8 weights with per-channel scales.
"""
from __future__ import annotations

import glob
import json
import logging
import os
from typing import Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from tqdm.auto import tqdm

from radixserve.config import ModelConfig
from radixserve.model.architectures import get_model_class
from radixserve.quant.fp8 import FP8_DTYPE, init_dummy_fp8, resolve_quant_config

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "dummy")


def resolve_model_path(model_path: Optional[str]) -> str:
    """What --model-path names, as an HF-style directory.

    None -> the default model (downloaded and converted on first use); a directory with a
    config.json -> itself; a .gguf file -> converted once into the cache directory.
    Raises ValueError for anything else.
    """
    from radixserve.model import default_model

    if model_path is None:
        return default_model.default_model_path()
    if os.path.isdir(model_path):
        if not os.path.isfile(os.path.join(model_path, "config.json")):
            raise ValueError(f"model directory {model_path!r} has no config.json; pass an HF-style "
                             f"model directory or a .gguf file")
        return model_path
    if os.path.isfile(model_path) and model_path.endswith(".gguf"):
        return default_model.convert_cached(model_path, default_model.converted_dir_for(model_path))
    raise ValueError(f"model path {model_path!r} is neither a directory with config.json nor a "
                     f".gguf file")


def safetensors_files(model_path: str) -> List[str]:
    """The weight files of a directory: the shards named by model.safetensors.index.json if it
    exists, else every *.safetensors file. Raises ValueError when there are none."""
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = [os.path.join(model_path, name) for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors weights in {model_path!r}; convert the checkpoint "
                         f"to safetensors or use --load-format dummy")
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise ValueError(f"weight shards listed in the index are missing: {missing}")
    return files


def _iterate_safetensors(files: List[str]) -> Iterator[Tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in tqdm(files, desc="Loading safetensors", unit="file"):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _init_dummy(model: nn.Module, seed: int = 0) -> None:
    """Random weights with finite, moderate activations: normal(0, 0.02) for matrices and biases,
    ones for norm weights (as the real checkpoints start); FP8 layers get normal(0, 0.02)
    weights quantized per output channel (quant/fp8.py: init_dummy_fp8)."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    for name, param in model.named_parameters():
        if param.dtype == FP8_DTYPE or name.endswith(("weight_scale", "input_scale")):
            continue
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        else:
            param.data.normal_(0.0, 0.02, generator=gen)
    init_dummy_fp8(model, gen)


def load_model(model_path: str, model_config: ModelConfig, load_format: str,
               dtype: torch.dtype, device: str, quantization: Optional[str] = None,
               lm_head_optional: bool = False) -> nn.Module:
    """Build the model for model_config on device in dtype and fill its weights; eval mode.

    load_format: "auto"/"safetensors" read model_path's safetensors (sharded or not), checking
    that every parameter was filled; "dummy" draws random weights (no weight file is read, only
    the config). quantization: --quantization (None, fp8, compressed-tensors, modelopt); with the
    checkpoint's quantization_config it decides the FP8 layers (quant/fp8.py:
    resolve_quant_config); model.quant_config says what was built. Raises ValueError for an
    unknown format, architecture or quantization method, missing or unexpected tensors, or
    tensors of the wrong shape or dtype. lm_head_optional (--is-embedding): a checkpoint
    without lm_head.weight (an embedding model's backbone, e.g. Qwen3-Embedding) loads, with
    model.lm_head_loaded False (its LM head is not the checkpoint's: no logits may be read).
    """
    return load_model_shards(model_path, model_config, load_format, dtype, [device],
                             quantization, lm_head_optional)[0]


def load_model_shards(model_path: str, model_config: ModelConfig, load_format: str,
                      dtype: torch.dtype, devices: Sequence[Union[str, torch.device]],
                      quantization: Optional[str] = None,
                      lm_head_optional: bool = False) -> List[nn.Module]:
    """load_model for tensor parallelism: one shard per device, shard r built with (tp_rank r,
    tp_size len(devices)) on devices[r], so it allocates only its slices (heads, MLP columns,
    vocabulary rows; norms and the row-parallel biases whole). Safetensors: each tensor is read
    from the files once and every shard copies only its slice of it onto its device. Dummy
    weights: each shard draws its own from the same seed, so the parameters every rank holds
    whole (norms, biases after an all-reduce) are equal on every rank. One device: load_model."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load format {load_format!r} is not supported; use one of "
                         f"{', '.join(LOAD_FORMATS)}")
    model_cls = get_model_class(model_config.architecture)
    quant_config = resolve_quant_config(model_config.hf_config, quantization, model_path)
    tp_size = len(devices)
    shards = []
    for rank, device in enumerate(devices):
        with torch.device(device):
            # parameters allocated on device
            shard = model_cls(model_config, params_dtype=dtype, tp_rank=rank, tp_size=tp_size,
                              quant_config=quant_config)
        shard.quant_config = quant_config
        shards.append(shard)
    quant = "" if quant_config is None else f", quantization {quant_config.describe()}"
    where = str(devices[0]) if tp_size == 1 else \
        f"{', '.join(str(d) for d in devices)} as {tp_size} tensor-parallel shards"
    if load_format == "dummy":
        for shard in shards:
            _init_dummy(shard)
        logger.info("built %s with dummy weights on %s (%s%s)", model_config.architecture, where,
                    dtype, quant)
    else:
        files = safetensors_files(model_path)
        loaders = [shard.weight_loader() for shard in shards]
        for name, tensor in _iterate_safetensors(files):
            for loader in loaders:
                loader.feed(name, tensor)
        for shard, loader in zip(shards, loaders):
            missing = shard.expected_weights() - loader.finish()
            if missing == {("lm_head.weight", 0)}:
                if lm_head_optional:
                    shard.lm_head_loaded = False
                    missing = set()
                else:
                    raise ValueError(f"checkpoint in {model_path!r} has no lm_head.weight (an "
                                     f"embedding model's backbone?); serve it with "
                                     f"--is-embedding, or give a checkpoint with its LM head")
            if missing:
                names = sorted(f"{n}[{s}]" if s else n for n, s in missing)
                raise ValueError(f"checkpoint in {model_path!r} lacks {len(names)} tensors, e.g. "
                                 f"{names[:5]}")
        logger.info("loaded %s from %d file(s) on %s (%s%s)", model_config.architecture,
                    len(files), where, dtype, quant)
    return [shard.eval() for shard in shards]
