"""The frontend language end to end on the default model, through both backends: the HTTP
RuntimeEndpoint against the session's server and the in-process EngineBackend. Programs in the
style of SGLang's own program tests; the checks are on structure and constraints (the model is
135M parameters), and on the sharing the runtime gives the programs (cached tokens, request
counts)."""
import asyncio
import json
import re

import httpx
import jsonschema
import pytest

import radixserve.lang as sgl
from radixserve.lang.backend import RuntimeEndpoint


@pytest.fixture(scope="module")
def engine_backend():
    backend = sgl.EngineBackend(device="cpu", max_total_tokens=8192)
    yield backend
    backend.shutdown()


@pytest.fixture(scope="module", params=["http", "engine"])
def backend(request, server):
    if request.param == "http":
        return sgl.RuntimeEndpoint(server.url)
    return request.getfixturevalue("engine_backend")


class CountingEndpoint(RuntimeEndpoint):
    """A RuntimeEndpoint that records every POST body it sends."""

    def __init__(self, url):
        self.posts = []
        super().__init__(url)

    def _post(self, path, body):
        self.posts.append((path, body))
        return super()._post(path, body)


FEW_SHOT = ("The following are questions with answers.\n\n"
            "Q: What is the capital of France?\nA: Paris\n"
            "Q: What is the capital of Germany?\nA: Berlin\n")


@sgl.function
def few_shot_qa(s, question):
    s += FEW_SHOT
    s += "Q: " + question + "\n"
    s += "A:" + sgl.gen("answer", stop="\n", max_tokens=16)


def test_few_shot_qa(backend):
    """A gen stops at its stop string; the state's text is the prompt plus the answer."""
    state = few_shot_qa.run(question="What is the capital of Italy?", temperature=0,
                            backend=backend)
    answer = state["answer"]
    assert isinstance(answer, str) and answer.strip() and "\n" not in answer
    assert state.text() == FEW_SHOT + "Q: What is the capital of Italy?\nA:" + answer
    meta = state.get_meta_info("answer")
    assert meta["completion_tokens"] <= 16 and meta["prompt_tokens"] > 20


@sgl.function
def multi_turn(s, questions):
    s += sgl.system("You are a terse assistant.")
    for i, q in enumerate(questions):
        with s.user():
            s += q
        with s.assistant():
            s += sgl.gen(f"answer_{i}", max_tokens=12)


def test_multi_turn_chat_is_the_chat_template(backend, default_tokenizer):
    """Role blocks render with the served model's chat template: the program's text is exactly
    what the template renders for its messages."""
    state = multi_turn.run(questions=["Name a color.", "Name another one."], temperature=0,
                           backend=backend)
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert messages[2]["content"] == state["answer_0"].lstrip()
    assert state.text() == default_tokenizer.apply_chat_template(messages,
                                                                 add_generation_prompt=False)


@sgl.function
def pick(s, method):
    s += "Q: Which city is the capital of England?\nA:"
    s += sgl.select("city", choices=[" Paris", " London", " Berlin", " Madrid"],
                    choices_method=method)


@pytest.mark.parametrize("method", [sgl.token_length_normalized, sgl.greedy_token_selection,
                                    sgl.unconditional_likelihood_normalized],
                         ids=["token_length", "greedy", "unconditional"])
def test_select_methods(backend, method):
    """Every method picks one of the choices, appends it, and reports the scores it compared."""
    state = pick.run(method=method, backend=backend)
    city = state["city"]
    assert city in [" Paris", " London", " Berlin", " Madrid"]
    assert state.text().endswith("A:" + city)
    meta = state.get_meta_info("city")
    assert len(meta["normalized_prompt_logprobs"]) == 4
    if method is sgl.unconditional_likelihood_normalized:
        assert len(meta["normalized_unconditional_prompt_logprobs"]) == 4
    if method is sgl.greedy_token_selection:
        assert len(meta["greedy_logprob_matrix"]) == 4


def test_select_is_one_batched_request_and_matches_generate_logprobs(server, default_tokenizer):
    """select sends the prompt once, then ONE batched scoring request; its pick is the argmax of
    the choices' mean logprobs computed by hand from separate /generate calls."""
    endpoint = CountingEndpoint(server.url)
    state = pick.run(method=sgl.token_length_normalized, backend=endpoint)
    city = state["city"]
    generates = [body for path, body in endpoint.posts if path == "/generate"]
    assert len(generates) == 2
    assert isinstance(generates[0]["text"], str) and generates[0]["sampling_params"] == {
        "max_new_tokens": 0}
    assert len(generates[1]["text"]) == 4 and generates[1]["sampling_params"]["max_new_tokens"] == 0

    prompt = "Q: Which city is the capital of England?\nA:"
    start = len(default_tokenizer.encode(prompt))
    means = {}
    for choice in [" Paris", " London", " Berlin", " Madrid"]:
        out = httpx.post(server.url + "/generate", timeout=120, json={
            "text": prompt + choice, "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True, "logprob_start_len": start}).json()
        logprobs = [e[0] for e in out["meta_info"]["input_token_logprobs"]]
        assert logprobs and all(lp is not None for lp in logprobs)
        means[choice] = sum(logprobs) / len(logprobs)
    assert city == max(means, key=means.get)
    scores = state.get_meta_info("city")["normalized_prompt_logprobs"]
    assert scores == pytest.approx(list(means.values()), abs=1e-3)


@sgl.function
def constrained(s):
    s += "Phone: " + sgl.gen("phone", regex=r"[0-9]{3}-[0-9]{4}", max_tokens=12) + "\n"
    s += "Age: " + sgl.gen("age", dtype=int, max_tokens=6) + "\n"
    s += "Height: " + sgl.gen("height", dtype=float, max_tokens=10) + "\n"
    s += "Married: " + sgl.gen("married", dtype=bool, max_tokens=3) + "\n"
    s += "Name: " + sgl.gen_string("name", max_tokens=16) + "\n"
    s += "Year: " + sgl.gen_int("year", max_tokens=6) + "\n"


def test_gen_regex_and_dtypes(backend):
    """regex output matches it; dtype gens store typed values."""
    state = constrained.run(backend=backend, temperature=0)
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", state["phone"])
    assert isinstance(state["age"], int) and not isinstance(state["age"], bool)
    assert isinstance(state["height"], float)
    assert isinstance(state["married"], bool)
    assert isinstance(state["name"], str) and '"' not in state["name"]
    assert isinstance(state["year"], int)
    assert f"Age: {state['age']}\n" in state.text()


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@sgl.function
def person(s):
    s += "A person as JSON: " + sgl.gen("json", json_schema=PERSON, max_tokens=48)


def test_gen_json_schema(backend):
    state = person.run(backend=backend, temperature=0)
    jsonschema.validate(json.loads(state["json"], strict=False), PERSON)


PARENT = ("Here is a short story about a lighthouse keeper who lived alone on a rocky island "
          "far from the coast, and who kept a diary of every ship that passed. ")


@sgl.function
def branches(s, mode):
    s += PARENT
    forks = s.fork(4)
    forks += lambda i: f"Ending {i + 1}:"
    forks += sgl.gen("ending", max_tokens=6)
    forks.join(mode)


def test_fork_prefills_the_parent_once(backend, default_tokenizer):
    """Four branches report the parent's prompt as cached tokens; gather makes a list."""
    state = branches.run(mode="gather_variable", backend=backend, temperature=0)
    endings = state["ending"]
    assert isinstance(endings, list) and len(endings) == 4
    parent_tokens = len(default_tokenizer.encode(PARENT))
    child = state.executor.children
    assert len(child) == 4
    for branch in child:
        meta = branch.meta_info["ending"]
        assert meta["cached_tokens"] >= parent_tokens - 2, meta


def test_fork_computes_the_parent_prompt_once_on_the_server(server, default_tokenizer):
    """Server-side: the prompt tokens the whole fork computes (not cached) are the parent's
    once plus each branch's own few."""
    server.wait_idle()
    prompt0, cached0 = server.metric("prompt_tokens_total"), server.metric("cached_tokens_total")
    branches.run(mode="gather", backend=sgl.RuntimeEndpoint(server.url), temperature=0).sync()
    computed = (server.metric("prompt_tokens_total") - prompt0) - (
        server.metric("cached_tokens_total") - cached0)
    parent_tokens = len(default_tokenizer.encode(PARENT))
    branch_suffix = len(default_tokenizer.encode(PARENT + "Ending 1:")) - parent_tokens
    assert computed <= parent_tokens + 4 * (branch_suffix + 2)
    assert computed < 2 * parent_tokens


def test_run_batch_of_forking_programs(backend):
    """run_batch waits for every branch of every program (each joined branch ends once)."""
    states = branches.run_batch([{"mode": "gather"}, {"mode": "concatenate"}], backend=backend,
                                temperature=0)
    assert len(states[0]["ending"]) == 4
    assert states[1].text().startswith(PARENT + "Ending 1:")
    with pytest.raises(RuntimeError, match="has ended"):
        states[0] += "more"


def test_join_concatenate(backend):
    """concate_and_append appends every branch's text since the fork, in order."""
    state = branches.run(mode="concate_and_append", backend=backend, temperature=0)
    text = state.text()
    assert text.startswith(PARENT)
    tail = text[len(PARENT):]
    positions = [tail.find(f"Ending {i}:") for i in range(1, 5)]
    assert positions == sorted(positions) and positions[0] == 0


@sgl.function
def story(s):
    s += "Once upon a time" + sgl.gen("story", max_tokens=24, ignore_eos=True)


def test_streaming_text_iter(backend):
    """stream=True: text_iter yields the generation piece by piece; they add up to the value."""
    state = story.run(stream=True, backend=backend, temperature=0)
    pieces = list(state.text_iter("story"))
    assert len(pieces) > 1
    assert "".join(pieces) == state["story"]


def test_streaming_text_async_iter(backend):
    async def collect():
        state = story.run(stream=True, backend=backend, temperature=0)
        return state, [p async for p in state.text_async_iter("story")]

    state, pieces = asyncio.run(collect())
    assert len(pieces) > 1 and "".join(pieces) == state["story"]


def test_run_batch_with_progress_bar(backend, capfd):
    """run_batch returns the states in order; the progress bar reaches the batch size."""
    questions = [f"What is {i} plus {i}?" for i in range(6)]
    states = few_shot_qa.run_batch([{"question": q} for q in questions], backend=backend,
                                   progress_bar=True, temperature=0)
    assert [s.text().split("Q: ")[-1].split("\n")[0] for s in states] == questions
    assert all(isinstance(s["answer"], str) for s in states)
    assert "6/6" in capfd.readouterr().err


def test_run_batch_precaches_the_shared_prefix(server):
    endpoint = CountingEndpoint(server.url)
    shared = few_shot_qa.precache([{"question": "a?"}, {"question": "b?"}], endpoint)
    assert shared == FEW_SHOT + "Q: "
    assert endpoint.posts[-1][1]["text"] == shared


@sgl.function
def short_reply(s, min_tokens):
    s += sgl.user("Is the sky blue? Answer yes or no.")
    s += sgl.assistant(sgl.gen("reply", max_tokens=16, min_tokens=min_tokens))


def test_min_tokens(backend):
    """min_tokens holds EOS back: the reply is at least that long."""
    free = short_reply.run(min_tokens=None, backend=backend, temperature=0)
    held = short_reply.run(min_tokens=10, backend=backend, temperature=0)
    assert free.get_meta_info("reply")["completion_tokens"] < 10
    assert held.get_meta_info("reply")["completion_tokens"] >= 10


@sgl.function
def bad_schema(s):
    s += "x" + sgl.gen("out", json_schema="{not json", max_tokens=4)


def test_backend_error_names_the_request(backend):
    state = bad_schema.run(backend=backend)
    with pytest.raises(sgl.BackendError) as err:
        state["out"]
    e = err.value
    assert e.status == 400 and e.route == "/generate" and e.rid.startswith("lang-")
    assert e.rid in str(e) and "json_schema" in str(e)
    assert state.error() is e
    # the backend keeps serving
    assert few_shot_qa.run(question="Hi?", backend=backend, temperature=0)["answer"] is not None


@sgl.function
def with_image(s):
    s += sgl.user(sgl.image("cat.png") + "What is this?")


def test_image_is_refused_for_a_text_model(backend):
    state = with_image.run(backend=backend)
    with pytest.raises(ValueError, match="reads text only"):
        state.text()


def test_model_info_has_what_a_runtime_endpoint_reads(server):
    info = httpx.get(server.url + "/get_model_info", timeout=30).json()
    assert info["chat_template_name"] == "chatml"
    assert "<|im_start|>" in info["chat_template"]
    assert info["adds_bos_token"] is False
    assert info["special_tokens"]["eos_token"] == "<|im_end|>"
    assert info["model_path"]


def test_scoring_request_batched(server, default_tokenizer):
    """max_new_tokens 0 with logprobs scores prompts: no output, prompt logprobs from
    logprob_start_len on, for every text of a batch."""
    texts = ["The sky is blue.", "Water is wet and cold."]
    out = httpx.post(server.url + "/generate", timeout=120, json={
        "text": texts, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
        "logprob_start_len": 2, "return_text_in_logprobs": True}).json()
    assert isinstance(out, list) and len(out) == 2
    for text, o in zip(texts, out):
        ids = default_tokenizer.encode(text)
        entries = o["meta_info"]["input_token_logprobs"]
        assert o["output_ids"] == [] and o["meta_info"]["completion_tokens"] == 0
        assert [e[1] for e in entries] == ids[2:]
        assert all(e[0] <= 0 for e in entries)
        assert "".join(e[2] for e in entries) == default_tokenizer.decode(ids[2:])
