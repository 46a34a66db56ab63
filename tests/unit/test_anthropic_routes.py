"""Anthropic's Messages API (server/anthropic_*.py) over the fake engine of
test_server_fake_engine: the Message and every streamed event validated with the anthropic
SDK's own types, the event order, stop reasons, usage, thinking blocks from
--reasoning-parser, tool_use blocks out and tool_result blocks in (through the chat route's
tool machinery and template path), count_tokens, errors in Anthropic's shape (the door's
included, with the key sent as x-api-key), and bad requests that start nothing."""
import dataclasses
import json

import anthropic.types as AT
import pytest
from pydantic import TypeAdapter
from starlette.testclient import TestClient

from radixserve.server import anthropic_render
from radixserve.server.app import create_app
from radixserve.server.render import SeqResult

from test_server_fake_engine import LOCAL, FakeEngine

HI = [{"role": "user", "content": "hi"}]
EVENT = TypeAdapter(AT.RawMessageStreamEvent)
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
THOUGHT = "<think>\nThe user greets.\n</think>\n\nHello there."


def _client(engine, **args):
    engine.server_args = dataclasses.replace(engine.server_args, **args)
    return TestClient(create_app(engine), base_url=LOCAL, raise_server_exceptions=False)


@pytest.fixture()
def engine():
    e = FakeEngine()
    e.context_len = 1024
    return e


@pytest.fixture()
def client(engine):
    with _client(engine) as c:
        yield c


def _post(client, **body):
    return client.post("/v1/messages", json={"model": "fake", "messages": HI, **body})


def _message(r) -> AT.Message:
    assert r.status_code == 200, r.text
    return AT.Message.model_validate(r.json())


def _as_dict(m: AT.Message) -> dict:
    """The parts of a Message the tests compare, without the SDK's unset optional fields."""
    return {"content": [b.model_dump(exclude_none=True) for b in m.content],
            "stop_reason": m.stop_reason, "stop_sequence": m.stop_sequence,
            "usage": m.usage.model_dump(exclude_none=True)}


def _events(r) -> list:
    """The streamed events, each checked: `event:` names the data's type, the data validates
    as the SDK's RawMessageStreamEvent; no [DONE]."""
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    raw = r.content.decode()
    assert raw.endswith("\n\n") and "[DONE]" not in raw
    events = []
    for frame in raw[:-2].split("\n\n"):
        head, data = frame.split("\n")
        assert head.startswith("event: ") and data.startswith("data: ")
        obj = json.loads(data[len("data: "):])
        assert obj["type"] == head[len("event: "):]
        events.append(obj if obj["type"] == "error" else EVENT.validate_python(obj))
    return events


def _accumulate(events) -> dict:
    """The message the events describe, with the order Anthropic's protocol requires checked."""
    start, *middle, delta, stop = events
    assert (start.type, delta.type, stop.type) == ("message_start", "message_delta", "message_stop")
    msg = start.message.model_dump()
    assert msg["content"] == [] and msg["stop_reason"] is None
    open_index = None
    for e in middle:
        if e.type == "content_block_start":
            assert open_index is None and e.index == len(msg["content"])
            open_index = e.index
            msg["content"].append(e.content_block.model_dump(exclude_none=True))
        elif e.type == "content_block_delta":
            assert e.index == open_index
            block, d = msg["content"][e.index], e.delta
            if d.type == "text_delta":
                block["text"] += d.text
            elif d.type == "thinking_delta":
                block["thinking"] += d.thinking
            elif d.type == "signature_delta":
                block["signature"] = d.signature
            else:
                assert d.type == "input_json_delta"
                block["input"] = json.loads(d.partial_json)
        else:
            assert e.type == "content_block_stop" and e.index == open_index
            open_index = None
    assert open_index is None
    msg["stop_reason"], msg["stop_sequence"] = delta.delta.stop_reason, delta.delta.stop_sequence
    msg["usage"].update(delta.usage.model_dump(exclude_none=True))
    return msg


def _prompt(engine) -> str:
    return bytes(engine.seen[-1].input_ids).decode()


# --------------------------------------------------------------------------- plain and streamed

def test_message_shape_usage_and_prompt(client, engine):
    m = _message(_post(client, max_tokens=5, system="Be brief.", metadata={"user_id": "u1"},
                       temperature=0.5, top_p=0.9, top_k=20))
    assert m.type == "message" and m.role == "assistant" and m.model == "fake"
    assert m.id.startswith("msg_") and engine.seen[-1].rid == m.id
    assert [b.model_dump(exclude_none=True) for b in m.content] == [{"type": "text", "text": "Paris"}]
    assert (m.stop_reason, m.stop_sequence) == ("max_tokens", None)
    prompt = "<system>Be brief.<user>hi<assistant>"
    assert _prompt(engine) == prompt
    assert (m.usage.input_tokens, m.usage.output_tokens) == (len(prompt), 5)
    assert (m.usage.cache_read_input_tokens, m.usage.cache_creation_input_tokens) == (0, 0)
    sp = engine.seen[-1].sampling_params
    assert (sp.max_new_tokens, sp.temperature, sp.top_p, sp.top_k) == (5, 0.5, 0.9, 20)


def test_system_blocks_and_content_blocks_join_like_chat_parts(client, engine):
    _message(_post(client, max_tokens=1, system=[{"type": "text", "text": "A"},
                                                 {"type": "text", "text": "B",
                                                  "cache_control": {"type": "ephemeral"}}],
                   messages=[{"role": "user", "content": [{"type": "text", "text": "x"},
                                                          {"type": "text", "text": "y"}]},
                             {"role": "assistant", "content": "ok"},
                             {"role": "user", "content": "z"}]))
    assert _prompt(engine) == "<system>A\nB<user>x\ny<assistant>ok<user>z<assistant>"


def test_stop_sequence_names_the_sequence(client, engine):
    m = _message(_post(client, max_tokens=20, stop_sequences=["capital", "s"]))
    assert m.content[0].text == "Pari"
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "s")
    assert engine.seen[-1].sampling_params.stop_strs == ["capital", "s"]


def test_stop_reasons_of_every_finish():
    def result(reason):
        r = SeqResult(0, [1, 2])
        r.finish_reason = reason
        return r
    assert anthropic_render.stop_reason(result({"type": "stop", "matched": 2}), False) == ("end_turn", None)
    assert anthropic_render.stop_reason(result({"type": "stop", "matched": "END"}), False) == \
        ("stop_sequence", "END")
    assert anthropic_render.stop_reason(result({"type": "length", "matched": None}), False) == \
        ("max_tokens", None)
    assert anthropic_render.stop_reason(result({"type": "stop", "matched": 2}), True) == ("tool_use", None)


def test_stream_events_follow_anthropics_sequence(client):
    m = _message(_post(client, max_tokens=12, stop_sequences=["capital"]))
    events = _events(_post(client, max_tokens=12, stop_sequences=["capital"], stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert all(e.delta.type == "text_delta" for e in events[2:-3])
    streamed = _accumulate(events)
    assert streamed["content"] == [b.model_dump(exclude_none=True) for b in m.content]
    assert (streamed["stop_reason"], streamed["usage"]["output_tokens"]) == (m.stop_reason, 12)
    assert streamed["usage"]["input_tokens"] == m.usage.input_tokens
    assert events[0].message.id != m.id


def test_the_cached_prompt_is_cache_read_input_tokens():
    r = SeqResult(0, list(range(10)))
    r.prompt_tokens, r.cached_tokens, r.completion_tokens = 10, 4, 3
    assert anthropic_render.usage(r) == {"input_tokens": 6, "output_tokens": 3,
                                         "cache_creation_input_tokens": 0,
                                         "cache_read_input_tokens": 4}


# --------------------------------------------------------------------------- thinking

@pytest.mark.parametrize("stream", [False, True])
def test_thinking_block_from_the_reasoning_parser(engine, stream):
    engine.reply = THOUGHT
    with _client(engine, reasoning_parser="qwen3") as c:
        r = _post(c, max_tokens=len(THOUGHT), stream=stream)
        msg = _accumulate(_events(r)) if stream else _as_dict(_message(r))
    assert msg["content"] == [{"type": "thinking", "thinking": "The user greets.", "signature": ""},
                              {"type": "text", "text": "Hello there."}]
    assert msg["stop_reason"] == "max_tokens"
    # the fake tokenizer has no </think> token: the tagged reasoning encoded, one per byte
    tagged = "<think>The user greets.</think>"
    assert msg["usage"]["output_tokens_details"] == {"thinking_tokens": len(tagged)}


def test_streamed_thinking_then_text_blocks(engine):
    engine.reply = THOUGHT
    with _client(engine, reasoning_parser="qwen3") as c:
        events = _events(_post(c, max_tokens=len(THOUGHT), stream=True))
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text"]
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    first_text = deltas.index("text_delta")
    assert deltas[first_text - 1] == "signature_delta"       # just before the thinking block stops
    assert deltas.count("thinking_delta") > 3 and "thinking_delta" not in deltas[first_text:]


def test_thinking_setting_reaches_the_template(client, engine):
    _message(_post(client, max_tokens=1, thinking={"type": "enabled", "budget_tokens": 2048}))
    assert _prompt(engine).startswith("<enable_thinking=True>")
    _message(_post(client, max_tokens=1, thinking={"type": "disabled"}))
    assert _prompt(engine).startswith("<enable_thinking=False>")
    r = _post(client, max_tokens=1, thinking={"type": "enabled"})
    assert r.json()["error"]["message"].startswith("thinking.budget_tokens is required")


# --------------------------------------------------------------------------- tools

@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"},
                                    {"type": "auto"}])
def test_tool_use_block(engine, choice, stream):
    engine.reply = "Let me check. " + CALL
    with _client(engine) as c:
        r = _post(c, max_tokens=len(engine.reply), tools=[WEATHER], tool_choice=choice,
                  stream=stream)
        msg = _accumulate(_events(r)) if stream else _as_dict(_message(r))
    text, call = msg["content"]
    assert text["type"] == "text" and text["text"].strip() == "Let me check."
    assert call["type"] == "tool_use" and call["id"].startswith("toolu_")
    assert (call["name"], call["input"]) == ("get_weather", {"city": "Paris"})
    assert (msg["stop_reason"], msg["stop_sequence"]) == ("tool_use", None)
    prompt = _prompt(engine)        # the chat route's tools block (the template lacks tools)
    assert prompt.startswith("<system>You can call these functions") and '"get_weather"' in prompt
    tag = engine.seen[-1].sampling_params.structural_tag      # the chat route's call grammar
    assert tag is not None and "get_weather" in tag
    assert ("triggered_tags" in tag) == (choice["type"] == "auto")


def test_tool_choice_none_keeps_tools_out(client, engine):
    _message(_post(client, max_tokens=3, tools=[WEATHER], tool_choice={"type": "none"}))
    assert _prompt(engine) == "<user>hi<assistant>"
    assert engine.seen[-1].sampling_params.grammar_key is None


def test_disable_parallel_tool_use_stops_after_the_first_call(client, engine):
    _message(_post(client, max_tokens=3, tools=[WEATHER],
                   tool_choice={"type": "auto", "disable_parallel_tool_use": True}))
    assert json.loads(engine.seen[-1].sampling_params.structural_tag)["format"]["stop_after_first"]


def test_tool_result_round_renders_like_chat_tool_messages(client, engine):
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": [
                   {"type": "thinking", "thinking": "I should call it.", "signature": ""},
                   {"type": "text", "text": "Checking."},
                   {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                    "input": {"city": "Paris"}}]},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 C"},
                   {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                    "content": [{"type": "text", "text": "no such city"}]},
                   {"type": "text", "text": "And tomorrow?"}]}]
    _message(_post(client, max_tokens=1, tools=[WEATHER], messages=history))
    prompt = _prompt(engine)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert prompt.endswith(f"<user>Weather in Paris?<assistant>Checking.\n{call}<tool>21 C"
                           "<tool>Error: no such city<user>And tomorrow?<assistant>")
    assert "I should call it." not in prompt              # earlier thinking is not rendered
    # the same conversation through the chat route renders to the same prompt
    chat = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"id": "toolu_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "21 C"},
            {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no such city"},
            {"role": "user", "content": "And tomorrow?"}]
    tools = [{"type": "function", "function": {"name": WEATHER["name"],
                                               "description": WEATHER["description"],
                                               "parameters": WEATHER["input_schema"]}}]
    r = client.post("/v1/chat/completions", json={"messages": chat, "tools": tools, "max_tokens": 1})
    assert r.status_code == 200 and _prompt(engine) == prompt


# --------------------------------------------------------------------------- count_tokens

def test_count_tokens_is_the_prompt_the_message_runs(client, engine):
    body = {"system": "Be brief.", "tools": [WEATHER], "tool_choice": {"type": "any"},
            "messages": [{"role": "user", "content": "Weather?"}]}
    r = client.post("/v1/messages/count_tokens", json={"model": "fake", **body})
    assert r.status_code == 200, r.text
    count = AT.MessageTokensCount.model_validate(r.json()).input_tokens
    assert engine.seen == []                                  # nothing ran
    m = _message(_post(client, max_tokens=1, **body))
    assert count == len(engine.seen[-1].input_ids) == m.usage.input_tokens
    long = [{"role": "user", "content": "x" * 2000}]          # past the context: still counted
    r = client.post("/v1/messages/count_tokens", json={"messages": long})
    assert r.json() == {"input_tokens": len("<user>" + "x" * 2000 + "<assistant>")}


# --------------------------------------------------------------------------- errors

def _error(r, status, kind="invalid_request_error", where=None):
    assert r.status_code == status, r.text
    body = r.json()
    assert body == {"type": "error", "error": {"type": kind, "message": body["error"]["message"]}}
    if kind != "request_too_large":     # Anthropic's 413 type, which the SDK's types lack
        AT.ErrorResponse.model_validate(body)
    message = body["error"]["message"]
    assert message and (where is None or message.startswith(where)), message
    return message


@pytest.mark.parametrize("body, where", [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"stop_sequences": [""]}, "stop_sequences[0]"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f",
                                                   "input": {}}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]},
     "messages[1]"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"name": "f", "input_schema": {"type": "array"}}]}, "tools[0].input_schema"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"stream": "yes"}, "stream"),
    ({"n": 2}, "unknown field 'n'"),
    ({"output_config": {"effort": "high"}}, "output_config"),
])
def test_bad_requests_are_400s_that_start_nothing(client, engine, body, where):
    payload = {"model": "fake", "max_tokens": 4, "messages": HI, **body}
    if payload["max_tokens"] is None:
        del payload["max_tokens"]
    _error(client.post("/v1/messages", json=payload), 400, where=where)
    assert engine.seen == [] and not engine.running


def test_other_errors_keep_anthropics_shape(client, engine):
    _error(_post(client, model="claude-x", max_tokens=2), 404, "not_found_error")
    _error(client.post("/v1/messages", content=b"{", headers={"content-type": "application/json"}), 400)
    _error(client.post("/v1/messages", content=b"x", headers={"content-type": "text/plain"}), 415)
    _error(client.get("/v1/messages"), 405)
    _error(client.post("/v1/messages/count_tokens", json={"messages": HI, "max_tokens": 3}), 400,
           where="unknown field 'max_tokens'")
    _error(_post(client, max_tokens=2000), 400, where="max_tokens=2000")   # past the context
    assert engine.seen == []
    engine.reply = "ABORTME"             # the fake aborts at the second token (a full KV pool)
    _error(_post(client, max_tokens=10, messages=[{"role": "user", "content": "ABORTME"}]), 503,
           "overloaded_error")


def test_an_error_after_the_stream_started_is_an_error_event(client, engine):
    events = _events(_post(client, max_tokens=10, stream=True,
                           messages=[{"role": "user", "content": "ABORTME"}]))
    assert events[0].type == "message_start"
    last = events[-1]
    assert last == {"type": "error", "error": {"type": "overloaded_error", "message": last["error"]["message"]}}
    assert "KV pool" in last["error"]["message"]
    AT.ErrorResponse.model_validate(last)


def test_the_door_takes_x_api_key_and_answers_in_each_routes_shape(engine):
    key = "sk-anthropic-test-1"
    with _client(engine, api_key=key) as c:
        for headers in ({}, {"x-api-key": "wrong"}, {"authorization": "Bearer wrong"}):
            for path in ("/v1/messages", "/v1/messages/count_tokens"):
                r = c.post(path, json={"model": "fake", "max_tokens": 2, "messages": HI},
                           headers=headers)
                assert "x-api-key" in _error(r, 401, "authentication_error")
            r = c.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == 401     # OpenAI's shape
        assert engine.seen == []
        _message(c.post("/v1/messages", json={"max_tokens": 2, "messages": HI},
                        headers={"x-api-key": key}))
        _message(c.post("/v1/messages", json={"max_tokens": 2, "messages": HI},
                        headers={"authorization": f"Bearer {key}"}))
        r = c.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2},
                   headers={"x-api-key": key})
        assert r.status_code == 200
        # a wrong Authorization is not rescued by a right x-api-key
        r = c.post("/v1/messages", json={"max_tokens": 2, "messages": HI},
                   headers={"x-api-key": key, "authorization": "Bearer wrong"})
        _error(r, 401, "authentication_error")


def test_the_door_refuses_foreign_hosts_and_large_bodies_in_anthropics_shape(engine):
    with _client(engine, max_request_bytes=1024) as c:
        _error(c.post("/v1/messages", json={"max_tokens": 2, "messages": HI},
                      headers={"host": "evil.example"}), 421)
        big = {"max_tokens": 2, "messages": [{"role": "user", "content": "x" * 2000}]}
        _error(c.post("/v1/messages", json=big), 413, "request_too_large")
    assert engine.seen == []


def test_error_types_by_status():
    assert [anthropic_render.error_type(s) for s in (400, 401, 403, 404, 405, 413, 415, 500, 503)] == [
        "invalid_request_error", "authentication_error", "permission_error", "not_found_error",
        "invalid_request_error", "request_too_large", "invalid_request_error", "api_error",
        "overloaded_error"]



# --------------------------------------------------------------------------- the document

@pytest.mark.parametrize("body, valid", [
    ({"max_tokens": 5, "messages": HI}, True),
    ({"messages": HI}, False),
    ({"max_tokens": 5, "messages": HI, "temperature": -1}, False),
    ({"max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]}, False),
    ({"max_tokens": 5, "messages": HI, "tools": [WEATHER], "tool_choice": {"type": "any"}}, True),
    ({"max_tokens": 5, "messages": HI, "tools": [{"name": "bad name!", "input_schema":
                                                  {"type": "object"}}]}, False),
    ({"max_tokens": 5, "messages": HI, "stream": True, "metadata": {"user_id": "u"}}, True),
    ({"max_tokens": 5, "messages": HI, "logprobs": True}, False),
])
def test_the_documented_schema_agrees_with_the_parser(client, body, valid):
    """A body /openapi.json calls valid is served; one it calls invalid is a 400."""
    import jsonschema
    from referencing import Registry
    from referencing.jsonschema import DRAFT202012

    from radixserve.server.openapi import openapi_document

    doc = openapi_document(api_key=False)
    registry = Registry().with_resource("urn:doc", DRAFT202012.create_resource(doc))
    validator = jsonschema.Draft202012Validator(
        {"$ref": "urn:doc#/components/schemas/AnthropicMessagesRequest"}, registry=registry)
    assert validator.is_valid(body) is valid
    r = client.post("/v1/messages", json=body)
    assert r.status_code == (200 if valid else 400), r.text
