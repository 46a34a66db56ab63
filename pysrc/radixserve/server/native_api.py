"""Native (SGLang-style) routes: /generate, /health, /health_generate, /get_model_info,
/get_server_info, /flush_cache, /abort_request, /metrics."""
from __future__ import annotations

import asyncio
import logging
import re
import uuid
from typing import AsyncIterator, List, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from radixserve.engine.io import GenerateReqInput
from radixserve.sampling.params import SamplingParams
from radixserve.server import protocol as P
from radixserve.server.errors import ApiError, bad_request, error_response
from radixserve.server.generation import (ClientDisconnected, collect, expand_requests,
                                          merge_generations, validate_all)
from radixserve.server.sse import DONE_EVENT, EventStreamResponse, encode_event

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 20.0


# --------------------------------------------------------------------------- /generate

async def generate(request: Request, engine) -> Response:
    body = P.parse_json_body(await request.body())
    req = P.parse_generate_request(body)
    prompt_param = "text" if body.get("text") is not None else "input_ids"
    prompt_ids = [engine.tokenizer.encode(p) if isinstance(p, str) else p for p in req.prompts]
    for ids, sp in zip(prompt_ids, req.sampling):
        P.check_prompt_ids(ids, engine.model_config.vocab_size, engine.context_len,
                           sp.max_new_tokens, prompt_param, "max_new_tokens")
    # every prompt of a batch takes the same n (SGLang's rule): the first prompt's
    n = req.sampling[0].n
    if any(sp.n != n for sp in req.sampling):
        raise bad_request("every prompt of a batch must use the same n", param="sampling_params")
    if n > P.MAX_N:
        raise bad_request(f"n must be at most {P.MAX_N}, got {n}", param="n")
    rid = uuid.uuid4().hex
    reqs = expand_requests(rid, prompt_ids, n, req.sampling, req.stream, req.return_logprob,
                           req.logprob_start_len, req.top_logprobs_num,
                           req.return_text_in_logprobs, rids=req.rids)
    validate_all(engine, reqs)
    seq_prompts = [prompt_ids[i // n] for i in range(len(reqs))]
    return_logprob = [req.return_logprob[i // n] for i in range(len(reqs))]
    many = req.is_batch or n > 1
    if req.stream:
        return EventStreamResponse(_generate_events(engine, reqs, seq_prompts, return_logprob, many))
    results = [P.SeqResult(i, seq_prompts[i]) for i in range(len(reqs))]
    try:
        await collect(engine, reqs, results, request.receive)
    except ClientDisconnected:
        return Response(status_code=499)
    out = [P.native_result(r, reqs[r.index].rid, return_logprob[r.index]) for r in results]
    return JSONResponse(out if many else out[0])


async def _generate_events(engine, reqs: Sequence[GenerateReqInput], seq_prompts: Sequence[List[int]],
                           return_logprob: Sequence[bool], many: bool) -> AsyncIterator[bytes]:
    """Chunks with the CUMULATIVE text and output ids so far (SGLang's native streaming);
    batches add "index". Errors become an error event; [DONE] ends the stream."""
    results = [P.SeqResult(i, seq_prompts[i]) for i in range(len(reqs))]
    gen = merge_generations(engine, reqs)
    try:
        async for i, out in gen:
            results[i].feed(out)
            chunk = P.native_result(results[i], reqs[i].rid, return_logprob[i])
            if many:
                chunk["index"] = i
            yield encode_event(chunk)
    except ApiError as e:
        yield encode_event(e.body())
    except Exception as e:  # noqa: BLE001 - the headers are out; tell the client in-band
        logger.exception("error while streaming /generate")
        yield encode_event(ApiError(f"internal server error: {type(e).__name__}: {e}", 500).body())
    finally:
        await gen.aclose()
    yield DONE_EVENT


# --------------------------------------------------------------------------- health and info

async def health(request: Request, engine) -> Response:
    """200 with an empty body while the engine's loop task is alive; never waits on the model."""
    return Response(status_code=200 if engine.is_healthy() else 503)


async def health_generate(request: Request, engine) -> Response:
    """200 once a one-token generation completes (proves the model runs), 503 otherwise."""
    ids = engine.tokenizer.encode("hi", add_special_tokens=False) or [0]
    req = GenerateReqInput(rid=f"health-{uuid.uuid4().hex}", input_ids=ids[:1],
                           sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0))
    results = [P.SeqResult(0, req.input_ids)]
    try:
        await asyncio.wait_for(collect(engine, [req], results), HEALTH_GENERATE_TIMEOUT_S)
    except asyncio.TimeoutError:
        return error_response(ApiError("the engine did not generate a token within "
                                       f"{HEALTH_GENERATE_TIMEOUT_S:.0f} s", 503))
    return Response(status_code=200 if results[0].finished else 503)


async def get_model_info(request: Request, engine) -> Response:
    args = engine.server_args
    return JSONResponse({
        "model_path": engine.model_path,
        "tokenizer_path": args.tokenizer_path or engine.model_path,
        "served_model_name": engine.served_model_name,
        "is_generation": True,
        "architecture": engine.model_config.architecture,
        "context_len": engine.context_len,
        "vocab_size": engine.model_config.vocab_size,
    })


async def get_server_info(request: Request, engine) -> Response:
    return JSONResponse(engine.server_info())


async def flush_cache(request: Request, engine) -> Response:
    if await engine.flush_cache():
        return PlainTextResponse("Cache flushed.\n")
    return error_response(bad_request("cannot flush the cache while requests are running; "
                                      "retry when the server is idle"))


async def abort_request(request: Request, engine) -> Response:
    body = P.parse_json_body(await request.body())
    rid = P.get_field(body, "rid", "string")
    if not rid:
        raise bad_request("rid is required", param="rid")
    engine.abort(rid)
    return Response(status_code=200)


# --------------------------------------------------------------------------- /metrics

# engine.metrics() keys that are monotonically increasing counts (exposed as <key>_total);
# every other numeric key is a gauge.
_COUNTERS = {
    "prompt_tokens": "Prompt tokens received",
    "cached_tokens": "Prompt tokens served from the prefix cache",
    "generation_tokens": "Tokens generated",
    "num_requests": "Requests received",
    "num_finished_requests": "Requests finished",
    "num_aborted_requests": "Requests aborted",
    "num_prefill_steps": "Prefill steps run",
    "num_decode_steps": "Decode steps run",
    "num_retractions": "Running requests retracted to the queue for lack of KV slots",
}
_GAUGE_HELP = {
    "num_running_reqs": "Requests running",
    "num_waiting_reqs": "Requests waiting",
    "token_usage": "Fraction of KV slots held by requests",
    "num_used_tokens": "KV slots held by requests",
    "max_total_tokens": "KV slots in the pool",
    "evictable_tokens": "KV slots held only by the prefix cache (evictable)",
}


class EngineCollector:
    """Reads engine.metrics() at scrape time: the counter keys (and keys ending in `_total`)
    become counters `radixserve:<key>_total`, other numeric keys gauges `radixserve:<key>`,
    each with a model_name label."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        model = self.engine.served_model_name
        for key, value in sorted(self.engine.metrics().items()):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            name = "radixserve:" + re.sub(r"[^a-zA-Z0-9_:]", "_", key)
            if key in _COUNTERS or key.endswith("_total"):
                family = CounterMetricFamily(name, _COUNTERS.get(key, key.replace("_", " ")),
                                             labels=["model_name"])
            else:
                family = GaugeMetricFamily(name, _GAUGE_HELP.get(key, key.replace("_", " ")),
                                           labels=["model_name"])
            family.add_metric([model], float(value))
            yield family


def metrics_registry(engine) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine))
    return registry


async def metrics(request: Request, engine) -> Response:
    return Response(generate_latest(request.app.state.metrics_registry),
                    media_type=CONTENT_TYPE_LATEST)
