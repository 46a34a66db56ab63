"""radixserve.lang, the frontend language, on fake backends: no model, no server. The fakes record
every call, so the tests check exactly which requests a program sends and what its state holds.

  FakeBackend   overrides generate / generate_stream / cache_prefix (and _get for model_info)
  WireBackend   overrides only _get / _post / _stream: Backend's own request logic runs (select)

No test waits on time: threads are ordered with Events; the few `timeout=` values only keep a
broken build from hanging (a test that reaches one fails on the flag it leaves).
"""
import asyncio
import copy
import json
import socket
import threading

import pytest

import radixserve.lang as sgl
from radixserve.lang import ir
from radixserve.lang.backend import Backend, BackendError, RuntimeEndpoint
from radixserve.lang.choices import (greedy_token_selection, token_length_normalized,
                                     unconditional_likelihood_normalized)
from radixserve.lang.interpreter import ProgramState
from radixserve.lang.program import PRECACHE_MIN_CHARS, function, trace_prefix
from radixserve.tokenizer.roles import (FIXED_FORMATS, FixedRoles, TemplateRoles, _chatml,
                                   role_format_for)
from radixserve.tokenizer.chat_template import ChatTemplate

GUARD_S = 30.0     # hang guard only: never reached by a passing test

# SmolLM2's chatml template: a default system prompt when the first message is not system
CHATML = ("{% for message in messages %}"
          "{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\\nYou are a helpful AI assistant.<|im_end|>\\n' }}{% endif %}"
          "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CHATML_BOS = "{{ bos_token }}" + CHATML
IM = "<|im_start|>{}\n{}<|im_end|>\n"


class FakeBackend(Backend):
    """Records every call. `reply(text, params)` gives a generation: a str, a list (n > 1) or a
    (text, meta_info) pair; `pieces` are the deltas generate_stream yields."""

    def __init__(self, reply=None, pieces=("Hel", "lo", " world"), model_info=None,
                 ack=None):
        super().__init__()
        self.calls = []
        self.reply = reply or (lambda text, params: "OUT")
        self.pieces = list(pieces)
        self.info = {"model_path": "Qwen/Qwen2-0.5B-Instruct"} if model_info is None \
            else model_info
        self.ack = ack                          # a Semaphore the reader releases per piece
        self.stream_started = threading.Event()

    def _get(self, path):
        self.calls.append(("GET", path))
        assert path == "/get_model_info"
        return dict(self.info)

    def generate(self, text, params):
        self.calls.append(("generate", text, params))
        out = self.reply(text, params)
        if isinstance(out, tuple):
            return out
        if isinstance(out, list):
            return out, [{"index": i} for i in range(len(out))]
        return out, {"prompt": text, "completion_tokens": 1}

    def generate_stream(self, text, params):
        self.calls.append(("generate_stream", text, params))
        self.stream_started.set()
        for i, piece in enumerate(self.pieces):
            yield piece, {"completion_tokens": i + 1}
            if self.ack is not None:
                assert self.ack.acquire(timeout=GUARD_S), "the reader never took the piece"

    def cache_prefix(self, text):
        self.calls.append(("cache_prefix", text))
        return {"prompt_tokens": len(text), "cached_tokens": 0}

    def kinds(self):
        return [c[0] for c in self.calls if c[0] != "GET"]


class WireBackend(Backend):
    """Backend's real request logic over a scripted transport: `answer(path, body)` answers each
    _post; every (path, body) sent is recorded."""

    def __init__(self, answer, model_info=None):
        super().__init__()
        self.answer = answer
        self.posts = []
        self.info = model_info or {"model_path": "qwen"}

    def _get(self, path):
        return dict(self.info)

    def _post(self, path, body):
        self.posts.append((path, copy.deepcopy(body)))
        return self.answer(path, body)

    def _stream(self, path, body):
        self.posts.append((path, copy.deepcopy(body)))
        yield from self.answer(path, body)


# =========================================================================== ir

def test_str_plus_gen_builds_an_expr_list():
    """`"Q: " + gen("a")` (and longer sums) is one flat ExprList of Text and Gen, in order."""
    expr = "Q: " + sgl.gen("a")
    assert isinstance(expr, ir.ExprList)
    assert expr.items[0] == ir.Text("Q: ")
    assert isinstance(expr.items[1], ir.Gen) and expr.items[1].name == "a"
    longer = expr + " then " + sgl.gen("b")
    assert [type(e).__name__ for e in ir.flatten(longer)] == ["Text", "Gen", "Text", "Gen"]
    assert ir.variable_names(longer) == ["a", "b"]
    assert ir.variable_names(sgl.user("x" + sgl.select("c", ["y", "n"]))) == ["c"]


def test_as_expr_refuses_none():
    """Appending None is refused; a number becomes its text."""
    with pytest.raises(ValueError, match="None"):
        ir.as_expr(None)
    assert ir.as_expr(3) == ir.Text("3")


def test_sampling_params_over_takes_only_unset_fields():
    """over(): a set field (even a falsy 0) wins, an unset one comes from the defaults."""
    mine = ir.SamplingParams(max_new_tokens=5, temperature=0.0)
    merged = mine.over(ir.RUN_DEFAULTS)
    assert merged.max_new_tokens == 5
    assert merged.temperature == 0.0
    assert merged.top_p == 1.0 and merged.top_k == -1 and merged.ignore_eos is False
    assert merged.stop is None and merged.n is None


def test_native_splits_top_level_and_sampling_fields():
    """native(): logprob fields go top-level, the rest under sampling_params; unset ones vanish."""
    sp, top = ir.SamplingParams(max_new_tokens=8, temperature=0.5, stop=["\n"], n=2,
                                return_logprob=True, logprob_start_len=3, top_logprobs_num=2,
                                return_text_in_logprobs=True).native()
    assert sp == {"max_new_tokens": 8, "temperature": 0.5, "stop": ["\n"], "n": 2}
    assert top == {"return_logprob": True, "logprob_start_len": 3, "top_logprobs_num": 2,
                   "return_text_in_logprobs": True}


def test_native_dtype_becomes_regex_and_wins():
    """A dtype becomes its regex, replacing an explicit regex and a json_schema; dtype itself is
    never sent."""
    sp, top = ir.SamplingParams(dtype="int", regex="[a-z]+", json_schema={"type": "object"}
                                ).native()
    assert sp == {"regex": ir.DTYPE_REGEX["int"]}
    assert top == {}


def test_native_json_schema_dict_is_sent_as_json_text():
    """A json_schema dict is sent as JSON text (a str one as is)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    sp, _ = ir.SamplingParams(json_schema=schema).native()
    assert isinstance(sp["json_schema"], str) and json.loads(sp["json_schema"]) == schema
    sp, _ = ir.SamplingParams(json_schema='{"type": "string"}').native()
    assert sp["json_schema"] == '{"type": "string"}'


@pytest.mark.parametrize("name,text,value", [
    ("int", "-42", -42), ("float", "2.5", 2.5), ("bool", "True", True), ("bool", "False", False),
    ("str", '"hi there"', "hi there"), (None, "raw", "raw")])
def test_dtype_value(name, text, value):
    """dtype_value turns the constrained text into its typed value (str loses its quotes)."""
    out = ir.dtype_value(name, text)
    assert out == value and type(out) is type(value)


def test_dtype_name_accepts_types_and_names():
    """dtype_name maps int/float/bool/str (types or names) to names; None stays None."""
    assert [ir.dtype_name(t) for t in (int, float, bool, str)] == ["int", "float", "bool", "str"]
    assert ir.dtype_name("float") == "float" and ir.dtype_name(None) is None


@pytest.mark.parametrize("bad", [list, "integer", dict, 3])
def test_dtype_name_refuses_a_bad_dtype(bad):
    """dtype_name raises ValueError naming the allowed dtypes; gen(dtype=...) too."""
    with pytest.raises(ValueError, match="int, float, bool or str"):
        ir.dtype_name(bad)
    with pytest.raises(ValueError):
        sgl.gen("x", dtype=bad)


def test_dtype_name_refuses_an_unhashable_dtype_with_value_error():
    """dtype_name's contract is ValueError for any bad dtype, an unhashable one included."""
    with pytest.raises(ValueError):
        ir.dtype_name([int])


def test_gen_with_choices_is_select_and_bad_regex_is_refused():
    """gen(choices=...) is a Select at temperature 0; gen(regex=bad) raises ValueError."""
    expr = sgl.gen("c", choices=["a", "b"])
    assert isinstance(expr, ir.Select) and expr.choices == ["a", "b"] and expr.temperature == 0.0
    with pytest.raises(ValueError, match="not valid"):
        sgl.gen("x", regex="(unclosed")
    with pytest.raises(ValueError):
        sgl.select("c", [])


# =========================================================================== choices

def _entries(*logprobs):
    return [[lp, 100 + i, f"t{i}"] for i, lp in enumerate(logprobs)]


def test_token_length_normalized_picks_the_best_mean():
    """token_length_normalized: highest mean token logprob; None counts as 0."""
    d = token_length_normalized(["a", "b", "c"],
                                [_entries(-1.0, -1.0), _entries(-0.2, -3.0), _entries(None, -1.5)])
    assert d.decision == "c"                    # means -1.0, -1.6, -0.75
    assert d.meta_info["normalized_prompt_logprobs"] == pytest.approx([-1.0, -1.6, -0.75])


def test_greedy_and_length_normalized_disagree():
    """A strong first token wins greedily while a steady choice has the better mean."""
    choices = ["spike", "steady"]
    logprobs = [_entries(-0.1, -5.0), _entries(-0.5, -0.5)]
    assert token_length_normalized(choices, logprobs).decision == "steady"
    assert greedy_token_selection(choices, logprobs).decision == "spike"


def test_greedy_shorter_choice_continues_at_its_mean():
    """greedy: a tie moves to the next position, where a shorter choice counts at its mean."""
    d = greedy_token_selection(["short", "long"], [_entries(-1.0), _entries(-1.0, -0.2)])
    assert d.decision == "long"
    assert d.meta_info["greedy_logprob_matrix"] == [[-1.0, -1.0], [-1.0, -0.2]]
    d = greedy_token_selection(["short", "long"], [_entries(-1.0), _entries(-1.0, -3.0)])
    assert d.decision == "short"


def test_unconditional_likelihood_normalized():
    """unconditional: highest mean of (logprob - unconditional logprob), which can overturn the
    plain mean."""
    choices = ["common", "rare"]
    cond = [_entries(-0.5), _entries(-2.0, -0.3)]
    uncond = [_entries(None), _entries(None, -3.0)]
    assert token_length_normalized(choices, cond).decision == "common"
    d = unconditional_likelihood_normalized(choices, cond, uncond)
    assert d.decision == "rare"                 # -0.5 vs mean(-2.0, 2.7) = 0.35
    assert d.meta_info["normalized_unconditional_prompt_logprobs"] == pytest.approx([-0.5, 0.35])
    assert unconditional_likelihood_normalized.needs_unconditional
    assert not token_length_normalized.needs_unconditional


def test_unconditional_mismatch_and_missing_are_errors():
    """unconditional refuses logprobs covering different tokens, and no unconditional at all."""
    with pytest.raises(ValueError, match="different tokens"):
        unconditional_likelihood_normalized(["a"], [_entries(-1.0, -1.0)], [_entries(-1.0)])
    with pytest.raises(ValueError, match="unconditional"):
        unconditional_likelihood_normalized(["a"], [_entries(-1.0)])


# =========================================================================== roles

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello!"},
     {"role": "user", "content": "bye"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}],
]


def _pieces_text(fmt, messages):
    text = ""
    for i, m in enumerate(messages):
        prefix, suffix = fmt.prefix_and_suffix(m["role"], messages[:i])
        text += prefix + m["content"] + suffix
    return text


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_template_roles_concatenate_to_the_rendered_template(messages):
    """TemplateRoles' prefix + content + suffix pieces are exactly ChatTemplate's rendering."""
    fmt = TemplateRoles(CHATML)
    expected = ChatTemplate(CHATML).render(messages, add_generation_prompt=False)
    assert _pieces_text(fmt, messages) == expected


def test_template_roles_default_system_lands_in_the_first_prefix():
    """The template's own default system prompt is in the first non-system prefix only."""
    fmt = TemplateRoles(CHATML)
    prefix, suffix = fmt.prefix_and_suffix("user", [])
    assert prefix == IM.format("system", "You are a helpful AI assistant.") + "<|im_start|>user\n"
    assert suffix == "<|im_end|>\n"
    later, _ = fmt.prefix_and_suffix("assistant", [{"role": "user", "content": "hi"}])
    assert later == "<|im_start|>assistant\n"
    assert fmt.prefix_and_suffix("system", [])[0] == "<|im_start|>system\n"
    with pytest.raises(ValueError, match="unknown role"):
        fmt.prefix_and_suffix("tool", [])


def test_template_roles_strip_bos():
    """strip_bos drops the BOS text the template writes first; without it the BOS stays."""
    messages = CONVERSATIONS[0]
    special = {"bos_token": "<s>"}
    rendered = ChatTemplate(CHATML_BOS).render(messages, add_generation_prompt=False,
                                               special_tokens=special)
    assert rendered.startswith("<s><|im_start|>system")
    kept = TemplateRoles(CHATML_BOS, special, strip_bos=False)
    stripped = TemplateRoles(CHATML_BOS, special, strip_bos=True)
    assert _pieces_text(kept, messages) == rendered
    assert _pieces_text(stripped, messages) == rendered[len("<s>"):]
    assert not stripped.prefix_and_suffix("user", [])[0].startswith("<s>")


def test_fixed_roles_default_system():
    """FixedRoles inserts its default system block before a first non-system message only."""
    fmt = _chatml("Default prompt.")
    assert fmt.prefix_and_suffix("user", []) == (
        IM.format("system", "Default prompt.") + "<|im_start|>user\n", "<|im_end|>\n")
    assert fmt.prefix_and_suffix("user", [{"role": "system", "content": "x"}]) == (
        "<|im_start|>user\n", "<|im_end|>\n")
    assert fmt.prefix_and_suffix("system", []) == ("<|im_start|>system\n", "<|im_end|>\n")
    assert FIXED_FORMATS["chatml"].prefix_and_suffix("user", [])[0] == "<|im_start|>user\n"
    with pytest.raises(ValueError, match="unknown role"):
        fmt.prefix_and_suffix("narrator", [])


def test_role_format_for_precedence():
    """role_format_for: explicit name > the server's template > model-path guess > default."""
    info = {"chat_template": CHATML, "model_path": "Qwen/Qwen2-0.5B", "chat_template_name": "smol",
            "special_tokens": {"bos_token": "<s>"}, "adds_bos_token": True}
    assert role_format_for(info, "llama-3-instruct") is FIXED_FORMATS["llama-3-instruct"]
    from_template = role_format_for(info)
    assert isinstance(from_template, TemplateRoles) and from_template.name == "smol"
    assert from_template._strip == "<s>"
    no_template = {"model_path": "/models/Meta-Llama-3-8B-Instruct"}
    assert role_format_for(no_template) is FIXED_FORMATS["llama-3-instruct"]
    assert role_format_for({"model_path": "HuggingFaceTB/SmolLM2-135M"}) is FIXED_FORMATS["chatml"]
    assert role_format_for({"model_path": "mistral-7b"}) is FIXED_FORMATS["default"]
    assert role_format_for({}) is FIXED_FORMATS["default"]


def test_role_format_for_unknown_name():
    """An unknown chat_template_name is a ValueError that names it and the known ones."""
    with pytest.raises(ValueError, match="'vicuna'.*chatml"):
        role_format_for({"chat_template": CHATML}, "vicuna")


def test_backend_chat_template_name_overrides_the_server_template():
    """Backend.role_format uses chat_template_name over the template model_info reports."""
    be = FakeBackend(model_info={"chat_template": CHATML})
    be.chat_template_name = "llama-3-instruct"
    assert be.role_format is FIXED_FORMATS["llama-3-instruct"]
    be2 = FakeBackend(model_info={"chat_template": CHATML})
    assert isinstance(be2.role_format, TemplateRoles)
    assert be2.role_format is be2.role_format                 # computed once
    assert be2.calls == [("GET", "/get_model_info")]


# =========================================================================== interpreter

def test_gen_is_non_blocking():
    """run() returns while the generation is still in flight; state["x"] waits for it."""
    release, returned, timed_out = threading.Event(), threading.Event(), []

    def reply(text, params):
        if not release.wait(timeout=GUARD_S):
            timed_out.append(True)
        returned.set()
        return "42"

    @function
    def prog(s):
        s += "Q: " + sgl.gen("x")

    state = prog.run(backend=FakeBackend(reply))
    assert not returned.is_set(), "run() waited for the generation"
    release.set()
    assert state["x"] == "42"
    assert state.text() == "Q: 42"
    assert not timed_out


def test_variables_text_and_meta_info():
    """Variables, text(), get_meta_info and the run() defaults each gen is sent with."""
    be = FakeBackend(lambda text, params: ("Paris", {"prompt": text, "id": "m1"}))

    @function
    def prog(s, country):
        s += f"The capital of {country} is " + sgl.gen("cap", max_tokens=5, stop=".")
        s += "."

    state = prog.run(country="France", backend=be, temperature=0, top_p=0.9)
    assert state["cap"] == "Paris" and state.get_var("cap") == "Paris"
    assert state.text() == "The capital of France is Paris."
    assert state.get_meta_info("cap") == {"prompt": "The capital of France is ", "id": "m1"}
    assert "cap" in state and "nope" not in state
    with pytest.raises(KeyError):
        state["nope"]
    (kind, text, params), = be.calls
    assert kind == "generate" and text == "The capital of France is "
    sp, _ = params.native()
    assert sp["max_new_tokens"] == 5 and sp["stop"] == "." and sp["temperature"] == 0
    assert sp["top_p"] == 0.9 and sp["top_k"] == -1


def test_later_gen_sees_the_earlier_generation():
    """Each gen's prompt is the whole text so far, earlier generations included."""
    be = FakeBackend(lambda text, params: f"<{len(text)}>")

    @function
    def prog(s):
        s += "ab" + sgl.gen("x") + "cd" + sgl.gen("y")

    state = prog.run(backend=be)
    assert state.text() == "ab<2>cd<7>"
    assert [c[1] for c in be.calls] == ["ab", "ab<2>cd"]


def test_dtype_int_returns_an_int():
    """gen(dtype=int) sends the int regex and stores an int; gen_string drops the quotes."""
    be = FakeBackend(lambda text, params: {"int": "42", "str": '"yes"'}[params.dtype])

    @function
    def prog(s):
        s += "n=" + sgl.gen("n", dtype=int) + " s=" + sgl.gen_string("s")

    state = prog.run(backend=be)
    assert state["n"] == 42 and isinstance(state["n"], int)
    assert state["s"] == "yes"
    assert state.text() == 'n=42 s="yes"'
    assert be.calls[0][2].native()[0]["regex"] == ir.DTYPE_REGEX["int"]
    assert be.calls[1][2].native()[0]["regex"] == ir.DTYPE_REGEX["str"]


def test_n_greater_than_one_returns_a_list():
    """n>1: the variable is the list of samples and the text continues with the first."""
    be = FakeBackend(lambda text, params: ["a", "b", "c"] if params.n == 3 else "z")

    @function
    def prog(s):
        s += "X:" + sgl.gen("x", n=3) + "|" + sgl.gen("y")

    state = prog.run(backend=be)
    assert state["x"] == ["a", "b", "c"]
    assert state.get_meta_info("x") == [{"index": 0}, {"index": 1}, {"index": 2}]
    assert state.text() == "X:a|z"
    assert be.calls[1][1] == "X:a|"


def test_with_role_blocks_and_messages():
    """`with s.user():` and role calls render the format's text; messages() lists the blocks."""
    be = FakeBackend()          # model path "Qwen/...": chatml

    @function
    def prog(s):
        s += sgl.system("Be brief.")
        with s.user():
            s += "What is "
            s += "2+2?"
        s += sgl.assistant(sgl.gen("a"))
        s.user("thanks")

    state = prog.run(backend=be)
    assert state.text() == (IM.format("system", "Be brief.") + IM.format("user", "What is 2+2?")
                            + IM.format("assistant", "OUT") + IM.format("user", "thanks"))
    assert state.messages() == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "What is 2+2?"},
                                {"role": "assistant", "content": "OUT"},
                                {"role": "user", "content": "thanks"}]
    assert be.calls[1][1].endswith("<|im_start|>assistant\n")


def test_program_text_matches_the_template_rendering():
    """With the server's jinja template, a program's text is what the template renders for the
    program's own messages (default system prompt included)."""
    be = FakeBackend(model_info={"chat_template": CHATML})

    @function
    def prog(s):
        s += sgl.user("What is 2+2?")
        s += sgl.assistant(sgl.gen("a"))
        s += sgl.user("Thanks!")

    state = prog.run(backend=be)
    messages = state.messages()
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert state.text() == ChatTemplate(CHATML).render(messages, add_generation_prompt=False)
    assert state.text().startswith("<|im_start|>system\nYou are a helpful AI assistant.")


def test_nested_role_is_an_error():
    """A role block inside an open one fails the state with a ValueError; so does a stray end."""
    @function
    def nested(s):
        with s.user():
            s += "hi"
            s += sgl.assistant("x")

    state = nested.run(backend=FakeBackend())
    assert isinstance(state.error(), ValueError)
    assert "inside the open user block" in str(state.error())
    with pytest.raises(ValueError, match="inside the open user block"):
        state.text()

    @function
    def stray(s):
        s += "x" + sgl.assistant_end()

    assert "without an open assistant block" in str(stray.run(backend=FakeBackend()).error())


def test_fork_caches_the_parent_once_and_branches_start_from_it():
    """fork(3): exactly one cache_prefix of the parent text, before any branch generation;
    every branch's prompt starts from the parent text."""
    be = FakeBackend(lambda text, params: "v" + text[-3])

    @function
    def prog(s):
        s += "Parent text. "
        forks = s.fork(3)
        forks += lambda i: f"Branch {i}: " + sgl.gen("v", max_tokens=4)
        forks.join()
        return forks

    state = prog.run(backend=be)
    state.sync()
    assert be.kinds() == ["cache_prefix", "generate", "generate", "generate"]
    assert be.calls[[c[0] for c in be.calls].index("cache_prefix")][1] == "Parent text. "
    prompts = sorted(c[1] for c in be.calls if c[0] == "generate")
    assert prompts == [f"Parent text. Branch {i}: " for i in range(3)]
    forks = state.ret_value
    assert len(forks) == 3
    assert [f.text() for f in forks] == [f"Parent text. Branch {i}: v{i}" for i in range(3)]


def test_fork_of_one_sends_no_cache_request():
    """fork(1) (and s.copy()) copies the state without a cache_prefix request."""
    be = FakeBackend()

    @function
    def prog(s):
        s += "P"
        with s.copy() as c:
            c += sgl.gen("x")

    prog.run(backend=be).sync()
    assert be.kinds() == ["generate"]


def test_join_gather_keeps_branch_order():
    """join(): s["v"] is the branches' values in branch order, even when they finish out of
    order; the parent's text is unchanged."""
    last_done, timed_out = threading.Event(), []

    def reply(text, params):
        i = int(text[-3])
        if i == 0 and not last_done.wait(timeout=GUARD_S):   # branch 0 finishes after branch 2
            timed_out.append(True)
        if i == 2:
            last_done.set()
        return f"v{i}"

    @function
    def prog(s):
        s += "P. "
        forks = s.fork(3)
        forks += lambda i: f"Branch {i}: " + sgl.gen("v")
        forks.join("gather_variable")
        s += "end"

    state = prog.run(backend=FakeBackend(reply))
    assert state["v"] == ["v0", "v1", "v2"]
    assert state.text() == "P. end"
    assert not timed_out


def test_join_concatenate_appends_branch_suffixes_in_order():
    """join("concate_and_append"): the parent text gets each branch's text since the fork."""
    be = FakeBackend(lambda text, params: "v" + text[-3])

    @function
    def prog(s, mode):
        s += "P. "
        forks = s.fork(3)
        forks += [f"B{i}: " for i in range(3)]
        forks += sgl.gen("v")
        forks.join(mode)
        s += "|end"

    for mode in ("concate_and_append", "concatenate"):
        state = prog.run(mode=mode, backend=be)
        assert state.text() == "P. B0: v0B1: v1B2: v2|end"


def test_ended_states_take_no_more_expressions():
    """After the program returns, its state and its joined branches refuse appends; reading a
    joined branch still works (it is ended once, not twice)."""
    @function
    def prog(s):
        s += "P"
        forks = s.fork(2)
        forks += sgl.gen("v")
        forks.join()
        return forks

    state = prog.run(backend=FakeBackend())
    forks = state.ret_value
    with pytest.raises(RuntimeError, match="ended"):
        state += "more"
    with pytest.raises(RuntimeError, match="ended"):
        forks[0] += "more"
    assert [f.text() for f in forks] == ["POUT", "POUT"]
    assert state.text() == "P" and state["v"] == ["OUT", "OUT"]


def test_run_batch_of_a_forking_program_finishes():
    """run_batch waits for every branch of a program that forks and joins, then returns (a
    branch ended twice used to leave its queue unfinished and the batch hung)."""
    @function
    def prog(s, q):
        s += q
        forks = s.fork(2)
        forks += lambda i: f" b{i}:" + sgl.gen("v")
        forks.join()

    result = []
    worker = threading.Thread(target=lambda: result.append(
        prog.run_batch([{"q": "x"}, {"q": "y"}], backend=FakeBackend(), precache=False)),
        daemon=True)
    worker.start()
    worker.join(timeout=GUARD_S)
    assert not worker.is_alive(), "run_batch never returned"
    assert [s["v"] for s in result[0]] == [["OUT", "OUT"], ["OUT", "OUT"]]


def test_join_bad_mode():
    """join() with an unknown mode raises ValueError listing the modes."""
    @function
    def prog(s):
        s += "P"
        return s.fork(2)

    forks = prog.run(backend=FakeBackend()).ret_value
    with pytest.raises(ValueError, match="join mode"):
        forks.join("merge")


def test_failed_generation_stops_the_state():
    """A BackendError in a gen: reads and text() raise it, error() returns it, later
    expressions are skipped (no further request)."""
    err = BackendError("/generate", "rid-1", 400, "bad")

    def reply(text, params):
        raise err

    be = FakeBackend(reply)

    @function
    def prog(s):
        s += "Q" + sgl.gen("x")
        s += "after" + sgl.gen("y")

    state = prog.run(backend=be)
    with pytest.raises(BackendError) as info:
        state["x"]
    assert info.value is err
    with pytest.raises(BackendError):
        state["y"]
    with pytest.raises(BackendError):
        state.text()
    with pytest.raises(BackendError):
        state.messages()
    assert state.error() is err
    assert be.kinds() == ["generate"]


def test_failed_program_in_run_batch_fails_alone():
    """In run_batch, the state whose gen fails holds the error; the other one is unaffected."""
    def reply(text, params):
        if "bad" in text:
            raise BackendError("/generate", "rid-1", 400, "bad")
        return "fine"

    @function
    def prog(s, q):
        s += q + sgl.gen("x")

    bad, good = prog.run_batch([{"q": "bad"}, {"q": "good"}], backend=FakeBackend(reply))
    assert isinstance(bad.error(), BackendError) and bad.error().rid == "rid-1"
    with pytest.raises(BackendError):
        bad["x"]
    assert good.error() is None
    assert good["x"] == "fine" and good.text() == "goodfine"


def test_image_is_refused():
    """image(...) fails the state with a ValueError saying the model reads text only."""
    be = FakeBackend()

    @function
    def prog(s):
        s += "Look: " + sgl.image("cat.png") + sgl.gen("x")

    state = prog.run(backend=be)
    assert isinstance(state.error(), ValueError) and "text only" in str(state.error())
    with pytest.raises(ValueError, match="text only"):
        state.text()
    assert be.kinds() == []


def test_select_with_temperature_is_an_error():
    """select at a temperature above 0 fails the state before any request."""
    be = FakeBackend()

    @function
    def prog(s):
        s += "A or B? " + sgl.select("c", ["A", "B"], temperature=0.7)

    state = prog.run(backend=be)
    assert isinstance(state.error(), ValueError) and "temperature" in str(state.error())
    with pytest.raises(ValueError):
        state["c"]
    assert be.kinds() == []


# =========================================================================== streaming

@function
def _stream_prog(s):
    s += "Q: " + sgl.gen("x") + "!"


def _started_stream(ack=None):
    be = FakeBackend(ack=ack)
    state = _stream_prog.run(stream=True, backend=be)
    assert be.stream_started.wait(timeout=GUARD_S)      # gen("x") is queued and streaming
    return be, state


def test_text_iter_of_a_variable_yields_the_deltas():
    """stream=True: text_iter("x") yields the streamed deltas; they join to state["x"]."""
    ack = threading.Semaphore(0)
    be, state = _started_stream(ack)
    pieces = []
    for piece in state.text_iter("x"):
        pieces.append(piece)
        ack.release()
    assert pieces == ["Hel", "lo", " world"]
    assert "".join(pieces) == state["x"] == "Hello world"
    assert state.get_meta_info("x") == {"completion_tokens": 3}
    assert state.text() == "Q: Hello world!"
    assert be.kinds() == ["generate_stream"]


def test_text_iter_of_the_whole_text_ends():
    """stream=True: text_iter() yields the whole text piece by piece and ends with the program."""
    _, state = _started_stream()
    pieces = list(state.text_iter())
    assert "".join(pieces) == state.text() == "Q: Hello world!"


def test_text_async_iter_under_asyncio():
    """text_async_iter yields the same deltas under asyncio.run."""
    ack = threading.Semaphore(0)
    _, state = _started_stream(ack)

    async def collect():
        out = []
        async for piece in state.text_async_iter("x"):
            out.append(piece)
            ack.release()
        return out

    assert asyncio.run(collect()) == ["Hel", "lo", " world"]
    assert state["x"] == "Hello world"


def test_text_iter_without_stream_yields_one_piece():
    """Without stream, text_iter(name) / text_iter() yield the final value in one piece."""
    be = FakeBackend()
    state = _stream_prog.run(backend=be)
    assert list(state.text_iter("x")) == ["OUT"]
    assert list(state.text_iter()) == ["Q: OUT!"]
    assert be.kinds() == ["generate"]


def test_streamed_generation_with_n_uses_generate():
    """stream=True with n>1 falls back to one non-streamed generate (the list of samples)."""
    called = threading.Event()

    def reply(text, params):
        called.set()
        return ["a", "b"]

    be = FakeBackend(reply)

    @function
    def prog(s):
        s += sgl.gen("x", n=2)

    state = prog.run(stream=True, backend=be)
    assert called.wait(timeout=GUARD_S)         # the body ran: gen("x") is queued
    assert state["x"] == ["a", "b"]
    assert be.kinds() == ["generate"]


def test_text_iter_waits_for_a_gen_not_yet_submitted():
    """stream=True: text_iter("b") called while the program body still waits on s["a"] (so
    gen("b") is not queued yet) yields b's deltas once b streams."""
    gate = threading.Event()

    class Gated(FakeBackend):
        def generate_stream(self, text, params):
            if not self.calls:          # gen("a") streams only once the reader waits
                gate.wait(timeout=GUARD_S)
            yield from super().generate_stream(text, params)

    class OpensGate(threading.Condition):
        def wait(self, timeout=None):   # the reader is blocked waiting for the state to change
            gate.set()
            return super().wait(timeout)

    @function
    def prog(s):
        s += sgl.gen("a")
        s += "[" + s["a"] + "]" + sgl.gen("b")

    state = prog.run(stream=True, backend=Gated())
    state.executor._changed = OpensGate()   # unused until gen("a") streams, which needs the gate
    try:
        pieces = list(state.text_iter("b"))
    finally:
        gate.set()
    assert "".join(pieces) == "Hello world"
    assert state["b"] == "Hello world"


def test_failed_streamed_generation_read_raises():
    """stream=True: a gen whose stream fails makes state["x"] raise its error, as without
    stream."""
    err = BackendError("/generate", "rid-1", 400, "bad")

    class Failing(FakeBackend):
        def generate_stream(self, text, params):
            self.stream_started.set()
            raise err
            yield  # noqa: unreachable - makes this a generator

    be = Failing()
    state = _stream_prog.run(stream=True, backend=be)
    assert be.stream_started.wait(timeout=GUARD_S)
    state.sync()
    assert state.error() is err
    with pytest.raises(BackendError):
        state["x"]


def test_failed_streamed_generation_text_iter_raises():
    """stream=True: text_iter("x") of a failing stream raises its error; text() too."""
    err = BackendError("/generate", "rid-2", 500, "boom")

    class Failing(FakeBackend):
        def generate_stream(self, text, params):
            self.stream_started.set()
            yield "Hel", {}
            raise err

    be = Failing()
    state = _stream_prog.run(stream=True, backend=be)
    assert be.stream_started.wait(timeout=GUARD_S)
    with pytest.raises(BackendError):
        list(state.text_iter("x"))
    with pytest.raises(BackendError):
        state.text()


# =========================================================================== Backend requests

TEXT = "The answer is"
PROMPT_TOKENS = 4


def _select_wire(scored, unconditional=None):
    """A WireBackend answering the cache request, the batched score and the unconditional
    score with the given entries (per choice)."""
    def answer(path, body):
        assert path == "/generate"
        if "input_ids" in body:
            return [{"text": "", "meta_info": {"input_token_logprobs": unconditional[i]}}
                    for i in range(len(body["input_ids"]))]
        if isinstance(body["text"], list):
            return [{"text": "", "meta_info": {"input_token_logprobs": scored[t[len(TEXT):]]}}
                    for t in body["text"]]
        return {"text": "", "meta_info": {"prompt_tokens": PROMPT_TOKENS, "cached_tokens": 0}}
    return WireBackend(answer)


# " yes" keeps TEXT's last token " is"; "n't" merges with it into " isn"
SCORED = {" yes": [[-0.1, 11, " is"], [-0.5, 12, " yes"]],
          "n't": [[-2.0, 13, " isn"], [-0.3, 14, "'t"]]}


def test_select_sends_cache_then_one_batched_score():
    """select: a cache request of the text, then ONE batched /generate scoring every choice from
    logprob_start_len = prompt_tokens - 1 with no new tokens."""
    be = _select_wire(SCORED)
    decision = be.select(TEXT, [" yes", "n't"])
    assert len(be.posts) == 2
    (p1, cache), (p2, score) = be.posts
    assert p1 == p2 == "/generate"
    assert cache["text"] == TEXT and cache["sampling_params"]["max_new_tokens"] == 0
    assert score["text"] == [TEXT + " yes", TEXT + "n't"]
    assert score["logprob_start_len"] == PROMPT_TOKENS - 1
    assert score["sampling_params"]["max_new_tokens"] == 0
    assert score["return_logprob"] is True
    assert isinstance(score["rid"], list) and len(score["rid"]) == 2
    assert isinstance(cache["rid"], str)
    assert decision.decision == " yes"


def test_select_drops_the_texts_own_last_token_only():
    """The first scored entry is dropped when it is the text's own last token, kept when the
    choice merged into it."""
    decision = _select_wire(SCORED).select(TEXT, [" yes", "n't"])
    assert decision.meta_info["input_token_logprobs"] == [
        [[-0.5, 12, " yes"]], [[-2.0, 13, " isn"], [-0.3, 14, "'t"]]]
    assert decision.meta_info["normalized_prompt_logprobs"] == pytest.approx([-0.5, -1.15])


def test_select_unconditional_sends_the_choice_ids():
    """unconditional_likelihood_normalized adds a third request: the choices' token ids alone."""
    uncond = [[[None, 12, None]], [[None, 13, None], [-3.0, 14, None]]]
    be = _select_wire(SCORED, uncond)
    decision = be.select(TEXT, [" yes", "n't"], unconditional_likelihood_normalized)
    assert len(be.posts) == 3
    path, body = be.posts[2]
    assert path == "/generate" and body["input_ids"] == [[12], [13, 14]]
    assert body["logprob_start_len"] == 0 and body["sampling_params"]["max_new_tokens"] == 0
    assert isinstance(body["rid"], list) and len(body["rid"]) == 2
    assert decision.decision == "n't"           # -0.5 vs mean(-2.0, 2.7) = 0.35


def test_select_in_a_program():
    """s += select(...) runs Backend.select on the text so far and appends the choice."""
    be = _select_wire(SCORED)

    @function
    def prog(s):
        s += TEXT + sgl.select("c", [" yes", "n't"]) + "."

    state = prog.run(backend=be)
    assert state["c"] == " yes" and state.text() == TEXT + " yes."
    assert state.get_meta_info("c")["normalized_prompt_logprobs"] == pytest.approx([-0.5, -1.15])
    assert be.posts[0][1]["text"] == TEXT


def test_generate_body_and_stream_deltas():
    """generate() sends sampling_params and top-level fields; generate_stream turns the
    cumulative chunk texts into deltas, and refuses n>1."""
    def answer(path, body):
        if body.get("stream"):
            return iter([{"text": "He", "meta_info": {"k": 1}},
                         {"text": "Hello", "meta_info": {"k": 2}}])
        return {"text": "hi", "meta_info": {"prompt_tokens": 3}}

    be = WireBackend(answer)
    params = ir.SamplingParams(max_new_tokens=4, return_logprob=True)
    assert be.generate("abc", params) == ("hi", {"prompt_tokens": 3})
    body = be.posts[0][1]
    assert body["text"] == "abc" and body["sampling_params"] == {"max_new_tokens": 4}
    assert body["return_logprob"] is True and isinstance(body["rid"], str)
    assert list(be.generate_stream("abc", params)) == [("He", {"k": 1}), ("llo", {"k": 2})]
    assert be.posts[1][1]["stream"] is True
    with pytest.raises(ValueError, match="n=1"):
        list(be.generate_stream("abc", ir.SamplingParams(n=2)))


# =========================================================================== run_batch

LONG_SYSTEM = "You are a meticulous assistant who answers every question in one short line. "
assert len(LONG_SYSTEM) >= PRECACHE_MIN_CHARS


@function
def _qa(s, q):
    s += LONG_SYSTEM
    s += "Q: " + q + "\nA:" + sgl.gen("a")


def _echo(text, params):
    return " ans-" + text.split("Q: ")[-1].split("\n")[0]


def test_run_batch_precaches_the_long_shared_prefix():
    """run_batch sends one cache_prefix of the batch's common prefix (>= 64 chars) before the
    programs' generations; states come back in order."""
    be = FakeBackend(_echo)
    states = _qa.run_batch([{"q": f"q{i}"} for i in range(4)], backend=be)
    assert be.kinds() == ["cache_prefix"] + ["generate"] * 4
    assert be.calls[[c[0] for c in be.calls].index("cache_prefix")][1] == LONG_SYSTEM + "Q: q"
    assert [s["a"] for s in states] == [f" ans-q{i}" for i in range(4)]


def test_run_batch_no_precache_for_a_short_prefix():
    """A shared prefix shorter than 64 characters is not precached."""
    @function
    def prog(s, q):
        s += "Short. Q: " + q + sgl.gen("a")

    be = FakeBackend()
    prog.run_batch([{"q": "x"}, {"q": "y"}], backend=be)
    assert be.kinds() == ["generate", "generate"]


def test_run_batch_no_precache_when_a_program_cannot_be_traced():
    """A program that raises when traced (after its long shared text) runs without any
    precache request."""
    @function
    def prog(s, q):
        s += LONG_SYSTEM
        if not isinstance(s, ProgramState):
            raise RuntimeError("only runs on a real state")
        s += q + sgl.gen("a")

    be = FakeBackend()
    states = prog.run_batch([{"q": "x"}, {"q": "y"}], backend=be)
    assert be.kinds() == ["generate", "generate"]
    assert [s.text() for s in states] == [LONG_SYSTEM + "xOUT", LONG_SYSTEM + "yOUT"]


def test_run_batch_results_in_order_when_finishing_out_of_order():
    """States come back in the batch's order though the first finishes last."""
    last_done, timed_out = threading.Event(), []

    def reply(text, params):
        out = _echo(text, params)
        if out.endswith("q0") and not last_done.wait(timeout=GUARD_S):
            timed_out.append(True)
        if out.endswith("q3"):
            last_done.set()
        return out

    states = _qa.run_batch([{"q": f"q{i}"} for i in range(4)], backend=FakeBackend(reply),
                           num_threads=4, precache=False)
    assert [s["a"] for s in states] == [f" ans-q{i}" for i in range(4)]
    assert not timed_out


def test_run_batch_progress_bar_and_settings():
    """progress_bar=True runs the batch the same; run() settings reach every gen."""
    be = FakeBackend(_echo)
    states = _qa.run_batch([{"q": "a"}, {"q": "b"}], backend=be, progress_bar=True,
                           temperature=0, max_new_tokens=7)
    assert [s["a"] for s in states] == [" ans-a", " ans-b"]
    gens = [c[2] for c in be.calls if c[0] == "generate"]
    assert all(p.temperature == 0 and p.max_new_tokens == 7 for p in gens)


def test_trace_prefix_stops_at_the_first_gen():
    """trace_prefix: the text (role blocks rendered) before the first gen, with no request."""
    be = FakeBackend()
    assert trace_prefix(_qa.func, {"q": "why"}, be) == LONG_SYSTEM + "Q: why\nA:"

    @function
    def chat(s, q):
        s += sgl.system("Sys.")
        with s.user():
            s += q
        s += sgl.assistant(sgl.gen("a") + "tail")
        s += "never"

    assert trace_prefix(chat.func, {"q": "hi"}, be) == (
        IM.format("system", "Sys.") + IM.format("user", "hi") + "<|im_start|>assistant\n")

    @function
    def reads(s):
        s += "before"
        s.fork(2)
        s += "after"

    assert trace_prefix(reads.func, {}, be) == "before"
    assert be.kinds() == []


# =========================================================================== errors

def test_backend_error_message_names_route_and_rid():
    """BackendError's message names the route, the rid, the status and the server's message."""
    e = BackendError("/generate", "rid-1", 400, "bad")
    assert (e.route, e.rid, e.status, e.message) == ("/generate", "rid-1", 400, "bad")
    assert str(e) == "request rid-1 (/generate) failed with HTTP 400: bad"
    assert str(BackendError("/get_model_info", None, None, "refused")) == \
        "/get_model_info failed with no answer: refused"


def test_runtime_endpoint_closed_port_fails_at_construction():
    """RuntimeEndpoint to a port nobody listens on raises BackendError when constructed."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    with pytest.raises(BackendError) as info:
        RuntimeEndpoint(f"http://127.0.0.1:{port}", timeout=5)
    assert info.value.route == "/get_model_info" and info.value.status is None
    assert "/get_model_info" in str(info.value)


def test_no_backend_is_an_error():
    """run() with no backend and no default one raises ValueError saying how to set one."""
    previous = sgl.get_default_backend()
    sgl.set_default_backend(None)
    try:
        with pytest.raises(ValueError, match="set_default_backend"):
            _qa.run(q="x")
    finally:
        sgl.set_default_backend(previous)


# =========================================================================== separate_reasoning

def test_separate_reasoning_splits_the_variable_and_keeps_the_text():
    """SGLang's sgl.separate_reasoning: s[name] becomes the answer, s[name +
    "_reasoning_content"] the <think> block; the state's text keeps what the model wrote; a
    read of either waits for the split (never sees the raw generation)."""
    release = threading.Event()
    raw = "<think>\n2 + 2 is 4.\n</think>\n\nFour."

    def reply(text, params):
        assert release.wait(timeout=GUARD_S)
        return raw

    @function
    def prog(s):
        s += sgl.user("2 + 2?")
        s += sgl.assistant(sgl.separate_reasoning(sgl.gen("answer"), model_type="qwen3"))

    be = FakeBackend(reply, model_info={"model_path": "x", "chat_template": CHATML})
    state = prog.run(backend=be)
    got = []
    reader = threading.Thread(target=lambda: got.append(state["answer_reasoning_content"]))
    reader.start()
    release.set()
    reader.join(GUARD_S)
    assert got == ["2 + 2 is 4."]
    assert state["answer"] == "Four."
    assert state.text().endswith(IM.format("assistant", raw))
    # n > 1 splits each sample; a gen without reasoning gives None
    be = FakeBackend(lambda text, params: ["<think>a</think>A", "B"])

    @function
    def many(s):
        s += sgl.separate_reasoning(sgl.gen("x", n=2), model_type="qwen3")

    state = many.run(backend=be)
    assert state["x"] == ["A", "B"] and state["x_reasoning_content"] == ["a", None]


def test_separate_reasoning_needs_a_known_model_type():
    with pytest.raises(ValueError, match="deepseek-r1"):
        sgl.separate_reasoning(sgl.gen("x"))
    assert "separate_reasoning" in sgl.__all__


def test_a_read_of_the_separated_variable_waits_for_the_split(monkeypatch):
    """While the split runs, s[name] is not final (its done event, which reads wait on, is
    unset, though the gen already stored the raw generation), so a reader gets the answer."""
    from radixserve.parsers import reasoning

    splitting, go = threading.Event(), threading.Event()
    real = reasoning.split_reasoning

    def slow_split(text, parser):
        splitting.set()
        assert go.wait(timeout=GUARD_S)
        return real(text, parser)

    monkeypatch.setattr(reasoning, "split_reasoning", slow_split)

    @function
    def prog(s):
        s += sgl.separate_reasoning(sgl.gen("x"), model_type="qwen3")

    state = prog.run(backend=FakeBackend(lambda text, params: "<think>r</think>A"))
    assert splitting.wait(timeout=GUARD_S)
    executor = state.executor
    assert executor.variables["x"] == "<think>r</think>A"      # stored by the gen ...
    assert not executor.done["x"].is_set()                      # ... but not final yet
    go.set()
    assert state["x"] == "A" and state["x_reasoning_content"] == "r"
