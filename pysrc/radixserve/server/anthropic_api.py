"""Anthropic's Messages API: POST /v1/messages and POST /v1/messages/count_tokens.

A request runs as a chat completion with one answer (the route skeleton of responses_api.py,
built from generation.py's parts): the body is validated once and mapped onto the chat route's
request (anthropic_requests.py); tools and tool_choice go through the chat route's tool
machinery (openai_api._chat_tools: parsers/tool_calls.py's formats, the tools block in the
prompt for templates without tool support, and the grammar that forces or constrains calls);
--reasoning-parser through the chat route's (openai_api._apply_reasoning_parser: a tool grammar
is wrapped to constrain the answer after the reasoning); the prompt renders through the chat
template exactly as /v1/chat/completions renders it (openai_api.render_messages). The output is
split into thinking, text and tool calls by the chat route's splitter (openai_api._ChoiceText)
and rendered by anthropic_render.py: a Message, or with stream true Anthropic's events.

count_tokens renders the same prompt (the same mapping, tools and template) and answers
{"input_tokens": N}: N is the prompt's token count, which equals a /v1/messages request's
usage.input_tokens + usage.cache_read_input_tokens for the same conversation. It is counted
whatever its length (a prompt too long for the context still gets its count).

Every error is Anthropic's shape (anthropic_render.error_response; app.py renders these
routes' errors, the door's included, with it): 400 invalid_request_error for a body the chat
route would refuse too (the same field types and bounds, sampling_params_from_dict, the same
prompt checks naming messages / max_tokens), 404 not_found_error for another model, 401
authentication_error without the server's key (sent as x-api-key or a Bearer token), 503
overloaded_error when the server is busy or aborted the request. An error after the stream
started is an `error` event, which ends the stream. A client that leaves a collected request
gets 499; leaving a stream aborts it: either way the engine frees the request's KV.
"""
from __future__ import annotations

import logging
import uuid
from typing import AsyncIterator, List, Optional, Sequence

from starlette.requests import Request
from starlette.responses import Response

from radixserve.engine.io import GenerateReqInput, expand_requests
from radixserve.errors import ApiError
from radixserve.parsers.reasoning import reasoning_token_count
from radixserve.server import anthropic_render as A
from radixserve.server import render as O
from radixserve.server import requests as R
from radixserve.server.anthropic_requests import (MessagesRequest, parse_count_tokens_request,
                                                  parse_messages_request)
from radixserve.server.generation import (ClientDisconnected, check_grammars, collect,
                                          merge_generations, validate_all)
from radixserve.server.jsonio import JSONResponse
from radixserve.server.metrics import RequestMetrics, request_metrics
from radixserve.server.openai_api import (_apply_reasoning_parser, _chat_tools, _ChoiceText,
                                          model_aliases, _raise_if_aborted, _Tools,
                                          render_messages)
from radixserve.server.security import read_json_object
from radixserve.server.sse import EventStreamResponse

logger = logging.getLogger(__name__)


async def _read(request: Request, engine) -> dict:
    body = await read_json_object(request)
    R.check_model(body, engine.served_model_name, model_aliases(engine))
    return body


def _tools(engine, parsed: MessagesRequest) -> _Tools:
    return _chat_tools(engine, {"tool_choice": parsed.tool_choice}, parsed.chat)


async def _prompt_ids(engine, parsed: MessagesRequest, tools: _Tools, must_fit: bool) -> List[int]:
    chat = parsed.chat
    return await render_messages(engine, tools.messages, chat.add_generation_prompt,
                                 tools.template_tools, template_kwargs=chat.template_kwargs,
                                 must_fit=must_fit)


async def count_tokens(request: Request, engine) -> Response:
    """POST /v1/messages/count_tokens."""
    parsed = parse_count_tokens_request(await _read(request, engine))
    ids = await _prompt_ids(engine, parsed, _tools(engine, parsed), must_fit=False)
    return JSONResponse({"input_tokens": len(ids)})


class _Output:
    """How one request's output becomes Anthropic content: the reasoning parser (None: no
    split) and the tool-call format (None: no tools in use)."""

    def __init__(self, engine, rid: str, parser: Optional[str], tools: _Tools):
        self.rid, self.model = rid, engine.served_model_name
        self.tokenizer = engine.tokenizer
        self.parser = parser
        self.fmt = tools.fmt if tools.active else None

    def splitter(self) -> _ChoiceText:
        return _ChoiceText(self.parser, True, self.fmt)

    def usage(self, result: O.SeqResult, split: _ChoiceText) -> dict:
        thinking = None if self.parser is None else reasoning_token_count(
            result.output_ids, split.reasoning, self.tokenizer)
        return A.usage(result, thinking)

    def message(self, result: O.SeqResult) -> dict:
        split = self.splitter()
        thinking, text = split.feed(result.text)
        more_thinking, more_text, calls = split.finish()
        content = A.content_blocks(thinking + more_thinking, text + more_text, calls)
        return A.message(self.rid, self.model, content, A.stop_reason(result, bool(calls)),
                         self.usage(result, split))


async def messages(request: Request, engine) -> Response:
    """POST /v1/messages."""
    body = await _read(request, engine)
    parsed = parse_messages_request(body)
    chat = parsed.chat
    tools = _tools(engine, parsed)
    origin = chat.sampling.grammar_key[0] if chat.sampling.grammar_key else None
    parser = _apply_reasoning_parser(engine, chat)
    prompt_ids = await _prompt_ids(engine, parsed, tools, must_fit=True)
    R.check_prompt_ids(prompt_ids, engine.model_config.vocab_size, engine.context_len,
                       chat.sampling.max_new_tokens, "messages", "max_tokens")
    rid = f"msg_{uuid.uuid4().hex}"
    reqs = expand_requests(rid, [prompt_ids], 1, [chat.sampling], chat.stream,
                           return_logprob=[False], logprob_start_len=[-1], top_logprobs_num=[0],
                           return_text_in_logprobs=False)
    validate_all(engine, reqs)
    await check_grammars(engine, reqs, body, origin=origin)
    output = _Output(engine, rid, parser, tools)
    result = O.SeqResult(0, prompt_ids)
    metrics = request_metrics(request)
    if chat.stream:
        return EventStreamResponse(_events(engine, output, reqs, result, metrics))
    try:
        await collect(engine, reqs, [result], request.receive, metrics)
    except ClientDisconnected:
        return Response(status_code=499)
    _raise_if_aborted([result])
    return JSONResponse(output.message(result))


async def _events(engine, output: _Output, reqs: Sequence[GenerateReqInput], result: O.SeqResult,
                  metrics: Optional[RequestMetrics]) -> AsyncIterator[bytes]:
    """The stream: message_start with the first output (its usage knows the cached prompt
    tokens by then), the blocks as their text arrives, the calls and message_delta /
    message_stop at the end; an error becomes an `error` event that ends the stream."""
    events = A.MessageEvents(output.rid, output.model)
    split = output.splitter()
    started = False
    generations = merge_generations(engine, reqs, metrics)
    try:
        async for _, out in generations:
            result.feed(out)
            _raise_if_aborted([result])
            batch: List[dict] = []
            if not started:
                batch += events.start(A.usage(result))
                started = True
            thinking, text = split.feed(out.text_delta)
            calls: List[dict] = []
            if out.finished:
                more_thinking, more_text, calls = split.finish()
                thinking, text = thinking + more_thinking, text + more_text
            batch += events.piece("thinking", thinking) + events.piece("text", text)
            if out.finished:
                for call in calls:
                    batch += events.tool_use(call)
                batch += events.finish(A.stop_reason(result, bool(calls)),
                                       output.usage(result, split))
            for event in batch:
                yield A.encode(event)
    except ApiError as e:
        yield A.error_event(e)
    except Exception as e:  # noqa: BLE001 - the headers are out; tell the client in-band
        logger.exception("error while streaming message %s", output.rid)
        yield A.error_event(ApiError(f"internal server error: {type(e).__name__}: {e}", 500))
    finally:
        await generations.aclose()
