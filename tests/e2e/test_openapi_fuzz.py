"""schemathesis against the live server's /openapi.json, bounded: every documented operation
gets MAX_EXAMPLES generated requests that follow its schemas and MAX_EXAMPLES that break them,
each generation capped at a few tokens (schemathesis_hooks). Asserts: no 5xx, and every status,
media type and body (each SSE event included) as the document says; afterwards the server is
healthy, idle, and holds no KV slots. The longer run (the CLI, every check) is in
tests/README.md.

(The schemathesis pytest plugin's lazy loader does not run under pytest 9, so each operation's
hypothesis strategy is driven here directly.)"""
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                               status_code_conformance)

import schemathesis_hooks  # noqa: F401 - registers the before_call hook that caps generation
from radixserve.server.openapi import openapi_document

pytestmark = pytest.mark.slow

MAX_EXAMPLES = 25
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]
VALID, INVALID = schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE
# every operation with valid requests; those that take a body with invalid ones too (an
# operation without parameters has no invalid request to generate)
CASES = [(path, method.upper(), mode)
         for path, item in openapi_document(api_key=False)["paths"].items()
         for method, op in item.items()
         for mode in ((VALID, INVALID) if "requestBody" in op else (VALID,))]
STATUSES = {}        # (path, method, mode) -> statuses seen


@pytest.fixture(scope="session")
def api_schema(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    schema.config.update(base_url=server.url)
    return schema


@pytest.mark.parametrize("path, method, mode", CASES, ids=[f"{m} {p} {g.value}" for p, m, g in CASES])
def test_operation_answers_as_documented(api_schema, path, method, mode):
    operation = api_schema[path][method]
    seen = STATUSES.setdefault((path, method, mode.value), [])

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def fuzz(case):
        response = case.call_and_validate(checks=CHECKS, timeout=120)
        seen.append(response.status_code)

    fuzz()
    assert seen and all(status < 500 for status in seen), seen


def test_fuzzed_server_stays_healthy_and_leaks_nothing(server, http):
    assert any(s == 200 for s in STATUSES.get(("/v1/chat/completions", "POST", "positive"), []))
    assert any(400 <= s < 500 for s in STATUSES.get(("/generate", "POST", "negative"), []))
    server.wait_idle()
    assert http.get("/health").status_code == 200
    assert server.metric("num_used_tokens") == 0
    r = http.post("/v1/completions", json={"prompt": "1, 2, 3,", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"]
