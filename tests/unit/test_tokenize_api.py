"""/tokenize and /detokenize (server/tokenize_api.py, vLLM's shapes) over the fake engine of
test_server_fake_engine (byte-level: a token is one byte): text and chat prompts, chat
messages equal to the chat route's prompt ids, add_generation_prompt / add_special_tokens,
token_strs, the round trip, and 400s for bad ids and bodies."""
import pytest
from starlette.testclient import TestClient

from radixserve.server.app import create_app

from test_server_fake_engine import LOCAL, FakeEngine, err_of

CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Capital"},
                                     {"type": "text", "text": "of France?"}]}]


@pytest.fixture()
def engine():
    e = FakeEngine()
    e.context_len = 128
    return e


@pytest.fixture()
def client(engine):
    with TestClient(create_app(engine), base_url=LOCAL, raise_server_exceptions=False) as c:
        yield c


def test_tokenize_a_prompt(client):
    r = client.post("/tokenize", json={"model": "fake", "prompt": "hé"})
    assert r.status_code == 200
    assert r.json() == {"count": 3, "max_model_len": 128, "tokens": list("hé".encode()),
                        "token_strs": None}
    r = client.post("/tokenize", json={"prompt": "hi", "return_token_strs": True})
    assert r.json()["token_strs"] == ["h", "i"]
    long = "x" * 500                          # longer than the context: still counted
    assert client.post("/tokenize", json={"prompt": long}).json()["count"] == 500


def test_chat_messages_are_the_chat_routes_prompt_ids(client, engine):
    r = client.post("/tokenize", json={"messages": CHAT})
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    assert bytes(tokens).decode() == "<system>Be brief.<user>Capital\nof France?<assistant>"
    chat = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1,
                                                     "return_token_ids": True})
    assert chat.json()["prompt_token_ids"] == tokens == engine.seen[-1].input_ids
    r = client.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False})
    assert bytes(r.json()["tokens"]).decode() == "<system>Be brief.<user>Capital\nof France?"
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    r = client.post("/tokenize", json={"messages": CHAT, **kwargs})
    assert bytes(r.json()["tokens"]).decode().startswith("<enable_thinking=False><system>")


def test_chat_tools_render_as_on_the_chat_route(client, engine):
    engine.context_len = 1024                 # room for the tools block
    tools = [{"type": "function", "function": {"name": "add", "description": "Add",
                                               "parameters": {"type": "object"}}}]
    r = client.post("/tokenize", json={"messages": CHAT, "tools": tools})
    assert r.status_code == 200, r.text
    text = bytes(r.json()["tokens"]).decode()
    assert text.startswith("<system>Be brief.\n\nYou can call these functions") and '"add"' in text
    chat = client.post("/v1/chat/completions", json={"messages": CHAT, "tools": tools,
                                                     "max_tokens": 1})
    assert chat.status_code == 200, chat.text
    assert engine.seen[-1].input_ids == r.json()["tokens"]


def test_add_special_tokens_reaches_the_tokenizer(client, engine, monkeypatch):
    seen = []
    encode = engine.tokenizer.encode

    def spy(text, add_special_tokens=True, max_tokens=None):
        seen.append(add_special_tokens)
        return encode(text, add_special_tokens, max_tokens)

    monkeypatch.setattr(engine.tokenizer, "encode", spy)
    client.post("/tokenize", json={"prompt": "a"})
    client.post("/tokenize", json={"prompt": "a", "add_special_tokens": False})
    client.post("/tokenize", json={"messages": CHAT})
    client.post("/tokenize", json={"messages": CHAT, "add_special_tokens": True})
    assert seen == [True, False, False, True]


def test_detokenize_round_trip(client):
    text = "Paris, <b>é</b>"
    ids = client.post("/tokenize", json={"prompt": text}).json()["tokens"]
    r = client.post("/detokenize", json={"model": "fake", "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": text}
    assert client.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("path, body, param", [
    ("/detokenize", {"tokens": [104, 256]}, "tokens"),            # the fake's vocabulary is 256
    ("/detokenize", {"tokens": [104, -1]}, "tokens[1]"),
    ("/detokenize", {"tokens": [1.5]}, "tokens[0]"),
    ("/detokenize", {"tokens": "hi"}, "tokens"),
    ("/detokenize", {}, "tokens"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, "prompt"),
    ("/tokenize", {"messages": [{"role": 7, "content": "x"}]}, "messages[0].role"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"messages": CHAT, "chat_template": "{{ x }}"}, "chat_template"),
    ("/tokenize", {"messages": CHAT, "tools": [{"type": "function"}]}, "tools[0]"),
    ("/tokenize", {"messages": [{"role": "user", "content": "BADTEMPLATE"}]}, "messages"),
    ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt"),
])
def test_bad_bodies_are_400s_naming_the_field(client, engine, path, body, param):
    err_of(client.post(path, json=body), 400, param)
    assert engine.seen == []


def test_other_model_is_a_404(client):
    err_of(client.post("/tokenize", json={"model": "gpt-4", "prompt": "a"}), 404, "model")
    err_of(client.post("/detokenize", json={"model": "gpt-4", "tokens": [1]}), 404, "model")
