"""Request parsing: a validated request body -> what the routes hand the engine.

Contract. Parsing never touches the engine or the tokenizer: `parse_*_request` validates a
decoded JSON body against its pydantic model (server/schemas.py: types, caps, and the sampling
numbers' bounds from sampling/params.BOUNDS), applies the rules that span several fields (one
grammar at most, top_logprobs needs logprobs, stream_options needs stream, best_of == n,
min_tokens <= max_tokens...), and returns a typed request (ChatRequest, CompletionRequest,
NativeGenerateRequest) whose SamplingParams passed SamplingParams.verify(bounds_checked=True)
(its rules beyond the numbers' ranges, which the schema checked), so the engine does not
verify them again. Every problem is an ApiError naming the field to change (param: its dotted
location as the client sent it, from the error's param, never from its message); `check_model`
is the one 404. Tokenization and context-length checks need the tokenizer and the context
length: `check_prompt_ids` (engine/validation.check_prompt in the client's words), called by the
routes once per prompt; they then tell the engine (generation.validate_all).

Turning the engine's outputs back into response bodies is server/render.py's.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Union

from radixserve.engine import validation
from radixserve.errors import ApiError, RequestError, bad_request
from radixserve.sampling.params import SamplingParams
from radixserve.server import schemas as S

Prompt = Union[str, List[int]]          # text, or token ids

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
    truncate_prompt_tokens: Optional[int] = None  # keep only k prompt tokens
    truncation_side: str = "left"                 # which end goes: left keeps the last k
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
    priority: Optional[int] = None     # --enable-priority-scheduling (schemas.Priority)


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
    priority: Optional[int] = None     # --enable-priority-scheduling (schemas.Priority)


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
        truncation_side=req.truncation_side or "left",
        return_token_ids=bool(req.return_token_ids),
        continuous_usage=bool(so is not None and so.include_usage and so.continuous_usage_stats))


def truncate_prompt(ids: List[int], keep: Optional[int], side: str = "left") -> List[int]:
    """truncate_prompt_tokens: `keep` tokens of the prompt (all when None): the last ones
    (side "left": the start is cut, vLLM's default) or the first ones (side "right")."""
    if keep is None or len(ids) <= keep:
        return ids
    return ids[len(ids) - keep:] if side == "left" else ids[:keep]


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
        priority=req.priority,
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
        priority=req.priority,
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
    priority: Optional[int] = None       # every sequence's (--enable-priority-scheduling)


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
        priority=req.priority,
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
