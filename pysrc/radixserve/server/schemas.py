"""The request bodies of the HTTP API as pydantic v2 models: the type, bounds and size of every
field, and the source of the OpenAPI document (server/openapi.py).

Contract:
  * Types are strict: "5" is not 5, true is not 1, 5.0 is not an integer (an integer is a
    number, though). Every number is finite and bounded in the type the engine holds it in:
    int64 seeds, int32 counts and top_k, float32 temperatures and penalties. The sampling
    numbers' types are built from sampling/params.BOUNDS, the one table of their ranges, and
    checked with its number_problem (so SamplingParams.verify, which the routes then run with
    bounds_checked=True, does not check them again). Every list and string is capped by a
    MAX_* constant below.
  * A value given "once or one per prompt" (stop, rid, return_logprob, ...) is told apart by its
    JSON shape (an array or not), so an error inside an array names its index.
  * `parse(model, body)` returns the validated model or raises ApiError 400 for the first
    problem: param is its dotted location (messages[3].content) and the message names it and
    what is allowed ("n must be between 1 and 128, got 500").
  * The OpenAI bodies (chat, completions, and their stream_options, response_format and
    structured_outputs objects) are closed: every field is honoured, or declared as accepted
    and ignored (IGNORED_FIELDS: user, metadata, ... say why), or refused (REFUSED_FIELDS: a
    feature the server lacks, a 400 saying so); any other key is a 400 "unknown field X (did
    you mean Y?)". Message objects keep unknown keys (the chat template sees them); an unknown
    key in native sampling_params is a 400; other native bodies ignore unknown keys.
Rules across fields (exactly one of text / input_ids, one entry per prompt, prompts x n, at
most one grammar, top_logprobs needs logprobs) are requests.py's, which builds the engine's
types from these models.
"""
from __future__ import annotations

import difflib
from typing import Any, Callable, Dict, List, Literal, Optional, Type, TypeVar, Union, get_args

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, ValidationError,
                      WrapValidator, model_validator)
from pydantic_core import PydanticCustomError
from typing_extensions import Annotated

from radixserve.errors import ApiError, describe, is_number as _is_number, short as _short
from radixserve.errors import fmt_number as _fmt
from radixserve.sampling import params as _sp

INT32_MAX, INT64_MIN, INT64_MAX = _sp.INT32_MAX, _sp.INT64_MIN, _sp.INT64_MAX

MAX_N = _sp.MAX_N                        # samples per prompt
MAX_PROMPTS = 1024                       # prompts in one request (a completions list, a /generate batch)
MAX_SEQUENCES = 4096                     # prompts x n in one request
MAX_TOP_LOGPROBS = 20
MAX_MESSAGES = 4096                      # messages in one chat
MAX_CONTENT_PARTS = 256                  # parts of one message's content
MAX_TEXT_CHARS = 1 << 22                 # one prompt, message or content part (the body limit usually binds first)
MAX_PROMPT_TOKENS = 1 << 20              # one token-id prompt
MAX_TOOLS = 256                          # tools offered in one chat request
MAX_TOOL_CALLS = 256                     # tool calls in one assistant message
MAX_NAME_CHARS = 4096                    # model names, rids, message names, tool-call ids
MAX_STOP = _sp.MAX_STOPS                 # stop strings; stop_regex patterns
MAX_STOP_LEN = _sp.MAX_STOP_LEN          # characters of one stop string / stop_regex
MAX_STOP_TOKEN_IDS = _sp.MAX_STOP_TOKEN_IDS
MAX_LOGIT_BIAS = _sp.MAX_LOGIT_BIAS      # entries in logit_bias
MAX_GRAMMAR_CHARS = _sp.MAX_GRAMMAR_CHARS  # a regex / ebnf / json_schema / structural_tag
MAX_CHOICES = 1024                       # guided_choice alternatives
MAX_CACHE_SALT_CHARS = 256               # cache_salt on the OpenAI routes
MAX_METADATA = 16                        # metadata pairs (OpenAI's limits)
MAX_TEMPLATE_KWARGS = 32                 # chat_template_kwargs entries
MAX_METADATA_KEY = 64
MIN_REPETITION_PENALTY = _sp.MIN_REPETITION_PENALTY

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
"""The roles OpenAI defines. Other role names are passed to the chat template as sent (vLLM does
the same): a template that renders any role (ChatML...) takes them; one that raises for them
gets the request a 400 naming the template's error."""
MAX_ROLE_CHARS = 64

M = TypeVar("M", bound=BaseModel)


# --------------------------------------------------------------------------- errors

def _error(text: str) -> PydanticCustomError:
    """A validation error whose message is `text` (a phrase: "must be ..."); braces are safe."""
    return PydanticCustomError("radixserve", "{text}", {"text": text})


def location(loc: tuple) -> str:
    """('messages', 3, 'content') -> 'messages[3].content'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not out:
            out = str(part)
        elif str(part).isidentifier():
            out += f".{part}"
        else:
            out += f"[{_short(str(part))}]"
    return out


_TYPE_WORDS = {
    "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
    "float_type": "a number", "float_parsing": "a number", "bool_type": "a boolean",
    "bool_parsing": "a boolean", "string_type": "a string", "list_type": "an array",
    "dict_type": "an object", "model_type": "an object", "model_attributes_type": "an object",
}


_BOUND_WORDS = {"greater_than_equal": "at least", "less_than_equal": "at most",
                "greater_than": "greater than", "less_than": "less than"}


def _phrase(err: dict) -> str:
    kind, ctx, value = err["type"], err.get("ctx") or {}, err.get("input")
    if kind == "radixserve":
        return ctx["text"]
    if kind == "missing":
        return "is required"
    if kind in _TYPE_WORDS:
        return f"must be {_TYPE_WORDS[kind]}, got {describe(value)}"
    if kind == "literal_error":
        return f"must be {'one of ' if ' or ' in ctx['expected'] else ''}{ctx['expected']}, got {describe(value)}"
    if kind in ("too_long", "string_too_long"):
        unit = "characters" if kind == "string_too_long" else "entries"
        got = len(value) if hasattr(value, "__len__") else "more"
        return f"may have at most {ctx['max_length']} {unit}, got {got}"
    if kind in ("too_short", "string_too_short"):
        what = "string" if kind == "string_too_short" else ("object" if isinstance(value, dict) else "array")
        if ctx.get("min_length") == 1:
            return f"must be a non-empty {what}"
        return f"must have at least {ctx['min_length']} entries, got {len(value)}"
    if kind in _BOUND_WORDS:
        bound = next(iter(ctx.values()))
        return f"must be {_BOUND_WORDS[kind]} {_fmt(bound)}, got {_fmt(value) if _is_number(value) else describe(value)}"
    if kind == "string_pattern_mismatch":
        return f"must match the pattern {ctx['pattern']}, got {describe(value)}"
    if kind == "extra_forbidden":
        return "is not a known field; remove it"
    return err.get("msg", "is invalid")


def _models_in(annotation: Any) -> List[type]:
    """The pydantic models an annotation holds (through Optional, Union, List, Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def field_names(model: type) -> List[str]:
    """The keys a body object of `model` may have (aliases where a field has one)."""
    return [f.alias or name for name, f in model.model_fields.items()]


def _unknown_field(err: dict, model: Optional[type], prefix: tuple, more: str) -> ApiError:
    """An unknown key of a closed object: "unknown field 'X' (did you mean 'Y'?); remove it",
    the hint from the keys of the object's own model (found by walking err's location)."""
    owner = model
    for part in err["loc"][:-1]:
        if owner is None or isinstance(part, int):
            continue
        field = owner.model_fields.get(part) or next(
            (f for f in owner.model_fields.values() if f.alias == part), None)
        found = _models_in(field.annotation) if field is not None else []
        owner = found[0] if found else None
    where = location(prefix + tuple(err["loc"]))
    message = f"unknown field {where!r}"
    if owner is not None:
        close = difflib.get_close_matches(str(err["loc"][-1]), field_names(owner), n=1)
        if close:
            message += f" (did you mean {location(prefix + tuple(err['loc'][:-1]) + (close[0],))!r}?)"
    return ApiError(f"{message}; remove it{more}", 400, where)


def api_error(e: ValidationError, prefix: tuple = (), model: Optional[type] = None) -> ApiError:
    """The first problem of a ValidationError as a 400: "<where> <what is wrong>", param <where>
    (its location, under `prefix`). An unknown key of a closed object (`model`'s or one inside
    it) comes first, with a did-you-mean hint (see _unknown_field)."""
    errors = e.errors(include_url=False)
    more = f" (and {len(errors) - 1} more problem{'s' * (len(errors) > 2)})" if len(errors) > 1 else ""
    extra = [err for err in errors if err["type"] == "extra_forbidden"]
    if extra:
        return _unknown_field(extra[0], model, prefix, more)
    err = errors[0]
    where = location(prefix + tuple(err["loc"]))
    return ApiError(f"{where or 'the request body'} {_phrase(err)}{more}", 400, where or None)


def parse(model: Type[M], body: Any) -> M:
    """`model` validated from a decoded JSON body; ApiError 400 (see api_error) otherwise."""
    try:
        return model.model_validate(body, strict=True)
    except ValidationError as e:
        raise api_error(e, model=model) from None


def parse_value(adapter: TypeAdapter, value: Any, where: str) -> Any:
    """One field's value validated by `adapter` (e.g. PROMPT), errors located under `where`."""
    try:
        return adapter.validate_python(value, strict=True)
    except ValidationError as e:
        raise api_error(e, (where,)) from None


# --------------------------------------------------------------------------- bounded numbers

def _json_schema(bound: _sp.Bound) -> dict:
    """A Bound as JSON schema keywords (the OpenAPI document)."""
    if bound.least is not None:
        return {"anyOf": [{"const": 0}, {"minimum": bound.least, "maximum": bound.hi}]}
    if bound.lo_open:
        return {"exclusiveMinimum": bound.lo, "maximum": bound.hi}
    return {"minimum": bound.lo, "maximum": bound.hi}


def _check_with(problem: Callable[[Any], Optional[str]], kind: type, json_extra: dict):
    """`kind`, refused with the phrase problem(v) returns (None: allowed)."""
    def validate(v: Any, handler):
        text = problem(v)
        if text is not None:
            raise _error(text)
        return handler(v)
    return Annotated[kind, WrapValidator(validate), Field(json_schema_extra=json_extra)]


def _bounded(kind: type, lo, hi, lo_open: bool = False, noun: Optional[str] = None):
    """An int (kind=int) or float in [lo, hi] ((lo, hi] with lo_open), finite, strict: a
    request field that is no sampling number (those are `sampling_number`s). The message names
    the range; `noun` ("a token id") says what the number is."""
    bound = _sp.Bound(kind, lo, hi, lo_open=lo_open, noun=noun)
    return _check_with(bound.problem, kind, _json_schema(bound))


def sampling_number(name: str):
    """The field type of the sampling number `name`: its range is BOUNDS[name] (also its JSON
    schema), checked by sampling/params.number_problem, the check SamplingParams.verify runs
    for a SamplingParams no schema checked."""
    bound = _sp.BOUNDS[name]
    return _check_with(lambda v: _sp.number_problem(name, v), bound.kind, _json_schema(bound))


Temperature = sampling_number("temperature")
TopP = sampling_number("top_p")
MinP = sampling_number("min_p")
Penalty = sampling_number("presence_penalty")              # presence / frequency: one range
RepetitionPenalty = sampling_number("repetition_penalty")
TopK = sampling_number("top_k")
Seed = sampling_number("seed")
MaxTokens = sampling_number("max_new_tokens")              # max_tokens, max_completion_tokens, ...
MinTokens = sampling_number("min_new_tokens")              # min_tokens, min_new_tokens
N = sampling_number("n")
TokenCount = _bounded(int, 0, INT32_MAX)                   # a count that is no sampling number
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]      # in pydantic-core: prompts are long
TopLogprobs = _bounded(int, 0, MAX_TOP_LOGPROBS)
LogprobStart = _bounded(int, -1, INT32_MAX, noun="an integer (-1: no prompt logprobs)")
PromptTokens = _bounded(int, 1, INT32_MAX)                 # truncate_prompt_tokens: keep the last k
# the request's priority (SGLang's and vLLM's field): which end is urgent, and whether it is
# used at all, is the server's (--enable-priority-scheduling, engine/scheduler/priority.py)
Priority = _bounded(int, INT64_MIN, INT64_MAX, noun="an integer")
Bias = _check_with(_sp.LOGIT_BIAS.problem, float, _json_schema(_sp.LOGIT_BIAS))

Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]
Grammar = Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LEN)]
TokenIds = Annotated[List[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKENS)]
JsonObject = Dict[str, Any]
TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]
Metadata = Annotated[Dict[Annotated[str, Field(max_length=MAX_METADATA_KEY)], Any],
                     Field(max_length=MAX_METADATA)]


def _check_bias_keys(v: Any, handler):
    if isinstance(v, dict):
        bad = next((k for k in v if not (isinstance(k, str) and k.isascii() and k.isdigit()
                                         and len(k) <= 10)), None)
        if bad is not None:
            raise _error(f"must map token ids (decimal strings such as \"50256\") to biases; "
                         f"{_short(bad)} is not a token id")
    return handler(v)


LogitBias = Annotated[Dict[TokenIdKey, Bias],
                      Field(max_length=MAX_LOGIT_BIAS, json_schema_extra={"additionalProperties": False}),
                      WrapValidator(_check_bias_keys)]
"""OpenAI's logit_bias: {"token id": bias in [-100, 100]}."""


# --------------------------------------------------------------------------- shapes

def _own_type_error(e: ValidationError) -> bool:
    """True when the value itself has the wrong JSON type (not something inside it)."""
    return all(not err["loc"] and err["type"] in _TYPE_WORDS for err in e.errors())


def _shaped(choose: Callable[[Any], Optional[TypeAdapter]], description: str) -> WrapValidator:
    """Validate with the adapter `choose(value)` picks by the value's JSON shape (None: no
    shape fits). A value of the wrong type reads "must be <description>, got ..."; a problem
    inside it keeps its own location and message."""
    def validate(value: Any, handler):
        adapter = choose(value)
        if adapter is None:
            raise _error(f"must be {description}, got {describe(value)}")
        try:
            return adapter.validate_python(value, strict=True)
        except ValidationError as e:
            if _own_type_error(e):
                raise _error(f"must be {description}, got {describe(value)}") from None
            raise
    return WrapValidator(validate)


def either(one: Any, many: Any, description: str) -> Any:
    """`one` value, or an array (`many`): the union in the schema, told apart by JSON shape."""
    one_adapter, many_adapter = TypeAdapter(one), TypeAdapter(many)
    return Annotated[Union[one, many],
                     _shaped(lambda v: many_adapter if isinstance(v, list) else one_adapter, description)]


def described(t: Any, description: str) -> Any:
    """`t`, whose wrong-type message reads "must be <description>, got ..."."""
    adapter = TypeAdapter(t)
    return Annotated[t, _shaped(lambda v: adapter, description)]


def _literal(*values: str, note: str = "") -> Any:
    """A string that must be one of `values` (a Literal), with a message listing them."""
    allowed = ", ".join(repr(v) for v in values)

    def validate(v: Any, handler):
        if not isinstance(v, str) or v not in values:
            raise _error(f"must be {'one of ' if len(values) > 1 else ''}{allowed}{note}, got {describe(v)}")
        return handler(v)
    return Annotated[Literal[values], WrapValidator(validate)]


_PROMPT_TEXTS = TypeAdapter(Annotated[List[Text], Field(min_length=1, max_length=MAX_PROMPTS)])
_PROMPT_IDS = TypeAdapter(TokenIds)
_PROMPT_ID_LISTS = TypeAdapter(Annotated[List[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)])
_TEXT = TypeAdapter(Text)


def _choose_prompt(v: Any) -> Optional[TypeAdapter]:
    if isinstance(v, str):
        return _TEXT
    if not isinstance(v, list) or not v:
        return None
    first = v[0]
    if isinstance(first, str):
        return _PROMPT_TEXTS
    if isinstance(first, int) and not isinstance(first, bool):
        return _PROMPT_IDS
    return _PROMPT_ID_LISTS if isinstance(first, list) else None


Prompt = Annotated[
    Union[Text, Annotated[List[Text], Field(min_length=1, max_length=MAX_PROMPTS)], TokenIds,
          Annotated[List[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]],
    _shaped(_choose_prompt, f"a string, an array of at most {MAX_PROMPTS} strings, an array of "
                            f"token ids, or an array of at most {MAX_PROMPTS} arrays of token ids")]
"""A completions prompt: text, a batch of texts, one tokenized prompt, a batch of those."""
PROMPT = TypeAdapter(Prompt)

Stop = either(StopString, Annotated[List[StopString], Field(max_length=MAX_STOP)],
              f"a non-empty string or an array of at most {MAX_STOP} non-empty strings")
StopRegex = either(Annotated[str, Field(min_length=1, max_length=MAX_STOP_LEN)],
                   Annotated[List[Annotated[str, Field(min_length=1, max_length=MAX_STOP_LEN)]],
                             Field(max_length=MAX_STOP)],
                   f"a regular expression or an array of at most {MAX_STOP} of them")
StopTokenIds = Annotated[List[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)]
_GRAMMAR_TEXT, _JSON_OBJECT = TypeAdapter(Grammar), TypeAdapter(JsonObject)
SchemaSpec = Annotated[Union[Grammar, JsonObject],
                       _shaped(lambda v: _GRAMMAR_TEXT if isinstance(v, str) else
                               _JSON_OBJECT if isinstance(v, dict) else None,
                               "a JSON object, or a string holding one")]
"""A json_schema / structural_tag: an object (sent on as JSON text) or the JSON text itself."""
_NAME = TypeAdapter(Annotated[str, Field(max_length=MAX_NAME_CHARS)])
ToolChoice = Annotated[Union[Annotated[str, Field(max_length=MAX_NAME_CHARS)], JsonObject],
                       _shaped(lambda v: _NAME if isinstance(v, str) else
                               _JSON_OBJECT if isinstance(v, dict) else None,
                               '"none", "auto", "required" or {"type": "function", "function": '
                               '{"name": ...}}')]
"""tool_choice (its values are checked by tool_calls.check_tools)."""


class _Body(BaseModel):
    """A request body object: strict types, unknown keys ignored."""
    model_config = ConfigDict(strict=True, extra="ignore")


class _Closed(_Body):
    """A body object whose unknown keys are 400s (api_error: "unknown field 'X' (did you mean
    'Y'?)"); the document says additionalProperties: false."""
    model_config = ConfigDict(extra="forbid")


# --------------------------------------------------------------------------- the field policy

# Fields of OpenAI's (and vLLM's) request schemas accepted and ignored, each with why ignoring it
# is harmless (the field's description in /openapi.json; README's table).
IGNORED_FIELDS = {
    "user": "an end-user id for OpenAI's abuse monitoring; the server keeps no per-user state",
    "safety_identifier": "OpenAI's newer name for user",
    "metadata": "tags for OpenAI's stored completions; nothing is stored here",
    "store": "asks OpenAI to store the completion; nothing is stored here (and no route "
             "returns stored completions)",
    "service_tier": "one tier here: every request is served the same way",
    "prompt_cache_key": "a routing hint for OpenAI's prompt cache; the radix cache finds "
                        "shared prefixes by itself",
    "prompt_cache_retention": "the radix cache keeps prefixes while the pool has room",
    "prompt_cache_options": "the same (OpenAI's newer form)",
    "prediction": "predicted output only makes OpenAI's decoding faster; the output is the same "
                  "without it",
    "request_id": "vLLM's id for its logs; the response carries the server's own id",
    "guided_decoding_backend": "there is one grammar backend (xgrammar)",
    "include_obfuscation": "padding against chunk-size side channels; chunks are not padded",
    "stream_options": "/v1/responses streams its typed events the same way whatever is asked",
    "disable_fallback": "one grammar backend, which never falls back",
}


def _ignored(t: Any, name: str) -> Any:
    """`t`, validated as usual, then ignored (see IGNORED_FIELDS)."""
    return Annotated[t, Field(description="accepted and ignored: " + IGNORED_FIELDS[name])]


def _only(t: Any, allowed: Callable[[Any], bool], problem: str, schema: dict) -> Any:
    """A field of a feature the server lacks: `t`, validated as usual, then refused with
    "<field> <problem>" unless allowed(value) (its neutral value). `schema`: the JSON schema of
    the values that pass (for the OpenAPI document)."""
    def validate(v: Any, handler):
        v = handler(v)
        if not allowed(v):
            raise _error(problem)
        return v
    return Annotated[t, WrapValidator(validate), Field(json_schema_extra=schema)]


def _refused(problem: str) -> Any:
    """A field of a feature the server lacks with no neutral value: only null (or leaving it
    out) passes."""
    def validate(v: Any, handler):
        if v is not None:
            raise _error(problem)
        return None
    return Annotated[Any, WrapValidator(validate), Field(json_schema_extra={"type": "null"})]


def _off(problem: str) -> Any:
    """A switch the server lacks: false (or null, or leaving it out) passes, true is refused."""
    return _only(bool, lambda v: v is False, f"{problem}; leave it out or send false",
                 {"const": False})


# --------------------------------------------------------------------------- OpenAI routes

TEXT_ONLY = ("the served model reads text only: no images, audio or files (a multimodal "
             "checkpoint such as Gemma 3 4B / 12B / 27B is served as its text model)")
"""Why a request's images (or other media) are refused, on every route."""
TextPartType = _literal("text", note=f"; only text content is supported, {TEXT_ONLY}")
TruncationSide = _literal("left", "right")
"""Which end truncate_prompt_tokens cuts (vLLM): "left" (default) drops the first tokens and
keeps the last k, "right" keeps the first k."""
Role = Annotated[str, Field(min_length=1, max_length=MAX_ROLE_CHARS)]
"""A message's role: one of CHAT_ROLES or a custom name for the chat template (1-64 chars)."""
FormatType = _literal("text", "json_object", "json_schema")
ToolCalls = Annotated[List[JsonObject], Field(max_length=MAX_TOOL_CALLS)]


class TextContentPart(_Body):
    """{"type": "text", "text": ...}: the only content part the server reads."""
    type: TextPartType
    text: Text


Content = either(Text, Annotated[List[TextContentPart], Field(max_length=MAX_CONTENT_PARTS)],
                 f"a string or an array of at most {MAX_CONTENT_PARTS} text parts "
                 '{"type": "text", "text": "..."}')


class ChatMessage(BaseModel):
    """One chat message. Keys beyond these are kept for the chat template (tool metadata...).
    content may be left out only by an assistant message with tool_calls (requests.py)."""
    model_config = ConfigDict(strict=True, extra="allow", json_schema_extra={"anyOf": [
        {"required": ["content"]},
        {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array", "minItems": 1}}}]})
    role: Role
    content: Optional[Content] = None
    name: Optional[Name] = None
    tool_calls: Optional[ToolCalls] = None
    tool_call_id: Optional[Name] = None


class JsonSchemaFormat(_Closed):
    """response_format.json_schema: {name, description, schema, strict} (strict or not, the
    output always follows the schema)."""
    name: Optional[Name] = None
    description: Optional[Text] = None
    schema_: JsonObject = Field(alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Closed):
    """{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}."""
    type: FormatType
    json_schema: Optional[JsonSchemaFormat] = None


class StreamOptions(_Closed):
    """include_usage (OpenAI): a last chunk with the request's usage; continuous_usage_stats
    (vLLM, with include_usage): every chunk also carries its sequence's usage so far."""
    include_usage: Optional[bool] = None
    continuous_usage_stats: Optional[bool] = None
    include_obfuscation: Optional[_ignored(bool, "include_obfuscation")] = None


Choices = Annotated[List[Annotated[str, Field(max_length=MAX_STOP_LEN)]],
                    Field(min_length=1, max_length=MAX_CHOICES)]
"""guided_choice / structured_outputs.choice: the output is exactly one of these strings."""
CacheSalt = Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)]

# Fields of features the server lacks: refused with a 400 saying so, unless neutral.
WhitespacePattern = _refused("is not supported: JSON grammars allow no whitespace between "
                             "tokens; leave it out")
BeamSearch = _off("is not supported: beam search is not implemented (n samples are independent)")
AllowedTokenIds = _refused("is not supported; use logit_bias (-100 for the tokens to exclude) "
                           "or a grammar (regex, ...)")
BadWords = _refused("is not supported; use logit_bias (-100 for their tokens) instead")
TokensAsIds = _off("is not supported: logprob tokens are always text (return_token_ids gives "
                   "the ids)")
LoraPath = _refused("is not supported: the server serves one model without adapters; leave it out")
Modalities = _only(Annotated[List[Name], Field(max_length=8)], lambda v: all(m == "text" for m in v),
                   'is not supported beyond ["text"]: the served models write text only',
                   {"items": {"const": "text"}})
Audio = _refused("is not supported: the served models write text only; leave it out")
WebSearch = _refused("is not supported: there is no web search; leave it out")
Functions = _refused("(deprecated by OpenAI) is not supported; send tools instead")
FunctionCall = _refused("(deprecated by OpenAI) is not supported; send tool_choice instead")
ReasoningEffort = _only(Name, lambda v: v == "none", "is not supported: the server does not bound "
                        "a model's reasoning (chat_template_kwargs can switch a template's "
                        'thinking mode); leave it out or send "none"', {"const": "none"})
Verbosity = _refused("is not supported: output length follows max_tokens and the prompt only; "
                     "leave it out")
Moderation = _refused("is not supported: the server runs no moderation; leave it out")
ChatEcho = _off("is not supported on chat (vLLM's echo of the last message)")
ContinueFinalMessage = _off("is not supported: the chat always ends with the generation prompt "
                            "(add_generation_prompt)")
ChatSpecialTokens = _off("is not supported on chat: the chat template writes the special tokens")
ChatTemplate = _refused("is not supported: the server renders with the model's own chat template")
# The chat template's own arguments have their own fields; render()'s keyword parameters would
# be shadowed. Names are identifiers not starting with "_" (the template context's internals).
TEMPLATE_ARGS_RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt",
                                    "special_tokens", "render_limits"})


def _check_template_kwargs(v: Dict[str, Any]) -> Dict[str, Any]:
    taken = sorted(TEMPLATE_ARGS_RESERVED.intersection(v))
    if taken:
        raise _error(f"sets {taken[0]!r}, which the request's own fields set; use those fields")
    return v


TemplateArgName = Annotated[str, Field(min_length=1, max_length=64,
                                       pattern=r"^[A-Za-z][A-Za-z0-9_]*$")]
# extra variables of the chat template, e.g. {"enable_thinking": false} (Qwen3)
ChatTemplateKwargs = Annotated[Dict[TemplateArgName, Any], Field(max_length=MAX_TEMPLATE_KWARGS),
                               AfterValidator(_check_template_kwargs)]


class StructuredOutputs(_Closed):
    """vLLM's structured_outputs: at most one of json, regex, choice, grammar, json_object (true:
    any JSON object), structural_tag, each mapped onto the grammar of the same kind as the
    top-level fields (requests._grammar). The JSON grammars (constrained/backend.py) are
    always compact and closed, which is what disable_any_whitespace and
    disable_additional_properties ask for; a custom whitespace_pattern is refused."""
    json_: Optional[SchemaSpec] = Field(None, alias="json")
    regex: Optional[Grammar] = None
    choice: Optional[Choices] = None
    grammar: Optional[Grammar] = None
    json_object: Optional[bool] = None
    structural_tag: Optional[SchemaSpec] = None
    disable_fallback: Optional[_ignored(bool, "disable_fallback")] = None
    disable_any_whitespace: Optional[bool] = Field(
        None, description="JSON output never has whitespace between tokens, whatever this says")
    disable_additional_properties: Optional[bool] = Field(
        None, description="objects never get properties their schema does not list (xgrammar's "
                          "strict mode), whatever this says")
    whitespace_pattern: Optional[WhitespacePattern] = None


Messages = described(Annotated[List[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)],
                     f"a non-empty array of at most {MAX_MESSAGES} message objects with role and "
                     "content")
MESSAGES = TypeAdapter(Messages)


class _OpenAIRequest(_Closed):
    """The fields the chat and completions bodies share: OpenAI's, SGLang's and vLLM's
    sampling extras, the grammar fields, vLLM's output extras, the fields accepted and ignored
    (IGNORED_FIELDS) and the refused ones (_off / _only / _refused). Any other key is a 400."""
    model: Optional[Name] = None
    n: Optional[N] = None
    best_of: Optional[N] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[Temperature] = None
    top_p: Optional[TopP] = None
    top_k: Optional[TopK] = None
    min_p: Optional[MinP] = None
    presence_penalty: Optional[Penalty] = None
    frequency_penalty: Optional[Penalty] = None
    repetition_penalty: Optional[RepetitionPenalty] = None
    seed: Optional[Seed] = None
    max_tokens: Optional[MaxTokens] = None
    min_tokens: Optional[MinTokens] = None
    stop: Optional[Stop] = None
    stop_token_ids: Optional[StopTokenIds] = None
    ignore_eos: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None
    spaces_between_special_tokens: Optional[bool] = None
    no_stop_trim: Optional[bool] = None
    logit_bias: Optional[LogitBias] = None
    response_format: Optional[ResponseFormat] = None
    json_schema: Optional[SchemaSpec] = None
    regex: Optional[Grammar] = None
    ebnf: Optional[Grammar] = None
    structural_tag: Optional[SchemaSpec] = None
    stop_regex: Optional[StopRegex] = None
    guided_json: Optional[SchemaSpec] = None
    guided_regex: Optional[Grammar] = None
    guided_grammar: Optional[Grammar] = None
    guided_choice: Optional[Choices] = None
    structured_outputs: Optional[StructuredOutputs] = None
    include_stop_str_in_output: Optional[bool] = None      # vLLM's no_stop_trim
    # vLLM's output extras
    prompt_logprobs: Optional[TopLogprobs] = None
    truncate_prompt_tokens: Optional[PromptTokens] = None
    truncation_side: Optional[TruncationSide] = None       # with truncate_prompt_tokens
    return_token_ids: Optional[bool] = None
    # prefix sharing only among requests with the same salt (vLLM's cache_salt)
    cache_salt: Optional[CacheSalt] = None
    # --enable-priority-scheduling: the request's priority (else ignored, or refused with
    # --abort-on-priority-when-disabled)
    priority: Optional[Priority] = None
    # accepted and ignored
    user: Optional[_ignored(Name, "user")] = None
    safety_identifier: Optional[_ignored(Name, "safety_identifier")] = None
    metadata: Optional[_ignored(Metadata, "metadata")] = None
    store: Optional[_ignored(bool, "store")] = None
    service_tier: Optional[_ignored(Name, "service_tier")] = None
    prompt_cache_key: Optional[_ignored(Name, "prompt_cache_key")] = None
    prompt_cache_retention: Optional[_ignored(Name, "prompt_cache_retention")] = None
    prompt_cache_options: Optional[_ignored(JsonObject, "prompt_cache_options")] = None
    request_id: Optional[_ignored(Name, "request_id")] = None
    guided_decoding_backend: Optional[_ignored(Name, "guided_decoding_backend")] = None
    # refused unless neutral
    use_beam_search: Optional[BeamSearch] = None
    allowed_token_ids: Optional[AllowedTokenIds] = None
    bad_words: Optional[BadWords] = None
    return_tokens_as_token_ids: Optional[TokensAsIds] = None
    lora_path: Optional[LoraPath] = None


class ChatCompletionRequest(_OpenAIRequest):
    """POST /v1/chat/completions."""
    messages: Messages
    tools: Optional[Annotated[List[JsonObject], Field(max_length=MAX_TOOLS)]] = None
    tool_choice: Optional[ToolChoice] = None
    parallel_tool_calls: Optional[bool] = None
    add_generation_prompt: Optional[bool] = None
    max_completion_tokens: Optional[MaxTokens] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[TopLogprobs] = None
    prediction: Optional[_ignored(JsonObject, "prediction")] = None
    modalities: Optional[Modalities] = None
    audio: Optional[Audio] = None
    web_search_options: Optional[WebSearch] = None
    functions: Optional[Functions] = None
    function_call: Optional[FunctionCall] = None
    reasoning_effort: Optional[ReasoningEffort] = None
    verbosity: Optional[Verbosity] = None
    moderation: Optional[Moderation] = None
    echo: Optional[ChatEcho] = None
    continue_final_message: Optional[ContinueFinalMessage] = None
    add_special_tokens: Optional[ChatSpecialTokens] = None
    chat_template: Optional[ChatTemplate] = None
    chat_template_kwargs: Optional[ChatTemplateKwargs] = None
    # SGLang's reasoning switches (--reasoning-parser): the <think> block in
    # message.reasoning_content (separate_reasoning), streamed as it comes (stream_reasoning)
    separate_reasoning: Optional[bool] = None
    stream_reasoning: Optional[bool] = None


class CompletionRequest(_OpenAIRequest):
    """POST /v1/completions."""
    prompt: Prompt
    echo: Optional[bool] = None
    logprobs: Optional[TopLogprobs] = None
    suffix: Optional[Annotated[Text, Field(json_schema_extra={"maxLength": 0})]] = None  # unsupported
    add_special_tokens: Optional[bool] = None     # text prompts: BOS etc. (default true)


# --------------------------------------------------------------------------- native routes

class SamplingParamsBody(BaseModel):
    """/generate's sampling_params, SGLang's names; defaults are SamplingParams'. json_schema and
    structural_tag may be objects (sent on as JSON text); an unknown key is a 400."""
    model_config = ConfigDict(strict=True, extra="forbid")
    max_new_tokens: Optional[MaxTokens] = 128            # null: up to the context length
    min_new_tokens: MinTokens = 0
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = -1
    min_p: MinP = 0.0
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    stop: Optional[Stop] = None
    stop_token_ids: Optional[StopTokenIds] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: N = 1
    seed: Optional[Seed] = None
    json_schema: Optional[SchemaSpec] = None
    regex: Optional[Grammar] = None
    ebnf: Optional[Grammar] = None
    structural_tag: Optional[SchemaSpec] = None
    stop_regex: Optional[StopRegex] = None
    logit_bias: Optional[LogitBias] = None

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = sorted(k for k in data if k not in cls.model_fields)
            if unknown:
                hints = []
                for k in unknown:
                    close = difflib.get_close_matches(str(k), cls.model_fields, n=1)
                    hints.append(f"{_short(k)}" + (f" (did you mean {close[0]!r}?)" if close else ""))
                raise _error(f"has unknown sampling parameter{'s' * (len(unknown) > 1)} "
                             f"{', '.join(hints)}; remove {'them' if len(unknown) > 1 else 'it'}")
        return data


def _per_prompt(t: Any, description: str) -> Any:
    return either(t, Annotated[List[t], Field(min_length=1, max_length=MAX_PROMPTS)],
                  f"{description}, or an array of one per prompt")


_BATCH_IDS = TypeAdapter(Annotated[List[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)])
GenerateText = either(Text, Annotated[List[Text], Field(min_length=1, max_length=MAX_PROMPTS)],
                      f"a string or a non-empty array of at most {MAX_PROMPTS} strings")
GenerateIds = Annotated[
    Union[TokenIds, Annotated[List[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]],
    _shaped(lambda v: (None if not isinstance(v, list) else
                       _BATCH_IDS if v and isinstance(v[0], list) else _PROMPT_IDS),
            f"a non-empty array of token ids or an array of at most {MAX_PROMPTS} of them")]
PerPromptSampling = _per_prompt(SamplingParamsBody, "a sampling parameters object")
PerPromptRid = _per_prompt(Annotated[Name, Field(min_length=1)], "a request id string")
PerPromptSalt = _per_prompt(Annotated[Name, Field(min_length=1)], "a cache salt string")
PerPromptBool = _per_prompt(bool, "a boolean")
PerPromptLogprobStart = _per_prompt(LogprobStart, "an integer")
PerPromptTopLogprobs = _per_prompt(TopLogprobs, "an integer")


class GenerateRequest(_Closed):
    """POST /generate (SGLang's native API): give exactly one of text and input_ids (neither
    may be null), each one prompt or an array of prompts (a batch); per-prompt fields once or
    one per prompt. SGLang's fields of features this server lacks are refused by name; any
    other unknown key is a 400 too."""
    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["text"]},
                                                           {"required": ["input_ids"]}]})
    text: GenerateText = None
    input_ids: GenerateIds = None
    sampling_params: Optional[PerPromptSampling] = None
    rid: Optional[PerPromptRid] = None
    stream: Optional[bool] = None
    return_logprob: Optional[PerPromptBool] = None
    logprob_start_len: Optional[PerPromptLogprobStart] = None
    top_logprobs_num: Optional[PerPromptTopLogprobs] = None
    return_text_in_logprobs: Optional[bool] = None
    cache_salt: Optional[PerPromptSalt] = None     # prefix sharing only within one salt
    priority: Optional[Priority] = None            # every sequence's (as _OpenAIRequest.priority)
    image_data: Optional[_refused(f"is not supported: {TEXT_ONLY}")] = None
    lora_path: Optional[_refused("is not supported: no LoRA adapters are loaded")] = None
    return_hidden_states: Optional[_off("is not supported: hidden states are not returned")] = None
    custom_logit_processor: Optional[_refused("is not supported: logit processors do not run "
                                              "here (logit_bias in sampling_params does)")] = None
    # fields SGLang's model gateway (smg) writes into every /generate it forwards, at its
    # defaults (crates/protocols/src/generate.rs): accepted and ignored, or off
    model: Optional[Name] = None              # ignored: one model is served
    log_metrics: Optional[bool] = None        # ignored
    no_logs: Optional[bool] = None            # ignored: request bodies are never logged
    background: Optional[_off("is not supported: /generate answers in the foreground")] = None
    return_bytes: Optional[_off("is not supported: no image generation")] = None
    return_entropy: Optional[_off("is not supported: entropy is not returned")] = None


class AbortRequest(_Closed):
    """POST /abort_request: the id of one of this client's live requests, or abort_all: true
    for every live request of this client (SGLang's body; an empty rid is allowed then)."""
    model_config = ConfigDict(json_schema_extra={"anyOf": [
        {"required": ["rid"], "properties": {"rid": {"minLength": 1}}},
        {"required": ["abort_all"], "properties": {"abort_all": {"const": True}}}]})
    rid: Optional[Name] = None
    abort_all: Optional[bool] = None        # a rid or abort_all: requests.parse_abort_request


MAX_SCORE_LABELS = 64


ScoreText = Annotated[Union[Text, TokenIds],
                      _shaped(lambda v: _TEXT if isinstance(v, str) else
                              _PROMPT_IDS if isinstance(v, list) else None,
                              "a string or a non-empty array of token ids")]
"""A /v1/score query or item: text or token ids, told apart by JSON shape (so an error names
the field, never a pydantic union member)."""


class ScoreRequest(_Closed):
    """POST /v1/score (SGLang's scoring API): for each item, the probability of each label
    token as the next token after query + item (item + query with item_first). query and
    items are text, or token ids (both the same kind)."""
    query: ScoreText
    items: Annotated[List[ScoreText], Field(min_length=1, max_length=MAX_PROMPTS)]
    label_token_ids: Annotated[List[TokenId], Field(min_length=1, max_length=MAX_SCORE_LABELS)]
    apply_softmax: bool = False
    item_first: bool = False
    model: Optional[Name] = None
    cache_salt: Optional[Annotated[Name, Field(min_length=1)]] = None


# --------------------------------------------------------------------------- embeddings, rerank

EncodingFormat = _literal("float", "base64")
Dimensions = _bounded(int, 1, INT32_MAX)     # at most the model's hidden size (the engine's check)
TopN = _bounded(int, 0, INT32_MAX, noun="an integer (0: every document)")


class EmbeddingRequest(_Closed):
    """POST /v1/embeddings (OpenAI's, with --is-embedding): one embedding per input. input is a
    string, an array of strings, an array of token ids (one input) or an array of them; no
    string may be empty. encoding_format: float (arrays of numbers, the default) or base64 (each
    vector's little-endian float32 bytes). dimensions: keep the first N values, then
    renormalise (Matryoshka truncation)."""
    input: Prompt
    model: Optional[Name] = None
    encoding_format: Optional[EncodingFormat] = None
    dimensions: Optional[Dimensions] = None
    cache_salt: Optional[CacheSalt] = None
    user: Optional[_ignored(Name, "user")] = None


class RerankDocumentObject(_Closed):
    """A document as an object: {"text": ...} (Cohere's and Jina's form)."""
    text: Text


_RERANK_DOCUMENT = TypeAdapter(RerankDocumentObject)
RerankDocument = Annotated[Union[Text, RerankDocumentObject],
                           _shaped(lambda v: _TEXT if isinstance(v, str) else
                                   _RERANK_DOCUMENT if isinstance(v, dict) else None,
                                   'a string or an object {"text": "..."}')]


class RerankRequest(_Closed):
    """POST /v1/rerank (Cohere's and Jina's shape, as vLLM and SGLang serve it; with
    --is-embedding): each document's relevance to query, best first. top_n: return the
    best N (0 or left out: all); return_documents (default true): each result carries
    document.text; instruction: the task line of the qwen3 rerank template (--rerank-template)
    in place of its default."""
    query: Text
    documents: Annotated[List[RerankDocument], Field(min_length=1, max_length=MAX_PROMPTS)]
    model: Optional[Name] = None
    top_n: Optional[TopN] = None
    return_documents: Optional[bool] = None
    instruction: Optional[Text] = None
    cache_salt: Optional[CacheSalt] = None


REQUEST_MODELS = (ChatCompletionRequest, CompletionRequest, GenerateRequest, AbortRequest,
                  ScoreRequest, EmbeddingRequest, RerankRequest)
