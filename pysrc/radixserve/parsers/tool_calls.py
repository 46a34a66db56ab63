"""Tool calls for /v1/chat/completions: tools in the prompt, a grammar for the calls, parsing.

The wire format the model writes is chosen by --tool-call-parser (FORMATS):
  hermes (qwen25)       `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks,
                        anywhere in the output (Hermes, Qwen2.5 / Qwen3, SmolLM)
  llama3 (llama3_json)  bare `{"name": ..., "parameters": {...}}` objects, several joined by
                        "; " (Llama 3.1 / 3.2 / 3.3 with JSON tool calling)
Per tool_choice:
  none      no tools in the prompt, no grammar; the output is plain content
  auto      tools in the prompt; a structural tag lets the model write free text, and once it
            opens a call (the format's trigger) the arguments must match that function's schema
  required  the output is exactly one call to one of the functions (a grammar from their
            parameter schemas, so the arguments always parse and validate)
  {"type": "function", "function": {"name": N}}   the same, for function N only
A chat template that does not mention `tools` gets them as a generic system block (prepended,
or merged into the first system message) that shows the format; assistant messages with
tool_calls are rendered back in the same format for templates without tool support.
ToolFormat.parse splits an output into content and calls; ToolCallStream does it while
streaming, holding back text from where a call may begin.
"""
from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from typing import Any, Dict, List, Optional, Tuple

from radixserve.errors import bad_request

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


# --------------------------------------------------------------------------- formats

def _new_call(name: str, args: Any) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)}}


def _chosen(functions: List[dict], choice: Any) -> List[dict]:
    """The functions a tool_choice allows: none for "none", all for auto / required, else the
    named one."""
    if choice == "none":
        return []
    return functions if choice in ("auto", "required") else \
        [f for f in functions if f["name"] == choice]


def _call_args(call: dict) -> Tuple[Any, Any]:
    """(name, arguments object) of an OpenAI tool_calls entry (arguments given as JSON text)."""
    fn = call.get("function") or {}
    args = fn.get("arguments")
    try:
        args = json.loads(args) if isinstance(args, str) else (args or {})
    except (ValueError, RecursionError):             # kept as the text the client sent
        pass
    return fn.get("name"), args


class ToolFormat(ABC):
    """One wire format: how calls are written, constrained, found and shown to the model.
    Subclasses set `trigger` (what opens every call: a prefix of each tag's begin) and
    `joiner` (between calls rendered back)."""
    trigger = ""
    joiner = "\n"

    @abstractmethod
    def call_text(self, name: str, args: Any) -> str:
        """One call as the model writes it."""

    @abstractmethod
    def tag(self, fn: dict) -> dict:
        """The structural tag of one call to fn (its arguments constrained by its schema)."""

    @abstractmethod
    def find_calls(self, text: str) -> List[Tuple[int, int, dict]]:
        """(start, end, call) of every complete call in text, in order, not overlapping."""

    @abstractmethod
    def call_start(self, text: str) -> Tuple[int, bool]:
        """Where a call may begin in text: (index, True) at the first certain start, (index,
        False) where text's tail may still become one, (-1, False) where neither."""

    # ---------------------------------------------------------------- shared
    def grammar(self, functions: List[dict], choice: Any, parallel: bool = True) -> Optional[str]:
        """The structural tag (JSON text) that constrains the output, or None (tool_choice
        none). parallel=False (parallel_tool_calls: false): under auto the output ends after
        its first call (required and named choices always make exactly one)."""
        chosen = _chosen(functions, choice)
        if not chosen:
            return None
        tags = [self.tag(f) for f in chosen]
        if choice == "auto":
            fmt = {"type": "triggered_tags", "triggers": [self.trigger], "tags": tags,
                   "at_least_one": False, "stop_after_first": not parallel}
        else:
            fmt = tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}
        return json.dumps({"type": "structural_tag", "format": fmt})

    def system_block(self, functions: List[dict]) -> str:
        lines = ["You can call these functions. To call one, reply with exactly",
                 self.call_text("<function name>", "<arguments object>")
                 .replace('"<function name>"', "<function name>")
                 .replace('"<arguments object>"', "<arguments object>"),
                 "Functions (JSON):"]
        lines += [json.dumps({"name": f["name"], "description": f["description"],
                              "parameters": f["parameters"]}) for f in functions]
        return "\n".join(lines)

    def render_calls(self, calls: List[dict]) -> str:
        """An assistant message's tool_calls in this format (templates without tool support)."""
        return self.joiner.join(self.call_text(*_call_args(c)) for c in calls)

    def parse(self, text: str) -> Tuple[Optional[str], List[dict]]:
        """(content or None, tool_calls): every complete, parseable call becomes a call; the
        text outside them (stripped) is the content."""
        content, pos = [], 0
        spans = self.find_calls(text)
        for start, end, _ in spans:
            content.append(text[pos:start])
            pos = end
        content.append(text[pos:])
        joined = self._tidy("".join(content))
        return (joined or None), [call for _, _, call in spans]

    def _tidy(self, content: str) -> str:
        return content.strip()


class HermesFormat(ToolFormat):
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks."""
    trigger = BEGIN

    def call_text(self, name: str, args: Any) -> str:
        return f'{BEGIN}\n{json.dumps({"name": name, "arguments": args})}\n{END}'

    def tag(self, fn: dict) -> dict:
        schema = {"type": "object", "properties": {"name": {"const": fn["name"]},
                                                   "arguments": fn["parameters"]},
                  "required": ["name", "arguments"]}
        return {"type": "tag", "begin": BEGIN + "\n",
                "content": {"type": "json_schema", "json_schema": schema}, "end": "\n" + END}

    def grammar(self, functions: List[dict], choice: Any, parallel: bool = True) -> Optional[str]:
        """One tag for all chosen functions (the name inside the JSON picks one)."""
        chosen = _chosen(functions, choice)
        if not chosen:
            return None
        tags = [self.tag(f) for f in chosen]
        schemas = [t["content"]["json_schema"] for t in tags]
        tag = {**tags[0], "content": {"type": "json_schema", "json_schema":
                                      schemas[0] if len(schemas) == 1 else {"anyOf": schemas}}}
        if choice == "auto":
            fmt = {"type": "triggered_tags", "triggers": [BEGIN], "tags": [tag],
                   "at_least_one": False, "stop_after_first": not parallel}
        else:
            fmt = tag
        return json.dumps({"type": "structural_tag", "format": fmt})

    def find_calls(self, text: str) -> List[Tuple[int, int, dict]]:
        spans, pos = [], 0
        while True:
            start = text.find(BEGIN, pos)
            end = text.find(END, start) if start >= 0 else -1
            if end < 0:
                return spans
            call = _parse_call(text[start + len(BEGIN):end].strip(), ("arguments", "parameters"))
            if call is not None:
                spans.append((start, end + len(END), call))
            pos = end + len(END)

    def call_start(self, text: str) -> Tuple[int, bool]:
        start = text.find(BEGIN)
        if start >= 0:
            return start, True
        for n in range(min(len(BEGIN) - 1, len(text)), 0, -1):
            if text.endswith(BEGIN[:n]):
                return len(text) - n, False
        return -1, False


MAX_DECODE_ATTEMPTS = 256       # llama3: JSON objects decoded per output at most
PYTHON_TAG = "<|python_tag|>"     # Llama 3's tool-call token, in text when special tokens are kept
# `{"name":` with any whitespace, and the prefixes of it that may still grow into one
_JSON_CALL = re.compile(r'\{\s*"name"\s*:')
_JSON_CALL_PREFIX = re.compile(r'\{\s*(?:"(?:n(?:a(?:m(?:e(?:"\s*)?)?)?)?)?)?')


class Llama3Format(ToolFormat):
    """Bare `{"name": ..., "parameters": {...}}` objects (Llama 3.x JSON tool calling); a
    `<|python_tag|>` before them (kept when skip_special_tokens is false) is dropped, and so
    are the `;` between calls."""
    joiner = "; "
    trigger = '{"name": '

    def call_text(self, name: str, args: Any) -> str:
        return json.dumps({"name": name, "parameters": args})

    def tag(self, fn: dict) -> dict:
        return {"type": "tag", "begin": f'{{"name": {json.dumps(fn["name"])}, "parameters": ',
                "content": {"type": "json_schema", "json_schema": fn["parameters"]}, "end": "}"}

    def find_calls(self, text: str) -> List[Tuple[int, int, dict]]:
        """Bounded work: at most MAX_DECODE_ATTEMPTS objects are decoded (each may scan to the
        end of the output), so a pathological output cannot hold the loop thread."""
        spans, pos, decoder = [], 0, json.JSONDecoder(strict=False)
        for attempt, m in enumerate(_JSON_CALL.finditer(text)):
            if attempt >= MAX_DECODE_ATTEMPTS:
                break
            if m.start() < pos:
                continue
            try:
                obj, end = decoder.raw_decode(text, m.start())
            except (ValueError, RecursionError):     # not JSON, or nested beyond the parser
                continue
            call = _call_of(obj, ("parameters", "arguments"))
            if call is not None:
                spans.append((m.start(), end, call))
                pos = end
        return spans

    def call_start(self, text: str) -> Tuple[int, bool]:
        m = _JSON_CALL.search(text)
        tag = text.find(PYTHON_TAG)
        starts = [i for i in (m.start() if m else -1, tag) if i >= 0]
        if starts:
            return min(starts), True
        for n in range(min(len(PYTHON_TAG) - 1, len(text)), 0, -1):
            if text.endswith(PYTHON_TAG[:n]):
                return len(text) - n, False
        brace = text.rfind("{")
        while brace >= 0:
            if _JSON_CALL_PREFIX.fullmatch(text, brace):
                return brace, False
            brace = text.rfind("{", 0, brace)
        return -1, False

    def _tidy(self, content: str) -> str:
        content = content.replace(PYTHON_TAG, "").strip()
        return "" if not content.strip("; \n\t") else content


FORMATS: Dict[str, ToolFormat] = {"hermes": HermesFormat(), "qwen25": HermesFormat(),
                                  "llama3": Llama3Format(), "llama3_json": Llama3Format()}


def get_format(name: Optional[str]) -> ToolFormat:
    """The format of --tool-call-parser `name` (None: hermes)."""
    return FORMATS[name or "hermes"]


def _call_of(obj: Any, arg_keys: Tuple[str, ...]) -> Optional[dict]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in arg_keys if k in obj), {})
    return _new_call(obj["name"], args)


def _parse_call(payload: str, arg_keys: Tuple[str, ...]) -> Optional[dict]:
    try:
        obj = json.loads(payload, strict=False)
    except (ValueError, RecursionError):             # not JSON, or nested beyond the parser
        return None
    return _call_of(obj, arg_keys)


# --------------------------------------------------------------------------- hermes defaults

def tool_grammar(functions: List[dict], choice: Any, parallel: bool = True,
                 fmt: Optional[ToolFormat] = None) -> Optional[str]:
    return (fmt or FORMATS["hermes"]).grammar(functions, choice, parallel)


def parse_tool_calls(text: str, fmt: Optional[ToolFormat] = None
                     ) -> Tuple[Optional[str], List[dict]]:
    return (fmt or FORMATS["hermes"]).parse(text)


# --------------------------------------------------------------------------- the prompt

def messages_for_template(messages: List[dict], functions: List[dict],
                          template_knows_tools: bool, fmt: Optional[ToolFormat] = None
                          ) -> List[dict]:
    """The messages a template without tool support needs: the tools as a system block and
    assistant tool_calls as text, in fmt (default hermes). Templates that handle tools get the
    messages unchanged."""
    if template_knows_tools:
        return messages
    fmt = fmt or FORMATS["hermes"]
    out = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            text = fmt.render_calls(m["tool_calls"])
            m = {**m, "content": (m.get("content") or "") + ("\n" if m.get("content") else "")
                 + text}
            m.pop("tool_calls", None)
        out.append(m)
    if functions:
        block = fmt.system_block(functions)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{block}".strip()}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


# --------------------------------------------------------------------------- streaming

class ToolCallStream:
    """Streaming: feed(text_delta) -> content to send now; finish() -> (content, calls) left.
    Text from the first certain start of a call on is held until the end, as is any tail that
    may still become one."""

    def __init__(self, fmt: Optional[ToolFormat] = None):
        self._fmt = fmt or FORMATS["hermes"]
        self._held = ""
        self._in_call = False

    def feed(self, delta: str) -> str:
        if self._in_call:
            self._held += delta
            return ""
        text = self._held + delta
        start, certain = self._fmt.call_start(text)
        if start < 0:
            self._held = ""
            return text
        self._in_call, self._held = certain, text[start:]
        return text[:start]

    def finish(self) -> Tuple[str, List[dict]]:
        if not self._in_call:
            return self._held, []
        content, calls = self._fmt.parse(self._held)
        return content or "", calls
