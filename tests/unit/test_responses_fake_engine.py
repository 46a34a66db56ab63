"""/v1/responses over the fake engine (no model): the bounded, per-client ResponseStore; the
Response object and the typed SSE event sequence; previous_response_id conversations (the
instructions stay with their request); per-client isolation of stored responses; errors
before the stream (400 naming each unsupported field, 404s) and in-band after it (error +
response.failed); the OpenAPI document agreeing with the parser and with what is sent."""
import json

import jsonschema
import pytest
from referencing import Registry
from referencing.jsonschema import DRAFT202012
from starlette.testclient import TestClient

from radixserve.errors import ApiError
from radixserve.server import schemas as S
from radixserve.server.app import create_app
from radixserve.server.openapi import openapi_document
from radixserve.server.responses_api import ResponseStore
from radixserve.server.responses_schemas import ResponseCreateRequest

from test_server_fake_engine import LOCAL, REPLY, FakeEngine, err_of

DOC = openapi_document(api_key=False)
STREAM_TYPES = ["response.created", "response.in_progress", "response.output_item.added",
                "response.content_part.added"]
DONE_TYPES = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def _validator(name):
    registry = Registry().with_resource("urn:doc", DRAFT202012.create_resource(DOC))
    return jsonschema.Draft202012Validator({"$ref": f"urn:doc#/components/schemas/{name}"},
                                           registry=registry)


@pytest.fixture()
def engine():
    return FakeEngine()


@pytest.fixture()
def app(engine):
    return create_app(engine)


@pytest.fixture()
def client(app):
    with TestClient(app, base_url=LOCAL, raise_server_exceptions=False) as c:
        yield c


def events_of(resp):
    """The typed events of an SSE body: `event: <type>` + `data: <json>` each, no [DONE]."""
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    parts = resp.content.decode().split("\n\n")
    assert parts[-1] == ""
    events = []
    for part in parts[:-1]:
        event_line, data_line = part.split("\n")
        data = json.loads(data_line[len("data: "):])
        assert event_line == f"event: {data['type']}"
        events.append(data)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


# --------------------------------------------------------------------------- the store

def _put(store, rid, owner="a", chars=1):
    return store.put(rid, owner, {"id": rid}, [{"role": "user", "content": "x"}], chars)


def test_store_keeps_the_most_recently_used_within_its_count():
    store = ResponseStore(max_responses=3, max_chars=1000)
    for rid in "abc":
        assert _put(store, rid)
    assert store.get("a", "a") is not None           # a is now the most recently used
    _put(store, "d")
    assert len(store) == 3 and store.get("b", "a") is None
    assert [r for r in "acd" if store.get(r, "a")] == ["a", "c", "d"]
    _put(store, "c")                                   # replacing does not grow it
    assert len(store) == 3 and store.chars == 3


def test_store_keeps_within_its_characters_and_refuses_a_giant():
    store = ResponseStore(max_responses=100, max_chars=10)
    _put(store, "a", chars=4)
    _put(store, "b", chars=4)
    _put(store, "c", chars=4)                          # 12 > 10: a goes
    assert store.get("a", "a") is None and store.chars == 8
    assert not _put(store, "huge", chars=11)
    assert store.get("huge", "a") is None and store.chars == 8
    assert store.delete("b", "a") and store.chars == 4 and not store.delete("b", "a")


def test_one_clients_many_responses_never_evict_anothers():
    """When the store is full, the client holding the most loses its least recently used
    response: a client storing 1,030 responses evicts only its own, the others keep theirs
    (by count, then by characters)."""
    store = ResponseStore(max_responses=1024, max_chars=1 << 30)
    for owner in ("bob", "carol"):
        for i in range(5):
            _put(store, f"{owner}-{i}", owner=owner)
    for i in range(1030):
        assert _put(store, f"mallory-{i}", owner="mallory")
    assert len(store) == 1024 and store.held_by("mallory") == 1014
    assert all(store.get(f"{o}-{i}", o) for o in ("bob", "carol") for i in range(5))
    assert store.get("mallory-15", "mallory") is None and store.get("mallory-16", "mallory")
    _put(store, "bob-5", owner="bob")              # full: the largest holder (mallory) pays
    assert store.held_by("bob") == 6 and store.held_by("mallory") == 1013
    assert store.get("mallory-17", "mallory") is None      # (16 was just read: used)
    # the characters: bob's one big response survives mallory's many small ones
    store = ResponseStore(max_responses=1000, max_chars=100)
    _put(store, "bob-big", owner="bob", chars=40)
    for i in range(50):
        assert _put(store, f"m-{i}", owner="mallory", chars=3)
    assert store.get("bob-big", "bob") and store.chars <= 100 and store.held_by("mallory") == 20
    _put(store, "bob-2", owner="bob", chars=30)    # now bob is the largest: bob's oldest goes
    assert store.get("bob-big", "bob") is None and store.held_by("mallory") == 20


def test_store_entries_belong_to_their_owner():
    store = ResponseStore()
    _put(store, "r", owner="alice")
    assert store.get("r", "bob") is None and not store.delete("r", "bob")
    assert store.get("r", "alice").response == {"id": "r"}
    assert store.delete("r", "alice") and store.get("r", "alice") is None


# --------------------------------------------------------------------------- create

def test_create_answers_a_response_object(client, engine):
    r = client.post("/v1/responses", json={"model": "fake", "input": "hi", "instructions": "be brief",
                                           "max_output_tokens": 5, "metadata": {"k": "v"},
                                           "user": "u1", "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert _validator("ResponseObject").is_valid(body)
    assert body["id"].startswith("resp_") and body["object"] == "response"
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert (body["instructions"], body["metadata"], body["user"], body["temperature"]) == \
        ("be brief", {"k": "v"}, "u1", 0.0)
    [message] = body["output"]
    assert message["id"].startswith("msg_") and message["role"] == "assistant"
    assert message["type"] == "message" and message["status"] == "incomplete"
    assert message["content"] == [{"type": "output_text", "text": REPLY[:5], "annotations": [],
                                   "logprobs": []}]
    prompt = bytes(engine.seen[-1].input_ids)
    assert prompt == b"<system>be brief<user>hi<assistant>"
    assert body["usage"] == {"input_tokens": len(prompt), "output_tokens": 5,
                             "total_tokens": len(prompt) + 5,
                             "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                             "output_tokens_details": {"reasoning_tokens": 0},
                             "prompt_tokens": len(prompt), "completion_tokens": 5}   # SGLang's names
    assert engine.seen[-1].rid == body["id"]


def test_input_items_become_chat_messages(client, engine):
    items = [{"role": "developer", "content": "sys"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                            {"type": "input_text", "text": "b"}]},
             {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
              "content": [{"type": "output_text", "text": "c", "annotations": []}]}]
    r = client.post("/v1/responses", json={"input": items, "max_output_tokens": 2})
    assert r.status_code == 200, r.text
    assert bytes(engine.seen[-1].input_ids) == b"<system>sys<user>a\nb<assistant>c<assistant>"


def test_stream_sends_the_typed_event_sequence(client):
    r = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 6, "stream": True})
    events = events_of(r)
    types = [e["type"] for e in events]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert types == STREAM_TYPES + ["response.output_text.delta"] * len(deltas) + DONE_TYPES + \
        ["response.incomplete"]
    text = "".join(d["delta"] for d in deltas)
    assert text == REPLY[:6]
    created, final = events[0]["response"], events[-1]["response"]
    assert created["status"] == "in_progress" and created["output"] == [] and created["usage"] is None
    assert final["id"] == created["id"] and final["usage"]["output_tokens"] == 6
    assert final["output"][0]["content"][0]["text"] == text == events[-4]["text"]
    item_id = events[2]["item"]["id"]
    assert all(e["item_id"] == item_id for e in events if "item_id" in e)
    for e in events:
        assert _validator("ResponseStreamEvent").is_valid(e)
    # stored once finished: GET answers the final response
    assert client.get(f"/v1/responses/{final['id']}").json() == final


def test_stream_echoes_the_text_format(client):
    fmt = {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True}
    r = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 4, "stream": True,
                                           "text": {"format": fmt}})
    events = events_of(r)
    assert events[0]["response"]["text"] == events[-1]["response"]["text"] == {"format": fmt}


def test_previous_response_id_continues_the_conversation(client, engine):
    engine.context_len = 256
    first = client.post("/v1/responses", json={"input": "a", "instructions": "I1",
                                               "max_output_tokens": 3}).json()
    second = client.post("/v1/responses", json={"input": "b", "previous_response_id": first["id"],
                                                "max_output_tokens": 2}).json()
    assert bytes(engine.seen[-1].input_ids) == b"<user>a<assistant>Par<user>b<assistant>"
    assert second["previous_response_id"] == first["id"] and second["instructions"] is None
    third = client.post("/v1/responses", json={"input": "c", "previous_response_id": second["id"],
                                               "instructions": "I3", "max_output_tokens": 1})
    assert third.status_code == 200, third.text
    assert bytes(engine.seen[-1].input_ids) == \
        b"<system>I3<user>a<assistant>Par<user>b<assistant>Pa<user>c<assistant>"


def test_store_false_and_delete(client):
    kept = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 1}).json()
    unkept = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 1,
                                                 "store": False}).json()
    assert unkept["store"] is False and kept["store"] is True
    err_of(client.get(f"/v1/responses/{unkept['id']}"), 404, "response_id")
    err_of(client.post("/v1/responses", json={"input": "x", "previous_response_id": unkept["id"]}),
           404, "previous_response_id")
    assert client.get(f"/v1/responses/{kept['id']}").json() == kept
    deleted = client.delete(f"/v1/responses/{kept['id']}")
    assert deleted.json() == {"id": kept["id"], "object": "response", "deleted": True}
    assert _validator("ResponseDeleted").is_valid(deleted.json())
    err_of(client.get(f"/v1/responses/{kept['id']}"), 404, "response_id")
    err_of(client.delete(f"/v1/responses/{kept['id']}"), 404, "response_id")
    err_of(client.get(f"/v1/responses/{kept['id']}?stream=true"), 400, "stream")


def test_stored_responses_are_visible_only_to_their_client(app):
    with TestClient(app, base_url=LOCAL, client=("10.0.0.1", 1000)) as alice:
        bob = TestClient(app, base_url=LOCAL, client=("10.0.0.2", 1000))
        mine = alice.post("/v1/responses", json={"input": "hi", "max_output_tokens": 1}).json()
        err_of(bob.get(f"/v1/responses/{mine['id']}"), 404)
        err_of(bob.delete(f"/v1/responses/{mine['id']}"), 404)
        err_of(bob.post("/v1/responses", json={"input": "x", "previous_response_id": mine["id"]}), 404)
        assert alice.get(f"/v1/responses/{mine['id']}").status_code == 200


def test_stored_responses_belong_to_the_api_key_not_the_address(engine):
    """With several keys, each key's client has its own stored responses even from one
    address (one proxy in front, or one machine): no key reads, continues or deletes
    another's."""
    from radixserve.config import ServerArgs
    engine.server_args = ServerArgs(model_path="/models/fake", api_key=["sk-a", "sk-b"])
    with TestClient(create_app(engine), base_url=LOCAL, client=("10.0.0.1", 1)) as c:
        a, b = ({"Authorization": f"Bearer {k}"} for k in ("sk-a", "sk-b"))
        mine = c.post("/v1/responses", json={"input": "hi", "max_output_tokens": 1}, headers=a).json()
        err_of(c.get(f"/v1/responses/{mine['id']}", headers=b), 404)
        err_of(c.delete(f"/v1/responses/{mine['id']}", headers=b), 404)
        err_of(c.post("/v1/responses", json={"input": "x", "previous_response_id": mine["id"]},
                      headers=b), 404)
        assert c.get(f"/v1/responses/{mine['id']}", headers=a).status_code == 200


# --------------------------------------------------------------------------- errors

@pytest.mark.parametrize("field, value", [
    ("tools", [{"type": "function", "name": "f", "parameters": {}}]),
    ("tool_choice", "required"),
    ("tool_choice", {"type": "function", "name": "f"}),
    ("reasoning", {"effort": "low"}),
    ("background", True),
    ("include", ["message.output_text.logprobs"]),
    ("truncation", "auto"),
    ("top_logprobs", 2),
    ("n", 2),
    ("conversation", "conv_1"),
    ("prompt", {"id": "pmpt_1"}),
    ("context_management", [{"type": "compaction"}]),
    ("moderation", {"model": "omni-moderation-latest"}),
])
def test_unsupported_fields_are_400s_naming_them(client, field, value):
    body = err_of(client.post("/v1/responses", json={"input": "hi", field: value}), 400, field)
    assert field in body["message"]


@pytest.mark.parametrize("item, param", [
    ({"type": "function_call_output", "call_id": "c", "output": "x"}, "input[0].type"),
    ({"type": "item_reference", "id": "msg_1"}, "input[0].type"),
    ({"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]},
     "input[0].content[0].type"),
    ({"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}, "input[0].content[0].type"),
    ({"role": "tool", "content": "x"}, "input[0].role"),
])
def test_non_text_input_is_a_400_naming_the_item(client, item, param):
    err_of(client.post("/v1/responses", json={"input": [item]}), 400, param)


def test_neutral_values_of_unsupported_fields_pass(client):
    r = client.post("/v1/responses", json={
        "input": "hi", "max_output_tokens": 1, "tools": [], "tool_choice": "none", "reasoning": None,
        "background": False, "include": [], "truncation": "disabled", "top_logprobs": 0, "n": 1,
        "parallel_tool_calls": False, "service_tier": "auto", "prompt_cache_key": "k",
        "safety_identifier": "s", "stream_options": {"include_obfuscation": False},
        "text": {"verbosity": "low"}})
    assert r.status_code == 200, r.text
    assert r.json()["tool_choice"] == "none" and r.json()["parallel_tool_calls"] is False


def test_an_unknown_field_is_a_400_naming_it(client):
    err_of(client.post("/v1/responses", json={"input": "hi", "something_new": 1}), 400,
           "something_new")


def test_request_errors_before_the_stream(client):
    err_of(client.post("/v1/responses", json={"input": "hi", "model": "gpt-4o"}), 404, "model")
    err_of(client.post("/v1/responses", json={"input": "hi", "previous_response_id": "resp_nope",
                                              "stream": True}), 404, "previous_response_id")
    err_of(client.post("/v1/responses", json={"input": "x" * 100}), 400, "input")
    err_of(client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 60}), 400,
           "max_output_tokens")
    err_of(client.post("/v1/responses", json={"input": "hi", "text": {"format": {
        "type": "json_schema", "name": "x"}}}), 400, "text.format.schema")
    err_of(client.post("/v1/responses", json={"input": "hi", "temperature": 1e-9}), 400, "temperature")
    err_of(client.post("/v1/responses", json={"input": "BADTEMPLATE"}), 400, "input")
    err_of(client.post("/v1/responses", json={}), 400, "input")
    err_of(client.post("/v1/responses", json={"input": "hi", "instructions": 3}), 400, "instructions")


@pytest.mark.parametrize("trigger, code", [("BOOM", "server_error"), ("ABORTME", "server_error")])
def test_errors_after_the_headers_are_in_band(client, trigger, code):
    r = client.post("/v1/responses", json={"input": trigger, "stream": True, "max_output_tokens": 8})
    events = events_of(r)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    error, failed = events[-2], events[-1]["response"]
    assert error["code"] == code and error["message"]
    assert failed["status"] == "failed" and failed["error"] == {"code": code, "message": error["message"]}
    for e in events:
        assert _validator("ResponseStreamEvent").is_valid(e)
    err_of(client.get(f"/v1/responses/{failed['id']}"), 404)         # a failed one is not stored


# --------------------------------------------------------------------------- the document

@pytest.mark.parametrize("body, valid", [
    ({"input": "hi"}, True),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}]}]}, True),
    ({"input": []}, False),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, False),
    ({"input": "hi", "tools": []}, True),
    ({"input": "hi", "tools": [{"type": "function"}]}, False),
    ({"input": "hi", "background": False}, True),
    ({"input": "hi", "background": True}, False),
    ({"input": "hi", "truncation": "auto"}, False),
    ({"input": "hi", "conversation": "c"}, False),
    ({"input": "hi", "reasoning": {"effort": None}}, True),
    ({"input": "hi", "reasoning": {"effort": "high"}}, False),
    ({"input": "hi", "metadata": {"k": "v" * 513}}, False),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "n", "schema": {}}}}, True),
    ({"input": "hi", "max_output_tokens": -1}, False),
])
def test_request_schema_agrees_with_the_parser(body, valid):
    assert _validator("ResponseCreateRequest").is_valid(body) is valid
    if valid:
        S.parse(ResponseCreateRequest, body)
    else:
        with pytest.raises(ApiError) as info:
            S.parse(ResponseCreateRequest, body)
        assert info.value.status == 400


def test_routes_are_documented():
    assert set(DOC["paths"]["/v1/responses"]) == {"post"}
    assert set(DOC["paths"]["/v1/responses/{response_id}"]) == {"get", "delete"}
    assert "404" in DOC["paths"]["/v1/responses"]["post"]["responses"]
