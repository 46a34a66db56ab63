"""How `radixserve bench serving` streams one request, per --backend:

  generate     POST /generate (SGLang's native API: radixserve, SGLang), input_ids; counts from
               meta_info (prompt_tokens, completion_tokens, cached_tokens); the output ids are
               kept (the multi-turn dataset replays them)
  completions  POST /v1/completions (any OpenAI-compatible server: radixserve, SGLang, vLLM),
               the prompt as a token-id array
  chat         POST /v1/chat/completions, the prompt as text (one user message)

The two OpenAI routes ask for stream_options.include_usage and take the counts from the final
usage chunk (cached tokens from usage.prompt_tokens_details.cached_tokens when present); without
usage, the output length is the number of chunks that carried text (a lower bound). Every
request is greedy (temperature 0) and, unless ignore_eos is False, asks for exactly output_len
tokens (`ignore_eos`, which SGLang, vLLM and radixserve accept). TTFT is the time to the first
chunk with new tokens (for a request that produced none, e.g. output_len 0, its latency; SGLang's
client records 0.0 there), ITL the gaps between such chunks, latency the time to the last byte.
output_len 0 is sent as is (max_new_tokens / max_tokens 0, as SGLang's client sends it):
radixserve and SGLang answer with no tokens and finish reason "length" after the prefill.

A request fails (RequestResult.failure, one of FAILURES, and .error, the message) when:
  http_status   the answer's HTTP status is not 2xx
  error         an error chunk ({"error": ...}: how radixserve's OpenAI routes report an engine
                abort or failure once streaming) or finish reason "error"
  abort         finish reason "abort" (/generate: meta_info.finish_reason.type; OpenAI routes:
                choices[].finish_reason)
  truncated     the stream ended (the connection closed, or [DONE] came) without a finish reason
  short_output  under ignore_eos, fewer output tokens than asked (judged only when the server
                counted them: /generate's meta_info, the OpenAI usage chunk)
  transport     the connection failed or timed out, or a chunk was not JSON
"""
from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import aiohttp
import orjson

from radixserve.bench.workloads import BenchRequest

FAILURES = ("http_status", "error", "abort", "truncated", "short_output", "transport")


@dataclass
class RequestResult:
    success: bool = False
    failure: str = ""                       # why it failed: one of FAILURES ("" when success)
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    cached_tokens: int = 0
    ttft: float = 0.0                       # seconds to the first output token
    latency: float = 0.0                    # seconds to the last byte
    itl: List[float] = field(default_factory=list)   # gaps between chunks carrying new tokens
    output_ids: List[int] = field(default_factory=list)
    num_chunks: int = 0                     # chunks that carried new tokens
    start: float = 0.0                      # time.perf_counter() when the request was sent


def auth_headers() -> Dict[str, str]:
    """Authorization: Bearer $OPENAI_API_KEY when that is set (as SGLang's bench_serving does)."""
    key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


class Generate:
    path = "/generate"

    def payload(self, req: BenchRequest, model: str, ignore_eos: bool) -> Dict:
        return {"input_ids": req.prompt_ids, "stream": True,
                "sampling_params": {"max_new_tokens": req.output_len, "temperature": 0.0,
                                    "ignore_eos": ignore_eos}}

    def on_chunk(self, chunk: Dict, res: RequestResult, state: Dict) -> bool:
        """Record chunk; True when it carries new tokens (output_ids are cumulative)."""
        state["meta"] = chunk.get("meta_info") or state.get("meta") or {}
        ids = chunk.get("output_ids") or []
        if len(ids) <= len(res.output_ids):
            return False
        res.output_ids = ids      # a fresh list per parsed chunk: kept, not copied
        return True

    def finish_reason(self, chunk: Dict) -> Any:
        """meta_info.finish_reason ({"type": "length" | "stop" | "abort", ...}; None while the
        request runs)."""
        return (chunk.get("meta_info") or {}).get("finish_reason")

    def finish(self, res: RequestResult, state: Dict) -> bool:
        """Set res's counts from the last meta_info; True when the server counted the output."""
        meta = state.get("meta") or {}
        res.prompt_len = meta.get("prompt_tokens", res.prompt_len)
        res.output_len = meta.get("completion_tokens", len(res.output_ids))
        res.cached_tokens = meta.get("cached_tokens", 0) or 0
        return "completion_tokens" in meta


class Completions:
    path = "/v1/completions"

    def prompt_fields(self, req: BenchRequest) -> Dict:
        return {"prompt": req.prompt_ids}

    def payload(self, req: BenchRequest, model: str, ignore_eos: bool) -> Dict:
        return {"model": model, **self.prompt_fields(req), "max_tokens": req.output_len,
                "temperature": 0.0, "ignore_eos": ignore_eos, "stream": True,
                "stream_options": {"include_usage": True}}

    def has_tokens(self, choice: Dict) -> bool:
        return bool(choice.get("text"))

    def on_chunk(self, chunk: Dict, res: RequestResult, state: Dict) -> bool:
        if chunk.get("usage"):
            state["usage"] = chunk["usage"]
        return any(self.has_tokens(c) for c in chunk.get("choices") or [])

    def finish_reason(self, chunk: Dict) -> Any:
        """The first non-null choices[].finish_reason ("stop", "length", "abort", ...)."""
        return next((c["finish_reason"] for c in chunk.get("choices") or []
                     if c.get("finish_reason")), None)

    def finish(self, res: RequestResult, state: Dict) -> bool:
        """Set res's counts from the usage chunk (else the chunks with text, a lower bound);
        True when the server counted the output."""
        usage = state.get("usage") or {}
        res.prompt_len = usage.get("prompt_tokens", res.prompt_len)
        res.output_len = usage.get("completion_tokens", res.num_chunks)
        res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return "completion_tokens" in usage


class Chat(Completions):
    path = "/v1/chat/completions"

    def prompt_fields(self, req: BenchRequest) -> Dict:
        return {"messages": [{"role": "user", "content": req.prompt_text}]}

    def has_tokens(self, choice: Dict) -> bool:
        return bool((choice.get("delta") or {}).get("content"))


BACKENDS = {"generate": Generate(), "completions": Completions(), "chat": Chat()}


def _sse_data(line: bytes) -> Optional[bytes]:
    """The payload of an SSE `data:` line; None for any other line."""
    if not line.startswith(b"data:"):
        return None
    return line[5:].strip()


def session(timeout: float) -> aiohttp.ClientSession:
    """The HTTP session a run streams its requests through: no cap on connections (the Runner's
    semaphore is the concurrency limit), `timeout` seconds to connect and between reads.

    aiohttp, as SGLang's bench_serving uses, and not httpx: at ~10k streamed chunks a second
    the client's own CPU is the limit. Per chunk the whole client took ~117 us of CPU with
    httpx's stack (httpcore, anyio, h11) and stdlib json, ~35 us with aiohttp on uvloop and
    orjson (2-core CPU, 128 streams of 256 tokens over /generate: bench/README.md). The
    cumulative output ids SGLang's native route sends make a chunk grow with the output, so
    the parser's speed matters more the longer the outputs."""
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout),
        connector=aiohttp.TCPConnector(limit=0))


async def _read(resp, backend, res: RequestResult, state: Dict, start: float) -> bool:
    """Consume resp's SSE stream (an aiohttp response) into res (TTFT, ITL, chunk count) and
    state (state["finish"]: the last finish reason seen, raw; state["done"]: [DONE] came);
    False after an error chunk (res.error set). Lines are split here, not by the reader, so no
    line length limit applies (a chunk of cumulative output ids grows with the output); the
    time of a chunk is when the bytes that end it arrived."""
    last = start
    pending = b""
    async for block in resp.content.iter_any():
        now = time.perf_counter()
        *lines, pending = (pending + block).split(b"\n")
        for line in lines:
            data = _sse_data(line)
            if data is None:
                continue
            if data == b"[DONE]":
                state["done"] = True
                return True
            chunk = orjson.loads(data)
            if "error" in chunk:
                res.error = str(chunk["error"])[:300]
                return False
            state["finish"] = backend.finish_reason(chunk) or state.get("finish")
            if backend.on_chunk(chunk, res, state):
                if res.num_chunks == 0:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                res.num_chunks += 1
                last = now
    return True


def _finish_type(reason: Any) -> str:
    """A finish reason as its type: "length", "stop", "abort", "error", ..."""
    return str(reason.get("type") if isinstance(reason, dict) else reason)


def judge(res: RequestResult, state: Dict, asked: int, ignore_eos: bool, counted: bool) -> None:
    """After a stream that ended cleanly: res.failure (module doc) and res.error when the
    finish reason is missing, an abort or an error, or (ignore_eos, counted) when res has
    fewer than asked output tokens; else res.success."""
    reason = state.get("finish")
    kind = _finish_type(reason) if reason else None
    if kind is None:
        res.failure = "truncated"
        res.error = "the stream ended without a finish reason" + (
            "" if state.get("done") else " (closed before [DONE])")
    elif kind in ("abort", "error"):
        res.failure, res.error = kind, f"finish reason {str(reason)[:300]}"
    elif ignore_eos and counted and res.output_len < asked:
        res.failure = "short_output"
        res.error = (f"{res.output_len} of the {asked} output tokens asked (ignore_eos), "
                     f"finish reason {str(reason)[:200]}")
    else:
        res.success = True


async def send(client: aiohttp.ClientSession, base_url: str, backend_name: str,
               req: BenchRequest, model: str, ignore_eos: bool) -> RequestResult:
    """Stream req through backend_name's route (client: session()). Never raises for a failed
    request: the result has success False, the failure (module doc) and the error (HTTP status
    and body, the error chunk, the finish reason, the transport error)."""
    backend = BACKENDS[backend_name]
    res = RequestResult(prompt_len=len(req.prompt_ids))
    state: Dict = {}
    body = orjson.dumps(backend.payload(req, model, ignore_eos))
    headers = {"Content-Type": "application/json", **auth_headers()}
    start = res.start = time.perf_counter()
    try:
        async with client.post(base_url + backend.path, data=body, headers=headers) as resp:
            if not 200 <= resp.status < 300:
                text = (await resp.read()).decode(errors="replace")
                res.failure, res.error = "http_status", f"HTTP {resp.status}: {text[:300]}"
                return res
            if not await _read(resp, backend, res, state, start):
                res.failure = "error"
                return res
    except aiohttp.ClientPayloadError as e:          # the body was cut off mid-transfer
        res.failure, res.error = "truncated", f"{type(e).__name__}: {e}"
        return res
    except (aiohttp.ClientError, asyncio.TimeoutError, orjson.JSONDecodeError) as e:
        res.failure, res.error = "transport", f"{type(e).__name__}: {e}"
        return res
    res.latency = time.perf_counter() - start
    counted = backend.finish(res, state)
    if res.num_chunks == 0:
        res.ttft = res.latency
    judge(res, state, req.output_len, ignore_eos, counted)
    return res
