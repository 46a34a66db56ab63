"""Native routes, every bad input over real HTTP (status, OpenAI-style body, the field named),
and a client disconnect mid-stream freeing its request."""
import json
import socket
import time

import pytest

pytestmark = pytest.mark.slow

MSGS = [{"role": "user", "content": "hi"}]


def test_info_routes(http, server):
    assert http.get("/health").status_code == 200 and http.get("/health").content == b""
    info = http.get("/get_model_info").json()
    assert info["is_generation"] is True and info["model_path"] and info["tokenizer_path"]
    sinfo = http.get("/get_server_info").json()
    assert sinfo["served_model_name"] == server.model and sinfo["context_len"] > 0
    text = http.get("/metrics").text
    for name in ("prompt_tokens_total", "cached_tokens_total", "generation_tokens_total",
                 "num_requests_total", "num_running_reqs", "num_waiting_reqs"):
        assert f"radixserve:{name}{{" in text
    assert http.get("/health_generate").status_code == 200


def test_generate_native_shapes_and_flush(http, server):
    before = server.metric("generation_tokens_total")
    body = {"text": "The capital of France is", "return_logprob": True, "logprob_start_len": 0,
            "top_logprobs_num": 2, "return_text_in_logprobs": True, "rid": "native-1",
            "sampling_params": {"temperature": 0, "max_new_tokens": 4}}
    out = http.post("/generate", json=body).json()
    meta = out["meta_info"]
    assert meta["id"] == "native-1" and meta["completion_tokens"] == len(out["output_ids"]) == 4
    assert meta["finish_reason"] == {"type": "length", "matched": None}
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
    assert meta["input_token_logprobs"][0][0] is None
    assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
    assert "".join(e[2] for e in meta["output_token_logprobs"]) == out["text"]
    assert all(len(t) == 2 for t in meta["output_top_logprobs"])
    assert server.metric("generation_tokens_total") >= before + 4
    # streamed: cumulative text, the last chunk equals the non-streamed result
    body.update(stream=True, rid="native-2")
    events = []
    with http.stream("POST", "/generate", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert texts[-1] == out["text"] and chunks[-1]["output_ids"] == out["output_ids"]
    # finished sequences stay in the radix cache (evictable) until /flush_cache empties it
    server.wait_idle()
    assert server.metric("evictable_tokens") > 0
    assert http.post("/flush_cache").status_code == 200
    assert server.metric("evictable_tokens") == 0


BAD_INPUTS = [
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", {"messages": MSGS, "model": "nope"}, 404, "model"),
    ("/v1/chat/completions", {}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": 7, "content": "x"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {"messages": MSGS, "temperature": "1"}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": MSGS, "temperature": -0.5}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": MSGS, "top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": MSGS, "top_p": 1.01}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": MSGS, "n": 0}, 400, "n"),
    ("/v1/chat/completions", {"messages": MSGS, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 10 ** 7}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello " * 9000}]}, 400, "messages"),
    ("/v1/completions", {"model": "x", "prompt": "hi"}, 404, "model"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 10 ** 9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 99}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("/generate", {"sampling_params": {}}, 400, "text"),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": -1}}, 400, "sampling_params.temperature"),
    ("/generate", {"text": "hi", "sampling_params": {"bogus": 1}}, 400, "sampling_params"),
    ("/generate", {"input_ids": [1, "a"]}, 400, "input_ids[1]"),
]


@pytest.mark.parametrize("path, body, status, param", BAD_INPUTS)
def test_bad_inputs_over_http(http, path, body, status, param):
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["message"]
    assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert err["param"] == param
    if param:
        assert param.split("[")[0] in err["message"]


def test_server_survives_bad_inputs(http):
    for path, body, status, _ in BAD_INPUTS:
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        assert http.post(path, **kw).status_code == status
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json={"prompt": "1, 2, 3,", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"]


def test_client_disconnect_frees_the_request(server, http):
    server.wait_idle()
    baseline = server.metric("num_used_tokens")
    aborted_before = server.metric("num_aborted_requests_total")
    body = json.dumps({"messages": [{"role": "user", "content": "Tell me a long story."}],
                       "max_tokens": 2000, "ignore_eos": True, "temperature": 0, "stream": True})
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}")
    port = int(server.url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=120)
    try:
        sock.sendall(request.encode())
        received = b""
        while received.count(b"data: ") < 3:            # the role chunk and two content chunks
            data = sock.recv(65536)
            assert data, "the server closed the stream early"
            received += data
        assert b" 200 " in received.split(b"\r\n", 1)[0]
        assert server.metric("num_running_reqs") == 1
        assert server.metric("num_used_tokens") > baseline
    finally:
        sock.close()
    deadline = time.monotonic() + 60
    while server.metric("num_aborted_requests_total") < aborted_before + 1:
        assert time.monotonic() < deadline, "the disconnected request was not aborted"
        time.sleep(0.1)
    server.wait_idle()
    assert server.metric("num_used_tokens") == baseline
    r = http.post("/v1/completions", json={"prompt": "1, 2, 3,", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200
