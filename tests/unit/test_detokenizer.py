"""IncrementalDetokenizer on the default model's byte-level BPE tokenizer."""
import pytest

from radixserve.tokenizer.detokenizer import IncrementalDetokenizer

MULTIBYTE = "Hi 😀👍🏽 日本語のテキスト, 한국어 and ñandú 🇫🇷!"
SENTENCE = "The quick brown fox jumps over the lazy dog."


class _CountingTokenizer:
    """A tokenizer with decode only (no byte_level_pieces): the window decoder's path."""

    def __init__(self, tok):
        self.tok, self.calls = tok, 0

    def decode(self, ids, **kw):
        self.calls += 1
        return self.tok.decode(ids, **kw)


def _run(tok, ids, chunk=1, **kw):
    """Push ids in chunks; return (deltas, flushed text, detokenizer)."""
    kw.setdefault("stop_strs", [])
    detok = IncrementalDetokenizer(tok, kw.pop("stop_strs"), kw.pop("no_stop_trim", False),
                                   kw.pop("skip_special_tokens", True),
                                   kw.pop("spaces_between_special_tokens", True))
    deltas = []
    for i in range(0, len(ids), chunk):
        result = detok.push(ids[i:i + chunk])
        deltas.append(result.text_delta)
    return deltas, detok.flush(), detok


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_multibyte_never_broken(default_tokenizer, chunk):
    ids = default_tokenizer.encode(MULTIBYTE, add_special_tokens=False)
    # the test is only meaningful if some characters are split across tokens
    assert any("\ufffd" in default_tokenizer.token_text(i) for i in ids)
    deltas, tail, _ = _run(default_tokenizer, ids, chunk)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + tail == default_tokenizer.decode(ids) == MULTIBYTE


@pytest.mark.parametrize("path", ["bytes", "window"])
def test_incomplete_character_released_by_flush(default_tokenizer, path):
    tok = default_tokenizer if path == "bytes" else _CountingTokenizer(default_tokenizer)
    ids = default_tokenizer.encode("ok 😀", add_special_tokens=False)
    deltas, tail, detok = _run(tok, ids[:-1])      # the emoji's last byte never comes
    assert (detok._utf8 is not None) == (path == "bytes")
    # the byte path holds back only the cut character's bytes; the window decoder holds back
    # the whole token they came in (" " and the first bytes of the emoji)
    assert "".join(deltas) == ("ok " if path == "bytes" else "ok")
    assert "".join(deltas) + tail == default_tokenizer.decode(ids[:-1])
    assert tail.endswith("\ufffd") and len(tail) == (1 if path == "bytes" else 2)


def test_special_tokens_skipped_or_kept(default_tokenizer):
    ids = default_tokenizer.encode("hello", add_special_tokens=False) + [2]   # <|im_end|>
    deltas, tail, _ = _run(default_tokenizer, ids)
    assert "".join(deltas) + tail == "hello"
    deltas, tail, _ = _run(default_tokenizer, ids, skip_special_tokens=False)
    assert "".join(deltas) + tail == "hello<|im_end|>"


def _stop_case(tok, stops, no_stop_trim=False, chunk=1):
    ids = tok.encode(SENTENCE, add_special_tokens=False)
    deltas, tail, detok = _run(tok, ids, chunk, stop_strs=stops, no_stop_trim=no_stop_trim)
    return "".join(deltas) + tail, detok


def test_stop_string_across_token_boundary(default_tokenizer):
    tok = default_tokenizer
    # "own fo" spans the tokens " brown" and " fox"
    ids = tok.encode(SENTENCE, add_special_tokens=False)
    assert not any("own fo" in tok.token_text(i) for i in ids)
    text, detok = _stop_case(tok, ["own fo"])
    assert detok.stop_matched == "own fo"
    assert text == "The quick br"
    text, detok = _stop_case(tok, ["own fo"], no_stop_trim=True)
    assert text == "The quick brown fo"
    # nothing after the match, and nothing of the stop string before it
    deltas, tail, detok = _run(tok, ids, stop_strs=["own fo"])
    assert tail == "" and detok.finished
    emitted = ""
    for d in deltas:
        emitted += d
        assert "own" not in emitted


def test_stop_string_at_the_start(default_tokenizer):
    text, detok = _stop_case(default_tokenizer, ["The"])
    assert (text, detok.stop_matched) == ("", "The")
    text, _ = _stop_case(default_tokenizer, ["The"], no_stop_trim=True)
    assert text == "The"


@pytest.mark.parametrize("chunk", [1, 100])
def test_stop_strings_one_prefix_of_another(default_tokenizer, chunk):
    # the shorter completes first, whether tokens arrive one by one or all at once
    text, detok = _stop_case(default_tokenizer, ["lazy dog", "lazy"], chunk=chunk)
    assert (text, detok.stop_matched) == ("The quick brown fox jumps over the ", "lazy")
    text, detok = _stop_case(default_tokenizer, ["jumps under", "jumps over"], chunk=chunk)
    assert (text, detok.stop_matched) == ("The quick brown fox ", "jumps over")


def test_partial_stop_string_released_at_end(default_tokenizer):
    ids = default_tokenizer.encode("see the la", add_special_tokens=False)
    deltas, tail, detok = _run(default_tokenizer, ids, stop_strs=["lazy"])
    assert detok.stop_matched is None
    assert "".join(deltas) == "see the " and tail == "la"


def test_no_stop_deltas_concatenate_to_full_decode(default_tokenizer):
    text = SENTENCE + " " + MULTIBYTE + "\n\tend"
    ids = default_tokenizer.encode(text, add_special_tokens=False)
    deltas, tail, detok = _run(default_tokenizer, ids, stop_strs=["never appears", "\n\n"])
    assert detok.stop_matched is None
    assert "".join(deltas) + tail == text


@pytest.mark.parametrize("path", ["bytes", "window"])
@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_concatenate_to_full_decode(default_tokenizer, chunk, path, skip):
    """Any ids (random ones cut characters, mix special tokens in and start words anywhere):
    the deltas and the flush are the full decode, on the byte path and on the window decoder
    (whichever way its window moved)."""
    import random

    tok = default_tokenizer if path == "bytes" else _CountingTokenizer(default_tokenizer)
    rng = random.Random(chunk)
    vocab = default_tokenizer.vocab_size
    special = sorted(default_tokenizer.all_special_ids)
    for n in range(20):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        if n % 2:
            ids[rng.randrange(len(ids))] = rng.choice(special)
        deltas, tail, detok = _run(tok, ids, chunk, skip_special_tokens=skip)
        assert (detok._utf8 is not None) == (path == "bytes")
        assert "".join(deltas) + tail == default_tokenizer.decode(ids, skip_special_tokens=skip)


def test_about_one_decode_a_token(default_tokenizer):
    """The window's prefix text is kept from the push before (the loop thread decodes each
    streamed token's window once, not twice): one decode a push, plus one each time the
    window's start moves up (every WINDOW tokens or so)."""
    from radixserve.tokenizer.detokenizer import WINDOW

    ids = default_tokenizer.encode(SENTENCE * 8, add_special_tokens=False)
    counting = _CountingTokenizer(default_tokenizer)
    deltas, tail, _ = _run(counting, ids)
    assert "".join(deltas) + tail == SENTENCE * 8
    assert counting.calls <= len(ids) * (1 + 1 / (WINDOW - 1)) + 2, (counting.calls, len(ids))
