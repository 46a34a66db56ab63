"""Sampler: turns a batch's logits into next-token ids (+ logprobs), and prompt logits into
prompt logprobs.

SamplingBatchInfo is built on the event-loop thread from the requests (sampling_batch_info());
sample() and prompt_logprobs() run on the forward worker thread and touch only the tensors they
are given. Logprobs are the model's own: log_softmax of the raw logits, before penalties,
temperature and filters; top_logprobs are torch.topk of the same log_softmax row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

from radixserve import ops
from radixserve.sampling.penalties import PenaltyInfo, apply_penalties

# rows of prompt logits turned into log_softmax at a time (bounds the [rows, vocab] temporaries)
PROMPT_LOGPROB_CHUNK = 128


@dataclass
class SamplingBatchInfo:
    """Per-row sampling tensors for the rows that sample this step (on the model's device)."""
    temperature: torch.Tensor      # [batch] float32, 0 = greedy
    top_k: torch.Tensor            # [batch] int32, <= 0 = off
    top_p: torch.Tensor            # [batch] float32
    min_p: torch.Tensor            # [batch] float32
    seeds: torch.Tensor            # [batch] int64
    offsets: torch.Tensor          # [batch] int64: output tokens so far (the step offset)
    penalties: PenaltyInfo
    logprob_rows: List[int]        # rows whose sampled-token logprob is returned
    top_logprobs_num: List[int]    # per row, 0 = none
    all_greedy: bool


class SampleResult(NamedTuple):
    ids: List[int]                                   # [batch]
    logprobs: List[Optional[float]]                  # [batch], None where not asked
    top_logprobs: List[Optional[List[Tuple[float, int]]]]  # [batch], sorted desc, None where not asked


def sampling_batch_info(reqs: Sequence, vocab_size: int, eos_ids: Sequence[int],
                        device: torch.device) -> SamplingBatchInfo:
    """Build the tensors for reqs (engine Req objects), in order. Loop thread only."""
    temps, top_ks, top_ps, min_ps, seeds, offsets = [], [], [], [], [], []
    rep, freq, pres, prompts, outputs, banned = [], [], [], [], [], []
    logprob_rows, top_nums = [], []
    for i, r in enumerate(reqs):
        sp = r.sampling_params
        temps.append(float(sp.temperature))
        top_ks.append(int(sp.top_k) if sp.top_k and sp.top_k > 0 else -1)
        top_ps.append(float(sp.top_p))
        min_ps.append(float(sp.min_p))
        seeds.append(int(r.seed or 0))
        offsets.append(len(r.output_ids))
        rep.append(float(sp.repetition_penalty))
        freq.append(float(sp.frequency_penalty))
        pres.append(float(sp.presence_penalty))
        prompts.append(r.origin_input_ids)
        outputs.append(r.output_ids)
        ban: List[int] = []
        if len(r.output_ids) < sp.min_new_tokens:
            ban = sorted({t for t in list(eos_ids) + list(sp.stop_token_ids or [])
                          if 0 <= t < vocab_size})
        banned.append(ban)
        if r.return_logprob:
            logprob_rows.append(i)
        top_nums.append(int(r.top_logprobs_num) if r.return_logprob else 0)
    penalties = PenaltyInfo.build(vocab_size, device, rep, freq, pres, prompts, outputs, banned)
    return SamplingBatchInfo(
        temperature=torch.tensor(temps, dtype=torch.float32, device=device),
        top_k=torch.tensor(top_ks, dtype=torch.int32, device=device),
        top_p=torch.tensor(top_ps, dtype=torch.float32, device=device),
        min_p=torch.tensor(min_ps, dtype=torch.float32, device=device),
        seeds=torch.tensor(seeds, dtype=torch.int64, device=device),
        offsets=torch.tensor(offsets, dtype=torch.int64, device=device),
        penalties=penalties,
        logprob_rows=logprob_rows,
        top_logprobs_num=top_nums,
        all_greedy=all(t == 0.0 for t in temps),
    )


def sample(logits: torch.Tensor, info: SamplingBatchInfo,
           bitmask: Optional[torch.Tensor] = None) -> SampleResult:
    """logits: [batch, vocab] float32 raw model logits (not modified). Worker thread."""
    batch = logits.shape[0]
    if batch == 0:
        return SampleResult([], [], [])
    want_logprobs = bool(info.logprob_rows)
    raw_logprobs = torch.log_softmax(logits.float(), dim=-1) if want_logprobs else None
    if info.penalties.active:
        work = logits.float().clone()
        apply_penalties(work, info.penalties)
    else:
        work = logits
    if info.all_greedy and bitmask is None:
        ids_t = work.argmax(dim=-1)
    else:
        ids_t = ops.bitmask_sample(work, bitmask, info.temperature, info.top_k, info.top_p,
                                   info.min_p, info.seeds, info.offsets).ids
    ids = ids_t.tolist()
    logprobs: List[Optional[float]] = [None] * batch
    tops: List[Optional[List[Tuple[float, int]]]] = [None] * batch
    if want_logprobs:
        rows = torch.tensor(info.logprob_rows, dtype=torch.int64, device=logits.device)
        chosen = raw_logprobs[rows].gather(-1, ids_t[rows][:, None])[:, 0].tolist()
        for j, row in enumerate(info.logprob_rows):
            logprobs[row] = chosen[j]
        max_k = max(info.top_logprobs_num)
        if max_k > 0:
            vals, idx = torch.topk(raw_logprobs[rows], max_k, dim=-1)
            vals, idx = vals.tolist(), idx.tolist()
            for j, row in enumerate(info.logprob_rows):
                k = info.top_logprobs_num[row]
                if k > 0:
                    tops[row] = list(zip(vals[j][:k], idx[j][:k]))
    return SampleResult(ids, logprobs, tops)


def prompt_logprobs(compute_logits, hidden: torch.Tensor, target_ids: torch.Tensor,
                    top_k: int) -> Tuple[List[float], Optional[List[List[Tuple[float, int]]]]]:
    """Logprobs of target_ids[i] under the logits of hidden row i, in chunks of rows.

    compute_logits: hidden [n, hidden] -> logits [n, vocab] float32
    hidden:     [num_rows, hidden] hidden states of the positions before each target token
    target_ids: [num_rows] int64 on hidden's device
    top_k:      > 0 also returns each row's top_k (logprob, id) pairs, sorted desc
    """
    values: List[float] = []
    tops: Optional[List[List[Tuple[float, int]]]] = [] if top_k > 0 else None
    for start in range(0, hidden.shape[0], PROMPT_LOGPROB_CHUNK):
        end = min(start + PROMPT_LOGPROB_CHUNK, hidden.shape[0])
        lp = torch.log_softmax(compute_logits(hidden[start:end]).float(), dim=-1)  # [rows, vocab]
        values += lp.gather(-1, target_ids[start:end, None])[:, 0].tolist()
        if tops is not None:
            v, i = torch.topk(lp, top_k, dim=-1)
            tops += [list(zip(a, b)) for a, b in zip(v.tolist(), i.tolist())]
    return values, tops
