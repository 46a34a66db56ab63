"""Configuration: ServerArgs (every flag of `radixserve serve`, each field's help text, choices
and SGLang aliases in its metadata), REFUSED_SGLANG_FLAGS (SGLang flags refused by name), and
ModelConfig (from config.json).

Configuration flows from ServerArgs; nothing else reads flags. The environment variables
radixserve reads are one table, knobs.KNOBS (knobs.py, printed by `radixserve env`), and only
knobs.value() reads them: the API keys' defaults (RADIXSERVE_API_KEY, RADIXSERVE_ADMIN_API_KEY),
the cache directory, RADIXSERVE_DISABLE_KERNELS (the debugging switch), and the A/B switches of
the kernels, the CUDA graphs and the GC. Each A/B switch also has a hidden flag here (--debug-*,
group "debug": parsed, but not in --help; `radixserve env` lists them), whose value, when given,
beats the environment's (ServerArgs.knob_overrides(), applied by ModelRunner at start).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import textwrap
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from radixserve import knobs

logger = logging.getLogger("radixserve.config")


# SGLang flags radixserve does not support yet, each refused by name with its reason (exit 2):
# `radixserve serve --pp-size 2` stops with "--pp-size is an SGLang flag radixserve does not
# support yet: ...", never starts with the flag silently ignored. The SGLang flags we do
# implement are ServerArgs fields under SGLang's names (plus the `aliases` of their metadata).
_ONE_DEVICE = "one server runs on one device, or with --tp-size N on N ranks (pipeline, " \
              "expert and data parallelism are not implemented)"
_ONE_HOST = "one server is one process on one machine"
_LORA = "LoRA adapters are not supported"
_SPECULATIVE = ("speculative decoding with a draft model is not implemented (--speculative-"
                "algorithm ngram drafts from the request's own text)")
_NO_DOWNLOAD = "models are local directories or .gguf files (--model-path); nothing is downloaded"
_HICACHE = "the prefix cache lives in the KV pool only (no host-memory tier)"
_OWN_KERNELS = "attention and sampling are radixserve's own kernels (torch references on the CPU)"
_BUCKETS = "the latency histograms' buckets are fixed (--enable-metrics)"
_NO_WARMUP = "radixserve sends no warmup request; drop the flag"
REFUSED_SGLANG_FLAGS: Dict[str, str] = {
    # model and tokenizer
    "--trust-remote-code": "radixserve runs only its own model code (Llama, Mistral, Qwen2, "
                           "Qwen3, Phi-3, SmolLM2, Gemma 2 and 3); code from a model's "
                           "repository is never run",
    "--tokenizer-mode": "the tokenizer is the model's tokenizer.json (HF tokenizers) or "
                        "tokenizer.model (sentencepiece)",
    "--skip-tokenizer-init": "the server always loads the tokenizer",
    "--revision": _NO_DOWNLOAD,
    "--download-dir": _NO_DOWNLOAD,
    "--model-impl": "each architecture has one implementation",
    "--json-model-override-args": "the model's config.json is used as it is",
    "--model-loader-extra-config": "the loader takes no options (--load-format)",
    "--enable-multimodal": "only text is served (of a multimodal checkpoint such as Gemma 3 "
                           "4B, its text model)",
    "--completion-template": "completion (fill-in-the-middle) templates are not supported",
    "--hf-chat-template-name": "of a tokenizer's named templates, chats use 'default' and "
                               "requests with tools 'tool_use'; --chat-template replaces them",
    # quantization and data type
    "--quantization-param-path": "FP8 scales come from the checkpoint (quantization_config) or "
                                 "are computed at load (--quantization fp8)",
    # parallelism and distribution (--tp-size N and --dp-size N are accepted)
    "--pp-size": _ONE_DEVICE,
    "--pipeline-parallel-size": _ONE_DEVICE,
    "--ep-size": _ONE_DEVICE,
    "--expert-parallel-size": _ONE_DEVICE,
    "--enable-dp-attention": _ONE_DEVICE,
    "--enable-dp-lm-head": _ONE_DEVICE,
    "--load-balance-method": "--dp-size N puts SGLang's model gateway in front of N replica "
                             "processes; choose its policy with --router-policy",
    "--nnodes": _ONE_HOST,
    "--node-rank": _ONE_HOST,
    "--dist-init-addr": _ONE_HOST,
    "--nccl-port": _ONE_HOST,
    "--dist-timeout": _ONE_HOST,
    "--base-gpu-id": "the server uses the current CUDA device; choose it with CUDA_VISIBLE_DEVICES",
    "--gpu-id-step": "the server uses the current CUDA device; choose it with CUDA_VISIBLE_DEVICES",
    "--disaggregation-mode": "prefill and decode run in the same server",
    "--disaggregation-transfer-backend": "prefill and decode run in the same server",
    # memory and scheduling
    "--cpu-offload-gb": "weights stay on the device",
    "--enable-hierarchical-cache": _HICACHE,
    "--hicache-ratio": _HICACHE,
    "--hicache-size": _HICACHE,
    "--num-continuous-decode-steps": "the scheduler runs one decode step per turn (overlapped "
                                     "with the next: see --disable-overlap-schedule)",
    "--enable-memory-saver": "the KV pool and weights are never released while serving",
    # kernels and optimizations
    "--attention-backend": _OWN_KERNELS,
    "--prefill-attention-backend": _OWN_KERNELS,
    "--decode-attention-backend": _OWN_KERNELS,
    "--sampling-backend": _OWN_KERNELS,
    "--triton-attention-reduce-in-fp32": _OWN_KERNELS,
    "--triton-attention-num-kv-splits": _OWN_KERNELS,
    "--enable-torch-compile": "the forward is not torch.compile'd (decode replays CUDA graphs: "
                              "--cuda-graph-max-bs)",
    "--torch-compile-max-bs": "the forward is not torch.compile'd (decode replays CUDA graphs: "
                              "--cuda-graph-max-bs)",
    "--cuda-graph-bs": "the CUDA graphs' batch-size buckets are fixed (up to --cuda-graph-max-bs)",
    "--disable-cuda-graph-padding": "a batch between two captured sizes always replays the next "
                                    "larger graph, padded (--disable-cuda-graph launches eagerly)",
    "--enable-two-batch-overlap": "no micro-batch overlap (the step loop overlaps the scheduler "
                                  "with the forward instead)",
    "--enable-nan-detection": "a request whose logits turn non-finite already fails alone",
    "--enable-deterministic-inference": "batch-invariant kernels are not implemented",
    "--enable-p2p-check": _ONE_DEVICE,
    "--disable-custom-all-reduce": _ONE_DEVICE,
    # LoRA
    "--enable-lora": _LORA,
    "--lora-paths": _LORA,
    "--max-loras-per-batch": _LORA,
    "--max-lora-rank": _LORA,
    "--lora-target-modules": _LORA,
    "--lora-backend": _LORA,
    # speculative decoding
    "--speculative-draft-model-path": _SPECULATIVE,
    "--speculative-num-steps": _SPECULATIVE,
    "--speculative-eagle-topk": _SPECULATIVE,
    # serving and API
    "--config": "flags are read from the command line only (no YAML config file)",
    "--skip-server-warmup": _NO_WARMUP,
    "--warmups": _NO_WARMUP,
    "--enable-cache-report": "cached prompt tokens are always reported "
                             "(usage.prompt_tokens_details.cached_tokens); drop the flag",
    "--allow-auto-truncate": "a prompt longer than the context is refused with a 400 (a request "
                             "may ask for truncate_prompt_tokens)",
    "--enable-custom-logit-processor": "custom logit processors are not supported (logit_bias is)",
    "--enable-return-hidden-states": "hidden states are not returned",
    "--preferred-sampling-params": "no server-wide default sampling parameters",
    "--constrained-json-whitespace-pattern": "xgrammar's JSON grammar is used as it is",
    "--file-storage-path": "the server stores no files",
    "--ssl-keyfile": "the server speaks plain HTTP; put a TLS proxy in front of it",
    "--ssl-certfile": "the server speaks plain HTTP; put a TLS proxy in front of it",
    "--sleep-on-idle": "the scheduling loop already sleeps while idle; drop the flag",
    "--watchdog-timeout": "no watchdog: if the scheduling loop dies the server reports unhealthy "
                          "and exits non-zero",
    # logging and metrics
    "--log-requests-level": "--log-requests logs one line of metadata per finished request; no "
                            "levels",
    "--log-level-http": "--log-level sets every logger",
    "--enable-metrics-for-all-schedulers": "one server has one scheduler",
    "--bucket-time-to-first-token": _BUCKETS,
    "--bucket-inter-token-latency": _BUCKETS,
    "--bucket-e2e-request-latency": _BUCKETS,
    "--collect-tokens-histogram": "token-count histograms are not collected",
    "--decode-log-interval": "the decode log line comes every 40 decode steps",
    "--show-time-cost": "no time-cost marks",
    "--crash-dump-folder": "requests are not dumped on a crash",
}


class RefusedFlag(argparse.Action):
    """An SGLang flag radixserve does not support yet: parsing it is an error (exit 2) naming the
    flag and the reason. It takes any values (`--lora-paths a b`, `--trust-remote-code`)."""

    def __init__(self, option_strings: Sequence[str], dest: str, reason: str = "", **kw: Any):
        kw.update(nargs="*", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        super().__init__(option_strings, dest, **kw)
        self.reason = reason

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is an SGLang flag radixserve does not support yet: "
                     f"{self.reason}")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each flag's choices ({a,b}) and default: `(default: X)` unless the help
    already says what the default is; on/off flags show `(default: off)`. Hidden flags (an
    action with hidden = True: the --debug-* A/B switches) are left out of the usage and the
    flag list; a section of hidden flags only is left out whole."""

    def __init__(self, prog: str):
        super().__init__(prog, max_help_position=36)

    def add_usage(self, usage, actions, groups, prefix=None):
        super().add_usage(usage, [a for a in actions if not getattr(a, "hidden", False)],
                          groups, prefix)

    def add_argument(self, action: argparse.Action) -> None:
        if not getattr(action, "hidden", False):
            super().add_argument(action)

    def _split_lines(self, text: str, width: int) -> List[str]:
        # flag names are never broken at their hyphens
        return textwrap.wrap(self._whitespace_matcher.sub(" ", text).strip(), width,
                             break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return textwrap.fill(self._whitespace_matcher.sub(" ", text).strip(), width,
                             initial_indent=indent, subsequent_indent=indent,
                             break_on_hyphens=False)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.default is argparse.SUPPRESS or not action.option_strings
                or "default" in text.lower()):
            return text
        if isinstance(action, argparse._StoreTrueAction):
            return text + " (default: off)"
        return text + " (default: %(default)s)"


def serve_epilog() -> str:
    """The end of `serve --help`: SGLang's names, and the SGLang flags refused by name."""
    return ("SGLang's flag names are accepted where radixserve implements the flag (e.g. --model, "
            "--tp-size 1, --stream-interval, --grammar-backend xgrammar, --chat-template). These "
            "SGLang flags are refused by name with the reason (not supported yet): "
            + ", ".join(REFUSED_SGLANG_FLAGS) + ".")


def _flag(default: Any, help: str, *, choices: Optional[Sequence[Any]] = None,
          aliases: Sequence[str] = (), metavar: Optional[str] = None,
          type: Optional[Callable[[str], Any]] = None, group: Optional[str] = None,
          repeat: bool = False) -> Any:
    """A ServerArgs field and its flag: `help` says what it does, in which unit, and (where the
    default is None or depends on the machine) what the default means; choices closes the value
    set; aliases are further option strings (SGLang's names); group starts a --help section;
    repeat: the flag may be given several times (the field holds the list of values)."""
    return field(default=default, metadata={"help": help, "choices": choices,
                                            "aliases": tuple(aliases), "metavar": metavar,
                                            "type": type, "group": group, "repeat": repeat})


def _debug_flag(knob_name: str, group: Optional[str] = None) -> Any:
    """A hidden ServerArgs field (not in --help) overriding the environment variable knob_name
    of knobs.KNOBS: it takes what the variable takes (knobs.Knob.parse); None (not given) leaves
    the knob to the environment, then its default."""
    knob = knobs.KNOBS[knob_name]
    assert knob.flag is not None

    def parse(raw: str) -> Any:
        try:
            return knob.parse(raw)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{raw!r}: it {e}") from None

    metavar = "{" + knob.values.replace("|", ",") + "}" if "|" in knob.values else knob.values
    return field(default=None, metadata={
        "help": f"{knob.help}; default: ${knob.name}, else {knob.default_text()}",
        "choices": None, "aliases": (), "metavar": metavar, "type": parse, "group": group,
        "repeat": False, "hidden": True, "knob": knob_name})


def _lower(value: str) -> str:
    return value.lower()


# --tool-call-parser's values (parsers/tool_calls.FORMATS, SGLang's and vLLM's names)
TOOL_CALL_PARSERS = ("hermes", "qwen25", "llama3", "llama3_json", "qwen3_coder", "mistral",
                     "pythonic")

# --speculative-algorithm's values (SGLang's NGRAM and SUFFIX, any case)
SPECULATIVE_ALGORITHMS = ("ngram", "suffix")
# speculation runs only while at most this many requests decode (engine/scheduler/spec.py's
# batch gate); the runner keeps SPEC_MAX_BATCH x (num_draft_tokens - 1) spare req_to_token rows
# for the verify steps' draft positions (model/runner.py)
SPEC_MAX_BATCH = 32
SPEC_MAX_DRAFT_TOKENS = 32   # --speculative-num-draft-tokens' ceiling (spare rows x context)


def _speculative_algorithm(value: str) -> str:
    if value.lower() not in SPECULATIVE_ALGORITHMS:
        raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from "
                                         f"{', '.join(SPECULATIVE_ALGORITHMS)})")
    return value.lower()


# --quantization's values (radixserve.quant.fp8.QUANTIZATION_METHODS, SGLang's names)
QUANTIZATION_METHODS = ("fp8", "compressed-tensors", "modelopt")


def _quantization(value: str) -> str:
    if value not in QUANTIZATION_METHODS:
        raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from "
                                         f"{', '.join(QUANTIZATION_METHODS)})")
    return value


@dataclass
class ServerArgs:
    """Every flag of `radixserve serve` (one field each: --field-name); the help text of each
    flag is its field's metadata, so `radixserve serve --help` cannot drift from the fields."""
    # model
    model_path: Optional[str] = _flag(
        None, "model to serve: an HF-style directory (config.json + safetensors) or a .gguf file; "
        "default: the embedded SmolLM2-135M-Instruct (converted once into ~/.cache/radixserve)",
        aliases=("--model",), metavar="PATH", group="model")
    tokenizer_path: Optional[str] = _flag(
        None, "directory holding tokenizer.json or tokenizer.model; default: the model's directory",
        metavar="PATH")
    served_model_name: Optional[str] = _flag(
        None, "model name shown in /v1/models and in responses; default: the model directory's name",
        metavar="NAME")
    load_format: str = _flag(
        "auto", "how weights are loaded: auto (safetensors, or the converted GGUF), safetensors, "
        "dummy (the real shapes with random weights, for benchmarks)",
        choices=("auto", "safetensors", "dummy"))
    dtype: str = _flag(
        "auto", "dtype of weights, activations and (unless --kv-cache-dtype) the KV cache; "
        "auto: float32 on the CPU, bfloat16 on a GPU; float = float32, half = float16",
        choices=("auto", "float32", "float", "bfloat16", "float16", "half"))
    kv_cache_dtype: str = _flag(
        "auto", "dtype of the KV cache: auto (the model's --dtype), fp8_e4m3 or fp8_e5m2 (one "
        "byte per element, so the pool holds twice the tokens of bf16; K and V are stored "
        "divided by the layer's k_scale / v_scale from the checkpoint, 1.0 where it has none, "
        "and attention reads them back multiplied)", choices=("auto", "fp8_e4m3", "fp8_e5m2"))
    quantization: Optional[str] = _flag(
        None, "FP8 (e4m3) linear layers: fp8 quantizes a bf16/fp16 checkpoint at load "
        "(per-output-channel weight scales; activations quantized per token for GEMMs of more "
        "than 16 rows, FP8 weights with --dtype math below); an FP8 checkpoint (config.json's "
        "quantization_config: compressed-tensors FP8/FP8_DYNAMIC or ModelOpt FP8) loads as it "
        "ships, with fp8 or its own method name or without the flag; the LM head and "
        "embeddings stay in --dtype; default: what the checkpoint's quantization_config says "
        "(unquantized without one)", type=_quantization,
        metavar="{" + ",".join(QUANTIZATION_METHODS) + "}")
    device: str = _flag(
        "auto", "device of the forward; auto: cuda when a GPU is visible, else cpu",
        choices=("auto", "cpu", "cuda"))
    context_length: Optional[int] = _flag(
        None, "most tokens (prompt + output) of one sequence; default and upper bound: the "
        "model's max_position_embeddings (with yarn rope scaling: the pretraining length x its "
        "factor, when larger)", metavar="TOKENS")
    chat_template: Optional[str] = _flag(
        None, "chat template of the chat routes, replacing the model's: the path of a Jinja file, "
        "or the Jinja text itself (it holds {{ or {%); SGLang's built-in template names are not "
        "supported yet; default: the model's own template", metavar="PATH_OR_JINJA")
    reasoning_parser: str = _flag(
        "none", "chat routes put a reasoning model's <think> ... </think> text in "
        "message.reasoning_content (streamed as delta.reasoning_content), the answer in content: "
        "qwen3 when the output opens with <think>; deepseek-r1 and qwen3-thinking when the "
        "output starts inside the reasoning (the template opened it); none: no split",
        choices=("none", "deepseek-r1", "qwen3", "qwen3-thinking"))
    tool_call_parser: str = _flag(
        "hermes", "how the model writes tool calls (the chat routes' tools): hermes (= qwen25): "
        "<tool_call>{\"name\", \"arguments\"}</tool_call> blocks (Hermes, Qwen2.5, Qwen3, "
        "SmolLM2); llama3 (= llama3_json): bare {\"name\", \"parameters\"} objects joined by "
        "\"; \" (Llama 3.1-3.3); qwen3_coder: <tool_call><function=NAME><parameter=ARG>VALUE"
        "</parameter></function></tool_call> (Qwen3-Coder, Qwen3.5); mistral: [TOOL_CALLS] "
        "[{\"name\", \"arguments\"}] or [TOOL_CALLS]NAME[ARGS]{...} (Mistral); pythonic: "
        "[name(arg=literal, ...)] (Llama 3.2, Llama 4)", choices=TOOL_CALL_PARSERS)
    # server
    host: str = _flag("127.0.0.1", "address the HTTP server binds (0.0.0.0: every interface)",
                      metavar="ADDR", group="server")
    port: int = _flag(30000, "TCP port of the HTTP server", metavar="PORT")
    log_level: str = _flag("info", "log level of every logger (trace = debug)",
                           choices=("critical", "error", "warning", "info", "debug", "trace"),
                           type=_lower)
    # memory and scheduling
    mem_fraction_static: Optional[float] = _flag(
        None, "fraction in (0, 1) of free memory the KV pool takes; default: 0.85 of the GPU's free "
        "memory after the weights, less where that would not leave a prefill step its peak, and "
        "0.10 of available RAM on the CPU", metavar="FRACTION",
        group="memory and scheduling")
    max_total_tokens: Optional[int] = _flag(
        None, "KV pool size in tokens (overrides --mem-fraction-static); default: from "
        "--mem-fraction-static, capped at --max-running-requests x the context length",
        metavar="TOKENS")
    max_running_requests: Optional[int] = _flag(
        None, "most sequences running (decoding) at once; default: 256 on a GPU, 64 on the CPU",
        metavar="N")
    max_prefill_tokens: int = _flag(16384, "most prompt tokens prefilled in one step (tokens)",
                                    metavar="TOKENS")
    chunked_prefill_size: Optional[int] = _flag(
        None, "longest prefill chunk in tokens (longer prompts prefill over several steps); -1 "
        "disables chunking; default: 8192 on a GPU, 512 on the CPU", metavar="TOKENS")
    schedule_policy: str = _flag(
        "fcfs", "order of the waiting queue: fcfs (arrival order) or lpm (longest cached prefix "
        "first)", choices=("fcfs", "lpm"))
    step_order: str = _flag(
        "alternate", "what runs while prompts wait and requests decode: 'alternate' interleaves "
        "one prefill step with one decode step (steadier inter-token latency), 'prefill-first' "
        "runs every prefill that can be admitted before the next decode step (SGLang's order: "
        "the largest decode batches, for throughput; the offline Engine's default)",
        choices=("alternate", "prefill-first"))
    enable_priority_scheduling: bool = _flag(
        False, "order the waiting queue by each request's priority (its `priority` field), "
        "then by --schedule-policy within a priority; a waiting request that beats running "
        "ones by more than --priority-scheduling-preemption-threshold retracts the least "
        "urgent of them when running slots or KV memory keep it out (they resume later with "
        "their output and KV), and retraction for memory takes the least urgent first; "
        "higher values are more urgent unless --schedule-low-priority-values-first (SGLang's "
        "semantics)")
    schedule_low_priority_values_first: bool = _flag(
        False, "with --enable-priority-scheduling, lower priority values are more urgent (vLLM's "
        "convention) instead of higher ones")
    priority_scheduling_preemption_threshold: int = _flag(
        10, "with --enable-priority-scheduling, how much more urgent (priority difference, "
        "strictly greater) a waiting request must be than a running one to retract it; >= 0",
        metavar="N")
    disable_priority_preemption: bool = _flag(
        False, "with --enable-priority-scheduling, order the queue by priority but never retract "
        "a running request for a more urgent one")
    default_priority_value: Optional[int] = _flag(
        None, "with --enable-priority-scheduling, the priority of requests sent without one; "
        "default: the least urgent of all (they wait behind every prioritized request and are "
        "retracted first)", metavar="N")
    abort_on_priority_when_disabled: bool = _flag(
        False, "without --enable-priority-scheduling, refuse (400) a request that sets "
        "priority instead of ignoring it")
    schedule_conservativeness: float = _flag(
        1.0, "scales the output tokens reserved per running request when admitting new ones "
        "(larger: fewer retractions, smaller batches)", metavar="X")
    disable_radix_cache: bool = _flag(
        False, "no prefix reuse: every prompt is prefilled in full (for A/B runs)")
    page_size: int = _flag(1, "tokens per KV-cache page (the prefix cache matches whole pages)",
                           metavar="TOKENS")
    # parallelism
    tp_size: int = _flag(1, "tensor-parallel size: ranks per model, all in this one process (a "
                         "thread per rank; on CUDA one GPU per rank, NCCL made in-process)",
                         aliases=("--tensor-parallel-size",), metavar="N", group="parallelism")
    dp_size: int = _flag(
        1, "data-parallel size: N > 1 starts N replica servers (each on its own GPU, or --tp-size "
        "GPUs; on the CPU, N CPU processes) on loopback ports, and SGLang's model gateway (smg: "
        "pip install 'radixserve[router]') in front of them on --host:--port; a replica that "
        "dies is restarted", aliases=("--data-parallel-size",), metavar="N")
    router_policy: str = _flag(
        "cache_aware", "with --dp-size N > 1, how the gateway picks a replica: cache_aware (the "
        "replica whose earlier requests share the longest prefix with this one, unless load is "
        "imbalanced), round_robin, power_of_two (the less loaded of two random replicas), "
        "random", choices=("cache_aware", "round_robin", "power_of_two", "random"))
    engine_process: Optional[bool] = _flag(
        None, "run the engine (model, scheduler, detokenizers) in a process of its own and "
        "HTTP in this one, as SGLang and vLLM split them: the two no longer share one GIL, so "
        "streaming many requests does not slow the steps; --no-engine-process: one process "
        "(default: a process of its own on a GPU, one process on the CPU and with "
        "--enable-dashboard, which reads the radix tree in this process)")
    # runtime
    random_seed: int = _flag(0, "seed of the generator that seeds requests sent without a seed",
                             metavar="SEED", group="runtime")
    disable_cuda_graph: bool = _flag(
        False, "launch decode steps eagerly instead of replaying CUDA graphs (GPU only)")
    cuda_graph_max_bs: Optional[int] = _flag(
        None, "largest decode batch (sequences) run as a CUDA graph; larger batches launch eagerly; "
        "default: --max-running-requests", metavar="N")
    disable_overlap_schedule: bool = _flag(
        False, "serial loop: each step waits for the previous step's tokens (same outputs; for A/B "
        "runs)")
    max_queued_requests: int = _flag(
        4096, "waiting sequences beyond this get a 503 with Retry-After (a request of more "
        "sequences than this, which could never be queued, a 400)", metavar="N")
    max_running_requests_per_client: Optional[int] = _flag(
        None, "running sequences one client (API key, else peer address) may hold while another "
        "client's requests wait; beyond it, its latest requests are retracted (KV kept in the "
        "prefix cache) so a client under it can start; default: --max-running-requests divided "
        "by the clients with live requests (equal to --max-running-requests: no fairness)",
        metavar="N")
    chat_template_timeout: float = _flag(
        10.0, "seconds a chat template may take to render (a 400 beyond)", metavar="SECONDS")
    shutdown_timeout: float = _flag(
        20.0, "on SIGTERM, seconds live requests may run before they are aborted; the server "
        "then takes up to 5 s more to close its connections, so the default ends within "
        "Kubernetes' default 30 s grace period (raise terminationGracePeriodSeconds with it)",
        metavar="SECONDS")
    tokenizer_worker_num: int = _flag(
        2, "threads that tokenize long prompts (8192 characters or more) at once, with the GIL "
        "released; more long prompts wait their turn (shorter ones are tokenized at once)",
        metavar="N")
    stream_interval: int = _flag(
        1, "tokens per streamed chunk: a stream sends its first token at once, then a chunk each "
        "time this many new tokens are ready, and the rest when it finishes (larger: fewer "
        "events)", metavar="TOKENS")
    enable_mixed_chunk: bool = _flag(
        False, "a prefill chunk and the running decodes share one forward")
    debug_integrity: bool = _flag(
        False, "each time the step loop runs out of work, check that every KV slot is free, "
        "cached or owned by one request (slow; for debugging)")
    cpu_threads: Optional[int] = _flag(
        None, "torch threads of the CPU forward; default: torch's choice", metavar="N")
    # constrained decoding (constrained/)
    grammar_backend: str = _flag(
        "xgrammar", "backend of structured output (json_schema, regex, ebnf, tools); only xgrammar "
        "is supported", choices=("xgrammar",), group="constrained decoding")
    disable_jump_forward: bool = _flag(
        False, "grammar-forced text is sampled token by token (for A/B runs)")
    grammar_compile_timeout: float = _flag(
        30.0, "seconds a grammar may take to compile before its request fails", metavar="SECONDS")
    grammar_cache_size: int = _flag(
        256, "compiled grammars kept (LRU), keyed by (kind, spec)", metavar="N")
    # embeddings and reranking (engine/pooling.py, server/embeddings_api.py)
    is_embedding: bool = _flag(
        False, "serve the model for embeddings and reranking instead of generation: POST "
        "/v1/embeddings (pooled final-norm hidden states, L2-normalised; OpenAI's API) and "
        "/v1/rerank (each document's relevance to a query, from the model's yes / no logits "
        "at the prompt's end, as Qwen3-Reranker scores); the generation routes answer 400; a "
        "checkpoint without an LM head (an embedding model's backbone) loads, and serves "
        "embeddings only", group="embeddings and reranking")
    pooling_method: str = _flag(
        "auto", "how /v1/embeddings pools the final-norm hidden states of a prompt: last (its "
        "last token's: Qwen3-Embedding and other decoder embedders; a cached prefix is "
        "reused), mean (the mean over every token; such prompts prefill from the start); "
        "auto: what the model's sentence-transformers config says (modules.json and its "
        "Pooling module's config.json), else last", choices=("auto", "last", "mean"))
    rerank_template: str = _flag(
        "qwen3", "how /v1/rerank makes a prompt of a query and a document: qwen3: "
        "Qwen3-Reranker's (a system message asking for yes or no, then <Instruct>: ..., "
        "<Query>: ..., <Document>: ... and an empty think block; a request's instruction "
        "replaces the default one); concat: the query's tokens followed by the document's "
        "(the client formats both, as vLLM's rerank examples do)", choices=("qwen3", "concat"))
    rerank_token_ids: Optional[str] = _flag(
        None, "the token ids whose logits at a rerank prompt's last position score it, as "
        "YES,NO: the score is P(yes) = softmax over the two logits; default: the tokenizer's "
        "single tokens \"yes\" and \"no\"", metavar="YES,NO")
    # speculative decoding without a draft model (engine/spec/, engine/scheduler/spec.py)
    speculative_algorithm: Optional[str] = _flag(
        None, "draft tokens without a draft model and verify them in one decode step: ngram "
        "(prompt lookup: the tokens that followed the latest earlier occurrence of the "
        "request's last n tokens) or suffix (ngram, or the radix tree's continuation of the "
        "request's whole history where another sequence had it as prefix); outputs are unchanged, greedy or sampled (requests with a "
        "grammar or penalties run unspeculated); speculation runs while at most 32 requests "
        "decode, per request as its drafts get accepted; default: off", type=_speculative_algorithm,
        metavar="{ngram,suffix}", group="speculative decoding")
    speculative_num_draft_tokens: int = _flag(
        8, "tokens a verify step computes per speculating request: its last token plus up to "
        "this many minus one draft tokens (SGLang's meaning)", metavar="N")
    speculative_ngram_min_match_window_size: int = _flag(
        1, "shortest suffix (tokens) an ngram draft may match on", metavar="N")
    speculative_ngram_max_match_window_size: int = _flag(
        12, "longest suffix (tokens) an ngram draft tries to match first", metavar="N")
    # security (server/)
    api_key: Union[str, List[str], None] = _flag(
        None, "Bearer key required by every route but /health; give it several times for "
        "several clients: each key is its own client (its stored responses, aborts, running "
        "cap); default: $RADIXSERVE_API_KEY, else no key (--api-key-file adds keys)",
        metavar="KEY", group="security", type=str, repeat=True)
    api_key_file: Optional[str] = _flag(
        None, "file of API keys, one a line: the key, then optionally whitespace and the "
        "client's name (keys sharing a name are one client, e.g. while a key is rotated); "
        "blank lines and lines starting with # are skipped; added to --api-key's keys",
        metavar="PATH")
    admin_api_key: Optional[str] = _flag(
        None, "Bearer key of the server-wide routes (/flush_cache, /get_server_info, /metrics), "
        "where the other keys then get 403; it also works as a client key on every other "
        "route; default: $RADIXSERVE_ADMIN_API_KEY, else none (those routes take any valid key)",
        metavar="KEY")
    allowed_origins: Optional[str] = _flag(
        None, "comma list of browser origins allowed cross-origin (CORS), e.g. "
        "https://app.example.com, or * for any; default: none (same-origin only)",
        metavar="ORIGINS")
    allowed_hosts: Optional[str] = _flag(
        None, "comma list of Host names answered (.example.com: it and its subdomains; *: any; "
        "other names get 421, against DNS rebinding); default: on loopback, only localhost "
        "(and *.localhost) and loopback addresses; beyond loopback, localhost, this machine's "
        "name and any IP address. Behind a proxy that forwards its own Host, list the names "
        "clients use", metavar="HOSTS")
    max_request_bytes: int = _flag(
        8 * 1024 * 1024, "larger request bodies (bytes) get a 413 before they are read",
        metavar="BYTES")
    expose_server_info: bool = _flag(
        False, "/get_server_info, /get_model_info and /v1/models show filesystem paths (the "
        "model's) too (never the API keys)")
    # observability (server/)
    enable_metrics: bool = _flag(
        False, "/metrics also serves latency histograms (TTFT, inter-token, per output token, "
        "end-to-end, queue time)", group="observability")
    metrics_prefix: str = _flag(
        "radixserve:", "prefix of every metric name (sglang: gives SGLang's names; vllm: serves "
        "vLLM's names where vLLM has one (vllm:num_requests_running, vllm:num_requests_waiting, "
        "vllm:kv_cache_usage_perc, vllm:prefix_cache_queries/hits, ... with the labels "
        "model_name and engine) and the rest as radixserve:)", metavar="PREFIX")
    log_requests: bool = _flag(
        False, "one INFO line per finished request: rid, token counts, timings, finish reason")
    enable_dashboard: bool = _flag(
        False, "serve /dashboard, a page of the prefix cache over the last minutes (hit rate, "
        "KV pool use, requests, throughput, the step timeline, the radix tree's largest "
        "subtrees), its data as JSON (/dashboard/data) and the prefix-cache advisor "
        "(/dashboard/advice, `radixserve advise`); behind the API key (with --admin-api-key, "
        "that key only); keeps the token ids of the last 256 prompts in memory")
    dashboard_show_text: bool = _flag(
        True, "the dashboard shows decoded prompt text (the tree's prefixes, the advisor's "
        "spans), which shows every client's prompts to whoever may open it; "
        "--no-dashboard-show-text: token counts and positions only (default: on)")
    kv_events_config: Optional[str] = _flag(
        None, "publish the prefix cache's KV events (BlockStored, BlockRemoved, AllBlocksCleared) "
        "over ZMQ in vLLM's KVEventBatch msgpack format, for KV-aware routers (llm-d, Dynamo): "
        "vLLM's and SGLang's JSON, e.g. '{\"publisher\": \"zmq\", \"endpoint\": "
        "\"tcp://*:5557\", \"topic\": \"kv-events\"}' (also replay_endpoint, buffer_steps, hwm, "
        "max_queue_size, enable_kv_cache_events), plus block_size (tokens per event block, a "
        "multiple of --page-size; default --page-size, 16 when that is 1) and event_encoding "
        "(map: current vLLM, the default; array: vLLM before 2026 and SGLang); see "
        "cache/kv_events.py", metavar="JSON")
    # debug: the A/B switches of knobs.KNOBS as hidden flags (not in --help; `radixserve env`
    # lists them); each, when given, beats its environment variable (knob_overrides)
    debug_decode_kernel: Optional[str] = _debug_flag("RADIXSERVE_DECODE_KERNEL", group="debug")
    debug_fp8_scaled_mm: Optional[str] = _debug_flag("RADIXSERVE_FP8_SCALED_MM")
    debug_extend_kernel: Optional[str] = _debug_flag("RADIXSERVE_EXTEND_KERNEL")
    debug_decode_no_split_tokens: Optional[int] = _debug_flag("RADIXSERVE_DECODE_NO_SPLIT_TOKENS")
    debug_graph_context_classes: Optional[bool] = _debug_flag("RADIXSERVE_GRAPH_CONTEXT_CLASSES")
    debug_gc_gen0: Optional[int] = _debug_flag("RADIXSERVE_GC_GEN0")
    debug_spec_overlap: Optional[str] = _debug_flag("RADIXSERVE_SPEC_OVERLAP")
    debug_switch_interval_us: Optional[int] = _debug_flag("RADIXSERVE_SWITCH_INTERVAL_US")

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_engine_process(self) -> bool:
        """Whether the engine runs in a process of its own (engine/process.py): --engine-process /
        --no-engine-process where given, else on a GPU unless --enable-dashboard (which reads the
        radix tree in the server's process). On the CPU one process: the model's threads and a
        second interpreter would share the same few cores."""
        if self.engine_process is not None:
            return self.engine_process
        return self.resolved_device().startswith("cuda") and not self.enable_dashboard

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.resolved_device() == "cuda" else torch.float32
        return {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
                "float16": torch.float16, "half": torch.float16}[self.dtype]

    def resolved_kv_cache_dtype(self) -> torch.dtype:
        """The KV pool's dtype: the model's (resolved_dtype) for auto, else the FP8 format."""
        if self.kv_cache_dtype == "auto":
            return self.resolved_dtype()
        return {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[self.kv_cache_dtype]

    def resolved_api_keys(self) -> List[Tuple[str, Optional[str]]]:
        """The client keys, each (key, name or None): --api-key's (one, or a list; without
        the flag, the environment's RADIXSERVE_API_KEY, an empty one counting as unset), then
        those of --api-key-file (api_key_file_entries)."""
        given = [self.api_key] if isinstance(self.api_key, str) else list(self.api_key or [])
        if not given and knobs.value("RADIXSERVE_API_KEY"):
            given = [knobs.value("RADIXSERVE_API_KEY")]
        return [(k, None) for k in given] + self.api_key_file_entries()

    def api_key_file_entries(self) -> List[Tuple[str, Optional[str]]]:
        """The (key, name or None) lines of --api-key-file ([] without one): `KEY [NAME]`,
        blank lines and # comments skipped. Raises ValueError naming the flag for a file that
        cannot be read, or a line of another shape."""
        if self.api_key_file is None:
            return []
        try:
            with open(os.path.expanduser(self.api_key_file), encoding="utf-8") as f:
                lines = f.read().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--api-key-file {self.api_key_file}: {e}") from None
        entries: List[Tuple[str, Optional[str]]] = []
        for number, line in enumerate(lines, 1):
            parts = line.split()
            if not parts or parts[0].startswith("#"):
                continue
            if len(parts) > 2:
                raise ValueError(f"--api-key-file {self.api_key_file}, line {number}: "
                                 f"expected KEY [NAME], got {len(parts)} words")
            entries.append((parts[0], parts[1] if len(parts) == 2 else None))
        return entries

    def resolved_admin_api_key(self) -> Optional[str]:
        """--admin-api-key, else the environment's RADIXSERVE_ADMIN_API_KEY (empty: unset)."""
        if self.admin_api_key is not None:
            return self.admin_api_key
        return knobs.value("RADIXSERVE_ADMIN_API_KEY") or None

    def knob_overrides(self) -> Dict[str, Any]:
        """{knob name: value} of the hidden --debug-* flags given (knobs.set_flags takes it;
        ModelRunner applies it at start). Raises ValueError naming the flag for a value its knob
        does not take (a flag parsed from the command line was checked already; this catches
        Engine(debug_decode_kernel=...) and the like)."""
        out: Dict[str, Any] = {}
        for f in dataclasses.fields(self):
            name = f.metadata.get("knob")
            v = getattr(self, f.name)
            if name is None or v is None:
                continue
            try:
                out[name] = knobs.KNOBS[name].coerce(v)
            except ValueError as e:
                raise ValueError(f"--{f.name.replace('_', '-')} {v!r}: it {e}") from None
        return out

    def resolved_chunked_prefill_size(self) -> Optional[int]:
        if self.chunked_prefill_size is None:
            return 8192 if self.resolved_device() == "cuda" else 512
        return None if self.chunked_prefill_size <= 0 else self.chunked_prefill_size

    def resolved_chat_template(self) -> Optional[str]:
        """--chat-template as Jinja text (the file's contents when it names a file), or None when
        unset. Raises ValueError naming the flag for a value that is neither."""
        value = self.chat_template
        if value is None:
            return None
        path = os.path.expanduser(value)
        if os.path.isfile(path):
            if path.endswith(".json"):
                raise ValueError(f"--chat-template {value}: SGLang's JSON conversation templates "
                                 f"are not supported yet; pass a Jinja file")
            with open(path, encoding="utf-8") as f:
                return f.read()
        if "{{" in value or "{%" in value:
            return value
        raise ValueError(f"--chat-template takes the path of a Jinja file or Jinja text; {value!r} "
                         f"is neither (SGLang's built-in template names are not supported yet)")

    def resolved_rerank_token_ids(self) -> Optional[Tuple[int, int]]:
        """--rerank-token-ids as (yes id, no id), None when not given; ValueError naming the
        flag for anything but two different non-negative integers."""
        if self.rerank_token_ids is None:
            return None
        parts = [p.strip() for p in str(self.rerank_token_ids).split(",")]
        if len(parts) != 2 or not all(p.isdigit() for p in parts) or parts[0] == parts[1]:
            raise ValueError(f"--rerank-token-ids takes two different token ids as YES,NO "
                             f"(e.g. 9693,2152), not {self.rerank_token_ids!r}")
        return int(parts[0]), int(parts[1])

    def spec_draft_rows(self) -> int:
        """Draft positions a verify step may hold at most (0 without speculation): the
        runner's spare req_to_token rows, one per draft position (model/runner.py)."""
        if self.speculative_algorithm is None:
            return 0
        return SPEC_MAX_BATCH * (self.speculative_num_draft_tokens - 1)

    def check(self) -> None:
        """Raise ValueError naming the flag to change."""
        if self.schedule_policy not in ("fcfs", "lpm"):
            raise ValueError(f"--schedule-policy must be fcfs or lpm, not {self.schedule_policy!r}")
        if self.priority_scheduling_preemption_threshold < 0:
            raise ValueError(f"--priority-scheduling-preemption-threshold must be >= 0 (a "
                             f"negative one lets requests of equal priority retract each other "
                             f"in turn), not {self.priority_scheduling_preemption_threshold}")
        if not self.enable_priority_scheduling:
            given = [flag for flag, on in (
                ("--schedule-low-priority-values-first", self.schedule_low_priority_values_first),
                ("--disable-priority-preemption", self.disable_priority_preemption),
                ("--default-priority-value", self.default_priority_value is not None)) if on]
            if given:
                logger.warning("%s has no effect without --enable-priority-scheduling",
                               ", ".join(given))
        if self.step_order not in ("alternate", "prefill-first"):
            raise ValueError(f"--step-order must be alternate or prefill-first, not "
                             f"{self.step_order!r}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"--load-format must be auto, safetensors or dummy, not {self.load_format!r}")
        if self.dtype not in ("auto", "float32", "float", "bfloat16", "float16", "half"):
            raise ValueError(f"--dtype {self.dtype!r} is not supported")
        if self.kv_cache_dtype not in ("auto", "fp8_e4m3", "fp8_e5m2"):
            raise ValueError(f"--kv-cache-dtype must be auto, fp8_e4m3 or fp8_e5m2, not "
                             f"{self.kv_cache_dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATION_METHODS)}, "
                             f"not {self.quantization!r}")
        if self.page_size < 1:
            raise ValueError("--page-size must be >= 1")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError("--mem-fraction-static must be in (0, 1)")
        if self.tp_size < 1:
            raise ValueError(f"--tp-size must be >= 1, not {self.tp_size}")
        if self.tp_size > 1 and self.resolved_device().startswith("cuda"):
            have = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if self.tp_size > have:
                raise ValueError(f"--tp-size {self.tp_size} needs {self.tp_size} GPUs (one per "
                                 f"rank); this host has {have}")
        if self.engine_process is True and self.enable_dashboard:
            raise ValueError("--enable-dashboard reads the engine's radix tree in this process, "
                             "so it does not run with --engine-process; drop one of the two")
        if self.dp_size < 1:
            raise ValueError(f"--dp-size must be >= 1, not {self.dp_size}")
        if self.dp_size > 1 and self.resolved_device().startswith("cuda"):
            have = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if self.dp_size * self.tp_size > have:
                raise ValueError(f"--dp-size {self.dp_size} x --tp-size {self.tp_size} needs "
                                 f"{self.dp_size * self.tp_size} GPUs (one replica per "
                                 f"{'GPU' if self.tp_size == 1 else f'{self.tp_size} GPUs'}); "
                                 f"this host has {have}")
        if self.enable_dashboard and self.dp_size > 1:
            raise ValueError("--enable-dashboard shows one server's cache: with --dp-size "
                             f"{self.dp_size} the gateway in front does not route /dashboard; "
                             "drop one of the two flags")
        if self.router_policy not in ("cache_aware", "round_robin", "power_of_two", "random"):
            raise ValueError(f"--router-policy must be cache_aware, round_robin, power_of_two or "
                             f"random, not {self.router_policy!r}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                             f"not {self.tool_call_parser!r}")
        if self.grammar_backend != "xgrammar":
            raise ValueError(f"--grammar-backend must be xgrammar, not {self.grammar_backend!r}")
        if self.stream_interval < 1:
            raise ValueError("--stream-interval must be >= 1 token")
        if self.pooling_method not in ("auto", "last", "mean"):
            raise ValueError(f"--pooling-method must be auto, last or mean, not "
                             f"{self.pooling_method!r}")
        if self.rerank_template not in ("qwen3", "concat"):
            raise ValueError(f"--rerank-template must be qwen3 or concat, not "
                             f"{self.rerank_template!r}")
        self.resolved_rerank_token_ids()
        if self.kv_events_config is not None:
            from radixserve.cache.kv_events import KVEventsConfig
            events = KVEventsConfig.parse(self.kv_events_config)
            if events.enabled and self.disable_radix_cache:
                raise ValueError("--kv-events-config publishes the radix cache's blocks: drop "
                                 "--disable-radix-cache")
            if events.enabled and events.resolved_block_size(self.page_size) % self.page_size:
                raise ValueError(f"--kv-events-config: block_size {events.block_size} must be a "
                                 f"multiple of --page-size {self.page_size}")
        template = self.resolved_chat_template()
        if template is not None:
            from radixserve.tokenizer.chat_template import ChatTemplate
            try:
                ChatTemplate(template)
            except ValueError as e:
                raise ValueError(f"--chat-template: {e}") from None
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
        if self.speculative_algorithm is not None:
            if self.speculative_algorithm not in SPECULATIVE_ALGORITHMS:
                raise ValueError(f"--speculative-algorithm must be one of "
                                 f"{', '.join(SPECULATIVE_ALGORITHMS)}, not "
                                 f"{self.speculative_algorithm!r}")
            if self.tp_size > 1:
                raise ValueError("--speculative-algorithm with --tp-size > 1 is not implemented "
                                 "yet (a verify step's draft rows live on one device)")
            if not 2 <= self.speculative_num_draft_tokens <= SPEC_MAX_DRAFT_TOKENS:
                raise ValueError(f"--speculative-num-draft-tokens must be in [2, "
                                 f"{SPEC_MAX_DRAFT_TOKENS}] (the last token plus 1 to "
                                 f"{SPEC_MAX_DRAFT_TOKENS - 1} draft tokens; the runner keeps "
                                 f"a req_to_token row per draft position), not "
                                 f"{self.speculative_num_draft_tokens}")
            lo = self.speculative_ngram_min_match_window_size
            hi = self.speculative_ngram_max_match_window_size
            if lo < 1 or hi < lo:
                raise ValueError(f"--speculative-ngram-min-match-window-size ({lo}) must be >= 1 "
                                 f"and <= --speculative-ngram-max-match-window-size ({hi})")
        # security (server/)
        given = [self.api_key] if isinstance(self.api_key, str) else list(self.api_key or [])
        if any(not k.strip() for k in given):
            raise ValueError("--api-key must not be empty (leave it out to serve without a key)")
        if self.admin_api_key is not None and not self.admin_api_key.strip():
            raise ValueError("--admin-api-key must not be empty (leave it out for none)")
        if self.api_key_file is not None and not self.api_key_file_entries():
            raise ValueError(f"--api-key-file {self.api_key_file} holds no key")
        if self.resolved_admin_api_key() in {k for k, _ in self.resolved_api_keys()}:
            raise ValueError("--admin-api-key must differ from every client key (--api-key, "
                             "--api-key-file)")
        self.knob_overrides()
        if self.tokenizer_worker_num < 1:
            raise ValueError("--tokenizer-worker-num must be >= 1")
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
        """Every field as --field-name (plus its aliases), with its help, choices and default from
        the field's metadata, in --help sections; then REFUSED_SGLANG_FLAGS, refused by name."""
        group: Any = parser
        for f in dataclasses.fields(ServerArgs):
            meta = f.metadata
            if meta.get("group"):
                group = parser.add_argument_group(meta["group"])
            flags = ["--" + f.name.replace("_", "-"), *meta.get("aliases", ())]
            kw: Dict[str, Any] = {"dest": f.name, "default": f.default,
                                  "help": meta["help"].replace("%", "%%")}
            if f.type in ("bool", bool):     # on by default: --no-<flag> turns it off
                group.add_argument(*flags, action=argparse.BooleanOptionalAction if f.default
                                   else "store_true", **kw)
                continue
            if f.type in ("Optional[bool]", Optional[bool]) and not meta.get("type"):
                # None: decided at start (resolved_*); --flag / --no-flag decide
                group.add_argument(*flags, action=argparse.BooleanOptionalAction, **kw)
                continue
            hidden = meta.get("hidden", False)
            if meta.get("repeat"):
                kw["action"] = "append"
            kw["type"] = meta.get("type") or {
                "int": int, "float": float, "str": str, "Optional[int]": int,
                "Optional[float]": float, "Optional[str]": str}[str(f.type)]
            if meta.get("choices") is not None:
                kw["choices"] = meta["choices"]
            elif meta.get("metavar"):
                kw["metavar"] = meta["metavar"]
            action = group.add_argument(*flags, **kw)
            action.hidden = hidden        # HelpFormatter leaves it out of --help
        for flag, reason in REFUSED_SGLANG_FLAGS.items():
            parser.add_argument(flag, action=RefusedFlag, reason=reason)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "ServerArgs":
        return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})


# Multimodal checkpoints whose text model is served alone (as SGLang and vLLM serve it for
# text-only prompts): config.json nests the text model's config under "text_config", and the hub
# files keep there only what differs from transformers' text config class defaults (gemma-3-4b's
# lists 6 keys), so those defaults are filled in here. Gemma 3's are transformers'
# Gemma3TextConfig defaults (gemma-3-4b's head count, head_dim, vocabulary and context come from
# them). The rope keys among them apply only where text_config has no rope_parameters (the form
# transformers 5 writes, which holds them). model/gemma3.py maps the weights' names.
_TEXT_CONFIG_DEFAULTS: Dict[str, Dict[str, Any]] = {
    "Gemma3ForConditionalGeneration": {
        "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
        "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "pad_token_id": 0,
        "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": True,
        "attention_bias": False, "query_pre_attn_scalar": 256, "sliding_window": 4096,
        "sliding_window_pattern": 6, "final_logit_softcapping": None,
        "attn_logit_softcapping": None, "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
    },
}
_ROPE_KEYS = ("rope_theta", "rope_local_base_freq", "rope_scaling")
# keys of the outer config that speak for the whole checkpoint: they win over text_config's
_OUTER_KEYS = ("architectures", "model_type", "eos_token_id", "bos_token_id", "pad_token_id",
               "tie_word_embeddings", "quantization_config", "compression_config", "dtype",
               "torch_dtype")


def text_model_config(cfg: dict) -> dict:
    """config.json as the text model reads it. A multimodal checkpoint whose text model is
    served (its architecture in _TEXT_CONFIG_DEFAULTS): text_config's keys over the text config
    class's defaults, with the outer config's _OUTER_KEYS (the architecture, the EOS ids of
    gemma-3-*-it: [1, 106], tie_word_embeddings, quantization_config) over those; the vision
    keys (vision_config, mm_tokens_per_image, image_token_index...) are dropped. Any other
    config: itself. The result is a new dict; cfg is not changed."""
    arch = (cfg.get("architectures") or [None])[0]
    defaults = _TEXT_CONFIG_DEFAULTS.get(arch)
    if defaults is None:
        return cfg
    text = cfg.get("text_config") or {}
    if not isinstance(text, dict):
        raise ValueError(f"{arch} config.json: text_config must be an object, got "
                         f"{type(text).__name__}")
    if "rope_parameters" in text:
        defaults = {k: v for k, v in defaults.items() if k not in _ROPE_KEYS}
    flat = {**defaults, **text}
    flat.update({k: cfg[k] for k in _OUTER_KEYS if k in cfg})
    return flat


# config.json fields every model config must carry (ModelConfig.from_dict)
_REQUIRED_CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                         "num_attention_heads")


@dataclass
class ModelConfig:
    """The model facts the runtime needs, read from an HF config.json (for a multimodal
    checkpoint whose text model is served, its text part: text_model_config)."""
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
        cfg = text_model_config(cfg)
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        missing = [k for k in _REQUIRED_CONFIG_KEYS if not isinstance(cfg.get(k), int)]
        if missing:     # a multimodal wrapper we do not unwrap (Llava ...), an encoder, ...
            raise ValueError(f"config.json ({arch}) has no integer {', '.join(missing)}: it is "
                             f"not a decoder-only text model config radixserve can read (it "
                             f"serves the Llama, Mistral, Qwen2/3, Phi-3 and Gemma 2/3 families, "
                             f"and Gemma 3's multimodal checkpoints as text models)")
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        rope_params = cfg.get("rope_parameters") or {}
        if isinstance(rope_params.get("full_attention"), dict):
            # per layer type (Gemma 3 as transformers 5 writes it): the global layers' rope is
            # the model's; model/gemma3.py reads the local layers' own
            rope_params = rope_params["full_attention"]
        rope_scaling = cfg.get("rope_scaling")
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = rope_params
        rope_theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        if rope_scaling and (rope_scaling.get("rope_type") or rope_scaling.get("type")) == "yarn" \
                and not rope_scaling.get("original_max_position_embeddings"):
            # as HF reads it: yarn's pretraining length defaults to max_position_embeddings
            rope_scaling = {**rope_scaling, "original_max_position_embeddings":
                            cfg.get("max_position_embeddings", 4096)}
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
            # HF's Gemma configs tie the LM head to the embedding unless they say otherwise
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch.startswith("Gemma"))),
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            hf_config=cfg,
        )

    @property
    def max_context(self) -> int:
        """Positions the model's rope table covers: max_position_embeddings, or what yarn rope
        scaling extends the pretraining length to (original_max_position_embeddings x factor),
        whichever is larger. The default --context-length, and its upper bound."""
        rs = self.rope_scaling or {}
        if (rs.get("rope_type") or rs.get("type")) == "yarn" and rs.get("factor"):
            original = rs.get("original_max_position_embeddings") or self.max_position_embeddings
            return max(self.max_position_embeddings, int(original * float(rs["factor"])))
        return self.max_position_embeddings

    @classmethod
    def from_path(cls, model_path: str) -> "ModelConfig":
        with open(os.path.join(model_path, "config.json")) as f:
            return cls.from_dict(json.load(f))
