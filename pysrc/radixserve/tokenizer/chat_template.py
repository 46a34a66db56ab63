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
"""
from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Dict, List, Optional

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment


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
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"templates may not set underscore-prefixed namespace attributes ({name!r})")


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _SafeNamespace
    return env


def _plain(value: Any, where: str) -> Any:
    """A fresh copy of value made only of JSON types; ValueError naming where anything else is."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{where} has a non-string key {k!r}")
            out[str(k)] = _plain(v, f"{where}.{k}")
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if callable(getattr(value, "model_dump", None)):      # pydantic models (e.g. openai types)
        return _plain(value.model_dump(), where)
    raise ValueError(f"{where} must be JSON data (string, number, bool, null, list or object), "
                     f"not {type(value).__name__}")


def normalize_messages(messages: Any) -> List[Dict[str, Any]]:
    """Validate a chat and return a plain copy with None-valued keys dropped (as HF does).

    Requires a non-empty list of objects, each with a string "role"; "content", when present,
    must be a string or a list of content parts (objects). Raises ValueError otherwise.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {\"role\", \"content\"} objects")
    out = []
    for i, message in enumerate(messages):
        message = _plain(message, f"messages[{i}]")
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
    return out


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
               special_tokens: Optional[Dict[str, Any]] = None, **kwargs: Any) -> str:
        """The prompt text for messages, as HF apply_chat_template(tokenize=False) renders it.

        special_tokens (bos_token, eos_token, ...) are visible to the template; kwargs override
        them, as in HF. Raises ValueError for bad messages or a template failure.
        """
        chat = normalize_messages(messages)
        if tools is not None and (not isinstance(tools, list)
                                  or not all(isinstance(t, dict) for t in tools)):
            raise ValueError("tools must be a list of JSON-schema objects")
        context = dict(_plain(special_tokens or {}, "special tokens"))
        context.update(_plain(kwargs, "chat template arguments"))
        try:
            return self._template.render(
                messages=chat, tools=_plain(tools, "tools"), documents=_plain(documents, "documents"),
                add_generation_prompt=bool(add_generation_prompt), **context)
        except jinja2.exceptions.SecurityError as e:
            raise ValueError(f"the chat template tried an unsafe operation: {e}") from e
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"the chat template rejected the messages: {e}") from e
        except (TypeError, KeyError, IndexError, AttributeError, ZeroDivisionError) as e:
            raise ValueError(f"the chat template failed on these messages: "
                             f"{type(e).__name__}: {e}") from e
