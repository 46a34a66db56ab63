"""Engine: the offline API. `radixserve.Engine(model_path=None, **server_arg_overrides)`.

    engine = Engine(max_total_tokens=8192)
    out = engine.generate("Hello", {"max_new_tokens": 16, "temperature": 0})
    out["text"], out["output_ids"], out["meta_info"]["finish_reason"]
    engine.shutdown()

The Engine owns a background thread running its own (uv)loop with an AsyncEngine in it, so the
synchronous generate() works from plain code and async_generate() works from inside a caller's
own running loop (the work is handed over to the engine's loop and awaited from the caller's).

Layers (tests/unit/test_import_layers.py): the offline Engine sits above the engine and above
the server, whose native path (server/native_api.py: prepare / run / chunks) native() shares;
nothing below imports it. generate() expands prompts x n with engine/io.expand_requests, the
function the HTTP routes use.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import uuid
from typing import Any, Dict, Iterator, List, Optional, Union

from radixserve.config import ServerArgs
from radixserve.engine import validation
from radixserve.engine.async_engine import AsyncEngine
from radixserve.engine.io import GenerateReqInput, apply_ids_delta, expand_requests
from radixserve.errors import ApiError, RequestError
from radixserve.sampling.params import SamplingParams

Prompt = Union[str, List[str], None]
InputIds = Union[List[int], List[List[int]], None]


RUN_ALL_BATCH = 16


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


class Engine:
    def __init__(self, model_path: Optional[str] = None, **server_arg_overrides: Any):
        """Blocking: loads the model. Unknown keyword arguments raise TypeError (ServerArgs).
        Offline generation has no stream waiting on its next token, so step_order defaults to
        prefill-first here (the largest decode batches); pass step_order="alternate" for the
        server's order."""
        self._closed = True
        server_arg_overrides.setdefault("step_order", "prefill-first")
        self.server_args = ServerArgs(model_path=model_path, **server_arg_overrides)
        if self.server_args.dp_size != 1:
            raise ValueError(f"dp_size={self.server_args.dp_size}: data parallelism is a server "
                             f"of replicas behind the gateway (`radixserve serve --dp-size N`); "
                             f"the offline Engine is one engine in this process")
        self.async_engine = AsyncEngine(self.server_args)
        self.tokenizer = self.async_engine.tokenizer
        self._loop = _new_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="radixserve-engine",
                                        daemon=True)
        self._thread.start()
        self._closed = False
        self._submit(self._start()).result()

    async def _start(self) -> None:
        self.async_engine.start()

    def _submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    # ------------------------------------------------------------------ generation
    def _requests(self, prompt: Prompt, sampling_params: Optional[Dict[str, Any]],
                  input_ids: InputIds, priority: Optional[int] = None):
        """The validated sequences of a call (prompts x n, expanded as the HTTP routes expand
        them) and whether its answer is one dict (a single prompt with n == 1) or a list.
        priority: an int (not a bool) or None, every sequence's, checked here once."""
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt or input_ids")
        if priority is not None and (not isinstance(priority, int) or isinstance(priority, bool)):
            raise RequestError(f"priority must be an integer, got {priority!r}", param="priority")
        if prompt is not None:
            single = isinstance(prompt, str)
            prompts = [prompt] if single else list(prompt)
            if not all(isinstance(p, str) for p in prompts):
                raise ValueError("prompt must be a string or a list of strings")
            ids_list = [self.tokenizer.encode(p) for p in prompts]
        else:
            single = len(input_ids) == 0 or isinstance(input_ids[0], int)
            ids_list = [list(input_ids)] if single else [list(x) for x in input_ids]
        sp = SamplingParams.from_dict(sampling_params)          # verified, once
        ae = self.async_engine
        for ids in ids_list:            # each prompt once, not once per sample
            validation.check_prompt(ids, ae.model_config.vocab_size, ae.context_len,
                                    sp.max_new_tokens)
        reqs = expand_requests(uuid.uuid4().hex, ids_list, sp.n, [sp] * len(ids_list),
                               priority=priority)
        for r in reqs:
            ae.validate(r, prompt_checked=True)
        return reqs, single and sp.n == 1

    async def _run_one(self, req: GenerateReqInput) -> Dict[str, Any]:
        text, ids, last = [], [], None
        async for out in self.async_engine.generate(req, validated=True):   # by _requests
            text.append(out.text_delta)
            apply_ids_delta(ids, out)
            last = out
        return {"text": "".join(text), "output_ids": ids,
                "meta_info": {"id": req.rid, "prompt_tokens": last.prompt_tokens,
                              "completion_tokens": last.completion_tokens,
                              "cached_tokens": last.cached_tokens,
                              "finish_reason": last.finish_reason}}

    async def _run_all(self, reqs: List[GenerateReqInput]) -> List[Dict[str, Any]]:
        # requests go in RUN_ALL_BATCH at a time with a yield to the loop between, so the
        # scheduler launches the first step while the rest are still being added (256 offline
        # prompts of 1k tokens take tens of ms to add, which the GPU would otherwise wait out)
        tasks = []
        for i, r in enumerate(reqs):
            tasks.append(asyncio.ensure_future(self._run_one(r)))
            if i % RUN_ALL_BATCH == RUN_ALL_BATCH - 1:
                await asyncio.sleep(0)
        return list(await asyncio.gather(*tasks))

    def generate(self, prompt: Prompt = None, sampling_params: Optional[Dict[str, Any]] = None,
                 input_ids: InputIds = None, priority: Optional[int] = None):
        """One prompt (str / list[int]) -> a dict; a list of them -> a list of dicts, in order.
        With n > 1 in sampling_params every prompt gives n samples, so the answer is a list
        (prompt p's sample j at p * n + j; a seed s gives sample j the seed s + j), as /generate
        answers. Each dict: {"text", "output_ids", "meta_info": {id, prompt_tokens,
        completion_tokens, cached_tokens, finish_reason}}. priority: the request's, with
        --enable-priority-scheduling (as the HTTP field). Bad input raises ValueError."""
        reqs, single = self._requests(prompt, sampling_params, input_ids, priority)
        results = self._submit(self._run_all(reqs)).result()
        return results[0] if single else results

    async def async_generate(self, prompt: Prompt = None,
                             sampling_params: Optional[Dict[str, Any]] = None,
                             input_ids: InputIds = None, priority: Optional[int] = None):
        """The async twin of generate(), to await from the caller's own event loop."""
        reqs, single = self._requests(prompt, sampling_params, input_ids, priority)
        results = await asyncio.wrap_future(self._submit(self._run_all(reqs)))
        return results[0] if single else results

    # ------------------------------------------------------------------ embeddings, rerank
    def embed(self, input: Union[str, List[str], List[int], List[List[int]]],
              dimensions: Optional[int] = None) -> Union[List[float], List[List[float]]]:
        """With is_embedding=True: the embedding of one input (a string or a token-id list) as
        a list of floats, or of a list of them as a list of those, in order: pooled as
        pooling_method says, truncated to `dimensions`, L2-normalised (what /v1/embeddings
        returns; server/embeddings_api.py). Bad input raises ValueError."""
        return self._submit(self._embed(input, dimensions)).result()

    def rerank(self, query: str, documents: List[str], top_n: Optional[int] = None,
               instruction: Optional[str] = None, return_documents: bool = True
               ) -> List[Dict[str, Any]]:
        """With is_embedding=True: the documents by relevance to query, best first, as
        /v1/rerank's results ({"index", "relevance_score", "document": {"text"}}); top_n: the
        best N only; instruction: the qwen3 rerank template's task line. Bad input raises
        ValueError."""
        return self._submit(self._rerank(query, documents, top_n, instruction,
                                         return_documents)).result()

    async def _embed(self, input, dimensions):
        from radixserve.server import embeddings_api as E
        engine = self.async_engine
        single = isinstance(input, str) or (isinstance(input, list) and bool(input)
                                            and isinstance(input[0], int))
        inputs = [input] if single else list(input)
        try:
            E.require_embedding(engine, "embed()")
            if not inputs:
                raise ApiError("input is empty; send at least one input", 400, "input")
            ids = await E.prompt_ids_of(engine, inputs, "input", single)
            results = await E.embed_prompts(engine, ids, dimensions)
        except ApiError as e:
            if e.status != 400:
                raise
            raise ValueError(e.message) from None
        vectors = [r.embedding for r in results]
        return vectors[0] if single else vectors

    async def _rerank(self, query, documents, top_n, instruction, return_documents):
        from radixserve.server import embeddings_api as E
        from radixserve.server import requests as R
        engine = self.async_engine
        try:
            E.require_embedding(engine, "rerank()")
            E.rerank_labels(engine)
            if not isinstance(query, str) or not query:
                raise ApiError("query must be a non-empty string", 400, "query")
            docs = list(documents)
            if not docs or not all(isinstance(d, str) and d for d in docs):
                raise ApiError("documents must be a non-empty list of non-empty strings", 400,
                               "documents")
            ids = E.rerank_prompt_ids(engine, query, docs, instruction)
            for k, p in enumerate(ids):
                R.check_prompt_ids(p, engine.model_config.vocab_size, engine.context_len, 0,
                                   f"documents[{k}]", f"documents[{k}]")
            scores = await E.rerank_scores(engine, ids)
        except ApiError as e:
            if e.status != 400:
                raise
            raise ValueError(e.message) from None
        return E.ranked(scores, docs, top_n, return_documents)

    # ------------------------------------------------------------------ the native API in-process
    def native(self, path: str, body: Optional[Dict[str, Any]] = None) -> Any:
        """The answer the server's native route `path` gives `body` (None for a GET), without
        HTTP: /generate (not streamed), /get_model_info, /get_server_info, /flush_cache. A
        request the server would refuse raises radixserve.errors.ApiError (its
        .status and .message are the HTTP error's)."""
        return self._submit(self._native(path, body)).result()

    def native_stream(self, path: str, body: Dict[str, Any]) -> Iterator[Dict[str, Any]]:
        """The chunks of a streamed /generate (cumulative text, as the SSE events carry), as a
        blocking iterator; closing it early aborts the request's sequences."""
        from radixserve.server import native_api
        if path != "/generate":
            raise ApiError(f"no streamed route {path}; only /generate streams", 404)
        chunks: "queue.Queue" = queue.Queue()
        end = object()

        async def pump():
            try:
                job = await native_api.prepare_generate(self.async_engine, {**body, "stream": True})
                async for chunk in native_api.generate_chunks(self.async_engine, job):
                    chunks.put(chunk)
                chunks.put(end)
            except BaseException as e:     # noqa: BLE001 - handed to the consuming thread
                chunks.put(e)

        task = self._submit(pump())
        try:
            while True:
                item = chunks.get()
                if item is end:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            task.cancel()

    async def _native(self, path: str, body: Optional[Dict[str, Any]]) -> Any:
        from radixserve.server import native_api
        engine = self.async_engine
        if path == "/generate" and body is not None:
            job = await native_api.prepare_generate(engine, body)
            if job.stream:
                raise ApiError("use native_stream for a streamed /generate", 400, "stream")
            return await native_api.run_generate(engine, job)
        if path == "/get_model_info":
            return native_api.model_info(engine)
        if path == "/get_server_info":
            return engine.server_info()
        if path == "/flush_cache":
            if not await engine.flush_cache():
                raise ApiError("cannot flush the cache while requests are running", 400)
            return "Cache flushed.\n"
        raise ApiError(f"no route {path}", 404)

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._submit(self.async_engine.shutdown()).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
