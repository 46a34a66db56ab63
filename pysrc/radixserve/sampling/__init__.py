"""Sampling: SamplingParams (params.py), penalties (penalties.py) and the batch sampler (sampler.py)."""
from radixserve.sampling.params import SamplingParams

__all__ = ["SamplingParams"]
