"""Issue 36 point 3, validate once: the sampling numbers' bounds live in one table
(sampling/params.BOUNDS) that the request schema reads; a request's temperature passes through
the one check (params.number_problem) once, its SamplingParams are verified once, its prompt's
ids are scanned and the context-length rule applied once (engine/validation.check_prompt), and
the engine validates each sequence once, on the HTTP routes and the offline Engine alike; errors
carry their field as data (RequestError.param), never read back out of the message."""
from collections import Counter

import pytest
from starlette.testclient import TestClient

from radixserve.engine import validation
from radixserve.errors import ApiError, RequestError
from radixserve.sampling import params as sp_module
from radixserve.sampling.params import BOUNDS, SamplingParams
from radixserve.server import requests as R
from radixserve.server import schemas as S
from radixserve.server.app import create_app

from test_server_fake_engine import LOCAL, FakeEngine, err_of, sse_events

CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture()
def counts(monkeypatch):
    """Calls to the one number check (by field), to SamplingParams.verify and to check_prompt."""
    seen = Counter()
    number_problem, verify, check_prompt = (sp_module.number_problem, SamplingParams.verify,
                                            validation.check_prompt)

    def counted_number_problem(name, value):
        seen["number:" + name] += 1
        return number_problem(name, value)

    def counted_verify(self, *args, **kwargs):
        seen["verify"] += 1
        return verify(self, *args, **kwargs)

    def counted_check_prompt(*args, **kwargs):
        seen["check_prompt"] += 1
        return check_prompt(*args, **kwargs)

    monkeypatch.setattr(sp_module, "number_problem", counted_number_problem)
    monkeypatch.setattr(SamplingParams, "verify", counted_verify)
    monkeypatch.setattr(validation, "check_prompt", counted_check_prompt)
    return seen


def _counting_engine():
    """The fake engine, counting validate calls and recording generate's `validated`."""
    engine = FakeEngine()
    calls = {"validate": 0, "generated": []}
    validate, generate = engine.validate, engine.generate

    def counted_validate(req, prompt_checked=False):
        calls["validate"] += 1
        return validate(req, prompt_checked=prompt_checked)

    def recorded_generate(req, validated=False):
        calls["generated"].append(validated)
        return generate(req, validated=validated)

    engine.validate, engine.generate = counted_validate, recorded_generate
    return engine, calls


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_request_is_validated_once(counts, stream):
    engine, calls = _counting_engine()
    with TestClient(create_app(engine), base_url=LOCAL) as client:
        r = client.post("/v1/chat/completions",
                        json={**CHAT, "temperature": 0.5, "max_tokens": 3, "stream": stream})
    assert r.status_code == 200, r.text
    if stream:
        sse_events(r)
    assert counts["number:temperature"] == 1          # bounded once, by the schema
    assert counts["verify"] == 1                      # the SamplingParams verified once
    assert counts["check_prompt"] == 1                # the ids scanned once, one context rule
    assert calls["validate"] == 1                     # the engine validated it once ...
    assert calls["generated"] == [True]               # ... and was told so when it started it


def test_n_sequences_of_one_prompt_check_it_once(counts):
    engine, calls = _counting_engine()
    with TestClient(create_app(engine), base_url=LOCAL) as client:
        r = client.post("/v1/chat/completions",
                        json={**CHAT, "temperature": 0.5, "max_tokens": 2, "n": 3, "seed": 4})
    assert r.status_code == 200, r.text
    assert (counts["number:temperature"], counts["verify"], counts["check_prompt"]) == (1, 1, 1)
    assert calls["validate"] == 3 and calls["generated"] == [True] * 3    # once per sequence
    assert all(req.sampling_params.verified for req in engine.seen)


def test_native_and_completions_routes_validate_once(counts):
    engine, calls = _counting_engine()
    with TestClient(create_app(engine), base_url=LOCAL) as client:
        r = client.post("/v1/completions", json={"model": "fake", "prompt": "hi",
                                                 "temperature": 0.5, "max_tokens": 2})
        assert r.status_code == 200, r.text
        r = client.post("/generate", json={"text": "hi", "sampling_params": {
            "temperature": 0.5, "max_new_tokens": 2}})
        assert r.status_code == 200, r.text
    assert (counts["number:temperature"], counts["verify"], counts["check_prompt"]) == (2, 2, 2)
    assert calls["validate"] == 2 and calls["generated"] == [True, True]


def test_engine_generate_is_validated_once(counts, monkeypatch, smol_engine):
    from radixserve.engine.async_engine import AsyncEngine

    validate = AsyncEngine.validate
    engine_validations = []

    def counted_validate(self, req, prompt_checked=False):
        engine_validations.append(prompt_checked)
        return validate(self, req, prompt_checked=prompt_checked)

    monkeypatch.setattr(AsyncEngine, "validate", counted_validate)
    out = smol_engine.generate(input_ids=[1, 2, 3], sampling_params={
        "max_new_tokens": 1, "temperature": 0.5, "ignore_eos": True})
    assert out["meta_info"]["completion_tokens"] == 1
    assert (counts["number:temperature"], counts["verify"], counts["check_prompt"]) == (1, 1, 1)
    assert engine_validations == [True]       # the prompt was checked once, before it


def test_the_schema_reads_its_bounds_from_the_table():
    """Every sampling number's JSON schema on the native body is its BOUNDS row, and its
    field type refuses what the one check refuses."""
    props = S.SamplingParamsBody.model_json_schema()["properties"]
    for name, bound in BOUNDS.items():
        schema = props[name]
        if "anyOf" in schema and name in ("max_new_tokens", "seed"):        # Optional: or null
            schema = next(s for s in schema["anyOf"] if s.get("type") != "null")
        if bound.least is not None:
            assert schema["anyOf"][1] == {"minimum": bound.least, "maximum": bound.hi}, name
            continue
        assert schema["maximum"] == bound.hi, name
        assert schema["exclusiveMinimum" if bound.lo_open else "minimum"] == bound.lo, name


def test_the_schema_checks_with_the_one_check(monkeypatch):
    monkeypatch.setattr(sp_module, "number_problem",
                        lambda name, v: "is refused by the table" if name == "temperature" else None)
    with pytest.raises(ApiError) as info:
        R.parse_chat_request({**CHAT, "temperature": 0.5})
    assert info.value.param == "temperature"
    assert info.value.message == "temperature is refused by the table"


def test_a_bad_temperature_names_the_field_as_data():
    with pytest.raises(RequestError) as info:
        SamplingParams(temperature=-1.0).verify()
    assert info.value.param == "temperature"
    with pytest.raises(RequestError) as info:
        SamplingParams.from_dict({"temperature": "hot"})
    assert info.value.param == "temperature"
    engine = FakeEngine()
    with TestClient(create_app(engine), base_url=LOCAL) as client:
        for route, body, param in [
                ("/v1/chat/completions", {**CHAT, "temperature": -1}, "temperature"),
                ("/v1/completions", {"prompt": "x", "temperature": 2e4}, "temperature"),
                ("/generate", {"text": "x", "sampling_params": {"temperature": -1}},
                 "sampling_params.temperature"),
                ("/generate", {"text": ["x", "y"], "sampling_params": [{}, {"temperature": 1e-9}]},
                 "sampling_params[1].temperature"),
                ("/v1/responses", {"input": "x", "temperature": -1}, "temperature")]:
            body = err_of(client.post(route, json=body), 400, param)
            assert body["message"].startswith(param + " "), body
    assert engine.seen == []


def test_the_field_is_taken_from_the_error_never_its_message(monkeypatch):
    """An error whose message does not start with its field still names it, renamed as the
    client sent it (the old code matched a leading word of the message)."""
    def refuse(self, bounds_checked=False):
        raise RequestError("the seed leaves no room for n samples", param="seed")

    monkeypatch.setattr(SamplingParams, "verify", refuse)
    e = pytest.raises(ApiError, R.sampling_params_from_dict, {"seed": 1}).value
    assert (e.param, e.message) == ("seed", "the seed leaves no room for n samples")
    e = pytest.raises(ApiError, R.sampling_params_from_dict, {"seed": 1},
                      where="sampling_params[1]").value
    assert e.param == "sampling_params[1].seed"

    def too_many(self, bounds_checked=False):
        raise RequestError("max_new_tokens is too many", param="max_new_tokens")

    monkeypatch.setattr(SamplingParams, "verify", too_many)
    e = pytest.raises(ApiError, R.sampling_params_from_dict, {}, openai_names=True).value
    assert (e.param, e.message) == ("max_tokens", "max_tokens is too many")
    e = pytest.raises(ApiError, R.sampling_params_from_dict, {},
                      names={"max_new_tokens": "max_output_tokens"}).value
    assert (e.param, e.message) == ("max_output_tokens", "max_output_tokens is too many")


def test_verified_sampling_params_stay_verified_only_unchanged():
    sp = SamplingParams.from_dict({"temperature": 0.5, "seed": 7, "n": 3})
    assert sp.verified
    samples = [sp.for_sample(j) for j in range(3)]
    assert [(s.n, s.seed, s.verified) for s in samples] == [(1, 7, True), (1, 8, True), (1, 9, True)]
    tagged = sp.with_grammar("structural_tag", '{"type": "structural_tag"}')
    assert tagged.verified and tagged.grammar_key == ("structural_tag", '{"type": "structural_tag"}')
    with pytest.raises(RequestError) as info:           # what with_grammar changed is checked
        sp.with_grammar("regex", "x" * (sp_module.MAX_GRAMMAR_CHARS + 1))
    assert info.value.param == "regex"
    sp.temperature = -1.0                               # any assignment: verified again later
    assert not sp.verified
    assert not SamplingParams(temperature=0.5).verified  # a bare one is not verified


def test_check_prompt_is_one_rule_in_two_voices():
    """engine/validation.check_prompt: the engine's words (param input_ids / max_new_tokens)
    or, given the client's field names, the server's."""
    for ids, words, param in [
            ([], "the prompt is empty", "input_ids"),
            ([1, 10], "token id 10 is out of range", "input_ids"),
            ([1, True], "token id True is out of range", "input_ids"),
            (list(range(8)), "prompt has 8 tokens; the context length is 8", "input_ids"),
            ([1, 2], "lower max_new_tokens to at most 6", "max_new_tokens")]:
        with pytest.raises(RequestError) as info:
            validation.check_prompt(ids, 10, 8, 7)
        assert words in str(info.value) and info.value.param == param
    with pytest.raises(RequestError) as info:
        validation.check_prompt([1, 10], 10, 8, 1, prompt_param="messages", max_param="max_tokens")
    assert info.value.param == "messages" and "messages contains token id 10" in str(info.value)
    with pytest.raises(RequestError) as info:
        validation.check_prompt([1, 2], 10, 8, 7, prompt_param="prompt", max_param="max_tokens")
    assert info.value.param == "max_tokens" and str(info.value).startswith("max_tokens=7")
    validation.check_prompt([1, 2], 10, 8, 6)
    assert validation.max_prompt_tokens(8) == 7
