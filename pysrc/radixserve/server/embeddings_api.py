"""POST /v1/embeddings and POST /v1/rerank, served with --is-embedding (engine/pooling.py).

    /v1/embeddings  {"input": "text" | ["a", "b"] | [ids] | [[ids], ...], "model",
                     "encoding_format": "float" | "base64", "dimensions": N}
                 -> {"object": "list", "model", "data": [{"object": "embedding", "index": i,
                     "embedding": [floats] | "base64 of little-endian float32"}],
                     "usage": {"prompt_tokens", "total_tokens"}}
    /v1/rerank      {"query", "documents": ["text" | {"text"}], "top_n", "return_documents",
                     "instruction", "model"}
                 -> {"id", "model", "results": [{"index", "relevance_score",
                     "document": {"text"}}] best first, "usage": {"prompt_tokens", "total_tokens"}}

Each input (each query-document pair) is one pooling request of the engine: prefilled
through the scheduler with every other request (so a batch of inputs shares steps), never
decoded. An embedding is the final-norm hidden state of the input's last token (or the mean
over its tokens: --pooling-method), truncated to `dimensions` and L2-normalised. A rerank
prompt is the pair in the --rerank-template (qwen3: Qwen3-Reranker's prompt; concat: query
then document); its score is P(yes) = softmax over the logits of the yes / no tokens at the
prompt's last position (--rerank-token-ids, else the tokenizer's "yes" and "no"). The pairs
of one query share their prompt up to the document, which the radix cache computes once.

Validation happens once, before anything runs: the body (server/schemas.py), each prompt
(requests.check_prompt_ids: non-empty, shorter than the context, ids in the vocabulary),
then the engine (generation.validate_all: dimensions within the hidden size, the queue); a
refused request starts nothing. The offline Engine's embed() and rerank() share
embed_prompts and rerank_prompt_ids.
"""
from __future__ import annotations

import base64
import math
import struct
import uuid
from typing import List, Optional, Sequence, Tuple

from starlette.requests import Request
from starlette.responses import Response

from radixserve.engine.io import GenerateReqInput
from radixserve.engine.pooling import PoolParams
from radixserve.errors import ApiError, bad_request
from radixserve.sampling.params import SamplingParams
from radixserve.server import render as O
from radixserve.server import requests as R
from radixserve.server import schemas as S
from radixserve.server.generation import ClientDisconnected, collect, encode_prompt, validate_all
from radixserve.server.jsonio import JSONResponse
from radixserve.server.metrics import request_metrics
from radixserve.server.openai_api import model_aliases
from radixserve.server.security import read_json_object

# Qwen3-Reranker's prompt (its model card): a system message asking for a yes / no judgement,
# the pair as <Instruct> / <Query> / <Document> lines, and an empty think block to answer after
QWEN3_RERANK_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements "
                       "based on the Query and the Instruct provided. Note that the answer can "
                       "only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
QWEN3_RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN3_RERANK_INSTRUCTION = ("Given a web search query, retrieve relevant passages that answer "
                            "the query")


def qwen3_rerank_text(query: str, document: str, instruction: Optional[str] = None) -> str:
    """The middle of a qwen3 rerank prompt (between QWEN3_RERANK_PREFIX and _SUFFIX)."""
    return (f"<Instruct>: {instruction or QWEN3_RERANK_INSTRUCTION}\n<Query>: {query}\n"
            f"<Document>: {document}")


def require_embedding(engine, route: str) -> None:
    """A 400 naming --is-embedding when the server generates instead."""
    if not getattr(engine.server_args, "is_embedding", False):
        raise bad_request(f"{route} needs a server started with --is-embedding (the model is "
                          f"served for generation here)")


# --------------------------------------------------------------------------- running

def pool_requests(rid: str, prompt_ids: Sequence[List[int]], pool: PoolParams,
                  cache_salt: Optional[str] = None) -> List[GenerateReqInput]:
    """One pooling request per prompt: rid for a single one, else rid-<index>."""
    return [GenerateReqInput(rid=rid if len(prompt_ids) == 1 else f"{rid}-{k}",
                             input_ids=list(ids),
                             sampling_params=SamplingParams(max_new_tokens=0, temperature=0.0),
                             pool=pool, cache_salt=cache_salt)
            for k, ids in enumerate(prompt_ids)]


async def run_pooled(engine, reqs: Sequence[GenerateReqInput], receive=None, metrics=None
                     ) -> List[O.SeqResult]:
    """Validate every request (nothing starts when one is refused), run them together, and
    return their results; an engine abort is raised as its error (render.abort_error)."""
    validate_all(engine, reqs)
    results = [O.SeqResult(k, r.input_ids) for k, r in enumerate(reqs)]
    await collect(engine, reqs, results, receive, metrics)
    for r in results:
        err = O.abort_error(r.finish_reason)
        if err is not None:
            raise err
    return results


async def prompt_ids_of(engine, inputs: Sequence, param: str, single: bool) -> List[List[int]]:
    """Each input's token ids (text tokenized as the completions route does), each checked
    once: an empty string or prompt, one too long for the context, ids outside the
    vocabulary are 400s naming input (or input[k])."""
    out = []
    for k, item in enumerate(inputs):
        where = param if single else f"{param}[{k}]"
        if isinstance(item, str):
            if not item:
                raise bad_request(f"{where} is an empty string; send text to embed", param=where)
            ids = await encode_prompt(engine, item, where)
        else:
            ids = list(item)
        R.check_prompt_ids(ids, engine.model_config.vocab_size, engine.context_len, 0, where,
                           where)
        out.append(ids)
    return out


async def embed_prompts(engine, prompt_ids: Sequence[List[int]], dimensions: Optional[int],
                        cache_salt: Optional[str] = None, receive=None, metrics=None
                        ) -> List[O.SeqResult]:
    """The embeddings of checked prompts (SeqResult.embedding each), pooled as the server's
    --pooling-method says."""
    pool = PoolParams(method=engine.pooling_method, normalize=True, dimensions=dimensions)
    reqs = pool_requests(f"embd-{uuid.uuid4().hex}", prompt_ids, pool, cache_salt)
    return await run_pooled(engine, reqs, receive, metrics)


def encode_embedding(values: List[float], encoding_format: str):
    """float: the list itself; base64: its little-endian float32 bytes, base64-encoded (what
    the openai client decodes)."""
    if encoding_format != "base64":
        return values
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")


async def embeddings(request: Request, engine) -> Response:
    body = await read_json_object(request)
    require_embedding(engine, "/v1/embeddings")
    R.check_model(body, engine.served_model_name, model_aliases(engine))
    req = S.parse(S.EmbeddingRequest, body)
    single = isinstance(req.input, str) or (bool(req.input) and isinstance(req.input[0], int))
    inputs = [req.input] if single else list(req.input)
    prompt_ids = await prompt_ids_of(engine, inputs, "input", single)
    try:
        results = await embed_prompts(engine, prompt_ids, req.dimensions, req.cache_salt,
                                      request.receive, request_metrics(request))
    except ClientDisconnected:
        return Response(status_code=499)
    fmt = req.encoding_format or "float"
    tokens = sum(len(ids) for ids in prompt_ids)
    return JSONResponse({
        "object": "list", "model": engine.served_model_name,
        "data": [{"object": "embedding", "index": r.index,
                  "embedding": encode_embedding(r.embedding, fmt)} for r in results],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


# --------------------------------------------------------------------------- rerank

def rerank_labels(engine) -> Tuple[int, int]:
    """The (yes, no) token ids, or a 400 saying why the server cannot rerank."""
    labels = getattr(engine, "rerank_labels", None)
    if labels is None:
        reason = getattr(engine, "rerank_unavailable", None) or "no yes / no token ids"
        raise bad_request(f"/v1/rerank is not available: {reason}")
    return labels


def rerank_prompt_ids(engine, query: str, documents: Sequence[str],
                      instruction: Optional[str] = None) -> List[List[int]]:
    """Each (query, document) pair's prompt ids in the --rerank-template. qwen3: the prefix,
    the <Instruct> / <Query> / <Document> text and the suffix tokenized apart (as the model
    card's transformers example does), so every pair's prompt starts with the same tokens up
    to its document; concat: the query's ids (with the tokenizer's special tokens) then the
    document's. Not checked against the context here (prompt_ids_of does)."""
    tok = engine.tokenizer
    if getattr(engine.server_args, "rerank_template", "qwen3") == "concat":
        head = tok.encode(query, add_special_tokens=True)
        return [head + tok.encode(doc, add_special_tokens=False) for doc in documents]
    prefix = tok.encode(QWEN3_RERANK_PREFIX, add_special_tokens=False)
    suffix = tok.encode(QWEN3_RERANK_SUFFIX, add_special_tokens=False)
    return [prefix + tok.encode(qwen3_rerank_text(query, doc, instruction),
                                add_special_tokens=False) + suffix for doc in documents]


def relevance(label_logits: Sequence[float]) -> float:
    """P(yes) of softmax over the (yes, no) logits: 1 / (1 + exp(no - yes))."""
    yes, no = label_logits
    d = no - yes
    return 1.0 / (1.0 + math.exp(d)) if d < 700 else 0.0


async def rerank_scores(engine, prompt_ids: Sequence[List[int]],
                        cache_salt: Optional[str] = None, receive=None, metrics=None
                        ) -> List[float]:
    """Each checked rerank prompt's relevance score (P(yes)), in order."""
    yes, no = rerank_labels(engine)
    pool = PoolParams(method="last", normalize=False, label_ids=(yes, no))
    reqs = pool_requests(f"rerank-{uuid.uuid4().hex}", prompt_ids, pool, cache_salt)
    results = await run_pooled(engine, reqs, receive, metrics)
    return [relevance(r.label_logits) for r in results]


def ranked(scores: Sequence[float], documents: Sequence[str], top_n: Optional[int],
           return_documents: bool) -> List[dict]:
    """The results, best first (ties by index), the first top_n (0 / None: all)."""
    order = sorted(range(len(scores)), key=lambda k: (-scores[k], k))
    if top_n:
        order = order[:top_n]
    out = []
    for k in order:
        item = {"index": k, "relevance_score": scores[k]}
        if return_documents:
            item["document"] = {"text": documents[k]}
        out.append(item)
    return out


async def rerank(request: Request, engine) -> Response:
    body = await read_json_object(request)
    require_embedding(engine, "/v1/rerank")
    R.check_model(body, engine.served_model_name, model_aliases(engine))
    req = S.parse(S.RerankRequest, body)
    rerank_labels(engine)
    if not req.query:
        raise bad_request("query is an empty string; send the text to rank by", param="query")
    documents = [d if isinstance(d, str) else d.text for d in req.documents]
    for k, doc in enumerate(documents):
        if not doc:
            raise bad_request(f"documents[{k}] is empty; send text to rank",
                              param=f"documents[{k}]")
    prompt_ids = rerank_prompt_ids(engine, req.query, documents, req.instruction)
    for k, ids in enumerate(prompt_ids):
        R.check_prompt_ids(ids, engine.model_config.vocab_size, engine.context_len, 0,
                           f"documents[{k}]", f"documents[{k}]")
    try:
        scores = await rerank_scores(engine, prompt_ids, req.cache_salt, request.receive,
                                     request_metrics(request))
    except ClientDisconnected:
        return Response(status_code=499)
    tokens = sum(len(ids) for ids in prompt_ids)
    return JSONResponse({
        "id": f"rerank-{uuid.uuid4().hex}", "model": engine.served_model_name,
        "results": ranked(scores, documents,
                          req.top_n, req.return_documents is not False),
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def generation_off(engine) -> Optional[ApiError]:
    """The 400 a generation route answers on a --is-embedding server (None elsewhere)."""
    if not getattr(engine.server_args, "is_embedding", False):
        return None
    return bad_request(f"{engine.served_model_name} is served for embeddings (--is-embedding): "
                       f"generation routes are off; use POST /v1/embeddings or /v1/rerank")
