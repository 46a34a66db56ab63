"""The door (server/security.py) and the client mistakes that used to be 500s, over the fake
engine of test_server_fake_engine: the API key, Content-Type, POST-only state changes, the body
limit (a huge Content-Length and an endless chunked body, neither read in full), the Host
check, Origin and CORS, lone surrogates and deep nesting (400 naming the field), GET
/v1/models/{id}, request ownership for /abort_request, and /get_server_info without paths or
the key."""
import asyncio
import collections
import dataclasses
import json

import pytest
from starlette.testclient import TestClient
from test_server_fake_engine import LOCAL, FakeEngine, err_of, sse_events

from radixserve.config import ServerArgs
from radixserve.server import jsonio
from radixserve.server.app import create_app
from radixserve.server.security import DoorPolicy
from radixserve.server.sse import encode_event

KEY = "sk-test-0123456789"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def make_client(engine, **door):
    """A TestClient over the fake engine with ServerArgs(**door) for the door."""
    engine.server_args = ServerArgs(model_path="/models/fake", **door)
    return TestClient(create_app(engine), base_url=LOCAL, raise_server_exceptions=False)


@pytest.fixture()
def engine():
    return FakeEngine()


@pytest.fixture()
def client(engine):
    with make_client(engine) as c:
        yield c


# --------------------------------------------------------------------------- API key

def test_api_key_required_everywhere_but_health(engine):
    with make_client(engine, api_key=KEY) as c:
        assert c.get("/health").status_code == 200
        for method, path, kw in [("GET", "/v1/models", {}), ("POST", "/v1/chat/completions", {"json": CHAT}),
                                 ("GET", "/metrics", {}), ("GET", "/get_server_info", {}),
                                 ("POST", "/flush_cache", {}), ("GET", "/v1/nope", {})]:
            r = c.request(method, path, **kw)
            body = err_of(r, 401, None)
            assert body["type"] == "invalid_request_error" and body["param"] is None
            assert "Authorization: Bearer" in body["message"]
            assert r.headers["www-authenticate"] == "Bearer"
            for bad in ("Bearer wrong", f"Basic {KEY}", f"Bearer {KEY}x", "Bearer"):
                err_of(c.request(method, path, headers={"Authorization": bad}, **kw), 401)
        assert engine.seen == []
        auth = {"Authorization": f"Bearer {KEY}"}
        assert c.get("/v1/models", headers=auth).status_code == 200
        r = c.post("/v1/chat/completions", json=CHAT, headers={"authorization": f"bearer {KEY}"})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Pa"
        assert c.get("/metrics", headers=auth).status_code == 200


def test_api_key_from_the_environment(engine, monkeypatch, tmp_path):
    monkeypatch.setenv("RADIXSERVE_API_KEY", "from-env")
    assert ServerArgs().resolved_api_keys() == [("from-env", None)]
    assert ServerArgs(api_key="flag").resolved_api_keys() == [("flag", None)]
    (tmp_path / "keys").write_text("from-file ci\n")     # the file adds to the environment's
    assert ServerArgs(api_key_file=str(tmp_path / "keys")).resolved_api_keys() == [
        ("from-env", None), ("from-file", "ci")]
    with make_client(engine) as c:
        err_of(c.get("/v1/models"), 401)
        assert c.get("/v1/models", headers={"Authorization": "Bearer from-env"}).status_code == 200
    monkeypatch.setenv("RADIXSERVE_API_KEY", "")
    assert ServerArgs().resolved_api_keys() == []


# --------------------------------------------------------------------------- methods and content types

@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "hi"}),
                                        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}}),
                                        ("/abort_request", {"rid": "x"})])
def test_json_routes_need_a_json_content_type(client, engine, path, body):
    raw = json.dumps(body)
    for ctype in ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                  "multipart/form-data; boundary=x"):
        r = client.post(path, content=raw, headers={"content-type": ctype})
        assert "application/json" in err_of(r, 415)["message"]
    assert engine.seen == [] and engine.aborted == []
    r = client.post(path, content=raw, headers={"content-type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200, r.text


def test_state_changes_are_post_only(client):
    err_of(client.get("/flush_cache"), 405)
    err_of(client.get("/abort_request"), 405)
    assert client.post("/flush_cache").status_code == 200


# --------------------------------------------------------------------------- body size

def _asgi_call(app, path, headers, receive, client=("127.0.0.1", 1)):
    """Run one HTTP request through the ASGI app by hand; return (status, body, messages)."""
    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "headers": headers, "client": client,
             "server": ("127.0.0.1", 2), "state": {}}
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 10))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], body, sent


def test_huge_content_length_is_413_before_the_body_is_read(engine):
    engine.server_args = ServerArgs(model_path="/models/fake", max_request_bytes=4096)
    app = create_app(engine)

    async def receive():
        raise AssertionError("the body was read")

    headers = [(b"content-type", b"application/json"), (b"content-length", b"1000000000000")]
    status, body, _ = _asgi_call(app, "/v1/chat/completions", headers, receive)
    assert status == 413
    err = json.loads(body)["error"]
    assert err["code"] == 413 and "--max-request-bytes" in err["message"]
    status, _, _ = _asgi_call(app, "/generate", [(b"content-length", b"12x")], receive)
    assert status == 400
    assert engine.seen == []


def test_chunked_body_is_cut_off_at_the_limit(engine):
    limit = 64 * 1024
    engine.server_args = ServerArgs(model_path="/models/fake", max_request_bytes=limit)
    app = create_app(engine)
    chunk = b" " * 4096
    calls = 0

    async def endless():          # a chunked body that never ends
        nonlocal calls
        calls += 1
        assert calls < 1000, "the server kept reading past the limit"
        return {"type": "http.request", "body": chunk, "more_body": True}

    status, body, _ = _asgi_call(app, "/generate", [(b"content-type", b"application/json")], endless)
    assert status == 413 and json.loads(body)["error"]["code"] == 413
    assert calls == limit // len(chunk) + 1
    assert engine.seen == []


def test_body_under_the_limit_passes(engine):
    with make_client(engine, max_request_bytes=4096) as c:
        padded = json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 2}}) + " " * 3000
        assert c.post("/generate", content=padded, headers={"content-type": "application/json"}).json()["text"] == "Pa"
        err_of(c.post("/generate", content=padded + " " * 2000, headers={"content-type": "application/json"}), 413)


# --------------------------------------------------------------------------- Host

def test_host_check_beyond_loopback(engine):
    with make_client(engine, host="0.0.0.0") as c:
        body = err_of(c.get("/v1/models", headers={"host": "evil.example:30000"}), 421)
        assert "--allowed-hosts evil.example" in body["message"]
        err_of(c.post("/v1/chat/completions", json=CHAT, headers={"host": "rebind.attacker.test"}), 421)
        assert engine.seen == []
        for ok in ("localhost:30000", "10.1.2.3:30000", "[::1]:30000", "LOCALHOST."):
            assert c.get("/v1/models", headers={"host": ok}).status_code == 200, ok
    with make_client(engine, host="0.0.0.0", allowed_hosts="api.example.com:8000, .corp.example") as c:
        for ok in ("api.example.com", "API.example.com:443", "corp.example", "gpu1.corp.example:8000", "192.168.0.9"):
            assert c.get("/v1/models", headers={"host": ok}).status_code == 200, ok
        for bad in ("example.com", "xcorp.example", "api.example.com.evil.test", "testserver"):
            err_of(c.get("/v1/models", headers={"host": bad}), 421)
    with make_client(engine, allowed_hosts="localhost") as c:
        err_of(c.get("/v1/models", headers={"host": "anything.test"}), 421)
        assert c.get("/v1/models", headers={"host": "localhost:30000"}).status_code == 200
    with make_client(engine, host="0.0.0.0", allowed_hosts="*") as c:
        assert c.get("/v1/models", headers={"host": "anything.test"}).status_code == 200


def test_loopback_server_answers_only_loopback_names_by_default(engine):
    """DNS rebinding: a page on attacker.test rebinds its name to 127.0.0.1, and the browser
    sends Host: attacker.test (with Origin http://attacker.test, which the page's own origin
    check would let through as "same origin"). A loopback server answers 421 to every name
    but localhost's and to addresses other than loopback ones, on every route."""
    for host in ("127.0.0.1", "localhost", "::1"):
        with make_client(engine, host=host) as c:
            for bad in ("rebind.attacker.test", "attacker.test:30000", "LOCALHOST.attacker.test",
                        "localhost.evil", "10.1.2.3:30000", "[2001:db8::1]", "testserver"):
                body = err_of(c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                                     headers={"host": bad, "origin": f"http://{bad}"}), 421)
                assert "--allowed-hosts" in body["message"]
                err_of(c.post("/flush_cache", headers={"host": bad}), 421)
            assert engine.seen == []
            for ok in ("localhost", "localhost:30000", "LOCALHOST.", "app.localhost:8080",
                       "127.0.0.1:30000", "127.0.0.2", "[::1]:30000", "[::ffff:127.0.0.1]",
                       "0.0.0.0:30000", "[::]:30000"):     # SGLang's bench client: 0.0.0.0
                assert c.get("/v1/models", headers={"host": ok}).status_code == 200, ok
            # ... but a page that names 0.0.0.0 carries its own Origin: 403
            err_of(c.post("/flush_cache", headers={"host": "0.0.0.0:30000",
                                                    "origin": "http://attacker.test"}), 403)
    with make_client(engine, allowed_hosts="proxy.example") as c:   # behind a proxy: its name
        assert c.get("/v1/models", headers={"host": "proxy.example"}).status_code == 200
        assert c.get("/v1/models", headers={"host": "10.1.2.3"}).status_code == 200
        err_of(c.get("/v1/models", headers={"host": "attacker.test"}), 421)


# --------------------------------------------------------------------------- Origin and CORS

PREFLIGHT = {"access-control-request-method": "POST",
             "access-control-request-headers": "authorization, content-type, x-stainless-lang"}


def test_cors_off_by_default_and_cross_origin_refused(client, engine):
    r = client.options("/v1/chat/completions", headers={"origin": "https://app.example", **PREFLIGHT})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    r = client.post("/v1/chat/completions", json=CHAT, headers={"origin": "https://app.example"})
    assert "--allowed-origins https://app.example" in err_of(r, 403)["message"]
    # a form post or a no-cors fetch of raw bytes (no Content-Type) from a page elsewhere
    err_of(client.post("/flush_cache", headers={"origin": "https://evil.example",
                                               "content-type": "application/x-www-form-urlencoded"}), 403)
    err_of(client.post("/generate", content=b'{"text": "hi"}', headers={"origin": "null"}), 403)
    assert engine.seen == []
    # the server's own origin (a page it served itself) is fine; so are clients without Origin
    r = client.post("/v1/chat/completions", json=CHAT, headers={"origin": "http://localhost"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_cors_for_allowed_origins(engine):
    with make_client(engine, api_key=KEY, allowed_origins="https://app.example,http://localhost:5173") as c:
        r = c.options("/v1/chat/completions", headers={"origin": "https://app.example", **PREFLIGHT})
        assert r.status_code == 200       # answered before the API key: preflights carry none
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        assert "x-stainless-lang" in r.headers["access-control-allow-headers"].lower()
        auth = {"Authorization": f"Bearer {KEY}"}
        r = c.post("/v1/chat/completions", json=CHAT, headers={"origin": "http://localhost:5173", **auth})
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "http://localhost:5173"
        # errors reach the page too (it can read why)
        r = c.post("/v1/chat/completions", json=CHAT, headers={"origin": "https://app.example"})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "https://app.example"
        # other origins: no CORS, refused
        r = c.options("/v1/chat/completions", headers={"origin": "https://other.example", **PREFLIGHT})
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
        err_of(c.post("/v1/chat/completions", json=CHAT, headers={"origin": "https://other.example", **auth}), 403)


# --------------------------------------------------------------------------- surrogates, nesting

def _post_raw(client, path, raw: str):
    return client.post(path, content=raw.encode("ascii"), headers={"content-type": "application/json"})


@pytest.mark.parametrize("path, raw, param", [
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "a\ud800b"}]}', "messages[0].content"),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "hi"}], "model": "\udfff"}', "model"),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "hi"}], "stop": ["\ud800"]}', "stop[0]"),
    ("/v1/completions", r'{"prompt": "\ud83d"}', "prompt"),
    ("/v1/completions", r'{"prompt": ["fine", "\ude00"]}', "prompt[1]"),
    ("/generate", r'{"text": "x\udbff"}', "text"),
    ("/generate", r'{"text": "hi", "rid": "\ud800"}', "rid"),
    ("/generate", r'{"text": "hi", "sampling_params": {"stop": "\ud800"}}', "sampling_params.stop"),
    ("/abort_request", r'{"rid": "\ud800"}', "rid"),
])
def test_lone_surrogates_are_400_naming_the_field(client, engine, path, raw, param):
    body = err_of(_post_raw(client, path, raw), 400, param)
    assert "surrogate" in body["message"] and param in body["message"]
    assert engine.seen == [] and engine.aborted == []


def test_surrogate_in_a_key_and_valid_pairs(client, engine):
    body = err_of(_post_raw(client, "/generate", r'{"text": "hi", "sampling_params": {"\ud800": 1}}'), 400,
                  "sampling_params")
    assert "\\ud800" in body["message"]
    r = _post_raw(client, "/generate", r'{"text": "\ud83d\ude00", "sampling_params": {"max_new_tokens": 1}}')
    assert r.status_code == 200 and bytes(engine.seen[0].input_ids).decode() == "\U0001F600"


@pytest.mark.parametrize("path, template", [
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "tools": %s}'),
    ("/v1/completions", '{"prompt": %s}'),
    ("/generate", '{"text": "hi", "sampling_params": %s}'),
    ("/abort_request", '{"rid": %s}'),
])
@pytest.mark.parametrize("depth", [100_000, 2_000, 70])
def test_deep_nesting_is_400(client, engine, path, template, depth):
    deep = "[" * depth + "]" * depth
    body = err_of(_post_raw(client, path, template % deep), 400)
    assert "nests deeper" in body["message"]
    assert engine.seen == []
    assert client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1}}).status_code == 200


def test_moderate_nesting_passes(client):
    nested = {"type": "object"}
    for _ in range(25):                  # 25 object levels: depth 53 of the 64 allowed
        nested = {"type": "object", "properties": {"x": nested}}
    r = client.post("/v1/chat/completions", json={**CHAT, "response_format": {"type": "json_schema",
                    "json_schema": {"name": "n", "schema": nested}}})
    assert r.status_code != 500 and "nests deeper" not in r.text


def test_non_finite_numbers_are_400(client):
    for raw in ('{"text": "hi", "sampling_params": {"temperature": NaN}}',
                '{"text": "hi", "sampling_params": {"temperature": 1e999}}',
                '{"text": "hi", "sampling_params": {"temperature": -Infinity}}'):
        assert "JSON" in err_of(_post_raw(client, "/generate", raw), 400)["message"]


# --------------------------------------------------------------------------- /v1/models/{id}

def test_retrieve_model(client, engine):
    card = client.get("/v1/models/fake").json()
    assert card == client.get("/v1/models").json()["data"][0]
    assert (card["id"], card["object"], card["owned_by"]) == ("fake", "model", "radixserve")
    body = err_of(client.get("/v1/models/gpt-4"), 404, "model")
    assert body["type"] == "not_found_error" and "gpt-4" in body["message"]
    engine.served_model_name = "org/fake-model"     # names with a slash, as the client encodes them
    assert client.get("/v1/models/org%2Ffake-model").json()["id"] == "org/fake-model"
    assert client.get("/v1/models/org/fake-model").json()["id"] == "org/fake-model"
    err_of(client.get("/v1/models/org"), 404)


# --------------------------------------------------------------------------- request ownership

def _json_request(body):
    raw = json.dumps(body).encode()
    done = False

    async def receive():
        nonlocal done
        if not done:
            done = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await asyncio.sleep(3600)

    return raw, receive


async def _asgi_post(app, path, body, client, key=None):
    """POST a JSON body to app from peer address `client` (with Bearer `key`): (status, the
    ASGI messages sent)."""
    _, receive = _json_request(body)
    sent = []

    async def send(m):
        sent.append(m)
    headers = [(b"content-type", b"application/json")]
    if key is not None:
        headers.append((b"authorization", b"Bearer " + key.encode()))
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "headers": headers,
             "client": client, "server": ("127.0.0.1", 2), "state": {}}
    await app(scope, receive, send)
    return next(m for m in sent if m["type"] == "http.response.start")["status"], sent


ALICE, MALLORY = ("10.0.0.1", 5001), ("10.0.0.2", 5002)


def test_abort_only_reaches_the_clients_own_requests(engine):
    app = create_app(engine)
    alice, mallory = ALICE, MALLORY

    async def call(path, body, client):
        return await _asgi_post(app, path, body, client)

    async def scenario():
        owners = app.state.request_owners
        victim = asyncio.ensure_future(call("/generate", {"text": "HANG", "rid": "victim", "stream": True,
                                                          "sampling_params": {"max_new_tokens": 60}}, alice))
        while "victim" not in engine.running:
            await asyncio.sleep(0.005)
        assert owners.engine_rid("peer:10.0.0.1", "victim") == "victim"
        status, _ = await call("/abort_request", {"rid": "victim"}, mallory)
        assert status == 200 and engine.aborted == []          # refused, silently
        # the owner may not reuse its own live id ...
        status, sent = await call("/generate", {"text": "hi", "rid": "victim",
                                                  "sampling_params": {"max_new_tokens": 2}}, alice)
        assert status == 400 and b"already in use by one of your running requests" in sent[-1]["body"]
        # ... while another client's request by that id runs (under an alias the engine sees)
        # and is answered exactly as for an id no one holds: its existence does not show
        answers = []
        for rid in ("victim", "fresh"):
            status, sent = await call("/generate", {"text": "hi", "rid": rid,
                                                      "sampling_params": {"max_new_tokens": 2}}, mallory)
            answer = json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))
            assert status == 200 and answer["meta_info"]["id"] == rid
            answers.append({k: v for k, v in answer["meta_info"].items() if k != "id"} | {"text": answer["text"]})
        assert answers[0] == answers[1]
        assert [r.rid for r in engine.seen][0] == "victim"
        assert engine.seen[1].rid.startswith("victim#") and engine.seen[2].rid == "fresh"
        assert engine.aborted == []
        await asyncio.sleep(0.05)
        assert "victim" in engine.running
        status, _ = await call("/abort_request", {"rid": "victim"}, alice)
        assert status == 200 and engine.aborted == ["victim"]
        status, _ = await asyncio.wait_for(victim, 5)
        assert status == 200
        # a non-streamed request is owned too, and the map empties when requests end
        other = asyncio.ensure_future(call("/v1/completions", {"prompt": "HANG", "max_tokens": 30}, alice))
        while not engine.running:
            await asyncio.sleep(0.005)
        rid = next(iter(engine.running))
        await call("/abort_request", {"rid": rid}, mallory)
        assert rid not in engine.aborted
        status, _ = await asyncio.wait_for(other, 5)
        assert status == 200 and len(owners) == 0

    asyncio.run(scenario())


def test_abort_all_reaches_only_the_clients_own_requests(engine):
    """abort_all aborts every live request of the caller and none of another client's."""
    app = create_app(engine)

    async def scenario():
        hang = {"text": "HANG", "stream": True, "sampling_params": {"max_new_tokens": 60}}
        runs = [asyncio.ensure_future(_asgi_post(app, "/generate", {**hang, "rid": rid}, who))
                for rid, who in (("a1", ALICE), ("a2", ALICE), ("m1", MALLORY))]
        while len(engine.running) < 3:
            await asyncio.sleep(0.005)
        status, _ = await _asgi_post(app, "/abort_request", {"rid": "", "abort_all": True}, MALLORY)
        assert status == 200 and engine.aborted == ["m1"]
        status, _ = await _asgi_post(app, "/abort_request", {"abort_all": True}, ALICE)
        assert status == 200 and sorted(engine.aborted) == ["a1", "a2", "m1"]
        for run in runs:
            status, _ = await asyncio.wait_for(run, 5)
            assert status == 200

    asyncio.run(scenario())


def test_with_an_api_key_the_key_is_the_identity(engine):
    with make_client(engine, api_key=KEY) as c:
        auth = {"Authorization": f"Bearer {KEY}"}
        assert c.post("/abort_request", json={"rid": "gone"}, headers=auth).status_code == 200
        assert engine.aborted == ["gone"]      # no live request holds it: the engine's no-op


ALICE_KEY, BOB_KEY, ADMIN_KEY = "sk-alice-0123", "sk-bob-4567", "sk-admin-89ab"


def test_each_key_is_its_own_client(engine, tmp_path):
    """Several keys (--api-key twice, --api-key-file with names): each is an identity, the
    scheduler's client_id among them, and no key's holder can abort another's requests (from
    the same address: the key decides, not the peer)."""
    from radixserve.server.security import key_identity
    keys = tmp_path / "keys"
    keys.write_text(f"{BOB_KEY} bob\n")
    engine.server_args = ServerArgs(model_path="/models/fake", api_key=[ALICE_KEY, KEY],
                                    api_key_file=str(keys))
    app = create_app(engine)
    peer = ("10.0.0.9", 1)

    async def scenario():
        hang = {"text": "HANG", "stream": True, "sampling_params": {"max_new_tokens": 60}}
        runs = [asyncio.ensure_future(_asgi_post(app, "/generate", {**hang, "rid": rid}, peer, key))
                for rid, key in (("a1", ALICE_KEY), ("b1", BOB_KEY))]
        while len(engine.running) < 2:
            await asyncio.sleep(0.005)
        by_rid = {r.rid: r.client_id for r in engine.seen}
        assert by_rid == {"a1": key_identity(ALICE_KEY), "b1": "key:bob"}
        assert ALICE_KEY not in by_rid["a1"]
        for rid in ("a1", "b1"):                  # the third key owns neither
            status, _ = await _asgi_post(app, "/abort_request", {"rid": rid}, peer, KEY)
            assert status == 200
        status, _ = await _asgi_post(app, "/abort_request", {"abort_all": True}, peer, KEY)
        assert status == 200 and engine.aborted == []
        status, _ = await _asgi_post(app, "/abort_request", {"rid": "a1"}, peer, BOB_KEY)
        assert status == 200 and engine.aborted == []
        status, _ = await _asgi_post(app, "/abort_request", {"abort_all": True}, peer, BOB_KEY)
        assert status == 200 and engine.aborted == ["b1"]
        status, _ = await _asgi_post(app, "/abort_request", {"rid": "a1"}, peer, ALICE_KEY)
        assert engine.aborted == ["b1", "a1"]
        for run in runs:
            status, _ = await asyncio.wait_for(run, 5)
            assert status == 200
        status, _ = await _asgi_post(app, "/generate", hang, peer, "sk-unknown")
        assert status == 401

    asyncio.run(scenario())


def test_admin_key_guards_the_server_wide_routes(engine):
    """With --admin-api-key: /flush_cache, /get_server_info (/server_info), /metrics and the load
    routes (/v1/loads, /get_load) take only the admin
    key (a client key gets 403, none or a wrong one 401); every other route takes the client
    keys, and the admin key too. Without client keys, only the server-wide routes are locked."""
    from radixserve.server.security import ADMIN_PATHS
    assert ADMIN_PATHS == {"/flush_cache", "/get_server_info", "/server_info", "/metrics",
                           "/v1/loads", "/get_load"}
    admin, alice = ({"Authorization": f"Bearer {k}"} for k in (ADMIN_KEY, ALICE_KEY))
    calls = [("POST", "/flush_cache"), ("GET", "/get_server_info"), ("GET", "/server_info"),
             ("GET", "/metrics"), ("GET", "/v1/loads"), ("GET", "/get_load")]
    with make_client(engine, api_key=ALICE_KEY, admin_api_key=ADMIN_KEY) as c:
        for method, path in calls:
            assert "admin key" in err_of(c.request(method, path, headers=alice), 403)["message"]
            assert "--admin-api-key" in err_of(c.request(method, path), 401)["message"]
            err_of(c.request(method, path, headers={"Authorization": "Bearer wrong"}), 401)
            assert c.request(method, path, headers=admin).status_code == 200, path
        for headers in (alice, admin):
            assert c.post("/v1/chat/completions", json=CHAT, headers=headers).status_code == 200
            assert c.post("/abort_request", json={"rid": "x"}, headers=headers).status_code == 200
            assert c.get("/get_model_info", headers=headers).status_code == 200
        err_of(c.post("/v1/chat/completions", json=CHAT), 401)
        assert engine.seen[-1].client_id == "admin"
        doc = c.get("/openapi.json", headers=alice).json()
        assert doc["paths"]["/flush_cache"]["post"]["responses"]["401"]
    with make_client(engine, admin_api_key=ADMIN_KEY) as c:      # no client keys
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
        assert engine.seen[-1].client_id.startswith("peer:")
        err_of(c.post("/flush_cache"), 401)
        assert c.post("/flush_cache", headers=admin).status_code == 200
        doc = c.get("/openapi.json").json()
        assert "security" not in doc and doc["paths"]["/flush_cache"]["post"]["security"]
    with make_client(engine, api_key=ALICE_KEY) as c:             # no admin key: any client key
        for method, path in calls:
            assert c.request(method, path, headers=alice).status_code == 200, path


def test_the_door_logs_identities_never_keys(engine, tmp_path, caplog):
    from radixserve.server.app import _log_door
    keys = tmp_path / "keys"
    keys.write_text(f"{BOB_KEY} bob\n")
    args = ServerArgs(model_path="/models/fake", api_key=ALICE_KEY, api_key_file=str(keys),
                      admin_api_key=ADMIN_KEY)
    with caplog.at_level("INFO", logger="radixserve.server.app"):
        _log_door(args, DoorPolicy.from_server_args(args))
    assert "key:bob" in caplog.text and "2 clients" in caplog.text and "admin key set" in caplog.text
    assert all(k not in caplog.text for k in (ALICE_KEY, BOB_KEY, ADMIN_KEY))


# --------------------------------------------------------------------------- /get_server_info

def _server_info(args):
    return {"server_args": dataclasses.asdict(args), "model_path": args.model_path,
            "served_model_name": "fake", "context_len": 64, "weights": ["/models/fake/a.safetensors"]}


def test_server_info_without_paths_or_secrets(engine):
    with make_client(engine, api_key=KEY, tokenizer_path="/srv/tok", admin_api_key=ADMIN_KEY) as c:
        engine.server_info = lambda: _server_info(engine.server_args)
        r = c.get("/get_server_info", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        info = r.json()
        assert KEY not in r.text and "/models/fake" not in r.text and "/srv/tok" not in r.text
        assert ADMIN_KEY not in r.text and "admin_api_key" not in info["server_args"]
        assert info["served_model_name"] == "fake" and info["context_len"] == 64
        assert info["server_args"]["max_request_bytes"] == engine.server_args.max_request_bytes
        assert "api_key" not in info["server_args"] and "model_path" not in info
    with make_client(engine, api_key=KEY, expose_server_info=True) as c:
        engine.server_info = lambda: _server_info(engine.server_args)
        r = c.get("/get_server_info", headers={"Authorization": f"Bearer {KEY}"})
        assert r.json()["model_path"] == "/models/fake" and KEY not in r.text


def test_model_path_hidden_unless_exposed(engine):
    """/v1/models, /v1/models/{id} and /get_model_info show the served name where the model's
    path would be, and a request naming the model by its path is a 404 like any other name
    (else the path could be probed); --expose-server-info shows and accepts it."""
    with make_client(engine, tokenizer_path="/srv/tok") as c:
        for path in ("/v1/models", "/v1/models/fake", "/get_model_info"):
            r = c.get(path)
            assert r.status_code == 200 and "/models/fake" not in r.text and "/srv/tok" not in r.text
        assert c.get("/v1/models").json()["data"][0]["root"] == "fake"
        info = c.get("/get_model_info").json()
        assert (info["model_path"], info["tokenizer_path"]) == ("fake", "fake")
        err_of(c.get("/v1/models/%2Fmodels%2Ffake"), 404)
        err_of(c.post("/v1/completions", json={"model": "/models/fake", "prompt": "hi"}), 404, "model")
    with make_client(engine, tokenizer_path="/srv/tok", expose_server_info=True) as c:
        assert c.get("/v1/models").json()["data"][0]["root"] == "/models/fake"
        info = c.get("/get_model_info").json()
        assert (info["model_path"], info["tokenizer_path"]) == ("/models/fake", "/srv/tok")
        assert c.get("/v1/models/%2Fmodels%2Ffake").status_code == 200
        r = c.post("/v1/completions", json={"model": "/models/fake", "prompt": "hi", "max_tokens": 1})
        assert r.status_code == 200


# --------------------------------------------------------------------------- JSON out, flags

def test_serialization_never_raises():
    Entry = collections.namedtuple("Entry", "logprob token_id text")
    assert json.loads(jsonio.dumps({"e": Entry(-0.5, 3, "é")})) == {"e": [-0.5, 3, "é"]}
    assert json.loads(jsonio.dumps({"s": "a\ud800", "n": 2 ** 70})) == {"s": "a\ud800", "n": 2 ** 70}
    assert encode_event({"x": float("nan"), 1: "k"}) == b'data: {"x":null,"1":"k"}\n\n'
    assert encode_event({"t": "\u00e9\U0001F600"}) == 'data: {"t":"\u00e9\U0001F600"}\n\n'.encode()


def test_door_flags_are_checked_and_on_the_cli(tmp_path):
    from radixserve import cli
    from radixserve.server.security import key_digest, key_identity
    keys = tmp_path / "keys"
    keys.write_text("# clients\nsk-file-1 alice\n\n  sk-file-2   bob  \nsk-file-3\n")
    ns = cli.build_parser().parse_args(["serve", "--api-key", "k", "--api-key", "k2",
                                        "--api-key-file", str(keys), "--admin-api-key", "adm",
                                        "--allowed-origins", "https://a.example",
                                        "--allowed-hosts", "a.example", "--max-request-bytes", "2048",
                                        "--expose-server-info"])
    args = ServerArgs.from_cli_args(ns)
    args.check()
    assert args.resolved_api_keys() == [("k", None), ("k2", None), ("sk-file-1", "alice"),
                                        ("sk-file-2", "bob"), ("sk-file-3", None)]
    policy = DoorPolicy.from_server_args(args)
    assert (policy.allowed_origins, policy.allowed_hosts, policy.max_request_bytes,
            policy.expose_server_info) == (("https://a.example",), ("a.example",), 2048, True)
    assert policy.client_keys == {key_digest(k): key_identity(k, n) for k, n in args.resolved_api_keys()}
    assert policy.admin_key == key_digest("adm")
    assert sorted(policy.client_keys.values()) == sorted(
        ["key:alice", "key:bob", key_identity("k"), key_identity("k2"), key_identity("sk-file-3")])
    assert all(k not in repr(policy) for k in ("sk-file", "adm'", "'k'"))      # digests only
    bad_file = tmp_path / "bad"
    bad_file.write_text("sk-1 a b\n")
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    for bad, flag in [({"api_key": ""}, "--api-key"), ({"api_key": ["a", " "]}, "--api-key"),
                      ({"admin_api_key": ""}, "--admin-api-key"),
                      ({"api_key": "same", "admin_api_key": "same"}, "--admin-api-key must differ"),
                      ({"api_key_file": str(bad_file)}, "line 1: expected KEY"),
                      ({"api_key_file": str(empty)}, "holds no key"),
                      ({"api_key_file": str(tmp_path / "missing")}, "--api-key-file"),
                      ({"tokenizer_worker_num": 0}, "--tokenizer-worker-num"),
                      ({"max_request_bytes": 10}, "--max-request-bytes"),
                      ({"allowed_origins": "https://a.example/path"}, "--allowed-origins"),
                      ({"allowed_origins": "a.example"}, "--allowed-origins"),
                      ({"allowed_hosts": "http://a.example"}, "--allowed-hosts")]:
        with pytest.raises(ValueError, match=flag):
            ServerArgs(**bad).check()


def test_streamed_errors_still_parse(client):
    events = sse_events(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "BOOM"}],
                                                                   "stream": True}))
    assert events[-1]["error"]["code"] == 500
