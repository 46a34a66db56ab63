"""Role formats: the text a program's `system(...)` / `user(...)` / `assistant(...)` blocks
become, rendered with the served model's chat template.

A program builds its prompt as plain text, one piece at a time, so a chat template (which
renders a whole message list at once) is turned into two strings per role block:

    prefix, suffix = fmt.prefix_and_suffix(role, history)
    # text += prefix; ...the block's content...; text += suffix

`TemplateRoles` gets them from a jinja chat template by rendering the history with one more
message whose content is a sentinel, and cutting that text around the sentinel; whatever the
template adds on its own (a default system prompt, a BOS text) lands in the first prefix, so the
program's text is what the template renders for the same messages. `FixedRoles` holds the
strings of a few well-known formats, for a server that does not send its template (SGLang's
/get_model_info) and for tests.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

ROLES = ("system", "user", "assistant")
_SENTINEL = "\u2063radixserve-role-content\u2063"


class RoleFormat:
    """prefix_and_suffix(role, history): the text before and after a `role` block whose earlier
    messages are `history` ([{"role", "content"}], in OpenAI's format). Raises ValueError for a
    role or an order the format cannot render."""

    name = "custom"

    def prefix_and_suffix(self, role: str, history: List[Dict[str, str]]) -> Tuple[str, str]:
        raise NotImplementedError


class TemplateRoles(RoleFormat):
    """Role strings cut out of a jinja chat template (radixserve.tokenizer.ChatTemplate, the
    same sandbox the server renders with). `strip_bos`: the BOS text the template writes first
    is dropped, because the server's tokenizer adds BOS to a text prompt itself."""

    def __init__(self, source: str, special_tokens: Optional[Dict[str, str]] = None,
                 strip_bos: bool = False, name: str = "custom"):
        from radixserve.tokenizer.chat_template import ChatTemplate
        self.template = ChatTemplate(source)
        self.special_tokens = dict(special_tokens or {})
        self.name = name
        bos = self.special_tokens.get("bos_token")
        self._strip = bos if strip_bos and bos else None

    def _render(self, messages: List[Dict[str, str]]) -> str:
        if not messages:
            return ""
        text = self.template.render(messages, add_generation_prompt=False,
                                    special_tokens=self.special_tokens)
        if self._strip and text.startswith(self._strip):
            text = text[len(self._strip):]
        return text

    def prefix_and_suffix(self, role: str, history: List[Dict[str, str]]) -> Tuple[str, str]:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; use one of {', '.join(ROLES)}")
        before = self._render(history)
        try:
            full = self._render(list(history) + [{"role": role, "content": _SENTINEL}])
        except ValueError as e:
            raise ValueError(f"the chat template cannot render a {role} message after "
                             f"{[m['role'] for m in history]}: {e}") from None
        cut = full.find(_SENTINEL)
        if cut < 0 or not full.startswith(before):
            raise ValueError(f"the chat template does not render a {role} message as "
                             "history + prefix + content + suffix; set the role text with "
                             "RuntimeEndpoint(..., chat_template_name=...)")
        return full[len(before):cut], full[cut + len(_SENTINEL):]


class FixedRoles(RoleFormat):
    """A format given as strings: role_prefix[role] + content + role_suffix[role], with
    `default_system` inserted as a system block before a first message of another role."""

    def __init__(self, name: str, role_prefix: Dict[str, str], role_suffix: Dict[str, str],
                 default_system: Optional[str] = None):
        self.name = name
        self.role_prefix = dict(role_prefix)
        self.role_suffix = dict(role_suffix)
        self.default_system = default_system

    def prefix_and_suffix(self, role: str, history: List[Dict[str, str]]) -> Tuple[str, str]:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; use one of {', '.join(ROLES)}")
        prefix = self.role_prefix[role]
        if not history and role != "system" and self.default_system:
            prefix = (self.role_prefix["system"] + self.default_system
                      + self.role_suffix["system"] + prefix)
        return prefix, self.role_suffix[role]


def _chatml(default_system: Optional[str] = None) -> FixedRoles:
    return FixedRoles("chatml", {r: f"<|im_start|>{r}\n" for r in ROLES},
                      {r: "<|im_end|>\n" for r in ROLES}, default_system)


FIXED_FORMATS: Dict[str, FixedRoles] = {
    "chatml": _chatml(),
    "llama-3-instruct": FixedRoles(
        "llama-3-instruct",
        {r: f"<|start_header_id|>{r}<|end_header_id|>\n\n" for r in ROLES},
        {r: "<|eot_id|>" for r in ROLES}),
    "default": FixedRoles("default", {"system": "SYSTEM:", "user": "\nUSER:",
                                      "assistant": "\nASSISTANT:"},
                          {r: "" for r in ROLES}),
}
# model-path fragments (lower case) -> format, for servers that do not send their template
_BY_MODEL_PATH = (("smollm", "chatml"), ("qwen", "chatml"), ("llama-3", "llama-3-instruct"),
                  ("llama3", "llama-3-instruct"))


def template_name(source: Optional[str]) -> Optional[str]:
    """A short name for a chat template's family, from its text: "chatml",
    "llama-3-instruct", "custom", or None for no template."""
    if source is None:
        return None
    if "<|im_start|>" in source:
        return "chatml"
    if "<|start_header_id|>" in source:
        return "llama-3-instruct"
    return "custom"


def role_format_for(model_info: dict, chat_template_name: Optional[str] = None) -> RoleFormat:
    """The RoleFormat for a server, from its /get_model_info: an explicit chat_template_name
    (one of FIXED_FORMATS) first, then the jinja template the server sends (radixserve does),
    then a guess from the model path (SGLang's way), else the plain "default" format."""
    if chat_template_name is not None:
        if chat_template_name not in FIXED_FORMATS:
            raise ValueError(f"unknown chat_template_name {chat_template_name!r}; use one of "
                             f"{sorted(FIXED_FORMATS)}")
        return FIXED_FORMATS[chat_template_name]
    source = model_info.get("chat_template")
    if isinstance(source, str):
        return TemplateRoles(source, model_info.get("special_tokens"),
                             strip_bos=bool(model_info.get("adds_bos_token")),
                             name=model_info.get("chat_template_name") or "custom")
    path = str(model_info.get("model_path") or "").lower()
    for fragment, name in _BY_MODEL_PATH:
        if fragment in path:
            return FIXED_FORMATS[name]
    return FIXED_FORMATS["default"]
