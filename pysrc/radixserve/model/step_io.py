"""What one step hands the ModelRunner and what comes back: the seam between engine/ and model/.

The scheduler (engine/) builds a StepInput on the event-loop thread from plain host values; the
runner (model/) moves it to the device in one packed copy per dtype, runs the step there, and
returns a PendingStep whose wait() gives the host-side StepOutput. Neither side sees the other's
objects: no Req crosses this seam, no device tensor crosses it back.

Decode steps send only what the device cannot derive itself: each row's ReqToToken row, its KV
length after the step and its new slot. Positions (seq_len - 1), the ReqToToken writes and the
input token (the id the previous step sampled for that row, kept on the device in a per-row
buffer) are computed on the device, so a step never waits for the host to learn a token.

A step's per-row sampling settings are the sampler's own type (sampling/batch.SamplingInputs,
built from the step's requests in one call): sampling sits below the model and owns its batch,
its packing into the step's upload and the tensors the sampler takes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

from radixserve.model.forward_batch import ForwardMode
from radixserve.sampling.batch import SamplingInputs


@dataclass
class StepInput:
    """One step, host side. Shapes: B = batch_size, T = num_tokens (decode: T == B).

    Every mode:
      req_pool_indices [B]  ReqToToken row of each request
      seq_lens         [B]  KV length of each request once this step has run
      out_cache_loc    [T]  int64 CPU tensor: the slot each new token's K/V goes to
      sample_rows      [S]  ReqToToken rows of the requests that sample (their new id is kept
                            on the device as that row's next input)
      sampling              their per-row settings, row i for sample_rows[i]
                            (sampling/batch.SamplingInputs)
      table_rows / table_cols / table_slots [W]: ReqToToken writes the device copy lacks (the
                            matched prefix of admitted requests, every extend token's slot,
                            rows re-pointed at the cache after a chunk is published); None: none
    EXTEND only (DECODE derives them on the device):
      input_ids [T] (-1 where resolve_pos says the id comes from the device), positions [T],
      extend_lens [B], logits_indices (prompt-logprob rows first, then one sampling row per
      sampling request, k + 1 for a verify row), prompt_* (prompt logprobs).
    Speculative verify (a DECODE step; empty otherwise): a request of draft d (k tokens)
      takes k + 1 consecutive rows: its own row (its last token, from next_ids as in any
      decode) and k spare rows (req_pool_indices past the runner's padding row), row t with
      input d[t - 1] and KV length one more than row t - 1; every row samples (the request's
      own parameters at output offsets o .. o + k). spec_tokens [R] the drafts in batch order,
      spec_src [R] the request row of each spare row (whose slot table the runner copies into
      it, and d[t - 1] into its next_ids, before the forward), spec_counts [V] k per verify
      request, spec_sample [V] its own row's index. After sampling the runner sets next_ids
      of the request's row to its true next token: the sample at the first position j whose
      sample differs from d[j], else the last (bonus) sample; the host accepts the same
      tokens from StepOutput.sample. The runner also records each verify request's
      accepted count (its row's spec_accepted).
    Speculation over a verify step in flight (DECODE, verify or not): the host scheduled
      this step assuming the step in flight accepts every draft of the requests in
      spec_cond_rows [C] (their own rows); spec_cond_expect [C] is each one's draft length
      there. A request whose recorded accepted count differs computed this step from wrong
      positions: the runner leaves its next_ids as they were (the true next token the step
      in flight chose), and the host drops its results (it learns the same from the step in
      flight's StepOutput and voids this step's entry: engine/scheduler/spec.py).
    Pooling (EXTEND only; engine/pooling.py): P spans of the step's token rows, each one
      pooling request's. pool_starts [P] the span's first row (in the step's token order),
      pool_counts [P] its rows; the runner returns each span's sum of final-norm hidden
      states (StepOutput.pooled) and, for pool_labels[p] (token ids, [] for none), their
      logits at the span's last row (StepOutput.pool_logits). Pooling rows never sample.
    """
    mode: ForwardMode
    batch_size: int
    req_pool_indices: List[int]
    seq_lens: List[int]
    out_cache_loc: torch.Tensor
    sample_rows: List[int]
    sampling: SamplingInputs
    input_ids: List[int] = field(default_factory=list)
    positions: List[int] = field(default_factory=list)
    extend_lens: List[int] = field(default_factory=list)
    resolve_pos: List[int] = field(default_factory=list)
    resolve_rows: List[int] = field(default_factory=list)
    table_rows: Optional[torch.Tensor] = None                 # int64 CPU, [W]
    table_cols: Optional[torch.Tensor] = None                 # int64 CPU, [W]
    table_slots: Optional[torch.Tensor] = None                # int64 CPU, [W]
    logits_indices: List[int] = field(default_factory=list)
    num_prompt_rows: int = 0
    prompt_targets: List[int] = field(default_factory=list)   # [num_prompt_rows]
    prompt_counts: List[int] = field(default_factory=list)    # [B], prompt rows per request
    prompt_top_k: int = 0
    spec_tokens: List[int] = field(default_factory=list)      # [R]
    spec_src: List[int] = field(default_factory=list)         # [R]
    spec_counts: List[int] = field(default_factory=list)      # [V]
    spec_sample: List[int] = field(default_factory=list)      # [V]
    spec_cond_rows: List[int] = field(default_factory=list)   # [C]
    spec_cond_expect: List[int] = field(default_factory=list)   # [C]
    pool_starts: List[int] = field(default_factory=list)      # [P]
    pool_counts: List[int] = field(default_factory=list)      # [P]
    pool_labels: List[List[int]] = field(default_factory=list)   # [P] x its label ids


class SampleResult(NamedTuple):
    ids: List[int]                                           # [S]
    logprobs: List[Optional[float]]                          # [S], None where not asked
    top_logprobs: List[Optional[List[Tuple[float, int]]]]    # [S], sorted desc, None where not asked
    finite: List[bool]                                       # [S]: the row's logits were finite


class StepOutput(NamedTuple):
    """Host values of one step: the sampled rows (batch order), prompt logprobs per request
    (empty / None for requests without), the step's device time in seconds, and idle_before:
    seconds the device's step stream sat idle between the previous step's end and this step's
    start (CUDA events; 0.0 on the CPU and for the first step). pooled [P, hidden] float32
    CPU: each pooling span's summed hidden states (StepInput.pool_starts), None without
    spans; pool_logits [P]: each span's label logits (StepInput.pool_labels)."""
    sample: SampleResult
    prompt_logprobs: List[List[float]]
    prompt_top_logprobs: List[Optional[List[List[Tuple[float, int]]]]]
    device_time: float
    idle_before: float = 0.0
    pooled: Optional[torch.Tensor] = None
    pool_logits: Sequence[List[float]] = ()
