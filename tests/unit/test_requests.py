"""Request parsing / validation of radixserve.server.requests: every bad input gets the right
status and a message naming the field."""
import pytest

from radixserve.errors import ApiError
from radixserve.server import requests as R

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def _err(fn, *args) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(*args)
    return info.value


# --------------------------------------------------------------------------- body and model

@pytest.mark.parametrize("raw", [b"{not json", b"", b"\xff\xfe", b"[1, 2]", b'"text"', b"null"])
def test_body_must_be_a_json_object(raw):
    e = _err(R.parse_json_body, raw)
    assert e.status == 400 and e.type == "invalid_request_error"
    assert "JSON" in e.message


def test_error_body_shape():
    e = ApiError("temperature must be >= 0", 400, "temperature")
    assert e.body() == {"error": {"message": "temperature must be >= 0",
                                  "type": "invalid_request_error", "param": "temperature", "code": 400}}
    assert ApiError("x", 404).type == "not_found_error"
    assert ApiError("x", 500).type == "internal_server_error"


def test_model_optional_but_must_match():
    R.check_model({}, "smol")
    R.check_model({"model": "smol"}, "smol")
    R.check_model({"model": "/path/to/smol"}, "smol", ["/path/to/smol"])
    e = _err(R.check_model, {"model": "gpt-4"}, "smol")
    assert e.status == 404 and e.type == "not_found_error" and e.param == "model"
    assert e.message == "The model 'gpt-4' does not exist; this server serves 'smol'"
    e = _err(R.check_model, {"model": 3}, "smol")
    assert e.status == 400 and e.param == "model"


# --------------------------------------------------------------------------- chat

def test_chat_defaults_and_mapping():
    r = R.parse_chat_request({**CHAT, "temperature": 0, "top_p": 0.5, "max_tokens": 7,
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
    assert R.parse_chat_request(CHAT).sampling.max_new_tokens is None   # up to the context


def test_max_completion_tokens_wins():
    r = R.parse_chat_request({**CHAT, "max_tokens": 5, "max_completion_tokens": 9})
    assert r.sampling.max_new_tokens == 9
    e = _err(R.parse_chat_request, {**CHAT, "max_completion_tokens": -1})
    assert e.param == "max_completion_tokens" and "max_completion_tokens" in e.message


def test_stream_options_include_usage():
    r = R.parse_chat_request({**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    assert r.stream and r.include_usage
    e = _err(R.parse_chat_request, {**CHAT, "stream_options": {"include_usage": True}})
    assert e.param == "stream_options"


def test_messages_content_parts_and_developer_role():
    msgs = R.parse_messages([{"role": "developer", "content": "be brief"},
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
    ({"messages": [{"role": "", "content": "x"}]}, "messages[0].role", "non-empty"),
    ({"messages": [{"role": "w" * 65, "content": "x"}]}, "messages[0].role", "at most 64"),
    ({"messages": [{"role": 3, "content": "x"}]}, "messages[0].role", "string"),
    ({"messages": [{"content": "x"}]}, "messages[0].role", "required"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "required"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "string"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].type", "only text content is supported, the served model reads "
     "text only: no images, audio or files (a multimodal checkpoint such as Gemma 3 4B / 12B / "
     "27B is served as its text model), got"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                                {"type": "image_url",
                                                 "image_url": {"url": "data:image/png;base64,"}}]}]},
     "messages[0].content[1].type", "got the string 'image_url'"),
    ({**CHAT, "temperature": "hot"}, "temperature", "must be a number"),
    ({**CHAT, "temperature": -1}, "temperature", "between 0 and 10000, got -1"),
    ({**CHAT, "temperature": 1e-7}, "temperature", "0 (greedy) or between 1e-05 and 10000"),
    ({**CHAT, "temperature": True}, "temperature", "must be a number"),
    ({**CHAT, "temperature": 10 ** 400}, "temperature", "between 0 and 10000"),
    ({**CHAT, "top_p": 0}, "top_p", "(0, 1]"),
    ({**CHAT, "top_p": 1.5}, "top_p", "(0, 1]"),
    ({**CHAT, "n": 0}, "n", "between 1"),
    ({**CHAT, "n": 500}, "n", "n must be between 1 and 128, got 500"),
    ({**CHAT, "n": True}, "n", "integer"),
    ({**CHAT, "n": "2"}, "n", "integer"),
    ({**CHAT, "max_tokens": -5}, "max_tokens", "between 0 and 2147483647"),
    ({**CHAT, "max_tokens": 2 ** 31}, "max_tokens", "between 0 and 2147483647"),
    ({**CHAT, "max_tokens": 1.5}, "max_tokens", "integer"),
    ({**CHAT, "stream": "yes"}, "stream", "boolean"),
    ({**CHAT, "logprobs": 1}, "logprobs", "boolean"),
    ({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "between 0 and 20"),
    ({**CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs", "between 0 and 20"),
    ({**CHAT, "top_logprobs": 3}, "top_logprobs", "requires logprobs"),
    ({**CHAT, "stop": 5}, "stop", "stop"),
    ({**CHAT, "stop": ["a", ""]}, "stop[1]", "non-empty"),
    ({**CHAT, "stop": ["a"] * 17}, "stop", "at most 16"),
    ({**CHAT, "presence_penalty": 3}, "presence_penalty", "between -2 and 2"),
    ({**CHAT, "frequency_penalty": -3}, "frequency_penalty", "between -2 and 2"),
    ({**CHAT, "repetition_penalty": 0}, "repetition_penalty", "between 1e-20 and 2"),
    ({**CHAT, "repetition_penalty": 1.1754944e-38}, "repetition_penalty", "between 1e-20 and 2"),
    ({**CHAT, "seed": "x"}, "seed", "integer"),
    ({**CHAT, "seed": 2 ** 63}, "seed", "9223372036854775807"),
    ({**CHAT, "seed": 2 ** 63 - 1, "n": 2}, "seed", "seed + n - 1"),
    ({**CHAT, "top_k": -2}, "top_k", "top_k"),
    ({**CHAT, "top_k": 2 ** 31}, "top_k", "2147483647"),
    ({**CHAT, "min_tokens": -1}, "min_tokens", "between 0 and"),
    ({**CHAT, "stop_token_ids": [-1]}, "stop_token_ids[0]", "at least 0"),
    ({**CHAT, "logit_bias": {"x": 5}}, "logit_bias", "token id"),
    ({**CHAT, "logit_bias": {"1": 101}}, "logit_bias['1']", "between -100 and 100"),
    ({**CHAT, "response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ({**CHAT, "response_format": {"type": "json_schema"}}, "response_format.json_schema", "required"),
    ({**CHAT, "regex": "a", "guided_json": {}}, "guided_json", "at most one"),
    ({**CHAT, "guided_choice": []}, "guided_choice", "non-empty"),
    ({**CHAT, "json_schema": 5}, "json_schema", "JSON object"),
])
def test_chat_bad_inputs(body, param, words):
    e = _err(R.parse_chat_request, body)
    assert e.status == 400, e.message
    assert e.param == param, (e.param, e.message)
    assert words in e.message
    assert param.split("[")[0].split(".")[0] in e.message


# --------------------------------------------------------------------------- completions

def test_prompt_shapes():
    assert R.parse_prompts("a", "prompt") == ["a"]
    assert R.parse_prompts(["a", "b"], "prompt") == ["a", "b"]
    assert R.parse_prompts([1, 2, 3], "prompt") == [[1, 2, 3]]
    assert R.parse_prompts([[1, 2], [3]], "prompt") == [[1, 2], [3]]


@pytest.mark.parametrize("body, param, words", [
    ({}, "prompt", "required"),
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": 5}, "prompt", "array of token ids"),
    ({"prompt": [1, "a"]}, "prompt[1]", "integer"),
    ({"prompt": [[1], []]}, "prompt[1]", "non-empty"),
    ({"prompt": [1, -1]}, "prompt[1]", "at least 0"),
    ({"prompt": [True, 2]}, "prompt", "array of token ids"),
    ({"prompt": "x", "logprobs": 21}, "logprobs", "between 0 and 20"),
    ({"prompt": "x", "logprobs": True}, "logprobs", "integer"),
    ({"prompt": "x", "echo": "no"}, "echo", "boolean"),
    ({"prompt": "x", "suffix": "y"}, "suffix", "not supported"),
    ({"prompt": "x", "best_of": 3}, "best_of", "best_of"),
])
def test_completion_bad_inputs(body, param, words):
    e = _err(R.parse_completion_request, body)
    assert e.status == 400 and e.param == param and words in e.message, (e.param, e.message)


def test_completion_defaults():
    r = R.parse_completion_request({"prompt": "x", "logprobs": 2, "echo": True, "n": 3})
    assert r.sampling.max_new_tokens == 16 and r.logprobs == 2 and r.echo and r.n == 3


# --------------------------------------------------------------------------- native

def test_generate_request_shapes():
    r = R.parse_generate_request({"text": "a", "sampling_params": {"max_new_tokens": 3}})
    assert r.prompts == ["a"] and not r.is_batch and r.sampling[0].max_new_tokens == 3
    r = R.parse_generate_request({"input_ids": [[1, 2], [3]], "return_logprob": [True, False],
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
    ({"input_ids": [1.5]}, "input_ids[0]", "integer"),
    ({"text": "a", "sampling_params": {"temperature": -1}}, "sampling_params.temperature", "between 0"),
    ({"text": "a", "sampling_params": {"temprature": 0}}, "sampling_params",
     "unknown sampling parameter 'temprature' (did you mean 'temperature'?)"),
    ({"text": "a", "sampling_params": {"max_new_tokens": "5"}}, "sampling_params.max_new_tokens",
     "integer"),
    ({"text": ["a", "b"], "sampling_params": [{}, {"top_k": -5}]}, "sampling_params[1].top_k",
     "between -1"),
    ({"text": "a", "sampling_params": {"seed": 2 ** 63 - 1, "n": 2}}, "sampling_params.seed",
     "seed + n - 1"),
    ({"text": "a", "sampling_params": {"regex": "a", "ebnf": "b"}}, "sampling_params", "at most one"),
    ({"text": "a", "sampling_params": [{}, {}]}, "sampling_params", "2 entries"),
    ({"text": "a", "sampling_params": 3}, "sampling_params", "object"),
    ({"text": ["a", "b"], "rid": "x"}, "rid", "one string per prompt"),
    ({"text": "a", "return_logprob": "yes"}, "return_logprob", "boolean"),
    ({"text": "a", "top_logprobs_num": 99}, "top_logprobs_num", "between 0 and 20"),
    ({"text": ["a", "b"], "return_logprob": [True]}, "return_logprob", "one per prompt"),
])
def test_generate_bad_inputs(body, param, words):
    e = _err(R.parse_generate_request, body)
    assert e.status == 400 and e.param == param and words in e.message, (e.param, e.message)


def test_check_prompt_ids():
    R.check_prompt_ids([1, 2], 10, 8, 6, "prompt", "max_tokens")
    R.check_prompt_ids([1, 2], 10, 8, None, "prompt", "max_tokens")
    e = _err(R.check_prompt_ids, [], 10, 8, 1, "prompt", "max_tokens")
    assert e.param == "prompt" and "empty" in e.message
    e = _err(R.check_prompt_ids, [1, 10], 10, 8, 1, "prompt", "max_tokens")
    assert e.param == "prompt" and "token id 10" in e.message
    e = _err(R.check_prompt_ids, list(range(8)), 10, 8, None, "messages", "max_tokens")
    assert e.param == "messages" and "context length is 8" in e.message
    e = _err(R.check_prompt_ids, [1, 2], 10, 8, 7, "prompt", "max_completion_tokens")
    assert e.param == "max_completion_tokens" and "at most 6" in e.message


# --------------------------------------------------------------------------- caps, grammars, extras

from radixserve.server import schemas as S  # noqa: E402


@pytest.mark.parametrize("fn, body, param, words", [
    (R.parse_chat_request, {"messages": [{"role": "user", "content": "x"}] * (S.MAX_MESSAGES + 1)},
     "messages", f"at most {S.MAX_MESSAGES} entries"),
    (R.parse_chat_request, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]
                                          * (S.MAX_CONTENT_PARTS + 1)}]},
     "messages[0].content", f"at most {S.MAX_CONTENT_PARTS} entries"),
    (R.parse_chat_request, {**CHAT, "tools": [{}] * (S.MAX_TOOLS + 1)}, "tools", f"at most {S.MAX_TOOLS}"),
    (R.parse_chat_request, {"messages": [{"role": "user", "content": "x" * (S.MAX_TEXT_CHARS + 1)}]},
     "messages[0].content", f"at most {S.MAX_TEXT_CHARS} characters"),
    (R.parse_chat_request, {**CHAT, "logit_bias": {str(i): 1 for i in range(S.MAX_LOGIT_BIAS + 1)}},
     "logit_bias", f"at most {S.MAX_LOGIT_BIAS} entries"),
    (R.parse_chat_request, {**CHAT, "guided_choice": ["a"] * (S.MAX_CHOICES + 1)}, "guided_choice",
     f"at most {S.MAX_CHOICES} entries"),
    (R.parse_completion_request, {"prompt": ["a"] * (S.MAX_PROMPTS + 1)}, "prompt",
     f"at most {S.MAX_PROMPTS} entries"),
    (R.parse_completion_request, {"prompt": [1] * (S.MAX_PROMPT_TOKENS + 1)}, "prompt",
     f"at most {S.MAX_PROMPT_TOKENS} entries"),
    (R.parse_completion_request, {"prompt": ["a"] * 40, "n": 128}, "n",
     f"40 prompts x n=128 = 5120 sequences; at most {S.MAX_SEQUENCES}"),
    (R.parse_generate_request, {"text": ["a"] * 33, "sampling_params": {"n": 128}}, "sampling_params.n",
     f"at most {S.MAX_SEQUENCES}"),
    (R.parse_generate_request, {"input_ids": [[1]] * (S.MAX_PROMPTS + 1)}, "input_ids",
     f"at most {S.MAX_PROMPTS} entries"),
    (R.parse_generate_request, {"text": "a", "rid": "r" * (S.MAX_NAME_CHARS + 1)}, "rid",
     f"at most {S.MAX_NAME_CHARS} characters"),
    (R.parse_generate_request, {"text": "a", "sampling_params": {"stop_regex": ["a"] * 17}},
     "sampling_params.stop_regex", "at most 16"),
])
def test_every_list_and_string_is_capped(fn, body, param, words):
    e = _err(fn, body)
    assert e.status == 400 and e.param == param and words in e.message, (e.param, e.message)


def test_bounds_are_inclusive_at_the_engine_types():
    """The largest values the engine's types hold pass; one more is refused (above)."""
    sp = R.parse_chat_request({**CHAT, "seed": 2 ** 63 - 128, "n": 128, "top_k": 2 ** 31 - 1,
                               "max_tokens": 2 ** 31 - 1, "temperature": 10000,
                               "repetition_penalty": 1e-20}).sampling
    assert (sp.seed, sp.top_k, sp.max_new_tokens) == (2 ** 63 - 128, 2 ** 31 - 1, 2 ** 31 - 1)
    assert R.parse_chat_request({**CHAT, "seed": -(2 ** 63)}).sampling.seed == -(2 ** 63)


def test_documented_ignored_fields_pass_unknown_ones_are_400s_and_message_keys_kept():
    r = R.parse_chat_request({"messages": [{"role": "user", "content": "hi", "name": "bob"},
                                           {"role": "assistant", "content": None,
                                            "tool_calls": [{"id": "1"}], "reasoning": "r"}],
                              "user": "u-1", "metadata": {"a": 1}, "parallel_tool_calls": True})
    assert r.messages[0] == {"role": "user", "content": "hi", "name": "bob"}
    assert r.messages[1] == {"role": "assistant", "content": "", "tool_calls": [{"id": "1"}],
                             "reasoning": "r"}
    assert R.parse_completion_request({"prompt": "x", "user": "u"}).prompts == ["x"]
    assert _err(R.parse_generate_request, {"text": "x", "custom": 1}).param == "custom"
    assert _err(R.parse_chat_request, {"messages": [{"role": "user", "content": "hi"}],
                                       "temprature": 1}).param == "temprature"
    e = _err(R.parse_chat_request, {"messages": [{"role": "assistant"}]})
    assert e.param == "messages[0].content" and "required" in e.message


@pytest.mark.parametrize("extra, kind, spec", [
    ({"response_format": {"type": "json_object"}}, "json_schema", '{"type": "object"}'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                                                 "schema": {"type": "integer"}}}},
     "json_schema", '{"type": "integer"}'),
    ({"json_schema": {"type": "string"}}, "json_schema", '{"type": "string"}'),
    ({"json_schema": '{"type": "string"}'}, "json_schema", '{"type": "string"}'),
    ({"guided_json": {"type": "null"}}, "json_schema", '{"type": "null"}'),
    ({"guided_regex": "[ab]+"}, "regex", "[ab]+"),
    ({"regex": "a|b"}, "regex", "a|b"),
    ({"guided_choice": ["yes", "no.", "a b"]}, "regex", r"(yes|no\.|a\ b)"),
    ({"guided_grammar": 'root ::= "x"'}, "ebnf", 'root ::= "x"'),
    ({"ebnf": 'root ::= "y"'}, "ebnf", 'root ::= "y"'),
    ({"structural_tag": {"type": "structural_tag", "format": {}}}, "structural_tag",
     '{"type": "structural_tag", "format": {}}'),
])
def test_openai_grammar_fields_reach_sampling_params(extra, kind, spec):
    for parse, body in ((R.parse_chat_request, CHAT), (R.parse_completion_request, {"prompt": "x"})):
        sp = parse({**body, **extra}).sampling
        assert sp.grammar_key == (kind, spec)


def test_response_format_text_is_no_constraint_and_two_constraints_are_refused():
    assert R.parse_chat_request({**CHAT, "response_format": {"type": "text"}}).sampling.grammar_key is None
    e = _err(R.parse_chat_request, {**CHAT, "response_format": {"type": "json_object"},
                                    "guided_regex": "a"})
    assert e.param == "guided_regex" and "response_format, guided_regex" in e.message


def test_logit_bias_and_stop_regex_pass_through():
    sp = R.parse_chat_request({**CHAT, "logit_bias": {"5": -100, "7": 2.5}, "stop_regex": "a+b"}).sampling
    assert sp.logit_bias == {5: -100.0, 7: 2.5} and sp.stop_regexes == ["a+b"]
    r = R.parse_generate_request({"text": "x", "sampling_params": {
        "json_schema": {"type": "object"}, "stop_regex": ["x", "y+"], "logit_bias": {"3": 1}}})
    sp = r.sampling[0]
    assert sp.json_schema == '{"type": "object"}' and sp.stop_regexes == ["x", "y+"]
    assert sp.logit_bias == {3: 1.0}
    sp = R.parse_generate_request({"text": "x", "sampling_params": {
        "structural_tag": {"format": {"type": "const_string", "value": "hi"}}}}).sampling[0]
    assert sp.grammar_key == ("structural_tag", '{"format": {"type": "const_string", "value": "hi"}}')
    e = _err(R.parse_generate_request, {"text": "x", "sampling_params": {"stop_regex": "("}})
    assert e.param == "sampling_params.stop_regex" and "regular expression" in e.message


def test_native_sampling_defaults_and_null_max_new_tokens():
    r = R.parse_generate_request({"text": "x"})
    assert r.sampling[0].max_new_tokens == 128 and r.sampling[0].temperature == 1.0
    r = R.parse_generate_request({"text": "x", "sampling_params": {"max_new_tokens": None}})
    assert r.sampling[0].max_new_tokens is None            # up to the context length
