"""The expressions a program appends to its state (`s += expr`), and the sampling settings of a
generation.

    Text(str)                 literal text (a plain str is wrapped in one)
    Gen(name, params)         generate into variable `name`
    Select(name, choices...)  score `choices` and append the most likely one
    RoleBegin / RoleEnd       the chat-template text around a role block
    ExprList([...])           several of the above in order (what `user(...)` returns)
    Image(path)               an image (refused: the models served here read text only)

`a + b` of any two (or of one and a str) is an ExprList, so `"Q: " + gen("a")` works.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

# dtype -> the regex its generation is constrained to, and how its text becomes a value
DTYPE_REGEX = {
    "int": r"-?(0|[1-9][0-9]{0,17})",
    "float": r"-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,8})?",
    "bool": r"(True|False)",
    "str": r'"[^"\\\n]{0,512}"',
}
_DTYPE_NAMES = {int: "int", float: "float", bool: "bool", str: "str"}


def dtype_name(dtype: Union[type, str, None]) -> Optional[str]:
    """"int" / "float" / "bool" / "str" for a dtype given as a type or its name; ValueError else."""
    if dtype is None:
        return None
    try:
        name = _DTYPE_NAMES.get(dtype, dtype)
    except TypeError:                       # unhashable, e.g. [int]
        name = None
    if name not in DTYPE_REGEX:
        raise ValueError(f"dtype must be int, float, bool or str, not {dtype!r}")
    return name


def dtype_value(name: Optional[str], text: str) -> Any:
    """The value of a dtype-constrained generation's text (a str dtype loses its quotes)."""
    if name is None:
        return text
    if name == "int":
        return int(text)
    if name == "float":
        return float(text)
    if name == "bool":
        return text == "True"
    return json.loads(text)


@dataclass
class SamplingParams:
    """Per-generation settings in SGLang's names; None means "use the program's default"
    (program.run(temperature=..., ...)). `native()` is the /generate body they become."""
    max_new_tokens: Optional[int] = None
    min_new_tokens: Optional[int] = None
    n: Optional[int] = None
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    stop_regex: Optional[Union[str, List[str]]] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    ignore_eos: Optional[bool] = None
    return_logprob: Optional[bool] = None
    logprob_start_len: Optional[int] = None
    top_logprobs_num: Optional[int] = None
    return_text_in_logprobs: Optional[bool] = None
    dtype: Optional[str] = None
    regex: Optional[str] = None
    json_schema: Optional[Union[str, dict]] = None

    def over(self, defaults: "SamplingParams") -> "SamplingParams":
        """These settings, with every unset one taken from `defaults`."""
        return SamplingParams(**{f.name: (getattr(self, f.name) if getattr(self, f.name)
                                          is not None else getattr(defaults, f.name))
                                 for f in dataclasses.fields(self)})

    # the top-level /generate fields (the rest go under "sampling_params")
    _TOP = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")

    def native(self) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        """(sampling_params, top-level fields) of the /generate request; a dtype becomes its
        regex (and wins over an explicit regex)."""
        sp: Dict[str, Any] = {}
        top: Dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None or f.name == "dtype":
                continue
            (top if f.name in self._TOP else sp)[f.name] = value
        if isinstance(sp.get("json_schema"), dict):
            sp["json_schema"] = json.dumps(sp["json_schema"])
        if self.dtype is not None:
            sp["regex"] = DTYPE_REGEX[self.dtype]
            sp.pop("json_schema", None)
        return sp, top


RUN_DEFAULTS = SamplingParams(max_new_tokens=128, temperature=1.0, top_p=1.0, top_k=-1,
                              min_p=0.0, frequency_penalty=0.0, presence_penalty=0.0,
                              ignore_eos=False)


class Expr:
    """Something a program appends to its state."""

    def __add__(self, other: Any) -> "ExprList":
        return ExprList([self, as_expr(other)])

    def __radd__(self, other: Any) -> "ExprList":
        return ExprList([as_expr(other), self])


@dataclass
class Text(Expr):
    value: str


@dataclass
class Gen(Expr):
    name: Optional[str]
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class Select(Expr):
    name: Optional[str]
    choices: List[str]
    temperature: float = 0.0
    method: Any = None          # a choices.ChoicesMethod; None: token_length_normalized


@dataclass
class RoleBegin(Expr):
    role: str


@dataclass
class RoleEnd(Expr):
    role: str


@dataclass
class Image(Expr):
    path: str


@dataclass
class SeparateReasoning(Expr):
    """After the gens named in `names` ran: each variable's <think> block moves to
    `<name>_reasoning_content` and the variable keeps the answer (parsers/reasoning.py's split
    under `parser`). The state's text keeps what the model wrote."""
    parser: str
    names: List[str]


@dataclass
class ExprList(Expr):
    items: List[Expr]

    def __add__(self, other: Any) -> "ExprList":
        return ExprList(self.items + [as_expr(other)])

    def __radd__(self, other: Any) -> "ExprList":
        return ExprList([as_expr(other)] + self.items)


def as_expr(value: Any) -> Expr:
    """value as an Expr: a str (or a number) is Text; None is refused."""
    if isinstance(value, Expr):
        return value
    if value is None:
        raise ValueError("cannot append None to a program state")
    return Text(str(value))


def flatten(expr: Expr) -> Sequence[Expr]:
    """The leaves of expr, in order."""
    if isinstance(expr, ExprList):
        return [leaf for item in expr.items for leaf in flatten(item)]
    return [expr]


def variable_names(expr: Expr) -> List[str]:
    """The variables expr will set (named gens and selects, and the reasoning variables of
    separate_reasoning)."""
    names = []
    for e in flatten(expr):
        if isinstance(e, (Gen, Select)) and e.name is not None:
            names.append(e.name)
        elif isinstance(e, SeparateReasoning):
            names += [f"{name}_reasoning_content" for name in e.names]
    return names


def separated_names(expr: Expr) -> List[str]:
    """The variables a separate_reasoning in expr rewrites (read only after it ran)."""
    return [name for e in flatten(expr) if isinstance(e, SeparateReasoning) for name in e.names]
