"""Tool calls for /v1/chat/completions: tools in the prompt, a grammar for the calls, parsing.

The wire format the model writes is chosen by --tool-call-parser (FORMATS; one module each
under tool_formats/):
  hermes (qwen25)       `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks,
                        anywhere in the output (Hermes, Qwen2.5 / Qwen3, SmolLM)
  llama3 (llama3_json)  bare `{"name": ..., "parameters": {...}}` objects, several joined by
                        "; " (Llama 3.1 / 3.2 / 3.3 with JSON tool calling)
  qwen3_coder           `<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>...
                        </function>\\n</tool_call>`, values typed by the tool's schema
                        (Qwen3-Coder, Qwen3.5)
  mistral               `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` and
                        `[TOOL_CALLS]NAME[ARGS]{...}` (Mistral tokenizers before / from v11);
                        call ids of 9 letters and digits
  pythonic              `[name(key=literal, ...), ...]` (Llama 3.2 / Llama 4), read with ast
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
streaming (content as soon as it cannot be a call, then each call's name and its arguments as
JSON deltas), with the same result however the text is split. ToolFormat.bind(functions,
tokenizer) is the per-request copy (schemas for qwen3_coder's values, Mistral's form, whether
the request must keep special tokens).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from radixserve.errors import bad_request
from radixserve.parsers.tool_formats.base import ToolFormat
from radixserve.parsers.tool_formats.hermes import BEGIN, END, HermesFormat
from radixserve.parsers.tool_formats.llama3 import PYTHON_TAG, Llama3Format
from radixserve.parsers.tool_formats.mistral import MistralFormat
from radixserve.parsers.tool_formats.pythonic import PythonicFormat
from radixserve.parsers.tool_formats.qwen3_coder import Qwen3CoderFormat
from radixserve.parsers.tool_formats.stream import CallStream

__all__ = ["BEGIN", "END", "FORMATS", "MAX_TOOLS", "PYTHON_TAG", "HermesFormat", "Llama3Format",
           "MistralFormat", "PythonicFormat", "Qwen3CoderFormat", "ToolCallStream", "ToolFormat",
           "check_tools", "get_format", "messages_for_template", "parse_tool_calls",
           "tool_grammar"]

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

FORMATS: Dict[str, ToolFormat] = {
    "hermes": HermesFormat(), "qwen25": HermesFormat(),
    "llama3": Llama3Format(), "llama3_json": Llama3Format(),
    "qwen3_coder": Qwen3CoderFormat(), "mistral": MistralFormat(), "pythonic": PythonicFormat()}


def get_format(name: Optional[str]) -> ToolFormat:
    """The format of --tool-call-parser `name` (None: hermes). ValueError naming the known
    formats for another name."""
    fmt = FORMATS.get(name or "hermes")
    if fmt is None:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(FORMATS)}")
    return fmt


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

class ToolCallStream(CallStream):
    """Streaming (stream.CallStream, in fmt, default hermes): feed(text_delta) -> content to
    send now; take_deltas() -> the calls' deltas so far (name first, then argument text);
    finish() -> (content left, every call). Text that may still become a call is held."""

    def __init__(self, fmt: Optional[ToolFormat] = None):
        super().__init__(fmt or FORMATS["hermes"])
