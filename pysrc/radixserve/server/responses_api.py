"""The OpenAI Responses API: POST /v1/responses, GET and DELETE /v1/responses/{response_id}.

A request runs like a chat completion with one answer: `input` (a string: one user message; or
a list of message items with text content) after `instructions` (a system message, for this
request only: it is not carried to follow-ups) and after the stored conversation of
`previous_response_id`, rendered with the model's chat template (openai_api.render_messages),
sampled with `temperature` / `top_p` (and SGLang's extensions: frequency_penalty,
presence_penalty, repetition_penalty, top_k, min_p, stop) for at most `max_output_tokens` tokens (default: up to the
context length), constrained by `text.format` (json_object / json_schema become the same
json_schema grammar as chat's response_format: requests.json_format_schema, compiled up front by
generation.check_grammars). The answer is a Response object whose output is one assistant
message with one output_text part, after a reasoning item (one reasoning_text part) when the
server runs a --reasoning-parser and the output has a <think> block (parsers/reasoning.py;
text.format's grammar then constrains the answer after it); status "completed", or
"incomplete" with incomplete_details.reason "max_output_tokens" when the output was cut by the
token limit (or the context). usage: input_tokens (prompt), input_tokens_details.cached_tokens (prompt tokens
served from the radix cache), output_tokens, output_tokens_details.reasoning_tokens (with a
reasoning parser: reasoning.reasoning_token_count, else 0), total_tokens; cache_write_tokens is
not tracked and always 0. usage also carries prompt_tokens and completion_tokens (the same counts
as input_tokens and output_tokens) for clients written against SGLang, whose Responses usage
has those names.

stream: true sends the typed events the openai client parses, each as `event: <type>` plus
`data: <json>` with a sequence_number counting from 0: response.created, response.in_progress,
response.output_item.added, response.content_part.added, response.output_text.delta (one per
piece of text), response.output_text.done, response.content_part.done,
response.output_item.done, then response.completed (or response.incomplete). With reasoning,
the reasoning item's events come first (output_index 0: response.reasoning_text.delta /
.done inside the same item and part events) and the message's follow (output_index 1); each
item is announced when its first text is known. No `[DONE]`
(OpenAI sends none). An error after the headers went out is an `error` event {code, message,
param} followed by response.failed (status "failed", response.error set); the stream ends there.

store (default true): a finished (completed or incomplete) response is kept in a bounded
in-memory store, ResponseStore (MAX_STORED_RESPONSES responses, about MAX_STORED_CHARS
characters of conversation, in all; when it is full, the least recently used response of the
client holding the most goes first, so one client storing many responses evicts its own, never
those of a client holding fewer), per client: only the client
that created a response (security.ClientView.identity: the same API key's client, or without
keys the same peer address) can GET it, DELETE it, or continue it; for anyone else it does not exist
(404, like an unknown, deleted or evicted id). `previous_response_id`: the new conversation is
the stored one (its input messages and output, not its instructions) followed by the new input,
(the answer only: reasoning is not carried, as Qwen and DeepSeek advise), so the earlier
exchange is a prefix of the new prompt and comes from the radix cache
(usage.input_tokens_details.cached_tokens). A response streaming or failed is not stored.

Refused with a 400 naming the field (responses_schemas.py): tools (other than []), tool_choice
other than "none" / "auto", reasoning, background: true, include (other than []), truncation
"auto", top_logprobs above 0, n above 1, conversation, prompt, context_management, moderation,
input items other than messages, content parts other than input_text / output_text.
Accepted and ignored (harmless; echoed in the response where OpenAI echoes them): model (it must
name the served model, else 404), user, metadata, parallel_tool_calls, max_tool_calls (no tools
run), service_tier, prompt_cache_key, prompt_cache_retention, safety_identifier, stream_options,
text.verbosity, text.format.strict (the schema is always enforced). Any other top-level field is
a 400 naming it. GET ignores its
query parameters but stream=true (a 400: stored responses are not replayed as events).
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import time
import uuid
from typing import Any, AsyncIterator, Dict, List, Optional, Sequence

from starlette.requests import Request
from starlette.responses import Response

from radixserve.engine.io import GenerateReqInput, expand_requests
from radixserve.errors import ApiError, bad_request
from radixserve.parsers.reasoning import (ReasoningSplitter, reasoning_token_count,
                                          with_reasoning_grammar)
from radixserve.sampling.params import SamplingParams
from radixserve.server import render as O
from radixserve.server import requests as R
from radixserve.server import schemas as S
from radixserve.server.generation import (ClientDisconnected, check_grammars, collect,
                                          merge_generations, validate_all)
from radixserve.server.jsonio import JSONResponse
from radixserve.server.metrics import RequestMetrics, request_metrics
from radixserve.server.openai_api import model_aliases, _raise_if_aborted, render_messages
from radixserve.server.responses_schemas import RESPONSE_ID_PREFIX, ResponseCreateRequest
from radixserve.server.security import read_json_object
from radixserve.server.sse import EventStreamResponse, encode_event

logger = logging.getLogger(__name__)

MAX_STORED_RESPONSES = 1024
MAX_STORED_CHARS = 1 << 26          # characters of stored conversations, all clients together


# --------------------------------------------------------------------------- the store

@dataclasses.dataclass
class StoredResponse:
    owner: str                      # the identity of the client that created it
    response: dict                  # the Response object, as GET answers it
    conversation: List[dict]        # input + output messages a follow-up continues (no instructions)
    chars: int                      # what it counts against max_chars


class ResponseStore:
    """Stored responses by id, each client's least recently used first. Putting one beyond
    `max_responses` entries or `max_chars` characters in all drops entries until it fits,
    each time the least recently used entry of the client holding the most (entries, or
    characters when those overflow; the storing client's new entry counted, and it loses a
    tie), so a client that stores a
    lot evicts its own responses first and never another's that holds less; a response larger
    than max_chars alone is not stored. Reads (get) count as use. An entry belongs to its
    owner: get and delete for another identity behave as for an unknown id. One per app
    (app.state); the event loop's thread only."""

    def __init__(self, max_responses: int = MAX_STORED_RESPONSES, max_chars: int = MAX_STORED_CHARS):
        self.max_responses = max_responses
        self.max_chars = max_chars
        self._entries: Dict[str, StoredResponse] = {}
        # per owner: its response ids, least recently used first (value unused)
        self._by_owner: Dict[str, "collections.OrderedDict[str, None]"] = {}
        self._owner_chars: Dict[str, int] = {}
        self._chars = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def chars(self) -> int:
        return self._chars

    def held_by(self, owner: str) -> int:
        """How many responses `owner` has stored."""
        return len(self._by_owner.get(owner, ()))

    def put(self, response_id: str, owner: str, response: dict, conversation: List[dict],
            chars: int) -> bool:
        """Store (or replace) `response_id`; False when it is too large to store at all."""
        self._drop(response_id)
        if chars > self.max_chars:
            return False
        while self._entries and len(self._entries) >= self.max_responses:
            self._evict_from(self._largest(owner, lambda who: len(self._by_owner[who]), 1))
        while self._entries and self._chars + chars > self.max_chars:
            self._evict_from(self._largest(owner, self._owner_chars.__getitem__, chars))
        self._entries[response_id] = StoredResponse(owner, response, conversation, chars)
        self._by_owner.setdefault(owner, collections.OrderedDict())[response_id] = None
        self._owner_chars[owner] = self._owner_chars.get(owner, 0) + chars
        self._chars += chars
        return True

    def get(self, response_id: str, owner: str) -> Optional[StoredResponse]:
        entry = self._entries.get(response_id)
        if entry is None or entry.owner != owner:
            return None
        self._by_owner[owner].move_to_end(response_id)
        return entry

    def delete(self, response_id: str, owner: str) -> bool:
        entry = self._entries.get(response_id)
        if entry is None or entry.owner != owner:
            return False
        self._drop(response_id)
        return True

    def _largest(self, storing: str, size, adding: int) -> str:
        """The owner holding the most by `size`, counting the `adding` that `storing` is about
        to store (which also wins a tie)."""
        return max(self._by_owner, key=lambda who: (size(who) + (adding if who == storing else 0),
                                                    who == storing))

    def _evict_from(self, owner: str) -> None:
        self._drop(next(iter(self._by_owner[owner])))

    def _drop(self, response_id: str) -> None:
        old = self._entries.pop(response_id, None)
        if old is None:
            return
        self._chars -= old.chars
        ids = self._by_owner[old.owner]
        del ids[response_id]
        self._owner_chars[old.owner] -= old.chars
        if not ids:
            del self._by_owner[old.owner], self._owner_chars[old.owner]


def _store(request: Request) -> ResponseStore:
    return request.app.state.response_store


def _not_found(response_id: str, param: str, store: ResponseStore) -> ApiError:
    return ApiError(f"no stored response {response_id[:200]!r}: this client never stored one by "
                    f"that id (store: false, deleted, or another client's), or it was evicted (the "
                    f"server keeps at most {store.max_responses}, evicting the least recently used "
                    f"of the clients holding the most)", 404, param=param)


# --------------------------------------------------------------------------- the request

def _input_messages(value) -> List[dict]:
    """The validated input as chat messages: a string is one user message; content parts are
    joined by newlines (as chat joins text parts); developer is system (as in chat)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages = []
    for item in value:
        content = item.content if isinstance(item.content, str) else \
            "\n".join(part.text for part in item.content)
        messages.append({"role": "system" if item.role == "developer" else item.role,
                         "content": content})
    return messages


def _sampling(req: ResponseCreateRequest) -> SamplingParams:
    """max_output_tokens, temperature, top_p, SGLang's extensions (penalties, top_k, min_p,
    stop) and text.format's grammar as SamplingParams."""
    d: Dict[str, object] = {"max_new_tokens": req.max_output_tokens}
    for name in ("temperature", "top_p", "frequency_penalty", "presence_penalty",
                 "repetition_penalty", "top_k", "min_p"):
        if getattr(req, name) is not None:
            d[name] = getattr(req, name)
    if req.stop:
        d["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_schema" and fmt.schema_ is None:
            raise bad_request("text.format.schema is required when text.format.type is json_schema",
                              param="text.format.schema")
        d["json_schema"] = R.json_format_schema(fmt.type, fmt.schema_)
    return R.sampling_params_from_dict(d, names={"max_new_tokens": "max_output_tokens"})


def _reasoning_sampling(engine, sampling: SamplingParams) -> tuple:
    """(sampling, --reasoning-parser or None): a text.format grammar is wrapped to constrain the
    answer after the reasoning (reasoning.with_reasoning_grammar); without a parser, or with a
    grammar that cannot be wrapped, the output is not split."""
    parser = getattr(engine.server_args, "reasoning_parser", "none")
    if parser in (None, "none"):
        return sampling, None
    wrapped = with_reasoning_grammar(parser, sampling)
    return (sampling, None) if wrapped is None else (wrapped, parser)


def _chars(messages: Sequence[dict]) -> int:
    return sum(len(m["content"]) for m in messages)


# --------------------------------------------------------------------------- response objects

@dataclasses.dataclass
class _Shape:
    """What every Response object of one request shares."""
    rid: str
    created: int
    model: str
    req: ResponseCreateRequest
    sampling: SamplingParams
    store: bool
    parser: Optional[str] = None       # --reasoning-parser for this request (None: no split)
    tokenizer: Any = None              # the engine's (reasoning_tokens)
    msg_id: str = dataclasses.field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    rs_id: str = dataclasses.field(default_factory=lambda: f"rs_{uuid.uuid4().hex}")

    def output(self, status: str, text: str) -> List[dict]:
        """The output items of an output's text: [reasoning item,] message. A reasoning item
        that its </think> closed is "completed" whatever became of the answer."""
        if not self.parser:
            return [_message(self.msg_id, status, [_text_part(text)])]
        split = ReasoningSplitter(self.parser)
        reasoning, answer = split.feed(text)
        closed = split.reasoning_done
        more_reasoning, more_answer = split.finish()
        items = [_message(self.msg_id, status, [_text_part(answer + more_answer)])]
        if split.had_reasoning:
            items.insert(0, _reasoning_item(self.rs_id, "completed" if closed else status,
                                            reasoning + more_reasoning))
        return items

    def response(self, status: str, output: List[dict], usage: Optional[dict] = None,
                 error: Optional[dict] = None, incomplete: Optional[dict] = None) -> dict:
        req = self.req
        fmt = req.text.format if req.text is not None else None
        return {
            "id": self.rid, "object": "response", "created_at": self.created, "status": status,
            "background": False, "error": error, "incomplete_details": incomplete,
            "completed_at": int(time.time()) if status == "completed" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": req.max_tool_calls, "metadata": req.metadata or {},
            "model": self.model, "output": output,
            "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id, "reasoning": None,
            "service_tier": "default", "store": self.store,
            "temperature": self.sampling.temperature, "top_p": self.sampling.top_p,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None
                     else {"type": "text"}},
            "tool_choice": req.tool_choice or "auto", "tools": [], "top_logprobs": 0,
            "truncation": "disabled", "usage": usage, "user": req.user,
        }


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message(msg_id: str, status: str, content: List[dict]) -> dict:
    return {"id": msg_id, "type": "message", "role": "assistant", "status": status,
            "content": content}


def _reasoning_part(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def _reasoning_item(rs_id: str, status: str, text: str) -> dict:
    return {"id": rs_id, "type": "reasoning", "status": status, "summary": [],
            "content": [_reasoning_part(text)]}


def _usage(result: O.SeqResult, reasoning_tokens: int = 0) -> dict:
    u = O.usage_dict([result], 1)
    return {"input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"],
                                     "cache_write_tokens": 0},
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": u["total_tokens"],
            # SGLang's names for the same counts (see the module docstring)
            "prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"]}


def _ending(result: O.SeqResult) -> tuple:
    """(status, incomplete_details) of a finished sequence."""
    if O.finish_reason_str(result.finish_reason) == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def _finish(shape: _Shape, result: O.SeqResult, store: ResponseStore, owner: str,
            conversation: List[dict]) -> dict:
    """The final Response object of a finished sequence, stored when asked (the answer joins
    the conversation; the reasoning does not)."""
    status, incomplete = _ending(result)
    output = shape.output(status, result.text)
    reasoning = output[0]["content"][0]["text"] if output[0]["type"] == "reasoning" else None
    usage = _usage(result, reasoning_token_count(result.output_ids, reasoning, shape.tokenizer))
    response = shape.response(status, output, usage, incomplete=incomplete)
    if shape.store:
        answer = output[-1]["content"][0]["text"]
        full = conversation + [{"role": "assistant", "content": answer}]
        chars = _chars(full) + len(shape.req.instructions or "") + len(result.text)
        if not store.put(shape.rid, owner, response, full, chars):
            logger.warning("response %s not stored: %d characters exceed the store's %d",
                           shape.rid, chars, store.max_chars)
    return response


# --------------------------------------------------------------------------- routes

async def create_response(request: Request, engine) -> Response:
    """POST /v1/responses."""
    body = await read_json_object(request)
    R.check_model(body, engine.served_model_name, model_aliases(engine))
    req = S.parse(ResponseCreateRequest, body)
    store = _store(request)
    history: List[dict] = []
    if req.previous_response_id is not None:
        previous = store.get(req.previous_response_id, engine.identity)
        if previous is None:
            raise _not_found(req.previous_response_id, "previous_response_id", store)
        history = previous.conversation
    conversation = history + _input_messages(req.input)
    sampling = _sampling(req)
    schema_param = "text.format.schema" if sampling.json_schema else "text.format"
    sampling, parser = _reasoning_sampling(engine, sampling)
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) \
        + conversation
    prompt_ids = await render_messages(engine, messages, param="input")
    R.check_prompt_ids(prompt_ids, engine.model_config.vocab_size, engine.context_len,
                       sampling.max_new_tokens, "input", "max_output_tokens")
    rid = f"{RESPONSE_ID_PREFIX}{uuid.uuid4().hex}"
    stream = bool(req.stream)
    reqs = expand_requests(rid, [prompt_ids], 1, [sampling], stream, return_logprob=[False],
                           logprob_start_len=[-1], top_logprobs_num=[0],
                           return_text_in_logprobs=False)
    validate_all(engine, reqs)
    try:
        await check_grammars(engine, reqs)
    except ApiError as e:           # the only grammar source here
        e.param = schema_param
        raise
    shape = _Shape(rid, int(time.time()), engine.served_model_name, req, sampling,
                   store=req.store is not False, parser=parser, tokenizer=engine.tokenizer)
    if stream:
        return EventStreamResponse(_response_events(engine, shape, reqs, prompt_ids, store,
                                                    conversation, request_metrics(request)))
    result = O.SeqResult(0, prompt_ids)
    try:
        await collect(engine, reqs, [result], request.receive, request_metrics(request))
    except ClientDisconnected:
        return Response(status_code=499)
    _raise_if_aborted([result])
    return JSONResponse(_finish(shape, result, store, engine.identity, conversation))


def _event(seq: "itertools.count", obj: dict) -> bytes:
    obj["sequence_number"] = next(seq)
    return b"event: " + obj["type"].encode() + b"\n" + encode_event(obj)


class _StreamedItems:
    """A stream's output items as typed events. An item (the reasoning, then the message) is
    announced (output_item.added, content_part.added) with its first text, or at once for the
    message of a request without a reasoning parser; each piece of text is a delta event of the
    open item; an item is closed (text done, content_part.done, output_item.done) when the next
    starts or by close() at the end, which makes sure the message was announced."""

    def __init__(self, seq: "itertools.count", shape: _Shape):
        self._seq, self._shape = seq, shape
        self._kind: Optional[str] = None        # "reasoning" or "message" while one is open
        self._started: set = set()              # kinds announced so far
        self._index = -1
        self._text = ""                         # the open item's text so far

    def reasoning(self, piece: str) -> List[bytes]:
        return self._piece("reasoning", piece)

    def answer(self, piece: str) -> List[bytes]:
        return self._piece("message", piece)

    def close(self, output: List[dict]) -> List[bytes]:
        """Close the open items with their final forms from the response's output (announcing
        the message first if the output ended before its answer began)."""
        events: List[bytes] = []
        if self._kind == "reasoning":
            events += self._done(output[self._index])
            self._kind = None
        if self._kind is None:
            events += self._start("message")
        return events + self._done(output[self._index])

    def _piece(self, kind: str, piece: str) -> List[bytes]:
        events: List[bytes] = []
        if kind in self._started and kind != self._kind:
            return events                       # an item closed earlier: nothing reopens it
        if self._kind != kind:
            if self._kind is not None:
                events += self._done(self._item("completed", self._text))
            events += self._start(kind)
        if piece:
            self._text += piece
            kind_text = "reasoning_text" if kind == "reasoning" else "output_text"
            events.append(self._event({"type": f"response.{kind_text}.delta", **self._where(),
                                       "delta": piece, **self._logprobs()}))
        return events

    def _start(self, kind: str) -> List[bytes]:
        self._kind, self._index, self._text = kind, self._index + 1, ""
        self._started.add(kind)
        empty = self._item("in_progress", "")
        part = empty["content"][0] if kind == "reasoning" else _text_part("")
        empty["content"] = []
        return [self._event({"type": "response.output_item.added", "output_index": self._index,
                             "item": empty}),
                self._event({"type": "response.content_part.added", **self._where(),
                             "part": part})]

    def _done(self, item: dict) -> List[bytes]:
        kind_text = "reasoning_text" if self._kind == "reasoning" else "output_text"
        part = item["content"][0]
        return [self._event({"type": f"response.{kind_text}.done", **self._where(),
                             "text": part["text"], **self._logprobs()}),
                self._event({"type": "response.content_part.done", **self._where(),
                             "part": part}),
                self._event({"type": "response.output_item.done", "output_index": self._index,
                             "item": item})]

    def _item(self, status: str, text: str) -> dict:
        if self._kind == "reasoning":
            return _reasoning_item(self._shape.rs_id, status, text)
        return _message(self._shape.msg_id, status, [_text_part(text)])

    def _where(self) -> dict:
        item_id = self._shape.rs_id if self._kind == "reasoning" else self._shape.msg_id
        return {"item_id": item_id, "output_index": self._index, "content_index": 0}

    def _logprobs(self) -> dict:
        return {"logprobs": []} if self._kind == "message" else {}

    def _event(self, obj: dict) -> bytes:
        return _event(self._seq, obj)


async def _response_events(engine, shape: _Shape, reqs: Sequence[GenerateReqInput],
                           prompt_ids: List[int], store: ResponseStore,
                           conversation: List[dict],
                           metrics: Optional[RequestMetrics] = None) -> AsyncIterator[bytes]:
    seq = itertools.count()
    items = _StreamedItems(seq, shape)
    split = ReasoningSplitter(shape.parser) if shape.parser else None
    result = O.SeqResult(0, prompt_ids)
    yield _event(seq, {"type": "response.created", "response": shape.response("in_progress", [])})
    yield _event(seq, {"type": "response.in_progress", "response": shape.response("in_progress", [])})
    for event in ([] if split else items.answer("")):   # no reasoning: the message at once
        yield event
    generations = merge_generations(engine, reqs, metrics)
    try:
        async for _, out in generations:
            result.feed(out)
            _raise_if_aborted([result])
            reasoning, answer = split.feed(out.text_delta) if split else ("", out.text_delta)
            if out.finished and split:
                more_reasoning, more_answer = split.finish()
                reasoning, answer = reasoning + more_reasoning, answer + more_answer
            if reasoning or (split is not None and split.had_reasoning):
                for event in items.reasoning(reasoning):    # announced once, even if empty
                    yield event
            if answer:
                for event in items.answer(answer):
                    yield event
    except Exception as e:  # noqa: BLE001 - the headers are out; tell the client in-band
        if not isinstance(e, ApiError):
            logger.exception("error while streaming response %s", shape.rid)
            e = ApiError(f"internal server error: {type(e).__name__}: {e}", 500)
        code = "server_error" if e.status >= 500 else "invalid_prompt"
        yield _event(seq, {"type": "error", "code": code, "message": e.message, "param": e.param})
        yield _event(seq, {"type": "response.failed", "response": shape.response(
            "failed", shape.output("incomplete", result.text), _usage(result),
            error={"code": code, "message": e.message})})
        return
    finally:
        await generations.aclose()
    response = _finish(shape, result, store, engine.identity, conversation)
    for event in items.close(response["output"]):
        yield event
    final = "response.completed" if response["status"] == "completed" else "response.incomplete"
    yield _event(seq, {"type": final, "response": response})


def _path_id(request: Request) -> str:
    """The {response_id} of the path; one that cannot be a response id (no "resp_" prefix) is
    a 400, as SGLang and vLLM answer it (an id that could be one but is not stored: 404)."""
    response_id = request.path_params["response_id"]
    if not response_id.startswith(RESPONSE_ID_PREFIX):
        raise bad_request(f"response_id must be a response id (it begins with "
                          f"{RESPONSE_ID_PREFIX!r}), got {response_id[:200]!r}",
                          param="response_id")
    return response_id


async def stored_response(request: Request, engine) -> Response:
    """/v1/responses/{response_id}: GET retrieves, DELETE deletes (one route, both methods)."""
    if request.method == "DELETE":
        return await delete_response(request, engine)
    return await retrieve_response(request, engine)


async def retrieve_response(request: Request, engine) -> Response:
    """GET /v1/responses/{response_id}: a stored response of this client, or 404."""
    if request.query_params.get("stream", "false").lower() not in ("false", "0", ""):
        raise bad_request("stream is not supported when retrieving a response (stored responses "
                          "are not replayed as events); leave it out", param="stream")
    response_id, store = _path_id(request), _store(request)
    entry = store.get(response_id, engine.identity)
    if entry is None:
        raise _not_found(response_id, "response_id", store)
    return JSONResponse(entry.response)


async def delete_response(request: Request, engine) -> Response:
    """DELETE /v1/responses/{response_id}: forget a stored response of this client, or 404."""
    response_id, store = _path_id(request), _store(request)
    if not store.delete(response_id, engine.identity):
        raise _not_found(response_id, "response_id", store)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})
