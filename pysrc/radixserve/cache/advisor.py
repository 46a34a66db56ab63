"""The prefix-cache advisor: families of prompts that share a start, diverge in a short varying
span (a timestamp, a user name, a request id) and then share a long text again, and what moving
that span after the shared text would save. Pure: token ids in, numbers out (and, given a
decoder, text); no server, engine or torch imports. `radixserve advise` and /dashboard/advice
(server/dashboard.py) print and serve `advise`'s report.

Terms. A family is a set of prompts of one key space (`PromptSample.group`: a cache salt's
prompts never share KV with another's) that
  * share their first `divergence` tokens (the shared part P) and no more: at that position at
    least two members differ (the divergence position, exact);
  * continue, each at its own offset o_j after P, with a common run of at least `min_tail`
    tokens (the tail T), found in at least `support` of the members (the covered ones), none
    of whose spans is longer than T (a longer "span" is a text of its own, e.g. the system
    prompts of sub-families before a shared question template, not a varying value).
Member j is then P + V_j + T + R_j, where V_j (o_j tokens, possibly none) is its varying span.
Reordered, it would be P + T + V_j + R_j: P + T becomes shared, and the KV of T is held once
instead of once per distinct V_j.

How families are found. Families are searched at every branch of the sample's trie that has at
least `min_members` prompts below it (members are sorted, so a set's shared prefix is that of
its smallest and largest member and the branch below is a split by the next token); at a
branch, T is searched by anchors: every `anchor`-token run of a reference member within
`max_span` tokens of the divergence is looked up in the other members' same window, and the
longest run that at least `support` of the members continue with wins (score: tail length x
covered members - 1). Work is bounded by the sample: every token sequence is packed once into
bytes (8 big-endian bytes a token, so that bytes order is token order), shared prefixes are
found by binary search over byte slices, and at most `max_families` candidates are scored.

Hit estimates simulate an unbounded prefix cache over the sample, in arrival order: a prompt's
cached tokens are its longest common prefix with any earlier prompt of its group, at most
len - 1 (the last prompt token is always computed) and in whole pages. Eviction and the output
tokens that a finished request also publishes are not modelled. For each family the report has
  * observed_hit_rate: what the server served its members (PromptSample.cached, counted at
    their first admission: the cache's state before the sample counts too);
  * current_hit_rate: the simulation of the sample as it is;
  * estimated_hit_rate: the same simulation with the family's covered members reordered;
  * tokens_saved: estimated minus current simulated hit tokens over the sample (the ranking).
`overall` applies the best non-overlapping suggestions together.
"""
from __future__ import annotations

import bisect
import dataclasses
import math
import sys
from array import array
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

TOKEN_BYTES = 8              # a packed token: 8 big-endian bytes (ids < 2**64)
TEXT_TOKENS = 48             # tokens of a decoded excerpt (each side of an ellipsis)
MAX_EXAMPLES = 8             # varying spans shown per family
MAX_ANCHORS = 1_000_000      # anchor positions indexed per group (the search's work bound)


@dataclasses.dataclass(frozen=True)
class PromptSample:
    """One prompt as the server saw it: `ids` its token ids (unsalted), `cached` the prompt
    tokens the prefix cache served at its first admission, `group` its key space (the cache
    salt's offset, 0 for none; prompts of different groups never share a prefix)."""
    ids: Sequence[int]
    cached: int = 0
    group: Hashable = 0


@dataclasses.dataclass(frozen=True)
class AdvisorParams:
    """min_members: prompts a family needs (covered ones, >= 2). min_tail: tokens its shared
    tail needs. max_span: the longest varying span looked at (tokens). support: the share of a
    family's prompts that must continue with the tail, in (0, 1]. anchor: tokens of the runs
    used to find the tail. max_prompt_tokens: tokens of each prompt looked at (its start).
    max_families: candidates scored. page_size: the cache's page (hits in whole pages)."""
    min_members: int = 3
    min_tail: int = 16
    max_span: int = 64
    support: float = 0.75
    anchor: int = 4
    max_prompt_tokens: int = 8192
    max_families: int = 12
    page_size: int = 1

    def check(self) -> None:
        """Raise ValueError naming the bad parameter."""
        if self.min_members < 2:
            raise ValueError(f"min_members must be >= 2, not {self.min_members}")
        if self.min_tail < 1:
            raise ValueError(f"min_tail must be >= 1 token, not {self.min_tail}")
        if self.max_span < 0:
            raise ValueError(f"max_span must be >= 0 tokens, not {self.max_span}")
        if not 0 < self.support <= 1:
            raise ValueError(f"support must be in (0, 1], not {self.support}")
        if self.anchor < 1:
            raise ValueError(f"anchor must be >= 1 token, not {self.anchor}")
        if self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, not {self.max_prompt_tokens}")
        if self.max_families < 1:
            raise ValueError(f"max_families must be >= 1, not {self.max_families}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, not {self.page_size}")


# --------------------------------------------------------------------------- packed tokens

def pack(ids: Sequence[int]) -> bytes:
    """ids as 8 big-endian bytes each: bytes order is the ids' lexicographic order, and a common
    prefix of b bytes is one of b // 8 tokens."""
    try:
        a = array("Q", ids)
    except (OverflowError, TypeError):
        raise ValueError("token ids must be integers in [0, 2**64)") from None
    if sys.byteorder == "little":
        a.byteswap()
    return a.tobytes()


def unpack(b: bytes) -> List[int]:
    a = array("Q")
    a.frombytes(b)
    if sys.byteorder == "little":
        a.byteswap()
    return a.tolist()


def ntokens(b: bytes) -> int:
    return len(b) // TOKEN_BYTES


def common_prefix(a: bytes, b: bytes, ia: int = 0, ib: int = 0) -> int:
    """Tokens a[ia:] and b[ib:] (token offsets) share from their starts: galloping, then binary
    search over slice comparisons (each a memcmp)."""
    w = TOKEN_BYTES
    n = min(ntokens(a) - ia, ntokens(b) - ib)
    if n <= 0:
        return 0
    oa, ob = ia * w, ib * w
    hi = 1
    while hi < n and a[oa:oa + hi * w] == b[ob:ob + hi * w]:
        hi *= 2
    hi = min(hi, n)
    lo = hi // 2 if hi > 1 else 0      # a common prefix of lo tokens is known
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[oa:oa + mid * w] == b[ob:ob + mid * w]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def simulate_cached(seqs: Sequence[bytes], page_size: int = 1) -> List[int]:
    """The cached tokens of each packed prompt under an unbounded prefix cache that saw the
    earlier ones (module docstring): its longest common prefix with any earlier prompt (that
    of its neighbours in sorted order), at most len - 1, in whole pages."""
    seen: List[bytes] = []
    out: List[int] = []
    for s in seqs:
        i = bisect.bisect_left(seen, s)
        best = 0
        if i < len(seen):
            best = common_prefix(s, seen[i])
        if i > 0:
            best = max(best, common_prefix(s, seen[i - 1]))
        best = min(best, ntokens(s) - 1)
        best -= best % page_size
        out.append(max(best, 0))
        if i == len(seen) or seen[i] != s:
            seen.insert(i, s)
    return out


# --------------------------------------------------------------------------- families

@dataclasses.dataclass
class Family:
    """A family of one group (module docstring). Indexes are into the group's prompts."""
    members: List[int]                 # every prompt below the branch, sample order
    divergence: int                    # P: tokens every member shares
    tail_len: int                      # T's tokens
    offsets: Dict[int, int]            # covered member -> its varying span's length o_j
    reference: int                     # the member T was taken from
    tail_at: int                       # T's offset after P in the reference
    score: int = 0

    def reordered(self, seq: bytes, member: int) -> bytes:
        """member's packed prompt with its varying span moved after T."""
        w, d, o, t = TOKEN_BYTES, self.divergence, self.offsets[member], self.tail_len
        return seq[:d * w] + seq[(d + o) * w:(d + o + t) * w] + seq[d * w:(d + o) * w] \
            + seq[(d + o + t) * w:]


def find_families(seqs: Sequence[bytes], params: AdvisorParams) -> Tuple[List[Family], bool]:
    """The families among packed prompts of one group, best candidates first (at most
    params.max_families of them), and whether the search stopped at MAX_ANCHORS (branches
    deeper in the sample's trie were not searched then)."""
    found: List[Family] = []
    stack: List[List[int]] = [[i for i, s in enumerate(seqs) if s]]
    budget = [MAX_ANCHORS]
    truncated = False
    while stack:
        members = stack.pop()
        if len(members) < params.min_members:
            continue
        if budget[0] <= 0:
            truncated = True
            break
        lo = min(members, key=seqs.__getitem__)
        hi = max(members, key=seqs.__getitem__)
        d = common_prefix(seqs[lo], seqs[hi])
        w = TOKEN_BYTES
        branches: Dict[bytes, List[int]] = {}
        for i in members:
            s = seqs[i]
            if len(s) > d * w:
                branches.setdefault(s[d * w:(d + 1) * w], []).append(i)
        if len(branches) >= 2:
            going_on = sorted(i for b in branches.values() for i in b)
            family = _family_at(seqs, going_on, d, params, budget)
            if family is not None:
                found.append(family)
        stack.extend(b for b in branches.values() if len(b) >= params.min_members)
    found.sort(key=lambda f: (-f.score, f.divergence, f.members[0]))
    return found[:params.max_families], truncated


def _family_at(seqs: Sequence[bytes], members: List[int], d: int,
               params: AdvisorParams, budget: List[int]) -> Optional[Family]:
    """The best tail after divergence position d shared by enough of members, or None.
    budget[0]: anchor positions the search may still index (decreased here)."""
    w, k = TOKEN_BYTES, params.anchor
    need = max(math.ceil(params.support * len(members)), params.min_members, 2)
    if need > len(members):
        return None
    windows: List[Dict[bytes, List[int]]] = []     # per member: anchor -> its offsets after P
    for i in members:
        s = seqs[i]
        grams: Dict[bytes, List[int]] = {}
        last = min(params.max_span, ntokens(s) - d - k)
        budget[0] -= max(last + 1, 0)
        for o in range(0, last + 1):
            at = (d + o) * w
            grams.setdefault(s[at:at + k * w], []).append(o)
        windows.append(grams)
    by_length = sorted(members, key=lambda i: len(seqs[i]))
    references = list(dict.fromkeys([members[0], by_length[len(by_length) // 2], members[-1]]))
    best: Optional[Family] = None
    for ref in references:
        r = seqs[ref]
        last = min(params.max_span, ntokens(r) - d - k)
        at = 0
        last = min(last, ntokens(r) - d - params.min_tail)   # room for a tail after it
        while at <= last:
            gram = r[(d + at) * w:(d + at + k) * w]
            present = [(i, grams[gram]) for i, grams in zip(members, windows) if gram in grams]
            if len(present) < need:
                at += 1
                continue
            runs: List[Tuple[int, int, int]] = []          # (run, member, its offset)
            for i, offsets in present:
                run, o = max((common_prefix(r, seqs[i], d + at, d + o), o) for o in offsets)
                runs.append((run, i, o))
            runs.sort(key=lambda x: -x[0])
            tail = runs[need - 1][0]
            if tail < params.min_tail:
                at += 1
                continue
            # a member's span is at most the tail it would move behind: a longer "span" is
            # a text of its own (a sub-family's), not a varying value
            covered = {i: o for run, i, o in runs if run >= tail and o <= tail}
            score = tail * (len(covered) - 1)
            if len(covered) >= need and (best is None or score > best.score):
                best = Family(members=list(members), divergence=d, tail_len=tail,
                              offsets=covered, reference=ref, tail_at=at, score=score)
            # a later anchor inside this run gives a suffix of it, later in every member:
            # a shorter tail behind longer spans, never better
            at += tail
    return best


# --------------------------------------------------------------------------- the report

def _excerpt(decode: Callable[[Sequence[int]], str], ids: Sequence[int],
             head: int = TEXT_TOKENS, tail: int = TEXT_TOKENS) -> str:
    """ids decoded; longer than head + tail tokens: the first head and last tail with an
    ellipsis between (tail=0: the first head only)."""
    ids = list(ids)
    if len(ids) <= head + tail:
        return decode(ids)
    return decode(ids[:head]) + " \u2026 " + (decode(ids[-tail:]) if tail else "")


@dataclasses.dataclass
class _Group:
    samples: List[int]                 # indexes into the caller's sample
    seqs: List[bytes]


def advise(samples: Sequence[PromptSample], decode: Optional[Callable[[Sequence[int]], str]] = None,
           params: Optional[AdvisorParams] = None, show_text: bool = True) -> Dict[str, Any]:
    """The report (a JSON-ready dict): `suggestions` ranked by tokens_saved (each a family:
    where it diverges, its varying spans, its tail, its hit rates; decoded text when `decode`
    is given and show_text), and `overall`. samples: in arrival order. Raises ValueError for
    bad params."""
    params = params or AdvisorParams()
    params.check()
    groups: Dict[Hashable, _Group] = {}
    for n, sample in enumerate(samples):
        try:
            packed = pack(sample.ids[:params.max_prompt_tokens])
        except ValueError as e:
            raise ValueError(f"prompt {n}: {e}") from None
        g = groups.setdefault(sample.group, _Group([], []))
        g.samples.append(n)
        g.seqs.append(packed)
    text = decode is not None and show_text
    suggestions: List[Dict[str, Any]] = []
    chosen: Dict[Hashable, Dict[int, bytes]] = {}    # group -> member -> reordered prompt
    truncated = False
    current_total = 0
    group_current: Dict[Hashable, List[int]] = {}
    for key, g in groups.items():
        current = simulate_cached(g.seqs, params.page_size)
        group_current[key] = current
        current_total += sum(current)
        ranked = []
        families, cut = find_families(g.seqs, params)
        truncated = truncated or cut
        for family in families:
            cur = sum(current[m] for m in family.members)
            est = _estimate(g.seqs, family, current, params.page_size)
            if est - cur <= 0:
                continue
            ranked.append((est - cur, family))
        taken: Dict[int, bytes] = {}
        for saved, family in sorted(ranked, key=lambda x: -x[0]):
            if not taken.keys() & set(family.members):
                taken.update({m: family.reordered(g.seqs[m], m) for m in family.offsets})
            report = _family_report(samples, g, family, current, saved, params, text, decode)
            report["salted"] = key != 0
            if key != 0:                # a tenant's prompts: no text (server/dashboard.py)
                _drop_text(report)
            suggestions.append(report)
        chosen[key] = taken
    suggestions.sort(key=lambda s: (-s["tokens_saved"], s["divergence"]))
    for rank, s in enumerate(suggestions, 1):
        s["rank"] = rank
    prompt_tokens = sum(len(g.seqs[i]) // TOKEN_BYTES for g in groups.values()
                        for i in range(len(g.seqs)))
    with_all = 0
    for key, g in groups.items():
        taken = chosen[key]
        if taken:
            seqs = [taken.get(i, s) for i, s in enumerate(g.seqs)]
            with_all += sum(simulate_cached(seqs, params.page_size))
        else:
            with_all += sum(group_current[key])
    observed = sum(min(s.cached, len(s.ids), params.max_prompt_tokens) for s in samples)
    return {
        "prompts": len(samples),
        "prompt_tokens": prompt_tokens,
        "params": dataclasses.asdict(params),
        "show_text": text,
        "search_truncated": truncated,
        "overall": {
            "observed_hit_rate": _rate(observed, prompt_tokens),
            "current_hit_rate": _rate(current_total, prompt_tokens),
            "estimated_hit_rate": _rate(with_all, prompt_tokens),
            "tokens_saved": with_all - current_total,
        },
        "suggestions": suggestions,
    }


def _estimate(seqs: Sequence[bytes], family: Family, current: List[int], page_size: int) -> int:
    """The hit tokens of family's members with its covered ones reordered, the rest of the
    group as it is. Only the members need simulating: every other prompt of the group shares
    less than the divergence position with them (it is not below the branch) or is exactly P,
    and a reordering keeps P, so a member's longest match among earlier prompts is one with an
    earlier member, except for the first member, whose match (with a non-member, at most P)
    is the current one."""
    members = family.members          # in sample order
    reordered = [family.reordered(seqs[m], m) if m in family.offsets else seqs[m]
                 for m in members]
    simulated = simulate_cached(reordered, page_size)
    return current[members[0]] + sum(simulated[1:])


def _rate(hits: int, total: int) -> Optional[float]:
    return hits / total if total else None


def _family_report(samples: Sequence[PromptSample], g: _Group, family: Family,
                   current: List[int], saved: int, params: AdvisorParams, text: bool,
                   decode: Optional[Callable[[Sequence[int]], str]]) -> Dict[str, Any]:
    d, t = family.divergence, family.tail_len
    members = family.members
    tokens = sum(ntokens(g.seqs[m]) for m in members)
    observed = sum(min(samples[g.samples[m]].cached, ntokens(g.seqs[m])) for m in members)
    cur = sum(current[m] for m in members)
    spans: Dict[bytes, int] = {}
    for m, o in family.offsets.items():
        span = g.seqs[m][d * TOKEN_BYTES:(d + o) * TOKEN_BYTES]
        spans[span] = spans.get(span, 0) + 1
    lengths = sorted(family.offsets.values())
    ref = g.seqs[family.reference]
    tail_ids = unpack(ref[(d + family.tail_at) * TOKEN_BYTES:(d + family.tail_at + t) * TOKEN_BYTES])
    report: Dict[str, Any] = {
        "members": len(members),
        "covered": len(family.offsets),
        "sample_indexes": [g.samples[m] for m in members],
        "divergence": d,
        "branches": len({g.seqs[m][d * TOKEN_BYTES:(d + 1) * TOKEN_BYTES] for m in members}),
        "distinct_spans": len(spans),
        "span_tokens": {"min": lengths[0], "max": lengths[-1]},
        "tail_tokens": t,
        "tail_starts": {"min": d + lengths[0], "max": d + lengths[-1]},
        "prompt_tokens": tokens,
        "observed_hit_rate": _rate(observed, tokens),
        "current_hit_rate": _rate(cur, tokens),
        "estimated_hit_rate": _rate(cur + saved, tokens),
        "tokens_saved": saved,
        # the tail is held once per distinct span now; once after the reordering
        "kv_tokens_duplicated": (len(spans) - 1) * t,
        "suggestion": (f"move the varying span at token {d} ({lengths[0]}-{lengths[-1]} tokens, "
                       f"{len(spans)} distinct) after the {t} shared tokens that follow it"),
    }
    if text:
        shared = unpack(ref[:d * TOKEN_BYTES])
        report["shared_text"] = _excerpt(decode, shared, head=16, tail=TEXT_TOKENS)
        report["before_text"] = decode(shared[-16:])
        examples = sorted(spans.items(), key=lambda x: (-x[1], x[0]))[:MAX_EXAMPLES]
        report["varying"] = [{"text": _excerpt(decode, unpack(span), head=24, tail=8),
                              "tokens": ntokens(span), "prompts": count}
                             for span, count in examples]
        report["tail_text"] = _excerpt(decode, tail_ids, head=TEXT_TOKENS, tail=16)
    return report


def _drop_text(report: Dict[str, Any]) -> None:
    for key in ("shared_text", "before_text", "varying", "tail_text"):
        report.pop(key, None)


# --------------------------------------------------------------------------- as text

def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def format_report(report: Dict[str, Any]) -> str:
    """`advise`'s report (as served by /dashboard/advice) as lines of text for a terminal."""
    o = report.get("overall", {})
    lines = [f"{report.get('prompts', 0)} recent prompts, {report.get('prompt_tokens', 0)} "
             f"tokens: prefix-cache hit rate observed {_pct(o.get('observed_hit_rate'))}, "
             f"simulated {_pct(o.get('current_hit_rate'))}, with the suggestions below "
             f"{_pct(o.get('estimated_hit_rate'))} ({o.get('tokens_saved', 0)} prompt tokens "
             f"saved)"]
    suggestions = report.get("suggestions") or []
    if not suggestions:
        lines.append("no family of prompts with a varying span before a shared text was found")
    for s in suggestions:
        lines.append("")
        lines.append(f"#{s['rank']}: {s['members']} prompts ({s['covered']} with the shared "
                     f"tail), diverging at token {s['divergence']} into {s['distinct_spans']} "
                     f"distinct spans of {s['span_tokens']['min']}-{s['span_tokens']['max']} "
                     f"tokens, then {s['tail_tokens']} shared tokens")
        lines.append(f"    hit rate: observed {_pct(s['observed_hit_rate'])}, simulated "
                     f"{_pct(s['current_hit_rate'])}, if reordered {_pct(s['estimated_hit_rate'])}"
                     f"; saves {s['tokens_saved']} prompt tokens over the sample and "
                     f"{s['kv_tokens_duplicated']} duplicated KV tokens")
        lines.append(f"    {s['suggestion']}")
        if "shared_text" in s:
            lines.append(f"    shared:  {s['shared_text']!r}")
            for v in s["varying"]:
                lines.append(f"    varying: {v['text']!r} ({v['prompts']} prompts)")
            lines.append(f"    tail:    {s['tail_text']!r}")
        elif s.get("salted"):
            lines.append("    (cache-salted prompts: text not shown)")
    return "\n".join(lines)
