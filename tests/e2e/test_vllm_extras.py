"""vLLM's request extras and the field policy of the OpenAI routes against the real server and the
default model, through the official `openai` client (vLLM's fields via extra_body) and httpx:
prompt_logprobs, stream_options.continuous_usage_stats, truncate_prompt_tokens,
return_token_ids, structured_outputs, stop_regex / include_stop_str_in_output, logprobs 0,
echo of special-token ids; fields accepted and ignored; refused and unknown fields as 400s that
name them."""
import json
import math
import re

import pytest

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
CHAT_TEXT = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"


def _native_prompt(http, text: str, top: int = 0):
    """(prompt ids, input_token_logprobs, input_top_logprobs) of text from /generate."""
    meta = http.post("/generate", json={
        "text": text, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": top,
        "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 1}}).json()["meta_info"]
    lps = meta["input_token_logprobs"]
    return [e[1] for e in lps], lps, meta["input_top_logprobs"]


def _bad(http, path: str, body: dict, param: str, named: bool = True) -> str:
    """A 400 whose param is `param` and (named) whose message names it."""
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and (not named or param.split(".")[-1] in err["message"]), err
    return err["message"]


# --------------------------------------------------------------------------- prompt_logprobs

def test_prompt_logprobs_on_completions(oai, server, http):
    ids, native, native_tops = _native_prompt(http, PROMPT, top=2)
    r = oai.completions.create(model=server.model, prompt=PROMPT, temperature=0, max_tokens=2,
                               extra_body={"prompt_logprobs": 2, "return_token_ids": True})
    choice = r.choices[0]
    plp = choice.model_extra["prompt_logprobs"]
    assert choice.model_extra["prompt_token_ids"] == ids
    assert len(plp) == len(ids) == r.usage.prompt_tokens and plp[0] is None
    assert choice.logprobs is None                       # no output logprobs were asked for
    for j, entry in enumerate(plp[1:], start=1):
        me = entry[str(ids[j])]                           # the prompt token itself is there
        assert math.isclose(me["logprob"], native[j][0], abs_tol=1e-4) and me["logprob"] <= 0
        assert me["decoded_token"] == native[j][2]
        assert 2 <= len(entry) <= 3                       # the token + the top 2
        tops = sorted(entry.values(), key=lambda v: -v["logprob"])
        assert tops[0]["rank"] == 1 and tops[0]["logprob"] >= me["logprob"]
        assert {int(k) for k, v in entry.items() if v["rank"] in (1, 2)} == \
            {t[1] for t in native_tops[j]}
        if me["rank"] is not None:
            assert str(ids[j]) in {str(t[1]) for t in native_tops[j]}


def test_prompt_logprobs_on_chat(oai, server):
    r = oai.chat.completions.create(model=server.model, messages=FRANCE, temperature=0, max_tokens=3,
                                    extra_body={"prompt_logprobs": 0, "return_token_ids": True})
    plp, ids = r.model_extra["prompt_logprobs"], r.model_extra["prompt_token_ids"]
    assert len(plp) == len(ids) == r.usage.prompt_tokens and plp[0] is None
    assert all(list(e) == [str(t)] for e, t in zip(plp[1:], ids[1:]))     # k = 0: the token only
    assert r.choices[0].logprobs is None


def test_prompt_logprobs_refused_when_streaming(http):
    _bad(http, "/v1/completions", {"prompt": PROMPT, "stream": True, "prompt_logprobs": 1},
         "prompt_logprobs")
    _bad(http, "/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 21}, "prompt_logprobs")


# --------------------------------------------------------------------------- continuous usage

def test_continuous_usage_stats_on_every_chunk(oai, server):
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(oai.completions.create(model=server.model, prompt=PROMPT, temperature=0,
                                         max_tokens=6, stream=True, stream_options=opts))
    body, final = chunks[:-1], chunks[-1]
    assert final.choices == [] and final.usage.completion_tokens == 6
    counts = [c.usage.completion_tokens for c in body]
    assert all(c.usage is not None for c in body) and counts == sorted(counts) and counts[-1] == 6
    assert len(set(counts)) == len(counts)               # each chunk brings a new token
    assert all(c.usage.prompt_tokens == final.usage.prompt_tokens and
               c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in body)
    chat = list(oai.chat.completions.create(model=server.model, messages=FRANCE, temperature=0,
                                            max_tokens=5, stream=True, stream_options=opts))
    counts = [c.usage.completion_tokens for c in chat[:-1]]
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == chat[-1].usage.completion_tokens
    plain = list(oai.chat.completions.create(model=server.model, messages=FRANCE, temperature=0,
                                             max_tokens=3, stream=True,
                                             stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage.completion_tokens == 3


# --------------------------------------------------------------------------- truncation, token ids

def test_truncate_prompt_tokens_keeps_the_last_tokens(oai, server, http):
    ids, _, _ = _native_prompt(http, PROMPT)
    kw = dict(model=server.model, temperature=0, max_tokens=4)
    r = oai.completions.create(prompt=PROMPT, echo=True, extra_body={
        "truncate_prompt_tokens": 3, "return_token_ids": True}, **kw)
    assert r.usage.prompt_tokens == 3
    assert r.choices[0].model_extra["prompt_token_ids"] == ids[-3:]
    direct = oai.completions.create(prompt=ids[-3:], echo=True, **kw)
    assert r.choices[0].text == direct.choices[0].text                # echo shows the kept tokens
    assert not r.choices[0].text.startswith("The")
    # a prompt far past the context length passes once cut
    long = oai.completions.create(prompt="hello " * 9000, extra_body={"truncate_prompt_tokens": 8}, **kw)
    assert long.usage.prompt_tokens == 8
    chat = oai.chat.completions.create(messages=FRANCE, extra_body={"truncate_prompt_tokens": 5}, **kw)
    assert chat.usage.prompt_tokens == 5
    _bad(http, "/v1/completions", {"prompt": PROMPT, "truncate_prompt_tokens": 0},
         "truncate_prompt_tokens")


def test_return_token_ids_streamed_and_not(oai, server, http):
    ids, _, _ = _native_prompt(http, PROMPT)
    native = http.post("/generate", json={"text": PROMPT, "sampling_params": {
        "temperature": 0, "max_new_tokens": 6}}).json()
    kw = dict(model=server.model, prompt=PROMPT, temperature=0, max_tokens=6,
              extra_body={"return_token_ids": True})
    r = oai.completions.create(**kw)
    extra = r.choices[0].model_extra
    assert extra["prompt_token_ids"] == ids and extra["token_ids"] == native["output_ids"]
    assert r.choices[0].text == native["text"]
    chunks = [c for c in oai.completions.create(stream=True, **kw) if c.choices]
    assert chunks[0].choices[0].model_extra["prompt_token_ids"] == ids
    assert all("prompt_token_ids" not in c.choices[0].model_extra for c in chunks[1:])
    assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == native["output_ids"]
    chat = oai.chat.completions.create(model=server.model, messages=FRANCE, temperature=0,
                                       max_tokens=5, extra_body={"return_token_ids": True})
    assert len(chat.model_extra["prompt_token_ids"]) == chat.usage.prompt_tokens
    assert len(chat.choices[0].model_extra["token_ids"]) == chat.usage.completion_tokens
    streamed = list(oai.chat.completions.create(model=server.model, messages=FRANCE, temperature=0,
                                                max_tokens=5, stream=True,
                                                extra_body={"return_token_ids": True}))
    assert streamed[0].model_extra["prompt_token_ids"] == chat.model_extra["prompt_token_ids"]
    assert [t for c in streamed[1:] for t in c.choices[0].model_extra["token_ids"]] == \
        chat.choices[0].model_extra["token_ids"]


# --------------------------------------------------------------------------- logprobs 0, echo

def test_logprobs_zero_gives_one_entry_per_token(oai, server):
    r = oai.completions.create(model=server.model, prompt=PROMPT, temperature=0, max_tokens=4,
                               logprobs=0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4 == \
        r.usage.completion_tokens
    assert all(top == {tok: p} for tok, p, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))
    assert "".join(lp.tokens) == r.choices[0].text
    echoed = oai.completions.create(model=server.model, prompt=PROMPT, temperature=0, max_tokens=4,
                                    logprobs=0, echo=True)
    lp = echoed.choices[0].logprobs
    assert len(lp.tokens) == echoed.usage.prompt_tokens + 4 and lp.top_logprobs[0] is None
    assert all(top == {tok: p} for tok, p, top in
               zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]))
    two = oai.completions.create(model=server.model, prompt=PROMPT, temperature=0, max_tokens=4,
                                 logprobs=2)                 # the top 2, and the token itself
    assert all(1 <= len(top) <= 3 and tok in top
               for tok, top in zip(two.choices[0].logprobs.tokens, two.choices[0].logprobs.top_logprobs))


def test_echo_of_special_token_ids_keeps_their_text_and_logprobs(oai, server, http):
    ids, native, _ = _native_prompt(http, CHAT_TEXT)
    assert 1 in ids and 2 in ids                          # <|im_start|>, <|im_end|>
    r = oai.completions.create(model=server.model, prompt=ids, echo=True, logprobs=1,
                               temperature=0, max_tokens=3)
    choice = r.choices[0]
    assert choice.text.startswith(CHAT_TEXT)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + r.usage.completion_tokens
    assert "".join(lp.tokens[:len(ids)]) == CHAT_TEXT and lp.token_logprobs[0] is None
    for j in range(1, len(ids)):
        assert math.isclose(lp.token_logprobs[j], native[j][0], abs_tol=1e-4)
    assert "".join(lp.tokens) == choice.text
    only_special = oai.completions.create(model=server.model, prompt=[1], echo=True, logprobs=0,
                                          temperature=0, max_tokens=2)
    assert only_special.choices[0].text.startswith("<|im_start|>")
    assert only_special.choices[0].logprobs.tokens[0] == "<|im_start|>"
    plain = oai.completions.create(model=server.model, prompt=ids, echo=True, temperature=0,
                                   max_tokens=3)
    assert plain.choices[0].text == choice.text


# --------------------------------------------------------------------------- grammars and stops

def test_structured_outputs(oai, server, http):
    kw = dict(model=server.model, messages=FRANCE, temperature=0, max_tokens=24)
    r = oai.chat.completions.create(extra_body={"structured_outputs": {"choice": ["Paris", "Lyon"]}}, **kw)
    assert r.choices[0].message.content in ("Paris", "Lyon")
    r = oai.chat.completions.create(extra_body={"structured_outputs": {"regex": "[0-9]{3}"}}, **kw)
    assert re.fullmatch("[0-9]{3}", r.choices[0].message.content)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"]}
    r = oai.completions.create(model=server.model, prompt=PROMPT, temperature=0, max_tokens=32,
                               extra_body={"structured_outputs": {"json": schema}})
    assert isinstance(json.loads(r.choices[0].text)["city"], str)
    _bad(http, "/v1/chat/completions", {"messages": FRANCE, "guided_regex": "a",
                                        "structured_outputs": {"regex": "b"}}, "structured_outputs.regex")
    _bad(http, "/v1/chat/completions", {"messages": FRANCE, "structured_outputs": {"regex": "("}},
         "structured_outputs", named=False)              # the compiler's message, the field as param


def test_stop_regex_and_include_stop_str_in_output(oai, server):
    kw = dict(model=server.model, prompt="1, 2, 3,", temperature=0, max_tokens=12)
    full = oai.completions.create(**kw).choices[0].text
    assert "5" in full
    r = oai.completions.create(extra_body={"stop_regex": "[5]"}, **kw)
    assert r.choices[0].finish_reason == "stop" and "5" not in r.choices[0].text
    assert full.startswith(r.choices[0].text)
    cut = full.index("5")
    assert oai.completions.create(stop=["5"], **kw).choices[0].text == full[:cut]
    kept = oai.completions.create(stop=["5"], extra_body={"include_stop_str_in_output": True}, **kw)
    assert kept.choices[0].text == full[:cut + 1]


# --------------------------------------------------------------------------- the field policy

def test_ignored_fields_are_accepted_and_change_nothing(oai, server, http):
    kw = dict(model=server.model, messages=FRANCE, temperature=0, max_tokens=6)
    plain = oai.chat.completions.create(**kw).choices[0].message.content
    r = oai.chat.completions.create(user="u-1", metadata={"team": "a"}, store=False,
                                    service_tier="auto", safety_identifier="s-1",
                                    prompt_cache_key="k", parallel_tool_calls=True,
                                    prediction={"type": "content", "content": "Paris"},
                                    reasoning_effort="none", modalities=["text"],
                                    extra_body={"request_id": "mine", "guided_decoding_backend": "x",
                                                "use_beam_search": False, "cache_salt": "salt-1",
                                                # variables the default model's template never
                                                # reads; a server without --reasoning-parser
                                                "chat_template_kwargs": {"enable_thinking": False},
                                                "separate_reasoning": True},
                                    **kw)
    assert r.choices[0].message.content == plain
    c = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                                           "user": "u", "cache_salt": "s", "priority": 0,
                                           "stream": True, "stream_options": {
                                               "include_usage": True, "include_obfuscation": True}})
    assert c.status_code == 200 and c.text.endswith("data: [DONE]\n\n")


REFUSED = [("/v1/chat/completions", "use_beam_search", True),
           ("/v1/completions", "use_beam_search", True),
           ("/v1/chat/completions", "audio", {"voice": "alloy", "format": "wav"}),
           ("/v1/chat/completions", "modalities", ["text", "audio"]),
           ("/v1/chat/completions", "web_search_options", {}),
           ("/v1/chat/completions", "functions", [{"name": "f", "parameters": {}}]),
           ("/v1/chat/completions", "reasoning_effort", "high"),
           ("/v1/completions", "allowed_token_ids", [1, 2]),
           ("/v1/completions", "bad_words", ["Paris"])]


@pytest.mark.parametrize("path, name, value", REFUSED, ids=[f"{p[4:]}:{n}" for p, n, _ in REFUSED])
def test_refused_fields_are_400s_naming_them(http, path, name, value):
    base = {"messages": FRANCE} if "chat" in path else {"prompt": PROMPT}
    message = _bad(http, path, {**base, "max_tokens": 2, name: value}, name)
    assert "not supported" in message


def test_unknown_fields_are_400s_with_a_hint(oai, server, http):
    import openai
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=server.model, messages=FRANCE, max_tokens=2,
                                    extra_body={"temprature": 0})
    assert "unknown field 'temprature'" in str(e.value) and "did you mean 'temperature'" in str(e.value)
    message = _bad(http, "/v1/chat/completions", {"messages": FRANCE, "stream": True, "stream_options": {
        "continuous_usage": True}}, "stream_options.continuous_usage")
    assert "did you mean 'stream_options.continuous_usage_stats'" in message
    _bad(http, "/v1/completions", {"prompt": PROMPT, "structured_outputs": {"choices": ["a"]}},
         "structured_outputs.choices")
    assert http.get("/health").status_code == 200
