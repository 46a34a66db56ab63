"""ToolFormat: one wire format of tool calls (--tool-call-parser), and what every format shares.

A format knows how calls are written (call_text, render_calls, system_block), constrained
(tag, grammar: an xgrammar structural tag) and read (find_start and block, driven by
stream.CallStream; parse is one feed of the whole text). Per tool_choice the grammar is:
  auto      triggered tags: free text until the format's trigger opens a call, whose arguments
            then follow the function's schema; parallel=False ends the output after one call
  required  exactly one call, to any of the functions (an "or" of their tags)
  <name>    exactly one call to that function
bind(functions, tokenizer) gives the per-request copy: the functions' parameter schemas (a
format that writes untyped values converts them by these) and whether the tokenizer would drop
one of the format's markers as a special token (the request must then keep special tokens).
"""
from __future__ import annotations

import copy
import json
import uuid
from abc import ABC, abstractmethod
from typing import Any, Dict, List, Optional, Pattern, Sequence, Tuple

from radixserve.parsers.tool_formats.stream import Block, CallStream, Sink, SkipBlock


def chosen_functions(functions: List[dict], choice: Any) -> List[dict]:
    """The functions a tool_choice allows: none for "none", all for auto / required, else the
    named one."""
    if choice == "none":
        return []
    return functions if choice in ("auto", "required") else \
        [f for f in functions if f["name"] == choice]


def call_args(call: dict) -> Tuple[Any, Any]:
    """(name, arguments) of an OpenAI tool_calls entry: the arguments decoded from their JSON
    text, or that text itself when it does not parse."""
    fn = call.get("function") or {}
    args = fn.get("arguments")
    try:
        args = json.loads(args) if isinstance(args, str) else (args or {})
    except (ValueError, RecursionError):             # kept as the text the client sent
        pass
    return fn.get("name"), args


def structural_tag(fmt: dict) -> str:
    return json.dumps({"type": "structural_tag", "format": fmt})


def tail_prefix(text: str, pos: int, token: str) -> int:
    """Index of the longest tail of text[pos:] that is a proper prefix of token, or -1."""
    for n in range(min(len(token) - 1, len(text) - pos), 0, -1):
        if text.endswith(token[:n]):
            return len(text) - n
    return -1


class ToolFormat(ABC):
    """One wire format; see the module docstring. Subclasses set:
      trigger   what opens every call (a prefix of each tag's begin), for the auto grammar
      joiner    between calls rendered back (render_calls)
      openers   literal call openers, and/or opener_re (a call opener) with opener_tail_re
                (a tail of the text that may still grow into one, anchored at the end)
      ignored   tokens dropped from the content wherever they appear
      markers   tokens that must survive detokenization for calls to be read
    """
    trigger = ""
    joiner = "\n"
    openers: Tuple[str, ...] = ()
    opener_re: Optional[Pattern] = None
    opener_tail_re: Optional[Pattern] = None
    ignored: Tuple[str, ...] = ()
    markers: Tuple[str, ...] = ()

    def __init__(self) -> None:
        self.functions: Dict[str, dict] = {}      # name -> parameters schema (bind)
        self.keep_special_tokens = False          # bind: a marker is a skipped special token

    # ---------------------------------------------------------------- per format
    @abstractmethod
    def call_text(self, name: str, args: Any) -> str:
        """One call as the model writes it."""

    @abstractmethod
    def tag(self, fn: dict) -> dict:
        """The structural tag of one call to fn (its arguments constrained by its schema)."""

    @abstractmethod
    def call_block(self, text: str, start: int, sink: Sink) -> Block:
        """The reader of the call block that begins at text[start] (a certain opener)."""

    def example_text(self) -> str:
        """The call shown to the model by system_block (placeholders for name and arguments)."""
        return self.call_text("<function name>", "<arguments object>") \
            .replace('"<function name>"', "<function name>") \
            .replace('"<arguments object>"', "<arguments object>")

    # ---------------------------------------------------------------- binding
    def bind(self, functions: Sequence[dict], tokenizer: Any = None) -> "ToolFormat":
        """A copy for one request: functions (check_tools' {name, parameters}) and, when a
        tokenizer is given, whether it would drop a marker as a skipped special token."""
        fmt = copy.copy(self)
        fmt.functions = {f["name"]: f.get("parameters") or {} for f in functions}
        fmt.keep_special_tokens = tokenizer is not None and any(
            _skipped_special(tokenizer, m) for m in self.markers)
        return fmt

    def new_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    # ---------------------------------------------------------------- reading
    def find_start(self, text: str, pos: int) -> Tuple[int, bool]:
        """(index, True) of the first certain start at or after pos (a call opener or an
        ignored token); else (index, False) of the first tail that may still become one; else
        (-1, False)."""
        starts = [i for i in (text.find(t, pos) for t in self.openers + self.ignored) if i >= 0]
        if self.opener_re is not None:
            m = self.opener_re.search(text, pos)
            if m is not None:
                starts.append(m.start())
        if starts:
            return min(starts), True
        tails = [i for i in (tail_prefix(text, pos, t) for t in self.openers + self.ignored)
                 if i >= 0]
        if self.opener_tail_re is not None:
            m = self.opener_tail_re.search(text, pos)
            if m is not None:
                tails.append(m.start())
        return (min(tails), False) if tails else (-1, False)

    def block(self, text: str, start: int, sink: Sink) -> Block:
        for token in self.ignored:
            if text.startswith(token, start):
                return SkipBlock(sink, start, len(token))
        return self.call_block(text, start, sink)

    def parse(self, text: str) -> Tuple[Optional[str], List[dict]]:
        """(content or None, tool_calls) of a whole output: every complete call becomes a call
        (an id, its name, its arguments as JSON text); the text outside them, stripped, is the
        content. A call that breaks is content, as written."""
        stream = CallStream(self)
        content = stream.feed(text)
        rest, calls = stream.finish()
        return ((content + rest).strip() or None), calls

    # ---------------------------------------------------------------- writing
    def grammar(self, functions: List[dict], choice: Any, parallel: bool = True) -> Optional[str]:
        """The structural tag (JSON text) that constrains the output, or None (tool_choice
        none). parallel=False (parallel_tool_calls: false): under auto the output ends after
        its first call (required and named choices always make exactly one)."""
        chosen = chosen_functions(functions, choice)
        if not chosen:
            return None
        tags = [self.tag(f) for f in chosen]
        if choice == "auto":
            fmt = {"type": "triggered_tags", "triggers": self.triggers(chosen), "tags": tags,
                   "at_least_one": False, "stop_after_first": not parallel}
        else:
            fmt = tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}
        return structural_tag(fmt)

    def triggers(self, chosen: List[dict]) -> List[str]:
        return [self.trigger]

    def system_block(self, functions: List[dict]) -> str:
        lines = ["You can call these functions. To call one, reply with exactly",
                 self.example_text(), "Functions (JSON):"]
        lines += [json.dumps({"name": f["name"], "description": f["description"],
                              "parameters": f["parameters"]}) for f in functions]
        return "\n".join(lines)

    def render_calls(self, calls: List[dict]) -> str:
        """An assistant message's tool_calls in this format (templates without tool support)."""
        return self.joiner.join(self.call_text(*call_args(c)) for c in calls)


def _skipped_special(tokenizer: Any, token: str) -> bool:
    """Whether token is one token of tokenizer that decoding with skip_special_tokens drops."""
    to_id = getattr(tokenizer, "token_to_id", None)
    tid = to_id(token) if to_id is not None else None
    if tid is None:
        return False
    try:
        return tokenizer.decode([tid], skip_special_tokens=True) == ""
    except (TypeError, ValueError):
        return False
