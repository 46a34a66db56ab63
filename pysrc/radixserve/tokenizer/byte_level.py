"""The bytes of each token of a byte-level BPE tokenizer (GPT-2's alphabet: Llama 3, Qwen,
SmolLM, ...), for detokenizing a stream without decoding windows of ids.

A HF tokenizers Tokenizer whose decoder is ByteLevel decodes ids as: the token strings of the
ids (special tokens dropped under skip_special_tokens), each mapped char by char back to bytes
through GPT-2's byte alphabet (a token with a char outside it contributes its own UTF-8
bytes), the bytes joined, then decoded as UTF-8 with U+FFFD for what is not valid. So the text
of a stream of ids is an incremental UTF-8 decoder fed each token's bytes: one table lookup a
token instead of a decode call (tokenizer/detokenizer.py uses it).

byte_level_pieces(tok, decoder_spec) builds the table once (a quarter of a second for 128k
tokens) and checks it against tok.decode on random id sequences, both ways of
skip_special_tokens; a tokenizer it does not match exactly (another decoder, a normalizing
added token) gets None and keeps the window decoder.
"""
from __future__ import annotations

import random
from typing import Any, Dict, FrozenSet, List, NamedTuple, Optional

CHECK_SEQUENCES = 200          # random id sequences checked against tok.decode
CHECK_MAX_LEN = 24


class ByteLevelPieces(NamedTuple):
    table: List[bytes]            # [vocab] the bytes of token id (b"" for an id with no token)
    special: FrozenSet[int]       # ids that skip_special_tokens drops


def gpt2_byte_decoder() -> Dict[str, int]:
    """GPT-2's byte alphabet, char -> byte: printable Latin-1 bytes stand for themselves, the
    other 68 bytes for the chars from U+0100 on, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars = {b: b for b in kept}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


def text_of(pieces: ByteLevelPieces, ids, skip_special_tokens: bool) -> str:
    """What tok.decode(ids, skip_special_tokens) gives, from the table."""
    special = pieces.special if skip_special_tokens else ()
    return b"".join(pieces.table[i] for i in ids if i not in special).decode("utf-8", "replace")


def byte_level_pieces(tok: Any, decoder_spec: Optional[dict]) -> Optional[ByteLevelPieces]:
    """The table of HF tokenizers Tokenizer `tok` whose tokenizer.json "decoder" is
    decoder_spec, or None where the decoder is not ByteLevel or the table does not decode as
    tok.decode does."""
    if not decoder_spec or decoder_spec.get("type") != "ByteLevel":
        return None
    to_byte = gpt2_byte_decoder()
    table: List[bytes] = []
    for i in range(tok.get_vocab_size(with_added_tokens=True)):
        piece = tok.id_to_token(i)
        if piece is None:
            table.append(b"")
            continue
        try:
            table.append(bytes(to_byte[c] for c in piece))
        except KeyError:                     # a char outside the alphabet: its own UTF-8
            table.append(piece.encode("utf-8"))
    special = frozenset(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
    pieces = ByteLevelPieces(table, special)
    rng = random.Random(0)
    added = sorted(tok.get_added_tokens_decoder())
    for n in range(CHECK_SEQUENCES):
        ids = [rng.randrange(len(table)) for _ in range(rng.randrange(1, CHECK_MAX_LEN))]
        if added and n % 4 == 0:             # added tokens among ordinary ones
            ids[rng.randrange(len(ids))] = rng.choice(added)
        for skip in (True, False):
            if text_of(pieces, ids, skip) != tok.decode(ids, skip_special_tokens=skip):
                return None
    return pieces
