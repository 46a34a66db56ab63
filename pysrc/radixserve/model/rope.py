"""Rotary position embedding tables: the cos/sin cache that ops.rotary_embedding reads.

The frequencies are computed exactly as HF transformers computes them (same fp32 operations in
the same order), so that our model and the HF oracle agree bit for bit on cos/sin. Supported
scalings: none ("default"), "linear" and "llama3" (Llama 3.1). Any other type raises ValueError.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_type_of(rope_scaling: Optional[dict]) -> str:
    """The scaling type of a config.json rope_scaling / rope_parameters dict ("default" if none)."""
    if not rope_scaling:
        return "default"
    return rope_scaling.get("rope_type") or rope_scaling.get("type") or "default"


def compute_inv_freq(head_dim: int, rope_theta: float, rope_scaling: Optional[dict]) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] float32 on the CPU, with scaling folded in.

    Raises ValueError for a rope type we do not implement (the message lists the supported ones).
    """
    rope_type = rope_type_of(rope_scaling)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope scaling type {rope_type!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope_theta ** exponents)                                # [head_dim // 2]
    if rope_type == "linear":
        inv_freq = inv_freq / rope_scaling["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, rope_scaling)
    return inv_freq


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
    inv_freq = compute_inv_freq(head_dim, rope_theta, rope_scaling)           # [head_dim // 2]
    positions = torch.arange(max_position, dtype=torch.int64, device="cpu").to(torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]                            # [max_position, head_dim // 2]
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)                     # [max_position, head_dim]
    return cache.to(device)
