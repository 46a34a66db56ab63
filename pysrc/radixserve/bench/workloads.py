"""The workloads of `radixserve bench serving`: prompts as token ids drawn from [lo, hi), so
their lengths and overlaps are exact and no tokenizer is needed (the chat backend decodes them
to text once, before the run).

Lengths and arrival times follow SGLang's bench_serving for the same --seed. Its run_benchmark
seeds numpy's global stream with --seed; for --dataset-name random, sample_random_requests then
draws every input length and every output length from it (two randint calls, in that order;
nothing else draws from that stream before the run: its prompts come from ShareGPT text and
Python's `random`), and get_request draws one exponential gap after each request it hands out.
build_workload does the same with one numpy RandomState(--seed): the random dataset's lengths,
then each request's (or conversation's) gap. The generated-shared-prefix dataset draws nothing
from numpy in SGLang either, so its gaps start at the stream's beginning there too. Prompt token
ids come from a separate random.Random(--seed) (they never share a prefix by accident)."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np


@dataclass
class BenchRequest:
    prompt_ids: List[int]
    output_len: int                      # may be 0 (SGLang's random lengths): prefill only
    prompt_text: Optional[str] = None    # the ids decoded, for the chat backend
    gap: float = 0.0                     # seconds between sending this one and the next


@dataclass
class Conversation:
    messages: List[List[int]]   # the user message of each turn (turn 0's includes the opening)
    output_len: int
    gap: float = 0.0            # seconds between starting this one and the next


# (requests, None) or (None, conversations)
Workload = Tuple[Optional[List[BenchRequest]], Optional[List[Conversation]]]


def _ids(rng: random.Random, n: int, lo: int, hi: int) -> List[int]:
    return [rng.randrange(lo, hi) for _ in range(n)]


def random_lengths(stream: np.random.RandomState, num: int, input_len: int, output_len: int,
                   range_ratio: float) -> Tuple[np.ndarray, np.ndarray]:
    """(input lengths, output lengths) of num requests, drawn from stream as SGLang's
    sample_random_requests draws them: inputs uniform in [max(int(input_len * range_ratio), 1),
    input_len], then outputs uniform in [int(output_len * range_ratio), output_len] (so 0 is
    possible below range ratio 1/output_len)."""
    inputs = stream.randint(max(int(input_len * range_ratio), 1), input_len + 1, size=num)
    outputs = stream.randint(int(output_len * range_ratio), output_len + 1, size=num)
    return inputs, outputs


def sample_random(rng, stream, num, input_len, output_len, range_ratio, lo,
                  hi) -> List[BenchRequest]:
    """num requests with random_lengths(stream, ...) and token ids uniform in [lo, hi) from rng."""
    inputs, outputs = random_lengths(stream, num, input_len, output_len, range_ratio)
    return [BenchRequest(_ids(rng, int(n_in), lo, hi), int(n_out))
            for n_in, n_out in zip(inputs, outputs)]


def set_gaps(items, stream: np.random.RandomState, request_rate: float) -> None:
    """Each item's gap: one stream.exponential(1 / request_rate) per item, in order, as SGLang's
    get_request draws them (after handing out each request); all 0 for an infinite rate."""
    for item in items:
        item.gap = float(stream.exponential(1.0 / request_rate)) \
            if math.isfinite(request_rate) else 0.0


def sample_shared_prefix(rng, num_groups, per_group, system_len, question_len, output_len, order,
                         lo, hi) -> List[BenchRequest]:
    """num_groups x per_group prompts = group system prompt + own question. order: interleaved
    (round-robin over groups: the cache-unfriendly arrival order), grouped, or shuffled."""
    systems = [_ids(rng, system_len, lo, hi) for _ in range(num_groups)]
    groups = [[BenchRequest(systems[g] + _ids(rng, question_len, lo, hi), output_len)
               for _ in range(per_group)] for g in range(num_groups)]
    if order == "grouped":
        return [r for g in groups for r in g]
    out = [groups[g][j] for j in range(per_group) for g in range(num_groups)]
    if order == "shuffled":
        rng.shuffle(out)
    return out


def sample_conversations(rng, num, turns, first_len, message_len, output_len, lo, hi):
    return [Conversation([_ids(rng, first_len, lo, hi)] +
                         [_ids(rng, message_len, lo, hi) for _ in range(turns - 1)], output_len)
            for _ in range(num)]


def token_range(args, vocab_size: int) -> Tuple[int, int]:
    """[--token-id-low, min(vocab, --token-id-high)); ValueError when empty."""
    lo = args.token_id_low
    hi = min(vocab_size, args.token_id_high) if args.token_id_high else vocab_size
    if not lo < hi:
        raise ValueError(f"token id range [{lo}, {hi}) is empty; change --token-id-low/--token-id-high")
    return lo, hi


def build_workload(args, vocab_size: int, tokenizer=None) -> Workload:
    """args.dataset's workload with its arrival gaps (--request-rate), seeded by args.seed as
    the module doc says. tokenizer (needed for --backend chat): decodes each prompt to
    prompt_text. ValueError for a combination that cannot run."""
    rng = random.Random(args.seed)
    stream = np.random.RandomState(args.seed)        # SGLang: np.random.seed(args.seed)
    lo, hi = token_range(args, vocab_size)
    if args.dataset == "multi-turn":
        if args.backend != "generate":
            raise ValueError("--dataset multi-turn needs --backend generate (it replays output ids)")
        conversations = sample_conversations(rng, args.num_prompts, args.mt_turns,
                                             args.mt_first_len, args.mt_message_len,
                                             args.mt_output_len, lo, hi)
        set_gaps(conversations, stream, args.request_rate)
        return None, conversations
    if args.dataset == "random":
        requests = sample_random(rng, stream, args.num_prompts, args.random_input_len,
                                 args.random_output_len, args.random_range_ratio, lo, hi)
    else:
        requests = sample_shared_prefix(rng, args.gsp_num_groups, args.gsp_prompts_per_group,
                                        args.gsp_system_prompt_len, args.gsp_question_len,
                                        args.gsp_output_len, args.gsp_order, lo, hi)
    set_gaps(requests, stream, args.request_rate)
    if args.backend == "chat":
        add_text(requests, tokenizer)
    return requests, None


def describe(args, workload: Workload) -> Dict:
    """What the workload is, for the result file ("workload") and describe_line: dataset,
    seed, request (and conversation) counts, token totals, how lengths and arrivals were
    drawn."""
    requests, conversations = workload
    d: Dict = {"dataset": args.dataset, "seed": args.seed}
    if requests is not None:
        d.update(num_requests=len(requests),
                 total_input_tokens=sum(len(r.prompt_ids) for r in requests),
                 total_output_tokens=sum(r.output_len for r in requests))
    else:   # later turns' prompts grow by the answers: only the new messages are known ahead
        d.update(num_conversations=len(conversations), turns=args.mt_turns,
                 num_requests=len(conversations) * args.mt_turns,
                 total_message_tokens=sum(len(m) for c in conversations for m in c.messages),
                 total_output_tokens=sum(c.output_len * len(c.messages) for c in conversations))
    if args.dataset == "random":
        ratio = args.random_range_ratio
        d["random_range_ratio"] = ratio
        d["lengths"] = (
            f"as SGLang's bench_serving draws them: numpy RandomState({args.seed}).randint, "
            f"input uniform in [{max(int(args.random_input_len * ratio), 1)}, "
            f"{args.random_input_len}], then output uniform in "
            f"[{int(args.random_output_len * ratio)}, {args.random_output_len}]")
    rate = args.request_rate
    d["arrivals"] = ("all at once (request rate inf)" if not math.isfinite(rate) else
                     f"Poisson, {rate:g} per second: one numpy exponential gap per "
                     f"{'request' if requests is not None else 'conversation'} from the same "
                     f"RandomState({args.seed}) after the lengths, as SGLang's get_request")
    return d


def describe_line(d: Dict) -> str:
    """describe()'s dict in one line, e.g. "workload: random, 200 requests, 103,005 input /
    105,408 output tokens; lengths as SGLang's bench_serving draws them (range ratio 0.0,
    seed 1)"."""
    if "num_conversations" in d:
        line = (f"workload: {d['dataset']}, {d['num_conversations']:,} conversations x "
                f"{d['turns']} turns, {d['total_message_tokens']:,} message / "
                f"{d['total_output_tokens']:,} output tokens")
    else:
        line = (f"workload: {d['dataset']}, {d['num_requests']:,} requests, "
                f"{d['total_input_tokens']:,} input / {d['total_output_tokens']:,} output tokens")
    if "lengths" in d:
        line += (f"; lengths as SGLang's bench_serving draws them (range ratio "
                 f"{d['random_range_ratio']}, seed {d['seed']})")
    return line + f"; arrivals {d['arrivals'].split(':')[0]}"


def add_text(requests: List[BenchRequest], tokenizer) -> None:
    """Set each request's prompt_text to its ids decoded (tokenizer.decode(ids) -> str)."""
    if tokenizer is None:
        raise ValueError("--backend chat sends text: pass --tokenizer PATH (or serve a model "
                         "directory this machine can read) to decode the prompts")
    for r in requests:
        r.prompt_text = tokenizer.decode(r.prompt_ids)


def head(workload: Workload, n: int) -> Workload:
    """The first n requests (or conversations) of a workload."""
    requests, conversations = workload
    return (requests[:n] if requests is not None else None,
            conversations[:n] if conversations is not None else None)


def size(workload: Workload) -> int:
    requests, conversations = workload
    return len(requests if requests is not None else conversations)
