"""How `select` picks among its choices, from the logprobs of each choice's tokens.

Each method gets, per choice, `token_logprobs`: the logprob of every token of the choice given
the prompt and the tokens before it (the scoring request's input_token_logprobs, cut to the
choice), and for unconditional_likelihood_normalized also `unconditional`: the same tokens
scored with no prompt at all. It returns a Decision: the chosen text and meta_info with the
figures it compared.

    token_length_normalized             highest mean token logprob (the default)
    greedy_token_selection              token by token: keep the choices with the highest logprob
                                        at each position (a shorter choice continues at its mean)
    unconditional_likelihood_normalized highest mean of (logprob - unconditional logprob)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional


@dataclass
class Decision:
    decision: str
    meta_info: Dict[str, Any]


def _mean(values: List[float]) -> float:
    return sum(values) / len(values) if values else float("-inf")


def _argmax(values: List[float]) -> int:
    """The first index of the largest value."""
    return max(range(len(values)), key=values.__getitem__)


def _logprobs(entries: List[List[Any]]) -> List[float]:
    """The logprob of each [logprob, token_id, text] entry (a None, the very first position of
    a sequence, counts as 0)."""
    return [float(e[0]) if e[0] is not None else 0.0 for e in entries]


class ChoicesMethod:
    """A selection rule: __call__(choices, token_logprobs, unconditional=None) -> Decision."""
    needs_unconditional = False

    def __call__(self, choices: List[str], token_logprobs: List[List[List[Any]]],
                 unconditional: Optional[List[List[List[Any]]]] = None) -> Decision:
        raise NotImplementedError

    @staticmethod
    def _meta(token_logprobs, normalized) -> Dict[str, Any]:
        return {"normalized_prompt_logprobs": normalized, "input_token_logprobs": token_logprobs}


class TokenLengthNormalized(ChoicesMethod):
    def __call__(self, choices, token_logprobs, unconditional=None):
        means = [_mean(_logprobs(t)) for t in token_logprobs]
        return Decision(choices[_argmax(means)], self._meta(token_logprobs, means))


class GreedyTokenSelection(ChoicesMethod):
    def __call__(self, choices, token_logprobs, unconditional=None):
        rows = [_logprobs(t) for t in token_logprobs]
        width = max(len(r) for r in rows)
        matrix = [r + [_mean(r)] * (width - len(r)) for r in rows]
        remaining = list(range(len(choices)))
        for j in range(width):
            best = max(matrix[i][j] for i in remaining)
            remaining = [i for i in remaining if matrix[i][j] == best]
            if len(remaining) == 1:
                break
        meta = self._meta(token_logprobs, [_mean(r) for r in rows])
        meta["greedy_logprob_matrix"] = matrix
        return Decision(choices[remaining[0]], meta)


class UnconditionalLikelihoodNormalized(ChoicesMethod):
    needs_unconditional = True

    def __call__(self, choices, token_logprobs, unconditional=None):
        if unconditional is None:
            raise ValueError("unconditional_likelihood_normalized needs the choices' "
                             "unconditional logprobs")
        scores = []
        for cond, uncond in zip(token_logprobs, unconditional):
            a, b = _logprobs(cond), _logprobs(uncond)
            if len(a) != len(b):
                raise ValueError("a choice's conditional and unconditional logprobs cover "
                                 f"different tokens ({len(a)} vs {len(b)})")
            scores.append(_mean([x - y for x, y in zip(a, b)]))
        meta = self._meta(token_logprobs, [_mean(_logprobs(t)) for t in token_logprobs])
        meta.update(unconditional_token_logprobs=unconditional,
                    normalized_unconditional_prompt_logprobs=scores)
        return Decision(choices[_argmax(scores)], meta)


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
