"""SamplingParams: per-request sampling settings, named as SGLang's native API names them."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional, Union


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
    extra: Dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def stop_strs(self) -> List[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

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
        """Raise ValueError saying which field to change. Context-length checks happen later."""
        def num(name, v, kind=(int, float)):
            if isinstance(v, bool) or not isinstance(v, kind):
                raise ValueError(f"{name} must be a number, got {type(v).__name__}")

        num("temperature", self.temperature)
        num("top_p", self.top_p)
        num("top_k", self.top_k, int)
        num("min_p", self.min_p)
        num("frequency_penalty", self.frequency_penalty)
        num("presence_penalty", self.presence_penalty)
        num("repetition_penalty", self.repetition_penalty)
        num("min_new_tokens", self.min_new_tokens, int)
        num("n", self.n, int)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not 0 < self.repetition_penalty <= 2:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.max_new_tokens is not None:
            num("max_new_tokens", self.max_new_tokens, int)
            if self.max_new_tokens < 0:
                raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.seed is not None:
            num("seed", self.seed, int)
        if self.stop is not None:
            stops = self.stop_strs
            if not all(isinstance(s, str) and s for s in stops):
                raise ValueError("stop must be a non-empty string or a list of non-empty strings")
            if len(stops) > 16:
                raise ValueError("at most 16 stop strings are allowed")
        if self.stop_token_ids is not None:
            if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                       for t in self.stop_token_ids):
                raise ValueError("stop_token_ids must be a list of non-negative integers")
        constraints = [c for c in (self.json_schema, self.regex, self.ebnf) if c is not None]
        if len(constraints) > 1:
            raise ValueError("give at most one of json_schema, regex, ebnf")
