"""The rules a prompt meets, written once for the engine and the server: at least one token,
every id an integer in [0, vocab_size) (the id scan), and the context-length rule: the prompt
is shorter than the context, and the prompt plus max_new_tokens fit in it.

Each sequence is checked once. The server's routes check each prompt here, in the client's
words (the field names it sent: messages, prompt, max_completion_tokens, ...), once its ids
are known, and then tell the engine so (AsyncEngine.validate(req, prompt_checked=True)); the
engine checks any other request (the offline Engine, a direct caller) itself, in its own words.
Either way a failure is a RequestError naming the field to change (param).
"""
from __future__ import annotations

from typing import Any, List, Optional

from radixserve.errors import RequestError


def max_prompt_tokens(context_len: int) -> int:
    """The most tokens a prompt may have: one position of the context stays for a new token."""
    return context_len - 1


def prompt_too_long(num_tokens: int, context_len: int, prompt_param: Optional[str] = None
                    ) -> RequestError:
    """The error for a prompt of num_tokens > max_prompt_tokens(context_len) tokens, naming
    prompt_param (the client's field) or, without it, the engine's input_ids."""
    if prompt_param is None:
        return RequestError(f"prompt has {num_tokens} tokens; the context length is "
                            f"{context_len}: shorten the prompt", param="input_ids")
    return RequestError(f"the prompt is {num_tokens} tokens long but the context length is "
                        f"{context_len}; shorten {prompt_param} to fewer than {context_len} "
                        f"tokens", param=prompt_param)


def first_bad_id(ids: List[Any], vocab_size: int) -> Optional[Any]:
    """The id scan: the first entry of ids that is not an integer in [0, vocab_size) (bools are
    not ids), or None. The common case runs in C-level passes (a 1k-token prompt: 0.10 ms
    against a Python loop's 0.16 ms, paid by every prompt before its first step); only a
    prompt that fails them is walked for its first bad id."""
    if ids and set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab_size:
        return None
    return next((t for t in ids if not isinstance(t, int) or isinstance(t, bool)
                 or not 0 <= t < vocab_size), None)


def check_prompt(ids: List[Any], vocab_size: int, context_len: int,
                 max_new_tokens: Optional[int], prompt_param: Optional[str] = None,
                 max_param: Optional[str] = None) -> None:
    """Raise RequestError unless `ids` is a prompt the model can continue: non-empty, within
    the context length (before its ids are walked), every id in the vocabulary, and room for
    max_new_tokens (None: whatever fits) after it. prompt_param / max_param: the fields the
    client named the prompt and max_new_tokens with (the server's routes); without them the
    messages are the engine's own (param input_ids / max_new_tokens)."""
    n = len(ids)
    if n == 0:
        if prompt_param is None:
            raise RequestError("the prompt is empty; send at least one token", param="input_ids")
        raise RequestError(f"{prompt_param} is empty after tokenization; send at least one token",
                           param=prompt_param)
    if n > max_prompt_tokens(context_len):
        raise prompt_too_long(n, context_len, prompt_param)
    bad = first_bad_id(ids, vocab_size)
    if bad is not None:
        if prompt_param is None:
            raise RequestError(f"token id {bad!r} is out of range: ids must be integers in "
                               f"[0, {vocab_size})", param="input_ids")
        raise RequestError(f"{prompt_param} contains token id {bad} outside the vocabulary "
                           f"[0, {vocab_size})", param=prompt_param)
    if max_new_tokens is not None and n + max_new_tokens > context_len:
        if prompt_param is None:
            raise RequestError(f"prompt has {n} tokens and max_new_tokens is {max_new_tokens}; "
                               f"together they exceed the context length {context_len}: lower "
                               f"max_new_tokens to at most {context_len - n}",
                               param="max_new_tokens")
        max_param = max_param or "max_new_tokens"
        raise RequestError(f"{max_param}={max_new_tokens} plus the {n}-token prompt exceeds the "
                           f"context length {context_len}; lower {max_param} to at most "
                           f"{context_len - n}", param=max_param)
