"""POST /v1/score, SGLang's scoring API for decoder models: how likely each label token is to
come next after query + item, for every item.

    {"query": "Is this review positive? ", "items": ["Great film.", "Dull."],
     "label_token_ids": [9583, 2822], "apply_softmax": true}
 -> {"object": "scoring", "model": ..., "scores": [[p_yes, p_no], [p_yes, p_no]], "usage": ...}

Each (item, label) pair is one scoring sequence, query + item + [label], run with no new token
and the prompt logprob of its last position: log P(label | query + item). The sequences of an
item share everything but their last token, so the radix cache computes query + item once per
item (and the query once for all). apply_softmax normalises over the labels (softmax of their
logits); without it the scores are the labels' probabilities over the whole vocabulary.

`model`, when given, must name the served model (else 404), as on every OpenAI route. Errors on
this path (the route's and the door's) carry OpenAI's {"error": {...}} and, at the top level,
SGLang's flat error fields, which SGLang's own clients of /v1/score read (error_response):

    {"error": {"message", "type": "invalid_request_error", "param", "code": 400},
     "object": "error", "message", "type": "BadRequestError", "param", "code": 400}
"""
from __future__ import annotations

import math
import uuid
from http import HTTPStatus
from typing import List, Optional

from starlette.requests import Request
from starlette.responses import Response

from radixserve.engine.io import GenerateReqInput
from radixserve.errors import ApiError, bad_request
from radixserve.sampling.params import SamplingParams
from radixserve.server import render as O
from radixserve.server import requests as R
from radixserve.server import schemas as S
from radixserve.server.generation import collect, encode_prompt, validate_all
from radixserve.server.jsonio import JSONResponse
from radixserve.server.metrics import request_metrics
from radixserve.server.openai_api import model_aliases
from radixserve.server.security import read_json_object


async def _item_prompts(engine, req: S.ScoreRequest) -> List[List[int]]:
    """The prompt of each item: query + item (item + query with item_first), as text joined
    then tokenized, or ids joined."""
    text = isinstance(req.query, str)
    if any(isinstance(item, str) != text for item in req.items):
        raise bad_request("query and items must all be text or all be token ids", param="items")
    prompts = []
    for item in req.items:
        if text:
            joined = item + req.query if req.item_first else req.query + item
            prompts.append(await encode_prompt(engine, joined, f"items[{len(prompts)}]"))
        else:
            prompts.append(list(item) + list(req.query) if req.item_first
                           else list(req.query) + list(item))
    return prompts


def _scores(logprobs: List[float], apply_softmax: bool) -> List[float]:
    if not apply_softmax:
        return [math.exp(lp) for lp in logprobs]
    top = max(logprobs)
    weights = [math.exp(lp - top) for lp in logprobs]
    total = sum(weights)
    return [w / total for w in weights]


def _sglang_type(status: int) -> str:
    """SGLang's error type for an HTTP status: its phrase in CamelCase + Error
    (BadRequestError, NotFoundError, InternalServerError)."""
    try:
        name = HTTPStatus(status).phrase.title().replace(" ", "").replace("-", "")
    except ValueError:
        return "BadRequestError" if status < 500 else "InternalServerError"
    return name if name.endswith("Error") else name + "Error"


def error_body(err: ApiError) -> dict:
    """err's OpenAI body plus SGLang's flat fields (the module docstring)."""
    return {**err.body(), "object": "error", "message": err.message,
            "type": _sglang_type(err.status), "param": err.param, "code": err.status}


def error_response(err: ApiError, headers: Optional[dict] = None) -> JSONResponse:
    """jsonio.error_response's counterpart for /v1/score (app.ERROR_SHAPES)."""
    merged = {**(err.headers or {}), **(headers or {})} or None
    return JSONResponse(error_body(err), status_code=err.status, headers=merged)


async def score(request: Request, engine) -> Response:
    body = await read_json_object(request)
    R.check_model(body, engine.served_model_name, model_aliases(engine))
    req = S.parse(S.ScoreRequest, body)
    vocab = engine.model_config.vocab_size
    bad = [t for t in req.label_token_ids if t >= vocab]
    if bad:
        raise bad_request(f"label_token_ids: Token ID {bad[0]} is out of vocabulary (the "
                          f"vocabulary has {vocab} tokens: ids 0 to {vocab - 1})",
                          param="label_token_ids")
    prompts = await _item_prompts(engine, req)
    labels = req.label_token_ids
    if len(prompts) * len(labels) > S.MAX_SEQUENCES:
        raise bad_request(f"items x label_token_ids is {len(prompts) * len(labels)} scoring "
                          f"sequences; at most {S.MAX_SEQUENCES} per request", param="items")
    rid = uuid.uuid4().hex
    reqs = []
    for i, ids in enumerate(prompts):
        if not ids:
            raise bad_request("query + item is empty", param=f"items[{i}]")
        R.check_prompt_ids(ids + [0], vocab, engine.context_len, 0, "items", "max_new_tokens")
        for j, label in enumerate(labels):
            reqs.append(GenerateReqInput(
                rid=f"{rid}-{i}-{j}", input_ids=ids + [label],
                sampling_params=SamplingParams(max_new_tokens=0, temperature=0.0),
                return_logprob=True, logprob_start_len=len(ids), cache_salt=req.cache_salt))
    validate_all(engine, reqs)
    results = [O.SeqResult(k, r.input_ids) for k, r in enumerate(reqs)]
    await collect(engine, reqs, results, request.receive, request_metrics(request))
    scores = []
    for i in range(len(prompts)):
        row = results[i * len(labels):(i + 1) * len(labels)]
        scores.append(_scores([r.input_token_logprobs[-1][0] for r in row], req.apply_softmax))
    prompt_tokens = sum(len(ids) for ids in prompts)
    return JSONResponse({"object": "scoring", "model": engine.served_model_name, "scores": scores,
                         "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 0,
                                   "total_tokens": prompt_tokens}})
