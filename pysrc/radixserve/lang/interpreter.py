"""The interpreter: one Executor per program state runs that state's expressions in order on its
own thread, so `s += gen(...)` returns at once and the caller waits only when it reads a value.

Ownership:
  Executor      the text, chat messages, variables and meta_info of one state; its worker thread
                is the only writer of them (fork/join read them after `sync()`)
  ProgramState  what a program sees as `s`: appends, reads, role blocks, fork, streaming
  ProgramGroup  the states `s.fork(n)` returns; `join()` brings their results back

A failed expression (a BackendError, a template the chat format cannot render, ...) stops the
state: later expressions are skipped, waiting readers wake up, and every read of a value the
failure left unset, and every text()/messages(), raises that error.
"""
from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional

from radixserve.lang import ir
from radixserve.lang.backend import Backend

_END = object()
_names = itertools.count()


class _JoinText(ir.Expr):
    """Append each forked state's text since the fork (join mode "concate_and_append")."""

    def __init__(self, children: List["Executor"]):
        self.children = children


class Executor:
    def __init__(self, backend: Backend, defaults: ir.SamplingParams, stream: bool):
        self.backend = backend
        self.defaults = defaults
        self.stream = stream
        self.text_ = ""
        self.messages_: List[Dict[str, str]] = []
        self.variables: Dict[str, Any] = {}
        self.meta_info: Dict[str, Any] = {}
        self.done: Dict[str, threading.Event] = {}     # name -> set when its value is final
        self.error_: Optional[BaseException] = None
        self.fork_start = 0                            # len(text_) when forked from a parent
        self.children: List["Executor"] = []
        self._role: Optional[str] = None
        self._role_begin = 0
        self._role_suffix = ""
        self._rewritten: set = set()                   # set by separate_reasoning, not by gen
        self._changed = threading.Condition()          # streaming readers wait on it
        self._finished = False
        self._ended = False
        self.body_thread: Optional[int] = None         # the thread running the program body
        self._queue: "queue.Queue" = queue.Queue()
        self._worker = threading.Thread(target=self._work, name="radixserve-lang", daemon=True)
        self._worker.start()

    # ---------------------------------------------------------------- the caller's side
    def submit(self, expr: ir.Expr) -> None:
        if self._ended:
            raise RuntimeError("this program state has ended (its program returned, or it is "
                               "a joined branch); it takes no more expressions")
        with self._changed:
            for name in ir.variable_names(expr):
                self.done[name] = threading.Event()
            self._queue.put(expr)
            self._changed.notify_all()

    def sync(self) -> None:
        """Wait until every expression submitted so far has run (or was skipped by an error)."""
        self._queue.join()

    def end(self) -> None:
        """No more expressions: the worker exits once the queue is done (children too).
        Idempotent (a joined branch is ended again with its parent)."""
        for child in self.children:
            child.end()
        with self._changed:
            if not self._ended:
                self._ended = True
                self._queue.put(_END)
            self._changed.notify_all()

    def _outside_body(self) -> bool:
        return threading.get_ident() != self.body_thread

    def _await_submitted(self, name: Optional[str]) -> None:
        """From outside the program body (a streamed run's body runs on its own thread): wait
        until the body has queued `name` (None: until it returned), so a read right after
        run(stream=True) does not race the body."""
        if not self._outside_body():
            return
        with self._changed:
            while not self._ended and (name is None or name not in self.done):
                self._changed.wait()

    def get_var(self, name: str) -> Any:
        if name not in self.variables:
            self._await_submitted(name)
        event = self.done.get(name)
        if event is not None:
            event.wait()
        if name in self.variables:
            return self.variables[name]
        if self.error_ is not None:
            raise self.error_
        raise KeyError(f"the program has no variable {name!r}")

    def checked(self, read: Callable[[], Any]) -> Any:
        """read() once the queue has run (from outside the body: once the body returned, too);
        the state's error instead, if it failed."""
        self._await_submitted(None)
        self.sync()
        if self.error_ is not None:
            raise self.error_
        return read()

    def fork(self, size: int) -> List["Executor"]:
        """`size` copies of this state as it is once its queue has run. With more than one,
        the text so far is prefilled once first, so every branch finds it in the cache."""
        self.sync()
        if self.error_ is not None:
            raise self.error_
        if size > 1 and self.text_:
            self.backend.cache_prefix(self.text_)
        children = []
        for _ in range(size):
            child = Executor(self.backend, self.defaults, self.stream)
            child.text_, child.fork_start = self.text_, len(self.text_)
            child.messages_ = list(self.messages_)
            child.variables = dict(self.variables)
            child._role, child._role_begin = self._role, self._role_begin
            child._role_suffix = self._role_suffix
            child.body_thread = self.body_thread
            children.append(child)
        self.children.extend(children)
        return children

    # ---------------------------------------------------------------- streaming
    def wait_change(self, seen: int, name: Optional[str]) -> str:
        """Block until the text (or variable `name`) is longer than `seen` characters or final;
        return its new part ("" once final). A variable the body has not queued yet is waited
        for; one it never queues is final once the program ended."""
        with self._changed:
            while True:
                current = self.text_ if name is None else str(self.variables.get(name, ""))
                if len(current) > seen:
                    return current[seen:]
                if name is None or name not in self.done:
                    final = self._finished
                else:
                    final = self.done[name].is_set()
                if final or self.error_ is not None:
                    return ""
                self._changed.wait()

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    # ---------------------------------------------------------------- the worker's side
    def _work(self) -> None:
        while True:
            expr = self._queue.get()
            try:
                if expr is _END:
                    return
                if self.error_ is None:
                    self._execute(expr)
            except BaseException as e:  # noqa: BLE001 - the state fails; readers see it
                self.error_ = e
                for event in self.done.values():
                    event.set()
            finally:
                if expr is _END:
                    with self._changed:
                        self._finished = True
                        self._changed.notify_all()
                else:
                    self._notify()
                self._queue.task_done()

    def _execute(self, expr: ir.Expr) -> None:
        self._rewritten = set(ir.separated_names(expr))   # their values are final only later
        for leaf in ir.flatten(expr):
            if isinstance(leaf, ir.Text):
                self.text_ += leaf.value
            elif isinstance(leaf, ir.Gen):
                self._gen(leaf)
            elif isinstance(leaf, ir.Select):
                self._select(leaf)
            elif isinstance(leaf, ir.RoleBegin):
                self._role_begin_(leaf.role)
            elif isinstance(leaf, ir.RoleEnd):
                self._role_end_(leaf.role)
            elif isinstance(leaf, _JoinText):
                for child in leaf.children:
                    child.sync()
                    self.text_ += child.text_[child.fork_start:]
            elif isinstance(leaf, ir.SeparateReasoning):
                self._separate_reasoning(leaf)
            elif isinstance(leaf, ir.Image):
                raise ValueError(f"image({leaf.path!r}): the served model reads text only; "
                                 "radixserve serves no vision model")
            else:
                raise TypeError(f"cannot append {type(leaf).__name__} to a program state")

    def _set(self, name: str, value: Any, meta: Any) -> None:
        self.variables[name] = value
        self.meta_info[name] = meta
        if name not in self._rewritten:
            self.done[name].set()

    def _gen(self, expr: ir.Gen) -> None:
        params = expr.params.over(self.defaults)
        name = expr.name if expr.name is not None else f"gen_{next(_names)}"
        if name not in self.done:
            self.done[name] = threading.Event()
        if self.stream and (params.n or 1) == 1:
            self.variables[name] = ""
            meta: Any = None
            try:
                for delta, meta in self.backend.generate_stream(self.text_, params):
                    with self._changed:
                        self.text_ += delta
                        self.variables[name] += delta
                        self.meta_info[name] = meta
                        self._changed.notify_all()
            except BaseException:
                del self.variables[name]        # a failed gen has no value: reads raise
                raise
            text = self.variables[name]
            self._set(name, ir.dtype_value(params.dtype, text), meta)
            return
        text, meta = self.backend.generate(self.text_, params)
        if isinstance(text, list):                 # n > 1: the state continues with the first
            self.text_ += text[0]
            self._set(name, [ir.dtype_value(params.dtype, t) for t in text], meta)
        else:
            self.text_ += text
            self._set(name, ir.dtype_value(params.dtype, text), meta)

    def _separate_reasoning(self, expr: ir.SeparateReasoning) -> None:
        from radixserve.parsers.reasoning import split_reasoning

        for name in expr.names:
            value = self.variables.get(name)
            if isinstance(value, str):
                reasoning, answer = split_reasoning(value, expr.parser)
            elif isinstance(value, list) and all(isinstance(v, str) for v in value):
                splits = [split_reasoning(v, expr.parser) for v in value]   # n > 1
                reasoning, answer = [r for r, _ in splits], [a for _, a in splits]
            else:                                 # a typed value (dtype): no text to split
                reasoning, answer = None, value
            with self._changed:
                self.variables[name] = answer
                self.variables[f"{name}_reasoning_content"] = reasoning
                self.done.setdefault(name, threading.Event()).set()
                self.done.setdefault(f"{name}_reasoning_content", threading.Event()).set()
                self._changed.notify_all()

    def _select(self, expr: ir.Select) -> None:
        if expr.temperature > 1e-5:
            raise ValueError("select scores its choices; a temperature above 0 is not supported")
        decision = self.backend.select(self.text_, list(expr.choices), expr.method)
        self.text_ += decision.decision
        if expr.name is not None:
            self._set(expr.name, decision.decision, decision.meta_info)

    def _role_begin_(self, role: str) -> None:
        if self._role is not None:
            raise ValueError(f"a {role} block cannot start inside the open {self._role} block")
        prefix, self._role_suffix = self.backend.role_format.prefix_and_suffix(
            role, self.messages_)
        self.text_ += prefix
        self._role, self._role_begin = role, len(self.text_)

    def _role_end_(self, role: str) -> None:
        if self._role != role:
            raise ValueError(f"{role}_end() without an open {role} block")
        content = self.text_[self._role_begin:]
        self.text_ += self._role_suffix
        self.messages_.append({"role": role, "content": content.lstrip()})
        self._role = None


class RoleMethods:
    """s.system / s.user / s.assistant over the class's _role(role, expr): a block around expr,
    or with no argument a `with s.user():` block."""

    def system(self, expr: Any = None):
        return self._role("system", expr)

    def user(self, expr: Any = None):
        return self._role("user", expr)

    def assistant(self, expr: Any = None):
        return self._role("assistant", expr)


class ProgramState(RoleMethods):
    """The `s` of a program. `s += expr` queues expr (a str, gen(...), select(...), a role
    block, ...) and returns at once; `s[name]`, `s.text()` and the like wait for what they read."""

    def __init__(self, executor: Executor):
        self.executor = executor
        self.ret_value: Any = None

    # ---------------------------------------------------------------- appending
    def __iadd__(self, other: Any) -> "ProgramState":
        self.executor.submit(ir.as_expr(other))
        return self

    def _role(self, role: str, expr: Any = None):
        if expr is not None:
            self.executor.submit(ir.ExprList([ir.RoleBegin(role), ir.as_expr(expr),
                                              ir.RoleEnd(role)]))
            return None
        return self._role_scope(role)

    @contextmanager
    def _role_scope(self, role: str):
        self.executor.submit(ir.RoleBegin(role))
        yield self
        self.executor.submit(ir.RoleEnd(role))

    # ---------------------------------------------------------------- reading
    def __getitem__(self, name: str) -> Any:
        return self.executor.get_var(name)

    def get_var(self, name: str) -> Any:
        return self.executor.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.executor.sync()
        self.executor.variables[name] = value

    set_var = __setitem__

    def __contains__(self, name: str) -> bool:
        return name in self.executor.done or name in self.executor.variables

    def get_meta_info(self, name: str) -> Any:
        """The server's meta_info of the generation (or the scores of the select) `name`."""
        self.executor.get_var(name)
        return self.executor.meta_info.get(name)

    def text(self) -> str:
        """The whole text so far, once every queued expression ran."""
        return self.executor.checked(lambda: self.executor.text_)

    def messages(self) -> List[Dict[str, str]]:
        """The role blocks so far as OpenAI chat messages."""
        return self.executor.checked(lambda: list(self.executor.messages_))

    def sync(self) -> None:
        self.executor.sync()

    def error(self) -> Optional[BaseException]:
        """The error that stopped this state, or None."""
        self.executor.sync()
        return self.executor.error_

    # ---------------------------------------------------------------- streaming
    def text_iter(self, var_name: Optional[str] = None) -> Iterator[str]:
        """The text (or the variable var_name) piece by piece as it is generated, when the
        program runs with stream=True; else the final value in one piece."""
        if not self.executor.stream:
            yield self.text() if var_name is None else str(self[var_name])
            return
        seen = 0
        while True:
            piece = self.executor.wait_change(seen, var_name)
            if not piece:
                if self.executor.error_ is not None:
                    raise self.executor.error_
                return
            seen += len(piece)
            yield piece

    async def text_async_iter(self, var_name: Optional[str] = None):
        """text_iter for an asyncio caller (each wait runs on a worker thread)."""
        pieces = self.text_iter(var_name)
        loop = asyncio.get_running_loop()
        end = object()
        while True:
            piece = await loop.run_in_executor(None, next, pieces, end)
            if piece is end:
                return
            yield piece

    # ---------------------------------------------------------------- fork
    def fork(self, size: int = 1) -> "ProgramGroup":
        """`size` independent copies of this state; their gens run concurrently, sharing the
        text so far through the server's prefix cache."""
        children = self.executor.fork(int(size))
        return ProgramGroup([ProgramState(c) for c in children], self)

    @contextmanager
    def copy(self):
        group = self.fork(1)
        try:
            yield group[0]
        finally:
            group.join()

    def __repr__(self) -> str:
        return f"ProgramState({self.executor.text_!r})"


class ProgramGroup:
    """The states of one fork. `group += x` appends x to every state (a callable: x(i) to the
    i-th, a list: x[i]); `join()` ends them and brings their results to the parent."""

    def __init__(self, states: List[ProgramState], parent: ProgramState):
        self.states = states
        self.parent = parent

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: Any) -> "ProgramGroup":
        for i, state in enumerate(self.states):
            if callable(other) and not isinstance(other, ir.Expr):
                state += other(i)
            elif isinstance(other, (list, tuple)):
                state += other[i]
            else:
                state += other
        return self

    JOIN_MODES = {"gather_variable": "gather", "gather": "gather",
                  "concate_and_append": "concatenate", "concatenate": "concatenate"}

    def join(self, mode: str = "gather_variable") -> None:
        """"gather_variable" (or "gather"): every variable a branch created becomes, in the
        parent, the list of the branches' values. "concate_and_append" (or "concatenate"): the
        branches' texts since the fork are appended to the parent's text, in order."""
        kind = self.JOIN_MODES.get(mode)
        if kind is None:
            raise ValueError(f"join mode must be one of {sorted(self.JOIN_MODES)}, not {mode!r}")
        children = [s.executor for s in self.states]
        parent = self.parent.executor
        if kind == "gather":
            parent.sync()
            before = set(parent.variables)
            gathered: Dict[str, List[Any]] = {}
            for child in children:
                child.sync()
                if child.error_ is not None:
                    raise child.error_
                for name in child.variables:
                    if name not in before:
                        gathered.setdefault(name, []).append(child.variables[name])
            parent.variables.update(gathered)
        else:
            parent.submit(_JoinText(children))
            parent.sync()
            if parent.error_ is not None:
                raise parent.error_
        for child in children:
            child.end()


def start_state(backend: Backend, defaults: ir.SamplingParams, stream: bool) -> ProgramState:
    return ProgramState(Executor(backend, defaults, stream))


def run_in_state(func: Callable, state: ProgramState, args, kwargs) -> None:
    """Call the program on `state` (on this thread), then end the state (its queue still
    runs to the end)."""
    state.executor.body_thread = threading.get_ident()
    try:
        state.ret_value = func(state, *args, **kwargs)
    finally:
        state.executor.end()
