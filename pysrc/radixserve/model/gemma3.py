"""Gemma 3 (text) and Gemma 2 decoders over the paged KV pool: the first block here that is not
the Llama block.

Built from model/llama.py's pieces by import (the tensor-parallel linears and embedding, the
paged attention of LlamaAttention, the CausalLM forward / logits / HF weight-loading contract);
what differs from Llama lives here:
  * GemmaRMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w), in fp32, rounded once to x's dtype
    (HF multiplies by 1 + w before rounding, not after, as Llama does). The parameter holds
    1 + w in float32 (loaded as 1 + checkpoint tensor), so ops.rms_norm computes exactly that.
  * embeddings times sqrt(hidden_size), the factor rounded to the model dtype first as HF does
    (55.4256 becomes 55.5 in bf16 for hidden 3072).
  * four norms a block: input, post-attention (on the attention output, before the residual
    add), pre-feedforward and post-feedforward (on the MLP output, before the residual add).
  * the MLP: down(gelu_tanh(gate(x)) * up(x)) (HF's gelu_pytorch_tanh).
  * attention: softmax scale query_pre_attn_scalar ** -0.5; Gemma 3: an RMSNorm (Gemma's) over
    head_dim of every q and k head before rope (q_norm / k_norm); Gemma 2: the scores
    soft-capped, c * tanh(scores / c) with c = attn_logit_softcapping.
  * per-layer sliding windows: config.layer_types ("sliding_attention" / "full_attention"),
    else every sliding_window_pattern-th layer full (Gemma 3: 6, Gemma 2: 2) and the others
    windowed by config.sliding_window. A windowed layer's query at position p attends KV
    positions (p - sliding_window, p], as HF's mask does.
  * rope: Gemma 3's local (sliding) layers rotate with base rope_local_base_freq (10000) and no
    scaling, its global layers with rope_theta and rope_scaling (linear x8 in the 4B+ models);
    transformers 5 writes both as rope_parameters {"sliding_attention": .., "full_attention":
    ..}, read here too. Gemma 2: one rope for all layers.
  * final logits soft-capped where final_logit_softcapping is set (Gemma 2: 30), tied
    embeddings (the default for Gemma).
Gemma3ForConditionalGeneration (the multimodal 4B / 12B / 27B checkpoints): their text model is
served, for text-only prompts (as SGLang and vLLM serve it when given only text; the server
refuses image content parts for every model). config.json nests the text model under
text_config, flattened by config.text_model_config (with Gemma3TextConfig's defaults for the keys
the hub files leave out); the weights are named language_model.model.* / language_model.lm_head.*
(as transformers 4 and 5 save them) or model.language_model.* / lm_head.* (transformers 5's
in-memory names), mapped here to model.* / lm_head.*; vision_tower.* and multi_modal_projector.*
(either prefix) are skipped, counted and logged once.

Not supported: FP8 linear layers (refused), use_bidirectional_attention (EmbeddingGemma's,
refused), images.

On CUDA these layers run slower paths until kernels take them: soft-capped attention (Gemma 2)
and the fp32 (1 + w) norm weights run the torch references (ops), and the runner keeps CUDA
graphs off for a soft-capped model; windowed attention runs the kernels.
"""
from __future__ import annotations

import logging
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from radixserve import ops
from radixserve.config import ModelConfig
from radixserve.model.cpu_attention import CpuDecodeAttention
from radixserve.model.forward_batch import ForwardBatch
from radixserve.model.llama import (CausalLM, ColumnParallelLinear, LlamaAttention,
                                    ParallelLMHead, RowParallelLinear, VocabParallelEmbedding,
                                    WeightLoader, _check_shape, _frozen, hf_layer_types,
                                    log_windows, windows_of_types)
from radixserve.model.rope import build_cos_sin_cache, rope_type_of
from radixserve.quant.fp8 import QuantConfig, checkpoint_quant_config

logger = logging.getLogger(__name__)

SLIDING, FULL = "sliding_attention", "full_attention"
GELU_TANH = ("gelu_pytorch_tanh",)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w). weight holds 1 + w in float32
    (whatever the model dtype), so the fp32 product is HF's; a dummy-initialised weight of ones
    is w = 0, Gemma's own starting point."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = _frozen(torch.ones(hidden_size, dtype=torch.float32))   # [hidden] = 1 + w

    def load_weight(self, name: str, loaded: torch.Tensor, shard_id: int = 0) -> None:
        _check_shape(name, loaded.shape, self.weight.shape)
        self.weight.data.copy_(1.0 + loaded.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> None:
        """In place: residual += x; x = norm(residual) (residual float32)."""
        ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class GemmaMLP(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)), gate|up fused and column-parallel, down row-parallel."""

    def __init__(self, config: ModelConfig, params_dtype: torch.dtype, tp_rank: int,
                 tp_size: int):
        super().__init__()
        hf = config.hf_config
        act = hf.get("hidden_activation") or hf.get("hidden_act") or GELU_TANH[0]
        if act not in GELU_TANH:
            raise ValueError(f"hidden_activation {act!r} is not supported for "
                             f"{config.architecture} (only gelu_pytorch_tanh)")
        inter = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [inter, inter], False,
                                                 params_dtype, tp_rank, tp_size)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, False, params_dtype,
                                           tp_rank, tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x, contiguous=False)     # [num_tokens, 2 * inter / tp]
        return self.down_proj(ops.gelu_tanh_and_mul(gate_up))   # [num_tokens, hidden_size]


class GemmaAttention(LlamaAttention):
    """LlamaAttention's paged attention with Gemma's scale (query_pre_attn_scalar ** -0.5), its
    RMSNorm on q and k heads (Gemma 3), its window and soft-cap (Gemma 2)."""

    def __init__(self, config: ModelConfig, layer_id: int, params_dtype: torch.dtype,
                 tp_rank: int, tp_size: int, qk_norm: bool, window: int, softcap: float):
        bias = config.attention_bias
        super().__init__(config, layer_id, bias, bias, params_dtype, tp_rank, tp_size,
                         qk_norm=False, quant_config=None, window=window)
        scalar = config.hf_config.get("query_pre_attn_scalar") or config.head_dim
        self.scaling = float(scalar) ** -0.5
        self.softcap = float(softcap or 0.0)
        if qk_norm:
            self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)


class GemmaDecoderLayer(nn.Module):
    """Gemma 2 / 3's block: input norm -> attention -> post-attention norm -> + residual ->
    pre-feedforward norm -> MLP -> post-feedforward norm -> (+ residual in the next block)."""

    def __init__(self, config: ModelConfig, layer_id: int, params_dtype: torch.dtype,
                 tp_rank: int, tp_size: int, qk_norm: bool, window: int, softcap: float):
        super().__init__()
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.self_attn = GemmaAttention(config, layer_id, params_dtype, tp_rank, tp_size,
                                        qk_norm, window, softcap)
        self.mlp = GemmaMLP(config, params_dtype, tp_rank, tp_size)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, fb: ForwardBatch, hidden: torch.Tensor, residual: Optional[torch.Tensor],
                cos_sin_cache: torch.Tensor,
                cpu_attn: Optional[CpuDecodeAttention] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """hidden: the last block's (post-feedforward-normed) output not yet added to residual,
        or the scaled embeddings before the first block (residual None). residual: the fp32
        stream (as LlamaDecoderLayer's). Returns (this block's output, residual)."""
        if residual is None:
            residual = hidden.float()                      # [num_tokens, hidden] f32
            hidden = self.input_layernorm(hidden)
        else:
            self.input_layernorm.forward_add(hidden, residual)
        attn = self.self_attn(fb, hidden, cos_sin_cache, cpu_attn)     # [num_tokens, hidden]
        attn = self.post_attention_layernorm(attn)
        self.pre_feedforward_layernorm.forward_add(attn, residual)
        return self.post_feedforward_layernorm(self.mlp(attn)), residual


class GemmaModel(nn.Module):
    def __init__(self, config: ModelConfig, params_dtype: torch.dtype, tp_rank: int,
                 tp_size: int, qk_norm: bool, layer_types: Sequence[str],
                 ropes: Dict[str, Tuple[float, Optional[dict]]], softcap: float):
        """layer_types: each layer's "sliding_attention" / "full_attention"; ropes: (rope_theta,
        rope_scaling) per layer type (one entry with key None: every layer's)."""
        super().__init__()
        window = int(config.hf_config.get("sliding_window") or 0)
        windows = windows_of_types(layer_types, window)
        log_windows(config, windows)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   params_dtype, tp_rank, tp_size)
        # sqrt(hidden_size) as HF rounds it: fp32, then the model dtype (exact as a Python float)
        self.embed_scale = float(torch.tensor(config.hidden_size ** 0.5,
                                              dtype=torch.float32).to(params_dtype))
        self.layers = nn.ModuleList([
            GemmaDecoderLayer(config, i, params_dtype, tp_rank, tp_size, qk_norm, windows[i],
                              softcap)
            for i in range(config.num_hidden_layers)])
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        device = self.norm.weight.device
        # [max_context, head_dim] float32 = [cos | sin] per rope; the layer index -> its table
        self._rope_of_layer: List[str] = []
        for key, (theta, scaling) in ropes.items():
            name = f"cos_sin_cache_{key or 'all'}"
            self.register_buffer(name, build_cos_sin_cache(config.head_dim, config.max_context,
                                                           theta, scaling, device=device),
                                 persistent=False)
        for t in layer_types:
            self._rope_of_layer.append(f"cos_sin_cache_{t if t in ropes else 'all'}")

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        hidden = self.embed_tokens(fb.input_ids) * self.embed_scale   # [num_tokens, hidden]
        residual = None
        cpu_attn = CpuDecodeAttention.for_batch(fb, hidden.dtype)     # tables per window, once
        for layer, rope in zip(self.layers, self._rope_of_layer):
            hidden, residual = layer(fb, hidden, residual, getattr(self, rope), cpu_attn)
        self.norm.forward_add(hidden, residual)
        return hidden


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3 text models (gemma-3-1b and Gemma3ForCausalLM checkpoints). See the module
    docstring."""

    qk_norm = True
    default_pattern = 6        # every 6th layer global when config.json has no layer_types

    def __init__(self, config: ModelConfig, params_dtype: torch.dtype = torch.float32,
                 tp_rank: int = 0, tp_size: int = 1, quant_config: Optional[QuantConfig] = None):
        super().__init__()
        hf = config.hf_config
        if quant_config is None:
            quant_config = checkpoint_quant_config(hf)
        if quant_config is not None:
            raise ValueError(f"FP8 linear layers are not supported for {config.architecture}")
        if hf.get("use_bidirectional_attention"):
            raise ValueError(f"{config.architecture} with use_bidirectional_attention (an "
                             f"embedding model) is not supported")
        self.config = config
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.quant_config = None
        self.checkpoint_kv_scales: Dict[str, float] = {}
        types = self.layer_types(config)
        self.model = GemmaModel(config, params_dtype, tp_rank, tp_size, self.qk_norm, types,
                                self.ropes(config, types),
                                float(hf.get("attn_logit_softcapping") or 0.0))
        if config.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, params_dtype,
                                          tp_rank, tp_size)
        self.final_logit_softcap = float(hf.get("final_logit_softcapping") or 0.0)

    @classmethod
    def layer_types(cls, config: ModelConfig) -> List[str]:
        """config.json's layer_types, else HF's default: layer i is global when (i + 1) is a
        multiple of sliding_window_pattern."""
        hf = config.hf_config
        pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or \
            cls.default_pattern
        default = [SLIDING if (i + 1) % pattern else FULL for i in range(config.num_hidden_layers)]
        return hf_layer_types(config, default)

    @classmethod
    def ropes(cls, config: ModelConfig, types: Sequence[str]) -> Dict[str, Tuple[float, Optional[dict]]]:
        """(rope_theta, rope_scaling) per layer type: the local layers' base rope, the global
        layers' with the config's scaling (see the module docstring)."""
        hf = config.hf_config
        nested = hf.get("rope_parameters")
        ropes: Dict[str, Tuple[float, Optional[dict]]] = {}
        for t in sorted(set(types)):
            if isinstance(nested, dict) and isinstance(nested.get(t), dict):
                params = nested[t]
                theta = float(params.get("rope_theta", 10000.0 if t == SLIDING else 1e6))
                ropes[t] = (theta, None if rope_type_of(params) == "default" else params)
            elif t == SLIDING:
                ropes[t] = (float(hf.get("rope_local_base_freq", 10000.0)), None)
            else:
                theta = config.rope_theta if "rope_theta" in hf or nested else 1e6
                ropes[t] = (float(theta), config.rope_scaling)
        return ropes


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma 2: Gemma 3's block without q/k norms, with attention logit soft-capping
    (attn_logit_softcapping, 50) and final logit soft-capping (final_logit_softcapping, 30),
    every other layer windowed (layer 0 first), one rope for every layer."""

    qk_norm = False
    default_pattern = 2

    @classmethod
    def ropes(cls, config: ModelConfig, types: Sequence[str]) -> Dict[str, Tuple[float, Optional[dict]]]:
        return {None: (config.rope_theta, config.rope_scaling)}


# A multimodal Gemma 3 checkpoint's names -> ours: (prefix, replacement), the first match wins;
# language_model.* as transformers 4 and 5 save the weights, model.language_model.* as
# transformers 5 names them in memory (its lm_head.weight is ours already)
TEXT_WEIGHT_PREFIXES = (("language_model.model.", "model."),
                        ("language_model.lm_head.", "lm_head."),
                        ("model.language_model.", "model."))
# the vision tower (SigLIP) and the projector into the text model's embeddings: not served
VISION_WEIGHT_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                          "model.multi_modal_projector.")


def text_weight_name(name: str) -> Optional[str]:
    """A Gemma3ForConditionalGeneration checkpoint tensor's name as Gemma3ForCausalLM's
    (language_model.model.layers.0.mlp.up_proj.weight -> model.layers.0.mlp.up_proj.weight), or
    None for a vision tower / projector tensor. Other names are returned as they are (the
    WeightLoader refuses those that match no parameter)."""
    if name.startswith(VISION_WEIGHT_PREFIXES):
        return None
    for prefix, ours in TEXT_WEIGHT_PREFIXES:
        if name.startswith(prefix):
            return ours + name[len(prefix):]
    return name


class TextOnlyWeightLoader(WeightLoader):
    """WeightLoader over a multimodal checkpoint's tensors: the text model's renamed
    (text_weight_name), the vision ones skipped; finish() logs how many were skipped (tensor-
    parallel rank 0 only, so once a load)."""

    def __init__(self, model: "Gemma3ForConditionalGeneration"):
        super().__init__(model)
        self.skipped = 0                # vision tower / projector tensors seen
        self.skipped_params = 0         # their elements

    def feed(self, name: str, tensor: torch.Tensor) -> None:
        text_name = text_weight_name(name)
        if text_name is None:
            self.skipped += 1
            self.skipped_params += tensor.numel()
            return
        super().feed(text_name, tensor)

    def finish(self):
        loaded = super().finish()
        if self.model.tp_rank == 0:
            logger.info("%s: serving the text model only; skipped %d vision tower / projector "
                        "tensors (%.1fM parameters)", self.model.config.architecture,
                        self.skipped, self.skipped_params / 1e6)
        return loaded


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The text model of a multimodal Gemma 3 checkpoint (gemma-3-4b / 12b / 27b, -pt and -it):
    Gemma3ForCausalLM built from the flattened text_config, loading the checkpoint's
    language-model weights under their mapped names (see the module docstring). Text prompts
    only."""

    def weight_loader(self) -> WeightLoader:
        return TextOnlyWeightLoader(self)
