"""SamplingParams: per-request sampling settings, named as SGLang's native API names them, and
BOUNDS, the one table of the numbers' ranges.

Every range a sampling number has lives in BOUNDS (and LOGIT_BIAS for logit_bias's values), in
the type the engine holds the number in: float32 temperatures, probabilities and penalties,
int32 counts and top_k, int64 seeds. `number_problem` is the one check against it: the server's
request schema (server/schemas.py) builds its field types from the table and calls it, and
SamplingParams.verify calls it for a SamplingParams the schema did not check. A request's
numbers are checked once: by the schema on the HTTP routes (which then build their
SamplingParams with verify(bounds_checked=True)), by verify everywhere else.

verify() runs once per SamplingParams: it marks the object verified, any assignment to it clears
the mark, and the engine verifies a request's SamplingParams only when it is not marked. The
copies the server and the engine make of a verified one (for_sample, with_grammar) stay
verified: each re-checks what it changed. Every error is a RequestError naming its field as
data (param).
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional, Union

from radixserve.errors import RequestError, describe, fmt_number, is_number


INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
MAX_TEMPERATURE = 1e4          # above this every distribution is flat in float32 anyway
MIN_TEMPERATURE = 1e-5         # logits / T must stay finite in float32
# The sampler divides positive logits by repetition_penalty and all by the temperature (at least
# MIN_TEMPERATURE): from 1e-20 up, a logit of 1e13 stays finite in float32.
MIN_REPETITION_PENALTY = 1e-20
MAX_N = 128
MAX_STOPS = 16                 # stop strings; stop_regex patterns
MAX_STOP_LEN = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024          # entries in logit_bias (OpenAI allows 300)
MAX_GRAMMAR_CHARS = 1 << 20    # a json_schema / regex / ebnf / structural_tag spec


@dataclass(frozen=True)
class Bound:
    """The values a number may take: a `kind` (int; or float, where an int is a number too) in
    [lo, hi] ((lo, hi] with lo_open), finite; with `least`, a value above 0 is at least that
    (temperature: 0 is greedy, else at least MIN_TEMPERATURE). `noun` says what the number is
    in the message ("a 64-bit integer")."""
    kind: type
    lo: Union[int, float]
    hi: Union[int, float]
    lo_open: bool = False
    noun: Optional[str] = None
    least: Optional[float] = None

    @property
    def span(self) -> str:
        if self.lo_open:
            return f"in ({fmt_number(self.lo)}, {fmt_number(self.hi)}]"
        return f"between {fmt_number(self.lo)} and {fmt_number(self.hi)}"

    def problem(self, v: Any) -> Optional[str]:
        """None when v is allowed; else what is wrong with it, a phrase to follow the field's
        name ("must be between 0 and 10000, got -1")."""
        what = self.noun or ("an integer" if self.kind is int else "a number")
        ok_type = (isinstance(v, int) and not isinstance(v, bool)) if self.kind is int \
            else is_number(v)
        if not ok_type:
            return f"must be {what} {self.span}, got {describe(v)}"
        if isinstance(v, float) and not math.isfinite(v):
            return f"must be a finite number {self.span}, got {v}"
        if (v <= self.lo if self.lo_open else v < self.lo) or v > self.hi:
            return f"must be {self.noun + ' ' if self.noun else ''}{self.span}, got {fmt_number(v)}"
        if self.least is not None and 0 < v < self.least:
            return (f"must be 0 (greedy) or between {fmt_number(self.least)} and "
                    f"{fmt_number(self.hi)}, got {fmt_number(v)}")
        return None


# The sampling numbers of SamplingParams, in the order verify checks them. max_new_tokens and
# seed may also be None (up to the context length; no seed).
BOUNDS: Dict[str, Bound] = {
    "temperature": Bound(float, 0.0, MAX_TEMPERATURE, least=MIN_TEMPERATURE),
    "top_p": Bound(float, 0.0, 1.0, lo_open=True),
    "top_k": Bound(int, -1, INT32_MAX, noun="an integer (-1 or 0: off)"),
    "min_p": Bound(float, 0.0, 1.0),
    "frequency_penalty": Bound(float, -2.0, 2.0),
    "presence_penalty": Bound(float, -2.0, 2.0),
    "repetition_penalty": Bound(float, MIN_REPETITION_PENALTY, 2.0),
    "min_new_tokens": Bound(int, 0, INT32_MAX),
    "n": Bound(int, 1, MAX_N),
    "max_new_tokens": Bound(int, 0, INT32_MAX),
    "seed": Bound(int, INT64_MIN, INT64_MAX, noun="a 64-bit integer"),
}
OPTIONAL_NUMBERS = frozenset({"max_new_tokens", "seed"})
LOGIT_BIAS = Bound(float, -100.0, 100.0)      # each value of logit_bias (OpenAI's bounds)


def number_problem(name: str, value: Any) -> Optional[str]:
    """The one check of the sampling number `name` (a key of BOUNDS): None when `value` is
    allowed, else what is wrong with it (Bound.problem). The schema's field types and verify
    both call it; a request's temperature passes through it once."""
    return BOUNDS[name].problem(value)


@dataclass
class SamplingParams:
    max_new_tokens: Optional[int] = 128     # None: up to the context length
    temperature: float = 1.0                # 0: greedy
    top_p: float = 1.0
    top_k: int = -1                         # -1 (or 0): off
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    ignore_eos: bool = False
    min_new_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    seed: Optional[int] = None
    json_schema: Optional[str] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    structural_tag: Optional[str] = None    # xgrammar structural tag, as a JSON string
    stop_regex: Optional[Union[str, List[str]]] = None
    logit_bias: Optional[Dict[int, float]] = None   # token id -> bias added to its logit
    extra: Dict[str, Any] = field(default_factory=dict, repr=False)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        self.__dict__["_verified"] = False        # a changed SamplingParams is verified again

    @property
    def verified(self) -> bool:
        """verify() passed and no field was assigned since (a list changed in place is not
        seen: treat a verified SamplingParams as read-only, or copy it)."""
        return self.__dict__.get("_verified", False)

    @property
    def stop_strs(self) -> List[str]:
        return _str_list(self.stop)

    @classmethod
    def from_dict(cls, d: Optional[Dict[str, Any]],
                  bounds_checked: bool = False) -> "SamplingParams":
        """Build from a request's dict and verify it; unknown keys raise RequestError (a 400
        upstream). bounds_checked: as verify's."""
        d = dict(d or {})
        names = {f.name for f in fields(cls)} - {"extra"}
        unknown = sorted(set(d) - names)
        if unknown:
            raise RequestError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        sp = cls(**d)
        sp.verify(bounds_checked=bounds_checked)
        return sp

    def verify(self, bounds_checked: bool = False) -> None:
        """Raise RequestError naming the field to change (param); mark self verified.
        Context-length checks happen in the engine (engine/validation.py).

        Every number of BOUNDS is checked with number_problem unless `bounds_checked`: the
        caller's request schema checked each one with it already (the server's routes). Then the
        rules no single number's range says: seed + n - 1 (the seed of the last of n samples)
        is an int64 too, the stop strings and stop_token_ids, at most one grammar and its size,
        stop_regex patterns compile, logit_bias (normalized to {int id: float bias}).
        """
        if not bounds_checked:
            for name in BOUNDS:
                value = getattr(self, name)
                if value is None and name in OPTIONAL_NUMBERS:
                    continue
                problem = number_problem(name, value)
                if problem is not None:
                    raise RequestError(f"{name} {problem}", param=name)
        if self.seed is not None and self.seed > INT64_MAX - (self.n - 1):
            raise RequestError(f"seed must be in [{INT64_MIN}, {INT64_MAX - (self.n - 1)}] (a "
                               f"64-bit integer, leaving room for seed + n - 1), got {self.seed}",
                               param="seed")
        if self.stop is not None:
            stops = self.stop_strs
            if not all(isinstance(s, str) and s for s in stops):
                raise RequestError("stop must be a non-empty string or a list of non-empty "
                                   "strings", param="stop")
            if len(stops) > MAX_STOPS:
                raise RequestError(f"at most {MAX_STOPS} stop strings are allowed", param="stop")
            if any(len(s) > MAX_STOP_LEN for s in stops):
                raise RequestError(f"each stop string may have at most {MAX_STOP_LEN} characters",
                                   param="stop")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, list) or not all(
                    isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT32_MAX
                    for t in self.stop_token_ids):
                raise RequestError("stop_token_ids must be a list of non-negative integers",
                                   param="stop_token_ids")
            if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
                raise RequestError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed",
                                   param="stop_token_ids")
        self._verify_grammar()
        self._verify_stop_regex()
        if self.logit_bias is not None:
            self.logit_bias = _check_logit_bias(self.logit_bias)
        self.__dict__["_verified"] = True

    def for_sample(self, j: int) -> "SamplingParams":
        """Sample j of this request's n (engine/io.expand_requests): n=1, seed + j. A verified
        SamplingParams gives verified samples: seed + j <= seed + n - 1, which verify bounded."""
        sp = dataclasses.replace(self, n=1, seed=None if self.seed is None else self.seed + j)
        if self.verified and 0 <= j < self.n:
            sp.__dict__["_verified"] = True
        return sp

    def with_grammar(self, kind: str, spec: str) -> "SamplingParams":
        """A copy whose one grammar is (kind, spec) (a tool-call or reasoning grammar the server
        wraps around the request's own); verified again, the grammar rules only, when self was
        verified."""
        grammars = {k: None for k in ("json_schema", "regex", "ebnf", "structural_tag")}
        sp = dataclasses.replace(self, **{**grammars, kind: spec})
        if self.verified:
            sp._verify_grammar()
            sp.__dict__["_verified"] = True
        return sp

    @property
    def stop_regexes(self) -> List[str]:
        return _str_list(self.stop_regex)

    @property
    def grammar_key(self) -> Optional[tuple]:
        """(kind, spec) of the request's grammar, or None when it has none."""
        for kind in ("json_schema", "regex", "ebnf", "structural_tag"):
            spec = getattr(self, kind)
            if spec is not None:
                return kind, spec
        return None

    def _verify_grammar(self) -> None:
        kinds = [k for k in ("json_schema", "regex", "ebnf", "structural_tag")
                 if getattr(self, k) is not None]
        if len(kinds) > 1:
            raise RequestError(f"give at most one of json_schema, regex, ebnf, structural_tag; "
                               f"got {', '.join(kinds)}")
        for k in kinds:
            spec = getattr(self, k)
            if not isinstance(spec, str):
                raise RequestError(f"{k} must be a string, got {type(spec).__name__}", param=k)
            if len(spec) > MAX_GRAMMAR_CHARS:
                raise RequestError(f"{k} may have at most {MAX_GRAMMAR_CHARS} characters", param=k)

    def _verify_stop_regex(self) -> None:
        if self.stop_regex is None:
            return
        regs = self.stop_regexes
        if not all(isinstance(r, str) and r for r in regs):
            raise RequestError("stop_regex must be a non-empty string or a list of non-empty "
                               "strings", param="stop_regex")
        if len(regs) > MAX_STOPS:
            raise RequestError(f"at most {MAX_STOPS} stop_regex patterns are allowed",
                               param="stop_regex")
        for r in regs:
            if len(r) > MAX_STOP_LEN:
                raise RequestError(f"each stop_regex may have at most {MAX_STOP_LEN} characters",
                                   param="stop_regex")
            try:
                re.compile(r)
            except re.error as e:
                raise RequestError(f"stop_regex {r!r} is not a valid regular expression: {e}",
                                   param="stop_regex") from None


def _str_list(value: Optional[Union[str, List[str]]]) -> List[str]:
    """A field given as one string or a list of them, as a list (None: empty)."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def _check_logit_bias(bias: Any) -> Dict[int, float]:
    """logit_bias as {token id: bias}, ids given as ints or decimal strings (JSON object keys),
    biases finite within LOGIT_BIAS ([-100, 100], as OpenAI bounds them). The vocabulary bound
    is checked by the engine, which knows the vocabulary."""
    if not isinstance(bias, dict):
        raise RequestError("logit_bias must be an object mapping token ids to biases",
                           param="logit_bias")
    if len(bias) > MAX_LOGIT_BIAS:
        raise RequestError(f"logit_bias may have at most {MAX_LOGIT_BIAS} entries, got "
                           f"{len(bias)}", param="logit_bias")
    lo, hi = LOGIT_BIAS.lo, LOGIT_BIAS.hi
    out: Dict[int, float] = {}
    for k, v in bias.items():
        try:
            tid = int(k) if not isinstance(k, bool) else None
        except (TypeError, ValueError):
            tid = None
        if tid is None or tid < 0 or tid > INT32_MAX or (isinstance(k, str) and not k.strip().isdigit()):
            raise RequestError(f"logit_bias keys must be token ids (non-negative integers), got "
                               f"{k!r}", param="logit_bias")
        if not is_number(v) or (isinstance(v, float) and not math.isfinite(v)) \
                or not lo <= v <= hi:
            raise RequestError(f"logit_bias[{k}] must be a number in [{fmt_number(lo)}, "
                               f"{fmt_number(hi)}], got {v!r}", param="logit_bias")
        out[tid] = float(v)
    return out
