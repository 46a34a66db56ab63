"""The OpenAPI 3.1 document served at GET /openapi.json.

Request bodies are the pydantic models of server/schemas.py (their JSON schemas, under
#/components/schemas). Responses are typed loosely (objects with the fields every response
has; more may appear) but truthfully: each documents every status and media type the route
answers with, so a schema fuzzer (schemathesis) can check the server against it. Statuses the
door can answer on any route (server/security.py: 400 for a malformed Content-Length, 401
without the API key, 403 for a foreign Origin, 413 for a large body, 421 for a foreign Host)
are on every route; with an API key the document declares Bearer security for every route but
/health.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Union

from pydantic import BaseModel, ConfigDict
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import Response

from radixserve.server import anthropic_schemas as AS
from radixserve.server import dashboard as D
from radixserve.server import responses_schemas as RS
from radixserve.server import schemas as S
from radixserve.server import tokenize_schemas as TS
from radixserve.server.jsonio import JSONResponse
from radixserve.server.security import ADMIN_PATHS, OPEN_PATHS
from radixserve.version import __version__

REF = "#/components/schemas/{model}"
JSON = "application/json"
EVENT_STREAM = "text/event-stream"


# --------------------------------------------------------------------------- response shapes

class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(_Response):
    message: str
    type: str
    param: Optional[str]
    code: int


class ErrorResponse(_Response):
    """Every error body: OpenAI's shape."""
    error: ErrorDetail


class ChatMessageOut(_Response):
    role: str
    content: Optional[str]


class ChatChoice(_Response):
    index: int
    message: ChatMessageOut
    finish_reason: Optional[str]
    logprobs: Optional[Dict[str, Any]] = None


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(_Response):
    """A non-streamed /v1/chat/completions response."""
    id: str
    object: str
    created: int
    model: str
    choices: List[ChatChoice]
    usage: Usage


class CompletionChoice(_Response):
    index: int
    text: str
    finish_reason: Optional[str]
    logprobs: Optional[Dict[str, Any]] = None


class TextCompletion(_Response):
    """A non-streamed /v1/completions response."""
    id: str
    object: str
    created: int
    model: str
    choices: List[CompletionChoice]
    usage: Usage


class ChatCompletionChunk(_Response):
    """One event of a streamed chat completion (choices is empty in the final usage chunk)."""
    id: str
    object: str
    created: int
    model: str
    choices: List[Dict[str, Any]]


class TextCompletionChunk(ChatCompletionChunk):
    """One event of a streamed text completion."""


class GenerateMeta(_Response):
    id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: Optional[Dict[str, Any]]


class GenerateResult(_Response):
    """A /generate result (one per sequence; a batch or n > 1 answers an array of them)."""
    text: str
    output_ids: List[int]
    meta_info: GenerateMeta


class ModelCard(_Response):
    id: str
    object: str
    created: int
    owned_by: str


class ModelList(_Response):
    object: str
    data: List[ModelCard]


class ResponseObject(_Response):
    """A /v1/responses Response object: POST's result, GET's body, and inside the stream's
    response.* events (status "in_progress" there, output [] and usage null at first)."""
    id: str
    object: str
    created_at: int
    status: str
    model: str
    output: List[Dict[str, Any]]
    usage: Optional[Dict[str, Any]]


class ResponseStreamEvent(_Response):
    """One event of a streamed /v1/responses (response.created ... response.completed, or an
    error event followed by response.failed)."""
    type: str
    sequence_number: int


class ResponseDeleted(_Response):
    id: str
    object: str
    deleted: bool


class EmbeddingData(_Response):
    object: str
    index: int
    embedding: Union[List[float], str]       # encoding_format base64: a string


class EmbeddingList(_Response):
    """A /v1/embeddings response."""
    object: str
    model: str
    data: List[EmbeddingData]
    usage: Dict[str, int]


class RerankResult(_Response):
    index: int
    relevance_score: float
    document: Optional[Dict[str, Any]] = None


class RerankResponse(_Response):
    """A /v1/rerank response: results best first."""
    id: str
    model: str
    results: List[RerankResult]
    usage: Dict[str, int]


RESPONSE_MODELS = (ErrorResponse, ChatCompletion, TextCompletion, GenerateResult, ModelCard, ModelList,
                   ChatCompletionChunk, TextCompletionChunk, ResponseObject, ResponseStreamEvent,
                   ResponseDeleted, EmbeddingList, RerankResponse)


# --------------------------------------------------------------------------- the document

def _ref(model: type) -> dict:
    return {"$ref": REF.format(model=model.__name__)}


def _json(schema: dict, description: str) -> dict:
    return {"description": description, "content": {JSON: {"schema": schema}}}


def _error(description: str) -> dict:
    return _json(_ref(ErrorResponse), description)


def _door_errors(api_key: bool, error=_error) -> Dict[str, dict]:
    """The door's errors (error(description): the path's error response)."""
    errors = {
        "400": error("invalid request"),
        "403": error("cross-origin request from an origin not in --allowed-origins"),
        "413": error("request body larger than --max-request-bytes"),
        "421": error("Host header not in --allowed-hosts"),
    }
    if api_key:
        errors["401"] = error("missing or wrong API key")
    return errors


def _sse_event(chunk: type) -> dict:
    """One server-sent event (OpenAPI 3.1 reads an event stream's schema per event): its data
    is a JSON chunk, an error body (after the stream started), or the closing [DONE]."""
    return {"type": "object", "required": ["data"], "properties": {
        "event": {"type": "string"},
        "data": {"type": "string", "anyOf": [
            {"const": "[DONE]"},
            {"contentMediaType": JSON, "contentSchema": {"anyOf": [_ref(chunk), _ref(ErrorResponse)]}}]}}}


def _generation_route(summary: str, body: type, result: dict, chunk: type, has_model: bool) -> dict:
    responses = {
        "200": {"description": "the result (application/json), or with stream=true, server-sent "
                               "events ending in data: [DONE]",
                "content": {JSON: {"schema": result}, EVENT_STREAM: {"schema": _sse_event(chunk)}}},
        "415": _error("Content-Type is not application/json"),
        "503": _error("the server is busy (Retry-After), shutting down, or aborted the request"),
    }
    if has_model:
        responses["404"] = _error("model names a model this server does not serve")
    return {"post": {"summary": summary, "requestBody": {
        "required": True, "content": {JSON: {"schema": _ref(body)}}}, "responses": responses}}


def _pooling_route(summary: str, body: type, result: type) -> dict:
    """/v1/embeddings and /v1/rerank (--is-embedding; a 400 without it)."""
    return {"post": {"summary": summary, "requestBody": {
        "required": True, "content": {JSON: {"schema": _ref(body)}}}, "responses": {
            "200": _json(_ref(result), "the result"),
            "400": _error("an invalid request (names the field), or a server started without "
                          "--is-embedding"),
            "404": _error("model names a model this server does not serve"),
            "415": _error("Content-Type is not application/json"),
            "503": _error("the server is busy (Retry-After), shutting down, or aborted the "
                          "request")}}}


def _get(summary: str, responses: Dict[str, dict]) -> dict:
    return {"get": {"summary": summary, "responses": responses}}


def _responses_paths() -> Dict[str, dict]:
    """The Responses API (server/responses_api.py): create, and a stored response's GET / DELETE."""
    create = _generation_route("OpenAI Responses API: create a response", RS.ResponseCreateRequest,
                               _ref(ResponseObject), ResponseStreamEvent, has_model=True)
    answers = create["post"]["responses"]
    answers["200"]["description"] = ("the Response object (application/json), or with stream=true "
                                     "its typed server-sent events (event: <type>, data: <json>)")
    answers["404"] = _error("model names a model this server does not serve, or "
                            "previous_response_id names no stored response of this client")
    response_id = [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    missing = _error("no stored response of this client has this id")
    malformed = _error("response_id is not a response id (it does not begin with resp_)")
    return {
        "/v1/responses": create,
        "/v1/responses/{response_id}": {
            "get": {"summary": "a stored response", "parameters": response_id,
                    "responses": {"200": _json(_ref(ResponseObject), "the Response object"),
                                  "400": malformed, "404": missing}},
            "delete": {"summary": "delete a stored response", "parameters": response_id,
                       "responses": {"200": _json(_ref(ResponseDeleted), "deleted"),
                                     "404": missing}}},
    }


def _paths() -> Dict[str, dict]:
    obj = {"type": "object"}
    empty = {"description": "empty body"}
    return {
        "/v1/chat/completions": _generation_route("OpenAI chat completion", S.ChatCompletionRequest,
                                                  _ref(ChatCompletion), ChatCompletionChunk,
                                                  has_model=True),
        "/v1/completions": _generation_route("OpenAI text completion", S.CompletionRequest,
                                             _ref(TextCompletion), TextCompletionChunk,
                                             has_model=True),
        **_responses_paths(),
        **AS.openapi_paths(_ref),
        **TS.openapi_paths(_ref, _error),
        "/generate": _generation_route(
            "SGLang native generation", S.GenerateRequest,
            {"anyOf": [_ref(GenerateResult), {"type": "array", "items": _ref(GenerateResult)}]},
            GenerateResult, has_model=False),
        "/v1/score": {"post": {
            "summary": "SGLang's scoring: each label token's probability after query + item",
            "requestBody": {"required": True, "content": {JSON: {"schema": _ref(S.ScoreRequest)}}},
            "responses": {"200": _json(obj, "{object: scoring, model, scores: [[p per label] "
                                            "per item], usage}"),
                          "400": _error("an invalid request (names the field); every error "
                                        "body of this path also has SGLang's flat fields "
                                        "(object, message, type: BadRequestError, param, code)"),
                          "404": _error("model names a model this server does not serve")}}},
        "/v1/embeddings": _pooling_route("OpenAI embeddings (--is-embedding)",
                                         S.EmbeddingRequest, EmbeddingList),
        "/v1/rerank": _pooling_route("rerank documents by relevance to a query (Cohere / Jina "
                                     "shape; --is-embedding)", S.RerankRequest, RerankResponse),
        "/v1/models": _get("the served model", {"200": _json(_ref(ModelList), "model list")}),
        "/v1/models/{model_id}": {"get": {
            "summary": "one model's card",
            "parameters": [{"name": "model_id", "in": "path", "required": True,
                            "schema": {"type": "string"}}],
            "responses": {"200": _json(_ref(ModelCard), "the model"),
                          "404": _error("not a model this server serves")}}},
        "/health": _get("liveness: 200 while the engine's loop runs",
                        {"200": empty, "503": empty}),
        "/health_generate": _get("readiness: 200 once a one-token generation completes", {
            "200": empty,
            "503": {"description": "the engine did not generate (empty body, or an error body "
                                   "after the time limit)",
                    "content": {JSON: {"schema": _ref(ErrorResponse)}}}}),
        "/get_model_info": _get("model facts", {"200": _json(obj, "model path, context length, ...")}),
        "/get_server_info": _get("server facts", {"200": _json(obj, "server arguments and state")}),
        "/model_info": _get("model facts (alias of /get_model_info, SGLang's model gateway's "
                            "name)", {"200": _json(obj, "model path, context length, ...")}),
        "/server_info": _get("server facts (alias of /get_server_info)",
                             {"200": _json(obj, "server arguments and state")}),
        "/v1/loads": {"get": {
            "summary": "SGLang's load report: running and waiting requests, KV tokens in use, "
                       "one entry per DP rank (this server is rank 0)",
            "parameters": [
                {"name": "include", "in": "query", "required": False,
                 "schema": {"type": "string"},
                 "description": "comma list of core, memory, spec, lora, disagg, queues, all"},
                {"name": "dp_rank", "in": "query", "required": False,
                 "schema": {"type": "integer"}},
                {"name": "format", "in": "query", "required": False,
                 "schema": {"type": "string", "enum": ["json"]}}],
            "responses": {"200": _json(obj, "{timestamp, version, dp_rank_count, loads, "
                                            "aggregate}"),
                          "400": _error("an unknown section, or a dp_rank that is not an "
                                        "integer")}}},
        "/get_load": _get("SGLang's older load report: [{dp_rank, num_reqs, num_waiting_reqs, "
                          "num_tokens, num_pending_tokens, ts_tic}]",
                          {"200": _json({"type": "array", "items": obj}, "one entry per DP "
                                                                         "rank")}),
        "/flush_cache": {"post": {"summary": "empty the radix cache", "responses": {
            "200": {"description": "flushed", "content": {"text/plain": {"schema": {"type": "string"}}}},
            "400": _error("requests are running; retry when idle")}}},
        "/abort_request": {"post": {
            "summary": "abort one of this client's live requests, or all of them with abort_all "
                       "(200 whether or not one was live)",
            "requestBody": {"required": True, "content": {JSON: {"schema": _ref(S.AbortRequest)}}},
            "responses": {"200": empty, "415": _error("Content-Type is not application/json")}}},
        "/metrics": _get("Prometheus metrics", {"200": {
            "description": "the Prometheus text format",
            "content": {"text/plain": {"schema": {"type": "string"}}}}}),
        "/openapi.json": _get("this document", {"200": _json(obj, "OpenAPI 3.1")}),
        "/ping": {method: {"summary": "SageMaker's health check (as /health)",
                           "responses": {"200": empty, "503": empty}}
                  for method in ("get", "post")},
        "/invocations": {"post": {
            "summary": "SageMaker's inference entry: the body goes to the route its keys name "
                       "(messages: /v1/chat/completions, prompt: /v1/completions, input: "
                       "/v1/embeddings, documents: /v1/rerank, text or input_ids: /generate) "
                       "and is answered as that route answers",
            "requestBody": {"required": True, "content": {JSON: {"schema": obj}}},
            "responses": {"200": _json(obj, "the chosen route's response (or its event "
                                            "stream)"),
                          "400": _error("no key names a route, or the chosen route's 400")}}},
    }


def _query_parameters(table: Dict[str, tuple]) -> List[dict]:
    """A dashboard route's query table (name -> (int | float, low, high)) as OpenAPI parameters."""
    return [{"name": name, "in": "query", "required": False,
             "schema": {"type": "integer" if kind is int else "number",
                        "minimum": low, "maximum": high}}
            for name, (kind, low, high) in table.items()]


def _dashboard_paths() -> Dict[str, dict]:
    """--enable-dashboard's routes (server/dashboard.py); absent from the document without it."""
    bad_query = _error("an unknown, repeated or out-of-range query parameter (names it)")
    return {
        "/dashboard": {"get": {
            "summary": "the cache dashboard page (HTML, no external fetches)",
            "responses": {"200": {"description": "the page",
                                  "content": {"text/html": {"schema": {"type": "string"}}}},
                          "400": _error("any query parameter (the page takes none)")}}},
        "/dashboard/data": {"get": {
            "summary": "the dashboard's time series, totals and radix-tree summary",
            "parameters": _query_parameters(D.DATA_QUERY),
            "responses": {"200": _json({"type": "object"}, "{now, model, interval_s, totals, "
                                                           "series: {columns, rows}, tree, "
                                                           "tree_unchanged, ...}"),
                          "400": bad_query}}},
        "/dashboard/advice": {"get": {
            "summary": "the prefix-cache advisor's report over the recent prompts",
            "parameters": _query_parameters(D.ADVICE_QUERY),
            "responses": {"200": _json({"type": "object"}, "{prompts, prompt_tokens, overall, "
                                                           "suggestions (ranked by prompt "
                                                           "tokens saved), ...}"),
                          "400": bad_query}}},
    }


def component_schemas() -> Dict[str, Any]:
    """The JSON schemas of every request and response model, keyed by model name."""
    _, top = models_json_schema([(m, "validation") for m in
                                 S.REQUEST_MODELS + RS.REQUEST_MODELS + AS.REQUEST_MODELS
                                 + TS.REQUEST_MODELS + RESPONSE_MODELS + AS.RESPONSE_MODELS
                                 + TS.RESPONSE_MODELS],
                                ref_template=REF)
    return top["$defs"]


def openapi_document(api_key: bool, version: str = "0", admin_key: bool = False,
                     dashboard: bool = False) -> dict:
    """The whole document; `api_key`: the server requires a Bearer key (all but /health);
    `admin_key`: the server-wide routes (security.ADMIN_PATHS, and the dashboard's) take only
    the admin key; `dashboard`: --enable-dashboard's routes are served."""
    paths = _paths()
    admin_paths = set(ADMIN_PATHS)
    if dashboard:
        dash = _dashboard_paths()
        paths.update(dash)
        admin_paths.update(dash)
    door = _door_errors(api_key)
    anthropic_door = _door_errors(api_key, lambda description: AS.error_doc(_ref, description))
    for path, item in paths.items():
        for op in item.values():
            op["responses"] = {**(anthropic_door if path in AS.PATHS else door), **op["responses"]}
            if api_key and path in OPEN_PATHS:
                op["security"] = []
                op["responses"].pop("401", None)
            if admin_key and path in admin_paths:
                op["security"] = [{"bearer": []}]
                op["responses"]["401"] = _error("missing or wrong admin key")
                op["responses"]["403"] = _error("a client key on a server-wide route, or a "
                                                "cross-origin request")
    doc: Dict[str, Union[str, dict, list]] = {
        "openapi": "3.1.0",
        "info": {"title": "radixserve", "version": version,
                 "description": "OpenAI-compatible and SGLang-native LLM serving"},
        "paths": paths,
        "components": {"schemas": component_schemas()},
    }
    if api_key or admin_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    if api_key:
        doc["security"] = [{"bearer": []}]
    return doc


async def openapi_json(request: Request, engine) -> Response:
    """GET /openapi.json (built once per app)."""
    state = request.app.state
    doc = getattr(state, "openapi_document", None)
    if doc is None:
        policy = state.door_policy
        doc = openapi_document(api_key=policy.requires_key, version=__version__,
                               admin_key=policy.admin_key is not None,
                               dashboard=getattr(state, "dashboard", None) is not None)
        state.openapi_document = doc
    return JSONResponse(doc)
