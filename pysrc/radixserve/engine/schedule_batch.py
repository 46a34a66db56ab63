"""ScheduleBatch: the requests of one step and what each computes; builds the step's StepInput.

The scheduler fills a ScheduleBatch on the event-loop thread (slots allocated, the host
ReqToToken rows written), then prepare() turns it into a StepInput of plain host values
(model/step_io.py). The forward worker sees only the StepInput. Sampling offsets are taken when
a request is added (add()), so a step scheduled before the previous step's tokens reach the host
samples exactly what the serial loop would.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

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
    [p0, p1) whose logits give prompt logprobs of tokens p0+1 .. p1. A pooling request
    (engine/pooling.py) never samples: pool_spans[i] = (offset in its extend, count) are the
    rows whose hidden states it pools this step (None: none), pool_final[i] says the step
    ends its prompt (it finishes when the step is processed)."""
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
    pool_spans: List[Optional[Tuple[int, int]]] = field(default_factory=list)
    pool_final: List[bool] = field(default_factory=list)
    # speculative verify steps (engine/scheduler/spec.py): per req, the draft tokens that
    # follow its last token this step ([] for none); None when the batch verifies nothing
    drafts: Optional[List[List[int]]] = None
    # scheduled over a verify step in flight: (request row, its draft length there) of each
    # request this step assumes fully accepted there (StepInput.spec_cond_rows)
    spec_cond: List[Tuple[int, int]] = field(default_factory=list)
    step_input: Optional[StepInput] = None                        # set by Scheduler.schedule()

    def add(self, req: Req, start: int, length: int, slots: Optional[torch.Tensor], sample: bool,
            prompt_lp: Optional[Tuple[int, int]] = None, from_device: bool = False,
            pool_span: Optional[Tuple[int, int]] = None, pool_final: bool = False) -> None:
        self.reqs.append(req)
        self.pool_spans.append(pool_span)
        self.pool_final.append(pool_final)
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
        if self.drafts is not None:
            self.drafts.append([])

    def add_verify(self, req: Req, draft: List[int], start: int) -> None:
        """In a verify step (a DECODE batch with drafts, engine/scheduler/spec.py): req
        computes its last token (at position start, read from the device as in any decode)
        and its draft (positions start + 1 ..), its row already extended over them, and
        samples at each of the len(draft) + 1 positions, output offsets offsets[i] ..
        offsets[i] + len(draft). An empty draft is a plain decode row. req.num_output_scheduled
        counts the whole draft as accepted (what a step scheduled over this one assumes);
        ResultProcessor._apply_verify corrects it when a draft token is rejected."""
        if self.drafts is None:
            self.drafts = [[] for _ in self.reqs]
        self.add(req, start, len(draft) + 1, None, sample=True, from_device=True)
        self.drafts[-1] = list(draft)
        req.num_output_scheduled += len(draft)

    def pending_drafts(self) -> Dict[int, List[int]]:
        """{id(req): its draft} of the requests whose draft this step verifies and that still
        hold the state it was scheduled for (not finished, no jump, not voided since)."""
        if self.drafts is None:
            return {}
        return {id(r): d for i, (r, d) in enumerate(zip(self.reqs, self.drafts))
                if d and self.current(i)}

    @property
    def verifies(self) -> bool:
        """Some row verifies a draft (a speculative verify step)."""
        return self.drafts is not None

    def ends_prompt(self, i: int) -> bool:
        """reqs[i]'s prompt ends in this step: it samples there, or it is a pooling request
        whose prompt's last chunk this is."""
        return self.sample[i] or self.pool_final[i]

    def num_samples(self, i: int) -> int:
        """Sampling rows of reqs[i] this step: 0, 1, or len(draft) + 1 for a verify row."""
        if not self.sample[i]:
            return 0
        return len(self.drafts[i]) + 1 if self.drafts is not None else 1

    def current(self, i: int) -> bool:
        """reqs[i] is still in the state this step was scheduled for (not finished, no jump)."""
        return not self.reqs[i].finished and self.reqs[i].epoch == self.epochs[i]

    def sampling_owners(self) -> List[int]:
        """Per sampling row, in order, the index of the request it belongs to (a verify row's
        request owns its len(draft) + 1 rows)."""
        return [i for i in range(self.batch_size) for _ in range(self.num_samples(i))]

    def sampling_grammars(self) -> list:
        """Per sampling row (sampling_owners): the grammar whose mask it samples under, None
        for a free row or a request whose token will be dropped (finished or jumped since it
        was scheduled). A request with a grammar never drafts: its one row."""
        return [self.reqs[i].grammar if self.current(i) else None
                for i in self.sampling_owners()]

    @property
    def batch_size(self) -> int:
        return len(self.reqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    # ------------------------------------------------------------------ StepInput
    def prepare(self, rows: ReqToTokenPool, eos_ids: Sequence[int], vocab_size: int,
                decode_slots: Optional[torch.Tensor] = None,
                spec_row_base: Optional[int] = None) -> StepInput:
        """The StepInput of this batch. Loop thread; the host rows must be written already.
        decode_slots: a decode batch's new slots as one tensor (saves a cat of B pieces).
        spec_row_base: the runner's first spare row (a verify step's draft positions run as
        decode rows of their own there; see _verify_rows)."""
        pool_rows = [r.req_pool_idx for r in self.reqs]
        seq_lens = [s + n for s, n in zip(self.extend_starts, self.extend_lens)]
        spec = None
        if self.drafts is not None:
            pool_rows, seq_lens, spec = self._verify_rows(spec_row_base)
        if decode_slots is not None:
            out_cache_loc = decode_slots
        else:
            out_cache_loc = (torch.cat(self.new_slots) if self.new_slots
                             else torch.empty(0, dtype=torch.int64))           # [num_tokens]
        if spec is not None:
            sample_rows = list(pool_rows)          # a verify step samples at every row
        else:
            sample_rows = [row for row, s in zip(pool_rows, self.sample) if s]
        step = StepInput(self.mode, len(pool_rows), pool_rows, seq_lens, out_cache_loc,
                         sample_rows, self.sampling_inputs(eos_ids, vocab_size))
        if spec is not None:
            step.spec_tokens, step.spec_counts, step.spec_sample, step.spec_src = spec
        if self.spec_cond:
            step.spec_cond_rows = [row for row, _ in self.spec_cond]
            step.spec_cond_expect = [k for _, k in self.spec_cond]
        pending = rows.take_pending()
        if pending is not None:
            step.table_rows, step.table_cols, step.table_slots = pending
        if self.mode is not ForwardMode.DECODE:
            self._extend_fields(step)
        return step

    def _verify_rows(self, spec_row_base: Optional[int]):
        """A verify step's decode rows: each request's own row at its last token, then one row
        per draft token, numbered from spec_row_base up (the runner copies the request's slot
        table into those rows and its draft tokens into their next_ids before the step). Row
        t of a request of draft d has KV length start + t + 1 and input d[t - 1].
        Returns (pool_rows [N], seq_lens [N], (spec_tokens [R], spec_counts [V],
        spec_sample [V], spec_src [R]))."""
        if spec_row_base is None:
            raise ValueError("a verify step needs the runner's spare rows (spec_row_base)")
        pool_rows: List[int] = []
        seq_lens: List[int] = []
        tokens: List[int] = []
        counts: List[int] = []
        firsts: List[int] = []
        src: List[int] = []
        spare = spec_row_base
        for i, req in enumerate(self.reqs):
            start, draft = self.extend_starts[i], self.drafts[i]
            if draft:
                counts.append(len(draft))
                firsts.append(len(pool_rows))
                tokens += draft
            pool_rows.append(req.req_pool_idx)
            seq_lens.append(start + 1)
            for t in range(1, len(draft) + 1):
                pool_rows.append(spare)
                seq_lens.append(start + t + 1)
                src.append(req.req_pool_idx)
                spare += 1
        return pool_rows, seq_lens, (tokens, counts, firsts, src)

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
            span = self.pool_spans[i]
            if span is not None:
                step.pool_starts.append(base + span[0])
                step.pool_counts.append(span[1])
                step.pool_labels.append(list(req.pool.label_ids) if self.pool_final[i] else [])
            base += n
        step.input_ids, step.positions = input_ids, positions
        step.extend_lens = list(self.extend_lens)
        step.logits_indices = prompt_rows + sample_rows
        step.num_prompt_rows = len(prompt_rows)

    def sampling_inputs(self, eos_ids: Sequence[int], vocab_size: int) -> SamplingInputs:
        """The per-row sampling inputs of the rows that sample, in batch order, each at the
        output offset taken by add() (sampling/batch.py builds them)."""
        reqs, offsets = [], []
        for i, req in enumerate(self.reqs):
            for j in range(self.num_samples(i)):      # a verify row samples offset .. offset + k
                reqs.append(req)
                offsets.append(self.offsets[i] + j)
        return SamplingInputs.from_requests(reqs, offsets, eos_ids, vocab_size)
