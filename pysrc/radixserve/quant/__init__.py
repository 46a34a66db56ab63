"""Quantized linear layers: FP8 (e4m3) weights with fp32 scales (issue 35).

  fp8.py     what a checkpoint's quantization_config (or --quantization fp8) means for each
             linear layer (QuantConfig, Fp8Scheme, resolve_quant_config: the start-up errors),
             per-output-channel quantization of bf16/fp16 weights at load, and the loading of
             FP8 tensors and their scales into the tensor-parallel layers of model/llama.py.

The GEMMs themselves are ops of the seam (radixserve.ops.fp8_linear, fp8_scaled_mm,
fp8_quantize, rmsnorm_quant_fp8), each with its plain-torch reference.
"""
from radixserve.quant.fp8 import (QUANTIZATION_METHODS, Fp8Activation, Fp8Scheme, QuantConfig,
                                  checkpoint_quant_config, quant_config_of, quantization_name,
                                  quantize_weight_per_channel, resolve_quant_config)

__all__ = ["QUANTIZATION_METHODS", "Fp8Activation", "Fp8Scheme", "QuantConfig",
           "checkpoint_quant_config", "quant_config_of", "quantization_name",
           "quantize_weight_per_channel", "resolve_quant_config"]
