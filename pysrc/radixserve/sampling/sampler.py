"""Sampler: turns a step's logits into next-token ids (+ logprobs) on the device, without a
host synchronisation, and prompt logits into prompt logprobs.

Logprobs are the model's own: log_softmax of the raw logits, before penalties, temperature and
filters. They come from the sampler's own outputs (bitmask_sample returns the chosen id's log
probability of the logits it was given; top logprobs are topk(logits) - logsumexp(logits)), not
from a second full-vocabulary log_softmax. A row whose chosen logprob is not finite had
non-finite logits: the caller fails that row alone.

Runs on the thread that runs steps; touches only the tensors it is given and PenaltyState.
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

import torch

from radixserve import ops
from radixserve.sampling import cpu_sampling
from radixserve.sampling.batch import SamplingInputs, SamplingTensors
from radixserve.sampling.penalties import PenaltyState, ban_tokens

# rows of prompt logits turned into log_softmax at a time (bounds the [rows, vocab] temporaries)
PROMPT_LOGPROB_CHUNK = 128


class DeviceSample(NamedTuple):
    """Sampler outputs, still on the device."""
    ids: torch.Tensor                  # [S] int64
    logprobs: torch.Tensor             # [S] float32, raw-logit log probability of ids (when no
                                       # row asks for logprobs: a value finite iff the row is)
    top_values: Optional[torch.Tensor]  # [S, K] float32 top logprobs (K = max asked), or None
    top_ids: Optional[torch.Tensor]     # [S, K] int64


def sample(logits: torch.Tensor, inputs: SamplingInputs, st: SamplingTensors,
           pool_rows: torch.Tensor, penalties: PenaltyState,
           bitmask: Optional[torch.Tensor] = None) -> DeviceSample:
    """logits: [S, vocab] float32 raw model logits (not modified: they may be a CUDA graph's
    static output). pool_rows: [S] int64 ReqToToken rows of the sampling rows (penalty state).
    inputs: the host copy of st (sampling/batch.py; its list lengths and flags decide which
    work runs, with no device read). bitmask: None or [S, ceil(vocab / 32)] int32 on the
    device (grammar rows; free rows all ones). Order: logit_bias, penalties, bans, then
    bitmask_sample's mask and filters (on CPU tensors cpu_sampling.bitmask_sample,
    ops.bitmask_sample's contract without a sort of the vocabulary). Records the sampled ids in
    the penalty state."""
    penalized = bool(inputs.penalty_rows) or bool(inputs.banned_rows) or bool(inputs.bias_rows)
    work = logits
    if penalized:
        if logits.device.type == "cpu":      # reused memory (cpu_sampling.workspace)
            work = cpu_sampling.workspace.get("penalized", tuple(logits.shape),
                                              logits.dtype).copy_(logits)
        else:
            work = logits.clone()
        if inputs.bias_rows:
            work.index_put_((st.bias_rows, st.bias_cols), st.bias_values, accumulate=True)
        if inputs.penalty_rows:
            penalties.apply(work, st.penalty_rows, pool_rows.index_select(0, st.penalty_rows),
                            st.repetition, st.frequency, st.presence)
        if inputs.banned_rows:
            ban_tokens(work, st.banned_rows, st.banned_cols)
    max_k = max(inputs.top_logprobs_num, default=0)
    want_lp = bool(inputs.logprob_rows)
    if inputs.all_greedy and bitmask is None:
        ids = ops.argmax_rows(work)                                          # [S] int64
        logprobs = None
    elif work.device.type == "cpu":
        # the same contract without a full-vocabulary sort per row (cpu_sampling.py); no
        # log_softmax of the whole batch unless a row asks for logprobs
        ids, logprobs = cpu_sampling.bitmask_sample(work, bitmask, st.temperature, st.top_k,
                                                    st.top_p, st.min_p, st.seeds, st.offsets,
                                                    want_logprobs=want_lp and not penalized)
    else:
        ids, logprobs = ops.bitmask_sample(work, bitmask, st.temperature, st.top_k, st.top_p,
                                           st.min_p, st.seeds, st.offsets)
    lse = torch.logsumexp(logits, dim=-1) if want_lp else None              # [S]
    if logprobs is None or (penalized and want_lp):
        chosen = logits.gather(-1, ids[:, None])[:, 0]                       # [S]
        # not asked for: the chosen raw logit stands in; it is finite iff the row's logits are
        logprobs = chosen - lse if want_lp else chosen
    top_values = top_ids = None
    if max_k > 0:
        top_values, top_ids = torch.topk(logits, max_k, dim=-1)
        top_values = top_values - lse[:, None]
    penalties.record(pool_rows, ids)
    return DeviceSample(ids, logprobs, top_values, top_ids)


def host_result(inputs: SamplingInputs, ids: List[int], logprobs: List[float],
                top_values: Optional[List[List[float]]], top_ids: Optional[List[List[int]]]):
    """(logprobs, top_logprobs, finite) lists per row from host copies of a DeviceSample:
    logprobs only where asked, top entries cut to each row's own count."""
    n = len(ids)
    out_lp: List[Optional[float]] = [None] * n
    out_top: List[Optional[List[Tuple[float, int]]]] = [None] * n
    for row in inputs.logprob_rows:
        out_lp[row] = logprobs[row]
        k = inputs.top_logprobs_num[row]
        if k > 0 and top_values is not None:
            out_top[row] = list(zip(top_values[row][:k], top_ids[row][:k]))
    finite = [v == v and v not in (float("inf"), float("-inf")) for v in logprobs]
    return out_lp, out_top, finite


def prompt_logprobs(compute_logits, hidden: torch.Tensor, target_ids: torch.Tensor,
                    top_k: int) -> Tuple[List[float], Optional[List[List[Tuple[float, int]]]]]:
    """Logprobs of target_ids[i] under the logits of hidden row i, in chunks of rows.

    compute_logits: hidden [n, hidden] -> logits [n, vocab] float32
    hidden:     [num_rows, hidden] hidden states of the positions before each target token
    target_ids: [num_rows] int64 on hidden's device
    top_k:      > 0 also returns each row's top_k (logprob, id) pairs, sorted desc
    Reads the values back to the host (prompt logprobs come only with prefill steps, which the
    pipeline resolves before scheduling the next step anyway).
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
