"""Issue 40 point 7: what vLLM's and SGLang's own server tests send that a strict server
refuses. SageMaker's /ping and /invocations (vLLM's entry points), custom chat roles (vLLM
passes them to the chat template), truncation_side with truncate_prompt_tokens. Over the
byte-level FakeEngine of test_server_fake_engine (token id == byte), so prompts are readable."""
import pytest
from starlette.testclient import TestClient
from test_server_fake_engine import LOCAL, FakeEngine, sse_events
from test_server_fake_engine import client, engine  # noqa: F401 (its fixtures)

from radixserve.server.app import create_app
from radixserve.server.sagemaker_api import INVOCATION_KEYS, pick_route

CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


# ------------------------------------------------------------------------- /ping, /invocations

@pytest.mark.parametrize("method", ["GET", "POST"])
def test_ping_answers_as_health(client, engine, method):
    assert client.request(method, "/ping").status_code == 200
    engine.is_healthy = lambda: False
    assert client.request(method, "/ping").status_code == 503


def test_ping_needs_no_key_but_invocations_does():
    engine = FakeEngine()
    engine.server_args.api_key = "sekret"
    with TestClient(create_app(engine), base_url=LOCAL, raise_server_exceptions=False) as c:
        assert c.get("/ping").status_code == 200
        assert c.post("/invocations", json=CHAT).status_code == 401
        ok = c.post("/invocations", json=CHAT, headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200 and ok.json()["object"] == "chat.completion"


def test_invocations_answers_exactly_as_the_route_its_keys_name(client, engine):
    """The same body to /invocations and to its route: the same response, ids and timestamps
    aside, and the same engine request."""
    cases = [(CHAT, "/v1/chat/completions"),
             ({"model": "fake", "prompt": ["ab", "cd"], "max_tokens": 2, "logprobs": 1},
              "/v1/completions"),
             ({"text": "hello", "sampling_params": {"max_new_tokens": 2}}, "/generate"),
             ({"input_ids": [104, 105], "sampling_params": {"max_new_tokens": 2}}, "/generate")]
    for body, path in cases:
        n0 = len(engine.seen)
        direct = client.post(path, json=body)
        n1 = len(engine.seen)
        via = client.post("/invocations", json=body)
        assert direct.status_code == via.status_code == 200, (path, via.text)
        assert [r.input_ids for r in engine.seen[n0:n1]] == \
            [r.input_ids for r in engine.seen[n1:]], path
        a, b = direct.json(), via.json()
        for d in (a, b):
            for one in (d if isinstance(d, list) else [d]):
                one.pop("id", None)
                one.pop("created", None)
                for key in ("id", "e2e_latency"):
                    one.get("meta_info", {}).pop(key, None)
        assert a == b, path


def test_invocations_streams_like_the_route(client):
    r = client.post("/invocations", json={**CHAT, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    assert events[0]["object"] == "chat.completion.chunk"
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                   if e.get("choices")) == "Par"


def test_invocations_refuses_what_it_cannot_route_and_passes_route_errors_through(client,
                                                                                   engine):
    r = client.post("/invocations", json={"model": "fake", "question": "hi"})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    for word in ("'messages'", "'prompt'", "'input'", "'documents'", "'text' or 'input_ids'",
                 "/v1/chat/completions"):
        assert word in msg, msg
    # the chosen route's own validation answers, naming its field
    bad = client.post("/invocations", json={**CHAT, "temperature": "hot"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
    assert client.post("/invocations", content=b"{", headers={
        "content-type": "application/json"}).status_code == 400
    assert client.post("/invocations", json=[CHAT]).status_code == 400
    assert engine.seen == []            # nothing reached the engine
    assert client.get("/invocations").status_code == 405


def test_pick_route_order_is_first_match():
    handlers = {path: path for _, path in INVOCATION_KEYS}
    assert pick_route({"messages": [], "prompt": "x"}, handlers)[0] == "/v1/chat/completions"
    assert pick_route({"input_ids": [1]}, handlers)[0] == "/generate"
    assert pick_route({"input": "x", "text": "y"}, handlers)[0] == "/v1/embeddings"


# ------------------------------------------------------------------------------ custom roles

def test_custom_role_reaches_the_template_and_both_content_shapes_agree(client, engine):
    """vLLM's test_custom_role: a role OpenAI does not define renders through the template;
    string content and text parts give the same prompt."""
    a = client.post("/v1/chat/completions", json={**CHAT, "messages": [
        {"role": "my-custom-role", "content": "what is 1+1?"}]})
    b = client.post("/v1/chat/completions", json={**CHAT, "messages": [
        {"role": "my-custom-role", "content": [{"type": "text", "text": "what is 1+1?"}]}]})
    assert a.status_code == b.status_code == 200, a.text
    assert bytes(engine.seen[0].input_ids) == b"<my-custom-role>what is 1+1?<assistant>"
    assert engine.seen[1].input_ids == engine.seen[0].input_ids
    assert a.json()["choices"][0]["message"] == b.json()["choices"][0]["message"]


def test_a_template_that_refuses_a_role_gives_a_400_naming_it(engine):
    """A real jinja template that raises for roles it does not know (as Llama 2's and Gemma's
    do): the request gets the template's message as a 400 and nothing runs."""
    from radixserve.tokenizer.chat_template import ChatTemplate

    template = ChatTemplate(
        "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
        "{{ raise_exception('Conversation roles must be user or assistant') }}{% endif %}"
        "[{{ m['role'] }}]{{ m['content'] }}{% endfor %}")

    def render(messages, add_generation_prompt=True, tools=None, render_limits=None, **kw):
        return template.render(messages, add_generation_prompt, tools=tools,
                               render_limits=render_limits, **kw)
    engine.tokenizer.apply_chat_template = render
    with TestClient(create_app(engine), base_url=LOCAL, raise_server_exceptions=False) as c:
        ok = c.post("/v1/chat/completions", json=CHAT)
        assert ok.status_code == 200 and bytes(engine.seen[0].input_ids) == b"[user]hi"
        r = c.post("/v1/chat/completions", json={**CHAT, "messages": [
            {"role": "narrator", "content": "x"}]})
        assert r.status_code == 400, r.text
        assert "Conversation roles must be user or assistant" in r.json()["error"]["message"]
        assert len(engine.seen) == 1


# ------------------------------------------------------------------------- truncation_side

@pytest.mark.parametrize("side, kept", [(None, b"def"), ("left", b"def"), ("right", b"abc")])
def test_truncation_side_picks_the_end_truncate_prompt_tokens_keeps(client, engine, side, kept):
    extra = {} if side is None else {"truncation_side": side}
    r = client.post("/v1/completions", json={"model": "fake", "prompt": "abcdef", "max_tokens": 1,
                                             "truncate_prompt_tokens": 3, "echo": True, **extra})
    assert r.status_code == 200, r.text
    assert bytes(engine.seen[-1].input_ids) == kept
    assert r.json()["choices"][0]["text"].startswith(kept.decode())
    assert r.json()["usage"]["prompt_tokens"] == 3
    c = client.post("/v1/chat/completions", json={**CHAT, "truncate_prompt_tokens": 5, **extra})
    assert c.status_code == 200, c.text
    whole = b"<user>hi<assistant>"
    assert bytes(engine.seen[-1].input_ids) == (whole[:5] if side == "right" else whole[-5:])


def test_truncation_side_is_validated_and_changes_nothing_alone(client, engine):
    r = client.post("/v1/completions", json={"model": "fake", "prompt": "abcdef", "max_tokens": 1,
                                             "truncate_prompt_tokens": 3, "truncation_side": "up"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncation_side"
    assert "'left', 'right'" in r.json()["error"]["message"]
    assert engine.seen == []
    ok = client.post("/v1/completions", json={"model": "fake", "prompt": "abcdef",
                                              "max_tokens": 1, "truncation_side": "right"})
    assert ok.status_code == 200 and bytes(engine.seen[-1].input_ids) == b"abcdef"
