"""parsers/tool_calls.py's wire formats (--tool-call-parser), hermes and llama3: each format's
grammar accepts its own calls and refuses bad arguments (xgrammar, compiled here on the CPU),
parsing whole outputs, and streaming that holds back exactly the text that may be a call
(test_tool_formats.py has the other formats, the streamed call deltas and bounded work)."""
import json
import random

import pytest
import xgrammar as xgr

from radixserve.parsers import tool_calls as T

WEATHER = {"name": "get_weather", "description": "", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ADD = {"name": "add", "description": "", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"]}}
FUNCTIONS = [WEATHER, ADD]


def _accepts(grammar_json: str, text: str) -> bool:
    return xgr.testing._is_grammar_accept_string(xgr.Grammar.from_structural_tag(grammar_json),
                                                 text)


@pytest.mark.parametrize("name", ["hermes", "llama3"])
def test_grammars_accept_the_formats_calls_and_refuse_bad_arguments(name):
    fmt = T.get_format(name)
    good, bad = fmt.call_text("add", {"a": 1, "b": 2}), fmt.call_text("add", {"a": "x", "b": 2})
    weather = fmt.call_text("get_weather", {"city": "Paris"})
    required = fmt.grammar(FUNCTIONS, "required")
    assert _accepts(required, good) and _accepts(required, weather)
    assert not _accepts(required, bad) and not _accepts(required, "Sure. " + good)
    named = fmt.grammar(FUNCTIONS, "add")
    assert _accepts(named, good) and not _accepts(named, weather)
    auto = fmt.grammar(FUNCTIONS, "auto")
    assert _accepts(auto, "Let me check. " + weather) and _accepts(auto, "No call needed.")
    assert not _accepts(auto, "Let me check. " + bad)
    assert fmt.grammar(FUNCTIONS, "none") is None and fmt.grammar([], "auto") is None
    one = json.loads(fmt.grammar(FUNCTIONS, "auto", parallel=False))["format"]
    assert one["stop_after_first"] is True


LLAMA = [
    # (output, content, [(name, arguments)])
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [("get_weather", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}', None,
     [("add", {"a": 1, "b": 2})]),
    ('{"name": "add", "parameters": {"a": 1, "b": 2}}; '
     '{"name":"get_weather","arguments":{"city":"Oslo"}}',
     None, [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo"})]),
    ('I will check. {"name": "get_weather", "parameters": {"city": "Rome"}}', "I will check.",
     [("get_weather", {"city": "Rome"})]),
    ('The JSON {"a": 1} is not a call.', 'The JSON {"a": 1} is not a call.', []),
    ('{"name": "add", "parameters": {"a": 1', '{"name": "add", "parameters": {"a": 1', []),  # cut
]
HERMES = [
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', None,
     [("add", {"a": 1, "b": 2})]),
    ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Sure.", [("get_weather", {"city": "Paris"})]),
    ("<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
    ('{"name": "add", "parameters": {"a": 1, "b": 2}}',     # llama3's form is content here
     '{"name": "add", "parameters": {"a": 1, "b": 2}}', []),
]
CASES = [("llama3",) + c for c in LLAMA] + [("hermes",) + c for c in HERMES]


def _calls(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_parse_whole_outputs(name, text, content, calls):
    got_content, got_calls = T.get_format(name).parse(text)
    assert got_content == content and _calls(got_calls) == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got_calls)


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_streaming_any_split_gives_the_whole_parse(name, text, content, calls):
    fmt = T.get_format(name)
    rng = random.Random(len(text))
    for _ in range(100):
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        stream = T.ToolCallStream(fmt)
        sent = "".join(stream.feed(p) for p in pieces)
        rest, got = stream.finish()
        assert _calls(got) == calls, pieces
        if calls:                      # the content around the calls, as the whole parse has it
            assert (sent + rest).strip() == (content or ""), pieces
        else:
            assert sent + rest == text, pieces


def test_streaming_sends_text_before_a_call_and_holds_only_a_possible_start():
    stream = T.ToolCallStream(T.get_format("llama3"))
    assert stream.feed("Checking the weather ") == "Checking the weather "
    assert stream.feed('{"na') == ""               # may become a call: held
    assert stream.feed('me": "get_weather", "parameters": {"city": "Oslo"}}') == ""
    content, calls = stream.finish()
    assert content == "" and _calls(calls) == [("get_weather", {"city": "Oslo"})]
    stream = T.ToolCallStream(T.get_format("llama3"))
    assert stream.feed("a {") == "a "
    assert stream.feed("x} b") == "{x} b"          # not a call after all: released


def test_calls_render_back_in_the_format_for_templates_without_tools():
    call = {"id": "call_1", "type": "function",
            "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    history = [{"role": "user", "content": "1+2?"},
               {"role": "assistant", "content": None, "tool_calls": [call, call]}]
    for name, text in (("llama3", '{"name": "add", "parameters": {"a": 1, "b": 2}}'),
                       ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}'
                                  '\n</tool_call>')):
        fmt = T.get_format(name)
        out = T.messages_for_template(history, [ADD], False, fmt)
        shown = fmt.call_text("<function name>", "<arguments object>") \
            .replace('"<function name>"', "<function name>") \
            .replace('"<arguments object>"', "<arguments object>")
        assert out[0]["role"] == "system" and shown in out[0]["content"]
        assert out[2]["content"] == fmt.joiner.join([text, text])
        assert _calls(fmt.parse(out[2]["content"])[1]) == [("add", {"a": 1, "b": 2})] * 2
    assert T.messages_for_template(history, [ADD], True, T.get_format("llama3")) is history


def test_the_server_flag_offers_every_format():
    import dataclasses

    from radixserve.config import ServerArgs
    field = {f.name: f for f in dataclasses.fields(ServerArgs)}["tool_call_parser"]
    assert set(field.metadata["choices"]) == set(T.FORMATS) and field.default == "hermes"


# --------------------------------------------------------------------------- the real model

@pytest.fixture(scope="module")
def llama3_client(default_model_path):
    """The app over an AsyncEngine on the default model with --tool-call-parser llama3 (its
    template renders no tools, so the prompt gets llama3's system block)."""
    from starlette.testclient import TestClient
    from test_server_fake_engine import LOCAL

    from radixserve.config import ServerArgs
    from radixserve.engine.async_engine import AsyncEngine
    from radixserve.server.app import create_app

    engine = AsyncEngine(ServerArgs(model_path=default_model_path, device="cpu",
                                    tool_call_parser="llama3", max_total_tokens=4096,
                                    context_length=1024, max_running_requests=4))
    assert not engine.tokenizer.template_handles_tools
    with TestClient(create_app(engine), base_url=LOCAL, raise_server_exceptions=False) as client:
        yield client


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_llama3_calls_are_forced_parsed_and_valid_on_the_default_model(llama3_client, choice,
                                                                       stream):
    import jsonschema

    from test_server_fake_engine import sse_events

    tools = [{"type": "function", "function": f} for f in FUNCTIONS]
    body = {"messages": [{"role": "user", "content": "What is 2 plus 3?"}], "tools": tools,
            "tool_choice": choice, "temperature": 0, "max_tokens": 60, "stream": stream}
    r = llama3_client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if stream:                  # each call's id and name, then its arguments in pieces
        chunks = [e["choices"][0] for e in sse_events(r) if e["choices"]]
        calls = {}
        for tc in (tc for c in chunks for tc in c["delta"].get("tool_calls", [])):
            slot = calls.setdefault(tc["index"], {"id": tc.get("id"), "function": {
                "name": tc["function"].get("name"), "arguments": ""}})
            slot["function"]["arguments"] += tc["function"]["arguments"]
        calls = [calls[k] for k in sorted(calls)]
        finish = chunks[-1]["finish_reason"]
    else:
        choice0 = r.json()["choices"][0]
        calls, finish = choice0["message"].get("tool_calls") or [], choice0["finish_reason"]
    assert finish == "tool_calls" and len(calls) == 1
    fn = calls[0]["function"]
    assert fn["name"] in ("add", "get_weather") and (isinstance(choice, str) or fn["name"] == "add")
    schema = {"add": ADD, "get_weather": WEATHER}[fn["name"]]["parameters"]
    jsonschema.validate(json.loads(fn["arguments"]), schema)


@pytest.mark.parametrize("name", ["hermes", "llama3"])
def test_nesting_beyond_the_json_parser_is_content_not_an_error(name):
    fmt = T.get_format(name)
    deep = '{"name": ' * 100_000 + "1" + "}" * 100_000
    text = f"{T.BEGIN}\n{deep}\n{T.END}" if name == "hermes" else deep
    content, calls = fmt.parse(text)
    assert calls == [] and content == text


def test_history_arguments_that_do_not_parse_render_as_sent():
    deep = "[" * 100_000 + "]" * 100_000
    call = {"id": "c", "type": "function", "function": {"name": "add", "arguments": deep}}
    text = T.get_format("llama3").render_calls([call])
    assert json.loads(text)["parameters"] == deep
