"""ModelRunner: owns the model, the KV pool, the device-side batch tables, and runs steps.

Device and dtype come from ServerArgs.resolved_*(). KV pool size: --max-total-tokens if given,
else --mem-fraction-static of free memory (GPU: 0.85 of free device memory after the weights;
CPU: 0.10 of MemAvailable), capped at what max_running_requests * context_len could ever use.

Device-side state, written only by steps, in step order (the "device" is the GPU's compute
stream, or on the CPU the one thread that runs steps):
  req_to_token [num_rows + 1 + spare, context_len + 1] int32: each ReqToToken row's KV slots.
               The scheduler keeps the host mirror (cache/kv_pool.ReqToTokenPool); each step
               sends the writes it adds. Row num_rows is the padding row of CUDA-graph batches;
               the spare rows after it (--speculative-algorithm only) hold a verify step's
               draft positions (StepInput).
  next_ids     [num_rows + 1 + spare] int64: the id each row sampled last, the input of its
               next decode step (a decode step reads it on the device, so it never waits for
               the host).
  penalties    PenaltyState: per-row token counts (sampling/penalties.py).
launch(step) enqueues a whole step (inputs up, forward, sampling, ids into next_ids, results
down into pinned memory behind an event) and returns a PendingStep at once on CUDA; wait() is
the one blocking point. On the CPU, launch computes the step and wait() returns its values.

Tensor parallelism (--tp-size N > 1; N CPU rank threads, or N GPUs with NCCL): self.model is a
model/tensor_parallel.TensorParallelModel, N shards whose forwards run at once on N rank
threads, and self.kv_pool its ShardedKVPool (one slot allocator, each rank's KV heads in its
own buffers). Everything above stays single, on rank 0's device: the step inputs, the tables,
the sampler, which gets the LM-head shards gathered on rank 0.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import List, Optional

import torch

from radixserve import knobs, ops
from radixserve.cache.kv_pool import KVPool
from radixserve.config import ModelConfig, ServerArgs
from radixserve.model.forward_batch import ForwardBatch, ForwardMode, decode_prologue
from radixserve.model.staging import Packer, Upload
from radixserve.model.step_io import SampleResult, StepInput, StepOutput
from radixserve.ops.kernel_status import log_kernel_status
from radixserve.sampling import sampler
from radixserve.sampling.batch import SamplingTensors
from radixserve.sampling.penalties import PenaltyState

logger = logging.getLogger(__name__)

DEFAULT_MAX_RUNNING_REQUESTS = {"cpu": 64, "cuda": 256}
CPU_MEM_FRACTION = 0.10
GPU_MEM_FRACTION = 0.85
FIXED_STEP_RESERVE = 1 << 30   # cuBLAS(Lt) workspaces, CUDA graph pools, allocator slack


def step_reserve_bytes(mc: ModelConfig, step_tokens: int, max_running: int) -> int:
    """Device memory a step needs beyond the weights and the KV pool, at its peak (an upper
    estimate): a prefill step of step_tokens tokens through the MLP (the residual, the normed
    input and the layer output in 16 bits, gate|up's output and the activation, their FP8
    copies under W8A8) or through attention (q|k|v), whichever is larger; plus the fp32 logits
    of max_running decode rows three times over (logits, probabilities, the sampler's scratch);
    plus FIXED_STEP_RESERVE. The KV pool leaves at least this much free (_kv_pool_tokens): with
    a 70B model on an 80 GB GPU, 15% of what the weights leave is ~1.6 GB, and prefill steps ran
    out of memory (bench/results/h100-2026-12-07.md)."""
    h, i = mc.hidden_size, mc.intermediate_size
    qkv = (mc.num_attention_heads + 2 * mc.num_key_value_heads) * mc.head_dim
    per_token = 2 * (3 * h + max(3 * i, qkv)) + (h + i)
    logits = 3 * 4 * max_running * mc.vocab_size
    return step_tokens * per_token + logits + FIXED_STEP_RESERVE


def reference_attention(model: torch.nn.Module, head_dim: Optional[int] = None) -> Optional[str]:
    """Why some attention layer of model runs the torch reference (ops.attention_kernel_takes),
    or None when every layer takes the kernels. Layers say what they need through
    attention_options() -> (window, softcap); the kernels take any window, so a soft-cap (Gemma
    2) or a head_dim they are not built for (head_dim: the model's, None: not asked) answers."""
    if head_dim is not None and not ops.attention_kernel_takes(None, None, head_dim):
        return f"head_dim {head_dim}"
    for module in model.modules():
        options = getattr(module, "attention_options", None)
        if options is None:
            continue
        window, softcap = options()
        if not ops.attention_kernel_takes(window, softcap):
            return "attention soft-capping"
    return None


def _cpu_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (bytes); falls back to 4 GiB where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


class PendingStep:
    """A launched step. wait() blocks until its results are on the host (once)."""

    def __init__(self, step: StepInput, host: dict, events=None, uploads=(), device_time=0.0,
                 prompt=None):
        self.step = step
        self._host = host                  # name -> host tensor (pinned on CUDA)
        self._events = events              # (start, end) CUDA events, or None on the CPU
        self._uploads = uploads            # keep the staging buffers alive until done
        self._device_time = device_time
        self._prompt = prompt              # (per-request logprobs, tops), computed at launch
        self.prev_end = None               # the previous step's end event (idle_before)
        self.masked = None                 # (logits, ...) while it waits for its grammar mask
        self.pooled = None                 # {"pooled", "labels"} host tensors (pooling spans)

    @property
    def needs_mask(self) -> bool:
        """Launched up to its logits; sample_masked() must finish it."""
        return self.masked is not None

    def ready(self) -> bool:
        """wait() would not block (the CPU computed the step at launch)."""
        return self._events is None

    def wait(self) -> StepOutput:
        device_time, idle = self._device_time, 0.0
        if self._events is not None:
            start, end = self._events
            end.synchronize()
            device_time = start.elapsed_time(end) / 1e3
            if self.prev_end is not None:     # recorded earlier on the same stream: complete
                idle = max(self.prev_end.elapsed_time(start) / 1e3, 0.0)
            self.prev_end = None
        self._uploads = ()
        h = self._host
        inputs = self.step.sampling
        ids = h["ids"].tolist() if "ids" in h else []
        logprobs = h["logprobs"].tolist() if "logprobs" in h else []
        top_v = h["top_values"].tolist() if "top_values" in h else None
        top_i = h["top_ids"].tolist() if "top_ids" in h else None
        lp, tops, finite = sampler.host_result(inputs, ids, logprobs, top_v, top_i)
        per_lp, per_top = self._prompt or ([[] for _ in range(self.step.batch_size)],
                                           [None] * self.step.batch_size)
        pooled, pool_logits = None, []
        if self.pooled is not None:
            pooled = self.pooled["pooled"]
            flat = self.pooled["labels"].tolist()
            pos = 0
            for labels in self.step.pool_labels:
                pool_logits.append(flat[pos:pos + len(labels)])
                pos += len(labels)
            self.pooled = None
        return StepOutput(SampleResult(ids, lp, tops, finite), per_lp, per_top, device_time, idle,
                          pooled, pool_logits)


class ModelRunner:
    def __init__(self, server_args: ServerArgs, model_config: ModelConfig, model_path: str,
                 context_len: Optional[int] = None, model: Optional[torch.nn.Module] = None):
        """model: an already loaded model to reuse (several pools over one set of weights, as
        tests do); it must live on the resolved device in the resolved dtype."""
        from radixserve.model.loader import load_model

        self.server_args = server_args
        self.model_config = model_config
        # the hidden --debug-* flags beat their environment variables (knobs.py) from here on:
        # the kernels' choices reach the ops through knobs.value(), the graphs' classes below,
        # the GC threshold when the engine starts. A runner without them clears earlier ones.
        knobs.set_flags(server_args.knob_overrides())
        self.device = torch.device(server_args.resolved_device())
        self.dtype = server_args.resolved_dtype()
        self.kv_dtype = server_args.resolved_kv_cache_dtype()   # the model's, or FP8
        self.context_len = context_len or server_args.context_length or model_config.max_context
        if self.device.type == "cpu" and server_args.cpu_threads:
            torch.set_num_threads(server_args.cpu_threads)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        # one line: whether radixserve._C's kernels run here, and if not why (WARNING on a GPU)
        self.kernel_status = log_kernel_status(self.device, logger)
        # tensor parallelism (--tp-size N > 1): a TensorParallelModel of N shards, run as one
        # model (model/tensor_parallel.py); the rest of the runner is tp_size 1's
        self.tp_size = server_args.tp_size
        if model is None and self.tp_size > 1:
            from radixserve.model.tensor_parallel import load_tp_model

            model = load_tp_model(model_path, model_config, server_args.load_format, self.dtype,
                                  self.device, self.tp_size, server_args.quantization,
                                  lm_head_optional=server_args.is_embedding)
        elif model is None:
            model = load_model(model_path, model_config, server_args.load_format, self.dtype,
                               self.device, server_args.quantization,
                               lm_head_optional=server_args.is_embedding)
        if getattr(model, "tp_size", 1) != self.tp_size:
            raise ValueError(f"--tp-size {self.tp_size}, but the model given is split "
                             f"{getattr(model, 'tp_size', 1)} ways")
        self.model = model
        self.model.eval()
        if self.kv_dtype != self.dtype:
            from radixserve.model.llama import set_kv_cache_scales

            for shard in getattr(self.model, "shards", None) or [self.model]:
                scaled = set_kv_cache_scales(shard)
            logger.info("KV cache in %s: k/v scales from the checkpoint for %d of %d layers "
                        "(1.0 elsewhere)", server_args.kv_cache_dtype, scaled,
                        model_config.num_hidden_layers)
        # the batch-1 decode floor, measured here before the KV pool takes the free memory
        # (weight_floor.py; None on the CPU)
        self.weight_floor_s: Optional[float] = None
        self.streamed_weight_bytes = 0         # the floor's numerator (CUDA only, as the floor)
        if self.device.type == "cuda":
            from radixserve.model.weight_floor import streamed_weight_bytes, weight_floor_seconds
            self.weight_floor_s = weight_floor_seconds(self.model, self.device)
            self.streamed_weight_bytes = streamed_weight_bytes(self.model)
            logger.info("batch-1 decode floor (weights over copy bandwidth): %.3f ms",
                        self.weight_floor_s * 1e3)
        self.max_running_requests = (server_args.max_running_requests
                                     or DEFAULT_MAX_RUNNING_REQUESTS.get(self.device.type, 64))
        self.max_total_tokens = self._kv_pool_tokens()
        if hasattr(self.model, "make_kv_pool"):   # TP: one slot allocator, KV heads sharded
            self.kv_pool = self.model.make_kv_pool(self.max_total_tokens, self.kv_dtype)
        else:
            self.kv_pool = KVPool(self.max_total_tokens, model_config.num_hidden_layers,
                                  model_config.num_key_value_heads, model_config.head_dim,
                                  self.kv_dtype, self.device)
        self.num_rows = self.max_running_requests
        self.padding_row = self.num_rows
        # --speculative-algorithm: spare rows past the padding row, one per draft position of
        # a verify step (StepInput: a draft token is a decode row of its own there)
        self.spec_row_base = self.num_rows + 1
        table_rows = self.spec_row_base + server_args.spec_draft_rows()
        dev = self.device
        # [table_rows, context_len + 1] int32 and [table_rows] int64 (see the module doc)
        self.req_to_token = torch.zeros((table_rows, self.context_len + 1),
                                        dtype=torch.int32, device=dev)
        self.next_ids = torch.zeros(table_rows, dtype=torch.int64, device=dev)
        # [num_rows + 1] int64: each request row's accepted draft count in its last verify
        # step (StepInput: a step scheduled over that one checks it)
        self.spec_accepted = torch.zeros(self.num_rows + 1, dtype=torch.int64, device=dev)
        self.penalties = PenaltyState(self.num_rows + 1, model_config.vocab_size, dev)
        self.compute_stream = self.copy_stream = None
        self._last_end = None      # the end event of the last step launched (idle_before)
        if dev.type == "cuda":
            self.compute_stream = torch.cuda.Stream(device=dev)
            self.copy_stream = torch.cuda.Stream(device=dev)
        logger.info("KV pool: %d tokens, %.1f MB, %s%s", self.max_total_tokens,
                    self.kv_pool.size_bytes / (1 << 20), str(self.kv_dtype).replace("torch.", ""),
                    "" if not hasattr(self.kv_pool, "shards") else f", sharded by KV heads over "
                    f"{len(self.kv_pool.shards)} ranks ({self.kv_pool.num_kv_heads} a rank)")
        self.graph_runner = None
        if self._cuda_graph_usable():
            from radixserve.model.cuda_graph_runner import CudaGraphRunner, TPCudaGraphRunner

            max_bs = min(self.max_running_requests,
                         server_args.cuda_graph_max_bs or self.max_running_requests)
            graphs = TPCudaGraphRunner if hasattr(self.model, "shards") else CudaGraphRunner
            self.graph_runner = graphs(self, max_bs)
            if max_bs < self.max_running_requests:
                logger.info("decode batches above %d (--cuda-graph-max-bs) run eagerly", max_bs)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)   # weights and tables are ready before any step stream

    def _cuda_graph_usable(self) -> bool:
        """Decode runs as CUDA graphs where every op on its path is a graph-safe kernel."""
        from radixserve.ops._ext import kernels_available

        if self.server_args.disable_cuda_graph or self.device.type != "cuda":
            return False
        if self.server_args.is_embedding:     # pooling requests are never decoded
            return False
        group = getattr(self.model, "group", None)
        if group is not None and group.backend != "nccl":
            return False
        if self.dtype not in (torch.bfloat16, torch.float16) or not kernels_available():
            logger.info("CUDA graphs off: they need radixserve._C and bf16/fp16 (dtype %s)",
                        self.dtype)
            return False
        why = reference_attention(self.model, self.model_config.head_dim)
        if why:
            logger.warning("CUDA graphs off: %s, which the attention kernels do not take yet "
                           "(the torch reference runs them, and it is not capturable)", why)
            return False
        return True

    def _kv_pool_tokens(self) -> int:
        sa, mc = self.server_args, self.model_config
        if sa.max_total_tokens is not None:
            if sa.max_total_tokens < 2:
                raise ValueError("--max-total-tokens must be at least 2")
            return sa.max_total_tokens
        kv_heads = mc.num_key_value_heads if not hasattr(self.model, "shards") else \
            self.model.kv_heads_per_token(one_memory=self.device.type == "cpu")
        per_token = KVPool.bytes_per_token(mc.num_hidden_layers, kv_heads,
                                           mc.head_dim, self.kv_dtype)   # 1 byte a value: FP8
        if self.device.type == "cuda":
            fraction = sa.mem_fraction_static or GPU_MEM_FRACTION
            # with TP every rank holds its KV heads of every token: the tightest GPU decides
            devices = getattr(self.model, "devices", None) or [self.device]
            free = min(torch.cuda.mem_get_info(d)[0] for d in devices)
            budget = int(free * fraction)
            if sa.mem_fraction_static is None:   # the default leaves room for a step's peak
                step_tokens = max(sa.max_prefill_tokens, sa.resolved_chunked_prefill_size() or 0)
                reserve = step_reserve_bytes(mc, step_tokens, self.max_running_requests)
                if free - budget < reserve:
                    budget = max(0, free - reserve)
                    logger.info("KV pool: %.1f GB of %.1f GB free left for steps (their peak "
                                "at %d prefill tokens)", reserve / 1e9, free / 1e9, step_tokens)
        else:
            fraction = sa.mem_fraction_static or CPU_MEM_FRACTION
            budget = int(_cpu_available_bytes() * fraction)
        tokens = budget // per_token
        cap = self.max_running_requests * self.context_len
        tokens = min(tokens, cap)
        if tokens < 2:
            raise ValueError(f"not enough memory for the KV pool ({budget} bytes); raise "
                             "--mem-fraction-static or give --max-total-tokens")
        return tokens

    # ------------------------------------------------------------------ forward pieces
    @torch.inference_mode()
    def forward_hidden(self, fb: ForwardBatch) -> torch.Tensor:
        """Hidden states of the rows fb.logits_indices selects: [num_logit_rows, hidden]."""
        hidden = self.model(fb)                                     # [num_tokens, hidden]
        return hidden.index_select(0, fb.logits_indices)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] float32."""
        return self.model.compute_logits(hidden).float()

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits of the rows fb.logits_indices selects: [num_logit_rows, vocab] float32."""
        return self.compute_logits(self.forward_hidden(fb))

    # ------------------------------------------------------------------ steps
    def _stream(self):
        if self.compute_stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.compute_stream)

    @torch.inference_mode()
    def launch(self, step: StepInput) -> PendingStep:
        """Enqueue one step; returns without waiting for the device (CUDA). Thread: the one
        that runs steps (the engine's forward worker). Raises for inputs the model rejects;
        the device state then holds at most this step's partial KV and table writes.
        A step with grammar rows stops after its logits (pending.needs_mask): the owner fills
        the token bitmask meanwhile and calls sample_masked(pending, bitmask) to finish it."""
        t0 = time.perf_counter()
        events = None
        with self._stream():
            if self.device.type == "cuda":
                events = (torch.cuda.Event(enable_timing=True),
                          torch.cuda.Event(enable_timing=True))
                events[0].record()
            ints, floats = self._upload(step)
            if step.table_slots is not None:
                self.req_to_token.index_put_((ints["table_rows"], ints["table_cols"]),
                                             ints["table_slots"].to(torch.int32))
            if step.spec_counts:    # a verify step's spare rows: the request's table, a draft
                spare = torch.arange(self.spec_row_base, self.spec_row_base
                                     + len(step.spec_src), device=self.device)       # [R]
                self.req_to_token.index_copy_(
                    0, spare, self.req_to_token.index_select(0, ints["spec_src"]))
                self.next_ids.index_copy_(0, spare, ints["spec_tokens"])
            prompt = None
            if step.mode is ForwardMode.DECODE:
                logits = self._decode_logits(step, ints)            # [B, vocab] float32
                pool_rows = ints["rows"]
            else:
                logits, prompt, pooled = self._extend_logits(step, ints)   # [S, vocab] float32
                pool_rows = ints["sample_rows"]
            pending = PendingStep(step, {}, events, (ints, floats), 0.0, prompt)
            pending.prev_end = self._last_end
            if step.pool_counts:                  # before the end event, on the same stream
                pending.pooled = self._to_host(pooled)
            if step.sampling.grammar_rows and logits is not None:
                pending.masked = (logits, pool_rows, ints, floats)
            else:
                pending._host = self._sample(step, logits, pool_rows, ints, floats)
                if events is not None:
                    events[1].record()
                    self._last_end = events[1]
        if events is None:             # CPU: the step's compute time (CUDA: from the events)
            pending._device_time = time.perf_counter() - t0
        return pending

    @torch.inference_mode()
    def sample_masked(self, pending: PendingStep, bitmask: torch.Tensor) -> PendingStep:
        """Finish a step launched with grammar rows: bitmask [S, ceil(vocab / 32)] int32 on the
        host (pinned on CUDA), one row per sampling row. Same thread as launch."""
        logits, pool_rows, ints, floats = pending.masked
        pending.masked = None
        t1 = time.perf_counter()
        with self._stream():
            mask = bitmask.to(self.device, non_blocking=True)
            pending._host = self._sample(pending.step, logits, pool_rows, ints, floats, mask)
            pending._uploads = (ints, floats, bitmask)
            if pending._events is not None:
                pending._events[1].record()
                self._last_end = pending._events[1]
        if pending._events is None:    # CPU: the forward's time plus the sampling's
            pending._device_time += time.perf_counter() - t1
        return pending

    def _upload(self, step: StepInput):
        """Pack the step's ints and floats into one host buffer each (the sampling fields as
        sampling/batch.py packs them) and send them up."""
        ints, floats = Packer(torch.int64), Packer(torch.float32)
        ints.add("rows", step.req_pool_indices)
        ints.add("seq_lens", step.seq_lens)
        ints.add("out_cache_loc", step.out_cache_loc)
        has_table = step.table_slots is not None
        ints.add("table_rows", step.table_rows if has_table else [])
        ints.add("table_cols", step.table_cols if has_table else [])
        ints.add("table_slots", step.table_slots if has_table else [])
        if step.mode is not ForwardMode.DECODE:
            qo = [0]
            for n in step.extend_lens:
                qo.append(qo[-1] + n)
            ints.add("input_ids", step.input_ids)
            ints.add("positions", step.positions)
            ints.add("qo_indptr", qo)
            ints.add("resolve_pos", step.resolve_pos)
            ints.add("resolve_rows", step.resolve_rows)
            ints.add("logits_indices", step.logits_indices)
            ints.add("sample_rows", step.sample_rows)
            ints.add("prompt_targets", step.prompt_targets)
            if step.pool_counts:         # pooling spans (engine/pooling.py)
                ints.add("pool_starts", step.pool_starts)
                ints.add("pool_counts", step.pool_counts)
                labelled = [p for p, labels in enumerate(step.pool_labels) if labels]
                ints.add("pool_labelled", labelled)
                ints.add("pool_label_pos", [q for q, p in enumerate(labelled)
                                            for _ in step.pool_labels[p]])
                ints.add("pool_label_ids", [t for labels in step.pool_labels for t in labels])
        if step.spec_counts:             # speculative verify steps only (DECODE)
            ints.add("spec_tokens", step.spec_tokens)
            ints.add("spec_src", step.spec_src)
            ints.add("spec_counts", step.spec_counts)
            ints.add("spec_sample", step.spec_sample)
        if step.spec_cond_rows:          # scheduled over a verify step in flight
            ints.add("spec_cond_rows", step.spec_cond_rows)
            ints.add("spec_cond_expect", step.spec_cond_expect)
        step.sampling.pack(ints, floats)
        return (ints.upload(self.device, self.copy_stream),
                floats.upload(self.device, self.copy_stream))

    def _decode_logits(self, step: StepInput, ints: Upload) -> torch.Tensor:
        bs = step.batch_size
        if self.graph_runner is not None and self.graph_runner.can_run(bs):
            return self.graph_runner.replay(bs, ints["rows"], ints["seq_lens"],
                                            ints["out_cache_loc"], max(step.seq_lens))
        nnz = sum(step.seq_lens)
        kv_indptr = torch.empty(bs + 1, dtype=torch.int32, device=self.device)   # [B + 1]
        kv_indices = torch.empty(max(nnz, 1), dtype=torch.int32, device=self.device)  # [nnz]
        input_ids, positions = decode_prologue(
            self.req_to_token, self.next_ids, ints["rows"], ints["seq_lens"].to(torch.int32),
            ints["out_cache_loc"], kv_indptr, kv_indices)
        fb = ForwardBatch(ForwardMode.DECODE, bs, input_ids, positions, ints["out_cache_loc"],
                          kv_indptr, kv_indptr, kv_indices, ints["seq_lens"], None, self.kv_pool,
                          max(step.seq_lens))
        return self.compute_logits(self.model(fb))

    def _extend_logits(self, step: StepInput, ints: Upload):
        """Forward of an extend (or mixed) step: logits of the sampling rows (a verify row's
        k + 1 among them), the prompt logprobs (read back to the host here: prompt
        logprobs come only with extend steps), and the pooling spans' results (_pool)."""
        bs = step.batch_size
        input_ids = ints["input_ids"]
        if step.resolve_pos:
            input_ids = input_ids.clone()
            input_ids.index_copy_(0, ints["resolve_pos"],
                                  self.next_ids.index_select(0, ints["resolve_rows"]))
        nnz = sum(step.seq_lens)
        kv_indptr = torch.empty(bs + 1, dtype=torch.int32, device=self.device)       # [B + 1]
        kv_indices = torch.empty(max(nnz, 1), dtype=torch.int32, device=self.device)  # [nnz]
        ops.build_kv_indices(self.req_to_token, ints["rows"], ints["seq_lens"], kv_indptr,
                             kv_indices)
        fb = ForwardBatch(step.mode, bs, input_ids, ints["positions"], ints["out_cache_loc"],
                          ints["qo_indptr"].to(torch.int32), kv_indptr, kv_indices,
                          ints["seq_lens"].to(torch.int32), ints["logits_indices"], self.kv_pool,
                          max(step.seq_lens, default=0))
        if not step.logits_indices and not step.pool_counts:
            self.model(fb)     # a chunk that only fills the KV cache
            return None, None, None
        hidden_all = self.model(fb)                                  # [T, hidden]
        pooled = self._pool(step, ints, hidden_all) if step.pool_counts else None
        if not step.logits_indices:
            return None, None, pooled
        hidden = hidden_all.index_select(0, fb.logits_indices)      # [rows, hidden]
        n_prompt = step.num_prompt_rows
        logits = self.compute_logits(hidden[n_prompt:]) if step.sample_rows else None
        prompt = None
        if n_prompt:
            prompt = self._prompt_logprobs(step, hidden[:n_prompt], ints["prompt_targets"])
        return logits, prompt, pooled

    def _pool(self, step: StepInput, ints: Upload, hidden: torch.Tensor) -> dict:
        """The pooling spans of an extend step (StepInput: pool_starts / pool_counts /
        pool_labels) over its final-norm hidden states [T, hidden]: {"pooled": [P, hidden]
        float32, each span's sum over its rows; "labels": [L] float32, the label tokens'
        logits at each labelled span's last row, spans in order}. On the device."""
        starts, counts = ints["pool_starts"], ints["pool_counts"]           # [P], [P]
        p, n = len(step.pool_counts), sum(step.pool_counts)
        seg = torch.repeat_interleave(torch.arange(p, device=hidden.device), counts,
                                      output_size=n)                          # [N] span
        first = torch.cumsum(counts, 0) - counts                              # [P]
        rows = starts.index_select(0, seg) + torch.arange(n, device=hidden.device) \
            - first.index_select(0, seg)                                      # [N] token row
        pooled = torch.zeros(p, hidden.shape[1], dtype=torch.float32, device=hidden.device)
        pooled.index_add_(0, seg, hidden.index_select(0, rows).float())
        labels = torch.empty(0, dtype=torch.float32, device=hidden.device)
        if any(step.pool_labels):
            last = (starts + counts - 1).index_select(0, ints["pool_labelled"])   # [Q] token row
            logits = self.compute_logits(hidden.index_select(0, last))            # [Q, vocab]
            labels = logits[ints["pool_label_pos"], ints["pool_label_ids"]]      # [L]
        return {"pooled": pooled, "labels": labels}

    def _to_host(self, device: dict) -> dict:
        """Start copies of device tensors to pinned host memory (the step's stream, before its
        end event); on the CPU the tensors themselves."""
        if self.device.type != "cuda":
            return device
        host = {}
        for name, t in device.items():
            h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            h.copy_(t, non_blocking=True)
            host[name] = h
        return host

    def _verify_next(self, step: StepInput, ids: torch.Tensor, pool_rows: torch.Tensor,
                     ints: Upload) -> None:
        """After a verify step sampled (ids [S], pool_rows [S]): each verify row's next_ids
        becomes its true next token (StepInput's contract), on the device: the sample at the
        first draft position whose sample differs from the draft token, else the bonus sample.
        ResultProcessor._apply_verify accepts the same tokens on the host."""
        counts = ints["spec_counts"]                                         # [V]
        first_rows = ints["spec_sample"]                                     # [V]
        tokens = ints["spec_tokens"]                                         # [R]
        r, v = len(step.spec_tokens), len(step.spec_counts)
        seg = torch.repeat_interleave(torch.arange(v, device=ids.device), counts,
                                      output_size=r)                         # [R] verify row
        starts = torch.cumsum(counts, 0) - counts                            # [V]
        local = torch.arange(r, device=ids.device) - starts.index_select(0, seg)   # [R]
        sampled = ids.index_select(0, first_rows.index_select(0, seg) + local)     # [R]
        miss = torch.where(sampled != tokens, local, counts.index_select(0, seg))
        accepted = counts.clone().scatter_reduce_(0, seg, miss, reduce="amin")      # [V]
        tok = ids.index_select(0, first_rows + accepted)                     # [V]
        own_rows = pool_rows.index_select(0, first_rows)                     # [V]
        self.next_ids.index_copy_(0, own_rows, tok)
        self.spec_accepted.index_copy_(0, own_rows, accepted)

    def _prompt_logprobs(self, step: StepInput, hidden: torch.Tensor, targets: torch.Tensor):
        values, tops = sampler.prompt_logprobs(self.compute_logits, hidden, targets,
                                               step.prompt_top_k)
        per_lp: List[List[float]] = []
        per_top: List[Optional[list]] = []
        pos = 0
        for count in step.prompt_counts:
            per_lp.append(values[pos:pos + count])
            per_top.append(tops[pos:pos + count] if tops is not None else None)
            pos += count
        return per_lp, per_top

    def _sample(self, step: StepInput, logits: Optional[torch.Tensor], pool_rows: torch.Tensor,
                ints: Upload, floats: Upload, bitmask: Optional[torch.Tensor] = None) -> dict:
        """Sample, keep the ids on the device as the rows' next inputs, start the copies down."""
        if logits is None or not step.sample_rows:
            return {}
        sp = step.sampling
        self.penalties.init_rows(sp.penalty_init)
        st = SamplingTensors.from_upload(ints, floats)
        penalty_rows = pool_rows
        if step.spec_counts:        # spare rows have no penalty state: the padding row's
            penalty_rows = pool_rows.clamp(max=self.padding_row)    # (no penalty row drafts)
        kept = None
        if step.spec_cond_rows:     # over a verify in flight: read before this step's writes
            cond_rows = ints["spec_cond_rows"]                                   # [C]
            ok = self.spec_accepted.index_select(0, cond_rows) == ints["spec_cond_expect"]
            kept = (cond_rows, ok, self.next_ids.index_select(0, cond_rows))
        out = sampler.sample(logits, sp, st, penalty_rows, self.penalties, bitmask)
        self.next_ids.index_copy_(0, pool_rows, out.ids)
        if step.spec_counts:        # a verify row's pool row repeats: its true next token
            self._verify_next(step, out.ids, pool_rows, ints)
        if kept is not None:        # a request whose assumption failed keeps its true token
            cond_rows, ok, before = kept
            self.next_ids.index_copy_(0, cond_rows, torch.where(
                ok, self.next_ids.index_select(0, cond_rows), before))
        device = {"ids": out.ids, "logprobs": out.logprobs.float()}
        if out.top_values is not None:
            device["top_values"], device["top_ids"] = out.top_values, out.top_ids
        return self._to_host(device)

    def run_step(self, step: StepInput, bitmask: Optional[torch.Tensor] = None) -> StepOutput:
        """launch (+ sample_masked with bitmask for grammar steps) + wait, synchronously."""
        pending = self.launch(step)
        if pending.needs_mask:
            pending = self.sample_masked(pending, bitmask)
        return pending.wait()
