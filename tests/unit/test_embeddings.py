"""Issue 40 point 2, embeddings and rerank (--is-embedding; engine/pooling.py,
server/embeddings_api.py), on a tiny random Qwen3 over the default model's tokenizer (CPU,
fp32), against HF transformers as the oracle:

  * pooling through the scheduler: last-token and mean pooling equal HF's final hidden states
    (last_hidden_state, pooled, L2-normalised) within 1e-4, for a batch of prompts of
    different lengths run together, for chunked prefill, and for a prompt whose prefix the
    radix cache holds (last pooling takes the hit; mean pooling never does); dimensions
    truncates then renormalises; no KV slot or row leaks;
  * a bare backbone checkpoint (HF's Qwen3Model, no LM head, names without "model."), as
    Qwen3-Embedding ships, loads with --is-embedding and only then;
  * rerank: the qwen3 template's ids are the model card's tokenization, the scores are
    P(yes) of HF's logits on the same prompts, and the order matches;
  * the HTTP routes over a real engine: /v1/embeddings (float, base64, dimensions, batches),
    /v1/rerank (top_n, return_documents), every bad parameter a 400 that starts nothing,
    generation routes refused, /get_model_info and /get_server_info say is_embedding.
"""
import base64
import math
import shutil
import struct

import pytest
import torch
from starlette.testclient import TestClient

from radixserve.config import ModelConfig, ServerArgs
from radixserve.engine.pooling import PoolParams, resolve_pooling_method
from radixserve.engine.req import Req
from radixserve.engine.scheduler import Scheduler
from radixserve.model.loader import load_model
from radixserve.model.runner import ModelRunner
from radixserve.sampling.params import SamplingParams

from conftest import run_to_completion
from test_server_fake_engine import LOCAL, FakeEngine

HIDDEN = 64
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _qwen3_config(tie: bool):
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=49152, hidden_size=HIDDEN, intermediate_size=96,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=32, max_position_embeddings=512, tie_word_embeddings=tie,
                       rms_norm_eps=1e-6, rope_theta=1000000.0)


def _randomize(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.15 * noise)


def _save(hf, path, default_model_path) -> str:
    hf.save_pretrained(path, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(f"{default_model_path}/{name}", path / name)
    return str(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_path):
    """(HF Qwen3ForCausalLM, its directory with the default model's tokenizer, our model)."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(_qwen3_config(tie=True)).eval()
    _randomize(hf, seed=1)
    path = _save(hf, tmp_path_factory.mktemp("qwen3-embed"), default_model_path)
    config = ModelConfig.from_path(path)
    ours = load_model(path, config, "safetensors", torch.float32, "cpu")
    return hf, path, ours


def _scheduler(tiny, **overrides) -> Scheduler:
    _, path, model = tiny
    kw = dict(model_path=path, device="cpu", max_total_tokens=2048, max_running_requests=8,
              context_length=512, is_embedding=True)
    kw.update(overrides)
    args = ServerArgs(**kw)
    runner = ModelRunner(args, ModelConfig.from_path(path), path, context_len=512, model=model)
    return Scheduler(args, runner)


def _pool_req(rid, ids, pool, outputs):
    return Req(rid, ids, SamplingParams(max_new_tokens=0, temperature=0.0), 0, pool=pool,
               sink=outputs.append)


def _hf_hidden(hf, ids) -> torch.Tensor:
    with torch.no_grad():
        return hf.model(torch.tensor([ids])).last_hidden_state[0].float()     # [len, hidden]


def _expected(hf, ids, method="last", dimensions=None) -> torch.Tensor:
    h = _hf_hidden(hf, ids)
    v = h[-1] if method == "last" else h.mean(0)
    if dimensions is not None:
        v = v[:dimensions]
    return torch.nn.functional.normalize(v, dim=0)


def _close(got, expected, atol=1e-4):
    got, expected = torch.as_tensor(got), torch.as_tensor(expected)
    assert got.shape == expected.shape
    diff = (got - expected).abs().max().item()
    assert diff < atol, f"max abs difference {diff}"


def _no_leak(sched: Scheduler) -> None:
    sched.check_integrity()
    assert not sched.reqs and not sched.running and not sched.waiting
    assert sched.req_to_token_pool.available_size() == sched.req_to_token_pool.size
    assert sched.kv_pool.available_size() + sched.cache.evictable_size() == sched.kv_pool.num_slots


def _ids(n, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(10, 40000, (n,), generator=gen).tolist()


def _final(outputs, rid):
    done = [o for o in outputs if o.rid == rid and o.finished]
    assert len(done) == 1
    assert done[0].finish_reason["type"] == "length", done[0].finish_reason
    return done[0]


# --------------------------------------------------------------------------- the scheduler path

@pytest.mark.parametrize("method", ["last", "mean"])
def test_a_batch_of_lengths_pools_as_hf(tiny, method):
    hf = tiny[0]
    sched = _scheduler(tiny)
    prompts = [_ids(n, seed) for seed, n in enumerate((13, 5, 29, 1, 8))]
    outputs = []
    reqs = [_pool_req(f"r{k}", p, PoolParams(method), outputs) for k, p in enumerate(prompts)]
    steps = run_to_completion(sched, reqs)
    assert steps <= 2 and sched.counters.get("num_finished_requests") == len(prompts)
    for k, p in enumerate(prompts):
        out = _final(outputs, f"r{k}")
        assert out.output_ids_delta == [] and out.completion_tokens == 0
        assert out.prompt_tokens == len(p)
        _close(out.embedding, _expected(hf, p, method))
        assert math.isclose(sum(v * v for v in out.embedding), 1.0, rel_tol=1e-5)
    _no_leak(sched)


@pytest.mark.parametrize("method", ["last", "mean"])
def test_chunked_prefill_pools_as_hf(tiny, method):
    hf = tiny[0]
    sched = _scheduler(tiny, chunked_prefill_size=16)
    long, short = _ids(45, 7), _ids(6, 8)
    outputs = []
    reqs = [_pool_req("long", long, PoolParams(method), outputs),
            _pool_req("short", short, PoolParams(method), outputs)]
    steps = run_to_completion(sched, reqs)
    assert steps >= 3                                # 45 tokens in chunks of at most 16
    _close(_final(outputs, "long").embedding, _expected(hf, long, method))
    _close(_final(outputs, "short").embedding, _expected(hf, short, method))
    _no_leak(sched)


def test_a_shared_prefix_takes_a_radix_hit_for_last_pooling_only(tiny):
    hf = tiny[0]
    sched = _scheduler(tiny)
    prefix = _ids(40, 11)
    first, second, third = prefix + _ids(5, 12), prefix + _ids(7, 13), prefix + _ids(3, 14)
    outputs = []
    run_to_completion(sched, [_pool_req("a", first, PoolParams("last"), outputs)])
    run_to_completion(sched, [_pool_req("b", second, PoolParams("last"), outputs),
                              _pool_req("again", first, PoolParams("last"), outputs)])
    b, again = _final(outputs, "b"), _final(outputs, "again")
    assert b.cached_tokens >= 40 and again.cached_tokens == len(first) - 1
    _close(b.embedding, _expected(hf, second))
    _close(again.embedding, _final(outputs, "a").embedding, atol=1e-5)
    # mean pooling needs every token's state: it prefills from position 0 despite the cache
    run_to_completion(sched, [_pool_req("mean", third, PoolParams("mean"), outputs)])
    mean = _final(outputs, "mean")
    assert mean.cached_tokens == 0
    _close(mean.embedding, _expected(hf, third, "mean"))
    _no_leak(sched)


def test_prompts_sharing_an_uncached_prefix_compute_it_once(tiny):
    """Rerank's shape: one query, many documents, arriving together. The first computes the
    shared prefix; the others wait a step for it (in-batch prefix sharing), then hit."""
    hf = tiny[0]
    sched = _scheduler(tiny)
    query = _ids(60, 51)
    prompts = [query + _ids(4 + k, 52 + k) for k in range(4)]
    outputs = []
    run_to_completion(sched, [_pool_req(f"p{k}", p, PoolParams("last"), outputs)
                              for k, p in enumerate(prompts)])
    hits = sorted(_final(outputs, f"p{k}").cached_tokens for k in range(4))
    assert hits[0] == 0 and all(h >= 60 for h in hits[1:]), hits
    for k, p in enumerate(prompts):
        _close(_final(outputs, f"p{k}").embedding, _expected(hf, p))
    _no_leak(sched)


def test_a_restarted_mean_sum_starts_over():
    """A mean-pooling request retracted mid-prompt recomputes it from position 0: the span
    from position 0 replaces the sum instead of adding to it."""
    from radixserve.engine.pooling import PoolState

    state = PoolState()
    state.add(0, torch.tensor([1.0, 1.0]), 2, [])
    state.add(2, torch.tensor([2.0, 4.0]), 2, [])
    assert state.embedding(PoolParams("mean", normalize=False)) == [0.75, 1.25]
    state.add(0, torch.tensor([3.0, 3.0]), 3, [0.5, -0.5])
    assert state.embedding(PoolParams("mean", normalize=False)) == [1.0, 1.0]
    assert state.label_logits == [0.5, -0.5] and state.finite()


def test_dimensions_truncate_then_renormalise(tiny):
    hf = tiny[0]
    sched = _scheduler(tiny)
    ids = _ids(17, 21)
    outputs = []
    run_to_completion(sched, [_pool_req("d8", ids, PoolParams("last", dimensions=8), outputs),
                              _pool_req("raw", ids, PoolParams("last", normalize=False),
                                        outputs)])
    d8 = _final(outputs, "d8").embedding
    assert len(d8) == 8 and math.isclose(sum(v * v for v in d8), 1.0, rel_tol=1e-5)
    _close(d8, _expected(hf, ids, dimensions=8))
    _close(_final(outputs, "raw").embedding, _hf_hidden(hf, ids)[-1])
    _no_leak(sched)


def test_pooling_and_generation_requests_share_a_scheduler(tiny):
    """The engine refuses to mix them (--is-embedding), but the scheduler itself keeps both
    right in one batch: pooling rows never sample, the generating row decodes on."""
    hf = tiny[0]
    sched = _scheduler(tiny, is_embedding=False)
    ids = _ids(9, 31)
    outputs = []
    gen = Req("gen", _ids(6, 32), SamplingParams(max_new_tokens=3, temperature=0.0,
                                                 ignore_eos=True), 3, sink=outputs.append)
    run_to_completion(sched, [gen, _pool_req("emb", ids, PoolParams("last"), outputs)])
    assert len(gen.output_ids) == 3
    _close(_final(outputs, "emb").embedding, _expected(hf, ids))
    _no_leak(sched)


def test_tensor_parallel_pooling_and_labels(tiny):
    """--tp-size 2 on CPU rank threads: the hidden states and the gathered LM head's label
    logits equal HF's."""
    from radixserve.model.tensor_parallel import load_tp_model

    hf, path, _ = tiny
    config = ModelConfig.from_path(path)
    model = load_tp_model(path, config, "safetensors", torch.float32, torch.device("cpu"), 2)
    sched = _scheduler((hf, path, model), tp_size=2, chunked_prefill_size=16)
    ids = [_ids(23, 61), _ids(9, 62)]
    outputs = []
    run_to_completion(sched, [_pool_req("m", ids[0], PoolParams("mean"), outputs),
                              _pool_req("l", ids[1], PoolParams("last", label_ids=(5, 7)),
                                        outputs)])
    _close(_final(outputs, "m").embedding, _expected(hf, ids[0], "mean"))
    _close(_final(outputs, "l").embedding, _expected(hf, ids[1]))
    with torch.no_grad():
        logits = hf(torch.tensor([ids[1]])).logits[0, -1]
    _close(_final(outputs, "l").label_logits, logits[[5, 7]])
    _no_leak(sched)


# --------------------------------------------------------------------------- loading

def test_a_bare_backbone_checkpoint_loads_for_embeddings_only(tmp_path, default_model_path):
    """Qwen3-Embedding's layout: HF's Qwen3Model (names without "model.", no lm_head,
    architectures ["Qwen3Model"]), here untied so that the LM head is really missing."""
    from transformers import Qwen3Model

    torch.manual_seed(0)
    hf = Qwen3Model(_qwen3_config(tie=False)).eval()
    _randomize(hf, seed=3)
    path = _save(hf, tmp_path, default_model_path)
    config = ModelConfig.from_path(path)
    assert config.architecture == "Qwen3Model"
    with pytest.raises(ValueError, match="--is-embedding"):
        load_model(path, config, "safetensors", torch.float32, "cpu")
    ours = load_model(path, config, "safetensors", torch.float32, "cpu", lm_head_optional=True)
    assert ours.lm_head_loaded is False
    args = ServerArgs(model_path=path, device="cpu", max_total_tokens=512,
                      max_running_requests=4, context_length=512, is_embedding=True)
    sched = Scheduler(args, ModelRunner(args, config, path, context_len=512, model=ours))
    ids = _ids(11, 41)
    outputs = []
    run_to_completion(sched, [_pool_req("e", ids, PoolParams("last"), outputs)])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).last_hidden_state[0, -1]
    _close(_final(outputs, "e").embedding, torch.nn.functional.normalize(ref, dim=0))


def test_pooling_method_from_sentence_transformers_config(tmp_path):
    assert resolve_pooling_method("auto", str(tmp_path)) == "last"
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "modules.json").write_text(
        '[{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},'
        ' {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]')
    (tmp_path / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    assert resolve_pooling_method("auto", str(tmp_path)) == "mean"
    assert resolve_pooling_method("last", str(tmp_path)) == "last"
    (tmp_path / "1_Pooling" / "config.json").write_text('{"pooling_mode_cls_token": true}')
    with pytest.raises(ValueError, match="--pooling-method"):
        resolve_pooling_method("auto", str(tmp_path))
    with pytest.raises(ValueError, match="--rerank-token-ids"):
        ServerArgs(rerank_token_ids="yes,no").check()


# --------------------------------------------------------------------------- the HTTP routes

@pytest.fixture(scope="module")
def served(tiny):
    """A real engine over the tiny model with --is-embedding, behind the app."""
    from radixserve.engine.async_engine import AsyncEngine
    from radixserve.server.app import create_app

    engine = AsyncEngine(ServerArgs(model_path=tiny[1], device="cpu", max_total_tokens=2048,
                                    max_running_requests=8, context_length=128,
                                    is_embedding=True, debug_integrity=True))
    with TestClient(create_app(engine), base_url=LOCAL, raise_server_exceptions=False) as client:
        yield engine, client


def _idle(engine):
    sched = engine.scheduler
    assert not sched.has_work()
    sched.check_integrity()
    assert sched.num_used_tokens() == 0


def test_embeddings_route_shapes(served, tiny):
    engine, client = served
    hf = tiny[0]
    tok = engine.tokenizer
    texts = ["The quick brown fox", "jumps over the lazy dog, twice."]
    r = client.post("/v1/embeddings", json={"input": texts, "model": engine.served_model_name})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == engine.served_model_name
    assert [d["index"] for d in body["data"]] == [0, 1]
    assert all(d["object"] == "embedding" for d in body["data"])
    ids = [tok.encode(t) for t in texts]
    assert body["usage"] == {"prompt_tokens": sum(map(len, ids)),
                             "total_tokens": sum(map(len, ids))}
    for d, p in zip(body["data"], ids):
        _close(d["embedding"], _expected(hf, p))
    # one text, token ids, a batch of id lists; base64; dimensions
    one = client.post("/v1/embeddings", json={"input": texts[0]}).json()
    _close(one["data"][0]["embedding"], body["data"][0]["embedding"], atol=1e-5)   # a radix hit
    by_ids = client.post("/v1/embeddings", json={"input": ids[1]}).json()
    _close(by_ids["data"][0]["embedding"], _expected(hf, ids[1]))
    assert len(client.post("/v1/embeddings", json={"input": ids}).json()["data"]) == 2
    b64 = client.post("/v1/embeddings", json={"input": texts[0], "encoding_format": "base64",
                                               "dimensions": 16}).json()
    raw = base64.b64decode(b64["data"][0]["embedding"])
    assert len(raw) == 16 * 4
    _close(list(struct.unpack("<16f", raw)), _expected(hf, ids[0], dimensions=16))
    _idle(engine)


def test_rerank_matches_hf_yes_no_scores(served, tiny):
    from transformers import AutoTokenizer

    from radixserve.server import embeddings_api as E

    engine, client = served
    hf = tiny[0]
    query = "What is the capital of France?"
    docs = ["Paris is the capital of France.", "Bananas are yellow.",
            "The Eiffel tower stands in Paris, France's capital city.", "Gravity pulls."]
    # the prompt ids are the model card's: prefix, the formatted pair, suffix, tokenized apart
    hf_tok = AutoTokenizer.from_pretrained(tiny[1])
    yes, no = hf_tok.convert_tokens_to_ids("yes"), hf_tok.convert_tokens_to_ids("no")
    assert engine.rerank_labels == (yes, no)
    ids = E.rerank_prompt_ids(engine, query, docs, "Find the answer")
    for doc, got in zip(docs, ids):
        expected = (hf_tok.encode(E.QWEN3_RERANK_PREFIX, add_special_tokens=False)
                    + hf_tok.encode(f"<Instruct>: Find the answer\n<Query>: {query}\n"
                                    f"<Document>: {doc}", add_special_tokens=False)
                    + hf_tok.encode(E.QWEN3_RERANK_SUFFIX, add_special_tokens=False))
        assert got == expected
    # the oracle: softmax over HF's (yes, no) logits at the last position
    oracle = []
    with torch.no_grad():
        for p in ids:
            last = hf(torch.tensor([p])).logits[0, -1].float()
            oracle.append(torch.softmax(last[[yes, no]], 0)[0].item())
    order = sorted(range(len(docs)), key=lambda k: -oracle[k])
    r = client.post("/v1/rerank", json={"query": query, "documents": docs,
                                        "instruction": "Find the answer"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [x["index"] for x in body["results"]] == order
    for x in body["results"]:
        assert abs(x["relevance_score"] - oracle[x["index"]]) < 1e-5
        assert x["document"] == {"text": docs[x["index"]]}
    assert body["usage"]["prompt_tokens"] == sum(map(len, ids))
    top = client.post("/v1/rerank", json={"query": query, "top_n": 2, "return_documents": False,
                                          "documents": [{"text": d} for d in docs],
                                          "instruction": "Find the answer"}).json()
    assert [x["index"] for x in top["results"]] == order[:2]
    assert all("document" not in x for x in top["results"])
    _idle(engine)


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"),
    ({"input": ["fine", ""]}, "input[1]"),
    ({"input": []}, "input"),
    ({"input": [[]]}, "input[0]"),
    ({"input": "x " * 400}, "input"),
    ({"input": [49152]}, "input"),
    ({"input": "hi", "dimensions": 0}, "dimensions"),
    ({"input": "hi", "dimensions": HIDDEN + 1}, "dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "hi", "extra": 1}, "extra"),
])
def test_bad_embedding_requests_are_400s_that_start_nothing(served, body, param):
    engine, client = served
    before = engine.scheduler.counters.get("num_requests", 0)
    r = client.post("/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert engine.scheduler.counters.get("num_requests", 0) == before
    _idle(engine)


@pytest.mark.parametrize("body, param", [
    ({"query": "", "documents": ["a"]}, "query"),
    ({"query": "q", "documents": []}, "documents"),
    ({"query": "q", "documents": ["a", ""]}, "documents[1]"),
    ({"query": "q", "documents": ["a", "word " * 200]}, "documents[1]"),
    ({"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
    ({"query": "q", "documents": [{"txt": "a"}]}, "documents[0].txt"),
])
def test_bad_rerank_requests_are_400s(served, body, param):
    engine, client = served
    r = client.post("/v1/rerank", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    _idle(engine)


def test_generation_is_off_and_info_says_embedding(served):
    engine, client = served
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                       ("/v1/completions", {"prompt": "x"}), ("/generate", {"text": "x"})):
        r = client.post(path, json=body)
        assert r.status_code == 400 and "--is-embedding" in r.json()["error"]["message"], path
    assert client.post("/v1/embeddings", json={"input": "hi", "model": "other"}).status_code == 404
    assert client.get("/get_model_info").json()["is_generation"] is False
    assert client.get("/get_server_info").json()["is_embedding"] is True
    assert client.get("/health_generate").status_code == 200
    _idle(engine)


def test_invocations_reach_the_embedding_routes_and_their_gates(served, tiny):
    """SageMaker's /invocations (sagemaker_api): "input" goes to /v1/embeddings, "documents"
    to /v1/rerank, and a generation body meets the same --is-embedding 400 as its route."""
    engine, client = served
    body = {"input": ["The quick brown fox"]}
    direct, via = client.post("/v1/embeddings", json=body), client.post("/invocations", json=body)
    assert via.status_code == 200, via.text
    _close(via.json()["data"][0]["embedding"], direct.json()["data"][0]["embedding"], atol=1e-5)
    rr = {"query": "q", "documents": ["a b", "c"]}
    a, b = client.post("/v1/rerank", json=rr).json(), client.post("/invocations", json=rr).json()
    assert [x["index"] for x in a["results"]] == [x["index"] for x in b["results"]]
    refused = client.post("/invocations", json={"messages": [{"role": "user", "content": "x"}]})
    assert refused.status_code == 400 and "--is-embedding" in refused.json()["error"]["message"]
    _idle(engine)


def test_a_generation_server_refuses_the_embedding_routes():
    with TestClient(create_app_fake(), base_url=LOCAL) as client:
        for path, body in (("/v1/embeddings", {"input": "hi"}),
                           ("/v1/rerank", {"query": "q", "documents": ["d"]})):
            r = client.post(path, json=body)
            assert r.status_code == 400 and "--is-embedding" in r.json()["error"]["message"]
        assert client.get("/get_model_info").json()["is_generation"] is True


def create_app_fake():
    from radixserve.server.app import create_app
    return create_app(FakeEngine())


# --------------------------------------------------------------------------- offline

def test_offline_embed_and_rerank(tiny):
    from radixserve import Engine

    hf, path, _ = tiny
    with Engine(path, device="cpu", max_total_tokens=1024, max_running_requests=4,
                context_length=128, is_embedding=True) as engine:
        ids = engine.tokenizer.encode("hello there")
        _close(engine.embed("hello there"), _expected(hf, ids))
        two = engine.embed([ids, ids[:2]], dimensions=8)
        assert len(two) == 2 and len(two[1]) == 8
        _close(two[1], _expected(hf, ids[:2], dimensions=8))
        ranked = engine.rerank("capital of France?", ["Paris.", "Bananas."], top_n=1)
        assert len(ranked) == 1 and ranked[0]["index"] in (0, 1)
        with pytest.raises(ValueError, match="empty"):
            engine.embed("")
        with pytest.raises(ValueError, match="--is-embedding"):
            engine.generate("hi", {"max_new_tokens": 2})
