"""Constrained decoding on the default model: grammars, the grammar slot, jump-forward.

Scheduler-level tests step the pipeline synchronously with overlap on and check_integrity after
every step; outputs are validated with jsonschema / re.fullmatch, never compared to fixed text.
"""
import json
import re

import jsonschema
import pytest

from radixserve import knobs
from radixserve.config import ServerArgs
from radixserve.constrained import GrammarBackend, GrammarError
from radixserve.constrained.jump_forward import plan_jump
from radixserve.engine.async_engine import merge_outputs
from radixserve.engine.io import GenerateOutput, apply_ids_delta
from radixserve.engine.req import Req
from radixserve.sampling.params import SamplingParams
from radixserve.tokenizer.detokenizer import IncrementalDetokenizer

from conftest import run_to_completion

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}},
     "required": ["name"]},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
     "required": ["color"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string",
     "maxLength": 6}, "minItems": 1, "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -9, "maximum": 9},
        "y": {"type": "integer", "minimum": -9, "maximum": 9}}, "required": ["x", "y"]}},
     "required": ["point"]},
    {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
     "required": ["zip"]},
    {"type": "object", "properties": {"price": {"type": "number", "minimum": 0, "maximum": 100}},
     "required": ["price"]},
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 1, "maximum": 5},
                                      "b": {"type": "string", "maxLength": 5}},
     "required": ["a"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
     "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"status": {"const": "done"}, "n": {"type": "integer",
     "minimum": 0, "maximum": 3}}, "required": ["status", "n"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "roles": {"type": "array", "items": {"enum": ["admin", "dev"]}, "maxItems": 2}},
        "required": ["id", "roles"]}}, "required": ["user"]},
    {"type": "object", "properties": {"date": {"type": "string",
     "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}}, "required": ["date"]},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 0,
     "maximum": 9}, {"type": "boolean"}]}}, "required": ["v"]},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "object",
        "properties": {"k": {"type": "string", "maxLength": 4}}, "required": ["k"]},
        "maxItems": 2}}, "required": ["items"]},
    {"type": "object", "properties": {"note": {"type": ["string", "null"], "maxLength": 8}},
     "required": ["note"]},
    {"type": "object", "properties": {"level": {"type": "integer", "enum": [1, 2, 3]},
                                      "label": {"enum": ["low", "high"]}},
     "required": ["level", "label"]},
    {"type": "object", "properties": {"first": {"type": "string", "maxLength": 6},
                                      "last": {"type": "string", "maxLength": 6},
                                      "middle": {"type": "string", "maxLength": 3}},
     "required": ["first", "last"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "items": {"type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 1}, "minItems": 2, "maxItems": 2},
        "minItems": 2, "maxItems": 2}}, "required": ["matrix"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                      "count": {"type": "integer", "minimum": 10, "maximum": 20},
                                      "valid": {"type": "boolean"}},
     "required": ["code", "count", "valid"]},
]

REGEXES = {
    "phone": r"\(\d{3}\) \d{3}-\d{4}",
    "date": r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
    "ipv4": r"((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)",
    "alternation": r"(yes|no|maybe)",
}

EBNF = '''root ::= "The answer is " answer "."
answer ::= ("yes" | "no") (", because " [a-z ]{1,20})?'''


@pytest.fixture(scope="module")
def backend(default_tokenizer, smol_model):
    config, _ = smol_model
    return GrammarBackend(default_tokenizer, config.vocab_size, [default_tokenizer.eos_token_ids[0]])


@pytest.fixture(scope="module")
def make_sched(default_model_path, smol_model, default_tokenizer):
    from radixserve.engine.scheduler import Scheduler
    from radixserve.model.runner import ModelRunner

    config, model = smol_model

    def detok(req):
        sp = req.sampling_params
        return IncrementalDetokenizer(default_tokenizer, sp.stop_strs, sp.no_stop_trim)

    def make(**overrides):
        kw = dict(model_path=default_model_path, device="cpu", max_total_tokens=4096,
                  max_running_requests=32, context_length=1024)
        kw.update(overrides)
        args = ServerArgs(**kw)
        runner = ModelRunner(args, config, default_model_path, context_len=args.context_length,
                             model=model)
        return Scheduler(args, runner, tokenizer=default_tokenizer, detokenizer_factory=detok)

    return make


def chat_ids(tokenizer, text):
    return tokenizer.encode_chat([{"role": "user", "content": text}])


def constrained_req(backend, rid, ids, max_new=160, temperature=0.0, seed=None, **constraint):
    sp = SamplingParams(max_new_tokens=max_new, temperature=temperature, seed=seed, **constraint)
    sp.verify()
    req = Req(rid, ids, sp, max_new)
    req.grammar = backend.matcher(backend.compile_sync(sp.grammar_key))
    return req


def collect(req):
    """Attach a sink that accumulates the request's streamed text and ids (deltas)."""
    got = {"text": "", "ids": [], "outs": []}

    def sink(out):
        got["text"] += out.text_delta
        apply_ids_delta(got["ids"], out)
        got["outs"].append(out)
    req.sink = sink
    return got


def output_text(tokenizer, req):
    return tokenizer.decode(req.output_ids)


# --------------------------------------------------------------------------- pieces

def test_plan_jump_retokenizes_the_seam_exactly(default_tokenizer):
    tok = default_tokenizer
    out = tok.encode('{"name', add_special_tokens=False)
    plan = plan_jump(tok, out, '": "')
    assert plan is not None
    new = out[:len(out) - plan.num_removed] + plan.new_ids
    assert tok.decode(new) == '{"name": "'
    # the whole output is what the tokenizer makes of the whole text (the window covers it)
    assert new == tok.encode('{"name": "', add_special_tokens=False)
    assert plan_jump(tok, out, "") is None
    # from an empty output: just the text's own tokens
    empty = plan_jump(tok, [], '{"a": ')
    assert empty.num_removed == 0 and tok.decode(empty.new_ids) == '{"a": '


def test_plan_jump_rolls_back_a_token_that_merges_with_the_jump(default_tokenizer):
    tok = default_tokenizer
    whole = tok.encode("hello world", add_special_tokens=False)
    pieces = tok.encode("hello", add_special_tokens=False) + tok.encode(" wor",
                                                                       add_special_tokens=False)
    plan = plan_jump(tok, pieces, "ld")
    new = pieces[:len(pieces) - plan.num_removed] + plan.new_ids
    assert tok.decode(new) == "hello world"
    assert new == whole                    # " wor" + "ld" re-tokenized as " world"
    assert plan.num_removed >= 1


def test_detokenizer_replace_tail_appends_only_the_new_text(default_tokenizer):
    tok = default_tokenizer
    d = IncrementalDetokenizer(tok, stop_strs=["STOP"])
    first = tok.encode("hello wor", add_special_tokens=False)
    text = d.push(first).text_delta
    assert d.caught_up
    whole = tok.encode("hello world and STOP here", add_special_tokens=False)
    keep = 0
    while keep < len(first) and first[keep] == whole[keep]:
        keep += 1
    res = d.replace_tail(len(first) - keep, whole[keep:])
    assert text + res.text_delta == "hello world and "     # cut at the stop string
    assert res.stop_matched == "STOP"


def test_merge_outputs_and_apply_ids_delta_honour_rollback():
    a = GenerateOutput("r", "ab", [1, 2, 3], False)
    b = GenerateOutput("r", "c", [7, 8], False, output_ids_rollback=2)
    m = merge_outputs(a, b)
    assert m.output_ids_delta == [1, 7, 8] and m.output_ids_rollback == 0 and m.text_delta == "abc"
    c = GenerateOutput("r", "", [9], False, output_ids_rollback=5)
    m2 = merge_outputs(a, c)
    assert m2.output_ids_delta == [9] and m2.output_ids_rollback == 2
    ids = [4, 5, 6]
    for out in (a, c):
        apply_ids_delta(ids, out)
    ref = [4, 5, 6]
    apply_ids_delta(ref, m2)
    assert ids == ref == [4, 9]


def test_bad_grammars_fail_with_the_compilers_message(backend):
    cases = [(("regex", "a(b"), "parenthesis"), (("json_schema", "{"), "not valid JSON"),
             (("ebnf", "root ::= x"), 'Rule "x" is not defined'),
             (("json_schema", "[1, 2]"), "a JSON schema is an object")]
    for key, message in cases:
        with pytest.raises(GrammarError, match=re.escape(message)):
            backend.compile_sync(key)
        with pytest.raises(GrammarError):      # cached failure: the same error, at once
            backend.compile_sync(key)


def test_a_repeated_schema_compiles_once(backend):
    key = ("json_schema", json.dumps({"type": "object", "properties": {"q": {"type": "integer"}}}))
    before = dict(backend.stats)
    first = backend.compile_sync(key)
    again = backend.compile_sync(key)
    assert first is again
    assert backend.stats["compiles"] == before["compiles"] + 1
    assert backend.stats["cache_hits"] == before["cache_hits"] + 1


def test_sampling_params_validate_constraint_fields():
    with pytest.raises(ValueError, match="at most one of json_schema, regex"):
        SamplingParams(regex="a", ebnf="root ::= \"a\"").verify()
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={"x": 1}).verify()
    with pytest.raises(ValueError, match=r"\[-100, 100\]"):
        SamplingParams(logit_bias={"5": 101}).verify()
    with pytest.raises(ValueError, match="not a valid regular expression"):
        SamplingParams(stop_regex="(").verify()
    sp = SamplingParams(logit_bias={"5": -3})
    sp.verify()
    assert sp.logit_bias == {5: -3.0}


# --------------------------------------------------------------------------- in the scheduler

def test_twenty_schemas_in_one_batch_all_validate(make_sched, backend, default_tokenizer):
    sched = make_sched()
    reqs = []
    for i, schema in enumerate(SCHEMAS):
        ids = chat_ids(default_tokenizer, f"Reply with JSON for record {i}.")
        reqs.append(constrained_req(backend, f"s{i}", ids, json_schema=json.dumps(schema),
                                    temperature=0.0 if i % 2 else 0.8, seed=i))
    got = [collect(r) for r in reqs]
    run_to_completion(sched, reqs)
    for r, g, schema in zip(reqs, got, SCHEMAS):
        assert r.finish_reason["type"] == "stop", (r.rid, r.finish_reason, output_text(default_tokenizer, r))
        text = output_text(default_tokenizer, r)
        jsonschema.validate(json.loads(text), schema)
        assert g["ids"] == r.output_ids and g["text"] == text      # streamed == final
    assert sched.counters["num_jumps"] > 0
    assert sched.num_used_tokens() == 0


def test_regexes_fully_match_with_three_samples_each(make_sched, backend, default_tokenizer):
    sched = make_sched()
    reqs = []
    for name, pattern in REGEXES.items():
        ids = chat_ids(default_tokenizer, f"Give me a {name}.")
        for k in range(3):
            reqs.append(constrained_req(backend, f"{name}-{k}", ids, max_new=40, regex=pattern,
                                        temperature=1.0, seed=100 + k))
    run_to_completion(sched, reqs)
    for r in reqs:
        text = output_text(default_tokenizer, r)
        assert r.finish_reason["type"] == "stop", (r.rid, text)
        assert re.fullmatch(r.sampling_params.regex, text), (r.rid, text)


def test_ebnf_grammar(make_sched, backend, default_tokenizer):
    sched = make_sched()
    ids = chat_ids(default_tokenizer, "Is the sky blue?")
    reqs = [constrained_req(backend, f"e{k}", ids, max_new=60, ebnf=EBNF, temperature=0.9, seed=k)
            for k in range(3)]
    run_to_completion(sched, reqs)
    for r in reqs:
        text = output_text(default_tokenizer, r)
        assert re.fullmatch(r"The answer is (yes|no)(, because [a-z ]{1,20})?\.", text), text


def test_mixed_batch_free_rows_equal_their_greedy_run_alone(make_sched, backend, default_tokenizer,
                                                            greedy_alone, text_prompts):
    sched = make_sched()
    reqs, free = [], []
    for i in range(32):
        if i % 2:
            ids = text_prompts[i % len(text_prompts)]
            sp = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
            r = Req(f"free{i}", ids, sp, 12)
            free.append(r)
        else:
            schema = SCHEMAS[i % len(SCHEMAS)]
            r = constrained_req(backend, f"c{i}", chat_ids(default_tokenizer, f"JSON {i}"),
                                json_schema=json.dumps(schema))
        reqs.append(r)
    run_to_completion(sched, reqs)
    for r in free:
        assert r.output_ids == greedy_alone(r.origin_input_ids, 12), r.rid
    for r in reqs:
        if r.grammar is not None:
            jsonschema.validate(json.loads(output_text(default_tokenizer, r)),
                                SCHEMAS[int(r.rid[1:]) % len(SCHEMAS)])


FLAT = {"type": "object", "properties": {f"field_{i:02d}": {"type": "integer", "minimum": 0,
                                                            "maximum": 9} for i in range(12)},
        "required": [f"field_{i:02d}" for i in range(12)], "additionalProperties": False}


def _steps_for(make_sched, backend, tokenizer, **overrides):
    sched = make_sched(**overrides)
    req = constrained_req(backend, "flat", chat_ids(tokenizer, "Fill in the record."),
                          max_new=300, json_schema=json.dumps(FLAT))
    steps = run_to_completion(sched, [req])
    jsonschema.validate(json.loads(output_text(tokenizer, req)), FLAT)
    return steps, req


def test_jump_forward_needs_fewer_forward_passes(make_sched, backend, default_tokenizer):
    jump_steps, jumped = _steps_for(make_sched, backend, default_tokenizer)
    plain_steps, plain = _steps_for(make_sched, backend, default_tokenizer,
                                    disable_jump_forward=True)
    assert jumped.num_jumped_tokens > 0 and plain.num_jumped_tokens == 0
    assert 2 * jump_steps <= plain_steps, (jump_steps, plain_steps)


LIST = {"type": "object", "properties": {"story": {"type": "string", "minLength": 50,
                                                   "maxLength": 80}}, "required": ["story"]}


def test_jump_forward_under_retraction_and_chunked_prefill(make_sched, backend, default_tokenizer,
                                                          text_prompts):
    # a pool too small for all of them at once: retraction and re-admission mix with jumps
    sched = make_sched(max_total_tokens=150, chunked_prefill_size=8,
                       schedule_conservativeness=0.05)
    reqs = [constrained_req(backend, f"p{i}", p, max_new=120, json_schema=json.dumps(LIST),
                            temperature=0.7, seed=i) for i, p in enumerate(text_prompts)]
    run_to_completion(sched, reqs)
    assert sched.counters["num_retractions"] > 0 and sched.counters["num_jumps"] > 0, str(sched.counters)
    for r in reqs:
        assert r.finish_reason["type"] == "stop", (r.rid, r.finish_reason)
        jsonschema.validate(json.loads(output_text(default_tokenizer, r)), LIST)
    assert sched.num_used_tokens() == 0


def test_overlap_and_serial_constrained_outputs_are_equal(make_sched, backend, default_tokenizer):
    outs = []
    for overlap_off in (False, True):
        sched = make_sched(disable_overlap_schedule=overlap_off)
        reqs = [constrained_req(backend, f"o{i}", chat_ids(default_tokenizer, f"JSON {i}"),
                                json_schema=json.dumps(SCHEMAS[i])) for i in range(6)]
        run_to_completion(sched, reqs)
        outs.append([r.output_ids for r in reqs])
    assert outs[0] == outs[1]


def test_grammar_rows_in_speculative_verify_steps(make_sched, backend, default_tokenizer,
                                                 greedy_alone):
    """--speculative-algorithm: a grammar request runs unspeculated (one row) in the same verify
    steps as requests whose drafts take len(draft) + 1 sampling rows each. Its bitmask must
    have a row per sampling row, its own at its position among them (after the verify rows of
    the requests before it): a mask of one row per request failed the whole step (IndexError
    in the sampler: every request of the batch aborted, a 503), or masked the wrong rows."""
    sched = make_sched(speculative_algorithm="ngram", speculative_num_draft_tokens=5)
    repeat = default_tokenizer.encode("one two three four five six seven eight nine ten. one two "
                                      "three four five six seven eight nine ten. one two three")
    free = [Req(f"free{i}", list(repeat), SamplingParams(max_new_tokens=24, temperature=0.0,
                                                         ignore_eos=True), 24) for i in range(2)]
    phone = REGEXES["phone"]
    grammar = [constrained_req(backend, "g0", chat_ids(default_tokenizer, "A phone number?"),
                               regex=phone),
               constrained_req(backend, "g1", chat_ids(default_tokenizer, "JSON 1"),
                               json_schema=json.dumps(SCHEMAS[1]))]
    reqs = [free[0], grammar[0], free[1], grammar[1]]   # grammar rows between verify rows
    run_to_completion(sched, reqs)
    assert sched.counters["spec_verify_steps"] > 0 and sched.counters["spec_accepted_tokens"] > 0
    for r in reqs:
        assert not r.finish_reason.is_abort, (r.rid, r.finish_reason)
    for r in free:
        assert r.output_ids == greedy_alone(r.origin_input_ids, 24), r.rid
    assert re.fullmatch(phone, output_text(default_tokenizer, grammar[0]))
    jsonschema.validate(json.loads(output_text(default_tokenizer, grammar[1])), SCHEMAS[1])


def test_logit_bias_forces_and_bans_tokens(make_sched, default_tokenizer, text_prompts):
    sched = make_sched()
    target = default_tokenizer.encode(" banana", add_special_tokens=False)[0]
    forced = Req("forced", text_prompts[0], SamplingParams(max_new_tokens=3, temperature=0.0,
                                                           logit_bias={target: 100.0}), 3)
    plain = Req("plain", text_prompts[0], SamplingParams(max_new_tokens=3, temperature=0.0), 3)
    run_to_completion(sched, [forced, plain])
    assert forced.output_ids == [target] * 3
    first = plain.output_ids[0]
    banned = Req("banned", text_prompts[0], SamplingParams(max_new_tokens=1, temperature=0.0,
                                                           logit_bias={first: -100.0}), 1)
    run_to_completion(sched, [banned])
    assert banned.output_ids[0] != first


def test_stop_regex_cuts_at_the_match_even_across_releases(default_tokenizer):
    tok = default_tokenizer
    d = IncrementalDetokenizer(tok, stop_regexes=[r"\d{3}"])
    text = ""
    for piece in ["call 1", "2", "3 now"]:
        res = d.push(tok.encode(piece, add_special_tokens=False))
        text += res.text_delta
        if res.stop_matched:
            break
    assert res.stop_matched == r"\d{3}"
    assert text == "call 12"         # "1" and "2" were released before the match could be seen
    d2 = IncrementalDetokenizer(tok, stop_regexes=[r"b+c"], no_stop_trim=True)
    out = d2.push(tok.encode("aaa bbbc ddd", add_special_tokens=False))
    assert out.stop_matched == "b+c" and out.text_delta == "aaa bbbc"


def test_a_grammar_dead_end_fails_its_request_as_a_400_not_a_503():
    """The request's own constraint left no valid token: its abort carries status_code 400
    (SGLang's key), which the OpenAI routes answer as a 400; other aborts stay 503s."""
    from types import SimpleNamespace

    from radixserve.engine.scheduler.grammar import GrammarSlot
    from radixserve.server import render as O

    reasons = []
    slot = GrammarSlot(vocab_size=32, tokenizer=None, context_len=64, pin=False)
    req = SimpleNamespace(rid="r1", grammar=SimpleNamespace(accept=lambda tok: False),
                          abort_message=None)
    reasons.append(slot.refusal(req, 7))
    assert reasons[0] is not None
    err = O.abort_error(reasons[0].to_dict())
    assert err.status == 400 and "no valid continuation" in err.message
    assert O.abort_error({"type": "abort", "message": "the pool is full"}).status == 503


def test_speculation_beside_grammar_rows_changes_nothing(make_sched, backend, default_tokenizer):
    """Issue 39's grammar case: requests with a grammar run unspeculated (and jump forward) in
    the same steps as speculated free requests on repeating text, overlapped or serial: every
    output equals the unspeculated run's, each JSON validates, and verify steps ran (over a
    step in flight when overlapped)."""
    free_texts = ["one two three four five six seven eight nine ten. one two three four five "
                  "six seven eight nine ten. one two three four",
                  "A B C D E F G A B C D E F G A B C"]

    def reqs():
        out = [constrained_req(backend, f"g{i}", chat_ids(default_tokenizer, f"JSON {i}"),
                               json_schema=json.dumps(SCHEMAS[i])) for i in range(3)]
        out += [Req(f"f{i}", default_tokenizer.encode(t),
                    SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True), 40)
                for i, t in enumerate(free_texts)]
        return out

    runs = {}
    for spec in (False, True):
        for serial in (False, True):
            kw = dict(speculative_algorithm="ngram", speculative_num_draft_tokens=5) \
                if spec else {}
            sched = make_sched(disable_overlap_schedule=serial, **kw)
            rs = reqs()
            with knobs.override("RADIXSERVE_SPEC_OVERLAP", "on"):   # the CPU's auto: serial
                run_to_completion(sched, rs)
            runs[(spec, serial)] = ([r.output_ids for r in rs], sched.counters)
            for i, r in enumerate(rs[:3]):
                jsonschema.validate(json.loads(output_text(default_tokenizer, r)), SCHEMAS[i])
    ref = runs[(False, False)][0]
    for key, (outs, counters) in runs.items():
        assert outs == ref, key
    overlapped = runs[(True, False)][1]
    assert overlapped["spec_verify_steps"] > 0 and overlapped["spec_accepted_tokens"] > 0
    assert overlapped["spec_overlapped_verify_steps"] > 0
    assert runs[(True, True)][1]["spec_overlapped_verify_steps"] == 0
