"""Backends: where a program's generations run. Both speak radixserve's native /generate API
(SGLang's), so one Backend class builds every request and only the transport differs:

    RuntimeEndpoint(url, api_key=None)   HTTP to a running server (radixserve or SGLang)
    EngineBackend(engine=None, **kw)     a radixserve.Engine in this process; no HTTP

What a program needs from a backend:
    generate(text, params)          -> (text or [texts] for n > 1, meta_info or [meta_infos])
    generate_stream(text, params)   -> iterator of (text delta, meta_info)
    cache_prefix(text)              -> meta_info: prefill `text` so later prompts reuse its KV
    select(text, choices, method)   -> choices.Decision, from one batched scoring request
    role_format                     -> tokenizer/roles.RoleFormat of the served chat template

A request the server refuses, or a transport failure, raises BackendError, which names the
route, the request id and the server's message.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid
from typing import Any, Dict, Iterator, List, Optional, Tuple

from radixserve.lang.choices import ChoicesMethod, Decision, token_length_normalized
from radixserve.lang.ir import SamplingParams
from radixserve.tokenizer.roles import RoleFormat, role_format_for


class BackendError(RuntimeError):
    """A request of a program failed: `route`, `rid` (the request id sent), `status` (HTTP
    status, or None for a transport failure) and the server's `message`."""

    def __init__(self, route: str, rid: Optional[str], status: Optional[int], message: str):
        self.route, self.rid, self.status, self.message = route, rid, status, message
        where = f"request {rid} ({route})" if rid else route
        code = f"HTTP {status}" if status is not None else "no answer"
        super().__init__(f"{where} failed with {code}: {message}")


def _new_rid() -> str:
    return "lang-" + uuid.uuid4().hex


def _rids(body: dict) -> Any:
    """The rid field for body: one id, or one per prompt of a batch."""
    text = body.get("text", body.get("input_ids"))
    batch = isinstance(text, list) and (not text or not isinstance(text[0], int))
    return [_new_rid() for _ in text] if batch else _new_rid()


class Backend:
    """The request logic over a transport. Subclasses implement _get, _post and _stream; each
    raises BackendError for a failed request."""

    chat_template_name: Optional[str] = None

    def __init__(self):
        self._model_info: Optional[dict] = None
        self._roles: Optional[RoleFormat] = None

    # ---------------------------------------------------------------- transport
    def _get(self, path: str) -> Any:
        raise NotImplementedError

    def _post(self, path: str, body: dict) -> Any:
        raise NotImplementedError

    def _stream(self, path: str, body: dict) -> Iterator[dict]:
        raise NotImplementedError

    def _generate(self, body: dict) -> Any:
        body.setdefault("rid", _rids(body))
        return self._post("/generate", body)

    # ---------------------------------------------------------------- info
    @property
    def model_info(self) -> dict:
        if self._model_info is None:
            self._model_info = self._get("/get_model_info")
        return self._model_info

    @property
    def role_format(self) -> RoleFormat:
        if self._roles is None:
            self._roles = role_format_for(self.model_info, self.chat_template_name)
        return self._roles

    def get_server_info(self) -> dict:
        return self._get("/get_server_info")

    def flush_cache(self) -> None:
        self._post("/flush_cache", {})

    # ---------------------------------------------------------------- generation
    @staticmethod
    def _body(text: str, params: SamplingParams) -> dict:
        sp, top = params.native()
        return {"text": text, "sampling_params": sp, **top}

    def generate(self, text: str, params: SamplingParams) -> Tuple[Any, Any]:
        """One generation after `text`: (its text, its meta_info); lists of both when n > 1."""
        out = self._generate(self._body(text, params))
        if isinstance(out, list):
            return [o["text"] for o in out], [o["meta_info"] for o in out]
        return out["text"], out["meta_info"]

    def generate_stream(self, text: str, params: SamplingParams
                        ) -> Iterator[Tuple[str, dict]]:
        """(text delta, meta_info so far) as the generation after `text` streams (n must be 1)."""
        if (params.n or 1) != 1:
            raise ValueError("a streamed gen must have n=1")
        body = self._body(text, params)
        body.update(stream=True, rid=_new_rid())
        seen = 0
        for chunk in self._stream("/generate", body):
            delta = chunk["text"][seen:]
            seen = len(chunk["text"])
            yield delta, chunk["meta_info"]

    def cache_prefix(self, text: str) -> dict:
        """Prefill `text` (no new token) so that prompts starting with it reuse its KV; its
        meta_info (prompt_tokens, cached_tokens)."""
        return self._generate({"text": text, "sampling_params": {"max_new_tokens": 0}})["meta_info"]

    def score(self, texts: List[str], logprob_start_len: int) -> List[List[List[Any]]]:
        """input_token_logprobs ([logprob, token_id, token_text] from logprob_start_len on) of
        each text, in one batched request with no new tokens."""
        out = self._generate({"text": list(texts),
                              "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                              "return_logprob": True, "return_text_in_logprobs": True,
                              "logprob_start_len": logprob_start_len})
        return [o["meta_info"]["input_token_logprobs"] for o in out]

    def score_ids(self, ids: List[List[int]]) -> List[List[List[Any]]]:
        """input_token_logprobs of each token-id sequence scored on its own (from position 0)."""
        out = self._generate({"input_ids": [list(x) for x in ids],
                              "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                              "return_logprob": True, "logprob_start_len": 0})
        return [o["meta_info"]["input_token_logprobs"] for o in out]

    def select(self, text: str, choices: List[str],
               method: Optional[ChoicesMethod] = None) -> Decision:
        """The choice to append after `text`. Two requests: `text` is prefilled once, then all
        choices are scored in one batch whose prompts reuse that KV. A choice's tokens are
        those after text's last token position, plus that position itself when its token is
        not text's own ending (the choice merged into text's last token)."""
        method = method or token_length_normalized
        if not choices:
            raise ValueError("select needs at least one choice")
        last = max(self.cache_prefix(text)["prompt_tokens"] - 1, 0)
        scored = self.score([text + c for c in choices], last)
        per_choice = [entries[1:] if len(entries) > 1 and last > 0 and entries[0][2]
                      and text.endswith(entries[0][2]) else entries for entries in scored]
        unconditional = None
        if method.needs_unconditional:
            unconditional = self.score_ids([[e[1] for e in entries] for entries in per_choice])
        return method(list(choices), per_choice, unconditional)


class RuntimeEndpoint(Backend):
    """A running server at base_url (radixserve, or SGLang: the same native API). `api_key`
    is sent as a bearer token; `chat_template_name` (see tokenizer/roles.FIXED_FORMATS)
    overrides the template the server reports."""

    def __init__(self, base_url: str, api_key: Optional[str] = None,
                 chat_template_name: Optional[str] = None, timeout: float = 600.0):
        super().__init__()
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.chat_template_name = chat_template_name
        self.timeout = timeout
        self._split_batches = False      # the server refused a batched /generate (a gateway)
        _ = self.model_info              # fail now, not mid-program, for a wrong URL or key

    def _generate(self, body: dict) -> Any:
        """As Backend._generate; a batch (a list of prompts) that the server refuses with 422
        goes as one request per prompt, concurrently, answers in order, and so do later
        batches. SGLang's model gateway (smg, `radixserve serve --dp-size N`) reads /generate
        into a struct with one prompt per request and answers 422 to a list; radixserve and
        SGLang servers never answer 422."""
        key = "text" if "text" in body else "input_ids"
        prompts = body.get(key)
        batch = isinstance(prompts, list) and bool(prompts) and not isinstance(prompts[0], int)
        if batch and not self._split_batches:
            try:
                return super()._generate(body)
            except BackendError as e:
                if e.status != 422:
                    raise
                self._split_batches = True
        if not batch or not self._split_batches:
            return super()._generate(body)
        from concurrent.futures import ThreadPoolExecutor
        rids = body.get("rid")
        singles = []
        for i, prompt in enumerate(prompts):
            one = {k: v for k, v in body.items() if k not in (key, "rid")}   # scalars only:
            one[key] = prompt                                   # Backend batches no others
            one["rid"] = rids[i] if isinstance(rids, list) else _new_rid()
            singles.append(one)
        with ThreadPoolExecutor(max_workers=min(len(singles), 16)) as pool:
            return list(pool.map(lambda b: self._post("/generate", b), singles))

    def _request(self, path: str, body: Optional[dict]):
        headers = {"Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None
        if body is not None:
            headers["Content-Type"] = "application/json"
            data = json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, headers=headers,
                                     method="POST" if body is not None else "GET")
        rid = body.get("rid") if body else None
        try:
            return urllib.request.urlopen(req, timeout=self.timeout)
        except urllib.error.HTTPError as e:
            raise BackendError(path, _first(rid), e.code, _error_message(e.read())) from None
        except OSError as e:
            raise BackendError(path, _first(rid), None, f"{type(e).__name__}: {e}") from None

    def _get(self, path: str) -> Any:
        with self._request(path, None) as r:
            return _json_or_text(r.read())

    def _post(self, path: str, body: dict) -> Any:
        with self._request(path, body) as r:
            return _json_or_text(r.read())

    def _stream(self, path: str, body: dict) -> Iterator[dict]:
        with self._request(path, body) as r:
            for raw in r:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    err = chunk["error"]
                    raise BackendError(path, body.get("rid"), err.get("code"), err.get("message"))
                yield chunk


class EngineBackend(Backend):
    """A radixserve.Engine in this process: the same /generate logic as the server, with no
    HTTP. Pass an Engine, or the Engine's arguments to build one (closed by shutdown())."""

    def __init__(self, engine=None, **engine_kwargs: Any):
        super().__init__()
        if engine is None:
            from radixserve.offline import Engine
            engine = Engine(**engine_kwargs)
            self._owns = True
        else:
            self._owns = False
        self.engine = engine

    def _get(self, path: str) -> Any:
        return self._call(path, None)

    def _post(self, path: str, body: dict) -> Any:
        return self._call(path, body)

    def _call(self, path: str, body: Optional[dict]) -> Any:
        from radixserve.errors import ApiError
        try:
            return self.engine.native(path, body)
        except ApiError as e:
            raise BackendError(path, _first((body or {}).get("rid")), e.status,
                               e.message) from None

    def _stream(self, path: str, body: dict) -> Iterator[dict]:
        from radixserve.errors import ApiError
        chunks = self.engine.native_stream(path, body)
        try:
            yield from chunks
        except ApiError as e:
            raise BackendError(path, body.get("rid"), e.status, e.message) from None
        finally:
            chunks.close()

    def shutdown(self) -> None:
        if self._owns:
            self.engine.shutdown()


def _first(rid: Any) -> Optional[str]:
    return rid[0] if isinstance(rid, list) and rid else rid


def _json_or_text(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return raw.decode("utf-8", "replace")


def _error_message(raw: bytes) -> str:
    body = _json_or_text(raw)
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message"))
    return str(body)
