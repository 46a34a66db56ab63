"""FP8 (e4m3) linear layers: which layers are FP8 and how (QuantConfig), where that comes from
(a checkpoint's quantization_config, or --quantization fp8), and how FP8 tensors load into the
tensor-parallel layers of model/llama.py.

Layouts read (weights stay [out, in] as nn.Linear stores them; names are HF's):
  <module>.weight        float8_e4m3fn [N, K]
  <module>.weight_scale  fp32 or bf16: [N, 1] or [N] per output channel, [1] or [] per tensor
  <module>.input_scale   [1] or []: a static per-tensor activation scale (static schemes only)
    compressed-tensors   config.json quantization_config {"quant_method": "compressed-tensors",
                         "format": "float-quantized", "config_groups": {...}, "ignore": [...]}:
                         llm-compressor's FP8_DYNAMIC (weights strategy "channel", activations
                         strategy "token" dynamic) and FP8 (weights and activations "tensor",
                         activations static) schemes, and FP8 weight-only groups
    modelopt             NVIDIA ModelOpt's HF export: quantization_config {"quant_method":
                         "modelopt", "quant_algo": "FP8", ...} in config.json, or the older
                         hf_quant_config.json {"producer": {"name": "modelopt"}, "quantization":
                         {"quant_algo": "FP8", "exclude_modules": [...]}}; per-tensor weight and
                         static input scales (also FP8_PER_CHANNEL_PER_TOKEN: channel weights,
                         dynamic tokens)
    fp8                  AutoFP8's {"quant_method": "fp8", "activation_scheme": "static" |
                         "dynamic"}: per-tensor weight scales (block-wise FP8, weight_block_size,
                         is refused)
Anything else in quantization_config stops the start with a ValueError naming the method.

In the model every FP8 layer holds weight [N_local, K_local] e4m3, weight_scale [N_local] fp32
(one scale per output row: a checkpoint's per-tensor scale is expanded over the rows of its
shard, exact, so a fused q|k|v or gate|up keeps each part's own scale), and for static schemes
input_scale [1] fp32 (the max over the parts of a fused layer, as they share one input).
Column-parallel layers shard weight and scales by output rows; row-parallel layers shard the
weight's input columns and keep every output channel's scale whole. --quantization fp8 quantizes
each row of a bf16/fp16 weight before any column split (quantize_weight_per_channel), so every
rank holds the scales of a single-device model. The LM head and the embeddings never are FP8.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import json
import logging
import os
import re
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from radixserve.config import QUANTIZATION_METHODS
from radixserve.ops.reference import FP8_DTYPE, fp8_cast, fp8_scale_of

logger = logging.getLogger(__name__)

# --quantization's values (SGLang's names, config.QUANTIZATION_METHODS): fp8 quantizes an
# unquantized checkpoint at load (an FP8 checkpoint loads as it ships); the others name a
# checkpoint format, which must match

WEIGHT_STRATEGIES = ("channel", "tensor")
ACTIVATION_MODES = ("dynamic", "static", "none")


@dataclasses.dataclass(frozen=True)
class Fp8Scheme:
    """How one linear layer is FP8.

    weight:     "channel" (the checkpoint scales each output row) or "tensor" (one scale); the
                layer holds per-row scales either way
    activation: "dynamic" (per-token scales computed on the fly), "static" (the checkpoint's
                per-tensor input_scale) or "none" (weight-only: the GEMM runs in the model dtype)
    checkpoint: True when the weights arrive in FP8 with their scales; False when bf16/fp16
                weights are quantized at load (--quantization fp8)
    """
    weight: str
    activation: str
    checkpoint: bool

    def __post_init__(self):
        if self.weight not in WEIGHT_STRATEGIES or self.activation not in ACTIVATION_MODES:
            raise ValueError(f"bad Fp8Scheme {self}")
        if self.activation == "static" and not self.checkpoint:
            raise ValueError("static activation scales come from a checkpoint")

    def expects(self, name: str) -> bool:
        """Whether a complete checkpoint holds parameter `name` (weight, weight_scale,
        input_scale) of a layer of this scheme."""
        if name == "weight_scale":
            return self.checkpoint
        if name == "input_scale":
            return self.activation == "static"
        return True

    def describe(self) -> str:
        acts = {"dynamic": "dynamic per-token activations", "static":
                "static per-tensor activations", "none": "weight-only"}[self.activation]
        return f"per-{self.weight} e4m3 weights, {acts}"


class Fp8Activation(NamedTuple):
    """An activation already quantized for a W8A8 GEMM (rmsnorm_quant_fp8's output): the FP8 layers
    of model/llama.py take it in place of a tensor."""
    data: torch.Tensor     # [M, K] float8_e4m3fn
    scale: torch.Tensor    # [M, 1] fp32
    dtype: torch.dtype     # the model dtype the GEMM writes

    @property
    def shape(self) -> torch.Size:
        return self.data.shape


def _matches(pattern: str, name: str) -> bool:
    """A module name against an ignore / target entry: "re:REGEX" (re.match, compressed-tensors'
    rule), a glob with * ? [ (ModelOpt's exclude_modules), else the name itself or a parent of
    it."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return name == pattern or name.startswith(pattern + ".")


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """FP8 linear layers of a model. method: "fp8" (quantized at load, or an AutoFP8
    checkpoint), "compressed-tensors" or "modelopt". groups: (targets, scheme) in order, the
    first whose target matches a module wins ("Linear" matches every linear layer). ignore:
    modules left in the model dtype. kv_cache: what the checkpoint says of KV-cache
    quantization (not applied here: --kv-cache-dtype sets the cache)."""
    method: str
    groups: Tuple[Tuple[Tuple[str, ...], Fp8Scheme], ...]
    ignore: Tuple[str, ...] = ()
    kv_cache: Optional[str] = None

    def ignored(self, name: str) -> bool:
        return any(_matches(p, name) for p in self.ignore)

    def _group_scheme(self, name: str) -> Optional[Fp8Scheme]:
        for targets, scheme in self.groups:
            if any(t == "Linear" or _matches(t, name) for t in targets):
                return scheme
        return None

    def scheme_for(self, names: Sequence[str], fused_name: Optional[str] = None) -> Optional[Fp8Scheme]:
        """The scheme of the linear layer whose checkpoint modules are `names` (q_proj, k_proj,
        v_proj of a fused q|k|v; one name otherwise), or None when it stays unquantized (any of
        them, or fused_name, ignored, or no group targets it). ValueError when the parts of a
        fused layer are quantized differently."""
        if any(self.ignored(n) for n in names) or (fused_name and self.ignored(fused_name)):
            return None
        schemes = {self._group_scheme(n) for n in names}
        if len(schemes) > 1:
            raise ValueError(f"quantization_config quantizes {', '.join(names)} differently; "
                             f"radixserve fuses them into one layer, which takes one scheme")
        return schemes.pop()

    @property
    def checkpoint(self) -> bool:
        return any(s.checkpoint for _, s in self.groups)

    def describe(self) -> str:
        """One line for the start-up log: the method and each scheme."""
        schemes = sorted({s.describe() for _, s in self.groups})
        where = "FP8 checkpoint" if self.checkpoint else "quantized at load"
        text = f"{self.method} ({where}: {'; '.join(schemes)})"
        if self.kv_cache:
            text += f"; the checkpoint's KV-cache quantization {self.kv_cache!r} is not applied " \
                    f"(--kv-cache-dtype sets the cache)"
        return text


# --quantization fp8 on an unquantized checkpoint: per-output-channel weights, per-token activations
ONLINE_FP8 = QuantConfig("fp8", ((("Linear",), Fp8Scheme("channel", "dynamic", False)),))


def _unsupported(what: str) -> ValueError:
    return ValueError(
        f"{what} is not supported: radixserve loads FP8 checkpoints in the compressed-tensors "
        f"format (llm-compressor's FP8 / FP8_DYNAMIC: float-quantized, channel or tensor weight "
        f"scales) and NVIDIA ModelOpt's FP8 export, and quantizes bf16/fp16 checkpoints at load "
        f"with --quantization fp8")


def _check_fp8_args(args: Dict[str, Any], where: str) -> None:
    if args.get("type", "float") != "float" or int(args.get("num_bits", 8)) != 8:
        raise _unsupported(f"compressed-tensors {where} of type {args.get('type')!r} with "
                           f"{args.get('num_bits')} bits")
    if args.get("symmetric") is False:
        raise _unsupported(f"compressed-tensors {where}: asymmetric quantization")


def _compressed_tensors(qc: Dict[str, Any]) -> QuantConfig:
    sparsity = qc.get("sparsity_config") or {}
    if sparsity.get("format") not in (None, "dense"):
        raise _unsupported(f"compressed-tensors sparsity format {sparsity.get('format')!r}")
    groups = []
    for gname, group in (qc.get("config_groups") or {}).items():
        fmt = group.get("format") or qc.get("format")
        if fmt != "float-quantized":
            raise _unsupported(f"compressed-tensors format {fmt!r} (config group {gname})")
        weights = group.get("weights") or {}
        _check_fp8_args(weights, f"config group {gname} weights")
        strategy = weights.get("strategy")
        if strategy not in WEIGHT_STRATEGIES or weights.get("dynamic") or \
                weights.get("group_size") or weights.get("block_structure"):
            raise _unsupported(f"compressed-tensors FP8 weights with strategy {strategy!r} "
                               f"(config group {gname}; block- and group-wise scales are not "
                               f"implemented)")
        acts = group.get("input_activations")
        if not acts:
            mode = "none"
        else:
            _check_fp8_args(acts, f"config group {gname} input_activations")
            a_strategy, dynamic = acts.get("strategy"), acts.get("dynamic")
            if a_strategy == "token" and dynamic is True:
                mode = "dynamic"
            elif a_strategy == "tensor" and dynamic is False:
                mode = "static"
            elif a_strategy == "tensor" and dynamic is True:
                mode = "dynamic"       # per-token scales: finer than the per-tensor one it asks for
            else:
                raise _unsupported(f"compressed-tensors FP8 activations with strategy "
                                   f"{a_strategy!r}, dynamic {dynamic!r} (config group {gname})")
        if group.get("output_activations"):
            raise _unsupported(f"compressed-tensors output_activations (config group {gname})")
        groups.append((tuple(group.get("targets") or ("Linear",)),
                       Fp8Scheme(strategy, mode, True)))
    if not groups:
        raise _unsupported("a compressed-tensors quantization_config without config_groups")
    kv = qc.get("kv_cache_scheme")
    kv_text = None if not kv else f"{kv.get('type', '?')}{kv.get('num_bits', '')}"
    return QuantConfig("compressed-tensors", tuple(groups), tuple(qc.get("ignore") or ()), kv_text)


def _modelopt(qc: Dict[str, Any]) -> QuantConfig:
    inner = qc["quantization"] if isinstance(qc.get("quantization"), dict) else qc
    algo = str(inner.get("quant_algo") or "").upper()
    if algo == "FP8":
        scheme = Fp8Scheme("tensor", "static", True)
    elif algo == "FP8_PER_CHANNEL_PER_TOKEN":
        scheme = Fp8Scheme("channel", "dynamic", True)
    else:
        raise _unsupported(f"ModelOpt quant_algo {inner.get('quant_algo')!r} (FP8 and "
                           f"FP8_PER_CHANNEL_PER_TOKEN are)")
    ignore = inner.get("exclude_modules") or inner.get("ignore") or qc.get("ignore") or ()
    return QuantConfig("modelopt", ((("Linear",), scheme),), tuple(ignore),
                       inner.get("kv_cache_quant_algo"))


def _autofp8(qc: Dict[str, Any]) -> QuantConfig:
    if qc.get("weight_block_size"):
        raise _unsupported(f"quant_method 'fp8' with weight_block_size "
                           f"{qc.get('weight_block_size')} (block-wise FP8, as in Qwen3-*-FP8 "
                           f"and DeepSeek-V3)")
    act = qc.get("activation_scheme", "dynamic")
    if act not in ("static", "dynamic"):
        raise _unsupported(f"quant_method 'fp8' with activation_scheme {act!r}")
    ignore = qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ()
    return QuantConfig("fp8", ((("Linear",), Fp8Scheme("tensor", act, True)),), tuple(ignore),
                       qc.get("kv_cache_scheme") if isinstance(qc.get("kv_cache_scheme"), str)
                       else None)


def checkpoint_quant_config(hf_config: Dict[str, Any],
                            model_path: Optional[str] = None) -> Optional[QuantConfig]:
    """The FP8 layers a checkpoint ships: from config.json's quantization_config (or the older
    compression_config key), else ModelOpt's hf_quant_config.json beside it; None for an
    unquantized checkpoint. ValueError naming the method for anything not supported."""
    qc = hf_config.get("quantization_config") or hf_config.get("compression_config")
    if qc is None and model_path:
        sidecar = os.path.join(model_path, "hf_quant_config.json")
        if os.path.isfile(sidecar):
            with open(sidecar) as f:
                data = json.load(f)
            producer = (data.get("producer") or {}).get("name", "modelopt")
            if producer != "modelopt":
                raise _unsupported(f"hf_quant_config.json of producer {producer!r}")
            qc = {"quant_method": "modelopt", **data}
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"config.json's quantization_config must be an object, got {qc!r}")
    method = str(qc.get("quant_method") or ("compressed-tensors" if "config_groups" in qc
                                            else "")).lower()
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "modelopt":
        return _modelopt(qc)
    if method == "fp8":
        return _autofp8(qc)
    raise _unsupported(f"quantization_config quant_method {qc.get('quant_method')!r}")


def resolve_quant_config(hf_config: Dict[str, Any], quantization: Optional[str] = None,
                         model_path: Optional[str] = None) -> Optional[QuantConfig]:
    """What the model's linear layers are, from the checkpoint and --quantization:
    an FP8 checkpoint loads as it ships (--quantization fp8, or its own method name, may be
    given too); --quantization fp8 on an unquantized checkpoint quantizes it at load
    (ONLINE_FP8); no flag and no quantization_config: None (the model dtype). ValueError naming
    the flag or the method otherwise."""
    ckpt = checkpoint_quant_config(hf_config, model_path)
    if quantization is None:
        return ckpt
    if quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"--quantization {quantization!r} is not supported; use one of "
                         f"{', '.join(QUANTIZATION_METHODS)}")
    if ckpt is None:
        if quantization == "fp8":
            return ONLINE_FP8
        raise ValueError(f"--quantization {quantization}: the checkpoint has no quantization_config "
                         f"of that format (it is unquantized); --quantization fp8 quantizes it at "
                         f"load")
    if quantization in ("fp8", ckpt.method):
        if quantization != ckpt.method:
            logger.info("--quantization %s: the checkpoint is FP8 already (%s); its scales are "
                        "used", quantization, ckpt.method)
        return ckpt
    raise ValueError(f"--quantization {quantization} does not match the checkpoint's "
                     f"quantization_config ({ckpt.method})")


# ----------------------------------------------------------------------------- weights


# The per-row scales --quantization fp8 tries (as llm-compressor's MSE observer does): amax * c /
# 448 for each c here, 0.70 to 1.00 in steps of 0.02 (c < 1 clips the row's largest values to
# +-448 and moves every other value onto a different part of e4m3's grid). The row keeps the c
# whose dequantized row has the least squared error; c = 1 (the plain absmax scale) comes first
# and is replaced only by a strictly smaller error, so no row is worse than absmax. On the default
# model (tests/unit/test_fp8_accuracy.py: 64 x 64 positions, W8A8 prefill) the mean KL to bf16
# fell from 0.0385 to 0.0307 nats, top-1 agreement from 0.895 to 0.899. In a trial on 32 x 64
# positions, 31 steps over the same range gave 0.0279 and 64 over 0.50-1.00 0.0293 (against
# 0.0294 for these 16): weight error is not the logits' error, and each step is one more
# quantization pass at load, so 16 it is.
SCALE_SEARCH = tuple((50 - i) / 50 for i in range(16))        # 1.00, 0.98, ..., 0.70


def quantize_weight_per_channel(w: torch.Tensor,
                                search: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (any float dtype) -> (w_fp8 [N, K] float8_e4m3fn, scale [N] fp32) with
    w[n] ~= w_fp8[n].float() * scale[n]: scale = amax(|w[n]|) * c / 448 (amax floored at
    FP8_MIN_AMAX) and w_fp8 = (w / scale) clamped to +-448, rounded to e4m3. search: c is the
    SCALE_SEARCH value of least squared error per row (ties keep the earlier c), else 1 (the
    plain absmax scale). In slices of rows (bounded fp32 copies: about 4 x 64 MiB at a time)."""
    rows = w.shape[0]
    q = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
    scale = torch.empty(rows, dtype=torch.float32, device=w.device)
    step = max(1, (16 << 20) // max(1, w.shape[1]))
    for start in range(0, rows, step):
        part = w[start:start + step].float()                             # [rows, K]
        amax = part.abs().amax(dim=1, keepdim=True)                      # [rows, 1]
        best_s = fp8_scale_of(amax)
        best_q = fp8_cast(part, best_s)
        if search:
            best_err = _row_sq_error(part, best_q, best_s)
            for c in SCALE_SEARCH[1:]:
                s = fp8_scale_of(amax * c)
                cand = fp8_cast(part, s)
                err = _row_sq_error(part, cand, s)
                better = err < best_err                                  # [rows, 1]
                best_q = torch.where(better, cand, best_q)
                best_s = torch.where(better, s, best_s)
                best_err = torch.where(better, err, best_err)
        q[start:start + step] = best_q
        scale[start:start + step] = best_s[:, 0]
    return q, scale


def _row_sq_error(part: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    # sum over k of (q * s - w)^2 per row: [rows, 1] fp32
    return (q.float() * s - part).square_().sum(dim=1, keepdim=True)


def init_fp8_params(layer: torch.nn.Module, rows: int, cols: int, scheme: Fp8Scheme) -> None:
    """Give a linear layer its FP8 parameters: weight [rows, cols] e4m3, weight_scale [rows]
    fp32 (ones), input_scale [1] fp32 (zero until loaded: the max over a fused layer's parts)
    for static schemes, else None."""
    layer.quant = scheme
    layer.weight = torch.nn.Parameter(torch.empty(rows, cols, dtype=FP8_DTYPE),
                                      requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(torch.ones(rows, dtype=torch.float32),
                                            requires_grad=False)
    if scheme.activation == "static":
        layer.input_scale = torch.nn.Parameter(torch.zeros(1, dtype=torch.float32),
                                               requires_grad=False)
    else:
        layer.input_scale = None


def load_fp8_tensor(layer: torch.nn.Module, name: str, loaded: torch.Tensor, what: str,
                    full_rows: int, src_start: int, rows: int, dst_offset: int,
                    cols: Optional[Tuple[int, int]] = None) -> None:
    """Load checkpoint tensor `name` (weight, weight_scale, input_scale) of one logical output
    into an FP8 layer: rows [src_start, src_start + rows) of the checkpoint's full_rows go to
    rows [dst_offset, ...) of the layer; cols (start, width): the weight's input columns the
    layer holds (row-parallel), None for all. A bf16/fp16 weight of an online scheme is
    quantized per row over all its columns first. `what` names the tensor in errors."""
    scheme: Fp8Scheme = layer.quant
    dev = layer.weight.device
    if name == "weight":
        if loaded.dtype == FP8_DTYPE:
            part = loaded.narrow(0, src_start, rows)
            layer.weight.data.narrow(0, dst_offset, rows).copy_(
                part if cols is None else part.narrow(1, *cols))
            return
        if loaded.dtype.is_floating_point and loaded.element_size() == 1:
            raise ValueError(f"checkpoint tensor {what} is {loaded.dtype}; FP8 weights must be "
                             f"float8_e4m3fn")
        if scheme.checkpoint:
            raise ValueError(f"checkpoint tensor {what} is {loaded.dtype}, but the checkpoint's "
                             f"quantization_config says it is FP8 (float8_e4m3fn)")
        q, scale = quantize_weight_per_channel(loaded.narrow(0, src_start, rows).to(dev))
        layer.weight.data.narrow(0, dst_offset, rows).copy_(q if cols is None else q.narrow(1, *cols))
        layer.weight_scale.data.narrow(0, dst_offset, rows).copy_(scale)
        return
    flat = loaded.reshape(-1).to(device=dev, dtype=torch.float32)
    if name == "weight_scale":
        dst = layer.weight_scale.data.narrow(0, dst_offset, rows)
        if flat.numel() == 1:                   # per tensor: the scalar over this shard's rows
            dst.copy_(flat.expand(rows))
        elif flat.numel() == full_rows:         # per channel ([N] or [N, 1])
            dst.copy_(flat.narrow(0, src_start, rows))
        else:
            raise ValueError(f"checkpoint tensor {what} has shape {tuple(loaded.shape)}, expected "
                             f"({full_rows}, 1), ({full_rows},) or a single scale")
        return
    if name == "input_scale":
        if layer.input_scale is None:
            raise ValueError(f"checkpoint tensor {what}: a static input scale for a layer whose "
                             f"scheme has {scheme.activation} activations")
        if flat.numel() != 1:
            raise ValueError(f"checkpoint tensor {what} has shape {tuple(loaded.shape)}; only "
                             f"per-tensor input scales are supported")
        torch.maximum(layer.input_scale.data, flat, out=layer.input_scale.data)
        return
    raise ValueError(f"checkpoint tensor {what}: FP8 layers take weight, weight_scale, "
                     f"input_scale and bias, not {name!r}")


def init_dummy_fp8(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Random FP8 layers for --load-format dummy: normal(0, 0.02) weights quantized per output
    channel with the plain absmax scale (no search: nothing to preserve in random weights), in
    slices of rows, and a static input scale of 8 / 448 (activations up to +-8)."""
    for module in model.modules():
        scheme = getattr(module, "quant", None)
        if scheme is None:
            continue
        w = module.weight.data
        step = max(1, (16 << 20) // max(1, w.shape[1]))
        for start in range(0, w.shape[0], step):
            part = torch.empty(w[start:start + step].shape, dtype=torch.float32, device=w.device)
            part.normal_(0.0, 0.02, generator=gen)
            q, s = quantize_weight_per_channel(part, search=False)
            w[start:start + step].copy_(q)
            module.weight_scale.data[start:start + step].copy_(s)
        if module.input_scale is not None:
            module.input_scale.data.fill_(8.0 / 448.0)


def quant_config_of(model: Any) -> Optional[QuantConfig]:
    return getattr(model, "quant_config", None)


def quantization_name(model: Any) -> Optional[str]:
    """The model's quantization method for /get_server_info (None: unquantized)."""
    qc = quant_config_of(model)
    return None if qc is None else qc.method
