"""Native (SGLang-style) routes: /generate, /health, /health_generate, /get_model_info (and its
alias /model_info), /get_server_info (alias /server_info), /v1/loads and /get_load, /flush_cache,
/abort_request, /metrics.

The worker surface a gateway in front of several servers reads (SGLang's model gateway, `smg`;
`radixserve serve --dp-size N` runs one, radixserve/replicas.py), as its source reads it
(smg-project/smg, model_gateway/src): registration probes `/health` (2xx, no key), then
`/v1/models` (`owned_by`; ours is not an engine it knows) and `/version` (vLLM's; we have none,
404) and `/server_info` (200: the worker is SGLang-compatible), then reads `/server_info` and
`/model_info` (falling back to `/get_server_info` / `/get_model_info` on 404) into typed structs
(workflow/steps/local/discover_metadata.rs: ServerInfo, ModelInfo; one field of the wrong type
drops the whole struct); its load monitor polls `/v1/loads?include=core,disagg,queues,memory`
(worker/monitor.rs; WorkerLoadResponse in crates/protocols/src/worker.rs: a string timestamp,
integer counts), falling back to `/metrics` gauges for SGLang workers; health checks poll
`/health` (worker/worker.rs)."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import AsyncIterator, List, Optional

from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from radixserve.engine.io import GenerateReqInput, expand_requests
from radixserve.engine.pooling import PoolParams
from radixserve.errors import ApiError, bad_request
from radixserve.sampling.params import SamplingParams
from radixserve.server import render as O
from radixserve.server import requests as R
from radixserve.server.generation import (ClientDisconnected, check_grammars, collect,
                                          encode_prompt, merge_generations, validate_all)
from radixserve.server.jsonio import JSONResponse, error_response
from radixserve.server.metrics import MetricsRegistry, RequestMetrics, request_metrics
from radixserve.server.security import read_json_object, redact_server_info
from radixserve.server.sse import DONE_EVENT, EventStreamResponse, encode_event

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 20.0


# --------------------------------------------------------------------------- /generate

@dataclass
class NativeJob:
    """One validated /generate body, ready to run: its sequences (prompts x n, in order), the
    prompt of each, whether each returns logprobs, and the shape of the answer."""
    reqs: List[GenerateReqInput]
    seq_prompts: List[List[int]]
    return_logprob: List[bool]
    many: bool            # a batch or n > 1: the answer is a list (streams add "index")
    stream: bool


async def prepare_generate(engine, body: dict) -> NativeJob:
    """Parse, tokenize and validate a /generate body and compile its grammars; nothing runs
    yet. Bad input raises ApiError (a 4xx naming the field)."""
    req = R.parse_generate_request(body)
    prompt_param = "text" if body.get("text") is not None else "input_ids"
    prompt_ids = [await encode_prompt(engine, p, prompt_param) if isinstance(p, str)
                  else p for p in req.prompts]
    for ids, sp in zip(prompt_ids, req.sampling):
        R.check_prompt_ids(ids, engine.model_config.vocab_size, engine.context_len,
                           sp.max_new_tokens, prompt_param, "max_new_tokens")
    # every prompt of a batch takes the same n (SGLang's rule): the first prompt's
    n = req.sampling[0].n
    if any(sp.n != n for sp in req.sampling):
        raise bad_request("every prompt of a batch must use the same n", param="sampling_params")
    rid = uuid.uuid4().hex
    reqs = expand_requests(rid, prompt_ids, n, req.sampling, req.stream, req.return_logprob,
                           req.logprob_start_len, req.top_logprobs_num,
                           req.return_text_in_logprobs, rids=req.rids,
                           cache_salts=req.cache_salts, priority=req.priority)
    validate_all(engine, reqs)
    await check_grammars(engine, reqs, body.get("sampling_params") if isinstance(
        body.get("sampling_params"), dict) else None, prefix="sampling_params.")
    return NativeJob(reqs, [prompt_ids[i // n] for i in range(len(reqs))],
                     [req.return_logprob[i // n] for i in range(len(reqs))],
                     req.is_batch or n > 1, req.stream)


async def run_generate(engine, job: NativeJob, receive=None,
                       metrics: Optional[RequestMetrics] = None):
    """Run a non-streamed job to its end: /generate's JSON answer (a dict, or a list of them).
    With `receive`, a client disconnect aborts it and raises ClientDisconnected."""
    results = [O.SeqResult(i, job.seq_prompts[i]) for i in range(len(job.reqs))]
    await collect(engine, job.reqs, results, receive, metrics)
    out = [O.native_result(r, job.reqs[r.index].rid, job.return_logprob[r.index])
           for r in results]
    return out if job.many else out[0]


async def generate_chunks(engine, job: NativeJob,
                          metrics: Optional[RequestMetrics] = None) -> AsyncIterator[dict]:
    """A streamed job's chunks, each with the CUMULATIVE text and output ids so far of one
    sequence (SGLang's native streaming); batches add "index". Engine errors propagate; closing
    the iterator aborts the unfinished sequences."""
    results = [O.SeqResult(i, job.seq_prompts[i]) for i in range(len(job.reqs))]
    gen = merge_generations(engine, job.reqs, metrics)
    try:
        async for i, out in gen:
            results[i].feed(out)
            chunk = O.native_result(results[i], job.reqs[i].rid, job.return_logprob[i])
            if job.many:
                chunk["index"] = i
            yield chunk
    finally:
        await gen.aclose()


async def generate(request: Request, engine) -> Response:
    job = await prepare_generate(engine, await read_json_object(request))
    if job.stream:
        return EventStreamResponse(_generate_events(engine, job, request_metrics(request)))
    try:
        out = await run_generate(engine, job, request.receive, request_metrics(request))
    except ClientDisconnected:
        return Response(status_code=499)
    return JSONResponse(out)


async def _generate_events(engine, job: NativeJob,
                           metrics: Optional[RequestMetrics] = None) -> AsyncIterator[bytes]:
    """generate_chunks as SSE events. Errors become an error event; [DONE] ends the stream."""
    chunks = generate_chunks(engine, job, metrics)
    try:
        async for chunk in chunks:
            yield encode_event(chunk)
    except ApiError as e:
        yield encode_event(e.body())
    except Exception as e:  # noqa: BLE001 - the headers are out; tell the client in-band
        logger.exception("error while streaming /generate")
        yield encode_event(ApiError(f"internal server error: {type(e).__name__}: {e}", 500).body())
    finally:
        await chunks.aclose()
    yield DONE_EVENT


# --------------------------------------------------------------------------- health and info

async def health(request: Request, engine) -> Response:
    """200 with an empty body while the engine's loop task is alive, 503 once it died or while
    the server drains for shutdown (so a gateway's health check or a readiness probe stops
    sending it new requests, which it would refuse with 503); never waits on the model."""
    ok = engine.is_healthy() and getattr(engine, "_draining", False) is not True
    return Response(status_code=200 if ok else 503)


async def health_generate(request: Request, engine) -> Response:
    """200 once a one-token generation completes (proves the model runs), 503 otherwise."""
    ids = engine.tokenizer.encode("hi", add_special_tokens=False) or [0]
    req = GenerateReqInput(rid=f"health-{uuid.uuid4().hex}", input_ids=ids[:1],
                           sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0))
    if getattr(engine.server_args, "is_embedding", False):     # a pooling request instead
        req.sampling_params = SamplingParams(max_new_tokens=0, temperature=0.0)
        req.pool = PoolParams(method=getattr(engine, "pooling_method", None) or "last")
    results = [O.SeqResult(0, req.input_ids)]
    try:
        # not through validate_all (no queue-capacity refusal): the engine validates it
        await asyncio.wait_for(collect(engine, [req], results, validated=False),
                               HEALTH_GENERATE_TIMEOUT_S)
    except asyncio.TimeoutError:
        return error_response(ApiError("the engine did not generate a token within "
                                       f"{HEALTH_GENERATE_TIMEOUT_S:.0f} s", 503))
    return Response(status_code=200 if results[0].finished else 503)


async def get_model_info(request: Request, engine) -> Response:
    """/get_model_info and its alias /model_info (the name SGLang's model gateway asks first)."""
    return JSONResponse(model_info(engine))


def model_info(engine) -> dict:
    """The /get_model_info answer for engine. model_path and tokenizer_path are filesystem
    paths only with --expose-server-info; otherwise both are the served model's name (SGLang
    clients read model_path for the model's name, to guess its chat format)."""
    args = engine.server_args
    expose = args.expose_server_info
    return {
        "model_path": engine.model_path if expose else engine.served_model_name,
        "tokenizer_path": (args.tokenizer_path or engine.model_path) if expose
        else engine.served_model_name,
        "served_model_name": engine.served_model_name,
        "is_generation": not getattr(args, "is_embedding", False),
        "architecture": engine.model_config.architecture,
        # SGLang's names, as the model gateway reads them (discover_metadata.rs, ModelInfo)
        "architectures": [engine.model_config.architecture],
        "model_type": (getattr(engine.model_config, "hf_config", None) or {}).get("model_type"),
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "context_len": engine.context_len,
        "vocab_size": engine.model_config.vocab_size,
        # what a frontend-language client (radixserve.lang.RuntimeEndpoint) renders roles with
        **chat_template_info(engine.tokenizer),
    }


def chat_template_info(tokenizer) -> dict:
    """The chat template fields of /get_model_info: its name ("chatml", "llama-3-instruct",
    "custom" or None), its jinja source, the special tokens it sees, and whether the tokenizer
    adds BOS itself."""
    from radixserve.tokenizer.roles import template_name
    source = tokenizer.chat_template_text
    special = {k: v for k, v in tokenizer.special_tokens.items() if isinstance(v, str)}
    return {"chat_template_name": template_name(source), "chat_template": source,
            "special_tokens": special, "adds_bos_token": tokenizer.adds_bos_token}


async def get_server_info(request: Request, engine) -> Response:
    """/get_server_info and its alias /server_info: server_info_body without secrets and,
    unless --expose-server-info, without filesystem paths (security.redact_server_info)."""
    expose = request.app.state.door_policy.expose_server_info
    return JSONResponse(redact_server_info(server_info_body(engine), expose_paths=expose))


def server_info_body(engine) -> dict:
    """engine.server_info() in the shape SGLang's model gateway deserializes (ServerInfo of
    discover_metadata.rs, where a field of another type drops the whole answer): the model's
    shape moves from "model" (which the gateway reads as a string alias of model_id) to
    "model_config"; dp_size is this server's own (1: each replica of --dp-size is a server of
    one); context_length is the effective context; pp_size 1, is_embedding (--is-embedding),
    disaggregation_mode "null" as SGLang reports them."""
    info = dict(engine.server_info())
    if isinstance(info.get("model"), dict):
        info["model_config"] = info.pop("model")
    info.update(dp_size=1, pp_size=1,
                is_embedding=bool(getattr(engine.server_args, "is_embedding", False)),
                disaggregation_mode="null",
                context_length=engine.context_len, served_model_name=engine.served_model_name)
    return info


# --------------------------------------------------------------------------- loads

LOAD_SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues", "all")


def load_snapshot(engine, include=("all",)) -> dict:
    """This server's one scheduler as one DP rank of SGLang's /v1/loads (GetLoadsReqOutput):
    integer counts, ratios as floats. num_waiting_uncached_tokens is the engine's
    `num_waiting_uncached_tokens` metric when it reports one, else 0 (the gateway then
    estimates the queue from num_waiting_reqs). `queues` is added for include "queues"/"all";
    memory, spec, lora and disagg are left out (the gateway reads them as absent)."""
    m = engine.metrics()

    def num(key, default=0):
        v = m.get(key, default)
        return v if isinstance(v, (int, float)) and not isinstance(v, bool) else default

    running, waiting = int(num("num_running_reqs")), int(num("num_waiting_reqs"))
    used, capacity = int(num("num_used_tokens")), int(num("max_total_tokens"))
    prompt, cached = num("prompt_tokens"), num("cached_tokens")
    sched = getattr(engine, "scheduler", None)
    max_running = getattr(sched, "max_running_requests", None) \
        or engine.server_args.max_running_requests or 0
    snap = {
        "dp_rank": 0, "timestamp": time.time(),
        "num_running_reqs": running, "num_waiting_reqs": waiting,
        "num_total_reqs": running + waiting,
        "num_waiting_uncached_tokens": int(num("num_waiting_uncached_tokens")),
        "num_used_tokens": used, "num_total_tokens": used, "max_total_num_tokens": capacity,
        "token_usage": float(num("token_usage", used / capacity if capacity else 0.0)),
        "gen_throughput": float(num("gen_throughput")),
        "cache_hit_rate": float(cached / prompt) if prompt else 0.0,
        "utilization": float(num("gpu_busy_fraction")),
        "max_running_requests": int(max_running),
    }
    if "queues" in include or "all" in include:
        snap["queues"] = {"waiting": waiting, "grammar": 0, "paused": 0, "retracted": 0}
    return snap


def _load_query(request: Request):
    """(include sections, dp_rank or None) of a /v1/loads query; ApiError 400 for bad ones."""
    raw = request.query_params.get("include")
    include = [s.strip() for s in raw.split(",") if s.strip()] if raw else ["all"]
    bad = sorted(set(include) - set(LOAD_SECTIONS))
    if bad:
        raise bad_request(f"include: unknown section(s) {', '.join(bad)}; valid: "
                          f"{', '.join(LOAD_SECTIONS)}", param="include")
    rank = request.query_params.get("dp_rank")
    if rank is not None and not rank.strip().lstrip("-").isdigit():
        raise bad_request(f"dp_rank must be an integer, not {rank[:40]!r}", param="dp_rank")
    fmt = request.query_params.get("format", "json")
    if fmt != "json":
        raise bad_request(f"format must be json, not {fmt[:40]!r}", param="format")
    return include, (int(rank) if rank is not None else None)


async def get_loads(request: Request, engine) -> Response:
    """GET /v1/loads (SGLang's): {timestamp (ISO 8601), version, dp_rank_count, loads: [one
    snapshot per DP rank: this server is rank 0], aggregate}. ?include=core,queues,...
    (SGLang's sections; unknown ones are a 400) and ?dp_rank=N (another rank: no loads)."""
    from radixserve.version import __version__
    include, rank = _load_query(request)
    await refresh_metrics(engine)
    loads = [] if rank not in (None, 0) else [load_snapshot(engine, include)]
    agg = {"total_running_reqs": sum(x["num_running_reqs"] for x in loads),
           "total_waiting_reqs": sum(x["num_waiting_reqs"] for x in loads),
           "total_reqs": sum(x["num_total_reqs"] for x in loads),
           "avg_token_usage": (sum(x["token_usage"] for x in loads) / len(loads)) if loads else 0.0,
           "avg_throughput": (sum(x["gen_throughput"] for x in loads) / len(loads)) if loads
           else 0.0,
           "avg_utilization": (sum(x["utilization"] for x in loads) / len(loads)) if loads
           else 0.0}
    return JSONResponse({"timestamp": datetime.now(timezone.utc).isoformat(),
                         "version": __version__, "dp_rank_count": len(loads), "loads": loads,
                         "aggregate": agg})


async def get_load(request: Request, engine) -> Response:
    """GET /get_load: SGLang's older load route (deprecated there for /v1/loads), in its shape:
    a list with one entry per DP rank, {dp_rank, num_reqs (running + waiting),
    num_waiting_reqs, num_tokens (KV tokens in use), num_pending_tokens (0: no pending
    prefill is counted), ts_tic}."""
    await refresh_metrics(engine)
    s = load_snapshot(engine, ("core",))
    return JSONResponse([{"dp_rank": 0, "num_reqs": s["num_total_reqs"],
                          "num_waiting_reqs": s["num_waiting_reqs"],
                          "num_tokens": s["num_total_tokens"],
                          "num_pending_tokens": s["num_total_tokens"] - s["num_used_tokens"],
                          "ts_tic": time.perf_counter()}])


async def flush_cache(request: Request, engine) -> Response:
    if await engine.flush_cache():
        return PlainTextResponse("Cache flushed.\n")
    return error_response(bad_request("cannot flush the cache while requests are running; "
                                      "retry when the server is idle"))


async def abort_request(request: Request, engine) -> Response:
    """Abort a live request of this client's (security.ClientView.abort), or with abort_all
    every live request of this client (ClientView.abort_all); 200 whether or not there was one
    to abort."""
    rid = R.parse_abort_request(await read_json_object(request))
    if rid is None:
        engine.abort_all()
    else:
        engine.abort(rid)
    return Response(status_code=200)


# --------------------------------------------------------------------------- /metrics

def metrics_registry(engine) -> MetricsRegistry:
    """The app's registry (server/metrics.py): the engine's counters and gauges, read at scrape
    time, and the per-request instruments (`.requests`) that --enable-metrics and
    --log-requests turn on. Raises ValueError for a bad --metrics-prefix."""
    return MetricsRegistry(engine)


async def refresh_metrics(engine) -> None:
    """Bring engine.metrics() up to date where the engine runs in another process
    (engine/client.EngineClient.refresh_metrics); an in-process engine's are always current."""
    refresh = getattr(engine, "refresh_metrics", None)
    if refresh is not None:
        await refresh()


async def metrics(request: Request, engine) -> Response:
    await refresh_metrics(engine)
    return Response(generate_latest(request.app.state.metrics_registry),
                    media_type=CONTENT_TYPE_LATEST)
