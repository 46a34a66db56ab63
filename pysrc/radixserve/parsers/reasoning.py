"""The chain of thought split from the answer (--reasoning-parser), for reasoning models that
wrap it in <think> ... </think> (Qwen3, DeepSeek-R1 and its distills).

The contract is DeepSeek's API, as SGLang serves it: a chat message carries the reasoning in
`reasoning_content` and the answer in `content`; a stream sends `delta.reasoning_content`
pieces, then `delta.content` pieces.

Parsers (PARSERS: name -> whether the output starts inside the reasoning):
  qwen3           reasoning only when the output opens with <think> (after optional
                  whitespace); otherwise it is all answer (Qwen3's template with
                  enable_thinking=false closes an empty block in the prompt).
  deepseek-r1,    the output starts inside the reasoning: R1's template opens <think> in the
  qwen3-thinking  prompt (a <think> the model writes anyway is dropped).
The reasoning ends at the first </think>; without one it runs to the end of the output (the
answer is then empty). Whitespace around the reasoning and at the start of the answer that
follows it is dropped. Text that never reaches a reasoning block passes through unchanged.

Under a grammar (response_format, a forced tool call, ...) the reasoning comes first:
reasoning_grammar wraps the request's grammar into a structural tag that leaves the <think>
block free (optional for qwen3, from the first token to </think> for the forced parsers) and
constrains what follows it, as vLLM and SGLang apply structured output to the answer only.

Streaming: ReasoningSplitter.feed(delta) returns what can be sent now; text that may be the
start of a tag (or whitespace that may end the reasoning) is held back until the next delta
or finish(). The concatenated pieces equal split_reasoning() of the whole text.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Optional, Tuple

if TYPE_CHECKING:
    from radixserve.sampling.params import SamplingParams

START, END = "<think>", "</think>"
PARSERS = {"qwen3": False, "deepseek-r1": True, "qwen3-thinking": True}

_OPENING, _REASONING, _ANSWER = "opening", "reasoning", "answer"


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningSplitter:
    """One output's split, fed its text deltas in order: feed(delta) -> (reasoning, answer)
    pieces to send now; finish() -> the pieces held back. Not thread-safe (one stream)."""

    def __init__(self, parser: str):
        if parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}; choose from "
                             f"{', '.join(sorted(PARSERS))}")
        self._forced = PARSERS[parser]
        self._state = _OPENING
        self._held = ""               # text not yet sent (see the module doc)
        self._reasoning_started = False   # the reasoning's first non-space was sent
        self._answer_started = False      # after a reasoning block: the answer's first non-space
        self.had_reasoning = False

    def feed(self, delta: str) -> Tuple[str, str]:
        self._held += delta
        reasoning, answer = "", ""
        if self._state == _OPENING:
            self._open()
        if self._state == _REASONING:
            reasoning = self._reason()
        if self._state == _ANSWER:
            answer = self._answer()
        return reasoning, answer

    @property
    def reasoning_done(self) -> bool:
        """The reasoning block (if any) is over: everything from here on is answer."""
        return self._state == _ANSWER

    def finish(self) -> Tuple[str, str]:
        """The end of the output: what was held back, as (reasoning, answer)."""
        held, self._held = self._held, ""
        if self._state == _OPENING:
            if self._forced or held.lstrip() == START:
                self.had_reasoning = True
                body = held.lstrip()
                return (body[len(START):] if body.startswith(START) else body).strip(), ""
            return "", held
        if self._state == _REASONING:
            return held.rstrip(), ""            # an unclosed reasoning runs to the end
        return "", held if self._answer_started else held.lstrip()

    # ------------------------------------------------------------------ states
    def _open(self) -> None:
        """Decide whether the output opens with a reasoning block, once enough text is in."""
        body = self._held.lstrip()
        if body.startswith(START):
            self._held = body[len(START):].lstrip()
            self._enter_reasoning()
        elif START.startswith(body):
            return                              # whitespace or a partial <think>: wait
        elif self._forced:
            self._held = body
            self._enter_reasoning()
        else:
            self._state = _ANSWER
            self._answer_started = True         # no reasoning: the text passes unchanged

    def _enter_reasoning(self) -> None:
        self._state = _REASONING
        self.had_reasoning = True

    def _reason(self) -> str:
        """Reasoning text that can be sent; at </think>, switch to the answer."""
        text = self._held
        if not self._reasoning_started:
            text = self._held = text.lstrip()
            self._reasoning_started = bool(text)
        end = text.find(END)
        if end >= 0:
            self._held = text[end + len(END):]
            self._state = _ANSWER
            return text[:end].rstrip()
        keep = _partial_suffix(text, END)
        body = text[:len(text) - keep]
        sendable = body.rstrip()                # trailing whitespace may precede </think>
        self._held = text[len(sendable):]
        return sendable

    def _answer(self) -> str:
        text, self._held = self._held, ""
        if not self._answer_started:
            text = text.lstrip()
            if not text:
                return ""
            self._answer_started = True
        return text


def split_reasoning(text: str, parser: str) -> Tuple[Optional[str], str]:
    """The whole output -> (reasoning or None when there was no reasoning block, answer)."""
    splitter = ReasoningSplitter(parser)
    reasoning, answer = splitter.feed(text)
    more_reasoning, more_answer = splitter.finish()
    reasoning += more_reasoning
    answer += more_answer
    return (reasoning if splitter.had_reasoning else None), answer


# what a model writes between </think> and its answer ("\n\n" for Qwen3), bounded
_GAP = {"type": "regex", "pattern": r"\s{0,4}"}


def _answer_format(kind: str, spec: str) -> Optional[dict]:
    """A SamplingParams grammar (kind, spec) as a structural-tag format, or None for a spec
    that is not one (a structural tag in xgrammar's older form, without "format"; JSON that
    does not parse, which the grammar compiler then refuses as it is)."""
    if kind == "regex":
        return {"type": "regex", "pattern": spec}
    if kind == "ebnf":
        return {"type": "grammar", "grammar": spec}
    try:
        obj = json.loads(spec)
    except (ValueError, RecursionError):
        return None
    if kind == "json_schema":       # at most one whitespace character between JSON tokens, so
        # the answer cannot run on in whitespace (the bare schema compiles with none free)
        return {"type": "json_schema", "json_schema": obj, "max_whitespace_cnt": 1}
    return obj.get("format") if isinstance(obj, dict) else None


def reasoning_grammar(parser: str, kind: str, spec: str) -> Optional[str]:
    """The structural tag (JSON text) that lets `parser`'s reasoning block run free and
    constrains the answer after it by (kind, spec); None when the spec cannot be wrapped."""
    answer = _answer_format(kind, spec)
    if answer is None:
        return None
    free = {"type": "any_text"}
    if PARSERS[parser]:            # the output starts inside the reasoning
        fmt = {"type": "sequence", "elements": [
            {"type": "tag", "begin": "", "content": free, "end": END}, _GAP, answer]}
    else:                          # an optional <think> block first
        think = {"type": "tag", "begin": START, "content": free, "end": END}
        fmt = {"type": "or", "elements": [
            {"type": "sequence", "elements": [think, _GAP, answer]}, answer]}
    return json.dumps({"type": "structural_tag", "format": fmt})


def with_reasoning_grammar(parser: str, sampling: "SamplingParams") -> Optional["SamplingParams"]:
    """sampling (SamplingParams) with its grammar wrapped by reasoning_grammar (as a structural
    tag), sampling itself when it has no grammar, or None when its grammar cannot be wrapped.
    A verified sampling gives a verified one (SamplingParams.with_grammar)."""
    key = sampling.grammar_key
    if key is None:
        return sampling
    wrapped = reasoning_grammar(parser, *key)
    if wrapped is None:
        return None
    return sampling.with_grammar("structural_tag", wrapped)


def reasoning_token_count(output_ids, reasoning: Optional[str], tokenizer) -> int:
    """How many of an output's tokens were reasoning (usage's reasoning_tokens): through the
    closing tag's token where the vocabulary has </think> as one token (Qwen3, DeepSeek-R1),
    all of them when that token never came (the reasoning ran to the end); else an estimate,
    the tagged reasoning text encoded. 0 without a reasoning block."""
    if reasoning is None:
        return 0
    ids = list(output_ids)
    token_to_id = getattr(tokenizer, "token_to_id", None)
    end_id = token_to_id(END) if token_to_id is not None else None
    if end_id is not None:
        return ids.index(end_id) + 1 if end_id in ids else len(ids)
    estimate = len(tokenizer.encode(START + reasoning + END, add_special_tokens=False))
    return min(len(ids), estimate)
