"""GrammarBackend: xgrammar compilation off the event loop, once per (kind, spec).

Contract:
  * compile(key) -> Future[CompiledGrammar]: key is SamplingParams.grammar_key, (kind, spec)
    with kind in json_schema | regex | ebnf | structural_tag. The work runs in a small thread
    pool; the loop thread never compiles. A bounded LRU of futures (cache_size entries) makes
    a repeated spec compile once; a failed compile is cached too (it fails the same way again).
  * await compile_async(key) / compile_sync(key) wait for the result with the time limit
    (--grammar-compile-timeout) and raise GrammarError, whose message is the compiler's, for a
    spec xgrammar rejects, or say the limit was hit. Only the asking request fails.
  * matcher(compiled) -> RequestGrammar, a fresh per-request matcher.
xgrammar (and the transformers it imports) loads on the first compile, in the pool, so a
server that never sees a grammar never pays for it. The tokenizer's vocabulary is described to
xgrammar once (TokenizerInfo) with the model's vocab size, so masks are [rows, ceil(V / 32)].
Loop thread: compile(), stats; pool threads: everything xgrammar.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import logging
import re
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from radixserve.errors import RequestError

logger = logging.getLogger(__name__)

GrammarKey = Tuple[str, str]
KINDS = ("json_schema", "regex", "ebnf", "structural_tag")


class GrammarError(RequestError):
    """A grammar that cannot be used: the compiler's message, or the time limit. A 400."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"invalid {kind}: {message}", param=kind)
        self.kind = kind


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_ids: Sequence[int]):
    """xgrammar.TokenizerInfo of our Tokenizer (tokenizers or sentencepiece backend)."""
    import xgrammar as xgr

    backend = getattr(tokenizer, "_backend", None)
    hf_tok = getattr(backend, "tok", None)
    if hf_tok is not None:                        # HF tokenizers: let xgrammar detect its kind
        from transformers import PreTrainedTokenizerFast

        fast = PreTrainedTokenizerFast(tokenizer_object=hf_tok)
        return xgr.TokenizerInfo.from_huggingface(fast, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_ids))
    sp = getattr(backend, "sp", None)
    if sp is None:
        raise TypeError(f"cannot describe {type(tokenizer).__name__} to xgrammar")
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    byte_fallback = any(re.fullmatch(r"<0x[0-9A-F]{2}>", p) for p in pieces)
    kind = xgr.VocabType.BYTE_FALLBACK if byte_fallback else xgr.VocabType.RAW
    return xgr.TokenizerInfo(pieces, kind, vocab_size=vocab_size, stop_token_ids=list(stop_ids),
                             add_prefix_space=True)


class GrammarBackend:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int],
                 max_workers: int = 2, cache_size: int = 256, timeout_s: float = 30.0):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = list(stop_ids)
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_workers, thread_name_prefix="radixserve-grammar")
        self._cache: "collections.OrderedDict[GrammarKey, concurrent.futures.Future]" = \
            collections.OrderedDict()
        self._lock = threading.Lock()
        self._compiler = None
        self._compiler_lock = threading.Lock()
        self.stats: Dict[str, float] = {"compiles": 0, "cache_hits": 0, "compile_seconds": 0.0,
                                        "failures": 0}

    # ------------------------------------------------------------------ compiling
    def compile(self, key: GrammarKey) -> concurrent.futures.Future:
        kind, spec = key
        if kind not in KINDS:
            raise GrammarError(kind, f"unknown grammar kind; use one of {', '.join(KINDS)}")
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                self.stats["cache_hits"] += 1
                return fut
            fut = self._pool.submit(self._compile, kind, spec)
            self._cache[key] = fut
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return fut

    async def compile_async(self, key: GrammarKey):
        fut = self.compile(key)
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), self.timeout_s)
        except asyncio.TimeoutError:
            raise GrammarError(key[0], f"compiling it took longer than {self.timeout_s:g} s "
                                       f"(--grammar-compile-timeout); simplify it") from None

    def compile_sync(self, key: GrammarKey):
        try:
            return self.compile(key).result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise GrammarError(key[0], f"compiling it took longer than {self.timeout_s:g} s "
                                       f"(--grammar-compile-timeout); simplify it") from None

    def _get_compiler(self):
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                t0 = time.perf_counter()
                info = tokenizer_info(self.tokenizer, self.vocab_size, self.stop_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
                logger.info("grammar backend ready (xgrammar, vocab %d) in %.1f s",
                            self.vocab_size, time.perf_counter() - t0)
            return self._compiler

    def _compile(self, kind: str, spec: str):
        """Pool thread. Raises GrammarError with the compiler's message."""
        compiler = self._get_compiler()
        t0 = time.perf_counter()
        try:
            if kind == "json_schema":
                compiled = compiler.compile_json_schema(_json_schema(spec), any_whitespace=False)
            elif kind == "regex":
                compiled = compiler.compile_regex(spec)
            elif kind == "ebnf":
                compiled = compiler.compile_grammar(spec)
            else:
                compiled = compiler.compile_structural_tag(spec)
        except GrammarError:
            self.stats["failures"] += 1
            raise
        except Exception as e:       # noqa: BLE001 - xgrammar raises several types; all are 400s
            self.stats["failures"] += 1
            raise GrammarError(kind, _first_line(e)) from None
        self.stats["compiles"] += 1
        self.stats["compile_seconds"] += time.perf_counter() - t0
        return compiled

    # ------------------------------------------------------------------ matching
    def matcher(self, compiled):
        """A fresh matcher for one request (terminates when it accepts a stop token)."""
        import xgrammar as xgr

        from radixserve.constrained.grammar import RequestGrammar

        return RequestGrammar(xgr.GrammarMatcher(compiled))


def _json_schema(spec: str) -> str:
    """The schema text, checked to be a JSON object or boolean (xgrammar's message for other
    JSON is obscure)."""
    try:
        value = json.loads(spec)
    except ValueError as e:
        raise GrammarError("json_schema", f"it is not valid JSON ({e})") from None
    if not isinstance(value, (dict, bool)):
        raise GrammarError("json_schema", f"a JSON schema is an object, got {type(value).__name__}")
    return spec


_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")   # "[13:18:35] /project/cpp/x.cc:94: "


def _first_line(e: BaseException) -> str:
    """The compiler's message, without its log prefix, in at most three lines."""
    text = str(e).strip() or type(e).__name__
    lines: List[str] = [_LOG_PREFIX.sub("", ln) for ln in text.splitlines() if ln.strip()]
    return " ".join(lines[:3])[:500]
