"""Sampling: SamplingParams (params.py), a step's sampling batch (batch.py: SamplingInputs built
from the step's requests, packed for upload, SamplingTensors on the device), penalties
(penalties.py) and the batch sampler (sampler.py)."""
from radixserve.sampling.params import SamplingParams

__all__ = ["SamplingParams"]
