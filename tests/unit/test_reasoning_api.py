"""--reasoning-parser and chat_template_kwargs through the chat route, over the fake engine
(parsers/reasoning.py has the splitter's own tests): message.reasoning_content and content, the
streamed deltas, SGLang's separate_reasoning / stream_reasoning switches, the requests the
split is skipped for, and template variables reaching the template."""
import dataclasses

import pytest
from starlette.testclient import TestClient

from radixserve.server.app import create_app

from test_server_fake_engine import LOCAL, FakeEngine, err_of, sse_events

THOUGHT = "<think>\nThe user wants a capital.\nFrance -> Paris.\n</think>\n\nParis."
CHAT = {"messages": [{"role": "user", "content": "Capital of France?"}],
        "max_tokens": len(THOUGHT)}


def _client(parser, reply=THOUGHT):
    engine = FakeEngine()
    engine.server_args = dataclasses.replace(engine.server_args, reasoning_parser=parser)
    engine.reply = reply
    engine.context_len = 1024
    return engine, TestClient(create_app(engine), base_url=LOCAL, raise_server_exceptions=False)


def _stream(client, **extra):
    r = client.post("/v1/chat/completions", json={**CHAT, "stream": True, **extra})
    assert r.status_code == 200, r.text
    deltas = [e["choices"][0]["delta"] for e in sse_events(r) if e["choices"]]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    return reasoning, content, deltas


def test_message_carries_the_reasoning_apart_from_the_answer():
    _, client = _client("qwen3")
    with client:
        msg = client.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]
        assert msg["reasoning_content"] == "The user wants a capital.\nFrance -> Paris."
        assert msg["content"] == "Paris."
        # the fake tokenizer has no </think> token: the tagged reasoning encoded, one per byte
        r = client.post("/v1/chat/completions", json=CHAT).json()
        tagged = "<think>The user wants a capital.\nFrance -> Paris.</think>"
        assert r["usage"]["completion_tokens_details"] == {"reasoning_tokens": len(tagged)}
        stream = client.post("/v1/chat/completions", json={
            **CHAT, "stream": True, "stream_options": {"include_usage": True}})
        usage = sse_events(stream)[-1]["usage"]
        assert usage["completion_tokens_details"] == {"reasoning_tokens": len(tagged)}
        reasoning, content, deltas = _stream(client)
    assert (reasoning, content) == (msg["reasoning_content"], msg["content"])
    # the reasoning streams as it comes: several reasoning deltas before the first content one
    kinds = [("r" if "reasoning_content" in d else "") + ("c" if d.get("content") else "")
             for d in deltas]
    first_content = kinds.index("c")
    assert kinds[:first_content].count("r") > 5 and "r" not in kinds[first_content:]


def test_stream_reasoning_false_sends_the_reasoning_in_one_delta():
    _, client = _client("qwen3")
    with client:
        reasoning, content, deltas = _stream(client, stream_reasoning=False)
    pieces = [d["reasoning_content"] for d in deltas if "reasoning_content" in d]
    assert pieces == ["The user wants a capital.\nFrance -> Paris."] and content == "Paris."


def test_separate_reasoning_false_and_no_parser_keep_the_raw_text():
    _, client = _client("qwen3")
    with client:
        r = client.post("/v1/chat/completions", json={**CHAT, "separate_reasoning": False})
        msg = r.json()["choices"][0]["message"]
        assert msg["content"] == THOUGHT and "reasoning_content" not in msg
        assert _stream(client, separate_reasoning=False)[:2] == ("", THOUGHT)
    _, client = _client("none")
    with client:
        msg = client.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]
        assert msg["content"] == THOUGHT and "reasoning_content" not in msg


def test_forced_parser_reads_an_output_without_the_opening_tag():
    reply = "Okay, France.\n</think>\n\nParis."
    _, client = _client("deepseek-r1", reply)
    with client:
        msg = client.post("/v1/chat/completions",
                          json={**CHAT, "max_tokens": len(reply)}).json()["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("Okay, France.", "Paris.")
    # qwen3 on a reply without <think>: all answer, reasoning_content null
    _, client = _client("qwen3", "Paris.")
    with client:
        msg = client.post("/v1/chat/completions",
                          json={**CHAT, "max_tokens": 6}).json()["choices"][0]["message"]
    assert msg["reasoning_content"] is None and msg["content"] == "Paris."


def test_reasoning_before_a_tool_call_is_split_and_the_call_parsed():
    call = '<tool_call>\n{"name": "capital", "arguments": {"country": "France"}}\n</tool_call>'
    reply = "<think>I should call the tool.</think>\n" + call
    tools = [{"type": "function", "function": {
        "name": "capital", "parameters": {"type": "object",
                                          "properties": {"country": {"type": "string"}}}}}]
    _, client = _client("qwen3", reply)
    with client:
        body = {**CHAT, "max_tokens": len(reply), "tools": tools}
        choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert choice["message"]["reasoning_content"] == "I should call the tool."
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["tool_calls"][0]["function"]["name"] == "capital"
        r = client.post("/v1/chat/completions", json={**body, "stream": True})
    events = [e for e in sse_events(r) if e["choices"]]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "I should call the tool."
    assert any("tool_calls" in d for d in deltas)
    assert not "".join(d.get("content") or "" for d in deltas).strip()
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("extra", [
    {"response_format": {"type": "json_object"}},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
     "tool_choice": "required"},
])
def test_a_grammar_constrains_the_answer_after_the_reasoning(extra):
    """response_format and forced tool calls: the request's grammar becomes a structural tag
    that leaves a <think> block free and constrains what follows (compiled with xgrammar)."""
    import xgrammar as xgr

    from radixserve.server import openai_api, requests as R

    engine, _ = _client("qwen3")
    body = {**CHAT, **extra}
    req = R.parse_chat_request(body)
    openai_api._chat_tools(engine, body, req)
    before = req.sampling.grammar_key
    assert openai_api._apply_reasoning_parser(engine, req) == "qwen3"
    kind, spec = req.sampling.grammar_key
    assert kind == "structural_tag" and spec != before[1]
    grammar = xgr.Grammar.from_structural_tag(spec)
    answer = ('{"x": 1}' if "response_format" in extra
              else '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>')
    for text, ok in ((answer, True), ("<think>\nfirst this\n</think>\n\n" + answer, True),
                     ("<think>no answer</think>\n\nplain words", False), ("plain words", False)):
        assert xgr.testing._is_grammar_accept_string(grammar, text) is ok, text
    # separate_reasoning false: no split, the grammar as it was
    req = R.parse_chat_request({**body, "separate_reasoning": False})
    openai_api._chat_tools(engine, body, req)
    key = req.sampling.grammar_key
    assert openai_api._apply_reasoning_parser(engine, req) is None and req.sampling.grammar_key == key


def test_a_structural_tag_of_the_older_form_is_left_unsplit():
    from radixserve.server import openai_api, requests as R

    engine, _ = _client("qwen3")
    old = {"type": "structural_tag", "structures": [], "triggers": []}
    req = R.parse_chat_request({**CHAT, "structural_tag": old})
    key = req.sampling.grammar_key
    assert openai_api._apply_reasoning_parser(engine, req) is None and req.sampling.grammar_key == key


def test_chat_template_kwargs_reach_the_template():
    engine, client = _client("none")
    with client:
        r = client.post("/v1/chat/completions",
                        json={**CHAT, "max_tokens": 1,
                              "chat_template_kwargs": {"enable_thinking": False, "tier": 2}})
        assert r.status_code == 200, r.text
        prompt = bytes(engine.seen[-1].input_ids).decode()
        assert prompt.startswith("<enable_thinking=False><tier=2><user>")


@pytest.mark.parametrize("kwargs, needle", [
    ({"messages": []}, "'messages'"),
    ({"render_limits": 1}, "'render_limits'"),
    ({"_guard": 1}, "chat_template_kwargs"),
    ({"x" * 65: 1}, "chat_template_kwargs"),
    ({f"k{i}": i for i in range(33)}, "chat_template_kwargs"),
    ([1], "chat_template_kwargs"),
])
def test_chat_template_kwargs_that_would_shadow_or_overflow_are_400s(kwargs, needle):
    _, client = _client("none")
    with client:
        r = client.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": kwargs})
    body = err_of(r, 400)
    assert needle in body["message"] and body["param"].startswith("chat_template_kwargs")


# --------------------------------------------------------------------------- /v1/responses

def _sdk_events(r):
    """The stream's events, each parsed by the openai client's own event types (what
    client.responses.create(stream=True) yields), and the raw dicts."""
    import json

    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    adapter = TypeAdapter(ResponseStreamEvent)
    raw = [json.loads(part.split("\n")[1][len("data: "):])
           for part in r.content.decode().split("\n\n")[:-1]]
    return [adapter.validate_python(e) for e in raw], raw


def test_responses_put_the_reasoning_in_a_reasoning_item():
    engine, client = _client("qwen3")
    with client:
        body = {"input": "Capital of France?", "max_output_tokens": len(THOUGHT)}
        resp = client.post("/v1/responses", json=body).json()
        reasoning, message = resp["output"]
        tagged = "<think>The user wants a capital.\nFrance -> Paris.</think>"
        assert resp["usage"]["output_tokens_details"] == {"reasoning_tokens": len(tagged)}
        assert reasoning["type"] == "reasoning" and reasoning["summary"] == []
        assert reasoning["content"] == [{"type": "reasoning_text",
                                         "text": "The user wants a capital.\nFrance -> Paris."}]
        assert message["type"] == "message" and message["content"][0]["text"] == "Paris."
        # the follow-up carries the answer, not the reasoning
        client.post("/v1/responses", json={**body, "input": "And Spain?",
                                           "previous_response_id": resp["id"]})
        prompt = bytes(engine.seen[-1].input_ids).decode()
        assert "<assistant>Paris.<user>And Spain?" in prompt and "capital" not in prompt

        r = client.post("/v1/responses", json={**body, "stream": True})
    events, raw = _sdk_events(r)
    types = [e.type for e in events]
    item_events = ["response.output_item.added", "response.content_part.added"]
    done = ["response.content_part.done", "response.output_item.done"]
    n_reasoning = types.count("response.reasoning_text.delta")
    n_text = types.count("response.output_text.delta")
    assert types == (["response.created", "response.in_progress"] + item_events
                     + ["response.reasoning_text.delta"] * n_reasoning
                     + ["response.reasoning_text.done"] + done + item_events
                     + ["response.output_text.delta"] * n_text
                     + ["response.output_text.done"] + done + ["response.incomplete"])
    final = raw[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["reasoning", "message"]
    deltas = {k: "".join(e["delta"] for e in raw if e["type"] == f"response.{k}.delta")
              for k in ("reasoning_text", "output_text")}
    assert deltas == {"reasoning_text": final["output"][0]["content"][0]["text"],
                      "output_text": "Paris."}
    # the items' ids and indexes agree with the final output
    for e in raw:
        if "item_id" in e:
            item = final["output"][e["output_index"]]
            assert e["item_id"] == item["id"]


@pytest.mark.parametrize("reply, kinds", [
    ("Paris.", ["message"]),                               # qwen3 without <think>
    ("<think>\n\n</think>\n\nParis.", ["reasoning", "message"]),   # an empty block
    ("<think>still thinking", ["reasoning", "message"]),  # cut inside the reasoning
])
def test_responses_stream_announces_the_items_of_the_final_output(reply, kinds):
    _, client = _client("qwen3", reply)
    with client:
        r = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": len(reply),
                                               "stream": True})
    events, raw = _sdk_events(r)
    added = [e["item"]["type"] for e in raw if e["type"] == "response.output_item.added"]
    final = raw[-1]["response"]
    assert added == kinds == [i["type"] for i in final["output"]]
    done = [e["item"] for e in raw if e["type"] == "response.output_item.done"]
    assert done == final["output"]


# --------------------------------------------------------------------------- the real model

@pytest.fixture(scope="module")
def qwen3_parser_client(default_model_path):
    """The app over an AsyncEngine on the default model with --reasoning-parser qwen3."""
    from radixserve.config import ServerArgs
    from radixserve.engine.async_engine import AsyncEngine

    engine = AsyncEngine(ServerArgs(model_path=default_model_path, device="cpu",
                                    reasoning_parser="qwen3", max_total_tokens=4096,
                                    context_length=1024, max_running_requests=4))
    with TestClient(create_app(engine), base_url=LOCAL, raise_server_exceptions=False) as client:
        yield client


@pytest.mark.parametrize("stream", [False, True])
def test_json_answer_after_optional_reasoning_on_the_default_model(qwen3_parser_client, stream):
    """The wrapped grammar compiles against the real tokenizer and the answer it leaves is
    JSON of the schema (the model may open a <think> block first; its reasoning is split)."""
    import json

    import jsonschema

    schema = {"type": "object", "properties": {"answer": {"type": "integer"}},
              "required": ["answer"], "additionalProperties": False}
    body = {"messages": [{"role": "user", "content": "What is 2 plus 3? Reply in JSON."}],
            "temperature": 0, "max_tokens": 64, "stream": stream,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "sum", "schema": schema}}}
    r = qwen3_parser_client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if stream:
        chunks = [e["choices"][0] for e in sse_events(r) if e["choices"]]
        content = "".join(c["delta"].get("content") or "" for c in chunks)
        reasoning = "".join(c["delta"].get("reasoning_content") or "" for c in chunks)
        finish = chunks[-1]["finish_reason"]
    else:
        choice = r.json()["choices"][0]
        content, finish = choice["message"]["content"], choice["finish_reason"]
        reasoning = choice["message"]["reasoning_content"] or ""
    assert finish == "stop", (content, reasoning)
    jsonschema.validate(json.loads(content), schema)
    assert "<think>" not in content


@pytest.mark.parametrize("extra, param", [
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}},
     "response_format"),
])
def test_a_bad_grammar_under_the_wrap_names_the_clients_field(qwen3_parser_client, extra, param):
    r = qwen3_parser_client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra})
    body = err_of(r, 400, param)
    assert body["message"]
