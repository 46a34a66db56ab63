"""The field policy of the OpenAI routes (server/schemas.py): every field is honoured, accepted
and ignored (IGNORED_FIELDS), or refused with a 400 that names it; any other key is a 400
"unknown field X (did you mean Y?)", at the top level and inside stream_options,
response_format and structured_outputs. The OpenAPI document says the same. Then vLLM's
extras through the app over the fake engine (no model): prompt_logprobs, truncation,
return_token_ids, continuous usage, logprobs 0, structured_outputs."""
import json

import jsonschema
import pytest
from referencing import Registry
from referencing.jsonschema import DRAFT202012
from starlette.testclient import TestClient

from radixserve.engine.io import GenerateOutput
from radixserve.errors import ApiError
from radixserve.parsers import tool_calls as T
from radixserve.server import render as O, requests as R
from radixserve.server import schemas as S
from radixserve.server.app import create_app
from radixserve.server.openapi import openapi_document

from test_server_fake_engine import LOCAL, FakeEngine, err_of, sse_events

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"prompt": "hi"}
PARSERS = [(R.parse_chat_request, CHAT), (R.parse_completion_request, COMPLETION)]
DOC = openapi_document(api_key=False)


def _err(fn, body) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(body)
    assert info.value.status == 400
    return info.value


def _valid_in_document(model: str, body: dict) -> bool:
    registry = Registry().with_resource("urn:doc", DRAFT202012.create_resource(DOC))
    schema = {"$ref": f"urn:doc#/components/schemas/{model}"}
    return jsonschema.Draft202012Validator(schema, registry=registry).is_valid(body)


# --------------------------------------------------------------------------- unknown fields

@pytest.mark.parametrize("extra, param, hint", [
    ({"temprature": 0.5}, "temperature", None),
    ({"max_token": 5}, "max_token", "max_tokens"),
    ({"stream": True, "stream_options": {"include_usge": True}}, "stream_options.include_usge",
     "stream_options.include_usage"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn", "structured_outputs.json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "nme": "x"}}},
     "response_format.json_schema.nme", "response_format.json_schema.name"),
    ({"completely_made_up": None}, "completely_made_up", None),
])
def test_unknown_fields_are_400s_naming_them(extra, param, hint):
    for parse, body in PARSERS:
        e = _err(parse, {**body, **extra})
        param_ = "temprature" if param == "temperature" else param
        assert e.param == param_ and e.message.startswith(f"unknown field {param_!r}")
        if hint or param == "temperature":
            assert f"did you mean {(hint or 'temperature')!r}?" in e.message
        assert not _valid_in_document("ChatCompletionRequest" if parse is R.parse_chat_request
                                      else "CompletionRequest", {**body, **extra})


def test_unknown_field_hint_on_the_route_specific_names():
    e = _err(R.parse_completion_request, {**COMPLETION, "max_completion_tokens": 3})
    assert e.param == "max_completion_tokens"          # chat's name: not a completions field
    e = _err(R.parse_chat_request, {**CHAT, "top_logprob": 3})
    assert "did you mean 'top_logprobs'?" in e.message


# --------------------------------------------------------------------------- ignored fields

IGNORED = {"user": "u-1", "safety_identifier": "s", "metadata": {"k": "v", "n": 1}, "store": True,
           "service_tier": "flex", "prompt_cache_key": "k", "prompt_cache_retention": "24h",
           "prompt_cache_options": {"ttl": "1h"}, "request_id": "r-1",
           "guided_decoding_backend": "outlines"}


@pytest.mark.parametrize("name", sorted(IGNORED))
def test_ignored_fields_are_accepted_and_change_nothing(name):
    for parse, body in PARSERS:
        plain = parse(body).sampling
        assert parse({**body, name: IGNORED[name]}).sampling == plain
        assert parse({**body, name: None}).sampling == plain
    assert name in S.IGNORED_FIELDS
    prop = DOC["components"]["schemas"]["ChatCompletionRequest"]["properties"][name]
    assert "accepted and ignored" in json.dumps(prop)


def test_chat_only_ignored_fields_and_stream_options_extras():
    r = R.parse_chat_request({**CHAT, "prediction": {"type": "content", "content": "x"},
                              "stream": True, "stream_options": {"include_usage": True,
                                                                 "include_obfuscation": True}})
    assert r.include_usage and not r.extras.continuous_usage
    e = _err(R.parse_chat_request, {**CHAT, "metadata": {"k" * 65: "v"}})
    assert e.param.startswith("metadata")                    # ignored, but still bounded
    e = _err(R.parse_chat_request, {**CHAT, "user": 5})
    assert e.param == "user"


# --------------------------------------------------------------------------- refused fields

REFUSED = [  # (field, a refused value, the neutral value accepted or None, chat only)
    ("use_beam_search", True, False, False),
    ("allowed_token_ids", [1, 2], None, False),
    ("bad_words", ["x"], None, False),
    ("return_tokens_as_token_ids", True, False, False),
    ("lora_path", "/x", None, False),
    ("modalities", ["text", "audio"], ["text"], True),
    ("audio", {"voice": "alloy", "format": "wav"}, None, True),
    ("web_search_options", {}, None, True),
    ("functions", [{"name": "f"}], None, True),
    ("function_call", "auto", None, True),
    ("reasoning_effort", "high", "none", True),
    ("verbosity", "low", None, True),
    ("moderation", {}, None, True),
    ("echo", True, False, True),
    ("continue_final_message", True, False, True),
    ("add_special_tokens", True, False, True),
    ("chat_template", "{{ x }}", None, True),
]


@pytest.mark.parametrize("name, bad, neutral, chat_only", REFUSED, ids=[r[0] for r in REFUSED])
def test_refused_fields_are_400s_naming_them_and_neutral_values_pass(name, bad, neutral, chat_only):
    for parse, body in PARSERS[:1] if chat_only else PARSERS:
        e = _err(parse, {**body, name: bad})
        assert e.param == name and e.message.startswith(f"{name} ") and "not supported" in e.message
        assert parse({**body, name: neutral}).sampling == parse(body).sampling
    assert not _valid_in_document("ChatCompletionRequest", {**CHAT, name: bad})
    assert _valid_in_document("ChatCompletionRequest", {**CHAT, name: neutral})


def test_structured_outputs_switches():
    so = {"json": {"type": "object"}, "disable_any_whitespace": True,
          "disable_additional_properties": False, "disable_fallback": True}
    assert R.parse_chat_request({**CHAT, "structured_outputs": so}).sampling.grammar_key == \
        ("json_schema", '{"type": "object"}')
    e = _err(R.parse_chat_request, {**CHAT, "structured_outputs": {"whitespace_pattern": " "}})
    assert e.param == "structured_outputs.whitespace_pattern" and "not supported" in e.message


# --------------------------------------------------------------------------- honoured vLLM fields

@pytest.mark.parametrize("so, kind, spec", [
    ({"json": {"type": "integer"}}, "json_schema", '{"type": "integer"}'),
    ({"json": '{"type": "string"}'}, "json_schema", '{"type": "string"}'),
    ({"regex": "[ab]+"}, "regex", "[ab]+"),
    ({"choice": ["yes", "no."]}, "regex", r"(yes|no\.)"),
    ({"grammar": 'root ::= "x"'}, "ebnf", 'root ::= "x"'),
    ({"json_object": True}, "json_schema", '{"type": "object"}'),
    ({"structural_tag": {"type": "structural_tag", "format": {}}}, "structural_tag",
     '{"type": "structural_tag", "format": {}}'),
])
def test_structured_outputs_reach_the_grammar(so, kind, spec):
    for parse, body in PARSERS:
        assert parse({**body, "structured_outputs": so}).sampling.grammar_key == (kind, spec)
    assert R.parse_chat_request({**CHAT, "structured_outputs": {"json_object": False}}
                                ).sampling.grammar_key is None


def test_structured_outputs_conflicts_name_the_fields():
    e = _err(R.parse_chat_request, {**CHAT, "structured_outputs": {"regex": "a", "choice": ["b"]}})
    assert e.param == "structured_outputs.choice"
    e = _err(R.parse_chat_request, {**CHAT, "guided_regex": "a", "structured_outputs": {"regex": "b"}})
    assert e.param == "structured_outputs.regex" and "guided_regex" in e.message


def test_stop_regex_include_stop_str_and_cache_salt():
    sp = R.parse_completion_request({**COMPLETION, "stop_regex": ["a+b"],
                                     "include_stop_str_in_output": True}).sampling
    assert sp.stop_regexes == ["a+b"] and sp.no_stop_trim
    assert not R.parse_completion_request(COMPLETION).sampling.no_stop_trim
    for model, body in ((S.ChatCompletionRequest, CHAT), (S.CompletionRequest, COMPLETION)):
        assert S.parse(model, {**body, "cache_salt": "s" * 256}).cache_salt == "s" * 256
        with pytest.raises(ApiError) as info:
            S.parse(model, {**body, "cache_salt": "s" * 257})
        assert info.value.param == "cache_salt"


def test_vllm_output_extras_parse_and_bounds():
    r = R.parse_completion_request({**COMPLETION, "prompt_logprobs": 3, "truncate_prompt_tokens": 7,
                                    "return_token_ids": True})
    assert (r.extras.prompt_logprobs, r.extras.truncate_prompt_tokens, r.extras.return_token_ids) == \
        (3, 7, True)
    r = R.parse_chat_request({**CHAT, "stream": True, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}})
    assert r.extras.continuous_usage
    r = R.parse_chat_request({**CHAT, "stream": True, "stream_options": {"continuous_usage_stats": True}})
    assert not r.extras.continuous_usage                  # as vLLM: only with include_usage
    for body, param in (({"prompt_logprobs": 21}, "prompt_logprobs"),
                        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
                        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
                        ({"truncate_prompt_tokens": 2 ** 31}, "truncate_prompt_tokens"),
                        ({"return_token_ids": 1}, "return_token_ids")):
        for parse, base in PARSERS:
            assert _err(parse, {**base, **body}).param == param
    assert R.truncate_prompt([1, 2, 3, 4], 2) == [3, 4]
    assert R.truncate_prompt([1, 2], 5) == [1, 2] and R.truncate_prompt([1, 2], None) == [1, 2]


def test_parallel_tool_calls_false_stops_after_the_first_call():
    functions, choice = T.check_tools([{"type": "function", "function": {"name": "f"}}], "auto")
    assert json.loads(T.tool_grammar(functions, choice))["format"]["stop_after_first"] is False
    tag = json.loads(T.tool_grammar(functions, choice, parallel=False))
    assert tag["format"]["stop_after_first"] is True
    assert R.parse_chat_request({**CHAT, "parallel_tool_calls": False}).parallel_tool_calls is False


# --------------------------------------------------------------------------- builders

def test_completion_logprobs_always_hold_the_token_itself():
    entries = [(-0.5, 1, "a"), (-2.0, 2, "b")]
    tops = [[(-0.5, 1, "a"), (-1.0, 3, "c")], [(-0.1, 4, "d"), (-1.0, 5, "e")]]
    lp = O.completion_logprobs(entries, tops, 0, token_text=str)
    assert lp["top_logprobs"] == [{"a": -0.5}, {"b": -2.0}]          # logprobs 0: the token only
    lp = O.completion_logprobs(entries, tops, 1, token_text=str)
    assert lp["top_logprobs"] == [{"a": -0.5}, {"d": -0.1, "b": -2.0}]   # up to k + 1, best first
    lp = O.completion_logprobs(entries, [], 0, token_text=str)         # no alternatives computed
    assert lp["top_logprobs"] == [{"a": -0.5}, {"b": -2.0}]


def test_vllm_prompt_logprobs_shape():
    r = O.SeqResult(0, [7, 8, 9])
    r.feed(GenerateOutput(rid="r", text_delta="x", output_ids_delta=[5], finished=True,
                          input_token_logprobs=[(None, 7, "a"), (-1.5, 8, "b"), (float("-inf"), 9, "c")],
                          input_top_logprobs=[[], [(-0.2, 3, "t"), (-1.5, 8, "b")], [(-0.1, 3, "t")]]))
    out = O.vllm_prompt_logprobs(r, 2, token_text=str)
    assert out == [None,
                   {"8": {"logprob": -1.5, "rank": 2, "decoded_token": "b"},
                    "3": {"logprob": -0.2, "rank": 1, "decoded_token": "t"}},
                   {"9": {"logprob": -9999.0, "rank": None, "decoded_token": "c"},
                    "3": {"logprob": -0.1, "rank": 1, "decoded_token": "t"}}]
    assert [list(x) if x else x for x in O.vllm_prompt_logprobs(r, 0, token_text=str)] == \
        [None, ["8"], ["9"]]


# --------------------------------------------------------------------------- the app

class _RecordingTokenizer(type(FakeEngine().tokenizer)):
    """The fake byte tokenizer; id 1 is a special token whose text decode drops by default."""
    special = {1: "<s>"}

    def decode(self, ids, skip_special_tokens=True, spaces_between_special_tokens=True):
        return "".join(("" if skip_special_tokens else self.special[t]) if t in self.special
                       else bytes([t]).decode("latin-1") for t in ids)

    def token_text(self, tid):
        return self.special.get(tid) or bytes([tid]).decode("latin-1")

    def encode(self, text, add_special_tokens=True, max_tokens=None):
        return ([1] if add_special_tokens and text.startswith("BOS") else []) + list(text.encode())


@pytest.fixture()
def engine():
    e = FakeEngine()
    e.tokenizer = _RecordingTokenizer()
    return e


@pytest.fixture()
def client(engine):
    with TestClient(create_app(engine), base_url=LOCAL, raise_server_exceptions=False) as c:
        yield c


def test_app_prompt_logprobs_truncation_and_token_ids(client, engine):
    r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, "prompt_logprobs": 1,
                                             "truncate_prompt_tokens": 3, "return_token_ids": True})
    body = r.json()
    choice = body["choices"][0]
    assert body["usage"]["prompt_tokens"] == 3 and engine.seen[0].input_ids == list(b"llo")
    assert choice["prompt_token_ids"] == list(b"llo") and choice["token_ids"] == list(b"Par")
    plp = choice["prompt_logprobs"]
    assert len(plp) == 3 and plp[0] is None
    assert [list(e)[0] for e in plp[1:]] == [str(t) for t in b"lo"]
    assert engine.seen[0].logprob_start_len == 0 and engine.seen[0].top_logprobs_num == 1
    assert choice["logprobs"] is None                    # prompt_logprobs alone: no output logprobs
    r = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2, "prompt_logprobs": 0,
                                                  "return_token_ids": True})
    body = r.json()
    assert len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"] == len(body["prompt_token_ids"])
    assert body["choices"][0]["token_ids"] == list(b"Pa")
    # a prompt past the context length passes once truncated
    r = client.post("/v1/completions", json={"prompt": "x" * 200, "max_tokens": 2,
                                             "truncate_prompt_tokens": 10})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 10


def test_app_echo_of_special_token_ids_keeps_their_text(client):
    r = client.post("/v1/completions", json={"prompt": [1, 104, 105], "echo": True, "logprobs": 0,
                                             "max_tokens": 2})
    choice = r.json()["choices"][0]
    assert choice["text"] == "<s>hiPa"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["<s>", "h", "i", "P", "a"] and lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][1:] == [{"h": -1.0}, {"i": -1.0}, {"P": -0.25}, {"a": -0.5}]
    r = client.post("/v1/completions", json={"prompt": [1], "echo": True, "logprobs": 1, "max_tokens": 1})
    lp = r.json()["choices"][0]["logprobs"]                  # only a special token: still there
    assert lp["tokens"] == ["<s>", "P"] and lp["token_logprobs"][0] is None


def test_app_add_special_tokens_on_completions(client, engine):
    for flag, ids in ((None, [1] + list(b"BOS")), (True, [1] + list(b"BOS")), (False, list(b"BOS"))):
        body = {"prompt": "BOS", "max_tokens": 1, **({} if flag is None else {"add_special_tokens": flag})}
        assert client.post("/v1/completions", json=body).json()["usage"]["prompt_tokens"] == len(ids)
        assert engine.seen[-1].input_ids == ids


def test_app_continuous_usage_and_streamed_token_ids(client):
    r = client.post("/v1/completions", json={
        "prompt": "hello", "max_tokens": 4, "stream": True, "return_token_ids": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    events = sse_events(r)
    chunks, last = events[:-1], events[-1]
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 3, 4]
    assert all(c["usage"]["prompt_tokens"] == 5 and c["usage"]["total_tokens"] == 5 + k + 1
               for k, c in enumerate(chunks))
    assert chunks[0]["choices"][0]["prompt_token_ids"] == list(b"hello")
    assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == list(b"Pari")
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4
    r = client.post("/v1/chat/completions", json={
        **CHAT, "max_tokens": 2, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    events = sse_events(r)
    assert [e["usage"]["completion_tokens"] for e in events[:-1]] == [0, 1, 2]
    r = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2, "stream": True,
                                                  "stream_options": {"include_usage": True}})
    assert all(e["usage"] is None for e in sse_events(r)[:-1])


def test_app_refuses_and_names_fields(client):
    err_of(client.post("/v1/chat/completions", json={**CHAT, "use_beam_search": True}), 400,
           "use_beam_search")
    assert client.post("/v1/chat/completions", json={**CHAT, "use_beam_search": False,
                                                     "max_tokens": 1}).status_code == 200
    body = err_of(client.post("/v1/completions", json={**COMPLETION, "tempreture": 1}), 400,
                  "tempreture")
    assert "did you mean 'temperature'?" in body["message"]
