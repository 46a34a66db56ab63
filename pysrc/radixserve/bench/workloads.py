"""The workloads of `radixserve bench serving`: prompts as token ids drawn from [lo, hi), so
their lengths and overlaps are exact and no tokenizer is needed (the chat backend decodes them
to text once, before the run)."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import List, Optional, Tuple


@dataclass
class BenchRequest:
    prompt_ids: List[int]
    output_len: int
    prompt_text: Optional[str] = None    # the ids decoded, for the chat backend


@dataclass
class Conversation:
    messages: List[List[int]]   # the user message of each turn (turn 0's includes the opening)
    output_len: int


# (requests, None) or (None, conversations)
Workload = Tuple[Optional[List[BenchRequest]], Optional[List[Conversation]]]


def _ids(rng: random.Random, n: int, lo: int, hi: int) -> List[int]:
    return [rng.randrange(lo, hi) for _ in range(n)]


def sample_random(rng, num, input_len, output_len, range_ratio, lo, hi) -> List[BenchRequest]:
    """Lengths uniform in [len * range_ratio, len]; token ids uniform in [lo, hi)."""
    out = []
    for _ in range(num):
        n_in = rng.randint(max(1, int(input_len * range_ratio)), input_len)
        n_out = rng.randint(max(1, int(output_len * range_ratio)), output_len)
        out.append(BenchRequest(_ids(rng, n_in, lo, hi), n_out))
    return out


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
    """args.dataset's workload (seeded by args.seed). tokenizer (needed for --backend chat):
    decodes each prompt to prompt_text. ValueError for a combination that cannot run."""
    rng = random.Random(args.seed)
    lo, hi = token_range(args, vocab_size)
    if args.dataset == "multi-turn":
        if args.backend != "generate":
            raise ValueError("--dataset multi-turn needs --backend generate (it replays output ids)")
        return None, sample_conversations(rng, args.num_prompts, args.mt_turns, args.mt_first_len,
                                          args.mt_message_len, args.mt_output_len, lo, hi)
    if args.dataset == "random":
        requests = sample_random(rng, args.num_prompts, args.random_input_len,
                                 args.random_output_len, args.random_range_ratio, lo, hi)
    else:
        requests = sample_shared_prefix(rng, args.gsp_num_groups, args.gsp_prompts_per_group,
                                        args.gsp_system_prompt_len, args.gsp_question_len,
                                        args.gsp_output_len, args.gsp_order, lo, hi)
    if args.backend == "chat":
        add_text(requests, tokenizer)
    return requests, None


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
