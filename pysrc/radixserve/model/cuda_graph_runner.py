"""CudaGraphRunner: the decode step captured as CUDA graphs, one per batch-size bucket.

A decode step of a small model is dozens of short kernels; launched one by one from Python the
GPU waits on the host between them. Captured once, a step is one graph launch.

What a graph holds, for `bucket` rows: the decode prologue (each row's new slot into the
runner's req_to_token, kv_indptr / kv_indices built from it, the input id read from the
runner's next_ids: model/forward_batch.decode_prologue) -> embedding -> every layer (rotary, store_kv,
paged decode attention, MLP) -> final norm -> logits (fp32). It reads only the static inputs
below and the runner's fixed tensors (req_to_token, next_ids, the KV pool) and writes those and
the static logits buffer.

Static inputs (allocated once for the largest bucket; a bucket's graph sees the first `bucket`):
    rows [max_bs] int64    seq_lens [max_bs] int32    out_cache_loc [max_bs] int64
    kv_indptr [max_bs + 1] int32, kv_indices [max_bs * context_len] int32 (bucket b's graph
    sees the first b * context_len; the decode kernel's grid is fixed at capture from that
    bound, and each request's split ranges follow its real length on the device)
replay() copies a batch of bs <= max_bs rows into them and pads rows bs..bucket-1 with the
runner's padding row: KV length 1 at the padding slot 0, so a padded row writes only slot 0
(whose contents nothing reads) and row `padding_row` of req_to_token, never a request's.

Context classes: buckets up to CLASS_BUCKET_MAX rows are captured once per capacity of
context_capacities() (CONTEXT_CLASSES below the context length, then the context length), each
graph seeing the first bucket x capacity entries of kv_indices, so its decode kernel's grid is
planned for that capacity; replay() takes the smallest capacity that holds the batch's longest
request. At batch 1 a grid planned for the whole context launches ~33 splits per kv head, of
which a 128-token request uses 2: the H200 sweep (bench/results/logs/decode-sweep-h200.txt,
c2m64) measured 273.6 us per 32 layers against 239.1 with the grid planned from the real length
(b8: 332.7 against 285.0). Larger buckets fill the device without splits, so one graph each.

Used only where every op on the decode path is a graph-safe kernel: a CUDA device, the
radixserve._C extension, bf16/fp16 (float32 attention runs the torch reference, which syncs),
no attention layer with soft-capping and a head_dim the attention kernels are built for (64,
128; otherwise the layers run the reference: runner.reference_attention), and not
--disable-cuda-graph. A sliding window is a launch argument of the decode kernel; a graph's
ForwardBatch carries its capacity as max_seq_len, so a window at least that long attends as a
full layer. The returned logits are a view of static memory, valid until the next replay (the
sampler never writes them).
"""
from __future__ import annotations

import gc
import logging
from typing import Dict, List, Optional, Tuple

import torch

from radixserve import knobs
from radixserve.model.forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)


CONTEXT_CLASSES = (256, 1024)
CLASS_BUCKET_MAX = 8


def context_capacities(bucket: int, context_len: int,
                       classes: Tuple[int, ...] = CONTEXT_CLASSES) -> List[int]:
    """KV capacities (tokens per request) captured for a bucket, ascending; the last is
    context_len."""
    if bucket > CLASS_BUCKET_MAX:
        return [context_len]
    return [c for c in classes if c < context_len] + [context_len]


def capacity_for(capacities: List[int], max_seq_len: Optional[int]) -> int:
    """The smallest capacity that holds max_seq_len tokens; the largest when it is unknown."""
    if max_seq_len is not None:
        for c in capacities:
            if max_seq_len <= c:
                return c
    return capacities[-1]


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
    def __init__(self, runner, max_bs: int):
        """runner: the ModelRunner (model, kv_pool, req_to_token, next_ids, padding_row,
        context_len, device)."""
        if max_bs < 1:
            raise ValueError("max_bs must be >= 1")
        self.runner = runner
        self.device = runner.device
        self.context_len = runner.context_len + 1
        self.max_bs = max_bs
        self.buckets = batch_buckets(max_bs)
        dev = self.device
        self.rows = torch.full((max_bs,), runner.padding_row, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self.out_cache_loc = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.kv_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=dev)
        self.kv_indices = torch.zeros(max_bs * self.context_len, dtype=torch.int32, device=dev)
        # (bucket, capacity) -> [bucket, vocab] float32 / its graph
        self.logits: Dict[Tuple[int, int], torch.Tensor] = {}
        self.graphs: Dict[Tuple[int, int], torch.cuda.CUDAGraph] = {}
        # RADIXSERVE_GRAPH_CONTEXT_CLASSES=0 (or --debug-graph-context-classes 0): one
        # full-context graph per bucket, for A/B runs (knobs.py)
        classes = CONTEXT_CLASSES if knobs.value("RADIXSERVE_GRAPH_CONTEXT_CLASSES") else ()
        self.capacities = {b: context_capacities(b, self.context_len, classes)
                           for b in self.buckets}
        self._capture_all()

    # ------------------------------------------------------------------ capture
    @torch.inference_mode()
    def _run(self, bs: int, capacity: int) -> torch.Tensor:
        from radixserve.model.forward_batch import decode_prologue

        r = self.runner
        kv_indices = self.kv_indices[:bs * capacity]     # the decode grid is planned from this
        input_ids, positions = decode_prologue(
            r.req_to_token, r.next_ids, self.rows[:bs], self.seq_lens[:bs],
            self.out_cache_loc[:bs], self.kv_indptr[:bs + 1], kv_indices)
        fb = ForwardBatch(ForwardMode.DECODE, bs, input_ids, positions, self.out_cache_loc[:bs],
                          self.kv_indptr[:bs + 1], self.kv_indptr[:bs + 1], kv_indices,
                          self.seq_lens[:bs], None, r.kv_pool, capacity)
        hidden = r.model(fb)                                       # [bs, hidden]
        return r.model.compute_logits(hidden).float()              # [bs, vocab]

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """Capture every bucket. The cyclic garbage collector is off meanwhile: a collection
        inside a capture could free a dead runner's pinned host buffers, whose CUDA events the
        host allocator then records or queries on other streams, which invalidates the capture
        (seen on the H200 when a test session had built many runners before)."""
        gc.collect()
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            self._capture_buckets()
        finally:
            if was_enabled:
                gc.enable()

    def _capture_buckets(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        # every row is the padding row during capture: KV length 1 at slot 0
        for bs in reversed(self.buckets):          # largest first: later ones reuse its pool
            for cap in reversed(self.capacities[bs]):
                with torch.cuda.stream(stream):
                    for _ in range(2):             # warm-up outside the graph (lazy init)
                        self._run(bs, cap)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.logits[(bs, cap)] = self._run(bs, cap)
                self.graphs[(bs, cap)] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        logger.info("CUDA graphs captured for decode batch sizes %s", self.buckets)

    # ------------------------------------------------------------------ replay
    def bucket_for(self, bs: int) -> int:
        for b in self.buckets:
            if b >= bs:
                return b
        raise ValueError(f"batch {bs} exceeds the largest captured batch {self.max_bs}")

    def can_run(self, bs: int) -> bool:
        return 1 <= bs <= self.max_bs

    @torch.inference_mode()
    def replay(self, bs: int, rows: torch.Tensor, seq_lens: torch.Tensor,
               out_cache_loc: torch.Tensor, max_seq_len: Optional[int] = None) -> torch.Tensor:
        """Logits [bs, vocab] float32 of a decode batch on the current stream: rows [bs] int64,
        seq_lens [bs] (KV length after the step, <= context_len), out_cache_loc [bs] int64;
        max_seq_len: the largest of seq_lens, known on the host (None: the bucket's full-context
        graph). Writes the batch's K/V, table entries and nothing of any other request."""
        key = self._stage(bs, rows, seq_lens, out_cache_loc, max_seq_len)
        self.graphs[key].replay()
        return self.logits[key][:bs]

    def _stage(self, bs: int, rows: torch.Tensor, seq_lens: torch.Tensor,
               out_cache_loc: torch.Tensor, max_seq_len: Optional[int]) -> Tuple[int, int]:
        """Copy the batch into the static inputs, pad rows bs..bucket-1 with the padding row;
        the (bucket, capacity) of the graph to replay."""
        bucket = self.bucket_for(bs)
        key = (bucket, capacity_for(self.capacities[bucket], max_seq_len))
        self.rows[:bs].copy_(rows)
        self.seq_lens[:bs].copy_(seq_lens)
        self.out_cache_loc[:bs].copy_(out_cache_loc)
        if bucket > bs:
            self.rows[bs:bucket].fill_(self.runner.padding_row)
            self.seq_lens[bs:bucket].fill_(1)
            self.out_cache_loc[bs:bucket].zero_()          # the padding slot
        return key


class TPCudaGraphRunner(CudaGraphRunner):
    """The decode graphs under tensor parallelism on CUDA (runner.model a TensorParallelModel
    over an NcclGroup): one graph per GPU for each (bucket, capacity), the all-reduces and the
    LM-head gather captured inside as NCCL collectives.

    Rank 0's graph runs the decode prologue on GPU 0 (the runner's req_to_token and next_ids,
    the static inputs above) and packs the step's inputs into two buffers, int64 [3 x bucket]
    (input_ids | positions | out_cache_loc) and int32 [2 x bucket + 1 + bucket x capacity]
    (seq_lens | kv_indptr | kv_indices); every rank's graph then broadcasts them from rank 0
    (NCCL, in place; rank r >= 1 receives into its own buffers on its GPU), runs its shard over
    its KV shard, and takes part in the LM-head gather; rank 0's graph ends with the full logits
    [bucket, vocab] fp32 in static memory. Cross-GPU order comes from the collectives alone.

    Capture: every rank captures at once on its own thread (RankWorkers), stream and memory
    pool, in thread-local capture mode, after two eager warm-ups. Replay, from the calling
    thread: the inputs copied on rank 0's current stream (the runner's compute stream), rank
    0's graph launched there, rank r's on its rank stream (NcclGroup.streams[r], the stream of
    its eager steps too, so a rank's steps stay in order however they run)."""

    def __init__(self, runner, max_bs: int):
        self.tp = runner.model
        self.rank_graphs: Dict[Tuple[int, int], List[torch.cuda.CUDAGraph]] = {}
        super().__init__(runner, max_bs)

    def _rank_step(self, r: int, bs: int, cap: int) -> Optional[torch.Tensor]:
        """Rank r's share of one decode step of bs rows planned for capacity cap; rank 0 gets
        the logits [bs, vocab] float32, the others None."""
        from radixserve.model.forward_batch import decode_prologue

        tp, run = self.tp, self.runner
        n32 = 2 * bs + 1 + bs * cap
        p64, p32 = self.packed64[r][:3 * bs], self.packed32[r][:n32]
        if r == 0:
            kv_indices = self.kv_indices[:bs * cap]
            input_ids, positions = decode_prologue(
                run.req_to_token, run.next_ids, self.rows[:bs], self.seq_lens[:bs],
                self.out_cache_loc[:bs], self.kv_indptr[:bs + 1], kv_indices)
            p64[:bs].copy_(input_ids)
            p64[bs:2 * bs].copy_(positions)
            p64[2 * bs:].copy_(self.out_cache_loc[:bs])
            p32[:bs].copy_(self.seq_lens[:bs])
            p32[bs:2 * bs + 1].copy_(self.kv_indptr[:bs + 1])
            p32[2 * bs + 1:].copy_(kv_indices)
        tp.group.broadcast(p64, r, root=0)
        tp.group.broadcast(p32, r, root=0)
        kv_indptr = p32[bs:2 * bs + 1]
        fb = ForwardBatch(ForwardMode.DECODE, bs, p64[:bs], p64[bs:2 * bs], p64[2 * bs:],
                          kv_indptr, kv_indptr, p32[2 * bs + 1:], p32[:bs], None,
                          run.kv_pool.shard(r), cap)
        shard = tp.shards[r]
        logits = shard.compute_logits(shard(fb))                   # rank 0: [bs, vocab]
        return None if logits is None else logits.float()

    def _capture_buckets(self) -> None:
        tp = self.tp
        biggest = max(max(caps) * b for b, caps in self.capacities.items())
        self.packed64, self.packed32, streams, pools = [], [], [], []
        for r, dev in enumerate(tp.devices):
            self.packed64.append(torch.zeros(3 * self.max_bs, dtype=torch.int64, device=dev))
            self.packed32.append(torch.zeros(2 * self.max_bs + 1 + biggest, dtype=torch.int32,
                                             device=dev))
            streams.append(torch.cuda.Stream(device=dev) if r == 0 else tp.group.streams[r])
            with torch.cuda.device(dev):
                pools.append(torch.cuda.graph_pool_handle())
        streams[0].wait_stream(torch.cuda.current_stream(self.device))
        for bs in reversed(self.buckets):          # largest first: later ones reuse its pool
            for cap in reversed(self.capacities[bs]):
                def capture(r: int, bs=bs, cap=cap):
                    with torch.cuda.stream(streams[r]):
                        for _ in range(2):         # warm-up outside the graph (lazy init)
                            self._rank_step(r, bs, cap)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pools[r], stream=streams[r],
                                          capture_error_mode="thread_local"):
                        out = self._rank_step(r, bs, cap)
                    return graph, out
                captured = tp.workers.run(capture)
                self.rank_graphs[(bs, cap)] = [g for g, _ in captured]
                self.logits[(bs, cap)] = captured[0][1]
        torch.cuda.current_stream(self.device).wait_stream(streams[0])
        for dev in tp.devices:
            torch.cuda.synchronize(dev)
        logger.info("CUDA graphs captured for decode batch sizes %s on %d GPUs (one graph per "
                    "GPU each, NCCL inside)", self.buckets, tp.tp_size)

    @torch.inference_mode()
    def replay(self, bs: int, rows: torch.Tensor, seq_lens: torch.Tensor,
               out_cache_loc: torch.Tensor, max_seq_len: Optional[int] = None) -> torch.Tensor:
        """As CudaGraphRunner.replay: logits [bs, vocab] float32 on GPU 0."""
        key = self._stage(bs, rows, seq_lens, out_cache_loc, max_seq_len)
        graphs = self.rank_graphs[key]
        graphs[0].replay()                                  # rank 0: the caller's stream
        for r in range(1, len(graphs)):
            with torch.cuda.device(self.tp.devices[r]), torch.cuda.stream(self.tp.group.streams[r]):
                graphs[r].replay()
        return self.logits[key][:bs]
