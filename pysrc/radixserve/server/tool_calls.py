"""Tool calls for /v1/chat/completions: tools in the prompt, a grammar for the calls, parsing.

The wire format the model writes is `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
(Hermes / Qwen / SmolLM style). Per tool_choice:
  none      no tools in the prompt, no grammar; the output is plain content
  auto      tools in the prompt; a structural tag lets the model write free text, and once it
            opens `<tool_call>` the JSON inside must match one of the functions' schemas
  required  the output is exactly one call to one of the functions (a grammar from their
            parameter schemas, so the arguments always parse and validate)
  {"type": "function", "function": {"name": N}}   the same, for function N only
A chat template that does not mention `tools` gets them as a generic system block (prepended,
or merged into the first system message); assistant messages with tool_calls are rendered back
as the same wire format for templates without tool support.
parse_tool_calls splits the output into content and calls; ToolCallStream does it while
streaming, holding back text that may be the start of a `<tool_call>` tag.
"""
from __future__ import annotations

import json
import uuid
from typing import Any, Dict, List, Optional, Tuple

from radixserve.server.errors import bad_request

BEGIN, END = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128


# --------------------------------------------------------------------------- validation

def check_tools(tools: Optional[list], tool_choice: Any) -> Tuple[List[dict], Any]:
    """(functions, choice): each function {name, description, parameters}; choice "none" |
    "auto" | "required" | a function name. 400s name the field."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise bad_request("tool_choice needs tools; send tools or drop tool_choice",
                              param="tool_choice")
        return [], "none"
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise bad_request(f"tools must be an array of at most {MAX_TOOLS} tools", param="tools")
    functions = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or \
                not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f'tools[{i}] must be {{"type": "function", "function": {{"name": '
                              f'..., "parameters": {{...}}}}}}', param=f"tools[{i}]")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object",
                              param=f"tools[{i}].function.parameters")
        functions.append({"name": fn["name"], "description": fn.get("description") or "",
                          "parameters": params or {"type": "object"}})
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise bad_request("tools has two functions of the same name", param="tools")
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise bad_request('tool_choice must be "none", "auto", "required" or {"type": '
                              '"function", "function": {"name": ...}}', param="tool_choice")
        if name not in names:
            raise bad_request(f"tool_choice names function {name!r}, which is not in tools",
                              param="tool_choice")
        return functions, name
    if choice not in ("none", "auto", "required"):
        raise bad_request('tool_choice must be "none", "auto", "required" or {"type": '
                          '"function", "function": {"name": ...}}', param="tool_choice")
    return functions, choice


# --------------------------------------------------------------------------- grammar

def _call_schema(fn: dict) -> dict:
    return {"type": "object", "properties": {"name": {"const": fn["name"]},
                                             "arguments": fn["parameters"]},
            "required": ["name", "arguments"]}


def tool_grammar(functions: List[dict], choice: Any, parallel: bool = True) -> Optional[str]:
    """The structural tag (JSON text) that constrains the output, or None (tool_choice none).
    parallel=False (parallel_tool_calls: false): under auto the output ends after its first
    call (required and named choices always make exactly one)."""
    if choice == "none" or not functions:
        return None
    chosen = functions if choice in ("auto", "required") else \
        [f for f in functions if f["name"] == choice]
    schemas = [_call_schema(f) for f in chosen]
    tag = {"type": "tag", "begin": BEGIN + "\n",
           "content": {"type": "json_schema",
                       "json_schema": schemas[0] if len(schemas) == 1 else {"anyOf": schemas}},
           "end": "\n" + END}
    if choice == "auto":
        fmt = {"type": "triggered_tags", "triggers": [BEGIN], "tags": [tag],
               "at_least_one": False, "stop_after_first": not parallel}
    else:
        fmt = tag
    return json.dumps({"type": "structural_tag", "format": fmt})


# --------------------------------------------------------------------------- the prompt

def tools_system_block(functions: List[dict]) -> str:
    lines = ["You can call these functions. To call one, reply with exactly",
             f'{BEGIN}\n{{"name": <function name>, "arguments": <arguments object>}}\n{END}',
             "Functions (JSON):"]
    lines += [json.dumps({"name": f["name"], "description": f["description"],
                          "parameters": f["parameters"]}) for f in functions]
    return "\n".join(lines)


def render_tool_calls(calls: List[dict]) -> str:
    """An assistant message's tool_calls in the wire format (templates without tool support)."""
    out = []
    for c in calls:
        fn = c.get("function") or {}
        args = fn.get("arguments")
        try:
            args = json.loads(args) if isinstance(args, str) else (args or {})
        except ValueError:
            pass
        out.append(f'{BEGIN}\n{json.dumps({"name": fn.get("name"), "arguments": args})}\n{END}')
    return "\n".join(out)


def messages_for_template(messages: List[dict], functions: List[dict],
                          template_knows_tools: bool) -> List[dict]:
    """The messages a template without tool support needs: the tools as a system block and
    assistant tool_calls as text. Templates that handle tools get the messages unchanged."""
    if template_knows_tools:
        return messages
    out = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            text = render_tool_calls(m["tool_calls"])
            m = {**m, "content": (m.get("content") or "") + ("\n" if m.get("content") else "")
                 + text}
            m.pop("tool_calls", None)
        out.append(m)
    if functions:
        block = tools_system_block(functions)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{block}".strip()}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


# --------------------------------------------------------------------------- parsing

def _call(payload: str) -> Optional[dict]:
    try:
        obj = json.loads(payload, strict=False)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args)}}


def parse_tool_calls(text: str) -> Tuple[Optional[str], List[dict]]:
    """(content or None, tool_calls): every complete, parseable <tool_call> block becomes a
    call; the text outside the blocks (stripped) is the content."""
    calls, content, pos = [], [], 0
    while True:
        start = text.find(BEGIN, pos)
        if start < 0:
            content.append(text[pos:])
            break
        end = text.find(END, start)
        if end < 0:
            content.append(text[pos:])
            break
        call = _call(text[start + len(BEGIN):end].strip())
        content.append(text[pos:start] if call is not None else text[pos:end + len(END)])
        if call is not None:
            calls.append(call)
        pos = end + len(END)
    joined = "".join(content).strip()
    return (joined or None), calls


class ToolCallStream:
    """Streaming: feed(text_delta) -> content to send now; finish() -> (content, calls) left.
    Text from the first `<tool_call>` on is held until the end, as is any tail that may be
    the start of the tag."""

    def __init__(self):
        self._held = ""
        self._in_call = False

    def feed(self, delta: str) -> str:
        if self._in_call:
            self._held += delta
            return ""
        text = self._held + delta
        start = text.find(BEGIN)
        if start >= 0:
            self._in_call, self._held = True, text[start:]
            return text[:start]
        keep = 0
        for n in range(min(len(BEGIN) - 1, len(text)), 0, -1):
            if text.endswith(BEGIN[:n]):
                keep = n
                break
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def finish(self) -> Tuple[str, List[dict]]:
        if not self._in_call:
            return self._held, []
        content, calls = parse_tool_calls(self._held)
        return content or "", calls
