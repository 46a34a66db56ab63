"""The Responses API (/v1/responses) through the official `openai` client against the real
server and the default model: create streamed and not (the typed events in order, deltas
joining to the final text, usage), the responses.stream() helper, instructions, the
max_output_tokens cut (status incomplete), text.format json_schema (and responses.parse),
store + previous_response_id (the earlier exchange is the cached prefix of the next prompt,
which is exactly the chat prompt of the whole conversation), retrieve and delete, 404s, and a
400 naming each unsupported field."""
import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel

pytestmark = pytest.mark.slow

FRANCE = "What is the capital of France?"
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False}
OPENING = ["response.created", "response.in_progress", "response.output_item.added",
           "response.content_part.added"]
CLOSING = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)


def _check_usage(u, max_output=None):
    assert u.input_tokens > 0 and u.output_tokens > 0
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert 0 <= u.input_tokens_details.cached_tokens < u.input_tokens
    assert u.output_tokens_details.reasoning_tokens == 0
    if max_output is not None:
        assert u.output_tokens <= max_output


def test_create(oai, server):
    r = oai.responses.create(model=server.model, input=FRANCE, temperature=0, max_output_tokens=16)
    assert r.object == "response" and r.model == server.model and r.id.startswith("resp_")
    assert r.status in ("completed", "incomplete") and r.error is None
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.status == r.status
    assert [c.type for c in message.content] == ["output_text"]
    assert "Paris" in r.output_text
    _check_usage(r.usage, 16)
    # the same prompt as the chat route's: same tokens, same greedy text
    chat = oai.chat.completions.create(model=server.model, temperature=0, max_tokens=16,
                                       messages=[{"role": "user", "content": FRANCE}])
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.output_text == chat.choices[0].message.content


def test_stream_events_in_order(oai, server):
    kw = dict(model=server.model, input=FRANCE, temperature=0, max_output_tokens=12)
    full = oai.responses.create(**kw)
    events = list(oai.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    n_deltas = types.count("response.output_text.delta")
    final_type = "response.completed" if full.status == "completed" else "response.incomplete"
    assert n_deltas > 0
    assert types == OPENING + ["response.output_text.delta"] * n_deltas + CLOSING + [final_type]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == full.output_text == final.output_text == events[-4].text
    assert events[0].response.id == final.id and events[0].response.status == "in_progress"
    assert events[-2].item.content[0].text == text
    assert final.usage.output_tokens == full.usage.output_tokens
    assert final.usage.input_tokens == full.usage.input_tokens
    # the repeated prompt comes from the radix cache: all but its last token
    assert final.usage.input_tokens_details.cached_tokens == final.usage.input_tokens - 1
    _check_usage(final.usage, 12)
    assert oai.responses.retrieve(final.id).output_text == text          # stored when it ended


def test_stream_helper_accumulates_the_final_response(oai, server):
    with oai.responses.stream(model=server.model, input=FRANCE, temperature=0,
                              max_output_tokens=64) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "completed" and final.incomplete_details is None
    assert final.output_text == text and "Paris" in text


def test_instructions_are_a_system_message(oai, server):
    instructions = "You are a geography teacher. Answer in one short sentence."
    r = oai.responses.create(model=server.model, input=FRANCE, instructions=instructions,
                             temperature=0, max_output_tokens=24)
    chat = oai.chat.completions.create(model=server.model, temperature=0, max_tokens=24, messages=[
        {"role": "system", "content": instructions}, {"role": "user", "content": FRANCE}])
    assert r.instructions == instructions
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.output_text == chat.choices[0].message.content


def test_max_output_tokens_cuts_the_response(oai, server):
    kw = dict(model=server.model, input="Count from 1 to 100, separated by commas.",
              temperature=0, max_output_tokens=5)
    r = oai.responses.create(**kw)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.max_output_tokens == 5
    assert r.usage.output_tokens == 5
    events = list(oai.responses.create(stream=True, **kw))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.usage.output_tokens == 5


def test_text_format_json_schema(oai, server):
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    r = oai.responses.create(model=server.model, input="Describe a person as JSON.", temperature=0,
                             max_output_tokens=80, text={"format": fmt})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.text.format.type == "json_schema" and r.text.format.name == "person"
    events = list(oai.responses.create(model=server.model, input="Describe a person as JSON.",
                                       temperature=0.8, max_output_tokens=80, text={"format": fmt},
                                       stream=True))
    jsonschema.validate(json.loads(events[-1].response.output_text), PERSON)


def test_responses_parse_with_a_pydantic_model(oai, server):
    class City(BaseModel):
        name: str
        country: str

    r = oai.responses.parse(model=server.model, input="Name a city in Europe, as JSON.",
                            temperature=0, max_output_tokens=60, text_format=City)
    assert isinstance(r.output_parsed, City) and r.output_parsed.name


def test_previous_response_id_continues_from_the_cached_prefix(oai, server):
    first_input, second_input = "My name is Ada. Please remember it.", "What is my name?"
    first = oai.responses.create(model=server.model, input=first_input, temperature=0,
                                 max_output_tokens=24)
    second = oai.responses.create(model=server.model, input=second_input, temperature=0,
                                  max_output_tokens=24, previous_response_id=first.id)
    assert second.previous_response_id == first.id
    # the second prompt holds the first exchange, whose prompt comes from the radix cache
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    # exactly the chat prompt of the whole conversation
    chat = oai.chat.completions.create(model=server.model, temperature=0, max_tokens=24, messages=[
        {"role": "user", "content": first_input},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": second_input}])
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content
    # instructions belong to their request only; a streamed follow-up chains too
    third = list(oai.responses.create(model=server.model, input="Thanks!", temperature=0,
                                      max_output_tokens=8, previous_response_id=second.id,
                                      instructions="Be brief.", stream=True))[-1].response
    fourth = oai.responses.create(model=server.model, input="Bye.", temperature=0,
                                  max_output_tokens=4, previous_response_id=third.id)
    assert fourth.instructions is None and third.instructions == "Be brief."
    chat = oai.chat.completions.create(model=server.model, temperature=0, max_tokens=4, messages=[
        {"role": "user", "content": first_input}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": second_input}, {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "Thanks!"}, {"role": "assistant", "content": third.output_text},
        {"role": "user", "content": "Bye."}])
    assert fourth.usage.input_tokens == chat.usage.prompt_tokens
    assert fourth.usage.input_tokens_details.cached_tokens >= second.usage.input_tokens


def test_retrieve_delete_and_404s(oai, server):
    r = oai.responses.create(model=server.model, input="Say hi.", temperature=0, max_output_tokens=8,
                             metadata={"case": "retrieve"}, user="tester")
    got = oai.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.usage == r.usage
    assert got.metadata == {"case": "retrieve"} and got.user == "tester" and got.store is True
    assert oai.responses.delete(r.id) is None
    for call in (lambda: oai.responses.retrieve(r.id), lambda: oai.responses.delete(r.id)):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.param == "response_id"
    with pytest.raises(openai.NotFoundError) as e:
        oai.responses.create(model=server.model, input="x", previous_response_id=r.id)
    assert e.value.param == "previous_response_id"
    unstored = oai.responses.create(model=server.model, input="Say hi.", temperature=0,
                                    max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as e:
        oai.responses.create(model="not-this-model", input="x")
    assert e.value.param == "model"


def test_sglangs_penalty_and_bad_previous_id_expectations(oai, server):
    """SGLang's /v1/responses tests: frequency_penalty is accepted, usage also has
    prompt_tokens; a previous_response_id that is no response id is a 400 in OpenAI's shape."""
    r = oai.responses.create(model=server.model, input=FRANCE, temperature=0, max_output_tokens=4,
                             extra_body={"frequency_penalty": 1.0})
    assert r.object == "response" and r.output_text
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == \
        (r.usage.input_tokens, r.usage.output_tokens)
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=server.model, input="Hi", previous_response_id="bad")
    assert e.value.param == "previous_response_id" and e.value.body["type"] == "invalid_request_error"


@pytest.mark.parametrize("field, kwargs", [
    ("tools", {"tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]}),
    ("tool_choice", {"tool_choice": "required"}),
    ("reasoning", {"reasoning": {"effort": "low"}}),
    ("background", {"background": True}),
    ("include", {"include": ["message.output_text.logprobs"]}),
    ("truncation", {"truncation": "auto"}),
    ("top_logprobs", {"top_logprobs": 3}),
    ("conversation", {"conversation": "conv_123"}),
    ("prompt", {"prompt": {"id": "pmpt_123"}}),
    ("n", {"extra_body": {"n": 2}}),
    ("input[0].content[0].type", {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "https://example.com/cat.png"}]}]}),
    ("input[0].content[1].type", {"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "read this"}, {"type": "input_file", "file_id": "file_1"}]}]}),
    ("input[1].type", {"input": [{"role": "user", "content": "hi"},
                                 {"type": "function_call_output", "call_id": "c1", "output": "42"}]}),
])
def test_unsupported_is_a_400_naming_the_field(oai, server, field, kwargs):
    kwargs = {"input": "hi", **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=server.model, max_output_tokens=4, **kwargs)
    assert e.value.param == field and e.value.status_code == 400
    assert field.split("[")[0] in e.value.message
