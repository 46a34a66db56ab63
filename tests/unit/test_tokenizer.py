"""Tokenizer and chat template: equal to HF transformers on the default model; sandboxed
templates; the sentencepiece backend on a tiny model trained here."""
import io
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


def test_missing_tokenizer_files(tmp_path):
    with pytest.raises(ValueError, match="neither tokenizer.json nor tokenizer.model"):
        Tokenizer.from_path(str(tmp_path))
