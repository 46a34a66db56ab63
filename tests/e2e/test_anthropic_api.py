"""Anthropic's Messages API and vLLM's /tokenize and /detokenize over HTTP on the default
model, through the official anthropic client: a plain message, the stream (every event one of
the SDK's typed events, in Anthropic's order), stop_sequences, forced tool calls (tool_choice
any / tool) and a tool_result round, count_tokens against the server's tokenization, errors in
Anthropic's shape; the tokenizer routes' round trip and the chat route's prompt ids. A second
server of its own (--reasoning-parser deepseek-r1, which reads the whole output of a model that
never closes a <think> block as reasoning, and an API key) serves thinking blocks and the key
check (x-api-key, Bearer, a wrong key)."""

import anthropic
import httpx
import jsonschema
import pytest
from anthropic import types as AT
from conftest import launched_server

pytestmark = pytest.mark.slow

KEY = "sk-anthropic-e2e-7c1d"
STARTUP_TIMEOUT_S = 900
ASK = [{"role": "user", "content": "Name three colors of the rainbow."}]
SYSTEM = "You are a concise assistant."
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 20},
               "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}
ADD = {"name": "add", "description": "Add two integers",
       "input_schema": {"type": "object", "properties": {"a": {"type": "integer"},
                                                         "b": {"type": "integer"}},
                        "required": ["a", "b"]}}
WEATHER_Q = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMAS = {"get_weather": WEATHER["input_schema"], "add": ADD["input_schema"]}
# greedy sampling; this client has no temperature argument, the body field is the server's
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def claude(server):
    """The official anthropic client pointed at the shared server (no key there: the door
    ignores the x-api-key the client always sends)."""
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)


def _text(message: AT.Message) -> str:
    return "".join(b.text for b in message.content if isinstance(b, AT.TextBlock))


def _prompt_tokens(usage) -> int:
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


# --------------------------------------------------------------------------- messages

def test_plain_message_and_count_tokens(claude, server, http):
    kw = dict(model=server.model, system=SYSTEM, messages=ASK)
    m = claude.messages.create(max_tokens=24, metadata={"user_id": "u-1"}, extra_body=GREEDY, **kw)
    assert isinstance(m, AT.Message) and m.role == "assistant" and m.model == server.model
    assert len(m.content) == 1 and isinstance(m.content[0], AT.TextBlock) and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    assert 0 < m.usage.output_tokens <= 24
    count = claude.messages.count_tokens(**kw)
    assert isinstance(count, AT.MessageTokensCount)
    assert count.input_tokens == _prompt_tokens(m.usage)
    # the server's own tokenization of the same conversation as chat messages
    chat = [{"role": "system", "content": SYSTEM}] + ASK
    assert http.post("/tokenize", json={"messages": chat}).json()["count"] == count.input_tokens


def test_stream_is_anthropics_typed_event_sequence(claude, server):
    kw = dict(model=server.model, messages=ASK, max_tokens=24, extra_body=GREEDY)
    plain = claude.messages.create(**kw)
    events = list(claude.messages.create(stream=True, **kw))
    assert isinstance(events[0], AT.RawMessageStartEvent)
    assert events[0].message.content == [] and events[0].message.stop_reason is None
    assert isinstance(events[1], AT.RawContentBlockStartEvent)
    assert isinstance(events[1].content_block, AT.TextBlock)
    *blocks, closing, delta, stop = events[1:]
    assert isinstance(closing, AT.RawContentBlockStopEvent) and closing.index == 0
    assert isinstance(delta, AT.RawMessageDeltaEvent) and isinstance(stop, AT.RawMessageStopEvent)
    deltas = blocks[1:]
    assert deltas and all(isinstance(e, AT.RawContentBlockDeltaEvent) and e.index == 0
                          and isinstance(e.delta, AT.TextDelta) for e in deltas)
    assert "".join(e.delta.text for e in deltas) == _text(plain)
    assert delta.delta.stop_reason == plain.stop_reason
    assert delta.usage.output_tokens == plain.usage.output_tokens
    # the SDK's stream helper accumulates the same message
    with claude.messages.stream(**kw) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == _text(final) == _text(plain)
    assert final.stop_reason == plain.stop_reason


def test_stop_sequences(claude, server):
    kw = dict(model=server.model, messages=ASK, max_tokens=32, extra_body=GREEDY)
    text = _text(claude.messages.create(**kw))
    words = text.split()
    assert len(words) >= 4, text
    word = words[len(words) // 2]
    m = claude.messages.create(stop_sequences=["\x07never", word], **kw)
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", word)
    assert _text(m) == text[:text.index(word)]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "add"}])
def test_forced_tool_use(claude, server, choice, stream):
    kw = dict(model=server.model, messages=WEATHER_Q, tools=[WEATHER, ADD], tool_choice=choice,
              max_tokens=120, extra_body=GREEDY)
    if stream:
        with claude.messages.stream(**kw) as s:
            kinds = {getattr(e, "delta", None).type for e in s if e.type == "content_block_delta"}
            m = s.get_final_message()
        assert "input_json_delta" in kinds
    else:
        m = claude.messages.create(**kw)
    calls = [b for b in m.content if isinstance(b, AT.ToolUseBlock)]
    assert len(calls) == 1 and calls[0].id.startswith("toolu_")
    assert m.stop_reason == "tool_use"
    call = calls[0]
    assert call.name == choice.get("name", call.name) and call.name in SCHEMAS
    jsonschema.validate(call.input, SCHEMAS[call.name])


def test_tool_result_round(claude, server):
    kw = dict(model=server.model, tools=[WEATHER], extra_body=GREEDY)
    first = claude.messages.create(messages=WEATHER_Q, tool_choice={"type": "any"},
                                   max_tokens=120, **kw)
    assert first.stop_reason == "tool_use"
    call = next(b for b in first.content if isinstance(b, AT.ToolUseBlock))
    messages = WEATHER_Q + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": '{"temperature": 21, "unit": "celsius"}'}]}]
    second = claude.messages.create(messages=messages, max_tokens=24, **kw)
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert _prompt_tokens(second.usage) > _prompt_tokens(first.usage) + first.usage.output_tokens
    count = claude.messages.count_tokens(model=server.model, tools=[WEATHER], messages=messages)
    assert count.input_tokens == _prompt_tokens(second.usage)


def test_errors_are_anthropics_shape_and_leak_nothing(claude, server, http):
    r = http.post("/v1/messages", json={"model": server.model, "messages": ASK})
    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                   "message": "max_tokens is required"}}
    for bad in (dict(messages=[{"role": "system", "content": "hi"}]),
                dict(messages=ASK, extra_body={"temperature": -0.5}),
                dict(messages=ASK, max_tokens=10 ** 7)):
        with pytest.raises(anthropic.BadRequestError) as info:
            claude.messages.create(model=server.model, **{"max_tokens": 4, **bad})
        assert info.value.status_code == 400
        assert info.value.body["type"] == "error"
        assert info.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as info:
        claude.messages.create(model="claude-nonexistent", messages=ASK, max_tokens=4)
    assert info.value.body["error"]["type"] == "not_found_error"
    server.wait_idle()
    assert server.metric("num_used_tokens") == 0


# --------------------------------------------------------------------------- tokenizer routes

def test_tokenize_detokenize_round_trip(http):
    text = "The quick brown fox, <b>naïve</b> café."
    r = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False,
                                     "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    card = http.get("/v1/models").json()["data"][0]
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"]) > 5
    assert body["max_model_len"] == card["max_model_len"]
    back = http.post("/detokenize", json={"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}


def test_tokenized_chat_is_the_chat_routes_prompt(http, server):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello!"}]
    tokens = http.post("/tokenize", json={"model": server.model, "messages": messages}).json()["tokens"]
    chat = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1,
                                                   "return_token_ids": True})
    assert chat.status_code == 200 and chat.json()["prompt_token_ids"] == tokens
    bare = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False})
    assert tokens[:len(bare.json()["tokens"])] == bare.json()["tokens"]
    assert len(tokens) > len(bare.json()["tokens"])


def test_bad_token_ids_are_400s(http):
    vocab = http.get("/v1/models").json()["data"][0]["vocab_size"]
    for tokens, param in (([1, vocab], "tokens"), ([-3], "tokens[0]"), ([1, 2 ** 40], "tokens[1]")):
        r = http.post("/detokenize", json={"tokens": tokens})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# --------------------------------------------------------------------------- a reasoning server with a key

@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    """A server of the default model with --reasoning-parser deepseek-r1 and an API key."""
    args = ["--reasoning-parser", "deepseek-r1", "--api-key", KEY, "--max-total-tokens", "4096"]
    with launched_server(tmp_path_factory.mktemp("thinker"), args,
                         headers={"x-api-key": KEY}) as srv:
        yield srv.url, srv.model


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_blocks(thinker, stream):
    url, model = thinker
    client = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=300)
    kw = dict(model=model, messages=ASK, max_tokens=16, extra_body=GREEDY)
    if stream:
        with client.messages.stream(**kw) as s:
            events = list(s)
            m = s.get_final_message()
        deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
        assert deltas.count("thinking_delta") > 1 and deltas[-1] == "signature_delta"
    else:
        m = client.messages.create(**kw)
    assert len(m.content) == 1 and isinstance(m.content[0], AT.ThinkingBlock)
    assert m.content[0].thinking.strip() and m.content[0].signature == ""
    assert m.stop_reason in ("end_turn", "max_tokens") and 0 < m.usage.output_tokens <= 16
    assert 0 < m.usage.output_tokens_details.thinking_tokens <= m.usage.output_tokens


def test_the_key_as_x_api_key_or_bearer(thinker):
    url, model = thinker
    kw = dict(model=model, messages=ASK, max_tokens=2)
    for client in (anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0),
                   anthropic.Anthropic(base_url=url, auth_token=KEY, max_retries=0)):
        assert client.messages.create(**kw).usage.output_tokens == 2
        assert client.messages.count_tokens(model=model, messages=ASK).input_tokens > 0
    wrong = anthropic.Anthropic(base_url=url, api_key="sk-wrong", max_retries=0)
    for call in (lambda: wrong.messages.create(**kw),
                 lambda: wrong.messages.count_tokens(model=model, messages=ASK)):
        with pytest.raises(anthropic.AuthenticationError) as info:
            call()
        assert info.value.status_code == 401
        assert info.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(url + "/tokenize", json={"prompt": "hi"}, headers={"x-api-key": KEY})
    assert r.status_code == 200 and r.json()["count"] > 0
    r = httpx.post(url + "/tokenize", json={"prompt": "hi"})
    assert r.status_code == 401 and r.json()["error"]["code"] == 401     # OpenAI's shape there
