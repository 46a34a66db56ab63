"""Tokenizer: text <-> token ids for one model, with its special tokens and chat template.

Two backends behind one interface: HF `tokenizers` (tokenizer.json, preferred) and
`sentencepiece` (tokenizer.model). With tokenizer.json, encode/decode equal HF
AutoTokenizer's: `tokenizer(text)["input_ids"]` and `tokenizer.decode(ids, ...)`.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Sequence, Union

from radixserve.tokenizer.chat_template import ChatTemplate

# special-token keys of tokenizer_config.json, in HF's order
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                 "mask_token")


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_content(value: Any) -> Optional[str]:
    """tokenizer_config.json stores special tokens as strings or as AddedToken dicts."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _as_id_list(value: Any) -> List[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


class _TokenizersBackend:
    """HF tokenizers (tokenizer.json)."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer as HFTokenizer

        self.tok = HFTokenizer.from_file(path)

    def encode(self, text: str, add_special_tokens: bool) -> List[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool,
               spaces_between_special_tokens: bool) -> str:
        # The tokenizers decoder places added tokens itself (as HF's fast tokenizers do);
        # spaces_between_special_tokens only affects the sentencepiece backend.
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> Optional[int]:
        return self.tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)


class _SentencePieceBackend:
    """sentencepiece (tokenizer.model). BOS/EOS are added per tokenizer_config.json
    (add_bos_token, default true; add_eos_token, default false), as Llama-style tokenizers do."""

    def __init__(self, path: str, add_bos: bool, add_eos: bool):
        import sentencepiece

        self.sp = sentencepiece.SentencePieceProcessor(model_file=path)
        self.add_bos, self.add_eos = add_bos, add_eos

    def _special(self, i: int) -> bool:
        return self.sp.is_control(i) or self.sp.is_unknown(i)

    def encode(self, text: str, add_special_tokens: bool) -> List[int]:
        ids = list(self.sp.encode(text))
        if add_special_tokens:
            if self.add_bos and self.sp.bos_id() >= 0:
                ids = [self.sp.bos_id()] + ids
            if self.add_eos and self.sp.eos_id() >= 0:
                ids = ids + [self.sp.eos_id()]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool,
               spaces_between_special_tokens: bool) -> str:
        """Runs of ordinary pieces decode with sentencepiece; special pieces (control, unknown)
        are dropped (skip_special_tokens) or written as their piece text, separated from their
        neighbours by a space when spaces_between_special_tokens."""
        parts: List[str] = []
        run: List[int] = []
        for i in ids:
            if self._special(i):
                if run:
                    parts.append(self.sp.decode(run))
                    run = []
                if not skip_special_tokens:
                    parts.append(self.sp.id_to_piece(i))
            else:
                run.append(i)
        if run:
            parts.append(self.sp.decode(run))
        return (" " if spaces_between_special_tokens else "").join(p for p in parts if p)

    def token_to_id(self, token: str) -> Optional[int]:
        i = self.sp.piece_to_id(token)
        return None if i == self.sp.unk_id() and token != self.sp.id_to_piece(i) else i

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()


class Tokenizer:
    """A model's tokenizer. Build with Tokenizer.from_path(model_dir).

    Attributes: eos_token_ids (generation_config.json, then config.json, then the tokenizer's
    eos_token; duplicates removed), bos_token_id, vocab_size, all_special_ids.
    """

    def __init__(self, backend: Union[_TokenizersBackend, _SentencePieceBackend],
                 special_tokens: Dict[str, Any], eos_token_ids: List[int],
                 bos_token_id: Optional[int], chat_template: Optional[Any]):
        self._backend = backend
        self.special_tokens = special_tokens           # bos_token, eos_token, ... as strings
        self.eos_token_ids = eos_token_ids
        self.bos_token_id = bos_token_id
        self._chat_template_source = chat_template     # str, or {name: str} for named templates
        self._compiled: Dict[str, ChatTemplate] = {}
        ids: List[int] = []
        for key in _SPECIAL_KEYS:
            tid = self._id_of(special_tokens.get(key))
            if tid is not None and tid not in ids:
                ids.append(tid)
        for tok in special_tokens.get("additional_special_tokens", []):
            tid = self._id_of(tok)
            if tid is not None and tid not in ids:
                ids.append(tid)
        self.all_special_ids = ids

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_path(cls, path: str) -> "Tokenizer":
        """Load from a model directory: tokenizer.json (HF tokenizers) or tokenizer.model
        (sentencepiece), plus tokenizer_config.json, chat_template.jinja, generation_config.json
        and config.json when present. Raises ValueError when neither tokenizer file exists."""
        tok_config = _read_json(os.path.join(path, "tokenizer_config.json"))
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            backend = _TokenizersBackend(os.path.join(path, "tokenizer.json"))
        elif os.path.isfile(os.path.join(path, "tokenizer.model")):
            backend = _SentencePieceBackend(os.path.join(path, "tokenizer.model"),
                                            add_bos=tok_config.get("add_bos_token", True),
                                            add_eos=tok_config.get("add_eos_token", False))
        else:
            raise ValueError(f"{path!r} has neither tokenizer.json nor tokenizer.model; pass "
                             f"--tokenizer-path pointing at a directory with one of them")
        special: Dict[str, Any] = {}
        for key in _SPECIAL_KEYS:
            content = _token_content(tok_config.get(key))
            if content is not None:
                special[key] = content
        extra = tok_config.get("additional_special_tokens") or tok_config.get("extra_special_tokens")
        if isinstance(extra, list):
            special["additional_special_tokens"] = [c for c in map(_token_content, extra) if c]
        if isinstance(backend, _SentencePieceBackend):
            sp = backend.sp
            for key, tid in (("bos_token", sp.bos_id()), ("eos_token", sp.eos_id()),
                             ("unk_token", sp.unk_id()), ("pad_token", sp.pad_id())):
                if key not in special and tid >= 0:
                    special[key] = sp.id_to_piece(tid)

        gen_config = _read_json(os.path.join(path, "generation_config.json"))
        model_config = _read_json(os.path.join(path, "config.json"))
        eos: List[int] = []
        candidates = (_as_id_list(gen_config.get("eos_token_id"))
                      + _as_id_list(model_config.get("eos_token_id")))
        eos_from_tok = backend.token_to_id(special["eos_token"]) if "eos_token" in special else None
        if eos_from_tok is not None:
            candidates.append(eos_from_tok)
        for tid in candidates:
            if tid not in eos:
                eos.append(tid)
        bos = backend.token_to_id(special["bos_token"]) if "bos_token" in special else None
        if bos is None:
            bos = model_config.get("bos_token_id")

        chat_template: Optional[Any] = None
        jinja_path = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                chat_template = f.read()
        elif isinstance(tok_config.get("chat_template"), str):
            chat_template = tok_config["chat_template"]
        elif isinstance(tok_config.get("chat_template"), list):
            chat_template = {t["name"]: t["template"] for t in tok_config["chat_template"]}
        return cls(backend, special, eos, bos, chat_template)

    def _id_of(self, token: Optional[str]) -> Optional[int]:
        return None if token is None else self._backend.token_to_id(token)

    def token_to_id(self, token: str) -> Optional[int]:
        """The id of a token of the vocabulary (added tokens included), else None."""
        return self._id_of(token)

    # ------------------------------------------------------------------ text <-> ids

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows (added tokens included)."""
        return self._backend.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        """Token ids of text; equals HF `tokenizer(text, add_special_tokens=...)["input_ids"]`."""
        if not isinstance(text, str):
            raise ValueError(f"text to tokenize must be a string, not {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str:
        """Text of ids; equals HF `tokenizer.decode(ids, skip_special_tokens=...)`."""
        return self._backend.decode(ids, skip_special_tokens, spaces_between_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one token (special tokens included), e.g. for logprob output. A token that
        is only part of a UTF-8 character shows as U+FFFD."""
        return self._backend.decode([token_id], False, False)

    # ------------------------------------------------------------------ chat

    def set_chat_template(self, source: str) -> None:
        """Replace the model's chat template(s) with source (Jinja text; --chat-template).
        Raises ValueError when it does not compile."""
        compiled = ChatTemplate(source)
        self._chat_template_source = source
        self._compiled = {source: compiled}

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template_source is not None

    @property
    def chat_template_text(self) -> Optional[str]:
        """The source of the chat template plain chats use (the "default" one of named
        templates), or None."""
        source = self._chat_template_source
        return source.get("default") if isinstance(source, dict) else source

    @property
    def adds_bos_token(self) -> bool:
        """encode(text) puts a BOS token first (so a rendered template's own BOS text must not
        be sent again as text)."""
        bos = self.special_tokens.get("bos_token")
        bos_id = self._id_of(bos) if isinstance(bos, str) else None
        ids = self.encode("a", add_special_tokens=True)
        return bos_id is not None and bool(ids) and ids[0] == bos_id

    @property
    def template_handles_tools(self) -> bool:
        """The chat template renders `tools` itself (else the server adds a generic block)."""
        source = self._chat_template_source
        if isinstance(source, dict):
            return "tool_use" in source or any("tools" in t for t in source.values())
        return source is not None and "tools" in source

    def _template(self, tools: Optional[list]) -> ChatTemplate:
        source = self._chat_template_source
        if source is None:
            raise ValueError("this model has no chat template; send a plain text prompt "
                             "(/v1/completions or /generate) instead of chat messages")
        if isinstance(source, dict):
            name = "tool_use" if tools is not None and "tool_use" in source else "default"
            if name not in source:
                raise ValueError(f"the model's chat templates {sorted(source)} include no "
                                 f"'default' one")
            source = source[name]
        compiled = self._compiled.get(source)
        if compiled is None:
            compiled = ChatTemplate(source)
            self._compiled[source] = compiled
        return compiled

    def apply_chat_template(self, messages: List[Dict[str, Any]], add_generation_prompt: bool = True,
                            tools: Optional[List[dict]] = None, **kwargs: Any) -> str:
        """Prompt text for messages, equal to HF apply_chat_template(tokenize=False).

        The template sees the special tokens (bos_token, eos_token, ...) and kwargs (which
        override them). Raises ValueError for bad messages, a missing template or a template
        error.
        """
        template = self._template(tools)
        special = {k: v for k, v in self.special_tokens.items()}
        return template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                               special_tokens=special, **kwargs)

    def encode_chat(self, messages: List[Dict[str, Any]], add_generation_prompt: bool = True,
                    tools: Optional[List[dict]] = None, **kwargs: Any) -> List[int]:
        """Token ids of the rendered chat, equal to HF apply_chat_template(tokenize=True): the
        template text tokenized without adding special tokens (the template has them)."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools, **kwargs)
        return self.encode(text, add_special_tokens=False)
