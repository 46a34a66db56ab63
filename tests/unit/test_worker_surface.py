"""The worker surface SGLang's model gateway (smg) reads, over a fake engine: /server_info and
/model_info (aliases of the /get_* routes, in the field types smg deserializes them into),
/v1/loads (smg's WorkerLoadResponse: a string timestamp, integer counts) and /get_load
(SGLang's older list shape), /health's 503 while draining, and the admin key on the load routes.
The field lists come from smg's source (model_gateway/src/workflow/steps/local/
discover_metadata.rs: ServerInfo, ModelInfo; crates/protocols/src/worker.rs:
SchedulerLoadSnapshot, WorkerLoadResponse); server/native_api.py's docstring names them."""
from __future__ import annotations

from datetime import datetime
from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

from radixserve.config import ServerArgs
from radixserve.server.app import create_app

from test_server_fake_engine import LOCAL, FakeEngine

ADMIN, ALICE = "admin-key-0123456789", "alice-key-0123456789"

# smg's ServerInfo / ModelInfo fields and the JSON types serde accepts for them (Option<...>:
# null too). One field of another type makes serde drop the whole answer.
SERVER_INFO_TYPES = {"model_id": str, "model": str, "model_path": str, "served_model_name": str,
                     "tp_size": int, "dp_size": int, "pp_size": int, "load_balance_method": str,
                     "disaggregation_mode": str, "version": str, "is_embedding": bool,
                     "context_length": int, "max_total_tokens": int,
                     "max_running_requests": int, "weight_version": str}
MODEL_INFO_TYPES = {"model_path": str, "tokenizer_path": str, "is_generation": bool,
                    "has_image_understanding": bool, "has_audio_understanding": bool,
                    "model_type": str, "architectures": list}
# SchedulerLoadSnapshot: i32 fields must be JSON integers (serde refuses 3.0 for an i32)
LOAD_INTS = ("dp_rank", "num_running_reqs", "num_waiting_reqs", "num_waiting_uncached_tokens",
             "num_total_reqs", "num_used_tokens", "max_total_num_tokens", "max_running_requests")
LOAD_FLOATS = ("token_usage", "gen_throughput", "cache_hit_rate", "utilization")


class LoadedEngine(FakeEngine):
    """The fake engine with the scheduler numbers /v1/loads reads (AsyncEngine.metrics keys)."""

    def __init__(self):
        super().__init__()
        self.model_config = SimpleNamespace(vocab_size=256, architecture="FakeForCausalLM",
                                            hf_config={"model_type": "llama"})
        self.scheduler = SimpleNamespace(max_running_requests=16)
        self._draining = False

    def server_info(self):
        return {"model": {"architecture": "FakeForCausalLM", "vocab_size": 256}, "tp_size": 1,
                "dp_size": 1, "version": "0.0", "max_total_tokens": 4096,
                "max_running_requests": 16, "model_path": "/models/fake",
                "served_model_name": "fake", "server_args": {"api_key": "secret"}}

    def metrics(self):
        return {"num_running_reqs": 3, "num_waiting_reqs": 2, "num_used_tokens": 1024,
                "max_total_tokens": 4096, "token_usage": 0.25, "gen_throughput": 123.5,
                "prompt_tokens": 1000, "cached_tokens": 600, "gpu_busy_fraction": 0.5}


def _typed(body: dict, types: dict) -> None:
    for key, kind in types.items():
        value = body.get(key)
        assert value is None or (isinstance(value, kind) and not (
            kind is int and isinstance(value, bool))), (key, value)


@pytest.fixture()
def engine():
    return LoadedEngine()


def test_server_info_alias_in_the_gateways_types(engine):
    with TestClient(create_app(engine), base_url=LOCAL) as c:
        info = c.get("/server_info").json()
        assert info == c.get("/get_server_info").json()
    _typed(info, SERVER_INFO_TYPES)
    assert "model" not in info and info["model_config"]["architecture"] == "FakeForCausalLM"
    assert info["dp_size"] == 1 and info["served_model_name"] == "fake"
    assert info["context_length"] == engine.context_len and info["max_running_requests"] == 16
    assert "model_path" not in info and "secret" not in str(info)     # redacted as before


def test_model_info_alias_in_the_gateways_types(engine):
    with TestClient(create_app(engine), base_url=LOCAL) as c:
        info = c.get("/model_info").json()
        assert info == c.get("/get_model_info").json()
    _typed(info, MODEL_INFO_TYPES)
    assert info["architectures"] == ["FakeForCausalLM"] and info["model_type"] == "llama"
    assert info["is_generation"] is True and info["has_image_understanding"] is False


def test_v1_loads_in_the_gateways_shape(engine):
    with TestClient(create_app(engine), base_url=LOCAL) as c:
        r = c.get("/v1/loads?include=core,disagg,queues,memory")   # what smg's monitor asks
        assert r.status_code == 200
        body = r.json()
        datetime.fromisoformat(body["timestamp"])                  # a string, not a number
        assert body["dp_rank_count"] == 1 and len(body["loads"]) == 1
        snap = body["loads"][0]
        for key in LOAD_INTS:
            assert type(snap[key]) is int, key
        for key in LOAD_FLOATS:
            assert isinstance(snap[key], float), key
        assert (snap["num_running_reqs"], snap["num_waiting_reqs"], snap["num_total_reqs"]) == \
            (3, 2, 5)
        assert (snap["num_used_tokens"], snap["max_total_num_tokens"]) == (1024, 4096)
        assert snap["token_usage"] == 0.25 and snap["cache_hit_rate"] == 0.6
        assert snap["max_running_requests"] == 16 and snap["queues"]["waiting"] == 2
        assert body["aggregate"]["total_reqs"] == 5
        assert "queues" not in c.get("/v1/loads?include=core").json()["loads"][0]
        assert c.get("/v1/loads?dp_rank=1").json()["loads"] == []
        for bad in ("include=bogus", "dp_rank=x", "format=prometheus"):
            assert c.get("/v1/loads?" + bad).status_code == 400, bad
        legacy = c.get("/get_load").json()
        assert legacy[0] == {**legacy[0], "dp_rank": 0, "num_reqs": 5, "num_waiting_reqs": 2,
                             "num_tokens": 1024, "num_pending_tokens": 0}


def test_health_is_503_while_draining(engine):
    with TestClient(create_app(engine), base_url=LOCAL) as c:
        assert c.get("/health").status_code == 200
        engine._draining = True
        assert c.get("/health").status_code == 503


def test_load_routes_take_the_admin_key(engine):
    engine.server_args = ServerArgs(model_path="/models/fake", api_key=ALICE, admin_api_key=ADMIN)
    with TestClient(create_app(engine), base_url=LOCAL) as c:
        for path in ("/v1/loads", "/get_load", "/server_info"):
            assert c.get(path, headers={"Authorization": f"Bearer {ALICE}"}).status_code == 403
            assert c.get(path, headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200
        assert c.get("/model_info", headers={"Authorization": f"Bearer {ALICE}"}).status_code == 200
        assert c.get("/health").status_code == 200                  # smg's probe sends no key
