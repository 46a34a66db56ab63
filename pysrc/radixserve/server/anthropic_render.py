"""Anthropic Messages API bodies: the engine's outputs -> a Message, its streamed events, and
errors in Anthropic's shape.

Contract. Pure functions of what the engine produced (a SeqResult, and the pieces a route has
split out of the output text: thinking, text, tool calls in the chat route's form); nothing
here touches the engine or the connection, and nothing raises for what a client sent.

  Message       {id, type: "message", role: "assistant", model, content, stop_reason,
                stop_sequence, usage}; content in order: a thinking block (non-empty
                reasoning only; signature ""), a text block (non-empty text only), one
                tool_use block per call {id: toolu_..., name, input}
  stop_reason   tool_use (the output holds calls), max_tokens (the length limit),
                stop_sequence (a stop_sequences entry ended it; stop_sequence names it),
                end_turn (EOS, or a grammar's end)
  usage         input_tokens: prompt tokens computed for this request; cache_read_input_tokens:
                prompt tokens served from the radix cache (the two add up to the prompt);
                cache_creation_input_tokens: 0 (nothing is billed for caching here);
                output_tokens; with a reasoning parser output_tokens_details.thinking_tokens
  events        MessageEvents: message_start, then per block content_block_start,
                content_block_delta (text_delta, thinking_delta, input_json_delta; a thinking
                block's signature_delta just before its stop), content_block_stop, then
                message_delta {stop_reason, stop_sequence} with the final usage, message_stop;
                each framed as `event: <type>` + `data: <json>` (no [DONE])
  errors        {"type": "error", "error": {"type", "message"}}: error_response for a body
                with its status, error_event in a stream (ERROR_TYPES maps statuses)
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Tuple

from radixserve.errors import ApiError
from radixserve.server.jsonio import JSONResponse, dumps
from radixserve.server.render import SeqResult

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


# --------------------------------------------------------------------------- errors

def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(err: ApiError) -> dict:
    return {"type": "error", "error": {"type": error_type(err.status), "message": err.message}}


def error_response(err: ApiError, headers: Optional[dict] = None) -> JSONResponse:
    """err's body in Anthropic's shape with its status and headers (headers given here win);
    jsonio.error_response's counterpart for the Anthropic routes (and the door in front of
    them)."""
    merged = {**(err.headers or {}), **(headers or {})} or None
    return JSONResponse(error_body(err), status_code=err.status, headers=merged)


def encode(event: dict) -> bytes:
    """One server-sent event: `event: <its type>` and its JSON data."""
    return b"event: " + event["type"].encode() + b"\ndata: " + dumps(event) + b"\n\n"


def error_event(err: ApiError) -> bytes:
    return encode(error_body(err))


# --------------------------------------------------------------------------- the message

def stop_reason(result: SeqResult, has_calls: bool) -> Tuple[str, Optional[str]]:
    """(stop_reason, stop_sequence) of a finished sequence (module docstring)."""
    if has_calls:
        return "tool_use", None
    reason = result.finish_reason or {}
    if reason.get("type") == "length":
        return "max_tokens", None
    matched = reason.get("matched")
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def usage(result: SeqResult, thinking_tokens: Optional[int] = None) -> dict:
    prompt = result.prompt_tokens or len(result.prompt_ids)
    cached = min(result.cached_tokens, prompt)
    out = {"input_tokens": prompt - cached, "output_tokens": result.completion_tokens,
           "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}
    if thinking_tokens is not None:
        out["output_tokens_details"] = {"thinking_tokens": thinking_tokens}
    return out


def tool_use_block(call: dict) -> dict:
    """A parsed call (the chat route's {id: call_..., function: {name, arguments}}) as a
    tool_use block; its arguments are JSON the parser wrote."""
    fn = call["function"]
    return {"type": "tool_use", "id": "toolu_" + call["id"].split("_", 1)[-1],
            "name": fn["name"], "input": json.loads(fn["arguments"])}


def content_blocks(thinking: str, text: str, calls: List[dict]) -> List[dict]:
    blocks: List[dict] = []
    if thinking:
        blocks.append({"type": "thinking", "thinking": thinking, "signature": ""})
    if text:
        blocks.append({"type": "text", "text": text})
    return blocks + [tool_use_block(c) for c in calls]


def message(rid: str, model: str, content: List[dict], stop: Tuple[Optional[str], Optional[str]],
            usage_: dict) -> dict:
    return {"id": rid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage_}


# --------------------------------------------------------------------------- streaming

_EMPTY = {"thinking": {"type": "thinking", "thinking": "", "signature": ""},
          "text": {"type": "text", "text": ""}}
_DELTA = {"thinking": ("thinking_delta", "thinking"), "text": ("text_delta", "text")}


class MessageEvents:
    """One streamed message's events, in Anthropic's order (module docstring): start() once,
    then thinking / text pieces (a block opens with its first piece and closes when another
    kind begins: nothing reopens), tool_use() per call, finish() last. Each returns the event
    dicts to send (encode frames them)."""

    def __init__(self, rid: str, model: str):
        self._rid, self._model = rid, model
        self._index = -1
        self._open: Optional[str] = None        # the kind of the open block

    def start(self, usage_: dict) -> List[dict]:
        return [{"type": "message_start",
                 "message": message(self._rid, self._model, [], (None, None), usage_)}]

    def piece(self, kind: str, text: str) -> List[dict]:
        """A piece of the thinking ("thinking") or the answer ("text")."""
        if not text:
            return []
        events = []
        if self._open != kind:
            events += self._close()
            events += self._start(dict(_EMPTY[kind]))
            self._open = kind
        delta_type, field = _DELTA[kind]
        events.append({"type": "content_block_delta", "index": self._index,
                       "delta": {"type": delta_type, field: text}})
        return events

    def tool_use(self, call: dict) -> List[dict]:
        """One call: its block (input {}), its input as one input_json_delta, its stop."""
        events = self._close()
        block = tool_use_block(call)
        events += self._start({**block, "input": {}})
        events.append({"type": "content_block_delta", "index": self._index,
                       "delta": {"type": "input_json_delta",
                                 "partial_json": json.dumps(block["input"])}})
        return events + [{"type": "content_block_stop", "index": self._index}]

    def finish(self, stop: Tuple[str, Optional[str]], usage_: dict) -> List[dict]:
        return self._close() + [
            {"type": "message_delta", "delta": {"stop_reason": stop[0], "stop_sequence": stop[1]},
             "usage": usage_},
            {"type": "message_stop"}]

    def _start(self, block: Dict[str, Any]) -> List[dict]:
        self._index += 1
        return [{"type": "content_block_start", "index": self._index, "content_block": block}]

    def _close(self) -> List[dict]:
        if self._open is None:
            return []
        events = []
        if self._open == "thinking":
            events.append({"type": "content_block_delta", "index": self._index,
                           "delta": {"type": "signature_delta", "signature": ""}})
        self._open = None
        return events + [{"type": "content_block_stop", "index": self._index}]
