"""SamplingInputs: a step's per-row sampling settings, host side, as the scheduler (engine/
schedule_batch.py) builds them and the sampler (sampling/sampler.py) reads them. The model's
StepInput (model/step_io.py) carries one; sampling owns the type, so the sampler never imports
the model."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Tuple


@dataclass
class SamplingInputs:
    """Per sampling row (the rows that draw a token this step, in batch order)."""
    temperature: List[float] = field(default_factory=list)   # 0 = greedy
    top_k: List[int] = field(default_factory=list)           # <= 0 = off
    top_p: List[float] = field(default_factory=list)
    min_p: List[float] = field(default_factory=list)
    seeds: List[int] = field(default_factory=list)
    offsets: List[int] = field(default_factory=list)         # output tokens before this one
    logprob_rows: List[int] = field(default_factory=list)    # rows whose logprobs are returned
    top_logprobs_num: List[int] = field(default_factory=list)  # per row, 0 = none
    # penalties: rows of this step that use any; their settings, in the same order
    penalty_rows: List[int] = field(default_factory=list)
    repetition: List[float] = field(default_factory=list)
    frequency: List[float] = field(default_factory=list)
    presence: List[float] = field(default_factory=list)
    # penalty state that starts this step (a request's first sampled token since admission):
    # (ReqToToken row, prompt ids, output ids so far)
    penalty_init: List[Tuple[int, List[int], List[int]]] = field(default_factory=list)
    # (row, token) pairs that may not be sampled this step (min_new_tokens)
    banned_rows: List[int] = field(default_factory=list)
    banned_cols: List[int] = field(default_factory=list)
    # logit_bias: logits[row, col] += value before any filter
    bias_rows: List[int] = field(default_factory=list)
    bias_cols: List[int] = field(default_factory=list)
    bias_values: List[float] = field(default_factory=list)
    # rows with a grammar: the step samples only once their token bitmask is filled (the
    # grammar slot of the pipeline: the forward runs while the host fills it)
    grammar_rows: List[int] = field(default_factory=list)

    @property
    def all_greedy(self) -> bool:
        return all(t == 0.0 for t in self.temperature)
