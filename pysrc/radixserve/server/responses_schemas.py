"""The request body of POST /v1/responses (the OpenAI Responses API) as a pydantic v2 model, with
schemas.py's conventions and types: strict types, every number bounded, every list and string
capped, unknown top-level fields refused (400), `schemas.parse` for a 400 that names the dotted field
(input[2].content[0].type).

What the server cannot do is refused here, field by field, with a 400 that says so (the
document at /openapi.json says the same: such a field accepts only its neutral value): tools
(only [] passes), tool_choice other than "none" / "auto", reasoning with a value, background
true, include with entries, truncation "auto", top_logprobs above 0, n above 1, conversation,
prompt, context_management, moderation; input items other than messages (function calls and
outputs, reasoning, item references, ...) and content parts other than text (images, files,
audio). A previous_response_id that cannot be a response id (it does not begin with "resp_",
as every id this server makes does) is a 400 here, as SGLang and vLLM answer it; whether such
an id is stored (else 404) needs the server. Beyond OpenAI's fields, SGLang's sampling
extensions are accepted with chat's types and bounds: frequency_penalty, presence_penalty,
repetition_penalty, top_k, min_p, stop. The rules across fields (text.format json_schema needs a
schema) and the ones that need the server are responses_api.py's.
"""
from __future__ import annotations

from typing import Dict, List, Optional

from pydantic import Field
from typing_extensions import Annotated

from radixserve.server.schemas import (MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_TOOLS, FormatType, JsonObject,
                                       MaxTokens, MinP, N, Name, Penalty, RepetitionPenalty, Stop,
                                       TEXT_ONLY, Temperature, Text, TokenCount, TopK, TopLogprobs,
                                       TopP, _Body, _Closed, _ignored, _literal, _only, _refused,
                                       described, either)

MAX_METADATA = 16                  # metadata pairs (OpenAI's limits)
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
MAX_INCLUDE = 64
RESPONSE_ID_PREFIX = "resp_"       # every response id this server makes begins with it (as OpenAI's)


# --------------------------------------------------------------------------- unsupported fields

Tools = _only(Annotated[List[JsonObject], Field(max_length=MAX_TOOLS)], lambda v: not v,
              "is not supported on /v1/responses: no tool calling here (/v1/chat/completions takes "
              "function tools); send [] or leave it out", {"maxItems": 0})
ToolChoice = _literal("none", "auto", note=" (tools are not supported on /v1/responses)")
Reasoning = _only(JsonObject, lambda v: all(x is None for x in v.values()),
                  "is not supported: the served model has no reasoning settings; leave it out",
                  {"additionalProperties": {"type": "null"}})
Background = _only(bool, lambda v: v is False,
                   "must be false: background responses are not supported; leave it out",
                   {"const": False})
Include = _only(Annotated[List[Annotated[str, Field(max_length=MAX_METADATA_VALUE)]],
                          Field(max_length=MAX_INCLUDE)], lambda v: not v,
                "is not supported: nothing extra can be included (no logprobs, reasoning or tool "
                "outputs); send [] or leave it out", {"maxItems": 0})
Truncation = _literal("disabled", note=" (the server never truncates: a conversation longer than "
                                       "the context is a 400)")
NoTopLogprobs = _only(TopLogprobs, lambda v: v == 0,
                      "must be 0: logprobs are not supported on /v1/responses "
                      "(/v1/chat/completions has them)", {"const": 0})
OneSample = _only(N, lambda v: v == 1,
                  "must be 1: a response has one output (send several requests for more samples)",
                  {"const": 1})
NoConversation = _refused("is not supported (no Conversations API here); chain responses with "
                         "previous_response_id")
NoPrompt = _refused("is not supported (no stored prompt templates); send input and instructions")
NoContextManagement = _refused("is not supported (no context compaction); leave it out")
NoModeration = _refused("is not supported (no moderation here); leave it out")


ResponseId = _only(Annotated[Name, Field(min_length=1)],
                   lambda v: v.startswith(RESPONSE_ID_PREFIX),
                   f"must be a response id (it begins with {RESPONSE_ID_PREFIX!r})",
                   {"pattern": f"^{RESPONSE_ID_PREFIX}"})


# --------------------------------------------------------------------------- input

InputPartType = _literal("input_text", "output_text",
                         note=f"; only text is supported, {TEXT_ONLY}")
ItemType = _literal("message", note=" (only message items are supported: no function calls or "
                                    "their outputs, reasoning items or item references)")
InputRole = _literal("user", "assistant", "system", "developer")


class InputTextPart(_Body):
    """{"type": "input_text" | "output_text", "text": ...} (output_text: an assistant message
    sent back as input); other keys (annotations, logprobs, ...) are ignored."""
    type: InputPartType
    text: Text


InputContent = either(Text, Annotated[List[InputTextPart], Field(max_length=MAX_CONTENT_PARTS)],
                      f"a string or an array of at most {MAX_CONTENT_PARTS} text parts "
                      '{"type": "input_text", "text": "..."}')


class InputMessage(_Body):
    """One input item: a message {type?: "message", role, content}. An output message of an
    earlier response (id, status, output_text parts) passes as it is."""
    type: Optional[ItemType] = None            # first: an item of another type is named by it
    role: InputRole
    content: InputContent


Input = either(Text, Annotated[List[InputMessage], Field(min_length=1, max_length=MAX_MESSAGES)],
               f"a string or a non-empty array of at most {MAX_MESSAGES} message items "
               '{"role": ..., "content": ...}')


# --------------------------------------------------------------------------- text.format

class TextFormat(_Body):
    """text.format: {"type": "text"}, {"type": "json_object"}, or {"type": "json_schema",
    "name", "schema", "description", "strict"} (the schema is enforced by constrained
    decoding, strict or not)."""
    type: FormatType
    name: Optional[Name] = None
    description: Optional[Text] = None
    schema_: Optional[JsonObject] = Field(None, alias="schema")
    strict: Optional[bool] = None


Verbosity = _literal("low", "medium", "high")


class TextConfig(_Body):
    format: Optional[TextFormat] = None
    verbosity: Optional[Verbosity] = None      # accepted, ignored


Metadata = described(Annotated[Dict[Annotated[str, Field(max_length=MAX_METADATA_KEY)],
                                    Annotated[str, Field(max_length=MAX_METADATA_VALUE)]],
                               Field(max_length=MAX_METADATA)],
                     f"an object of at most {MAX_METADATA} string values")


# --------------------------------------------------------------------------- the body

class ResponseCreateRequest(_Closed):
    """POST /v1/responses. Any key not declared here is a 400 naming it."""
    model: Optional[Name] = None
    input: Input
    instructions: Optional[Text] = None
    previous_response_id: Optional[ResponseId] = None
    max_output_tokens: Optional[MaxTokens] = None
    temperature: Optional[Temperature] = None
    top_p: Optional[TopP] = None
    stream: Optional[bool] = None
    store: Optional[bool] = None
    text: Optional[TextConfig] = None
    metadata: Optional[Metadata] = None
    user: Optional[Name] = None
    parallel_tool_calls: Optional[bool] = None
    max_tool_calls: Optional[TokenCount] = None
    # SGLang's sampling extensions of /v1/responses (the same types and bounds as on chat)
    frequency_penalty: Optional[Penalty] = None
    presence_penalty: Optional[Penalty] = None
    repetition_penalty: Optional[RepetitionPenalty] = None
    top_k: Optional[TopK] = None
    min_p: Optional[MinP] = None
    stop: Optional[Stop] = None
    # accepted and ignored (schemas.IGNORED_FIELDS says why)
    safety_identifier: Optional[_ignored(Name, "safety_identifier")] = None
    service_tier: Optional[_ignored(Name, "service_tier")] = None
    prompt_cache_key: Optional[_ignored(Name, "prompt_cache_key")] = None
    prompt_cache_retention: Optional[_ignored(Name, "prompt_cache_retention")] = None
    stream_options: Optional[_ignored(JsonObject, "stream_options")] = None
    # refused unless neutral (see the module docstring)
    tools: Optional[Tools] = None
    tool_choice: Optional[ToolChoice] = None
    reasoning: Optional[Reasoning] = None
    background: Optional[Background] = None
    include: Optional[Include] = None
    truncation: Optional[Truncation] = None
    top_logprobs: Optional[NoTopLogprobs] = None
    n: Optional[OneSample] = None
    conversation: NoConversation = None
    prompt: NoPrompt = None
    context_management: NoContextManagement = None
    moderation: NoModeration = None


REQUEST_MODELS = (ResponseCreateRequest,)
