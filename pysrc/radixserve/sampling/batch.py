"""A step's sampling batch: the per-row inputs, built from the step's requests in one call, their
packing for the step's upload, and the device tensors the sampler takes. The one module a
sampling knob passes through (besides SamplingParams and the request schema, which accept it,
and the kernel, which uses it); it imports nothing above sampling/.

    si = SamplingInputs.from_requests(reqs, offsets, eos_ids, vocab_size)   # loop thread (engine)
    si.pack(ints, floats)                       # runner: into the step's int64 / float32 buffers
    st = SamplingTensors.from_upload(ints_up, floats_up)   # runner: device views, kernel dtypes
    sampler.sample(logits, si, st, pool_rows, penalties, bitmask)
    st = si.to_device(device)                   # the same tensors without a packed upload (tests)

Shapes (S = rows that sample this step, in batch order; P = of them the rows that use penalties;
N = banned (row, token) pairs; L = logit_bias entries):

    field         host (SamplingInputs)      packed    device (SamplingTensors)
    temperature   [S] float, 0 = greedy      float32   [S] float32
    top_k         [S] int, <= 0 = off        int64     [S] int32
    top_p         [S] float                  float32   [S] float32
    min_p         [S] float                  float32   [S] float32
    seeds         [S] int (int64 range)      int64     [S] int64
    offsets       [S] int, output index      int64     [S] int64
    penalty_rows  [P] rows using penalties   int64     [P] int64
    repetition / frequency / presence
                  [P] float                  float32   [P] float32
    banned_rows / banned_cols
                  [N] int (min_new_tokens)   int64     [N] int64: logits[rows, cols] = -inf
    bias_rows / bias_cols
                  [L] int (logit_bias)       int64     [L] int64 } logits[rows, cols] += values
    bias_values   [L] float                  float32   [L] float32 }
Host only (the sampler reads them to decide which work runs, without a device read):
    logprob_rows [<= S], top_logprobs_num [S], penalty_init (rows whose penalty state starts
    this step), grammar_rows [<= S] (rows that sample under a token bitmask).

TENSOR_DTYPES is the one table of the device fields: pack, from_upload and to_device follow it,
and it lists SamplingTensors' fields in order. A new per-row knob is a SamplingInputs field, a
line in from_requests, a row of TENSOR_DTYPES and a SamplingTensors field (tests/unit/
test_sampling_batch.py checks that the table, SamplingInputs and SamplingTensors agree and that
every field comes through the packed upload).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, NamedTuple, Optional, Protocol, Sequence, Tuple

import torch

from radixserve.sampling.params import SamplingParams

_I64, _I32, _F32 = torch.int64, torch.int32, torch.float32

# SamplingTensors' fields, in order: name -> (dtype of the packed buffer it travels in, dtype
# the sampler takes). int64 fields share the step's int64 buffer, float32 ones its float32 one.
TENSOR_DTYPES: Dict[str, Tuple[torch.dtype, torch.dtype]] = {
    "temperature": (_F32, _F32),
    "top_k": (_I64, _I32),
    "top_p": (_F32, _F32),
    "min_p": (_F32, _F32),
    "seeds": (_I64, _I64),
    "offsets": (_I64, _I64),
    "penalty_rows": (_I64, _I64),
    "repetition": (_F32, _F32),
    "frequency": (_F32, _F32),
    "presence": (_F32, _F32),
    "banned_rows": (_I64, _I64),
    "banned_cols": (_I64, _I64),
    "bias_rows": (_I64, _I64),
    "bias_cols": (_I64, _I64),
    "bias_values": (_F32, _F32),
}


class SamplingRequest(Protocol):
    """What from_requests reads of a request (engine/req.Req is one)."""
    sampling_params: SamplingParams
    seed: Optional[int]              # fixed at admission (None: 0)
    return_logprob: bool
    top_logprobs_num: int
    req_pool_idx: int                # its ReqToToken row (the penalty state's row)
    origin_input_ids: List[int]
    output_ids: List[int]
    grammar: Any                     # None: free sampling
    penalty_ready: bool              # its penalty row is initialised; from_requests sets it

    @property
    def uses_penalties(self) -> bool: ...


@dataclass
class SamplingInputs:
    """Per sampling row (the rows that draw a token this step, in batch order); see the module
    docstring for shapes."""
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

    # ------------------------------------------------------------------ build (loop thread)
    @classmethod
    def from_requests(cls, reqs: Sequence[SamplingRequest], offsets: Sequence[int],
                      eos_ids: Sequence[int], vocab_size: int) -> "SamplingInputs":
        """The inputs of a step whose sampling rows are reqs, in order: reqs[i] samples the
        output token at index offsets[i]. From values the requests were validated with at
        admission. eos_ids (and each request's stop_token_ids) below vocab_size are banned while
        a request has fewer than min_new_tokens outputs and no grammar (a grammar decides the
        end). A request whose penalty row is not initialised gets a penalty_init entry and is
        marked penalty_ready."""
        if len(reqs) != len(offsets):
            raise ValueError(f"{len(reqs)} sampling requests but {len(offsets)} offsets")
        si = cls()
        for row, (req, offset) in enumerate(zip(reqs, offsets)):
            sp = req.sampling_params
            si.temperature.append(float(sp.temperature))
            si.top_k.append(int(sp.top_k) if sp.top_k and sp.top_k > 0 else -1)
            si.top_p.append(float(sp.top_p))
            si.min_p.append(float(sp.min_p))
            si.seeds.append(int(req.seed or 0))
            si.offsets.append(offset)
            si.top_logprobs_num.append(int(req.top_logprobs_num) if req.return_logprob else 0)
            if req.return_logprob:
                si.logprob_rows.append(row)
            if req.uses_penalties:
                si.penalty_rows.append(row)
                si.repetition.append(float(sp.repetition_penalty))
                si.frequency.append(float(sp.frequency_penalty))
                si.presence.append(float(sp.presence_penalty))
                if not req.penalty_ready:
                    si.penalty_init.append((req.req_pool_idx, list(req.origin_input_ids),
                                            list(req.output_ids)))
                    req.penalty_ready = True
            if req.grammar is not None:
                si.grammar_rows.append(row)
            for tid, bias in (sp.logit_bias or {}).items():
                si.bias_rows.append(row)
                si.bias_cols.append(tid)
                si.bias_values.append(bias)
            if offset < sp.min_new_tokens and req.grammar is None:
                for t in sorted({t for t in list(eos_ids) + list(sp.stop_token_ids or [])
                                 if 0 <= t < vocab_size}):
                    si.banned_rows.append(row)
                    si.banned_cols.append(t)
        return si

    # ------------------------------------------------------------------ upload (runner)
    def pack(self, ints, floats) -> None:
        """Add the device fields to a step's packed upload, under SamplingTensors' field names:
        the int64 ones to ints, the float32 ones to floats (model/staging.Packer, or anything
        with add(name, values))."""
        for name, (packed, _) in TENSOR_DTYPES.items():
            (ints if packed is _I64 else floats).add(name, getattr(self, name))

    def to_device(self, device: torch.device) -> "SamplingTensors":
        """SamplingTensors without a packed upload (tests, tools): each field in its packed
        dtype, converted as from_upload converts it, so the values are the runner's."""
        return SamplingTensors(*(
            torch.tensor(getattr(self, name), dtype=packed, device=device).to(dtype)
            for name, (packed, dtype) in TENSOR_DTYPES.items()))


class SamplingTensors(NamedTuple):
    """SamplingInputs on the device, in the dtypes the sampler takes (TENSOR_DTYPES; shapes in
    the module docstring)."""
    temperature: torch.Tensor      # [S] float32
    top_k: torch.Tensor            # [S] int32, <= 0 = off
    top_p: torch.Tensor            # [S] float32
    min_p: torch.Tensor            # [S] float32
    seeds: torch.Tensor            # [S] int64
    offsets: torch.Tensor          # [S] int64
    penalty_rows: torch.Tensor     # [P] int64 rows that use penalties
    repetition: torch.Tensor       # [P] float32
    frequency: torch.Tensor        # [P] float32
    presence: torch.Tensor         # [P] float32
    banned_rows: torch.Tensor      # [N] int64 } logits[rows, cols] = -inf
    banned_cols: torch.Tensor      # [N] int64 }
    bias_rows: torch.Tensor        # [L] int64 } logits[rows, cols] += values (logit_bias)
    bias_cols: torch.Tensor        # [L] int64 }
    bias_values: torch.Tensor      # [L] float32

    @classmethod
    def from_upload(cls, ints, floats) -> "SamplingTensors":
        """The tensors from the views of an upload that pack() filled (model/staging.Upload, or
        anything indexable by field name), cast to the sampler's dtypes."""
        return cls(*((ints if packed is _I64 else floats)[name].to(dtype)
                     for name, (packed, dtype) in TENSOR_DTYPES.items()))
