"""ScheduleBatch: the requests of one step and what each computes; builds the step's StepInput.

The scheduler fills a ScheduleBatch on the event-loop thread (slots allocated, the host
ReqToToken rows written), then prepare() turns it into a StepInput of plain host values
(model/step_io.py). The forward worker sees only the StepInput. Sampling offsets are taken when
a request is added (add()), so a step scheduled before the previous step's tokens reach the host
samples exactly what the serial loop would.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch

from radixserve.cache.kv_pool import ReqToTokenPool
from radixserve.engine.req import Req
from radixserve.model.forward_batch import ForwardMode
from radixserve.model.step_io import StepInput
from radixserve.sampling.batch import SamplingInputs


@dataclass
class ScheduleBatch:
    """reqs[i] computes fill positions [extend_starts[i], extend_starts[i] + extend_lens[i]) this
    step. from_device[i]: its one input token is the id its previous step sampled, still on the
    device (decode rows). sample[i]: the step ends req i's prefill (or is a decode), so a token
    is drawn from its last position, at output offset offsets[i]. prompt_lp[i]: positions
    [p0, p1) whose logits give prompt logprobs of tokens p0+1 .. p1."""
    mode: ForwardMode
    reqs: List[Req] = field(default_factory=list)
    extend_starts: List[int] = field(default_factory=list)
    extend_lens: List[int] = field(default_factory=list)
    from_device: List[bool] = field(default_factory=list)
    sample: List[bool] = field(default_factory=list)
    offsets: List[int] = field(default_factory=list)
    epochs: List[int] = field(default_factory=list)      # req.epoch when scheduled (jump-forward)
    prompt_lp: List[Optional[Tuple[int, int]]] = field(default_factory=list)
    # per req, [extend_len] int64 CPU; None in a decode batch, whose slots are decode_slots
    new_slots: List[Optional[torch.Tensor]] = field(default_factory=list)
    decode_slots: Optional[torch.Tensor] = None                   # decode: all new slots, [B]
    step_input: Optional[StepInput] = None                        # set by Scheduler.schedule()

    def add(self, req: Req, start: int, length: int, slots: Optional[torch.Tensor], sample: bool,
            prompt_lp: Optional[Tuple[int, int]] = None, from_device: bool = False) -> None:
        self.reqs.append(req)
        self.extend_starts.append(start)
        self.extend_lens.append(length)
        self.from_device.append(from_device)
        self.sample.append(sample)
        self.offsets.append(req.num_output_scheduled if sample else -1)
        self.epochs.append(req.epoch)
        if sample:
            req.num_output_scheduled += 1
        self.prompt_lp.append(prompt_lp)
        self.new_slots.append(slots)

    def current(self, i: int) -> bool:
        """reqs[i] is still in the state this step was scheduled for (not finished, no jump)."""
        return not self.reqs[i].finished and self.reqs[i].epoch == self.epochs[i]

    def sampling_grammars(self) -> list:
        """Per sampling row: the grammar whose mask it samples under, None for a free row or a
        request whose token will be dropped (finished or jumped since it was scheduled)."""
        return [self.reqs[i].grammar if self.current(i) else None
                for i in range(self.batch_size) if self.sample[i]]

    @property
    def batch_size(self) -> int:
        return len(self.reqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    # ------------------------------------------------------------------ StepInput
    def prepare(self, rows: ReqToTokenPool, eos_ids: Sequence[int], vocab_size: int,
                decode_slots: Optional[torch.Tensor] = None) -> StepInput:
        """The StepInput of this batch. Loop thread; the host rows must be written already.
        decode_slots: a decode batch's new slots as one tensor (saves a cat of B pieces)."""
        pool_rows = [r.req_pool_idx for r in self.reqs]
        seq_lens = [s + n for s, n in zip(self.extend_starts, self.extend_lens)]
        if decode_slots is not None:
            out_cache_loc = decode_slots
        else:
            out_cache_loc = (torch.cat(self.new_slots) if self.new_slots
                             else torch.empty(0, dtype=torch.int64))           # [num_tokens]
        sample_rows = [row for row, s in zip(pool_rows, self.sample) if s]
        step = StepInput(self.mode, self.batch_size, pool_rows, seq_lens, out_cache_loc,
                         sample_rows, self.sampling_inputs(eos_ids, vocab_size))
        pending = rows.take_pending()
        if pending is not None:
            step.table_rows, step.table_cols, step.table_slots = pending
        if self.mode is not ForwardMode.DECODE:
            self._extend_fields(step)
        return step

    def _extend_fields(self, step: StepInput) -> None:
        input_ids: List[int] = []
        positions: List[int] = []
        prompt_rows: List[int] = []
        sample_rows: List[int] = []
        base = 0
        for i, req in enumerate(self.reqs):
            start, n = self.extend_starts[i], self.extend_lens[i]
            if self.from_device[i]:
                step.resolve_pos.append(base)
                step.resolve_rows.append(req.req_pool_idx)
                input_ids.append(-1)
            else:
                input_ids += req.fill_ids[start:start + n]
            positions += range(start, start + n)
            lp = self.prompt_lp[i]
            if lp is not None:
                p0, p1 = lp
                prompt_rows += range(base + p0 - start, base + p1 - start)
                step.prompt_targets += req.fill_ids[p0 + 1:p1 + 1]
                step.prompt_counts.append(p1 - p0)
                step.prompt_top_k = max(step.prompt_top_k, req.top_logprobs_num)
            else:
                step.prompt_counts.append(0)
            if self.sample[i]:
                sample_rows.append(base + n - 1)
            base += n
        step.input_ids, step.positions = input_ids, positions
        step.extend_lens = list(self.extend_lens)
        step.logits_indices = prompt_rows + sample_rows
        step.num_prompt_rows = len(prompt_rows)

    def sampling_inputs(self, eos_ids: Sequence[int], vocab_size: int) -> SamplingInputs:
        """The per-row sampling inputs of the rows that sample, in batch order, each at the
        output offset taken by add() (sampling/batch.py builds them)."""
        rows = [i for i, s in enumerate(self.sample) if s]
        return SamplingInputs.from_requests([self.reqs[i] for i in rows],
                                            [self.offsets[i] for i in rows], eos_ids, vocab_size)
