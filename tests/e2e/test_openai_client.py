"""The OpenAI-compatible routes through the official `openai` client against the real server
and the default model: chat and completions, streamed and not, usage, n>1, logprobs, stop
strings across token boundaries, UTF-8 boundaries in streamed deltas."""
import math

import openai
import pytest

pytestmark = pytest.mark.slow

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
FRUITS = "Fruits: 🍎🍌🍇🍓🍒🍑"        # the model continues with emoji, 3 byte-tokens each


def _stream_chat(oai, **kw):
    """(deltas, finish_reasons by index, usage or None, role of each choice's first chunk)."""
    deltas, finish, roles, usage = {}, {}, {}, None
    for chunk in oai.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            usage = chunk.usage
            continue
        for c in chunk.choices:
            roles.setdefault(c.index, c.delta.role)
            if c.delta.content:
                deltas.setdefault(c.index, []).append(c.delta.content)
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    return deltas, finish, usage, roles


def test_models_list(oai, server):
    models = oai.models.list().data
    assert [m.id for m in models] == [server.model] and models[0].owned_by == "radixserve"
    assert isinstance(models[0].max_model_len, int)                     # SGLang's test reads it
    card = oai.models.retrieve(server.model)
    assert (card.id, card.root) == (server.model, server.model)
    with pytest.raises(openai.NotFoundError) as e:
        oai.models.retrieve("non-existent-model")
    assert e.value.body["type"] == "not_found_error"


def test_chat_capital_of_france(oai, server):
    r = oai.chat.completions.create(model=server.model, messages=FRANCE, temperature=0, max_tokens=16)
    assert r.object == "chat.completion" and r.model == server.model
    choice = r.choices[0]
    assert "Paris" in choice.message.content and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens > 10 and 0 < u.completion_tokens <= 16
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert 0 <= u.prompt_tokens_details.cached_tokens < u.prompt_tokens


def test_chat_stream_equals_non_stream_with_usage(oai, server):
    kw = dict(model=server.model, messages=FRANCE, temperature=0, max_tokens=12)
    full = oai.chat.completions.create(**kw)
    deltas, finish, usage, roles = _stream_chat(oai, stream_options={"include_usage": True}, **kw)
    assert roles == {0: "assistant"}
    assert "".join(deltas[0]) == full.choices[0].message.content
    assert finish == {0: full.choices[0].finish_reason}
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # the repeated prompt is served from the radix cache: all but its last token
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1


def test_completions_stream_and_non_stream(oai, server):
    kw = dict(model=server.model, prompt="The capital of France is", temperature=0, max_tokens=6)
    full = oai.completions.create(**kw)
    assert full.object == "text_completion" and "Paris" in full.choices[0].text
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 6
    pieces, usage = [], None
    for chunk in oai.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
        else:
            usage = chunk.usage
    assert "".join(pieces) == full.choices[0].text
    assert usage.completion_tokens == 6 and usage.prompt_tokens == full.usage.prompt_tokens
    echoed = oai.completions.create(echo=True, **kw)
    assert echoed.choices[0].text == "The capital of France is" + full.choices[0].text


def test_completions_batch_of_token_prompts(oai, server, http):
    texts = ["The capital of France is", "1, 2, 3,"]
    ids = [[e[1] for e in http.post("/generate", json={
        "text": t, "return_logprob": True, "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 1}}).json()["meta_info"]["input_token_logprobs"]]
        for t in texts]
    by_text = oai.completions.create(model=server.model, prompt=texts, temperature=0, max_tokens=4)
    by_ids = oai.completions.create(model=server.model, prompt=ids, temperature=0, max_tokens=4)
    assert [c.index for c in by_ids.choices] == [0, 1]
    assert [c.text for c in by_ids.choices] == [c.text for c in by_text.choices]
    assert "Paris" in by_ids.choices[0].text and "4" in by_ids.choices[1].text
    assert by_ids.usage.prompt_tokens == len(ids[0]) + len(ids[1])


def test_batched_completions_with_logprobs_and_echo_match_each_prompt_alone(oai, server):
    """SGLang's and vLLM's batched completions: several prompts in one call with logprobs and
    echo; each choice is what its prompt gives alone (text, tokens, logprobs), streamed too."""
    prompts = ["The capital of France is", "1, 2, 3,"]
    kw = dict(model=server.model, temperature=0, max_tokens=3, logprobs=2, echo=True)
    batch = oai.completions.create(prompt=prompts, **kw)
    assert [c.index for c in batch.choices] == [0, 1]
    alone = [oai.completions.create(prompt=p, **kw) for p in prompts]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    for c, a, p in zip(batch.choices, alone, prompts):
        single = a.choices[0]
        assert c.text.startswith(p) and c.text == single.text
        assert c.logprobs.tokens == single.logprobs.tokens
        assert "".join(c.logprobs.tokens) == c.text
        assert c.logprobs.token_logprobs[0] is None
        assert c.logprobs.token_logprobs[1:] == pytest.approx(single.logprobs.token_logprobs[1:],
                                                              abs=2e-3)
    texts, usage = {}, []
    for chunk in oai.completions.create(prompt=prompts, stream=True,
                                        stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage.append(chunk.usage)
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {c.index: c.text for c in batch.choices}
    assert [u.completion_tokens for u in usage] == [batch.usage.completion_tokens]


def test_n_choices(oai, server):
    r = oai.chat.completions.create(model=server.model, messages=FRANCE, n=3, temperature=1.0,
                                    seed=7, max_tokens=6, logprobs=True)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)
    single = oai.chat.completions.create(model=server.model, messages=FRANCE, temperature=0, max_tokens=5)
    assert r.usage.prompt_tokens == single.usage.prompt_tokens             # counted once
    assert len({c.message.content for c in r.choices}) > 1                 # seeds differ per choice
    deltas, finish, usage, roles = _stream_chat(oai, model=server.model, messages=FRANCE, n=2,
                                                temperature=0, max_tokens=5,
                                                stream_options={"include_usage": True})
    assert roles == {0: "assistant", 1: "assistant"} and set(finish) == {0, 1}
    assert "".join(deltas[0]) == "".join(deltas[1]) == single.choices[0].message.content
    assert usage.completion_tokens == 2 * single.usage.completion_tokens


def test_chat_logprobs(oai, server):
    r = oai.chat.completions.create(model=server.model, messages=FRANCE, temperature=0, max_tokens=5,
                                    logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:
        assert c.logprob <= 0 and len(c.top_logprobs) == 3
        tops = [t.logprob for t in c.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert c.top_logprobs[0].token == c.token                          # greedy picks the top
        assert math.isclose(c.top_logprobs[0].logprob, c.logprob, abs_tol=1e-4)
        assert bytes(c.bytes).decode("utf-8") == c.token


def test_completion_logprobs_with_echo(oai, server):
    prompt = "The capital of France is"
    r = oai.completions.create(model=server.model, prompt=prompt, temperature=0, max_tokens=3,
                               logprobs=2, echo=True)
    lp = r.choices[0].logprobs
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == n_prompt + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    # the top 2 and, as OpenAI and vLLM, the token itself: up to logprobs + 1 entries
    assert all(1 <= len(t) <= 3 and tok in t for tok, t in zip(lp.tokens[1:], lp.top_logprobs[1:]))
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_stop_string_across_token_boundary(oai, server, http):
    prompt = "The capital of France is"
    g = http.post("/generate", json={"text": prompt, "return_logprob": True,
                                     "return_text_in_logprobs": True,
                                     "sampling_params": {"temperature": 0, "max_new_tokens": 12}}).json()
    text = g["text"]
    toks = [e[2] for e in g["meta_info"]["output_token_logprobs"]]
    assert "".join(toks) == text
    stop = cut = None
    offset = 0
    for a, b in zip(toks, toks[1:]):
        offset += len(a)
        if len(a.strip()) >= 2 and b.strip():
            cand = a[-2:] + b[:1]
            if text.find(cand) == offset - 2:           # first occurrence spans this boundary
                stop, cut = cand, offset - 2
                break
    assert stop is not None, f"no stop string spanning two tokens in {toks}"
    kw = dict(model=server.model, prompt=prompt, temperature=0, max_tokens=12, stop=[stop])
    r = oai.completions.create(**kw)
    assert r.choices[0].text == text[:cut]
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra.get("matched_stop") == stop
    streamed = "".join(c.choices[0].text for c in oai.completions.create(stream=True, **kw) if c.choices)
    assert streamed == text[:cut]
    # chat, streamed: the partial stop string is held back, never sent then retracted
    chat = oai.chat.completions.create(model=server.model, messages=FRANCE, temperature=0, max_tokens=12)
    full = chat.choices[0].message.content
    i = full.find("Paris")
    assert i > 0
    deltas, finish, _, _ = _stream_chat(oai, model=server.model, messages=FRANCE, temperature=0,
                                        max_tokens=12, stop=["aris"])
    assert "".join(deltas.get(0, [])) == full[:i + 1] and finish == {0: "stop"}


def test_utf8_boundaries_in_streamed_deltas(oai, server):
    kw = dict(model=server.model, prompt=FRUITS, temperature=0, max_tokens=9)
    full = oai.completions.create(**kw).choices[0].text
    assert any(ord(ch) > 0xFFFF for ch in full), f"expected emoji, got {full!r}"
    assert "\ufffd" not in full
    deltas = [c.choices[0].text for c in oai.completions.create(stream=True, **kw) if c.choices]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == full
    # chat, streamed, CJK
    chat_kw = dict(model=server.model, temperature=0, max_tokens=8,
                   messages=[{"role": "user", "content": "Repeat exactly: 你好世界 🌍"}])
    whole = oai.chat.completions.create(**chat_kw).choices[0].message.content
    deltas, _, _, _ = _stream_chat(oai, **chat_kw)
    parts = deltas.get(0, [])
    assert all("\ufffd" not in d for d in parts)
    assert "".join(parts) == whole


def test_openai_errors(oai, server):
    import openai
    with pytest.raises(openai.NotFoundError) as e:
        oai.chat.completions.create(model="gpt-4", messages=FRANCE)
    assert "gpt-4" in str(e.value) and server.model in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=server.model, messages=FRANCE, temperature=-1)
    assert "temperature" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=server.model, prompt="hi", max_tokens=10 ** 7)
    assert "max_tokens" in str(e.value)
