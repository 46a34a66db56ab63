"""The architecture registry: config.json's architecture name -> the model class that serves it.

model/llama.py's Llama family (its MODEL_REGISTRY) and model/gemma3.py's Gemma 2 / 3 (and the
text model of the multimodal Gemma 3 checkpoints); the loader
(model/loader.py) builds models through get_model_class. It lives in a module of its own because
gemma3.py imports llama.py, so llama.py cannot name the Gemma classes.
"""
from __future__ import annotations

from typing import Dict, Type

from torch import nn

from radixserve.model.gemma3 import (Gemma2ForCausalLM, Gemma3ForCausalLM,
                                     Gemma3ForConditionalGeneration)
from radixserve.model.llama import MODEL_REGISTRY as LLAMA_FAMILY

MODEL_REGISTRY: Dict[str, Type[nn.Module]] = {
    **LLAMA_FAMILY,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    # the multimodal checkpoints' text model (text prompts only; vision weights skipped)
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
}

# architectures we know of and do not serve, with the reason
_NOT_SERVED: Dict[str, str] = {}


def get_model_class(architecture: str) -> Type[nn.Module]:
    """The model class for a config.json architecture name; ValueError naming the supported ones."""
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        why = f" ({_NOT_SERVED[architecture]})" if architecture in _NOT_SERVED else ""
        raise ValueError(f"model architecture {architecture!r} is not supported{why}; supported: "
                         f"{', '.join(sorted(MODEL_REGISTRY))}") from None
