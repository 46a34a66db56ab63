"""Request parsing and validation, and response builders, for the OpenAI and native routes.

Parsing never touches the engine: it turns a decoded JSON body into a typed request (or raises
ApiError naming the field to change). Tokenization and context-length checks need the tokenizer
and the context length and live in `check_context`, called by the routes. The builders turn the
engine's GenerateOutputs (accumulated in a SeqResult) into OpenAI / native response bodies.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from radixserve.engine.io import GenerateOutput, LogprobEntry
from radixserve.sampling.params import SamplingParams
from radixserve.server.errors import ApiError, bad_request

Prompt = Union[str, List[int]]          # text, or token ids
TokenText = Callable[[int], str]        # token id -> its text (for logprob entries without text)

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
MAX_TOP_LOGPROBS = 20
MAX_N = 128

# SGLang sampling names -> the OpenAI names a client sent them under (for error messages).
_OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


# --------------------------------------------------------------------------- field checking

def _type_name(v: Any) -> str:
    if v is None:
        return "null"
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object"}.get(type(v), type(v).__name__)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_CHECKS = {
    "number": _is_number,
    "integer": _is_int,
    "boolean": lambda v: isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
}


def get_field(body: dict, name: str, kind: str, default: Any = None) -> Any:
    """body[name] if present and not null, checked to be of `kind` (a key of _CHECKS);
    otherwise `default`. A wrong type is a 400 naming the field."""
    v = body.get(name)
    if v is None:
        return default
    if not _CHECKS[kind](v):
        article = "an" if kind[0] in "aeiou" else "a"
        raise bad_request(f"{name} must be {article} {kind}, got {_type_name(v)}", param=name)
    return v


def parse_json_body(raw: bytes) -> dict:
    """Decode a request body; anything but a JSON object is a 400."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON ({e}); send a JSON object")
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {_type_name(body)}")
    return body


def check_model(body: dict, served_model_name: str, aliases: Sequence[str] = ()) -> None:
    """`model` is optional; when given it must name the served model (404 otherwise)."""
    model = get_field(body, "model", "string")
    if model is not None and model != served_model_name and model not in aliases:
        raise ApiError(f"The model '{model}' does not exist; this server serves "
                       f"'{served_model_name}'", status=404, param="model")


def sampling_params_from_dict(d: dict, openai_names: bool = False) -> SamplingParams:
    """SamplingParams.from_dict with its ValueError turned into a 400 naming the field; with
    `openai_names`, under the OpenAI name the client used (max_tokens for max_new_tokens...)."""
    try:
        return SamplingParams.from_dict(d)
    except (ValueError, TypeError) as e:
        msg = str(e)
        m = re.match(r"[a-z_]+", msg)
        name = m.group(0) if m else None
        if openai_names and name in _OPENAI_NAMES:
            msg = _OPENAI_NAMES[name] + msg[len(name):]
            name = _OPENAI_NAMES[name]
        known = set(SamplingParams.__dataclass_fields__) | set(_OPENAI_NAMES.values())
        raise bad_request(msg, param=name if name in known else None) from None


# --------------------------------------------------------------------------- OpenAI requests

@dataclass
class ChatRequest:
    messages: List[dict]
    tools: Optional[List[dict]]
    add_generation_prompt: bool
    stream: bool
    include_usage: bool
    n: int
    logprobs: bool
    top_logprobs: int
    sampling: SamplingParams


@dataclass
class CompletionRequest:
    prompts: List[Prompt]
    echo: bool
    stream: bool
    include_usage: bool
    n: int
    logprobs: Optional[int]            # None: no logprobs; k: k top alternatives per token
    sampling: SamplingParams


def _openai_sampling(body: dict, default_max_tokens: Optional[int]) -> SamplingParams:
    """The OpenAI sampling fields (plus SGLang's extras) as a validated SamplingParams."""
    d: Dict[str, Any] = {}
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "min_p",
                 "repetition_penalty"):
        v = get_field(body, name, "number")
        if v is not None:
            d[name] = v
    for name in ("top_k", "seed"):
        v = get_field(body, name, "integer")
        if v is not None:
            d[name] = v
    for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
        v = get_field(body, name, "boolean")
        if v is not None:
            d[name] = v
    for name in ("regex", "ebnf"):
        v = get_field(body, name, "string")
        if v is not None:
            d[name] = v

    max_tokens = get_field(body, "max_tokens", "integer")
    max_param = "max_tokens"
    mct = get_field(body, "max_completion_tokens", "integer")
    if mct is not None:
        max_tokens, max_param = mct, "max_completion_tokens"
    if max_tokens is not None and max_tokens < 0:
        raise bad_request(f"{max_param} must be >= 0, got {max_tokens}", param=max_param)
    d["max_new_tokens"] = default_max_tokens if max_tokens is None else max_tokens

    min_tokens = get_field(body, "min_tokens", "integer")
    if min_tokens is not None:
        if min_tokens < 0:
            raise bad_request(f"min_tokens must be >= 0, got {min_tokens}", param="min_tokens")
        d["min_new_tokens"] = min_tokens

    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise bad_request("stop must be a non-empty string or a list of non-empty strings",
                              param="stop")
        if stop:
            d["stop"] = stop
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list) or not all(_is_int(t) and t >= 0 for t in stop_ids):
            raise bad_request("stop_token_ids must be a list of non-negative integers",
                              param="stop_token_ids")
        d["stop_token_ids"] = stop_ids

    schema = body.get("json_schema")
    if schema is not None:
        if not isinstance(schema, (str, dict)):
            raise bad_request("json_schema must be a JSON schema (object or string)", param="json_schema")
        d["json_schema"] = schema if isinstance(schema, str) else json.dumps(schema)
    rf = get_field(body, "response_format", "object")
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_schema":
            js = rf.get("json_schema")
            sch = js.get("schema") if isinstance(js, dict) else None
            if not isinstance(sch, dict):
                raise bad_request("response_format.json_schema.schema must be an object",
                                  param="response_format")
            d["json_schema"] = json.dumps(sch)
        elif kind == "json_object":
            d["json_schema"] = json.dumps({"type": "object"})
        elif kind != "text":
            raise bad_request("response_format.type must be text, json_object or json_schema",
                              param="response_format")

    bias = body.get("logit_bias")
    if bias:
        raise bad_request("logit_bias is not supported; remove it", param="logit_bias")
    return sampling_params_from_dict(d, openai_names=True)


def _n_and_stream(body: dict):
    n = get_field(body, "n", "integer", 1)
    if not 1 <= n <= MAX_N:
        raise bad_request(f"n must be between 1 and {MAX_N}, got {n}", param="n")
    best_of = get_field(body, "best_of", "integer")
    if best_of is not None and best_of != n:
        raise bad_request("best_of is not supported (only best_of == n); remove it", param="best_of")
    stream = get_field(body, "stream", "boolean", False)
    opts = get_field(body, "stream_options", "object")
    include_usage = False
    if opts is not None:
        if not stream:
            raise bad_request("stream_options is only allowed when stream is true",
                              param="stream_options")
        include_usage = get_field(opts, "include_usage", "boolean", False)
    return n, stream, include_usage


def _message_text(content: Any, where: str) -> str:
    """A message's content as one string: a string, null, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"{where}.content[{j}] must be a text part "
                                  f'{{"type": "text", "text": "..."}}; only text content is supported',
                                  param=f"{where}.content")
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad_request(f"{where}.content must be a string or a list of text parts, got "
                      f"{_type_name(content)}", param=f"{where}.content")


def parse_messages(messages: Any) -> List[dict]:
    """Validate chat messages; return copies with content flattened to strings and the
    `developer` role mapped to `system` (chat templates know the latter)."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty array of {role, content} objects",
                          param="messages")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise bad_request(f"{where} must be an object with role and content, got "
                              f"{_type_name(msg)}", param=where)
        role = msg.get("role")
        if role not in CHAT_ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(CHAT_ROLES)}; got {role!r}",
                              param=f"{where}.role")
        if "content" not in msg and not msg.get("tool_calls"):
            raise bad_request(f"{where}.content is required", param=f"{where}.content")
        m = dict(msg)
        m["role"] = "system" if role == "developer" else role
        m["content"] = _message_text(msg.get("content"), where)
        out.append(m)
    return out


def parse_chat_request(body: dict) -> ChatRequest:
    """Validate a /v1/chat/completions body (the model name is checked by the route)."""
    if "messages" not in body:
        raise bad_request("messages is required", param="messages")
    messages = parse_messages(body["messages"])
    tools = get_field(body, "tools", "array")
    n, stream, include_usage = _n_and_stream(body)
    logprobs = get_field(body, "logprobs", "boolean", False)
    top = get_field(body, "top_logprobs", "integer")
    if top is not None:
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise bad_request(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {top}",
                              param="top_logprobs")
        if not logprobs and top > 0:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    return ChatRequest(
        messages=messages,
        tools=tools,
        add_generation_prompt=get_field(body, "add_generation_prompt", "boolean", True),
        stream=stream, include_usage=include_usage, n=n,
        logprobs=logprobs, top_logprobs=top or 0,
        sampling=_openai_sampling(body, default_max_tokens=None),
    )


def parse_prompts(prompt: Any, param: str) -> List[Prompt]:
    """A prompt in any of the accepted shapes -> a list of prompts (text or token ids):
    str, list[str] (a batch), list[int] (one tokenized prompt), list[list[int]] (a batch)."""
    bad = bad_request(f"{param} must be a string, an array of strings, an array of token ids, "
                      f"or an array of arrays of token ids", param=param)
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise bad_request(f"{param} must not be empty", param=param) if prompt == [] else bad
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(_is_int(t) for t in prompt):
        return [list(prompt)]
    if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
        return [list(p) for p in prompt]
    raise bad


def parse_completion_request(body: dict) -> CompletionRequest:
    """Validate a /v1/completions body."""
    if body.get("prompt") is None:
        raise bad_request("prompt is required", param="prompt")
    prompts = parse_prompts(body["prompt"], "prompt")
    n, stream, include_usage = _n_and_stream(body)
    logprobs = get_field(body, "logprobs", "integer")
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {logprobs}",
                          param="logprobs")
    if body.get("suffix"):
        raise bad_request("suffix is not supported; remove it", param="suffix")
    return CompletionRequest(
        prompts=prompts,
        echo=get_field(body, "echo", "boolean", False),
        stream=stream, include_usage=include_usage, n=n, logprobs=logprobs,
        sampling=_openai_sampling(body, default_max_tokens=16),
    )


# --------------------------------------------------------------------------- native requests

@dataclass
class NativeGenerateRequest:
    prompts: List[Prompt]
    is_batch: bool
    sampling: List[SamplingParams]      # one per prompt
    stream: bool
    return_logprob: List[bool]
    logprob_start_len: List[int]
    top_logprobs_num: List[int]
    return_text_in_logprobs: bool
    rids: Optional[List[str]]            # one per prompt when given


def _per_prompt(body: dict, name: str, kind: str, default: Any, count: int) -> list:
    """A native field given once (applies to every prompt) or as a list of one per prompt."""
    v = body.get(name)
    if isinstance(v, list) and kind != "array":
        if len(v) != count:
            raise bad_request(f"{name} has {len(v)} entries but there are {count} prompts; give "
                              f"one value or one per prompt", param=name)
        return [get_field({name: x}, name, kind, default) for x in v]
    return [get_field(body, name, kind, default)] * count


def parse_generate_request(body: dict) -> NativeGenerateRequest:
    """Validate a native /generate body (SGLang's names)."""
    has_text, has_ids = body.get("text") is not None, body.get("input_ids") is not None
    if has_text == has_ids:
        raise bad_request("give exactly one of text or input_ids", param="text")
    if has_text:
        text = body["text"]
        if isinstance(text, str):
            prompts, is_batch = [text], False
        elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            prompts, is_batch = list(text), True
        else:
            raise bad_request("text must be a string or a non-empty array of strings", param="text")
    else:
        ids = body["input_ids"]
        if isinstance(ids, list) and ids and all(_is_int(t) for t in ids):
            prompts, is_batch = [list(ids)], False
        elif isinstance(ids, list) and ids and all(
                isinstance(p, list) and p and all(_is_int(t) for t in p) for p in ids):
            prompts, is_batch = [list(p) for p in ids], True
        else:
            raise bad_request("input_ids must be a non-empty array of token ids or an array of "
                              "such arrays", param="input_ids")
    count = len(prompts)

    sp = body.get("sampling_params")
    if sp is None or isinstance(sp, dict):
        sampling = [sampling_params_from_dict(sp or {})] * count
    elif isinstance(sp, list) and all(isinstance(x, dict) for x in sp):
        if len(sp) != count:
            raise bad_request(f"sampling_params has {len(sp)} entries but there are {count} "
                              "prompts; give one object or one per prompt", param="sampling_params")
        sampling = [sampling_params_from_dict(x) for x in sp]
    else:
        raise bad_request("sampling_params must be an object or an array of objects",
                          param="sampling_params")

    rid = body.get("rid")
    rids = None
    if rid is not None:
        if isinstance(rid, str) and count == 1:
            rids = [rid]
        elif isinstance(rid, list) and len(rid) == count and all(isinstance(r, str) for r in rid):
            rids = list(rid)
        else:
            raise bad_request("rid must be a string (one prompt) or an array of one string per "
                              "prompt", param="rid")

    top_nums = _per_prompt(body, "top_logprobs_num", "integer", 0, count)
    for t in top_nums:
        if not 0 <= t <= MAX_TOP_LOGPROBS:
            raise bad_request(f"top_logprobs_num must be between 0 and {MAX_TOP_LOGPROBS}, got {t}",
                              param="top_logprobs_num")
    return NativeGenerateRequest(
        prompts=prompts, is_batch=is_batch, sampling=sampling,
        stream=get_field(body, "stream", "boolean", False),
        return_logprob=_per_prompt(body, "return_logprob", "boolean", False, count),
        logprob_start_len=_per_prompt(body, "logprob_start_len", "integer", -1, count),
        top_logprobs_num=top_nums,
        return_text_in_logprobs=get_field(body, "return_text_in_logprobs", "boolean", False),
        rids=rids,
    )


# --------------------------------------------------------------------------- shared checks

def check_prompt_ids(ids: List[int], vocab_size: int, context_len: int,
                     max_new_tokens: Optional[int], prompt_param: str, max_param: str) -> None:
    """The checks that need the tokenized prompt: non-empty, ids in the vocabulary, and prompt
    plus output within the context length. Each failure is a 400 naming the field to change."""
    if not ids:
        raise bad_request(f"{prompt_param} is empty after tokenization; send at least one token",
                          param=prompt_param)
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"{prompt_param} contains token id {bad[0]} outside the vocabulary "
                          f"[0, {vocab_size})", param=prompt_param)
    if len(ids) >= context_len:
        raise bad_request(f"the prompt is {len(ids)} tokens long but the context length is "
                          f"{context_len}; shorten {prompt_param} to fewer than {context_len} tokens",
                          param=prompt_param)
    if max_new_tokens is not None and len(ids) + max_new_tokens > context_len:
        raise bad_request(f"{max_param}={max_new_tokens} plus the {len(ids)}-token prompt exceeds "
                          f"the context length {context_len}; lower {max_param} to at most "
                          f"{context_len - len(ids)}", param=max_param)


# --------------------------------------------------------------------------- results

@dataclass
class SeqResult:
    """One generated sequence, accumulated from its GenerateOutputs."""
    index: int
    prompt_ids: List[int]
    text: str = ""
    output_ids: List[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: Optional[Dict[str, Any]] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    output_token_logprobs: List[LogprobEntry] = field(default_factory=list)
    output_top_logprobs: List[List[LogprobEntry]] = field(default_factory=list)
    input_token_logprobs: Optional[List[LogprobEntry]] = None
    input_top_logprobs: Optional[List[List[LogprobEntry]]] = None

    def feed(self, out: GenerateOutput) -> None:
        self.text += out.text_delta
        self.output_ids.extend(out.output_ids_delta)
        self.output_token_logprobs.extend(out.output_token_logprobs_delta)
        self.output_top_logprobs.extend(out.output_top_logprobs_delta)
        if out.input_token_logprobs is not None:
            self.input_token_logprobs = out.input_token_logprobs
        if out.input_top_logprobs is not None:
            self.input_top_logprobs = out.input_top_logprobs
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens or len(self.prompt_ids)
        self.completion_tokens = out.completion_tokens or len(self.output_ids)
        self.cached_tokens = out.cached_tokens or self.cached_tokens
        if out.finished:
            self.finished = True
            self.finish_reason = out.finish_reason


def finish_reason_str(reason: Optional[Dict[str, Any]]) -> Optional[str]:
    """OpenAI's finish_reason: "stop" (EOS or a stop string/token) or "length". (The OpenAI
    routes turn an engine abort into an error, see `abort_error`; native routes pass it on.)"""
    return None if reason is None else reason.get("type")


def abort_error(reason: Optional[Dict[str, Any]]) -> Optional[ApiError]:
    """An engine abort ({"type": "abort", "message": ...}: the pool cannot hold the request,
    the server is shutting down, /abort_request) as the 503 an OpenAI client receives; None for
    any other finish."""
    if reason is None or reason.get("type") != "abort":
        return None
    return ApiError(f"the request was aborted by the server: {reason.get('message') or 'aborted'}", 503)


def matched_stop(reason: Optional[Dict[str, Any]]) -> Any:
    return None if reason is None else reason.get("matched")


def usage_dict(results: Sequence[SeqResult], n: int) -> dict:
    """Usage over all sequences: each prompt counted once (n sequences share it), completions
    summed; cached_tokens is the most any sequence of a prompt reused."""
    prompt_tokens = cached = 0
    for start in range(0, len(results), n):
        group = results[start:start + n]
        prompt_tokens += group[0].prompt_tokens or len(group[0].prompt_ids)
        cached += max(r.cached_tokens for r in group)
    completion = sum(r.completion_tokens for r in results)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _entry_text(entry: LogprobEntry, token_text: TokenText) -> str:
    return entry[2] if entry[2] is not None else token_text(entry[1])


def chat_logprobs(entries: Sequence[LogprobEntry], tops: Sequence[Sequence[LogprobEntry]],
                  num_top: int, token_text: TokenText) -> dict:
    """choices[].logprobs for chat: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    content = []
    for i, entry in enumerate(entries):
        text = _entry_text(entry, token_text)
        top = list(tops[i])[:num_top] if i < len(tops) and tops[i] else []
        content.append({
            "token": text, "logprob": entry[0], "bytes": list(text.encode("utf-8")),
            "top_logprobs": [{"token": (t := _entry_text(e, token_text)), "logprob": e[0],
                              "bytes": list(t.encode("utf-8"))} for e in top],
        })
    return {"content": content}


def completion_logprobs(entries: Sequence[LogprobEntry], tops: Sequence[Optional[Sequence[LogprobEntry]]],
                        num_top: int, token_text: TokenText, text_offset: int = 0) -> dict:
    """choices[].logprobs for completions: {tokens, token_logprobs, top_logprobs, text_offset}.
    text_offset counts characters from `text_offset` (the start of this piece within the
    choice's text). An entry whose logprob is None (the first prompt token under echo) gets a
    None top_logprobs entry too."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = text_offset
    for i, entry in enumerate(entries):
        text = _entry_text(entry, token_text)
        tokens.append(text)
        token_logprobs.append(entry[0])
        offsets.append(offset)
        offset += len(text)
        top = tops[i] if i < len(tops) else None
        if entry[0] is None or top is None:
            top_logprobs.append(None)
        else:
            top_logprobs.append({_entry_text(e, token_text): e[0] for e in list(top)[:num_top]})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def prompt_logprob_entries(result: SeqResult) -> tuple:
    """The prompt's (entries, tops) with one entry per prompt token, the first one's logprob
    None (nothing precedes it), whether or not the engine reported that first position."""
    entries = list(result.input_token_logprobs or [])
    tops = list(result.input_top_logprobs or [])
    missing = len(result.prompt_ids) - len(entries)
    if missing > 0:
        entries = [(None, t, None) for t in result.prompt_ids[:missing]] + entries
        tops = [None] * missing + tops
    tops += [None] * (len(entries) - len(tops))
    return entries, tops


def chat_response(rid: str, created: int, model: str, results: Sequence[SeqResult], n: int,
                  logprobs: bool, top_logprobs: int, token_text: TokenText) -> dict:
    choices = []
    for r in results:
        choice = {"index": r.index, "message": {"role": "assistant", "content": r.text},
                  "logprobs": None, "finish_reason": finish_reason_str(r.finish_reason),
                  "matched_stop": matched_stop(r.finish_reason)}
        if logprobs:
            choice["logprobs"] = chat_logprobs(r.output_token_logprobs, r.output_top_logprobs,
                                               top_logprobs, token_text)
        choices.append(choice)
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage_dict(results, n)}


def chat_chunk(rid: str, created: int, model: str, index: int, delta: dict,
               finish_reason: Optional[str] = None, logprobs: Optional[dict] = None,
               usage_null: bool = False, extra: Optional[dict] = None) -> dict:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    if extra:
        choice.update(extra)
    chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": [choice]}
    if usage_null:
        chunk["usage"] = None
    return chunk


def usage_chunk(rid: str, obj: str, created: int, model: str, usage: dict) -> dict:
    """The final chunk of a stream with include_usage: no choices, the whole request's usage."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage}


def completion_choice(r: SeqResult, echo_text: str, logprobs: Optional[int],
                      token_text: TokenText) -> dict:
    choice = {"index": r.index, "text": echo_text + r.text, "logprobs": None,
              "finish_reason": finish_reason_str(r.finish_reason),
              "matched_stop": matched_stop(r.finish_reason)}
    if logprobs is not None:
        entries, tops = [], []
        if echo_text:
            entries, tops = prompt_logprob_entries(r)
        entries += list(r.output_token_logprobs)
        tops += list(r.output_top_logprobs)
        choice["logprobs"] = completion_logprobs(entries, tops, logprobs, token_text)
    return choice


def completion_response(rid: str, created: int, model: str, choices: List[dict],
                        results: Sequence[SeqResult], n: int) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage_dict(results, n)}


def completion_chunk(rid: str, created: int, model: str, index: int, text: str,
                     finish_reason: Optional[str] = None, logprobs: Optional[dict] = None,
                     usage_null: bool = False, extra: Optional[dict] = None) -> dict:
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if extra:
        choice.update(extra)
    chunk = {"id": rid, "object": "text_completion", "created": created, "model": model,
             "choices": [choice]}
    if usage_null:
        chunk["usage"] = None
    return chunk


def native_result(r: SeqResult, rid: str, return_logprob: bool) -> dict:
    """A /generate result: {"text", "output_ids", "meta_info": {...}} (text and ids cumulative)."""
    meta = {"id": rid, "prompt_tokens": r.prompt_tokens or len(r.prompt_ids),
            "completion_tokens": r.completion_tokens, "cached_tokens": r.cached_tokens,
            "finish_reason": r.finish_reason}
    if return_logprob:
        meta["input_token_logprobs"] = [list(e) for e in (r.input_token_logprobs or [])]
        meta["output_token_logprobs"] = [list(e) for e in r.output_token_logprobs]
        meta["input_top_logprobs"] = [None if t is None else [list(e) for e in t]
                                      for t in (r.input_top_logprobs or [])]
        meta["output_top_logprobs"] = [[list(e) for e in t] for t in r.output_top_logprobs]
    return {"text": r.text, "output_ids": list(r.output_ids), "meta_info": meta}
