"""An Anthropic Messages body (validated by anthropic_schemas.py) -> the chat route's request.

Contract. `parse_messages_request` / `parse_count_tokens_request` validate the body once
(schemas.parse with the Anthropic models, whose sampling numbers are the chat route's field
types) and return a `requests.ChatRequest` plus the tool_choice in the chat route's form, so
that openai_api's tool and reasoning machinery and its chat-template path serve the request
unchanged. Nothing here touches the engine. The mapping:

  system                  a first system message (text blocks joined by newlines)
  user text blocks        one user message per run of text blocks (joined by newlines)
  tool_result             a tool message {tool_call_id, name (the tool_use's), content} as the
                          chat route renders tool messages; is_error puts "Error: " first
  assistant text/tool_use one assistant message: content (text blocks joined by newlines) and
                          tool_calls [{id, type: function, function: {name, arguments}}]
  thinking blocks         dropped (the chat templates of reasoning models drop earlier
                          reasoning; Anthropic ignores it outside a tool-use turn too)
  tools                   OpenAI function tools {name, description, parameters: input_schema}
  tool_choice             auto -> "auto", any -> "required", tool -> that function,
                          none -> "none"; disable_parallel_tool_use -> parallel_tool_calls false
  thinking                chat_template_kwargs {"enable_thinking": type != "disabled"} (the
                          template variable reasoning models read; others ignore it)
  max_tokens ...          SamplingParams (max_new_tokens, stop, temperature, top_p, top_k),
                          verified by requests.sampling_params_from_dict
Rules across fields, each a 400 naming the field: a block in the wrong role's message, a
final assistant message (continuing a partial assistant reply is not supported), tool_choice
"tool" without a name or a name with another type, thinking "enabled" without budget_tokens.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, List, Optional, Union

from radixserve.errors import bad_request
from radixserve.sampling.params import SamplingParams
from radixserve.server import anthropic_schemas as A
from radixserve.server import requests as R
from radixserve.server import schemas as S

_USER_BLOCKS = ("text", "tool_result")
_ASSISTANT_BLOCKS = ("text", "tool_use", "thinking", "redacted_thinking")


@dataclasses.dataclass
class MessagesRequest:
    """A validated Messages (or count_tokens) body in the chat route's terms."""
    chat: R.ChatRequest
    tool_choice: Any            # the chat route's tool_choice ("auto", "required", {...}, None)


def _texts(blocks: List[A.AnthropicTextBlock]) -> str:
    return "\n".join(b.text for b in blocks)


def _result_text(block: A.AnthropicToolResultBlock) -> str:
    content = block.content
    text = "" if content is None else content if isinstance(content, str) else _texts(content)
    return "Error: " + text if block.is_error else text


def _user_turn(i: int, blocks: list, tool_names: Dict[str, str], out: List[dict]) -> None:
    pending: List[str] = []

    def flush() -> None:
        if pending:
            out.append({"role": "user", "content": "\n".join(pending)})
            pending.clear()

    for j, block in enumerate(blocks):
        if block.type not in _USER_BLOCKS:
            raise _misplaced(i, j, block.type, "user", _USER_BLOCKS)
        if block.type == "text":
            pending.append(block.text)
            continue
        flush()
        msg = {"role": "tool", "tool_call_id": block.tool_use_id, "content": _result_text(block)}
        if block.tool_use_id in tool_names:
            msg["name"] = tool_names[block.tool_use_id]
        out.append(msg)
    flush()


def _assistant_turn(i: int, blocks: list, tool_names: Dict[str, str], out: List[dict]) -> None:
    texts, calls = [], []
    for j, block in enumerate(blocks):
        if block.type not in _ASSISTANT_BLOCKS:
            raise _misplaced(i, j, block.type, "assistant", _ASSISTANT_BLOCKS)
        if block.type == "text":
            texts.append(block.text)
        elif block.type == "tool_use":
            tool_names[block.id] = block.name
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input)}})
    msg: Dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        msg["tool_calls"] = calls
    out.append(msg)


def _misplaced(i: int, j: int, kind: str, role: str, allowed) -> Exception:
    where = f"messages[{i}].content[{j}]"
    return bad_request(f"{where} is a {kind} block, which a {role} message cannot hold (a {role} "
                       f"message holds {', '.join(allowed)} blocks)", param=f"{where}.type")


def chat_messages(system: Optional[Union[str, List[A.AnthropicTextBlock]]],
                  messages: List[A.AnthropicMessageParam]) -> List[dict]:
    """The conversation as the chat messages the template renders (module docstring)."""
    out: List[dict] = []
    if system:
        text = system if isinstance(system, str) else _texts(system)
        out.append({"role": "system", "content": text})
    tool_names: Dict[str, str] = {}          # tool_use id -> tool name, for tool messages
    for i, m in enumerate(messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
        elif m.role == "user":
            _user_turn(i, m.content, tool_names, out)
        else:
            _assistant_turn(i, m.content, tool_names, out)
    last = len(messages) - 1
    if messages[last].role != "user":
        raise bad_request(f"messages[{last}] is an assistant message: the conversation must end "
                          "with a user message (continuing a partial assistant reply is not "
                          "supported)", param=f"messages[{last}].role")
    return out


def _tools(tools: Optional[List[A.AnthropicTool]]) -> Optional[List[dict]]:
    if tools is None:
        return None
    return [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                              "parameters": t.input_schema}} for t in tools]


def _tool_choice(choice: Optional[A.AnthropicToolChoice]) -> Any:
    """The chat route's tool_choice for Anthropic's (None: the default, auto with tools)."""
    if choice is None:
        return None
    if choice.type == "tool":
        if not choice.name:
            raise bad_request('tool_choice.name is required when tool_choice.type is "tool"',
                              param="tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}
    if choice.name is not None:
        raise bad_request(f'tool_choice.name goes only with tool_choice.type "tool", not '
                          f'{choice.type!r}; remove it', param="tool_choice.name")
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _template_kwargs(thinking: Optional[A.AnthropicThinkingConfig]) -> Dict[str, Any]:
    if thinking is None:
        return {}
    if thinking.type == "enabled" and thinking.budget_tokens is None:
        raise bad_request('thinking.budget_tokens is required when thinking.type is "enabled"',
                          param="thinking.budget_tokens")
    return {"enable_thinking": thinking.type != "disabled"}


def _sampling(req: A.AnthropicMessagesRequest) -> SamplingParams:
    d: Dict[str, Any] = {"max_new_tokens": req.max_tokens}
    for name in ("temperature", "top_p", "top_k"):
        if getattr(req, name) is not None:
            d[name] = getattr(req, name)
    if req.stop_sequences:
        d["stop"] = list(req.stop_sequences)
    return R.sampling_params_from_dict(d, names={"max_new_tokens": "max_tokens",
                                                 "stop": "stop_sequences"})


def _request(req: A.AnthropicCountTokensRequest, sampling: SamplingParams,
             stream: bool) -> MessagesRequest:
    choice = req.tool_choice
    chat = R.ChatRequest(
        messages=chat_messages(req.system, req.messages), tools=_tools(req.tools),
        add_generation_prompt=True, stream=stream, include_usage=False, n=1, logprobs=False,
        top_logprobs=0, sampling=sampling,
        parallel_tool_calls=not (choice is not None and choice.disable_parallel_tool_use),
        template_kwargs=_template_kwargs(req.thinking))
    return MessagesRequest(chat, _tool_choice(choice))


def parse_messages_request(body: dict) -> MessagesRequest:
    """Validate a /v1/messages body (the model name is checked by the route)."""
    req = S.parse(A.AnthropicMessagesRequest, body)
    return _request(req, _sampling(req), stream=bool(req.stream))


def parse_count_tokens_request(body: dict) -> MessagesRequest:
    """Validate a /v1/messages/count_tokens body; its sampling is the defaults (nothing is
    generated)."""
    req = S.parse(A.AnthropicCountTokensRequest, body)
    return _request(req, SamplingParams.from_dict({}, bounds_checked=True), stream=False)
