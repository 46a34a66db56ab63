"""The HTTP app over a small fake engine with AsyncEngine's interface: routing, OpenAI and
native shapes, n>1 choice indexing, the usage chunk, logprob shapes, error bodies, a 500 on an
engine exception while the app keeps serving, and abort on client disconnect."""
import asyncio
import json
from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

from radixserve.config import ServerArgs
from radixserve.engine.io import GenerateOutput
from radixserve.server.app import create_app
from radixserve.tokenizer.tokenizer import TooManyTokens

REPLY = "Paris is the capital of France. "
# the base URL of every TestClient: a loopback server answers only loopback Host names
LOCAL = "http://localhost"
CONTEXT_LEN = 64


class FakeTokenizer:
    """Byte-level: token id == UTF-8 byte (so a token stands for at most one character)."""
    eos_token_ids = [0]
    template_handles_tools = False
    chat_template_text = None          # no jinja template: /get_model_info says so
    special_tokens = {"eos_token": "\x00"}
    adds_bos_token = False
    max_chars_per_token = 1
    silent_chars = frozenset()

    def encode(self, text, add_special_tokens=True, max_tokens=None):
        ids = list(text.encode("utf-8"))
        if max_tokens is not None and len(ids) > max_tokens:
            raise TooManyTokens(len(ids), max_tokens)
        return ids

    def decode(self, ids, skip_special_tokens=True, spaces_between_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")

    def token_text(self, tid):
        return bytes([tid]).decode("latin-1")

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None,
                            render_limits=None, **template_kwargs):
        """<role>content... then <assistant>; template variables render as <name=value>."""
        if any("BADTEMPLATE" in m["content"] for m in messages):
            raise ValueError("the template cannot render this conversation")
        text = "".join(f"<{k}={v}>" for k, v in sorted(template_kwargs.items()))
        text += "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


class FakeEngine:
    """Emits self.reply (REPLY unless a test sets it; rotated by the seed) one byte-token per
    step; honours max_new_tokens, stop strings and logprobs; 'BOOM' in the prompt raises after
    the first output; 'ABORTME' makes the engine abort the request at its second token; 'HANG'
    makes every step sleep 10 ms."""

    def __init__(self):
        self.server_args = ServerArgs(model_path="/models/fake")
        self.model_config = SimpleNamespace(vocab_size=256, architecture="FakeForCausalLM")
        self.tokenizer = FakeTokenizer()
        self.model_path = "/models/fake"
        self.served_model_name = "fake"
        self.context_len = CONTEXT_LEN
        self.running = set()
        self.aborted = []
        self.seen = []
        self.started = False
        self.reply = REPLY

    def start(self):
        self.started = True

    async def shutdown(self):
        self.started = False

    def validate(self, req, prompt_checked=False):
        if len(req.input_ids) >= self.context_len:
            raise ValueError("prompt too long")

    def abort(self, rid):
        self.aborted.append(rid)

    async def flush_cache(self):
        return not self.running

    def server_info(self):
        return {"num_running_reqs": len(self.running)}

    def metrics(self):
        return {"prompt_tokens": 12, "num_running_reqs": len(self.running), "note": "x"}

    def is_healthy(self):
        return True

    async def generate(self, req, validated=False):
        if not validated:           # as AsyncEngine.generate: the routes validated it already
            self.validate(req)
        self.seen.append(req)
        self.running.add(req.rid)
        sp = req.sampling_params
        finished = False
        try:
            prompt = bytes(req.input_ids)
            shift = (sp.seed or 0) % len(self.reply)
            reply = self.reply[shift:] + self.reply[:shift]
            limit = sp.max_new_tokens if sp.max_new_tokens is not None else self.context_len - len(req.input_ids)
            text = ""
            step = 0
            while True:
                await asyncio.sleep(0)
                if b"HANG" in prompt:
                    await asyncio.sleep(0.01)
                ch = reply[step % len(reply)]
                step += 1
                text += ch
                tid = ord(ch)
                reason = None
                delta = ch
                for s in sp.stop_strs:
                    if text.endswith(s):
                        reason = {"type": "stop", "matched": s}
                        delta = "" if not sp.no_stop_trim else ch
                if reason is None and step >= limit:
                    reason = {"type": "length", "matched": None}
                if b"ABORTME" in prompt and step == 2:
                    reason = {"type": "abort", "matched": None, "message": "the KV pool is full"}
                lp = (-0.25 * step, tid, ch if req.return_text_in_logprobs else None)
                out = GenerateOutput(
                    rid=req.rid, text_delta=delta, output_ids_delta=[tid], finished=reason is not None,
                    finish_reason=reason, prompt_tokens=len(req.input_ids), completion_tokens=step,
                    cached_tokens=1 if req.rid.endswith("-1") else 0)
                if req.return_logprob:
                    out.output_token_logprobs_delta = [lp]
                    out.output_top_logprobs_delta = [[lp, (-9.0, 120, "x")][:req.top_logprobs_num]]
                    if step == 1 and req.logprob_start_len >= 0:
                        ids = req.input_ids[req.logprob_start_len:]
                        out.input_token_logprobs = [(None if req.logprob_start_len + k == 0 else -1.0, t, None)
                                                    for k, t in enumerate(ids)]
                        out.input_top_logprobs = [None if req.logprob_start_len + k == 0 else [(-1.0, t, None)]
                                                  for k, t in enumerate(ids)]
                if b"BOOM" in prompt and step == 2:
                    raise RuntimeError("kaboom")
                finished = reason is not None
                yield out
                if finished:
                    return
        finally:
            self.running.discard(req.rid)
            if not finished:
                self.aborted.append(req.rid)


@pytest.fixture()
def engine():
    return FakeEngine()


@pytest.fixture()
def client(engine):
    with TestClient(create_app(engine), base_url=LOCAL, raise_server_exceptions=False) as c:
        yield c


def sse_events(resp):
    """Split an SSE body into decoded JSON events, checking the framing and the final [DONE]."""
    raw = resp.content.decode("utf-8")
    assert raw.endswith("data: [DONE]\n\n")
    parts = raw.split("\n\n")
    assert parts[-1] == "" and parts[-2] == "data: [DONE]"
    assert all(p.startswith("data: ") for p in parts[:-1])
    return [json.loads(p[len("data: "):]) for p in parts[:-2]]


def err_of(resp, status, param=None):
    assert resp.status_code == status, resp.text
    body = resp.json()["error"]
    assert body["code"] == status and body["message"]
    if param is not None:
        assert body["param"] == param, body
    return body


# --------------------------------------------------------------------------- lifecycle, info

def test_lifespan_starts_engine_and_info_routes(engine):
    with TestClient(create_app(engine), base_url=LOCAL) as c:
        assert engine.started
        r = c.get("/health")
        assert r.status_code == 200 and r.content == b""
        models = c.get("/v1/models").json()
        assert models["object"] == "list"
        assert [(m["id"], m["owned_by"]) for m in models["data"]] == [("fake", "radixserve")]
        info = c.get("/get_model_info").json()
        assert info["model_path"] == "fake" and info["is_generation"] is True   # no path
        assert info["tokenizer_path"] == "fake"
        assert info["chat_template"] is None and info["chat_template_name"] is None
        info = c.get("/get_server_info").json()        # the engine's, plus the gateway's fields
        assert info == {"num_running_reqs": 0, "dp_size": 1, "pp_size": 1, "is_embedding": False,
                        "disaggregation_mode": "null", "context_length": engine.context_len,
                        "served_model_name": "fake"}
        assert c.get("/server_info").json() == info
        assert c.post("/flush_cache").status_code == 200
        text = c.get("/metrics").text
        assert 'radixserve:prompt_tokens_total{model_name="fake"} 12.0' in text
        assert "# TYPE radixserve:prompt_tokens_total counter" in text
        assert 'radixserve:num_running_reqs{model_name="fake"} 0.0' in text
        assert "# TYPE radixserve:num_running_reqs gauge" in text
        assert c.get("/health_generate").status_code == 200
    assert not engine.started


def test_unknown_route_and_method(client):
    err_of(client.get("/v1/nope"), 404)
    assert client.get("/v1/nope").json()["error"]["type"] == "not_found_error"
    err_of(client.get("/v1/chat/completions"), 405)


def test_flush_cache_refused_while_running(client, engine):
    engine.running.add("busy")
    body = err_of(client.post("/flush_cache"), 400)
    assert "running" in body["message"]


# --------------------------------------------------------------------------- chat

def test_chat_non_streaming(client, engine):
    r = client.post("/v1/chat/completions", json={
        "model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == "fake"
    assert body["id"].startswith("chatcmpl-")
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Paris"},
                                "logprobs": None, "finish_reason": "length", "matched_stop": None}]
    prompt_len = len("<user>hi<assistant>")
    assert body["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 5,
                             "total_tokens": prompt_len + 5, "prompt_tokens_details": {"cached_tokens": 0}}
    assert engine.seen[0].input_ids == list(b"<user>hi<assistant>")
    assert engine.seen[0].rid == body["id"]


def test_chat_stop_string_and_model_alias(client, engine):
    body = {"model": "/models/fake", "messages": [{"role": "user", "content": "hi"}], "stop": ["X", "i"]}
    err_of(client.post("/v1/chat/completions", json=body), 404, "model")   # the path is not shown
    engine.server_args.expose_server_info = True                            # ... unless it may be
    r = client.post("/v1/chat/completions", json=body)
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "Par"
    assert (choice["finish_reason"], choice["matched_stop"]) == ("stop", "i")


def test_chat_n_choices_indexed(client, engine):
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 3, "seed": 1})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in body["choices"]] == ["ari", "ris", "is "]
    rid = body["id"]
    assert sorted(req.rid for req in engine.seen) == [f"{rid}-0", f"{rid}-1", f"{rid}-2"]
    assert all(req.input_ids == engine.seen[0].input_ids for req in engine.seen)
    u = body["usage"]
    assert u["prompt_tokens"] == len(engine.seen[0].input_ids)            # the prompt, once
    assert u["completion_tokens"] == 9 and u["prompt_tokens_details"]["cached_tokens"] == 1


def test_chat_streaming_with_usage_and_n(client):
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2, "stream": True,
        "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    for e in events:
        assert e["object"] == "chat.completion.chunk" and e["model"] == "fake" and "created" in e
        assert e["id"] == events[0]["id"]
    firsts = {e["choices"][0]["index"]: e["choices"][0]["delta"] for e in events[:2]}
    assert firsts == {0: {"role": "assistant", "content": ""}, 1: {"role": "assistant", "content": ""}}
    *body, last = events
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 8
    assert all(e["usage"] is None for e in body)
    texts = {0: "", 1: ""}
    finishes = {}
    for e in body:
        c = e["choices"][0]
        texts[c["index"]] += c["delta"].get("content", "")
        if c["finish_reason"]:
            finishes[c["index"]] = c["finish_reason"]
    assert texts == {0: "Pari", 1: "Pari"} and finishes == {0: "length", 1: "length"}


def test_chat_logprobs(client, engine):
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True,
        "top_logprobs": 2})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["P", "a"]
    assert [c["logprob"] for c in content] == [-0.25, -0.5]
    assert content[0]["bytes"] == [ord("P")]
    assert content[0]["top_logprobs"] == [{"token": "P", "logprob": -0.25, "bytes": [80]},
                                          {"token": "x", "logprob": -9.0, "bytes": [120]}]
    assert engine.seen[0].return_logprob and engine.seen[0].top_logprobs_num == 2
    # streamed: each content chunk carries its token's logprobs
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True,
        "stream": True})
    lps = [e["choices"][0]["logprobs"] for e in sse_events(r) if e["choices"][0]["logprobs"]]
    assert [lp["content"][0]["token"] for lp in lps] == ["P", "a"]
    assert all(lp["content"][0]["top_logprobs"] == [] for lp in lps)


@pytest.mark.parametrize("body, status, param", [
    ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4"}, 404, "model"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "warm"}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_p": 2}, 400, "top_p"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, 400, "n"),
    ({"messages": [{"role": "", "content": "hi"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "BADTEMPLATE"}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "x" * 80}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 60}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 60}, 400,
     "max_completion_tokens"),
    ({}, 400, "messages"),
])
def test_chat_errors(client, engine, body, status, param):
    err_of(client.post("/v1/chat/completions", json=body), status, param)
    assert engine.seen == []


def test_malformed_json_and_non_object(client):
    r = client.post("/v1/chat/completions", content=b"{oops", headers={"content-type": "application/json"})
    assert "JSON" in err_of(r, 400)["message"]
    err_of(client.post("/v1/completions", json=[1, 2]), 400)
    err_of(client.post("/generate", content=b"\xff"), 400)


def test_engine_exception_is_500_and_server_keeps_serving(client, engine):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "BOOM"}]})
    body = err_of(r, 500)
    assert "kaboom" in body["message"] and body["type"] == "internal_server_error"
    assert engine.running == set()
    # streamed: the error arrives in-band, then [DONE]
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "BOOM"}],
                                                  "stream": True})
    events = sse_events(r)
    assert events[-1]["error"]["code"] == 500 and "kaboom" in events[-1]["error"]["message"]
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                  "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Pa"


def test_engine_abort_is_503_for_openai_and_passed_on_natively(client):
    body = {"messages": [{"role": "user", "content": "ABORTME"}]}
    err = err_of(client.post("/v1/chat/completions", json=body), 503)
    assert "aborted" in err["message"] and "KV pool is full" in err["message"]
    events = sse_events(client.post("/v1/chat/completions", json={**body, "stream": True}))
    assert events[-1]["error"]["code"] == 503
    err_of(client.post("/v1/completions", json={"prompt": "ABORTME"}), 503)
    out = client.post("/generate", json={"text": "ABORTME", "sampling_params": {"max_new_tokens": 5}}).json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and out["text"] == "Pa"


# --------------------------------------------------------------------------- completions

def test_completions_batch_and_n(client, engine):
    r = client.post("/v1/completions", json={"prompt": ["ab", "cd"], "n": 2, "max_tokens": 2})
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == ["Pa"] * 4
    by_rid = {req.rid: bytes(req.input_ids) for req in engine.seen}
    rid = body["id"]
    assert by_rid == {f"{rid}-0": b"ab", f"{rid}-1": b"ab", f"{rid}-2": b"cd", f"{rid}-3": b"cd"}
    assert body["usage"]["prompt_tokens"] == 4 and body["usage"]["completion_tokens"] == 8


def test_completions_token_prompts_default_max_tokens(client, engine):
    r = client.post("/v1/completions", json={"prompt": [[104, 105], [106]]})
    assert [c["text"] for c in r.json()["choices"]] == [REPLY[:16]] * 2
    assert [req.input_ids for req in engine.seen] == [[104, 105], [106]]
    err_of(client.post("/v1/completions", json={"prompt": [1, 300]}), 400, "prompt")


def test_completions_echo_with_logprobs(client, engine):
    r = client.post("/v1/completions", json={"prompt": "hi", "echo": True, "logprobs": 1, "max_tokens": 2})
    choice = r.json()["choices"][0]
    assert choice["text"] == "hiPa"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["h", "i", "P", "a"]
    assert lp["token_logprobs"] == [None, -1.0, -0.25, -0.5]
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][2] == {"P": -0.25}
    assert lp["text_offset"] == [0, 1, 2, 3]
    assert engine.seen[0].logprob_start_len == 0
    # streamed: the first chunk carries the prompt too
    r = client.post("/v1/completions", json={"prompt": "hi", "echo": True, "logprobs": 0,
                                             "max_tokens": 2, "stream": True})
    events = sse_events(r)
    assert all(e["object"] == "text_completion" for e in events)
    assert "".join(e["choices"][0]["text"] for e in events) == "hiPa"
    offsets = [o for e in events if e["choices"][0]["logprobs"] for o in e["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == [0, 1, 2, 3]


def test_completions_stream_usage(client):
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": True,
                                             "stream_options": {"include_usage": True}})
    events = sse_events(r)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["total_tokens"] == 5
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "Par"
    assert events[-2]["choices"][0]["finish_reason"] == "length"


# --------------------------------------------------------------------------- native

def test_generate_single_and_batch(client, engine):
    r = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 3},
                                       "rid": "mine"})
    body = r.json()
    assert body["text"] == "Par" and body["output_ids"] == list(b"Par")
    assert body["meta_info"] == {"id": "mine", "prompt_tokens": 2, "completion_tokens": 3,
                                 "cached_tokens": 0, "finish_reason": {"type": "length", "matched": None}}
    r = client.post("/generate", json={"input_ids": [[1, 2], [3]], "return_logprob": True,
                                       "logprob_start_len": 0, "top_logprobs_num": 1,
                                       "sampling_params": {"max_new_tokens": 1}})
    out = r.json()
    assert isinstance(out, list) and len(out) == 2
    meta = out[0]["meta_info"]
    assert meta["input_token_logprobs"] == [[None, 1, None], [-1.0, 2, None]]
    assert meta["output_token_logprobs"] == [[-0.25, 80, None]]
    assert meta["output_top_logprobs"] == [[[-0.25, 80, None]]]
    assert meta["input_top_logprobs"][0] is None


def test_generate_stream_is_cumulative(client):
    r = client.post("/generate", json={"text": "hi", "stream": True,
                                       "sampling_params": {"max_new_tokens": 3}})
    events = sse_events(r)
    assert [e["text"] for e in events] == ["P", "Pa", "Par"]
    assert events[-1]["output_ids"] == list(b"Par")
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_generate_errors(client, engine):
    err_of(client.post("/generate", json={"sampling_params": {}}), 400, "text")
    err_of(client.post("/generate", json={"text": "a", "sampling_params": {"top_p": 0}}), 400,
           "sampling_params.top_p")
    err_of(client.post("/generate", json={"text": "x" * 70}), 400, "text")
    err_of(client.post("/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 64}}),
           400, "max_new_tokens")
    assert engine.seen == []


def test_abort_request_route(client, engine):
    assert client.post("/abort_request", json={"rid": "abc"}).status_code == 200
    assert engine.aborted == ["abc"]
    err_of(client.post("/abort_request", json={}), 400, "rid")


# --------------------------------------------------------------------------- disconnect

@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "HANG"}], "n": 2,
                              "stream": True}),
    ("/v1/completions", {"prompt": "HANG", "max_tokens": 50, "stream": True}),
    ("/generate", {"text": "HANG", "stream": True, "sampling_params": {"max_new_tokens": 50}}),
    ("/v1/completions", {"prompt": "HANG", "max_tokens": 50}),
])
def test_client_disconnect_aborts_requests(engine, path, body):
    """Drive the ASGI app by hand: after two body chunks (or at once for a non-streamed
    request) the client disconnects; every sequence must be aborted and none left running."""
    app = create_app(engine)
    raw = json.dumps(body).encode()

    async def scenario():
        gone = asyncio.Event()
        sent = []
        delivered = False

        async def receive():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": raw, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)
            if message["type"] == "http.response.body" and message.get("body"):
                if sum(1 for m in sent if m["type"] == "http.response.body" and m.get("body")) >= 2:
                    gone.set()

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
                 "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
                 "raw_path": path.encode(), "query_string": b"", "root_path": "",
                 "headers": [(b"content-type", b"application/json")],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "state": {}}
        task = asyncio.ensure_future(app(scope, receive, send))
        if not body.get("stream"):
            while not engine.seen:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            gone.set()
        await asyncio.wait_for(task, 5)
        return sent

    sent = asyncio.run(scenario())
    assert sent[0]["type"] == "http.response.start"
    assert engine.seen, "the request never reached the engine"
    assert engine.running == set()
    assert sorted(engine.aborted) == sorted(r.rid for r in engine.seen)
    body_bytes = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert b"[DONE]" not in body_bytes


# --------------------------------------------------------------------------- CLI

def test_cli_rejects_bad_flags_with_a_message(capsys):
    from radixserve import cli, launch_server
    assert cli.main(["serve", "--page-size", "0"]) == 2
    assert "--page-size must be >= 1" in capsys.readouterr().err
    assert launch_server.main(["--schedule-policy", "random"]) == 2
    assert "--schedule-policy" in capsys.readouterr().err
    assert cli.main(["serve", "--log-level", "loud"]) == 2
    assert "--log-level" in capsys.readouterr().err


def test_cli_serve_takes_every_server_arg():
    import dataclasses
    from radixserve import cli
    ns = cli.build_parser().parse_args(["serve", "--model-path", "/m", "--port", "1234",
                                        "--disable-radix-cache", "--max-total-tokens", "99"])
    args = ServerArgs.from_cli_args(ns)
    assert (args.model_path, args.port, args.disable_radix_cache, args.max_total_tokens) == ("/m", 1234, True, 99)
    launch_ns = cli.serve_parser().parse_args([])
    assert {f.name for f in dataclasses.fields(ServerArgs)} <= set(vars(launch_ns))
    assert cli.main(["bench", "--help"]) == 0       # the packaged benchmarks, no checkout needed


def test_long_prompts_are_tokenized_off_the_event_loop(engine, client):
    """A short prompt is tokenized inline on the loop's thread; one of OFF_LOOP_CHARS or more on
    the encode pool's threads (so it cannot stall the loop), for /generate, completions and
    chats, whose template always renders on a worker thread (a template's cost need not
    follow the size of its input)."""
    import threading

    from radixserve.server.generation import OFF_LOOP_CHARS

    encodes, renders = [], []
    real_encode, real_render = engine.tokenizer.encode, engine.tokenizer.apply_chat_template

    def encode(text, add_special_tokens=True, max_tokens=None):
        encodes.append(threading.current_thread())
        return real_encode(text, add_special_tokens, max_tokens)

    def apply_chat_template(messages, **kw):
        renders.append(threading.current_thread())
        return real_render(messages, **kw)

    engine.tokenizer.encode, engine.tokenizer.apply_chat_template = encode, apply_chat_template
    engine.context_len = 4 * OFF_LOOP_CHARS                # long prompts fit: they are encoded
    long_text = "x" * (OFF_LOOP_CHARS + 10)
    bodies = [("/generate", lambda t: {"text": t, "sampling_params": {"max_new_tokens": 1}}),
              ("/v1/completions", lambda t: {"model": "fake", "prompt": t, "max_tokens": 1}),
              ("/v1/chat/completions", lambda t: {"model": "fake", "max_tokens": 1,
                                                  "messages": [{"role": "user", "content": t}]})]
    loop_thread = None
    for route, body in bodies:
        encodes.clear()
        assert client.post(route, json=body("hi")).status_code == 200
        assert client.post(route, json=body(long_text)).status_code == 200
        assert len(encodes) == 2, route
        if route == "/generate":
            loop_thread = encodes[0]                  # the short prompt, inline on the loop
        else:
            assert encodes[0] == loop_thread, route
        assert encodes[1].name.startswith("radixserve-encode"), f"{route}: {encodes[1].name}"
    assert renders and loop_thread not in renders, "a chat was rendered on the loop"


def test_a_prompt_too_long_for_any_tokenization_is_refused_before_it_is_encoded(engine, client):
    """context_len x max_chars_per_token characters (the tokenizer's silent characters not
    counted) cannot fit: a 400 naming the field before a token is computed; a prompt within
    that bound is encoded and refused by its token count as before; with
    truncate_prompt_tokens the whole prompt is encoded (it will be cut)."""
    from radixserve.tokenizer.tokenizer import TooManyTokens

    encoded, listed = [], []
    real_encode = engine.tokenizer.encode

    def encode(text, add_special_tokens=True, max_tokens=None):
        encoded.append(len(text))
        ids = real_encode(text, add_special_tokens)
        if max_tokens is not None and len(ids) > max_tokens:
            raise TooManyTokens(len(ids), max_tokens)    # the ids are never listed
        listed.append(len(ids))
        return ids

    engine.tokenizer.encode = encode
    engine.tokenizer.max_chars_per_token = 2                 # the fake covers 1: a loose bound
    limit = (CONTEXT_LEN - 1) * 2
    too_long = "y" * (limit + 1)
    for route, body, param in [
            ("/generate", {"text": too_long}, "text"),
            ("/v1/completions", {"prompt": too_long}, "prompt"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": too_long}]}, "messages"),
            ("/v1/score", {"query": too_long, "items": ["a"], "label_token_ids": [1]}, "items[0]"),
            ("/v1/responses", {"input": too_long}, "input")]:
        msg = err_of(client.post(route, json=body), 400, param)["message"]
        assert f"{limit} characters" in msg and "context length 64" in msg, msg
    assert encoded == []
    # silent characters (that give no token) are not counted against the bound
    engine.tokenizer.silent_chars = frozenset("y")
    msg = err_of(client.post("/v1/completions", json={"prompt": too_long}), 400, "prompt")["message"]
    assert "fewer than 64 tokens" in msg and encoded == [len(too_long)] and listed == []
    engine.tokenizer.silent_chars = frozenset()
    # within the bound but over the context in tokens: refused by count, ids never listed
    encoded.clear()
    msg = err_of(client.post("/v1/completions", json={"prompt": "y" * limit}), 400, "prompt")["message"]
    assert "the prompt is 126 tokens long" in msg and encoded == [limit] and listed == []
    # truncate_prompt_tokens: encoded whole, then cut
    r = client.post("/v1/completions", json={"prompt": too_long, "max_tokens": 1,
                                             "truncate_prompt_tokens": 8})
    assert r.status_code == 200 and engine.seen[-1].input_ids == list(b"y" * 8)
    assert encoded[-1] == len(too_long) and listed[-1] == len(too_long)


def test_full_waiting_queue_gets_503_with_retry_after(engine, client):
    """Beyond --max-queued-requests the engine refuses before anything starts: 503 with
    Retry-After, the OpenAI error shape, and no sequence handed to the engine."""
    from radixserve.errors import EngineOverloaded

    def check_capacity(num_new):
        if num_new > 1:
            raise EngineOverloaded("the server is busy: 7 sequences are waiting", 2)

    engine.check_capacity = check_capacity
    before = len(engine.seen)
    r = client.post("/v1/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 2,
                                             "n": 2})
    assert r.status_code == 503 and r.headers["retry-after"] == "2"
    assert r.json()["error"]["code"] == 503 and "busy" in r.json()["error"]["message"]
    assert len(engine.seen) == before
    ok = client.post("/v1/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_async_engine_capacity_counts_the_waiting_queue():
    from types import SimpleNamespace

    import pytest

    from radixserve.engine.async_engine import AsyncEngine
    from radixserve.errors import EngineOverloaded

    fake = SimpleNamespace(scheduler=SimpleNamespace(waiting=[object()] * 3),
                           server_args=SimpleNamespace(max_queued_requests=4), _draining=False)
    fake.waiting_count = lambda: AsyncEngine.waiting_count(fake)    # the scheduler's queue
    AsyncEngine.check_capacity(fake, 1)                    # 3 + 1 <= 4
    with pytest.raises(EngineOverloaded, match="3 sequences are waiting"):
        AsyncEngine.check_capacity(fake, 2)
    fake._draining = True                                  # SIGTERM: nothing new is admitted
    with pytest.raises(EngineOverloaded, match="shutting down"):
        AsyncEngine.check_capacity(fake, 1)


def test_requests_carry_their_client_identity(engine, client):
    """The scheduler's fairness key (--max-running-requests-per-client) is the client's
    identity: the API key's, or without one the peer address."""
    assert client.post("/generate", json={"text": "hi", "sampling_params":
                                          {"max_new_tokens": 1}}).status_code == 200
    assert engine.seen[-1].client_id and engine.seen[-1].client_id.startswith("peer:")


def test_a_request_that_can_never_be_queued_is_400_not_503(engine, client):
    """More sequences (prompts x n) than --max-queued-requests can never be admitted: a 400
    saying so (a retry would fail again), not a 503 with Retry-After; nothing starts."""
    engine.server_args.max_queued_requests = 4
    for route, body in [("/v1/completions", {"prompt": "hi", "max_tokens": 1, "n": 5}),
                        ("/v1/completions", {"prompt": ["a", "b", "c"], "max_tokens": 1, "n": 2}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                  "max_tokens": 1, "n": 5}),
                        ("/generate", {"text": ["a", "b", "c", "d", "e"],
                                       "sampling_params": {"max_new_tokens": 1}})]:
        r = client.post(route, json=body)
        assert "retry-after" not in r.headers
        assert "--max-queued-requests" in err_of(r, 400)["message"], route
    assert engine.seen == []
    ok = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "n": 4})
    assert ok.status_code == 200 and len(engine.seen) == 4


def test_min_tokens_above_max_tokens_is_400(client, engine):
    """No sequence can produce at least min_tokens and at most max_tokens < min_tokens: a 400
    naming min_tokens (min_new_tokens natively) on every route; equal bounds are fine."""
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for route, body, param in [
            ("/v1/chat/completions", {**chat, "max_tokens": 3, "min_tokens": 5}, "min_tokens"),
            ("/v1/chat/completions", {**chat, "max_completion_tokens": 3, "min_tokens": 4}, "min_tokens"),
            ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
            ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1, "min_new_tokens": 2}},
             "sampling_params.min_new_tokens"),
            ("/generate", {"text": ["a", "b"], "sampling_params": [
                {"max_new_tokens": 1}, {"max_new_tokens": 1, "min_new_tokens": 9}]},
             "sampling_params[1].min_new_tokens")]:
        msg = err_of(client.post(route, json=body), 400, param)["message"]
        assert msg.startswith(param) and "is more than" in msg, msg
    assert engine.seen == []
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "min_tokens": 3})
    assert r.status_code == 200


@pytest.mark.parametrize("body, param", [
    ({"query": 5, "items": ["a"], "label_token_ids": [1]}, "query"),
    ({"query": None, "items": ["a"], "label_token_ids": [1]}, "query"),
    ({"query": [], "items": ["a"], "label_token_ids": [1]}, "query"),
    ({"query": "q", "items": [5], "label_token_ids": [1]}, "items[0]"),
    ({"query": "q", "items": ["a", {"x": 1}], "label_token_ids": [1]}, "items[1]"),
    ({"query": "q", "items": [[1, "x"]], "label_token_ids": [1]}, "items[0][1]"),
    ({"query": [1, -2], "items": [[1]], "label_token_ids": [1]}, "query[1]"),
    ({"query": "q", "items": "a", "label_token_ids": [1]}, "items"),
])
def test_score_errors_name_the_field_not_pydantic_internals(client, body, param):
    msg = err_of(client.post("/v1/score", json=body), 400, param)["message"]
    assert msg.startswith(param + " ")
    for internal in ("constrained", "function-", "union", "list[", "str]", "int]"):
        assert internal not in msg, msg
