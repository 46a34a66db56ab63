"""parsers/reasoning.py: the <think> block split from the answer, whole and streamed."""
import random

import pytest

from radixserve.parsers.reasoning import PARSERS, ReasoningSplitter, split_reasoning

CASES = [
    # (parser, model output, reasoning (None: no block), answer)
    ("qwen3", "<think>\nLet me add.\n2 + 2 = 4\n</think>\n\nThe answer is 4.",
     "Let me add.\n2 + 2 = 4", "The answer is 4."),
    ("qwen3", "The answer is 4.", None, "The answer is 4."),
    ("qwen3", "\n\n  plain text, <think> later is text", None,
     "\n\n  plain text, <think> later is text"),
    ("qwen3", "<think>\n\n</think>\n\nHi!", "", "Hi!"),              # an empty block
    ("qwen3", "<think>unfinished thought", "unfinished thought", ""),  # cut by max_tokens
    ("qwen3", "<thi", None, "<thi"),                                  # never became a tag
    ("qwen3", "", None, ""),
    ("deepseek-r1", "Okay, the user asks 2+2.\n</think>\n\n4", "Okay, the user asks 2+2.", "4"),
    ("deepseek-r1", "<think>\nR1-0528 writes the tag\n</think>answer", "R1-0528 writes the tag",
     "answer"),
    ("deepseek-r1", "no end tag at all", "no end tag at all", ""),
    ("qwen3-thinking", "thinking</think>done </think> twice", "thinking", "done </think> twice"),
    ("qwen3", "<think>a < b and </thin is not the end</think> ok",
     "a < b and </thin is not the end", "ok"),
]


@pytest.mark.parametrize("parser,text,reasoning,answer", CASES)
def test_whole_output(parser, text, reasoning, answer):
    assert split_reasoning(text, parser) == (reasoning, answer)


def _stream(parser, pieces):
    s = ReasoningSplitter(parser)
    reasoning, answer, sent = "", "", []
    for piece in pieces:
        r, a = s.feed(piece)
        sent.append((r, a))
        reasoning, answer = reasoning + r, answer + a
    r, a = s.finish()
    return reasoning + r, answer + a, sent, s.had_reasoning


@pytest.mark.parametrize("parser,text,reasoning,answer", CASES)
def test_any_split_into_deltas_streams_the_same_split(parser, text, reasoning, answer):
    rng = random.Random(len(text))
    for _ in range(200):
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 8))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        r, a, _, had = _stream(parser, pieces)
        assert (r if had else None, a) == (reasoning, answer), pieces


def test_streaming_sends_reasoning_as_it_comes_and_holds_only_what_may_be_a_tag():
    pieces = ["<think>", "\nStep", " one.", "\n", "</th", "ink>", "\n\n", "Four", "."]
    _, _, sent, _ = _stream("qwen3", pieces)
    assert sent == [("", ""), ("Step", ""), (" one.", ""), ("", ""), ("", ""), ("", ""),
                    ("", ""), ("", "Four"), ("", ".")]
    # without reasoning every delta goes out at once, unchanged
    _, _, sent, had = _stream("qwen3", ["Hello", " world", "\n"])
    assert not had and sent == [("", "Hello"), ("", " world"), ("", "\n")]


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="deepseek-r1"):
        ReasoningSplitter("gpt-oss")
    assert set(PARSERS) == {"qwen3", "deepseek-r1", "qwen3-thinking"}


def test_the_server_flag_offers_every_parser():
    import dataclasses

    from radixserve.config import ServerArgs
    field = {f.name: f for f in dataclasses.fields(ServerArgs)}["reasoning_parser"]
    assert set(field.metadata["choices"]) == set(PARSERS) | {"none"}
    assert field.default == "none"


def test_a_grammar_spec_that_does_not_parse_is_not_wrapped():
    from radixserve.parsers.reasoning import reasoning_grammar

    deep = "[" * 100_000 + "]" * 100_000
    assert reasoning_grammar("qwen3", "json_schema", deep) is None
    assert reasoning_grammar("qwen3", "structural_tag", "{not json") is None
    assert reasoning_grammar("qwen3", "json_schema", '{"type": "object"}') is not None


@pytest.mark.parametrize("parser, prefix", [("qwen3", "<think>\nhm\n</think>\n\n"),
                                            ("qwen3", ""), ("deepseek-r1", "hm\n</think>\n\n")])
def test_wrapped_grammars_constrain_the_answer_after_the_reasoning(parser, prefix):
    import xgrammar as xgr

    from radixserve.parsers.reasoning import reasoning_grammar

    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'
    for kind, spec, good, bad in (("json_schema", schema, '{"a": 1}', '{"a": "x"}'),
                                  ("json_schema", schema, '{"a":1}', '{"a":\n\n\n1}'),
                                  ("regex", "[0-9]{3}", "123", "12a"),
                                  ("ebnf", 'root ::= "yes" | "no"', "yes", "maybe")):
        grammar = xgr.Grammar.from_structural_tag(reasoning_grammar(parser, kind, spec))
        assert xgr.testing._is_grammar_accept_string(grammar, prefix + good), (kind, good)
        assert not xgr.testing._is_grammar_accept_string(grammar, prefix + bad), (kind, bad)
    if parser == "deepseek-r1":      # the forced parsers need the reasoning's end first
        grammar = xgr.Grammar.from_structural_tag(reasoning_grammar(parser, "regex", "[0-9]{3}"))
        assert not xgr.testing._is_grammar_accept_string(grammar, "123")


class _Vocab:
    """token_to_id knows </think> as id 9 when `single`; encode: one id per character."""

    def __init__(self, single: bool):
        self.single = single

    def token_to_id(self, token):
        return 9 if self.single and token == "</think>" else None

    def encode(self, text, add_special_tokens=True):
        return list(range(len(text)))


def test_reasoning_tokens_count_through_the_closing_tag():
    from radixserve.parsers.reasoning import reasoning_token_count

    ids = [5, 6, 7, 9, 3, 4]                       # <think> a b </think> answer...
    assert reasoning_token_count(ids, "ab", _Vocab(True)) == 4
    assert reasoning_token_count([5, 6, 7], "ab", _Vocab(True)) == 3      # never closed
    assert reasoning_token_count(ids, None, _Vocab(True)) == 0           # no reasoning block
    # without </think> as one token: the tagged text encoded, at most the whole output
    assert reasoning_token_count(ids, "a", _Vocab(False)) == len(ids)
    assert reasoning_token_count(list(range(40)), "a", _Vocab(False)) == len("<think>a</think>")
