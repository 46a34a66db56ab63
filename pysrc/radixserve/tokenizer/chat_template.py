"""Chat templates: HF-compatible jinja2 rendering inside an immutable sandbox.

A chat template comes with the model and is untrusted code. It runs in jinja2's
ImmutableSandboxedEnvironment (no attribute access to Python internals, no mutation of lists
or dicts passed in) with the globals and filters HF transformers gives templates, so the text we
render is the text HF's apply_chat_template renders:
  * trim_blocks and lstrip_blocks on; the loopcontrols extension ({% break %}, {% continue %});
  * the {% generation %}...{% endgeneration %} tag (renders its body; HF uses it for masks);
  * raise_exception(msg), strftime_now(fmt), a `tojson` filter that does not HTML-escape and
    takes ensure_ascii/indent/separators/sort_keys, `dict(...)`, and a `namespace` that refuses
    underscore-prefixed names.
Every failure a client can cause (bad message shapes, a template raising, sandbox violations)
becomes ValueError with a message saying what went wrong.

Rendering is bounded (RenderLimits): a render that runs past `max_seconds` or produces more than
`max_chars` characters stops with RenderLimitExceeded (a ValueError). The template cannot run
long without passing a check point: every call (functions, filters called as functions, macros),
every step through `range(...)` and through the lists handed to it (messages, tools, ...), every
piece of output, and the `*` / `**` operators (which also refuse results beyond max_chars).
The server renders on a worker thread and also stops waiting at max_seconds, so even a single
long C-level operation cannot hold a request past its limit.
"""
from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Dict, Iterator, List, Optional

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

MAX_RENDER_SECONDS = 10.0
MAX_RENDERED_CHARS = 1 << 22        # far beyond any context length; a namespace value has the same cap
_GUARD = "__radixserve_render_guard"  # the render context's entry holding its _Guard
_CHECK_EVERY = 256                  # iteration steps between deadline checks


@dataclass(frozen=True)
class RenderLimits:
    """How long one render may run and how much text it may produce."""
    max_seconds: float = MAX_RENDER_SECONDS
    max_chars: int = MAX_RENDERED_CHARS


class RenderLimitExceeded(ValueError):
    """A render ran past its RenderLimits (its message says which and what to change)."""


class _Guard:
    """One render's deadline and output budget. check() raises once the deadline passed."""

    def __init__(self, limits: RenderLimits):
        self.limits = limits
        self._deadline = time.monotonic() + limits.max_seconds
        self._chars = 0

    def check(self) -> None:
        if time.monotonic() > self._deadline:
            raise RenderLimitExceeded(
                f"the chat template took longer than {self.limits.max_seconds:g} s to render; "
                "send fewer or shorter messages")

    def check_size(self, num_chars: int) -> None:
        if num_chars > self.limits.max_chars:
            raise RenderLimitExceeded(
                f"the chat template rendered more than {self.limits.max_chars} characters; send "
                "fewer or shorter messages")

    def emit(self, chunk: str) -> None:
        self._chars += len(chunk)
        self.check_size(self._chars)
        self.check()


def _guarded(items, guard: Optional["_Guard"]) -> Iterator[Any]:
    for i, item in enumerate(items):
        if guard is not None and i % _CHECK_EVERY == 0:
            guard.check()
        yield item


class _GuardedList(list):
    """A list handed to a template: iterating it passes the render's deadline check."""

    def __init__(self, items, guard: Optional[_Guard]):
        super().__init__(items)
        self._guard = guard

    def __iter__(self):
        return _guarded(super().__iter__(), self._guard)


class _GuardedRange(Sequence):
    """range(...) for templates: jinja's sandboxed range (at most MAX_RANGE items) whose
    iteration passes the render's deadline check."""

    def __init__(self, rng: range, guard: Optional[_Guard]):
        self._range = rng
        self._guard = guard

    def __len__(self) -> int:
        return len(self._range)

    def __getitem__(self, index):
        item = self._range[index]
        return _GuardedRange(item, self._guard) if isinstance(item, range) else item

    def __iter__(self):
        return _guarded(self._range, self._guard)

    def __repr__(self) -> str:
        return repr(self._range)


@jinja2.pass_context
def _range(context, *args) -> _GuardedRange:
    return _GuardedRange(safe_range(*args), context.get(_GUARD))


class _GenerationTag(jinja2.ext.Extension):
    """{% generation %}body{% endgeneration %} renders body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Optional[int] = None,
            separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` for templates: builds plain dicts, exposes nothing else of the type."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _SafeNamespace(jinja2.utils.Namespace):
    """jinja's namespace(), refusing underscore-prefixed attribute names."""

    def __init__(*args, **kwargs):  # noqa: N805 (jinja's own signature trick: self in args)
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _SafeNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _SafeNamespace._check(name)
        if isinstance(value, (str, list)) and len(value) > MAX_RENDERED_CHARS:
            raise RenderLimitExceeded(f"the chat template built a value of more than "
                                      f"{MAX_RENDERED_CHARS} items; send fewer or shorter messages")
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"templates may not set underscore-prefixed namespace attributes ({name!r})")


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox plus the render guard's check points (module docstring)."""

    intercepted_binops = frozenset({"*", "**"})

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
        guard = __context.get(_GUARD)
        if guard is not None:
            guard.check()
        return super().call(__context, __obj, *args, **kwargs)

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        guard = context.get(_GUARD)
        limit = guard.limits.max_chars if guard is not None else MAX_RENDERED_CHARS
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(count, int) \
                        and len(seq) * count > limit:
                    raise RenderLimitExceeded(f"the chat template tried to build a value of "
                                              f"{len(seq) * count} items (more than {limit})")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) \
                and abs(left) > 1 and right > 0 and right * abs(left).bit_length() > 8 * limit:
            raise RenderLimitExceeded(f"the chat template tried to compute a number of more "
                                      f"than {8 * limit} bits")
        return super().call_binop(context, operator, left, right)


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True,
                              extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _SafeNamespace
    env.globals["range"] = _range
    return env


def _plain(value: Any, where: str, guard: Optional[_Guard] = None) -> Any:
    """A fresh copy of value made only of JSON types (lists iterate under `guard`); ValueError
    naming where anything else is."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{where} has a non-string key {k!r}")
            out[str(k)] = _plain(v, f"{where}.{k}", guard)
        return out
    if isinstance(value, (list, tuple)):
        items = [_plain(v, f"{where}[{i}]", guard) for i, v in enumerate(value)]
        return _GuardedList(items, guard) if guard is not None else items
    if callable(getattr(value, "model_dump", None)):      # pydantic models (e.g. openai types)
        return _plain(value.model_dump(), where, guard)
    raise ValueError(f"{where} must be JSON data (string, number, bool, null, list or object), "
                     f"not {type(value).__name__}")


def normalize_messages(messages: Any, guard: Optional[_Guard] = None) -> List[Dict[str, Any]]:
    """Validate a chat and return a plain copy with None-valued keys dropped (as HF does).

    Requires a non-empty list of objects, each with a string "role"; "content", when present,
    must be a string or a list of content parts (objects). Raises ValueError otherwise.
    With `guard`, the copy's lists iterate under its deadline.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {\"role\", \"content\"} objects")
    out = []
    for i, message in enumerate(messages):
        message = _plain(message, f"messages[{i}]", guard)
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be an object with \"role\" and \"content\"")
        message = {k: v for k, v in message.items() if v is not None}
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}].role must be a non-empty string")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ValueError(f"messages[{i}].content must be a string or a list of content parts")
        if isinstance(content, list) and not all(isinstance(p, dict) for p in content):
            raise ValueError(f"messages[{i}].content parts must be objects")
        out.append(message)
    return _GuardedList(out, guard) if guard is not None else out


class ChatTemplate:
    """One compiled chat template. Rendering is safe to call concurrently (no shared state)."""

    def __init__(self, source: str):
        if not isinstance(source, str) or not source:
            raise ValueError("a chat template must be a non-empty string")
        self.source = source
        try:
            self._template = _make_environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ValueError(f"the chat template does not compile: {e} (line {e.lineno})") from e

    def render(self, messages: Any, add_generation_prompt: bool = True,
               tools: Optional[List[dict]] = None, documents: Optional[List[dict]] = None,
               special_tokens: Optional[Dict[str, Any]] = None,
               render_limits: Optional[RenderLimits] = None, **kwargs: Any) -> str:
        """The prompt text for messages, as HF apply_chat_template(tokenize=False) renders it.

        special_tokens (bos_token, eos_token, ...) are visible to the template; kwargs override
        them, as in HF. `render_limits` (default RenderLimits()) bounds the render's time and
        output (RenderLimitExceeded). Raises ValueError for bad messages or a template failure.
        """
        guard = _Guard(render_limits or RenderLimits())
        chat = normalize_messages(messages, guard)
        if tools is not None and (not isinstance(tools, list)
                                  or not all(isinstance(t, dict) for t in tools)):
            raise ValueError("tools must be a list of JSON-schema objects")
        context = dict(_plain(special_tokens or {}, "special tokens"))
        context.update(_plain(kwargs, "chat template arguments", guard))
        context[_GUARD] = guard
        pieces: List[str] = []
        try:
            for chunk in self._template.generate(
                    messages=chat, tools=_plain(tools, "tools", guard),
                    documents=_plain(documents, "documents", guard),
                    add_generation_prompt=bool(add_generation_prompt), **context):
                guard.emit(chunk)
                pieces.append(chunk)
        except jinja2.exceptions.SecurityError as e:
            raise ValueError(f"the chat template tried an unsafe operation: {e}") from e
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"the chat template rejected the messages: {e}") from e
        except RecursionError as e:
            raise ValueError("the chat template recursed too deeply on these messages") from e
        except (TypeError, KeyError, IndexError, AttributeError, ZeroDivisionError,
                OverflowError) as e:
            raise ValueError(f"the chat template failed on these messages: "
                             f"{type(e).__name__}: {e}") from e
        return "".join(pieces)
