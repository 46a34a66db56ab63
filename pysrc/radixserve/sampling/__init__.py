"""Sampling: SamplingParams (params.py), a step's per-row settings (inputs.py: SamplingInputs),
penalties (penalties.py) and the batch sampler (sampler.py)."""
from radixserve.sampling.params import SamplingParams

__all__ = ["SamplingParams"]
