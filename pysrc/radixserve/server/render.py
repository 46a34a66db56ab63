"""Response rendering: the engine's outputs -> OpenAI and native response bodies and chunks.

Contract. Everything here is a pure function of what the engine produced (GenerateOutputs,
accumulated per sequence in a SeqResult) and the request's output options (logprobs counts,
echo, server/requests.OutputExtras): it builds the JSON-ready dicts the routes send, never
touches the engine, the connection or the request body, and raises nothing a client causes.
It covers the OpenAI objects (chat.completion and chat.completion.chunk, text_completion,
the usage-only final chunk), their choices, usage, logprobs (OpenAI's chat and completions
shapes, vLLM's prompt_logprobs), finish reasons and matched stops, an engine abort as the
ApiError an OpenAI client receives (`abort_error`), and the native /generate result. SSE
framing of a chunk is server/sse.py's; parsing the request is server/requests.py's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

from radixserve.engine.io import GenerateOutput, LogprobEntry, apply_ids_delta
from radixserve.errors import ApiError
from radixserve.server.requests import OutputExtras

TokenText = Callable[[int], str]        # token id -> its text (for logprob entries without text)


# --------------------------------------------------------------------------- results

@dataclass
class SeqResult:
    """One generated sequence, accumulated from its GenerateOutputs."""
    index: int
    prompt_ids: List[int]
    text: str = ""
    output_ids: List[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: Optional[Dict[str, Any]] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    output_token_logprobs: List[LogprobEntry] = field(default_factory=list)
    output_top_logprobs: List[List[LogprobEntry]] = field(default_factory=list)
    input_token_logprobs: Optional[List[LogprobEntry]] = None
    input_top_logprobs: Optional[List[List[LogprobEntry]]] = None
    embedding: Optional[List[float]] = None          # a pooling request's (engine/pooling.py)
    label_logits: Optional[List[float]] = None

    def feed(self, out: GenerateOutput) -> None:
        self.text += out.text_delta
        apply_ids_delta(self.output_ids, out)        # a jump-forward may take ids back
        self.output_token_logprobs.extend(out.output_token_logprobs_delta)
        self.output_top_logprobs.extend(out.output_top_logprobs_delta)
        if out.input_token_logprobs is not None:
            self.input_token_logprobs = out.input_token_logprobs
        if out.input_top_logprobs is not None:
            self.input_top_logprobs = out.input_top_logprobs
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens or len(self.prompt_ids)
        self.completion_tokens = out.completion_tokens or len(self.output_ids)
        self.cached_tokens = out.cached_tokens or self.cached_tokens
        if out.embedding is not None:
            self.embedding = out.embedding
        if out.label_logits is not None:
            self.label_logits = out.label_logits
        if out.finished:
            self.finished = True
            self.finish_reason = out.finish_reason


def finish_reason_str(reason: Optional[Dict[str, Any]]) -> Optional[str]:
    """OpenAI's finish_reason: "stop" (EOS or a stop string/token) or "length". (The OpenAI
    routes turn an engine abort into an error, see `abort_error`; native routes pass it on.)"""
    return None if reason is None else reason.get("type")


def abort_error(reason: Optional[Dict[str, Any]]) -> Optional[ApiError]:
    """An engine abort ({"type": "abort", "message": ...}: the pool cannot hold the request,
    the server is shutting down, /abort_request) as the 503 an OpenAI client receives, or the
    abort's own "status_code" (400: the request's grammar left no valid continuation); None
    for any other finish."""
    if reason is None or reason.get("type") != "abort":
        return None
    message = reason.get("message") or "aborted"
    status = reason.get("status_code", 503)
    if status == 503:
        return ApiError(f"the request was aborted by the server: {message}", 503)
    return ApiError(f"the request failed: {message}", status)


def matched_stop(reason: Optional[Dict[str, Any]]) -> Any:
    return None if reason is None else reason.get("matched")


def usage_dict(results: Sequence[SeqResult], n: int,
               reasoning_tokens: Optional[int] = None) -> dict:
    """Usage over all sequences: each prompt counted once (n sequences share it), completions
    summed; cached_tokens is the most any sequence of a prompt reused. reasoning_tokens (with
    a reasoning parser): completion_tokens_details.reasoning_tokens."""
    prompt_tokens = cached = 0
    for start in range(0, len(results), n):
        group = results[start:start + n]
        prompt_tokens += group[0].prompt_tokens or len(group[0].prompt_ids)
        cached += max(r.cached_tokens for r in group)
    completion = sum(r.completion_tokens for r in results)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
             "total_tokens": prompt_tokens + completion,
             "prompt_tokens_details": {"cached_tokens": cached}}
    if reasoning_tokens is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return usage


def _entry_text(entry: LogprobEntry, token_text: TokenText) -> str:
    return entry[2] if entry[2] is not None else token_text(entry[1])


def chat_logprobs(entries: Sequence[LogprobEntry], tops: Sequence[Sequence[LogprobEntry]],
                  num_top: int, token_text: TokenText) -> dict:
    """choices[].logprobs for chat: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    content = []
    for i, entry in enumerate(entries):
        text = _entry_text(entry, token_text)
        top = list(tops[i])[:num_top] if i < len(tops) and tops[i] else []
        content.append({
            "token": text, "logprob": entry[0], "bytes": list(text.encode("utf-8")),
            "top_logprobs": [{"token": (t := _entry_text(e, token_text)), "logprob": e[0],
                              "bytes": list(t.encode("utf-8"))} for e in top],
        })
    return {"content": content}


def completion_logprobs(entries: Sequence[LogprobEntry], tops: Sequence[Optional[Sequence[LogprobEntry]]],
                        num_top: int, token_text: TokenText, text_offset: int = 0) -> dict:
    """choices[].logprobs for completions: {tokens, token_logprobs, top_logprobs, text_offset}.
    text_offset counts characters from `text_offset` (the start of this piece within the
    choice's text). Each top_logprobs entry holds the `num_top` most likely tokens and, as
    OpenAI's API and vLLM do, the token itself (so up to num_top + 1 entries; with logprobs 0
    just the token), most likely first. An entry whose logprob is None (the first prompt token
    under echo) gets a None top_logprobs entry too."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = text_offset
    for i, entry in enumerate(entries):
        text = _entry_text(entry, token_text)
        tokens.append(text)
        token_logprobs.append(entry[0])
        offsets.append(offset)
        offset += len(text)
        if entry[0] is None:
            top_logprobs.append(None)
            continue
        top = {text: entry[0]}
        for e in list(tops[i] if i < len(tops) and tops[i] else [])[:num_top]:
            top.setdefault(_entry_text(e, token_text), e[0])
        top_logprobs.append(dict(sorted(top.items(), key=lambda kv: -kv[1])))
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def prompt_logprob_entries(result: SeqResult) -> tuple:
    """The prompt's (entries, tops) with one entry per prompt token, the first one's logprob
    None (nothing precedes it), whether or not the engine reported that first position."""
    entries = list(result.input_token_logprobs or [])
    tops = list(result.input_top_logprobs or [])
    missing = len(result.prompt_ids) - len(entries)
    if missing > 0:
        entries = [(None, t, None) for t in result.prompt_ids[:missing]] + entries
        tops = [None] * missing + tops
    tops += [None] * (len(entries) - len(tops))
    return entries, tops


MIN_LOGPROB = -9999.0      # what vLLM (and OpenAI) send for -inf, which JSON cannot carry


def _vllm_logprob(logprob: float, rank: Optional[int], text: str) -> dict:
    return {"logprob": max(logprob, MIN_LOGPROB), "rank": rank, "decoded_token": text}


def vllm_prompt_logprobs(result: SeqResult, num_top: int,
                         token_text: TokenText) -> List[Optional[Dict[str, dict]]]:
    """vLLM's prompt_logprobs: one entry per prompt token, None for the first (nothing
    precedes it), else {str(token id): {logprob, rank, decoded_token}} holding the prompt token
    itself and the `num_top` most likely tokens at that position (rank: 1 for the most likely;
    the prompt token's rank is known when it is among those num_top, else null)."""
    entries, tops = prompt_logprob_entries(result)
    out: List[Optional[Dict[str, dict]]] = []
    for entry, top in zip(entries, tops):
        if entry[0] is None:
            out.append(None)
            continue
        top = list(top or [])[:num_top]
        ranks = {e[1]: k + 1 for k, e in enumerate(top)}
        row = {str(entry[1]): _vllm_logprob(entry[0], ranks.get(entry[1]), _entry_text(entry, token_text))}
        for k, e in enumerate(top):
            row.setdefault(str(e[1]), _vllm_logprob(e[0], k + 1, _entry_text(e, token_text)))
        out.append(row)
    return out


def seq_usage(r: SeqResult) -> dict:
    """One sequence's usage so far (stream_options.continuous_usage_stats, as vLLM: its prompt's
    tokens and its own completion tokens)."""
    prompt = r.prompt_tokens or len(r.prompt_ids)
    return {"prompt_tokens": prompt, "completion_tokens": r.completion_tokens,
            "total_tokens": prompt + r.completion_tokens}


def chat_response(rid: str, created: int, model: str, results: Sequence[SeqResult], n: int,
                  logprobs: bool, top_logprobs: int, token_text: TokenText,
                  extras: Optional[OutputExtras] = None) -> dict:
    """A chat.completion. With vLLM's extras, as vLLM: prompt_logprobs and prompt_token_ids on
    the response (one prompt), token_ids on each choice."""
    extras = extras or OutputExtras()
    choices = []
    for r in results:
        choice = {"index": r.index, "message": {"role": "assistant", "content": r.text},
                  "logprobs": None, "finish_reason": finish_reason_str(r.finish_reason),
                  "matched_stop": matched_stop(r.finish_reason)}
        if logprobs:
            choice["logprobs"] = chat_logprobs(r.output_token_logprobs, r.output_top_logprobs,
                                               top_logprobs, token_text)
        if extras.return_token_ids:
            choice["token_ids"] = list(r.output_ids)
        choices.append(choice)
    response = {"id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": choices, "usage": usage_dict(results, n)}
    if extras.wants_prompt_logprobs and results:
        response["prompt_logprobs"] = vllm_prompt_logprobs(results[0], extras.prompt_logprobs,
                                                           token_text)
    if extras.return_token_ids and results:
        response["prompt_token_ids"] = list(results[0].prompt_ids)
    return response


def chat_chunk(rid: str, created: int, model: str, index: int, delta: dict,
               finish_reason: Optional[str] = None, logprobs: Optional[dict] = None,
               usage_null: bool = False, extra: Optional[dict] = None,
               usage: Optional[dict] = None, chunk_extra: Optional[dict] = None) -> dict:
    """One chat.completion.chunk: `extra` goes into the choice, `chunk_extra` (vLLM's
    prompt_token_ids) into the chunk; `usage` (continuous usage) or null with usage_null."""
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    if extra:
        choice.update(extra)
    chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": [choice]}
    if chunk_extra:
        chunk.update(chunk_extra)
    if usage is not None or usage_null:
        chunk["usage"] = usage
    return chunk


def usage_chunk(rid: str, obj: str, created: int, model: str, usage: dict) -> dict:
    """The final chunk of a stream with include_usage: no choices, the whole request's usage."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage}


def completion_choice(r: SeqResult, echo_text: str, logprobs: Optional[int],
                      token_text: TokenText, echo: Optional[bool] = None,
                      extras: Optional[OutputExtras] = None) -> dict:
    """One completion choice. With echo (default: echo_text is not empty) the prompt's text
    and, with logprobs, its logprobs come first. vLLM's extras, as vLLM: prompt_logprobs,
    prompt_token_ids and token_ids on the choice."""
    echo = bool(echo_text) if echo is None else echo
    extras = extras or OutputExtras()
    choice = {"index": r.index, "text": echo_text + r.text, "logprobs": None,
              "finish_reason": finish_reason_str(r.finish_reason),
              "matched_stop": matched_stop(r.finish_reason)}
    if logprobs is not None:
        entries, tops = [], []
        if echo:
            entries, tops = prompt_logprob_entries(r)
        entries += list(r.output_token_logprobs)
        tops += list(r.output_top_logprobs)
        choice["logprobs"] = completion_logprobs(entries, tops, logprobs, token_text)
    if extras.wants_prompt_logprobs:
        choice["prompt_logprobs"] = vllm_prompt_logprobs(r, extras.prompt_logprobs, token_text)
    if extras.return_token_ids:
        choice["prompt_token_ids"] = list(r.prompt_ids)
        choice["token_ids"] = list(r.output_ids)
    return choice


def completion_response(rid: str, created: int, model: str, choices: List[dict],
                        results: Sequence[SeqResult], n: int) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage_dict(results, n)}


def completion_chunk(rid: str, created: int, model: str, index: int, text: str,
                     finish_reason: Optional[str] = None, logprobs: Optional[dict] = None,
                     usage_null: bool = False, extra: Optional[dict] = None,
                     usage: Optional[dict] = None) -> dict:
    """One streamed text_completion: `extra` goes into the choice; `usage` (continuous usage)
    or null with usage_null."""
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if extra:
        choice.update(extra)
    chunk = {"id": rid, "object": "text_completion", "created": created, "model": model,
             "choices": [choice]}
    if usage is not None or usage_null:
        chunk["usage"] = usage
    return chunk


def native_result(r: SeqResult, rid: str, return_logprob: bool) -> dict:
    """A /generate result: {"text", "output_ids", "meta_info": {...}} (text and ids cumulative).
    "output_ids" is r's own list, not a copy (a streamed chunk's ids are as many as the tokens so
    far): serialize the result before r is fed again."""
    meta = {"id": rid, "prompt_tokens": r.prompt_tokens or len(r.prompt_ids),
            "completion_tokens": r.completion_tokens, "cached_tokens": r.cached_tokens,
            "finish_reason": r.finish_reason}
    if return_logprob:
        meta["input_token_logprobs"] = [list(e) for e in (r.input_token_logprobs or [])]
        meta["output_token_logprobs"] = [list(e) for e in r.output_token_logprobs]
        meta["input_top_logprobs"] = [None if t is None else [list(e) for e in t]
                                      for t in (r.input_top_logprobs or [])]
        meta["output_top_logprobs"] = [[list(e) for e in t] for t in r.output_top_logprobs]
    return {"text": r.text, "output_ids": r.output_ids, "meta_info": meta}
