"""The expressions a program writes: gen, gen_int, gen_string, select, the role blocks and
image, in SGLang's signatures (so `import radixserve.lang as sgl` runs SGLang programs)."""
from __future__ import annotations

import re
from typing import List, Optional, Union

from radixserve.lang import ir
from radixserve.lang.choices import ChoicesMethod, token_length_normalized


def gen(name: Optional[str] = None, max_tokens: Optional[int] = None,
        min_tokens: Optional[int] = None, n: Optional[int] = None,
        stop: Optional[Union[str, List[str]]] = None, stop_token_ids: Optional[List[int]] = None,
        stop_regex: Optional[Union[str, List[str]]] = None, temperature: Optional[float] = None,
        top_p: Optional[float] = None, top_k: Optional[int] = None, min_p: Optional[float] = None,
        frequency_penalty: Optional[float] = None, presence_penalty: Optional[float] = None,
        ignore_eos: Optional[bool] = None, return_logprob: Optional[bool] = None,
        logprob_start_len: Optional[int] = None, top_logprobs_num: Optional[int] = None,
        return_text_in_logprobs: Optional[bool] = None, dtype: Union[type, str, None] = None,
        choices: Optional[List[str]] = None, choices_method: Optional[ChoicesMethod] = None,
        regex: Optional[str] = None, json_schema: Union[str, dict, None] = None) -> ir.Expr:
    """Generate into variable `name`. With `choices` it is select(); `dtype` (int, float, bool,
    str) constrains the text to that type's form and stores the typed value; `regex` and
    `json_schema` constrain it through the server's grammar engine. Unset settings come from
    program.run(...)."""
    if choices:
        return select(name, choices, 0.0 if temperature is None else temperature,
                      choices_method or token_length_normalized)
    if regex is not None:
        try:
            re.compile(regex)
        except re.error as e:
            raise ValueError(f"gen({name!r}): regex {regex!r} is not valid: {e}") from None
    return ir.Gen(name, ir.SamplingParams(
        max_new_tokens=max_tokens, min_new_tokens=min_tokens, n=n, stop=stop,
        stop_token_ids=stop_token_ids, stop_regex=stop_regex, temperature=temperature,
        top_p=top_p, top_k=top_k, min_p=min_p, frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty, ignore_eos=ignore_eos, return_logprob=return_logprob,
        logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs, dtype=ir.dtype_name(dtype),
        regex=regex, json_schema=json_schema))


def gen_int(name: Optional[str] = None, **kwargs) -> ir.Expr:
    """gen(name, dtype=int, ...): an integer, stored as int."""
    return gen(name, dtype=int, **kwargs)


def gen_string(name: Optional[str] = None, **kwargs) -> ir.Expr:
    """gen(name, dtype=str, ...): a double-quoted string, stored without its quotes."""
    return gen(name, dtype=str, **kwargs)


def select(name: Optional[str] = None, choices: Optional[List[str]] = None,
           temperature: float = 0.0,
           choices_method: ChoicesMethod = token_length_normalized) -> ir.Expr:
    """Append the choice the model scores highest (choices_method: see lang/choices.py) and
    store it in `name`."""
    if not choices:
        raise ValueError(f"select({name!r}) needs a non-empty list of choices")
    if not all(isinstance(c, str) for c in choices):
        raise ValueError(f"select({name!r}): every choice must be a string")
    return ir.Select(name, list(choices), temperature, choices_method)


def _role(role: str, expr=None) -> ir.Expr:
    items = [ir.RoleBegin(role)] + ([ir.as_expr(expr)] if expr is not None else [])
    return ir.ExprList(items + [ir.RoleEnd(role)])


def system(expr=None) -> ir.Expr:
    """A system block around expr, rendered with the served model's chat template."""
    return _role("system", expr)


def user(expr=None) -> ir.Expr:
    return _role("user", expr)


def assistant(expr=None) -> ir.Expr:
    return _role("assistant", expr)


def system_begin() -> ir.Expr:
    return ir.RoleBegin("system")


def system_end() -> ir.Expr:
    return ir.RoleEnd("system")


def user_begin() -> ir.Expr:
    return ir.RoleBegin("user")


def user_end() -> ir.Expr:
    return ir.RoleEnd("user")


def assistant_begin() -> ir.Expr:
    return ir.RoleBegin("assistant")


def assistant_end() -> ir.Expr:
    return ir.RoleEnd("assistant")


def separate_reasoning(expr: Optional[ir.Expr] = None,
                       model_type: Optional[str] = None) -> ir.Expr:
    """expr (a gen, or expressions holding gens), then each of its named variables split as
    the server's --reasoning-parser `model_type` splits (qwen3, deepseek-r1, qwen3-thinking):
    s[name] is the answer and s[name + "_reasoning_content"] the reasoning (None when the
    output had no reasoning block)."""
    from radixserve.parsers.reasoning import PARSERS

    if model_type not in PARSERS:
        raise ValueError(f"separate_reasoning(model_type={model_type!r}): choose one of "
                         f"{', '.join(sorted(PARSERS))}")
    expr = ir.as_expr(expr)
    names = [e.name for e in ir.flatten(expr) if isinstance(e, ir.Gen) and e.name is not None]
    return ir.ExprList([expr, ir.SeparateReasoning(model_type, names)])


def image(path: str) -> ir.Expr:
    """An image. The models radixserve serves read text only, so running it raises ValueError
    saying so."""
    return ir.Image(str(path))
