"""OpenAI-compatible routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models.

Chat and completions run one route skeleton (`_serve`): read the body and check `model`,
parse it (server/requests.py), build the prompts' token ids, check each against the context,
expand prompts x n into engine requests, validate them all with the engine and compile their
grammars, then either stream SSE chunks or collect the outputs into one JSON body, rendered by
server/render.py. A `_Route` holds what differs between the two: how the body becomes prompts
(chat: tools, reasoning parser and chat template over one conversation; completions: a batch
of texts or token ids, and echo), and which chunks and response the outputs render to.
Errors before the first byte are 4xx bodies (an engine abort of a collected request is the
503 or 400 of render.abort_error); an error after the stream started is sent as an error
event followed by [DONE]; a client that leaves a collected request gets 499.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from typing import AsyncIterator, Iterator, List, Optional, Sequence, Tuple, Type, Union

from starlette.requests import Request
from starlette.responses import Response

from radixserve.engine.io import GenerateOutput, GenerateReqInput, expand_requests
from radixserve.errors import ApiError, bad_request
from radixserve.parsers import tool_calls as T
from radixserve.parsers.reasoning import (ReasoningSplitter, reasoning_token_count,
                                          split_reasoning, with_reasoning_grammar)
from radixserve.server import render as O
from radixserve.server import requests as R
from radixserve.server.jsonio import JSONResponse
from radixserve.server.generation import (ClientDisconnected, check_grammars, collect,
                                          encode_prompt, merge_generations, validate_all)
from radixserve.server.metrics import RequestMetrics, request_metrics
from radixserve.server.security import read_json_object
from radixserve.server.sse import DONE_EVENT, EventStreamResponse, encode_event
from radixserve.tokenizer.chat_template import MAX_RENDER_SECONDS, RenderLimits

logger = logging.getLogger(__name__)



def _max_param(body: dict) -> str:
    return "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"


def exposes_paths(engine) -> bool:
    """--expose-server-info: the model's filesystem path may be shown (and named)."""
    return bool(engine.server_args.expose_server_info)


def model_aliases(engine) -> List[str]:
    """Other names a request's `model` may give the served model: its path, only where the
    path may be shown (else a client could probe for it)."""
    if not exposes_paths(engine):
        return []
    return [a for a in (getattr(engine, "model_path", None),) if a]


async def _stream_errors_as_events(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Pass events through; an exception turns into an error event. [DONE] always ends it
    (unless the stream was cancelled: the client is gone then)."""
    try:
        async for e in events:
            yield e
    except ApiError as e:
        yield encode_event(e.body())
    except Exception as e:  # noqa: BLE001 - the headers are out; tell the client in-band
        logger.exception("error while streaming")
        yield encode_event(ApiError(f"internal server error: {type(e).__name__}: {e}", 500).body())
    finally:
        await events.aclose()
    yield DONE_EVENT


def _raise_if_aborted(results: Sequence[O.SeqResult]) -> None:
    for r in results:
        err = O.abort_error(r.finish_reason)
        if err is not None:
            raise err


# --------------------------------------------------------------------------- the route skeleton

class _Route:
    """What one OpenAI generation route adds to the skeleton (`_serve`); one per request.

    The constructor parses the body (a 400 for a bad one) into `req`; `prompt_ids` builds the
    prompts' token ids (the skeleton checks each against the context, naming `prompt_param`),
    after which `prompts_checked` may prepare what rendering needs. `_serve` then sets `rid`,
    `created`, `model` and `results` (sequence i of prompt i // n) before any output arrives.
    Streaming: `opening_chunks` first, `chunks` for each engine output (its SeqResult already
    fed), and with include_usage a last chunk of `chunk_object` carrying `stream_usage`.
    Collected: `response` once every sequence finished without an abort."""

    rid_prefix: str             # the response id's prefix (chatcmpl, cmpl)
    chunk_object: str           # the streamed chunks' `object`
    prompt_param: str           # the field a prompt that does not fit names
    grammar_origin: Optional[str] = None   # check_grammars' origin (see there)
    req: Union[R.ChatRequest, R.CompletionRequest]

    rid: str
    created: int
    model: str
    results: List[O.SeqResult]

    def __init__(self, engine):
        self.engine = engine

    async def prompt_ids(self) -> List[List[int]]:
        raise NotImplementedError

    def prompts_checked(self, prompt_ids: List[List[int]]) -> None:
        """Every prompt passed check_prompt_ids; nothing has been sent to the engine yet."""

    def logprob_options(self) -> Tuple[bool, int, bool]:
        """(output logprobs?, top alternatives per token, prompt logprobs for echo?)."""
        raise NotImplementedError

    def opening_chunks(self) -> Iterator[dict]:
        return iter(())

    def chunks(self, i: int, out: GenerateOutput) -> Iterator[dict]:
        raise NotImplementedError

    def stream_usage(self) -> dict:
        return O.usage_dict(self.results, self.req.n)

    def response(self) -> dict:
        raise NotImplementedError


async def _serve(request: Request, engine, route_type: Type[_Route]) -> Response:
    """The skeleton of /v1/chat/completions and /v1/completions: parse the body, build the
    engine requests, then stream or collect, rendering through the route."""
    body = await read_json_object(request)
    R.check_model(body, engine.served_model_name, model_aliases(engine))
    route = route_type(engine, body)
    req = route.req
    prompt_ids = await route.prompt_ids()
    for ids in prompt_ids:
        R.check_prompt_ids(ids, engine.model_config.vocab_size, engine.context_len,
                           req.sampling.max_new_tokens, route.prompt_param, _max_param(body))
    route.prompts_checked(prompt_ids)
    count = len(prompt_ids)
    route.rid = f"{route.rid_prefix}-{uuid.uuid4().hex}"
    logprobs, top, echo_logprobs = route.logprob_options()
    reqs = expand_requests(route.rid, prompt_ids, req.n, [req.sampling] * count, req.stream,
                           **_logprob_args(logprobs, top, echo_logprobs, req.extras,
                                           req.stream and req.sampling.grammar_key is not None,
                                           count),
                           cache_salts=[req.cache_salt] * count, priority=req.priority)
    validate_all(engine, reqs)
    await check_grammars(engine, reqs, body, origin=route.grammar_origin)
    route.created = int(time.time())
    route.model = engine.served_model_name
    # sequence i belongs to prompt i // n
    route.results = [O.SeqResult(i, prompt_ids[i // req.n]) for i in range(len(reqs))]
    metrics = request_metrics(request)
    if req.stream:
        return EventStreamResponse(_stream_errors_as_events(_events(route, reqs, metrics)))
    try:
        await collect(engine, reqs, route.results, request.receive, metrics)
    except ClientDisconnected:
        return Response(status_code=499)
    _raise_if_aborted(route.results)
    return JSONResponse(route.response())


async def _events(route: _Route, reqs: Sequence[GenerateReqInput],
                  metrics: Optional[RequestMetrics] = None) -> AsyncIterator[bytes]:
    """A streamed request's SSE events (before [DONE], which _stream_errors_as_events adds):
    the route's opening chunks, its chunks for each output as the engine produces it (an abort
    raises), and with include_usage the usage chunk."""
    for chunk in route.opening_chunks():
        yield encode_event(chunk)
    async for i, out in merge_generations(route.engine, reqs, metrics):
        route.results[i].feed(out)
        _raise_if_aborted([route.results[i]])
        for chunk in route.chunks(i, out):
            yield encode_event(chunk)
    if route.req.include_usage:
        yield encode_event(O.usage_chunk(route.rid, route.chunk_object, route.created,
                                         route.model, route.stream_usage()))


def _logprob_args(logprobs: bool, top: int, echo_logprobs: bool, extras: R.OutputExtras,
                  stable_ids: bool, count: int) -> dict:
    """expand_requests' logprob settings for `count` prompts: output logprobs with `top`
    alternatives; prompt logprobs (from position 0) for echo_logprobs or vLLM's
    prompt_logprobs, the engine's top count the larger of the two (the builders cut each to
    its own). stable_ids (streamed token_ids under a grammar): logprobs on, which keeps
    jump-forward off, so streamed ids are never taken back."""
    want_prompt = echo_logprobs or extras.wants_prompt_logprobs
    return {"return_logprob": [bool(logprobs or want_prompt or stable_ids)] * count,
            "logprob_start_len": [0 if want_prompt else -1] * count,
            "top_logprobs_num": [max(top, extras.prompt_logprobs or 0)] * count,
            "return_text_in_logprobs": True}


# --------------------------------------------------------------------------- chat

def render_limits(engine) -> RenderLimits:
    """The chat-template bounds: --chat-template-timeout seconds when ServerArgs has that
    field, else MAX_RENDER_SECONDS; MAX_RENDERED_CHARS of output."""
    seconds = getattr(engine.server_args, "chat_template_timeout", None)
    return RenderLimits(max_seconds=MAX_RENDER_SECONDS if seconds is None else float(seconds))


async def _render_chat(engine, req: R.ChatRequest, tools: "_Tools") -> List[int]:
    """The chat's prompt ids (see render_messages)."""
    return await render_messages(engine, tools.messages, req.add_generation_prompt,
                                 tools.template_tools, template_kwargs=req.template_kwargs,
                                 must_fit=req.extras.truncate_prompt_tokens is None)


async def render_messages(engine, messages: List[dict], add_generation_prompt: bool = True,
                          template_tools: Optional[list] = None, param: str = "messages",
                          template_kwargs: Optional[dict] = None,
                          must_fit: bool = True, add_special_tokens: bool = False) -> List[int]:
    """Chat messages as prompt ids: the template renders them on a worker thread (a
    template's cost need not follow the input's size), bounded by render_limits: past the time
    limit the client gets a 400 (naming `param`) while the render stops at its next check
    point. The text is then tokenized as generation.encode_prompt does it (without adding
    special tokens: the template has them), so a rendered prompt too long for the context is
    refused before it is encoded unless `must_fit` is false (truncate_prompt_tokens will cut
    it). template_kwargs: the template's extra variables (chat_template_kwargs, names checked
    by schemas.ChatTemplateKwargs). add_special_tokens: the tokenizer's special tokens (BOS...)
    on top of the template's (vLLM's /tokenize option; the chat route never asks). Also used by
    /v1/responses, /v1/messages and /tokenize."""
    limits = render_limits(engine)
    work = asyncio.to_thread(engine.tokenizer.apply_chat_template, messages,
                             add_generation_prompt=add_generation_prompt,
                             tools=template_tools, render_limits=limits,
                             **(template_kwargs or {}))
    try:
        text = await asyncio.wait_for(work, limits.max_seconds)
    except asyncio.TimeoutError:
        raise bad_request(f"{param} cannot be rendered: the chat template took longer than "
                          f"{limits.max_seconds:g} s to render; send fewer or shorter messages",
                          param=param) from None
    except ValueError as e:
        raise bad_request(f"{param} cannot be rendered: {e}", param=param) from None
    return await encode_prompt(engine, text, param, add_special_tokens=add_special_tokens,
                               must_fit=must_fit)


@dataclasses.dataclass
class _Tools:
    """A chat's tools as this request uses them (parsers/tool_calls.py)."""
    functions: List[dict]          # [] when tool_choice is none or there are no tools
    fmt: T.ToolFormat              # the wire format (--tool-call-parser)
    messages: List[dict]           # what the template renders
    template_tools: Optional[list]  # tools handed to a template that renders them itself

    @property
    def active(self) -> bool:
        return bool(self.functions)


def _chat_tools(engine, body: dict, req: R.ChatRequest) -> _Tools:
    """Validate tools / tool_choice; the tool grammar goes into req.sampling."""
    functions, choice = T.check_tools(req.tools, body.get("tool_choice"))
    fmt = T.get_format(getattr(engine.server_args, "tool_call_parser", None)) \
        .bind(functions, engine.tokenizer)
    grammar = fmt.grammar(functions, choice, parallel=req.parallel_tool_calls)
    if grammar is not None:
        if req.sampling.grammar_key is not None:
            raise bad_request("tools (with tool_choice other than none) cannot be combined with "
                              "response_format or another grammar; drop one of them",
                              param="tool_choice")
        req.sampling = req.sampling.with_grammar("structural_tag", grammar)
    used = functions if choice != "none" else []
    if used and fmt.keep_special_tokens:     # the format's markers are special tokens (Mistral)
        req.sampling = dataclasses.replace(req.sampling, skip_special_tokens=False)
    knows = engine.tokenizer.template_handles_tools
    return _Tools(used, fmt, T.messages_for_template(req.messages, used, knows, fmt),
                  req.tools if (knows and used) else None)


def _apply_reasoning_parser(engine, req: R.ChatRequest) -> Optional[str]:
    """--reasoning-parser for this request, or None when the request asked for no split
    (separate_reasoning false). A grammar of the request (response_format, tools) is wrapped
    so that it constrains the answer after the reasoning (reasoning.with_reasoning_grammar);
    one that cannot be wrapped keeps the output as it is, unsplit."""
    parser = getattr(engine.server_args, "reasoning_parser", "none")
    if parser in (None, "none") or not req.separate_reasoning:
        return None
    sampling = with_reasoning_grammar(parser, req.sampling)
    if sampling is None:
        return None
    req.sampling = sampling
    return parser


def _with_reasoning(response: dict, parser: str, results: Sequence[O.SeqResult],
                    tokenizer) -> dict:
    """Split each choice's content into message.reasoning_content and the answer; usage gets
    completion_tokens_details.reasoning_tokens."""
    total = 0
    for choice in response["choices"]:
        msg = choice["message"]
        msg["reasoning_content"], msg["content"] = split_reasoning(msg["content"] or "", parser)
        total += reasoning_token_count(results[choice["index"]].output_ids,
                                       msg["reasoning_content"], tokenizer)
    response["usage"]["completion_tokens_details"] = {"reasoning_tokens": total}
    return response


def _with_tool_calls(response: dict, fmt: T.ToolFormat) -> dict:
    """Turn the calls in each choice's content into message.tool_calls."""
    for choice in response["choices"]:
        msg = choice["message"]
        content, calls = fmt.parse(msg["content"] or "")
        if calls:
            msg["content"], msg["tool_calls"] = content, calls
            choice["finish_reason"] = "tool_calls"
    return response


class _ChoiceText:
    """One streamed choice's text: the model's text deltas -> (reasoning, content) pieces to
    send now. With a reasoning parser the <think> block goes to reasoning (held until it ends
    when stream_reasoning is false); with tools, the calls (in the --tool-call-parser format)
    are cut out of the content and read as they come: tool_deltas() -> their delta.tool_calls
    entries so far (a call whose delta was taken stays a call). finish() -> (reasoning,
    content, tool calls) held back (every call, whole)."""

    def __init__(self, parser: Optional[str], stream_reasoning: bool,
                 tools: Optional[T.ToolFormat]):
        self._split = ReasoningSplitter(parser) if parser else None
        self._stream_reasoning = stream_reasoning
        self._held_reasoning = ""
        self._reasoning_text = ""          # all of it, for usage's reasoning_tokens
        self._tools = T.ToolCallStream(tools) if tools is not None else None

    def feed(self, text: str) -> Tuple[str, str]:
        if self._split is None:
            return "", self._content(text)
        reasoning, content = self._split.feed(text)
        return self._reasoning(reasoning, self._split.reasoning_done), self._content(content)

    def tool_deltas(self) -> List[dict]:
        """The calls' stream deltas (delta.tool_calls entries) since the last call."""
        return self._tools.take_deltas() if self._tools is not None else []

    @property
    def called(self) -> bool:
        """Whether the output made a whole call (finish_reason tool_calls, as when not
        streamed; a call cut off and sent in part does not count)."""
        return self._tools is not None and self._tools.whole > 0

    def finish(self) -> Tuple[str, str, List[dict]]:
        reasoning, content = self._split.finish() if self._split is not None else ("", "")
        reasoning, content = self._reasoning(reasoning, True), self._content(content)
        calls: List[dict] = []
        if self._tools is not None:
            rest, calls = self._tools.finish()
            content += rest
        return reasoning, content, calls

    @property
    def reasoning(self) -> Optional[str]:
        """The reasoning so far (None: no parser, or no reasoning block)."""
        if self._split is None or not self._split.had_reasoning:
            return None
        return self._reasoning_text

    def _reasoning(self, piece: str, release: bool) -> str:
        self._reasoning_text += piece
        if self._stream_reasoning:
            return piece
        self._held_reasoning += piece
        if not release:
            return ""
        out, self._held_reasoning = self._held_reasoning, ""
        return out

    def _content(self, piece: str) -> str:
        return self._tools.feed(piece) if self._tools is not None else piece


class _Chat(_Route):
    """/v1/chat/completions: one conversation rendered by the chat template; tools (their
    grammar, and the calls parsed out of the content) and --reasoning-parser (the reasoning
    split from the answer)."""

    rid_prefix = "chatcmpl"
    chunk_object = "chat.completion.chunk"
    prompt_param = "messages"
    req: R.ChatRequest

    def __init__(self, engine, body: dict):
        super().__init__(engine)
        self.req = req = R.parse_chat_request(body)
        self.tools = _chat_tools(engine, body, req)
        self.grammar_origin = req.sampling.grammar_key[0] if req.sampling.grammar_key else None
        self.parser = _apply_reasoning_parser(engine, req)
        self.texts: List[_ChoiceText] = []        # each streamed choice's text, once checked

    async def prompt_ids(self) -> List[List[int]]:
        req = self.req
        return [R.truncate_prompt(await _render_chat(self.engine, req, self.tools),
                                  req.extras.truncate_prompt_tokens, req.extras.truncation_side)]

    def prompts_checked(self, prompt_ids: List[List[int]]) -> None:
        req, tools = self.req, (self.tools.fmt if self.tools.active else None)
        self.texts = [_ChoiceText(self.parser, req.stream_reasoning, tools) for _ in range(req.n)]

    def logprob_options(self) -> Tuple[bool, int, bool]:
        return self.req.logprobs, self.req.top_logprobs, False

    def response(self) -> dict:
        req, results = self.req, self.results
        response = O.chat_response(self.rid, self.created, self.model, results, req.n,
                                   req.logprobs, req.top_logprobs,
                                   self.engine.tokenizer.token_text, req.extras)
        if self.parser is not None:
            response = _with_reasoning(response, self.parser, results, self.engine.tokenizer)
        return _with_tool_calls(response, self.tools.fmt) if self.tools.active else response

    # streaming

    def _usage(self, i: int) -> Optional[dict]:     # continuous_usage_stats: on every chunk
        return O.seq_usage(self.results[i]) if self.req.extras.continuous_usage else None

    def _chunk(self, i: int, delta: dict, finish_reason: Optional[str] = None,
               logprobs: Optional[dict] = None, extra: Optional[dict] = None,
               chunk_extra: Optional[dict] = None) -> dict:
        return O.chat_chunk(self.rid, self.created, self.model, i, delta, finish_reason,
                            logprobs, usage_null=self.req.include_usage, extra=extra,
                            usage=self._usage(i), chunk_extra=chunk_extra)

    def opening_chunks(self) -> Iterator[dict]:
        for i, r in enumerate(self.results):
            yield self._chunk(i, {"role": "assistant", "content": ""}, chunk_extra=(
                {"prompt_token_ids": r.prompt_ids} if self.req.extras.return_token_ids else None))

    def chunks(self, i: int, out: GenerateOutput) -> Iterator[dict]:
        req, ex = self.req, self.req.extras
        logprobs = None
        if req.logprobs and out.output_token_logprobs_delta:
            logprobs = O.chat_logprobs(out.output_token_logprobs_delta,
                                       out.output_top_logprobs_delta, req.top_logprobs,
                                       self.engine.tokenizer.token_text)
        reasoning, text = self.texts[i].feed(out.text_delta)
        ids = list(out.output_ids_delta) if ex.return_token_ids else []
        finish = O.finish_reason_str(out.finish_reason) if out.finished else None
        if out.finished:
            more_reasoning, rest, _ = self.texts[i].finish()
            reasoning, text = reasoning + more_reasoning, text + rest
            finish = "tool_calls" if self.texts[i].called else finish
        # delta.tool_calls: each call's id and name first, then its arguments JSON in pieces
        calls = self.texts[i].tool_deltas()
        if not (reasoning or text or logprobs or ids or calls or out.finished):
            return
        delta = {"reasoning_content": reasoning} if reasoning else {}
        if text:
            delta["content"] = text
        if calls:
            delta["tool_calls"] = calls
        extra = {"matched_stop": O.matched_stop(out.finish_reason)} if out.finished else {}
        if ex.return_token_ids:
            extra["token_ids"] = ids
        yield self._chunk(i, delta, finish, logprobs, extra=extra)

    def stream_usage(self) -> dict:
        reasoning_tokens = None if self.parser is None else sum(
            reasoning_token_count(r.output_ids, t.reasoning, self.engine.tokenizer)
            for r, t in zip(self.results, self.texts))
        return O.usage_dict(self.results, self.req.n, reasoning_tokens)


async def chat_completions(request: Request, engine) -> Response:
    return await _serve(request, engine, _Chat)


# --------------------------------------------------------------------------- completions

class _Completions(_Route):
    """/v1/completions: a batch of prompts (texts or token ids), each run n times; echo puts
    the prompt (and with logprobs its logprobs) before each choice's text."""

    rid_prefix = "cmpl"
    chunk_object = "text_completion"
    prompt_param = "prompt"
    req: R.CompletionRequest

    def __init__(self, engine, body: dict):
        super().__init__(engine)
        self.req = R.parse_completion_request(body)
        self.encoded: List[List[int]] = []        # each prompt's ids before truncation
        self.seq_echo: List[str] = []             # each sequence's echoed prompt ("" without echo)
        self.sent_chars: List[int] = []           # characters of choice i's text streamed so far
        self.started: List[bool] = []             # choice i's first chunk was sent

    async def prompt_ids(self) -> List[List[int]]:
        req, ex = self.req, self.req.extras
        self.encoded = [await encode_prompt(self.engine, p, "prompt",
                                            add_special_tokens=req.add_special_tokens,
                                            must_fit=ex.truncate_prompt_tokens is None)
                        if isinstance(p, str) else p for p in req.prompts]
        return [R.truncate_prompt(ids, ex.truncate_prompt_tokens, ex.truncation_side)
                for ids in self.encoded]

    def prompts_checked(self, prompt_ids: List[List[int]]) -> None:
        req, tok = self.req, self.engine.tokenizer
        echo_texts = [_echo_text(tok, p, ids, len(ids) < len(whole)) if req.echo else ""
                      for p, ids, whole in zip(req.prompts, prompt_ids, self.encoded)]
        # sequence i belongs to prompt i // n
        self.seq_echo = [echo_texts[i // req.n] for i in range(len(prompt_ids) * req.n)]
        self.sent_chars = [0] * len(self.seq_echo)
        self.started = [False] * len(self.seq_echo)

    def logprob_options(self) -> Tuple[bool, int, bool]:
        want = self.req.logprobs is not None
        return want, self.req.logprobs or 0, want and self.req.echo

    def response(self) -> dict:
        req = self.req
        choices = [O.completion_choice(r, self.seq_echo[r.index], req.logprobs,
                                       self.engine.tokenizer.token_text, echo=req.echo,
                                       extras=req.extras) for r in self.results]
        return O.completion_response(self.rid, self.created, self.model, choices, self.results,
                                     req.n)

    # streaming

    def chunks(self, i: int, out: GenerateOutput) -> Iterator[dict]:
        req, ex, r = self.req, self.req.extras, self.results[i]
        text = out.text_delta
        entries, tops = list(out.output_token_logprobs_delta), list(out.output_top_logprobs_delta)
        extra = {}
        if not self.started[i]:
            self.started[i] = True
            text = self.seq_echo[i] + text
            if req.echo and req.logprobs is not None:
                p_entries, p_tops = O.prompt_logprob_entries(r)
                entries, tops = p_entries + entries, p_tops + tops
            if ex.return_token_ids:                  # vLLM: with the choice's first chunk
                extra["prompt_token_ids"] = list(r.prompt_ids)
        logprobs = None
        if req.logprobs is not None and entries:
            logprobs = O.completion_logprobs(entries, tops, req.logprobs,
                                             self.engine.tokenizer.token_text, self.sent_chars[i])
        if ex.return_token_ids:
            extra["token_ids"] = list(out.output_ids_delta)
        if not (text or logprobs or out.finished or extra.get("token_ids") or
                "prompt_token_ids" in extra):
            return
        self.sent_chars[i] += len(text)
        finish = O.finish_reason_str(out.finish_reason) if out.finished else None
        if out.finished:
            extra["matched_stop"] = O.matched_stop(out.finish_reason)
        yield O.completion_chunk(self.rid, self.created, self.model, i, text, finish, logprobs,
                                 usage_null=req.include_usage, extra=extra,
                                 usage=O.seq_usage(r) if ex.continuous_usage else None)


async def completions(request: Request, engine) -> Response:
    return await _serve(request, engine, _Completions)


def _echo_text(tok, prompt: R.Prompt, ids: List[int], truncated: bool) -> str:
    """The prompt as echo shows it: the text sent, or (token ids, or a prompt that
    truncate_prompt_tokens cut) the ids decoded with their special tokens, so the echoed text
    matches the prompt's logprob tokens."""
    if isinstance(prompt, str) and not truncated:
        return prompt
    return tok.decode(ids, skip_special_tokens=False)



# --------------------------------------------------------------------------- models

def _model_card(engine) -> dict:
    """The served model's card; root is its path only with --expose-server-info (else its
    name, as vLLM shows a model given by name). vocab_size (ours) lets a benchmark client draw
    token-id prompts without knowing where the model lives."""
    root = engine.model_path if exposes_paths(engine) else engine.served_model_name
    return {"id": engine.served_model_name, "object": "model", "created": 0,
            "owned_by": "radixserve", "root": root, "max_model_len": engine.context_len,
            "vocab_size": engine.model_config.vocab_size}


async def list_models(request: Request, engine) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(engine)]})


async def retrieve_model(request: Request, engine) -> Response:
    """GET /v1/models/{id} (the openai client's models.retrieve): the served model's card for
    its name (or an alias), 404 in OpenAI's error shape for any other id."""
    model_id = request.path_params["model_id"]
    if model_id != engine.served_model_name and model_id not in model_aliases(engine):
        raise ApiError(f"The model '{model_id[:200]}' does not exist; this server serves "
                       f"'{engine.served_model_name}'", status=404, param="model")
    return JSONResponse(_model_card(engine))
