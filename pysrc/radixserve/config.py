"""Configuration: ServerArgs (every flag of `radixserve serve`) and ModelConfig (from config.json).

Configuration flows from ServerArgs; nothing reads flags or environment variables elsewhere
(except RADIXSERVE_DISABLE_KERNELS in ops/_ext.py, a debugging switch).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import List, Optional

import torch


@dataclass
class ServerArgs:
    # model
    model_path: Optional[str] = None          # None: the embedded default (SmolLM2-135M-Instruct)
    tokenizer_path: Optional[str] = None      # default: model_path
    served_model_name: Optional[str] = None   # default: the model directory's name
    load_format: str = "auto"                 # auto | safetensors | dummy
    dtype: str = "auto"                       # auto (float32 on CPU, bfloat16 on GPU) | float32 | bfloat16 | float16
    device: str = "auto"                      # auto | cpu | cuda
    context_length: Optional[int] = None      # default: max_position_embeddings of the model
    trust_remote_code: bool = False
    # server
    host: str = "127.0.0.1"
    port: int = 30000
    log_level: str = "info"
    # memory and scheduling
    mem_fraction_static: Optional[float] = None  # default: 0.85 on GPU, 0.10 of free RAM on CPU
    max_total_tokens: Optional[int] = None
    max_running_requests: Optional[int] = None
    max_prefill_tokens: int = 16384
    chunked_prefill_size: Optional[int] = None   # default: 8192 on GPU, 512 on CPU; -1 disables
    schedule_policy: str = "fcfs"                # fcfs | lpm
    schedule_conservativeness: float = 1.0
    disable_radix_cache: bool = False
    page_size: int = 1
    # parallelism
    tp_size: int = 1
    # runtime
    random_seed: int = 0
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: Optional[int] = None       # largest decode batch run as a CUDA graph (default: the running limit)
    disable_overlap_schedule: bool = False        # serial loop: each step waits for the previous step's tokens
    max_queued_requests: int = 4096               # waiting sequences beyond this get 503 + Retry-After
    max_running_requests_per_client: Optional[int] = None  # a client's running share while others wait (None: no cap)
    chat_template_timeout: float = 10.0           # seconds a chat template may take to render (400 beyond)
    shutdown_timeout: float = 30.0                # SIGTERM: seconds live requests may run before they are aborted
    enable_mixed_chunk: bool = False              # a prefill chunk and the running decodes share one forward
    debug_integrity: bool = False
    # constrained decoding (constrained/)
    disable_jump_forward: bool = False            # grammar-forced text is sampled token by token (A/B)
    grammar_compile_timeout: float = 30.0         # seconds a grammar may take to compile before its request fails
    grammar_cache_size: int = 256                 # compiled grammars kept (LRU), keyed by (kind, spec)
    cpu_threads: Optional[int] = None            # torch threads for the CPU forward (default: torch's)
    # security (server/)
    api_key: Optional[str] = None                 # Bearer key for every route but /health (default: $RADIXSERVE_API_KEY)
    allowed_origins: Optional[str] = None         # comma list of browser origins allowed cross-origin (CORS); "*" = any
    allowed_hosts: Optional[str] = None           # comma list of Host names answered (default: see server/security.py)
    max_request_bytes: int = 8 * 1024 * 1024      # larger request bodies get 413 before they are read
    expose_server_info: bool = False              # /get_server_info shows filesystem paths too (never the API key)
    # observability (server/)
    enable_metrics: bool = False                 # /metrics also serves latency histograms (TTFT, ITL, TPOT, e2e, queue time)
    metrics_prefix: str = "radixserve:"          # prefix of every metric name; "sglang:" gives SGLang's names
    log_requests: bool = False                   # one INFO line per finished request: rid, token counts, timings, finish reason

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.resolved_device() == "cuda" else torch.float32
        return {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
                "float16": torch.float16, "half": torch.float16}[self.dtype]

    def resolved_api_key(self) -> Optional[str]:
        """--api-key, else the environment's RADIXSERVE_API_KEY (an empty one counts as unset)."""
        if self.api_key is not None:
            return self.api_key
        return os.environ.get("RADIXSERVE_API_KEY") or None

    def resolved_chunked_prefill_size(self) -> Optional[int]:
        if self.chunked_prefill_size is None:
            return 8192 if self.resolved_device() == "cuda" else 512
        return None if self.chunked_prefill_size <= 0 else self.chunked_prefill_size

    def check(self) -> None:
        """Raise ValueError naming the flag to change."""
        if self.schedule_policy not in ("fcfs", "lpm"):
            raise ValueError(f"--schedule-policy must be fcfs or lpm, not {self.schedule_policy!r}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"--load-format must be auto, safetensors or dummy, not {self.load_format!r}")
        if self.dtype not in ("auto", "float32", "float", "bfloat16", "float16", "half"):
            raise ValueError(f"--dtype {self.dtype!r} is not supported")
        if self.page_size < 1:
            raise ValueError("--page-size must be >= 1")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError("--mem-fraction-static must be in (0, 1)")
        if self.tp_size != 1:
            raise ValueError("--tp-size > 1 is not supported yet")
        if not self.shutdown_timeout >= 0:
            raise ValueError("--shutdown-timeout must be >= 0 seconds")
        if self.max_running_requests_per_client is not None and \
                self.max_running_requests_per_client < 1:
            raise ValueError("--max-running-requests-per-client must be >= 1")
        if not self.chat_template_timeout > 0:
            raise ValueError("--chat-template-timeout must be > 0 seconds")
        if not self.grammar_compile_timeout > 0:
            raise ValueError("--grammar-compile-timeout must be > 0 seconds")
        if self.grammar_cache_size < 1:
            raise ValueError("--grammar-cache-size must be >= 1")
        if self.max_queued_requests < 1:
            raise ValueError("--max-queued-requests must be >= 1")
        # security (server/)
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key must not be empty (leave it out to serve without a key)")
        if self.max_request_bytes < 1024:
            raise ValueError(f"--max-request-bytes must be at least 1024, got {self.max_request_bytes}")
        for origin in (self.allowed_origins or "").split(","):
            origin = origin.strip()
            if origin and origin != "*" and not (origin.startswith(("http://", "https://"))
                                                 and "/" not in origin.split("://", 1)[1].rstrip("/")):
                raise ValueError(f"--allowed-origins takes origins like https://app.example.com "
                                 f"(scheme://host[:port], no path) or *, not {origin!r}")
        for host in (self.allowed_hosts or "").split(","):
            host = host.strip()
            if host and ("/" in host or " " in host):
                raise ValueError(f"--allowed-hosts takes host names like example.com, .example.com "
                                 f"(and its subdomains) or *, not {host!r}")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(ServerArgs):
            flag = "--" + f.name.replace("_", "-")
            if f.type in ("bool", bool):
                parser.add_argument(flag, action="store_true", default=f.default)
                continue
            base = {"int": int, "float": float, "str": str, "Optional[int]": int,
                    "Optional[float]": float, "Optional[str]": str}[str(f.type)]
            parser.add_argument(flag, type=base, default=f.default)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "ServerArgs":
        return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})


@dataclass
class ModelConfig:
    """The model facts the runtime needs, read from an HF config.json."""
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict]
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: List[int] = field(default_factory=list)
    bos_token_id: Optional[int] = None
    hf_config: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelConfig":
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        rope_params = cfg.get("rope_parameters") or {}
        rope_scaling = cfg.get("rope_scaling")
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = rope_params
        rope_theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            hf_config=cfg,
        )

    @classmethod
    def from_path(cls, model_path: str) -> "ModelConfig":
        with open(os.path.join(model_path, "config.json")) as f:
            return cls.from_dict(json.load(f))
