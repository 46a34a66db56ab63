"""Tokenizer and chat template: equal to HF transformers on the default model; sandboxed
templates; the sentencepiece backend on a tiny model trained here."""
import io
import os
import json

import pytest

from radixserve.tokenizer.chat_template import ChatTemplate
from radixserve.tokenizer.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    "  leading and trailing spaces  ",
    "Tabs\tand\nnew\n\nlines",
    "Emoji: 😀👍🏽🇫🇷 and a family 👨‍👩‍👧",
    "CJK: 日本語のテキスト、中文文本，한국어",
    "Accents: naïve café ñandú Ærøskøbing",
    "def f(x):\n    return x ** 2  # code",
    "Numbers 1234567890 3.14159 -42",
    "<|im_start|>user\nliteral special tokens<|im_end|>",
    "",
]


def test_encode_decode_match_hf(default_tokenizer, hf_gguf_tokenizer):
    hf = hf_gguf_tokenizer
    for text in TEXTS:
        for add in (True, False):
            ids = default_tokenizer.encode(text, add_special_tokens=add)
            assert ids == hf(text, add_special_tokens=add)["input_ids"], text
        for skip in (True, False):
            assert (default_tokenizer.decode(ids, skip_special_tokens=skip)
                    == hf.decode(ids, skip_special_tokens=skip)), text


def test_special_ids_match_hf(default_tokenizer, hf_gguf_tokenizer):
    hf = hf_gguf_tokenizer
    assert hf.eos_token_id in default_tokenizer.eos_token_ids
    assert default_tokenizer.eos_token_ids[0] == 2          # <|im_end|> (generation_config)
    assert default_tokenizer.bos_token_id == hf.bos_token_id
    assert default_tokenizer.vocab_size == len(hf)
    assert set(default_tokenizer.all_special_ids) == set(hf.all_special_ids)
    for token_id in (0, 2, 28, 905, 19556, 40303):
        assert default_tokenizer.token_text(token_id) == hf.decode([token_id])


CHATS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "Times 3? 😀 日本"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
     {"role": "assistant", "content": "b"}],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_hf(default_tokenizer, hf_gguf_tokenizer, add_generation_prompt):
    for chat in CHATS:
        expected = hf_gguf_tokenizer.apply_chat_template(
            chat, add_generation_prompt=add_generation_prompt, tokenize=False)
        assert default_tokenizer.apply_chat_template(
            chat, add_generation_prompt=add_generation_prompt) == expected
        expected_ids = hf_gguf_tokenizer.apply_chat_template(
            chat, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False)
        assert default_tokenizer.encode_chat(
            chat, add_generation_prompt=add_generation_prompt) == expected_ids


# A template using the HF-specific globals and filters: tojson (no HTML escaping, indent),
# namespace, loop controls, special-token variables, raise_exception, tools.
FEATURE_TEMPLATE = (
    "{% set ns = namespace(count=0) %}"
    "{{ bos_token }}"
    "{% if tools %}TOOLS:{{ tools | tojson(indent=2) }}\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'skip' %}{% continue %}{% endif %}"
    "{% if m['role'] not in ['user', 'assistant', 'system'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "{% set ns.count = ns.count + 1 %}"
    "[{{ m['role'] }}] {{ m['content'] | tojson }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}[assistant #{{ ns.count }}]{% endif %}"
)


def test_template_features_match_hf(default_tokenizer, hf_gguf_tokenizer):
    chat = [{"role": "user", "content": "<b>&\"quotes\" é 😀</b>"}, {"role": "skip", "content": "x"},
            {"role": "assistant", "content": "ok"}]
    tools = [{"type": "function", "function": {"name": "get_weather",
                                               "parameters": {"type": "object", "properties": {}}}}]
    ours = ChatTemplate(FEATURE_TEMPLATE).render(chat, add_generation_prompt=True, tools=tools,
                                                 special_tokens=default_tokenizer.special_tokens)
    expected = hf_gguf_tokenizer.apply_chat_template(chat, tools=tools, chat_template=FEATURE_TEMPLATE,
                                                     add_generation_prompt=True, tokenize=False)
    assert ours == expected
    assert '"<b>&\\"quotes\\" é 😀</b>"' in ours        # tojson: no HTML escaping, no \u escapes
    assert ours.endswith("[assistant #2]")


def test_template_raise_exception_is_value_error():
    template = ChatTemplate(FEATURE_TEMPLATE)
    with pytest.raises(ValueError, match="unknown role tool_x"):
        template.render([{"role": "tool_x", "content": "a"}])


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{% set ns = namespace(_secret=1) %}{{ ns._secret }}",
    "{% set _ = messages.append({'role': 'x'}) %}{{ messages }}",
    "{{ cycler.__init__.__globals__.os }}",
])
def test_sandbox_blocks_exploits(source):
    with pytest.raises(ValueError):
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("messages", [
    [],
    "hello",
    [{"content": "no role"}],
    [{"role": 3, "content": "bad role"}],
    [{"role": "user", "content": 5}],
    ["not a dict"],
    [{"role": "user", "content": [1, 2]}],
])
def test_bad_message_shapes(default_tokenizer, messages):
    with pytest.raises(ValueError):
        default_tokenizer.apply_chat_template(messages)


def test_template_syntax_error_is_value_error():
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")


def test_none_fields_are_dropped_like_hf(default_tokenizer, hf_gguf_tokenizer):
    chat = [{"role": "user", "content": "hi", "name": None}]
    assert (default_tokenizer.apply_chat_template(chat)
            == hf_gguf_tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))


# ----------------------------------------------------------------------------- sentencepiece

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a stitch in time saves nine",
    "all that glitters is not gold",
    "the early bird catches the worm",
    "actions speak louder than words",
] * 20


@pytest.fixture(scope="module")
def sp_model_dir(tmp_path_factory):
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS), model_writer=buf,
                                   vocab_size=100, model_type="bpe", character_coverage=1.0,
                                   bos_id=1, eos_id=2, unk_id=0, pad_id=-1,
                                   minloglevel=2)
    path = tmp_path_factory.mktemp("spm")
    (path / "tokenizer.model").write_bytes(buf.getvalue())
    (path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True,
                                                            "add_eos_token": False}))
    return path


def test_sentencepiece_backend(sp_model_dir):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(sp_model_dir / "tokenizer.model"))
    tok = Tokenizer.from_path(str(sp_model_dir))
    assert tok.vocab_size == 100
    assert tok.bos_token_id == 1 and tok.eos_token_ids == [2]
    assert set(tok.all_special_ids) == {0, 1, 2}
    text = "the lazy fox saves gold"
    pieces = sp.encode(text)
    assert tok.encode(text) == [1] + pieces
    assert tok.encode(text, add_special_tokens=False) == pieces
    assert tok.decode(tok.encode(text)) == text
    with_eos = [1] + pieces + [2]
    assert tok.decode(with_eos, skip_special_tokens=False) == f"<s> {text} </s>"
    assert tok.decode(with_eos, skip_special_tokens=False,
                      spaces_between_special_tokens=False) == f"<s>{text}</s>"
    assert tok.token_text(1) == "<s>"
    assert not tok.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_of_a_multimodal_checkpoint(sp_model_dir, tmp_path):
    """A checkpoint whose only template is its processor's chat_template.json (multimodal ones,
    whose text model is served) gets it; tokenizer_config.json's, when present, wins; the EOS
    ids of the outer config.json of a text_config-nesting checkpoint are read."""
    import shutil

    for name in os.listdir(sp_model_dir):
        shutil.copy(os.path.join(sp_model_dir, name), tmp_path)
    processor = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": processor}))
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [2, 7],
        "text_config": {"eos_token_id": 2}}))
    tok = Tokenizer.from_path(str(tmp_path))
    assert tok.has_chat_template and tok.eos_token_ids == [2, 7]
    chat = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(chat, add_generation_prompt=False) == "<user>hi"
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_path(str(tmp_path)).apply_chat_template(
        chat, add_generation_prompt=False) == "[hi]"


def test_missing_tokenizer_files(tmp_path):
    with pytest.raises(ValueError, match="neither tokenizer.json nor tokenizer.model"):
        Tokenizer.from_path(str(tmp_path))


# --------------------------------------------------------------------------- long texts, bounds

def _adversarial_texts():
    """Texts that pack many characters into few tokens, or few into many."""
    import random
    rng = random.Random(34)
    texts = ["#" * 5000, " " * 5000, "\n    " * 1000, "-" * 4097 + "x", "ab" * 3000,
             "".join(chr(rng.randint(0x20, 0x10FFFF)) for _ in range(3000)),
             "\x06\x04" * 2000 + "hi", "word " * 2000, "é" * 3000]
    return [t.encode("utf-8", "ignore").decode("utf-8") for t in texts] + TEXTS


def test_long_texts_encode_like_short_ones_and_without_the_gil(default_tokenizer, hf_gguf_tokenizer):
    """Texts of GIL_FREE_CHARS characters or more go through the batch encoder (which
    releases the GIL) with the same ids as HF; max_tokens refuses a longer text."""
    from radixserve.tokenizer.tokenizer import GIL_FREE_CHARS, TooManyTokens
    backend = default_tokenizer._backend
    calls = []
    real = backend._batch

    def batch(texts, add_special_tokens):
        calls.append(len(texts[0]))
        return real(texts, add_special_tokens=add_special_tokens)

    backend._batch = batch
    try:
        long_text = " ".join(TEXTS) * (GIL_FREE_CHARS // len(" ".join(TEXTS)) + 1)
        for text in (long_text, long_text[:GIL_FREE_CHARS], long_text[:GIL_FREE_CHARS - 1]):
            for add in (True, False):
                assert default_tokenizer.encode(text, add) == hf_gguf_tokenizer(
                    text, add_special_tokens=add)["input_ids"]
        assert calls == [len(long_text)] * 2 + [GIL_FREE_CHARS] * 2
        n = len(default_tokenizer.encode(long_text))
        assert len(default_tokenizer.encode(long_text, max_tokens=n)) == n
        with pytest.raises(TooManyTokens) as info:
            default_tokenizer.encode(long_text, max_tokens=n - 1)
        assert (info.value.count, info.value.limit) == (n, n - 1)
        with pytest.raises(TooManyTokens):
            default_tokenizer.encode("hello world", max_tokens=1)
    finally:
        backend._batch = real


def test_chars_per_token_bound_holds_on_the_default_model(default_tokenizer):
    """SmolLM2's byte-level BPE: the longest token is 81 characters (a run of '#'s); six
    ASCII control characters have no byte symbol in its vocabulary and vanish (silent). For
    any text, tokens x max_chars_per_token >= its characters other than the silent ones."""
    tok = default_tokenizer
    assert tok.max_chars_per_token == 81
    assert tok.silent_chars == frozenset("\x04\x06\x13\x14\x16\x1d")
    for c in tok.silent_chars:
        assert tok.encode(c * 100, add_special_tokens=False) == []
    for text in _adversarial_texts():
        counted = len(text) - sum(text.count(c) for c in tok.silent_chars)
        assert len(tok.encode(text, add_special_tokens=False)) * tok.max_chars_per_token >= counted


@pytest.mark.parametrize("change, bound", [
    ({}, 4),                                                            # "abcd" is the longest
    ({"normalizer": {"type": "NFC"}}, 16),
    ({"normalizer": {"type": "Sequence", "normalizers": [{"type": "NFD"}, {"type": "Lowercase"}]}}, 4),
    ({"normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}}, 4),
    ({"normalizer": {"type": "Replace", "pattern": {"String": "  "}, "content": " "}}, None),
    ({"normalizer": {"type": "Replace", "pattern": {"Regex": "\\s+"}, "content": " "}}, None),
    ({"normalizer": {"type": "BertNormalizer"}}, None),
    ({"normalizer": {"type": "StripAccents"}}, None),
    ({"normalizer": {"type": "Precompiled", "precompiled_charsmap": "x"}}, None),
    ({"pre_tokenizer": {"type": "Whitespace"}}, None),
    ({"pre_tokenizer": {"type": "Split", "behavior": "Removed"}}, None),
    ({"pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "Digits"}, {"type": "Metaspace"}]}}, 4),
    ({"added_tokens": [{"content": "<m>", "lstrip": True, "rstrip": False}]}, None),
    ({"model": {"type": "BPE", "unk_token": None, "byte_fallback": False}}, None),   # drops unknowns
    ({"model": {"type": "BPE", "unk_token": "<unk>", "fuse_unk": True}}, None),
    ({"model": {"type": "BPE", "unk_token": "<unk>", "fuse_unk": False}}, 4),
    ({"model": {"type": "Unigram", "byte_fallback": False}}, None),
    ({"model": {"type": "Unigram", "byte_fallback": True}}, 4),
    ({"model": {"type": "WordPiece"}}, None),
    ({"model": {"type": "WordLevel"}}, None),
])
def test_chars_per_token_bound_refuses_what_can_delete_characters(change, bound):
    """tokenizers_chars_bound over tokenizer.json variants: a bound only where no character
    can vanish or a run of them become one token."""
    from radixserve.tokenizer.tokenizer import tokenizers_chars_bound
    spec = {"normalizer": None, "pre_tokenizer": None, "added_tokens": [],
            "model": {"type": "BPE", "byte_fallback": True}, **change}
    got = tokenizers_chars_bound(spec, ["a", "ab", "abcd"])
    assert (got[0] if got else None) == bound


def test_byte_level_bpe_missing_bytes(default_model_path):
    """A byte-level BPE lacking a lead byte and a continuation byte may drop whole multi-byte
    characters: no bound. Lacking only lead bytes (SmolLM2 lacks 0xF1, 0xF2) it may not."""
    import json as _json

    from tokenizers import Tokenizer as HF

    from radixserve.tokenizer.tokenizer import _utf8_byte_symbols, tokenizers_chars_bound
    path = f"{default_model_path}/tokenizer.json"
    spec = _json.load(open(path))
    vocab = list(HF.from_file(path).get_vocab(with_added_tokens=True))
    assert tokenizers_chars_bound(spec, vocab)[0] == 81
    by_byte = {b: s for s, b in _utf8_byte_symbols().items()}
    assert len(by_byte) == 128 + 64 + (0xF5 - 0xC2)
    without_continuation = [t for t in vocab if by_byte[0xA9] not in t]
    assert tokenizers_chars_bound(spec, without_continuation) is None


def test_sentencepiece_claims_no_bound(sp_model_dir):
    tok = Tokenizer.from_path(str(sp_model_dir))
    assert tok.max_chars_per_token is None and tok.silent_chars == frozenset()
    from radixserve.tokenizer.tokenizer import TooManyTokens
    with pytest.raises(TooManyTokens):
        tok.encode("the lazy fox saves gold", max_tokens=2)
