"""Logit penalties, applied to a batch's logits before sampling (in place).

Semantics:
  * repetition_penalty r (HF transformers): for every token seen in prompt + output so far,
    a positive logit is divided by r and a negative one multiplied by r.
  * frequency_penalty f, presence_penalty p (OpenAI): logit -= f * count_in_output + p * (count > 0),
    counting output tokens only.
  * min_new_tokens: until a request has that many output tokens, its EOS and stop_token_ids
    get -inf so they cannot be sampled.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch


@dataclass
class PenaltyInfo:
    """Per-batch penalty tensors (None where no row of the batch uses that penalty)."""
    repetition: Optional[torch.Tensor] = None      # [batch] float32, 1 = off
    seen_mask: Optional[torch.Tensor] = None       # [batch, vocab] bool: seen in prompt + output
    frequency: Optional[torch.Tensor] = None       # [batch] float32
    presence: Optional[torch.Tensor] = None        # [batch] float32
    output_counts: Optional[torch.Tensor] = None   # [batch, vocab] float32: counts in output
    banned_rows: Optional[torch.Tensor] = None     # [num_banned] int64 } logits[rows, cols] = -inf
    banned_cols: Optional[torch.Tensor] = None     # [num_banned] int64 }

    @property
    def active(self) -> bool:
        return (self.repetition is not None or self.frequency is not None
                or self.banned_rows is not None)

    @classmethod
    def build(cls, vocab_size: int, device: torch.device, rep: Sequence[float],
              freq: Sequence[float], pres: Sequence[float], prompt_ids: Sequence[List[int]],
              output_ids: Sequence[List[int]], banned: Sequence[List[int]]) -> "PenaltyInfo":
        """rep/freq/pres: one value per row; prompt_ids/output_ids: each row's tokens so far;
        banned: token ids each row may not sample this step (min_new_tokens)."""
        batch = len(rep)
        info = cls()
        if any(r != 1.0 for r in rep):
            info.repetition = torch.tensor(rep, dtype=torch.float32, device=device)
            seen = torch.zeros((batch, vocab_size), dtype=torch.bool)        # [batch, vocab]
            for b in range(batch):
                if rep[b] != 1.0:
                    ids = prompt_ids[b] + output_ids[b]
                    if ids:
                        seen[b, torch.tensor(ids, dtype=torch.int64)] = True
            info.seen_mask = seen.to(device)
        if any(f != 0.0 for f in freq) or any(p != 0.0 for p in pres):
            info.frequency = torch.tensor(freq, dtype=torch.float32, device=device)
            info.presence = torch.tensor(pres, dtype=torch.float32, device=device)
            counts = torch.zeros((batch, vocab_size), dtype=torch.float32)   # [batch, vocab]
            for b in range(batch):
                if (freq[b] != 0.0 or pres[b] != 0.0) and output_ids[b]:
                    counts[b] = torch.bincount(torch.tensor(output_ids[b], dtype=torch.int64),
                                               minlength=vocab_size)[:vocab_size].float()
            info.output_counts = counts.to(device)
        rows = [b for b in range(batch) for _ in banned[b]]
        if rows:
            cols = [t for b in range(batch) for t in banned[b]]
            info.banned_rows = torch.tensor(rows, dtype=torch.int64, device=device)
            info.banned_cols = torch.tensor(cols, dtype=torch.int64, device=device)
        return info


def apply_penalties(logits: torch.Tensor, info: PenaltyInfo) -> None:
    """logits: [batch, vocab] float32, modified in place."""
    if info.repetition is not None:
        r = info.repetition[:, None]
        penalized = torch.where(logits > 0, logits / r, logits * r)
        logits.copy_(torch.where(info.seen_mask, penalized, logits))
    if info.frequency is not None:
        counts = info.output_counts
        logits -= info.frequency[:, None] * counts + info.presence[:, None] * (counts > 0).float()
    if info.banned_rows is not None:
        logits[info.banned_rows, info.banned_cols] = float("-inf")
