"""ModelRunner: owns the model, the KV pool and the ReqToTokenPool, and runs one step's forward.

Device and dtype come from ServerArgs.resolved_*(). KV pool size: --max-total-tokens if given,
else --mem-fraction-static of free memory (GPU: 0.85 of free device memory after the weights;
CPU: 0.10 of MemAvailable), capped at what max_running_requests * context_len could ever use.
forward_hidden / compute_logits / run_step are called from the engine's single forward worker
thread; they touch only the tensors of the step they are given and the KV buffers. On CUDA in
bf16/fp16, decode steps replay CUDA graphs (model/cuda_graph_runner.py) unless
--disable-cuda-graph.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from radixserve.cache.kv_pool import KVPool, ReqToTokenPool
from radixserve.config import ModelConfig, ServerArgs
from radixserve.engine.schedule_batch import StepInput, StepOutput
from radixserve.model.forward_batch import ForwardBatch
from radixserve.sampling import sampler

logger = logging.getLogger(__name__)

DEFAULT_MAX_RUNNING_REQUESTS = {"cpu": 64, "cuda": 256}
CPU_MEM_FRACTION = 0.10
GPU_MEM_FRACTION = 0.85


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


class ModelRunner:
    def __init__(self, server_args: ServerArgs, model_config: ModelConfig, model_path: str,
                 context_len: Optional[int] = None, model: Optional[torch.nn.Module] = None):
        """model: an already loaded model to reuse (several pools over one set of weights, as
        tests do); it must live on the resolved device in the resolved dtype."""
        from radixserve.model.loader import load_model

        self.server_args = server_args
        self.model_config = model_config
        self.device = torch.device(server_args.resolved_device())
        self.dtype = server_args.resolved_dtype()
        self.context_len = context_len or server_args.context_length or \
            model_config.max_position_embeddings
        if self.device.type == "cpu" and server_args.cpu_threads:
            torch.set_num_threads(server_args.cpu_threads)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if model is None:
            model = load_model(model_path, model_config, server_args.load_format, self.dtype,
                               self.device)
        self.model = model
        self.model.eval()
        self.max_running_requests = (server_args.max_running_requests
                                     or DEFAULT_MAX_RUNNING_REQUESTS.get(self.device.type, 64))
        self.max_total_tokens = self._kv_pool_tokens()
        self.kv_pool = KVPool(self.max_total_tokens, model_config.num_hidden_layers,
                              model_config.num_key_value_heads, model_config.head_dim,
                              self.dtype, self.device)
        self.req_to_token_pool = ReqToTokenPool(self.max_running_requests, self.context_len + 1,
                                                self.device)
        logger.info("KV pool: %d tokens, %.1f MB", self.max_total_tokens,
                    self.kv_pool.size_bytes / (1 << 20))
        self.graph_runner = None
        if self._cuda_graph_usable():
            from radixserve.model.cuda_graph_runner import DEFAULT_MAX_BS, CudaGraphRunner

            max_bs = min(self.max_running_requests,
                         server_args.cuda_graph_max_bs or DEFAULT_MAX_BS)
            self.graph_runner = CudaGraphRunner(self.model, self.kv_pool, model_config.vocab_size,
                                                self.context_len + 1, max_bs)

    def _cuda_graph_usable(self) -> bool:
        """Decode runs as CUDA graphs where every op on its path is a graph-safe kernel."""
        from radixserve.ops._ext import kernels_available

        if self.server_args.disable_cuda_graph or self.device.type != "cuda":
            return False
        if self.dtype not in (torch.bfloat16, torch.float16) or not kernels_available():
            logger.info("CUDA graphs off: they need radixserve._C and bf16/fp16 (dtype %s)",
                        self.dtype)
            return False
        return True

    def _kv_pool_tokens(self) -> int:
        sa, mc = self.server_args, self.model_config
        if sa.max_total_tokens is not None:
            if sa.max_total_tokens < 2:
                raise ValueError("--max-total-tokens must be at least 2")
            return sa.max_total_tokens
        per_token = KVPool.bytes_per_token(mc.num_hidden_layers, mc.num_key_value_heads,
                                           mc.head_dim, self.dtype)
        if self.device.type == "cuda":
            fraction = sa.mem_fraction_static or GPU_MEM_FRACTION
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * fraction)
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

    # ------------------------------------------------------------------ forward (worker thread)
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

    @torch.inference_mode()
    def run_step(self, step: StepInput) -> StepOutput:
        """Forward + sampling of one step; returns host-side values. Worker thread."""
        fb = step.forward_batch
        if fb.logits_indices.numel() == 0:
            self.model(fb)     # a chunk that only fills the KV cache
            return StepOutput(sampler.SampleResult([], [], []), [[] for _ in step.prompt_counts],
                              [None for _ in step.prompt_counts])
        n_prompt = step.num_prompt_rows
        if n_prompt == 0 and self.graph_runner is not None and self.graph_runner.can_run(fb):
            logits = self.graph_runner.replay(fb)                   # [batch, vocab] float32
            return StepOutput(sampler.sample(logits, step.sampling_info),
                              [[] for _ in step.prompt_counts],
                              [None for _ in step.prompt_counts])
        hidden = self.forward_hidden(fb)                            # [rows, hidden]
        logits = self.compute_logits(hidden[n_prompt:])             # [num_sampling_reqs, vocab]
        result = sampler.sample(logits, step.sampling_info)
        per_req_lp, per_req_top = [], []
        if n_prompt:
            values, tops = sampler.prompt_logprobs(self.compute_logits, hidden[:n_prompt],
                                                   step.prompt_targets, step.prompt_top_k)
            pos = 0
            for count in step.prompt_counts:
                per_req_lp.append(values[pos:pos + count])
                per_req_top.append(tops[pos:pos + count] if tops is not None else None)
                pos += count
        else:
            per_req_lp = [[] for _ in step.prompt_counts]
            per_req_top = [None for _ in step.prompt_counts]
        return StepOutput(result, per_req_lp, per_req_top)
