"""The bodies of POST /tokenize and /detokenize, vLLM's shapes, as pydantic v2 models with
schemas.py's conventions (strict types, capped lists and strings, unknown keys a 400 naming
them), plus their responses and OpenAPI paths.

  TokenizeCompletionRequest  {model, prompt, add_special_tokens (default true),
                             return_token_strs}
  TokenizeChatRequest        {model, messages (the chat route's message objects),
                             add_generation_prompt (default true), add_special_tokens (default
                             false: the template writes them), return_token_strs, tools,
                             chat_template_kwargs}; continue_final_message only false and
                             chat_template only null, as on the chat route; mm_processor_kwargs
                             refused (text only)
  DetokenizeRequest          {model, tokens}: token ids (0 or more; each in [0, 2^31 - 1] here,
                             in the vocabulary: tokenize_api's check)
A /tokenize body with a `messages` key is a chat request, any other a completion one.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

from pydantic import BaseModel, ConfigDict, Field
from typing_extensions import Annotated

from radixserve.server.schemas import (MAX_PROMPT_TOKENS, MAX_TOOLS, ChatTemplate,
                                       ChatTemplateKwargs, ContinueFinalMessage, JsonObject,
                                       Messages, Name, Text, TokenId, _Closed, _refused)


class TokenizeCompletionRequest(_Closed):
    """POST /tokenize with a text prompt."""
    model: Optional[Name] = None
    prompt: Text
    add_special_tokens: Optional[bool] = None
    return_token_strs: Optional[bool] = None


class TokenizeChatRequest(_Closed):
    """POST /tokenize with chat messages, rendered as /v1/chat/completions renders them."""
    model: Optional[Name] = None
    messages: Messages
    add_generation_prompt: Optional[bool] = None
    add_special_tokens: Optional[bool] = None
    return_token_strs: Optional[bool] = None
    tools: Optional[Annotated[List[JsonObject], Field(max_length=MAX_TOOLS)]] = None
    chat_template_kwargs: Optional[ChatTemplateKwargs] = None
    continue_final_message: Optional[ContinueFinalMessage] = None
    chat_template: Optional[ChatTemplate] = None
    mm_processor_kwargs: _refused("is not supported: the served models read text only; leave "
                                  "it out") = None


class DetokenizeRequest(_Closed):
    """POST /detokenize."""
    model: Optional[Name] = None
    tokens: Annotated[List[TokenId], Field(max_length=MAX_PROMPT_TOKENS)]


REQUEST_MODELS = (TokenizeCompletionRequest, TokenizeChatRequest, DetokenizeRequest)


class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


class TokenizeResponse(_Out):
    count: int
    max_model_len: int
    tokens: List[int]
    token_strs: Optional[List[str]] = None


class DetokenizeResponse(_Out):
    prompt: str


RESPONSE_MODELS = (TokenizeResponse, DetokenizeResponse)
JSON = "application/json"


def openapi_paths(ref: Callable[[type], dict], error: Callable[[str], dict]) -> Dict[str, dict]:
    """The two routes' path items; `ref(model)` refers to a model's schema, `error(description)`
    is the document's error response."""
    def route(summary: str, body: dict, result: type, description: str) -> dict:
        return {"post": {"summary": summary,
                         "requestBody": {"required": True, "content": {JSON: {"schema": body}}},
                         "responses": {
                             "200": {"description": description,
                                     "content": {JSON: {"schema": ref(result)}}},
                             "404": error("model names a model this server does not serve"),
                             "415": error("Content-Type is not application/json")}}}

    return {
        "/tokenize": route("vLLM's tokenize: a prompt's token ids, or chat messages' as the chat "
                           "template renders them",
                           {"anyOf": [ref(TokenizeCompletionRequest), ref(TokenizeChatRequest)]},
                           TokenizeResponse, "{count, max_model_len, tokens, token_strs}"),
        "/detokenize": route("vLLM's detokenize: the text of token ids", ref(DetokenizeRequest),
                             DetokenizeResponse, "{prompt}"),
    }
