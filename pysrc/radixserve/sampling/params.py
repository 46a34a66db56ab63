"""SamplingParams: per-request sampling settings, named as SGLang's native API names them."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional, Union


INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
MAX_TEMPERATURE = 1e4          # above this every distribution is flat in float32 anyway
MIN_TEMPERATURE = 1e-5         # logits / T must stay finite in float32
MIN_REPETITION_PENALTY = 1e-20   # positive logits / penalty stay finite in float32 (a logit of 1e13)
MAX_N = 128
MAX_STOP_LEN = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024          # entries in logit_bias (OpenAI allows 300)
MAX_GRAMMAR_CHARS = 1 << 20    # a json_schema / regex / ebnf / structural_tag spec


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

    @property
    def stop_strs(self) -> List[str]:
        return _str_list(self.stop)

    @classmethod
    def from_dict(cls, d: Optional[Dict[str, Any]]) -> "SamplingParams":
        """Build from a request's dict; unknown keys raise ValueError (a 400 upstream)."""
        d = dict(d or {})
        names = {f.name for f in fields(cls)} - {"extra"}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        sp = cls(**d)
        sp.verify()
        return sp

    def verify(self) -> None:
        """Raise ValueError saying which field to change. Context-length checks happen later.

        Every number is checked in the type the engine uses it in: float32 for temperature, top_p,
        min_p and the penalties (finite; a repetition_penalty must stay a normal float32, since
        the sampler divides by it), int32 for top_k, int64 for the seed and for seed + n - 1 (the
        seed of the last of n samples). NaN and infinities are refused.
        """
        def num(name, v, kind=(int, float)):
            if isinstance(v, bool) or not isinstance(v, kind):
                raise ValueError(f"{name} must be a number, got {type(v).__name__}")

        def f32(name, v, lo, hi, lo_open=False):
            num(name, v)
            if isinstance(v, float) and not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v}")
            if (v <= lo if lo_open else v < lo) or v > hi:
                raise ValueError(f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], "
                                 f"got {v}")

        num("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        f32("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        f32("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        num("top_k", self.top_k, int)
        f32("min_p", self.min_p, 0.0, 1.0)
        f32("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        f32("presence_penalty", self.presence_penalty, -2.0, 2.0)
        f32("repetition_penalty", self.repetition_penalty, 0.0, 2.0, lo_open=True)
        if self.repetition_penalty < MIN_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty {self.repetition_penalty} is too small: "
                             f"dividing logits by it overflows float32; use at least "
                             f"{MIN_REPETITION_PENALTY:g}")
        num("min_new_tokens", self.min_new_tokens, int)
        num("n", self.n, int)
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, "
                             f"got {self.temperature}")
        if not (self.top_k == -1 or self.top_k == 0 or 1 <= self.top_k <= INT32_MAX):
            raise ValueError(f"top_k must be -1 (off) or in [1, {INT32_MAX}], got {self.top_k}")
        if self.max_new_tokens is not None:
            num("max_new_tokens", self.max_new_tokens, int)
            if not 0 <= self.max_new_tokens <= INT32_MAX:
                raise ValueError(f"max_new_tokens must be in [0, {INT32_MAX}], got "
                                 f"{self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= INT32_MAX:
            raise ValueError(f"min_new_tokens must be in [0, {INT32_MAX}], got {self.min_new_tokens}")
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        if self.seed is not None:
            num("seed", self.seed, int)
            if not INT64_MIN <= self.seed <= INT64_MAX - (self.n - 1):
                raise ValueError(f"seed must be in [{INT64_MIN}, {INT64_MAX - (self.n - 1)}] "
                                 f"(a 64-bit integer, leaving room for seed + n - 1), got "
                                 f"{self.seed}")
        if self.stop is not None:
            stops = self.stop_strs
            if not all(isinstance(s, str) and s for s in stops):
                raise ValueError("stop must be a non-empty string or a list of non-empty strings")
            if len(stops) > 16:
                raise ValueError("at most 16 stop strings are allowed")
            if any(len(s) > MAX_STOP_LEN for s in stops):
                raise ValueError(f"each stop string may have at most {MAX_STOP_LEN} characters")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, list) or not all(
                    isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT32_MAX
                    for t in self.stop_token_ids):
                raise ValueError("stop_token_ids must be a list of non-negative integers")
            if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
                raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed")
        self._verify_constraints()

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

    def _verify_constraints(self) -> None:
        kinds = [k for k in ("json_schema", "regex", "ebnf", "structural_tag")
                 if getattr(self, k) is not None]
        if len(kinds) > 1:
            raise ValueError(f"give at most one of json_schema, regex, ebnf, structural_tag; got "
                             f"{', '.join(kinds)}")
        for k in kinds:
            spec = getattr(self, k)
            if not isinstance(spec, str):
                raise ValueError(f"{k} must be a string, got {type(spec).__name__}")
            if len(spec) > MAX_GRAMMAR_CHARS:
                raise ValueError(f"{k} may have at most {MAX_GRAMMAR_CHARS} characters")
        if self.stop_regex is not None:
            regs = self.stop_regexes
            if not all(isinstance(r, str) and r for r in regs):
                raise ValueError("stop_regex must be a non-empty string or a list of non-empty strings")
            if len(regs) > 16:
                raise ValueError("at most 16 stop_regex patterns are allowed")
            for r in regs:
                if len(r) > MAX_STOP_LEN:
                    raise ValueError(f"each stop_regex may have at most {MAX_STOP_LEN} characters")
                try:
                    re.compile(r)
                except re.error as e:
                    raise ValueError(f"stop_regex {r!r} is not a valid regular expression: {e}")
        if self.logit_bias is not None:
            self.logit_bias = _check_logit_bias(self.logit_bias)


def _str_list(value: Optional[Union[str, List[str]]]) -> List[str]:
    """A field given as one string or a list of them, as a list (None: empty)."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def _check_logit_bias(bias: Any) -> Dict[int, float]:
    """logit_bias as {token id: bias}, ids given as ints or decimal strings (JSON object keys),
    biases finite in [-100, 100] as OpenAI bounds them. The vocabulary bound is checked by the
    engine, which knows the vocabulary."""
    if not isinstance(bias, dict):
        raise ValueError("logit_bias must be an object mapping token ids to biases")
    if len(bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias may have at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
    out: Dict[int, float] = {}
    for k, v in bias.items():
        try:
            tid = int(k) if not isinstance(k, bool) else None
        except (TypeError, ValueError):
            tid = None
        if tid is None or tid < 0 or tid > INT32_MAX or (isinstance(k, str) and not k.strip().isdigit()):
            raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {k!r}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or not -100 <= v <= 100:
            raise ValueError(f"logit_bias[{k}] must be a number in [-100, 100], got {v!r}")
        out[tid] = float(v)
    return out
