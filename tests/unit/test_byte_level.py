"""tokenizer/byte_level.py: the token bytes table of byte-level BPE tokenizers."""
import random

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from radixserve.tokenizer.byte_level import (ByteLevelPieces, byte_level_pieces,
                                             gpt2_byte_decoder, text_of)


def test_gpt2_alphabet_is_a_bijection_onto_bytes():
    table = gpt2_byte_decoder()
    assert len(table) == 256 and sorted(table.values()) == list(range(256))
    assert table["A"] == ord("A") and table["\u0120"] == ord(" ")    # "Ġ" is the space


def test_default_tokenizer_table_decodes_as_the_tokenizer(default_tokenizer):
    pieces = default_tokenizer.byte_level_pieces()
    assert isinstance(pieces, ByteLevelPieces)
    assert len(pieces.table) == default_tokenizer.vocab_size
    assert pieces.special and pieces.special <= set(range(default_tokenizer.vocab_size))
    assert default_tokenizer.byte_level_pieces() is pieces           # built once
    rng = random.Random(7)
    special = sorted(default_tokenizer.all_special_ids)
    for _ in range(200):
        ids = [rng.randrange(default_tokenizer.vocab_size) for _ in range(rng.randrange(1, 30))]
        ids.insert(rng.randrange(len(ids) + 1), rng.choice(special))
        for skip in (True, False):
            assert text_of(pieces, ids, skip) == default_tokenizer.decode(
                ids, skip_special_tokens=skip)
    ids = default_tokenizer.encode("Grüße, 世界 🇫🇷!", add_special_tokens=False)
    assert text_of(pieces, ids, True) == "Grüße, 世界 🇫🇷!"


def _word_level(decoder):
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "▁hi": 3}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if decoder is not None:
        tok.decoder = decoder
    return tok


def test_other_decoders_get_no_table():
    assert byte_level_pieces(_word_level(None), None) is None
    assert byte_level_pieces(_word_level(decoders.Metaspace()), {"type": "Metaspace"}) is None


def test_a_table_that_does_not_decode_as_the_tokenizer_is_refused():
    """A spec claiming ByteLevel over a tokenizer that decodes otherwise (WordLevel without a
    decoder joins tokens with spaces): the check against tok.decode catches it."""
    assert byte_level_pieces(_word_level(None), {"type": "ByteLevel"}) is None
    tok = _word_level(decoders.ByteLevel())
    pieces = byte_level_pieces(tok, {"type": "ByteLevel"})
    assert pieces is not None and text_of(pieces, [1, 2], True) == tok.decode([1, 2])

