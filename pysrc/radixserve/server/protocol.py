"""Request parsing and validation, and response builders, for the OpenAI and native routes.

Parsing never touches the engine: it validates a decoded JSON body against its pydantic model
(server/schemas.py: types, caps, and the sampling numbers' bounds from sampling/params.BOUNDS),
applies the rules that span several fields (below), and returns a typed request whose
SamplingParams passed SamplingParams.verify(bounds_checked=True) (its rules beyond the numbers'
ranges, which the schema checked), so the engine does not verify them again; any problem is an
ApiError naming the field to change (param: its dotted location, from the error's param, never
from its message). Tokenization and context-length checks need the tokenizer and the context
length: `check_prompt_ids` (engine/validation.check_prompt in the client's words), called by the
routes once per prompt; they then tell the engine (generation.validate_all). The builders
turn the engine's GenerateOutputs (accumulated in a SeqResult) into OpenAI / native response
bodies.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from radixserve.engine import validation
from radixserve.engine.io import GenerateOutput, LogprobEntry, apply_ids_delta
from radixserve.errors import ApiError, RequestError, bad_request
from radixserve.sampling.params import SamplingParams
from radixserve.server import schemas as S

Prompt = Union[str, List[int]]          # text, or token ids
TokenText = Callable[[int], str]        # token id -> its text (for logprob entries without text)

CHAT_ROLES = S.CHAT_ROLES
MAX_TOP_LOGPROBS = S.MAX_TOP_LOGPROBS
MAX_N = S.MAX_N

# SGLang sampling names -> the OpenAI names a client sent them under (for error messages).
_OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


# --------------------------------------------------------------------------- body and model

def parse_json_body(raw: bytes) -> dict:
    """Decode a request body; anything but a JSON object is a 400. (The routes read bodies
    with security.read_json_object, which adds the door's rules.)"""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON ({e}); send a JSON object")
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {S.describe(body)}")
    return body


def check_model(body: dict, served_model_name: str, aliases: Sequence[str] = ()) -> None:
    """`model` is optional; when given it must name the served model (404 otherwise). Called
    before the body is parsed, so a request for another model gets 404 whatever else it has."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request(f"model must be a string, got {S.describe(model)}", param="model")
    if model is not None and model != served_model_name and model not in aliases:
        raise ApiError(f"The model '{model[:200]}' does not exist; this server serves "
                       f"'{served_model_name}'", status=404, param="model")


def sampling_params_from_dict(d: dict, openai_names: bool = False,
                              where: Optional[str] = None,
                              names: Optional[Dict[str, str]] = None) -> SamplingParams:
    """SamplingParams.from_dict(d, bounds_checked=True) for `d` built from a request the schema
    validated (so its numbers were checked against BOUNDS already), its RequestError turned
    into a 400 naming the field (the error's param) as the client sent it: under the OpenAI
    name with `openai_names` (max_tokens for max_new_tokens...), or as `names` maps it
    (max_output_tokens), inside `where` (sampling_params[1].seed); an error of no one field
    names `where`. Also a 400 for min_new_tokens above max_new_tokens (no sequence could
    satisfy both), naming min_new_tokens."""
    names = {**(_OPENAI_NAMES if openai_names else {}), **(names or {})}

    def shown(field: str) -> str:
        name = names.get(field, field)
        return f"{where}.{name}" if where else name

    try:
        sp = SamplingParams.from_dict(d, bounds_checked=True)
    except RequestError as e:
        if e.param is None:
            raise bad_request(str(e), param=where) from None
        raise bad_request(e.named(shown(e.param)), param=shown(e.param)) from None
    if sp.max_new_tokens is not None and sp.min_new_tokens > sp.max_new_tokens:
        low, high = shown("min_new_tokens"), shown("max_new_tokens")
        raise bad_request(f"{low}={sp.min_new_tokens} is more than {high}={sp.max_new_tokens}: a "
                          f"sequence ends at {high} tokens; lower {low} or raise {high}", param=low)
    return sp


# --------------------------------------------------------------------------- OpenAI requests

@dataclass
class OutputExtras:
    """vLLM's output extras, on both routes."""
    prompt_logprobs: Optional[int] = None         # k: prompt_logprobs with the top k per position
    truncate_prompt_tokens: Optional[int] = None  # keep only the last k prompt tokens
    return_token_ids: bool = False                # prompt_token_ids and token_ids in the response
    continuous_usage: bool = False                # every streamed chunk carries usage so far

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.prompt_logprobs is not None


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
    extras: OutputExtras = field(default_factory=lambda: OutputExtras())
    parallel_tool_calls: bool = True
    cache_salt: Optional[str] = None   # prefix sharing only with requests of the same salt
    template_kwargs: Dict[str, Any] = field(default_factory=dict)   # chat_template_kwargs
    separate_reasoning: bool = True    # with --reasoning-parser (parsers/reasoning.py)
    stream_reasoning: bool = True


@dataclass
class CompletionRequest:
    prompts: List[Prompt]
    echo: bool
    stream: bool
    include_usage: bool
    n: int
    logprobs: Optional[int]            # None: no logprobs; k: k top alternatives per token
    sampling: SamplingParams
    extras: OutputExtras = field(default_factory=lambda: OutputExtras())
    add_special_tokens: bool = True    # for text prompts
    cache_salt: Optional[str] = None


def _json_text(spec: Union[str, dict]) -> str:
    return spec if isinstance(spec, str) else json.dumps(spec)


def json_format_schema(format_type: str, schema: Optional[dict]) -> str:
    """The JSON schema (as the JSON text SamplingParams.json_schema takes) that an OpenAI
    output format constrains to: json_object is any object, json_schema its schema. Chat's
    and completions' response_format, and /v1/responses' text.format."""
    return json.dumps({"type": "object"} if format_type == "json_object" else schema)


def _choice_regex(choices: Sequence[str]) -> str:
    """The output is exactly one of `choices`: the alternation of the escaped strings."""
    return "(" + "|".join(map(re.escape, choices)) + ")"


def _grammar(req: S._OpenAIRequest) -> Dict[str, str]:
    """The request's grammar as the one SamplingParams field it sets. Sources: json_schema,
    regex, ebnf, structural_tag (SGLang), response_format json_object / json_schema (OpenAI;
    json_object is the schema {"type": "object"}), guided_json / guided_regex / guided_grammar /
    guided_choice and structured_outputs.{json, regex, choice, grammar, json_object,
    structural_tag} (vLLM; a choice list is the regex alternation of the escaped choices). More
    than one source is a 400 naming them."""
    given = []                                   # (field the client used, SamplingParams field, spec)
    for name in ("json_schema", "structural_tag"):
        if getattr(req, name) is not None:
            given.append((name, name, _json_text(getattr(req, name))))
    for name in ("regex", "ebnf"):
        if getattr(req, name) is not None:
            given.append((name, name, getattr(req, name)))
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        given.append(("response_format", "json_schema", json_format_schema("json_object", None)))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise bad_request("response_format.json_schema is required when response_format.type "
                              "is json_schema", param="response_format.json_schema")
        given.append(("response_format", "json_schema",
                      json_format_schema("json_schema", rf.json_schema.schema_)))
    if req.guided_json is not None:
        given.append(("guided_json", "json_schema", _json_text(req.guided_json)))
    if req.guided_regex is not None:
        given.append(("guided_regex", "regex", req.guided_regex))
    if req.guided_grammar is not None:
        given.append(("guided_grammar", "ebnf", req.guided_grammar))
    if req.guided_choice is not None:
        given.append(("guided_choice", "regex", _choice_regex(req.guided_choice)))
    so = req.structured_outputs
    if so is not None:
        for name, kind, value, text in (
                ("json", "json_schema", so.json_, _json_text),
                ("regex", "regex", so.regex, str),
                ("choice", "regex", so.choice, _choice_regex),
                ("grammar", "ebnf", so.grammar, str),
                ("json_object", "json_schema", so.json_object or None,
                 lambda _: json.dumps({"type": "object"})),
                ("structural_tag", "structural_tag", so.structural_tag, _json_text)):
            if value is not None:
                given.append((f"structured_outputs.{name}", kind, text(value)))
    if len(given) > 1:
        names = [g[0] for g in given]
        raise bad_request(f"give at most one output constraint (json_schema, regex, ebnf, "
                          f"structural_tag, response_format, guided_*, structured_outputs.*); "
                          f"got {', '.join(names)}",
                          param=names[1])
    return {kind: spec for _, kind, spec in given}


def _openai_sampling(req: S._OpenAIRequest, n: int, default_max_tokens: Optional[int]) -> SamplingParams:
    """The OpenAI sampling fields (plus SGLang's and vLLM's extras) as a verified
    SamplingParams (n included, so seed + n - 1 is checked; the routes run n copies of n=1)."""
    d: Dict[str, Any] = {"n": n}
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "seed", "ignore_eos", "skip_special_tokens",
                 "spaces_between_special_tokens", "no_stop_trim", "stop_token_ids", "stop_regex",
                 "logit_bias"):
        v = getattr(req, name)
        if v is not None:
            d[name] = v
    if req.include_stop_str_in_output:                 # vLLM's name for no_stop_trim
        d["no_stop_trim"] = True
    max_tokens = getattr(req, "max_completion_tokens", None)
    if max_tokens is None:
        max_tokens = req.max_tokens
    d["max_new_tokens"] = default_max_tokens if max_tokens is None else max_tokens
    if req.min_tokens is not None:
        d["min_new_tokens"] = req.min_tokens
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    if stop:
        d["stop"] = list(stop)
    d.update(_grammar(req))
    return sampling_params_from_dict(d, openai_names=True)


def _n_and_stream(req: S._OpenAIRequest):
    n = 1 if req.n is None else req.n
    if req.best_of is not None and req.best_of != n:
        raise bad_request("best_of is not supported (only best_of == n); remove it", param="best_of")
    stream = bool(req.stream)
    include_usage = False
    if req.stream_options is not None:
        if not stream:
            raise bad_request("stream_options is only allowed when stream is true",
                              param="stream_options")
        include_usage = bool(req.stream_options.include_usage)
    return n, stream, include_usage


def _output_extras(req: S._OpenAIRequest) -> OutputExtras:
    """vLLM's extras: prompt_logprobs (not with stream, as vLLM), truncate_prompt_tokens,
    return_token_ids, stream_options.continuous_usage_stats (counts with include_usage)."""
    if req.prompt_logprobs is not None and req.stream:
        raise bad_request("prompt_logprobs is not available when stream is true (as in vLLM); "
                          "drop one of them", param="prompt_logprobs")
    so = req.stream_options
    return OutputExtras(
        prompt_logprobs=req.prompt_logprobs, truncate_prompt_tokens=req.truncate_prompt_tokens,
        return_token_ids=bool(req.return_token_ids),
        continuous_usage=bool(so is not None and so.include_usage and so.continuous_usage_stats))


def truncate_prompt(ids: List[int], keep: Optional[int]) -> List[int]:
    """truncate_prompt_tokens: only the last `keep` tokens of the prompt (all when None)."""
    return ids if keep is None or len(ids) <= keep else ids[len(ids) - keep:]


def _message_dict(i: int, msg: S.ChatMessage) -> dict:
    """A validated message as the dict the chat template sees: every key the client sent,
    content flattened to one string (text parts joined by newlines), `developer` as `system`."""
    if "content" not in msg.model_fields_set and not msg.tool_calls:
        raise bad_request(f"messages[{i}].content is required", param=f"messages[{i}].content")
    m = msg.model_dump(exclude_unset=True)
    content = msg.content
    if content is None:
        m["content"] = ""
    elif not isinstance(content, str):
        m["content"] = "\n".join(part.text for part in content)
    m["role"] = "system" if msg.role == "developer" else msg.role
    return m


def parse_messages(messages: Any) -> List[dict]:
    """Validate chat messages (schemas.ChatMessage); return dicts for the chat template (see
    _message_dict)."""
    validated = S.parse_value(S.MESSAGES, messages, "messages")
    return [_message_dict(i, m) for i, m in enumerate(validated)]


def parse_chat_request(body: dict) -> ChatRequest:
    """Validate a /v1/chat/completions body (the model name is checked by the route)."""
    req = S.parse(S.ChatCompletionRequest, body)
    n, stream, include_usage = _n_and_stream(req)
    logprobs = bool(req.logprobs)
    top = req.top_logprobs or 0
    if top > 0 and not logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    return ChatRequest(
        messages=[_message_dict(i, m) for i, m in enumerate(req.messages)],
        tools=req.tools,
        add_generation_prompt=True if req.add_generation_prompt is None else req.add_generation_prompt,
        stream=stream, include_usage=include_usage, n=n,
        logprobs=logprobs, top_logprobs=top,
        sampling=_openai_sampling(req, n, default_max_tokens=None),
        extras=_output_extras(req),
        parallel_tool_calls=req.parallel_tool_calls is not False,
        cache_salt=req.cache_salt,
        template_kwargs=dict(req.chat_template_kwargs or {}),
        separate_reasoning=req.separate_reasoning is not False,
        stream_reasoning=req.stream_reasoning is not False,
    )


def parse_prompts(prompt: Any, param: str) -> List[Prompt]:
    """A prompt in any of the accepted shapes (schemas.Prompt) -> a list of prompts (text or
    token ids): str, list[str] (a batch), list[int] (one tokenized prompt), list[list[int]]."""
    prompt = S.parse_value(S.PROMPT, prompt, param)
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return [p if isinstance(p, str) else list(p) for p in prompt]


def _check_sequences(num_prompts: int, n: int, param: str) -> None:
    if num_prompts * n > S.MAX_SEQUENCES:
        raise bad_request(f"the request asks for {num_prompts} prompts x n={n} = {num_prompts * n} "
                          f"sequences; at most {S.MAX_SEQUENCES} are allowed per request: send "
                          f"fewer prompts or a smaller n", param=param)


def parse_completion_request(body: dict) -> CompletionRequest:
    """Validate a /v1/completions body."""
    req = S.parse(S.CompletionRequest, body)
    prompts = parse_prompts(req.prompt, "prompt")
    n, stream, include_usage = _n_and_stream(req)
    _check_sequences(len(prompts), n, "n")
    if req.suffix:
        raise bad_request("suffix is not supported; remove it", param="suffix")
    return CompletionRequest(
        prompts=prompts, echo=bool(req.echo),
        stream=stream, include_usage=include_usage, n=n, logprobs=req.logprobs,
        sampling=_openai_sampling(req, n, default_max_tokens=16),
        extras=_output_extras(req),
        add_special_tokens=req.add_special_tokens is not False,
        cache_salt=req.cache_salt,
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
    cache_salts: List[Optional[str]]     # one per prompt (None: unsalted)


def _per_prompt(value: Any, name: str, default: Any, count: int) -> list:
    """A native field given once (applies to every prompt) or as a list of one per prompt."""
    if value is None:
        return [default] * count
    if isinstance(value, list):
        if len(value) != count:
            raise bad_request(f"{name} has {len(value)} entries but there are {count} prompts; give "
                              f"one value or one per prompt", param=name)
        return list(value)
    return [value] * count


def native_sampling_dict(sp: S.SamplingParamsBody) -> dict:
    """A validated sampling_params object as SamplingParams.from_dict's input: only the keys
    the client sent, json_schema / structural_tag objects as JSON text."""
    d = sp.model_dump(exclude_unset=True)
    for name in ("json_schema", "structural_tag"):
        if d.get(name) is not None:
            d[name] = _json_text(d[name])
    return d


def parse_generate_request(body: dict) -> NativeGenerateRequest:
    """Validate a native /generate body (SGLang's names)."""
    req = S.parse(S.GenerateRequest, body)
    if (req.text is None) == (req.input_ids is None):
        raise bad_request("give exactly one of text or input_ids", param="text")
    if req.text is not None:
        is_batch = isinstance(req.text, list)
        prompts: List[Prompt] = list(req.text) if is_batch else [req.text]
    else:
        is_batch = isinstance(req.input_ids[0], list)
        prompts = [list(p) for p in req.input_ids] if is_batch else [list(req.input_ids)]
    count = len(prompts)

    sp = req.sampling_params
    if isinstance(sp, list):
        if len(sp) != count:
            raise bad_request(f"sampling_params has {len(sp)} entries but there are {count} "
                              "prompts; give one object or one per prompt", param="sampling_params")
        sampling = [sampling_params_from_dict(native_sampling_dict(x), where=f"sampling_params[{i}]")
                    for i, x in enumerate(sp)]
    else:
        one = {} if sp is None else native_sampling_dict(sp)
        sampling = [sampling_params_from_dict(one, where="sampling_params")] * count
    _check_sequences(count, max(s.n for s in sampling), "sampling_params.n")

    rids = None
    if req.rid is not None:
        if isinstance(req.rid, str) and count != 1:
            raise bad_request("rid must be a string (one prompt) or an array of one string per "
                              "prompt", param="rid")
        rids = _per_prompt(req.rid, "rid", None, count)
    return NativeGenerateRequest(
        prompts=prompts, is_batch=is_batch, sampling=sampling,
        stream=bool(req.stream),
        return_logprob=_per_prompt(req.return_logprob, "return_logprob", False, count),
        logprob_start_len=_per_prompt(req.logprob_start_len, "logprob_start_len", -1, count),
        top_logprobs_num=_per_prompt(req.top_logprobs_num, "top_logprobs_num", 0, count),
        return_text_in_logprobs=bool(req.return_text_in_logprobs),
        rids=rids,
        cache_salts=_per_prompt(req.cache_salt, "cache_salt", None, count),
    )


def parse_abort_request(body: dict) -> Optional[str]:
    """The rid of an /abort_request body; None for abort_all."""
    req = S.parse(S.AbortRequest, body)
    if req.abort_all:
        return None
    if not req.rid:
        raise bad_request("give the rid of a live request, or abort_all: true", param="rid")
    return req.rid


# --------------------------------------------------------------------------- shared checks

def prompt_too_long(num_tokens: int, context_len: int, prompt_param: str) -> ApiError:
    """The 400 for a prompt of num_tokens >= context_len tokens (engine/validation's words)."""
    e = validation.prompt_too_long(num_tokens, context_len, prompt_param)
    return bad_request(str(e), param=e.param)


def check_prompt_ids(ids: List[int], vocab_size: int, context_len: int,
                     max_new_tokens: Optional[int], prompt_param: str, max_param: str) -> None:
    """engine/validation.check_prompt in the client's words, once per prompt: non-empty,
    within the context length, ids in the vocabulary (walked only once the length is known to
    fit), and prompt plus output within the context length. Each failure is a 400 naming the
    field to change (prompt_param, max_param). The routes then validate the prompt's sequences
    with prompt_checked=True (generation.validate_all), so the engine does not check again."""
    try:
        validation.check_prompt(ids, vocab_size, context_len, max_new_tokens,
                                prompt_param=prompt_param, max_param=max_param)
    except RequestError as e:
        raise bad_request(str(e), param=e.param) from None


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
        apply_ids_delta(self.output_ids, out)        # a jump-forward may take ids back
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
    the server is shutting down, /abort_request) as the 503 an OpenAI client receives, or the
    abort's own "status_code" (400: the request's grammar left no valid continuation); None
    for any other finish."""
    if reason is None or reason.get("type") != "abort":
        return None
    message = reason.get("message") or "aborted"
    status = reason.get("status_code", 503)
    if status == 503:
        return ApiError(f"the request was aborted by the server: {message}", 503)
    return ApiError(f"the request failed: {message}", status)


def matched_stop(reason: Optional[Dict[str, Any]]) -> Any:
    return None if reason is None else reason.get("matched")


def usage_dict(results: Sequence[SeqResult], n: int,
               reasoning_tokens: Optional[int] = None) -> dict:
    """Usage over all sequences: each prompt counted once (n sequences share it), completions
    summed; cached_tokens is the most any sequence of a prompt reused. reasoning_tokens (with
    a reasoning parser): completion_tokens_details.reasoning_tokens."""
    prompt_tokens = cached = 0
    for start in range(0, len(results), n):
        group = results[start:start + n]
        prompt_tokens += group[0].prompt_tokens or len(group[0].prompt_ids)
        cached += max(r.cached_tokens for r in group)
    completion = sum(r.completion_tokens for r in results)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
             "total_tokens": prompt_tokens + completion,
             "prompt_tokens_details": {"cached_tokens": cached}}
    if reasoning_tokens is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return usage


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
    choice's text). Each top_logprobs entry holds the `num_top` most likely tokens and, as
    OpenAI's API and vLLM do, the token itself (so up to num_top + 1 entries; with logprobs 0
    just the token), most likely first. An entry whose logprob is None (the first prompt token
    under echo) gets a None top_logprobs entry too."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = text_offset
    for i, entry in enumerate(entries):
        text = _entry_text(entry, token_text)
        tokens.append(text)
        token_logprobs.append(entry[0])
        offsets.append(offset)
        offset += len(text)
        if entry[0] is None:
            top_logprobs.append(None)
            continue
        top = {text: entry[0]}
        for e in list(tops[i] if i < len(tops) and tops[i] else [])[:num_top]:
            top.setdefault(_entry_text(e, token_text), e[0])
        top_logprobs.append(dict(sorted(top.items(), key=lambda kv: -kv[1])))
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


MIN_LOGPROB = -9999.0      # what vLLM (and OpenAI) send for -inf, which JSON cannot carry


def _vllm_logprob(logprob: float, rank: Optional[int], text: str) -> dict:
    return {"logprob": max(logprob, MIN_LOGPROB), "rank": rank, "decoded_token": text}


def vllm_prompt_logprobs(result: SeqResult, num_top: int,
                         token_text: TokenText) -> List[Optional[Dict[str, dict]]]:
    """vLLM's prompt_logprobs: one entry per prompt token, None for the first (nothing
    precedes it), else {str(token id): {logprob, rank, decoded_token}} holding the prompt token
    itself and the `num_top` most likely tokens at that position (rank: 1 for the most likely;
    the prompt token's rank is known when it is among those num_top, else null)."""
    entries, tops = prompt_logprob_entries(result)
    out: List[Optional[Dict[str, dict]]] = []
    for entry, top in zip(entries, tops):
        if entry[0] is None:
            out.append(None)
            continue
        top = list(top or [])[:num_top]
        ranks = {e[1]: k + 1 for k, e in enumerate(top)}
        row = {str(entry[1]): _vllm_logprob(entry[0], ranks.get(entry[1]), _entry_text(entry, token_text))}
        for k, e in enumerate(top):
            row.setdefault(str(e[1]), _vllm_logprob(e[0], k + 1, _entry_text(e, token_text)))
        out.append(row)
    return out


def seq_usage(r: SeqResult) -> dict:
    """One sequence's usage so far (stream_options.continuous_usage_stats, as vLLM: its prompt's
    tokens and its own completion tokens)."""
    prompt = r.prompt_tokens or len(r.prompt_ids)
    return {"prompt_tokens": prompt, "completion_tokens": r.completion_tokens,
            "total_tokens": prompt + r.completion_tokens}


def chat_response(rid: str, created: int, model: str, results: Sequence[SeqResult], n: int,
                  logprobs: bool, top_logprobs: int, token_text: TokenText,
                  extras: Optional[OutputExtras] = None) -> dict:
    """A chat.completion. With vLLM's extras, as vLLM: prompt_logprobs and prompt_token_ids on
    the response (one prompt), token_ids on each choice."""
    extras = extras or OutputExtras()
    choices = []
    for r in results:
        choice = {"index": r.index, "message": {"role": "assistant", "content": r.text},
                  "logprobs": None, "finish_reason": finish_reason_str(r.finish_reason),
                  "matched_stop": matched_stop(r.finish_reason)}
        if logprobs:
            choice["logprobs"] = chat_logprobs(r.output_token_logprobs, r.output_top_logprobs,
                                               top_logprobs, token_text)
        if extras.return_token_ids:
            choice["token_ids"] = list(r.output_ids)
        choices.append(choice)
    response = {"id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": choices, "usage": usage_dict(results, n)}
    if extras.wants_prompt_logprobs and results:
        response["prompt_logprobs"] = vllm_prompt_logprobs(results[0], extras.prompt_logprobs,
                                                           token_text)
    if extras.return_token_ids and results:
        response["prompt_token_ids"] = list(results[0].prompt_ids)
    return response


def chat_chunk(rid: str, created: int, model: str, index: int, delta: dict,
               finish_reason: Optional[str] = None, logprobs: Optional[dict] = None,
               usage_null: bool = False, extra: Optional[dict] = None,
               usage: Optional[dict] = None, chunk_extra: Optional[dict] = None) -> dict:
    """One chat.completion.chunk: `extra` goes into the choice, `chunk_extra` (vLLM's
    prompt_token_ids) into the chunk; `usage` (continuous usage) or null with usage_null."""
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    if extra:
        choice.update(extra)
    chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": [choice]}
    if chunk_extra:
        chunk.update(chunk_extra)
    if usage is not None or usage_null:
        chunk["usage"] = usage
    return chunk


def usage_chunk(rid: str, obj: str, created: int, model: str, usage: dict) -> dict:
    """The final chunk of a stream with include_usage: no choices, the whole request's usage."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage}


def completion_choice(r: SeqResult, echo_text: str, logprobs: Optional[int],
                      token_text: TokenText, echo: Optional[bool] = None,
                      extras: Optional[OutputExtras] = None) -> dict:
    """One completion choice. With echo (default: echo_text is not empty) the prompt's text
    and, with logprobs, its logprobs come first. vLLM's extras, as vLLM: prompt_logprobs,
    prompt_token_ids and token_ids on the choice."""
    echo = bool(echo_text) if echo is None else echo
    extras = extras or OutputExtras()
    choice = {"index": r.index, "text": echo_text + r.text, "logprobs": None,
              "finish_reason": finish_reason_str(r.finish_reason),
              "matched_stop": matched_stop(r.finish_reason)}
    if logprobs is not None:
        entries, tops = [], []
        if echo:
            entries, tops = prompt_logprob_entries(r)
        entries += list(r.output_token_logprobs)
        tops += list(r.output_top_logprobs)
        choice["logprobs"] = completion_logprobs(entries, tops, logprobs, token_text)
    if extras.wants_prompt_logprobs:
        choice["prompt_logprobs"] = vllm_prompt_logprobs(r, extras.prompt_logprobs, token_text)
    if extras.return_token_ids:
        choice["prompt_token_ids"] = list(r.prompt_ids)
        choice["token_ids"] = list(r.output_ids)
    return choice


def completion_response(rid: str, created: int, model: str, choices: List[dict],
                        results: Sequence[SeqResult], n: int) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage_dict(results, n)}


def completion_chunk(rid: str, created: int, model: str, index: int, text: str,
                     finish_reason: Optional[str] = None, logprobs: Optional[dict] = None,
                     usage_null: bool = False, extra: Optional[dict] = None,
                     usage: Optional[dict] = None) -> dict:
    """One streamed text_completion: `extra` goes into the choice; `usage` (continuous usage)
    or null with usage_null."""
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if extra:
        choice.update(extra)
    chunk = {"id": rid, "object": "text_completion", "created": created, "model": model,
             "choices": [choice]}
    if usage is not None or usage_null:
        chunk["usage"] = usage
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
