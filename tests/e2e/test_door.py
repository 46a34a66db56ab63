"""The door over real HTTP: a server of its own (the default model's config with dummy weights:
the door does not care what the model says) started with the API key in RADIXSERVE_API_KEY
(the CLI path), two named keys in --api-key-file, an --admin-api-key, one allowed CORS origin
and a 64 KiB body limit. The official openai client with the right and a wrong key,
models.retrieve, 413 from uvicorn before a huge body is read (Content-Length and chunked), 415,
405, surrogates, deep nesting, CORS, DNS rebinding (421), each key its own client, the admin
routes, /get_server_info and /get_model_info without paths."""
import json
import os
import select
import socket

import httpx
import pytest
from conftest import launched_server

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEY = "sk-door-test-9f2c"
ALICE, BOB, ADMIN = "sk-door-alice-11", "sk-door-bob-22", "sk-door-admin-33"
ORIGIN = "https://app.example"
LIMIT = 64 * 1024
STARTUP_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def door(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("door")
    (tmp / "keys").write_text(f"# the door test's clients\n{ALICE} alice\n{BOB} bob\n")
    args = ["--load-format", "dummy", "--max-total-tokens", "2048", "--allowed-origins", ORIGIN,
            "--max-request-bytes", str(LIMIT), "--api-key-file", str(tmp / "keys"),
            "--admin-api-key", ADMIN]
    with launched_server(tmp, args, env={"RADIXSERVE_API_KEY": KEY},
                         headers={"Authorization": f"Bearer {KEY}"}) as srv:
        yield srv.url, srv.port, srv.log


@pytest.fixture(scope="module")
def http(door):
    with httpx.Client(base_url=door[0], timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


def _read_response(sock) -> bytes:
    """Bytes of one response: the head, then content-length bytes of body (or until close)."""
    data = b""
    while b"\r\n\r\n" not in data:
        part = sock.recv(65536)
        if not part:
            return data
        data += part
    head, body = data.split(b"\r\n\r\n", 1)
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), None)
    while length is None or len(body) < length:
        try:
            part = sock.recv(65536)
        except OSError:
            break
        if not part:
            break
        body += part
    return head + b"\r\n\r\n" + body


def _raw(port: int, head: bytes, chunked_body: bool = False):
    """Send a request head (and, with chunked_body, 64 KiB chunks until the server answers);
    return (status line, response bytes, body bytes sent)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sent = 0
    try:
        sock.sendall(head)
        if chunked_body:
            chunk = b"10000\r\n" + b" " * 0x10000 + b"\r\n"
            try:
                for _ in range(1000):
                    if select.select([sock], [], [], 0)[0]:
                        break
                    sock.sendall(chunk)
                    sent += 0x10000
            except OSError:            # the server closed the connection after answering
                pass
        data = _read_response(sock)
    finally:
        sock.close()
    return data.split(b"\r\n", 1)[0], data, sent


def test_api_key_with_the_openai_client(door):
    import openai
    url, _, _ = door
    assert httpx.get(url + "/health").status_code == 200
    r = httpx.get(url + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == 401
    bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    model = good.models.list().data[0].id
    card = good.models.retrieve(model)
    assert card.id == model and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        good.models.retrieve("no-such-model")
    out = good.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop")


def test_oversized_bodies_get_413_unread(door):
    _, port, _ = door
    auth = f"Authorization: Bearer {KEY}\r\n".encode()
    head = (b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\n" + auth +
            b"Content-Type: application/json\r\nContent-Length: 100000000000\r\n\r\n")
    status, data, _ = _raw(port, head)         # not a byte of the body is sent
    assert b" 413 " in status and b"--max-request-bytes" in data
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n" + auth +
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    status, data, sent = _raw(port, head, chunked_body=True)
    assert b" 413 " in status and b'"code":413' in data
    assert sent < 1000 * 0x10000               # answered long before the client gave up
    # the key comes first: without it, even the size is not looked at
    status, _, _ = _raw(port, b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                               b"Content-Length: 100000000000\r\n\r\n")
    assert b" 401 " in status


def test_client_mistakes_are_4xx(http):
    r = http.post("/generate", content=b'{"text": "hi"}', headers={"content-type": "text/plain"})
    assert r.status_code == 415
    assert http.get("/flush_cache", headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 405
    for path, raw, param in [("/generate", rb'{"text": "\ud800"}', "text"),
                             ("/generate", rb'{"text": "hi", "rid": "\udc00"}', "rid"),
                             ("/v1/completions", rb'{"prompt": ["ok", "\ud800"]}', "prompt[1]"),
                             ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "\ud800"}]}',
                              "messages[0].content"),
                             ("/abort_request", rb'{"rid": "\ud800"}', "rid")]:
        r = http.post(path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, r.text)
    deep = b'{"prompt": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"
    r = http.post("/v1/completions", content=deep, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "nests deeper" in r.json()["error"]["message"]
    assert http.get("/health").status_code == 200


def test_cors(http):
    preflight = {"origin": ORIGIN, "access-control-request-method": "POST",
                 "access-control-request-headers": "authorization, content-type"}
    r = httpx.options(str(http.base_url) + "/v1/chat/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.options(str(http.base_url) + "/v1/chat/completions",
                      headers={**preflight, "origin": "https://evil.example"})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    r = http.get("/v1/models", headers={"origin": ORIGIN})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN


def test_server_info_has_no_paths_or_key(http, default_model_path):
    r = http.get("/get_server_info", headers={"Authorization": f"Bearer {ADMIN}"})
    info = r.json()
    assert all(k not in r.text for k in (KEY, ALICE, BOB, ADMIN))
    assert info["context_len"] > 0 and info["served_model_name"]
    assert default_model_path not in r.text
    assert "model_path" not in info and "model_path" not in info["server_args"]
    assert json.dumps(info).count('"/') == 0           # no absolute path anywhere
    for path in ("/get_model_info", "/v1/models"):
        shown = http.get(path)
        assert shown.status_code == 200 and default_model_path not in shown.text
        assert json.dumps(shown.json()).count('"/') == 0


def test_dns_rebinding_gets_421(door):
    """A page on attacker.test that rebinds its name to 127.0.0.1: the browser sends its
    name as Host (and its origin, which would pass as "same origin"): 421 everywhere."""
    url, _, _ = door
    rebound = {"Host": "attacker.test:80", "Origin": "http://attacker.test:80",
               "Authorization": f"Bearer {KEY}"}
    for method, path, body in (("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1}),
                               ("POST", "/flush_cache", None), ("GET", "/v1/models", None)):
        r = httpx.request(method, url + path, json=body, headers=rebound, timeout=60)
        assert r.status_code == 421 and "--allowed-hosts" in r.json()["error"]["message"], path
    r = httpx.get(url.replace("127.0.0.1", "localhost") + "/v1/models",
                  headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200


def test_each_key_is_a_client_and_the_admin_key_guards_server_wide_routes(door):
    url, _, log_path = door

    def client(key):
        return httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {key}"})

    with client(ALICE) as alice, client(BOB) as bob, client(ADMIN) as admin:
        stored = alice.post("/v1/responses", json={"input": "hi", "max_output_tokens": 1})
        assert stored.status_code == 200, stored.text
        rid = stored.json()["id"]
        assert bob.get(f"/v1/responses/{rid}").status_code == 404
        assert bob.delete(f"/v1/responses/{rid}").status_code == 404
        assert alice.get(f"/v1/responses/{rid}").status_code == 200
        for method, path in (("POST", "/flush_cache"), ("GET", "/metrics"), ("GET", "/get_server_info")):
            assert alice.request(method, path).status_code == 403, path
            assert admin.request(method, path).status_code == 200, path
        assert admin.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200
    with open(log_path) as f:
        log = f.read()
    assert "key:alice" in log and "key:bob" in log
    assert all(k not in log for k in (KEY, ALICE, BOB, ADMIN))


def test_lang_runtime_endpoint_sends_the_api_key(door):
    """radixserve.lang.RuntimeEndpoint(url, api_key=...) works behind the key; without it (or
    with a wrong one) construction fails with a BackendError carrying the 401."""
    import radixserve.lang as sgl
    url, _, _ = door
    for key in (None, "wrong"):
        with pytest.raises(sgl.BackendError) as err:
            sgl.RuntimeEndpoint(url, api_key=key)
        assert err.value.status == 401 and err.value.route == "/get_model_info"
    endpoint = sgl.RuntimeEndpoint(url, api_key=KEY)

    @sgl.function
    def one(s):
        s += "Hello" + sgl.gen("x", max_tokens=2)

    state = one.run(backend=endpoint, temperature=0)
    assert state.get_meta_info("x")["completion_tokens"] <= 2
