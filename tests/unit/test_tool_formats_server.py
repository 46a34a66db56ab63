"""--tool-call-parser qwen3_coder / mistral / pythonic through /v1/chat/completions: over the
fake engine (a reply written in each format, one character per token), the streamed
delta.tool_calls add up to the non-streamed message's calls and arrive while the call is being
written; a call cut off by max_tokens; and on the default model (SmolLM2-135M, in-process),
tool_choice required and named force the model into each format, its calls parsed and valid
against the tool's schema, streamed and not."""
import dataclasses
import json

import jsonschema
import pytest
from starlette.testclient import TestClient

from radixserve.server.app import create_app

from test_server_fake_engine import LOCAL, FakeEngine, sse_events

ADD = {"name": "add", "description": "Add two integers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"]}}
BOOK = {"name": "book_hotel", "description": "Book a hotel room", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "nights": {"type": "integer"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "extras": {"type": "object", "properties": {"breakfast": {"type": "boolean"}},
                   "required": ["breakfast"]}},
    "required": ["city", "nights", "extras"]}}
TOOLS = [{"type": "function", "function": f} for f in (ADD, BOOK)]
SCHEMAS = {f["name"]: f["parameters"] for f in (ADD, BOOK)}

REPLIES = {
    "qwen3_coder": "Booking it.\n<tool_call>\n<function=book_hotel>\n<parameter=city>\nSão Paulo"
                   "\n</parameter>\n<parameter=nights>\n2\n</parameter>\n<parameter=extras>\n"
                   '{"breakfast": true}\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n'
                   "<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n41\n"
                   "</parameter>\n</function>\n</tool_call>",
    "mistral": 'Booking it.[TOOL_CALLS] [{"name": "book_hotel", "arguments": {"city": "São Paulo",'
               ' "nights": 2, "extras": {"breakfast": true}}}, {"name": "add", "arguments": '
               '{"a": 1, "b": 41}}]',
    "pythonic": 'Booking it.\n[book_hotel(city="São Paulo", nights=2, extras={"breakfast": True}),'
                " add(a=1, b=41)]",
}
WANT = [("book_hotel", {"city": "São Paulo", "nights": 2, "extras": {"breakfast": True}}),
        ("add", {"a": 1, "b": 41})]
CHAT = {"messages": [{"role": "user", "content": "Book São Paulo, 2 nights; and 1 + 41?"}],
        "tools": TOOLS}


def _fake_client(parser, reply):
    engine = FakeEngine()
    engine.server_args = dataclasses.replace(engine.server_args, tool_call_parser=parser)
    engine.reply = reply
    engine.context_len = 8192
    return TestClient(create_app(engine), base_url=LOCAL, raise_server_exceptions=False)


def _streamed(r):
    """(content, calls, finish_reason, chunks) of a streamed chat response; calls accumulated
    from delta.tool_calls (each call's first delta carries its id and name)."""
    assert r.status_code == 200, r.text
    chunks = [e["choices"][0] for e in sse_events(r) if e["choices"]]
    content, calls = "", {}
    for c in chunks:
        content += c["delta"].get("content") or ""
        for tc in c["delta"].get("tool_calls") or []:
            if tc["index"] not in calls:
                assert tc["id"] and tc["type"] == "function" and "name" in tc["function"]
                calls[tc["index"]] = {"id": tc["id"], "name": tc["function"]["name"],
                                      "arguments": ""}
            else:
                assert "name" not in tc["function"] and "id" not in tc
            calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
    return content, [calls[k] for k in sorted(calls)], chunks[-1]["finish_reason"], chunks


@pytest.mark.parametrize("parser", sorted(REPLIES))
def test_streamed_call_deltas_add_up_to_the_message_calls(parser):
    reply = REPLIES[parser]
    with _fake_client(parser, reply) as client:
        body = {**CHAT, "max_tokens": len(reply)}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        content, calls, finish, chunks = _streamed(
            client.post("/v1/chat/completions", json={**body, "stream": True}))
    msg = choice["message"]
    assert choice["finish_reason"] == finish == "tool_calls"
    assert msg["content"] == content.strip() == "Booking it."
    whole = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
             for c in msg["tool_calls"]]
    assert whole == WANT
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == WANT
    assert [c["arguments"] for c in calls] == [c["function"]["arguments"]
                                              for c in msg["tool_calls"]]
    if parser == "mistral":
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls + msg["tool_calls"])
    # the calls stream while they are written: deltas in many chunks before the last one
    during = [c for c in chunks[:-1] if c["delta"].get("tool_calls")]
    assert len(during) > 4 and all(c["finish_reason"] is None for c in during)


@pytest.mark.parametrize("parser", sorted(REPLIES))
@pytest.mark.parametrize("cut_at, whole", [("41", 1), ("Paulo", 0)])
def test_a_call_cut_by_max_tokens(parser, cut_at, whole):
    """Not streamed, the cut call is content; streamed, the call whose name went out stays a
    call with the arguments that came. The finish reason is tool_calls when a call before it
    was whole, else length, streamed or not."""
    reply = REPLIES[parser]
    cut = reply.index(cut_at)
    with _fake_client(parser, reply) as client:
        body = {**CHAT, "max_tokens": cut}
        choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        content, calls, finish, _ = _streamed(
            client.post("/v1/chat/completions", json={**body, "stream": True}))
    assert choice["finish_reason"] == finish == ("tool_calls" if whole else "length")
    msg = choice["message"]
    names = [name for name, _ in WANT]
    assert [c["function"]["name"] for c in msg.get("tool_calls") or []] == names[:whole]
    assert msg["content"].startswith("Booking it.")
    assert msg["content"].rstrip().endswith(reply[:cut].rstrip()[-4:])   # the cut call
    assert content.strip() == "Booking it."
    assert [c["name"] for c in calls] == names[:whole + 1]
    full = json.dumps(WANT[whole][1])
    assert full.startswith(calls[whole]["arguments"]) and calls[whole]["arguments"] != full


# --------------------------------------------------------------------------- the real model

@pytest.fixture(scope="module", params=["qwen3_coder", "mistral", "pythonic"])
def model_client(request, default_model_path):
    """The app over an AsyncEngine on the default model with --tool-call-parser <param> (its
    template renders no tools, so the prompt gets the format's system block)."""
    from radixserve.config import ServerArgs
    from radixserve.engine.async_engine import AsyncEngine

    engine = AsyncEngine(ServerArgs(model_path=default_model_path, device="cpu",
                                    tool_call_parser=request.param, max_total_tokens=4096,
                                    context_length=1024, max_running_requests=4))
    with TestClient(create_app(engine), base_url=LOCAL, raise_server_exceptions=False) as client:
        yield request.param, client


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required",
                                    {"type": "function", "function": {"name": "book_hotel"}}])
def test_the_default_model_is_forced_into_the_format(model_client, choice, stream):
    parser, client = model_client
    body = {"messages": [{"role": "user", "content": "Book a hotel in Paris for 3 nights."}],
            "tools": TOOLS, "tool_choice": choice, "temperature": 0, "max_tokens": 200,
            "stream": stream}
    r = client.post("/v1/chat/completions", json=body)
    if stream:
        _, calls, finish, _ = _streamed(r)
    else:
        assert r.status_code == 200, r.text
        choice0 = r.json()["choices"][0]
        calls = [{"id": c["id"], **c["function"]} for c in choice0["message"]["tool_calls"] or []]
        finish = choice0["finish_reason"]
    assert finish == "tool_calls" and len(calls) == 1, (parser, calls)
    call = calls[0]
    assert call["name"] in SCHEMAS and (isinstance(choice, str) or call["name"] == "book_hotel")
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    if parser == "mistral":
        assert len(call["id"]) == 9 and call["id"].isalnum()


@pytest.mark.parametrize("parser, choice, kept", [
    ("mistral", "auto", True), ("mistral", "required", True), ("mistral", "none", False),
    ("hermes", "auto", False), ("pythonic", "auto", False)])
def test_special_token_markers_are_kept_in_the_text(parser, choice, kept):
    """With a tokenizer whose [TOOL_CALLS] and [ARGS] are special tokens (Mistral v11+), a
    request with tools keeps special tokens in its text (else the calls could not be read) and
    its grammar writes the compact form."""
    from radixserve.server import openai_api, requests as R

    from test_server_fake_engine import FakeTokenizer

    class MistralTokenizer(FakeTokenizer):
        SPECIAL = {"[TOOL_CALLS]": 300, "[ARGS]": 301}

        def token_to_id(self, token):
            return self.SPECIAL.get(token)

        def decode(self, ids, skip_special_tokens=True, spaces_between_special_tokens=True):
            if set(ids) <= set(self.SPECIAL.values()):
                names = {v: k for k, v in self.SPECIAL.items()}
                return "" if skip_special_tokens else "".join(names[i] for i in ids)
            return super().decode(ids, skip_special_tokens, spaces_between_special_tokens)

    engine = FakeEngine()
    engine.tokenizer = MistralTokenizer()
    engine.server_args = dataclasses.replace(engine.server_args, tool_call_parser=parser)
    body = {**CHAT, "tool_choice": choice}
    req = R.parse_chat_request(body)
    assert req.sampling.skip_special_tokens is True
    tools = openai_api._chat_tools(engine, body, req)
    assert req.sampling.skip_special_tokens is (not kept)
    if parser == "mistral" and choice != "none":
        assert "[ARGS]" in req.sampling.structural_tag and tools.fmt.compact
