"""SGLang's native extras on the real server: /v1/score (checked against HF transformers on the
same GGUF), cache_salt (prefix sharing only within one salt, shown by cached-token counts),
/abort_request with abort_all, and /get_server_info's SGLang field names."""
import threading
import uuid

import httpx
import pytest
import torch

LONG = ("A lighthouse stood on the northern cape, and every night its keeper climbed the "
        "ninety steps to light the lamp, counting the ships that passed far out at sea. ")


def _generate(server, **body):
    r = httpx.post(server.url + "/generate", timeout=120, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _hf_next_token_logprobs(model, tokenizer, text):
    ids = torch.tensor([tokenizer.encode(text)])
    with torch.no_grad():
        logits = model(ids).logits[0, -1].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("apply_softmax,item_first", [(True, False), (False, False), (True, True)])
def test_score_matches_hf(server, hf_gguf_model, default_tokenizer, apply_softmax, item_first):
    """scores[i][j] = P(label j | query + item i), over the labels with apply_softmax, over the
    vocabulary without; item_first puts the item before the query."""
    query, items = ("I pledge allegiance", ["", " to the"]) if not item_first else \
        (" is a city", ["Tokyo", "Paris"])
    labels = [default_tokenizer.encode(" to")[0], default_tokenizer.encode(" the")[0],
              default_tokenizer.encode(" in")[0]]
    r = httpx.post(server.url + "/v1/score", timeout=120, json={
        "query": query, "items": items, "label_token_ids": labels,
        "apply_softmax": apply_softmax, "item_first": item_first})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "scoring" and len(out["scores"]) == len(items)
    for item, row in zip(items, out["scores"]):
        text = item + query if item_first else query + item
        ref = _hf_next_token_logprobs(hf_gguf_model, default_tokenizer, text)[labels]
        expect = torch.softmax(ref, -1) if apply_softmax else ref.exp()
        assert row == pytest.approx(expect.tolist(), abs=2e-3)
        if apply_softmax:
            assert sum(row) == pytest.approx(1.0, abs=1e-6)
        else:
            assert sum(row) < 1.0


def test_score_with_token_ids_equals_text(server, default_tokenizer):
    labels = [default_tokenizer.encode(" yes")[0], default_tokenizer.encode(" no")[0]]
    q, item = "Is water wet? Answer:", " Maybe"
    by_text = httpx.post(server.url + "/v1/score", timeout=120, json={
        "query": q, "items": [item], "label_token_ids": labels}).json()["scores"]
    ids = default_tokenizer.encode(q + item)
    cut = len(default_tokenizer.encode(q))
    assert ids[:cut] == default_tokenizer.encode(q)
    by_ids = httpx.post(server.url + "/v1/score", timeout=120, json={
        "query": ids[:cut], "items": [ids[cut:]], "label_token_ids": labels}).json()["scores"]
    assert by_ids[0] == pytest.approx(by_text[0], abs=1e-4)


@pytest.mark.parametrize("body,param", [
    ({"query": "x", "items": ["a"], "label_token_ids": [10 ** 9]}, "label_token_ids"),
    ({"query": "x", "items": [[1, 2]], "label_token_ids": [5]}, "items"),
    ({"query": "x", "items": [], "label_token_ids": [5]}, "items"),
    ({"query": "x", "items": ["a"], "label_token_ids": []}, "label_token_ids"),
])
def test_score_refuses_bad_requests(server, body, param):
    r = httpx.post(server.url + "/v1/score", timeout=60, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    # SGLang's flat error fields beside OpenAI's (SGLang's score clients read these)
    assert (r.json()["type"], r.json()["param"]) == ("BadRequestError", param)


def test_cache_salt_keeps_sharing_inside_one_salt(server):
    """Same prompt: a second request with the same salt reuses the KV, a different salt or no
    salt does not (and an unsalted prompt's KV is not found by a salted request)."""
    # nothing of it cached yet: a fresh lead (the server is shared with other tests, whose
    # prompts may begin like LONG) and salts no other test uses
    tag = uuid.uuid4().hex
    prompt = f"Salted {tag}: " + LONG
    a, b = f"tenant-a-{tag}", f"tenant-b-{tag}"
    sp = {"max_new_tokens": 1, "temperature": 0}
    n = _generate(server, text=prompt, sampling_params=sp, cache_salt=a)["meta_info"]
    assert n["cached_tokens"] == 0
    again = _generate(server, text=prompt, sampling_params=sp, cache_salt=a)["meta_info"]
    assert again["cached_tokens"] == again["prompt_tokens"] - 1
    other = _generate(server, text=prompt, sampling_params=sp, cache_salt=b)["meta_info"]
    assert other["cached_tokens"] == 0
    plain = _generate(server, text=prompt, sampling_params=sp)["meta_info"]
    assert plain["cached_tokens"] <= 1       # at most "Salted", from some other test's prompt
    plain2 = _generate(server, text=prompt, sampling_params=sp)["meta_info"]
    assert plain2["cached_tokens"] == plain2["prompt_tokens"] - 1
    third = _generate(server, text=prompt, sampling_params=sp, cache_salt=f"tenant-c-{tag}")["meta_info"]
    assert third["cached_tokens"] == 0


def test_cache_salt_does_not_change_outputs(server):
    sp = {"max_new_tokens": 8, "temperature": 0}
    a = _generate(server, text="The capital of France is", sampling_params=sp)
    b = _generate(server, text="The capital of France is", sampling_params=sp, cache_salt="s")
    assert a["output_ids"] == b["output_ids"]


def test_abort_all_ends_every_live_request_of_the_client(server):
    """abort_all: both of this client's long streams end with finish_reason abort."""
    finishes = {}

    def stream(name):
        with httpx.stream("POST", server.url + "/generate", timeout=120, json={
                "text": f"Count forever {name}:", "stream": True,
                "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}) as r:
            last = None
            for line in r.iter_lines():
                if line.startswith("data:") and line != "data: [DONE]":
                    last = line
            finishes[name] = last

    threads = [threading.Thread(target=stream, args=(k,)) for k in ("a", "b")]
    for t in threads:
        t.start()
    deadline_steps = 0
    while server.metric("num_running_reqs") < 2 and deadline_steps < 600:
        deadline_steps += 1
        threading.Event().wait(0.05)
    r = httpx.post(server.url + "/abort_request", timeout=30, json={"rid": "", "abort_all": True})
    assert r.status_code == 200
    for t in threads:
        t.join(timeout=120)
    assert set(finishes) == {"a", "b"}
    for last in finishes.values():
        assert '"finish_reason": {"type": "abort"' in last or '"type":"abort"' in last
    server.wait_idle()


def test_abort_request_needs_a_target(server):
    r = httpx.post(server.url + "/abort_request", timeout=30, json={"rid": ""})
    assert r.status_code == 400


def test_server_info_has_sglang_names(server):
    info = httpx.get(server.url + "/get_server_info", timeout=30).json()
    assert info["max_total_num_tokens"] > 0 and info["version"]
    assert info["max_req_input_len"] == info["context_len"] - 1
    assert isinstance(info["internal_states"], list) and "last_gen_throughput" in info[
        "internal_states"][0]
    assert info["schedule_policy"] == info["server_args"]["schedule_policy"]
    assert "api_key" not in info and "api_key" not in info["server_args"]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_cache_salt_on_the_openai_routes(server, route):
    """vLLM's cache_salt: the second call with the same salt reuses the prompt, another salt
    does not (usage.prompt_tokens_details.cached_tokens)."""
    text = LONG + uuid.uuid4().hex
    body = ({"prompt": text} if route == "/v1/completions"
            else {"messages": [{"role": "user", "content": text}]})
    body.update(model=server.model, max_tokens=1, temperature=0)

    def cached(salt):
        r = httpx.post(server.url + route, timeout=120, json={**body, "cache_salt": salt})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        return usage["prompt_tokens"], (usage.get("prompt_tokens_details") or {}).get(
            "cached_tokens", 0)

    prompt_tokens, first = cached("x")
    assert first == 0
    assert cached("x")[1] == prompt_tokens - 1
    assert cached("y")[1] == 0
