"""schemathesis hooks that keep fuzzing radixserve affordable on a CPU: every generation is
capped at MAX_FUZZ_TOKENS new tokens, MAX_FUZZ_N samples per prompt and MAX_FUZZ_PROMPTS prompts
per batch. A value is lowered only where the schema allows it (an out-of-range value a negative
test sent stays as it is, so the server must still refuse it), and a missing or null
max_tokens / max_new_tokens is set (the chat and native defaults would run to the context
length). schemathesis re-checks a case against the schema after a hook edits it.

Used by tests/e2e/test_openapi_fuzz.py, and by the CLI run in tests/README.md
(SCHEMATHESIS_HOOKS=tests.e2e.schemathesis_hooks).
"""
import schemathesis

MAX_FUZZ_TOKENS = 4
MAX_FUZZ_N = 4
MAX_FUZZ_PROMPTS = 8
PER_PROMPT = ("text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len",
              "top_logprobs_num")
INT32_MAX = 2 ** 31 - 1
_LIMITS = {"max_tokens": MAX_FUZZ_TOKENS, "max_completion_tokens": MAX_FUZZ_TOKENS,
           "max_output_tokens": MAX_FUZZ_TOKENS,
           "max_new_tokens": MAX_FUZZ_TOKENS, "n": MAX_FUZZ_N, "best_of": MAX_FUZZ_N}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _cap(d: dict, names) -> None:
    for name in names:
        v = d.get(name)
        if _is_int(v) and _LIMITS[name] < v <= INT32_MAX:
            d[name] = _LIMITS[name]


def cap_body(path: str, body) -> None:
    """Lower the generation sizes of one request body in place (see the module docstring)."""
    if not isinstance(body, dict):
        return
    if path in ("/v1/chat/completions", "/v1/completions"):
        _cap(body, ("max_tokens", "max_completion_tokens", "n", "best_of"))
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = MAX_FUZZ_TOKENS
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            del prompt[MAX_FUZZ_PROMPTS:]
    elif path == "/v1/messages":            # max_tokens is required there (a 400 without it)
        _cap(body, ("max_tokens",))
    elif path == "/v1/responses":
        _cap(body, ("max_output_tokens",))
        if body.get("max_output_tokens") is None:
            body["max_output_tokens"] = MAX_FUZZ_TOKENS
    elif path == "/generate":
        for name in PER_PROMPT:
            v = body.get(name)
            if isinstance(v, list) and v and not (name == "input_ids" and not isinstance(v[0], list)):
                del v[MAX_FUZZ_PROMPTS:]
        sp = body.get("sampling_params")
        if sp is None:
            body["sampling_params"] = sp = {}
        for one in (sp if isinstance(sp, list) else [sp]):
            if isinstance(one, dict):
                _cap(one, ("max_new_tokens", "n"))
                if one.get("max_new_tokens") is None:
                    one["max_new_tokens"] = MAX_FUZZ_TOKENS


@schemathesis.hook
def before_call(context, case, kwargs):
    cap_body(case.operation.path, case.body)
