"""The OpenAPI document at /openapi.json: it lists every route the app serves with the methods
it takes, declares Bearer security exactly when --api-key is set, its schemas are valid JSON
Schema, the request models' schemas agree with what the parsers accept, and what the
response builders produce validates against the documented response schemas. Then a short
schemathesis run against the app over the fake engine (no server, no model)."""
import json

import jsonschema
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from referencing import Registry
from referencing.jsonschema import DRAFT202012
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                               status_code_conformance)
from starlette.routing import Route
from starlette.testclient import TestClient

from radixserve.config import ServerArgs
from radixserve.engine.io import GenerateOutput
from radixserve.errors import ApiError
from radixserve.server import render as O, requests as R
from radixserve.server.app import create_app
from radixserve.server.openapi import openapi_document

from test_server_fake_engine import LOCAL, FakeEngine

DOC = openapi_document(api_key=False)


def _validator(name: str):
    """A validator for components.schemas[name], resolving the document's $refs."""
    registry = Registry().with_resource("urn:doc", DRAFT202012.create_resource(DOC))
    schema = {"$ref": f"urn:doc#/components/schemas/{name}"}
    return jsonschema.Draft202012Validator(schema, registry=registry)


def test_every_route_is_documented_with_its_methods():
    app = create_app(FakeEngine())
    served = {}
    for route in app.routes:
        if isinstance(route, Route):
            path = route.path.replace("{model_id:path}", "{model_id}")
            served[path] = {m.lower() for m in route.methods if m != "HEAD"}
    documented = {path: set(item) for path, item in DOC["paths"].items()}
    assert documented == served


def test_security_follows_the_api_key():
    assert "security" not in DOC and "securitySchemes" not in DOC["components"]
    assert all("401" not in op["responses"] for item in DOC["paths"].values() for op in item.values())
    locked = openapi_document(api_key=True)
    assert locked["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    assert locked["security"] == [{"bearer": []}]
    assert locked["paths"]["/health"]["get"]["security"] == []
    assert "401" in locked["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert "401" not in locked["paths"]["/health"]["get"]["responses"]


def test_served_document_matches_and_schemas_are_valid_json_schema():
    engine = FakeEngine()
    engine.server_args = ServerArgs(model_path="/models/fake", api_key="k")
    with TestClient(create_app(engine), base_url=LOCAL) as client:
        assert client.get("/openapi.json").status_code == 401          # behind the key
        r = client.get("/openapi.json", headers={"Authorization": "Bearer k"})
    assert r.status_code == 200 and r.json()["security"] == [{"bearer": []}]
    assert r.json()["openapi"] == "3.1.0"
    for name, schema in DOC["components"]["schemas"].items():
        jsonschema.Draft202012Validator.check_schema(schema)
    for status in ("400", "413", "415", "503"):
        assert DOC["paths"]["/generate"]["post"]["responses"][status]["content"]["application/json"][
            "schema"] == {"$ref": "#/components/schemas/ErrorResponse"}


@pytest.mark.parametrize("model, body, valid", [
    ("ChatCompletionRequest", {"messages": [{"role": "user", "content": "hi"}], "n": 128}, True),
    ("ChatCompletionRequest", {"messages": [{"role": "user", "content": "hi"}], "n": 129}, False),
    ("ChatCompletionRequest", {"messages": [{"role": "user", "content": "hi"}], "temperature": 1e-6}, False),
    ("ChatCompletionRequest", {"messages": [{"role": "user", "content": "hi"}], "temperature": 0}, True),
    ("ChatCompletionRequest", {"messages": [{"role": "tool"}]}, False),
    ("ChatCompletionRequest", {"messages": [{"role": "assistant", "tool_calls": [{}]}]}, True),
    ("ChatCompletionRequest", {"messages": [{"role": "user", "content": "x"}],
                               "seed": 2 ** 63}, False),
    ("ChatCompletionRequest", {"messages": [{"role": "user", "content": "x"}],
                               "logit_bias": {"12": 3}}, True),
    ("ChatCompletionRequest", {"messages": [{"role": "user", "content": "x"}],
                               "logit_bias": {"a": 3}}, False),
    ("CompletionRequest", {"prompt": [[1, 2], [3]]}, True),
    ("CompletionRequest", {"prompt": [1, "a"]}, False),
    ("CompletionRequest", {"prompt": "x", "suffix": "y"}, False),
    ("GenerateRequest", {"text": "x", "sampling_params": {"temprature": 1}}, False),
    ("GenerateRequest", {"text": "x", "sampling_params": [{"top_k": 5}]}, True),
    ("GenerateRequest", {"sampling_params": {}}, False),
    ("GenerateRequest", {"text": "x", "input_ids": [1]}, False),
    ("AbortRequest", {"rid": ""}, False),
])
def test_request_schemas_agree_with_the_parsers(model, body, valid):
    """A body the document calls valid passes the model; one it calls invalid is a 400."""
    assert _validator(model).is_valid(body) is valid
    parse = {"ChatCompletionRequest": R.parse_chat_request, "CompletionRequest": R.parse_completion_request,
             "GenerateRequest": R.parse_generate_request, "AbortRequest": R.parse_abort_request}[model]
    if valid:
        parse(body)
    else:
        with pytest.raises(ApiError) as info:
            parse(body)
        assert info.value.status == 400


def _result():
    r = O.SeqResult(0, [1, 2])
    r.feed(GenerateOutput(rid="r", text_delta="hi", output_ids_delta=[4, 5], finished=True,
                          finish_reason={"type": "stop", "matched": "!"}, prompt_tokens=2,
                          completion_tokens=2, output_token_logprobs_delta=[(-1.0, 4, "h"), (-2.0, 5, "i")],
                          output_top_logprobs_delta=[[(-1.0, 4, "h")], [(-2.0, 5, "i")]]))
    return r


def test_response_builders_match_the_documented_schemas():
    r, text = _result(), lambda i: "t"
    cases = [
        ("ChatCompletion", O.chat_response("id", 1, "m", [r], 1, True, 1, text)),
        ("ChatCompletionChunk", O.chat_chunk("id", 1, "m", 0, {"content": "x"}, "stop", usage_null=True)),
        ("ChatCompletionChunk", O.usage_chunk("id", "chat.completion.chunk", 1, "m", O.usage_dict([r], 1))),
        ("TextCompletion", O.completion_response("id", 1, "m", [O.completion_choice(r, "", 1, text)], [r], 1)),
        ("TextCompletionChunk", O.completion_chunk("id", 1, "m", 0, "t", None)),
        ("GenerateResult", O.native_result(r, "rid", True)),
        ("GenerateResult", {**O.native_result(O.SeqResult(0, [1]), "rid", False), "index": 3}),
        ("ErrorResponse", ApiError("bad", 400, "n").body()),
        ("ErrorResponse", ApiError("gone", 503).body()),
    ]
    for name, body in cases:
        errors = list(_validator(name).iter_errors(json.loads(json.dumps(body))))
        assert not errors, (name, [e.message for e in errors])
    assert not _validator("ChatCompletion").is_valid({"id": "x"})            # the check can fail


@pytest.fixture(scope="module")
def asgi_schema():
    engine = FakeEngine()      # schemathesis's ASGI client sends Host: testserver
    engine.server_args = ServerArgs(model_path="/models/fake", allowed_hosts="testserver")
    schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(engine))
    return schema


CASES = [(path, method.upper()) for path, item in DOC["paths"].items() for method in item]


@pytest.mark.parametrize("path, method", CASES)
def test_schemathesis_over_the_fake_engine(asgi_schema, path, method):
    """A few schema-driven requests per operation straight into the app: no 5xx, and every
    response (statuses, media types, bodies, SSE events) as documented."""
    operation = asgi_schema[path][method]
    modes = [schemathesis.GenerationMode.POSITIVE]
    if "requestBody" in DOC["paths"][path][method.lower()]:
        modes.append(schemathesis.GenerationMode.NEGATIVE)
    for mode in modes:
        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=15, deadline=None, derandomize=True, database=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        def fuzz(case):
            case.call_and_validate(checks=[not_a_server_error, status_code_conformance,
                                           content_type_conformance, response_schema_conformance])
        fuzz()


def test_the_dashboard_routes_are_documented_exactly_when_served():
    from radixserve.server import dashboard as D
    engine = FakeEngine()
    engine.server_args = ServerArgs(model_path="/models/fake", enable_dashboard=True)
    app = create_app(engine)
    served = {route.path for route in app.routes if isinstance(route, Route)}
    doc = openapi_document(api_key=False, dashboard=True)
    assert {p for p in doc["paths"] if p.startswith("/dashboard")} == \
        {p for p in served if p.startswith("/dashboard")} == {path for path, _ in D.ROUTES}
    assert not any(p.startswith("/dashboard") for p in DOC["paths"])
    data = doc["paths"]["/dashboard/data"]["get"]
    assert {p["name"]: (p["schema"]["type"], p["schema"]["maximum"]) for p in data["parameters"]} \
        == {"window": ("integer", D.HISTORY_SAMPLES * D.SAMPLE_INTERVAL_S),
            "since": ("number", 1e12), "tree_since": ("number", 1e12)}
    # with an admin key the dashboard takes only that key, as /metrics does
    locked = openapi_document(api_key=True, admin_key=True, dashboard=True)
    for path in ("/dashboard", "/dashboard/advice", "/metrics"):
        assert locked["paths"][path]["get"]["security"] == [{"bearer": []}]
    assert "security" not in locked["paths"]["/v1/completions"]["post"]
    with TestClient(app, base_url=LOCAL) as client:
        served_doc = client.get("/openapi.json").json()
    assert "/dashboard/advice" in served_doc["paths"]
