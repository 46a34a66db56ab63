"""Response builders of radixserve.server.render, and the SSE framing of what they build."""
import json

from radixserve.engine.io import GenerateOutput
from radixserve.server import render as O
from radixserve.server.sse import DONE_EVENT, encode_event


# --------------------------------------------------------------------------- builders

def _out(text, ids, finished=False, reason=None, lps=(), tops=(), **kw):
    return GenerateOutput(rid="r", text_delta=text, output_ids_delta=list(ids), finished=finished,
                          finish_reason=reason, output_token_logprobs_delta=list(lps),
                          output_top_logprobs_delta=list(tops), **kw)


def test_seq_result_and_usage():
    a, b = O.SeqResult(0, [1, 2, 3]), O.SeqResult(1, [1, 2, 3])
    a.feed(_out("He", [5], prompt_tokens=3, completion_tokens=1, cached_tokens=0))
    a.feed(_out("llo", [6], True, {"type": "stop", "matched": "!"}, prompt_tokens=3,
                completion_tokens=2, cached_tokens=0))
    b.feed(_out("X", [7], True, {"type": "length", "matched": None}, prompt_tokens=3,
                completion_tokens=1, cached_tokens=2))
    assert a.text == "Hello" and a.output_ids == [5, 6] and a.finished
    assert O.finish_reason_str(a.finish_reason) == "stop" and O.matched_stop(a.finish_reason) == "!"
    assert O.usage_dict([a, b], n=2) == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                                         "prompt_tokens_details": {"cached_tokens": 2}}
    assert O.usage_dict([a, b], n=1)["prompt_tokens"] == 6


def test_chat_logprobs_shape():
    lp = O.chat_logprobs([(-0.5, 7, "é")], [[(-0.5, 7, "é"), (-1.5, 8, None)]], 2,
                         token_text=lambda i: f"<{i}>")
    assert lp == {"content": [{"token": "é", "logprob": -0.5, "bytes": [195, 169], "top_logprobs": [
        {"token": "é", "logprob": -0.5, "bytes": [195, 169]},
        {"token": "<8>", "logprob": -1.5, "bytes": list(b"<8>")}]}]}


def test_completion_logprobs_with_echo():
    r = O.SeqResult(0, [1, 2])
    r.feed(_out("c", [3], True, {"type": "length"}, lps=[(-0.1, 3, "c")], tops=[[(-0.1, 3, "c")]],
                input_token_logprobs=[(-2.0, 2, "b")], input_top_logprobs=[[(-2.0, 2, "b")]]))
    choice = O.completion_choice(r, "ab", 1, token_text=lambda i: "ab"[i - 1])
    assert choice["text"] == "abc" and choice["finish_reason"] == "length"
    assert choice["logprobs"] == {"tokens": ["a", "b", "c"], "token_logprobs": [None, -2.0, -0.1],
                                  "top_logprobs": [None, {"b": -2.0}, {"c": -0.1}],
                                  "text_offset": [0, 1, 2]}


def test_native_result_shape():
    r = O.SeqResult(0, [1, 2])
    r.feed(_out("hi", [4, 5], True, {"type": "length", "matched": None}, lps=[(-1.0, 4, None)],
                tops=[[(-1.0, 4, None)]], prompt_tokens=2, completion_tokens=2, cached_tokens=1,
                input_token_logprobs=[(None, 1, None), (-3.0, 2, None)]))
    res = O.native_result(r, "rid1", return_logprob=True)
    assert res["text"] == "hi" and res["output_ids"] == [4, 5]
    m = res["meta_info"]
    assert (m["id"], m["prompt_tokens"], m["completion_tokens"], m["cached_tokens"]) == ("rid1", 2, 2, 1)
    assert m["finish_reason"] == {"type": "length", "matched": None}
    assert m["input_token_logprobs"] == [[None, 1, None], [-3.0, 2, None]]
    assert m["output_token_logprobs"] == [[-1.0, 4, None]]
    assert m["output_top_logprobs"] == [[[-1.0, 4, None]]]
    assert "input_token_logprobs" not in O.native_result(r, "rid1", False)["meta_info"]


def test_chunks_and_usage_chunk():
    c = O.chat_chunk("id", 1, "m", 2, {"content": "x"}, "stop", usage_null=True)
    assert c == {"id": "id", "object": "chat.completion.chunk", "created": 1, "model": "m",
                 "choices": [{"index": 2, "delta": {"content": "x"}, "logprobs": None,
                              "finish_reason": "stop"}], "usage": None}
    u = O.usage_chunk("id", "text_completion", 1, "m", {"prompt_tokens": 1})
    assert u["choices"] == [] and u["usage"] == {"prompt_tokens": 1}
    c = O.completion_chunk("id", 1, "m", 0, "t")
    assert c["object"] == "text_completion" and c["choices"][0]["text"] == "t" and "usage" not in c


# --------------------------------------------------------------------------- SSE framing

def test_sse_framing_byte_exact():
    assert encode_event({"a": 1, "b": "é"}) == 'data: {"a":1,"b":"é"}\n\n'.encode("utf-8")
    assert DONE_EVENT == b"data: [DONE]\n\n"
    payload = encode_event({"x": "line1\nline2"})
    assert payload.count(b"\n") == 2          # newlines inside strings are escaped by JSON
    assert json.loads(payload[len(b"data: "):-2]) == {"x": "line1\nline2"}
