"""The tool-call formats qwen3_coder, mistral and pythonic (parsers/tool_formats/), with hermes
and llama3 alongside: outputs written the way each model family's chat template writes calls,
parsed whole and streamed at every split (one character at a time, and every cut in two), the
streamed call deltas (name first, then argument JSON that adds up to the parsed arguments); a
call cut off mid-way; qwen3_coder's typed values; the grammars of tool_choice required / named /
auto (xgrammar, compiled here on the CPU) accepting the format's calls and refusing bad
arguments; the prompt and history rendering; bind(); the flag's names."""
import argparse
import json

import jsonschema
import pytest
import xgrammar as xgr

from radixserve.config import ServerArgs
from radixserve.errors import ApiError
from radixserve.parsers import tool_calls as T
from radixserve.parsers.tool_formats import json_text
from radixserve.parsers.tool_formats.pyliteral import literal_value
from radixserve.parsers.tool_formats.pyschema import kwargs_grammar
from radixserve.parsers.tool_formats.qwen3_coder import convert_value


def _fn(name, properties, required=()):
    return {"name": name, "description": "", "parameters": {
        "type": "object", "properties": properties, "required": list(required)}}


WEATHER = _fn("get_weather", {"city": {"type": "string"},
                              "unit": {"enum": ["celsius", "fahrenheit"]},
                              "days": {"type": "integer"}}, ["city"])
WRITE = _fn("write_file", {"path": {"type": "string"}, "content": {"type": "string"},
                           "overwrite": {"type": "boolean"}}, ["path", "content"])
SEARCH = _fn("search", {"query": {"type": "string"}, "filters": {"type": "object"},
                        "tags": {"type": "array", "items": {"type": "string"}},
                        "threshold": {"type": "number"}, "limit": {"type": ["integer", "null"]}},
             ["query"])
ADD = _fn("add", {"a": {"type": "integer"}, "b": {"type": "number"}}, ["a", "b"])
FUNCTIONS = [WEATHER, WRITE, SEARCH, ADD]

CODE = 'def greet(name):\n    print(f"héllo {name} 🌍 <b>")\n    return [1, (2, 3)]'
NESTED = {"lang": "fr", "max": 5, "nested": {"a": [1, {"b": None}], "ok": True}}

QWEN = [
    # (output, content, [(name, arguments)])
    ("I'll check the weather for you.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
     "Paris\n</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n<parameter=days>\n3\n"
     "</parameter>\n</function>\n</tool_call>",
     "I'll check the weather for you.",
     [("get_weather", {"city": "Paris", "unit": "celsius", "days": 3})]),
    (f"<tool_call>\n<function=write_file>\n<parameter=path>\n/tmp/café.py\n</parameter>\n"
     f"<parameter=content>\n{CODE}\n</parameter>\n<parameter=overwrite>\ntrue\n</parameter>\n"
     f"</function>\n</tool_call>\n<tool_call>\n<function=search>\n<parameter=query>\n"
     f"naïve bayes 统计\n</parameter>\n<parameter=filters>\n{json.dumps(NESTED)}\n</parameter>\n"
     f"<parameter=tags>\n[\"ml\", \"统计\"]\n</parameter>\n<parameter=threshold>\n0.75\n"
     f"</parameter>\n<parameter=limit>\nnull\n</parameter>\n</function>\n</tool_call>",
     None,
     [("write_file", {"path": "/tmp/café.py", "content": CODE, "overwrite": True}),
      ("search", {"query": "naïve bayes 统计", "filters": NESTED, "tags": ["ml", "统计"],
                  "threshold": 0.75, "limit": None})]),
    # two functions in one block; a parameter left open; a string that looks like a number
    # stays a string; an integer that is not one stays the text; text after the calls
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\n123\n<parameter=days>\nthree\n"
     "</parameter>\n</function>\n<function=add>\n<parameter=a>\n2\n</parameter>\n"
     "<parameter=b>\n-0.5\n</parameter>\n</function>\n</tool_call>\nDone.",
     "Done.",
     [("get_weather", {"city": "123", "days": "three"}), ("add", {"a": 2, "b": -0.5})]),
    # a function the request did not send: its values stay strings
    ("<tool_call>\n<function=lookup>\n<parameter=id>\n42\n</parameter>\n</function>\n"
     "</tool_call>", None, [("lookup", {"id": "42"})]),
    ("<tool_call>\n<function=list_files>\n</function>\n</tool_call>", None,
     [("list_files", {})]),
    ("The capital of France is Paris. Use <b>bold</b> for emphasis.",
     "The capital of France is Paris. Use <b>bold</b> for emphasis.", []),
    ("Wrap calls in <tool_call> tags, like this.",
     "Wrap calls in <tool_call> tags, like this.", []),
]
MISTRAL = [
    ('Let me look that up.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": '
     '"Paris", "unit": "celsius"}, "id": "a1b2c3d4e"}, {"name": "search", "arguments": '
     '{"query": "天气 ☀", "filters": {"nested": [1, [2, {"x": true}]], "e": "\\u00e9\\n"}}}]',
     "Let me look that up.",
     [("get_weather", {"city": "Paris", "unit": "celsius"}),
      ("search", {"query": "天气 ☀", "filters": {"nested": [1, [2, {"x": True}]], "e": "é\n"}})]),
    ('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2.0}}]', None,
     [("add", {"a": 1, "b": 2.0})]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich", "days": 2}[TOOL_CALLS]add[ARGS]'
     '{"a": -15, "b": -1.5e3}', None,
     [("get_weather", {"city": "Zürich", "days": 2}), ("add", {"a": -15, "b": -1500.0})]),
    ('[TOOL_CALLS]add[CALL_ID]abc123XYZ[ARGS]{"a": 1, "b": 2}', None, [("add", {"a": 1, "b": 2})]),
    ('Sure![TOOL_CALLS]write_file{"path": "a.txt", "content": "x\\ty"}', "Sure!",
     [("write_file", {"path": "a.txt", "content": "x\ty"})]),
    ('Plain answer with [brackets] and {"json": 1}.',
     'Plain answer with [brackets] and {"json": 1}.', []),
    ("[TOOL_CALLS] not json", "[TOOL_CALLS] not json", []),
]
PYTHONIC = [
    ('[get_weather(city="Paris", unit="celsius")]', None,
     [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ("Let me check both.\n[get_weather(city='Zürich', unit=\"celsius\", days=3), "
     "search(query=\"naïve 🌍\", filters={'lang': 'fr', 'nested': [1, (2, 3), {'ok': True, "
     "'none': None}]}, tags=['a', \"b\"], threshold=-0.5)]",
     "Let me check both.",
     [("get_weather", {"city": "Zürich", "unit": "celsius", "days": 3}),
      ("search", {"query": "naïve 🌍", "filters": {"lang": "fr", "nested": [
          1, [2, 3], {"ok": True, "none": None}]}, "tags": ["a", "b"], "threshold": -0.5})]),
    ("<|python_start|>[add(a=1, b=2)]<|python_end|>", None, [("add", {"a": 1, "b": 2})]),
    ('[write_file(path="a.py", content="""def f(a, b):\n    return (a, b)]""", '
     'overwrite=False)]', None,
     [("write_file", {"path": "a.py", "content": "def f(a, b):\n    return (a, b)]",
                      "overwrite": False})]),
    ("[list_files(), math.add(a=1, b=2.5e3,)]", None,
     [("list_files", {}), ("math.add", {"a": 1, "b": 2500.0})]),
    ("[toggle(on=true, value=null)] done", "done", [("toggle", {"on": True, "value": None})]),
    ("See [the docs](https://example.com), [note] and [see(below)].",
     "See [the docs](https://example.com), [note] and [see(below)].", []),
]
HERMES = [
    ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}\n'
     '</tool_call>\n<tool_call>\n{"name": "search", "arguments": {"query": "x", "filters": '
     '{"nested": [1, {"a": null}]}}}\n</tool_call>', "Sure.",
     [("get_weather", {"city": "Zürich", "days": 2}),
      ("search", {"query": "x", "filters": {"nested": [1, {"a": None}]}})]),
]
LLAMA3 = [
    ('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_weather", '
     '"parameters": {"city": "Tōkyō"}}', None,
     [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Tōkyō"})]),
]
CASES = [(name, *case) for name, cases in (
    ("qwen3_coder", QWEN), ("mistral", MISTRAL), ("pythonic", PYTHONIC), ("hermes", HERMES),
    ("llama3", LLAMA3)) for case in cases]
IDS = [f"{c[0]}-{i}" for i, c in enumerate(CASES)]


def _fmt(name):
    return T.get_format(name).bind(FUNCTIONS)


def _stream(fmt, pieces, take=True):
    """(content, finish's calls, deltas) of a stream fed pieces, deltas taken after each."""
    stream = T.ToolCallStream(fmt)
    content, deltas = "", []
    for piece in pieces:
        content += stream.feed(piece)
        deltas += stream.take_deltas() if take else []
    rest, calls = stream.finish()
    deltas += stream.take_deltas() if take else []
    return content + rest, calls, deltas


def _accumulate(deltas):
    """The calls the deltas add up to, checking that each call's first delta carries its id,
    type and name, and no later one does."""
    calls = {}
    for d in deltas:
        fn = d["function"]
        if d["index"] not in calls:
            assert d["type"] == "function" and d["id"] and "name" in fn, d
            calls[d["index"]] = {"id": d["id"], "name": fn["name"], "arguments": "", "pieces": 0}
        else:
            assert set(d) == {"index", "function"} and set(fn) == {"arguments"}, d
        calls[d["index"]]["arguments"] += fn["arguments"]
        calls[d["index"]]["pieces"] += 1
    assert sorted(calls) == list(range(len(calls)))
    return [calls[i] for i in sorted(calls)]


def _pairs(calls):
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize("name, text, content, calls", CASES, ids=IDS)
def test_parse_whole_outputs(name, text, content, calls):
    got_content, got = _fmt(name).parse(text)
    assert got_content == content
    # the arguments are exactly the canonical JSON of the expected values
    assert _pairs(got) == [(n, json.dumps(a)) for n, a in calls]
    for c in got:
        assert c["type"] == "function"
        if name == "mistral":
            assert len(c["id"]) == 9 and c["id"].isalnum()
        else:
            assert c["id"].startswith("call_")


@pytest.mark.parametrize("name, text, content, calls", CASES, ids=IDS)
def test_streaming_at_every_split_gives_the_whole_parse(name, text, content, calls):
    fmt = _fmt(name)
    want_content, want = fmt.parse(text)
    splits = [[text[:k], text[k:]] for k in range(len(text) + 1)] + [list(text)]
    for pieces in splits:
        sent, finished, deltas = _stream(fmt, pieces)
        streamed = _accumulate(deltas)
        assert [(c["name"], c["arguments"]) for c in streamed] == _pairs(want), pieces
        assert [(c["id"], c["name"], c["arguments"]) for c in streamed] == \
            [(c["id"], *p) for c, p in zip(finished, _pairs(finished))]
        if want:
            assert sent.strip() == (want_content or ""), pieces
        else:
            assert sent == text, pieces
        # without taking deltas, the stream's end is the whole parse too
        sent, finished, _ = _stream(fmt, pieces, take=False)
        assert _pairs(finished) == _pairs(want) and (sent.strip() or None) == want_content


@pytest.mark.parametrize("name, text, content, calls", [c for c in CASES if c[3]],
                         ids=[i for i, c in zip(IDS, CASES) if c[3]])
def test_a_call_streams_its_name_before_its_arguments_end(name, text, content, calls):
    """One character at a time, each call's first delta comes before its arguments are whole,
    and a call with arguments sends them in more than one delta."""
    fmt = _fmt(name)
    _, _, deltas = _stream(fmt, list(text))
    firsts = {}
    for d in deltas:
        firsts.setdefault(d["index"], d["function"]["arguments"])
    for index, call in enumerate(_accumulate(deltas)):
        if call["arguments"] != "{}":
            assert firsts[index] != call["arguments"] and call["pieces"] > 2, call


CUTS = [  # (format, output, where the output is cut: inside the last call's arguments)
    ("qwen3_coder", QWEN[0][0], QWEN[0][0].index("celsius")),
    ("mistral", MISTRAL[2][0], MISTRAL[2][0].index("-1.5e3")),
    ("mistral", MISTRAL[0][0], MISTRAL[0][0].index("[2, {")),
    ("pythonic", PYTHONIC[1][0], PYTHONIC[1][0].index("tags=")),
    ("hermes", HERMES[0][0], HERMES[0][0].index("[1, {")),
    ("llama3", LLAMA3[0][0], LLAMA3[0][0].index("Tōkyō")),
]


@pytest.mark.parametrize("name, text, cut", CUTS)
def test_an_output_that_ends_inside_a_call(name, text, cut):
    """Parsed whole, the cut call is content as written; streamed with its deltas taken, it
    stays the call it began as, its arguments what had come (a prefix of the whole call's)."""
    fmt = _fmt(name)
    whole = _pairs(fmt.parse(text)[1])
    cut_text = text[:cut]
    content, calls = fmt.parse(cut_text)
    done = _pairs(calls)
    assert done == whole[:len(done)] and len(done) == len(whole) - 1
    stream = T.ToolCallStream(fmt)
    sent, deltas = "", []
    for ch in cut_text:
        sent += stream.feed(ch)
        deltas += stream.take_deltas()
    rest, finished = stream.finish()
    deltas += stream.take_deltas()
    streamed = _accumulate(deltas)
    assert len(streamed) == len(whole) and stream.broken
    assert [c["name"] for c in streamed] == [n for n, _ in whole]
    last_args = streamed[-1]["arguments"]
    assert whole[-1][1].startswith(last_args) and last_args != whole[-1][1]
    # what the whole parse saw as content around the calls that were whole is content here too
    assert (sent + rest).strip() == (fmt.parse(text)[0] or "")
    assert content.endswith(cut_text.rstrip()[-10:])     # the cut call is content, as written


@pytest.mark.parametrize("name", ["hermes", "llama3", "qwen3_coder", "mistral", "pythonic"])
def test_calls_round_trip_through_the_format(name):
    """call_text and render_calls (history for templates without tools) read back as the
    calls they wrote; the prompt block shows the format."""
    fmt = _fmt(name)
    args = [("search", {"query": "naïve \"q\"\n", "filters": NESTED, "tags": ["x"],
                        "threshold": 0.5}),
            ("add", {"a": 3, "b": -2.5})]
    entries = [{"id": "c1", "type": "function",
                "function": {"name": n, "arguments": json.dumps(a)}} for n, a in args]
    for text in [fmt.call_text(*args[0]), fmt.render_calls(entries)]:
        got = fmt.parse(text)[1]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] \
            == args[:len(got)] and got
    out = T.messages_for_template([{"role": "user", "content": "hi"}], [ADD], False, fmt)
    assert out[0]["role"] == "system" and fmt.example_text() in out[0]["content"]


# --------------------------------------------------------------------------- qwen3_coder values

@pytest.mark.parametrize("raw, schema, value", [
    ("\nParis\n", {"type": "string"}, "Paris"),
    ("\n  indented\n  code\n\n", {"type": "string"}, "  indented\n  code\n"),
    ("\n007\n", {"type": "string"}, "007"),
    ("\n42\n", {"type": "integer"}, 42),
    ("\n42.0\n", {"type": "integer"}, 42),
    ("\nforty\n", {"type": "integer"}, "forty"),
    ("\n-1.5e3\n", {"type": "number"}, -1500.0),
    ("\nTrue\n", {"type": "boolean"}, True),
    ("\nfalse\n", {"type": "boolean"}, False),
    ('\n{"a": [1, null]}\n', {"type": "object"}, {"a": [1, None]}),
    ("\n{'a': (1, None)}\n", {"type": "object"}, {"a": [1, None]}),
    ('\n["x", 2]\n', {"type": "array"}, ["x", 2]),
    ("\nnot json\n", {"type": "array"}, "not json"),
    ("\nnull\n", {"type": ["integer", "null"]}, None),
    ("\n7\n", {"type": ["integer", "null"]}, 7),
    ("\nnull\n", {"type": "string"}, "null"),
    ("\n celsius \n", {"enum": ["celsius", "fahrenheit"]}, "celsius"),
    ("\n3\n", {"enum": [1, 2, 3]}, 3),
    ("\n3\n", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, 3),
    ("\n3\n", {}, "3"),
    ("\n3\n", None, "3"),
])
def test_qwen3_coder_values_follow_the_schema(raw, schema, value):
    got = convert_value(raw, schema)
    assert got == value and type(got) is type(value)


# --------------------------------------------------------------------------- grammars

def _grammar(spec):
    return xgr.Grammar.from_structural_tag(spec)


def _accepts(grammar, text):
    return xgr.testing._is_grammar_accept_string(grammar, text)


class _Tokenizer:
    """Enough of a tokenizer for bind(): ids for some tokens, which decode to nothing when
    special tokens are skipped."""

    def __init__(self, tokens):
        self.ids = {t: i for i, t in enumerate(tokens)}

    def token_to_id(self, token):
        return self.ids.get(token)

    def decode(self, ids, skip_special_tokens=True):
        return "" if skip_special_tokens else "".join(
            t for t, i in self.ids.items() if i in ids)


FORMS = [("qwen3_coder", None), ("mistral", None),
         ("mistral", _Tokenizer(["[TOOL_CALLS]", "[ARGS]"])), ("pythonic", None)]


@pytest.mark.parametrize("name, tokenizer", FORMS, ids=["qwen3_coder", "mistral-array",
                                                        "mistral-compact", "pythonic"])
def test_grammars_accept_the_formats_calls_and_refuse_bad_arguments(name, tokenizer):
    fmt = T.get_format(name).bind(FUNCTIONS, tokenizer)
    good, bad = fmt.call_text("add", {"a": 1, "b": 2.5}), fmt.call_text("add", {"a": "x", "b": 2})
    weather = fmt.call_text("get_weather", {"city": "Paris", "unit": "celsius"})
    missing = fmt.call_text("add", {"b": 2})
    required = _grammar(fmt.grammar(FUNCTIONS, "required"))
    assert _accepts(required, good) and _accepts(required, weather)
    assert not _accepts(required, bad) and not _accepts(required, missing)
    assert not _accepts(required, "Sure. " + good) and not _accepts(required, "no call")
    named = _grammar(fmt.grammar(FUNCTIONS, "add"))
    assert _accepts(named, good) and not _accepts(named, weather)
    auto = _grammar(fmt.grammar(FUNCTIONS, "auto"))
    assert _accepts(auto, "Let me check. " + weather) and _accepts(auto, "No call needed.")
    assert not _accepts(auto, "Let me check. " + bad)
    assert fmt.grammar(FUNCTIONS, "none") is None and fmt.grammar([], "auto") is None
    one = json.loads(fmt.grammar(FUNCTIONS, "auto", parallel=False))["format"]
    assert one["stop_after_first"] is True
    # what the grammar accepts, the format reads back
    assert _pairs(fmt.parse(good)[1]) == [("add", json.dumps({"a": 1, "b": 2.5}))]
    assert (name == "mistral" and tokenizer is not None) == ("[ARGS]" in good)


TRIP = _fn("plan_trip", {
    "city": {"type": "string", "minLength": 2, "maxLength": 8},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "stops": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
    "prefs": {"type": "object", "properties": {"budget": {"type": "number"},
                                               "hotel": {"type": "boolean"}},
              "required": ["hotel"]},
    "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    "route": {"$ref": "#/$defs/leg"}}, ["city", "prefs"])
TRIP["parameters"]["$defs"] = {"leg": {"type": "object", "properties": {
    "to": {"type": "string"}, "next": {"anyOf": [{"$ref": "#/$defs/leg"}, {"type": "null"}]}},
    "required": ["to"]}}


@pytest.mark.parametrize("text, ok", [
    ('[plan_trip(city="Rome", prefs={"hotel": True})]', True),
    ('[plan_trip(city="Rome",prefs={"hotel": False, })]', False),
    ('[plan_trip(city="Rome", unit="celsius", stops=["a", "b"], prefs={"budget": -1.5e2, '
     '"hotel": False}, note=None, route={"to": "Pisa", "next": {"to": "Siena", "next": None}})]',
     True),
    ('[plan_trip(city="Rome", stops=["a", "b", "c"], prefs={"hotel": True})]', False),
    ('[plan_trip(city="R", prefs={"hotel": True})]', False),
    ('[plan_trip(city="Bolognese", prefs={"hotel": True})]', False),
    ('[plan_trip(city="Rome", unit="kelvin", prefs={"hotel": True})]', False),
    ('[plan_trip(city="Rome", prefs={"budget": 3})]', False),
    ('[plan_trip(prefs={"hotel": True}, city="Rome")]', False),
    ('[plan_trip(city="Rome", prefs={"hotel": true})]', False),
    ('[plan_trip(city="Ro\\"me\\u00e9", prefs={"hotel": True}, note="x")]', True),
])
def test_the_pythonic_grammar_follows_the_schema(text, ok):
    fmt = T.get_format("pythonic")
    grammar = _grammar(fmt.grammar([TRIP], "required"))
    assert _accepts(grammar, text) is ok
    if ok:
        (call,) = fmt.parse(text)[1]
        jsonschema.validate(json.loads(call["function"]["arguments"]), TRIP["parameters"])


def test_the_pythonic_format_refuses_what_it_cannot_write():
    fmt = T.get_format("pythonic")
    for fn in (_fn("get-weather", {}), _fn("f", {"from": {"type": "string"}}),
               _fn("f", {"first name": {}})):
        with pytest.raises(ApiError) as e:
            fmt.grammar([fn], "required")
        assert e.value.param == "tools" and repr(fn["name"]) in str(e.value)
    assert "py_kwargs" in kwargs_grammar({"type": "object"})


# --------------------------------------------------------------------------- pieces

@pytest.mark.parametrize("text, value", [
    ("'a' 'b'", "ab"), ("-3", -3), ("+2.5", 2.5), ("(1, [2])", [1, [2]]),
    ("{'k': {'n': None}}", {"k": {"n": None}}), ("true", True), ('"""x\ny"""', "x\ny"),
])
def test_python_literals_read_without_evaluating(text, value):
    assert literal_value(text) == value


@pytest.mark.parametrize("text", ["__import__('os')", "f'{x}'", "b'x'", "{1, 2}", "x", "1 + 2",
                                  "[*a]", "{**a}", "1e999", "{1: 2}", "lambda: 1", "(" * 500])
def test_anything_but_a_literal_is_refused(text):
    with pytest.raises(ValueError):
        literal_value(text)


def test_bind_reads_the_tokenizer():
    mistral = T.get_format("mistral")
    assert not mistral.bind([ADD]).compact and not mistral.bind([ADD]).keep_special_tokens
    v3 = mistral.bind([ADD], _Tokenizer(["[TOOL_CALLS]"]))
    assert not v3.compact and v3.keep_special_tokens
    v11 = mistral.bind([ADD], _Tokenizer(["[TOOL_CALLS]", "[ARGS]"]))
    assert v11.compact and v11.keep_special_tokens and mistral.compact is False
    assert not T.get_format("pythonic").bind([ADD], _Tokenizer(["[TOOL_CALLS]"])) \
        .keep_special_tokens
    assert T.get_format("qwen3_coder").bind([ADD]).functions == {"add": ADD["parameters"]}


def test_junk_openings_cost_linear_work():
    """Thousands of call openings that never become calls are content, and reading them costs
    work linear in the text: each opening fails within its name, never rescanning the rest."""
    read = []
    real = json_text.JsonText.read

    def counting(self, cur):
        before = cur.pos
        out = real(self, cur)
        read.append(cur.pos - before)
        return out

    import unittest.mock
    cases = [("llama3", '{"name": ' * 5000), ("hermes", '<tool_call>{"name": ' * 3000),
             ("mistral", '[TOOL_CALLS][{"name": [' * 3000),
             ("hermes", "<tool_call>\n" + '{"name": ' * 50_000 + "1" + "}" * 50_000)]
    for name, junk in cases:
        read.clear()
        with unittest.mock.patch.object(json_text.JsonText, "read", counting):
            content, calls = _fmt(name).parse(junk)
        assert calls == [] and content == junk.strip()
        assert sum(read) <= 2 * len(junk), name
    good = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
    assert _pairs(_fmt("llama3").parse(good + " " + cases[0][1])[1]) == \
        [("add", '{"a": 1, "b": 2}')]
    for name, junk in (("qwen3_coder", "<tool_call>\n<function=" * 3000),
                       ("pythonic", "[f(" * 3000), ("pythonic", "[" * 5000)):
        assert _fmt(name).parse(junk) == (junk.strip(), [])


def test_the_flag_offers_every_format_and_refuses_others():
    import dataclasses

    field = {f.name: f for f in dataclasses.fields(ServerArgs)}["tool_call_parser"]
    assert set(field.metadata["choices"]) == set(T.FORMATS)
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    for name in ("qwen3_coder", "mistral", "pythonic"):
        ns = parser.parse_args(["--tool-call-parser", name])
        assert ServerArgs.from_cli_args(ns).tool_call_parser == name
    with pytest.raises(SystemExit):
        parser.parse_args(["--tool-call-parser", "bogus"])
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ServerArgs(model_path="/nonexistent", tool_call_parser="bogus").check()
    with pytest.raises(ValueError, match="qwen3_coder"):
        T.get_format("bogus")
