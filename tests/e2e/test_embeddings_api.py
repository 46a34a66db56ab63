"""A live server with --is-embedding on a tiny random Qwen3 (the default model's tokenizer):
the official openai client's embeddings.create (one input, a list, token ids; its default
base64 transfer and encoding_format="float"; dimensions) against HF's pooled, normalised
final hidden states, /v1/rerank over httpx against HF's P(yes), the generation routes
refused, and no KV held once idle."""
import shutil
import time

import httpx
import openai
import pytest
import torch

from conftest import launched_server, metric

DOCS = ["Paris is the capital of France.", "Bananas are yellow and curved.",
        "France's capital city, Paris, lies on the Seine.", "The moon orbits the earth."]
QUERY = "What is the capital of France?"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, default_model_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=49152, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, max_position_embeddings=512, tie_word_embeddings=True,
                      rms_norm_eps=1e-6, rope_theta=1000000.0)
    hf = Qwen3ForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.15 * noise)
    path = tmp_path_factory.mktemp("qwen3-embed-model")
    hf.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{default_model_path}/{name}", path / name)
    return hf, str(path)


@pytest.fixture(scope="module")
def embed_server(tmp_path_factory, tiny_dir):
    args = ["--model-path", tiny_dir[1], "--is-embedding", "--served-model-name", "tiny-embed",
            "--max-total-tokens", "4096", "--debug-integrity"]
    with launched_server(tmp_path_factory.mktemp("embed-server"), args) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(embed_server):
    return openai.OpenAI(base_url=embed_server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def _hf_embedding(hf, ids, dimensions=None):
    with torch.no_grad():
        v = hf.model(torch.tensor([ids])).last_hidden_state[0, -1].float()
    if dimensions is not None:
        v = v[:dimensions]
    return torch.nn.functional.normalize(v, dim=0)


def _tokenize(url, text):
    return httpx.post(url + "/tokenize", json={"prompt": text}, timeout=30).json()["tokens"]


def _assert_close(got, expected, atol=1e-4):
    got = torch.tensor(got, dtype=torch.float32)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < atol


def test_openai_client_embeddings(client, embed_server, tiny_dir):
    hf = tiny_dir[0]
    one = client.embeddings.create(model="tiny-embed", input="hello embeddings")   # base64
    assert one.object == "list" and one.model == "tiny-embed" and len(one.data) == 1
    ids = _tokenize(embed_server.url, "hello embeddings")
    assert one.usage.prompt_tokens == one.usage.total_tokens == len(ids)
    _assert_close(one.data[0].embedding, _hf_embedding(hf, ids))
    floats = client.embeddings.create(model="tiny-embed", input="hello embeddings",
                                      encoding_format="float")
    _assert_close(floats.data[0].embedding, torch.tensor(one.data[0].embedding), atol=1e-5)
    batch = client.embeddings.create(model="tiny-embed", input=DOCS, dimensions=16)
    assert [d.index for d in batch.data] == list(range(len(DOCS)))
    for d, text in zip(batch.data, DOCS):
        assert len(d.embedding) == 16
        _assert_close(d.embedding, _hf_embedding(hf, _tokenize(embed_server.url, text), 16))
    by_ids = client.embeddings.create(model="tiny-embed", input=[ids, ids[:3]])
    _assert_close(by_ids.data[1].embedding, _hf_embedding(hf, ids[:3]))


def test_openai_client_errors(client):
    for kw in ({"input": ""}, {"input": "x", "dimensions": 65}, {"input": "x", "dimensions": 0}):
        with pytest.raises(openai.BadRequestError):
            client.embeddings.create(model="tiny-embed", **kw)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="another-model", input="x")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny-embed", max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])
    assert "--is-embedding" in str(info.value)


def test_rerank_over_http(embed_server, tiny_dir):
    from radixserve.server.embeddings_api import (QWEN3_RERANK_PREFIX, QWEN3_RERANK_SUFFIX,
                                                  qwen3_rerank_text)
    from transformers import AutoTokenizer

    hf, path = tiny_dir
    tok = AutoTokenizer.from_pretrained(path)
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    oracle = []
    with torch.no_grad():
        for doc in DOCS:
            ids = (tok.encode(QWEN3_RERANK_PREFIX, add_special_tokens=False)
                   + tok.encode(qwen3_rerank_text(QUERY, doc), add_special_tokens=False)
                   + tok.encode(QWEN3_RERANK_SUFFIX, add_special_tokens=False))
            last = hf(torch.tensor([ids])).logits[0, -1].float()
            oracle.append(torch.softmax(last[[yes, no]], 0)[0].item())
    r = httpx.post(embed_server.url + "/v1/rerank", timeout=120,
                   json={"model": "tiny-embed", "query": QUERY, "documents": DOCS, "top_n": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    order = sorted(range(len(DOCS)), key=lambda k: -oracle[k])
    assert [x["index"] for x in body["results"]] == order[:3]
    for x in body["results"]:
        assert abs(x["relevance_score"] - oracle[x["index"]]) < 1e-5
        assert x["document"]["text"] == DOCS[x["index"]]
    assert body["model"] == "tiny-embed" and body["usage"]["prompt_tokens"] > 0
    bad = httpx.post(embed_server.url + "/v1/rerank", json={"query": QUERY, "documents": []},
                     timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "documents"


def test_info_and_nothing_held_when_idle(embed_server):
    url = embed_server.url
    assert httpx.get(url + "/get_server_info", timeout=30).json()["is_embedding"] is True
    assert httpx.get(url + "/model_info", timeout=30).json()["is_generation"] is False
    assert httpx.get(url + "/health_generate", timeout=60).status_code == 200
    assert httpx.post(url + "/generate", json={"text": "hi"}, timeout=30).status_code == 400
    for _ in range(100):
        if metric(url, "num_running_reqs") == 0 and metric(url, "num_waiting_reqs") == 0:
            break
        time.sleep(0.1)
    assert metric(url, "num_used_tokens") == 0
