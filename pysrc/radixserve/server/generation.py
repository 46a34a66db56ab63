"""Running a request's sequences on the engine (prompts x n expanded by engine/io.expand_requests,
which the offline Engine shares): validate them all before anything starts, and drive their
engine generators together.

Each sequence is validated once: the route checks its prompt (requests.check_prompt_ids) and
builds its SamplingParams verified (requests.sampling_params_from_dict); validate_all has the
engine validate the rest of each sequence (prompt_checked=True: the prompt is not walked again;
verified SamplingParams are not verified again); merge_generations then starts them with
validated=True, so the engine does not validate them a second time.

The one invariant every helper here keeps: when the consumer stops early (client gone, error,
cancellation), every engine generator started for the request is closed, which aborts its
sequence in the engine and frees its KV slots.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from typing import AsyncIterator, Dict, List, Optional, Sequence, Tuple

from starlette.types import Receive

from radixserve.engine.io import GenerateOutput, GenerateReqInput
from radixserve.engine.validation import max_prompt_tokens
from radixserve.errors import ApiError, EngineOverloaded, bad_request
from radixserve.server import requests as R
from radixserve.server.metrics import RequestMetrics
from radixserve.server.render import SeqResult
from radixserve.server.sse import wait_for_disconnect
from radixserve.tokenizer.tokenizer import TooManyTokens


OFF_LOOP_CHARS = 8192   # prompts this long or longer are tokenized on the encode pool

_ENCODE_POOLS: Dict[int, concurrent.futures.ThreadPoolExecutor] = {}


def _encode_pool(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    """The process's pool of `workers` threads that tokenize long prompts (one per size)."""
    pool = _ENCODE_POOLS.get(workers)
    if pool is None:
        pool = _ENCODE_POOLS[workers] = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="radixserve-encode")
    return pool


def max_prompt_chars(tokenizer, context_len: int) -> Optional[int]:
    """The most characters (not counting the tokenizer's silent ones) a prompt can have and
    still fit a context of `context_len` tokens, from the tokenizer's max_chars_per_token:
    a prompt must be shorter than context_len tokens, and k tokens cover at most
    k x max_chars_per_token characters. None when the tokenizer admits no such bound."""
    per_token = tokenizer.max_chars_per_token
    if not per_token:
        return None
    return max_prompt_tokens(context_len) * per_token


def check_prompt_chars(engine, text: str, param: str) -> None:
    """A 400 naming `param` when `text` has more characters than any prompt that fits the
    context (max_prompt_chars): refused before a token of it is computed."""
    limit = max_prompt_chars(engine.tokenizer, engine.context_len)
    if limit is None or len(text) <= limit:
        return
    counted = len(text) - _count_silent(text, engine.tokenizer.silent_chars)
    if counted > limit:
        raise bad_request(f"{param} is {counted} characters long, more than any prompt that "
                          f"fits the context length {engine.context_len} ({limit} characters: "
                          f"a token of this model covers at most "
                          f"{engine.tokenizer.max_chars_per_token}); shorten it", param=param)


def _count_silent(text: str, silent: frozenset) -> int:
    """How many of text's characters are silent ones (ASCII, as Tokenizer.silent_chars are):
    one pass over its UTF-8 bytes (an ASCII byte there is always that character), 2.5x faster
    than counting each character in turn."""
    if not silent:
        return 0
    raw = text.encode("utf-8", "surrogatepass")
    return len(raw) - len(raw.translate(None, "".join(silent).encode("ascii")))


async def encode_prompt(engine, text: str, param: str, add_special_tokens: bool = True,
                        must_fit: bool = True) -> List[int]:
    """`text`'s token ids, computed without stalling the event loop or any other request.

    With `must_fit` (the prompt is used whole: no truncate_prompt_tokens), a text too long to
    fit the context in any tokenization is a 400 before it is encoded (check_prompt_chars), and
    one with context_len tokens or more a 400 before its ids are listed (requests.
    prompt_too_long). A text shorter than OFF_LOOP_CHARS is encoded inline (a thread hop costs
    more); a longer one on the encode pool, --tokenizer-worker-num threads, so at most that
    many long encodes run at once and the others wait their turn; the tokenizer releases the
    GIL while it works (tokenizer.Tokenizer.encode), so the loop keeps running meanwhile."""
    tok = engine.tokenizer
    limit = None
    if must_fit:
        check_prompt_chars(engine, text, param)
        limit = max_prompt_tokens(engine.context_len)
    work = functools.partial(tok.encode, text, add_special_tokens=add_special_tokens,
                             max_tokens=limit)
    try:
        if len(text) < OFF_LOOP_CHARS:
            return work()
        workers = engine.server_args.tokenizer_worker_num
        return await asyncio.get_running_loop().run_in_executor(_encode_pool(workers), work)
    except TooManyTokens as e:
        raise R.prompt_too_long(e.count, engine.context_len, param) from None


# the request fields a grammar of each kind can come from, in the order they are looked for
GRAMMAR_FIELDS = {"json_schema": ("response_format", "guided_json", "json_schema", "structured_outputs"),
                  "regex": ("guided_regex", "guided_choice", "regex", "structured_outputs"),
                  "ebnf": ("guided_grammar", "ebnf", "structured_outputs"),
                  "structural_tag": ("tool_choice", "tools", "structural_tag", "structured_outputs")}


async def check_grammars(engine, reqs: Sequence[GenerateReqInput], body: Optional[dict] = None,
                         prefix: str = "", origin: Optional[str] = None) -> None:
    """Compile every distinct grammar of reqs now, before any byte of the response, so a bad
    one is a 400 (with the compiler's message) naming the field the client used. Compiling
    runs in the engine's grammar pool and is cached, so generate() finds it ready. origin: the
    kind the client's grammar had before the server wrapped it (a reasoning parser's structural
    tag), for naming the field."""
    grammars = getattr(engine, "grammars", None)
    keys = {r.sampling_params.grammar_key for r in reqs} - {None}
    if grammars is None or not keys:
        return
    for key in sorted(keys):
        try:
            await grammars.compile_async(key)
        except ValueError as e:
            kind = origin or key[0]
            fields = [f for f in GRAMMAR_FIELDS.get(kind, ()) if body and body.get(f) is not None]
            raise bad_request(str(e), param=prefix + (fields[0] if fields else kind)) from None


def validate_all(engine, reqs: Sequence[GenerateReqInput], prompt_checked: bool = True) -> None:
    """engine.validate on every sequence, once (its ValueError becomes a 400 naming the error's
    param); prompt_checked: the route checked every prompt with requests.check_prompt_ids, so
    the engine does not walk it again. Then a 400 when there are more sequences than the
    waiting queue ever holds (--max-queued-requests: a retry could never succeed); then room in
    the engine's waiting queue for all of them now (else a 503 with Retry-After; nothing
    started). The sequences then run with merge_generations / collect (validated=True)."""
    for req in reqs:
        try:
            engine.validate(req, prompt_checked=prompt_checked)
        except ValueError as e:
            raise bad_request(str(e), param=getattr(e, "param", None)) from None
    most = engine.server_args.max_queued_requests
    if len(reqs) > most:
        raise bad_request(f"this request runs {len(reqs)} sequences (prompts x n) but the server "
                          f"queues at most {most} (--max-queued-requests); send fewer prompts or "
                          f"a smaller n")
    check = getattr(engine, "check_capacity", None)
    if check is not None:
        try:
            check(len(reqs))
        except EngineOverloaded as e:
            raise ApiError(str(e), 503, headers={"Retry-After": str(e.retry_after_s)}) from None


async def merge_generations(engine, reqs: Sequence[GenerateReqInput],
                            metrics: Optional[RequestMetrics] = None, validated: bool = True
                            ) -> AsyncIterator[Tuple[int, GenerateOutput]]:
    """Yield (index into reqs, output) from all sequences, in the order the engine produces
    them. validated: reqs passed validate_all (the engine does not validate them again); with
    False the engine validates each as it starts it. A ValueError from the engine (a request it
    refuses) is raised as a 400 ApiError; any other engine exception propagates. However this
    generator ends, it closes every engine generator it opened (aborting the unfinished ones).
    With `metrics` (the app's RequestMetrics), every output is observed as it arrives (TTFT,
    inter-token latency, ...)."""
    trackers = metrics.track(reqs) if metrics is not None else None
    if len(reqs) == 1:
        agen = engine.generate(reqs[0], validated=validated)
        try:
            async for out in agen:
                if trackers is not None:
                    trackers[0].observe(out)
                yield 0, out
        except ValueError as e:
            raise bad_request(str(e)) from None
        finally:
            await agen.aclose()
            if trackers is not None:
                trackers[0].close()
        return

    queue: asyncio.Queue = asyncio.Queue()

    async def drive(i: int, req: GenerateReqInput) -> None:
        agen = engine.generate(req, validated=validated)
        try:
            async for out in agen:
                if trackers is not None:
                    trackers[i].observe(out)
                queue.put_nowait((i, out))
        except Exception as e:  # handed to the consumer, which raises it
            queue.put_nowait((i, e))
            return
        finally:
            await agen.aclose()
        queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(drive(i, r)) for i, r in enumerate(reqs)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, ValueError):
                raise bad_request(str(item))
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for tracker in trackers or ():
            tracker.close()


class ClientDisconnected(Exception):
    """The client went away before a non-streamed response was ready (its sequences aborted)."""


async def collect(engine, reqs: Sequence[GenerateReqInput], results: Sequence[SeqResult],
                  receive: Optional[Receive] = None,
                  metrics: Optional[RequestMetrics] = None, validated: bool = True) -> None:
    """Run every sequence to its end, feeding results[i] with sequence i's outputs. With
    `receive` (the request's ASGI receive, body already read), a client disconnect cancels the
    run (aborting the sequences) and raises ClientDisconnected. `metrics`, `validated`: as in
    merge_generations."""
    async def run() -> None:
        async for i, out in merge_generations(engine, reqs, metrics, validated):
            results[i].feed(out)

    if receive is None:
        await run()
        return
    run_task = asyncio.ensure_future(run())
    watch = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({run_task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (run_task, watch):
            t.cancel()
        await asyncio.gather(run_task, watch, return_exceptions=True)
    if run_task.cancelled():
        raise ClientDisconnected()
    run_task.result()
