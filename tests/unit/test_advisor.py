"""cache/advisor.py: packed-token prefixes, the cache simulation (against brute force), family
detection (exact divergence, spans, tail, support), estimates (against a brute-force
simulation of the reordered prompts), ranking, key spaces, text and its absence, the
terminal report, and bad input."""
import random

import pytest

from radixserve.cache import advisor
from radixserve.cache.advisor import AdvisorParams, PromptSample, advise, pack


def lcp(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def brute_cached(prompts, page_size=1):
    """Each prompt's cached tokens under an unbounded cache of the earlier ones."""
    out = []
    for i, p in enumerate(prompts):
        best = max((lcp(p, q) for q in prompts[:i]), default=0)
        best = max(min(best, len(p) - 1), 0)
        out.append(best - best % page_size)
    return out


def decode(ids):
    return " ".join(f"t{t}" for t in ids)


# --------------------------------------------------------------------------- primitives

def test_common_prefix_and_packed_order_agree_with_lists():
    rng = random.Random(1)
    seqs = [[rng.randrange(3) << rng.choice([0, 9, 40, 62]) for _ in range(rng.randrange(0, 30))]
            for _ in range(200)]
    for a, b in zip(seqs, seqs[1:]):
        ia, ib = rng.randrange(len(a) + 1), rng.randrange(len(b) + 1)
        assert advisor.common_prefix(pack(a), pack(b), ia, ib) == lcp(a[ia:], b[ib:])
        assert advisor.unpack(pack(a)) == a
    assert sorted(seqs) == [advisor.unpack(p) for p in sorted(pack(s) for s in seqs)]


@pytest.mark.parametrize("page_size", [1, 4])
def test_simulation_matches_brute_force(page_size):
    rng = random.Random(page_size)
    prompts = [[rng.randrange(3) for _ in range(rng.randrange(1, 25))] for _ in range(150)]
    prompts += [list(p) for p in prompts[:20]]          # exact repeats: len - 1 at most
    assert advisor.simulate_cached([pack(p) for p in prompts], page_size) == \
        brute_cached(prompts, page_size)


# --------------------------------------------------------------------------- families

def workload(rng, families=4, per_family=8, span=(2, 5), prefix_len=20, tail_len=60):
    """(prompts, [(prefix, tail, [span per member], [member indexes])]) of families whose
    members are prefix + span + tail + question, interleaved; every span starts with its own
    token and ends with one no other span of its family ends with."""
    fams, prompts = [], []
    for f in range(families):
        prefix = [1000 + 100 * f + i for i in range(prefix_len)]
        tail = [5000 + 100 * f + i for i in range(tail_len)]
        spans = []
        for m in range(per_family):
            n = rng.randint(*span)
            spans.append([10000 + 1000 * f + 100 * m + j for j in range(n)])
        fams.append((prefix, tail, spans, []))
    for m in range(per_family):
        for f, (prefix, tail, spans, members) in enumerate(fams):
            question = [30000 + 1000 * f + 50 * m + j for j in range(rng.randint(5, 12))]
            members.append(len(prompts))
            prompts.append(prefix + spans[m] + tail + question)
    return prompts, fams


def reorder(prompt, d, span_len, tail_len):
    return prompt[:d] + prompt[d + span_len:d + span_len + tail_len] + prompt[d:d + span_len] \
        + prompt[d + span_len + tail_len:]


def test_four_families_exact_positions_spans_and_estimates():
    rng = random.Random(7)
    prompts, fams = workload(rng)
    report = advise([PromptSample(p) for p in prompts], decode)
    by_members = {tuple(s["sample_indexes"]): s for s in report["suggestions"]}
    all_reordered = list(prompts)
    for prefix, tail, spans, members in fams:
        s = by_members[tuple(members)]
        assert s["divergence"] == len(prefix)
        assert s["tail_tokens"] == len(tail)
        assert s["covered"] == s["members"] == len(members) == s["distinct_spans"]
        assert {v["text"] for v in s["varying"]} == {decode(sp) for sp in spans}
        assert s["span_tokens"] == {"min": min(map(len, spans)), "max": max(map(len, spans))}
        # the estimate is the simulation of exactly this reordering (brute force here)
        reordered = list(prompts)
        for m, sp in zip(members, spans):
            reordered[m] = reorder(prompts[m], len(prefix), len(sp), len(tail))
            all_reordered[m] = reordered[m]
        cur, est = brute_cached(prompts), brute_cached(reordered)
        total = sum(len(prompts[m]) for m in members)
        assert s["current_hit_rate"] == pytest.approx(sum(cur[m] for m in members) / total)
        assert s["estimated_hit_rate"] == pytest.approx(sum(est[m] for m in members) / total)
        assert s["tokens_saved"] == sum(est[m] - cur[m] for m in members) > 0
        assert s["kv_tokens_duplicated"] == (len(members) - 1) * len(tail)
        assert s["shared_text"] == decode(prefix)
        assert s["tail_text"].startswith(decode(tail[:10]))
    assert len(report["suggestions"]) == 4
    total = sum(map(len, prompts))
    assert report["overall"]["estimated_hit_rate"] == pytest.approx(
        sum(brute_cached(all_reordered)) / total)
    assert report["overall"]["current_hit_rate"] == pytest.approx(sum(brute_cached(prompts)) / total)
    assert [s["rank"] for s in report["suggestions"]] == [1, 2, 3, 4]
    saved = [s["tokens_saved"] for s in report["suggestions"]]
    assert saved == sorted(saved, reverse=True)


def test_observed_hit_rate_is_what_the_server_served():
    prompts, fams = workload(random.Random(3), families=1)
    cached = [0, 5, 7, 7, 9, 20, 20, 20]
    report = advise([PromptSample(p, c) for p, c in zip(prompts, cached)])
    s = report["suggestions"][0]
    assert s["observed_hit_rate"] == pytest.approx(sum(cached) / sum(map(len, prompts)))
    assert report["overall"]["observed_hit_rate"] == pytest.approx(s["observed_hit_rate"])


def test_a_token_every_span_ends_with_joins_the_tail():
    prefix, tail = [1, 2, 3], list(range(100, 130))
    spans = [[50 + i, 60 + i, 99] for i in range(5)]          # each ends with token 99
    prompts = [prefix + sp + tail + [200 + i] for i, sp in enumerate(spans)]
    s = advise([PromptSample(p) for p in prompts], decode)["suggestions"][0]
    assert s["divergence"] == 3 and s["tail_tokens"] == len(tail) + 1
    assert {v["text"] for v in s["varying"]} == {decode(sp[:2]) for sp in spans}


def test_spans_sharing_their_first_tokens_diverge_after_them():
    prefix, tail = [7] * 4, list(range(300, 340))
    spans = [[11, 12, 20 + i] for i in range(6)]              # same first two tokens
    prompts = [prefix + sp + tail + [900 + i, 901] for i, sp in enumerate(spans)]
    s = advise([PromptSample(p) for p in prompts], decode)["suggestions"][0]
    assert s["divergence"] == 6 and s["span_tokens"] == {"min": 1, "max": 1}


def test_support_leaves_an_outlier_out_and_unchanged():
    prompts, fams = workload(random.Random(5), families=1, per_family=8)
    prefix, tail, spans, members = fams[0]
    odd = members[3]
    prompts[odd] = prefix + spans[3] + [77777] * 70              # no shared tail
    s = advise([PromptSample(p) for p in prompts])["suggestions"][0]
    assert s["members"] == 8 and s["covered"] == 7
    reordered = [reorder(p, len(prefix), len(sp), len(tail)) if m != odd else p
                 for m, (p, sp) in enumerate(zip(prompts, spans))]
    est = brute_cached(reordered)
    assert s["estimated_hit_rate"] == pytest.approx(sum(est) / sum(map(len, prompts)))
    strict = advise([PromptSample(p) for p in prompts], params=AdvisorParams(support=1.0))
    assert not any(x["members"] == 8 for x in strict["suggestions"])


def test_no_suggestion_without_a_shared_tail_or_below_the_thresholds():
    rng = random.Random(9)
    unrelated = [[rng.randrange(50000) for _ in range(60)] for _ in range(30)]
    assert advise([PromptSample(p) for p in unrelated])["suggestions"] == []
    prefix = list(range(20))
    diverging = [prefix + [rng.randrange(50000) for _ in range(60)] for _ in range(10)]
    assert advise([PromptSample(p) for p in diverging])["suggestions"] == []
    prompts, _ = workload(random.Random(2), families=1, per_family=2, tail_len=60)
    assert advise([PromptSample(p) for p in prompts])["suggestions"] == []      # 2 < 3 members
    assert advise([PromptSample(p) for p in prompts],
                  params=AdvisorParams(min_members=2))["suggestions"]
    prompts, _ = workload(random.Random(2), families=1, tail_len=10)
    assert advise([PromptSample(p) for p in prompts])["suggestions"] == []      # 10 < 16 tokens
    assert advise([PromptSample(p) for p in prompts],
                  params=AdvisorParams(min_tail=8))["suggestions"]
    prompts, _ = workload(random.Random(2), families=1, span=(70, 80))
    assert advise([PromptSample(p) for p in prompts])["suggestions"] == []      # span > 64
    prompts, _ = workload(random.Random(2), families=1, span=(30, 40), tail_len=25)
    assert advise([PromptSample(p) for p in prompts])["suggestions"] == []      # span > tail
    assert advise([], decode)["suggestions"] == []


def test_groups_never_mix_and_salted_reports_carry_no_text():
    prompts, fams = workload(random.Random(4), families=1)
    samples = [PromptSample(p, 0, 0) for p in prompts] + [PromptSample(p, 0, 12345) for p in prompts]
    report = advise(samples, decode)
    assert len(report["suggestions"]) == 2
    plain, salted = sorted(report["suggestions"], key=lambda s: s["salted"])
    assert plain["sample_indexes"] == list(range(8)) and "varying" in plain
    assert salted["sample_indexes"] == list(range(8, 16))
    assert not {"shared_text", "before_text", "varying", "tail_text"} & set(salted)
    # the second group's copies hit nothing of the first's
    assert salted["current_hit_rate"] == plain["current_hit_rate"]


def test_text_only_with_a_decoder_and_show_text():
    prompts, _ = workload(random.Random(6), families=1)
    samples = [PromptSample(p) for p in prompts]
    for report in (advise(samples), advise(samples, decode, show_text=False)):
        s = report["suggestions"][0]
        assert not report["show_text"]
        assert not {"shared_text", "before_text", "varying", "tail_text"} & set(s)
        text = advisor.format_report(report)
        assert "diverging at token 20" in text and "shared:" not in text and "t1000" not in text
    text = advisor.format_report(advise(samples, decode))
    assert "diverging at token 20" in text and "varying: 't10000" in text


def test_page_size_counts_whole_pages():
    prompts, fams = workload(random.Random(8), families=1)
    s = advise([PromptSample(p) for p in prompts], params=AdvisorParams(page_size=16))
    prefix, tail, spans, members = fams[0]
    reordered = [reorder(p, len(prefix), len(sp), len(tail)) for p, sp in zip(prompts, spans)]
    est = brute_cached(reordered, 16)
    assert s["suggestions"][0]["estimated_hit_rate"] == pytest.approx(
        sum(est) / sum(map(len, prompts)))


def test_bad_input_is_a_value_error():
    with pytest.raises(ValueError, match="min_members"):
        advise([], params=AdvisorParams(min_members=1))
    with pytest.raises(ValueError, match="support"):
        advise([], params=AdvisorParams(support=0))
    with pytest.raises(ValueError, match="prompt 1"):
        advise([PromptSample([1, 2]), PromptSample([-1])])
    with pytest.raises(ValueError, match="prompt 0"):
        advise([PromptSample([1 << 64])])


def test_the_search_stops_at_its_work_bound(monkeypatch):
    prompts, _ = workload(random.Random(1))
    monkeypatch.setattr(advisor, "MAX_ANCHORS", 50)
    report = advise([PromptSample(p) for p in prompts])
    assert report["search_truncated"] is True
    monkeypatch.setattr(advisor, "MAX_ANCHORS", 1_000_000)
    assert advise([PromptSample(p) for p in prompts])["search_truncated"] is False


def test_sub_families_before_a_shared_template_are_not_one_family():
    """Three system prompts (each a family of user names before its shared instructions),
    then one question template for all: the families are the three, at their name; the
    system prompts are not a 'varying span' before the question template."""
    rng = random.Random(11)
    head = [1, 2, 3]
    systems = [[100 * (s + 1) + i for i in range(rng.randint(8, 14))] for s in range(3)]
    instructions = [[2000 + 100 * s + i for i in range(20)] for s in range(3)]
    template = list(range(9000, 9020))
    prompts, where = [], []
    for n in range(36):
        s = n % 3
        name = [5000 + 10 * (n // 3 % 6)]
        prompts.append(head + systems[s] + name + instructions[s] + [7000 + n] + template)
        where.append(s)
    report = advise([PromptSample(p) for p in prompts])
    found = {s["divergence"] for s in report["suggestions"]}
    assert {len(head) + len(systems[s]) for s in range(3)} <= found
    assert len(head) not in found
