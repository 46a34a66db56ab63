"""Request parsing / validation and response builders of radixserve.server.protocol, and the
SSE framing: every bad input gets the right status and a message naming the field."""
import json

import pytest

from radixserve.engine.io import GenerateOutput
from radixserve.server import protocol as P
from radixserve.server.errors import ApiError
from radixserve.server.sse import DONE_EVENT, encode_event

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def _err(fn, *args) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(*args)
    return info.value


# --------------------------------------------------------------------------- body and model

@pytest.mark.parametrize("raw", [b"{not json", b"", b"\xff\xfe", b"[1, 2]", b'"text"', b"null"])
def test_body_must_be_a_json_object(raw):
    e = _err(P.parse_json_body, raw)
    assert e.status == 400 and e.type == "invalid_request_error"
    assert "JSON" in e.message


def test_error_body_shape():
    e = ApiError("temperature must be >= 0", 400, "temperature")
    assert e.body() == {"error": {"message": "temperature must be >= 0",
                                  "type": "invalid_request_error", "param": "temperature", "code": 400}}
    assert ApiError("x", 404).type == "not_found_error"
    assert ApiError("x", 500).type == "internal_server_error"


def test_model_optional_but_must_match():
    P.check_model({}, "smol")
    P.check_model({"model": "smol"}, "smol")
    P.check_model({"model": "/path/to/smol"}, "smol", ["/path/to/smol"])
    e = _err(P.check_model, {"model": "gpt-4"}, "smol")
    assert e.status == 404 and e.type == "not_found_error" and e.param == "model"
    assert e.message == "The model 'gpt-4' does not exist; this server serves 'smol'"
    e = _err(P.check_model, {"model": 3}, "smol")
    assert e.status == 400 and e.param == "model"


# --------------------------------------------------------------------------- chat

def test_chat_defaults_and_mapping():
    r = P.parse_chat_request({**CHAT, "temperature": 0, "top_p": 0.5, "max_tokens": 7,
                              "stop": "\n", "seed": 3, "presence_penalty": 0.5,
                              "frequency_penalty": -0.5, "top_k": 5, "min_p": 0.1,
                              "repetition_penalty": 1.1, "min_tokens": 2, "ignore_eos": True,
                              "stop_token_ids": [7], "skip_special_tokens": False,
                              "no_stop_trim": True})
    sp = r.sampling
    assert (sp.temperature, sp.top_p, sp.max_new_tokens, sp.stop, sp.seed) == (0, 0.5, 7, ["\n"], 3)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.top_k, sp.min_p) == (0.5, -0.5, 5, 0.1)
    assert (sp.repetition_penalty, sp.min_new_tokens, sp.ignore_eos) == (1.1, 2, True)
    assert sp.stop_token_ids == [7] and sp.skip_special_tokens is False and sp.no_stop_trim is True
    assert (r.n, r.stream, r.include_usage, r.logprobs, r.top_logprobs) == (1, False, False, False, 0)
    assert P.parse_chat_request(CHAT).sampling.max_new_tokens is None   # up to the context


def test_max_completion_tokens_wins():
    r = P.parse_chat_request({**CHAT, "max_tokens": 5, "max_completion_tokens": 9})
    assert r.sampling.max_new_tokens == 9
    e = _err(P.parse_chat_request, {**CHAT, "max_completion_tokens": -1})
    assert e.param == "max_completion_tokens" and "max_completion_tokens" in e.message


def test_stream_options_include_usage():
    r = P.parse_chat_request({**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    assert r.stream and r.include_usage
    e = _err(P.parse_chat_request, {**CHAT, "stream_options": {"include_usage": True}})
    assert e.param == "stream_options"


def test_messages_content_parts_and_developer_role():
    msgs = P.parse_messages([{"role": "developer", "content": "be brief"},
                             {"role": "user", "content": [{"type": "text", "text": "a"},
                                                          {"type": "text", "text": "b"}]},
                             {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}])
    assert [m["role"] for m in msgs] == ["system", "user", "assistant"]
    assert msgs[1]["content"] == "a\nb" and msgs[2]["content"] == ""


@pytest.mark.parametrize("body, param, words", [
    ({}, "messages", "required"),
    ({"messages": []}, "messages", "non-empty"),
    ({"messages": "hi"}, "messages", "non-empty"),
    ({"messages": ["hi"]}, "messages[0]", "object"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "one of"),
    ({"messages": [{"content": "x"}]}, "messages[0].role", "one of"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "required"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "string"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content", "text"),
    ({**CHAT, "temperature": "hot"}, "temperature", "must be a number"),
    ({**CHAT, "temperature": -1}, "temperature", ">= 0"),
    ({**CHAT, "top_p": 0}, "top_p", "(0, 1]"),
    ({**CHAT, "top_p": 1.5}, "top_p", "(0, 1]"),
    ({**CHAT, "n": 0}, "n", "between 1"),
    ({**CHAT, "n": "2"}, "n", "integer"),
    ({**CHAT, "max_tokens": -5}, "max_tokens", ">= 0"),
    ({**CHAT, "max_tokens": 1.5}, "max_tokens", "integer"),
    ({**CHAT, "stream": "yes"}, "stream", "boolean"),
    ({**CHAT, "logprobs": 1}, "logprobs", "boolean"),
    ({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "between 0 and 20"),
    ({**CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs", "between 0 and 20"),
    ({**CHAT, "top_logprobs": 3}, "top_logprobs", "requires logprobs"),
    ({**CHAT, "stop": 5}, "stop", "stop"),
    ({**CHAT, "stop": ["a", ""]}, "stop", "non-empty"),
    ({**CHAT, "presence_penalty": 3}, "presence_penalty", "[-2, 2]"),
    ({**CHAT, "frequency_penalty": -3}, "frequency_penalty", "[-2, 2]"),
    ({**CHAT, "seed": "x"}, "seed", "integer"),
    ({**CHAT, "top_k": -2}, "top_k", "top_k"),
    ({**CHAT, "min_tokens": -1}, "min_tokens", ">= 0"),
    ({**CHAT, "stop_token_ids": [-1]}, "stop_token_ids", "non-negative"),
    ({**CHAT, "logit_bias": {"1": 5}}, "logit_bias", "not supported"),
    ({**CHAT, "response_format": {"type": "xml"}}, "response_format", "json_schema"),
])
def test_chat_bad_inputs(body, param, words):
    e = _err(P.parse_chat_request, body)
    assert e.status == 400, e.message
    assert e.param == param, (e.param, e.message)
    assert words in e.message
    assert param.split("[")[0].split(".")[0] in e.message


# --------------------------------------------------------------------------- completions

def test_prompt_shapes():
    assert P.parse_prompts("a", "prompt") == ["a"]
    assert P.parse_prompts(["a", "b"], "prompt") == ["a", "b"]
    assert P.parse_prompts([1, 2, 3], "prompt") == [[1, 2, 3]]
    assert P.parse_prompts([[1, 2], [3]], "prompt") == [[1, 2], [3]]


@pytest.mark.parametrize("body, param, words", [
    ({}, "prompt", "required"),
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": 5}, "prompt", "array of token ids"),
    ({"prompt": [1, "a"]}, "prompt", "array of token ids"),
    ({"prompt": [[1], []]}, "prompt", "array of token ids"),
    ({"prompt": [True, 2]}, "prompt", "array of token ids"),
    ({"prompt": "x", "logprobs": 21}, "logprobs", "between 0 and 20"),
    ({"prompt": "x", "logprobs": True}, "logprobs", "integer"),
    ({"prompt": "x", "echo": "no"}, "echo", "boolean"),
    ({"prompt": "x", "suffix": "y"}, "suffix", "not supported"),
    ({"prompt": "x", "best_of": 3}, "best_of", "best_of"),
])
def test_completion_bad_inputs(body, param, words):
    e = _err(P.parse_completion_request, body)
    assert e.status == 400 and e.param == param and words in e.message, (e.param, e.message)


def test_completion_defaults():
    r = P.parse_completion_request({"prompt": "x", "logprobs": 2, "echo": True, "n": 3})
    assert r.sampling.max_new_tokens == 16 and r.logprobs == 2 and r.echo and r.n == 3


# --------------------------------------------------------------------------- native

def test_generate_request_shapes():
    r = P.parse_generate_request({"text": "a", "sampling_params": {"max_new_tokens": 3}})
    assert r.prompts == ["a"] and not r.is_batch and r.sampling[0].max_new_tokens == 3
    r = P.parse_generate_request({"input_ids": [[1, 2], [3]], "return_logprob": [True, False],
                                  "sampling_params": [{"temperature": 0}, {"temperature": 1}],
                                  "rid": ["x", "y"], "top_logprobs_num": 2, "stream": True})
    assert r.is_batch and r.prompts == [[1, 2], [3]] and r.return_logprob == [True, False]
    assert [s.temperature for s in r.sampling] == [0, 1] and r.rids == ["x", "y"]
    assert r.top_logprobs_num == [2, 2] and r.stream and r.logprob_start_len == [-1, -1]


@pytest.mark.parametrize("body, param, words", [
    ({}, "text", "exactly one of text or input_ids"),
    ({"text": "a", "input_ids": [1]}, "text", "exactly one"),
    ({"text": 5}, "text", "string"),
    ({"input_ids": []}, "input_ids", "non-empty"),
    ({"input_ids": [1.5]}, "input_ids", "token ids"),
    ({"text": "a", "sampling_params": {"temperature": -1}}, "temperature", ">= 0"),
    ({"text": "a", "sampling_params": {"temprature": 0}}, None, "unknown sampling parameter"),
    ({"text": "a", "sampling_params": {"max_new_tokens": "5"}}, "max_new_tokens", "number"),
    ({"text": "a", "sampling_params": [{}, {}]}, "sampling_params", "2 entries"),
    ({"text": "a", "sampling_params": 3}, "sampling_params", "object"),
    ({"text": ["a", "b"], "rid": "x"}, "rid", "one string per prompt"),
    ({"text": "a", "return_logprob": "yes"}, "return_logprob", "boolean"),
    ({"text": "a", "top_logprobs_num": 99}, "top_logprobs_num", "between 0 and 20"),
    ({"text": ["a", "b"], "return_logprob": [True]}, "return_logprob", "one per prompt"),
])
def test_generate_bad_inputs(body, param, words):
    e = _err(P.parse_generate_request, body)
    assert e.status == 400 and e.param == param and words in e.message, (e.param, e.message)


def test_check_prompt_ids():
    P.check_prompt_ids([1, 2], 10, 8, 6, "prompt", "max_tokens")
    P.check_prompt_ids([1, 2], 10, 8, None, "prompt", "max_tokens")
    e = _err(P.check_prompt_ids, [], 10, 8, 1, "prompt", "max_tokens")
    assert e.param == "prompt" and "empty" in e.message
    e = _err(P.check_prompt_ids, [1, 10], 10, 8, 1, "prompt", "max_tokens")
    assert e.param == "prompt" and "token id 10" in e.message
    e = _err(P.check_prompt_ids, list(range(8)), 10, 8, None, "messages", "max_tokens")
    assert e.param == "messages" and "context length is 8" in e.message
    e = _err(P.check_prompt_ids, [1, 2], 10, 8, 7, "prompt", "max_completion_tokens")
    assert e.param == "max_completion_tokens" and "at most 6" in e.message


# --------------------------------------------------------------------------- builders

def _out(text, ids, finished=False, reason=None, lps=(), tops=(), **kw):
    return GenerateOutput(rid="r", text_delta=text, output_ids_delta=list(ids), finished=finished,
                          finish_reason=reason, output_token_logprobs_delta=list(lps),
                          output_top_logprobs_delta=list(tops), **kw)


def test_seq_result_and_usage():
    a, b = P.SeqResult(0, [1, 2, 3]), P.SeqResult(1, [1, 2, 3])
    a.feed(_out("He", [5], prompt_tokens=3, completion_tokens=1, cached_tokens=0))
    a.feed(_out("llo", [6], True, {"type": "stop", "matched": "!"}, prompt_tokens=3,
                completion_tokens=2, cached_tokens=0))
    b.feed(_out("X", [7], True, {"type": "length", "matched": None}, prompt_tokens=3,
                completion_tokens=1, cached_tokens=2))
    assert a.text == "Hello" and a.output_ids == [5, 6] and a.finished
    assert P.finish_reason_str(a.finish_reason) == "stop" and P.matched_stop(a.finish_reason) == "!"
    assert P.usage_dict([a, b], n=2) == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                                         "prompt_tokens_details": {"cached_tokens": 2}}
    assert P.usage_dict([a, b], n=1)["prompt_tokens"] == 6


def test_chat_logprobs_shape():
    lp = P.chat_logprobs([(-0.5, 7, "é")], [[(-0.5, 7, "é"), (-1.5, 8, None)]], 2,
                         token_text=lambda i: f"<{i}>")
    assert lp == {"content": [{"token": "é", "logprob": -0.5, "bytes": [195, 169], "top_logprobs": [
        {"token": "é", "logprob": -0.5, "bytes": [195, 169]},
        {"token": "<8>", "logprob": -1.5, "bytes": list(b"<8>")}]}]}


def test_completion_logprobs_with_echo():
    r = P.SeqResult(0, [1, 2])
    r.feed(_out("c", [3], True, {"type": "length"}, lps=[(-0.1, 3, "c")], tops=[[(-0.1, 3, "c")]],
                input_token_logprobs=[(-2.0, 2, "b")], input_top_logprobs=[[(-2.0, 2, "b")]]))
    choice = P.completion_choice(r, "ab", 1, token_text=lambda i: "ab"[i - 1])
    assert choice["text"] == "abc" and choice["finish_reason"] == "length"
    assert choice["logprobs"] == {"tokens": ["a", "b", "c"], "token_logprobs": [None, -2.0, -0.1],
                                  "top_logprobs": [None, {"b": -2.0}, {"c": -0.1}],
                                  "text_offset": [0, 1, 2]}


def test_native_result_shape():
    r = P.SeqResult(0, [1, 2])
    r.feed(_out("hi", [4, 5], True, {"type": "length", "matched": None}, lps=[(-1.0, 4, None)],
                tops=[[(-1.0, 4, None)]], prompt_tokens=2, completion_tokens=2, cached_tokens=1,
                input_token_logprobs=[(None, 1, None), (-3.0, 2, None)]))
    res = P.native_result(r, "rid1", return_logprob=True)
    assert res["text"] == "hi" and res["output_ids"] == [4, 5]
    m = res["meta_info"]
    assert (m["id"], m["prompt_tokens"], m["completion_tokens"], m["cached_tokens"]) == ("rid1", 2, 2, 1)
    assert m["finish_reason"] == {"type": "length", "matched": None}
    assert m["input_token_logprobs"] == [[None, 1, None], [-3.0, 2, None]]
    assert m["output_token_logprobs"] == [[-1.0, 4, None]]
    assert m["output_top_logprobs"] == [[[-1.0, 4, None]]]
    assert "input_token_logprobs" not in P.native_result(r, "rid1", False)["meta_info"]


def test_chunks_and_usage_chunk():
    c = P.chat_chunk("id", 1, "m", 2, {"content": "x"}, "stop", usage_null=True)
    assert c == {"id": "id", "object": "chat.completion.chunk", "created": 1, "model": "m",
                 "choices": [{"index": 2, "delta": {"content": "x"}, "logprobs": None,
                              "finish_reason": "stop"}], "usage": None}
    u = P.usage_chunk("id", "text_completion", 1, "m", {"prompt_tokens": 1})
    assert u["choices"] == [] and u["usage"] == {"prompt_tokens": 1}
    c = P.completion_chunk("id", 1, "m", 0, "t")
    assert c["object"] == "text_completion" and c["choices"][0]["text"] == "t" and "usage" not in c


# --------------------------------------------------------------------------- SSE framing

def test_sse_framing_byte_exact():
    assert encode_event({"a": 1, "b": "é"}) == 'data: {"a":1,"b":"é"}\n\n'.encode("utf-8")
    assert DONE_EVENT == b"data: [DONE]\n\n"
    payload = encode_event({"x": "line1\nline2"})
    assert payload.count(b"\n") == 2          # newlines inside strings are escaped by JSON
    assert json.loads(payload[len(b"data: "):-2]) == {"x": "line1\nline2"}
