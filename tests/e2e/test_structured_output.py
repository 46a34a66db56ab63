"""Structured output over HTTP on the default model: response_format (json_schema, json_object)
through the official openai client, streamed and not; native json_schema / regex / ebnf and
the vLLM-style guided_* extras; tool calls for every tool_choice, streamed and not; bad
grammars and logit_bias are 400s naming the field and leave other requests alone."""
import asyncio
import json
import re

import httpx
import jsonschema
import pytest

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "languages": {"type": "array", "items": {"enum": ["en", "fr", "de"]}, "minItems": 1,
                  "maxItems": 3}},
    "required": ["name", "age", "languages"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
WEATHER_Q = [{"role": "user", "content": "What is the weather in Paris?"}]


def _rf(schema):
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema,
                                                   "strict": True}}


def test_response_format_json_schema(oai, server):
    r = oai.chat.completions.create(model=server.model, messages=ASK, temperature=0.7, seed=3,
                                    max_tokens=120, n=2, response_format=_rf(PERSON))
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), PERSON)


def test_response_format_json_schema_streamed(oai, server):
    text = ""
    for chunk in oai.chat.completions.create(model=server.model, messages=ASK, temperature=0,
                                             max_tokens=120, stream=True,
                                             response_format=_rf(PERSON)):
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    jsonschema.validate(json.loads(text), PERSON)


def test_json_object_mode(oai, server):
    ask = [{"role": "user", "content": "Reply with a JSON object with keys name and city."}]
    r = oai.chat.completions.create(model=server.model, messages=ask, temperature=0,
                                    max_tokens=150, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_completions_with_guided_extras(http):
    r = http.post("/v1/completions", json={"prompt": "My phone number is", "max_tokens": 30,
                                           "temperature": 1.0, "seed": 5, "n": 3,
                                           "guided_regex": r"\d{3}-\d{3}-\d{4}"})
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        assert re.fullmatch(r"\d{3}-\d{3}-\d{4}", c["text"]), c["text"]
    r = http.post("/v1/completions", json={"prompt": "Pick a color:", "max_tokens": 10,
                                           "guided_choice": ["red", "green", "blue (dark)"]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] in ("red", "green", "blue (dark)")


def test_native_grammars_streamed_ids_match_text(http, default_tokenizer):
    ebnf = 'root ::= "The answer is " ("yes" | "no") "."'
    for sp in ({"json_schema": json.dumps(PERSON)}, {"regex": r"(19|20)\d{2}-\d{2}-\d{2}"},
               {"ebnf": ebnf}):
        body = {"text": "Answer:", "stream": True,
                "sampling_params": {"max_new_tokens": 120, "temperature": 0, **sp}}
        last = None
        with http.stream("POST", "/generate", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    last = json.loads(line[6:])
        text = last["text"]
        assert last["meta_info"]["finish_reason"]["type"] == "stop", last
        if "json_schema" in sp:
            jsonschema.validate(json.loads(text), PERSON)
        elif "regex" in sp:
            assert re.fullmatch(sp["regex"], text)
        else:
            assert re.fullmatch(r"The answer is (yes|no)\.", text)
        # jump-forward rewrites streamed ids at the seam: the cumulative ids still spell the text
        assert default_tokenizer.decode(last["output_ids"]) == text


def _tool_chat(oai, server, choice, stream):
    kw = dict(model=server.model, messages=WEATHER_Q, tools=[WEATHER, ADD], tool_choice=choice,
              temperature=0, max_tokens=120)
    if not stream:
        r = oai.chat.completions.create(**kw)
        return r.choices[0].message, r.choices[0].finish_reason
    calls, content, finish = {}, "", None
    for chunk in oai.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        content += c.delta.content or ""
        for tc in c.delta.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            slot["id"] = tc.id or slot["id"]
            if tc.function is not None:
                slot["name"] += tc.function.name or ""
                slot["arguments"] += tc.function.arguments or ""
        finish = c.finish_reason or finish
    return {"content": content, "calls": [calls[i] for i in sorted(calls)]}, finish


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_forced_tool_calls_parse_and_validate(oai, server, choice, stream):
    msg, finish = _tool_chat(oai, server, choice, stream)
    assert finish == "tool_calls"
    calls = msg["calls"] if stream else [{"id": c.id, "name": c.function.name,
                                          "arguments": c.function.arguments}
                                         for c in msg.tool_calls]
    assert len(calls) == 1 and calls[0]["id"]
    want = "add" if isinstance(choice, dict) else None
    call = calls[0]
    assert call["name"] in ("get_weather", "add") and (want is None or call["name"] == want)
    schema = (ADD if call["name"] == "add" else WEATHER)["function"]["parameters"]
    jsonschema.validate(json.loads(call["arguments"]), schema)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_none_and_auto(oai, server, stream):
    msg, finish = _tool_chat(oai, server, "none", stream)
    content = msg["content"] if stream else msg.content
    calls = msg["calls"] if stream else (msg.tool_calls or [])
    assert not calls and finish in ("stop", "length") and content
    msg, finish = _tool_chat(oai, server, "auto", stream)
    calls = msg["calls"] if stream else (msg.tool_calls or [])
    if calls:                         # the model chose to call: then it parses and validates
        assert finish == "tool_calls"
        for c in calls:
            name = c["name"] if stream else c.function.name
            args = c["arguments"] if stream else c.function.arguments
            schema = (ADD if name == "add" else WEATHER)["function"]["parameters"]
            jsonschema.validate(json.loads(args), schema)
    else:
        assert finish in ("stop", "length")


def test_tool_results_render_in_the_next_turn(oai, server):
    first = oai.chat.completions.create(model=server.model, messages=WEATHER_Q, tools=[WEATHER],
                                        tool_choice="required", temperature=0, max_tokens=100)
    call = first.choices[0].message.tool_calls[0]
    messages = WEATHER_Q + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    r = oai.chat.completions.create(model=server.model, messages=messages, tools=[WEATHER],
                                    temperature=0, max_tokens=30)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > first.usage.prompt_tokens


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(unclosed"}}}}}},
     "response_format"),
    ({"regex": "a(b"}, "regex"),
    ({"ebnf": "root ::= undefined_rule"}, "ebnf"),
    ({"logit_bias": {"99999999": 5}}, "logit_bias"),
])
def test_bad_grammars_are_400s_and_leave_others_alone(server, body, param):
    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            good = client.post("/v1/chat/completions", json={
                "messages": ASK, "max_tokens": 80, "temperature": 0, "response_format": _rf(PERSON)})
            bad = client.post("/v1/chat/completions", json={
                "messages": ASK, "max_tokens": 8, **body})
            return await asyncio.gather(good, bad)

    good, bad = asyncio.run(scenario())
    assert bad.status_code == 400, bad.text
    err = bad.json()["error"]
    assert err["param"] == param and err["message"]
    assert good.status_code == 200
    jsonschema.validate(json.loads(good.json()["choices"][0]["message"]["content"]), PERSON)
    server.wait_idle()
    assert server.metric("num_used_tokens") == 0
