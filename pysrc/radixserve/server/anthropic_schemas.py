"""The request bodies of Anthropic's Messages API (POST /v1/messages and
/v1/messages/count_tokens) as pydantic v2 models, with schemas.py's conventions and types:
strict types, every sampling number bounded by sampling/params.BOUNDS (the same field types the
chat route uses), every list and string capped, unknown top-level fields refused (400 naming
them), `schemas.parse` for a 400 naming the dotted field (messages[2].content[0].type). Also
the response shapes and the paths of the OpenAPI document (server/openapi.py).

What a body may hold:
  messages        role "user" or "assistant"; content a string or content blocks: text and
                  tool_result (user), text, tool_use, thinking and redacted_thinking
                  (assistant; thinking is dropped from the prompt, as the chat templates of
                  reasoning models drop earlier reasoning). Which role may hold which block is
                  anthropic_requests.py's rule. Images, documents and every other block type
                  are refused by name (the served models read text only).
  system          a string or a list of text blocks
  max_tokens      required (as Anthropic requires it); stop_sequences, temperature, top_p,
                  top_k: the sampling numbers of the chat route
  tools           custom tools {name, description, input_schema}; server tools (web_search,
                  bash, ...) are refused: nothing runs tools here
  tool_choice     {type: auto | any | tool | none, name (tool), disable_parallel_tool_use}
  thinking        {type: enabled | disabled | adaptive, budget_tokens}: whether the chat
                  template is asked to think (anthropic_requests.py); the budget is not enforced
                  (max_tokens bounds the whole output)
  stream          server-sent events in Anthropic's sequence (anthropic_render.py)
Accepted and ignored: metadata, service_tier, cache_control (everywhere), a block's citations
and other keys of a block or tool this server has no use for. Refused: container,
mcp_servers, context_management, output_config (features this server lacks).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, WrapValidator
from typing_extensions import Annotated, Literal

from radixserve.errors import describe
from radixserve.server.schemas import (MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_STOP, MAX_TOOLS,
                                       TEXT_ONLY, JsonObject, MaxTokens, Name, StopString,
                                       Temperature, Text, TokenCount, TopK, TopP, _Body, _Closed,
                                       _error, _literal, _refused, described, either)

MAX_TOOL_NAME = 128


def _accepted(t: Any, why: str) -> Any:
    """`t`, validated as usual, then ignored (`why` says why that is harmless)."""
    return Annotated[t, Field(description="accepted and ignored: " + why)]


CacheControl = _accepted(JsonObject, "prompt-caching hints; the radix cache finds shared "
                                     "prefixes by itself")


# --------------------------------------------------------------------------- content blocks

class AnthropicTextBlock(_Body):
    """{"type": "text", "text": ...}; citations and other keys are ignored."""
    type: Literal["text"]
    text: Text
    cache_control: Optional[CacheControl] = None


class AnthropicToolUseBlock(_Body):
    """An assistant's call: {"type": "tool_use", "id", "name", "input": {...}}."""
    type: Literal["tool_use"]
    id: Annotated[Name, Field(min_length=1)]
    name: Annotated[Name, Field(min_length=1)]
    input: JsonObject
    cache_control: Optional[CacheControl] = None


ResultContent = either(Text, Annotated[List[AnthropicTextBlock],
                                       Field(max_length=MAX_CONTENT_PARTS)],
                       f"a string or an array of at most {MAX_CONTENT_PARTS} text blocks "
                       '{"type": "text", "text": "..."}')


class AnthropicToolResultBlock(_Body):
    """A user's answer to a call: {"type": "tool_result", "tool_use_id", "content",
    "is_error"}."""
    type: Literal["tool_result"]
    tool_use_id: Annotated[Name, Field(min_length=1)]
    content: Optional[ResultContent] = None
    is_error: Optional[bool] = None
    cache_control: Optional[CacheControl] = None


class AnthropicThinkingBlock(_Body):
    """Earlier reasoning sent back: {"type": "thinking", "thinking", "signature"}."""
    type: Literal["thinking"]
    thinking: Text
    signature: Optional[Text] = None


class AnthropicRedactedThinkingBlock(_Body):
    type: Literal["redacted_thinking"]
    data: Text


_BLOCKS: Dict[str, TypeAdapter] = {
    "text": TypeAdapter(AnthropicTextBlock),
    "tool_use": TypeAdapter(AnthropicToolUseBlock),
    "tool_result": TypeAdapter(AnthropicToolResultBlock),
    "thinking": TypeAdapter(AnthropicThinkingBlock),
    "redacted_thinking": TypeAdapter(AnthropicRedactedThinkingBlock)}
_NOT_TEXT = frozenset({"image", "document", "search_result", "container_upload"})


def _block_kind(v: Any, handler):
    """A content block, chosen by its "type" (a problem inside it keeps its own location)."""
    if not isinstance(v, dict):
        raise _error(f'must be a content block object {{"type": ..., ...}}, got {describe(v)}')
    kind = v.get("type")
    adapter = _BLOCKS.get(kind) if isinstance(kind, str) else None
    if adapter is not None:
        return adapter.validate_python(v, strict=True)
    if kind in _NOT_TEXT:
        raise _error(f"is a {kind} block, which is not supported: {TEXT_ONLY}; send text "
                     f"blocks")
    allowed = ", ".join(repr(k) for k in _BLOCKS)
    raise _error(f"has type {describe(kind)}; the content blocks served here are {allowed} "
                 f"(server tool blocks are not: no tools run on this server)")


ContentBlock = Annotated[Union[AnthropicTextBlock, AnthropicToolUseBlock, AnthropicToolResultBlock,
                               AnthropicThinkingBlock, AnthropicRedactedThinkingBlock],
                         WrapValidator(_block_kind)]
MessageContent = either(Text, Annotated[List[ContentBlock],
                                        Field(min_length=1, max_length=MAX_CONTENT_PARTS)],
                        f"a string or a non-empty array of at most {MAX_CONTENT_PARTS} content "
                        "blocks")
MessageRole = _literal("user", "assistant",
                       note=" (the system prompt goes in the top-level system field)")


class AnthropicMessageParam(_Body):
    """One turn: {"role": "user" | "assistant", "content": ...}."""
    role: MessageRole
    content: MessageContent


Messages = described(Annotated[List[AnthropicMessageParam],
                               Field(min_length=1, max_length=MAX_MESSAGES)],
                     f"a non-empty array of at most {MAX_MESSAGES} message objects with role "
                     "and content")
System = either(Text, Annotated[List[AnthropicTextBlock], Field(max_length=MAX_CONTENT_PARTS)],
                f"a string or an array of at most {MAX_CONTENT_PARTS} text blocks "
                '{"type": "text", "text": "..."}')


# --------------------------------------------------------------------------- tools

def _object_schema(v: Any, handler):
    if isinstance(v, dict) and v.get("type") != "object":
        raise _error('must be a JSON schema of an object ({"type": "object", "properties": '
                     f'{{...}}}}), got type {describe(v.get("type"))}')
    return handler(v)


InputSchema = Annotated[JsonObject, WrapValidator(_object_schema),
                        Field(json_schema_extra={"required": ["type"],
                                                 "properties": {"type": {"const": "object"}}})]
ToolName = Annotated[str, Field(pattern=rf"^[A-Za-z0-9_-]{{1,{MAX_TOOL_NAME}}}$")]
ToolType = _literal("custom", note=" (server tools such as web_search, bash or text_editor are "
                                   "not run here; describe a custom tool with input_schema)")


class AnthropicTool(_Body):
    """A custom tool: {"name", "description", "input_schema"}; type, when given, is "custom".
    Other keys (strict, input_examples, ...) are ignored: calls always follow input_schema."""
    type: Optional[ToolType] = None         # first: a server tool is named by its type
    name: ToolName
    description: Optional[Text] = None
    input_schema: InputSchema
    cache_control: Optional[CacheControl] = None


ToolChoiceType = _literal("auto", "any", "tool", "none")


class AnthropicToolChoice(_Body):
    """{"type": "auto" | "any" | "tool" | "none", "name" (with tool),
    "disable_parallel_tool_use"}."""
    type: ToolChoiceType
    name: Optional[Name] = None
    disable_parallel_tool_use: Optional[bool] = None


ThinkingType = _literal("enabled", "disabled", "adaptive")


class AnthropicThinkingConfig(_Body):
    """{"type": "enabled", "budget_tokens": N} | {"type": "disabled"} | {"type": "adaptive"}."""
    type: ThinkingType
    budget_tokens: Optional[TokenCount] = None


# --------------------------------------------------------------------------- the bodies

_LACKS = "is not supported: {what}; leave it out"


class AnthropicCountTokensRequest(_Closed):
    """POST /v1/messages/count_tokens: what renders the prompt. Any other key is a 400."""
    model: Optional[Name] = None
    messages: Messages
    system: Optional[System] = None
    tools: Optional[Annotated[List[AnthropicTool], Field(max_length=MAX_TOOLS)]] = None
    tool_choice: Optional[AnthropicToolChoice] = None
    thinking: Optional[AnthropicThinkingConfig] = None
    cache_control: Optional[CacheControl] = None
    mcp_servers: _refused(_LACKS.format(what="no MCP servers are called from here")) = None


class AnthropicMessagesRequest(AnthropicCountTokensRequest):
    """POST /v1/messages. Any key not declared here is a 400 naming it."""
    max_tokens: MaxTokens
    stop_sequences: Optional[Annotated[List[StopString], Field(max_length=MAX_STOP)]] = None
    temperature: Optional[Temperature] = None
    top_p: Optional[TopP] = None
    top_k: Optional[TopK] = None
    stream: Optional[bool] = None
    metadata: Optional[_accepted(JsonObject, "a user id for Anthropic's abuse monitoring; "
                                             "the server keeps no per-user state")] = None
    service_tier: Optional[_accepted(Name, "one tier here: every request is served the "
                                           "same way")] = None
    container: _refused(_LACKS.format(what="no code-execution containers here")) = None
    context_management: _refused(_LACKS.format(what="no context editing here")) = None
    output_config: _refused(_LACKS.format(what="no output settings beyond max_tokens, "
                                               "stop_sequences and the sampling numbers")) = None


REQUEST_MODELS = (AnthropicCountTokensRequest, AnthropicMessagesRequest)


# --------------------------------------------------------------------------- responses (the document)

class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


class AnthropicErrorDetail(_Out):
    type: str
    message: str


class AnthropicErrorResponse(_Out):
    """Every error body of these routes: Anthropic's shape."""
    type: Literal["error"]
    error: AnthropicErrorDetail


class AnthropicUsage(_Out):
    input_tokens: int
    output_tokens: int


class AnthropicMessage(_Out):
    """A non-streamed /v1/messages response."""
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: List[Dict[str, Any]]
    stop_reason: Optional[str]
    stop_sequence: Optional[str]
    usage: AnthropicUsage


class AnthropicStreamEvent(_Out):
    """The data of one streamed event (message_start ... message_stop, or error)."""
    type: str


class AnthropicTokenCount(_Out):
    input_tokens: int


RESPONSE_MODELS = (AnthropicErrorResponse, AnthropicMessage, AnthropicStreamEvent,
                   AnthropicTokenCount)
PATHS = ("/v1/messages", "/v1/messages/count_tokens")     # the routes these models serve
JSON, EVENT_STREAM = "application/json", "text/event-stream"


def error_doc(ref: Callable[[type], dict], description: str) -> dict:
    """An error response of these paths (the door's included), as the document declares it."""
    return {"description": description, "content": {JSON: {"schema": ref(AnthropicErrorResponse)}}}


def openapi_paths(ref: Callable[[type], dict]) -> Dict[str, dict]:
    """The two routes' path items; `ref(model)` is the document's reference to a model's
    schema. Every error answers an AnthropicErrorResponse (openapi.openapi_document gives these
    paths the door's errors in that shape too, error_doc)."""
    def body(model: type) -> dict:
        return {"required": True, "content": {JSON: {"schema": ref(model)}}}

    common = {"404": error_doc(ref, "model names a model this server does not serve"),
              "415": error_doc(ref, "Content-Type is not application/json")}
    event = {"type": "object", "required": ["event", "data"], "properties": {
        "event": {"type": "string"},
        "data": {"type": "string", "contentMediaType": JSON,
                 "contentSchema": ref(AnthropicStreamEvent)}}}
    return {
        "/v1/messages": {"post": {
            "summary": "Anthropic Messages API: create a message",
            "requestBody": body(AnthropicMessagesRequest),
            "responses": {
                "200": {"description": "the Message (application/json), or with stream=true its "
                                       "server-sent events (event: <type>, data: <json>)",
                        "content": {JSON: {"schema": ref(AnthropicMessage)},
                                    EVENT_STREAM: {"schema": event}}},
                **common,
                "503": error_doc(ref, "the server is busy (Retry-After), shutting down, or "
                                      "aborted the request")}}},
        "/v1/messages/count_tokens": {"post": {
            "summary": "Anthropic Messages API: the prompt's token count",
            "requestBody": body(AnthropicCountTokensRequest),
            "responses": {"200": {"description": "{input_tokens}",
                                  "content": {JSON: {"schema": ref(AnthropicTokenCount)}}},
                          **common}}},
    }
