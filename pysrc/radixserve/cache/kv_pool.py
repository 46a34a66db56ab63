"""KVPool (token slots and their K/V tensors) and ReqToTokenPool (running request -> slots).

Ownership: the KVPool owns slots. A slot is either free (in the pool's free list) or owned by
exactly one holder: a running request (its new tokens) or the prefix cache (published tokens).
Slot 0 is a padding slot that is never handed out, so kernels may read it harmlessly.
Page size 1: one slot holds one token's K and V for every layer.
"""
from __future__ import annotations

from typing import List, Optional

import torch


class KVPool:
    """Per-layer K and V buffers, each [num_slots + 1, num_kv_heads, head_dim] (slot 0 = padding).

    Contract: alloc(n) returns n distinct free slots (int64 tensor on the CPU) or None when fewer
    than n are free, and changes nothing in that case; free(slots) returns slots to the free list.
    Freeing a slot that is already free is a bug and raises in debug mode (check_integrity).
    """

    def __init__(self, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device):
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_slots + 1, num_kv_heads, head_dim)
        # [num_slots + 1, num_kv_heads, head_dim] per layer
        self.k_buffers: List[torch.Tensor] = [torch.zeros(shape, dtype=dtype, device=self.device)
                                              for _ in range(num_layers)]
        self.v_buffers: List[torch.Tensor] = [torch.zeros(shape, dtype=dtype, device=self.device)
                                              for _ in range(num_layers)]
        self._free = torch.arange(1, num_slots + 1, dtype=torch.int64)   # [num_free] on the CPU
        self._num_free = num_slots

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()

    @property
    def size_bytes(self) -> int:
        return self.num_slots * self.bytes_per_token(self.num_layers, self.num_kv_heads,
                                                     self.head_dim, self.dtype)

    def available_size(self) -> int:
        return self._num_free

    def alloc(self, n: int) -> Optional[torch.Tensor]:
        if n > self._num_free:
            return None
        start = self._num_free - n
        out = self._free[start:self._num_free].clone()
        self._num_free = start
        return out

    def free(self, slots: torch.Tensor) -> None:
        n = slots.numel()
        if n == 0:
            return
        self._free[self._num_free:self._num_free + n] = slots.to(torch.int64).cpu()
        self._num_free += n

    def free_slots(self) -> torch.Tensor:
        """A copy of the free list (for integrity checks)."""
        return self._free[:self._num_free].clone()

    def reset(self) -> None:
        self._free = torch.arange(1, self.num_slots + 1, dtype=torch.int64)
        self._num_free = self.num_slots


class ReqToTokenPool:
    """Rows of slot indices, one row per running request: [max_running_reqs, max_context_len] int32.

    A request holds one row from admission to finish (or retraction); row r, positions
    [0, seq_len) are that request's KV slots (prefix from the cache, then its own).
    """

    def __init__(self, max_running_reqs: int, max_context_len: int, device: str | torch.device):
        self.size = max_running_reqs
        self.max_context_len = max_context_len
        # [max_running_reqs, max_context_len] int32
        self.req_to_token = torch.zeros((max_running_reqs, max_context_len), dtype=torch.int32,
                                        device=device)
        self._free_rows = list(range(max_running_reqs))

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> Optional[int]:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        self.req_to_token[row, start:start + slots.numel()] = slots.to(self.req_to_token.device,
                                                                       torch.int32)

    def reset(self) -> None:
        self._free_rows = list(range(self.size))
