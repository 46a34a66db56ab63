"""Rotary position embedding tables: the cos/sin cache that ops.rotary_embedding reads.

The frequencies are computed exactly as HF transformers computes them (same fp32 operations in
the same order), so that our model and the HF oracle agree bit for bit on cos/sin. Supported
scalings: none ("default"), "linear", "llama3" (Llama 3.1) and "yarn" (Qwen2.5 / Qwen3 long
context: NTK-by-parts frequencies, and cos/sin scaled by the attention factor, which is how the
attention logits get YaRN's temperature). Any other type raises ValueError.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_type_of(rope_scaling: Optional[dict]) -> str:
    """The scaling type of a config.json rope_scaling / rope_parameters dict ("default" if none)."""
    if not rope_scaling:
        return "default"
    return rope_scaling.get("rope_type") or rope_scaling.get("type") or "default"


def compute_inv_freq(head_dim: int, rope_theta: float, rope_scaling: Optional[dict],
                     max_position: Optional[int] = None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] float32 on the CPU, with scaling folded in.
    max_position: the config's max_position_embeddings (yarn's default pretraining length).

    Raises ValueError for a rope type we do not implement (the message lists the supported ones).
    """
    rope_type = rope_type_of(rope_scaling)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope scaling type {rope_type!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, rope_theta, rope_scaling, max_position)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope_theta ** exponents)                                # [head_dim // 2]
    if rope_type == "linear":
        inv_freq = inv_freq / rope_scaling["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, rope_scaling)
    return inv_freq


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_factor(scaling: dict, max_position: Optional[int]) -> float:
    """The context extension factor: the config's, else max_position over the pretraining length."""
    if scaling.get("factor") is not None:
        return float(scaling["factor"])
    return max_position / _yarn_original_length(scaling, max_position)


def _yarn_original_length(scaling: dict, max_position: Optional[int]) -> int:
    original = scaling.get("original_max_position_embeddings") or max_position
    if original is None:
        raise ValueError("yarn rope scaling needs original_max_position_embeddings")
    return original


def rope_attention_scale(rope_scaling: Optional[dict], max_position: Optional[int] = None) -> float:
    """The factor cos and sin are multiplied by: yarn's attention factor (its `attention_factor`,
    else from `mscale` / `mscale_all_dim`, else 0.1 ln(factor) + 1); 1 for the other types."""
    if rope_type_of(rope_scaling) != "yarn":
        return 1.0
    if rope_scaling.get("attention_factor") is not None:
        return float(rope_scaling["attention_factor"])
    factor = _yarn_factor(rope_scaling, max_position)
    mscale, mscale_all_dim = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def _yarn_inv_freq(head_dim: int, rope_theta: float, scaling: dict,
                   max_position: Optional[int]) -> torch.Tensor:
    """YaRN (NTK-by-parts): dimensions that rotate fewer than beta_slow times over the
    pretraining length are interpolated (divided by factor), those above beta_fast kept, a
    linear ramp between."""
    factor = _yarn_factor(scaling, max_position)
    original = _yarn_original_length(scaling, max_position)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        turns = original / (rotations * 2 * math.pi)
        return (head_dim * math.log(turns)) / (2 * math.log(rope_theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    dims = torch.arange(head_dim // 2, dtype=torch.float32)                  # [head_dim // 2]
    ramp = torch.clamp((dims - low) / (high - low), 0, 1)
    pos_freqs = rope_theta ** (torch.arange(0, head_dim, 2).to(dtype=torch.float32) / head_dim)
    extrapolation = 1 - ramp                                                  # [head_dim // 2]
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _llama3_scale(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by factor, short ones kept, a smooth ramp between."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def build_cos_sin_cache(head_dim: int, max_position: int, rope_theta: float,
                        rope_scaling: Optional[dict],
                        device: str | torch.device = "cpu") -> torch.Tensor:
    """[max_position, head_dim] float32 on device; row p = [cos(p * f) | sin(p * f)].

    Computed on the CPU in fp32 (position * inv_freq as an elementwise fp32 product, the way HF
    does it) and then moved, so the table is identical whatever the device.
    """
    inv_freq = compute_inv_freq(head_dim, rope_theta, rope_scaling, max_position)  # [head_dim // 2]
    positions = torch.arange(max_position, dtype=torch.int64, device="cpu").to(torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]                            # [max_position, head_dim // 2]
    scale = rope_attention_scale(rope_scaling, max_position)
    cos, sin = freqs.cos(), freqs.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    cache = torch.cat([cos, sin], dim=-1)                  # [max_position, head_dim]
    return cache.to(device)
