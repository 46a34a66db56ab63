"""CudaGraphRunner: the decode forward captured as CUDA graphs, one per batch-size bucket.

A decode step of a small model is dozens of short kernels; launched one by one from Python the
GPU waits on the host between them. Captured once, a step is one graph launch.

What a graph holds: embedding -> every layer (rotary, store_kv, paged decode attention, MLP) ->
final norm -> logits (fp32), for `bucket` rows, reading only the static input buffers below and
the KV pool (fixed tensors), writing the KV pool and the static logits buffer.

Static inputs (allocated once for the largest bucket; a bucket's graph sees the first `bucket`
rows):
    input_ids      [max_bs] int64      out_cache_loc [max_bs] int64
    positions      [max_bs] int64      kv_indptr     [max_bs + 1] int32
    kv_indices     [max_bs * context_len] int32 (bucket b's graph sees the first b * context_len:
                   the decode kernel's split count, fixed at capture, derives from that length)
replay(fb) copies a decode ForwardBatch of bs <= max_bs rows into them and pads rows bs..bucket-1
as empty requests: token 0 at position 0 writing the padding slot 0 (whose contents nothing
reads) with no KV to attend to (kv_indptr stays flat past row bs), so a padded row can neither
read nor write another request's KV.

Used only where every op on the decode path is a graph-safe kernel: a CUDA device, the
radixserve._C extension, bf16/fp16 (float32 attention runs the torch reference, which syncs),
and not --disable-cuda-graph. Capture and replay happen on the thread and device of the runner;
the returned logits are a view of static memory, valid until the next replay.
"""
from __future__ import annotations

import logging
from typing import Dict, List

import torch

from radixserve.model.forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)

DEFAULT_MAX_BS = 160


def batch_buckets(max_bs: int) -> List[int]:
    """Captured batch sizes, ascending: 1, 2, 4, 8, then steps of 8 up to 64, of 16 up to 128,
    of 32 beyond; the last bucket is max_bs itself."""
    sizes, b = [], 1
    while b < max_bs:
        sizes.append(b)
        b = b * 2 if b < 8 else b + (8 if b < 64 else 16 if b < 128 else 32)
    sizes.append(max_bs)
    return sizes


class CudaGraphRunner:
    def __init__(self, model: torch.nn.Module, kv_pool, vocab_size: int, context_len: int,
                 max_bs: int):
        if max_bs < 1:
            raise ValueError("max_bs must be >= 1")
        self.model = model
        self.kv_pool = kv_pool
        self.device = kv_pool.device
        self.context_len = context_len
        self.max_bs = max_bs
        self.buckets = batch_buckets(max_bs)
        dev = self.device
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.kv_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=dev)
        self.kv_indices = torch.zeros(max_bs * context_len, dtype=torch.int32, device=dev)
        self.logits: Dict[int, torch.Tensor] = {}      # bucket -> [bucket, vocab] float32
        self.graphs: Dict[int, torch.cuda.CUDAGraph] = {}
        self.vocab_size = vocab_size
        self._capture_all()

    # ------------------------------------------------------------------ capture
    def _batch(self, bs: int) -> ForwardBatch:
        """The ForwardBatch a bucket's graph runs: views of the static buffers."""
        return ForwardBatch(
            mode=ForwardMode.DECODE, batch_size=bs,
            input_ids=self.input_ids[:bs], positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            qo_indptr=self.kv_indptr[:bs + 1],      # unused by decode
            kv_indptr=self.kv_indptr[:bs + 1],
            kv_indices=self.kv_indices[:bs * self.context_len],
            seq_lens=self.kv_indptr[1:bs + 1],      # unused by decode
            logits_indices=self.positions[:bs],     # unused: every row gets logits
            kv_pool=self.kv_pool)

    @torch.inference_mode()
    def _run(self, fb: ForwardBatch) -> torch.Tensor:
        hidden = self.model(fb)                                    # [bs, hidden]
        return self.model.compute_logits(hidden).float()           # [bs, vocab]

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        # all rows empty during capture: padding inputs, no KV (the attention reads nothing)
        for bs in reversed(self.buckets):          # largest first: later ones reuse its pool
            fb = self._batch(bs)
            with torch.cuda.stream(stream):
                for _ in range(2):                 # warm-up outside the graph (lazy init)
                    self._run(fb)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.logits[bs] = self._run(fb)
            self.graphs[bs] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        logger.info("CUDA graphs captured for decode batch sizes %s", self.buckets)

    # ------------------------------------------------------------------ replay
    def bucket_for(self, bs: int) -> int:
        for b in self.buckets:
            if b >= bs:
                return b
        raise ValueError(f"batch {bs} exceeds the largest captured batch {self.max_bs}")

    def can_run(self, fb: ForwardBatch) -> bool:
        """A decode batch whose every row gets logits, within the captured sizes."""
        return (fb.mode is ForwardMode.DECODE and 1 <= fb.batch_size <= self.max_bs
                and fb.logits_indices.numel() == fb.batch_size
                and fb.input_ids.numel() == fb.batch_size)

    @torch.inference_mode()
    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits [bs, vocab] float32 of a decode batch (fb.logits_indices must select every
        row in order, as decode batches do); writes the batch's K/V like model(fb) would."""
        bs = fb.batch_size
        bucket = self.bucket_for(bs)
        nnz = fb.kv_indices.numel()
        if nnz > bucket * self.context_len:
            raise ValueError(f"decode batch holds {nnz} KV entries, more than the graph's "
                             f"{bucket} x {self.context_len}")
        self.input_ids[:bs].copy_(fb.input_ids, non_blocking=True)
        self.positions[:bs].copy_(fb.positions, non_blocking=True)
        self.out_cache_loc[:bs].copy_(fb.out_cache_loc, non_blocking=True)
        self.kv_indptr[:bs + 1].copy_(fb.kv_indptr, non_blocking=True)
        self.kv_indices[:nnz].copy_(fb.kv_indices, non_blocking=True)
        if bucket > bs:
            self.input_ids[bs:bucket].zero_()
            self.positions[bs:bucket].zero_()
            self.out_cache_loc[bs:bucket].zero_()          # the padding slot
            self.kv_indptr[bs + 1:bucket + 1].copy_(fb.kv_indptr[bs:bs + 1].expand(bucket - bs))
        self.graphs[bucket].replay()
        return self.logits[bucket][:bs]
