"""KVPool (token slots and their K/V tensors) and ReqToTokenPool (running request -> slots).

Ownership: the KVPool owns slots. A slot is either free (in the pool's free list) or owned by
exactly one holder: a running request (its new tokens) or the prefix cache (published tokens).
Slot 0 is a padding slot that is never handed out, so kernels may read it harmlessly.
Page size 1: one slot holds one token's K and V for every layer.
The pages are in the model's dtype, or FP8 (--kv-cache-dtype fp8_e4m3 / fp8_e5m2: one byte per
element, so the same memory holds twice the tokens of a bf16 pool); the layers' FP8 scales live
with the model (LlamaAttention.k_scale / v_scale), which passes them to the store and attention
ops. The prefix cache indexes slots whatever their dtype.
Tensor parallelism (--tp-size N): ShardedKVPool, the same slots and allocator over per-rank
buffers that each hold the rank's KV heads of every token.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch


class KVBuffers:
    """Per-layer K and V buffers, each [num_slots + 1, num_kv_heads, head_dim] (slot 0 = padding),
    of dtype (the model's, or torch.float8_e4m3fn / float8_e5m2 for an FP8 cache), on device:
    what the model reads and writes (fb.kv_pool.k_buffers / v_buffers). A KVPool is one with its
    slot allocator; a tensor-parallel rank's shard (ShardedKVPool.shards) is one alone."""

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

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """K + V bytes of one token over all layers: 1 byte per element for FP8."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()

    @property
    def is_fp8(self) -> bool:
        return self.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)

    @property
    def size_bytes(self) -> int:
        return self.num_slots * self.bytes_per_token(self.num_layers, self.num_kv_heads,
                                                     self.head_dim, self.dtype)


class KVPool(KVBuffers):
    """KVBuffers (per-layer K and V, each [num_slots + 1, num_kv_heads, head_dim], slot 0 =
    padding) and the allocator of their slots.

    Contract: alloc(n) returns n distinct free slots (int64 tensor on the CPU) or None when fewer
    than n are free, and changes nothing in that case; free(slots) returns slots to the free list.
    Freeing a slot that is already free is a bug; free() does not check, the scheduler's
    check_integrity (--debug-integrity) finds it.
    """

    def __init__(self, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device):
        super().__init__(num_slots, num_layers, num_kv_heads, head_dim, dtype, device)
        self._free = torch.arange(1, num_slots + 1, dtype=torch.int64)   # [num_free] on the CPU
        self._num_free = num_slots

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
    """Rows of slot indices, one row per running request: the scheduler's host copy,
    [max_running_reqs, max_context_len] int32 on the CPU.

    A request holds one row from admission to finish (or retraction); row r, positions
    [0, kv_len) are that request's KV slots (prefix from the cache, then its own). The device
    copy (ModelRunner.req_to_token) receives the same writes through each step's inputs, in step
    order; this copy is what the scheduler reads (publishing to the cache, integrity checks), so
    reading it never waits for the device.
    """

    def __init__(self, max_running_reqs: int, max_context_len: int):
        self.size = max_running_reqs
        self.max_context_len = max_context_len
        # [max_running_reqs, max_context_len] int32, host
        self.req_to_token = torch.zeros((max_running_reqs, max_context_len), dtype=torch.int32)
        self._free_rows = list(range(max_running_reqs))
        self._pending: List[Tuple[int, int, torch.Tensor]] = []   # writes the device lacks

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> Optional[int]:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Positions [start, start + n) of row = slots; the next step carries the write to the
        device copy (take_pending)."""
        if slots.numel() == 0:
            return
        self.req_to_token[row, start:start + slots.numel()] = slots.to(torch.int32)
        self._pending.append((row, start, slots.to(torch.int64)))

    def take_pending(self) -> Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The writes since the last call as (rows, cols, slots) int64 tensors, or None."""
        if not self._pending:
            return None
        rows = torch.cat([torch.full((s.numel(),), r, dtype=torch.int64)
                          for r, _, s in self._pending])
        cols = torch.cat([torch.arange(c, c + s.numel(), dtype=torch.int64)
                          for _, c, s in self._pending])
        slots = torch.cat([s for _, _, s in self._pending])
        self._pending = []
        return rows, cols, slots

    def write_many(self, rows: torch.Tensor, cols: torch.Tensor, slots: torch.Tensor) -> None:
        """req_to_token[rows[i], cols[i]] = slots[i], one indexed write: a decode step's slots,
        which the step itself writes on the device (model/forward_batch.decode_prologue)."""
        self.req_to_token[rows, cols] = slots.to(torch.int32)

    def slots(self, row: int, end: int) -> torch.Tensor:
        """Slots of positions [0, end) of row: int64 [end] (a copy)."""
        return self.req_to_token[row, :end].to(torch.int64)

    def reset(self) -> None:
        self._free_rows = list(range(self.size))
        self._pending = []


class ShardedKVPool(KVPool):
    """The KV pool of tensor parallelism (model/tensor_parallel.py): sharded by KV heads, each
    rank's shard (shards[r], a KVBuffers on that rank's device) holding its heads of every
    token, [num_slots + 1, local_kv_heads, head_dim] per layer. The slots, their one allocator
    (this object's alloc / free, the scheduler's) and hence the radix tree stay global and
    single: slot s is token s on every rank. k_buffers / v_buffers are rank 0's, and
    num_kv_heads is a rank's (local) count; size_bytes counts every shard."""

    def __init__(self, num_slots: int, num_layers: int, local_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, devices: Sequence[str | torch.device]):
        if not devices:
            raise ValueError("a sharded KV pool needs at least one rank")
        self.shards: List[KVBuffers] = [
            KVBuffers(num_slots, num_layers, local_kv_heads, head_dim, dtype, d) for d in devices]
        first = self.shards[0]
        self.num_slots, self.num_layers = num_slots, num_layers
        self.num_kv_heads, self.head_dim = local_kv_heads, head_dim
        self.dtype, self.device = dtype, first.device
        self.k_buffers, self.v_buffers = first.k_buffers, first.v_buffers
        self._free = torch.arange(1, num_slots + 1, dtype=torch.int64)   # [num_free] on the CPU
        self._num_free = num_slots

    @property
    def size_bytes(self) -> int:
        return sum(shard.size_bytes for shard in self.shards)

    def shard(self, rank: int) -> KVBuffers:
        return self.shards[rank]
