"""Programs: `@function` turns `def prog(s, ...)` into a Program that runs on a backend.

    state = prog.run(question="...", temperature=0)       # returns at once; reads wait
    states = prog.run_batch([{"question": q} for q in qs], progress_bar=True)

run_batch first finds the text every program of the batch starts with (each is traced up to
its first generation, select or fork, with no request sent) and, when that shared prefix is
long, prefills it once before starting them, so the batch reuses one cached copy of it instead
of racing to compute it many times.
"""
from __future__ import annotations

import inspect
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from radixserve.lang import ir
from radixserve.lang.backend import Backend
from radixserve.lang.interpreter import ProgramState, RoleMethods, run_in_state, start_state

_default_backend: Optional[Backend] = None
PRECACHE_MIN_CHARS = 64          # a shared prefix shorter than this is not worth a request


def set_default_backend(backend: Optional[Backend]) -> None:
    """The backend programs run on when run() names none."""
    global _default_backend
    _default_backend = backend


def get_default_backend() -> Optional[Backend]:
    return _default_backend


def _backend(backend: Optional[Backend]) -> Backend:
    backend = backend or _default_backend
    if backend is None:
        raise ValueError("no backend: pass backend=... or call "
                         "set_default_backend(RuntimeEndpoint(url))")
    return backend


def _defaults(max_new_tokens, **settings) -> ir.SamplingParams:
    given = ir.SamplingParams(max_new_tokens=max_new_tokens, **settings)
    return given.over(ir.RUN_DEFAULTS)


class Program:
    """A decorated program. Calling it is run(); bind(**kw) fixes some arguments."""

    def __init__(self, func: Callable, bound: Optional[Dict[str, Any]] = None):
        params = list(inspect.signature(func).parameters)
        if not params:
            raise TypeError(f"{func.__name__}: a program's first parameter is its state `s`")
        self.func = func
        self.bound = dict(bound or {})
        self.arg_names = params[1:]
        self.__name__ = getattr(func, "__name__", "program")
        self.__doc__ = func.__doc__

    def bind(self, **kwargs: Any) -> "Program":
        return Program(self.func, {**self.bound, **kwargs})

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)

    def run(self, *args: Any, max_new_tokens: int = 128, stop=None, stop_token_ids=None,
            stop_regex=None, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
            min_p: float = 0.0, frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
            ignore_eos: bool = False, return_logprob: Optional[bool] = None,
            logprob_start_len: Optional[int] = None, top_logprobs_num: Optional[int] = None,
            return_text_in_logprobs: Optional[bool] = None, stream: bool = False,
            backend: Optional[Backend] = None, **kwargs: Any) -> ProgramState:
        """Start the program; the sampling settings are the defaults of every gen in it.
        Without stream the program body runs here (each gen is queued, not awaited); with
        stream=True it runs on a thread and the state returns at once, for text_iter()."""
        defaults = _defaults(max_new_tokens, stop=stop, stop_token_ids=stop_token_ids,
                             stop_regex=stop_regex, temperature=temperature, top_p=top_p,
                             top_k=top_k, min_p=min_p, frequency_penalty=frequency_penalty,
                             presence_penalty=presence_penalty, ignore_eos=ignore_eos,
                             return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                             top_logprobs_num=top_logprobs_num,
                             return_text_in_logprobs=return_text_in_logprobs)
        state = start_state(_backend(backend), defaults, stream)
        kwargs = {**self.bound, **kwargs}
        if stream:
            threading.Thread(target=run_in_state, args=(self.func, state, args, kwargs),
                             daemon=True).start()
        else:
            run_in_state(self.func, state, args, kwargs)
        return state

    def run_batch(self, batch_kwargs: Sequence[Dict[str, Any]], *,
                  backend: Optional[Backend] = None, num_threads: Union[int, str] = "auto",
                  progress_bar: bool = False, precache: bool = True,
                  **settings: Any) -> List[ProgramState]:
        """Run the program once per kwargs dict, `num_threads` at a time ("auto": all of
        them, up to 16 per core), and wait for all; states come back in order. A failing
        program fails alone: its state's reads raise its error. `settings` are run()'s."""
        backend = _backend(backend)
        batch = [dict(kw) for kw in batch_kwargs]
        if precache and len(batch) > 1:
            self.precache(batch, backend)
        if num_threads == "auto":
            num_threads = min(len(batch), 16 * (os.cpu_count() or 1)) or 1
        bar = _progress(len(batch)) if progress_bar else None

        def one(kwargs: Dict[str, Any]) -> ProgramState:
            state = self.run(backend=backend, **settings, **kwargs)
            state.sync()
            for child in _descendants(state.executor):
                child.sync()
            if bar is not None:
                bar.update(1)
            return state

        try:
            with ThreadPoolExecutor(max(int(num_threads), 1)) as pool:
                return list(pool.map(one, batch))
        finally:
            if bar is not None:
                bar.close()

    def precache(self, batch: Sequence[Dict[str, Any]], backend: Backend) -> Optional[str]:
        """Prefill the text every program of the batch starts with, when it is at least
        PRECACHE_MIN_CHARS long; return it (None when there is none worth caching)."""
        texts = [trace_prefix(self.func, {**self.bound, **kw}, backend) for kw in batch]
        if any(t is None for t in texts):
            return None
        shared = os.path.commonprefix(texts)
        if len(shared) < PRECACHE_MIN_CHARS:
            return None
        backend.cache_prefix(shared)
        return shared


def _descendants(executor) -> List[Any]:
    out = []
    for child in executor.children:
        out.append(child)
        out.extend(_descendants(child))
    return out


def _progress(total: int):
    from tqdm import tqdm
    return tqdm(total=total)


class _StopTrace(Exception):
    pass


class _TraceState(RoleMethods):
    """A stand-in state that records the text a program appends before its first generation,
    select, fork or read (then stops it). Role blocks render through the backend's format."""

    def __init__(self, backend: Backend):
        self.roles = backend.role_format
        self.text_ = ""
        self.messages: List[Dict[str, str]] = []
        self._open: Optional[tuple] = None

    def __iadd__(self, other: Any) -> "_TraceState":
        for leaf in ir.flatten(ir.as_expr(other)):
            if isinstance(leaf, ir.Text):
                self.text_ += leaf.value
            elif isinstance(leaf, ir.RoleBegin):
                prefix, suffix = self.roles.prefix_and_suffix(leaf.role, self.messages)
                self.text_ += prefix
                self._open = (leaf.role, len(self.text_), suffix)
            elif isinstance(leaf, ir.RoleEnd) and self._open is not None:
                role, begin, suffix = self._open
                self.messages.append({"role": role, "content": self.text_[begin:].lstrip()})
                self.text_ += suffix
                self._open = None
            else:
                raise _StopTrace
        return self

    def _role(self, role: str, expr: Any = None):
        if expr is not None:
            self += ir.ExprList([ir.RoleBegin(role), ir.as_expr(expr), ir.RoleEnd(role)])
            return None
        return _TraceRole(self, role)

    def __getattr__(self, name: str):
        raise _StopTrace      # fork, reads, text(), ...: the traced prefix ends here

    def __getitem__(self, name: str):
        raise _StopTrace


class _TraceRole:
    def __init__(self, state: _TraceState, role: str):
        self.state, self.role = state, role

    def __enter__(self):
        self.state += ir.RoleBegin(self.role)
        return self.state

    def __exit__(self, *exc):
        if exc[0] is None:
            self.state += ir.RoleEnd(self.role)
        return False


def trace_prefix(func: Callable, kwargs: Dict[str, Any], backend: Backend) -> Optional[str]:
    """The text `func(s, **kwargs)` builds before its first generation / select / fork / read,
    computed locally; None when the program cannot be traced (it raised)."""
    state = _TraceState(backend)
    try:
        func(state, **kwargs)
    except _StopTrace:
        pass
    except Exception:  # noqa: BLE001 - an untraceable program just runs without precaching
        return None
    return state.text_


def function(func: Optional[Callable] = None):
    """Decorator: `@function def prog(s, ...)` (or `@function()`)."""
    if func is not None:
        return Program(func)
    return Program
