"""ScheduleBatch: the requests of one step and what each computes; builds the ForwardBatch.

The scheduler fills a ScheduleBatch on the event-loop thread (slots already allocated and written
into the ReqToTokenPool rows), then prepare() turns it into a StepInput: pure tensors on the
model's device plus plain lists. The forward worker thread sees only the StepInput.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, NamedTuple, Optional, Tuple

import torch

from radixserve import ops
from radixserve.cache.kv_pool import KVPool, ReqToTokenPool
from radixserve.engine.req import Req
from radixserve.model.forward_batch import ForwardBatch, ForwardMode
from radixserve.sampling.sampler import SampleResult, SamplingBatchInfo


@dataclass
class ScheduleBatch:
    """reqs[i] computes fill_ids[extend_starts[i] : extend_starts[i] + extend_lens[i]] this step
    (decode: extend_lens[i] == 1, the last sampled token). sample[i]: the step ends req i's
    prefill (or is a decode), so a token is sampled from its last position.
    prompt_lp[i]: positions [p0, p1) whose logits give prompt logprobs of tokens p0+1 .. p1."""
    mode: ForwardMode
    reqs: List[Req] = field(default_factory=list)
    extend_starts: List[int] = field(default_factory=list)
    extend_lens: List[int] = field(default_factory=list)
    sample: List[bool] = field(default_factory=list)
    prompt_lp: List[Optional[Tuple[int, int]]] = field(default_factory=list)
    new_slots: List[torch.Tensor] = field(default_factory=list)   # per req, [extend_len] int64 CPU
    step_input: Optional["StepInput"] = None                      # set by Scheduler.schedule()

    def add(self, req: Req, start: int, length: int, slots: torch.Tensor, sample: bool,
            prompt_lp: Optional[Tuple[int, int]] = None) -> None:
        self.reqs.append(req)
        self.extend_starts.append(start)
        self.extend_lens.append(length)
        self.sample.append(sample)
        self.prompt_lp.append(prompt_lp)
        self.new_slots.append(slots)

    @property
    def batch_size(self) -> int:
        return len(self.reqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    @property
    def sampling_reqs(self) -> List[Req]:
        return [r for r, s in zip(self.reqs, self.sample) if s]

    def prepare(self, req_to_token_pool: ReqToTokenPool, kv_pool: KVPool,
                sampling_info: SamplingBatchInfo) -> "StepInput":
        """Build the device tensors of this step. Loop thread; the rows must be written already."""
        device = kv_pool.device
        input_ids: List[int] = []
        positions: List[int] = []
        seq_lens: List[int] = []
        qo_indptr = [0]
        prompt_rows: List[int] = []
        prompt_targets: List[int] = []
        prompt_counts: List[int] = []
        sample_rows: List[int] = []
        top_k = 0
        for i, req in enumerate(self.reqs):
            start, n = self.extend_starts[i], self.extend_lens[i]
            base = qo_indptr[-1]
            if self.mode == ForwardMode.DECODE:
                input_ids.append(req.output_ids[-1] if req.output_ids else req.origin_input_ids[-1])
            else:
                input_ids += req.fill_ids[start:start + n]
            positions += range(start, start + n)
            seq_lens.append(start + n)
            qo_indptr.append(base + n)
            lp = self.prompt_lp[i]
            if lp is not None:
                fill = req.fill_ids
                p0, p1 = lp
                prompt_rows += range(base + p0 - start, base + p1 - start)
                prompt_targets += fill[p0 + 1:p1 + 1]
                prompt_counts.append(p1 - p0)
                top_k = max(top_k, req.top_logprobs_num)
            else:
                prompt_counts.append(0)
            if self.sample[i]:
                sample_rows.append(base + n - 1)
        batch = len(self.reqs)
        pool_rows = torch.tensor([r.req_pool_idx for r in self.reqs], dtype=torch.int64)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
        kv_indptr = torch.zeros(batch + 1, dtype=torch.int32, device=device)   # [batch + 1]
        total_kv = sum(seq_lens)
        kv_indices = torch.empty(max(total_kv, 1), dtype=torch.int32, device=device)  # [nnz]
        ops.build_kv_indices(req_to_token_pool.req_to_token, pool_rows.to(device),
                             seq_lens_t.to(device), kv_indptr, kv_indices)
        out_cache_loc = (torch.cat(self.new_slots) if self.new_slots
                         else torch.empty(0, dtype=torch.int64))              # [num_tokens]
        fb = ForwardBatch(
            mode=self.mode,
            batch_size=batch,
            input_ids=torch.tensor(input_ids, dtype=torch.int64).to(device),
            positions=torch.tensor(positions, dtype=torch.int64).to(device),
            out_cache_loc=out_cache_loc.to(device),
            qo_indptr=torch.tensor(qo_indptr, dtype=torch.int32).to(device),
            kv_indptr=kv_indptr,
            kv_indices=kv_indices,
            seq_lens=seq_lens_t.to(device),
            logits_indices=torch.tensor(prompt_rows + sample_rows, dtype=torch.int64).to(device),
            kv_pool=kv_pool,
        )
        return StepInput(fb, sampling_info, len(prompt_rows),
                         torch.tensor(prompt_targets, dtype=torch.int64).to(device),
                         prompt_counts, top_k)


class StepInput(NamedTuple):
    """Everything the forward worker needs for one step (tensors + plain values only)."""
    forward_batch: ForwardBatch
    sampling_info: SamplingBatchInfo
    num_prompt_rows: int           # the first rows of logits_indices are prompt-logprob rows
    prompt_targets: torch.Tensor   # [num_prompt_rows] int64: the token each of those rows scores
    prompt_counts: List[int]       # per req, how many prompt rows are its (in order)
    prompt_top_k: int              # top logprobs to keep per prompt row (0 = none)


class StepOutput(NamedTuple):
    """What the worker returns: sampled tokens for the sampling reqs (in batch order), and the
    prompt logprobs of the prompt rows, split per req (empty lists for reqs without)."""
    sample: SampleResult
    prompt_logprobs: List[List[float]]
    prompt_top_logprobs: List[Optional[List[List[Tuple[float, int]]]]]
