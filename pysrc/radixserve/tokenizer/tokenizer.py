"""Tokenizer: text <-> token ids for one model, with its special tokens and chat template.

Two backends behind one interface: HF `tokenizers` (tokenizer.json, preferred) and
`sentencepiece` (tokenizer.model). With tokenizer.json, encode/decode equal HF
AutoTokenizer's: `tokenizer(text)["input_ids"]` and `tokenizer.decode(ids, ...)`.

Encoding a long text never holds the GIL while it tokenizes (texts of GIL_FREE_CHARS characters
or more go through the tokenizers library's batch encoder, which releases it; sentencepiece
releases it for every encode), so a worker thread encoding a huge prompt leaves the event loop
running. `max_chars_per_token` bounds how many characters of text one token can stand for, so
a prompt that cannot fit a context can be refused before it is encoded.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Tuple, Union

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


GIL_FREE_CHARS = 4096     # texts this long or longer are encoded with the GIL released

# What a tokenizers normalizer may do to the length of a text: None when it can delete
# characters (so one token may stand for any number of them), else the most characters of
# input that can become one character of its output (NFC / NFKC compose at most 4 code points,
# the longest canonical decomposition, into one; the others never shrink a text).
_NORMALIZER_SHRINK = {"NFD": 1, "NFKD": 1, "Lowercase": 1, "Prepend": 1, "ByteLevel": 1,
                      "NFC": 4, "NFKC": 4}
# Pre-tokenizers that keep every character (Whitespace, WhitespaceSplit, BertPreTokenizer and
# CharDelimiterSplit drop the characters they split on; Split and Punctuation may, by behavior).
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split",
                           "Punctuation"}


class TooManyTokens(ValueError):
    """A text has more tokens than the caller allowed (Tokenizer.encode's max_tokens)."""

    def __init__(self, count: int, limit: int):
        super().__init__(f"the text is {count} tokens long; at most {limit} allowed")
        self.count = count
        self.limit = limit


def _normalizer_shrink(spec: Optional[dict]) -> Optional[int]:
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1
        for part in spec.get("normalizers") or []:
            f = _normalizer_shrink(part)
            if f is None:
                return None
            factor *= f
        return factor
    if kind == "Replace":       # a fixed string replaced by one at least as long keeps the length
        pattern, content = (spec.get("pattern") or {}).get("String"), spec.get("content")
        ok = isinstance(pattern, str) and isinstance(content, str) and len(content) >= len(pattern)
        return 1 if ok else None
    return _NORMALIZER_SHRINK.get(kind)


def _keeps_characters(spec: Optional[dict]) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_keeps_characters(p) for p in spec.get("pretokenizers") or [])
    return kind in _KEEPING_PRE_TOKENIZERS and spec.get("behavior") != "Removed"


def _byte_level(spec: dict) -> bool:
    """The text reaches the model as byte symbols (a ByteLevel normalizer or pre-tokenizer)."""
    def has(part: Optional[dict], key: str) -> bool:
        if not part:
            return False
        if part.get("type") == "Sequence":
            return any(has(p, key) for p in part.get(key) or [])
        return part.get("type") == "ByteLevel"
    return has(spec.get("normalizer"), "normalizers") or has(spec.get("pre_tokenizer"), "pretokenizers")


def _silent_bytes(vocab: Sequence[str]) -> Optional[FrozenSet[str]]:
    """For a byte-level BPE, which drops a byte whose symbol is not in its vocabulary: the
    characters that vanish whole (ASCII ones whose byte is missing), or None when some
    multi-byte characters may vanish too (both a lead byte and a continuation byte are
    missing). A multi-byte character keeps a token while its lead bytes or its continuation
    bytes are all there; bytes that never occur in UTF-8 (0xC0, 0xC1, 0xF5-0xFF) do not
    matter."""
    symbols = set(vocab)
    missing = [b for symbol, b in _utf8_byte_symbols().items() if symbol not in symbols]
    if any(0x80 <= b <= 0xBF for b in missing) and any(b >= 0xC2 for b in missing):
        return None
    return frozenset(chr(b) for b in missing if b < 0x80)


def _utf8_byte_symbols() -> Dict[str, int]:
    """ByteLevel's symbol of every byte that occurs in UTF-8 text -> that byte, read from the
    library's own pre-tokenizer: ASCII, every continuation byte, and every lead byte."""
    from tokenizers.pre_tokenizers import ByteLevel
    pre = ByteLevel(add_prefix_space=False, use_regex=False)
    texts = [chr(c) for c in range(0x80)] + [chr(0x80 + i) for i in range(64)]   # C2 80..C2 BF
    texts += [bytes([lead, 0x80]).decode() for lead in range(0xC2, 0xE0)]
    texts += [bytes([lead, 0xA0 if lead == 0xE0 else 0x80, 0x80]).decode() for lead in range(0xE0, 0xF0)]
    texts += [bytes([lead, 0x90 if lead == 0xF0 else 0x80, 0x80, 0x80]).decode()
              for lead in range(0xF0, 0xF5)]
    table: Dict[str, int] = {}
    for text in texts:
        piece = "".join(p for p, _ in pre.pre_tokenize_str(text))
        raw = text.encode("utf-8")
        assert len(piece) == len(raw), "ByteLevel maps one byte to one symbol"
        table.update(zip(piece, raw))
    return table


def tokenizers_chars_bound(spec: dict, vocab: Sequence[str]) -> Optional[Tuple[int, FrozenSet[str]]]:
    """(the most characters of input one token of a tokenizer.json can stand for, the
    characters that give no token at all), or None when no bound holds. `spec` is the parsed
    tokenizer.json, `vocab` every token's string (added tokens included). A text with more
    than k x bound characters that are not silent has more than k tokens.

    A token's string in the vocabulary is the piece of normalized, pre-tokenized text it
    covers, written one character per character (Metaspace's U+2581 stands for one space) or
    per byte (ByteLevel: at least as many as the characters it touches); byte-fallback and
    continuing-subword markers only lengthen it. So the longest string bounds the normalized
    text per token, and the normalizer's shrink factor (_normalizer_shrink) turns that into
    input text. No bound holds when characters can vanish: a normalizer or pre-tokenizer that
    deletes them, an added token that strips the whitespace around it (lstrip / rstrip), a
    character the model drops (BPE without an unknown token or byte fallback, unless it is a
    byte-level BPE that lacks only single-byte symbols: those characters are the silent ones)
    or an unknown token that swallows a run of text (WordPiece, WordLevel, Unigram
    without byte fallback, BPE fusing unknowns)."""
    silent: FrozenSet[str] = frozenset()
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if shrink is None or not _keeps_characters(spec.get("pre_tokenizer")):
        return None
    if any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or []):
        return None
    model = spec.get("model") or {}
    kind = model.get("type", "BPE" if "merges" in model else None)
    if kind == "BPE":
        # a character outside the vocabulary becomes its bytes (byte fallback; or it was bytes
        # already: ByteLevel, with all 256 byte symbols in the vocabulary) or one unknown token
        # of its own; anything else drops it (no unk_token) or fuses a run of them (fuse_unk)
        unknown_ok = model.get("byte_fallback") or (
            model.get("unk_token") is not None and not model.get("fuse_unk"))
        if not unknown_ok:
            if not _byte_level(spec):
                return None
            silent = _silent_bytes(vocab)
            if silent is None:
                return None
    elif kind != "Unigram" or not model.get("byte_fallback"):
        return None
    longest = max((len(t) for t in vocab), default=0)
    return max(1, longest) * shrink, silent


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
        # encode_batch releases the GIL (encode does not); the fast one skips the offsets
        self._batch = getattr(self.tok, "encode_batch_fast", None) or self.tok.encode_batch
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
        bound = tokenizers_chars_bound(spec, list(self.tok.get_vocab(with_added_tokens=True)))
        self.max_chars_per_token, self.silent_chars = bound if bound else (None, frozenset())
        self._decoder_spec = spec.get("decoder")
        self._pieces: Any = False              # byte_level_pieces(): False until built

    def byte_level_pieces(self):
        """tokenizer/byte_level.ByteLevelPieces of a ByteLevel decoder (None for others);
        built and checked on the first call."""
        if self._pieces is False:
            from radixserve.tokenizer.byte_level import byte_level_pieces

            self._pieces = byte_level_pieces(self.tok, self._decoder_spec)
        return self._pieces

    def encode(self, text: str, add_special_tokens: bool,
               max_tokens: Optional[int] = None) -> List[int]:
        if len(text) < GIL_FREE_CHARS:
            enc = self.tok.encode(text, add_special_tokens=add_special_tokens)
        else:
            enc = self._batch([text], add_special_tokens=add_special_tokens)[0]
        if max_tokens is not None and len(enc) > max_tokens:
            raise TooManyTokens(len(enc), max_tokens)    # before building the list of ids
        return enc.ids

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

    # No bound on the characters per token is claimed: the model's normalizer (nmt_nfkc by
    # default) drops control characters and collapses runs of whitespace.
    max_chars_per_token: Optional[int] = None
    silent_chars: FrozenSet[str] = frozenset()

    def byte_level_pieces(self):
        """No byte table: sentencepiece decodes through its own normalizer."""
        return None

    def __init__(self, path: str, add_bos: bool, add_eos: bool):
        import sentencepiece

        self.sp = sentencepiece.SentencePieceProcessor(model_file=path)
        self.add_bos, self.add_eos = add_bos, add_eos

    def _special(self, i: int) -> bool:
        return self.sp.is_control(i) or self.sp.is_unknown(i)

    def encode(self, text: str, add_special_tokens: bool,
               max_tokens: Optional[int] = None) -> List[int]:
        ids = list(self.sp.encode(text))          # sentencepiece releases the GIL meanwhile
        if add_special_tokens:
            if self.add_bos and self.sp.bos_id() >= 0:
                ids = [self.sp.bos_id()] + ids
            if self.add_eos and self.sp.eos_id() >= 0:
                ids = ids + [self.sp.eos_id()]
        if max_tokens is not None and len(ids) > max_tokens:
            raise TooManyTokens(len(ids), max_tokens)
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
    eos_token; duplicates removed), bos_token_id, vocab_size, all_special_ids,
    max_chars_per_token and silent_chars (an upper bound on the characters of text one token
    stands for, from the vocabulary, or None when the tokenizer admits no bound; and the
    characters that give no token, all ASCII: tokenizers_chars_bound. A text of more than
    k x max_chars_per_token characters other than silent ones has more than k tokens).
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
        self.max_chars_per_token: Optional[int] = backend.max_chars_per_token
        self.silent_chars: FrozenSet[str] = backend.silent_chars

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_path(cls, path: str) -> "Tokenizer":
        """Load from a model directory: tokenizer.json (HF tokenizers) or tokenizer.model
        (sentencepiece), plus tokenizer_config.json, chat_template.jinja, generation_config.json
        and config.json when present. The chat template: chat_template.jinja, else
        tokenizer_config.json's, else chat_template.json's (a processor's, as multimodal
        checkpoints ship it). Raises ValueError when neither tokenizer file exists."""
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
        elif isinstance(_read_json(os.path.join(path, "chat_template.json"))
                        .get("chat_template"), str):
            # the processor's template, the only one some multimodal checkpoints ship (their
            # text model is served: Gemma3ForConditionalGeneration)
            chat_template = _read_json(os.path.join(path, "chat_template.json"))["chat_template"]
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

    def encode(self, text: str, add_special_tokens: bool = True,
               max_tokens: Optional[int] = None) -> List[int]:
        """Token ids of text; equals HF `tokenizer(text, add_special_tokens=...)["input_ids"]`.
        A text of GIL_FREE_CHARS characters or more is tokenized with the GIL released. With
        max_tokens, a text of more tokens raises TooManyTokens (its count) without the list of
        ids being built."""
        if not isinstance(text, str):
            raise ValueError(f"text to tokenize must be a string, not {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens, max_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str:
        """Text of ids; equals HF `tokenizer.decode(ids, skip_special_tokens=...)`."""
        return self._backend.decode(ids, skip_special_tokens, spaces_between_special_tokens)

    def byte_level_pieces(self):
        """The bytes of every token (tokenizer/byte_level.ByteLevelPieces) where the tokenizer
        decodes byte-level BPE exactly as that table does, else None. Built on the first call
        (about 0.3 s for 128k tokens): AsyncEngine calls it at start, not a request."""
        return self._backend.byte_level_pieces()

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
