"""What SGLang's and vLLM's own server tests expect from the OpenAI routes, expressed over the
fake engine through the official `openai` client (issue 40.7): completions over a matrix of
echo x logprobs x prompt lists x n x token prompts (each choice aligned with its own prompt,
streamed and not), streamed chat with n and logprobs (one role chunk and one finish_reason per
choice, one usage chunk), every stream_options combination on both routes, /v1/responses'
SGLang sampling extensions, id checks and usage names, and /v1/score's error shape (OpenAI's
plus SGLang's flat fields)."""
import itertools

import openai
import pytest


from test_server_fake_engine import LOCAL, REPLY, err_of, sse_events
from test_server_fake_engine import client, engine  # noqa: F401 (its fixtures)

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture()
def oai(client):
    return openai.OpenAI(base_url=LOCAL + "/v1", api_key="unused", http_client=client,
                         max_retries=0)


# --------------------------------------------------------------------------- completions

PROMPTS = ["ab", "xyz"]            # different lengths, so a choice given another's prompt shows


@pytest.mark.parametrize("echo, logprobs, as_list, n, as_ids",
                         list(itertools.product([False, True], [None, 2], [False, True], [1, 2],
                                                [False, True])))
def test_completions_choices_follow_their_prompts_streamed_and_not(oai, echo, logprobs, as_list,
                                                                   n, as_ids):
    """SGLang's completion matrix: choice i belongs to prompt i // n; its text (with echo, the
    prompt first), its logprobs (tokens, token_logprobs, top_logprobs, text_offset: one entry
    per token, the prompt's first with echo) and the usage (each prompt counted once) line up;
    the stream gives the same per choice, one finish_reason each, and one usage chunk."""
    prompts = [list(p.encode()) if as_ids else p for p in PROMPTS]
    prompt = prompts if as_list else prompts[0]
    texts = PROMPTS if as_list else PROMPTS[:1]
    kw = dict(model="fake", prompt=prompt, max_tokens=3, temperature=0, echo=echo,
              logprobs=logprobs, n=n)
    r = oai.completions.create(**kw)
    assert [c.index for c in r.choices] == list(range(len(texts) * n))
    for c in r.choices:
        own = texts[c.index // n]
        assert c.text == (own if echo else "") + REPLY[:3] and c.finish_reason == "length"
        if logprobs is None:
            assert c.logprobs is None
            continue
        lp = c.logprobs
        assert "".join(lp.tokens) == c.text
        assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(c.text)
        assert lp.text_offset == list(range(len(c.text)))
        if echo:                    # the prompt's first token has no logprob, as OpenAI's
            assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[-3:] == [-0.25, -0.5, -0.75]
        assert lp.top_logprobs[-3] == {"P": -0.25, "x": -9.0}
    assert r.usage.prompt_tokens == sum(len(t) for t in texts)
    assert r.usage.completion_tokens == 3 * len(r.choices)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    streamed, tokens, finishes, usages = {}, {}, {}, []
    for chunk in oai.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            assert chunk.choices == []
            usages.append(chunk.usage)
            continue
        assert usages == []                          # the usage chunk comes last
        (c,) = chunk.choices
        streamed[c.index] = streamed.get(c.index, "") + c.text
        if logprobs is not None:
            assert c.logprobs.tokens
            tokens[c.index] = tokens.get(c.index, []) + c.logprobs.tokens
        if c.finish_reason is not None:
            finishes[c.index] = finishes.get(c.index, 0) + 1
    assert streamed == {c.index: c.text for c in r.choices}
    if logprobs is not None:
        assert tokens == {c.index: c.logprobs.tokens for c in r.choices}
    assert finishes == {c.index: 1 for c in r.choices}
    assert len(usages) == 1 and usages[0].model_dump() == r.usage.model_dump()


# --------------------------------------------------------------------------- chat

@pytest.mark.parametrize("top_logprobs, n", [(None, 1), (None, 2), (2, 1), (2, 2)])
def test_chat_stream_with_n_and_logprobs(oai, top_logprobs, n):
    """SGLang's streamed chat: each choice opens with a role chunk, every later chunk before
    the finish carries content and (asked) logprobs with top_logprobs alternatives, each choice
    has exactly one finish_reason, and include_usage adds exactly one usage chunk."""
    firsts, texts, finishes, usages = {}, {}, {}, []
    for chunk in oai.chat.completions.create(
            model="fake", messages=HI, max_tokens=4, temperature=0, n=n, stream=True,
            logprobs=top_logprobs is not None, top_logprobs=top_logprobs,
            stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usages.append(chunk.usage)
            continue
        (c,) = chunk.choices
        if c.index not in firsts:
            firsts[c.index] = c.delta.role
            continue
        texts[c.index] = texts.get(c.index, "") + c.delta.content
        if top_logprobs is not None:
            assert len(c.logprobs.content) == 1
            assert len(c.logprobs.content[0].top_logprobs) == top_logprobs
            assert c.logprobs.content[0].token == c.delta.content
        if c.finish_reason is not None:
            finishes[c.index] = finishes.get(c.index, 0) + 1
    assert firsts == {i: "assistant" for i in range(n)}
    assert texts == {i: REPLY[:4] for i in range(n)}
    assert finishes == {i: 1 for i in range(n)}
    prompt = len("<user>hi<assistant>")
    assert [(u.prompt_tokens, u.completion_tokens, u.total_tokens) for u in usages] == \
        [(prompt, 4 * n, prompt + 4 * n)]


# --------------------------------------------------------------------------- stream_options

def _stream(client, route: str, options):
    body = {"model": "fake", "max_tokens": 3, "stream": True}
    body.update({"messages": HI} if route == "chat" else {"prompt": "hi"})
    if options is not ...:
        body["stream_options"] = options
    r = client.post(f"/v1/{'chat/completions' if route == 'chat' else 'completions'}", json=body)
    assert r.status_code == 200, r.text
    return sse_events(r)


@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize("options", [..., None, {}, {"include_usage": False},
                                     {"include_usage": False, "continuous_usage_stats": True},
                                     {"continuous_usage_stats": True}])
def test_stream_without_include_usage_has_no_usage(client, route, options):
    """vLLM's combinations without include_usage (continuous_usage_stats alone included): no
    chunk carries usage, and none is a usage chunk."""
    events = _stream(client, route, options)
    assert all(e.get("usage") is None and len(e["choices"]) == 1 for e in events)
    assert events[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_include_usage_alone_is_one_last_chunk(client, route):
    """include_usage: every choice chunk has usage null (the key present, as OpenAI's), then
    one chunk with no choices and the whole usage."""
    *chunks, last = _stream(client, route, {"include_usage": True, "continuous_usage_stats": False})
    assert all("usage" in e and e["usage"] is None and len(e["choices"]) == 1 for e in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    prompt = len("<user>hi<assistant>") if route == "chat" else 2
    assert last["choices"] == [] and last["usage"]["prompt_tokens"] == prompt
    assert (last["usage"]["completion_tokens"], last["usage"]["total_tokens"]) == (3, prompt + 3)


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_continuous_usage_grows_on_every_chunk_then_the_usage_chunk(client, route):
    """include_usage + continuous_usage_stats (vLLM, SGLang): every chunk carries usage; the
    completion count grows with each chunk that has a token (chat's role chunk counts 0) and
    total = prompt + completion; the last chunk (no choices) repeats the final usage."""
    *chunks, last = _stream(client, route, {"include_usage": True, "continuous_usage_stats": True})
    counts = [e["usage"]["completion_tokens"] for e in chunks]
    assert counts == ([0, 1, 2, 3] if route == "chat" else [1, 2, 3])
    for e in chunks + [last]:
        u = e["usage"]
        assert u["prompt_tokens"] > 0 and u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3
    assert last["usage"]["total_tokens"] == chunks[-1]["usage"]["total_tokens"]


@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize("options", [{"include_usage": None}, {"include_usage": True},
                                     {"continuous_usage_stats": None},
                                     {"continuous_usage_stats": True}])
def test_stream_options_without_stream_is_a_400(client, engine, route, options):
    """vLLM: stream_options with stream false is a 4xx; nothing runs."""
    body = {"model": "fake", "stream": False, "stream_options": options}
    body.update({"messages": HI} if route == "chat" else {"prompt": "hi"})
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    assert "stream" in err_of(client.post(path, json=body), 400, "stream_options")["message"]
    assert engine.seen == []


# --------------------------------------------------------------------------- /v1/responses

def test_responses_take_sglangs_sampling_extensions(client, engine):
    """SGLang's /v1/responses also takes frequency_penalty, presence_penalty,
    repetition_penalty, top_k, min_p and stop; they reach the sampler."""
    r = client.post("/v1/responses", json={
        "model": "fake", "input": "hi", "max_output_tokens": 8, "temperature": 0,
        "frequency_penalty": 1.0, "presence_penalty": 0.5, "repetition_penalty": 1.1,
        "top_k": 5, "min_p": 0.1, "stop": "is"})
    assert r.status_code == 200, r.text
    sp = engine.seen[0].sampling_params
    assert (sp.frequency_penalty, sp.presence_penalty, sp.repetition_penalty, sp.top_k,
            sp.min_p, list(sp.stop_strs)) == (1.0, 0.5, 1.1, 5, 0.1, ["is"])
    assert r.json()["output"][0]["content"][0]["text"] == "Pari"      # "Paris" ends in "is"
    for field, value in [("frequency_penalty", "high"), ("top_k", 1.5), ("stop", [""]),
                         ("repetition_penalty", 0)]:
        err = err_of(client.post("/v1/responses", json={"input": "hi", field: value}), 400)
        assert err["param"].startswith(field), err
    assert len(engine.seen) == 1


def test_responses_usage_has_sglangs_names_too(oai):
    r = oai.responses.create(model="fake", input="hi", max_output_tokens=4, temperature=0)
    u = r.usage
    assert (u.prompt_tokens, u.completion_tokens) == (u.input_tokens, u.output_tokens) == \
        (len("<user>hi<assistant>"), 4)
    assert u.total_tokens == u.input_tokens + u.output_tokens


def test_a_malformed_response_id_is_a_400_and_an_unknown_one_404(client, engine):
    """As SGLang and vLLM: an id without the "resp_" prefix is a 400 naming the field, one with
    it that is not stored a 404; nothing runs."""
    for bad in ("bad", "msg_123"):
        err = err_of(client.post("/v1/responses", json={"input": "Hi", "previous_response_id": bad}),
                     400, "previous_response_id")
        assert err["type"] == "invalid_request_error" and "resp_" in err["message"]
        err_of(client.get(f"/v1/responses/{bad}"), 400, "response_id")
        err_of(client.delete(f"/v1/responses/{bad}"), 400, "response_id")
    err_of(client.post("/v1/responses", json={"input": "Hi", "previous_response_id": "resp_x"}),
           404, "previous_response_id")
    err_of(client.get("/v1/responses/resp_x"), 404, "response_id")
    assert engine.seen == []


# --------------------------------------------------------------------------- /v1/score

def test_score_errors_carry_sglangs_flat_fields_beside_openais(client, engine):
    """SGLang's clients of /v1/score read body["type"] == "BadRequestError" and
    body["message"]; OpenAI's read body["error"]. Both are there, route and door errors alike."""
    r = client.post("/v1/score", json={"model": "fake", "query": "The capital of France is",
                                       "items": ["Paris", "London"], "label_token_ids": [999999],
                                       "apply_softmax": True})
    err = err_of(r, 400, "label_token_ids")
    body = r.json()
    assert body["type"] == "BadRequestError" and body["object"] == "error"
    assert "Token ID 999999 is out of vocabulary" in body["message"]
    assert (body["message"], body["param"], body["code"]) == (err["message"], err["param"], 400)
    assert err["type"] == "invalid_request_error"
    r = client.post("/v1/score", json={"model": "gpt-4", "query": "q", "items": ["a"],
                                       "label_token_ids": [1]})
    assert err_of(r, 404, "model") and r.json()["type"] == "NotFoundError"
    r = client.post("/v1/score", content=b"{oops", headers={"content-type": "application/json"})
    assert err_of(r, 400) and r.json()["type"] == "BadRequestError"
    r = client.get("/v1/score")                                          # 405, the router's
    assert err_of(r, 405) and r.json()["type"] == "MethodNotAllowedError"
    assert engine.seen == []
    # the other routes keep OpenAI's shape alone
    assert set(client.post("/v1/completions", json={"model": "gpt-4", "prompt": "a"}).json()) == {"error"}


def test_score_text_and_token_ids_agree_and_softmax_sums_to_one(client):
    """SGLang's score tests: one row per item, one float per label in label order; with
    apply_softmax each row sums to 1; text and token-id input give the same scores."""
    labels = [ord("P"), ord("L"), ord("B")]
    by_text = client.post("/v1/score", json={"query": "The capital is ", "items": ["Paris", "Lyon"],
                                             "label_token_ids": labels, "apply_softmax": True}).json()
    by_ids = client.post("/v1/score", json={"query": list(b"The capital is "),
                                            "items": [list(b"Paris"), list(b"Lyon")],
                                            "label_token_ids": labels, "apply_softmax": True}).json()
    assert by_text["object"] == "scoring" and by_text["scores"] == by_ids["scores"]
    assert [len(row) for row in by_text["scores"]] == [3, 3]
    assert all(isinstance(v, float) for row in by_text["scores"] for v in row)
    assert all(abs(sum(row) - 1.0) < 1e-9 for row in by_text["scores"])
    assert by_text["usage"]["prompt_tokens"] == len("The capital is Paris") + len("The capital is Lyon")
