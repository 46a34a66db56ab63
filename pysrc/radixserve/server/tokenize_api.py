"""vLLM's tokenizer routes: POST /tokenize and POST /detokenize (shapes: tokenize_schemas.py).

/tokenize with `prompt` encodes the text (add_special_tokens, default true, as vLLM); with
`messages` it renders the conversation exactly as /v1/chat/completions does (the same message
validation, tools through openai_api._chat_tools with tool_choice auto, chat_template_kwargs,
openai_api.render_messages), so with the defaults (add_generation_prompt true,
add_special_tokens false) its tokens are the chat route's prompt ids for the same messages.
Either way the text is counted whatever its length (max_model_len says what fits). The answer
is {"count", "max_model_len" (the context length), "tokens", "token_strs"}: token_strs is null
unless return_token_strs, then each token's text as decoded alone (Tokenizer.token_text; a
token that is part of a UTF-8 character shows as U+FFFD).

/detokenize answers {"prompt": the text of `tokens`}, special tokens kept, so tokenize then
detokenize gives the text back. Every id must be in the model's vocabulary: a negative one is
refused by the schema, one at or past vocab_size by the same id scan prompts get
(engine/validation.first_bad_id); both are 400s naming tokens. A long list is decoded off the
event loop.

Errors are the OpenAI shape every route but the Anthropic ones answers.
"""
from __future__ import annotations

import asyncio
from typing import List

from starlette.requests import Request
from starlette.responses import Response

from radixserve.engine.validation import first_bad_id
from radixserve.errors import bad_request
from radixserve.sampling.params import SamplingParams
from radixserve.server import requests as R
from radixserve.server import schemas as S
from radixserve.server import tokenize_schemas as T
from radixserve.server.generation import OFF_LOOP_CHARS, encode_prompt
from radixserve.server.jsonio import JSONResponse
from radixserve.server.openai_api import _chat_tools, model_aliases, render_messages
from radixserve.server.security import read_json_object

OFF_LOOP_IDS = OFF_LOOP_CHARS        # token lists this long or longer are decoded off the loop


async def _body(request: Request, engine) -> dict:
    body = await read_json_object(request)
    R.check_model(body, engine.served_model_name, model_aliases(engine))
    return body


async def _chat_ids(engine, req: T.TokenizeChatRequest) -> List[int]:
    """The chat route's prompt ids for req's messages and tools (module docstring)."""
    chat = R.ChatRequest(
        messages=[R._message_dict(i, m) for i, m in enumerate(req.messages)], tools=req.tools,
        add_generation_prompt=req.add_generation_prompt is not False, stream=False,
        include_usage=False, n=1, logprobs=False, top_logprobs=0,
        sampling=SamplingParams.from_dict({}, bounds_checked=True),
        template_kwargs=dict(req.chat_template_kwargs or {}))
    tools = _chat_tools(engine, {}, chat)
    return await render_messages(engine, tools.messages, chat.add_generation_prompt,
                                 tools.template_tools, template_kwargs=chat.template_kwargs,
                                 must_fit=False, add_special_tokens=req.add_special_tokens is True)


async def tokenize(request: Request, engine) -> Response:
    """POST /tokenize."""
    body = await _body(request, engine)
    if "messages" in body:
        req = S.parse(T.TokenizeChatRequest, body)
        ids = await _chat_ids(engine, req)
    else:
        req = S.parse(T.TokenizeCompletionRequest, body)
        ids = await encode_prompt(engine, req.prompt, "prompt",
                                  add_special_tokens=req.add_special_tokens is not False,
                                  must_fit=False)
    strs = [engine.tokenizer.token_text(i) for i in ids] if req.return_token_strs else None
    return JSONResponse({"count": len(ids), "max_model_len": engine.context_len,
                         "tokens": list(ids), "token_strs": strs})


async def detokenize(request: Request, engine) -> Response:
    """POST /detokenize."""
    req = S.parse(T.DetokenizeRequest, await _body(request, engine))
    vocab = engine.model_config.vocab_size
    bad = first_bad_id(req.tokens, vocab)
    if bad is not None:
        raise bad_request(f"tokens contains token id {bad}, outside the vocabulary [0, {vocab})",
                          param="tokens")
    decode = engine.tokenizer.decode
    if len(req.tokens) < OFF_LOOP_IDS:
        text = decode(req.tokens, skip_special_tokens=False)
    else:
        text = await asyncio.to_thread(decode, req.tokens, skip_special_tokens=False)
    return JSONResponse({"prompt": text})
